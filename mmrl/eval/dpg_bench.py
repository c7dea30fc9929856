"""DPG-Bench (Dense Prompt Graph Benchmark, ELLA) in ``mmrl eval``: benchmark ``dpg_bench``.

    mmrl eval CONFIG benchmarks=[dpg_bench] dpg_csv=/path/to/dpg_bench.csv
                     [dpg_vqa_model=HUB_ID|DIR|mplug[:ID]] [official_quirks=false] [dpg_grids=false]

Data: the 1065 shipped prompt files (``assets/benchmarks/dpg_bench/prompts/``, checked against the digest mmrl pins,
:data:`PROMPTS_SHA256`) are what is generated; the questions and their dependency graph come from the user's copy of
``dpg_bench.csv`` (not shipped: :data:`mmrl.eval.benchmarks.USER_SUPPLIED`), read and checked by
:func:`mmrl.eval.benchmarks.load_dpg_bench` (a malformed row is a ``DataError`` naming ``file:line``). Whether the
csv is the official one (git blob ``98457fc...``) is recorded in the summary (``csv.official``).

Generation protocol (``shared/benchmarks/dpg_bench/SOURCE.md``): the official pipeline takes **4 images per prompt**
tiled into one 2x2 grid ``<item_id>.png`` (``dist_eval.sh``: ``--pic-num 4``; ``--resolution`` is one tile's size,
so the grid is 2R x 2R) and ``compute_dpg_one_sample()`` crops the tiles back with the boxes of
:func:`mmrl.eval.scoring.dpg_tile_boxes` (top-left, top-right, bottom-left, bottom-right) before asking the VQA
model anything. mmrl generates each image on its own (seed + k): **image k is tile k** of that order. The scorer
asks the questions of each image directly instead of pasting and re-cropping: pasting R x R tiles at those boxes
into a lossless PNG and cropping the same boxes gives back exactly the tiles' pixels (tested), so the VQA model
sees the same input either way. ``dpg_grids=true`` additionally writes the grids as the official script expects
them (``dpg_grids/<item_id>.png``, :func:`dpg_grid`), to run ``compute_dpg_bench.py`` itself on mmrl's images.
Seed, resolution, steps and guidance are not fixed upstream: mmrl uses Flow-GRPO's SD3.5-M evaluation settings.

Scoring (the rules are :mod:`mmrl.eval.scoring`'s, not rewritten here): each question of the prompt's graph is
asked of each tile; an answer scores 1 iff it is exactly ``'yes'`` (:func:`~mmrl.eval.scoring.dpg_answer_score`);
:func:`~mmrl.eval.scoring.dpg_gate` zeroes a question whose parent scored 0, in place, in csv order; the tile score
is the mean over the questions. One DPG "prompt score" belongs to the whole grid (mean over its 4 tiles), while an
mmrl row is one image: each row holds its own tile's numbers (``scores.dpg_tile`` gated, ``dpg_tile_ungated``) and
its verdict (every question, the answer, the judge's P(yes), the raw and gated score), and :meth:`DPGScorer.summarize`
regroups the rows by prompt (tiles ordered by ``image_index``) and computes the official per-prompt numbers with
:func:`~mmrl.eval.scoring.dpg_item_score` and the benchmark's with :func:`~mmrl.eval.scoring.dpg_bench_summary`:
``overall`` = 100 x the mean prompt score, L1 / L2 category scores, ``per_prompt``.

VQA model -- official and substitute:

* **official**: mPLUG-large (``damo/mplug_visual-question-answering_coco_large_en``) through ModelScope, which
  transformers does not carry. ``dpg_vqa_model=mplug`` (or ``mplug:<ModelScope id or folder>``) runs it when the
  ``modelscope`` package (and mPLUG's own dependencies) are installed: it answers in free text, and only an exact
  ``'yes'`` counts, as upstream.
* **default, a named substitute**: a Qwen-VL instruct model through transformers (:data:`DEFAULT_VQA`,
  ``Qwen/Qwen2.5-VL-7B-Instruct``; any hub id or folder of a Qwen2-VL / Qwen2.5-VL / newer Qwen-VL checkpoint), asked
  ``"<question> Answer yes or no."`` with :mod:`mmrl.rewards.vlm_judge`'s ``VLMJudge``; its answer is ``'yes'`` iff
  P(yes) > P(no) over the one-token yes/no variants (a greedy answer restricted to yes / no). Its numbers are
  DPG-Bench with another judge: comparable between mmrl runs with the same judge, not to published mPLUG numbers.

``official_quirks=true`` reproduces ``compute_dpg_bench.py``'s documented oddities so published numbers reproduce:
the csv's first data row is dropped (``prepare_dpg_data()``'s ``i == 0``), which leaves the first item's children
of that question without a parent, so the official scorer raises on that item and skips it (mmrl: the item's rows
are unjudged with that reason, ``num_failed`` 1); and the category breakdown uses the **ungated** scores of the
**last** tile only (``qid2scores_orig``; the last tile = the highest ``image_index``). ``false`` (default) keeps every
question and pools the gated scores of every tile into the categories. The overall score is the same rule in both.
"""
from __future__ import annotations

