"""Layout invariance over processes: one global batch of 2 prompts x 4 samples gives the same update on one
process as split 4 + 4 over two gloo processes (torchrun, CPU, fp32).

The worker (layout_process_worker.py) samples the same global rollout on every process and keeps its share of
the rows, then runs the trainer's own ``_score``, ``_advantages`` and ``_train_on`` (2 inner epochs, so the second
has ratio != 1; beta > 0, so the KL term is in the loss). Two splits: ``contiguous`` (one whole group per process,
a real run's layout) and ``interleaved`` (two samples of each group per process: no group's mean or std can be
computed from one process's rewards). What must agree, to 1e-5 relative:

* the advantages: group statistics are computed on the rewards gathered from every process;
* the loss, the gradient norm and the updated weights (the DDP gradient average of the per-process losses must
  be the one-process gradient: ``grpo`` averages per-sample means over equally sized halves, ``dapo`` divides
  by the GLOBAL active-action count; the VLM halves have 20 + 28 or 14 + 34 actions, so a local count would show);
* the KL: the action-weighted mean of the two processes' KL is the one-process KL;
* the two replicas, bit for bit.

``bnpo`` is TRL's per-process action mean: not invariant to the process count, by definition (documented below).

FSDP2 (``configs/accelerate/fsdp2.yaml``): the same comparison with the two processes SHARDING the model instead of
replicating it (each keeps half of every parameter and its optimizer state; gradients are reduce-scattered), for
both families with LoRA and with full fine-tuning: the sharded update is the one-process update.

DeepSpeed ZeRO-2 and ZeRO-3 (``configs/accelerate/deepspeed_zero{2,3}.yaml``, launched by ``accelerate launch``
with that file as a user does, on DeepSpeed's CPU accelerator): the engine partitions the gradients and the AdamW
state (ZeRO-3: the weights too), takes each backward with the loop's accumulation boundary and steps; the update is
the one-process update.

The entropy options (``algorithm.top_entropy_quantile``, ``algorithm.entropy_coef``): the quantile threshold is taken
over every process's tokens and the bonus averages over the whole optimizer step's tokens, so the update is the
one-process update too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmrl.pipelines.flow.tiny import build_tiny_sd3

WORKER = Path(__file__).with_name("layout_process_worker.py")
RTOL = 1e-5
BETA = 0.04  # the worker's algorithm.beta
GROUP = 4  # the worker's group size: global rows 4g .. 4g+3 are group g
# flow masks are all ones, so flow dapo is flow grpo up to a constant: the VLM cases exercise dapo's global count
INVARIANT = [("flow", "grpo", "contiguous"), ("vlm", "grpo", "contiguous"),
             ("vlm", "dapo", "contiguous"), ("flow", "grpo", "interleaved"), ("vlm", "dapo", "interleaved")]
TWO_PROCESS_RUNS = [*INVARIANT, ("vlm", "bnpo", "contiguous")]
# FSDP2 cases: (family, aggregation, full fine-tuning); vlm dapo exercises the global action count under sharding
SHARDED = [("flow", "grpo", False), ("flow", "grpo", True), ("vlm", "dapo", False), ("vlm", "dapo", True)]
# FSDP2 with the shards, gradients and optimizer state offloaded to the CPU (configs/accelerate/fsdp2_offload.yaml)
OFFLOADED = [("flow", "grpo", True), ("vlm", "dapo", True)]
# DeepSpeed cases (family, aggregation, full fine-tuning, ZeRO stage): flow LoRA with the steps chunked (several
# backwards per optimizer step), VLM full fine-tuning with the vision tower (ZeRO-2: encoded outside the engine's
# forward; ZeRO-3: through it). ZeRO-2 flow LoRA is the ZeRO-3 case's boundary logic on whole weights (3.4e-6 by
# hand), left out for the CI budget
DEEPSPEED = [("vlm", "dapo", True, 2), ("flow", "grpo", False, 3), ("vlm", "dapo", True, 3)]
ACCELERATE_CONFIGS = Path(__file__).parents[1] / "configs" / "accelerate"
#: the entropy options' case: interleaved, so each process's tokens alone would give another quantile
ENTROPY = ("vlm", "dapo", "interleaved")
BASE_PORT = 29611  # + the index in TWO_PROCESS_RUNS: every torchrun launch of the module has its own port


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(family, aggregation, split)``: (one-process result, [rank 0, rank 1] results); every launch once
    per module (the one-process run does not depend on the split)."""
    base = tmp_path_factory.mktemp("layout-processes")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "MMRL_CACHE": str(tmp_path_factory.getbasetemp() / "mmrl-cache")}  # tiny VLM built once, shared
    cache: dict[tuple, list[dict]] = {}
    sd3: list[str] = []

    def launch(family: str, aggregation: str, split: str, processes: int, full: bool = False,
               fsdp: bool = False, offload: bool = False, deepspeed: int | None = None,
               entropy: bool = False) -> list[dict]:
        key = (family, aggregation, split if processes > 1 else None, processes, full, fsdp, offload, deepspeed,
               entropy)
        if key not in cache:
            if family == "flow" and not sd3:
                sd3.append(str(build_tiny_sd3(base / "sd3")))
            out = base / "-".join(str(k) for k in key)
            out.mkdir()
            launcher = [sys.executable]
            if deepspeed:  # the production launcher, reading the shipped config
                port = BASE_PORT + 60 + DEEPSPEED.index((family, aggregation, full, deepspeed))
                launcher += ["-m", "accelerate.commands.launch", "--config_file",
                             str(ACCELERATE_CONFIGS / f"deepspeed_zero{deepspeed}.yaml"),
                             "--num_processes", str(processes), "--main_process_port", str(port)]
            elif processes > 1 and entropy:
                launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                             "--master_port", str(BASE_PORT + 80)]
            elif processes > 1:
                port = BASE_PORT + (len(TWO_PROCESS_RUNS) + len(SHARDED) + OFFLOADED.index((family, aggregation, full))
                                    if offload else
                                    len(TWO_PROCESS_RUNS) + SHARDED.index((family, aggregation, full)) if fsdp
                                    else TWO_PROCESS_RUNS.index((family, aggregation, split)) + 40 * full)
                launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                             "--master_port", str(port)]
            flags = (["--full"] * full + ["--fsdp"] * fsdp + ["--offload"] * offload + ["--deepspeed"] * bool(deepspeed)
                     + ["--entropy"] * entropy)
            cmd = [*launcher, str(WORKER), str(out), family, aggregation, split, *(sd3 if family == "flow" else []),
                   *flags]
            result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            assert result.returncode == 0, f"{processes} process(es): rc {result.returncode}\n{result.stderr[-4000:]}"
            cache[key] = [torch.load(out / f"rank{r}.pt") for r in range(processes)]
        return cache[key]

    def run(family: str, aggregation: str, split: str = "contiguous", full: bool = False, fsdp: bool = False,
            offload: bool = False, deepspeed: int | None = None, entropy: bool = False):
        # one process first: it also builds the tiny VLM into the cache, before two processes could race for it
        one = launch(family, aggregation, split, 1, full, entropy=entropy)[0]
        return one, launch(family, aggregation, split, 2, full, fsdp or offload, offload, deepspeed, entropy)

    return run


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def action_weighted(ranks: list[dict], key: str) -> float:
    """The whole batch's action mean of a metric each process logs as the action mean of its own samples."""
    return sum(r["metrics"][key] * r["actions"] for r in ranks) / sum(r["actions"] for r in ranks)


