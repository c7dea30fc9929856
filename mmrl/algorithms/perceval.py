"""Perceval: token-level penalties on the hallucinated spans a claim checker finds, instead of one sequence value."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from mmrl.algorithms.base import TransformContext, Variant, option, register


@dataclass
class PercevalOptions:
    claims: str = option("", "The reward component whose reward reports the hallucinated (perceptually wrong) claim "
                             "spans of each response (its spans; its score may have weight 0).")
    penalty: float = option(1.0, "Subtracted from the advantage of every token inside a hallucinated span.")

    def validate(self) -> None:
        if not self.claims:
            raise ValueError("claims: name the reward component that reports hallucinated spans")
        if self.penalty < 0:
            raise ValueError(f"penalty must be >= 0, got {self.penalty}")


@register
class Perceval(Variant):
    """``A[i, t] = A_i - penalty * H[i, t]``: the loop's sequence advantage on every token, and a targeted penalty on
    the tokens ``H`` inside the spans the ``claims`` reward reports as hallucinated (mapped with the tokenizer,
    :mod:`mmrl.pipelines.vlm.spans`). The paper's rule is the token-level penalty on Perceval's hallucinated spans;
    the additive form and ``penalty`` are mmrl's."""

    name = "perceval"
    summary = "token-level penalty on the hallucinated claim spans a perception checker reports"
    paper = ("Improving Vision-language Models with Perception-centric Process Reward Models (Perceval), Min et al. "
             "2026, arXiv 2604.24583 (the additive per-token penalty is mmrl's)")
    Options = PercevalOptions
    families = ("vlm",)

    def check(self, config) -> None:
        self.require_reward(config, "claims")

    def transform(self, ctx: TransformContext) -> Tensor:
        r = ctx.rollout
        reported = r.spans.get(self.options.claims) or [None] * len(r)
        hallucinated = ctx.policy.span_mask(r, [s or [] for s in reported])
        adv = ctx.advantages if ctx.advantages.dim() == 2 else ctx.advantages.unsqueeze(1).expand(r.mask.shape)
        ctx.stats["perceval/hallucinated_tokens"] = float(hallucinated.sum())
        return (adv.float() - self.options.penalty * hallucinated) * r.mask.float()
