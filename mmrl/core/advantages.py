"""Group-relative advantages (GRPO family) as pure tensor functions.

Every function maps rewards ``[N]`` (one outcome per sample) or ``[N, T]`` (dense, one per step)
to advantages of the same shape. ``N`` is prompts x group size; ``group_ids[i]`` names the group
(prompt) of sample ``i``. For ``[N, T]`` rewards each step column is normalised within its group
(dense per-timestep rewards, REFERENCE.md section 4).

Conventions of the anchors (REFERENCE.md section 4):

* TRL ``GRPOTrainer``: ``scale="group"``, unbiased std (``std_ddof=1``), ``eps=1e-4``.
* Flow-GRPO ``PerPromptStatTracker``: biased std (``std_ddof=0``), ``eps=1e-4``, advantages clamped
  to +-5 at loss time.
* EasyR1 / verl: unbiased std, ``eps=1e-6``.
* Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783): ``scale="none"``.

A reward that could not judge a sample is NaN: it is left out of every statistic and its advantage
is exactly 0. A group whose (valid) rewards have zero spread gets exactly 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

SCALES = ("group", "batch", "none")
COMBINE_MODES = ("sum_then_normalize", "normalize_then_sum", "nansum_then_normalize")


def group_index(group_ids: Tensor | Sequence[Any]) -> tuple[Tensor, int]:
    """Map arbitrary group labels (ints, strings, prompts) to ``0..G-1``; returns ``(index [N], G)``."""
    if isinstance(group_ids, Tensor):
        _, inverse = torch.unique(group_ids.reshape(-1), return_inverse=True)
        return inverse, int(inverse.max().item()) + 1 if inverse.numel() else 0
    seen: dict[Any, int] = {}
    index = [seen.setdefault(g, len(seen)) for g in group_ids]
    return torch.tensor(index, dtype=torch.long), len(seen)


def _as_2d(rewards: Tensor) -> tuple[Tensor, bool]:
    if rewards.dim() == 1:
        return rewards.unsqueeze(1), True
    if rewards.dim() == 2:
        return rewards, False
    raise ValueError(f"rewards must be [N] or [N, T], got shape {tuple(rewards.shape)}")


def _grouped_stats(values: Tensor, valid: Tensor, index: Tensor, num_groups: int, ddof: int):
    """Per-group mean, std and count of ``values [N, T]`` over ``valid`` entries, gathered back to ``[N, T]``."""
    zeros = torch.zeros(num_groups, values.shape[1], dtype=values.dtype, device=values.device)
    filled = torch.where(valid, values, torch.zeros_like(values))
    count = zeros.index_add(0, index, valid.to(values.dtype))
    mean = zeros.index_add(0, index, filled) / count.clamp(min=1)
    centred = torch.where(valid, values - mean[index], torch.zeros_like(values))
    var = zeros.index_add(0, index, centred.square()) / (count - ddof).clamp(min=1)
    # equal values have zero spread exactly, whatever the rounding of their mean (seven fp32 0.1s: std 8e-9)
    rows = index.unsqueeze(1).expand_as(values)
    high = zeros.scatter_reduce(0, rows, torch.where(valid, values, torch.full_like(values, -torch.inf)), "amax",
                                include_self=False)
    low = zeros.scatter_reduce(0, rows, torch.where(valid, values, torch.full_like(values, torch.inf)), "amin",
                               include_self=False)
    std = torch.where((count - ddof > 0) & (high > low), var.sqrt(), torch.zeros_like(var))
    return mean[index], std[index], count[index]


def scale_centred(centred: Tensor, values: Tensor, valid: Tensor, std: Tensor, *, scale: str, eps: float,
                  std_ddof: int) -> Tensor:
    """``centred = values - baseline`` divided as ``scale`` says: ``group`` by the group's ``std`` (+ ``eps``),
    ``batch`` by the std of the whole batch's valid ``values`` (per column), ``none`` not at all. A group with zero
    spread (``std == 0``) and an invalid entry get exactly 0. Shared by every group-relative estimator whose baseline
    is not the plain group mean (median, virtual samples)."""
    if scale not in SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; expected one of {SCALES}")
    if scale == "group":
        adv = centred / (std + eps)
    elif scale == "batch":
        index = torch.zeros(values.shape[0], dtype=torch.long, device=values.device)
        _, batch_std, _ = _grouped_stats(values, valid, index, 1, std_ddof)
        adv = centred / (batch_std + eps)
    else:
        adv = centred
    return torch.where((std > 0) & valid, adv, torch.zeros_like(adv))


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence[Any],
    *,
    scale: str = "group",
    eps: float = 1e-4,
    std_ddof: int = 1,
    clamp: float | None = None,
) -> Tensor:
    """Group-relative advantages ``A = (R - mean_group(R)) / (std + eps)`` (GRPO, Shao et al. 2024, arXiv 2402.03300).

    Args:
        rewards: ``[N]`` outcome rewards or ``[N, T]`` dense rewards (each column within its group).
        group_ids: ``[N]`` group label of every sample (a tensor, or a list of prompts / ints).
        scale: ``"group"`` divides by the group's std; ``"batch"`` subtracts the group mean and divides
            by the std of the whole batch (per column); ``"none"`` only subtracts the group mean (Dr. GRPO).
        eps: added to the std before dividing.
        std_ddof: 1 for the unbiased std (TRL, EasyR1), 0 for the biased one (Flow-GRPO's tracker).
        clamp: if given, clamp advantages to ``[-clamp, clamp]`` (Flow-GRPO uses 5).

    NaN rewards are excluded from the statistics and get advantage 0; a group with zero spread
    (or a single valid sample) gets exactly 0. The statistics are computed in float64 (Flow-GRPO's tracker and
    TP-GRPO use numpy float64: a float32 mean of rewards near 0.85 spread by 1e-3 is off by up to 2e-4 in ``A``);
    the result has the rewards' dtype (float32 for integer rewards).
    """
    if scale not in SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; expected one of {SCALES}")
    out_dtype = rewards.dtype if rewards.dtype in (torch.float64, torch.float32) else torch.float32
    values, was_1d = _as_2d(rewards.double())
    index, num_groups = group_index(group_ids)
    index = index.to(values.device)
    if index.numel() != values.shape[0]:
        raise ValueError(f"group_ids has {index.numel()} entries but rewards has {values.shape[0]} samples")
    valid = torch.isfinite(values)
    mean, std, _ = _grouped_stats(values, valid, index, num_groups, std_ddof)
    adv = scale_centred(values - mean, values, valid, std, scale=scale, eps=eps, std_ddof=std_ddof)
    if clamp is not None:
        adv = adv.clamp(-clamp, clamp)
    adv = adv.to(out_dtype)
    return adv.squeeze(1) if was_1d else adv


def gaussian_rank_advantages(rewards: Tensor, group_ids: Tensor | Sequence[Any], *,
                             clamp: float | None = None) -> Tensor:
    """Rank-based Gaussian advantages (G2RPO-style Gaussian normalisation).

    Within each group (and each column of ``[N, T]`` rewards) the valid rewards are ranked
    (ties get the average of their ranks, ranks ``r = 1..n``) and mapped to standard-normal
    quantiles ``A = Phi^-1((r - 0.5) / n)`` (Hazen plotting positions), so each group's advantages
    follow N(0, 1) whatever the reward's scale or outliers. Zero-spread groups and NaN rewards get 0.
    ``clamp``: the advantages are clamped to ``+-clamp`` (``algorithm.advantage_clamp``; groups of more than
    about 30 reach quantiles beyond 2).
    """
    values, was_1d = _as_2d(rewards.double())
    index, num_groups = group_index(group_ids)
    index = index.to(values.device)
    adv = torch.zeros_like(values)
    for g in range(num_groups):
        rows = (index == g).nonzero(as_tuple=True)[0]
        for col in range(values.shape[1]):
            column = values[rows, col]
            ok = torch.isfinite(column)
            vals = column[ok]
            n = vals.numel()
            if n < 2 or bool((vals == vals[0]).all()):
                continue
            less = (vals.unsqueeze(0) < vals.unsqueeze(1)).sum(1).double()
            equal = (vals.unsqueeze(0) == vals.unsqueeze(1)).sum(1).double()
            avg_rank = less + (equal + 1) / 2  # 1-based rank, ties averaged
            quantiles = torch.special.ndtri((avg_rank - 0.5) / n)
            adv[rows[ok], col] = quantiles
    if clamp is not None:
        adv = adv.clamp(-clamp, clamp)
    adv = adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)
    return adv.squeeze(1) if was_1d else adv


ADVANTAGE_ESTIMATORS = {
    "grpo": group_advantages,
    "gaussian_rank": gaussian_rank_advantages,
}


def weighted_total(components: Mapping[str, Tensor], weights: Mapping[str, float] | None = None, *,
                   nansum: bool = False) -> Tensor:
    """``sum_k w_k R_k`` in float64 (a missing weight is 1). A NaN component makes the sample's total NaN, or with
    ``nansum`` (TRL's ``torch.nansum``) is left out of it; a sample every component leaves NaN stays NaN."""
    weights = weights or {}
    values = [weights.get(k, 1.0) * v.double() for k, v in components.items()]
    if not nansum:
        return sum(values)
    judged = torch.stack([torch.isfinite(v) for v in values]).any(0)
    total = sum(torch.nan_to_num(v, nan=0.0) for v in values)
    return torch.where(judged, total, torch.full_like(total, float("nan")))


def combine_rewards(
    components: Mapping[str, Tensor],
    group_ids: Tensor | Sequence[Any],
    *,
    weights: Mapping[str, float] | None = None,
    mode: str = "sum_then_normalize",
    estimator: str = "grpo",
    batch_normalize: bool = False,
    clamp_sum: bool = False,
    batch_eps: float | None = None,
    **estimator_kwargs: Any,
) -> Tensor:
    """Advantages from several named rewards.

    ``sum_then_normalize`` (Flow-GRPO, TRL default): ``A = norm(sum_k w_k R_k)``; a NaN in any
    weighted component makes the sample's total NaN (advantage 0). mmrl's rule, where TRL differs: TRL
    sums with ``nansum`` (a ``None`` reward means "does not apply"), so there a sample with one NaN component is
    scored by the others; in mmrl NaN means "could not judge", and a sample is not ranked on a partial score.
    ``nansum_then_normalize`` (TRL's ``torch.nansum``): as ``sum_then_normalize``, but a NaN component is left out
    of that sample's sum (TRL's reward returning ``None``: "does not apply to this sample", the multi-task pattern), so
    the sample is scored by the others; a sample with every component NaN stays NaN (advantage 0; TRL sums it to 0
    and warns).
    ``normalize_then_sum`` (DanceGRPO video, MixGRPO, GDPO): ``A = sum_k w_k norm(R_k)``; a NaN
    component contributes 0 for that sample.
    ``batch_normalize`` (``normalize_then_sum`` only): GDPO's final step (Liu et al. 2026, "GDPO: Group
    reward-Decoupled Normalization Policy Optimization", arXiv 2601.05242), the summed advantages normalised
    over the whole batch, ``(A - mean(A)) / (std(A) + eps)`` with the unbiased std and ``eps`` (1e-4) of its
    reference implementation, over every sample at least one reward could judge (a sample with every component
    NaN is left out of the statistics and gets exactly 0); ``batch_eps`` replaces that eps (default: the
    estimator's ``eps``, else 1e-4).
    ``clamp_sum`` (``normalize_then_sum`` only): the estimator's ``clamp`` applies to the summed advantage
    (MixGRPO's ``train_grpo_flux.py``: each reward normalised per group, weighted, summed, then clamped to
    ``adv_clip_max``) instead of to each component (DanceGRPO's video script clamps each reward's advantage).
    """
    if mode not in COMBINE_MODES:
        raise ValueError(f"unknown reward combination {mode!r}; expected one of {COMBINE_MODES}")
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {sorted(ADVANTAGE_ESTIMATORS)}")
    if not components:
        raise ValueError("combine_rewards needs at least one reward component")
    if batch_normalize and mode != "normalize_then_sum":
        raise ValueError("batch_normalize is GDPO's step after normalize_then_sum; use mode='normalize_then_sum'")
    if clamp_sum and mode != "normalize_then_sum":
        raise ValueError("clamp_sum clamps the sum of normalize_then_sum; use mode='normalize_then_sum'")
    weights = dict(weights or {})
    unknown = set(weights) - set(components)
    if unknown:
        raise ValueError(f"weights given for unknown reward components {sorted(unknown)}; have {sorted(components)}")
    norm = ADVANTAGE_ESTIMATORS[estimator]
    # sums and statistics in float64 (as the flow anchors' numpy trackers), the result float32 unless every
    # component is float64
    out_dtype = torch.float64 if all(v.dtype == torch.float64 for v in components.values()) else torch.float32
    if mode in ("sum_then_normalize", "nansum_then_normalize"):
        total = weighted_total(components, weights, nansum=mode == "nansum_then_normalize")
        return norm(total, group_ids, **estimator_kwargs).to(out_dtype)
    component_kwargs = {**estimator_kwargs, "clamp": None} if clamp_sum else estimator_kwargs
    total = sum(weights.get(k, 1.0) * norm(v.double(), group_ids, **component_kwargs) for k, v in components.items())
    if batch_normalize:
        # over the scorable samples only (every component NaN: no score), which then get exactly 0, as TRL's
        # normalize_then_sum leaves its all-NaN rows out of the batch statistics
        judged = torch.stack([torch.isfinite(v.float()) for v in components.values()]).any(0)
        judged = judged.reshape(judged.shape[0], -1).any(-1).reshape(-1, *([1] * (total.dim() - 1))).expand_as(total)
        eps = batch_eps if batch_eps is not None else estimator_kwargs.get("eps", 1e-4)
        kept = total[judged]
        std = kept.std() if kept.numel() > 1 else torch.zeros(())
        mean = kept.mean() if kept.numel() else torch.zeros(())
        total = torch.where(judged, (total - mean) / (std + eps), torch.zeros_like(total))
    if clamp_sum and estimator_kwargs.get("clamp") is not None:
        total = total.clamp(-estimator_kwargs["clamp"], estimator_kwargs["clamp"])
    return total.to(out_dtype)


class PerPromptStatTracker:
    """Per-prompt reward statistics, as Flow-GRPO's ``PerPromptStatTracker`` (Liu et al. 2025, arXiv 2505.05470).

    Samples are grouped by prompt text (across processes, whatever sampling group they came from).
    With ``keep_history=False`` (Flow-GRPO clears its tracker after every sampling epoch, so this is
    its behaviour) ``update`` is :func:`combine_rewards` grouped by prompt, with the estimator settings
    given here (Flow-GRPO: ``std_ddof=0, eps=1e-4``). With ``keep_history=True`` each prompt's past
    rewards stay in its statistics: ``(R - mean_history) / (std_history + eps)``, biased std, as the
    anchor computes before clearing. The state (histories, prompts seen) goes into checkpoints.
    """

    def __init__(self, *, keep_history: bool = False, **estimator_kwargs: Any):
        self.keep_history = keep_history
        self.estimator_kwargs = estimator_kwargs
        self.history: dict[str, list[float]] = {}
        self.prompts_seen: set[str] = set()

    def update(self, prompts: Sequence[str], rewards: Mapping[str, Tensor] | Tensor,
               weights: Mapping[str, float] | None = None, mode: str = "sum_then_normalize",
               batch_normalize: bool = False, clamp_sum: bool = False) -> Tensor:
        self.prompts_seen.update(prompts)
        components = {"reward": rewards} if isinstance(rewards, Tensor) else dict(rewards)
        if not self.keep_history:
            return combine_rewards(components, list(prompts), weights=weights, mode=mode,
                                   batch_normalize=batch_normalize, clamp_sum=clamp_sum, **self.estimator_kwargs)
        if mode != "sum_then_normalize":
            raise ValueError("keep_history tracks one total reward: use mode='sum_then_normalize'")
        total = sum((weights or {}).get(k, 1.0) * v.double() for k, v in components.items())
        return self._update_history(list(prompts), total.cpu())

    def _update_history(self, prompts: list[str], values: Tensor) -> Tensor:
        if values.dim() != 1 or values.numel() != len(prompts):
            raise ValueError(f"expected [N] rewards for {len(prompts)} prompts, got {tuple(values.shape)}")
        eps = self.estimator_kwargs.get("eps", 1e-4)
        for prompt, r in zip(prompts, values.tolist()):
            if r == r:  # NaN rewards are not statistics
                self.history.setdefault(prompt, []).append(r)
        adv = torch.zeros_like(values)
        for i, (prompt, r) in enumerate(zip(prompts, values.tolist())):
            past = torch.tensor(self.history.get(prompt, []), dtype=torch.float64)
            if r != r or past.numel() < 2:
                continue
            std = past.std(unbiased=False)
            adv[i] = 0.0 if std == 0 else (r - past.mean()) / (std + eps)
        clamp = self.estimator_kwargs.get("clamp")
        return (adv.clamp(-clamp, clamp) if clamp is not None else adv).float()

    def state_dict(self) -> dict[str, Any]:
        return {"history": {k: list(v) for k, v in self.history.items()}, "prompts_seen": sorted(self.prompts_seen)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = {k: list(v) for k, v in state.get("history", {}).items()}
        self.prompts_seen = set(state.get("prompts_seen", []))
