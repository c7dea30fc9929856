"""DAPO dynamic sampling: groups whose rewards are all equal are replaced by freshly sampled ones."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import SelectContext, Variant, option, register
from mmrl.core.variants import select_informative_groups


@dataclass
class DynamicSamplingOptions:
    max_rounds: int = option(3, "Rollout rounds per update before training on what there is (the groups that vary "
                                "first, then the rest).")

    def validate(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {self.max_rounds}")


@register
class DynamicSampling(Variant):
    """Keeps the groups :func:`mmrl.core.variants.select_informative_groups` finds informative (their advantage
    input varies), drawing up to ``max_rounds`` rounds of ``data.prompts_per_step`` prompts until there are enough;
    the same number of rounds on every process. Each process fills its own ``prompts_per_step`` from its own pool,
    so which groups are trained (not the rule) depends on the process count."""

    name = "dynamic_sampling"
    summary = "drop zero-variance groups and sample replacements (text policies)"
    paper = "DAPO: An Open-Source LLM Reinforcement Learning System at Scale, Yu et al. 2025, arXiv 2503.14476"
    Options = DynamicSamplingOptions
    families = ("vlm",)

    def sampling_rounds(self) -> tuple[int, int]:
        return 1, self.options.max_rounds

    def select(self, ctx: SelectContext) -> Tensor:
        keep = select_informative_groups(ctx.total, ctx.group_ids)
        return torch.where(keep, torch.zeros(len(keep)), torch.full((len(keep),), float("-inf")))
