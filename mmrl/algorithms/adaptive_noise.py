"""Reward-aware, timestep-specific SDE noise calibration (mmrl's rule after DenseGRPO's idea)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    ``R_{t+1} - R_t`` over the whole global batch, per step of the sigma grid (each step's spread over the samples
    of the processes that trained it: with a random plan, ``sampling.train_steps`` ``random_window`` or
    ``random_fraction``, each process draws its own steps), so every process computes, and rank 0 checkpoints, the
    same levels; the levels stay within 0.25-4x of the configured ones (and <= 1 for CPS). The levels are saved in every
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
        plan, policy, acc = ctx.rollout.plan, ctx.policy, ctx.accelerator
        gains = step_gain_credit(ctx.intermediate().step_rewards)  # [n, trained steps], in plan.train's order
        # each process may train its own steps (sampling.train_steps random_window / random_fraction draw the plan
        # per process): the gains go into the columns of the full [n, S] grid, and every process's rows are gathered
        num_steps = policy.step_noise_levels.numel()
        grid = torch.zeros(gains.shape[0], num_steps, dtype=torch.float64)
        trained = torch.zeros(gains.shape[0], num_steps)
        grid[:, plan.train] = gains.double()
        trained[:, plan.train] = 1.0
        if acc.num_processes > 1:
            grid, trained = (acc.gather(x.to(acc.device)).cpu() for x in (grid, trained))
        steps = (trained.sum(0) > 0).nonzero(as_tuple=True)[0]  # every step some process trained
        spread = torch.stack([grid[trained[:, s] > 0, s].std() for s in steps.tolist()])
        policy.step_noise_levels = adapt_noise_levels(
            policy.step_noise_levels, steps, spread, rate=self.options.rate,
            base=self.base_levels, max_level=1.0 if ctx.config.sampling.sde == "cps" else None)
        for s, level in zip(steps.tolist(), policy.step_noise_levels[steps].tolist()):
            ctx.stats[f"noise_level/step_{s}"] = level
        return Rewards(ctx.scores, ctx.weights)
