"""LENS: wrong answers get a negative, confidence-dependent signal, so all-wrong groups are not wasted."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import TransformContext, Variant, option, register

CONFIDENCES = ("token_mean", "sequence")


@dataclass
class LENSOptions:
    reward: str = option("", "The correctness component (a key of `rewards`, e.g. accuracy): an answer is wrong when "
                             "it scores <= threshold (LENS, Feng et al. 2025, arXiv 2510.08696, penalises wrong "
                             "answers by the policy's confidence).")
    threshold: float = option(0.5, "An answer is correct when its `reward` component is > threshold.")
    weight: float = option(0.5, "Penalty per unit of confidence on a wrong answer, in advantage units (mmrl's "
                                "scale; the paper's constant was not available).")
    confidence: str = option("token_mean", "The policy's confidence in a response: 'token_mean' = exp(mean log-prob "
                                           "of its tokens), the geometric-mean token probability in (0, 1]; "
                                           "'sequence' = exp(sum of log-probs) = pi_old(y | x).")

    def validate(self) -> None:
        if not self.reward:
            raise ValueError("reward: name the correctness component that decides wrong answers (e.g. accuracy)")
        if self.weight < 0:
            raise ValueError(f"weight must be >= 0, got {self.weight}")
        if self.confidence not in CONFIDENCES:
            raise ValueError(f"confidence must be one of {CONFIDENCES}, got {self.confidence!r}")


def response_confidence(old_logps: Tensor, mask: Tensor, mode: str = "token_mean") -> Tensor:
    """``[N]`` confidence of each response from the sampling policy's per-token log-probs ``[N, T]`` over ``mask``:
    ``exp(sum M logp / sum M)`` (``token_mean``) or ``exp(sum M logp)`` (``sequence``); 0 for an empty response."""
    m = mask.to(old_logps.dtype)
    total = (old_logps * m).sum(-1)
    count = m.sum(-1)
    if mode == "token_mean":
        conf = torch.exp(total / count.clamp(min=1.0))
    elif mode == "sequence":
        conf = torch.exp(total)
    else:
        raise ValueError(f"unknown confidence {mode!r}; expected one of {CONFIDENCES}")
    return torch.where(count > 0, conf, torch.zeros_like(conf))


@register
class LENS(Variant):
    """A confidence-weighted penalty on wrong answers, added after the group normalisation (mmrl's rule).

    The abstract: the MLE gradient equals a policy gradient for a modified value function that "adds a
    confidence-weighted penalty on incorrect responses, imposing larger penalties on more confident mistakes", so
    LENS gives incorrect generations "non-zero, confidence-dependent rewards" and negative groups become
    informative. Its exact formula was not available; mmrl implements this rule in the ``transform`` stage::

        c_i  = exp( sum_t M_it log pi_old(y_it) / sum_t M_it )    (confidence='token_mean'; 'sequence': exp(sum))
        A'_i = A_i - weight * c_i     if the answer is wrong (reward component <= threshold)
        A'_i = A_i                    if it is right, or its correctness is NaN (not judged)

    (``[N, T]`` advantages get the same penalty on every step.) So every wrong answer is pushed down, a confident
    one harder, and an all-wrong group (``A = 0`` under GRPO) gets ``-weight * c_i`` instead of nothing.

    What differs from the paper: LENS changes the *reward* of wrong answers before the group normalisation. In mmrl
    no stage has the sampling policy's log-probs before the advantages (``RewardContext`` / ``AdvantageContext`` carry
    none; ``old_logps`` exist from the ``transform`` stage on), and ``TransformContext`` has neither the algorithm
    settings (``eps``, ``std_ddof``, ``scale``) nor the other processes' samples needed to renormalise there. So the
    penalty is added to the normalised advantage and is not itself centred or scaled by the group: the signal on
    all-wrong groups is uniform in sign (all negative), where a renormalised reward would be zero-mean in the group.
    The log-probs are those of the sampling policy before the first update (``needs = ("old_logps",)``).
    """

    name = "lens"
    summary = "wrong answers get a negative advantage term weight x the policy's confidence in them"
    paper = ("Don't Waste Mistakes: Leveraging Negative RL-Groups via Confidence Reweighting (LENS), Feng et al. "
             "2025, arXiv 2510.08696 (the penalty rule and its placement after normalisation are mmrl's)")
    Options = LENSOptions
    needs = ("old_logps",)
    families = ("vlm",)  # confidence from token probabilities; a flow's per-step log-densities are no probabilities

    def check(self, config) -> None:
        self.require_reward(config, "reward")

    def transform(self, ctx: TransformContext) -> Tensor:
        o, r = self.options, ctx.rollout
        correctness = ctx.scores[o.reward].float()
        if correctness.dim() != 1:
            raise ValueError(f"variant 'lens': the correctness component {o.reward!r} must be one value per sample, "
                             f"got shape {tuple(correctness.shape)}")
        conf = response_confidence(r.old_logps.float(), r.mask, o.confidence)
        wrong = torch.isfinite(correctness) & (correctness <= o.threshold)
        penalty = torch.where(wrong, o.weight * conf, torch.zeros_like(conf)).to(ctx.advantages.dtype)
        if ctx.advantages.dim() == 2:
            penalty = penalty.unsqueeze(1)
        return ctx.advantages - penalty
