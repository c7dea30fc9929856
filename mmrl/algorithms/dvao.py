"""DVAO-style multi-reward advantages: each objective's group advantage weighted by its share of group variance."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import AdvantageContext, Variant, option, register
from mmrl.core.advantages import _grouped_stats, group_advantages, group_index


@dataclass
class DVAOOptions:
    power: float = option(2.0, "Weights are sigma_k^power / sum_j sigma_j^power of each objective's within-group "
                               "spread (2: variance shares, the 'empirical reward variance' of DVAO, Jiang et al. "
                               "2026; 1: std shares).")
    floor: float = option(0.0, "Mix the variance weights with uniform ones, (1 - floor) w + floor / K, so no "
                               "objective of a group with any spread is silenced entirely (0: pure variance weights; "
                               "mmrl's option, not DVAO's).")

    def validate(self) -> None:
        if not self.power > 0:
            raise ValueError(f"power must be > 0, got {self.power}")
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"floor must be in [0, 1], got {self.floor}")


@register
class DVAO(Variant):
    """Variance-adaptive advantage combination (mmrl's rule: the abstract states the idea, not the formula).

    For every component ``k`` entering the advantage (``ctx.weights``; ``ctx.components`` holds the raw scores and the
    weight ``w_k`` is applied here, as the loop's :func:`~mmrl.core.advantages.combine_rewards` does), within each
    group ``g`` of ``ctx.labels``:

    * ``z_k = group_advantages(w_k R_k)`` with the run's ``algorithm.scale`` / ``eps`` / ``std_ddof`` (NaN -> 0);
    * ``s_kg`` the within-group std of ``w_k R_k`` (``std_ddof``, NaN excluded), from ``_grouped_stats``;
    * ``omega_kg = s_kg^p / sum_j s_jg^p`` (``p = power``), then ``(1 - floor) omega_kg + floor / K``; a group where
      no objective varies gets ``omega = 0`` (all its ``z`` are 0 anyway);
    * ``A = sum_k omega_kg z_k``, clamped to ``algorithm.advantage_clamp`` when set.

    The weights of a group are a convex combination, so ``|A_i| <= max_k |z_k,i|``: the combined advantage is never
    larger than the largest single-objective advantage (the boundedness DVAO proves; with ``scale=group`` each
    ``|z| <= (n - 1) / sqrt(n)`` for ``ddof=0``). Because the spread is that of the *weighted* component, a configured
    weight still scales its objective's share by ``|w_k|^p``. ``[N, T]`` components are weighted per step column.
    DVAO's cross-objective regularisation term is not reproduced beyond what this weighting implies."""

    name = "dvao"
    summary = "per-objective group advantages combined with weights from each objective's within-group variance"
    paper = ("DVAO: Dynamic Variance-adaptive Advantage Optimization for Multi-reward Reinforcement Learning, Jiang "
             "et al. 2026, arXiv 2605.25604 (the weight formula was not available; the variance-share rule is mmrl's)")
    Options = DVAOOptions

    def advantages(self, ctx: AdvantageContext) -> Tensor:
        a, o = ctx.algorithm, self.options
        if not ctx.weights:
            raise ValueError("variant 'dvao' needs at least one weighted reward component")
        index, num_groups = group_index(ctx.labels)
        zs, spreads = [], []
        for key, weight in ctx.weights.items():
            values = weight * ctx.components[key].double()
            z = group_advantages(values, ctx.labels, scale=a.scale, eps=a.eps, std_ddof=a.std_ddof)
            flat = values.reshape(values.shape[0], -1)
            _, std, _ = _grouped_stats(flat, torch.isfinite(flat), index.to(flat.device), num_groups, a.std_ddof)
            zs.append(z.reshape(flat.shape))
            spreads.append(std.pow(o.power))
        total = sum(spreads)
        omegas = [torch.where(total > 0, s / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(s))
                  for s in spreads]
        if o.floor > 0:
            k = len(omegas)
            omegas = [torch.where(total > 0, (1.0 - o.floor) * w + o.floor / k, w) for w in omegas]
        adv = sum(w * z for w, z in zip(omegas, zs))
        if a.advantage_clamp is not None:
            adv = adv.clamp(-a.advantage_clamp, a.advantage_clamp)
        outcome_only = all(ctx.components[k].dim() == 1 for k in ctx.weights)
        return adv.squeeze(1).float() if outcome_only else adv.float()
