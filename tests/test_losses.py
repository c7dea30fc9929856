"""policy_loss against a per-element Python computation of REFERENCE.md section 5 (TRL's definitions)."""

import math

import pytest
import torch

from mmrl.core.losses import high_entropy_mask, k3_kl, policy_loss

N, T = 3, 4


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = (torch.randn(N, T, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    old = logps.detach() + torch.randn(N, T, generator=g, dtype=torch.float64) * 0.3
    ref = logps.detach() + torch.randn(N, T, generator=g, dtype=torch.float64) * 0.2
    adv = torch.tensor([1.5, -0.7, 0.3], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float64)
    return logps, old, ref, adv, mask


def _per_action(logps, old, ref, adv, eps_low, eps_high, beta, sequence_mask=None):
    """l[i][t] computed element by element from the formulas."""
    out = [[0.0] * T for _ in range(N)]
    for i in range(N):
        sequence = sequence_mask is not None
        seq_ratio = None
        if sequence:
            m = sequence_mask[i].tolist()
            seq_ratio = math.exp(sum(mi * (a - b) for mi, a, b in zip(m, logps[i].tolist(), old[i].tolist())) / sum(m))
        for t in range(T):
            r = seq_ratio if sequence else math.exp(logps[i, t].item() - old[i, t].item())
            a = adv[i].item()
            clipped = min(max(r, 1 - eps_low), 1 + eps_high)
            value = -min(r * a, clipped * a)
            d = ref[i, t].item() - logps[i, t].item()
            value += beta * (math.exp(d) - d - 1)
            out[i][t] = value
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("aggregation", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_aggregations_match_definitions(aggregation, beta):
    logps, old, ref, adv, mask = _inputs()
    l = _per_action(logps.detach(), old, ref, adv, 0.2, 0.28, beta)
    ga = 2
    if aggregation == "grpo":
        want = sum((l[i] * mask[i]).sum() / mask[i].sum() for i in range(N)) / N / ga
    elif aggregation == "bnpo":
        want = (l * mask).sum() / mask.sum() / ga
    elif aggregation == "dr_grpo":
        want = (l * mask).sum() / (N * 16) / ga
    else:  # 2 processes, 20 active tokens in the whole generation batch -> normaliser 10
        want = (l * mask).sum() / 10.0
    out = policy_loss(logps, old, adv, mask, clip_low=0.2, clip_high=0.28, aggregation=aggregation,
                      max_length=16, ref_logps=ref, beta=beta, gradient_accumulation_steps=ga,
                      num_items_in_batch=20, num_processes=2)
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-10, abs=1e-12)
    out.loss.backward()
    assert logps.grad is not None and torch.all(logps.grad[mask == 0] == 0)


def test_sequence_level_ratio_gspo():
    logps, old, ref, adv, mask = _inputs(1)
    l = _per_action(logps.detach(), old, ref, adv, 0.2, 0.2, 0.0, sequence_mask=mask)
    want = sum((l[i] * mask[i]).sum() / mask[i].sum() for i in range(N)) / N
    out = policy_loss(logps, old, adv, mask, ratio_level="sequence")
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-10)


def _gspo_token_reference(logps, old, adv, mask, clip):
    """GSPO-token written out as verl's compute_policy_loss_gspo (stop-gradient construction), aggregated as
    seq-mean-token-mean (mmrl's grpo): s_t = sg(s) * pi_t / sg(pi_t), l_t = max(-A_t s_t, -A_t clip(s_t))."""
    seq = ((logps - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    ratio = torch.exp(logps - logps.detach() + seq.detach().unsqueeze(-1))
    per = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip))
    return ((per * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def test_sequence_ratio_is_gspo_token_with_per_action_advantages():
    torch.manual_seed(3)
    old = -torch.rand(N, T, dtype=torch.float64) - 0.5
    mask = torch.ones(N, T, dtype=torch.float64)
    mask[1, 3] = 0
    adv = torch.randn(N, T, dtype=torch.float64)  # per-action advantages (dense credit)
    base = old + 0.05 * torch.randn(N, T, dtype=torch.float64)
    a = base.clone().requires_grad_(True)
    b = base.clone().requires_grad_(True)
    want = _gspo_token_reference(a, old, adv, mask, 0.2)
    got = policy_loss(b, old, adv, mask, clip_low=0.2, ratio_level="sequence").loss
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    want.backward()
    got.backward()
    assert torch.allclose(b.grad, a.grad, rtol=1e-12, atol=1e-14)
    # each action's gradient carries its own advantage: s * A_t / (|y| N) where unclipped
    seq = ((base - old) * mask).sum(-1) / mask.sum(-1)
    s = torch.exp(seq).unsqueeze(-1)
    inside = (s > 0.8) & (s < 1.2)
    expect = torch.where(inside, -adv * s / mask.sum(-1, keepdim=True) / N, torch.zeros_like(adv)) * mask
    assert torch.allclose(b.grad, expect, rtol=1e-10, atol=1e-14)
    assert b.grad[0].unique().numel() > 1  # not spread evenly over the sample, as exp(mean) would


def test_sequence_ratio_gradient_is_trl_exp_mean_with_sample_advantages():
    torch.manual_seed(4)
    old = -torch.rand(N, T, dtype=torch.float64) - 0.5
    mask = torch.ones(N, T, dtype=torch.float64)
    mask[2, 2:] = 0
    adv = torch.randn(N, dtype=torch.float64)
    base = old + 0.05 * torch.randn(N, T, dtype=torch.float64)
    for aggregation in ("grpo", "bnpo", "dr_grpo"):
        a = base.clone().requires_grad_(True)
        b = base.clone().requires_grad_(True)
        # TRL's sequence level: coef = exp(mean log-ratio) [N, 1], its gradient through every token
        coef = torch.exp((((a - old) * mask).sum(-1) / mask.sum(-1)).unsqueeze(-1))
        per = -torch.min(coef * adv[:, None], torch.clamp(coef, 0.8, 1.2) * adv[:, None])
        if aggregation == "grpo":
            want = ((per * mask).sum(-1) / mask.sum(-1)).mean()
        elif aggregation == "bnpo":
            want = (per * mask).sum() / mask.sum()
        else:
            want = (per * mask).sum() / (N * T)
        got = policy_loss(b, old, adv, mask, clip_low=0.2, ratio_level="sequence", aggregation=aggregation).loss
        assert got.item() == pytest.approx(want.item(), rel=1e-12)
        want.backward()
        got.backward()
        assert torch.allclose(b.grad, a.grad, rtol=1e-10, atol=1e-15), aggregation


def test_sequence_ratio_action_weight_zero_trains_nothing_there():
    torch.manual_seed(5)
    old = -torch.rand(N, T, dtype=torch.float64) - 0.5
    mask = torch.ones(N, T, dtype=torch.float64)
    adv = torch.randn(N, dtype=torch.float64)
    weight = torch.ones(N, T, dtype=torch.float64)
    weight[:, ::2] = 0  # an entropy mask keeping every other token
    logps = (old + 0.05 * torch.randn(N, T, dtype=torch.float64)).requires_grad_(True)
    policy_loss(logps, old, adv, mask, clip_low=0.2, ratio_level="sequence", action_weight=weight).loss.backward()
    assert torch.all(logps.grad[:, ::2] == 0)
    assert torch.all(logps.grad[:, 1::2] != 0)


def test_ratio_one_and_zero_kl_at_start():
    logps, _, _, adv, mask = _inputs()
    out = policy_loss(logps, logps.detach().clone(), adv, mask, ref_logps=logps.detach().clone(), beta=0.1)
    assert out.metrics["ratio/mean"].item() == 1.0
    assert out.metrics["ratio/min"].item() == 1.0 and out.metrics["ratio/max"].item() == 1.0
    assert out.metrics["kl"].item() == 0.0
    assert out.metrics["clipfrac"].item() == 0.0


def test_clip_metrics_count_the_clipped_region():
    logps = torch.zeros(2, 2, dtype=torch.float64)
    old = torch.tensor([[0.0, -0.5], [0.5, 0.0]], dtype=torch.float64)  # ratios e^0.5 > 1.2 and e^-0.5 < 0.8
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    out = policy_loss(logps, old, adv, clip_low=0.2)
    assert out.metrics["clip_ratio/high"].item() == 0.25  # ratio > 1.2 with A > 0
    assert out.metrics["clip_ratio/low"].item() == 0.25  # ratio < 0.8 with A < 0
    assert out.metrics["clipfrac"].item() == 0.5 and out.metrics["clip_ratio/region"].item() == 0.5
    # a ratio outside the range on the side its advantage does not clip: in Flow-GRPO's clipfrac (|r - 1| > eps),
    # not in TRL's region (its gradient is not cut)
    out = policy_loss(logps, old, -adv, clip_low=0.2)
    assert out.metrics["clip_ratio/region"].item() == 0.0 and out.metrics["clipfrac"].item() == 0.5


def test_dense_advantages_and_explicit_kl():
    logps, old, _, _, mask = _inputs()
    adv = torch.randn(N, T, dtype=torch.float64)
    kl = torch.rand(N, T, dtype=torch.float64)
    base = policy_loss(logps, old, adv, mask, aggregation="bnpo")
    with_kl = policy_loss(logps, old, adv, mask, aggregation="bnpo", kl=kl, beta=0.5)
    assert with_kl.loss.item() == pytest.approx(base.loss.item() + 0.5 * ((kl * mask).sum() / mask.sum()).item())


def test_kl_estimators_against_verl_and_easyr1_written_out():
    from mmrl.core.losses import kl_estimate

    # verl kl_penalty_forward / EasyR1 compute_kl, written out: low_var_kl clamps ref - logp to [-20, 20], the
    # estimate to [-10, 10]; kl = logp - ref, mse = (logp - ref)^2 / 2, abs = |logp - ref|
    logp = torch.tensor([-5.0, -1.0, -1.0, -3.5, -0.2], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.0, -30.0, -1.2, -1.0, -0.2], dtype=torch.float64)
    d = (ref - logp.detach()).clamp(-20, 20)
    expected = {
        "low_var_kl": (d.exp() - d - 1).clamp(-10, 10),
        "k3": (ref - logp.detach()).exp() - (ref - logp.detach()) - 1,
        "k1": logp.detach() - ref, "k2": 0.5 * (logp.detach() - ref) ** 2, "abs": (logp.detach() - ref).abs(),
    }
    for name, want in expected.items():
        torch.testing.assert_close(kl_estimate(logp, ref, name), want)
    assert kl_estimate(logp, ref, "low_var_kl")[:2].tolist() == [10.0, 10.0]  # clamped where k3 reads 49.6 / 28
    grad, = torch.autograd.grad(kl_estimate(logp, ref, "low_var_kl").sum(), logp)
    # no gradient past the clamps; elsewhere k3's d/dlogp = 1 - exp(ref - logp)
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, 1 - math.exp(-0.2), 1 - math.exp(2.5), 0.0],
                                                  dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(logp, ref, "k4")


def test_k3_is_nonnegative_and_zero_at_equality():
    a = torch.randn(100, dtype=torch.float64)
    b = torch.randn(100, dtype=torch.float64)
    assert torch.all(k3_kl(a, b) >= 0)
    assert torch.all(k3_kl(a, a) == 0)


def test_bad_arguments():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(x, x, torch.zeros(2), aggregation="mean")
    with pytest.raises(ValueError, match=r"\[N, T\]"):
        policy_loss(x, torch.zeros(2, 4), torch.zeros(2))
    with pytest.raises(ValueError, match="mask shape"):
        policy_loss(x, x, torch.zeros(2), torch.ones(3, 2))




@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("aggregation", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_chunks_add_up_to_the_whole_loss_and_gradient(aggregation, ratio_level):
    """timestep_chunk is a memory knob: chunk losses (and their gradients) sum to the unchunked ones, for uneven
    chunks (4 + 4 + 1) and ragged masks; the sequence ratio spans the whole trajectory, clipping included."""
    g = torch.Generator().manual_seed(3)
    n, t = 5, 9
    logps = (torch.randn(n, t, generator=g) * 0.3).requires_grad_(True)
    old = logps.detach() + torch.randn(n, t, generator=g) * 0.2
    ref = logps.detach() + torch.randn(n, t, generator=g) * 0.1
    adv = torch.randn(n, generator=g)
    mask = (torch.arange(t)[None, :] < torch.tensor([9, 7, 3, 5, 1])[:, None]).float()
    kwargs = dict(aggregation=aggregation, ratio_level=ratio_level, clip_low=0.1, beta=0.05)
    whole = policy_loss(logps, old, adv, mask, ref_logps=ref, max_length=t, **kwargs).loss
    (g_whole,) = torch.autograd.grad(whole, logps)
    chunks = [torch.arange(0, 4), torch.arange(4, 8), torch.arange(8, 9)]
    total = 0.0
    counts = mask.sum(-1)
    seq = (((logps - old) * mask).sum(-1) / counts).detach() if ratio_level == "sequence" else None
    for cols in chunks:
        total = total + policy_loss(logps[:, cols], old[:, cols], adv, mask[:, cols], ref_logps=ref[:, cols],
                                    sample_action_counts=counts, batch_action_count=mask.sum(), max_length=t,
                                    num_items_in_batch=mask.sum(), sequence_log_ratio=seq, **kwargs).loss
    (g_chunks,) = torch.autograd.grad(total, logps)
    assert torch.allclose(total, whole, rtol=1e-6, atol=1e-7)
    assert torch.allclose(g_chunks, g_whole, rtol=1e-5, atol=1e-8)
    assert g_whole.abs().sum() > 0
    # without the whole-trajectory counts the chunks weight the lone last step 4x (the old behaviour)
    naive = sum(policy_loss(logps[:, c], old[:, c], adv, mask[:, c], ref_logps=ref[:, c], max_length=t,
                            **kwargs).loss for c in chunks)
    if aggregation in ("grpo",) or ratio_level == "sequence":
        assert not torch.allclose(naive, whole, rtol=1e-4)


def test_dr_grpo_divides_by_the_configured_maximum_length():
    """Dr. GRPO / TRL: sum(l M) / (N * max_completion_length), whatever this batch's longest completion is."""
    logps = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss = policy_loss(logps, logps, adv, mask, aggregation="dr_grpo", max_length=16).loss
    # ratio 1: l = -A per action; sum = -(2 * 1) - (1 * -0.5) = -1.5; / (2 * 16)
    assert loss.item() == pytest.approx(-1.5 / 32)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_kl_ratio_weight_is_trl_bias_corrected_kl(ratio_level):
    """``kl_ratio_weight`` = TRL 1.16's ``use_bias_correction_kl``: ``beta * k3 * ratio`` per action, the ratio's
    gradient kept, so even on-policy (ratio 1) the gradient differs from the plain KL's by ``beta * k3 * dlogp``."""
    logps, old, ref, adv, mask = _inputs()
    beta = 0.1
    for on_policy in (True, False):
        base = logps.detach() if on_policy else old
        lp = logps.detach().clone().requires_grad_(True)
        out = policy_loss(lp, base, adv, mask, clip_low=0.2, aggregation="bnpo", ref_logps=ref, beta=beta,
                          ratio_level=ratio_level, kl_ratio_weight=True)
        out.loss.backward()
        # independent: the per-action surrogate plus beta * k3 * ratio, the ratio built from the same log-probs
        lp2 = logps.detach().clone().requires_grad_(True)
        log_ratio = lp2 - base
        if ratio_level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))
        ratio = torch.exp(log_ratio)
        a = adv.unsqueeze(1)
        d = ref - lp2
        per = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a) + beta * (torch.exp(d) - d - 1) * ratio
        want = (per * mask).sum() / mask.sum()
        want.backward()
        assert out.loss.item() == pytest.approx(want.item(), rel=1e-12)
        torch.testing.assert_close(lp.grad, lp2.grad, rtol=1e-10, atol=1e-12)
        plain = logps.detach().clone().requires_grad_(True)
        policy_loss(plain, base, adv, mask, clip_low=0.2, aggregation="bnpo", ref_logps=ref, beta=beta,
                    ratio_level=ratio_level).loss.backward()
        assert (plain.grad - lp.grad).abs().max() > 1e-4  # the correction changes the gradient, on-policy too
    with pytest.raises(ValueError, match="chunked sequence ratio"):
        policy_loss(logps, old, adv, mask, ref_logps=ref, beta=beta, ratio_level="sequence", kl_ratio_weight=True,
                    sequence_log_ratio=torch.zeros(N, dtype=torch.float64))


