"""``report.html`` and ``mmrl eval --compare`` (mmrl.eval.report) on synthetic evaluation folders written here
(summary.json, samples.jsonl, small PNGs; no model): the difference colours and their direction, escaping, the
protocol-mismatch warning, the curves and the note for a run without metrics.jsonl, the worst / best prompts per
category, VLM answers, relative and existing figure paths, --compare with evaluation and run folders and its
one-line errors; and the page in a real headless Chromium (the DevTools protocol over a pipe: no console errors,
no failed loads, every image decoded, a screenshot showing the tables and images), skipped when Chromium is
absent."""
from __future__ import annotations

import base64
import copy
import io
import json
import os
import re
import select
import shutil
import subprocess
import tempfile
import time
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import mmrl.eval.report as report
from mmrl.cli import main
from fixtures import one_error
from mmrl.eval.report import (ReportError, flatten_metrics, metric_direction, protocol_differences,
                              resolve_eval_dir, write_report)

# ---------------------------------------------------------------------------------------------- synthetic folders

PROTOCOL = {"benchmark": "geneval", "prompts_file": "/somewhere/geneval/evaluation_metadata.jsonl",
            "prompts_sha256": "5c48e0813e81", "total_prompts": 553, "num_prompts": 4, "images_per_prompt": 2,
            "seed": 42, "resolution": 32, "num_steps": 4, "guidance_scale": 4.5, "scorer": "geneval",
            "scorer_settings": {"detector": "det", "threshold": 0.3}, "overridden": {"num_steps": {"default": 40,
                                                                                                    "used": 4}},
            "hash": "aaaa"}
PROMPTS = ["a photo of a bench", "a photo of a cow", "a red car", "a blue & green <bird>"]
TAGS = ["single_object", "single_object", "colors", "colors"]
PACKAGES = {"mmrl": "0.1.0", "torch": "2.14.1", "python": "3.11.7"}


def write_png(path: Path, seed: int, size: int = 32) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(path)


def make_eval(folder: Path, *, checkpoint: str = "base", run_dir: str | None = None, scores=None, overall=0.5,
              fid=10.0, pick=0.2, protocol: dict | None = None, prompts=PROMPTS, metrics_rows=None,
              colour_seed: int = 0, tags=TAGS) -> Path:
    """An evaluation folder: geneval (4 prompts x 2 images, tags, per_tag metrics, a lower-is-better fid) and a
    reward benchmark (2 prompts x 1 image, no categories). ``scores[i]``: prompt i's per-image ``correct``."""
    scores = scores or [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]]
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, prompt in enumerate(prompts):
        for k in range(2):
            image = f"images/geneval/{i:05d}_{k}.png"
            write_png(folder / image, colour_seed * 100 + i * 10 + k)
            rows.append({"benchmark": "geneval", "prompt_index": i, "image_index": k, "prompt": prompt,
                         "seed": 42 + k, "image": image, "scores": {"correct": scores[i][k], "partial": scores[i][k]},
                         "verdict": {"tag": tags[i], "reason": "ok"}, "reason": None})
    for i in range(2):
        image = f"images/reward-pickscore@drawbench/{i:05d}_0.png"
        write_png(folder / image, colour_seed * 100 + 50 + i)
        rows.append({"benchmark": "reward:pickscore@drawbench", "prompt_index": i, "image_index": 0,
                     "prompt": f"drawbench prompt {i}", "seed": 42, "image": image,
                     "scores": {"pickscore": pick + i / 10}, "verdict": None, "reason": None})
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proto = copy.deepcopy(PROTOCOL)
    proto.update(protocol or {})
    reward_proto = {**copy.deepcopy(PROTOCOL), "benchmark": "reward:pickscore@drawbench", "num_prompts": 2,
                    "images_per_prompt": 1, "scorer": "reward:pickscore"}
    summary = {
        "mmrl_eval": 1, "config_file": "/cfg/tiny.yaml",
        "checkpoint": {"path": checkpoint, "run_dir": run_dir, "ema": None if checkpoint == "base" else True,
                       "weights_sha256": None if checkpoint == "base" else "ab" * 32,
                       # the trainer's in-training evaluation (mmrl.eval.runner.evaluate_policy): the live weights
                       **({"update": checkpoint} if checkpoint.startswith("update ") else {})},
        "generator": {"pretrained": "tiny:sd3"},
        "benchmarks": {
            "geneval": {"metrics": {"overall": overall, "per_tag": {tags[0]: overall / 2, tags[2]: overall},
                                    "counts": {tags[0]: 4, tags[2]: 4}, "fid": fid,
                                    "missing_tags": ["position"], "num_unjudged": 0,
                                    "partial": {"mean": overall, "n": 8, "num_unjudged": 1}},
                        "num_images": 8, "num_unjudged": 1, "unjudged_reasons": {"detector failed": 1},
                        "images": "images/geneval", "grid": "grids/geneval.png", "headline": "overall",
                        "sample_score": "correct", "protocol": proto},
            "reward:pickscore@drawbench": {
                "metrics": {"pickscore": {"mean": pick, "n": 2, "num_unjudged": 0}}, "num_images": 2,
                "num_unjudged": 0, "unjudged_reasons": {}, "images": "images/reward-pickscore@drawbench",
                "headline": "pickscore.mean", "sample_score": "pickscore", "protocol": reward_proto}},
        "eval_keys": {"limit": 4}, "config_overrides": [], "config": {}, "packages": PACKAGES, "device": "cpu"}
    (folder / "summary.json").write_text(json.dumps(summary))
    if metrics_rows is not None and run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics_rows))
    return folder


def make_run(root: Path, name: str, steps=(2, 4), **kwargs) -> Path:
    """A run folder with metrics.jsonl and eval/step_N folders (the default output of ``mmrl eval RUN``)."""
    run = root / name
    metrics = [{"step": s, "reward/mean": 0.5 + s / 100, **({"eval/reward/brightness": 0.4 + s / 50} if s % 2 == 0
                                                             else {}), "eval/geneval/overall": 0.1 * s}
               for s in range(1, max(steps) + 1)]
    for s in steps:
        make_eval(run / "eval" / f"step_{s}", checkpoint=str(run / "checkpoints" / f"step_{s}"), run_dir=str(run),
                  metrics_rows=metrics, **kwargs)
    return run


class _Cells(HTMLParser):
    """Every table row as a list of ``(tag, classes, text)`` cells."""

    def __init__(self):
        super().__init__()
        self.rows: list[list[tuple[str, str, str]]] = []
        self.cell = None
        self.imgs: list[dict] = []
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th") and self.rows:
            self.cell = [tag, attrs.get("class") or "", ""]
        elif tag == "img":
            self.imgs.append(attrs)
        if tag in ("a", "link") and attrs.get("href"):
            self.links.append(attrs["href"])

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            self.rows[-1].append(tuple(self.cell))
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell[2] += data


