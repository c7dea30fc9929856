"""Grounding rewards: boxes (single and multi-object) and temporal spans, for vision-language policies.

All geometry is on continuous coordinates. A box is ``[x1, y1, x2, y2]``; one with ``x2 <= x1`` or
``y2 <= y1`` (reversed or empty) is invalid and never scores (the anchors differ here; mmrl follows
REFERENCE.md section 7). A span is ``[start, end]`` in seconds; a reversed or empty span scores 0.

Reading boxes from an answer (:func:`parse_boxes`, then :func:`rescale_box` into ORIGINAL image pixels):

* JSON, as Qwen2.5-VL writes it: ``[{"bbox_2d": [x1, y1, x2, y2], "label": "cat"}, ...]`` (also the keys
  ``bbox``, ``box``, ``box_2d``; a bare ``[x1, y1, x2, y2]``; a list of such lists; code fences ignored);
* Qwen2-VL's native ``<|box_start|>(x1,y1),(x2,y2)<|box_end|>``;
* otherwise every ``[x1, y1, x2, y2]`` in the text;
* ``[]``, ``none``, ``null``, ``no object``: an explicit empty prediction (the set rewards score it).

In a JSON list of boxes, an item meant as a box but malformed (``{"bbox_2d": [1, 2, 3]}``, a NaN, a string) is a
prediction that matches nothing (a box of NaNs, IoU 0), as VLM-R1's ``detection_score`` counts every item; a list
with no readable box at all is unparseable.

Coordinate formats (``coord_format``, per sample from metadata, else the reward's default):

* ``"qwen2"``: [0, 1000) normalised units, what Qwen2-VL and Qwen3-VL answer in: ``x_abs = x / 1000 * W``,
  ``y_abs = y / 1000 * H`` with ``image_size = [W, H]`` (Qwen3-VL: "relative coordinates ranging from 0 to
  1000", QwenLM/Qwen3-VL ``cookbooks/2d_grounding.ipynb``);
* ``"qwen25"``: Qwen2.5-VL's absolute pixels of the resized model input: ``x_abs = x * W / W_in``,
  ``y_abs = y * H / H_in`` with ``input_size = [W_in, H_in]`` (= ``grid_w * 14, grid_h * 14``);
* ``"absolute"``: already original pixels (only when configured or written in the metadata: never assumed).

There is no silent default: a box reward built without ``coord_format`` scores a sample whose metadata has no
``coord_format`` NaN, with a reason naming ``coord_format``. ``mmrl.build.build_reward_fn`` sets the reward-level
default from the policy's model type (:data:`QWEN_COORD_FORMATS`, :func:`with_coord_format`) for
``model.family: qwen_vl``, so a config only has to name it for other models.

Metadata read here: ``boxes`` (ground truth in original pixels; ``[]`` is a valid "nothing there" for
the multi-object rewards), ``labels`` (``box_detection_score``: one class name per box), ``image_size``, ``input_size``, ``coord_format``, ``salience``,
``timestamps``, ``duration``, ``solution``, ``choices``.

Registered rewards and their keyword arguments (all also take ``require_tags=True``; the box rewards
``coord_format=None``, the format of samples whose metadata has none; ``None`` = no default, such samples are NaN):

=====================  ======================================================  ================================
name                   kwargs                                                  extra keys
=====================  ======================================================  ================================
``iou``                (none)                                                  ``acc@0.5`` (IoU > 0.5, strict)
``box_coordinate``     ``coordinate`` (x1 / y1 / x2 / y2), ``tolerance=0.25``,    (none); reports the spans of the
                       ``reasoning=True``                                      coordinate's characters
``box_f1``             ``iou_threshold=0.5, spam_penalty=False``               ``precision``, ``recall``
``box_matched_iou``    ``iou_threshold=0.5, iou_weight=0.5, spam_penalty=True``  ``mean_iou``, ``completeness``
``box_detection_score`` ``iou_threshold=0.5, alpha=0.7, beta=0.0, gamma=0.3``  ``position``, ``label_accuracy``,
                       (VLM-R1's ``weighted_sum``)                             ``completeness``
``box_weighted_pr``    ``iou_threshold=0.5, precision_weight=0.5,              ``precision``, ``recall``
                       spam_penalty=False`` (DIP-R1)
``box_set_f1``         ``iou_thresholds=(0.5, 0.55, ..., 0.95)`` (Falcon)       ``f1@0.5``
``box_salience_iou``   ``spam_penalty=True`` (GRiP)                            (none)
``temporal_iou``       ``time_unit="seconds"``                                 ``r1@0.3``, ``r1@0.5``, ``r1@0.7``
``temporal_dual``      ``time_unit="seconds"`` (Temporal-R1 / Temporal-RLT)     ``semantic``, ``temporal``
=====================  ======================================================  ================================
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ._base import register_reward
from ._text import ANSWER_BLOCK, THINK_BLOCK, TextReward, Unjudgeable, Unparseable, answer_or_text, require
from .answer import _PREFIX, _WHOLE_LETTER, _choices, _solution_text, parse_choice

__all__ = [
    "COORD_FORMATS",
    "QWEN_COORD_FORMATS",
    "takes_coord_format",
    "with_coord_format",
    "box_iou",
    "valid_box",
    "parse_boxes",
    "parse_vlm_r1_box",
    "parse_time_r1_span",
    "vlm_r1_iou",
    "vlm_r1_clean_text",
    "vlm_r1_detection_score",
    "rescale_box",
    "iou_matrix",
    "match_boxes",
    "spam_penalty",
    "box_f1",
    "matched_iou_completeness",
    "weighted_precision_recall",
    "set_f1",
    "salience_weighted_iou",
    "temporal_iou",
    "parse_timestamps",
    "parse_timezero_span",
    "recall_at",
    "mean_iou",
    "BoxIoU",
    "BoxCoordinate",
    "coordinate_spans",
    "BoxF1",
    "BoxMatchedIoU",
    "BoxWeightedPR",
    "BoxSetF1",
    "BoxSalienceIoU",
    "TemporalIoU",
    "TemporalDual",
]

COORD_FORMATS = ("qwen2", "qwen25", "absolute")
#: transformers ``config.model_type`` of a Qwen-VL checkpoint -> the coordinates its boxes are written in:
#: Qwen2-VL [0, 1000) normalised; Qwen2.5-VL absolute pixels of the resized input; Qwen3-VL (dense and MoE)
#: back to [0, 1000) normalised ("Qwen3-VL's default coordinate system has been changed from the absolute
#: coordinates used in Qwen2.5-VL to relative coordinates ranging from 0 to 1000", QwenLM/Qwen3-VL
#: ``cookbooks/2d_grounding.ipynb``).
QWEN_COORD_FORMATS = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen25", "qwen3_vl": "qwen2", "qwen3_vl_moe": "qwen2"}
FALCON_IOU_THRESHOLDS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)


# --------------------------------------------------------------------------------------------
# Box geometry
# --------------------------------------------------------------------------------------------


def _as_box(box: Any) -> tuple[float, float, float, float] | None:
    """Four finite floats, or None."""
    if isinstance(box, (str, bytes, Mapping)) or not isinstance(box, Iterable):
        return None
    try:
        values = tuple(float(v) for v in box)
    except (TypeError, ValueError, OverflowError):
        return None
    if len(values) != 4 or not all(math.isfinite(v) for v in values):
        return None
    return values  # type: ignore[return-value]


def valid_box(box: Any) -> bool:
    """True for four finite numbers with ``x2 > x1`` and ``y2 > y1``."""
    b = _as_box(box)
    return b is not None and b[2] > b[0] and b[3] > b[1]


def _intersection(a: Sequence[float], b: Sequence[float]) -> float:
    """Area shared by two ``[x1, y1, x2, y2]`` boxes (0 when they are apart or only touch)."""
    return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))


def box_iou(pred: Sequence[float], gt: Sequence[float]) -> float:
    """Intersection over union of two ``[x1, y1, x2, y2]`` boxes on continuous coordinates.

    An invalid box (not four finite numbers, ``x2 <= x1`` or ``y2 <= y1``) scores 0; boxes that only
    touch (a shared edge or corner) have zero intersection and score 0. No ``+1`` pixel convention.
    """
    p, g = _as_box(pred), _as_box(gt)
    if p is None or g is None or not (p[2] > p[0] and p[3] > p[1] and g[2] > g[0] and g[3] > g[1]):
        return 0.0
    inter = _intersection(p, g)
    if inter == 0:
        return 0.0
    union = (p[2] - p[0]) * (p[3] - p[1]) + (g[2] - g[0]) * (g[3] - g[1]) - inter
    return inter / union


def iou_matrix(pred: Sequence[Sequence[float]], gt: Sequence[Sequence[float]]) -> np.ndarray:
    """``[len(pred), len(gt)]`` float64 matrix of :func:`box_iou`."""
    out = np.zeros((len(pred), len(gt)), dtype=np.float64)
    for i, p in enumerate(pred):
        for j, g in enumerate(gt):
            out[i, j] = box_iou(p, g)
    return out


def match_boxes(
    pred: Sequence[Sequence[float]],
    gt: Sequence[Sequence[float]],
    iou_threshold: float = 0.5,
    *,
    weights: Sequence[float] | None = None,
    mask_below_threshold: bool = True,
) -> list[tuple[int, int, float]]:
    """One-to-one matching of predictions to ground truth: ``[(pred_index, gt_index, iou), ...]``.

    Hungarian assignment (``scipy.optimize.linear_sum_assignment``) maximising the total IoU (times the
    ground-truth ``weights`` when given); pairs with IoU below ``iou_threshold`` are dropped. With
    ``mask_below_threshold`` (default) such pairs are worth 0 in the assignment and every pair at or above the
    threshold is worth a bonus larger than any total of IoUs, so the assignment counts as many matches above the
    threshold as possible and, among those, maximises the matched IoU (greedy highest-IoU-first matching does
    not; maximising the IoU sum alone missed a match in a chain of overlapping boxes: 3 of 4 matched where 4
    can be). ``mask_below_threshold=False`` is plain Hungarian on IoU (what Falcon-Perception's evaluation
    does).
    """
    if len(pred) == 0 or len(gt) == 0:
        return []
    from scipy.optimize import linear_sum_assignment

    ious = iou_matrix(pred, gt)
    value = ious.copy()
    if weights is not None:
        value = value * np.asarray(weights, dtype=np.float64)[None, :]
    if mask_below_threshold:  # every counting pair first worth more than any total of IoUs: most matches, then IoU
        bonus = min(len(pred), len(gt)) * max(1.0, float(np.max(value, initial=0.0))) + 1.0
        value = np.where(ious >= iou_threshold, bonus + value, 0.0)
    rows, cols = linear_sum_assignment(value, maximize=True)
    return [(int(i), int(j), float(ious[i, j])) for i, j in zip(rows, cols) if ious[i, j] >= iou_threshold]


def spam_penalty(n_pred: int, n_gt: int) -> float:
    """VLM-R1's box-spam penalty ``min(1, #gt / #pred)`` (1 when nothing was predicted).

    Shen et al., "VLM-R1: A Stable and Generalizable R1-style Large Vision-Language Model"
    (arXiv:2504.07615), open-vocabulary detection reward: the per-sample score is multiplied by it, so
    predicting more boxes than there are objects cannot pay.
    """
    return 1.0 if n_pred <= 0 else min(1.0, n_gt / n_pred)


def _presence(n_pred: int, n_gt: int) -> float | None:
    """1 when both sets are empty (a correct "nothing there"), 0 when exactly one is, else None."""
    if n_pred == 0 and n_gt == 0:
        return 1.0
    if n_pred == 0 or n_gt == 0:
        return 0.0
    return None


def box_f1(pred, gt, iou_threshold: float = 0.5) -> dict[str, float]:
    """F1 of the one-to-one matching at ``IoU >= iou_threshold`` (:func:`match_boxes`).

    ``precision = TP / #pred``, ``recall = TP / #gt``, ``f1 = 2·TP / (#pred + #gt)``. Both empty: all 1;
    exactly one empty: all 0. Returns ``{"f1", "precision", "recall", "tp"}``.
    """
    n_pred, n_gt = len(pred), len(gt)
    empty = _presence(n_pred, n_gt)
    if empty is not None:
        return {"f1": empty, "precision": empty, "recall": empty, "tp": 0.0}
    tp = len(match_boxes(pred, gt, iou_threshold))
    return {"f1": 2 * tp / (n_pred + n_gt), "precision": tp / n_pred, "recall": tp / n_gt, "tp": float(tp)}


def matched_iou_completeness(pred, gt, iou_threshold: float = 0.5, iou_weight: float = 0.5) -> dict[str, float]:
    """Weighted sum of how well the matched boxes fit and how many objects were found.

    ``mean_iou`` = mean IoU over the one-to-one matches at ``IoU >= iou_threshold`` (0 without a match),
    ``completeness`` = ``#matched / #gt`` (recall), ``score = iou_weight * mean_iou + (1 - iou_weight) *
    completeness`` (REFERENCE.md section 7: "a weighted sum of matched IoU and completeness"; this form is
    mmrl's own: VLM-R1's reward of that description is :func:`vlm_r1_detection_score`, the ``box_detection_score``
    reward). Extra boxes cost nothing here, so the registered reward applies :func:`spam_penalty` by default.
    Both empty: 1; exactly one empty: 0.
    """
    empty = _presence(len(pred), len(gt))
    if empty is not None:
        return {"score": empty, "mean_iou": empty, "completeness": empty}
    matches = match_boxes(pred, gt, iou_threshold)
    mean = sum(m[2] for m in matches) / len(matches) if matches else 0.0
    completeness = len(matches) / len(gt)
    return {"score": iou_weight * mean + (1 - iou_weight) * completeness, "mean_iou": mean, "completeness": completeness}


def vlm_r1_clean_text(text: str) -> str:
    """VLM-R1's ``clean_text`` (``src/open-r1-multimodal/src/open_r1/grpo_jsonl.py``): the LAST ``<answer>`` block
    if there is one (else the whole text), a newline after whitespace removed and any other one made a space,
    stripped, one trailing ``.`` removed, lower-cased."""
    blocks = _VLM_R1_ANSWER.findall(text)
    if blocks:
        text = blocks[-1]
    for char in ("\n", "\r"):
        text = re.sub(r"(?<=\s)" + re.escape(char), "", text)
        text = re.sub(r"(?<!\s)" + re.escape(char), " ", text)
    return text.strip().rstrip(".").lower()


def vlm_r1_detection_score(pred: Sequence[tuple[Sequence[float] | None, str | None]],
                           gt: Sequence[tuple[Sequence[float], str | None]], iou_threshold: float = 0.5,
                           alpha: float = 0.7, beta: float = 0.0, gamma: float = 0.3) -> dict[str, float]:
    """VLM-R1's multi-object detection reward (``grpo_jsonl.py`` ``detection_score``, its ``weighted_sum``
    accuracy reward for open-vocabulary detection), as written.

    ``pred`` / ``gt``: ``(box, label)`` pairs (a predicted box that cannot be read is ``None``: IoU 0; a ``None``
    ground-truth label is not checked, mmrl's rule for data without class names). Greedy matching: repeatedly the
    unmatched pair of highest :func:`vlm_r1_iou` (the first in prediction-major order on ties), until it falls
    below ``iou_threshold``; a matched pair whose labels differ (lower-cased) counts IoU 0. ``position = sum of
    matched IoU / #gt``, ``label_accuracy = #matches with the right label / #gt``, ``completeness = 1 - (miss rate
    + false-alarm rate) / 2`` with ``miss = unmatched gt / #gt`` and ``false alarm = unmatched predictions /
    #pred``; ``score = (alpha position + beta label_accuracy + gamma completeness) / (alpha + beta + gamma)``.
    No ground truth: 1 without predictions, else 0; predictions missing: 0."""
    if not gt:
        value = 1.0 if not pred else 0.0
        return {"score": value, "position": value, "label_accuracy": value, "completeness": value}
    if not pred:
        return {"score": 0.0, "position": 0.0, "label_accuracy": 0.0, "completeness": 0.0}
    ious = [[vlm_r1_iou(p, g) if p is not None else 0.0 for g, _ in gt] for p, _ in pred]
    free_pred, free_gt = list(range(len(pred))), list(range(len(gt)))
    matched: list[tuple[float, bool]] = []
    while free_pred and free_gt:
        best, bi, bj = -1.0, -1, -1
        for i in free_pred:
            for j in free_gt:
                if ious[i][j] > best:
                    best, bi, bj = ious[i][j], i, j
        if best < iou_threshold:
            break
        want = gt[bj][1]
        right = want is None or (pred[bi][1] or "").lower() == want.lower()
        matched.append((best if right else 0.0, right))
        free_pred.remove(bi)
        free_gt.remove(bj)
    position = sum(v for v, _ in matched) / len(gt) if matched else 0.0
    label_accuracy = sum(1.0 for _, ok in matched if ok) / len(gt) if matched else 0.0
    completeness = 1.0 - (len(free_gt) / len(gt) + len(free_pred) / len(pred)) / 2.0
    score = (alpha * position + beta * label_accuracy + gamma * completeness) / (alpha + beta + gamma)
    return {"score": score, "position": position, "label_accuracy": label_accuracy, "completeness": completeness}


def weighted_precision_recall(pred, gt, iou_threshold: float = 0.5, precision_weight: float = 0.5) -> dict[str, float]:
    """DIP-R1's weighted precision-recall accuracy reward (closest documented rule, see below).

    Park et al., "DIP-R1: Deep Inspection and Perception with RL Looking Through and Understanding
    Complex Scenes" (arXiv:2505.23179) reward decision-making with "a weighted precision-recall accuracy
    reward" for crowded-scene detection. The exact formula was not available to us; mmrl implements
    ``score = w·P + (1 - w)·R`` with ``P = TP / #pred``, ``R = TP / #gt`` from the one-to-one matching at
    ``IoU >= iou_threshold`` and ``w = precision_weight``. Both empty: 1; exactly one empty: 0.
    """
    f = box_f1(pred, gt, iou_threshold)
    empty = _presence(len(pred), len(gt))
    score = empty if empty is not None else precision_weight * f["precision"] + (1 - precision_weight) * f["recall"]
    return {"score": score, "precision": f["precision"], "recall": f["recall"]}


def set_f1(pred, gt, iou_thresholds: Sequence[float] = FALCON_IOU_THRESHOLDS) -> dict[str, float]:
    """Falcon-Perception's set-level F1, averaged over IoU thresholds.

    Mirrors ``sample_f1`` in Falcon-Perception's ``eval/metrics.py`` (PBench; Bevli et al., "Falcon
    Perception", arXiv:2603.27365) on boxes: Hungarian matching on IoU over the whole matrix (no
    masking), then at each threshold ``t`` the matches with ``IoU >= t`` are true positives and
    ``F1_t = 2·TP / (#pred + #gt)``; the score is the mean over ``iou_thresholds`` (0.5:0.05:0.95 by
    default; PBench's dense split uses ``(0.5,)``). Falcon drops the image-level cases from F1 and
    reports them as presence counts; as a reward mmrl scores a correct empty answer to an empty ground
    truth 1 and any other empty side 0. Their ``1e-8`` guards are omitted (identical to ~1e-8).
    Returns ``{"f1", "f1@0.5"}`` (``f1@0.5``: the F1 at IoU 0.5 alone).
    """
    n_pred, n_gt = len(pred), len(gt)
    empty = _presence(n_pred, n_gt)
    if empty is not None:
        return {"f1": empty, "f1@0.5": empty}
    matched = [m[2] for m in match_boxes(pred, gt, 0.0, mask_below_threshold=False)]

    def f1_at(t: float) -> float:
        tp = sum(1 for v in matched if v >= t)
        return 2 * tp / (n_pred + n_gt)

    return {"f1": float(np.mean([f1_at(t) for t in iou_thresholds])), "f1@0.5": f1_at(0.5)}


def salience_weighted_iou(pred, gt, weights: Sequence[float] | None = None) -> float:
    """GRiP's salience-weighted IoU (closest documented rule, see below).

    Wei et al., "Guiding the Inner Eye: A Framework for Hierarchical and Flexible Visual Grounded
    Reasoning" (GRiP, arXiv:2511.22172) reward localisation with a Salience-Weighted IoU that favours
    mission-critical objects over distractors; its exact formula was not available to us. mmrl
    implements: each ground-truth box ``j`` carries a salience weight ``w_j >= 0`` (metadata
    ``salience``; uniform when absent); predictions are matched one-to-one to maximise ``Σ_j w_j·IoU``
    (Hungarian, no threshold) and ``score = Σ_j w_j·IoU_j / Σ_j w_j`` with ``IoU_j = 0`` for an
    unmatched ground truth. Both empty: 1; exactly one empty: 0.
    """
    empty = _presence(len(pred), len(gt))
    if empty is not None:
        return empty
    w = np.ones(len(gt)) if weights is None else np.asarray(weights, dtype=np.float64)
    total = float(w.sum())
    if total <= 0:
        raise ValueError("salience weights sum to zero")
    matches = match_boxes(pred, gt, 0.0, weights=w, mask_below_threshold=False)
    return sum(w[j] * iou for _, j, iou in matches) / total


# --------------------------------------------------------------------------------------------
# Parsing boxes
# --------------------------------------------------------------------------------------------

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_BARE = re.compile(rf"\[\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*\]")
_QWEN2 = re.compile(rf"\(\s*({_NUM})\s*,\s*({_NUM})\s*\)\s*,?\s*\(\s*({_NUM})\s*,\s*({_NUM})\s*\)")
_FENCE = re.compile(r"```(?:json|JSON)?")
_EMPTY = {"[]", "none", "null", "no object", "no objects", "nothing", "no box", "no boxes"}
_BOX_KEYS = ("bbox_2d", "bbox", "box_2d", "box")


def _boxes_from_json(obj: Any) -> list[list[float]] | None:
    """Boxes found in a parsed JSON value, or None if it holds no box at all (``[]`` gives [])."""
    box = _as_box(obj) if isinstance(obj, list) and len(obj) == 4 else None
    if box is not None:
        return [list(box)]
    if isinstance(obj, Mapping):
        for key in _BOX_KEYS:
            if key in obj:
                b = _as_box(obj[key])
                return [list(b)] if b is not None else None
        return None
    if isinstance(obj, list):
        if not obj:
            return []
        found: list[list[float]] = []
        any_box = False
        for item in obj:
            sub = _boxes_from_json(item)
            if sub is not None:
                any_box = True
                found.extend(sub)
            elif _box_attempt(item):  # a prediction all the same: it matches nothing (never dropped, so a list
                found.append([math.nan] * 4)  # of boxes cannot hide its wrong items from precision or the penalty)
        return found if any_box else None
    return None


def _box_attempt(item: Any) -> bool:
    """Whether a list item that is no box was meant as one: a mapping with a box key (``{"bbox_2d": [1, 2, 3]}``) or a
    flat list of scalars (``[1, 2, 3]``, ``[NaN, 0, 5, 5]``)."""
    if isinstance(item, Mapping):
        return any(key in item for key in _BOX_KEYS)
    return isinstance(item, list) and bool(item) and not any(isinstance(v, (list, dict)) for v in item)


def _json_candidates(text: str) -> list[Any]:
    out = []
    for candidate in (text, text[_first(text, "[{"): _last(text, "]}") + 1]):
        if not candidate:
            continue
        try:
            out.append(json.loads(candidate))
        except (ValueError, TypeError):
            continue
    return out


def _first(text: str, chars: str) -> int:
    idx = [text.find(c) for c in chars if c in text]
    return min(idx) if idx else len(text)


def _last(text: str, chars: str) -> int:
    idx = [text.rfind(c) for c in chars if c in text]
    return max(idx) if idx else -1


def parse_boxes(answer: str) -> list[list[float]]:
    """Boxes written in an answer, in the answer's own coordinates, in order.

    See the module docstring for the accepted forms. An explicit empty answer (``[]``, ``none``...)
    gives ``[]``; an answer with nothing box-like raises :class:`~mmrl.rewards._text.Unparseable`.
    Reversed boxes are kept as written (they score 0 later), not repaired.
    """
    if not isinstance(answer, str):
        raise Unparseable(f"answer is not text (got {type(answer).__name__})")
    text = _FENCE.sub("", answer).strip()
    if text.lower().rstrip(".") in _EMPTY:
        return []
    for obj in _json_candidates(text):
        boxes = _boxes_from_json(obj)
        if boxes is not None:
            return boxes
    qwen2 = [[float(v) for v in m.groups()] for m in _QWEN2.finditer(text)]
    if qwen2:
        return qwen2
    bare = [[float(v) for v in m.groups()] for m in _BARE.finditer(text)]
    if bare:
        return bare
    raise Unparseable("no box in the answer")


_VLM_R1_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_VLM_R1_TRAIN_BOX = re.compile(r"\[(\d+),\s*(\d+),\s*(\d+),\s*(\d+)]")
_VLM_R1_BOX = re.compile(r"\{.*\[(\d+),\s*(\d+),\s*(\d+),\s*(\d+)]\s*.*\}", re.DOTALL)


def parse_vlm_r1_box(text: str, training: bool = False) -> list[float]:
    """The box VLM-R1's REC evaluation reads (``src/eval/test_rec_r1.py`` ``extract_bbox_answer``): the first
    ``<answer>...</answer>`` block, stripped, then its greedy ``{.*[a, b, c, d] .*}`` regex: four whole numbers in
    brackets inside braces, the last such list when there are several (the leading ``.*`` is greedy). Where the
    official code returns ``[0, 0, 0, 0]`` (no answer block, no such box) this raises
    :class:`~mmrl.rewards._text.Unparseable`, which scores the same (IoU 0, wrong). ``training=True``: its training
    ``iou_reward`` (``qwen_module.py``) instead, the block's first ``[a, b, c, d]`` of whole numbers, no braces."""
    if not isinstance(text, str):
        raise Unparseable(f"answer is not text (got {type(text).__name__})")
    block = _VLM_R1_ANSWER.search(text)
    if block is None:
        raise Unparseable("no <answer>...</answer> block")
    box = (_VLM_R1_TRAIN_BOX if training else _VLM_R1_BOX).search(block.group(1).strip())
    if box is None:
        raise Unparseable("no [x1, y1, x2, y2] of whole numbers in the first answer block" if training else
                          "no '{... [x1, y1, x2, y2] ...}' box of whole numbers in the answer")
    return [float(v) for v in box.groups()]


def vlm_r1_iou(pred: Sequence[float], gt: Sequence[float]) -> float:
    """VLM-R1's REC IoU (``src/eval/test_rec_r1.py`` ``iou``), as written: the intersection on inclusive pixels,
    ``(min(x2) - 1) - max(x1) + 1`` per side when ``max(x1) < min(x2) - 1`` (so an overlap of at most 1 px counts
    0), over the union of the continuous areas. A non-positive union (degenerate boxes) gives 0."""
    p, g = [float(v) for v in pred], [float(v) for v in gt]
    x1, y1 = max(p[0], g[0]), max(p[1], g[1])
    x2, y2 = min(p[2] - 1, g[2] - 1), min(p[3] - 1, g[3] - 1)
    inter = (x2 - x1 + 1) * (y2 - y1 + 1) if x1 < x2 and y1 < y2 else 0.0
    union = (p[2] - p[0]) * (p[3] - p[1]) + (g[2] - g[0]) * (g[3] - g[1]) - inter
    return float(inter) / union if union > 0 else 0.0


def _size(value: Any, key: str) -> tuple[float, float]:
    try:
        w, h = (float(v) for v in value)
    except (TypeError, ValueError, OverflowError):
        raise Unjudgeable(f"metadata {key!r} must be [W, H], got {value!r}") from None
    if not (w > 0 and h > 0 and math.isfinite(w) and math.isfinite(h)):
        raise Unjudgeable(f"metadata {key!r} must be positive [W, H], got {value!r}")
    return w, h


def rescale_box(
    box: Sequence[float],
    coord_format: str,
    image_size: Sequence[float] | None = None,
    input_size: Sequence[float] | None = None,
) -> list[float]:
    """A box from the model's coordinates to ORIGINAL image pixels (see the module docstring).

    ``qwen2`` needs ``image_size``; ``qwen25`` needs ``image_size`` and ``input_size``; ``absolute``
    needs neither. Raises :class:`~mmrl.rewards._text.Unjudgeable` when a size is missing or wrong.
    """
    if coord_format == "absolute":
        return [float(v) for v in box]
    if coord_format not in COORD_FORMATS:
        raise Unjudgeable(f"unknown coord_format {coord_format!r}; expected one of {COORD_FORMATS}")
    if image_size is None:
        raise Unjudgeable(f"metadata has no 'image_size' (needed to rescale {coord_format} boxes)")
    w, h = _size(image_size, "image_size")
    if coord_format == "qwen2":
        sx, sy = w / 1000.0, h / 1000.0
    else:
        if input_size is None:
            raise Unjudgeable("metadata has no 'input_size' (needed to rescale qwen25 boxes)")
        win, hin = _size(input_size, "input_size")
        sx, sy = w / win, h / hin
    x1, y1, x2, y2 = (float(v) for v in box)
    return [x1 * sx, y1 * sy, x2 * sx, y2 * sy]


def _gt_boxes(meta: Mapping, reward: str) -> list[list[float]]:
    raw = require(meta, "boxes", reward)
    if isinstance(raw, (list, tuple)) and len(raw) == 4 and _as_box(raw) is not None:
        raw = [raw]
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Iterable):
        raise Unjudgeable(f"metadata 'boxes' must be a list of [x1, y1, x2, y2], got {raw!r}")
    boxes = []
    for k, b in enumerate(raw):
        box = _as_box(b)
        if box is None or not valid_box(box):
            raise Unjudgeable(f"metadata 'boxes'[{k}] = {b!r} is not a valid [x1, y1, x2, y2] box (x2 > x1, y2 > y1)")
        boxes.append(list(box))
    return boxes


