"""ShapeWorld: a deterministic world of coloured shapes with exact ground truth (mmrl's own; GitHub issue 11).

A small, fully known world in which a text-to-image policy can be trained and judged without learned weights, and a
vision-language policy can be taught to ground, count and time things:

* **images** (:func:`render`): ``size x size`` RGB (default :data:`IMAGE_SIZE` = 32) on a plain :data:`BACKGROUND`,
  with :data:`SHAPES` (circle, square, triangle) filled in one of the named :data:`COLORS` (all GenEval colour
  names). Rasterised by pixel-centre tests in numpy (no anti-aliasing), so an image is a pure function of its
  :class:`Scene` and every shape's mask reaches exactly to its box (see :func:`shape_mask`);
* **prompts** (:func:`prompt_set`) in GenEval's six categories with GenEval's templates and its
  ``evaluation_metadata.jsonl`` format (Ghosh et al. 2023, arXiv:2310.11513; djghosh13/geneval
  ``prompts/create_prompts.py``): ``single_object`` "a photo of a circle", ``two_object`` "a photo of a circle and a
  square", ``counting`` "a photo of three triangles" (include ``count=N`` + exclude ``count=N+1``, as GenEval),
  ``colors`` "a photo of a red circle", ``position`` "a photo of a circle left of a square" (include the target
  first, then the object with ``position: [relation, 0]``, as GenEval), ``color_attr`` "a photo of a red circle and a
  blue square". Counts 2-4 (GenEval's), two different shapes in the two-object categories;
* **splits** (mmrl's own rule, :func:`is_heldout`): ``heldout`` prompts are disjoint from ``train`` ones. Held out are
  a third of the colour-shape pairings (:data:`HELDOUT_PAIRINGS`: each shape with two of its six colours, each colour
  with one shape), so ``colors`` / ``color_attr`` held-out prompts name a pairing never in a training prompt; for the
  categories without colours a third of the (shape, count), (shape, shape) and (shape, shape, relation)
  combinations, and the triangle alone for ``single_object``; ``scene_for(..., split="train")`` and the training VLM
  data never show a held-out pairing, even where the prompt names no colour. Seeds split too: :func:`split_rng`
  ``(k, s)`` = ``numpy.random.default_rng([k, SPLITS.index(s)])`` is split ``s``'s stream for seed ``k`` (what
  :func:`write_vlm_dataset` draws from; use it with :func:`scene_for`), so the two splits never share a stream;
* **ground-truth scenes** (:func:`scene_for`): a random scene satisfying a prompt's metadata under GenEval's rules,
  shapes of 8-14 px at 32 px (scaled with the size), placed without overlap with a gap (rejection sampling) so
  connected components separate them; a position pair is placed so the relation holds under GenEval's rule
  (:func:`mmrl.rewards.geneval.relative_position`) with a margin (``position_threshold`` 0.25 instead of 0.1);
* **VLM data** (:func:`write_vlm_dataset`): mmrl's VLM JSONL (:mod:`mmrl.data.vlm`) with PNG images and mp4 videos
  (PyAV, H.264; decord reads them): box grounding ("Where is the red circle?"), counting (task ``numeric``) and
  temporal grounding on short videos of a shape appearing, moving or changing colour, each line with the completion
  an SFT step trains on (``sft_target``).

The weightless evaluator that turns these images (and a generator's imitations of them) into GenEval detections is
:func:`mmrl.rewards.shapeworld.detect`; the reward is ``shapeworld`` / ``shapeworld_partial``, the benchmark
``mmrl eval ... benchmarks=[shapeworld@heldout]`` (:mod:`mmrl.eval.shapeworld`).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from PIL import Image

__all__ = [
    "SHAPES", "COLORS", "BACKGROUND", "IMAGE_SIZE", "VLM_IMAGE_SIZE", "TAGS", "SPLITS", "POSITIONS", "NUMBERS",
    "HELDOUT_PAIRINGS", "PROMPTS_VERSION", "VLM_TASKS", "EXTRA_VLM_TASKS", "VIDEO_FRAMES", "VIDEO_FPS", "Obj", "Scene",
    "shape_mask",
    "render", "render_array", "is_heldout", "prompt_set", "scene_for", "write_prompts", "write_vlm_dataset",
    "write_video", "split_rng", "prompts_file", "parse_split_and_tags", "check_prompts_spec", "resolve_prompts_spec",
    "PROMPTS_SPEC_PREFIX", "TIMELINE_FPS", "LOOSE_SPAN_FRACTION", "timeline_steps",
    "BASE_MODELS", "base_model_path", "VLM_SPEC", "check_vlm_spec", "resolve_vlm_spec",
]

#: The shapes (GenEval "classes" of this world).
SHAPES = ("circle", "square", "triangle")
#: Named colours (GenEval colour names), RGB; pairwise >= 130 apart (Euclidean) and >= 140 from the background.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 215, 40),
    "purple": (160, 40, 190),
    "white": (245, 245, 245),
}
#: The plain background.
BACKGROUND: tuple[int, int, int] = (40, 40, 40)
#: Default image side for the generator (pixels).
IMAGE_SIZE = 32
#: Image and video side of the VLM data: 4 x 28, so Qwen2.5-VL's ``smart_resize`` (factor 28) keeps it as it is under
#: any pixel budget with ``min_pixels <= 12544 <= max_pixels`` (then Qwen2.5-VL's pixels = original pixels).
VLM_IMAGE_SIZE = 112
#: GenEval's six categories, in GenEval's order.
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
SPLITS = ("train", "heldout", "test")
POSITIONS = ("left of", "right of", "above", "below")
#: Counting prompts' numbers (GenEval: 2-4).
NUMBERS = {2: "two", 3: "three", 4: "four"}
_PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles"}
_COLOR_NAMES = tuple(COLORS)
#: Held-out colour-shape pairings: ``(SHAPES.index(s) + colour index) % 3 == 0`` (mmrl's rule).
HELDOUT_PAIRINGS = frozenset((s, c) for i, s in enumerate(SHAPES) for j, c in enumerate(_COLOR_NAMES)
                             if (i + j) % 3 == 0)
#: Bumped whenever the prompts or the rendering change (it is in every written file).
PROMPTS_VERSION = "shapeworld-v1"
#: Tasks of :func:`write_vlm_dataset`.
VLM_TASKS = ("grounding", "numeric", "temporal_grounding")
#: Tasks a spec may name besides :data:`VLM_TASKS` (not in the default mix): ``grounding_crop``, box grounding whose
#: ``sft_target`` is a tool-call trace (``generation.tools: [crop]``; TACO's first stage); ``grounding_loose``, box
#: grounding whose ``sft_target`` box is systematically too large (a loose annotator; ``solution`` stays exact);
#: ``temporal_grounding_timeline``, temporal grounding whose ``sft_target`` walks through the clip at the timestamps
#: Qwen3-VL's prompt shows; ``temporal_grounding_timeline_loose``, the same with a span too long on both sides.
EXTRA_VLM_TASKS = ("grounding_crop", "grounding_loose", "temporal_grounding_timeline",
                   "temporal_grounding_timeline_loose")
_ANY_VLM_TASK = VLM_TASKS + EXTRA_VLM_TASKS

#: Shape sides at 32 px (scaled with the image size), gap between boxes, and the position margin.
_MIN_SIDE, _MAX_SIDE, _MAX_SIDE_CROWDED, _GAP = 8, 14, 11, 2
_POSITION_MARGIN = 0.25


# ---------------------------------------------------------------------------------------------------- scenes


@dataclass(frozen=True)
class Obj:
    """One shape: ``shape`` in :data:`SHAPES`, ``color`` in :data:`COLORS`, ``box`` ``(x1, y1, x2, y2)`` integer
    pixels with ``x2``/``y2`` exclusive (the convention of GenEval's detections, mmdetection's ``mask2bbox``): the
    shape's pixels span exactly the box."""

    shape: str
    color: str
    box: tuple[int, int, int, int]

    def __post_init__(self):
        if self.shape not in SHAPES:
            raise ValueError(f"Obj: unknown shape {self.shape!r}; ShapeWorld shapes: {', '.join(SHAPES)}")
        if self.color not in COLORS:
            raise ValueError(f"Obj: unknown colour {self.color!r}; ShapeWorld colours: {', '.join(COLORS)}")
        box = tuple(self.box)
        if len(box) != 4 or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in box):
            raise ValueError(f"Obj: box must be 4 integers (x1, y1, x2, y2), got {self.box!r}")
        if not (box[2] > box[0] and box[3] > box[1]):
            raise ValueError(f"Obj: box {box} is empty or reversed (expected x2 > x1 and y2 > y1)")
        object.__setattr__(self, "box", tuple(int(v) for v in box))

    @property
    def name(self) -> str:
        """``"red circle"``."""
        return f"{self.color} {self.shape}"


