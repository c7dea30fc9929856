"""Reward-aware, timestep-specific SDE noise calibration (mmrl's rule after DenseGRPO's idea)."""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.algorithms.base import RewardContext, Rewards, Variant, VariantError, option, register
from mmrl.core.credit import step_gain_credit
from mmrl.core.noise import adapt_noise_levels


@dataclass
class AdaptiveNoiseOptions:
    rate: float = option(0.1, "Exponent of the per-update noise correction: a level moves by at most a factor e^rate "
                              "per update (0 = frozen).")

    def validate(self) -> None:
        if self.rate < 0:
            raise ValueError(f"rate must be >= 0, got {self.rate}")


@register
class AdaptiveNoise(Variant):
    """After each rollout, :func:`mmrl.core.noise.adapt_noise_levels` from the spread of the step gains
    ``R_{t+1} - R_t`` over the whole global batch (so every process computes, and rank 0 checkpoints, the same
    levels); the levels stay within 0.25-4x of the configured ones (and <= 1 for CPS). The levels are saved in every
    checkpoint with the policy. Needs the intermediate images (the same ones a dense-credit variant uses, computed
    once)."""

    name = "adaptive_noise"
    summary = "per-step SDE noise levels calibrated from the spread of the step reward gains"
    paper = ("DenseGRPO: From Sparse to Dense Reward for Flow Matching Model Alignment, Deng et al. 2026, "
             "arXiv 2601.20218 (its reward-aware noise calibration; the update rule is mmrl's)")
    Options = AdaptiveNoiseOptions
    needs = ("intermediate_images",)
    families = ("flow",)

    def setup(self, policy, config) -> None:
        self.base_levels = policy.step_noise_levels.clone()  # the configured levels, before any resume

    def check(self, config) -> None:
        if config.sampling.train_steps == "entropy_merge":
            raise VariantError("variant 'adaptive_noise' calibrates the full sigma grid's levels: it does not apply to "
                               "sampling.train_steps=entropy_merge")

    def rewards(self, ctx: RewardContext) -> Rewards:
        step_rewards = ctx.intermediate().step_rewards
        acc = ctx.accelerator
        everyone = acc.gather(step_rewards.to(acc.device)).cpu() if acc.num_processes > 1 else step_rewards
        gains = step_gain_credit(everyone)
        policy = ctx.policy
        policy.step_noise_levels = adapt_noise_levels(
            policy.step_noise_levels, ctx.rollout.plan.train, gains.std(dim=0), rate=self.options.rate,
            base=self.base_levels, max_level=1.0 if ctx.config.sampling.sde == "cps" else None)
        for s, level in zip(ctx.rollout.plan.train.tolist(), policy.step_noise_levels[ctx.rollout.plan.train].tolist()):
            ctx.stats[f"noise_level/step_{s}"] = level
        return Rewards(ctx.scores, ctx.weights)
