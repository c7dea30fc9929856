"""The clipped group-relative policy loss on ``[N, T]`` actions, with TRL's aggregations.

One function serves both policy families: for a flow generator an action is a denoising step
(its Gaussian log-probability), for a VLM a generated token. Definitions follow TRL's
``GRPOTrainer`` (REFERENCE.md section 5):

* ratio ``r = exp(logp - old)`` per action, or per sample with ``ratio_level="sequence"``
  (GSPO, Zheng et al. 2025, arXiv 2507.18071: ``r = exp(sum M (logp - old) / sum M)``), in its GSPO-token
  form ``sg(r) * exp(logp - sg(logp))`` on every action: the value is ``r``, the gradient TRL's ``exp(mean)``
  one when the advantage and the action weights are constant over the sample, and per action otherwise;
* per action ``l = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`` (PPO, Schulman et al. 2017;
  the asymmetric "clip-higher" of DAPO, Yu et al. 2025, arXiv 2503.14476);
* with a KL penalty ``+ beta * kl``: TRL's k3 estimator ``exp(ref - logp) - (ref - logp) - 1``
  from ``ref_logps``, or a per-action KL given directly (Flow-GRPO's KL between step means); with
  ``kl_ratio_weight`` the KL is multiplied by the (differentiable) ratio, TRL 1.16's
  ``use_bias_correction_kl`` (the unbiased reverse-KL gradient of DeepSeek-V3.2, arXiv 2512.02556);
* aggregations ``grpo | bnpo | dr_grpo | dapo`` exactly as the table in REFERENCE.md section 5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

AGGREGATIONS = ("grpo", "bnpo", "dr_grpo", "dapo")
RATIO_LEVELS = ("token", "sequence")


@dataclass
class PolicyLossOutput:
    """``loss`` is the scalar to backpropagate; ``metrics`` are detached 0-dim tensors."""

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per action: ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1.0


#: per-action KL estimators (``algorithm.kl_estimator``)
KL_ESTIMATORS = ("k3", "low_var_kl", "k1", "k2", "abs")


def kl_estimate(logps: Tensor, ref_logps: Tensor, estimator: str = "k3") -> Tensor:
    """Per-action estimate of KL(pi || ref) from the policy's and the reference's log-probs of the sampled actions
    (Schulman, "Approximating KL divergence", 2020), as ``algorithm.kl_estimator`` names it:

    * ``k3``: :func:`k3_kl`, unclamped (TRL's ``per_token_kl``);
    * ``low_var_kl``: k3 with ``ref - logp`` clamped to [-20, 20] and the estimate to [-10, 10], so past the clamps
      it has no gradient (verl's ``kl_penalty`` ``low_var_kl`` / ``k3``, EasyR1's ``compute_kl`` ``low_var_kl``);
    * ``k1``: ``logp - ref`` (verl / EasyR1 ``kl``); ``k2``: ``(logp - ref)^2 / 2`` (``mse``); ``abs``:
      ``|logp - ref|``.
    """
    if estimator == "k3":
        return k3_kl(logps, ref_logps)
    if estimator == "low_var_kl":
        delta = (ref_logps - logps).clamp(-20.0, 20.0)
        return (torch.exp(delta) - delta - 1.0).clamp(-10.0, 10.0)
    if estimator == "k1":
        return logps - ref_logps
    if estimator == "k2":
        return 0.5 * (logps - ref_logps).square()
    if estimator == "abs":
        return (logps - ref_logps).abs()
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


#: how the rollout engine's log-probs correct the loss (TRL's ``vllm_importance_sampling_mode``)
SAMPLER_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def sampler_importance_weights(old_logps: Tensor, sampler_logps: Tensor, mask: Tensor, *, mode: str,
                               clip_min: float | None = None, clip_max: float | None = 3.0) -> Tensor:
    """``[N, T]`` importance weights of each action for the gap between the rollout engine that sampled it (vLLM:
    ``sampler_logps``) and the trained model's own log-probs of the same tokens (``old_logps``), TRL 1.16's
    ``vllm_importance_sampling_correction``: ``r = exp(old - sampler)`` on the masked actions (a NaN sampler
    log-prob counts as no gap), per token (``token_*``) or once per sample from the sum over its actions
    (``sequence_*``); ``*_truncate`` clamps ``r`` to ``[clip_min, clip_max]``, ``*_mask`` sets it to 0 outside
    (a bound of ``None`` does not apply). The policy term of each action is multiplied by it (the KL term is not)."""
    if mode not in SAMPLER_CORRECTIONS or mode == "none":
        raise ValueError(f"unknown sampler correction {mode!r}; expected one of {SAMPLER_CORRECTIONS[1:]}")
    diff = torch.nan_to_num((old_logps.detach() - sampler_logps.detach()) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    return ratio.expand_as(old_logps)


def high_entropy_mask(entropies: Tensor, mask: Tensor, top_quantile: float,
                      pool: Tensor | None = None) -> tuple[Tensor, float]:
    """The tokens a policy gradient keeps under "Beyond the 80/20 Rule" (Wang et al. 2025, arXiv 2506.01939; TRL's
    ``top_entropy_quantile``): those whose entropy is at least the ``1 - top_quantile`` quantile (``torch.quantile``,
    linear interpolation, as TRL) of the entropies of every real action (``mask > 0``) in ``entropies``.
    ``top_quantile`` 1 keeps every real action, 0 only the highest-entropy one(s), 0.2 is the paper's choice.
    ``pool``: the 1-D entropies the quantile is taken over instead (every process's real actions, for a threshold
    shared by all of them). Returns the ``[N, T]`` 0/1 mask (padding always 0) and the threshold (NaN when there is
    no real action)."""
    if not 0.0 <= top_quantile <= 1.0:
        raise ValueError(f"top_quantile must be in [0, 1], got {top_quantile}")
    real = mask > 0
    values = entropies[real].float() if pool is None else pool.float()
    if not values.numel():
        return torch.zeros_like(mask, dtype=torch.float32), float("nan")
    threshold = torch.quantile(values, 1.0 - top_quantile)
    return ((entropies.float() >= threshold) & real).float(), float(threshold)


def policy_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    aggregation: str = "grpo",
    max_length: int | None = None,
    ref_logps: Tensor | None = None,
    kl: Tensor | None = None,
    beta: float = 0.0,
    ratio_level: str = "token",
    gradient_accumulation_steps: int = 1,
    num_items_in_batch: float | Tensor | None = None,
    num_processes: int = 1,
    sample_action_counts: Tensor | None = None,
    batch_action_count: float | Tensor | None = None,
    sequence_log_ratio: Tensor | None = None,
    surrogate=None,
    kl_ratio_weight: bool = False,
    delta: float | None = None,
    action_weight: Tensor | None = None,
) -> PolicyLossOutput:
    """Clipped surrogate loss over ``[N, T]`` actions.

    Args:
        logps: ``[N, T]`` log-probs under the current parameters (with grad).
        old_logps: ``[N, T]`` log-probs of the sampling policy (no grad).
        advantages: ``[N]`` (broadcast over steps) or ``[N, T]``.
        mask: ``[N, T]`` 1 for trained actions, 0 for padding / untrained steps (default all ones).
        clip_low, clip_high: the clip range ``[1 - clip_low, 1 + clip_high]`` (``clip_high`` defaults to
            ``clip_low``). Flow anchors use 1e-4 (Flow-GRPO, DanceGRPO) to 1e-5 (Flow-GRPO-Fast, TP-GRPO).
        aggregation: ``grpo`` (per-sample mean, then mean), ``bnpo`` (mean over the local batch's actions),
            ``dr_grpo`` (sum / (N * max_length)), ``dapo`` (sum / (num_items_in_batch / num_processes)).
        max_length: the ``L`` of ``dr_grpo`` (default ``T``).
        ref_logps: ``[N, T]`` reference log-probs for TRL's k3 KL; or pass ``kl`` ``[N, T]`` directly.
        beta: KL coefficient (0 disables the penalty; KL is still reported when available).
        ratio_level: ``token`` or ``sequence`` (GSPO; GSPO-token's ``sg(s) * pi_t / sg(pi_t)`` per action, so
            per-action advantages (dense credit) and action weights (the entropy mask, a token-level sampler
            correction) reach only their own action's gradient, as in verl; TRL's ``exp(mean)`` spreads each
            action's term over the whole sample, which equals this only when both are constant over it).
        gradient_accumulation_steps: divides ``grpo``, ``bnpo`` and ``dr_grpo`` (TRL's GA scaling).
        num_items_in_batch: for ``dapo``, the active actions of the batch one optimizer step covers, summed over
            all processes (TRL's ``num_items_in_batch``: the generation batch's count per optimizer step); defaults
            to this batch's ``mask.sum()``. The normaliser is ``max(num_items_in_batch, 1) / num_processes``.
        num_processes: for ``dapo``, the number of data-parallel processes.
        sample_action_counts: ``[N]`` trained actions of each sample over its WHOLE trajectory (default
            ``mask.sum(-1)``). When a forward sees only a chunk of each trajectory's steps
            (``train.timestep_chunk``), passing the full counts makes the chunk losses add up to exactly the
            unchunked loss: ``grpo`` divides each sample's sum by it, and the sequence ratio averages over it.
        batch_action_count: for ``bnpo``, the active actions of the batch the mean is over (default
            ``mask.sum()``); the trainer passes those of the whole local batch of one optimizer step, so
            neither chunking nor the accumulation split changes the mean.
        sequence_log_ratio: ``[N]`` with ``ratio_level="sequence"`` when the forward sees a chunk only: the
            detached sequence log-ratio ``sum M (logp - old) / sum M`` of the whole trajectory. The ratio's value
            is then the whole trajectory's, and each action's gradient its own (GSPO-token), so the chunk
            gradients add up to the unchunked gradient exactly.
        surrogate: optional ``fn(logps, old_logps, log_ratio, ratio, advantages, mask, clip_low, clip_high)``
            returning the per-action loss ``[N, T]`` in place of the clipped surrogate
            ``-min(ratio A, clip(ratio) A)`` (an algorithm variant's ``surrogate`` stage, :mod:`mmrl.algorithms`);
            the KL term and the aggregation below apply to it unchanged; the clip metrics (``clip_ratio/*``,
            ``clipfrac``, which describe the configured clip) are then not reported.
        delta: two-sided clipping (INTELLECT-2, arXiv 2505.07291; TRL's ``delta``): the unclipped term uses
            ``min(ratio, delta)``, so ``l = -min(min(r, delta) A, clip(r) A)``: with a negative advantage a ratio
            above ``delta`` no longer grows the loss (nor has a gradient). ``None``: off. Not with ``surrogate``.
        action_weight: ``[N, T]`` (or ``[N, 1]``) weights of each action's policy term, no gradient: the rollout
            engine's importance correction (:func:`sampler_importance_weights`) times the high-entropy token mask
            (:func:`high_entropy_mask`); the KL term is not weighted and the aggregation's action counts are
            unchanged, as in TRL.
        kl_ratio_weight: multiply the KL term by the importance ratio, gradient kept (TRL 1.16's
            ``use_bias_correction_kl``, its default; earlier TRL, EasyR1 / verl and Flow-GRPO add the plain KL).
            With ``ratio_level="sequence"`` the sample's ratio weights each of its actions' KL, as TRL broadcasts it;
            not with ``sequence_log_ratio`` (a chunked sequence ratio), whose chunks would not add up.

    Layout invariance: with ``sample_action_counts``, ``batch_action_count``, ``max_length`` and
    ``sequence_log_ratio`` describing the whole trajectories, the sum of the losses (and gradients) of the
    chunks of a batch equals the loss (and gradient) of the batch in one piece.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {aggregation!r}; expected one of {AGGREGATIONS}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; expected one of {RATIO_LEVELS}")
    if logps.dim() != 2 or logps.shape != old_logps.shape:
        raise ValueError(
            f"logps and old_logps must both be [N, T]; got {tuple(logps.shape)} and {tuple(old_logps.shape)}"
        )
    mask = torch.ones_like(logps) if mask is None else mask.to(logps.dtype)
    if mask.shape != logps.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match logps {tuple(logps.shape)}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(logps.dtype)
    clip_high = clip_low if clip_high is None else clip_high

    counts = mask.sum(-1) if sample_action_counts is None else sample_action_counts.to(logps)
    counts = counts.clamp(min=1.0)
    log_ratio = logps - old_logps.detach()
    sequence_ratio = None
    if ratio_level == "sequence":
        part = (log_ratio * mask).sum(-1) / counts  # this chunk's share of the trajectory's mean log-ratio
        if sequence_log_ratio is not None:  # the value of the whole trajectory, the gradient of this chunk
            part = sequence_log_ratio.detach().to(part) + part - part.detach()
        sequence_ratio = torch.exp(part).unsqueeze(-1)  # TRL's exp(mean): weights the KL term (kl_ratio_weight)
        # GSPO-token (Zheng et al. 2025, arXiv 2507.18071; verl's compute_policy_loss_gspo):
        # s_t = sg(s) * pi(y_t) / sg(pi(y_t)). The value is the sequence ratio s on every action; each action's
        # gradient is s times its own log-prob's, so per-action advantages and weights keep their credit. With
        # an advantage constant over the sample it is GSPO's gradient (TRL's exp(mean) form) exactly.
        log_ratio = part.detach().unsqueeze(-1) + log_ratio - log_ratio.detach()
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    if surrogate is not None and delta is not None:
        raise ValueError("delta (two-sided clipping) caps the clipped surrogate's ratio; a variant's own surrogate "
                         "replaces that surrogate")
    if surrogate is None:
        unclipped = ratio if delta is None else torch.clamp(ratio, max=float(delta))
        per_action = -torch.min(unclipped * advantages, clipped * advantages)
    else:
        per_action = surrogate(logps, old_logps.detach(), log_ratio, ratio, advantages, mask, clip_low, clip_high)
        if per_action.shape != logps.shape and per_action.shape != (n_rows := logps.shape[0], 1):
            raise ValueError(f"the surrogate returned shape {tuple(per_action.shape)}; expected {tuple(logps.shape)} "
                             f"or ({n_rows}, 1)")
    surrogate_value = per_action.detach()

    if action_weight is not None:
        per_action = per_action * action_weight.detach().to(per_action)
    if kl is None and ref_logps is not None:
        kl = k3_kl(logps, ref_logps.detach())
    if kl is not None and kl_ratio_weight:
        if sequence_log_ratio is not None:
            raise ValueError("kl_ratio_weight with a chunked sequence ratio (sequence_log_ratio) is not supported: "
                             "the chunks' KL terms would not add up to the whole trajectory's")
        kl = kl * (ratio if sequence_ratio is None else sequence_ratio)
    if kl is not None and beta != 0.0:
        per_action = per_action + beta * kl

    n, t = logps.shape
    if aggregation == "grpo":
        loss = ((per_action * mask).sum(-1) / counts).mean() / gradient_accumulation_steps
    elif aggregation == "bnpo":
        total = mask.sum() if batch_action_count is None else torch.as_tensor(batch_action_count).to(logps)
        loss = (per_action * mask).sum() / total.clamp(min=1.0) / gradient_accumulation_steps
    elif aggregation == "dr_grpo":
        loss = (per_action * mask).sum() / (n * (max_length or t)) / gradient_accumulation_steps
    else:
        total = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch).to(logps)
        loss = (per_action * mask).sum() / (total.clamp(min=1.0) / num_processes)  # TRL's order

    with torch.no_grad():
        full_ratio = ratio.expand_as(logps)
        low = ((full_ratio < 1.0 - clip_low) & (advantages < 0)).to(logps.dtype)
        high = ((full_ratio > 1.0 + clip_high) & (advantages > 0)).to(logps.dtype)
        masked_ratio = full_ratio[mask > 0]
        metrics = {
            "clip_ratio/low": _masked_mean(low, mask),
            "clip_ratio/high": _masked_mean(high, mask),
            "clip_ratio/region": _masked_mean(torch.maximum(low, high), mask),  # TRL's region: gradient clipped
            # Flow-GRPO's clipfrac: the ratio outside the clip range, whatever the advantage's sign
            "clipfrac": _masked_mean(((full_ratio < 1.0 - clip_low) | (full_ratio > 1.0 + clip_high)).to(logps.dtype),
                                     mask),
            "ratio/mean": _masked_mean(full_ratio, mask),
            "ratio/min": masked_ratio.min() if masked_ratio.numel() else torch.tensor(1.0),
            "ratio/max": masked_ratio.max() if masked_ratio.numel() else torch.tensor(1.0),
            "approx_kl": _masked_mean(0.5 * (logps - old_logps).square(), mask),
            "policy_loss": _masked_mean(surrogate_value.expand_as(logps), mask),
        }
        if kl is not None:
            metrics["kl"] = _masked_mean(kl, mask)
        if surrogate is not None:  # the configured clip range is not what a replaced surrogate applies
            for key in ("clip_ratio/low", "clip_ratio/high", "clip_ratio/region", "clipfrac"):
                metrics.pop(key)
    return PolicyLossOutput(loss=loss, metrics={k: v.detach() for k, v in metrics.items()})
