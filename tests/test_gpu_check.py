"""benchmarks/gpu_check.py without a GPU: the real-size models it builds have the published sizes (built on the
meta device: no memory, no weights), and its whole path (build, load through mmrl, time Trainer.step) runs with
the tiny models on CPU (``--smoke``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_the_flow_check_builds_sd35_medium_sizes():
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from mmrl.pipelines.flow.loading import resolve_pretrained

    transformer = gpu_check.build(SD3Transformer2DModel, gpu_check.SD35M_TRANSFORMER, "meta", torch.bfloat16)
    assert 2.2e9 < params(transformer) < 2.3e9  # SD3.5-Medium's MMDiT-X: 2.24B
    assert len(transformer.transformer_blocks) == 24
    assert sum(b.attn2 is not None for b in transformer.transformer_blocks) == 13  # dual attention, blocks 0-12
    assert 8.0e7 < params(gpu_check.build(AutoencoderKL, gpu_check.SD3_VAE, "meta", torch.bfloat16)) < 8.5e7
    tiny = Path(resolve_pretrained("tiny:sd3"))
    t5 = gpu_check.build(T5EncoderModel, gpu_check.text_encoder_config(T5Config, tiny / "text_encoder_3",
                                                                        gpu_check.T5_XXL), "meta", torch.bfloat16)
    assert 4.5e9 < params(t5) < 4.8e9 and t5.config.d_model == 4096  # T5-XXL's encoder
    clip_g = gpu_check.build(CLIPTextModelWithProjection,
                             gpu_check.text_encoder_config(CLIPTextConfig, tiny / "text_encoder_2", gpu_check.CLIP_G),
                             "meta", torch.bfloat16)
    # the pooled projections (768 + 1280) are what the transformer's pooled_projection_dim expects
    assert gpu_check.CLIP_L["projection_dim"] + clip_g.config.projection_dim == \
        gpu_check.SD35M_TRANSFORMER["pooled_projection_dim"]


def test_the_vlm_check_builds_qwen25_vl_3b_sizes():
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mmrl.pipelines.vlm.tiny import ensure_tiny_vlm

    model = gpu_check.build(Qwen2_5_VLForConditionalGeneration,
                            gpu_check.qwen25vl_3b_config(Path(ensure_tiny_vlm("qwen2_5_vl"))), "meta", torch.bfloat16)
    assert 3.7e9 < params(model) < 3.8e9  # Qwen2.5-VL-3B-Instruct: 3.75B
    vision = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    assert 6.5e8 < vision < 6.9e8
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight  # tied, as the 3B


def test_the_gpu_check_runs_end_to_end_on_cpu_with_the_tiny_models(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MMRL_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--warmup", "0",
                             "--steps", "1", "--vlm-new-tokens", "4", "--vlm-group", "2", "--flow-group", "2",
                             "--flow-prompts", "1", "--vlm-prompts", "1", "--vlm-cache", "dynamic", "static",
                             "--set", "model.use_lora=true", "model.lora_rank=4"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["check"] for line in lines] == ["flow_sd35m_size"] + ["vlm_qwen25vl_3b_size"] * 2, lines
    assert [line["kv_cache"] for line in lines[1:]] == ["dynamic", "static"]
    for line in lines[1:]:  # --set reached the VLM checks: LoRA rank 4 trains a small share of the model
        assert 0 < line["trainable_parameters"] < 0.05 * line["parameters"]["model"]
    for line in lines:
        assert line["seconds_per_update"] > 0 and line["samples_per_update"] == 2
        assert line["engine"] == "plain"
        assert line["trainable_parameters"] > 0 and line["peak_gpu_gib"] is None  # no GPU here
    for line in lines[1:]:
        assert 1 <= line["decode_steps"] <= 4 and line["ms_per_decode_step"] > 0  # at most 4 new tokens


def test_the_gpu_check_runs_on_deepspeed_under_its_accelerate_config(tmp_path):
    """What gpu_check.sh runs after the plain check: the VLM updates on the ZeRO-2 engine, launched with the shipped
    config (one process; DeepSpeed's CPU accelerator here)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MMRL_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                             str(ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml"), "--num_processes", "1",
                             "--main_process_port", "29593", str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke",
                             "--only", "vlm", "--warmup", "0", "--steps", "1", "--vlm-new-tokens", "4",
                             "--vlm-group", "2", "--vlm-prompts", "1"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(line["check"], line["engine"]) for line in lines] == [("vlm_qwen25vl_3b_size", "deepspeed_zero2")]
    assert lines[0]["seconds_per_update"] > 0 and lines[0]["trainable_parameters"] > 0


def test_without_a_gpu_the_full_check_says_so_and_passes():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the full check would run")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0
    assert json.loads(result.stdout.strip().splitlines()[-1])["skipped"].startswith("no CUDA device")
