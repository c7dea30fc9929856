"""STARE: token advantages reweighted by the advantage-sign x surprisal quadrant, behind a target-entropy gate."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmrl.algorithms.base import TransformContext, Variant, global_mean, global_pool, option, register
from mmrl.algorithms.delightful_pg import _token_advantages

MODES = ("O1", "C2")


def top_surprisal(candidates: Tensor, surprisal: Tensor, ratio: float, accelerator: Any = None) -> Tensor:
    """The ``ceil(ratio * n)`` highest-surprisal entries among the ``n`` ``candidates`` (bool ``[N, T]``) of every
    process's batch (``accelerator``; this process's alone when ``None``); ties go to the earlier entry in row-major
    order, processes in order. Returns this process's selection; ``ratio = 0`` or no candidate selects nothing."""
    selected = torch.zeros_like(candidates)
    flat = candidates.reshape(-1).nonzero(as_tuple=True)[0]
    pool, offset = global_pool(surprisal.reshape(-1)[flat], accelerator)
    count = pool.numel()
    if count == 0 or ratio <= 0.0:
        return selected
    k = min(count, max(1, math.ceil(count * ratio - 1e-9)))
    chosen = torch.sort(-pool, stable=True).indices[:k] - offset
    chosen = chosen[(chosen >= 0) & (chosen < flat.numel())]
    selected.view(-1)[flat[chosen]] = True
    return selected


@dataclass
class STAREOptions:
    mode: str = option("O1", "STARE's variant: O1 amplifies L+ only (the paper's default); C2 also attenuates L- "
                             "(Luo et al. 2026, arXiv 2606.19236).")
    top_ratio: float = option(0.1, "P%: the share of each advantage-sign set, by surprisal rank, that forms the "
                                   "entropy-critical set L+ / L- (paper: 10%).")
    reweight_w: float = option(1.1, "W >= 1: weight of L+ (positive advantage, high surprisal) (paper: 1.1).")
    reweight_m: float = option(0.9, "M <= 1: weight of L- (negative advantage, high surprisal; C2 only) (paper: 0.9).")
    target_entropy: float = option(0.3, "H_tgt: the closed-loop gate reweights only while the batch entropy is below "
                                         "it (paper: 0.3 nats); a large value keeps the reweighting always on.")
    adaptive: bool = option(False, "The paper's adaptive schedule: W += alpha sgn(H_tgt - H), M -= alpha sgn(H_tgt - H) "
                                   "each update, clipped to [1, w_max] and [m_min, 1] (paper default: off).")
    alpha: float = option(0.01, "Step size of the adaptive schedule (paper: 0.01).")
    w_max: float = option(1.5, "Upper bound of W under the adaptive schedule (paper: 1.5).")
    m_min: float = option(0.5, "Lower bound of M under the adaptive schedule (paper: 0.5).")

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not 0.0 <= self.top_ratio <= 1.0:
            raise ValueError(f"top_ratio must be in [0, 1], got {self.top_ratio}")
        if not 1.0 <= self.reweight_w <= self.w_max or not math.isfinite(self.w_max):
            raise ValueError(f"need 1 <= reweight_w <= w_max (finite), got reweight_w={self.reweight_w}, "
                             f"w_max={self.w_max}")
        if not 0.0 <= self.m_min <= self.reweight_m <= 1.0:
            raise ValueError(f"need 0 <= m_min <= reweight_m <= 1, got m_min={self.m_min}, "
                             f"reweight_m={self.reweight_m}")
        if not self.alpha >= 0 or not math.isfinite(self.alpha):
            raise ValueError(f"alpha must be a finite number >= 0, got {self.alpha}")
        if math.isnan(self.target_entropy):
            raise ValueError("target_entropy must be a number, got nan")


