"""Credit assignment over denoising steps (mmrl.core.credit) on reward sequences worked out by hand.

Notation: R = [R_0, ..., R_n], d_t = R_{t+1} - R_t, G = R_n - R_0, s_t = sign(d_t) sign(G),
consistency at step t: sign(d_t) sign(R_n - R_{t+1}) > 0. Float64 everywhere so sums are exact enough.
"""

import math
from pathlib import Path

import pytest
import torch

from mmrl.core.advantages import group_advantages
from mmrl.core.credit import (
    CREDIT_FUNCTIONS,
    STEP_ADVANTAGES,
    TurningPointCredit,
    cosine_similarity_credit,
    cosine_step_weights,
    dense_advantages,
    gaussian_step_entropy,
    merge_low_entropy_steps,
    multi_step_group_advantages,
    step_gain_credit,
    turning_point_credit,
    turning_points,
    value_anchored_advantages,
)


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


REPO = Path(__file__).resolve().parents[1]


def close(a, b, tol=1e-9):
    return torch.allclose(a, torch.as_tensor(b, dtype=a.dtype), atol=tol, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# Step gain
# ---------------------------------------------------------------------------------------------------------


def test_step_gain_by_hand_and_telescopes():
    r = t([[0.2, 0.1, 0.4, 0.5], [1.0, 1.0, 0.0, 2.0]])
    d = step_gain_credit(r)
    # row 0: [0.1-0.2, 0.4-0.1, 0.5-0.4]; row 1: [0, -1, 2]
    assert d.shape == (2, 3)
    assert close(d, [[-0.1, 0.3, 0.1], [0.0, -1.0, 2.0]])
    assert close(d.sum(1), r[:, -1] - r[:, 0])


def test_step_gain_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"\[B, n\+1\]"):
        step_gain_credit(torch.zeros(4))
    with pytest.raises(ValueError, match=r"\[B, n\+1\]"):
        step_gain_credit(torch.zeros(4, 1))


def test_step_gain_keeps_float32():
    assert step_gain_credit(torch.zeros(2, 3)).dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------
# TP-GRPO turning points (paper rule)
# ---------------------------------------------------------------------------------------------------------


def test_turning_point_example_g_positive():
    # R = [0.2, 0.1, 0.4, 0.5]: d = [-0.1, 0.3, 0.1], G = 0.3 > 0, s = [-, +, +]
    # step 0: sign(d_0) = -1, R_3 - R_1 = 0.4 -> +1: product < 0, not a turning point -> d_0 = -0.1
    # step 1: s_0 < 0, s_1 > 0, sign(d_1) = + and R_3 - R_2 = 0.1 > 0: turning point -> R_3 - R_1 = 0.4
    # step 2: s_1 > 0 (no flip) -> d_2 = 0.1
    out = turning_point_credit(t([[0.2, 0.1, 0.4, 0.5]]))
    assert isinstance(out, TurningPointCredit)
    assert out.turning_points.tolist() == [[False, True, False]]
    assert close(out.step_rewards, [[-0.1, 0.4, 0.1]])
    rewards, mask = out  # also a tuple
    assert rewards.shape == mask.shape == (1, 3)
    assert mask.dtype == torch.bool


def test_turning_point_example_g_negative():
    # R = [0.5, 0.6, 0.2, 0.1]: d = [0.1, -0.4, -0.1], G = -0.4 < 0, s = [-, +, +]
    # step 0: sign(d_0) = + but R_3 - R_1 = -0.5: not a turning point -> 0.1
    # step 1: s_0 < 0, s_1 > 0, sign(d_1) = - and R_3 - R_2 = -0.1: consistent -> R_3 - R_1 = -0.5
    # step 2: no flip -> -0.1
    out = turning_point_credit(t([[0.5, 0.6, 0.2, 0.1]]))
    assert out.turning_points.tolist() == [[False, True, False]]
    assert close(out.step_rewards, [[0.1, -0.5, -0.1]])


def test_consistency_filter_on_and_off():
    # R = [0.2, 0.1, 0.6, 0.4]: d = [-0.1, 0.5, -0.2], G = 0.2 > 0, s = [-, +, -]
    # step 1 flips (s_0 < 0, s_1 > 0) but R_3 - R_2 = -0.2 has the opposite sign of d_1: the filter rejects it.
    # filter on: no turning point, rewards = d = [-0.1, 0.5, -0.2]
    # filter off: step 1 is a turning point -> R_3 - R_1 = 0.3; step 0: s_0 < 0 -> no; step 2: s_2 < 0 -> no
    r = t([[0.2, 0.1, 0.6, 0.4]])
    on = turning_point_credit(r, consistency_filter=True)
    assert not on.turning_points.any()
    assert close(on.step_rewards, [[-0.1, 0.5, -0.2]])
    off = turning_point_credit(r, consistency_filter=False)
    assert off.turning_points.tolist() == [[False, True, False]]
    assert close(off.step_rewards, [[-0.1, 0.3, -0.2]])


