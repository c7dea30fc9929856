"""Benchmark prompt and annotation files for ``mmrl eval``: typed, validated loaders.

Each loader reads one benchmark file into a list of small frozen dataclasses and returns it as
:class:`BenchmarkItems`: a ``list`` that also carries the ``source`` path and ``counts`` (what the loader
counted: items per tag, repeats, data caveats). With ``path=None`` a loader reads the copy shipped in
``assets/benchmarks/`` (licences and provenance in each folder's ``ATTRIBUTION.md``). A user's copy in the
same format can be passed instead.

Bad input raises :class:`mmrl.data.prompts.DataError`:

* a malformed line gives ``"<file>:<line>: <what was expected>"``, with 1-based lines;
* a missing file gives its path and where to get it.

Loaders:

* :func:`load_geneval` -> :class:`GenEvalItem` (553 shipped; the 6 tags, clauses checked against
  ``object_names.txt``)
* :func:`load_t2i_compbench` -> :class:`T2IPrompt` (300 ``*_val.txt`` prompts per category)
* :func:`load_dpg_bench` -> :class:`DPGItem` with its :class:`DPGQuestion` graph (the user's
  ``dpg_bench.csv``; the official scorer's quirks behind ``official_quirks``). :func:`load_dpg_prompts`
  reads the 1065 shipped prompt files alone.
* :func:`load_ocr_prompts` -> :class:`OCRPrompt` (1018 shipped; the target is Flow-GRPO's
  ``prompt.split('"')[1]``)
* :func:`load_partiprompts` -> :class:`PartiPrompt` (1632)
* :func:`load_drawbench` -> :class:`DrawBenchPrompt` (200 unique; no categories)
* :func:`load_charades_sta` -> :class:`CharadesQuery` (3720 queries over 1334 videos, with durations)
* :func:`load_hpsv2` -> :class:`HPSv2Prompt` (user-supplied: HF ``zhwang/HPDv2`` ``benchmark/*.json``)

:data:`BENCHMARKS` maps each benchmark name to its loader. :data:`USER_SUPPLIED` says what is not shipped
and where to get it.
"""
from __future__ import annotations

import csv
import io
import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Literal, Mapping, Sequence, TypeVar

from mmrl.data.prompts import DataError, json_error

__all__ = [
    "BenchmarkItems",
    "assets_dir",
    "GENEVAL_TAGS",
    "GENEVAL_COLORS",
    "GENEVAL_RELATIONS",
    "GenEvalClause",
    "GenEvalItem",
    "load_geneval",
    "T2I_CATEGORIES",
    "T2I_METRICS",
    "T2IPrompt",
    "load_t2i_compbench",
    "DPG_COLUMNS",
    "DPGQuestion",
    "DPGItem",
    "load_dpg_bench",
    "load_dpg_prompts",
    "OCRPrompt",
    "ocr_target",
    "load_ocr_prompts",
    "PartiPrompt",
    "load_partiprompts",
    "DrawBenchPrompt",
    "load_drawbench",
    "CharadesQuery",
    "load_charades_sta",
    "HPSV2_STYLES",
    "HPSv2Prompt",
    "load_hpsv2",
    "BENCHMARKS",
    "USER_SUPPLIED",
    "benchmark_names",
]

T = TypeVar("T")


class BenchmarkItems(List[T]):
    """A loader's items (a plain list) plus ``benchmark`` (its name), ``source`` (the file or folder read)
    and ``counts`` (what the loader counted; keys documented per loader)."""

    def __init__(self, items: Sequence[T] = (), *, benchmark: str, source: Path, counts: Mapping[str, int] | None = None):
        super().__init__(items)
        self.benchmark = benchmark
        self.source = Path(source)
        self.counts: dict[str, int] = dict(counts or {})

    def __repr__(self) -> str:
        return f"BenchmarkItems({self.benchmark!r}, {len(self)} items from {str(self.source)!r}, counts={self.counts})"


# --------------------------------------------------------------------------------------------------- files

def assets_dir() -> Path:
    """The shipped ``assets/benchmarks`` folder.

    An installed package has it at ``mmrl/assets/benchmarks``, and a source checkout at
    ``<repo>/assets/benchmarks``. A loader with ``path=None`` names a missing folder in its error."""
    here = Path(__file__).resolve().parent  # .../mmrl/eval
    candidates = (here.parent / "assets" / "benchmarks", here.parent.parent / "assets" / "benchmarks")
    for candidate in candidates:
        if (candidate / "README.md").is_file():
            return candidate
    return candidates[-1]


def _shipped(*parts: str) -> Path:
    return assets_dir().joinpath(*parts)


def _missing(path: Path, what: str, get: str) -> DataError:
    return DataError(f"{what} not found: {path} ({get})")


def _read_text(path: str | Path, what: str, get: str) -> tuple[Path, str]:
    """``(path, text)`` of a UTF-8 file (a BOM is dropped); a missing or non-UTF-8 file is a DataError."""
    path = Path(path)
    if not path.is_file():
        raise _missing(path, what, get)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {exc.start})") from None
    return path, text.removeprefix("\ufeff")


def _lines(text: str) -> list[tuple[int, str]]:
    """``(1-based line number, line)`` with the line ending (``\\n``, ``\\r\\n``) removed; a final newline
    adds no empty line."""
    parts = text.split("\n")
    if parts and parts[-1] == "":
        parts.pop()
    return [(number, line.removesuffix("\r")) for number, line in enumerate(parts, start=1)]


def _position(text: str, offset: int) -> str:
    """``"<line>:<column>"`` (1-based) of a character offset."""
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return f"{line}:{column}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# --------------------------------------------------------------------------------------------------- GenEval

#: The six GenEval tasks (``metadata["tag"]``), in ``summary_scores.py``'s order.
GENEVAL_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
#: ``evaluation/evaluate_images.py``'s colour classes.
GENEVAL_COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
#: The relations ``evaluate_images.py`` can find between two boxes.
GENEVAL_RELATIONS = ("left of", "right of", "above", "below")
_GENEVAL_GET = "the GenEval metadata ships in assets/benchmarks/geneval/; upstream: djghosh13/geneval prompts/"
_GENEVAL_KEYS = ("tag", "include", "exclude", "prompt")
_INCLUDE_KEYS = ("class", "count", "color", "position")
_EXCLUDE_KEYS = ("class", "count")


