"""NGRPO: a virtual maximum-reward sample in every group's statistics, and an asymmetric clip range."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import AdvantageContext, SurrogateContext, Variant, VariantError, option, register
from mmrl.core.advantages import _grouped_stats, group_index, scale_centred


@dataclass
class NGRPOOptions:
    max_reward: float = option(1.0, "Reward of the virtual sample added to each group's mean and std: the task's "
                                    "maximum weighted total reward (NGRPO, Nan et al. 2025, arXiv 2509.18851: 1.0).")
    virtual_samples: int = option(1, "How many virtual maximum-reward samples each group's statistics get (the "
                                      "released NGRPO script: 1).")
    positive_clip_scale: float = option(1.2, "Asymmetric clipping: the clip range above 1 (what bounds positive "
                                             "advantages) is algorithm.clip_high x this (>= 1 relaxes it; with the "
                                             "usual 0.2, 1.2 gives the released NGRPO script's 0.24).")
    negative_clip_scale: float = option(0.8, "Asymmetric clipping: the clip range below 1 (what bounds negative "
                                             "advantages) is algorithm.clip_low x this (<= 1 tightens it; with the "
                                             "usual 0.2, 0.8 gives the released NGRPO script's 0.16).")

    def validate(self) -> None:
        if self.virtual_samples < 1:
            raise ValueError(f"virtual_samples must be >= 1, got {self.virtual_samples}")
        if self.positive_clip_scale < 1.0:
            raise ValueError(f"positive_clip_scale must be >= 1 (NGRPO relaxes the positive side), got "
                             f"{self.positive_clip_scale}")
        if not 0.0 < self.negative_clip_scale <= 1.0:
            raise ValueError(f"negative_clip_scale must be in (0, 1] (NGRPO tightens the negative side), got "
                             f"{self.negative_clip_scale}")


def calibrated_advantages(total: Tensor, group_ids, *, max_reward: float = 1.0, virtual_samples: int = 1,
                          scale: str = "group", eps: float = 1e-4, std_ddof: int = 0,
                          clamp: float | None = None) -> Tensor:
    """``A_i = (R_i - mean(R_g + V)) / (std(R_g + V) + eps)`` with ``V`` the group's ``virtual_samples`` virtual rewards
    ``max_reward`` (they enter the statistics only; no advantage is returned for them). ``scale="batch"`` divides by
    the std of the real rewards of the whole batch, ``"none"`` not at all. A group whose augmented rewards do not
    vary (every real reward equal to ``max_reward``) gets 0; NaN rewards are left out and get 0."""
    values = total.unsqueeze(1) if total.dim() == 1 else total
    values = values.double() if values.dtype == torch.float64 else values.float()
    index, num_groups = group_index(group_ids)
    valid = torch.isfinite(values)
    n = values.shape[0]
    extra = num_groups * virtual_samples
    aug_values = torch.cat([values, torch.full((extra, values.shape[1]), float(max_reward), dtype=values.dtype)])
    aug_valid = torch.cat([valid, torch.ones(extra, values.shape[1], dtype=torch.bool)])
    aug_index = torch.cat([index, torch.arange(num_groups).repeat_interleave(virtual_samples)])
    mean, std, _ = _grouped_stats(aug_values, aug_valid, aug_index, num_groups, std_ddof)
    mean, std = mean[:n], std[:n]
    adv = scale_centred(values - mean, values, valid, std, scale=scale, eps=eps, std_ddof=std_ddof)
    if clamp is not None:
        adv = adv.clamp(-clamp, clamp)
    return adv.squeeze(1) if total.dim() == 1 else adv


@register
class NGRPO(Variant):
    """Advantage calibration and asymmetric clipping (two stages).

    ``advantages`` (the abstract's rule, with the released code's one virtual sample): each group's mean and std are
    computed over its rewards plus ``virtual_samples`` virtual rewards ``max_reward``::

        A_i = (R_i - mean(R_1..R_G, r_max)) / (std(R_1..R_G, r_max) + eps)     (R = sum_k w_k R_k)

    so an all-wrong group (every ``R_i < r_max``) gets negative advantages instead of 0, and an all-correct group
    (every ``R_i = r_max``) still gets 0. ``algorithm.std_ddof`` (the released code uses the unbiased std, 1),
    ``eps``, ``scale`` (``batch``: the real rewards' batch std) and ``advantage_clamp`` apply; groups are the loop's
    (``labels``: condition keys with ``algorithm.per_prompt_stat_tracking``, without its history).

    ``surrogate``: the clipped PPO surrogate ``-min(r A, clip(r, 1 - lo, 1 + hi) A)`` with
    ``lo = clip_low x negative_clip_scale`` and ``hi = clip_high x positive_clip_scale``. Since only the upper bound
    binds for ``A > 0`` and only the lower one for ``A < 0``, this relaxes positive updates and tightens negative
    ones, as the abstract says; with ``algorithm.clip_low = 0.2`` the defaults give the released script's
    ``[0.84, 1.24]``. The scales are mmrl's parametrisation (the paper's own symbols were not available); the
    loop's ``clip_ratio/*`` metrics still count against the configured, unscaled range.
    """

    name = "ngrpo"
    summary = "a virtual max-reward sample in each group's mean/std (all-wrong groups learn) and asymmetric clipping"
    paper = ("NGRPO: Negative-enhanced Group Relative Policy Optimization, Nan et al. 2025, arXiv 2509.18851 "
             "(advantage calibration as stated; the clip scales are mmrl's parametrisation of its asymmetric clip)")
    Options = NGRPOOptions

    def check(self, config) -> None:
        if config.algorithm.reward_combination != "sum_then_normalize":
            raise VariantError("variant 'ngrpo' adds a virtual maximum of the weighted total reward: it needs "
                               "algorithm.reward_combination=sum_then_normalize")

    def advantages(self, ctx: AdvantageContext) -> Tensor:
        a, o = ctx.algorithm, self.options
        total = sum(w * ctx.components[k].float() for k, w in ctx.weights.items())
        return calibrated_advantages(total, ctx.labels, max_reward=o.max_reward, virtual_samples=o.virtual_samples,
                                     scale=a.scale, eps=a.eps, std_ddof=a.std_ddof, clamp=a.advantage_clamp)

    def surrogate(self, ctx: SurrogateContext) -> Tensor:
        o = self.options
        low = ctx.clip_low * o.negative_clip_scale
        high = ctx.clip_high * o.positive_clip_scale
        clipped = torch.clamp(ctx.ratio, 1.0 - low, 1.0 + high)
        return -torch.min(ctx.ratio * ctx.advantages, clipped * ctx.advantages)