class _BoxReward(TextReward):
    """Shared reading of ground truth and predicted boxes (original pixels).

    ``coord_format``: the format of a sample whose metadata has no ``coord_format`` (``"qwen2"``, ``"qwen25"``,
    ``"absolute"``), or ``None``: no default, such a sample is NaN (never silently read as absolute pixels).
    """

    def __init__(self, require_tags: bool = True, coord_format: str | None = None) -> None:
        super().__init__()
        if coord_format is not None and coord_format not in COORD_FORMATS:
            raise ValueError(f"unknown coord_format {coord_format!r}; expected one of {COORD_FORMATS} or None")
        self.require_tags = bool(require_tags)
        self.coord_format = coord_format

    unparseable_extras: dict[str, float] = {}

    def _boxes(self, text: str, meta: Mapping) -> tuple[list[list[float]], list[list[float]]]:
        _, pred, gt = self._read(text, meta)
        return pred, gt

    def _read(self, text: str, meta: Mapping) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
        """``(raw, pred, gt)``: the boxes as written (the answer's own coordinates), the same in original pixels,
        and the ground truth."""
        gt = _gt_boxes(meta, self.name)
        fmt = self._format(meta)
        try:
            raw = parse_boxes(answer_or_text(text, self.require_tags))
        except Unparseable as exc:
            raise Unparseable(exc.reason, self.unparseable_extras) from None
        pred = [rescale_box(b, fmt, meta.get("image_size"), meta.get("input_size")) for b in raw]
        return raw, pred, gt

    def _format(self, meta: Mapping) -> str:
        """The sample's coordinate format, its sizes checked (Unjudgeable: NaN, never read as absolute pixels)."""
        fmt = meta.get("coord_format") or self.coord_format
        if fmt is None:
            raise Unjudgeable(
                f"metadata has no 'coord_format' and {self.name} has no default coord_format: the box coordinates "
                f"cannot be read. Give each sample a coord_format ({', '.join(COORD_FORMATS)}), or set "
                f"rewards.<key>.kwargs.coord_format (model.family qwen_vl with a Qwen2-VL / Qwen2.5-VL / Qwen3-VL "
                f"model sets it from the model type)"
            )
        if fmt not in COORD_FORMATS:
            raise Unjudgeable(f"metadata 'coord_format' {fmt!r} is not one of {COORD_FORMATS}")
        if fmt != "absolute":  # fail on missing sizes before reading the answer: NaN, not "unparseable"
            rescale_box([0, 0, 1, 1], fmt, meta.get("image_size"), meta.get("input_size"))
        return fmt


