"""GiGPO for VLM completions: episode advantage plus a step advantage among completions that share a prefix."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmrl.algorithms.base import TransformContext, Variant, option, register
from mmrl.core.advantages import _grouped_stats, group_index

NORMALIZE = ("mean", "mean_std")


def prefix_anchor_states(completion_ids: Tensor, mask: Tensor, group_ids: Tensor | Sequence[Any]) -> Tensor:
    """Anchor-state label ``[N, T]`` (long) of every token position: ``(i, t)`` and ``(j, t)`` share a label iff
    ``i`` and ``j`` are in the same group, both are active at ``t`` and ``completion_ids[i, :t] ==
    completion_ids[j, :t]`` (the state before token ``t`` is the prefix ``y_<t``). A position is active while
    every mask entry up to it is 1 (right padding). Labels are arbitrary integers; an inactive position gets one of
    its own row, which no active position of another row shares."""
    if completion_ids.shape != mask.shape or completion_ids.dim() != 2:
        raise ValueError(f"completion_ids {tuple(completion_ids.shape)} and mask {tuple(mask.shape)} must both be "
                         f"[N, T]")
    n, length = completion_ids.shape
    index, num_groups = group_index(group_ids)
    if index.numel() != n:
        raise ValueError(f"group_ids has {index.numel()} entries but completion_ids has {n} rows")
    alive = torch.cumprod((mask > 0).to(torch.uint8), dim=1, dtype=torch.uint8).bool()
    rep = torch.arange(n).unsqueeze(1).expand(n, length).clone()
    steps = torch.arange(length)
    for g in range(num_groups):
        rows = (index == g).nonzero(as_tuple=True)[0]
        ids, act = completion_ids[rows], alive[rows]
        equal = ids.unsqueeze(1) == ids.unsqueeze(0)  # [m, m, T]
        # first position where rows a and b differ (T if never): they share the prefix y_<t for every t <= it
        first_diff = torch.where(equal.all(dim=2), torch.full(equal.shape[:2], length),
                                 (~equal).to(torch.uint8).argmax(dim=2))
        shared = (steps.view(1, 1, -1) <= first_diff.unsqueeze(2)) & act.unsqueeze(0)  # [a, b, t]: b in a's state
        rep[rows] = rows[shared.to(torch.uint8).argmax(dim=1)]  # the first member is the state's representative
    rep = torch.where(alive, rep, torch.arange(n).unsqueeze(1))
    return rep * length + steps.unsqueeze(0)


def prefix_step_advantages(returns: Tensor, completion_ids: Tensor, mask: Tensor, group_ids: Tensor | Sequence[Any],
                           *, normalize: str = "mean", eps: float = 1e-6) -> Tensor:
    """GiGPO's step advantage ``[N, T]`` when the return from every state is the final return ``returns [N]``.

    Per anchor state ``S`` (:func:`prefix_anchor_states`): ``A^S = G_i - mean_S(G)`` (``"mean"``) or
    ``(G_i - mean_S(G)) / (std_S(G) + eps)`` (``"mean_std"``, unbiased std); 0 for a state only one completion
    reaches, on padding and for a non-finite return (left out of the statistics)."""
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {NORMALIZE}, got {normalize!r}")
    if returns.dim() != 1 or returns.shape[0] != mask.shape[0]:
        raise ValueError(f"returns must be [N] with N = {mask.shape[0]}, got {tuple(returns.shape)}")
    n, length = mask.shape
    labels = prefix_anchor_states(completion_ids, mask, group_ids)
    values = (returns.double() if returns.dtype == torch.float64 else returns.float()).unsqueeze(1).expand(n, length)
    alive = torch.cumprod((mask > 0).to(torch.uint8), dim=1, dtype=torch.uint8).bool()
    valid = alive & torch.isfinite(values)
    index, num_states = group_index(labels.reshape(-1))
    flat, flat_valid = values.reshape(-1, 1), valid.reshape(-1, 1)
    mean, std, count = _grouped_stats(flat, flat_valid, index, num_states, 1)
    centred = flat - mean
    step = centred / (std + eps) if normalize == "mean_std" else centred
    keep = flat_valid & (count > 1)
    return torch.where(keep, step, torch.zeros_like(step)).reshape(n, length)


@dataclass
class GiGPOOptions:
    step_weight: float = option(1.0, "omega: A = A^E + omega A^S (GiGPO, Feng et al. 2025, arXiv 2505.10978: 1).")
    normalize: str = option("mean", "F_norm of the step advantage: 'mean' (A^S = G - mean over the anchor state, the "
                                    "released default mean_norm) or 'mean_std' (divided by the state's std + eps).")
    eps: float = option(1e-6, "Added to the step group's std with normalize: mean_std (GiGPO's epsilon).")
    reward: str = option("", "The score component whose value is each completion's return G; '' = the incoming "
                             "(episode) advantage itself, the same affine map of the reward within each group.")

    def validate(self) -> None:
        if self.normalize not in NORMALIZE:
            raise ValueError(f"normalize must be one of {NORMALIZE}, got {self.normalize!r}")
        if not self.step_weight >= 0 or not math.isfinite(self.step_weight):
            raise ValueError(f"step_weight must be a finite number >= 0, got {self.step_weight}")
        if not self.eps > 0 or not math.isfinite(self.eps):
            raise ValueError(f"eps must be a finite number > 0, got {self.eps}")


@register
class GiGPO(Variant):
    """GiGPO (Group-in-Group Policy Optimization) with token prefixes as anchor states.

    GiGPO adds to the episode (group) advantage ``A^E`` a step advantage ``A^S`` computed within *anchor-state
    groups*: all actions, across the group's trajectories, taken from the same environment state. For a VLM
    completion the state before token ``t`` is the prefix ``y_<t`` (the prompt is the group's), so the anchor state
    of ``(i, t)`` is the set ``S_{i,t}`` of the group's completions ``j`` that are still generating at ``t`` and have
    ``y^j_<t = y^i_<t``. With a single final reward and no discount the return from every state is the completion's
    final return ``G_i``, and the step advantage becomes::

        A^S_{i,t} = G_i - mean_{j in S_{i,t}} G_j        (normalize = mean; mean_std: / (std_{S_{i,t}} G + eps))
        A_{i,t}   = A^E_i + omega * A^S_{i,t}            (0 on padding; transform stage, [N] -> [N, T])

    i.e. a Monte-Carlo advantage of the completion over the value of the prefix it has reached, estimated by the
    mean return of the completions through that prefix. Concretely: on the prefix the whole group shares (at least
    ``t = 0``, the empty prefix) ``S`` is the group and ``A^S`` is the group-centred return (with ``reward: ''`` and
    ``mean_std``: exactly the episode advantage); after every branching point ``S`` shrinks to the completions
    that made the same choices, so the token at which a completion leaves a sub-group (the first token it does not
    share) is compared with the sub-group that went elsewhere from the same prefix; once no other completion shares
    its prefix, ``|S| = 1`` and ``A^S = 0`` (only ``A^E`` is left). Identical tokens shared by a whole state group
    get gradients that cancel across it, as in GRPO.

    ``G`` is ``ctx.scores[reward]`` when ``reward`` is set; with ``reward: ''`` it is the incoming advantage itself,
    which the loop's default estimator (without ``advantage_clamp``, no NaN reward in the group) makes an increasing
    affine map of the reward within each group, so ``mean_std`` gives exactly the step advantage of the raw reward
    and ``mean`` gives it in the episode advantage's units (divided by the group's std).

    Paper vs mmrl: the two-level advantage ``A^E + omega A^S``, anchor-state groups of identical states and the
    ``F_norm`` choice (std or 1, with singleton groups giving 0) are GiGPO's (its code ``compute_gigpo_outcome_
    advantage``, defaults ``omega = 1``, ``mean_norm``, ``epsilon = 1e-6``); taking token prefixes as the states, the
    undiscounted final return at every token, and using the incoming (possibly transformed) advantage as ``A^E``
    are mmrl's.

    VLM only: GiGPO needs states that recur across trajectories. A flow trajectory's intermediate latents are
    continuous and almost surely distinct across the group after the first stochastic step, so the only state
    trajectories can share is the start; there ``A^S`` would be the group-centred return again, and GiGPO reduces
    to GRPO with the advantage scaled by ``1 + omega``.
    """

    name = "gigpo"
    summary = "episode advantage plus omega x the return's advantage among completions sharing the token prefix"
    paper = ("Group-in-Group Policy Optimization for LLM Agent Training (GiGPO), Feng et al. 2025, arXiv 2505.10978 "
             "(token prefixes as anchor states: mmrl's)")
    Options = GiGPOOptions
    families = ("vlm",)

    def check(self, config) -> None:
        reward = self.options.reward
        if reward:
            self.require_reward(config, "reward")

    def transform(self, ctx: TransformContext) -> Tensor:
        o, r = self.options, ctx.rollout
        adv = ctx.advantages.double() if ctx.advantages.dtype == torch.float64 else ctx.advantages.float()
        if o.reward:
            returns = ctx.scores[o.reward]
            if returns.dim() != 1:
                raise ValueError(f"variant 'gigpo': reward {o.reward!r} must be one value per completion [N], got "
                                 f"{tuple(returns.shape)}")
        elif adv.dim() == 1:
            returns = adv
        else:
            raise ValueError("variant 'gigpo': the incoming advantages are per token [N, T] (an earlier transform), "
                             "so they are no episode return; set the option reward to a score component")
        step = prefix_step_advantages(returns.to(adv.dtype), r.completion_ids, r.mask, r.group_ids,
                                      normalize=o.normalize, eps=o.eps)
        episode = adv.unsqueeze(1) if adv.dim() == 1 else adv
        alive = torch.cumprod((r.mask > 0).to(torch.uint8), dim=1, dtype=torch.uint8).bool()
        out = episode + o.step_weight * step.to(adv.dtype)
        return torch.where(alive, out, torch.zeros_like(out))
