"""GenEval-style compositional reward (Ghosh et al. 2023, "GenEval: An Object-Focused Framework for
Evaluating Text-to-Image Alignment", NeurIPS 2023 Datasets and Benchmarks, arXiv:2310.11513).

An object detector finds the objects, a CLIP zero-shot classifier names their colours, and rules check
each prompt's metadata. The rules are those of GenEval's ``evaluation/evaluate_images.py``
(djghosh13/geneval), reproduced exactly in :func:`select_detections` / :func:`evaluate_geneval`:

* **detections kept**: per class, confidence ``> threshold`` (0.3; 0.9 when the prompt's ``tag`` is
  ``"counting"``), sorted by confidence, at most ``max_objects`` (16) per class; an optional greedy NMS
  with ``max_overlap`` (GenEval's default 1.0 = off). IoU uses GenEval's ``+1`` pixel convention.
* **include clause** ``{"class", "count", "color"?, "position"?: [relation, target_index]}`` holds iff:
  there are ``>= count`` detections of the class; if ``color`` is given, each of the ``count`` most
  confident ones is classified as that colour; if ``position`` is given, the target include clause
  ``target_index`` (an earlier one) held, and every one of those ``count`` objects stands in ``relation``
  (``"left of"``, ``"right of"``, ``"above"``, ``"below"``) to every matched object of the target.
* **relation** (:func:`relative_position`): with box centres ``c``, sizes ``d`` (width, height) and
  ``offset = c_a - c_b``, ``revised = max(|offset| - 0.1 * (d_a + d_b), 0) * sign(offset)``; no relation
  if ``|revised| < 1e-3`` in both axes; else ``(dx, dy) = revised / ||offset||`` and A is "left of" B if
  ``dx < -0.5``, "right of" if ``dx > 0.5``, "above" if ``dy < -0.5``, "below" if ``dy > 0.5`` (image y
  grows downwards).
* **exclude clause** ``{"class", "count"}`` fails iff there are ``>= count`` detections of the class (so
  GenEval's counting prompts, include ``count=N`` + exclude ``count=N+1``, mean "exactly N").
* **colour**: CLIP zero-shot over the 10 colours (red, orange, yellow, green, blue, purple, pink, brown,
  black, white) with the templates "a photo of a {c} {class}", "a photo of a {c}-colored {class}",
  "a photo of a {c} object" (per colour: mean of the L2-normalised text embeddings, renormalised;
  clip_benchmark's zero-shot classifier), on the object's masked image (pixels outside the instance mask
  set to ``bgcolor`` #999) cropped to its box; a detector without masks (OWL) uses the box crop.

Scores per image (main key per ``variant``; both are always returned as extra keys):

* ``strict``: 1 if every include clause holds and no exclude clause fails (GenEval's ``correct``), else 0;
* ``partial``: the fraction of clauses (include and exclude, each counted once) that hold (mmrl's);
* ``flow_grpo`` (only with ``variant="flow_grpo"``, then also ``flow_grpo_strict``): the graded score Flow-GRPO
  trains its GenEval model on, the reward server's ``evaluate_reward`` (yifan123/reward-server,
  ``reward_server/gen_eval.py``; :func:`flow_grpo_geneval_score`).

:func:`geneval_summary` gives the benchmark number: the mean over the six tags (single_object,
two_object, counting, colors, position, color_attr) of each tag's accuracy (``summary_scores.py``).

Metadata per sample, GenEval's ``evaluation_metadata.jsonl`` format:
``{"tag": "color_attr", "include": [{"class": "cat", "count": 1, "color": "red"},
{"class": "dog", "count": 1, "position": ["right of", 0]}], "exclude": [...], "prompt": ...}``.
Malformed or missing metadata gives NaN with the reason.

Models (transformers): the detector is ``Mask2FormerForUniversalSegmentation`` (default
``facebook/mask2former-swin-small-coco-instance``: GenEval used mmdetection's Mask2Former Swin-S COCO
instance model; this is the same architecture and training set, converted) or an open-vocabulary
OWL-ViT / OWLv2 detector (``OwlViTForObjectDetection`` / ``Owlv2ForObjectDetection``; queried with
"a photo of a {class}"; boxes only; its sigmoid scores are not calibrated like Mask2Former's, so tune
the thresholds). Mask2Former scores follow mmdetection's instance post-processing: per query and class
``softmax(class_logits)[:-1]``, top ``max_per_image`` (100) (query, class) pairs, masks upsampled
(bilinear) to the padded input, cropped to the resized image, upsampled to the original size, binarised at
logit 0; score = class probability x mean sigmoid of the mask over its binary pixels; box = the mask's
extent (``x_max + 1``, ``y_max + 1``). Preprocessing is the checkpoint's image processor, so input
resolution (and hence scores) can differ slightly from mmdetection's 1024x1024 LSJ test pipeline.
The colour classifier is transformers ``CLIPModel`` ``openai/clip-vit-large-patch14`` (the weights of
GenEval's open_clip ``ViT-L-14`` / ``openai``) with its processor (shortest side 224 bicubic, centre
crop). GenEval class names are COCO's with "computer mouse", "tv remote", "computer keyboard" for
"mouse", "remote", "keyboard" (detector labels are mapped).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from ._base import ImageBatch, MissingWeightsError, Reward, register_reward, resolve_device, resolve_dtype
from ._base import check_available as _check_available, load_pretrained
from .pickscore import _embedding

__all__ = [
    "COLORS",
    "TAGS",
    "POSITIONS",
    "GENEVAL_CLASSES",
    "COLOR_TEMPLATES",
    "Detection",
    "GenEvalResult",
    "canonical_class",
    "compute_iou",
    "relative_position",
    "select_detections",
    "check_geneval_metadata",
    "evaluate_geneval",
    "flow_grpo_geneval_score",
    "verdict_details",
    "geneval_summary",
    "color_crop",
    "Mask2FormerDetector",
    "OwlDetector",
    "ClipColorClassifier",
    "GenEval",
    "GenEvalPartial",
    "DEFAULT_DETECTOR",
    "DEFAULT_CLIP",
]

COLORS = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
POSITIONS = ("left of", "right of", "above", "below")
COLOR_TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")

#: GenEval's ``object_names.txt``: the 80 COCO classes, three renamed.
GENEVAL_CLASSES = [
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock",
    "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
]

#: Detector label spellings (COCO / VOC style) -> GenEval's class names.
_ALIASES = {
    "mouse": "computer mouse", "remote": "tv remote", "keyboard": "computer keyboard", "tvmonitor": "tv",
    "tv monitor": "tv", "television": "tv", "sofa": "couch", "pottedplant": "potted plant",
    "diningtable": "dining table", "motorbike": "motorcycle", "aeroplane": "airplane", "hair dryer": "hair drier",
    "cellphone": "cell phone", "wineglass": "wine glass", "hotdog": "hot dog", "teddybear": "teddy bear",
}

DEFAULT_DETECTOR = "facebook/mask2former-swin-small-coco-instance"
DEFAULT_OWL = "google/owlv2-base-patch16-ensemble"
DEFAULT_CLIP = "openai/clip-vit-large-patch14"

_MODEL_FILES = [
    [["config.json"]],
    [["model.safetensors"], ["model.safetensors.index.json"], ["pytorch_model.bin"], ["pytorch_model.bin.index.json"]],
]
_IMAGE_PROCESSOR_FILES = [[["preprocessor_config.json"], ["processor_config.json"]]]
_CLIP_PROCESSOR_FILES = [
    [["preprocessor_config.json"], ["processor_config.json"]],
    [["tokenizer.json"], ["vocab.json", "merges.txt"]],
]


def canonical_class(name: str) -> str:
    """A class name in GenEval's spelling (lower case, single spaces, detector aliases mapped)."""
    key = " ".join(str(name).replace("_", " ").lower().split())
    return _ALIASES.get(key, key)


