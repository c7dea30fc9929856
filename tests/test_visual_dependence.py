"""Visual-dependence credit: the grey canvas in the processor's patch layout, the masked forward of a tiny Qwen-VL, and
VIG / RVCO worked by hand."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.algorithms.base import TransformContext, VariantError, parse_spec
from mmrl.pipelines.vlm.tiny import _processor, build_tiny_vlm_tokenizer

REPO = __import__("pathlib").Path(__file__).parents[1]


def test_grey_canvas_matches_the_processor_layout():
    """The Qwen-VL processors flatten patches channel-major: a picture whose channels are three constants gives three
    constant blocks per row, in channel order; the grey canvas must fill the same blocks."""
    from mmrl.pipelines.vlm.qwen import QwenVLPolicy

    processor = _processor("qwen2_5_vl", build_tiny_vlm_tokenizer())
    rgb = np.zeros((56, 84, 3), dtype=np.uint8)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = 255, 0, 51  # 1.0, 0.0, 0.2 after rescaling
    pixels = processor.image_processor(images=[Image.fromarray(rgb)], return_tensors="pt")["pixel_values"]
    ip = processor.image_processor
    block = pixels.shape[1] // 3
    for c, value in enumerate((1.0, 0.0, 0.2)):
        expected = (value - ip.image_mean[c]) / ip.image_std[c]
        assert torch.allclose(pixels[:, c * block:(c + 1) * block], torch.tensor(expected), atol=1e-5)
    fake = SimpleNamespace(processor=processor)
    grey = QwenVLPolicy._grey_like(fake, pixels, "image")
    assert grey.shape == pixels.shape
    for c in range(3):
        assert torch.allclose(grey[:, c * block:(c + 1) * block], torch.tensor((0.5 - ip.image_mean[c]) / ip.image_std[c]))


@pytest.fixture(scope="module")
def trainer_and_rollout(tmp_path_factory):
    from mmrl.build import build_trainer
    from mmrl.config import load_config

    config = load_config(REPO / "configs/tiny/vlm_grounding.yaml",
                         [f"output_dir={tmp_path_factory.mktemp('vig')}", "logging.progress_bar=false",
                          "logging.tensorboard=false", "generation.max_new_tokens=6", "data.prompts_per_step=2",
                          "data.group_size=2", "train.batch_size=4"])
    trainer = build_trainer(config)
    rollout = trainer.policy.rollout(trainer.prompts.next_batch(2), 2, generator=torch.Generator().manual_seed(0))
    return trainer, rollout


def test_masked_forward_replaces_the_images_and_is_cached(trainer_and_rollout):
    trainer, rollout = trainer_and_rollout
    policy, index = trainer.policy, torch.arange(len(rollout))
    with torch.no_grad():
        seen = policy.logprobs(rollout, index).logps
        blind = policy.logprobs(rollout, index, masked_vision=True).logps
    assert blind.shape == seen.shape and torch.isfinite(blind).all()
    assert not torch.allclose(seen * rollout.mask, blind * rollout.mask)  # the image mattered to the random model
    cached = rollout.extras["masked_vision"]
    assert policy.masked_vision(rollout) is cached and len(cached) == len(rollout.vision)
    assert all(torch.equal(g.image_grid_thw, v.image_grid_thw) for g, v in zip(cached, rollout.vision))
    with pytest.raises(ValueError, match="no KL"):
        policy.logprobs(rollout, index, with_kl=True, masked_vision=True)


def _ctx(advantages, old, masked, mask):
    rollout = SimpleNamespace(old_logps=torch.tensor(old), masked_logps=torch.tensor(masked), mask=torch.tensor(mask))
    return TransformContext(advantages=torch.tensor(advantages), scores={}, rollout=rollout, update=0, total_updates=1)


def test_vig_selects_image_dependent_tokens_and_samples():
    # VIG = old - masked: sample 0 [0.5, -0.1, 0.2], sample 1 [0.0, 0.1, (pad)]
    ctx = _ctx([2.0, -1.0], [[-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0]], [[-1.5, -0.9, -1.2], [-1.0, -1.1, 0.0]],
               [[1.0, 1, 1], [1, 1, 0]])
    adv = parse_spec({"name": "vig"}, 0).transform(ctx)
    assert torch.allclose(adv, torch.tensor([[2.0, 0.0, 2.0], [0.0, -1.0, 0.0]]))
    assert ctx.stats["vig/vig"] == pytest.approx((0.5 - 0.1 + 0.2 + 0.0 + 0.1) / 5)
    # sample_fraction 0.5 keeps the sample of larger mean VIG (sample 0: 0.2; sample 1: 0.05)
    adv = parse_spec({"name": "vig", "sample_fraction": 0.5}, 0).transform(ctx)
    assert torch.allclose(adv, torch.tensor([[2.0, 0.0, 2.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(Exception, match="sample_fraction"):
        parse_spec({"name": "vig", "sample_fraction": 0.0}, 0)


def test_rvco_routes_a_conserved_credit_by_visual_evidence():
    # one trajectory, 3 tokens, VIG e = [0, 1, 3]: median 1, MAD median(|-1|, 0, 2) = 1 -> z = [-1, 0, 2]
    ctx = _ctx([1.0], [[0.0, 1.0, 3.0]], [[0.0, 0.0, 0.0]], [[1.0, 1.0, 1.0]])
    adv = parse_spec({"name": "rvco", "temperature": 1.0, "residual": 0.5, "eps": 0.0}, 0).transform(ctx)
    routed = torch.softmax(torch.tensor([-1.0, 0.0, 2.0]), 0)
    expected = 3 * (0.5 / 3 + 0.5 * routed)
    assert torch.allclose(adv[0], expected) and adv.sum().item() == pytest.approx(3.0)  # the mass L * A is kept
    assert bool((adv > 0.5 - 1e-6).all())  # the residual path: every token keeps at least residual of its share
    # a shift and a scale of the evidence change nothing (robust coordinates)
    shifted = _ctx([1.0], [[10.0, 12.0, 16.0]], [[0.0, 0.0, 0.0]], [[1.0, 1.0, 1.0]])
    again = parse_spec({"name": "rvco", "eps": 0.0}, 0).transform(shifted)
    assert torch.allclose(again, adv)
    # residual 1: uniform credit, exactly GRPO
    uniform = parse_spec({"name": "rvco", "residual": 1.0}, 0).transform(ctx)
    assert torch.allclose(uniform, torch.ones(1, 3))


def test_perturbed_forward_is_seeded_and_cached(trainer_and_rollout):
    trainer, rollout = trainer_and_rollout
    policy, index = trainer.policy, torch.arange(len(rollout))
    first = policy.perturbed_vision(rollout, 0.1)
    assert policy.perturbed_vision(rollout, 0.1) is first and policy.perturbed_vision(rollout, 0.2) is not first
    with torch.no_grad():
        seen = policy.logprobs(rollout, index).logps
        noisy = policy.logprobs(rollout, index, perturbed_vision=0.1).logps
    assert torch.isfinite(noisy).all() and not torch.allclose(seen * rollout.mask, noisy * rollout.mask)
    delta = first[0].pixel_values - rollout.vision[0].pixel_values
    assert 0.08 < float(delta.std()) < 0.12  # the noise has the requested std


def test_dvrp_rewards_sensitivity_and_penalises_instability():
    # VIG [0.5, 2.0 -> clipped 1.0]; |old - perturbed| [0.1, 0.3]; A = 1
    rollout = SimpleNamespace(old_logps=torch.tensor([[-1.0, -1.0]]), masked_logps=torch.tensor([[-1.5, -3.0]]),
                              perturbed_logps=torch.tensor([[-1.1, -0.7]]), mask=torch.ones(1, 2))
    ctx = TransformContext(advantages=torch.tensor([1.0]), scores={}, rollout=rollout, update=0, total_updates=1)
    variant = parse_spec({"name": "dvrp", "divergence_weight": 0.2, "consistency_weight": 1.0, "clip": 1.0}, 0)
    assert variant.perturbation_std() == 0.1
    adv = variant.transform(ctx)
    assert torch.allclose(adv, torch.tensor([[1.0 + 0.2 * 0.5 - 0.1, 1.0 + 0.2 * 1.0 - 0.3]]))


def test_vision_sr1_rewards_perceptions_that_answer_blind():
    from mmrl.data.vlm import VLMSample

    items = [VLMSample(id="a", question="What colour?", solution="red", image_paths=["/x.png"])]
    class Rollout(SimpleNamespace):
        def __len__(self):
            return len(self.completions)

    rollout = Rollout(completions=["<perception>a red box</perception><answer>red</answer>",
                                   "<think>maybe</think><answer>blue</answer>", "<answer>red</answer>"],
                      prompt_index=torch.tensor([0, 0, 0]))
    asked = []

    def sample(prompts, group_size, **kwargs):
        asked.append((prompts, group_size, kwargs))
        return SimpleNamespace(completions=["red", "blue"])

    ctx = SimpleNamespace(rollout=rollout, items=items, scores={"acc": torch.tensor([1.0, 0.0, 1.0])},
                          weights={"acc": 1.0}, stats={}, sample=sample,
                          score=lambda blind: {"acc": torch.tensor([1.0, float("nan")])})
    out = parse_spec({"name": "vision_sr1", "accuracy": "acc", "weight": 0.5}, 0).rewards(ctx)
    prompts, group_size, kwargs = asked[0]
    # sample 0 re-prompted with its perception, sample 1 with its <think> (fallback), sample 2 has neither
    assert [p.question for p in prompts] == ["Image description: a red box\n\nWhat colour?",
                                              "Image description: maybe\n\nWhat colour?"]
    assert all(p.image_paths == [] and p.video_path is None for p in prompts) and group_size == 1
    assert kwargs == {"greedy": True}
    assert out.scores["self_reward"].tolist() == [1.0, 0.0, 0.0]  # a NaN judgement counts 0
    assert out.weights == {"acc": 1.0, "self_reward": 0.5} and ctx.stats["vision_sr1/no_perception"] == 1.0
    with pytest.raises(Exception, match="fallback"):
        parse_spec({"name": "vision_sr1", "accuracy": "acc", "fallback": "maybe"}, 0)


def test_grpo_care_bonus_follows_the_released_rule():
    """Group of 4: accuracies [1, 1, 0.5, 0] (mean 0.625 -> accurate: samples 0, 1); EMA-reference answer likelihoods
    exp(mean answer logp) = [0.8, 0.4, 0.9, 0.9] -> mean over the accurate 0.6 -> consistent: 0 (0.8), 2 and 3 (0.9)
    -> bonus only for sample 0 (accurate and consistent): 0.5 * 1."""
    import math

    weight = torch.nn.Parameter(torch.zeros(2))
    likelihoods = torch.tensor([0.8, 0.4, 0.9, 0.9])

    class Policy:
        def named_trainable_parameters(self):
            return {"w": weight}

        def span_mask(self, rollout, spans):
            return torch.tensor([[0.0, 1.0, 1.0]] * 4)  # the answer is tokens 1-2

        def logprobs(self, rollout, index):
            # answer tokens carry log(c); the reference weights are swapped in (w = shadow) while this runs
            assert torch.equal(weight.detach(), variant.reference.shadow["w"])
            rows = likelihoods[index].log().unsqueeze(1).expand(len(index), 3).clone()
            rows[:, 0] = -50.0  # the reasoning token does not count
            return SimpleNamespace(logps=rows)

    class Rollout(SimpleNamespace):
        def __len__(self):
            return 4

    variant = parse_spec({"name": "grpo_care", "accuracy": "acc", "bonus": 0.5, "decay": 0.5, "margin": None,
                          "confidence_cap": None}, 0)
    variant.setup(Policy(), None)
    with torch.no_grad():
        weight.add_(2.0)  # the policy moved: the reference follows halfway (decay 0.5) before judging
    rollout = Rollout(completions=["<answer>x</answer>"] * 4, mask=torch.ones(4, 3), group_ids=torch.zeros(4))
    ctx = SimpleNamespace(policy=Policy(), rollout=rollout, scores={"acc": torch.tensor([1.0, 1.0, 0.5, 0.0])},
                          weights={"acc": 1.0}, stats={}, config=SimpleNamespace(train=SimpleNamespace(batch_size=2)),
                          update=10)
    out = variant.rewards(ctx)
    assert variant.reference.shadow["w"].tolist() == [1.0, 1.0]
    assert weight.tolist() == [2.0, 2.0]  # the live weights are back
    assert out.scores["consistency_bonus"].tolist() == pytest.approx([0.5, 0.0, 0.0, 0.0])
    assert out.weights["consistency_bonus"] == 1.0
    assert ctx.stats["grpo_care/answer_likelihood"] == pytest.approx(float(likelihoods.mean()), rel=1e-5)
    state = variant.state_dict()
    fresh = parse_spec({"name": "grpo_care", "accuracy": "acc"}, 0)
    fresh.setup(Policy(), None)
    fresh.load_state_dict(state)
    assert fresh.reference.shadow["w"].tolist() == [1.0, 1.0]
    assert math.isclose(variant.options.decay, 0.5)
    # update_every (the released ref_ema_update_every, 10 by default): update 11 leaves the reference where it was
    with torch.no_grad():
        weight.add_(2.0)
    ctx.update = 11
    variant.rewards(ctx)
    assert variant.reference.shadow["w"].tolist() == [1.0, 1.0]
    # the released scripts' defaults: decay 0.995, every 10, bonus 0.5, margin 0.01, likelihood capped at 0.95
    defaults = fresh.options
    assert (defaults.decay, defaults.update_every, defaults.bonus, defaults.margin, defaults.confidence_cap) == (
        0.995, 10, 0.5, 0.01, 0.95)
    for bad in ({"confidence_cap": -1.0}, {"margin": -0.1}, {"update_every": 0}):
        with pytest.raises(VariantError):
            parse_spec({"name": "grpo_care", "accuracy": "acc", **bad}, 0)


def test_prco_trains_the_solver_on_its_outcome_and_the_observer_on_its_solvers_success():
    import contextlib

    from mmrl.data.vlm import VLMSample

    items = [VLMSample(id="a", question="What colour?", solution="red", image_paths=["/x.png"]),
             VLMSample(id="b", question="How many?", solution="2", image_paths=["/y.png"])]

    class Rollout(SimpleNamespace):
        def __len__(self):
            return len(self.completions)

    observer = Rollout(completions=["a red box", "<caption>two dots</caption> ok", "", "blue sky"],
                       prompt_index=torch.tensor([0, 0, 1, 1]), group_ids=torch.tensor([4, 4, 5, 5]))
    asked, prompting = [], []

    class Policy:
        system_prompt = "be brief"

        @contextlib.contextmanager
        def prompting(self, **kwargs):
            prompting.append(kwargs)
            yield self

        def concat_rollouts(self, parts):
            return Rollout(completions=[c for p in parts for c in p.completions], group_ids=torch.zeros(8))

    def sample(prompts, group_size, **kwargs):
        asked.append((prompts, group_size, kwargs))
        return Rollout(completions=["red", "blue", "2", "3"])

    solver_scores = {"acc": torch.tensor([1.0, 0.0, float("nan"), 1.0]), "acc/extra": torch.tensor([5.0, 6, 7, 8]),
                     "fmt": torch.tensor([0.5, 0.5, 1.0, 0.0]), "total": torch.tensor([1.5, 0.5, 1.0, 1.0])}
    ctx = SimpleNamespace(rollout=observer, items=items, weights={"acc": 2.0, "fmt": 1.0}, stats={}, sample=sample,
                          scores={"acc": torch.zeros(4), "acc/extra": torch.zeros(4), "fmt": torch.ones(4),
                                  "total": torch.ones(4)},
                          score=lambda r: solver_scores, policy=Policy(),
                          config=SimpleNamespace(data=SimpleNamespace(prompts_per_step=2)),
                          accelerator=SimpleNamespace(num_processes=3))
    variant = parse_spec({"name": "prco", "accuracy": "acc"}, 0)
    out = variant.rewards(ctx)
    prompts, group_size, kwargs = asked[0]
    assert group_size == 1 and kwargs == {}  # one sampled Solver answer per caption
    assert [p.question for p in prompts] == ["Evidence: a red box\n\nQuestion: What colour?",
                                              "Evidence: <caption>two dots</caption> ok\n\nQuestion: What colour?",
                                              "Evidence: \n\nQuestion: How many?",
                                              "Evidence: blue sky\n\nQuestion: How many?"]
    assert all(p.image_paths == [] and p.video_path is None for p in prompts)  # the Solver sees no image
    assert prompting == [{"system_prompt": "be brief", "question_template": "{question}"}]
    # Observer rows first: its Solver's accuracy (NaN counts 0) as the accuracy component, 0 elsewhere
    assert out.scores["acc"][:4].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert out.scores["acc"][4:6].tolist() == [1.0, 0.0] and torch.isnan(out.scores["acc"][6])  # the Solver's own
    assert out.scores["acc/extra"].tolist() == [5.0, 6, 7, 8, 5, 6, 7, 8]
    assert out.scores["fmt"].tolist() == [0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 1.0, 0.0]
    assert out.scores["total"].tolist() == [2.0, 0.0, 0.0, 2.0, 1.5, 0.5, 1.0, 1.0]
    assert out.weights == {"acc": 2.0, "fmt": 1.0}
    # each role's groups: the Solver's offset past every process's Observer groups (2 prompts x 3 processes)
    assert out.rollout.group_ids.tolist() == [4, 4, 5, 5, 10, 10, 11, 11] and len(out.rollout) == 8
    assert ctx.stats == {"prco/solver_accuracy": 0.5, "prco/empty_captions": 1.0}
    tagged = parse_spec({"name": "prco", "accuracy": "acc", "caption_tag": "caption"}, 0)
    assert [tagged.caption(c) for c in observer.completions] == ["", "two dots", "", ""]
    with pytest.raises(Exception, match="solver_template"):
        parse_spec({"name": "prco", "accuracy": "acc", "solver_template": "{answer}"}, 0)


def test_prco_refuses_what_would_drop_one_roles_rows():
    from mmrl.config import ConfigError, load_config

    base = REPO / "configs/tiny/vlm_grounding.yaml"
    prco = "{name: prco, accuracy: iou}"
    with pytest.raises(ConfigError, match="adds another role's groups.*variance_selection"):
        load_config(base, [f"algorithm.variants=[{prco}, variance_selection]"])
    with pytest.raises(ConfigError, match="skip_bad_samples"):
        load_config(base, [f"algorithm.variants=[{prco}]", "data.skip_bad_samples=true"])
    assert load_config(base, [f"algorithm.variants=[{prco}]"]).algorithm.variants
