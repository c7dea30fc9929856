"""TW-GRPO: token weights from the intra-group divergence at each position."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from mmrl.algorithms.base import TransformContext, Variant, option, register
from mmrl.core.variants import token_weighted_advantages


@dataclass
class TWGRPOOptions:
    max_weight: float = option(1.4, "The largest token weight alpha (the paper's trainer: 1.4).")

    def validate(self) -> None:
        if self.max_weight < 1.0:
            raise ValueError(f"max_weight must be >= 1 (token weights run from 1 to it), got {self.max_weight}")


@register
class TWGRPO(Variant):
    """:func:`mmrl.core.variants.token_weighted_advantages` on the sampling policy's per-token log-probs (the
    ``[N, T]`` statistic; see :func:`~mmrl.core.variants.token_variance_weights` for the exact rule)."""

    name = "tw_grpo"
    summary = "per-token advantage weights from the group's spread at each position"
    paper = ("Reinforcing Video Reasoning with Focused Thinking (TW-GRPO), Dang et al. 2025, arXiv 2505.24718")
    Options = TWGRPOOptions
    needs = ("old_logps",)

    def transform(self, ctx: TransformContext) -> Tensor:
        r = ctx.rollout
        return token_weighted_advantages(ctx.advantages, r.old_logps, r.mask, r.group_ids,
                                         max_weight=self.options.max_weight)
