"""``mmrl eval`` for vision-language policies (``model.family: qwen_vl``): grounding and VLM benchmarks.

    mmrl eval CONFIG [checkpoint=PATH|base] [benchmarks=[rec,multi_object,temporal_grounding,multiple_choice,
                     numeric,vsi_bench,charades_sta]] [data=FILE] [video_dir=DIR] [output_dir=DIR] [limit=N] [batch_size=B]
                     [greedy=true] [seed=S] [max_new_tokens=T] [blind=false] [coord_format=qwen2|qwen25|absolute]
                     [require_tags=true] [tg_convention=2d_tan|timezero|time_r1] [rec_convention=mmrl|vlm_r1]
                     [answer_convention=mmrl|video_r1] [ema=true] [progress=true]
                     [dotted.config=override ...]

:func:`run_vlm_eval` is what :func:`mmrl.eval.runner.run_eval` calls for a ``qwen_vl`` CONFIG. The policy answers
every question (batched, greedy by default: :meth:`mmrl.pipelines.vlm.qwen.QwenVLPolicy.sample_eval`), the answer
is parsed with mmrl's reward parsers (:mod:`mmrl.rewards.grounding`, :mod:`mmrl.rewards.answer`) and the benchmark
numbers are the official rules of :mod:`mmrl.eval.scoring`:

=====================  ==============================  ===========================================================
benchmark              samples                         metrics (headline first)
=====================  ==============================  ===========================================================
``rec``                JSONL lines with task           ``acc@0.5`` (IoU > 0.5, strict), ``miou``:
                       ``grounding`` / ``rec`` /       :func:`~mmrl.eval.scoring.rec_scores`, the rule of VLM-R1
                       ``refcoco``, one box            ``src/eval/test_rec_r1.py`` (RefCOCO/+/g)
``multi_object``       task ``multi_object`` /         ``f1`` (and precision, recall, micro versions):
                       ``multi_object_grounding`` /    :func:`~mmrl.eval.scoring.multi_object_f1`, one-to-one
                       ``detection``, a list of boxes  matching at IoU >= 0.5
``temporal_grounding`` task ``temporal_grounding``     ``r1@0.5``, ``r1@0.3``, ``r1@0.7``, ``miou``:
                                                       :func:`~mmrl.eval.scoring.charades_sta_scores` (2D-TAN
                                                       ``lib/core/eval.py``; TimeZero ``evaluate.py`` with
                                                       ``tg_convention=timezero``; Time-R1 ``eval_all.py``
                                                       with ``tg_convention=time_r1``)
``charades_sta``       the shipped Charades-STA test   as ``temporal_grounding``; the videos come from the user's
                       annotations (3720 queries)      ``video_dir=`` (``<video_id>.mp4``, not shipped)
``multiple_choice``    task ``multiple_choice`` / mc   ``accuracy``: :func:`~mmrl.eval.scoring.choice_accuracy`
                                                       (mmrl's letter reading; Video-R1 ``src/eval_bench.py``
                                                       with ``answer_convention=video_r1``)
``numeric``            task ``numeric`` / counting     ``accuracy``: :func:`~mmrl.eval.scoring.numeric_accuracy`
                                                       (Video-R1's with ``answer_convention=video_r1``)
``vsi_bench``          task ``vsi_bench`` (VSI-Bench   ``overall`` and one score per question type:
                       lines: ``question_type``,       :func:`~mmrl.eval.scoring.vsi_bench_scores` (thinking-in-
                       ``ground_truth``, a video)      space's lmms-eval task: first-word match, MRA)
=====================  ==============================  ===========================================================

The JSONL benchmarks read the format mmrl trains on (:mod:`mmrl.data.vlm`) from ``data=FILE`` (default: the
config's ``data.dataset``); each line's ``task`` decides its benchmark. Without ``benchmarks=`` every task in the
file is evaluated, and a line whose task has no metric is an error naming its file and line; with ``benchmarks=``
lines of other tasks are left out. RefCOCO is not shipped and mmrl has no loader of its own json format
(:data:`mmrl.eval.benchmarks.USER_SUPPLIED`): convert it to the JSONL (``task: grounding``, ``boxes``) and it is the
``rec`` benchmark.

Answers: read from the ``<answer>...</answer>`` block (``require_tags=true``, as VLM-R1's ``test_rec_r1.py`` reads
its box only there; ``false`` reads an untagged answer whole). Boxes are converted to original-image pixels from
the model's coordinates (``coord_format``: by default from the model type, as :func:`mmrl.build.build_reward_fn`
does: Qwen2-VL / Qwen3-VL 0-1000 normalised, Qwen2.5-VL pixels of the resized input; a line's own
``coord_format`` wins). Three outcomes per sample (:mod:`mmrl.eval.scoring`): judged; **unparseable** (no box,
span, letter or number in the answer: scores 0, stays in the denominator, counted); **unjudged** (the line lacks
its ground truth, no coordinate format is known, the prompt is too long, the media cannot be decoded: every score
``null`` with the ``reason`` in its row, left out of the means and counted in ``summary.json``). Nothing crashes on
one sample.

Blind control (``blind=true``, after Tong et al.'s "Eyes Wide Shut" and the blind baselines of VQA): every benchmark
is answered twice, once as given and once with every image and every video frame replaced by a uniform grey
(128, 128, 128) canvas of the same size, at the data-item level (after loading and resizing, before the processor),
so the prompts have the same tokens. Blind rows carry ``"blind": true``; ``summary.json`` gives the blind metrics
beside the real ones and :func:`~mmrl.eval.scoring.blind_control` (per-sample paired real - blind differences).

Outputs in ``output_dir`` (default ``RUN/eval/<checkpoint>``, or ``<config output_dir>/eval/base``), the layout of
:mod:`mmrl.eval.runner`: ``samples.jsonl`` (one row per answer, appended and flushed batch by batch: benchmark,
sample index, question, id, the media paths relative to the data file's folder (``protocol.data_file``) or to the
video folder (``protocol.media_root``), the answer, the ground truth as scored (``target``), every score, the verdict
(the parsed prediction in original pixels or seconds, why it was unparseable, the coordinate format and sizes used),
the ``reason`` of any null score, ``blind``), ``protocol.json`` (what a resumed evaluation is checked against) and
``summary.json`` (written atomically at the end: every metric with its unparseable and unjudged counts and reasons,
the blind metrics and paired differences, the protocols, the config, the checkpoint and the sha256 of its trainable
weights, package versions). The data are read strictly (``data.skip_bad_samples`` does not apply): a bad line is a
one-line error naming its file and line, before the model loads.

Resume and determinism: the rows of ``samples.jsonl`` (keyed by benchmark, sample index and blind) are never
generated, scored or written again. Batches are fixed by position (sample ``i`` is in batch ``i // batch_size``), so
a batch a kill left half-written is generated again whole, and its missing rows are exactly those of a straight
run at the same ``limit``; ``batch_size`` is part of the protocol (padding changes the numerics). A larger ``limit``
on resume can change the composition (and padding) of the old last batch, so its new rows are those of a straight
run at the new limit only up to that batch's padding. The same checkpoint and protocol give
the same answers and numbers. Rows of another protocol or another model in the same ``output_dir`` are a one-line
error naming what differs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from mmrl.eval.runner import EVAL_KEYS as FLOW_EVAL_KEYS
from mmrl.eval.runner import (EvalError, _config_path, _float, _int, _jsonable, _nearest, _packages, _seed,
                              _resolve_checkpoint, _Checkpoint, _version, _write_json, checkpoint_text,
                              default_output_dir, open_output_dir, rows_of_protocol,
                              write_eval_report, summary_record, build_policy_with,
                              split_eval_args, benchmark_list)

__all__ = ["VLM_EVAL_KEYS", "VLM_BENCHMARKS", "TASK_BENCHMARKS", "GREY", "CHARADES_QUESTION", "VLMEvalOptions",
           "parse_vlm_eval_args", "VLMProtocol", "grey_media", "Judged", "judge", "sample_scores", "summarize",
           "run_vlm_eval"]

#: The eval keys of a vision-language evaluation; every other key must be a dotted config override.
VLM_EVAL_KEYS: dict[str, str] = {
    "checkpoint": FLOW_EVAL_KEYS["checkpoint"],
    "benchmarks": "list of rec, multi_object, temporal_grounding, multiple_choice, numeric, vsi_bench (the lines of "
                  "data=FILE with that task) and charades_sta (the shipped Charades-STA test annotations, videos from "
                  "video_dir=); default: every task in data=FILE",
    "data": "a VLM JSONL file (mmrl.data.vlm format; tiny:grounding, tiny:temporal_grounding, "
            "shapeworld:<split>:<n>[:<tasks>]); default: the config's data.dataset",
    "video_dir": "for charades_sta: the folder of the Charades v1 videos, <video_id>.mp4 (not shipped)",
    "output_dir": "where samples.jsonl, protocol.json and summary.json go; default RUN/eval/<checkpoint> or "
                  "<config output_dir>/eval/base; an existing one is resumed",
    "limit": "evaluate the first N samples of each benchmark",
    "batch_size": "questions per generation call (default 8); part of the protocol (padding changes the numerics)",
    "greedy": "greedy decoding (default true); false samples with the config's generation.temperature, top_p, "
              "top_k, min_p, repetition_penalty",
    "seed": "sampled decoding (greedy=false): batch b of a benchmark is drawn with seed + b (default 42)",
    "max_new_tokens": "answer budget in tokens (default: the config's generation.max_new_tokens)",
    "blind": "also answer every benchmark with each image and video frame replaced by a uniform grey (128,128,128) "
             "canvas of the same size, reported beside the real answers (default false)",
    "coord_format": "the answers' box coordinates: qwen2 (0-1000), qwen25 (pixels of the resized input), absolute "
                    "(original pixels); default from the model type (Qwen2-VL, Qwen3-VL: qwen2; Qwen2.5-VL: qwen25); "
                    "a line's own coord_format wins",
    "require_tags": "read answers only from their <answer>...</answer> block (default true, as VLM-R1's "
                    "test_rec_r1.py); false reads an untagged answer whole",
    "tg_convention": "temporal grounding: 2d_tan (default: R1@m counts tIoU > m, ground-truth ends clipped to the "
                     "video duration), timezero (tIoU >= m, no clipping) or time_r1 (tIoU > m, no clipping); both "
                     "read the last 'a to|and b' of the whole output",
    "rec_convention": "rec: mmrl (default: mmrl's box reading, the first box of the one answer block, floats and "
                      "bare lists read; continuous IoU) or vlm_r1 (VLM-R1 src/eval/test_rec_r1.py as written: its "
                      "regex on the first answer block, its IoU, and its sample: the lines shuffled by Python's "
                      "random.seed(42), the first 2000)",
    "answer_convention": "multiple_choice and numeric: mmrl (default: mmrl's readings, a choice letter by "
                         "mmrl.rewards.answer.parse_choice, the answer's one number within 1e-6 relative) or "
                         "video_r1 (Video-R1 src/eval_bench.py reward_fn as written: the first answer block, else the "
                         "whole output; multiple choice the exact stripped string, numerical 0 unless both or neither "
                         "have a '.' or ',', then equal rounded to 2 decimals)",
    "ema": FLOW_EVAL_KEYS["ema"],
    "progress": FLOW_EVAL_KEYS["progress"],
}

#: ``task`` field of a JSONL line -> the benchmark (metric) that scores it.
TASK_BENCHMARKS: dict[str, str] = {
    "grounding": "rec", "rec": "rec", "refcoco": "rec",
    "multi_object": "multi_object", "multi_object_grounding": "multi_object", "detection": "multi_object",
    "temporal_grounding": "temporal_grounding",
    "multiple_choice": "multiple_choice", "mc": "multiple_choice",
    "numeric": "numeric", "counting": "numeric",
    "vsi_bench": "vsi_bench", "vsibench": "vsi_bench",
}


@dataclass(frozen=True)
class _Metric:
    """A benchmark's scoring: its headline metric, the per-sample score that ranks samples, the per-sample score
    keys, the :mod:`mmrl.eval.scoring` function and the official rule it follows."""

    headline: str
    sample_score: str
    score_keys: tuple[str, ...]
    scorer: str
    source: str


_REC_SOURCE = ("om-ai-lab/VLM-R1 src/eval/test_rec_r1.py: IoU(answer box, ground truth) > 0.5 (strict), accuracy over "
               "every sample, an unreadable answer wrong; mIoU over the same samples; continuous-coordinate IoU "
               "(mmrl.rewards.grounding.box_iou). The answer is read by mmrl's box parser (the first box of the one "
               "answer block, as VLM-R1's training reward; floats and bare lists read, two answer blocks "
               "unparseable), more lenient than test_rec_r1.py's (integers inside {...}, its greedy regex's last box); "
               "rec_convention=vlm_r1 reads, scores and samples as test_rec_r1.py (its extract_bbox_answer, its "
               "iou() with the inclusive-pixel intersection, the lines shuffled by random.seed(42), the first 2000)")
_TG_SOURCE = ("microsoft/2D-TAN lib/core/eval.py eval() (R1@m: tIoU > m) and lib/datasets/charades.py (ground-truth "
              "end clipped to the duration); www-Ye/TimeZero evaluate.py process_work_items() with "
              "tg_convention=timezero (tIoU >= m, no clipping, the answer read by its parse_timestamp_output: the "
              "last '<a> to|and <b>' anywhere in the output; an unparsed span scores 0); xiaomi-research/time-r1 "
              "src/vllm_inference/eval_all.py with tg_convention=time_r1 (tIoU > m, no clipping, the same parse as "
              "evaluate.py extract_answer; an unparsed span scores 0)")
#: Benchmark name -> its scoring.
VLM_BENCHMARKS: dict[str, _Metric] = {
    "rec": _Metric("acc@0.5", "iou", ("iou", "acc@0.5"), "mmrl.eval.scoring.rec_scores", _REC_SOURCE),
    "multi_object": _Metric("f1", "f1", ("f1", "precision", "recall"), "mmrl.eval.scoring.multi_object_f1",
                            "one-to-one (Hungarian) matching at IoU >= 0.5 (mmrl.rewards.grounding.box_f1), per-sample "
                            "F1 = 2TP / (#pred + #gt), both empty 1, one empty 0; mean over samples and pooled "
                            "(micro)"),
    "temporal_grounding": _Metric("r1@0.5", "tiou", ("tiou", "r1@0.3", "r1@0.5", "r1@0.7"),
                                  "mmrl.eval.scoring.charades_sta_scores", _TG_SOURCE),
    "charades_sta": _Metric("r1@0.5", "tiou", ("tiou", "r1@0.3", "r1@0.5", "r1@0.7"),
                            "mmrl.eval.scoring.charades_sta_scores", _TG_SOURCE),
    "multiple_choice": _Metric("accuracy", "correct", ("correct",), "mmrl.eval.scoring.choice_accuracy",
                               "the answer's choice letter (mmrl.rewards.answer.parse_choice) equals the solution's"),
    "numeric": _Metric("accuracy", "correct", ("correct",), "mmrl.eval.scoring.numeric_accuracy",
                       "the answer's one number (mmrl.rewards._text.parse_number) within max(1e-6 |gt|, 1e-9) of the "
                       "solution's"),
    "vsi_bench": _Metric("overall", "score", ("score",), "mmrl.eval.scoring.vsi_bench_scores",
                         "vision-x-nyu/thinking-in-space lmms_eval/tasks/vsibench/utils.py: the answer's first word "
                         "(trailing dots removed); multiple-choice types its case-insensitive match with "
                         "ground_truth, numerical types the mean relative accuracy over thresholds .50:.05:.95 "
                         "(|pred - gt| / gt <= 1 - threshold); the mean per question type, the three relative-"
                         "direction types averaged into one, overall the mean of the categories. The answer is the "
                         "output's <answer> block when it has one (mmrl's rule, for think/answer models), else the "
                         "whole output as lmms-eval reads it"),
}
#: What each benchmark's rows are scored as (charades_sta is temporal grounding).
_KIND = {"charades_sta": "temporal_grounding"}
_JSONL_BENCHMARKS = ("rec", "multi_object", "temporal_grounding", "multiple_choice", "numeric", "vsi_bench")
#: ``rec_convention`` -> the scorer settings it adds (``mmrl``, the default, adds none: its protocol hash is the one
#: evaluations had before the option existed).
_REC_CONVENTIONS: dict[str, dict[str, Any]] = {
    "mmrl": {},
    "vlm_r1": {"rec_convention": "vlm_r1", "reading": "vlm_r1", "iou": "vlm_r1",
               "subsample": {"shuffle_seed": 42, "first": 2000}},
}
#: ``answer_convention`` values (multiple_choice, numeric): ``video_r1`` adds ``{"answer_convention": "video_r1"}``
#: to the scorer settings (``mmrl``, the default, adds none: the protocol hash evaluations had before)
ANSWER_CONVENTIONS = ("mmrl", "video_r1")
_TG_CONVENTIONS = {"2d_tan": {"strict": True, "clip_gt_to_duration": True},
                   "timezero": {"strict": False, "clip_gt_to_duration": False},
                   "time_r1": {"strict": True, "clip_gt_to_duration": False}}

#: The blind control's canvas colour.
GREY = (128, 128, 128)
_CANVAS = ("every image and every video frame replaced by a uniform RGB (128, 128, 128) canvas of the same size, "
           "after loading and resizing, before the processor (same vision tokens)")
#: The question asked for each Charades-STA query (wrapped by generation.question_template).
CHARADES_QUESTION = ('When does "{sentence}" happen in the video? Answer with the start and end time in seconds, '
                     'like "2.5 to 7.0".')
_DEFAULT_BATCH = 8
_DEFAULT_SEED = 42


# --------------------------------------------------------------------------------------------------- keys


@dataclass
class VLMEvalOptions:
    """The parsed eval keys (see :data:`VLM_EVAL_KEYS`); ``given`` lists the keys the user set."""

    checkpoint: str | None = None
    benchmarks: list[str] | None = None  # None: every task in the data file
    data: str | None = None
    video_dir: str | None = None
    output_dir: str | None = None
    limit: int | None = None
    batch_size: int = _DEFAULT_BATCH
    greedy: bool = True
    seed: int = _DEFAULT_SEED
    max_new_tokens: int | None = None
    blind: bool = False
    coord_format: str | None = None
    require_tags: bool = True
    tg_convention: str = "2d_tan"
    rec_convention: str = "mmrl"
    answer_convention: str = "mmrl"
    ema: bool = True
    progress: bool | None = None
    given: tuple[str, ...] = ()

    def record(self) -> dict[str, Any]:
        """The keys the user gave, for ``summary.json`` (``output_dir`` left out: it is where the summary is)."""
        return {k: getattr(self, k) for k in self.given if k != "output_dir"}


def _benchmark_name(name: str) -> str:
    """Check one ``benchmarks`` entry."""
    from mmrl.eval.benchmarks import USER_SUPPLIED

    if name in VLM_BENCHMARKS:
        return name
    valid = ", ".join(VLM_BENCHMARKS)
    if name == "refcoco":
        raise EvalError(f"benchmark 'refcoco': {USER_SUPPLIED['refcoco']}; mmrl reads RefCOCO as its VLM JSONL (one "
                        f"line per referring expression: image, question, solution, task: grounding, boxes): give "
                        f"data=FILE with benchmarks=[rec]")
    if name in ("ocr", "geneval") or name.startswith("reward:"):
        raise EvalError(f"benchmark {name!r} scores generated images; a vision-language policy (model.family: "
                        f"qwen_vl) answers questions: benchmarks {valid}")
    close = _nearest(name, list(VLM_BENCHMARKS) + ["refcoco"])
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise EvalError(f"unknown benchmark {name!r}; {hint}vision-language benchmarks: {valid}")


def parse_vlm_eval_args(items: Sequence[str]) -> tuple[VLMEvalOptions, list[str]]:
    """Split ``key=value`` arguments into the eval keys (:data:`VLM_EVAL_KEYS`, values parsed as YAML) and the dotted
    config overrides, checking every eval value (as :func:`mmrl.eval.runner.parse_eval_args` does for flows)."""
    from mmrl.rewards.grounding import COORD_FORMATS

    def flow_key(key: str) -> None:
        if key in FLOW_EVAL_KEYS:
            raise EvalError(f"eval key {key!r} is for image-generation policies (sd3, flux); a vision-language "
                            f"evaluation (model.family: qwen_vl) takes: {', '.join(VLM_EVAL_KEYS)}")

    values, overrides = split_eval_args(items, VLM_EVAL_KEYS, unknown=flow_key)
    options = VLMEvalOptions(given=tuple(values))
    for key, value in values.items():
        if key in ("limit", "batch_size", "max_new_tokens"):
            value = _int(key, value, 1)
        elif key == "seed":
            value = _seed(value)
        elif key in ("greedy", "blind", "require_tags", "ema", "progress"):
            if not isinstance(value, bool):
                raise EvalError(f"{key}={value!r}: expected true or false")
        elif key == "benchmarks":
            value = benchmark_list(value, "benchmarks=[rec,charades_sta]", _benchmark_name)
        elif key == "coord_format":
            if value not in COORD_FORMATS:
                raise EvalError(f"coord_format={value!r}: expected one of {', '.join(COORD_FORMATS)}")
        elif key == "tg_convention":
            if value not in _TG_CONVENTIONS:
                raise EvalError(f"tg_convention={value!r}: expected one of {', '.join(_TG_CONVENTIONS)}")
        elif key == "rec_convention":
            if value not in _REC_CONVENTIONS:
                raise EvalError(f"rec_convention={value!r}: expected one of {', '.join(_REC_CONVENTIONS)}")
        elif key == "answer_convention":
            if value not in ANSWER_CONVENTIONS:
                raise EvalError(f"answer_convention={value!r}: expected one of {', '.join(ANSWER_CONVENTIONS)}")
        else:  # checkpoint, output_dir, data, video_dir
            if value is None or isinstance(value, (dict, list)) or str(value).strip() == "":
                raise EvalError(f"{key}={value!r}: expected a path or name")
            value = str(value)
        setattr(options, key, value)
    if "seed" in values and options.greedy:
        raise EvalError("seed= is for sampled answers (greedy=false); greedy decoding has no randomness")
    return options, overrides


# --------------------------------------------------------------------------------------------------- protocol


#: Protocol fields that decide one answer and its score (what :meth:`VLMProtocol.hash` covers).
_HASHED = ("benchmark", "data_sha256", "scorer", "scorer_settings", "generation")


@dataclass(frozen=True)
class VLMProtocol:
    """One VLM benchmark's protocol: the data file and its sha256, how many samples, how answers are generated
    (``generation``: decoding, budget, batch size, prompt template, pixel and frame budgets) and scored
    (``scorer``, ``scorer_settings``: coordinate format, answer tags, thresholds and conventions).

    :meth:`hash` covers what decides an answer and its score, not how many samples are taken or whether the blind
    control runs: a resumed evaluation with a larger ``limit`` or ``blind=true`` keeps its rows. ``overridden``:
    ``{field: {"default", "used"}}`` for every value the user changed. The media files' content is not hashed."""

    benchmark: str
    data_file: str
    data_sha256: str
    total_samples: int
    num_samples: int
    scorer: str
    scorer_source: str
    scorer_settings: dict
    generation: dict
    media_root: str | None = None
    blind: bool = False
    blind_canvas: str = _CANVAS
    overridden: dict = field(default_factory=dict)

    def hash(self) -> str:
        key = {name: getattr(self, name) for name in _HASHED}
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "hash": self.hash()}

    def differences(self, other: Mapping[str, Any]) -> list[str]:
        """``"field: theirs -> ours"`` for each hashed field (or setting) where ``other`` (a :meth:`to_dict`)
        differs."""
        out = []
        for name in _HASHED:
            mine, theirs = getattr(self, name), other.get(name)
            if isinstance(mine, dict) and isinstance(theirs, dict):
                for key in sorted(set(mine) | set(theirs)):
                    if json.dumps(mine.get(key), default=str) != json.dumps(theirs.get(key), default=str):
                        out.append(f"{name}.{key}: {theirs.get(key)!r} -> {mine.get(key)!r}")
            elif json.dumps(mine, sort_keys=True, default=str) != json.dumps(theirs, sort_keys=True, default=str):
                out.append(f"{name}: {theirs!r} -> {mine!r}")
        return out


