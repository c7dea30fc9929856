"""``mmrl eval`` plug-ins DPG-Bench (mmrl.eval.dpg_bench) and the HPSv2 benchmark (mmrl.eval.hpsv2).

DPG-Bench: a synthetic dpg_bench.csv in the official column format (3 items with dependency chains, a parent
failing and gating its children, a child listed before its parent: the in-place gating order, and the csv's first
row that official_quirks drops), a scripted VQA judge whose answers depend on the tile, and the hand-worked numbers
with official_quirks false / true; the 2x2 grid equivalence; the judge wiring on a tiny random Qwen2.5-VL and on a
fake ModelScope mPLUG; malformed csv / missing keys as one line naming file:line. HPSv2: the official chunked
per-style mean by hand, the scorer wiring on a stub (100 x cosine, the JPEG round trip), bad input. One end-to-end
``run_eval`` of both on the tiny SD3 (a scripted judge, a tiny random open_clip HPS checkpoint)."""
from __future__ import annotations

import csv
import json
import math
import sys
import types

import numpy as np
import pytest
from PIL import Image

import mmrl.build
import mmrl.eval.benchmarks
from mmrl.cli import main
from mmrl.eval import dpg_bench as D
from mmrl.eval import hpsv2 as H
from mmrl.eval.benchmarks import DPG_COLUMNS
from mmrl.eval.runner import parse_eval_args
from mmrl.eval.scoring import dpg_tile_boxes
from fixtures import one_error, tiny_flow_config

FAST = ["resolution=32", "num_steps=2"]




@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr(mmrl.build, "build_policy", lambda *a, **k: pytest.fail("a model was loaded"))


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    """The tiny CPU recipe (tiny:sd3, built once into $MMRL_CACHE)."""
    return tiny_flow_config(tmp_path_factory.mktemp("dpg-hps-config"), cached=True)


# ============================================================================================== DPG-Bench

# (item_id, proposition_id, dependency, tuple, question); item ids are shipped prompt file stems.
ROWS = [
    ("0", "1", "0", "entity - whole (cat)", "Is there a cat?"),
    ("0", "2", "1", "attribute - color (cat, black)", "Is the cat black?"),
    ("0", "3", "1,2", "relation - spatial (cat, mat, on)", "Is the black cat on the mat?"),
    ("0", "4", "0", "other - count (cat, ==1)", "Is there one cat?"),
    ("1", "1", "0", "entity - whole (dog)", "Is there a dog?"),
    ("1", "3", "2", "relation - spatial (dog, ball, next to)", "Is the dog next to the ball?"),  # before its parent
    ("1", "2", "1", "attribute - color (dog, brown)", "Is the dog brown?"),
    ("10", "1", "0", "entity - whole (eggplant)", "Are there eggplants?"),
    ("10", "2", "1", "other - count (eggplant, ==3)", "Are there three eggplants?"),
]
# item -> tile -> the propositions answered "no" (every other question: "yes")
NO = {"0": [[], [1], [2, 4], [3]], "1": [[], [1], [2], [3]], "10": [[], [], [1], [2]]}
QUESTION = {r[4]: (r[0], int(r[1])) for r in ROWS}


def write_csv(path, rows=ROWS, columns=DPG_COLUMNS):
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for item_id, qid, dep, tup, question in rows:
            value = {"item_id": item_id, "text": f"prompt {item_id}", "keywords": "", "proposition_id": qid,
                     "dependency": dep, "category_broad": tup.split(" - ")[0], "category_detailed": "",
                     "tuple": tup, "question_natural_language": question}
            writer.writerow([value[c] for c in columns])
    return path


def tile(k, size=16):
    """Tile k of a prompt: a solid image whose red channel says k (the scripted judge reads it)."""
    return Image.new("RGB", (size, size), (10 * k, 80, 160))


class ScriptedJudge:
    """Answers from NO by (item of the question, tile of the image); logs the questions asked."""

    def __init__(self, fail=None):
        self.asked = []
        self.fail = fail or {}  # (item, tile) -> "raise" | "none"

    def ask(self, images, questions):
        out = []
        for image, question in zip(images, questions):
            item, qid = QUESTION[question]
            k = image.getpixel((0, 0))[0] // 10
            self.asked.append((item, k, qid))
            mode = self.fail.get((item, k))
            if mode == "raise":
                raise RuntimeError("judge crashed")
            if mode == "none":
                out.append((None, None, "the VLM forward failed"))
                continue
            answer = "no" if qid in NO[item][k] else "yes"
            out.append((answer, 0.9 if answer == "yes" else 0.2, None))
        return out


