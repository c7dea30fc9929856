"""``mmrl eval`` for vision-language policies (mmrl.eval.vlm): end to end on a tiny random Qwen2.5-VL (image grounding,
video temporal grounding, Charades-STA with a user's video folder), the blind control's grey canvases as the processor
receives them, determinism, resume after a kill, metrics checked against numbers worked out by hand, unparseable and
unjudged answers, and the one-line errors for bad input."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import mmrl.build
from fixtures import write_image, write_jsonl, write_video
from mmrl.eval.runner import EvalError, run_eval
from mmrl.eval.vlm import GREY, grey_media
from mmrl.pipelines.vlm.qwen import QwenVLPolicy

REPO = Path(__file__).parents[1]
GROUNDING = REPO / "configs/tiny/vlm_grounding.yaml"
VIDEO_TG = REPO / "configs/tiny/vlm_video_tg.yaml"
FAST = ["max_new_tokens=4", "progress=false"]


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MMRL_CACHE", str(tmp_path_factory.getbasetemp() / "mmrl-cache"))
        yield


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a policy is built: the error must be found before any model loads."""
    monkeypatch.setattr(mmrl.build, "build_policy", lambda *a, **k: pytest.fail("a model was loaded"))


def rows_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def summary_of(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def quiet(_):
    pass


class ProcessorSpy:
    """Records the images and videos each processor call receives (the policy's inputs after the media step)."""

    def __init__(self, mp):
        import transformers

        self.calls: list[dict] = []
        original = transformers.Qwen2_5_VLProcessor.__call__

        def call(processor, *args, **kwargs):
            self.calls.append({"images": list(kwargs.get("images") or []),
                               "videos": [torch.as_tensor(v).clone() for v in kwargs.get("videos") or []]})
            return original(processor, *args, **kwargs)

        mp.setattr(transformers.Qwen2_5_VLProcessor, "__call__", call)


def grounding_args(out, *extra) -> list[str]:
    return ["limit=4", "batch_size=3", "blind=true", *FAST, f"output_dir={out}", *extra]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Image grounding with the blind control on the first 4 samples in one go (batches of 3 and 1), with what the
    processor received: what every rerun and resumed evaluation must equal."""
    out = tmp_path_factory.mktemp("vlm-eval") / "straight"
    with pytest.MonkeyPatch.context() as mp:
        spy = ProcessorSpy(mp)
        summary = run_eval(GROUNDING, grounding_args(out), echo=quiet)
    return out, summary, spy.calls


# ---------------------------------------------------------------------------------------------- the blind control


def test_grey_media_replaces_every_pixel_and_keeps_every_size():
    from mmrl.data.video import VideoClip

    image = Image.fromarray(np.random.RandomState(0).randint(0, 256, (40, 60, 3), dtype=np.uint8))
    frames = torch.randint(0, 256, (4, 3, 28, 56), dtype=torch.uint8)
    clip = VideoClip("v.mp4", frames, [0, 2, 4, 6], 2.0, 1.0, 4.0, 4.0, 16, (56, 28))
    meta = {"image_size": [60, 40]}

    def media(sample):
        sample["loaded"] = True
        return [image, image.resize((28, 28))], clip

    sample = dict(meta)
    images, video = grey_media(media)(sample)
    assert sample["loaded"] and sample["image_size"] == [60, 40]  # loaded for real: the metadata is the real one
    assert [im.size for im in images] == [(60, 40), (28, 28)] and all(im.mode == "RGB" for im in images)
    assert all((np.asarray(im) == 128).all() for im in images) and GREY == (128, 128, 128)
    assert video.frames.shape == frames.shape and video.frames.dtype == torch.uint8 and (video.frames == 128).all()
    assert video.indices == clip.indices and video.sample_fps == clip.sample_fps and clip.frames is frames


def test_tiny_grounding_end_to_end_with_the_blind_control(straight):
    out, summary, calls = straight
    assert {p.name for p in out.iterdir()} == {"samples.jsonl", "summary.json", "protocol.json", "report.html",
                                               "report_files"}
    assert summary == summary_of(out)
    rows = rows_of(out)
    assert [(r["prompt_index"], r["blind"]) for r in rows] == [(i, b) for b in (False, True) for i in range(4)]
    for r in rows:
        assert {"benchmark", "prompt_index", "image_index", "prompt", "id", "image", "answer", "target", "scores",
                "verdict", "reason", "blind", "protocol", "generator"} <= set(r)
        assert r["benchmark"] == "rec" and r["image_index"] == 0 and r["image"].startswith("images/")
        assert isinstance(r["answer"], str) and set(r["scores"]) == {"iou", "acc@0.5"}
        assert r["verdict"]["coord_format"] == "qwen25"  # Qwen2.5-VL: pixels of the resized input
    # the processor got the real pixels, then (blind) grey canvases of exactly the same sizes
    assert len(calls) == 4  # real: a batch of 3 and one of 1; blind: the same
    real = [im for c in calls[:2] for im in c["images"]]
    blind = [im for c in calls[2:] for im in c["images"]]
    assert len(real) == len(blind) == 4 and [im.size for im in real] == [im.size for im in blind]
    assert all(np.asarray(im).std() > 1 for im in real)
    assert all((np.asarray(im) == 128).all() for im in blind)
    # the summary: the official scorer's numbers, the blind ones beside them, their paired difference
    rec = summary["benchmarks"]["rec"]
    assert {"metrics", "num_samples", "num_unjudged", "unjudged_reasons", "protocol", "headline", "sample_score",
            "blind", "blind_control"} <= set(rec)
    assert rec["headline"] == "acc@0.5" and rec["sample_score"] == "iou" and rec["num_samples"] == 4
    assert {"acc@0.5", "miou", "n", "num_unparseable", "num_unjudged"} <= set(rec["metrics"])
    for part, blind_rows in ((rec, False), (rec["blind"], True)):
        mine = [r for r in rows if r["blind"] == blind_rows]
        assert part["metrics"]["acc@0.5"] == pytest.approx(np.mean([r["scores"]["acc@0.5"] for r in mine]))
        assert part["metrics"]["num_unparseable"] == sum(r["verdict"]["unparseable"] is not None for r in mine)
    control = rec["blind_control"]["metrics"]["iou"]
    assert control["n_pairs"] == 4 and control["delta"] == pytest.approx(control["real"] - control["blind"])
    protocol = rec["protocol"]
    assert protocol["generation"]["batch_size"] == 3 and protocol["generation"]["greedy"] is True
    assert protocol["num_samples"] == 4 and protocol["overridden"]["num_samples"] == {"default": 32, "used": 4}
    assert summary["mmrl_eval"] == 1 and summary["checkpoint"]["path"] == "base"
    assert summary["eval_keys"]["blind"] is True and "output_dir" not in summary["eval_keys"]
    assert summary["generator"]["pretrained"] == "tiny:qwen2_5_vl" and summary["packages"]["transformers"]
    assert json.loads((out / "protocol.json").read_text())["benchmarks"]["rec"]["hash"] == protocol["hash"]


def test_the_same_checkpoint_and_protocol_give_the_same_answers(straight, tmp_path):
    out, summary, _ = straight
    again = run_eval(GROUNDING, grounding_args(tmp_path / "again"), echo=quiet)
    assert rows_of(tmp_path / "again") == rows_of(out)
    assert again["benchmarks"] == summary["benchmarks"]


def test_sampled_answers_are_seeded(tmp_path):
    args = ["limit=2", "greedy=false", "seed=3", *FAST]
    first = run_eval(GROUNDING, [*args, f"output_dir={tmp_path / 'a'}"], echo=quiet)
    second = run_eval(GROUNDING, [*args, f"output_dir={tmp_path / 'b'}"], echo=quiet)
    assert rows_of(tmp_path / "a") == rows_of(tmp_path / "b") and first["benchmarks"] == second["benchmarks"]
    generation = first["benchmarks"]["rec"]["protocol"]["generation"]
    assert generation["greedy"] is False and generation["seed"] == 3 and generation["temperature"] == 1.0


def test_a_killed_evaluation_resumes_without_answering_a_row_again(straight, tmp_path, monkeypatch):
    out, summary, _ = straight
    lines = (out / "samples.jsonl").read_bytes().splitlines(keepends=True)
    original = QwenVLPolicy.sample_eval
    batches: list[int] = []

    def spy(self, items, seeds=None):
        batches.append(len(items))
        return original(self, items, seeds)

    monkeypatch.setattr(QwenVLPolicy, "sample_eval", spy)
    # killed while writing the first blind row: the real rows are kept, the cut line is dropped
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    (resumed / "summary.json").unlink()
    (resumed / "samples.jsonl").write_bytes(b"".join(lines[:4]) + lines[4][:40])
    assert run_eval(GROUNDING, grounding_args(resumed), echo=quiet)["benchmarks"] == summary["benchmarks"]
    assert batches == [3, 1]  # only the blind pass
    assert (resumed / "samples.jsonl").read_bytes() == (out / "samples.jsonl").read_bytes()
    # killed in the middle of the first batch: that batch is answered again whole, only its missing row written
    batches.clear()
    (resumed / "samples.jsonl").write_bytes(b"".join(lines[:2]))
    assert run_eval(GROUNDING, grounding_args(resumed), echo=quiet)["benchmarks"] == summary["benchmarks"]
    assert batches == [3, 1, 3, 1]
    assert (resumed / "samples.jsonl").read_bytes() == (out / "samples.jsonl").read_bytes()
    # nothing missing: nothing answered
    batches.clear()
    run_eval(GROUNDING, grounding_args(resumed), echo=quiet)
    assert batches == []


def test_another_protocol_or_model_in_the_same_output_dir_is_one_line(straight, tmp_path, no_model):
    out, _, _ = straight
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    before = (copy / "samples.jsonl").read_bytes()
    with pytest.raises(EvalError) as info:
        run_eval(GROUNDING, ["limit=4", "batch_size=2", "blind=true", *FAST, f"output_dir={copy}"], echo=quiet)
    message = str(info.value)
    assert "\n" not in message and "rec answers made under another protocol" in message
    assert "generation.batch_size: 3 -> 2" in message
    with pytest.raises(EvalError, match="another model or checkpoint .*dtype: 'float32' -> 'bfloat16'"):
        run_eval(GROUNDING, grounding_args(copy, "model.dtype=bfloat16"), echo=quiet)
    assert (copy / "samples.jsonl").read_bytes() == before


# ---------------------------------------------------------------------------------------------- video


def test_video_temporal_grounding_and_charades_sta_end_to_end(tmp_path, monkeypatch):
    from mmrl.eval.benchmarks import load_charades_sta

    first = load_charades_sta()[0]
    videos = tmp_path / "charades"
    write_video(videos / f"{first.video_id}.mp4", num_frames=12, fps=4)  # queries 0 and 1 are on this video
    spy = ProcessorSpy(monkeypatch)
    out = tmp_path / "out"
    summary = run_eval(VIDEO_TG, ["benchmarks=[temporal_grounding,charades_sta]", f"video_dir={videos}", "limit=2",
                                  "blind=true", *FAST, f"output_dir={out}"], echo=quiet)
    rows = rows_of(out)
    assert [(r["benchmark"], r["prompt_index"], r["blind"]) for r in rows] == [
        (b, i, blind) for b in ("temporal_grounding", "charades_sta") for blind in (False, True) for i in range(2)]
    charades = [r for r in rows if r["benchmark"] == "charades_sta"]
    assert charades[0]["video"] == f"{first.video_id}.mp4" and charades[0]["id"] == f"{first.video_id}#0"
    assert charades[0]["target"] == [first.start, first.end] and charades[0]["verdict"]["duration"] == first.duration
    assert first.sentence.rstrip(".") in charades[0]["prompt"]
    assert rows[0]["video"].startswith("videos/") and set(rows[0]["scores"]) == {"tiou", "r1@0.3", "r1@0.5", "r1@0.7"}
    for name in ("temporal_grounding", "charades_sta"):
        result = summary["benchmarks"][name]
        assert result["headline"] == "r1@0.5" and result["sample_score"] == "tiou"
        assert {"r1@0.3", "r1@0.5", "r1@0.7", "miou", "num_gt_clipped"} <= set(result["metrics"])
        assert result["protocol"]["scorer_settings"]["strict"] is True  # 2D-TAN's R1@m by default
        assert set(result["blind_control"]["metrics"]) == {"tiou", "r1@0.3", "r1@0.5", "r1@0.7"}
    assert summary["benchmarks"]["charades_sta"]["protocol"]["media_root"] == str(videos.absolute())
    # every video frame the blind pass handed the processor is grey, with the real frames' shapes
    real = [v for c in spy.calls[:1] + spy.calls[2:3] for v in c["videos"]]
    blind = [v for c in spy.calls[1:2] + spy.calls[3:4] for v in c["videos"]]
    assert len(real) == len(blind) == 4 and [v.shape for v in real] == [v.shape for v in blind]
    assert all((v == 128).all() for v in blind) and not any((v == 128).all() for v in real)


# ---------------------------------------------------------------------------------------------- hand-checked numbers


def hand_data(tmp_path) -> Path:
    """Samples of every benchmark whose answers (below) give numbers worked out by hand."""
    write_image(tmp_path / "img.png", 112, 112)  # Qwen2.5-VL input size = original size: its pixels are original ones
    img = {"image": "img.png"}
    g = "grounding"
    return write_jsonl(tmp_path / "hand.jsonl", [
        {**img, "id": "r0", "question": "q", "solution": "s", "task": g, "boxes": [[0, 0, 10, 10]]},
        {**img, "id": "r1", "question": "q", "solution": "s", "task": g, "boxes": [[0, 0, 10, 10]]},
        {**img, "id": "r2", "question": "q", "solution": "s", "task": g, "boxes": [[0, 0, 10, 10]]},
        {**img, "id": "r3", "question": "q", "solution": "s", "task": g},  # no ground truth: unjudged
        {**img, "id": "r4", "question": "q", "solution": "s", "task": g, "boxes": [[0, 0, 56, 56]],
         "coord_format": "qwen2"},  # the line's own format wins: 0-1000
        {**img, "id": "m0", "question": "q", "solution": "s", "task": "multi_object",
         "boxes": [[0, 0, 10, 10], [20, 20, 40, 40]]},
        {**img, "id": "m1", "question": "q", "solution": "s", "task": "multi_object", "boxes": []},
        {"id": "t0", "question": "q", "solution": "s", "task": "temporal_grounding", "timestamps": [2, 6],
         "duration": 10},
        {"id": "t1", "question": "q", "solution": "s", "task": "temporal_grounding", "timestamps": [0, 4],
         "duration": 10},
        {"id": "t2", "question": "q", "solution": "s", "task": "temporal_grounding", "timestamps": [8, 12],
         "duration": 10},  # 2D-TAN clips the end to 10
        {"id": "t3", "question": "q", "solution": "s", "task": "temporal_grounding", "timestamps": [11, 12],
         "duration": 10},  # empty after clipping: 2D-TAN drops it
        {"id": "c0", "question": "q", "solution": "B", "task": "multiple_choice", "choices": ["cat", "dog"]},
        {"id": "c1", "question": "q", "solution": "A", "task": "multiple_choice", "choices": ["cat", "dog"]},
        {"id": "c2", "question": "q", "solution": "Z", "task": "multiple_choice", "choices": ["cat", "dog"]},
        {"id": "n0", "question": "q", "solution": "3", "task": "numeric"},
        {"id": "n1", "question": "q", "solution": "4", "task": "counting"},
    ])


REAL = {"r0": "<answer>[0, 0, 10, 10]</answer>", "r1": "<answer>[0, 0, 10, 5]</answer>",  # IoU 1, IoU 0.5 (not > 0.5)
        "r2": "<answer>no idea</answer>", "r3": "<answer>[0, 0, 10, 10]</answer>",
        "r4": "<think>hm</think><answer>[0, 0, 500, 500]</answer>",  # = [0, 0, 56, 56]: IoU 1
        "m0": '<answer>[{"bbox_2d": [0, 0, 10, 10]}, {"bbox_2d": [50, 50, 60, 60]}]</answer>',  # TP 1: F1 2/4
        "m1": "<answer>[]</answer>",  # nothing there, rightly: F1 1
        "t0": "<answer>2 to 6</answer>", "t1": "<answer>2 to 6</answer>",  # tIoU 1, 2/6
        "t2": "<answer>8 to 10</answer>", "t3": "<answer>11 to 12</answer>",  # 1 (clipped gt), unjudged
        "c0": "<answer>B</answer>", "c1": "<answer>dog</answer>", "c2": "<answer>A</answer>",  # 1, 0 (B), unjudged
        "n0": "<answer>3</answer>", "n1": "<answer>many</answer>"}  # 1, unparseable
BLIND = {**REAL, **{k: "<answer>none</answer>" for k in ("r0", "r1", "r2", "r3", "r4", "m0", "m1")}}


@pytest.fixture
def fixed_answers(monkeypatch):
    """The policy answers from REAL, or from BLIND when every image it was shown is a grey canvas (text-only samples:
    the same answer both times). The media are loaded as the real policy loads them (sizes for the box rescaling)."""
    seen: list[list[str]] = []

    def sample_eval(self, items, seeds=None):
        answers = []
        for item in items:
            images, _ = self.media(item)
            grey = bool(images) and all((np.asarray(im) == 128).all() for im in images)
            answers.append((BLIND if grey else REAL)[item.id])
        seen.append([item.id for item in items])
        return answers

    monkeypatch.setattr(QwenVLPolicy, "sample_eval", sample_eval)
    return seen


def test_metrics_match_numbers_worked_out_by_hand(tmp_path, fixed_answers):
    data = hand_data(tmp_path)
    out = tmp_path / "out"
    summary = run_eval(GROUNDING, [f"data={data}", "blind=true", "batch_size=4", f"output_dir={out}", "progress=false"],
                       echo=quiet)
    b = summary["benchmarks"]
    assert list(b) == ["rec", "multi_object", "temporal_grounding", "multiple_choice", "numeric"]
    assert fixed_answers[0] == ["r0", "r1", "r2", "r3"] and fixed_answers[1] == ["r4"]  # batches by position

    rec = b["rec"]["metrics"]  # kept: r0 1, r1 0.5, r2 unparseable 0, r4 1; r3 unjudged
    assert rec == {"acc@0.5": 0.5, "miou": pytest.approx(2.5 / 4), "n": 4, "num_unparseable": 1, "num_unjudged": 1}
    assert b["rec"]["num_unjudged"] == 1
    assert b["rec"]["unjudged_reasons"] == {"metadata has no 'boxes' (needed by rec)": 1}
    assert b["rec"]["unparseable_reasons"] == {"no box in the answer": 1}
    mo = b["multi_object"]["metrics"]
    assert mo["f1"] == pytest.approx(0.75) and mo["precision"] == pytest.approx(0.75) and mo["recall"] == 0.75
    assert mo["micro_f1"] == pytest.approx(2 * 1 / (2 + 2)) and mo["n"] == 2
    tg = b["temporal_grounding"]["metrics"]  # kept: t0 1, t1 1/3, t2 1; t3 unjudged; t2 and t3 clipped
    assert tg["r1@0.3"] == 1.0 and tg["r1@0.5"] == pytest.approx(2 / 3) and tg["r1@0.7"] == pytest.approx(2 / 3)
    assert tg["miou"] == pytest.approx(7 / 9) and tg["n"] == 3 and tg["num_unjudged"] == 1 and tg["num_gt_clipped"] == 2
    assert "empty after clipping" in next(iter(b["temporal_grounding"]["unjudged_reasons"]))
    mc = b["multiple_choice"]
    assert mc["metrics"] == {"accuracy": 0.5, "n": 2, "num_unparseable": 0, "num_unjudged": 1}
    assert "'Z' is not a choice letter" in next(iter(mc["unjudged_reasons"]))
    assert b["numeric"]["metrics"] == {"accuracy": 0.5, "n": 2, "num_unparseable": 1, "num_unjudged": 0}

    rows = {(r["id"], r["blind"]): r for r in rows_of(out)}
    assert rows[("r1", False)]["scores"] == {"iou": 0.5, "acc@0.5": 0.0} and rows[("r1", False)]["reason"] is None
    assert rows[("r4", False)]["verdict"]["pred"] == pytest.approx([0, 0, 56, 56])
    assert rows[("r4", False)]["verdict"]["coord_format"] == "qwen2"
    assert rows[("r0", False)]["verdict"]["input_size"] == [112, 112]
    assert rows[("r2", False)]["scores"] == {"iou": 0.0, "acc@0.5": 0.0}  # unparseable: 0, counted
    assert rows[("r3", False)]["scores"] == {"iou": None, "acc@0.5": None} and "boxes" in rows[("r3", False)]["reason"]
    assert rows[("t2", False)]["target"] == [8.0, 12.0] and rows[("t2", False)]["scores"]["tiou"] == 1.0
    assert rows[("c1", False)]["verdict"]["pred"] == "B" and rows[("n1", False)]["verdict"]["unparseable"]

    # the blind control: the box answers went blind, the text-only ones did not change
    control = b["rec"]["blind_control"]["metrics"]["iou"]
    assert control == {"real": pytest.approx(2.5 / 4), "blind": 0.0, "delta": pytest.approx(2.5 / 4),
                       "delta_se": pytest.approx(np.std([1, 0.5, 0, 1], ddof=1) / 2), "n_pairs": 4, "num_dropped": 1}
    assert b["rec"]["blind"]["metrics"]["acc@0.5"] == 0.0 and b["rec"]["blind"]["metrics"]["num_unparseable"] == 4
    assert b["multi_object"]["blind_control"]["metrics"]["f1"]["delta"] == pytest.approx(0.25)  # F1 0.5, 1 -> 0, 1
    for name in ("temporal_grounding", "multiple_choice", "numeric"):
        assert all(m["delta"] == 0 for m in b[name]["blind_control"]["metrics"].values())

    # TimeZero's convention: tIoU >= m and no clipping (t2: 0.5, t3: 1)
    tz = run_eval(GROUNDING, [f"data={data}", "benchmarks=[temporal_grounding]", "tg_convention=timezero",
                              f"output_dir={tmp_path / 'tz'}", "progress=false"], echo=quiet)
    tg = tz["benchmarks"]["temporal_grounding"]["metrics"]
    assert (tg["r1@0.3"], tg["r1@0.5"], tg["r1@0.7"]) == (1.0, 0.75, 0.5) and tg["n"] == 4
    assert tg["miou"] == pytest.approx((1 + 1 / 3 + 0.5 + 1) / 4) and tg["num_gt_clipped"] == 0
    # Time-R1's (eval_all.py): tIoU > m and no clipping: t2's 0.5 is no hit at 0.5, t3 unclipped is 1
    tr = run_eval(GROUNDING, [f"data={data}", "benchmarks=[temporal_grounding]", "tg_convention=time_r1",
                              f"output_dir={tmp_path / 'tr'}", "progress=false"], echo=quiet)
    tg = tr["benchmarks"]["temporal_grounding"]["metrics"]
    assert (tg["r1@0.3"], tg["r1@0.5"], tg["r1@0.7"]) == (1.0, 0.5, 0.5) and tg["n"] == 4
    assert tg["miou"] == pytest.approx((1 + 1 / 3 + 0.5 + 1) / 4) and tg["num_gt_clipped"] == 0
    # Video-R1's answer reading for the text benchmarks: recorded in the protocol, the default's unchanged
    vr = run_eval(GROUNDING, [f"data={data}", "benchmarks=[multiple_choice, numeric]", "answer_convention=video_r1",
                              f"output_dir={tmp_path / 'vr'}", "progress=false"], echo=quiet)
    for name in ("multiple_choice", "numeric"):
        protocol = vr["benchmarks"][name]["protocol"]
        assert protocol["scorer_settings"]["answer_convention"] == "video_r1"
        assert protocol["overridden"]["answer_convention"] == {"default": "mmrl", "used": "video_r1"}
        assert vr["benchmarks"][name]["metrics"]["num_unparseable"] == 0  # nothing is unparseable there
        assert "answer_convention" not in b[name]["protocol"]["scorer_settings"]


def test_a_sample_that_cannot_be_answered_is_counted_not_a_crash(tmp_path):
    out = tmp_path / "out"
    summary = run_eval(GROUNDING, ["limit=2", *FAST, "generation.max_prompt_length=16", f"output_dir={out}"],
                       echo=quiet)
    rows = rows_of(out)
    assert len(rows) == 2 and all(r["answer"] is None and r["scores"] == {"iou": None, "acc@0.5": None} for r in rows)
    assert all("not answered: PromptTooLongError" in r["reason"] and "max_prompt_length=16" in r["reason"]
               for r in rows)
    rec = summary["benchmarks"]["rec"]
    assert rec["num_unjudged"] == 2 and sum(rec["unjudged_reasons"].values()) == 2
    assert rec["metrics"]["acc@0.5"] is None and rec["metrics"]["num_unjudged"] == 2  # NaN -> null


# ---------------------------------------------------------------------------------------------- bad input


def bad_lines(tmp_path) -> Path:
    write_image(tmp_path / "img.png", 32, 32)
    good = {"image": "img.png", "question": "q", "solution": "s", "task": "grounding", "boxes": [[0, 0, 4, 4]]}
    return write_jsonl(tmp_path / "bad.jsonl", [good, '{"question": "q", "solution"'])


def other_task(tmp_path) -> Path:
    good = {"question": "q", "solution": "3", "task": "numeric"}
    return write_jsonl(tmp_path / "tasks.jsonl", [good, {**good, "task": "caption"}])


@pytest.mark.parametrize("extra,words", [
    (["limt=3"], ["unknown eval key 'limt'", "did you mean 'limit'", "valid eval keys: checkpoint, benchmarks"]),
    (["resolution=64"], ["'resolution' is for image-generation policies", "qwen_vl"]),
    (["limit=0"], ["limit=0: expected an integer >= 1"]),
    (["blind=maybe"], ["blind='maybe': expected true or false"]),
    (["seed=1"], ["seed= is for sampled answers (greedy=false)"]),
    (["coord_format=pixels"], ["coord_format='pixels': expected one of qwen2, qwen25, absolute"]),
    (["answer_convention=mvbench"], ["answer_convention='mvbench': expected one of mmrl, video_r1"]),
    (["data=missing.jsonl"], ["data=missing.jsonl: VLM data file not found", "relative paths resolve"]),
    (["data=BAD"], ["bad.jsonl:2:"]),
    (["data=TASKS"], ["tasks.jsonl:2: task 'caption' has no evaluation metric", "benchmarks=[...]"]),
    (["data=TASKS", "benchmarks=[rec]"], ["benchmark rec:", "has no line with task grounding"]),
    (["benchmarks=[refcoco]"], ["RefCOCO/+/g annotations are not shipped", "data=FILE with benchmarks=[rec]"]),
    (["benchmarks=[ocr]"], ["'ocr' scores generated images"]),
    (["benchmarks=[charades]"], ["unknown benchmark 'charades'", "did you mean 'charades_sta'"]),
    (["benchmarks=[charades_sta]"], ["charades_sta needs the Charades videos: video_dir=DIR", "allenai.org"]),
    (["benchmarks=[charades_sta]", "video_dir=VIDEOS"], ["Charades-STA queries' videos are missing",
                                                        "3MSZA.mp4", "charades_test.json:1"]),
    (["video_dir=VIDEOS", "benchmarks=[rec]"], ["video_dir= is for the charades_sta benchmark"]),
    (["checkpoint=nowhere"], ["checkpoint=nowhere: no such run or checkpoint folder"]),
])
def test_bad_input_is_one_line_before_any_model_loads(extra, words, tmp_path, no_model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "videos").mkdir()
    names = {"BAD": bad_lines(tmp_path), "TASKS": other_task(tmp_path), "VIDEOS": tmp_path / "videos"}
    extra = [e.split("=")[0] + "=" + str(names.get(e.split("=")[1], e.split("=")[1])) for e in extra]
    with pytest.raises(EvalError) as info:
        run_eval(GROUNDING, [*extra, f"output_dir={tmp_path / 'out'}"], echo=quiet)
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)
    assert not (tmp_path / "out").exists()


def test_headline_warns_when_the_blind_answers_are_mostly_unparseable():
    from mmrl.eval.vlm import _headline

    def result(blind_unparseable):
        return {"headline": "r1@0.5", "sample_score": "tiou", "num_samples": 4, "num_unjudged": 0,
                "metrics": {"r1@0.5": 0.5, "num_unparseable": 0},
                "blind": {"num_samples": 4, "metrics": {"r1@0.5": 0.0, "num_unparseable": blind_unparseable}},
                "blind_control": {"metrics": {"tiou": {"delta": 0.4}}}}

    assert "WARNING: 3 of 4 blind answers unparseable" in _headline(result(3))
    assert "WARNING" not in _headline(result(2))  # half or fewer: the blind score means something
    assert "real - blind 0.4" in _headline(result(0))


def test_timezero_convention_reads_answers_with_timezeros_parse():
    """``tg_convention=timezero`` reads the last ``a to b`` of the whole output (TimeZero ``evaluate.py``); the
    default reads the answer block's last span in any format."""
    from mmrl.eval.vlm import judge

    meta = {"task": "temporal_grounding", "timestamps": [12.0, 19.0], "duration": 30.0}
    tz = {"require_tags": True, "convention": "timezero"}
    tan = {"require_tags": True, "convention": "2d_tan"}
    assert judge("temporal_grounding", "12.0 to 19.0", meta, tz).pred == [12.0, 19.0]  # untagged: TimeZero reads it
    assert judge("temporal_grounding", "12.0 to 19.0", meta, tan).pred is None  # mmrl: no answer block
    assert judge("temporal_grounding", "<answer>[12, 19]</answer>", meta, tz).pred is None
    tr = {"require_tags": True, "convention": "time_r1"}  # Time-R1's evaluate.py extract_answer: the same parse
    assert judge("temporal_grounding", "12.0 to 19.0", meta, tr).pred == [12.0, 19.0]
    assert judge("temporal_grounding", "<answer>[12, 19]</answer>", meta, tr).pred is None
    assert judge("temporal_grounding", "<answer>[12, 19]</answer>", meta, tan).pred == [12.0, 19.0]


def _video_r1_reward_fn(solution: str, output: str, question_type: str) -> float:
    """Video-R1 src/eval_bench.py reward_fn (multiple choice and numerical), its rule written out."""
    import re

    def extract(text):
        match = re.search(r"<answer>\s*(.*?)\s*</answer>", text, re.DOTALL)
        return match.group(1).strip() if match else ""

    def number(text):
        try:
            return float(text.replace(",", ""))
        except Exception:
            return None

    try:
        out = extract(output) or output
        gt = extract(solution)
        if question_type == "multiple choice":
            return 1.0 if out.strip() == gt.strip() else 0.0
        if (("." in gt) or ("," in gt)) != (("." in out) or ("," in out)):
            return 0.0
        g, o = number(gt), number(out)
        return 0.0 if g is None or o is None else float(round(g, 2) == round(o, 2))
    except Exception:
        return 0.0


@pytest.mark.parametrize("kind,solution,outputs", [
    ("multiple_choice", "<answer>B</answer>", ["<think>x</think><answer>B</answer>", "<answer>(B)</answer>", "B",
                                                "b", "<answer>B</answer><answer>C</answer>", "<answer> B </answer>",
                                                "The answer is B", "<answer></answer>B", "", "<answer>b</answer>"]),
    ("numeric", "<answer>3</answer>", ["<answer>3</answer>", "<answer>3.0</answer>", "3", "<answer>3 apples</answer>",
                                       "<answer>1,500</answer>", "<answer>three</answer>", "<answer>3.001</answer>"]),
    ("numeric", "<answer>2.5</answer>", ["<answer>2.504</answer>", "<answer>2.5</answer>", "<answer>2,5</answer>",
                                         "<answer>3</answer>", "2.499"]),
])
def test_answer_convention_video_r1_is_its_eval_bench(kind, solution, outputs):
    """answer_convention=video_r1: Video-R1's eval_bench.py reward_fn on every output (its first answer block, else
    the whole output; exact strings for multiple choice, the decimal-mark check and 2-decimal rounding for
    numbers), where mmrl's reading disagrees on most of these (an audit: 188 of 672 multiple-choice outputs)."""
    from mmrl.eval.vlm import judge, sample_scores

    settings = {"require_tags": True, "answer_convention": "video_r1"}
    meta = {"task": kind, "solution": solution}
    qtype = "multiple choice" if kind == "multiple_choice" else "numerical"
    for output in outputs:
        scores, reason = sample_scores(kind, judge(kind, output, meta, settings), settings)
        assert scores["correct"] == _video_r1_reward_fn(solution, output, qtype), output
        assert reason is None
    unjudged = judge(kind, "B", {"task": kind}, settings)
    assert not unjudged.judged and "no 'solution'" in unjudged.reason


# ---------------------------------------------------------------------------------------------- VLM-R1's REC protocol


def _official_extract_bbox_answer(content):
    """VLM-R1 src/eval/test_rec_r1.py extract_bbox_answer, its rule written out (no box: [0, 0, 0, 0])."""
    import re

    block = re.search(r"<answer>(.*?)</answer>", content, re.DOTALL)
    if block:
        box = re.search(r"\{.*\[(\d+),\s*(\d+),\s*(\d+),\s*(\d+)]\s*.*\}", block.group(1).strip(), re.DOTALL)
        if box:
            return [int(v) for v in box.groups()]
    return [0, 0, 0, 0]


def _official_iou(box1, box2):
    """VLM-R1 src/eval/test_rec_r1.py iou, its rule written out (inclusive-pixel intersection)."""
    ix1, iy1 = max(box1[0], box2[0]), max(box1[1], box2[1])
    ix2, iy2 = min(box1[2] - 1, box2[2] - 1), min(box1[3] - 1, box2[3] - 1)
    inter = (ix2 - ix1 + 1) * (iy2 - iy1 + 1) if ix1 < ix2 and iy1 < iy2 else 0
    union = (box1[2] - box1[0]) * (box1[3] - box1[1]) + (box2[2] - box2[0]) * (box2[3] - box2[1]) - inter
    return float(inter) / union


#: REC answers where mmrl's reading and test_rec_r1.py's differ (ground truth [0, 0, 10, 10] on a 112 px image)
VLM_R1_ANSWERS = {
    "a0": '<answer>{"bbox_2d": [0, 0, 10, 10]}</answer>',  # both: IoU 1
    "a1": '<answer>[{"bbox_2d": [50, 50, 60, 60]}, {"bbox_2d": [0, 0, 10, 10]}]</answer>',  # VLM-R1: the last box
    "a2": "<answer>[0, 0, 10, 10]</answer>",  # a bare list: VLM-R1 needs braces
    "a3": '<answer>{"bbox_2d": [0.0, 0.0, 10.0, 10.0]}</answer>',  # decimals: VLM-R1 reads whole numbers only
    "a4": '<answer>{"bbox_2d": [0, 0, 10, 10]}</answer> <answer>{"bbox_2d": [50, 50, 60, 60]}</answer>',  # 1st block
    "a5": '<answer>{"bbox_2d": [0, 9, 10, 19]}</answer>',  # a 1 px overlap: VLM-R1's IoU 0, continuous 10/190
}


def test_vlm_r1_reading_and_iou_are_test_rec_r1s():
    from mmrl.rewards._text import Unparseable
    from mmrl.rewards.grounding import parse_vlm_r1_box, vlm_r1_iou

    gt = [0, 0, 10, 10]
    for answer in [*VLM_R1_ANSWERS.values(), "no tags {[1, 2, 3, 4]}", '<answer>{"box": [3, 4, 50, 60]} ok}</answer>']:
        want = _official_extract_bbox_answer(answer)
        try:
            got = parse_vlm_r1_box(answer)
        except Unparseable:
            got = None
        assert (got is None and want == [0, 0, 0, 0]) or got == want, answer
        assert vlm_r1_iou(got or [0, 0, 0, 0], gt) == _official_iou(want, gt)
    rng = np.random.default_rng(0)
    for _ in range(2000):  # predictions of every overlap, reversed ones included, against valid ground truths
        a = rng.integers(0, 30, 4).tolist()
        x1, y1 = rng.integers(0, 25, 2).tolist()
        b = [x1, y1, x1 + int(rng.integers(1, 10)), y1 + int(rng.integers(1, 10))]
        union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1])
        if union > 0:  # where the official function divides by a positive union (else it fails or is negative)
            assert vlm_r1_iou(a, b) == _official_iou(a, b)
        else:
            assert vlm_r1_iou(a, b) == 0.0


