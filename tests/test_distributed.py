"""mmrl.distributed in one process: the engines the loop refuses, and the helpers' behaviour on a model that is
not sharded (the sharded behaviour is tested on 2 gloo processes in test_layout_processes.py and
test_multiprocess.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from mmrl.config import ConfigError
from mmrl.distributed import check_engine, copy_full_into, fsdp_modules, full_tensor, full_weights, is_dtensor


@pytest.mark.parametrize("kind,fsdp2", [(DistributedType.NO, False), (DistributedType.MULTI_CPU, False),
                                        (DistributedType.MULTI_GPU, False), (DistributedType.FSDP, True)])
def test_supported_engines_pass(kind, fsdp2):
    check_engine(SimpleNamespace(distributed_type=kind, is_fsdp2=fsdp2))


def test_fsdp1_is_refused_with_the_config_to_use():
    with pytest.raises(ConfigError, match="fsdp_version: 2"):
        check_engine(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False))


def test_deepspeed_is_refused_with_the_config_to_use():
    with pytest.raises(ConfigError, match="configs/accelerate/fsdp2.yaml"):
        check_engine(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, is_fsdp2=False))


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
