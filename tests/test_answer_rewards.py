"""Answer rewards (mmrl.rewards.answer) on hand-worked cases; composition of text rewards."""
from __future__ import annotations

import math
import re

import pytest
import torch

from mmrl.rewards import ComposedReward, build_reward, build_rewards
from mmrl.rewards._text import Unparseable, parse_number
from mmrl.rewards.answer import (
    extract_answer,
    fgrpr_precision,
    multi_choice_credit,
    parse_choice,
    parse_choice_set,
    think_answer_format,
)

NAN = float("nan")


def same(a: torch.Tensor, b: list[float]) -> bool:
    return torch.allclose(a, torch.tensor(b, dtype=torch.float32), equal_nan=True, atol=1e-6)


# --------------------------------------------------------------------------------------------
# format
# --------------------------------------------------------------------------------------------

ANCHOR = r"<think>.*?</think>\s*<answer>.*?</answer>"  # VLM-R1 / Video-R1 format regex (fullmatch, DOTALL)


@pytest.mark.parametrize("text", [
    "<think>the cat is left</think><answer>B</answer>",
    "\n  <think>\nstep 1\nstep 2\n</think>\n\n<answer> [1, 2, 3, 4] </answer>\n",
    "<think></think><answer>3</answer>",  # an empty think block is allowed
])
def test_format_accepts_exactly_one_think_then_one_answer(text):
    assert think_answer_format(text) == 1.0


@pytest.mark.parametrize("text", [
    "<think>a</think><answer>B</answer><answer>C</answer>",       # repeated answer block
    "<think>a</think><think>b</think><answer>B</answer>",         # repeated think block
    "<think>a<think>b</think></think><answer>B</answer>",         # nested think
    "<think>maybe <answer>A</answer></think><answer>B</answer>",  # answer nested in think
    "<think>a</think><answer><answer>B</answer></answer>",        # nested answer
    "<think>a</think><answer>   </answer>",                       # empty answer
    "Sure! <think>a</think><answer>B</answer>",                   # text before
    "<think>a</think><answer>B</answer> Hope this helps.",        # text after
    "<think>a</think> so <answer>B</answer>",                     # text between
    "<answer>B</answer><think>a</think>",                         # wrong order
    "<answer>B</answer>",                                         # no think
    "<think>a</think><answer>B",                                  # unclosed
])
def test_format_rejects_everything_else(text):
    assert think_answer_format(text) == 0.0


def test_format_rejects_the_second_answer_block_the_anchor_regex_accepts():
    text = "<think>a</think><answer>B</answer><answer>C</answer>"
    assert re.fullmatch(ANCHOR, text, re.DOTALL)  # the anchors' reward would give this 1.0
    assert think_answer_format(text) == 0.0


def test_format_reward_object():
    r = build_reward("think_answer_format")
    out = r(["<think>x</think><answer>A</answer>", "<answer>A</answer>", None], None, None)
    assert same(out["think_answer_format"], [1.0, 0.0, NAN])
    assert r.last_info["nan_samples"] == {2: "completion is not a string (got NoneType)"}


def test_extract_answer():
    assert extract_answer("<think>x</think><answer> B. red </answer>") == "B. red"
    assert extract_answer("no tags at all") is None
    assert extract_answer("<answer>A</answer><answer>B</answer>") is None  # ambiguous: refused
    assert extract_answer("<answer>  </answer>") is None
    assert extract_answer("<answer>A") is None


# --------------------------------------------------------------------------------------------
# choice letters
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer,letter", [
    ("B", "B"), ("(B)", "B"), ("B.", "B"), ("b", "B"), ("b)", "B"),
    ("Answer: B", "B"), ("The answer is (C).", "C"), ("Option D", "D"),
    ("B. the red car", "B"), ("(B) the red car", "B"), ("B, because it is red", "B"),
    ("I think the answer is C", "C"),  # leading "I" is no option of four; "answer is C" is
])
def test_parse_choice_tolerant_forms(answer, letter):
    assert parse_choice(answer, ["w", "x", "y", "z"]) == letter


