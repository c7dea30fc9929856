"""The text-reward contract and the helpers the answer, grounding and routing rewards share.

A text reward scores what a vision-language policy wrote::

    scores = reward(completions, prompts, metadata)   # -> dict[str, Tensor]

* ``completions``: a list of N strings (the generated text, chat template removed);
* ``prompts``: a list of N strings, or ``None`` (no text reward here needs them);
* ``metadata``: a list of N dicts with each sample's ground truth (``None`` means "none given").

It returns ``[N]`` float32 CPU tensors, the main score under ``reward.name``. Three outcomes per sample:

* judged: a number;
* **unparseable** model output (no ``<answer>`` block, no box, no number...): the main score is 0 (a
  reward with several parts keeps the parts it could read; extra keys get their documented "failed"
  values), and the sample is *counted*:
  ``last_info["num_unparseable"]``, ``last_info["unparseable"]`` (reason -> count),
  ``last_info["unparseable_samples"]`` (index -> reason). It is the policy's fault, so it is a 0, not a NaN;
* **not judgeable**: the sample's metadata lacks what the reward needs (no ``boxes`` for a grounding
  reward...), or the completion is not a string: every key is NaN, and ``last_info["nan_samples"]``
  says why. Such a sample is the data's fault and must not be scored.

A wrongly shaped batch (completions not a list, lengths that disagree) raises ``ValueError``.

Metadata fields (the data loader writes them; each reward's docstring says which it reads):

``solution``     str (or number, or list of letters): the reference answer;
``task``         str: the task type, used by :class:`~mmrl.rewards.routing.TaskRoutedReward`;
``choices``      list[str]: the options of a multiple-choice question, in letter order A, B, C...;
``boxes``        list of ``[x1, y1, x2, y2]``: ground-truth boxes in ORIGINAL image pixels
                 (a single flat ``[x1, y1, x2, y2]`` is accepted as one box);
``image_size``   ``[W, H]`` of the original image;
``input_size``   ``[W, H]`` of the resized model input (Qwen2.5-VL: ``grid_w*14, grid_h*14``);
``coord_format`` ``"qwen2"`` (0-1000 normalised: Qwen2-VL, Qwen3-VL), ``"qwen25"`` (Qwen2.5-VL: absolute
                 pixels of the resized input) or ``"absolute"`` (original pixels); when absent, the box
                 reward's ``coord_format`` (set from the model type for ``model.family: qwen_vl``), and
                 with neither the sample is NaN: never silently read as absolute pixels;
``timestamps``   ``[start, end]`` in seconds (a temporal-grounding line: its ``solution`` holds the span as
                 text, e.g. ``"[3.0, 7.5]"``, and is not a choice letter);
``duration``     the video length in seconds;
``salience``     list of weights, one per ground-truth box (GRiP's salience-weighted IoU).
"""
from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any, Mapping, Sequence

import torch

from ._base import _info

__all__ = [
    "TextReward",
    "Unparseable",
    "Unjudgeable",
    "is_text_batch",
    "check_text_batch",
    "extract_answer",
    "think_answer_format",
    "answer_or_text",
    "parse_number",
    "require",
]


class Unparseable(Exception):
    """Raised by a text reward's ``_score_one`` when the model output cannot be read: scores 0, counted.

    ``extras`` gives the values of the reward's extra keys for such a sample (missing ones are NaN);
    ``score`` the main score (0 unless a reward with several parts still credits the parts it could read).
    """

    def __init__(self, reason: str, extras: Mapping[str, float] | None = None, score: float = 0.0):
        super().__init__(reason)
        self.reason = reason
        self.extras = dict(extras or {})
        self.score = float(score)


class Unjudgeable(Exception):
    """Raised by ``_score_one`` when the sample's metadata lacks what the reward needs: NaN, with the reason."""


# --------------------------------------------------------------------------------------------
# Batch checks
# --------------------------------------------------------------------------------------------


