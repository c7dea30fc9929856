"""Tests for mmrl.pipelines.flow.sde against the REFERENCE formulas written out in float64 numpy."""
import math

import numpy as np
import pytest
import torch

from mmrl.core.kl import flow_kl
from mmrl.pipelines.flow.sde import SDE_KINDS, SDEStepOutput, sde_step

TOL = 1e-5
SHAPE = (2, 3, 4, 4)


def _inputs(seed=0, shape=SHAPE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    eps = torch.randn(shape, generator=g)
    return x, v, eps


# ---------------------------------------------------------------- reference formulas (float64)
def _ref_step(kind, x, v, eps, sigma, sigma_next, a, sub=None):
    """Returns (mean, std, noise_scale, x', logp[B] or None) in float64 numpy for scalar sigmas."""
    x, v, eps = (np.asarray(t, dtype=np.float64) for t in (x, v, eps))
    dt = sigma_next - sigma
    if kind == "flow_grpo":
        denom = 1.0 - (sub if sigma == 1.0 else sigma)
        sigma_t = a * math.sqrt(sigma / denom)
        mean = x * (1 + sigma_t**2 * dt / (2 * sigma)) + v * (1 + sigma_t**2 * (1 - sigma) / (2 * sigma)) * dt
        std = sigma_t * math.sqrt(-dt)
        scale = sigma_t
    elif kind == "dance":
        mean = x + dt * (v + a**2 * (x + (1 - sigma) * v) / (2 * sigma))
        std = a * math.sqrt(sigma - sigma_next)
        scale = a
    elif kind == "cps":
        s = sigma_next * math.sin(a * math.pi / 2)
        x0 = x - sigma * v
        x1 = x + (1 - sigma) * v
        mean = (1 - sigma_next) * x0 + math.sqrt(sigma_next**2 - s**2) * x1
        std = s
        scale = s
    elif kind == "ode":
        mean = x + dt * v
        return mean, 0.0, 0.0, mean, None
    xp = mean + std * eps
    axes = tuple(range(1, x.ndim))
    if kind == "cps":
        logp = (-((xp - mean) ** 2)).mean(axis=axes)
    else:
        logp = (-((xp - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))).mean(axis=axes)
    return mean, std, scale, xp, logp


def _np(t):
    return t.detach().double().numpy()


@pytest.mark.parametrize(
    "kind,a,sigma,sigma_next",
    [
        ("flow_grpo", 0.7, 0.8, 0.6),
        ("flow_grpo", 0.5, 0.3, 0.0),
        ("dance", 0.3, 0.8, 0.6),
        ("dance", 0.7, 0.25, 0.0),
        ("cps", 0.8, 0.8, 0.6),
        ("cps", 0.5, 0.4, 0.1),
        ("ode", 0.7, 0.8, 0.6),
    ],
)
def test_matches_reference_formula(kind, a, sigma, sigma_next):
    x, v, eps = _inputs()
    out = sde_step(x, v, sigma, sigma_next, kind=kind, noise_level=a, noise=None if kind == "ode" else eps)
    assert isinstance(out, SDEStepOutput)
    mean, std, scale, xp, logp = _ref_step(kind, x, v, eps, sigma, sigma_next, a)
    np.testing.assert_allclose(_np(out.mean), mean, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(_np(out.prev_sample), xp, atol=TOL, rtol=TOL)
    assert out.std.shape == (SHAPE[0], 1, 1, 1) and out.noise_scale.shape == (SHAPE[0], 1, 1, 1)
    np.testing.assert_allclose(_np(out.std).ravel(), [std] * SHAPE[0], atol=TOL, rtol=TOL)
    np.testing.assert_allclose(_np(out.noise_scale).ravel(), [scale] * SHAPE[0], atol=TOL, rtol=TOL)
    if kind == "ode":
        assert out.log_prob is None
    else:
        assert out.log_prob.shape == (SHAPE[0],) and out.log_prob.dtype == torch.float32
        np.testing.assert_allclose(_np(out.log_prob), logp, atol=TOL, rtol=TOL)


def test_cps_noise_is_flow_grpos_fp32_step_with_a_float64_sine():
    """Flow-GRPO's cps branch: ``std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)`` (a python float, its
    sine in float64) on fp32 sigmas, and ``prev_sample_mean = pred_original_sample * (1 - sigma_prev) + noise_pred *
    sqrt(sigma_prev**2 - std_dev_t**2)`` in fp32. Written out here in those dtypes, bit for bit: the sine taken in
    fp32 instead moved the mean by 1.4e-5 at noise level 1.023 (sqrt(sigma'^2 - s^2) amplifies it near 1)."""
    x, v, eps = _inputs()
    for a, sigma, sigma_next in ((0.8, 0.8, 0.6), (1.0230413675308228, 0.7111, 0.5646), (0.5, 0.4, 0.1)):
        out = sde_step(x, v, sigma, sigma_next, kind="cps", noise_level=a, noise=eps)
        s, s_next = torch.tensor(sigma, dtype=torch.float32), torch.tensor(sigma_next, dtype=torch.float32)
        std = s_next * math.sin(a * math.pi / 2)
        x0, x1 = x - s * v, x + (1 - s) * v
        mean = x0 * (1 - s_next) + x1 * torch.sqrt(s_next**2 - std**2)
        assert torch.equal(out.std.ravel(), std.expand(SHAPE[0]))
        torch.testing.assert_close(out.mean, mean, atol=1e-7, rtol=0)


def test_default_noise_levels_follow_anchors():
    x, v, eps = _inputs()
    for kind, a in (("flow_grpo", 0.7), ("dance", 0.3), ("cps", 0.8)):
        got = sde_step(x, v, 0.7, 0.5, kind=kind, noise=eps)
        want = sde_step(x, v, 0.7, 0.5, kind=kind, noise=eps, noise_level=a)
        torch.testing.assert_close(got.prev_sample, want.prev_sample, atol=0, rtol=0)
        torch.testing.assert_close(got.log_prob, want.log_prob, atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["flow_grpo", "dance", "cps"])
def test_logprob_recomputed_from_prev_sample(kind):
    x, v, _ = _inputs()
    g = torch.Generator().manual_seed(123)
    sampled = sde_step(x, v, 0.9, 0.75, kind=kind, generator=g)
    again = sde_step(x, v, 0.9, 0.75, kind=kind, prev_sample=sampled.prev_sample)
    torch.testing.assert_close(again.log_prob, sampled.log_prob, atol=TOL, rtol=TOL)
    torch.testing.assert_close(again.prev_sample, sampled.prev_sample, atol=0, rtol=0)
    # A different sample gives a different (lower, for the Gaussian at its mean) log-prob.
    at_mean = sde_step(x, v, 0.9, 0.75, kind=kind, prev_sample=sampled.mean)
    assert torch.all(at_mean.log_prob > sampled.log_prob)


def test_generator_reproducible_and_noise_is_standard_normal():
    x, v, _ = _inputs()
    a = sde_step(x, v, 0.9, 0.75, generator=torch.Generator().manual_seed(7))
    b = sde_step(x, v, 0.9, 0.75, generator=torch.Generator().manual_seed(7))
    c = sde_step(x, v, 0.9, 0.75, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(a.prev_sample, b.prev_sample, atol=0, rtol=0)
    assert not torch.allclose(a.prev_sample, c.prev_sample)
    want = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close((a.prev_sample - a.mean) / a.std, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,a", [("flow_grpo", 0.7), ("dance", 0.3)])
def test_empirical_std_matches_std(kind, a):
    n = 20000
    x = torch.randn(1, 8).expand(n, 8).contiguous()
    v = torch.randn(1, 8).expand(n, 8).contiguous()
    out = sde_step(x, v, 0.6, 0.45, kind=kind, noise_level=a, generator=torch.Generator().manual_seed(3))
    emp_std = (out.prev_sample - out.mean).std(dim=0)  # per latent coordinate, over draws
    emp_mean = out.prev_sample.mean(dim=0)
    std = float(out.std[0])
    assert torch.allclose(emp_std, torch.full_like(emp_std, std), rtol=0.03)
    assert torch.allclose(emp_mean, out.mean[0], atol=4 * std / math.sqrt(n))
    # The real std is not the anchor's noise scale for these kinds.
    assert not math.isclose(std, float(out.noise_scale[0]), rel_tol=1e-3)


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_bf16_inputs_give_fp32_outputs(kind):
    x, v, eps = _inputs()
    out = sde_step(x.bfloat16(), v.bfloat16(), 0.8, 0.6, kind=kind, noise=eps.bfloat16())
    for t in (out.prev_sample, out.mean, out.std, out.noise_scale):
        assert t.dtype == torch.float32
    ref = sde_step(x.bfloat16().float(), v.bfloat16().float(), 0.8, 0.6, kind=kind, noise=eps.bfloat16().float())
    torch.testing.assert_close(out.mean, ref.mean, atol=0, rtol=0)
    if kind == "ode":
        assert out.log_prob is None
    else:
        assert out.log_prob.dtype == torch.float32
        torch.testing.assert_close(out.log_prob, ref.log_prob, atol=0, rtol=0)


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_batched_sigmas_and_noise_levels_equal_per_sample_calls(kind):
    x, v, eps = _inputs(shape=(3, 2, 5))
    sig = torch.tensor([1.0, 0.7, 0.3])
    sig_next = torch.tensor([0.9, 0.5, 0.0])
    levels = torch.tensor([0.5, 0.7, 0.9])
    out = sde_step(x, v, sig, sig_next, kind=kind, noise_level=levels, noise=eps, sigma_one_substitute=0.95)
    for i in range(3):
        one = sde_step(
            x[i : i + 1], v[i : i + 1], float(sig[i]), float(sig_next[i]), kind=kind,
            noise_level=float(levels[i]), noise=eps[i : i + 1], sigma_one_substitute=0.95,
        )
        torch.testing.assert_close(out.prev_sample[i : i + 1], one.prev_sample, atol=TOL, rtol=TOL)
        torch.testing.assert_close(out.mean[i : i + 1], one.mean, atol=TOL, rtol=TOL)
        torch.testing.assert_close(out.std[i : i + 1], one.std, atol=TOL, rtol=TOL)
        torch.testing.assert_close(out.noise_scale[i : i + 1], one.noise_scale, atol=TOL, rtol=TOL)
        if kind != "ode":
            torch.testing.assert_close(out.log_prob[i : i + 1], one.log_prob, atol=TOL, rtol=TOL)
    # 0-dim tensors behave like python floats
    a = sde_step(x, v, torch.tensor(0.7), torch.tensor(0.5), kind=kind, noise=eps)
    b = sde_step(x, v, 0.7, 0.5, kind=kind, noise=eps)
    torch.testing.assert_close(a.prev_sample, b.prev_sample, atol=0, rtol=0)


def test_sigma_one_substitution():
    x, v, eps = _inputs()
    sub = 0.97  # e.g. sigmas[1] of a shifted schedule
    with pytest.raises(ValueError, match="sigma_one_substitute"):
        sde_step(x, v, 1.0, sub, kind="flow_grpo", noise=eps)
    out = sde_step(x, v, 1.0, sub, kind="flow_grpo", noise=eps, sigma_one_substitute=sub)
    mean, std, scale, xp, logp = _ref_step("flow_grpo", x, v, eps, 1.0, sub, 0.7, sub=sub)
    assert math.isclose(scale, 0.7 * math.sqrt(1.0 / (1 - sub)))
    np.testing.assert_allclose(_np(out.noise_scale).ravel(), [scale] * SHAPE[0], rtol=TOL)
    np.testing.assert_allclose(_np(out.mean), mean, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(_np(out.log_prob), logp, atol=TOL, rtol=TOL)
    assert torch.isfinite(out.log_prob).all()
    # The substitute is only used at sigma == 1; it must not change any other step.
    a = sde_step(x, v, 0.8, 0.6, kind="flow_grpo", noise=eps, sigma_one_substitute=0.5)
    b = sde_step(x, v, 0.8, 0.6, kind="flow_grpo", noise=eps)
    torch.testing.assert_close(a.prev_sample, b.prev_sample, atol=0, rtol=0)
    # Other kinds do not divide by 1 - sigma and need no substitute.
    for kind in ("dance", "cps", "ode"):
        assert torch.isfinite(sde_step(x, v, 1.0, 0.9, kind=kind, noise=eps).mean).all()


def test_ode_step():
    x, v, _ = _inputs()
    out = sde_step(x, v, 0.8, 0.55, kind="ode")
    assert out.log_prob is None
    torch.testing.assert_close(out.prev_sample, x + (0.55 - 0.8) * v, atol=TOL, rtol=TOL)
    torch.testing.assert_close(out.prev_sample, out.mean, atol=0, rtol=0)
    assert torch.all(out.std == 0) and torch.all(out.noise_scale == 0)


def test_gradient_flows_through_mean_only():
    x, v, eps = _inputs()
    v = v.clone().requires_grad_(True)
    out = sde_step(x, v, 0.8, 0.6, kind="flow_grpo", noise=eps)
    out.log_prob.sum().backward()
    # d/dv of -(x'-mean)^2/(2std^2) with x' detached: (x'-mean)/std^2 * dmean/dv
    sigma_t = 0.7 * math.sqrt(0.8 / 0.2)
    dmean_dv = (1 + sigma_t**2 * 0.2 / (2 * 0.8)) * (-0.2)
    n = float(np.prod(SHAPE[1:]))
    want = (out.prev_sample - out.mean).detach() / out.std**2 * dmean_dv / n
    torch.testing.assert_close(v.grad, want, atol=1e-5, rtol=1e-4)


def test_flow_kl():
    x, v, eps = _inputs()
    out = sde_step(x, v, 0.8, 0.6, kind="flow_grpo", noise=eps)
    zero = flow_kl(out.mean, out.mean.clone(), out.noise_scale)
    assert zero.shape == (SHAPE[0],) and torch.all(zero == 0)
    ref = sde_step(x, v + 0.1 * torch.randn_like(v), 0.8, 0.6, kind="flow_grpo", noise=eps)
    kl = flow_kl(out.mean, ref.mean, out.noise_scale)
    m, mr = _np(out.mean), _np(ref.mean)
    sigma_t = 0.7 * math.sqrt(0.8 / 0.2)
    want = ((m - mr) ** 2).mean(axis=(1, 2, 3)) / (2 * sigma_t**2)
    assert np.all(want > 0)
    np.testing.assert_allclose(_np(kl), want, atol=TOL, rtol=TOL)
    assert kl.dtype == torch.float32
    # scalar and [B] noise scales agree with the [B, 1, 1, 1] one
    torch.testing.assert_close(flow_kl(out.mean, ref.mean, sigma_t), kl, atol=TOL, rtol=TOL)
    torch.testing.assert_close(flow_kl(out.mean, ref.mean, out.noise_scale.reshape(-1)), kl, atol=0, rtol=0)
    with pytest.raises(ValueError):
        flow_kl(out.mean, ref.mean[:1], out.noise_scale)


def test_validation_errors():
    x, v, eps = _inputs()
    with pytest.raises(ValueError, match="strictly smaller"):
        sde_step(x, v, 0.5, 0.5)
    with pytest.raises(ValueError, match="strictly smaller"):
        sde_step(x, v, 0.5, 0.7, kind="ode")
    with pytest.raises(ValueError, match="strictly smaller"):
        sde_step(x, v, torch.tensor([0.5, 0.5]), torch.tensor([0.4, 0.6]), kind="dance")
    with pytest.raises(ValueError, match="unknown SDE kind"):
        sde_step(x, v, 0.5, 0.4, kind="ddim")
    with pytest.raises(ValueError, match="does not match"):
        sde_step(x, v[:, :2], 0.5, 0.4)
    with pytest.raises(ValueError, match="does not match"):
        sde_step(x, v, 0.5, 0.4, prev_sample=x[:1])
    with pytest.raises(ValueError, match="does not match"):
        sde_step(x, v, 0.5, 0.4, noise=eps[:, :1])
    with pytest.raises(ValueError, match="not both"):
        sde_step(x, v, 0.5, 0.4, noise=eps, prev_sample=x)
    with pytest.raises(ValueError, match="sigma"):
        sde_step(x, v, torch.tensor([0.5, 0.5, 0.5]), 0.4)
    with pytest.raises(ValueError, match="0 <= sigma_next"):
        sde_step(x, v, 0.5, -0.1)
    with pytest.raises(ValueError, match="noise_level"):
        sde_step(x, v, 0.5, 0.4, kind="dance", noise_level=0.0)
