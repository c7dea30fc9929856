"""PURE min-form credit: the value of a denoising step is the minimum of the process rewards from it onward."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import Intermediate, RewardContext, option, register
from mmrl.algorithms.dense import DenseCredit
from mmrl.core.credit import _step_rewards, step_gain_credit

PROCESS_REWARDS = ("reward", "gain")


def process_rewards(step_rewards: Tensor, process: str = "reward") -> Tensor:
    """The process reward of each trained step ``[N, T]`` from ``R_0 .. R_T`` ``[N, T+1]``: ``"reward"``:
    ``r_t = R_{t+1}`` (the reward of the image step ``t`` leads to); ``"gain"``: ``r_t = R_{t+1} - R_t``."""
    if process not in PROCESS_REWARDS:
        raise ValueError(f"process must be one of {PROCESS_REWARDS}, got {process!r}")
    values = _step_rewards(step_rewards)
    return values[:, 1:].clone() if process == "reward" else step_gain_credit(values)


def _nan_rows(values: Tensor, out: Tensor) -> Tensor:
    """A trajectory with any NaN reward gets NaN everywhere (advantage 0 downstream)."""
    bad = torch.isnan(values).any(dim=1, keepdim=True)
    return torch.where(bad, torch.full_like(out, math.nan), out)


def min_form_credit(step_rewards: Tensor, *, process: str = "reward", temperature: float = 0.0) -> Tensor:
    """PURE's min-form value of every trained step, ``[N, T+1] -> [N, T]``.

    ``temperature = 0``: ``V_t = min_{k >= t} r_k`` (exact). ``temperature = tau > 0``: the released code's
    approximation, ``r*_k = softmax_k(-r / tau) r_k`` over the trajectory's steps, then ``V_t = sum_{k >= t} r*_k``.
    """
    if not temperature >= 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    values = _step_rewards(step_rewards)
    r = process_rewards(values, process)
    safe = torch.nan_to_num(r, nan=0.0)
    if temperature == 0.0:
        out = safe.flip(1).cummin(dim=1).values.flip(1)
    else:
        weighted = torch.softmax(-safe / temperature, dim=1) * safe
        out = weighted.flip(1).cumsum(dim=1).flip(1)
    return _nan_rows(values, out)


@dataclass
class PURECreditOptions:
    process: str = option("reward", "The process reward of step t: 'reward' = R_{t+1}, the reward of the image the "
                                    "step leads to (a PRM scores the partial solution a step reaches; PURE, Cheng et "
                                    "al. 2025, arXiv 2504.15275), or 'gain' = R_{t+1} - R_t (mmrl's alternative).")
    temperature: float = option(0.0, "0: the exact min-form value min_{k>=t} r_k (PURE's definition); tau > 0: the "
                                     "released code's softmin approximation (its tau: 0.1), softmax(-r/tau) r summed "
                                     "from t on.")

    def validate(self) -> None:
        if self.process not in PROCESS_REWARDS:
            raise ValueError(f"process must be one of {PROCESS_REWARDS}, got {self.process!r}")
        if not self.temperature >= 0 or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")


@register
class PURECredit(DenseCredit):
    """PURE's min-form credit assignment over denoising steps.

    Exact rule (``rewards`` stage via :class:`~mmrl.algorithms.dense.DenseCredit`; ``R_0 .. R_T`` the rewards of
    the images the trajectory reaches before the first and after each trained step)::

        r_t      = R_{t+1}                       (process = "reward", default)   or   R_{t+1} - R_t   ("gain")
        credit_t = min_{k = t .. T-1} r_k        (temperature = 0, default)

    so a step is worth the worst state the trajectory still goes through after it: a step cannot be credited for
    a high intermediate reward that a later step loses (sum-form credit ``sum_{k >= t} r_k`` can, which is what
    PURE identifies as the source of process-reward hacking). The loop then normalises each step column within its
    group. ``temperature = tau > 0`` gives the released code's approximation instead
    (``CJReinforce/PURE``, ``turn_process_reward_logits_to_reward``, ``tau = 0.1``): ``r*_k = softmax(-r / tau)_k r_k``
    over the trajectory's steps and ``credit_t = sum_{k >= t} r*_k`` (-> ``min_k r_k`` for steps up to the argmin
    and -> 0 after it as ``tau -> 0``). A trajectory with a NaN reward gets NaN credit (advantage 0).

    Which process reward, and why: a PRM scores the partial solution *reached* after each step, so the flow analogue
    is ``R_{t+1}``, the reward of the image the trained step ``t`` leads to (ODE-completed or one-step predicted,
    ``sampling.intermediate``); its min over the future is bounded by the reward's own range, as PURE requires.
    ``process = "gain"`` takes the per-step gains ``d_t`` instead (a step is then worth the worst future gain);
    that choice is mmrl's.

    Paper vs mmrl: the min-form value ``min_{k >= t} r_k`` is PURE's (its abstract: "formulates the value function as
    the minimum of future rewards"), the softmin approximation its code's; applying it to intermediate-image
    rewards of a flow trajectory, per-column group normalisation in place of PURE's RLOO baseline, and no mixing
    with verifiable rewards are mmrl's, not claimed parity.
    """

    name = "pure_credit"
    summary = "min-form credit: each step is worth the minimum process reward R_{k+1} from it onward"
    paper = ("Stop Summation: Min-Form Credit Assignment Is All Process Reward Model Needs for Reasoning (PURE), "
             "Cheng et al. 2025, arXiv 2504.15275 (applied to intermediate-image rewards: mmrl's)")
    Options = PURECreditOptions

    def credit(self, intermediate: Intermediate, ctx: RewardContext) -> Tensor:
        return min_form_credit(intermediate.step_rewards, process=self.options.process,
                               temperature=self.options.temperature)
