"""Factorized reward assignment: vision rewards credit only the vision segments, text rewards only the text."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.algorithms.base import VariantError, option, register
from mmrl.algorithms.span_scoped import SpanScoped, SpanScopedOptions


@dataclass
class FactorizedOptions(SpanScopedOptions):
    vision: list = option([], "Reward components that judge the visual steps: their advantage goes only to the vision "
                              "segments (the policy's tool calls). Every other weighted component is a text reward: "
                              "its advantage goes to default_scope (the tokens outside the calls).")
    default_scope: str = option("outside_tool_calls", "Scope of the text rewards (the weighted components not in "
                                                      "vision or scopes).")

    def validate(self) -> None:
        super().validate()
        if not self.vision:
            raise ValueError("vision: name the reward components that judge the vision segments (e.g. [crop_recall])")
        overlap = sorted(set(self.vision) & set(self.scopes))
        if overlap:
            raise ValueError(f"{overlap} are vision rewards and have a scope in scopes too: name each once")


@register
class Factorized(SpanScoped):
    """Factorized reward assignment (Kim et al. 2026): instead of one joint advantage on every token, each reward
    credits only the segment of the modality it judges, so the text's reward does not move the visual steps and the
    visual steps' reward does not move the text ("cross-modal interference" in the paper's joint assignment).

    On :class:`~mmrl.algorithms.span_scoped.SpanScoped`'s mechanism: every weighted component gets its own
    group-relative advantage; the ``vision`` components' apply on the ``tool_calls`` scope, the others' on
    ``outside_tool_calls``. A completion without a call has no vision segment, so a vision reward credits nothing there.
    The paper's vision segments are image tokens that a unified discrete-diffusion model generates (its visual rollouts
    edit the image locally); mmrl's VLM policies write no image tokens, and their visual steps are the image-tool calls
    of ``generation.tools`` (crop / rotate / contrast, each producing the next view): that mapping is mmrl's."""

    name = "factorized"
    summary = "vision rewards on the vision segments (tool calls) only, text rewards on the text only"
    paper = ("Efficient Reinforcement for Visual-Textual Thinking with Discrete Diffusion Model, Kim et al. 2026, "
             "arXiv 2606.14792 (factorized reward assignment; the vision segments as image-tool calls are mmrl's)")
    Options = FactorizedOptions

    def implied_scope(self, component: str) -> str | None:
        return "tool_calls" if component in self.options.vision else None

    def check(self, config) -> None:
        super().check(config)
        if not config.generation.tools:
            raise VariantError("variant 'factorized' credits the vision segments, the policy's tool calls: set "
                               "generation.tools (e.g. [crop])")
        unknown = sorted(set(self.options.vision) - set(config.rewards))
        if unknown:
            raise VariantError(f"variant 'factorized': vision rewards {unknown} are not among the configured rewards "
                               f"{sorted(config.rewards)}")