def dpg_scorer(csv_path, *extra, judge=None):
    options, _ = parse_eval_args([f"dpg_csv={csv_path}", *extra])
    spec = D.benchmark("dpg_bench", options)
    items, path, pinned = D.load_items(spec, options)
    scorer = D.make_scorer(spec, options)
    scorer.judge = judge or ScriptedJudge()
    return spec, items, path, pinned, scorer


def score_all(scorer, items, order=(0, 1, 2, 3)):
    """The rows the runner writes: image k of each prompt scored as tile k (``order``: the images of one call)."""
    rows = []
    for item in items:
        results = scorer.score([tile(k) for k in order], item)
        for k, result in zip(order, results):
            rows.append({"prompt_index": item.index, "image_index": k, "image": f"images/x/{item.index:05d}_{k}.png",
                         **result})
    return rows


def test_dpg_items_protocol_and_settings(tmp_path):
    csv_path = write_csv(tmp_path / "dpg_bench.csv")
    spec, items, path, pinned, scorer = dpg_scorer(csv_path)
    assert (spec.name, spec.kind) == ("dpg_bench", "dpg_bench")
    assert path == csv_path and pinned is None
    assert [i.metadata["item_id"] for i in items] == ["0", "1", "10"]
    shipped = mmrl.eval.benchmarks.assets_dir() / "dpg_bench" / "prompts"
    assert items[2].prompt == (shipped / "10.txt").read_text().strip()  # the prompt file, not the csv text
    d = D.defaults(spec)
    assert (d.images_per_prompt, d.seed, d.resolution, d.num_steps, d.guidance_scale) == (4, 42, 512, 40, 4.5)
    assert "2x2 grid" in d.source and "--pic-num 4" in d.source
    assert D.prompts_digest(shipped) == D.PROMPTS_SHA256
    s = scorer.settings
    assert s["vqa_model"] == D.DEFAULT_VQA == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert s["vqa_role"].startswith("substitute") and D.OFFICIAL_VQA in s["vqa_role"]
    assert D.OFFICIAL_VQA in s["official_scorer"] and s["official_quirks"] is False
    assert set(scorer.defaults) <= set(s) and D.main_keys(spec) == ["dpg_tile"]
    assert scorer.headline == "overall"


def test_dpg_rows_and_summary_by_hand(tmp_path):
    csv_path = write_csv(tmp_path / "dpg_bench.csv")
    _, items, _, _, scorer = dpg_scorer(csv_path)
    rows = score_all(scorer, items, order=(2, 0, 3, 1))  # the images of one call in any order: tile = image_index
    by = {(r["prompt_index"], r["image_index"]): r for r in rows}
    # item "0", tile 1: q1 "no" gates q2 and q3 (q3 also through q2); q4 has no parent
    r = by[(0, 1)]
    assert [q["answer"] for q in r["verdict"]["questions"]] == ["no", "yes", "yes", "yes"]
    assert [q["gated"] for q in r["verdict"]["questions"]] == [0.0, 0.0, 0.0, 1.0]
    assert r["scores"] == {"dpg_tile": 0.25, "dpg_tile_ungated": 0.75} and r["reason"] is None
    # item "1", tile 1: q3 (listed before its parent q2) reads q2's ungated "yes": in-place gating in csv order
    r = by[(1, 1)]
    assert [(q["id"], q["gated"]) for q in r["verdict"]["questions"]] == [(1, 0.0), (3, 1.0), (2, 0.0)]
    assert r["scores"]["dpg_tile"] == pytest.approx(1 / 3)
    metrics = scorer.summarize(list(reversed(rows)), items, tmp_path)
    # per prompt: "0" (1 + .25 + .25 + .75) / 4; "1" (1 + 1/3 + 1/3 + 2/3) / 4; "10" (1 + 1 + 0 + .5) / 4
    assert metrics["per_prompt"]["0"] == {"score": 0.5625, "tile_scores": [1.0, 0.25, 0.25, 0.75]}
    assert metrics["per_prompt"]["1"]["score"] == pytest.approx(7 / 12)
    assert metrics["per_prompt"]["10"]["score"] == pytest.approx(0.625)
    assert metrics["overall"] == pytest.approx(100 * (0.5625 + 7 / 12 + 0.625) / 3)
    # categories: each question's gated score averaged over the 4 tiles, pooled per category
    assert metrics["l2"] == pytest.approx({"entity - whole": 75.0, "attribute - color": 50.0,
                                           "relation - spatial": 37.5, "other - count": 62.5})
    assert metrics["l1"] == pytest.approx({"entity": 75.0, "attribute": 50.0, "relation": 37.5, "other": 62.5})
    counts = [metrics[k] for k in ("num_prompts", "num_scored", "num_failed", "num_unjudged")]
    assert counts == [3, 3, 0, 0]
    assert metrics["tiles_per_prompt"] == 4 and metrics["vqa_role"] == "substitute"
    assert metrics["csv"]["official"] is False and metrics["csv"]["git_blob"] == D.git_blob_id(csv_path)
    assert metrics["data"]["questions"] == 9 and metrics["official_quirks"] is False