def _scorer_settings(name: str, options: VLMEvalOptions, coord_format: str | None) -> dict[str, Any]:
    kind = _KIND.get(name, name)
    settings: dict[str, Any] = {"require_tags": options.require_tags}
    if kind in ("rec", "multi_object"):
        settings.update(coord_format=coord_format, iou_threshold=0.5)
        if kind == "rec":
            settings.update(_REC_CONVENTIONS[options.rec_convention])
    elif kind == "temporal_grounding":
        settings.update(convention=options.tg_convention, thresholds=[0.3, 0.5, 0.7], time_unit="seconds",
                        **_TG_CONVENTIONS[options.tg_convention])
    elif kind == "numeric" and options.answer_convention == "mmrl":
        settings.update(rel_tol=1e-6, abs_tol=1e-9)
    if kind in ("multiple_choice", "numeric") and options.answer_convention != "mmrl":
        settings.update(answer_convention=options.answer_convention)
    return settings


def _generation(cfg, options: VLMEvalOptions, name: str) -> dict[str, Any]:
    g = cfg.generation
    out = {"greedy": options.greedy, "max_new_tokens": options.max_new_tokens or g.max_new_tokens,
           "batch_size": options.batch_size, "seed": None if options.greedy else options.seed,
           "temperature": None if options.greedy else g.temperature, "top_p": None if options.greedy else g.top_p,
           "top_k": None if options.greedy else g.top_k, "min_p": None if options.greedy else g.min_p,
           "repetition_penalty": None if options.greedy else g.repetition_penalty,
           "max_prompt_length": g.max_prompt_length,
           "system_prompt": g.system_prompt, "question_template": g.question_template, "min_pixels": g.min_pixels,
           "max_pixels": g.max_pixels, "video_fps": g.video_fps, "video_nframes": g.video_nframes,
           "video_max_frames": g.video_max_frames, "video_max_pixels": g.video_max_pixels,
           "video_min_pixels": g.video_min_pixels, "video_total_pixels": g.video_total_pixels}
    if name == "charades_sta":
        out["question"] = CHARADES_QUESTION
    return out


