"""Paper variants (GA-GRPO, TW-GRPO, DAPO dynamic sampling, T-GRPO) on cases worked out by hand."""

import math
from pathlib import Path

import pytest
import torch

from mmrl.core.advantages import group_advantages
from mmrl.core.losses import policy_loss
from mmrl.core.variants import (
    ADVANTAGE_TRANSFORMS,
    GROUP_FILTERS,
    evidence_weighted_advantages,
    select_informative_groups,
    select_top_variance_groups,
    temporal_contrast_rewards,
    token_variance_weights,
    token_weighted_advantages,
)

REPO = Path(__file__).parents[1]

# ---------------------------------------------------------------------------------------------------------
# GA-GRPO evidence weighting
# ---------------------------------------------------------------------------------------------------------


def test_evidence_scaling_positive_and_negative_by_hand():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0, 2.0])
    q = torch.tensor([1.0, 0.25, 1.0, 0.25, 0.5, 0.0])
    out = evidence_weighted_advantages(adv, q)
    # positive: A * q; negative: A * (2 - q); zero stays zero
    assert torch.allclose(out, torch.tensor([1.0, 0.25, -1.0, -1.75, 0.0, 0.0]))


def test_evidence_floor_and_signs_preserved():
    adv = torch.tensor([2.0, -2.0])
    q = torch.tensor([0.0, 0.0])
    out = evidence_weighted_advantages(adv, q, floor=0.2)
    # w = 0.2 + 0.8 * 0 = 0.2 -> 2 * 0.2 and -2 * (2 - 0.2)
    assert torch.allclose(out, torch.tensor([0.4, -3.6]))
    rand = torch.randn(50)
    scaled = evidence_weighted_advantages(rand, torch.rand(50), floor=0.1)
    assert torch.equal(torch.sign(scaled), torch.sign(rand))


def test_evidence_nan_quality_leaves_advantage_and_bad_quality_errors():
    adv = torch.tensor([1.5, -0.5])
    out = evidence_weighted_advantages(adv, torch.tensor([float("nan"), float("nan")]))
    assert torch.equal(out, adv)
    with pytest.raises(ValueError, match="sample 1 has 1.5"):
        evidence_weighted_advantages(adv, torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match="3 samples"):
        evidence_weighted_advantages(adv, torch.tensor([0.5, 0.5, 0.5]))


def test_evidence_on_nt_advantages_broadcasts_quality():
    adv = torch.tensor([[1.0, -1.0, 0.0], [2.0, 2.0, -2.0]])
    out = evidence_weighted_advantages(adv, torch.tensor([0.5, 1.0]))
    assert out.shape == (2, 3)
    assert torch.allclose(out, torch.tensor([[0.5, -1.5, 0.0], [2.0, 2.0, -2.0]]))


def test_evidence_after_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])  # one group: two right, two wrong
    adv = group_advantages(rewards, [0, 0, 0, 0], std_ddof=0)
    iou = torch.tensor([0.9, 0.9, 0.1, 0.1])
    out = evidence_weighted_advantages(adv, iou)
    a = adv[0].item()  # 1 / (0.5 + 1e-4)
    assert torch.allclose(out, torch.tensor([0.9 * a, -1.1 * a, 0.1 * a, -1.9 * a]))
    # the well-grounded right answer gets more credit than the badly grounded one
    assert out[0] > out[2] > 0 and out[3] < out[1] < 0


# ---------------------------------------------------------------------------------------------------------
# TW-GRPO token weights
# ---------------------------------------------------------------------------------------------------------


def _two_member_kl(a, b):
    """Hand formula for two responses: sum_v (cosh(d_v) - 1), d_v = log(b_v / a_v) / 2.

    For G = 2 the mean log-prob is (log a + log b) / 2, so member a's difference is +d and b's is -d; the
    average of (e^d - d - 1) and (e^-d + d - 1) is cosh(d) - 1.
    """
    return sum(math.cosh(0.5 * math.log(bv / av)) - 1.0 for av, bv in zip(a, b))


