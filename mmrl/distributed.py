"""Sharded training (FSDP2 or DeepSpeed ZeRO through accelerate): what the loop needs beyond
``accelerator.prepare``.

DeepSpeed ZeRO-1 / ZeRO-2 (``configs/accelerate/deepspeed_zero2.yaml``) partitions the optimizer state (and, at
stage 2, the gradients) and keeps every weight whole on every process, so rollouts, evaluation and exports read
the model as they do under DDP; ZeRO-3 (``deepspeed_zero3.yaml``) partitions the weights too, and rollouts,
evaluation and checkpoints then run inside :func:`full_weights` as under FSDP2. :func:`configure_deepspeed` fills
the engine's config from mmrl's fields, the loop hands each backward and optimizer step to the engine, and
checkpoints add the engine's own partitioned files. The rest of this module is FSDP2's.

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
    """The distributed engines the loop supports: none, DDP (any device), FSDP2 and DeepSpeed ZeRO stages 1-3.
    FSDP1 (``fsdp_version: 1``) flattens parameters into ``FlatParameter`` blocks that rollouts, checkpoints and
    exports here do not gather: refused before any model is wrapped, with the config to use instead."""
    from accelerate.utils import DistributedType

    from mmrl.config import ConfigError

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ConfigError("FSDP version 1 is not supported: set fsdp_version: 2 in the accelerate config "
                          "(configs/accelerate/fsdp2.yaml)")
    stage = deepspeed_stage(accelerator)
    if stage is not None and stage not in (1, 2, 3):
        raise ConfigError(f"DeepSpeed ZeRO stage {stage} is not supported: use zero_stage 1, 2 or 3 "
                          "(configs/accelerate/deepspeed_zero2.yaml, deepspeed_zero3.yaml)")


def configure_fsdp(accelerator) -> None:
    """FSDP2 under ``train.mixed_precision`` bf16 / fp16: gradients reduced and accumulated in fp32.

    accelerate's policy for a mixed precision is ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)``,
    so FSDP2 would reduce-scatter the gradients in bf16 and, between the micro-steps of one optimizer step (the
    loop's ``no_sync``: ``set_requires_gradient_sync(False)``), keep their unsharded sum in bf16 too; under DDP or
    one process the fp32 trainable weights get fp32 gradients reduced in fp32. Measured on a 2-process toy of 32
    micro-steps: relative gradient error 5.3e-3 with the bf16 reduce against 2.5e-3 from the bf16 compute alone.
    The forward keeps computing in ``param_dtype`` (the mixed precision), as accelerate sets it; a policy that
    already reduces in fp32 is left as it is."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.FSDP or not accelerator.is_fsdp2:
        return
    plugin = accelerator.state.fsdp_plugin
    policy = getattr(plugin, "mixed_precision_policy", None)
    if policy is None or getattr(policy, "reduce_dtype", None) in (None, torch.float32):
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=torch.float32,
                                                         output_dtype=policy.output_dtype,
                                                         cast_forward_inputs=policy.cast_forward_inputs)


def deepspeed_stage(accelerator) -> int | None:
    """The ZeRO stage when accelerate runs DeepSpeed, else ``None``."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    return int(accelerator.state.deepspeed_plugin.zero_stage)


def configure_deepspeed(accelerator, *, micro_batch: int, max_grad_norm: float) -> None:
    """Fill the DeepSpeed config from mmrl's own fields before ``accelerator.prepare`` builds the engine.

    The loop keeps its layout: it accumulates as many micro-batches (minibatches x timestep chunks) per optimizer
    step as ``train.gradient_accumulation_steps`` and the chunking give, each loss already normalised by what the
    whole step covers, and tells the engine where each step ends (``set_gradient_accumulation_boundary``). So the
    engine's own accumulation is 1 (its ``backward`` divides by nothing), its micro-batch is ``train.batch_size``
    and its clipping is ``optim.max_grad_norm`` (0: none; DeepSpeed clips the global norm as
    ``clip_grad_norm_`` does). An accelerate / DeepSpeed config that sets either to something else is refused:
    the mmrl field is the one to set."""
    from mmrl.config import ConfigError

    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    accumulation = ds.get("gradient_accumulation_steps", "auto")
    if accumulation not in ("auto", 1):
        raise ConfigError(f"the DeepSpeed config sets gradient_accumulation_steps: {accumulation}; mmrl accumulates "
                          "itself: leave it at 1 or auto and set train.gradient_accumulation_steps")
    clipping = ds.get("gradient_clipping", "auto")
    if clipping not in ("auto", None) and float(clipping) != float(max_grad_norm):
        raise ConfigError(f"the DeepSpeed config sets gradient_clipping: {clipping} but optim.max_grad_norm is "
                          f"{max_grad_norm}: leave gradient_clipping out (or auto) and set optim.max_grad_norm")
    if accelerator.state.deepspeed_plugin.zero3_init_flag:
        raise ConfigError("zero3_init_flag: true is not supported: mmrl loads its models whole (it casts, wraps "
                          "LoRA and copies the reference before training) and the engine partitions the policy when "
                          "it is prepared; set zero3_init_flag: false")
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ConfigError(f"the DeepSpeed config has a {key!r} section; mmrl builds its own AdamW and schedule "
                              "from the optim section: remove it")
    ds["gradient_accumulation_steps"] = 1
    ds["train_micro_batch_size_per_gpu"] = int(micro_batch)
    ds["train_batch_size"] = int(micro_batch) * accelerator.num_processes
    ds["gradient_clipping"] = float(max_grad_norm)


def is_zero3(module) -> bool:
    """Whether ``module`` is a DeepSpeed engine that partitions its weights (ZeRO-3): each process holds 1/N of
    every parameter and forward hooks all-gather a submodule's weights for its forward."""
    stage = getattr(module, "zero_optimization_stage", None)
    return callable(stage) and stage() == 3


def weights_partitioned(module) -> bool:
    """Whether ``module``'s weights are split over the processes (FSDP2 or ZeRO-3): then every forward outside
    :func:`full_weights` is a collective, which every process must run the same number of times."""
    return is_zero3(module) or bool(fsdp_modules(module))


def deepspeed_engine(accelerator):
    """The ``DeepSpeedEngine`` that ``accelerator.prepare`` built, or ``None``."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    return None if wrapped is None else wrapped.engine


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
    the gathered tensors are not written back (load weights with :func:`copy_full_into`).

    A ZeRO-3 engine: :func:`_zero3_full_weights`."""
    if is_zero3(module):
        with _zero3_full_weights(module):
            yield
        return
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


@contextlib.contextmanager
def _zero3_full_weights(engine) -> Iterator[None]:
    """Every parameter of a ZeRO-3 ``engine`` all-gathered (``deepspeed.zero.GatheredParameters``) and the engine's
    forward hooks taken off for the block, so no forward inside it communicates: DeepSpeed's
    ``unwrap_model_for_generation`` (which TRL uses) does the same but keeps the root module's start-of-forward
    hook, whose trace check is a collective, so a forward on the main process alone (evaluation) would wait for
    the others. On exit the hooks are registered again (the next forward records a new trace) and the
    partitions restored."""
    import deepspeed
    from deepspeed.runtime.zero import parameter_offload

    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for hook in (*offload.forward_hooks, *offload.backward_hooks, offload.fwd_pre_hook):
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            depth = len(parameter_offload.FWD_MODULE_STACK)
            offload.setup_zero_stage3_hooks()
            del parameter_offload.FWD_MODULE_STACK[depth:]  # it pushes the root module again: keep the stack's depth


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