# --------------------------------------------------------------------------------------------
# The rule engine (no model): GenEval's evaluate_images.py
# --------------------------------------------------------------------------------------------


@dataclass
class Detection:
    """One detected object: GenEval class name, confidence, box ``(x1, y1, x2, y2)`` in pixels of the
    original image, and optionally its boolean instance mask ``[H, W]``."""

    label: str
    score: float
    box: tuple[float, float, float, float]
    mask: np.ndarray | None = None


def compute_iou(box_a: Sequence[float], box_b: Sequence[float]) -> float:
    """GenEval's IoU (inclusive pixel boxes: areas use ``x2 - x1 + 1``)."""
    def area(b):
        return max(b[2] - b[0] + 1, 0) * max(b[3] - b[1] + 1, 0)

    inter = area([max(box_a[0], box_b[0]), max(box_a[1], box_b[1]), min(box_a[2], box_b[2]), min(box_a[3], box_b[3])])
    union = area(box_a) + area(box_b) - inter
    return inter / union if union else 0.0


def relative_position(box_a: Sequence[float], box_b: Sequence[float], position_threshold: float = 0.1) -> set[str]:
    """The relations of box A to box B (GenEval's rule, see the module docstring): a subset of
    ``{"left of", "right of", "above", "below"}``. In float32, as the official code computes it on the detector's
    float32 boxes (a ratio at exactly 0.5 there can be 0.50000005 in float64)."""
    boxes = np.array([list(box_a[:4]), list(box_b[:4])], dtype=np.float32).reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - position_threshold * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def select_detections(
    detections: Iterable[Detection],
    tag: str | None = None,
    threshold: float = 0.3,
    counting_threshold: float = 0.9,
    max_objects: int = 16,
    max_overlap: float = 1.0,
) -> dict[str, list[Detection]]:
    """GenEval's filtering: per class, confidence ``> threshold`` (``counting_threshold`` for
    ``tag == "counting"``), most confident first, at most ``max_objects``, then greedy NMS at IoU
    ``max_overlap`` (1.0 = none). Classes with no detection are absent.

    Exactly as the official ``evaluate_images.py``: per class the order is numpy's
    ``argsort(scores)[::-1]`` over the detector's outputs of that class in output order (so among exactly equal
    scores the later output comes first), and the threshold is compared in float32, as on mmdetection's float32
    arrays (a score of ``float32(0.3)`` is not above 0.3)."""
    cut = np.float32(counting_threshold if tag == "counting" else threshold)
    by_class: dict[str, list[Detection]] = {}
    for det in detections:
        by_class.setdefault(canonical_class(det.label), []).append(det)
    out: dict[str, list[Detection]] = {}
    for name, dets in by_class.items():
        scores = np.asarray([d.score for d in dets], dtype=np.float32)
        order = np.argsort(scores)[::-1]
        order = order[scores[order] > cut][:max_objects]
        ordering = [dets[i] for i in order.tolist()]
        if not ordering:
            continue
        kept: list[Detection] = []
        while ordering:
            best = ordering.pop(0)
            kept.append(best)
            if max_overlap < 1:
                ordering = [d for d in ordering if compute_iou(best.box, d.box) < max_overlap]
        out[name] = kept
    return out