def takes_coord_format(name: str) -> bool:
    """Whether the registered reward ``name`` has an explicit ``coord_format`` keyword argument (the box rewards)."""
    import inspect

    from ._base import _REGISTRY

    factory = _REGISTRY.get(name)
    if factory is None:
        return False
    target = factory.__init__ if isinstance(factory, type) else factory
    return "coord_format" in inspect.signature(target).parameters


def with_coord_format(spec: Mapping[str, Any], coord_format: str) -> dict[str, Any]:
    """A reward spec (``build_rewards``' mapping) where every reward that takes ``coord_format`` and was not
    given one gets ``coord_format`` as its default; explicitly configured values are kept. The routes (and a
    mapping ``default``) of ``task_routed`` rewards are walked too. The input is not modified."""
    if coord_format not in COORD_FORMATS:
        raise ValueError(f"unknown coord_format {coord_format!r}; expected one of {COORD_FORMATS}")

    def entry_with(key: str, entry: Any) -> Any:
        if isinstance(entry, Mapping):
            name, kwargs = entry.get("reward", key), dict(entry.get("kwargs") or {})
        else:  # a bare weight (or something build_rewards will reject with its own message)
            name, kwargs = key, {}
        if name == "task_routed":
            if "routes" in kwargs and isinstance(kwargs["routes"], Mapping):
                kwargs["routes"] = {task: route_with(route) for task, route in kwargs["routes"].items()}
            if isinstance(kwargs.get("default"), Mapping):
                kwargs["default"] = route_with(kwargs["default"])
        elif takes_coord_format(name) and kwargs.get("coord_format") is None:
            kwargs["coord_format"] = coord_format
        else:
            return entry
        base = dict(entry) if isinstance(entry, Mapping) else {"weight": entry}
        return {**base, "kwargs": kwargs}

    def route_with(route: Any) -> Any:
        return {k: entry_with(k, e) for k, e in route.items()} if isinstance(route, Mapping) else route

    return {key: entry_with(key, entry) for key, entry in spec.items()}


