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
    threshold: float = option(0.5, "A response is correct when its outcome reward is >= threshold, for the group "
                                   "means mu_c / mu_w (the released code's 0.5; a NaN outcome is neither).")
    all_correct_at: float = option(0.9, "A group whose every outcome is >= this is homogeneous (the released code's "
                                        "0.9): its thinking reward gets the factor no_contrast_trust.")
    all_wrong_at: float = option(0.1, "A group whose every outcome is <= this is homogeneous (the released code's "
                                      "0.1).")
    judge_from: float = option(0.2, "A response whose outcome is below this gets thinking reward 0 (the released code "
                                    "sends only responses of answer score >= 0.2 to the thinking reward model); "
                                    "-inf keeps every thinking reward.", allow_inf=True)
    temperature: float = option(1.0, "tau in the trust factor exp((mu_c - mu_w) / tau) of a group whose incorrect "
                                     "responses out-think its correct ones (the released code: exp(mu_c - mu_w), "
                                     "tau = 1).")
    no_contrast_trust: float = option(0.0, "The factor of a homogeneous group's thinking reward (the released code: "
                                           "0, the thinking reward is dropped where every answer is right or every "
                                           "answer is wrong).")
    anneal: str = option("exp", "How the thinking reward decays over training: 'exp' exp(-k/K) with k the 1-based "
                                "update (the released code's exp(-global_step / T)), 'linear' 1 - k/K and 'cosine' "
                                "(1 + cos(pi k/K)) / 2 with k the 0-based update (to 0 at K), 'none'.")
    anneal_steps: int = option(500, "K (the released code's T: 500 by default, 12000 in its training script); 0 = "
                                    "train.steps.")

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
        if not self.all_wrong_at < self.all_correct_at:
            raise ValueError(f"need all_wrong_at < all_correct_at, got {self.all_wrong_at} and {self.all_correct_at}")
        if math.isnan(self.judge_from) or self.judge_from == math.inf:
            raise ValueError(f"judge_from must be a number or -inf, got {self.judge_from}")


def anneal_factor(update: int, steps: int, mode: str = "exp") -> float:
    """The thinking reward's schedule at update ``update`` (0-based) of ``K = steps``: ``exp(-(update + 1) / K)``
    ('exp': SophiaVL-R1's ``exp(-global_step / T)``, whose global step counts from 1), ``1 - update / K`` ('linear')
    and ``(1 + cos(pi update / K)) / 2`` ('cosine'), 1 at the start and clamped at 0 from ``K``, 1 ('none')."""
    if mode == "none":
        return 1.0
    if steps <= 0:
        raise ValueError(f"the annealing needs a positive number of steps, got {steps}")
    if mode == "exp":
        return math.exp(-(max(update, 0) + 1) / steps)
    x = min(max(update, 0) / steps, 1.0)
    if mode == "linear":
        return 1.0 - x
    if mode == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * x))
    raise ValueError(f"unknown anneal {mode!r}; expected one of {ANNEALS}")


def trust_factors(thinking: Tensor, outcome: Tensor, group_ids, *, threshold: float = 0.5, temperature: float = 1.0,
                  no_contrast: float = 0.0, all_correct_at: float = 0.9,
                  all_wrong_at: float = 0.1) -> tuple[Tensor, Tensor]:
    """The factor ``gamma [N]`` on each sample's thinking reward from its group, and whether the group is contrasted
    (not homogeneous; ``[N]`` bool), as SophiaVL-R1's released reward manager (``CustomRewardManager``, group mode)::

        homogeneous (every outcome >= all_correct_at, or every outcome <= all_wrong_at):  gamma = no_contrast (0)
        otherwise, mu_c / mu_w = mean thinking reward of the correct (outcome >= threshold) / incorrect responses,
        mu_w = 0 without incorrect ones:
            gamma = exp((mu_c - mu_w) / temperature)   if there are correct responses and mu_c < mu_w (distrusted)
                  = 1                                  otherwise (the thinking reward agrees with the outcome)

    Samples with a NaN outcome are left out of the group's test and means, a NaN thinking reward out of the means; a
    group without a finite outcome is homogeneous."""
    thinking, outcome = thinking.float(), outcome.float()
    index, num_groups = group_index(group_ids)
    judged = torch.isfinite(outcome)
    finite = torch.isfinite(thinking) & judged
    correct = finite & (outcome >= threshold)
    wrong = finite & (outcome < threshold)

    def every(condition: Tensor) -> Tensor:  # per group: every judged sample meets the condition
        failing = torch.zeros(num_groups).index_add_(0, index, (judged & ~condition).float())
        return failing == 0

    homogeneous = (every(outcome >= all_correct_at) | every(outcome <= all_wrong_at))[index]  # [N]
    values = thinking.unsqueeze(1)
    mu_c, _, n_c = _grouped_stats(values, correct.unsqueeze(1), index, num_groups, 0)
    mu_w, _, n_w = _grouped_stats(values, wrong.unsqueeze(1), index, num_groups, 0)
    mu_c, n_c = mu_c[:, 0], n_c[:, 0]
    mu_w = torch.where(n_w[:, 0] > 0, mu_w[:, 0], torch.zeros_like(mu_c))
    gamma = torch.where(n_c > 0, torch.exp(torch.clamp(mu_c - mu_w, max=0.0) / temperature), torch.ones_like(mu_c))
    gamma = torch.where(homogeneous, torch.full_like(gamma, float(no_contrast)), gamma)
    return gamma, ~homogeneous


