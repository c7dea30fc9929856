"""GPU check: real model sizes through mmrl's own trainer, one JSON line per check.

    bash benchmarks/gpu_check.sh            # on a GPU machine: installs mmrl (README command), then this script
    python benchmarks/gpu_check.py --smoke  # the same code path with the tiny models, on CPU (tests run it)

Two workloads, each with random weights built from the published configs (step time and memory do not depend on
the weights' values), written to a temporary folder and loaded by mmrl exactly as a downloaded model would be:

* ``flow``: an SD3.5-Medium-sized pipeline (MMDiT-X transformer: 24 joint blocks of 24 x 64 channels, dual
  attention in blocks 0-12, 2.24B parameters; the SD3 16-channel VAE, 84M; CLIP-L 86M, CLIP-G 632M and a T5-XXL
  encoder 4.63B, with the tiny pipeline's tokenizers and vocabularies) through ``configs/gpu/sd35m_flow_grpo_pickscore.yaml`` at 512 px
  (bf16, LoRA r32, CFG 4.5, 10 SDE steps, 9 trained), the reward replaced by the weightless ``brightness``;
* ``vlm``: a Qwen2.5-VL-3B-sized model (36 decoder layers of 2048, 32 vision blocks of 1280, vocabulary 151,936;
  3.75B parameters) through ``configs/gpu/qwen25vl3b_rec_grpo.yaml`` (bf16, full fine-tuning of the language
  model with the vision tower frozen and no checkpointing, as its figures were first measured; beta 0.04, 256 new
  tokens) on ShapeWorld grounding questions, SDPA attention.

For each: build seconds, then ``--warmup`` updates and ``--steps`` timed updates of ``Trainer.step`` (rollout,
rewards, training pass, optimizer step), printing seconds per update (and its rollout / training parts), samples
per second, peak GPU memory (``torch.cuda.max_memory_allocated``) over the timed updates and that peak per
sample. vLLM does not install beside mmrl's torch pin (see the README), so it is not checked here.

Under ``accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml --num_processes 1`` the same
script runs the updates on DeepSpeed's ZeRO-2 engine (bf16 weights, fp32 master weights and AdamW state in the
engine): its lines carry ``"engine": "deepspeed_zero2"``. ``gpu_check.sh`` runs the VLM check that way too when
DeepSpeed is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

#: SD3.5-Medium's transformer (stabilityai/stable-diffusion-3.5-medium, transformer/config.json)
SD35M_TRANSFORMER = dict(sample_size=64, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                         num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                         pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384, qk_norm="rms_norm",
                         dual_attention_layers=tuple(range(13)))
#: the SD3 / SD3.5 VAE (vae/config.json)
SD3_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
               down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
               layers_per_block=2, norm_num_groups=32, scaling_factor=1.5305, shift_factor=0.0609,
               use_quant_conv=False, use_post_quant_conv=False)
#: CLIP-L and CLIP-G text towers (text_encoder, text_encoder_2) and T5-XXL (text_encoder_3) widths
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              projection_dim=768, hidden_act="quick_gelu")
CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              projection_dim=1280, hidden_act="gelu")
T5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, feed_forward_proj="gated-gelu")
#: Qwen2.5-VL-3B-Instruct (config.json): language model and vision tower
QWEN25VL_3B_TEXT = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=128000,
                        max_window_layers=70, rms_norm_eps=1e-6,
                        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                         "mrope_section": [16, 24, 24]})
QWEN25VL_3B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                          window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def build(cls, config, device: str, dtype: torch.dtype):
    """A random ``cls(config)`` initialised directly on ``device`` (seconds for billions of parameters on a GPU)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config) if not isinstance(config, dict) else cls(**config)
    return model.to(dtype)


