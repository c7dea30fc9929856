"""RVCO: a fixed sequence utility routed over the tokens by their response to a controlled visual intervention."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import TransformContext, option, register
from mmrl.algorithms.visual import VisualDependence


@dataclass
class RVCOOptions:
    temperature: float = option(1.0, "Temperature of the entropic router over the robust evidence scores (-> 0: hard "
                                     "selection of the most image-dependent tokens).")
    residual: float = option(0.5, "Share of the credit spread uniformly (the residual support path): every valid token "
                                  "keeps at least residual / L of it.")
    eps: float = option(1e-6, "Added to the within-trajectory MAD before dividing.")

    def validate(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0 (it is added to a MAD), got {self.eps}")
        if not 0.0 <= self.residual <= 1.0:
            raise ValueError(f"residual must be in [0, 1], got {self.residual}")


@register
class RVCO(VisualDependence):
    """Per trajectory ``i`` with ``L`` valid tokens and evidence response ``e_t = VIG_t`` (:mod:`mmrl.algorithms.visual`):

        z_t = (e_t - median(e)) / (MAD(e) + eps)                    robust within-trajectory coordinates
        p_t = softmax(z / temperature)_t over the valid tokens         the entropic router
        w_t = L * (residual / L + (1 - residual) * p_t)                 residual support, sum_t w_t = L exactly
        A'[i, t] = A_i * w_t

    so the trajectory's credit mass ``sum_t A'_t = L A_i`` is what GRPO gives it, redistributed towards the tokens
    that depend on the image; every valid token keeps at least ``residual`` of its uniform share, ``z`` is invariant
    to shifting and scaling a response's scores, and ``temperature -> 0`` (with ``residual = 0``) selects the
    highest-evidence token. The paper states these parts (conserved routing, robust coordinates, budgeted entropic
    router, residual support, analytic mass correction); the exact formulas here are mmrl's."""

    name = "rvco"
    summary = "route each trajectory's fixed credit over its tokens by their visual evidence response"
    paper = ("Residual Visual Credit Optimization (RVCO) for multimodal RLVR (2026; arXiv id not found offline); the "
             "concrete median/MAD coordinates, softmax router and residual mix are mmrl's")
    Options = RVCOOptions

    def transform(self, ctx: TransformContext) -> Tensor:
        o = self.options
        gain = self.visual_gain(ctx)
        valid = ctx.rollout.mask > 0
        weights = torch.zeros(gain.shape)
        for i in range(gain.shape[0]):
            e = gain[i, valid[i]]
            if e.numel() == 0:
                continue
            median = e.median()
            mad = (e - median).abs().median()
            spread = mad + o.eps
            # no spread (eps 0 and at least half the values tied): every token at its median coordinate, 0
            z = (e - median) / spread if spread > 0 else torch.zeros_like(e)
            routed = torch.softmax(z / o.temperature, dim=0)
            length = e.numel()
            weights[i, valid[i]] = length * (o.residual / length + (1.0 - o.residual) * routed)
        adv = ctx.advantages if ctx.advantages.dim() == 2 else ctx.advantages.unsqueeze(1)
        return adv.float() * weights
