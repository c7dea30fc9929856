"""Span-scoped advantages: each reward component's advantage applies only on the tokens it is about.

The shared mechanism of Blockwise advantages, CSPO and RS-GRPO (one file each registers its variant): every weighted
component ``k`` gets its own group-relative advantage ``A_k [N]`` (the loop's ``algorithm.scale`` / ``eps`` /
``std_ddof`` / ``advantage_clamp``, per component, as ``normalize_then_sum`` does), and the per-token advantage is

    A[i, t] = sum_k w_k * A_k[i] * M_k[i, t]

with ``M_k [N, T]`` the mask of component ``k``'s scope: the character spans its reward reported for the sample
(``reward``), a region of the ``<think>/<answer>`` response (``answer``, ``think``, ``outside_answer``) or ``all``,
mapped onto the sampled tokens with the tokenizer (:mod:`mmrl.pipelines.vlm.spans`); or, in a tool rollout
(``generation.tools``), the tokens of the policy's own tool calls, ``<tool>`` through ``</tool>`` (``tool_calls``), or
every sampled token outside them (``outside_tool_calls``; the tool responses are context, never trained). A component
whose ``reward`` scope has no spans for a sample falls back to ``fallback``. With every scope ``all`` this is exactly
the loop's ``normalize_then_sum`` advantage on every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmrl.algorithms.base import AdvantageContext, TransformContext, Variant, VariantError, lookup, option
from mmrl.algorithms.dense import spec_name
from mmrl.core.advantages import group_advantages

SCOPES = ("reward", "all", "answer", "think", "outside_answer", "tool_calls", "outside_tool_calls")


@dataclass
class SpanScopedOptions:
    scopes: dict = option({}, "Reward component -> its scope: 'reward' (the character spans its reward reports), "
                              "'answer' / 'think' (the contents of the response's <answer> / <think> blocks), "
                              "'outside_answer', 'tool_calls' (the policy's <tool>...</tool> calls), "
                              "'outside_tool_calls', or 'all' (every token).")
    default_scope: str = option("all", "Scope of the weighted components not listed in scopes.")
    fallback: str = option("all", "Where a 'reward'-scoped component applies for a sample its reward reported no spans "
                                  "for: 'all' tokens or 'none'.")

    def validate(self) -> None:
        for name, scope in {**self.scopes, "default_scope": self.default_scope}.items():
            if scope not in SCOPES:
                raise ValueError(f"scope of {name!r} must be one of {SCOPES}, got {scope!r}")
        if self.fallback not in ("all", "none"):
            raise ValueError(f"fallback must be 'all' or 'none', got {self.fallback!r}")


class SpanScoped(Variant):
    """Base of the span-scoped variants (module docstring). Subclasses may override :meth:`implied_scope`."""

    Options = SpanScopedOptions
    families = ("vlm",)

    def __init__(self, options: Any = None):
        super().__init__(options)
        self.component_advantages: dict[str, Tensor] = {}
        self.component_weights: dict[str, float] = {}

    def group_labels(self, component: str, ctx: AdvantageContext):
        """The groups ``component``'s advantage is normalised within (default: the loop's)."""
        return ctx.labels

    def scope_of(self, component: str) -> str:
        """``component``'s scope: set in ``scopes``, else the variant's own rule (:meth:`implied_scope`), else
        ``default_scope``."""
        if component in self.options.scopes:
            return self.options.scopes[component]
        return self.implied_scope(component) or self.options.default_scope

    def implied_scope(self, component: str) -> str | None:
        """The scope a subclass's own rule gives ``component`` when ``scopes`` does not set it (none here)."""
        return None

    def check(self, config) -> None:
        unknown = sorted(set(self.options.scopes) - set(config.rewards))
        if unknown:
            raise VariantError(f"variant {self.name!r}: scopes name {unknown}, not among the configured rewards "
                               f"{sorted(config.rewards)}")
        names = [spec_name(s) for s in config.algorithm.variants]
        mine = [i for i, n in enumerate(names) if lookup(n) is type(self)]
        before = [n for n in names[:mine[0] if mine else 0] if "transform" in lookup(n).stages()]
        if before:
            raise VariantError(f"variant {self.name!r} builds the per-token advantages from the per-component ones: "
                               f"list it before the transform variants {before}")

    def advantages(self, ctx: AdvantageContext) -> Tensor:
        a = ctx.algorithm
        self.component_weights = dict(ctx.weights)
        self.component_advantages = {}
        for key in ctx.weights:
            values = ctx.components[key].float()
            if values.dim() != 1:
                raise ValueError(f"variant {self.name!r}: component {key!r} is [N, T]; span scopes need one reward "
                                 f"per sample")
            self.component_advantages[key] = group_advantages(values, self.group_labels(key, ctx), scale=a.scale,
                                                              eps=a.eps, std_ddof=a.std_ddof, clamp=a.advantage_clamp)
        return sum(w * self.component_advantages[k] for k, w in ctx.weights.items())

    def scope_mask(self, ctx: TransformContext, component: str) -> Tensor:
        """``[N, T]`` token mask of ``component``'s scope for these samples."""
        from mmrl.pipelines.vlm.spans import region_spans

        r = ctx.rollout
        scope = self.scope_of(component)
        if scope == "all":
            return r.mask.float()
        if scope == "reward":
            reported = r.spans.get(component) or [None] * len(r)
            mask = ctx.policy.span_mask(r, [s or [] for s in reported])
            if self.options.fallback == "all":
                missing = torch.tensor([s is None for s in reported]).unsqueeze(1)
                mask = torch.where(missing, r.mask.float(), mask)
            return mask
        if scope in ("tool_calls", "outside_tool_calls"):
            calls = tool_call_mask(r)
            return calls if scope == "tool_calls" else r.mask.float() - calls
        return ctx.policy.span_mask(r, [region_spans(text, scope) for text in r.completions])

    def transform(self, ctx: TransformContext) -> Tensor:
        r = ctx.rollout
        out = torch.zeros(r.mask.shape)
        active = r.mask.sum().clamp(min=1.0)
        for key, weight in self.component_weights.items():
            mask = self.scope_mask(ctx, key)
            out = out + weight * self.component_advantages[key][ctx.rows].float().unsqueeze(1) * mask
            ctx.stats[f"{self.name}/{key}_token_share"] = float(mask.sum() / active)
        return out


def tool_call_mask(rollout) -> Tensor:
    """``[N, T]``: 1 on the sampled tokens of each tool call the policy wrote (``<tool>`` through ``</tool>``, the
    :class:`~mmrl.pipelines.vlm.tools.ToolCall` range ``[opened, end)``), 0 elsewhere (all 0 without tool calls)."""
    out = torch.zeros(rollout.mask.shape)
    for i, calls in enumerate(rollout.tool_calls or []):
        for call in calls:
            out[i, call.opened:call.end] = 1.0
    return out * rollout.mask.float()
