"""Answer rewards for vision-language policies: format, choice letters, numbers, multi-select, math.

Every reward here is a :class:`~mmrl.rewards._text.TextReward`:
``reward(completions, prompts, metadata) -> {name: [N], ...}``. The answer is read from the one
``<answer>...</answer>`` block (:func:`extract_answer`); with ``require_tags=False`` a completion with
no answer tag at all is read whole. Unreadable answers score 0 and are counted in
``last_info["num_unparseable"]``; a sample without the metadata a reward needs is NaN.

Metadata read here:

* ``solution``: the reference answer. A choice letter (``"B"``, ``"(B)"``, ``"B. text"``, or the option
  text when ``choices`` is given) for ``choice_accuracy``; letters ``"A,C"`` or ``["A", "C"]`` for
  ``multi_choice_accuracy``; a number (or a string holding one) for ``numeric_accuracy`` and
  ``numeric_fuzzy``; a LaTeX or plain expression for ``math_accuracy``. A solution wrapped in
  ``<answer>`` tags (TW-GRPO's data) is unwrapped.
* ``choices``: the option texts in letter order (optional; limits the valid letters and lets an
  answer that repeats an option's text count as that letter).

Registered rewards and their keyword arguments:

=========================  ==========================================  ================================
name                       kwargs                                      extra keys
=========================  ==========================================  ================================
``think_answer_format``    ``convention="mmrl"`` (``r1``, ``time_r1``,   (none)
                           ``vlm_r1_rec``: the anchors' patterns)
``choice_accuracy``        ``require_tags=True``                       (none)
``multi_choice_accuracy``  ``require_tags=True, partial_credit=True``  ``exact``
``numeric_accuracy``       ``require_tags=True, rel_tol=1e-6,          ``abs_error``
                           abs_tol=1e-9``
``numeric_fuzzy``          ``require_tags=True, rule="fgrpr",          ``relative_error``
                           tau=0.5``
``math_accuracy``          ``require_tags=True, timeout_seconds=5,     (none)
                           convention="mmrl"`` (``"trl"``: TRL's
                           ``accuracy_reward``)
``chart_accuracy``         ``require_tags=True,                        (none)
                           max_relative_change=0.05``
=========================  ==========================================  ================================
"""
from __future__ import annotations

import math
import re
import signal
import string
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

from ._base import register_reward
from ._text import (
    TextReward,
    Unjudgeable,
    Unparseable,
    answer_or_text,
    extract_answer,
    parse_number,
    require,
    think_answer_format,
)

__all__ = [
    "think_answer_format",
    "extract_answer",
    "parse_choice",
    "parse_choice_set",
    "multi_choice_credit",
    "fgrpr_precision",
    "ThinkAnswerFormat",
    "ChoiceAccuracy",
    "MultiChoiceAccuracy",
    "NumericAccuracy",
    "NumericFuzzy",
    "MathAccuracy",
    "ChartAccuracy",
    "relaxed_correctness",
]


# --------------------------------------------------------------------------------------------
# Choice letters
# --------------------------------------------------------------------------------------------

_PREFIX = re.compile(
    r"^\s*(?:the\s+)?(?:final\s+|correct\s+|best\s+)*(?:answer|option|choice)s?\s*(?:is|are|:|=|-)?\s*",
    re.IGNORECASE,
)
_WHOLE_LETTER = re.compile(r"\(?([A-Za-z])\)?[.)]?")
_LEADING_LETTER = re.compile(r"\(?([A-Z])\)?(?=$|[\s.,:;)\]])")
_ANYWHERE = re.compile(r"(?i:answer|option|choice)\s*(?i:is|:)?\s*\(?([A-Z])\)?(?![A-Za-z])")
#: A second letter listed right after the one found (``B, C`` / ``B or C`` / ``(B)/(C)``), ending the phrase: a hedge.
_ALSO = re.compile(r"\)?\s*(?:,|/|&|\bor\b|\band\b)\s*\(?([A-Za-z])\)?(?=\s*$|\s*[.,;:!?)\]]|\s+(?:or|and)\b)")


def _valid_letters(choices: Sequence[str] | None) -> str:
    if choices is None:
        return string.ascii_uppercase
    return string.ascii_uppercase[: len(choices)]


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^\w\s]", " ", text.lower())).strip()