def _vlm_generator(cfg, ckpt: _Checkpoint) -> dict[str, Any]:
    """What decides the answers besides the protocol: the model and the weights (``hash`` as
    :func:`mmrl.eval.runner._generator` makes it for flows, over the same kind of record)."""
    m = cfg.model
    record = {"family": m.family, "pretrained": m.pretrained, "revision": m.revision, "dtype": m.dtype,
              "attn_implementation": m.attn_implementation, "use_lora": m.use_lora, "lora_rank": m.lora_rank,
              "lora_alpha": m.lora_alpha, "lora_target_modules": list(m.lora_target_modules),
              "freeze_vision": m.freeze_vision, "checkpoint": ckpt.name,
              "ema": ckpt.ema, "weights_sha256": ckpt.sha256}
    key = {k: v for k, v in record.items() if k != "checkpoint"}  # the folder may move; the weights' hash decides
    record["hash"] = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return record


def _model_coord_format(cfg) -> tuple[str | None, str | None]:
    """``(model type, its box coordinate format)``, read as :func:`mmrl.build.build_reward_fn` reads them
    (:func:`mmrl.build.policy_model_type`); ``(None, None)`` when it cannot be read."""
    from mmrl.build import policy_model_type
    from mmrl.rewards.grounding import QWEN_COORD_FORMATS

    model_type = policy_model_type(cfg, warn=False)
    return model_type, QWEN_COORD_FORMATS.get(model_type)