@pytest.mark.parametrize("answer,second", [
    ("B, C", "C"), ("B or C", "C"), ("The answer is B or C.", "C"), ("(B)/(C)", "C"), ("B and D", "D"),
    ("B, C, D", "C"),
])
def test_parse_choice_refuses_a_hedge(answer, second):
    """Two letters listed as the answer are not the first one: a reward that read "B, C" as B pays for listing."""
    with pytest.raises(Unparseable, match=f"more than one choice \\(B and {second}\\)"):
        parse_choice(answer, ["w", "x", "y", "z"])
    assert parse_choice("The answer is B, since C is wrong", ["w", "x", "y", "z"]) == "B"  # an argument, no list
    assert parse_choice("B, I think", ["w", "x", "y", "z"]) == "B"


def test_parse_choice_without_choices():
    assert parse_choice("I think the answer is C") == "C"   # not the pronoun "I"
    assert parse_choice("B. The answer is unclear") == "B"  # "answer is u..." names no letter
    assert parse_choice("D") == "D"


def test_parse_choice_reads_a_leading_article_as_a_word():
    # "A cat" names option B's text after the article, not option A (it scored 1 against solution A)
    assert parse_choice("A cat", ["dog", "cat"]) == "B"
    assert parse_choice("A cat.", ["dog", "cat"]) == "B"
    assert parse_choice("A dog", ["dog", "cat"]) == "A"
    assert parse_choice("A cat sits on the mat", ["dog", "cat"]) == "A"  # not an option's text: the letter
    assert parse_choice("A. cat", ["dog", "cat"]) == "A" and parse_choice("A, because", ["dog", "cat"]) == "A"
    assert parse_choice("B because it barks", ["dog", "cat"]) == "B"
    meta = [{"solution": "A", "choices": ["dog", "cat"]}]
    out = build_reward("choice_accuracy")(["<answer>A cat</answer>"], None, meta)
    assert out["choice_accuracy"].tolist() == [0.0]


@pytest.mark.parametrize("template", ["{} is correct", "{} because the red one is visible", "{}, the red one",
                                      "{} is the answer", "({}) is correct"])
def test_parse_choice_reads_every_letter_alike(template):
    """Relabelling the options changes no parse: "A is correct" is A as "B is correct" is B (A and I were read as
    the article / pronoun, so these answers scored 0 only when the solution was A: 0 of 16 for A, 16 of 16 for B-H
    in an audit)."""
    choices = [f"option {i}" for i in range(9)]
    for letter in "ABCDEFGHI":
        assert parse_choice(template.format(letter), choices) == letter


def test_parse_choice_option_text_and_range():
    choices = ["a blue car", "the red car", "a bus"]
    assert parse_choice("The red car.", choices) == "B"
    with pytest.raises(Unparseable, match="not one of the options A-C"):
        parse_choice("E", choices)
    with pytest.raises(Unparseable, match="no choice letter"):
        parse_choice("it is red", choices)


def test_choice_accuracy_counts_unparseable_and_nans_missing_solution():
    r = build_reward("choice_accuracy")
    completions = [
        "<think>.</think><answer>(B)</answer>",   # right
        "<think>.</think><answer>Answer: C</answer>",  # wrong letter
        "<think>.</think><answer>the red car</answer>",  # option text -> B, right
        "<think>.</think>B",                       # no answer block: unparseable, 0
        "<answer>E</answer>",                      # out of range: unparseable, 0
        "<answer>B</answer>",                      # no solution: NaN
    ]
    meta = [{"solution": "B", "choices": ["a", "the red car", "c", "d"]}] * 5 + [{"choices": ["a", "b"]}]
    out = r(completions, None, meta)
    assert same(out["choice_accuracy"], [1, 0, 1, 0, 0, NAN])
    info = r.last_info
    assert info["num_unparseable"] == 2
    assert set(info["unparseable_samples"]) == {3, 4}
    assert info["num_nan"] == 1 and "solution" in info["nan_samples"][5]


