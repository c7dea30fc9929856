"""A-GRAE: positive advantages suppressed, and group weights that move from easy prompts to hard ones."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import TransformContext, Variant, global_mean, option, register
from mmrl.algorithms.focal_advantage import group_success_rate

PROGRESS = ("schedule", "accuracy")


@dataclass
class AGRAEOptions:
    reward: str = option("", "The component (a key of `rewards`, e.g. accuracy) whose value > threshold counts as a "
                             "correct trajectory; a group's difficulty is its failure rate (A-GRAE, Yu et al. 2026, "
                             "arXiv 2602.05548).")
    threshold: float = option(0.5, "A trajectory is correct when its `reward` component is > threshold.")
    positive_scale: float = option(0.5, "Asymmetric suppression: positive advantages are multiplied by this at the "
                                        "start of training, rising linearly with progress to 1 (mmrl's schedule).")
    curriculum: float = option(1.0, "Strength of the easy-to-hard group weights, in [0, 1] (0 = off): early, groups "
                                    "the policy mostly solves weigh more; late, groups it mostly fails weigh more.")
    progress: str = option("schedule", "Training progress t in [0, 1]: 'schedule' = update / (total updates - 1); "
                                       "'accuracy' = the success rate of the whole batch, every process's samples "
                                       "(the released A-GRAE code's proxy).")

    def validate(self) -> None:
        if not self.reward:
            raise ValueError("reward: name the component that decides correct trajectories (e.g. accuracy)")
        if not 0.0 <= self.positive_scale <= 1.0:
            raise ValueError(f"positive_scale must be in [0, 1] (it suppresses positive advantages), got "
                             f"{self.positive_scale}")
        if not 0.0 <= self.curriculum <= 1.0:
            raise ValueError(f"curriculum must be in [0, 1], got {self.curriculum}")
        if self.progress not in PROGRESS:
            raise ValueError(f"progress must be one of {PROGRESS}, got {self.progress!r}")


@register
class AGRAE(Variant):
    """Asymmetric, progress-dependent reweighting of the group-relative advantages (mmrl's rule after the abstract).

    The abstract's two findings: (i) asymmetrically suppressing the advantages of correct trajectories encourages
    exploration; (ii) learning is most efficient with a curriculum-like shift from simpler samples to harder ones;
    A-GRAE "dynamically modulates" both. Its exact formulas are not in the abstract, so mmrl implements::

        t    = update / max(1, total_updates - 1)    (progress='schedule'; 'accuracy': the batch's success rate)
        p_g  = the success rate of group g (`reward` component > threshold, NaN left out)
        w_g  = 1 - curriculum + curriculum * 2 * ((1 - t) * p_g + t * (1 - p_g))
        s    = positive_scale + (1 - positive_scale) * t
        A'_i = A_i * w_g * s     if A_i > 0
        A'_i = A_i * w_g         otherwise

    ``w_g`` is 1 for a half-solved group at every point of training; at the start it favours easy groups
    (``w = 2 p``), at the end hard ones (``w = 2 (1 - p)``), linearly in between. Positive advantages are scaled by
    ``s`` (suppressed most at the start, not at all at the end). A group without a judged sample gets ``w = 1``;
    ``[N, T]`` advantages get the same weights on every step. Groups are this process's sampling groups (whole on one
    process); the 'accuracy' progress is the success rate of the whole update's batch, every process's samples.
    No parity with the paper's numbers is claimed.
    """

    name = "a_grae"
    summary = "positive advantages suppressed and group weights shifting from easy to hard prompts over training"
    paper = ("Unveiling Implicit Advantage Symmetry: Why GRPO Struggles with Exploration and Difficulty Adaptation "
             "(A-GRAE), Yu et al. 2026, arXiv 2602.05548 (the suppression and curriculum formulas are mmrl's)")
    Options = AGRAEOptions

    def check(self, config) -> None:
        self.require_reward(config, "reward")

    def _progress(self, ctx: TransformContext, success: Tensor) -> float:
        if self.options.progress == "accuracy":
            return global_mean(success, ctx.accelerator)  # the judged samples of every process
        return min(1.0, max(0.0, ctx.update / max(1, ctx.total_updates - 1)))

    def transform(self, ctx: TransformContext) -> Tensor:
        o = self.options
        p, success = group_success_rate(ctx.scores[o.reward], ctx.rollout.group_ids, o.threshold)
        t = self._progress(ctx, success)
        focus = (1.0 - t) * p + t * (1.0 - p)
        w = torch.where(torch.isfinite(p), 1.0 - o.curriculum + o.curriculum * 2.0 * focus, torch.ones_like(p))
        s = o.positive_scale + (1.0 - o.positive_scale) * t
        adv = ctx.advantages
        w = (w.unsqueeze(1) if adv.dim() == 2 else w).to(adv.dtype)
        return torch.where(adv > 0, adv * w * s, adv * w)