def parse_choice(answer: str, choices: Sequence[str] | None = None) -> str:
    """The choice letter an answer names, upper case; raises :class:`Unparseable`.

    Tried in order, the first valid letter wins (valid: ``A``.. up to ``len(choices)``, or A-Z):

    1. the whole answer is a letter: ``B``, ``(B)``, ``B.``, ``b)``; a prefix ``Answer:`` /
       ``The answer is`` / ``Option`` is dropped first;
    2. the answer repeats an option's text (``choices`` given; case and punctuation ignored);
    3. ``answer is B`` / ``option: (B)`` anywhere in the answer (upper-case letter);
    4. the answer starts with an upper-case letter token: ``B. red car``, ``(B) red car``, ``B, because``,
       ``B is correct``; a bare letter before an option's whole text names that option (``A cat`` with options
       ``dog, cat``: the article and option B). Every letter is read alike: ``A is correct`` is A as ``B is
       correct`` is B (an earlier rule read a bare ``A`` / ``I`` before a lower-case word as the article or
       pronoun, so such answers scored 0 exactly when the solution was A: a bias against one option).

    A letter found by 3 or 4 and followed by another valid one in a list (``B, C``, ``answer is B or C``,
    ``B/C.``) is a hedge: :class:`Unparseable`, not the first letter (mmrl's rule: Video-R1 compares the whole
    answer with the solution, so a hedge scores 0 there too; a reward that took the first letter would pay for
    listing options).
    """
    if not isinstance(answer, str) or not answer.strip():
        raise Unparseable("empty answer")
    valid = _valid_letters(choices)
    body = _PREFIX.sub("", answer.strip(), count=1).strip()
    candidates: list[tuple[str, str | None]] = []  # (letter, a second letter listed right after it)

    def listed_after(text: str, end: int) -> str | None:
        also = _ALSO.match(text, end)
        return also.group(1).upper() if also and also.group(1).upper() in valid else None

    whole = _WHOLE_LETTER.fullmatch(body)
    if whole:
        candidates.append((whole.group(1).upper(), None))
    if choices:
        norm = _norm(body)
        for letter, text in zip(valid, choices):
            if isinstance(text, str) and norm and _norm(text) == norm:
                candidates.append((letter, None))
    candidates += [(m.group(1), listed_after(answer, m.end())) for m in _ANYWHERE.finditer(answer)]
    leading = _LEADING_LETTER.match(body)
    if leading:
        letter, rest = leading.group(1), body[leading.end():]
        bare = leading.group(0) == letter and rest[:1].isspace()  # "A cat", not "A. cat" / "(A) cat"
        named = [v for v, text in zip(valid, choices or ()) if isinstance(text, str) and _norm(rest)
                 and _norm(text) == _norm(rest)] if bare else []
        if named:  # "A cat" with cat an option: the article and that option's text
            candidates.append((named[0], None))
        else:
            candidates.append((letter, listed_after(body, leading.end())))
    for letter, also in candidates:
        if letter in valid:
            if also is not None and also != letter:
                raise Unparseable(f"the answer names more than one choice ({letter} and {also})")
            return letter
    if candidates:
        raise Unparseable(f"letter {candidates[0][0]!r} is not one of the options {valid[0]}-{valid[-1]}")
    raise Unparseable("no choice letter in the answer")


_SPLIT = re.compile(r"\s*(?:,|;|/|&|\band\b|\s)\s*", re.IGNORECASE)


def parse_choice_set(answer: Any, choices: Sequence[str] | None = None) -> frozenset[str]:
    """The set of letters of a multi-select answer (``"A, C"``, ``"(A) and (C)"``, ``["A", "C"]``).

    Tokens are split on commas, semicolons, slashes, ``&``, ``and`` and spaces; every token must be a
    single valid letter (optionally in parentheses or followed by a period), else :class:`Unparseable`.
    """
    valid = _valid_letters(choices)
    if isinstance(answer, (list, tuple, set, frozenset)):
        tokens = [str(t) for t in answer]
    elif isinstance(answer, str):
        body = _PREFIX.sub("", answer.strip(), count=1).strip()
        tokens = [t for t in _SPLIT.split(body) if t]
    else:
        raise Unparseable(f"answer is not text (got {type(answer).__name__})")
    letters = set()
    for token in tokens:
        m = _WHOLE_LETTER.fullmatch(token.strip().strip("[]"))
        if not m or m.group(1).upper() not in valid:
            raise Unparseable(f"{token!r} is not an option letter {valid[0]}-{valid[-1]}")
        letters.add(m.group(1).upper())
    if not letters:
        raise Unparseable("no choice letter in the answer")
    return frozenset(letters)


