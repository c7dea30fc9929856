"""GA-GRPO (MedScope): advantages scaled by the quality of the evidence each response grounded its answer on."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from mmrl.algorithms.base import TransformContext, Variant, option, register
from mmrl.core.variants import evidence_weighted_advantages


@dataclass
class GAGRPOOptions:
    reward: str = option("", "The reward component in [0, 1] that measures grounding quality (e.g. iou).")
    floor: float = option(0.0, "The weight of a positive advantage whose evidence quality is 0.")

    def validate(self) -> None:
        if not self.reward:
            raise ValueError("reward: name the reward component that scores grounding quality (e.g. iou)")
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"floor must be in [0, 1], got {self.floor}")


@register
class GAGRPO(Variant):
    """:func:`mmrl.core.variants.evidence_weighted_advantages` (sign-aware; the modulation rule is mmrl's)."""

    name = "ga_grpo"
    summary = "advantages scaled by each response's evidence quality (credit shrinks, blame grows)"
    paper = ("MedScope: Incentivizing 'Think with Videos' for Clinical Reasoning via Coarse-to-Fine Tool Calling, "
             "Li et al. 2026, arXiv 2602.13332 (GA-GRPO; the modulation rule is mmrl's)")
    Options = GAGRPOOptions

    def check(self, config) -> None:
        self.require_reward(config, "reward")

    def transform(self, ctx: TransformContext) -> Tensor:
        return evidence_weighted_advantages(ctx.advantages, ctx.scores[self.options.reward], floor=self.options.floor)
