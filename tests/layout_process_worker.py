"""Run by test_layout_processes.py: one update of a real Trainer on ONE global batch of 2 prompts x 4 samples,
either all 8 samples on one process or split 4 + 4 over two gloo processes (under torchrun).

    python tests/layout_process_worker.py OUT FAMILY AGGREGATION SPLIT [MODEL_PATH] [--full]   # one process
    python -m torch.distributed.run --nproc_per_node 2 --master_port PORT \\
        tests/layout_process_worker.py OUT FAMILY AGGREGATION SPLIT [MODEL_PATH] [--full] [--fsdp]  # two

``--full``: full fine-tuning instead of the recipe's LoRA (for the VLM, vision tower included). ``--fsdp``: the
processes shard the model with FSDP2 as ``configs/accelerate/fsdp2.yaml`` configures it (see :func:`select_fsdp2`)
instead of DDP; with ``--offload`` as ``configs/accelerate/fsdp2_offload.yaml`` does (shards on the CPU).
``--deepspeed``: launched by ``accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml`` (the test
does that); the trained steps are then cut into chunks (``train.timestep_chunk``: 2 flow steps, 4 VLM tokens), so
each optimizer step takes several backwards (the one-process run it is compared with does not chunk: chunking
never changes the update). ``--entropy``: with ``algorithm.top_entropy_quantile: 0.5`` and ``algorithm.entropy_coef:
0.01`` (VLM only): the threshold is a quantile over every process's tokens, the bonus a mean over them.

Sampling randomness is seeded per process by design, so every process samples the SAME global rollout (same
items, same generator, group ids 0..1) and keeps its share of the rows: SPLIT ``contiguous`` gives process r
rows ``4r .. 4r+3`` (one whole group each, the layout of a real run), ``interleaved`` rows ``r, r+2, r+4, r+6``
(two samples of EACH group per process, so no group's statistics can be computed from one process's rewards:
what a condition drawn on several processes meets in a real run). The layouts then train on exactly the same
samples, and whatever differs must come from the trainer's cross-process statistics (group
advantages gathered over processes, ``dapo``'s global action count, the DDP gradient average). Each process
writes ``OUT/rank{r}.pt``: its metrics, its advantages, its action count, the trainable weights before and after.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from layout import cut_completions, flat_weights, select_fsdp2, take_rows  # noqa: E402
from mmrl.build import build_trainer  # noqa: E402
from mmrl.config import load_config  # noqa: E402

REPO = Path(__file__).parents[1]
TINY_RECIPE = str(REPO / "configs" / "tiny" / "flow_grpo.yaml")
PROMPTS, GROUP = 2, 4  # the global batch: 2 prompts x 4 samples


def common(world: int, aggregation: str) -> list[str]:
    return [f"data.prompts_per_step={PROMPTS // world}", f"data.group_size={GROUP}",
            f"train.batch_size={PROMPTS * GROUP // world}",  # one minibatch per process: its order is irrelevant
            "train.gradient_accumulation_steps=1", "train.inner_epochs=2",  # epoch 2 has ratio != 1
            "optim.max_grad_norm=0", "optim.lr=1e-2", "algorithm.beta=0.04", f"algorithm.aggregation={aggregation}",
            "train.overlap_scoring=false", "logging.eval_every=0", "logging.progress_bar=false",
            "logging.tensorboard=false"]


def build_config(out: Path, family: str, aggregation: str, world: int, model: str | None, full: bool = False,
                 chunked: bool = False, entropy: bool = False):
    extra = ["model.use_lora=false", "optim.lr=1e-3"] if full else []
    if entropy:
        extra += ["algorithm.top_entropy_quantile=0.5", "algorithm.entropy_coef=0.01"]
    if chunked:
        extra.append(f"train.timestep_chunk={2 if family == 'flow' else 4}")
    if full and family == "vlm":
        extra.append("model.freeze_vision=false")  # the vision tower trained too
    if family == "flow":
        return load_config(TINY_RECIPE, [f"output_dir={out}/run", f"model.pretrained={model}", "sampling.num_steps=4",
                                  "sampling.eval_num_steps=4", "sampling.max_sequence_length=16",
                                  "algorithm.clip_low=0.2", *common(world, aggregation), *extra])
    if family == "vlm":
        return load_config(str(REPO / "configs/tiny/vlm_grounding.yaml"),
                           [f"output_dir={out}/run", "generation.max_new_tokens=12",
                            "rewards={test_short_completion: 1.0}", *common(world, aggregation), *extra])
    raise SystemExit(f"unknown family {family!r}")


def offloaded(trainer) -> bool:
    """Whether every FSDP2 unit of the policy keeps its shards on the CPU (``CPUOffloadPolicy``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from mmrl.distributed import fsdp_modules

    policy = trainer.policy
    modules = fsdp_modules(getattr(policy, "train_model", policy.model))  # the VLM's prepared model, the flow's
    groups = [g for m in modules for g in m._get_fsdp_state()._fsdp_param_groups]
    return bool(groups) and all(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups)


def main() -> None:
    flags = {a for a in sys.argv[1:] if a.startswith("--")}
    out, family, aggregation, split, *rest = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = Path(out)
    model = rest[0] if rest else None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "--fsdp" in flags:
        select_fsdp2(offload="--offload" in flags)
    trainer = build_trainer(build_config(out, family, aggregation, world, model, full="--full" in flags,
                                         chunked="--deepspeed" in flags, entropy="--entropy" in flags))
    from mmrl.distributed import deepspeed_stage

    assert (deepspeed_stage(trainer.accelerator) is not None) == ("--deepspeed" in flags)
    acc = trainer.accelerator
    assert acc.num_processes == world, (acc.num_processes, world)
    assert trainer.sharded == ("--fsdp" in flags), trainer.sharded
    rank = acc.process_index
    with trainer._full_weights():  # sharded: the whole weights (a collective)
        initial = flat_weights(trainer.policy).clone()

    # the same global rollout on every process (same items, same generator), then this process's rows
    items = trainer.prompts.items[:PROMPTS]
    with trainer._full_weights():  # what Trainer.step does around sampling
        rollout = trainer.policy.rollout(items, GROUP, generator=torch.Generator().manual_seed(1234))
    assert len(rollout) == PROMPTS * GROUP and rollout.group_ids.tolist() == [0] * GROUP + [1] * GROUP
    if family == "vlm":
        cut_completions(trainer.policy, rollout)
    n_local = PROMPTS * GROUP // world
    if split == "contiguous":
        rows = torch.arange(rank * n_local, (rank + 1) * n_local)
    elif split == "interleaved":
        rows = torch.arange(rank, PROMPTS * GROUP, world)
    else:
        raise SystemExit(f"unknown split {split!r}")
    local = take_rows(rollout, rows)

    trainer.reward_counts = {}  # what Trainer.step sets before scoring
    scores = trainer._score(local)
    advantages, adv_stats = trainer._advantages(local, scores)
    metrics = trainer._train_on(local, advantages, torch.Generator().manual_seed(7))
    if trainer.scorer is not None:
        trainer.scorer.close()

    with trainer._full_weights():
        weights = flat_weights(trainer.policy).clone()
    result = {"metrics": metrics, "adv_stats": adv_stats, "advantages": advantages.cpu(), "rows": rows,
              "scores": {k: v.cpu() for k, v in scores.items()}, "actions": float(local.mask.sum()),
              "initial": initial, "weights": weights, "sharded": trainer.sharded, "offloaded": offloaded(trainer),
              "deepspeed": deepspeed_stage(acc)}
    torch.save(result, out / f"rank{rank}.pt")
    if rank == 0:
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    if world > 1:
        acc.wait_for_everyone()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # every file is written and closed: leave without the interpreter's teardown, where a C++ worker thread still
    # joinable at static destruction aborted a rank once in a loaded CI run ("terminate called without an active
    # exception", SIGABRT after the results were on disk)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