@register
class STARE(Variant):
    """STARE: surprisal-guided token advantage reweighting in the four advantage-sign x surprisal quadrants.

    Exact rule (``transform`` stage, once per update over the whole batch, every process's samples; ``s =
    -old_logps`` the surprisal of each sampled token, ``A`` the advantage broadcast over tokens, active tokens only):

    1. Gate: ``H = mean(s)`` over the active tokens; reweighting is on iff ``H < target_entropy``. With
       ``adaptive``: first ``W <- clip(W + alpha sgn(H_tgt - H), 1, w_max)``, ``M <- clip(M - alpha sgn(H_tgt - H),
       m_min, 1)`` (kept across updates and in checkpoints), then the gate.
    2. Quadrants: ``T+ = {A > 0}``, ``T- = {A < 0}``; ``L+`` = the ``ceil(top_ratio |T+|)`` tokens of ``T+`` with the
       highest surprisal (over the whole batch, not per sequence; ties to the earlier token, rows in process
       order), ``L-`` likewise in ``T-``. Low-surprisal tokens and ``A = 0`` keep weight 1.
    3. ``A'_{i,t} = w_{i,t} A_{i,t}`` with ``w = W`` on ``L+``, ``w = M`` on ``L-`` (mode ``C2`` only), 1 elsewhere
       and everywhere while the gate is off; 0 on padding. (High-surprisal positive tokens raise the entropy,
       high-surprisal negative ones lower it: O1 amplifies the first, C2 also damps the second.)

    Paper vs mmrl: the partition, the weights ``W``/``M``, the O1/C2 variants, the gate ``1[H < H_tgt]`` and the
    adaptive schedule are the released code's (``hp-luo/STARE``, ``compute_stare_token_weights`` and
    ``STAREController``; defaults ``P = 10%, W = 1.1, M = 0.9, H_tgt = 0.3``); it multiplies the per-token clipped
    surrogate by ``w``, which equals weighting the advantage for ``w > 0``. mmrl's differences, not claimed parity:
    the anchor ranks surprisal under the current policy within each loss micro-batch and gates on the batch's mean
    *full-distribution* token entropy; a ``transform`` sees the sampling policy's ``old_logps``, so ``H`` is the
    mean sampled-token surprisal (a Monte-Carlo estimate of the mean token entropy) and ``H`` and the ranks are
    taken over the whole update's batch (every process's tokens: the same weights, and the same adaptive ``W``/``M``
    on every process, for any process count), once per update.

    VLM only: STARE's analysis is over next-token distributions; a flow policy's ``old_logps`` are Gaussian
    log-densities of continuous steps, whose negative is no surprisal or entropy (it can be negative and is set by
    the noise level), so neither the quantiles nor the target entropy carry over.
    """

    name = "stare"
    summary = "token advantages reweighted by advantage sign x high/low surprisal (W on rare successes) below H_tgt"
    paper = ("STARE: Surprisal-Guided Token-Level Advantage Reweighting for Policy Entropy Stability, Luo et al. 2026, "
             "arXiv 2606.19236")
    Options = STAREOptions
    needs = ("old_logps",)
    families = ("vlm",)

    def __init__(self, options: Any = None):
        super().__init__(options)
        self.reweight_w = float(self.options.reweight_w)
        self.reweight_m = float(self.options.reweight_m)

    def weights(self, advantages: Tensor, old_logps: Tensor, mask: Tensor, accelerator: Any = None) -> Tensor:
        """The STARE weights ``[N, T]`` (0 on padding) of this process's samples, with ``H`` and the surprisal ranks
        taken over every process's batch (``accelerator``); updates the adaptive ``W``/``M`` first when enabled."""
        o = self.options
        adv = _token_advantages(advantages, mask)
        surprisal = -old_logps.to(adv.dtype)
        active = (mask > 0) & torch.isfinite(surprisal)
        weights = active.to(adv.dtype)
        entropy = global_mean(surprisal[active], accelerator, empty=math.nan)
        if math.isnan(entropy):  # no process has an active token
            return weights
        if o.adaptive and o.alpha > 0:
            sign = float(math.copysign(1.0, o.target_entropy - entropy)) if entropy != o.target_entropy else 0.0
            self.reweight_w = min(max(self.reweight_w + o.alpha * sign, 1.0), o.w_max)
            self.reweight_m = min(max(self.reweight_m - o.alpha * sign, o.m_min), 1.0)
        if not entropy < o.target_entropy:
            return weights
        plus = top_surprisal(active & (adv > 0), surprisal, o.top_ratio, accelerator)
        weights = torch.where(plus, torch.full_like(weights, self.reweight_w), weights)
        if o.mode == "C2":
            minus = top_surprisal(active & (adv < 0), surprisal, o.top_ratio, accelerator)
            weights = torch.where(minus, torch.full_like(weights, self.reweight_m), weights)
        return weights

    def transform(self, ctx: TransformContext) -> Tensor:
        r = ctx.rollout
        adv = _token_advantages(ctx.advantages, r.mask)
        w = self.weights(ctx.advantages, r.old_logps, r.mask, ctx.accelerator)
        return torch.where(w > 0, adv * w, torch.zeros_like(adv))

    def state_dict(self) -> dict[str, Any]:
        return {"reweight_w": self.reweight_w, "reweight_m": self.reweight_m} if self.options.adaptive else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reweight_w = float(state.get("reweight_w", self.reweight_w))
        self.reweight_m = float(state.get("reweight_m", self.reweight_m))
