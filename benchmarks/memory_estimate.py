#!/usr/bin/env python
"""Estimated peak GPU memory of the GPU recipes at their real sizes, on a machine without a GPU, and the memory
presets (24 / 80 / 141 GB cards) it picks.

Every model (SD3.5-Medium, FLUX.1-dev, Qwen2.5-VL-3B / 7B, with their text encoders, VAE and reward model) is
built at its published size on PyTorch's ``meta`` device (shapes and dtypes, no storage, no
arithmetic), and the recipe's two memory phases are run on it under a tracker of live tensor bytes
(:class:`LiveBytes`, a ``TorchDispatchMode`` that adds each new storage's size when an op creates it and subtracts
it when the storage is freed), the way ``torch.cuda.max_memory_allocated`` counts on a GPU:

* ``training``: one training micro-batch of the recipe as mmrl runs it (flows: ``train.batch_size`` samples x
  ``train.timestep_chunk`` trained steps x 2 CFG halves through the transformer in one forward; VLMs:
  ``train.batch_size`` completions of prompt + ``max_new_tokens`` tokens, log-probs of the completion from
  ``logits_to_keep`` logits in fp32, as :meth:`QwenVLPolicy.logprobs`), its backward and an AdamW step, with
  everything mmrl keeps resident: the frozen weights in the load dtype, trainable weights in fp32 with their
  gradients and two AdamW moments, the EMA shadows (``optim.ema``), a full fine-tune's frozen reference copy
  (``algorithm.beta > 0``), the text encoders and the VAE (flows), the reward model's weights (PickScore's and
  HPSv2's CLIP ViT-H-14) where the recipe uses it;
* ``rollout``: one sampling forward of ``train.sample_batch_size`` x 2 (CFG; FLUX.1-dev's guidance is an input)
  rows and the VAE decode of ``train.sample_batch_size`` images (flows), or one decoding step of
  ``prompts_per_step x group_size`` sequences with their whole KV cache at full length (VLMs), on the same resident
  weights and the AdamW moments of the previous update.

Attention is counted as a flash kernel (``flash_attention_2`` / SDPA's flash backend on a GPU: no ``L x L``
matrix is kept), by routing ``scaled_dot_product_attention`` to the CPU flash kernel, whose saved tensors are the
same (output and log-sum-exp). What is not counted: the CUDA context and cuBLAS / NCCL workspaces (about 0.5-1
GiB), the caching allocator's fragmentation (often 5-15 %), the reward model's activations (small next to the
policy's) and processes other than one. So the figures are estimates of the allocated peak; a preset keeps
``--headroom`` (default 15 %) of the card free for what is not counted. ``benchmarks/gpu_check.sh`` measures the
real peak on a GPU.

    python benchmarks/memory_estimate.py [--recipes NAME ...] [--cards 24 80 141] [--headroom 0.15] [--out PATH]
    python benchmarks/memory_estimate.py --config MY.yaml --model sd35m|flux_dev|qwen25vl_3b|qwen25vl_7b  # your own
    mmrl bench memory [same options]

Prints one JSON line per recipe: the recipe as shipped (peak per phase, with its parts) and, for each card, the
first preset of :data:`PRESETS` (ordered from fastest to leanest) whose estimated peak fits one process
(``one_process``, ``null`` when none does), and, where that is none or changes the fine-tune to LoRA, the recipe's
own method sharded with FSDP2 over the fewest of 2 / 4 / 8 processes that fits (``fsdp2``, from
:func:`sharded_peak`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LiveBytes, finish, versions  # noqa: E402
from gpu_check import (CLIP_G, CLIP_L, QWEN25VL_3B_TEXT, QWEN25VL_3B_VISION, SD3_VAE, SD35M_TRANSFORMER,  # noqa: E402
                       T5_XXL)

ROOT = Path(__file__).resolve().parent.parent
GIB = 2 ** 30
META = torch.device("meta")

#: Qwen2.5-VL-7B-Instruct's language model (config.json); its vision tower is the 3B's with a 3584 merger output
QWEN25VL_7B_TEXT = dict(QWEN25VL_3B_TEXT, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064)
#: PickScore_v1 / CLIP ViT-H-14 (the flow recipes' reward model): text and vision towers
CLIP_H_TEXT = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                   projection_dim=1024)
CLIP_H_VISION = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                     patch_size=14, image_size=224, projection_dim=1024)

#: the recipes estimated: the real-size model each is built for, its file and (VLMs) a typical prompt length in
#: tokens: a RefCOCO image (640 x 480 at Qwen2.5-VL's 28 px per merged token: 391) plus the question, and a
#: 30 s Charades-STA clip at 2 fps under Time-R1's video budget (total 3584 x 28 x 28 pixels: at most 3584 video
#: tokens; a 640 x 360 clip gets 30 frame pairs of 8 x 14 = 112) plus Time-R1's prompt, about 106 tokens
RECIPES = {
    "sd35m_flow_grpo_pickscore": ("sd35m", "configs/gpu/sd35m_flow_grpo_pickscore.yaml", None),
    "sd35m_flow_grpo_fast": ("sd35m", "configs/gpu/sd35m_flow_grpo_fast.yaml", None),
    "sd35m_dense_grpo": ("sd35m", "configs/gpu/sd35m_dense_grpo.yaml", None),
    "sd35m_tp_grpo": ("sd35m", "configs/gpu/sd35m_tp_grpo.yaml", None),
    "flux_dance_grpo_hps": ("flux_dev", "configs/gpu/flux_dance_grpo_hps.yaml", None),
    "qwen25vl3b_rec_grpo": ("qwen25vl_3b", "configs/gpu/qwen25vl3b_rec_grpo.yaml", 450),
    "qwen25vl7b_video_tg_grpo": ("qwen25vl_7b", "configs/gpu/qwen25vl7b_video_tg_grpo.yaml", 3690),
}
FLOW_SIZES = ("sd35m", "flux_dev")
#: FLUX.1-dev's transformer (black-forest-labs/FLUX.1-dev, transformer/config.json)
FLUX_DEV_TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                            guidance_embeds=True, axes_dims_rope=(16, 56, 56))
#: process counts tried for a sharded run (FSDP2) when no single-process preset fits a card
SHARDS = (2, 4, 8, 16)

#: candidate memory settings per family, fastest first (a card's preset is the first whose estimate fits):
#: ``batch_size`` (samples per training micro-batch; gradient accumulation is raised so that every optimizer step
#: sees the recipe's number of samples and the update stays the same), gradient checkpointing, the sampling batch,
#: and, for VLMs, LoRA on the language model as the last resort (a different fine-tune: the JSON line says so)
PRESETS = {
    "flow": [{}, {"batch_size": 3}, {"checkpointing": True}, {"checkpointing": True, "batch_size": 3,
                                                               "sample_batch_size": 8},
             {"checkpointing": True, "batch_size": 1, "sample_batch_size": 4}],
    "vlm": [{}, {"checkpointing": True}, {"checkpointing": True, "batch_size": 4}, {"lora": True},
            {"lora": True, "checkpointing": True, "batch_size": 4},
            {"lora": True, "checkpointing": True, "batch_size": 1}],
}


def preset_overrides(config, preset: dict) -> list[str] | None:
    """The config overrides of ``preset`` for ``config`` (``None`` when its batch size does not divide the samples of
    an optimizer step)."""
    t, out = config.train, []
    if "batch_size" in preset:
        per_step = t.batch_size * t.gradient_accumulation_steps
        if preset["batch_size"] >= t.batch_size:
            return None
        if per_step % preset["batch_size"]:
            return None
        out += [f"train.batch_size={preset['batch_size']}",
                f"train.gradient_accumulation_steps={per_step // preset['batch_size']}"]
    if preset.get("checkpointing"):
        out.append("model.gradient_checkpointing=true")
    if "sample_batch_size" in preset and preset["sample_batch_size"] < t.sample_batch_size:
        out.append(f"train.sample_batch_size={preset['sample_batch_size']}")
    if preset.get("lora"):
        out += ["model.use_lora=true", "model.lora_rank=64", "model.lora_alpha=128"]
    return out


def _flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` through the CPU flash kernel (on ``meta`` the dispatcher would pick the math
    backend and keep the ``L x L`` weights, which a GPU's flash kernel never holds)."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out[0]


@contextlib.contextmanager
def flash_attention():
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _flash_sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def on_meta(cls, config, dtype: torch.dtype):
    with META:
        model = cls(config) if not isinstance(config, dict) else cls(**config)
    return model.to(dtype).requires_grad_(False).eval()


def nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def make_trainable(model: torch.nn.Module, config, lora_targets: list[str] | None) -> torch.nn.Module:
    """The recipe's trainable weights as mmrl holds them, in fp32: LoRA adapters (PEFT) on ``lora_targets``, or
    every weight already marked trainable."""
    m = config.model
    if m.use_lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=0.0,
                                                 target_modules=lora_targets))
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return model


def resident(config, trainable_model: torch.nn.Module, others: list[torch.nn.Module]) -> list[torch.Tensor]:
    """Every tensor held through an update besides activations: the models' weights, the EMA shadows and a full
    fine-tune's reference copy (as new meta tensors of their size)."""
    tensors = [p for module in [trainable_model, *others] for p in module.parameters()]
    trainable = [p for p in trainable_model.parameters() if p.requires_grad]
    if config.optim.ema:
        tensors += [torch.empty_like(p) for p in trainable]
    if not config.model.use_lora and config.algorithm.beta > 0:
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(config.model.dtype, torch.float32)
        tensors += [torch.empty(p.shape, dtype=dtype, device=META) for p in trainable]
    return tensors