def check_geneval_metadata(metadata: Any) -> str | None:
    """None if ``metadata`` is usable GenEval metadata, else the reason it is not."""
    if not isinstance(metadata, Mapping):
        return f"GenEval metadata must be a dict with 'include' clauses, got {type(metadata).__name__}"
    include, exclude = metadata.get("include", []), metadata.get("exclude", [])
    if not isinstance(include, (list, tuple)) or not isinstance(exclude, (list, tuple)):
        return "GenEval metadata 'include' and 'exclude' must be lists of clauses"
    if not include and not exclude:
        return "GenEval metadata has no 'include' or 'exclude' clause"
    for kind, clauses in (("include", include), ("exclude", exclude)):
        for k, clause in enumerate(clauses):
            if not isinstance(clause, Mapping) or not isinstance(clause.get("class"), str):
                return f"{kind} clause {k} needs a 'class' string: {clause!r}"
            count = clause.get("count", 1)
            if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
                return f"{kind} clause {k} has an invalid count {count!r} (a positive integer)"
            if kind == "include" and "color" in clause and clause["color"] not in COLORS:
                return f"include clause {k} has an unknown colour {clause['color']!r}; GenEval's colours: {COLORS}"
            if kind == "include" and "position" in clause:
                pos = clause["position"]
                if not isinstance(pos, (list, tuple)):
                    pos = ()
                index_ok = len(pos) == 2 and isinstance(pos[1], (int, np.integer)) and not isinstance(pos[1], bool)
                if not index_ok or pos[0] not in POSITIONS or not 0 <= pos[1] < k:
                    return (f"include clause {k} has an invalid position {pos!r}: expected [relation, index of an "
                            f"earlier include clause] with relation in {list(POSITIONS)}")
    tag = metadata.get("tag")
    if tag is not None and not isinstance(tag, str):
        return f"GenEval metadata 'tag' must be a string, got {type(tag).__name__}"
    return None


@dataclass
class GenEvalResult:
    """``correct``: GenEval's strict verdict; ``clauses``: one bool per include clause then per exclude
    clause; ``reasons``: why clauses failed (GenEval's messages)."""

    correct: bool
    clauses: list[bool] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    @property
    def partial(self) -> float:
        """Fraction of clauses that hold."""
        return sum(self.clauses) / len(self.clauses) if self.clauses else float(self.correct)


def verdict_details(metadata: Mapping[str, Any], result: GenEvalResult,
                    objects: Mapping[str, Sequence[Detection]]) -> dict[str, Any]:
    """One sample's ``last_details`` entry of a GenEval-rule reward: tag, verdict, clauses, the failure reasons and
    how many detections of each class were kept."""
    return {"tag": metadata.get("tag"), "correct": result.correct, "partial": result.partial,
            "clauses": result.clauses, "reason": "\n".join(result.reasons),
            "detected": {k: len(v) for k, v in objects.items()}}


def evaluate_geneval(
    objects: Mapping[str, Sequence[Detection]],
    metadata: Mapping[str, Any],
    classify_colors: Callable[[str, Sequence[Detection]], list[str]] | None = None,
    position_threshold: float = 0.1,
) -> GenEvalResult:
    """Apply GenEval's rules to the kept detections ``objects`` (class -> detections, most confident first,
    as :func:`select_detections` returns). ``classify_colors(class, objects)`` names each object's colour;
    it is needed only when a clause has a ``color``."""
    reason = check_geneval_metadata(metadata)
    if reason:
        raise ValueError(reason)
    objects = {canonical_class(k): list(v) for k, v in objects.items()}
    reasons: list[str] = []
    clauses: list[bool] = []
    matched_groups: list[list[Detection] | None] = []
    for req in metadata.get("include", []):
        name, count = canonical_class(req["class"]), int(req.get("count", 1))
        matched = True
        found = objects.get(name, [])[:count]
        if len(found) < count:
            matched = False
            reasons.append(f"expected {name}>={count}, found {len(found)}")
        else:
            if "color" in req:
                if classify_colors is None:
                    raise ValueError("a clause has a colour but no colour classifier was given")
                colors = list(classify_colors(name, found))
                hits = colors.count(req["color"])
                if hits < count:
                    matched = False
                    reasons.append(
                        f"expected {req['color']} {name}>={count}, found {hits} {req['color']}; and "
                        + ", ".join(f"{colors.count(c)} {c}" for c in COLORS if c in colors))
            if "position" in req and matched:
                relation, target = req["position"]
                if matched_groups[target] is None:
                    matched = False
                    reasons.append(f"no target for {name} to be {relation}")
                else:
                    for obj in found:
                        for target_obj in matched_groups[target]:
                            true_rels = relative_position(obj.box, target_obj.box, position_threshold)
                            if relation not in true_rels:
                                matched = False
                                reasons.append(f"expected {name} {relation} target, found "
                                               f"{' and '.join(sorted(true_rels))} target")
                                break
                        if not matched:
                            break
        matched_groups.append(found if matched else None)
        clauses.append(matched)
    for req in metadata.get("exclude", []):
        name, count = canonical_class(req["class"]), int(req.get("count", 1))
        n = len(objects.get(name, []))
        ok = n < count
        if not ok:
            reasons.append(f"expected {name}<{count}, found {n}")
        clauses.append(ok)
    return GenEvalResult(correct=all(clauses), clauses=clauses, reasons=reasons)