@register
class TrustGRPO(Variant):
    """Trust-GRPO, in the ``rewards`` stage::

        thinking'_i = gamma_g(i) * lambda(k) * thinking_i

    ``gamma`` the trust factor of sample i's group (:func:`trust_factors`): the abstract's "trustworthiness weight"
    "computed based on the thinking reward comparison of responses leading to correct answers versus incorrect
    answers"; ``lambda(k)`` the annealing "that gradually reduces the thinking reward over time"
    (:func:`anneal_factor`).
    The defaults are the released code's (``verl/workers/reward/custom.py`` of kxfan2002/SophiaVL-R1, group mode):
    a response whose outcome is below 0.2 gets thinking reward 0 (it is never sent to the thinking reward model
    there), a homogeneous group's thinking reward is dropped, ``lambda = exp(-k / T)`` with T = 500. The thinking
    component keeps its configured weight (the released code's 0.3: ``rewards: {accuracy: 1.0, thinking: 0.3}``
    gives its ``answer + exp(-k/T) * 0.3 * gamma * process``). The raw thinking reward is kept (logged only) as
    ``<thinking>_raw`` and the factor ``gamma * lambda`` as ``<thinking>_trust``. A NaN thinking reward stays NaN.
    Stats: ``trust_grpo/trust`` (mean gamma over contrasted groups), ``trust_grpo/distrusted_groups`` (count with
    gamma < 1), ``trust_grpo/anneal`` (lambda).
    """

    name = "trust_grpo"
    summary = "thinking reward x per-group trust (correct vs incorrect responses' thinking rewards), annealed"
    paper = ("SophiaVL-R1: Reinforcing MLLMs Reasoning with Thinking Reward (Trust-GRPO), Fan et al. 2025, "
             "arXiv 2505.17018; the trust and annealing rules of its released reward manager")
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
        judged = torch.where(outcome < o.judge_from, torch.zeros_like(thinking), thinking)
        gamma, contrasted = trust_factors(judged, outcome, group_ids, threshold=o.threshold,
                                          temperature=o.temperature, no_contrast=o.no_contrast_trust,
                                          all_correct_at=o.all_correct_at, all_wrong_at=o.all_wrong_at)
        lam = anneal_factor(ctx.update, o.anneal_steps or int(ctx.config.train.steps), o.anneal)
        factor = gamma * lam
        index, num_groups = group_index(group_ids)
        member = torch.zeros(num_groups, dtype=torch.long).scatter_(0, index, torch.arange(len(index)))
        trusted = gamma[member][contrasted[member]]  # one factor per contrasted group (constant in a group)
        if trusted.numel():
            ctx.stats[f"{self.name}/trust"] = float(trusted.mean())
        name = f"{self.name}/distrusted_groups"
        ctx.stats[name] = ctx.stats.get(name, 0.0) + float((trusted < 1.0).sum())
        ctx.stats[f"{self.name}/anneal"] = lam
        scores = {**ctx.scores, o.thinking: factor * judged, f"{o.thinking}_raw": thinking,
                  f"{o.thinking}_trust": factor}
        return Rewards(scores, dict(ctx.weights))