def test_dpg_official_quirks_by_hand(tmp_path):
    csv_path = write_csv(tmp_path / "dpg_bench.csv")
    judge = ScriptedJudge()
    _, items, _, _, scorer = dpg_scorer(csv_path, "official_quirks=true", judge=judge)
    assert scorer.settings["official_quirks"] is True
    rows = score_all(scorer, items)
    # the csv's first row (item "0", q1) is dropped: q2 and q3 of item "0" name a missing parent -> the official
    # scorer raises KeyError and skips the image; the judge is not asked about it
    assert {a[0] for a in judge.asked} == {"1", "10"}
    r0 = [r for r in rows if r["prompt_index"] == 0]
    assert all(r["scores"]["dpg_tile"] is None and "KeyError" in r["reason"] for r in r0)
    metrics = scorer.summarize(rows[::-1], items, tmp_path)
    assert (metrics["num_scored"], metrics["num_failed"]) == (2, 1) and "0" in metrics["not_scored"]
    assert metrics["overall"] == pytest.approx(100 * (7 / 12 + 0.625) / 2)  # the same gated tile rule
    # categories: the UNGATED answers of the LAST tile (image_index 3) only: "1" q1 yes, q3 no, q2 yes;
    # "10" q1 yes, q2 no
    assert metrics["l2"] == pytest.approx({"entity - whole": 100.0, "relation - spatial": 0.0,
                                           "attribute - color": 100.0, "other - count": 0.0})
    assert metrics["l1"] == pytest.approx({"entity": 100.0, "relation": 0.0, "attribute": 100.0, "other": 0.0})
    assert metrics["data"]["dropped_rows"] == 1 and metrics["data"]["items_failing_official"] == 1


def test_dpg_a_failing_judge_is_unjudged_with_its_reason(tmp_path):
    csv_path = write_csv(tmp_path / "dpg_bench.csv")
    judge = ScriptedJudge(fail={("10", 2): "none"})
    _, items, _, _, scorer = dpg_scorer(csv_path, judge=judge)
    rows = score_all(scorer, items)
    bad = [r for r in rows if r["prompt_index"] == 2 and r["image_index"] == 2][0]
    assert bad["scores"] == {"dpg_tile": None, "dpg_tile_ungated": None}
    assert "not answered" in bad["reason"] and "the VLM forward failed" in bad["reason"]
    judge.fail = {("1", 0): "raise"}  # a judge raising: every image of that prompt unjudged
    crashed = scorer.score([tile(k) for k in range(4)], items[1])
    assert all(r["scores"]["dpg_tile"] is None and "judge crashed" in r["reason"] for r in crashed)
    metrics = scorer.summarize(rows, items, tmp_path)
    assert (metrics["num_scored"], metrics["num_unjudged"]) == (2, 1) and "10" in metrics["not_scored"]
    assert metrics["overall"] == pytest.approx(100 * (0.5625 + 7 / 12) / 2)


