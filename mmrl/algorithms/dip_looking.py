"""DIP-R1's variance-guided looking reward: credit for inspecting the objects the group is unsure about."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

from mmrl.algorithms.base import RewardContext, Rewards, Variant, option, register
from mmrl.core.advantages import group_index

LOOKING = "dip_looking"


@dataclass
class DIPLookingOptions:
    tag: str = option("observe", "The block of the response that holds its observing step: the boxes written inside "
                                 "<tag>...</tag> are the regions it looked at.")
    iou_threshold: float = option(0.5, "An answer box finds a ground-truth object when their IoU is >= this.")
    coverage: float = option(0.5, "A looked-at region inspects an object when it covers at least this fraction of the "
                                  "object's box.")
    weight: float = option(0.5, "Advantage weight of the looking reward next to the configured rewards.")
    coord_format: str = option("", "The box format of the responses when a sample's metadata has none: qwen2, qwen25 "
                                    "or absolute; '' = the policy's (from its model type, as the box rewards).")

    def validate(self) -> None:
        if not re.fullmatch(r"[A-Za-z_][\w-]*", self.tag):
            raise ValueError(f"tag must be a tag name like 'observe', got {self.tag!r}")
        for name in ("iou_threshold", "coverage"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must lie in (0, 1], got {value}")
        if not self.weight >= 0 or not math.isfinite(self.weight):
            raise ValueError(f"weight must be a finite number >= 0, got {self.weight}")
        from mmrl.rewards.grounding import COORD_FORMATS

        if self.coord_format and self.coord_format not in COORD_FORMATS:
            raise ValueError(f"coord_format must be one of {COORD_FORMATS} or '', got {self.coord_format!r}")


def coverage_of(region, box) -> float:
    """The fraction of ``box``'s area inside ``region`` (0 for an empty box)."""
    w = min(region[2], box[2]) - max(region[0], box[0])
    h = min(region[3], box[3]) - max(region[1], box[1])
    area = (box[2] - box[0]) * (box[3] - box[1])
    return max(w, 0.0) * max(h, 0.0) / area if area > 0 else 0.0


def looking_rewards(found: list[list[bool] | None], looked: list[list[bool] | None], group_ids
                    ) -> tuple[Tensor, dict[str, float]]:
    """The looking reward ``[N]`` from, per response, which ground-truth objects its answer found (``found[i][k]``)
    and which its observing step inspected (``looked[i][k]``); ``None`` for a response that cannot be judged (NaN,
    left out of its group). Within a group (one prompt: the same objects), object ``k``'s detection rate over the
    judged responses is ``p_k`` and its variance ``v_k = p_k (1 - p_k)``: the objects the group is unsure about.

        looking_i = sum_k v_k * looked_i(k) / sum_k v_k        (0 when no object is uncertain: sum_k v_k = 0)

    ``stats``: ``uncertain_objects`` (mean per group of the objects with ``0 < p_k < 1``) and ``looked_share`` (mean
    fraction of a response's uncertain objects it inspected, over responses in groups with any)."""
    index, num_groups = group_index(group_ids)
    reward = torch.full((len(found),), float("nan"))
    members: list[list[int]] = [[] for _ in range(num_groups)]
    for i, g in enumerate(index.tolist()):
        if found[i] is not None and looked[i] is not None:
            members[g].append(i)
    uncertain, shares = [], []
    for rows in members:
        if not rows:
            continue
        n_objects = len(found[rows[0]])
        p = [sum(found[i][k] for i in rows) / len(rows) for k in range(n_objects)]
        v = [q * (1.0 - q) for q in p]
        total = sum(v)
        uncertain.append(sum(x > 0 for x in v))
        for i in rows:
            reward[i] = sum(vk for vk, seen in zip(v, looked[i]) if seen) / total if total > 0 else 0.0
            if total > 0:
                shares.append(sum(seen for vk, seen in zip(v, looked[i]) if vk > 0) / uncertain[-1])
    stats = {}
    if uncertain:
        stats["uncertain_objects"] = sum(uncertain) / len(uncertain)
    if shares:
        stats["looked_share"] = sum(shares) / len(shares)
    return reward, stats


