"""Shared base of the visual-dependence variants: per-token visual information gain from a grey-canvas forward.

``VIG_t = log p(y_t | image) - log p(y_t | grey canvas)`` for every sampled token (the sampling policy's log-probs,
``rollout.old_logps``, against the same completions' log-probs with every image / frame replaced by a uniform grey
canvas of the same size, ``rollout.masked_logps``; one extra no-gradient forward per update, through the cached-vision
path, its time in ``time/masked_forward``). Large where the token depends on what the image shows (colours, counts,
positions), about 0 where the language prior alone predicts it.
"""

from __future__ import annotations

from torch import Tensor

from mmrl.algorithms.base import TransformContext, Variant


class VisualDependence(Variant):
    """Base class: :meth:`visual_gain` gives ``VIG [N, T]`` (0 on padding) and logs its mean as ``<name>/vig``."""

    needs = ("old_logps", "masked_logps")
    families = ("vlm",)

    def visual_gain(self, ctx: TransformContext) -> Tensor:
        r = ctx.rollout
        mask = r.mask.float()
        gain = (r.old_logps.float() - r.masked_logps.float()) * mask
        ctx.stats[f"{self.name}/vig"] = float(gain.sum() / mask.sum().clamp(min=1.0))
        return gain
