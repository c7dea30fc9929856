"""Seed-method plug-ins (MC-GRPO, NGRPO, LENS, A-GRAE, focal scaling, contrastive baselines, PAR) on small cases
worked out by hand: every expected number below is derived in the comments, never by running the code twice."""

import dataclasses
import math
import re
from types import SimpleNamespace

import pytest
import torch

from mmrl.algorithms.a_grae import AGRAE, AGRAEOptions
from mmrl.algorithms.base import (REGISTRY, AdvantageContext, RewardContext, SurrogateContext, TransformContext,
                                  VariantError, parse_spec)
from mmrl.algorithms.contrastive_baseline import ContrastiveBaseline, ContrastiveBaselineOptions
from mmrl.algorithms.focal_advantage import FocalAdvantage, FocalAdvantageOptions
from mmrl.algorithms.lens import LENS, LENSOptions
from mmrl.algorithms.mc_grpo import MCGRPO, MCGRPOOptions, median_centered_advantages
from mmrl.algorithms.ngrpo import NGRPO, NGRPOOptions
from mmrl.algorithms.par import PAR, PAROptions

EPS = 1e-4
NAMES = ("mc_grpo", "ngrpo", "lens", "a_grae", "focal_advantage", "contrastive_baseline", "par")


def algorithm(**kw):
    base = {"scale": "group", "eps": EPS, "std_ddof": 0, "advantage_clamp": None,
            "reward_combination": "sum_then_normalize", "batch_normalize_sum": False}
    return SimpleNamespace(**{**base, **kw})


def adv_ctx(components, weights, group_ids, labels=None, **alg):
    n = len(group_ids)
    return AdvantageContext(components=components, weights=weights, labels=group_ids if labels is None else labels,
                            group_ids=group_ids, keys=[f"k{int(g)}" for g in group_ids], algorithm=algorithm(**alg),
                            update=0, default=lambda: torch.zeros(n))


def transform_ctx(advantages, scores, group_ids, update=0, total_updates=11, old_logps=None, mask=None):
    rollout = SimpleNamespace(group_ids=group_ids, old_logps=old_logps,
                              mask=mask if mask is not None else torch.ones(len(group_ids), 1))
    return TransformContext(advantages=advantages, scores=scores, rollout=rollout, update=update,
                            total_updates=total_updates)


def config(**kw):
    base = {"rewards": {"acc": {}, "pref": {}}, "algorithm": algorithm(), "data": SimpleNamespace(group_size=5)}
    return SimpleNamespace(**{**base, **kw})


# ---------------------------------------------------------------------------------------------------------
# the plug-in contract, for all seven
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_registered_with_paper_summary_and_documented_options(name):
    cls = REGISTRY[name]
    assert cls.name == name and cls.summary and "\n" not in cls.summary
    assert re.search(r"arXiv \d{4}\.\d{5}", cls.paper) and re.search(r"(et al\.|Kim) 20\d\d", cls.paper)
    assert cls.__doc__ and len(cls.__doc__) > 200
    for f in dataclasses.fields(cls.Options):
        assert f.metadata.get("help"), f"{name}.{f.name} has no help"
    assert hasattr(cls.Options, "validate")


# ---------------------------------------------------------------------------------------------------------
# MC-GRPO
# ---------------------------------------------------------------------------------------------------------


def test_mc_grpo_median_baseline_by_hand():
    # weighted total = 0.5 * acc: group 0 -> [1, 0, 0.5], group 1 -> [1, 0, 0]
    acc = torch.tensor([2.0, 0.0, 1.0, 2.0, 0.0, 0.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    out = MCGRPO().advantages(adv_ctx({"acc": acc, "fmt": torch.ones(6)}, {"acc": 0.5, "fmt": 0.0}, g))
    # group 0: median 0.5 (the pivot is sample 2); mean 0.5, biased std sqrt((0.25 + 0.25 + 0) / 3) = sqrt(1/6)
    s0 = math.sqrt(1 / 6) + EPS
    # group 1: median 0; mean 1/3, std sqrt(((2/3)^2 + 2 (1/3)^2) / 3) = sqrt(2/9). The mean baseline would give the
    # two zeros -(1/3)/std < 0; the median leaves them at exactly 0
    s1 = math.sqrt(2 / 9) + EPS
    expected = torch.tensor([0.5 / s0, -0.5 / s0, 0.0, 1.0 / s1, 0.0, 0.0])
    assert torch.allclose(out, expected, atol=1e-6)
    assert out[2] == 0.0 and out[4] == 0.0 and out[5] == 0.0


def test_mc_grpo_pivot_is_one_median_sample_per_group_and_scale_none():
    total = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, float("nan")])
    g = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    adv, pivot = median_centered_advantages(total, g, scale="none")
    # one pivot per group, on a sample whose reward is the median (0.5 in group 0, 0 in group 1; NaN left out)
    assert pivot.tolist()[:3] == [False, False, True]
    assert int(pivot[3:].sum()) == 1 and total[3:][pivot[3:]].item() == 0.0
    # scale none: A = R - median = [0.5, -0.5, 0 | 1, 0, 0 | NaN -> 0]
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.0, 1.0, 0.0, 0.0, 0.0]))


