"""VGPO-style value-anchored advantages: a group term plus an absolute term against a running value per prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmrl.algorithms.base import AdvantageContext, Variant, VariantError, option, register
from mmrl.algorithms.dense import DenseCredit, configured
from mmrl.core.credit import value_anchored_advantages


@dataclass
class VGPOOptions:
    weight: float = option(1.0, "Weight of the absolute term (R - V) / scale added to the group term.")
    scale: float = option(1.0, "The reward's natural scale dividing the absolute term.")
    decay: float = option(0.9, "Each prompt's value V is a running mean of its rewards: V <- decay V + (1 - decay) R.")

    def validate(self) -> None:
        if self.weight <= 0 or self.scale <= 0:
            raise ValueError(f"weight and scale must be > 0, got {self.weight} and {self.scale}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")


@register
class VGPO(Variant):
    """:func:`mmrl.core.credit.value_anchored_advantages` with ``V`` each condition's running mean reward (the
    batch mean for a condition not seen yet), anchors updated after use and kept in checkpoints. The running mean
    moves once per sample, in batch order: a group of ``G`` samples of one prompt applies ``V <- decay V + (1 - decay)
    R_i`` ``G`` times."""

    name = "vgpo"
    summary = "group advantages plus weight (R - V) / scale against a running per-prompt value, so uniform groups learn"
    paper = ("Anchoring Values in Temporal and Group Dimensions for Flow Matching Model Alignment (VGPO), Shao et al. "
             "2025, arXiv 2512.12387 (its dual advantage formula was not available; the rule is mmrl's)")
    Options = VGPOOptions

    def __init__(self, options: Any = None):
        super().__init__(options)
        self.anchors: dict[str, float] = {}

    def check(self, config) -> None:
        a = config.algorithm
        if a.scale != "group" or a.reward_combination != "sum_then_normalize" or configured(config, DenseCredit):
            raise VariantError("variant 'vgpo' works with algorithm.scale=group, reward_combination=sum_then_normalize "
                               "and outcome credit (no dense-credit variant)")

    def advantages(self, ctx: AdvantageContext) -> Tensor:
        a, o = ctx.algorithm, self.options
        total = sum(w * ctx.components[k] for k, w in ctx.weights.items())
        finite = total[torch.isfinite(total)]
        fallback = float(finite.mean()) if finite.numel() else 0.0
        value = torch.tensor([self.anchors.get(k, fallback) for k in ctx.keys])
        adv = value_anchored_advantages(total, ctx.group_ids, value=value, weight=o.weight, scale=o.scale, eps=a.eps,
                                        std_ddof=a.std_ddof, clamp=a.advantage_clamp)
        for key, r in zip(ctx.keys, total.tolist()):  # the anchors move after they were used
            if r == r:
                self.anchors[key] = o.decay * self.anchors.get(key, r) + (1.0 - o.decay) * r
        return adv

    def state_dict(self) -> dict[str, Any]:
        return {"anchors": dict(self.anchors)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.anchors = dict(state.get("anchors", {}))
