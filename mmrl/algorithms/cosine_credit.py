"""Cosine-similarity credit (CoCA): the outcome spread over steps by how far each moves the image towards the final."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from mmrl.algorithms.base import Intermediate, RewardContext, VariantError, option, register
from mmrl.algorithms.dense import DenseCredit
from mmrl.core.credit import cosine_similarity_credit


@dataclass
class CosineCreditOptions:
    window: int = option(1, "Steps per window of the cosine gains (CoCA's window_size; its trainer: 5); the trained "
                            "steps must divide into windows.")
    reward_to_go: bool = option(False, "Credit step t with R x (alpha + (1 - alpha) x the sum of the weights from t "
                                       "to the end), as CoCA's trainer shapes its reward; false: R x w_t, summing to "
                                       "R over the trajectory (REFERENCE.md section 6).")
    alpha: float = option(0.0, "CoCA's temporal_alpha, the outcome's share in the reward-to-go (its trainer: 0); "
                               "needs reward_to_go.")
    clamp_negative: bool = option(False, "Clamp negative cosine gains (steps that move away from the final image) at "
                                         "0 before normalising (the anchor keeps them).")

    def validate(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not 0.0 <= self.alpha <= 1.0 or math.isnan(self.alpha):
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.alpha != 0.0 and not self.reward_to_go:
            raise ValueError("alpha mixes the outcome into CoCA's reward-to-go: set reward_to_go: true to use it")


@register
class CosineCredit(DenseCredit):
    """:func:`mmrl.core.credit.cosine_similarity_credit` on centred pixels of the intermediate images.

    The defaults are REFERENCE.md's rule (``r_t = R * w_t``, per-step gains); ``window: 5, reward_to_go: true`` is
    the weighting of CoCA's released trainer (``Lil-Shake/CoCA`` ``scripts/train_coca.py``). Where mmrl differs
    from that trainer whatever the options: the cosines are taken on the decoded intermediate images (centred
    pixels), not on its latent ``x0`` predictions, and the outcome reward is spread, with each step column then
    normalised in its group by the loop, where the trainer spreads the clipped per-prompt advantage."""

    name = "cosine"
    summary = "outcome reward weighted per step by the gain in cosine similarity to the final image"
    paper = ("Step-level Reward for Free in RL-based T2I Diffusion Model Fine-tuning (CoCA), Liao et al. 2025, "
             "arXiv 2505.19196 (pixel-space cosines and per-column normalisation: mmrl's)")
    Options = CosineCreditOptions

    def check(self, config) -> None:
        super().check(config)
        from mmrl.pipelines.flow.schedule import plan_steps

        s = config.sampling
        steps = len(plan_steps(s.train_steps, s.num_steps, timestep_fraction=s.timestep_fraction,
                               window_size=s.window_size, window_range=s.window_range).train)
        if steps % self.options.window:
            raise VariantError(f"variant 'cosine': window={self.options.window} must divide the {steps} trained "
                               f"steps (sampling.train_steps={s.train_steps})")

    def credit(self, intermediate: Intermediate, ctx: RewardContext) -> Tensor:
        images = intermediate.images
        n, k = images.shape[:2]
        # centred pixels ([-1, 1], minus each image's mean): raw [0, 1] images all have cosine ~1 to each other
        flat = images.reshape(n, k, -1) * 2 - 1
        flat = flat - flat.mean(dim=-1, keepdim=True)
        o = self.options
        return cosine_similarity_credit(flat, flat[:, -1], intermediate.step_rewards[:, -1], window=o.window,
                                        reward_to_go=o.reward_to_go, alpha=o.alpha, clamp_negative=o.clamp_negative)