def parse(path: Path) -> _Cells:
    parser = _Cells()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def metric_row(cells: _Cells, name: str) -> list[tuple[str, str, str]]:
    for row in cells.rows:
        if row and row[0][2].strip() == name and row[0][0] == "th":
            return row
    raise AssertionError(f"no table row {name!r}")




@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """base, a trained run (better overall, worse fid) and a third run (lower overall), and their report."""
    root = tmp_path_factory.mktemp("report")
    base = make_eval(root / "base", overall=0.5, fid=10.0, pick=0.2, colour_seed=1)
    run = make_run(root, "grpo", steps=(4,), overall=0.75, fid=12.0, pick=0.25, colour_seed=2,
                   scores=[[1.0, 1.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    other = make_eval(root / "other", checkpoint=str(root / "gone" / "checkpoints" / "step_9"),
                      run_dir=str(root / "gone"), overall=0.25, fid=8.0, pick=0.2, colour_seed=3)
    out = write_report([base, run / "eval" / "step_4", other], root / "out" / "report.html")
    return {"root": root, "dirs": [base, run / "eval" / "step_4", other], "html": out}


# ---------------------------------------------------------------------------------------------- pure pieces


def test_metric_direction():
    assert metric_direction("overall") == 1 and metric_direction("per_tag.colors") == 1
    assert metric_direction("pickscore") == 1 and metric_direction("clipscore.mean") == 1
    for lower in ("fid", "kid", "loss", "val_loss", "fid_clip", "per_category.fid", "jpeg_compressibility/jpeg_size_kb",
                  "num_unjudged", "KID"):
        assert metric_direction(lower) == -1, lower
    for neutral in ("n", "counts.colors", "num_images", "partial.std", "num_prompts", "blind_accuracy"):
        assert metric_direction(neutral) == 0, neutral
    assert "fid" in report.LOWER_IS_BETTER and "loss" in report.LOWER_IS_BETTER
    # settings and counts: FID / KID's (kid_* would otherwise read as lower-is-better), DPG-Bench's, a VLM's
    for setting in ("kid_subsets", "kid_subset_size_used", "kid_subset_size", "num_generated", "num_reference",
                    "num_gt_clipped", "feature_dim", "tiles_per_prompt", "rec.num_gt_clipped",
                    # the general rule on the last part: n, num_*, *_subsets, *_size*, feature_dim, tiles_per_prompt
                    "per_category.animals.n", "num_prompts_recomputed", "grounding.num_boxes", "fid_subsets",
                    "loss_subsets", "judge.batch_size", "fid.sample_size_used", "per_tag.colors.feature_dim"):
        assert metric_direction(setting) == 0, setting
    for name in ("kid_subsets", "kid_subset_size_used", "num_generated", "num_reference", "num_gt_clipped",
                 "feature_dim", "tiles_per_prompt"):
        assert name in report.NEUTRAL, name
    # the rule leaves the documented lower-is-better counts and sizes alone, and the scores beside the settings
    for lower in ("num_unjudged", "num_unparseable", "rec.num_unparseable", "jpeg_size_kb", "reward.jpeg_size_kb",
                  "kid", "fid", "num_error", "kid.mean"):
        assert metric_direction(lower) == -1, lower
    for higher in ("overall", "l1.entity", "l2.entity.whole", "diversity.mean", "accuracy"):
        assert metric_direction(higher) == 1, higher


def test_flatten_metrics():
    flat = flatten_metrics({"overall": 0.5, "per_tag": {"colors": 1.0}, "missing": ["position", "counting"],
                            "pick": {"mean": 0.2, "n": 8, "num_unjudged": 1, "std": 0.1}, "bad": float("nan"),
                            "per_category": {"pick": {"animals": {"mean": 0.3, "n": 2, "num_unjudged": 0}}}})
    assert flat["overall"] == {"value": 0.5, "n": None, "unjudged": None}
    assert flat["per_tag.colors"]["value"] == 1.0
    assert flat["missing"]["value"] == "position, counting"
    assert flat["pick"] == {"value": 0.2, "n": 8, "unjudged": 1} and flat["pick.std"]["value"] == 0.1
    assert flat["bad"]["value"] is None
    assert flat["per_category.pick.animals"] == {"value": 0.3, "n": 2, "unjudged": 0}


def test_protocol_differences_ignores_derived_fields():
    a = copy.deepcopy(PROTOCOL)
    b = {**copy.deepcopy(PROTOCOL), "prompts_file": "/elsewhere/file.jsonl", "hash": "bbbb", "overridden": {}}
    assert protocol_differences([a, b]) == []  # the same prompts (sha256) at another path
    vlm = {"benchmark": "rec", "data_file": "/a/data.jsonl", "data_sha256": "cd", "num_samples": 4, "blind": True}
    assert protocol_differences([vlm, {**vlm, "data_file": "/b/data.jsonl", "blind": False}]) == []
    assert protocol_differences([vlm, {**vlm, "num_samples": 8}]) == [("num_samples", [4, 8])]
    c = {**copy.deepcopy(PROTOCOL), "num_steps": 40, "scorer_settings": {"detector": "other", "threshold": 0.3}}
    diffs = dict(protocol_differences([a, None, c]))
    assert diffs == {"num_steps": [4, 40], "scorer_settings.detector": ["det", "other"]}


def fid_protocol(reference="/data/coco/val", inception="/models/inception-2015-12-05.pt", ref_sha="r" * 64,
                 inc_sha="i" * 64, **settings):
    """The protocol of mmrl.eval.distribution's fid@SET (paths of this machine, their content's sha256)."""
    return {"benchmark": "fid@drawbench", "prompts_file": "/x/drawbench.txt", "prompts_sha256": "ab", "seed": 42,
            "scorer": "fid_kid", "hash": "h",
            "scorer_settings": {"reference_images": reference, "reference_sha256": ref_sha, "reference_count": 8,
                                "reference_rule": "clean-fid get_folder_features", "inception": inception,
                                "inception_sha256": inc_sha, "fid_mode": "clean",
                                "prompt_files": {"a.txt": {"file": "assets/a.txt", "sha256": "s1"}}, **settings}}


def test_protocol_differences_ignores_nested_paths_pinned_by_an_equal_sha256():
    here = fid_protocol()
    there = fid_protocol("/mnt/other/coco-val", "/home/me/inception-2015-12-05.pt")
    there["scorer_settings"]["prompt_files"]["a.txt"]["file"] = "/abs/a.txt"
    assert protocol_differences([here, there]) == []  # the same files (their sha256) on another machine
    # other content: the sha256 and the path both named
    diffs = dict(protocol_differences([here, fid_protocol("/mnt/other/coco-val", ref_sha="q" * 64)]))
    assert diffs == {"scorer_settings.reference_images": ["/data/coco/val", "/mnt/other/coco-val"],
                     "scorer_settings.reference_sha256": ["r" * 64, "q" * 64]}
    diffs = dict(protocol_differences([here, fid_protocol(inception="/b/inception-2015-12-05.pt", inc_sha="j")]))
    assert set(diffs) == {"scorer_settings.inception", "scorer_settings.inception_sha256"}
    # a path without a recorded sha256 on one side, or a string that is no path beside a sha256, still compared
    bare = fid_protocol("/mnt/other/coco-val")
    del bare["scorer_settings"]["reference_sha256"]
    assert set(dict(protocol_differences([here, bare]))) == {"scorer_settings.reference_images",
                                                             "scorer_settings.reference_sha256"}
    other_rule = fid_protocol(reference_rule="another rule")
    assert dict(protocol_differences([here, other_rule])) == {
        "scorer_settings.reference_rule": ["clean-fid get_folder_features", "another rule"]}
    assert dict(protocol_differences([here, fid_protocol(fid_mode="legacy_tensorflow")])) == {
        "scorer_settings.fid_mode": ["clean", "legacy_tensorflow"]}
    assert report._pinned_paths(here) == {"scorer_settings.reference_images": "scorer_settings.reference_sha256",
                                          "scorer_settings.inception": "scorer_settings.inception_sha256",
                                          "scorer_settings.prompt_files.a.txt.file":
                                              "scorer_settings.prompt_files.a.txt.sha256",
                                          "prompts_file": "prompts_sha256"}


def test_the_page_warns_only_when_the_pinned_content_differs(tmp_path):
    def with_fid(folder, protocol):
        summary = json.loads((folder / "summary.json").read_text())
        summary["benchmarks"]["fid@drawbench"] = {
            "metrics": {"fid": 10.0, "kid": 0.01, "num_generated": 4, "num_reference": 8}, "num_images": 4,
            "num_unjudged": 0, "unjudged_reasons": {}, "headline": "fid", "sample_score": "", "protocol": protocol}
        (folder / "summary.json").write_text(json.dumps(summary))
        return folder

    a = with_fid(make_eval(tmp_path / "a"), fid_protocol())
    b = with_fid(make_eval(tmp_path / "b", checkpoint=str(tmp_path / "r/checkpoints/step_1"),
                           run_dir=str(tmp_path / "r")), fid_protocol("/mnt/b/ref", "/opt/b/inception-2015-12-05.pt"))
    page = write_report([a, b], tmp_path / "same.html").read_text()
    assert "protocols differ" not in page
    c = with_fid(make_eval(tmp_path / "c", checkpoint=str(tmp_path / "r/checkpoints/step_2"),
                           run_dir=str(tmp_path / "r")), fid_protocol("/mnt/c/ref", ref_sha="q" * 64))
    page = write_report([a, c], tmp_path / "diff.html").read_text()
    box = page[page.index("protocols differ</strong>"):]
    box = box[:box.index("</div>")]
    assert "scorer_settings.reference_sha256" in box and "scorer_settings.reference_images" in box
    assert "scorer_settings.inception" not in box


# ---------------------------------------------------------------------------------------------- the page


def test_difference_colours_follow_the_metric_direction(three):
    cells = parse(three["html"])
    overall = metric_row(cells, "overall")  # metric, base, grpo, Δ, other, Δ
    assert [c[0] for c in overall] == ["th", "td", "td", "td", "td", "td"]
    assert "better" in overall[3][1] and overall[3][2].startswith("+0.25")
    assert "worse" in overall[5][1] and overall[5][2].startswith("-0.25")
    fid = metric_row(cells, "fid")  # lower is better: up is red, down is green
    assert "worse" in fid[3][1] and fid[3][2].startswith("+2")
    assert "better" in fid[5][1] and fid[5][2].startswith("-2")
    counts = metric_row(cells, "counts.colors")  # a count: never coloured
    assert "better" not in counts[3][1] + counts[5][1] and "worse" not in counts[3][1] + counts[5][1]
    partial = metric_row(cells, "partial")  # a {"mean", "n", "num_unjudged"} entry shows its counts
    assert "n=8" in partial[1][2] and "1 unjudged" in partial[1][2]
    same = metric_row(cells, "pickscore")  # equal values: neither colour
    assert "same" in same[5][1] and "better" in same[3][1]
    page = three["html"].read_text()
    assert page.count("<h2>geneval</h2>") == 1 and "reward:pickscore@drawbench" in page
    assert "detector failed" in page  # the unjudged reasons
    assert "mean correct" in page and "worst" in page and "best" in page


def test_figures_are_relative_and_exist_and_the_folder_moves(three, tmp_path):
    cells = parse(three["html"])
    page = three["html"].read_text()
    assert "file://" not in page and "http://" not in page and "https://" not in page and "<script" not in page
    srcs = [img["src"] for img in cells.imgs]
    assert len(srcs) > 20 and any(s.endswith("curves.png") for s in srcs)
    assert any("categories" in s for s in srcs)  # the per_tag bar chart
    for src in srcs:
        assert not src.startswith("/") and ":" not in src, src
        assert (three["html"].parent / src).is_file(), src
    moved = tmp_path / "moved"
    shutil.copytree(three["html"].parent, moved)
    assert all((moved / s).is_file() for s in srcs)
    for href in cells.links:
        assert href.startswith("#") or href == "data:,", href


def test_worst_and_best_prompts_per_category(three):
    page = three["html"].read_text()
    # ranked by the last run ("other": the default scores): colors has #2 (1.0) and #3 (0.5)
    section = page[page.index("Worst and best prompts per category"):page.index("reward:pickscore@drawbench</h2>")]
    assert "colors: worst 2 of 2" in section and "single_object: worst 2 of 2" in section
    colors = section[section.index("colors: worst"):section.index("single_object: worst")]
    assert colors.index("#3 ") < colors.index("#2 ")  # 0.5 before 1.0
    assert "a blue &amp; green &lt;bird&gt;" in colors


def test_user_text_is_escaped(tmp_path):
    evil = '<script>alert("x")</script> & "quoted"'
    a = make_eval(tmp_path / "a", prompts=[evil, "b", "c", "d"])
    b = make_eval(tmp_path / "b", checkpoint=str(tmp_path / "r" / "checkpoints" / "step_1"),
                  run_dir=str(tmp_path / "r"), prompts=[evil, "b", "c", "d"])
    summary = json.loads((b / "summary.json").read_text())
    summary["config_file"] = "/x/<img src=x onerror=alert(1)>.yaml"
    summary["benchmarks"]["geneval"]["unjudged_reasons"] = {"<b>bold</b>": 1}
    (b / "summary.json").write_text(json.dumps(summary))
    out = write_report([a, b], tmp_path / "report.html", labels=["<i>base</i>", 'run "b" & co'])
    page = out.read_text()
    assert "<script" not in page and "<img src=x" not in page and "<b>bold" not in page and "<i>base" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &quot;quoted&quot;" in page
    assert "&lt;i&gt;base&lt;/i&gt;" in page and "run &quot;b&quot; &amp; co" in page
    assert "&lt;b&gt;bold&lt;/b&gt;" in page


def test_protocol_mismatch_is_a_warning_naming_the_fields(tmp_path):
    a = make_eval(tmp_path / "a")
    b = make_eval(tmp_path / "b", checkpoint=str(tmp_path / "r/checkpoints/step_1"), run_dir=str(tmp_path / "r"),
                  protocol={"num_steps": 40, "prompts_file": "/other/place.jsonl"})
    page = write_report([a, b], tmp_path / "diff.html").read_text()
    assert page.count("protocols differ") >= 2  # the top warning list and the benchmark's own box
    box = page[page.index("protocols differ</strong>"):]
    box = box[:box.index("</div>")]
    assert "num_steps" in box and "40" in box and "prompts_file" not in box
    same = write_report([a, make_eval(tmp_path / "c", checkpoint=str(tmp_path / "r/checkpoints/step_2"),
                                      run_dir=str(tmp_path / "r"))], tmp_path / "same.html").read_text()
    assert "protocols differ" not in same and "identical in every run" in same


def test_a_benchmark_missing_in_a_run_is_a_warning_and_empty_cells(tmp_path):
    a = make_eval(tmp_path / "a")
    b = make_eval(tmp_path / "b", checkpoint=str(tmp_path / "r/checkpoints/step_1"), run_dir=str(tmp_path / "r"))
    summary = json.loads((b / "summary.json").read_text())
    del summary["benchmarks"]["reward:pickscore@drawbench"]
    (b / "summary.json").write_text(json.dumps(summary))
    out = write_report([a, b], tmp_path / "r.html")
    assert "reward:pickscore@drawbench: not evaluated in r/step_1" in out.read_text()
    row = metric_row(parse(out), "pickscore")
    assert row[1][2].startswith("0.2") and row[2][2] == "\u2014" and row[3][2] == ""


def test_curves_and_the_note_for_runs_without_metrics(three, tmp_path):
    page = three["html"].read_text()
    curves = page[page.index('id="curves"'):]
    assert "base: the untrained base model: no training run, no curves" in curves
    assert "gone/step_9: no metrics.jsonl at" in curves and str(three["root"] / "gone" / "metrics.jsonl") in curves
    assert "curves.png" in curves
    with Image.open(three["html"].parent / "report_files" / "curves.png") as image:
        assert image.size[0] > 600  # reward/mean, eval/reward/brightness, eval/geneval/overall: 3 panels
    # only the base: no curves at all, said so
    alone = write_report([three["dirs"][0]], tmp_path / "alone.html").read_text()
    assert "no run has a metrics.jsonl" in alone and "&Delta;" not in alone  # one column, no differences


def test_without_matplotlib_the_page_says_so(three, tmp_path, monkeypatch):
    monkeypatch.setattr(report, "_matplotlib", lambda: None)
    out = write_report(three["dirs"][:2], tmp_path / "plain.html")
    page = out.read_text()
    assert "charts need matplotlib" in page and "curves.png" not in page and "categories0.png" not in page
    assert "<table" in page and "_files/img" in page  # tables and thumbnails still there


def test_vlm_answers_are_shown(tmp_path):
    """The layout of mmrl.eval.vlm: the input image relative to the data file's folder, ``task``, blind rows, the
    blind metrics and the paired blind control beside the real ones."""
    folder = make_eval(tmp_path / "vlm")
    data = tmp_path / "data"
    write_png(data / "images" / "0000.png", 7)
    summary = json.loads((folder / "summary.json").read_text())
    summary["benchmarks"]["rec"] = {
        "metrics": {"acc@0.5": 0.5, "miou": 0.4, "n": 2, "num_unparseable": 1, "num_unjudged": 0},
        "num_samples": 2, "num_unjudged": 0, "unjudged_reasons": {},
        "blind": {"metrics": {"acc@0.5": 0.0, "miou": 0.1}},
        "blind_control": {"metrics": {"iou": {"real": 0.4, "blind": 0.1, "delta": 0.3, "n_pairs": 2}},
                          "num_unpaired": 0},
        "protocol": {"benchmark": "rec", "data_file": str(data / "data.jsonl"), "num_samples": 2, "blind": True},
        "headline": "acc@0.5", "sample_score": "iou"}
    (folder / "summary.json").write_text(json.dumps(summary))
    with open(folder / "samples.jsonl", "a") as handle:
        for i in range(2):
            for blind in (False, True):
                handle.write(json.dumps({
                    "benchmark": "rec", "prompt_index": i, "image_index": 0, "blind": blind, "id": f"g{i}",
                    "task": "grounding", "prompt": f"where is <the> dog {i}?", "image": "images/0000.png",
                    "answer": "no idea" if blind else f"[1, 2, 3, {i}] <box>", "target": [1, 2, 3, 4],
                    "scores": {"iou": 0.0 if blind else 0.5 * i},
                    "verdict": {"unparseable": "no <answer> block" if i == 0 else None}}) + "\n")
        handle.write("{not json\n")
    out = write_report([folder], tmp_path / "vlm.html")
    page = out.read_text()
    section = page[page.index("<h2>rec</h2>"):]
    assert "[1, 2, 3, 1] &lt;box&gt;" in section and "blind: no idea" in section
    assert "where is &lt;the&gt; dog 1?" in section and "target: [1, 2, 3, 4]" in section
    assert "#1 &middot; grounding" in section and "grounding: worst 2 of 2" in section
    assert "unparseable: no &lt;answer&gt; block" in section
    assert "mean iou 0.5" in section  # the blind control is not part of the sample's score
    rows = parse(out)
    assert metric_row(rows, "blind.acc@0.5")[1][2].startswith("0")
    assert metric_row(rows, "blind_control.iou.delta")[1][2].startswith("0.3")
    assert metric_direction("blind_control.iou.delta") == 0 and metric_direction("num_unparseable") == -1
    inputs = [img["src"] for img in rows.imgs if "input image" in img.get("alt", "")]
    assert len(inputs) >= 2 and all((out.parent / src).is_file() for src in inputs)  # found beside the data file
    assert "1 unreadable line(s) in samples.jsonl skipped" in page


def test_settings_and_counts_are_not_coloured_on_the_page(tmp_path):
    def with_fid(folder, **metrics):
        summary = json.loads((folder / "summary.json").read_text())
        summary["benchmarks"]["fid@drawbench"] = {
            "metrics": {"fid": 10.0, "kid": 0.01, **metrics}, "num_images": 4, "num_unjudged": 0,
            "unjudged_reasons": {}, "headline": "fid", "sample_score": "", "protocol": fid_protocol()}
        (folder / "summary.json").write_text(json.dumps(summary))
        return folder

    a = with_fid(make_eval(tmp_path / "a"), num_generated=4, num_reference=8, kid_subsets=100,
                 kid_subset_size_used=4, feature_dim=2048, tiles_per_prompt=4)
    b = with_fid(make_eval(tmp_path / "b", checkpoint=str(tmp_path / "r/checkpoints/step_1"),
                           run_dir=str(tmp_path / "r")), fid=8.0, kid=0.02, num_generated=6, num_reference=10,
                 kid_subsets=50, kid_subset_size_used=6, feature_dim=1024, tiles_per_prompt=1)
    page = write_report([a, b], tmp_path / "r.html").read_text()
    rows = _Cells()
    rows.feed(page[page.index("<h2>fid@drawbench</h2>"):])  # geneval has a fid row too
    assert "better" in metric_row(rows, "fid")[3][1] and "worse" in metric_row(rows, "kid")[3][1]
    for name in ("num_generated", "num_reference", "kid_subsets", "kid_subset_size_used", "feature_dim",
                 "tiles_per_prompt"):
        diff = metric_row(rows, name)[3]
        assert "same" in diff[1] and "better" not in diff[1] and "worse" not in diff[1], (name, diff)


def vlm_folder(tmp_path: Path, name="vlm", **extra) -> Path:
    """An evaluation holding a VLM benchmark ``rec`` (mmrl.eval.vlm's layout) with two samples, one of them
    without an answer (its generation failed), and the answer's unparseable reasons in the summary."""
    folder = make_eval(tmp_path / name)
    data = tmp_path / "data"
    write_png(data / "images" / "0000.png", 7)
    summary = json.loads((folder / "summary.json").read_text())
    summary["benchmarks"]["rec"] = {
        "metrics": {"acc@0.5": 0.5, "n": 2, "num_unparseable": 1, "num_unjudged": 1}, "num_samples": 2,
        "num_unjudged": 1, "unjudged_reasons": {"no answer: prompt too long": 1},
        "unparseable_reasons": {"no <answer> block": 3, "two boxes": 1},
        "blind": {"metrics": {"acc@0.5": 0.0}, "unparseable_reasons": {"empty answer": 2}},
        "protocol": {"benchmark": "rec", "data_file": str(data / "data.jsonl"), "num_samples": 2},
        "headline": "acc@0.5", "sample_score": "iou", **extra}
    (folder / "summary.json").write_text(json.dumps(summary))
    with open(folder / "samples.jsonl", "a") as handle:
        for i, answer in enumerate(["[1, 2, 3, 4]", None]):
            handle.write(json.dumps({
                "benchmark": "rec", "prompt_index": i, "image_index": 0, "blind": False, "id": f"g{i}",
                "task": "grounding", "prompt": f"where is the dog {i}?", "image": "images/0000.png", "answer": answer,
                "target": [1, 2, 3, 4], "scores": {"iou": 1.0 if answer else None},
                "verdict": {"unparseable": None},
                "reason": None if answer else "prompt longer than generation.max_prompt_length (5000 > 4096)"}) + "\n")
    return folder


def test_a_missing_answer_shows_no_answer_with_its_reason(tmp_path):
    page = write_report([vlm_folder(tmp_path)], tmp_path / "vlm.html").read_text()
    section = page[page.index("<h2>rec</h2>"):]
    assert "(no answer): prompt longer than generation.max_prompt_length (5000 &gt; 4096)" in section
    assert ">None<" not in section and "None" not in section.replace("none", "")
    assert '<div class="answer">[1, 2, 3, 4]</div>' in section


def test_unparseable_reasons_are_shown(tmp_path):
    page = write_report([vlm_folder(tmp_path)], tmp_path / "vlm.html").read_text()
    section = page[page.index("<h2>rec</h2>"):]
    why = section[section.index("Why answers were unparseable"):]
    assert "no &lt;answer&gt; block &times; 3" in why and "two boxes &times; 1" in why
    assert "(blind control): empty answer &times; 2" in why
    assert section.index("Why images were not judged") < section.index("Why answers were unparseable")


def test_worst_and_best_follow_the_scores_direction(tmp_path):
    """A lower-is-better sample score (an edit distance): the worst prompts are those with the highest score."""
    folder = make_eval(tmp_path / "ocr")
    summary = json.loads((folder / "summary.json").read_text())
    summary["benchmarks"]["ocr"] = {"metrics": {"edit_distance": 2.0}, "num_images": 4, "num_unjudged": 0,
                                    "unjudged_reasons": {}, "headline": "edit_distance",
                                    "sample_score": "edit_distance",
                                    "protocol": {"benchmark": "ocr", "num_prompts": 4, "images_per_prompt": 1}}
    (folder / "summary.json").write_text(json.dumps(summary))
    distances = [0.0, 9.0, 3.0, 1.0]
    with open(folder / "samples.jsonl", "a") as handle:
        for i, d in enumerate(distances):
            image = f"images/ocr/{i:05d}_0.png"
            write_png(folder / image, 90 + i)
            handle.write(json.dumps({"benchmark": "ocr", "prompt_index": i, "image_index": 0, "prompt": f"text {i}",
                                     "seed": 42, "image": image, "scores": {"edit_distance": d}, "verdict": None,
                                     "reason": None}) + "\n")
    out = write_report([folder], tmp_path / "ocr.html", per_category=1)
    page = out.read_text()
    section = page[page.index("<h2>ocr</h2>"):]
    section = section[section.index("Worst and best prompts"):]
    assert "(lower is better)" in section
    worst = section[section.index("all prompts: worst 1 of 4"):section.index("all prompts: best 1 of 4")]
    best = section[section.index("all prompts: best 1 of 4"):]
    assert "#1 " in worst and "text 1" in worst  # distance 9: the worst
    assert "#0 " in best and "text 0" in best  # distance 0: the best
    # a higher-is-better score still ranks as before: geneval's worst are the lowest
    geneval = page[page.index("<h2>geneval</h2>"):page.index("<h2>ocr</h2>")]
    assert "(higher is better)" in geneval


def test_per_item_mappings_are_left_out_of_the_tables(tmp_path):
    """DPG-Bench's metrics: per_prompt (one entry per prompt) and not_scored out, l1 / l2 / per_category in."""
    folder = make_eval(tmp_path / "dpg")
    summary = json.loads((folder / "summary.json").read_text())
    per_prompt = {f"item{i}": {"score": 0.5, "tile_scores": [0.5, 0.5, 0.5, 0.5]} for i in range(40)}
    summary["benchmarks"]["dpg_bench"] = {
        "metrics": {"overall": 80.0, "l1": {"entity": 90.0, "relation": 70.0}, "l2": {"entity.whole": 88.0},
                    "per_category": {"attribute": {"mean": 0.7, "n": 3, "num_unjudged": 0}}, "tiles_per_prompt": 4,
                    "num_prompts": 41, "per_prompt": per_prompt, "not_scored": {"item40": "judge failed"},
                    "csv": {"path": "/x/dpg.csv", "official": True}},
        "num_images": 164, "num_unjudged": 4, "unjudged_reasons": {}, "headline": "overall",
        "sample_score": "score", "protocol": {"benchmark": "dpg_bench"}}
    (folder / "summary.json").write_text(json.dumps(summary))
    out = write_report([folder], tmp_path / "dpg.html")
    rows = parse(out)
    names = [row[0][2].strip() for row in rows.rows if row and row[0][0] == "th"]
    assert not [n for n in names if n.startswith(("per_prompt", "not_scored"))], names
    for kept in ("overall", "l1.entity", "l1.relation", "l2.entity.whole", "per_category.attribute",
                 "tiles_per_prompt", "csv.path"):
        assert kept in names, kept
    page = out.read_text()
    assert "item17" not in page and "judge failed" not in page
    assert "per-item entries left out of the table (in summary.json)" in page
    assert "<code>per_prompt</code> (40 entries)" in page and "<code>not_scored</code> (1 entries)" in page
    assert report._without_per_item({"a": {"per_prompt": {"x": 1}, "b": 2}, "per_prompt": 0.5}) == (
        {"a": {"b": 2}, "per_prompt": 0.5}, {"a.per_prompt": 1})  # a number named per_prompt is a metric


class _Recorded:
    """report._matplotlib with every Figure made recorded."""

    def __init__(self):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        figures = self.figures = []

        class Recording(Figure):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                figures.append(self)

        self.value = (Recording, FigureCanvasAgg)


def test_dollar_signs_are_drawn_as_text(tmp_path, monkeypatch):
    """Labels, categories (tick labels), titles and curve names holding $ go to matplotlib as plain text: no mathtext
    (which would italicise $x$ and fail on $x^$)."""
    pytest.importorskip("matplotlib")
    from matplotlib.text import Text

    tags = ["$x$", "$x$", "a $x^$ b", "a $x^$ b"]
    prompts = ["$x$ costs $", "$", "b", "c"]
    metrics = [{"step": s, "reward/mean": 0.1 * s, "eval/$x$/score": 0.2 * s} for s in range(1, 4)]
    a = make_eval(tmp_path / "a", tags=tags, prompts=prompts)
    b = make_eval(tmp_path / "b", checkpoint=str(tmp_path / "r/checkpoints/step_2"), run_dir=str(tmp_path / "r"),
                  tags=tags, prompts=prompts, metrics_rows=metrics)
    recorded = _Recorded()
    monkeypatch.setattr(report, "_matplotlib", lambda: recorded.value)
    out = write_report([a, b], tmp_path / "dollar.html", labels=["$x$", "$"])
    page = out.read_text()
    assert "$x$ costs $" in page and "<th>$x$</th>" in page
    assert len(recorded.figures) >= 2  # the per_tag chart and the curves
    texts = [t for fig in recorded.figures for t in fig.findobj(Text) if "$" in t.get_text()]
    shown = {t.get_text() for t in texts}
    assert {"$x$", "$", "a $x^$ b", "eval/$x$/score"} <= shown, shown  # tick labels, legend, panel title
    assert any("a $x^$ b" in t for t in shown)
    assert all(t.get_parse_math() is False for t in texts), [t.get_text() for t in texts if t.get_parse_math()]
    for png in ("curves.png", "bench0-categories0.png"):
        with Image.open(out.parent / "dollar_files" / png) as image:
            assert image.size[0] > 300
    import matplotlib

    assert matplotlib.rcParams["text.parse_math"] is True  # switched off for the report's charts only


# ---------------------------------------------------------------------------------------------- folders and CLI


def test_resolve_eval_dir(tmp_path):
    run = make_run(tmp_path, "run", steps=(2, 10))
    make_eval(run / "eval" / "base")
    make_eval(run / "eval" / "step_10-no_ema")
    assert resolve_eval_dir(run) == run / "eval" / "step_10"  # the latest checkpoint's evaluation
    assert resolve_eval_dir(run / "eval" / "step_2") == run / "eval" / "step_2"
    assert resolve_eval_dir(run / "eval" / "base" / "summary.json") == run / "eval" / "base"
    custom = tmp_path / "custom"
    make_eval(custom / "eval" / "mine")
    assert resolve_eval_dir(custom) == custom / "eval" / "mine"  # the only one
    make_eval(custom / "eval" / "yours")
    with pytest.raises(ReportError, match="several evaluations"):
        resolve_eval_dir(custom)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "samples.jsonl").write_text("")
    with pytest.raises(ReportError, match="did not finish"):
        resolve_eval_dir(tmp_path / "half")
    with pytest.raises(ReportError, match="none named eval/step_N or eval/update_N"):
        resolve_eval_dir(custom)


def make_trained(root: Path, name: str, updates=(2, 10), steps=()) -> Path:
    """A run folder with the trainer's in-training evaluations eval/update_<k> (checkpoint path "update <k>") and,
    for ``steps``, mmrl eval's eval/step_N of checkpoints."""
    run = root / name
    metrics = [{"step": s, "reward/mean": 0.5 + s / 100, "eval/geneval/overall": 0.05 * s} for s in range(0, 13)]
    for k in updates:
        make_eval(run / "eval" / f"update_{k}", checkpoint=f"update {k}", run_dir=str(run), metrics_rows=metrics)
    for s in steps:
        make_eval(run / "eval" / f"step_{s}", checkpoint=str(run / "checkpoints" / f"step_{s}"), run_dir=str(run),
                  metrics_rows=metrics)
    return run


def test_resolve_eval_dir_falls_back_to_the_trainers_latest_update(tmp_path):
    run = make_trained(tmp_path, "trained", updates=(2, 10, 9))
    make_eval(run / "eval" / "base")
    assert resolve_eval_dir(run) == run / "eval" / "update_10"  # no step_N: the latest in-training evaluation
    both = make_trained(tmp_path, "both", updates=(2, 12), steps=(4,))
    assert resolve_eval_dir(both) == both / "eval" / "step_4"  # a checkpoint's evaluation first, as before
    assert report.load_eval(run / "eval" / "update_10").default_label() == "trained/update_10"
    assert not report.load_eval(run / "eval" / "update_10").is_base


def test_curve_marks_and_labels_of_checkpoint_and_update_evaluations(tmp_path, monkeypatch):
    run = make_trained(tmp_path, "trained", updates=(2, 10), steps=(4,))
    drawn = []
    real = report._curves_chart

    def spy(path, keys, series):
        drawn.append(series)
        return real(path, keys, series)

    monkeypatch.setattr(report, "_curves_chart", spy)
    out = write_report([run / "eval" / "step_4", run / "eval" / "update_2", run / "eval" / "update_10"],
                       tmp_path / "curves.html")
    [series] = drawn
    assert len(series) == 1  # one run: one line, one mark per evaluation
    label, _, marks = series[0]
    assert label == "trained/step_4, trained/update_2, trained/update_10"
    assert marks == [(4, "checkpoint"), (2, "update"), (10, "update")]
    page = out.read_text()
    assert "dashed lines: the in-training evaluations (eval/update_N)" in page
    assert "<th>trained/update_10</th>" in page and (out.parent / "curves_files" / "curves.png").is_file()


def test_compare_cli_with_run_folders(tmp_path, monkeypatch, capsys):
    base = make_eval(tmp_path / "base")
    a = make_run(tmp_path, "run_a", steps=(2, 4), overall=0.6)
    b = make_run(tmp_path, "run_b", steps=(4,), overall=0.7)
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--compare", str(base), str(a), str(b / "eval" / "step_4")]) == 0
    out = capsys.readouterr().out
    assert f"using {a / 'eval' / 'step_4'}" in out
    html_file = tmp_path / "compare" / "base_vs_run_a-step_4_vs_run_b-step_4" / "report.html"
    assert html_file.is_file() and "wrote compare/base_vs_run_a-step_4_vs_run_b-step_4/report.html" in out
    page = html_file.read_text()
    assert "base vs run_a/step_4 vs run_b/step_4" in page
    assert "+0.1" in "".join(c[2] for c in metric_row(parse(html_file), "overall"))
    # options after the folders, labels and an explicit output_dir
    assert main(["eval", str(base), str(a), "--compare", "labels=[ref, mine]", f"output_dir={tmp_path / 'o'}"]) == 0
    assert "ref vs mine" in (tmp_path / "o" / "report.html").read_text()


def test_compare_cli_errors(tmp_path, monkeypatch, capsys):
    base = make_eval(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    assert main(["eval", "--compare", str(base), str(tmp_path / "empty")]) == 2
    one_error(capsys, str(tmp_path / "empty"), "no summary.json")
    assert main(["eval", "--compare", str(base), str(tmp_path / "missing")]) == 2
    one_error(capsys, "no such folder")
    assert main(["eval", "--compare"]) == 2
    one_error(capsys, "--compare", "give the evaluation folders")
    assert main(["eval", "--compare", str(base), str(base)]) == 2
    one_error(capsys, "given twice")
    assert main(["eval", "--compare", str(base), "limit=3"]) == 2
    one_error(capsys, "limit=", "not a --compare key")
    assert main(["eval", "--compare", str(base), "labels=[a, b]"]) == 2
    one_error(capsys, "labels", "2 names for 1")
    other = make_eval(tmp_path / "other")
    assert main(["eval", "--compare", str(base), str(other), "labels=[x, x]"]) == 2
    one_error(capsys, "labels: x, x names a column twice")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "summary.json").write_text("{truncated")
    assert main(["eval", "--compare", str(base), str(bad)]) == 2
    one_error(capsys, "summary.json", "not readable JSON")
    (bad / "summary.json").write_text(json.dumps({"hello": 1}))
    assert main(["eval", "--compare", str(bad)]) == 2
    one_error(capsys, "not an mmrl eval summary")
    assert not (tmp_path / "compare").exists()  # nothing written on an error


def test_report_replaces_its_files_folder(tmp_path):
    a = make_eval(tmp_path / "a")
    out = write_report([a], a / "report.html")
    stale = a / "report_files" / "stale.png"
    stale.write_bytes(b"x")
    assert write_report([a], a) == out  # a folder: folder/report.html
    assert not stale.exists() and (a / "report_files").is_dir()
    assert not [p for p in a.iterdir() if p.name.startswith(".")]  # no staging leftovers


# ---------------------------------------------------------------------------------------------- the browser


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


class _DevTools:
    """Chromium's DevTools protocol over ``--remote-debugging-pipe`` (fd 3: commands in, fd 4: replies out)."""

    def __init__(self, binary: str, profile: str, timeout: float = 60.0):
        self.timeout = timeout
        cmd_r, self.cmd_w = os.pipe()
        self.res_r, res_w = os.pipe()

        def child():  # the pipe ends as the fds 3 and 4 Chromium expects
            os.dup2(cmd_r, 3)
            os.dup2(res_w, 4)

        self.log = open(Path(profile) / "stderr.log", "w+")
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             f"--user-data-dir={profile}", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--disable-background-networking", "about:blank"],
            preexec_fn=child, pass_fds=(3, 4, cmd_r, res_w), stdin=subprocess.DEVNULL, stdout=self.log,
            stderr=self.log)
        os.close(cmd_r)
        os.close(res_w)
        self.buffer = b""
        self.next_id = 0
        self.events: list[dict] = []

    def _read(self, done, deadline):
        while True:
            while b"\0" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\0", 1)
                message = json.loads(raw)
                if "id" not in message:
                    self.events.append(message)
                if done(message):
                    return message
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from Chromium")
            ready, _, _ = select.select([self.res_r], [], [], left)
            if ready:
                chunk = os.read(self.res_r, 1 << 20)
                if not chunk:
                    self.log.seek(0)
                    raise RuntimeError(f"Chromium closed the DevTools pipe: {self.log.read()[-2000:]}")
                self.buffer += chunk

    def call(self, method, params=None, session=None):
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.cmd_w, json.dumps(message).encode() + b"\0")
        ident = self.next_id
        reply = self._read(lambda m: m.get("id") == ident, time.monotonic() + self.timeout)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    def wait_event(self, method, session):
        return self._read(lambda m: m.get("method") == method and m.get("sessionId") == session,
                          time.monotonic() + self.timeout)

    def close(self):
        try:
            self.call("Browser.close")
        except Exception:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self.cmd_w, self.res_r):
            try:
                os.close(fd)
            except OSError:
                pass
        self.log.close()