def is_text_batch(outputs: Any) -> bool:
    """True for a non-empty list/tuple of outputs that contains a string and no image.

    ``ComposedReward`` uses this to send a batch down the text path (completions passed straight to the
    components) instead of the image path (validated and converted by ``prepare_batch``).
    """
    if not isinstance(outputs, (list, tuple)) or not outputs:
        return False
    from PIL import Image

    return any(isinstance(o, str) for o in outputs) and not any(isinstance(o, Image.Image) for o in outputs)


def check_text_batch(completions: Any, prompts: Any, metadata: Any) -> tuple[list, list | None, list[dict]]:
    """Validate the batch's shape; return ``(completions, prompts, metadata)`` as lists.

    ``metadata=None`` becomes N empty dicts (rewards that need a field then mark every sample NaN).
    Raises ``ValueError`` naming what was expected for a wrongly shaped batch.
    """
    if isinstance(completions, (str, bytes)) or not isinstance(completions, Sequence):
        raise ValueError(
            f"completions must be a list of N strings (one per sample), got {type(completions).__name__}"
        )
    completions = list(completions)
    n = len(completions)
    if prompts is not None:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError(f"prompts must be a list of N strings or None, got {type(prompts).__name__}")
        if len(prompts) != n:
            raise ValueError(f"got {n} completions but {len(prompts)} prompts; they must match")
        prompts = list(prompts)
    if metadata is None:
        metadata = [{} for _ in range(n)]
    else:
        if isinstance(metadata, (str, bytes, Mapping)) or not isinstance(metadata, Sequence):
            raise ValueError(f"metadata must be a list of N dicts or None, got {type(metadata).__name__}")
        if len(metadata) != n:
            raise ValueError(f"got {n} completions but {len(metadata)} metadata entries; they must match")
        metadata = [m if m is not None else {} for m in metadata]
    return completions, prompts, metadata


# --------------------------------------------------------------------------------------------
# Base class
# --------------------------------------------------------------------------------------------


def as_spans(reported) -> list[tuple[int, int]] | None:
    """A reward's reported character spans of one response as ``[(start, end), ...]`` (``None``: none reported)."""
    return None if reported is None else [(int(a), int(b)) for a, b in reported]


def combined_spans(per_component: Sequence[Sequence | None], n: int) -> list[list[tuple[int, int]] | None] | None:
    """The spans of a weighted sum of rewards, per sample, from each summed component's reported spans.

    ``per_component`` holds one entry per component in the sum: its per-sample spans (``None`` for a sample it reported
    none for) or ``None`` when the component reports no spans at all. A component without spans for a sample is about
    the whole response, so the sum is too: that sample's entry is ``None``; otherwise it is the union of the
    components' spans, sorted, overlapping and touching spans merged. Returns ``None`` when no component reports spans.
    """
    if not per_component or all(part is None for part in per_component):
        return None
    out: list[list[tuple[int, int]] | None] = []
    for i in range(n):
        pieces: list[tuple[int, int]] | None = []
        for part in per_component:
            reported = None if part is None else part[i]
            if reported is None:
                pieces = None
                break
            pieces.extend(as_spans(reported))
        if pieces is None:
            out.append(None)
            continue
        merged: list[tuple[int, int]] = []
        for start, end in sorted(pieces):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        out.append(merged)
    return out


def collect_rows(name: str, extra_keys: Sequence[str], rows: list[dict[str, float]], nan_reasons: dict[int, str],
                 unparseable: dict[int, str]) -> tuple[dict[str, torch.Tensor], dict]:
    """Per-sample score rows -> ``{key: [N]}`` tensors (``name`` first, a row's missing or non-finite value NaN) and
    the reward's ``last_info``: the NaN reasons (a non-finite main score gets one) and the unparseable counts."""
    keys = [name] + sorted(({k for row in rows for k in row} | set(extra_keys)) - {name})
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        values = torch.tensor([row.get(key, math.nan) for row in rows], dtype=torch.float32)
        out[key] = torch.where(torch.isfinite(values), values, torch.nan)
    for i in torch.isnan(out[name]).nonzero().flatten().tolist():
        nan_reasons.setdefault(i, "the scorer returned a non-finite value")
    info = _info(len(rows), nan_reasons)
    info["num_unparseable"] = len(unparseable)
    info["unparseable"] = dict(Counter(unparseable.values()))
    info["unparseable_samples"] = dict(sorted(unparseable.items()))
    return out, info


