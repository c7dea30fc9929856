"""``mmrl eval``: generation benchmarks of a flow policy (SD3 / FLUX), with pinned protocols and resume.
(Vision-language policies: :mod:`mmrl.eval.vlm`; the report: :mod:`mmrl.eval.report`.)

    mmrl eval CONFIG [checkpoint=PATH|base] [benchmarks=[ocr,geneval,reward:NAME@SET,...]] [output_dir=DIR]
                     [limit=N] [images_per_prompt=K] [seed=S] [num_steps=T] [resolution=R] [guidance=G]
                     [prompts=FILE] [detector=DIR] [clip_model=DIR] [reward_kwargs={NAME: {...}}]
                     [ema=true] [progress=true] [dotted.config=override ...]

Benchmarks (plus the plug-ins of :data:`PLUGINS`, each in its own module: T2I-CompBench, DPG-Bench, HPSv2,
FID / KID and diversity):

* ``ocr``: Flow-GRPO's 1018 OCR test prompts; rapidocr (its wheel's PP-OCR weights, through
  :class:`mmrl.rewards.ocr.OCRReward`'s engine) reads each image, :func:`mmrl.eval.scoring.ocr_accuracy` scores
  it against the prompt's quoted text, :func:`mmrl.eval.scoring.ocr_benchmark` gives the benchmark mean.
* ``geneval``: GenEval's 553 prompts; each image judged by mmrl's GenEval reward (the rules of
  ``evaluate_images.py``, a Mask2Former or OWL detector: ``detector=``, a CLIP colour classifier:
  ``clip_model=``), summarised by :func:`mmrl.eval.scoring.geneval_scores` (``summary_scores.py``).
* ``reward:NAME[+NAME...][@SET]``: any registered image reward(s) averaged over a prompt set: ``SET`` one of
  ``drawbench``, ``partiprompts``, ``geneval``, ``ocr``, or without ``@SET`` the user's ``prompts=FILE``
  (``.txt`` one per line, ``.jsonl`` with ``prompt`` and metadata). Reward arguments (model folders, device):
  ``reward_kwargs={NAME: {model: DIR, ...}}``.

Outputs in ``output_dir`` (default ``RUN/eval/<checkpoint>``, or ``<config output_dir>/eval/base``):
``samples.jsonl`` (one row per image, appended and flushed as each prompt's images are scored),
``images/<benchmark>/<prompt:05d>_<k>.png``, ``grids/<benchmark>.png`` (the first prompts x their images),
``protocol.json`` (what a resumed evaluation is checked against) and ``summary.json`` (written atomically at the
end: every metric, the protocols, the config, the checkpoint and the sha256 of its trainable weights, package
versions).

A killed evaluation resumes where it stopped: the rows in ``samples.jsonl`` (keyed by benchmark, prompt index and
image index) are never generated or scored again; rows of another protocol or another model in the same
``output_dir`` are a one-line error naming what differs. A scorer that cannot judge an image gives NaN (``null``
in the JSON files) with the reason in the row, counted in ``summary.json``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from mmrl.eval.protocol import OVERRIDABLE, PINNED_SHA256, Protocol, file_sha256, resolve_protocol

__all__ = ["EvalError", "EVAL_KEYS", "EvalOptions", "parse_eval_args", "BenchmarkSpec", "parse_benchmark",
           "EvalItem", "load_prompt_set", "weights_sha256", "run_eval", "REWARD_SETS"]


class EvalError(ValueError):
    """A mistake in an ``mmrl eval`` call (printed as one ``mmrl: error:`` line)."""


#: The eval keys and what they do; every other key must be a dotted config override.
EVAL_KEYS: dict[str, str] = {
    "checkpoint": "a run folder (its latest checkpoint), a checkpoint folder (or its name under the run's "
                  "checkpoints/, e.g. step_3), or base (the untrained model.pretrained); default: the latest checkpoint of CONFIG's run (the run folder CONFIG is "
                  "in, else the config's output_dir) if it has one, else base",
    "benchmarks": "list of ocr, geneval, t2i_compbench[:CAT+CAT...], dpg_bench, hpsv2[:STYLE], "
                  "reward:NAME[+NAME...][@SET], fid[@SET], diversity[@SET] (SET: drawbench, partiprompts, geneval, "
                  "ocr; without @SET: prompts=FILE); default: the config's eval.benchmarks (with its "
                  "eval.options), else [geneval, ocr]",
    "output_dir": "where samples.jsonl, images/, grids/, summary.json go; default RUN/eval/<checkpoint> or "
                  "<config output_dir>/eval/base; an existing one is resumed",
    "limit": "evaluate the first N prompts of each benchmark",
    "images_per_prompt": "images per prompt (default: the benchmark's protocol)",
    "seed": "base seed: image k of every prompt has seed + k (default 42)",
    "num_steps": "ODE sampler steps (default 40)",
    "resolution": "image height and width, a multiple of 16 (default 512)",
    "guidance": "guidance scale (default 4.5: SD3's CFG; FLUX: the config's distilled guidance)",
    "prompts": "prompt file (.txt or .jsonl) for reward:NAME without @SET",
    "detector": "GenEval detector: hub id or folder of a Mask2Former or OWL-ViT/OWLv2 checkpoint "
                "(default facebook/mask2former-swin-small-coco-instance)",
    "clip_model": "GenEval colour classifier: hub id or folder of a transformers CLIPModel with its processor "
                  "(default openai/clip-vit-large-patch14)",
    "reward_kwargs": "arguments of the reward:NAME rewards, {NAME: {argument: value}} (e.g. model folders)",
    "ema": "use the checkpoint's EMA weights when it has them (default true, as mmrl sample)",
    "progress": "show a progress bar (default: when stderr is a terminal)",
}

#: Prompt sets a ``reward:NAME@SET`` benchmark can use.
REWARD_SETS = ("drawbench", "partiprompts", "geneval", "ocr")
#: Names that are not generation benchmarks of their own, and what to run instead.
_NOT_YET = {
    "drawbench": "DrawBench has no metric of its own: score it with reward models, e.g. reward:pickscore@drawbench",
    "partiprompts": "PartiPrompts has no metric of its own: score it with reward models, e.g. "
                    "reward:pickscore@partiprompts",
    "charades_sta": "a video grounding benchmark for vision-language policies: evaluate a model.family qwen_vl config",
    "refcoco": "a grounding benchmark for vision-language policies: evaluate a model.family qwen_vl config",
}
#: Benchmarks whose loader and scorer live in a module of their own: name (or ``name@SET`` / ``name:...`` prefix)
#: -> module. A plug-in module defines (and imports nothing heavy at module level):
#:
#: * ``EVAL_KEYS: dict[str, str]``: its own eval keys and what they do (values parsed as YAML, checked by it);
#:   they land in :attr:`EvalOptions.extra`;
#: * ``benchmark(name, options) -> BenchmarkSpec``: check the name and every argument it needs (files exist,
#:   values valid) without building a model; ``spec.kind`` = the plug-in's name;
#: * ``load_items(spec, options) -> (items, file read, pinned sha256 or None)``: the prompts as :class:`EvalItem`;
#: * ``defaults(spec) -> mmrl.eval.protocol.Defaults``: the protocol's official settings and their source;
#: * ``make_scorer(spec, options) -> Scorer``;
#: * ``main_keys(spec) -> list[str]``: the score keys whose ``None`` means an image was not judged.
PLUGINS: dict[str, str] = {
    "t2i_compbench": "mmrl.eval.t2i_compbench",
    "dpg_bench": "mmrl.eval.dpg_bench",
    "hpsv2": "mmrl.eval.hpsv2",
    "fid": "mmrl.eval.distribution",
    "diversity": "mmrl.eval.distribution",
    "shapeworld": "mmrl.eval.shapeworld",
}


def _plugin_name(name: str) -> str | None:
    """The :data:`PLUGINS` key a benchmark name belongs to (``fid@drawbench`` -> ``fid``), or None."""
    import re

    head = re.split(r"[@:]", name, maxsplit=1)[0]
    return head if head in PLUGINS else None


def _plugin(key: str):
    import importlib

    return importlib.import_module(PLUGINS[key])


def _plugin_keys_of(module_name: str) -> dict[str, str]:
    """A plug-in module's eval keys (``{}`` when the module is not there)."""
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        return {}
    return dict(getattr(module, "EVAL_KEYS", {}))