import functools
import hashlib
from collections import Counter
import math
import os
from pathlib import Path
from typing import Any, Sequence

from mmrl.eval.protocol import Defaults
from mmrl.eval.runner import BenchmarkSpec, EvalError, EvalItem, EvalOptions, Scorer

__all__ = ["EVAL_KEYS", "benchmark", "load_items", "defaults", "make_scorer", "main_keys", "DPGScorer", "dpg_grid",
           "DEFAULT_VQA", "OFFICIAL_VQA", "QUESTION_TEMPLATE", "PROMPTS_SHA256", "OFFICIAL_CSV_BLOB",
           "prompts_digest", "git_blob_id"]

#: This plug-in's eval keys (``official_quirks`` is shared with T2I-CompBench: the same meaning there).
EVAL_KEYS: dict[str, str] = {
    "dpg_csv": "DPG-Bench: path of your copy of dpg_bench.csv (questions + dependencies; not shipped: "
               "github.com/TencentQQGYLab/ELLA dpg_bench/dpg_bench.csv)",
    "dpg_vqa_model": "DPG-Bench VQA model: hub id or folder of a Qwen-VL instruct model (default "
                     "Qwen/Qwen2.5-VL-7B-Instruct, a substitute for the official mPLUG-large), or mplug[:ID] for "
                     "the official mPLUG through ModelScope",
    "dpg_grids": "DPG-Bench: also write each prompt's 2x2 grid as dpg_grids/<item_id>.png, the input of the official "
                 "compute_dpg_bench.py (default false)",
    "official_quirks": "reproduce the official scoring scripts' known quirks (DPG-Bench, T2I-CompBench) so published "
                       "numbers reproduce (default false: the rules as documented)",
}

#: The substitute VQA judge (mmrl.rewards.vlm_judge.DEFAULT_JUDGE).
DEFAULT_VQA = "Qwen/Qwen2.5-VL-7B-Instruct"
#: The official VQA model (ModelScope id; ``compute_dpg_bench.py`` class ``MPLUG``).
OFFICIAL_VQA = "damo/mplug_visual-question-answering_coco_large_en"
#: What the Qwen-VL substitute is asked (``{prompt}`` is the DPG question).
QUESTION_TEMPLATE = "{prompt} Answer yes or no."
#: Images per forward of the Qwen-VL judge.
JUDGE_BATCH_SIZE = 8
#: :func:`prompts_digest` of the shipped ``assets/benchmarks/dpg_bench/prompts/`` (1065 files, ELLA 3c228f1).
PROMPTS_SHA256 = "c9c75784dc4dbc8442fd749fdae3b425f55e659a6277fa090611d47912d48fb5"
#: git blob id of the official ``dpg_bench/dpg_bench.csv`` (SOURCE.md).
OFFICIAL_CSV_BLOB = "98457fc9901943f51ff9a30367250fc292533bed"

_NAME = "dpg_bench"
_SOURCE = ("DPG-Bench (TencentQQGYLab/ELLA 3c228f1, dpg_bench/README.md + dist_eval.sh): 4 images per prompt tiled "
           "into one 2x2 grid (compute_dpg_bench.py --pic-num 4; --resolution = one tile), image k = tile k "
           "(top-left, top-right, bottom-left, bottom-right); upstream fixes no seed, resolution or sampler: base "
           "seed 42, 512 px tiles, 40 steps, CFG 4.5 = Flow-GRPO's SD3.5-M evaluation settings (yifan123/flow_grpo "
           "config/grpo.py, config/base.py)")


