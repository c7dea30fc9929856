"""DisCO-style discriminative loss: positives' mean score minus negatives', with KL to the sampler as a constraint."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmrl.algorithms.base import SurrogateContext, TransformContext, Variant, VariantError, option, register
from mmrl.algorithms.dense import DenseCredit, configured
from mmrl.core.advantages import _grouped_stats, group_index

SCORES = ("log_likelihood", "likelihood_ratio")


@dataclass
class DisCOOptions:
    score: str = option("log_likelihood", "The non-clipping scoring function s of DisCO (Li et al. 2025), averaged "
                                          "over actions: log_likelihood (log pi) or likelihood_ratio (pi / pi_old).")
    delta: float = option(1e-4, "The KL budget: KL(pi_old || pi) <= delta, enforced by the squared-hinge penalty.")
    penalty: float = option(1000.0, "zeta of the penalty zeta * max(KL - delta, 0)^2 that replaces the constraint.")

    def validate(self) -> None:
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
        if not (self.delta >= 0 and math.isfinite(self.delta)):
            raise ValueError(f"delta must be a finite number >= 0, got {self.delta}")
        if not (self.penalty >= 0 and math.isfinite(self.penalty)):
            raise ValueError(f"penalty must be a finite number >= 0, got {self.penalty}")


@register
class DisCO(Variant):
    """Per action (mmrl's per-action form of the DisCO objective as its abstract states it):

    ``l = -c_i * s_it + zeta * max(K - delta, 0)^2 + 2 zeta max(K - delta, 0) * (k_it - sg(k_it))``

    * positives / negatives: the sign of the loop's advantage (for a 0/1 reward in a mixed group exactly the
      correct / incorrect responses; groups without both get ``c = 0``), fixed in ``transform`` for the update;
    * ``c_i = n_g / n+_g`` for a positive and ``-n_g / n-_g`` for a negative (``n_g`` the group's samples in this
      process's batch), so the group's mean of ``c_i s_i`` is ``mean_+ s - mean_- s``: the discriminative score gap,
      with no ``1 / std`` and no advantage magnitude, hence no question-difficulty weighting;
    * ``s_it``: ``log_ratio`` (gradient that of ``log pi``, the log-likelihood score; the constant ``old_logp`` is
      dropped) or ``ratio`` (likelihood-ratio score); a per-sample mean through the ``grpo`` aggregation;
    * ``k_it = ratio - 1 - log_ratio``, the k3 estimate of KL(pi_old || pi) from pi_old's samples, ``K`` its mean over
      this forward's active actions. The last term carries the penalty's gradient ``2 zeta [K - delta]_+ dK`` (exact
      for a mean over the same actions, i.e. ``aggregation=bnpo`` with the batch in one forward); the middle one is
      the penalty's value, with no gradient.

    Differences from the paper: the KL constraint is enforced per forward (a minibatch chunk), not over the whole
    batch; positives come from the advantage's sign; DisCO's DRO (log-sum-exp over negatives) for imbalanced groups is
    not implemented; the loop's ``beta * KL`` to the reference is added on top (set ``algorithm.beta=0`` for DisCO).
    Per-sample advantages ``[N]`` only, and ``ratio_level=token``."""

    name = "disco"
    summary = "discriminative loss: mean score of positives minus negatives, KL to the sampler <= delta by a hinge penalty"
    paper = ("DisCO: Reinforcing Large Reasoning Models with Discriminative Constrained Optimization, Li et al. 2025, "
             "arXiv 2505.12366 (DisCO-b form, per-forward KL penalty; mmrl's)")
    Options = DisCOOptions

    def __init__(self, options: Any = None):
        super().__init__(options)
        self.coef: Tensor | None = None  # c_i per sample of this update's local batch

    def check(self, config) -> None:
        if config.algorithm.ratio_level != "token":
            raise VariantError("variant 'disco' scores per action: it needs algorithm.ratio_level=token")
        dense = configured(config, DenseCredit)
        if dense:
            raise VariantError(f"variant 'disco' splits whole responses into positives and negatives; {dense[0]!r} "
                               f"gives per-step rewards")

    def transform(self, ctx: TransformContext) -> Tensor:
        adv = ctx.advantages
        if adv.dim() != 1:
            raise ValueError(f"variant 'disco' needs one advantage per sample [N], got shape {tuple(adv.shape)}")
        index, num_groups = group_index(ctx.rollout.group_ids.cpu())
        sign = torch.stack([(adv > 0), (adv < 0)], dim=1).double().cpu()
        share, _, _ = _grouped_stats(sign, torch.ones_like(sign, dtype=torch.bool), index, num_groups, 0)
        pos, neg = sign[:, 0] > 0, sign[:, 1] > 0
        both = (share[:, 0] > 0) & (share[:, 1] > 0)
        coef = torch.where(pos, 1.0 / share[:, 0].clamp(min=1e-12), torch.zeros_like(share[:, 0]))
        coef = torch.where(neg, -1.0 / share[:, 1].clamp(min=1e-12), coef)
        self.coef = torch.where(both, coef, torch.zeros_like(coef)).float()
        return adv

    def surrogate(self, ctx: SurrogateContext) -> Tensor:
        o = self.options
        if self.coef is None:
            raise RuntimeError("variant 'disco': the transform stage has not run for this update")
        n, t = ctx.mask.shape
        coef = self.coef.to(ctx.logps)[ctx.index.to(ctx.logps.device)].unsqueeze(1)
        log_ratio, ratio = ctx.log_ratio.expand(n, t), ctx.ratio.expand(n, t)
        score = log_ratio if o.score == "log_likelihood" else ratio
        kl = ratio - 1.0 - log_ratio
        mask = ctx.mask.to(ctx.logps.dtype)
        estimate = (kl.detach() * mask).sum() / mask.sum().clamp(min=1.0)
        excess = (estimate - o.delta).clamp(min=0.0)
        return -coef * score + o.penalty * excess.square() + 2.0 * o.penalty * excess * (kl - kl.detach())
