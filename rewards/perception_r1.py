"""``perception_r1``: Perception-R1's visual perception reward (Xiao et al. 2025, "Advancing Multimodal Reasoning
Capabilities of MLLMs via Visual Perception Reward", arXiv:2506.07218).

The paper: textual *visual annotations* are collected from CoT trajectories of each training problem and serve
as visual references; during RLVR a judging LLM assesses the consistency between the annotations and the
policy's response, and the visual perception reward is assigned from these consistency judgments.

mmrl's rule (the abstract gives no formula; no parity claim with the paper's code): a FROZEN Qwen-VL judge sees
the image, the response and ONE annotation at a time and is asked whether the response is consistent with it::

    p_k   = P(yes | image, template(response, annotation_k))        k = 1..K annotations
    score = mean_k p_k                  (threshold=None: soft)
    score = mean_k [p_k >= threshold]   (threshold=t: the fraction of annotations judged consistent)

Extra keys: ``consistent`` (the fraction with ``p_k >= 0.5``, the hard count at the default threshold, whatever
``threshold`` is) and ``num_annotations`` (K). Differences from the paper: the judge here is a VLM that also
sees the image (the paper's judge reads text only), and the judgment is a yes-probability, not a sampled text.
Differences from its released code (tongxiao2002/Perception-R1, ``verl/utils/reward_score/math_with_visual.py``):
there one text-only call asks whether each key item is *present* in the response ("not on its correctness"),
the score is the items judged present over the items, and the trainer adds ``visual_reward_factor x`` it to
accuracy + 0.1 x format; here each annotation is asked for *consistency* (the abstract's word) in its own call, and
the reward is a component you weight in ``rewards``. Its data's ``<info1>...</info1><info2>...</info2>`` string is
read as one annotation per item (:func:`mmrl.rewards._judge.annotation_list`).

Metadata: the image (see :mod:`mmrl.rewards._judge`) and ``visual_annotations`` (``annotation_key``): a string
(``<infoK>`` items split), or a list of strings. A sample without either is NaN; an empty response (or a missing block, with ``part``) is a
counted 0. The question (``{question}``) is the sample's prompt when given.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import torch

from ._base import register_reward
from ._judge import Ask, JudgedReward, annotation_list, bullets, check_part, check_template, fill, response_part
from .vlm_judge import DEFAULT_JUDGE, NO_WORDS, YES_WORDS

__all__ = ["PerceptionR1", "perception_score", "DEFAULT_PERCEPTION_TEMPLATE"]

DEFAULT_PERCEPTION_TEMPLATE = (
    "You check whether a model's response perceives this image correctly.\n"
    "Visual fact about the image: {annotation}\n"
    "Model's response:\n{response}\n\n"
    "Is the response consistent with this visual fact (it states or agrees with it and never contradicts it)? "
    "Answer yes or no."
)
PERCEPTION_PLACEHOLDERS = ("annotation", "annotations", "response", "question")


def perception_score(p_yes: Sequence[float], threshold: float | None = None) -> dict[str, float]:
    """The rule above on the per-annotation yes-probabilities: ``{"score", "consistent", "num_annotations"}``."""
    p = [float(x) for x in p_yes]
    if not p:
        raise ValueError("no annotations to judge")
    judged = p if threshold is None else [1.0 if x >= threshold else 0.0 for x in p]
    return {"score": sum(judged) / len(p), "consistent": sum(x >= 0.5 for x in p) / len(p),
            "num_annotations": float(len(p))}


@register_reward("perception_r1")
class PerceptionR1(JudgedReward):
    """Perception-R1's visual perception reward on a frozen Qwen-VL judge; see the module docstring."""

    extra_keys = ("consistent", "num_annotations")

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module = DEFAULT_JUDGE,
        processor: Any = None,
        template: str = DEFAULT_PERCEPTION_TEMPLATE,
        annotation_key: str = "visual_annotations",
        part: str = "all",
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
            :class:`~mmrl.rewards.vlm_judge.VLMJudge` (a checkpoint name shares one loaded model across rewards).
        template: the yes/no question per annotation. Placeholders: ``{annotation}`` (this annotation),
            ``{annotations}`` (all of the sample's, one ``- `` line each), ``{response}`` (the judged part of the
            response), ``{question}`` (the prompt, or empty), ``{meta[field]}``.
        annotation_key: the metadata field holding the visual annotations.
        part: which part of the response is judged: ``"all"`` (default), ``"think"``, ``"answer"``,
            ``"answer_or_all"``, ``"think_or_all"``.
        threshold: None (soft mean of P(yes)) or a probability: the fraction with ``P(yes) >= threshold``.
        batch_size: judge queries per forward (all samples' annotations are batched together).
        media_root: folder that relative image paths in the metadata are read from.
        """
        super().__init__(model=model, processor=processor, device=device, dtype=dtype, batch_size=batch_size,
                         system_prompt=system_prompt, min_pixels=min_pixels, max_pixels=max_pixels,
                         yes_words=yes_words, no_words=no_words, media_root=media_root)
        self.template = check_template(template, PERCEPTION_PLACEHOLDERS, "template")
        self.annotation_key = str(annotation_key)
        self.part = check_part(part)
        if threshold is not None and not 0.0 < float(threshold) < 1.0:
            raise ValueError(f"threshold must be None or in (0, 1), got {threshold}")
        self.threshold = None if threshold is None else float(threshold)

    def _plan(self, text: str, prompt: str | None, meta: Mapping, record: list):
        images = self.media.images(meta, self.name)
        annotations = annotation_list(meta, self.annotation_key, self.name)
        response = response_part(text, self.part)
        asks = [Ask(images + [fill(self.template, meta, annotation=a, annotations=bullets(annotations),
                                   response=response, question=prompt or "")], label=a) for a in annotations]
        p_yes = yield asks
        result = perception_score(p_yes, self.threshold)
        return {self.name: result.pop("score"), **result}
