"""FLUX adapter: schedule, timestep convention, packing and decoding checked against diffusers'
own ``FluxPipeline.__call__``; stored rollout log-probs equal re-scored ones; LoRA export loads
back with ``FluxPipeline.load_lora_weights`` and reproduces the policy."""
from __future__ import annotations

import math

import pytest
import torch

from mmrl.pipelines.flow.flux import FluxFamily
from mmrl.pipelines.flow.policy import FlowPolicy, build_family
from mmrl.pipelines.flow.tiny import build_tiny_flux

PROMPTS = ["a photo of a cat sitting on a red table", "two dogs in the city"]
SEEDS = [0, 7]
STEPS = 6
GUIDANCE = 3.5
RES = 32
MAX_SEQ = 32


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    return build_tiny_flux(tmp_path_factory.mktemp("tiny-flux"))


def _policy(path, *, rank=4, alpha=4, **kwargs) -> FlowPolicy:
    family = FluxFamily.from_pretrained(str(path), dtype=torch.float32, max_sequence_length=MAX_SEQ)
    lora = {"rank": rank, "alpha": alpha, "target_modules": FluxFamily.default_lora_targets}
    kwargs = {"num_steps": STEPS, "guidance_scale": GUIDANCE, "lora": lora, "resolution": RES, **kwargs}
    return FlowPolicy(family, **kwargs)


def _pipe(path):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def _pipeline_images(pipe, prompt, seeds=SEEDS, guidance_scale=GUIDANCE):
    """FluxPipeline's own images, each from its own seed's generator (its noise draw, not mmrl's)."""
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    return pipe([prompt] * len(seeds), num_inference_steps=STEPS, guidance_scale=guidance_scale, height=RES,
                width=RES, output_type="pt", generator=generators, max_sequence_length=MAX_SEQ).images


def _perturb_lora_b(policy: FlowPolicy, scale: float = 0.5) -> int:
    gen = torch.Generator().manual_seed(123)
    n = 0
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
                n += 1
    return n


# ------------------------------------------------------------------------------------------- layout


def test_latent_shape_is_packed(flux_dir):
    family = FluxFamily.from_pretrained(str(flux_dir), dtype=torch.float32, max_sequence_length=MAX_SEQ)
    # 32 px / VAE factor 2 = 16x16 latent of 16 channels -> 8x8 tokens of 2x2x16 = 64 channels
    assert family.latent_shape(32) == (64, 64)
    assert family.latent_shape(48) == (144, 64)
    with pytest.raises(ValueError, match="multiple of 4"):
        family.latent_shape(30)
    ids = family.image_ids(64, torch.device("cpu"))
    assert ids.shape == (64, 3)
    assert torch.equal(ids[:, 0], torch.zeros(64))
    assert torch.equal(ids[9], torch.tensor([0.0, 1.0, 1.0]))  # row 1, column 1 of the 8x8 grid


def test_encode_is_batch_first_and_keeps_text_ids_once(flux_dir):
    family = FluxFamily.from_pretrained(str(flux_dir), dtype=torch.float32, max_sequence_length=MAX_SEQ)
    cond = family.encode(PROMPTS)
    assert set(cond) == {"prompt_embeds", "pooled_projections"}
    assert cond["prompt_embeds"].shape == (2, MAX_SEQ, 64)  # T5 d_model 64
    assert cond["pooled_projections"].shape == (2, 32)  # CLIP pooled
    assert not torch.allclose(cond["prompt_embeds"][0], cond["prompt_embeds"][1])
    assert family.text_ids.shape == (MAX_SEQ, 3) and not family.text_ids.any()
    one = family.encode(PROMPTS[:1])
    torch.testing.assert_close(one["prompt_embeds"][0], cond["prompt_embeds"][0], rtol=0, atol=1e-6)