# --------------------------------------------------------------------------------------------------- keys / data


def _bool(options: EvalOptions, key: str, default: bool) -> bool:
    value = options.extra.get(key, default)
    if not isinstance(value, bool):
        raise EvalError(f"{key}={value!r}: expected true or false")
    return value


def _text(options: EvalOptions, key: str) -> str | None:
    value = options.extra.get(key)
    if value is None:
        return None
    if isinstance(value, (dict, list, bool)) or str(value).strip() == "":
        raise EvalError(f"{key}={value!r}: expected a path or name")
    return str(value).strip()


def _csv_path(options: EvalOptions) -> Path:
    from mmrl.eval.benchmarks import USER_SUPPLIED

    value = _text(options, "dpg_csv")
    if value is None:
        raise EvalError(f"benchmark dpg_bench needs dpg_csv=PATH, your copy of the questions file: "
                        f"{USER_SUPPLIED['dpg_bench']}")
    return Path(value).expanduser()


def _vqa_model(options: EvalOptions) -> str:
    value = _text(options, "dpg_vqa_model") or DEFAULT_VQA
    if value == "mplug" or value.startswith("mplug:"):
        if value.startswith("mplug:") and not value[len("mplug:"):].strip():
            raise EvalError("dpg_vqa_model=mplug: expected mplug or mplug:<ModelScope id or folder>")
        return value
    local = value.startswith(("/", ".", "~")) or os.path.exists(os.path.expanduser(value))
    if local and not os.path.isdir(os.path.expanduser(value)):
        raise EvalError(f"dpg_vqa_model={value}: no such folder (a hub id or folder of a Qwen-VL instruct model, "
                        f"e.g. {DEFAULT_VQA}, or mplug for the official mPLUG through ModelScope)")
    return os.path.expanduser(value) if local else value


def prompts_digest(directory: str | Path) -> str:
    """sha256 over the sorted ``*.txt`` files of a folder: ``"<name>\\0<sha256 of its bytes>\\n"`` each."""
    digest = hashlib.sha256()
    for file in sorted(Path(directory).glob("*.txt")):
        digest.update(f"{file.name}\0{hashlib.sha256(file.read_bytes()).hexdigest()}\n".encode())
    return digest.hexdigest()


def git_blob_id(path: str | Path) -> str:
    """``git hash-object PATH``: sha1 of ``"blob <size>\\0"`` + the bytes."""
    data = Path(path).read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@functools.lru_cache(maxsize=1)
def _checked_prompts() -> Path:
    """The shipped prompts folder, refused unless it is the pinned version."""
    from mmrl.data.prompts import DataError
    from mmrl.eval.benchmarks import assets_dir

    directory = assets_dir() / "dpg_bench" / "prompts"
    if not directory.is_dir():
        raise DataError(f"DPG-Bench prompts folder not found: {directory} (the DPG-Bench prompts ship in "
                        f"assets/benchmarks/dpg_bench/prompts/)")
    sha = prompts_digest(directory)
    if sha != PROMPTS_SHA256:
        raise DataError(f"{directory}: not the version of the DPG-Bench prompts mmrl pins (digest {sha[:16]}..., "
                        f"expected {PROMPTS_SHA256[:16]}...): restore the shipped files "
                        f"(assets/benchmarks/dpg_bench/prompts/)")
    return directory


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, quirks: bool, mtime_ns: int, size: int):
    from mmrl.eval.benchmarks import load_dpg_bench

    return load_dpg_bench(path, _checked_prompts(), official_quirks=quirks)


def _load(csv: Path, quirks: bool):
    """:func:`~mmrl.eval.benchmarks.load_dpg_bench` on the user's csv and the shipped prompts (cached per file
    version)."""
    from mmrl.eval.benchmarks import load_dpg_bench

    if not csv.is_file():  # the loader's own error: the path and where to get the file
        return load_dpg_bench(csv, False, official_quirks=quirks)
    stat = csv.stat()
    return _load_cached(str(csv.resolve()), quirks, stat.st_mtime_ns, stat.st_size)


# --------------------------------------------------------------------------------------------------- plug-in API


