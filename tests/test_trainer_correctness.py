"""What the loop optimises is what the config says: accumulation, fp16 scaler skips, advantage groups, GDPO,
the dr_grpo constant, overlapped scoring batches, per-sampling-batch TP-GRPO balancing."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch

from layout import assert_same_update, one_update
from fixtures import TINY_RECIPE
from mmrl import trainer as trainer_module
from mmrl.build import build_accelerator, build_policy, build_reward_fn, build_source, build_trainer
from mmrl.config import ConfigError, load_config
from mmrl.core.advantages import group_advantages
from mmrl.pipelines.flow.tiny import build_tiny_sd3
from mmrl.rewards import register_reward
from mmrl.trainer import Trainer

REPO = Path(__file__).parents[1]
FLOW = ["sampling.num_steps=4", "sampling.eval_num_steps=4", "sampling.max_sequence_length=16",
        "data.prompts_per_step=2", "data.group_size=4", "train.batch_size=4", "train.gradient_accumulation_steps=1",
        "logging.progress_bar=false", "logging.tensorboard=false", "logging.eval_every=0", "optim.lr=1e-2",
        "train.overlap_scoring=false"]


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    return str(build_tiny_sd3(tmp_path_factory.mktemp("tiny") / "sd3"))


@pytest.fixture()
def vlm_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MMRL_CACHE", str(tmp_path_factory.getbasetemp() / "mmrl-cache"))


def flow_config(tmp_path, tiny_sd3, *overrides):
    return load_config(TINY_RECIPE, [f"output_dir={tmp_path}", f"model.pretrained={tiny_sd3}", *FLOW, *overrides])


def spy_policy_loss(monkeypatch) -> list[dict]:
    calls: list[dict] = []
    original = trainer_module.policy_loss

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "policy_loss", spy)
    return calls


# ------------------------------------------------------------------------------- gradient accumulation


def test_accumulation_longer_than_the_update_accumulates_what_there_is(tmp_path, tiny_sd3, caplog):
    """GA 8 over 2 minibatches is GA 2 (before, the loss was divided by 8: a quarter of the gradient), warned."""
    with caplog.at_level("WARNING", logger="mmrl.trainer"):
        longer = one_update(flow_config(tmp_path / "a", tiny_sd3, "train.gradient_accumulation_steps=8"))
    assert "gradient_accumulation_steps=8 is more than the 2 minibatches" in caplog.text
    assert_same_update(longer, one_update(flow_config(tmp_path / "b", tiny_sd3, "train.gradient_accumulation_steps=2")))


def test_uneven_accumulation_tail_is_a_mean_over_its_own_minibatches(tmp_path, tiny_sd3, monkeypatch):
    """3 minibatches with GA 2: steps of 2 and 1 minibatches, each a mean over the minibatches it really holds."""
    calls = spy_policy_loss(monkeypatch)
    metrics, grads, _ = one_update(flow_config(tmp_path, tiny_sd3, "data.group_size=6",
                                               "train.gradient_accumulation_steps=2"))
    assert [c["gradient_accumulation_steps"] for c in calls] == [2, 2, 1] * 2  # 2 inner epochs
    assert len(grads) == 4 and metrics["optimizer_steps"] == 4


def test_lr_schedule_counts_the_optimizer_steps_really_taken(tmp_path, tiny_sd3):
    trainer = build_trainer(flow_config(tmp_path, tiny_sd3, "data.group_size=6", "train.gradient_accumulation_steps=2",
                                        "train.inner_epochs=2", "train.steps=3", "optim.lr_scheduler=linear"))
    trainer.train()
    assert trainer.optimizer_steps == 3 * 2 * 2  # ceil(3 / 2) steps per epoch
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)  # the schedule ends at its end


def test_adamw_is_fused_and_steps_as_torchs_default_adamw(tmp_path, tiny_sd3):
    """The loop's AdamW runs torch's fused kernel on CPU / CUDA; its steps move the weights as the default AdamW
    with the same settings does, to float rounding."""
    trainer = build_trainer(flow_config(tmp_path, tiny_sd3, "optim.weight_decay=0.01"))
    assert trainer.optimizer.param_groups[0]["fused"] is True
    params = trainer.policy.trainable_parameters()
    start = [p.detach().clone() for p in params]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    group = trainer.optimizer.param_groups[0]
    default = torch.optim.AdamW(twins, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                weight_decay=group["weight_decay"])
    assert not default.param_groups[0]["fused"]
    for step in range(3):
        for i, (p, q) in enumerate(zip(params, twins)):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(step * 1000 + i))
            p.grad, q.grad = g.clone(), g.clone()
        trainer.optimizer.step()
        default.step()
    moved = torch.cat([(q.detach() - s0).flatten() for q, s0 in zip(twins, start)]).abs().max()
    apart = torch.cat([(p.detach() - q.detach()).flatten() for p, q in zip(params, twins)]).abs().max()
    assert moved > 0.5 * group["lr"]  # three Adam steps of about lr each
    assert apart <= 1e-3 * moved, (float(apart), float(moved))


# ------------------------------------------------------------------------------------- fp16 scaler


def test_fp16_overflow_lets_the_scaler_skip_and_lower_its_scale(tmp_path, tiny_sd3):
    """A non-finite gradient under a GradScaler: the scaler skips that step and halves its scale, the skip is
    counted, and training goes on (before, the loop skipped optimizer.step(), so the next unscale_ raised)."""
    config = flow_config(tmp_path, tiny_sd3, "train.steps=2", "data.group_size=4", "train.batch_size=2",
                         "train.gradient_accumulation_steps=1")
    accelerator = build_accelerator(config)
    accelerator.native_amp = True  # accelerate makes a scaler on accelerators only: give it one on CPU
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    accelerator.autocast = lambda *a, **k: contextlib.nullcontext()  # the scaler path is under test, not fp16 math
    policy = build_policy(config)
    trainer = Trainer(config, policy, build_reward_fn(config), build_source(config), accelerator)
    param = policy.trainable_parameters()[-1]
    poisoned = {"left": 1}

    def overflow(grad):
        if poisoned["left"]:
            poisoned["left"] -= 1
            return grad * float("inf")
        return grad

    param.register_hook(overflow)
    assert not trainer.optimizer.param_groups[0]["fused"]  # the scaler must see (and count) a skipped step
    before = {k: v.detach().clone() for k, v in policy.named_trainable_parameters().items()}
    first = trainer.step()
    assert first["train/skipped_optimizer_steps"] == 1.0
    assert accelerator.scaler.get_scale() == 512.0  # backed off once
    assert trainer.optimizer_steps == 7  # 4 minibatches x 2 inner epochs, one skipped
    second = trainer.step()
    assert second["train/skipped_optimizer_steps"] == 0.0 and trainer.optimizer_steps == 15
    after = policy.named_trainable_parameters()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(p).all() for p in after.values())


# ------------------------------------------------------------------------------------ advantage groups


def test_vlm_groups_are_samples_not_question_texts(tmp_path, vlm_cache, monkeypatch):
    """tiny:grounding shares each question among many images: two samples with one question and different
    images are two groups (before, per_prompt_stat_tracking merged them by question text)."""
    config = load_config(REPO / "configs/tiny/vlm_grounding.yaml",
                         [f"output_dir={tmp_path}", "logging.progress_bar=false", "logging.tensorboard=false",
                          "generation.max_new_tokens=8", "rewards={test_groups_length: 1.0}", "data.prompts_per_step=2",
                          "data.group_size=4"])
    trainer = build_trainer(config)
    samples = trainer.prompts.items
    by_question: dict[str, list] = {}
    for sample in samples:
        by_question.setdefault(sample.question, []).append(sample)
    pair = next(v[:2] for v in by_question.values() if len(v) >= 2)
    assert pair[0].question == pair[1].question and pair[0].metadata["id"] != pair[1].metadata["id"]
    monkeypatch.setattr(trainer.prompts, "next_batch", lambda *a, **k: list(pair))
    items = trainer.prompts.next_batch(2)
    rollout, scores = trainer._sample(items, torch.Generator().manual_seed(0), {"rollout": 0.0, "reward": 0.0})
    assert rollout.prompts[0] == rollout.prompts[-1]  # one question text for all 8 samples
    advantages, _ = trainer._advantages(rollout, scores)
    expected = group_advantages(scores["test_groups_length"], rollout.group_ids, scale="group", eps=1e-4, std_ddof=1)
    merged = group_advantages(scores["test_groups_length"], rollout.prompts, scale="group", eps=1e-4, std_ddof=1)
    assert torch.allclose(advantages, expected)
    assert not torch.allclose(expected, merged)  # the check can tell the two groupings apart


@register_reward("test_groups_length")
class GroupsLength:
    """Test reward whose group means differ: the completion length plus 10 for the first data sample."""

    name = "test_groups_length"
    needs_prompts = True

    def __init__(self):
        self.last_info = {}
        self.first = None

    def __call__(self, completions, prompts=None, metadata=None):
        ids = [m.get("id") for m in metadata]
        self.first = self.first or ids[0]
        return {self.name: torch.tensor([float(len(c)) + (10.0 if i == self.first else 0.0)
                                         for c, i in zip(completions, ids)])}


def test_gdpo_batch_normalises_the_summed_advantages(tmp_path, tiny_sd3):
    config = flow_config(tmp_path, tiny_sd3, "rewards={brightness: 1.0, saturation: 0.5}",
                         "algorithm.reward_combination=normalize_then_sum", "algorithm.batch_normalize_sum=true",
                         "algorithm.scale=group", "algorithm.advantage_clamp=null")
    trainer = build_trainer(config)
    items = trainer.prompts.next_batch(2)
    rollout, scores = trainer._sample(items, torch.Generator().manual_seed(0), {"rollout": 0.0, "reward": 0.0})
    advantages, _ = trainer._advantages(rollout, scores)
    a = config.algorithm
    pre = sum(w * group_advantages(scores[k], rollout.prompts, scale="group", eps=a.eps, std_ddof=a.std_ddof)
              for k, w in (("brightness", 1.0), ("saturation", 0.5)))
    expected = (pre - pre.mean()) / (pre.std(unbiased=True) + a.eps)
    assert torch.allclose(advantages, expected, atol=1e-6)
    assert advantages.std().item() == pytest.approx(1.0, abs=1e-3)
    with pytest.raises(ConfigError, match="batch_normalize_sum"):
        flow_config(tmp_path, tiny_sd3, "algorithm.batch_normalize_sum=true")


def test_clamp_summed_advantage_clamps_the_sum_not_each_reward(tmp_path, tiny_sd3):
    common = ["rewards={brightness: 1.0, saturation: 0.5}", "algorithm.reward_combination=normalize_then_sum",
              "algorithm.scale=group", "algorithm.advantage_clamp=0.5"]
    got = {}
    for on in (False, True):
        config = flow_config(tmp_path / str(on), tiny_sd3, *common, f"algorithm.clamp_summed_advantage={str(on).lower()}")
        trainer = build_trainer(config)
        items = trainer.prompts.next_batch(2)
        rollout, scores = trainer._sample(items, torch.Generator().manual_seed(0), {"rollout": 0.0, "reward": 0.0})
        got[on], _ = trainer._advantages(rollout, scores)
        a = config.algorithm
        parts = [w * group_advantages(scores[k], rollout.prompts, scale="group", eps=a.eps, std_ddof=a.std_ddof,
                                      clamp=None if on else 0.5) for k, w in (("brightness", 1.0), ("saturation", 0.5))]
        want = sum(parts).clamp(-0.5, 0.5) if on else sum(parts)
        assert torch.allclose(got[on], want, atol=1e-6)
    assert got[True].abs().max().item() <= 0.5 < got[False].abs().max().item()  # the clamp binds differently
    with pytest.raises(ConfigError, match="clamp_summed_advantage"):
        flow_config(tmp_path, tiny_sd3, "algorithm.clamp_summed_advantage=true")


# -------------------------------------------------------------------------------------- dr_grpo constant


def test_vlm_dr_grpo_divides_by_max_new_tokens(tmp_path, vlm_cache, monkeypatch):
    calls = spy_policy_loss(monkeypatch)
    config = load_config(REPO / "configs/tiny/vlm_grounding.yaml",
                         [f"output_dir={tmp_path}", "logging.progress_bar=false", "logging.tensorboard=false",
                          "generation.max_new_tokens=9", "rewards={test_groups_length: 1.0}",
                          "algorithm.aggregation=dr_grpo"])
    one_update(config)
    assert calls and all(c["max_length"] == 9 for c in calls)


def test_flow_dr_grpo_divides_by_the_trained_step_count(tmp_path, tiny_sd3, monkeypatch):
    calls = spy_policy_loss(monkeypatch)
    one_update(flow_config(tmp_path, tiny_sd3, "algorithm.aggregation=dr_grpo", "train.timestep_chunk=1"))
    assert calls and all(c["max_length"] == 3 for c in calls)  # 4 steps, the last never trained


# ------------------------------------------------------------------------------ overlapped scoring batches


@register_reward("test_batch_sizes")
class BatchSizes:
    """Test reward: brightness, recording the size of every call."""

    name = "test_batch_sizes"
    needs_prompts = False
    sizes: list[int] = []

    def __init__(self):
        self.last_info = {}

    def __call__(self, images, prompts=None, metadata=None):
        BatchSizes.sizes.append(len(images))
        return {self.name: images.float().mean(dim=(1, 2, 3))}


@pytest.mark.parametrize("overlap", [False, True])
def test_reward_batch_size_holds_with_and_without_overlapped_scoring(tmp_path, tiny_sd3, overlap):
    """8 images sampled in chunks of 3 are scored in calls of 5 + 3 either way (before, overlapped scoring called
    the reward once per sampling chunk whatever reward_batch_size said)."""
    BatchSizes.sizes = []
    config = flow_config(tmp_path, tiny_sd3, "rewards={test_batch_sizes: 1.0}", "train.sample_batch_size=3",
                         "train.reward_batch_size=5", f"train.overlap_scoring={str(overlap).lower()}")
    trainer = build_trainer(config)
    assert (trainer.scorer is not None) == overlap
    trainer._sample(trainer.prompts.next_batch(2), torch.Generator().manual_seed(0), {"rollout": 0.0, "reward": 0.0})
    assert BatchSizes.sizes == [5, 3]


# ------------------------------------------------------------------------- TP-GRPO balancing, VGPO anchors


def test_turning_point_balancing_runs_within_each_sampling_batch(tmp_path, tiny_sd3, monkeypatch):
    """TP-GRPO balances turning points within one sampling batch (the anchor's per-device sampling batch), not
    over the whole rollout: the trainer labels rows by their sampling batch of train.sample_batch_size."""
    seen = []
    from mmrl.algorithms import turning_point as tp_module

    original = tp_module.turning_point_credit

    def spy(step_rewards, **kwargs):
        seen.append(kwargs.get("group_ids"))
        return original(step_rewards, **kwargs)

    monkeypatch.setattr(tp_module, "turning_point_credit", spy)
    config = load_config(REPO / "configs/tiny/tp_grpo.yaml",
                         [f"output_dir={tmp_path}", f"model.pretrained={tiny_sd3}", "sampling.num_steps=4",
                          "sampling.window_size=3", "sampling.max_sequence_length=16", "data.prompts_per_step=2",
                          "data.group_size=4", "train.batch_size=4", "train.sample_batch_size=3",
                          "algorithm.variants=[{name: turning_point, balance: true}]", "logging.eval_every=0", "logging.progress_bar=false",
                          "logging.tensorboard=false"])
    one_update(config)
    assert len(seen) == 1 and seen[0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]


def test_vlm_value_anchors_are_keyed_by_sample(tmp_path, vlm_cache):
    config = load_config(REPO / "configs/tiny/vlm_grounding.yaml",
                         [f"output_dir={tmp_path}", "logging.progress_bar=false", "logging.tensorboard=false",
                          "generation.max_new_tokens=6", "rewards={test_groups_length: 1.0}",
                          "algorithm.variants=[{name: vgpo, weight: 0.5}]", "algorithm.scale=group"])
    trainer = build_trainer(config)
    items = trainer.prompts.next_batch(2)
    rollout, scores = trainer._sample(items, torch.Generator().manual_seed(0), {"rollout": 0.0, "reward": 0.0})
    trainer._advantages(rollout, scores)
    assert sorted(trainer.variants[0].anchors) == sorted(f"sample:{item.metadata['id']}" for item in items)


def test_negative_prompt_is_rejected_where_nothing_would_use_it(tmp_path, tiny_sd3):
    with pytest.raises(ConfigError, match="guidance-distilled"):
        load_config(TINY_RECIPE, ["model.family=flux", "model.pretrained=tiny:flux", "sampling.negative_prompt=blurry"])
    with pytest.raises(ConfigError, match="classifier-free guidance only"):
        flow_config(tmp_path, tiny_sd3, "sampling.negative_prompt=blurry", "sampling.guidance_scale=1.0")
    assert flow_config(tmp_path, tiny_sd3, "sampling.negative_prompt=blurry").sampling.guidance_scale > 1


# ------------------------------------------------------------------------------- Flow-GRPO's zero-advantage filter


@register_reward("test_first_prompt_constant")
class FirstPromptConstant:
    """Brightness, except that the update's first prompt scores 0.5 on every image: its group's advantages are all
    exactly 0."""

    name = "test_first_prompt_constant"
    needs_prompts = True

    def __init__(self):
        self.last_info = {}

    def __call__(self, images, prompts=None, metadata=None):
        brightness = images.float().mean(dim=(1, 2, 3))
        constant = torch.tensor([p == prompts[0] for p in prompts])
        return {self.name: torch.where(constant, torch.full_like(brightness, 0.5), brightness)}


def test_informative_rows_pads_to_the_minibatch_count():
    """Flow-GRPO's mask: the samples that move, plus random zero ones until the count divides the minibatches."""
    from mmrl.trainer import informative_rows

    advantages = torch.tensor([0.0, 0.0, 1.0, 0.0, -1.0, 0.0, 0.0])
    keep = informative_rows(advantages, 4, torch.Generator().manual_seed(0))
    assert keep[2] and keep[4] and int(keep.sum()) == 4  # 2 that move + 2 of the 5 zero ones
    assert int(informative_rows(advantages, 2, torch.Generator()).sum()) == 2  # already a multiple: no padding
    assert int(informative_rows(torch.zeros(6), 3, torch.Generator()).sum()) == 3  # none moves: one per minibatch
    per_step = torch.tensor([[0.0, 0.0], [0.0, 0.3], [0.0, 0.0]])  # [N, T]: a row is kept if any step moves
    assert informative_rows(per_step, 1, torch.Generator()).tolist() == [False, True, False]


def test_drop_zero_advantage_trains_the_informative_samples_only(tmp_path, tiny_sd3):
    """algorithm.drop_zero_advantage (Flow-GRPO's filter): 2 prompts x 4 images, the first prompt's group all zero,
    2 minibatches of 4 accumulated into one step. The kept 4 are split 2 + 2, so each minibatch's mean runs over
    informative samples: on-policy (ratio 1, no KL) the gradient is (8 / 4) x the one with every sample trained,
    whose zero-advantage half adds nothing but its share of the mean; the dropped samples are not counted trained."""
    common = ["rewards={test_first_prompt_constant: 1.0}", "train.inner_epochs=1",
              "train.gradient_accumulation_steps=2", "algorithm.beta=0"]
    every, grads_every, _ = one_update(flow_config(tmp_path / "a", tiny_sd3, *common))
    dropped, grads_dropped, _ = one_update(flow_config(tmp_path / "b", tiny_sd3, *common,
                                                       "algorithm.drop_zero_advantage=true"))
    assert len(grads_every) == len(grads_dropped) == 1
    assert every["samples/trained"] == 8 and every["samples/informative"] == 4
    assert dropped["samples/trained"] == 4 and dropped["samples/informative"] == 4
    assert grads_every[0].norm() > 0
    torch.testing.assert_close(grads_dropped[0], 2.0 * grads_every[0], rtol=1e-4,
                               atol=1e-6 * float(grads_every[0].norm()))


def test_reward_spread_stats_are_trls_reward_std_and_frac_reward_zero_std():
    """TRL logs reward_std (the unbiased std of the summed reward over the batch) and frac_reward_zero_std (the share
    of samples whose group's reward std is 0); mmrl's reward/std and reward/frac_zero_std, on 3 groups of 4 (one
    all-equal) and a NaN sample left out; dense [N, T] rewards give none."""
    import statistics

    from mmrl.trainer import reward_spread_stats

    a = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.2, float("nan"), 0.9, 0.4])
    b = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    labels = ["p"] * 4 + ["q"] * 4 + ["r"] * 4
    stats = reward_spread_stats({"a": a, "b": b}, {"a": 1.0, "b": 2.0}, labels)
    total = [1.0, 2.0, 1.0, 0.0, 2.5, 2.5, 2.5, 2.5, 0.2, 0.9, 0.4]  # the NaN sample left out
    assert stats["reward/std"] == pytest.approx(statistics.stdev(total), rel=1e-6)  # the inputs are fp32
    assert stats["reward/frac_zero_std"] == pytest.approx(4 / 11)  # the 4 samples of group q
    assert stats["reward/mean"] == pytest.approx(statistics.mean(total), rel=1e-6)
    # nansum_then_normalize: the sample whose component a is NaN counts with b alone, in the mean as in the std
    # (reward/mean was the NaN-propagating total's, over 11 samples, while the std and advantages used 12)
    summed = reward_spread_stats({"a": a, "b": b}, {"a": 1.0, "b": 2.0}, labels, nansum=True)
    nansummed = total[:9] + [0.0] + total[9:]
    assert summed["reward/mean"] == pytest.approx(statistics.mean(nansummed), rel=1e-6)
    assert summed["reward/std"] == pytest.approx(statistics.stdev(nansummed), rel=1e-6)
    assert reward_spread_stats({"a": torch.zeros(4, 3)}, {"a": 1.0}, [0, 0, 1, 1]) == {}


