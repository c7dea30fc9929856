"""G2RPO-style Gaussian rank normalisation of rewards within each group."""

from __future__ import annotations

from torch import Tensor

from mmrl.algorithms.base import AdvantageContext, Variant, register
from mmrl.core.advantages import combine_rewards


@register
class G2RPO(Variant):
    """:func:`mmrl.core.advantages.gaussian_rank_advantages` in place of the linear group normalisation, grouped as
    the loop groups (``algorithm.per_prompt_stat_tracking``) and combined as ``algorithm.reward_combination`` says."""

    name = "g2rpo"
    summary = "advantages are the standard-normal quantiles of each reward's rank in its group"
    paper = ("Gaussian GRPO (G^2RPO), the objective of OpenVLThinkerV2 (2026): advantages forced to N(0, 1); the "
             "rank -> Hazen-quantile rule is mmrl's")

    def advantages(self, ctx: AdvantageContext) -> Tensor:
        a = ctx.algorithm
        return combine_rewards(ctx.components, ctx.labels, weights=ctx.weights, mode=a.reward_combination,
                               batch_normalize=a.batch_normalize_sum, estimator="gaussian_rank")
