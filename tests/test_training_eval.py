"""Benchmarks during training (``eval.every``): ``mmrl train`` runs ``mmrl eval``'s benchmarks on the live weights,
logs ``eval/<benchmark>/<metric>`` with its metrics, writes ``output_dir/eval/update_<k>/``; the numbers equal
``mmrl eval`` on the checkpoint of that update, the evaluation leaves training untouched, and every mistake in the
``eval`` section stops the run at startup in one line."""
from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

import mmrl.build
from mmrl.cli import main
from mmrl.eval.runner import training_metrics
from mmrl.pipelines.flow.tiny import build_tiny_sd3
from fixtures import TINY_RECIPE, metrics_rows

TINY = ["sampling.num_steps=3", "sampling.eval_num_steps=3", "sampling.max_sequence_length=16",
        "data.prompts_per_step=2", "data.group_size=2", "train.batch_size=2", "logging.eval_every=0",
        "logging.progress_bar=false", "logging.tensorboard=false", "optim.lr=1e-2", "train.steps=2",
        "logging.save_every=1", "logging.keep_last=3"]
EVAL = ["eval.every=1", "eval.benchmarks=[ocr,reward:brightness@drawbench]", "eval.limit=2",
        "eval.options={resolution: 32, num_steps: 2}"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_sd3(tmp_path_factory.mktemp("tiny") / "sd3"))


def _train(run: Path, tiny_path: str, *extra: str) -> int:
    return main(["train", TINY_RECIPE, f"output_dir={run}", f"model.pretrained={tiny_path}", *TINY, *extra])


_metrics = metrics_rows


@pytest.fixture(scope="module")
def runs(tiny_path, tmp_path_factory):
    base = tmp_path_factory.mktemp("train-eval")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert _train(base / "with", tiny_path, *EVAL) == 0
    (base / "with.stdout").write_text(printed.getvalue())
    assert _train(base / "without", tiny_path) == 0
    return base / "with", base / "without"


def test_eval_metrics_are_logged_at_every_interval_and_before_training(runs):
    with_eval, _ = runs
    rows = _metrics(with_eval)
    steps = [r["step"] for r in rows if "eval/ocr/accuracy" in r]
    assert steps == [0, 1, 2]
    for r in rows:
        if "eval/ocr/accuracy" in r:
            assert 0.0 <= r["eval/ocr/accuracy"] <= 1.0
            assert math.isfinite(r["eval/reward:brightness@drawbench/brightness/mean"])
    for k in (0, 1, 2):
        out = with_eval / "eval" / f"update_{k}"
        summary = json.loads((out / "summary.json").read_text())
        assert summary["checkpoint"]["path"] == f"update {k}"
        assert len((out / "samples.jsonl").read_text().splitlines()) == 2 + 2 * 5  # ocr 2x1, drawbench 2x5
        assert (out / "grids" / "ocr.png").is_file()


def test_the_run_report_compares_every_evaluation_with_the_untrained_model(runs, tiny_path, capsys):
    with_eval, without = runs
    page = (with_eval / "report.html").read_text()
    for k in (0, 1, 2):
        assert f"update {k}" in page
    assert (with_eval / "report_files").is_dir() and any((with_eval / "report_files").iterdir())
    assert not (without / "report.html").exists()  # no benchmarks, no report
    capsys.readouterr()
    assert _train(with_eval, tiny_path, *EVAL, "resume=auto") == 0  # complete: says so and where things are
    out = capsys.readouterr().out
    assert "nothing to do" in out
    assert f"report:     {with_eval / 'report.html'}" in out
    assert f"checkpoint: {with_eval / 'checkpoints' / 'step_2'}" in out


def test_the_run_report_is_written_after_its_update_is_logged_so_its_curves_end_there(tiny_path, tmp_path,
                                                                                      monkeypatch):
    import mmrl.trainer

    written = []
    original = mmrl.trainer.Trainer._write_run_report

    def spy(self):
        # what the report's curves read: the run's metrics.jsonl as it is when the report is written
        written.append((self.update, max(r["step"] for r in _metrics(self.output_dir))))
        original(self)

    monkeypatch.setattr(mmrl.trainer.Trainer, "_write_run_report", spy)
    assert _train(tmp_path / "run", tiny_path, *EVAL) == 0
    assert written == [(1, 1), (2, 2)]
    assert (tmp_path / "run" / "report.html").is_file()


