"""Reg-GRPO: the policy's log-ratio regressed onto the group-relative advantage, with no clip and no min."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from mmrl.algorithms.base import SurrogateContext, Variant, option, register


@dataclass
class RegGRPOOptions:
    scale: float = option(5.0, "s: an action's predicted advantage is s * log_ratio, so the loss (s log_ratio - A)^2 "
                               "/ (2 s) pulls each log-ratio to A / s (5: |A| = 1 moves a log-prob by 0.2, about "
                               "the usual clip range); Reg-GRPO (Park et al. 2025) regresses the advantage.")

    def validate(self) -> None:
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ValueError(f"scale must be a finite number > 0, got {self.scale}")


@register
class RegGRPO(Variant):
    """Per action ``l = (s * log_ratio - A)^2 / (2 s)`` (``log_ratio = logp - old_logp``, per action or GSPO's
    per-sample one). Its gradient ``(s * log_ratio - A) * d logp`` is GRPO's ``-A`` on-policy and vanishes once the
    log-ratio reaches ``A / s``: the regression target replaces clipping and the min (both absent), and it pushes back
    an action that overshoots, in either direction. The regression form is the abstract's; the per-action
    prediction ``s * log_ratio`` and the ``1 / (2 s)`` normalisation are mmrl's (the paper's exact prediction, e.g. a
    group-normalised ratio, is not in the abstract), so no parity is claimed."""

    name = "reg_grpo"
    summary = "regress the advantage from the log-ratio: loss (s log_ratio - A)^2 / (2 s), no clip, no min"
    paper = ("DeepVideo-R1: Video Reinforcement Fine-Tuning via Difficulty-aware Regressive GRPO (Reg-GRPO), Park et "
             "al. 2025, arXiv 2506.07464 (the per-action regression rule is mmrl's)")
    Options = RegGRPOOptions

    def surrogate(self, ctx: SurrogateContext) -> Tensor:
        s = self.options.scale
        return (s * ctx.log_ratio - ctx.advantages).square() / (2.0 * s)