def _check_threshold(t: float) -> float:
    t = float(t)
    if not 0.0 < t <= 1.0:
        raise ValueError(f"IoU thresholds must lie in (0, 1], got {t}")
    return t


@register_reward("iou")
class BoxIoU(_BoxReward):
    """Single-object grounding (REC): IoU of the first predicted box with the ground truth.

    Reads ``boxes`` (with several ground-truth boxes, the best IoU over them counts: any annotated
    referent is accepted) and the coordinate fields. The first box of the answer is scored (VLM-R1
    reads the first ``[x1, y1, x2, y2]``). No box: unparseable (0). Extra key ``acc@0.5``: 1 when
    ``IoU > 0.5`` strictly (REFERENCE.md section 7), so an IoU of exactly 0.5 does not count.

    ``hit_threshold=t`` makes the score the benchmark's hit instead, 1 when ``IoU > t`` (strict, as
    ``acc@t``) and 0 otherwise: the REC metric itself as the reward (mmrl's option; VLM-R1 trains on the
    IoU). The extra key ``raw_iou`` always holds the continuous value.

    ``convention="vlm_r1"``: VLM-R1's training ``iou_reward`` (``src/open-r1-multimodal/src/open_r1/vlm_modules/
    qwen_module.py``) as written: the FIRST ``<answer>`` block's first ``[x1, y1, x2, y2]`` of whole numbers, and
    :func:`vlm_r1_iou` (inclusive-pixel intersection); an answer it cannot read scores 0 (unparseable).
    """

    extra_keys = ("acc@0.5", "raw_iou")
    unparseable_extras = {"acc@0.5": 0.0, "raw_iou": 0.0}

    def __init__(self, require_tags: bool = True, coord_format: str | None = None,
                 hit_threshold: float | None = None, convention: str = "mmrl") -> None:
        super().__init__(require_tags, coord_format)
        self.hit_threshold = None if hit_threshold is None else _check_threshold(hit_threshold)
        if convention not in ("mmrl", "vlm_r1"):
            raise ValueError(f"unknown convention {convention!r}; expected 'mmrl' or 'vlm_r1'")
        self.convention = convention

    def _vlm_r1_boxes(self, text: str, meta: Mapping) -> tuple[list[list[float]], list[list[float]]]:
        """``(pred, gt)`` as VLM-R1's training ``iou_reward`` reads the answer (:func:`parse_vlm_r1_box` with
        ``training=True``), rescaled from the sample's coordinate format."""
        gt, fmt = _gt_boxes(meta, self.name), self._format(meta)
        if not gt:  # no ground truth: NaN (the caller), whatever the answer
            return [], gt
        try:
            box = parse_vlm_r1_box(text, training=True)
        except Unparseable as exc:
            raise Unparseable(exc.reason, self.unparseable_extras) from None
        return [rescale_box(box, fmt, meta.get("image_size"), meta.get("input_size"))], gt

    def _score_one(self, text, prompt, meta):
        pred, gt = self._vlm_r1_boxes(text, meta) if self.convention == "vlm_r1" else self._boxes(text, meta)
        if not gt:
            raise Unjudgeable("metadata 'boxes' is empty (iou needs a ground-truth box)")
        if not pred:
            raise Unparseable("the answer has no box", self.unparseable_extras)
        overlap = vlm_r1_iou if self.convention == "vlm_r1" else box_iou
        iou = max(overlap(pred[0], g) for g in gt)
        score = iou if self.hit_threshold is None else float(iou > self.hit_threshold)
        return {self.name: score, "acc@0.5": float(iou > 0.5), "raw_iou": iou}


