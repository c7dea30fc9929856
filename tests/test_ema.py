"""mmrl.ema.EMA: Flow-GRPO's warm-up and update interval by hand, state round trip, device/dtype on resume."""
from __future__ import annotations

import pytest
import torch

from mmrl.ema import EMA, flow_grpo_decay


def params(*values, dtype=torch.float32):
    return {f"w{i}": torch.nn.Parameter(torch.tensor([float(v)], dtype=dtype)) for i, v in enumerate(values)}


def set_to(ps, value):
    with torch.no_grad():
        for p in ps.values():
            p.fill_(value)


def test_constant_decay_every_step():
    ps = params(0.0)
    ema = EMA(ps, 0.9)
    set_to(ps, 1.0)
    assert ema.update(ps)  # shadow = 0.9 * 0 + 0.1 * 1
    assert ema.shadow["w0"].item() == pytest.approx(0.1)
    assert ema.update(ps)  # 0.9 * 0.1 + 0.1 * 1
    assert ema.shadow["w0"].item() == pytest.approx(0.19)
    assert ema.optimizer_step == 2 and ema.num_updates == 2


def test_flow_grpo_warmup_decays_by_hand():
    # EMAModuleWrapper.get_current_decay: min((1 + s) / (10 + s), decay) at optimizer step s
    assert flow_grpo_decay(0.9, 1) == pytest.approx(2 / 11)
    assert flow_grpo_decay(0.9, 7) == pytest.approx(8 / 17)
    assert flow_grpo_decay(0.9, 79) == pytest.approx(80 / 89)
    assert flow_grpo_decay(0.9, 80) == pytest.approx(0.9) and flow_grpo_decay(0.9, 1000) == 0.9
    ps = params(0.0)
    ema = EMA(ps, 0.9, warmup=True)
    expected = 0.0
    for step, target in zip((1, 2, 3), (1.0, 2.0, 4.0)):
        set_to(ps, target)
        ema.update(ps)  # counts optimizer steps itself: 1, 2, 3
        d = (1 + step) / (10 + step)  # 2/11, 3/12, 4/13
        expected = d * expected + (1 - d) * target
        assert ema.shadow["w0"].item() == pytest.approx(expected, rel=1e-6)
    # by hand: 9/11 = 0.818182; 0.25 * 0.818182 + 0.75 * 2 = 1.704545; 4/13 * 1.704545 + 9/13 * 4 = 3.293706
    assert ema.shadow["w0"].item() == pytest.approx(3.293706, rel=1e-6)


def test_update_interval_flow_grpo_schedule():
    """Flow-GRPO (update_step_interval=8, decay 0.9, warm-up): updates at optimizer steps 7, 15, 23 only."""
    ps = params(0.0)
    ema = EMA(ps, 0.9, update_interval=8, warmup=True)
    expected, updated = 0.0, []
    for step in range(1, 25):
        set_to(ps, float(step))
        if ema.update(ps, step):
            updated.append(step)
            d = min((1 + step) / (10 + step), 0.9)
            expected = d * expected + (1 - d) * step
        assert ema.shadow["w0"].item() == pytest.approx(expected, rel=1e-6)
    assert updated == [7, 15, 23] and ema.num_updates == 3
    # by hand: step 7: 9/17 * 7 = 3.705882; step 15: 16/25 * 3.705882 + 9/25 * 15 = 7.771765;
    # step 23: 24/33 * 7.771765 + 9/33 * 23 = 11.924920
    assert ema.shadow["w0"].item() == pytest.approx(11.924920, rel=1e-6)


def test_interval_counts_steps_itself():
    ps = params(0.0)
    ema = EMA(ps, 0.5, update_interval=3)
    set_to(ps, 1.0)
    assert [ema.update(ps) for _ in range(6)] == [False, True, False, False, True, False]  # steps 2 and 5
    assert ema.shadow["w0"].item() == pytest.approx(0.75)


