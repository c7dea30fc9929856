"""Trust-GRPO (SophiaVL-R1): the thinking reward weighted by a per-group trust factor and annealed to 0."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import RewardContext, Rewards, Variant, option, register
from mmrl.core.advantages import _grouped_stats, group_index

ANNEALS = ("linear", "cosine", "exp", "none")


@dataclass
class TrustGRPOOptions:
    thinking: str = option("", "The thinking reward component (a key of `rewards`, e.g. a thinking reward model's "
                               "score of the whole thinking process) that Trust-GRPO weights (SophiaVL-R1, Fan et al. "
                               "2025, arXiv 2505.17018).")
    outcome: str = option("", "The outcome component (a key of `rewards`, e.g. accuracy) that decides which responses "
                              "are correct.")
    threshold: float = option(0.5, "A response is correct when its outcome reward is >= threshold (0.5 splits 0/1 "
                                   "accuracies; a NaN outcome is neither correct nor incorrect).")
    temperature: float = option(1.0, "tau in the trust factor exp((mu_correct - mu_incorrect) / tau) of a group whose "
                                     "incorrect responses out-think its correct ones (mmrl's form).")
    no_contrast_trust: float = option(1.0, "The trust factor of a group without both correct and incorrect responses "
                                           "(nothing to compare; mmrl's choice: trusted).")
    anneal: str = option("linear", "How the thinking reward decays over training to 0: 'linear' 1 - k/K, 'cosine' "
                                   "(1 + cos(pi k/K)) / 2, 'exp' exp(-k/K) (towards 0), 'none' (no annealing); k = the "
                                   "update, K = anneal_steps.")
    anneal_steps: int = option(0, "K, the updates over which the thinking reward anneals; 0 = train.steps.")

    def validate(self) -> None:
        if not self.thinking or not self.outcome:
            raise ValueError("thinking and outcome: name the thinking reward and the outcome (correctness) components")
        if self.thinking == self.outcome:
            raise ValueError(f"thinking and outcome must be different components, both are {self.thinking!r}")
        if not self.temperature > 0 or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        if not 0.0 <= self.no_contrast_trust <= 1.0:
            raise ValueError(f"no_contrast_trust must be in [0, 1], got {self.no_contrast_trust}")
        if self.anneal not in ANNEALS:
            raise ValueError(f"anneal must be one of {ANNEALS}, got {self.anneal!r}")
        if self.anneal_steps < 0:
            raise ValueError(f"anneal_steps must be >= 0 (0 = train.steps), got {self.anneal_steps}")
        if not math.isfinite(self.threshold):
            raise ValueError(f"threshold must be a finite number, got {self.threshold}")


def anneal_factor(update: int, steps: int, mode: str = "linear") -> float:
    """The thinking reward's schedule at update ``update`` (0-based) of ``steps``: 1 at the start, 0 at ``steps``
    ('linear', 'cosine'; clamped at 0 after it), ``exp(-update / steps)`` ('exp'), 1 ('none')."""
    if mode == "none":
        return 1.0
    if steps <= 0:
        raise ValueError(f"the annealing needs a positive number of steps, got {steps}")
    x = min(max(update, 0) / steps, 1.0)
    if mode == "linear":
        return 1.0 - x
    if mode == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * x))
    if mode == "exp":
        return math.exp(-max(update, 0) / steps)
    raise ValueError(f"unknown anneal {mode!r}; expected one of {ANNEALS}")


def trust_factors(thinking: Tensor, outcome: Tensor, group_ids, *, threshold: float = 0.5, temperature: float = 1.0,
                  no_contrast: float = 1.0) -> tuple[Tensor, Tensor]:
    """The trust factor ``gamma [N]`` of each sample's group (mmrl's rule from the abstract's idea), and whether the
    group has both correct and incorrect responses (``contrasted [N]``, bool)::

        mu_c = mean thinking reward of the group's correct responses   (outcome >= threshold)
        mu_w = mean thinking reward of its incorrect responses         (outcome < threshold)
        gamma = 1                                 if mu_c >= mu_w   (the thinking reward agrees with the outcome)
              = exp((mu_c - mu_w) / temperature)  if mu_c <  mu_w   (it favours wrong answers: distrusted)
              = no_contrast                       without both kinds of responses

    Samples with a NaN thinking reward or outcome are left out of the means."""
    thinking, outcome = thinking.float(), outcome.float()
    index, num_groups = group_index(group_ids)
    finite = torch.isfinite(thinking) & torch.isfinite(outcome)
    correct = finite & (outcome >= threshold)
    wrong = finite & (outcome < threshold)
    values = thinking.unsqueeze(1)
    mu_c, _, n_c = _grouped_stats(values, correct.unsqueeze(1), index, num_groups, 0)
    mu_w, _, n_w = _grouped_stats(values, wrong.unsqueeze(1), index, num_groups, 0)
    mu_c, mu_w, n_c, n_w = mu_c[:, 0], mu_w[:, 0], n_c[:, 0], n_w[:, 0]
    contrasted = (n_c > 0) & (n_w > 0)
    gamma = torch.exp(torch.clamp(mu_c - mu_w, max=0.0) / temperature)
    return torch.where(contrasted, gamma, torch.full_like(gamma, float(no_contrast))), contrasted


@register
class TrustGRPO(Variant):
    """Trust-GRPO, in the ``rewards`` stage::

        thinking'_i = gamma_g(i) * lambda(k) * thinking_i

    ``gamma`` the trust factor of sample i's group (:func:`trust_factors`): the abstract's "trustworthiness weight"
    "computed based on the thinking reward comparison of responses leading to correct answers versus incorrect
    answers"; ``lambda(k)`` the annealing "that gradually reduces the thinking reward over time" (:func:`anneal_factor`,
    default linear to 0 at ``train.steps``). The thinking component keeps its configured weight (the thinking reward's
    weight next to the outcome reward); the raw thinking reward is kept (logged only) as ``<thinking>_raw`` and the
    factor ``gamma * lambda`` as ``<thinking>_trust``. A NaN thinking reward stays NaN. The comparison (group means,
    ``gamma = exp(min(0, mu_c - mu_w) / tau)``) and the schedules are mmrl's rules from the abstract's ideas, without
    a claim of parity with the paper's code. Stats: ``trust_grpo/trust`` (mean gamma over groups with both kinds of
    responses), ``trust_grpo/distrusted_groups`` (count with gamma < 1), ``trust_grpo/anneal`` (lambda).
    """

    name = "trust_grpo"
    summary = "thinking reward x per-group trust (correct vs incorrect responses' thinking rewards), annealed to 0"
    paper = ("SophiaVL-R1: Reinforcing MLLMs Reasoning with Thinking Reward (Trust-GRPO), Fan et al. 2025, "
             "arXiv 2505.17018; the trust and annealing formulas are mmrl's")
    Options = TrustGRPOOptions
    families = ("vlm",)

    def check(self, config) -> None:
        self.require_reward(config, "thinking", weighted=True)
        self.require_reward(config, "outcome")

    def rewards(self, ctx: RewardContext) -> Rewards:
        o = self.options
        for key in (o.thinking, o.outcome):
            if key not in ctx.scores:
                raise ValueError(f"variant {self.name!r}: no score component {key!r}; the components are "
                                 f"{sorted(ctx.scores)}")
        thinking, outcome = ctx.scores[o.thinking].float(), ctx.scores[o.outcome].float()
        if thinking.dim() != 1 or outcome.shape != thinking.shape:
            raise ValueError(f"variant {self.name!r}: {o.thinking!r} and {o.outcome!r} must be one reward per sample "
                             f"[N], got shapes {tuple(thinking.shape)} and {tuple(outcome.shape)}")
        group_ids = ctx.rollout.group_ids
        gamma, contrasted = trust_factors(thinking, outcome, group_ids, threshold=o.threshold,
                                          temperature=o.temperature, no_contrast=o.no_contrast_trust)
        lam = anneal_factor(ctx.update, o.anneal_steps or int(ctx.config.train.steps), o.anneal)
        factor = gamma * lam
        index, num_groups = group_index(group_ids)
        member = torch.zeros(num_groups, dtype=torch.long).scatter_(0, index, torch.arange(len(index)))
        trusted = gamma[member][contrasted[member]]  # one factor per group with both kinds (constant in a group)
        if trusted.numel():
            ctx.stats[f"{self.name}/trust"] = float(trusted.mean())
        name = f"{self.name}/distrusted_groups"
        ctx.stats[name] = ctx.stats.get(name, 0.0) + float((trusted < 1.0).sum())
        ctx.stats[f"{self.name}/anneal"] = lam
        scores = {**ctx.scores, o.thinking: factor * thinking, f"{o.thinking}_raw": thinking,
                  f"{o.thinking}_trust": factor}
        return Rewards(scores, dict(ctx.weights))
