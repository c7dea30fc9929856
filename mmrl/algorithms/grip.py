"""GRiP's multi-heuristic reward: valid responses earn a bonus for reasoning unlike their group's other valid ones."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import RewardContext, Rewards, Variant, option, register
from mmrl.core.advantages import group_index

DIVERSITY = "grip_diversity"
_WORD = re.compile(r"\w+")


@dataclass
class GRiPOptions:
    outcome: str = option("", "The outcome component (a key of `rewards`, e.g. iou or accuracy) that decides which "
                              "responses are valid.")
    threshold: float = option(0.5, "A response is valid when its outcome reward is >= threshold (a NaN outcome is not "
                                   "valid).")
    weight: float = option(0.5, "Advantage weight of the diversity component next to the configured rewards.")

    def validate(self) -> None:
        if not self.outcome:
            raise ValueError("outcome: name the reward component that decides which responses are valid")
        if not math.isfinite(self.threshold):
            raise ValueError(f"threshold must be a finite number, got {self.threshold}")
        if not self.weight >= 0 or not math.isfinite(self.weight):
            raise ValueError(f"weight must be a finite number >= 0, got {self.weight}")


def reasoning_words(text: str) -> frozenset[str]:
    """The lower-cased words of a response's reasoning: its ``<think>`` blocks, or the whole text without one."""
    from mmrl.rewards._text import THINK_BLOCK

    blocks = THINK_BLOCK.findall(text) if isinstance(text, str) else []
    source = " ".join(blocks) if blocks else (text if isinstance(text, str) else "")
    return frozenset(w.lower() for w in _WORD.findall(source))


def jaccard_distance(a: frozenset, b: frozenset) -> float:
    """``1 - |a & b| / |a | b|`` (0 for two empty sets)."""
    union = len(a | b)
    return 1.0 - len(a & b) / union if union else 0.0


def multi_heuristic_rewards(texts: list[str], valid: list[bool], group_ids) -> tuple[Tensor, dict[str, float]]:
    """The diversity reward ``[N]``: for a valid response ``i`` with ``m >= 2`` valid responses in its group,

        d_i = mean over the other valid j of jaccard_distance(words_i, words_j)

    over the words of their reasoning (:func:`reasoning_words`); 0 for an invalid response and for the only valid
    response of its group (no other valid path to differ from). ``stats``: ``valid_share`` (valid responses / N) and
    ``mean_distance`` (mean ``d_i`` over the valid responses that have a peer)."""
    index, num_groups = group_index(group_ids)
    words = [reasoning_words(t) for t in texts]
    reward = torch.zeros(len(texts))
    members: list[list[int]] = [[] for _ in range(num_groups)]
    for i, g in enumerate(index.tolist()):
        if valid[i]:
            members[g].append(i)
    distances = []
    for rows in members:
        if len(rows) < 2:
            continue
        for i in rows:
            reward[i] = sum(jaccard_distance(words[i], words[j]) for j in rows if j != i) / (len(rows) - 1)
            distances.append(float(reward[i]))
    stats = {"valid_share": sum(valid) / max(len(valid), 1)}
    if distances:
        stats["mean_distance"] = sum(distances) / len(distances)
    return reward, stats


@register
class GRiPMultiHeuristic(Variant):
    """GRiP's Multi-Heuristic Reward, in the ``rewards`` stage (VLM policies): "rewarding diverse yet logically valid
    reasoning pathways" (GRiP, arXiv 2511.22172). The abstract gives the idea, not the rule; mmrl's rule: a response
    is valid when its ``outcome`` component is at least ``threshold``, and a valid response earns the mean Jaccard
    distance between the words of its reasoning and those of the other valid responses of its group
    (:func:`multi_heuristic_rewards`), as the component ``grip_diversity`` with advantage weight ``weight``. Invalid
    responses get 0, so a diverse but wrong path earns nothing. GRiP's other reward, the salience-weighted IoU, is the
    ``box_salience_iou`` reward. Stats: ``grip/valid_share``, ``grip/mean_distance``."""

    name = "grip_multi_heuristic"
    summary = "a bonus for valid responses whose reasoning differs from their group's other valid responses"
    paper = ("GRiP: Guided Reasoning and Perception, arXiv 2511.22172 (Multi-Heuristic Reward; the valid-response "
             "rule and the Jaccard distance of reasoning words are mmrl's)")
    Options = GRiPOptions
    families = ("vlm",)

    def check(self, config) -> None:
        self.require_reward(config, "outcome")

    def rewards(self, ctx: RewardContext) -> Rewards:
        o, r = self.options, ctx.rollout
        outcome = ctx.scores[o.outcome].float()
        valid = [bool(v >= o.threshold) for v in outcome.tolist()]  # NaN >= t is False
        diversity, stats = multi_heuristic_rewards(list(r.completions), valid, r.group_ids)
        for key, value in stats.items():
            ctx.stats[f"grip/{key}"] = value
        return Rewards({**ctx.scores, DIVERSITY: diversity}, {**ctx.weights, DIVERSITY: float(o.weight)})