def multi_choice_credit(pred: set[str] | frozenset[str], gt: set[str] | frozenset[str], partial_credit: bool = True) -> float:
    """TW-GRPO's soft multi-choice reward: ``|pred| / |gt|`` if ``pred ⊆ gt``, else 0.

    Dang et al., "Reinforcing Video Reasoning with Focused Thinking" (TW-GRPO, arXiv:2505.24718), as
    implemented by their released ``accuracy_reward`` (``src/open_r1/grpo.py``): a subset of the correct
    options earns the fraction of them it names; naming any wrong option scores 0. With
    ``partial_credit=False`` it is their ``origin_accuracy`` (1 only for the exact set).
    """
    if not gt:
        raise ValueError("the ground-truth option set is empty")
    if not pred or not pred <= gt:
        return 0.0
    credit = len(pred) / len(gt)
    return credit if partial_credit or credit == 1.0 else 0.0


def _solution_text(meta: Mapping, reward: str) -> Any:
    sol = require(meta, "solution", reward)
    if isinstance(sol, str):
        inner = extract_answer(sol)
        return inner if inner is not None else sol.strip()
    return sol


def _choices(meta: Mapping) -> list[str] | None:
    choices = meta.get("choices")
    if choices is None:
        return None
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence) or not choices:
        raise Unjudgeable(f"metadata 'choices' must be a non-empty list of option texts, got {choices!r}")
    if len(choices) > 26:
        raise Unjudgeable(f"metadata 'choices' has {len(choices)} options; at most 26 letters are supported")
    return list(choices)


# --------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------


def fgrpr_precision(pred: float, gt: float) -> float:
    """CrowdVLM-R1's Fuzzy Group Relative Policy Reward (FGRPR) precision term.

    Wang et al., "CrowdVLM-R1: Expanding R1 Ability to Vision Language Model for Crowd Counting using
    Fuzzy Group Relative Policy Reward" (arXiv:2504.03724), as in their released ``count_reward``:
    with the relative error ``e = |pred - gt| / gt``, the reward is ``1.5 - e`` when ``e < 0.5`` and 0
    otherwise (so an exact count earns 1.5, a near miss between 1.0 and 1.5, a far miss 0). Their code
    divides by ``gt``; mmrl uses ``|gt|`` so a negative target does not flip the sign, and for ``gt = 0``
    takes ``e = 0`` for an exact answer and infinity otherwise.
    """
    e = _relative_error(pred, gt)
    return 1.5 - e if e < 0.5 else 0.0


def _relative_error(pred: float, gt: float) -> float:
    if gt == 0:
        return 0.0 if pred == 0 else math.inf
    return abs(pred - gt) / abs(gt)


def _number_solution(meta: Mapping, reward: str) -> float:
    sol = _solution_text(meta, reward)
    try:
        return parse_number(sol)
    except Unparseable as exc:
        raise Unjudgeable(f"metadata 'solution' {sol!r} is not a number ({exc})") from None


# --------------------------------------------------------------------------------------------
# Rewards
# --------------------------------------------------------------------------------------------


#: ``think_answer_format``'s anchor conventions: the pattern and how it is matched
_R1_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
_VLM_R1_REC_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?\{.*\[\d+,\s*\d+,\s*\d+,\s*\d+\].*\}.*?</answer>",
                                re.DOTALL)
FORMAT_CONVENTIONS = ("mmrl", "r1", "time_r1", "vlm_r1_rec")


