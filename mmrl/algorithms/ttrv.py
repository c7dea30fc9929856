"""TTRV: label-free test-time RL: each answer is rewarded by its frequency in its group, plus a low-entropy reward."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmrl.algorithms.base import RewardContext, Rewards, Variant, option, register
from mmrl.core.advantages import group_index

MATCHES = ("text", "choice", "number")
FREQUENCY = "ttrv_frequency"
ENTROPY = "ttrv_entropy"


@dataclass
class TTRVOptions:
    entropy_weight: float = option(1.0, "Weight of the low-entropy reward next to the frequency reward (weight 1); "
                                        "TTRV (Singh et al. 2025, arXiv 2510.06783) rewards both; the mix is mmrl's "
                                        "option. 0 = frequency only.")
    match: str = option("text", "When two answers are the same vote: 'text' = equal after lower-casing, collapsing "
                                "white space and dropping trailing punctuation; 'choice' = the same option letter "
                                "(metadata choices, as choice_accuracy reads it); 'number' = the same number.")
    require_tags: bool = option(True, "Read the answer from the one <answer>...</answer> block (else unparseable); "
                                      "False also reads a completion without answer tags whole.")
    keep_weights: bool = option(False, "Keep the configured rewards' advantage weights next to TTRV's rewards. "
                                       "Default: they are logged only (test-time RL has no labels; an accuracy "
                                       "reward then tracks what the label-free rewards achieve).")

    def validate(self) -> None:
        if not self.entropy_weight >= 0 or not math.isfinite(self.entropy_weight):
            raise ValueError(f"entropy_weight must be a finite number >= 0, got {self.entropy_weight}")
        if self.match not in MATCHES:
            raise ValueError(f"match must be one of {MATCHES}, got {self.match!r}")


_SPACE = re.compile(r"\s+")


def answer_key(text: Any, meta: Mapping | None, match: str = "text", require_tags: bool = True) -> Any:
    """The vote a completion casts: a hashable answer key; raises :class:`~mmrl.rewards._text.Unparseable` for an
    answer it cannot read and :class:`~mmrl.rewards._text.Unjudgeable` for metadata ``choices`` it cannot use."""
    from mmrl.rewards._text import Unparseable, answer_or_text, parse_number

    if not isinstance(text, str):
        raise Unparseable(f"completion is not a string (got {type(text).__name__})")
    answer = answer_or_text(text, require_tags)
    if match == "text":
        key = _SPACE.sub(" ", answer.lower()).strip().rstrip(".!;,").strip()
        if not key:
            raise Unparseable("empty answer")
        return key
    if match == "number":
        return parse_number(answer) + 0.0  # -0.0 and 0.0 are one vote
    from mmrl.rewards.answer import _choices, parse_choice

    return parse_choice(answer, _choices(meta or {}))


def ttrv_rewards(keys: list[Any], group_ids: Tensor | list) -> tuple[Tensor, Tensor, dict[str, float]]:
    """TTRV's two rewards ``(frequency [N], entropy [N], stats)`` from each sample's vote ``keys[i]``: a hashable
    answer, ``None`` for an unparseable completion (a 0 in both rewards, no vote) or ``NaN`` (float) for a sample
    that cannot be judged (NaN in both, left out of its group).

    Within a group of ``n`` judgeable samples (unparseable ones included) with answer counts ``c(a)``, the empirical
    distribution is ``p(a) = c(a) / n`` and::

        frequency_i = p(a_i)                                   TTRV's frequency reward
        entropy_i   = 1 + log p(a_i) / log n       (n > 1)      mmrl's per-sample low-entropy reward, in [0, 1]
                    = 1                             (n = 1)

    ``-log p(a_i)`` is sample i's surprisal under the group's answer distribution and the group's entropy is their
    mean, ``H = (1/n) sum_i -log p(a_i)``, so when every answer parses the group mean of ``entropy_i`` is exactly
    ``1 - H / log n``: the normalised negentropy of the group's answers (1 when all agree, 0 when all differ). A
    reward equal for the whole group (``-H`` itself) would cancel in every group-centred advantage; this split
    credits each sample with its share of it. ``stats``: ``answer_entropy`` (mean ``H`` over groups in nats, over the
    parsed answers' distribution), ``majority_share`` (mean ``max_a p(a)``), ``unparseable`` (count)."""
    index, num_groups = group_index(group_ids)
    n_all = len(keys)
    if index.numel() != n_all:
        raise ValueError(f"group_ids has {index.numel()} entries but there are {n_all} answers")
    frequency = torch.full((n_all,), float("nan"))
    entropy = torch.full((n_all,), float("nan"))
    members: list[list[int]] = [[] for _ in range(num_groups)]
    for i, g in enumerate(index.tolist()):
        members[g].append(i)
    entropies, shares = [], []
    unparseable = 0
    for rows in members:
        judged = [i for i in rows if not _is_nan(keys[i])]
        n = len(judged)
        if n == 0:
            continue
        counts = Counter(keys[i] for i in judged if keys[i] is not None)
        for i in judged:
            if keys[i] is None:
                unparseable += 1
                frequency[i], entropy[i] = 0.0, 0.0
                continue
            p = counts[keys[i]] / n
            frequency[i] = p
            entropy[i] = 1.0 + math.log(p) / math.log(n) if n > 1 else 1.0
        parsed = sum(counts.values())
        if parsed:
            entropies.append(-sum(c / parsed * math.log(c / parsed) for c in counts.values()))
        shares.append(max(counts.values(), default=0) / n)
    stats = {"unparseable": float(unparseable)}
    if entropies:
        stats["answer_entropy"] = sum(entropies) / len(entropies)
    if shares:
        stats["majority_share"] = sum(shares) / len(shares)
    return frequency, entropy.clamp(min=0.0), stats


def _is_nan(key: Any) -> bool:
    return isinstance(key, float) and math.isnan(key)


@register
class TTRV(Variant):
    """TTRV's label-free rewards, in the ``rewards`` stage (VLM policies)::

        a_i = the answer of completion i (the <answer> block; ``match`` says when two answers are one vote)
        ttrv_frequency_i = p(a_i)                       weight 1
        ttrv_entropy_i   = 1 + log p(a_i) / log n       weight ``entropy_weight``

    with ``p`` the empirical distribution of the answers in sample i's group of ``n`` (:func:`ttrv_rewards`). The
    abstract's rules: rewards "based on the frequency of the base model's output, while inferring on each test sample
    multiple times", and "rewarding the model for obtaining low entropy of the output empirical distribution". The
    frequency reward is that rule; the per-sample split of the entropy reward (the group's mean of ``ttrv_entropy`` is
    ``1 - H(p) / log n``), the normalisation and the weight are mmrl's, not a claim of parity with the paper's code.

    An unparseable answer (no ``<answer>`` block, no choice letter, no number) casts no vote and scores 0 in both
    rewards, but counts in ``n`` (it dilutes the group's frequencies); it is counted in ``ttrv/unparseable``. A
    sample whose metadata ``choices`` cannot be used (``match: choice``) is NaN in both and left out of its group.
    The configured rewards stay as logged components (weight 0) unless ``keep_weights``. Stats: ``ttrv/answer_entropy``
    (mean group entropy of the parsed answers, nats), ``ttrv/majority_share``, ``ttrv/unparseable``.
    """

    name = "ttrv"
    summary = "label-free rewards: each answer's frequency in its group plus a low-entropy reward for the group"
    paper = ("TTRV: Test-Time Reinforcement Learning for Vision Language Models, Singh et al. 2025, arXiv 2510.06783; "
             "the per-sample entropy split and weights are mmrl's")
    Options = TTRVOptions
    families = ("vlm",)

    def rewards(self, ctx: RewardContext) -> Rewards:
        from mmrl.rewards._text import Unjudgeable, Unparseable

        o, r = self.options, ctx.rollout
        metadata = list(r.metadata) if getattr(r, "metadata", None) is not None else [{}] * len(r.completions)
        keys: list[Any] = []
        for text, meta in zip(r.completions, metadata):
            try:
                keys.append(answer_key(text, meta, o.match, o.require_tags))
            except Unparseable:
                keys.append(None)
            except Unjudgeable:
                keys.append(float("nan"))
        frequency, entropy, stats = ttrv_rewards(keys, r.group_ids)
        for key, value in stats.items():
            name = f"{self.name}/{key}"
            ctx.stats[name] = ctx.stats.get(name, 0.0) + value if key == "unparseable" else value
        weights = dict(ctx.weights) if o.keep_weights else {}
        weights[FREQUENCY] = 1.0
        if o.entropy_weight > 0:
            weights[ENTROPY] = float(o.entropy_weight)
        return Rewards({**ctx.scores, FREQUENCY: frequency, ENTROPY: entropy}, weights)
