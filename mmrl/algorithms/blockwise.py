"""Blockwise Advantage Estimation: one advantage per objective, applied only to its block of tokens."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.algorithms.base import AdvantageContext, VariantError, option, register
from mmrl.algorithms.span_scoped import SpanScoped, SpanScopedOptions


@dataclass
class BlockwiseOptions(SpanScopedOptions):
    conditions: dict = option({}, "Outcome-Conditioned Baseline: objective -> the component whose outcome stratifies "
                                  "its group (e.g. {confidence: accuracy}): a later block's baseline is the mean over "
                                  "the group's samples with the same intermediate outcome.")
    threshold: float = option(0.5, "An outcome above this is one stratum, at or below it the other (NaN: its own).")


@register
class Blockwise(SpanScoped):
    """:class:`~mmrl.algorithms.span_scoped.SpanScoped` with an explicit block for every weighted objective:
    ``scopes`` must name each one (``reward``: the spans its reward reports; or a response region). Objective ``k``'s
    own group-relative advantage is the advantage of exactly the tokens of its block; tokens in several blocks get the
    weighted sum, tokens in none get 0. The Outcome-Conditioned Baseline (``conditions``) normalises a later block's
    reward within ``(group, outcome stratum)``, the within-group stratification the paper states; the binary strata
    (``threshold``) are mmrl's choice for a scalar outcome."""

    name = "blockwise"
    summary = "one group-relative advantage per objective on its own token block (outcome-conditioned baselines)"
    paper = ("Blockwise Advantage Estimation for Multi-Objective RL with Verifiable Rewards, Pavlenko et al. 2026, "
             "arXiv 2602.10231 (blocks from reward spans or <think>/<answer> regions: mmrl's interface)")
    Options = BlockwiseOptions

    def check(self, config) -> None:
        super().check(config)
        weighted = [k for k, spec in config.rewards.items()
                    if (spec.get("weight", 1.0) if isinstance(spec, dict) else spec) != 0]
        missing = [k for k in weighted if k not in self.options.scopes]
        if missing:
            raise VariantError(f"variant 'blockwise' needs a block for every weighted objective: add {missing} to "
                               f"scopes (e.g. {{{missing[0]}: answer}})")
        unknown = sorted((set(self.options.conditions) | set(self.options.conditions.values())) - set(weighted))
        if unknown:
            raise VariantError(f"variant 'blockwise': conditions name {unknown}, not among the weighted rewards "
                               f"{sorted(weighted)}")

    def group_labels(self, component: str, ctx: AdvantageContext):
        outcome_key = self.options.conditions.get(component)
        if outcome_key is None:
            return ctx.labels
        outcome = ctx.components[outcome_key]
        labels = ctx.labels.tolist() if hasattr(ctx.labels, "tolist") else list(ctx.labels)
        strata = ["nan" if v != v else int(v > self.options.threshold) for v in outcome.float().tolist()]
        return [f"{label}|{stratum}" for label, stratum in zip(labels, strata)]
