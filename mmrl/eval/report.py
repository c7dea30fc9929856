"""``report.html``: one evaluation, or several side by side (``mmrl eval --compare``).

    write_report([EVAL_DIR, ...], OUTPUT.html, labels=None)      the first folder is the reference column
    mmrl eval --compare DIR_A DIR_B ... [output_dir=DIR] [labels=[a,b,...]]

Each ``EVAL_DIR`` is an ``mmrl eval`` output folder (``summary.json``, ``samples.jsonl``, ``images/``: image
generators, :mod:`mmrl.eval.runner`; or answers, :mod:`mmrl.eval.vlm`, whose rows show the answer, the target and
the input image, with the blind control's answers and metrics). ``--compare`` also takes a run folder: its
``eval/step_N`` with the largest N, the evaluation of its latest checkpoint by ``mmrl eval RUN``; without any, its
``eval/update_N`` with the largest N, the trainer's latest in-training evaluation (``eval.every``: the live weights
at update N, summary checkpoint path ``"update N"``); see :func:`resolve_eval_dir`. The page is
one static HTML file with its figures in a folder beside it (``report.html`` -> ``report_files/``: JPEG thumbnails
of the evaluated images and matplotlib PNG charts), referenced by relative paths only, so the two can be moved or
copied together; nothing is loaded from the network and the page has no JavaScript. It holds:

* the runs: checkpoint, EMA, sha256 of the trainable weights, config file, overrides, eval keys, device;
* a summary table (each benchmark's headline metric) and per benchmark a table of every metric (nested metrics
  flattened into dotted names, ``{"mean", "n", "num_unjudged"}`` entries shown as the mean with their counts), one
  column per run and a difference column against the first run for every other one, green when better and red
  when worse (higher is better except for the names in :data:`LOWER_IS_BETTER`; counts, spreads and settings,
  :data:`NEUTRAL` and any name whose last part is ``n``, ``num_*``, ``*_subsets``, ``*_size*``, ``feature_dim`` or
  ``tiles_per_prompt``, are not coloured: :func:`metric_direction`); per-item mappings (``per_prompt``,
  ``not_scored``: DPG-Bench's one entry per prompt) are left out of the tables (``summary.json`` holds them), the
  ``per_category`` / ``l1`` / ``l2`` breakdowns are kept; the reasons of unjudged images and of unparseable answers
  (a VLM's ``unparseable_reasons``) follow the table;
* per-category bar charts (metrics under ``per_tag`` / ``per_category``);
* image grids of the same prompts and seeds across runs: the first prompts, and per category (GenEval tag,
  PartiPrompts category, ...) the worst and the best prompts, ranked by the last run's mean score over a prompt's
  images (the benchmark's ``sample_score``, else the first score key of its rows) in that score's direction
  (:func:`metric_direction`: for a lower-is-better score the worst are the highest), with the scores of every run;
  a VLM row without an answer (generation failed) shows ``(no answer)`` with the row's reason;
* the training curves from each run's ``metrics.jsonl`` (``reward/mean`` and every ``eval/*`` key; a note for a
  run without one, such as the untrained base), with a vertical mark per evaluation shown: dotted at an evaluated
  checkpoint's update (``RUN/eval/step_N``), dashed at an in-training evaluation's (``RUN/eval/update_N``);
* every benchmark's protocol, with a warning naming the differing fields when the runs' protocols differ
  (comparing numbers made under different protocols is misleading; paths whose content a recorded sha256 pins are
  not compared when those sha256 agree: :func:`protocol_differences`);
* a footer with the package versions of each evaluation.

All text from the files (prompts, answers, labels, paths) is HTML-escaped. matplotlib (``pip install
matplotlib``) draws the charts, with mathtext off (``text.parse_math``: a ``$`` in a label, a category or a metric
name is drawn as itself); without matplotlib the page says so and keeps everything else.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import html
import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence
from urllib.parse import quote

__all__ = ["ReportError", "LOWER_IS_BETTER", "NEUTRAL", "COMPARE_KEYS", "metric_direction", "flatten_metrics",
           "protocol_differences", "resolve_eval_dir", "EvalRun", "load_eval", "write_report", "run_compare"]


class ReportError(ValueError):
    """A folder that is not an evaluation, an unreadable ``summary.json``, a bad ``--compare`` key (one
    ``mmrl: error:`` line)."""


#: Metric-name parts for which lower is better. A metric is lower-better when one of its dotted or slashed parts
#: (``per_category.fid``, ``jpeg_compressibility/jpeg_size_kb``) is one of these, or starts with it and ``_``, or
#: ends with ``_`` and it (``fid_clip``, ``val_loss``).
LOWER_IS_BETTER = frozenset({
    "fid", "kid", "loss", "kl", "mse", "mae", "rmse", "wer", "cer", "edit_distance", "error", "error_rate",
    "jpeg_size_kb", "num_unjudged", "unjudged", "num_unparseable", "unparseable", "nan_rate"})
#: Metric-name parts (same matching) that are counts, spreads or settings, not better or worse: never coloured.
#: ``blind``: a VLM's answers without the visual input, a control whose direction depends on the question. Besides
#: these, a name whose last part is a count or a setting (:func:`_is_setting`: ``n``, ``num_*``, ``*_subsets``,
#: ``*_size*``, ``feature_dim``, ``tiles_per_prompt``) is neutral, unless that part is itself lower-is-better
#: (``num_unjudged``, ``num_unparseable``, ``jpeg_size_kb``).
NEUTRAL = frozenset({
    "n", "count", "counts", "num_images", "num_samples", "num_prompts", "total_prompts", "num_judged", "std",
    "stderr", "sem", "missing_tags", "blind",
    # FID / KID settings and counts (mmrl.eval.distribution), DPG-Bench's tiles, a VLM's clipped boxes
    "kid_subsets", "kid_subset_size", "kid_subset_size_used", "num_generated", "num_reference", "feature_dim",
    "num_gt_clipped", "tiles_per_prompt"})

#: The ``key=value`` arguments of ``mmrl eval --compare``.
COMPARE_KEYS = {
    "output_dir": "folder of report.html and report_files/ (default compare/<label>_vs_<label>... in the current "
                  "folder)",
    "labels": "column names, one per folder, e.g. labels=[base,grpo] (default: run/checkpoint, or base)",
}

_CATEGORY_GROUPS = ("per_tag", "per_category")
#: per-item mappings of a benchmark's metrics (DPG-Bench's ``per_prompt`` and ``not_scored``: one entry per prompt):
#: left out of the tables, which they would bloat; ``summary.json`` holds them
_PER_ITEM = ("per_prompt", "not_scored", "per_sample", "per_item")
#: protocol fields not compared: derived ones, and paths that differ between machines (the sha256 fields pin the files)
_PROTOCOL_IGNORED = ("hash", "prompts_file", "data_file", "media_root", "overridden",
                     "blind")  # whether a VLM evaluation also ran the blind control: not how its numbers are made
_MAX_CURVES = 30
_THUMB = 192  # longest side of a thumbnail (px); shown at 128 css px (88 px when a cell holds 3 or more)
_CELL_IMAGES = 5  # images of a prompt shown per run (DrawBench's 5, GenEval's 4)


# --------------------------------------------------------------------------------------------- metric names


def _matches(part: str, tokens: frozenset) -> bool:
    return any(part == t or part.startswith(t + "_") or part.endswith("_" + t) for t in tokens)


def _is_setting(part: str) -> bool:
    """A metric name's last part that is a count or a setting, not a score: ``n``, ``num_*``, ``*_subsets``,
    ``*_size*``, ``feature_dim``, ``tiles_per_prompt`` (``kid_subsets``, ``kid_subset_size_used``,
    ``num_reference``), unless it is (or ends with) a lower-is-better name (``num_unjudged``, ``jpeg_size_kb``)."""
    if any(part == t or part.endswith("_" + t) for t in LOWER_IS_BETTER):
        return False
    return (part == "n" or part.startswith("num_") or part.endswith("_subsets") or "_size" in part
            or part in ("feature_dim", "tiles_per_prompt"))


def metric_direction(name: str) -> int:
    """``+1`` when higher is better, ``-1`` when lower is better (:data:`LOWER_IS_BETTER`), ``0`` for counts,
    spreads and settings (:data:`NEUTRAL`, and a last part that :func:`_is_setting`), which are never coloured."""
    parts = [p for p in re.split(r"[./]", str(name).lower()) if p]
    if any(_matches(p, NEUTRAL) for p in parts) or (parts and _is_setting(parts[-1])):
        return 0
    if any(_matches(p, LOWER_IS_BETTER) for p in parts):
        return -1
    return 1


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return None if math.isnan(value) else value
    return None


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """Nested metrics -> ``{dotted name: {"value": number | None | str, "n": int | None, "unjudged": int | None}}``.
    A ``{"mean", "n", "num_unjudged"}`` dict is one entry (its other keys, e.g. ``std``, become ``name.std``);
    lists and strings are text; ``None`` and NaN are ``None`` (not available)."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in metrics.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            if "mean" in value and not isinstance(value["mean"], (Mapping, list)):
                out[name] = {"value": _number(value["mean"]), "n": _number(value.get("n")),
                             "unjudged": _number(value.get("num_unjudged"))}
                rest = {k: v for k, v in value.items() if k not in ("mean", "n", "num_unjudged")}
                out.update(flatten_metrics(rest, name))
            else:
                out.update(flatten_metrics(value, name))
        elif isinstance(value, (list, tuple)):
            out[name] = {"value": ", ".join(str(v) for v in value) or "(none)", "n": None, "unjudged": None}
        elif isinstance(value, str) or isinstance(value, bool):
            out[name] = {"value": str(value), "n": None, "unjudged": None}
        else:
            out[name] = {"value": _number(value), "n": None, "unjudged": None}
    return out