def gathered_advantages(one: dict, two: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The two processes' advantages in the order of the global batch, and the one-process ones."""
    rows = torch.cat([r["rows"] for r in two])
    assert sorted(rows.tolist()) == one["rows"].tolist()
    adv = torch.empty_like(one["advantages"])
    adv[rows] = torch.cat([r["advantages"] for r in two])
    return adv, one["advantages"]


@pytest.mark.parametrize("family,aggregation,split", INVARIANT)
def test_one_process_and_two_processes_give_the_same_update(runs, family, aggregation, split):
    one, two = runs(family, aggregation, split)
    r0, r1 = two
    m1, m2 = one["metrics"], r0["metrics"]
    groups = [set((r["rows"] // GROUP).tolist()) for r in two]
    assert groups == ([{0}, {1}] if split == "contiguous" else [{0, 1}, {0, 1}]), groups
    # the same starting point: DDP broadcast rank 0's LoRA init, which the one-process run shares (seed + rank 0)
    assert torch.equal(r0["initial"], one["initial"]) and torch.equal(r1["initial"], one["initial"])
    assert one["actions"] == r0["actions"] + r1["actions"]
    if family == "vlm":  # the halves differ in action count: a local dapo count would not be invariant
        assert r0["actions"] != r1["actions"], (r0["actions"], r1["actions"])

    # group statistics on the global batch: the processes' advantages are the one-process advantages
    adv, adv_one = gathered_advantages(one, two)
    assert adv_one.abs().sum() > 0
    torch.testing.assert_close(adv, adv_one, rtol=1e-6, atol=1e-7)

    # the loss is a near-cancelling sum of O(1) terms (centred advantages): float32 rounding bounds it absolutely
    assert abs(m2["loss"] - m1["loss"]) <= RTOL * abs(m1["loss"]) + 1e-7, (m2["loss"], m1["loss"])
    assert r1["metrics"]["loss"] == m2["loss"]  # reduced over processes: every process logs the same value
    assert abs(m2["grad_norm"] - m1["grad_norm"]) <= RTOL * m1["grad_norm"], (m2["grad_norm"], m1["grad_norm"])
    assert m1["grad_norm"] > 0
    # the KL term is in the loss (beta > 0) and non-zero (epoch 2 moved off the reference); each process logs
    # its own samples' mean, and their action-weighted mean is the whole batch's
    assert m1["kl"] > 0
    kl = action_weighted(two, "kl")
    assert abs(kl - m1["kl"]) <= RTOL * m1["kl"], (kl, m1["kl"])

    # the update: non-trivial, the same, and identical on both replicas
    moved = relative_error(one["weights"], one["initial"])
    assert moved > 1e-3, moved
    weights = relative_error(r0["weights"], one["weights"])
    update = relative_error(r0["weights"] - r0["initial"], one["weights"] - one["initial"])
    print(f"\n{family}/{aggregation}/{split}: loss {abs(m2['loss'] - m1['loss']):.3g} abs "
          f"(|loss| {abs(m1['loss']):.3g}), grad_norm {abs(m2['grad_norm'] - m1['grad_norm']) / m1['grad_norm']:.3g}, "
          f"kl {abs(kl - m1['kl']) / m1['kl']:.3g}, weights {weights:.3g}, update {update:.3g} (moved {moved:.3g}), "
          f"advantages {relative_error(adv, adv_one):.3g}")
    assert weights <= RTOL, weights
    assert torch.equal(r0["weights"], r1["weights"])
    # the update alone (weights - initial, ~30 % of the weights' norm): Adam divides each coordinate by its own
    # gradient scale, so a coordinate's rounding is relative to ITS gradient, not to the gradient's norm
    assert update <= 10 * RTOL, update


def test_bnpo_is_a_per_process_action_mean(runs):
    """``bnpo`` (TRL's definition) divides by the action count of the PROCESS's batch: with halves of 20 and 28
    actions two processes average two local means, which is not the one-process mean over 48. Not a bug: the
    process count is part of bnpo's definition; ``dapo`` is its invariant form (global count / processes)."""
    one, two = runs("vlm", "bnpo")
    r0, r1 = two
    torch.testing.assert_close(*gathered_advantages(one, two), rtol=1e-6, atol=1e-7)  # still global

    m1 = one["metrics"]
    # the logged policy metrics are global action means, so one process's loss is their bnpo loss, two
    # processes' (a mean of two local action means) is not
    assert abs(m1["loss"] - (m1["policy_loss"] + BETA * m1["kl"])) <= RTOL * abs(m1["loss"]) + 1e-7
    assert abs(r0["metrics"]["loss"] - m1["loss"]) > 1e-3 * abs(m1["loss"])
    assert relative_error(r0["weights"], one["weights"]) > 100 * RTOL  # a different update
    assert torch.equal(r0["weights"], r1["weights"])


def test_logged_policy_metrics_describe_the_whole_batch(runs):
    """kl, policy_loss, approx_kl, ratio and clip statistics are action-weighted over every process (before, only
    the loss was reduced: the others were the main process's own samples' means)."""
    one, (r0, _) = runs("vlm", "dapo")
    for key in ("kl", "policy_loss", "approx_kl", "ratio/mean"):
        want = one["metrics"][key]
        assert abs(r0["metrics"][key] - want) <= RTOL * abs(want) + 1e-7, (key, r0["metrics"][key], want)


@pytest.mark.parametrize("family,aggregation,full", SHARDED,
                         ids=[f"{f}-{a}-{'full' if full else 'lora'}" for f, a, full in SHARDED])
def test_fsdp_sharded_update_is_the_one_process_update(runs, family, aggregation, full):
    """Two processes that shard the model (FSDP2) make the update one process makes: the rollout runs on the
    gathered weights, the loss on the shards, the gradient is reduce-scattered and each process steps its half.
    The VLM's full fine-tuning trains the vision tower too: one process encodes each prompt once per forward,
    the sharded processes pass the pixels through the model's own forward."""
    one, two = runs(family, aggregation, full=full, fsdp=True)
    r0, r1 = two
    assert r0["sharded"] and r1["sharded"] and not one["sharded"]
    assert_same_update_on_two_processes(one, two, f"fsdp {family}/{aggregation}/{'full' if full else 'lora'}")


@pytest.mark.parametrize("family,aggregation,full", OFFLOADED,
                         ids=[f"{f}-{a}-{'full' if full else 'lora'}" for f, a, full in OFFLOADED])
def test_fsdp_with_cpu_offload_is_the_one_process_update(runs, family, aggregation, full):
    """``fsdp_offload_params: true``: the shards, their gradients and the AdamW state live on the CPU (unpinned
    here: pinning needs a CUDA driver); the update is still the one-process update."""
    one, two = runs(family, aggregation, full=full, offload=True)
    assert all(r["sharded"] and r["offloaded"] for r in two) and not one["offloaded"]
    assert_same_update_on_two_processes(one, two, f"fsdp+offload {family}/{aggregation}/{'full' if full else 'lora'}")


@pytest.mark.parametrize("family,aggregation,full,stage", DEEPSPEED,
                         ids=[f"zero{z}-{f}-{a}-{'full' if full else 'lora'}" for f, a, full, z in DEEPSPEED])
def test_deepspeed_is_the_one_process_update(runs, family, aggregation, full, stage):
    """``accelerate launch --config_file configs/accelerate/deepspeed_zero{2,3}.yaml``: each process holds half of
    the gradients and of the AdamW state (ZeRO-3: of the weights too, gathered per forward by the engine's hooks
    and once for the rollout), the engine reduce-scatters, steps its half and all-gathers; the loop's own
    accumulation (several timestep chunks per optimizer step for the flow) reaches the engine as its boundary.
    The update is the one-process update."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    one, two = runs(family, aggregation, full=full, deepspeed=stage)
    assert all(r["deepspeed"] == stage for r in two) and one["deepspeed"] is None
    assert_same_update_on_two_processes(one, two, f"zero{stage} {family}/{aggregation}/{'full' if full else 'lora'}")


def test_ddp_full_finetuning_with_the_vision_tower_is_the_one_process_update(runs):
    """DDP: the vision tower is encoded outside the wrapped forward (each prompt once per forward); its gradients
    are still averaged over the processes."""
    one, two = runs("vlm", "dapo", full=True)
    assert not two[0]["sharded"] and not one["sharded"]
    assert_same_update_on_two_processes(one, two, "ddp vlm/dapo/full")


def test_entropy_options_give_the_same_update_on_two_processes(runs):
    """top_entropy_quantile's threshold is the quantile of ALL processes' token entropies (each process logs it), and
    entropy_coef's bonus is the mean over all of them: with two samples of each group on each process the update is
    the one-process update, and the options change it (against the same split without them)."""
    one, two = runs(*ENTROPY, entropy=True)
    m1 = one["metrics"]
    threshold = m1["rollout/entropy_threshold"]
    assert threshold > 0
    for rank in two:
        assert abs(rank["metrics"]["rollout/entropy_threshold"] - threshold) <= 1e-6 * threshold
        assert 0.0 < rank["metrics"]["rollout/high_entropy_fraction"] < 1.0
    kept = action_weighted(two, "rollout/high_entropy_fraction")
    assert abs(kept - m1["rollout/high_entropy_fraction"]) <= 1e-6
    entropy = action_weighted(two, "entropy")
    assert m1["entropy"] > 0 and abs(entropy - m1["entropy"]) <= RTOL * m1["entropy"], (entropy, m1["entropy"])
    assert_same_update_on_two_processes(one, two, "vlm/dapo/interleaved with the entropy options")
    plain, _ = runs(*ENTROPY)
    assert torch.equal(plain["initial"], one["initial"])
    assert relative_error(one["weights"] - one["initial"], plain["weights"] - plain["initial"]) > 1e-2


def assert_same_update_on_two_processes(one: dict, two: list[dict], name: str) -> None:
    r0, r1 = two
    assert torch.equal(r0["initial"], one["initial"]) and torch.equal(r1["initial"], one["initial"])
    adv, adv_one = gathered_advantages(one, two)
    assert adv_one.abs().sum() > 0
    torch.testing.assert_close(adv, adv_one, rtol=1e-6, atol=1e-7)
    m1, m2 = one["metrics"], r0["metrics"]
    assert abs(m2["loss"] - m1["loss"]) <= RTOL * abs(m1["loss"]) + 1e-7, (m2["loss"], m1["loss"])
    assert abs(m2["grad_norm"] - m1["grad_norm"]) <= RTOL * m1["grad_norm"], (m2["grad_norm"], m1["grad_norm"])
    kl = action_weighted(two, "kl")
    assert m1["kl"] > 0 and abs(kl - m1["kl"]) <= RTOL * m1["kl"], (kl, m1["kl"])
    moved = relative_error(one["weights"], one["initial"])
    assert moved > 1e-3, moved
    weights = relative_error(r0["weights"], one["weights"])
    update = relative_error(r0["weights"] - r0["initial"], one["weights"] - one["initial"])
    print(f"\n{name}: weights {weights:.3g}, update {update:.3g} "
          f"(moved {moved:.3g}), {one['weights'].numel()} trainable values")
    assert weights <= RTOL, weights
    assert update <= 10 * RTOL, update
    assert torch.equal(r0["weights"], r1["weights"])  # the gathered halves are the same model on both processes
