"""Clip and Delta: process-reward refinements that keep a trajectory's accumulated reward bounded (unhackable)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import Intermediate, RewardContext, global_mean, option, register
from mmrl.algorithms.dense import DenseCredit
from mmrl.algorithms.pure_credit import _nan_rows, process_rewards
from mmrl.core.credit import _step_rewards

MODES = ("clip", "delta")
THRESHOLDS = ("mean", "fixed")


def refined_process_rewards(step_rewards: Tensor, *, mode: str = "clip", threshold: str = "mean",
                            eta: float = 0.0) -> Tensor:
    """Clip or Delta refined process rewards ``[N, T]`` of ``r_t = R_{t+1}`` (``step_rewards`` ``[N, T+1]``).

    ``clip``: ``min(r_t - eta, 0)`` with ``eta`` the mean of every finite ``r`` of ``step_rewards``
    (``threshold="mean"``; the variant passes the mean over every process's samples as a fixed ``eta``) or the
    given ``eta`` (``"fixed"``). ``delta``: ``r_t - r_{t+1}`` for ``t < T-1``, 0 for the last step.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if threshold not in THRESHOLDS:
        raise ValueError(f"threshold must be one of {THRESHOLDS}, got {threshold!r}")
    r = process_rewards(step_rewards, "reward")
    if mode == "clip":
        if threshold == "mean":
            finite = r[torch.isfinite(r)]
            eta = float(finite.mean()) if finite.numel() else 0.0
        return (r - eta).clamp(max=0.0)
    return torch.cat([r[:, :-1] - r[:, 1:], torch.zeros_like(r[:, :1])], dim=1)


def clip_delta_credit(step_rewards: Tensor, *, mode: str = "clip", threshold: str = "mean", eta: float = 0.0,
                      accumulate: bool = True, outcome_weight: float = 1.0) -> Tensor:
    """Per-step credit ``[N, T]``: the refined rewards, plus ``outcome_weight * R_T`` on the last step, summed from
    each step to the end when ``accumulate`` (the return-to-go, gamma = 1). NaN rewards give a NaN row."""
    values = _step_rewards(step_rewards)
    refined = torch.nan_to_num(refined_process_rewards(values, mode=mode, threshold=threshold, eta=eta), nan=0.0)
    refined[:, -1] = refined[:, -1] + outcome_weight * torch.nan_to_num(values[:, -1], nan=0.0)
    out = refined.flip(1).cumsum(dim=1).flip(1) if accumulate else refined
    return _nan_rows(values, out)


@dataclass
class ClipDeltaOptions:
    mode: str = option("clip", "Which refinement of the process rewards r_t = R_{t+1} (Gao et al. 2024, arXiv "
                               "2410.15115): 'clip' min(r_t - eta, 0), 'delta' r_t - r_{t+1} (last step 0).")
    threshold: str = option("mean", "Clip's eta: 'mean' = the batch mean of the process rewards (mmrl's scale-free "
                                     "choice), 'fixed' = the option eta (the paper's fixed threshold).")
    eta: float = option(0.0, "Clip's fixed threshold eta (threshold: fixed), in the reward's units.")
    accumulate: bool = option(True, "Credit each step with the sum of the refined rewards from it to the end (the "
                                    "return the paper's RL optimises, gamma = 1); false: the step's own refined reward.")
    outcome_weight: float = option(1.0, "Weight of the final reward R_T added at the last step (the paper combines "
                                        "the refined process rewards with the success reward); 0: process only.")

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.threshold not in THRESHOLDS:
            raise ValueError(f"threshold must be one of {THRESHOLDS}, got {self.threshold!r}")
        if self.eta != 0.0 and not (self.mode == "clip" and self.threshold == "fixed"):
            raise ValueError(f"eta={self.eta} is Clip's fixed threshold: it takes effect only with mode: clip and "
                             f"threshold: fixed (mode={self.mode}, threshold={self.threshold})")
        if not math.isfinite(self.eta):
            raise ValueError(f"eta must be finite, got {self.eta}")
        if not self.outcome_weight >= 0 or not math.isfinite(self.outcome_weight):
            raise ValueError(f"outcome_weight must be a finite number >= 0, got {self.outcome_weight}")


@register
class ClipDelta(DenseCredit):
    """The Clip and Delta refinements of process rewards, on the intermediate-image rewards of a flow trajectory.

    Exact rule (``rewards`` stage via :class:`~mmrl.algorithms.dense.DenseCredit`; process reward of trained step
    ``t`` = ``r_t = R_{t+1}``, the reward of the image it leads to, ``t = 0 .. T-1``)::

        clip:   c_t = min(r_t - eta, 0)          eta = mean of all r of the batch (threshold = mean) or the option eta
        delta:  c_t = r_t - r_{t+1}  (t < T-1),  c_{T-1} = 0
        c_{T-1} += outcome_weight * R_T          (the success / outcome reward at the end)
        credit_t = sum_{k >= t} c_k              (accumulate = true, default; else credit_t = c_t)

    Both bound what a trajectory can collect from process rewards: clipped rewards are never positive, so repeating
    good-looking steps earns nothing; delta rewards telescope, so with the defaults ``credit_t = R_{t+1}`` exactly
    (``outcome_weight = 0``: ``R_{t+1} - R_T``) whatever the number of steps. The loop then normalises each step
    column within its group. A trajectory with a NaN reward gets NaN credit (advantage 0).

    Paper vs mmrl: ``min(r - eta, 0)`` and ``r_k - r_{k+1}``, with the refined rewards combined with the success
    reward and the idea of an upper-bounded accumulated reward, are the paper's (its abstract: "Clipping and Delta
    ... ensure the accumulative reward of any reasoning trajectory is upper-bounded"); the full text was not
    available to us, so the last step's delta of 0 (read from its figure: the last step's process reward is left
    out), the batch-mean threshold (the paper's eta is a fixed hyperparameter; flow rewards have no common scale),
    per-column group normalisation instead of PPO's value baseline, and using intermediate-image rewards as process
    rewards are mmrl's, not claimed parity.
    """

    name = "clip_delta"
    summary = "Clip (min(R_{t+1} - eta, 0)) or Delta (R_{t+1} - R_{t+2}) process rewards, returns-to-go plus outcome"
    paper = ("On Designing Effective RL Reward at Training Time for LLM Reasoning, Gao et al. 2024, arXiv 2410.15115 "
             "(Clip and Delta; applied to intermediate-image rewards, threshold and last step: mmrl's)")
    Options = ClipDeltaOptions

    def credit(self, intermediate: Intermediate, ctx: RewardContext) -> Tensor:
        o = self.options
        threshold, eta = o.threshold, o.eta
        if o.mode == "clip" and threshold == "mean":  # the mean over every process's samples, not this one's
            threshold, eta = "fixed", global_mean(process_rewards(_step_rewards(intermediate.step_rewards), "reward"),
                                                 ctx.accelerator)
        return clip_delta_credit(intermediate.step_rewards, mode=o.mode, threshold=threshold, eta=eta,
                                 accumulate=o.accumulate, outcome_weight=o.outcome_weight)