def test_choice_accuracy_solution_forms():
    r = build_reward("choice_accuracy")
    meta = [{"solution": "<answer>C</answer>"}, {"solution": "(C) a bus", "choices": ["x", "y", "a bus"]},
            {"solution": "a bus", "choices": ["x", "y", "a bus"]}, {"solution": "not a letter at all"}]
    out = r(["<answer>C</answer>"] * 4, None, meta)
    assert same(out["choice_accuracy"], [1, 1, 1, NAN])


def test_choice_accuracy_without_tags_when_allowed():
    strict, loose = build_reward("choice_accuracy"), build_reward("choice_accuracy", require_tags=False)
    assert strict(["B"], None, [{"solution": "B"}])["choice_accuracy"].item() == 0.0
    assert strict.last_info["num_unparseable"] == 1
    assert loose(["B"], None, [{"solution": "B"}])["choice_accuracy"].item() == 1.0


# --------------------------------------------------------------------------------------------
# multi-select (TW-GRPO)
# --------------------------------------------------------------------------------------------


def test_multi_choice_credit_rule():
    gt = {"A", "C"}
    assert multi_choice_credit({"A"}, gt) == 0.5          # a correct subset: its share
    assert multi_choice_credit({"A", "C"}, gt) == 1.0
    assert multi_choice_credit({"A", "B"}, gt) == 0.0     # one wrong letter: nothing
    assert multi_choice_credit({"A", "C", "D"}, gt) == 0.0
    assert multi_choice_credit({"A"}, {"A", "B", "C"}) == pytest.approx(1 / 3)
    assert multi_choice_credit({"A"}, gt, partial_credit=False) == 0.0
    assert multi_choice_credit({"A", "C"}, gt, partial_credit=False) == 1.0


def test_parse_choice_set_forms():
    assert parse_choice_set("A, C") == {"A", "C"}
    assert parse_choice_set("(C) and (A)") == {"A", "C"}
    assert parse_choice_set("Answer: a;c") == {"A", "C"}
    assert parse_choice_set(["C", "A"]) == {"A", "C"}
    with pytest.raises(Unparseable):
        parse_choice_set("A, maybe C")
    with pytest.raises(Unparseable):
        parse_choice_set("AC")
    with pytest.raises(Unparseable):
        parse_choice_set("E", ["a", "b", "c"])


def test_multi_choice_reward():
    r = build_reward("multi_choice_accuracy")
    completions = ["<answer>A</answer>", "<answer>C, A</answer>", "<answer>A, B</answer>",
                   "<answer>not letters</answer>", "<answer>A</answer>"]
    meta = [{"solution": "<answer>A,C</answer>"}, {"solution": ["A", "C"]}, {"solution": "A, C"},
            {"solution": "A,C"}, {}]
    out = r(completions, None, meta)
    assert same(out["multi_choice_accuracy"], [0.5, 1.0, 0.0, 0.0, NAN])
    assert same(out["exact"], [0.0, 1.0, 0.0, 0.0, NAN])
    assert r.last_info["num_unparseable"] == 1 and 3 in r.last_info["unparseable_samples"]
    strict = build_reward("multi_choice_accuracy", partial_credit=False)
    assert same(strict(completions[:2], None, meta[:2])["multi_choice_accuracy"], [0.0, 1.0])


# --------------------------------------------------------------------------------------------
# numbers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,value", [
    ("3", 3.0), ("There are 3 cats.", 3.0), ("-2.5", -2.5), ("1,234", 1234.0), ("3/4", 0.75),
    ("50%", 50.0), ("1e3", 1000.0), ("seven", 7.0), ("12.5s", 12.5), ("3.0 or 3", 3.0),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["3 or 4", "2-3", "none", "1, 2"])
def test_parse_number_refuses_ambiguous(text):
    with pytest.raises(Unparseable):
        parse_number(text)