def test_step_zero_rule():
    # R = [0.2, 0.5, 0.4, 0.6]: d = [0.3, -0.1, 0.2], G = 0.4, s = [+, -, +]
    # step 0: sign(d_0) = + and R_3 - R_1 = 0.1 > 0: turning point -> R_3 - R_0 = 0.4
    # step 1: s_1 < 0 -> -0.1
    # step 2: s_1 < 0, s_2 > 0 but R_3 - R_3 = 0: sign 0 fails the filter (the last step never passes it) -> 0.2
    out = turning_point_credit(t([[0.2, 0.5, 0.4, 0.6]]))
    assert out.turning_points.tolist() == [[True, False, False]]
    assert close(out.step_rewards, [[0.4, -0.1, 0.2]])
    # without the filter step 2 is a turning point too, its long-term reward R_3 - R_2 = 0.2 equals d_2
    off = turning_point_credit(t([[0.2, 0.5, 0.4, 0.6]]), consistency_filter=False)
    assert off.turning_points.tolist() == [[True, False, True]]
    assert close(off.step_rewards, [[0.4, -0.1, 0.2]])


def test_step_zero_filter_differs_from_unfiltered():
    # R = [0.2, 0.6, 0.5, 0.4]: d = [0.4, -0.1, -0.1], G = 0.2 > 0, s = [+, -, -]
    # filtered step 0: sign(d_0) = + but R_3 - R_1 = -0.2: not a turning point -> rewards = d
    # unfiltered step 0 (anchor with the consistency selection off): s_0 > 0 -> turning point, R_3 - R_0 = 0.2
    r = t([[0.2, 0.6, 0.5, 0.4]])
    on = turning_point_credit(r)
    assert not on.turning_points.any()
    assert close(on.step_rewards, [[0.4, -0.1, -0.1]])
    off = turning_point_credit(r, consistency_filter=False)
    assert off.turning_points.tolist() == [[True, False, False]]
    assert close(off.step_rewards, [[0.2, -0.1, -0.1]])


def test_turning_point_with_zero_bonus_keeps_its_own_gain():
    # the anchor (my_train_sd3_fast_with_op3.py, drop_original_reward_when_having_bonus) zeroes d_t only where the
    # bonus eta * (R_n - R_t) is non-zero. R = [0, 1, 0.5, 1.5, 0.5]: d = [1, -0.5, 1, -1], G = 0.5, s = [+, -, +, -]
    # unfiltered: step 0 (s_0 > 0) -> R_4 - R_0 = 0.5; step 2 (s_1 < 0, s_2 > 0) is a turning point whose bonus
    # R_4 - R_2 = 0 is zero, so it keeps d_2 = 1 (not 0)
    off = turning_point_credit(t([[0.0, 1.0, 0.5, 1.5, 0.5]]), consistency_filter=False)
    assert off.turning_points.tolist() == [[True, False, True, False]]
    assert close(off.step_rewards, [[0.5, -0.5, 1.0, -1.0]])
    # eta = 0: no bonus anywhere, every step keeps its gain
    zero = turning_point_credit(t([[0.0, 1.0, 0.5, 1.5, 0.5]]), consistency_filter=False, eta=0.0)
    assert close(zero.step_rewards, [[1.0, -0.5, 1.0, -1.0]])


def test_zero_gains_are_never_turning_points():
    # R = [0.3, 0.3, 0.5, 0.5]: d = [0, 0.2, 0], G = 0.2, s = [0, +, 0]
    # step 0: sign(0) = 0 -> no; step 1: s_0 = 0 is not < 0 -> no flip; step 2: s_2 = 0 -> no
    # R = [0.3, 0.1, 0.5, 0.3]: G = 0 -> every s_t = 0, no turning point after step 0; step 0: sign(d_0) = -,
    # sign(R_3 - R_1 = 0.2) = + -> no. Rewards are the gains d.
    # R constant: all zero.
    r = t([[0.3, 0.3, 0.5, 0.5], [0.3, 0.1, 0.5, 0.3], [0.7, 0.7, 0.7, 0.7]])
    for flt in (True, False):
        out = turning_point_credit(r, consistency_filter=flt)
        assert not out.turning_points.any()
        assert close(out.step_rewards, [[0.0, 0.2, 0.0], [-0.2, 0.4, -0.2], [0.0, 0.0, 0.0]])


def test_two_turning_points_in_one_trajectory():
    # R = [0.5, 0.4, 0.7, 0.6, 0.8, 0.9]: d = [-0.1, 0.3, -0.1, 0.2, 0.1], G = 0.4, s = [-, +, -, +, +]
    # step 1: flip, R_5 - R_2 = 0.2 > 0 -> turning point, R_5 - R_1 = 0.5
    # step 3: flip, R_5 - R_4 = 0.1 > 0 -> turning point, R_5 - R_3 = 0.3
    out = turning_point_credit(t([[0.5, 0.4, 0.7, 0.6, 0.8, 0.9]]))
    assert out.turning_points.tolist() == [[False, True, False, True, False]]
    assert close(out.step_rewards, [[-0.1, 0.5, -0.1, 0.3, 0.1]])