class TextReward:
    """Base class of the text rewards: the per-sample loop, the NaN / unparseable bookkeeping.

    Subclasses set ``name`` (the registry does) and implement ``_score_one(text, prompt, meta)``
    returning ``{name: score, extra_key: value, ...}`` (a bare float is the main score), raising
    :class:`Unparseable` for output it cannot read and :class:`Unjudgeable` for missing ground truth.
    Any other exception in ``_score_one`` marks that one sample NaN with the error as reason.

    A reward that says which characters of a response its score is about (span-scoped credit,
    :mod:`mmrl.pipelines.vlm.spans`) sets ``reports_spans = True`` and returns ``(result, spans)`` from
    ``_score_one``, ``spans`` a list of ``(start, end)`` character spans of ``text`` or ``None``; they go to
    ``last_info["spans"]``, one entry per sample (``None`` for the samples it scored no spans for, unparseable,
    NaN or not).
    """

    name: str = ""
    reports_spans: bool = False
    needs_prompts: bool = False
    scores_images: bool = False  # judges completions (text), never images
    extra_keys: tuple[str, ...] = ()  # always present in the output (NaN where not scored), for stable logs

    def __init__(self) -> None:
        self.last_info: dict = {}

    def _score_one(self, text: str, prompt: str | None, meta: Mapping) -> float | Mapping[str, float]:
        raise NotImplementedError

    def __call__(self, completions, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        completions, prompts, metadata = check_text_batch(completions, prompts, metadata)
        rows: list[dict[str, float]] = []
        nan_reasons: dict[int, str] = {}
        unparseable: dict[int, str] = {}
        spans: list[list[tuple[int, int]] | None] = [None] * len(completions)
        for i, text in enumerate(completions):
            prompt = prompts[i] if prompts is not None else None
            meta = metadata[i]
            if not isinstance(text, str):
                nan_reasons[i] = f"completion is not a string (got {type(text).__name__})"
                rows.append({})
                continue
            if not isinstance(meta, Mapping):
                nan_reasons[i] = f"metadata entry is not a dict (got {type(meta).__name__})"
                rows.append({})
                continue
            try:
                result = self._score_one(text, prompt, meta)
            except Unparseable as exc:
                unparseable[i] = exc.reason
                rows.append({**exc.extras, self.name: exc.score})
                continue
            except Unjudgeable as exc:
                nan_reasons[i] = str(exc)
                rows.append({})
                continue
            except Exception as exc:  # one bad sample never takes the batch down
                nan_reasons[i] = f"scorer failed: {type(exc).__name__}: {exc}"
                rows.append({})
                continue
            if self.reports_spans:
                result, reported = result
                spans[i] = as_spans(reported)
            if not isinstance(result, Mapping):
                result = {self.name: result}
            rows.append({k: float(v) for k, v in result.items()})

        out, self.last_info = collect_rows(self.name, self.extra_keys, rows, nan_reasons, unparseable)
        if self.reports_spans:
            self.last_info["spans"] = spans
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# --------------------------------------------------------------------------------------------
# <think>/<answer> structure
# --------------------------------------------------------------------------------------------

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_FORMAT = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
#: the contents of a response's ``<answer>`` / ``<think>`` blocks (every reader of the response format uses these)
ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
THINK_BLOCK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_ANSWER = ANSWER_BLOCK


def think_answer_format(text: str) -> float:
    """1.0 only for exactly one ``<think>...</think>`` followed by exactly one non-empty
    ``<answer>...</answer>``, with nothing but whitespace before, between and after them; else 0.0.

    Each of the four tags must occur exactly once, so a repeated block or a nested tag (``<answer>``
    inside ``<think>``) scores 0. The anchors (VLM-R1, Video-R1) match
    ``<think>.*?</think>\\s*<answer>.*?</answer>`` with ``re.fullmatch`` and DOTALL, which accepts a
    second answer block (``.*?`` stretches over ``</answer><answer>``); mmrl rejects it. They also
    refuse whitespace before the first or after the last tag, which mmrl (as Time-R1, which strips the
    text) allows. The think block may be empty; the answer may not (whitespace only counts as empty).
    """
    if not isinstance(text, str):
        return 0.0
    if any(text.count(tag) != 1 for tag in _TAGS):
        return 0.0
    match = _FORMAT.fullmatch(text)
    if match is None or not match.group(2).strip():
        return 0.0
    return 1.0


def extract_answer(text: str) -> str | None:
    """The stripped content of the one ``<answer>...</answer>`` block, or None.

    None when there is no complete answer block, when there is more than one ``<answer>`` or
    ``</answer>`` tag (repeated or nested blocks are ambiguous), or when the block is empty.
    The ``<think>`` structure is not checked here (that is :func:`think_answer_format`'s job).
    """
    if not isinstance(text, str):
        return None
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return None
    match = _ANSWER.search(text)
    if match is None:
        return None
    content = match.group(1).strip()
    return content or None


def answer_or_text(text: str, require_tags: bool) -> str:
    """The answer a reward should read: the ``<answer>`` block, or (``require_tags=False`` and no
    answer tag at all) the whole completion stripped. Raises :class:`Unparseable` otherwise."""
    answer = extract_answer(text)
    if answer is not None:
        return answer
    if not require_tags and "<answer>" not in text and "</answer>" not in text and text.strip():
        return text.strip()
    if text.count("<answer>") > 1 or text.count("</answer>") > 1:
        raise Unparseable("more than one <answer> block")
    if "<answer>" in text and "</answer>" in text and _ANSWER.search(text):
        raise Unparseable("empty <answer> block")
    raise Unparseable("no <answer>...</answer> block")


# --------------------------------------------------------------------------------------------
# Numbers and metadata
# --------------------------------------------------------------------------------------------

_WORDS = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
    "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
    "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19, "twenty": 20,
}
_NUMBER = re.compile(
    r"(?<![\w.])[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?%?(?!\d)(?!\.\d)"
)