def test_numeric_accuracy_tolerances():
    r = build_reward("numeric_accuracy", rel_tol=0.05, abs_tol=0.0)
    out = r(["<answer>10.4</answer>", "<answer>10.6</answer>", "<answer>ten</answer>", "<answer>3 or 4</answer>",
             "<answer>1,000</answer>", "<answer>5</answer>"], None,
            [{"solution": "10"}, {"solution": 10}, {"solution": "10"}, {"solution": 10}, {"solution": 1000},
             {"solution": "many"}])
    # |10.4-10| = 0.4 <= 0.05*10 = 0.5 ; 0.6 > 0.5 ; "ten" = 10 ; ambiguous -> 0 ; 1000 ; bad solution -> NaN
    assert same(out["numeric_accuracy"], [1, 0, 1, 0, 1, NAN])
    assert same(out["abs_error"], [0.4, 0.6, 0.0, NAN, 0.0, NAN])
    assert r.last_info["num_unparseable"] == 1
    a = build_reward("numeric_accuracy", rel_tol=0.0, abs_tol=0.25)
    assert same(a(["<answer>0.2</answer>", "<answer>0.3</answer>"], None, [{"solution": 0}] * 2)["numeric_accuracy"], [1, 0])


def test_fgrpr_rule_hand_worked():
    # CrowdVLM-R1: e = |pred - gt| / gt ; 1.5 - e if e < 0.5 else 0
    assert fgrpr_precision(100, 100) == 1.5
    assert fgrpr_precision(90, 100) == pytest.approx(1.4)
    assert fgrpr_precision(130, 100) == pytest.approx(1.2)
    assert fgrpr_precision(51, 100) == pytest.approx(1.01)
    assert fgrpr_precision(150, 100) == 0.0  # e = 0.5 exactly: not < 0.5
    assert fgrpr_precision(49, 100) == 0.0
    assert fgrpr_precision(0, 0) == 1.5 and fgrpr_precision(1, 0) == 0.0


def test_numeric_fuzzy_reward():
    r = build_reward("numeric_fuzzy")
    out = r(["<answer>90</answer>", "<answer>about 200 people</answer>", "<answer>lots</answer>"], None,
            [{"solution": 100}] * 3)
    assert same(out["numeric_fuzzy"], [1.4, 0.0, 0.0])
    assert same(out["relative_error"], [0.1, 1.0, NAN])
    assert r.last_info["num_unparseable"] == 1
    e = build_reward("numeric_fuzzy", rule="exp", tau=0.5)
    assert e(["<answer>15</answer>"], None, [{"solution": 10}])["numeric_fuzzy"].item() == pytest.approx(math.exp(-1))
    with pytest.raises(ValueError, match="unknown rule"):
        build_reward("numeric_fuzzy", rule="linear")


# --------------------------------------------------------------------------------------------
# math (math-verify)
# --------------------------------------------------------------------------------------------


def test_math_accuracy():
    r = build_reward("math_accuracy")
    completions = ["<answer>\\frac{1}{2}</answer>", "<answer>The result is $\\boxed{0.5}$</answer>",
                   "<answer>x^2+1</answer>", "<answer>0.25</answer>", "<answer>hello</answer>", "<answer>1</answer>"]
    meta = [{"solution": "0.5"}, {"solution": "$\\frac{1}{2}$"}, {"solution": "1+x^2"}, {"solution": "1/2"},
            {"solution": "3"}, {"solution": "no math here"}]
    out = r(completions, None, meta)
    assert same(out["math_accuracy"], [1, 1, 1, 0, 0, NAN])
    assert r.last_info["num_unparseable"] == 1 and 4 in r.last_info["unparseable_samples"]
    assert "could not parse" in r.last_info["nan_samples"][5]


def test_math_accuracy_keeps_an_outer_alarm_running():
    import signal

    if not hasattr(signal, "setitimer"):
        pytest.skip("no setitimer on this platform")
    old_handler = signal.signal(signal.SIGALRM, lambda *a: None)
    old_timer = signal.setitimer(signal.ITIMER_REAL, 300.0)
    try:
        build_reward("math_accuracy")(["<answer>1/2</answer>"], None, [{"solution": "0.5"}])
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 200.0  # math-verify's alarm(0) did not cancel it
    finally:
        signal.setitimer(signal.ITIMER_REAL, *old_timer)
        signal.signal(signal.SIGALRM, old_handler)


# --------------------------------------------------------------------------------------------
# the batch contract and composition of text rewards
# --------------------------------------------------------------------------------------------


