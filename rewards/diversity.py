"""Set-level diversity reward with leave-one-out credit (SGRPO-style set-level GRPO).

GRPO scores each sample on its own, so nothing rewards a *group* of images for being varied. A set-level
reward scores the group as a whole and hands each sample its marginal contribution to that score:

    D(S)  = mean pairwise distance of the embeddings of the group S     (``set_score="mean_pairwise"``)
            (or the sum over pairs: ``"sum_pairwise"``)
    r_i   = D(S) - D(S \\ {i})                                            (leave-one-out contribution)

with ``d(a, b) = 1 - cos(a, b)`` (``distance="cosine"``, default) or ``||a - b||_2`` (``"euclidean"``) and
``D`` of a set with fewer than two members defined as 0. For ``mean_pairwise`` this is
``r_i = D(S) - (T - R_i) / C(n-1, 2)`` with ``T`` the sum over all pairs and ``R_i`` sample i's row sum:
a sample far from the others raises the mean when present (positive credit), a near-duplicate lowers
it (negative credit). For ``sum_pairwise``, ``r_i = R_i`` (the graph-cut form: total distance to the
others). Extra keys: ``"group_score"`` (``D(S)`` of the sample's group) and ``"mean_distance"`` (mean
distance to the other members).

Provenance: the leave-one-out redistribution of a set-level score is the rule named for SGRPO in
mmrl's issue; the SGRPO paper's own text was not available to check its exact set function, so both the
set function and the distance are options here (SetPO, Li et al. 2026, arXiv:2602.01062, uses the same
leave-one-out marginal contribution of a kernel-similarity set diversity for LLM reasoning).

Groups: ``metadata[i]["group"]`` when every sample has one; else consecutive blocks of ``group_size``
(when given); else samples sharing a prompt (a GRPO group is the images of one prompt); else the whole
batch. A group with a single judgeable member cannot be scored (NaN with the reason), and samples that
cannot be judged (bad pixels) are left out of their group's set. Note: the trainer scores a rollout in
chunks of ``train.reward_batch_size``; a group must not straddle two chunks (make the chunk a multiple
of the group size).

Embeddings: any image encoder callable ``encoder(pil_images) -> [N, D]`` tensor; by default DINOv2
(:class:`~mmrl.rewards.reference.DinoEmbedder`, ``facebook/dinov2-base`` CLS embedding); a string is
taken as a DINOv2 hub id / local directory.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch

from ._base import ImageBatch, Reward, register_reward

__all__ = ["SetDiversity", "pairwise_distances", "leave_one_out_credit"]


def pairwise_distances(embeddings: torch.Tensor, distance: str = "cosine") -> torch.Tensor:
    """``[n, D]`` -> ``[n, n]`` distances (zero diagonal), float32."""
    x = embeddings.float()
    if distance == "cosine":
        x = torch.nn.functional.normalize(x, dim=-1)
        d = 1.0 - x @ x.T
    elif distance == "euclidean":
        d = torch.cdist(x, x)
    else:
        raise ValueError(f"distance must be 'cosine' or 'euclidean', got {distance!r}")
    d = d.clamp_min(0.0)
    d.fill_diagonal_(0.0)
    return d


def leave_one_out_credit(dist: torch.Tensor, set_score: str = "mean_pairwise") -> tuple[torch.Tensor, float]:
    """Per member ``D(S) - D(S \\ {i})`` and ``D(S)`` for a group's ``[n, n]`` distance matrix."""
    n = dist.shape[0]
    if set_score not in ("mean_pairwise", "sum_pairwise"):
        raise ValueError(f"set_score must be 'mean_pairwise' or 'sum_pairwise', got {set_score!r}")
    total = dist.triu(1).sum()
    rows = dist.sum(dim=1)
    if set_score == "sum_pairwise":
        return rows.clone(), float(total)
    pairs = n * (n - 1) / 2
    score = total / pairs if pairs else total.new_zeros(())
    pairs_without = (n - 1) * (n - 2) / 2
    without = (total - rows) / pairs_without if pairs_without else torch.zeros_like(rows)
    return score - without, float(score)