def flow_grpo_geneval_score(
    objects: Mapping[str, Sequence[Detection]],
    metadata: Mapping[str, Any],
    classify_colors: Callable[[str, Sequence[Detection]], list[str]] | None = None,
    position_threshold: float = 0.1,
) -> tuple[bool, float]:
    """Flow-GRPO's GenEval training reward (Liu et al. 2025, arXiv 2505.05470), as its reward server's
    ``evaluate_reward`` computes it from the same kept detections: ``(strict_correct, score)``.

    ``score`` is the mean of a list of terms built per include clause (exclude clauses are not read):

    * ``1 - |count - n| / count`` with ``n`` all kept detections of the class (negative when ``n > 2 count``);
    * if ``n != count``: one ``0`` more when the clause has a colour or a position, and the clause fails;
    * else, with a colour: ``1 - |count - hits| / count`` over the colours of all ``n`` objects (the clause fails
      unless ``hits == count``); with a position (the clause still matched): ``0`` when the target clause failed,
      else a ``0`` at the first object pair not in the relation, and then (the anchor's code, whatever the check
      found) a ``1``.

    ``strict_correct`` needs exact counts, colours and relations for every include clause. No include clause:
    ``(True, 0.0)``, as the anchor.
    """
    reason = check_geneval_metadata(metadata)
    if reason:
        raise ValueError(reason)
    objects = {canonical_class(k): list(v) for k, v in objects.items()}
    correct = True
    terms: list[float] = []
    matched_groups: list[list[Detection] | None] = []
    for req in metadata.get("include", []):
        name, count = canonical_class(req["class"]), int(req.get("count", 1))
        found = objects.get(name, [])
        matched = len(found) == count
        terms.append(1.0 - abs(count - len(found)) / count)
        if not matched:
            if "color" in req or "position" in req:
                terms.append(0.0)
        else:
            if "color" in req:
                if classify_colors is None:
                    raise ValueError("a clause has a colour but no colour classifier was given")
                hits = list(classify_colors(name, found)).count(req["color"])
                terms.append(1.0 - abs(count - hits) / count)
                matched = hits == count
            if "position" in req and matched:
                relation, target = req["position"]
                if matched_groups[target] is None:
                    matched = False
                    terms.append(0.0)
                else:
                    matched = all(relation in relative_position(obj.box, other.box, position_threshold)
                                  for obj in found for other in matched_groups[target])
                    if not matched:
                        terms.append(0.0)
                    terms.append(1.0)
        correct = correct and matched
        matched_groups.append(found if matched else None)
    return correct, (sum(terms) / len(terms) if terms else 0.0)


def geneval_summary(tags: Sequence[str], correct: Sequence[float | bool]) -> dict[str, Any]:
    """GenEval's benchmark score (``summary_scores.py``): the mean over tags of each tag's accuracy.

    Returns ``{"overall": mean of the per-tag accuracies, "per_tag": {tag: accuracy}, "counts":
    {tag: n}, "image_accuracy": mean over images, "missing_tags": [of the six, those absent]}``. NaN
    entries of ``correct`` (images that could not be judged) are left out and counted in
    ``"num_unjudged"``."""
    if len(tags) != len(correct):
        raise ValueError(f"got {len(tags)} tags but {len(correct)} results")
    per: dict[str, list[float]] = {}
    unjudged = 0
    for tag, c in zip(tags, correct):
        c = float(c)
        if math.isnan(c):
            unjudged += 1
            continue
        per.setdefault(str(tag), []).append(c)
    per_tag = {t: float(np.mean(v)) for t, v in per.items()}
    flat = [c for v in per.values() for c in v]
    return {
        "overall": float(np.mean(list(per_tag.values()))) if per_tag else float("nan"),
        "per_tag": per_tag,
        "counts": {t: len(v) for t, v in per.items()},
        "image_accuracy": float(np.mean(flat)) if flat else float("nan"),
        "missing_tags": [t for t in TAGS if t not in per_tag],
        "num_unjudged": unjudged,
    }


def color_crop(image: Image.Image, obj: Detection, bgcolor: str = "#999", crop: bool = True) -> Image.Image:
    """GenEval's ``ImageCrops``: outside the instance mask, pixels become ``bgcolor`` (``"original"`` keeps
    them); then the box is cropped (PIL rounds the box)."""
    image = image if image.mode == "RGB" else image.convert("RGB")
    if obj.mask is not None:
        mask = np.asarray(obj.mask, dtype=bool)
        if mask.shape != (image.height, image.width):
            raise ValueError(f"mask shape {mask.shape} does not match the image {(image.height, image.width)}")
        blank = image.copy() if bgcolor == "original" else Image.new("RGB", image.size, color=bgcolor)
        image = Image.composite(image, blank, Image.fromarray(mask))
    if crop:
        image = image.crop(tuple(float(v) for v in obj.box[:4]))
    return image


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def _load_image_processor(source: str, what: str, kwarg: str):
    from transformers import AutoImageProcessor

    _check_available(source, _IMAGE_PROCESSOR_FILES, what, kwarg)
    try:
        return AutoImageProcessor.from_pretrained(source)
    except OSError as exc:
        raise MissingWeightsError(f"could not load the {what} {source!r}: {exc}; pass {kwarg}=<local dir>.") from exc


def _load_model(cls, source: str, what: str, kwarg: str, dtype):
    return load_pretrained(cls, source, _MODEL_FILES, what, kwarg, dtype=dtype or torch.float32)


def _place(model, device, dtype):
    if device is not None or dtype is not None:
        model = model.to(device=None if device is None else torch.device(device), dtype=dtype)
    return model.eval().requires_grad_(False)


