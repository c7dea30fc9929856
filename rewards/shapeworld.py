"""ShapeWorld's evaluator and reward: GenEval's rules on detections found without learned weights (mmrl's own;
GitHub issue 11; the world is :mod:`mmrl.data.shapeworld`).

:func:`detect` turns an image into GenEval detections (:class:`mmrl.rewards.geneval.Detection`, with the colour of
each one known), in four steps, all numpy / ``scipy.ndimage``:

1. **colour segmentation**: a pixel ``p`` takes the named colour ``c`` (:data:`~mmrl.data.shapeworld.COLORS`) when
   it lies near the line from the background ``b`` (:data:`~mmrl.data.shapeworld.BACKGROUND`) to ``c``, at least half
   way along it: coverage ``alpha = (p - b) . (c - b) / |c - b|^2`` in [0.5, 1.5] and Euclidean RGB distance from
   ``b + alpha (c - b)`` at most ``color_threshold`` (default :data:`COLOR_THRESHOLD` = 60, under half the smallest
   distance between two palette entries, 130); of several such colours the nearest line wins; every other pixel is
   background. A blurred edge pixel is a mixture of the shape's colour and the background, so the half-way rule
   keeps exactly the pixels a shape covers at least half of, and a blurred shape keeps its extent; pixels far from
   every named colour (orange, noise) are background;
2. **connected components** per colour (``scipy.ndimage.label``, 4-connectivity), holes filled
   (``binary_fill_holes``; no shape has holes); components whose box is under ``min_side`` pixels on a side (default
   4 px at 32 px, scaled with the image) are dropped;
3. **shape classification** against templates: in the component's box (``x2``/``y2`` exclusive, as mmdetection's
   ``mask2bbox``) the renderer's own masks of the three shapes (:func:`~mmrl.data.shapeworld.shape_mask`) are made
   and ``iou_s = IoU(component, template_s)``; the label is the best-matching shape;
4. **confidence** (in (0, 1]; components scoring 0 are left out): how clearly the component is that shape and not
   the runner-up, ``clarity = (iou_best - iou_second) / (1 - IoU(template_best, template_second))`` clipped to
   [0, 1] (1 for a perfectly rendered shape, whose IoU with the runner-up template is exactly the templates' own
   IoU; 0 for a blob halfway between two shapes), times an aspect factor ``clip((a - 0.5) / 0.4, 0, 1)`` with
   ``a = min(w, h) / max(w, h)`` (1 for square boxes: every ShapeWorld shape has one; 0 at 2:1 and beyond). The
   fill ratio of the box that separates the shapes (square 1, circle ~pi/4, triangle ~1/2) is what the IoUs
   measure; the templates also use where the pixels are (a triangle's empty upper corners). So GenEval's
   thresholds mean something: a detection counts (0.3) when it is closer to one shape than to the others by at
   least 30 % of the gap between the two, and counts in a counting prompt (0.9) only when it is nearly exact.

On rendered ground-truth scenes the boxes are exact and every score is 1 (``tests/test_shapeworld.py`` measures
that the verdicts are right on thousands of scenes of all six categories).

The reward ``shapeworld`` (``shapeworld_partial``: the partial score as the main one; ``shapeworld_soft``:
:func:`soft_score`, graded confidences for training, mmrl's own rule) scores an image against its
prompt's GenEval metadata with GenEval's rules, as :class:`mmrl.rewards.geneval.GenEval` does, with this detector
in place of Mask2Former and each detection's segmented colour in place of CLIP's colour classifier:
:func:`~mmrl.rewards.geneval.select_detections` (confidence ``> threshold`` 0.3, ``counting_threshold`` 0.9 for
the ``counting`` tag, at most 16 per class) then :func:`~mmrl.rewards.geneval.evaluate_geneval`. Keys: the main
score, ``strict`` (GenEval's ``correct``: 1 iff every clause holds), ``partial`` (the fraction of clauses that
hold) and ``soft`` (:func:`soft_score`). A sample whose metadata is not GenEval's, or names a class or colour
ShapeWorld does not have (which no image could satisfy), is NaN with the reason.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from PIL import Image

from ._base import ImageBatch, Reward, register_reward
from .geneval import (Detection, GenEvalResult, check_geneval_metadata, evaluate_geneval, select_detections,
                      verdict_details)

__all__ = ["COLOR_THRESHOLD", "MIN_SIDE", "ShapeDetection", "detect", "classify", "check_shapeworld_metadata",
           "score_image", "soft_score", "ShapeWorldReward", "ShapeWorldPartial", "ShapeWorldSoft"]

#: Largest RGB distance from the background -> colour line at which a pixel still has that colour.
COLOR_THRESHOLD = 60.0
#: Smallest box side (pixels at 32 px, scaled with the image's smaller side) of a kept component.
MIN_SIDE = 4
#: A pixel takes colour ``c`` when it is at least half way from the background to ``c`` (and at most 1.5 times as far).
_MIN_COVERAGE, _MAX_COVERAGE = 0.5, 1.5
#: 4-connectivity (``scipy.ndimage.generate_binary_structure(2, 1)``).
_FOUR = np.array([[0, 1, 0], [1, 1, 1], [0, 1, 0]], dtype=bool)


@dataclass
class ShapeDetection(Detection):
    """A :class:`~mmrl.rewards.geneval.Detection` with its segmented ``color`` and the template IoUs behind its
    label and score (``ious``: shape -> IoU)."""

    color: str | None = None
    ious: dict | None = None


def _pixels(image: Any) -> np.ndarray:
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"))
    if isinstance(image, np.ndarray) and image.ndim == 3 and image.shape[-1] == 3:
        if image.dtype == np.uint8:
            return image
        if np.issubdtype(image.dtype, np.floating):
            return (np.clip(image, 0.0, 1.0) * 255).round().astype(np.uint8)
    raise TypeError(f"detect needs a PIL image or an [H, W, 3] array (uint8, or float in [0, 1]), got "
                    f"{type(image).__name__}{getattr(image, 'shape', '')}")


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return float(np.logical_and(a, b).sum() / union) if union else 0.0


@functools.lru_cache(maxsize=4096)
def _templates(width: int, height: int) -> tuple[dict[str, np.ndarray], dict[tuple[str, str], float]]:
    """The three shape templates of a ``width x height`` box and their pairwise IoUs (cached)."""
    from mmrl.data.shapeworld import SHAPES, shape_mask

    templates = {s: shape_mask(s, width, height) for s in SHAPES}
    pairs = {(a, b): _iou(templates[a], templates[b]) for a in SHAPES for b in SHAPES if a != b}
    return templates, pairs


def classify(mask: np.ndarray) -> tuple[str, float, dict[str, float]]:
    """``(shape, confidence, {shape: IoU})`` of one component's boolean mask cropped to its box (see the module
    docstring, steps 3 and 4)."""
    h, w = mask.shape
    templates, pairs = _templates(w, h)
    area = int(mask.sum())
    ious = {}
    for s, t in templates.items():
        inter = int(np.count_nonzero(mask & t))
        union = area + int(np.count_nonzero(t)) - inter
        ious[s] = inter / union if union else 0.0
    best, second = sorted(templates, key=lambda s: -ious[s])[:2]
    gap = 1.0 - pairs[(best, second)]
    clarity = (ious[best] - ious[second]) / gap if gap > 1e-9 else 0.0
    aspect = min(w, h) / max(w, h)
    score = float(np.clip(clarity, 0.0, 1.0) * np.clip((aspect - 0.5) / 0.4, 0.0, 1.0))
    return best, score, ious


def detect(image: Any, *, color_threshold: float = COLOR_THRESHOLD, min_side: int | None = None
           ) -> list[ShapeDetection]:
    """GenEval detections of the shapes in ``image`` (PIL, or ``[H, W, 3]`` uint8 / float in [0, 1]), most confident
    first: label (shape), score in (0, 1], box ``(x1, y1, x2, y2)`` pixels (``x2``/``y2`` exclusive), the instance
    mask ``[H, W]``, ``color`` and the template IoUs. No learned weights; the method is the module docstring's."""
    from scipy import ndimage

    from mmrl.data.shapeworld import BACKGROUND, COLORS, IMAGE_SIZE

    pixels = _pixels(image).astype(np.float32)
    height, width = pixels.shape[:2]
    names = list(COLORS)
    background = np.asarray(BACKGROUND, dtype=np.float32)
    directions = np.asarray(list(COLORS.values()), dtype=np.float32) - background  # [K, 3]
    offset = pixels - background  # [H, W, 3]
    # coverage of each colour along its background -> colour line, and the distance off that line
    dots = offset @ directions.T  # [H, W, K]
    lengths = (directions ** 2).sum(-1)
    alpha = dots / lengths
    # squared distance to the line's point alpha: |offset|^2 - (offset . d)^2 / |d|^2
    residual = np.sqrt(np.maximum((offset ** 2).sum(-1)[..., None] - dots * alpha, 0.0))
    eligible = (alpha >= _MIN_COVERAGE) & (alpha <= _MAX_COVERAGE) & (residual <= float(color_threshold))
    residual = np.where(eligible, residual, np.inf)
    nearest = residual.argmin(axis=-1)
    label_map = np.where(eligible.any(axis=-1), nearest + 1, 0)
    side = MIN_SIDE if min_side is None else int(min_side)
    if min_side is None:
        side = max(1, int(round(MIN_SIDE * min(height, width) / IMAGE_SIZE)))
    found: list[ShapeDetection] = []
    for k in np.unique(label_map).tolist():
        if k == 0:
            continue
        name = names[k - 1]
        components, _ = ndimage.label(label_map == k, structure=_FOUR)
        for j, window in enumerate(ndimage.find_objects(components), start=1):
            if window is None:
                continue
            ys, xs = window
            if ys.stop - ys.start < side or xs.stop - xs.start < side:
                continue
            part = ndimage.binary_fill_holes(components[window] == j, structure=_FOUR)
            shape, score, ious = classify(part)
            if score <= 0.0:
                continue
            mask = np.zeros((height, width), dtype=bool)
            mask[window] = part
            box = (float(xs.start), float(ys.start), float(xs.stop), float(ys.stop))
            found.append(ShapeDetection(label=shape, score=score, box=box, mask=mask, color=name, ious=ious))
    found.sort(key=lambda d: -d.score)
    return found