@register_reward("think_answer_format")
class ThinkAnswerFormat(TextReward):
    """1.0 for ``<think>...</think><answer>...</answer>`` exactly once each, else 0 (:func:`think_answer_format`).

    Needs no metadata. Stricter than the format reward of VLM-R1 / Video-R1 / Time-R1 about repeated, nested or
    empty blocks; like Time-R1 (which strips the text) it allows whitespace around the blocks, which VLM-R1's and
    Video-R1's ``re.fullmatch`` on the raw text refuse (a trailing newline scores 0 there). ``convention`` takes an
    anchor's own instead:

    * ``"r1"``: ``re.fullmatch(r"<think>.*?</think>\s*<answer>.*?</answer>", text, re.DOTALL)``, the generic
      ``format_reward`` of VLM-R1's ``grpo_jsonl.py`` and Video-R1's ``grpo.py`` (a second answer block or an empty
      answer passes);
    * ``"time_r1"``: the same pattern on the stripped text (Time-R1's ``main.py`` ``format_reward``);
    * ``"vlm_r1_rec"``: VLM-R1's REC ``format_reward_rec`` (``qwen_module.py``): ``re.search`` (text around the
      blocks allowed) of ``<think>.*?</think>\s*<answer>.*?\{.*\[\d+,\s*\d+,\s*\d+,\s*\d+\].*\}.*?</answer>``,
      so the answer must hold a whole-number box inside braces.
    """

    def __init__(self, convention: str = "mmrl") -> None:
        super().__init__()
        if convention not in FORMAT_CONVENTIONS:
            raise ValueError(f"unknown convention {convention!r}; expected one of {FORMAT_CONVENTIONS}")
        self.convention = convention

    def _score_one(self, text, prompt, meta):
        if self.convention == "mmrl":
            return think_answer_format(text)
        if self.convention == "vlm_r1_rec":
            return float(_VLM_R1_REC_FORMAT.search(text) is not None)
        return float(_R1_FORMAT.fullmatch(text.strip() if self.convention == "time_r1" else text) is not None)


@register_reward("choice_accuracy")
class ChoiceAccuracy(TextReward):
    """1.0 when the answer's choice letter equals ``solution``'s, else 0 (single-answer multiple choice).

    Reads ``solution`` and optionally ``choices``. Letters are parsed by :func:`parse_choice`, which
    tolerates ``B``, ``(B)``, ``B.``, ``Answer: B``, ``The answer is B`` and the option's own text.
    """

    def __init__(self, require_tags: bool = True) -> None:
        super().__init__()
        self.require_tags = bool(require_tags)

    def _score_one(self, text, prompt, meta):
        choices = _choices(meta)
        sol = _solution_text(meta, self.name)
        try:
            gt = parse_choice(str(sol), choices)
        except Unparseable as exc:
            raise Unjudgeable(f"metadata 'solution' {sol!r} is not a choice letter ({exc})") from None
        pred = parse_choice(answer_or_text(text, self.require_tags), choices)
        return float(pred == gt)


@register_reward("multi_choice_accuracy")
class MultiChoiceAccuracy(TextReward):
    """TW-GRPO's soft multi-select reward (:func:`multi_choice_credit`): ``|pred|/|gt|`` for a subset
    of the correct letters, 0 as soon as one wrong letter is named.

    Reads ``solution`` (``"A,C"`` or ``["A", "C"]``) and optionally ``choices``. Extra key ``exact``:
    1 when the named set is exactly the correct one.
    """

    extra_keys = ("exact",)

    def __init__(self, require_tags: bool = True, partial_credit: bool = True) -> None:
        super().__init__()
        self.require_tags = bool(require_tags)
        self.partial_credit = bool(partial_credit)

    def _score_one(self, text, prompt, meta):
        choices = _choices(meta)
        sol = _solution_text(meta, self.name)
        try:
            gt = parse_choice_set(sol, choices)
        except Unparseable as exc:
            raise Unjudgeable(f"metadata 'solution' {sol!r} is not a set of choice letters ({exc})") from None
        try:
            pred = parse_choice_set(answer_or_text(text, self.require_tags), choices)
        except Unparseable as exc:
            raise Unparseable(exc.reason, {"exact": 0.0}) from None
        return {self.name: multi_choice_credit(pred, gt, self.partial_credit), "exact": float(pred == gt)}