def test_token_weights_exact_tw_grpo_by_hand():
    # one group of two responses, vocabulary 2, three positions
    a = [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]
    b = [[0.5, 0.5], [0.8, 0.2], [0.1, 0.9]]
    logp = torch.tensor([a, b]).log()  # [2, 3, 2]
    mask = torch.ones(2, 3)
    w = token_variance_weights(logp, mask, [0, 0], max_weight=1.4)
    kl = [_two_member_kl(x, y) for x, y in zip(a, b)]
    assert kl[0] == 0.0
    expected = [1.0 + 0.4 * (k - 0.0) / (max(kl) - 0.0 + 1e-8) for k in kl]
    assert torch.allclose(w, torch.tensor([expected, expected]), atol=1e-6)
    assert w[0, 0] == 1.0 and abs(w[0, 2].item() - 1.4) < 1e-6  # same-distribution position 1, most divergent 1.4


def test_token_weights_padding_counts_as_uniform():
    # b differs from a at position 1, but b is padding there -> uniform, which equals a: no divergence
    a = [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]
    b = [[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]
    logp = torch.tensor([a, b]).log()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    w = token_variance_weights(logp, mask, ["q", "q"], max_weight=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 1.0, 2.0], [1.0, 0.0, 2.0]]), atol=1e-6)


