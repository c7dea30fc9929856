"""Which denoising steps are stochastic (SDE) and which are trained (REFERENCE.md section 3).

A plan for one update is two things over the ``S`` sampling steps: ``sde`` (bool ``[S]``: SDE step with
a log-probability, else a deterministic ODE step) and ``train`` (sorted step indices ``[T]`` whose
log-probabilities enter the loss). The last step (to sigma = 0) is never trained, as in every anchor.

Modes:

* ``fraction`` -- Flow-GRPO (Liu et al. 2025, arXiv 2505.05470): SDE on every step, train the first
  ``int(S * timestep_fraction)`` steps (0.99 with S = 10 trains steps 0..8).
* ``random_fraction`` -- DanceGRPO (Xue et al. 2025, arXiv 2505.07818): SDE on every step, train a random
  subset of ``max(1, int(S * timestep_fraction))`` of steps ``0..S-2`` (fresh each update).
* ``random_window`` -- Flow-GRPO-Fast: a window of ``W`` consecutive SDE steps whose start is drawn
  uniformly from ``0..max(0, S//2 - W)`` (so the window lies in the first half of the schedule), ODE
  elsewhere; only the window is trained.
* ``sliding_window`` -- MixGRPO (Li et al. 2025, arXiv 2507.21802): a window of ``W`` SDE steps starting at
  ``(update // shift_every) % (S - W)``, i.e. moving forward one step every ``shift_every`` updates and
  wrapping; ODE elsewhere; only the window is trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STEP_MODES = ("fraction", "random_fraction", "random_window", "sliding_window")


@dataclass
class StepPlan:
    sde: torch.Tensor  # bool [S]
    train: torch.Tensor  # long [T], sorted, subset of the SDE steps, never S-1


def plan_steps(
    mode: str,
    num_steps: int,
    *,
    timestep_fraction: float = 0.99,
    window_size: int = 2,
    shift_every: int = 1,
    update: int = 0,
    generator: torch.Generator | None = None,
) -> StepPlan:
    """The SDE/train plan of one update. ``generator`` drives the random modes (seed it per update)."""
    s = num_steps
    trainable = s - 1
    if mode not in STEP_MODES:
        raise ValueError(f"unknown train_steps mode {mode!r}; expected one of {STEP_MODES}")
    if trainable < 1:
        raise ValueError(f"a schedule of {s} steps has no trainable step (the last one is never trained)")
    if mode in ("fraction", "random_fraction"):
        count = min(trainable, max(1, int(s * timestep_fraction)))
        if mode == "fraction":
            train = torch.arange(count)
        else:
            train = torch.randperm(trainable, generator=generator)[:count].sort().values
        return StepPlan(sde=torch.ones(s, dtype=torch.bool), train=train)
    if window_size > trainable:
        raise ValueError(f"window of {window_size} steps is longer than the {trainable} trainable steps of a "
                         f"{s}-step schedule")
    if mode == "random_window":
        high = max(0, s // 2 - window_size)
        start = int(torch.randint(0, high + 1, (1,), generator=generator).item())
    else:
        start = (update // shift_every) % (trainable - window_size + 1)
    train = torch.arange(start, start + window_size)
    sde = torch.zeros(s, dtype=torch.bool)
    sde[train] = True
    return StepPlan(sde=sde, train=train)

