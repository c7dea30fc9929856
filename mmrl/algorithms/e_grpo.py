"""E-GRPO's group-normalised advantage for merged high-entropy SDE steps."""

from __future__ import annotations

from torch import Tensor

from mmrl.algorithms.base import AdvantageContext, Variant, VariantError, register
from mmrl.core.credit import multi_step_group_advantages


@register
class EGRPO(Variant):
    """With ``sampling.train_steps: entropy_merge`` (consecutive low-entropy SDE steps merged into one high-entropy
    step on a coarser sigma grid, :func:`mmrl.core.credit.merge_low_entropy_steps`), the advantage of every merged step
    is E-GRPO's multi-step group normalisation (:func:`mmrl.core.credit.multi_step_group_advantages`): the weighted
    total reward normalised within its group with the unbiased std and ``eps = 1e-8`` of the released code, then
    ``algorithm.advantage_clamp``. The merge itself stays a sampling mode (it changes the policy's sigma grid); this
    variant is its advantage rule."""

    name = "e_grpo"
    summary = "E-GRPO's multi-step group-normalised advantage for merged high-entropy SDE steps"
    paper = ("E-GRPO: High Entropy Steps Drive Effective Reinforcement Learning for Flow Models, Zhang et al. 2026, "
             "arXiv 2601.00423 (the merge threshold rule is mmrl's, see merge_low_entropy_steps)")
    families = ("flow",)

    def check(self, config) -> None:
        if config.sampling.train_steps != "entropy_merge":
            raise VariantError("variant 'e_grpo' normalises the rewards of merged SDE steps: set "
                               "sampling.train_steps=entropy_merge (with sampling.merge_threshold or merge_groups)")
        if config.algorithm.reward_combination != "sum_then_normalize":
            raise VariantError("variant 'e_grpo' normalises the weighted total reward: it needs "
                               "algorithm.reward_combination=sum_then_normalize")

    def advantages(self, ctx: AdvantageContext) -> Tensor:
        total = sum(w * ctx.components[k].float() for k, w in ctx.weights.items())
        adv = multi_step_group_advantages(total.unsqueeze(1), ctx.labels).squeeze(1)
        clamp = ctx.algorithm.advantage_clamp
        return adv.clamp(-clamp, clamp) if clamp is not None else adv