def test_turning_points_function_matches_credit_mask():
    r = torch.randn(20, 7, dtype=torch.float64)
    for flt in (True, False):
        assert torch.equal(turning_points(r, consistency_filter=flt),
                           turning_point_credit(r, consistency_filter=flt).turning_points)


def test_turning_point_properties_on_random_rewards():
    torch.manual_seed(3)
    r = torch.randn(200, 9, dtype=torch.float64)
    out = turning_point_credit(r)
    d = r[:, 1:] - r[:, :-1]
    g = (r[:, -1] - r[:, 0]).unsqueeze(1).expand_as(d)
    mask = out.turning_points
    assert mask.any()
    # at a turning point sign(d_t) = sign(G) != 0, and with the filter the last step is never one
    assert torch.equal(torch.sign(d[mask]), torch.sign(g[mask]))
    assert not mask[:, -1].any()
    # elsewhere the reward is the plain gain
    assert torch.equal(out.step_rewards[~mask], d[~mask])
    assert close(out.step_rewards[mask], (r[:, -1:] - r[:, :-1])[mask])


def test_nan_rewards_give_nan_and_no_turning_points():
    r = t([[0.2, float("nan"), 0.4, 0.5], [0.2, 0.1, 0.4, 0.5]])
    out = turning_point_credit(r)
    assert not out.turning_points[0].any()
    assert torch.isnan(out.step_rewards[0]).all()
    assert out.turning_points[1].tolist() == [False, True, False]
    adv = dense_advantages(out.step_rewards, [0, 0])
    assert torch.equal(adv[0], torch.zeros(3, dtype=adv.dtype))


@pytest.mark.parametrize("mode", ["paper", "g_plus_bonus"])
def test_one_nan_reward_leaves_no_partial_credit_on_the_trajectory(mode):
    """An unscored intermediate or final image makes the whole trajectory unscored (advantage 0 on every step, as
    outcome credit gives the sample), not a credit built on its other steps: a turning point at t = 4 survived a
    NaN at R_1 and a NaN R_n still credited the early steps."""
    r = t([[0.0, float("nan"), 0.5, 0.4, 0.3, 0.8, 1.0], [0.0, 0.5, 0.4, 0.3, 0.2, 0.1, float("nan")],
           [0.0, 0.5, 0.4, 0.3, 0.6, 0.8, 1.0]])
    out = turning_point_credit(r, mode=mode, balance=False)
    assert torch.isnan(out.step_rewards[:2]).all() and not out.turning_points[:2].any()
    assert torch.isfinite(out.step_rewards[2]).all()
    assert torch.isnan(step_gain_credit(r)[:2]).all() and torch.isfinite(step_gain_credit(r)[2]).all()


def test_eta_scales_the_turning_point_reward():
    out = turning_point_credit(t([[0.2, 0.1, 0.4, 0.5]]), eta=2.0)
    assert close(out.step_rewards, [[-0.1, 0.8, 0.1]])


def test_bad_mode_and_shape():
    with pytest.raises(ValueError, match="unknown turning-point mode"):
        turning_point_credit(t([[0.0, 1.0]]), mode="nope")
    with pytest.raises(ValueError, match=r"\[B, n\+1\]"):
        turning_point_credit(t([0.0, 1.0]))


# ---------------------------------------------------------------------------------------------------------
# TP-GRPO balancing
# ---------------------------------------------------------------------------------------------------------

# n = 5 trajectories, turning points worked out as above:
P1 = [0.5, 0.4, 0.7, 0.6, 0.8, 0.9]    # G = +0.4; turning points at 1 (R_5-R_1 = 0.5) and 3 (R_5-R_3 = 0.3)
P2 = [0.0, -0.1, 0.5, 0.6, 0.7, 0.9]   # d = [-.1,.6,.1,.1,.2], G = +0.9; step 1: flip, R_5-R_2 = .4 > 0 -> TP, 1.0
N1 = [0.5, 0.6, 0.2, 0.15, 0.12, 0.1]  # d = [.1,-.4,-.05,-.03,-.02], G = -0.4; step 0: R_5-R_1 = -.5 vs + -> no;
#                                        step 1: flip, sign(d_1) = -, R_5-R_2 = -.1 -> TP, R_5-R_1 = -0.5
N2 = [0.5, 0.55, 0.35, 0.32, 0.31, 0.3]  # d = [.05,-.2,-.03,-.01,-.01], G = -0.2; step 1 TP, R_5-R_1 = -0.25


def test_unbalanced_turning_points_by_hand():
    out = turning_point_credit(t([P1, P2, N1, N2]))
    assert out.turning_points.tolist() == [
        [False, True, False, True, False],
        [False, True, False, False, False],
        [False, True, False, False, False],
        [False, True, False, False, False],
    ]
    assert close(out.step_rewards[0], [-0.1, 0.5, -0.1, 0.3, 0.1])
    assert close(out.step_rewards[1], [-0.1, 1.0, 0.1, 0.1, 0.2])
    assert close(out.step_rewards[2], [0.1, -0.5, -0.05, -0.03, -0.02])
    assert close(out.step_rewards[3], [0.05, -0.25, -0.03, -0.01, -0.01])