@register_reward("crop_recall")
class CropRecall(_BoxReward):
    """How much of the ground-truth box the policy's crops look at, for tool rollouts (``generation.tools: [crop]``).

    Score: the best, over the completion's ``<tool>crop(x1, y1, x2, y2)</tool>`` calls and the ground-truth boxes,
    of ``area(crop & box) / area(box)``, the recall of the region of interest (the zoom-in measure the Muffin &
    Chihuahua study of zoom-in tool use, UKPLab 2026, found most correlated with task success; as a reward, mmrl's).
    The crop's numbers are in the frame of the model's box answers (as the tool reads them), rescaled to original
    pixels like a predicted box. The reported
    spans are the characters of each crop call, ``<tool>`` through ``</tool>``: the vision reward of ``factorized``
    (which credits the calls anyway) or a ``reward``-scoped component of ``cspo``. No crop call, or only calls that do
    not parse: unparseable (0, counted, no spans).
    """

    reports_spans = True

    def __init__(self, coord_format: str | None = None) -> None:
        super().__init__(require_tags=False, coord_format=coord_format)

    def _score_one(self, text, prompt, meta):
        from mmrl.pipelines.vlm.tools import ToolError, calls_in, parse_call

        gt = _gt_boxes(meta, self.name)
        if not gt:
            raise Unjudgeable("metadata 'boxes' is empty (crop_recall needs a ground-truth box)")
        fmt = self._format(meta)
        crops, spans = [], []
        for start, end, inside in calls_in(text):
            try:
                _, args = parse_call(inside, {"crop": None})
            except ToolError:
                continue
            if len(args) == 4:
                x1, y1, x2, y2 = rescale_box(args, fmt, meta.get("image_size"), meta.get("input_size"))
                crops.append([min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)])
                spans.append((start, end))
        if not crops:
            raise Unparseable("the completion has no crop(x1, y1, x2, y2) call")
        recall = max(_intersection(c, b) / ((b[2] - b[0]) * (b[3] - b[1])) for c in crops for b in gt)
        return {self.name: recall}, spans


COORDINATES = ("x1", "y1", "x2", "y2")
_NUMBER = re.compile(_NUM)


def coordinate_spans(text: str, box: Sequence[float], coordinate: int, reasoning: bool = True) -> list[tuple[int, int]]:
    """Character spans of ``text`` that write coordinate ``coordinate`` (0-3: x1, y1, x2, y2) of ``box``, the first box
    of its answer as written: the number in the answer (the first four consecutive numbers of the ``<answer>`` block,
    or of the whole text without one, equal to ``box``), and with ``reasoning`` every number of the ``<think>`` block
    with the same value (where a response works the coordinate out before writing it). ``[]`` when the box is not
    found."""
    match = ANSWER_BLOCK.search(text)
    start, answer = (match.start(1), match.group(1)) if match else (0, text)
    numbers = list(_NUMBER.finditer(answer))
    values = [float(m.group()) for m in numbers]
    target = [float(v) for v in box]
    spans: list[tuple[int, int]] = []
    for j in range(len(values) - 3):
        if values[j:j + 4] == target:
            m = numbers[j + coordinate]
            spans.append((start + m.start(), start + m.end()))
            break
    if reasoning and spans:
        for think in THINK_BLOCK.finditer(text):
            spans.extend((think.start(1) + m.start(), think.start(1) + m.end())
                         for m in _NUMBER.finditer(think.group(1)) if float(m.group()) == target[coordinate])
    return sorted(spans)


@register_reward("box_coordinate")
class BoxCoordinate(_BoxReward):
    """One coordinate of the first predicted box, scored on its own, with the characters that write it.

    ``coordinate`` is ``x1``, ``y1``, ``x2`` or ``y2``. Score ``max(0, 1 - |p - g| / (tolerance * side))`` in
    original pixels, ``g`` that coordinate of the ground-truth box the prediction overlaps most (the one ``iou``
    scores), ``side`` the image's width (x) or height (y) from ``image_size``. The reported spans
    (:func:`coordinate_spans`) are the answer's number for that coordinate and, with ``reasoning``, the same value
    written in the ``<think>`` block.

    Four of these under ``cspo`` (``algorithm.variants: [cspo]``, the coordinates' default scope ``reward``) give
    each coordinate's digits the group advantage of that coordinate's error alone, instead of one box IoU on every
    token: CSPO's component-specific credit (Yang et al. 2026) applied to a box's four numbers, which is mmrl's own
    use of it (CSPO's components are a table's structure and content). No box: unparseable (0, no spans).
    """

    reports_spans = True

    def __init__(self, coordinate: str, tolerance: float = 0.25, reasoning: bool = True, require_tags: bool = True,
                 coord_format: str | None = None) -> None:
        super().__init__(require_tags, coord_format)
        if coordinate not in COORDINATES:
            raise ValueError(f"coordinate must be one of {COORDINATES}, got {coordinate!r}")
        if not float(tolerance) > 0:
            raise ValueError(f"tolerance must be > 0 (a fraction of the image side), got {tolerance!r}")
        self.index = COORDINATES.index(coordinate)
        self.tolerance = float(tolerance)
        self.reasoning = bool(reasoning)

    def _score_one(self, text, prompt, meta):
        raw, pred, gt = self._read(text, meta)
        if not gt:
            raise Unjudgeable("metadata 'boxes' is empty (box_coordinate needs a ground-truth box)")
        if not pred:
            raise Unparseable("the answer has no box")
        if meta.get("image_size") is None:
            raise Unjudgeable("metadata has no 'image_size' (box_coordinate measures errors in image sides)")
        side = _size(meta["image_size"], "image_size")[self.index % 2]
        target = max(gt, key=lambda g: box_iou(pred[0], g))
        error = abs(pred[0][self.index] - target[self.index])
        score = max(0.0, 1.0 - error / (self.tolerance * side))
        return {self.name: score}, coordinate_spans(text, raw[0], self.index, self.reasoning)


@register_reward("box_f1")
class BoxF1(_BoxReward):
    """Multi-object grounding: F1 of the one-to-one matching at ``IoU >= iou_threshold`` (:func:`box_f1`),
    optionally times VLM-R1's :func:`spam_penalty`. Extra keys ``precision``, ``recall``."""

    extra_keys = ("precision", "recall")
    unparseable_extras = {"precision": 0.0, "recall": 0.0}

    def __init__(self, require_tags: bool = True, coord_format: str | None = None, iou_threshold: float = 0.5,
                 spam_penalty: bool = False) -> None:
        super().__init__(require_tags, coord_format)
        self.iou_threshold = _check_threshold(iou_threshold)
        self.spam_penalty = bool(spam_penalty)

    def _score_one(self, text, prompt, meta):
        pred, gt = self._boxes(text, meta)
        f = box_f1(pred, gt, self.iou_threshold)
        score = f["f1"] * (spam_penalty(len(pred), len(gt)) if self.spam_penalty else 1.0)
        return {self.name: score, "precision": f["precision"], "recall": f["recall"]}


