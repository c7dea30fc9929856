"""PAPO: an outcome advantage over all responses plus a process advantage normalised among the correct ones only."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import AdvantageContext, Variant, option, register
from mmrl.core.advantages import group_advantages


@dataclass
class PAPOOptions:
    outcome: str = option("", "The outcome (ORM) reward component, e.g. accuracy: A_out is its group advantage over "
                              "all responses (PAPO, Tan et al. 2026).")
    process: str = option("", "The process (rubric PRM) reward component: A_proc is its group advantage among the "
                              "correct responses only, 0 for the others (PAPO).")
    threshold: float = option(0.5, "A response is correct when its outcome reward is >= threshold (1.0 for a 0/1 "
                                   "accuracy needs the exact 1; 0.5 splits 0/1 rewards the same way).")
    process_weight: float = option(1.0, "A = A_out + process_weight * A_proc (the abstract composes the two; the "
                                        "relative weight is mmrl's option).")

    def validate(self) -> None:
        if not self.outcome or not self.process:
            raise ValueError("outcome and process: name the outcome (ORM) and process (PRM) reward components")
        if self.outcome == self.process:
            raise ValueError(f"outcome and process must be different components, both are {self.outcome!r}")
        if not self.process_weight >= 0:
            raise ValueError(f"process_weight must be >= 0, got {self.process_weight}")


@register
class PAPO(Variant):
    """Decoupled advantage normalisation, as the PAPO abstract states it:

    * ``correct_i = outcome_i >= threshold`` (a NaN outcome is not correct);
    * ``A_out = group_advantages(outcome)`` over every response of the group (``ctx.labels``);
    * ``A_proc = group_advantages(process restricted to correct responses)``: the process score's group mean and std
      are taken over the group's correct responses only (the others are left out as NaN, so they get ``A_proc = 0``);
      a group with fewer than two correct responses or no process spread among them gets ``A_proc = 0``;
    * ``A = A_out + process_weight * A_proc``, clamped to ``algorithm.advantage_clamp`` when set.

    Both normalisations use the run's ``algorithm.scale`` / ``eps`` / ``std_ddof``. The configured reward weights do
    not enter (each term is normalised on its own; ``process_weight`` is the mix). The rule is the abstract's; the
    ``process_weight`` mix and the threshold test are mmrl's spelling of it, not a claim of parity with the paper's
    code."""

    name = "papo"
    summary = "outcome advantage over all responses + process advantage normalised among correct responses only"
    paper = ("Stabilizing Rubric Integration Training via Decoupled Advantage Normalization (PAPO), Tan et al. 2026, "
             "arXiv 2603.26535")
    Options = PAPOOptions

    def check(self, config) -> None:
        for role in ("outcome", "process"):
            self.require_reward(config, role, weighted=True)

    def advantages(self, ctx: AdvantageContext) -> Tensor:
        a, o = ctx.algorithm, self.options
        outcome, process = _components(ctx, "papo", o.outcome, o.process)
        correct = torch.isfinite(outcome) & (outcome >= o.threshold)
        kwargs = {"scale": a.scale, "eps": a.eps, "std_ddof": a.std_ddof}
        a_out = group_advantages(outcome, ctx.labels, **kwargs)
        among_correct = torch.where(correct, process, torch.full_like(process, float("nan")))
        a_proc = group_advantages(among_correct, ctx.labels, **kwargs)
        adv = a_out + o.process_weight * a_proc
        if a.advantage_clamp is not None:
            adv = adv.clamp(-a.advantage_clamp, a.advantage_clamp)
        return adv


def _components(ctx: AdvantageContext, variant: str, *keys: str) -> list[Tensor]:
    """The named ``[N_all]`` components of ``ctx`` as float tensors, with an error naming what is there."""
    out = []
    for key in keys:
        if key not in ctx.components:
            raise ValueError(f"variant {variant!r}: component {key!r} does not enter the advantage (give it a weight); "
                             f"the advantage components are {sorted(ctx.components)}")
        value = ctx.components[key]
        if value.dim() != 1:
            raise ValueError(f"variant {variant!r}: component {key!r} must be one score per sample [N], got shape "
                             f"{tuple(value.shape)}")
        out.append(value.float())
    return out
