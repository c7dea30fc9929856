"""GRPO-CARE: a consistency bonus from a slowly updated reference's likelihood of the answer given the reasoning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmrl.algorithms.base import RewardContext, Rewards, Variant, VariantError, option, register
from mmrl.core.advantages import _grouped_stats, group_index
from mmrl.ema import EMA


@dataclass
class GRPOCareOptions:
    accuracy: str = option("", "The answer-correctness component (a key of `rewards`), GRPO-CARE's base reward.")
    bonus: float = option(0.5, "The bonus coefficient: a consistent, accurate response gets bonus x its accuracy "
                               "(the released scripts' bonus_coefficient 0.5).")
    decay: float = option(0.995, "EMA decay of the slowly evolving reference, lerp(policy, reference, decay) (the "
                                 "released scripts' ref_ema_decay 0.995).")
    update_every: int = option(10, "The reference moves every this many updates, before that update's rollout is "
                                   "judged (the released scripts' ref_ema_update_every 10, counted in optimizer steps "
                                   "there: one per update).")
    margin: float | None = option(0.01, "Consistent means a likelihood >= the mean over the accurate peers minus this "
                                        "(the released scripts' consistency_margin: 0.01, or 0 in its margin0 runs; "
                                        "null: no margin).")
    confidence_cap: float | None = option(0.95, "Clamp the answer likelihood at this (the released scripts' "
                                                "confidence_upper_bound 0.95; null: no cap).")

    def validate(self) -> None:
        if not self.accuracy:
            raise ValueError("accuracy: name the answer-correctness component")
        if self.bonus < 0 or not 0.0 <= self.decay <= 1.0:
            raise ValueError("bonus must be >= 0 and decay in [0, 1]")
        if self.update_every < 1:
            raise ValueError(f"update_every must be >= 1, got {self.update_every}")
        if self.margin is not None and self.margin < 0:
            raise ValueError(f"margin must be >= 0 (or null), got {self.margin}")
        if self.confidence_cap is not None and not 0.0 < self.confidence_cap <= 1.0:
            raise ValueError(f"confidence_cap caps a probability: it must be in (0, 1] (or null), got "
                             f"{self.confidence_cap}")


@register
class GRPOCare(Variant):
    """Two-tiered reward (Chen et al.): the base accuracy reward plus an adaptive consistency bonus.

    A reference model evolves slowly: an EMA of the policy's trainable weights (LoRA adapters or all weights), moved
    as ``ref <- decay * ref + (1 - decay) * policy`` at the start of every ``update_every``-th update (updates 0,
    10, 20, ...: the released trainer's ``moving_average`` after optimizer steps 10, 20, ..., its reference then
    judging the next rollout). For each response its likelihood of the final
    answer given its own reasoning under that reference is ``c_i = exp(mean log p_ref(answer tokens | prompt,
    reasoning))`` (the tokens of the ``<answer>`` block, mapped with the tokenizer), optionally capped. Within each
    group, following the released trainer: the accurate responses are those with accuracy ``> 0.1`` and ``>=`` the
    group's mean accuracy; the consistent ones have ``c_i >=`` the mean ``c`` of the group's accurate responses minus
    ``margin``; accurate and consistent responses get ``bonus * accuracy_i`` as the component ``consistency_bonus``
    (weight 1). The bonus replaces the KL penalty, so ``algorithm.beta`` must be 0. Cost: one no-gradient forward of
    every completion under the EMA weights per update (``time/reward``)."""

    name = "grpo_care"
    summary = "consistency bonus: accurate answers the slow EMA reference finds likely given their reasoning"
    paper = ("GRPO-CARE: Consistency-Aware Reinforcement Learning for Multimodal Reasoning, Chen et al. 2025, "
             "arXiv 2506.16141 (rule and defaults as its released trainer and scripts, per group)")
    Options = GRPOCareOptions
    families = ("vlm",)

    def __init__(self, options: Any = None):
        super().__init__(options)
        self.reference: EMA | None = None

    def check(self, config) -> None:
        self.require_reward(config, "accuracy")
        if config.algorithm.beta != 0:
            raise VariantError("variant 'grpo_care' replaces the KL penalty with its consistency bonus: set "
                               "algorithm.beta=0")

    copies_weights = True  # the EMA reference

    def setup(self, policy, config) -> None:
        self.reference = EMA(policy.named_trainable_parameters(), self.options.decay)

    def answer_likelihood(self, ctx: RewardContext) -> torch.Tensor:
        """``c [N]``: the EMA reference's mean answer-token probability (0 for a response without an answer)."""
        from mmrl.pipelines.vlm.spans import region_spans

        policy, r = ctx.policy, ctx.rollout
        answer = policy.span_mask(r, [region_spans(text, "answer") for text in r.completions])
        logps = torch.zeros(r.mask.shape)
        batch = ctx.config.train.batch_size
        with torch.no_grad(), self.reference.swapped_in(policy.named_trainable_parameters()):
            for start in range(0, len(r), batch):
                index = torch.arange(start, min(len(r), start + batch))
                logps[index] = policy.logprobs(r, index).logps.float().cpu()
        count = answer.sum(-1)
        mean = (logps * answer).sum(-1) / count.clamp(min=1.0)
        likelihood = torch.where(count > 0, mean.exp(), torch.zeros_like(mean))
        cap = self.options.confidence_cap
        return likelihood.clamp(max=cap) if cap is not None else likelihood

    def rewards(self, ctx: RewardContext) -> Rewards:
        o = self.options
        if ctx.update % o.update_every == 0:  # the slowly evolving reference moves first
            self.reference.update(ctx.policy.named_trainable_parameters())
        accuracy = torch.nan_to_num(ctx.scores[o.accuracy].float(), nan=0.0)
        likelihood = self.answer_likelihood(ctx)
        index, groups = group_index(ctx.rollout.group_ids)
        column = accuracy.unsqueeze(1)
        mean_accuracy, _, _ = _grouped_stats(column, torch.ones_like(column, dtype=torch.bool), index, groups, 0)
        accurate = (accuracy > 0.1) & (accuracy >= mean_accuracy.squeeze(1))
        mean_likelihood, _, count = _grouped_stats(likelihood.unsqueeze(1), accurate.unsqueeze(1), index, groups, 0)
        threshold = mean_likelihood.squeeze(1) - (o.margin or 0.0)
        consistent = (likelihood >= threshold) & (count.squeeze(1) > 0)
        bonus = torch.where(accurate & consistent, o.bonus * accuracy, torch.zeros_like(accuracy))
        ctx.stats["grpo_care/answer_likelihood"] = float(likelihood.mean())
        ctx.stats["grpo_care/bonus_share"] = float((bonus > 0).float().mean())
        return Rewards({**ctx.scores, "consistency_bonus": bonus}, {**ctx.weights, "consistency_bonus": 1.0})

    def state_dict(self) -> dict[str, Any]:
        return {"reference": self.reference.state_dict()} if self.reference is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and self.reference is not None:
            self.reference.load_state_dict(state["reference"])