def test_balance_keeps_largest_abs_g():
    # positive turning points: P1@1 (|G| .4), P1@3 (.4), P2@1 (.9); negative: N1@1 (.4) -> keep 1 of each:
    # P2@1 (largest |G|) and N1@1; both of P1's revert to their gains d = [-.1, .3, -.1, .2, .1]
    out = turning_point_credit(t([P1, P2, N1]), balance=True)
    assert out.turning_points.tolist() == [
        [False, False, False, False, False],
        [False, True, False, False, False],
        [False, True, False, False, False],
    ]
    assert close(out.step_rewards[0], [-0.1, 0.3, -0.1, 0.2, 0.1])
    assert close(out.step_rewards[1], [-0.1, 1.0, 0.1, 0.1, 0.2])
    assert close(out.step_rewards[2], [0.1, -0.5, -0.05, -0.03, -0.02])


def test_balance_two_of_each_ties_go_to_the_earlier_step():
    # positives P1@1, P1@3 (tie, |G| = .4), P2@1 (.9); negatives N1@1 (.4), N2@1 (.2) -> keep 2 of each:
    # P2@1, then the tie between P1's two turning points goes to the earlier step P1@1; P1@3 reverts to d_3 = 0.2
    out = turning_point_credit(t([P1, P2, N1, N2]), balance=True)
    assert out.turning_points.tolist() == [
        [False, True, False, False, False],
        [False, True, False, False, False],
        [False, True, False, False, False],
        [False, True, False, False, False],
    ]
    assert close(out.step_rewards[0], [-0.1, 0.5, -0.1, 0.2, 0.1])
    assert int(out.turning_points.sum()) == 4


def test_balance_with_one_sign_keeps_everything():
    # only G > 0 trajectories: the anchor does not balance (nothing to pair with), all turning points stay
    plain = turning_point_credit(t([P1, P2]))
    balanced = turning_point_credit(t([P1, P2]), balance=True)
    assert torch.equal(plain.turning_points, balanced.turning_points)
    assert torch.equal(plain.step_rewards, balanced.step_rewards)


def test_balance_within_each_sampling_batch():
    # batch "a" = [P1, N1]: P1 has 2 positives, N1 one negative -> keep P1@1 (earlier of the tie) and N1@1
    # batch "b" = [P2, N2]: one of each -> both kept
    r = t([P1, N1, P2, N2])
    out = turning_point_credit(r, balance=True, group_ids=["a", "a", "b", "b"])
    assert out.turning_points.tolist() == [
        [False, True, False, False, False],
        [False, True, False, False, False],
        [False, True, False, False, False],
        [False, True, False, False, False],
    ]
    # the whole input as one batch: 3 positives vs 2 negatives -> P1@3 dropped as well (same answer here);
    # with [P1, P2, N1] in one batch only P2 survives among positives (previous test), per batch P1@1 survives
    per_batch = turning_point_credit(t([P1, N1, P2]), balance=True, group_ids=[0, 0, 1])
    assert per_batch.turning_points[0].tolist() == [False, True, False, False, False]
    assert per_batch.turning_points[2].tolist() == [False, True, False, False, False]
    with pytest.raises(ValueError, match="group_ids has 2 entries"):
        turning_point_credit(r, balance=True, group_ids=[0, 1])


# ---------------------------------------------------------------------------------------------------------
# TP-GRPO: the anchor's config defaults (G + bonus)
# ---------------------------------------------------------------------------------------------------------


def test_g_plus_bonus_by_hand():
    # R = [0.2, 0.1, 0.4, 0.5]: G = 0.3, d = [-0.1, 0.3, 0.1]; unfiltered turning points: step 1 only
    # (step 0: s_0 < 0). Rule: r_t = G + 1[TP] d_t -> [0.3, 0.6, 0.3]
    out = turning_point_credit(t([[0.2, 0.1, 0.4, 0.5]]), mode="g_plus_bonus")
    assert out.turning_points.tolist() == [[False, True, False]]
    assert close(out.step_rewards, [[0.3, 0.6, 0.3]])
    alias = turning_point_credit(t([[0.2, 0.1, 0.4, 0.5]]), mode="config_default")
    assert torch.equal(alias.step_rewards, out.step_rewards)


def test_g_plus_bonus_defaults_to_no_consistency_filter():
    # R = [0.2, 0.6, 0.5, 0.4]: G = 0.2, d = [0.4, -0.1, -0.1]; unfiltered step 0: s_0 > 0 -> turning point
    # r = [G + d_0, G, G] = [0.6, 0.2, 0.2]; with the filter step 0 is not one -> [0.2, 0.2, 0.2]
    r = t([[0.2, 0.6, 0.5, 0.4]])
    out = turning_point_credit(r, mode="g_plus_bonus")
    assert out.turning_points.tolist() == [[True, False, False]]
    assert close(out.step_rewards, [[0.6, 0.2, 0.2]])
    filtered = turning_point_credit(r, mode="g_plus_bonus", consistency_filter=True)
    assert close(filtered.step_rewards, [[0.2, 0.2, 0.2]])