def benchmark(name: str, options: EvalOptions) -> BenchmarkSpec:
    """Check ``dpg_bench`` and its keys; read and check the csv (no model is built)."""
    if name != _NAME:
        raise EvalError(f"benchmark {name!r}: DPG-Bench has no variants or prompt sets; use dpg_bench")
    csv = _csv_path(options)
    quirks = _bool(options, "official_quirks", False)
    _bool(options, "dpg_grids", False)
    _vqa_model(options)
    _load(csv, quirks)  # a malformed csv: DataError naming file:line
    return BenchmarkSpec(_NAME, _NAME, _NAME)


def load_items(spec: BenchmarkSpec, options: EvalOptions) -> tuple[list[EvalItem], Path, str | None]:
    """One :class:`EvalItem` per csv item (csv order), prompted with its shipped prompt file; the file read is the
    user's csv (no pinned sha256: the shipped prompts are checked against :data:`PROMPTS_SHA256` instead)."""
    csv = _csv_path(options)
    loaded = _load(csv, _bool(options, "official_quirks", False))
    items = [EvalItem(i, item.prompt, {"item_id": item.item_id, "num_questions": len(item.questions)})
             for i, item in enumerate(loaded)]
    return items, csv, None


def defaults(spec: BenchmarkSpec) -> Defaults:
    return Defaults(4, 42, 512, 40, 4.5, _SOURCE)


def make_scorer(spec: BenchmarkSpec, options: EvalOptions) -> "DPGScorer":
    return DPGScorer(_csv_path(options), _vqa_model(options), _bool(options, "official_quirks", False),
                     _bool(options, "dpg_grids", False))


def main_keys(spec: BenchmarkSpec) -> list[str]:
    return ["dpg_tile"]


# --------------------------------------------------------------------------------------------------- grids


def dpg_grid(images: Sequence[Any]):
    """The official input image of one prompt: its tiles (image k = tile k, all R x R) pasted at
    :func:`~mmrl.eval.scoring.dpg_tile_boxes` into one canvas (2R x 2R for 3-4 tiles; 2R x R for 2; the image
    itself for 1), so that ``compute_dpg_one_sample()``'s crops give back exactly the tiles."""
    from PIL import Image

    from mmrl.eval.scoring import dpg_tile_boxes

    if not images:
        raise ValueError("a DPG grid needs at least one tile")
    tiles = [im.convert("RGB") for im in images]
    r = tiles[0].size[0]
    if any(t.size != (r, r) for t in tiles):
        raise ValueError(f"DPG tiles must all be square and the same size, got {[t.size for t in tiles]}")
    n = len(tiles)
    canvas = Image.new("RGB", (2 * r if n >= 2 else r, 2 * r if n >= 3 else r))
    for tile, box in zip(tiles, dpg_tile_boxes(r, n)):
        canvas.paste(tile, box[:2])
    return canvas


# --------------------------------------------------------------------------------------------------- judges


class _QwenJudge:
    """The substitute: a Qwen-VL instruct model through :class:`mmrl.rewards.vlm_judge.VLMJudge`."""

    def __init__(self, model: str):
        from mmrl.rewards.vlm_judge import VLMJudge

        self.judge = VLMJudge(model, template=QUESTION_TEMPLATE, batch_size=JUDGE_BATCH_SIZE)

    def ask(self, images: list, questions: list[str]) -> list[tuple[str | None, float | None, str | None]]:
        """``(answer 'yes'/'no' or None, P(yes) or None, reason or None)`` per (image, question) pair."""
        out = self.judge(list(images), list(questions))
        probs = out[self.judge.name].tolist()
        reasons = self.judge.last_info.get("nan_samples", {})
        results = []
        for i, p in enumerate(probs):
            if p is None or not math.isfinite(p):
                results.append((None, None, reasons.get(i, "the VQA judge gave no answer")))
            else:
                results.append(("yes" if p > 0.5 else "no", float(p), None))
        return results