def test_rec_convention_vlm_r1_reads_scores_and_samples_as_test_rec_r1(tmp_path, monkeypatch):
    import random

    write_image(tmp_path / "img.png", 112, 112)
    ids = list(VLM_R1_ANSWERS)
    data = write_jsonl(tmp_path / "rec.jsonl", [
        {"image": "img.png", "id": i, "question": "q", "solution": "s", "task": "grounding", "boxes": [[0, 0, 10, 10]]}
        for i in ids])
    seen: list[str] = []

    def sample_eval(self, items, seeds=None):
        for item in items:
            self.media(item)  # loaded as the real policy loads them: the sizes the box rescaling reads
        seen.extend(item.id for item in items)
        return [VLM_R1_ANSWERS[item.id] for item in items]

    monkeypatch.setattr(QwenVLPolicy, "sample_eval", sample_eval)
    args = [f"data={data}", "benchmarks=[rec]", "progress=false", "coord_format=qwen25"]
    mine = run_eval(GROUNDING, [*args, f"output_dir={tmp_path / 'mmrl'}"], echo=quiet)["benchmarks"]["rec"]
    assert seen == ids  # mmrl's default: every line in file order
    # mmrl: a0, a2, a3 right (the first box, lenient reading); a4 unparseable (two answer blocks)
    assert mine["metrics"]["acc@0.5"] == 0.5 and mine["metrics"]["num_unparseable"] == 1
    assert mine["metrics"]["miou"] == pytest.approx((3 + 10 / 190) / 6)

    seen.clear()
    theirs = run_eval(GROUNDING, [*args, "rec_convention=vlm_r1", f"output_dir={tmp_path / 'vlm_r1'}"],
                      echo=quiet)["benchmarks"]["rec"]
    order = list(ids)
    random.seed(42)  # test_rec_r1.py: random.seed(42); random.shuffle(data); data = data[:num_samples]
    random.shuffle(order)
    assert seen == order[:2000] and seen != ids
    # VLM-R1: a0, a1 (last box), a4 (first block) right; a2, a3 unparseable; a5's 1 px overlap counts 0
    want = [_official_iou(_official_extract_bbox_answer(VLM_R1_ANSWERS[i]), [0, 0, 10, 10]) for i in order]
    assert theirs["metrics"]["acc@0.5"] == sum(v > 0.5 for v in want) / len(want) == 0.5
    assert theirs["metrics"]["miou"] == pytest.approx(np.mean(want)) == 0.5
    assert theirs["metrics"]["num_unparseable"] == 2
    assert theirs["protocol"]["scorer_settings"]["rec_convention"] == "vlm_r1"
    assert theirs["protocol"]["overridden"]["rec_convention"] == {"default": "mmrl", "used": "vlm_r1"}
    assert "rec_convention" not in mine["protocol"]["scorer_settings"]  # the default protocol is unchanged
    with pytest.raises(EvalError, match="rec_convention='refcoco': expected one of mmrl, vlm_r1"):
        run_eval(GROUNDING, [*args, "rec_convention=refcoco"], echo=quiet)


