"""The one training loop: rollout -> score -> advantages -> inner epochs -> log / eval / save.

It knows nothing model-specific. A policy provides ``rollout(items, group_size, ...)`` returning
``outputs`` (what the rewards judge: images, completions), ``old_logps [N, T]`` (or ``None``: then the loop
computes them before the first update, in the first inner epoch's minibatch layout, so the first ratio is
exactly 1), ``mask [N, T]``, ``prompts``, ``metadata`` and ``group_ids``;
``logprobs(rollout, index, steps, with_kl)`` under current parameters; ``trainable_parameters()``;
``named_trainable_parameters()``; ``prepare(accelerator)``; ``export(dir)``; ``sample_eval(prompts, seeds)``.
A reward is ``reward(images, prompts, metadata) -> {name: [N], ..., "total": [N]}`` with ``weights``
naming the components that enter the advantage (:class:`mmrl.rewards.ComposedReward`). Everything algorithmic comes from :mod:`mmrl.core` by name.

Every random draw of update ``k`` comes from a generator seeded by ``(seed, k, process)`` (dropout from each
process's own global stream, saved per process), and every piece of loop state is in the checkpoint, so a run
stopped after 2 of 4 updates and resumed equals 4 straight updates. Raising ``train.steps`` on resume (``2 steps``,
then ``resume`` with 4) equals 4 straight updates only where nothing depends on the total: the learning-rate
schedule and the variants whose schedules read ``total_updates`` do.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object

from mmrl.checkpoint import (COMPLETE_MARKER, damaged, latest_checkpoint, load_checkpoint, load_trainable,
                             process_rng_states, read_state, restore_data_state, restore_rng_states, save_checkpoint,
                             set_aside_newer)
from mmrl.config import Config, ConfigError, config_to_dict, dump_config
from mmrl.algorithms import (AdvantageContext, Intermediate, RewardContext, Rewards, SelectContext, SurrogateContext,
                             TransformContext, build_variants)
from mmrl.core.advantages import PerPromptStatTracker, combine_rewards, group_index, weighted_total
from mmrl.core.losses import high_entropy_mask, policy_loss, sampler_importance_weights
from mmrl.distributed import (broadcast_from_main, check_engine, configure_deepspeed, configure_fsdp,
                              deepspeed_engine, deepspeed_stage, full_model_state, full_optimizer_state, full_tensor,
                              is_dtensor, is_zero3, load_full_optimizer_state)
from mmrl.ema import EMA
from mmrl.health import RunHealth
from mmrl.data.prompts import DataError, EmptyBatchError, PromptSource
from mmrl.tracking import MetricsLogger, make_grid_image

logger = logging.getLogger(__name__)


def _update_seed(seed: int, update: int, rank: int) -> int:
    return (seed * 1_000_003 + update * 7_919 + rank * 104_729) % (2**63 - 1)


#: config fields a resume cannot change: they define what the checkpoint's weights and data position mean
#: (another model, LoRA shape or trainable set, prompt set or data order). Everything else applies on resume.
FIXED_ON_RESUME = ("model.family", "model.pretrained", "model.revision", "model.use_lora", "model.lora_rank",
                   "model.lora_alpha", "model.lora_target_modules", "model.freeze_vision", "data.dataset",
                   "data.prompts", "data.prompt_list", "data.shuffle", "seed", "sampling.num_steps")


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "rewards":
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resume_changes(saved: dict | None, now: dict, path) -> dict[str, tuple[Any, Any]]:
    """``{field: (checkpoint value, configured value)}`` for every field a resume changes; a
    :class:`ConfigError` listing them when any is in :data:`FIXED_ON_RESUME`. ``saved`` is the checkpoint's
    config (``None`` for checkpoints written before configs were saved in them: nothing to compare)."""
    if saved is None:
        return {}
    before, after = _flatten(saved), _flatten(now)
    changes = {k: (before.get(k), after.get(k)) for k in sorted(set(before) | set(after))
               if before.get(k) != after.get(k) and k not in ("resume", "output_dir")}
    fixed = [k for k in changes if k in FIXED_ON_RESUME]
    if fixed:
        diff = "; ".join(f"{k}: {changes[k][0]!r} in the checkpoint, {changes[k][1]!r} now" for k in fixed)
        raise ConfigError(f"cannot resume {path} with a changed {', '.join(fixed)} ({diff}): these define what the "
                          f"checkpoint's weights and data position mean; start a new output_dir instead")
    return changes


def check_resume(config: Config) -> None:
    """Before anything is built: a resume whose config changes a field the checkpoint fixes is a
    :class:`ConfigError` now, not after the model has loaded (:func:`resume_changes`)."""
    if not config.resume:
        return
    directory = Path(config.output_dir) / "checkpoints"
    path = latest_checkpoint(directory) if config.resume == "auto" else Path(config.resume)
    if path is None or not (path / COMPLETE_MARKER).is_file():
        return
    resume_changes(read_state(path).get("config"), config_to_dict(config), path)


def fused_adamw_applies(params: list[torch.Tensor], scaler=None) -> bool:
    """Whether to use torch's fused AdamW kernel: parameters in floating point on CPU or CUDA, and no fp16
    GradScaler (a fused step takes the scaler's inf check into the kernel and is always called, so a skipped step
    could not be counted). One kernel per parameter instead of torch's default per-tensor loop (CPU) or foreach
    path (CUDA, which also holds a temporary copy of the weights during the step); the same AdamW update, to
    float rounding."""
    return scaler is None and bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda")
                                                   for p in params)


def build_lr_scheduler(optimizer, name: str, warmup: int, total: int):
    """``constant`` / ``linear`` / ``cosine`` decay after a linear warm-up, as transformers' ``get_scheduler``
    except the warm-up: step k (from 0) of ``warmup`` runs at ``(k + 1) / warmup`` of the lr (mmrl's rule, so the
    first step trains; transformers and diffusers run it at 0, ``k / warmup``). The shipped bases were trained
    with it."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        if name == "linear":
            return max(0.0, 1.0 - progress)
        if name == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def resolve_minibatch_order(order: str, policy) -> str:
    """``train.minibatch_order`` with 'auto' resolved: 'groups' where the policy runs each distinct prompt once per
    forward (a VLM with ``share_prompt_prefix``), 'samples' otherwise."""
    if order == "auto":
        return "groups" if getattr(policy, "share_prompt_prefix", False) else "samples"
    return order


def minibatch_order(group_ids: torch.Tensor, order: str, generator: torch.Generator) -> torch.Tensor:
    """One inner epoch's order of an update's local samples, cut into minibatches in this order: ``'samples'`` a
    seeded permutation of every sample, ``'groups'`` a seeded permutation of the groups (``group_ids``), each
    group's samples kept together in their stored order."""
    n = len(group_ids)
    if order == "samples":
        return torch.randperm(n, generator=generator)
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    rank = torch.argsort(torch.randperm(len(groups), generator=generator))  # each group's place in the order
    return torch.sort(rank[inverse] * n + torch.arange(n)).indices  # a group's samples in stored order


def informative_rows(advantages: torch.Tensor, num_minibatches: int, generator: torch.Generator,
                     trainable: torch.Tensor | None = None) -> torch.Tensor:
    """``algorithm.drop_zero_advantage``: the rows (a bool mask over this process's samples) one update trains under
    Flow-GRPO's filter (``scripts/train_sd3.py``): every sample whose advantage is non-zero at some step, plus randomly
    chosen zero-advantage ones (``torch.randperm`` over them, as there) until the kept count is a multiple of
    ``num_minibatches``, when enough of them are left. Where no sample moves, one per minibatch is kept instead of
    none, as TurningPoint-GRPO's fork of the script pads (``true_count == 0``; Flow-GRPO's own reshape of an empty
    batch fails). ``trainable`` (bool ``[N]``): rows with an action in the loss (mmrl's: a row a variant or
    ``mask_truncated_completions`` left out counts as not informative and pads only after every trainable one)."""
    trainable = torch.ones(len(advantages), dtype=torch.bool) if trainable is None else trainable.bool()
    keep = (advantages.reshape(len(advantages), -1).abs().sum(-1) != 0) & trainable
    count = int(keep.sum())
    missing = num_minibatches if count == 0 else -count % num_minibatches
    spare = torch.nonzero(~keep & trainable).flatten()
    spare = spare[torch.randperm(len(spare), generator=generator)]
    spare = torch.cat([spare, torch.nonzero(~keep & ~trainable).flatten()])
    if missing and len(spare) >= missing:
        keep[spare[:missing]] = True
    return keep


def reward_spread_stats(components: dict[str, torch.Tensor], weights: dict[str, float], labels, *,
                        nansum: bool = False) -> dict[str, float]:
    """TRL 1.16's ``reward_std`` and ``frac_reward_zero_std`` (under its default ``scale_rewards="group"``) for the
    weighted total reward of an update's batch (every process): ``reward/std`` the unbiased std of the total over the
    judged samples (``nanstd(rewards)``), ``reward/frac_zero_std`` the share of judged samples whose group
    (``labels``) has no spread (all its judged totals equal: no advantage, no signal). The total is summed as the
    advantages sum it: NaN-propagating, or with ``nansum`` (``reward_combination: nansum_then_normalize``) over the
    components that judged the sample. Per-sample rewards only (dense ``[N, T]`` ones have their own statistics):
    ``{}`` otherwise. ``reward/mean`` is that total's mean over the judged samples (TRL's ``reward``), so mean and
    std describe the same numbers (with ``nansum`` the component-wise NaN-propagating ``reward/total`` counted fewer
    samples)."""
    if any(v.dim() != 1 for v in components.values()):
        return {}
    total = weighted_total({k: v for k, v in components.items() if k in weights}, weights, nansum=nansum)
    judged = torch.isfinite(total)
    if not bool(judged.any()):
        return {"reward/mean": float("nan"), "reward/std": float("nan"), "reward/frac_zero_std": float("nan")}
    index, count = group_index(labels)
    flat = total[judged]
    groups = index[judged]
    high = torch.full((count,), float("-inf"), dtype=torch.float64).scatter_reduce(0, groups, flat, "amax")
    low = torch.full((count,), float("inf"), dtype=torch.float64).scatter_reduce(0, groups, flat, "amin")
    return {"reward/mean": float(flat.mean()), "reward/std": float(flat.std()) if flat.numel() > 1 else 0.0,
            "reward/frac_zero_std": float((high[groups] == low[groups]).double().mean())}


