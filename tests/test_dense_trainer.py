"""Dense per-step credit on the tiny SD3 pipeline: every credit mode end to end, costs logged, config errors."""

import json
import math
from pathlib import Path

import pytest

from mmrl.cli import main
from mmrl.config import ConfigError, load_config
from mmrl.pipelines.flow.tiny import build_tiny_sd3

REPO = Path(__file__).parents[1]
SMALL = ["sampling.num_steps=5", "sampling.window_size=4", "data.prompts_per_step=1", "data.group_size=4",
         "train.batch_size=4", "train.steps=2", "logging.eval_every=0", "logging.progress_bar=false",
         "logging.tensorboard=false", "sampling.max_sequence_length=16"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_sd3(tmp_path_factory.mktemp("tiny") / "sd3"))


@pytest.mark.parametrize("credit,intermediate", [("step_gain", "ode"), ("turning_point", "ode"),
                                                 ("cosine", "ode"), ("step_gain", "x0")])
def test_each_credit_mode_trains(tmp_path, tiny_path, credit, intermediate):
    assert main(["train", str(REPO / "configs/tiny/tp_grpo.yaml"), f"output_dir={tmp_path}",
                 f"model.pretrained={tiny_path}", "algorithm.variants=[" + credit + "]",
                 f"sampling.intermediate={intermediate}", *SMALL]) == 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first = metrics[0]
    assert math.isfinite(first["loss"]) and first["grad_norm"] > 0
    # 4 trained steps -> 5 rewards per trajectory, the last the final image's own (not scored again); ODE
    # completions cost the remaining steps from each start before the last trained step's end
    assert first["cost/reward_calls"] == 4 * 4
    if intermediate == "ode":
        assert first["cost/extra_nfe"] == 4 * 2 * sum(5 - s for s in [0, 1, 2, 3])  # CFG: 2 passes
    else:
        assert first["cost/extra_nfe"] == 0
    assert math.isfinite(first["reward/ode_baseline"])
    if credit == "turning_point":
        assert "credit/turning_points" in first
        assert first["health/no_turning_point_streak"] == float(first["credit/turning_points"] == 0)
    else:
        assert "health/no_turning_point_streak" not in first


@pytest.mark.parametrize("intermediate", ["ode", "x0"])
def test_the_last_step_reward_is_the_scored_final_sample_when_sde_steps_follow(tmp_path, tiny_path, intermediate):
    """TP-GRPO's R_n is the final sample's reward. With ``train_steps: fraction`` SDE steps follow the last trained
    one: R_n was the ODE completion of the latent after it (images 0.5 apart at fraction 0.5, G's sign wrong in 2
    of 8 trajectories), and in x0 mode a one-step prediction."""
    import torch

    from mmrl.build import build_policy, build_reward_fn
    from mmrl.trainer import Trainer
    from mmrl.build import build_accelerator, build_source

    config = load_config(REPO / "configs/tiny/tp_grpo.yaml", [
        f"output_dir={tmp_path}", f"model.pretrained={tiny_path}", "sampling.train_steps=fraction",
        "sampling.timestep_fraction=0.5", "sampling.sde=flow_grpo",
        f"sampling.intermediate={intermediate}", *SMALL[:1], *SMALL[2:]])
    policy = build_policy(config)
    trainer = Trainer(config, policy, build_reward_fn(config), build_source(config), build_accelerator(config))
    rollout = policy.rollout(["a red circle"], 4, generator=torch.Generator().manual_seed(0))
    train = rollout.plan.train.tolist()
    assert train[-1] + 1 < policy.num_steps and rollout.noise_levels[train[-1] + 1:].gt(0).any()  # an SDE tail
    images, _ = policy.intermediate_images(rollout, mode=intermediate)
    assert images.shape[1] == len(train) + 1 and torch.equal(images[:, -1], rollout.outputs)
    outcome = trainer._score(rollout)
    step_rewards = trainer._intermediate(rollout, outcome).step_rewards
    total = sum(w * outcome[k].float() for k, w in trainer.reward_fn.weights.items())
    assert torch.equal(step_rewards[:, -1], total)


