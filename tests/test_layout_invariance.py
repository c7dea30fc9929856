"""Layout invariance: equivalent layouts of one update give the same loss, gradients and updated weights.

Chunking the trained steps (``train.timestep_chunk``), splitting a minibatch into accumulated micro-batches,
the sampling and reward batch sizes and overlapped scoring are memory / speed knobs only. Each test runs one
update of a real Trainer per layout (fp32, CPU) and compares the logged loss, the gradient norm, the gradient
of every optimizer step and the weights after the update, to 1e-5 relative. The process-count test is in
test_layout_processes.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layout import assert_same_update, one_update, vary_completion_lengths
from fixtures import TINY_RECIPE
from mmrl.config import load_config
from mmrl.pipelines.flow.tiny import build_tiny_sd3

REPO = Path(__file__).parents[1]

# optim.adam_eps=1e-3, above every gradient element here: Adam's step g / (sqrt(v) + eps) is then close to g / eps,
# so the updated weights inherit the gradients' 1e-6 agreement. At the default 1e-8, elements whose gradient is near
# 1e-8 (a few of them, at float32's noise floor of the sum) have their step set by that noise: 1.2e-5 relative on the
# weights on an AVX-512 CPU, from gradients that agree to 4e-6 (measured 2026-12-06).
FLOW = ["sampling.num_steps=4", "sampling.eval_num_steps=4", "sampling.max_sequence_length=16",
        "data.prompts_per_step=2", "data.group_size=4", "train.batch_size=4", "train.gradient_accumulation_steps=1",
        "train.inner_epochs=2", "logging.progress_bar=false", "logging.tensorboard=false", "logging.eval_every=0",
        "optim.lr=1e-2", "optim.adam_eps=1e-3", "optim.max_grad_norm=0", "algorithm.clip_low=0.2",
        "train.overlap_scoring=false"]


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    return str(build_tiny_sd3(tmp_path_factory.mktemp("tiny") / "sd3"))


def flow_update(tmp_path, tiny_sd3, *overrides):
    config = load_config(TINY_RECIPE, [f"output_dir={tmp_path}", f"model.pretrained={tiny_sd3}", *FLOW, *overrides])
    return one_update(config)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("aggregation", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_flow_timestep_chunk_is_a_memory_knob(tmp_path, tiny_sd3, aggregation, ratio_level):
    """3 trained steps in one forward, in chunks of 2 + 1, and one per forward: the same update (KL included)."""
    common = [f"algorithm.aggregation={aggregation}", f"algorithm.ratio_level={ratio_level}", "algorithm.beta=0.04"]
    whole = flow_update(tmp_path / "a", tiny_sd3, *common, "train.timestep_chunk=0")
    for chunk in (2, 1):
        assert_same_update(flow_update(tmp_path / f"c{chunk}", tiny_sd3, *common, f"train.timestep_chunk={chunk}"),
                           whole)
    assert whole[0]["kl"] > 0  # the second inner epoch moved off the reference: the KL term is compared too


@pytest.mark.parametrize("aggregation", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_flow_accumulation_split_is_a_memory_knob(tmp_path, tiny_sd3, aggregation):
    """8 samples per optimizer step as one minibatch, 2 x 4 accumulated, or 4 x 2 accumulated."""
    common = ["data.group_size=8", f"algorithm.aggregation={aggregation}"]
    whole = flow_update(tmp_path / "a", tiny_sd3, *common, "train.batch_size=8", "train.gradient_accumulation_steps=1")
    for batch, ga in ((4, 2), (2, 4)):
        assert_same_update(flow_update(tmp_path / f"b{batch}", tiny_sd3, *common, f"train.batch_size={batch}",
                                       f"train.gradient_accumulation_steps={ga}"), whole)


def test_flow_sampling_and_reward_batches_and_overlap_are_speed_knobs(tmp_path, tiny_sd3):
    base = flow_update(tmp_path / "a", tiny_sd3, "train.sample_batch_size=8", "train.reward_batch_size=8")
    for i, extra in enumerate([("train.sample_batch_size=3", "train.reward_batch_size=5"),
                               ("train.sample_batch_size=2", "train.reward_batch_size=3", "train.overlap_scoring=true"),
                               ("train.sample_batch_size=8", "train.reward_batch_size=32",
                                "train.overlap_scoring=true")]):
        assert_same_update(flow_update(tmp_path / f"s{i}", tiny_sd3, *extra), base)


# ------------------------------------------------------------------------------------------------ VLM


VLM = [str(REPO / "configs/tiny/vlm_grounding.yaml"), "logging.progress_bar=false", "logging.tensorboard=false",
       "logging.eval_every=0", "generation.max_new_tokens=12", "rewards={test_short_completion: 1.0}",
       "optim.max_grad_norm=0", "optim.lr=1e-2", "train.inner_epochs=2", "algorithm.beta=0.04"]


@pytest.fixture()
def vlm_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MMRL_CACHE", str(tmp_path_factory.getbasetemp() / "mmrl-cache"))


def vlm_update(tmp_path, *overrides):
    config = load_config(VLM[0], [f"output_dir={tmp_path}", *VLM[1:], *overrides])
    return one_update(config, prepare=vary_completion_lengths)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("aggregation", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_vlm_token_chunk_and_accumulation_are_memory_knobs(tmp_path, vlm_cache, aggregation, ratio_level):
    """Completions of different lengths: chunks of 5 tokens and 2 x 4 accumulated give the 8-sample update."""
    common = [f"algorithm.aggregation={aggregation}", f"algorithm.ratio_level={ratio_level}"]
    whole = vlm_update(tmp_path / "a", *common, "train.batch_size=8", "train.gradient_accumulation_steps=1")
    assert whole[0]["completions/mean_length"] < 12  # lengths vary: the masks differ between samples
    assert_same_update(vlm_update(tmp_path / "c", *common, "train.batch_size=8", "train.timestep_chunk=5"), whole)
    assert_same_update(vlm_update(tmp_path / "g", *common, "train.batch_size=4", "train.gradient_accumulation_steps=2",
                                  "train.timestep_chunk=3"), whole)


def test_vlm_kl_bias_correction_changes_the_update_and_keeps_the_layout_knobs(tmp_path, vlm_cache):
    """``algorithm.kl_bias_correction`` (TRL 1.16's ``use_bias_correction_kl``) weights the KL by the ratio: with
    beta 0.04 and two inner epochs (the second epoch's policy is off the reference) it changes the gradient, and
    token chunks and accumulation still give the same update."""
    common = ["algorithm.kl_bias_correction=true", "train.batch_size=8"]
    whole = vlm_update(tmp_path / "a", *common, "train.gradient_accumulation_steps=1")
    plain = vlm_update(tmp_path / "p", "train.batch_size=8", "train.gradient_accumulation_steps=1")
    assert whole[1][0].equal(plain[1][0])  # first step: policy == reference, KL and its gradient are 0 either way
    assert (whole[1][1] - plain[1][1]).norm() > 1e-4 * plain[1][1].norm()  # second epoch: the ratio weights the KL
    assert_same_update(vlm_update(tmp_path / "c", *common, "train.timestep_chunk=5"), whole)
    assert_same_update(vlm_update(tmp_path / "g", "algorithm.kl_bias_correction=true", "train.batch_size=4",
                                  "train.gradient_accumulation_steps=2", "train.timestep_chunk=3"), whole)


def test_vlm_delta_two_sided_clipping_changes_the_update_and_keeps_the_layout_knobs(tmp_path, vlm_cache):
    """``algorithm.delta`` (TRL's two-sided clipping) caps the unclipped ratio: with a clip range of 0.01 and delta
    1.02, the second inner epoch (ratios off 1 at lr 1e-2) gets another gradient than without it, and token chunks
    and accumulation still give the same update."""
    common = ["algorithm.clip_low=0.01", "algorithm.clip_high=0.01", "algorithm.aggregation=bnpo", "train.batch_size=8"]
    whole = vlm_update(tmp_path / "a", *common, "algorithm.delta=1.02", "train.gradient_accumulation_steps=1")
    plain = vlm_update(tmp_path / "p", *common, "train.gradient_accumulation_steps=1")
    assert whole[1][0].equal(plain[1][0])  # first step: every ratio is 1, below delta
    assert (whole[1][1] - plain[1][1]).norm() > 1e-4 * plain[1][1].norm()  # second epoch: capped tokens drop out
    assert_same_update(vlm_update(tmp_path / "c", *common, "algorithm.delta=1.02", "train.timestep_chunk=5"), whole)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_vlm_first_optimizer_step_reads_old_logprobs_from_its_live_forward(tmp_path, vlm_cache, monkeypatch,
                                                                           ratio_level):
    """Two inner epochs in minibatches of 2: the first optimizer step's samples still see the sampling policy, so
    (no dropout) their old log-probs are their live ones, detached, and the no-grad pass skips them; the update is
    bit for bit the one with the full pass (the policy made to report a stochastic training forward)."""
    from mmrl.pipelines.vlm.qwen import QwenVLPolicy

    rows = []
    original = QwenVLPolicy.logprobs

    def counting(self, rollout, index, *args, **kwargs):
        if not torch.is_grad_enabled():
            rows.append(len(index))
        return original(self, rollout, index, *args, **kwargs)

    monkeypatch.setattr(QwenVLPolicy, "logprobs", counting)
    common = [f"algorithm.ratio_level={ratio_level}", "train.batch_size=2", "train.gradient_accumulation_steps=1",
              "train.timestep_chunk=5"]
    live = vlm_update(tmp_path / "live", *common)
    chunks = 3  # 12 new tokens in chunks of 5
    skipped_pass = sum(rows)
    monkeypatch.setattr(QwenVLPolicy, "deterministic_training_forward", property(lambda self: False))
    rows.clear()
    full = vlm_update(tmp_path / "full", *common)
    # the first minibatch's old log-probs (and, per sequence, its whole-trajectory ratio): no separate forwards
    assert sum(rows) - skipped_pass == 2 * chunks * (2 if ratio_level == "sequence" else 1)
    assert len(live[1]) == len(full[1]) >= 4
    for a, b in zip(live[1], full[1]):
        assert torch.equal(a, b)
    assert torch.equal(live[2], full[2]) and live[0]["loss"] == full[0]["loss"]


# ------------------------------------------------------------------------------------------------ minibatch order


def _order(order: str, group_ids: torch.Tensor, shares_prompts: bool, seed: int = 0) -> torch.Tensor:
    from types import SimpleNamespace

    from mmrl.trainer import minibatch_order, resolve_minibatch_order

    resolved = resolve_minibatch_order(order, SimpleNamespace(share_prompt_prefix=shares_prompts))
    return minibatch_order(group_ids, resolved, torch.Generator().manual_seed(seed))


def test_minibatch_order_keeps_groups_together_where_prompts_are_shared():
    """'samples' is the seeded permutation of every sample (TRL, Flow-GRPO; the flow default); 'groups' a seeded
    permutation of whole groups, each group's samples in their stored order (the VLM default, 'auto' with
    share_prompt_prefix), so minibatches of the group size each hold one prompt."""
    group_ids = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3, 9, 9, 9, 9])  # any labels, as after dynamic-sampling refills
    expected = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    assert torch.equal(_order("samples", group_ids, True), expected)
    assert torch.equal(_order("auto", group_ids, False), expected)  # flows: unchanged
    seen = set()
    for seed in range(12):
        order = _order("auto", group_ids, True, seed)
        assert torch.equal(order, _order("groups", group_ids, False, seed))
        assert sorted(order.tolist()) == list(range(12))
        blocks = [order[i:i + 4] for i in range(0, 12, 4)]
        assert all(len(set(group_ids[b].tolist())) == 1 for b in blocks)
        assert all(torch.equal(b, b.sort().values) for b in blocks)  # stored order within a group
        seen.add(tuple(int(group_ids[b[0]]) for b in blocks))
    assert len(seen) > 3  # the group order is shuffled, not fixed
    with pytest.raises(Exception, match="minibatch_order"):
        load_config(VLM[0], ["train.minibatch_order=prompts"])


def test_vlm_minibatch_order_is_a_layout_knob_for_one_optimizer_step(tmp_path, vlm_cache):
    """One optimizer step per update (two accumulated minibatches): sample or group order gives the same update."""
    common = ["train.inner_epochs=1", "train.batch_size=4", "train.gradient_accumulation_steps=2"]
    assert_same_update(vlm_update(tmp_path / "g", *common, "train.minibatch_order=groups"),
                       vlm_update(tmp_path / "s", *common, "train.minibatch_order=samples"))


def test_vlm_group_order_runs_each_minibatchs_prompt_once(tmp_path, vlm_cache, monkeypatch):
    """Minibatches of one group's size: in group order every gradient forward of the language model sees one prompt
    row (the shared prefix), in sample order some see both prompts of the update."""
    from mmrl.pipelines.vlm.qwen import QwenVLPolicy

    prompt_rows = {}
    original = QwenVLPolicy._prefix_shared_logits

    def spy(self, model, rollout, index, *args, **kwargs):
        if torch.is_grad_enabled():
            prompt_rows[order].append(len(torch.unique(rollout.prompt_index[index])))
        return original(self, model, rollout, index, *args, **kwargs)

    monkeypatch.setattr(QwenVLPolicy, "_prefix_shared_logits", spy)
    for order in ("groups", "samples"):
        prompt_rows[order] = []
        vlm_update(tmp_path / order, "train.batch_size=4", "train.gradient_accumulation_steps=1",
                   f"train.minibatch_order={order}", "algorithm.beta=0.0")
    assert prompt_rows["groups"] == [1, 1, 1, 1]  # 2 groups of 4, two inner epochs
    assert len(prompt_rows["samples"]) == 4 and max(prompt_rows["samples"]) == 2
