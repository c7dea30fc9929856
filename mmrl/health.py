"""Run-health monitor: warns when updates stop carrying a training signal or the optimisation blows up.

:class:`RunHealth` reads each update's metrics (as the trainer logs them) and returns ``health/*`` metrics to log
alongside; it warns (``logging`` warning on ``mmrl.health``, printed on the main process) once per episode:

* ``health/no_signal_streak``: consecutive updates in which no sample carried signal (every advantage exactly
  0, ``samples/informative == 0``; ``samples/trained`` counts every sample the update trained on). Warned from
  :data:`STREAK` updates on, with the likely cause read from the same metrics: no parseable answer (``reward_info/<r>/num_unparseable`` covers every sample), every reward NaN, or
  rewards that do not vary within any group.
* ``health/nan_reward_streak``: consecutive updates in which more than half of the samples got a NaN reward.
* ``health/clipfrac_high``: 1 when more than :data:`CLIPFRAC_LIMIT` of the actions were clipped (the policy
  moves too far per update: lower ``optim.lr`` or widen ``algorithm.clip_low``).
* ``health/kl_spike`` and ``health/grad_norm_spike``: 1 when the KL or the gradient norm exceeds
  :data:`SPIKE_FACTOR` times the median of the previous :data:`HISTORY` updates (after :data:`MIN_HISTORY` of
  them; the KL also needs to exceed :data:`KL_FLOOR`).
* ``health/no_turning_point_streak`` (only in runs that log ``credit/turning_points``, the ``turning_point``
  variant): consecutive updates without a single turning point. Warned from :data:`TURNING_POINT_STREAK` updates
  on: the variant is then plain step-gain credit. Under TP-GRPO's consistency filter a reward that only takes the
  values 0 and 1 (a single-clause GenEval prompt) never has one, since ``sign(d_t) sign(R_n - R_{t+1}) > 0`` needs
  room above a gain and below a loss.
* ``health/warnings``: how many warnings this update raised.

The thresholds are mmrl's own rules of thumb, not an anchor's; they only warn, never change training.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque

logger = logging.getLogger(__name__)

STREAK = 3
CLIPFRAC_LIMIT = 0.5
SPIKE_FACTOR = 10.0
HISTORY = 10
MIN_HISTORY = 3
KL_FLOOR = 1e-3
TURNING_POINT_STREAK = 5


def _samples(metrics: dict[str, float]) -> float:
    return metrics.get("samples/trained", 0.0)


def no_signal_cause(metrics: dict[str, float]) -> str:
    """The likely reason an update had no trainable signal, from its own metrics."""
    n = _samples(metrics)
    unparseable = {k.split("/")[1]: v for k, v in metrics.items()
                   if k.startswith("reward_info/") and k.endswith("/num_unparseable")}
    full = [name for name, count in unparseable.items() if n and count >= n]
    if full and metrics.get("completions/clipped_ratio", 0.0) >= 1.0:  # perhaps cut off, not unable to answer
        return (f"no parseable answer: the policy writes nothing the rewards {full} can read "
                f"(reward_info/<reward>/num_unparseable = {int(n)} of {int(n)} samples), and every completion was "
                f"cut off by generation.max_new_tokens (completions/clipped_ratio 1, mean length "
                f"{metrics.get('completions/mean_length', float('nan')):.0f} tokens): a policy that answers in a "
                f"longer format (a model fine-tuned with mmrl sft: its mmrl_train.yaml's generation settings) needs "
                f"a larger budget; one that cannot answer yet needs SFT first")
    if full:
        return (f"no parseable answer: the policy writes nothing the rewards {full} can read "
                f"(reward_info/<reward>/num_unparseable = {int(n)} of {int(n)} samples), so every sample scores the "
                f"same; a policy that cannot answer yet needs SFT first (a random tiny model never answers)")
    if n and metrics.get("samples/nan_reward", 0.0) >= n:
        return "every reward is NaN (see the rewards' nan reasons in the log)"
    return ("the rewards do not vary within any group (a saturated or too coarse reward, or data.group_size too "
            "small); consider the dynamic_sampling variant (algorithm.variants: [dynamic_sampling])")


class RunHealth:
    """Keeps the streaks and histories across updates; :meth:`check` once per update."""

    def __init__(self, warn=None):
        self.warn = warn or logger.warning
        self.no_signal = 0
        self.nan_streak = 0
        self.no_turning_point = 0
        self.kl: deque[float] = deque(maxlen=HISTORY)
        self.grad_norm: deque[float] = deque(maxlen=HISTORY)

    def _spike(self, history: deque[float], value: float, floor: float = 0.0) -> bool:
        finite = [v for v in history if math.isfinite(v)]
        if len(finite) < MIN_HISTORY or not math.isfinite(value):
            return False
        return value > max(floor, SPIKE_FACTOR * statistics.median(finite))

    def check(self, metrics: dict[str, float]) -> dict[str, float]:
        step = int(metrics.get("step", 0))
        n = _samples(metrics)
        warnings = 0

        informative = metrics.get("samples/informative", n - metrics.get("samples/zero_advantage", 0.0))
        self.no_signal = self.no_signal + 1 if n and informative == 0 else 0
        if self.no_signal == STREAK:
            warnings += 1
            self.warn(f"update {step}: {STREAK} updates in a row with no trainable signal (every advantage is 0, "
                      f"grad_norm {metrics.get('grad_norm', float('nan')):.3g}); likely cause: "
                      f"{no_signal_cause(metrics)}")

        nan_heavy = n and metrics.get("samples/nan_reward", 0.0) > 0.5 * n
        self.nan_streak = self.nan_streak + 1 if nan_heavy else 0
        if self.nan_streak == STREAK:
            warnings += 1
            self.warn(f"update {step}: {STREAK} updates in a row with more than half of the rewards NaN "
                      f"({int(metrics.get('samples/nan_reward', 0))} of {int(n)} now): the rewards cannot judge "
                      f"these samples; check their reasons in the log and the data")

        clipped = metrics.get("clip_ratio/region", metrics.get("clipfrac", 0.0))  # the actions whose gradient is cut
        clip_high = clipped > CLIPFRAC_LIMIT
        if clip_high:
            warnings += 1
            self.warn(f"update {step}: clipped fraction {clipped:.2f} > {CLIPFRAC_LIMIT}: most actions are clipped, "
                      f"the policy moves too far per update (lower optim.lr or widen algorithm.clip_low)")

        kl = metrics.get("kl", float("nan"))
        kl_spike = self._spike(self.kl, kl, KL_FLOOR)
        if kl_spike:
            warnings += 1
            self.warn(f"update {step}: kl {kl:.3g} is more than {SPIKE_FACTOR:g}x its recent median: the policy is "
                      f"leaving the reference fast (raise algorithm.beta or lower optim.lr)")
        grad = metrics.get("grad_norm", float("nan"))
        grad_spike = self._spike(self.grad_norm, grad)
        if grad_spike:
            warnings += 1
            self.warn(f"update {step}: grad_norm {grad:.3g} is more than {SPIKE_FACTOR:g}x its recent median "
                      f"(optim.max_grad_norm clips it; persistent spikes mean an unstable reward or lr)")
        if math.isfinite(kl):
            self.kl.append(kl)
        if math.isfinite(grad):
            self.grad_norm.append(grad)
        out = {"health/no_signal_streak": float(self.no_signal), "health/nan_reward_streak": float(self.nan_streak),
               "health/clipfrac_high": float(clip_high), "health/kl_spike": float(kl_spike),
               "health/grad_norm_spike": float(grad_spike)}
        if "credit/turning_points" in metrics:
            none = metrics["credit/turning_points"] == 0
            self.no_turning_point = self.no_turning_point + 1 if none else 0
            out["health/no_turning_point_streak"] = float(self.no_turning_point)
            if self.no_turning_point == TURNING_POINT_STREAK:
                warnings += 1
                self.warn(f"update {step}: {TURNING_POINT_STREAK} updates in a row without a turning point "
                          f"(credit/turning_points 0): turning_point credit is step-gain credit here. Under the "
                          f"consistency filter a reward that is only 0 or 1 never has one; use a graded reward "
                          f"(e.g. shapeworld_partial on multi-clause prompts) or consistency_filter: false")
        return {**out, "health/warnings": float(warnings)}