@dataclass(frozen=True)
class GenEvalClause:
    """One ``include`` or ``exclude`` requirement.

    * ``class_name``: the metadata's ``class``.
    * ``count``: include means at least ``count`` objects; exclude means fewer than ``count``.
    * ``color`` (include only): the colour of each of the ``count`` most confident objects.
    * ``position`` (include only): ``(relation, index of an earlier include clause)``.
    """

    class_name: str
    count: int
    color: str | None = None
    position: tuple[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The clause as in ``evaluation_metadata.jsonl``."""
        out: dict[str, Any] = {"class": self.class_name, "count": self.count}
        if self.color is not None:
            out["color"] = self.color
        if self.position is not None:
            out["position"] = [self.position[0], self.position[1]]
        return out


@dataclass(frozen=True)
class GenEvalItem:
    """One GenEval prompt.

    * ``index``: 0-based line index. GenEval names its image folders ``<index:05d>``.
    * ``line``: 1-based line in the file.
    """

    index: int
    prompt: str
    tag: str
    include: tuple[GenEvalClause, ...]
    exclude: tuple[GenEvalClause, ...] = ()
    line: int = 0

    def metadata(self) -> dict[str, Any]:
        """The metadata object as in the file: what ``mmrl.rewards.geneval`` and GenEval's scorer take."""
        out: dict[str, Any] = {"tag": self.tag, "include": [c.to_dict() for c in self.include]}
        if self.exclude:
            out["exclude"] = [c.to_dict() for c in self.exclude]
        out["prompt"] = self.prompt
        return out


def _read_object_names(path: Path) -> list[str]:
    path, text = _read_text(path, "GenEval object_names.txt", _GENEVAL_GET)
    names = [line.strip() for _, line in _lines(text) if line.strip()]
    if not names:
        raise DataError(f"{path}: empty class list (expected one GenEval class name per line)")
    return names


def _geneval_clause(raw: Any, kind: str, k: int, classes: set[str], where: str) -> GenEvalClause:
    what = f"{kind} clause {k}"
    if not isinstance(raw, dict):
        raise DataError(f"{where}: {what}: expected an object, got {type(raw).__name__}")
    allowed = _INCLUDE_KEYS if kind == "include" else _EXCLUDE_KEYS
    unknown = [key for key in raw if key not in allowed]
    if unknown:
        raise DataError(f"{where}: {what}: unknown field(s) {unknown}; a GenEval {kind} clause has {list(allowed)}")
    cls = raw.get("class")
    if not isinstance(cls, str):
        raise DataError(f"{where}: {what}: expected a string 'class', got {cls!r}")
    if cls not in classes:
        raise DataError(f"{where}: {what}: class {cls!r} is not in GenEval's object_names.txt")
    if "count" not in raw:
        raise DataError(f"{where}: {what}: missing 'count' (an integer >= 1)")
    count = raw["count"]
    if not _is_int(count) or count < 1:
        raise DataError(f"{where}: {what}: 'count' must be an integer >= 1, got {count!r}")
    color = raw.get("color")
    if "color" in raw and color not in GENEVAL_COLORS:
        raise DataError(f"{where}: {what}: unknown color {color!r}; GenEval's colours: {list(GENEVAL_COLORS)}")
    position = None
    if "position" in raw:
        pos = raw["position"]
        ok = (isinstance(pos, list) and len(pos) == 2 and pos[0] in GENEVAL_RELATIONS and _is_int(pos[1])
              and 0 <= pos[1] < k)
        if not ok:
            raise DataError(f"{where}: {what}: 'position' must be [relation, index of an earlier include clause] "
                            f"with relation in {list(GENEVAL_RELATIONS)} and index in [0, {k}), got {pos!r}")
        position = (pos[0], pos[1])
    return GenEvalClause(cls, count, color, position)


def load_geneval(path: str | Path | None = None, *, object_names: str | Path | None = None) -> BenchmarkItems[GenEvalItem]:
    """GenEval's ``evaluation_metadata.jsonl``: one JSON object per line,
    ``{"tag", "include": [clause, ...], "exclude"?: [clause, ...], "prompt"}``.

    Checks:

    * ``tag`` is one of :data:`GENEVAL_TAGS`, and ``prompt`` is a non-empty string;
    * ``include`` is a non-empty list, and ``exclude`` (optional) a list;
    * every clause has a ``class`` from ``object_names.txt`` and an integer ``count >= 1``;
    * an include clause may have a ``color`` (one of :data:`GENEVAL_COLORS`) and a ``position``
      ``[relation, index]``, whose index names an earlier include clause;
    * unknown fields are errors, and so are blank lines, because GenEval numbers image folders by line.

    ``object_names`` defaults to the ``object_names.txt`` next to ``path``, else the shipped one.
    ``path=None`` reads the shipped file (553 prompts).
    ``counts`` holds ``prompts`` and one entry per tag.
    """
    path = Path(path) if path is not None else _shipped("geneval", "evaluation_metadata.jsonl")
    if object_names is None:
        sibling = path.parent / "object_names.txt"
        object_names = sibling if sibling.is_file() else _shipped("geneval", "object_names.txt")
    classes = set(_read_object_names(Path(object_names)))
    path, text = _read_text(path, "GenEval metadata file", _GENEVAL_GET)
    items: list[GenEvalItem] = []
    for number, line in _lines(text):
        where = f"{path}:{number}"
        if not line.strip():
            raise DataError(f"{where}: blank line (GenEval metadata has one JSON object per line, numbered by line)")
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: {json_error(exc)}") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object with 'tag', 'include' and 'prompt', got {type(record).__name__}")
        unknown = [key for key in record if key not in _GENEVAL_KEYS]
        if unknown:
            raise DataError(f"{where}: unknown field(s) {unknown}; GenEval metadata has {list(_GENEVAL_KEYS)}")
        for key in ("tag", "include", "prompt"):
            if key not in record:
                raise DataError(f"{where}: missing '{key}' (GenEval metadata has 'tag', 'include', optional 'exclude', 'prompt')")
        prompt, tag = record["prompt"], record["tag"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
        if tag not in GENEVAL_TAGS:
            raise DataError(f"{where}: unknown tag {tag!r}; GenEval's tags: {list(GENEVAL_TAGS)}")
        include, exclude = record["include"], record.get("exclude", [])
        if not isinstance(include, list) or not include:
            raise DataError(f"{where}: 'include' must be a non-empty list of clauses, got {include!r}")
        if not isinstance(exclude, list):
            raise DataError(f"{where}: 'exclude' must be a list of clauses, got {exclude!r}")
        items.append(GenEvalItem(
            index=len(items), prompt=prompt, tag=tag,
            include=tuple(_geneval_clause(c, "include", k, classes, where) for k, c in enumerate(include)),
            exclude=tuple(_geneval_clause(c, "exclude", k, classes, where) for k, c in enumerate(exclude)),
            line=number))
    if not items:
        raise DataError(f"{path}: no prompts (expected one GenEval metadata object per line)")
    tags = Counter(item.tag for item in items)
    return BenchmarkItems(items, benchmark="geneval", source=path,
                          counts={"prompts": len(items), **{tag: tags.get(tag, 0) for tag in GENEVAL_TAGS}})


# --------------------------------------------------------------------------------------------- T2I-CompBench

#: T2I-CompBench categories: the original six, then the two T2I-CompBench++ ones that have a val list.
T2I_CATEGORIES = ("color", "shape", "texture", "spatial", "non_spatial", "complex", "3d_spatial", "numeracy")
#: The official metric of each category (T2I-CompBench's scorer folders).
T2I_METRICS = {
    "color": "blip_vqa", "shape": "blip_vqa", "texture": "blip_vqa",
    "spatial": "unidet", "non_spatial": "clipscore", "complex": "3_in_1",
    "3d_spatial": "unidet_depth", "numeracy": "unidet_numeracy",
}
_T2I_SPLITS = {c: ("val", "val_seen", "val_unseen") if c in ("color", "shape", "texture") else ("val",)
               for c in T2I_CATEGORIES}
_T2I_GET = ("mmrl ships the *_val.txt test lists (and color/shape/texture val_seen/val_unseen) in "
            "assets/benchmarks/t2i_compbench/dataset/; other lists: Karine-Huang/T2I-CompBench examples/dataset/, "
            "passed as path=")


@dataclass(frozen=True)
class T2IPrompt:
    """One T2I-CompBench prompt.

    * ``index``: 0-based position in the file; the scorers order images by it.
    * ``line``: 1-based line in the file.
    * ``complex_kind`` (``complex`` only): how 3-in-1 weights the prompt. ``"spatial"`` means
      (UniDet + BLIP)/2, ``"action"`` means (CLIP + BLIP)/2, and ``"all"`` the mean of all three.
    """

    index: int
    prompt: str
    category: str
    split: str
    line: int
    complex_kind: Literal["spatial", "action", "all"] | None = None


def _t2i_read(path: Path, what: str) -> list[tuple[int, str]]:
    """Official reading: ``f.read().splitlines()`` then ``split("\\t")[0]``; blank lines are skipped."""
    path, text = _read_text(path, what, _T2I_GET)
    out = []
    for number, line in _lines(text):
        if not line.strip():
            continue
        prompt = line.split("\t")[0]
        if not prompt.strip():
            raise DataError(f"{path}:{number}: empty prompt before a tab (expected one prompt per line)")
        out.append((number, prompt))
    return out


def _complex_key(prompt: str) -> str:
    """``3_in_1.py``'s matching key: the text before the first ``.``, lower-cased."""
    return prompt.split(".")[0].lower()


def load_t2i_compbench(category: str, split: str = "val", path: str | Path | None = None) -> BenchmarkItems[T2IPrompt]:
    """One T2I-CompBench prompt list: one prompt per line (CRLF or LF), text before a tab. This is
    ``GORS_finetune/inference_eval.py``'s reading, except that blank lines are skipped.

    ``category`` is one of :data:`T2I_CATEGORIES`. ``split`` is ``"val"``, the official test set of 300
    prompts. Color, shape and texture also ship ``"val_seen"`` and ``"val_unseen"``.
    With ``path`` a user's list is read instead, and ``split`` is only a label.

    Complex prompts get ``complex_kind`` from the ``complex_<split>_spatial.txt`` and
    ``complex_<split>_action.txt`` next to the file, or from the shipped val lists. A prompt counts as
    spatial, else action, else all, matching on the text before the first ``.``, lower-cased, as
    ``3_in_1_eval/3_in_1.py`` does. ``counts`` holds ``prompts`` and ``unique``, plus the per-kind counts
    for complex.
    """
    if category not in T2I_CATEGORIES:
        raise DataError(f"unknown T2I-CompBench category {category!r}; known: {list(T2I_CATEGORIES)}")
    if path is None:
        if split not in _T2I_SPLITS[category]:
            raise DataError(f"T2I-CompBench {category} split {split!r} is not shipped (shipped: "
                            f"{list(_T2I_SPLITS[category])}); {_T2I_GET}")
        path = _shipped("t2i_compbench", "dataset", f"{category}_{split}.txt")
    path = Path(path)
    rows = _t2i_read(path, f"T2I-CompBench {category} prompt list")
    if not rows:
        raise DataError(f"{path}: no prompts (expected one prompt per line)")
    kinds: dict[int, str] = {}
    counts: dict[str, int] = {"prompts": len(rows), "unique": len({p for _, p in rows})}
    if category == "complex":
        lists = [path.parent / f"complex_{split}_{kind}.txt" for kind in ("spatial", "action")]
        if not all(p.is_file() for p in lists) and split == "val":
            lists = [_shipped("t2i_compbench", "dataset", f"complex_val_{kind}.txt") for kind in ("spatial", "action")]
        if all(p.is_file() for p in lists):
            spatial, action = ({_complex_key(p) for _, p in _t2i_read(f, "T2I-CompBench complex sub-list")} for f in lists)
            for i, (_, prompt) in enumerate(rows):
                key = _complex_key(prompt)
                kinds[i] = "spatial" if key in spatial else "action" if key in action else "all"
            counts.update({f"complex_{k}": v for k, v in sorted(Counter(kinds.values()).items())})
    items = [T2IPrompt(i, prompt, category, split, number, kinds.get(i)) for i, (number, prompt) in enumerate(rows)]
    return BenchmarkItems(items, benchmark="t2i_compbench", source=path, counts=counts)


# --------------------------------------------------------------------------------------------------- DPG-Bench

#: The columns of ``dpg_bench.csv`` as ``compute_dpg_bench.py`` reads them, one row per question.
DPG_COLUMNS = ("item_id", "text", "keywords", "proposition_id", "dependency", "category_broad",
               "category_detailed", "tuple", "question_natural_language")
_DPG_CSV_GET = ("dpg_bench.csv is not shipped; download it from "
                "https://github.com/TencentQQGYLab/ELLA/blob/main/dpg_bench/dpg_bench.csv "
                "(Apache-2.0, git blob 98457fc9901943f51ff9a30367250fc292533bed)")
_DPG_PROMPTS_GET = "the DPG-Bench prompts ship in assets/benchmarks/dpg_bench/prompts/; upstream: TencentQQGYLab/ELLA dpg_bench/prompts/"


@dataclass(frozen=True)
class DPGQuestion:
    """One DPG-Bench question, a proposition of its item's graph.

    * ``dependency``: the parent proposition ids as the official scorer parses them
      (``[int(d.strip()) for d in dependency.split(',')]``); ``0`` means no parent.
    * ``tuple_``: the csv's ``tuple`` column (the DSG tuple, e.g. ``"entity - whole (cat)"``), which gives
      the official categories.
    * ``line``: the 1-based CSV line where the row starts.
    """

    proposition_id: int
    question: str
    dependency: tuple[int, ...]
    tuple_: str
    category_broad: str
    category_detailed: str
    keywords: str
    line: int

    @property
    def parents(self) -> tuple[int, ...]:
        """The parent proposition ids, the ``0`` entries dropped."""
        return tuple(d for d in self.dependency if d != 0)

    @property
    def category(self) -> str:
        """The official L2 category: ``tuple.split('(')[0].strip()``, e.g. ``"entity - whole"``."""
        return self.tuple_.split("(")[0].strip()

    @property
    def category_l1(self) -> str:
        """The official L1 category: the L2 category's text before ``-``, e.g. ``"entity"``."""
        return self.category.split("-")[0].strip()


@dataclass(frozen=True)
class DPGItem:
    """One DPG-Bench prompt with its question graph.

    * ``item_id``: the prompt file stem and the image name, ``<item_id>.png``.
    * ``text``: the csv's ``text`` column.
    * ``prompt``: the generation input, i.e. the prompt file's text (stripped) when the file was read,
      else ``text``.
    * ``questions``: in CSV order, which is the order the official gating runs in.
    * ``missing_parents``: ``official_quirks`` only. These are parent ids that name no question of the
      item. The official scorer raises ``KeyError`` when it reaches one and then drops the image from the
      mean (``Failed filename``).
    """

    item_id: str
    text: str
    prompt: str
    questions: tuple[DPGQuestion, ...]
    line: int
    prompt_file: Path | None = None
    missing_parents: tuple[int, ...] = ()

    @property
    def official_fails(self) -> bool:
        """Whether the official scorer can raise on this item (see ``missing_parents``)."""
        return bool(self.missing_parents)


def _dpg_int(value: str, where: str, column: str, *, integral_float: bool) -> int:
    text = value.strip()
    try:
        return int(text)
    except ValueError:
        pass
    if integral_float:  # pandas reads an integer column with gaps as float: "1.0"
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if math.isfinite(number) and number.is_integer():
            return int(number)
    raise DataError(f"{where}: column '{column}' must be an integer, got {value!r}")


def load_dpg_prompts(prompts_dir: str | Path | None = None) -> BenchmarkItems[tuple[str, str]]:
    """The DPG-Bench prompt files, as ``(item_id, prompt)`` pairs sorted by item id. Each prompt is one
    file's text, stripped. ``prompts_dir=None`` reads the 1065 shipped files. Generating images needs only
    these; scoring needs ``dpg_bench.csv`` (:func:`load_dpg_bench`)."""
    directory = Path(prompts_dir) if prompts_dir is not None else _shipped("dpg_bench", "prompts")
    if not directory.is_dir():
        raise _missing(directory, "DPG-Bench prompts folder", _DPG_PROMPTS_GET)
    out = []
    for file in sorted(directory.glob("*.txt")):
        _, text = _read_text(file, "DPG-Bench prompt file", _DPG_PROMPTS_GET)
        if not text.strip():
            raise DataError(f"{file}:1: empty prompt file (expected the prompt text)")
        out.append((file.stem, text.strip()))
    if not out:
        raise DataError(f"{directory}: no <item_id>.txt prompt files ({_DPG_PROMPTS_GET})")
    return BenchmarkItems(out, benchmark="dpg_bench", source=directory, counts={"prompts": len(out)})


def load_dpg_bench(csv_path: str | Path, prompts_dir: str | Path | None | Literal[False] = None, *,
                   official_quirks: bool = False) -> BenchmarkItems[DPGItem]:
    """DPG-Bench questions from the user's ``dpg_bench.csv``, grouped into items with their question graph.

    The csv is a comma-separated file with a header row containing :data:`DPG_COLUMNS`, read as pandas
    would with standard quoting. Blank lines are skipped. There is one row per question, and an item's
    rows come in one contiguous block.

    Checks:

    * every row has the header's number of fields;
    * ``item_id``, ``proposition_id``, ``dependency``, ``tuple`` and ``question_natural_language`` are
      present, and so is ``text`` (checked only with ``official_quirks`` off);
    * ``proposition_id`` is an integer, and so is every comma-separated ``dependency`` entry.

    With ``official_quirks`` off, the graph is also checked:

    * proposition ids are >= 1 and unique within an item;
    * every non-zero dependency names another proposition of the same item;
    * an item's rows are contiguous.

    ``prompts_dir`` holds the prompt files, ``<item_id>.txt``. It defaults to the shipped 1065;
    ``False`` skips them. When it is used, every item needs a prompt file, which sets
    :attr:`DPGItem.prompt`. ``counts["text_differs_from_prompt_file"]`` counts the csv texts that differ
    from their file, and ``counts["prompts_without_questions"]`` the prompt files no item uses.

    ``official_quirks=True`` reproduces ``dpg_bench/compute_dpg_bench.py:prepare_dpg_data()`` exactly, for
    numbers that match published ones:

    * **first row dropped**: the scorer skips ``i == 0`` of the pandas frame, i.e. the first question of
      the first item. That item's children of the dropped question then name a missing parent.
      They are recorded in :attr:`DPGItem.missing_parents` rather than raised, because the official scorer
      raises ``KeyError`` on them at scoring time and leaves the image out of the mean.
      ``counts["dropped_rows"]`` is 1, and ``counts["items_failing_official"]`` counts such items.
    * **a repeated item block replaces the earlier one**: the scorer starts a fresh dict whenever
      ``item_id`` differs from the previous row's, so a non-contiguous item keeps only its last block.
      ``counts["replaced_blocks"]`` counts these.
    * **a repeated proposition id overwrites** the earlier question's values, keeping its place in the
      order (Python dict assignment). ``counts["overwritten_questions"]`` counts these.
    * the graph checks above are not applied.

    Not a loader matter, but part of the same scorer and to be honoured by the DPG scorer: the category
    breakdown (L1/L2 from ``tuple``; :attr:`DPGQuestion.category`) uses the scores **before** dependency
    gating and of the **last** tile only (``qid2scores_orig``). The overall score uses gated scores,
    averaged over the 4 tiles of the 2×2 grid.
    """
    csv_path = Path(csv_path)
    path, text = _read_text(csv_path, "DPG-Bench questions file (dpg_bench.csv)", _DPG_CSV_GET)
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        while header == []:
            header = next(reader, None)
    except csv.Error as exc:
        raise DataError(f"{path}:{reader.line_num}: not valid CSV ({exc})") from None
    if header is None:
        raise DataError(f"{path}: empty file (expected a header row with columns {list(DPG_COLUMNS)})")
    header_line = reader.line_num
    header = [h.strip() for h in header]
    missing = [c for c in DPG_COLUMNS if c not in header]
    if missing:
        raise DataError(f"{path}:{header_line}: header lacks column(s) {missing}; dpg_bench.csv has {list(DPG_COLUMNS)}")
    col = {c: header.index(c) for c in DPG_COLUMNS}

    # item_id -> [first line, text, {qid: question}]; block order kept
    blocks: dict[str, list[Any]] = {}
    block_lines: dict[str, int] = {}
    counts = Counter({"dropped_rows": 0, "replaced_blocks": 0, "overwritten_questions": 0})
    previous_id: str | None = None
    first_data_row = True
    while True:
        start = reader.line_num + 1
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            raise DataError(f"{path}:{start}: not valid CSV ({exc})") from None
        if row == [] or all(not field.strip() for field in row):
            continue  # pandas skips blank lines
        where = f"{path}:{start}"
        if len(row) != len(header):
            raise DataError(f"{where}: expected {len(header)} fields (the header's columns), got {len(row)}")
        if first_data_row:
            first_data_row = False
            if official_quirks:
                counts["dropped_rows"] += 1
                continue  # compute_dpg_bench.py: `if i == 0: continue`
        value = {c: row[col[c]] for c in DPG_COLUMNS}
        required = ["item_id", "proposition_id", "dependency", "tuple", "question_natural_language"]
        if not official_quirks:
            required.append("text")
        for c in required:
            if not value[c].strip():
                raise DataError(f"{where}: column '{c}' is empty")
        item_id = value["item_id"].strip()
        qid = _dpg_int(value["proposition_id"], where, "proposition_id", integral_float=True)
        dependency = tuple(_dpg_int(d, where, "dependency", integral_float=False) for d in value["dependency"].split(","))
        question = DPGQuestion(qid, value["question_natural_language"], dependency, value["tuple"],
                               value["category_broad"], value["category_detailed"], value["keywords"], start)
        if item_id != previous_id:
            if item_id in blocks:
                if not official_quirks:
                    raise DataError(f"{where}: item '{item_id}' appears again (its rows started at line "
                                    f"{block_lines[item_id]}); an item's rows must be contiguous. "
                                    f"official_quirks=True keeps only the last block, as the official scorer does")
                counts["replaced_blocks"] += 1
                del blocks[item_id]
            blocks[item_id] = [start, value["text"], {}]
            block_lines[item_id] = start
        questions: dict[int, DPGQuestion] = blocks[item_id][2]
        if qid in questions:
            if not official_quirks:
                raise DataError(f"{where}: item '{item_id}' repeats proposition_id {qid} "
                                f"(first at line {questions[qid].line})")
            counts["overwritten_questions"] += 1
        elif not official_quirks and qid < 1:
            raise DataError(f"{where}: proposition_id must be >= 1 (0 means 'no parent' in 'dependency'), got {qid}")
        questions[qid] = question
        previous_id = item_id
    if not blocks:
        raise DataError(f"{path}: no question rows after the header (expected one row per question)")

    directory: Path | None = None
    if prompts_dir is not False:
        directory = Path(prompts_dir) if prompts_dir is not None else _shipped("dpg_bench", "prompts")
        if not directory.is_dir():
            raise _missing(directory, "DPG-Bench prompts folder", _DPG_PROMPTS_GET)

    items: list[DPGItem] = []
    for item_id, (line, item_text, questions) in blocks.items():
        ids = set(questions)
        missing_parents: set[int] = set()
        for q in questions.values():
            for parent in q.parents:
                if official_quirks:  # only a parent with no question breaks the official scorer (KeyError)
                    if parent not in ids:
                        missing_parents.add(parent)
                    continue
                if parent in ids and parent != q.proposition_id:
                    continue
                what = "names its own proposition" if parent == q.proposition_id else "names no proposition"
                raise DataError(f"{path}:{q.line}: item '{item_id}' proposition {q.proposition_id}: dependency "
                                f"{parent} {what} of item '{item_id}' (its propositions: {sorted(ids)}; 0 = no parent)")
        prompt_file, prompt = None, item_text.strip()
        if directory is not None:
            counts.setdefault("text_differs_from_prompt_file", 0)
            prompt_file = directory / f"{item_id}.txt"
            if not prompt_file.is_file():
                raise DataError(f"{path}:{line}: item '{item_id}' has no prompt file {prompt_file} (DPG-Bench item ids "
                                f"are the prompt file stems; a csv of another version? prompts_dir=False skips this)")
            _, file_text = _read_text(prompt_file, "DPG-Bench prompt file", _DPG_PROMPTS_GET)
            prompt = file_text.strip()
            counts["text_differs_from_prompt_file"] += prompt != item_text.strip()
        items.append(DPGItem(item_id, item_text, prompt, tuple(questions.values()), line, prompt_file,
                             tuple(sorted(missing_parents))))
    counts["items_failing_official"] = sum(item.official_fails for item in items)
    if directory is not None:
        stems = {f.stem for f in directory.glob("*.txt")}
        counts["prompts_without_questions"] = len(stems - set(blocks))
    out_counts = {"items": len(items), "questions": sum(len(i.questions) for i in items), **counts}
    return BenchmarkItems(items, benchmark="dpg_bench", source=path, counts=out_counts)


# --------------------------------------------------------------------------------------------------------- OCR

_OCR_GET = "the OCR test prompts ship in assets/benchmarks/ocr/test.txt; upstream: yifan123/flow_grpo dataset/ocr/"


@dataclass(frozen=True)
class OCRPrompt:
    """One text-rendering prompt. ``target`` is the text to render, taken as Flow-GRPO does
    (``prompt.split('"')[1]``). ``index`` is 0-based; ``line`` is 1-based."""

    index: int
    prompt: str
    target: str
    line: int


def ocr_target(prompt: str) -> str | None:
    """Flow-GRPO's target, ``prompt.split('"')[1]``: the text inside the first pair of double quotes.
    None when the prompt has no such pair."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None


def load_ocr_prompts(path: str | Path | None = None) -> BenchmarkItems[OCRPrompt]:
    """Flow-GRPO's OCR prompt file: one prompt per line, each containing its target text in double quotes.

    Blank lines are skipped. A line without a closed ``"..."`` pair is an error, and so is an empty or
    all-space quoted target; Flow-GRPO divides by the target's length. ``path=None`` reads the shipped
    ``test.txt`` (1018 prompts). ``counts``:

    * ``prompts``;
    * ``multiple_quoted``: prompts with more than one quoted span, where only the first is the target.
    """
    path = Path(path) if path is not None else _shipped("ocr", "test.txt")
    path, text = _read_text(path, "OCR prompt file", _OCR_GET)
    items: list[OCRPrompt] = []
    multiple = 0
    for number, line in _lines(text):
        prompt = line.strip()
        if not prompt:
            continue
        target = ocr_target(prompt)
        if target is None:
            raise DataError(f'{path}:{number}: no quoted text (expected the text to render in double quotes, "...")')
        if not target.replace(" ", ""):
            raise DataError(f'{path}:{number}: the quoted target text is empty (expected "<text to render>")')
        multiple += prompt.count('"') > 2
        items.append(OCRPrompt(len(items), prompt, target, number))
    if not items:
        raise DataError(f"{path}: no prompts (expected one prompt per line)")
    return BenchmarkItems(items, benchmark="ocr", source=path, counts={"prompts": len(items), "multiple_quoted": multiple})


# -------------------------------------------------------------------------------------------------- PartiPrompts

_PARTI_GET = "PartiPrompts ships in assets/benchmarks/partiprompts/; upstream: google-research/parti PartiPrompts.tsv"
_PARTI_HEADER = ["Prompt", "Category", "Challenge", "Note"]


@dataclass(frozen=True)
class PartiPrompt:
    """One PartiPrompts (P2) prompt, with its ``category`` (12), ``challenge`` (11) and optional ``note``.
    The prompt is kept exactly as in the file; ten upstream prompts have outer spaces."""

    index: int
    prompt: str
    category: str
    challenge: str
    note: str
    line: int


def load_partiprompts(path: str | Path | None = None) -> BenchmarkItems[PartiPrompt]:
    """``PartiPrompts.tsv``: a header ``Prompt<TAB>Category<TAB>Challenge<TAB>Note`` and then 4 tab-separated
    fields per line. Prompt, Category and Challenge must be non-empty, and Note may be empty. There is no
    CSV-style quoting. ``path=None`` reads the shipped file (1632 prompts). ``counts``: ``prompts``,
    ``categories``, ``challenges``."""
    path = Path(path) if path is not None else _shipped("partiprompts", "PartiPrompts.tsv")
    path, text = _read_text(path, "PartiPrompts file", _PARTI_GET)
    lines = _lines(text)
    if not lines or lines[0][1].split("\t") != _PARTI_HEADER:
        got = lines[0][1] if lines else "an empty file"
        raise DataError(f"{path}:1: expected the header {chr(9).join(_PARTI_HEADER)!r} (tab-separated), got {got!r}")
    items: list[PartiPrompt] = []
    for number, line in lines[1:]:
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 4:
            raise DataError(f"{path}:{number}: expected 4 tab-separated fields (Prompt, Category, Challenge, Note), "
                            f"got {len(fields)}")
        prompt, category, challenge, note = fields
        for name, value in (("Prompt", prompt), ("Category", category), ("Challenge", challenge)):
            if not value.strip():
                raise DataError(f"{path}:{number}: empty {name}")
        items.append(PartiPrompt(len(items), prompt, category, challenge, note, number))
    if not items:
        raise DataError(f"{path}: no prompts after the header")
    return BenchmarkItems(items, benchmark="partiprompts", source=path, counts={
        "prompts": len(items), "categories": len({i.category for i in items}),
        "challenges": len({i.challenge for i in items})})


# ----------------------------------------------------------------------------------------------------- DrawBench

_DRAWBENCH_GET = "DrawBench ships in assets/benchmarks/drawbench/; upstream copy: NVlabs/DiffusionNFT dataset/drawbench/test.txt"


@dataclass(frozen=True)
class DrawBenchPrompt:
    """One DrawBench prompt. ``line`` is where it first appears. There is **no category**: DrawBench's
    11 category labels exist only in an unlicensed copy, which is not shipped."""

    index: int
    prompt: str
    line: int


def load_drawbench(path: str | Path | None = None) -> BenchmarkItems[DrawBenchPrompt]:
    """DrawBench's unique prompts from a one-prompt-per-line file, de-duplicated in order of first
    appearance. Prompts are compared after stripping, and blank lines are skipped.

    ``path=None`` reads the shipped ``prompts_unique.txt`` (200 prompts). The shipped ``test.txt``
    (DiffusionNFT's, each prompt 5 times) gives the same 200 in the same order. That 5-fold repetition
    is how the diffusion-RL papers get their 5 images per prompt.
    ``counts``: ``lines``, ``prompts`` (unique), ``repeats`` (lines minus unique).
    Categories are not available (see :class:`DrawBenchPrompt`).
    """
    path = Path(path) if path is not None else _shipped("drawbench", "prompts_unique.txt")
    path, text = _read_text(path, "DrawBench prompt file", _DRAWBENCH_GET)
    seen: dict[str, int] = {}
    lines = 0
    for number, line in _lines(text):
        prompt = line.strip()
        if not prompt:
            continue
        lines += 1
        seen.setdefault(prompt, number)
    if not seen:
        raise DataError(f"{path}: no prompts (expected one prompt per line)")
    items = [DrawBenchPrompt(i, prompt, number) for i, (prompt, number) in enumerate(seen.items())]
    return BenchmarkItems(items, benchmark="drawbench", source=path,
                          counts={"lines": lines, "prompts": len(items), "repeats": lines - len(items)})


# -------------------------------------------------------------------------------------------------- Charades-STA

_CHARADES_GET = ("the Charades-STA test annotations ship in assets/benchmarks/charades_sta/; upstream: "
                 "microsoft/2D-TAN data/Charades-STA/, www-Ye/TimeZero dataset/charades-sta/ (the videos are "
                 "Charades v1 from allenai.org/plato/charades, not included)")
_CHARADES_TXT = re.compile(r"^(\S+) (\S+) (\S+)##(.*)$")


@dataclass(frozen=True)
class CharadesQuery:
    """One Charades-STA query.

    * ``start`` and ``end``: seconds.
    * ``duration``: the video's length in seconds. It is given in the TimeZero JSON and None from the
      2D-TAN txt.
    * ``index``: 0-based; ``line``: 1-based in the file (the JSON file is a single line).
    """

    index: int
    video_id: str
    start: float
    end: float
    sentence: str
    duration: float | None
    line: int

    @property
    def end_past_duration(self) -> bool:
        """Whether the annotated end is after the video's end, a known Charades-STA artefact."""
        return self.duration is not None and self.end > self.duration

    @property
    def clipped_end(self) -> float:
        """``end`` clipped to ``duration``, where the duration is known."""
        return min(self.end, self.duration) if self.duration is not None else self.end


def _charades_moment(start: Any, end: Any, where: str, duration: float | None = None) -> tuple[float, float]:
    if not (_is_number(start) and _is_number(end)):
        raise DataError(f"{where}: start and end must be finite numbers of seconds, got {start!r} and {end!r}")
    if start < 0:
        raise DataError(f"{where}: start must be >= 0 seconds, got {start}")
    if not start < end:
        raise DataError(f"{where}: start must be before end, got start {start} >= end {end}")
    if duration is not None and start >= duration:
        raise DataError(f"{where}: start {start} is not inside the video (duration {duration})")
    return float(start), float(end)


def _parse_json(path: Path, text: str):
    """``json.loads(text)``, or a :class:`DataError` naming ``path`` and the line of the fault."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{exc.lineno}: {json_error(exc)}") from None


def load_charades_sta(path: str | Path | None = None) -> BenchmarkItems[CharadesQuery]:
    """Charades-STA annotations in either of two formats, chosen by the file suffix.

    * ``.json`` (TimeZero): ``{video_id: {"duration": s, "timestamps": [[start, end], ...],
      "sentences": [...]}}``. The moments come in video order, then annotation order. An error names the
      line and column of the video's key.
    * otherwise (2D-TAN txt): ``VIDEO_ID START END##sentence`` per line, times in seconds, no duration.

    Checks: times are finite, ``0 <= start < end``, the sentence is non-empty and a start lies inside the
    video. An end past the duration is **counted, not failed**: 562 of the 3720 shipped moments have one.
    ``path=None`` reads the shipped ``charades_test.json``: 3720 queries over 1334 videos, with durations.
    ``counts``: ``queries``, ``videos``, ``ends_past_duration``.
    """
    path = Path(path) if path is not None else _shipped("charades_sta", "charades_test.json")
    path, text = _read_text(path, "Charades-STA annotation file", _CHARADES_GET)
    items: list[CharadesQuery] = []
    if path.suffix.lower() == ".json":
        data = _parse_json(path, text)
        if not isinstance(data, dict) or not data:
            raise DataError(f"{path}:1: expected a non-empty object {{video_id: {{duration, timestamps, sentences}}}}")
        cursor = 0  # json keeps key order, so each key is searched for after the previous one
        for video_id, record in data.items():
            match = re.compile(re.escape(json.dumps(video_id, ensure_ascii=False)) + r"\s*:").search(text, cursor)
            if match is None:  # an escaped spelling of the key: fall back to line 1
                at = "1"
            else:
                cursor = match.end()
                at = _position(text, match.start())
            where = f"{path}:{at}: video {video_id!r}"
            line = int(at.split(":")[0])
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected an object with 'duration', 'timestamps', 'sentences'")
            duration, stamps, sentences = record.get("duration"), record.get("timestamps"), record.get("sentences")
            if not _is_number(duration) or duration <= 0:
                raise DataError(f"{where}: 'duration' must be a positive number of seconds, got {duration!r}")
            if not isinstance(stamps, list) or not isinstance(sentences, list) or len(stamps) != len(sentences) or not stamps:
                raise DataError(f"{where}: 'timestamps' and 'sentences' must be non-empty lists of the same length")
            for k, (stamp, sentence) in enumerate(zip(stamps, sentences)):
                at_k = f"{where} moment {k}"
                if not isinstance(stamp, list) or len(stamp) != 2:
                    raise DataError(f"{at_k}: a timestamp must be [start, end], got {stamp!r}")
                start, end = _charades_moment(stamp[0], stamp[1], at_k, float(duration))
                if not isinstance(sentence, str) or not sentence.strip():
                    raise DataError(f"{at_k}: the sentence must be a non-empty string, got {sentence!r}")
                items.append(CharadesQuery(len(items), video_id, start, end, sentence, float(duration), line))
    else:
        for number, line in _lines(text):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            match = _CHARADES_TXT.match(line)
            if match is None:
                raise DataError(f"{where}: expected 'VIDEO_ID START END##sentence', got {line[:80]!r}")
            video_id, start_s, end_s, sentence = match.groups()
            try:
                start, end = float(start_s), float(end_s)
            except ValueError:
                raise DataError(f"{where}: START and END must be numbers of seconds, got {start_s!r} and {end_s!r}") from None
            start, end = _charades_moment(start, end, where)
            if not sentence.strip():
                raise DataError(f"{where}: empty sentence after '##'")
            items.append(CharadesQuery(len(items), video_id, start, end, sentence, None, number))
    if not items:
        raise DataError(f"{path}: no queries")
    return BenchmarkItems(items, benchmark="charades_sta", source=path, counts={
        "queries": len(items), "videos": len({q.video_id for q in items}),
        "ends_past_duration": sum(q.end_past_duration for q in items)})


# ------------------------------------------------------------------------------------------------------- HPSv2

#: The four HPSv2 benchmark styles (HF dataset ``zhwang/HPDv2``, ``benchmark/<style>.json``).
HPSV2_STYLES = ("anime", "concept-art", "paintings", "photo")
_HPSV2_GET = ("the HPSv2 benchmark prompts are not shipped; get benchmark/{anime,concept-art,paintings,photo}.json "
              "from the Hugging Face dataset zhwang/HPDv2 (what hpsv2.benchmark_prompts() downloads)")


@dataclass(frozen=True)
class HPSv2Prompt:
    """One HPSv2 benchmark prompt. ``index`` is its 0-based position within its style; HPSv2 names
    images ``<style>/<index:05d>.jpg``."""

    style: str
    index: int
    prompt: str


def load_hpsv2(path: str | Path) -> BenchmarkItems[HPSv2Prompt]:
    """HPSv2 benchmark prompts, which the user supplies. ``path`` is either a folder holding the four
    ``<style>.json`` files (a missing one is an error) or one such file. Each file is a JSON list of
    prompt strings, and the style is the file stem. ``counts``: ``prompts`` and one entry per style."""
    path = Path(path)
    if path.is_dir():
        files = [path / f"{style}.json" for style in HPSV2_STYLES]
    elif path.is_file():
        files = [path]
    else:
        raise _missing(path, "HPSv2 benchmark prompts (a folder of <style>.json or one file)", _HPSV2_GET)
    items: list[HPSv2Prompt] = []
    counts: dict[str, int] = {}
    for file in files:
        file, text = _read_text(file, "HPSv2 benchmark prompt file", _HPSV2_GET)
        data = _parse_json(file, text)
        if not isinstance(data, list) or not data:
            raise DataError(f"{file}:1: expected a non-empty JSON list of prompt strings")
        for k, prompt in enumerate(data):
            if not isinstance(prompt, str) or not prompt.strip():
                raise DataError(f"{file}:1: entry {k} must be a non-empty string, got {prompt!r}")
            items.append(HPSv2Prompt(file.stem, k, prompt))
        counts[file.stem] = len(data)
    return BenchmarkItems(items, benchmark="hpsv2", source=path, counts={"prompts": len(items), **counts})


# ---------------------------------------------------------------------------------------------------- registry

#: Benchmark name -> loader. The loaders' required arguments: ``t2i_compbench`` a category,
#: ``dpg_bench`` the csv path, ``hpsv2`` the prompts path. The others default to the shipped files.
BENCHMARKS: dict[str, Callable[..., BenchmarkItems]] = {
    "geneval": load_geneval,
    "t2i_compbench": load_t2i_compbench,
    "dpg_bench": load_dpg_bench,
    "ocr": load_ocr_prompts,
    "partiprompts": load_partiprompts,
    "drawbench": load_drawbench,
    "charades_sta": load_charades_sta,
    "hpsv2": load_hpsv2,
}

#: What mmrl cannot ship, and where a user gets it.
USER_SUPPLIED: dict[str, str] = {
    "dpg_bench": _DPG_CSV_GET,
    "hpsv2": _HPSV2_GET,
    "refcoco": ("RefCOCO/+/g annotations are not shipped: VLM-R1's processed jsons are on Hugging Face "
                "(omlab/VLM-R1, rec_jsons_processed.zip), the originals from lichengunc/refer; images are COCO "
                "train2014 (cocodataset.org)"),
    "charades_sta": ("the Charades v1 videos are not shipped (AllenAI terms, non-commercial): "
                     "allenai.org/plato/charades, Charades_v1_480.zip"),
}


def benchmark_names() -> list[str]:
    """The names in :data:`BENCHMARKS`, in registry order."""
    return list(BENCHMARKS)