def mask_to_box(masks: torch.Tensor) -> torch.Tensor:
    """mmdetection's ``mask2bbox``: ``[N, H, W]`` bool -> ``[N, 4]`` ``(x_min, y_min, x_max + 1, y_max + 1)``;
    zeros for an empty mask."""
    boxes = torch.zeros((masks.shape[0], 4), dtype=torch.float32, device=masks.device)
    if masks.shape[0] == 0:
        return boxes
    x_any, y_any = masks.any(dim=1), masks.any(dim=2)
    width, height = masks.shape[2], masks.shape[1]
    xs = torch.arange(width, device=masks.device)
    ys = torch.arange(height, device=masks.device)
    big = max(width, height) + 1
    x_min = torch.where(x_any, xs, big).min(dim=1).values
    x_max = torch.where(x_any, xs, -1).max(dim=1).values
    y_min = torch.where(y_any, ys, big).min(dim=1).values
    y_max = torch.where(y_any, ys, -1).max(dim=1).values
    nonempty = x_any.any(dim=1) & y_any.any(dim=1)
    stacked = torch.stack([x_min, y_min, x_max + 1, y_max + 1], dim=1).float()
    boxes[nonempty] = stacked[nonempty]
    return boxes


class Mask2FormerDetector:
    """``detector(pil_images, classes=None, min_score=0.0) -> [[Detection, ...], ...]`` with
    ``Mask2FormerForUniversalSegmentation``, scored as mmdetection's instance post-processing (see the
    module docstring). ``classes`` is ignored (closed vocabulary)."""

    def __init__(self, model: str | os.PathLike | torch.nn.Module = DEFAULT_DETECTOR, processor: Any = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 batch_size: int = 8, max_per_image: int = 100):
        from transformers import Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessor

        dtype = resolve_dtype(dtype)
        if isinstance(model, (str, os.PathLike)):
            source = os.fspath(model)
            model = _load_model(Mask2FormerForUniversalSegmentation, source, "Mask2Former detector", "detector", dtype)
            processor = source if processor is None else processor
            device = resolve_device(device)
        if isinstance(processor, (str, os.PathLike)):
            processor = _load_image_processor(os.fspath(processor), "Mask2Former image processor", "detector_processor")
        if processor is None:
            processor = Mask2FormerImageProcessor()
        self.model = _place(model, device, dtype)
        self.processor = processor
        self.batch_size = int(batch_size)
        self.max_per_image = int(max_per_image)
        id2label = getattr(self.model.config, "id2label", None) or {}
        n = self.model.config.num_labels
        self.labels = [canonical_class(id2label.get(i, id2label.get(str(i), f"class_{i}"))) for i in range(n)]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def postprocess(self, class_logits: torch.Tensor, mask_logits: torch.Tensor, padded_hw: tuple[int, int],
                    resized_hw: tuple[int, int], original_hw: tuple[int, int],
                    min_score: float = 0.0) -> list[Detection]:
        """One image's ``class_queries_logits [Q, C+1]`` and ``masks_queries_logits [Q, h, w]`` -> detections
        with score ``> min_score``, most confident first."""
        scores = class_logits.float().softmax(-1)[:, :-1]
        num_classes = scores.shape[1]
        k = min(self.max_per_image, scores.numel())
        top, index = scores.flatten().topk(k)
        # score = class prob x mask score <= class prob: pairs at or under min_score can never pass
        candidates = top > min_score
        if not candidates.any():
            return []
        top, index = top[candidates], index[candidates]
        labels, queries = index % num_classes, index // num_classes
        masks = mask_logits[queries].float().unsqueeze(0)
        masks = F.interpolate(masks, size=tuple(padded_hw), mode="bilinear", align_corners=False)
        masks = masks[:, :, : resized_hw[0], : resized_hw[1]]
        masks = F.interpolate(masks, size=tuple(original_hw), mode="bilinear", align_corners=False)[0]
        binary = masks > 0
        mask_scores = (masks.sigmoid() * binary).flatten(1).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
        det_scores = top * mask_scores
        keep = (det_scores > min_score).nonzero().flatten()
        keep = keep[det_scores[keep].argsort(descending=True)]
        boxes = mask_to_box(binary[keep]).cpu()
        out = []
        for j, b in zip(keep.tolist(), boxes.tolist()):
            out.append(Detection(label=self.labels[int(labels[j])], score=float(det_scores[j]),
                                 box=tuple(b), mask=binary[j].cpu().numpy()))
        return out

    @torch.inference_mode()
    def __call__(self, images: Sequence[Image.Image], classes: Sequence[Sequence[str]] | None = None,
                 min_score: float = 0.0) -> list[list[Detection]]:
        results: list[list[Detection]] = []
        for start in range(0, len(images), self.batch_size):
            part = [im if im.mode == "RGB" else im.convert("RGB") for im in images[start:start + self.batch_size]]
            inputs = self.processor(images=part, return_tensors="pt")
            pixel_values = inputs["pixel_values"].to(self.device, self.dtype)
            pixel_mask = inputs.get("pixel_mask")
            kwargs = {"pixel_values": pixel_values}
            if pixel_mask is not None:
                kwargs["pixel_mask"] = pixel_mask.to(self.device)
            out = self.model(**kwargs)
            padded = tuple(pixel_values.shape[-2:])
            for k, image in enumerate(part):
                if pixel_mask is not None:
                    resized = (int(pixel_mask[k].any(1).sum()), int(pixel_mask[k].any(0).sum()))
                else:
                    resized = padded
                results.append(self.postprocess(out.class_queries_logits[k], out.masks_queries_logits[k], padded,
                                                resized, (image.height, image.width), min_score))
        return results