def test_text_batch_shape_errors():
    r = build_reward("choice_accuracy")
    with pytest.raises(ValueError, match="list of N strings"):
        r("<answer>B</answer>", None, [{"solution": "B"}])
    with pytest.raises(ValueError, match="2 completions but 1 metadata"):
        r(["a", "b"], None, [{"solution": "B"}])
    with pytest.raises(ValueError, match="2 completions but 3 prompts"):
        r(["a", "b"], ["p"] * 3, None)
    out = r([], None, [])
    assert out["choice_accuracy"].shape == (0,)


def test_outputs_are_float32_cpu_of_length_n():
    out = build_reward("numeric_fuzzy")(["<answer>1</answer>"] * 3, ["q"] * 3, [{"solution": 1}] * 3)
    for t in out.values():
        assert t.dtype == torch.float32 and t.device.type == "cpu" and t.shape == (3,)


def test_composed_text_rewards():
    composed = build_rewards({"choice_accuracy": 1.0, "think_answer_format": 0.5,
                              "count": {"reward": "numeric_fuzzy", "weight": 0.0}})
    completions = ["<think>.</think><answer>B</answer>", "<answer>B</answer>", "<think>.</think>B", "<answer>A</answer>"]
    meta = [{"solution": "B"}, {"solution": "B"}, {"solution": "B"}, {}]
    out = composed(completions, None, meta)
    assert same(out["choice_accuracy"], [1, 1, 0, NAN])
    assert same(out["think_answer_format"], [1, 0, 0, 0])
    assert same(out["total"], [1.5, 1.0, 0.0, NAN])  # weight-0 "count" (all NaN) never poisons the total
    assert "count/relative_error" in out
    assert composed.weights == {"choice_accuracy": 1.0, "think_answer_format": 0.5}
    info = composed.last_info
    assert info["components"]["choice_accuracy"]["num_unparseable"] == 1
    assert "choice_accuracy" in info["total"]["nan_samples"][3]
    with pytest.raises(ValueError, match="2 completions but 1 metadata"):
        composed(["a", "b"], None, [{}])


def test_composed_text_path_passes_completions_to_plain_callables():
    seen = {}

    def plain(completions, prompts, metadata=None):
        seen["args"] = (completions, prompts, metadata)
        return {"plain": torch.tensor([float(len(c)) for c in completions])}

    plain.name, plain.needs_prompts = "plain", False
    out = ComposedReward({"plain": (plain, 2.0)})(["ab", "abcd"], ["p", "q"], None)
    assert seen["args"] == (["ab", "abcd"], ["p", "q"], None)
    assert same(out["total"], [4.0, 8.0])


# ------------------------------------------------------------------------------------------ chart_accuracy


def test_relaxed_correctness_is_chartqas_rule():
    from mmrl.rewards.answer import relaxed_correctness

    assert relaxed_correctness("100", "104.9") and relaxed_correctness("100", "95")      # within 5 %
    assert not relaxed_correctness("100", "105.1") and not relaxed_correctness("100", "94.9")
    assert relaxed_correctness("0.12", "12%")          # a prediction's % divides by 100
    assert not relaxed_correctness("12", "12%")        # ... so 12% is 0.12, not 12
    assert relaxed_correctness("12%", "0.121")         # the reference's % too
    assert not relaxed_correctness("0", "0.0")         # a zero reference falls back to the exact string
    assert relaxed_correctness("0", " 0 ")
    assert relaxed_correctness("Yes", "yes") and not relaxed_correctness("Yes", "yes.")
    assert relaxed_correctness("2019", "2019.0") and relaxed_correctness("1990", "2019")  # the rule's known leniency
    assert not relaxed_correctness("1990", "2100")


