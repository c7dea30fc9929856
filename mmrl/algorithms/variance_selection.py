"""Variance-aware selection (Temporal-RLT): sample more groups than are trained, keep those whose rewards disagree."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import SelectContext, Variant, option, register
from mmrl.core.variants import select_top_variance_groups


@dataclass
class VarianceSelectionOptions:
    rounds: int = option(2, "Rollout rounds of data.prompts_per_step prompts drawn per update; the prompts_per_step "
                            "groups of largest reward variance among them are trained (1 = no selection).")

    def validate(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")


@register
class VarianceSelection(Variant):
    """:func:`mmrl.core.variants.select_top_variance_groups` over the pool of ``rounds`` sampling rounds: the
    ``prompts_per_step`` groups with the largest population variance of their advantage input (ties: first drawn).
    Each process selects its own ``prompts_per_step`` from its own pool (every process trains the same number of
    groups), so which prompts are trained depends on the process count."""

    name = "variance_selection"
    summary = "oversample prompts and train on the groups with the largest reward variance"
    paper = ("Reinforcement Learning Tuning for VideoLLMs: Reward Design and Data Efficiency (Temporal-RLT), Li et al. "
             "2025, arXiv 2506.01908 (variance-aware data selection; the top-k rule is mmrl's)")
    Options = VarianceSelectionOptions
    families = ("vlm",)  # pools of several rounds need the rollout's select / concat (VLM rollouts)

    def sampling_rounds(self) -> tuple[int, int]:
        return self.options.rounds, self.options.rounds

    def select(self, ctx: SelectContext) -> Tensor:
        keep = select_top_variance_groups(ctx.total, ctx.group_ids, ctx.need)
        return torch.where(keep, torch.zeros(len(keep)), torch.full((len(keep),), float("-inf")))