def test_scoring_tiles_directly_equals_cropping_the_official_grid(tmp_path):
    rng = np.random.default_rng(0)
    tiles = [Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)) for _ in range(4)]
    D.dpg_grid(tiles).save(tmp_path / "0.png")
    with Image.open(tmp_path / "0.png") as grid:
        assert grid.size == (48, 48)
        crops = [np.asarray(grid.crop(box)) for box in dpg_tile_boxes(24)]  # compute_dpg_one_sample's crops
    assert all(np.array_equal(c, np.asarray(t)) for c, t in zip(crops, tiles))


def test_dpg_qwen_judge_answers_from_the_yes_probability():
    import torch

    from mmrl.rewards.vlm_judge import VLMJudge

    judge = D._QwenJudge("tiny:qwen2_5_vl")
    images = [tile(1, 28), tile(5, 56)]
    questions = ["Is there a cat?", "Is the dog brown?"]
    got = judge.ask(images, questions)
    reference = VLMJudge(judge.judge.model, judge.judge.processor, template="{prompt} Answer yes or no.")
    p = reference(images, questions)["vlm_judge"]
    for (answer, p_yes, reason), want in zip(got, p.tolist()):
        assert reason is None and p_yes == pytest.approx(want, abs=1e-5)
        assert answer == ("yes" if want > 0.5 else "no")
    assert torch.isfinite(p).all()


def test_dpg_mplug_is_the_official_judge_through_modelscope(tmp_path, monkeypatch):
    calls = []

    def pipeline(task, model, device):
        calls.append((task, model, device))
        return lambda inputs: {"text": "yes" if "three" not in inputs["question"] else "Yes"}  # "Yes" is not 'yes'

    modelscope = types.ModuleType("modelscope")
    pipelines = types.ModuleType("modelscope.pipelines")
    pipelines.pipeline = pipeline
    constant = types.ModuleType("modelscope.utils.constant")
    constant.Tasks = types.SimpleNamespace(visual_question_answering="visual-question-answering")
    for name, module in [("modelscope", modelscope), ("modelscope.pipelines", pipelines),
                         ("modelscope.utils", types.ModuleType("modelscope.utils")),
                         ("modelscope.utils.constant", constant)]:
        monkeypatch.setitem(sys.modules, name, module)
    csv_path = write_csv(tmp_path / "dpg_bench.csv")
    options, _ = parse_eval_args([f"dpg_csv={csv_path}", "dpg_vqa_model=mplug"])
    spec = D.benchmark("dpg_bench", options)
    items, _, _ = D.load_items(spec, options)
    scorer = D.make_scorer(spec, options)
    assert scorer.settings["vqa_model"] == D.OFFICIAL_VQA and scorer.settings["vqa_role"].startswith("official")
    scorer.build()
    assert calls == [("visual-question-answering", D.OFFICIAL_VQA, "cpu")]
    rows = scorer.score([tile(0)], items[2])
    assert [q["answer"] for q in rows[0]["verdict"]["questions"]] == ["yes", "Yes"]
    assert rows[0]["scores"]["dpg_tile"] == 0.5  # the official exact match: "Yes" scores 0


def test_dpg_mplug_without_modelscope_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "modelscope", None)
    scorer = D.DPGScorer(write_csv(tmp_path / "dpg_bench.csv"), "mplug", False)
    with pytest.raises(Exception, match="pip install modelscope"):
        scorer.build()


def test_dpg_missing_vqa_weights_name_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    scorer = D.DPGScorer(write_csv(tmp_path / "dpg_bench.csv"), D.DEFAULT_VQA, False)
    with pytest.raises(Exception, match="not available offline.*set dpg_vqa_model=") as info:
        scorer.build()
    assert "pass model=" not in str(info.value)


