"""Two gloo processes (torchrun) stay in step where one process's data or statistics could differ: a bad sample
skipped on one rank only, adaptive noise levels computed from the whole batch and resumed on every rank, and a
sharded (FSDP2) run's checkpoint and resume, and a DeepSpeed ZeRO-2 run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures import write_image, write_jsonl
from mmrl.pipelines.flow.tiny import build_tiny_sd3
from mmrl.pipelines.vlm.tiny import ensure_tiny_vlm

REPO = Path(__file__).parents[1]
WORKER = Path(__file__).with_name("dist_config_worker.py")
QUIET = ["logging.progress_bar=false", "logging.tensorboard=false", "logging.eval_every=0"]


def torchrun(tmp_path: Path, port: int, *args: str, processes: int = 2, expect_failure: bool = False,
             stage: int = 2) -> str:
    """``args``: [``--fsdp`` | ``--deepspeed``] CONFIG OVERRIDE...; ``--deepspeed`` launches with ``accelerate launch
    --config_file configs/accelerate/deepspeed_zero<stage>.yaml``. Returns stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    flags = [a for a in args[:1] if a in ("--fsdp", "--deepspeed")]
    config, *overrides = args[len(flags):]
    if flags == ["--deepspeed"]:
        launcher = ["-m", "accelerate.commands.launch", "--config_file",
                    str(REPO / "configs" / "accelerate" / f"deepspeed_zero{stage}.yaml"),
                    "--num_processes", str(processes), "--main_process_port", str(port)]
    else:
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", str(port)]
    cmd = [sys.executable, *launcher, str(WORKER), *flags, str(tmp_path), config, *QUIET, *overrides]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if expect_failure:
        assert result.returncode != 0, "the launch was expected to fail"
    else:
        assert result.returncode == 0, result.stderr[-4000:]
    return result.stderr


def replicas(tmp_path: Path):
    w0, w1 = load_file(str(tmp_path / "rank0.safetensors")), load_file(str(tmp_path / "rank1.safetensors"))
    s0, s1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    return w0, w1, s0, s1


