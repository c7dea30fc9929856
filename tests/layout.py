"""Shared harness of the layout-invariance tests: one update of a real Trainer, with its per-step gradients.

``one_update(config)`` builds the trainer from ``config`` exactly as ``mmrl train`` does, runs one update and
returns the update's metrics, the flattened gradient of every optimizer step (before clipping) and the trainable
weights after the update. Two configs that differ only in a layout knob must give the same three.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from mmrl.build import build_trainer
from mmrl.rewards import register_reward


def flat_grads(params) -> torch.Tensor:
    return torch.cat([(p.grad.detach().float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
                      .flatten() for p in params])


def flat_weights(policy) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in policy.trainable_parameters()])


def spy_gradients(trainer) -> list[torch.Tensor]:
    """Record the gradient of every optimizer step (what the optimizer sees, before clipping)."""
    grads: list[torch.Tensor] = []
    original = trainer._optimizer_step

    def spy(params):
        grads.append(flat_grads(params).clone())
        return original(params)

    trainer._optimizer_step = spy
    return grads


@register_reward("test_short_completion")
class ShortCompletion:
    """Test reward with signal for a random tiny VLM: shorter completions score higher."""

    name = "test_short_completion"
    needs_prompts = False

    def __init__(self):
        self.last_info = {}

    def __call__(self, completions, prompts=None, metadata=None):
        return {self.name: torch.tensor([-float(len(c)) for c in completions])}


def cut_completions(policy, rollout) -> None:
    """Cut the i-th completion of a VLM rollout after ``2 + 5 i mod 9`` tokens (a random tiny model never writes
    its end token, so every mask would be full): the masks then differ from sample to sample."""
    for i in range(len(rollout)):
        keep = 2 + (5 * i) % 9
        rollout.mask[i, keep:] = 0
        rollout.completion_ids[i, keep:] = policy.pad_id
    rollout.completions = policy.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
    rollout.extras["completion_length"] = rollout.mask.sum(-1)


def vary_completion_lengths(trainer) -> None:
    """:func:`cut_completions` on every rollout the trainer's policy samples."""
    policy = trainer.policy
    original = policy.rollout

    def rollout(*args, **kwargs):
        r = original(*args, **kwargs)
        cut_completions(policy, r)
        return r

    policy.rollout = rollout


def one_update(config, prepare=None):
    trainer = build_trainer(config)
    if prepare is not None:
        prepare(trainer)
    grads = spy_gradients(trainer)
    metrics = trainer.step()
    if trainer.scorer is not None:
        trainer.scorer.close()
    return metrics, grads, flat_weights(trainer.policy)


def take_rows(rollout, rows: torch.Tensor):
    """Samples ``rows`` of a flow or VLM rollout (whole groups), for splitting one global batch over processes."""
    if hasattr(rollout, "select"):
        return rollout.select(rows)
    rows = torch.as_tensor(rows, dtype=torch.long)
    pick = rows.tolist()
    return dataclasses.replace(
        rollout, prompts=[rollout.prompts[i] for i in pick], metadata=[rollout.metadata[i] for i in pick],
        group_ids=rollout.group_ids[rows], images=rollout.images[rows], latents=rollout.latents[rows],
        old_logps=None if rollout.old_logps is None else rollout.old_logps[rows], mask=rollout.mask[rows],
        prompt_index=rollout.prompt_index[rows], extras={})


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def assert_same_update(a, b, *, rtol: float = 1e-5) -> None:
    """Same loss, gradient norm, gradients of every optimizer step and updated weights, to ``rtol``."""
    (ma, ga, wa), (mb, gb, wb) = a, b
    # the loss is a sum of O(1) terms that nearly cancel (advantages are centred): float32 rounding of the terms
    # (~1e-8 each) bounds its agreement in absolute terms
    assert abs(ma["loss"] - mb["loss"]) <= rtol * abs(mb["loss"]) + 1e-7, (ma["loss"], mb["loss"])
    assert abs(ma["grad_norm"] - mb["grad_norm"]) <= rtol * mb["grad_norm"], (ma["grad_norm"], mb["grad_norm"])
    assert len(ga) == len(gb), (len(ga), len(gb))
    for k, (x, y) in enumerate(zip(ga, gb)):
        assert y.norm() > 0, f"optimizer step {k} has a zero gradient: the comparison would prove nothing"
        assert relative_error(x, y) <= rtol, (k, relative_error(x, y))
    assert relative_error(wa, wb) <= rtol, relative_error(wa, wb)


FSDP_CONFIG = Path(__file__).parents[1] / "configs" / "accelerate" / "fsdp2.yaml"
OFFLOAD_CONFIG = FSDP_CONFIG.with_name("fsdp2_offload.yaml")


def select_fsdp2(offload: bool = False) -> None:
    """Make mmrl's accelerator shard with FSDP2 as ``accelerate launch --config_file configs/accelerate/fsdp2.yaml``
    does on GPUs. accelerate never selects FSDP on CPU (its MULTI_CPU type stays DDP), although torch's
    ``fully_shard`` runs on gloo CPU processes; so a test worker exports the config's ``fsdp_config`` the way
    ``accelerate launch`` does (``FSDP_<KEY>`` variables) and, once mmrl has built its accelerator, switches the
    accelerator's state to FSDP with the plugin those variables describe. Everything after that (``prepare``,
    the loop, the checkpoint) is the production path. ``offload``: ``configs/accelerate/fsdp2_offload.yaml``
    instead (``fsdp_offload_params: true``: the shards, their gradients and the optimizer on the CPU), unpinned:
    pinned memory needs a CUDA driver."""
    import yaml
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    import mmrl.build as build

    fsdp_config = yaml.safe_load((OFFLOAD_CONFIG if offload else FSDP_CONFIG).read_text())["fsdp_config"]
    for key, value in fsdp_config.items():
        os.environ["FSDP_" + key.removeprefix("fsdp_").upper()] = str(value).lower() if isinstance(value, bool) \
            else str(value)
    original = build.build_accelerator

    def build_accelerator(config):
        accelerator = original(config)
        state = AcceleratorState()
        state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables
        if offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            assert isinstance(state.fsdp_plugin.cpu_offload, CPUOffloadPolicy)
            state.fsdp_plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
        state.distributed_type = DistributedType.FSDP
        assert accelerator.is_fsdp2
        return accelerator

    build.build_accelerator = build_accelerator