def test_balance_ranks_by_g_in_paper_mode_and_by_gain_in_g_plus_bonus():
    # A = [0.0, -0.1, 0.2, 1.0]: d = [-.1, .3, .8], G = 1.0; step 1 TP (R_3 - R_2 = .8 > 0), |d_1| = .3
    # B = [0.2, 0.1, 0.7, 0.8]: d = [-.1, .6, .1], G = 0.6; step 1 TP (R_3 - R_2 = .1 > 0), |d_1| = .6
    # C = [0.5, 0.6, 0.2, 0.1]: G = -0.4, step 1 TP (negative)
    # paper mode keeps the largest |G| -> A; the config-default rule ranks by |d_t| -> B
    r = t([[0.0, -0.1, 0.2, 1.0], [0.2, 0.1, 0.7, 0.8], [0.5, 0.6, 0.2, 0.1]])
    paper = turning_point_credit(r, balance=True)
    assert paper.turning_points[:, 1].tolist() == [True, False, True]
    bonus = turning_point_credit(r, balance=True, mode="g_plus_bonus")
    assert bonus.turning_points[:, 1].tolist() == [False, True, True]
    # g_plus_bonus rewards: A = G everywhere = 1.0; B = [.6, .6 + .6, .6]; C = G = -.4 plus d_1 = -.4 at step 1
    assert close(bonus.step_rewards, [[1.0, 1.0, 1.0], [0.6, 1.2, 0.6], [-0.4, -0.8, -0.4]])


# ---------------------------------------------------------------------------------------------------------
# Cosine-similarity credit (CoCA)
# ---------------------------------------------------------------------------------------------------------


def test_cosine_weights_and_credit_by_hand():
    # final = [1, 0]; predictions with cos = 0, 0.6, 1 -> gains [0.6, 0.4], sum 1 -> weights [0.6, 0.4]
    preds = t([[[0.0, 1.0], [0.6, 0.8], [1.0, 0.0]]])
    w = cosine_step_weights(preds)
    assert close(w, [[0.6, 0.4]])
    credit = cosine_similarity_credit(preds, t([[1.0, 0.0]]), t([2.0]))
    assert close(credit, [[1.2, 0.8]])
    assert close(credit.sum(1), [2.0])
    # final=None uses the last prediction
    assert close(cosine_similarity_credit(preds, None, t([2.0])), [[1.2, 0.8]])


def test_cosine_variant_options_reach_the_credit():
    # the variant's window / reward_to_go / alpha / clamp_negative (CoCA's trainer: window 5, reward-to-go) are the
    # core function's on the centred pixels; window 1 without reward-to-go is the default
    from mmrl.algorithms.base import Intermediate, VariantError, parse_spec
    from mmrl.config import ConfigError, load_config

    torch.manual_seed(0)
    images = torch.rand(3, 5, 3, 4, 4)
    inter = Intermediate(images=images, step_rewards=torch.rand(3, 5))
    flat = images.reshape(3, 5, -1) * 2 - 1
    flat = flat - flat.mean(dim=-1, keepdim=True)

    def variant_credit(**options):
        return parse_spec({"name": "cosine", **options}, 0).credit(inter, None)

    default = variant_credit()
    assert close(default, cosine_similarity_credit(flat, None, inter.step_rewards[:, -1]))
    shaped = variant_credit(window=2, reward_to_go=True, alpha=0.25, clamp_negative=True)
    assert close(shaped, cosine_similarity_credit(flat, None, inter.step_rewards[:, -1], window=2, reward_to_go=True,
                                                  alpha=0.25, clamp_negative=True))
    assert not torch.allclose(default, shaped)
    with pytest.raises(VariantError, match="reward_to_go"):
        parse_spec({"name": "cosine", "alpha": 0.5}, 0)
    # the window must divide the trained steps (9 of the tiny dense recipe's sliding window)
    with pytest.raises(ConfigError, match="window=2 must divide the 9 trained steps"):
        load_config(REPO / "configs/tiny/dense_grpo.yaml", ["algorithm.variants=[{name: cosine, window: 2}]"])
    load_config(REPO / "configs/tiny/dense_grpo.yaml", ["algorithm.variants=[{name: cosine, window: 3}]"])


