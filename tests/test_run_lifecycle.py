"""What a run says and does at its edges: the startup summary, resuming with changed settings, run-health
warnings, SIGTERM / SIGINT stopping cleanly with a checkpoint that resumes exactly, TensorBoard after a resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mmrl.cli import main
from mmrl.health import RunHealth, no_signal_cause
from mmrl.pipelines.flow.tiny import build_tiny_sd3
from fixtures import TINY_RECIPE, metrics_rows

REPO = Path(__file__).parents[1]
TINY = ["sampling.num_steps=4", "sampling.eval_num_steps=4", "sampling.max_sequence_length=16",
        "data.prompts_per_step=2", "data.group_size=2", "train.batch_size=2", "data.eval_seeds=[0, 1]",
        "data.num_eval_prompts=2", "logging.progress_bar=false", "logging.tensorboard=false",
        "logging.eval_every=0", "optim.lr=1e-2", "algorithm.clip_low=0.01"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_sd3(tmp_path_factory.mktemp("tiny") / "sd3"))


def _train(run: Path, tiny_path: str, *extra: str) -> int:
    return main(["train", TINY_RECIPE, f"output_dir={run}", f"model.pretrained={tiny_path}", *TINY, *extra])


_metrics = metrics_rows


def test_startup_summary_says_what_the_run_does(tmp_path, tiny_path, capsys):
    assert _train(tmp_path / "run", tiny_path, "train.steps=1", "train.gradient_accumulation_steps=2") == 0
    out = capsys.readouterr().out
    assert f"mmrl train -> {tmp_path / 'run'}" in out
    assert "trainable parameters of" in out and "LoRA r16" in out
    assert "device    cpu, 1 process(es), mixed precision no" in out
    assert "2 prompts x 2 samples = 4 per process, 4 in all" in out
    assert "2 optimizer steps of 4 samples per process (2 inner epoch(s) of 2 minibatches of 2, shuffled samples)" in out
    assert "start     a new run" in out


def test_resume_applies_a_new_lr_and_keeps_the_original_config(tmp_path, tiny_path, capsys):
    run = tmp_path / "run"
    assert _train(run, tiny_path, "train.steps=2", "logging.save_every=2") == 0
    original = (run / "config.yaml").read_text()
    capsys.readouterr()
    assert _train(run, tiny_path, "train.steps=3", "optim.lr=0.001") == 0
    out = capsys.readouterr().out
    assert "resumed at update 2 of 3" in out
    assert "changed   optim.lr: 0.01 -> 0.001 (applied from update 2)" in out
    assert "changed   train.steps: 2 -> 3" in out
    assert "the updates so far followed a 2-update run" in out  # an extended run is not a straight 3-update one
    assert (run / "config.yaml").read_text() == original  # never overwritten
    assert yaml.safe_load((run / "config.resume_2.yaml").read_text())["optim"]["lr"] == 0.001
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[1]["lr"] == pytest.approx(0.01) and metrics[2]["lr"] == pytest.approx(0.001)  # really applied


def test_resume_refuses_changes_the_checkpoint_cannot_take(tmp_path, tiny_path, capsys):
    run = tmp_path / "run"
    assert _train(run, tiny_path, "train.steps=1") == 0
    before = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert _train(run, tiny_path, "train.steps=2", "model.lora_rank=8", "data.prompt_list=[a cat]") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("mmrl: error: cannot resume") and "model.lora_rank: 16 in the checkpoint, 8 now" in err
    assert "data.prompt_list" in err and "start a new output_dir" in err
    assert (run / "metrics.jsonl").read_text() == before and not (run / "config.resume_1.yaml").exists()


def test_health_warns_on_a_run_with_nothing_to_learn(tmp_path, monkeypatch, capsys):
    """A random tiny VLM writes no parseable answer: every reward 0, nothing trained; the monitor says so and why."""
    monkeypatch.setenv("MMRL_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    assert main(["train", str(REPO / "configs/tiny/vlm_grounding.yaml"), f"output_dir={run}", "train.steps=3",
                 "logging.progress_bar=false", "logging.tensorboard=false", "logging.eval_every=0",
                 "generation.max_new_tokens=8", "train.inner_epochs=1"]) == 0
    err_out = capsys.readouterr()
    text = err_out.out + err_out.err
    assert "3 updates in a row with no trainable signal" in text and "no parseable answer" in text
    metrics = _metrics(run)
    assert [m["health/no_signal_streak"] for m in metrics] == [1.0, 2.0, 3.0]
    assert [m["health/warnings"] for m in metrics] == [0.0, 0.0, 1.0]
    # 2 updates, then resumed for the third: the streak carries over and the warning comes at update 3 as above
    split = tmp_path / "split"
    common = ["logging.progress_bar=false", "logging.tensorboard=false", "logging.eval_every=0",
              "generation.max_new_tokens=8", "train.inner_epochs=1", "logging.save_every=1"]
    assert main(["train", str(REPO / "configs/tiny/vlm_grounding.yaml"), f"output_dir={split}", "train.steps=2",
                 *common]) == 0
    capsys.readouterr()
    assert main(["train", str(REPO / "configs/tiny/vlm_grounding.yaml"), f"output_dir={split}", "train.steps=3",
                 "resume=auto", *common]) == 0
    resumed_out = capsys.readouterr()
    assert "3 updates in a row with no trainable signal" in resumed_out.out + resumed_out.err
    assert [m["health/no_signal_streak"] for m in _metrics(split)] == [1.0, 2.0, 3.0]


def test_health_rules_by_hand():
    warnings = []
    health = RunHealth(warn=warnings.append)
    base = {"samples/trained": 8.0, "samples/informative": 8.0, "samples/zero_advantage": 0.0, "samples/nan_reward": 0.0,
            "clipfrac": 0.1,
            "kl": 0.01, "grad_norm": 1.0}
    for step in range(1, 6):
        assert health.check({**base, "step": step})["health/warnings"] == 0
    out = health.check({**base, "step": 6, "kl": 0.5, "grad_norm": 20.0, "clipfrac": 0.7})
    assert out["health/kl_spike"] == out["health/grad_norm_spike"] == out["health/clipfrac_high"] == 1.0
    assert out["health/warnings"] == 3 and len(warnings) == 3
    nan = {**base, "samples/informative": 0.0, "samples/zero_advantage": 8.0, "samples/nan_reward": 8.0}
    for step in range(7, 10):
        out = health.check({**nan, "step": step})
    assert out["health/nan_reward_streak"] == 3 and out["health/no_signal_streak"] == 3
    assert any("more than half of the rewards NaN" in w for w in warnings)
    assert "every reward is NaN" in no_signal_cause(nan)
    assert "do not vary within any group" in no_signal_cause({**nan, "samples/nan_reward": 0.0})
    # nothing parseable: a model that cannot answer yet, unless every answer was cut off (it advised SFT to a model
    # just fine-tuned, whose answers were longer than the GRPO config's max_new_tokens)
    unread = {**nan, "samples/nan_reward": 0.0, "reward_info/iou/num_unparseable": 8.0}
    assert "needs SFT first" in no_signal_cause(unread)
    cut = no_signal_cause({**unread, "completions/clipped_ratio": 1.0, "completions/mean_length": 24.0})
    assert "no parseable answer" in cut and "cut off by generation.max_new_tokens" in cut
    assert "cut off" not in no_signal_cause(unread)
    # the clipped-fraction rule reads TRL's region (the gradient cut) where it is logged
    assert RunHealth(warn=lambda *_: None).check({**base, "step": 1, "clipfrac": 0.9, "clip_ratio/region": 0.2})[
        "health/clipfrac_high"] == 0.0


def test_a_turning_point_run_without_turning_points_is_warned_once_per_episode():
    from mmrl.core.credit import turning_points
    from mmrl.health import TURNING_POINT_STREAK

    # why it happens: with 0/1 step rewards the consistency filter never finds a turning point, whatever the path
    paths = torch.tensor([[0, 1, 0, 1, 1], [1, 0, 0, 1, 0], [0, 0, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float32)
    assert not turning_points(paths).any()
    assert turning_points(torch.tensor([[0.2, 0.6, 0.4, 0.9]])).tolist() == [[True, False, False]]  # graded: step 0
    warnings = []
    health = RunHealth(warn=warnings.append)
    base = {"samples/trained": 8.0, "samples/informative": 8.0}
    assert "health/no_turning_point_streak" not in health.check({**base, "step": 1})  # not a turning-point run
    streaks = [health.check({**base, "step": s, "credit/turning_points": 0.0})["health/no_turning_point_streak"]
               for s in range(1, TURNING_POINT_STREAK + 3)]
    assert streaks == [float(k) for k in range(1, TURNING_POINT_STREAK + 3)]
    assert len(warnings) == 1 and "turning_point credit is step-gain credit here" in warnings[0]
    out = health.check({**base, "step": 99, "credit/turning_points": 3.0})
    assert out["health/no_turning_point_streak"] == 0.0 and out["health/warnings"] == 0.0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_at_an_update_boundary_with_a_checkpoint_that_resumes_exactly(tmp_path, tiny_path, sig):
    common = ["train", TINY_RECIPE, f"model.pretrained={tiny_path}", *TINY, "logging.save_every=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-m", "mmrl.cli", *common, f"output_dir={run}", "train.steps=400"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text()):
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in err
    done = len(_metrics(run))
    assert 1 <= done < 400
    assert f"stopped by {signal.Signals(sig).name} after update {done}" in out
    assert (run / "checkpoints" / f"step_{done}" / "state.json").is_file()
    # resume=auto continues from it and ends where an uninterrupted run ends
    assert main([*common, f"output_dir={run}", f"train.steps={done + 1}"]) == 0
    assert main([*common, f"output_dir={tmp_path / 'straight'}", f"train.steps={done + 1}"]) == 0
    a = load_file(str(run / "checkpoints" / f"step_{done + 1}" / "trainable.safetensors"))
    b = load_file(str(tmp_path / "straight" / "checkpoints" / f"step_{done + 1}" / "trainable.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tensorboard_drops_the_killed_runs_later_points_on_resume(tmp_path, tiny_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert _train(run, tiny_path, "train.steps=3", "logging.save_every=1", "logging.tensorboard=true") == 0
    # as if killed after update 3's metrics but before its checkpoint: the newest checkpoint is step_2
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_3")
    assert _train(run, tiny_path, "train.steps=3", "logging.save_every=1", "logging.tensorboard=true") == 0
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("loss")]
    assert steps == [1, 2, 3]  # update 3 once, not twice


@pytest.mark.parametrize("damage", ["optimizer.pt missing", "trainable.safetensors cut", "optimizer.pt cut",
                                    "state.json broken", "state.json a list", "state.json data empty",
                                    "state.json update text"])
def test_a_damaged_checkpoint_is_one_line_naming_the_previous_one(tmp_path, tiny_path, capsys, damage):
    """A checkpoint that is complete (state.json) but damaged: one line naming it and the previous complete one,
    and resuming from that one works."""
    run = tmp_path / "run"
    assert _train(run, tiny_path, "train.steps=2", "logging.save_every=1") == 0
    step2, step1 = run / "checkpoints" / "step_2", run / "checkpoints" / "step_1"
    name = damage.split()[0]
    if damage.endswith("missing"):
        (step2 / name).unlink()
    elif damage.endswith("cut"):
        data = (step2 / name).read_bytes()
        (step2 / name).write_bytes(data[:len(data) // 2])
    elif damage.endswith(("empty", "text")):  # parses, but holds what no run wrote (KeyError / TypeError before)
        import json

        state = json.loads((step2 / name).read_text())
        state.update({"data": {}} if damage.endswith("empty") else {"update": "2"})
        (step2 / name).write_text(json.dumps(state))
    else:
        (step2 / name).write_text("{bad" if damage.endswith("broken") else "[]")
    capsys.readouterr()
    assert _train(run, tiny_path, "train.steps=3") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mmrl: error: checkpoint {step2} is damaged"), err
    assert name in err[0] and f"resume={step1}" in err[0]
    assert _train(run, tiny_path, "train.steps=3", f"resume={step1}") == 0
    assert [m["step"] for m in _metrics(run)] == [1, 2, 3]


def test_a_half_written_metrics_line_is_dropped_on_resume(tmp_path, tiny_path):
    """A run killed while logging leaves half a line; the resumed run drops it (and the rows after its
    checkpoint) instead of failing to parse the file."""
    run = tmp_path / "run"
    assert _train(run, tiny_path, "train.steps=2", "logging.save_every=2") == 0
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 3, "rew')
    assert _train(run, tiny_path, "train.steps=3") == 0
    assert [m["step"] for m in _metrics(run)] == [1, 2, 3]
    assert not list(run.glob(".metrics.jsonl.tmp-*"))


def test_a_new_run_keeps_the_logs_an_earlier_run_left_without_a_checkpoint(tmp_path, caplog):
    """A run killed before its first checkpoint leaves metrics.jsonl and TensorBoard events; a new run in that
    output_dir deleted the metrics (28 lines -> 3) and mixed both runs' events on one step axis."""
    from mmrl.tracking import MetricsLogger

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.1").write_bytes(b"old")
    with caplog.at_level("WARNING", logger="mmrl.tracking"):
        logger = MetricsLogger(tmp_path, tensorboard=True)
    logger.log({"step": 1, "loss": 0.5})
    logger.close()
    assert (tmp_path / "metrics.jsonl.stale-1").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert [p.name for p in (tmp_path / "tensorboard.stale-1").iterdir()] == ["events.out.tfevents.1"]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    assert "moved to metrics.jsonl.stale-1" in caplog.text and "moved to tensorboard.stale-1" in caplog.text


