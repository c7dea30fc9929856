"""T-GRPO (Video-R1): a bonus for correct answers when the group does better on ordered than on shuffled frames."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmrl.algorithms.base import RewardContext, Rewards, Variant, VariantError, option, register
from mmrl.core.variants import temporal_contrast_rewards


@dataclass
class TGRPOOptions:
    reward: str = option("", "The accuracy component (a key of `rewards`) that decides whether an answer is correct.")
    alpha: float = option(0.3, "The bonus a correct answer gets (Video-R1: 0.3).")
    mu: float = option(0.8, "The group's accuracy on ordered frames must reach mu x its accuracy on shuffled frames "
                            "(Video-R1: 0.8).")

    def validate(self) -> None:
        if not self.reward:
            raise ValueError("reward: name the accuracy component that judges answers (e.g. temporal_iou)")
        if self.alpha < 0 or self.mu < 0:
            raise ValueError("alpha and mu must be >= 0")


@register
class TGRPO(Variant):
    """Also samples ``group_size / 2`` answers per video on shuffled frames and adds the component
    ``temporal_bonus`` (weight 1) from :func:`mmrl.core.variants.temporal_contrast_rewards`; image samples get 0."""

    name = "t_grpo"
    summary = "temporal contrast bonus from extra rollouts on shuffled video frames"
    paper = "Video-R1: Reinforcing Video Reasoning in MLLMs, Feng et al. 2025, arXiv 2503.21776 (T-GRPO)"
    Options = TGRPOOptions
    families = ("vlm",)

    def check(self, config) -> None:
        self.require_reward(config, "reward")
        if config.algorithm.reward_combination == "normalize_then_sum":
            raise VariantError("variant 't_grpo' adds its bonus (alpha) to the summed reward before the one "
                               "normalisation, as Video-R1 does; under normalize_then_sum the bonus would be scaled to "
                               "unit spread on its own and lose alpha: use algorithm.reward_combination="
                               "sum_then_normalize (or nansum_then_normalize)")

    def rewards(self, ctx: RewardContext) -> Rewards:
        videos = [item for item in ctx.items if getattr(item, "video_path", None)]
        if videos:
            shuffled = ctx.sample(videos, max(1, ctx.config.data.group_size // 2), shuffle_frames=True)
            shuffled_scores = ctx.score(shuffled)

            def keys(r):
                return [f"{m.get('id')}|{p}" for m, p in zip(r.metadata, r.prompts)]

            key = self.options.reward
            # unjudged (NaN) accuracies are left out of p and p~ and get no bonus, not counted as wrong
            bonus = temporal_contrast_rewards(
                ctx.scores[key], shuffled_scores[key], keys(ctx.rollout),
                shuffled_group_ids=keys(shuffled), alpha=self.options.alpha, mu=self.options.mu)
        else:
            bonus = torch.zeros(len(ctx.rollout))
        return Rewards({**ctx.scores, "temporal_bonus": bonus}, {**ctx.weights, "temporal_bonus": 1.0})