@pytest.mark.parametrize("edit, words", [
    ("no_tuple", [":1:", "header lacks column(s) ['tuple']"]),
    ("bad_dependency", [":3:", "column 'dependency' must be an integer"]),
    ("missing_parent", [":3:", "dependency 7 names no proposition of item '0'"]),
])
def test_dpg_malformed_csv_is_one_line_naming_file_and_line(edit, words, config_file, tmp_path, capsys, no_model):
    rows, columns = list(ROWS), DPG_COLUMNS
    if edit == "no_tuple":
        columns = [c for c in DPG_COLUMNS if c != "tuple"]
    elif edit == "bad_dependency":
        rows[1] = rows[1][:2] + ("1;2",) + rows[1][3:]
    else:
        rows[1] = rows[1][:2] + ("7",) + rows[1][3:]
    path = write_csv(tmp_path / "dpg_bench.csv", rows, columns)
    assert main(["eval", str(config_file), "benchmarks=[dpg_bench]", f"dpg_csv={path}",
                 f"output_dir={tmp_path / 'o'}"]) == 2
    one_error(capsys, str(path), *words)


@pytest.mark.parametrize("args, words", [
    ([], ["dpg_bench needs dpg_csv=PATH", "TencentQQGYLab/ELLA", "98457fc9"]),
    (["dpg_csv=/nowhere/dpg_bench.csv"], ["/nowhere/dpg_bench.csv", "not found", "TencentQQGYLab/ELLA"]),
    (["dpg_csv=CSV", "official_quirks=maybe"], ["official_quirks='maybe': expected true or false"]),
    (["dpg_csv=CSV", "dpg_vqa_model=/nowhere/qwen"], ["dpg_vqa_model=/nowhere/qwen: no such folder"]),
])
def test_dpg_missing_or_bad_keys_are_one_line(args, words, config_file, tmp_path, capsys, no_model):
    csv_path = write_csv(tmp_path / "dpg_bench.csv")
    args = [a.replace("CSV", str(csv_path)) for a in args]
    assert main(["eval", str(config_file), "benchmarks=[dpg_bench]", *args]) == 2
    one_error(capsys, *words)


# ============================================================================================== HPSv2


def test_hpsv2_official_chunked_style_mean_by_hand():
    # 81 images: chunks [80 x 20.0] and [30.0] -> style score = mean of chunk means = 25, std 5; the "Average" is
    # the mean over all images, (80 * 20 + 30) / 81
    out = H.hpsv2_benchmark_summary({"anime": [20.0] * 80 + [30.0], "photo": [24.0, None, 26.0]})
    assert out["styles"]["anime"] == {"score": 25.0, "std": 5.0, "num_images": 81, "num_chunks": 2}
    assert out["styles"]["photo"] == {"score": 25.0, "std": 0.0, "num_images": 2, "num_chunks": 1}
    assert out["overall"] == pytest.approx((80 * 20 + 30 + 24 + 26) / 83)
    assert out["mean_of_styles"] == 25.0 and out["num_images"] == 83 and out["chunk"] == 80


def write_styles(folder, prompts=None, skip=()):
    prompts = prompts or {"anime": ["an anime cat", "an anime dog"], "concept-art": ["a concept castle"],
                          "paintings": ["an oil painting of a lake"], "photo": ["a photo of a bus"]}
    folder.mkdir(parents=True, exist_ok=True)
    for style, texts in prompts.items():
        if style not in skip:
            (folder / f"{style}.json").write_text(json.dumps(texts))
    return folder


class StubHPS:
    """An HPS reward: the cosine of a prompt from a table; records the images it saw."""

    COS = {"an anime cat": 0.30, "an anime dog": 0.20, "a concept castle": 0.25, "an oil painting of a lake": 0.27,
           "a photo of a bus": float("nan")}

    def __init__(self):
        self.seen = []
        self.last_info = {}

    def __call__(self, images, prompts):
        import torch

        self.seen += list(images)
        values = [self.COS[p] for p in prompts]
        self.last_info = {"nan_samples": {i: "stub: no score" for i, v in enumerate(values) if math.isnan(v)}}
        return {"hpsv2": torch.tensor(values)}