# ---------------------------------------------------------------------------------------------- VSI-Bench


def _official_vsi(rows):
    """thinking-in-space lmms_eval/tasks/vsibench/utils.py: process_results then aggregate_results, written out."""
    mca = ["object_rel_direction_easy", "object_rel_direction_medium", "object_rel_direction_hard",
           "object_rel_distance", "route_planning", "obj_appearance_order"]

    def fuzzy_matching(pred):
        return pred.split(" ")[0].rstrip(".").strip()

    def mra(pred, target, start=.5, end=.95, interval=.05):
        conf = np.linspace(start, end, int((end - start) / interval + 2))
        return (abs(pred - target) / target <= 1 - conf).mean()

    def to_float(x):
        try:
            return float(x)
        except BaseException:
            return None

    per = {}
    for prediction, qtype, gt in rows:
        if qtype in mca:
            value = 1.0 if fuzzy_matching(prediction).lower() == gt.lower() else 0.0
        else:
            try:
                value = mra(to_float(fuzzy_matching(prediction)), to_float(gt))
            except TypeError:
                value = 0.0
        per.setdefault(qtype, []).append(value)
    out = {t: float(np.mean(v)) for t, v in per.items()}
    if "object_rel_direction_easy" in out:
        out["object_rel_direction"] = sum(out.pop(t) for t in mca[:3]) / 3.0
    return sum(out.values()) / len(out), out