@register_reward("box_matched_iou")
class BoxMatchedIoU(_BoxReward):
    """Multi-object grounding: ``iou_weight·mean matched IoU + (1 - iou_weight)·completeness``
    (:func:`matched_iou_completeness`), times :func:`spam_penalty` unless ``spam_penalty=False``.
    Extra keys ``mean_iou``, ``completeness``."""

    extra_keys = ("mean_iou", "completeness")
    unparseable_extras = {"mean_iou": 0.0, "completeness": 0.0}

    def __init__(self, require_tags: bool = True, coord_format: str | None = None, iou_threshold: float = 0.5,
                 iou_weight: float = 0.5, spam_penalty: bool = True) -> None:
        super().__init__(require_tags, coord_format)
        self.iou_threshold = _check_threshold(iou_threshold)
        if not 0.0 <= iou_weight <= 1.0:
            raise ValueError(f"iou_weight must lie in [0, 1], got {iou_weight}")
        self.iou_weight = float(iou_weight)
        self.spam_penalty = bool(spam_penalty)

    def _score_one(self, text, prompt, meta):
        pred, gt = self._boxes(text, meta)
        r = matched_iou_completeness(pred, gt, self.iou_threshold, self.iou_weight)
        score = r["score"] * (spam_penalty(len(pred), len(gt)) if self.spam_penalty else 1.0)
        return {self.name: score, "mean_iou": r["mean_iou"], "completeness": r["completeness"]}


_FENCED_JSON = re.compile(r"```json(.*?)```", re.DOTALL)


@register_reward("box_detection_score")
class BoxDetectionScore(_BoxReward):
    """VLM-R1's open-vocabulary detection reward (``accu_reward_method: weighted_sum``; :func:`vlm_r1_detection_score`
    on the answer read as VLM-R1 reads it).

    Reading, as ``grpo_jsonl.py``: :func:`vlm_r1_clean_text` (the last answer block, lower-cased), then the first
    fenced ````` ```json ... ``` ````` block, ``json.loads``; each item of the list is a prediction, its
    ``bbox_2d`` the box (rescaled from ``coord_format`` to original pixels; missing or malformed: IoU 0, still a
    prediction) and its ``label`` the class. Ground truth: metadata ``boxes`` and, when given, ``labels`` (one
    string per box; without them labels are not checked). An image with no box (``boxes: []``, VLM-R1's solution
    ``None``) scores 1 when the cleaned answer is ``none`` and 0 otherwise, an empty fenced list included, as VLM-R1
    compares the cleaned texts there. mmrl's rule where VLM-R1 differs: with boxes to find, an answer with no fenced
    JSON block, or one that does not parse, is unparseable (0, counted) where VLM-R1 scores it 0 as an empty
    prediction. ``require_tags`` is not used (VLM-R1 reads the whole text when there is no answer block). Extra keys
    ``position``, ``label_accuracy``, ``completeness``."""

    extra_keys = ("position", "label_accuracy", "completeness")
    unparseable_extras = {"position": 0.0, "label_accuracy": 0.0, "completeness": 0.0}

    def __init__(self, require_tags: bool = True, coord_format: str | None = None, iou_threshold: float = 0.5,
                 alpha: float = 0.7, beta: float = 0.0, gamma: float = 0.3) -> None:
        super().__init__(require_tags, coord_format)
        self.iou_threshold = _check_threshold(iou_threshold)
        weights = (float(alpha), float(beta), float(gamma))
        if min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"alpha, beta, gamma must be >= 0 with a positive sum, got {weights}")
        self.alpha, self.beta, self.gamma = weights

    def _ground_truth(self, meta: Mapping) -> list[tuple[list[float], str | None]]:
        boxes = _gt_boxes(meta, self.name)
        labels = meta.get("labels")
        if labels is None:
            return [(b, None) for b in boxes]
        if not isinstance(labels, (list, tuple)) or len(labels) != len(boxes) or \
                not all(isinstance(v, str) for v in labels):
            raise Unjudgeable(f"metadata 'labels' must be one string per box ({len(boxes)}), got {labels!r}")
        return list(zip(boxes, labels))

    def _score_one(self, text, prompt, meta):
        gt = self._ground_truth(meta)
        fmt = self._format(meta)
        if not isinstance(text, str):
            raise Unparseable(f"answer is not text (got {type(text).__name__})", self.unparseable_extras)
        if not gt:  # VLM-R1: an image with nothing to detect has the solution "None", met by the answer "none" alone
            value = 1.0 if vlm_r1_clean_text(text) == "none" else 0.0
            return {self.name: value, "position": value, "label_accuracy": value, "completeness": value}
        fenced = _FENCED_JSON.search(vlm_r1_clean_text(text))
        if fenced is None:
            raise Unparseable("no ```json ... ``` block in the answer", self.unparseable_extras)
        try:
            items = list(json.loads(fenced.group(1).strip()))
        except (ValueError, TypeError):
            raise Unparseable("the ```json block does not parse as a list", self.unparseable_extras) from None
        pred = []
        for item in items:
            box = _as_box(item.get("bbox_2d")) if isinstance(item, Mapping) else None
            label = item.get("label") if isinstance(item, Mapping) and isinstance(item.get("label"), str) else None
            pred.append((None if box is None else
                         rescale_box(list(box), fmt, meta.get("image_size"), meta.get("input_size")), label))
        r = vlm_r1_detection_score(pred, gt, self.iou_threshold, self.alpha, self.beta, self.gamma)
        return {self.name: r["score"], "position": r["position"], "label_accuracy": r["label_accuracy"],
                "completeness": r["completeness"]}


@register_reward("box_weighted_pr")
class BoxWeightedPR(_BoxReward):
    """DIP-R1's weighted precision-recall reward (:func:`weighted_precision_recall`):
    ``precision_weight·P + (1 - precision_weight)·R``. Extra keys ``precision``, ``recall``."""

    extra_keys = ("precision", "recall")
    unparseable_extras = {"precision": 0.0, "recall": 0.0}

    def __init__(self, require_tags: bool = True, coord_format: str | None = None, iou_threshold: float = 0.5,
                 precision_weight: float = 0.5, spam_penalty: bool = False) -> None:
        super().__init__(require_tags, coord_format)
        self.iou_threshold = _check_threshold(iou_threshold)
        if not 0.0 <= precision_weight <= 1.0:
            raise ValueError(f"precision_weight must lie in [0, 1], got {precision_weight}")
        self.precision_weight = float(precision_weight)
        self.spam_penalty = bool(spam_penalty)

    def _score_one(self, text, prompt, meta):
        pred, gt = self._boxes(text, meta)
        r = weighted_precision_recall(pred, gt, self.iou_threshold, self.precision_weight)
        score = r["score"] * (spam_penalty(len(pred), len(gt)) if self.spam_penalty else 1.0)
        return {self.name: score, "precision": r["precision"], "recall": r["recall"]}


@register_reward("box_set_f1")
class BoxSetF1(_BoxReward):
    """Falcon-Perception's set reward: F1 of the Hungarian matching averaged over IoU thresholds
    (:func:`set_f1`). ``boxes: []`` is a valid negative sample. Extra key ``f1@0.5``."""

    extra_keys = ("f1@0.5",)
    unparseable_extras = {"f1@0.5": 0.0}

    def __init__(self, require_tags: bool = True, coord_format: str | None = None,
                 iou_thresholds: Sequence[float] = FALCON_IOU_THRESHOLDS) -> None:
        super().__init__(require_tags, coord_format)
        self.iou_thresholds = tuple(_check_threshold(t) for t in iou_thresholds)
        if not self.iou_thresholds:
            raise ValueError("iou_thresholds must not be empty")

    def _score_one(self, text, prompt, meta):
        pred, gt = self._boxes(text, meta)
        r = set_f1(pred, gt, self.iou_thresholds)
        return {self.name: r["f1"], "f1@0.5": r["f1@0.5"]}