def test_cosine_negative_gain_kept_or_clamped():
    # cos = [0, 0.8, 0.6, 1]: gains [0.8, -0.2, 0.4], sum 1.0 -> weights [0.8, -0.2, 0.4] (anchor keeps negatives)
    # clamp_negative: [0.8, 0, 0.4] / 1.2 = [2/3, 0, 1/3]
    preds = t([[[0.0, 1.0], [0.8, 0.6], [0.6, 0.8], [1.0, 0.0]]])
    assert close(cosine_step_weights(preds), [[0.8, -0.2, 0.4]])
    assert close(cosine_step_weights(preds, clamp_negative=True), [[2 / 3, 0.0, 1 / 3]])
    # reward-to-go (the anchor's shaping): sum_{s >= t} w_s = [1.0, 0.2, 0.4]; R = 3 -> [3, 0.6, 1.2]
    # alpha = 0.5: R (0.5 + 0.5 [1, .2, .4]) = 3 [1, .6, .7]
    assert close(cosine_similarity_credit(preds, None, t([3.0]), reward_to_go=True), [[3.0, 0.6, 1.2]])
    assert close(cosine_similarity_credit(preds, None, t([3.0]), reward_to_go=True, alpha=0.5), [[3.0, 1.8, 2.1]])
    with pytest.raises(ValueError, match="reward_to_go"):
        cosine_similarity_credit(preds, None, t([3.0]), alpha=0.5)


def test_cosine_window_by_hand():
    # n = 4, window 2; cos = [0, 0.6, 0.8, 0.8, 1.0]: window means m = [0.7, 0.9], gains [0.7 - 0, 0.9 - 0.7]
    # = [0.7, 0.2], sum 0.9; per step g / (2 * 0.9) -> [.3889, .3889, .1111, .1111], sums to 1
    preds = t([[[0.0, 1.0], [0.6, 0.8], [0.8, 0.6], [0.8, 0.6], [1.0, 0.0]]])
    w = cosine_step_weights(preds, window=2)
    assert close(w, [[0.7 / 1.8, 0.7 / 1.8, 0.2 / 1.8, 0.2 / 1.8]])
    assert close(w.sum(1), [1.0])
    with pytest.raises(ValueError, match="window must divide"):
        cosine_step_weights(preds, window=3)


def test_cosine_uniform_when_no_movement():
    # every prediction already equals the final image: all gains 0 -> uniform 1/n
    preds = torch.ones(2, 5, 3, dtype=torch.float64)
    assert close(cosine_step_weights(preds), torch.full((2, 4), 0.25))
    assert close(cosine_similarity_credit(preds, None, t([4.0, -2.0])), [[1.0] * 4, [-0.5] * 4])


def test_cosine_credit_sums_and_shapes_on_images():
    torch.manual_seed(1)
    preds = torch.randn(6, 4, 3, 8, 8)  # [B, n+1, C, H, W]
    final = torch.randn(6, 3, 8, 8)
    rewards = torch.randn(6)
    credit = cosine_similarity_credit(preds, final, rewards)
    assert credit.shape == (6, 3) and credit.dtype == torch.float32
    # each row distributes exactly its outcome reward (unless the gains sum to ~0, then uniformly)
    assert torch.allclose(credit.sum(1), rewards, atol=1e-4)
    with pytest.raises(ValueError, match="outcome_rewards has 5"):
        cosine_similarity_credit(preds, final, rewards[:5])
    with pytest.raises(ValueError, match="features per sample"):
        cosine_similarity_credit(preds, torch.randn(6, 5), rewards)