def _anchor_weights(per_logps, completion_mask, num_generations, max_weight):
    """The anchor's computation, written from its description: contiguous groups, min-max over all columns."""
    total, length, vocab = per_logps.shape
    groups = per_logps.view(total // num_generations, num_generations, length, vocab)
    masks = completion_mask.view(total // num_generations, num_generations, length, 1)
    masked = torch.where(masks == 1, groups, torch.full_like(groups, -math.log(vocab)))
    diff = (masked.mean(dim=1, keepdim=True) - masked).clamp(-11.0, 11.0)
    kl = (torch.exp(diff) - diff - 1).sum(-1).mean(dim=1)
    lo, hi = kl.min(dim=1, keepdim=True)[0], kl.max(dim=1, keepdim=True)[0]
    w = 1.0 + (max_weight - 1.0) * (kl - lo) / (hi - lo + 1e-8)
    return w.repeat_interleave(num_generations, dim=0) * completion_mask


def test_token_weights_match_anchor_when_every_column_is_active():
    g, t, v = 4, 6, 11
    logits = torch.randn(3 * g, t, v)
    logp = logits.log_softmax(-1)
    mask = torch.ones(3 * g, t)
    for grp in range(3):
        lengths = torch.randint(1, t + 1, (g,))
        lengths[0] = t  # padded to the group's longest response
        for j, n in enumerate(lengths.tolist()):
            mask[grp * g + j, n:] = 0
    ours = token_variance_weights(logp, mask, torch.arange(3).repeat_interleave(g), max_weight=1.4)
    ref = _anchor_weights(logp, mask, g, 1.4)
    assert torch.allclose(ours, ref, atol=1e-5)


def test_token_weights_group_order_does_not_matter():
    logp = torch.randn(6, 5, 7).log_softmax(-1)
    mask = torch.ones(6, 5)
    groups = torch.tensor([0, 1, 0, 1, 0, 1])
    w = token_variance_weights(logp, mask, groups)
    perm = torch.tensor([0, 2, 4, 1, 3, 5])
    w_sorted = token_variance_weights(logp[perm], mask[perm], groups[perm])
    assert torch.allclose(w[perm], w_sorted)


def test_token_weights_from_nt_statistics_use_group_variance():
    # group 0: three responses; statistic per position; position 2 is padding for response 2
    stats = torch.tensor([[0.0, 1.0, 5.0], [0.0, 3.0, 1.0], [0.0, 2.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w = token_variance_weights(stats, mask, [7, 7, 7], max_weight=1.5)
    # biased variances over active responses: pos0 0, pos1 var(1,3,2) = 2/3, pos2 var(5,1) = 4
    var = [0.0, 2.0 / 3.0, 4.0]
    row = [1.0 + 0.5 * x / (4.0 + 1e-8) for x in var]
    expected = torch.tensor([row, row, row[:2] + [0.0]])
    assert torch.allclose(w, expected, atol=1e-6)


def test_token_weights_mean_one_over_active_tokens():
    logp = torch.randn(8, 9, 5).log_softmax(-1)
    mask = (torch.rand(8, 9) > 0.3).float()
    mask[:, 0] = 1
    w = token_variance_weights(logp, mask, torch.arange(8) // 4, normalize="mean")
    assert abs(((w * mask).sum() / mask.sum()).item() - 1.0) < 1e-6
    assert torch.all(w[mask == 0] == 0)
    raw = token_variance_weights(logp, mask, torch.arange(8) // 4)
    active = raw[mask > 0]
    assert active.min() >= 1.0 - 1e-6 and active.max() <= 1.4 + 1e-6


def test_token_weights_identical_responses_give_weight_one():
    one = torch.randn(1, 4, 6).log_softmax(-1)
    logp = one.repeat(3, 1, 1)
    w = token_variance_weights(logp, torch.ones(3, 4), [0, 0, 0])
    assert torch.equal(w, torch.ones(3, 4))


def test_token_weight_errors():
    with pytest.raises(ValueError, match="mask shape"):
        token_variance_weights(torch.zeros(2, 3), torch.ones(2, 4), [0, 0])
    with pytest.raises(ValueError, match="normalize"):
        token_variance_weights(torch.zeros(2, 3), torch.ones(2, 3), [0, 0], normalize="sum")
    with pytest.raises(ValueError, match="group_ids has 3"):
        token_variance_weights(torch.zeros(2, 3), torch.ones(2, 3), [0, 0, 1])


def test_token_weighted_advantages_shapes():
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    stats = torch.randn(4, 5)
    mask = torch.ones(4, 5)
    out = token_weighted_advantages(adv, stats, mask, [0, 0, 1, 1])
    w = token_variance_weights(stats, mask, [0, 0, 1, 1])
    assert out.shape == (4, 5)
    assert torch.allclose(out, adv.unsqueeze(1) * w)
    out2 = token_weighted_advantages(adv.unsqueeze(1).expand(4, 5), stats, mask, [0, 0, 1, 1])
    assert torch.allclose(out, out2)


# ---------------------------------------------------------------------------------------------------------
# DAPO dynamic sampling / variance-aware selection
# ---------------------------------------------------------------------------------------------------------


def test_equal_reward_groups_are_dropped():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = ["all_right"] * 3 + ["all_wrong"] * 3 + ["mixed"] * 2 + ["single"] + ["half"]
    keep = select_informative_groups(rewards, groups)
    assert keep.tolist() == [False] * 6 + [True, True, True, True]
    keep = select_informative_groups(rewards, groups, keep_singletons=False)
    assert keep.tolist() == [False] * 6 + [True, True, False, False]


def test_dynamic_sampling_min_std_and_nan():
    rewards = torch.tensor([0.0, 0.2, 0.0, 1.0, float("nan"), 1.0, float("nan"), float("nan")])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    # stds (ddof 0, NaN left out): g0 0.1, g1 0.5, g2 0 (one finite value), g3 none -> 0
    assert select_informative_groups(rewards, groups).tolist() == [True, True, True, True, False, False, False, False]
    assert select_informative_groups(rewards, groups, min_std=0.1).tolist() == [False, False, True, True] + [False] * 4


def test_dynamic_sampling_dense_rewards_any_column():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0], [2.0, 2.0], [2.0, 2.0]])
    assert select_informative_groups(rewards, [0, 0, 1, 1]).tolist() == [True, True, False, False]


def test_top_variance_groups_by_hand():
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.2, 5.0, 5.0, 0.0, 2.0])
    groups = ["a", "a", "b", "b", "c", "c", "d", "d"]
    # variances: a 0.25, b 0.01, c 0, d 1.0
    top2 = select_top_variance_groups(rewards, groups, 2)
    assert top2.tolist() == [True, True, False, False, False, False, True, True]
    assert select_top_variance_groups(rewards, groups, 0).tolist() == [False] * 8
    assert all(select_top_variance_groups(rewards, groups, 10).tolist())
    # ties broken by first appearance
    tied = torch.tensor([0.0, 1.0, 3.0, 4.0, 7.0, 7.0])
    assert select_top_variance_groups(tied, [0, 0, 1, 1, 2, 2], 1).tolist() == [True, True, False, False, False, False]


def test_group_filters_registry():
    assert GROUP_FILTERS["dynamic_sampling"] is select_informative_groups
    assert GROUP_FILTERS["top_variance"] is select_top_variance_groups


# ---------------------------------------------------------------------------------------------------------
# T-GRPO temporal contrast
# ---------------------------------------------------------------------------------------------------------


def test_temporal_bonus_on_exactly_at_threshold():
    # ordered p = 2/5 = 0.4; shuffled p~ = 2/4 = 0.5; 0.4 >= 0.8 * 0.5 -> bonus on the two correct ones
    ordered = torch.tensor([1, 1, 0, 0, 0], dtype=torch.bool)
    shuffled = torch.tensor([1, 1, 0, 0], dtype=torch.bool)
    bonus = temporal_contrast_rewards(ordered, shuffled, [0] * 5, shuffled_group_ids=[0] * 4)
    assert torch.allclose(bonus, torch.tensor([0.3, 0.3, 0.0, 0.0, 0.0]))


def test_temporal_bonus_off_below_threshold():
    # p = 1/5 = 0.2 < 0.8 * 0.5
    ordered = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0])
    shuffled = torch.tensor([1.0, 1.0, 0.0, 0.0])
    bonus = temporal_contrast_rewards(ordered, shuffled, [0] * 5, shuffled_group_ids=[0] * 4)
    assert torch.equal(bonus, torch.zeros(5))
    # p = 0.75 vs p~ = 1.0: 0.75 < 0.8 -> off; p = 0.8 -> on
    on_off = temporal_contrast_rewards(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.ones(4), [0] * 4)
    assert torch.equal(on_off, torch.zeros(4))
    five = temporal_contrast_rewards(torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0]), torch.ones(5), [0] * 5)
    assert torch.allclose(five, torch.tensor([0.3, 0.3, 0.3, 0.3, 0.0]))