@pytest.mark.parametrize("jpeg", [True, False])
def test_hpsv2_scorer_rows_and_summary_by_hand(jpeg, tmp_path, monkeypatch):
    monkeypatch.setattr(H, "manifest_dir", lambda: tmp_path / "cache")
    folder = write_styles(tmp_path / "hps")
    options, _ = parse_eval_args([f"hpsv2_prompts={folder}", f"hpsv2_jpeg={str(jpeg).lower()}"])
    spec = H.benchmark("hpsv2", options)
    items, path, pinned = H.load_items(spec, options)
    assert [(i.category, i.metadata["style_index"]) for i in items] == [
        ("anime", 0), ("anime", 1), ("concept-art", 0), ("paintings", 0), ("photo", 0)]
    assert pinned is None and json.loads(path.read_text())["anime"] == ["an anime cat", "an anime dog"]
    d = H.defaults(spec)
    assert (d.images_per_prompt, d.seed, d.resolution) == (1, 42, 512) and "<idx:05d>.jpg" in d.source
    scorer = H.make_scorer(spec, options)
    assert scorer.settings["hps_version"] == "v2.1" and scorer.settings["role"].startswith("official")
    assert scorer.settings["jpeg_quality"] == (75 if jpeg else None)
    scorer.reward = StubHPS()
    rng = np.random.default_rng(1)
    rows = []
    for item in items:
        image = Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
        (result,) = scorer.score([image], item)
        seen = np.asarray(scorer.reward.seen[-1])
        want = np.asarray(H.jpeg_round_trip(image)) if jpeg else np.asarray(image)
        assert np.array_equal(seen, want)
        rows.append({"prompt_index": item.index, "image_index": 0, **result})
    assert [r["scores"]["hpsv2"] for r in rows[:2]] == pytest.approx([30.0, 20.0])  # 100 x cosine
    assert rows[4]["scores"]["hpsv2"] is None and rows[4]["reason"] == "stub: no score"
    metrics = scorer.summarize(rows, items, tmp_path)
    assert metrics["per_style"]["anime"]["score"] == pytest.approx(25.0)
    assert metrics["per_style"]["photo"]["num_images"] == 0 and metrics["num_unjudged"] == 1
    assert metrics["overall"] == pytest.approx((30 + 20 + 25 + 27) / 4)
    assert metrics["mean_of_styles"] == pytest.approx((25 + 25 + 27) / 3)


def test_hpsv2_one_style(tmp_path, monkeypatch):
    monkeypatch.setattr(H, "manifest_dir", lambda: tmp_path / "cache")
    folder = write_styles(tmp_path / "hps", skip=("photo",))
    options, _ = parse_eval_args([f"hpsv2_prompts={folder}"])
    spec = H.benchmark("hpsv2:anime", options)
    items, _, _ = H.load_items(spec, options)
    assert spec.folder == "hpsv2-anime" and [i.prompt for i in items] == ["an anime cat", "an anime dog"]


@pytest.mark.parametrize("bench, args, words", [
    ("hpsv2", [], ["hpsv2 needs hpsv2_prompts=DIR", "zhwang/HPDv2"]),
    ("hpsv2", ["hpsv2_prompts=DIR"], ["photo.json", "not found"]),
    ("hpsv2:cartoon", ["hpsv2_prompts=DIR"], ["'hpsv2:cartoon'", "anime, concept-art, paintings, photo"]),
    ("hpsv2", ["hpsv2_prompts=DIR", "hps_version=v3"], ["hps_version='v3': expected v2.1 or v2.0"]),
    ("hpsv2", ["hpsv2_prompts=DIR", "hps_model=/nowhere/hps.pt"], ["hps_model=/nowhere/hps.pt: no such file"]),
])
def test_hpsv2_bad_input_is_one_line(bench, args, words, config_file, tmp_path, capsys, no_model):
    folder = write_styles(tmp_path / "hps", skip=("photo",))
    args = [a.replace("DIR", str(folder)) for a in args]
    assert main(["eval", str(config_file), f"benchmarks=[{bench}]", *args]) == 2
    one_error(capsys, *words)


def test_hpsv2_missing_checkpoint_names_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    scorer = H.HPSv2BenchmarkScorer("hpsv2", None, "v2.1", True, str(tmp_path))
    with pytest.raises(Exception, match="not in the Hugging Face cache.*set hps_model=") as info:
        scorer.build()
    assert "checkpoint=" not in str(info.value)


# ============================================================================================== end to end

TINY_OPEN_CLIP = {
    "embed_dim": 8,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 16, "head_width": 8, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1},
}