@pytest.mark.parametrize("override,message", [
    ("model.lora_target_modules=[nosuch]", "model.lora_target_modules=['nosuch']: Target modules {'nosuch'} not found"),
    ("rewards={jpeg_compressibility: {weight: 1, kwargs: {scale_divisor: 0}}}",
     "rewards.jpeg_compressibility: ValueError: scale_divisor must be a non-zero number"),
])
def test_values_only_the_model_or_a_reward_can_refuse_are_one_line(tmp_path, tiny_path, capsys, override, message):
    assert _train(tmp_path / "run", tiny_path, "train.steps=1", override) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmrl: error: ") and message in err[0], err


def test_evaluated_weights_prefer_ema_and_name_a_damaged_file(tmp_path):
    """What `mmrl eval` and `mmrl sample` load: the EMA weights when the checkpoint has them (unless told not to), a
    damaged file a CheckpointError naming the checkpoint and the previous complete one."""
    from mmrl.checkpoint import CheckpointError, evaluated_weights, save_checkpoint

    live, shadow = {"w": torch.ones(2)}, {"w": torch.full((2,), 3.0)}
    for step in (1, 2):
        save_checkpoint(tmp_path, step, trainable=live, state={"update": step}, objects={"ema": {"shadow": shadow}})
    weights, is_ema = evaluated_weights(tmp_path / "step_2")
    assert is_ema and torch.equal(weights["w"], shadow["w"])
    weights, is_ema = evaluated_weights(tmp_path / "step_2", ema=False)
    assert not is_ema and torch.equal(weights["w"], live["w"])
    (tmp_path / "step_2" / "ema.pt").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match=rf"checkpoint .*step_2 is damaged: ema.pt cannot be read .*"
                                              rf"resume={tmp_path / 'step_1'}") as info:
        evaluated_weights(tmp_path / "step_2")
    # mmrl eval and mmrl sample read a checkpoint: their advice names their own way to pick the previous one
    assert info.value.for_reading("eval").endswith(f"evaluate the previous complete one with "
                                                   f"checkpoint={tmp_path / 'step_1'}")
    assert info.value.for_reading("sample").endswith(f"mmrl sample {tmp_path / 'step_1'}")
    assert "resume=" not in info.value.for_reading("eval")


