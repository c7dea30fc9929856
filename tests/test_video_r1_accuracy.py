"""video_r1_accuracy against Video-R1's accuracy_reward (src/r1-v/src/open_r1/grpo.py), its rules written out here
from the official code, on hand-worked answers of every problem type."""
from __future__ import annotations

import math
import re

import pytest

from mmrl.rewards import build_reward
from mmrl.rewards.video_r1 import word_error_rate


def official(content: str, sol: str, question_type: str) -> float:
    """Video-R1's accuracy_reward for one sample, as its code computes it (exceptions score 0)."""
    def extract_answer(text):
        match = re.search(r"<answer>\s*(.*?)\s*</answer>", text, re.DOTALL)
        return match.group(1).strip() if match else ""

    def normalize_number(num_str):
        try:
            return float(num_str.replace(",", ""))
        except Exception:
            return None

    def wer(reference, hypothesis):
        r, h = reference.split(), hypothesis.split()
        d = [[0] * (len(h) + 1) for _ in range(len(r) + 1)]
        for i in range(len(r) + 1):
            d[i][0] = i
        for j in range(len(h) + 1):
            d[0][j] = j
        for i in range(1, len(r) + 1):
            for j in range(1, len(h) + 1):
                d[i][j] = d[i - 1][j - 1] if r[i - 1] == h[j - 1] else 1 + min(d[i - 1][j], d[i][j - 1], d[i - 1][j - 1])
        return d[len(r)][len(h)] / max(1, len(r))

    try:
        out, gt = extract_answer(content), extract_answer(sol)
        if question_type == "multiple choice":
            return 1.0 if out.strip() == gt.strip() else 0.0
        if question_type == "numerical":
            if (("." in gt) or ("," in gt)) != (("." in out) or ("," in out)):
                return 0.0
            g, o = normalize_number(gt), normalize_number(out)
            if g is None or o is None:
                return 0.0
            return 1.0 if round(g, 2) == round(o, 2) else 0.0
        if question_type == "OCR":
            return max(0.0, min(1.0, 1 - wer(gt, out)))
        if question_type == "free-form":
            from rouge_score import rouge_scorer

            s = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True).score(gt, out)
            return max(0.0, min(1.0, (s["rouge1"].fmeasure + s["rouge2"].fmeasure + s["rougeL"].fmeasure) / 3))
        if question_type == "regression":
            g, o = normalize_number(gt), normalize_number(out)
            rel = min(1.0, max(0.0, (abs(o - g) + 1e-9) / (abs(g) + 1e-9)))
            return 1 - rel
        return 0.0
    except Exception:
        return 0.0


def ans(text: str) -> str:
    return f"<think>let me see</think><answer>{text}</answer>"


CASES = [  # (problem_type, answer, solution, hand-worked value)
    ("multiple choice", "B", "B", 1.0),
    ("multiple choice", " B ", "B", 1.0),  # the answer block is stripped
    ("multiple choice", "B.", "B", 0.0),  # exact string match only
    ("multiple choice", "(B)", "B", 0.0),
    ("numerical", "3", "3", 1.0),
    ("numerical", "3.0", "3", 0.0),  # a decimal point in one and not the other
    ("numerical", "2.999", "3.00", 1.0),  # equal at 2 decimals
    ("numerical", "2.994", "3.00", 0.0),
    ("numerical", "1,234", "1234", 0.0),  # ',' counts as a decimal mark in the check
    ("numerical", "1,234", "1,234.0", 1.0),
    ("numerical", "three", "3", 0.0),
    ("OCR", "the quick brown fox", "the quick brown fox", 1.0),
    ("OCR", "the quick fox", "the quick brown fox", 0.75),  # one deletion of 4 words
    ("OCR", "a b c d e f g h", "x", 0.0),  # WER above 1 clips to 0
    ("free-form", "a cat runs", "the cats are running", None),  # ROUGE: worked out by rouge-score below
    ("free-form", "the cats are running", "the cats are running", 1.0),
    ("regression", "9", "10", 0.9),
    ("regression", "30", "10", 0.0),  # relative error clipped at 1
    ("regression", "ten", "10", 0.0),
    ("regression", "0", "0", 1 - 1e-9 / 1e-9),  # (0 + 1e-9) / (0 + 1e-9) = 1: 0
]


