"""MIG: a denoising step is credited only by how much it raises the running maximum (watermark) of the reward."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import Intermediate, RewardContext, option, register
from mmrl.algorithms.dense import DenseCredit
from mmrl.algorithms.pure_credit import _nan_rows
from mmrl.core.credit import _step_rewards


def watermark_credit(step_rewards: Tensor, *, accumulate: bool = False, outcome_weight: float = 0.0) -> Tensor:
    """Marginal gain over the monotonic watermark, ``[N, T+1] -> [N, T]``.

    ``W_k = max(R_0 .. R_k)``; ``m_t = W_{t+1} - W_t = max(R_{t+1} - W_t, 0)``; with ``accumulate`` the sum from
    ``t`` on, ``W_T - W_t``; plus ``outcome_weight * R_T`` on every step. NaN rewards give a NaN row.
    """
    values = _step_rewards(step_rewards)
    watermark = torch.nan_to_num(values, nan=0.0).cummax(dim=1).values
    gain = watermark[:, 1:] - watermark[:, :-1]
    out = gain.flip(1).cumsum(dim=1).flip(1) if accumulate else gain
    if outcome_weight:
        out = out + outcome_weight * values[:, -1:]
    return _nan_rows(values, out)


@dataclass
class MIGOptions:
    accumulate: bool = option(False, "Credit each step with the watermark raises from it to the end, W_T - W_t, "
                                     "instead of its own raise (mmrl's return-to-go form; default: the step's own "
                                     "marginal gain, Wang et al. 2026, arXiv 2602.01034).")
    outcome_weight: float = option(0.0, "Weight of the final reward R_T added to every step (MIG's outcome-oriented "
                                        "reward on the full completion; 0: process credit only).")

    def validate(self) -> None:
        if not self.outcome_weight >= 0 or not math.isfinite(self.outcome_weight):
            raise ValueError(f"outcome_weight must be a finite number >= 0, got {self.outcome_weight}")


@register
class MIG(DenseCredit):
    """Step-wise marginal information gain against a monotonic historical watermark, over denoising steps.

    Exact rule (``rewards`` stage via :class:`~mmrl.algorithms.dense.DenseCredit`; ``R_0 .. R_T`` the rewards of the
    images the trajectory reaches before the first and after each trained step)::

        W_0 = R_0,  W_{k} = max(W_{k-1}, R_k)                   the watermark: the best reward reached so far
        credit_t = W_{t+1} - W_t = max(R_{t+1} - W_t, 0)        (t = 0 .. T-1)
        accumulate:      credit_t = W_T - W_t
        outcome_weight:  credit_t += outcome_weight * R_T

    A step earns credit only for a *new best*: falling back and recovering to a level already reached earns
    nothing (step-gain credit ``R_{t+1} - R_t`` would pay the recovery again), and no step is ever negative. The
    gains telescope to ``max_k R_k - R_0``. The loop then normalises each step column within its group. A
    trajectory with a NaN reward gets NaN credit (advantage 0).

    Paper vs mmrl: scoring each step by its marginal gain over a monotonic historical watermark is the paper's idea
    (its abstract: "quantifies the intrinsic value of reasoning steps against a Monotonic Historical Watermark"; in
    the paper the process score is the policy's information about the ground truth after each reasoning step). Its
    exact formula was not available to us: the watermark recursion, seeding it with ``R_0`` (the reward before any
    trained step), the flow analogue (intermediate-image rewards as the process score), ``accumulate`` and adding the
    outcome to every step (the paper applies process and outcome rewards to different token masks) are mmrl's rule,
    not claimed parity.
    """

    name = "mig"
    summary = "per-step credit = how much the step raises the running maximum (watermark) of R_0 .. R_T"
    paper = ("Discovering Process-Outcome Credit in Multi-Step LLM Reasoning (MIG), Wang et al. 2026, arXiv 2602.01034 "
             "(the watermark rule on intermediate-image rewards is mmrl's)")
    Options = MIGOptions

    def credit(self, intermediate: Intermediate, ctx: RewardContext) -> Tensor:
        return watermark_credit(intermediate.step_rewards, accumulate=self.options.accumulate,
                                outcome_weight=self.options.outcome_weight)
