"""The loop end to end on the tiny SD3 pipeline: CLI outputs, exact resume, faults, NaN handling."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures import TINY_RECIPE, metrics_rows
from mmrl.checkpoint import latest_checkpoint, list_checkpoints
from mmrl.cli import main
from mmrl.config import load_config
from mmrl.pipelines.flow.tiny import build_tiny_sd3
from mmrl.rewards import register_reward

TINY = ["sampling.num_steps=4", "sampling.eval_num_steps=4", "sampling.max_sequence_length=16",
        "data.prompts_per_step=2", "data.group_size=2", "train.batch_size=2", "data.eval_seeds=[0, 1]",
        "data.num_eval_prompts=2", "logging.progress_bar=false", "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_sd3(tmp_path_factory.mktemp("tiny") / "sd3"))


def _run(tmp_path, tiny_path, *extra):
    args = ["train", TINY_RECIPE, f"output_dir={tmp_path}", f"model.pretrained={tiny_path}", *TINY, *extra]
    assert main(args) == 0
    return [json.loads(line) for line in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]


def test_cli_train_writes_every_output(tmp_path, tiny_path):
    metrics = _run(tmp_path, tiny_path, "train.steps=2", "logging.eval_every=2", "logging.save_every=1",
                   "logging.keep_last=1", "logging.tensorboard=true")
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("reward/mean", "reward/brightness", "loss", "clipfrac", "kl", "grad_norm", "time/rollout",
                "time/reward", "time/train", "samples/trained", "samples/nan_reward"):
        assert key in metrics[0] and math.isfinite(metrics[0][key]), key
    assert (tmp_path / "config.yaml").is_file()
    assert load_config(tmp_path / "config.yaml").train.steps == 2  # the saved config reloads
    assert (tmp_path / "samples" / "step_0.png").is_file() and (tmp_path / "samples" / "step_2.png").is_file()
    from PIL import Image

    assert Image.open(tmp_path / "samples" / "step_2.png").size == (2 * 32, 2 * 32)
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_2"]  # keep_last=1
    ckpt = tmp_path / "checkpoints" / "step_2"
    assert (ckpt / "export" / "pytorch_lora_weights.safetensors").is_file()
    assert json.loads((ckpt / "state.json").read_text())["update"] == 2
    assert list((tmp_path / "tensorboard").glob("events.*"))
    # mmrl sample reads the run back
    assert main(["sample", str(tmp_path), "--prompt", "a cat", "--seeds", "0", "1", "--out",
                 str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "grid.png").is_file() and (tmp_path / "out" / "p0_s1.png").is_file()


def test_two_steps_resume_two_steps_equals_four(tmp_path, tiny_path):
    extra = ["logging.eval_every=0", "logging.save_every=2", "optim.lr=1e-2", "algorithm.clip_low=0.01",
             "train.inner_epochs=2", "optim.ema=true"]
    straight = _run(tmp_path / "a", tiny_path, "train.steps=4", *extra)
    _run(tmp_path / "b", tiny_path, "train.steps=2", *extra)
    resumed = _run(tmp_path / "b", tiny_path, "train.steps=4", "resume=auto", *extra)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    a = load_file(str(tmp_path / "a" / "checkpoints" / "step_4" / "trainable.safetensors"))
    b = load_file(str(tmp_path / "b" / "checkpoints" / "step_4" / "trainable.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    for ma, mb in zip(straight, resumed):
        assert ma["reward/mean"] == mb["reward/mean"] and ma["loss"] == mb["loss"]
    first = load_file(str(tmp_path / "a" / "checkpoints" / "step_2" / "trainable.safetensors"))
    assert any(not torch.equal(first[k], a[k]) for k in a)  # training moved the weights


def test_resume_skips_checkpoint_killed_while_writing(tmp_path, tiny_path):
    _run(tmp_path, tiny_path, "train.steps=2", "logging.eval_every=0", "logging.save_every=1", "logging.keep_last=3")
    ckpts = tmp_path / "checkpoints"
    # a kill during the next save: a half-written temporary folder and a step folder without its marker
    shutil.copytree(ckpts / "step_2", ckpts / ".step_3.tmp-999")
    shutil.copytree(ckpts / "step_2", ckpts / "step_3")
    (ckpts / "step_3" / "state.json").unlink()
    assert latest_checkpoint(ckpts).name == "step_2"
    metrics = _run(tmp_path, tiny_path, "train.steps=3", "resume=auto", "logging.eval_every=0",
                   "logging.save_every=1", "logging.keep_last=3")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert latest_checkpoint(ckpts).name == "step_3"
    assert not list(ckpts.glob(".step_*"))


@register_reward("test_half_nan")
class HalfNaN:
    """Test reward: brightness, but NaN for every second sample (a reward that cannot judge them)."""

    name = "test_half_nan"
    needs_prompts = False

    def __init__(self):
        self.last_info = {}

    def __call__(self, images, prompts=None, metadata=None):
        score = images.float().mean(dim=(1, 2, 3))
        score[1::2] = float("nan")
        self.last_info = {"num_nan": len(score[1::2]), "reasons": {"test": len(score[1::2])},
                          "nan_samples": {i: "the test cannot judge odd samples" for i in range(1, len(score), 2)}}
        return {self.name: score}


def test_nan_rewards_are_counted_and_excluded(tmp_path, tiny_path, capsys):
    metrics = _run(tmp_path, tiny_path, "train.steps=1", "logging.eval_every=0", "rewards={test_half_nan: 1.0}")
    # the reason is printed once (not per batch): what to fix in the data or the reward
    out = capsys.readouterr()
    said = [line for line in (out.out + out.err).splitlines() if "the test cannot judge odd samples" in line]
    assert len(said) == 1 and said[0].startswith("mmrl: warning: reward test_half_nan: NaN for 2 sample(s)"), said
    assert metrics[0]["samples/nan_reward"] == 2.0
    assert math.isfinite(metrics[0]["reward/mean"]) and math.isfinite(metrics[0]["loss"])
    # NaN samples get advantage 0; the other two (one per group) have no group partner either
    assert metrics[0]["samples/zero_advantage"] == 4.0
    # every advantage is 0, yet the loop trained on all four samples: counted as trained, none informative
    assert metrics[0]["samples/trained"] == 4.0 and metrics[0]["samples/informative"] == 0.0


def test_nonfinite_loss_is_skipped_and_logged(tmp_path, tiny_path, monkeypatch):
    from mmrl.pipelines.flow.policy import FlowPolicy

    original = FlowPolicy.logprobs
    calls = {"n": 0}

    def flaky(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 1:
            out.logps = out.logps * float("nan")
        return out

    monkeypatch.setattr(FlowPolicy, "logprobs", flaky)
    metrics = _run(tmp_path, tiny_path, "train.steps=2", "logging.eval_every=0", "train.gradient_accumulation_steps=2")
    assert metrics[0]["train/skipped_nonfinite_loss"] == 1.0
    assert metrics[1]["train/skipped_nonfinite_loss"] == 0.0
    saved = load_file(str(tmp_path / "checkpoints" / "step_2" / "trainable.safetensors"))
    assert all(torch.isfinite(v).all() for v in saved.values())


def test_bad_inputs_give_one_clear_error(tmp_path, tiny_path, capsys):
    assert main(["train", TINY_RECIPE, f"output_dir={tmp_path}", "train.stpes=3"]) == 2
    assert "did you mean 'train.steps'" in capsys.readouterr().err
    assert main(["train", TINY_RECIPE, f"output_dir={tmp_path}", "rewards={pickscroe: 1.0}"]) == 2
    assert "pickscore" in capsys.readouterr().err
    assert main(["train", TINY_RECIPE, f"output_dir={tmp_path}", f"data.prompts={tmp_path}/missing.txt"]) == 2
    assert "prompt file not found" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert main(["train", TINY_RECIPE, f"output_dir={tmp_path}", f"data.prompts={empty}", *TINY]) == 2
    assert "empty" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a cat"}\n{"prompt": 3}\n')
    assert main(["train", TINY_RECIPE, f"output_dir={tmp_path}", f"data.prompts={bad}", *TINY]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert main(["train", TINY_RECIPE, f"output_dir={tmp_path}", f"model.pretrained={tmp_path}", *TINY]) == 2
    assert "model_index.json" in capsys.readouterr().err


#: Shipped configs of the other commands (their own schemas), by file name.
OTHER_COMMANDS = {"pretrain_sd3.yaml": "pretrain", "pretrain_sd3_mislabeled.yaml": "pretrain",
                  "pretrain_sd3_faded.yaml": "pretrain",
                  "sft_qwen_vl.yaml": "sft", "sft_qwen_vl_grounding.yaml": "sft",
                  "sft_qwen_vl_grounding_crop.yaml": "sft", "sft_qwen_vl_grounding_loose.yaml": "sft",
                  "sft_qwen_vl_timeline.yaml": "sft", "sft_qwen_vl_timeline_loose.yaml": "sft"}


@pytest.mark.parametrize("path", sorted(str(p) for p in Path(__file__).parents[1].glob("configs/**/*.yaml")))
def test_every_shipped_config_validates(path):
    if Path(path).parent.name == "accelerate":  # accelerate's own launch configs
        from accelerate.commands.config.config_args import load_config_from_file

        launch = load_config_from_file(path)
        expected = {"one_gpu.yaml": ("NO", 1, 1), "ddp_one_node.yaml": ("MULTI_GPU", 8, 1),
                    "ddp_multi_node.yaml": ("MULTI_GPU", 16, 2), "fsdp2.yaml": ("FSDP", 8, 1),
                    "fsdp2_offload.yaml": ("FSDP", 8, 1), "deepspeed_zero2.yaml": ("DEEPSPEED", 8, 1),
                    "deepspeed_zero3.yaml": ("DEEPSPEED", 8, 1)}[Path(path).name]
        assert (str(launch.distributed_type).split(".")[-1], launch.num_processes, launch.num_machines) == expected
        assert launch.mixed_precision == "no" and not launch.use_cpu  # mmrl's train.mixed_precision decides
        if Path(path).name.startswith("fsdp2"):  # the version mmrl supports, blocks as shard units, whole checkpoints
            fsdp = launch.fsdp_config
            assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
            assert fsdp["fsdp_state_dict_type"] == "FULL_STATE_DICT"
            assert fsdp["fsdp_offload_params"] is Path(path).name.endswith("_offload.yaml")
            other = {k: v for k, v in fsdp.items() if k != "fsdp_offload_params"}
            twin = load_config_from_file(str(Path(path).with_name("fsdp2.yaml"))).fsdp_config
            assert other == {k: v for k, v in twin.items() if k != "fsdp_offload_params"}  # offload is the only change
        if Path(path).name.startswith("deepspeed"):  # the stage named; mmrl fills accumulation and clipping itself
            ds = launch.deepspeed_config
            assert ds["zero_stage"] == int(Path(path).stem[-1]) and ds["zero3_init_flag"] is False
            assert "gradient_accumulation_steps" not in ds and "gradient_clipping" not in ds
        return
    command = OTHER_COMMANDS.get(Path(path).name, "train")
    if command == "pretrain":
        from mmrl.pretrain import load_pretrain_config

        config = load_pretrain_config(path)
    elif command == "sft":
        from mmrl.sft import load_sft_config

        config = load_sft_config(path, check_files=False)
    else:
        config = load_config(path, check_files=False)
    assert config.train.steps >= 1


def test_slurm_example_is_valid_bash_naming_the_multi_node_config():
    script = Path(__file__).parents[1] / "configs" / "accelerate" / "slurm_ddp.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "configs/accelerate/ddp_multi_node.yaml" in text and "--machine_rank \\$SLURM_NODEID" in text
    assert "--config_file $ACCELERATE_CONFIG" in text  # another engine's file through the environment


@pytest.mark.parametrize("gpus,expected", [("4", "--num_processes 8"), (None, "--num_processes 16")])
def test_slurm_example_counts_the_gpus_slurm_gave_each_node(tmp_path, gpus, expected):
    """With stand-ins for scontrol, srun and accelerate: `sbatch --gpus-per-node=4 --nodes 2` launches 8 processes
    (the script counted 8 per node whatever SLURM gave, and the extra ranks failed on device indices)."""
    script = Path(__file__).parents[1] / "configs" / "accelerate" / "slurm_ddp.sh"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {"scontrol": 'printf "node-a\\nnode-b\\n"', "srun": 'exec "$@"',
             "accelerate": f'echo "$@" > {tmp_path / "launch.txt"}'}
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPUS_PER_NODE"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_NODELIST="node-[a-b]", SLURM_NNODES="2", SLURM_NODEID="1")
    if gpus:
        env["SLURM_GPUS_ON_NODE"] = gpus
    result = subprocess.run(["bash", str(script), "recipe.yaml"], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    launched = (tmp_path / "launch.txt").read_text()
    assert expected in launched and "--num_machines 2" in launched and "--machine_rank 1" in launched
    assert "--main_process_ip node-a" in launched and launched.strip().endswith("train recipe.yaml")


def test_two_process_gloo_run_keeps_replicas_in_sync(tmp_path, tiny_path):
    """torchrun with 2 CPU processes: gradients all-reduced, both replicas end with identical weights."""
    script = Path(__file__).with_name("dist_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
           str(script), str(tmp_path), tiny_path, *TINY]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    w0 = load_file(str(tmp_path / "rank0.safetensors"))
    w1 = load_file(str(tmp_path / "rank1.safetensors"))
    for key in w0:
        assert torch.equal(w0[key], w1[key]), key
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert metrics[0]["samples/trained"] == 8  # 2 processes x 4 samples, all trained on
    assert metrics[0]["samples/informative"] + metrics[0]["samples/zero_advantage"] == 8


def test_embedded_default_is_the_shipped_shapeworld_recipe(tmp_path):
    repo = Path(__file__).parents[1]
    recipe = repo / "configs/shapes/flow_grpo_faded.yaml"
    assert recipe.read_text() == (repo / "mmrl/default.yaml").read_text()
    config = load_config(None)
    assert config.model.pretrained == "shapeworld:sd3_faded" and config.rewards == {"shapeworld_partial": 1.0}
    assert config.data.prompts == "shapeworld:train:single_object+colors"
    assert config.eval.benchmarks == ["shapeworld@test:single_object+colors"] and config.eval.every == 20
    # `mmrl train` with no config file runs it (shortened here: one small update and the benchmark on 2 prompts)
    os.environ["MMRL_CACHE"] = str(tmp_path / "cache")
    try:
        assert main(["train", f"output_dir={tmp_path / 'run'}", "train.steps=1", "data.prompts_per_step=1",
                     "data.group_size=4", "train.batch_size=4", "train.gradient_accumulation_steps=1",
                     "sampling.num_steps=3", "logging.eval_every=0", "logging.progress_bar=false",
                     "eval.every=1", "eval.limit=2", "eval.options={images_per_prompt: 1, num_steps: 2}"]) == 0
    finally:
        del os.environ["MMRL_CACHE"]
    assert (tmp_path / "run" / "checkpoints" / "step_1" / "state.json").is_file()
    assert (tmp_path / "run" / "report.html").is_file()
    rows = metrics_rows(tmp_path / "run")
    key = "eval/shapeworld@test:single_object+colors/overall"
    assert [r["step"] for r in rows if key in r] == [0, 1] and all(0 <= r[key] <= 1 for r in rows if key in r)


def test_existing_run_is_never_overwritten(tmp_path, tiny_path, capsys):
    _run(tmp_path, tiny_path, "train.steps=1", "logging.eval_every=0")
    before = (tmp_path / "metrics.jsonl").read_text()
    args = ["train", TINY_RECIPE, f"output_dir={tmp_path}", f"model.pretrained={tiny_path}", *TINY, "train.steps=1"]
    assert main([*args, "resume=null"]) == 2
    assert "resume=auto" in capsys.readouterr().err
    assert main(args) == 0  # the default resume=auto finds the run complete
    assert "nothing to do" in capsys.readouterr().out
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_ema_every_minibatch_is_flow_grpos_call_pattern(tmp_path, tiny_path, monkeypatch):
    """optim.ema_every_minibatch: Flow-GRPO's train_sd3.py calls ema.step(params, global_step) after every training
    batch, global_step the optimizer steps taken so far: a window of 2 minibatches calls it with the last step's count
    on unchanged weights, then with the new count after the step. The shadow is the plain lerp over those calls."""
    from mmrl.ema import EMA

    calls, instances = [], []
    original = EMA.update

    def update(self, params, optimizer_step=None):
        if not instances:
            instances.append((self, {k: v.detach().clone() for k, v in self.shadow.items()}))
        calls.append((optimizer_step, {k: p.detach().clone() for k, p in params.items()}))
        return original(self, params, optimizer_step)

    monkeypatch.setattr(EMA, "update", update)
    _run(tmp_path, tiny_path, "train.steps=2", "logging.eval_every=0", "train.inner_epochs=2",
         "train.gradient_accumulation_steps=2", "optim.lr=1e-2", "optim.ema=true", "optim.ema_every_minibatch=true",
         "optim.ema_decay=0.9")
    steps = [s for s, _ in calls]
    assert steps == [0, 1, 1, 2, 2, 3, 3, 4]  # 2 updates x 2 inner epochs, one optimizer step of 2 minibatches each
    for k in range(1, 4):  # the repeated call sees the weights of the step it repeats
        first, again = calls[2 * k - 1][1], calls[2 * k][1]
        assert all(torch.equal(first[n], again[n]) for n in first)
    ema, start = instances[0]
    shadow = {k: v.clone() for k, v in start.items()}
    for _, params in calls:
        for k in shadow:
            shadow[k] += 0.1 * (params[k] - shadow[k])
    assert ema.num_updates == 8
    for k in shadow:
        torch.testing.assert_close(ema.shadow[k], shadow[k], rtol=1e-6, atol=1e-7)
    # the default: one call per optimizer step
    calls.clear()
    _run(tmp_path / "plain", tiny_path, "train.steps=1", "logging.eval_every=0", "train.inner_epochs=2",
         "train.gradient_accumulation_steps=2", "optim.ema=true")
    assert [s for s, _ in calls] == [1, 2]
    with pytest.raises(Exception, match="optim.ema_every_minibatch is how the EMA is updated: set optim.ema: true"):
        load_config(TINY_RECIPE, ["optim.ema_every_minibatch=true"])


def test_allow_tf32_sets_the_matmul_flag(tmp_path, tiny_path, monkeypatch):
    """train.allow_tf32: the process-wide flag Flow-GRPO and DanceGRPO set (no effect on the CPU numbers); off
    leaves PyTorch's default."""
    from mmrl.build import build_trainer

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    args = [f"output_dir={tmp_path / 'a'}", f"model.pretrained={tiny_path}", *TINY, "train.steps=1"]
    build_trainer(load_config(TINY_RECIPE, args))
    assert torch.backends.cuda.matmul.allow_tf32 is False
    build_trainer(load_config(TINY_RECIPE, [*args[1:], f"output_dir={tmp_path / 'b'}", "train.allow_tf32=true"]))
    assert torch.backends.cuda.matmul.allow_tf32 is True