@register_reward("box_salience_iou")
class BoxSalienceIoU(_BoxReward):
    """GRiP's salience-weighted IoU (:func:`salience_weighted_iou`), times :func:`spam_penalty` unless
    ``spam_penalty=False``. Reads ``salience`` (one weight >= 0 per ground-truth box; uniform if absent)."""

    def __init__(self, require_tags: bool = True, coord_format: str | None = None, spam_penalty: bool = True) -> None:
        super().__init__(require_tags, coord_format)
        self.spam_penalty = bool(spam_penalty)

    def _score_one(self, text, prompt, meta):
        gt_probe = _gt_boxes(meta, self.name)
        weights = meta.get("salience")
        if weights is not None:
            try:
                weights = [float(w) for w in weights]
            except (TypeError, ValueError, OverflowError):
                raise Unjudgeable(f"metadata 'salience' must be a list of numbers, got {weights!r}") from None
            if len(weights) != len(gt_probe) or any(not (w >= 0 and math.isfinite(w)) for w in weights):
                raise Unjudgeable(
                    f"metadata 'salience' must hold one finite weight >= 0 per ground-truth box "
                    f"({len(gt_probe)}), got {weights!r}"
                )
            if gt_probe and sum(weights) <= 0:
                raise Unjudgeable("metadata 'salience' weights sum to 0")
        pred, gt = self._boxes(text, meta)
        score = salience_weighted_iou(pred, gt, weights)
        return score * (spam_penalty(len(pred), len(gt)) if self.spam_penalty else 1.0)


# --------------------------------------------------------------------------------------------
# Temporal spans
# --------------------------------------------------------------------------------------------


def temporal_iou(pred: Sequence[float], gt: Sequence[float]) -> float:
    """Temporal IoU of two ``[start, end]`` spans in seconds:
    ``max(0, min(e) - max(s)) / (max(e) - min(s))`` (REFERENCE.md section 7).

    A reversed (``end < start``) or empty (``end == start``) span, or non-finite values, score 0.
    """
    try:
        ps, pe = (float(v) for v in pred)
        gs, ge = (float(v) for v in gt)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    if not all(math.isfinite(v) for v in (ps, pe, gs, ge)) or pe <= ps or ge <= gs:
        return 0.0
    inter = max(0.0, min(pe, ge) - max(ps, gs))
    return inter / (max(pe, ge) - min(ps, gs))


_CLOCK = r"\d+:\d{1,2}(?::\d{1,2})?(?:\.\d+)?"
_SECONDS = r"\d+(?:\.\d+)?"
#: a time token: not a piece of a longer number (digits, a decimal point, a clock's colon, an exponent)
_T = rf"(?<![\d.:])(?<!\d[eE])(?<!\d[eE][-+])(?:{_CLOCK}|{_SECONDS})(?![\d:]|[eE][-+]?\d)"
_UNIT = r"(?:\s*(?:s|secs?|seconds?)\b)?"
_RANGE = re.compile(rf"({_T}){_UNIT}\s*(?:to|until|till|through|-|–|—|~|and)\s*({_T}){_UNIT}", re.IGNORECASE)
_PAIR = re.compile(rf"({_T}){_UNIT}\s*,\s*({_T}){_UNIT}", re.IGNORECASE)
_START_KEYS = ("start_time", "start", "begin")
_END_KEYS = ("end_time", "end", "stop")


def _signed(text: str, pos: int) -> bool:
    """Whether the time token at ``pos`` carries a sign: a minus or plus right before it that starts a number (at
    the start, after a space or an opening bracket), not a dash joining two times (``10-20``, ``10s-20s``)."""
    if pos == 0 or text[pos - 1] not in "-+−":
        return False
    return pos == 1 or text[pos - 2].isspace() or text[pos - 2] in "([{,:=\"'"


def _span_matches(text: str) -> list[re.Match]:
    """The time pairs in ``text`` joined by a word or a dash, or failing those by a comma (``[12.5, 20.1]``); a pair
    whose start carries a sign (``-3 to 5``) is no time span (its end cannot: the joiners take no sign)."""
    for pattern in (_RANGE, _PAIR):
        found = [m for m in pattern.finditer(text) if not _signed(text, m.start(1))]
        if found:
            return found
    return []


def _time_value(token: Any) -> float:
    if isinstance(token, (int, float)) and not isinstance(token, bool):
        return float(token)
    token = str(token).strip().rstrip("s").strip()
    if ":" in token:
        parts = [float(p) for p in token.split(":")]
        value = 0.0
        for p in parts:
            value = value * 60.0 + p
        return value
    return float(token)


def parse_timestamps(text: str) -> tuple[float, float]:
    """The ``(start, end)`` span an answer names, in the answer's units; raises :class:`Unparseable`.

    Accepts JSON ``{"start_time": 12.5, "end_time": 20.1}`` (Temporal-R1's answer format; also
    ``start``/``end``), and otherwise the last pair of times joined by ``to``, ``-``, ``,``, ``and``,
    ``~``...: ``12.5 to 20.1 seconds``, ``[12.5, 20.1]``, ``from 12.5s to 20.1s``, ``00:12-00:20``
    (``mm:ss``, ``hh:mm:ss`` read as seconds). The last pair, as TimeZero's training reward reads its answer
    (``grpo_video.py`` ``parse_timestamp_output``: the last ``A to B``), so "10 to 15, more precisely 12 to 20"
    answers 12 to 20. A pair joined by a word or a dash wins over one joined by a comma (mmrl's rule), so a
    number before the span ("Step 1, 2.0 to 5.5") or after it ("2.0 to 5.5 s, 3.5 s long") is not read as an
    end. A reversed pair is returned as written (it scores 0).
    """
    if not isinstance(text, str):
        raise Unparseable(f"answer is not text (got {type(text).__name__})")
    body = _FENCE.sub("", text).strip()
    for obj in _json_candidates(body):
        if isinstance(obj, Mapping):
            start = next((obj[k] for k in _START_KEYS if k in obj), None)
            end = next((obj[k] for k in _END_KEYS if k in obj), None)
            if start is not None and end is not None:
                try:
                    return _time_value(start), _time_value(end)
                except (TypeError, ValueError, OverflowError):
                    raise Unparseable(f"start/end values {start!r}, {end!r} are not times") from None
    matches = _span_matches(body)
    if not matches:
        raise Unparseable("no time span in the answer")
    return _time_value(matches[-1].group(1)), _time_value(matches[-1].group(2))


_TIMEZERO_SPAN = re.compile(r"(\d+\.?\d*) (to|and) (\d+\.?\d*)")


_TIME_R1_SPAN = re.compile(r"(\d+\.?\d*) (to|and) (\d+\.?\d*)", re.IGNORECASE)


def parse_time_r1_span(text: str) -> tuple[float, float]:
    """Time-R1's training parse (``main.py`` ``parse_timestamp_output``): the LAST ``<answer>`` block's last
    ``<number> to|and <number>`` (one space each side, case-insensitive, plain decimals); raises
    :class:`Unparseable` where it returns None."""
    if not isinstance(text, str):
        raise Unparseable(f"answer is not text (got {type(text).__name__})")
    blocks = _VLM_R1_ANSWER.findall(text)
    if not blocks:
        raise Unparseable("no <answer>...</answer> block")
    spans = _TIME_R1_SPAN.findall(blocks[-1])
    if not spans:
        raise Unparseable("no '<start> to <end>' span in the last answer block (Time-R1's parse)")
    return float(spans[-1][0]), float(spans[-1][2])


def parse_timezero_span(text: str) -> tuple[float, float]:
    """TimeZero's evaluation parse (www-Ye/TimeZero ``evaluate.py`` ``parse_timestamp_output``): the last
    ``<number> to|and <number>`` anywhere in the whole output, tags or not; raises :class:`Unparseable` where
    TimeZero returns ``(None, None)`` (no such pair: ``12.5-19.0``, ``[12, 19]``, JSON and ``mm:ss`` included)."""
    if not isinstance(text, str):
        raise Unparseable(f"answer is not text (got {type(text).__name__})")
    matches = _TIMEZERO_SPAN.findall(text)
    if not matches:
        raise Unparseable("no '<start> to <end>' span in the output (TimeZero's parse)")
    return float(matches[-1][0]), float(matches[-1][2])


def _finite(values: Iterable[float]) -> list[float]:
    if hasattr(values, "tolist"):
        values = values.tolist()  # tensors and arrays
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def recall_at(tious: Iterable[float], m: float) -> float:
    """R1@m: the fraction of samples with ``tIoU > m`` (strict; REFERENCE.md section 7).

    NaN entries (samples not judged) are left out; NaN when none is left.
    """
    vals = _finite(tious)
    return sum(1 for v in vals if v > m) / len(vals) if vals else math.nan


def mean_iou(tious: Iterable[float]) -> float:
    """mIoU: the mean of the finite (t)IoU values; NaN when there are none."""
    vals = _finite(tious)
    return sum(vals) / len(vals) if vals else math.nan


def _gt_span(meta: Mapping, reward: str) -> tuple[float, float]:
    raw = require(meta, "timestamps", reward)
    try:
        s, e = (float(v) for v in raw)
    except (TypeError, ValueError, OverflowError):
        raise Unjudgeable(f"metadata 'timestamps' must be [start, end] in seconds, got {raw!r}") from None
    if not (math.isfinite(s) and math.isfinite(e)) or e <= s:
        raise Unjudgeable(f"metadata 'timestamps' {raw!r} is not a span with end > start")
    return s, e


_TIME_UNITS = ("seconds", "fraction")