def test_dapo_clamps_the_global_count_before_dividing_by_processes():
    """TRL: ``num_items_in_batch.clamp(min=1) / num_processes``: one active token over 4 processes divides by 1/4."""
    logps, old, _, adv, mask = _inputs()
    one = torch.zeros_like(mask)
    one[0, 0] = 1.0
    l = _per_action(logps.detach(), old, old, adv, 0.2, 0.2, 0.0)
    out = policy_loss(logps, old, adv, one, clip_low=0.2, aggregation="dapo", num_items_in_batch=1, num_processes=4)
    assert out.loss.item() == pytest.approx(l[0, 0].item() * 4, rel=1e-12)


def test_delta_two_sided_clipping_is_trls():
    """``delta`` = TRL's two-sided clipping (INTELLECT-2): ``coef_2 = clamp(r, 1-eps_low, 1+eps_high)``, then
    ``coef_1 = clamp(r, max=delta)``, ``l = -min(coef_1 A, coef_2 A)``; value and gradient against that formula, on
    log-ratios wide enough that some ratios pass delta."""
    g = torch.Generator().manual_seed(3)
    old = torch.randn(6, 5, generator=g, dtype=torch.float64)
    logps = (old + 1.2 * torch.randn(6, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.3], dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=g) > 0.2).to(torch.float64)
    delta = 2.0
    assert ((logps.detach() - old).exp() > delta).any()  # the cap is reached
    out = policy_loss(logps, old, adv, mask, clip_low=0.2, clip_high=0.28, aggregation="bnpo", delta=delta)
    out.loss.backward()
    ref = logps.detach().clone().requires_grad_(True)
    coef_1 = torch.exp(ref - old)
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
    coef_1 = torch.clamp(coef_1, max=delta)
    per = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    want = (per * mask).sum() / mask.sum()
    want.backward()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-12)
    torch.testing.assert_close(logps.grad, ref.grad, rtol=1e-10, atol=1e-12)
    plain = logps.detach().clone().requires_grad_(True)
    without = policy_loss(plain, old, adv, mask, clip_low=0.2, clip_high=0.28, aggregation="bnpo")
    without.loss.backward()
    capped = ((logps.detach() - old).exp() > delta) & (adv[:, None] < 0) & (mask > 0)
    assert capped.any() and without.loss.item() > out.loss.item()  # the capped negative-advantage terms shrink
    assert torch.all(logps.grad[capped] == 0) and torch.all(plain.grad[capped] != 0)
    torch.testing.assert_close(logps.grad[~capped], plain.grad[~capped], rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="replaces that surrogate"):
        policy_loss(logps, old, adv, mask, delta=delta, surrogate=lambda *a: a[0])