class OwlDetector:
    """Open-vocabulary detection with ``OwlViTForObjectDetection`` / ``Owlv2ForObjectDetection``:
    ``detector(pil_images, classes=[[name, ...], ...], min_score)``; each image is queried with
    ``query_template.format(name)`` for its classes; per predicted box the best query's sigmoid score and
    label; boxes in original pixels (OWLv2 pads images to a square at the bottom/right, so its normalised
    boxes are scaled by the longer side), clipped to the image. No masks."""

    def __init__(self, model: str | os.PathLike | torch.nn.Module = DEFAULT_OWL, processor: Any = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 batch_size: int = 8, query_template: str = "a photo of a {}"):
        from transformers import AutoModelForZeroShotObjectDetection, AutoProcessor

        dtype = resolve_dtype(dtype)
        if isinstance(model, (str, os.PathLike)):
            source = os.fspath(model)
            model = _load_model(AutoModelForZeroShotObjectDetection, source, "OWL detector", "detector", dtype)
            processor = source if processor is None else processor
            device = resolve_device(device)
        if isinstance(processor, (str, os.PathLike)):
            processor = load_pretrained(AutoProcessor, processor, _CLIP_PROCESSOR_FILES, "OWL processor",
                                        "detector_processor", needs="preprocessor_config.json and tokenizer files")
        if processor is None:
            raise ValueError("an OWL detector built from a module needs its processor (detector_processor=...)")
        self.model = _place(model, device, dtype)
        self.processor = processor
        self.batch_size = int(batch_size)
        self.query_template = query_template
        self.square = "owlv2" in str(getattr(self.model.config, "model_type", "")).lower()
        text_cfg = getattr(self.model.config, "text_config", None)
        self.max_length = int(getattr(text_cfg, "max_position_embeddings", 16))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def __call__(self, images: Sequence[Image.Image], classes: Sequence[Sequence[str]] | None = None,
                 min_score: float = 0.0) -> list[list[Detection]]:
        if classes is None or len(classes) != len(images):
            raise ValueError("an open-vocabulary detector needs, per image, the class names to look for")
        results: list[list[Detection]] = []
        for start in range(0, len(images), self.batch_size):
            part = [im if im.mode == "RGB" else im.convert("RGB") for im in images[start:start + self.batch_size]]
            names = [list(dict.fromkeys(canonical_class(c) for c in cls)) or ["object"]
                     for cls in classes[start:start + self.batch_size]]
            queries = [[self.query_template.format(n) for n in ns] for ns in names]
            inputs = self.processor(text=queries, images=part, return_tensors="pt", padding="max_length",
                                    truncation=True, max_length=self.max_length)
            inputs = {k: (v.to(self.device) if torch.is_tensor(v) else v) for k, v in inputs.items()}
            if "pixel_values" in inputs:
                inputs["pixel_values"] = inputs["pixel_values"].to(next(self.model.parameters()).dtype)
            out = self.model(**inputs)
            logits, boxes = out.logits.float(), out.pred_boxes.float()
            for k, image in enumerate(part):
                q = len(names[k])
                probs = logits[k, :, :q].sigmoid()
                score, label = probs.max(dim=-1)
                keep = (score > min_score).nonzero().flatten()
                keep = keep[score[keep].argsort(descending=True)]
                w, h = image.width, image.height
                sx, sy = (max(w, h), max(w, h)) if self.square else (w, h)
                dets = []
                for j in keep.tolist():
                    cx, cy, bw, bh = boxes[k, j].tolist()
                    x1, y1 = (cx - bw / 2) * sx, (cy - bh / 2) * sy
                    x2, y2 = (cx + bw / 2) * sx, (cy + bh / 2) * sy
                    box = (min(max(x1, 0.0), w), min(max(y1, 0.0), h), min(max(x2, 0.0), w), min(max(y2, 0.0), h))
                    dets.append(Detection(label=names[k][int(label[j])], score=float(score[j]), box=box))
                results.append(dets)
        return results