class _SpanReward(TextReward):
    def __init__(self, require_tags: bool = True, time_unit: str = "seconds") -> None:
        super().__init__()
        if time_unit not in _TIME_UNITS:
            raise ValueError(f"unknown time_unit {time_unit!r}; use one of {_TIME_UNITS}")
        self.require_tags = bool(require_tags)
        self.time_unit = time_unit

    def _scale(self, meta: Mapping) -> float:
        if self.time_unit == "seconds":
            return 1.0
        return _duration(meta, f"{self.name} with time_unit='fraction'")


def _duration(meta: Mapping, needed_by: str) -> float:
    """The line's ``duration`` in seconds, a positive finite number; else :class:`Unjudgeable`."""
    duration = require(meta, "duration", needed_by)
    try:
        d = float(duration)
    except (TypeError, ValueError, OverflowError):
        d = math.nan
    if not (d > 0 and math.isfinite(d)):
        raise Unjudgeable(f"metadata 'duration' must be a positive number of seconds, got {duration!r}")
    return d


@register_reward("temporal_iou")
class TemporalIoU(_SpanReward):
    """Temporal grounding: :func:`temporal_iou` of the answer's span with ``timestamps`` (seconds).

    ``time_unit="fraction"``: the answer gives fractions of the video, multiplied by ``duration``.
    Extra keys ``r1@0.3``, ``r1@0.5``, ``r1@0.7``: 1 when ``tIoU > m`` (their batch means are R1@m).

    ``hit_threshold=m`` makes the score the benchmark's hit instead, 1 when ``tIoU > m`` (strict, as
    R1@m) and 0 otherwise: the metric itself as the reward (mmrl's option).

    ``boundary_penalty=True`` is Time-R1's timestamp-aware IoU (Wang et al. 2025, arXiv 2503.13377; the reward
    its RL scripts train with, ``main.py`` ``iou_timestamp_reward_v2``, ``--reward_funcs iou_v2 format``):
    ``tIoU * (1 - |s - s_gt| / d) * (1 - |e - e_gt| / d)`` with ``d`` the line's ``duration`` (seconds), so of
    two answers with the same overlap the one with the nearer boundaries scores higher. As in Time-R1 the factors
    are not clipped (a boundary more than ``d`` away makes the score negative). It needs ``duration``; R1@m and
    ``raw_tiou`` stay the plain tIoU. With ``hit_threshold`` the hit is taken on the plain tIoU, so the two
    options do not combine.
    The extra key ``raw_tiou`` always holds the continuous, plain tIoU.

    ``convention="time_r1"``: the span read as Time-R1's training reward reads it (:func:`parse_time_r1_span`).
    """

    extra_keys = ("r1@0.3", "r1@0.5", "r1@0.7", "raw_tiou")
    unparseable_extras = {"r1@0.3": 0.0, "r1@0.5": 0.0, "r1@0.7": 0.0, "raw_tiou": 0.0}

    def __init__(self, require_tags: bool = True, time_unit: str = "seconds",
                 hit_threshold: float | None = None, boundary_penalty: bool = False,
                 convention: str = "mmrl") -> None:
        super().__init__(require_tags, time_unit)
        if convention not in ("mmrl", "time_r1"):
            raise ValueError(f"unknown convention {convention!r}; expected 'mmrl' or 'time_r1'")
        self.convention = convention
        self.hit_threshold = None if hit_threshold is None else _check_threshold(hit_threshold)
        if not isinstance(boundary_penalty, bool):
            raise ValueError(f"boundary_penalty must be true or false, got {boundary_penalty!r}")
        if boundary_penalty and hit_threshold is not None:
            raise ValueError("temporal_iou: boundary_penalty (Time-R1's timestamp-aware IoU) and hit_threshold "
                             "(the R1@m hit) are two different scores; set one")
        self.boundary_penalty = boundary_penalty

    def _score_one(self, text, prompt, meta):
        gt = _gt_span(meta, self.name)
        scale = self._scale(meta)
        duration = _duration(meta, f"{self.name} with boundary_penalty") if self.boundary_penalty else None
        try:
            s, e = parse_time_r1_span(text) if self.convention == "time_r1" else \
                parse_timestamps(answer_or_text(text, self.require_tags))
        except Unparseable as exc:
            raise Unparseable(exc.reason, self.unparseable_extras) from None
        s, e = s * scale, e * scale
        tiou = temporal_iou((s, e), gt)
        if duration is not None:
            score = tiou * (1.0 - abs(s - gt[0]) / duration) * (1.0 - abs(e - gt[1]) / duration)
        else:
            score = tiou if self.hit_threshold is None else float(tiou > self.hit_threshold)
        return {self.name: score, **{f"r1@{m}": float(tiou > m) for m in (0.3, 0.5, 0.7)}, "raw_tiou": tiou}


@register_reward("temporal_dual")
class TemporalDual(_SpanReward):
    """Temporal-R1's dual reward: a discrete semantic reward plus a continuous temporal reward.

    Li et al., "Reinforcement Learning Tuning for VideoLLMs: Reward Design and Data Efficiency"
    (Temporal-RLT, arXiv:2506.01908; code: Temporal-R1) supervise semantic reasoning with a discrete
    multiple-choice correctness reward and temporal reasoning with a continuous temporal-IoU reward.
    mmrl's rule, per line:

    * ``temporal`` = :func:`temporal_iou` of the answer's span with ``timestamps``, when the line has them;
    * ``semantic`` = 1 if the answer's choice letter equals the solution's, only when the line is a
      multiple-choice line: it has ``choices`` (its ``solution`` must then name one of them, by letter or
      option text, else the line is NaN), or its ``solution`` is a bare choice letter (``B``, ``(B)``,
      ``Answer: B``). A temporal-grounding line's ``solution`` holds the span as text (``"[3.0, 7.5]"``,
      see :mod:`mmrl.data.vlm`) and gets no semantic part;
    * the score is the sum over the parts the line has (MC-VQA: semantic only, [0, 1]; temporal grounding:
      temporal only, [0, 1]; grounded VideoQA, a multiple-choice line with ``timestamps``: both, [0, 2]).

    The sum for grounded QA is our reading of the paper (its exact weighting was not available to us).
    Temporal-R1's released grounding code scores ``0.9·tIoU + 0.1·format``: compose this reward with
    ``think_answer_format`` for that. The letter is read from the answer with the time span removed. A part
    that cannot be read scores 0 and the sample is counted unparseable. A line with neither part (no
    ``timestamps`` and not multiple choice) is NaN.
    """

    extra_keys = ("semantic", "temporal")

    def __init__(self, require_tags: bool = True, time_unit: str = "seconds") -> None:
        super().__init__(require_tags, time_unit)

    def _gt_letter(self, meta: Mapping) -> str | None:
        """The solution's choice letter on a multiple-choice line, None on any other line."""
        choices = _choices(meta)
        if meta.get("solution") is None:
            if choices is not None:
                raise Unjudgeable("metadata has 'choices' but no 'solution' (needed by temporal_dual)")
            return None
        sol = _solution_text(meta, self.name)
        if choices is not None:
            try:
                return parse_choice(str(sol), choices)
            except Unparseable as exc:
                raise Unjudgeable(f"metadata 'solution' {sol!r} names none of the {len(choices)} 'choices' "
                                  f"({exc})") from None
        body = _PREFIX.sub("", str(sol).strip(), count=1).strip()
        whole = _WHOLE_LETTER.fullmatch(body)
        return whole.group(1).upper() if whole else None

    def _score_one(self, text, prompt, meta):
        gt_letter = self._gt_letter(meta)
        has_sem, has_tmp = gt_letter is not None, meta.get("timestamps") is not None
        if not (has_sem or has_tmp):
            raise Unjudgeable("metadata has no 'timestamps' and is not a multiple-choice line ('choices', or a "
                              "'solution' that is a choice letter): nothing for temporal_dual to judge")
        choices = _choices(meta)
        gt_span = None
        if has_tmp:
            gt_span = _gt_span(meta, self.name)
            scale = self._scale(meta)
        parts: dict[str, float] = {}
        failures: list[str] = []
        try:
            answer = answer_or_text(text, self.require_tags)
        except Unparseable as exc:
            extras = {k: 0.0 for k, has in (("semantic", has_sem), ("temporal", has_tmp)) if has}
            raise Unparseable(exc.reason, extras) from None
        remainder = answer
        if has_tmp:
            try:
                s, e = parse_timestamps(answer)
                parts["temporal"] = temporal_iou((s * scale, e * scale), gt_span)
                match = next(iter(_span_matches(answer)), None)
                if match:
                    remainder = (answer[: match.start()] + " " + answer[match.end():]).strip()
            except Unparseable as exc:
                parts["temporal"] = 0.0
                failures.append(f"temporal: {exc.reason}")
        if has_sem:
            try:
                parts["semantic"] = float(parse_choice(remainder, choices) == gt_letter)
            except Unparseable as exc:
                parts["semantic"] = 0.0
                failures.append(f"semantic: {exc.reason}")
        total = sum(parts.values())
        if failures:
            raise Unparseable("; ".join(failures), parts, score=total)
        return {self.name: total, **parts}
