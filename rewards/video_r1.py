"""Video-R1's answer accuracy, routed by the sample's problem type (Feng et al. 2025, "Video-R1: Reinforcing Video
Reasoning in MLLMs", arXiv 2503.21776; code ``tulerfeng/Video-R1`` ``src/r1-v/src/open_r1/grpo.py``
``accuracy_reward``), the reward its T-GRPO training mixes with the format reward.

Both the completion and the solution are read with Video-R1's ``extract_answer``: the first
``<answer>\\s*(.*?)\\s*</answer>`` (DOTALL), stripped. Then, by metadata ``problem_type``:

* ``"multiple choice"``: 1 if the two answers are the same string (stripped), else 0 (``"B"`` against ``"B."``
  is 0);
* ``"numerical"``: 0 unless both or neither contain a ``.`` or ``,``; then both read as floats with ``,``
  removed, 1 if they agree rounded to 2 decimals;
* ``"OCR"``: ``1 - WER`` (word-level edit distance over the reference's word count, at least 1), clipped to
  [0, 1];
* ``"free-form"``: the mean of ROUGE-1, ROUGE-2 and ROUGE-L F-measures (Google's ``rouge-score``, Porter
  stemmer), clipped to [0, 1];
* ``"regression"``: ``1 - min(1, (|pred - gt| + 1e-9) / (|gt| + 1e-9))``; an answer that is not a number 0.

A value that fails to read (a number that does not parse) scores 0, as the anchor's ``try``/``except``.

mmrl's rules where the anchor's code is silent or batch-bound:

* the problem type is each sample's own (the anchor reads ``problem_type[0]``, the first sample's, for its
  whole batch, which its data loader makes one question's group);
* a completion without an answer block is unparseable (0, counted; the anchor reads an empty answer, which
  scores 0 unless the solution's answer is empty too: then 1 for multiple choice and OCR), and an unknown or missing ``problem_type`` or a missing ``solution`` is NaN with the reason
  (the anchor gives 0 to an unknown type);
* a solution without an answer block is read whole (stripped): Video-R1's data wraps every solution in
  ``<answer>`` tags, where its ``extract_answer`` would give ``""``;
* a ``numerical`` or ``regression`` solution that is not a finite number is NaN with the reason, as the other
  numeric rewards and ``mmrl eval`` treat it (the anchor's ``try``/``except`` gives 0 whatever the answer, so a
  broken label trains the policy away from every answer to that question);
* an answer that reads as a non-finite number (``nan``, ``inf``) is not a number: 0. In the anchor ``float("nan")``
  parses, its relative error is NaN, and ``min(1, max(0, nan))`` returns 0, so ``nan`` scores 1.0 in every
  ``regression`` question, a reward hack a policy finds.

Extra key: none. ``problem_type`` names also accept mmrl's task spellings ``multiple_choice`` and ``numeric``.
"""
from __future__ import annotations

import math
import re
from typing import Mapping

from ._base import register_reward
from ._text import TextReward, Unjudgeable, Unparseable, require

__all__ = ["VideoR1Accuracy", "video_r1_extract_answer", "numerical_match", "word_error_rate", "PROBLEM_TYPES"]

_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
PROBLEM_TYPES = ("multiple choice", "numerical", "OCR", "free-form", "regression")
_ALIASES = {"multiple_choice": "multiple choice", "numeric": "numerical"}


def video_r1_extract_answer(text: str) -> str | None:
    """Video-R1's ``extract_answer``: the first answer block's content, stripped (``None`` where it returns "")."""
    match = _ANSWER.search(text)
    return match.group(1).strip() if match else None


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Video-R1's ``wer``: word-level Levenshtein distance (whitespace-split) over ``max(1, #reference words)``."""
    ref, hyp = reference.split(), hypothesis.split()
    previous = list(range(len(hyp) + 1))
    for i in range(1, len(ref) + 1):
        current = [i] + [0] * len(hyp)
        for j in range(1, len(hyp) + 1):
            current[j] = previous[j - 1] if ref[i - 1] == hyp[j - 1] else \
                1 + min(previous[j], current[j - 1], previous[j - 1])
        previous = current
    return previous[len(hyp)] / max(1, len(ref))


def _number(text: str) -> float | None:
    """The answer as a finite float, else None (mmrl's rule for ``nan`` / ``inf``: see the module docstring)."""
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def numerical_match(gt: str, out: str) -> float:
    """Video-R1's ``numerical`` rule on two answers already read: 0 unless both or neither contain a ``.`` or
    ``,``; then both as floats with ``,`` removed, 1 if they agree rounded to 2 decimals (0 when either is not a
    finite number)."""
    if (("." in gt) or ("," in gt)) != (("." in out) or ("," in out)):
        return 0.0
    a, b = _number(gt), _number(out)
    return 1.0 if a is not None and b is not None and round(a, 2) == round(b, 2) else 0.0


@register_reward("video_r1_accuracy")
class VideoR1Accuracy(TextReward):
    """Video-R1's accuracy reward by ``problem_type`` (see the module docstring). No keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self._rouge = None

    def _rouge_mean(self, reference: str, hypothesis: str) -> float:
        if self._rouge is None:
            try:
                from rouge_score import rouge_scorer
            except ImportError as exc:  # a dependency of mmrl; a broken environment gets a clear reason
                raise Unjudgeable("free-form answers need the rouge-score package (pip install rouge-score)") \
                    from exc
            self._rouge = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
        scores = self._rouge.score(reference, hypothesis)
        return (scores["rouge1"].fmeasure + scores["rouge2"].fmeasure + scores["rougeL"].fmeasure) / 3

    def _score_one(self, text: str, prompt: str | None, meta: Mapping) -> float:
        kind = require(meta, "problem_type", self.name)
        kind = _ALIASES.get(kind, kind)
        if kind not in PROBLEM_TYPES:
            raise Unjudgeable(f"metadata 'problem_type' {meta.get('problem_type')!r} is not one of "
                              f"{', '.join(PROBLEM_TYPES)}")
        solution = str(require(meta, "solution", self.name))
        gt = video_r1_extract_answer(solution)
        gt = solution.strip() if gt is None else gt
        out = video_r1_extract_answer(text)
        if out is None:
            raise Unparseable("no <answer>...</answer> block")
        if kind == "multiple choice":
            return 1.0 if out == gt else 0.0
        if kind in ("numerical", "regression") and _number(gt) is None:  # the label, not the answer, is broken
            raise Unjudgeable(f"metadata 'solution' {gt!r} is not a number ({kind} question)")
        if kind == "numerical":
            return numerical_match(gt, out)
        if kind == "OCR":
            return max(0.0, min(1.0, 1.0 - word_error_rate(gt, out)))
        if kind == "free-form":
            return max(0.0, min(1.0, self._rouge_mean(gt, out)))
        a, b = _number(gt), _number(out)  # regression
        if a is None or b is None:
            return 0.0
        return 1.0 - min(1.0, max(0.0, (abs(b - a) + 1e-9) / (abs(a) + 1e-9)))