def test_mc_grpo_check_wants_odd_groups_unless_told_otherwise():
    with pytest.raises(VariantError, match="must be odd.*set 5"):
        MCGRPO().check(config(data=SimpleNamespace(group_size=4)))
    MCGRPO(MCGRPOOptions(odd_groups=False)).check(config(data=SimpleNamespace(group_size=4)))
    MCGRPO().check(config(data=SimpleNamespace(group_size=5)))
    with pytest.raises(VariantError, match="sum_then_normalize"):
        MCGRPO().check(config(algorithm=algorithm(reward_combination="normalize_then_sum")))
    with pytest.raises(VariantError, match="true or false"):
        parse_spec({"name": "mc_grpo", "odd_groups": "maybe"}, 0)
    with pytest.raises(TypeError, match="true or false"):
        MCGRPOOptions(odd_groups="maybe").validate()


# ---------------------------------------------------------------------------------------------------------
# NGRPO
# ---------------------------------------------------------------------------------------------------------


def test_ngrpo_virtual_max_sample_by_hand():
    acc = torch.tensor([0.0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1])
    labels = ["wrong"] * 4 + ["mixed"] * 4 + ["right"] * 4
    g = torch.arange(3).repeat_interleave(4)
    out = NGRPO().advantages(adv_ctx({"acc": acc}, {"acc": 1.0}, g, labels=labels))
    # all wrong + virtual 1: [0,0,0,0,1] mean 0.2, biased std sqrt((4 * 0.04 + 0.64) / 5) = 0.4 -> -0.2 / 0.4
    wrong = -0.2 / (0.4 + EPS)
    # mixed + virtual 1: [1,0,0,0,1] mean 0.4, var (2 * 0.36 + 3 * 0.16) / 5 = 0.24
    s = math.sqrt(0.24) + EPS
    # all right + virtual 1: no spread -> 0
    expected = torch.tensor([wrong] * 4 + [0.6 / s, -0.4 / s, -0.4 / s, -0.4 / s] + [0.0] * 4)
    assert torch.allclose(out, expected, atol=1e-6)


def test_ngrpo_more_virtual_samples_and_a_higher_max_change_the_statistics():
    acc = torch.zeros(4)
    g = torch.zeros(4, dtype=torch.long)
    out = NGRPO(NGRPOOptions(virtual_samples=2)).advantages(adv_ctx({"acc": acc}, {"acc": 1.0}, g))
    # [0,0,0,0,1,1]: mean 1/3, var (4 (1/9) + 2 (4/9)) / 6 = 2/9 -> -(1/3) / sqrt(2/9)
    assert torch.allclose(out, torch.full((4,), -(1 / 3) / (math.sqrt(2 / 9) + EPS)), atol=1e-6)
    ones = torch.ones(4)
    assert torch.equal(NGRPO().advantages(adv_ctx({"acc": ones}, {"acc": 1.0}, g)), torch.zeros(4))
    # with max_reward 2 an all-1 group is below the maximum: [1,1,1,1,2] mean 1.2, std 0.4 -> -0.2 / 0.4
    out = NGRPO(NGRPOOptions(max_reward=2.0)).advantages(adv_ctx({"acc": ones}, {"acc": 1.0}, g))
    assert torch.allclose(out, torch.full((4,), -0.2 / (0.4 + EPS)), atol=1e-6)


def _surrogate(variant, ratio, adv, clip=0.2):
    n = ratio.shape[0]
    return variant.surrogate(SurrogateContext(
        logps=ratio.log(), old_logps=torch.zeros_like(ratio), log_ratio=ratio.log(), ratio=ratio, advantages=adv,
        mask=torch.ones_like(ratio), clip_low=clip, clip_high=clip, index=torch.arange(n),
        group_ids=torch.zeros(n, dtype=torch.long)))


