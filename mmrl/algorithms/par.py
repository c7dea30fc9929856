"""PAR (Preference As Reward): the reward shaped as sigmoid(r - r_ref) against a reference response's reward."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import RewardContext, Rewards, Variant, option, register
from mmrl.algorithms.contrastive_baseline import check_reference_options, reference_rewards


@dataclass
class PAROptions:
    reward: str = option("", "The component (a key of `rewards`, e.g. a reward model's score) that PAR shapes into "
                             "sigmoid(r - r_ref) (Fu et al. 2025, arXiv 2502.18770).")
    field: str = option("reference_response", "The data item's metadata key holding the reference response to its "
                                              "prompt: one text, or a list of texts (PAR then averages the sigmoids "
                                              "over the references; the paper finds one enough).")
    on_missing: str = option("error", "A sample whose metadata has no reference response: 'error' stops, 'nan' gives "
                                      "it a NaN reward (left out of the statistics, advantage 0).")

    def validate(self) -> None:
        check_reference_options(self, "the component to shape (e.g. the reward model's score)",
                                "the metadata key of the reference response")


@register
class PAR(Variant):
    """Preference As Reward: the reward model's implied preference of the response over a reference one::

        R'_i = (1/M) sum_m sigmoid(R_i - R(x_i, ref_m))     ref_1..ref_M = metadata[field] of sample i's data item

    (``M = 1`` for a single ``reference_response`` text: ``sigmoid(R_i - R_ref)``, bounded in (0, 1), steepest near
    the reference and saturating far from it, the paper's rule.) The references are scored with the run's reward
    (``ctx.score_outputs``, under the sample's prompt and metadata, each distinct text of a group once); a NaN
    reference reward makes its sigmoid NaN and it is left out of the mean (all NaN: ``R'`` NaN). The raw component
    is kept (logged only) as ``<reward>_raw`` and the references' mean reward as ``<reward>_reference``; the stats get
    ``par/reference_reward``. Data: every item's metadata carries ``reference_response`` (``field``), e.g. the
    dataset's chosen answer or an SFT sample. VLM policies only (references are texts).
    """

    name = "par"
    summary = "reward shaped to sigmoid(r - r_ref) against a reference response's reward (metadata reference_response)"
    paper = "Reward Shaping to Mitigate Reward Hacking in RLHF (PAR), Fu et al. 2025, arXiv 2502.18770"
    Options = PAROptions
    families = ("vlm",)

    def check(self, config) -> None:
        self.require_reward(config, "reward")

    def rewards(self, ctx: RewardContext) -> Rewards:
        o = self.options
        raw = ctx.scores[o.reward].float()
        if raw.dim() != 1:
            raise ValueError(f"variant 'par': {o.reward!r} must be one reward per sample, got shape {tuple(raw.shape)}")
        refs = reference_rewards(ctx, o.field, o.reward, on_missing=o.on_missing, variant=self.name)
        nan = torch.tensor(float("nan"))
        shaped = torch.stack([nan if x is None else torch.nanmean(torch.sigmoid(r - x)) for r, x in zip(raw, refs)])
        reference = torch.stack([nan if x is None else torch.nanmean(x) for x in refs])
        finite = reference[torch.isfinite(reference)]
        if finite.numel():
            ctx.stats[f"{self.name}/reference_reward"] = float(finite.mean())
        scores: dict[str, Tensor] = {**ctx.scores, o.reward: shaped, f"{o.reward}_raw": raw,
                                     f"{o.reward}_reference": reference}
        return Rewards(scores, dict(ctx.weights))