class ClipColorClassifier:
    """``classifier(crops, class_name) -> [colour, ...]``: CLIP zero-shot over :data:`COLORS` with
    :data:`COLOR_TEMPLATES` (clip_benchmark's classifier: per colour, mean of the normalised template
    embeddings, renormalised; argmax of ``image_embedding @ weights``). One text forward per class name
    (cached)."""

    def __init__(self, model: str | os.PathLike | torch.nn.Module = DEFAULT_CLIP, processor: Any = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 colors: Sequence[str] = COLORS, templates: Sequence[str] = COLOR_TEMPLATES, batch_size: int = 16):
        from transformers import CLIPModel, CLIPProcessor

        dtype = resolve_dtype(dtype)
        if isinstance(model, (str, os.PathLike)):
            source = os.fspath(model)
            model = _load_model(CLIPModel, source, "CLIP colour classifier", "clip_model", dtype)
            processor = source if processor is None else processor
            device = resolve_device(device)
        if isinstance(processor, (str, os.PathLike)):
            source = os.fspath(processor)
            # backend pil: PIL resizing, as the anchors' processors (transformers 4, open_clip)
            processor = load_pretrained(CLIPProcessor, source, _CLIP_PROCESSOR_FILES, "CLIP processor",
                                        "clip_processor", needs="preprocessor_config.json and tokenizer files",
                                        backend="pil")
        if processor is None:
            raise ValueError("a CLIP model passed in built needs its processor (clip_processor=...)")
        for attr in ("get_image_features", "get_text_features"):
            if not hasattr(model, attr):
                raise TypeError(f"clip_model must be a transformers CLIPModel; {type(model).__name__} has no {attr}")
        self.model = _place(model, device, dtype)
        self.processor = processor
        self.colors = list(colors)
        self.templates = list(templates)
        self.batch_size = int(batch_size)
        self._weights: dict[str, torch.Tensor] = {}
        text_cfg = getattr(getattr(self.model, "config", None), "text_config", None)
        self.max_length = int(min(77, getattr(text_cfg, "max_position_embeddings", 77)))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.inference_mode()
    def weights(self, classname: str) -> torch.Tensor:
        """The zero-shot classifier ``[D, len(colors)]`` for ``classname`` (cached)."""
        if classname not in self._weights:
            texts = [t.format(c=c, cls=classname) for c in self.colors for t in self.templates]
            tokens = self.processor.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                                              return_tensors="pt")
            tokens = {k: v.to(self.device) for k, v in tokens.items() if k in ("input_ids", "attention_mask")}
            emb = _embedding(self.model.get_text_features(**tokens)).float()
            emb = F.normalize(emb, dim=-1).view(len(self.colors), len(self.templates), -1).mean(dim=1)
            emb = F.normalize(emb, dim=-1)
            self._weights[classname] = emb.T.contiguous()
        return self._weights[classname]

    @torch.inference_mode()
    def __call__(self, crops: Sequence[Image.Image], classname: str) -> list[str]:
        if not crops:
            return []
        from mmrl.eval.t2i_compbench import clip_pixels

        weights = self.weights(classname)
        chunks = []
        for start in range(0, len(crops), self.batch_size):
            # open_clip's ViT-L-14 "openai" transform, as evaluate_images.py preprocesses the crops (torchvision's
            # centre crop rounds its offset, transformers' floors it: a pixel apart in a fifth of the crops)
            pixels = clip_pixels(list(crops[start:start + self.batch_size]), self.processor.image_processor)
            emb = _embedding(self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype))).float()
            chunks.append(F.normalize(emb, dim=-1))
        logits = 100.0 * torch.cat(chunks) @ weights
        return [self.colors[i] for i in logits.argmax(dim=1).tolist()]


def _build_detector(detector, processor, device, dtype, batch_size):
    if isinstance(detector, (Mask2FormerDetector, OwlDetector)) or (
            callable(detector) and not isinstance(detector, (str, os.PathLike, torch.nn.Module))):
        return detector
    if isinstance(detector, torch.nn.Module):
        kind = str(getattr(getattr(detector, "config", None), "model_type", "")).lower()
        cls = OwlDetector if kind.startswith("owl") else Mask2FormerDetector
        return cls(detector, processor, device=device, dtype=dtype, batch_size=batch_size)
    source = os.fspath(detector)
    _check_available(source, [[["config.json"]]], "GenEval detector", "detector")
    from transformers import AutoConfig

    try:
        kind = AutoConfig.from_pretrained(source).model_type
    except OSError as exc:
        raise MissingWeightsError(f"could not read the detector config {source!r}: {exc}") from exc
    if kind == "mask2former":
        return Mask2FormerDetector(source, processor, device=device, dtype=dtype, batch_size=batch_size)
    if kind in ("owlvit", "owlv2"):
        return OwlDetector(source, processor, device=device, dtype=dtype, batch_size=batch_size)
    raise ValueError(f"detector {source!r} is a {kind!r} model; GenEval supports Mask2Former (mask2former) and "
                     "OWL-ViT / OWLv2 (owlvit, owlv2) checkpoints, or a callable detector")


# --------------------------------------------------------------------------------------------
# The reward
# --------------------------------------------------------------------------------------------