@pytest.mark.parametrize("problem_type, answer, solution, value", CASES)
def test_video_r1_accuracy_equals_the_official_rule(problem_type, answer, solution, value):
    r = build_reward("video_r1_accuracy")
    got = r([ans(answer)], None, [{"problem_type": problem_type, "solution": f"<answer>{solution}</answer>"}])
    want = official(ans(answer), f"<answer>{solution}</answer>", problem_type)
    assert got["video_r1_accuracy"].item() == pytest.approx(want, abs=1e-6)
    if value is not None:
        assert want == pytest.approx(value, abs=1e-9)


def test_free_form_is_the_mean_of_rouge_1_2_l():
    r = build_reward("video_r1_accuracy")
    # "a cat runs" vs "the cats are running", stemmed: cat, run shared -> R1 P 2/3, R 2/4, F 4/7; R2 0; RL 4/7
    got = r([ans("a cat runs")], None, [{"problem_type": "free-form", "solution": "<answer>the cats are running</answer>"}])
    assert got["video_r1_accuracy"].item() == pytest.approx((4 / 7 + 0 + 4 / 7) / 3, abs=1e-6)


def test_word_error_rate_by_hand():
    assert word_error_rate("a b c d", "a c d") == 0.25
    assert word_error_rate("a b", "x y z") == 1.5
    assert word_error_rate("", "a") == 1.0  # over max(1, 0) words


def test_each_sample_its_own_type_and_mmrl_rules_for_bad_input():
    r = build_reward("video_r1_accuracy")
    out = r([ans("B"), ans("3"), "no tags at all", ans("B"), ans("B"), ans("5")], None, [
        {"problem_type": "multiple choice", "solution": "<answer>B</answer>"},
        {"problem_type": "numeric", "solution": "3"},  # mmrl's spelling; a solution without tags is read whole
        {"problem_type": "multiple choice", "solution": "<answer>B</answer>"},  # unparseable: 0, counted
        {"problem_type": "essay", "solution": "<answer>B</answer>"},  # unknown type: NaN
        {"solution": "<answer>B</answer>"},  # no type: NaN
        {"problem_type": "regression"},  # no solution: NaN
    ])["video_r1_accuracy"].tolist()
    assert out[:3] == [1.0, 1.0, 0.0] and all(math.isnan(v) for v in out[3:])
    assert r.last_info["num_unparseable"] == 1
    assert "'essay' is not one of" in r.last_info["nan_samples"][3]


@pytest.mark.parametrize("answer", ["nan", "NaN", "inf", "-inf"])
def test_a_non_finite_regression_answer_scores_0_not_the_anchors_1(answer):
    """mmrl's rule: Video-R1's code reads "nan" as a float, its relative error is NaN and min(1, max(0, nan)) is 0,
    so "nan" scores 1.0 on every regression question (a reward hack); here a non-finite answer is not a number."""
    r = build_reward("video_r1_accuracy")
    meta = [{"problem_type": "regression", "solution": "<answer>10</answer>"}]
    assert r([ans(answer)], None, meta)["video_r1_accuracy"].item() == 0.0
    if answer.lower() == "nan":
        assert official(ans(answer), "<answer>10</answer>", "regression") == 1.0  # the hack, as the anchor scores it


@pytest.mark.parametrize("problem_type", ["numerical", "regression"])
@pytest.mark.parametrize("solution", ["nan", "<answer>inf</answer>", "<answer>three</answer>"])
def test_a_numeric_solution_that_is_not_a_number_is_nan_with_the_reason(problem_type, solution):
    """mmrl's rule: the label is broken, not the answer (the anchor's except gives 0 to every answer, 1 to none)."""
    r = build_reward("video_r1_accuracy")
    got = r([ans("3")], None, [{"problem_type": problem_type, "solution": solution}])["video_r1_accuracy"]
    assert math.isnan(got.item())
    assert "is not a number" in r.last_info["nan_samples"][0] and problem_type in r.last_info["nan_samples"][0]
