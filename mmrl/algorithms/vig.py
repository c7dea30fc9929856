"""VIG-guided selective training: train on the samples and tokens that gain most from the image."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import TransformContext, global_pool, option, register
from mmrl.algorithms.visual import VisualDependence


@dataclass
class VIGOptions:
    token_threshold: float = option(0.0, "A token is trained when its VIG (nats) exceeds this; the others get "
                                         "advantage 0.")
    sample_fraction: float = option(1.0, "The fraction of the batch's samples, those of largest mean VIG, that are "
                                         "trained (1 = every sample); ranked over every process's samples.")

    def validate(self) -> None:
        if not 0.0 < self.sample_fraction <= 1.0:
            raise ValueError(f"sample_fraction must be in (0, 1], got {self.sample_fraction}")


@register
class VIG(VisualDependence):
    """``A'[i, t] = A_i * [VIG_{i,t} > token_threshold] * [i among the sample_fraction of largest mean VIG]``.

    The paper measures VIG as the perplexity reduction the image brings, at sample and token level, and trains only
    on high-VIG samples and tokens (for supervised tuning); mmrl applies the same selection to the RL advantages,
    with VIG from the sampling policy (:mod:`mmrl.algorithms.visual`). The thresholds are mmrl's options.
    ``sample_fraction < 1`` keeps the top fraction of the whole update's batch (every process's samples ranked
    together, ties to the earlier row), so the chosen samples do not depend on the process count."""

    name = "vig"
    summary = "train only on the tokens and samples whose likelihood the image raises (visual information gain)"
    paper = ("Selective Training for Large Vision Language Models via Visual Information Gain, Lee and Hwang 2026, "
             "arXiv 2602.17186 (applying the selection to RL advantages, and its thresholds, are mmrl's)")
    Options = VIGOptions

    def transform(self, ctx: TransformContext) -> Tensor:
        gain = self.visual_gain(ctx)
        mask = ctx.rollout.mask.float()
        tokens = (gain > self.options.token_threshold).float() * mask
        per_sample = gain.sum(-1) / mask.sum(-1).clamp(min=1.0)
        pool, offset = global_pool(per_sample, ctx.accelerator)  # every process's samples, ranked together
        keep = int(round(self.options.sample_fraction * len(pool)))
        ranked = torch.argsort(pool, descending=True, stable=True)[:max(1, keep)] - offset
        chosen = torch.zeros(len(per_sample))
        chosen[ranked[(ranked >= 0) & (ranked < len(per_sample))]] = 1.0
        adv = ctx.advantages if ctx.advantages.dim() == 2 else ctx.advantages.unsqueeze(1)
        ctx.stats["vig/token_share"] = float(tokens.sum() / mask.sum().clamp(min=1.0))
        return adv.float() * tokens * chosen.unsqueeze(1)