@pytest.mark.parametrize("failure", ["safetensors", "torch.save", "oserror"])
def test_a_full_disk_while_checkpointing_is_one_line_and_leaves_no_partial_folder(tmp_path, monkeypatch, failure):
    """A disk that fills while a checkpoint is written: a 20-line safetensors traceback before, and an empty
    .step_2.tmp-* folder left behind; now one error naming the cause and the intact last checkpoint."""
    import mmrl.checkpoint as checkpoint
    from mmrl.cli import _ordinary_errors

    weights = {"w": torch.ones(2)}
    checkpoint.save_checkpoint(tmp_path, 1, trainable=weights, state={"update": 1}, objects={"rng": {}})
    safetensor_error = type("SafetensorError", (Exception,), {})
    full = {
        "safetensors": safetensor_error("Error while serializing: I/O error: No space left on device (os error 28)"),
        "torch.save": RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0: "
                                   "PytorchStreamWriter failed writing file data/0: No space left on device"),
        "oserror": OSError(28, "No space left on device"),
    }[failure]

    def fail(*args, **kwargs):
        raise full

    if failure == "safetensors":
        monkeypatch.setattr(checkpoint, "save_file", fail)
    else:
        monkeypatch.setattr(checkpoint, "torch", SimpleTorch(fail))
    with pytest.raises(checkpoint.CheckpointWriteError) as info:
        checkpoint.save_checkpoint(tmp_path, 2, trainable=weights, state={"update": 2}, objects={"rng": {}})
    assert str(info.value).startswith(f"could not write checkpoint step_2 in {tmp_path}: No space left on device; "
                                      f"the last complete checkpoint, {tmp_path / 'step_1'}, is intact")
    assert isinstance(info.value, _ordinary_errors())  # printed as one line by the CLI
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