def sd35m_pipeline(out: Path, device: str, dtype: torch.dtype, smoke: bool) -> tuple[Path, dict]:
    """The tiny SD3 pipeline's folder (tokenizers, scheduler) with every model replaced by a random one of the real
    size (``smoke``: the tiny models as they are)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from mmrl.pipelines.flow.loading import resolve_pretrained

    tiny = Path(resolve_pretrained("tiny:sd3"))
    shutil.copytree(tiny, out)
    if smoke:
        return out, {"transformer": count(SD3Transformer2DModel.from_pretrained(tiny / "transformer"))}
    sizes = {}
    parts = [("transformer", SD3Transformer2DModel, SD35M_TRANSFORMER), ("vae", AutoencoderKL, SD3_VAE)]
    for name, cls, config in parts:
        model = build(cls, config, device, dtype)
        sizes[name] = count(model)
        shutil.rmtree(out / name)
        model.save_pretrained(out / name)
        del model
    for name, cls, config_cls, dims in (("text_encoder", CLIPTextModelWithProjection, CLIPTextConfig, CLIP_L),
                                        ("text_encoder_2", CLIPTextModelWithProjection, CLIPTextConfig, CLIP_G),
                                        ("text_encoder_3", T5EncoderModel, T5Config, T5_XXL)):
        model = build(cls, text_encoder_config(config_cls, out / name, dims), device, dtype)
        sizes[name] = count(model)
        shutil.rmtree(out / name)
        model.save_pretrained(out / name)
        del model
    return out, sizes


def qwen25vl_3b_config(tiny: Path):
    """The tiny Qwen2.5-VL's config (its tokenizer's special-token ids) with Qwen2.5-VL-3B's sizes."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny)
    for key, value in QWEN25VL_3B_TEXT.items():
        setattr(config.text_config, key, value)
    config.text_config.layer_types = ["full_attention"] * QWEN25VL_3B_TEXT["num_hidden_layers"]
    config.text_config.head_dim = QWEN25VL_3B_TEXT["hidden_size"] // QWEN25VL_3B_TEXT["num_attention_heads"]
    for key, value in QWEN25VL_3B_VISION.items():
        setattr(config.vision_config, key, value)
    config.tie_word_embeddings = True
    return config


def text_encoder_config(config_cls, tiny_folder: Path, dims: dict):
    config = config_cls.from_pretrained(tiny_folder)
    for key, value in dims.items():
        setattr(config, key, value)
    return config


def qwen25vl_3b(out: Path, device: str, dtype: torch.dtype, smoke: bool, engine: str = "hf") -> tuple[Path, dict]:
    """The tiny Qwen2.5-VL's folder (tokenizer, processor, token ids) with a random model of the 3B's sizes (with
    ``smoke`` the tiny model itself; for the vLLM engine with 32-wide text heads, the smallest vLLM's CPU attention
    takes)."""
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    from mmrl.pipelines.vlm.tiny import build_tiny_qwen2_5_vl, ensure_tiny_vlm

    tiny = Path(ensure_tiny_vlm("qwen2_5_vl"))
    if smoke and engine == "vllm":
        rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6]}
        build_tiny_qwen2_5_vl(out, text_overrides={"num_attention_heads": 2, "num_key_value_heads": 1,
                                                   "rope_parameters": rope})
        return out, {"model": count(Qwen2_5_VLForConditionalGeneration.from_pretrained(out))}
    shutil.copytree(tiny, out)
    if smoke:
        return out, {"model": count(Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny))}
    config = qwen25vl_3b_config(tiny)
    model = build(Qwen2_5_VLForConditionalGeneration, config, device, dtype)
    model.generation_config = GenerationConfig.from_pretrained(tiny)
    sizes = {"model": count(model)}
    for path in out.glob("*.safetensors*"):
        path.unlink()
    model.save_pretrained(out)
    del model
    return out, sizes


