"""benchmarks/memory_estimate.py: the live-bytes tracker, the flash-attention routing and the presets' rules.

The estimates themselves are not asserted against a GPU (none here; ``benchmarks/gpu_check.sh`` measures it): these
tests check that the tracker counts what is allocated, that attention is counted as a flash kernel keeps it, that
the memory knobs move the estimate the way they must, and that a preset never changes the update."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import memory_estimate as me  # noqa: E402


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_live_bytes_counts_each_storage_once_from_creation_to_free(device):
    held = torch.empty(10, device=device)
    tracker = me.LiveBytes([held])  # 40 bytes held from before
    assert tracker.current == 40
    gone = me.LiveBytes([torch.empty(10, device=device)])
    assert gone.current == 0  # the list held the tensor only during the call: freed, uncounted
    with tracker:
        a = torch.zeros(1000, device=device)  # 4000
        view = a.view(10, 100)  # no new storage
        b = torch.zeros(500, dtype=torch.float16, device=device)  # 1000
        assert tracker.current == 5040 and view.shape == (10, 100)
        del b
        assert tracker.current == 4040
        c = a * 2  # 4000 more: 8040 at the peak
        del a, view, c
    assert tracker.current == 40 and tracker.peak == 8040
    del held
    assert tracker.current == 0


def test_flash_routing_computes_attention_and_keeps_no_square_matrix():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 64, 16)
    k, v = torch.randn(2, 2, 64, 16), torch.randn(2, 2, 64, 16)  # grouped-query: 2 key/value heads for 4
    for kwargs in ({}, {"is_causal": True}):
        expected = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                                                    v.repeat_interleave(2, 1), **kwargs)
        torch.testing.assert_close(me._flash_sdpa(q, k, v, enable_gqa=True, **kwargs), expected, atol=1e-5, rtol=0)

    def held(route: bool) -> int:  # what the forward leaves for backward at L = 1024 (meta: no arithmetic)
        x = torch.randn(1, 8, 1024, 64, device="meta", requires_grad=True)
        tracker = me.LiveBytes()
        with tracker:
            with me.flash_attention() if route else contextlib.nullcontext():
                out = torch.nn.functional.scaled_dot_product_attention(x, x, x)
            return tracker.current if out.requires_grad else 0

    square = 8 * 1024 * 1024 * 4  # one fp32 8-head 1024 x 1024 attention matrix
    assert held(True) < square / 4  # output + log-sum-exp: linear in L
    assert held(False) >= square  # what the math backend keeps (and a GPU's flash kernel does not)


def test_presets_keep_the_samples_of_an_optimizer_step():
    from mmrl.config import load_config

    config = load_config(me.ROOT / "configs/gpu/sd35m_flow_grpo_pickscore.yaml", check_files=False)
    per_step = config.train.batch_size * config.train.gradient_accumulation_steps
    for preset in me.PRESETS["flow"] + me.PRESETS["vlm"]:
        overrides = me.preset_overrides(config, preset)
        if overrides is None:
            continue
        changed = load_config(me.ROOT / "configs/gpu/sd35m_flow_grpo_pickscore.yaml", overrides, check_files=False)
        assert changed.train.batch_size * changed.train.gradient_accumulation_steps == per_step, overrides
    assert me.preset_overrides(config, {"batch_size": 5}) is None  # 72 samples per step: 5 does not divide them
    assert me.preset_overrides(config, {"batch_size": 9}) is None  # not smaller than the recipe's


def test_the_memory_knobs_move_the_flow_estimate_as_they_must():
    shipped = me.estimate("sd35m_flow_grpo_fast", [], 450)
    checkpointed = me.estimate("sd35m_flow_grpo_fast", ["model.gradient_checkpointing=true"], 450)
    rows = shipped["shapes"]["training_rows"]
    assert shipped["shapes"]["image_tokens"] == 1024 and shipped["shapes"]["text_tokens"] == 77 + 128
    # the resident weights alone: SD3.5-M 2.24B + T5-XXL 4.63B + CLIP-L/G + VAE in bf16 (about 14.5 GiB) + the
    # CLIP-H reward (0.99B) in the fp32 the recipe loads it in (3.7 GiB)
    assert 17.5 < shipped["resident_weights_gib"] < 19.5
    bf16_reward = me.estimate("sd35m_flow_grpo_fast", ["rewards.pickscore.kwargs.dtype=bfloat16"], 450)
    assert shipped["resident_weights_gib"] - bf16_reward["resident_weights_gib"] == pytest.approx(1.84, abs=0.05)
    assert shipped["training_gib"] > shipped["resident_weights_gib"] + rows  # > 1 GiB of activations per 512 px row
    assert checkpointed["training_gib"] < shipped["resident_weights_gib"] + (shipped["training_gib"]
                                                                           - shipped["resident_weights_gib"]) / 3
    assert checkpointed["rollout_gib"] == shipped["rollout_gib"]  # sampling keeps nothing for backward either way
    smaller = me.estimate("sd35m_flow_grpo_fast", ["train.sample_batch_size=2"], 450)
    assert smaller["rollout_gib"] < shipped["rollout_gib"] and smaller["training_gib"] == shipped["training_gib"]


def test_full_fine_tuning_holds_fp32_weights_gradients_and_two_adam_moments():
    full = me.estimate("qwen25vl3b_rec_grpo", ["model.gradient_checkpointing=true"], 450)
    lora = me.estimate("qwen25vl3b_rec_grpo", ["model.gradient_checkpointing=true", "model.use_lora=true"], 450)
    language = 3.09e9  # Qwen2.5-VL-3B's language model (embeddings tied), trained; the 0.67B vision tower frozen
    # fp32 weights + gradients + 2 moments = 16 bytes per trained weight, at the optimizer step
    assert full["training_gib"] > 16 * language / 2 ** 30
    assert lora["training_gib"] < full["training_gib"] / 3
    assert full["shapes"]["sequence_tokens"] == 450 + 256 and full["shapes"]["rollout_rows"] == 16


def test_flux_has_no_cfg_half_and_sharding_divides_the_trained_state():
    one = me.estimate("flux_dance_grpo_hps", [])
    assert one["shapes"]["training_rows"] == 4  # batch 4 x one step per forward, guidance is an input
    assert one["shapes"]["image_tokens"] == 45 * 45 and one["shapes"]["text_tokens"] == 512
    assert 11.5e9 < one["trained_parameters"] < 12.5e9  # FLUX.1-dev's transformer, trained whole
    assert one["trainable_state_gib"] == round(16 * one["trained_parameters"] / 2 ** 30, 1)
    peaks = [me.sharded_peak(one, n) for n in (1, 2, 4, 8)]
    assert peaks[0] == one["peak_gib"] and peaks == sorted(peaks, reverse=True)
    # the whole fp32 weights gathered for the rollout stay on every process however many there are
    assert me.sharded_peak(one, 1024) > 4 * one["trained_parameters"] / 2 ** 30


def test_a_users_own_config_is_estimated_for_the_model_named(tmp_path):
    import json

    mine = tmp_path / "mine.yaml"
    mine.write_text((me.ROOT / "configs/gpu/sd35m_flow_grpo_fast.yaml").read_text())
    out = tmp_path / "estimate.json"
    assert me.main(["--config", str(mine), "--model", "sd35m", "--cards", "141", "--set", "train.batch_size=3",
                    "train.gradient_accumulation_steps=24", "--out", str(out)]) == 0
    (line,) = json.loads(out.read_text())["recipes"]
    assert line["recipe"] == "mine" and line["shipped"]["shapes"]["training_rows"] == 3  # the --set applied
    assert line["presets"]["141GB"]["one_process"]["overrides"] == ["train.batch_size=3",
                                                                    "train.gradient_accumulation_steps=24"]
    with pytest.raises(SystemExit):
        me.main(["--config", str(mine)])  # which model it is for must be said