def test_cosine_nan_reward_gives_zero_advantage():
    preds = t([[[0.0, 1.0], [0.6, 0.8], [1.0, 0.0]]] * 2)
    credit = cosine_similarity_credit(preds, None, t([float("nan"), 1.0]))
    assert torch.isnan(credit[0]).all()
    assert torch.equal(dense_advantages(credit, [0, 0])[0], torch.zeros(2, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------
# Dense advantages
# ---------------------------------------------------------------------------------------------------------


def test_dense_advantages_per_column_by_hand():
    # group 0 = rows 0, 1; group 1 = rows 2, 3
    # column 0, group 0: [1, 3] -> mean 2, biased std 1 -> [-1, 1] / (1 + 1e-4)
    # column 1, group 0: [5, 5] -> zero spread -> 0
    # column 0, group 1: [0, 4] -> mean 2, std 2 -> [-2, 2] / (2 + 1e-4)
    # column 1, group 1: [1, 2] -> mean 1.5, std 0.5 -> [-.5, .5] / (.5 + 1e-4)
    r = t([[1.0, 5.0], [3.0, 5.0], [0.0, 1.0], [4.0, 2.0]])
    adv = dense_advantages(r, [0, 0, 1, 1])
    e = 1e-4
    expected = [[-1 / (1 + e), 0.0], [1 / (1 + e), 0.0],
                [-2 / (2 + e), -0.5 / (0.5 + e)], [2 / (2 + e), 0.5 / (0.5 + e)]]
    assert close(adv, expected)
    # the same as group_advantages on each column, and options pass through
    for col in range(2):
        assert torch.equal(adv[:, col], group_advantages(r[:, col], [0, 0, 1, 1], std_ddof=0, eps=1e-4))
    unbiased = dense_advantages(r, [0, 0, 1, 1], std_ddof=1, scale="group")
    assert close(unbiased[:2, 0], [-1 / (math.sqrt(2) + e), 1 / (math.sqrt(2) + e)])
    with pytest.raises(ValueError, match=r"\[B, n\]"):
        dense_advantages(torch.zeros(4), [0, 0, 1, 1])


def test_turning_point_credit_through_dense_advantages_and_the_loss():
    from mmrl.core.losses import policy_loss

    r = t([P1, P2, N1, N2])
    out = turning_point_credit(r, balance=True)
    adv = dense_advantages(out.step_rewards, [0, 0, 1, 1]).float()
    assert adv.shape == (4, 5)
    logps = torch.randn(4, 5, requires_grad=True)
    mask = torch.ones(4, 5)
    loss = policy_loss(logps, logps.detach(), adv, mask)
    loss.loss.backward()
    assert logps.grad is not None and torch.isfinite(logps.grad).all()


# ---------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------


def test_registry_names_and_uniform_call():
    assert set(CREDIT_FUNCTIONS) == {"outcome", "step_gain", "turning_point", "cosine"}
    r = t([[0.2, 0.1, 0.4, 0.5], [0.5, 0.6, 0.2, 0.1]])
    preds = t([[[0.0, 1.0], [0.6, 0.8], [0.8, 0.6], [1.0, 0.0]]] * 2)
    inputs = dict(step_rewards=r, outcome_rewards=r[:, -1], predictions=preds, final=None, num_steps=3,
                  group_ids=None)
    outcome = CREDIT_FUNCTIONS["outcome"](**inputs)
    assert close(outcome, [[0.5] * 3, [0.1] * 3])
    assert torch.equal(CREDIT_FUNCTIONS["step_gain"](**inputs), step_gain_credit(r))
    assert torch.equal(CREDIT_FUNCTIONS["turning_point"](**inputs), turning_point_credit(r).step_rewards)
    assert torch.equal(CREDIT_FUNCTIONS["turning_point"](**inputs, mode="g_plus_bonus"),
                       turning_point_credit(r, mode="g_plus_bonus").step_rewards)
    assert torch.equal(CREDIT_FUNCTIONS["cosine"](**inputs), cosine_similarity_credit(preds, None, r[:, -1]))
    for name in CREDIT_FUNCTIONS:
        assert CREDIT_FUNCTIONS[name](**inputs).shape == (2, 3)


def test_registry_missing_inputs_and_unknown_options():
    with pytest.raises(ValueError, match="needs step_rewards"):
        CREDIT_FUNCTIONS["step_gain"](outcome_rewards=t([1.0]))
    with pytest.raises(ValueError, match="needs predictions"):
        CREDIT_FUNCTIONS["cosine"](outcome_rewards=t([1.0]))
    with pytest.raises(ValueError, match="needs num_steps"):
        CREDIT_FUNCTIONS["outcome"](outcome_rewards=t([1.0]))
    with pytest.raises(TypeError):
        CREDIT_FUNCTIONS["turning_point"](step_rewards=t([[0.0, 1.0]]), not_an_option=1)
    assert set(STEP_ADVANTAGES) == {"grpo", "multi_step", "value_anchored"}


# ---------------------------------------------------------------------------------------------------------
# E-GRPO
# ---------------------------------------------------------------------------------------------------------


def test_merge_low_entropy_steps_threshold_by_hand():
    # variances [1, .01, .01, .01, .01, .01, .25]; threshold = entropy of std 0.19 (variance 0.0361)
    # step 0 alone (1 >= .0361); run 1..5: [1,2,3,4] reaches .04 >= .0361 -> group; remainder [5] (.01) joins it;
    # step 6 alone (.25)
    std = [1.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.5]
    tau = float(gaussian_step_entropy(torch.tensor(0.19)))
    assert merge_low_entropy_steps(noise_std=std, threshold=tau) == [[0], [1, 2, 3, 4, 5], [6]]
    # the same from per-step entropies
    from_entropy = merge_low_entropy_steps(gaussian_step_entropy(torch.tensor(std)), threshold=tau)
    assert from_entropy == [[0], [1, 2, 3, 4, 5], [6]]
    # a low run that never reaches the threshold stays one group; high steps stay alone
    assert merge_low_entropy_steps(noise_std=[0.1, 0.1, 1.0, 0.1], threshold=tau) == [[0, 1], [2], [3]]
    # threshold below every step: nothing merges
    assert merge_low_entropy_steps(noise_std=std, threshold=-100.0) == [[i] for i in range(7)]


def test_merge_low_entropy_steps_num_groups_by_hand():
    # equal-variance partition: [1,1,1,1] in 2 -> [[0,1],[2,3]]
    assert merge_low_entropy_steps(noise_std=[1.0] * 4, num_groups=2) == [[0, 1], [2, 3]]
    # variances [4,1,1,1,1], total 8, k=3: targets 8/3, 16/3: step 0 (4) closes; 1+2 reach 6 >= 5.33; rest [3,4]
    assert merge_low_entropy_steps(noise_std=[2.0, 1.0, 1.0, 1.0, 1.0], num_groups=3) == [[0], [1, 2], [3, 4]]
    # a dominant step cannot swallow several groups: every group gets at least one step
    assert merge_low_entropy_steps(noise_std=[10.0, 1.0, 1.0], num_groups=3) == [[0], [1], [2]]
    assert merge_low_entropy_steps(noise_std=[1.0, 2.0, 3.0], num_groups=1) == [[0, 1, 2]]


def test_merge_low_entropy_steps_validation():
    with pytest.raises(ValueError, match="exactly one of step_entropy"):
        merge_low_entropy_steps(threshold=0.0)
    with pytest.raises(ValueError, match="exactly one of threshold"):
        merge_low_entropy_steps(noise_std=[1.0], threshold=0.0, num_groups=1)
    with pytest.raises(ValueError, match="num_groups must be between"):
        merge_low_entropy_steps(noise_std=[1.0, 1.0], num_groups=3)
    with pytest.raises(ValueError, match="noise_std must be finite"):
        merge_low_entropy_steps(noise_std=[-1.0], threshold=0.0)


def test_gaussian_step_entropy():
    # h = 0.5 log(2 pi e s^2)
    assert math.isclose(float(gaussian_step_entropy(torch.tensor(2.0))), 0.5 * math.log(2 * math.pi * math.e * 4.0),
                        rel_tol=1e-6)


def test_multi_step_group_advantages_by_hand():
    # two merged steps, group of 3 per prompt, two granularities
    # granularity 1, column 0, group 0: [1, 2, 3] -> mean 2, unbiased std 1 -> [-1, 0, 1] / (1 + 1e-8)
    # granularity 2, column 0, group 0: [3, 3, 3] -> zero spread -> 0; sum = [-1, 0, 1]
    g1 = t([[1.0, 0.0], [2.0, 0.0], [3.0, 1.0], [0.0, 5.0], [0.0, 5.0], [3.0, 5.0]])
    g2 = t([[3.0, 1.0], [3.0, 2.0], [3.0, 3.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    groups = [0, 0, 0, 1, 1, 1]
    adv = multi_step_group_advantages([g1, g2], groups)
    assert close(adv[:3, 0], [-1.0, 0.0, 1.0], tol=1e-7)
    expected = dense_advantages(g1, groups, std_ddof=1, eps=1e-8) + dense_advantages(g2, groups, std_ddof=1, eps=1e-8)
    assert torch.equal(adv, expected)
    assert torch.equal(multi_step_group_advantages(g1, groups), dense_advantages(g1, groups, std_ddof=1, eps=1e-8))
    with pytest.raises(ValueError, match="same \\[B, k\\] shape"):
        multi_step_group_advantages([g1, g2[:, :1]], groups)


# ---------------------------------------------------------------------------------------------------------
# VGPO
# ---------------------------------------------------------------------------------------------------------


def test_value_anchored_advantages_do_not_vanish():
    # group 0 all 0.8 (GRPO gives 0); anchor V = 0.5 -> A = 1.0 * (0.8 - 0.5) = 0.3 each
    # group 1: [0, 1] -> relative [-1, 1] / (0.5 + 1e-4) * 0.5 ... biased std 0.5: (-.5 / .5001, .5 / .5001)
    #          absolute: [0 - .5, 1 - .5] = [-.5, .5]
    r = t([0.8, 0.8, 0.0, 1.0])
    adv = value_anchored_advantages(r, [0, 0, 1, 1], value=0.5)
    rel = 0.5 / (0.5 + 1e-4)
    assert close(adv, [0.3, 0.3, -rel - 0.5, rel + 0.5])
    assert torch.equal(group_advantages(r, [0, 0, 1, 1], std_ddof=0)[:2], torch.zeros(2, dtype=torch.float64))
    # weight 0 is plain GRPO; scale divides the absolute term; per-sample value estimates
    assert torch.equal(value_anchored_advantages(r, [0, 0, 1, 1], value=0.5, weight=0.0),
                       group_advantages(r, [0, 0, 1, 1], std_ddof=0))
    assert close(value_anchored_advantages(r, [0, 0, 1, 1], value=0.5, scale=2.0)[:2], [0.15, 0.15])
    assert close(value_anchored_advantages(r, [0, 0, 1, 1], value=t([0.8, 0.6, 0.0, 1.0]))[:2], [0.0, 0.2])


def test_value_anchored_dense_nan_and_validation():
    r = t([[0.8, float("nan")], [0.8, 0.2]])
    adv = value_anchored_advantages(r, [0, 0], value=t([0.5, 0.5]))
    assert close(adv, [[0.3, 0.0], [0.3, -0.3]])
    assert close(value_anchored_advantages(t([0.9, 0.9]), [0, 0], value=0.0, clamp=0.5), [0.5, 0.5])
    with pytest.raises(ValueError, match="scale must be > 0"):
        value_anchored_advantages(r, [0, 0], value=0.0, scale=0.0)
    with pytest.raises(ValueError, match="does not fit"):
        value_anchored_advantages(t([1.0, 2.0]), [0, 0], value=t([1.0, 2.0, 3.0]))