def time_updates(config, warmup: int, steps: int, cuda: bool) -> dict:
    """``warmup`` + ``steps`` updates of mmrl's own Trainer; figures over the timed ones."""
    from mmrl.build import build_trainer
    from mmrl.distributed import deepspeed_stage

    trainer = build_trainer(config)
    stage = deepspeed_stage(trainer.accelerator)
    decode_steps: list[int] = []  # a VLM rollout decodes as many steps as its longest completion
    if hasattr(trainer.policy, "encode_prompts"):
        sample = trainer.policy.rollout

        def counted_rollout(*a, **kw):
            out = sample(*a, **kw)
            decode_steps.append(int(out.mask.sum(-1).max()))
            return out

        trainer.policy.rollout = counted_rollout
    for _ in range(warmup):
        trainer.step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds, rollout, train = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        metrics = trainer.step()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        rollout.append(metrics["time/rollout"] + metrics["time/reward"])
        train.append(metrics["time/train"])
    samples = config.data.prompts_per_step * config.data.group_size
    per_update = sorted(seconds)[len(seconds) // 2]
    extra = {}
    if hasattr(trainer.policy, "encode_prompts"):  # a VLM: the prompt length the memory estimate needs
        inputs, _, _ = trainer.policy.encode_prompts(trainer.prompts.items[:1])
        extra["prompt_tokens"] = int(inputs["input_ids"].shape[1])
        # the timed rollouts' decoding: steps (longest completion) and milliseconds per step (prefill included)
        timed = decode_steps[-steps:]
        extra["decode_steps"] = sorted(timed)[len(timed) // 2]
        per_step = sorted(r / max(d, 1) for r, d in zip(rollout, timed))
        extra["ms_per_decode_step"] = round(1000 * per_step[len(per_step) // 2], 1)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"samples_per_update": samples, "seconds_per_update": round(per_update, 3),
            "rollout_s": round(sorted(rollout)[len(rollout) // 2], 3),
            "train_s": round(sorted(train)[len(train) // 2], 3),
            "samples_per_s": round(samples / per_update, 3),
            "peak_gpu_gib": None if peak is None else round(peak, 2),
            "peak_gpu_gib_per_sample": None if peak is None else round(peak / samples, 3),
            # ZeRO-3 partitions the weights: a parameter's own numel() is then 0 and ds_numel its full size
            "trainable_parameters": sum(getattr(p, "ds_numel", p.numel())
                                        for p in trainer.policy.trainable_parameters()),
            "engine": "plain" if stage is None else f"deepspeed_zero{stage}", **extra}


def common_overrides(out: Path, steps: int) -> list[str]:
    return [f"output_dir={out}", "resume=null", f"train.steps={steps}", "logging.eval_every=0",
            "logging.save_every=0", "logging.progress_bar=false", "logging.tensorboard=false", "eval.every=0"]


def check_flow(args, work: Path, device: str, dtype: torch.dtype, cuda: bool) -> dict:
    from mmrl.config import load_config

    t0 = time.perf_counter()
    pipeline, sizes = sd35m_pipeline(work / "sd35m", device, dtype, args.smoke)
    built = time.perf_counter() - t0
    overrides = [*common_overrides(work / "flow_run", args.warmup + args.steps), f"model.pretrained={pipeline}",
                 "data.prompts=shapeworld:train", f"data.prompts_per_step={args.flow_prompts}",
                 f"data.group_size={args.flow_group}", f"train.batch_size={args.flow_group}",
                 "train.gradient_accumulation_steps=1", f"train.sample_batch_size={args.flow_group}",
                 f"train.reward_batch_size={args.flow_group}", "rewards={brightness: 1.0}", "optim.ema=false",
                 "optim.ema_every_minibatch=false"]
    if args.smoke:
        overrides += ["model.dtype=float32", "train.mixed_precision=\"no\"", "model.resolution=32",
                      "sampling.max_sequence_length=16", "sampling.num_steps=4"]
    overrides += args.set
    config = load_config(str(ROOT / "configs/gpu/sd35m_flow_grpo_pickscore.yaml"), overrides)
    figures = time_updates(config, args.warmup, args.steps, cuda)
    return {"check": "flow_sd35m_size", "parameters": sizes, "build_s": round(built, 1),
            "resolution": config.model.resolution, "sde_steps": config.sampling.num_steps,
            "guidance": config.sampling.guidance_scale, **figures,
            **estimated("sd35m_flow_grpo_pickscore", overrides, None, args.smoke)}


def check_vlm(args, work: Path, device: str, dtype: torch.dtype, cuda: bool, cache: str = "dynamic",
              engine: str = "hf") -> dict:
    from mmrl.config import load_config

    t0 = time.perf_counter()
    model, sizes = qwen25vl_3b(work / "qwen25vl3b", device, dtype, args.smoke, engine)
    built = time.perf_counter() - t0
    overrides = [*common_overrides(work / "vlm_run", args.warmup + args.steps), f"model.pretrained={model}",
                 "model.attn_implementation=sdpa", "data.dataset=shapeworld:train:64:grounding",
                 f"data.prompts_per_step={args.vlm_prompts}", f"data.group_size={args.vlm_group}",
                 f"train.batch_size={args.vlm_group}", "train.gradient_accumulation_steps=1",
                 f"generation.max_new_tokens={args.vlm_new_tokens}", f"generation.cache_implementation={cache}",
                 f"generation.engine={engine}",
                 # the workload its recorded figures were measured on (the recipe now trains the vision tower with
                 # gradient checkpointing, as VLM-R1's run_grpo_rec.sh)
                 "model.freeze_vision=true", "model.gradient_checkpointing=false"]
    if args.smoke:
        overrides += ["model.dtype=float32", "train.mixed_precision=\"no\""]
        if engine == "vllm":
            overrides += ["generation.vllm={enforce_eager: true, max_num_batched_tokens: 4096}"]
    overrides += args.set
    config = load_config(str(ROOT / "configs/gpu/qwen25vl3b_rec_grpo.yaml"), overrides)
    figures = time_updates(config, args.warmup, args.steps, cuda)
    prompt_tokens = figures["prompt_tokens"]
    return {"check": "vlm_qwen25vl_3b_size", "parameters": sizes, "build_s": round(built, 1),
            "max_new_tokens": config.generation.max_new_tokens, "image_px": 112, "kv_cache": cache,
            "rollout_engine": engine, **figures,
            **estimated("qwen25vl3b_rec_grpo", overrides, prompt_tokens, args.smoke)}


def estimated(recipe: str, overrides: list[str], prompt_tokens: int | None, smoke: bool) -> dict:
    """``benchmarks/memory_estimate.py``'s peak for the same recipe and overrides, next to the measured one (the
    estimator's check; not run with ``--smoke``, whose tiny models are not the sizes it builds)."""
    if smoke:
        return {}
    from memory_estimate import estimate

    kept = [o for o in overrides if o.split("=")[0] in MEMORY_KEYS]
    try:
        return {"estimated_peak_gib": estimate(recipe, kept, prompt_tokens)["peak_gib"]}
    except Exception as exc:  # the measured figures are printed whatever happens to the estimate
        return {"estimated_peak_gib": None, "estimate_error": f"{type(exc).__name__}: {exc}"[:500]}


#: the overrides that change what the memory estimate holds (paths, logging and step counts do not)
MEMORY_KEYS = {"model.use_lora", "model.lora_rank", "model.freeze_vision", "model.gradient_checkpointing",
               "data.prompts_per_step", "data.group_size", "train.batch_size", "train.gradient_accumulation_steps",
               "train.sample_batch_size", "rewards", "optim.ema", "generation.max_new_tokens", "model.dtype"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the tiny models on CPU: checks the script, not a GPU")
    ap.add_argument("--only", choices=["flow", "vlm"], default=None)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--flow-prompts", type=int, default=2)
    ap.add_argument("--flow-group", type=int, default=4)
    ap.add_argument("--vlm-prompts", type=int, default=2)
    ap.add_argument("--vlm-group", type=int, default=8)
    ap.add_argument("--vlm-new-tokens", type=int, default=256)
    ap.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="config overrides applied to the checks after their own (e.g. model.use_lora=true)")
    ap.add_argument("--vlm-cache", nargs="+", choices=["dynamic", "static"], default=["dynamic"],
                    help="the VLM check once per KV cache (generation.cache_implementation); 'static' is compiled by "
                         "transformers on a GPU, its compilation falls in the warm-up update")
    ap.add_argument("--vlm-engine", nargs="+", choices=["hf", "vllm"], default=None,
                    help="the VLM check once per rollout engine (generation.engine); default: hf, and vllm too where "
                         "vLLM imports")
    args = ap.parse_args()
    if args.vlm_engine is None:
        from mmrl.pipelines.vlm.vllm_engine import vllm_missing

        args.vlm_engine = ["hf"] + ([] if vllm_missing() else ["vllm"])
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        emit({"check": "gpu", "skipped": "no CUDA device: run with --smoke for the CPU plumbing check"})
        sys.exit(0)
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if cuda:
        emit({"check": "gpu", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)})
    failed = False
    with tempfile.TemporaryDirectory(prefix="mmrl-gpu-check-") as tmp:
        checks = [("flow", "flow", check_flow)]
        checks += [("vlm", f"vlm_{cache}", lambda *a, c=cache: check_vlm(*a, cache=c)) for cache in args.vlm_cache
                   if "hf" in args.vlm_engine]
        checks += [("vlm", "vlm_vllm", lambda *a: check_vlm(*a, engine="vllm"))] if "vllm" in args.vlm_engine else []
        for name, folder, check in checks:
            if args.only not in (None, name):
                continue
            try:
                emit(check(args, Path(tmp) / folder, device, dtype, cuda))
            except Exception as exc:  # one failing check still lets the others report
                failed = True
                emit({"check": folder, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            if cuda:
                torch.cuda.empty_cache()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