@register_reward("geneval")
class GenEval(Reward):
    """GenEval compositional reward (strict 0/1 by default); see the module docstring for the rules.

    Returns the main score (``variant``) plus ``"strict"`` and ``"partial"`` for every judged sample.
    ``last_details`` holds, per sample, GenEval's verdict, failure reasons and detection counts.
    """

    needs_prompts = False
    default_variant = "strict"
    #: what ``mmrl config validate`` asks of each prompt's metadata (None: scorable; else why every sample is NaN)
    check_metadata = staticmethod(check_geneval_metadata)

    def __init__(
        self,
        detector: str | os.PathLike | torch.nn.Module | Callable = DEFAULT_DETECTOR,
        detector_processor: Any = None,
        clip_model: str | os.PathLike | torch.nn.Module | Callable = DEFAULT_CLIP,
        clip_processor: Any = None,
        variant: str | None = None,
        threshold: float = 0.3,
        counting_threshold: float = 0.9,
        max_objects: int = 16,
        max_overlap: float = 1.0,
        position_threshold: float = 0.1,
        bgcolor: str = "#999",
        crop: bool = True,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 8,
    ):
        """Args:
        detector: hub id or local directory of a Mask2Former (default, COCO instance) or OWL-ViT / OWLv2
            checkpoint, a built model of those classes, a :class:`Mask2FormerDetector` / :class:`OwlDetector`,
            or any callable ``(pil_images, classes=..., min_score=...) -> [[Detection, ...], ...]``.
        detector_processor: its image processor (hub id / dir / built); default: the checkpoint's own.
        clip_model: colour classifier: hub id / dir of a transformers ``CLIPModel`` (default
            ``openai/clip-vit-large-patch14``), a built ``CLIPModel`` (then ``clip_processor`` is required), a
            :class:`ClipColorClassifier`, or a callable ``(crops, class_name) -> [colour, ...]``.
        variant: ``"strict"`` (0/1, default for ``geneval``), ``"partial"`` (fraction of clauses that
            hold; default for ``geneval_partial``) or ``"flow_grpo"`` (Flow-GRPO's graded training score,
            :func:`flow_grpo_geneval_score`, returned with ``flow_grpo_strict``, its exact-count verdict): which
            score is the main one.
        threshold, counting_threshold, max_objects, max_overlap, position_threshold: GenEval's options
            (0.3, 0.9, 16, 1.0, 0.1).
        bgcolor, crop: colour crops: background outside the mask (``"original"`` keeps the image) and
            whether to crop to the box (GenEval: ``#999``, crop).
        device, dtype: where the models run (default CUDA if available) and their dtype.
        batch_size: images per detector forward.
        """
        super().__init__()
        variant = variant or self.default_variant
        if variant not in ("strict", "partial", "flow_grpo"):
            raise ValueError(f"variant must be 'strict', 'partial' or 'flow_grpo', got {variant!r}")
        self.variant = variant
        self.threshold = float(threshold)
        self.counting_threshold = float(counting_threshold)
        self.max_objects = int(max_objects)
        self.max_overlap = float(max_overlap)
        self.position_threshold = float(position_threshold)
        self.bgcolor = bgcolor
        self.crop = bool(crop)
        self.detector = _build_detector(detector, detector_processor, device, dtype, batch_size)
        if isinstance(clip_model, ClipColorClassifier) or (
                callable(clip_model) and not isinstance(clip_model, (str, os.PathLike, torch.nn.Module))):
            self.color_classifier = clip_model
        else:
            self.color_classifier = ClipColorClassifier(clip_model, clip_processor, device=device, dtype=dtype)
        self.last_details: list[dict | None] = []

    def _classify_colors(self, image: Image.Image):
        """The colour classifier of one image's objects; each object is classified once per class name, however
        many rules ask (GenEval's verdict and Flow-GRPO's graded score read the same objects)."""
        # keyed by identity; each entry holds its object, so no id is reused while the cache lives
        known: dict[tuple[str, int], tuple[Detection, str | None]] = {}

        def classify(classname: str, objects: Sequence[Detection]) -> list[str]:
            todo = [obj for obj in objects if (classname, id(obj)) not in known]
            crops = [color_crop(image, obj, self.bgcolor, self.crop) for obj in todo]
            ok = [k for k, c in enumerate(crops) if c.width > 0 and c.height > 0]
            for obj in todo:
                known[classname, id(obj)] = (obj, None)  # an empty crop has no colour (never matches)
            if ok:
                for k, c in zip(ok, self.color_classifier([crops[k] for k in ok], classname)):
                    known[classname, id(todo[k])] = (todo[k], c)
            return [known[classname, id(obj)][1] for obj in objects]
        return classify

    def _detect(self, images: list[Image.Image], classes: list[list[str]], min_score: float):
        """Detections per image; a failing batch is retried image by image so one bad image is one NaN."""
        try:
            return list(self.detector(images, classes=classes, min_score=min_score)), [None] * len(images)
        except Exception:
            if len(images) == 1:
                raise
        dets, errors = [], []
        for image, cls in zip(images, classes):
            try:
                dets.append(list(self.detector([image], classes=[cls], min_score=min_score))[0])
                errors.append(None)
            except Exception as exc:
                dets.append(None)
                errors.append(f"detector failed: {type(exc).__name__}: {exc}")
        return dets, errors

    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        valid = batch.valid_indices
        strict = torch.full((len(valid),), float("nan"))
        partial = torch.full((len(valid),), float("nan"))
        graded = torch.full((len(valid),), float("nan"))
        graded_strict = torch.full((len(valid),), float("nan"))
        details: list[dict | None] = [None] * batch.n
        todo: list[int] = []
        for pos, i in enumerate(valid):
            meta = batch.metadata[i] if batch.metadata is not None else None
            problem = check_geneval_metadata(meta)
            if problem:
                reasons[i] = problem
            else:
                todo.append(pos)
        if todo:
            pils = batch.pil()
            images = [pils[pos] for pos in todo]
            metas = [batch.metadata[valid[pos]] for pos in todo]
            classes = [[c["class"] for c in m.get("include", [])] + [c["class"] for c in m.get("exclude", [])]
                       for m in metas]
            min_score = min(self.threshold, self.counting_threshold)
            try:
                detections, errors = self._detect(images, classes, min_score)
            except Exception as exc:
                detections, errors = [None], [f"detector failed: {type(exc).__name__}: {exc}"]
            for pos, image, meta, dets, err in zip(todo, images, metas, detections, errors):
                i = valid[pos]
                if err is not None:
                    reasons[i] = err
                    continue
                try:
                    objects = select_detections(dets, meta.get("tag"), self.threshold, self.counting_threshold,
                                                self.max_objects, self.max_overlap)
                    classify = self._classify_colors(image)
                    result = evaluate_geneval(objects, meta, classify, self.position_threshold)
                    if self.variant == "flow_grpo":
                        fg_correct, graded[pos] = flow_grpo_geneval_score(objects, meta, classify,
                                                                          self.position_threshold)
                        graded_strict[pos] = float(fg_correct)
                except Exception as exc:  # one sample's failure is its NaN, not the batch's
                    reasons[i] = f"GenEval scoring failed: {type(exc).__name__}: {exc}"
                    continue
                strict[pos] = float(result.correct)
                partial[pos] = result.partial
                details[i] = verdict_details(meta, result, objects)
        self.last_details = details
        if self.variant == "flow_grpo":
            return {self.name: graded, "strict": strict, "partial": partial, "flow_grpo_strict": graded_strict}
        main = strict if self.variant == "strict" else partial
        return {self.name: main, "strict": strict, "partial": partial}


@register_reward("geneval_partial")
class GenEvalPartial(GenEval):
    """:class:`GenEval` whose main score is the fraction of satisfied clauses."""

    default_variant = "partial"