def check_shapeworld_metadata(metadata: Any) -> str | None:
    """None if ``metadata`` is GenEval metadata about ShapeWorld's shapes and colours, else the reason it is not."""
    from mmrl.data.shapeworld import COLORS, SHAPES

    problem = check_geneval_metadata(metadata)
    if problem:
        return problem
    for kind in ("include", "exclude"):
        for k, clause in enumerate(metadata.get(kind, [])):
            if clause["class"] not in SHAPES:
                return (f"{kind} clause {k} names {clause['class']!r}, not a ShapeWorld shape ({', '.join(SHAPES)}): "
                        f"no image can show it")
            if "color" in clause and clause["color"] not in COLORS:
                return (f"include clause {k} asks for {clause['color']!r}, not a ShapeWorld colour "
                        f"({', '.join(COLORS)}): no image can show it")
    return None


def _colors_of(_: str, found: Sequence[Detection]) -> list[str | None]:
    return [getattr(d, "color", None) for d in found]


def score_image(image: Any, metadata: Mapping[str, Any], *, threshold: float = 0.3, counting_threshold: float = 0.9,
                max_objects: int = 16, max_overlap: float = 1.0, position_threshold: float = 0.1,
                color_threshold: float = COLOR_THRESHOLD, min_side: int | None = None,
                detections: Sequence[ShapeDetection] | None = None
                ) -> tuple[GenEvalResult, dict[str, list[ShapeDetection]]]:
    """GenEval's verdict on one image: ``(result, kept detections per class)``. Bad metadata: ValueError.
    ``detections``: :func:`detect`'s output for ``image`` when already computed."""
    problem = check_shapeworld_metadata(metadata)
    if problem:
        raise ValueError(problem)
    dets = detect(image, color_threshold=color_threshold, min_side=min_side) if detections is None else detections
    objects = select_detections(dets, metadata.get("tag"), threshold, counting_threshold, max_objects, max_overlap)
    return evaluate_geneval(objects, metadata, _colors_of, position_threshold), objects