@dataclass(frozen=True)
class Scene:
    """Objects (painted in order) on a ``size x size`` image."""

    objects: tuple[Obj, ...]
    size: int = IMAGE_SIZE

    def __post_init__(self):
        objects = tuple(self.objects)
        if not all(isinstance(o, Obj) for o in objects):
            raise ValueError("Scene: objects must be Obj instances")
        if isinstance(self.size, bool) or not isinstance(self.size, (int, np.integer)) or self.size < 8:
            raise ValueError(f"Scene: size must be an integer >= 8, got {self.size!r}")
        for o in objects:
            if o.box[0] < 0 or o.box[1] < 0 or o.box[2] > self.size or o.box[3] > self.size:
                raise ValueError(f"Scene: the box {o.box} of the {o.name} leaves the {self.size}x{self.size} image")
        object.__setattr__(self, "objects", objects)
        object.__setattr__(self, "size", int(self.size))


def shape_mask(shape: str, width: int, height: int) -> np.ndarray:
    """The boolean ``[height, width]`` mask of ``shape`` filling a ``width x height`` box, by pixel-centre tests
    (mmrl's rasterisation; the renderer paints it and the evaluator compares components against it):

    * square: every pixel;
    * circle (an ellipse in a non-square box): pixel centres ``(x + 0.5, y + 0.5)`` inside the inscribed ellipse;
    * triangle (apex up, base on the bottom row): row ``r`` (from the top) keeps the pixel centres within
      ``(r + 1) / height * width / 2`` of the box's vertical mid-line.

    Each mask touches all four sides of its box (so a rendered shape's tight box is its box). Fill ratios of the box
    tend to 1, pi/4 ~ 0.785 and 1/2 for large boxes (at 8 px: 1, 0.81, 0.62)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; ShapeWorld shapes: {', '.join(SHAPES)}")
    width, height = int(width), int(height)
    if width < 1 or height < 1:
        raise ValueError(f"a shape box must be at least 1x1 pixels, got {width}x{height}")
    if shape == "square":
        return np.ones((height, width), dtype=bool)
    xs = np.arange(width, dtype=np.float64) + 0.5 - width / 2
    ys = np.arange(height, dtype=np.float64) + 0.5 - height / 2
    if shape == "circle":
        return (xs[None, :] / (width / 2)) ** 2 + (ys[:, None] / (height / 2)) ** 2 <= 1.0 + 1e-9
    half = (np.arange(height, dtype=np.float64) + 1) * width / (2 * height)
    return np.abs(xs)[None, :] <= half[:, None] + 1e-9


def render_array(scene: Scene) -> np.ndarray:
    """:func:`render` as a uint8 ``[size, size, 3]`` array."""
    if not isinstance(scene, Scene):
        raise TypeError(f"render needs a Scene, got {type(scene).__name__}")
    pixels = np.empty((scene.size, scene.size, 3), dtype=np.uint8)
    pixels[:] = BACKGROUND
    for obj in scene.objects:
        x1, y1, x2, y2 = obj.box
        mask = shape_mask(obj.shape, x2 - x1, y2 - y1)
        pixels[y1:y2, x1:x2][mask] = COLORS[obj.color]
    return pixels


def render(scene: Scene) -> Image.Image:
    """The scene as an RGB uint8 PIL image (deterministic: the same scene gives the same bytes)."""
    return Image.fromarray(render_array(scene), mode="RGB")


# ---------------------------------------------------------------------------------------------------- prompts


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown ShapeWorld split {split!r}; expected one of {', '.join(SPLITS)}")
    return split


def split_rng(seed: int, split: str) -> np.random.Generator:
    """The random stream of ``split`` for ``seed``: ``numpy.random.default_rng([seed, SPLITS.index(split)])``."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    return np.random.default_rng([int(seed), SPLITS.index(_check_split(split))])


def _s(shape: str) -> int:
    return SHAPES.index(shape)


def is_heldout(tag: str, *, shapes: Sequence[str] = (), colors: Sequence[str | None] = (), count: int | None = None,
               relation: str | None = None) -> bool:
    """Whether a prompt of ``tag`` with these parts belongs to the held-out split (mmrl's rule):

    * ``single_object``: the triangle;
    * ``two_object`` (a, b): ``(index(b) - index(a)) % 3 == 1`` (each unordered pair is held out in one order);
    * ``counting`` (shape, N): ``(index(shape) + N) % 3 == 0``;
    * ``colors`` / ``color_attr``: any of its colour-shape pairings is in :data:`HELDOUT_PAIRINGS`;
    * ``position`` (a relation b): ``(index(a) + index(b) + POSITIONS.index(relation)) % 3 == 0``.
    """
    if tag == "single_object":
        return shapes[0] == "triangle"
    if tag == "two_object":
        return (_s(shapes[1]) - _s(shapes[0])) % 3 == 1
    if tag == "counting":
        return (_s(shapes[0]) + int(count)) % 3 == 0
    if tag in ("colors", "color_attr"):
        return any((s, c) in HELDOUT_PAIRINGS for s, c in zip(shapes, colors))
    if tag == "position":
        return (_s(shapes[0]) + _s(shapes[1]) + POSITIONS.index(relation)) % 3 == 0
    raise ValueError(f"unknown GenEval tag {tag!r}; expected one of {', '.join(TAGS)}")


