"""E-GRPO as a sampling mode: consecutive low-entropy SDE steps merged into one SDE step on a coarser grid."""

import json
import math
from pathlib import Path

import pytest
import torch

from mmrl.cli import main
from mmrl.config import ConfigError, load_config
from mmrl.core.credit import gaussian_step_entropy
from mmrl.pipelines.flow.policy import FlowPolicy
from mmrl.pipelines.flow.schedule import plan_steps
from mmrl.pipelines.flow.sd3 import SD3Family
from mmrl.pipelines.flow.tiny import build_tiny_sd3

REPO = Path(__file__).parents[1]
LORA = {"rank": 4, "alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    return build_tiny_sd3(tmp_path_factory.mktemp("tiny") / "sd3")


def make_policy(path, **kwargs):
    family = SD3Family.from_pretrained(str(path), dtype=torch.float32, max_sequence_length=32)
    defaults = dict(num_steps=6, eval_num_steps=6, resolution=32, guidance_scale=4.5, lora=dict(LORA),
                    train_steps="entropy_merge", sample_batch_size=16)
    defaults.update(kwargs)
    return FlowPolicy(family, **defaults)


def test_merge_plan_on_a_hand_made_schedule():
    # 6 steps, steps 0..4 trainable (the std of step 5 is ignored). Threshold = entropy of std 0.5:
    # steps 0 and 4 (std 1) stay alone; the run 1..3 (variance 0.01 each, 0.03 < 0.25) is one group.
    std = torch.tensor([1.0, 0.1, 0.1, 0.1, 1.0, 5.0])
    threshold = float(gaussian_step_entropy(torch.tensor(0.5)))
    plan = plan_steps("entropy_merge", 6, step_noise_std=std, merge_threshold=threshold)
    assert plan.sigma_index.tolist() == [0, 1, 4, 5, 6]  # merged steps 0->1, 1->4, 4->5, then ODE 5->6
    assert plan.sde.tolist() == [True, True, True, False]
    assert plan.train.tolist() == [0, 1, 2]
    # a run long enough to close groups: variance 0.09 each, a group closes at 0.27 >= 0.25 (3 steps);
    # the remainder (step 3, 0.09) joins the run's previous group
    plan = plan_steps("entropy_merge", 5, step_noise_std=[0.3, 0.3, 0.3, 0.3], merge_threshold=threshold)
    assert plan.sigma_index.tolist() == [0, 4, 5] and plan.train.tolist() == [0]
    # merge_groups: equal variances over 5 trainable steps, 2 groups close at half the total -> [0,1,2], [3,4]
    plan = plan_steps("entropy_merge", 6, step_noise_std=torch.ones(6), merge_groups=2)
    assert plan.sigma_index.tolist() == [0, 3, 5, 6] and plan.sde.tolist() == [True, True, False]
    with pytest.raises(ValueError, match="step_noise_std"):
        plan_steps("entropy_merge", 6, merge_groups=2)
    with pytest.raises(ValueError, match="merge_groups"):
        plan_steps("entropy_merge", 6, step_noise_std=torch.ones(6), merge_groups=6)


def test_existing_plans_have_no_sigma_index():
    for mode in ("fraction", "random_fraction", "random_window", "sliding_window"):
        assert plan_steps(mode, 6, generator=torch.Generator().manual_seed(0)).sigma_index is None


def test_merged_rollout_logprobs_replay_and_nfe(tiny_sd3):
    policy = make_policy(tiny_sd3, merge_groups=2)
    calls = []
    velocity = policy._velocity

    def counting(model, x, step, timesteps, cond):
        calls.append((int(step[0]), float(timesteps[step[0]])))
        return velocity(model, x, step, timesteps, cond)

    policy._velocity = counting
    rollout = policy.rollout(["a cat", "a dog"], 2, generator=torch.Generator().manual_seed(0))
    plan = rollout.plan
    merged = len(plan.sde)  # S' = 2 merged SDE steps + the final ODE step
    assert merged == 3 and plan.train.tolist() == [0, 1]
    # one transformer evaluation per merged step (one chunk of 4 samples)
    assert len(calls) == merged
    sigmas_full, timesteps_full = policy.schedule(6)
    torch.testing.assert_close(rollout.sigmas, sigmas_full[plan.sigma_index])
    assert [t for _, t in calls] == timesteps_full[plan.sigma_index[:-1]].tolist()
    assert rollout.latents.shape[:2] == (4, merged + 1) and rollout.old_logps.shape == (4, 2)
    torch.testing.assert_close(rollout.noise_levels, torch.tensor([0.7, 0.7, 0.0]))
    # the per-step noise std the merge rule reads: one per fine step, all positive on the trainable steps
    std = policy.step_noise_std(sigmas_full)
    assert std.shape == (6,) and bool((std[:5] > 0).all())
    policy._velocity = velocity
    out = policy.logprobs(rollout, torch.arange(4))
    torch.testing.assert_close(out.logps, rollout.old_logps, atol=1e-6, rtol=0)
    sub = policy.logprobs(rollout, torch.tensor([3, 0]), torch.tensor([1]))
    torch.testing.assert_close(sub.logps, rollout.old_logps[[3, 0]][:, [1]], atol=1e-6, rtol=0)


def test_threshold_merge_with_the_policy_noise(tiny_sd3):
    # a threshold above every fine step's entropy merges runs; each merged step is one trained action
    policy = make_policy(tiny_sd3, merge_threshold=10.0)
    rollout = policy.rollout(["a cat"], 2, generator=torch.Generator().manual_seed(1))
    assert rollout.plan.sigma_index.tolist() == [0, 5, 6] and rollout.old_logps.shape == (2, 1)
    torch.testing.assert_close(policy.logprobs(rollout, torch.arange(2)).logps, rollout.old_logps, atol=1e-6, rtol=0)


SMALL = ["sampling.num_steps=5", "data.prompts_per_step=1", "data.group_size=4", "train.batch_size=4",
         "train.steps=2", "logging.eval_every=0", "logging.progress_bar=false", "logging.tensorboard=false",
         "sampling.max_sequence_length=16"]


def test_entropy_merge_tiny_run(tmp_path, tiny_sd3):
    assert main(["train", str(REPO / "configs/tiny/flow_grpo.yaml"), f"output_dir={tmp_path}",
                 f"model.pretrained={tiny_sd3}", "sampling.train_steps=entropy_merge", "sampling.merge_groups=2",
                 *SMALL]) == 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    assert all(math.isfinite(m["loss"]) for m in metrics) and metrics[0]["grad_norm"] > 0


def test_entropy_merge_config_errors():
    cfg = REPO / "configs/tiny/flow_grpo.yaml"
    with pytest.raises(ConfigError, match="exactly one of"):
        load_config(cfg, ["sampling.train_steps=entropy_merge"])
    with pytest.raises(ConfigError, match="merge_groups"):
        load_config(cfg, ["sampling.train_steps=entropy_merge", "sampling.merge_groups=40"])
    with pytest.raises(ConfigError, match="needs the intermediate images of the full grid"):
        load_config(cfg, ["sampling.train_steps=entropy_merge", "sampling.merge_groups=2",
                          "algorithm.variants=[step_gain]"])
    config = load_config(cfg, ["sampling.train_steps=entropy_merge", "sampling.merge_threshold=-1.5"])
    assert config.sampling.merge_threshold == -1.5