def test_cfg_detach_uncond_reaches_the_policys_training_forward(tmp_path, tiny_path):
    """sampling.cfg_detach_uncond (default true) is what the built policy's training forward uses; the gradients of
    the two settings are checked against the branches' own in test_flow_policy."""
    from mmrl.build import build_trainer

    args = [f"model.pretrained={tiny_path}", *TINY, "train.steps=1"]
    assert build_trainer(load_config(TINY_RECIPE, [f"output_dir={tmp_path / 'a'}", *args])).policy.cfg_detach_uncond
    both = build_trainer(load_config(TINY_RECIPE, [f"output_dir={tmp_path / 'b'}", *args,
                                                   "sampling.cfg_detach_uncond=false"])).policy
    assert both.cfg_detach_uncond is False and both.guidance_scale > 1


def test_a_second_train_on_a_busy_output_dir_stops_with_one_line(tmp_path, tiny_path, capsys):
    """Another mmrl train holds output_dir's lock (an flock, here taken by this test): the run stops with exit 2 and
    one line, writing nothing; once the lock is released the same command trains."""
    import fcntl

    run = tmp_path / "run"
    run.mkdir()
    args = ["train", str(TINY_RECIPE), f"output_dir={run}", f"model.pretrained={tiny_path}", *TINY, "train.steps=1",
            "logging.progress_bar=false", "logging.tensorboard=false", "logging.eval_every=0"]
    with open(run / ".mmrl-train.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("12345\n")
        held.flush()
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "is being trained by another mmrl train (process 12345)" in err
        assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    assert main(args) == 0  # the holder is gone
    assert [m["step"] for m in metrics_rows(run)] == [1]


def test_a_filesystem_without_flock_trains_without_the_lock(tmp_path, tiny_path, capsys, monkeypatch):
    """Only BlockingIOError (another holder) means busy: a filesystem that refuses flock (ENOLCK, Lustre without
    -o flock) is warned about and the run trains."""
    import errno
    import fcntl

    def no_locks(handle, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    run = tmp_path / "run"
    assert main(["train", str(TINY_RECIPE), f"output_dir={run}", f"model.pretrained={tiny_path}", *TINY,
                 "train.steps=1", "logging.progress_bar=false", "logging.tensorboard=false",
                 "logging.eval_every=0"]) == 0
    captured = capsys.readouterr()
    assert "mmrl: warning: could not lock" in captured.out + captured.err
    assert [m["step"] for m in metrics_rows(run)] == [1]
