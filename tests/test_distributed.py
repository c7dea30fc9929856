"""mmrl.distributed in one process: the engines the loop refuses, the DeepSpeed config it fills, and the helpers' behaviour on a model that is
not sharded (the sharded behaviour is tested on 2 gloo processes in test_layout_processes.py and
test_multiprocess.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from mmrl.config import ConfigError
from mmrl.distributed import (check_engine, configure_deepspeed, configure_fsdp, copy_full_into, deepspeed_stage, fsdp_modules,
                              full_tensor, full_weights, is_dtensor)


@pytest.mark.parametrize("kind,fsdp2", [(DistributedType.NO, False), (DistributedType.MULTI_CPU, False),
                                        (DistributedType.MULTI_GPU, False), (DistributedType.FSDP, True)])
def test_supported_engines_pass(kind, fsdp2):
    check_engine(SimpleNamespace(distributed_type=kind, is_fsdp2=fsdp2))


def test_fsdp1_is_refused_with_the_config_to_use():
    with pytest.raises(ConfigError, match="fsdp_version: 2"):
        check_engine(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False))


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_fsdp2_under_mixed_precision_reduces_gradients_in_fp32(precision, dtype, monkeypatch):
    """accelerate's FSDP2 policy for bf16 reduces (and, under no_sync, accumulates) gradients in bf16; the loop's
    fp32 trainable weights get fp32 gradient reductions, as under DDP. The forward still computes in the mixed
    precision."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    monkeypatch.setenv("FSDP_VERSION", "2")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision(precision)
    assert plugin.mixed_precision_policy.reduce_dtype == dtype  # accelerate's own choice
    accelerator = SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True,
                                  state=SimpleNamespace(fsdp_plugin=plugin))
    configure_fsdp(accelerator)
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (dtype, torch.float32)
    unchanged = FullyShardedDataParallelPlugin(fsdp_version=2)  # fp32: no policy to change
    configure_fsdp(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True,
                                   state=SimpleNamespace(fsdp_plugin=unchanged)))
    assert unchanged.mixed_precision_policy is None
    configure_fsdp(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, is_fsdp2=False))  # not FSDP: no-op


def deepspeed_accelerator(stage: int, processes: int = 2, **ds_config):
    plugin = SimpleNamespace(zero_stage=stage, zero3_init_flag=False, deepspeed_config={"zero_optimization": {"stage": stage}, **ds_config})
    return SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, is_fsdp2=False, num_processes=processes,
                           state=SimpleNamespace(deepspeed_plugin=plugin))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_stages_pass(stage):
    accelerator = deepspeed_accelerator(stage)
    check_engine(accelerator)
    assert deepspeed_stage(accelerator) == stage
    assert deepspeed_stage(SimpleNamespace(distributed_type=DistributedType.MULTI_GPU)) is None


def test_an_unknown_deepspeed_stage_is_refused():
    with pytest.raises(ConfigError, match="ZeRO stage 0 is not supported"):
        check_engine(deepspeed_accelerator(0))


def test_zero3_init_at_model_construction_is_refused():
    """mmrl casts, wraps LoRA and copies the reference on whole models before the engine partitions them."""
    accelerator = deepspeed_accelerator(3)
    accelerator.state.deepspeed_plugin.zero3_init_flag = True
    with pytest.raises(ConfigError, match="zero3_init_flag: false"):
        configure_deepspeed(accelerator, micro_batch=2, max_grad_norm=0.5)


def test_only_a_zero3_engine_counts_as_partitioned_weights():
    from mmrl.distributed import is_zero3, weights_partitioned

    engine = lambda stage: SimpleNamespace(zero_optimization_stage=lambda: stage)  # noqa: E731
    assert is_zero3(engine(3)) and not is_zero3(engine(2)) and not is_zero3(torch.nn.Linear(2, 2))
    assert weights_partitioned(engine(3)) is True and weights_partitioned(torch.nn.Linear(2, 2)) is False


def test_the_deepspeed_config_is_filled_from_mmrls_fields():
    """The engine accumulates nothing itself (the loop does and marks each step's end), takes train.batch_size as
    its micro-batch and clips at optim.max_grad_norm."""
    accelerator = deepspeed_accelerator(2, processes=4, gradient_accumulation_steps="auto", gradient_clipping="auto")
    configure_deepspeed(accelerator, micro_batch=3, max_grad_norm=0.5)
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    assert (ds["gradient_accumulation_steps"], ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"],
            ds["gradient_clipping"]) == (1, 3, 12, 0.5)
    same = deepspeed_accelerator(2, gradient_accumulation_steps=1, gradient_clipping=0.5)
    configure_deepspeed(same, micro_batch=2, max_grad_norm=0.5)  # agreeing values are fine


@pytest.mark.parametrize("ds_config,message", [
    ({"gradient_accumulation_steps": 4}, "train.gradient_accumulation_steps"),
    ({"gradient_clipping": 1.0}, "optim.max_grad_norm"),
    ({"optimizer": {"type": "AdamW"}}, "'optimizer' section"),
    ({"scheduler": {"type": "WarmupLR"}}, "'scheduler' section"),
])
def test_a_deepspeed_config_that_contradicts_mmrl_is_refused(ds_config, message):
    with pytest.raises(ConfigError, match=message):
        configure_deepspeed(deepspeed_accelerator(2, **ds_config), micro_batch=2, max_grad_norm=0.5)


def test_helpers_leave_an_unsharded_model_alone():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    before = [p.clone() for p in model.parameters()]
    assert fsdp_modules(model) == [] and fsdp_modules(None) == []
    with full_weights(model):
        out = model(torch.ones(1, 3))
    assert out.shape == (1, 2)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    weight = model[0].weight
    assert not is_dtensor(weight) and full_tensor(weight) is weight
    with torch.no_grad():
        copy_full_into(weight, torch.full((4, 3), 2.0))
    assert torch.equal(weight, torch.full((4, 3), 2.0))


def test_the_variants_that_swap_weight_copies_in_say_so():
    """ZeRO-3 refuses a variant that keeps and swaps in its own copy of the trainable weights (its weights are
    partitions outside a forward); GRPO-CARE's EMA reference is the one there is."""
    from mmrl.algorithms import REGISTRY

    assert sorted(name for name, cls in REGISTRY.items() if cls.copies_weights) == ["grpo_care"]