def test_temporal_bonus_per_group_with_soft_accuracy_and_missing_shuffle():
    # group "v1": soft accuracies; mean 0.35 vs shuffled mean 0.25 -> on; only acc > 0.1 get the bonus
    # group "v2": ordered mean 0.5 < 0.8 * 1.0 -> off
    # group "img": no shuffled rollouts (an image question) -> no bonus
    ordered = torch.tensor([0.05, 0.65, 0.5, 0.5, 1.0, 1.0])
    groups = ["v1", "v1", "v2", "v2", "img", "img"]
    shuffled = torch.tensor([0.5, 0.0, 1.0])
    sgroups = ["v1", "v1", "v2"]
    bonus = temporal_contrast_rewards(ordered, shuffled, groups, shuffled_group_ids=sgroups, alpha=0.3, mu=0.8)
    assert torch.allclose(bonus, torch.tensor([0.0, 0.3, 0.0, 0.0, 0.0, 0.0]))


def test_temporal_bonus_nan_and_tensor_ids_and_errors():
    ordered = torch.tensor([1.0, float("nan"), 0.0, 1.0])
    shuffled = torch.tensor([0.0, 0.0, 1.0, float("nan")])
    ids = torch.tensor([3, 3, 3, 3])
    bonus = temporal_contrast_rewards(ordered, shuffled, ids)
    # p = 2/3 (NaN left out), p~ = 1/3 -> on; the NaN sample gets nothing
    assert torch.allclose(bonus, torch.tensor([0.3, 0.0, 0.0, 0.3]))
    assert bonus.dtype == torch.float32
    with pytest.raises(ValueError, match="shuffled_group_ids"):
        temporal_contrast_rewards(ordered, shuffled[:2], ids)


