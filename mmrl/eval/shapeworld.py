"""ShapeWorld in ``mmrl eval``: benchmark ``shapeworld[@heldout|@train|@test][:<tag>+<tag>...]`` (mmrl's own; GitHub
issue 11).

    mmrl eval CONFIG benchmarks=[shapeworld@heldout] [limit=N] [images_per_prompt=K] [resolution=32] ...

Prompts: :func:`mmrl.data.shapeworld.prompt_set` of the split (``shapeworld`` alone is ``@heldout``), GenEval's six
categories with GenEval's templates and metadata, in round-robin tag order (``limit=6`` takes one prompt of every
category); ``shapeworld@test:single_object+colors`` keeps those categories only (``overall`` is then their mean).
They are generated, not shipped: :func:`load_items` writes them once into
``$MMRL_CACHE/eval-prompts/shapeworld-<split>[-<tag>+<tag>]-<sha256[:16]>.jsonl`` (default ``~/.cache/mmrl``), the
file the protocol's ``prompts_sha256`` records, so a change of the prompt set is a change of protocol.

Scoring: each image is judged by the ``shapeworld`` reward (:mod:`mmrl.rewards.shapeworld`: a weightless detector --
colour segmentation, connected components, template shape classification -- and GenEval's rules of
:mod:`mmrl.rewards.geneval`, the detections' segmented colours in place of CLIP's); the benchmark numbers are
GenEval's :func:`mmrl.eval.scoring.geneval_scores` (``summary_scores.py``): ``per_tag`` accuracies, ``overall`` (their
mean), ``image_accuracy``, ``prompt_accuracy``; plus ``partial`` (the mean fraction of satisfied clauses).

Protocol defaults (:func:`defaults`, mmrl's choice): 4 images per prompt and base seed 42 (GenEval's), 32 px (the
world's :data:`~mmrl.data.shapeworld.IMAGE_SIZE`), 40 steps and guidance 4.5 (Flow-GRPO's evaluation settings).
"""
from __future__ import annotations

from pathlib import Path

from mmrl.data.shapeworld import prompts_file
from mmrl.eval.protocol import Defaults
from mmrl.eval.runner import BenchmarkSpec, EvalError, EvalItem, EvalOptions, GenEvalScorer

__all__ = ["EVAL_KEYS", "benchmark", "load_items", "defaults", "make_scorer", "main_keys", "ShapeWorldScorer",
           "prompts_file"]

#: No eval keys of its own: the detector has no weights to point at.
EVAL_KEYS: dict[str, str] = {}

_NAME = "shapeworld"
_SOURCE = ("mmrl's ShapeWorld benchmark (mmrl.data.shapeworld, GitHub issue 11): 4 images per prompt and base seed 42 "
           "as GenEval (djghosh13/geneval generation/diffusers_generate.py); 32 px, the world's image size; 40 steps, "
           "CFG 4.5: Flow-GRPO's SD3.5-M evaluation settings (yifan123/flow_grpo config/grpo.py)")


def _split(name: str) -> str:
    """``shapeworld[@<split>[:<tag>+<tag>...]]`` -> ``"<split>[:<tags>]"`` (the spec's ``prompt_set``), checked."""
    from mmrl.data.shapeworld import parse_split_and_tags

    head, _, rest = name.partition("@")
    if head != _NAME or (":" in name and not rest):
        raise EvalError(f"benchmark {name!r}: expected shapeworld, shapeworld@train, shapeworld@heldout or "
                        f"shapeworld@test, optionally of some GenEval categories: shapeworld@test:colors+position")
    try:
        split, tags = parse_split_and_tags(rest or "heldout", what=name)
    except ValueError as exc:
        raise EvalError(f"benchmark {exc}") from None
    return split + (f":{'+'.join(tags)}" if tags else "")


# --------------------------------------------------------------------------------------------------- plug-in API


def benchmark(name: str, options: EvalOptions) -> BenchmarkSpec:
    """Check ``shapeworld[@<split>][:<tag>+<tag>...]`` (nothing to load)."""
    return BenchmarkSpec(name, _NAME, _split(name))


def load_items(spec: BenchmarkSpec, options: EvalOptions) -> tuple[list[EvalItem], Path, str | None]:
    """One :class:`EvalItem` per prompt of the split (category = GenEval tag); the file read is the written prompt
    file (no pinned sha256: it is generated)."""
    from mmrl.data.prompts import read_prompts
    from mmrl.data.shapeworld import parse_split_and_tags

    path = prompts_file(*parse_split_and_tags(spec.prompt_set, what=spec.name))
    items = []
    for i, p in enumerate(read_prompts(path)):
        meta = {**p.metadata, "prompt": p.prompt}
        items.append(EvalItem(i, p.prompt, meta, meta["tag"]))
    return items, path, None


def defaults(spec: BenchmarkSpec) -> Defaults:
    from mmrl.data.shapeworld import IMAGE_SIZE

    return Defaults(4, 42, IMAGE_SIZE, 40, 4.5, _SOURCE)


def make_scorer(spec: BenchmarkSpec, options: EvalOptions) -> "ShapeWorldScorer":
    return ShapeWorldScorer()


def main_keys(spec: BenchmarkSpec) -> list[str]:
    return ["correct"]


# --------------------------------------------------------------------------------------------------- scorer


class ShapeWorldScorer(GenEvalScorer):
    """The ``shapeworld`` reward per image (GenEval's rules, a weightless detector);
    :func:`mmrl.eval.scoring.geneval_scores`. Scoring and summary are :class:`~mmrl.eval.runner.GenEvalScorer`'s."""

    name = "shapeworld"
    failure = "ShapeWorld scoring"

    def __init__(self):
        from mmrl.data.shapeworld import PROMPTS_VERSION
        from mmrl.eval.runner import _mmrl_version, _version
        from mmrl.rewards.shapeworld import COLOR_THRESHOLD, MIN_SIDE

        self.settings = {"threshold": 0.3, "counting_threshold": 0.9, "max_objects": 16, "max_overlap": 1.0,
                         "position_threshold": 0.1, "color_threshold": COLOR_THRESHOLD, "min_side_at_32px": MIN_SIDE,
                         "world": PROMPTS_VERSION,
                         "detector": "mmrl.rewards.shapeworld.detect: colour segmentation (half-way coverage of a "
                                     "named colour), scipy.ndimage connected components, template-IoU shape "
                                     "classification (no learned weights)",
                         "rules": "mmrl.rewards.geneval (djghosh13/geneval evaluation/evaluate_images.py), colours "
                                  "from the segmentation",
                         "summary": "mmrl.eval.scoring.geneval_scores (evaluation/summary_scores.py)"}
        self.defaults = {}
        self.version = f"mmrl {_mmrl_version()}, scipy {_version('scipy')}, numpy {_version('numpy')}"
        self.reward = None

    def build(self) -> None:
        from mmrl.rewards import build_reward

        self.reward = build_reward("shapeworld")
