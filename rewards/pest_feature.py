"""``pest_feature``: Pest-Thinker's feature reward: does the response reason from observable (morphological)
evidence?

The paper (Pest-Thinker): GRPO with a feature reward that guides the model to focus on observable morphological
evidence, assessed by an LLM-as-a-Judge; the benchmarks carry expert-annotated morphological traits.

mmrl's rule (the abstract gives no formula; no parity claim). A FROZEN Qwen-VL judge sees the image and the
response's reasoning:

* the sample has annotated traits (``features``, a string or a list): one yes/no question per trait, "does the
  response cite this trait as evidence, as it is visible in the image?"::

      score = mean_k P(yes | image, template(reasoning, feature_k))

* it has none: one question, "does the reasoning rest on specific features observable in the image (not generic
  knowledge)?"::

      score = P(yes | image, open_template(reasoning))

``threshold`` (optional) turns each P(yes) into 0/1 first. Extra keys: ``num_features`` (0 for the open
question) and ``cited`` (the fraction of questions with ``P(yes) >= 0.5``). The reasoning is the ``<think>``
block, or the whole response when it has no think tag (``part``). Metadata: the image (required: NaN without).
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import torch

from ._base import register_reward
from ._judge import Ask, JudgedReward, annotation_list, bullets, check_part, check_template, fill, response_part
from .vlm_judge import DEFAULT_JUDGE, NO_WORDS, YES_WORDS

__all__ = ["PestFeature", "feature_score", "DEFAULT_FEATURE_TEMPLATE", "DEFAULT_OPEN_FEATURE_TEMPLATE"]

DEFAULT_FEATURE_TEMPLATE = (
    "An expert annotated this morphological feature of the specimen in the image: {feature}\n"
    "Model's reasoning:\n{response}\n\n"
    "Does the reasoning cite this feature as evidence, described the way it is visible in the image? "
    "Answer yes or no."
)
DEFAULT_OPEN_FEATURE_TEMPLATE = (
    "Model's reasoning about the image:\n{response}\n\n"
    "Does the reasoning rest on specific features that can be observed in this image (shape, colour, markings, "
    "body parts), rather than on generic knowledge or guesses? Answer yes or no."
)
FEATURE_PLACEHOLDERS = ("feature", "features", "response", "question")
OPEN_PLACEHOLDERS = ("response", "question")


def feature_score(p_yes: Sequence[float], threshold: float | None = None) -> dict[str, float]:
    """``{"score": mean of P(yes) (or of [P(yes) >= threshold]), "cited": fraction with P(yes) >= 0.5}``."""
    p = [float(x) for x in p_yes]
    if not p:
        raise ValueError("no judge answers")
    judged = p if threshold is None else [1.0 if x >= threshold else 0.0 for x in p]
    return {"score": sum(judged) / len(p), "cited": sum(x >= 0.5 for x in p) / len(p)}


@register_reward("pest_feature")
class PestFeature(JudgedReward):
    """Pest-Thinker's feature reward on a frozen Qwen-VL judge; see the module docstring."""

    extra_keys = ("num_features", "cited")

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module = DEFAULT_JUDGE,
        processor: Any = None,
        template: str = DEFAULT_FEATURE_TEMPLATE,
        open_template: str = DEFAULT_OPEN_FEATURE_TEMPLATE,
        feature_key: str = "features",
        require_features: bool = False,
        part: str = "think_or_all",
        threshold: float | None = None,
        system_prompt: str | None = None,
        yes_words: Sequence[str] = YES_WORDS,
        no_words: Sequence[str] = NO_WORDS,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 8,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        media_root: str | os.PathLike | None = None,
    ):
        """Args:
        model, processor, system_prompt, yes_words, no_words, device, dtype, min_pixels, max_pixels: the judge, as
            :class:`~mmrl.rewards.vlm_judge.VLMJudge`.
        template: the per-trait question. Placeholders ``{feature}``, ``{features}`` (all, ``- `` lines),
            ``{response}`` (the judged part), ``{question}``, ``{meta[field]}``.
        open_template: the question without traits: ``{response}``, ``{question}``, ``{meta[field]}``.
        feature_key: the metadata field with the annotated traits.
        require_features: a sample without traits is NaN instead of getting the open question.
        part: the judged part of the response (default the ``<think>`` block, or all of a tag-free response).
        threshold: None (soft) or a probability each P(yes) is thresholded at.
        batch_size: judge queries per forward. media_root: folder for relative image paths.
        """
        super().__init__(model=model, processor=processor, device=device, dtype=dtype, batch_size=batch_size,
                         system_prompt=system_prompt, min_pixels=min_pixels, max_pixels=max_pixels,
                         yes_words=yes_words, no_words=no_words, media_root=media_root)
        self.template = check_template(template, FEATURE_PLACEHOLDERS, "template")
        self.open_template = check_template(open_template, OPEN_PLACEHOLDERS, "open_template")
        self.feature_key = str(feature_key)
        self.require_features = bool(require_features)
        self.part = check_part(part)
        if threshold is not None and not 0.0 < float(threshold) < 1.0:
            raise ValueError(f"threshold must be None or in (0, 1), got {threshold}")
        self.threshold = None if threshold is None else float(threshold)

    def _plan(self, text: str, prompt: str | None, meta: Mapping, record: list):
        images = self.media.images(meta, self.name)
        features = annotation_list(meta, self.feature_key, self.name, required=self.require_features)
        response = response_part(text, self.part)
        if features:
            asks = [Ask(images + [fill(self.template, meta, feature=f, features=bullets(features), response=response,
                                       question=prompt or "")], label=f) for f in features]
        else:
            asks = [Ask(images + [fill(self.open_template, meta, response=response, question=prompt or "")],
                        label="observable evidence")]
        p_yes = yield asks
        result = feature_score(p_yes, self.threshold)
        return {self.name: result.pop("score"), "num_features": float(len(features)), **result}
