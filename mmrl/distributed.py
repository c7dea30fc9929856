"""Sharded training (FSDP2 through accelerate): what the loop needs beyond ``accelerator.prepare``.

``accelerate launch --config_file configs/accelerate/fsdp2.yaml`` makes ``accelerator.prepare(model, optimizer)``
apply ``torch.distributed.fsdp.fully_shard``: each process keeps ``1 / processes`` of every parameter, gradient
and optimizer state as a ``DTensor`` shard, a forward all-gathers a module's parameters and frees them again, a
backward reduce-scatters the gradients (their mean over processes, as DDP's all-reduce). Three parts of a GRPO
loop do not fit that per-forward collective and are handled here:

* **rollouts and evaluation** run a number of forwards that may differ between processes (``generate`` stops
  when a process's own completions end; only the main process evaluates), so they run inside
  :func:`full_weights`: every process all-gathers the whole model once, the block runs with no collective, and
  the shards are restored afterwards. This is the gathered-weights generation TRL and verl use under ZeRO-3 /
  FSDP (one all-gather per rollout instead of one per forward), at the cost of holding the full model for the
  duration of the rollout;
* **checkpoints and exports** are written from whole tensors (:func:`full_model_state`,
  :func:`full_optimizer_state`: ``torch.distributed.checkpoint.state_dict`` gathers them to the main process), so
  a sharded run's checkpoint holds the same files as an unsharded run's and resumes on another process count;
* **loading** full tensors back into shards (:func:`copy_full_into`).

Everything here is a no-op on a model that is not sharded.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def check_engine(accelerator) -> None:
    """The distributed engines the loop supports: none, DDP (any device) and FSDP2. FSDP1 (``fsdp_version: 1``)
    flattens parameters into ``FlatParameter`` blocks that rollouts, checkpoints and exports here do not gather, and
    DeepSpeed's engine owns the optimizer step and gradient clipping the loop does itself: both are refused before
    any model is wrapped, with the config to use instead."""
    from accelerate.utils import DistributedType

    from mmrl.config import ConfigError

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ConfigError("FSDP version 1 is not supported: set fsdp_version: 2 in the accelerate config "
                          "(configs/accelerate/fsdp2.yaml)")
    if kind == DistributedType.DEEPSPEED:
        raise ConfigError("DeepSpeed is not supported by mmrl's loop (its engine owns the optimizer step and the "
                          "gradient clipping); FSDP2 shards weights, gradients and optimizer state as ZeRO-3 does: "
                          "accelerate launch --config_file configs/accelerate/fsdp2.yaml")


def fsdp_modules(module: torch.nn.Module | None) -> list[torch.nn.Module]:
    """The FSDP2-managed modules inside ``module`` (root first), or ``[]``."""
    if module is None:
        return []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _reshards_after_forward(module) -> bool:
    """Whether ``module`` frees its gathered parameters after each forward (FSDP2 keeps this per parameter group;
    the root's is False unless set)."""
    groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", [])
    return any(getattr(g, "post_forward_mesh_info", None) is not None for g in groups)


@contextlib.contextmanager
def full_weights(module: torch.nn.Module | None) -> Iterator[None]:
    """Inside the block every parameter of a sharded ``module`` is its full, plain tensor on every process and no
    forward communicates; on exit the shards are restored. A collective: every process must enter it. Writes to
    the gathered tensors are not written back (load weights with :func:`copy_full_into`)."""
    modules = fsdp_modules(module)
    if not modules:
        yield
        return
    # FSDP2 makes the first module whose forward runs the root: generate() runs the PEFT model's inner model and
    # its blocks, never the root's forward, so the root is initialised here first (torch has no public call for it)
    modules[0]._get_fsdp_state()._lazy_init()
    reshards = [_reshards_after_forward(m) for m in modules]
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m, reshard in zip(modules, reshards):
            # a module whose last forward did not reshard skips reshard() (the root never does): allow it for the
            # call, so every parameter is its shard again and the optimizer's DTensors are the registered ones
            m.set_reshard_after_forward(True, recurse=False)
            m.reshard()
            m.set_reshard_after_forward(reshard, recurse=False)


def is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (an FSDP2 shard)."""
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "placements")


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s full value (a collective), any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def copy_full_into(param: torch.Tensor, value: torch.Tensor) -> None:
    """``param.copy_(value)`` where ``param`` may be a ``DTensor`` shard and ``value`` is the full tensor that every
    process holds (a checkpoint's): each process keeps its own slice, nothing is communicated."""
    if is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements,
                                  src_data_rank=None)
    param.copy_(value)


def broadcast_from_main(params) -> None:
    """Every process takes the main process's values of ``params`` (DDP does this when it wraps a model; FSDP2
    keeps each process's own slice, so a LoRA initialised with a per-process seed must be made common first)."""
    with torch.no_grad():
        for param in params:
            torch.distributed.broadcast(param.data, src=0)


def _inner_optimizer(optimizer):
    while hasattr(optimizer, "optimizer"):  # accelerate's AcceleratedOptimizer
        optimizer = optimizer.optimizer
    return optimizer


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of a sharded ``model`` as whole CPU tensors on the main process (``{}`` on the others; a
    collective), keyed as ``model.state_dict()``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def unsharded_class(module: torch.nn.Module) -> type:
    """The class ``fully_shard`` derived ``module``'s class from (it swaps in an ``FSDP<Name>`` subclass)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return type(module)
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def full_optimizer_state(model: torch.nn.Module, optimizer) -> dict[str, Any]:
    """The optimizer state of a sharded ``model`` as full CPU tensors keyed by parameter name (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, _inner_optimizer(optimizer),
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state(model: torch.nn.Module, optimizer, state: dict[str, Any]) -> None:
    """Inverse of :func:`full_optimizer_state`: every process loads the full state and keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, _inner_optimizer(optimizer), state,
                             options=StateDictOptions(full_state_dict=True))