def test_a_bad_sample_on_one_rank_is_replaced_and_the_run_completes(tmp_path, monkeypatch):
    """Item 1 of 4 is too long for generation.max_prompt_length: with shuffle off it lands on rank 1 in the first
    update. Rank 1 draws a replacement, rank 0 draws (and drops) one too, so both train on one group, stay in
    the same collectives and end at the same data position (before, the ranks desynchronised)."""
    monkeypatch.setenv("MMRL_CACHE", str(tmp_path / "cache"))
    ensure_tiny_vlm("qwen2_5_vl")  # built once here, not by both ranks at once
    media = tmp_path / "media"
    media.mkdir()
    for i, colour in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]):
        write_image(media / f"{i}.png", 56, 56, colour)
    questions = ["Where is the box?", "Where is the box? " + "Describe every pixel in detail. " * 40,
                 "Where is the red box?", "Where is the blue box?"]
    dataset = write_jsonl(tmp_path / "data.jsonl", [
        {"id": f"s{i}", "image": f"media/{i}.png", "question": q, "solution": "[0, 0, 10, 10]"}
        for i, q in enumerate(questions)])
    run = tmp_path / "out"
    torchrun(run, 29541, str(REPO / "configs/tiny/vlm_grounding.yaml"), f"data.dataset={dataset}",
             "data.skip_bad_samples=true", "data.shuffle=false", "generation.max_prompt_length=160",
             "generation.max_new_tokens=8", "data.prompts_per_step=1", "data.group_size=2", "train.batch_size=2",
             "train.steps=2", "rewards={think_answer_format: 1.0}", "logging.save_every=0")
    w0, w1, s0, s1 = replicas(run)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert s1["skipped"] == {"prompt_too_long": 2} and s0["skipped"] == {}  # item 1 again in the second pass
    assert s0["data"] == s1["data"]  # the same data position on both ranks
    metrics = [json.loads(line) for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    # counted over every rank (rank 0, which logs, skipped nothing), cumulative over the run
    assert [m["samples/skipped_prompt_too_long"] for m in metrics] == [1.0, 2.0]
    assert metrics[0]["samples/trained"] == 4  # 2 ranks x 1 group x 2, all trained on
    assert metrics[0]["samples/informative"] + metrics[0]["samples/zero_advantage"] == 4


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    return str(build_tiny_sd3(tmp_path_factory.mktemp("tiny") / "sd3"))


def test_adaptive_noise_levels_agree_on_every_rank_and_resume(tmp_path, tiny_sd3):
    """Adaptive noise levels come from the gathered per-step gains, so both ranks compute the same levels; the
    checkpoint (rank 0's) then resumes every rank exactly: 1 + resume + 1 updates == 2 updates. With LoRA dropout,
    which draws from each rank's own random stream: the checkpoint keeps every rank's (it kept rank 0's and gave it
    to both, so the resumed update's dropout masks differed on rank 1: weights 0.056 apart after 4 updates)."""
    common = [f"model.pretrained={tiny_sd3}", "sampling.num_steps=4", "sampling.eval_num_steps=4",
              "sampling.max_sequence_length=16", "data.prompts_per_step=1", "data.group_size=4", "train.batch_size=4",
              "train.gradient_accumulation_steps=1", "algorithm.variants=[step_gain, {name: adaptive_noise, rate: 0.5}]", "sampling.window_size=3",
              "train.sample_batch_size=4", "optim.lr=1e-2", "model.lora_dropout=0.3",
              "algorithm.clip_low=0.2", "logging.save_every=1"]
    config = str(REPO / "configs/tiny/dense_grpo.yaml")
    torchrun(tmp_path / "straight", 29543, config, *common, "train.steps=2")
    torchrun(tmp_path / "resumed", 29545, config, *common, "train.steps=1")
    torchrun(tmp_path / "resumed", 29547, config, *common, "train.steps=2", "resume=auto")
    w0, w1, s0, s1 = replicas(tmp_path / "straight")
    assert s0["noise_levels"] == s1["noise_levels"]
    assert s0["noise_levels"] != [0.7] * 4 and len(set(s0["noise_levels"][:3])) > 1  # the levels did adapt
    r0, r1, t0, t1 = replicas(tmp_path / "resumed")
    assert t0["noise_levels"] == t1["noise_levels"] == s0["noise_levels"]
    for key in w0:
        assert torch.equal(w0[key], w1[key]) and torch.equal(w0[key], r0[key]) and torch.equal(r0[key], r1[key]), key


def resume_overrides(tiny_sd3) -> list[str]:
    return [f"model.pretrained={tiny_sd3}", "sampling.num_steps=4", "sampling.eval_num_steps=4",
            "sampling.max_sequence_length=16", "data.prompts_per_step=1", "data.group_size=4", "train.batch_size=2",
            "train.gradient_accumulation_steps=2", "optim.lr=1e-2", "algorithm.clip_low=0.2", "algorithm.beta=0.04",
            "logging.save_every=1"]


def straight_and_resumed(tmp_path: Path, tiny_sd3, engine: str, ports: tuple[int, int, int], *extra: str,
                         stage: int = 2):
    """2 straight updates, and 1 + resume + 1, of the tiny flow recipe under ``engine`` (``--fsdp`` /
    ``--deepspeed``) on 2 processes (gradient accumulation 2, a checkpoint every update). Checks that all four
    replicas end on the same weights and that the straight run's last checkpoint holds them whole; returns
    (that checkpoint, its trainable tensors)."""
    common = [*resume_overrides(tiny_sd3), *extra]
    config = str(REPO / "configs/tiny/flow_grpo.yaml")
    torchrun(tmp_path / "straight", ports[0], engine, config, *common, "train.steps=2", stage=stage)
    torchrun(tmp_path / "resumed", ports[1], engine, config, *common, "train.steps=1", stage=stage)
    torchrun(tmp_path / "resumed", ports[2], engine, config, *common, "train.steps=2", "resume=auto", stage=stage)
    w0, w1, _, _ = replicas(tmp_path / "straight")
    r0, r1, _, _ = replicas(tmp_path / "resumed")
    checkpoint = tmp_path / "straight" / "run" / "checkpoints" / "step_2"
    saved = load_file(str(checkpoint / "trainable.safetensors"))
    assert set(saved) == set(w0) and len(saved) > 0
    first = load_file(str(tmp_path / "resumed" / "run" / "checkpoints" / "step_1" / "trainable.safetensors"))
    assert any(not torch.equal(first[key], w0[key]) for key in w0)  # the resumed update moved the weights
    for key in w0:
        assert torch.equal(w0[key], w1[key]) and torch.equal(w0[key], r0[key]) and torch.equal(r0[key], r1[key]), key
        assert torch.equal(saved[key], w0[key]), key  # whole tensors, not a shard
    return checkpoint, saved


def test_a_sharded_run_checkpoints_whole_weights_and_resumes_exactly(tmp_path, tiny_sd3):
    """FSDP2 (``configs/accelerate/fsdp2.yaml``) on 2 processes: the checkpoint holds the WHOLE trainable tensors
    and the whole optimizer state (gathered, not one process's shards), the main process's evaluation grid runs on
    the gathered weights, and 1 + resume + 1 updates give exactly the weights of 2 straight updates."""
    checkpoint, saved = straight_and_resumed(tmp_path, tiny_sd3, "--fsdp", (29549, 29551, 29553),
                                             "logging.eval_every=1", "data.num_eval_prompts=1", "data.eval_seeds=[0]")
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=False)
    for name, state in optimizer["state"].items():  # keyed by parameter name, whole moments
        assert tuple(state["exp_avg"].shape) == tuple(saved[name].shape), name
    assert (tmp_path / "straight" / "run" / "samples" / "step_2.png").is_file()
    assert (checkpoint / "export").is_dir()