def test_the_end_of_a_run_prints_each_benchmarks_headline_from_update_0_to_the_last(runs):
    with_eval, _ = runs
    printed = (with_eval.parent / "with.stdout").read_text()
    rows = _metrics(with_eval)
    # the headlines "accuracy" and "brightness.mean" (a nested metric)
    for key in ("eval/ocr/accuracy", "eval/reward:brightness@drawbench/brightness/mean"):
        values = [r[key] for r in rows if key in r]
        assert len(values) == 3
        assert f"  {key[5:]}: {values[0]:.4g} -> {values[-1]:.4g}" in printed, printed


def test_a_resumed_run_prints_its_headline_from_update_0_not_from_its_first_evaluation_since(tiny_path, tmp_path,
                                                                                             capsys):
    run = tmp_path / "run"
    assert _train(run, tiny_path, *EVAL) == 0
    capsys.readouterr()
    assert _train(run, tiny_path, *EVAL, "train.steps=3") == 0  # continues for one more update
    out = capsys.readouterr().out
    rows = _metrics(run)
    key = "eval/reward:brightness@drawbench/brightness/mean"
    values = {r["step"]: r[key] for r in rows if key in r}
    assert sorted(values) == [0, 1, 2, 3] and f"{values[0]:.4g}" != f"{values[3]:.4g}"
    assert f"  {key[5:]}: {values[0]:.4g} -> {values[3]:.4g}" in out, out