def test_delta_config_is_checked():
    from fixtures import TINY_RECIPE

    from mmrl.algorithms.base import VariantError
    from mmrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"algorithm.delta .* must be > 1 \+ clip_high"):
        load_config(TINY_RECIPE, ["algorithm.clip_low=0.2", "algorithm.delta=1.1"])
    assert load_config(TINY_RECIPE, ["algorithm.clip_low=0.2", "algorithm.delta=4"]).algorithm.delta == 4.0
    with pytest.raises((ConfigError, VariantError), match="replaces the surrogate"):
        load_config(TINY_RECIPE, ["algorithm.clip_low=0.2", "algorithm.delta=4", "algorithm.variants=[gvpo]"])


# ------------------------------------------------------------ the rollout engine's importance correction (TRL)


def test_sampler_importance_weights_follow_trls_modes():
    """TRL 1.16 vllm_importance_sampling_correction: r = exp(old - sampler) on the real tokens (NaN: no gap), per
    token or summed per sequence, clamped (*_truncate) or zeroed outside [C_min, C_max] (*_mask)."""
    import math

    from mmrl.core.losses import sampler_importance_weights

    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-2.5, -2.0, -0.7], [-0.9, float("nan"), -5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the last action of row 1 is padding
    # token gaps: row 0: 1.5, 0, 0.2; row 1: -0.1, NaN -> 0, padding -> 0
    token = torch.tensor([[math.exp(1.5), 1.0, math.exp(0.2)], [math.exp(-0.1), 1.0, 1.0]])
    w = sampler_importance_weights(old, sampler, mask, mode="token_truncate", clip_max=3.0)
    assert torch.allclose(w, token.clamp(max=3.0))  # e^1.5 = 4.48 -> 3
    w = sampler_importance_weights(old, sampler, mask, mode="token_mask", clip_min=0.95, clip_max=3.0)
    assert torch.allclose(w, torch.tensor([[0.0, 1.0, math.exp(0.2)], [0.0, 1.0, 1.0]]))  # e^-0.1 = 0.905 < 0.95
    # sequence: row 0 sums to 1.7 (e^1.7 = 5.47), row 1 to -0.1
    w = sampler_importance_weights(old, sampler, mask, mode="sequence_truncate", clip_max=3.0)
    assert torch.allclose(w, torch.tensor([[3.0] * 3, [math.exp(-0.1)] * 3]))
    w = sampler_importance_weights(old, sampler, mask, mode="sequence_mask", clip_max=3.0)
    assert torch.allclose(w, torch.tensor([[0.0] * 3, [math.exp(-0.1)] * 3]))
    w = sampler_importance_weights(old, sampler, mask, mode="sequence_mask", clip_max=None)  # no upper bound
    assert torch.allclose(w[0], torch.full((3,), math.exp(1.7)))
    with pytest.raises(ValueError, match="unknown sampler correction"):
        sampler_importance_weights(old, sampler, mask, mode="none")


def test_action_weight_scales_the_policy_term_not_the_kl():
    torch.manual_seed(0)
    logps = torch.randn(3, 4, requires_grad=True)
    old, ref = logps.detach() + 0.05 * torch.randn(3, 4), logps.detach() + 0.1 * torch.randn(3, 4)
    adv, mask = torch.tensor([1.0, -0.5, 2.0]), torch.ones(3, 4)
    weight = torch.tensor([[2.0], [0.0], [0.5]]).expand(3, 4)
    out = policy_loss(logps, old, adv, mask, ref_logps=ref, beta=0.1, aggregation="dapo", action_weight=weight)
    ratio = torch.exp(logps - old)
    surrogate = -torch.min(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
    expected = ((surrogate * weight + 0.1 * k3_kl(logps, ref)) * mask).sum() / mask.sum()
    assert torch.allclose(out.loss, expected)
    (grad,) = torch.autograd.grad(out.loss, logps)
    (want,) = torch.autograd.grad(expected, logps)
    assert torch.allclose(grad, want)


def test_high_entropy_mask_keeps_the_top_quantile_of_real_tokens_as_trl():
    """TRL's get_high_entropy_mask on hand values: the threshold is torch.quantile (linear interpolation) at 1 - rho
    of the real tokens' entropies, a token is kept when its entropy reaches it, padding never (its 9.0 neither counts
    in the quantile nor is kept)."""
    entropies = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # sorted real values 0.1 0.3 0.5 0.7 0.9: the 0.6 quantile sits at 2.4 -> 0.5 + 0.4 x 0.2 = 0.58
    keep, threshold = high_entropy_mask(entropies, mask, 0.4)
    assert threshold == pytest.approx(0.58)
    assert keep.tolist() == [[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
    keep, threshold = high_entropy_mask(entropies, mask, 1.0)  # everything real
    assert threshold == pytest.approx(0.1) and torch.equal(keep, mask)
    keep, _ = high_entropy_mask(entropies, mask, 0.0)  # only the highest real entropy
    assert keep.tolist() == [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
    # a pool from every process sets the threshold instead: 0.825 between 0.8 and 0.85
    keep, threshold = high_entropy_mask(entropies, mask, 0.5, pool=torch.tensor([0.8, 0.85]))
    assert threshold == pytest.approx(0.825) and keep.tolist() == [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
    keep, threshold = high_entropy_mask(entropies, torch.zeros_like(mask), 0.2)
    assert math.isnan(threshold) and keep.sum() == 0
    with pytest.raises(ValueError, match=r"top_quantile must be in \[0, 1\]"):
        high_entropy_mask(entropies, mask, 1.5)