# --------------------------------------------------------------------------------------------------- the blind control


def grey_media(media: Callable) -> Callable:
    """``media`` (``sample -> (images, video clip)``, :func:`mmrl.build.vlm_media`) with every image and every video
    frame replaced by a uniform :data:`GREY` canvas of the same size: the blind control's input. The pixels are
    loaded (and resized to the pixel budget) first, so the canvases have the sizes, and the prompts the vision
    tokens, of the real inputs; the sample's size metadata (``image_size``, ``input_size``) is the real one."""
    import torch
    from PIL import Image

    def blind(sample):
        images, video = media(sample)
        images = [Image.new("RGB", image.size, GREY) for image in images]
        if video is not None:
            video = dataclasses.replace(video, frames=torch.full_like(video.frames, GREY[0]))
        return images, video

    blind.images_at_final_size = getattr(media, "images_at_final_size", False)
    return blind


# --------------------------------------------------------------------------------------------------- scoring


@dataclass
class Judged:
    """One answer read against its ground truth.

    ``target``: the ground truth as scored (box, boxes, ``[start, end]``, letter, number; ``None`` when the line
    has none); ``judged``: False when the sample cannot be scored (``reason`` says why: every score null);
    ``pred``: the parsed prediction in the benchmark's units (original-image pixels, seconds, letter, number), or
    ``None`` when the answer is unparseable (``unparseable`` says why: scores 0); ``details``: what the reading
    used (coordinate format and sizes, duration)."""

    target: Any
    judged: bool = True
    reason: str | None = None
    pred: Any = None
    unparseable: str | None = None
    details: dict = field(default_factory=dict)


def _target(kind: str, meta: Mapping) -> Any:
    """The ground truth of one line, or :class:`~mmrl.rewards._text.Unjudgeable` naming what is missing."""
    from mmrl.rewards._text import Unjudgeable, Unparseable
    from mmrl.rewards.answer import _choices, _number_solution, _solution_text, parse_choice
    from mmrl.rewards.grounding import _gt_boxes, _gt_span

    if kind == "rec":
        boxes = _gt_boxes(meta, "rec")
        if len(boxes) != 1:
            raise Unjudgeable(f"rec scores one ground-truth box per sample, the line has {len(boxes)} (task "
                              f"multi_object scores several)")
        return boxes[0]
    if kind == "multi_object":
        return _gt_boxes(meta, "multi_object")
    if kind == "temporal_grounding":
        return list(_gt_span(meta, "temporal_grounding"))
    if kind == "multiple_choice":
        choices = _choices(meta)
        solution = _solution_text(meta, "multiple_choice")
        try:
            return parse_choice(str(solution), choices)
        except Unparseable as exc:
            raise Unjudgeable(f"metadata 'solution' {solution!r} is not a choice letter ({exc})") from None
    if kind == "numeric":
        return _number_solution(meta, "numeric")
    if kind == "vsi_bench":
        from mmrl.eval.scoring import VSI_MCA_TYPES, VSI_NA_TYPES

        qtype = meta.get("question_type")
        if qtype not in VSI_MCA_TYPES + VSI_NA_TYPES:
            raise Unjudgeable(f"metadata 'question_type' {qtype!r} is not a VSI-Bench question type")
        truth = meta.get("ground_truth", meta.get("solution"))
        if truth is None:
            raise Unjudgeable("metadata has no 'ground_truth' (needed by vsi_bench)")
        if qtype in VSI_NA_TYPES:
            try:
                if float(truth) == 0:
                    raise ValueError
            except (TypeError, ValueError):
                raise Unjudgeable(f"metadata 'ground_truth' {truth!r} is not a non-zero number (a numerical "
                                  f"VSI-Bench answer; the relative error divides by it)") from None
        return {"question_type": qtype, "ground_truth": str(truth)}
    raise ValueError(kind)


