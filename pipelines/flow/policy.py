"""The flow-matching policy: SDE rollouts with per-step log-probabilities, and their re-scoring.

A trajectory of ``S`` denoising steps is the action sequence. ``rollout`` samples ``G`` trajectories
per prompt with the configured SDE on the planned steps (ODE elsewhere), keeping what training
needs: every latent ``x_0..x_S``, the sigma schedule, the trained step indices ``[T]``, the old
log-probs ``[N, T]`` and their mask. ``logprobs`` recomputes those log-probs under the current
parameters, several trained steps of several samples in one batched forward. Everything that
differs between model families (text encoders, transformer call, latent packing, decoding, LoRA
file format) lives in a family adapter (:mod:`.sd3`, :mod:`.flux`).

References: Flow-GRPO (Liu et al. 2025, arXiv 2505.05470), DanceGRPO (Xue et al. 2025, arXiv
2505.07818), MixGRPO (Li et al. 2025, arXiv 2507.21802).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mmrl.pipelines.flow.schedule import StepPlan, plan_steps
from mmrl.core.kl import flow_kl
from mmrl.distributed import full_weights, unsharded_class
from mmrl.pipelines.flow.sde import DEFAULT_NOISE_LEVELS, sde_step

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(model) -> torch.dtype:
    """The dtype a transformer's inputs are cast to: diffusers' ``ModelMixin.dtype`` (its first floating-point
    parameter; PEFT registers a LoRA layer's base weights before its adapters, so with LoRA this is the load
    dtype), through a DDP wrapper. The fp32 policy of a full fine-tune and its reference in the load dtype thus
    each get inputs of their own dtype."""
    return getattr(model, "module", model).dtype


def build_family(family: str, pretrained: str, *, dtype: str = "float32", revision: str | None = None,
                 max_sequence_length: int = 256):
    """The adapter of a model family, with its pipeline loaded."""
    if family == "sd3":
        from mmrl.pipelines.flow.sd3 import SD3Family as cls
    elif family == "flux":
        from mmrl.pipelines.flow.flux import FluxFamily as cls
    else:
        raise ValueError(f"unknown flow model family {family!r}; expected 'sd3' or 'flux'")
    return cls.from_pretrained(pretrained, dtype=DTYPES[dtype], revision=revision,
                               max_sequence_length=max_sequence_length)


@dataclass
class FlowRollout:
    """Everything one update needs from a batch of trajectories (``N`` samples, ``S`` steps, ``T`` trained).

    With an E-GRPO plan (``plan.sigma_index`` set) ``S`` is the merged step count ``S'``: ``latents``, ``sigmas``,
    ``timesteps`` and ``noise_levels`` are those of the merged grid, so ``logprobs`` replays the merged
    ``(sigma, sigma_next)`` pairs unchanged."""

    prompts: list[str]
    metadata: list[dict]
    group_ids: Tensor  # [N] long, the sampling group of each sample
    images: Tensor  # [N, 3, H, W] in [0, 1]
    latents: Tensor  # [N, S+1, *latent] fp32: x_0 (noise) .. x_S (final)
    sigmas: Tensor  # [S+1]
    timesteps: Tensor  # [S]
    plan: StepPlan
    noise_levels: Tensor  # [S] SDE noise level of each step
    old_logps: Tensor  # [N, T]
    mask: Tensor  # [N, T]
    cond: dict[str, Tensor]  # per unique prompt, [P, ...]
    prompt_index: Tensor  # [N] row of `cond` for each sample
    extras: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def outputs(self) -> Tensor:
        """What the rewards judge: the decoded images."""
        return self.images


@dataclass
class LogProbOutput:
    logps: Tensor  # [n, t]
    kl: Tensor | None = None  # [n, t]


class FlowPolicy:
    """A diffusers flow-matching generator as a policy over denoising steps.

    Args:
        family: a family adapter (``SD3Family``, ``FluxFamily``) holding the loaded pipeline.
        sde: ``flow_grpo | dance | cps`` (see :func:`mmrl.pipelines.flow.sde.sde_step`).
        noise_level: the SDE noise level (float), used on every SDE step unless ``noise_schedule`` is set; None: the
            anchor's default for ``sde`` (:data:`~mmrl.pipelines.flow.sde.DEFAULT_NOISE_LEVELS`: Flow-GRPO 0.7, CPS 0.8,
            DanceGRPO 0.3).
        guidance_scale: classifier-free guidance (SD3) or distilled guidance (FLUX).
        negative_prompt: the unconditional prompt of SD3's classifier-free guidance; FLUX has no CFG (FLUX.1-dev is
            guidance-distilled), so a non-empty one is a ``ValueError`` there instead of being silently ignored.
        lora: dict with ``rank, alpha, dropout, target_modules``; ``None`` trains the whole transformer (in fp32;
            the frozen reference copy stays in the load dtype). The LoRA ``dropout`` acts only in the
            gradient-carrying forward of :meth:`logprobs` (train mode); rollouts, old log-probs, the reference,
            intermediate images and evaluation run in eval mode, so with dropout 0 the first ratio is exactly 1.
        cfg_detach_uncond: with CFG, the training forward detaches the unconditional half (the gradient flows through
            the conditional branch only); False: through both (:meth:`SD3Family.velocity`).
        gradient_checkpointing: diffusers' per-block activation checkpointing in the training forward.
        final_image: what a rollout decodes and the rewards score: ``"sample"``, the last step's sampled latent, or
            ``"prediction"``, the last step's clean prediction ``x - sigma v`` (DanceGRPO's ``train_grpo_flux.py``
            decodes ``pred_original`` of its last ``flux_step``, whose own SDE noise never reaches the image). The
            trajectory and its log-probs are the same either way; after an ODE last step the two are equal.
    """

    def __init__(self, family, *, num_steps: int = 10, eval_num_steps: int = 10, resolution: int = 32,
                 sde: str = "flow_grpo", noise_level: float | None = None, guidance_scale: float = 4.5,
                 negative_prompt: str = "", cfg_detach_uncond: bool = True, train_steps: str = "fraction",
                 timestep_fraction: float = 0.99,
                 window_size: int = 2, window_shift_every: int = 1, window_range: list[int] | None = None,
                 share_group_noise: bool = False,
                 lora: dict | None = None, gradient_checkpointing: bool = False, sample_batch_size: int = 16,
                 time_shift: float | None = None, noise_schedule: list[float] | None = None,
                 keep_x0: bool = False, merge_threshold: float | None = None, merge_groups: int | None = None,
                 final_image: str = "sample", device: torch.device | str = "cpu"):
        if final_image not in ("sample", "prediction"):
            raise ValueError(f"final_image must be 'sample' or 'prediction', got {final_image!r}")
        self.final_image = final_image
        if negative_prompt and family.name == "flux":
            raise ValueError(
                f"sampling.negative_prompt={negative_prompt!r} is not supported for model.family='flux': FLUX.1 is "
                f"guidance-distilled (FLUX.1-dev takes sampling.guidance_scale as a distilled-guidance input of the "
                f"transformer, FLUX.1-schnell none), so there is no classifier-free guidance and no unconditional "
                f"branch for a negative prompt to steer; it would be silently ignored. Leave sampling.negative_prompt "
                f"empty for FLUX (diffusers' 'true CFG' with true_cfg_scale is not implemented here)."
            )
        self.family = family
        self.num_steps = num_steps
        self.eval_num_steps = eval_num_steps
        self.resolution = resolution  # checked by the family (the setter below)
        self.sde = sde
        if sde not in DEFAULT_NOISE_LEVELS:
            raise ValueError(f"unknown sde {sde!r}; expected one of {', '.join(DEFAULT_NOISE_LEVELS)}")
        self.noise_level = DEFAULT_NOISE_LEVELS[sde] if noise_level is None else noise_level
        self.guidance_scale = guidance_scale
        self.cfg_detach_uncond = cfg_detach_uncond
        self.plan_kwargs = dict(mode=train_steps, timestep_fraction=timestep_fraction, window_size=window_size,
                                shift_every=window_shift_every, window_range=window_range)
        if train_steps == "entropy_merge":  # E-GRPO: merge consecutive low-entropy steps (schedule.plan_steps)
            self.plan_kwargs.update(merge_threshold=merge_threshold, merge_groups=merge_groups)
        self.share_group_noise = share_group_noise
        self.time_shift = time_shift
        #: per-step SDE noise levels [S] (timestep-specific noise; adapted during training by the trainer's
        #: reward-aware rule of the adaptive_noise variant); a constant noise_level by default
        if noise_schedule:
            if len(noise_schedule) != num_steps:
                raise ValueError(f"sampling.noise_schedule has {len(noise_schedule)} levels for {num_steps} steps")
            self.step_noise_levels = torch.tensor([float(v) for v in noise_schedule])
        else:
            self.step_noise_levels = torch.full((num_steps,), float(self.noise_level))
        #: keep the one-step predictions x0 = x - sigma v of every step (intermediate rewards in x0 mode)
        self.keep_x0 = keep_x0
        self.sample_batch_size = sample_batch_size
        self.device = torch.device(device)

        pipe = family.pipe
        pipe.to(self.device)
        for module in (getattr(pipe, name, None) for name in ("vae", "text_encoder", "text_encoder_2",
                                                             "text_encoder_3")):
            if module is not None:
                module.requires_grad_(False)
                module.eval()
        self.transformer = family.transformer
        self.transformer.requires_grad_(False)
        #: the dtype the transformer was loaded in (model.dtype), before trainable weights are cast to fp32: the
        #: frozen reference copy of a full fine-tune is kept in it
        self.load_dtype = family.dtype
        self.use_lora = lora is not None
        if self.use_lora:
            from peft import LoraConfig

            self.transformer.add_adapter(LoraConfig(
                r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora.get("dropout", 0.0),
                init_lora_weights="gaussian", target_modules=list(lora["target_modules"]),
            ))
            self._reference_model = None
        else:
            self.transformer.requires_grad_(True)
            self._reference_model = None  # a frozen copy, made on first use of reference()
        for p in self.trainable_parameters():
            p.data = p.data.float()  # trainable weights (and their optimizer state) in fp32
        if gradient_checkpointing:  # diffusers checkpoints each block when torch.is_grad_enabled()
            self.transformer.enable_gradient_checkpointing()
        # Train / eval mode: only the gradient-carrying forward of `logprobs` runs in train mode (LoRA dropout,
        # model.lora_dropout, applies there); every no-grad forward (rollout and its old log-probs, recomputed
        # old log-probs, the reference, intermediate images, evaluation) runs in eval mode. See `_set_mode`.
        self.transformer.eval()
        # the module that computes training log-probs: replaced by the DDP-wrapped one in prepare(); sampling
        # (no gradients) calls the unwrapped transformer directly
        self.model = self.transformer
        self._negative: dict[str, Tensor] | None = None
        self._use_cfg = False
        self.set_guidance(guidance_scale, negative_prompt)

    @property
    def resolution(self) -> int:
        """Image side in pixels of rollouts and evaluation samples."""
        return self._resolution

    @resolution.setter
    def resolution(self, value: int) -> None:
        # the family's latent_shape raises a ValueError naming the limit for a side the model cannot generate (not a
        # multiple of its patch x VAE factor, or beyond SD3's positional embedding): here, not mid-rollout
        self.family.latent_shape(value)
        self._resolution = value

    def set_guidance(self, guidance_scale: float, negative_prompt: str = "") -> None:
        """Set the guidance of sampling and replayed steps: SD3 classifier-free guidance above 1 (the negative
        prompt encoded once), FLUX's distilled-guidance input as given. ``mmrl eval`` uses it to apply a
        benchmark protocol's guidance to a loaded policy."""
        self.guidance_scale = guidance_scale
        use_cfg = self.family.name == "sd3" and guidance_scale > 1.0
        if use_cfg and (not self._use_cfg or self._negative is None):
            self._negative = self.family.encode([negative_prompt])
        elif not use_cfg:
            self._negative = None
        self._use_cfg = use_cfg

    # ----------------------------------------------------------------------------------- parameters

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def named_trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.transformer.named_parameters() if p.requires_grad}

    def prepare(self, accelerator, optimizer):
        """Wrap the trainable module and its optimizer for distributed training with ``accelerator.prepare``, the
        two together (FSDP2 swaps the optimizer's parameters for their shards): DDP wraps the transformer, FSDP2
        shards it in place. Returns the prepared optimizer."""
        self.model, optimizer = accelerator.prepare(self.transformer, optimizer)
        return optimizer

    def full_weights(self):
        """Every parameter whole, with no per-forward collective, for the block (:func:`mmrl.distributed.full_weights`;
        a no-op unless the transformer is FSDP-sharded). Every process enters it."""
        return full_weights(self.model)

    def _set_mode(self, train: bool) -> None:
        """Train mode for the gradient-carrying forward of ``logprobs`` (LoRA dropout applies), eval mode for every
        no-grad forward. The mode is set at the start of each forward and left as it is afterwards: under gradient
        checkpointing the backward pass re-runs the training forward, and that recomputation must see the same
        (train) mode, so ``logprobs`` does not switch back to eval on return."""
        self.transformer.train(train)

    @contextlib.contextmanager
    def reference(self):
        """The reference policy, in eval mode: LoRA adapters disabled, or (full fine-tuning) a frozen copy of the
        initial weights in the load dtype (:meth:`init_reference`)."""
        if self.use_lora:
            self._set_mode(False)
            self.transformer.disable_adapters()
            try:
                yield self.transformer
            finally:
                self.transformer.enable_adapters()
        else:
            self.init_reference()
            yield self._reference_model

    def init_reference(self) -> None:
        """Snapshot the reference weights now (full fine-tuning keeps a frozen, eval-mode copy of the initial model).

        The copy is in the dtype the model was loaded in (``load_dtype``, e.g. bfloat16), not in the fp32 the
        trainable weights were cast to: half the memory, and what the reference of a LoRA run (the frozen base) is
        too. Its parameters are cast while copying, so no second fp32 transformer is ever held."""
        if self.use_lora or self._reference_model is not None:
            return
        memo = {id(p): torch.nn.Parameter(p.detach().to(self.load_dtype, copy=True), requires_grad=False)
                for p in self.transformer.parameters()}  # buffers were never cast: they keep the load dtype
        self._reference_model = copy.deepcopy(self.transformer, memo).requires_grad_(False).eval()

    def lora_state_dict(self, state_dict: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The LoRA tensors, from the live transformer or from its ``state_dict`` (a sharded model's, gathered)."""
        from peft.utils import get_peft_model_state_dict

        return get_peft_model_state_dict(self.transformer, state_dict=state_dict)

    def export(self, directory: str, state_dict: dict[str, Tensor] | None = None) -> None:
        """Trainable part in the format its ecosystem loads: diffusers LoRA file or a full transformer folder.
        ``state_dict``: the transformer's whole state when FSDP shards it (:func:`mmrl.distributed.full_model_state`)."""
        if self.use_lora:
            self.family.save_lora(directory, self.lora_state_dict(state_dict))
        elif state_dict is None:
            self.transformer.save_pretrained(f"{directory}/transformer")
        else:  # a plain transformer of the same config holding the gathered weights writes the same folder
            plain = unsharded_class(self.transformer).from_config(self.transformer.config)
            plain.load_state_dict(state_dict)
            plain.save_pretrained(f"{directory}/transformer")

    # -------------------------------------------------------------------------------------- sampling

    def schedule(self, num_steps: int) -> tuple[Tensor, Tensor]:
        """``(sigmas [S+1], timesteps [S])``: the family scheduler's, or with ``time_shift`` set the shifted uniform
        schedule ``sigma = shift t / (1 + (shift - 1) t)`` on ``t = linspace(1, 0, S+1)`` (DanceGRPO's ``--shift``)
        with DanceGRPO's integer timesteps ``int(sigma * 1000)``: the transformer sees ``sigma`` truncated to three
        decimals (0.978 for 0.97826), the SDE step the exact ``sigma``. Computed in float32 as there
        (``sd3_time_shift(shift, torch.linspace(1, 0, S + 1))``), so the truncation falls the same way: at shift 3, 10
        steps, step 3's sigma is 0.87499994 and its timestep 874, not the 875 of the exact 0.875."""
        if self.time_shift is None:
            return self.family.schedule(num_steps, self.resolution)
        t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32)
        sigmas = (self.time_shift * t) / (1 + (self.time_shift - 1) * t)
        return sigmas, torch.trunc(sigmas[:-1] * 1000.0)

    def _noise_levels(self, plan: StepPlan) -> Tensor:
        levels = self.step_noise_levels.clone()
        if plan.sigma_index is not None:  # a merged step takes its first fine step's noise level
            levels = levels[plan.sigma_index[:-1]]
        return torch.where(plan.sde, levels, torch.zeros_like(levels))

    def step_noise_std(self, sigmas: Tensor) -> Tensor:
        """``[S]``: the std of each fine step's Gaussian transition if it were an SDE step at its noise level (the
        step entropy E-GRPO merges on is ``gaussian_step_entropy`` of it)."""
        zero = torch.zeros(1, 1)
        return torch.stack([
            sde_step(zero, zero, sigmas[s].item(), sigmas[s + 1].item(), kind=self.sde,
                     noise_level=self.step_noise_levels[s].item(), noise=zero,
                     sigma_one_substitute=sigmas[1].item()).std.reshape(())
            for s in range(len(sigmas) - 1)])

    def _plan(self, update: int, generator: torch.Generator, sigmas: Tensor) -> StepPlan:
        merging = self.plan_kwargs["mode"] == "entropy_merge"
        extra = {"step_noise_std": self.step_noise_std(sigmas)} if merging else {}
        return plan_steps(num_steps=self.num_steps, update=update, generator=generator, **self.plan_kwargs, **extra)

    def _initial_noise(self, n: int, group_size: int, generator: torch.Generator) -> Tensor:
        shape = self.family.latent_shape(self.resolution)
        if self.share_group_noise:
            noise = torch.randn((n // group_size, *shape), generator=generator)
            return noise.repeat_interleave(group_size, dim=0)
        return torch.randn((n, *shape), generator=generator)

    def _velocity(self, model, x: Tensor, step: Tensor, timesteps: Tensor, cond: dict[str, Tensor]) -> Tensor:
        return self.family.velocity(model, x, timesteps[step], cond, self._negative, self.guidance_scale,
                                    detach_uncond=self.cfg_detach_uncond)

    @torch.no_grad()
    def rollout(self, prompts: list, group_size: int, *, generator: torch.Generator, update: int = 0,
                metadata: list[dict] | None = None, group_offset: int = 0, on_chunk=None) -> FlowRollout:
        """Sample ``group_size`` trajectories for each prompt (``N = len(prompts) * group_size``). ``prompts`` are
        strings, or prompt items with ``.prompt`` and ``.metadata`` (what the trainer passes). ``on_chunk(images,
        prompts, metadata)`` is called with each decoded chunk of ``sample_batch_size`` images as soon as it is
        ready, so scoring can overlap with sampling the next chunk."""
        if prompts and not isinstance(prompts[0], str):
            metadata = [item.metadata for item in prompts]
            prompts = [item.prompt for item in prompts]
        n = len(prompts) * group_size
        sigmas, timesteps = self.schedule(self.num_steps)
        plan = self._plan(update, generator, sigmas)
        noise_levels = self._noise_levels(plan)
        if plan.sigma_index is not None:  # E-GRPO: sample on the merged grid (S' steps, S'+1 latents)
            sigmas, timesteps = sigmas[plan.sigma_index], timesteps[plan.sigma_index[:-1]]
        num_steps = len(timesteps)
        cond = self.family.encode(list(prompts))  # once per prompt, not per sample
        prompt_index = torch.arange(len(prompts)).repeat_interleave(group_size)
        x = self._initial_noise(n, group_size, generator)
        step_noise = torch.randn((num_steps, *x.shape), generator=generator)
        latents = torch.empty((n, num_steps + 1, *x.shape[1:]))
        latents[:, 0] = x
        train_pos = {int(s): j for j, s in enumerate(plan.train)}
        old_logps = torch.zeros(n, len(plan.train))
        x0_pred = torch.empty((n, num_steps, *x.shape[1:])) if self.keep_x0 else None
        meta = metadata if metadata is not None else [{} for _ in prompts]
        images_list: list[Tensor] = []
        self._set_mode(False)
        for start in range(0, n, self.sample_batch_size):
            rows = slice(start, min(n, start + self.sample_batch_size))
            batch_cond = {k: v[prompt_index[rows].to(v.device)] for k, v in cond.items()}
            xb = x[rows].to(self.device)
            for s in range(num_steps):
                b = xb.shape[0]
                v = self._velocity(self.transformer, xb, torch.full((b,), s), timesteps.to(self.device), batch_cond)
                if x0_pred is not None:  # x0_hat = x - sigma v (REFERENCE.md section 1), free: v is computed anyway
                    x0_pred[rows, s] = (xb.float() - sigmas[s].item() * v).cpu()
                if s == num_steps - 1 and self.final_image == "prediction":
                    final = (xb.float() - sigmas[s].item() * v.float()).to(xb.dtype)
                out = sde_step(xb, v, sigmas[s].item(), sigmas[s + 1].item(),
                               kind=self.sde if plan.sde[s] else "ode",
                               noise_level=noise_levels[s].item() if plan.sde[s] else None,
                               noise=step_noise[s, rows].to(self.device) if plan.sde[s] else None,
                               sigma_one_substitute=sigmas[1].item())
                xb = out.prev_sample
                latents[rows, s + 1] = xb.cpu()
                if s in train_pos:
                    old_logps[rows, train_pos[s]] = out.log_prob.cpu()
            chunk = self.family.decode(final if self.final_image == "prediction" else xb).cpu()
            images_list.append(chunk)
            if on_chunk is not None:
                on_chunk(chunk, [prompts[i] for i in prompt_index[rows].tolist()],
                         [meta[i] for i in prompt_index[rows].tolist()])
        images = torch.cat(images_list)
        group_ids = torch.arange(len(prompts)).repeat_interleave(group_size) + group_offset
        return FlowRollout(
            prompts=[p for p in prompts for _ in range(group_size)],
            metadata=[m for m in meta for _ in range(group_size)],
            group_ids=group_ids, images=images, latents=latents, sigmas=sigmas, timesteps=timesteps, plan=plan,
            noise_levels=noise_levels, old_logps=old_logps, mask=torch.ones_like(old_logps),
            cond={k: v.cpu() for k, v in cond.items()}, prompt_index=prompt_index,
            extras={"x0_pred": x0_pred} if x0_pred is not None else {},
        )

    def logprobs(self, rollout: FlowRollout, index: Tensor, steps: Tensor | None = None, *,
                 with_kl: bool = False) -> LogProbOutput:
        """Log-probs ``[n, t]`` of the stored transitions of samples ``index`` at trained-step positions ``steps``
        (default: all ``T``), under the current parameters, in one batched forward. With ``with_kl`` also
        Flow-GRPO's KL to the reference policy per step (REFERENCE.md section 2)."""
        index = torch.as_tensor(index, dtype=torch.long)
        positions = torch.arange(len(rollout.plan.train)) if steps is None else torch.as_tensor(steps)
        step_ids = rollout.plan.train[positions]  # [t]
        n, t = len(index), len(step_ids)
        # batch order: step-major, so that row r = j * n + i is sample index[i] at step_ids[j]
        rows = index.repeat(t)
        srep = step_ids.repeat_interleave(n)
        x = rollout.latents[rows, srep].to(self.device)
        x_next = rollout.latents[rows, srep + 1].to(self.device)
        cond = {k: v[rollout.prompt_index[rows]].to(self.device) for k, v in rollout.cond.items()}
        sigma = rollout.sigmas[srep].to(self.device)
        sigma_next = rollout.sigmas[srep + 1].to(self.device)
        levels = rollout.noise_levels[srep].to(self.device)
        timesteps = rollout.timesteps.to(self.device)

        def step(model):
            v = self._velocity(model, x, srep.to(self.device), timesteps, cond)
            return sde_step(x, v, sigma, sigma_next, kind=self.sde, noise_level=levels, prev_sample=x_next,
                            sigma_one_substitute=rollout.sigmas[1].item())

        ref = None
        if with_kl:  # first, in eval mode, so the training forward below is the last one before backward
            with torch.no_grad(), self.reference() as ref_model:
                ref = step(ref_model)
        # train mode only when this forward carries gradients (LoRA dropout on); a no-grad call (old log-probs)
        # is in eval mode, like the rollout that produced them
        self._set_mode(torch.is_grad_enabled())
        out = step(self.model)
        logps = out.log_prob.view(t, n).T
        kl = None if ref is None else flow_kl(out.mean, ref.mean, out.noise_scale).view(t, n).T
        return LogProbOutput(logps=logps, kl=kl)

    def intermediate_starts(self, rollout: FlowRollout) -> list[int]:
        """Latent indices whose completions give ``R_0 .. R_{T-1}``: before the first trained step, then after each
        trained step but the last (``R_T`` is the rollout's own final sample)."""
        train = rollout.plan.train.tolist()
        return [train[0]] + [s + 1 for s in train[:-1]]

    @torch.no_grad()
    def intermediate_images(self, rollout: FlowRollout, mode: str = "ode") -> tuple[Tensor, int]:
        """Images ``[N, T+1, 3, H, W]`` the trajectories would reach from the latent before the first trained step
        and after each trained step, and the extra transformer evaluations (NFE, CFG counted twice) this cost.

        ``mode="ode"``: deterministic ODE completion to sigma = 0 (TP-GRPO, DenseGRPO, TempFlow-GRPO); from the
        initial noise this is the pure-ODE baseline sample ``R_0``. ``mode="x0"``: the one-step prediction
        ``x0 = x - sigma v`` stored during the rollout (no extra NFE; needs ``keep_x0``), an approximation: its
        first column is the prediction from the first trained step's latent, not the pure-ODE sample.
        The last column is always the rollout's final image (``rollout.outputs``, what its reward scored), as
        TP-GRPO's ``R_n`` (the SDE sample's reward) and DenseGRPO's end point (the reward of ``x_0``): where SDE
        steps follow the last trained step (``train_steps: fraction``), their noise is credited to that step."""
        starts = self.intermediate_starts(rollout)
        n, steps = len(rollout), self.num_steps
        out = torch.empty((n, len(starts) + 1, 3, self.resolution, self.resolution))
        out[:, -1] = rollout.outputs
        nfe = 0
        passes = 2 if self._use_cfg else 1
        self._set_mode(False)
        for k, start in enumerate(starts):
            for i in range(0, n, self.sample_batch_size):
                rows = torch.arange(i, min(n, i + self.sample_batch_size))
                if mode == "x0":
                    if "x0_pred" not in rollout.extras:
                        raise ValueError("x0 intermediate rewards need the policy built with keep_x0=True")
                    z = rollout.extras["x0_pred"][rows, start].to(self.device)
                else:
                    z = rollout.latents[rows, start].to(self.device)
                    cond = {key: v[rollout.prompt_index[rows]].to(self.device) for key, v in rollout.cond.items()}
                    timesteps = rollout.timesteps.to(self.device)
                    for s in range(start, steps):
                        v = self._velocity(self.transformer, z, torch.full((len(rows),), s), timesteps, cond)
                        z = sde_step(z, v, rollout.sigmas[s].item(), rollout.sigmas[s + 1].item(), kind="ode").prev_sample
                        nfe += passes * len(rows)
                out[rows, k] = self.family.decode(z).cpu()
        return out, nfe

    @torch.no_grad()
    def sample_eval(self, prompts: list[str], seeds: list[int], *, num_steps: int | None = None) -> Tensor:
        """Deterministic evaluation images ``[len(prompts) * len(seeds), 3, H, W]`` (row-major: prompt, seed).
        ``prompts`` are strings or prompt items."""
        prompts = [p if isinstance(p, str) else p.prompt for p in prompts]
        num_steps = num_steps or self.eval_num_steps
        sigmas, timesteps = self.schedule(num_steps)
        images = []
        self._set_mode(False)
        for prompt in prompts:
            cond = self.family.encode([prompt])
            # each image's noise from its own seed, as the family's diffusers pipeline draws it
            x = torch.stack([self.family.seeded_noise(self.resolution, s) for s in seeds])
            x = x.to(self.device)
            batch_cond = {k: v.expand(len(seeds), *v.shape[1:]) for k, v in cond.items()}
            for s in range(num_steps):
                v = self._velocity(self.transformer, x, torch.full((len(seeds),), s), timesteps.to(self.device),
                                   batch_cond)
                x = sde_step(x, v, sigmas[s].item(), sigmas[s + 1].item(), kind="ode").prev_sample
            images.append(self.family.decode(x).cpu())
        return torch.cat(images)
