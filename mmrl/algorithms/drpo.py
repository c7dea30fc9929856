"""DRPO-style decoupled rewards: a preference (e.g. length) signal that only shares credit among correct rollouts."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import AdvantageContext, Variant, option, register
from mmrl.core.advantages import group_advantages, group_index


@dataclass
class DRPOOptions:
    outcome: str = option("", "The correctness reward component (e.g. accuracy); a rollout is correct when it is "
                              ">= threshold (DRPO, Li et al. 2025).")
    preference: str = option("", "The preference reward of correct rollouts, higher = preferred (e.g. a length "
                                 "reward that is larger for shorter answers); it never enters an incorrect "
                                 "rollout's advantage (DRPO).")
    threshold: float = option(0.5, "A rollout is correct when its outcome reward is >= threshold.")
    temperature: float = option(1.0, "lambda of the KL-regularised positive distribution q_i ~ exp(r_i / lambda) "
                                     "over a group's correct rollouts, in the preference reward's units (large: "
                                     "the preference barely matters; small: the most preferred takes all the credit).")

    def validate(self) -> None:
        if not self.outcome or not self.preference:
            raise ValueError("outcome and preference: name the correctness and the preference reward components")
        if self.outcome == self.preference:
            raise ValueError(f"outcome and preference must be different components, both are {self.outcome!r}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")


@register
class DRPO(Variant):
    """Correct rollouts' preference reward normalised within the correct subgroup only, never turning a correct
    rollout negative. Exact rule (mmrl's reading of the abstract), within each group of ``ctx.labels``:

    * ``c_i = 1[outcome_i >= threshold]`` (NaN outcome: NaN, advantage 0);
    * ``A_out = group_advantages(c)`` with the run's ``scale`` / ``eps`` / ``std_ddof``: ``> 0`` for every correct
      rollout of a group that also has incorrect ones, ``< 0`` for the incorrect ones, 0 in uniform groups;
    * over the group's correct rollouts with a finite preference ``r``: ``q_i = exp(r_i / lambda) / sum_j
      exp(r_j / lambda)`` -- the closed form of the KL-regularised preference maximiser, self-normalised over the
      on-policy correct samples -- and the factor ``f_i = n_valid q_i`` (mean 1 over those rollouts); other rows
      ``f_i = 1``;
    * ``A_i = A_out_i * f_i`` for correct rollouts, ``A_out_i`` for incorrect ones; then ``advantage_clamp``.

    So the preference only redistributes the positive credit among correct rollouts (its sum over them is unchanged
    and every share stays > 0), and incorrect rollouts are untouched by it. Differences from the paper: its full
    objective is DisCO's discriminative score difference with importance weights; here the weights reshape the loop's
    group advantage and the loop's surrogate is kept. Groups whose rollouts are all correct get 0, as in GRPO."""

    name = "drpo"
    summary = "preference reward normalised within the correct subgroup: correct rollouts share positive credit"
    paper = ("DRPO: Efficient Reasoning via Decoupled Reward Policy Optimization, Li et al. 2025, arXiv 2510.04474 "
             "(the per-group softmax reweighting of the outcome advantage is mmrl's reading of the abstract)")
    Options = DRPOOptions

    def check(self, config) -> None:
        for role in ("outcome", "preference"):
            self.require_reward(config, role, weighted=True)

    def advantages(self, ctx: AdvantageContext) -> Tensor:
        a, o = ctx.algorithm, self.options
        outcome, preference = (_component(ctx, key) for key in (o.outcome, o.preference))
        finite = torch.isfinite(outcome)
        correct = finite & (outcome >= o.threshold)
        indicator = torch.where(finite, correct.float(), torch.full_like(outcome, float("nan")))
        a_out = group_advantages(indicator, ctx.labels, scale=a.scale, eps=a.eps, std_ddof=a.std_ddof)

        index, num_groups = group_index(ctx.labels)
        valid = correct & torch.isfinite(preference)
        logits = torch.where(valid, preference.double() / o.temperature,
                             torch.full_like(preference, float("-inf"), dtype=torch.float64))
        peak = torch.full((num_groups,), float("-inf"), dtype=torch.float64).scatter_reduce(
            0, index, logits, reduce="amax")
        weights = torch.where(valid, torch.exp(logits - torch.where(valid, peak[index], torch.zeros_like(logits))),
                              torch.zeros_like(logits))
        mass = torch.zeros(num_groups, dtype=torch.float64).index_add(0, index, weights)
        count = torch.zeros(num_groups, dtype=torch.float64).index_add(0, index, valid.double())
        factor = torch.where(valid, count[index] * weights / mass[index].clamp(min=1e-300), torch.ones_like(weights))
        adv = torch.where(correct, a_out * factor.float(), a_out)
        if a.advantage_clamp is not None:
            adv = adv.clamp(-a.advantage_clamp, a.advantage_clamp)
        return adv


def _component(ctx: AdvantageContext, key: str) -> Tensor:
    if key not in ctx.components:
        raise ValueError(f"variant 'drpo': component {key!r} does not enter the advantage (give it a weight); the "
                         f"advantage components are {sorted(ctx.components)}")
    value = ctx.components[key]
    if value.dim() != 1:
        raise ValueError(f"variant 'drpo': component {key!r} must be one score per sample [N], got shape "
                         f"{tuple(value.shape)}")
    return value.float()
