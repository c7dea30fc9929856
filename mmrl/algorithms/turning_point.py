"""Turning-point credit (TP-GRPO): steps where the trajectory turns towards its final outcome get the long-term gain."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import Intermediate, RewardContext, option, register
from mmrl.algorithms.dense import DenseCredit
from mmrl.core.credit import turning_point_credit


@dataclass
class TurningPointOptions:
    balance: bool = option(False, "TP-GRPO's use_balanced_bonus: keep equal numbers of turning points from "
                                  "trajectories that end better and worse than their ODE baseline, within each "
                                  "sampling batch of train.sample_batch_size trajectories (as the anchor), so with it "
                                  "on sample_batch_size is part of the algorithm, not only a speed knob.")
    consistency_filter: bool = option(True, "TP-GRPO: require sign(d_t) sign(R_n - R_{t+1}) > 0 at a turning point "
                                            "(the released launch script).")


@register
class TurningPoint(DenseCredit):
    """:func:`mmrl.core.credit.turning_point_credit` in the paper's mode (``r_t = R_n - R_t`` at a turning point,
    ``d_t`` elsewhere)."""

    name = "turning_point"
    summary = "turning points get the aggregated long-term reward R_n - R_t, other steps their own gain"
    paper = ("Alleviating Sparse Rewards by Modeling Step-Wise and Long-Term Sampling Effects in Flow-Based GRPO "
             "(TP-GRPO), Tong et al. 2026, arXiv 2602.06422")
    Options = TurningPointOptions

    def credit(self, intermediate: Intermediate, ctx: RewardContext) -> Tensor:
        n = intermediate.step_rewards.shape[0]
        # balancing runs within each sampling batch (sample_batch_size trajectories, as the anchor balances one
        # per-device sampling batch), not over the whole rollout
        sampling_batch = torch.arange(n) // ctx.config.train.sample_batch_size
        result = turning_point_credit(intermediate.step_rewards, balance=self.options.balance, group_ids=sampling_batch,
                                      consistency_filter=self.options.consistency_filter)
        ctx.stats["credit/turning_points"] = ctx.stats.get("credit/turning_points", 0.0) + float(
            result.turning_points.sum())
        return result.step_rewards