VSI = [  # (id, question_type, ground_truth, the model's answer)
    ("v0", "object_counting", "4", "4"),  # MRA 1
    ("v1", "object_counting", "10", "8 chairs."),  # first word 8: error 0.2, 6 of the 10 thresholds (below)
    ("v2", "object_abs_distance", "2.5", "<think>far</think><answer>3.0</answer>"),  # the answer block: 0.2 -> 0.6
    ("v3", "room_size_estimation", "20", "about 20"),  # first word 'about': 0
    ("v4", "object_rel_direction_easy", "B", "B."),  # 1
    ("v5", "object_rel_direction_medium", "A", "b"),  # 0
    ("v6", "object_rel_direction_hard", "C", "c"),  # 1 (case-insensitive)
    ("v7", "route_planning", "D", "D. turn left"),  # 1
    ("v8", "obj_appearance_order", "A", "The answer is A"),  # 0
]


def test_vsi_bench_scores_as_the_official_lmms_eval_task(tmp_path, monkeypatch):
    from mmrl.eval.scoring import vsi_bench_prompt, vsi_mean_relative_accuracy

    write_image(tmp_path / "img.png", 56, 56)
    lines = [{"image": "img.png", "id": i, "question": vsi_bench_prompt("how many?", t, ["A. x", "B. y"]),
              "solution": g, "task": "vsi_bench", "question_type": t, "ground_truth": g} for i, t, g, _ in VSI]
    lines.append({"image": "img.png", "id": "bad", "question": "q", "solution": "0", "task": "vsi_bench",
                  "question_type": "object_counting", "ground_truth": "0"})  # a zero truth cannot be scored
    data = write_jsonl(tmp_path / "vsi.jsonl", lines)
    answers = {i: a for i, _, _, a in VSI} | {"bad": "3"}
    monkeypatch.setattr(QwenVLPolicy, "sample_eval", lambda self, items, seeds=None: [answers[x.id] for x in items])
    summary = run_eval(GROUNDING, [f"data={data}", "benchmarks=[vsi_bench]", "progress=false",
                                   f"output_dir={tmp_path / 'out'}"], echo=quiet)
    got = summary["benchmarks"]["vsi_bench"]["metrics"]
    readable = [("3.0" if i == "v2" else a, t, g) for i, t, g, a in VSI]  # v2 read from its answer block
    overall, categories = _official_vsi(readable)
    assert got["overall"] == pytest.approx(overall, abs=1e-12)
    for name, value in categories.items():
        assert got[name] == pytest.approx(value, abs=1e-12), name
    # by hand: an error of exactly 0.2 passes 6 thresholds, not 7: 1 - 0.8 is 0.19999999999999996 in floats, as the
    # official code computes it; counting (1 + 0.6) / 2, distance 0.6, room 0, direction (1 + 0 + 1) / 3, route 1,
    # order 0
    assert overall == pytest.approx((0.8 + 0.6 + 0 + 2 / 3 + 1 + 0) / 6)
    assert got["num_unjudged"] == 1 and got["n"] == 9
    assert vsi_mean_relative_accuracy(8, 10) == pytest.approx(0.6) and vsi_mean_relative_accuracy(5, 4) == 0.6
    assert vsi_bench_prompt("how far?", "object_abs_distance") == ("These are frames of a video.\nhow far?\nPlease "
                                                                     "answer the question using a single word or phrase.")
