"""CSPO: each component-specific reward backpropagates only through the tokens of its component."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.algorithms.base import option, register
from mmrl.algorithms.span_scoped import SpanScoped, SpanScopedOptions


@dataclass
class CSPOOptions(SpanScopedOptions):
    default_scope: str = option("reward", "Scope of the components not listed in scopes: 'reward', the tokens their "
                                          "reward reports (CSPO: each component's own tokens).")


@register
class CSPO(SpanScoped):
    """:class:`~mmrl.algorithms.span_scoped.SpanScoped` whose components default to the spans their rewards report
    (a structure reward on the table's structure tokens, a content reward on its cell contents, ...); a component
    reporting no spans for a sample applies to the whole response (``fallback``)."""

    name = "cspo"
    summary = "component-specific rewards, each backpropagated only through its component's tokens"
    paper = ("CSPO: Alleviating Reward Ambiguity for Structured Table-to-LaTeX Generation, Yang et al. 2026, "
             "arXiv 2604.10918 (each component's tokens come from the spans its reward reports: mmrl's interface)")
    Options = CSPOOptions