def test_a_run_logs_the_reward_spread(tmp_path, tiny_sd3):
    metrics, _, _ = one_update(flow_config(tmp_path, tiny_sd3))
    assert metrics["reward/std"] > 0 and 0.0 <= metrics["reward/frac_zero_std"] <= 1.0


def test_informative_rows_leave_rows_outside_the_loss_last():
    """A row with no action in the loss (mask_truncated_completions, a variant's drop) is not informative whatever
    its advantage, and pads a minibatch only once every trainable zero row is in."""
    from mmrl.trainer import informative_rows

    advantages = torch.tensor([1.0, -1.0, 0.5, 0.0, 0.0])
    trainable = torch.tensor([True, True, False, True, False])
    keep = informative_rows(advantages, 2, torch.Generator().manual_seed(0), trainable=trainable)
    assert keep.tolist() == [True, True, False, False, False]
    keep = informative_rows(advantages, 4, torch.Generator().manual_seed(0), trainable=trainable)
    assert keep[:2].all() and keep[3] and int(keep.sum()) == 4  # the trainable zero row first, then one more


def test_reward_spread_under_nansum_sums_the_rewards_that_apply():
    from mmrl.trainer import reward_spread_stats

    iou = torch.tensor([0.9, 0.1, float("nan"), float("nan")])
    acc = torch.tensor([float("nan"), float("nan"), 1.0, 1.0])
    plain = reward_spread_stats({"iou": iou, "acc": acc}, {"iou": 1.0, "acc": 1.0}, [0, 0, 1, 1])
    assert math.isnan(plain["reward/std"])  # every sample has a NaN component: none is judged
    both = reward_spread_stats({"iou": iou, "acc": acc}, {"iou": 1.0, "acc": 1.0}, [0, 0, 1, 1], nansum=True)
    assert both["reward/frac_zero_std"] == 0.5 and both["reward/std"] > 0  # group 1 (1.0, 1.0) has no spread