def test_t_grpo_plug_in_leaves_unjudged_answers_out():
    """The plug-in hands the accuracies to temporal_contrast_rewards as scored: ordered [1, NaN, NaN, 0] has
    p = 1/2 over its judged answers (not 1/4 with NaN as wrong), shuffled [1, 0] p~ = 1/2: 1/2 >= 0.8 x 1/2, so the
    correct ordered answer gets 0.3; an image question in the batch gets 0."""
    from types import SimpleNamespace

    from mmrl.algorithms.base import RewardContext
    from mmrl.algorithms.t_grpo import TGRPO, TGRPOOptions

    nan = float("nan")
    meta = [{"id": "v"}] * 4 + [{"id": "i"}] * 2
    rollout = SimpleNamespace(metadata=meta, prompts=["when?"] * 4 + ["what?"] * 2,
                              group_ids=torch.tensor([0] * 4 + [1] * 2))
    items = [SimpleNamespace(video_path="v.mp4"), SimpleNamespace(video_path=None)]
    shuffled = SimpleNamespace(metadata=[{"id": "v"}] * 2, prompts=["when?"] * 2)
    asked = []

    def sample(videos, n, shuffle_frames):
        asked.append((len(videos), n, shuffle_frames))
        return shuffled

    ctx = RewardContext(rollout=rollout, items=items, scores={"acc": torch.tensor([1.0, nan, nan, 0.0, 1.0, 0.0])},
                        weights={"acc": 1.0}, config=SimpleNamespace(data=SimpleNamespace(group_size=4)),
                        policy=None, accelerator=None, update=0, score=lambda r: {"acc": torch.tensor([1.0, 0.0])},
                        score_outputs=None, sample=sample, intermediate=None, stats={}, timer={})
    out = TGRPO(TGRPOOptions(reward="acc")).rewards(ctx)
    assert asked == [(1, 2, True)]  # half the group size, on the video question only
    assert torch.allclose(out.scores["temporal_bonus"], torch.tensor([0.3, 0.0, 0.0, 0.0, 0.0, 0.0]))
    assert out.weights["temporal_bonus"] == 1.0


def test_t_grpo_refuses_normalize_then_sum():
    """Video-R1 adds the 0.3 bonus to the summed reward and normalises once; normalize_then_sum would normalise the
    bonus on its own (acc [1, 1, 0, 0], format [1, 0, 1, 0], bonus on the correct ones: [2.60, 0.87, ...] instead of
    Video-R1's [1.21, 0.16, ...]), so the configuration is refused."""
    from mmrl.config import ConfigError, load_config

    args = ["algorithm.variants=[{name: t_grpo, reward: temporal_iou}]"]
    load_config(REPO / "configs/tiny/vlm_video_tg.yaml", args, check_files=False)
    with pytest.raises(ConfigError, match="t_grpo' adds its bonus .* algorithm.reward_combination=sum_then_normalize"):
        load_config(REPO / "configs/tiny/vlm_video_tg.yaml", [*args, "algorithm.reward_combination=normalize_then_sum"],
                    check_files=False)


def _video_r1_len_control(acc: list[float], lengths: list[int]) -> list[float]:
    """Video-R1's grpo_trainer.py with len_control, written out for one group (its local batch is one question's
    num_generations answers): correct = accuracy > 0.1; with more than one correct, each correct answer of
    320..512 completion tokens gets +0.2."""
    selected = [i for i, a in enumerate(acc) if a > 0.1]
    out = [0.0] * len(acc)
    if len(selected) > 1:
        for i in selected:
            if 320 <= lengths[i] <= 512:
                out[i] += 0.2
    return out