@register_reward("numeric_accuracy")
class NumericAccuracy(TextReward):
    """1.0 when ``|pred - gt| <= max(rel_tol * |gt|, abs_tol)``, else 0.

    Reads ``solution`` (a number, or a string with exactly one). The answer must hold exactly one
    number (:func:`~mmrl.rewards._text.parse_number`). Extra key ``abs_error``: ``|pred - gt|``.
    """

    extra_keys = ("abs_error",)

    def __init__(self, require_tags: bool = True, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> None:
        super().__init__()
        if rel_tol < 0 or abs_tol < 0:
            raise ValueError(f"rel_tol and abs_tol must be >= 0, got {rel_tol}, {abs_tol}")
        self.require_tags = bool(require_tags)
        self.rel_tol, self.abs_tol = float(rel_tol), float(abs_tol)

    def _score_one(self, text, prompt, meta):
        gt = _number_solution(meta, self.name)
        pred = parse_number(answer_or_text(text, self.require_tags))
        err = abs(pred - gt)
        return {self.name: float(err <= max(self.rel_tol * abs(gt), self.abs_tol)), "abs_error": err}


def relaxed_correctness(target: str, prediction: str, max_relative_change: float = 0.05) -> bool:
    """ChartQA's relaxed accuracy for one reference (Masry et al. 2022; the rule of its evaluation code, as
    pix2struct's ``metrics.relaxed_correctness``): when the prediction reads as a number (a trailing ``%`` divides
    by 100) and the reference as a non-zero number, correct within ``max_relative_change`` of the reference;
    otherwise a case-insensitive exact match. Both are stripped of surrounding whitespace (mmrl's)."""

    def to_float(value: str) -> float | None:
        try:
            return float(value[:-1]) / 100.0 if value.endswith("%") else float(value)
        except ValueError:
            return None

    target, prediction = str(target).strip(), str(prediction).strip()
    pred, ref = to_float(prediction), to_float(target)
    if pred is not None and ref:
        return abs(pred - ref) / abs(ref) <= max_relative_change
    return prediction.lower() == target.lower()


@register_reward("chart_accuracy")
class ChartAccuracy(TextReward):
    """Chart question answering: ChartQA's relaxed accuracy (:func:`relaxed_correctness`), 1 or 0, the best over the
    references when ``solution`` is a list. Mixed-R1 trains chart-aware data with a "chart reward" whose rule its
    abstract does not give; this is the chart benchmarks' own rule (ChartQA, and PlotQA's 5 % tolerance)."""

    def __init__(self, require_tags: bool = True, max_relative_change: float = 0.05) -> None:
        super().__init__()
        if not max_relative_change >= 0:
            raise ValueError(f"max_relative_change must be >= 0, got {max_relative_change}")
        self.require_tags = bool(require_tags)
        self.max_relative_change = float(max_relative_change)

    def _score_one(self, text, prompt, meta):
        solution = _solution_text(meta, self.name)
        targets = [solution] if isinstance(solution, (str, int, float)) else list(solution or [])
        if not targets or any(isinstance(t, bool) or not isinstance(t, (str, int, float)) for t in targets):
            raise Unjudgeable(f"metadata 'solution' must be an answer or a list of answers, got {solution!r}")
        answer = answer_or_text(text, self.require_tags)
        return float(any(relaxed_correctness(str(t), answer, self.max_relative_change) for t in targets))


@register_reward("numeric_fuzzy")
class NumericFuzzy(TextReward):
    """A graded score for near-miss numbers (counting): FGRPR by default.

    * ``rule="fgrpr"`` (default): CrowdVLM-R1's precision reward (:func:`fgrpr_precision`):
      ``1.5 - e`` if the relative error ``e = |pred - gt| / |gt| < 0.5``, else 0. Range {0} ∪ (1, 1.5].
    * ``rule="exp"``: ``exp(-e / tau)``, 1 for an exact answer, decaying with the relative error
      (``tau`` = the relative error at which the score falls to 1/e); range (0, 1].

    Reads ``solution``. Extra key ``relative_error``.
    """

    extra_keys = ("relative_error",)

    RULES = ("fgrpr", "exp")

    def __init__(self, require_tags: bool = True, rule: str = "fgrpr", tau: float = 0.5) -> None:
        super().__init__()
        if rule not in self.RULES:
            raise ValueError(f"unknown rule {rule!r}; use one of {self.RULES}")
        if not tau > 0:
            raise ValueError(f"tau must be > 0, got {tau}")
        self.require_tags = bool(require_tags)
        self.rule, self.tau = rule, float(tau)

    def _score_one(self, text, prompt, meta):
        gt = _number_solution(meta, self.name)
        pred = parse_number(answer_or_text(text, self.require_tags))
        e = _relative_error(pred, gt)
        score = fgrpr_precision(pred, gt) if self.rule == "fgrpr" else math.exp(-e / self.tau)
        return {self.name: score, "relative_error": e}


_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")


@contextmanager
def _keep_outer_alarm() -> Iterator[None]:
    """math-verify arms SIGALRM and cancels it afterwards; re-arm a timer that was running before
    (a watchdog, pytest-timeout) with the time it had left, instead of silently dropping it."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return
    remaining, interval = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    try:
        yield
    finally:
        if remaining > 0:
            left = max(remaining - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, interval)


@register_reward("math_accuracy")
class MathAccuracy(TextReward):
    """1.0 when math-verify judges the answer equal to ``solution``, else 0.

    Uses Hugging Face's ``math-verify`` (``parse`` then ``verify(gold, pred)``): LaTeX or plain
    expressions, ``\\boxed{}``, fractions vs decimals, sets and intervals. A bare expression (no ``$``,
    no ``\\boxed``, no words) is read wrapped in ``$...$`` first; an answer that parses to nothing is
    unparseable.
    math-verify bounds its work with ``SIGALRM``, which only works in the main thread: elsewhere (and
    with ``timeout_seconds=None``) it runs without a time limit. A ``SIGALRM`` timer already running
    (a watchdog) is re-armed afterwards with the time it had left.

    ``convention="trl"``: TRL's ``trl.rewards.accuracy_reward`` as written: the gold parsed with math-verify's
    defaults (unparseable: NaN, TRL's ``None``), the WHOLE completion (not the answer block) parsed with
    ``LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
    try_extract_without_anchor=False)`` and ``extraction_mode="first_match"`` (so an answer must be LaTeX:
    ``$...$`` or ``\\boxed{}``; plain ``3`` reads nothing), then ``verify(gold, answer)``; an answer that reads
    nothing scores 0 (counted as unparseable). ``require_tags`` does not apply there.
    """

    def __init__(self, require_tags: bool = True, timeout_seconds: int | None = 5, convention: str = "mmrl") -> None:
        super().__init__()
        try:
            import math_verify  # noqa: F401
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("math_accuracy needs the math-verify package: pip install 'math-verify[antlr4_13_2]'") from exc
        if convention not in ("mmrl", "trl"):
            raise ValueError(f"unknown convention {convention!r}; expected 'mmrl' or 'trl'")
        self.require_tags = bool(require_tags)
        self.timeout_seconds = timeout_seconds
        self.convention = convention

    def _timeout(self) -> int | None:
        if self.timeout_seconds is None or threading.current_thread() is not threading.main_thread():
            return None
        return int(self.timeout_seconds)

    def _parse(self, text: str) -> list:
        from math_verify import parse

        timeout = self._timeout()
        # A bare expression ("1+x^2", "\\sqrt{2}") is read as inline LaTeX: math-verify's plain-text
        # extraction would take its first number. Text with words is read as text ("$hello$" would
        # parse as a product of symbols).
        expression = "$" not in text and "\\boxed" not in text and not _WORD.search(text)
        for candidate in ([f"${text}$", text] if expression else [text]):
            parsed = parse(candidate, parsing_timeout=timeout)
            if parsed:
                return parsed
        return []

    def _score_one(self, text, prompt, meta):
        from math_verify import verify

        sol = _solution_text(meta, self.name)
        if self.convention == "trl":
            return self._score_trl(text, str(sol))
        answer = answer_or_text(text, self.require_tags)
        with _keep_outer_alarm():
            gold = self._parse(str(sol))
            if not gold:
                raise Unjudgeable(f"math-verify could not parse metadata 'solution' {sol!r}")
            pred = self._parse(answer)
            if not pred:
                raise Unparseable("math-verify found no expression in the answer")
            return float(verify(gold, pred, timeout_seconds=self._timeout()))

    def _score_trl(self, text: str, sol: str) -> float:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify

        timeout = self._timeout()
        parsing = None if timeout is None else 2 * timeout  # TRL's accuracy_reward: parsing 10 s, verifying 5 s
        with _keep_outer_alarm():
            gold = parse(sol, parsing_timeout=parsing)
            if not gold:
                raise Unjudgeable(f"math-verify could not parse metadata 'solution' {sol!r} (TRL skips the sample)")
            pred = parse(text, extraction_config=[LatexExtractionConfig(
                normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
                try_extract_without_anchor=False)], extraction_mode="first_match", parsing_timeout=parsing)
            if not pred:
                raise Unparseable("math-verify found no LaTeX answer in the completion (TRL's extraction)")
            return float(verify(gold, pred, timeout_seconds=timeout))
