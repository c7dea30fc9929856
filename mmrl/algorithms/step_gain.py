"""Step-gain credit (DenseGRPO): each denoising step is credited with the reward gain it causes."""

from __future__ import annotations

from torch import Tensor

from mmrl.algorithms.base import Intermediate, RewardContext, register
from mmrl.algorithms.dense import DenseCredit
from mmrl.core.credit import step_gain_credit


@register
class StepGain(DenseCredit):
    """``r_t = R_{t+1} - R_t`` per trained step (:func:`mmrl.core.credit.step_gain_credit`)."""

    name = "step_gain"
    summary = "per-step reward gain d_t = R_{t+1} - R_t of ODE-completed intermediate images"
    paper = ("DenseGRPO: From Sparse to Dense Reward for Flow Matching Model Alignment, Deng et al. 2026, "
             "arXiv 2601.20218")

    def credit(self, intermediate: Intermediate, ctx: RewardContext) -> Tensor:
        return step_gain_credit(intermediate.step_rewards)