def test_a_prompt_past_the_text_encoders_limits_is_said_once_not_on_every_encode(flux_dir, caplog, capsys):
    """diffusers warned on every encode, listing the cut tokens (29 KB of log for one long prompt in a tiny run),
    and mmrl said nothing; now one warning per prompt, naming the encoders that cut it."""
    import logging

    family = FluxFamily.from_pretrained(str(flux_dir), dtype=torch.float32, max_sequence_length=MAX_SEQ)
    long = "a red circle left of a blue square " * 12
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            family.encode([long, "a cat"])
    said = [r.getMessage() for r in caplog.records if "truncated by the text encoders" in r.getMessage()]
    assert len(said) == 1 and "1 longer than CLIP's 77 tokens" in said[0]
    assert f"1 longer than T5's {MAX_SEQ} tokens" in said[0]
    assert not [r for r in caplog.records if "truncated because" in r.getMessage()
                or "Token indices sequence length" in r.getMessage()]
    assert "truncated because" not in capsys.readouterr().err


def test_schedule_is_fluxpipeline_dynamic_shift(flux_dir):
    family = FluxFamily.from_pretrained(str(flux_dir), dtype=torch.float32, max_sequence_length=MAX_SEQ)
    sigmas, timesteps = family.schedule(STEPS, RES)
    assert sigmas.shape == (STEPS + 1,) and timesteps.shape == (STEPS,)
    # independent recomputation: mu linear in the token count (64 here), exponential time shift
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (64 - 256)
    base = torch.linspace(1.0, 1.0 / STEPS, STEPS, dtype=torch.float64)
    expected = math.exp(mu) / (math.exp(mu) + (1 / base - 1))
    torch.testing.assert_close(sigmas[:-1].double(), expected, rtol=0, atol=1e-6)
    assert sigmas[-1] == 0 and sigmas[0] == 1
    torch.testing.assert_close(timesteps, sigmas[:-1] * 1000, rtol=0, atol=1e-3)


def test_dance_time_shift_schedule_has_danceGRPO_integer_timesteps():
    """DanceGRPO (``train_grpo_flux.py``): ``sigma = sd3_time_shift(3, linspace(1, 0, S+1))`` in float32 for the
    SDE, the transformer at ``int(sigma * 1000) / 1000``."""
    from types import SimpleNamespace

    from mmrl.pipelines.flow.policy import FlowPolicy

    for steps in (10, 16, 25, 28, 50):
        for shift in (1.0, 2.0, 3.0, 5.0):
            sigmas, timesteps = FlowPolicy.schedule(SimpleNamespace(time_shift=shift), steps)
            t = torch.linspace(1, 0, steps + 1)  # the anchor's float32 schedule
            anchor = (shift * t) / (1 + (shift - 1) * t)
            torch.testing.assert_close(sigmas, anchor, rtol=0, atol=0)
            assert timesteps.tolist() == [float(int(s * 1000)) for s in anchor[:-1]], (steps, shift)
    sigmas, timesteps = FlowPolicy.schedule(SimpleNamespace(time_shift=3.0), 16)
    assert timesteps[1].item() == 978.0 and sigmas[1].item() != 0.978  # 0.97826 -> 978
    # float32 as the anchor: shift 3, 10 steps, step 3 is 0.87499994 -> 874 (the exact 0.875 would give 875)
    assert FlowPolicy.schedule(SimpleNamespace(time_shift=3.0), 10)[1][3].item() == 874.0


# ------------------------------------------------------------------------------ against diffusers


def test_ode_sampling_matches_fluxpipeline(flux_dir):
    policy = _policy(flux_dir)
    assert policy._negative is None  # FLUX: distilled guidance, no CFG batch
    images = policy.sample_eval(PROMPTS, SEEDS, num_steps=STEPS)
    assert images.shape == (len(PROMPTS) * len(SEEDS), 3, RES, RES)
    pipe = _pipe(flux_dir)
    for i, prompt in enumerate(PROMPTS):
        ref = _pipeline_images(pipe, prompt)  # the same seeds give the same images
        got = images[i * len(SEEDS):(i + 1) * len(SEEDS)]
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
        # the comparison is sensitive: another distilled-guidance value gives other images
        assert (_pipeline_images(pipe, prompt, guidance_scale=1.0) - got).abs().max() > 1e-3
    assert (images[0] - images[1]).abs().max() > 1e-2  # seeds differ
    assert (images[0] - images[2]).abs().max() > 1e-3  # prompts differ


