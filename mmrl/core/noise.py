"""Timestep-specific SDE noise levels for flow policies, calibrated from rewards (pure tensor functions)."""

from __future__ import annotations

import torch


def adapt_noise_levels(levels: torch.Tensor, steps: torch.Tensor, gain_std: torch.Tensor, *, rate: float = 0.1,
                       base: torch.Tensor | None = None, bounds: tuple[float, float] = (0.25, 4.0),
                       max_level: float | None = None, eps: float = 1e-8) -> torch.Tensor:
    """Reward-aware, timestep-specific noise calibration (mmrl's rule after DenseGRPO's idea).

    DenseGRPO (Deng et al. 2025, arXiv 2601.20218) observes that one SDE noise level explores unevenly across
    timesteps and calibrates a per-timestep noise from reward feedback. mmrl's rule, applied once per update to
    the trained steps ``steps`` (indices into the ``[S]`` levels): with ``g_t`` the spread (std over the batch) of
    the step reward gains ``d_t = R_{t+1} - R_t`` and ``g`` their mean over the trained steps,
    ``level_t <- level_t * exp(clamp(rate * log(g / g_t), -rate, rate))``: a step whose gains spread less than
    average gets more noise, one that spreads more gets less, by at most a factor ``e^rate`` per update, so
    exploration evens out across the trajectory. Levels stay within ``bounds`` times ``base`` (the configured
    levels) and below ``max_level`` (CPS needs ``a <= 1``); steps with no measured gain (``g_t`` NaN) keep theirs.
    Returns new levels ``[S]``; the input is not modified.
    """
    levels = levels.clone().float()
    base = levels.clone() if base is None else base.float()
    gain_std = gain_std.float()
    valid = torch.isfinite(gain_std)
    if not bool(valid.any()):
        return levels
    target = gain_std[valid].mean()
    log_ratio = torch.log((target + eps) / (gain_std + eps))
    step = torch.where(valid, (rate * log_ratio).clamp(-rate, rate), torch.zeros_like(gain_std))
    updated = levels[steps] * torch.exp(step)
    low, high = bounds
    updated = torch.minimum(torch.maximum(updated, base[steps] * low), base[steps] * high)
    if max_level is not None:
        updated = updated.clamp(max=max_level)
    levels[steps] = updated
    return levels
