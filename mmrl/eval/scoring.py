"""The official scoring rules of the benchmarks ``mmrl eval`` runs, as pure functions (no model, no I/O).

The models (detectors, VQA judges, OCR engines, policies) produce per-sample raw outputs elsewhere;
this module turns them into the benchmark numbers exactly as each benchmark's official script does,
and names the script and function each rule comes from. The per-image GenEval rules, box IoU /
matching and temporal IoU, and the OCR edit-distance score are NOT rewritten here: they are
mmrl's reward code (:mod:`mmrl.rewards.geneval`, :mod:`mmrl.rewards.grounding`,
:mod:`mmrl.rewards.ocr`), reused.

Three outcomes per sample, everywhere (the mmrl contract, :mod:`mmrl.rewards._text`):

* **judged**: a number;
* **unparseable** (the model's fault: no box, no span, no letter, no number in its answer), given
  as ``None`` for the prediction: it scores **0** and stays in the denominator (counted as
  ``num_unparseable``), never dropped. This is what the official grounding evaluations do: VLM-R1's
  ``test_rec_r1.py`` turns an unreadable answer into the box ``[0, 0, 0, 0]`` (IoU 0, wrong, divided
  by ``len(data)``); TimeZero's ``evaluate.py`` appends IoU 0 for an unparsed span;
* **unjudged** (the data's or a scorer's fault: a NaN score, a missing ground truth, a judge that
  failed): excluded from the mean and counted as ``num_unjudged``. The official scripts have no such
  case except by crashing or skipping (DPG-Bench's ``main()`` skips an image whose scoring raises);
  mmrl records it instead.

Benchmarks and official sources (files read at the commits named in
``shared/benchmarks/<name>/SOURCE.md``):

* GenEval: djghosh13/geneval ``evaluation/summary_scores.py`` (:func:`geneval_scores`);
* DPG-Bench: TencentQQGYLab/ELLA ``dpg_bench/compute_dpg_bench.py`` (:func:`dpg_item_score`,
  :func:`dpg_bench_summary`);
* T2I-CompBench: Karine-Huang/T2I-CompBench ``BLIPvqa_eval/BLIP_vqa.py`` and
  ``BLIPvqa_eval/models/blip_vqa.py`` (BLIP-VQA), ``UniDet_eval/2D_spatial_eval.py`` (spatial),
  ``CLIPScore_eval/CLIP_similarity.py`` (non-spatial), ``3_in_1_eval/3_in_1.py`` (complex);
* OCR: yifan123/flow_grpo ``flow_grpo/ocr.py`` ``OcrScorer.__call__``;
* RefCOCO-style REC: om-ai-lab/VLM-R1 ``src/eval/test_rec_r1.py``;
* Charades-STA: microsoft/2D-TAN ``lib/core/eval.py`` ``eval()`` and ``lib/datasets/charades.py``,
  www-Ye/TimeZero ``evaluate.py`` ``process_work_items()``.

``official_quirks`` (DPG-Bench, T2I-CompBench): ``True`` reproduces the official scripts' known
oddities so published numbers reproduce; ``False`` (default) is the rule as documented. Each
function says what the flag changes.
"""
from __future__ import annotations

import json
import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from mmrl.rewards.geneval import geneval_summary
from mmrl.rewards.grounding import box_f1, box_iou, temporal_iou, vlm_r1_iou
from mmrl.rewards.ocr import extract_target, ocr_score

__all__ = [
    # common
    "mean_with_count",
    "accuracy_mean",
    # GenEval
    "geneval_scores",
    # DPG-Bench
    "DPG_PIC_NUM",
    "dpg_tile_boxes",
    "dpg_answer_score",
    "dpg_category",
    "dpg_l1_category",
    "dpg_gate",
    "dpg_item_score",
    "dpg_bench_summary",
    # T2I-CompBench
    "T2I_COMPBENCH_METRICS",
    "T2I_SPATIAL_WORDS",
    "T2I_PERSON_WORDS",
    "blip_vqa_image_score",
    "t2i_spatial_locality",
    "t2i_position_score",
    "t2i_spatial_image_score",
    "t2i_complex_key",
    "t2i_complex_kind",
    "t2i_complex_image_score",
    "t2i_category_score",
    "t2i_compbench_summary",
    # OCR
    "ocr_target",
    "ocr_accuracy",
    "ocr_benchmark",
    # grounding / VLM
    "rec_scores",
    "multi_object_f1",
    "charades_sta_scores",
    "choice_accuracy",
    "numeric_accuracy",
    # blind control
    "paired_difference",
    "blind_control",
]

NAN = float("nan")


# --------------------------------------------------------------------------------------------
# Common
# --------------------------------------------------------------------------------------------


def _is_nan(x: Any) -> bool:
    """True for None, NaN and values that are not numbers."""
    if x is None or isinstance(x, bool):
        return x is None
    try:
        return math.isnan(float(x))
    except (TypeError, ValueError):
        return True


def mean_with_count(values: Iterable[Any]) -> dict[str, Any]:
    """Mean of the judged values: ``{"mean", "n", "num_unjudged"}``.

    ``None`` and NaN are unjudged: left out of the mean and counted. ``mean`` is NaN when nothing was
    judged. Booleans count as 0/1.
    """
    judged: list[float] = []
    unjudged = 0
    for v in values:
        if _is_nan(v):
            unjudged += 1
        else:
            judged.append(float(v))
    return {"mean": float(np.mean(judged)) if judged else NAN, "n": len(judged), "num_unjudged": unjudged}


def accuracy_mean(scores: Iterable[Any]) -> dict[str, Any]:
    """Mean of per-sample scores where ``None`` = unparseable (scores 0, kept) and NaN = unjudged (dropped).

    Returns ``{"accuracy", "n", "num_unparseable", "num_unjudged"}`` (``n`` counts the samples in the
    denominator, the unparseable ones included).
    """
    kept: list[float] = []
    unparseable = unjudged = 0
    for s in scores:
        if s is None:
            unparseable += 1
            kept.append(0.0)
        elif _is_nan(s):
            unjudged += 1
        else:
            kept.append(float(s))
    return {
        "accuracy": float(np.mean(kept)) if kept else NAN,
        "n": len(kept),
        "num_unparseable": unparseable,
        "num_unjudged": unjudged,
    }


def _field(record: Any, name: str, default: Any = None) -> Any:
    """``record[name]`` for a mapping, ``record.name`` for an object (a dataclass, a pandas row)."""
    if isinstance(record, Mapping):
        return record.get(name, default)
    return getattr(record, name, default)


# --------------------------------------------------------------------------------------------
# GenEval (djghosh13/geneval evaluation/summary_scores.py)
# --------------------------------------------------------------------------------------------


def _prompt_key(row: Mapping) -> str | None:
    meta = row.get("metadata")
    if isinstance(meta, str):
        return meta
    if isinstance(meta, Mapping):
        return json.dumps(meta, sort_keys=True)
    prompt = row.get("prompt")
    return None if prompt is None else str(prompt)