def test_report_in_headless_chromium(three, tmp_path):
    binary = _chromium()
    if binary is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium): the browser check needs it")
    page = three["html"]
    tools = _DevTools(binary, tempfile.mkdtemp(dir=tmp_path))
    try:
        target = tools.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = tools.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            tools.call(f"{domain}.enable", session=session)
        tools.call("Emulation.setDeviceMetricsOverride", {"width": 1280, "height": 2000, "deviceScaleFactor": 1,
                                                          "mobile": False}, session=session)
        tools.call("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
        tools.wait_event("Page.loadEventFired", session)
        probe = ("JSON.stringify({tables: document.querySelectorAll('table').length,"
                 " metrics: document.querySelectorAll('table.metrics').length,"
                 " grids: document.querySelectorAll('table.grid').length,"
                 " better: document.querySelectorAll('td.better').length,"
                 " worse: document.querySelectorAll('td.worse').length,"
                 " images: Array.from(document.images).map(i => [i.getAttribute('src'), i.complete, i.naturalWidth]),"
                 " title: document.title, height: document.documentElement.scrollHeight,"
                 " table: (r => [r.x, r.y, r.width, r.height])(document.querySelector('table')"
                 ".getBoundingClientRect()),"
                 " img: (r => [r.x, r.y, r.width, r.height])(document.querySelector('table.grid img')"
                 ".getBoundingClientRect())})")
        dom = json.loads(tools.call("Runtime.evaluate", {"expression": probe, "returnByValue": True},
                                    session=session)["result"]["value"])
        shot = tools.call("Page.captureScreenshot", {"format": "png"}, session=session)["data"]
        tools.call("Runtime.evaluate", {"expression": "1"}, session=session)  # let late events arrive
    finally:
        tools.close()
    problems = []
    for event in tools.events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            problems.append(f"exception: {params['exceptionDetails'].get('text')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "warning", "assert"):
            problems.append(f"console.{params['type']}: {params.get('args')}")
        elif method == "Log.entryAdded" and params["entry"].get("level") in ("error", "warning"):
            problems.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
        elif method == "Network.loadingFailed":
            problems.append(f"failed load: {params.get('errorText')}")
    assert not problems, problems
    assert dom["title"].startswith("mmrl evaluation report: base vs grpo/step_4 vs gone/step_9")
    assert dom["metrics"] == 2 and dom["grids"] >= 4 and dom["tables"] >= 10, dom
    assert dom["better"] > 0 and dom["worse"] > 0
    assert len(dom["images"]) > 20
    assert all(complete and width > 0 for _, complete, width in dom["images"]), \
        [src for src, complete, width in dom["images"] if not (complete and width)]
    with Image.open(io.BytesIO(base64.b64decode(shot))) as image:
        pixels = np.asarray(image.convert("RGB")).astype(float)
    (tmp_path / "screenshot.png").write_bytes(base64.b64decode(shot))
    assert pixels.shape == (2000, 1280, 3)
    packed = pixels.astype(np.int64) @ np.array([1 << 16, 1 << 8, 1])  # one int per colour
    assert pixels.std() > 10 and len(np.unique(packed)) > 200  # not blank, not one colour
    x, y, w, h = (int(round(v)) for v in dom["table"])  # the runs table: dark text on light cells
    table = pixels[y:y + h, x:x + w]
    assert table.size and table.min() < 80 and table.max() > 200
    x, y, w, h = (int(round(v)) for v in dom["img"])  # a thumbnail of random noise, inside the first 2000 px
    if y + h <= 2000:
        assert w >= 80 and pixels[y:y + h, x:x + w].std() > 30


def test_small_thumbnails_are_exact_and_captions_name_their_metric(three):
    """A 32 px image went into the page as a q88 4:2:0 JPEG (pixels up to 69 / 255 off: a washed-out shape lost a
    quarter of its contrast); a caption "seed 42 · 0" read as an image index."""
    page = three["html"].read_text()
    thumbs = sorted((three["html"].parent / "report_files").glob("img*"))
    assert thumbs and all(t.suffix == ".png" for t in thumbs)  # make_eval's images are 32 px
    source = next((three["dirs"][0] / "images").rglob("*.png"))
    with Image.open(source) as original:
        exact = [t for t in thumbs if np.array_equal(np.asarray(Image.open(t).convert("RGB")),
                                                     np.asarray(original.convert("RGB")))]
    assert exact, "no thumbnail equals its 32 px source"
    assert re.search(r"seed \d+ &middot; \w[\w./@:-]* [0-9.]+", page)


def test_an_evaluation_without_a_config_file_reads_n_a(tmp_path):
    """The trainer's own evaluations record config_file: null, which the Runs table printed as Python's None."""
    folder = make_eval(tmp_path / "live")
    summary = json.loads((folder / "summary.json").read_text())
    summary["config_file"] = None
    (folder / "summary.json").write_text(json.dumps(summary))
    page = write_report([folder], tmp_path / "live.html").read_text()
    assert ">None<" not in page and '<td class="mono">n/a</td>' in page


def test_curve_order_puts_headlines_first_and_leaves_a_flat_failed_out():
    from mmrl.eval.report import _constant_zero, _curve_order

    keys = ["eval/geneval/per_tag/colors", "eval/failed", "eval/geneval/overall", "reward/mean", "eval/ocr/accuracy"]
    assert sorted(keys, key=_curve_order) == ["reward/mean", "eval/failed", "eval/geneval/overall",
                                              "eval/ocr/accuracy", "eval/geneval/per_tag/colors"]
    flat = [("run", [{"eval/failed": 0.0}, {"eval/failed": 0}], [])]
    assert _constant_zero("eval/failed", flat) and not _constant_zero("eval/failed", [("r", [{"eval/failed": 1}], [])])


def test_a_category_whose_prompts_all_tie_has_no_worst_or_best(tmp_path):
    """Every prompt scoring the same (a VLM whose answers all miss: IoU 0) was still split into 3 "worst" and 1
    "best"."""
    tied = make_eval(tmp_path / "tied", scores=[[1.0, 1.0]] * 4, tags=[TAGS[0]] * 4)
    page = write_report([tied], tmp_path / "tied.html").read_text()
    assert f"{TAGS[0]}: all 4 tied at 1" in page and f"{TAGS[0]}: worst" not in page
    assert "The first prompts, same seeds in every run" in page  # image rows carry seeds
