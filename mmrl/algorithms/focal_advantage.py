"""F-GRPO focal scaling: advantages down-weighted on prompts the policy already solves, by (1 - p_g)^gamma."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import TransformContext, Variant, option, register
from mmrl.core.advantages import _grouped_stats, group_index


def group_success_rate(scores: Tensor, group_ids, threshold: float) -> tuple[Tensor, Tensor]:
    """``(p [N], success [N])``: ``success_i = scores_i > threshold`` and ``p`` the success rate of sample ``i``'s
    group over its samples with a finite score (NaN: not judged, left out; a group without one gets ``p = NaN``).
    ``success`` is NaN where the score is."""
    if scores.dim() != 1:
        raise ValueError(f"the success component must be one value per sample, got shape {tuple(scores.shape)}")
    values = scores.float()
    valid = torch.isfinite(values)
    success = torch.where(valid, (values > threshold).float(), torch.full_like(values, float("nan")))
    index, num_groups = group_index(group_ids)
    mean, _, count = _grouped_stats(success.unsqueeze(1), valid.unsqueeze(1), index, num_groups, 0)
    p = torch.where(count > 0, mean, torch.full_like(mean, float("nan"))).squeeze(1)
    return p, success


@dataclass
class FocalAdvantageOptions:
    reward: str = option("", "The component (a key of `rewards`, e.g. accuracy) whose value > threshold counts as a "
                             "success; p_g is the group's success rate (F-GRPO, Plyusov et al. 2026, "
                             "arXiv 2602.06717).")
    threshold: float = option(0.5, "A sample succeeds when its `reward` component is > threshold.")
    gamma: float = option(1.0, "The focal exponent: advantages are scaled by (1 - p_g)^gamma (0 = no scaling; the "
                               "default 1 is mmrl's, the paper's value was not available).")

    def validate(self) -> None:
        if not self.reward:
            raise ValueError("reward: name the component that decides success (e.g. accuracy)")
        if self.gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma}")


@register
class FocalAdvantage(Variant):
    """Focal difficulty scaling of the advantages (the abstract's coefficient, in the form ``(1 - p)^gamma``)::

        p_g  = #{i in g : R_i > threshold} / #{i in g : R_i not NaN}     (R = the `reward` component)
        A'_i = (1 - p_g)^gamma * A_i

    so updates on high-success prompts shrink (``p_g = 1`` gives 0; such a group's GRPO advantages are 0 anyway) and
    rarely solved prompts keep theirs. Groups are the sampling groups (``group_ids``) of this process (a sampling
    group never spans processes). A group with no judged sample keeps weight 1; ``[N, T]`` advantages get their
    group's weight on every step.
    """

    name = "focal_advantage"
    summary = "advantages scaled by (1 - group success rate)^gamma, down-weighting prompts already solved"
    paper = ("F-GRPO: Don't Let Your Policy Learn the Obvious and Forget the Rare, Plyusov et al. 2026, "
             "arXiv 2602.06717 (focal coefficient (1 - p)^gamma; the default gamma is mmrl's)")
    Options = FocalAdvantageOptions

    def check(self, config) -> None:
        self.require_reward(config, "reward")

    def transform(self, ctx: TransformContext) -> Tensor:
        o = self.options
        p, _ = group_success_rate(ctx.scores[o.reward], ctx.rollout.group_ids, o.threshold)
        weight = torch.where(torch.isfinite(p), (1.0 - p).clamp(min=0.0) ** o.gamma, torch.ones_like(p))
        weight = weight.to(ctx.advantages.dtype)
        return ctx.advantages * (weight.unsqueeze(1) if ctx.advantages.dim() == 2 else weight)