def judge(kind: str, answer: str | None, meta: Mapping, settings: Mapping[str, Any], *,
          failure: str | None = None) -> Judged:
    """Read one answer of benchmark kind ``kind`` (``rec``, ``multi_object``, ``temporal_grounding``,
    ``multiple_choice``, ``numeric``) against the line's metadata with mmrl's reward parsers: boxes through the box
    rewards' reading (:class:`mmrl.rewards.grounding.BoxIoU` / ``BoxF1``: ``coord_format``, rescaling to original
    pixels), spans with :func:`~mmrl.rewards.grounding.parse_timestamps`, letters with
    :func:`~mmrl.rewards.answer.parse_choice`, numbers with :func:`~mmrl.rewards._text.parse_number`, the answer
    block with :func:`~mmrl.rewards._text.answer_or_text`. ``answer=None`` (no answer: ``failure`` says why) is
    unjudged."""
    from mmrl.rewards._text import Unjudgeable, Unparseable, answer_or_text, parse_number
    from mmrl.rewards.answer import _choices, parse_choice
    from mmrl.rewards.grounding import BoxF1, BoxIoU, parse_timestamps, parse_timezero_span, parse_vlm_r1_box, \
        rescale_box

    require_tags = bool(settings.get("require_tags", True))
    if kind in ("multiple_choice", "numeric") and settings.get("answer_convention") == "video_r1":
        return _judge_video_r1(kind, answer, meta, failure)
    try:
        target = _target(kind, meta)
    except Unjudgeable as exc:
        raw = {"rec": "boxes", "multi_object": "boxes", "temporal_grounding": "timestamps"}.get(kind, "solution")
        return Judged(_jsonable(meta.get(raw)), judged=False, reason=str(exc))
    details: dict[str, Any] = {}
    if kind == "temporal_grounding":
        details["duration"] = meta.get("duration")
    if kind in ("rec", "multi_object"):
        details.update(coord_format=meta.get("coord_format") or settings.get("coord_format"),
                       image_size=meta.get("image_size"), input_size=meta.get("input_size"))
    if answer is None:
        return Judged(target, judged=False, reason=failure or "no answer", details=details)
    try:
        if kind in ("rec", "multi_object"):
            reward = (BoxIoU if kind == "rec" else BoxF1)(require_tags=require_tags,
                                                          coord_format=settings.get("coord_format"))
            try:
                if settings.get("reading") == "vlm_r1":  # test_rec_r1.py's regex, then its rescaling
                    boxes = [rescale_box(parse_vlm_r1_box(answer), reward._format(meta), meta.get("image_size"),
                                         meta.get("input_size"))]
                else:
                    boxes, _ = reward._boxes(answer, meta)  # the box rewards' reading: coord_format, rescaling
            except Unjudgeable as exc:
                return Judged(target, judged=False, reason=str(exc), details=details)
            if kind == "multi_object":
                pred = boxes  # [] is an explicit "nothing there"
            elif not boxes:
                raise Unparseable("the answer has no box")
            else:
                pred = boxes[0]  # the first box, as VLM-R1's training reward (test_rec_r1.py's greedy regex: the last)
        elif kind == "temporal_grounding" and settings.get("convention") in ("timezero", "time_r1"):
            pred = list(parse_timezero_span(answer))  # TimeZero's and Time-R1's evaluate.py read the whole output
        elif kind == "temporal_grounding":
            pred = list(parse_timestamps(answer_or_text(answer, require_tags)))
        elif kind == "multiple_choice":
            pred = parse_choice(answer_or_text(answer, require_tags), _choices(meta))
        elif kind == "vsi_bench":
            pred = answer_or_text(answer, False) if "<answer>" in answer else answer  # scored by its first word
        else:
            pred = parse_number(answer_or_text(answer, require_tags))
    except Unparseable as exc:
        return Judged(target, pred=None, unparseable=exc.reason, details=details)
    return Judged(target, pred=pred, details=details)


def _judge_video_r1(kind: str, answer: str | None, meta: Mapping, failure: str | None) -> Judged:
    """Video-R1's ``src/eval_bench.py`` reading: the answer is the first ``<answer>`` block (stripped), or the whole
    output when there is none (or it is empty); the solution likewise its answer block (mmrl's rule where it has
    none: the whole solution, stripped; Video-R1's would be empty). Scored by
    :func:`mmrl.eval.scoring.video_r1_answer_accuracy`; nothing is unparseable."""
    from mmrl.rewards.video_r1 import video_r1_extract_answer

    solution = meta.get("solution")
    if not isinstance(solution, str) or not solution.strip():
        return Judged(_jsonable(solution), judged=False, reason="metadata has no 'solution' text")
    block = video_r1_extract_answer(solution)
    target = solution.strip() if block is None else block
    if answer is None:
        return Judged(target, judged=False, reason=failure or "no answer")
    read = video_r1_extract_answer(answer)
    return Judged(target, pred=answer if not read else read)