def test_ngrpo_asymmetric_clip_by_hand_and_its_gradient():
    ratio = torch.tensor([[1.3], [0.7], [1.3]], requires_grad=True)
    adv = torch.tensor([[1.0], [-1.0], [-1.0]])
    loss = _surrogate(NGRPO(), ratio, adv)
    # range [1 - 0.2 * 0.8, 1 + 0.2 * 1.2] = [0.84, 1.24]
    # A > 0, r 1.3: -min(1.3, 1.24) = -1.24 (symmetric PPO: -1.2)
    # A < 0, r 0.7: -min(-0.7, -0.84) = 0.84 (symmetric PPO: 0.8)
    # A < 0, r 1.3: -min(-1.3, -1.24) = 1.3 (not clipped)
    assert torch.allclose(loss, torch.tensor([[-1.24], [0.84], [1.3]]))
    loss.sum().backward()
    # clipped rows carry no gradient; the unclipped row's d/dr (-r A) = -A = 1
    assert torch.allclose(ratio.grad, torch.tensor([[0.0], [0.0], [1.0]]))


def test_ngrpo_unit_scales_reproduce_the_standard_clipped_surrogate():
    ratio = torch.tensor([[1.3, 0.7, 1.0, 0.9]])
    adv = torch.tensor([[2.0]])
    loss = _surrogate(NGRPO(NGRPOOptions(positive_clip_scale=1.0, negative_clip_scale=1.0)), ratio, adv)
    # -min(r A, clip(r, 0.8, 1.2) A), A = 2: [-min(2.6, 2.4), -min(1.4, 1.6), -2, -1.8]
    assert torch.allclose(loss, torch.tensor([[-2.4, -1.4, -2.0, -1.8]]))


def test_ngrpo_options_are_validated():
    with pytest.raises(VariantError, match="positive_clip_scale must be >= 1"):
        parse_spec({"name": "ngrpo", "positive_clip_scale": 0.9}, 0)
    with pytest.raises(VariantError, match="negative_clip_scale"):
        parse_spec({"name": "ngrpo", "negative_clip_scale": 1.5}, 0)
    with pytest.raises(VariantError, match="virtual_samples"):
        parse_spec({"name": "ngrpo", "virtual_samples": 0}, 0)


# ---------------------------------------------------------------------------------------------------------
# LENS
# ---------------------------------------------------------------------------------------------------------


def _lens_inputs():
    # row 0: tokens with p 0.9 and 0.4, then padding (its log-prob 5 must not count); row 1: three tokens of p 0.5
    old = torch.tensor([[math.log(0.9), math.log(0.4), 5.0], [math.log(0.5)] * 3, [math.log(0.99)] * 3])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    return old, mask, torch.tensor([0.2, -0.1, 1.0]), {"acc": torch.tensor([0.0, 0.0, 1.0])}


def test_lens_confidence_penalty_on_wrong_answers_by_hand():
    old, mask, adv, scores = _lens_inputs()
    out = LENS(LENSOptions(reward="acc", weight=0.5)).transform(
        transform_ctx(adv, scores, torch.zeros(3, dtype=torch.long), old_logps=old, mask=mask))
    # token_mean confidence: row 0 exp((log .9 + log .4) / 2) = sqrt(.36) = 0.6, row 1 0.5; row 2 is right
    # A' = [0.2 - 0.5 * 0.6, -0.1 - 0.5 * 0.5, 1.0]
    assert torch.allclose(out, torch.tensor([-0.1, -0.35, 1.0]), atol=1e-6)


def test_lens_sequence_confidence_threshold_and_nan():
    old, mask, adv, scores = _lens_inputs()
    g = torch.zeros(3, dtype=torch.long)
    out = LENS(LENSOptions(reward="acc", weight=0.5, confidence="sequence")).transform(
        transform_ctx(adv, scores, g, old_logps=old, mask=mask))
    # sequence probability: row 0 0.9 * 0.4 = 0.36, row 1 0.5^3 = 0.125 -> [0.2 - 0.18, -0.1 - 0.0625, 1.0]
    assert torch.allclose(out, torch.tensor([0.02, -0.1625, 1.0]), atol=1e-6)
    # threshold -1: nothing is wrong; a NaN correctness is not judged: both leave the advantages alone
    same = LENS(LENSOptions(reward="acc", threshold=-1.0)).transform(
        transform_ctx(adv, scores, g, old_logps=old, mask=mask))
    assert torch.equal(same, adv)
    nan = {"acc": torch.tensor([float("nan"), 1.0, 1.0])}
    assert torch.equal(LENS(LENSOptions(reward="acc")).transform(
        transform_ctx(adv, nan, g, old_logps=old, mask=mask)), adv)
    # [N, T] advantages: the row's penalty on every step (row 1: -0.25 each)
    dense = LENS(LENSOptions(reward="acc", weight=0.5)).transform(
        transform_ctx(torch.zeros(3, 2), scores, g, old_logps=old, mask=mask))
    assert torch.allclose(dense, torch.tensor([[-0.3, -0.3], [-0.25, -0.25], [0.0, 0.0]]), atol=1e-6)