def _without_per_item(metrics: Mapping[str, Any], prefix: str = "") -> tuple[dict[str, Any], dict[str, int]]:
    """``metrics`` without its per-item mappings (:data:`_PER_ITEM`: ``per_prompt``, ``not_scored``, at any depth,
    when a mapping or a list), and ``{dotted name: number of entries}`` of those left out."""
    kept: dict[str, Any] = {}
    dropped: dict[str, int] = {}
    for key, value in metrics.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if str(key) in _PER_ITEM and isinstance(value, (Mapping, list, tuple)):
            if value:
                dropped[name] = len(value)
            continue
        if isinstance(value, Mapping):
            value, more = _without_per_item(value, name)
            dropped.update(more)
        kept[key] = value
    return kept, dropped


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """Plain dotted flattening of a protocol or config (lists and scalars as they are)."""
    if not isinstance(data, Mapping):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, name))
        else:
            out[name] = value
    return out


#: last parts of a field name that name a file or folder (``reference_images``, ``prompts_file``, ``media_root``)
_PATH_SUFFIXES = ("file", "files", "path", "dir", "folder", "root", "images")


def _pinned_paths(data: Any, prefix: str = "") -> dict[str, str]:
    """``{dotted path field: dotted hash field}`` of a protocol: the string fields whose content a content hash
    beside them pins: ``X`` with ``X_sha256`` (or ``X_hash``: ``inception`` / ``inception_sha256``), ``STEM_SUFFIX``
    with ``STEM_sha256`` for a path suffix (``reference_images`` / ``reference_sha256``, ``prompts_file`` /
    ``prompts_sha256``), and ``file`` / ``path`` with ``sha256`` (``{"file": ..., "sha256": ...}``)."""
    out: dict[str, str] = {}
    if not isinstance(data, Mapping):
        return out
    for key, value in data.items():
        key = str(key)
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping):
            out.update(_pinned_paths(value, name))
            continue
        if not isinstance(value, str):
            continue
        candidates = [f"{key}_sha256", f"{key}_hash"]
        stem, _, suffix = key.rpartition("_")
        if stem and suffix in _PATH_SUFFIXES:
            candidates.append(f"{stem}_sha256")
        if key in ("file", "path", "folder", "dir"):
            candidates.append("sha256")
        for candidate in candidates:
            if candidate != key and isinstance(data.get(candidate), str) and data.get(candidate):
                out[name] = f"{prefix}.{candidate}" if prefix else candidate
                break
    return out


def protocol_differences(protocols: Sequence[Mapping[str, Any] | None]) -> list[tuple[str, list[Any]]]:
    """The fields (dotted) whose values differ between the given protocols, each with the value of every protocol
    (``None`` where a protocol lacks the field). ``hash``, ``overridden`` (derived from the other fields) and the
    paths ``prompts_file``, ``data_file`` and ``media_root`` (the same files can live elsewhere on another machine:
    ``prompts_sha256`` / ``data_sha256`` pin them) and a VLM's ``blind`` (whether the blind control also ran) are not
    compared; nor is, at any depth, a path field whose content a sha256 recorded beside it pins
    (:func:`_pinned_paths`: FID's ``scorer_settings.reference_images`` / ``reference_sha256`` and
    ``scorer_settings.inception`` / ``inception_sha256``) when every protocol records that sha256 and they are
    equal (when they differ, both the sha256 and the paths are reported). Protocols that are ``None`` (a benchmark
    a run did not evaluate) are left out."""
    present = [p for p in protocols if p is not None]
    flats = [_flat(p) for p in present]
    pinned = [_pinned_paths(p) for p in present]
    keys: list[str] = []
    for flat in flats:
        keys += [k for k in flat if k not in keys and k.split(".")[0] not in _PROTOCOL_IGNORED]

    def same_content(key: str) -> bool:
        hashes = [pins.get(key) for pins in pinned]
        if any(h is None for h in hashes):
            return False
        values = [flat.get(h) for flat, h in zip(flats, hashes)]
        return all(v is not None and v == values[0] for v in values)

    out = []
    for key in keys:
        if same_content(key):
            continue
        values = [flat.get(key) for flat in flats]
        if any(json.dumps(v, sort_keys=True, default=str) != json.dumps(values[0], sort_keys=True, default=str)
               for v in values[1:]):
            out.append((key, values))
    return out


# --------------------------------------------------------------------------------------------- loading


@dataclass
class EvalRun:
    """One evaluation folder, read: its summary, its ``samples.jsonl`` rows and its run's ``metrics.jsonl``."""

    path: Path
    summary: dict
    rows: list[dict] = field(default_factory=list)
    bad_lines: int = 0
    label: str = ""
    metrics: list[dict] | None = None
    metrics_path: Path | None = None
    metrics_note: str = ""

    @property
    def checkpoint(self) -> dict:
        return self.summary.get("checkpoint") or {}

    @property
    def is_base(self) -> bool:
        """An evaluation of the untrained ``model.pretrained`` (``checkpoint: {"path": "base"}``)."""
        return str(self.checkpoint.get("path") or "base") == "base"

    @property
    def benchmarks(self) -> dict:
        return self.summary.get("benchmarks") or {}

    def default_label(self) -> str:
        ckpt = self.checkpoint
        if self.is_base:
            return "base"
        name = Path(str(ckpt["path"])).name
        update = _update_of(ckpt)
        if update is not None:  # the trainer's in-training evaluation, RUN/eval/update_<k>
            name = f"update_{update}"
        if self.path.name.startswith(name):  # step_60 or step_60-no_ema: the eval folder says which weights
            name = self.path.name
        run = Path(str(ckpt.get("run_dir") or self.path.parent.parent)).name
        return f"{run}/{name}" if run else name


def _update_of(ckpt: Mapping[str, Any]) -> int | None:
    """The update of an in-training evaluation's checkpoint record (path ``"update <k>"``), else None."""
    for value in (ckpt.get("update"), ckpt.get("path")):
        match = re.fullmatch(r"update[ _](\d+)", str(value or "").strip())
        if match:
            return int(match.group(1))
    return None


def _evaluated_update(run: "EvalRun") -> tuple[int, str] | None:
    """``(update, "checkpoint" | "update")`` of an evaluation: a checkpoint ``.../step_N`` (``mmrl eval``), or the
    live weights at update N (the trainer's ``RUN/eval/update_N``); None for the base or another name."""
    ckpt = run.checkpoint
    update = _update_of(ckpt)
    if update is not None:
        return update, "update"
    step = re.fullmatch(r"step_(\d+)", Path(str(ckpt.get("path", ""))).name)
    if step:
        return int(step.group(1)), "checkpoint"
    return None


