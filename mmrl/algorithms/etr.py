"""ETR-style elastic trust regions: the clip range of each action widened with |A| and with its group's variance."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmrl.algorithms.base import SurrogateContext, TransformContext, Variant, option, register
from mmrl.core.advantages import _grouped_stats, group_index


@dataclass
class ETROptions:
    alpha: float = option(0.5, "Micro elasticity: the clip range grows by a factor 1 + alpha * min(|A|, adv_cap) "
                               "(ETR, Zhang et al. 2026, scales clipping boundaries with the advantage magnitude).")
    adv_cap: float = option(3.0, "|A| above this widens no further.")
    gamma: float = option(1.0, "Macro elasticity: a factor 1 + gamma * u_g with u_g = min(1, 4 var_g / range^2) the "
                               "group's reward variance as a fraction of its largest possible value (ETR lets group "
                               "variance allocate larger update budgets); needs reward.")
    reward: str = option("", "The reward component whose within-group variance drives the macro factor (e.g. "
                             "accuracy); empty turns the macro factor off.")
    reward_range: float = option(1.0, "The span of that reward (max - min possible; 1 for a 0/1 or [0, 1] reward): a "
                                      "group's variance is at most range^2 / 4 (Popoviciu), which gives u_g = 1.")
    max_scale: float = option(3.0, "The widening factor of the clip range is at most this.")

    def validate(self) -> None:
        for name in ("alpha", "gamma"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not (self.adv_cap > 0 and self.reward_range > 0):
            raise ValueError(f"adv_cap and reward_range must be > 0, got {self.adv_cap} and {self.reward_range}")
        if not (self.max_scale >= 1 and math.isfinite(self.max_scale)):
            raise ValueError(f"max_scale must be a finite number >= 1, got {self.max_scale}")


@register
class ETR(Variant):
    """The clipped surrogate with per-action clip widths (mmrl's rule; the abstract states the two elasticities, not
    their formulas):

    * ``transform`` (once per update, this process's samples): for ``reward`` set, ``u_g = min(1, 4 var_g /
      reward_range^2)`` with ``var_g`` the biased within-group variance (``rollout.group_ids``, NaN left out) of that
      component, kept per sample; else ``u = 0``. The advantages pass through unchanged.
    * ``surrogate``: ``m = min(max_scale, (1 + alpha min(|A|, adv_cap)) (1 + gamma u_g))`` per action (``|A|`` of the
      action, so dense ``[N, T]`` advantages widen per step), and
      ``l = -min(ratio A, clamp(ratio, 1 - clip_low m, 1 + clip_high m) A)``.

    ``m >= 1``: the trust region only widens, most for confident (large ``|A|``) actions of groups in the "learning
    zone" (a 0/1 reward's variance ``p (1 - p)`` peaks at ``p = 1/2``, where ``u = 1``). A group split over several
    processes has its variance taken over this process's rows of it."""

    name = "etr"
    summary = "clipped surrogate whose clip range widens with the advantage magnitude and the group's reward variance"
    paper = ("ETR: Outcome-Guided Elastic Trust Regions for Policy Optimization, Zhang et al. 2026, arXiv 2601.03723 "
             "(the widening formulas are mmrl's)")
    Options = ETROptions

    def __init__(self, options: Any = None):
        super().__init__(options)
        self.zone: Tensor | None = None  # u_g per sample of this update's local batch

    def check(self, config) -> None:
        if self.options.reward:
            self.require_reward(config, "reward")

    def transform(self, ctx: TransformContext) -> Tensor:
        o = self.options
        n = ctx.advantages.shape[0]
        if not o.reward:
            self.zone = torch.zeros(n)
            return ctx.advantages
        if o.reward not in ctx.scores:
            raise ValueError(f"variant 'etr': no score component {o.reward!r}; have {sorted(ctx.scores)}")
        score = ctx.scores[o.reward]
        if score.dim() != 1:
            raise ValueError(f"variant 'etr': reward {o.reward!r} must be one score per sample [N], got shape "
                             f"{tuple(score.shape)}")
        values = score.double().unsqueeze(1)
        index, num_groups = group_index(ctx.rollout.group_ids.cpu())
        _, std, _ = _grouped_stats(values.cpu(), torch.isfinite(values.cpu()), index, num_groups, 0)
        self.zone = (4.0 * std[:, 0].square() / o.reward_range ** 2).clamp(max=1.0).float()
        return ctx.advantages

    def surrogate(self, ctx: SurrogateContext) -> Tensor:
        o = self.options
        if self.zone is None:
            raise RuntimeError("variant 'etr': the transform stage has not run for this update")
        adv = ctx.advantages
        zone = self.zone.to(adv.device)[ctx.index.to(adv.device)].unsqueeze(1)
        m = ((1.0 + o.alpha * adv.abs().clamp(max=o.adv_cap)) * (1.0 + o.gamma * zone)).clamp(max=o.max_scale)
        clipped = torch.clamp(ctx.ratio, 1.0 - ctx.clip_low * m, 1.0 + ctx.clip_high * m)
        return -torch.min(ctx.ratio * adv, clipped * adv)