def _plugin_keys() -> dict[str, str]:
    """Every plug-in's eval keys (a key two plug-ins share must mean the same there)."""
    keys: dict[str, str] = {}
    for module_name in dict.fromkeys(PLUGINS.values()):
        keys.update(_plugin_keys_of(module_name))
    return keys


#: Config fields the protocol sets (use the eval key instead).
_PROTOCOL_FIELDS = {"model.resolution": "resolution", "sampling.guidance_scale": "guidance",
                    "sampling.eval_num_steps": "num_steps"}
_GRID_PROMPTS = 8
_NAN = float("nan")


# --------------------------------------------------------------------------------------------------- keys


@dataclass
class EvalOptions:
    """The parsed eval keys (see :data:`EVAL_KEYS`); ``given`` lists the keys the user set."""

    checkpoint: str | None = None
    benchmarks: list[str] = field(default_factory=lambda: ["geneval", "ocr"])
    output_dir: str | None = None
    limit: int | None = None
    images_per_prompt: int | None = None
    seed: int | None = None
    num_steps: int | None = None
    resolution: int | None = None
    guidance: float | None = None
    prompts: str | None = None
    detector: str | None = None
    clip_model: str | None = None
    reward_kwargs: dict = field(default_factory=dict)
    ema: bool = True
    progress: bool | None = None
    #: the plug-ins' eval keys (:data:`PLUGINS`), as parsed YAML values; each plug-in checks its own
    extra: dict = field(default_factory=dict)
    given: tuple[str, ...] = ()

    def record(self) -> dict[str, Any]:
        """The keys the user gave, for ``summary.json`` (``output_dir`` left out: it is where the summary is)."""
        return {k: (self.extra[k] if k in self.extra else getattr(self, k)) for k in self.given if k != "output_dir"}


def _nearest(name: str, names: Sequence[str]) -> list[str]:
    import difflib

    return difflib.get_close_matches(name, list(names), n=2, cutoff=0.5)