class RewardBatches:
    """Regroups the sampler's chunks (``sample_batch_size`` images) into reward calls of exactly
    ``reward_batch_size`` images (the last one shorter), so ``train.reward_batch_size`` means the same with
    overlapped scoring as without."""

    def __init__(self, size: int, submit):
        self.size, self.submit = size, submit
        self.images: list[torch.Tensor] = []
        self.prompts: list[str] = []
        self.metadata: list[dict] = []

    def add(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> None:
        self.images.append(images)
        self.prompts.extend(prompts)
        self.metadata.extend(metadata)
        while len(self.prompts) >= self.size:
            self._emit(self.size)

    def flush(self) -> None:
        if self.prompts:
            self._emit(len(self.prompts))

    def _emit(self, count: int) -> None:
        images = torch.cat(self.images) if len(self.images) > 1 else self.images[0]
        self.submit(images[:count], self.prompts[:count], self.metadata[:count])
        self.images = [images[count:]] if count < len(images) else []
        self.prompts, self.metadata = self.prompts[count:], self.metadata[count:]


def values_by_key(stats: dict[str, float], accelerator) -> dict[str, list[float]]:
    """Every process's value of each key of ``stats`` (a collective with several processes; the processes that
    report a key, in rank order)."""
    parts = gather_object([dict(stats)]) if accelerator.num_processes > 1 else [stats]
    values: dict[str, list[float]] = {}
    for part in parts:
        for key, value in part.items():
            values.setdefault(key, []).append(float(value))
    return values


def mean_over_processes(stats: dict[str, float], accelerator) -> dict[str, float]:
    """``stats`` (what the variants report, per process) as the mean over the processes that report each key, so
    the logged figure describes every process's samples, not the main process's alone."""
    return {key: sum(v) / len(v) for key, v in values_by_key(stats, accelerator).items()}


class Trainer:
    def __init__(self, config: Config, policy, reward_fn, prompts: PromptSource, accelerator: Accelerator,
                 scorer=None):
        """``scorer``: optional background scorer (``submit(images, prompts, metadata) -> Future``) that the loop
        feeds chunk by chunk during flow rollouts, overlapping scoring with sampling."""
        self.config = config
        self.policy = policy
        self.minibatch_order = resolve_minibatch_order(config.train.minibatch_order, policy)
        self.reward_fn = reward_fn
        self.prompts = prompts
        self.accelerator = accelerator
        self.output_dir = Path(config.output_dir)
        a, o = config.algorithm, config.optim
        self.estimator_kwargs = dict(estimator="grpo", scale=a.scale, eps=a.eps, std_ddof=a.std_ddof,
                                     clamp=a.advantage_clamp)
        #: the algorithm variants (mmrl.algorithms), in config order; the loop calls the stages they override
        self.variants = build_variants(config)
        self.tracker = PerPromptStatTracker(**self.estimator_kwargs)
        params = policy.trainable_parameters()
        if not params:
            raise ValueError("the policy has no trainable parameters")
        self.optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay,
                                           eps=o.adam_eps,
                                           fused=fused_adamw_applies(params, getattr(accelerator, "scaler", None)))
        if self._micro_per_optimizer_step() > self._micro_batches_per_epoch() and accelerator.is_main_process:
            logger.warning("train.gradient_accumulation_steps=%d is more than the %d minibatches of an update: each "
                           "optimizer step accumulates the %d there are (the loss is a mean over them)",
                           self._micro_per_optimizer_step(), self._micro_batches_per_epoch(),
                           self._micro_batches_per_epoch())
        steps_per_epoch = -(-self._micro_batches_per_epoch() // self._micro_per_optimizer_step())
        total_optimizer_steps = config.train.steps * config.train.inner_epochs * steps_per_epoch
        self.lr_scheduler = build_lr_scheduler(self.optimizer, o.lr_scheduler, o.warmup_steps, total_optimizer_steps)
        check_engine(accelerator)
        configure_fsdp(accelerator)
        if deepspeed_stage(accelerator) is not None:
            configure_deepspeed(accelerator, micro_batch=config.train.batch_size, max_grad_norm=o.max_grad_norm)
        if accelerator.distributed_type == DistributedType.FSDP and accelerator.num_processes > 1:
            broadcast_from_main(policy.trainable_parameters())  # DDP would broadcast rank 0's initial weights itself
        if a.beta > 0 and not getattr(policy, "use_lora", True):
            policy.init_reference()  # the frozen copy of a full fine-tune, taken before FSDP could shard what it copies
        self.optimizer = policy.prepare(accelerator, self.optimizer)
        #: DeepSpeed: the engine that takes each backward and optimizer step
        self.engine = deepspeed_engine(accelerator)
        #: FSDP2: the trainable parameters are DTensor shards (:mod:`mmrl.distributed`)
        self.sharded = any(is_dtensor(p) for p in policy.trainable_parameters())
        #: ZeRO-3: every weight is partitioned, gathered by the engine's hooks per forward
        self.zero3 = is_zero3(self.engine)
        if (self.sharded or self.zero3) and o.ema:
            raise ConfigError("optim.ema is not supported with FSDP sharding or ZeRO-3: its shadow weights would be "
                              "shards, which checkpoints and evaluation do not gather; turn optim.ema off or train "
                              "with DDP or ZeRO-2")
        copying = [v.name for v in self.variants if v.copies_weights]
        if self.zero3 and copying:
            raise ConfigError(f"variant(s) {', '.join(copying)} keep a copy of the trainable weights to swap in, which "
                              "ZeRO-3's partitioned weights do not allow: train with ZeRO-2, FSDP2 or DDP")
        self.ema = EMA(policy.named_trainable_parameters(), o.ema_decay, update_interval=o.ema_update_interval,
                       warmup=o.ema_warmup) if o.ema else None
        for variant in self.variants:
            variant.setup(policy, config)
        self.scorer = scorer
        self.reward_counts: dict[str, float] = {}  # per update: unparseable / NaN counts of the reward components
        self.nan_reasons_shown: set[tuple[str, str]] = set()  # (reward, reason) already printed
        self.variant_stats: dict[str, float] = {}  # per update: what the variants and their extra passes report
        #: the score components entering the advantage and their weights (the reward's, as the variants leave them)
        self.advantage_weights: dict[str, float] = dict(reward_fn.weights)
        self.update = 0  # completed updates
        self._eval_plan = None  # eval.benchmarks read once (mmrl.eval.runner.plan_training_eval)
        self.initial_eval: dict[str, float] = {}  # eval.benchmarks of the untrained weights (update 0 of this run)
        self.eval_headlines: dict[str, str] = {}  # benchmark -> the logged key of its headline metric
        self.kept_rows: torch.Tensor | None = None  # algorithm.drop_zero_advantage: the last update's trained rows
        self.optimizer_steps = 0
        self.training_phase = False  # within an update: its training passes have begun

    # ------------------------------------------------------------------------------------------ sizes

    def _trained_per_process(self) -> int:
        """Rows trained per update on each process: the sampled ones, times a variant's other role (PRCO)."""
        c = self.config
        rows = max([v.trained_rows_per_sample for v in self.variants], default=1)
        return c.data.prompts_per_step * c.data.group_size * rows

    def _micro_batches_per_epoch(self) -> int:
        return self._trained_per_process() // self.config.train.batch_size

    def _micro_per_optimizer_step(self) -> int:
        return self.config.train.gradient_accumulation_steps

    # ------------------------------------------------------------------------------------- checkpoints

    def _full_weights(self):
        """The policy's whole weights for the block when FSDP or ZeRO-3 split them (every process enters), else
        nothing."""
        return self.policy.full_weights() if self.sharded or self.zero3 else contextlib.nullcontext()

    def _skipped_in_all(self) -> dict[str, int]:
        """The policy's bad-sample skip counts since the run began, summed over every process (a collective: a bad
        sample may be on any of them)."""
        counts = values_by_key(dict(getattr(self.policy, "skipped", {})), self.accelerator)
        return {reason: int(sum(v)) for reason, v in counts.items()}

    def save(self) -> None:
        acc = self.accelerator
        acc.wait_for_everyone()
        checkpoints = self.output_dir / "checkpoints"
        folders = {}
        if self.engine is not None:  # the optimizer state is partitioned: every process writes its own files
            staging = checkpoints / f".step_{self.update}.tmp-deepspeed"  # swept as a stale temporary if killed
            self.engine.save_checkpoint(str(staging), tag="deepspeed", save_latest=False,
                                        exclude_frozen_parameters=True)
            acc.wait_for_everyone()
            folders["deepspeed"] = staging / "deepspeed"
        model_state = optimizer_state = None
        if self.sharded:  # the whole weights and optimizer state, gathered to the main process (collectives)
            model_state = full_model_state(self.policy.model)
            optimizer_state = full_optimizer_state(self.policy.model, self.optimizer)
        rng = process_rng_states(acc)  # every process's own stream (a collective)
        skipped = self._skipped_in_all()  # a collective too
        # ZeRO-3: the weights gathered for the main process's files (every process enters)
        with self._full_weights() if self.zero3 else contextlib.nullcontext():
            if acc.is_main_process:
                self._write_checkpoint(checkpoints, folders, model_state, optimizer_state, rng, skipped)
        acc.wait_for_everyone()

    def _write_checkpoint(self, checkpoints: Path, folders: dict, model_state, optimizer_state, rng: dict,
                          skipped: dict[str, int]) -> None:
        """The main process's part of :meth:`save`. ``model_state`` / ``optimizer_state``: FSDP's, gathered;
        ``rng``: every process's random state; ``skipped``: the run's skip counts over every process."""
        if self.sharded:  # the same files as an unsharded run's, whole tensors keyed by the same names
            trainable = {name: model_state[name] for name in self.policy.named_trainable_parameters()}
            export = lambda directory: self.policy.export(directory, state_dict=model_state)  # noqa: E731
        else:
            trainable, export = self.policy.named_trainable_parameters(), self._export
        objects = {"lr_scheduler": self.lr_scheduler.state_dict(), "rng": rng}
        if self.accelerator.scaler is not None:  # fp16's loss scale (it took many steps to settle)
            objects["scaler"] = self.accelerator.scaler.state_dict()
        if self.engine is None:  # DeepSpeed's optimizer state is in its own folder
            objects["optimizer"] = optimizer_state if self.sharded else self.optimizer.state_dict()
        if self.ema is not None:
            objects["ema"] = self.ema.state_dict()
        variant_states = {v.name: v.state_dict() for v in self.variants if v.state_dict()}
        if variant_states:  # torch-saved: a variant's state may hold tensors (GRPO-CARE's EMA reference)
            objects["variants"] = variant_states
        state = {"update": self.update, "optimizer_steps": self.optimizer_steps,
                 "data": self.prompts.state_dict(), "tracker": self.tracker.state_dict(),
                 "config": config_to_dict(self.config)}
        if hasattr(self.policy, "step_noise_levels"):
            state["noise_levels"] = self.policy.step_noise_levels.tolist()
        if skipped:
            state["skipped"] = skipped
        if self.engine is not None:
            state["deepspeed_processes"] = self.accelerator.num_processes
        save_checkpoint(checkpoints, self.update, trainable=trainable, state=state, objects=objects,
                        export=export, keep_last=self.config.logging.keep_last, folders=folders)

    def resume(self, target: str) -> int | None:
        """Load ``target`` ('auto' = the latest complete checkpoint in output_dir, if any). Returns its update."""
        path = latest_checkpoint(self.output_dir / "checkpoints") if target == "auto" else Path(target)
        if path is None:
            return None
        trainable, state, objects = load_checkpoint(
            path, objects=("lr_scheduler", "rng") if self.engine is not None else ("optimizer", "lr_scheduler", "rng"),
            state_keys=("update", "optimizer_steps", "data", "tracker"))
        self.resume_changes = resume_changes(state.get("config"), config_to_dict(self.config), path)
        try:  # ZeRO-3: checked against the gathered weights (the engine's own files restore its partitions below)
            with self._full_weights() if self.zero3 else contextlib.nullcontext():
                load_trainable(self.policy.named_trainable_parameters(), trainable, path)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        written_by_deepspeed = "deepspeed_processes" in state
        if written_by_deepspeed != (self.engine is not None):
            raise ConfigError(f"checkpoint {path} was written {'with' if written_by_deepspeed else 'without'} "
                              f"DeepSpeed and this run {'uses' if self.engine is not None else 'does not use'} it: "
                              f"resume it under the engine that wrote it")
        if self.engine is not None:
            self._resume_deepspeed(path, state)
        else:
            sharded_state = isinstance(next(iter(objects["optimizer"]["param_groups"][0]["params"]), 0), str)
            if sharded_state != self.sharded:  # FSDP's state is keyed by parameter name, the plain one's by index
                raise ConfigError(f"checkpoint {path} was written {'with' if sharded_state else 'without'} FSDP "
                                  f"sharding and this run is {'' if self.sharded else 'not '}sharded: resume it the "
                                  f"way it was written (the process count may change)")
            if self.sharded:
                load_full_optimizer_state(self.policy.model, self.optimizer, objects["optimizer"])
            else:
                self.optimizer.load_state_dict(objects["optimizer"])
        self.lr_scheduler.load_state_dict(objects["lr_scheduler"])
        self._apply_optimizer_config()
        if self.ema is not None and "ema" in objects:
            self.ema.load_state_dict(objects["ema"], self.policy.named_trainable_parameters())
        if self.accelerator.scaler is not None and "scaler" in objects:  # fp16's loss scale
            self.accelerator.scaler.load_state_dict(objects["scaler"])
        note = restore_rng_states(objects["rng"], self.accelerator,
                                  reseed=lambda rank: _update_seed(self.config.seed, state["update"], rank))
        if note and self.accelerator.is_main_process:
            logger.warning("resume: %s", note)
        self.update = state["update"]
        self.optimizer_steps = state["optimizer_steps"]
        data_note = restore_data_state(self.prompts, state, path)
        if data_note and self.accelerator.is_main_process:
            logger.warning("resume: %s", data_note)
        try:  # a state.json edited by hand or written by another version
            self.tracker.load_state_dict(state["tracker"])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise damaged(path, f"state.json's loop state does not fit this run ({type(exc).__name__}: "
                                f"{exc})") from None
        for variant in self.variants:
            variant.load_state_dict(objects.get("variants", {}).get(variant.name, {}))
        if "noise_levels" in state:
            self.policy.step_noise_levels = torch.tensor(state["noise_levels"])
        if isinstance(getattr(self.policy, "skipped", None), dict) and self.accelerator.is_main_process:
            self.policy.skipped.update(state.get("skipped", {}))  # the run's counts so far (summed over processes)
        if self.accelerator.is_main_process:  # a rollback: the newer checkpoints of the line it leaves, set aside
            moved = set_aside_newer(self.output_dir / "checkpoints", self.update)
            if moved:
                logger.warning("resume from update %d: the newer checkpoints %s moved to %s (out of resume=auto's "
                               "reach)", self.update, ", ".join(m.name for m in moved), moved[0].parent)
        return self.update

    def _resume_deepspeed(self, path: Path, state: dict) -> None:
        """Load the engine's partitioned optimizer state (and its fp32 master weights) from ``path/deepspeed``. Its
        partitions are cut for the process count that wrote them, so that count must be this run's."""
        written = state["deepspeed_processes"]
        if written != self.accelerator.num_processes:
            raise ConfigError(f"checkpoint {path} was written by {written} DeepSpeed process(es), this run has "
                              f"{self.accelerator.num_processes}: ZeRO partitions the optimizer state per process, "
                              f"resume with --num_processes {written}")
        self.engine.load_checkpoint(str(path), tag="deepspeed", load_module_strict=False,
                                    load_optimizer_states=True, load_lr_scheduler_states=False)

    def _apply_optimizer_config(self) -> None:
        """After loading a checkpoint's optimizer and scheduler: the configured hyperparameters win (a resume with
        ``optim.lr=...`` really trains at the new rate). The scheduler's base rate becomes ``optim.lr`` and the
        current rate is recomputed from its (configured) schedule at the restored step."""
        o = self.config.optim
        for group in self.optimizer.param_groups:
            group.update(betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.adam_eps)
        self.lr_scheduler.base_lrs = [o.lr for _ in self.optimizer.param_groups]
        for group, lr_lambda in zip(self.optimizer.param_groups, self.lr_scheduler.lr_lambdas):
            group["lr"] = o.lr * lr_lambda(self.lr_scheduler.last_epoch)
        self.lr_scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    # ------------------------------------------------------------------------------------------- steps

    def _score(self, rollout) -> dict[str, torch.Tensor]:
        """The run's reward on a rollout; the character spans a text reward reports (``last_info["spans"]``, per
        sample) go to ``rollout.spans`` by component, for span-scoped variants."""
        spans: dict[str, list] = {}
        scores = self._score_outputs(rollout.outputs, rollout.prompts, rollout.metadata, spans=spans)
        if spans and hasattr(rollout, "spans"):
            rollout.spans = spans
        return scores

    def _score_outputs(self, outputs, prompts: list[str], metadata: list[dict],
                       spans: dict[str, list] | None = None) -> dict[str, torch.Tensor]:
        """The run's reward on ``outputs`` in calls of ``train.reward_batch_size``, unparseable / NaN counts kept;
        ``spans`` (given) collects each component's reported character spans per sample (``None`` where it reported
        none)."""
        batch = self.config.train.reward_batch_size
        parts: list[dict[str, torch.Tensor]] = []
        infos: list[dict] = []
        for start in range(0, len(prompts), batch):
            end = start + batch
            parts.append(self.reward_fn(outputs[start:end], prompts[start:end], metadata[start:end]))
            infos.append(getattr(self.reward_fn, "last_info", {}) or {})
            self._count_reward_info(infos[-1])
        if spans is not None:
            names = {k for info in infos for k, c in info.get("components", {}).items() if c.get("spans") is not None}
            for name in sorted(names):
                spans[name] = [s for info, part in zip(infos, parts)
                               for s in (info["components"].get(name, {}).get("spans")
                                         or [None] * len(next(iter(part.values()))))]
        return {k: torch.cat([p[k].float().cpu() for p in parts]) for k in parts[0]}

    def _count_reward_info(self, info: dict) -> None:
        """Unparseable outputs (scored 0) and unjudgeable samples (NaN), counted per reward component; the first
        time a component gives a NaN for a reason (its ``nan_samples``), that reason is printed once."""
        for name, component in (info or {}).get("components", {}).items():
            for key in ("num_unparseable", "num_nan"):
                if component.get(key):
                    tag = f"reward_info/{name}/{key}"
                    self.reward_counts[tag] = self.reward_counts.get(tag, 0.0) + float(component[key])
            reasons = Counter(str(v) for v in (component.get("nan_samples") or {}).values())
            for reason, count in reasons.most_common():
                if (name, reason) not in self.nan_reasons_shown and len(self.nan_reasons_shown) < 20:
                    self.nan_reasons_shown.add((name, reason))  # each reason once, at most 20 in a run
                    self._warn(f"reward {name}: NaN for {count} sample(s) of this batch: {reason}")

    def _users(self, stage: str) -> list:
        """The configured variants that override ``stage``, in config order."""
        return [v for v in self.variants if stage in v.stages()]

    def _needs(self, what: str) -> bool:
        return any(what in v.needs for v in self.variants)

    def _advantages(self, rollout, scores: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """Gather rewards from every process, compute group-relative advantages globally, keep this process's rows:
        the loop's group normalisation, or the ``advantages`` stage of a variant that replaces it. Rows left out of
        the loss (a variant's ``drop``, ``algorithm.mask_truncated_completions``) get a zero mask."""
        truncated_rows = getattr(self.policy, "truncated", None)
        if truncated_rows is not None:  # from the masks as sampled, before any row is left out below
            rollout.extras["truncated"] = truncated_rows(rollout)
        acc, a = self.accelerator, self.config.algorithm
        weights = self.advantage_weights
        local = {k: scores[k].to(acc.device) for k in weights}
        gathered = {k: acc.gather(v).cpu() for k, v in local.items()}
        n_local = len(rollout)
        start = acc.process_index * n_local
        keys = self._condition_keys(rollout)
        keys_all = gather_object(keys) if acc.num_processes > 1 else keys
        group_ids = acc.gather(rollout.group_ids.to(acc.device)).cpu()
        labels = keys_all if a.per_prompt_stat_tracking else group_ids

        def default() -> torch.Tensor:
            if a.per_prompt_stat_tracking:
                return self.tracker.update(keys_all, gathered, weights=weights, mode=a.reward_combination,
                                           batch_normalize=a.batch_normalize_sum,
                                           clamp_sum=a.clamp_summed_advantage)
            return combine_rewards(gathered, group_ids, weights=weights, mode=a.reward_combination,
                                   batch_normalize=a.batch_normalize_sum, clamp_sum=a.clamp_summed_advantage,
                                   **self.estimator_kwargs)

        estimators = self._users("advantages")
        drop = None
        if estimators:
            ctx = AdvantageContext(components=gathered, weights=weights, labels=labels, group_ids=group_ids,
                                   keys=list(keys_all), algorithm=a, update=self.update, default=default,
                                   stats=self.variant_stats)
            adv = estimators[0].advantages(ctx)
            drop = ctx.drop
        else:
            adv = default()
        if drop is not None:  # left out of the loss: no action of these samples is trained
            local_drop = drop[start:start + n_local].to(torch.bool)
            rollout.mask = rollout.mask * (~local_drop).to(rollout.mask.dtype).unsqueeze(1)
        if a.mask_truncated_completions:  # scored and in their groups' statistics above, left out of the loss here
            rollout.mask = rollout.mask * (~rollout.extras["truncated"]).to(rollout.mask.dtype).unsqueeze(1)
        nan_rows = torch.zeros(len(adv), dtype=torch.bool)
        for v in gathered.values():
            nan_rows |= ~torch.isfinite(v if v.dim() == 1 else v.sum(-1))
        stats = {
            **({"samples/dropped_from_loss": float(drop.sum())} if drop is not None else {}),
            "samples/nan_reward": float(nan_rows.sum()),
            "samples/zero_advantage": float((adv.reshape(len(adv), -1).abs().sum(-1) == 0).sum()),
            "advantages/abs_mean": float(adv.abs().mean()),
            **reward_spread_stats(gathered, weights, labels, nansum=a.reward_combination == "nansum_then_normalize"),
        }
        return adv[start:start + n_local], stats

    @staticmethod
    def _condition_keys(rollout) -> list[str]:
        """The key of each sample's condition for per-prompt statistics and value anchors: the rollout's own
        ``condition_keys`` (a VLM sample: its data id, since many images share one question), else the prompt
        text (a generator's whole condition, as Flow-GRPO's tracker keys it)."""
        keys = getattr(rollout, "condition_keys", None)
        return list(keys) if keys is not None else list(rollout.prompts)

    @torch.no_grad()
    def _old_logps(self, rollout, perm: torch.Tensor, step_chunks: list[torch.Tensor], *, skip: int = 0,
                   entropy: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Log-probs of the sampling policy, computed in exactly the minibatch layout of the first inner epoch
        (``kwargs`` to the policy's ``logprobs``: ``masked_vision=True`` for the grey-canvas pass). The first
        ``skip`` samples of ``perm`` are left at 0: the training loop fills them from its live forwards. ``entropy``
        (``[N, T]``): also filled, in place, with the token entropies of the same forwards."""
        old = torch.zeros(rollout.mask.shape)
        if entropy is not None:
            kwargs["with_entropy"] = True
        for i in range(skip, len(perm), self.config.train.batch_size):
            idx = perm[i:i + self.config.train.batch_size]
            for steps in step_chunks:
                with self.accelerator.autocast():
                    out = self.policy.logprobs(rollout, idx, steps, **kwargs)
                old[idx[:, None], steps[None, :]] = out.logps.float().cpu()
                if entropy is not None:
                    entropy[idx[:, None], steps[None, :]] = out.entropy.float().cpu()
        return old

    def _high_entropy_weights(self, rollout, entropy: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """``algorithm.top_entropy_quantile``'s 0/1 mask of the tokens the policy term keeps
        (:func:`high_entropy_mask`) from the sampling policy's token ``entropy``, the quantile taken over every
        process's real tokens, with its threshold, the mean entropy and the kept fraction as metrics."""
        pool = entropy[rollout.mask > 0]
        if self.accelerator.num_processes > 1:
            pool = torch.cat(gather_object([pool]))
        keep, threshold = high_entropy_mask(entropy, rollout.mask, self.config.algorithm.top_entropy_quantile,
                                            pool=pool)
        kept, real = float(keep.sum()), float((rollout.mask > 0).sum())
        if self.accelerator.num_processes > 1:  # the batch's share, not the main process's
            kept, real = (sum(v) for v in zip(*gather_object([(kept, real)])))
        return keep, {"rollout/entropy_threshold": threshold,
                      "rollout/entropy_mean": float(pool.mean()) if pool.numel() else float("nan"),
                      "rollout/high_entropy_fraction": kept / real if real else 0.0}

    def _max_actions(self, rollout) -> int:
        """The constant ``L`` of ``dr_grpo``: the policy's action budget (a VLM's ``max_new_tokens``), else the
        trained-step count of a trajectory (TRL divides by ``max_completion_length``, never by this update's
        longest completion)."""
        budget = getattr(self.policy, "max_new_tokens", None)
        return int(budget) if budget else int(rollout.mask.shape[1])

    @torch.no_grad()
    def _sequence_log_ratio(self, rollout, idx: torch.Tensor, step_chunks: list[torch.Tensor],
                            counts: torch.Tensor) -> torch.Tensor:
        """GSPO's sequence log-ratio ``sum M (logp - old) / sum M`` over the WHOLE trajectory of samples ``idx``,
        from chunked no-grad forwards: what every chunk of a chunked training forward needs as its ratio."""
        total = torch.zeros(len(idx))
        mask = rollout.mask[idx]
        for steps in step_chunks:
            with self.accelerator.autocast():
                logps = self.policy.logprobs(rollout, idx, steps).logps.float().cpu()
            diff = (logps - rollout.old_logps[idx][:, steps]) * mask[:, steps]
            total += diff.sum(-1)
        return total / counts.clamp(min=1.0)

    def _sampler_correction(self, rollout) -> str | None:
        """The importance correction this rollout's sampler log-probs get (``algorithm.sampler_correction``; unset:
        TRL's default ``sequence_mask``), or ``None``: no sampler log-probs (HF generate) or ``none``."""
        if getattr(rollout, "sampler_logps", None) is None:
            return None
        mode = self.config.algorithm.sampler_correction or "sequence_mask"
        return None if mode == "none" else mode

    def _sampler_weight_stats(self, weights: torch.Tensor, mask: torch.Tensor, mode: str) -> dict[str, float]:
        """TRL's ``sampling/importance_sampling_ratio/{min,mean,max}`` over every process: per sample for the
        ``sequence_*`` modes, per real token for the ``token_*`` ones."""
        acc = self.accelerator
        values = weights[:, 0] if mode.startswith("sequence") else weights[mask > 0]
        if acc.num_processes > 1:
            values = torch.cat(gather_object([values.float()]))
        if not values.numel():
            return {}
        return {"rollout/sampler_is_weight_min": float(values.min()), "rollout/sampler_is_weight_mean":
                float(values.mean()), "rollout/sampler_is_weight_max": float(values.max())}

    @staticmethod
    def _sampler_gap(rollout, idx: torch.Tensor, steps: torch.Tensor, old: torch.Tensor, add) -> float:
        """|log p of the rollout engine - log p of the trained model| on this minibatch's real tokens (TRL's
        ``sampling/sampling_logp_difference``): its mean goes to ``add`` weighted by the token count (the update's
        mean), its maximum is returned."""
        mask = rollout.mask[idx][:, steps]
        gap = (rollout.sampler_logps[idx][:, steps] - old.detach().float().cpu()).abs()[mask.bool()]
        gap = gap[torch.isfinite(gap)]  # a token the engine reported no log-prob for (NaN) has no gap to show
        if not gap.numel():
            return float("-inf")
        add("rollout/sampler_logp_gap_mean", float(gap.mean()), float(gap.numel()))
        return float(gap.max())

    def _optimizer_step(self, params) -> tuple[bool, float]:
        """Clip, then step. With a GradScaler (fp16) the scaler decides: a step whose gradients hold inf / NaN is
        skipped by the scaler, which lowers its scale (accelerate reports ``step_was_skipped``); without one a
        non-finite gradient norm skips the step. Returns ``(stepped, grad_norm)``."""
        acc, c = self.accelerator, self.config
        if self.engine is not None:
            # DeepSpeed: the engine reduces the partitioned gradients, clips them to optim.max_grad_norm (its
            # gradient_clipping), skips a step whose gradients are not finite (and lowers an fp16 loss scale), steps
            # AdamW on its fp32 partitions, gathers the weights back and zeroes the gradients
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            stepped = not getattr(self.engine.optimizer, "overflow", False)
            return stepped, float("nan") if norm is None else float(norm)
        scaler = getattr(acc, "scaler", None)
        if c.optim.max_grad_norm > 0:
            norm = acc.clip_grad_norm_(params, c.optim.max_grad_norm)  # unscales first under a scaler
        else:
            if scaler is not None:
                acc.unscale_gradients()
            grads = [full_tensor(p.grad.detach().float().norm()) for p in params if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack(grads)) if grads else torch.tensor(0.0)
        norm = float(full_tensor(norm))
        if scaler is not None:
            self.optimizer.step()
            stepped = not self.optimizer.step_was_skipped
        elif math.isfinite(norm):
            self.optimizer.step()
            stepped = True
        else:
            stepped = False
        self.optimizer.zero_grad(set_to_none=True)
        return stepped, norm

    def _train_on(self, rollout, advantages: torch.Tensor, generator: torch.Generator,
                  scores: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """K inner epochs of minibatches over samples x trained steps; one optimizer step per GA minibatches.

        The layout is a memory knob only: every chunk of steps (``train.timestep_chunk``) and every accumulated
        minibatch is normalised by the whole of what one optimizer step covers (each sample's full action count,
        the local batch's action count for ``bnpo``, the fixed ``L`` of ``dr_grpo``, the global count of ``dapo``,
        the minibatches really accumulated), and GSPO's sequence ratio spans the whole trajectory, so one update
        gives the same loss and gradient for every chunk size and accumulation split."""
        c, acc, policy = self.config, self.accelerator, self.policy
        a, t = c.algorithm, c.train
        n, num_steps = rollout.mask.shape
        chunk = t.timestep_chunk or num_steps
        step_chunks = [torch.arange(s, min(num_steps, s + chunk)) for s in range(0, num_steps, chunk)]
        perms = [minibatch_order(rollout.group_ids, self.minibatch_order, generator)
                 for _ in range(t.inner_epochs)]
        # one optimizer step per update: the sampling policy is the current one for every minibatch, so its
        # log-probs are the current ones, detached (TRL's shortcut), and need no extra pass
        single_step = t.inner_epochs == 1 and -(-n // t.batch_size) <= t.gradient_accumulation_steps
        # the rollout engine's log-probs (vLLM) against the trained model's: the trained model's must all be known
        # before the first step, from the separate pass (TRL computes them whenever it corrects)
        sampler_mode = self._sampler_correction(rollout)
        on_policy = rollout.old_logps is None and single_step and sampler_mode is None
        # several optimizer steps: the minibatches of the FIRST one still see the sampling policy, so where the
        # training forward equals the no-grad one (no dropout) their old log-probs are the live ones, detached, and
        # the separate pass covers only the rest (bit-identical: the same forwards in the same layout)
        # algorithm.top_entropy_quantile: the sampling policy's token entropies, all known before the first step; the
        # old-log-prob pass gives them from its own forwards where there is one (it then covers every sample)
        entropy = torch.zeros(rollout.mask.shape) if a.top_entropy_quantile < 1.0 else None
        entropy_pending = entropy is not None
        live_samples = 0
        if rollout.old_logps is None and not on_policy:
            if getattr(policy, "deterministic_training_forward", False) and not self._needs("old_logps") \
                    and sampler_mode is None and entropy is None and not a.drop_zero_advantage:
                live_samples = min(n, t.batch_size * t.gradient_accumulation_steps)
            rollout.old_logps = self._old_logps(rollout, perms[0], step_chunks, skip=live_samples, entropy=entropy)
            entropy_pending = False
        if self._needs("old_logps") and rollout.old_logps is None:  # a variant reads the sampling policy's log-probs
            rollout.old_logps = self._old_logps(rollout, perms[0], step_chunks, entropy=entropy)
            on_policy = entropy_pending = False
        entropy_stats: dict[str, float] = {}
        if entropy_pending:  # no old-log-prob pass (one on-policy step): a pass of its own
            t0 = time.perf_counter()
            self._old_logps(rollout, perms[0], step_chunks, entropy=entropy)
            entropy_stats["time/entropy_forward"] = time.perf_counter() - t0
        if self._needs("masked_logps"):  # the same completions on grey canvases instead of the images (no gradient)
            t0 = time.perf_counter()
            rollout.masked_logps = self._old_logps(rollout, perms[0], step_chunks, masked_vision=True)
            self.variant_stats["time/masked_forward"] = time.perf_counter() - t0
        if self._needs("perturbed_logps"):  # the same completions on noise-perturbed images (no gradient)
            t0 = time.perf_counter()
            std = max(v.perturbation_std() for v in self.variants if "perturbed_logps" in v.needs)
            rollout.perturbed_logps = self._old_logps(rollout, perms[0], step_chunks, perturbed_vision=std)
            self.variant_stats["time/perturbed_forward"] = time.perf_counter() - t0
        sampler_weights = None
        if sampler_mode is not None:
            sampler_weights = sampler_importance_weights(rollout.old_logps, rollout.sampler_logps, rollout.mask,
                                                         mode=sampler_mode, clip_min=a.sampler_correction_min,
                                                         clip_max=a.sampler_correction_max)
        action_weights = sampler_weights
        bonus_mask = rollout.mask  # the tokens algorithm.entropy_coef's bonus averages over
        if entropy is not None:  # TRL's order: entropy mask, then the sampler weight, on the policy term
            keep, stats = self._high_entropy_weights(rollout, entropy)
            entropy_stats.update(stats)
            action_weights = keep if sampler_weights is None else keep * sampler_weights
            bonus_mask = rollout.mask * keep
        rows = torch.arange(n) + acc.process_index * n  # these samples' rows in the advantages stage's [N_all]
        for variant in self._users("transform"):
            advantages = variant.transform(TransformContext(
                advantages=advantages, scores=scores or {}, rollout=rollout, update=self.update,
                total_updates=c.train.steps, stats=self.variant_stats, policy=policy, rows=rows,
                accelerator=acc))
        num_minibatches = -(-n // t.batch_size)
        self.kept_rows = None  # algorithm.drop_zero_advantage: the rows trained this update
        if a.drop_zero_advantage:
            self.kept_rows = informative_rows(advantages.cpu(), num_minibatches, generator,
                                              trainable=rollout.mask.sum(-1) > 0)
            perms = [perm[self.kept_rows[perm]] for perm in perms]
        surrogates = self._users("surrogate")
        max_length = self._max_actions(rollout)
        sequence_chunks = a.ratio_level == "sequence" and len(step_chunks) > 1
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        skipped_loss = 0
        grad_norms: list[float] = []
        step_losses: list[float] = []
        skipped_steps = 0

        ratio_min, ratio_max = float("inf"), float("-inf")  # true extremes over the update, not means
        gap_max = float("-inf")  # the rollout engine's log-probs against the trained model's (generation.engine)

        def add(key: str, value: float, weight: float = 1.0) -> None:
            sums[key] = sums.get(key, 0.0) + value * weight
            weights[key] = weights.get(key, 0.0) + weight

        # the gap over every sample of the batch, as TRL measures it, where the old log-probs are all known before
        # training (a correction mode forces that pass); else each minibatch's own on its first forward (with
        # algorithm.drop_zero_advantage: the trained rows only)
        gap_before = getattr(rollout, "sampler_logps", None) is not None and rollout.old_logps is not None \
            and live_samples == 0
        if gap_before:
            gap_max = self._sampler_gap(rollout, torch.arange(n), torch.arange(rollout.mask.shape[1]),
                                        rollout.old_logps, add)

        for epoch, perm in enumerate(perms):
            minibatches = [perm[i:i + t.batch_size] for i in range(0, n, t.batch_size)] if self.kept_rows is None \
                else list(torch.tensor_split(perm, num_minibatches))  # Flow-GRPO: equal shares of the kept rows
            for first in range(0, len(minibatches), t.gradient_accumulation_steps):
                group = minibatches[first:first + t.gradient_accumulation_steps]
                live = on_policy or (live_samples > 0 and epoch == 0 and first == 0)  # old log-probs = live ones
                local_items = torch.stack([rollout.mask[idx].sum() for idx in group]).sum()
                num_items = local_items.to(acc.device)
                if acc.num_processes > 1:
                    num_items = acc.reduce(num_items, reduction="sum")
                # grpo / dr_grpo: a mean over the minibatches really accumulated; bnpo / dapo are normalised by the
                # action count of the whole accumulated batch (local / global) instead
                accumulated = len(group) if a.aggregation in ("grpo", "dr_grpo") else 1
                if a.entropy_coef:  # the bonus is a mean over the whole optimizer step's trained tokens
                    bonus_items = torch.stack([bonus_mask[idx].sum() for idx in group]).sum().to(acc.device)
                    if acc.num_processes > 1:
                        bonus_items = acc.reduce(bonus_items, reduction="sum")
                    bonus_scale = bonus_items.clamp(min=1.0) / acc.num_processes  # DDP averages over processes
                step_loss = 0.0
                for g, idx in enumerate(group):
                    mask = rollout.mask[idx]
                    counts = mask.sum(-1)
                    sequence_log_ratio = None
                    if sequence_chunks:
                        sequence_log_ratio = torch.zeros(len(idx)) if live else \
                            self._sequence_log_ratio(rollout, idx, step_chunks, counts)
                    for k, steps in enumerate(step_chunks):
                        sync = g == len(group) - 1 and k == len(step_chunks) - 1
                        # DeepSpeed is told where the optimizer step ends instead (set_gradient_accumulation_boundary)
                        ctx = acc.no_sync(policy.model) if not sync and acc.num_processes > 1 and \
                            self.engine is None else contextlib.nullcontext()
                        with ctx, acc.autocast():
                            out = policy.logprobs(rollout, idx, steps, with_kl=a.beta > 0,
                                                  **({"with_entropy": True} if a.entropy_coef else {}))
                            device = out.logps.device
                            adv = advantages[idx]
                            adv = adv[:, steps] if adv.dim() == 2 else adv
                            if live:
                                old = out.logps.detach()
                                if not on_policy:  # kept for the later inner epochs
                                    rollout.old_logps[idx[:, None], steps[None, :]] = old.float().cpu()
                            else:
                                old = rollout.old_logps[idx][:, steps]
                            if epoch == 0 and not gap_before and \
                                    getattr(rollout, "sampler_logps", None) is not None:
                                gap_max = max(gap_max, self._sampler_gap(rollout, idx, steps, old, add))
                            result = policy_loss(
                                out.logps, old.to(device), adv.to(device), mask[:, steps].to(device),
                                clip_low=a.clip_low, clip_high=a.clip_high, aggregation=a.aggregation,
                                max_length=max_length, kl=out.kl, beta=a.beta, ratio_level=a.ratio_level,
                                gradient_accumulation_steps=accumulated, num_items_in_batch=num_items,
                                num_processes=acc.num_processes, sample_action_counts=counts.to(device),
                                batch_action_count=local_items.to(device),
                                sequence_log_ratio=None if sequence_log_ratio is None else sequence_log_ratio.to(device),
                                surrogate=self._surrogate(surrogates[0], idx, rollout) if surrogates else None,
                                kl_ratio_weight=a.kl_bias_correction, delta=a.delta,
                                action_weight=None if action_weights is None else
                                action_weights[idx][:, steps].to(device),
                            )
                        loss = result.loss
                        if a.entropy_coef:
                            covered = bonus_mask[idx][:, steps].to(device)
                            loss = loss - a.entropy_coef * (out.entropy * covered).sum() / bonus_scale
                            if covered.sum() > 0:
                                add("entropy", float((out.entropy.detach() * covered).sum() / covered.sum()),
                                    float(covered.sum()))
                        if not torch.isfinite(loss):
                            # keep every process in the same backward (DDP) but contribute nothing; ZeRO-3's weights are
                            # partitions outside a forward, so its zero goes through this forward's output instead
                            skipped_loss += 1
                            loss = torch.where(torch.isfinite(out.logps), out.logps, 0.0).sum() * 0.0 if self.zero3 \
                                else sum((p * 0.0).sum() for p in policy.trainable_parameters())
                        else:
                            step_loss += float(loss.detach())
                        if self.engine is not None:  # its own accumulation is 1: no division by it
                            self.engine.set_gradient_accumulation_boundary(sync)
                            self.engine.backward(loss)
                        else:
                            acc.backward(loss)
                        active = float(mask[:, steps].sum())
                        for key, value in result.metrics.items():
                            if key == "ratio/min":
                                ratio_min = min(ratio_min, float(value)) if active else ratio_min
                            elif key == "ratio/max":
                                ratio_max = max(ratio_max, float(value)) if active else ratio_max
                            else:
                                add(key, float(value), active)
                    if self.ema is not None and c.optim.ema_every_minibatch and g < len(group) - 1:
                        # Flow-GRPO calls ema.step after every training batch with the optimizer steps taken so
                        # far: the batches before the step repeat the last step's update on unchanged weights
                        self.ema.update(policy.named_trainable_parameters(), self.optimizer_steps)
                step_losses.append(step_loss)
                # the optimizer's own parameters: under FSDP the list taken before a forward can hold the gathered
                # tensors of a module still unsharded then, not the shards the gradients are reduced into
                stepped, norm = self._optimizer_step([p for g in self.optimizer.param_groups for p in g["params"]])
                if stepped:
                    self.lr_scheduler.step()
                    self.optimizer_steps += 1
                    if self.ema is not None:
                        self.ema.update(policy.named_trainable_parameters(), self.optimizer_steps)
                    grad_norms.append(norm)
                else:
                    skipped_steps += 1
        if acc.num_processes > 1:  # the metrics describe the whole global batch, not the main process's share
            keys = sorted(sums)
            packed = torch.tensor([[sums[k] for k in keys], [weights[k] for k in keys]], dtype=torch.float64,
                                  device=acc.device)
            packed = acc.reduce(packed, reduction="sum").cpu()
            sums, weights = dict(zip(keys, packed[0].tolist())), dict(zip(keys, packed[1].tolist()))
            extremes = gather_object([(ratio_min, ratio_max, gap_max)])
            ratio_min, ratio_max = min(e[0] for e in extremes), max(e[1] for e in extremes)
            gap_max = max(e[2] for e in extremes)  # the batch's largest gap, not the main process's
        metrics = {k: sums[k] / weights[k] if weights[k] > 0 else 0.0 for k in sums}
        if sampler_weights is not None:
            metrics.update(self._sampler_weight_stats(sampler_weights, rollout.mask, sampler_mode))
        metrics.update(entropy_stats)
        if gap_max > float("-inf"):
            metrics["rollout/sampler_logp_gap_max"] = gap_max
        if math.isfinite(ratio_min):
            metrics["ratio/min"], metrics["ratio/max"] = ratio_min, ratio_max
        # the loss of an optimizer step is the sum of its micro-step losses (what the gradient is of); with several
        # processes DDP averages their gradients, so the logged loss is the mean over processes too
        loss_mean = sum(step_losses) / len(step_losses)
        if acc.num_processes > 1:
            loss_mean = float(acc.reduce(torch.tensor(loss_mean, device=acc.device), reduction="mean"))
        metrics["loss"] = loss_mean
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        metrics["train/skipped_nonfinite_loss"] = float(skipped_loss)
        metrics["train/skipped_optimizer_steps"] = float(skipped_steps)
        metrics["lr"] = self.lr_scheduler.get_last_lr()[0]
        return metrics

    @staticmethod
    def _surrogate(variant, idx: torch.Tensor, rollout):
        """The ``surrogate`` stage of ``variant`` as :func:`~mmrl.core.losses.policy_loss` calls it, for the rows
        ``idx`` of this update's local batch."""
        group_ids = rollout.group_ids[idx]

        def per_action(logps, old_logps, log_ratio, ratio, advantages, mask, clip_low, clip_high):
            return variant.surrogate(SurrogateContext(
                logps=logps, old_logps=old_logps, log_ratio=log_ratio, ratio=ratio, advantages=advantages, mask=mask,
                clip_low=clip_low, clip_high=clip_high, index=idx, group_ids=group_ids))

        return per_action

    @contextlib.contextmanager
    def ema_weights(self):
        """Swap the EMA weights in (for evaluation and export), restoring the live ones afterwards."""
        if self.ema is None:
            yield
            return
        params = self.policy.named_trainable_parameters()
        with self.ema.swapped_in(params):
            yield

    def _export(self, directory: str) -> None:
        with self.ema_weights():
            self.policy.export(directory)

    def _evaluate(self) -> dict[str, float]:
        """Fixed evaluation on the main process, EMA weights when enabled: for image policies an ODE grid of fixed
        prompts (rows) x seeds (columns) in ``samples/step_<k>.png``; for text policies greedy answers to the first
        items in ``samples/step_<k>.jsonl``. Both are scored with the run's rewards (``eval/reward/*``)."""
        with self._full_weights():
            return self._evaluate_main() if self.accelerator.is_main_process else {}

    def _evaluate_main(self) -> dict[str, float]:
        c = self.config
        items = list(c.data.eval_prompts) or self._grid_items(c.data.num_eval_prompts)
        seeds = list(c.data.eval_seeds)
        with self.ema_weights():
            outputs = self.policy.sample_eval(items, seeds)
        samples = self.output_dir / "samples"
        samples.mkdir(parents=True, exist_ok=True)
        prompts = [item if isinstance(item, str) else getattr(item, "prompt", None) or item.question for item in items]
        metadata = [{} if isinstance(item, str) else dict(item.metadata) for item in items]
        if hasattr(outputs, "prompts"):  # text answers name the items answered (a skipped bad item has none)
            prompts, metadata = list(outputs.prompts), list(outputs.metadata)
        if isinstance(outputs, torch.Tensor):
            grid = make_grid_image(outputs, rows=len(items))
            grid.save(samples / f"step_{self.update}.png")
            # the grid's rows, top to bottom (its columns are data.eval_seeds)
            (samples / "grid_prompts.txt").write_text("".join(f"{p}\n" for p in prompts))
            if self.logger is not None:
                self.logger.log_image("samples", grid, self.update)
            prompts = [p for p in prompts for _ in seeds]
            metadata = [m for m in metadata for _ in seeds]
        scores = self.reward_fn(outputs, prompts, metadata)
        if not isinstance(outputs, torch.Tensor):
            with open(samples / f"step_{self.update}.jsonl", "w") as handle:
                for i, (prompt, text) in enumerate(zip(prompts, outputs)):
                    row = {"prompt": prompt, "completion": text, **{k: float(v[i]) for k, v in scores.items()}}
                    handle.write(json.dumps(row) + "\n")
        return {f"eval/reward/{k}": float(v[torch.isfinite(v)].mean()) if torch.isfinite(v).any() else float("nan")
                for k, v in scores.items()}

    def _grid_items(self, count: int) -> list:
        """The first ``count`` distinct items of the data, in order: a prompt set balanced by tag
        (``data.balance_tags``) repeats its smaller categories, and the fixed grid showed the same 2 prompts 3 times
        (the default run's 6 rows)."""
        seen, items = set(), []
        for item in self.prompts.items:
            key = repr(item)
            if key not in seen:
                seen.add(key)
                items.append(item)
                if len(items) == count:
                    break
        return items

    def _benchmarks(self) -> dict[str, float]:
        """``eval.benchmarks`` on the live policy (EMA weights when enabled), main process only, into
        ``output_dir/eval/update_<k>/`` (:func:`mmrl.eval.runner.evaluate_policy`); the metrics
        ``eval/<benchmark>/<metric>``."""
        with self._full_weights():
            return self._benchmarks_main() if self.accelerator.is_main_process else {}

    def _benchmarks_main(self) -> dict[str, float]:
        from mmrl.eval.runner import evaluate_policy, plan_training_eval, training_metrics

        try:
            if self._eval_plan is None:
                self._eval_plan = plan_training_eval(self.config)
            with self.ema_weights():
                summary = evaluate_policy(self.policy, self.config, self.update,
                                          self.output_dir / "eval" / f"update_{self.update}",
                                          ema=self.ema is not None, planned=self._eval_plan,
                                          echo=lambda line: self._warn(line[len("mmrl: warning: "):])
                                          if line.startswith("mmrl: warning: ") else None)
        except Exception as exc:
            if self.update == 0:  # nothing trained yet: a benchmark that cannot run is the run's error
                raise
            self._warn(f"the benchmarks at update {self.update} failed ({type(exc).__name__}: {exc}); training goes "
                       f"on, eval/failed = 1 is logged")
            return {"eval/failed": 1.0}
        metrics = training_metrics(summary)
        for name, result in summary.get("benchmarks", {}).items():
            headline = str(result.get("headline") or "")  # e.g. "acc@0.5", "overall", "brightness.mean"
            key = next((k for k in (f"eval/{name}/{headline}", f"eval/{name}/{headline.replace('.', '/')}")
                        if headline and k in metrics), None)
            if key is not None:
                self.eval_headlines[name] = key
        return {**metrics, "eval/failed": 0.0}

    def _logged_initial_eval(self) -> dict[str, float]:
        """The update-0 benchmark metrics of this run as ``metrics.jsonl`` holds them (its ``step`` 0 row), so a
        resumed run still reports its headline from the untrained model on; empty when absent or unreadable."""
        from mmrl.eval.report import read_jsonl

        rows, _ = read_jsonl(self.output_dir / "metrics.jsonl")
        first = next((row for row in rows if row.get("step") == 0), {})
        return {k: v for k, v in first.items() if k.startswith("eval/") and isinstance(v, (int, float))}

    def _write_run_report(self) -> None:
        """``output_dir/report.html``: every ``eval/update_<k>`` evaluation so far side by side, update 0 (the
        untrained model) as the reference column, with the training curves (:func:`mmrl.eval.report.write_report`).
        Rewritten after each evaluation; a failure is a warning."""
        from mmrl.eval.report import write_report

        root = self.output_dir / "eval"
        done = sorted((int(d.name.split("_", 1)[1]), d) for d in root.glob("update_*")
                      if d.name.split("_", 1)[1].isdigit() and (d / "summary.json").is_file())
        if len(done) < 2:
            return
        try:
            write_report([d for _, d in done], self.output_dir / "report.html",
                         labels=[f"update {k}" for k, _ in done])
        except Exception as exc:  # the report is a view of files already written: never the run's failure
            self._warn(f"could not write {self.output_dir / 'report.html'} ({type(exc).__name__}: {exc})")

    def outputs(self) -> dict[str, Path]:
        """What a finished run points its user at: the newest evaluation ``grid`` (``samples/step_<k>.png``), the
        run ``report`` (``report.html``) and the newest ``checkpoint``, those that exist."""
        found: dict[str, Path] = {}
        grids = sorted(self.output_dir.glob("samples/step_*.png"), key=lambda f: int(f.stem.split("_")[1]))
        if grids:
            found["grid"] = grids[-1]
        if (self.output_dir / "report.html").is_file():
            found["report"] = self.output_dir / "report.html"
        checkpoints = sorted((d for d in self.output_dir.glob("checkpoints/step_*") if d.name[5:].isdigit()),
                             key=lambda d: int(d.name[5:]))
        if checkpoints:
            found["checkpoint"] = checkpoints[-1]
        return found

    # ------------------------------------------------------------------------------------------- loop

    def summary(self, resumed: int | None) -> str:
        """The startup summary the main process prints: where, on what, how much per update, from where."""
        c, acc = self.config, self.accelerator
        params = self.policy.trainable_parameters()
        numel = lambda p: getattr(p, "ds_numel", None) or p.numel()  # noqa: E731  (ZeRO-3: the whole count)
        trainable = sum(numel(p) for p in params)
        model = getattr(self.policy, "model", None)
        total = sum(numel(p) for p in model.parameters()) if isinstance(model, torch.nn.Module) else None
        per_process = c.data.prompts_per_step * c.data.group_size
        trained = self._trained_per_process()
        other_role = f" ({trained} rows trained per process with the other role's)" if trained != per_process else ""
        minibatches = self._micro_batches_per_epoch()
        per_step = min(c.train.gradient_accumulation_steps, minibatches) * c.train.batch_size
        steps = -(-minibatches // c.train.gradient_accumulation_steps) * c.train.inner_epochs
        how = (f"LoRA r{c.model.lora_rank} alpha {c.model.lora_alpha}" if c.model.use_lora else "full fine-tuning")
        lines = [
            f"mmrl train -> {self.output_dir}",
            f"  model     {c.model.family} {c.model.pretrained} ({c.model.dtype} frozen weights, fp32 trainable), "
            f"{how}: {trainable:,} trainable parameters" + (f" of {total:,}" if total else ""),
            f"  device    {acc.device}, {acc.num_processes} process(es), mixed precision {c.train.mixed_precision}",
            f"  update    {c.data.prompts_per_step} prompts x {c.data.group_size} samples = {per_process} per process, "
            f"{per_process * acc.num_processes} in all{other_role}; {steps} optimizer steps of {per_step} samples per "
            f"process "
            f"({c.train.inner_epochs} inner epoch(s) of {minibatches} minibatches of {c.train.batch_size}, "
            f"{'whole groups' if self.minibatch_order == 'groups' else 'shuffled samples'})",
            f"  schedule  {c.train.steps} updates, lr {c.optim.lr:g} ({c.optim.lr_scheduler})",
            *([f"  eval      {', '.join(c.eval.benchmarks)} on {c.eval.limit} prompts each, every {c.eval.every} "
               f"update(s) -> {self.output_dir / 'eval'}/update_<k>"] if c.eval.every else []),
            "  start     " + (f"resumed at update {resumed} of {c.train.steps}" if resumed is not None
                               else "a new run"),
        ]
        for key, (before, after) in sorted(getattr(self, "resume_changes", {}).items()):
            lines.append(f"  changed   {key}: {before!r} -> {after!r} (applied from update {resumed})")
            if key == "train.steps":  # what follows the run's length was laid out for the old one until now
                lines.append(f"            the updates so far followed a {before}-update run: an lr schedule over the "
                             f"run (linear, cosine) and the variants that read its length go on over {after} "
                             f"updates from here, so the result is not a straight {after}-update run's")
        return "\n".join(lines)

    def _write_config(self, resumed: int | None) -> None:
        """``config.yaml`` is the run's original config and is never overwritten; each resume writes its own
        resolved config beside it (``config.resume_<update>.yaml``)."""
        original = self.output_dir / "config.yaml"
        if resumed is None or not original.exists():
            dump_config(self.config, original)
        if resumed is not None:
            dump_config(self.config, self.output_dir / f"config.resume_{resumed}.yaml")

    def _install_stop_signals(self):
        """SIGINT / SIGTERM (Ctrl-C, a cluster preemption) ask the loop to stop at the next safe point (after the
        current update), checkpoint and return; a second SIGINT interrupts at once. Returns a restore function.
        Only from the main thread (signal handlers cannot be set elsewhere)."""
        from mmrl.stopping import install_stop_signals

        self.stop_signal = None

        def on_signal(name: str) -> None:
            self.stop_signal = name
            print(f"mmrl: {self.stop_signal} received: stopping after update {self.update + 1} with a checkpoint "
                  f"(Ctrl-C again to stop at once, without one)", flush=True)

        return install_stop_signals(on_signal, lambda: self.stop_signal is not None)

    def _stop_requested(self) -> bool:
        """Whether any process received a stop signal (all processes stop at the same update)."""
        acc = self.accelerator
        flag = torch.tensor(float(getattr(self, "stop_signal", None) is not None), device=acc.device)
        return float(acc.reduce(flag, reduction="max") if acc.num_processes > 1 else flag) > 0

    def _lock_output_dir(self):
        """An exclusive lock on ``output_dir`` for this run (``fcntl.flock`` on ``output_dir/.mmrl-train.lock``, taken
        by the main process, released when the run ends or its process dies, even by SIGKILL), so a second
        ``mmrl train`` on the same folder stops with one line instead of resuming from, and writing over, the
        checkpoints of the first. Returns the open lock file (None where ``fcntl`` does not exist)."""
        acc = self.accelerator
        handle, holder = None, ""
        if acc.is_main_process:
            try:
                import fcntl
            except ImportError:  # not on POSIX: no lock
                fcntl = None
            if fcntl is not None:
                try:
                    self.output_dir.mkdir(parents=True, exist_ok=True)
                    handle = open(self.output_dir / ".mmrl-train.lock", "a+")
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    handle.seek(0)
                    handle.truncate()
                    handle.write(f"{os.getpid()}\n")
                    handle.flush()
                except BlockingIOError:  # another process holds it
                    handle.seek(0)
                    holder = handle.read().strip() or "?"
                    handle.close()
                    handle = None
                except OSError as exc:  # a filesystem without flock (Lustre without -o flock), a read-only lock file
                    if handle is not None:
                        handle.close()
                        handle = None
                    self._warn(f"could not lock {self.output_dir} ({type(exc).__name__}: {exc}); training without "
                               f"the lock that stops a second mmrl train on this folder")
        busy = torch.tensor(float(bool(holder)), device=acc.device)
        if acc.num_processes > 1:  # every process stops together (a sum of 0/1 flags)
            busy = acc.reduce(busy, reduction="sum")
        if float(busy) > 0:
            raise ConfigError(f"{self.output_dir} is being trained by another mmrl train (process {holder or '?'}): "
                              f"wait for it to end, or choose another output_dir (nothing was touched)")
        return handle

    def _check_output_folders(self) -> None:
        """The folders a run writes into (checkpoints, sample grids, evaluations) must be folders it can write, checked
        before the first update so that no finished update is lost to a save that cannot happen."""
        for name in ("checkpoints", "samples", "eval"):
            path = self.output_dir / name
            if path.exists() and not path.is_dir():
                raise ConfigError(f"{path} is not a folder, but the run writes its {name} there: move it away or "
                                  f"choose another output_dir (nothing was written)")
            if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
                raise ConfigError(f"{path} is not writable, but the run writes its {name} there (nothing was "
                                  f"written)")

    def train(self) -> list[dict[str, float]]:
        lock = self._lock_output_dir()
        try:
            return self._train()
        finally:
            if lock is not None:
                lock.close()  # releases the flock

    def _train(self) -> list[dict[str, float]]:
        c, acc = self.config, self.accelerator
        if not c.resume and latest_checkpoint(self.output_dir / "checkpoints") is not None:
            raise ConfigError(f"{self.output_dir} already holds a run with checkpoints: set resume=auto to continue it "
                              f"or choose another output_dir (nothing was overwritten)")
        self._check_output_folders()
        resumed = self.resume(c.resume) if c.resume else None
        self.logger = None
        if acc.is_main_process:
            print(self.summary(resumed), flush=True)
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._write_config(resumed)
            self.logger = MetricsLogger(self.output_dir, tensorboard=c.logging.tensorboard,
                                        wandb_project=c.logging.wandb_project, config=config_to_dict(c),
                                        resume_step=resumed)
        history: list[dict[str, float]] = []
        health = RunHealth(warn=lambda message: None)
        if resumed:  # the streaks and histories the run had reached: its logged updates replayed, silently
            from mmrl.eval.report import read_jsonl

            rows, _ = read_jsonl(self.output_dir / "metrics.jsonl")
            for row in rows:
                if isinstance(row.get("step"), (int, float)) and 1 <= row["step"] <= resumed:
                    health.check(row)
        health.warn = self._warn
        progress = None
        if acc.is_main_process and c.logging.progress_bar:
            from tqdm.auto import tqdm

            progress = tqdm(total=c.train.steps, initial=self.update, desc="mmrl train", dynamic_ncols=True)
        restore_signals = self._install_stop_signals()
        self.stopped_by = None
        try:
            base_samples = self._evaluate() if self.update == 0 and c.logging.eval_every else {}
            if self.update == 0 and c.eval.every:  # the untrained model's numbers: the curves' first point
                initial = self._benchmarks()
                self.initial_eval = initial
                if self.logger is not None and initial:  # with the fixed grid's rewards (eval/reward/*) at update 0
                    self.logger.log({"step": 0, **base_samples, **initial})
            elif c.eval.every:  # resumed: the untrained model's numbers as the first run logged them
                self.initial_eval = self._logged_initial_eval()
            while self.update < c.train.steps:
                data_state = copy.deepcopy(self.prompts.state_dict())
                try:
                    metrics = self.step()
                except DataError as exc:  # a bad line met mid-run: keep the updates done so far
                    self._save_before_bad_data(data_state, exc)
                    raise
                except Exception as exc:  # any other failure while sampling or scoring: the same
                    if not self.training_phase:  # the weights and the optimizer are still the last update's
                        self._save_before_bad_data(data_state, exc)
                    raise
                if c.logging.eval_every and self.update % c.logging.eval_every == 0:
                    metrics.update(self._evaluate())
                if c.eval.every and self.update % c.eval.every == 0:
                    metrics.update(self._benchmarks())
                metrics.update(health.check(metrics))
                history.append(metrics)
                if self.logger is not None:
                    self.logger.log(metrics)
                if metrics.get("eval/failed") == 0.0 and acc.is_main_process:
                    self._write_run_report()  # after the log line: its curves end at this update
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(reward=f"{metrics['reward/mean']:.4g}", loss=f"{metrics.get('loss', 0):.3g}")
                stop = self._stop_requested()
                if stop or (c.logging.save_every and self.update % c.logging.save_every == 0) or \
                        self.update == c.train.steps:
                    self.save()
                if stop and self.update < c.train.steps:
                    self.stopped_by = self.stop_signal or "a signal on another process"
                    if acc.is_main_process:
                        print(f"mmrl: stopped by {self.stopped_by} after update {self.update} of {c.train.steps}; "
                              f"checkpoint {self.output_dir / 'checkpoints' / f'step_{self.update}'} written: "
                              f"`mmrl train {self.output_dir / 'config.yaml'} resume=auto` continues from it",
                              flush=True)
                    break
        finally:
            restore_signals()
            if progress is not None:
                progress.close()
            if self.logger is not None:
                self.logger.close()
        return history

    def _save_before_bad_data(self, data_state: dict, exc: Exception) -> None:
        """A data error (a sample whose image or video does not decode, a prompt over the length budget), or any
        other error raised before the update's training passes (a reward server gone, a generation that fails),
        stopped the update after ``self.update``: the weights are still those of that update, so checkpoint them
        (with the data position before the failed update, so a resume meets the same samples) unless a checkpoint of
        it exists, and say how to go on. Single process only: elsewhere the other processes wait in a collective."""
        c, acc = self.config, self.accelerator
        folder = self.output_dir / "checkpoints" / f"step_{self.update}"
        if acc.num_processes > 1 or self.update == 0:
            return
        if not folder.exists():
            self.prompts.load_state_dict(data_state)
            self.save()
        resume = f"`mmrl train {self.output_dir / 'config.yaml'} resume=auto` continues from it"
        if not isinstance(exc, DataError):
            print(f"mmrl: update {self.update + 1} of {c.train.steps} stopped by {type(exc).__name__} while sampling "
                  f"or scoring, before any weight changed; checkpoint {folder} holds update {self.update}; once the "
                  f"cause is fixed, {resume}",
                  file=sys.stderr, flush=True)
            return
        hint = "" if c.data.skip_bad_samples or c.model.family != "qwen_vl" else \
            " or set data.skip_bad_samples: true (skipped samples are counted)"
        print(f"mmrl: update {self.update + 1} of {c.train.steps} stopped on bad data ({' '.join(str(exc).split())}); "
              f"checkpoint {folder} holds update {self.update}. Fix the data (`mmrl config validate "
              f"{self.output_dir / 'config.yaml'}` decodes every image and video){hint}, then {resume}",
              file=sys.stderr, flush=True)

    def _warn(self, message: str) -> None:
        """A run-health warning, printed on the main process (above the progress bar); ``health/*`` metrics log it."""
        logger.info(message)
        if self.accelerator.is_main_process:
            from tqdm.auto import tqdm

            tqdm.write(f"mmrl: warning: {message}")

    def _sample(self, items: list, generator: torch.Generator, timer: dict[str, float]):
        """Rollout and scores for ``items``, then the variants' ``rewards`` stage."""
        c, acc = self.config, self.accelerator
        t0 = time.perf_counter()
        kwargs = {"generator": generator, "update": self.update, "group_offset": acc.process_index * len(items)}
        if self.scorer is not None:  # score chunk k on a worker thread while chunk k+1 is sampled
            futures = []
            batches = RewardBatches(c.train.reward_batch_size, lambda *batch: futures.append(self.scorer.submit(*batch)))
            rollout = self.policy.rollout(items, c.data.group_size, **kwargs, on_chunk=batches.add)
            batches.flush()
            t1 = time.perf_counter()
            try:
                results = [f.result() for f in futures]
            finally:
                if hasattr(self.scorer, "release"):  # the worker thread ends: training runs without it (OpenMP)
                    self.scorer.release()
            for result in results:
                self._count_reward_info(result.info)
            scores = {k: torch.cat([r[k].float().cpu() for r in results]) for k in results[0]}
        else:
            rollout = self.policy.rollout(items, c.data.group_size, **kwargs)
            t1 = time.perf_counter()
            scores = self._score(rollout)
        timer["rollout"] += t1 - t0
        timer["reward"] += time.perf_counter() - t1
        return self._variant_rewards(items, rollout, scores, generator, timer)

    def _variant_rewards(self, items, rollout, scores, generator, timer):
        """The ``rewards`` stage of every variant that has one, in config order: extra rollouts and reward transforms
        that add or replace score components and the weights of those entering the advantage, and (a variant that
        trains another role's samples too) the rollout to train. Returns ``(rollout, scores)``."""
        weights = dict(self.reward_fn.weights)
        cache: dict[str, Intermediate] = {}
        sampled, outcome = rollout, scores  # R_T of the intermediate rewards: what the reward gave the final images

        def score(other):
            t0 = time.perf_counter()
            out = self._score(other)
            timer["reward"] += time.perf_counter() - t0
            return out

        def score_outputs(outputs, prompts, metadata):
            t0 = time.perf_counter()
            out = self._score_outputs(outputs, list(prompts), list(metadata))
            timer["reward"] += time.perf_counter() - t0
            return out

        def sample(more_items, group_size, **kwargs):
            t0 = time.perf_counter()
            out = self.policy.rollout(more_items, group_size, generator=generator, update=self.update, **kwargs)
            timer["rollout"] += time.perf_counter() - t0
            return out

        def intermediate() -> Intermediate:
            if "value" not in cache:
                t0 = time.perf_counter()
                cache["value"] = self._intermediate(sampled, outcome)
                timer["intermediate"] = timer.get("intermediate", 0.0) + time.perf_counter() - t0
            return cache["value"]

        for variant in self._users("rewards"):
            out: Rewards = variant.rewards(RewardContext(
                rollout=rollout, items=items, scores=scores, weights=weights, config=self.config, policy=self.policy,
                accelerator=self.accelerator, update=self.update, score=score, score_outputs=score_outputs,
                sample=sample, intermediate=intermediate, stats=self.variant_stats, timer=timer))
            scores, weights = dict(out.scores), dict(out.weights)
            missing = sorted(set(weights) - set(scores))
            if missing:
                raise ValueError(f"variant {variant.name!r} weights components {missing} it did not score")
            if out.rollout is not None:
                expected = len(rollout) * variant.trained_rows_per_sample
                if len(out.rollout) != expected or any(len(v) != expected for v in scores.values()):
                    raise ValueError(f"variant {variant.name!r} returned a rollout of {len(out.rollout)} rows and "
                                     f"scores of {sorted({len(v) for v in scores.values()})}; expected {expected} "
                                     f"(trained_rows_per_sample = {variant.trained_rows_per_sample})")
                rollout = out.rollout
        self.advantage_weights = weights
        return rollout, scores

    def _intermediate(self, rollout, outcome: dict[str, Tensor]) -> Intermediate:
        """The images each trained step of a flow rollout leads to and their rewards ``R_0 .. R_T`` (the weighted
        total of the reward's advantage components; ``R_T`` is the final images' own ``outcome`` score, not scored
        again), with their costs in ``cost/extra_nfe``, ``cost/reward_calls`` and the first column's mean reward in
        ``reward/ode_baseline`` (the pure-ODE sample's; with ``sampling.intermediate: x0`` the prediction from the
        first trained step's latent)."""
        c = self.config
        images, nfe = self.policy.intermediate_images(rollout, mode=c.sampling.intermediate)
        n, k = images.shape[:2]
        weights = self.reward_fn.weights
        batch = c.train.reward_batch_size

        def total(scores: dict[str, Tensor]) -> Tensor:
            return sum(w * scores[key].float().cpu() for key, w in weights.items())

        totals = []
        for j in range(k - 1):
            parts = [self.reward_fn(images[i:i + batch, j], rollout.prompts[i:i + batch], rollout.metadata[i:i + batch])
                     for i in range(0, n, batch)]
            totals.append(total({key: torch.cat([p[key].float().cpu() for p in parts]) for key in weights}))
        totals.append(total(outcome))
        step_rewards = torch.stack(totals, dim=1)  # [N, T+1]: R_0 .. R_T
        stats = self.variant_stats
        stats["cost/extra_nfe"] = stats.get("cost/extra_nfe", 0.0) + float(nfe)
        stats["cost/reward_calls"] = stats.get("cost/reward_calls", 0.0) + float(n * (k - 1))
        stats["reward/ode_baseline"] = float(step_rewards[:, 0].nanmean())
        return Intermediate(images=images, step_rewards=step_rewards)

    def _sample_or_none(self, items, generator, timer):
        """:meth:`_sample`, or ``(None, None)`` when every item was skipped (``data.skip_bad_samples``)."""
        try:
            return self._sample(items, generator, timer)
        except EmptyBatchError:
            return None, None

    def _refill_skipped(self, rollout, scores, generator, timer, max_rounds: int = 8):
        """Replace samples skipped as bad (``data.skip_bad_samples``) with fresh items, so every process trains on
        exactly ``prompts_per_step`` groups: the processes stay in the same collectives (gathers, DDP all-reduces)
        and keep the same data position, because every process draws the same number of replacement batches
        (one per round while ANY process is short); only a short process samples them."""
        c, acc = self.config, self.accelerator
        need = c.data.prompts_per_step

        def groups(r) -> int:
            return 0 if r is None else len(torch.unique(r.group_ids))

        refilled = False
        for round_ in range(max_rounds + 1):
            short = torch.tensor(float(groups(rollout) < need), device=acc.device)
            if float(acc.reduce(short, reduction="sum") if acc.num_processes > 1 else short) == 0:
                if refilled:
                    rollout.group_ids = rollout.group_ids + acc.process_index * need
                return rollout, scores
            if round_ == max_rounds:
                raise EmptyBatchError(f"still short of data.prompts_per_step={need} usable samples after {max_rounds} "
                                      f"rounds of replacements: too many bad samples (see the samples/skipped_* "
                                      f"counts and the warnings)")
            items = self.prompts.next_batch(need, rank=acc.process_index, world=acc.num_processes)
            if groups(rollout) >= need:
                continue  # keep the data position in step with the short processes
            extra, extra_scores = self._sample_or_none(items, generator, timer)
            if extra is None:
                continue
            parts, part_scores = ([rollout], [scores]) if rollout is not None else ([], [])
            missing = need - groups(rollout)
            for g in torch.unique(extra.group_ids).tolist()[:missing]:
                rows = (extra.group_ids == g).nonzero().flatten()
                parts.append(extra.select(rows))
                part_scores.append({k: v[rows] for k, v in extra_scores.items()})
            rollout = self.policy.concat_rollouts(parts)  # group ids renumbered 0..; offset by process on return
            refilled = True
            scores = {k: torch.cat([p[k] for p in part_scores]) for k in part_scores[0]}
        raise AssertionError("unreachable")

    def _select(self, rollout, scores, generator, timer):
        """The ``select`` stage: draw sampling rounds of ``prompts_per_step`` prompts (the same number on every
        process) until the selecting variants have enough groups they want (or their round limit), then keep
        ``prompts_per_step`` groups in order of priority (the sum of the variants' priorities; ties and fillers in
        the order drawn)."""
        c, acc = self.config, self.accelerator
        need = c.data.prompts_per_step
        selectors = self._users("select")
        min_rounds = max(v.sampling_rounds()[0] for v in selectors)
        max_rounds = max(min_rounds, max(v.sampling_rounds()[1] for v in selectors))
        parts = [(rollout, scores)]

        def priority(r, sc, rounds):
            weights = self.advantage_weights
            ctx = SelectContext(total=sum(w * sc[k] for k, w in weights.items()), group_ids=r.group_ids, scores=sc,
                                need=need, rounds=rounds)
            return sum(v.select(ctx) for v in selectors)

        def wanted(r, p):
            return len(torch.unique(r.group_ids[torch.isfinite(p)]))

        rounds = 1
        while rounds < max_rounds:
            pool = self.policy.concat_rollouts([r for r, _ in parts]) if len(parts) > 1 else rollout
            pool_scores = {k: torch.cat([sc[k] for _, sc in parts]) for k in scores}
            short = torch.tensor(float(rounds < min_rounds or wanted(pool, priority(pool, pool_scores, rounds)) < need),
                                 device=acc.device)
            if float(acc.reduce(short, reduction="sum") if acc.num_processes > 1 else short) == 0:
                break
            items = self.prompts.next_batch(need, rank=acc.process_index, world=acc.num_processes)
            parts.append(self._sample(items, generator, timer))
            rounds += 1
        pool = self.policy.concat_rollouts([r for r, _ in parts]) if len(parts) > 1 else rollout
        pool_scores = {k: torch.cat([sc[k] for _, sc in parts]) for k in scores}
        prio = priority(pool, pool_scores, rounds)
        groups = []  # (priority, order drawn, part, rows in the part, rows in the pool)
        offset = 0
        for index, (part, _) in enumerate(parts):
            for g in torch.unique_consecutive(part.group_ids).tolist():
                rows = (part.group_ids == g).nonzero().flatten()
                groups.append((float(prio[offset + rows[0]]), len(groups), index, rows, offset + rows))
            offset += len(part)
        chosen = sorted(groups, key=lambda x: (-x[0], x[1]))[:need]  # wanted first, each in the order drawn
        merged = self.policy.concat_rollouts([parts[i][0].select(rows) for _, _, i, rows, _ in chosen])
        merged.group_ids = merged.group_ids + acc.process_index * need
        pool_rows = torch.cat([rows for *_, rows in chosen])
        merged_scores = {k: v[pool_rows] for k, v in pool_scores.items()}
        return merged, merged_scores, {"samples/sampling_rounds": float(rounds),
                                       "samples/dropped_groups": float(len(groups) - len(chosen))}

    def step(self) -> dict[str, float]:
        """One update: sample, score, advantages, optimise."""
        c, acc = self.config, self.accelerator
        generator = torch.Generator().manual_seed(_update_seed(c.seed, self.update, acc.process_index))
        timer = {"rollout": 0.0, "reward": 0.0}
        self.reward_counts: dict[str, float] = {}
        self.variant_stats: dict[str, float] = {}
        self.training_phase = False  # set from the first training pass on (a failure before it keeps the update)
        items = self.prompts.next_batch(c.data.prompts_per_step, rank=acc.process_index, world=acc.num_processes)
        with self._full_weights():  # sharded: one all-gather for the whole rollout, no collective per forward
            if c.data.skip_bad_samples:  # skipped samples are replaced; without skipping a bad one is an error
                rollout, scores = self._refill_skipped(*self._sample_or_none(items, generator, timer), generator,
                                                       timer)
            else:
                rollout, scores = self._sample(items, generator, timer)
            sampling_stats = {}
            if self._users("select"):
                rollout, scores, sampling_stats = self._select(rollout, scores, generator, timer)
        t2 = time.perf_counter()
        advantages, adv_stats = self._advantages(rollout, scores)
        self.training_phase = True
        train_metrics = self._train_on(rollout, advantages, generator, scores=scores)
        t3 = time.perf_counter()
        self.update += 1
        metrics: dict[str, float] = {"step": self.update}
        for key, value in scores.items():
            gathered = acc.gather(value.to(acc.device)).cpu()
            finite = gathered[torch.isfinite(gathered)]
            metrics[f"reward/{key}"] = float(finite.mean()) if finite.numel() else float("nan")
        metrics["reward/mean"] = metrics["reward/total"]
        metrics.update(adv_stats)
        metrics.update(sampling_stats)
        # every sample with an action in the loss goes through the training pass (a zero advantage still carries the
        # KL term and the step); rows left out of the loss (a variant's drop, mask_truncated_completions) are not
        # trained; the informative ones are the trained ones whose advantage is not all zero
        moving = advantages.reshape(len(advantages), -1).abs().sum(-1).cpu() > 0
        trained = rollout.mask.sum(-1) > 0  # the rows of this process's advantages, as trained
        if self.kept_rows is not None:  # algorithm.drop_zero_advantage left the others out
            trained &= self.kept_rows
        counts = torch.tensor([float(trained.sum()), float((trained & moving).sum())], device=acc.device)
        if acc.num_processes > 1:
            counts = acc.reduce(counts, reduction="sum")
        metrics["samples/trained"], metrics["samples/informative"] = (float(v) for v in counts.cpu())
        metrics.update(train_metrics)
        metrics["kl"] = train_metrics.get("kl", 0.0)  # not computed with algorithm.beta 0 (TRL then omits the key)
        if "completion_length" in rollout.extras:  # TRL's completions/*_length, over every process's samples
            lengths = rollout.extras["completion_length"].float().to(acc.device)
            lengths = acc.gather(lengths).cpu() if acc.num_processes > 1 else lengths.cpu()
            metrics["completions/mean_length"] = float(lengths.mean())
            metrics["completions/min_length"], metrics["completions/max_length"] = (float(lengths.min()),
                                                                                  float(lengths.max()))
            if "truncated" in rollout.extras:  # the completions that ended with an end token
                cut = rollout.extras["truncated"].to(acc.device)
                cut = (acc.gather(cut).cpu() if acc.num_processes > 1 else cut.cpu()).bool()
                ended = lengths[~cut]
                metrics["completions/mean_terminated_length"] = float(ended.mean()) if ended.numel() else 0.0
        if "truncated" in rollout.extras:  # TRL's completions/clipped_ratio: cut off by generation.max_new_tokens
            clipped = rollout.extras["truncated"].float().to(acc.device)
            metrics["completions/clipped_ratio"] = float(acc.gather(clipped).mean() if acc.num_processes > 1
                                                         else clipped.mean())
        for key in ("tool_calls", "tool_errors"):  # tool rollouts (generation.tools): per completion, mean
            if key in rollout.extras:
                values = rollout.extras[key].float().to(acc.device)
                metrics[f"completions/{key}"] = float(acc.gather(values).mean() if acc.num_processes > 1
                                                      else values.mean())
        for reason, count in self._skipped_in_all().items():
            metrics[f"samples/skipped_{reason}"] = float(count)
        # counts of every process's samples, not the main process's (the health rules compare them with
        # samples/trained, a global count)
        counts = dict(self.reward_counts)
        if "samples/dropped_groups" in metrics:
            counts["samples/dropped_groups"] = metrics["samples/dropped_groups"]
        metrics.update({key: sum(v) for key, v in values_by_key(counts, acc).items()})  # one gather for all
        metrics.update(mean_over_processes(self.variant_stats, acc))
        if "intermediate" in timer:  # the images trained steps lead to, and their rewards
            metrics["time/intermediate"] = timer["intermediate"]
        metrics["optimizer_steps"] = float(self.optimizer_steps)
        metrics["time/rollout"] = timer["rollout"]
        metrics["time/reward"] = timer["reward"]
        metrics["time/train"] = t3 - t2
        return metrics