@pytest.mark.parametrize("stage", [3])  # ZeRO-2's checkpoint is the same code without the gather (and 65 s more)
def test_a_deepspeed_run_checkpoints_its_partitions_and_resumes_exactly(tmp_path, tiny_sd3, stage):
    """DeepSpeed ZeRO-3 (``configs/accelerate/deepspeed_zero3.yaml``) on 2 processes, gradient accumulation 2: the
    checkpoint holds the whole trainable tensors (gathered from the partitions) and the engine's two optimizer
    partitions, 1 + resume + 1 updates give exactly the weights of 2 straight updates, and a resume on another
    process count is refused by name."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    ports = [29561 + 10 * (stage - 2) + 2 * k for k in range(4)]
    checkpoint, _ = straight_and_resumed(tmp_path, tiny_sd3, "--deepspeed", tuple(ports[:3]), stage=stage)
    partitions = sorted(p.name for p in (checkpoint / "deepspeed").glob("zero_pp_rank_*_optim_states.pt"))
    assert partitions == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert not (checkpoint / "optimizer.pt").exists()
    assert json.loads((checkpoint / "state.json").read_text())["deepspeed_processes"] == 2
    assert not list(checkpoint.parent.glob(".step_*")), "a staging folder was left behind"
    err = torchrun(tmp_path / "resumed", ports[3], "--deepspeed", str(REPO / "configs/tiny/flow_grpo.yaml"),
                   *resume_overrides(tiny_sd3), "train.steps=3", "resume=auto", processes=1, expect_failure=True,
                   stage=stage)
    assert "written by 2 DeepSpeed process(es)" in err and "--num_processes 2" in err, err[-2000:]


def test_a_nonfinite_loss_under_zero3_contributes_exactly_nothing(tmp_path, tiny_sd3):
    """ZeRO-3's weights are empty partitions outside a forward, so a skipped (NaN) micro-step's zero contribution
    goes through that forward's output instead of the weights: every process still runs the same backward, and the
    update is the one made when that micro-step's loss is a plain 0."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    worker = Path(__file__).with_name("nonfinite_worker.py")
    results = {}
    for port, mode in ((29581, "nan"), (29583, "zero")):
        out = tmp_path / mode
        out.mkdir()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MODE": mode}
        proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                               str(REPO / "configs" / "accelerate" / "deepspeed_zero3.yaml"), "--num_processes", "2",
                               "--main_process_port", str(port), str(worker), str(out), str(tiny_sd3)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[mode] = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    for mode, runs in results.items():
        assert all(r["zero3"] for r in runs)
        assert torch.equal(runs[0]["weights"], runs[1]["weights"]) and torch.isfinite(runs[0]["weights"]).all()
        assert all(r["metrics"]["train/skipped_nonfinite_loss"] == (mode == "nan") for r in runs), mode
    nan, zero = results["nan"][0], results["zero"][0]
    assert nan["metrics"]["grad_norm"] > 0
    assert abs(nan["metrics"]["grad_norm"] - zero["metrics"]["grad_norm"]) <= 1e-6 * zero["metrics"]["grad_norm"]
    assert float((nan["weights"] - zero["weights"]).norm() / zero["weights"].norm()) < 1e-6