def _int(key: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise EvalError(f"{key}={value!r}: expected an integer >= {low}")
    return value


def split_eval_args(items: Sequence[str], known: Mapping[str, str], *, dotted: Callable[[str], None] | None = None,
                    unknown: Callable[[str], None] | None = None) -> tuple[dict[str, Any], list[str]]:
    """``({eval key: YAML value}, [dotted config overrides])`` of ``key=value`` arguments: a missing ``=``, a key
    not in ``known`` (``unknown(key)`` may raise its own error first) or a key given twice is a one-line
    :class:`EvalError`; ``dotted(key)`` may refuse a dotted key."""
    from mmrl.config import parse_overrides

    values: dict[str, Any] = {}
    overrides: list[str] = []
    valid = ", ".join(known)
    for item in items:
        if "=" not in item:
            raise EvalError(f"{item!r}: expected key=value (eval keys: {valid}; config overrides are dotted, "
                            f"e.g. model.dtype=bfloat16)")
        key = item.split("=", 1)[0].strip()
        if "." in key:
            if dotted is not None:
                dotted(key)
            overrides.append(item)
            continue
        if key not in known:
            if unknown is not None:
                unknown(key)
            close = _nearest(key, known)
            hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
            raise EvalError(f"unknown eval key {key!r}; {hint}valid eval keys: {valid} (config overrides are dotted, "
                            f"e.g. model.dtype=bfloat16)")
        if key in values:
            raise EvalError(f"eval key {key!r} given twice")
        values[key] = parse_overrides([item])[0][1]
    return values, overrides


def benchmark_list(value: Any, example: str, check: Callable[[str], str] = str.strip) -> list[str]:
    """A ``benchmarks=`` value: a non-empty list of names (or one comma-separated string), each checked by
    ``check``, none twice."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",")]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise EvalError(f"benchmarks={value!r}: expected a non-empty list, e.g. {example}")
    value = [check(v.strip()) for v in value]
    repeated = [v for v, n in Counter(value).items() if n > 1]
    if repeated:
        raise EvalError(f"benchmarks: {repeated[0]!r} is listed twice")
    return value


#: the largest base seed: a sample's seed is the base plus its index, and torch's generators take 64-bit seeds
MAX_SEED = 2**62


def _seed(value: Any) -> int:
    """``seed=``: an integer in ``[0, MAX_SEED)``."""
    value = _int("seed", value, 0)
    if value >= MAX_SEED:
        raise EvalError(f"seed={value}: must be below 2**62 (a sample's seed is the base seed plus its index, and "
                        f"torch's generators take 64-bit seeds)")
    return value


def parse_eval_args(items: Sequence[str]) -> tuple[EvalOptions, list[str]]:
    """Split ``key=value`` arguments into the eval keys (:data:`EVAL_KEYS`, values parsed as YAML) and the dotted
    config overrides, checking every eval value."""

    def refuse(key: str) -> None:
        if key in _PROTOCOL_FIELDS:
            raise EvalError(f"{key} is set by the evaluation protocol: use {_PROTOCOL_FIELDS[key]}=... instead")

    values, overrides = split_eval_args(items, {**EVAL_KEYS, **_plugin_keys()}, dotted=refuse)
    options = EvalOptions(given=tuple(values))
    for key, value in values.items():
        if key not in EVAL_KEYS:  # a plug-in's key: checked by its benchmark()
            options.extra[key] = value
            continue
        if key in ("limit", "images_per_prompt", "num_steps"):
            value = _int(key, value, 1)
        elif key == "seed":
            value = _seed(value)
        elif key == "resolution":
            value = _int(key, value, 16)
            if value % 16:
                raise EvalError(f"resolution={value}: must be a multiple of 16")
        elif key == "guidance":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise EvalError(f"guidance={value!r}: expected a number >= 0 (1.0 disables SD3's CFG)")
            value = float(value)
        elif key == "benchmarks":
            value = benchmark_list(value, "benchmarks=[ocr,geneval]")
        elif key == "reward_kwargs":
            if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
                raise EvalError("reward_kwargs: expected {REWARD_NAME: {argument: value}}, e.g. "
                                "reward_kwargs={pickscore: {model: /path/to/PickScore_v1}}")
        elif key in ("ema", "progress"):
            if not isinstance(value, bool):
                raise EvalError(f"{key}={value!r}: expected true or false")
        else:  # checkpoint, output_dir, prompts, detector, clip_model
            if value is None or isinstance(value, (dict, list)) or str(value).strip() == "":
                raise EvalError(f"{key}={value!r}: expected a path or name")
            value = str(value)
        setattr(options, key, value)
    return options, overrides


# --------------------------------------------------------------------------------------------------- benchmarks


@dataclass(frozen=True)
class BenchmarkSpec:
    """One requested benchmark: ``kind`` (ocr, geneval, reward), its prompt set, the rewards of a reward one."""

    name: str
    kind: str
    prompt_set: str
    rewards: tuple[str, ...] = ()

    @property
    def folder(self) -> str:
        """The benchmark's name as a folder name (``reward:pickscore@drawbench`` -> ``reward-pickscore@drawbench``)."""
        return "".join(c if c.isalnum() or c in "._@+-" else "-" for c in self.name)


def parse_benchmark(name: str, options: EvalOptions) -> BenchmarkSpec:
    """Check one ``benchmarks`` entry (reward names and their ``reward_kwargs`` too, without building anything)."""
    from mmrl.rewards import check_reward_arguments
    from mmrl.rewards._base import reward_scores_images

    if name in ("ocr", "geneval"):
        return BenchmarkSpec(name, name, name)
    if name.startswith("reward:"):
        body, _, prompt_set = name[len("reward:"):].partition("@")
        rewards = tuple(r.strip() for r in body.split("+"))
        if not all(rewards):
            raise EvalError(f"benchmark {name!r}: expected reward:NAME[+NAME...][@SET], e.g. "
                            f"reward:pickscore@drawbench")
        if prompt_set:
            if prompt_set not in REWARD_SETS:
                raise EvalError(f"benchmark {name!r}: unknown prompt set {prompt_set!r}; shipped sets: "
                                f"{', '.join(REWARD_SETS)} (or leave out @SET and give prompts=FILE)")
        elif options.prompts is None:
            raise EvalError(f"benchmark {name!r} needs prompts: a shipped set (reward:{body}@drawbench, @partiprompts, "
                            f"@geneval, @ocr) or prompts=FILE")
        for reward in rewards:
            try:
                check_reward_arguments(reward, options.reward_kwargs.get(reward, {}))
            except ValueError as exc:
                raise EvalError(f"benchmark {name!r}: {exc}") from None
            if not reward_scores_images(reward):
                raise EvalError(f"benchmark {name!r}: {reward!r} scores text answers, not images")
        return BenchmarkSpec(name, "reward", prompt_set or "file", rewards)
    plugin = _plugin_name(name)
    if plugin is not None:
        try:
            module = _plugin(plugin)
        except ModuleNotFoundError as exc:
            if exc.name != PLUGINS[plugin]:
                raise
            raise EvalError(f"benchmark {name!r}: its module {PLUGINS[plugin]} is not installed") from None
        return module.benchmark(name, options)
    close = _nearest(name, ["ocr", "geneval", *PLUGINS, *_NOT_YET])
    if name in _NOT_YET:
        raise EvalError(f"benchmark {name!r}: {_NOT_YET[name]}")
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise EvalError(f"unknown benchmark {name!r}; {hint}benchmarks: ocr, geneval, {', '.join(PLUGINS)}, "
                    f"reward:NAME[+NAME...][@SET] (SET: {', '.join(REWARD_SETS)}; without @SET: prompts=FILE)")


@dataclass(frozen=True)
class EvalItem:
    """One prompt of a benchmark: ``index`` (0-based, file order), ``metadata`` (what rewards get: GenEval's
    clauses, a JSONL line's fields), ``category`` (GenEval tag, PartiPrompts category), ``target`` (OCR text)."""

    index: int
    prompt: str
    metadata: dict = field(default_factory=dict)
    category: str | None = None
    target: str | None = None


def load_prompt_set(prompt_set: str, prompts: str | None = None) -> tuple[list[EvalItem], Path, str | None]:
    """``(items, file read, pinned sha256 or None)``. A shipped file must have its pinned sha256; a missing or
    malformed file is a :class:`~mmrl.data.prompts.DataError` naming it."""
    from mmrl.data.prompts import DataError, read_prompts
    from mmrl.eval import benchmarks as b

    if prompt_set == "file":
        path = Path(prompts)
        items = [EvalItem(i, p.prompt, dict(p.metadata)) for i, p in enumerate(read_prompts(path))]
        return items, path, None
    if prompt_set == "ocr":
        loaded = b.load_ocr_prompts()
        items = [EvalItem(p.index, p.prompt, {}, None, p.target) for p in loaded]
        key = "ocr/test.txt"
    elif prompt_set == "geneval":
        loaded = b.load_geneval()
        items = [EvalItem(p.index, p.prompt, p.metadata(), p.tag) for p in loaded]
        key = "geneval/evaluation_metadata.jsonl"
    elif prompt_set == "drawbench":
        loaded = b.load_drawbench()
        items = [EvalItem(p.index, p.prompt) for p in loaded]
        key = "drawbench/prompts_unique.txt"
    elif prompt_set == "partiprompts":
        loaded = b.load_partiprompts()
        items = [EvalItem(p.index, p.prompt, {"category": p.category, "challenge": p.challenge}, p.category)
                 for p in loaded]
        key = "partiprompts/PartiPrompts.tsv"
    else:
        raise ValueError(prompt_set)
    path = Path(loaded.source)
    pinned = PINNED_SHA256[key]
    sha = file_sha256(path)
    if sha != pinned:
        raise DataError(f"{path}: not the version of the {prompt_set} file mmrl pins (sha256 {sha[:16]}..., expected "
                        f"{pinned[:16]}...): restore the shipped file (assets/benchmarks/{key})")
    return items, path, pinned


# --------------------------------------------------------------------------------------------------- scorers


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _mmrl_version() -> str:
    from mmrl import __version__

    return __version__


def _float(value: Any) -> float | None:
    """A JSON-ready score: a finite float, or None for NaN / no value."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _nan(value: Any) -> float:
    return _NAN if value is None else float(value)


def _jsonable(value: Any) -> Any:
    """NaN / inf -> None, tuples -> lists, numpy / torch scalars -> Python numbers, recursively."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "item"):
        return _jsonable(value.item())
    return str(value)


class Scorer:
    """Scores one prompt's images: :meth:`score` -> one ``{"scores", "verdict", "reason"}`` per image;
    :meth:`summarize` turns a benchmark's rows into its metrics. ``describe`` is known before any model loads."""

    name: str = ""
    version: str = ""
    settings: dict = {}
    defaults: dict = {}
    #: the benchmark's main number: a key of :meth:`summarize`'s metrics (dotted for nested ones)
    headline: str = ""
    #: other top-level metrics the console line prints beside the headline (FID's KID)
    also_printed: tuple[str, ...] = ()
    #: the rows' score key that ranks prompts (worst / best in the report)
    sample_score: str = ""

    def build(self) -> None:
        raise NotImplementedError

    def score(self, images: list, item: EvalItem) -> list[dict]:
        raise NotImplementedError

    def summarize(self, rows: list[dict], items: list[EvalItem], out: Path) -> dict:
        """The benchmark's metrics from its rows (``out``: the eval folder; row ``"image"`` paths are relative to
        it)."""
        raise NotImplementedError


class OCRScorer(Scorer):
    """rapidocr reads each image (:class:`mmrl.rewards.ocr.OCRReward`'s engine, real PP-OCR weights from its wheel);
    :func:`mmrl.eval.scoring.ocr_accuracy` against the prompt's target; :func:`~mmrl.eval.scoring.ocr_benchmark`."""

    name = "ocr_accuracy"
    headline = "accuracy"
    sample_score = "ocr_accuracy"

    def __init__(self):
        import importlib.util

        if importlib.util.find_spec("rapidocr") is None or importlib.util.find_spec("onnxruntime") is None:
            raise EvalError("benchmark ocr needs rapidocr with onnxruntime: pip install rapidocr onnxruntime")
        self.version = f"rapidocr {_version('rapidocr')}, onnxruntime {_version('onnxruntime')}, mmrl {_mmrl_version()}"
        self.settings = {"engine": "rapidocr.RapidOCR, the PP-OCR ONNX weights of its wheel (mmrl.rewards.ocr)",
                         "use_cls": False, "text_score": 0.5, "det_limit_type": "max", "det_limit_side_len": 960,
                         "accuracy": "mmrl.eval.scoring.ocr_accuracy (Flow-GRPO flow_grpo/ocr.py OcrScorer.__call__)"}
        self.reward = None

    def build(self) -> None:
        from mmrl.rewards.ocr import OCRReward

        try:
            self.reward = OCRReward()
        except ImportError as exc:
            raise EvalError(f"benchmark ocr: {exc}") from None

    def score(self, images: list, item: EvalItem) -> list[dict]:
        from mmrl.eval.scoring import ocr_accuracy

        out = []
        for image in images:
            try:
                recognized = self.reward.recognize(image)
            except Exception as exc:  # the engine failing on one image is that image's NaN
                out.append({"scores": {"ocr_accuracy": None}, "verdict": {"target": item.target, "recognized": None},
                            "reason": f"OCR engine failed: {type(exc).__name__}: {exc}"})
                continue
            out.append({"scores": {"ocr_accuracy": _float(ocr_accuracy(recognized, item.target))},
                        "verdict": {"target": item.target, "recognized": recognized}, "reason": None})
        return out

    def summarize(self, rows: list[dict], items: list[EvalItem], out: Path) -> dict:
        from mmrl.eval.scoring import ocr_benchmark

        return ocr_benchmark([_nan(r["scores"]["ocr_accuracy"]) for r in rows])


class GenEvalScorer(Scorer):
    """mmrl's GenEval reward (``evaluate_images.py``'s rules) per image; :func:`mmrl.eval.scoring.geneval_scores`."""

    name = "geneval"
    headline = "overall"
    sample_score = "correct"
    #: what the reason of an image that could not be scored names
    failure = "GenEval scoring"

    def __init__(self, detector: str | None, clip_model: str | None):
        from mmrl.rewards.geneval import DEFAULT_CLIP, DEFAULT_DETECTOR

        self.defaults = {"detector": DEFAULT_DETECTOR, "clip_model": DEFAULT_CLIP}
        self.settings = {"detector": detector or DEFAULT_DETECTOR, "clip_model": clip_model or DEFAULT_CLIP,
                         "threshold": 0.3, "counting_threshold": 0.9, "max_objects": 16, "max_overlap": 1.0,
                         "position_threshold": 0.1, "bgcolor": "#999",
                         "rules": "mmrl.rewards.geneval (djghosh13/geneval evaluation/evaluate_images.py)",
                         "summary": "mmrl.eval.scoring.geneval_scores (evaluation/summary_scores.py)"}
        self.version = f"mmrl {_mmrl_version()}, transformers {_version('transformers')}"
        self.reward = None

    def build(self) -> None:
        from mmrl.rewards import build_reward

        self.reward = build_reward("geneval", detector=self.settings["detector"],
                                   clip_model=self.settings["clip_model"])

    def score(self, images: list, item: EvalItem) -> list[dict]:
        n = len(images)
        try:
            out = self.reward(images, None, [item.metadata] * n)
        except Exception as exc:
            reason = f"{self.failure} failed: {type(exc).__name__}: {exc}"
            return [{"scores": {"correct": None, "partial": None}, "verdict": None, "reason": reason}] * n
        details = list(self.reward.last_details) + [None] * n
        reasons = self.reward.last_info.get("nan_samples", {})
        rows = []
        for i in range(n):
            rows.append({"scores": {"correct": _float(out["strict"][i]), "partial": _float(out["partial"][i])},
                         "verdict": _jsonable(details[i]), "reason": reasons.get(i)})
        return rows

    def summarize(self, rows: list[dict], items: list[EvalItem], out: Path) -> dict:
        from mmrl.eval.scoring import geneval_scores, mean_with_count

        by_index = {item.index: item for item in items}
        results = [{"tag": by_index[r["prompt_index"]].category, "correct": _nan(r["scores"]["correct"]),
                    "metadata": by_index[r["prompt_index"]].metadata} for r in rows]
        out = geneval_scores(results)
        out["partial"] = mean_with_count([_nan(r["scores"]["partial"]) for r in rows])
        return out


class RewardScorer(Scorer):
    """Registered image rewards, averaged: per score key :func:`mmrl.eval.scoring.mean_with_count`, and per
    category for prompt sets that have one (GenEval tags, PartiPrompts categories)."""

    def __init__(self, rewards: Sequence[str], kwargs: Mapping[str, dict]):
        self.rewards = list(rewards)
        self.kwargs = {r: dict(kwargs.get(r, {})) for r in self.rewards}
        self.name = "reward:" + "+".join(self.rewards)
        self.headline = f"{self.rewards[0]}.mean"
        self.sample_score = self.rewards[0]
        self.settings = {r: _jsonable(self.kwargs[r]) for r in self.rewards}
        self.version = f"mmrl {_mmrl_version()}, transformers {_version('transformers')}"
        self.built: list = []

    def build(self) -> None:
        from mmrl.rewards import build_reward

        self.built = [build_reward(r, **self.kwargs[r]) for r in self.rewards]

    def score(self, images: list, item: EvalItem) -> list[dict]:
        n = len(images)
        scores: list[dict] = [{} for _ in range(n)]
        reasons: list[list[str]] = [[] for _ in range(n)]
        for name, reward in zip(self.rewards, self.built):
            try:
                out = reward(images, [item.prompt] * n, [item.metadata] * n)
            except Exception as exc:  # a scorer that fails on a batch: every image NaN, with the reason
                for i in range(n):
                    scores[i][name] = None
                    reasons[i].append(f"{name}: failed: {type(exc).__name__}: {exc}")
                continue
            nan_reasons = reward.last_info.get("nan_samples", {})
            for key, values in out.items():
                label = name if key == name else f"{name}/{key}"
                for i in range(n):
                    scores[i][label] = _float(values[i])
            for i in range(n):
                if i in nan_reasons:
                    reasons[i].append(f"{name}: {nan_reasons[i]}")
        return [{"scores": s, "verdict": None, "reason": "; ".join(r) or None} for s, r in zip(scores, reasons)]

    def summarize(self, rows: list[dict], items: list[EvalItem], out: Path) -> dict:
        from mmrl.eval.scoring import mean_with_count

        keys: list[str] = []
        for r in rows:
            keys += [k for k in r["scores"] if k not in keys]
        out: dict[str, Any] = {k: mean_with_count([_nan(r["scores"].get(k)) for r in rows]) for k in keys}
        by_index = {item.index: item for item in items}
        categories = sorted({by_index[r["prompt_index"]].category for r in rows} - {None})
        if categories:
            out["per_category"] = {
                name: {c: mean_with_count([_nan(r["scores"].get(name)) for r in rows
                                           if by_index[r["prompt_index"]].category == c]) for c in categories}
                for name in self.rewards}
        return out


def _load_items(spec: BenchmarkSpec, options: EvalOptions) -> tuple[list[EvalItem], Path, str | None]:
    if spec.kind in PLUGINS:
        return _plugin(spec.kind).load_items(spec, options)
    return load_prompt_set(spec.prompt_set, options.prompts)


def _defaults(spec: BenchmarkSpec):
    from mmrl.eval.protocol import DEFAULTS

    if spec.kind in PLUGINS:
        return _plugin(spec.kind).defaults(spec)
    return DEFAULTS[spec.prompt_set]


def _make_scorer(spec: BenchmarkSpec, options: EvalOptions) -> Scorer:
    if spec.kind in PLUGINS:
        return _plugin(spec.kind).make_scorer(spec, options)
    if spec.kind == "ocr":
        return OCRScorer()
    if spec.kind == "geneval":
        return GenEvalScorer(options.detector, options.clip_model)
    return RewardScorer(spec.rewards, options.reward_kwargs)


def _main_keys(spec: BenchmarkSpec) -> list[str]:
    """The score keys whose NaN means the image was not judged."""
    if spec.kind in PLUGINS:
        return list(_plugin(spec.kind).main_keys(spec))
    if spec.kind == "ocr":
        return ["ocr_accuracy"]
    if spec.kind == "geneval":
        return ["correct"]
    return list(spec.rewards)


# --------------------------------------------------------------------------------------------------- checkpoint


def weights_sha256(tensors: Mapping[str, Any]) -> str:
    """sha256 over the tensors sorted by name: each name, dtype, shape and raw bytes (CPU, contiguous)."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass
class _Checkpoint:
    path: Path | None  # None: base
    run_dir: Path | None
    ema: bool | None = None
    weights: dict | None = None
    sha256: str | None = None
    #: the live weights of a training run (evaluation during training): ``"update <k>"``
    live: str | None = None

    @property
    def name(self) -> str:
        return str(self.path) if self.path else (self.live or "base")

    def record(self) -> dict[str, Any]:
        return {"path": self.name, "run_dir": str(self.run_dir) if self.run_dir else None,
                "ema": self.ema, "weights_sha256": self.sha256, **({"update": self.live} if self.live else {})}


def _resolve_checkpoint(options: EvalOptions, run_dir: Path) -> _Checkpoint:
    """The weights to evaluate: ``checkpoint=`` (a run folder's latest checkpoint, a checkpoint folder, ``base``), by
    default ``run_dir``'s latest checkpoint, else base. The EMA weights when the checkpoint has them (``ema``)."""
    from mmrl.checkpoint import CheckpointError, evaluated_weights, latest_checkpoint

    value = options.checkpoint
    if value == "base" or (value is None and latest_checkpoint(run_dir / "checkpoints") is None):
        return _Checkpoint(None, None)
    path = Path(value) if value is not None else run_dir
    if not path.is_dir() and value is not None and (run_dir / "checkpoints" / value).is_dir():
        path = run_dir / "checkpoints" / value  # checkpoint=step_3: the run's own checkpoints/step_3
    if not path.is_dir():
        raise EvalError(f"checkpoint={value}: no such run or checkpoint folder (or checkpoint=base for the untrained "
                        f"model)")
    if (path / "trainable.safetensors").is_file():
        ckpt, run = path, path.parent.parent
    else:
        ckpt = latest_checkpoint(path / "checkpoints")
        if ckpt is None:
            raise EvalError(f"checkpoint={path}: neither a checkpoint folder (trainable.safetensors) nor a run folder "
                            f"with complete checkpoints/")
        run = path
    try:
        weights, ema = evaluated_weights(ckpt, options.ema)  # as mmrl sample
    except CheckpointError as exc:
        raise EvalError(exc.for_reading("eval")) from None
    return _Checkpoint(ckpt, run, ema, weights, weights_sha256(weights))


def _generator(config, ckpt: _Checkpoint) -> dict[str, Any]:
    """What decides the images besides the protocol: the model, its generation settings, the weights."""
    m, s = config.model, config.sampling
    record = {"family": m.family, "pretrained": m.pretrained, "revision": m.revision, "dtype": m.dtype,
              "use_lora": m.use_lora, "lora_rank": m.lora_rank, "lora_alpha": m.lora_alpha,
              "lora_target_modules": list(m.lora_target_modules), "max_sequence_length": s.max_sequence_length,
              "time_shift": s.time_shift, "negative_prompt": s.negative_prompt,
              "checkpoint": ckpt.name, "ema": ckpt.ema, "weights_sha256": ckpt.sha256}
    key = {k: v for k, v in record.items() if k != "checkpoint"}  # the folder may move; the weights' hash decides
    record["hash"] = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return record


# --------------------------------------------------------------------------------------------------- files


def _read_rows(path: Path) -> list[dict]:
    """The rows of ``samples.jsonl``; a last line cut short by a kill is dropped from the file."""
    from mmrl.data.prompts import json_error

    if not path.is_file():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as handle:
            handle.truncate(cut)
        data = data[:cut]
    rows = []
    for number, line in enumerate(data.decode("utf-8", errors="replace").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EvalError(f"{path}:{number}: {json_error(exc)}: not a row mmrl eval wrote (remove the line, or "
                            f"evaluate into another output_dir=)") from None
        if not isinstance(row, dict) or not {"benchmark", "prompt_index", "image_index", "protocol",
                                             "generator", "scores"} <= set(row):
            raise EvalError(f"{path}:{number}: not a row mmrl eval wrote (remove the line, or evaluate into another "
                            f"output_dir=)")
        rows.append(row)
    return rows


def _write_json(path: Path, data: Any) -> None:
    """Atomically (a temporary file renamed into place)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(_jsonable(data), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _to_pil(image):
    from mmrl.tracking import make_grid_image

    return make_grid_image(image[None], rows=1)


def _save_png(image, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    image.save(tmp, format="PNG")
    os.replace(tmp, path)


def _grid(out: Path, spec: BenchmarkSpec, protocol: Protocol) -> Path:
    """``grids/<benchmark>.png``: the first prompts (rows) x their images (columns); one image per prompt: 4 a row."""
    import numpy as np
    import torch
    from PIL import Image

    from mmrl.tracking import make_grid_image

    k = protocol.images_per_prompt
    prompts = min(protocol.num_prompts, _GRID_PROMPTS if k > 1 else 2 * _GRID_PROMPTS)
    size = protocol.resolution
    tiles = []
    for i in range(prompts):
        for j in range(k):
            path = out / "images" / spec.folder / f"{i:05d}_{j}.png"
            if path.is_file():
                with Image.open(path) as handle:
                    array = np.asarray(handle.convert("RGB").resize((size, size)))
                tiles.append(torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 255)
            else:  # an image removed by hand: a grey tile
                tiles.append(torch.full((3, size, size), 0.5))
    rows = prompts if k > 1 else math.ceil(prompts / 4)
    target = out / "grids" / f"{spec.folder}.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    _save_png(make_grid_image(torch.stack(tiles), rows=rows), target)
    return target


def _packages() -> dict[str, str]:
    names = ("torch", "diffusers", "transformers", "peft", "accelerate", "numpy", "pillow", "safetensors",
             "rapidocr", "onnxruntime", "rapidfuzz")
    return {"mmrl": _mmrl_version(), "mmrl-align": _version("mmrl-align"), **{n: _version(n) for n in names},
            "python": sys.version.split()[0]}


# --------------------------------------------------------------------------------------------------- the run


def _configure_policy(policy, protocol: Protocol, negative_prompt: str) -> None:
    """Apply a protocol's resolution and guidance to a built :class:`~mmrl.pipelines.flow.policy.FlowPolicy` (what
    its constructor derives from ``model.resolution`` and ``sampling.guidance_scale``), so benchmarks with other
    settings share one loaded model."""
    try:  # a resolution the model cannot generate is the user's to fix, not an error deep inside diffusers
        policy.resolution = protocol.resolution
    except ValueError as exc:
        raise EvalError(f"{protocol.benchmark}: {exc}") from None
    policy.set_guidance(protocol.guidance_scale, negative_prompt)


def _config_path(config: str | Path) -> tuple[Path, Path | None]:
    """``(config file, run folder or None)``: CONFIG may be a config file or a run folder holding config.yaml."""
    path = Path(config)
    if path.is_dir():
        if not (path / "config.yaml").is_file():
            raise EvalError(f"{path} is a folder without config.yaml: give a training config or a run folder")
        return path / "config.yaml", path
    if path.name == "config.yaml" and (path.parent / "checkpoints").is_dir():
        return path, path.parent
    return path, None


def _config_family(config_file: Path, args: Sequence[str]) -> str:
    """``model.family`` of CONFIG with the dotted overrides among ``args`` applied (eval keys are ignored)."""
    from mmrl.config import load_config

    dotted = [a for a in args if "=" in a and "." in a.split("=", 1)[0]]
    quiet = logging.getLogger("mmrl.config")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its warnings come once, from the full load that follows
    try:
        return load_config(config_file, dotted, check_files=False).model.family
    except Exception:  # let the full parse below report the mistake, unless the folder is another command's run
        from mmrl.checkpoint import other_command_run

        other = other_command_run(config_file.parent)
        if other:  # (its VLM keys would otherwise read as unknown image-benchmark keys)
            raise EvalError(other) from None
        return ""
    finally:
        quiet.setLevel(level)


def run_eval(config: str | Path, args: Sequence[str] = (), *, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``mmrl eval CONFIG args...`` (see the module docstring); returns the summary written to
    ``summary.json``. Every check that needs no model (keys, config, benchmarks, prompt files, the checkpoint, an
    existing ``output_dir``'s protocol) is done before any model loads."""
    from mmrl.config import load_config

    started = time.time()
    config_file, run_dir = _config_path(config)
    if _config_family(config_file, args) == "qwen_vl":  # a vision-language policy: its own benchmarks and keys
        from mmrl.eval.vlm import run_vlm_eval

        return run_vlm_eval(config, args, echo=echo)
    options, overrides = parse_eval_args(args)
    cfg = load_config(config_file, overrides, check_files=False)  # the training data is not needed
    if "benchmarks" not in options.given and cfg.eval.benchmarks:
        # without benchmarks=: the ones the run evaluates during training, with its eval.options (the keys given
        # here win); the limit stays this command's (default: whole benchmarks)
        from mmrl.config import yaml_literal

        defaults = [f"benchmarks={yaml_literal(list(cfg.eval.benchmarks))}"] + [
            f"{k}={yaml_literal(v)}" for k, v in cfg.eval.options.items() if k not in options.given]
        options, overrides = parse_eval_args([*defaults, *args])
    run_dir = run_dir or Path(cfg.output_dir)  # the run this config trains
    plans = plan_benchmarks(cfg, options)
    ckpt = _resolve_checkpoint(options, run_dir)
    out = default_output_dir(options, ckpt, cfg, run_dir)
    return _run(cfg, options, overrides, plans, ckpt, out, config_file, echo=echo, started=started)


def default_output_dir(options, ckpt: "_Checkpoint", cfg, run_dir: Path | None = None) -> Path:
    """``output_dir=``, else ``RUN/eval/<checkpoint>`` (``-no_ema`` when its EMA weights are not used), else
    ``<run_dir>/eval/base``: the run folder named on the command line (a copied run writes into its copy), else the
    config's ``output_dir``."""
    if options.output_dir is not None:
        return Path(options.output_dir)
    if ckpt.path is not None:
        no_ema = (ckpt.path / "ema.pt").is_file() and not options.ema
        return ckpt.run_dir / "eval" / (ckpt.path.name + ("-no_ema" if no_ema else ""))
    return Path(run_dir or cfg.output_dir) / "eval" / "base"


def open_output_dir(out: Path, generator: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict]]:
    """``(protocol.json's state, samples.jsonl's rows)`` of an existing ``out`` (empty for a new one), refusing in
    one line a file in its place, an unreadable state, or rows of another model or checkpoint."""
    if out.exists() and not out.is_dir():
        raise EvalError(f"output_dir={out} is a file, not a folder")
    state_file = out / "protocol.json"
    state: dict[str, Any] = {}
    if state_file.is_file():
        try:
            state = json.loads(state_file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise EvalError(f"{state_file}: not valid JSON (evaluate into another output_dir=)") from None
    rows = _read_rows(out / "samples.jsonl")
    old_gen = state.get("generator", {})
    if (old_gen and old_gen.get("hash") != generator["hash"]) or any(r["generator"] != generator["hash"][:16]
                                                                      for r in rows):
        diff = [f"{k}: {old_gen.get(k)!r} -> {generator[k]!r}" for k in generator
                if old_gen and k not in ("hash", "checkpoint") and old_gen.get(k) != generator[k]]
        raise EvalError(f"output_dir={out} holds an evaluation of another model or checkpoint"
                        f"{' (' + '; '.join(diff) + ')' if diff else ''}: evaluate into another output_dir=")
    return state, rows


def rows_of_protocol(out: Path, rows: list[dict], state: Mapping[str, Any], name: str, protocol, what: str) -> list[dict]:
    """The rows of benchmark ``name`` in an existing ``out``, refusing in one line rows made under another protocol
    (naming the fields that differ from ``protocol.json``'s record)."""
    theirs = [r for r in rows if r["benchmark"] == name]
    if any(r["protocol"] != protocol.hash()[:16] for r in theirs):
        old = state.get("benchmarks", {}).get(name)
        diff = protocol.differences(old) if old else []
        raise EvalError(f"output_dir={out} holds {name} {what} made under another protocol"
                        f"{' (' + '; '.join(diff) + ')' if diff else ''}: evaluate into another output_dir=")
    return theirs


def summary_record(cfg, config_file: Path | None, ckpt: "_Checkpoint", generator: Mapping[str, Any],
                   benchmarks: Mapping[str, Any], options, overrides: Sequence[str], packages: Mapping[str, str]
                   ) -> dict[str, Any]:
    """``summary.json``'s content (JSON-ready): the benchmarks' results with everything that made them."""
    import torch

    from mmrl.config import config_to_dict

    return _jsonable({
        "mmrl_eval": 1,
        "config_file": str(config_file) if config_file is not None else None,
        "checkpoint": ckpt.record(),
        "generator": generator,
        "benchmarks": benchmarks,
        "eval_keys": options.record(),
        "config_overrides": list(overrides),
        "config": config_to_dict(cfg),
        "packages": dict(packages),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    })


def build_policy_with(cfg, ckpt: "_Checkpoint"):
    """The config's policy with ``ckpt``'s trainable weights loaded (the base model for ``checkpoint=base``)."""
    import torch

    from mmrl.build import build_policy

    policy = build_policy(cfg, device="cuda" if torch.cuda.is_available() else "cpu")
    if ckpt.weights is not None:
        from mmrl.checkpoint import load_trainable

        try:
            load_trainable(policy.named_trainable_parameters(), ckpt.weights, ckpt.path)
        except ValueError as exc:
            raise EvalError(f"{exc} (were the overrides changing the model or its LoRA setup?)") from None
    return policy


def checkpoint_text(ckpt: "_Checkpoint", cfg) -> str:
    """How the startup line names the weights evaluated."""
    if ckpt.path is not None or ckpt.live:
        return f"{ckpt.name}{' (EMA weights)' if ckpt.ema else ''}"
    return f"base (the untrained {cfg.model.pretrained})"


def plan_benchmarks(cfg, options: EvalOptions) -> list[tuple]:
    """Check the requested benchmarks against each other and the config, load their prompts and resolve their
    protocols, building no model: ``[(spec, items used, all items, scorer, protocol)]``."""
    specs = [parse_benchmark(name, options) for name in options.benchmarks]
    requested = {r for s in specs for r in s.rewards}
    stray = [name for name in options.reward_kwargs if name not in requested]
    if stray:
        raise EvalError(f"reward_kwargs names {stray[0]!r}, which no reward:NAME benchmark uses "
                        f"(benchmarks: {', '.join(options.benchmarks)})")
    if options.prompts is not None and not any(s.prompt_set == "file" for s in specs):
        raise EvalError("prompts= is for reward:NAME benchmarks without @SET; none is requested")
    if not any(s.kind == "geneval" for s in specs) and (options.detector or options.clip_model):
        raise EvalError("detector= and clip_model= are for the geneval benchmark, which is not requested")
    used_keys = {key for s in specs if s.kind in PLUGINS for key in getattr(_plugin(s.kind), "EVAL_KEYS", {})}
    for key in options.extra:
        if key not in used_keys:
            owners = [name for name, module in PLUGINS.items() if key in _plugin_keys_of(module)]
            raise EvalError(f"{key}= is for the {' / '.join(owners) or 'other'} benchmark(s), none of which is "
                            f"requested (benchmarks: {', '.join(options.benchmarks)})")

    user = {key: getattr(options, key) for key in OVERRIDABLE}
    plans = []
    for spec in specs:
        items, path, pinned = _load_items(spec, options)
        scorer = _make_scorer(spec, options)
        protocol = resolve_protocol(
            spec.name, _defaults(spec), prompts_file=path, pinned_sha256=pinned, total_prompts=len(items),
            scorer=scorer.name, scorer_version=scorer.version, scorer_settings=scorer.settings,
            scorer_defaults=scorer.defaults, user=user, limit=options.limit, family=cfg.model.family,
            config_guidance=cfg.sampling.guidance_scale)
        plans.append((spec, items[:protocol.num_prompts], items, scorer, protocol))
    return plans


def _run(cfg, options: EvalOptions, overrides: Sequence[str], plans: list[tuple], ckpt: "_Checkpoint", out: Path,
         config_file: Path | None, *, echo: Callable[[str], None], started: float, policy=None) -> dict[str, Any]:
    """Generate what ``out`` lacks, score it, write ``summary.json``. ``policy``: an already built policy with the
    weights ``ckpt`` describes (evaluation during training); ``None`` builds one from ``cfg`` and loads ``ckpt``."""
    generator = _generator(cfg, ckpt)
    # ---- an existing output_dir: same model, same protocols, or a one-line error
    samples = out / "samples.jsonl"
    state_file = out / "protocol.json"
    state, rows = open_output_dir(out, generator)
    done: dict[tuple[str, int, int], dict] = {}
    for spec, _, _, _, protocol in plans:
        for r in rows_of_protocol(out, rows, state, spec.name, protocol, "images"):
            done[(spec.name, int(r["prompt_index"]), int(r["image_index"]))] = r

    todo = {spec.name: [(item, [k for k in range(protocol.images_per_prompt) if (spec.name, item.index, k) not in done])
                        for item in used]
            for spec, used, _, _, protocol in plans}
    missing = sum(len(ks) for pending in todo.values() for _, ks in pending)

    echo(f"mmrl eval: {config_file}, checkpoint {checkpoint_text(ckpt, cfg)} -> {out}")
    for spec, used, _, _, protocol in plans:
        changed = ", ".join(f"{k} {v['default']} -> {v['used']}" for k, v in protocol.overridden.items())
        have = sum(1 for key in done if key[0] == spec.name and key[1] < protocol.num_prompts
                   and key[2] < protocol.images_per_prompt)
        echo(f"  {spec.name}: {protocol.num_prompts} of {protocol.total_prompts} prompts x "
             f"{protocol.images_per_prompt} image(s), seeds {protocol.seed}+k, {protocol.resolution} px, "
             f"{protocol.num_steps} steps, guidance {protocol.guidance_scale:g}"
             f"{'; overridden: ' + changed if changed else ''}"
             f"{f'; {have} image(s) already in samples.jsonl' if have else ''}")

    out.mkdir(parents=True, exist_ok=True)
    state = {"generator": generator, "benchmarks": {**state.get("benchmarks", {}),
                                                    **{p[0].name: p[4].to_dict() for p in plans}}}
    _write_json(state_file, state)

    if missing:
        _generate(plans, todo, done, ckpt, cfg, generator, out, samples, options, policy=policy)

    # ---- summary
    benchmarks: dict[str, Any] = {}
    printed: dict[str, tuple[str, ...]] = {}  # per benchmark: its scorer's also_printed
    for spec, used, items, scorer, protocol in plans:
        rows_b = [done[(spec.name, item.index, k)] for item in used for k in range(protocol.images_per_prompt)]
        reasons = Counter(r["reason"] for r in rows_b if r.get("reason"))
        unjudged = sum(1 for r in rows_b if any(r["scores"].get(k) is None for k in _main_keys(spec)))
        grid = _grid(out, spec, protocol)
        benchmarks[spec.name] = {
            "metrics": scorer.summarize(rows_b, items, out), "num_images": len(rows_b), "num_unjudged": unjudged,
            "unjudged_reasons": dict(sorted(reasons.items())), "images": f"images/{spec.folder}",
            "grid": str(grid.relative_to(out)), "headline": scorer.headline, "sample_score": scorer.sample_score,
            "protocol": protocol.to_dict()}
        printed[spec.name] = scorer.also_printed
    summary = summary_record(cfg, config_file, ckpt, generator, benchmarks, options, overrides, _packages())
    _write_json(out / "summary.json", summary)
    for name, result in benchmarks.items():
        line = _headline(result["metrics"], result["headline"], printed[name])
        echo(f"  {name}: {line} ({result['num_images']} images"
             f"{', ' + str(result['num_unjudged']) + ' not judged' if result['num_unjudged'] else ''})")
    report = write_eval_report(out, echo)
    echo(f"wrote {out / 'summary.json'}, samples.jsonl, images/, grids/{', ' + report.name if report else ''} "
         f"({missing} image(s) generated, {time.time() - started:.1f} s)")
    return summary


def write_eval_report(out: Path, echo: Callable[[str], None]) -> Path | None:
    """``out/report.html`` of one evaluation (:func:`mmrl.eval.report.write_report`); a report that fails is a
    warning, never the loss of a finished evaluation."""
    from mmrl.eval.report import write_report

    try:
        return write_report([out], out / "report.html")
    except Exception as exc:  # the numbers are written; the page is a view of them
        echo(f"  warning: report.html not written: {type(exc).__name__}: {exc} (summary.json and samples.jsonl are "
             f"complete; `mmrl eval --compare {out}` retries it)")
        return None


def _headline(metrics: Mapping[str, Any], key: str = "", also: Sequence[str] = ()) -> str:
    """The line ``mmrl eval`` prints per benchmark: its headline metric (``key``, dotted for nested) and the metrics
    ``also`` (a null one with its ``<name>_reason``), or, for reward benchmarks, each reward's mean."""
    def fmt(v):
        return "nan" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"

    if key:
        shown = []
        for name in [key, *also]:
            value: Any = metrics
            for part in name.split("."):
                value = value.get(part) if isinstance(value, Mapping) else None
            if isinstance(value, Mapping):
                break
            reason = metrics.get(f"{name}_reason") if value is None else None  # why there is no number
            shown.append(f"{name} {fmt(value)}" + (f" ({reason})" if reason else ""))
        else:
            return ", ".join(shown)
    return ", ".join(f"{k} {fmt(v['mean'])}" for k, v in metrics.items() if isinstance(v, dict) and "mean" in v)


def _generate(plans, todo, done, ckpt: _Checkpoint, cfg, generator: dict, out: Path, samples: Path,
              options: EvalOptions, policy=None) -> None:
    """Generate, save, score and append a row for every missing image, prompt by prompt. A given ``policy`` (the
    trainer's) gets its resolution and guidance back afterwards."""
    for spec, used, _, scorer, _ in plans:  # scorers first: a missing reward model fails before the policy loads
        if any(ks for _, ks in todo[spec.name]):
            scorer.build()
    if policy is not None:
        restore = (policy.resolution, policy.guidance_scale)
        try:
            return _generate_with(plans, todo, done, policy, generator, out, samples, options, cfg)
        finally:
            policy.resolution = restore[0]
            policy.set_guidance(restore[1], cfg.sampling.negative_prompt)
    policy = build_policy_with(cfg, ckpt)
    _generate_with(plans, todo, done, policy, generator, out, samples, options, cfg)


def _generate_with(plans, todo, done, policy, generator: dict, out: Path, samples: Path, options: EvalOptions,
                   cfg) -> None:
    from tqdm.auto import tqdm

    progress = options.progress if options.progress is not None else sys.stderr.isatty()

    with open(samples, "a", encoding="utf-8") as handle:
        for spec, used, _, scorer, protocol in plans:
            pending = [(item, ks) for item, ks in todo[spec.name] if ks]
            if not pending:
                continue
            _configure_policy(policy, protocol, cfg.sampling.negative_prompt)
            folder = out / "images" / spec.folder
            folder.mkdir(parents=True, exist_ok=True)
            for stale in folder.glob(".*.tmp-*"):  # a PNG a killed evaluation was writing
                stale.unlink(missing_ok=True)
            total = protocol.num_prompts * protocol.images_per_prompt
            left = sum(len(ks) for _, ks in pending)
            bar = tqdm(total=total, initial=total - left, desc=spec.name, unit="img", disable=not progress,
                       dynamic_ncols=True)
            try:
                for item, ks in pending:
                    seeds = [protocol.seed + k for k in ks]
                    images = []
                    for k, seed in zip(ks, seeds):  # one image per call: each reproducible on its own
                        image = _to_pil(policy.sample_eval([item.prompt], [seed], num_steps=protocol.num_steps)[0])
                        _save_png(image, folder / f"{item.index:05d}_{k}.png")
                        images.append(image)
                    results = scorer.score(images, item)
                    for k, seed, result in zip(ks, seeds, results):
                        row = {"benchmark": spec.name, "prompt_index": item.index, "image_index": k,
                               "prompt": item.prompt, "seed": seed,
                               "image": f"images/{spec.folder}/{item.index:05d}_{k}.png", **result,
                               "protocol": protocol.hash()[:16], "generator": generator["hash"][:16]}
                        line = json.dumps(_jsonable(row), ensure_ascii=False, allow_nan=False)
                        handle.write(line + "\n")
                        handle.flush()
                        done[(spec.name, item.index, k)] = json.loads(line)
                    bar.update(len(ks))
            finally:
                bar.close()


# --------------------------------------------------------------------------------------------------- during training

#: Eval keys the trainer sets itself (``eval.options`` must not).
TRAINING_SET_KEYS = ("checkpoint", "output_dir", "benchmarks", "limit", "ema", "progress")


def training_eval_options(config) -> EvalOptions:
    """The :class:`EvalOptions` of a config's ``eval`` section (``eval.benchmarks``, ``eval.limit``, ``eval.options``),
    checked as ``mmrl eval`` checks its keys. Raises :class:`EvalError`."""
    options, overrides = parse_eval_args(training_eval_args(config))
    if overrides:
        raise EvalError(f"eval.options: {overrides[0].split('=', 1)[0]!r} is a config key, not an eval key")
    return options


def plan_training_eval(config) -> tuple[Any, list]:
    """``(options, plans)`` of a config's ``eval`` section: everything that can be checked before a model loads
    (benchmarks, their files and keys; for VLMs every data line and its media), so a mistake stops ``mmrl train`` at
    startup, and the trainer reads the benchmarks once, not at every evaluation. Raises :class:`EvalError`."""
    if config.model.family == "qwen_vl":
        from mmrl.eval.vlm import plan_vlm_eval, training_eval_options as vlm_options

        options = vlm_options(config)
        return options, plan_vlm_eval(config, options)
    options = training_eval_options(config)
    return options, plan_benchmarks(config, options)


def training_eval_args(config) -> list[str]:
    """``eval.benchmarks``, ``eval.limit`` and ``eval.options`` as ``mmrl eval`` arguments (the keys the trainer sets
    refused)."""
    from mmrl.config import yaml_literal

    e = config.eval
    fixed = [k for k in e.options if k in TRAINING_SET_KEYS]
    if fixed:
        raise EvalError(f"eval.options.{fixed[0]}: set by the trainer (benchmarks: eval.benchmarks, limit: eval.limit, "
                        f"output_dir: output_dir/eval/update_<k>, the weights: the live ones, EMA when optim.ema, "
                        f"no progress bar)")
    args = [f"benchmarks={yaml_literal(list(e.benchmarks))}", f"limit={e.limit}", "progress=false"]
    return args + [f"{k}={yaml_literal(v)}" for k, v in e.options.items()]


def evaluate_policy(policy, config, update: int, output_dir: str | Path, *, ema: bool = False, planned=None,
                    echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the config's ``eval.benchmarks`` on the live ``policy`` (the trainer's, its current or EMA weights) into
    ``output_dir`` (``RUN/eval/update_<k>``), exactly as ``mmrl eval`` does on a checkpoint: same protocols,
    scorers, files and resume. ``planned``: :func:`plan_training_eval`'s result (read once by the trainer). Returns
    the summary. The policy's settings (resolution, guidance; a VLM's media and token budget) are restored after,
    and the global RNG states are left as they were.

    An ``output_dir`` left by another run of the same update with other weights (a run resumed from an earlier
    checkpoint) is moved aside to ``<output_dir>.stale-<n>`` with a warning, never an error that stops training."""
    import random

    import numpy as np
    import torch

    started = time.time()
    options, plans = planned if planned is not None else plan_training_eval(config)
    weights = {k: p.detach() for k, p in policy.named_trainable_parameters().items()}
    ckpt = _Checkpoint(None, Path(config.output_dir), ema, None, weights_sha256(weights), live=f"update {update}")
    out = Path(output_dir)
    if config.model.family == "qwen_vl":
        from mmrl.eval.vlm import _run as run, _vlm_generator as generator_of
    else:
        run, generator_of = _run, _generator
    try:
        open_output_dir(out, generator_of(config, ckpt))
    except EvalError:
        from mmrl.checkpoint import move_aside

        stale = move_aside(out)
        echo(f"mmrl: warning: {out} held an evaluation of other weights at update {update} (a run resumed from an "
             f"earlier checkpoint); moved to {stale.name}")
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            return run(config, options, [], plans, ckpt, out, None, echo=echo, started=started, policy=policy)
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def training_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """``eval/<benchmark>/<metric>`` -> value for every number of a summary's metrics (nested keys joined with
    ``/``; counts ``n`` / ``num_*`` / ``counts``, GenEval's prompts per tag, left out), what the trainer logs with
    its own metrics."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, sub in value.items():
                if key in PER_ITEM_METRICS or key in ("n", "counts") or str(key).startswith("num_"):
                    continue
                walk(f"{prefix}/{key}", sub)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix] = float(value)
        elif value is None:
            out[prefix] = float("nan")

    for name, result in summary.get("benchmarks", {}).items():
        walk(f"eval/{name}", result.get("metrics", {}))
        if isinstance(result.get("blind"), Mapping):  # a VLM benchmark's blind control
            walk(f"eval/{name}/blind", result["blind"].get("metrics", {}))
    return out


#: Metric entries that hold one value per prompt or item (DPG-Bench's ``per_prompt``) or settings, not a number to
#: plot: left out of the logged metrics.
PER_ITEM_METRICS = ("per_prompt", "not_scored", "warnings", "settings")
