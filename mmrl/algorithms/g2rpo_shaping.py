"""G2RPO's task-level shaping (OpenVLThinkerV2): response-length shaping per task, and an entropy band."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmrl.algorithms.base import (RewardContext, Rewards, TransformContext, Variant, global_mean, option,
                                  register)
from mmrl.algorithms.delightful_pg import _token_advantages
from mmrl.core.advantages import _grouped_stats, group_index

LENGTH = "length_shaping"


@dataclass
class G2RPOShapingOptions:
    length_weight: float = option(0.1, "Weight of the response-length shaping component `length_shaping` (mmrl's "
                                       "scale; 0 = no length shaping) (OpenVLThinkerV2, Hu et al. 2026, "
                                       "arXiv 2604.08539).")
    direct_tasks: list = option(["grounding"], "Tasks (metadata `task`) whose answers should be direct: length "
                                               "shaping rewards staying within direct_length. Every other task, and a "
                                               "sample without one, is a reasoning task.")
    task_key: str = option("task", "The metadata key holding a sample's task.")
    direct_length: int = option(128, "Direct tasks: full length reward up to this many completion tokens, falling "
                                     "linearly to 0 at twice it.")
    reasoning_length: int = option(1024, "Reasoning tasks: the length reward grows linearly with the completion's "
                                         "tokens up to 1 at this many.")
    outcome: str = option("", "Optional outcome component (a key of `rewards`, e.g. accuracy) that measures how hard a "
                              "query is: a reasoning group's length reward is scaled by its failure rate (the share of "
                              "responses with outcome < threshold). Empty: every reasoning query gets the full reward.")
    threshold: float = option(0.5, "A response is correct when its outcome reward is >= threshold.")
    entropy_shaping: bool = option(True, "Bound the policy's token entropy in [entropy_low, entropy_high] by damping "
                                         "the advantage of the tokens that push it out of the band (transform stage).")
    entropy_low: float = option(0.1, "Below this batch entropy (mean sampled-token surprisal, nats) the tokens whose "
                                     "update lowers the entropy are damped (guards against entropy collapse).")
    entropy_high: float = option(1.0, "Above it the tokens whose update raises the entropy are damped (guards "
                                      "against entropy explosion); inf = no upper bound.", allow_inf=True)
    damping: float = option(0.5, "The factor multiplying the damped tokens' advantages (0 = drop them, 1 = off).")

    def validate(self) -> None:
        if not self.length_weight >= 0 or not math.isfinite(self.length_weight):
            raise ValueError(f"length_weight must be a finite number >= 0, got {self.length_weight}")
        if self.length_weight == 0 and not self.entropy_shaping:
            raise ValueError("length_weight is 0 and entropy_shaping is off: g2rpo_shaping would change nothing")
        if not isinstance(self.direct_tasks, list) or not all(isinstance(t, str) for t in self.direct_tasks):
            raise ValueError(f"direct_tasks must be a list of task names, got {self.direct_tasks!r}")
        if not self.task_key:
            raise ValueError("task_key must name the metadata key of the task")
        if self.direct_length < 1 or self.reasoning_length < 1:
            raise ValueError(f"direct_length and reasoning_length must be >= 1 token, got {self.direct_length} and "
                             f"{self.reasoning_length}")
        if not math.isfinite(self.threshold):
            raise ValueError(f"threshold must be a finite number, got {self.threshold}")
        if math.isnan(self.entropy_low) or math.isnan(self.entropy_high) or not (
                0.0 <= self.entropy_low <= self.entropy_high):
            raise ValueError(f"need 0 <= entropy_low <= entropy_high, got entropy_low={self.entropy_low}, "
                             f"entropy_high={self.entropy_high}")
        if not 0.0 <= self.damping <= 1.0:
            raise ValueError(f"damping must be in [0, 1], got {self.damping}")


def length_rewards(lengths: Tensor, direct: Tensor, *, direct_length: int, reasoning_length: int,
                   difficulty: Tensor | None = None) -> Tensor:
    """The length-shaping reward ``[N]`` in [0, 1] from completion lengths ``[N]`` (tokens) and ``direct [N]`` (bool,
    the sample's task wants a direct answer)::

        direct task:     clip(2 - L / direct_length, 0, 1)              1 up to direct_length, 0 from twice it
        reasoning task:  d_g * min(1, L / reasoning_length)             d_g = difficulty of the sample's group

    ``difficulty [N]`` (default 1): the group's failure rate, so longer chains are elicited where the query is hard."""
    lengths = lengths.float()
    short = (2.0 - lengths / direct_length).clamp(0.0, 1.0)
    long = (lengths / reasoning_length).clamp(max=1.0)
    if difficulty is not None:
        long = long * difficulty.float()
    return torch.where(direct, short, long)


def group_failure_rate(outcome: Tensor, group_ids, threshold: float) -> Tensor:
    """``[N]``: the share of each sample's group whose outcome is ``< threshold`` (NaN outcomes left out; a group
    without a finite outcome counts as fully failed)."""
    outcome = outcome.float()
    index, num_groups = group_index(group_ids)
    valid = torch.isfinite(outcome).unsqueeze(1)
    wrong = (outcome < threshold).float().unsqueeze(1)
    rate, _, count = _grouped_stats(wrong, valid, index, num_groups, 0)
    return torch.where(count[:, 0] > 0, rate[:, 0], torch.ones_like(rate[:, 0]))


def entropy_band_weights(advantages: Tensor, old_logps: Tensor, mask: Tensor, *, low: float, high: float,
                         damping: float, accelerator: Any = None) -> tuple[Tensor, float, int]:
    """Token weights ``[N, T]`` (0 on padding) that keep the policy's entropy in ``[low, high]``, the batch entropy
    ``H`` and the gate (-1 below the band, 0 in it, +1 above).

    ``s = -old_logps`` is each sampled token's surprisal, ``H = mean(s)`` over the active tokens of every process's
    batch (``accelerator``; this process's alone when ``None``), a Monte-Carlo estimate of the mean token entropy. A policy-gradient step changes the entropy by about
    ``-Cov(log pi, A)`` (the covariance over the batch's tokens): a token with ``(H - s) * A > 0`` (a likely token
    reinforced, or an unlikely one pushed down) lowers it, one with ``(H - s) * A < 0`` raises it. Below the band
    (``H < low``) the lowering tokens get weight ``damping``; above it (``H > high``) the raising ones; in it every
    weight is 1."""
    adv = _token_advantages(advantages, mask)
    surprisal = -old_logps.to(adv.dtype)
    active = (mask > 0) & torch.isfinite(surprisal)
    weights = active.to(adv.dtype)
    entropy = global_mean(surprisal[active], accelerator, empty=math.nan)
    if math.isnan(entropy):  # no process has an active token
        return weights, entropy, 0
    gate = -1 if entropy < low else (1 if entropy > high else 0)
    if gate == 0:
        return weights, entropy, 0
    direction = (entropy - surprisal) * adv  # > 0: lowers the entropy, < 0: raises it
    damped = active & ((direction > 0) if gate < 0 else (direction < 0))
    return torch.where(damped, torch.full_like(weights, damping), weights), entropy, gate


@register
class G2RPOShaping(Variant):
    """OpenVLThinkerV2's two task-level shaping mechanisms, as mmrl rules from the abstract's description:

    * **response-length shaping** (``rewards`` stage): the component ``length_shaping`` (weight ``length_weight``)
      from :func:`length_rewards`: "extended reasoning chains for complex queries" -- a reasoning task's reward grows
      with the completion's length up to ``reasoning_length`` tokens, scaled by the group's failure rate when
      ``outcome`` is named (the "dynamic", per-query part) -- "while enforc[ing] direct outputs to bolster visual
      grounding" -- a direct task (``direct_tasks``, metadata ``task``) is rewarded for staying within
      ``direct_length`` tokens. Lengths are the completions' token counts (``rollout.mask``).
    * **entropy shaping** (``transform`` stage, needs ``old_logps``): "tightly bounds the model's exploration zone,
      effectively preventing both entropy collapse and entropy explosion" -- :func:`entropy_band_weights` damps the
      advantages of the tokens whose update would push the batch entropy further out of
      ``[entropy_low, entropy_high]``; the advantages become ``[N, T]``.

    The abstract gives no formulas: the length targets, the failure-rate scaling, the covariance sign test and the
    damping are mmrl's, not a claim of parity with the paper's code. The entropy is the sampling policy's mean
    sampled-token surprisal over the whole update's batch (every process's tokens), once per update. Made to pair with ``g2rpo`` (the Gaussian
    advantages) but works with any estimator. Stats: ``g2rpo_shaping/entropy``, ``g2rpo_shaping/entropy_gate``,
    ``g2rpo_shaping/damped_tokens`` (share of active tokens), ``g2rpo_shaping/direct_length`` and
    ``g2rpo_shaping/reasoning_length`` (mean completion tokens per kind). VLM policies only (tasks, token entropies).
    """

    name = "g2rpo_shaping"
    summary = "task-level length reward (long reasoning on hard queries, direct grounding answers) + an entropy band"
    paper = ("OpenVLThinkerV2: A Generalist Multimodal Reasoning Model for Multi-domain Visual Tasks (G^2RPO), Hu et "
             "al. 2026, arXiv 2604.08539; the shaping formulas are mmrl's")
    Options = G2RPOShapingOptions
    needs = ("old_logps",)
    families = ("vlm",)

    def check(self, config) -> None:
        if self.options.outcome:
            self.require_reward(config, "outcome")

    def rewards(self, ctx: RewardContext) -> Rewards:
        o, r = self.options, ctx.rollout
        if o.length_weight == 0:
            return Rewards(dict(ctx.scores), dict(ctx.weights))
        lengths = r.mask.float().sum(-1)
        direct_tasks = set(o.direct_tasks)
        direct = torch.tensor([isinstance(m, dict) and m.get(o.task_key) in direct_tasks for m in r.metadata],
                              dtype=torch.bool)
        difficulty = None
        if o.outcome:
            if o.outcome not in ctx.scores:
                raise ValueError(f"variant {self.name!r}: no score component {o.outcome!r}; the components are "
                                 f"{sorted(ctx.scores)}")
            difficulty = group_failure_rate(ctx.scores[o.outcome], r.group_ids, o.threshold)
        shaped = length_rewards(lengths, direct, direct_length=o.direct_length, reasoning_length=o.reasoning_length,
                                difficulty=difficulty)
        for kind, rows in (("direct_length", direct), ("reasoning_length", ~direct)):
            if bool(rows.any()):
                ctx.stats[f"{self.name}/{kind}"] = float(lengths[rows].mean())
        return Rewards({**ctx.scores, LENGTH: shaped}, {**ctx.weights, LENGTH: float(o.length_weight)})

    def transform(self, ctx: TransformContext) -> Tensor:
        o, r = self.options, ctx.rollout
        if not o.entropy_shaping:
            return ctx.advantages
        weights, entropy, gate = entropy_band_weights(ctx.advantages, r.old_logps, r.mask, low=o.entropy_low,
                                                      high=o.entropy_high, damping=o.damping,
                                                      accelerator=ctx.accelerator)
        active = (r.mask > 0) & torch.isfinite(r.old_logps)
        if math.isfinite(entropy):
            ctx.stats[f"{self.name}/entropy"] = entropy
        ctx.stats[f"{self.name}/entropy_gate"] = float(gate)
        ctx.stats[f"{self.name}/damped_tokens"] = float((active & (weights < 1)).sum() / active.sum().clamp(min=1))
        adv = _token_advantages(ctx.advantages, r.mask)
        return torch.where(weights > 0, adv * weights, torch.zeros_like(adv))