def test_adaptive_noise_is_logged_and_resumed(tmp_path, tiny_path):
    args = ["train", str(REPO / "configs/tiny/dense_grpo.yaml"), f"output_dir={tmp_path}",
            f"model.pretrained={tiny_path}", *SMALL, "logging.save_every=1"]
    assert main(args) == 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    levels = [v for k, v in metrics[-1].items() if k.startswith("noise_level/")]
    assert len(levels) == 4 and any(abs(v - 0.7) > 1e-6 for v in levels) and all(v <= 1.0 for v in levels)
    state = json.loads((tmp_path / "checkpoints" / "step_2" / "state.json").read_text())
    assert [round(v, 6) for v in state["noise_levels"][:4]] == [round(v, 6) for v in levels]


def test_dense_credit_config_errors(tmp_path):
    tp = REPO / "configs/tiny/tp_grpo.yaml"
    with pytest.raises(ConfigError, match="judges completions \\(text\\), but a model.family sd3 policy"):
        load_config(tp, ["rewards={iou: 1.0}"])
    with pytest.raises(ConfigError, match="longer than the 9 trainable steps"):
        load_config(tp, ["sampling.window_size=12"])
    with pytest.raises(ConfigError, match=r"now an algorithm variant: write algorithm.variants: \[step_gain\]"):
        load_config(tp, ["algorithm.credit=step_gain"])
    with pytest.raises(ConfigError, match="both assign credit over denoising steps"):
        load_config(tp, ["algorithm.variants=[step_gain, turning_point]"])
    with pytest.raises(ConfigError, match="applies to vlm policies"):
        load_config(tp, ["algorithm.variants=[dynamic_sampling]"])
    with pytest.raises(ConfigError, match="noise_schedule has 3 levels"):
        load_config(tp, ["sampling.noise_schedule=[0.1, 0.2, 0.3]"])


def test_value_anchored_advantages_do_not_vanish_for_uniform_groups(tmp_path, tiny_path):
    """VGPO switch: a reward that is constant within every group still gives advantages once anchors exist."""
    from mmrl.rewards import register_reward

    @register_reward("test_constant_per_update")
    class ConstantPerUpdate:
        name = "test_constant_per_update"
        needs_prompts = False
        calls = 0

        def __init__(self):
            self.last_info = {}

        def __call__(self, images, prompts=None, metadata=None):
            ConstantPerUpdate.calls += 1
            import torch

            return {self.name: torch.full((len(images),), float(ConstantPerUpdate.calls))}

    args = ["train", str(REPO / "configs/tiny/flow_grpo.yaml"), f"output_dir={tmp_path}",
            f"model.pretrained={tiny_path}", "rewards={test_constant_per_update: 1.0}", "train.steps=2",
            "data.prompts_per_step=1", "data.group_size=4", "train.batch_size=4", "logging.eval_every=0",
            "logging.progress_bar=false", "logging.tensorboard=false", "sampling.num_steps=4",
            "sampling.max_sequence_length=16", "algorithm.variants=[vgpo]", "algorithm.scale=group", "train.overlap_scoring=false",
            "data.prompt_list=[a cat]"]
    assert main(args) == 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["samples/zero_advantage"] == 4.0  # first update: V = the batch mean, nothing to anchor
    # second update: every sample scores 2, the prompt's anchor is 1 -> advantage (2 - 1) / 1 for all, not 0
    assert metrics[1]["samples/zero_advantage"] == 0.0 and metrics[1]["advantages/abs_mean"] == pytest.approx(1.0)
    from mmrl.checkpoint import load_checkpoint

    _, _, objects = load_checkpoint(tmp_path / "checkpoints" / "step_2")
    assert objects["variants"]["vgpo"]["anchors"] == {"a cat": pytest.approx(2.0 - 0.9 ** 4)}  # 4 samples of 2
    with pytest.raises(ConfigError, match="variant 'vgpo' works with"):
        load_config(REPO / "configs/tiny/tp_grpo.yaml", ["algorithm.variants=[turning_point, vgpo]",
                                                         "algorithm.scale=group"])