def test_length_control_is_video_r1s_len_control():
    from mmrl.core.variants import length_control_rewards

    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        groups = 3
        size = int(torch.randint(1, 7, (1,), generator=gen))
        acc = torch.rand(groups * size, generator=gen)
        acc = torch.where(torch.rand(groups * size, generator=gen) < 0.4, torch.zeros_like(acc), acc)
        lengths = torch.randint(200, 700, (groups * size,), generator=gen)
        lengths[0], lengths[-1] = 320, 512  # both bounds are inclusive
        group_ids = torch.arange(groups).repeat_interleave(size)
        expected = sum((_video_r1_len_control(acc[g * size:(g + 1) * size].tolist(),
                                              lengths[g * size:(g + 1) * size].tolist()) for g in range(groups)), [])
        got = length_control_rewards(acc, lengths, group_ids)
        torch.testing.assert_close(got, torch.tensor(expected), atol=1e-7, rtol=0)
    # by hand: one group with two correct answers (one of them too long), one with a single correct answer
    got = length_control_rewards(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.05, float("nan")]),
                                 torch.tensor([400, 600, 400, 400, 400, 400]), [0, 0, 0, 1, 1, 1])
    assert got.tolist() == pytest.approx([0.2, 0.0, 0.0, 0.0, 0.0, 0.0])


def test_temporal_bonus_feeds_group_advantages():
    ordered = torch.tensor([1.0, 1.0, 0.0, 0.0])
    accuracy_reward = ordered.clone()
    bonus = temporal_contrast_rewards(ordered, torch.tensor([1.0, 0.0]), [0] * 4, shuffled_group_ids=[0, 0])
    adv = group_advantages(accuracy_reward + bonus, [0] * 4)
    assert adv.shape == (4,) and adv[0] > 0 > adv[2]


# ---------------------------------------------------------------------------------------------------------
# Registry and the loss
# ---------------------------------------------------------------------------------------------------------


def test_advantage_transforms_registry_and_policy_loss_shapes():
    assert ADVANTAGE_TRANSFORMS["evidence_weighted"] is evidence_weighted_advantages
    assert ADVANTAGE_TRANSFORMS["token_variance"] is token_weighted_advantages
    n, t, v = 6, 5, 7
    groups = [0, 0, 0, 1, 1, 1]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.4])
    adv = group_advantages(rewards, groups)
    mask = torch.ones(n, t)
    mask[1, 3:] = 0
    logits = torch.randn(n, t, v)
    tokens = torch.randint(0, v, (n, t))
    logp = logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    ev = ADVANTAGE_TRANSFORMS["evidence_weighted"](adv, torch.rand(n), floor=0.1)
    tw = ADVANTAGE_TRANSFORMS["token_variance"](ev, logits.log_softmax(-1), mask, groups)
    assert ev.shape == (n,) and tw.shape == (n, t)
    for a in (ev, tw):
        new = logp.clone().requires_grad_(True)
        out = policy_loss(new, logp.detach(), a, mask)
        assert out.loss.dim() == 0 and torch.isfinite(out.loss)
        out.loss.backward()
        assert new.grad.shape == (n, t)
        assert torch.all(new.grad[mask == 0] == 0)


def test_token_weights_scale_the_policy_gradient():
    # with ratio 1 the per-token gradient of the grpo loss is -A * w / (tokens of the sample): check the w
    n, t = 4, 3
    logp = torch.randn(n, t)
    mask = torch.ones(n, t)
    adv = torch.tensor([1.0, -1.0, 2.0, -2.0])
    stats = torch.randn(n, t)
    weighted = token_weighted_advantages(adv, stats, mask, [0, 0, 1, 1])
    new = logp.clone().requires_grad_(True)
    policy_loss(new, logp, weighted, mask, aggregation="grpo").loss.backward()
    w = token_variance_weights(stats, mask, [0, 0, 1, 1])
    assert torch.allclose(new.grad, -(adv.unsqueeze(1) * w) / (t * n), atol=1e-6)