def soft_score(detections: Sequence[ShapeDetection], metadata: Mapping[str, Any], result: GenEvalResult) -> float:
    """A graded version of GenEval's partial score for training (mmrl's own rule, not GenEval's): the mean over
    clauses of

    * an ``include`` clause (class ``c``, ``count`` n, optional ``color``): the mean of the ``n`` highest detection
      confidences (:func:`classify`'s clarity x aspect, before any threshold; missing ones count 0) among the
      detections of ``c`` (of that colour when the clause names one), times 1 if GenEval's clause holds and 1/2 if
      it does not while it asks for a ``position`` (the objects are there but misplaced);
    * an ``exclude`` clause: GenEval's verdict (1 or 0).

    It is 1 exactly when every clause holds with perfectly drawn shapes, and it rises as a blob becomes more clearly
    the shape asked for, before the 0.3 / 0.9 thresholds are crossed: a signal for every sample where the strict
    and partial scores are 0 for most of a group."""
    values = []
    includes = metadata.get("include", [])
    for k, clause in enumerate(includes):
        count = int(clause.get("count", 1))
        found = sorted((d.score for d in detections if d.label == clause["class"]
                        and ("color" not in clause or getattr(d, "color", None) == clause["color"])), reverse=True)
        value = sum(found[:count]) / count
        if "position" in clause and not result.clauses[k]:
            value *= 0.5
        values.append(value)
    values += [float(ok) for ok in result.clauses[len(includes):]]
    return float(sum(values) / len(values)) if values else 0.0


