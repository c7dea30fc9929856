"""Hand-worked checks of the token-weighting and dense-credit plug-ins: delightful_pg, stare, pure_credit,
clip_delta, mig, gigpo (each rule's numbers are derived by hand in the comments)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mmrl.algorithms.base import (Intermediate, TransformContext, VariantError, describe_variant, lookup,
                                  parse_spec)
from mmrl.algorithms.clip_delta import ClipDelta, ClipDeltaOptions
from mmrl.algorithms.delightful_pg import DelightfulPG, DelightfulPGOptions
from mmrl.algorithms.gigpo import GiGPO, GiGPOOptions, prefix_anchor_states, prefix_step_advantages
from mmrl.algorithms.mig import MIG, MIGOptions
from mmrl.algorithms.pure_credit import PURECredit, PURECreditOptions
from mmrl.algorithms.stare import STARE, STAREOptions
from mmrl.core.advantages import group_advantages

LN3 = math.log(3.0)


def transform_ctx(advantages, old_logps=None, mask=None, group_ids=None, completion_ids=None, scores=None):
    rollout = SimpleNamespace(old_logps=old_logps, mask=mask, group_ids=group_ids, completion_ids=completion_ids)
    return TransformContext(advantages=advantages, scores=scores or {}, rollout=rollout, update=0, total_updates=10)


def credit(variant, step_rewards):
    n, k = step_rewards.shape
    inter = Intermediate(images=torch.zeros(n, k, 3, 2, 2), step_rewards=step_rewards)
    return variant.credit(inter, ctx=SimpleNamespace(config=SimpleNamespace(), stats={}, accelerator=None))


def test_registered_with_stages_needs_and_families():
    expected = {
        "delightful_pg": (["transform"], ["old_logps"], ["vlm"]),
        "stare": (["transform"], ["old_logps"], ["vlm"]),
        "gigpo": (["transform"], [], ["vlm"]),
        "pure_credit": (["rewards"], ["intermediate_images"], ["flow"]),
        "clip_delta": (["rewards"], ["intermediate_images"], ["flow"]),
        "mig": (["rewards"], ["intermediate_images"], ["flow"]),
    }
    for name, (stages, needs, families) in expected.items():
        info = describe_variant(lookup(name))
        assert (info["stages"], info["needs"], info["families"]) == (stages, needs, families), name
        assert info["summary"] and "arXiv" in info["paper"] and all(o["help"] for o in info["options"]), name


# ------------------------------------------------------------------------------------------- delightful_pg


def test_delightful_gate_by_hand():
    # row 0: A = +1, surprisals l = [ln 3, 0, pad] -> delight [ln 3, 0] -> sigmoid: [3/4, 1/2] -> A' = [0.75, 0.5, 0]
    # row 1: A = -1, surprisals [ln 3, ln 3, pad] -> delight -ln 3 -> sigmoid 1/4 -> A' = [-0.25, -0.25, 0]
    old = torch.tensor([[-LN3, 0.0, 0.0], [-LN3, -LN3, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    out = DelightfulPG().transform(transform_ctx(torch.tensor([1.0, -1.0]), old, mask, torch.tensor([0, 0])))
    assert torch.allclose(out, torch.tensor([[0.75, 0.5, 0.0], [-0.25, -0.25, 0.0]]))


def test_delightful_temperature_and_token_advantages():
    # eta = 2, l = ln 9, [N, T] advantages used as given
    old = torch.full((1, 2), -math.log(9.0))
    adv = torch.tensor([[2.0, -2.0]])
    # token 0: A = 2, delight 2 ln 9, / 2 = ln 9 -> sigmoid = 9/10 -> 1.8; token 1: -ln 9 -> 1/10 -> -0.2
    variant = DelightfulPG(DelightfulPGOptions(temperature=2.0))
    out = variant.transform(transform_ctx(adv, old, torch.ones(1, 2), torch.tensor([0])))
    assert torch.allclose(out, torch.tensor([[1.8, -0.2]]))


def test_delightful_options_validation():
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(VariantError, match="temperature"):
            parse_spec({"name": "delightful_pg", "temperature": bad}, 0)
    assert parse_spec({"name": "delightful_pg", "temperature": 0.5}, 0).options.temperature == 0.5


# ------------------------------------------------------------------------------------------- stare

# 4 completions x 3 tokens; A = [+1, +1, -1, -1]; row 1's last token is padding.
STARE_ADV = torch.tensor([1.0, 1.0, -1.0, -1.0])
STARE_S = torch.tensor([[0.1, 2.0, 0.5],   # T+ (rows 0, 1: 5 active tokens)
                        [3.0, 0.2, 9.0],   # (9.0 is padding: ignored)
                        [1.0, 0.05, 4.0],  # T- (rows 2, 3: 6 tokens)
                        [0.3, 2.5, 0.6]])
STARE_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
# mean surprisal over the 11 active tokens: (2.6 + 3.2 + 5.05 + 3.4) / 11 = 14.25 / 11 = 1.2955
# top_ratio 0.5: |T+| = 5 -> ceil(2.5) = 3 tokens: 3.0 (1,0), 2.0 (0,1), 0.5 (0,2)  -> L+
#                |T-| = 6 -> 3 tokens: 4.0 (2,2), 2.5 (3,1), 1.0 (2,0)               -> L-


def stare_out(**options):
    variant = STARE(STAREOptions(top_ratio=0.5, **options))
    return variant, variant.transform(transform_ctx(STARE_ADV, -STARE_S, STARE_MASK, torch.zeros(4)))


def test_stare_o1_amplifies_rare_successes_by_hand():
    _, out = stare_out(target_entropy=2.0)  # H = 1.2955 < 2.0: gate on
    expected = torch.tensor([[1.0, 1.1, 1.1], [1.1, 1.0, 0.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    assert torch.allclose(out, expected)


def test_stare_c2_also_damps_rare_failures_by_hand():
    _, out = stare_out(target_entropy=2.0, mode="C2")
    expected = torch.tensor([[1.0, 1.1, 1.1], [1.1, 1.0, 0.0], [-0.9, -1.0, -0.9], [-1.0, -0.9, -1.0]])
    assert torch.allclose(out, expected)


def test_stare_gate_off_above_target_entropy():
    _, out = stare_out(target_entropy=1.0, mode="C2")  # H = 1.2955 >= 1.0: plain advantages
    assert torch.allclose(out, STARE_ADV.unsqueeze(1) * STARE_MASK)


def test_stare_adaptive_schedule_state_and_clamp():
    # H < H_tgt = 2: W = 1.1 + 0.1 = 1.2, M = 0.9 - 0.1 = 0.8, used at this update
    variant, out = stare_out(target_entropy=2.0, mode="C2", adaptive=True, alpha=0.1)
    assert out[1, 0].item() == pytest.approx(1.2) and out[2, 2].item() == pytest.approx(-0.8)
    assert variant.state_dict() == pytest.approx({"reweight_w": 1.2, "reweight_m": 0.8})
    restored = STARE(STAREOptions(top_ratio=0.5, target_entropy=2.0, adaptive=True, alpha=0.4))
    restored.load_state_dict(variant.state_dict())
    restored.weights(STARE_ADV, -STARE_S, STARE_MASK)
    # 1.2 + 0.4 = 1.6 -> clipped to w_max 1.5; 0.8 - 0.4 = 0.4 -> clipped to m_min 0.5
    assert (restored.reweight_w, restored.reweight_m) == pytest.approx((1.5, 0.5))


def test_stare_options_validation():
    for bad in ({"mode": "O2"}, {"top_ratio": 1.5}, {"reweight_w": 0.9}, {"reweight_m": 1.2},
                {"reweight_w": 2.0}, {"alpha": -0.1}):
        with pytest.raises(VariantError):
            parse_spec({"name": "stare", **bad}, 0)
    assert parse_spec({"name": "stare", "mode": "C2", "top_ratio": 0.2}, 0).options.mode == "C2"


# ------------------------------------------------------------------------------------------- pure_credit


def test_pure_min_form_by_hand():
    # row 0: R = [0.5, 0.2, 0.8, 0.6] -> r = R_1..R_3 = [0.2, 0.8, 0.6] -> min over k >= t: [0.2, 0.6, 0.6]
    # row 1: R = [0.0, 0.9, 0.3, 0.7] -> r = [0.9, 0.3, 0.7] -> [0.3, 0.3, 0.7]
    R = torch.tensor([[0.5, 0.2, 0.8, 0.6], [0.0, 0.9, 0.3, 0.7]])
    assert torch.allclose(credit(PURECredit(), R), torch.tensor([[0.2, 0.6, 0.6], [0.3, 0.3, 0.7]]))
    # gains of row 1: [0.9, -0.6, 0.4] -> future min [-0.6, -0.6, 0.4]
    gains = credit(PURECredit(PURECreditOptions(process="gain")), R)
    assert torch.allclose(gains[1], torch.tensor([-0.6, -0.6, 0.4]))


def test_pure_softmin_approximation_by_hand():
    # tau = 1, r = [0, ln 3]: softmax(-r) = [3/4, 1/4] -> r* = [0, ln 3 / 4] -> sums from t: [ln 3 / 4, ln 3 / 4]
    R = torch.tensor([[7.0, 0.0, LN3]])
    out = credit(PURECredit(PURECreditOptions(temperature=1.0)), R)
    assert torch.allclose(out, torch.tensor([[LN3 / 4, LN3 / 4]]))


def test_pure_nan_row_and_validation():
    out = credit(PURECredit(), torch.tensor([[0.0, math.nan, 1.0], [0.0, 1.0, 2.0]]))
    assert torch.isnan(out[0]).all() and torch.allclose(out[1], torch.tensor([1.0, 2.0]))
    for bad in ({"process": "return"}, {"temperature": -0.1}):
        with pytest.raises(VariantError):
            parse_spec({"name": "pure_credit", **bad}, 0)


# ------------------------------------------------------------------------------------------- clip_delta

# r_t = R_{t+1}: row 0 [0.4, 0.9, 0.5], row 1 [0.2, 0.3, 0.1]; their mean = 2.4 / 6 = 0.4
CD_R = torch.tensor([[0.1, 0.4, 0.9, 0.5], [0.0, 0.2, 0.3, 0.1]])


def cd(**options):
    return credit(ClipDelta(ClipDeltaOptions(**options)), CD_R)


def test_clip_refined_rewards_by_hand():
    # eta = 0.4: min(r - 0.4, 0): row 0 [0, 0, 0], row 1 [-0.2, -0.1, -0.3]
    assert torch.allclose(cd(accumulate=False, outcome_weight=0.0),
                          torch.tensor([[0.0, 0.0, 0.0], [-0.2, -0.1, -0.3]]))
    # fixed eta = 0.7: row 0 [-0.3, 0, -0.2]
    assert torch.allclose(cd(threshold="fixed", eta=0.7, accumulate=False, outcome_weight=0.0)[0],
                          torch.tensor([-0.3, 0.0, -0.2]))


def test_clip_default_returns_with_outcome_by_hand():
    # last step += R_T: row 0 [0, 0, 0.5] -> sums from t [0.5, 0.5, 0.5];
    # row 1 [-0.2, -0.1, -0.3 + 0.1] -> [-0.5, -0.3, -0.2]
    assert torch.allclose(cd(), torch.tensor([[0.5, 0.5, 0.5], [-0.5, -0.3, -0.2]]))


def test_delta_by_hand():
    # row 0: [0.4 - 0.9, 0.9 - 0.5, 0] = [-0.5, 0.4, 0]
    assert torch.allclose(cd(mode="delta", accumulate=False, outcome_weight=0.0)[0], torch.tensor([-0.5, 0.4, 0.0]))
    # defaults: last += R_T = 0.5, sums from t telescope to R_{t+1}: [0.4, 0.9, 0.5]
    assert torch.allclose(cd(mode="delta"), CD_R[:, 1:])


def test_clip_mean_threshold_is_the_whole_batch_over_processes():
    # two processes, one row each: eta must stay 0.4 (the mean over both rows), not each process's own row mean
    class TwoProcesses:  # accelerate's reduce(sum) over this process and the other one's stats
        num_processes, device = 2, "cpu"

        def __init__(self, other):
            self.other = other

        def reduce(self, stats, reduction):
            assert reduction == "sum"
            r = self.other[:, 1:]
            return stats + torch.stack([r.double().sum(), torch.tensor(float(r.numel()), dtype=torch.float64)])

    whole = cd()
    variant = ClipDelta(ClipDeltaOptions())
    for row, other in ((0, 1), (1, 0)):
        ctx = SimpleNamespace(config=SimpleNamespace(), stats={}, accelerator=TwoProcesses(CD_R[other:other + 1]))
        inter = Intermediate(images=torch.zeros(1, 4, 3, 2, 2), step_rewards=CD_R[row:row + 1])
        assert torch.allclose(variant.credit(inter, ctx), whole[row:row + 1])


def test_clip_delta_options_validation():
    for bad in ({"mode": "sum"}, {"threshold": "median"}, {"eta": math.nan}, {"outcome_weight": -1.0},
                {"eta": 0.5}, {"mode": "delta", "threshold": "fixed", "eta": 0.5}):
        with pytest.raises(VariantError):
            parse_spec({"name": "clip_delta", **bad}, 0)
    assert parse_spec({"name": "clip_delta", "mode": "delta"}, 0).options.mode == "delta"


# ------------------------------------------------------------------------------------------- mig


def test_mig_watermark_by_hand():
    # row 0: R = [0.3, 0.5, 0.4, 0.7, 0.6] -> W = [0.3, 0.5, 0.5, 0.7, 0.7] -> raises [0.2, 0, 0.2, 0]
    # row 1: R = [0.8, 0.2, 0.9, 0.1, 0.85] -> W = [0.8, 0.8, 0.9, 0.9, 0.9] -> [0, 0.1, 0, 0]
    #        (step gain would pay the recovery 0.2 -> 0.9 as +0.7; the watermark pays only the new best, +0.1)
    R = torch.tensor([[0.3, 0.5, 0.4, 0.7, 0.6], [0.8, 0.2, 0.9, 0.1, 0.85]])
    assert torch.allclose(credit(MIG(), R), torch.tensor([[0.2, 0.0, 0.2, 0.0], [0.0, 0.1, 0.0, 0.0]]))
    # accumulate: W_T - W_t = [0.4, 0.2, 0.2, 0]; + 0.5 R_T = 0.3 on every step
    out = credit(MIG(MIGOptions(accumulate=True, outcome_weight=0.5)), R[:1])
    assert torch.allclose(out, torch.tensor([[0.7, 0.5, 0.5, 0.3]]))


def test_mig_options_validation():
    for bad in (-0.5, math.nan):
        with pytest.raises(VariantError, match="outcome_weight"):
            parse_spec({"name": "mig", "outcome_weight": bad}, 0)
    assert parse_spec({"name": "mig", "accumulate": True}, 0).options.accumulate


# ------------------------------------------------------------------------------------------- gigpo

# group 0: a, b, c, d; group 1: e, f (e has a's tokens but another prompt: never a's state)
GI_IDS = torch.tensor([[5, 7, 9, 2],   # a  G = 1
                       [5, 7, 8, 2],   # b  G = 0
                       [5, 6, 1, 0],   # c  G = 1 (last position padding)
                       [3, 4, 4, 4],   # d  G = 0
                       [5, 7, 9, 2],   # e  G = 1
                       [5, 7, 9, 2]])  # f  G = 0
GI_MASK = torch.tensor([[1.0] * 4, [1.0] * 4, [1.0, 1.0, 1.0, 0.0], [1.0] * 4, [1.0] * 4, [1.0] * 4])
GI_GROUPS = torch.tensor([0, 0, 0, 0, 1, 1])
GI_G = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
# anchor states and their means (mean mode: A^S = G - mean, 0 for a singleton):
#   t=0 {a,b,c,d} mean 1/2 -> a +1/2, b -1/2, c +1/2, d -1/2 ;  {e,f} mean 1/2 at every t -> e +1/2, f -1/2
#   t=1 {a,b,c} (prefix [5]) mean 2/3 -> a +1/3, b -2/3, c +1/3 ; d alone ([3]) -> 0
#   t=2 {a,b} ([5,7]) mean 1/2 -> a +1/2, b -1/2 ; c alone ([5,6]) -> 0 ; d -> 0
#   t=3 a [5,7,9], b [5,7,8], d alone -> 0 ; c padding -> 0
GI_STEP = torch.tensor([[0.5, 1 / 3, 0.5, 0.0],
                        [-0.5, -2 / 3, -0.5, 0.0],
                        [0.5, 1 / 3, 0.0, 0.0],
                        [-0.5, 0.0, 0.0, 0.0],
                        [0.5, 0.5, 0.5, 0.5],
                        [-0.5, -0.5, -0.5, -0.5]])


def test_gigpo_anchor_states_are_shared_prefixes():
    labels = prefix_anchor_states(GI_IDS, GI_MASK, GI_GROUPS)
    assert len({labels[i, 0].item() for i in range(4)}) == 1 and labels[0, 0] != labels[4, 0]
    assert labels[0, 1] == labels[1, 1] == labels[2, 1] != labels[3, 1]
    assert labels[0, 2] == labels[1, 2] != labels[2, 2] and labels[0, 3] != labels[1, 3]
    assert (labels[4] == labels[5]).all()


def test_gigpo_step_advantage_by_hand():
    assert torch.allclose(prefix_step_advantages(GI_G, GI_IDS, GI_MASK, GI_GROUPS), GI_STEP)


def test_gigpo_transform_episode_plus_step_by_hand():
    # A = A^E + 1 * A^S with A^E = [1, -1, 1, -1, 1, -1]; c's padding -> 0
    episode = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    ctx = transform_ctx(episode, mask=GI_MASK, group_ids=GI_GROUPS, completion_ids=GI_IDS, scores={"acc": GI_G})
    out = GiGPO(GiGPOOptions(reward="acc")).transform(ctx)
    expected = episode.unsqueeze(1) + GI_STEP
    expected[2, 3] = 0.0  # c's padding
    assert torch.allclose(out, expected)
    half = GiGPO(GiGPOOptions(reward="acc", step_weight=0.5)).transform(ctx)
    assert half[1, 1].item() == pytest.approx(-1 - 1 / 3)  # -1 + 0.5 * (-2/3)


def test_gigpo_mean_std_by_hand_and_invariance_to_the_episode_advantage():
    # t=0 {1,0,1,0}: mean 1/2, unbiased std sqrt(1/3) -> a: 0.5 / 0.57735 = 0.8660
    # t=1 {1,0,1}: mean 2/3, var (1/9 + 4/9 + 1/9) / 2 = 1/3 -> a: (1/3) / 0.57735 = 0.57735, b: -1.1547
    # t=2 {1,0}: mean 1/2, std 0.7071 -> a: 0.7071
    step = prefix_step_advantages(GI_G, GI_IDS, GI_MASK, GI_GROUPS, normalize="mean_std")
    s3 = math.sqrt(1 / 3)
    assert torch.allclose(step[0], torch.tensor([0.5 / s3, (1 / 3) / s3, 0.5 / math.sqrt(0.5), 0.0]), atol=1e-5)
    assert step[1, 1].item() == pytest.approx((-2 / 3) / s3, abs=1e-5)
    # the loop's advantages are an increasing affine map of G within each group: same mean_std step advantage
    adv = group_advantages(GI_G, GI_GROUPS)
    from_adv = prefix_step_advantages(adv, GI_IDS, GI_MASK, GI_GROUPS, normalize="mean_std")
    assert torch.allclose(from_adv, step, atol=1e-4)
    ctx = transform_ctx(adv, mask=GI_MASK, group_ids=GI_GROUPS, completion_ids=GI_IDS)
    out = GiGPO(GiGPOOptions(normalize="mean_std")).transform(ctx)
    assert torch.allclose(out[0], adv[0] + step[0], atol=1e-4)


def test_gigpo_options_check_and_token_advantages_need_a_reward():
    for bad in ({"normalize": "std"}, {"step_weight": -1.0}, {"eps": 0.0}):
        with pytest.raises(VariantError):
            parse_spec({"name": "gigpo", **bad}, 0)
    with pytest.raises(VariantError, match="acc"):
        GiGPO(GiGPOOptions(reward="acc")).check(SimpleNamespace(rewards={"format": {}}))
    ctx = transform_ctx(torch.zeros(6, 4), mask=GI_MASK, group_ids=GI_GROUPS, completion_ids=GI_IDS)
    with pytest.raises(ValueError, match="reward"):
        GiGPO().transform(ctx)
