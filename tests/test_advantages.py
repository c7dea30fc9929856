"""Group-relative advantages against values derived by hand / with plain Python from REFERENCE.md section 4."""

import math
import statistics

import pytest
import torch

from mmrl.core.advantages import (
    PerPromptStatTracker,
    combine_rewards,
    gaussian_rank_advantages,
    group_advantages,
)


def _reference(rewards, groups, *, ddof, eps, scale="group"):
    """Plain-Python group normalisation, written from the formula."""
    out = []
    finite_all = [r for r in rewards if not math.isnan(r)]
    batch_std = (statistics.stdev(finite_all) if ddof else statistics.pstdev(finite_all))
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g and not math.isnan(x)]
        if math.isnan(r) or len(members) <= ddof:
            out.append(0.0)
            continue
        mean = sum(members) / len(members)
        std = statistics.stdev(members) if ddof else statistics.pstdev(members)
        if std == 0:
            out.append(0.0)
        elif scale == "group":
            out.append((r - mean) / (std + eps))
        elif scale == "batch":
            out.append((r - mean) / (batch_std + eps))
        else:
            out.append(r - mean)
    return torch.tensor(out)


REWARDS = [1.0, 2.0, 4.0, 7.0, 0.5, 0.5, 3.0, -1.0]
GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("ddof,eps", [(1, 1e-4), (0, 1e-4), (1, 1e-6)])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_formula(ddof, eps, scale):
    got = group_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS), scale=scale, eps=eps, std_ddof=ddof)
    want = _reference(REWARDS, GROUPS, ddof=ddof, eps=eps, scale=scale)
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


def test_hand_computed_trl_group():
    # group [1, 2, 4, 7]: mean 3.5, unbiased std sqrt(((2.5^2)+(1.5^2)+(0.5^2)+(3.5^2))/3) = sqrt(7)
    got = group_advantages(torch.tensor([1.0, 2.0, 4.0, 7.0]), [0, 0, 0, 0], eps=1e-4, std_ddof=1)
    s = math.sqrt(7.0) + 1e-4
    torch.testing.assert_close(got, torch.tensor([-2.5 / s, -1.5 / s, 0.5 / s, 3.5 / s]))


def test_zero_std_group_is_exactly_zero():
    got = group_advantages(torch.tensor([0.1, 0.1, 0.1, 3.0, 1.0]), ["a", "a", "a", "b", "b"])
    assert torch.equal(got[:3], torch.zeros(3))
    assert got[3] > 0 > got[4]


def test_equal_rewards_give_exactly_zero_whatever_the_rounding_of_their_mean():
    """Seven fp32 0.1s have a mean that is not 0.1 in fp32: the spread test is max == min, not std == 0."""
    for ddof in (0, 1):
        for scale in ("group", "batch", "none"):
            got = group_advantages(torch.tensor([0.1] * 7 + [0.3, 0.7]), [0] * 7 + [1, 1], std_ddof=ddof,
                                   scale=scale)
            assert torch.equal(got[:7], torch.zeros(7)), (ddof, scale, got)
            assert got[7] < 0 < got[8]