def test_chart_accuracy_reward():
    reward = build_reward("chart_accuracy")
    texts = ["<think>t</think><answer>41.5</answer>", "<answer>Canada</answer>", "<answer>7</answer>", "no tags",
             "<answer>3</answer>"]
    meta = [{"solution": "42"}, {"solution": ["USA", "canada"]}, {"solution": "7.5"}, {"solution": "1"}, {}]
    scores = reward(texts, None, meta)["chart_accuracy"]
    assert scores[:4].tolist() == [1.0, 1.0, 0.0, 0.0] and math.isnan(scores[4].item())
    assert reward.last_info["num_unparseable"] == 1
    loose = build_reward("chart_accuracy", max_relative_change=0.1)
    assert loose(["<answer>7</answer>"], None, [{"solution": 7.5}])["chart_accuracy"].tolist() == [1.0]
    with pytest.raises(ValueError, match="max_relative_change"):
        build_reward("chart_accuracy", max_relative_change=-1)


def test_math_accuracy_trl_convention_is_trls_accuracy_reward():
    """convention="trl": trl.rewards.accuracy_reward (TRL 1.16) as it calls math-verify, written out here."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    def trl(content, sol):
        gold = parse(sol)
        if not gold:
            return None
        answer = parse(content, extraction_config=[LatexExtractionConfig(
            normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
            try_extract_without_anchor=False)], extraction_mode="first_match")
        return float(verify(gold, answer))

    cases = [("<answer>3</answer>", "3", 0.0),  # plain text: TRL's extraction needs LaTeX
             (r"My answer is \boxed{\frac{1}{3}}", r"\frac{1}{3}", 1.0),  # TRL's own docstring example
             (r"My answer is \boxed{\frac{1}{2}}", r"\frac{1}{3}", 0.0),
             ("The answer is $12$ apples", "12", 1.0),
             (r"first $\frac{1}{2}$, finally $\boxed{3}$", "3", 1.0),  # boxed first (boxed_match_priority=0)
             ("no math here", "5", 0.0),
             ("$3$", "hello world", None)]  # the gold does not parse: TRL skips it (None), mmrl NaN
    r = build_reward("math_accuracy", convention="trl")
    out = r([c for c, _, _ in cases], None, [{"solution": s} for _, s, _ in cases])["math_accuracy"].tolist()
    for (content, sol, value), got in zip(cases, out):
        want = trl(content, sol)
        assert want == value, content
        assert (math.isnan(got) and want is None) or got == want, content
    # the default reads the answer block and plain numbers
    assert build_reward("math_accuracy")(["<answer>3</answer>"], None, [{"solution": "3"}])["math_accuracy"].item() == 1.0
    with pytest.raises(ValueError, match="unknown convention"):
        build_reward("math_accuracy", convention="verl")


def test_think_answer_format_conventions_are_the_anchors_patterns():
    """The anchors' format rewards written out: VLM-R1 / Video-R1 format_reward (fullmatch), Time-R1's (fullmatch on
    the stripped text), VLM-R1's REC format_reward_rec (search, a whole-number box in braces required)."""
    r1 = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
    rec = re.compile(r"<think>.*?</think>\s*<answer>.*?\{.*\[\d+,\s*\d+,\s*\d+,\s*\d+\].*\}.*?</answer>", re.DOTALL)
    official = {"r1": lambda t: r1.fullmatch(t) is not None, "time_r1": lambda t: r1.fullmatch(t.strip()) is not None,
                "vlm_r1_rec": lambda t: rec.search(t) is not None}
    texts = ["<think>a</think><answer>b</answer>", " <think>a</think>\n<answer>b</answer>\n",
             "<think>a</think><answer></answer>", "<think>a</think><answer>1</answer><answer>2</answer>",
             'pre <think>x</think> <answer>{"bbox_2d": [1, 2, 3, 4]}</answer> post',
             '<think>x</think><answer>{"bbox_2d": [1.5, 2, 3, 4]}</answer>', "<answer>b</answer>"]
    for convention, rule in official.items():
        got = build_reward("think_answer_format", convention=convention)(texts)["think_answer_format"].tolist()
        assert got == [float(rule(t)) for t in texts], convention
    mmrl = build_reward("think_answer_format")(texts)["think_answer_format"].tolist()
    assert mmrl == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]  # the strict default: one non-empty block of each
    assert build_reward("think_answer_format", convention="r1")(texts)["think_answer_format"].tolist()[2:4] == [1.0, 1.0]
