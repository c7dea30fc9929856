"""Video-R1's length control: a bonus for correct answers of a moderate length, when a group has several."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.algorithms.base import RewardContext, Rewards, Variant, VariantError, option, register
from mmrl.core.variants import length_control_rewards


@dataclass
class LengthControlOptions:
    reward: str = option("", "The accuracy component (a key of `rewards`) that decides whether an answer is correct.")
    bonus: float = option(0.2, "The bonus a correct answer of a moderate length gets (Video-R1: 0.2).")
    min_tokens: int = option(320, "Shortest completion (tokens) that earns the bonus (Video-R1: 320).")
    max_tokens: int = option(512, "Longest completion (tokens) that earns the bonus (Video-R1: 512).")

    def validate(self) -> None:
        if not self.reward:
            raise ValueError("reward: name the accuracy component that judges answers (e.g. video_r1_accuracy)")
        if self.bonus < 0:
            raise ValueError("bonus must be >= 0")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("need 0 <= min_tokens <= max_tokens")


@register
class LengthControl(Variant):
    """Adds the component ``length_bonus`` (weight 1) from :func:`mmrl.core.variants.length_control_rewards`: in each
    group with more than one correct answer, the correct ones of ``min_tokens`` to ``max_tokens`` completion tokens
    get ``bonus``, summed with the other rewards before the group normalisation."""

    name = "length_control"
    summary = "bonus for correct answers of a moderate length when a group has several (Video-R1 --len_control)"
    paper = "Video-R1: Reinforcing Video Reasoning in MLLMs, Feng et al. 2025, arXiv 2503.21776 (len_control)"
    Options = LengthControlOptions
    families = ("vlm",)

    def check(self, config) -> None:
        self.require_reward(config, "reward")
        if config.algorithm.reward_combination == "normalize_then_sum":
            raise VariantError("variant 'length_control' adds its bonus to the summed reward before the one "
                               "normalisation, as Video-R1 does: use algorithm.reward_combination=sum_then_normalize "
                               "(or nansum_then_normalize)")

    def rewards(self, ctx: RewardContext) -> Rewards:
        rollout = ctx.rollout
        bonus = length_control_rewards(
            ctx.scores[self.options.reward], rollout.mask.sum(-1), rollout.group_ids, bonus=self.options.bonus,
            min_length=self.options.min_tokens, max_length=self.options.max_tokens)
        return Rewards({**ctx.scores, "length_bonus": bonus}, {**ctx.weights, "length_bonus": 1.0})