def test_state_round_trip_with_counter():
    ps = params(0.0, 3.0)
    ema = EMA(ps, 0.9, update_interval=2, warmup=True)
    for step in range(1, 6):
        set_to(ps, float(step))
        ema.update(ps)
    state = ema.state_dict()
    assert state["optimizer_step"] == 5 and state["num_updates"] == 3  # steps 1, 3, 5
    fresh = EMA(params(0.0, 3.0), 0.9, update_interval=2, warmup=True)
    fresh.load_state_dict({k: v for k, v in state.items()}, ps)
    assert fresh.optimizer_step == 5 and fresh.num_updates == 3
    assert all(torch.equal(fresh.shadow[k], ema.shadow[k]) for k in ps)
    assert all(fresh.shadow[k].data_ptr() != ema.shadow[k].data_ptr() for k in ps)  # a copy, not an alias
    # both continue identically: the next update is at step 7 (counted from the restored 5)
    set_to(ps, 10.0)
    for e in (ema, fresh):
        assert [e.update(ps), e.update(ps)] == [False, True]
    assert all(torch.equal(fresh.shadow[k], ema.shadow[k]) for k in ps)


def test_old_state_without_counter_loads():
    ps = params(1.0)
    ema = EMA(ps, 0.9)
    ema.load_state_dict({"decay": 0.5, "shadow": {"w0": torch.tensor([2.0])}})
    assert ema.shadow["w0"].item() == 2.0 and ema.optimizer_step == 0 and ema.decay == 0.9  # configured decay kept


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_load_puts_shadows_on_the_params_device_and_dtype(dtype):
    ps = params(1.0, 2.0, dtype=dtype)
    ema = EMA(ps, 0.9)
    # a checkpoint as load_checkpoint returns it: float32 tensors on the CPU
    state = {"decay": 0.9, "optimizer_step": 4, "num_updates": 4,
             "shadow": {k: torch.tensor([5.0], dtype=torch.float32) for k in ps}}
    ema.load_state_dict(state, ps)
    kept = torch.float32 if dtype == torch.bfloat16 else dtype  # a half-precision weight averages in fp32
    for k, p in ps.items():
        assert ema.shadow[k].dtype == kept and ema.shadow[k].device == p.device
    other = EMA(ps, 0.9)
    other.load_state_dict(state)  # without params: the dtype/device the shadows were made with
    assert all(other.shadow[k].dtype == kept for k in ps)
    set_to(ps, 6.0)
    ema.update(ps)  # 0.9 * 5 + 0.1 * 6, in fp32 at least
    assert ema.shadow["w0"].dtype == kept and ema.shadow["w0"].item() == pytest.approx(5.1, rel=1e-6)


def test_a_half_precision_weight_is_averaged_in_fp32():
    """A bf16 weight (full fine-tuning in bf16, or DeepSpeed's bf16 engine, which casts the module before the EMA is
    built) averaged in bf16 loses the small steps: with decay 0.999 its average stalled, 56 % off the fp32 one."""
    ps = params(1.0, dtype=torch.bfloat16)
    ema = EMA(ps, 0.999)
    for step in range(1, 201):
        set_to(ps, 1.0 + step / 200)
        ema.update(ps)
    exact = 1.0
    for step in range(1, 201):
        exact += 0.001 * (float(torch.tensor(1.0 + step / 200, dtype=torch.bfloat16)) - exact)
    assert ema.shadow["w0"].dtype == torch.float32
    assert ema.shadow["w0"].item() == pytest.approx(exact, rel=1e-6) and ema.shadow["w0"].item() > 1.05
    with ema.swapped_in(ps):
        assert ps["w0"].dtype == torch.bfloat16  # the weights keep their own dtype


def test_mismatched_state_is_a_clear_error():
    ema = EMA(params(1.0), 0.9)
    with pytest.raises(ValueError, match="missing"):
        ema.load_state_dict({"shadow": {"other": torch.tensor([1.0])}})
    with pytest.raises(ValueError, match="shape"):
        ema.load_state_dict({"shadow": {"w0": torch.zeros(3)}})
    with pytest.raises(ValueError, match="update_interval"):
        EMA(params(1.0), 0.9, update_interval=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_moves_cpu_shadows_to_the_gpu():
    ps = {k: torch.nn.Parameter(p.detach().cuda()) for k, p in params(1.0, 2.0).items()}
    ema = EMA(ps, 0.9)
    ema.load_state_dict({"shadow": {k: torch.tensor([3.0]) for k in ps}}, ps)
    assert all(s.is_cuda for s in ema.shadow.values())
    ema.update(ps)
    assert ema.shadow["w0"].item() == pytest.approx(0.9 * 3 + 0.1 * 1)