class _MPLUGJudge:
    """The official VQA model: mPLUG-large through ModelScope's visual-question-answering pipeline, as
    ``compute_dpg_bench.py``'s ``MPLUG`` class calls it (one image, one question; the answer string)."""

    def __init__(self, checkpoint: str):
        import torch

        try:
            from modelscope.pipelines import pipeline
            from modelscope.utils.constant import Tasks
        except ImportError as exc:
            raise EvalError(f"dpg_vqa_model=mplug needs ModelScope and mPLUG's dependencies (pip install modelscope; "
                            f"{exc}); or leave dpg_vqa_model unset for the Qwen-VL substitute") from None
        device = "gpu" if torch.cuda.is_available() else "cpu"
        self.pipeline = pipeline(Tasks.visual_question_answering, model=checkpoint, device=device)

    def ask(self, images: list, questions: list[str]) -> list[tuple[str | None, float | None, str | None]]:
        results = []
        for image, question in zip(images, questions):
            try:
                answer = self.pipeline({"image": image, "question": question})["text"]
            except Exception as exc:  # one failing question: that answer is missing, with the reason
                results.append((None, None, f"mPLUG failed: {type(exc).__name__}: {exc}"))
                continue
            results.append((str(answer), None, None))
        return results


def _build_judge(vqa_model: str):
    """The VQA judge of ``dpg_vqa_model`` (an object with ``ask(images, questions)``)."""
    if vqa_model == "mplug" or vqa_model.startswith("mplug:"):
        return _MPLUGJudge(vqa_model[len("mplug:"):].strip() if vqa_model.startswith("mplug:") else OFFICIAL_VQA)
    return _QwenJudge(vqa_model)


# --------------------------------------------------------------------------------------------------- scorer


def _version(package: str) -> str:
    from mmrl.eval.runner import _version as version

    return version(package)


