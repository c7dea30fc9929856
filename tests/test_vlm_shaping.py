"""Hand-worked checks of the rollout-shaping plug-ins ttrv, trust_grpo, g2rpo_shaping and the BMAS reward (each
rule's numbers are derived by hand in the comments)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

import mmrl.algorithms.g2rpo_shaping  # noqa: F401 - registers the variants even where the package's list lacks them
import mmrl.algorithms.trust_grpo  # noqa: F401
import mmrl.algorithms.ttrv  # noqa: F401
from mmrl.algorithms.base import (RewardContext, TransformContext, VariantError, describe_variant, lookup,
                                  parse_spec)
from mmrl.algorithms.g2rpo_shaping import (G2RPOShaping, G2RPOShapingOptions, entropy_band_weights,
                                           group_failure_rate, length_rewards)
from mmrl.algorithms.trust_grpo import TrustGRPO, TrustGRPOOptions, anneal_factor, trust_factors
from mmrl.algorithms.ttrv import TTRV, TTRVOptions, answer_key, ttrv_rewards
from mmrl.rewards import MissingWeightsError, build_reward, list_rewards
from mmrl.rewards.bmas import bmas_similarity

NAN = float("nan")


def reward_ctx(completions=None, group_ids=None, scores=None, weights=None, metadata=None, mask=None, update=0,
               steps=10):
    n = len(completions) if completions is not None else len(group_ids)
    rollout = SimpleNamespace(completions=completions or [""] * n, group_ids=torch.tensor(group_ids),
                              metadata=metadata or [{} for _ in range(n)], mask=mask)
    config = SimpleNamespace(train=SimpleNamespace(steps=steps))
    return RewardContext(rollout=rollout, items=[], scores=scores or {}, weights=weights or {}, config=config,
                         policy=None, accelerator=None, update=update, score=None, score_outputs=None, sample=None,
                         intermediate=None, stats={}, timer={})


def ans(text: str) -> str:
    return f"<think>hm</think><answer>{text}</answer>"


def test_registered_with_stages_needs_and_families():
    expected = {
        "ttrv": (["rewards"], [], ["vlm"]),
        "trust_grpo": (["rewards"], [], ["vlm"]),
        "g2rpo_shaping": (["rewards", "transform"], ["old_logps"], ["vlm"]),
    }
    for name, (stages, needs, families) in expected.items():
        info = describe_variant(lookup(name))
        assert (info["stages"], info["needs"], info["families"]) == (stages, needs, families), name
        assert info["summary"] and "arXiv" in info["paper"] and all(o["help"] for o in info["options"]), name
    assert "bmas" in list_rewards()


# ------------------------------------------------------------------------------------------------- ttrv


def test_ttrv_frequency_and_entropy_by_hand():
    # group 0 (n = 4): cat, cat, dog, unparseable -> p(cat) = 2/4, p(dog) = 1/4 (the unparseable one dilutes)
    #   frequency = [1/2, 1/2, 1/4, 0]; entropy = 1 + log p / log 4 = [1 - 1/2, 1 - 1/2, 1 - 1, 0] = [.5, .5, 0, 0]
    # group 1 (n = 2): x, x -> p = 1 -> frequency [1, 1], entropy [1, 1]
    # group 2 (n = 1): y -> frequency 1, entropy 1 (a single answer has zero entropy)
    keys = ["cat", "cat", "dog", None, "x", "x", "y"]
    freq, ent, stats = ttrv_rewards(keys, [0, 0, 0, 0, 1, 1, 2])
    assert torch.allclose(freq, torch.tensor([0.5, 0.5, 0.25, 0.0, 1.0, 1.0, 1.0]))
    assert torch.allclose(ent, torch.tensor([0.5, 0.5, 0.0, 0.0, 1.0, 1.0, 1.0]))
    # parsed distributions: group 0 (2/3, 1/3) -> H = -(2/3 ln 2/3 + 1/3 ln 1/3) = 0.6365; groups 1, 2: H = 0
    h0 = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    assert stats["answer_entropy"] == pytest.approx(h0 / 3)
    assert stats["majority_share"] == pytest.approx((0.5 + 1 + 1) / 3) and stats["unparseable"] == 1


def test_ttrv_entropy_reward_averages_to_the_groups_negentropy():
    # answers a, a, a, b, b, c (n = 6): H = -(1/2 ln 1/2 + 1/3 ln 1/3 + 1/6 ln 1/6); mean entropy reward = 1 - H/ln 6
    keys = ["a", "a", "a", "b", "b", "c"]
    _, ent, stats = ttrv_rewards(keys, [0] * 6)
    h = -(0.5 * math.log(0.5) + 1 / 3 * math.log(1 / 3) + 1 / 6 * math.log(1 / 6))
    assert float(ent.mean()) == pytest.approx(1 - h / math.log(6))
    assert stats["answer_entropy"] == pytest.approx(h)


def test_ttrv_answer_keys_and_bad_input():
    from mmrl.rewards._text import Unjudgeable, Unparseable

    assert answer_key(ans(" The  Cat. "), {}) == answer_key(ans("the cat"), {}) == "the cat"
    assert answer_key(ans("three"), {}, "number") == answer_key(ans("3.0"), {}, "number") == 3.0
    choices = {"choices": ["red", "green", "blue"]}
    assert {answer_key(ans(t), choices, "choice") for t in ("B", "(B)", "B. green", "green")} == {"B"}
    for text, match in (("no tags", "text"), (ans("no number"), "number"), (ans("Z"), "choice"), (None, "text")):
        with pytest.raises(Unparseable):
            answer_key(text, choices, match)
    assert answer_key("no tags", {}, require_tags=False) == "no tags"
    with pytest.raises(Unjudgeable):
        answer_key(ans("A"), {"choices": "not a list"}, "choice")


def test_ttrv_variant_scores_weights_and_stats():
    # group 0: B, (B), Z (not an option: unparseable), bad choices (NaN, left out) -> n = 3, p(B) = 2/3
    #   frequency [2/3, 2/3, 0, NaN]; entropy 1 + ln(2/3)/ln 3 = 0.6309 for the two B's
    meta = [{"choices": ["red", "green", "blue"]}] * 3 + [{"choices": 7}]
    completions = [ans("B"), ans("(B)"), ans("Z"), ans("B")]
    ctx = reward_ctx(completions, [0, 0, 0, 0], scores={"acc": torch.ones(4)}, weights={"acc": 1.0}, metadata=meta)
    out = TTRV(TTRVOptions(match="choice", entropy_weight=0.5)).rewards(ctx)
    freq, ent = out.scores["ttrv_frequency"], out.scores["ttrv_entropy"]
    assert torch.allclose(freq[:3], torch.tensor([2 / 3, 2 / 3, 0.0])) and math.isnan(freq[3])
    e = 1 + math.log(2 / 3) / math.log(3)
    assert torch.allclose(ent[:3], torch.tensor([e, e, 0.0])) and math.isnan(ent[3])
    assert out.weights == {"ttrv_frequency": 1.0, "ttrv_entropy": 0.5}  # label-free: acc is logged only
    assert "acc" in out.scores and ctx.stats["ttrv/unparseable"] == 1
    TTRV(TTRVOptions(match="choice")).rewards(ctx)  # a second sampling round adds to the count
    assert ctx.stats["ttrv/unparseable"] == 2
    kept = TTRV(TTRVOptions(keep_weights=True, entropy_weight=0.0)).rewards(ctx)
    assert kept.weights == {"acc": 1.0, "ttrv_frequency": 1.0}


def test_ttrv_options_validation():
    for bad in ({"entropy_weight": -1.0}, {"entropy_weight": math.inf}, {"match": "regex"}):
        with pytest.raises(VariantError):
            parse_spec({"name": "ttrv", **bad}, 0)
    assert parse_spec({"name": "ttrv", "match": "number"}, 0).options.match == "number"


# ------------------------------------------------------------------------------------------------- trust_grpo


def test_trust_factors_by_hand():
    # group 0: correct thinking 0.2, 0.4 (mu_c = 0.3), incorrect 0.9, 0.7 (mu_w = 0.8) -> gamma = exp(-0.5)
    # group 1: correct 0.9, incorrect 0.1 and a NaN thinking reward (left out) -> mu_c >= mu_w -> gamma = 1
    # group 2: only correct responses (the NaN outcome is left out) -> homogeneous -> no_contrast = 0.25
    thinking = torch.tensor([0.2, 0.4, 0.9, 0.7, 0.9, 0.1, NAN, 0.5, 0.6])
    outcome = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, NAN])
    gamma, contrasted = trust_factors(thinking, outcome, [0, 0, 0, 0, 1, 1, 1, 2, 2], no_contrast=0.25)
    assert torch.allclose(gamma, torch.tensor([math.exp(-0.5)] * 4 + [1.0] * 3 + [0.25] * 2))
    assert contrasted.tolist() == [True] * 7 + [False] * 2
    # temperature 0.5: exp(-0.5 / 0.5) = exp(-1)
    gamma, _ = trust_factors(thinking[:4], outcome[:4], [0] * 4, temperature=0.5)
    assert torch.allclose(gamma, torch.full((4,), math.exp(-1.0)))


def test_trust_factors_follow_the_released_reward_manager():
    # SophiaVL-R1's CustomRewardManager (group mode), written out: homogeneous when every answer score is >= 0.9 or
    # every one <= 0.1 (discount 0); else correct = score >= 0.5, an empty side's mean is 0, and the discount is
    # multiplied by exp(c - w) when c < w and a correct answer exists
    def anchor(process, answer):
        if all(a >= 0.9 for a in answer) or all(a <= 0.1 for a in answer):
            return 0.0
        correct = [p for p, a in zip(process, answer) if a >= 0.5]
        wrong = [p for p, a in zip(process, answer) if a < 0.5]
        c = sum(correct) / len(correct) if correct else 0.0
        w = sum(wrong) / len(wrong) if wrong else 0.0
        return math.exp(c - w) if (c < w and correct) else 1.0

    rng = random.Random(0)
    for _ in range(200):
        n = rng.choice([2, 3, 4])
        answer = [rng.choice([0.0, 0.05, 0.3, 0.6, 0.95, 1.0]) for _ in range(n)]
        process = [rng.choice([-0.4, 0.0, 0.3, 0.8, 1.0]) for _ in range(n)]
        gamma, _ = trust_factors(torch.tensor(process), torch.tensor(answer), [0] * n)
        assert gamma.tolist() == pytest.approx([anchor(process, answer)] * n, abs=1e-6), (process, answer)


def test_anneal_schedules_by_hand():
    assert [anneal_factor(k, 10, "linear") for k in (0, 5, 10, 12)] == [1.0, 0.5, 0.0, 0.0]
    assert anneal_factor(5, 10, "cosine") == pytest.approx(0.5)  # (1 + cos(pi / 2)) / 2
    assert anneal_factor(0, 10, "cosine") == 1.0 and anneal_factor(10, 10, "cosine") == pytest.approx(0.0)
    # exp: the released code's exp(-global_step / T), its global step 1 at the first update (update 0 here)
    assert anneal_factor(0, 500) == pytest.approx(math.exp(-1 / 500))
    assert anneal_factor(9, 10, "exp") == pytest.approx(math.exp(-1.0))
    assert anneal_factor(7, 10, "none") == 1.0


def test_trust_grpo_variant_shapes_the_thinking_reward():
    # update 1 of 4 (linear): lambda = 1 - 1/4 = 0.75; group 0 as above (gamma = exp(-0.5)), group 1 gamma = 1
    thinking = torch.tensor([0.2, 0.4, 0.9, 0.7, 0.9, 0.1])
    outcome = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    ctx = reward_ctx(group_ids=[0, 0, 0, 0, 1, 1], scores={"think": thinking, "acc": outcome},
                     weights={"think": 0.5, "acc": 1.0}, update=1, steps=4)
    options = dict(thinking="think", outcome="acc", anneal="linear", anneal_steps=0, judge_from=-math.inf)
    out = TrustGRPO(TrustGRPOOptions(**options)).rewards(ctx)
    factor = torch.tensor([math.exp(-0.5)] * 4 + [1.0] * 2) * 0.75
    assert torch.allclose(out.scores["think"], factor * thinking)
    assert torch.allclose(out.scores["think_trust"], factor) and torch.equal(out.scores["think_raw"], thinking)
    assert out.weights == {"think": 0.5, "acc": 1.0}
    assert ctx.stats["trust_grpo/trust"] == pytest.approx((math.exp(-0.5) + 1) / 2)
    assert ctx.stats["trust_grpo/distrusted_groups"] == 1 and ctx.stats["trust_grpo/anneal"] == 0.75
    # anneal_steps overrides train.steps: 1 - 1/2 = 0.5; a NaN thinking reward stays NaN
    ctx.scores["think"] = torch.tensor([NAN, 0.4, 0.9, 0.7, 0.9, 0.1])
    out = TrustGRPO(TrustGRPOOptions(**{**options, "anneal_steps": 2})).rewards(ctx)
    assert math.isnan(out.scores["think"][0]) and ctx.stats["trust_grpo/anneal"] == 0.5
    assert out.scores["think"][4] == pytest.approx(0.45)


def test_trust_grpo_defaults_give_the_released_score():
    # the released code's group score: answer + exp(-step / 500) * 0.3 * gamma * process, process 0 where the answer
    # scores below 0.2 (never judged), gamma 0 for a homogeneous group; mmrl: rewards {acc: 1, think: 0.3}
    thinking = torch.tensor([0.6, 0.2, 0.9, 0.7, 0.5, 0.5])
    outcome = torch.tensor([1.0, 0.3, 0.0, 0.6, 1.0, 1.0])
    ctx = reward_ctx(group_ids=[0, 0, 0, 0, 1, 1], scores={"think": thinking, "acc": outcome},
                     weights={"think": 0.3, "acc": 1.0}, update=99, steps=1000)
    out = TrustGRPO(TrustGRPOOptions(thinking="think", outcome="acc")).rewards(ctx)
    # group 0: process [0.6, 0.2, 0 (answer 0 < 0.2), 0.7]; correct {0.6, 0.7} mean 0.65 >= wrong {0.2, 0} mean 0.1
    # -> gamma 1; group 1: every answer >= 0.9 -> 0. Step 100 (update 99, 1-based): exp(-100 / 500)
    lam = math.exp(-100 / 500)
    expected = torch.tensor([0.6, 0.2, 0.0, 0.7, 0.0, 0.0]) * torch.tensor([lam] * 4 + [0.0] * 2)
    assert torch.allclose(out.scores["think"], expected)
    total = outcome + 0.3 * out.scores["think"]
    assert torch.allclose(total, outcome + lam * 0.3 * torch.tensor([0.6, 0.2, 0.0, 0.7, 0.0, 0.0]))
    # a wrong answer that out-thinks the right ones: correct {0.2} vs wrong {0.9 (answer 0.3 >= 0.2: judged)}
    ctx.scores["think"], ctx.scores["acc"] = torch.tensor([0.2, 0.9]), torch.tensor([1.0, 0.3])
    ctx.rollout.group_ids = torch.tensor([0, 0])
    out = TrustGRPO(TrustGRPOOptions(thinking="think", outcome="acc")).rewards(ctx)
    assert torch.allclose(out.scores["think_trust"], torch.full((2,), lam * math.exp(0.2 - 0.9)))


def test_trust_grpo_options_and_config_checks():
    for bad in ({"thinking": "t"}, {"thinking": "t", "outcome": "t"}, {"thinking": "t", "outcome": "a",
                                                                       "temperature": 0.0},
                {"thinking": "t", "outcome": "a", "anneal": "step"}, {"thinking": "t", "outcome": "a",
                                                                      "no_contrast_trust": 2.0},
                {"thinking": "t", "outcome": "a", "all_wrong_at": 0.9, "all_correct_at": 0.1},
                {"thinking": "t", "outcome": "a", "judge_from": math.inf},
                {"thinking": "t", "outcome": "a", "threshold": math.nan}):
        with pytest.raises(VariantError):
            parse_spec({"name": "trust_grpo", **bad}, 0)
    variant = parse_spec({"name": "trust_grpo", "thinking": "think", "outcome": "acc"}, 0)
    variant.check(SimpleNamespace(rewards={"think": 0.5, "acc": 1.0}))
    with pytest.raises(VariantError, match="weight 0"):
        variant.check(SimpleNamespace(rewards={"think": 0.0, "acc": 1.0}))
    with pytest.raises(VariantError, match="not one of the configured rewards"):
        variant.check(SimpleNamespace(rewards={"think": 1.0}))


# ------------------------------------------------------------------------------------------------- g2rpo_shaping


def test_length_rewards_by_hand():
    # direct (budget 10): L = 5 -> 1; 15 -> 2 - 1.5 = 0.5; 25 -> 0.  reasoning (target 20): 10 -> 0.5; 40 -> 1
    lengths = torch.tensor([5.0, 15.0, 25.0, 10.0, 40.0])
    direct = torch.tensor([True, True, True, False, False])
    out = length_rewards(lengths, direct, direct_length=10, reasoning_length=20)
    assert torch.allclose(out, torch.tensor([1.0, 0.5, 0.0, 0.5, 1.0]))
    # difficulty scales only the reasoning samples: 0.5 * 0.5, 0.25 * 1
    out = length_rewards(lengths, direct, direct_length=10, reasoning_length=20,
                         difficulty=torch.tensor([0.0, 0.0, 0.0, 0.5, 0.25]))
    assert torch.allclose(out, torch.tensor([1.0, 0.5, 0.0, 0.25, 0.25]))


def test_group_failure_rate_by_hand():
    # group 0: outcomes 1, 0, 0, NaN -> 2 of 3 valid fail; group 1: only NaN -> counted as failed (1)
    rate = group_failure_rate(torch.tensor([1.0, 0.0, 0.0, NAN, NAN]), [0, 0, 0, 0, 1], 0.5)
    assert torch.allclose(rate, torch.tensor([2 / 3] * 4 + [1.0]))


def test_g2rpo_shaping_rewards_stage():
    # lengths (mask sums) 4, 12 in a grounding group, 6, 3 in a math group whose accuracy is 1, 0 (difficulty 1/2)
    # direct_length 8: 4 -> 1, 12 -> 2 - 1.5 = 0.5; reasoning_length 6: 0.5 * 1, 0.5 * 0.5
    mask = torch.zeros(4, 12)
    for row, length in enumerate((4, 12, 6, 3)):
        mask[row, :length] = 1
    meta = [{"task": "grounding"}] * 2 + [{"task": "math"}] * 2
    ctx = reward_ctx(group_ids=[0, 0, 1, 1], scores={"acc": torch.tensor([1.0, 1.0, 1.0, 0.0])},
                     weights={"acc": 1.0}, metadata=meta, mask=mask)
    options = G2RPOShapingOptions(direct_length=8, reasoning_length=6, outcome="acc", length_weight=0.2)
    out = G2RPOShaping(options).rewards(ctx)
    assert torch.allclose(out.scores["length_shaping"], torch.tensor([1.0, 0.5, 0.5, 0.25]))
    assert out.weights == {"acc": 1.0, "length_shaping": 0.2}
    assert ctx.stats["g2rpo_shaping/direct_length"] == 8 and ctx.stats["g2rpo_shaping/reasoning_length"] == 4.5
    off = G2RPOShaping(G2RPOShapingOptions(length_weight=0.0)).rewards(ctx)
    assert off.weights == {"acc": 1.0} and "length_shaping" not in off.scores


def test_entropy_band_by_hand():
    # surprisals s: row 0 [0.1, 0.5] (A = +1), row 1 [0.6, pad] (A = -1) -> H = (0.1 + 0.5 + 0.6) / 3 = 0.4
    # (H - s) * A: row 0: +0.3 (lowers the entropy), -0.1 (raises it); row 1: (0.4 - 0.6) * -1 = +0.2 (lowers)
    old = -torch.tensor([[0.1, 0.5], [0.6, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    # band [0.5, 1]: H < 0.5 -> collapse guard damps the lowering tokens (row 0 token 0, row 1 token 0) by 0.5
    w, h, gate = entropy_band_weights(adv, old, mask, low=0.5, high=1.0, damping=0.5)
    assert h == pytest.approx(0.4) and gate == -1 and torch.allclose(w, torch.tensor([[0.5, 1.0], [0.5, 0.0]]))
    # band [0.1, 0.3]: H > 0.3 -> explosion guard damps the raising token (row 0 token 1)
    w, _, gate = entropy_band_weights(adv, old, mask, low=0.1, high=0.3, damping=0.5)
    assert gate == 1 and torch.allclose(w, torch.tensor([[1.0, 0.5], [1.0, 0.0]]))
    w, _, gate = entropy_band_weights(adv, old, mask, low=0.1, high=1.0, damping=0.5)
    assert gate == 0 and torch.allclose(w, mask)


def test_g2rpo_shaping_transform_and_nan_log_probs():
    old = -torch.tensor([[0.1, 0.5], [0.6, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    rollout = SimpleNamespace(old_logps=old, mask=mask, group_ids=torch.tensor([0, 0]))
    ctx = TransformContext(advantages=torch.tensor([1.0, -1.0]), scores={}, rollout=rollout, update=0,
                           total_updates=1)
    variant = G2RPOShaping(G2RPOShapingOptions(entropy_low=0.5, entropy_high=1.0, damping=0.0))
    out = variant.transform(ctx)  # damping 0: the two lowering tokens drop out; padding stays 0
    assert torch.equal(out, torch.tensor([[0.0, 1.0], [0.0, 0.0]]))
    assert ctx.stats["g2rpo_shaping/entropy"] == pytest.approx(0.4)
    assert ctx.stats["g2rpo_shaping/entropy_gate"] == -1
    assert ctx.stats["g2rpo_shaping/damped_tokens"] == pytest.approx(2 / 3)
    # a NaN log-prob is no token: left out of H (= (0.1 + 0.5) / 2 = 0.3, in the band) and its advantage is 0
    rollout.old_logps = torch.tensor([[-0.1, -0.5], [NAN, 0.0]])
    ctx = TransformContext(advantages=torch.tensor([1.0, -1.0]), scores={}, rollout=rollout, update=0,
                           total_updates=1)
    out = G2RPOShaping(G2RPOShapingOptions(entropy_low=0.2, entropy_high=1.0)).transform(ctx)
    assert torch.equal(out, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert ctx.stats["g2rpo_shaping/entropy"] == pytest.approx(0.3)
    off = G2RPOShaping(G2RPOShapingOptions(entropy_shaping=False)).transform(ctx)
    assert torch.equal(off, ctx.advantages)


def test_g2rpo_shaping_options_and_config_checks():
    for bad in ({"entropy_low": 2.0, "entropy_high": 1.0}, {"damping": 1.5}, {"length_weight": -0.1},
                {"length_weight": 0.0, "entropy_shaping": False}, {"direct_tasks": "grounding"},
                {"direct_length": 0}, {"entropy_low": -0.1}):
        with pytest.raises(VariantError):
            parse_spec({"name": "g2rpo_shaping", **bad}, 0)
    assert parse_spec({"name": "g2rpo_shaping", "entropy_high": "inf"}, 0).options.entropy_high == math.inf
    variant = parse_spec({"name": "g2rpo_shaping", "outcome": "acc"}, 0)
    with pytest.raises(VariantError, match="not one of the configured rewards"):
        variant.check(SimpleNamespace(rewards={"iou": 1.0}))


# ------------------------------------------------------------------------------------------------- bmas


def test_bmas_similarity_by_hand():
    # x = [e1, (0.6, 0.8), e3] against y = [e1, e3]: precision = (1 + 0.6 + 1) / 3, recall = (1 + 1) / 2 = 1
    e1, e3 = [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]
    s = bmas_similarity(torch.tensor([e1, [0.6, 0.8, 0.0], e3]), torch.tensor([e1, e3]))
    assert s["precision"] == pytest.approx(2.6 / 3) and s["recall"] == pytest.approx(1.0)
    assert s["bmas"] == pytest.approx((2.6 / 3 + 1) / 2)
    # opposite vectors: -1 both ways; scale does not matter (cosine)
    assert bmas_similarity(torch.tensor([[2.0, 0.0]]), torch.tensor([[-1.0, 0.0]]))["bmas"] == pytest.approx(-1.0)
    with pytest.raises(ValueError):
        bmas_similarity(torch.zeros(0, 3), torch.ones(1, 3))


@pytest.fixture(scope="module")
def tiny_text_model():
    from mmrl.pipelines.vlm.tiny import build_tiny_vlm_tokenizer
    from transformers import Qwen2Config, Qwen2Model

    tokenizer = build_tiny_vlm_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=8, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64)
    return Qwen2Model(config).eval(), tokenizer


def test_bmas_reward_on_hand_set_token_embeddings(tiny_text_model):
    model, tokenizer = tiny_text_model
    ids = {w: tokenizer(w, add_special_tokens=False)["input_ids"] for w in ("a", " red", " cat", "a red cat", "a cat")}
    assert ids["a red cat"] == ids["a"] + ids[" red"] + ids[" cat"] and ids["a cat"] == ids["a"] + ids[" cat"]
    table = model.get_input_embeddings().weight
    with torch.no_grad():
        for word, vec in (("a", [1.0, 0.0, 0.0]), (" red", [0.6, 0.8, 0.0]), (" cat", [0.0, 0.0, 1.0])):
            table[ids[word][0]] = torch.tensor(vec + [0.0] * 5)
    reward = build_reward("bmas", model=model, tokenizer=tokenizer)
    completions = [ans("a red cat"), ans("a cat"), "a red cat", ans("a cat"), ans("a red cat")]
    metadata = [{"solution": "a cat"}, {"solution": "<answer>a red cat</answer>"}, {"solution": "a cat"}, {},
                {"solution": ["a", "a cat"]}]
    out = reward(completions, None, metadata)
    # 0: as test_bmas_similarity_by_hand: (2.6/3 + 1) / 2; 1: the mirror (answer and reference swapped), same value
    # 2: no <answer> block -> 0, counted; 3: no solution -> NaN; 4: references "a" (precision (1 + .6 + 0)/3,
    #    recall 1 -> 0.7667) and "a cat" (0.9333): the best counts
    v = (2.6 / 3 + 1) / 2
    assert torch.allclose(out["bmas"][[0, 1, 2, 4]], torch.tensor([v, v, 0.0, v])) and math.isnan(out["bmas"][3])
    assert out["precision"][1] == pytest.approx(1.0) and out["recall"][1] == pytest.approx(2.6 / 3)
    assert math.isnan(out["precision"][2])  # the extra keys of an unparseable answer are NaN
    info = reward.last_info
    assert info["num_unparseable"] == 1 and info["num_nan"] == 1 and 3 in info["nan_samples"]
    loose = build_reward("bmas", model=model, tokenizer=tokenizer, require_tags=False)
    assert float(loose(["a red cat"], None, [{"solution": "a cat"}])["bmas"][0]) == pytest.approx(v)
    # a completion that is not a string is that sample's NaN (the batch's embedding pass used to raise on it)
    out = reward([None, ans("a cat")], None, [{"solution": "a cat"}] * 2)
    assert math.isnan(out["bmas"][0]) and out["bmas"][1] == pytest.approx(1.0)
    assert "not a string" in reward.last_info["nan_samples"][0]


def test_bmas_hidden_states_load_and_arguments(tiny_text_model, tmp_path):
    model, tokenizer = tiny_text_model
    hidden = build_reward("bmas", model=model, tokenizer=tokenizer, embedding="hidden", batch_size=1)
    out = hidden([ans("a red cat"), ans("blue")], None, [{"solution": "a red cat"}, {"solution": "a red cat"}])
    assert out["bmas"][0] == pytest.approx(1.0) and -1.0 <= float(out["bmas"][1]) < 1.0  # same tokens, same states
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    loaded = build_reward("bmas", model=str(tmp_path / "tiny"), device="cpu")
    assert float(loaded([ans("a cat")], None, [{"solution": "a cat"}])["bmas"][0]) == pytest.approx(1.0)
    with pytest.raises(MissingWeightsError, match="does not exist"):
        build_reward("bmas", model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="embedding"):
        build_reward("bmas", model=model, tokenizer=tokenizer, embedding="pooled")
    with pytest.raises(ValueError, match="tokenizer"):
        build_reward("bmas", model=model)
    with pytest.raises(ValueError, match="no argument 'feild'"):
        build_reward("bmas", model=model, tokenizer=tokenizer, feild="answer")


# ---------------------------------------------------------------------------------------- grip_multi_heuristic


def test_grip_multi_heuristic_rewards_valid_paths_by_their_distance_to_the_other_valid_ones():
    import mmrl.algorithms.grip  # noqa: F401
    from mmrl.algorithms.grip import multi_heuristic_rewards, reasoning_words

    assert reasoning_words("<think>Red, red BOX.</think><answer>1</answer>") == {"red", "box"}
    assert reasoning_words("no tags here") == {"no", "tags", "here"}
    texts = ["<think>a b</think><answer>1</answer>",     # words {a, b}
             "<think>a c</think><answer>1</answer>",     # {a, c}
             "<think>d e</think><answer>1</answer>",     # {d, e}
             "<think>a b</think><answer>0</answer>",     # invalid
             "<think>x</think><answer>1</answer>",       # group 1: the only valid one
             "<think>y</think><answer>0</answer>"]
    valid = [True, True, True, False, True, False]
    reward, stats = multi_heuristic_rewards(texts, valid, [0, 0, 0, 0, 1, 1])
    # Jaccard distances: (ab, ac) = 1 - 1/3 = 2/3, (ab, de) = 1, (ac, de) = 1
    assert reward.tolist() == pytest.approx([(2 / 3 + 1) / 2, (2 / 3 + 1) / 2, 1.0, 0.0, 0.0, 0.0])
    assert stats["valid_share"] == pytest.approx(4 / 6) and stats["mean_distance"] == pytest.approx((5 / 6 * 2 + 1) / 3)

    variant = parse_spec({"name": "grip_multi_heuristic", "outcome": "acc", "weight": 0.25}, 0)
    ctx = reward_ctx(completions=texts, group_ids=[0, 0, 0, 0, 1, 1],
                     scores={"acc": torch.tensor([1.0, 0.5, 0.9, 0.2, 1.0, NAN])}, weights={"acc": 1.0})
    out = variant.rewards(ctx)
    assert out.weights == {"acc": 1.0, "grip_diversity": 0.25}
    assert torch.allclose(out.scores["grip_diversity"], reward)  # 0.5 >= threshold 0.5 is valid; NaN is not
    assert ctx.stats["grip/valid_share"] == pytest.approx(4 / 6)
    with pytest.raises(Exception, match="outcome"):
        parse_spec({"name": "grip_multi_heuristic"}, 0)


# ------------------------------------------------------------------------------------------------ dip_looking


def test_dip_looking_rewards_inspecting_the_objects_the_group_disagrees_on():
    import mmrl.algorithms.dip_looking  # noqa: F401
    from mmrl.algorithms.dip_looking import coverage_of, looking_rewards

    assert coverage_of([0, 0, 10, 10], [5, 5, 15, 15]) == pytest.approx(0.25)
    assert coverage_of([0, 0, 20, 20], [5, 5, 15, 15]) == 1.0 and coverage_of([0, 0, 1, 1], [2, 2, 2, 2]) == 0.0
    # group 0, objects A, B, C over 4 judged responses: found A 4/4 (v 0), B 2/4 (v 1/4), C 1/4 (v 3/16)
    found = [[True, True, False], [True, True, True], [True, False, False], [True, False, False], None,
             [True], [True]]
    looked = [[True, True, True], [False, False, True], [False, False, False], [True, True, False], [True, True, True],
              [True], [False]]
    reward, stats = looking_rewards(found, looked, [0, 0, 0, 0, 0, 1, 1])
    total = 1 / 4 + 3 / 16
    expected = [(1 / 4 + 3 / 16) / total, (3 / 16) / total, 0.0, (1 / 4) / total]
    assert reward[:4].tolist() == pytest.approx(expected) and math.isnan(reward[4].item())
    assert reward[5:].tolist() == [0.0, 0.0]  # group 1: every answer found its object, nothing uncertain
    assert stats["uncertain_objects"] == pytest.approx((2 + 0) / 2)
    assert stats["looked_share"] == pytest.approx((1 + 0.5 + 0 + 0.5) / 4)


def test_dip_looking_variant_reads_answer_and_observed_boxes():
    meta = {"boxes": [[0, 0, 10, 10], [50, 50, 60, 60]], "coord_format": "absolute"}
    texts = ["<think>t</think><observe>[45, 45, 70, 70]</observe><answer>[[0, 0, 10, 10], [50, 50, 60, 60]]</answer>",
             "<think>t</think><observe>[0, 0, 12, 12]</observe><answer>[0, 0, 10, 10]</answer>",
             "<think>t</think><answer>[1, 1, 10, 10]</answer>",                      # no observing step
             "<observe>[40, 40, 70, 70]</observe><answer>none</answer>"]              # found nothing
    variant = parse_spec({"name": "dip_looking", "weight": 0.3}, 0)
    ctx = reward_ctx(completions=texts, group_ids=[0, 0, 0, 0], metadata=[meta] * 4,
                     scores={"iou": torch.zeros(4)}, weights={"iou": 1.0})
    out = variant.rewards(ctx)
    # object 1 found by 3 of 4 (v 3/16), object 2 by 1 of 4 (v 3/16): equal weights; looked: r0 obj 2, r1 obj 1, r3 obj 2
    assert out.scores["dip_looking"].tolist() == pytest.approx([0.5, 0.5, 0.0, 0.5])
    assert out.weights == {"iou": 1.0, "dip_looking": 0.3}
    bad = reward_ctx(completions=texts[:1], group_ids=[0], metadata=[{"boxes": [[0, 0, 10, 10]]}], scores={},
                     weights={})  # no coord_format anywhere (and no policy model type): NaN, not a guess
    bad.config = SimpleNamespace(model=SimpleNamespace(family="sd3", pretrained=None))
    assert math.isnan(variant.rewards(bad).scores["dip_looking"].item())
    with pytest.raises(Exception, match="coverage"):
        parse_spec({"name": "dip_looking", "coverage": 0}, 0)