def test_lens_needs_old_logps_and_validates():
    assert LENS.needs == ("old_logps",) and LENS.families == ("vlm",)
    with pytest.raises(VariantError, match="confidence must be one of"):
        parse_spec({"name": "lens", "reward": "acc", "confidence": "entropy"}, 0)
    with pytest.raises(VariantError, match="weight must be >= 0"):
        parse_spec({"name": "lens", "reward": "acc", "weight": -1.0}, 0)
    with pytest.raises(VariantError, match="not one of the configured"):
        LENS(LENSOptions(reward="missing")).check(config())


# ---------------------------------------------------------------------------------------------------------
# A-GRAE
# ---------------------------------------------------------------------------------------------------------


def _agrae_inputs():
    # group 0 solves 3 of 4 (p = 0.75), group 1 solves 1 of 4 (p = 0.25); the advantages are illustrative
    acc = torch.tensor([1.0, 1, 1, 0, 1, 0, 0, 0])
    adv = torch.tensor([1.0, 1, 1, -3, 3, -1, -1, -1])
    return adv, {"acc": acc}, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


@pytest.mark.parametrize("update, expected", [
    # t = 0: w = 2p -> 1.5 and 0.5; positives x 0.5: [1 * 1.5 * 0.5, ..., -3 * 1.5 | 3 * 0.5 * 0.5, -1 * 0.5, ...]
    (0, [0.75, 0.75, 0.75, -4.5, 0.75, -0.5, -0.5, -0.5]),
    # t = 5/10: w = 2 (0.5 p + 0.5 (1 - p)) = 1; positives x (0.5 + 0.5 * 0.5) = 0.75
    (5, [0.75, 0.75, 0.75, -3.0, 2.25, -1.0, -1.0, -1.0]),
    # t = 10/10: w = 2 (1 - p) -> 0.5 and 1.5; no suppression
    (10, [0.5, 0.5, 0.5, -1.5, 4.5, -1.5, -1.5, -1.5]),
])
def test_a_grae_suppression_and_curriculum_by_hand(update, expected):
    adv, scores, g = _agrae_inputs()
    out = AGRAE(AGRAEOptions(reward="acc", positive_scale=0.5)).transform(
        transform_ctx(adv, scores, g, update=update, total_updates=11))
    assert torch.allclose(out, torch.tensor(expected))


def test_a_grae_options_change_the_rule():
    adv, scores, g = _agrae_inputs()
    # curriculum 0: w = 1, only the suppression at t = 0 (x 0.5 on positives)
    out = AGRAE(AGRAEOptions(reward="acc", positive_scale=0.5, curriculum=0.0)).transform(
        transform_ctx(adv, scores, g, update=0))
    assert torch.allclose(out, torch.tensor([0.5, 0.5, 0.5, -3.0, 1.5, -1.0, -1.0, -1.0]))
    # progress from accuracy: 4 of 8 right -> t = 0.5 at update 0, the middle case above
    out = AGRAE(AGRAEOptions(reward="acc", positive_scale=0.5, progress="accuracy")).transform(
        transform_ctx(adv, scores, g, update=0))
    assert torch.allclose(out, torch.tensor([0.75, 0.75, 0.75, -3.0, 2.25, -1.0, -1.0, -1.0]))
    with pytest.raises(VariantError, match="positive_scale must be in"):
        parse_spec({"name": "a_grae", "reward": "acc", "positive_scale": 1.5}, 0)
    with pytest.raises(VariantError, match="progress must be one of"):
        parse_spec({"name": "a_grae", "reward": "acc", "progress": "epochs"}, 0)


# ---------------------------------------------------------------------------------------------------------
# focal difficulty scaling
# ---------------------------------------------------------------------------------------------------------


