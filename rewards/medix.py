"""``medix_composite``: MediX-R1's composite reward for open-ended (medical) answers.

The paper (MediX-R1): Group-Based RL with a composite reward: an LLM-based accuracy reward that judges semantic
correctness with a strict YES/NO decision, a medical embedding-based semantic reward that captures paraphrases
and terminology variants, and lightweight format and modality rewards.

mmrl's rule (the abstract gives the parts, not their formulas or weights; no parity claim with the released
``training/examples/reward_function/medical.py``, which differs: ``0.9 x (0.575 llm + 0.375 embed + 0.05 modality)
+ 0.1 format``, a MedEmbed-large-v0.1 embedding with a binary ``cos >= 0.8``, ``<thinking>`` tags after a modality
tag, an exact-match shortcut, answers and references stripped of ``.`` and of spaces around ``<`` ``>`` ``/``,
empty, one-character or ``: ? __``-holding answers scored 0, and a tag-free response read whole)::

    answer    = the <answer> block (require_tags=True), or the whole response when it has no answer tag
    p_yes     = P(yes | image, template(question, answer, reference))     a FROZEN Qwen-VL judge
    accuracy  = 1 if p_yes >= 0.5 else 0                                  the strict YES/NO decision
    semantic  = max(0, cos(e(answer), e(reference)))                      (or [cos >= semantic_threshold])
    format    = think_answer_format(response)                             1 for <think>..</think><answer>..</answer>
    score     = (a * accuracy + s * semantic + f * format) / (a + s + f)  weights accuracy/semantic/format_weight

``e(.)`` is an embedding from the JUDGE MODEL ITSELF, not a medical embedder: ``embedding="last_hidden"``
(default) mean-pools its language model's final hidden states (after the final RMSNorm) over the text's tokens,
the text run alone (no chat template, no image); ``"input"`` mean-pools its input token embeddings. Pooled LLM
states are anisotropic (unrelated texts often have cosines well above 0), so the semantic part is a weak signal
unless ``semantic_threshold`` is set or a real embedder's judge is used. The modality reward of the paper is not
implemented (no modality field in mmrl's data).

Extra keys: ``accuracy``, ``semantic``, ``format``, ``p_yes``. The image is shown to the judge when the sample
has one (metadata ``image``..., see :mod:`mmrl.rewards._judge`); a text-only sample is judged on text. Metadata:
``solution`` (``reference_key``), required (NaN without). A response without a readable answer scores 0
(counted), with ``format`` 0.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import torch

from ._base import register_reward
from ._judge import Ask, Embed, JudgedReward, check_template, cosine, fill
from ._text import Unjudgeable, Unparseable, answer_or_text, require, think_answer_format
from .vlm_judge import DEFAULT_JUDGE, NO_WORDS, YES_WORDS

__all__ = ["MediXComposite", "medix_score", "DEFAULT_MEDIX_TEMPLATE"]

DEFAULT_MEDIX_TEMPLATE = (
    "You are a strict medical grader.\n"
    "Question: {question}\n"
    "Reference answer: {reference}\n"
    "Candidate answer: {answer}\n\n"
    "Does the candidate answer mean the same as the reference answer (same diagnosis, finding or value; "
    "paraphrases and synonyms count, partial or hedged answers do not)? Answer strictly yes or no."
)
MEDIX_PLACEHOLDERS = ("question", "answer", "reference", "response")


def medix_score(p_yes: float, cos: float, fmt: float, *, accuracy_weight: float = 1.0, semantic_weight: float = 1.0,
                format_weight: float = 0.5, semantic_threshold: float | None = None) -> dict[str, float]:
    """The composite rule above: ``{"score", "accuracy", "semantic", "format", "p_yes"}``."""
    accuracy = 1.0 if p_yes >= 0.5 else 0.0
    semantic = (1.0 if cos >= semantic_threshold else 0.0) if semantic_threshold is not None else max(0.0, cos)
    total = accuracy_weight + semantic_weight + format_weight
    score = (accuracy_weight * accuracy + semantic_weight * semantic + format_weight * fmt) / total
    return {"score": score, "accuracy": accuracy, "semantic": semantic, "format": float(fmt), "p_yes": float(p_yes)}


@register_reward("medix_composite")
class MediXComposite(JudgedReward):
    """MediX-R1's composite (strict judge accuracy + judge-embedding similarity + format); see the module
    docstring for the rule."""

    extra_keys = ("accuracy", "semantic", "format", "p_yes")

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module = DEFAULT_JUDGE,
        processor: Any = None,
        template: str = DEFAULT_MEDIX_TEMPLATE,
        accuracy_weight: float = 1.0,
        semantic_weight: float = 1.0,
        format_weight: float = 0.5,
        semantic_threshold: float | None = None,
        embedding: str = "last_hidden",
        require_tags: bool = True,
        use_image: bool = True,
        reference_key: str = "solution",
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
        template: the strict yes/no accuracy question. Placeholders ``{question}`` (the prompt, or empty),
            ``{answer}``, ``{reference}``, ``{response}`` (the whole response), ``{meta[field]}``.
        accuracy_weight, semantic_weight, format_weight: the parts' weights (>= 0, not all 0); the score is
            their weighted mean.
        semantic_threshold: None (the clipped cosine) or a cosine above which the semantic part is 1 (else 0).
        embedding: ``"last_hidden"`` or ``"input"`` (see the module docstring).
        require_tags: the answer must be in ``<answer>`` tags (else the whole tag-free response is the answer).
        use_image: show the sample's image to the accuracy judge when it has one.
        reference_key: the metadata field with the reference answer.
        batch_size: judge queries per forward. media_root: folder for relative image paths.
        """
        super().__init__(model=model, processor=processor, device=device, dtype=dtype, batch_size=batch_size,
                         system_prompt=system_prompt, min_pixels=min_pixels, max_pixels=max_pixels,
                         yes_words=yes_words, no_words=no_words, media_root=media_root, embedding=embedding)
        self.template = check_template(template, MEDIX_PLACEHOLDERS, "template")
        weights = (float(accuracy_weight), float(semantic_weight), float(format_weight))
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"the weights must be >= 0 and not all 0, got {weights}")
        self.accuracy_weight, self.semantic_weight, self.format_weight = weights
        self.semantic_threshold = None if semantic_threshold is None else float(semantic_threshold)
        self.require_tags = bool(require_tags)
        self.use_image = bool(use_image)
        self.reference_key = str(reference_key)

    def _plan(self, text: str, prompt: str | None, meta: Mapping, record: list):
        reference = require(meta, self.reference_key, self.name)
        if isinstance(reference, (int, float)) and not isinstance(reference, bool):
            reference = str(reference)
        if not isinstance(reference, str) or not reference.strip():
            raise Unjudgeable(f"metadata {self.reference_key!r} is not a non-empty answer")
        reference = reference.strip()
        images = []
        if self.use_image and any(meta.get(k) is not None for k in ("image", "image_path", "images", "image_paths")):
            images = self.media.images(meta, self.name)
        fmt = think_answer_format(text)
        try:
            answer = answer_or_text(text, self.require_tags)
        except Unparseable as exc:
            raise Unparseable(exc.reason, extras={"format": fmt, "accuracy": 0.0, "semantic": 0.0}) from None
        question = fill(self.template, meta, question=prompt or "", answer=answer, reference=reference,
                        response=text.strip())
        p_yes, e_answer, e_reference = yield [Ask(images + [question], label="accuracy"),
                                              Embed(answer, label="answer"), Embed(reference, label="reference")]
        result = medix_score(p_yes, cosine(e_answer, e_reference), fmt, accuracy_weight=self.accuracy_weight,
                             semantic_weight=self.semantic_weight, format_weight=self.format_weight,
                             semantic_threshold=self.semantic_threshold)
        return {self.name: result.pop("score"), **result}
