"""Reward-aware per-step noise calibration (mmrl.core.noise) on hand-worked numbers."""

import math

import pytest
import torch

from mmrl.core.noise import adapt_noise_levels


def test_steps_with_less_spread_get_more_noise_by_at_most_e_to_the_rate():
    levels = torch.full((5,), 0.5)
    # gain spreads 0.1, 0.2, 0.3 on steps 0-2: mean 0.2 -> factors exp(clamp(0.1 * log(0.2 / g), +-0.1))
    new = adapt_noise_levels(levels, torch.tensor([0, 1, 2]), torch.tensor([0.1, 0.2, 0.3]), rate=0.1)
    assert new[0].item() == pytest.approx(0.5 * math.exp(0.1 * math.log(2.0)))
    assert new[1].item() == pytest.approx(0.5)
    assert new[2].item() == pytest.approx(0.5 * math.exp(0.1 * math.log(2 / 3)))
    assert new[3:].tolist() == [0.5, 0.5]  # untrained steps untouched
    assert levels.tolist() == [0.5] * 5  # input not modified


def test_step_is_capped_bounded_and_nan_safe():
    levels = torch.full((3,), 0.7)
    tiny_spread = adapt_noise_levels(levels, torch.arange(3), torch.tensor([1e-9, 1.0, float("nan")]), rate=0.1)
    assert tiny_spread[0].item() == pytest.approx(0.7 * math.exp(0.1))  # one update moves at most e^rate
    assert tiny_spread[2].item() == pytest.approx(0.7)  # no measurement, no change
    current = levels.clone()
    for _ in range(100):
        current = adapt_noise_levels(current, torch.arange(3), torch.tensor([1e-9, 1.0, 1.0]), rate=0.5,
                                     base=levels, bounds=(0.5, 1.3), max_level=0.8)
    assert current[0].item() == pytest.approx(0.8)  # capped by max_level (CPS needs a <= 1)
    assert current[1].item() == pytest.approx(0.7 * 0.5)  # more spread than average: down to the lower bound