def test_without_guidance_embeds_matches_fluxpipeline(flux_dir):
    """FLUX.1-schnell style transformer (``guidance_embeds=False``): no guidance input at all."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    base = _pipe(flux_dir)
    config = dict(base.transformer.config)
    config["guidance_embeds"] = False
    torch.manual_seed(1)
    transformer = FluxTransformer2DModel.from_config(config).eval()
    pipe = FluxPipeline(**{**base.components, "transformer": transformer})
    pipe.set_progress_bar_config(disable=True)
    family = FluxFamily(pipe, max_sequence_length=MAX_SEQ)
    policy = FlowPolicy(family, num_steps=STEPS, guidance_scale=GUIDANCE, resolution=RES,
                        lora={"rank": 4, "alpha": 4, "target_modules": ["attn.to_q", "attn.to_v"]})
    images = policy.sample_eval(PROMPTS[:1], SEEDS, num_steps=STEPS)
    ref = _pipeline_images(pipe, PROMPTS[0])
    torch.testing.assert_close(images, ref, rtol=0, atol=1e-4)


# ------------------------------------------------------------------------------------------ rollout


@pytest.mark.parametrize("sde", ["flow_grpo", "dance", "cps"])
def test_rollout_logprobs_recompute(flux_dir, sde):
    policy = _policy(flux_dir, sde=sde, noise_level={"flow_grpo": 0.7, "dance": 0.3, "cps": 0.8}[sde])
    _perturb_lora_b(policy, scale=0.05)  # a non-trivial current policy; old == new must still hold
    rollout = policy.rollout(PROMPTS, group_size=2, generator=torch.Generator().manual_seed(0))
    n, t = 4, len(rollout.plan.train)
    assert rollout.latents.shape == (n, STEPS + 1, 64, 64)
    assert rollout.images.shape == (n, 3, RES, RES)
    assert rollout.old_logps.shape == (n, t) and t == STEPS - 1
    assert torch.isfinite(rollout.old_logps).all()
    assert rollout.cond["prompt_embeds"].shape[0] == len(PROMPTS)  # encoded once per prompt
    torch.testing.assert_close(rollout.images, policy.family.decode(rollout.latents[:, -1]), rtol=0, atol=1e-6)

    out = policy.logprobs(rollout, torch.arange(n), with_kl=True)
    torch.testing.assert_close(out.logps, rollout.old_logps, rtol=0, atol=1e-5)
    assert out.kl.shape == (n, t) and (out.kl >= 0).all() and out.kl.sum() > 0  # LoRA B != 0: not the reference
    # a subset of samples and steps, batched differently, gives the same numbers
    sub = policy.logprobs(rollout, torch.tensor([3, 1]), steps=torch.tensor([0, 2]))
    torch.testing.assert_close(sub.logps, rollout.old_logps[[3, 1]][:, [0, 2]], rtol=0, atol=1e-5)
    # gradients reach the LoRA weights through the log-probs
    sub.logps.sum().backward()
    grads = [p.grad for p in policy.trainable_parameters()]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)


def test_kl_zero_with_fresh_lora(flux_dir):
    policy = _policy(flux_dir)
    rollout = policy.rollout(PROMPTS[:1], group_size=2, generator=torch.Generator().manual_seed(1))
    out = policy.logprobs(rollout, torch.arange(2), with_kl=True)
    torch.testing.assert_close(out.kl, torch.zeros_like(out.kl), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------- LoRA


@pytest.mark.parametrize("alpha", [4, 8])
def test_lora_export_loads_in_fluxpipeline(flux_dir, tmp_path, alpha):
    policy = _policy(flux_dir, rank=4, alpha=alpha)
    base = _pipeline_images(_pipe(flux_dir), PROMPTS[0])

    fresh = tmp_path / "fresh"
    policy.export(str(fresh))
    assert (fresh / "pytorch_lora_weights.safetensors").is_file()
    from safetensors import safe_open

    with safe_open(fresh / "pytorch_lora_weights.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("transformer.") for k in keys)
    assert any("single_transformer_blocks.0.attn.to_q.lora_A" in k for k in keys)
    assert any("transformer_blocks.0.ff_context.net.2.lora_B" in k for k in keys)
    pipe = _pipe(flux_dir)
    pipe.load_lora_weights(str(fresh))
    torch.testing.assert_close(_pipeline_images(pipe, PROMPTS[0]), base, rtol=0, atol=1e-6)

    assert _perturb_lora_b(policy) > 0
    trained = tmp_path / "trained"
    policy.export(str(trained))
    pipe = _pipe(flux_dir)
    pipe.load_lora_weights(str(trained))
    loaded = _pipeline_images(pipe, PROMPTS[0])
    assert (loaded - base).abs().max() > 1e-3
    # the loaded LoRA is the policy's (same weights and scale alpha / rank)
    torch.testing.assert_close(loaded, policy.sample_eval(PROMPTS[:1], SEEDS, num_steps=STEPS), rtol=0, atol=1e-4)


def test_build_family_flux(flux_dir):
    family = build_family("flux", str(flux_dir), dtype="float32", max_sequence_length=16)
    assert isinstance(family, FluxFamily) and family.name == "flux"
    assert family.max_sequence_length == 16
    assert family.encode(["a cat"])["prompt_embeds"].shape[1] == 16


# ----------------------------------------------------------------------------------------- negative prompt


def test_negative_prompt_is_rejected_for_flux(flux_dir):
    """FLUX.1-dev is guidance-distilled: no CFG, so a negative prompt would be silently ignored -- refused instead."""
    with pytest.raises(ValueError, match=r"sampling\.negative_prompt.*guidance-distilled"):
        _policy(flux_dir, negative_prompt="blurry, low quality")
    policy = _policy(flux_dir, negative_prompt="")  # the default: fine
    assert policy._negative is None and not policy._use_cfg


def test_flux_lora_dropout_only_in_the_training_forward(flux_dir):
    family = FluxFamily.from_pretrained(str(flux_dir), dtype=torch.float32, max_sequence_length=MAX_SEQ)
    lora = {"rank": 4, "alpha": 4, "dropout": 0.5, "target_modules": FluxFamily.default_lora_targets}
    policy = FlowPolicy(family, num_steps=STEPS, guidance_scale=GUIDANCE, lora=lora, resolution=RES)
    _perturb_lora_b(policy, scale=0.05)
    rollout = policy.rollout(PROMPTS, group_size=2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(policy.logprobs(rollout, torch.arange(4)).logps, rollout.old_logps, rtol=0,
                                   atol=1e-5)
    out = policy.logprobs(rollout, torch.arange(4))
    assert policy.transformer.training and (out.logps - rollout.old_logps).abs().max() > 1e-4


def test_full_finetuning_in_bfloat16_keeps_a_bfloat16_reference(flux_dir):
    family = FluxFamily.from_pretrained(str(flux_dir), dtype=torch.bfloat16, max_sequence_length=MAX_SEQ)
    policy = FlowPolicy(family, num_steps=STEPS, guidance_scale=GUIDANCE, lora=None, resolution=RES)
    rollout = policy.rollout(PROMPTS[:1], group_size=2, generator=torch.Generator().manual_seed(0))
    out = policy.logprobs(rollout, torch.arange(2), with_kl=True)
    assert {p.dtype for p in policy._reference_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in policy.trainable_parameters()} == {torch.float32}
    assert torch.isfinite(out.kl).all() and (out.kl >= 0).all() and torch.isfinite(out.logps).all()