@register_reward("set_diversity")
class SetDiversity(Reward):
    """Set-level diversity redistributed by leave-one-out contribution; see the module docstring."""

    needs_prompts = False

    def __init__(
        self,
        encoder: str | os.PathLike | torch.nn.Module | Callable | None = None,
        processor: Any = None,
        group_size: int | None = None,
        set_score: str = "mean_pairwise",
        distance: str = "cosine",
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 32,
    ):
        """Args:
        encoder: ``None`` (DINOv2 ``facebook/dinov2-base``), a DINOv2 hub id / local directory, a built
            ``Dinov2Model``, or any callable ``(pil_images) -> [N, D]`` embeddings (e.g. a
            :class:`~mmrl.rewards.reference.DinoEmbedder`, or a CLIP image tower wrapped as such).
        processor: image processor for a DINOv2 model (default: its own / DINOv2's standard).
        group_size: consecutive block size when metadata carries no ``group``.
        set_score: ``"mean_pairwise"`` (default) or ``"sum_pairwise"``.
        distance: ``"cosine"`` (``1 - cos``, default) or ``"euclidean"``.
        device, dtype, batch_size: for the default DINOv2 encoder.
        """
        super().__init__()
        if set_score not in ("mean_pairwise", "sum_pairwise"):
            raise ValueError(f"set_score must be 'mean_pairwise' or 'sum_pairwise', got {set_score!r}")
        if distance not in ("cosine", "euclidean"):
            raise ValueError(f"distance must be 'cosine' or 'euclidean', got {distance!r}")
        if group_size is not None and int(group_size) < 2:
            raise ValueError(f"group_size must be at least 2, got {group_size}")
        if encoder is None or isinstance(encoder, (str, os.PathLike, torch.nn.Module)):
            from .reference import DEFAULT_DINO, DinoEmbedder

            encoder = DinoEmbedder(DEFAULT_DINO if encoder is None else encoder, processor, device=device,
                                   dtype=dtype, batch_size=batch_size)
        elif not callable(encoder):
            raise TypeError(f"encoder must be a model, a hub id / directory or a callable, "
                            f"got {type(encoder).__name__}")
        self.encoder = encoder
        self.group_size = None if group_size is None else int(group_size)
        self.set_score = set_score
        self.distance = distance

    def groups(self, batch: ImageBatch) -> list[Any]:
        """The group key of every sample (see the module docstring for the order of the rules)."""
        n = batch.n
        meta = batch.metadata
        if meta is not None and all(isinstance(m, dict) and "group" in m for m in meta):
            keys = []
            for m in meta:
                g = m["group"]
                keys.append(("group", g.item() if isinstance(g, torch.Tensor) else g))
            return keys
        if self.group_size is not None:
            if n % self.group_size:
                raise ValueError(f"got {n} samples, not a multiple of group_size={self.group_size}")
            return [("block", i // self.group_size) for i in range(n)]
        if batch.prompts is not None:
            return [("prompt", p if isinstance(p, str) else repr(p)) for p in batch.prompts]
        return [("batch", 0)] * n

    @torch.inference_mode()
    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        valid = batch.valid_indices
        keys = self.groups(batch)
        credit = torch.full((len(valid),), float("nan"))
        group_score = torch.full((len(valid),), float("nan"))
        mean_dist = torch.full((len(valid),), float("nan"))
        members: dict[Any, list[int]] = {}
        for pos, i in enumerate(valid):
            try:
                hash(keys[i])
            except TypeError:
                reasons[i] = f"metadata 'group' is not hashable: {keys[i][1]!r}"
                continue
            members.setdefault(keys[i], []).append(pos)
        usable = [pos for ps in members.values() if len(ps) >= 2 for pos in ps]
        for ps in members.values():
            if len(ps) < 2:
                reasons[valid[ps[0]]] = "its group has no other judgeable member: set diversity needs two or more"
        if not usable:
            return {self.name: credit, "group_score": group_score, "mean_distance": mean_dist}
        pils = batch.pil()
        emb = torch.as_tensor(self.encoder([pils[p] for p in usable])).float().cpu()
        if emb.dim() != 2 or emb.shape[0] != len(usable):
            raise RuntimeError(f"the encoder returned shape {tuple(emb.shape)}, expected [{len(usable)}, D]")
        row = {p: r for r, p in enumerate(usable)}
        for ps in members.values():
            if len(ps) < 2:
                continue
            e = emb[[row[p] for p in ps]]
            finite = torch.isfinite(e).all(dim=1)
            if not finite.all():
                for p, ok in zip(ps, finite.tolist()):
                    if not ok:
                        reasons[valid[p]] = "the encoder returned a non-finite embedding"
                ps = [p for p, ok in zip(ps, finite.tolist()) if ok]
                e = e[finite]
                if len(ps) < 2:
                    for p in ps:
                        reasons[valid[p]] = "its group has no other judgeable member: set diversity needs two or more"
                    continue
            d = pairwise_distances(e, self.distance)
            c, s = leave_one_out_credit(d, self.set_score)
            index = torch.tensor(ps)
            credit[index] = c
            group_score[index] = s if math.isfinite(s) else float("nan")
            mean_dist[index] = d.sum(dim=1) / (len(ps) - 1)
        return {self.name: credit, "group_score": group_score, "mean_distance": mean_dist}