def test_focal_scaling_by_hand():
    # success = score > 0.5: group 0 [y y y n] p = 3/4, group 1 [y n n n] p = 1/4, group 2 [n NaN y y] p = 2/3
    score = torch.tensor([0.9, 0.6, 0.7, 0.2, 1.0, 0.5, 0.0, 0.1, 0.3, float("nan"), 0.8, 0.9])
    g = torch.arange(3).repeat_interleave(4)
    adv = torch.ones(12)
    out = FocalAdvantage(FocalAdvantageOptions(reward="acc", gamma=1.0)).transform(
        transform_ctx(adv, {"acc": score}, g))
    assert torch.allclose(out, torch.tensor([0.25] * 4 + [0.75] * 4 + [1 / 3] * 4))
    out = FocalAdvantage(FocalAdvantageOptions(reward="acc", gamma=2.0)).transform(
        transform_ctx(adv, {"acc": score}, g))
    assert torch.allclose(out, torch.tensor([0.0625] * 4 + [0.5625] * 4 + [1 / 9] * 4))
    # gamma 0: (1 - p)^0 = 1, unchanged; [N, T] advantages: the group's weight on every step
    assert torch.equal(FocalAdvantage(FocalAdvantageOptions(reward="acc", gamma=0.0)).transform(
        transform_ctx(adv, {"acc": score}, g)), adv)
    dense = FocalAdvantage(FocalAdvantageOptions(reward="acc")).transform(
        transform_ctx(torch.full((12, 2), -2.0), {"acc": score}, g))
    assert torch.allclose(dense[0], torch.tensor([-0.5, -0.5])) and torch.allclose(dense[4], torch.tensor([-1.5, -1.5]))


def test_focal_threshold_and_validation():
    score = torch.tensor([0.9, 0.6, 0.7, 0.2])
    g = torch.zeros(4, dtype=torch.long)
    # threshold 0.65: successes 0.9, 0.7 -> p = 0.5 -> weight 0.5
    out = FocalAdvantage(FocalAdvantageOptions(reward="acc", threshold=0.65)).transform(
        transform_ctx(torch.ones(4), {"acc": score}, g))
    assert torch.allclose(out, torch.full((4,), 0.5))
    with pytest.raises(VariantError, match="gamma must be >= 0"):
        parse_spec({"name": "focal_advantage", "reward": "acc", "gamma": -1.0}, 0)
    with pytest.raises(VariantError, match="reward: name"):
        parse_spec({"name": "focal_advantage"}, 0)


# ---------------------------------------------------------------------------------------------------------
# contrastive baselines and PAR (rewards stage, references scored through ctx.score_outputs)
# ---------------------------------------------------------------------------------------------------------


def _reward_ctx(metadata, pref, calls):
    def score_outputs(outputs, prompts, meta):
        calls.append(list(outputs))  # the fake reward reads the number a response text spells ("x": not judged)
        return {"pref": torch.tensor([float("nan") if t == "x" else float(t) for t in outputs]),
                "total": torch.zeros(len(outputs))}

    rollout = SimpleNamespace(outputs=["a", "b", "c", "d"], prompts=["p0", "p0", "p1", "p1"], metadata=metadata,
                              group_ids=torch.tensor([0, 0, 1, 1]), mask=torch.ones(4, 1))
    return RewardContext(rollout=rollout, items=[], scores={"pref": pref, "acc": torch.ones(4)},
                         weights={"pref": 1.0, "acc": 0.5}, config=None, policy=None, accelerator=None, update=0,
                         score=None, score_outputs=score_outputs, sample=None, intermediate=None, stats={}, timer={})


def test_contrastive_baseline_subtracts_the_baselines_mean_reward():
    m0 = {"baseline_responses": ["1", "3"]}
    m1 = {"baseline_responses": ["4", "x"]}
    calls = []
    ctx = _reward_ctx([m0, m0, m1, m1], torch.tensor([3.0, 1.0, 0.0, 2.0]), calls)
    out = ContrastiveBaseline(ContrastiveBaselineOptions(reward="pref")).rewards(ctx)
    # prompt 0: baselines 1, 3 -> mean 2 -> [3 - 2, 1 - 2]; prompt 1: 4 and an unjudged "x" -> mean 4 -> [-4, -2]
    assert torch.allclose(out.scores["pref"], torch.tensor([1.0, -1.0, -4.0, -2.0]))
    assert torch.equal(out.scores["pref_raw"], torch.tensor([3.0, 1.0, 0.0, 2.0]))
    assert out.weights == {"pref": 1.0, "acc": 0.5} and "pref_raw" not in out.weights
    # one reward call, each distinct (group, prompt, text) once: 4 texts, not 8
    assert len(calls) == 1 and sorted(calls[0]) == ["1", "3", "4", "x"]
    assert ctx.stats["contrastive_baseline/baseline_reward"] == pytest.approx(3.0)  # mean of 2, 2, 4, 4