class DPGScorer(Scorer):
    """DPG-Bench: each tile's questions asked of a VQA judge, :mod:`mmrl.eval.scoring`'s official rules (see the
    module docstring). The official scorer is ELLA's ``compute_dpg_bench.py`` with mPLUG-large
    (``dpg_vqa_model=mplug``); the default Qwen-VL judge is a named substitute (``settings["vqa_role"]``)."""

    name = "dpg_bench"
    headline = "overall"
    sample_score = "dpg_tile"

    def __init__(self, csv: Path, vqa_model: str, official_quirks: bool, write_grids: bool = False):
        from mmrl.eval.runner import _mmrl_version

        self.csv = Path(csv)
        self.vqa_model = vqa_model
        self.official_quirks = bool(official_quirks)
        self.write_grids = bool(write_grids)  # not a scoring setting: not in the protocol
        self.mplug = vqa_model == "mplug" or vqa_model.startswith("mplug:")
        loaded = _load(self.csv, self.official_quirks)
        self.counts = dict(loaded.counts)
        self.by_id = {item.item_id: item for item in loaded}
        if self.mplug:
            checkpoint = vqa_model[len("mplug:"):].strip() if vqa_model.startswith("mplug:") else OFFICIAL_VQA
            role = f"official: mPLUG-large ({checkpoint}) through ModelScope, as compute_dpg_bench.py"
            answer_rule = "the pipeline's answer text; 1 iff exactly 'yes' (compute_dpg_bench.py)"
            judge = {"vqa_model": checkpoint, "vqa_backend": "modelscope visual-question-answering pipeline"}
            self.version = f"mmrl {_mmrl_version()}, modelscope {_version('modelscope')}"
        else:
            role = (f"substitute: a Qwen-VL instruct model through transformers (mmrl.rewards.vlm_judge.VLMJudge) in "
                    f"place of the official mPLUG-large ({OFFICIAL_VQA}, ModelScope, not in transformers); numbers "
                    f"are not comparable to published mPLUG ones")
            answer_rule = ("'yes' iff P(yes) > P(no) over the single-token yes/no variants (a greedy answer restricted "
                           "to yes/no), then 1 iff exactly 'yes' (compute_dpg_bench.py)")
            judge = {"vqa_model": vqa_model, "vqa_backend": "transformers AutoModelForImageTextToText",
                     "question_template": QUESTION_TEMPLATE, "judge_dtype": "bfloat16 on CUDA, float32 on CPU",
                     "judge_batch_size": JUDGE_BATCH_SIZE, "judge_pixels": "the processor's default min/max_pixels"}
            self.version = f"mmrl {_mmrl_version()}, transformers {_version('transformers')}"
        self.settings = {
            **judge,
            "vqa_role": role,
            "answer_rule": answer_rule,
            "official_quirks": self.official_quirks,
            "tiles": "image k of a prompt = tile k of the official 2x2 grid (dpg_tile_boxes order: top-left, "
                     "top-right, bottom-left, bottom-right), each asked directly (the same pixels as cropping the "
                     "lossless grid)",
            "prompts_sha256": PROMPTS_SHA256,
            "rules": "mmrl.eval.scoring dpg_answer_score, dpg_gate, dpg_item_score, dpg_bench_summary "
                     "(TencentQQGYLab/ELLA dpg_bench/compute_dpg_bench.py)",
            "official_scorer": f"TencentQQGYLab/ELLA dpg_bench/compute_dpg_bench.py with mPLUG-large ({OFFICIAL_VQA})",
        }
        self.defaults = {"vqa_model": DEFAULT_VQA, "official_quirks": False}
        self.judge = None

    def build(self) -> None:
        from mmrl.rewards import MissingWeightsError

        try:
            self.judge = _build_judge(self.vqa_model)
        except MissingWeightsError as exc:  # its advice names the reward's argument: name the eval key
            message = str(exc).replace("pass model=", "set dpg_vqa_model=")
            hint = "" if "dpg_vqa_model=" in message else " (set dpg_vqa_model=<hub id or folder>)"
            raise EvalError(f"benchmark dpg_bench: {message}{hint}") from None
        except (OSError, ValueError) as exc:
            raise EvalError(f"benchmark dpg_bench: cannot load the VQA model {self.vqa_model!r}: "
                            f"{type(exc).__name__}: {exc} (set dpg_vqa_model=...)") from None

    # ---- one prompt's images

    def _item(self, item: EvalItem):
        return self.by_id[item.metadata["item_id"]]

    def score(self, images: list, item: EvalItem) -> list[dict]:
        from mmrl.eval.scoring import dpg_answer_score, dpg_gate, dpg_item_score

        dpg = self._item(item)
        n = len(images)
        if self.official_quirks and dpg.official_fails:  # the official scorer raises on this item: skip the judge
            reason = (f"official_quirks: item {dpg.item_id!r} depends on proposition(s) {list(dpg.missing_parents)}, "
                      f"which the official scorer dropped (the csv's first row); it raises KeyError and skips the "
                      f"image")
            return [{"scores": {"dpg_tile": None, "dpg_tile_ungated": None},
                     "verdict": {"item_id": dpg.item_id, "questions": None}, "reason": reason}] * n
        questions = list(dpg.questions)
        try:
            answers = self.judge.ask([im for im in images for _ in questions], [q.question for _ in images
                                                                                 for q in questions])
            if len(answers) != n * len(questions):
                raise RuntimeError(f"the judge gave {len(answers)} answers for {n * len(questions)} questions")
        except Exception as exc:  # the judge failing on this prompt: every image unjudged, with the reason
            reason = f"VQA judge failed: {type(exc).__name__}: {exc}"
            return [{"scores": {"dpg_tile": None, "dpg_tile_ungated": None},
                     "verdict": {"item_id": dpg.item_id, "questions": None}, "reason": reason}] * n
        rows = []
        for t in range(n):
            mine = answers[t * len(questions):(t + 1) * len(questions)]
            raw = {q.proposition_id: dpg_answer_score(a) for q, (a, _, _) in zip(questions, mine)}
            result = dpg_item_score(dpg, [{q.proposition_id: a for q, (a, _, _) in zip(questions, mine)}],
                                    official_quirks=self.official_quirks)
            judged = not (result["failed"] or result["unjudged"])
            gated = dpg_gate(raw, {q.proposition_id: list(q.dependency) for q in questions}) if judged else {}
            verdict = {"item_id": dpg.item_id, "questions": [
                {"id": q.proposition_id, "question": q.question, "dependency": list(q.dependency),
                 "category": q.category, "answer": a, "p_yes": p,
                 "score": None if math.isnan(raw[q.proposition_id]) else raw[q.proposition_id],
                 "gated": gated.get(q.proposition_id)}
                for q, (a, p, _) in zip(questions, mine)]}
            why = [f"proposition {q.proposition_id}: {r}" for q, (_, _, r) in zip(questions, mine) if r]
            reason = None
            if not judged:
                reason = "; ".join([result["failed"] or result["unjudged"]] + why[:3])
            ungated = sum(raw.values()) / len(raw) if judged else None
            rows.append({"scores": {"dpg_tile": result["tile_scores"][0] if judged else None,
                                    "dpg_tile_ungated": ungated},
                         "verdict": verdict, "reason": reason})
        return rows

    # ---- the benchmark

    def prompt_results(self, rows: list[dict], items: list[EvalItem]) -> list[dict]:
        """:func:`~mmrl.eval.scoring.dpg_item_score` of every prompt that has rows: its tiles are its rows in
        ``image_index`` order (the last one is the official "last tile"); the answers come from the verdicts."""
        from mmrl.eval.scoring import dpg_item_score

        by_prompt: dict[int, list[dict]] = {}
        for row in rows:
            by_prompt.setdefault(int(row["prompt_index"]), []).append(row)
        results = []
        for item in items:
            tiles = sorted(by_prompt.get(item.index, []), key=lambda r: int(r["image_index"]))
            if not tiles:
                continue
            dpg = self._item(item)
            if self.official_quirks and dpg.official_fails:
                results.append({"item_id": dpg.item_id, "score": math.nan, "tile_scores": [], "question_scores": {},
                                "categories": {}, "unjudged": None,
                                "failed": tiles[0].get("reason") or "the official scorer skips this item"})
                continue
            tile_answers = []
            for row in tiles:
                verdict = row.get("verdict") or {}
                tile_answers.append({int(q["id"]): q["answer"] for q in verdict.get("questions") or []})
            results.append(dpg_item_score(dpg, tile_answers, official_quirks=self.official_quirks))
        return results

    def summarize(self, rows: list[dict], items: list[EvalItem], out: Path) -> dict:
        from mmrl.eval.scoring import dpg_bench_summary

        results = self.prompt_results(rows, items)
        summary = dpg_bench_summary(results, official_quirks=self.official_quirks)
        per_prompt = Counter(int(r["prompt_index"]) for r in rows)
        tiles = sorted(set(per_prompt.values()))
        metrics: dict[str, Any] = {"overall": summary.pop("score"), **summary}
        metrics["num_prompts"] = metrics.pop("num_items")
        metrics["tiles_per_prompt"] = tiles[0] if len(tiles) == 1 else tiles  # the official grid: 4
        metrics["per_prompt"] = {r["item_id"]: {"score": r["score"], "tile_scores": r["tile_scores"]}
                                 for r in results if not (r.get("failed") or r.get("unjudged"))}
        metrics["not_scored"] = {r["item_id"]: r.get("failed") or r.get("unjudged")
                                 for r in results if r.get("failed") or r.get("unjudged")}
        blob = git_blob_id(self.csv) if self.csv.is_file() else None
        metrics["csv"] = {"path": str(self.csv), "git_blob": blob, "official": blob == OFFICIAL_CSV_BLOB}
        metrics["data"] = self.counts
        metrics["vqa_model"] = self.settings["vqa_model"]
        metrics["vqa_role"] = "official" if self.mplug else "substitute"
        if self.write_grids:
            metrics["grids"] = self._write_grids(rows, items, out)
        return metrics

    def _write_grids(self, rows: list[dict], items: list[EvalItem], out: Path) -> str:
        """``dpg_grids/<item_id>.png`` for every prompt whose images are all there (written atomically)."""
        from PIL import Image

        folder = out / "dpg_grids"
        folder.mkdir(parents=True, exist_ok=True)
        by_prompt: dict[int, list[dict]] = {}
        for row in rows:
            by_prompt.setdefault(int(row["prompt_index"]), []).append(row)
        for item in items:
            tiles = sorted(by_prompt.get(item.index, []), key=lambda r: int(r["image_index"]))
            paths = [out / r["image"] for r in tiles]
            if not paths or len(paths) > 4 or not all(p.is_file() for p in paths):
                continue
            images = []
            for path in paths:
                with Image.open(path) as handle:
                    images.append(handle.convert("RGB"))
            target = folder / f"{self._item(item).item_id}.png"
            tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
            dpg_grid(images).save(tmp, format="PNG")
            os.replace(tmp, target)
        return str(folder.relative_to(out))
