"""G2RPO-style Gaussian rank normalisation of rewards within each group."""

from __future__ import annotations

from torch import Tensor

from mmrl.algorithms.base import AdvantageContext, Variant, VariantError, register
from mmrl.core.advantages import combine_rewards


@register
class G2RPO(Variant):
    """:func:`mmrl.core.advantages.gaussian_rank_advantages` in place of the linear group normalisation, grouped as
    the loop groups (``algorithm.per_prompt_stat_tracking``), combined as ``algorithm.reward_combination`` says and
    clamped to ``algorithm.advantage_clamp`` (each component's, or the sum's with ``clamp_summed_advantage``); GDPO's
    ``batch_normalize_sum`` divides by the batch std plus ``algorithm.eps``. The rank transform replaces the
    ``scale`` / ``std_ddof`` of the linear normalisation, so ``algorithm.scale: none`` (no std division) is refused."""

    name = "g2rpo"
    summary = "advantages are the standard-normal quantiles of each reward's rank in its group"
    paper = ("Gaussian GRPO (G^2RPO), the objective of OpenVLThinkerV2 (2026): advantages forced to N(0, 1); the "
             "rank -> Hazen-quantile rule is mmrl's")

    def check(self, config) -> None:
        if config.algorithm.scale == "none":
            raise VariantError("variant 'g2rpo' maps each group's rewards to N(0, 1) quantiles: algorithm.scale: none "
                               "(Dr. GRPO's unscaled R - mean) cannot apply; drop one")

    def advantages(self, ctx: AdvantageContext) -> Tensor:
        a = ctx.algorithm
        return combine_rewards(ctx.components, ctx.labels, weights=ctx.weights, mode=a.reward_combination,
                               batch_normalize=a.batch_normalize_sum, clamp_sum=a.clamp_summed_advantage,
                               batch_eps=a.eps, estimator="gaussian_rank", clamp=a.advantage_clamp)