def _all_prompts() -> dict[str, list[tuple[str, dict, bool]]]:
    """Every prompt per tag: ``(prompt, metadata, held out)``; metadata in GenEval's key order."""
    out: dict[str, list[tuple[str, dict, bool]]] = {t: [] for t in TAGS}

    def add(tag, prompt, include, exclude=None, **parts):
        meta: dict[str, Any] = {"tag": tag, "include": include}
        if exclude:
            meta["exclude"] = exclude
        meta["prompt"] = prompt
        out[tag].append((prompt, meta, is_heldout(tag, **parts)))

    pairs = [(a, b) for a in SHAPES for b in SHAPES if a != b]
    for s in SHAPES:
        add("single_object", f"a photo of a {s}", [{"class": s, "count": 1}], shapes=(s,))
    for a, b in pairs:
        add("two_object", f"a photo of a {a} and a {b}", [{"class": a, "count": 1}, {"class": b, "count": 1}],
            shapes=(a, b))
    for s in SHAPES:
        for n, word in NUMBERS.items():
            add("counting", f"a photo of {word} {_PLURAL[s]}", [{"class": s, "count": n}],
                [{"class": s, "count": n + 1}], shapes=(s,), count=n)
    for s in SHAPES:
        for c in COLORS:
            add("colors", f"a photo of a {c} {s}", [{"class": s, "count": 1, "color": c}], shapes=(s,), colors=(c,))
    for a, b in pairs:
        for rel in POSITIONS:
            add("position", f"a photo of a {a} {rel} a {b}",
                [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [rel, 0]}],
                shapes=(a, b), relation=rel)
    for a, b in pairs:
        for ca in COLORS:
            for cb in COLORS:
                if ca != cb:
                    add("color_attr", f"a photo of a {ca} {a} and a {cb} {b}",
                        [{"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb}],
                        shapes=(a, b), colors=(ca, cb))
    return out


def _check_tags(tags: Sequence[str] | None) -> tuple[str, ...] | None:
    """``tags`` as a tuple in :data:`TAGS` order (None: every category); a ValueError naming the categories for an
    unknown or empty one."""
    if tags is None:
        return None
    tags = tuple(tags)
    unknown = [t for t in tags if t not in TAGS]
    if unknown or not tags:
        raise ValueError(f"unknown GenEval categor{'y' if len(unknown) == 1 else 'ies'} "
                         f"{', '.join(map(repr, unknown)) or '(none given)'}; expected some of {', '.join(TAGS)}")
    return tuple(t for t in TAGS if t in tags)


def prompt_set(split: str, tags: Sequence[str] | None = None) -> list[tuple[str, dict]]:
    """The ``(prompt, metadata)`` pairs of ``split`` (``"train"`` or ``"heldout"``, disjoint; ``"test"`` has the
    ``train`` prompts: it holds out seeds, not prompts), of the GenEval categories ``tags`` only when given (any
    order; the result keeps :data:`TAGS` order).

    ``metadata`` is GenEval's ``{"tag", "include", "exclude"?, "prompt"}`` (a fresh copy each call). Order: round
    robin over the tags in :data:`TAGS` order (prompt k of every tag, then k + 1, ...), so the first ``6 m`` prompts
    hold ``m`` of every tag that has that many (an ``mmrl eval ... limit=6`` sees all six categories)."""
    _check_split(split)
    wanted = _check_tags(tags) or TAGS
    held = split == "heldout"
    per_tag = [[(p, m) for p, m, h in items if h == held] for tag, items in _all_prompts().items() if tag in wanted]
    ordered: list[tuple[str, dict]] = []
    for k in range(max(len(v) for v in per_tag)):
        ordered += [v[k] for v in per_tag if k < len(v)]
    return [(p, json.loads(json.dumps(m))) for p, m in ordered]


def write_prompts(path: str | os.PathLike, split: str, tags: Sequence[str] | None = None) -> Path:
    """Write ``split``'s prompts (of the categories ``tags`` when given, :func:`prompt_set`) as ``.jsonl``, one
    ``{"prompt": ..., "tag", "include", "exclude"?}`` object a line: what ``mmrl train``'s ``data.prompts``
    (:func:`mmrl.data.prompts.read_prompts`) and ``mmrl eval``'s ``prompts=FILE`` read, the metadata going to the
    rewards. Written atomically; returns the path."""
    path = Path(path)
    if path.suffix.lower() != ".jsonl":
        raise ValueError(f"{path}: a ShapeWorld prompt file must end in .jsonl (read_prompts takes metadata only "
                         f"from .jsonl)")
    lines = [json.dumps({"prompt": p, **m}, ensure_ascii=False) for p, m in prompt_set(split, tags)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


#: ``data.prompts`` / ``prompts=`` spelling of a split's prompt file: ``shapeworld:train`` or ``shapeworld:heldout``,
#: optionally of some GenEval categories only: ``shapeworld:train:single_object+colors``.
PROMPTS_SPEC_PREFIX = "shapeworld:"


def prompts_file(split: str, tags: Sequence[str] | None = None) -> Path:
    """``split``'s prompt file (of the categories ``tags`` when given) in the cache
    (``$MMRL_CACHE/eval-prompts/shapeworld-<split>[-<tag>+<tag>]-<sha256[:16]>.jsonl``, default ``~/.cache/mmrl``):
    written once, atomically, named by its content's sha256, so a changed world is a new file and never a silently
    different one."""
    import hashlib

    split = _check_split(split)
    tags = _check_tags(tags)
    stem = f"shapeworld-{split}" + (f"-{'+'.join(tags)}" if tags else "")
    env = os.environ.get("MMRL_CACHE")
    folder = (Path(env).expanduser() if env else Path.home() / ".cache" / "mmrl") / "eval-prompts"
    scratch = folder / f".{stem}-{os.getpid()}.jsonl"
    write_prompts(scratch, split, tags)
    data = scratch.read_bytes()
    target = folder / f"{stem}-{hashlib.sha256(data).hexdigest()[:16]}.jsonl"
    if target.is_file() and target.read_bytes() == data:
        scratch.unlink()
    else:
        os.replace(scratch, target)
    return target


def parse_split_and_tags(text: str, *, what: str) -> tuple[str, tuple[str, ...] | None]:
    """``"<split>"`` or ``"<split>:<tag>+<tag>..."`` -> ``(split, tags or None)``; a ValueError that names ``what``
    (the whole spelling the user wrote), the splits and the categories."""
    split, sep, body = text.partition(":")
    if split not in SPLITS:
        raise ValueError(f"{what!r}: unknown ShapeWorld split {split!r}; splits: {', '.join(SPLITS)}")
    if not sep:
        return split, None
    tags = tuple(t.strip() for t in body.split("+"))
    if not all(tags):
        raise ValueError(f"{what!r}: an empty GenEval category; categories: "
                         f"{', '.join(TAGS)}")
    try:
        return split, _check_tags(tags)
    except ValueError as exc:
        raise ValueError(f"{what!r}: {exc}") from None


def check_prompts_spec(value: str) -> str | None:
    """None if ``value`` (``shapeworld:<split>[:<tag>+<tag>...]``) names a split's prompts, else what is wrong."""
    try:
        parse_split_and_tags(value[len(PROMPTS_SPEC_PREFIX):], what=value)
    except ValueError as exc:
        return (f"{exc} (write shapeworld:train, shapeworld:heldout or shapeworld:test, optionally with "
                f":<category>+<category>)")
    return None


def resolve_prompts_spec(path: str | os.PathLike) -> str | os.PathLike:
    """``shapeworld:<split>[:<tag>+<tag>...]`` -> :func:`prompts_file` of that split and those categories (a
    ValueError naming the splits and categories for a wrong one); any other path unchanged. What ``data.prompts``
    goes through (:func:`mmrl.data.prompts.read_prompts`)."""
    text = str(path)
    if not text.startswith(PROMPTS_SPEC_PREFIX):
        return path
    problem = check_prompts_spec(text)
    if problem:
        raise ValueError(problem)
    return prompts_file(*parse_split_and_tags(text[len(PROMPTS_SPEC_PREFIX):], what=text))


#: The shipped base models (``model.pretrained: shapeworld:<name>``): ``name -> (folder under assets/shapeworld/,
#: the command that makes it)``, each trained by mmrl itself (README, "ShapeWorld and base models").
BASE_MODELS = {"sd3": ("sd3_base", "mmrl pretrain configs/shapes/pretrain_sd3.yaml"),
               "sd3_mislabeled": ("sd3_mislabeled_base", "mmrl pretrain configs/shapes/pretrain_sd3_mislabeled.yaml"),
               "sd3_faded": ("sd3_faded_base", "mmrl pretrain configs/shapes/pretrain_sd3_faded.yaml"),
               "qwen_vl": ("qwen_vl_base", "mmrl sft configs/shapes/sft_qwen_vl.yaml"),
               "qwen_vl_grounding": ("qwen_vl_grounding_base", "mmrl sft configs/shapes/sft_qwen_vl_grounding.yaml"),
               "qwen_vl_grounding_loose": ("qwen_vl_grounding_loose_base",
                                           "mmrl sft configs/shapes/sft_qwen_vl_grounding_loose.yaml"),
               "qwen_vl_timeline": ("qwen_vl_timeline_base", "mmrl sft configs/shapes/sft_qwen_vl_timeline.yaml"),
               "qwen_vl_timeline_loose": ("qwen_vl_timeline_loose_base",
                                          "mmrl sft configs/shapes/sft_qwen_vl_timeline_loose.yaml")}


def base_model_path(name: str) -> Path:
    """The folder of the shipped ShapeWorld base ``name`` (:data:`BASE_MODELS`): ``mmrl/assets/shapeworld/<dir>``
    in an installed package, ``<repo>/assets/shapeworld/<dir>`` in a source checkout. A FileNotFoundError that
    says how to make it when it is absent; a ValueError for an unknown name."""
    if name not in BASE_MODELS:
        raise ValueError(f"unknown ShapeWorld base {name!r}; shipped: "
                         f"{', '.join('shapeworld:' + k for k in BASE_MODELS)}")
    folder, recipe = BASE_MODELS[name]
    here = Path(__file__).resolve().parent  # .../mmrl/data
    candidates = [root / "assets" / "shapeworld" / folder for root in (here.parent, here.parent.parent)]
    for candidate in candidates:
        if (candidate / "model_index.json").is_file() or (candidate / "config.json").is_file():
            return candidate
    raise FileNotFoundError(f"the ShapeWorld base 'shapeworld:{name}' is not in this install (looked in "
                            f"{', '.join(map(str, candidates))}); make it with `{recipe}` and point "
                            f"model.pretrained at what it writes")


#: A ShapeWorld VLM set written on the spot: ``shapeworld:<split>:<n>`` (every task) or
#: ``shapeworld:<split>:<n>:<task>[+<task>...]`` (those tasks, e.g. ``shapeworld:heldout:48:grounding``).
VLM_SPEC = re.compile(r"^shapeworld:(train|heldout|test):([1-9][0-9]*)(?::([a-z_]+(?:\+[a-z_]+)*))?$")


def check_vlm_spec(value: str) -> str | None:
    """None if ``value`` names a ShapeWorld VLM set (:data:`VLM_SPEC`), else what is wrong with it."""
    match = VLM_SPEC.match(value)
    if match is None:
        return (f"{value!r} is not a ShapeWorld VLM set: write shapeworld:<train|heldout|test>:<n>[:<task>+<task>] "
                f"(tasks {', '.join(_ANY_VLM_TASK)})")
    bad = [t for t in (match.group(3) or "").split("+") if t and t not in _ANY_VLM_TASK]
    if bad:
        return f"{value!r}: unknown ShapeWorld task {bad[0]!r}; tasks: {', '.join(_ANY_VLM_TASK)}"
    return None


def resolve_vlm_spec(value: str, *, coord_format: str | None, seed: int = 0,
                     directory: str | os.PathLike | None = None) -> str:
    """A VLM JSONL path: ``value`` as given, or for :data:`VLM_SPEC` the set :func:`write_vlm_dataset` writes (once,
    atomically, into ``directory``, default ``$MMRL_CACHE`` / ``~/.cache/mmrl``) with its boxes in
    ``coord_format``, the format the policy answers in (Qwen2.5-VL ``qwen25``, Qwen2-VL / Qwen3-VL ``qwen2``). A
    ValueError when the spelling is wrong or the format is unknown."""
    if not isinstance(value, str) or not value.startswith("shapeworld:"):
        return value
    problem = check_vlm_spec(value)
    if problem:
        raise ValueError(problem)
    if coord_format is None:
        raise ValueError(f"{value} writes boxes in the model's coordinate format, which is unknown for this model "
                         f"(not a Qwen-VL model type mmrl knows); write the data yourself "
                         f"(mmrl.data.shapeworld.write_vlm_dataset(..., coord_format=...))")
    from mmrl.pipelines.flow.tiny import ensure_built

    match = VLM_SPEC.match(value)
    split, n = match.group(1), int(match.group(2))
    tasks = tuple(match.group(3).split("+")) if match.group(3) else VLM_TASKS
    name = "" if tasks == VLM_TASKS else "-" + "+".join(tasks)
    if "grounding_loose" in tasks:  # the taught boxes depend on the fraction
        name += f"-loose{LOOSE_BOX_FRACTION:g}"
    if "temporal_grounding_timeline_loose" in tasks:  # the taught spans depend on the fraction
        name += f"-looseSpan{LOOSE_SPAN_FRACTION:g}"
    folder = ensure_built(f"shapeworld-{PROMPTS_VERSION}-{split}-{n}{name}-{coord_format}-seed{seed}",
                          lambda out: write_vlm_dataset(out, split, n, seed=seed, tasks=tasks,
                                                        coord_format=coord_format), directory)
    return str(folder / f"{split}.jsonl")


# ---------------------------------------------------------------------------------------------------- scene_for


def _check_metadata(metadata: Any) -> None:
    from mmrl.rewards.geneval import check_geneval_metadata

    problem = check_geneval_metadata(metadata)
    if problem:
        raise ValueError(f"scene_for: {problem}")
    for kind in ("include", "exclude"):
        for k, clause in enumerate(metadata.get(kind, [])):
            if clause["class"] not in SHAPES:
                raise ValueError(f"scene_for: {kind} clause {k} names {clause['class']!r}, not a ShapeWorld shape "
                                 f"({', '.join(SHAPES)})")
            if "color" in clause and clause["color"] not in COLORS:
                raise ValueError(f"scene_for: include clause {k} has the colour {clause['color']!r}, not a "
                                 f"ShapeWorld colour ({', '.join(COLORS)})")


def _any_color(rng: np.random.Generator, shape: str, train: bool) -> str:
    """A random colour for ``shape``; in a training scene (``train``) never one of its held-out pairings."""
    options = [c for c in _COLOR_NAMES if not (train and (shape, c) in HELDOUT_PAIRINGS)]
    return options[int(rng.integers(len(options)))]


def _as_rng(rng) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        return np.random.default_rng(int(rng))
    raise TypeError(f"rng must be a numpy.random.Generator or an integer seed, got {type(rng).__name__}")


def _scaled(value: int, size: int) -> int:
    return max(1, int(round(value * size / IMAGE_SIZE)))


def _holds(box_a, box_b, relation: str, threshold: float) -> bool:
    from mmrl.rewards.geneval import relative_position

    return relation in relative_position(box_a, box_b, threshold)


def _free(box, placed: Sequence[tuple[int, int, int, int]], gap: int) -> bool:
    x1, y1, x2, y2 = box
    return all(x2 + gap <= b[0] or b[2] + gap <= x1 or y2 + gap <= b[1] or b[3] + gap <= y1 for b in placed)


def _satisfied(objects: Sequence[Obj], metadata: Mapping[str, Any]) -> bool:
    """GenEval's verdict on the true objects (every one a confident detection of its true colour)."""
    from mmrl.rewards.geneval import Detection, evaluate_geneval, select_detections

    dets = [Detection(o.shape, 1.0, tuple(float(v) for v in o.box)) for o in objects]
    colors = {id(d): o.color for d, o in zip(dets, objects)}
    kept = select_detections(dets, metadata.get("tag"))
    return evaluate_geneval(kept, metadata, lambda _, found: [colors[id(d)] for d in found]).correct


def scene_for(metadata: Mapping[str, Any], rng, size: int = IMAGE_SIZE, *, split: str | None = None,
              max_tries: int = 200) -> Scene:
    """A random ground-truth scene satisfying GenEval ``metadata`` whose classes are :data:`SHAPES`.

    Every include clause gets exactly ``count`` shapes of its class, in its colour (else a random one); nothing else
    is drawn, so exclude clauses hold unless the includes themselves break them (then no scene exists: ValueError).
    ``split="train"`` (or ``"test"``): the random colours avoid the held-out pairings (:data:`HELDOUT_PAIRINGS`), so
    training images never show a held-out colour-shape pairing at all, not even for prompts that name no colour.
    Sides are drawn uniformly from 8-14 px at 32 px (8-11 px with three or more shapes), scaled to ``size``; boxes
    are square, inside the image and at least 2 px (scaled) apart; a clause with ``position: [relation, t]`` is
    placed after its target so that ``relation`` holds towards every object of clause ``t`` under GenEval's rule with
    ``position_threshold`` 0.25 (GenEval scores with 0.1: a margin). The result is checked with GenEval's rules on the
    true boxes and colours; placements are redrawn (up to ``max_tries`` times, the largest side shrinking every 20)
    until it passes. ``rng``: a ``numpy.random.Generator`` (or an integer seed)."""
    _check_metadata(metadata)
    rng = _as_rng(rng)
    if split is not None:
        _check_split(split)
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 16:
        raise ValueError(f"scene_for: size must be an integer >= 16, got {size!r}")
    size = int(size)
    include = list(metadata.get("include", []))
    specs = [(k, c["class"], c.get("color"), c.get("position")) for k, c in enumerate(include)
             for _ in range(int(c.get("count", 1)))]
    if not specs:
        raise ValueError("scene_for: the metadata has no include clause, so no scene is defined by it")
    for clause in metadata.get("exclude", []):
        n = sum(1 for _, cls, _, _ in specs if cls == clause["class"])
        if n >= int(clause.get("count", 1)):
            raise ValueError(f"scene_for: the include clauses ask for {n} {clause['class']}(s), which the exclude "
                             f"clause (fewer than {clause['count']}) forbids")
    gap = _scaled(_GAP, size)
    low = _scaled(_MIN_SIDE, size)
    high0 = _scaled(_MAX_SIDE if len(specs) <= 2 else _MAX_SIDE_CROWDED, size)
    for attempt in range(max_tries):
        high = max(low, high0 - attempt // 20)
        objects: list[Obj] = []
        clause_of: list[int] = []
        for k, cls, color, position in specs:
            color = color if color is not None else _any_color(rng, cls, split in ("train", "test"))
            placed = None
            for _ in range(100):
                side = int(rng.integers(low, high + 1))
                x, y = int(rng.integers(0, size - side + 1)), int(rng.integers(0, size - side + 1))
                box = (x, y, x + side, y + side)
                if not _free(box, [o.box for o in objects], gap):
                    continue
                if position is not None:
                    relation, target = position
                    targets = [o for o, c in zip(objects, clause_of) if c == target]
                    if not all(_holds(box, t.box, relation, _POSITION_MARGIN) for t in targets):
                        continue
                placed = box
                break
            if placed is None:
                break
            objects.append(Obj(cls, color, placed))
            clause_of.append(k)
        if len(objects) == len(specs) and _satisfied(objects, metadata):
            return Scene(tuple(objects), size)
    raise ValueError(f"scene_for: no scene satisfying {metadata.get('prompt', dict(metadata))!r} found at {size} px "
                     f"in {max_tries} tries (too many shapes for the image?)")


# ---------------------------------------------------------------------------------------------------- VLM data


def _box_text(box: Sequence[float], coord_format: str, size: int) -> list[int]:
    """A box (original pixels) in the coordinates a model of ``coord_format`` answers in
    (:mod:`mmrl.rewards.grounding`): ``qwen25`` pixels of the resized input (= original pixels at
    :data:`VLM_IMAGE_SIZE`, a multiple of 28 that Qwen2.5-VL keeps), ``qwen2`` [0, 1000) normalised (Qwen2-VL,
    Qwen3-VL), ``absolute`` original pixels."""
    if coord_format == "qwen2":
        return [int(round(v / size * 1000)) for v in box]
    return [int(v) for v in box]


def _where(box: Sequence[int], size: int) -> str:
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    v = "upper" if cy < size / 3 else "lower" if cy > 2 * size / 3 else "middle"
    h = "left" if cx < size / 3 else "right" if cx > 2 * size / 3 else "centre"
    return "centre" if (v, h) == ("middle", "centre") else f"{v} {h}" if v != "middle" else f"middle {h}"


def _pairing(rng: np.random.Generator, held: bool, shape: str | None = None) -> tuple[str, str]:
    """A random (shape, colour) pairing of the split (held out or not)."""
    options = [(s, c) for s in SHAPES for c in COLORS
               if ((s, c) in HELDOUT_PAIRINGS) == held and (shape is None or s == shape)]
    return options[int(rng.integers(len(options)))]


def _place(rng, size: int, sides: Sequence[int], taken: Sequence[tuple[int, int, int, int]] = (),
           tries: int = 400) -> list[tuple[int, int, int, int]] | None:
    gap = _scaled(_GAP, size)
    boxes: list[tuple[int, int, int, int]] = []
    for side in sides:
        for _ in range(tries):
            x, y = int(rng.integers(0, size - side + 1)), int(rng.integers(0, size - side + 1))
            box = (x, y, x + side, y + side)
            if _free(box, [*taken, *boxes], gap):
                boxes.append(box)
                break
        else:
            return None
    return boxes


def _distractors(rng, exclude: Iterable[tuple[str, str]], k: int, train: bool, *, shapes: Sequence[str] = SHAPES
                 ) -> list[tuple[str, str]]:
    """``k`` random (shape, colour) pairings, none equal to one in ``exclude`` or to each other (in a training
    scene, none held out)."""
    taken = set(exclude)
    out = []
    while len(out) < k:
        shape = shapes[int(rng.integers(len(shapes)))]
        pair = (shape, _any_color(rng, shape, train))
        if pair not in taken:
            taken.add(pair)
            out.append(pair)
    return out


def _attempts(what: str, size: int, limit: int = 2000):
    """Retry counter for the VLM samplers' rejection loops: a clear error instead of an endless loop."""
    for attempt in range(limit):
        yield attempt
    raise ValueError(f"write_vlm_dataset: could not place a {what} scene at {size} px in {limit} tries (use a larger "
                     f"size)")


def _grounding_sample(rng, held: bool, size: int, coord_format: str) -> tuple[Scene, dict]:
    for _ in _attempts("grounding", size):
        target = _pairing(rng, held)
        others = _distractors(rng, [target], int(rng.integers(0, 3)), not held)
        low, high = _scaled(_MIN_SIDE, size), _scaled(_MAX_SIDE, size)
        sides = [int(rng.integers(low, high + 1)) for _ in range(1 + len(others))]
        boxes = _place(rng, size, sides)
        if boxes is not None:
            break
    objects = [Obj(s, c, b) for (s, c), b in zip([target, *others], boxes)]
    order = rng.permutation(len(objects))
    scene = Scene(tuple(objects[i] for i in order), size)
    obj = objects[0]
    line = {"task": "grounding",
            "question": f"Where is the {obj.name}? Answer with its bounding box [x1, y1, x2, y2].",
            "solution": json.dumps(list(obj.box)), "boxes": [list(obj.box)], "coord_format": coord_format,
            "target": obj.name, "sft_target": _grounding_target(obj.name, obj.box, obj.box, coord_format, size)}
    return scene, line


def _grounding_target(name: str, box: Sequence[int], taught: Sequence[int], coord_format: str, size: int) -> str:
    """The ``sft_target`` of a grounding line: where the shape at ``box`` is, then the ``taught`` box (``box``
    itself, or a loose one) read out and answered in ``coord_format``."""
    answer = _box_text(taught, coord_format, size)
    think = (f"The {name} is in the {_where(box, size)} of the image; its box spans x {answer[0]} to {answer[2]} and "
             f"y {answer[1]} to {answer[3]}.")
    return f"<think>{think}</think><answer>{json.dumps(answer)}</answer>"


#: ``grounding_crop``: the margin (pixels at 32 px, scaled) drawn for each side of the crop around the target's box.
_CROP_MARGIN = (1, 4)


def _grounding_crop_sample(rng, held: bool, size: int, coord_format: str) -> tuple[Scene, dict]:
    """:func:`_grounding_sample`'s scene and question, with a tool-call trace as ``sft_target``: the think block
    names where the shape is and crops around it (``<tool>crop(...)</tool>``, the target's box widened by a random
    margin on each side, in ``coord_format`` as the crop tool reads it), then, after the view the tool returns,
    reads the box and answers it. ``crop`` holds the crop in original pixels."""
    scene, line = _grounding_sample(rng, held, size, coord_format)
    box = line["boxes"][0]
    lo, hi = (_scaled(m, size) for m in _CROP_MARGIN)
    left, top, right, bottom = (int(rng.integers(lo, hi + 1)) for _ in range(4))
    region = [max(0, box[0] - left), max(0, box[1] - top), min(size, box[2] + right), min(size, box[3] + bottom)]
    call = ", ".join(str(v) for v in _box_text(region, coord_format, size))
    answer = _box_text(box, coord_format, size)
    name = line["target"]
    line = {**line, "task": "grounding", "tool": "crop", "crop": region,
            "sft_target": f"<think>The {name} is in the {_where(box, size)} of the image; a closer look: "
                          f"<tool>crop({call})</tool> In the view its box spans x {answer[0]} to {answer[2]} and y "
                          f"{answer[1]} to {answer[3]}.</think><answer>{json.dumps(answer)}</answer>"}
    return scene, line


#: ``grounding_loose``: each side of the ``sft_target`` box moves out by this fraction of the box's side.
LOOSE_BOX_FRACTION = 0.25


def _grounding_loose_sample(rng, held: bool, size: int, coord_format: str) -> tuple[Scene, dict]:
    """:func:`_grounding_sample`'s scene, question and exact ``solution`` / ``boxes``, with an ``sft_target`` whose
    box is :data:`LOOSE_BOX_FRACTION` of the side too large on every side (clamped to the image): the annotations of
    a systematically loose annotator (mmrl's own construction, not a paper's). A model taught on them localises but
    answers boxes whose IoU with the object is at best ``1 / (1 + 2 * 0.25) ** 2 = 0.44``; an IoU reward against
    the exact ``solution`` is what can correct it. ``loose_box`` holds the taught box in original pixels."""
    scene, line = _grounding_sample(rng, held, size, coord_format)
    box = line["boxes"][0]
    pad = [LOOSE_BOX_FRACTION * (box[2] - box[0]), LOOSE_BOX_FRACTION * (box[3] - box[1])]
    loose = [max(0, round(box[0] - pad[0])), max(0, round(box[1] - pad[1])),
             min(size, round(box[2] + pad[0])), min(size, round(box[3] + pad[1]))]
    target = _grounding_target(line["target"], box, loose, coord_format, size)
    return scene, {**line, "loose_box": loose, "sft_target": target}


def _counting_sample(rng, held: bool, size: int) -> tuple[Scene, dict]:
    """Count ``n`` (1-4) shapes of one kind among 0-2 shapes of other kinds; the (shape, n) pair is held out iff
    ``(index(shape) + n) % 3 == 0``, as the counting prompts."""
    options = [(s, n) for s in SHAPES for n in range(1, 5) if ((_s(s) + n) % 3 == 0) == held]
    for _ in _attempts("counting", size):
        shape, n = options[int(rng.integers(len(options)))]
        k = int(rng.integers(0, 3 if n <= 2 else 2))
        others = [SHAPES[int(i)] for i in rng.choice([j for j in range(3) if SHAPES[j] != shape], size=k)]
        top = _scaled(_MAX_SIDE if n + k <= 2 else _MAX_SIDE_CROWDED, size)
        sides = [int(rng.integers(_scaled(_MIN_SIDE, size), top + 1)) for _ in range(n + k)]
        boxes = _place(rng, size, sides)
        if boxes is not None:
            break
    kinds = [shape] * n + others
    objects = [Obj(s, _any_color(rng, s, not held), b) for s, b in zip(kinds, boxes)]
    objects.sort(key=lambda o: (o.box[0], o.box[1]))  # left to right, as the think text reads them
    scene = Scene(tuple(objects), size)
    noun = _PLURAL[shape]
    seen = ", ".join(o.name for o in objects)
    line = {"task": "numeric", "question": f"How many {noun} are in the image? Answer with a number.",
            "solution": str(n), "target": shape, "count": n,
            "sft_target": f"<think>From left to right: {seen}. Of these, {n} {'is a' if n == 1 else 'are'} "
                          f"{shape if n == 1 else noun}.</think><answer>{n}</answer>"}
    return scene, line


#: Temporal-grounding videos: frames, frames per second, and the event's frame span limits.
VIDEO_FRAMES, VIDEO_FPS = 24, 4
_EVENT_MIN, _EVENT_MAX = 4, 12


def _temporal_sample(rng, held: bool, size: int) -> tuple[list[Scene], dict]:
    """A video of ``VIDEO_FRAMES`` frames: 0-2 static distractors and one target shape with an event on frames
    ``[s, e)`` (``kind``): ``visible`` (the shape is there only then), ``move`` (it glides from one place to another
    only then, at least one pixel per frame, and rests before and after), ``color`` (it has colour B only then,
    colour A otherwise). The span is ``[s / fps, e / fps]`` seconds: frame ``f`` shows time ``f / fps``."""
    kind = ("visible", "move", "color")[int(rng.integers(3))]
    length = int(rng.integers(_EVENT_MIN, _EVENT_MAX + 1))
    start = int(rng.integers(2, VIDEO_FRAMES - length - 2 + 1))
    end = start + length
    lo, hi = _scaled(_MIN_SIDE, size), _scaled(_MAX_SIDE, size)
    for _ in _attempts("temporal grounding", size):
        shape, color = _pairing(rng, held)
        other_shapes = [s for s in SHAPES if s != shape]
        others = _distractors(rng, [], int(rng.integers(0, 3)), not held, shapes=other_shapes)
        others = list({s: (s, c) for s, c in others}.values())  # one of each other shape at most
        side = int(rng.integers(lo, hi + 1))
        boxes = _place(rng, size, [int(rng.integers(lo, hi + 1)) for _ in others])
        if boxes is None:
            continue
        first = _place(rng, size, [side], boxes)
        if first is None:
            continue
        if kind == "move":
            last = _place(rng, size, [side], boxes)
            if last is None:
                continue
            dx, dy = last[0][0] - first[0][0], last[0][1] - first[0][1]
            if max(abs(dx), abs(dy)) < length:
                continue
            # every intermediate box must stay clear of the distractors
            path = [(first[0][0] + round(dx * k / length), first[0][1] + round(dy * k / length))
                    for k in range(1, length + 1)]
            if not all(_free((x, y, x + side, y + side), boxes, _scaled(_GAP, size)) for x, y in path):
                continue
        break
    color_b = None
    if kind == "color":
        # the colour it turns to forms the tested pairing (held out iff the split is), A any other colour
        shape, color_b = _pairing(rng, held, shape)
        options = [c for c in COLORS if c != color_b and not (not held and (shape, c) in HELDOUT_PAIRINGS)]
        color = options[int(rng.integers(len(options)))]
    statics = [Obj(s, c, b) for (s, c), b in zip(others, boxes)]
    frames = []
    for f in range(VIDEO_FRAMES):
        inside = start <= f < end
        objs = list(statics)
        if kind == "visible":
            if inside:
                objs.append(Obj(shape, color, first[0]))
        elif kind == "move":
            if f < start:
                x, y = first[0][0], first[0][1]
            else:
                k = min(f, end - 1) - start + 1
                x, y = first[0][0] + round(dx * k / length), first[0][1] + round(dy * k / length)
            objs.append(Obj(shape, color, (x, y, x + side, y + side)))
        else:
            objs.append(Obj(shape, color_b if inside else color, first[0]))
        frames.append(Scene(tuple(objs), size))
    span = [start / VIDEO_FPS, end / VIDEO_FPS]
    if kind == "visible":
        name, question = f"{color} {shape}", f"When is the {color} {shape} visible?"
    elif kind == "move":
        name, question = f"{color} {shape}", f"When does the {color} {shape} move?"
    else:
        name, question = f"{color_b} {shape}", f"When is the {shape} {color_b}?"
    event = {"kind": kind, "shape": shape, "color": color, "color_during": color_b, "frames": [start, end],
             "fps": VIDEO_FPS, "total_frames": VIDEO_FRAMES}
    line = {"task": "temporal_grounding",
            "question": f"{question} Answer with the start and end time in seconds, like [2.0, 5.5].",
            "solution": json.dumps(span), "timestamps": span, "duration": VIDEO_FRAMES / VIDEO_FPS,
            "event": event, "target": name,
            "sft_target": f"<think>{_event_sentence(event, span)}</think><answer>{json.dumps(span)}</answer>"}
    return frames, line


def _event_sentence(event: Mapping[str, Any], span: Sequence[float]) -> str:
    """The think sentence of a temporal-grounding target: what happens to the shape and when (``span``, seconds)."""
    shape, color, color_b = event["shape"], event["color"], event["color_during"]
    if event["kind"] == "visible":
        return f"The {color} {shape} is absent at first, shows up at {span[0]:g} s and is gone from {span[1]:g} s."
    if event["kind"] == "move":
        return f"The {color} {shape} rests, moves from {span[0]:g} s until {span[1]:g} s, then rests again."
    return f"The {shape} is {color}, turns {color_b} at {span[0]:g} s and back to {color} at {span[1]:g} s."


#: ``temporal_grounding_timeline``: the frame rate its timeline is read at (``generation.video_fps``, mmrl's and
#: qwen-vl-utils' default 2), and the frames per temporal step (Qwen-VL's ``temporal_patch_size``).
TIMELINE_FPS, TIMELINE_FRAMES_PER_STEP = 2.0, 2
#: ``temporal_grounding_timeline_loose``: the taught span reaches this fraction of the event's length (frames,
#: rounded up) further on each side, clamped to the clip.
LOOSE_SPAN_FRACTION = 0.5
_STATE_WORDS = {"visible": ("here", "none"), "move": ("moving", "still")}


def timeline_steps(fps: float = TIMELINE_FPS) -> list[tuple[tuple[int, ...], str]]:
    """The temporal steps a Qwen3-VL prompt shows of a ShapeWorld clip read at ``fps``: for each, its frames (of the
    ``VIDEO_FRAMES`` at ``VIDEO_FPS``) and the time Qwen3-VL's processor writes before it (``<t seconds>``: the
    mean time of the step's frames, one decimal). The frames are the ones training decodes
    (:func:`mmrl.data.video.plan_frames`, qwen-vl-utils' rule): at 2 fps 0, 2 | 4, 6 | 8, 10 | 13, 15 | 17, 19 |
    21, 23, written 0.2, 1.2, 2.2, 3.5, 4.5, 5.5."""
    from mmrl.data.video import plan_frames

    indices = plan_frames(VIDEO_FRAMES, VIDEO_FPS, fps=fps).indices
    k = TIMELINE_FRAMES_PER_STEP
    steps = [tuple(indices[i:i + k]) for i in range(0, len(indices), k)]
    return [(frames, f"{(frames[0] + frames[-1]) / 2 / VIDEO_FPS:.1f}") for frames in steps]


def _timeline_sample(rng, held: bool, size: int, loose: bool) -> tuple[list[Scene], dict]:
    """:func:`_temporal_sample`'s clip, question and exact ``solution`` / ``timestamps``, with an ``sft_target``
    that walks through the clip before answering (mmrl's construction, not a paper's): the other shapes in view,
    then the target's state at each of the prompt's timestamps (:func:`timeline_steps`; ``here``/``none`` for
    ``visible``, ``moving``/``still`` for ``move``, the colour for ``color``; a step is in the event when one of its
    frames is), then the sentence and the span. Writing each entry reads the frames right after the timestamp in
    the prompt, so the target ties the answer to *where* in the clip the event is, which a plain target does not
    teach a small model (README, "What the video models read of their clip"). ``timeline`` holds the entries.
    ``loose``: the sentence and the answer give the span :data:`LOOSE_SPAN_FRACTION` of its length longer on each
    side (``loose_timestamps``; a loose annotator, the entries stay what the frames show): at best tIoU
    ``1 / (1 + 2 * 0.5) = 0.5`` away from the clip's ends, not a hit at R1@0.5 (tIoU > 0.5)."""
    frames, line = _temporal_sample(rng, held, size)
    event = line["event"]
    start, end = event["frames"]
    others = [o for o in frames[0].objects if o.shape != event["shape"]]  # the distractors: other shapes, static
    in_view = ", ".join(f"a {o.name}" for o in others) or "no other shape"
    kind = event["kind"]
    on, off = _STATE_WORDS.get(kind, (event["color_during"], event["color"]))
    timeline = [[stamp, on if any(start <= f < end for f in step) else off] for step, stamp in timeline_steps()]
    span = line["timestamps"]
    if loose:
        pad = math.ceil((end - start) * LOOSE_SPAN_FRACTION)
        span = line["loose_timestamps"] = [max(0, start - pad) / VIDEO_FPS, min(VIDEO_FRAMES, end + pad) / VIDEO_FPS]
    entries = "; ".join(f"{stamp} s {state}" for stamp, state in timeline)
    line["timeline"] = timeline
    line["sft_target"] = (f"<think>In view: {in_view}. {entries}. {_event_sentence(event, span)}</think>"
                          f"<answer>{json.dumps(span)}</answer>")
    return frames, line


def write_video(path: str | os.PathLike, frames: Sequence[Scene], fps: int = VIDEO_FPS) -> Path:
    """Encode rendered scenes as an mp4 (PyAV, H.264 ``yuv420p``, crf 12, ``ultrafast``): one video frame per scene,
    at ``fps``; decord reads it back frame for frame."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    size = frames[0].size
    if size % 2:
        raise ValueError(f"video frames must have an even side for yuv420p, got {size}")
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    with av.open(str(tmp), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size, size, "yuv420p"
        stream.options = {"crf": "12", "preset": "ultrafast"}
        for scene in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(render_array(scene), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    os.replace(tmp, path)
    return path


def write_vlm_dataset(out_dir: str | os.PathLike, split: str, n: int, seed: int = 0, *,
                      tasks: Sequence[str] = VLM_TASKS, size: int = VLM_IMAGE_SIZE,
                      coord_format: str = "qwen25") -> Path:
    """Write ``n`` VLM samples of ``split`` into ``out_dir``: ``<split>.jsonl`` (mmrl's VLM JSONL,
    :mod:`mmrl.data.vlm`; returned) with media under ``<split>/images/*.png`` and ``<split>/videos/*.mp4``.

    Tasks cycle through ``tasks`` (line ``i`` has task ``tasks[i % len(tasks)]``):

    * ``grounding``: "Where is the red circle?" on an image of it among 0-2 other shapes (no other red circle);
      ``boxes`` (original pixels, ``x2``/``y2`` exclusive), ``solution`` the box as JSON, ``coord_format`` the
      coordinates ``sft_target`` answers in (:mod:`mmrl.rewards.grounding`; the rewards read it from the line);
    * ``grounding_crop`` (only when named): ``grounding``'s lines (``task`` grounding) whose ``sft_target`` crops
      around the shape before answering, a tool-call trace for ``mmrl sft`` with ``generation.tools: [crop]``
      (the response, the view, is inserted by the SFT collator as in a rollout); ``crop`` the region in pixels;
    * ``grounding_loose`` (only when named): ``grounding``'s lines (``task`` grounding, exact ``solution``) whose
      ``sft_target`` box is :data:`LOOSE_BOX_FRACTION` of the side too large per side (``loose_box``), a
      deliberately imperfect annotation that a model learns and an IoU reward corrects;
    * ``numeric``: "How many circles are in the image?" (1-4 of the shape among 0-2 others), ``solution`` "3";
    * ``temporal_grounding``: a ``VIDEO_FRAMES``-frame mp4 at ``VIDEO_FPS`` of a shape appearing (``visible``),
      moving (``move``) or changing colour (``color``), "When does the red circle move?", ``timestamps`` ``[s, e]``
      seconds and ``duration``; ``event`` holds the frame span ``[s_frame, e_frame)``;
    * ``temporal_grounding_timeline`` and ``temporal_grounding_timeline_loose`` (only when named): temporal
      grounding's lines whose ``sft_target`` first lists the other shapes and the target's state at each timestamp
      a Qwen3-VL prompt shows at :data:`TIMELINE_FPS` (``timeline``), for a Qwen3-VL model read at that rate; the
      loose one teaches a span :data:`LOOSE_SPAN_FRACTION` of its length too long per side (``loose_timestamps``).

    Each line has ``sft_target``, ``"<think>...</think><answer>...</answer>"`` with the answer in the format the
    rewards parse (a box ``[x1, y1, x2, y2]`` in ``coord_format``, a number, a span ``[s, e]``). ``coord_format``:
    ``qwen25`` (default; Qwen2.5-VL's pixels of the resized input, which at ``size`` = 112 are the original pixels as
    long as the run's ``min_pixels <= 12544 <= max_pixels``), ``qwen2`` (0-1000 normalised: Qwen2-VL, Qwen3-VL) or
    ``absolute``. Held-out lines ask about held-out pairings (:data:`HELDOUT_PAIRINGS`) and (shape, count) pairs;
    training lines show no held-out pairing anywhere (targets, distractors, a colour change's both colours); each
    split's scenes come from its own random stream (:func:`split_rng`). The same arguments write the same files.
    """
    from mmrl.rewards.grounding import COORD_FORMATS

    _check_split(split)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"write_vlm_dataset: n must be an integer >= 1, got {n!r}")
    tasks = tuple(tasks)
    bad = [t for t in tasks if t not in _ANY_VLM_TASK]
    if not tasks or bad:
        raise ValueError(f"write_vlm_dataset: unknown task(s) {bad or tasks!r}; tasks are "
                         f"{', '.join(_ANY_VLM_TASK)}")
    if coord_format not in COORD_FORMATS:
        raise ValueError(f"write_vlm_dataset: coord_format {coord_format!r}; expected one of "
                         f"{', '.join(COORD_FORMATS)}")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 32 or size % 2:
        raise ValueError(f"write_vlm_dataset: size must be an even integer >= 32, got {size!r}")
    rng = split_rng(seed, split)
    held = split == "heldout"
    out_dir = Path(out_dir)
    media = out_dir / split
    (media / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(int(n)):
        task = tasks[i % len(tasks)]
        sample_id = f"shapeworld-{split}-{seed}-{i:05d}"
        if task.startswith("temporal_grounding"):
            frames, line = (_temporal_sample(rng, held, size) if task == "temporal_grounding" else
                            _timeline_sample(rng, held, size, loose=task.endswith("_loose")))
            rel = f"{split}/videos/{i:05d}.mp4"
            write_video(out_dir / rel, frames)
            record = {"id": sample_id, "video": rel}
        else:
            if task == "numeric":
                scene, line = _counting_sample(rng, held, size)
            else:
                sample = {"grounding": _grounding_sample, "grounding_crop": _grounding_crop_sample,
                          "grounding_loose": _grounding_loose_sample}[task]
                scene, line = sample(rng, held, size, coord_format)
            rel = f"{split}/images/{i:05d}.png"
            render(scene).save(out_dir / rel, format="PNG")
            line["objects"] = [{"shape": o.shape, "color": o.color, "box": list(o.box)} for o in scene.objects]
            record = {"id": sample_id, "image": rel}
        record.update(line)
        record["split"] = split
        record["version"] = PROMPTS_VERSION
        lines.append(json.dumps(record, ensure_ascii=False))
    path = out_dir / f"{split}.jsonl"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