@register
class DIPLooking(Variant):
    """DIP-R1's variance-guided looking reward, in the ``rewards`` stage (VLM box grounding and detection). DIP-R1
    (Park et al. 2025, arXiv 2505.23179) has the policy reason, then observe ("looking through interested but
    ambiguous regions"), then decide, and rewards the observing step with "a variance-guided looking reward ... to
    examine uncertain regions". The abstract gives no formula; mmrl's rule (:func:`looking_rewards`): the regions
    are the boxes the response writes inside ``<observe>...</observe>`` (``tag``), an object is uncertain as far as
    the group's answers disagree on finding it (variance ``p (1 - p)`` of its detection over the group, a box of the
    ``<answer>`` finding it at IoU >= ``iou_threshold``), and a response earns the variance-weighted share of the
    objects its regions inspect (cover at least ``coverage`` of the object's box), as the component ``dip_looking``
    with advantage weight ``weight``. DIP-R1's other two rewards are the format reward (write the three steps) and
    its weighted precision-recall accuracy (``box_weighted_pr``).

    Reads ``boxes`` (ground truth, original pixels) and the coordinate fields of each sample's metadata, as the box
    rewards do; a sample whose boxes cannot be read is NaN (left out of its group). A response without an
    ``<observe>`` block or without a readable answer box looked at / found nothing. Stats: ``dip/uncertain_objects``,
    ``dip/looked_share``."""

    name = "dip_looking"
    summary = "DIP-R1: reward observing the objects the group's answers disagree on (variance-guided looking)"
    paper = ("DIP-R1: Deep Inspection and Perception with RL Looking Through and Understanding Complex Scenes, Park et "
             "al. 2025, arXiv 2505.23179 (the variance, coverage and weighting rules are mmrl's)")
    Options = DIPLookingOptions
    families = ("vlm",)

    def rewards(self, ctx: RewardContext) -> Rewards:
        o, r = self.options, ctx.rollout
        fmt = o.coord_format or _policy_format(ctx.config)
        found, looked = [], []
        for text, meta in zip(r.completions, r.metadata):
            judged = self._judge(text, meta or {}, fmt)
            found.append(None if judged is None else judged[0])
            looked.append(None if judged is None else judged[1])
        reward, stats = looking_rewards(found, looked, r.group_ids)
        for key, value in stats.items():
            ctx.stats[f"dip/{key}"] = value
        return Rewards({**ctx.scores, LOOKING: reward}, {**ctx.weights, LOOKING: float(o.weight)})

    def _judge(self, text: Any, meta: Mapping, fmt: str | None) -> tuple[list[bool], list[bool]] | None:
        """``(found, looked)`` per ground-truth object, or None when the sample's metadata cannot be read."""
        from mmrl.rewards._text import Unjudgeable, Unparseable, answer_or_text
        from mmrl.rewards.grounding import _gt_boxes, box_iou, parse_boxes, rescale_box

        fmt = meta.get("coord_format") or fmt
        try:
            gt = _gt_boxes(meta, self.name)
            if fmt is None:
                return None
            to_pixels = lambda b: rescale_box(b, fmt, meta.get("image_size"), meta.get("input_size"))  # noqa: E731
            to_pixels([0, 0, 1, 1])  # the sizes the format needs are there
        except Unjudgeable:
            return None
        if not isinstance(text, str):
            return None

        def boxes(source: str) -> list[list[float]]:
            try:
                return [to_pixels(b) for b in parse_boxes(source)]
            except (Unparseable, Unjudgeable, ValueError):
                return []

        try:
            answer = boxes(answer_or_text(text, True))
        except Unparseable:
            answer = []
        tag = re.escape(self.options.tag)
        regions = [b for block in re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.DOTALL) for b in boxes(block)]
        found = [any(box_iou(a, g) >= self.options.iou_threshold for a in answer) for g in gt]
        looked = [any(coverage_of(q, g) >= self.options.coverage for q in regions) for g in gt]
        return found, looked


def _policy_format(config: Any) -> str | None:
    try:
        from mmrl.build import policy_coord_format

        return policy_coord_format(config)
    except Exception:  # a config without a Qwen-VL model type: samples then need their own coord_format
        return None
