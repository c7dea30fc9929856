"""Which denoising steps are stochastic (SDE) and which are trained (REFERENCE.md section 3).

A plan for one update is two things over the ``S`` sampling steps: ``sde`` (bool ``[S]``: SDE step with
a log-probability, else a deterministic ODE step) and ``train`` (sorted step indices ``[T]`` whose
log-probabilities enter the loss). The last step (to sigma = 0) is never trained, as in every anchor.

Modes:

* ``fraction`` -- Flow-GRPO (Liu et al. 2025, arXiv 2505.05470): SDE on every step, train the first
  ``int(S * timestep_fraction)`` steps (0.99 with S = 10 trains steps 0..8).
* ``random_fraction`` -- DanceGRPO (Xue et al. 2025, arXiv 2505.07818): SDE on every step, train a random
  subset of ``max(1, int((S - 1) * timestep_fraction))`` of steps ``0..S-2`` (the anchor drops the last step,
  then trains that fraction of the rest), fresh each update. mmrl's rule: one subset for every sample of the
  update (the anchor draws one per sample), so the trained steps batch across samples; the expected gradient is
  the same.
* ``random_window`` -- Flow-GRPO-Fast: a window of ``W`` consecutive SDE steps whose start is drawn
  uniformly from ``lo..hi-W`` of ``window_range`` ``[lo, hi]`` (its ``sample.sde_window_range``; default
  ``[0, S//2]``, so the window lies in the first half of the schedule, as its recipes set), ODE elsewhere; only
  the window is trained. ``hi`` is at most ``S - 1`` (mmrl's rule: the last step is never trained).
* ``sliding_window`` -- MixGRPO (Li et al. 2025, arXiv 2507.21802): a window of ``W`` SDE steps starting at
  ``(update // shift_every) % (S - W)``, i.e. moving forward one step every ``shift_every`` updates and
  wrapping; ODE elsewhere; only the window is trained.
* ``entropy_merge`` -- E-GRPO (Zhang, Zhang, Dai, Duan 2026, arXiv 2601.00423): the trainable steps
  ``0..S-2`` are partitioned into contiguous groups by :func:`mmrl.core.credit.merge_low_entropy_steps` from
  each step's SDE noise std (``step_noise_std``; entropy per dimension ``log std + log(2 pi e) / 2``, see
  :func:`mmrl.core.credit.gaussian_step_entropy`), with ``merge_threshold`` (nats) or ``merge_groups``. Each
  group becomes ONE SDE step from its first step's sigma to its last step's next sigma (one transformer
  evaluation, a larger ``dt``, the SDE noise of that merged step at the first step's noise level); the last step
  (to sigma = 0) stays a plain ODE step. The plan then carries ``sigma_index`` (long ``[S'+1]``, indices into the
  ``S+1`` sigmas of the fine schedule): the rollout samples on the coarser grid ``sigmas[sigma_index]`` with
  ``S' = groups + 1`` steps, and ``sde`` / ``train`` index that grid (every merged step is SDE and trained, one
  action each). Advantages: E-GRPO's multi-step group-normalised advantage
  (:func:`mmrl.core.credit.multi_step_group_advantages`) normalises each merged step's reward within its prompt
  group; with the trainer's outcome reward every merged step of a trajectory has the same reward (its final
  image's), so it reduces to the ordinary group-normalised outcome advantage broadcast over the merged steps,
  which is what the trainer applies (``[N]`` advantages over ``old_logps [N, T]``, ``T`` = merged steps). The
  paper's per-branch rewards (one ODE completion per merged step) are not sampled by this mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

STEP_MODES = ("fraction", "random_fraction", "random_window", "sliding_window", "entropy_merge")


@dataclass
class StepPlan:
    sde: torch.Tensor  # bool [S] (or [S'] on the merged grid)
    train: torch.Tensor  # long [T], sorted, subset of the SDE steps, never S-1
    #: long [S'+1] or None: the sampling grid is ``sigmas[sigma_index]`` (entropy_merge); None = the full schedule
    sigma_index: torch.Tensor | None = None


def check_window_range(window_range: Sequence[int], window_size: int, num_steps: int) -> tuple[int, int]:
    """``(lo, hi)`` of a ``random_window`` range ``[lo, hi]``, or a ValueError saying what is wrong: two whole
    numbers with ``0 <= lo``, ``hi <= num_steps - 1`` (the last step is never trained) and room for the window
    (``hi - lo >= window_size``)."""
    values = list(window_range) if isinstance(window_range, (list, tuple)) else None
    if values is None or len(values) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"expected [lo, hi], two whole numbers, got {window_range!r}")
    low, high = values
    if low < 0 or high > num_steps - 1:
        raise ValueError(f"[{low}, {high}] must lie in 0..{num_steps - 1} (the last of the {num_steps} steps is never "
                         f"trained)")
    if high - low < window_size:
        raise ValueError(f"[{low}, {high}] holds no window of {window_size} steps (need hi - lo >= window_size)")
    return low, high


def plan_steps(
    mode: str,
    num_steps: int,
    *,
    timestep_fraction: float = 0.99,
    window_size: int = 2,
    shift_every: int = 1,
    update: int = 0,
    generator: torch.Generator | None = None,
    step_noise_std: torch.Tensor | None = None,
    merge_threshold: float | None = None,
    merge_groups: int | None = None,
    window_range: Sequence[int] | None = None,
) -> StepPlan:
    """The SDE/train plan of one update. ``generator`` drives the random modes (seed it per update).
    ``random_window`` draws its start uniformly from ``lo..hi-W`` of ``window_range`` ``[lo, hi]`` (default
    ``[0, S // 2]``). ``entropy_merge`` needs ``step_noise_std`` (``[S]`` or ``[S-1]``, the SDE noise std of each fine step; only
    steps ``0..S-2`` are used) and exactly one of ``merge_threshold`` / ``merge_groups``."""
    s = num_steps
    trainable = s - 1
    if mode not in STEP_MODES:
        raise ValueError(f"unknown train_steps mode {mode!r}; expected one of {STEP_MODES}")
    if trainable < 1:
        raise ValueError(f"a schedule of {s} steps has no trainable step (the last one is never trained)")
    if mode == "entropy_merge":
        from mmrl.core.credit import merge_low_entropy_steps

        if step_noise_std is None:
            raise ValueError("train_steps='entropy_merge' needs the noise std of each step (step_noise_std)")
        std = torch.as_tensor(step_noise_std, dtype=torch.float64).reshape(-1)
        if len(std) < trainable:
            raise ValueError(f"step_noise_std has {len(std)} values for the {trainable} trainable steps")
        if merge_groups is not None and not 1 <= merge_groups <= trainable:
            raise ValueError(f"merge_groups={merge_groups} must be in 1..{trainable} (trainable steps of a "
                             f"{s}-step schedule)")
        groups = merge_low_entropy_steps(noise_std=std[:trainable], threshold=merge_threshold,
                                         num_groups=merge_groups)
        k = len(groups)
        sigma_index = torch.tensor([g[0] for g in groups] + [s - 1, s], dtype=torch.long)
        sde = torch.ones(k + 1, dtype=torch.bool)
        sde[k] = False  # the last step (to sigma = 0): ODE, never trained
        return StepPlan(sde=sde, train=torch.arange(k), sigma_index=sigma_index)
    if mode in ("fraction", "random_fraction"):
        # Flow-GRPO: int(S * fraction) (0.99 -> steps 0..S-2); DanceGRPO: int((S - 1) * fraction) of the S - 1
        count = min(trainable, max(1, int((s if mode == "fraction" else trainable) * timestep_fraction)))
        if mode == "fraction":
            train = torch.arange(count)
        else:
            train = torch.randperm(trainable, generator=generator)[:count].sort().values
        return StepPlan(sde=torch.ones(s, dtype=torch.bool), train=train)
    if window_size > trainable:
        raise ValueError(f"window of {window_size} steps is longer than the {trainable} trainable steps of a "
                         f"{s}-step schedule")
    if mode == "random_window":
        # Flow-GRPO-Fast: start uniform in lo..hi-W of sample.sde_window_range (default the first half)
        low, high = check_window_range(window_range, window_size, s) if window_range is not None else \
            (0, max(window_size, s // 2))
        start = int(torch.randint(low, high - window_size + 1, (1,), generator=generator).item())
    else:
        # MixGRPO's progressive window, always whole: W of the trainable steps 0..S-2, wrapping after S-W positions.
        # mmrl's rule. MixGRPO (grpo_states.py, --prog_overlap --roll_back) steps its start through 0..S-2 and
        # trains range(start, min(start + W, S - 2)): never step S-2, a shrinking window at the end and an empty
        # one (an update that trains nothing) at start S-2, wrapping after S-1 positions.
        start = (update // shift_every) % (trainable - window_size + 1)
    train = torch.arange(start, start + window_size)
    sde = torch.zeros(s, dtype=torch.bool)
    sde[train] = True
    return StepPlan(sde=sde, train=train)

