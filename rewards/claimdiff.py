"""``claimdiff``: ClaimDiff-RL's reference-conditioned atomic claim differences as a caption reward.

The paper (ClaimDiff-RL; long-form image captioning): given an image, an actor caption and a reference caption, a
multimodal judge enumerates visually grounded differences, verifies each difference against the image, assigns
open-vocabulary error types and severity levels, and produces per-difference statistics for reward composition,
so hallucinated claims and omitted salient facts are measured, and tuned, separately.

mmrl's rule (the abstract gives no formula; no parity claim with the released code, ltl3A87/ClaimDiff-RL
``utils_caption_diff.py``, whose ``hall_vs_miss`` score is ``1 - (#false verifications + #missing facts) / #differences``
(normalised by the differences; missing facts counted without checking the image; severity weights 1 / 1.25 / 1.6,
off by default) and whose difference blocks are ``[DIFFERENCE N]`` sections; mmrl's normalisation ``1 / (1 + H +
M)``, its severity scale and its line format are its own), ``differences="judge"`` (default), two judge stages
on a FROZEN Qwen-VL:

1. the judge sees the image, the reference caption and the policy's caption and writes the differences, one per
   line, ``KIND | error type | severity | claim`` with KIND ``HALLUCINATED`` (the policy states it, the reference
   does not) or ``MISSING`` (the reference states it, the policy does not), or ``NONE`` (greedy decoding,
   ``diff_template``); lines in another form are ignored (kept in ``last_info``); an output with no difference
   line and no ``NONE`` is the judge's failure: NaN;
2. each claim is verified against the image: ``p_d = P(yes | image, verify_template(claim))`` ("is it true of the
   image?"). A hallucination counts as far as the image refutes it, a missing fact as far as the image confirms
   it (the reference can be wrong too)::

       H = sum_{d hallucinated} w(severity_d) * (1 - p_d)
       M = sum_{d missing}      w(severity_d) * p_d
       score = 1 / (1 + hallucination_weight * H + missing_weight * M)        in (0, 1], 1 = no difference

   ``w`` is ``severity_weights`` (lower-cased; an unknown severity weighs ``default_severity``). With
   ``verify=False`` stage 2 is skipped and every listed difference counts fully (``p_d`` = 0 for a hallucination,
   1 for a missing fact).

``differences="split"`` (mmrl's, no generation: for judges that cannot follow the listing format): both captions
are split into sentences (atomic claims, at most ``max_claims`` each); ``H = sum_{c in caption} (1 - P(c is true
of the image))`` and ``M = sum_{r in reference} P(r is true of the image) * (1 - P(the caption states r))``
(``verify_template``, ``cover_template``), severity 1; the same ``score``.

Spans (for token-level credit, e.g. ``algorithm.variants: [{name: perceval, claims: <this component>}]``): the
reward reports, per response, the characters of the claims it found hallucinated, a hallucinated difference or a
caption sentence the image refutes more than it confirms (``p_d < 0.5``), located in the response by a
case-insensitive search of the claim's text (a judge that paraphrases a claim leaves it unlocated: no span;
``last_info["judge"]`` records located / unlocated). mmrl's rule: the paper scores differences, not spans.

Extra keys (scored apart, as the paper's point is): ``hallucinated`` (H), ``missing`` (M) and
``num_differences`` (differences listed, or claims checked in split mode). Metadata: the image and the
reference caption (``reference_key``, default ``solution``). The caption judged is the ``<answer>`` block, or the
whole response when it has no answer tag (``part``).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ._base import register_reward
from ._judge import Ask, Generate, JudgedReward, check_part, check_template, fill, response_part
from ._text import Unjudgeable, Unparseable, require
from .vlm_judge import DEFAULT_JUDGE, NO_WORDS, YES_WORDS

__all__ = ["ClaimDiff", "Difference", "parse_differences", "split_claims", "claimdiff_score", "claim_spans",
           "DEFAULT_DIFF_TEMPLATE", "DEFAULT_VERIFY_TEMPLATE", "DEFAULT_COVER_TEMPLATE", "SEVERITY_WEIGHTS"]

DEFAULT_DIFF_TEMPLATE = (
    "Compare a candidate caption of this image with a reference caption.\n"
    "Reference caption: {reference}\n"
    "Candidate caption: {caption}\n\n"
    "List every visual claim on which the two captions differ, one per line, as\n"
    "HALLUCINATED | <error type> | <minor, major or critical> | <the candidate's claim>\n"
    "for a claim the candidate makes and the reference does not, or\n"
    "MISSING | <error type> | <minor, major or critical> | <the reference's claim>\n"
    "for a claim the reference makes and the candidate leaves out. The error type is a short label of your own "
    "(object, count, color, position, text, action, ...). Write NONE if they do not differ."
)
DEFAULT_VERIFY_TEMPLATE = "Look at the image. Is this statement true of the image: {claim}? Answer yes or no."
DEFAULT_COVER_TEMPLATE = (
    "Caption: {caption}\n\nDoes the caption state or clearly imply the following fact: {claim}? Answer yes or no."
)
SEVERITY_WEIGHTS = {"minor": 0.5, "major": 1.0, "critical": 2.0}
DIFF_PLACEHOLDERS = ("caption", "reference", "question")
VERIFY_PLACEHOLDERS = ("claim", "caption", "reference", "question")

_KINDS = {"hallucinated": "hallucinated", "hallucination": "hallucinated", "extra": "hallucinated",
          "missing": "missing", "omitted": "missing", "omission": "missing"}
_LINE = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)])?\s*\**\s*([A-Za-z]+)\s*\**\s*\|(.*)$")
_NONE = re.compile(r"^\s*\**\s*none\s*[.!]?\s*\**\s*[.!]?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Difference:
    kind: str  # "hallucinated" | "missing"
    error_type: str
    severity: str
    claim: str


def parse_differences(text: str) -> list[Difference] | None:
    """The difference lines of the judge's listing, in order; ``[]`` for ``NONE``; None when neither is there.

    A line is ``KIND | type | severity | claim`` (``KIND | severity | claim`` is accepted with an empty type);
    KIND is HALLUCINATED/HALLUCINATION/EXTRA or MISSING/OMITTED/OMISSION (any case; a leading bullet or number
    and markdown bold are ignored). A NONE line counts only when no difference line is found."""
    found: list[Difference] = []
    none = False
    for line in str(text).splitlines():
        if _NONE.match(line):
            none = True
            continue
        match = _LINE.match(line)
        if match is None or match.group(1).lower() not in _KINDS:
            continue
        fields = [f.strip().strip("*").strip() for f in match.group(2).split("|")]
        if len(fields) >= 3:
            error_type, severity, claim = fields[0], fields[1], " | ".join(fields[2:])
        elif len(fields) == 2:
            error_type, severity, claim = "", fields[0], fields[1]
        else:
            continue
        if claim:
            found.append(Difference(_KINDS[match.group(1).lower()], error_type, severity.lower(), claim))
    if found:
        return found
    return [] if none else None


_SENTENCE = re.compile(r"(?<=[.!?;])\s+|\n+")


def split_claims(text: str, max_claims: int) -> list[str]:
    """Sentences of ``text`` (split after ``. ! ? ;`` and at line breaks; bullets stripped), at most ``max_claims``,
    duplicates dropped."""
    claims = []
    for piece in _SENTENCE.split(str(text)):
        piece = re.sub(r"^\s*(?:[-*\u2022]|\d+[.)])\s*", "", piece).strip()
        if len(re.sub(r"\W", "", piece)) >= 2 and piece not in claims:
            claims.append(piece)
    return claims[:max_claims]


def claim_spans(text: str, caption: str, claims: Sequence[str]) -> tuple[list[tuple[int, int]], int]:
    """Character spans of ``text`` where each claim is written in ``caption`` (itself the first occurrence of the
    caption in ``text``), found case-insensitively without its final punctuation; ``(spans, unlocated count)``."""
    base = max(text.find(caption), 0)
    lowered = caption.lower()
    spans, missing = [], 0
    for claim in claims:
        needle = claim.strip().rstrip(".!?;").strip().lower()
        at = lowered.find(needle) if needle else -1
        if at < 0:
            missing += 1
        else:
            spans.append((base + at, base + at + len(needle)))
    return sorted(set(spans)), missing


def claimdiff_score(hallucinated: float, missing: float, hallucination_weight: float = 1.0,
                    missing_weight: float = 1.0) -> float:
    return 1.0 / (1.0 + hallucination_weight * hallucinated + missing_weight * missing)


@register_reward("claimdiff")
class ClaimDiff(JudgedReward):
    """ClaimDiff-RL: verified atomic claim differences against a reference caption; see the module docstring."""

    extra_keys = ("hallucinated", "missing", "num_differences")
    reports_spans = True  # the hallucinated claims' characters (module docstring)

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module = DEFAULT_JUDGE,
        processor: Any = None,
        differences: str = "judge",
        diff_template: str = DEFAULT_DIFF_TEMPLATE,
        verify_template: str = DEFAULT_VERIFY_TEMPLATE,
        cover_template: str = DEFAULT_COVER_TEMPLATE,
        verify: bool = True,
        severity_weights: Mapping[str, float] | None = None,
        default_severity: float = 1.0,
        hallucination_weight: float = 1.0,
        missing_weight: float = 1.0,
        max_claims: int = 16,
        max_new_tokens: int = 384,
        reference_key: str = "solution",
        part: str = "answer_or_all",
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
        differences: ``"judge"`` (the judge lists them; the paper's idea) or ``"split"`` (sentences; mmrl's).
        diff_template: stage 1 (generation). Placeholders ``{caption}`` (the policy's), ``{reference}``,
            ``{question}``, ``{meta[field]}``.
        verify_template: stage 2, a yes/no question per claim: ``{claim}``, ``{caption}``, ``{reference}``,
            ``{question}``, ``{meta[field]}``.
        cover_template: split mode only, "does the caption state this reference claim": the same placeholders.
        verify: run stage 2 (judge mode).
        severity_weights: severity label -> weight (default ``{"minor": 0.5, "major": 1, "critical": 2}``);
            ``default_severity`` for any other label.
        hallucination_weight, missing_weight: the weights of H and M in the score.
        max_claims: the most differences (judge mode) or sentences per caption (split mode) counted.
        max_new_tokens: the judge's listing budget.
        reference_key: the metadata field with the reference caption.
        part: the part of the response that is the caption (see :func:`mmrl.rewards._judge.response_part`).
        batch_size: judge queries per forward. media_root: folder for relative image paths.
        """
        super().__init__(model=model, processor=processor, device=device, dtype=dtype, batch_size=batch_size,
                         system_prompt=system_prompt, min_pixels=min_pixels, max_pixels=max_pixels,
                         yes_words=yes_words, no_words=no_words, media_root=media_root)
        if differences not in ("judge", "split"):
            raise ValueError(f"differences must be 'judge' or 'split', got {differences!r}")
        self.differences = differences
        self.diff_template = check_template(diff_template, DIFF_PLACEHOLDERS, "diff_template")
        self.verify_template = check_template(verify_template, VERIFY_PLACEHOLDERS, "verify_template")
        self.cover_template = check_template(cover_template, VERIFY_PLACEHOLDERS, "cover_template")
        self.verify = bool(verify)
        weights = SEVERITY_WEIGHTS if severity_weights is None else severity_weights
        self.severity_weights = {str(k).lower(): float(v) for k, v in weights.items()}
        self.default_severity = float(default_severity)
        if any(w < 0 for w in [*self.severity_weights.values(), self.default_severity]):
            raise ValueError("severity weights must be >= 0")
        self.hallucination_weight = float(hallucination_weight)
        self.missing_weight = float(missing_weight)
        if self.hallucination_weight < 0 or self.missing_weight < 0:
            raise ValueError("hallucination_weight and missing_weight must be >= 0")
        self.max_claims = int(max_claims)
        self.max_new_tokens = int(max_new_tokens)
        if self.max_claims < 1 or self.max_new_tokens < 1:
            raise ValueError("max_claims and max_new_tokens must be >= 1")
        self.reference_key = str(reference_key)
        self.part = check_part(part)

    def weight(self, severity: str) -> float:
        return self.severity_weights.get(str(severity).lower().strip(), self.default_severity)

    def _result(self, h: float, m: float, count: int) -> dict[str, float]:
        return {self.name: claimdiff_score(h, m, self.hallucination_weight, self.missing_weight),
                "hallucinated": h, "missing": m, "num_differences": float(count)}

    def _plan(self, text: str, prompt: str | None, meta: Mapping, record: list):
        images = self.media.images(meta, self.name)
        reference = require(meta, self.reference_key, self.name)
        if not isinstance(reference, str) or not reference.strip():
            raise Unjudgeable(f"metadata {self.reference_key!r} is not a non-empty caption")
        reference = reference.strip()
        caption = response_part(text, self.part)
        fields = dict(caption=caption, reference=reference, question=prompt or "")
        if self.differences == "split":
            return (yield from self._split(text, images, caption, reference, fields, meta, record))
        (listing,) = yield [Generate(images + [fill(self.diff_template, meta, **fields)], label="differences",
                                     max_new_tokens=self.max_new_tokens)]
        diffs = parse_differences(listing)
        if diffs is None:
            raise Unjudgeable("the judge's listing has no difference line and no NONE")
        diffs = diffs[: self.max_claims]
        record.append({"kind": "differences", "items": [d.__dict__ for d in diffs]})
        if self.verify and diffs:
            p_true = yield [Ask(images + [fill(self.verify_template, meta, claim=d.claim, **fields)], label=d.claim)
                            for d in diffs]
        else:
            p_true = [0.0 if d.kind == "hallucinated" else 1.0 for d in diffs]
        h = sum(self.weight(d.severity) * (1.0 - p) for d, p in zip(diffs, p_true) if d.kind == "hallucinated")
        m = sum(self.weight(d.severity) * p for d, p in zip(diffs, p_true) if d.kind == "missing")
        wrong = [d.claim for d, p in zip(diffs, p_true) if d.kind == "hallucinated" and p < 0.5]
        return self._result(h, m, len(diffs)), self._spans(text, caption, wrong, record)

    @staticmethod
    def _spans(text: str, caption: str, wrong: list[str], record: list) -> list[tuple[int, int]]:
        spans, unlocated = claim_spans(text, caption, wrong)
        record.append({"kind": "hallucinated_spans", "located": len(wrong) - unlocated, "unlocated": unlocated})
        return spans

    def _split(self, text, images, caption, reference, fields, meta, record):
        own = split_claims(caption, self.max_claims)
        ref = split_claims(reference, self.max_claims)
        if not own:
            raise Unparseable("the caption has no sentence to check")
        if not ref:
            raise Unjudgeable(f"metadata {self.reference_key!r} has no sentence to check")
        record.append({"kind": "claims", "caption": own, "reference": ref})
        asks = [Ask(images + [fill(self.verify_template, meta, claim=c, **fields)], label=f"caption: {c}")
                for c in own]
        asks += [Ask(images + [fill(self.verify_template, meta, claim=r, **fields)], label=f"reference: {r}")
                 for r in ref]
        asks += [Ask(images + [fill(self.cover_template, meta, claim=r, **fields)], label=f"covered: {r}")
                 for r in ref]
        p = yield asks
        p_own, p_ref, p_cov = p[:len(own)], p[len(own):len(own) + len(ref)], p[len(own) + len(ref):]
        h = sum(1.0 - x for x in p_own)
        m = sum(t * (1.0 - c) for t, c in zip(p_ref, p_cov))
        wrong = [c for c, x in zip(own, p_own) if x < 0.5]
        return self._result(h, m, len(own) + len(ref)), self._spans(text, caption, wrong, record)