class SimpleTorch:
    """``torch`` as the checkpoint module sees it, with ``save`` failing."""

    def __init__(self, save):
        self.save = save

    def __getattr__(self, name):
        return getattr(torch, name)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_checkpoint_files_take_the_umask_not_safetensors_0600(tmp_path, umask):
    """safetensors (0.8) writes its files 0600 and a temporary folder is 0700: a checkpoint (weights, export) reads
    like anything else the user writes, 0644 / 0755 under umask 022, and stays private under 077."""
    from mmrl.checkpoint import current_umask, save_checkpoint
    from mmrl.pipelines.flow.tiny import ensure_built
    from safetensors.torch import save_file

    def export(directory):
        os.makedirs(directory)
        save_file({"w": torch.zeros(2)}, os.path.join(directory, "adapter.safetensors"))
        script = Path(directory) / "run.sh"
        script.write_text("#!/bin/sh\n")
        script.chmod(0o700)

    old = os.umask(umask)
    try:
        assert current_umask() == umask
        final = save_checkpoint(tmp_path, 1, trainable={"w": torch.ones(2)}, state={"update": 1}, objects={},
                                export=export)
        cached = ensure_built("tiny-mode-v1", lambda path: save_file({"w": torch.zeros(1)}, f"{path}/w.safetensors"),
                              tmp_path / "cache")
    finally:
        os.umask(old)
    modes = {str(p.relative_to(final)): p.stat().st_mode & 0o777 for p in [final, *final.rglob("*")]}
    assert modes == {".": 0o777 & ~umask, "trainable.safetensors": 0o666 & ~umask, "state.json": 0o666 & ~umask,
                     "export": 0o777 & ~umask, "export/adapter.safetensors": 0o666 & ~umask,
                     "export/run.sh": 0o777 & ~umask}
    assert cached.stat().st_mode & 0o777 == 0o777 & ~umask  # the model cache: a mkdtemp folder renamed into place
    assert (cached / "w.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


# ------------------------------------------------------------------ setup mistakes: one line, before any update


def test_setup_mistakes_stop_before_the_first_update_with_one_line(tmp_path, tiny_path, capsys):
    """Each is a one-line error (exit 2) before training, and nothing is trained and then lost: a `checkpoints` entry
    that is a file (the first save would fail after the update), a resolution beyond the model's positional
    embedding, an unknown tiny model, an SD3 folder loaded as model.family flux (diffusers only warns, then fails
    inside FluxPipeline's text encoding), and a pipeline folder whose model_index.json names a component that is
    missing (diffusers would build a default tokenizer in place of tokenizer_3 and train on the wrong ids)."""
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("not a folder")
    assert _train(run, tiny_path, "train.steps=1") == 2
    err = capsys.readouterr().err
    assert "checkpoints is not a folder, but the run writes its checkpoints there" in err
    assert "Traceback" not in err and not (run / "metrics.jsonl").exists()

    assert _train(tmp_path / "big", tiny_path, "train.steps=1", "model.resolution=1024") == 2
    err = capsys.readouterr().err
    assert "model.resolution=1024: resolution 1024 is larger than this SD3 model can generate" in err
    assert "Traceback" not in err

    assert _train(tmp_path / "tiny", "tiny:sd2", "train.steps=1") == 2
    err = capsys.readouterr().err
    assert "model.pretrained=tiny:sd2: the tiny random models of model.family=sd3 are tiny:sd3" in err
    assert "Traceback" not in err

    # diffusers warns about the transformer's class first, through a handler that may hold an earlier test's
    # captured stderr (closed, a logging error): quiet it for this call; mmrl's own line is what is checked
    import diffusers

    verbosity = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_error()
    try:
        assert _train(tmp_path / "fam", tiny_path, "train.steps=1", "model.family=flux") == 2
    finally:
        diffusers.utils.logging.set_verbosity(verbosity)
    err = capsys.readouterr().err
    assert "holds a SD3Transformer2DModel, not the FluxTransformer2DModel of FluxPipeline" in err
    assert "Traceback" not in err

    partial = tmp_path / "partial"
    shutil.copytree(tiny_path, partial)
    shutil.rmtree(partial / "tokenizer_3")
    assert _train(tmp_path / "p", str(partial), "train.steps=1") == 2
    err = capsys.readouterr().err
    assert "names components whose folders are missing: tokenizer_3" in err and "Traceback" not in err


def test_each_process_gets_its_own_random_state_back():
    """A checkpoint keeps every process's random state (each was seeded seed + rank): rank r resumes stream r. Written
    by another process count, every process is reseeded from (seed, update, rank) with a note; a one-process
    checkpoint (one state, the format before) restores as it was."""
    import random
    from types import SimpleNamespace

    import numpy as np

    from mmrl.checkpoint import process_rng_states, restore_rng_states, rng_state

    states = []
    for rank in range(2):
        torch.manual_seed(100 + rank), np.random.seed(100 + rank), random.seed(100 + rank)
        states.append(rng_state())
    saved = {"per_process": states}
    draws = {}
    for rank in (1, 0):
        torch.manual_seed(7)
        assert restore_rng_states(saved, SimpleNamespace(process_index=rank, num_processes=2),
                                  reseed=lambda r: 1 / 0) is None
        draws[rank] = (torch.rand(3), np.random.rand(), random.random())
    for rank in range(2):
        torch.manual_seed(100 + rank), np.random.seed(100 + rank), random.seed(100 + rank)
        assert torch.equal(draws[rank][0], torch.rand(3)) and draws[rank][1:] == (np.random.rand(), random.random())
    note = restore_rng_states(saved, SimpleNamespace(process_index=2, num_processes=3), reseed=lambda r: 50 + r)
    assert "random state is of 2 process(es), this run has 3" in note
    first = torch.rand(3)
    torch.manual_seed(52)
    assert torch.equal(first, torch.rand(3))
    one = process_rng_states(None)  # one process: its own state, no list
    expected = torch.rand(3)
    torch.manual_seed(9)
    assert restore_rng_states(one, None, reseed=lambda r: 1 / 0) is None and torch.equal(torch.rand(3), expected)


def test_a_rollback_sets_the_newer_checkpoints_aside(tmp_path, tiny_path, caplog):
    """Resumed from step_1 of 3, the run's step_2 and step_3 move to checkpoints/abandoned/: the next resume=auto
    continues the new line (it found the abandoned step_3 and stopped, "complete"), and keep_last prunes the new
    line's steps, not the old line's (keep_last=1 deleted the fresh step_2 and kept the abandoned step_3)."""
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    assert _train(run, tiny_path, "train.steps=3", "logging.save_every=1", "logging.keep_last=3") == 0
    old_step3 = load_file(str(checkpoints / "step_3" / "trainable.safetensors"))
    with caplog.at_level("WARNING", logger="mmrl.trainer"):
        assert _train(run, tiny_path, "train.steps=2", f"resume={checkpoints / 'step_1'}", "optim.lr=1e-3",
                      "logging.save_every=1", "logging.keep_last=1") == 0
    assert "the newer checkpoints step_2, step_3 moved to" in caplog.text
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_2"]
    assert sorted(p.name for p in (checkpoints / "abandoned").iterdir()) == ["step_2", "step_3"]
    assert _train(run, tiny_path, "train.steps=3", "logging.save_every=1", "logging.keep_last=1") == 0
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_3"]
    new_step3 = load_file(str(checkpoints / "step_3" / "trainable.safetensors"))
    assert any(not torch.equal(new_step3[k], old_step3[k]) for k in old_step3)  # trained on the new line
    assert [m["step"] for m in _metrics(run)] == [1, 2, 3]


def test_a_failure_while_sampling_keeps_the_updates_done(tmp_path, tiny_path, capsys, monkeypatch):
    """Any error raised while an update samples or scores (here the rollout of update 3) leaves the weights of update
    2: they are checkpointed at the data position before update 3, as a data error's are, and resume=auto finishes
    the run as a straight one would (before, only a DataError saved; save_every=0 lost both updates)."""
    from mmrl.pipelines.flow.policy import FlowPolicy

    straight = tmp_path / "straight"
    assert _train(straight, tiny_path, "train.steps=3", "logging.save_every=0") == 0
    run = tmp_path / "run"
    real, calls = FlowPolicy.rollout, [0]

    def failing(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("the reward server went away")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FlowPolicy, "rollout", failing)
    with pytest.raises(RuntimeError, match="reward server"):
        _train(run, tiny_path, "train.steps=3", "logging.save_every=0")
    err = capsys.readouterr().err
    assert "update 3 of 3 stopped by RuntimeError while sampling or scoring, before any weight changed" in err
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_2"]
    monkeypatch.setattr(FlowPolicy, "rollout", real)
    assert _train(run, tiny_path, "train.steps=3", "logging.save_every=0") == 0
    a = load_file(str(straight / "checkpoints" / "step_3" / "trainable.safetensors"))
    b = load_file(str(run / "checkpoints" / "step_3" / "trainable.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