def test_evaluating_leaves_training_bit_identical(runs):
    with_eval, without = runs
    a = load_file(with_eval / "checkpoints" / "step_2" / "trainable.safetensors")
    b = load_file(without / "checkpoints" / "step_2" / "trainable.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].equal(b[name]), name
    ra = [r for r in _metrics(with_eval) if "reward/mean" in r]
    rb = [r for r in _metrics(without) if "reward/mean" in r]
    assert [r["reward/mean"] for r in ra] == [r["reward/mean"] for r in rb]


def test_the_numbers_equal_mmrl_eval_on_that_updates_checkpoint(runs, tmp_path):
    with_eval, _ = runs
    out = tmp_path / "offline"
    assert main(["eval", str(with_eval), f"checkpoint={with_eval / 'checkpoints' / 'step_1'}",
                 "benchmarks=[ocr,reward:brightness@drawbench]", "limit=2", "resolution=32", "num_steps=2",
                 f"output_dir={out}", "progress=false"]) == 0
    offline = json.loads((out / "summary.json").read_text())
    live = json.loads((with_eval / "eval" / "update_1" / "summary.json").read_text())
    assert offline["generator"]["weights_sha256"] == live["generator"]["weights_sha256"]
    for name in ("ocr", "reward:brightness@drawbench"):
        assert offline["benchmarks"][name]["metrics"] == live["benchmarks"][name]["metrics"]
        assert offline["benchmarks"][name]["protocol"]["hash"] == live["benchmarks"][name]["protocol"]["hash"]
    logged = next(r for r in _metrics(with_eval) if r["step"] == 1 and "eval/ocr/accuracy" in r)
    assert logged["eval/ocr/accuracy"] == offline["benchmarks"]["ocr"]["metrics"]["accuracy"]


def test_training_metrics_flatten_numbers_and_drop_counts():
    summary = {"benchmarks": {
        "geneval": {"metrics": {"overall": 0.5, "counting": 0.25, "n": 8, "num_unjudged": 1,
                                "counts": {"counting": 4, "colors": 4},  # prompts per tag: flat lines in the report
                                "partial": {"mean": 0.75, "n": 8, "num_unjudged": 0}}},
        "ocr": {"metrics": {"accuracy": None}}}}
    flat = training_metrics(summary)
    assert set(flat) == {"eval/geneval/overall", "eval/geneval/counting", "eval/geneval/partial/mean",
                         "eval/ocr/accuracy"}
    assert flat["eval/geneval/partial/mean"] == 0.75 and math.isnan(flat["eval/ocr/accuracy"])


def test_the_fixed_grid_shows_distinct_prompts_and_its_base_scores_start_the_curves(tiny_path, tmp_path):
    """A tag-balanced prompt set repeats its small categories: the default run's grid showed 2 prompts 3 times. The
    grid's rows are now the first distinct prompts, listed beside it, and with eval.every the update-0 line holds
    the grid's rewards (eval/reward/*), the curves' first point."""
    run = tmp_path / "run"
    assert _train(run, tiny_path, "train.steps=1", "logging.eval_every=1", "data.num_eval_prompts=3",
                  "data.prompt_list=[a red circle, a red circle, a red circle, a blue square, a cat]",
                  "eval.every=1", "eval.benchmarks=[ocr]", "eval.limit=1", "eval.options={resolution: 32, num_steps: 2}"
                  ) == 0
    assert (run / "samples" / "grid_prompts.txt").read_text() == "a red circle\na blue square\na cat\n"
    first = _metrics(run)[0]
    assert first["step"] == 0 and "eval/ocr/accuracy" in first
    assert {k for k in first if k.startswith("eval/reward/")} == {"eval/reward/total", "eval/reward/brightness"}


@pytest.mark.parametrize("extra, words", [
    (["eval.every=1"], ["eval.benchmarks must not be empty"]),
    (["eval.every=1", "eval.benchmarks=[genevall]"], ["unknown benchmark 'genevall'", "geneval"]),
    (["eval.every=1", "eval.benchmarks=[ocr]", "eval.options={limit: 3}"], ["eval.options.limit", "set by the trainer"]),
    (["eval.every=1", "eval.benchmarks=[ocr]", "eval.options={resolutoin: 32}"], ["unknown eval key 'resolutoin'"]),
    (["eval.every=1", "eval.benchmarks=[reward:brightness]"], ["needs prompts"]),
    (["eval.every=-1"], ["eval.every must be >= 0"]),
])
def test_a_mistake_in_the_eval_section_stops_the_run_at_startup(extra, words, tiny_path, tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.setattr(mmrl.build, "build_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    assert _train(tmp_path / "run", tiny_path, *extra) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("mmrl: error: "), err
    for word in words:
        assert word in err[0], (word, err[0])


VLM = ["train.steps=1", "logging.progress_bar=false", "logging.tensorboard=false", "generation.max_new_tokens=12",
       "logging.eval_every=0", "logging.save_every=1"]
REPO = Path(__file__).parents[1]


def test_a_vlm_run_evaluates_its_benchmarks_like_mmrl_eval_and_trains_the_same(tmp_path):
    config = str(REPO / "configs/tiny/vlm_grounding.yaml")
    assert main(["train", config, *VLM, f"output_dir={tmp_path / 'with'}", "eval.every=1", "eval.benchmarks=[rec]",
                 "eval.limit=3", "eval.options={batch_size: 2}"]) == 0
    assert main(["train", config, *VLM, f"output_dir={tmp_path / 'without'}"]) == 0
    a = load_file(tmp_path / "with" / "checkpoints" / "step_1" / "trainable.safetensors")
    b = load_file(tmp_path / "without" / "checkpoints" / "step_1" / "trainable.safetensors")
    assert all(a[name].equal(b[name]) for name in a)
    logged = {r["step"]: r for r in _metrics(tmp_path / "with") if "eval/rec/acc@0.5" in r}
    assert sorted(logged) == [0, 1]
    out = tmp_path / "offline"
    assert main(["eval", str(tmp_path / "with"), f"checkpoint={tmp_path / 'with' / 'checkpoints' / 'step_1'}",
                 "benchmarks=[rec]", "limit=3", "batch_size=2", f"output_dir={out}", "progress=false"]) == 0
    offline = json.loads((out / "summary.json").read_text())
    live = json.loads((tmp_path / "with" / "eval" / "update_1" / "summary.json").read_text())
    assert offline["benchmarks"]["rec"]["metrics"] == live["benchmarks"]["rec"]["metrics"]
    live_rows = (tmp_path / "with" / "eval" / "update_1" / "samples.jsonl").read_text().splitlines()
    offline_rows = (out / "samples.jsonl").read_text().splitlines()
    assert [json.loads(r)["answer"] for r in live_rows] == [json.loads(r)["answer"] for r in offline_rows]
    assert logged[1]["eval/rec/acc@0.5"] == offline["benchmarks"]["rec"]["metrics"]["acc@0.5"]


def test_a_run_with_benchmarks_waits_long_enough_in_its_collectives():
    from mmrl.build import EVAL_COLLECTIVE_TIMEOUT_S, build_accelerator
    from mmrl.config import load_config

    config = load_config(REPO / "configs/tiny/flow_grpo.yaml", ["eval.every=1", "eval.benchmarks=[ocr]"],
                         check_files=False)
    handler = build_accelerator(config).init_handler
    assert handler is not None and handler.timeout.total_seconds() == EVAL_COLLECTIVE_TIMEOUT_S > 600
    plain = load_config(REPO / "configs/tiny/flow_grpo.yaml", check_files=False)
    assert build_accelerator(plain).init_handler is None


def test_a_failed_evaluation_after_training_started_is_a_warning_not_a_lost_run(tiny_path, tmp_path, monkeypatch,
                                                                                capsys):
    import mmrl.eval.runner as runner

    real = runner.evaluate_policy

    def flaky(policy, config, update, *args, **kwargs):
        if update == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(policy, config, update, *args, **kwargs)

    monkeypatch.setattr(runner, "evaluate_policy", flaky)
    assert _train(tmp_path / "run", tiny_path, *EVAL) == 0
    printed = capsys.readouterr()
    assert "mmrl: warning: the benchmarks at update 1 failed (RuntimeError: CUDA out of memory (simulated))" in \
        printed.out + printed.err
    rows = {r["step"]: r for r in _metrics(tmp_path / "run") if "eval/failed" in r}
    assert {k: rows[k]["eval/failed"] for k in rows} == {0: 0.0, 1: 1.0, 2: 0.0}
    assert "eval/ocr/accuracy" not in rows[1] and "eval/ocr/accuracy" in rows[2]
    assert (tmp_path / "run" / "checkpoints" / "step_2").is_dir()


def test_a_benchmark_that_cannot_run_before_training_is_the_runs_error(tiny_path, tmp_path, monkeypatch):
    import mmrl.eval.runner as runner

    monkeypatch.setattr(runner, "evaluate_policy", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no model")))
    with pytest.raises(RuntimeError, match="no model"):
        _train(tmp_path / "run", tiny_path, *EVAL)


@pytest.fixture
def live_policy(tiny_path):
    from mmrl.build import build_policy
    from mmrl.config import load_config

    config = load_config(TINY_RECIPE, [f"model.pretrained={tiny_path}", *TINY, *EVAL], check_files=False)
    return config, build_policy(config)


def test_evaluation_leaves_the_policy_and_every_rng_as_it_found_them(live_policy, tmp_path, monkeypatch):
    import random

    import numpy as np
    import torch

    import mmrl.eval.runner as runner

    config, policy = live_policy
    score = runner.RewardScorer.score

    def greedy_for_randomness(self, images, item):  # a scorer that draws from every global RNG
        torch.rand(3), np.random.rand(3), random.random()
        return score(self, images, item)

    monkeypatch.setattr(runner.RewardScorer, "score", greedy_for_randomness)
    states = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    settings = policy.resolution, policy.guidance_scale, policy._use_cfg
    runner.evaluate_policy(policy, config, 3, tmp_path / "update_3", echo=lambda line: None)
    assert torch.equal(torch.get_rng_state(), states[0])
    assert np.array_equal(np.random.get_state()[1], states[1]) and random.getstate() == states[2]
    assert (policy.resolution, policy.guidance_scale, policy._use_cfg) == settings
    assert (tmp_path / "update_3" / "summary.json").is_file()


def test_an_evaluation_of_other_weights_at_the_same_update_is_moved_aside(live_policy, tmp_path):
    import mmrl.eval.runner as runner

    config, policy = live_policy
    out = tmp_path / "update_2"
    out.mkdir()
    (out / "protocol.json").write_text(json.dumps({"generator": {"hash": "0" * 64, "weights_sha256": "x"}}))
    lines = []
    summary = runner.evaluate_policy(policy, config, 2, out, echo=lines.append)
    assert any("held an evaluation of other weights at update 2" in line and "update_2.stale-1" in line
               for line in lines)
    assert json.loads((tmp_path / "update_2.stale-1" / "protocol.json").read_text())["generator"]["hash"] == "0" * 64
    assert summary["checkpoint"]["path"] == "update 2" and (out / "summary.json").is_file()


def test_training_metrics_leave_out_per_item_entries_and_log_the_blind_control():
    summary = {"benchmarks": {
        "dpg_bench": {"metrics": {"overall": 80.0, "per_prompt": {"a": {"score": 0.5}}, "not_scored": {"b": "x"}}},
        "rec": {"metrics": {"acc@0.5": 0.5}, "blind": {"metrics": {"acc@0.5": 0.25, "n": 4}}}}}
    assert training_metrics(summary) == {"eval/dpg_bench/overall": 80.0, "eval/rec/acc@0.5": 0.5,
                                         "eval/rec/blind/acc@0.5": 0.25}