@register_reward("shapeworld")
class ShapeWorldReward(Reward):
    """GenEval's rules with ShapeWorld's weightless detector (strict 0/1 by default; see the module docstring).

    Returns the main score (``variant``) plus ``"strict"`` and ``"partial"``; ``last_details`` holds per sample the
    verdict, the failure reasons and the kept detections (shape, colour, score, box)."""

    needs_prompts = False
    default_variant = "strict"
    #: what ``mmrl config validate`` asks of each prompt's metadata (None: scorable; else why every sample is NaN)
    check_metadata = staticmethod(check_shapeworld_metadata)

    def __init__(self, variant: str | None = None, threshold: float = 0.3, counting_threshold: float = 0.9,
                 max_objects: int = 16, max_overlap: float = 1.0, position_threshold: float = 0.1,
                 color_threshold: float = COLOR_THRESHOLD, min_side: int | None = None):
        """Args:
        variant: ``"strict"`` (default for ``shapeworld``), ``"partial"`` (default for ``shapeworld_partial``) or
            ``"soft"`` (default for ``shapeworld_soft``: :func:`soft_score`).
        threshold, counting_threshold, max_objects, max_overlap, position_threshold: GenEval's options
            (0.3, 0.9, 16, 1.0, 0.1).
        color_threshold: the largest RGB distance at which a pixel takes a named colour (60).
        min_side: the smallest kept component side in pixels (default 4 at 32 px, scaled with the image).
        """
        super().__init__()
        variant = variant or self.default_variant
        if variant not in ("strict", "partial", "soft"):
            raise ValueError(f"variant must be 'strict', 'partial' or 'soft', got {variant!r}")
        if not color_threshold > 0:
            raise ValueError(f"color_threshold must be > 0, got {color_threshold!r}")
        if min_side is not None and (isinstance(min_side, bool) or not isinstance(min_side, int) or min_side < 1):
            raise ValueError(f"min_side must be an integer >= 1 (or None), got {min_side!r}")
        self.variant = variant
        self.options = {"threshold": float(threshold), "counting_threshold": float(counting_threshold),
                        "max_objects": int(max_objects), "max_overlap": float(max_overlap),
                        "position_threshold": float(position_threshold), "color_threshold": float(color_threshold),
                        "min_side": min_side}
        self.last_details: list[dict | None] = []

    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        valid = batch.valid_indices
        strict = torch.full((len(valid),), float("nan"))
        partial = torch.full((len(valid),), float("nan"))
        soft = torch.full((len(valid),), float("nan"))
        details: list[dict | None] = [None] * batch.n
        pils = None
        for pos, i in enumerate(valid):
            meta = batch.metadata[i] if batch.metadata is not None else None
            problem = check_shapeworld_metadata(meta)
            if problem:
                reasons[i] = problem
                continue
            pils = pils if pils is not None else batch.pil()
            try:
                dets = detect(pils[pos], color_threshold=self.options["color_threshold"],
                              min_side=self.options["min_side"])
                result, objects = score_image(pils[pos], meta, **self.options, detections=dets)
                soft[pos] = soft_score(dets, meta, result)
            except Exception as exc:  # one sample's failure is its NaN, not the batch's
                reasons[i] = f"ShapeWorld scoring failed: {type(exc).__name__}: {exc}"
                continue
            strict[pos] = float(result.correct)
            partial[pos] = result.partial
            details[i] = {**verdict_details(meta, result, objects),
                          "detections": [{"shape": d.label, "color": getattr(d, "color", None),
                                          "score": round(float(d.score), 4), "box": [float(v) for v in d.box]}
                                         for v in objects.values() for d in v]}
        self.last_details = details
        main = {"strict": strict, "partial": partial, "soft": soft}[self.variant]
        return {self.name: main, "strict": strict, "partial": partial, "soft": soft}


@register_reward("shapeworld_partial")
class ShapeWorldPartial(ShapeWorldReward):
    """:class:`ShapeWorldReward` whose main score is the fraction of satisfied clauses."""

    default_variant = "partial"


@register_reward("shapeworld_soft")
class ShapeWorldSoft(ShapeWorldReward):
    """:class:`ShapeWorldReward` whose main score is :func:`soft_score` (graded detection confidences; mmrl's own)."""

    default_variant = "soft"