def _official(kind: str, preds: list, gts: list, durations: list, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The :mod:`mmrl.eval.scoring` function of ``kind`` on predictions and ground truths (``None`` gt: unjudged)."""
    from mmrl.eval import scoring

    if kind in ("multiple_choice", "numeric") and settings.get("answer_convention") == "video_r1":
        return scoring.video_r1_answer_accuracy(preds, gts, kind)

    if kind == "rec":
        return scoring.rec_scores(preds, gts, iou_threshold=settings.get("iou_threshold", 0.5),
                                  iou=settings.get("iou", "continuous"))
    if kind == "multi_object":
        return scoring.multi_object_f1(preds, gts, iou_threshold=settings.get("iou_threshold", 0.5))
    if kind == "temporal_grounding":
        return scoring.charades_sta_scores(preds, gts, durations, tuple(settings.get("thresholds", (0.3, 0.5, 0.7))),
                                           strict=settings.get("strict", True),
                                           clip_gt_to_duration=settings.get("clip_gt_to_duration", True))
    if kind == "multiple_choice":
        return scoring.choice_accuracy(preds, gts)
    if kind == "numeric":
        return scoring.numeric_accuracy(preds, gts, rel_tol=settings.get("rel_tol", 1e-6),
                                        abs_tol=settings.get("abs_tol", 1e-9))
    if kind == "vsi_bench":
        return scoring.vsi_bench_scores(preds, gts)
    raise ValueError(kind)


def sample_scores(kind: str, judged: Judged, settings: Mapping[str, Any]) -> tuple[dict[str, float | None], str | None]:
    """``(scores, reason)`` of one sample: the benchmark's official function on this one sample, so a benchmark's
    mean of a per-sample score is its metric. Unparseable: 0 for every score; unjudged: every score ``None`` with
    the reason (also when the rule itself leaves the sample out, e.g. a ground truth empty after clipping)."""
    gt = judged.target if judged.judged else None
    r = _official(kind, [judged.pred], [gt], [judged.details.get("duration")], settings)
    if kind == "rec":
        scores = {"iou": r["ious"][0], "acc@0.5": r[f"acc@{settings.get('iou_threshold', 0.5):g}"]}
    elif kind == "multi_object":
        scores = {k: r[k] for k in ("f1", "precision", "recall")}
    elif kind == "temporal_grounding":
        scores = {"tiou": r["tious"][0], **{f"r1@{m:g}": r[f"r1@{m:g}"] for m in settings.get("thresholds",
                                                                                            (0.3, 0.5, 0.7))}}
    elif kind == "vsi_bench":
        scores = {"score": r["scores"][0]}
    else:
        scores = {"correct": r["accuracy"]}
    scores = {k: _float(v) for k, v in scores.items()}
    reason = judged.reason
    if reason is None and any(v is None for v in scores.values()):
        reason = ("the ground-truth span is empty after clipping its end to the video's duration (2D-TAN's loader "
                  "drops it)" if kind == "temporal_grounding" else "the scorer could not judge the sample")
    return scores, reason


def summarize(name: str, rows: Sequence[Mapping], settings: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics of one benchmark from its rows (``verdict.pred``, ``target``; unjudged rows as ``None`` ground
    truths), by its :mod:`mmrl.eval.scoring` function; per-sample lists left out (they are in the rows)."""
    kind = _KIND.get(name, name)
    preds = [r["verdict"].get("pred") for r in rows]
    gts = [r["target"] if r["verdict"].get("judged") else None for r in rows]
    durations = [r["verdict"].get("duration") for r in rows]
    out = _official(kind, preds, gts, durations, settings)
    return {k: v for k, v in out.items() if not isinstance(v, list)}


# --------------------------------------------------------------------------------------------------- samples


@dataclass
class _Plan:
    """One benchmark to run: its samples (``(index, VLMSample)``, the first ``num_samples``), protocol, and the folder
    media paths are shown relative to in the rows."""

    name: str
    samples: list
    protocol: VLMProtocol
    media_base: Path
    warnings: list = field(default_factory=list)


def _data_samples(options: VLMEvalOptions, cfg) -> tuple[dict[str, list], Path]:
    """The JSONL's samples grouped by benchmark, in file order: ``({benchmark: [(index, sample), ...]}, file)``."""
    from mmrl.build import resolve_vlm_dataset
    from mmrl.config import ConfigError
    from mmrl.data.prompts import DataError
    from mmrl.data.vlm import read_vlm_jsonl

    value = options.data or cfg.data.dataset
    if value is None:
        raise EvalError("no data to evaluate: give data=FILE (a VLM JSONL) or set data.dataset in the config, or run "
                        "benchmarks=[charades_sta] video_dir=DIR")
    try:
        path = Path(resolve_vlm_dataset(cfg, value, where=f"{'data=' if options.data else 'data.dataset='}{value}"))
    except ConfigError as exc:
        raise EvalError(str(exc)) from None
    if not path.is_file():
        where = "data=" if options.data else "data.dataset="
        hint = "" if path.is_absolute() else " (relative paths resolve from the working directory)"
        raise EvalError(f"{where}{value}: VLM data file not found: {path}{hint}")
    try:
        samples = read_vlm_jsonl(path, verify_images=True, verify_videos=True)
    except DataError as exc:  # "<file>:<line>: <what was expected>"
        raise EvalError(str(exc)) from None
    wanted = options.benchmarks
    groups: dict[str, list] = {}
    for sample in samples:
        name = TASK_BENCHMARKS.get(sample.task)
        if name is None:
            if wanted is None:
                tasks = ", ".join(f"{t} ({b})" for t, b in TASK_BENCHMARKS.items())
                raise EvalError(f"{sample.source}: task {sample.task!r} has no evaluation metric; tasks mmrl eval "
                                f"scores (benchmark): {tasks}; or choose benchmarks=[...] to leave other lines out")
            continue
        group = groups.setdefault(name, [])
        group.append((len(group), sample))
    return groups, path


def _charades_samples(options: VLMEvalOptions) -> tuple[list, Path, Path]:
    """The shipped Charades-STA test queries as samples with videos from ``video_dir`` (checked: present, and the
    used ones probed): ``([(index, sample), ...], annotation file, video_dir)``."""
    from mmrl.data.prompts import DataError
    from mmrl.data.vlm import VLMSample, check_all_media
    from mmrl.eval.benchmarks import USER_SUPPLIED, load_charades_sta

    if options.video_dir is None:
        raise EvalError(f"benchmark charades_sta needs the Charades videos: video_dir=DIR holding <video_id>.mp4 "
                        f"({USER_SUPPLIED['charades_sta']})")
    video_dir = Path(options.video_dir)
    if not video_dir.is_dir():
        raise EvalError(f"video_dir={options.video_dir}: no such folder (relative paths resolve from the working "
                        f"directory)")
    try:
        queries = load_charades_sta()
    except DataError as exc:
        raise EvalError(str(exc)) from None
    samples = []
    for q in queries:
        sample_id = f"{q.video_id}#{q.index}"
        question = CHARADES_QUESTION.format(sentence=q.sentence.strip().rstrip("."))
        span = [q.start, q.end]
        meta = {"task": "temporal_grounding", "id": sample_id, "solution": f"{q.start:g} to {q.end:g}",
                "timestamps": span, "duration": q.duration, "video_id": q.video_id, "sentence": q.sentence}
        samples.append((q.index, VLMSample(id=sample_id, question=question, solution=meta["solution"],
                                           video_path=str((video_dir / f"{q.video_id}.mp4").absolute()),
                                           task="temporal_grounding", metadata=meta,
                                           source=f"{queries.source}:{q.line} (video {q.video_id}, moment {q.index})")))
    used = samples[:options.limit] if options.limit else samples
    missing = [s for _, s in used if not Path(s.video_path).is_file()]
    if missing:
        raise EvalError(f"video_dir={options.video_dir}: {len(missing)} of the {len(used)} Charades-STA queries' "
                        f"videos are missing, e.g. {missing[0].video_path} (for {missing[0].source}); "
                        f"{USER_SUPPLIED['charades_sta']}")
    problems = check_all_media([s for _, s in used], images=False, videos=True)
    for (_, sample), found in zip(used, problems):
        if found:
            raise EvalError(f"{sample.source}: {'; '.join(found)}")
    return samples, Path(queries.source), video_dir


def _media_fields(sample, base: Path) -> dict[str, Any]:
    """The row's ``image`` / ``images`` / ``video``: paths relative to ``base`` (the data file's folder, the video
    folder) when they lie in it, as the data file gives them, else absolute."""

    def shown(path: str) -> str:
        try:
            return Path(os.path.relpath(path, base)).as_posix() if Path(path).is_relative_to(base) else path
        except ValueError:  # another drive
            return path

    out: dict[str, Any] = {}
    if len(sample.image_paths) == 1:
        out["image"] = shown(sample.image_paths[0])
    elif sample.image_paths:
        out["images"] = [shown(p) for p in sample.image_paths]
    if sample.video_path is not None:
        out["video"] = shown(sample.video_path)
    return out


# --------------------------------------------------------------------------------------------------- the run


def run_vlm_eval(config: str | Path, args: Sequence[str] = (), *, echo: Callable[[str], None] = print
                 ) -> dict[str, Any]:
    """Run ``mmrl eval CONFIG args...`` for a ``qwen_vl`` CONFIG (see the module docstring); returns the summary
    written to ``summary.json``. Every check that needs no model (keys, config, benchmarks, data lines and media,
    the Charades videos, the checkpoint, an existing ``output_dir``'s protocol) is done before the model loads."""
    from mmrl.config import load_config

    started = time.time()
    options, overrides = parse_vlm_eval_args(args)
    config_file, run_dir = _config_path(config)
    cfg = load_config(config_file, overrides, check_files=False)
    run_dir = run_dir or Path(cfg.output_dir)
    plans = plan_vlm_eval(cfg, options)
    ckpt = _resolve_checkpoint(options, run_dir)
    out = default_output_dir(options, ckpt, cfg, run_dir)
    return _run(cfg, options, overrides, plans, ckpt, out, config_file, echo=echo, started=started)


def plan_vlm_eval(cfg, options: VLMEvalOptions) -> list[_Plan]:
    """Check the requested benchmarks, read their samples (every data line and its media) and resolve their
    protocols, building no model."""
    if options.video_dir is not None and options.benchmarks is not None and "charades_sta" not in options.benchmarks:
        raise EvalError("video_dir= is for the charades_sta benchmark, which is not requested")
    if options.data is not None and options.benchmarks is not None and \
            not any(b in _JSONL_BENCHMARKS for b in options.benchmarks):
        raise EvalError(f"data= is for the JSONL benchmarks ({', '.join(_JSONL_BENCHMARKS)}); none is requested")

    # ---- the samples of every benchmark
    found: dict[str, tuple[list, Path, Path]] = {}  # name -> (samples, file read, media base)
    requested = options.benchmarks
    if requested is None or any(b in _JSONL_BENCHMARKS for b in requested):
        groups, data_path = _data_samples(options, cfg)
        for name in (requested or [b for b in _JSONL_BENCHMARKS if b in groups]):
            if name not in _JSONL_BENCHMARKS:
                continue
            if name not in groups:
                tasks = ", ".join(t for t, b in TASK_BENCHMARKS.items() if b == name)
                raise EvalError(f"benchmark {name}: {data_path} has no line with task {tasks}")
            found[name] = (groups[name], data_path, data_path.absolute().parent)
    if requested is not None and "charades_sta" in requested:
        samples, annotations, video_dir = _charades_samples(options)
        found["charades_sta"] = (samples, annotations, video_dir.absolute())
    names = requested or list(found)

    coord_format, model_type = options.coord_format, None
    if coord_format is None and any(_KIND.get(n, n) in ("rec", "multi_object") for n in names):
        model_type, coord_format = _model_coord_format(cfg)
    plans: list[_Plan] = []
    for name in names:
        samples, path, base = found[name]
        settings = _scorer_settings(name, options, coord_format)
        if "subsample" in settings:  # VLM-R1: random.seed(42); random.shuffle(data); data[:2000]
            samples = list(samples)
            random.Random(settings["subsample"]["shuffle_seed"]).shuffle(samples)
            samples = samples[:settings["subsample"]["first"]]
        num = len(samples) if options.limit is None else min(options.limit, len(samples))
        generation = _generation(cfg, options, name)
        defaults = {"num_samples": len(samples), "greedy": True, "batch_size": _DEFAULT_BATCH,
                    "max_new_tokens": cfg.generation.max_new_tokens, "require_tags": True}
        used = {"num_samples": num, "greedy": options.greedy, "batch_size": options.batch_size,
                "max_new_tokens": generation["max_new_tokens"], "require_tags": options.require_tags}
        if "convention" in settings:
            defaults["tg_convention"], used["tg_convention"] = "2d_tan", options.tg_convention
        if _KIND.get(name, name) == "rec":
            defaults["rec_convention"], used["rec_convention"] = "mmrl", options.rec_convention
        if name in ("multiple_choice", "numeric"):
            defaults["answer_convention"], used["answer_convention"] = "mmrl", options.answer_convention
        if "coord_format" in settings and options.coord_format is not None:
            defaults["coord_format"] = _model_coord_format(cfg)[1]
            used["coord_format"] = options.coord_format
        overridden = {k: {"default": defaults[k], "used": used[k]} for k in used if used[k] != defaults[k]}
        metric = VLM_BENCHMARKS[name]
        protocol = VLMProtocol(
            benchmark=name, data_file=str(path.absolute()), data_sha256=_sha256(path), total_samples=len(samples),
            num_samples=num, scorer=metric.scorer, scorer_source=metric.source, scorer_settings=settings,
            generation=generation, media_root=str(base) if name == "charades_sta" else None, blind=options.blind,
            overridden=overridden)
        plans.append(_Plan(name, samples[:num], protocol, base))
    if coord_format is None and any(_KIND.get(p.name, p.name) in ("rec", "multi_object") for p in plans):
        for plan in plans:
            plan.warnings.append(f"the box coordinate format of model type {model_type!r} is not known: lines "
                                 f"without coord_format are not judged (give coord_format=qwen2, qwen25 or absolute)")
    return plans


def _run(cfg, options: VLMEvalOptions, overrides: Sequence[str], plans: list[_Plan], ckpt: _Checkpoint, out: Path,
         config_file: Path | None, *, echo: Callable[[str], None], started: float, policy=None) -> dict[str, Any]:
    """Answer what ``out`` lacks, score it, write ``summary.json``. ``policy``: an already built policy with the
    weights ``ckpt`` describes (evaluation during training); ``None`` builds one from ``cfg`` and loads ``ckpt``."""
    # ---- an existing output_dir: same model, same protocols, or a one-line error
    generator = _vlm_generator(cfg, ckpt)
    samples_file = out / "samples.jsonl"
    state_file = out / "protocol.json"
    state, rows = open_output_dir(out, generator)
    done: dict[tuple[str, int, bool], dict] = {}
    for plan in plans:
        for r in rows_of_protocol(out, rows, state, plan.name, plan.protocol, "answers"):
            done[(plan.name, int(r["prompt_index"]), bool(r.get("blind", False)))] = r
    passes = [False, True] if options.blind else [False]
    missing = sum(1 for plan in plans for index, _ in plan.samples for blind in passes
                  if (plan.name, index, blind) not in done)

    echo(f"mmrl eval: {config_file}, checkpoint {checkpoint_text(ckpt, cfg)} -> {out}")
    for plan in plans:
        p, g = plan.protocol, plan.protocol.generation
        changed = ", ".join(f"{k} {v['default']} -> {v['used']}" for k, v in p.overridden.items())
        have = sum(1 for key in done if key[0] == plan.name and key[1] < p.num_samples and key[2] in passes)
        coord = p.scorer_settings.get("coord_format", "")
        echo(f"  {plan.name}: {p.num_samples} of {p.total_samples} samples from {p.data_file}, "
             f"{'greedy' if g['greedy'] else 'sampled'}, {g['max_new_tokens']} new tokens, batches of "
             f"{g['batch_size']}{', coordinates ' + str(coord) if coord != '' else ''}"
             f"{', with the blind control' if options.blind else ''}{'; overridden: ' + changed if changed else ''}"
             f"{f'; {have} answer(s) already in samples.jsonl' if have else ''}")
    for warning in dict.fromkeys(w for plan in plans for w in plan.warnings):
        echo(f"  warning: {warning}")

    out.mkdir(parents=True, exist_ok=True)
    state = {"generator": generator, "benchmarks": {**state.get("benchmarks", {}),
                                                    **{p.name: p.protocol.to_dict() for p in plans}}}
    _write_json(state_file, state)

    if missing:
        _generate(plans, passes, done, ckpt, cfg, generator, samples_file, options, policy=policy)

    # ---- summary
    from mmrl.eval.scoring import blind_control

    benchmarks: dict[str, Any] = {}
    for plan in plans:
        metric, settings = VLM_BENCHMARKS[plan.name], plan.protocol.scorer_settings
        result: dict[str, Any] = {}
        for blind in passes:
            rows_b = [done[(plan.name, index, blind)] for index, _ in plan.samples]
            part = _part(plan.name, rows_b, settings, metric)
            if not blind:
                result.update(part)
                real_rows = rows_b
            else:
                result["blind"] = part
                flat = [[{"prompt_index": r["prompt_index"], **r["scores"]} for r in side]
                        for side in (real_rows, rows_b)]
                result["blind_control"] = blind_control(flat[0], flat[1], metrics=list(metric.score_keys),
                                                        key="prompt_index")
        result.update(protocol=plan.protocol.to_dict(), headline=metric.headline, sample_score=metric.sample_score)
        benchmarks[plan.name] = result
    summary = summary_record(cfg, config_file, ckpt, generator, benchmarks, options, overrides,
                             {**_packages(), "decord": _version("decord"), "av": _version("av")})
    _write_json(out / "summary.json", summary)
    for name, result in benchmarks.items():
        echo(f"  {name}: {_headline(result)}")
    report = write_eval_report(out, echo)
    echo(f"wrote {out / 'summary.json'}, samples.jsonl{', ' + report.name if report else ''} ({missing} answer(s) "
         f"generated, {time.time() - started:.1f} s)")
    return summary


def _sha256(path: Path) -> str:
    from mmrl.eval.protocol import file_sha256

    return file_sha256(path)


def _part(name: str, rows: list[dict], settings: Mapping[str, Any], metric: _Metric) -> dict[str, Any]:
    """A benchmark's numbers over one pass's rows: metrics, counts, the reasons of null and unparseable rows."""
    unjudged = [r for r in rows if r["scores"].get(metric.sample_score) is None]
    return {"metrics": summarize(name, rows, settings), "num_samples": len(rows), "num_unjudged": len(unjudged),
            "unjudged_reasons": dict(sorted(Counter(r["reason"] or "unknown" for r in unjudged).items())),
            "unparseable_reasons": dict(sorted(Counter(r["verdict"]["unparseable"] for r in rows
                                                       if r["verdict"].get("unparseable")).items()))}


def _headline(result: Mapping[str, Any]) -> str:
    def fmt(v):
        return "nan" if v is None else f"{v:.4g}"

    key = result["headline"]
    m = result["metrics"]
    others = [f"{k} {fmt(v)}" for k, v in m.items() if k != key and isinstance(v, float) and not k.startswith("micro")]
    text = (", ".join([f"{key} {fmt(m.get(key))}", *others]) + f" ({result['num_samples']} samples, "
            f"{m.get('num_unparseable', 0)} unparseable, {result['num_unjudged']} not judged)")
    if "blind" in result:
        delta = result["blind_control"]["metrics"].get(result["sample_score"], {})
        text += (f"; blind {key} {fmt(result['blind']['metrics'].get(key))}, {result['sample_score']} real - blind "
                 f"{fmt(delta.get('delta'))}")
        bad, total = result["blind"]["metrics"].get("num_unparseable", 0), result["blind"]["num_samples"]
        if total and bad > total / 2:  # a model that cannot answer on a grey canvas scores 0 blind whatever it sees
            text += (f" (WARNING: {bad} of {total} blind answers unparseable: the blind control measures the answer "
                     f"format here, not the use of the image)")
    return text


def _answers(policy, samples: list, greedy: bool, seed: int) -> list[tuple[str | None, str | None]]:
    """``(answer, failure)`` per sample: one batched generation (greedy: ``policy.sample_eval``; sampled: one
    seeded completion each); a batch that fails on a sample (a prompt over generation.max_prompt_length, media that
    cannot be decoded) is answered one by one, and the failing samples get ``(None, the error)``."""
    import torch

    from mmrl.data.prompts import DataError
    from mmrl.pipelines.vlm.qwen import PromptTooLongError

    def generate(batch):
        if greedy:
            return policy.sample_eval(batch)
        return policy.rollout(batch, 1, generator=torch.Generator().manual_seed(seed), greedy=False).completions

    try:
        return [(text, None) for text in generate(samples)]
    except (PromptTooLongError, DataError) as exc:
        if len(samples) == 1:
            return [(None, f"not answered: {type(exc).__name__}: {exc}")]
    out = []
    for sample in samples:
        try:
            out.append((generate([sample])[0], None))
        except (PromptTooLongError, DataError) as exc:
            out.append((None, f"not answered: {type(exc).__name__}: {exc}"))
    return out


def _generate(plans: list[_Plan], passes: list[bool], done: dict, ckpt: _Checkpoint, cfg, generator: dict,
              samples_file: Path, options: VLMEvalOptions, policy=None) -> None:
    """Answer, score and append a row for every missing (benchmark, sample, blind), batch by batch. A given
    ``policy`` (the trainer's) gets its settings back afterwards."""
    if policy is not None:
        saved = (policy.skip_bad_samples, policy.max_new_tokens, policy.media)
        try:
            return _answer_all(plans, passes, done, policy, cfg, generator, samples_file, options)
        finally:
            policy.skip_bad_samples, policy.max_new_tokens, policy.media = saved
    policy = build_policy_with(cfg, ckpt)
    _answer_all(plans, passes, done, policy, cfg, generator, samples_file, options)


def _answer_all(plans: list[_Plan], passes: list[bool], done: dict, policy, cfg, generator: dict, samples_file: Path,
                options: VLMEvalOptions) -> None:
    policy.skip_bad_samples = False  # a sample that cannot be answered is a row with its reason, never a silent skip
    policy.max_new_tokens = options.max_new_tokens or cfg.generation.max_new_tokens
    media = policy.media
    progress = options.progress if options.progress is not None else sys.stderr.isatty()
    from tqdm.auto import tqdm

    with open(samples_file, "a", encoding="utf-8") as handle:
        for plan in plans:
            kind = _KIND.get(plan.name, plan.name)
            protocol, size = plan.protocol, plan.protocol.generation["batch_size"]
            for blind in passes:
                left = sum(1 for index, _ in plan.samples if (plan.name, index, blind) not in done)
                if not left:
                    continue
                policy.media = grey_media(media) if blind else media
                total = len(plan.samples)
                bar = tqdm(total=total, initial=total - left, desc=plan.name + (" (blind)" if blind else ""),
                           unit="answer", disable=not progress, dynamic_ncols=True)
                try:
                    for number, start in enumerate(range(0, total, size)):
                        batch = plan.samples[start:start + size]
                        todo = [(plan.name, index, blind) not in done for index, _ in batch]
                        if not any(todo):
                            continue
                        # the whole batch (fixed by position), so its answers are those of a straight run
                        answers = _answers(policy, [s for _, s in batch], options.greedy, options.seed + number)
                        for (index, sample), needed, (answer, failure) in zip(batch, todo, answers):
                            if not needed:
                                continue
                            judged = judge(kind, answer, sample.metadata, protocol.scorer_settings, failure=failure)
                            scores, reason = sample_scores(kind, judged, protocol.scorer_settings)
                            row = {"benchmark": plan.name, "prompt_index": index, "image_index": 0, "blind": blind,
                                   "id": sample.id, "task": sample.task, "prompt": sample.question,
                                   **_media_fields(sample, plan.media_base), "answer": answer,
                                   "target": judged.target, "scores": scores,
                                   "verdict": {"judged": judged.judged, "pred": judged.pred,
                                               "unparseable": judged.unparseable, **judged.details},
                                   "reason": reason, "protocol": protocol.hash()[:16],
                                   "generator": generator["hash"][:16]}
                            line = json.dumps(_jsonable(row), ensure_ascii=False, allow_nan=False)
                            handle.write(line + "\n")
                            handle.flush()
                            done[(plan.name, index, blind)] = json.loads(line)
                        bar.update(sum(todo))
                finally:
                    bar.close()
        policy.media = media


# --------------------------------------------------------------------------------------------------- during training


def training_eval_options(config) -> VLMEvalOptions:
    """The :class:`VLMEvalOptions` of a ``qwen_vl`` config's ``eval`` section (as ``mmrl eval`` checks its keys)."""
    from mmrl.eval.runner import training_eval_args

    options, overrides = parse_vlm_eval_args(training_eval_args(config))
    if overrides:
        raise EvalError(f"eval.options: {overrides[0].split('=', 1)[0]!r} is a config key, not an eval key")
    return options


def evaluate_vlm_policy(policy, config, update: int, output_dir: str | Path, *, ema: bool = False,
                        echo: Callable[[str], None] = print) -> dict[str, Any]:
    """The config's ``eval.benchmarks`` answered by the trainer's live ``policy`` into ``output_dir``, as ``mmrl
    eval`` does on a checkpoint (:func:`mmrl.eval.runner.evaluate_policy`)."""
    from mmrl.eval.runner import weights_sha256

    started = time.time()
    options = training_eval_options(config)
    plans = plan_vlm_eval(config, options)
    weights = {k: p.detach() for k, p in policy.named_trainable_parameters().items()}
    ckpt = _Checkpoint(None, Path(config.output_dir), ema, None, weights_sha256(weights), live=f"update {update}")
    return _run(config, options, [], plans, ckpt, Path(output_dir), None, echo=echo, started=started, policy=policy)