def geneval_scores(results: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """GenEval's benchmark numbers from per-image verdicts, as ``evaluation/summary_scores.py`` computes them.

    ``results``: one mapping per image with ``tag`` and ``correct`` (bool, 0/1, or None/NaN for an
    image that could not be judged) and, for the prompt-level line, ``metadata`` (the prompt's
    metadata dict or its JSON string, what ``evaluate_images.py`` writes) or ``prompt``.

    The official script (read at djghosh13/geneval ``d927da8``):

    * ``task score`` = ``df.groupby('tag', sort=False)['correct'].mean()``: the mean over the tag's
      **images** (no averaging per prompt first; with 4 images per prompt the weights are the same);
      tags in order of first appearance;
    * ``Overall score (avg. over tasks)`` = ``np.mean(task_scores)`` over the tags **present** in the
      results: a missing tag is simply not averaged (no penalty, no error). mmrl keeps that and lists
      the absent ones of the six in ``missing_tags`` so a partial run is visible;
    * ``% correct images`` = mean over all images (``image_accuracy``); ``% correct prompts`` =
      ``groupby('metadata')['correct'].any().mean()`` (``prompt_accuracy``: a prompt counts if any of
      its images is correct).

    Unjudged images: the official script never has one (every image gets a bool); pandas' ``mean`` and
    ``any`` skip NaN, so mmrl leaves them out of every mean and counts them (``num_unjudged``); a
    prompt none of whose images was judged is left out of ``prompt_accuracy``.

    The per-tag and overall numbers come from :func:`mmrl.rewards.geneval.geneval_summary` (keys
    ``overall``, ``per_tag``, ``counts``, ``image_accuracy``, ``missing_tags``, ``num_unjudged``);
    added here: ``prompt_accuracy``, ``num_prompts``, ``num_images``.
    """
    rows = list(results)
    tags = [str(r["tag"]) for r in rows]
    correct = [NAN if _is_nan(r.get("correct")) else float(r["correct"]) for r in rows]
    out = geneval_summary(tags, correct)
    by_prompt: dict[str, list[float]] = {}
    keyed = True
    for r, c in zip(rows, correct):
        key = _prompt_key(r)
        if key is None:
            keyed = False
            break
        if not math.isnan(c):
            by_prompt.setdefault(key, []).append(c)
    if keyed and by_prompt:
        out["prompt_accuracy"] = float(np.mean([float(any(v > 0 for v in vals)) for vals in by_prompt.values()]))
        out["num_prompts"] = len(by_prompt)
    else:
        out["prompt_accuracy"] = NAN
        out["num_prompts"] = 0
    out["num_images"] = len(rows)
    return out


# --------------------------------------------------------------------------------------------
# DPG-Bench (TencentQQGYLab/ELLA dpg_bench/compute_dpg_bench.py)
# --------------------------------------------------------------------------------------------

#: ``dist_eval.sh`` runs ``compute_dpg_bench.py --pic-num 4``: four images per prompt in one 2x2 grid.
DPG_PIC_NUM = 4


def dpg_tile_boxes(resolution: int, pic_num: int = DPG_PIC_NUM) -> list[tuple[int, int, int, int]]:
    """The crop boxes ``(left, upper, right, lower)`` of the grid's tiles, in the official order.

    ``compute_dpg_one_sample()``: ``(0,0,R,R)``, ``(R,0,2R,R)``, ``(0,R,R,2R)``, ``(R,R,2R,2R)``
    (top-left, top-right, bottom-left, bottom-right), the first ``pic_num`` of them; ``R`` is the
    ``--resolution`` argument, the size of one tile.
    """
    r = int(resolution)
    if r <= 0:
        raise ValueError(f"resolution must be a positive tile size, got {resolution!r}")
    if not 1 <= pic_num <= 4:
        raise ValueError(f"pic_num must be 1..4 tiles, got {pic_num!r}")
    boxes = [(0, 0, r, r), (r, 0, 2 * r, r), (0, r, r, 2 * r), (r, r, 2 * r, 2 * r)]
    return boxes[:pic_num]


def dpg_answer_score(answer: Any, exact: bool = True) -> float:
    """One VQA answer as a score: 1.0 for yes, 0.0 for anything else, NaN when there is no answer.

    Official: ``float(answer == 'yes')`` on mPLUG's answer string (case-sensitive, so ``"Yes"``
    is 0). ``exact=False`` normalises first (strip, lower case, trailing ``.``/``!`` removed), for a
    judge that writes ``"Yes."``. A bool or a number in [0, 1] is taken as the score already; ``None``
    / NaN (the judge failed) is NaN.
    """
    if answer is None:
        return NAN
    if isinstance(answer, bool):
        return float(answer)
    if isinstance(answer, (int, float, np.integer, np.floating)):
        return NAN if math.isnan(float(answer)) else float(answer)
    if not isinstance(answer, str):
        raise TypeError(f"a DPG answer must be a string, bool or number, got {type(answer).__name__}")
    if not exact:
        answer = answer.strip().lower().rstrip(".!").strip()
    return float(answer == "yes")


def dpg_category(tuple_text: str) -> str:
    """The L2 category of a question: its ``tuple`` column before the first ``(``, stripped
    (``main()``: ``qid2tuple[qid].split('(')[0].strip()``, e.g. ``"entity - whole"``)."""
    return str(tuple_text).split("(")[0].strip()


def dpg_l1_category(category: str) -> str:
    """The L1 category of an L2 one: before the first ``-`` (``main()``: ``category.split('-')[0].strip()``)."""
    return str(category).split("-")[0].strip()


def _dependency_list(dep: Any) -> list[int]:
    if isinstance(dep, str):
        return [int(d.strip()) for d in dep.split(",")]
    if isinstance(dep, (int, np.integer)):
        return [int(dep)]
    if dep is None:
        return [0]
    return [int(d) for d in dep]


def dpg_gate(scores: Mapping[int, float], dependencies: Mapping[int, Sequence[int]]) -> dict[int, float]:
    """The official dependency gating of one tile's scores (``compute_dpg_one_sample()``).

    Questions are visited in ``dependencies``' order (the CSV's row order); a question whose parents
    (``0`` = no parent) include one with score 0 is set to 0, **in place**, so a zero propagates down
    a chain in question order (a parent later in the order is read before it is gated). Returns a new
    dict ``{qid: gated score}``. A parent id that is not one of the item's questions raises
    :class:`KeyError` (the official script raises too; see :func:`dpg_item_score`).
    """
    gated = dict(scores)
    for qid, parents in dependencies.items():
        for parent in parents:
            if parent == 0:
                continue
            if parent not in gated:
                raise KeyError(parent)
            if gated[parent] == 0:
                gated[qid] = 0.0
                break
    return gated


def dpg_item_score(
    questions: Sequence[Any],
    tile_answers: Sequence[Mapping[int, Any] | Sequence[Any]],
    official_quirks: bool = False,
    exact_answers: bool = True,
) -> dict[str, Any]:
    """Score one DPG-Bench prompt (one 2x2 grid image) from its tiles' VQA answers.

    ``questions``: the item's rows of ``dpg_bench.csv`` in file order, mappings or objects with
    ``proposition_id``, ``dependency`` (``"0"``, ``"1,2"`` or a list of ints) and ``tuple`` (the
    category source; also read as ``tuple_``, else ``category``), optionally ``item_id``; or an item
    object with ``item_id`` and ``questions`` (:class:`mmrl.eval.benchmarks.DPGItem`).
    ``tile_answers``: one entry per tile (official order, :func:`dpg_tile_boxes`), each a mapping
    ``{proposition_id: answer}`` or a sequence aligned with ``questions``; answers as
    :func:`dpg_answer_score` takes them.

    Official rule (``compute_dpg_one_sample()``): per tile, each question scores 1 iff the answer is
    ``'yes'``; :func:`dpg_gate` zeroes children of a "no"; the tile score is the mean over the item's
    questions; the item score is the mean over the tiles. :func:`dpg_bench_summary` gives
    ``100 x mean`` over items.

    Category values (one per question, pooled per category by :func:`dpg_bench_summary`):

    * ``official_quirks=False``: the question's **gated** score averaged over the tiles;
    * ``official_quirks=True``: as ``main()`` does, ``qid2scores_orig``: the **ungated** score of the
      **last** tile only.

    A parent id missing from the item's questions (which happens when the loader reproduces the
    official ``prepare_dpg_data()`` quirk of dropping the CSV's first data row, the parent of the
    first item's children): the official ``qid2scores[parent_id]`` raises ``KeyError`` and ``main()``
    skips that image (``Failed filename``), so with ``official_quirks=True`` the item comes back with
    ``failed`` set and is left out of every mean; with ``official_quirks=False`` it is malformed data
    and raises :class:`ValueError` naming the item and the parent.

    A tile answer that is missing or NaN (the judge failed): the item is unjudged (``score`` NaN,
    ``unjudged`` says why), left out and counted by :func:`dpg_bench_summary`.

    Returns ``{"item_id", "score", "tile_scores", "question_scores" (the category values, by
    proposition id), "categories" (L2 category by proposition id), "failed", "unjudged"}``.
    """
    item_id = None
    if not isinstance(questions, (Sequence, Mapping)) and hasattr(questions, "questions"):
        item_id = getattr(questions, "item_id", None)  # an item object (mmrl.eval.benchmarks.DPGItem)
        questions = list(questions.questions)
    if not questions:
        raise ValueError("a DPG item needs at least one question")
    if not tile_answers:
        raise ValueError("a DPG item needs the answers of at least one tile")
    if item_id is None:
        item_id = _field(questions[0], "item_id")
    qids: list[int] = []
    dependencies: dict[int, list[int]] = {}
    categories: dict[int, str] = {}
    for q in questions:
        qid = int(_field(q, "proposition_id"))
        qids.append(qid)
        dependencies[qid] = _dependency_list(_field(q, "dependency"))
        source = _field(q, "tuple")
        if source is None:
            source = _field(q, "tuple_")
        if source is None:
            source = _field(q, "category", "")
        categories[qid] = dpg_category(source)
    out: dict[str, Any] = {
        "item_id": item_id, "score": NAN, "tile_scores": [], "question_scores": {},
        "categories": categories, "failed": None, "unjudged": None,
    }
    raw_tiles: list[dict[int, float]] = []
    for t, answers in enumerate(tile_answers):
        if isinstance(answers, Mapping):
            answers = {int(k): v for k, v in answers.items()}
            missing = [q for q in qids if q not in answers]
            if missing:
                out["unjudged"] = f"tile {t}: no answer for proposition(s) {missing}"
                return out
            raw = {q: dpg_answer_score(answers[q], exact_answers) for q in qids}
        else:
            answers = list(answers)
            if len(answers) != len(qids):
                raise ValueError(f"DPG item {item_id!r}: tile {t} has {len(answers)} answers for {len(qids)} questions")
            raw = {q: dpg_answer_score(a, exact_answers) for q, a in zip(qids, answers)}
        bad = [q for q, s in raw.items() if math.isnan(s)]
        if bad:
            out["unjudged"] = f"tile {t}: proposition(s) {bad} not answered (judge failed)"
            return out
        raw_tiles.append(raw)
    gated_tiles: list[dict[int, float]] = []
    for raw in raw_tiles:
        try:
            gated_tiles.append(dpg_gate(raw, dependencies))
        except KeyError as exc:
            parent = exc.args[0]
            reason = (f"DPG item {item_id!r}: a question depends on proposition {parent}, which is not "
                      f"among the item's questions")
            if official_quirks:
                out["failed"] = reason + " (the official scorer raises KeyError and skips the image)"
                return out
            raise ValueError(reason) from None
    tile_scores = [sum(g.values()) / len(g) for g in gated_tiles]
    out["tile_scores"] = tile_scores
    out["score"] = sum(tile_scores) / len(tile_scores)
    if official_quirks:
        out["question_scores"] = dict(raw_tiles[-1])
    else:
        out["question_scores"] = {q: sum(g[q] for g in gated_tiles) / len(gated_tiles) for q in qids}
    return out


def dpg_bench_summary(
    items: Iterable[Any], official_quirks: bool = False, exact_answers: bool = True,
) -> dict[str, Any]:
    """DPG-Bench's numbers (``main()``): ``score`` = 100 x the mean item score; L1 / L2 category scores.

    ``items``: results of :func:`dpg_item_score`, or ``(questions, tile_answers)`` pairs that are
    scored here with ``official_quirks`` / ``exact_answers``.

    * ``score`` = ``np.mean(global_dpg_scores) * 100`` over the items that were scored (failed and
      unjudged items left out, counted in ``num_failed`` / ``num_unjudged``);
    * ``l2`` (``L2 category scores``): per category, 100 x the mean of the category values of every
      question in it, pooled over all items (each question one value, see :func:`dpg_item_score` for
      what the value is in each mode); sorted by name as the official printout;
    * ``l1``: the same pooled over the L2 categories that share an L1 prefix (:func:`dpg_l1_category`).
    """
    scores: list[float] = []
    per_l2: dict[str, list[float]] = {}
    failed = unjudged = 0
    n_items = 0
    for item in items:
        n_items += 1
        if not (isinstance(item, Mapping) and "score" in item):
            questions, tile_answers = item
            item = dpg_item_score(questions, tile_answers, official_quirks, exact_answers)
        if item.get("failed"):
            failed += 1
            continue
        if item.get("unjudged") or _is_nan(item.get("score")):
            unjudged += 1
            continue
        scores.append(float(item["score"]))
        for qid, value in item["question_scores"].items():
            per_l2.setdefault(item["categories"][qid], []).append(float(value))
    per_l1: dict[str, list[float]] = {}
    for cat in sorted(per_l2):
        per_l1.setdefault(dpg_l1_category(cat), []).extend(per_l2[cat])
    return {
        "score": float(np.mean(scores)) * 100 if scores else NAN,
        "l1": {c: float(np.mean(v)) * 100 for c, v in sorted(per_l1.items())},
        "l2": {c: float(np.mean(per_l2[c])) * 100 for c in sorted(per_l2)},
        "num_items": n_items,
        "num_scored": len(scores),
        "num_failed": failed,
        "num_unjudged": unjudged,
        "official_quirks": bool(official_quirks),
    }


# --------------------------------------------------------------------------------------------
# T2I-CompBench (Karine-Huang/T2I-CompBench)
# --------------------------------------------------------------------------------------------

#: Category -> official metric (SOURCE.md table; the ++ categories numeracy / 3d_spatial are not here).
T2I_COMPBENCH_METRICS = {
    "color": "blip_vqa",
    "shape": "blip_vqa",
    "texture": "blip_vqa",
    "spatial": "unidet",
    "non_spatial": "clipscore",
    "complex": "3_in_1",
}

#: ``2D_spatial_eval.py`` ``vocab_spatial``, in its order: the first one found in the prompt wins.
T2I_SPATIAL_WORDS = (
    "on side of", "next to", "near", "on the left of", "on the right of", "on the bottom of", "on the top of",
    "on top of",
)
#: ``2D_spatial_eval.py``: these nouns are looked up as the detector's ``person``.
T2I_PERSON_WORDS = ("girl", "boy", "man", "woman")


def _round4(x: float) -> float:
    return float(f"{x:.4f}")


def blip_vqa_image_score(yes_probs: Sequence[float], np_num: int = 8, official_quirks: bool = False) -> float:
    """T2I-CompBench's BLIP-VQA score of one image (attribute binding: color, shape, texture).

    ``yes_probs``: for each noun phrase of the prompt (spaCy ``en_core_web_sm`` ``noun_chunks``, in
    order), the VQA model's ``P(yes) / (P(yes) + P(no))`` for the question ``"<noun phrase>?"``
    (``models/blip_vqa.py`` ``vqa_prob``). NaN in a used phrase gives NaN (unjudged).

    Official (``BLIP_vqa.py`` ``main()``, ``Create_annotation_for_BLIP()``): phrases ``0 .. np_num-1``
    are asked (``--np_num 8``); a phrase index the prompt does not have counts 1; phrases beyond
    ``np_num`` are never asked. Image score = the **product** of those values. The category score is
    the plain mean over images (:func:`t2i_category_score`).

    ``official_quirks=True`` also reproduces the number formats on the way: each P(yes) is written
    as ``'{:.4f}'`` (``vqa_prob`` returns strings), read back into a float32 tensor, multiplied in
    float32, and the product is written ``'{:.4f}'`` into ``vqa_result.json``, which both the
    BLIP-VQA mean and ``3_in_1.py`` read. ``False``: the exact product in float64.
    """
    if np_num < 1:
        raise ValueError(f"np_num must be >= 1, got {np_num}")
    used = [float(p) for p in list(yes_probs)[:np_num]]
    if any(math.isnan(p) for p in used):
        return NAN
    if not official_quirks:
        return float(np.prod(used)) if used else 1.0
    product = np.float32(1.0)
    for p in used:
        product = np.float32(product * np.float32(_round4(p)))
    return _round4(float(product))


def t2i_spatial_locality(prompt: str) -> str | None:
    """The spatial word of a prompt: the first of :data:`T2I_SPATIAL_WORDS` that occurs in it (substring
    test, ``2D_spatial_eval.py``), or None."""
    for word in T2I_SPATIAL_WORDS:
        if word in prompt:
            return word
    return None


def _box_dict(box: Any) -> tuple[float, float, float, float]:
    if isinstance(box, Mapping):
        return float(box["x_min"]), float(box["y_min"]), float(box["x_max"]), float(box["y_max"])
    x1, y1, x2, y2 = (float(v) for v in list(box)[:4])
    return x1, y1, x2, y2


def t2i_position_score(
    locality: str | None,
    box1: Any,
    box2: Any,
    iou_threshold: float = 0.1,
    distance_threshold: float = 150.0,
    official_quirks: bool = False,
) -> float:
    """T2I-CompBench's soft position score of object 1 relative to object 2 (``determine_position()``).

    Boxes ``[x1, y1, x2, y2]`` (or ``{"x_min", "y_min", "x_max", "y_max"}``) in image pixels (y grows
    downwards). With centre offsets ``dx = cx2 - cx1``, ``dy = cy2 - cy1`` and the plain IoU:

    * ``next to`` / ``on side of`` / ``near``: 1 if ``|dx| < 150`` **or** ``|dy| < 150``, else
      ``150 / max(|dx|, |dy|)``;
    * ``on the left of``: ``dx > 0`` and ``|dx| > |dy|``: 1 if ``IoU < 0.1`` else ``0.1 / IoU``; else 0;
    * ``on the right of``: the same with ``dx < 0``;
    * ``on the top of``: ``dy > 0`` and ``|dy| > |dx|``: 1 if ``IoU < 0.1`` else ``0.1 / IoU``; else 0;
    * ``on the bottom of``: the same with ``dy < 0``;
    * anything else (no spatial word): 0.

    ``official_quirks=True``: ``"on top of"`` (a word of the vocabulary, common in the complex
    category) falls through to 0, as in the official code. ``False``: it is read as ``on the top of``.
    Two degenerate boxes (union 0) make the official code divide by zero; here the IoU is 0.
    """
    if locality == "on top of" and not official_quirks:
        locality = "on the top of"
    ax1, ay1, ax2, ay2 = _box_dict(box1)
    bx1, by1, bx2, by2 = _box_dict(box2)
    dx = (bx1 + bx2) / 2 - (ax1 + ax2) / 2
    dy = (by1 + by2) / 2 - (ay1 + ay2) / 2
    inter = max(0.0, min(ax2, bx2) - max(ax1, bx1)) * max(0.0, min(ay2, by2) - max(ay1, by1))
    union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - inter
    iou = inter / union if union else 0.0

    def along(sign_ok: bool, major: float, minor: float) -> float:
        if not sign_ok or not abs(major) > abs(minor):
            return 0.0
        return 1.0 if iou < iou_threshold else iou_threshold / iou

    if locality in ("next to", "on side of", "near"):
        if abs(dx) < distance_threshold or abs(dy) < distance_threshold:
            return 1.0
        return distance_threshold / max(abs(dx), abs(dy))
    if locality == "on the right of":
        return along(dx < 0, dx, dy)
    if locality == "on the left of":
        return along(dx > 0, dx, dy)
    if locality == "on the bottom of":
        return along(dy < 0, dy, dx)
    if locality == "on the top of":
        return along(dy > 0, dy, dx)
    return 0.0


def _detection(det: Any) -> tuple[str, float, Any]:
    if isinstance(det, Mapping):
        return str(det["label"]), float(det["score"]), det["box"]
    if hasattr(det, "label") and hasattr(det, "score") and hasattr(det, "box"):
        return str(det.label), float(det.score), det.box
    label, score, box = det
    return str(label), float(score), box


def t2i_spatial_image_score(
    locality: str | None,
    obj1: str | None,
    obj2: str | None,
    detections: Sequence[Any],
    iou_threshold: float = 0.1,
    distance_threshold: float = 150.0,
    official_quirks: bool = False,
) -> float:
    """T2I-CompBench's UniDet spatial score of one image (``2D_spatial_eval.py`` ``main()``).

    ``obj1``, ``obj2``: the two nouns (simple prompts: spaCy's first and last ``NOUN``; complex: the
    nouns around the preposition, ``None`` when not exactly two were found); ``girl/boy/man/woman``
    are looked up as ``person``. ``detections``: the detector's outputs in its output order (UniDet /
    detectron2 sorts by confidence), each ``(label, score, box)``, a mapping with those keys or a
    :class:`mmrl.rewards.geneval.Detection`. Each noun takes the **first** detection whose label equals
    it exactly (``obj.index(obj1)``); both nouns may take the same detection.

    Score: both found: ``0.25·s1 + 0.25·s2 + 0.5·position`` (:func:`t2i_position_score`); one found:
    ``0.25·s``; none: 0. Then a score ``< 0.5`` becomes 0 (so in effect only images with both objects
    score). Category score = mean over images (:func:`t2i_category_score`).
    """
    if obj1 in T2I_PERSON_WORDS:
        obj1 = "person"
    if obj2 in T2I_PERSON_WORDS:
        obj2 = "person"
    dets = [_detection(d) for d in detections]
    labels = [d[0] for d in dets]
    first1 = labels.index(obj1) if obj1 is not None and obj1 in labels else None
    first2 = labels.index(obj2) if obj2 is not None and obj2 in labels else None
    if first1 is not None and first2 is not None:
        score = 0.25 * dets[first1][1] + 0.25 * dets[first2][1]
        score += t2i_position_score(locality, dets[first1][2], dets[first2][2], iou_threshold, distance_threshold,
                                    official_quirks) / 2
    elif first1 is not None:
        score = 0.25 * dets[first1][1]
    elif first2 is not None:
        score = 0.25 * dets[first2][1]
    else:
        score = 0.0
    return 0.0 if score < 0.5 else float(score)


def t2i_complex_key(prompt: str) -> str:
    """How ``3_in_1.py`` compares prompts: the text before the first ``.``, lower case (line ends removed)."""
    return prompt.rstrip("\r\n").split(".")[0].lower()


def t2i_complex_kind(prompt: str, spatial_prompts: Iterable[str], action_prompts: Iterable[str]) -> str:
    """Which 3-in-1 formula a complex prompt takes: ``"spatial"`` if it is in ``complex_val_spatial.txt``,
    else ``"action"`` if in ``complex_val_action.txt``, else ``"all"`` (``3_in_1.py`` ``main()``; the
    membership test is on :func:`t2i_complex_key` of both sides)."""
    key = t2i_complex_key(prompt)
    if key in {t2i_complex_key(p) for p in spatial_prompts}:
        return "spatial"
    if key in {t2i_complex_key(p) for p in action_prompts}:
        return "action"
    return "all"


def t2i_complex_image_score(kind: str, blip: float, unidet: float, clip: float) -> float:
    """T2I-CompBench's 3-in-1 score of one complex image (``3_in_1.py`` ``main()``).

    ``blip``: the BLIP-VQA image score; ``unidet``: the spatial score (``--complex`` noun extraction);
    ``clip``: the CLIP cosine (``--complex``: prompt with its adjectives removed). ``kind`` from
    :func:`t2i_complex_kind`: ``"spatial"`` = ``(unidet + blip) / 2``; ``"action"`` = ``(clip + blip) /
    2``; ``"all"`` = ``(blip + unidet + clip) / 3``. NaN in a used part gives NaN.
    """
    if kind == "spatial":
        return (float(unidet) + float(blip)) * 0.5
    if kind == "action":
        return (float(clip) + float(blip)) * 0.5
    if kind == "all":
        return (float(blip) + float(unidet) + float(clip)) / 3
    raise ValueError(f"unknown 3-in-1 kind {kind!r}; use 'spatial', 'action' or 'all'")


def t2i_category_score(image_scores: Iterable[Any]) -> dict[str, Any]:
    """A T2I-CompBench category's number: the plain mean over all its images (every scorer's final
    ``sum / len``: 300 val prompts x 10 images), NaN ones left out and counted.

    Non-spatial's image score is the CLIP ViT-B/32 cosine of the L2-normalised image and text
    embeddings (``CLIP_similarity.py``; not x100, not clipped), averaged as is.
    Returns ``{"score", "n", "num_unjudged"}``.
    """
    m = mean_with_count(image_scores)
    return {"score": m["mean"], "n": m["n"], "num_unjudged": m["num_unjudged"]}


def t2i_compbench_summary(per_category: Mapping[str, Iterable[Any]]) -> dict[str, Any]:
    """Every category's number from its per-image scores: ``{category: {"score", "n", "num_unjudged",
    "metric"}}`` (``metric`` from :data:`T2I_COMPBENCH_METRICS`, ``None`` for another category).
    The official repo reports no overall average across categories, so none is made here."""
    out: dict[str, Any] = {}
    for cat, scores in per_category.items():
        out[cat] = {**t2i_category_score(scores), "metric": T2I_COMPBENCH_METRICS.get(cat)}
    return out


# --------------------------------------------------------------------------------------------
# OCR (yifan123/flow_grpo flow_grpo/ocr.py)
# --------------------------------------------------------------------------------------------


def ocr_target(prompt: str) -> str | None:
    """The text a prompt asks to render: Flow-GRPO takes ``prompt.split('"')[1]``; this is
    :func:`mmrl.rewards.ocr.extract_target` (the first ``"..."``, the same on every prompt of the
    test set, all of which have one pair of double quotes)."""
    return extract_target(prompt)


def ocr_accuracy(recognized: str, target: str) -> float:
    """Flow-GRPO's OCR accuracy of one image (``OcrScorer.__call__``), i.e.
    :func:`mmrl.rewards.ocr.ocr_score`: spaces removed and lower case on both sides; 1 if the target
    is a substring of the recognised text, else ``1 - min(Levenshtein(rec, target), len(target)) /
    len(target)``. An empty target raises :class:`ValueError`."""
    return ocr_score(recognized, target)


def ocr_benchmark(scores: Iterable[Any]) -> dict[str, Any]:
    """The OCR benchmark number: the mean accuracy over the test prompts (1 image each).

    ``accuracy``: over the images that were scored (NaN = the engine failed / no target: left out,
    counted in ``num_unjudged``); ``accuracy_failed_as_zero``: NaN counted as 0, which is what
    Flow-GRPO does (its ``except`` branch sets the distance to ``len(target)``, reward 0).
    """
    values = list(scores)
    m = mean_with_count(values)
    as_zero = [0.0 if _is_nan(v) else float(v) for v in values]
    return {
        "accuracy": m["mean"],
        "accuracy_failed_as_zero": float(np.mean(as_zero)) if as_zero else NAN,
        "n": m["n"],
        "num_unjudged": m["num_unjudged"],
    }


# --------------------------------------------------------------------------------------------
# Grounding and VLM answers
# --------------------------------------------------------------------------------------------


def _valid_gt_box(box: Any) -> bool:
    try:
        x1, y1, x2, y2 = (float(v) for v in box)
    except (TypeError, ValueError):
        return False
    return all(math.isfinite(v) for v in (x1, y1, x2, y2)) and x2 > x1 and y2 > y1


def rec_scores(preds: Sequence[Any], gts: Sequence[Any], iou_threshold: float = 0.5,
               iou: str = "continuous") -> dict[str, Any]:
    """Referring-expression grounding (RefCOCO/+/g): ``acc@0.5`` and mean IoU over samples.

    ``preds``: the predicted box per sample in original-image pixels (``None`` = unparseable: IoU 0,
    wrong, kept in the denominator); ``gts``: the ground-truth box (``None`` or an invalid box =
    unjudged: left out, counted). IoU is :func:`mmrl.rewards.grounding.box_iou` (continuous
    coordinates; an invalid predicted box scores 0).

    ``acc@0.5`` counts ``IoU > 0.5`` **strictly**: VLM-R1 ``src/eval/test_rec_r1.py``
    (``iou(model_answer, ground_truth) > 0.5``, accuracy = ``correct_number / len(data)``, an
    unreadable answer becomes ``[0, 0, 0, 0]``) and REFERENCE.md section 7. VLM-R1's own ``iou()``
    uses an inclusive-pixel intersection that drops overlaps of at most 1 px; mmrl's IoU is the
    continuous one; ``iou="vlm_r1"`` takes that function as written
    (:func:`mmrl.rewards.grounding.vlm_r1_iou`). ``miou`` (VLM-R1 reports none) = mean IoU over the same samples.
    Returns ``{"acc@0.5" (key from the threshold), "miou", "n", "num_unparseable", "num_unjudged",
    "ious"}`` (``ious``: per sample, NaN for unjudged ones).
    """
    if len(preds) != len(gts):
        raise ValueError(f"got {len(preds)} predictions for {len(gts)} ground truths")
    if iou not in ("continuous", "vlm_r1"):
        raise ValueError(f"unknown iou {iou!r}; expected 'continuous' or 'vlm_r1'")
    ious: list[float] = []
    unparseable = unjudged = 0
    for p, g in zip(preds, gts):
        if g is None or not _valid_gt_box(g):
            unjudged += 1
            ious.append(NAN)
        elif p is None:
            unparseable += 1
            ious.append(0.0)
        else:
            ious.append(box_iou(p, g) if iou == "continuous" else vlm_r1_iou(p, g))
    kept = [v for v in ious if not math.isnan(v)]
    return {
        f"acc@{iou_threshold:g}": sum(v > iou_threshold for v in kept) / len(kept) if kept else NAN,
        "miou": float(np.mean(kept)) if kept else NAN,
        "n": len(kept),
        "num_unparseable": unparseable,
        "num_unjudged": unjudged,
        "ious": ious,
    }


def multi_object_f1(preds: Sequence[Any], gts: Sequence[Any], iou_threshold: float = 0.5) -> dict[str, Any]:
    """Multi-object grounding F1 over samples.

    Per sample, :func:`mmrl.rewards.grounding.box_f1`: one-to-one (Hungarian) matching at ``IoU >=
    iou_threshold`` (REFERENCE.md section 7), ``f1 = 2·TP / (#pred + #gt)``; both empty = 1, one empty
    = 0. ``preds[i]``: a list of boxes (``[]`` = "nothing there"), or ``None`` = unparseable (0 for
    every number, its ground truth counted in the micro recall); ``gts[i]``: a list of boxes, ``None``
    = unjudged.

    Returns the means over samples ``f1``, ``precision``, ``recall`` (the primary numbers), and the
    micro versions from pooled counts, ``micro_f1 = 2·ΣTP / (Σpred + Σgt)``, ``micro_precision =
    ΣTP / Σpred``, ``micro_recall = ΣTP / Σgt`` (NaN when the denominator is 0: no boxes to pool),
    plus ``n``, ``num_unparseable``, ``num_unjudged``.
    """
    if len(preds) != len(gts):
        raise ValueError(f"got {len(preds)} predictions for {len(gts)} ground truths")
    f1s: list[float] = []
    ps: list[float] = []
    rs: list[float] = []
    tp = n_pred = n_gt = 0
    unparseable = unjudged = 0
    for p, g in zip(preds, gts):
        if g is None:
            unjudged += 1
            continue
        g = list(g)
        if p is None:
            unparseable += 1
            f1s.append(0.0)
            ps.append(0.0)
            rs.append(0.0)
            n_gt += len(g)
            continue
        p = list(p)
        f = box_f1(p, g, iou_threshold)
        f1s.append(f["f1"])
        ps.append(f["precision"])
        rs.append(f["recall"])
        tp += int(f["tp"])
        n_pred += len(p)
        n_gt += len(g)

    return {
        "f1": float(np.mean(f1s)) if f1s else NAN,
        "precision": float(np.mean(ps)) if ps else NAN,
        "recall": float(np.mean(rs)) if rs else NAN,
        "micro_f1": 2 * tp / (n_pred + n_gt) if n_pred + n_gt else NAN,
        "micro_precision": tp / n_pred if n_pred else NAN,
        "micro_recall": tp / n_gt if n_gt else NAN,
        "n": len(f1s),
        "num_unparseable": unparseable,
        "num_unjudged": unjudged,
    }


def charades_sta_scores(
    preds: Sequence[Any],
    gts: Sequence[Any],
    durations: Sequence[float | None] | None = None,
    thresholds: Sequence[float] = (0.3, 0.5, 0.7),
    *,
    clip_gt_to_duration: bool = True,
    strict: bool = True,
) -> dict[str, Any]:
    """Video temporal grounding (Charades-STA format): R1@{0.3, 0.5, 0.7} and mIoU.

    ``preds``: the predicted ``[start, end]`` in seconds per query (``None`` = unparseable: tIoU 0,
    kept in the denominator, as TimeZero's ``process_work_items()`` appends 0); ``gts``: the
    ground-truth ``[start, end]``; ``durations``: the video lengths (seconds) or None. tIoU is
    :func:`mmrl.rewards.grounding.temporal_iou` (``max(0, min(e) - max(s)) / (max(e) - min(s))``; a
    reversed or empty predicted span scores 0, and so it does in both official formulas).

    Conventions, and what the official evaluations do:

    * ``strict=True`` (default): R1@m counts ``tIoU > m``: 2D-TAN ``lib/core/eval.py`` ``eval()``
      (``overlap > t``) and REFERENCE.md section 7. TimeZero ``evaluate.py`` counts
      ``thresh <= iou`` (``strict=False``).
    * ``clip_gt_to_duration=True`` (default): a GT end beyond the video's duration (562 of the 3720
      test moments) is cut to the duration, as 2D-TAN's loader does
      (``lib/datasets/charades.py``: ``e_time = min(float(e_time), duration)``, a moment kept only if
      ``s_time < e_time``); a GT that is empty after the cut is unjudged (2D-TAN drops it; with the
      durations of ``charades_test.json`` none is). TimeZero reads the duration but never uses it
      (``clip_gt_to_duration=False``). Predictions are never clipped (neither evaluation does).
    * ``strict=False, clip_gt_to_duration=False`` is TimeZero's scoring; with its parse
      (:func:`~mmrl.rewards.grounding.parse_timezero_span`, which ``mmrl eval ... tg_convention=timezero`` uses)
      its numbers.

    A GT that is missing or not a span with ``end > start`` is unjudged (left out, counted).
    ``miou`` = mean tIoU over the kept queries, one prediction per query (2D-TAN's ``eval.py`` takes the same
    top-1 IoU: its ``np.sort(overlap[0])[-3:]`` is over the one IoU of the first prediction).
    Returns ``{"r1@0.3", "r1@0.5", "r1@0.7", "miou", "n", "num_unparseable", "num_unjudged",
    "num_gt_clipped", "tious"}``.
    """
    if len(preds) != len(gts):
        raise ValueError(f"got {len(preds)} predictions for {len(gts)} ground truths")
    if durations is not None and len(durations) != len(gts):
        raise ValueError(f"got {len(durations)} durations for {len(gts)} ground truths")
    tious: list[float] = []
    unparseable = unjudged = clipped = 0
    for i, (p, g) in enumerate(zip(preds, gts)):
        try:
            s, e = (float(v) for v in g)
        except (TypeError, ValueError):
            unjudged += 1
            tious.append(NAN)
            continue
        if durations is not None and clip_gt_to_duration:
            d = durations[i]
            if d is not None and math.isfinite(float(d)) and e > float(d):
                e = float(d)
                clipped += 1
        if not (math.isfinite(s) and math.isfinite(e)) or not e > s:
            unjudged += 1
            tious.append(NAN)
            continue
        if p is None:
            unparseable += 1
            tious.append(0.0)
        else:
            tious.append(temporal_iou(p, (s, e)))
    kept = [v for v in tious if not math.isnan(v)]
    out: dict[str, Any] = {}
    for m in thresholds:
        hits = sum((v > m) if strict else (v >= m) for v in kept)
        out[f"r1@{m:g}"] = hits / len(kept) if kept else NAN
    out.update({
        "miou": float(np.mean(kept)) if kept else NAN,
        "n": len(kept),
        "num_unparseable": unparseable,
        "num_unjudged": unjudged,
        "num_gt_clipped": clipped,
        "tious": tious,
    })
    return out


def choice_accuracy(preds: Sequence[Any], gts: Sequence[Any]) -> dict[str, Any]:
    """Multiple-choice accuracy: the fraction of questions whose predicted letter equals the answer.

    ``preds``: the parsed letter (e.g. by :func:`mmrl.rewards.answer.parse_choice`) or ``None`` =
    unparseable (wrong, kept); ``gts``: the letter, ``None`` = unjudged. Letters are compared stripped
    and upper case. Returns :func:`accuracy_mean`'s dict.
    """
    if len(preds) != len(gts):
        raise ValueError(f"got {len(preds)} predictions for {len(gts)} ground truths")
    scores: list[Any] = []
    for p, g in zip(preds, gts):
        if g is None or (isinstance(g, float) and math.isnan(g)):
            scores.append(NAN)
        elif p is None:
            scores.append(None)
        else:
            scores.append(float(str(p).strip().upper() == str(g).strip().upper()))
    return accuracy_mean(scores)


#: VSI-Bench's question types (vision-x-nyu/thinking-in-space lmms_eval/tasks/vsibench/utils.py): multiple-choice
#: answers (accuracy) and numerical answers (mean relative accuracy)
VSI_MCA_TYPES = ("object_rel_direction_easy", "object_rel_direction_medium", "object_rel_direction_hard",
                 "object_rel_distance", "route_planning", "obj_appearance_order")
VSI_NA_TYPES = ("object_abs_distance", "object_counting", "object_size_estimation", "room_size_estimation")


def vsi_mean_relative_accuracy(pred: float, target: float, start: float = 0.5, end: float = 0.95,
                               interval: float = 0.05) -> float:
    """VSI-Bench's MRA as its ``mean_relative_accuracy`` computes it: the fraction of the thresholds
    ``np.linspace(start, end, int((end - start) / interval + 2))`` (10 of them for .5:.95:.05, the float count
    8.999... + 2 truncating to 10) at which ``|pred - target| / target <= 1 - threshold``."""
    thresholds = np.linspace(start, end, int((end - start) / interval + 2))
    return float((abs(pred - target) / target <= 1 - thresholds).mean())


def vsi_bench_prompt(question: str, question_type: str, options: Sequence[str] | None = None) -> str:
    """The question text VSI-Bench's ``vsibench_doc_to_text`` builds (its default pre / post prompts)."""
    if question_type in VSI_NA_TYPES:
        return "These are frames of a video.\n" + question + "\nPlease answer the question using a single word or phrase."
    if question_type in VSI_MCA_TYPES:
        return "\n".join(["These are frames of a video.", question, "Options:\n" + "\n".join(options or []),
                          "Answer with the option's letter from the given choices directly."])
    raise ValueError(f"unknown VSI-Bench question type {question_type!r}")


def vsi_bench_sample_score(pred: str, question_type: str, ground_truth: str) -> float:
    """One VSI-Bench answer's score (``vsibench_process_results``): the prediction's first space-separated word
    with trailing dots removed (``fuzzy_matching``); a multiple-choice type scores its case-insensitive equality
    with the ground truth, a numerical type the MRA of the two read as floats (either unreadable: 0)."""
    word = pred.split(" ")[0].rstrip(".").strip()
    if question_type in VSI_MCA_TYPES:
        return 1.0 if word.lower() == str(ground_truth).lower() else 0.0
    if question_type not in VSI_NA_TYPES:
        raise ValueError(f"unknown VSI-Bench question type {question_type!r}")
    try:
        return vsi_mean_relative_accuracy(float(word), float(ground_truth))
    except (TypeError, ValueError):
        return 0.0


def vsi_bench_scores(preds: Sequence[Any], gts: Sequence[Any]) -> dict[str, Any]:
    """VSI-Bench (Yang et al. 2024, "Thinking in Space", arXiv 2412.14171) as ``vsibench_aggregate_results``: the
    mean score per question type (:func:`vsi_bench_sample_score`), the three relative-direction types averaged
    into one ``object_rel_direction``, ``overall`` the mean of the resulting (up to 8) categories. Reported as
    fractions (the official table multiplies by 100).

    ``preds``: the model's answer text (``None`` = no answer: 0, kept); ``gts``: ``{"question_type",
    "ground_truth"}`` or ``None`` = unjudged (left out, counted)."""
    if len(preds) != len(gts):
        raise ValueError(f"got {len(preds)} predictions for {len(gts)} ground truths")
    per_type: dict[str, list[float]] = {}
    scores: list[float] = []
    unjudged = unparseable = 0
    for p, g in zip(preds, gts):
        if g is None:
            unjudged += 1
            scores.append(NAN)
            continue
        if p is None:
            unparseable += 1
        value = 0.0 if p is None else vsi_bench_sample_score(str(p), g["question_type"], g["ground_truth"])
        per_type.setdefault(g["question_type"], []).append(value)
        scores.append(value)
    categories = {t: float(np.mean(v)) for t, v in per_type.items()}
    directions = [t for t in VSI_MCA_TYPES[:3] if t in categories]
    # thinking-in-space's vsibench_aggregate_results always pops easy / medium / hard (missing as 0) and adds their
    # sum / 3 as one category; on a full run (all three present) this is the same. mmrl's rule for a partial run
    # (eval.limit, a subset): the merged category only when "easy" is there, and no zero category for direction
    # questions never asked (the official would add one: counting 0.1 and route planning 1.0 alone read 0.367
    # there, 0.55 here)
    if "object_rel_direction_easy" in categories:
        categories["object_rel_direction"] = sum(categories.pop(t) for t in directions) / 3.0
    return {"overall": float(np.mean(list(categories.values()))) if categories else NAN,
            **{f"{t}": v for t, v in sorted(categories.items())},
            "n": sum(len(v) for v in per_type.values()), "num_unparseable": unparseable, "num_unjudged": unjudged,
            "scores": scores}


def numeric_accuracy(
    preds: Sequence[Any], gts: Sequence[Any], rel_tol: float = 1e-6, abs_tol: float = 1e-9,
) -> dict[str, Any]:
    """Numeric-answer accuracy: correct iff ``|pred - gt| <= max(rel_tol·|gt|, abs_tol)`` (the rule of
    mmrl's ``numeric_accuracy`` reward). ``preds``: numbers or ``None`` = unparseable (wrong, kept);
    ``gts``: numbers, ``None``/NaN = unjudged. Returns :func:`accuracy_mean`'s dict."""
    if len(preds) != len(gts):
        raise ValueError(f"got {len(preds)} predictions for {len(gts)} ground truths")
    scores: list[Any] = []
    for p, g in zip(preds, gts):
        if _is_nan(g):
            scores.append(NAN)
        elif p is None or _is_nan(p):
            scores.append(None)
        else:
            gf, pf = float(g), float(p)
            scores.append(float(abs(pf - gf) <= max(rel_tol * abs(gf), abs_tol)))
    return accuracy_mean(scores)


def video_r1_answer_accuracy(preds: Sequence[Any], gts: Sequence[Any], kind: str) -> dict[str, Any]:
    """Video-R1's ``src/eval_bench.py`` ``reward_fn`` (tulerfeng/Video-R1) for its multiple-choice and numerical
    questions, on answers already read as it reads them (the first answer block, else the whole output):
    ``kind="multiple_choice"``: 1 iff ``pred.strip() == gt.strip()`` (case and punctuation count: ``(B)`` is not
    ``B``); ``kind="numeric"``: :func:`mmrl.rewards.video_r1.numerical_match` (the decimal-mark check, then equal
    at 2 decimals). ``gts`` ``None``: unjudged. Returns :func:`accuracy_mean`'s dict (every item in the
    denominator: Video-R1's ``mean_acc``)."""
    from mmrl.rewards.video_r1 import numerical_match

    if len(preds) != len(gts):
        raise ValueError(f"got {len(preds)} predictions for {len(gts)} ground truths")
    scores: list[Any] = []
    for p, g in zip(preds, gts):
        if g is None:
            scores.append(NAN)
        elif kind == "multiple_choice":
            scores.append(float(str(p).strip() == str(g).strip()))
        else:
            scores.append(numerical_match(str(g).strip(), str(p).strip()))
    return accuracy_mean(scores)


# --------------------------------------------------------------------------------------------
# Blind control
# --------------------------------------------------------------------------------------------


def paired_difference(real: Sequence[Any], blind: Sequence[Any]) -> dict[str, Any]:
    """Paired difference of one metric between real images and grey canvases, sample by sample.

    ``real[i]`` and ``blind[i]`` are the same sample's score with its image and with the grey canvas.
    Pairs where either side is None/NaN are dropped (counted in ``num_dropped``); over the kept pairs:
    ``real`` and ``blind`` (their means), ``delta`` = mean of ``real - blind`` (= ``real - blind``),
    ``delta_se`` = its standard error (sample std with ddof 1 / sqrt(n); NaN for fewer than 2 pairs),
    ``n_pairs``. A ``delta`` near 0 means the answers do not depend on the pixels.
    """
    if len(real) != len(blind):
        raise ValueError(f"got {len(real)} real scores for {len(blind)} blind ones")
    r_kept: list[float] = []
    b_kept: list[float] = []
    dropped = 0
    for r, b in zip(real, blind):
        if _is_nan(r) or _is_nan(b):
            dropped += 1
            continue
        r_kept.append(float(r))
        b_kept.append(float(b))
    n = len(r_kept)
    if n == 0:
        return {"real": NAN, "blind": NAN, "delta": NAN, "delta_se": NAN, "n_pairs": 0, "num_dropped": dropped}
    diffs = np.asarray(r_kept) - np.asarray(b_kept)
    se = float(np.std(diffs, ddof=1) / math.sqrt(n)) if n >= 2 else NAN
    return {
        "real": float(np.mean(r_kept)),
        "blind": float(np.mean(b_kept)),
        "delta": float(np.mean(diffs)),
        "delta_se": se,
        "n_pairs": n,
        "num_dropped": dropped,
    }


def _numeric(v: Any) -> bool:
    """A metric value: a number, a bool, or None (missing)."""
    return v is None or isinstance(v, (bool, int, float, np.integer, np.floating))


def blind_control(
    real_rows: Sequence[Mapping[str, Any]],
    blind_rows: Sequence[Mapping[str, Any]],
    metrics: Sequence[str] | None = None,
    key: str | None = "id",
) -> dict[str, Any]:
    """The blind control: for each metric, :func:`paired_difference` of the real run and the grey-canvas run.

    ``real_rows`` / ``blind_rows``: per-sample result rows (``samples.jsonl``), paired by the value of
    ``key`` (a sample id; ``key=None`` pairs by position, then both must be as long). A sample in only
    one run is left out and counted in ``num_unpaired``. ``metrics``: the metric names; default every
    key whose values are numbers (or bools) in both runs' rows, ``key`` excluded.
    Returns ``{"metrics": {metric: paired_difference dict}, "num_unpaired": int}``.
    """
    if key is None:
        if len(real_rows) != len(blind_rows):
            raise ValueError(f"pairing by position needs equal lengths, got {len(real_rows)} and {len(blind_rows)}")
        pairs = list(zip(real_rows, blind_rows))
        unpaired = 0
    else:
        blind_by: dict[Any, Mapping[str, Any]] = {}
        for row in blind_rows:
            if row[key] in blind_by:
                raise ValueError(f"blind rows repeat {key}={row[key]!r}")
            blind_by[row[key]] = row
        seen: set[Any] = set()
        pairs = []
        for row in real_rows:
            k = row[key]
            if k in seen:
                raise ValueError(f"real rows repeat {key}={k!r}")
            seen.add(k)
            if k in blind_by:
                pairs.append((row, blind_by[k]))
        unpaired = (len(real_rows) - len(pairs)) + (len(blind_by) - len(pairs))
    if metrics is None:
        names: list[str] = []
        for r, b in pairs:
            for name in r:
                if name == key or name in names or name not in b:
                    continue
                if _numeric(r[name]) and _numeric(b[name]):
                    names.append(name)
        metrics = [m for m in names if all(_numeric(r.get(m)) and _numeric(b.get(m)) for r, b in pairs)]
    result = {
        m: paired_difference([r.get(m) for r, _ in pairs], [b.get(m) for _, b in pairs]) for m in metrics
    }
    return {"metrics": result, "num_unpaired": unpaired}
