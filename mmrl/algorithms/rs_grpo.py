"""RS-GRPO (EVisRAG): fine-grained rewards bound to scope-specific tokens (per-image evidence vs the answer)."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.algorithms.base import option, register
from mmrl.algorithms.span_scoped import SpanScoped, SpanScopedOptions


@dataclass
class RSGRPOOptions(SpanScopedOptions):
    evidence: list = option([], "Reward components about the recorded per-image evidence: scoped to the spans their "
                                "rewards report (the evidence tokens).")
    answer: list = option([], "Reward components about the final answer: scoped to the <answer> block.")

    def validate(self) -> None:
        super().validate()
        both = set(self.evidence) & set(self.answer)
        if both:
            raise ValueError(f"{sorted(both)} cannot be both evidence and answer rewards")


@register
class RSGRPO(SpanScoped):
    """Reward-Scoped GRPO: :class:`~mmrl.algorithms.span_scoped.SpanScoped` with ``evidence`` components on their
    reported evidence spans, ``answer`` components on the ``<answer>`` block and the others (format, ...) on every
    token (``scopes`` may still set any component explicitly)."""

    name = "rs_grpo"
    summary = "evidence rewards on the evidence tokens, answer rewards on the answer tokens"
    paper = ("VisRAG 2.0: Evidence-Guided Multi-Image Reasoning in Visual Retrieval-Augmented Generation (EVisRAG, "
             "RS-GRPO), 2025, arXiv 2510.09733 (the evidence / answer scope mapping is mmrl's)")
    Options = RSGRPOOptions

    def implied_scope(self, component: str) -> str | None:
        if component in self.options.evidence:
            return "reward"
        return "answer" if component in self.options.answer else None

    def check(self, config) -> None:
        super().check(config)
        unknown = sorted((set(self.options.evidence) | set(self.options.answer)) - set(config.rewards))
        if unknown:
            from mmrl.algorithms.base import VariantError

            raise VariantError(f"variant 'rs_grpo': {unknown} are not among the configured rewards "
                               f"{sorted(config.rewards)}")