def _to_float(token: str) -> float | None:
    token = token.replace("−", "-").replace(",", "").replace(" ", "").rstrip("%")
    if not token or token in "+-" or not any(c.isdigit() for c in token):
        return None
    if "/" in token:
        num, den = token.split("/", 1)
        try:
            d = float(den)
            return float(num) / d if d != 0 else None
        except ValueError:
            return None
    try:
        return float(token)
    except ValueError:
        return None


def parse_number(text: Any) -> float:
    """The one number in ``text``; raises :class:`Unparseable` if there is none or several distinct ones.

    Accepts ints and floats (``3``, ``-2.5``, ``1e3``), thousands separators (``1,234``), simple
    fractions (``3/4``), a trailing percent sign (``50%`` reads as 50: same units as the solution),
    and the number words zero..twenty. A number passed in (int/float) is returned as is.
    """
    if isinstance(text, bool):
        raise Unparseable("answer is a boolean, not a number")
    if isinstance(text, (int, float)):
        if not math.isfinite(text):
            raise Unparseable("answer is not a finite number")
        return float(text)
    if not isinstance(text, str):
        raise Unparseable(f"answer is not text (got {type(text).__name__})")
    values = [v for v in (_to_float(m.group(0)) for m in _NUMBER.finditer(text)) if v is not None]
    if not values:
        words = [_WORDS[w] for w in re.findall(r"[a-zA-Z]+", text.lower()) if w in _WORDS]
        values = [float(w) for w in words]
    distinct = sorted(set(values))
    if not distinct:
        raise Unparseable("no number in the answer")
    if len(distinct) > 1:
        raise Unparseable("several different numbers in the answer")
    if not math.isfinite(distinct[0]):
        raise Unparseable("answer is not a finite number")
    return distinct[0]


def require(meta: Mapping, key: str, reward: str) -> Any:
    """``meta[key]``, or :class:`Unjudgeable` naming the missing field."""
    value = meta.get(key)
    if value is None:
        raise Unjudgeable(f"metadata has no {key!r} (needed by {reward})")
    return value
