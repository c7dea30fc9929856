"""Credit assignment over denoising steps: per-step rewards ``[B, n]`` for flow-matching policies.

Outcome-only GRPO gives every denoising step of a trajectory the same credit. The functions here turn what the
rollout measured into one reward per trained step, ``[B, n]`` (``B`` trajectories = prompts x group size, ``n``
trained steps); :func:`dense_advantages` then normalises each step column within its prompt group with
:func:`mmrl.core.advantages.group_advantages` (REFERENCE.md section 4: "dense rewards ``[N, T]``: normalize each
timestep column within its group"). Nothing here knows about models or images: inputs are tensors.

Inputs (the names every credit function of :data:`CREDIT_FUNCTIONS` accepts as keywords)
-----------------------------------------------------------------------------------------

* ``step_rewards`` ``[B, n+1]``: ``R_0 .. R_n``. ``R_k`` is the reward of the image the trajectory reaches after
  its first ``k`` trained (SDE) steps, completed to sigma = 0 by ODE (or by the one-step prediction
  ``x - sigma * v``); ``R_0`` is the pure-ODE sample from the same initial noise, ``R_n`` the final sample.
* ``outcome_rewards`` ``[B]``: the final reward of each trajectory (``R_n``).
* ``predictions`` ``[B, n+1, ...]``: what the trajectory would become after ``k`` steps (``x0`` predictions, decoded
  images or features of them), ``k = 0 .. n``; trailing dimensions are flattened.
* ``final`` ``[B, ...]``: the final image / latent / features (default ``predictions[:, -1]``).
* ``num_steps``: ``n``, for ``"outcome"`` when no other input gives it.
* ``group_ids`` ``[B]``: for ``"turning_point"``, the sampling batch of each trajectory (balancing scope).

============== ===================================== ====================================================
name           needs                                 per-step reward ``[B, n]``
============== ===================================== ====================================================
``outcome``    ``outcome_rewards`` + ``n``           ``R`` on every step (plain Flow-GRPO)
``step_gain``  ``step_rewards``                      ``d_t = R_{t+1} - R_t`` (DenseGRPO)
``turning_point`` ``step_rewards``                   TP-GRPO (:func:`turning_point_credit`)
``cosine``     ``predictions``, ``outcome_rewards``  CoCA cosine credit (:func:`cosine_similarity_credit`);
               (or ``step_rewards[:, -1]``)          ``final`` optional
============== ===================================== ====================================================

Every entry is called as ``CREDIT_FUNCTIONS[name](step_rewards=..., outcome_rewards=..., predictions=...,
final=..., num_steps=..., group_ids=..., **options)``: unused inputs are ignored, a missing one is a
``ValueError`` naming it, ``options`` go to the underlying function (unknown ones are a ``TypeError``). All
return the per-step rewards ``[B, n]`` (float32, or float64 for float64 input); NaN rewards (a sample the
reward could not judge) propagate as NaN and get advantage 0 in :func:`dense_advantages`.

Advantage rules for dense rewards (:data:`STEP_ADVANTAGES`): :func:`dense_advantages` (per column, TP-GRPO's
statistics), :func:`multi_step_group_advantages` (E-GRPO), :func:`value_anchored_advantages` (VGPO). E-GRPO's
entropy-guided step merging is :func:`merge_low_entropy_steps`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from mmrl.core.advantages import group_advantages, group_index

TP_MODES = ("paper", "g_plus_bonus")
_TP_MODE_ALIASES = {"paper": "paper", "g_plus_bonus": "g_plus_bonus", "config_default": "g_plus_bonus"}


def _float(values: Tensor) -> Tensor:
    return values.double() if values.dtype == torch.float64 else values.float()


def _step_rewards(step_rewards: Tensor) -> Tensor:
    values = _float(torch.as_tensor(step_rewards))
    if values.dim() != 2 or values.shape[1] < 2:
        raise ValueError(
            f"step_rewards must be [B, n+1] (R_0 .. R_n, n >= 1 trained steps), got shape {tuple(values.shape)}"
        )
    # a trajectory with any unscored reward (NaN) is unscored throughout: every step's reward is NaN (advantage 0
    # downstream, as an outcome-only run gives the whole sample), never a partial credit built on the others
    return values.masked_fill(values.isnan().any(dim=1, keepdim=True), float("nan"))


# --------------------------------------------------------------------------------------------------------
# DenseGRPO: step-wise reward gain
# --------------------------------------------------------------------------------------------------------


def step_gain_credit(step_rewards: Tensor) -> Tensor:
    """Step-wise reward gain ``d_t = R_{t+1} - R_t``: ``[B, n+1] -> [B, n]``.

    Paper: "DenseGRPO: From Sparse to Dense Reward for Flow Matching Model Alignment", Haoyou Deng, Keyu Yan,
    Chaojie Mao, Xiang Wang, Yu Liu, Changxin Gao, Nong Sang (2026), arXiv 2601.20218: the dense reward of a
    denoising step is the reward gain it causes, with each intermediate latent scored through ODE completion to a
    clean image. The same gain is TP-GRPO's "incremental reward" (arXiv 2602.06422) and Stepwise-Flow-GRPO's
    "gain" (Savani et al. 2026, arXiv 2603.28718, with one-step Tweedie predictions instead of ODE completion).

    mmrl's rule, exactly: ``d[:, t] = step_rewards[:, t + 1] - step_rewards[:, t]`` for ``t = 0 .. n-1``
    (REFERENCE.md section 6). The gains telescope: ``sum_t d_t = R_n - R_0``. A NaN anywhere in a trajectory's
    rewards makes all of its gains NaN (mmrl's rule; the anchors have no NaN handling).
    """
    values = _step_rewards(step_rewards)
    return values[:, 1:] - values[:, :-1]


# --------------------------------------------------------------------------------------------------------
# TP-GRPO: turning points
# --------------------------------------------------------------------------------------------------------


class TurningPointCredit(NamedTuple):
    """Result of :func:`turning_point_credit`.

    ``step_rewards`` ``[B, n]``: the per-step reward of every trained step; ``turning_points`` ``[B, n]`` bool:
    the steps treated as turning points (after balancing).
    """

    step_rewards: Tensor
    turning_points: Tensor


def turning_points(step_rewards: Tensor, *, consistency_filter: bool = True) -> Tensor:
    """TP-GRPO's turning-point mask ``[B, n]`` (bool) from ``R_0 .. R_n`` ``[B, n+1]``, before any balancing.

    With ``d_t = R_{t+1} - R_t``, ``G = R_n - R_0``, ``s_t = sign(d_t) sign(G)`` (``sign(0) = 0``):

    * ``consistency_filter=True`` (REFERENCE.md section 6; the anchor's released script): step 0 is a turning
      point iff ``sign(d_0) sign(R_n - R_1) > 0``; step ``t > 0`` iff ``s_{t-1} < 0``, ``s_t > 0`` and
      ``sign(d_t) sign(R_n - R_{t+1}) > 0``.
    * ``consistency_filter=False`` (the anchor with ``select_first_step_only_from_consistent_trajectory`` and
      ``select_inter_step_only_from_consistent_trajectory`` off, its config defaults): step 0 iff ``s_0 > 0``;
      step ``t > 0`` iff ``s_{t-1} < 0`` and ``s_t > 0``.

    Consequences: a zero gain (``sign 0``) is never a turning point and never counts as a sign flip; a
    trajectory with ``G = 0`` has no turning point after step 0; with the filter the last step ``t = n-1`` never
    is one (``R_n - R_n = 0``). At every turning point ``sign(d_t) = sign(G) != 0``. A NaN anywhere in a
    trajectory's rewards gives it no turning point.
    """
    values = _step_rewards(step_rewards)
    d = values[:, 1:] - values[:, :-1]
    sign_d = torch.sign(d)
    sign_g = torch.sign(values[:, -1] - values[:, 0]).unsqueeze(1)
    s = sign_d * sign_g
    consistent = sign_d * torch.sign(values[:, -1:] - values[:, 1:]) > 0  # sign(d_t) sign(R_n - R_{t+1}) > 0
    first = consistent[:, :1] if consistency_filter else s[:, :1] > 0
    later = (s[:, :-1] < 0) & (s[:, 1:] > 0)
    if consistency_filter:
        later = later & consistent[:, 1:]
    return torch.cat([first, later], dim=1)


def _balance(mask: Tensor, key: Tensor, group_ids: Tensor | Sequence[Any] | None) -> Tensor:
    """Keep equal numbers of turning points with ``key > 0`` and ``key < 0`` within each balancing unit.

    Per unit: with ``P`` positive and ``M`` negative turning points, both ``> 0``, keep ``min(P, M)`` of each, the
    largest ``|key|`` first, ties broken by position (trajectory, then step, in input order). A unit whose turning
    points all share one sign (or has none) keeps them all, as the anchor does.
    """
    if group_ids is None:
        unit = torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
        num_units = 1
    else:
        unit, num_units = group_index(group_ids)
        unit = unit.to(mask.device)
        if unit.numel() != mask.shape[0]:
            raise ValueError(f"group_ids has {unit.numel()} entries but step_rewards has {mask.shape[0]} trajectories")
    kept = mask.clone()
    for u in range(num_units):
        in_unit = mask & (unit == u).unsqueeze(1)
        flat = in_unit.flatten().nonzero(as_tuple=True)[0]  # row-major: trajectory, then step
        values = key.flatten()[flat]
        positive, negative = flat[values > 0], flat[values < 0]
        keep = min(positive.numel(), negative.numel())
        if keep == 0:
            continue
        for chosen in (positive, negative):
            order = torch.sort(-key.flatten()[chosen].abs(), stable=True).indices
            dropped = chosen[order[keep:]]
            kept.view(-1)[dropped] = False
    return kept


def turning_point_credit(
    step_rewards: Tensor,
    *,
    balance: bool = False,
    consistency_filter: bool | None = None,
    group_ids: Tensor | Sequence[Any] | None = None,
    mode: str = "paper",
    eta: float = 1.0,
) -> TurningPointCredit:
    """TP-GRPO per-step rewards ``[B, n]`` and turning-point mask from ``R_0 .. R_n`` ``[B, n+1]``.

    Paper: "Alleviating Sparse Rewards by Modeling Step-Wise and Long-Term Sampling Effects in Flow-Based GRPO"
    (TurningPoint-GRPO), Yunze Tong, Mushui Liu, Canyu Zhao, Wanggui He, Shiyi Zhang, Hongwei Zhang, Peng Zhang,
    Jinlong Liu, Ju Huang, Jiamang Wang, Hao Jiang, Pipei Huang (2026), arXiv 2602.06422; code
    ``YunzeTong/TurningPoint-GRPO`` (``scripts/my_train_sd3_fast_with_op3.py``). ``R_0`` is the reward of the
    pure-ODE sample from the same noise, ``R_k`` after ``k`` SDE steps + ODE completion, ``R_n`` the final
    sample's reward; ``d_t = R_{t+1} - R_t``, ``G = R_n - R_0``. Turning points: :func:`turning_points`.

    ``mode="paper"`` (REFERENCE.md section 6; the anchor's released launch script ``common_op3.sh``):
    ``r_t = eta * (R_n - R_t)`` at a turning point (the aggregated long-term effect replaces ``d_t``), ``r_t = d_t``
    elsewhere. Default ``consistency_filter=True``. As the anchor, ``d_t`` is replaced only where that bonus is
    non-zero: a turning point with ``R_n = R_t`` (possible without the filter) or ``eta = 0`` keeps ``d_t``.

    ``mode="g_plus_bonus"`` (alias ``"config_default"``): the anchor's config defaults (``config/my_grpo.py``,
    every ``*_op3`` recipe: ``take_delta_global_as_main=True``, ``use_delta_global=True``, ``eta=1.0``,
    ``apply_first_step_bonus=True``, both consistency selections off, ``use_balanced_bonus=False``,
    ``drop_original_reward_when_having_bonus=False``): ``r_t = G + eta * d_t`` at a turning point, ``r_t = G``
    elsewhere; every step gets the global SDE-vs-ODE gain and turning points also get their own gain as a bonus.
    Default ``consistency_filter=False`` (so step 0 is a turning point iff ``s_0 > 0``). The launch script the
    README points to overrides these defaults into the paper rule above.

    Balancing (``balance=True``, the anchor's ``use_balanced_bonus``): within each sampling batch keep equal
    numbers of turning points from trajectories with ``G > 0`` and ``G < 0``: ``k = min(#positive, #negative)``
    of each, largest ``|G|`` first (``mode="g_plus_bonus"``: the anchor ranks by ``|d_t|``, whose sign equals
    ``sign(G)`` at every turning point); ties go to the earlier trajectory, then the earlier step (the anchor uses
    ``torch.topk``, whose tie order is unspecified). The others revert to ordinary steps. When only one sign is
    present nothing is dropped (the anchor balances only when both signs occur).

    Args:
        step_rewards: ``[B, n+1]`` rewards ``R_0 .. R_n``.
        balance: balance turning points between ``G > 0`` and ``G < 0`` trajectories.
        consistency_filter: require ``sign(d_t) sign(R_n - R_{t+1}) > 0`` (see :func:`turning_points`); ``None``
            takes the mode's anchor default (``paper``: True, ``g_plus_bonus``: False).
        group_ids: ``[B]`` label of the sampling batch each trajectory came from; balancing runs within each.
            ``None``: the whole input is one sampling batch (the anchor balances one per-device sampling batch,
            which mixes prompts). Passing prompt-group ids balances within each prompt group instead.
        mode: ``"paper"`` or ``"g_plus_bonus"`` (``"config_default"``).
        eta: the anchor's ``config.eta``, scale of the turning-point term (1.0 in every anchor recipe).

    Returns:
        :class:`TurningPointCredit` ``(step_rewards [B, n], turning_points [B, n] bool)``. NaN in a trajectory's
        rewards gives NaN rewards (advantage 0 downstream) and no turning points.
    """
    if mode not in _TP_MODE_ALIASES:
        raise ValueError(f"unknown turning-point mode {mode!r}; expected one of {sorted(_TP_MODE_ALIASES)}")
    mode = _TP_MODE_ALIASES[mode]
    if consistency_filter is None:
        consistency_filter = mode == "paper"
    values = _step_rewards(step_rewards)
    d = values[:, 1:] - values[:, :-1]
    g = (values[:, -1] - values[:, 0]).unsqueeze(1)
    mask = turning_points(values, consistency_filter=consistency_filter)
    if balance:
        key = g.expand_as(d) if mode == "paper" else d
        mask = _balance(mask, key, group_ids)
    if mode == "paper":
        # the anchor adds the bonus eta * (R_n - R_t) at a turning point and zeroes d_t only where that bonus is
        # non-zero (drop_original_reward_when_having_bonus: `main_t[B_t != 0] = 0`), so a zero bonus keeps d_t
        bonus = eta * (values[:, -1:] - values[:, :-1])
        rewards = torch.where(mask & (bonus != 0), bonus, d)
    else:
        rewards = g + eta * torch.where(mask, d, torch.zeros_like(d))
    return TurningPointCredit(rewards, mask)


# --------------------------------------------------------------------------------------------------------
# CoCA: cosine-similarity credit
# --------------------------------------------------------------------------------------------------------


def cosine_step_weights(
    predictions: Tensor,
    final: Tensor | None = None,
    *,
    window: int = 1,
    clamp_negative: bool = False,
    eps: float = 1e-8,
) -> Tensor:
    """CoCA's per-step contribution weights ``[B, n]`` (each row sums to 1) from ``n+1`` predictions.

    ``c_k = cos(predictions[:, k], final)`` over the flattened trailing dimensions (``torch`` cosine similarity,
    its eps 1e-8, as the anchor), ``k = 0 .. n``. With ``window = w`` (``n`` divisible by ``w``): window means
    ``m_j = mean(c_{jw+1} .. c_{(j+1)w})``, gains ``g_0 = m_0 - c_0``, ``g_j = m_j - m_{j-1}``; step ``t`` gets
    ``w_t = g_{t // w} / (w * sum_j g_j)``. ``w = 1`` is the per-step rule ``g_t = c_{t+1} - c_t``,
    ``w_t = g_t / (c_n - c_0)``.

    Normalisation (the anchor's): divide by the sum of the gains, negative gains kept (a step that moves away from
    the final image gets a negative weight), so ``sum_t w_t = 1``. ``clamp_negative=True`` clamps gains at 0
    first. When the (clamped) sum is ``<= eps`` in absolute value the weights are uniform ``1/n`` (the anchor
    divides by it regardless).
    """
    preds = _float(torch.as_tensor(predictions))
    if preds.dim() < 3 or preds.shape[1] < 2:
        raise ValueError(f"predictions must be [B, n+1, ...] with n >= 1, got shape {tuple(preds.shape)}")
    b, k = preds.shape[:2]
    preds = preds.reshape(b, k, -1)
    target = preds[:, -1] if final is None else _float(torch.as_tensor(final)).to(preds.device).reshape(b, -1)
    if target.shape[-1] != preds.shape[-1]:
        raise ValueError(f"final has {target.shape[-1]} features per sample but predictions have {preds.shape[-1]}")
    n = k - 1
    if window < 1 or n % window:
        raise ValueError(f"window must divide the number of steps n = {n}, got {window}")
    c = F.cosine_similarity(preds, target.unsqueeze(1).to(preds.dtype), dim=-1)  # [B, n+1]
    means = c[:, 1:].reshape(b, n // window, window).mean(dim=-1)
    gains = means - torch.cat([c[:, :1], means[:, :-1]], dim=1)
    if clamp_negative:
        gains = gains.clamp(min=0.0)
    total = gains.sum(dim=1, keepdim=True)
    usable = total.abs() > eps
    weights = torch.where(usable, gains / (total * window).where(usable, torch.ones_like(total)),
                          torch.full_like(gains, 1.0 / n))
    return weights.repeat_interleave(window, dim=1)


def cosine_similarity_credit(
    predictions: Tensor,
    final: Tensor | None,
    outcome_rewards: Tensor,
    *,
    window: int = 1,
    clamp_negative: bool = False,
    reward_to_go: bool = False,
    alpha: float = 0.0,
    eps: float = 1e-8,
) -> Tensor:
    """Distribute the outcome reward over the steps by how far each moves the prediction towards the final image.

    Paper: "Step-level Reward for Free in RL-based T2I Diffusion Model Fine-tuning" (CoCA, Contribution-based
    Credit Assignment), Xinyao Liao, Wei Wei, Xiaoye Qu, Yu Cheng (2025), arXiv 2505.19196; code
    ``Lil-Shake/CoCA``. Dense credit without extra networks or extra reward calls: each step's contribution is the
    change in cosine similarity between the intermediate prediction and the final image
    (:func:`cosine_step_weights`, exact normalisation there).

    mmrl's rule: ``r_t = R * w_t`` with ``w = cosine_step_weights(...)``, so ``sum_t r_t = R`` (REFERENCE.md
    section 6: "normalised over the trajectory"). ``reward_to_go=True`` gives the anchor trainer's shaped reward
    instead: ``r_t = R * (alpha + (1 - alpha) * sum_{s >= t} w_s)`` (its ``temporal_alpha`` = 0 by default; it
    feeds the clipped per-prompt advantage in as ``R`` and uses ``window = 5``).

    Args:
        predictions: ``[B, n+1, ...]``: ``predictions[:, k]`` is the image (or ``x0`` latent, or features) the
            trajectory would reach after ``k`` steps; usually ``predictions[:, n]`` is the final image.
        final: ``[B, ...]`` the final image; ``None`` uses ``predictions[:, -1]``.
        outcome_rewards: ``[B]`` the reward (or advantage) to distribute.
        window, clamp_negative, eps: see :func:`cosine_step_weights`.
        reward_to_go, alpha: the anchor's reward-to-go shaping (``alpha`` needs ``reward_to_go``).
    """
    if alpha != 0.0 and not reward_to_go:
        raise ValueError("alpha mixes the outcome into CoCA's reward-to-go: set reward_to_go=True to use it")
    weights = cosine_step_weights(predictions, final, window=window, clamp_negative=clamp_negative, eps=eps)
    rewards = _float(torch.as_tensor(outcome_rewards)).to(weights.device).reshape(-1)
    if rewards.numel() != weights.shape[0]:
        raise ValueError(f"outcome_rewards has {rewards.numel()} entries but predictions has {weights.shape[0]}")
    rewards = rewards.to(weights.dtype).unsqueeze(1)
    if not reward_to_go:
        return rewards * weights
    to_go = weights.flip(1).cumsum(dim=1).flip(1)
    return rewards * (alpha + (1.0 - alpha) * to_go)


# --------------------------------------------------------------------------------------------------------
# Advantages for dense rewards
# --------------------------------------------------------------------------------------------------------


def dense_advantages(step_rewards_per_step: Tensor, group_ids: Tensor | Sequence[Any], **group_kwargs: Any) -> Tensor:
    """Per-step advantages ``[B, n]``: each step column normalised within its group by ``group_advantages``.

    Defaults are TP-GRPO's (REFERENCE.md section 6; Flow-GRPO's per-prompt tracker): biased std
    (``std_ddof=0``), ``eps=1e-4``; any ``group_advantages`` option (``scale``, ``eps``, ``std_ddof``, ``clamp``)
    can be given. NaN rewards get advantage 0; a step column whose group has zero spread gets 0.
    """
    values = torch.as_tensor(step_rewards_per_step)
    if values.dim() != 2:
        raise ValueError(f"per-step rewards must be [B, n], got shape {tuple(values.shape)}")
    group_kwargs.setdefault("std_ddof", 0)
    group_kwargs.setdefault("eps", 1e-4)
    return group_advantages(values, group_ids, **group_kwargs)


# --------------------------------------------------------------------------------------------------------
# E-GRPO: entropy-guided step merging and multi-step group-normalised advantages
# --------------------------------------------------------------------------------------------------------


def gaussian_step_entropy(noise_std: Tensor) -> Tensor:
    """Differential entropy per dimension (nats) of a Gaussian step with std ``noise_std``: ``log s + log(2 pi e) / 2``.

    For an SDE step ``x_{t+1} ~ N(mu, s_t^2 I)`` pass ``s_t = sigma_t * sqrt(dt)`` (the step's noise std).
    """
    std = _float(torch.as_tensor(noise_std))
    return torch.log(std) + 0.5 * math.log(2.0 * math.pi * math.e)


def merge_low_entropy_steps(
    step_entropy: Tensor | Sequence[float] | None = None,
    *,
    noise_std: Tensor | Sequence[float] | None = None,
    threshold: float | None = None,
    num_groups: int | None = None,
) -> list[list[int]]:
    """Partition the ``n`` denoising steps into contiguous groups; each group becomes one SDE step (E-GRPO).

    Paper: "E-GRPO: High Entropy Steps Drive Effective Reinforcement Learning for Flow Models", Shengjun Zhang,
    Zhang Zhang, Chensheng Dai, Yueqi Duan (2026), arXiv 2601.00423; code ``shengjun-zhang/VisualGRPO``. High
    entropy steps explore effectively, low entropy ones give near-identical rollouts, so consecutive low-entropy
    steps are merged into one high-entropy SDE step (ODE elsewhere). The released code takes the merge as
    configuration (``eta_step_list`` / ``eta_step_merge_list``; a merged step jumps from ``sigma_i`` to
    ``sigma_{i+m}`` in one SDE step); the paper's adaptive threshold formula was not available to us, so the
    partition below is mmrl's documented rule, not the paper's.

    Step ``t`` has variance ``v_t`` (``noise_std**2``, or ``exp(2 h_t) / (2 pi e)`` from a per-dimension Gaussian
    entropy ``h_t``, see :func:`gaussian_step_entropy`); a group's variance is ``sum v_t`` (independent noises add)
    and its entropy ``log(2 pi e sum v_t) / 2``.

    * ``threshold`` (nats per dimension): a step whose own entropy reaches it stays alone; each maximal run of
      consecutive steps below it is cut left to right into groups, closing a group as soon as its entropy
      reaches the threshold; a remainder at the end of a run that does not reach it joins the run's previous
      group (or stays one group when the run has none).
    * ``num_groups`` (``k <= n``): ``k`` contiguous groups of near-equal variance: steps are added in order and a
      group is closed once the running total reaches ``(j+1)/k`` of the total variance (``j`` = groups closed), or
      when the steps left are just enough to give each remaining group one.

    Returns:
        Lists of 0-based step indices, in order, covering ``0 .. n-1`` exactly once.
    """
    if (step_entropy is None) == (noise_std is None):
        raise ValueError("give exactly one of step_entropy (nats per dimension) or noise_std per step")
    if (threshold is None) == (num_groups is None):
        raise ValueError("give exactly one of threshold (entropy in nats) or num_groups")
    if noise_std is not None:
        std = torch.as_tensor(noise_std, dtype=torch.float64).reshape(-1)
        if not bool(torch.isfinite(std).all()) or bool((std < 0).any()):
            raise ValueError(f"noise_std must be finite and >= 0, got {std.tolist()}")
        variance = std.square().tolist()
    else:
        entropy = torch.as_tensor(step_entropy, dtype=torch.float64).reshape(-1)
        if bool(torch.isnan(entropy).any()) or bool((entropy == math.inf).any()):
            raise ValueError(f"step_entropy must be finite (or -inf), got {entropy.tolist()}")
        variance = (torch.exp(2.0 * entropy) / (2.0 * math.pi * math.e)).tolist()
    n = len(variance)
    if threshold is not None:
        target = math.exp(2.0 * threshold) / (2.0 * math.pi * math.e)  # variance whose entropy is the threshold
        groups: list[list[int]] = []
        t = 0
        while t < n:
            if variance[t] >= target:
                groups.append([t])
                t += 1
                continue
            run_groups: list[list[int]] = []
            current: list[int] = []
            total = 0.0
            while t < n and variance[t] < target:
                current.append(t)
                total += variance[t]
                t += 1
                if total >= target:
                    run_groups.append(current)
                    current, total = [], 0.0
            if current:
                if run_groups:
                    run_groups[-1].extend(current)
                else:
                    run_groups.append(current)
            groups.extend(run_groups)
        return groups
    if not 1 <= num_groups <= max(n, 1):
        raise ValueError(f"num_groups must be between 1 and the number of steps {n}, got {num_groups}")
    if n == 0:
        return []
    overall = sum(variance)
    groups, current, running = [], [], 0.0
    for t, v in enumerate(variance):
        current.append(t)
        running += v
        closed = len(groups)
        if closed == num_groups - 1:
            continue  # the last group takes the rest
        steps_left = n - t - 1
        if running >= (closed + 1) / num_groups * overall or steps_left == num_groups - closed - 1:
            groups.append(current)
            current = []
    groups.append(current)
    return groups


def multi_step_group_advantages(
    rewards: Tensor | Sequence[Tensor],
    group_ids: Tensor | Sequence[Any],
    *,
    std_ddof: int = 1,
    eps: float = 1e-8,
    **group_kwargs: Any,
) -> Tensor:
    """E-GRPO's multi-step group-normalised advantage ``[B, k]`` for ``k`` merged SDE steps.

    Paper: E-GRPO (Zhang, Zhang, Dai, Duan 2026, arXiv 2601.00423): group-relative advantages are computed within
    the samples that share the same consolidated SDE step. In the released code (``RolloutBuffer.
    compute_advantages``) every trained merged step ``j`` is its own rollout branch (the group shares the ODE
    trajectory up to step ``j``, takes one SDE step there, then completes by ODE), ``rewards[:, j]`` is the reward
    of that completion, and the advantage is, per prompt group and column, ``(R - mean) / (std + 1e-8)`` with the
    unbiased std, summed over the reward granularities (ODE completions with step strides 1 and 2).

    mmrl's rule, exactly that: ``A = sum_g dense_advantages(R_g, group_ids, std_ddof=1, eps=1e-8)`` over the
    given ``[B, k]`` reward tensors (one per granularity; a single tensor is one granularity). Zero-spread groups
    and single-sample groups get 0 (the anchor: 0 and NaN). The anchor clamps to +-5 at loss time.
    """
    parts = [rewards] if isinstance(rewards, Tensor) else list(rewards)
    if not parts:
        raise ValueError("multi_step_group_advantages needs at least one [B, k] reward tensor")
    shape = tuple(parts[0].shape)
    if any(tuple(p.shape) != shape for p in parts):
        raise ValueError(f"all granularities must have the same [B, k] shape, got {[tuple(p.shape) for p in parts]}")
    return sum(dense_advantages(p, group_ids, std_ddof=std_ddof, eps=eps, **group_kwargs) for p in parts)


# --------------------------------------------------------------------------------------------------------
# VGPO: value-anchored normalisation
# --------------------------------------------------------------------------------------------------------


def value_anchored_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence[Any],
    *,
    value: Tensor | float,
    weight: float = 1.0,
    scale: float = 1.0,
    eps: float = 1e-4,
    std_ddof: int = 0,
    clamp: float | None = None,
) -> Tensor:
    """Group-relative advantages plus an absolute, value-anchored term, so they do not vanish in uniform groups.

    Paper: "Anchoring Values in Temporal and Group Dimensions for Flow Matching Model Alignment" (VGPO,
    Value-Anchored Group Policy Optimization), Yawen Shao, Jie Xiao, Kai Zhu, Yu Liu, Wei Zhai, Yang Cao,
    Zheng-Jun Zha (2025), arXiv 2512.12387: relying only on intra-group relative rewards makes the signal fade as
    reward diversity is depleted, so VGPO enhances group normalisation with absolute values. Its exact "adaptive
    dual advantage" formula and code were not available to us; mmrl implements this documented rule:

        A = (R - mean_g(R)) / (std_g(R) + eps)  +  weight * (R - V) / scale

    The first term is :func:`mmrl.core.advantages.group_advantages` (0 for a zero-spread group); the second is the
    absolute advantage of ``R`` against a value anchor ``V`` (a scalar target, a running mean of past rewards, or a
    per-sample value estimate such as the pure-ODE baseline reward ``R_0``). A group whose rewards are all equal
    gets ``weight * (R - V) / scale``, not 0. NaN rewards get 0.

    Args:
        rewards: ``[N]`` or ``[N, T]`` (dense, per step column).
        group_ids: ``[N]`` group label of every sample.
        value: the anchor ``V``: a float, ``[N]`` or ``[N, T]``.
        weight: weight of the absolute term (0 gives plain GRPO).
        scale: divides the absolute term (the reward's natural scale); must be > 0.
        eps, std_ddof: of the relative term (defaults: Flow-GRPO / TP-GRPO's biased std, 1e-4).
        clamp: if given, clamp the result to ``[-clamp, clamp]``.
    """
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    values = _float(torch.as_tensor(rewards))
    relative = group_advantages(values, group_ids, eps=eps, std_ddof=std_ddof)
    anchor = _float(torch.as_tensor(value, dtype=values.dtype)).to(values.device)
    if anchor.dim() == 1 and values.dim() == 2:
        anchor = anchor.unsqueeze(1)
    try:
        absolute = (values - anchor) / scale
    except RuntimeError as err:
        raise ValueError(f"value of shape {tuple(anchor.shape)} does not fit rewards {tuple(values.shape)}") from err
    absolute = torch.where(torch.isfinite(values), absolute, torch.zeros_like(absolute))
    out = relative + weight * absolute
    if clamp is not None:
        out = out.clamp(-clamp, clamp)
    return out


# --------------------------------------------------------------------------------------------------------
# Registries
# --------------------------------------------------------------------------------------------------------


def _require(value: Any, name: str, method: str, what: str) -> Any:
    if value is None:
        raise ValueError(f"credit {method!r} needs {name} ({what})")
    return value


def _outcome_credit(*, step_rewards=None, outcome_rewards=None, predictions=None, final=None, num_steps=None,
                    group_ids=None) -> Tensor:
    rewards = _float(torch.as_tensor(_require(outcome_rewards, "outcome_rewards", "outcome", "[B] final rewards")))
    if num_steps is None:
        if step_rewards is not None:
            num_steps = torch.as_tensor(step_rewards).shape[1] - 1
        elif predictions is not None:
            num_steps = torch.as_tensor(predictions).shape[1] - 1
        else:
            raise ValueError("credit 'outcome' needs num_steps (or step_rewards / predictions to read n from)")
    return rewards.reshape(-1, 1).expand(-1, int(num_steps)).clone()


def _step_gain_entry(*, step_rewards=None, outcome_rewards=None, predictions=None, final=None, num_steps=None,
                     group_ids=None) -> Tensor:
    return step_gain_credit(_require(step_rewards, "step_rewards", "step_gain", "[B, n+1] rewards R_0 .. R_n"))


def _turning_point_entry(*, step_rewards=None, outcome_rewards=None, predictions=None, final=None, num_steps=None,
                         group_ids=None, **options: Any) -> Tensor:
    values = _require(step_rewards, "step_rewards", "turning_point", "[B, n+1] rewards R_0 .. R_n")
    return turning_point_credit(values, group_ids=group_ids, **options).step_rewards


def _cosine_entry(*, step_rewards=None, outcome_rewards=None, predictions=None, final=None, num_steps=None,
                  group_ids=None, **options: Any) -> Tensor:
    preds = _require(predictions, "predictions", "cosine", "[B, n+1, ...] intermediate predictions")
    if outcome_rewards is None and step_rewards is not None:
        outcome_rewards = torch.as_tensor(step_rewards)[:, -1]
    rewards = _require(outcome_rewards, "outcome_rewards", "cosine", "[B] final rewards")
    return cosine_similarity_credit(preds, final, rewards, **options)


CREDIT_FUNCTIONS = {
    "outcome": _outcome_credit,
    "step_gain": _step_gain_entry,
    "turning_point": _turning_point_entry,
    "cosine": _cosine_entry,
}
"""Credit methods by name; call with the keyword inputs of the module docstring, return ``[B, n]`` rewards."""

STEP_ADVANTAGES = {
    "grpo": dense_advantages,
    "multi_step": multi_step_group_advantages,
    "value_anchored": value_anchored_advantages,
}
"""Advantage rules for per-step rewards ``[B, n]``: ``fn(rewards, group_ids, **options) -> [B, n]``."""