def test_contrastive_baseline_field_and_missing_options():
    meta = [{"alt": ["2"]}] * 2 + [{}] * 2
    pref = torch.tensor([3.0, 1.0, 0.0, 2.0])
    with pytest.raises(ValueError, match="no metadata\\['baseline_responses'\\]"):
        ContrastiveBaseline(ContrastiveBaselineOptions(reward="pref")).rewards(_reward_ctx(meta, pref, []))
    out = ContrastiveBaseline(ContrastiveBaselineOptions(reward="pref", field="alt", on_missing="nan")).rewards(
        _reward_ctx(meta, pref, []))
    # field alt: prompt 0 baseline 2 -> [1, -1]; prompt 1 has none -> NaN (advantage 0 downstream)
    assert torch.allclose(out.scores["pref"][:2], torch.tensor([1.0, -1.0]))
    assert torch.isnan(out.scores["pref"][2:]).all()
    with pytest.raises(VariantError, match="on_missing must be one of"):
        parse_spec({"name": "contrastive_baseline", "reward": "pref", "on_missing": "skip"}, 0)


def test_par_sigmoid_of_centred_reward_by_hand():
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))
    m0 = {"reference_response": "1"}
    m1 = {"reference_response": ["0", "4"]}
    calls = []
    out = PAR(PAROptions(reward="pref")).rewards(_reward_ctx([m0, m0, m1, m1], torch.tensor([3.0, 1.0, 0.0, 2.0]),
                                                             calls))
    # prompt 0, one reference of reward 1: sigmoid(3 - 1) = 0.8808, sigmoid(1 - 1) = 0.5
    # prompt 1, references 0 and 4: mean(sigmoid(0), sigmoid(-4)) = 0.25899; mean(sigmoid(2), sigmoid(-2)) = 0.5
    expected = torch.tensor([sig(2.0), 0.5, (0.5 + sig(-4.0)) / 2, 0.5])
    assert torch.allclose(out.scores["pref"], expected, atol=1e-6)
    assert torch.allclose(out.scores["pref_reference"], torch.tensor([1.0, 1.0, 2.0, 2.0]))
    assert len(calls) == 1 and sorted(calls[0]) == ["0", "1", "4"]


def test_par_validation_and_missing_reference():
    with pytest.raises(VariantError, match="reward: name"):
        parse_spec({"name": "par"}, 0)
    with pytest.raises(VariantError, match="not one of the configured"):
        PAR(PAROptions(reward="rm")).check(config())
    with pytest.raises(ValueError, match="reference_response"):
        PAR(PAROptions(reward="pref")).rewards(_reward_ctx([{}] * 4, torch.zeros(4), []))
    out = PAR(PAROptions(reward="pref", on_missing="nan")).rewards(_reward_ctx([{}] * 4, torch.zeros(4), []))
    assert torch.isnan(out.scores["pref"]).all()


def test_e_grpo_is_the_unbiased_group_normalisation_of_merged_steps():
    from types import SimpleNamespace

    import torch

    from mmrl.algorithms.base import AdvantageContext, parse_spec
    from mmrl.config import ConfigError, load_config

    # rewards [1, 2, 3] in one group: mean 2, unbiased std 1 -> advantages [-1, 0, 1] (eps 1e-8)
    algo = SimpleNamespace(advantage_clamp=0.5)
    ctx = AdvantageContext(components={"r": torch.tensor([1.0, 2.0, 3.0])}, weights={"r": 1.0}, labels=["p"] * 3,
                           group_ids=torch.zeros(3), keys=["p"] * 3, algorithm=algo, update=0, default=lambda: None)
    adv = parse_spec("e_grpo", 0).advantages(ctx)
    assert torch.allclose(adv, torch.tensor([-0.5, 0.0, 0.5]))  # clamped to +-0.5
    with pytest.raises(ConfigError, match="set sampling.train_steps=entropy_merge"):
        load_config(None, ["algorithm.variants=[e_grpo]"])
