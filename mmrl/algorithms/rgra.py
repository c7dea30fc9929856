"""RGRA: REINFORCE with the group-relative advantage, no importance ratio and no clipping."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from mmrl.algorithms.base import SurrogateContext, Variant, VariantError, option, register


@dataclass
class RGRAOptions:
    negative_feedback: bool = option(True, "Keep the actions whose advantage is negative (RGRA, Carrino et al. 2026, "
                                           "finds them essential); false trains only on actions above the baseline, "
                                           "the ablation the paper reports as limiting learning.")

    def validate(self) -> None:
        if not isinstance(self.negative_feedback, bool):
            raise TypeError(f"negative_feedback must be true or false, got {self.negative_feedback!r}")


@register
class RGRA(Variant):
    """Per action ``l = -A * (logp - old_logp)``: the REINFORCE loss ``-A log pi`` with the group-relative advantage
    of the loop (its ``algorithm.scale``), whose gradient is ``-A * d logp`` whatever the ratio -- no ratio weighting,
    no clip, no min. Subtracting the detached ``old_logp`` only shifts the value (0 on-policy) so the logged
    ``policy_loss`` stays readable; the gradient is the paper's. The loop still adds ``beta * KL`` to the reference
    (RGRA keeps the KL term) and aggregates as ``algorithm.aggregation`` says. With ``negative_feedback=false`` the
    advantage is ``max(A, 0)``. The per-action log-probs are used, so ``ratio_level=sequence`` is refused."""

    name = "rgra"
    summary = "REINFORCE with group-relative advantages: loss -A log pi, no importance ratio, no clipping"
    paper = ("Are complicated loss functions necessary for teaching LLMs to reason? (RGRA), Carrino et al. 2026, "
             "arXiv 2603.18756")
    Options = RGRAOptions

    def check(self, config) -> None:
        if config.algorithm.ratio_level != "token":
            raise VariantError("variant 'rgra' has no importance ratio: it needs algorithm.ratio_level=token")

    def surrogate(self, ctx: SurrogateContext) -> Tensor:
        adv = ctx.advantages if self.options.negative_feedback else ctx.advantages.clamp(min=0.0)
        return -adv * (ctx.logps - ctx.old_logps.detach())
