#!/usr/bin/env bash
# The GPU check (issue 12): real-size random models (SD3.5-Medium, Qwen2.5-VL-3B) through mmrl's trainer in bf16,
# one JSON line each with seconds per update and peak GPU memory. Under 8 minutes on one H100/H200-class GPU.
#   bash benchmarks/gpu_check.sh [gpu_check.py options]      # e.g. --only flow, --steps 3
# Runs unchanged on a fresh machine: installs mmrl with the README's command first (offline-safe afterwards).
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -e . -q
export HF_HUB_OFFLINE=1
exec python benchmarks/gpu_check.py "$@"
