"""MC-GRPO: the group's median reward as the baseline, its pivot rollout out of the update."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import AdvantageContext, Variant, VariantError, option, register
from mmrl.core.advantages import _grouped_stats, group_index, scale_centred


@dataclass
class MCGRPOOptions:
    odd_groups: bool = option(True, "Refuse an even data.group_size: MC-GRPO samples G+1 rollouts per prompt (odd) so "
                                    "that exactly one of them, the pivot, is the group's median (Kim 2026, "
                                    "arXiv 2601.22582).")

    def validate(self) -> None:
        if not isinstance(self.odd_groups, bool):
            raise TypeError(f"odd_groups must be true or false, got {self.odd_groups!r}")


def median_centered_advantages(total: Tensor, group_ids, *, scale: str = "group", eps: float = 1e-4,
                               std_ddof: int = 0, clamp: float | None = None) -> tuple[Tensor, Tensor]:
    """``A_i = (R_i - median_g(R)) / (std_g(R) + eps)`` per sampling group (and per column of ``[N, T]``).

    Returns ``(advantages, pivot)``: ``pivot [N]`` (or ``[N, T]``) marks the sample :func:`torch.nanmedian` picks as
    each group's median (the lower middle value when a group's valid count is even); its advantage is exactly 0.
    ``scale``: ``group`` divides by the group's std (about its mean, as GRPO's), ``batch`` by the batch's,
    ``none`` not at all; a group whose valid rewards do not vary gets 0; NaN rewards are left out and get 0.
    """
    values = total.unsqueeze(1) if total.dim() == 1 else total
    values = values.double() if values.dtype == torch.float64 else values.float()
    index, num_groups = group_index(group_ids)
    valid = torch.isfinite(values)
    median = torch.zeros_like(values)
    pivot = torch.zeros_like(values, dtype=torch.bool)
    for g in range(num_groups):
        rows = (index == g).nonzero(as_tuple=True)[0]
        block = values[rows]
        has_valid = valid[rows].any(0)
        med, at = torch.nanmedian(torch.where(valid[rows], block, torch.full_like(block, float("nan"))), dim=0)
        median[rows] = torch.where(has_valid, med, torch.zeros_like(med)).unsqueeze(0).expand_as(block)
        cols = has_valid.nonzero(as_tuple=True)[0]
        pivot[rows[at[cols]], cols] = True
    _, std, _ = _grouped_stats(values, valid, index, num_groups, std_ddof)
    adv = scale_centred(values - median, values, valid, std, scale=scale, eps=eps, std_ddof=std_ddof)
    adv = torch.where(pivot, torch.zeros_like(adv), adv)
    if clamp is not None:
        adv = adv.clamp(-clamp, clamp)
    if total.dim() == 1:
        return adv.squeeze(1), pivot.squeeze(1)
    return adv, pivot


@register
class MCGRPO(Variant):
    """Median-centred advantages over each sampling group of ``G+1`` rollouts.

    Rule (the abstract's): sample ``G+1`` rollouts per prompt (set ``data.group_size`` to ``G+1``, odd), take the
    group's MEDIAN total reward as the baseline instead of its mean, and drop the pivot rollout (the one whose reward
    is the median) from the update, so ``G`` samples per prompt carry gradient::

        A_i = (R_i - median_g(R)) / (std_g(R) + eps)     (R = sum_k w_k R_k, the weighted total)
        A_pivot = 0

    ``std_g`` is the group's ordinary std over all ``G+1`` rewards (``algorithm.std_ddof``, ``algorithm.eps``);
    ``algorithm.scale`` is honoured (``batch``: the batch std, ``none``: no division), then
    ``algorithm.advantage_clamp``. Groups are the sampling groups (``group_ids``), not the per-prompt condition keys:
    the ``G+1`` structure belongs to one sampling group. With several samples tied at the median (binary rewards)
    they all get 0, since ``R_i - median = 0``; one of them is the pivot.

    The pivot leaves the update: its advantage is exactly 0 and it is dropped from the loss (``AdvantageContext.drop``:
    its action mask becomes 0, so it is out of the token-count normalisers of ``bnpo`` / ``dapo`` and takes no KL
    term; ``samples/dropped_from_loss`` counts it). The ``grpo`` aggregation's mean over samples still counts its
    row (as 0), and it is still forwarded, so no compute is saved. Not implemented from the released code: its median
    absolute deviation scale and its rescaling of the non-zero advantages by ``(G+1) / #non-zero`` (neither is in the
    abstract; the MAD is 0 for most binary-reward groups). No parity with the paper's numbers is claimed.
    """

    name = "mc_grpo"
    summary = "median reward as the group baseline over G+1 rollouts; the pivot (median) rollout gets advantage 0"
    paper = ("MC-GRPO: Median-Centered Group Relative Policy Optimization for Small-Rollout Reinforcement Learning, "
             "Kim 2026, arXiv 2601.22582 (the median baseline and pivot drop as the abstract states; the std scale is "
             "GRPO's, not the released code's MAD)")
    Options = MCGRPOOptions

    def check(self, config) -> None:
        if config.algorithm.reward_combination != "sum_then_normalize":
            raise VariantError("variant 'mc_grpo' takes the median of the weighted total reward: it needs "
                               "algorithm.reward_combination=sum_then_normalize")
        if self.options.odd_groups and config.data.group_size % 2 == 0:
            raise VariantError(f"variant 'mc_grpo' samples G+1 rollouts per prompt so that one is the median: "
                               f"data.group_size must be odd (got {config.data.group_size}; for G="
                               f"{config.data.group_size} set {config.data.group_size + 1}), or set odd_groups: false")

    def advantages(self, ctx: AdvantageContext) -> Tensor:
        a = ctx.algorithm
        total = sum(w * ctx.components[k].float() for k, w in ctx.weights.items())
        adv, pivot = median_centered_advantages(total, ctx.group_ids, scale=a.scale, eps=a.eps, std_ddof=a.std_ddof,
                                                clamp=a.advantage_clamp)
        ctx.drop = pivot if pivot.dim() == 1 else pivot.any(dim=1)  # the pivot rollouts leave the update
        return adv
