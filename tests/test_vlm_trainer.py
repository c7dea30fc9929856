"""The shared trainer on Qwen-VL policies: tiny image-grounding and video temporal-grounding runs end to end."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmrl.cli import main
from mmrl.config import load_config
from mmrl.rewards import register_reward
from fixtures import metrics_rows

REPO = Path(__file__).parents[1]
FAST = ["train.steps=2", "logging.progress_bar=false", "logging.tensorboard=false", "generation.max_new_tokens=12"]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MMRL_CACHE", str(tmp_path_factory.getbasetemp() / "mmrl-cache"))


_metrics = metrics_rows


@pytest.mark.parametrize("config,reward", [("vlm_grounding", "iou"), ("vlm_video_tg", "temporal_iou")])
def test_tiny_vlm_recipes_run_end_to_end(tmp_path, config, reward):
    run = tmp_path / "run"
    assert main(["train", str(REPO / f"configs/tiny/{config}.yaml"), f"output_dir={run}", *FAST,
                 "logging.eval_every=2", "logging.save_every=2"]) == 0
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    first = metrics[0]
    for key in (f"reward/{reward}", "reward/think_answer_format", "loss", "kl", "completions/mean_length",
                "time/rollout", "time/train"):
        assert key in first and math.isfinite(first[key]), key
    # a random tiny model writes no parseable answer: counted, scored 0, never an exception
    assert first[f"reward_info/{reward}/num_unparseable"] == 8.0
    assert metrics[1]["eval/reward/total"] == 0.0  # greedy answers on the evaluation items, scored
    rows = [json.loads(line) for line in (run / "samples" / "step_2.jsonl").read_text().splitlines()]
    assert rows and {"prompt", "completion", reward} <= set(rows[0])
    export = run / "checkpoints" / "step_2" / "export"
    assert (export / "adapter_config.json").is_file() and (export / "adapter_model.safetensors").is_file()
    from transformers import AutoProcessor

    assert AutoProcessor.from_pretrained(export).chat_template  # the processor travels with the adapter too


@register_reward("test_short_answer")
class ShortAnswer:
    """Test reward with signal for a random policy: shorter completions score higher."""

    name = "test_short_answer"
    needs_prompts = False

    def __init__(self):
        self.last_info = {}

    def __call__(self, completions, prompts=None, metadata=None):
        return {self.name: torch.tensor([-float(len(c)) for c in completions])}


def test_vlm_training_moves_lora_only_and_resumes_exactly(tmp_path):
    common = [str(REPO / "configs/tiny/vlm_grounding.yaml"), *FAST, "rewards={test_short_answer: 1.0}",
              "logging.eval_every=0", "logging.save_every=2", "algorithm.beta=0.0"]
    assert main(["train", *common, f"output_dir={tmp_path / 'a'}", "train.steps=4"]) == 0
    assert main(["train", *common, f"output_dir={tmp_path / 'b'}", "train.steps=2"]) == 0
    assert main(["train", *common, f"output_dir={tmp_path / 'b'}", "train.steps=4"]) == 0  # resume: auto
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    assert a[0]["samples/trained"] > 0 and a[0]["grad_norm"] > 0
    wa = load_file(str(tmp_path / "a" / "checkpoints" / "step_4" / "trainable.safetensors"))
    wb = load_file(str(tmp_path / "b" / "checkpoints" / "step_4" / "trainable.safetensors"))
    w2 = load_file(str(tmp_path / "b" / "checkpoints" / "step_2" / "trainable.safetensors"))
    assert wa.keys() == wb.keys() and all("lora" in k for k in wa)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], w2[k]) for k in wa)


def test_first_inner_step_ratio_is_exactly_one(tmp_path, monkeypatch):
    from mmrl import trainer as trainer_module

    seen = []
    original = trainer_module.policy_loss

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append((out.metrics["ratio/min"].item(), out.metrics["ratio/max"].item()))
        return out

    monkeypatch.setattr(trainer_module, "policy_loss", spy)
    assert main(["train", str(REPO / "configs/tiny/vlm_grounding.yaml"), *FAST, "train.steps=1",
                 "rewards={test_short_answer: 1.0}", "logging.eval_every=0", f"output_dir={tmp_path}"]) == 0
    assert seen[0] == (1.0, 1.0)


def test_vlm_config_errors(tmp_path):
    path = REPO / "configs/tiny/vlm_grounding.yaml"
    with pytest.raises(Exception, match="data.dataset"):
        load_config(path, ["data.dataset=null"])
    with pytest.raises(Exception, match="file not found"):
        load_config(path, [f"data.dataset={tmp_path}/missing.jsonl"])
    with pytest.raises(Exception, match="question_template"):
        load_config(path, ["generation.question_template=no placeholder"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "solution": "a", "image": "nope.png"}\n')
    assert main(["train", str(path), f"data.dataset={bad}", f"output_dir={tmp_path / 'run'}", *FAST]) == 2


@register_reward("test_first_group_only")
class FirstGroupOnly:
    """Test reward: signal only for the red-box prompts (other groups all score 0, zero variance)."""

    name = "test_first_group_only"
    needs_prompts = True

    def __init__(self):
        self.last_info = {}

    def __call__(self, completions, prompts=None, metadata=None):
        return {self.name: torch.tensor([-float(len(c)) if "red" in p else 0.0 for c, p in zip(completions, prompts)])}


def test_dynamic_sampling_replaces_zero_variance_groups(tmp_path):
    run = tmp_path / "run"
    assert main(["train", str(REPO / "configs/tiny/vlm_grounding.yaml"), *FAST, "train.steps=1",
                 "rewards={test_first_group_only: 1.0}", "algorithm.variants=[{name: dynamic_sampling, max_rounds: 4}]", "logging.eval_every=0", f"output_dir={run}"]) == 0
    m = _metrics(run)[0]
    # red prompts are 1 in 4 of the synthetic set: groups without them are dropped and replaced
    assert m["samples/sampling_rounds"] > 1 and m["samples/dropped_groups"] >= 1
    assert m["samples/zero_advantage"] < 8  # the batch it trained on carries signal


def test_evidence_and_token_weighting_and_temporal_contrast_run(tmp_path):
    assert main(["train", str(REPO / "configs/tiny/vlm_grounding.yaml"), *FAST, "train.steps=1",
                 "rewards={test_short_answer: 1.0, iou: 0.0}", "algorithm.variants=[{name: ga_grpo, reward: iou}]", "logging.eval_every=0", f"output_dir={tmp_path / 'ga'}"]) == 0
    assert main(["train", str(REPO / "configs/tiny/vlm_grounding.yaml"), *FAST, "train.steps=1",
                 "rewards={test_short_answer: 1.0}", "algorithm.variants=[tw_grpo]",
                 "logging.eval_every=0", f"output_dir={tmp_path / 'tw'}"]) == 0
    assert main(["train", str(REPO / "configs/tiny/vlm_video_tg.yaml"), *FAST, "train.steps=1",
                 "rewards={test_short_answer: 1.0, temporal_iou: 0.0}", "algorithm.variants=[{name: t_grpo, reward: temporal_iou}]", "logging.eval_every=0",
                 f"output_dir={tmp_path / 'tg'}"]) == 0
    for name in ("ga", "tw", "tg"):
        m = _metrics(tmp_path / name)[0]
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0, name
    assert "reward/temporal_bonus" in _metrics(tmp_path / "tg")[0]


def test_single_optimizer_step_skips_the_old_logprob_pass(tmp_path, monkeypatch):
    from mmrl import trainer as trainer_module

    calls = {"old": 0}
    original = trainer_module.Trainer._old_logps

    def counting(self, *args, **kwargs):
        calls["old"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(trainer_module.Trainer, "_old_logps", counting)
    run = tmp_path / "run"
    assert main(["train", str(REPO / "configs/tiny/vlm_grounding.yaml"), *FAST, "train.steps=1", "train.inner_epochs=1",
                 "train.batch_size=8", "rewards={test_short_answer: 1.0}", "logging.eval_every=0",
                 f"output_dir={run}"]) == 0
    m = _metrics(run)[0]
    assert calls["old"] == 0 and m["ratio/min"] == 1.0 and m["ratio/max"] == 1.0 and m["grad_norm"] > 0


def test_truncated_completions_are_those_without_an_end_of_turn_token():
    from types import SimpleNamespace

    from mmrl.pipelines.vlm.qwen import QwenVLPolicy

    eos, pad = 7, 0
    ids = torch.tensor([[3, 4, eos, pad], [3, 4, 5, 6], [3, eos, pad, pad], [3, 4, 5, eos], [pad, pad, pad, pad],
                        [3, 9, 9, 4]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0],
                         [1, 0, 0, 1]], dtype=torch.float32)  # last row: a tool rollout, a response between turns
    policy = SimpleNamespace(eos_ids=[eos, 8])
    rollout = SimpleNamespace(mask=mask, completion_ids=ids)
    assert QwenVLPolicy.truncated(policy, rollout).tolist() == [False, True, False, False, False, True]


def _with_end_tokens_on_even_rows(trainer):
    """Even rows end with the end-of-turn token after 3 + i tokens, odd rows keep the whole budget (truncated): a
    random tiny model never writes its end token itself."""
    policy = trainer.policy
    original = policy.rollout

    def rollout(*args, **kwargs):
        r = original(*args, **kwargs)
        for i in range(0, len(r), 2):
            keep = 3 + i
            r.completion_ids[i, keep - 1] = policy.eos_ids[0]
            r.completion_ids[i, keep:] = policy.pad_id
            r.mask[i, keep:] = 0
        r.completions = policy.tokenizer.batch_decode(r.completion_ids, skip_special_tokens=True)
        return r

    policy.rollout = rollout


@pytest.mark.parametrize("aggregation", ["grpo", "dapo"])
def test_mask_truncated_completions_leaves_them_out_of_the_loss_only(tmp_path, aggregation):
    from layout import one_update

    def update(name, *extra, prepare=None):
        config = load_config(REPO / "configs/tiny/vlm_grounding.yaml", [
            f"output_dir={tmp_path / name}", *FAST, "train.steps=1", "logging.eval_every=0", "algorithm.beta=0.0",
            "rewards={test_short_answer: 1.0}", f"algorithm.aggregation={aggregation}", "train.inner_epochs=1",
            "train.batch_size=8", *extra])
        return one_update(config, prepare)

    # all 8 completions run to the 12-token budget: nothing is left to train on
    metrics, grads, _ = update("all_on", "algorithm.mask_truncated_completions=true")
    assert metrics["completions/clipped_ratio"] == 1.0
    assert metrics["loss"] == 0.0 and all(g.abs().max() == 0 for g in grads)
    assert metrics["samples/trained"] == 0 and metrics["samples/informative"] == 0
    off, off_grads, _ = update("all_off")
    assert off["completions/clipped_ratio"] == 1.0 and off_grads[0].norm() > 0
    # half of them end: their gradient alone, the truncated half still in the group statistics
    on, on_grads, _ = update("half_on", "algorithm.mask_truncated_completions=true", prepare=_with_end_tokens_on_even_rows)
    off, off_grads, _ = update("half_off", prepare=_with_end_tokens_on_even_rows)
    assert on["completions/clipped_ratio"] == off["completions/clipped_ratio"] == 0.5
    assert on["samples/trained"] == 4 and off["samples/trained"] == 8
    assert on["advantages/abs_mean"] == off["advantages/abs_mean"] > 0
    assert on_grads[0].norm() > 0 and not torch.allclose(on_grads[0], off_grads[0])


def test_mask_truncated_completions_is_refused_for_flows():
    from mmrl.config import ConfigError

    with pytest.raises(ConfigError, match="mask_truncated_completions applies to VLM"):
        load_config(REPO / "configs/tiny/flow_grpo.yaml", ["algorithm.mask_truncated_completions=true"])


def _with_sampler_logps(row0: float | None):
    """Rollouts as a vLLM engine returns them: its own log-prob of every sampled token (``sampler_logps``), here NaN
    (no log-prob reported: no gap) except, with ``row0``, that value on every token of sample 0."""
    def prepare(trainer):
        policy = trainer.policy
        original = policy.rollout

        def rollout(*args, **kwargs):
            r = original(*args, **kwargs)
            r.sampler_logps = torch.full(r.mask.shape, float("nan"))
            if row0 is not None:
                r.sampler_logps[0] = row0
            return r

        policy.rollout = rollout
    return prepare


def test_sampler_log_probs_weight_the_policy_term_as_trl_corrects_vllm(tmp_path):
    from layout import one_update

    def update(name, prepare=None, **fields):
        config = load_config(REPO / "configs/tiny/vlm_grounding.yaml", [
            f"output_dir={tmp_path / name}", *FAST, "train.steps=1", "logging.eval_every=0", "algorithm.beta=0.0",
            "rewards={test_short_answer: 1.0}", "train.inner_epochs=1", "train.batch_size=8"])
        for key, value in fields.items():  # as a vllm-engine config would set them (the hf engine refuses them)
            setattr(config.algorithm, key, value)
        return one_update(config, prepare)

    plain, plain_grads, _ = update("plain")
    assert "rollout/sampler_is_weight_mean" not in plain  # HF generate: nothing to correct
    # no gap anywhere: every weight is 1, the same update (the old log-probs now come from the separate pass)
    same, same_grads, _ = update("nan", _with_sampler_logps(None))
    assert same["rollout/sampler_is_weight_min"] == same["rollout/sampler_is_weight_max"] == 1.0
    assert torch.allclose(same_grads[0], plain_grads[0], rtol=1e-5, atol=1e-9)
    # sample 0 sampled with log-prob 0 per token: its sequence ratio exp(sum of the model's log-probs) is ~0 (TRL's
    # default sequence_mask with C_max 3 keeps it, at that weight): sample 0 no longer moves the policy
    low, low_grads, _ = update("row0", _with_sampler_logps(0.0))
    assert low["rollout/sampler_is_weight_min"] < 1e-6 and low["rollout/sampler_is_weight_max"] == 1.0
    assert low["rollout/sampler_is_weight_mean"] == pytest.approx(7 / 8, abs=1e-6)
    assert not torch.allclose(low_grads[0], plain_grads[0], rtol=1e-3)
    # token_truncate: each of sample 0's tokens weighted exp(log p) in (0, 1), the others 1
    tok, _, _ = update("token", _with_sampler_logps(0.0), sampler_correction="token_truncate")
    assert 0 < tok["rollout/sampler_is_weight_min"] < 1 and tok["rollout/sampler_is_weight_max"] == 1.0
    # the gap is the whole batch's, as TRL measures it: dropping zero-advantage rows from training leaves it as is
    dropped, _, _ = update("drop", _with_sampler_logps(0.0), drop_zero_advantage=True)
    assert dropped["rollout/sampler_logp_gap_max"] == low["rollout/sampler_logp_gap_max"] > 0
    assert dropped["rollout/sampler_logp_gap_mean"] == pytest.approx(low["rollout/sampler_logp_gap_mean"], rel=1e-9)
    # none: the gap is still reported, nothing is weighted
    off, off_grads, _ = update("none", _with_sampler_logps(0.0), sampler_correction="none")
    assert "rollout/sampler_is_weight_mean" not in off and off["rollout/sampler_logp_gap_max"] > 0
    assert torch.allclose(off_grads[0], plain_grads[0], rtol=1e-5, atol=1e-9)


def test_top_entropy_quantile_trains_the_high_entropy_tokens_alike_for_every_layout(tmp_path):
    """algorithm.top_entropy_quantile ("Beyond the 80/20 Rule"; TRL's option): the entropies are those of the tempered
    next-token distribution (checked against torch.distributions.Categorical on a plain forward of the model), the
    kept tokens are the top half of the real ones, and the update is the same for every minibatch / accumulation
    split (one threshold over the whole update, mmrl's rule) and differs from training every token."""
    from torch.distributions import Categorical

    from layout import assert_same_update, one_update

    seen = []

    def spy(trainer):
        policy, original = trainer.policy, trainer.policy.logprobs

        def logprobs(rollout, index, steps=None, **kwargs):
            out = original(rollout, index, steps, **kwargs)
            if kwargs.get("with_entropy"):  # the same rows through a plain forward of the model, before the update
                index = torch.as_tensor(index)
                with torch.no_grad():
                    inputs = policy._sequence_inputs(rollout, index)
                    positions = policy._rope_positions(rollout)
                    if positions is not None:
                        inputs["position_ids"] = positions[:, index]
                    vision = policy._vision_kwargs([rollout.vision[r] for r in rollout.prompt_index[index].tolist()])
                    width = rollout.completion_ids.shape[1]
                    logits = policy.train_model(**inputs, **vision, logits_to_keep=width + 1,
                                                use_cache=False).logits[:, :-1].float() / 0.7
                logits[..., policy.suppressed_ids] = float("-inf")  # never sampled: probability 0
                seen.append((out.entropy, Categorical(logits=logits).entropy(), rollout.mask[index]))
            return out
        policy.logprobs = logprobs

    def update(name, *extra, prepare=None):
        config = load_config(REPO / "configs/tiny/vlm_grounding.yaml", [
            f"output_dir={tmp_path / name}", *FAST, "train.steps=1", "logging.eval_every=0", "algorithm.beta=0.0",
            "rewards={test_short_answer: 1.0}", "train.inner_epochs=1", "generation.temperature=0.7", *extra])
        return one_update(config, prepare)

    whole = update("whole", "algorithm.top_entropy_quantile=0.5", "train.batch_size=8", prepare=spy)
    metrics = whole[0]
    assert 0.5 <= metrics["rollout/high_entropy_fraction"] < 1.0 and metrics["rollout/entropy_threshold"] > 0
    got, want, mask = seen[0]
    assert torch.allclose(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-5) and got.std() > 0
    assert metrics["rollout/entropy_mean"] == pytest.approx(float(want[mask > 0].mean()), rel=1e-5)
    for name, extra in (("half", ["train.batch_size=4", "train.gradient_accumulation_steps=2"]),
                        ("quarter", ["train.batch_size=2", "train.gradient_accumulation_steps=4"])):
        other = update(name, "algorithm.top_entropy_quantile=0.5", *extra)
        assert other[0]["rollout/entropy_threshold"] == pytest.approx(metrics["rollout/entropy_threshold"], rel=1e-5)
        assert_same_update(other, whole, rtol=1e-4)
    every = update("every", "train.batch_size=8")
    assert "rollout/entropy_threshold" not in every[0]
    assert not torch.allclose(every[1][0], whole[1][0], rtol=1e-3)
    # two inner epochs: the entropies come from the old-log-prob pass's own forwards (no pass of their own), the same
    # threshold, and again the same two optimizer steps for 8 and 4 x 2
    assert "time/entropy_forward" in metrics
    two = update("two", "algorithm.top_entropy_quantile=0.5", "train.batch_size=8", "train.inner_epochs=2")
    assert "time/entropy_forward" not in two[0]
    assert two[0]["rollout/entropy_threshold"] == pytest.approx(metrics["rollout/entropy_threshold"], rel=1e-5)
    assert_same_update(update("two_split", "algorithm.top_entropy_quantile=0.5", "train.batch_size=4",
                              "train.gradient_accumulation_steps=2", "train.inner_epochs=2"), two, rtol=1e-4)


@register_reward("test_constant")
class ConstantReward:
    """Test reward: 1 for every completion, so every advantage is 0 and only a bonus term has a gradient."""

    name = "test_constant"
    needs_prompts = False

    def __init__(self):
        self.last_info = {}

    def __call__(self, completions, prompts=None, metadata=None):
        return {self.name: torch.ones(len(completions))}


def test_entropy_coef_raises_the_entropy_alike_for_every_layout(tmp_path):
    """algorithm.entropy_coef (TRL's entropy bonus, fixed coefficient): with every advantage 0 (a constant reward) the
    bonus is the whole gradient; it is linear in the coefficient, the same for batch 8 and 4 x 2 (a mean over the
    optimizer step's tokens, mmrl's rule), logged as `entropy`, and the step it drives raises the policy's entropy on
    the same completions; coefficient 0 trains nothing here."""
    from layout import assert_same_update, one_update

    kept = {}

    def keep(trainer):
        kept["trainer"] = trainer
        original = trainer.policy.rollout

        def rollout(*args, **kwargs):
            kept["rollout"] = original(*args, **kwargs)
            return kept["rollout"]
        trainer.policy.rollout = rollout

    def update(name, coef, *extra, prepare=None):
        config = load_config(REPO / "configs/tiny/vlm_grounding.yaml", [
            f"output_dir={tmp_path / name}", *FAST, "train.steps=1", "logging.eval_every=0", "algorithm.beta=0.0",
            "rewards={test_constant: 1.0}", "train.inner_epochs=1", f"algorithm.entropy_coef={coef}", *extra])
        return one_update(config, prepare)

    off = update("off", 0.0, "train.batch_size=8")
    assert all(g.abs().max() == 0 for g in off[1]) and "entropy" not in off[0]
    one = update("one", 1.0, "train.batch_size=8", prepare=keep)
    assert one[0]["entropy"] > 0 and one[1][0].norm() > 0
    two = update("two", 2.0, "train.batch_size=8")
    assert torch.allclose(two[1][0], 2 * one[1][0], rtol=1e-5, atol=1e-10)
    assert_same_update(update("split", 1.0, "train.batch_size=4", "train.gradient_accumulation_steps=2"), one,
                       rtol=1e-4)
    trainer, rollout = kept["trainer"], kept["rollout"]
    with torch.no_grad():
        after = trainer.policy.logprobs(rollout, torch.arange(len(rollout.mask)), with_entropy=True).entropy.cpu()
    real = rollout.mask > 0
    assert float(after[real].mean()) > one[0]["entropy"]


def test_top_entropy_quantile_is_checked():
    from mmrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"top_entropy_quantile must be in \[0, 1\]"):
        load_config(REPO / "configs/tiny/vlm_grounding.yaml", ["algorithm.top_entropy_quantile=1.5"])
    with pytest.raises(ConfigError, match="top_entropy_quantile selects high-entropy tokens of VLM"):
        load_config(REPO / "configs/tiny/flow_grpo.yaml", ["algorithm.top_entropy_quantile=0.2"])
    with pytest.raises(ConfigError, match="entropy_coef is a bonus on the entropy of VLM"):
        load_config(REPO / "configs/tiny/flow_grpo.yaml", ["algorithm.entropy_coef=0.01"])


def test_sampler_correction_needs_the_vllm_engine():
    from mmrl.config import ConfigError

    with pytest.raises(ConfigError, match="generation.engine: vllm"):
        load_config(REPO / "configs/tiny/vlm_grounding.yaml", ["algorithm.sampler_correction=token_mask"])
    with pytest.raises(ConfigError, match="generation.engine: vllm"):
        load_config(REPO / "configs/tiny/vlm_grounding.yaml", ["algorithm.sampler_correction_max=2.0"])
    with pytest.raises(ConfigError, match="sampler_correction_min must be"):
        load_config(REPO / "configs/tiny/vlm_grounding.yaml", ["algorithm.sampler_correction_min=5.0"])


@pytest.mark.parametrize("overrides,message", [
    (["algorithm.sampler_correction=token_truncate", "algorithm.sampler_correction_max=null"],
     "token_truncate clamps the weights: it needs sampler_correction_max or sampler_correction_min"),
    (["algorithm.sampler_correction=sequence_mask", "algorithm.sampler_correction_min=2.0",
      "algorithm.sampler_correction_max=2.0"], r"sampler_correction_min must be in \[0, sampler_correction_max\)"),
])
def test_sampler_correction_bounds_that_cannot_work_are_refused(overrides, message):
    """Both bounds null under a truncate mode failed in torch.clamp at the first update; equal bounds (TRL requires
    min < max) truncated every weight to 1 or masked 3 of 4 rows."""
    from mmrl.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(REPO / "configs/tiny/vlm_grounding.yaml", ["generation.engine=vllm", *overrides],
                    check_files=False)


def _grounding_lines_with_a_long_question(tmp_path, row: int) -> Path:
    """The first 6 lines of tiny:grounding (absolute image paths), line ``row``'s question far over 512 tokens."""
    from mmrl.data.synthetic import resolve_dataset

    source = Path(resolve_dataset("tiny:grounding"))
    rows = [json.loads(line) for line in source.read_text().splitlines()][:6]
    for r in rows:
        r["image"] = str(source.parent / r["image"])
    rows[row]["question"] = "where " * 3000
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def test_a_bad_line_met_mid_run_keeps_the_updates_done(tmp_path, capsys):
    """A prompt over generation.max_prompt_length met at update 3 (the startup check does not tokenize): the run
    stops with one line saying what to do, and a checkpoint of update 2 is written (save_every would have written
    none), at the data position before update 3, so resume=auto meets the same line again."""
    data = _grounding_lines_with_a_long_question(tmp_path, 4)  # the first line of update 3 (2 per update, in order)
    run = tmp_path / "run"
    args = ["train", str(REPO / "configs/tiny/vlm_grounding.yaml"), f"output_dir={run}", *FAST, "train.steps=4",
            f"data.dataset={data}", "data.shuffle=false", "logging.save_every=0", "logging.eval_every=0"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "update 3 of 4 stopped on bad data" in err and "resume=auto" in err and "skip_bad_samples" in err
    assert "mmrl: error: prompt longer than generation.max_prompt_length" in err
    assert [m["step"] for m in _metrics(run)] == [1, 2]
    state = json.loads((run / "checkpoints" / "step_2" / "state.json").read_text())
    assert state["update"] == 2 and state["data"]["position"] == 4


def test_a_skipped_evaluation_item_leaves_the_evaluation_aligned(tmp_path):
    """data.skip_bad_samples with a bad line among the evaluation items (the first num_eval_prompts lines): the
    greedy evaluation answers the others, each scored against its own item (before, the answers and the items were
    zipped out of step and the reward refused the counts)."""
    data = _grounding_lines_with_a_long_question(tmp_path, 0)
    run = tmp_path / "run"
    assert main(["train", str(REPO / "configs/tiny/vlm_grounding.yaml"), f"output_dir={run}", *FAST, "train.steps=1",
                 f"data.dataset={data}", "data.shuffle=false", "data.skip_bad_samples=true", "logging.eval_every=1",
                 "data.num_eval_prompts=3"]) == 0
    rows = [json.loads(line) for line in (run / "samples" / "step_1.jsonl").read_text().splitlines()]
    questions = [json.loads(line)["question"] for line in data.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == questions[1:3]
    assert math.isfinite(_metrics(run)[0]["eval/reward/total"])


def test_skip_counts_stay_cumulative_across_a_resume(tmp_path):
    """samples/skipped_* counts the run's skips since it began: a resumed run carries the checkpoint's counts on
    (they started again from 0, so update 2 of a resumed run dropped the metric)."""
    data = _grounding_lines_with_a_long_question(tmp_path, 0)  # the first line: update 1 skips it
    args = [str(REPO / "configs/tiny/vlm_grounding.yaml"), *FAST, f"data.dataset={data}", "data.shuffle=false",
            "data.skip_bad_samples=true", "logging.save_every=1", "logging.eval_every=0"]
    assert main(["train", *args, f"output_dir={tmp_path / 'straight'}", "train.steps=2"]) == 0
    assert main(["train", *args, f"output_dir={tmp_path / 'resumed'}", "train.steps=1"]) == 0
    assert main(["train", *args, f"output_dir={tmp_path / 'resumed'}", "train.steps=2"]) == 0
    straight, resumed = _metrics(tmp_path / "straight"), _metrics(tmp_path / "resumed")
    assert [m["samples/skipped_prompt_too_long"] for m in straight] == [1.0, 1.0]
    assert [m.get("samples/skipped_prompt_too_long") for m in resumed] == [1.0, 1.0]
