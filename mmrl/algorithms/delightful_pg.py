"""Delightful Policy Gradient (DG): each token's update gated by a sigmoid of delight = advantage x surprisal."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import TransformContext, Variant, option, register


def _token_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """``[N]`` or ``[N, T]`` advantages as ``[N, T]`` floats (an ``[N]`` advantage broadcast over the tokens)."""
    adv = advantages.double() if advantages.dtype == torch.float64 else advantages.float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(1).expand(-1, mask.shape[1])
    if adv.dim() != 2 or adv.shape != mask.shape:
        raise ValueError(f"advantages must be [N] or [N, T] matching mask {tuple(mask.shape)}, got "
                         f"{tuple(advantages.shape)}")
    return adv


def delight_gated_advantages(advantages: Tensor, old_logps: Tensor, mask: Tensor, *, temperature: float = 1.0
                             ) -> Tensor:
    """``A'_{i,t} = sigmoid(A_{i,t} * l_{i,t} / temperature) * A_{i,t}`` with ``l = -old_logps`` (``[N, T]``; 0 on
    padding and where the log-prob is not finite)."""
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if old_logps.shape != mask.shape:
        raise ValueError(f"old_logps {tuple(old_logps.shape)} and mask {tuple(mask.shape)} must both be [N, T]")
    adv = _token_advantages(advantages, mask)
    surprisal = -old_logps.to(adv.dtype)
    delight = adv * surprisal
    gated = torch.sigmoid(delight / temperature) * adv
    active = (mask > 0) & torch.isfinite(surprisal) & torch.isfinite(adv)
    return torch.where(active, gated, torch.zeros_like(gated))


@dataclass
class DelightfulPGOptions:
    temperature: float = option(1.0, "DG's eta: each term is gated by sigmoid(delight / eta), delight = advantage x "
                                     "surprisal (Osband 2026, arXiv 2603.14608 / 2603.20521: eta = 1).")

    def validate(self) -> None:
        if not self.temperature > 0 or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")


@register
class DelightfulPG(Variant):
    """Delightful Policy Gradient: every token's update is gated by the sigmoid of its *delight*.

    Exact rule (``transform`` stage, per active token ``t`` of completion ``i``)::

        l_{i,t}   = -old_logps[i, t]                 surprisal of the sampled token under the sampling policy
        chi_{i,t} = A_{i,t} * l_{i,t}                delight (an [N] advantage is broadcast over the tokens)
        A'_{i,t}  = sigmoid(chi_{i,t} / eta) * A_{i,t}     (0 on padding)

    A rare success (``A > 0``, high surprisal) keeps nearly all of its update (gate -> 1), a rare failure
    (``A < 0``, high surprisal) is suppressed (gate -> 0), and a confident token (surprisal ~ 0) gets half
    (gate = sigmoid(0) = 1/2), with no importance ratio. The gate is a constant factor of the advantage, so
    ``min(r w A, clip(r) w A) = w min(r A, clip(r) A)`` for the loop's clipped surrogate (``w > 0``).

    Paper vs mmrl: the gate ``sigmoid(advantage x surprisal / eta)`` multiplying each sampled term is the paper's
    (its abstract: "gating each update with delight, the product of advantage and surprisal"). The paper measures
    surprisal under the *learner's current* policy; a ``transform`` sees only ``old_logps``, the sampling policy's
    log-probs before the first update, which are the current policy's for the first inner epoch (on-policy) and
    frozen for later ones (``train.inner_epochs > 1``): that, and applying the gate to the PPO-clipped surrogate
    rather than to a plain policy gradient, are mmrl's, not claimed parity.

    VLM only: a flow policy's ``old_logps`` are Gaussian log-densities of continuous denoising steps (averaged over
    latent dimensions), not log-probabilities; their negative is no surprisal (it is negative for small noise and
    its level is set by the noise schedule, not by how rare the step was), so the gate would follow the sampler's
    noise level instead of the action's rarity.
    """

    name = "delightful_pg"
    summary = "each token's advantage gated by sigmoid(advantage x surprisal / eta): rare failures suppressed"
    paper = ("Delightful Distributed Policy Gradient, Osband 2026, arXiv 2603.20521 (the DG gate of Delightful "
             "Policy Gradient, Osband 2026, arXiv 2603.14608)")
    Options = DelightfulPGOptions
    needs = ("old_logps",)
    families = ("vlm",)

    def transform(self, ctx: TransformContext) -> Tensor:
        r = ctx.rollout
        return delight_gated_advantages(ctx.advantages, r.old_logps, r.mask, temperature=self.options.temperature)
