"""Contrastive rewards: each reward minus the mean reward of offline baseline responses to the same prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmrl.algorithms.base import RewardContext, Rewards, Variant, option, register

ON_MISSING = ("error", "nan")


def reference_rewards(ctx: RewardContext, field: str, reward: str, *, on_missing: str,
                      variant: str) -> list[Tensor | None]:
    """For each sample of ``ctx.rollout``, the ``reward`` component of the responses its metadata lists under
    ``field`` (a text or a list of texts), scored with ``ctx.score_outputs`` under the sample's own prompt and
    metadata; each distinct (group, prompt, response) is scored once. ``None`` for a sample without any (an error
    unless ``on_missing='nan'``)."""
    r = ctx.rollout
    group_ids = r.group_ids.tolist() if isinstance(r.group_ids, Tensor) else list(r.group_ids)
    wanted: dict[tuple[Any, str, str], int] = {}
    texts: list[str] = []
    prompts: list[str] = []
    metadata: list[dict] = []
    per_sample: list[list[int] | None] = []
    for i, (prompt, meta) in enumerate(zip(r.prompts, r.metadata)):
        refs = (meta or {}).get(field)
        if isinstance(refs, str):
            refs = [refs]
        if not refs or not all(isinstance(t, str) for t in refs):
            if on_missing == "error":
                raise ValueError(f"variant {variant!r}: sample {i} (prompt {prompt!r}) has no metadata[{field!r}] "
                                 f"(a response text or a list of them), got {refs!r}; add it to the data or set "
                                 f"on_missing: nan")
            per_sample.append(None)
            continue
        slots = []
        for text in refs:
            key = (group_ids[i], prompt, text)
            if key not in wanted:
                wanted[key] = len(texts)
                texts.append(text)
                prompts.append(prompt)
                metadata.append(meta)
            slots.append(wanted[key])
        per_sample.append(slots)
    scored = ctx.score_outputs(texts, prompts, metadata)[reward].float() if texts else torch.zeros(0)
    return [None if slots is None else scored[slots] for slots in per_sample]


@dataclass
class ContrastiveBaselineOptions:
    reward: str = option("", "The component (a key of `rewards`) that becomes contrastive: R - mean R(baselines) "
                             "(contrastive rewards, Shen et al. 2024, arXiv 2403.07708).")
    field: str = option("baseline_responses", "The data item's metadata key holding the offline baseline responses "
                                              "to its prompt: a list of response texts (one text also works).")
    on_missing: str = option("error", "A sample whose metadata has no baseline responses: 'error' stops, 'nan' gives "
                                      "it a NaN reward (left out of the statistics, advantage 0).")

    def validate(self) -> None:
        check_reference_options(self, "the component to make contrastive (e.g. preference)",
                                "the metadata key of the baseline responses")


def check_reference_options(options, reward: str, field: str) -> None:
    """The options every variant scoring responses from the data shares: ``reward``, ``field``, ``on_missing``."""
    if not options.reward:
        raise ValueError(f"reward: name {reward}")
    if not options.field:
        raise ValueError(f"field: name {field}")
    if options.on_missing not in ON_MISSING:
        raise ValueError(f"on_missing must be one of {ON_MISSING}, got {options.on_missing!r}")


@register
class ContrastiveBaseline(Variant):
    """Contrastive rewards: the chosen component minus the mean reward of the prompt's offline baseline responses::

        R'_i = R_i - (1/K) sum_k R(x_i, b_k)     b_1..b_K = metadata[field] of sample i's data item

    Data: every item's metadata carries ``baseline_responses`` (``field``): a list of response texts sampled offline
    (the paper: from the SFT policy) for that prompt. They are scored with the run's reward
    (``ctx.score_outputs``, under the sample's prompt and metadata, each distinct text of a group once); a baseline
    whose score is NaN is left out of the mean, and if all are NaN ``R'`` is NaN. The raw component is kept (logged
    only) as ``<reward>_raw`` and the baselines' mean reward as ``<reward>_baseline``; the stats get
    ``contrastive_baseline/baseline_reward``.

    Note: the baseline is one constant per prompt, so under plain group normalisation (``algorithm.scale`` group or
    none, the per-prompt mean subtracted) the advantages do not change; it matters where the absolute reward counts
    (``algorithm.scale=batch``: the batch std; value-anchored, virtual-sample or median estimators; several
    components combined with other weights per prompt), as in the paper's PPO. VLM policies only (baselines are
    texts).
    """

    name = "contrastive_baseline"
    summary = "reward minus the mean reward of the prompt's offline baseline responses (metadata baseline_responses)"
    paper = ("Improving Reinforcement Learning from Human Feedback Using Contrastive Rewards, Shen et al. 2024, "
             "arXiv 2403.07708")
    Options = ContrastiveBaselineOptions
    families = ("vlm",)

    def check(self, config) -> None:
        self.require_reward(config, "reward")

    def rewards(self, ctx: RewardContext) -> Rewards:
        o = self.options
        raw = ctx.scores[o.reward].float()
        if raw.dim() != 1:
            raise ValueError(f"variant 'contrastive_baseline': {o.reward!r} must be one reward per sample, got shape "
                             f"{tuple(raw.shape)}")
        refs = reference_rewards(ctx, o.field, o.reward, on_missing=o.on_missing, variant=self.name)
        baseline = torch.stack([torch.tensor(float("nan")) if x is None else torch.nanmean(x) for x in refs])
        shaped = raw - baseline
        finite = baseline[torch.isfinite(baseline)]
        if finite.numel():
            ctx.stats[f"{self.name}/baseline_reward"] = float(finite.mean())
        scores = {**ctx.scores, o.reward: shaped, f"{o.reward}_raw": raw, f"{o.reward}_baseline": baseline}
        return Rewards(scores, dict(ctx.weights))
