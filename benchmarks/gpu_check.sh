#!/usr/bin/env bash
# The GPU check (issue 12): real-size random models (SD3.5-Medium, Qwen2.5-VL-3B) through mmrl's trainer in bf16,
# one JSON line each with seconds per update and peak GPU memory, then the VLM update again on DeepSpeed ZeRO-2
# (configs/accelerate/deepspeed_zero2.yaml, one process) where DeepSpeed installs. Under 8 minutes on one
# H100/H200-class GPU.
#   bash benchmarks/gpu_check.sh [gpu_check.py options]      # e.g. --only flow, --steps 3
# Runs unchanged on a fresh machine: installs mmrl with the README's command first (offline-safe afterwards); where
# pip cannot reach an index but mmrl and its dependencies are already importable, it goes on with those.
set -uo pipefail
cd "$(dirname "$0")/.."
# offline (a machine with no package index, its packages installed beforehand): carry on with what is installed
pip install -e ".[deepspeed]" -q || pip install -e . -q || python -c "import mmrl.build" || exit 1
export HF_HUB_OFFLINE=1
python benchmarks/gpu_check.py "$@"
status=$?
if python -c "import deepspeed" 2>/dev/null && python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml --num_processes 1 \
    benchmarks/gpu_check.py --only vlm "$@" || status=1
else
  echo '{"check": "deepspeed_zero2", "skipped": "DeepSpeed or CUDA not available"}'
fi
exit $status
