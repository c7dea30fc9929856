"""policy_loss against a per-element Python computation of REFERENCE.md section 5 (TRL's definitions)."""

import math

import pytest
import torch

from mmrl.core.losses import k3_kl, policy_loss

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
    assert out.metrics["clipfrac"].item() == 0.5


def test_dense_advantages_and_explicit_kl():
    logps, old, _, _, mask = _inputs()
    adv = torch.randn(N, T, dtype=torch.float64)
    kl = torch.rand(N, T, dtype=torch.float64)
    base = policy_loss(logps, old, adv, mask, aggregation="bnpo")
    with_kl = policy_loss(logps, old, adv, mask, aggregation="bnpo", kl=kl, beta=0.5)
    assert with_kl.loss.item() == pytest.approx(base.loss.item() + 0.5 * ((kl * mask).sum() / mask.sum()).item())


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