def reward_dtypes(config, name: str) -> list[torch.dtype]:
    """The load dtype of each of the recipe's rewards that is the reward model ``name`` (by key or by its
    ``reward:`` field): its ``kwargs.dtype``, float32 (the rewards' default) when not given."""
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    return [names.get(str((spec.get("kwargs") or {}).get("dtype", "float32") if isinstance(spec, dict) else "float32"),
                      torch.float32)
            for key, spec in config.rewards.items()
            if key == name or (isinstance(spec, dict) and spec.get("reward") == name)]


def trained_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def train_and_step(tracker: LiveBytes, model: torch.nn.Module, loss_fn) -> None:
    """One forward + backward + AdamW step (moments created at the first step, as on a GPU). Traced as the
    multi-tensor (foreach) AdamW: the fused kernel the loop uses on CUDA does not run on the meta device, and it
    holds no temporary copy of the weights, so this is an upper bound at the step."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6, foreach=True)
    model.train()
    loss_fn().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()


def estimate_flow(config, size: str) -> dict:
    """Peak bytes of an SD3.5-Medium- or FLUX.1-dev-sized flow recipe's training and rollout phases (module
    docstring)."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel, SD3Transformer2DModel
    from transformers import (CLIPConfig, CLIPModel, CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection,
                              T5Config, T5EncoderModel)

    from mmrl.pipelines.flow.flux import FluxFamily
    from mmrl.pipelines.flow.sd3 import SD3Family

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(config.model.dtype, torch.float32)
    flux = size == "flux_dev"
    transformer = on_meta(FluxTransformer2DModel, FLUX_DEV_TRANSFORMER, dtype) if flux else \
        on_meta(SD3Transformer2DModel, SD35M_TRANSFORMER, dtype)
    if config.model.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if not config.model.use_lora:
        transformer.requires_grad_(True)
    family = FluxFamily if flux else SD3Family
    transformer = make_trainable(transformer, config,
                                 list(config.model.lora_target_modules or family.default_lora_targets))
    vae = on_meta(AutoencoderKL, SD3_VAE, dtype)  # FLUX's autoencoder has the SD3 VAE's layout (16 channels)
    encoders = [on_meta(CLIPTextModel, CLIPTextConfig(**CLIP_L), dtype)] if flux else [
        on_meta(CLIPTextModelWithProjection, CLIPTextConfig(**CLIP_L), dtype),
        on_meta(CLIPTextModelWithProjection, CLIPTextConfig(**CLIP_G), dtype)]
    encoders.append(on_meta(T5EncoderModel, T5Config(**T5_XXL), dtype))
    rewards = [on_meta(CLIPModel, CLIPConfig(text_config=CLIP_H_TEXT, vision_config=CLIP_H_VISION, projection_dim=1024),
                       reward_dtype)
               for name in ("pickscore", "hpsv2") for reward_dtype in reward_dtypes(config, name)]  # both CLIP ViT-H-14
    s, t = config.sampling, config.train
    side = config.model.resolution // 8
    image_tokens = (side // 2) ** 2
    # SD3 joins CLIP's 77 tokens and T5's; FLUX's transformer reads T5's alone (CLIP gives the pooled vector)
    text_tokens = s.max_sequence_length if flux else 77 + s.max_sequence_length
    trained = max(1, round(s.num_steps * s.timestep_fraction)) if "fraction" in s.train_steps else s.num_steps
    chunk = t.timestep_chunk or trained
    cfg = 2 if s.guidance_scale > 1 and not flux else 1  # FLUX.1-dev's guidance is an input, not a second half
    holding = resident(config, transformer, [vae, *encoders, *rewards])
    parts = {"weights": sum(p.numel() * p.element_size() for p in holding), "trainable": trained_numel(transformer)}

    def forward(rows: int):
        embeds = torch.randn(rows, text_tokens, 4096, dtype=dtype, device=META)
        timestep = torch.rand(rows, device=META)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            if flux:
                return transformer(hidden_states=torch.randn(rows, image_tokens, 64, dtype=dtype, device=META),
                                   encoder_hidden_states=embeds, timestep=timestep,
                                   guidance=torch.full((rows,), s.guidance_scale, device=META),
                                   pooled_projections=torch.randn(rows, 768, dtype=dtype, device=META),
                                   txt_ids=torch.zeros(text_tokens, 3, dtype=dtype, device=META),
                                   img_ids=torch.zeros(image_tokens, 3, dtype=dtype, device=META),
                                   return_dict=False)[0].float()
            return transformer(hidden_states=torch.randn(rows, 16, side, side, dtype=dtype, device=META),
                               encoder_hidden_states=embeds,
                               pooled_projections=torch.randn(rows, 2048, dtype=dtype, device=META),
                               timestep=timestep * 1000).sample.float()

    with flash_attention():
        tracker = LiveBytes(holding)
        with tracker:
            latents = torch.empty(config.data.prompts_per_step * config.data.group_size, s.num_steps + 1, 16, side,
                                  side, device=META)  # the trajectories of the update, fp32
            with torch.no_grad():
                forward(t.sample_batch_size * cfg)
                vae.decode(torch.randn(t.sample_batch_size, 16, side, side, dtype=dtype, device=META))
            rollout = tracker.peak
            tracker.reset_peak()
            train_and_step(tracker, transformer, lambda: forward(t.batch_size * chunk * cfg).pow(2).mean())
            training = tracker.peak
            del latents
    return {"rollout": rollout, "training": training, "parts": parts,
            "shapes": {"training_rows": t.batch_size * chunk * cfg, "sampling_rows": t.sample_batch_size * cfg,
                       "image_tokens": image_tokens, "text_tokens": text_tokens}}


def estimate_vlm(config, size: str, prompt_tokens: int) -> dict:
    """Peak bytes of a Qwen2.5-VL-sized recipe's training and rollout phases (module docstring)."""
    from mmrl.pipelines.vlm.qwen import LANGUAGE_LORA_TARGETS, QwenVLPolicy
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = QWEN25VL_3B_TEXT if size == "qwen25vl_3b" else QWEN25VL_7B_TEXT
    vision = dict(QWEN25VL_3B_VISION, out_hidden_size=text["hidden_size"])
    hf_config = Qwen2_5_VLConfig(text_config=dict(text, layer_types=["full_attention"] * text["num_hidden_layers"],
                                                  head_dim=text["hidden_size"] // text["num_attention_heads"]),
                                 vision_config=vision, tie_word_embeddings=size == "qwen25vl_3b")
    hf_config.text_config._attn_implementation = "sdpa"
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(config.model.dtype, torch.float32)
    model = on_meta(Qwen2_5_VLForConditionalGeneration, hf_config, dtype)
    if config.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not config.model.use_lora:  # as QwenVLPolicy: every weight, the vision tower unless frozen
        for name, param in model.named_parameters():
            param.requires_grad_(not (config.model.freeze_vision and QwenVLPolicy._is_vision(name)))
    targets = QwenVLPolicy.language_modules(model, list(config.model.lora_target_modules or LANGUAGE_LORA_TARGETS))
    model = make_trainable(model, config, targets)
    holding = resident(config, model, [])
    parts = {"weights": sum(p.numel() * p.element_size() for p in holding), "trainable": trained_numel(model)}
    g, t, d = config.generation, config.train, config.data
    width = g.max_new_tokens
    length = prompt_tokens + width
    inner = model.base_model.model if config.model.use_lora else model
    language = inner.model.language_model

    def logps(rows: int) -> torch.Tensor:
        ids = torch.zeros(rows, length, dtype=torch.long, device=META)
        positions = torch.arange(length, device=META).expand(3, rows, length)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            hidden = language(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
            logits = inner.lm_head(hidden[:, -(width + 1):]).float()[:, :-1]
        picked = logits.gather(-1, ids[:, -width:].unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)

    heads_kv, head_dim = text["num_key_value_heads"], text["hidden_size"] // text["num_attention_heads"]
    rollout_rows = d.prompts_per_step * d.group_size
    with flash_attention():
        tracker = LiveBytes(holding)
        with tracker:
            with torch.no_grad():
                cache = [torch.empty(2, rollout_rows, heads_kv, length, head_dim, dtype=dtype, device=META)
                         for _ in range(text["num_hidden_layers"])]
                hidden = language(input_ids=torch.zeros(rollout_rows, 1, dtype=torch.long, device=META),
                                  position_ids=torch.zeros(3, rollout_rows, 1, dtype=torch.long, device=META),
                                  use_cache=False).last_hidden_state
                inner.lm_head(hidden).float().softmax(-1)
                del cache, hidden
            rollout = tracker.peak
            tracker.reset_peak()
            train_and_step(tracker, model, lambda: -logps(t.batch_size).mean())
            training = tracker.peak
    return {"rollout": rollout, "training": training, "parts": parts,
            "shapes": {"training_rows": t.batch_size, "sequence_tokens": length, "completion_tokens": width,
                       "rollout_rows": rollout_rows}}


def recipe_path(name: str) -> Path:
    """The config file of recipe ``name`` (shipped ones are relative to the repository)."""
    return ROOT / RECIPES[name][1]  # an absolute path (--config) stays as it is


def estimate(name: str, overrides: list[str], prompt_tokens: int | None = None) -> dict:
    """The recipe ``name`` with ``overrides``: peak GiB per phase (one process), the resident weights, and
    ``trainable_state_gib``: the trained weights' fp32 copy, gradient and two AdamW moments (16 bytes each), the
    part that sharding (FSDP2) divides by the process count. The rollout of every update after the first also
    holds the AdamW moments (8 bytes per trained weight), which the traced first rollout has not made yet: they are
    added."""
    from mmrl.config import load_config

    size, _, typical = RECIPES[name]
    path = recipe_path(name)
    config = load_config(path, overrides, check_files=False)
    raw = estimate_flow(config, size) if size in FLOW_SIZES else estimate_vlm(config, size, prompt_tokens or typical)
    trained = raw["parts"]["trainable"]
    rollout = raw["rollout"] + 8 * trained
    peak = max(rollout, raw["training"])
    return {"overrides": overrides, "peak_gib": round(peak / GIB, 1), "training_gib": round(raw["training"] / GIB, 1),
            "rollout_gib": round(rollout / GIB, 1), "resident_weights_gib": round(raw["parts"]["weights"] / GIB, 1),
            "trainable_state_gib": round(16 * trained / GIB, 1), "trained_parameters": trained,
            "shapes": raw["shapes"]}


def sharded_peak(one: dict, processes: int) -> float:
    """Peak GiB per process of ``one`` (a one-process estimate) under FSDP2 over ``processes``: training holds
    ``1 / processes`` of the trained weights' fp32 copy, gradients and moments (FSDP2 gathers one block at a time);
    a rollout gathers the whole fp32 weights next to their shard and the sharded moments
    (``mmrl.distributed.full_weights``)."""
    trained = one["trained_parameters"] / GIB
    training = one["training_gib"] - 16 * trained * (1 - 1 / processes)
    rollout = one["rollout_gib"] - 8 * trained + (4 + 8) * trained / processes
    return round(max(training, rollout), 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="*", default=None, choices=list(RECIPES))
    parser.add_argument("--config", type=Path, default=None,
                        help="estimate this config instead (with --model: the real-size model it is for)")
    parser.add_argument("--model", choices=("sd35m", "flux_dev", "qwen25vl_3b", "qwen25vl_7b"), default=None)
    parser.add_argument("--cards", nargs="*", type=float, default=[24, 80, 141], help="card memory in GB (1e9 B)")
    parser.add_argument("--headroom", type=float, default=0.15,
                        help="fraction of each card kept free for what the estimate does not count")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="VLM prompt length in tokens (default: the recipe's typical one, see RECIPES)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="extra overrides for every estimate (repeat it or list several)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "memory_estimate.json")
    args = parser.parse_args(argv)
    from diffusers.utils import logging as diffusers_logging

    from mmrl.config import load_config

    diffusers_logging.set_verbosity_error()  # "modules that should be kept in float32: []" for each meta build
    lines = []
    if args.config is not None:
        if args.model is None:
            parser.error("--config needs --model (the published model the config is for)")
        RECIPES[args.config.stem] = (args.model, str(args.config.resolve()), 450)
        names = [args.config.stem]
    else:
        names = args.recipes or [name for name in RECIPES]
    for name in names:
        family = "flow" if RECIPES[name][0] in FLOW_SIZES else "vlm"
        config = load_config(recipe_path(name), list(args.set), check_files=False)
        candidates = [c for c in (preset_overrides(config, p) for p in PRESETS[family]) if c is not None]
        estimates = {tuple(c): estimate(name, [*args.set, *c], args.prompt_tokens) for c in candidates}
        same_method = [c for c in candidates if "model.use_lora=true" not in c]  # the recipe's own fine-tune
        presets = {}
        for card in args.cards:
            budget = card * 1e9 * (1 - args.headroom) / GIB
            one = next((c for c in candidates if estimates[tuple(c)]["peak_gib"] <= budget), None)
            preset = {"one_process": None if one is None else estimates[tuple(one)]}
            if one is None:
                preset["leanest"] = min(estimates.values(), key=lambda e: e["peak_gib"])
            # the recipe's own method sharded over the fewest processes, where the trained state is worth sharding
            if (one is None or one not in same_method) and estimates[()]["trainable_state_gib"] >= 1:
                preset["fsdp2"] = next(({**estimates[tuple(c)], "processes": n,
                                         "peak_gib": sharded_peak(estimates[tuple(c)], n)}
                                        for n in SHARDS for c in same_method
                                        if sharded_peak(estimates[tuple(c)], n) <= budget), None)
            presets[f"{card:g}GB"] = preset
        line = {"recipe": name, "shipped": estimates[()], "presets": presets,
                "candidates": {" ".join(k) or "as shipped": v["peak_gib"] for k, v in estimates.items()}}
        print(json.dumps(line), flush=True)
        lines.append(line)
    return finish({"benchmark": "memory_estimate", "ok": True, "versions": versions(),
                   "settings": {"headroom": args.headroom, "prompt_tokens": args.prompt_tokens, "set": args.set},
                   "recipes": lines}, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