def test_statistics_in_float64_as_the_flow_anchors_numpy_tracker():
    """Flow-GRPO's tracker computes ``(R - mean) / (std + 1e-4)`` on ``np.float64`` rewards; float32 statistics of
    rewards near 22 spread by 1e-5 are off by ~1e-3 in ``A``. Float32 rewards in, float32 advantages out."""
    import numpy as np

    g = torch.Generator().manual_seed(0)
    rewards = (22.0 + 1e-5 * torch.randn(64, generator=g)).float()
    groups = [k // 8 for k in range(64)]
    r = rewards.double().numpy()
    want = np.zeros(64)
    for k in range(8):
        block = r[8 * k:8 * k + 8]
        want[8 * k:8 * k + 8] = (block - block.mean()) / (block.std() + 1e-4)
    got = group_advantages(rewards, groups, std_ddof=0, eps=1e-4)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
    both = combine_rewards({"a": rewards, "b": torch.zeros(64)}, groups, std_ddof=0, eps=1e-4)
    assert both.dtype == torch.float32
    np.testing.assert_allclose(both.numpy(), want, rtol=1e-6, atol=1e-6)


def test_batch_normalised_sum_leaves_unjudged_samples_out():
    """GDPO's batch step over the samples at least one reward judged; a sample every reward left NaN gets 0 and
    does not move the others (TRL's normalize_then_sum does the same)."""
    nan = float("nan")
    a = torch.tensor([1.0, 2.0, nan, 3.0, 0.0, 1.0])
    b = torch.tensor([0.0, 1.0, nan, 1.0, 0.0, nan])
    groups = [0, 0, 0, 1, 1, 1]
    got = combine_rewards({"a": a, "b": b}, groups, mode="normalize_then_sum", batch_normalize=True, std_ddof=1)
    summed = (group_advantages(a, groups, std_ddof=1) + group_advantages(b, groups, std_ddof=1))
    kept = summed[[0, 1, 3, 4, 5]]
    want = (kept - kept.mean()) / (kept.std() + 1e-4)
    assert got[2].item() == 0.0
    torch.testing.assert_close(got[[0, 1, 3, 4, 5]], want)


def test_nan_rewards_excluded_and_zero():
    rewards = torch.tensor([1.0, float("nan"), 3.0, 5.0])
    got = group_advantages(rewards, [0, 0, 0, 0], std_ddof=0, eps=0.0)
    # statistics over [1, 3, 5]: mean 3, biased std sqrt(8/3)
    s = math.sqrt(8.0 / 3.0)
    torch.testing.assert_close(got, torch.tensor([-2.0 / s, 0.0, 0.0, 2.0 / s]))
    assert got[1].item() == 0.0


def test_dense_rewards_normalise_each_column_within_group():
    rewards = torch.tensor([[1.0, 10.0], [3.0, 10.0], [0.0, 2.0], [4.0, 6.0]])
    got = group_advantages(rewards, [0, 0, 1, 1], std_ddof=0, eps=0.0)
    want = torch.tensor([[-1.0, 0.0], [1.0, 0.0], [-1.0, -1.0], [1.0, 1.0]])
    torch.testing.assert_close(got, want)


def test_clamp_and_string_group_labels():
    rewards = torch.tensor([0.0] * 9 + [100.0])
    got = group_advantages(rewards, ["p"] * 10, std_ddof=0, clamp=2.0)
    assert got.max().item() == 2.0
    assert got[0].item() == pytest.approx(-1.0 / 3.0, rel=1e-3)  # (0 - 10) / 30


def test_combine_modes_differ_and_match_formula():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    b = torch.tensor([10.0, 0.0, 10.0, 0.0])
    groups = [0, 0, 0, 0]
    w = {"a": 1.0, "b": 0.5}
    sum_first = combine_rewards({"a": a, "b": b}, groups, weights=w, mode="sum_then_normalize", std_ddof=0, eps=0.0)
    torch.testing.assert_close(sum_first, group_advantages(a + 0.5 * b, groups, std_ddof=0, eps=0.0))
    norm_first = combine_rewards({"a": a, "b": b}, groups, weights=w, mode="normalize_then_sum", std_ddof=0, eps=0.0)
    want = group_advantages(a, groups, std_ddof=0, eps=0.0) + 0.5 * group_advantages(b, groups, std_ddof=0, eps=0.0)
    torch.testing.assert_close(norm_first, want)
    assert not torch.allclose(sum_first, norm_first)
    with pytest.raises(ValueError, match="unknown reward components"):
        combine_rewards({"a": a}, groups, weights={"c": 1.0})


def test_clamp_sum_is_mixgrpos_clamp_of_the_summed_advantage():
    """MixGRPO's train_grpo_flux.py: each reward normalised per group ((r - mean) / (std + 1e-8), unbiased std),
    summed with its weight, the sum clamped to +-adv_clip_max (5); DanceGRPO's video script clamps each reward."""
    one = torch.tensor([1.0] + [0.0] * 11)  # one sample right on all three rewards, a group of 12
    rewards = {"hps": one, "imagereward": one.clone(), "pickscore": one.clone()}
    kw = dict(mode="normalize_then_sum", scale="group", std_ddof=1, eps=1e-8, clamp=5.0)
    per_reward = 11 / 12 / statistics.stdev([1.0] + [0.0] * 11)  # (1 - 1/12) / std = 3.175
    each = combine_rewards(rewards, [0] * 12, **kw)  # each component clamped at 5: nothing to clamp
    assert each[0].item() == pytest.approx(3 * per_reward, rel=1e-6) and each[0].item() > 9.5
    summed = combine_rewards(rewards, [0] * 12, clamp_sum=True, **kw)
    assert summed[0].item() == 5.0  # the official advantage of that sample
    assert summed[1:].tolist() == pytest.approx(each[1:].tolist())  # -0.866 in both
    with pytest.raises(ValueError, match="clamp_sum clamps the sum of normalize_then_sum"):
        combine_rewards(rewards, [0] * 12, clamp_sum=True, mode="sum_then_normalize")


def test_gaussian_rank_advantages():
    from statistics import NormalDist

    rewards = torch.tensor([5.0, 1.0, 3.0, 3.0, 9.0, 9.0, 9.0, 9.0])
    got = gaussian_rank_advantages(rewards, [0, 0, 0, 0, 1, 1, 1, 1])
    # group 0 ranks: 1.0 -> 1, 3.0 -> 2.5 (tie of ranks 2,3), 5.0 -> 4; u = (r - 0.5) / 4
    q = NormalDist().inv_cdf
    want = torch.tensor([q(3.5 / 4), q(0.5 / 4), q(2.0 / 4), q(2.0 / 4), 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    clamped = gaussian_rank_advantages(rewards, [0, 0, 0, 0, 1, 1, 1, 1], clamp=1.0)
    torch.testing.assert_close(clamped, want.clamp(-1.0, 1.0), atol=1e-6, rtol=1e-6)


def test_g2rpo_variant_applies_the_configured_clamp_and_eps():
    # algorithm.advantage_clamp and clamp_summed_advantage were ignored by g2rpo (|A| 1.53 at clamp 1, group of 8)
    from types import SimpleNamespace

    from mmrl.algorithms.base import AdvantageContext, VariantError, parse_spec

    rewards = torch.arange(8.0)
    variant = parse_spec("g2rpo", 0)

    def run(**algorithm):
        a = dict(reward_combination="sum_then_normalize", batch_normalize_sum=False, clamp_summed_advantage=False,
                 eps=1e-4, advantage_clamp=None)
        a.update(algorithm)
        ctx = AdvantageContext(components={"r": rewards}, weights={"r": 1.0}, labels=[0] * 8, group_ids=torch.zeros(8),
                               keys=["p"] * 8, algorithm=SimpleNamespace(**a), update=0, default=lambda: None)
        return variant.advantages(ctx)

    free = run()
    assert free.abs().max() > 1.5
    torch.testing.assert_close(run(advantage_clamp=1.0), free.clamp(-1.0, 1.0))
    # GDPO's batch step: (A - mean) / (std + eps) with the configured eps
    gdpo = dict(reward_combination="normalize_then_sum", batch_normalize_sum=True)
    a1, a2 = run(**gdpo, eps=1e-4), run(**gdpo, eps=1.0)
    torch.testing.assert_close(a2, (free - free.mean()) / (free.std() + 1.0))
    assert not torch.allclose(a1, a2)
    with pytest.raises(VariantError, match="scale: none"):
        variant.check(SimpleNamespace(algorithm=SimpleNamespace(scale="none")))


def test_tracker_matches_flow_grpo_and_keeps_state():
    prompts = ["a", "b", "a", "c", "b", "a"]
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    tracker = PerPromptStatTracker(std_ddof=0, eps=1e-4)
    got = tracker.update(prompts, rewards)
    # Flow-GRPO: per prompt (r - mean) / (pstd + 1e-4); 'a' = [1, 3, 6], 'b' = [2, 5], 'c' = [4] (std 0 -> 0)
    sa = statistics.pstdev([1, 3, 6]) + 1e-4
    sb = statistics.pstdev([2, 5]) + 1e-4
    want = torch.tensor([(1 - 10 / 3) / sa, (2 - 3.5) / sb, (3 - 10 / 3) / sa, 0.0, (5 - 3.5) / sb, (6 - 10 / 3) / sa])
    torch.testing.assert_close(got, want)
    assert tracker.state_dict()["prompts_seen"] == ["a", "b", "c"]

    history = PerPromptStatTracker(keep_history=True)
    history.update(["x", "x"], torch.tensor([0.0, 2.0]))
    second = history.update(["x", "x"], torch.tensor([4.0, 6.0]))
    # history [0, 2, 4, 6]: mean 3, pstd sqrt(5)
    s = math.sqrt(5.0) + 1e-4
    torch.testing.assert_close(second, torch.tensor([1.0 / s, 3.0 / s]))
    restored = PerPromptStatTracker(keep_history=True)
    restored.load_state_dict(history.state_dict())
    assert restored.history == history.history


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(2), [0, 0], scale="global")
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.zeros(3), [0, 0])
    with pytest.raises(ValueError, match=r"\[N\] or \[N, T\]"):
        group_advantages(torch.zeros(2, 2, 2), [0, 0])


def test_nansum_then_normalize_is_trls_nansum():
    """TRL 1.16 (grpo_trainer.py): rewards = nansum(rewards_per_func * weights) over the reward functions (a None, a
    reward that does not apply, is NaN there), then the group mean and unbiased std, (r - mean) / (std + 1e-4). Two
    tasks in one batch, each reward NaN on the other's rows: sum_then_normalize leaves every row out (advantage 0);
    nansum scores each by the reward that applies, as TRL; a row every reward leaves NaN stays out (TRL sums it to 0)."""
    iou = torch.tensor([0.9, 0.1, float("nan"), float("nan"), 0.5, 0.2, float("nan"), float("nan")])
    acc = torch.tensor([float("nan"), float("nan"), 1.0, 0.0, float("nan"), float("nan"), 0.0, 1.0])
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    w = {"iou": 1.0, "acc": 2.0}
    kw = dict(scale="group", std_ddof=1, eps=1e-4, clamp=None)
    assert combine_rewards({"iou": iou, "acc": acc}, groups, weights=w, **kw).abs().sum() == 0
    got = combine_rewards({"iou": iou, "acc": acc}, groups, weights=w, mode="nansum_then_normalize", **kw)
    summed = [0.9, 0.1, 2.0, 0.0, 0.5, 0.2, 0.0, 2.0]  # TRL's nansum, written out
    want = []
    for g in range(2):
        part = summed[4 * g:4 * g + 4]
        mean, std = statistics.mean(part), statistics.stdev(part)
        want += [(r - mean) / (std + 1e-4) for r in part]
    assert got.tolist() == pytest.approx(want, rel=1e-6)
    none = combine_rewards({"iou": torch.tensor([float("nan"), 1.0, 0.0]), "acc": torch.tensor([float("nan")] * 3)},
                           [0, 0, 0], mode="nansum_then_normalize", **kw)
    assert none[0].item() == 0.0 and none[1:].tolist() == pytest.approx([1 / (2 ** 0.5 / 2 + 1e-4) / 2,
                                                                         -1 / (2 ** 0.5 / 2 + 1e-4) / 2], rel=1e-6)