@pytest.fixture
def tiny_hps_checkpoint(tmp_path, monkeypatch):
    """A tiny random open_clip model saved as an HPS checkpoint ({"state_dict": ...}); HPS_ARCH points at it."""
    import open_clip
    import torch

    (tmp_path / "mmrl-tiny-hps-eval.json").write_text(json.dumps(TINY_OPEN_CLIP))
    open_clip.add_model_config(str(tmp_path / "mmrl-tiny-hps-eval.json"))
    torch.manual_seed(0)
    model = open_clip.create_model("mmrl-tiny-hps-eval", pretrained=None)
    path = tmp_path / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": model.state_dict()}, path)
    monkeypatch.setattr(H, "HPS_ARCH", "mmrl-tiny-hps-eval")
    return path


def test_end_to_end_dpg_bench_and_hpsv2(config_file, tiny_hps_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(H, "manifest_dir", lambda: tmp_path / "cache")

    class ByQuestion:  # "no" to the questions about black and about three: the same answer on every tile
        def ask(self, images, questions):
            return [("no" if ("black" in q or "three" in q) else "yes", None, None) for q in questions]

    monkeypatch.setattr(D, "_build_judge", lambda vqa_model: ByQuestion())
    csv_path = write_csv(tmp_path / "dpg_bench.csv")
    styles = write_styles(tmp_path / "hps", {"anime": ["an anime cat"], "concept-art": ["a concept castle"],
                                             "paintings": ["a painted lake"], "photo": ["a photo of a bus"]})
    out = tmp_path / "out"
    assert main(["eval", str(config_file), "checkpoint=base", "benchmarks=[dpg_bench,hpsv2]", "limit=2", *FAST,
                 f"dpg_csv={csv_path}", "dpg_grids=true", f"hpsv2_prompts={styles}",
                 f"hps_model={tiny_hps_checkpoint}", f"output_dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    dpg = [r for r in rows if r["benchmark"] == "dpg_bench"]
    hps = [r for r in rows if r["benchmark"] == "hpsv2"]
    assert sorted((r["prompt_index"], r["image_index"]) for r in dpg) == [(p, k) for p in range(2) for k in range(4)]
    assert [r["seed"] for r in dpg if r["prompt_index"] == 1] == [42, 43, 44, 45]
    # item "0": q2 (black) "no" gates q3 -> [1, 0, 0, 1] on every tile = 0.5; item "1": all yes = 1
    assert {r["scores"]["dpg_tile"] for r in dpg if r["prompt_index"] == 0} == {0.5}
    summary = json.loads((out / "summary.json").read_text())
    m = summary["benchmarks"]["dpg_bench"]["metrics"]
    assert m["overall"] == pytest.approx(75.0) and m["num_prompts"] == 2 and m["tiles_per_prompt"] == 4
    protocol = summary["benchmarks"]["dpg_bench"]["protocol"]
    assert protocol["images_per_prompt"] == 4 and protocol["prompts_file"] == str(csv_path)
    assert protocol["scorer_settings"]["vqa_role"].startswith("substitute")
    # the official grid input: cropping dpg_grids/<item_id>.png gives back the saved images
    with Image.open(out / "dpg_grids" / "1.png") as grid:
        for k, box in enumerate(dpg_tile_boxes(32)):
            with Image.open(out / f"images/dpg_bench/00001_{k}.png") as image:
                assert np.array_equal(np.asarray(grid.crop(box)), np.asarray(image.convert("RGB")))
    # HPSv2: the first 2 prompts (anime, concept-art), 1 image each, 100 x cosine of the tiny HPS model
    assert [(r["prompt_index"], r["image_index"]) for r in hps] == [(0, 0), (1, 0)]
    assert all(abs(r["scores"]["hpsv2"]) <= 100 and r["verdict"]["cosine"] * 100 == pytest.approx(r["scores"]["hpsv2"])
               for r in hps)
    h = summary["benchmarks"]["hpsv2"]["metrics"]
    assert h["per_style"]["anime"]["score"] == pytest.approx(hps[0]["scores"]["hpsv2"])
    assert h["overall"] == pytest.approx((hps[0]["scores"]["hpsv2"] + hps[1]["scores"]["hpsv2"]) / 2)
    assert summary["benchmarks"]["hpsv2"]["protocol"]["scorer_settings"]["jpeg_quality"] == 75
