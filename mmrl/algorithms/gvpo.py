"""GVPO-style loss: the centred implicit reward of each response regressed onto its centred actual reward."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmrl.algorithms.base import SurrogateContext, TransformContext, Variant, VariantError, option, register
from mmrl.algorithms.dense import DenseCredit, configured
from mmrl.core.advantages import _grouped_stats, group_index


@dataclass
class GVPOOptions:
    beta: float = option(0.1, "beta of the implicit reward beta * log(pi_theta / pi_theta') (GVPO, Zhang et al. "
                              "2025): the KL strength of the objective whose unique optimum GVPO targets. On-policy "
                              "the gradient is beta * (its GRPO counterpart), so scale the learning rate by 1 / beta.")

    def validate(self) -> None:
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise ValueError(f"beta must be a finite number > 0, got {self.beta}")


@register
class GVPO(Variant):
    """Per response ``i`` of group ``g`` (mmrl's per-sample form of GVPO's group loss):

    ``L_i = 1/2 * (beta * (u_i - mean_g u) - A_i)^2``, spread as the same value over the response's actions,

    with ``u_i`` the implicit reward's log-ratio: the mean ``logp - old_logp`` over the response's actions in this
    forward (mask-weighted), and ``A_i`` the loop's advantage as the centred actual reward (``algorithm.scale=none``
    gives GVPO's ``R - mean R`` exactly; ``group`` regresses the standardised reward). The gradient on ``u_i`` is
    ``beta * (beta (u_i - mean u) - A_i)``, GVPO's weight ``(A_i) - beta (u_i - mean u)`` times ``-beta``.

    The group mean couples the samples of a group, and a minibatch holds only some of them. It is therefore
    detached and taken from a table kept over the update: ``transform`` sets every sample's ``u`` to 0 (its value at
    the update's start, where the current policy is the sampling one), and each forward first writes its rows' new
    ``u`` (detached) into the table, then reads ``mean_g u`` over all of the group's entries. Detaching loses nothing
    when the whole group is in one forward: the mean's own gradient term is ``-(beta / n) sum_j (beta (u_j - mean u)
    - A_j) = 0`` because both centred sums vanish. It is exact on-policy (one optimizer step per update: all ``u`` are
    0 and the gradient is ``-beta A_i``) and otherwise uses the group mates' latest values within the update.

    Differences from the paper: ``pi_theta'`` is the sampling policy (``SurrogateContext`` carries no reference
    log-probs), ``u`` is length-normalised (a mean over actions, not the sequence sum), the group mean is the table's
    as above, and constants (the paper's ``1 / (k - 1)``) are left to the aggregation. With
    ``train.timestep_chunk``, ``u`` is the chunk's mean log-ratio. Per-sample advantages ``[N]`` only,
    ``ratio_level=token``, and no per-token weight of the policy term (``algorithm.top_entropy_quantile`` < 1, a
    ``token_*`` sampler correction), which would scale each chunk's share of the per-sample loss by its own kept
    fraction: refused."""

    name = "gvpo"
    summary = "regress the centred implicit reward beta*(u - mean u) onto the centred actual reward, no ratio, no clip"
    paper = ("GVPO: Group Variance Policy Optimization for Large Language Model Post-Training, Zhang et al. 2025, "
             "arXiv 2504.19599 (per-sample form with a detached group mean over the update; mmrl's)")
    Options = GVPOOptions

    def __init__(self, options: Any = None):
        super().__init__(options)
        self.groups: Tensor | None = None  # group index of each sample of this update's local batch
        self.num_groups = 0
        self.implicit: Tensor | None = None  # latest u of each sample in this update (0 before its first forward)

    def check(self, config) -> None:
        if config.algorithm.ratio_level != "token":
            raise VariantError("variant 'gvpo' computes its own per-sample log-ratio: it needs "
                               "algorithm.ratio_level=token")
        dense = configured(config, DenseCredit)
        if dense:
            raise VariantError(f"variant 'gvpo' regresses one reward per sample; {dense[0]!r} gives per-step rewards")
        # per-token weights of the policy term scale the one per-sample loss by each chunk's weighted share of the
        # sample's actions, so the update would depend on train.timestep_chunk, and u counts tokens they leave out
        a = config.algorithm
        if a.top_entropy_quantile < 1.0:
            raise VariantError("variant 'gvpo' regresses one value per sample over all its tokens; "
                               "algorithm.top_entropy_quantile keeps only some tokens in the policy term, which its "
                               "per-sample loss cannot honour (set it to 1)")
        if (a.sampler_correction or "").startswith("token"):
            raise VariantError(f"variant 'gvpo' regresses one value per sample; algorithm.sampler_correction="
                               f"{a.sampler_correction} weights each token: use a sequence_* correction")

    def transform(self, ctx: TransformContext) -> Tensor:
        if ctx.advantages.dim() != 1:
            raise ValueError(f"variant 'gvpo' needs one advantage per sample [N], got shape "
                             f"{tuple(ctx.advantages.shape)}")
        self.groups, self.num_groups = group_index(ctx.rollout.group_ids.cpu())
        self.implicit = torch.zeros(ctx.advantages.shape[0], dtype=torch.float64)
        return ctx.advantages

    def surrogate(self, ctx: SurrogateContext) -> Tensor:
        if self.implicit is None:
            raise RuntimeError("variant 'gvpo': the transform stage has not run for this update")
        n, t = ctx.mask.shape
        adv = ctx.advantages.reshape(n, -1)
        if adv.shape[1] != 1:
            raise ValueError(f"variant 'gvpo' needs one advantage per sample, got shape {tuple(ctx.advantages.shape)}")
        mask = ctx.mask.to(ctx.logps.dtype)
        actions = mask.sum(-1)
        u = (ctx.log_ratio.expand(n, t) * mask).sum(-1) / actions.clamp(min=1.0)
        index = ctx.index.cpu()
        fresh = u.detach().double().cpu()
        self.implicit[index] = torch.where(actions.cpu() > 0, fresh, self.implicit[index])
        table = self.implicit.unsqueeze(1)
        mean, _, _ = _grouped_stats(table, torch.ones_like(table, dtype=torch.bool), self.groups, self.num_groups, 0)
        centre = mean[index, 0].to(u)
        loss = 0.5 * (self.options.beta * (u - centre) - adv[:, 0]).square()
        return loss.unsqueeze(1).expand(n, t)