def resolve_eval_dir(path: str | Path) -> Path:
    """An evaluation folder from ``path``: a folder holding ``summary.json`` (or that file itself), or a run folder:
    its ``eval/step_N`` with the largest N (the default output of ``mmrl eval RUN``: the run's latest checkpoint;
    ``step_N-no_ema`` and other names are not picked automatically); without any ``eval/step_N``, its
    ``eval/update_N`` with the largest N (the trainer's latest in-training evaluation, ``eval.every``); else its only
    ``eval/*/summary.json``. Other cases are a :class:`ReportError` that lists what is there."""
    p = Path(path)
    if p.is_file() and p.name == "summary.json":
        return p.parent
    if not p.exists():
        raise ReportError(f"{path}: no such folder (give an evaluation folder holding summary.json, or a run folder "
                          f"with eval/*/summary.json)")
    if not p.is_dir():
        raise ReportError(f"{path}: not a folder (give an evaluation folder holding summary.json, or a run folder)")
    if (p / "summary.json").is_file():
        return p
    found = sorted(s.parent for s in (p / "eval").glob("*/summary.json"))
    if not found:
        if (p / "samples.jsonl").is_file():
            raise ReportError(f"{path} holds samples.jsonl but no summary.json: an evaluation that did not finish "
                              f"(run the same mmrl eval again to complete it)")
        raise ReportError(f"{path}: no summary.json, and no eval/*/summary.json in it: neither an evaluation folder "
                          f"nor an evaluated run folder (evaluate it first: mmrl eval {path} ...)")
    for pattern in (r"step_(\d+)", r"update_(\d+)"):  # a checkpoint's evaluation first, else the trainer's latest
        numbered = [(int(m.group(1)), d) for d in found if (m := re.fullmatch(pattern, d.name))]
        if numbered:
            return max(numbered)[1]
    if len(found) == 1:
        return found[0]
    raise ReportError(f"{path}: several evaluations and none named eval/step_N or eval/update_N: "
                      f"{', '.join(str(d) for d in found)}: give one of them")


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """The JSON objects of a JSONL file (``samples.jsonl``, ``metrics.jsonl``) and how many lines were not one (a
    torn last line of a killed run, a stray value); ``([], 0)`` for a file that cannot be read."""
    rows, bad = [], 0
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


def load_eval(path: str | Path) -> EvalRun:
    """Read an evaluation folder (``summary.json`` is required; ``samples.jsonl`` and the run's ``metrics.jsonl``
    are optional)."""
    path = Path(path)
    file = path / "summary.json"
    if not file.is_file():
        raise ReportError(f"{path}: no summary.json (not an mmrl eval folder, or an evaluation that did not finish)")
    try:
        summary = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{file}: not readable JSON ({exc})") from None
    if not isinstance(summary, dict) or "mmrl_eval" not in summary or not isinstance(summary.get("benchmarks"), dict):
        raise ReportError(f"{file}: not an mmrl eval summary (no mmrl_eval / benchmarks fields)")
    run = EvalRun(path=path, summary=summary)
    run.rows, run.bad_lines = read_jsonl(path / "samples.jsonl")
    ckpt = run.checkpoint
    if run.is_base:
        run.metrics_note = "the untrained base model: no training run, no curves"
        return run
    candidates = []
    if ckpt.get("run_dir"):
        candidates.append(Path(str(ckpt["run_dir"])) / "metrics.jsonl")
    if path.parent.name == "eval":  # RUN/eval/<checkpoint>: the run moved together with its evaluation
        candidates.append(path.parent.parent / "metrics.jsonl")
    for candidate in candidates:
        if candidate.is_file():
            rows, _ = read_jsonl(candidate)
            run.metrics, run.metrics_path = rows, candidate
            if not rows:
                run.metrics_note = f"{candidate} holds no metrics"
            return run
    where = " or ".join(str(c) for c in candidates) or "(no run folder recorded)"
    run.metrics_note = f"no metrics.jsonl at {where}"
    return run


# --------------------------------------------------------------------------------------------- formatting


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def _diff_cell(name: str, value: Any, reference: Any) -> str:
    a, b = _number(value), _number(reference)
    if a is None or b is None:
        if isinstance(value, str) and isinstance(reference, str) and value != reference:
            return '<td class="diff">&ne;</td>'
        return '<td class="diff"></td>'
    d = a - b
    direction = metric_direction(name)
    cls = "same" if d == 0 or direction == 0 else ("better" if d * direction > 0 else "worse")
    if d == 0:
        text = "&plusmn;0"
    elif isinstance(a, int) and isinstance(b, int):
        text = f"{d:+d}"
    else:
        text = f"{d:+.3g}"
        if b != 0 and direction != 0:
            text += f' <span class="rel">({d / abs(b):+.1%})</span>'
    return f'<td class="diff {cls}">{text}</td>'


def _value_cell(entry: Mapping[str, Any] | None, headline: bool = False) -> str:
    if entry is None:
        return '<td class="num missing">&mdash;</td>'
    value = entry["value"]
    cls = "num" if not isinstance(value, str) else "text"
    extra = []
    if entry.get("n") is not None:
        extra.append(f"n={_fmt(entry['n'])}")
    if entry.get("unjudged"):
        extra.append(f"{_fmt(entry['unjudged'])} unjudged")
    small = f'<span class="n">{_e(", ".join(extra))}</span>' if extra else ""
    strong = ("<strong>", "</strong>") if headline else ("", "")
    return f'<td class="{cls}">{strong[0]}{_e(_fmt(value))}{strong[1]}{small}</td>'


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "run"


def _unique(labels: Sequence[str]) -> list[str]:
    out: list[str] = []
    for label in labels:
        candidate, k = label, 2
        while candidate in out:
            candidate, k = f"{label} #{k}", k + 1
        out.append(candidate)
    return out


# --------------------------------------------------------------------------------------------- figures


class _Files:
    """The report's figures folder: thumbnails (one per source image, cached) and charts."""

    def __init__(self, folder: Path, url_prefix: str):
        self.folder = folder
        self.prefix = url_prefix
        self.thumbs: dict[str, str | None] = {}
        self.small: set[str] = set()  # thumbnails under 128 px: drawn with sharp pixels
        self.count = 0

    def url(self, name: str) -> str:
        return f"{self.prefix}/{quote(name)}"

    def thumb(self, source: Path) -> str | None:
        key = str(source)
        if key in self.thumbs:
            return self.thumbs[key]
        url = None
        if source.is_file():
            try:
                from PIL import Image

                with Image.open(source) as image:
                    image = image.convert("RGB")
                    if max(image.size) > _THUMB:
                        image.thumbnail((_THUMB, _THUMB), Image.Resampling.LANCZOS)
                    self.count += 1
                    # a small image is kept exactly (PNG): JPEG's 4:2:0 blocks moved a 32 px image's pixels by up
                    # to 69 / 255, a faint washed-out shape's by a quarter of its contrast
                    lossless = max(image.size) <= 128
                    name = f"img{self.count:05d}.{'png' if lossless else 'jpg'}"
                    self.folder.mkdir(parents=True, exist_ok=True)
                    if lossless:
                        image.save(self.folder / name, format="PNG")
                    else:
                        image.save(self.folder / name, format="JPEG", quality=90, subsampling=0)
                    url = self.url(name)
                    if max(image.size) < 128:
                        self.small.add(url)
            except Exception:  # an unreadable image: the cell says so
                url = None
        self.thumbs[key] = url
        return url


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure, FigureCanvasAgg


def _plain_text():
    """matplotlib with mathtext off (``text.parse_math``) for every text made inside (titles, tick labels, legends,
    annotations): user strings holding ``$`` (``$x$``, ``cost $5``) are drawn as they are, never parsed as TeX
    (which fails on some, ``$x^$``). Wrap the whole drawing, ``savefig`` included (ticks are made when drawn)."""
    import matplotlib

    if "text.parse_math" not in matplotlib.rcParams:  # matplotlib < 3.5: nothing to switch off here
        return contextlib.nullcontext()
    return matplotlib.rc_context({"text.parse_math": False})


_COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974",
            "#64b5cd"]


def _bar_chart(path: Path, title: str, categories: list[str], labels: list[str],
               values: list[list[float | None]]) -> bool:
    """Horizontal grouped bars: a group per category, a bar per run (Agg canvas, no pyplot state)."""
    mpl = _matplotlib()
    if mpl is None:
        return False
    with _plain_text():
        return _draw_bars(mpl, path, title, categories, labels, values)


def _draw_bars(mpl, path: Path, title: str, categories: list[str], labels: list[str],
               values: list[list[float | None]]) -> bool:
    Figure, Canvas = mpl
    runs = len(labels)
    height = max(2.0, 0.3 * len(categories) * max(runs, 1) + 1.2)
    fig = Figure(figsize=(7.5, height), dpi=100)
    Canvas(fig)
    ax = fig.add_subplot()
    bar = 0.8 / max(runs, 1)
    for i, (label, row) in enumerate(zip(labels, values)):
        ys = [c - 0.4 + bar / 2 + i * bar for c in range(len(categories))]  # the first run on top (y inverted)
        xs = [v if v is not None else 0.0 for v in row]
        ax.barh(ys, xs, height=bar * 0.95, color=_COLOURS[i % len(_COLOURS)], label=label)
        for y, v in zip(ys, row):
            ax.text(v if v is not None else 0.0, y, f" {_fmt(v)}", va="center", fontsize=7)
    finite = [v for row in values for v in row if v is not None]
    if finite and min(finite) >= 0:
        ax.set_xlim(0, max(max(finite) * 1.15, 1e-9) if max(finite) > 0 else 1)
    ax.set_yticks(range(len(categories)))
    ax.set_yticklabels(categories, fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return True


def _curves_chart(path: Path, keys: list[str], series: list[tuple[str, list[dict], list[tuple[int, str]]]]) -> bool:
    """One panel per metric key, a line per run; verticals at the evaluations' updates: dotted at an evaluated
    checkpoint (``"checkpoint"``: ``RUN/eval/step_N``), dashed at an in-training evaluation (``"update"``:
    ``RUN/eval/update_N``)."""
    mpl = _matplotlib()
    if mpl is None:
        return False
    with _plain_text():
        return _draw_curves(mpl, path, keys, series)


def _draw_curves(mpl, path: Path, keys: list[str], series: list[tuple[str, list[dict], list[tuple[int, str]]]]) -> bool:
    Figure, Canvas = mpl
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig = Figure(figsize=(4.2 * cols, 2.8 * rows), dpi=100)
    Canvas(fig)
    for k, key in enumerate(keys):
        ax = fig.add_subplot(rows, cols, k + 1)
        for i, (label, metrics, marks) in enumerate(series):
            colour = _COLOURS[i % len(_COLOURS)]
            points = []
            for j, row in enumerate(metrics):
                value = _number(row.get(key))
                x = _number(row.get("step", row.get("update", j + 1)))
                if value is not None and x is not None:
                    points.append((x, value))
            if points:
                style = "-o" if len(points) < 30 else "-"
                ax.plot([p[0] for p in points], [p[1] for p in points], style, color=colour, label=label,
                        markersize=3, linewidth=1.2)
            for mark, kind in marks:
                ax.axvline(mark, color=colour, linestyle="--" if kind == "update" else ":", linewidth=1)
        ax.set_title(key, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if k == 0:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return True


# --------------------------------------------------------------------------------------------- samples


@dataclass
class _Prompt:
    index: int
    prompt: str
    rows: list[dict]
    score: float | None
    category: str | None


def _score_key(info: Mapping[str, Any], rows: Iterable[dict]) -> str | None:
    if info.get("sample_score"):
        return str(info["sample_score"])
    for row in rows:
        scores = row.get("scores")
        if isinstance(scores, dict) and scores:
            return next(iter(scores))
    return None


def _row_category(row: Mapping[str, Any]) -> str | None:
    for key in ("category", "task"):  # task: a VLM sample's
        if row.get(key) and row.get(key) != "default":
            return str(row[key])
    verdict = row.get("verdict")
    if isinstance(verdict, dict):
        for key in ("category", "tag"):
            if isinstance(verdict.get(key), str):
                return verdict[key]
    return None


def _set_categories(name: str, protocol: Mapping[str, Any]) -> dict[int, str]:
    """Prompt categories the rows do not carry: PartiPrompts' (shipped file), a user's .jsonl ``category``."""
    try:
        if name.endswith("@partiprompts"):
            from mmrl.eval.benchmarks import load_partiprompts

            return {p.index: p.category for p in load_partiprompts()}
        file = protocol.get("prompts_file")
        if file and str(file).endswith(".jsonl") and Path(file).is_file():
            from mmrl.data.prompts import read_prompts

            return {i: str(p.metadata["category"]) for i, p in enumerate(read_prompts(file))
                    if p.metadata.get("category") is not None}
    except Exception:
        pass
    return {}


def _prompts(run: EvalRun, name: str, key: str | None) -> dict[int, _Prompt]:
    info = run.benchmarks.get(name) or {}
    protocol = info.get("protocol") or {}
    limit = _number(protocol.get("num_prompts", protocol.get("num_samples")))
    per = _number(protocol.get("images_per_prompt"))
    grouped: dict[int, list[dict]] = {}
    for row in run.rows:
        if row.get("benchmark") != name or _number(row.get("prompt_index")) is None:
            continue
        index = int(row["prompt_index"])
        k = _number(row.get("image_index")) or 0
        if (limit is not None and index >= limit) or (per is not None and k >= per and not row.get("blind")):
            continue  # rows of a larger earlier limit in the same folder
        grouped.setdefault(index, []).append(row)
    extra = None
    out = {}
    for index, rows in sorted(grouped.items()):
        rows.sort(key=lambda r: (bool(r.get("blind")), _number(r.get("image_index")) or 0))
        values = [_number((r.get("scores") or {}).get(key)) for r in rows if not r.get("blind")] if key else []
        values = [v for v in values if v is not None]
        category = next((c for c in map(_row_category, rows) if c), None)
        if category is None:
            if extra is None:
                extra = _set_categories(name, protocol)
            category = extra.get(index)
        out[index] = _Prompt(index, str(rows[0].get("prompt", rows[0].get("question", ""))), rows,
                             sum(values) / len(values) if values else None, category)
    return out


def _image_path(run: EvalRun, value: Any, protocol: Mapping[str, Any] | None = None) -> Path | None:
    """A row's image: relative to the eval folder (generated images), or for a VLM sample's input (``protocol``
    given) to the data file's folder or the media root, as :mod:`mmrl.eval.vlm` writes them."""
    if isinstance(value, list):
        value = value[0] if value else None
    if not isinstance(value, str) or not value:
        return None
    p = Path(value)
    if p.is_absolute():
        return p
    bases = []
    if protocol:
        if protocol.get("data_file"):
            bases.append(Path(str(protocol["data_file"])).parent)
        if protocol.get("media_root"):
            bases.append(Path(str(protocol["media_root"])))
    bases.append(run.path)
    for base in bases:
        if (base / p).is_file():
            return base / p
    return bases[0] / p


# --------------------------------------------------------------------------------------------- the page


_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d2430; margin: 0;
       background: #f6f7f9; }
main { max-width: 1500px; margin: 0 auto; padding: 16px 28px 40px; }
h1 { font-size: 24px; margin: 8px 0 4px; } h2 { font-size: 19px; margin: 28px 0 8px; border-bottom: 2px solid #d5dae1;
padding-bottom: 4px; } h3 { font-size: 15px; margin: 18px 0 6px; } h4 { font-size: 14px; margin: 12px 0 4px; }
section.bench { background: #fff; border: 1px solid #dde1e7; border-radius: 8px; padding: 4px 18px 14px;
                margin: 18px 0; }
table { border-collapse: collapse; margin: 6px 0 10px; background: #fff; }
th, td { border: 1px solid #d9dde3; padding: 3px 8px; vertical-align: top; text-align: left; }
th { background: #eef1f5; font-weight: 600; }
td.num, td.diff { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.text { max-width: 420px; }
table.runs td { max-width: 340px; overflow-wrap: anywhere; }
td.missing { color: #999; text-align: center; }
td.better, span.better { background: #dcf5e1; color: #0b6b26; }
td.worse, span.worse { background: #fbe0e0; color: #9b1515; }
td.same { color: #888; }
span.n { display: block; font-size: 11px; color: #6b7280; }
span.rel { font-size: 11px; }
tr.headline td, tr.headline th { background: #fffbe6; }
.meta { color: #555; } .note { color: #6b7280; font-style: italic; }
.warning { background: #fff4e5; border: 1px solid #f0b35a; border-left: 5px solid #e8890c; padding: 6px 12px;
           margin: 8px 0; border-radius: 4px; }
.warning ul { margin: 4px 0; }
code, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12px; }
img.chart { max-width: 100%; border: 1px solid #e3e6ea; background: #fff; margin: 4px 0; }
table.grid td { min-width: 140px; }
table.grid td.prompt { max-width: 300px; min-width: 200px; font-size: 13px; }
.ptitle { font-size: 11px; color: #6b7280; }
.imgs { display: flex; flex-wrap: wrap; gap: 4px; }
figure { margin: 0; text-align: center; }
figure img { width: 128px; height: 128px; object-fit: contain; background: #eee; display: block; }
figure img.px { image-rendering: pixelated; }
.imgs.many { flex-wrap: nowrap; } .imgs.many figure img, .imgs.many .noimg { width: 88px; height: 88px; }
.scroll { overflow-x: auto; max-width: 100%; }
figcaption { font-size: 11px; color: #555; }
.noimg { width: 128px; height: 128px; display: flex; align-items: center; justify-content: center; background: #eee;
         color: #888; font-size: 11px; }
.score { font-size: 12px; margin-top: 3px; }
.answer { white-space: pre-wrap; font-size: 12px; max-width: 320px; }
.answer.none { color: #9b1515; font-style: italic; }
details > summary { cursor: pointer; color: #2a5ca8; }
footer { margin-top: 30px; font-size: 12px; color: #555; }
"""


class _Page:
    def __init__(self, runs: list[EvalRun], files: _Files, first_prompts: int, per_category: int):
        self.runs = runs
        self.files = files
        self.first_prompts = first_prompts
        self.per_category = per_category
        self.labels = [r.label for r in runs]
        self.ref = runs[0]
        self.warnings: list[str] = []
        self.chart_note = ""
        names: list[str] = []
        for run in runs:
            names += [n for n in run.benchmarks if n not in names]
        self.names = names

    # ---- pieces

    def header_cols(self, diffs: bool = True) -> str:
        cells = []
        for i, label in enumerate(self.labels):
            cells.append(f"<th>{_e(label)}</th>")
            if diffs and i:
                cells.append(f'<th class="diff">&Delta; vs {_e(self.labels[0])}</th>')
        return "".join(cells)

    def runs_table(self) -> str:
        rows = []
        for run in self.runs:
            ckpt = run.checkpoint
            gen = run.summary.get("generator") or {}
            sha = ckpt.get("weights_sha256") or gen.get("weights_sha256")
            if not run.is_base:
                where = f'<span class="mono">{_e(ckpt["path"])}</span>'
            else:
                where = f"base: the untrained <span class=\"mono\">{_e(gen.get('pretrained', 'model'))}</span>"
            keys = run.summary.get("eval_keys") or {}
            overrides = run.summary.get("config_overrides") or []
            rows.append(
                f"<tr><th>{_e(run.label)}</th><td>{where}</td><td>{_e(_fmt(ckpt.get('ema')))}</td>"
                f'<td class="mono" title="{_e(sha or "")}">{_e((sha or "n/a")[:16])}</td>'
                f'<td class="mono">{_e(run.summary.get("config_file") or "n/a")}</td>'
                f'<td class="mono">{_e(" ".join(overrides) or "none")}</td>'
                f'<td class="mono">{_e(", ".join(f"{k}={json.dumps(v)}" for k, v in keys.items()) or "defaults")}</td>'
                f"<td>{_e(run.summary.get('device', 'n/a'))}</td>"
                f'<td class="mono">{_e(run.path)}</td></tr>')
        return ('<table class="runs"><tr><th>run</th><th>checkpoint</th><th>EMA</th><th>weights sha256</th>'
                "<th>config file</th><th>config overrides</th><th>eval keys</th><th>device</th>"
                "<th>evaluation folder</th></tr>"
                + "".join(rows) + "</table>")

    def headline(self, name: str, flats: list[dict | None]) -> str | None:
        for run in self.runs:
            key = (run.benchmarks.get(name) or {}).get("headline")
            if key:
                key = str(key)
                for candidate in (key, key.removesuffix(".mean")):
                    if any(f and candidate in f for f in flats):
                        return candidate
        for key in ("overall", "accuracy"):
            if any(f and key in f for f in flats):
                return key
        for f in flats:
            for key, entry in (f or {}).items():
                if _number(entry["value"]) is not None and metric_direction(key) != 0:
                    return key
        return None

    def flats(self, name: str) -> list[dict | None]:
        out = []
        for run in self.runs:
            info = run.benchmarks.get(name)
            if not isinstance(info, dict):
                out.append(None)
                continue
            flat = flatten_metrics(_without_per_item(info.get("metrics") or {})[0])
            if isinstance(info.get("blind"), dict):  # a VLM's blind control: the grey-canvas answers' metrics
                flat.update(flatten_metrics(_without_per_item(info["blind"].get("metrics") or {})[0], "blind"))
            control = info.get("blind_control")
            if isinstance(control, dict):  # paired real - blind differences per metric
                flat.update(flatten_metrics(_without_per_item(control.get("metrics") or {})[0], "blind_control"))
                flat.update(flatten_metrics(_without_per_item({k: v for k, v in control.items() if k != "metrics"})[0],
                                            "blind_control"))
            out.append(flat)
        return out

    def summary_table(self) -> str:
        rows = []
        for b, name in enumerate(self.names):
            flats = self.flats(name)
            key = self.headline(name, flats)
            cells = []
            ref = (flats[0] or {}).get(key) if key else None
            for i, flat in enumerate(flats):
                entry = flat.get(key) if (flat is not None and key) else None
                cells.append(_value_cell(entry))
                if i:
                    cells.append(_diff_cell(key or "", entry and entry["value"], ref and ref["value"]))
            rows.append(f'<tr><th><a href="#bench-{b}">{_e(name)}</a></th><td class="mono">{_e(key or "n/a")}</td>'
                        + "".join(cells) + "</tr>")
        return (f"<table><tr><th>benchmark</th><th>metric</th>{self.header_cols()}</tr>" + "".join(rows)
                + "</table>")

    def metrics_table(self, name: str, flats: list[dict | None], headline: str | None) -> str:
        keys: list[str] = []
        for flat in flats:
            keys += [k for k in (flat or {}) if k not in keys]
        if headline in keys:
            keys.remove(headline)
            keys.insert(0, headline)
        infos = [run.benchmarks.get(name) for run in self.runs]
        lines = []
        for label, field_ in (("images / samples", None), ("not judged", "num_unjudged")):
            cells = []
            ref = None
            for i, info in enumerate(infos):
                if not isinstance(info, dict):
                    cells.append('<td class="num missing">&mdash;</td>')
                    value = None
                else:
                    value = info.get(field_) if field_ else info.get("num_images", info.get("num_samples"))
                    cells.append(f'<td class="num">{_e(_fmt(_number(value)))}</td>')
                if i == 0:
                    ref = value
                else:
                    cells.append(_diff_cell("count" if field_ is None else "num_unjudged", value, ref))
            lines.append(f"<tr><th>{label}</th>{''.join(cells)}</tr>")
        for key in keys:
            cells = []
            ref = (flats[0] or {}).get(key)
            for i, flat in enumerate(flats):
                entry = (flat or {}).get(key)
                cells.append(_value_cell(entry, key == headline))
                if i:
                    cells.append(_diff_cell(key, entry and entry["value"], ref and ref["value"]))
            cls = ' class="headline"' if key == headline else ""
            lines.append(f'<tr{cls}><th class="mono">{_e(key)}</th>{"".join(cells)}</tr>')
        reasons, unparseable, left_out = [], [], []
        for run, info in zip(self.runs, infos):
            info = info if isinstance(info, dict) else {}
            for reason, count in (info.get("unjudged_reasons") or {}).items():
                reasons.append(f"<li>{_e(run.label)}: {_e(reason)} &times; {_e(count)}</li>")
            blind = info.get("blind") if isinstance(info.get("blind"), dict) else {}
            for tag, part in (("", info), (" (blind control)", blind)):
                for reason, count in (part.get("unparseable_reasons") or {}).items():
                    unparseable.append(f"<li>{_e(run.label)}{_e(tag)}: {_e(reason)} &times; {_e(count)}</li>")
            dropped = _without_per_item(info.get("metrics") or {})[1]
            if dropped:
                left_out.append(f"{_e(run.label)}: " + ", ".join(f"<code>{_e(k)}</code> ({n} entries)"
                                                                 for k, n in dropped.items()))
        why = f"<h4>Why images were not judged</h4><ul>{''.join(reasons)}</ul>" if reasons else ""
        if unparseable:
            why += f"<h4>Why answers were unparseable</h4><ul>{''.join(unparseable)}</ul>"
        note = (f'<p class="note">per-item entries left out of the table (in summary.json): '
                f'{"; ".join(left_out)}</p>' if left_out else "")
        return (f'<table class="metrics"><tr><th>metric</th>{self.header_cols()}</tr>{"".join(lines)}</table>'
                f"{note}{why}")

    def category_charts(self, b: int, name: str, flats: list[dict | None]) -> str:
        groups: dict[str, list[str]] = {}
        for flat in flats:
            for key, entry in (flat or {}).items():
                parts = key.split(".")
                if len(parts) < 2 or not any(p in _CATEGORY_GROUPS for p in parts[:-1]):
                    continue
                if isinstance(entry["value"], str):
                    continue
                group, category = ".".join(parts[:-1]), parts[-1]
                if category not in groups.setdefault(group, []):
                    groups[group].append(category)
        if not groups:
            return ""
        out = ["<h3>Per category</h3>"]
        for g, (group, categories) in enumerate(groups.items()):
            values = [[_number(((flat or {}).get(f"{group}.{c}") or {}).get("value")) for c in categories]
                      for flat in flats]
            file = f"bench{b}-categories{g}.png"
            if _bar_chart(self.files.folder / file, f"{name}: {group}", categories, self.labels, values):
                out.append(f'<img class="chart" src="{self.files.url(file)}" alt="{_e(name)}: {_e(group)} per '
                           f'category">')
            else:
                self.chart_note = "charts need matplotlib (pip install matplotlib); the tables hold the numbers"
                out.append(f'<p class="note">{_e(group)}: no chart ({_e(self.chart_note)})</p>')
        return "".join(out)

    def prompt_cell(self, prompt: _Prompt, run: EvalRun, key: str | None) -> str:
        seeds = [r.get("seed") for r in prompt.rows if r.get("seed") is not None and not r.get("blind")]
        title = f"#{prompt.index}"
        if prompt.category:
            title += f" &middot; {_e(prompt.category)}"
        if seeds:
            title += f" &middot; seed{'s' if len(seeds) > 1 else ''} {_e(', '.join(str(s) for s in seeds))}"
        extra = ""
        target = next((r.get("target") for r in prompt.rows if r.get("target") is not None), None)
        if target is not None:
            text = target if isinstance(target, str) else json.dumps(target)
            extra += f'<div class="ptitle">target: {_e(text)}</div>'
        if any("answer" in r for r in prompt.rows):  # a VLM sample: its input image, once
            protocol = (run.benchmarks.get(str(prompt.rows[0].get("benchmark"))) or {}).get("protocol") or {}
            source = _image_path(run, prompt.rows[0].get("image", prompt.rows[0].get("images")), protocol)
            url = self.files.thumb(source) if source else None
            if url:
                px = ' class="px"' if url in self.files.small else ""
                extra += f'<figure><img{px} src="{url}" alt="input image of sample {prompt.index}"></figure>'
        return (f'<td class="prompt"><div class="ptitle">{title}</div><div>{_e(prompt.prompt)}</div>{extra}</td>')

    def run_cell(self, run: EvalRun, prompt: _Prompt | None, ref: _Prompt | None, key: str | None,
                 first: bool) -> str:
        if prompt is None:
            return '<td class="missing">not evaluated</td>'
        parts = []
        if ref is not None and prompt.prompt != ref.prompt:
            parts.append(f'<div class="warning">another prompt here: {_e(prompt.prompt)}</div>')
        vlm = any("answer" in r for r in prompt.rows)
        if vlm:
            for r in prompt.rows:
                verdict = r.get("verdict") if isinstance(r.get("verdict"), dict) else {}
                notes = [f"unparseable: {verdict['unparseable']}"] if verdict.get("unparseable") else []
                if r.get("answer") is None:  # no answer generated (a prompt too long, media that cannot be read)
                    answer = "(no answer)" + (f": {r['reason']}" if r.get("reason") else "")
                    cls = "answer none"
                else:
                    answer = str(r["answer"])
                    if len(answer) > 400:
                        answer = answer[:400] + " ..."
                    cls = "answer"
                    notes += [str(r["reason"])] if r.get("reason") else []
                score = _number((r.get("scores") or {}).get(key)) if key else None
                tag = "blind: " if r.get("blind") else ""
                parts.append(f'<div class="{cls}">{_e(tag)}{_e(answer)}</div>'
                             f'<div class="score">{_e(key or "")} {_e(_fmt(score))}'
                             f'{"".join(" &middot; " + _e(n) for n in notes)}</div>')
        else:
            figures = []
            shown = [r for r in prompt.rows if not r.get("blind")][:_CELL_IMAGES]
            for r in shown:
                source = _image_path(run, r.get("image"))
                url = self.files.thumb(source) if source else None
                score = _number((r.get("scores") or {}).get(key)) if key else None
                caption = f"seed {_e(r.get('seed', '?'))}"
                if key:  # the metric's name, so the score does not read as an image index
                    caption += f" &middot; {_e(key)} {_e(_fmt(score))}"
                tip = _e(f"{r.get('image', '')}" + (f" - {r['reason']}" if r.get("reason") else ""))
                if url:
                    px = ' class="px"' if url in self.files.small else ""
                    figures.append(f'<figure><img{px} src="{url}" alt="{_e(prompt.prompt[:80])} (seed '
                                   f'{_e(r.get("seed", "?"))})" title="{tip}"><figcaption>{caption}</figcaption>'
                                   f"</figure>")
                else:
                    figures.append(f'<figure><div class="noimg" title="{tip}">image missing</div>'
                                   f"<figcaption>{caption}</figcaption></figure>")
            more = len([r for r in prompt.rows if not r.get("blind")]) - len(shown)
            if more > 0:
                figures.append(f'<div class="note">+{more} more</div>')
            parts.append(f'<div class="imgs{" many" if len(shown) > 2 else ""}">{"".join(figures)}</div>')
        if key:
            text = f"mean {_e(key)} {_e(_fmt(prompt.score))}"
            if not first and ref is not None and prompt.score is not None and ref.score is not None:
                d = prompt.score - ref.score
                direction = metric_direction(key)
                cls = "same" if d == 0 or direction == 0 else ("better" if d * direction > 0 else "worse")
                text += f' <span class="{cls}">{f"{d:+.3g}" if d else "&plusmn;0"}</span>'
            parts.append(f'<div class="score">{text}</div>')
        return f"<td>{''.join(parts)}</td>"

    def grid(self, indices: list[int], prompts: list[dict[int, _Prompt]], key: str | None) -> str:
        rows = []
        for index in indices:
            ref = prompts[0].get(index)
            shown = ref or next(p[index] for p in prompts if index in p)
            owner = self.runs[0] if ref else self.runs[next(i for i, p in enumerate(prompts) if index in p)]
            cells = [self.prompt_cell(shown, owner, key)]
            for i, (run, by_index) in enumerate(zip(self.runs, prompts)):
                cells.append(self.run_cell(run, by_index.get(index), ref, key, i == 0))
            rows.append(f"<tr>{''.join(cells)}</tr>")
        head = "".join(f"<th>{_e(label)}</th>" for label in self.labels)
        return f'<table class="grid"><tr><th>prompt</th>{head}</tr>{"".join(rows)}</table>'

    def samples(self, name: str) -> str:
        infos = [run.benchmarks.get(name) or {} for run in self.runs]
        all_rows = [r for run in self.runs for r in run.rows if r.get("benchmark") == name]
        if not all_rows:
            return '<p class="note">no samples.jsonl rows for this benchmark: no images to show</p>'
        key = next((_score_key(info, []) for info in infos if info.get("sample_score")), None) \
            or _score_key({}, all_rows)
        prompts = [_prompts(run, name, key) for run in self.runs]
        indices = sorted({i for p in prompts for i in p})
        seeded = any("seed" in r for r in all_rows)  # image generators; a VLM's greedy answers have no seed
        out = [f"<h3>The first prompts{', same seeds' if seeded else ''} in every run</h3>",
               self.grid(indices[:self.first_prompts], prompts, key)]
        if key:
            ranker = len(self.runs) - 1
            while ranker > 0 and not prompts[ranker]:
                ranker -= 1
            ranked = prompts[ranker]
            categories: dict[str, list[_Prompt]] = {}
            for p in ranked.values():
                if p.score is not None:
                    categories.setdefault(p.category or "all prompts", []).append(p)
            sign = -1 if metric_direction(key) < 0 else 1  # a lower-is-better score: the worst are the highest
            if categories:
                order = "lower is better" if sign < 0 else "higher is better"
                out.append(f"<h3>Worst and best prompts per category</h3><p class=\"meta\">ranked by the mean "
                           f"<code>{_e(key)}</code> of {_e(self.labels[ranker])} over a prompt's images "
                           f"({order})</p>")
            k = self.per_category
            for category in sorted(categories):
                items = sorted(categories[category], key=lambda p: (sign * p.score, p.index))
                if len({p.score for p in items}) == 1:  # no worst or best among equals
                    out.append(f"<h4>{_e(category)}: all {len(items)} tied at {_e(_fmt(items[0].score))}</h4>")
                    continue
                worst = items[:k]
                best = [p for p in reversed(items) if p not in worst][:k]
                out.append(f"<h4>{_e(category)}: worst {len(worst)} of {len(items)}</h4>"
                           + self.grid([p.index for p in worst], prompts, key))
                if best:
                    out.append(f"<h4>{_e(category)}: best {len(best)} of {len(items)}</h4>"
                               + self.grid([p.index for p in best], prompts, key))
        return "".join(out)

    def protocol(self, name: str) -> str:
        protocols = [(run.benchmarks.get(name) or {}).get("protocol") for run in self.runs]
        present = [(run.label, p) for run, p in zip(self.runs, protocols) if p is not None]
        out = []
        missing = [run.label for run, info in zip(self.runs, (r.benchmarks.get(name) for r in self.runs))
                   if info is None]
        if missing:
            text = f"{name}: not evaluated in {', '.join(missing)}"
            self.warnings.append(text)
            out.append(f'<div class="warning">{_e(text)}</div>')
        diffs = protocol_differences([p for _, p in present])
        if diffs:
            items = "".join(f"<li><code>{_e(k)}</code>: " + "; ".join(
                f"{_e(label)} <code>{_e(json.dumps(v, default=str))}</code>" for (label, _), v in zip(present, vs))
                + "</li>" for k, vs in diffs)
            text = (f"{name}: the protocols differ ({', '.join(k for k, _ in diffs)}); comparing numbers made under "
                    f"different protocols is misleading")
            self.warnings.append(text)
            out.append(f'<div class="warning"><strong>The runs\' protocols differ</strong>: comparing numbers made '
                       f'under different protocols is misleading.<ul>{items}</ul></div>')
        if not present:
            return "".join(out)
        flats = [_flat(p) for _, p in present]
        keys: list[str] = []
        for flat in flats:
            keys += [k for k in flat if k not in keys]
        differing = {k for k, _ in diffs}
        same = not diffs
        head = "<th>value (every run)</th>" if same else "".join(f"<th>{_e(label)}</th>" for label, _ in present)
        rows = []
        for key in keys:
            values = flats[:1] if same else flats
            cells = "".join(f'<td class="mono">{_e(_protocol_text(f.get(key)))}</td>' for f in values)
            cls = ' class="headline"' if key in differing else ""
            rows.append(f'<tr{cls}><th class="mono">{_e(key)}</th>{cells}</tr>')
        out.append(f"<details><summary>Protocol of {_e(name)}{' (identical in every run)' if same else ''}</summary>"
                   f"<table><tr><th>field</th>{head}</tr>{''.join(rows)}</table></details>")
        return "".join(out)

    def curves(self) -> str:
        out = ['<h2 id="curves">Training curves</h2>']
        by_run: dict[str, tuple[str, list[dict], list[tuple[int, str]]]] = {}
        notes = []
        for run in self.runs:
            if run.metrics is None or not run.metrics:
                notes.append(f"<li>{_e(run.label)}: {_e(run.metrics_note)}</li>")
                continue
            key = str(run.metrics_path)
            mark = _evaluated_update(run)  # (N, "checkpoint"): RUN/eval/step_N; (N, "update"): RUN/eval/update_N
            if key not in by_run:
                by_run[key] = (run.label, run.metrics, [])
            else:  # another checkpoint of the same run: one line, one mark per evaluated checkpoint
                by_run[key] = (f"{by_run[key][0]}, {run.label}", by_run[key][1], by_run[key][2])
            if mark is not None and mark not in by_run[key][2]:
                by_run[key][2].append(mark)
        series = list(by_run.values())
        keys: list[str] = []
        for _, metrics, _ in series:
            for row in metrics:
                keys += [k for k, v in row.items() if k not in keys and (k == "reward/mean" or k.startswith("eval/"))
                         and _number(v) is not None]
        keys = [k for k in keys if not _constant_zero(k, series)]  # eval/failed while nothing failed
        keys.sort(key=_curve_order)
        if notes:
            out.append(f'<ul class="note">{"".join(notes)}</ul>')
        if not series:
            out.append('<p class="note">no run has a metrics.jsonl: no curves</p>')
            return "".join(out)
        if not keys:
            out.append('<p class="note">the metrics.jsonl files hold no reward/mean or eval/* values</p>')
            return "".join(out)
        dropped = keys[_MAX_CURVES:]
        keys = keys[:_MAX_CURVES]
        if _curves_chart(self.files.folder / "curves.png", keys, series):
            out.append(f'<p class="meta">reward/mean and every eval/* key of each run\'s metrics.jsonl against the '
                       f'update; dotted lines: the evaluated checkpoints (eval/step_N), dashed lines: the in-training '
                       f'evaluations (eval/update_N)</p><img class="chart" '
                       f'src="{self.files.url("curves.png")}" alt="training curves">')
        else:
            self.chart_note = "charts need matplotlib (pip install matplotlib); the tables hold the numbers"
            out.append(f'<p class="note">no curves: {_e(self.chart_note)}</p>')
        if dropped:
            out.append(f'<p class="note">{len(dropped)} more eval/* keys not drawn: {_e(", ".join(dropped))}</p>')
        return "".join(out)

    def footer(self) -> str:
        packages = [run.summary.get("packages") or {} for run in self.runs]
        names: list[str] = []
        for p in packages:
            names += [n for n in p if n not in names]
        rows = []
        for n in names:
            values = [p.get(n) for p in packages]
            cls = ' class="headline"' if len(set(map(str, values))) > 1 else ""
            rows.append(f"<tr{cls}><th>{_e(n)}</th>" + "".join(f"<td>{_e(_fmt(v))}</td>" for v in values) + "</tr>")
        head = "".join(f"<th>{_e(label)}</th>" for label in self.labels)
        from mmrl import __version__

        return (f'<footer><h2>Package versions</h2><table><tr><th>package</th>{head}</tr>{"".join(rows)}</table>'
                f"<p>written by mmrl {_e(__version__)} (mmrl.eval.report) on "
                f"{_e(datetime.datetime.now().isoformat(timespec='seconds'))}</p></footer>")

    def render(self) -> str:
        body = []
        for b, name in enumerate(self.names):
            flats = self.flats(name)
            headline = self.headline(name, flats)
            section = [f'<section class="bench" id="bench-{b}"><h2>{_e(name)}</h2>', self.protocol(name),
                       self.metrics_table(name, flats, headline), self.category_charts(b, name, flats),
                       self.samples(name), "</section>"]
            body.append("".join(section))
        curves = self.curves()
        for run in self.runs:
            if run.bad_lines:
                self.warnings.append(f"{run.label}: {run.bad_lines} unreadable line(s) in samples.jsonl skipped")
        warnings = ""
        if self.warnings:
            warnings = ('<div class="warning"><strong>Warnings</strong><ul>'
                        + "".join(f"<li>{_e(w)}</li>" for w in self.warnings) + "</ul></div>")
        body = [_scrolled(b) for b in body]
        chart_note = f'<p class="note">{_e(self.chart_note)}</p>' if self.chart_note else ""
        title = ("mmrl evaluation report: " + " vs ".join(self.labels)) if len(self.labels) > 1 else \
            f"mmrl evaluation report: {self.labels[0]}"
        intro = (f"{len(self.runs)} evaluations; differences are against <strong>{_e(self.labels[0])}</strong>, "
                 f"green better, red worse (lower is better for fid, kid, loss, ...: "
                 f"<code>mmrl.eval.report.LOWER_IS_BETTER</code>)" if len(self.runs) > 1 else "one evaluation")
        return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
                f'<meta name="viewport" content="width=device-width, initial-scale=1">'
                f'<link rel="icon" href="data:,"><title>{_e(title)}</title><style>{_CSS}</style></head>'
                f"<body><main><h1>{_e(title)}</h1><p class=\"meta\">{intro}</p>{warnings}{chart_note}"
                f"<h2>Runs</h2>{_scrolled(self.runs_table())}<h2>Summary</h2>{_scrolled(self.summary_table())}"
                f"{''.join(body)}{curves}{_scrolled(self.footer())}</main></body></html>\n")


def _scrolled(html: str) -> str:
    """Every table of ``html`` in a horizontally scrolling box: a wide table scrolls inside the page instead of
    widening it (877 px at an 800 px window before)."""
    return re.sub(r"<table(.*?)</table>", r'<div class="scroll"><table\1</table></div>', html, flags=re.S)


def _curve_order(key: str) -> tuple:
    """reward/mean first, then each benchmark's headline (``overall``, ``acc@0.5``, ..., a key directly under the
    benchmark), then the rest (per-tag, per-category keys), each group alphabetical."""
    if key == "reward/mean":
        return (0, key)
    depth = key.count("/")
    return (1 if depth <= 2 else 2, key)


def _constant_zero(key: str, series) -> bool:
    """``eval/failed`` while nothing failed: a flat line at 0 that would take a curve's place."""
    return key == "eval/failed" and all(_number(row.get(key)) in (None, 0.0) for _, metrics, _ in series
                                        for row in metrics)


def _protocol_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


def write_report(eval_dirs: Sequence[str | Path], output: str | Path, *, labels: Sequence[str] | None = None,
                 first_prompts: int = 6, per_category: int = 3) -> Path:
    """Write ``output`` (an ``.html`` file; an existing folder means ``folder/report.html``) and its figures folder
    beside it (``report.html`` -> ``report_files/``, replaced), comparing the evaluation folders ``eval_dirs`` (each
    holding ``summary.json``; the first is the reference column). ``labels``: column names (default: run/checkpoint
    or ``base``, made unique). ``first_prompts``: prompts in the first image grid; ``per_category``: worst and best
    prompts shown per category. Returns the path of the HTML file."""
    if not eval_dirs:
        raise ReportError("write_report: no evaluation folders given")
    runs = [load_eval(d) for d in eval_dirs]
    if labels is not None:
        labels = [str(label) for label in labels]
        if len(labels) != len(runs):
            raise ReportError(f"labels: {len(labels)} given for {len(runs)} evaluation folders")
    else:
        labels = [run.default_label() for run in runs]
    for run, label in zip(runs, _unique(labels)):
        run.label = label
    output = Path(output)
    if output.is_dir():
        output = output / "report.html"
    output.parent.mkdir(parents=True, exist_ok=True)
    folder = output.parent / f"{output.stem}_files"
    staging = output.parent / f".{folder.name}.tmp-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        files = _Files(staging, quote(folder.name))
        page = _Page(runs, files, first_prompts, per_category).render()
        if folder.exists():
            shutil.rmtree(folder) if folder.is_dir() else folder.unlink()
        if any(staging.iterdir()):
            staging.rename(folder)
        tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, output)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return output


# --------------------------------------------------------------------------------------------- mmrl eval --compare


def run_compare(items: Sequence[str], *, echo: Callable[[str], None] = print) -> Path:
    """``mmrl eval --compare DIR_A DIR_B ... [output_dir=DIR] [labels=[a,b,...]]``: resolve every DIR
    (:func:`resolve_eval_dir`), write the report, return its path. Default ``output_dir``:
    ``compare/<label>_vs_<label>...`` in the current folder (a rerun of the same comparison replaces it)."""
    import yaml

    dirs: list[str] = []
    keys: dict[str, str] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", key.strip()) and not Path(item).exists():
            key = key.strip()
            if key not in COMPARE_KEYS:
                raise ReportError(f"{key}=...: not a --compare key (with --compare: "
                                  f"{', '.join(k + '=' for k in COMPARE_KEYS)}; the evaluations are already done)")
            if key in keys:
                raise ReportError(f"{key}= given twice")
            keys[key] = raw
        else:
            dirs.append(item)
    if not dirs:
        raise ReportError("--compare: give the evaluation folders (or evaluated run folders) to compare, the "
                          "reference first: mmrl eval --compare DIR_A DIR_B ...")
    resolved = []
    for d in dirs:
        path = resolve_eval_dir(d)
        if path.resolve() in [p.resolve() for p in resolved]:
            raise ReportError(f"{d}: the evaluation {path} is given twice")
        if path != Path(d):
            echo(f"{d}: using {path}")
        resolved.append(path)
    labels = None
    if "labels" in keys:
        try:
            labels = yaml.safe_load(keys["labels"])
        except yaml.YAMLError:
            labels = None
        if isinstance(labels, str):
            labels = [v.strip() for v in labels.split(",")]
        if not isinstance(labels, list) or not all(isinstance(v, (str, int, float)) and str(v).strip()
                                                   for v in labels):
            raise ReportError(f"labels={keys['labels']}: expected a list of names, e.g. labels=[base,grpo]")
        if len(labels) != len(resolved):
            raise ReportError(f"labels: {len(labels)} names for {len(resolved)} evaluation folders")
        labels = [str(v).strip() for v in labels]
        if len(set(labels)) < len(labels):  # each names a column of the comparison
            raise ReportError(f"labels: {', '.join(labels)} names a column twice; give each evaluation its own name")
    runs = [load_eval(p) for p in resolved]  # every summary.json checked before anything is written
    if "output_dir" in keys:
        if not keys["output_dir"].strip():
            raise ReportError("output_dir=: expected a folder")
        out = Path(keys["output_dir"].strip())
    else:
        names = _unique(labels or [run.default_label() for run in runs])
        slug = "_vs_".join(_slug(n) for n in names)
        if len(slug) > 100:
            slug = slug[:80] + "-" + hashlib.sha1(slug.encode()).hexdigest()[:8]
        out = Path("compare") / slug
    if out.exists() and not out.is_dir():
        raise ReportError(f"output_dir={out} is a file, not a folder")
    path = write_report(resolved, out / "report.html", labels=labels)
    echo(f"wrote {path} and {path.parent / (path.stem + '_files')}/ ({len(resolved)} evaluations, reference "
         f"{resolved[0]})")
    return path
