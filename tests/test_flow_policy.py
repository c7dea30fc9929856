"""The SD3 flow policy on the tiny pipeline: diffusers parity, log-prob replay, ratio 1, KL 0, LoRA only."""

import pytest
import torch

from mmrl.core.losses import policy_loss
from mmrl.pipelines.flow.policy import FlowPolicy
from mmrl.pipelines.flow.schedule import plan_steps
from mmrl.pipelines.flow.sd3 import SD3Family
from mmrl.pipelines.flow.tiny import build_tiny_sd3

LORA = {"rank": 4, "alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    return build_tiny_sd3(tmp_path_factory.mktemp("tiny") / "sd3")


def make_policy(path, **kwargs):
    family = SD3Family.from_pretrained(str(path), dtype=torch.float32, max_sequence_length=32)
    defaults = dict(num_steps=6, eval_num_steps=6, resolution=32, guidance_scale=4.5, lora=dict(LORA))
    defaults.update(kwargs)
    return FlowPolicy(family, **defaults)


def test_ode_sampling_matches_diffusers_pipeline(tiny_sd3):
    from diffusers import StableDiffusion3Pipeline

    policy = make_policy(tiny_sd3)
    ours = policy.sample_eval(["a red apple"], [3, 4])
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3))
    generators = [torch.Generator().manual_seed(s) for s in (3, 4)]  # the pipeline's own noise draw per seed
    theirs = pipe("a red apple", num_images_per_prompt=2, num_inference_steps=6, guidance_scale=4.5, height=32,
                  width=32, generator=generators, output_type="pt", max_sequence_length=32).images
    torch.testing.assert_close(ours, theirs.float().clamp(0, 1), atol=1e-4, rtol=1e-4)


def test_dynamic_shifting_scheduler_matches_diffusers_pipeline(tiny_sd3):
    """An SD3 scheduler with use_dynamic_shifting needs the shift mu of the image's token count, as
    StableDiffusion3Pipeline computes it (mmrl raised the scheduler's "mu must be passed" error)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3))
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, use_dynamic_shifting=True)
    policy = FlowPolicy(SD3Family(pipe, max_sequence_length=32), num_steps=6, eval_num_steps=6, resolution=32,
                        guidance_scale=4.5, lora=dict(LORA))
    sigmas, _ = policy.family.schedule(6, 32)
    plain = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, use_dynamic_shifting=False)
    plain.set_timesteps(6)
    assert not torch.allclose(sigmas, plain.sigmas.float())  # the shift of 4 tokens differs from the static one
    ours = policy.sample_eval(["a red apple"], [3])
    reference = StableDiffusion3Pipeline(**{**pipe.components, "transformer": policy.transformer})
    with policy.reference():  # adapters off: the base transformer
        theirs = reference("a red apple", num_inference_steps=6, guidance_scale=4.5, height=32, width=32,
                           generator=[torch.Generator().manual_seed(3)], output_type="pt",
                           max_sequence_length=32).images
    torch.testing.assert_close(ours, theirs.float().clamp(0, 1), atol=1e-4, rtol=1e-4)


def test_recomputed_logprobs_equal_rollout_and_first_ratio_is_one(tiny_sd3):
    policy = make_policy(tiny_sd3)
    rollout = policy.rollout(["a cat", "a dog"], 3, generator=torch.Generator().manual_seed(0))
    assert rollout.old_logps.shape == (6, 5) and rollout.latents.shape[:2] == (6, 7)
    full = policy.logprobs(rollout, torch.arange(6))
    torch.testing.assert_close(full.logps, rollout.old_logps, atol=1e-6, rtol=0)
    # a shuffled minibatch over a subset of steps, as the trainer slices it
    idx, steps = torch.tensor([4, 1, 2]), torch.tensor([3, 0])
    out = policy.logprobs(rollout, idx, steps, with_kl=True)
    old = rollout.old_logps[idx][:, steps]
    loss = policy_loss(out.logps, old, torch.tensor([1.0, -1.0, 0.5]), kl=out.kl, beta=0.04, clip_low=1e-4)
    assert loss.metrics["ratio/min"].item() == 1.0 and loss.metrics["ratio/max"].item() == 1.0
    assert torch.equal(out.kl, torch.zeros_like(out.kl))  # fresh LoRA (B = 0): the policy is its reference


def test_only_lora_parameters_change(tiny_sd3):
    policy = make_policy(tiny_sd3)
    before = {k: v.clone() for k, v in policy.transformer.state_dict().items()}
    rollout = policy.rollout(["a cat"], 4, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    out = policy.logprobs(rollout, torch.arange(4))
    policy_loss(out.logps, rollout.old_logps, torch.tensor([1.0, -1.0, 0.5, -0.5]), clip_low=0.2).loss.backward()
    opt.step()
    after = policy.transformer.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "the update changed nothing"
    assert all("lora" in k for k in changed)
    assert all(p.requires_grad == ("lora" in n) for n, p in policy.transformer.named_parameters())


def test_reference_is_base_model_after_update(tiny_sd3):
    policy = make_policy(tiny_sd3)
    rollout = policy.rollout(["a cat"], 2, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for name, p in policy.named_trainable_parameters().items():
            if "lora_B" in name:
                p.add_(0.05)
    out = policy.logprobs(rollout, torch.arange(2), with_kl=True)
    assert torch.all(out.kl > 0)
    assert not torch.allclose(out.logps, rollout.old_logps)


def test_full_finetuning_reference_is_a_frozen_copy(tiny_sd3):
    policy = make_policy(tiny_sd3, lora=None)
    policy.init_reference()
    assert len(policy.trainable_parameters()) == len(list(policy.transformer.parameters()))
    rollout = policy.rollout(["a cat"], 2, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        next(iter(policy.transformer.parameters())).add_(0.1)
    out = policy.logprobs(rollout, torch.arange(2), with_kl=True)
    assert torch.all(out.kl > 0)


def test_window_modes_use_ode_outside_the_window(tiny_sd3):
    policy = make_policy(tiny_sd3, train_steps="sliding_window", window_size=2, window_shift_every=1)
    rollout = policy.rollout(["a cat"], 2, generator=torch.Generator().manual_seed(0), update=1)
    assert rollout.plan.train.tolist() == [1, 2]
    torch.testing.assert_close(rollout.noise_levels, torch.tensor([0.0, 0.7, 0.7, 0.0, 0.0, 0.0]))
    # the two samples start from different noise and the SDE only acts inside the window
    assert rollout.old_logps.shape == (2, 2)
    torch.testing.assert_close(policy.logprobs(rollout, torch.arange(2)).logps, rollout.old_logps, atol=1e-6, rtol=0)


@pytest.mark.parametrize("sde, expected", [("flow_grpo", 0.7), ("cps", 0.8), ("dance", 0.3)])
def test_noise_level_defaults_to_the_anchor_of_the_chosen_sde(tiny_sd3, sde, expected):
    """sampling.noise_level null (the config default) takes each SDE's anchor value: Flow-GRPO a = 0.7, Flow-GRPO's
    cps a = 0.8, DanceGRPO eta = 0.3; a number given is kept whatever the SDE."""
    from mmrl.config import config_from_dict

    config = config_from_dict({"rewards": {"jpeg_compressibility": 1.0}, "data": {"prompt_list": ["a cat"]}},
                             [f"sampling.sde={sde}"], check_files=False)
    assert config.sampling.noise_level is None
    policy = make_policy(tiny_sd3, sde=sde)
    assert policy.noise_level == expected
    rollout = policy.rollout(["a cat"], 1, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(rollout.noise_levels[rollout.plan.sde.bool()],
                               torch.full((int(rollout.plan.sde.sum()),), expected))
    assert make_policy(tiny_sd3, sde=sde, noise_level=0.5).noise_level == 0.5


def test_shared_group_noise(tiny_sd3):
    policy = make_policy(tiny_sd3, share_group_noise=True)
    rollout = policy.rollout(["a cat", "a dog"], 2, generator=torch.Generator().manual_seed(0))
    x0 = rollout.latents[:, 0]
    assert torch.equal(x0[0], x0[1]) and torch.equal(x0[2], x0[3]) and not torch.equal(x0[0], x0[2])
    assert not torch.equal(rollout.latents[0, -1], rollout.latents[1, -1])  # SDE noise still differs


def test_lora_export_loads_in_diffusers(tiny_sd3, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    policy = make_policy(tiny_sd3)
    with torch.no_grad():
        for name, p in policy.named_trainable_parameters().items():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    policy.export(str(tmp_path / "lora"))
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3))
    pipe.load_lora_weights(str(tmp_path / "lora"))
    latents = torch.randn((1, 16, 16, 16), generator=torch.Generator().manual_seed(5))
    theirs = pipe("a cat", num_inference_steps=6, guidance_scale=4.5, height=32, width=32, latents=latents,
                  output_type="pt", max_sequence_length=32).images
    ours = policy.sample_eval(["a cat"], [5])
    torch.testing.assert_close(ours, theirs.float().clamp(0, 1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "mode,kwargs,sde,train",
    [
        ("fraction", {"timestep_fraction": 0.99}, [True] * 10, list(range(9))),
        ("fraction", {"timestep_fraction": 0.5}, [True] * 10, list(range(5))),
        ("sliding_window", {"window_size": 4, "shift_every": 2, "update": 5}, None, [2, 3, 4, 5]),
        ("sliding_window", {"window_size": 4, "shift_every": 1, "update": 6}, None, [0, 1, 2, 3]),  # wraps at 6
    ],
)
def test_plan_steps(mode, kwargs, sde, train):
    plan = plan_steps(mode, 10, **kwargs)
    assert plan.train.tolist() == train
    if sde is not None:
        assert plan.sde.tolist() == sde
    else:
        assert plan.sde.nonzero().flatten().tolist() == train


def test_random_plans_are_seeded_and_in_range():
    for seed in range(20):
        w = plan_steps("random_window", 10, window_size=3, generator=torch.Generator().manual_seed(seed))
        assert w.train.tolist() == list(range(w.train[0].item(), w.train[0].item() + 3))
        assert 0 <= w.train[0].item() <= 2  # start <= S//2 - W
        f = plan_steps("random_fraction", 10, timestep_fraction=0.6, generator=torch.Generator().manual_seed(seed))
        assert len(f.train) == 5 and f.train.max().item() <= 8 and f.sde.all()  # DanceGRPO: int((10 - 1) * 0.6)
    a = plan_steps("random_fraction", 10, timestep_fraction=0.6, generator=torch.Generator().manual_seed(1))
    b = plan_steps("random_fraction", 10, timestep_fraction=0.6, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.train, b.train)
    with pytest.raises(ValueError, match="longer than"):
        plan_steps("random_window", 4, window_size=4)


def test_window_range_is_where_the_fast_window_starts(tiny_sd3):
    """sampling.window_range [lo, hi]: Flow-GRPO-Fast's sde_window_range, start uniform in lo..hi-W (its
    random.randint(lo, hi - W)); the default is the first half, [0, S // 2]; the built policy draws from it."""
    def starts(**kwargs):
        return {plan_steps("random_window", 10, window_size=2, generator=torch.Generator().manual_seed(seed),
                           **kwargs).train[0].item() for seed in range(200)}

    assert starts() == {0, 1, 2, 3} == starts(window_range=[0, 5])
    assert starts(window_range=[2, 7]) == {2, 3, 4, 5}
    assert starts(window_range=[0, 9]) == set(range(8))  # up to step 8: the last step (9) is never trained
    for bad, message in [([0, 10], "must lie in 0..9"), ([3, 4], "holds no window of 2"), ([1], "expected")]:
        with pytest.raises(ValueError, match=message):
            plan_steps("random_window", 10, window_size=2, window_range=bad)
    policy = make_policy(tiny_sd3, train_steps="random_window", window_size=2, window_range=[3, 5])
    rollout = policy.rollout(["a cat"], 1, generator=torch.Generator().manual_seed(0))
    assert rollout.plan.train.tolist() == [3, 4] and rollout.plan.sde.tolist() == [False] * 3 + [True] * 2 + [False]


# ------------------------------------------------------------------------------------------- negative prompt


def test_sd3_negative_prompt_is_used(tiny_sd3):
    plain = make_policy(tiny_sd3).sample_eval(["a cat"], [1])
    negative = make_policy(tiny_sd3, negative_prompt="blurry, dark").sample_eval(["a cat"], [1])
    assert not torch.allclose(plain, negative)


def test_sd3_resolution_outside_the_positional_embedding_is_a_clear_error(tiny_sd3):
    family = SD3Family.from_pretrained(str(tiny_sd3), dtype=torch.float32, max_sequence_length=32)
    config = family.transformer.config
    largest = config.pos_embed_max_size * config.patch_size * family.pipe.vae_scale_factor
    assert family.max_resolution() == largest
    assert family.latent_shape(largest)[1:] == (largest // family.pipe.vae_scale_factor,) * 2
    with pytest.raises(ValueError, match=f"covers {largest} px"):
        family.latent_shape(largest + config.patch_size * family.pipe.vae_scale_factor)
    with pytest.raises(ValueError, match="multiple of"):
        family.latent_shape(largest - 1)
    with pytest.raises(ValueError, match=f"at most {largest}"):  # at construction, not in the first rollout
        make_policy(tiny_sd3, resolution=2 * largest)
    policy = make_policy(tiny_sd3)
    with pytest.raises(ValueError, match=f"at most {largest}"):  # what mmrl eval's protocols set
        policy.resolution = 2 * largest
    assert policy.resolution == 32  # unchanged


def test_cfg_gradient_flows_through_the_conditional_branch_only_unless_asked(tiny_sd3):
    """Flow-GRPO's training forward detaches the unconditional half of the CFG batch (``scripts/train_sd3.py``
    ``compute_log_prob``: ``noise_pred_uncond.detach()``): the guided velocity's values are the usual ones, and its
    gradient is ``guidance_scale`` x the conditional branch's, written out here from a forward of that branch alone."""
    policy = make_policy(tiny_sd3)
    with torch.no_grad():  # non-zero adapters, so the LoRA gradients are not trivially structured
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    family, model = policy.family, policy.transformer
    cond = {k: v.detach() for k, v in family.encode(["a cat", "a dog"]).items()}
    negative = {k: v.detach() for k, v in family.encode([""]).items()}
    x = torch.randn((2, 16, 16, 16), generator=torch.Generator().manual_seed(0))
    t = torch.tensor([700.0, 700.0])
    weights = torch.randn((2, 16, 16, 16), generator=torch.Generator().manual_seed(1))
    params = policy.trainable_parameters()

    guided = family.velocity(model, x, t, cond, negative, 4.5)
    grads = torch.autograd.grad((guided * weights).sum(), params)
    text = family.velocity(model, x, t, cond, None, 1.0)
    expected = torch.autograd.grad((4.5 * text * weights).sum(), params)
    with torch.no_grad():
        uncond = family.velocity(model, x, t, {k: v.expand(2, *v.shape[1:]) for k, v in negative.items()}, None, 1.0)
    torch.testing.assert_close(guided, uncond + 4.5 * (text - uncond), atol=1e-5, rtol=1e-5)
    assert any(float(g.abs().max()) > 0 for g in grads)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=1e-6 + 1e-4 * float(e.abs().max()), rtol=1e-4)

    # detach_uncond=False (sampling.cfg_detach_uncond: false, the newest Flow-GRPO compute_log_prob): the same
    # values, and the gradient of uncond + 4.5 (text - uncond) through both branches, written out from the two
    # branches' forwards alone
    both = family.velocity(model, x, t, cond, negative, 4.5, detach_uncond=False)
    torch.testing.assert_close(both, guided, atol=0, rtol=0)
    grads_both = torch.autograd.grad((both * weights).sum(), params)
    uncond_graph = family.velocity(model, x, t, {k: v.expand(2, *v.shape[1:]) for k, v in negative.items()}, None, 1.0)
    text = family.velocity(model, x, t, cond, None, 1.0)
    expected_both = torch.autograd.grad((((1 - 4.5) * uncond_graph + 4.5 * text) * weights).sum(), params)
    differs = False
    for g, e, c in zip(grads_both, expected_both, expected):
        torch.testing.assert_close(g, e, atol=1e-6 + 1e-4 * float(e.abs().max()), rtol=1e-4)
        differs |= not torch.allclose(g, c, atol=1e-3 * float(c.abs().max()) + 1e-8, rtol=1e-3)
    assert differs  # the unconditional branch's gradient is really there


def test_final_image_prediction_decodes_the_last_clean_prediction(tiny_sd3):
    """final_image="prediction" (DanceGRPO's pred_original): the rollout's trajectory and log-probs are the same, the
    decoded image is that of x - sigma v at the last step instead of the last sampled latent."""
    sample = make_policy(tiny_sd3)
    prediction = make_policy(tiny_sd3, final_image="prediction")
    a = sample.rollout(["a cat"], 2, generator=torch.Generator().manual_seed(0))
    b = prediction.rollout(["a cat"], 2, generator=torch.Generator().manual_seed(0))
    assert a.plan.sde[-1]  # the last step is stochastic here
    torch.testing.assert_close(a.latents, b.latents, atol=0, rtol=0)
    torch.testing.assert_close(a.old_logps, b.old_logps, atol=0, rtol=0)
    with torch.no_grad():
        cond = {k: v[b.prompt_index] for k, v in b.cond.items()}
        last = b.latents[:, -2]
        v = prediction._velocity(prediction.transformer, last, torch.full((2,), len(b.timesteps) - 1), b.timesteps, cond)
        want = prediction.family.decode(last - b.sigmas[-2].item() * v)
    torch.testing.assert_close(b.images, want.cpu(), atol=1e-5, rtol=1e-5)
    assert (a.images - b.images).abs().max() > 1e-3  # the last step's own noise is not in the scored image
    with pytest.raises(ValueError, match="final_image"):
        make_policy(tiny_sd3, final_image="x0")


@pytest.mark.parametrize("detach", [True, False])
def test_the_policys_training_forward_passes_cfg_detach_uncond(tiny_sd3, monkeypatch, detach):
    """The policy's log-prob forward hands sampling.cfg_detach_uncond to the family's guided velocity (whose
    gradients under each setting are checked above against the branches' own)."""
    policy = make_policy(tiny_sd3, cfg_detach_uncond=detach)
    rollout = policy.rollout(["a cat"], 2, generator=torch.Generator().manual_seed(0))
    seen = []
    velocity = type(policy.family).velocity

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("detach_uncond"))
        return velocity(self, *args, **kwargs)

    monkeypatch.setattr(type(policy.family), "velocity", spy)
    policy.logprobs(rollout, torch.arange(2))
    assert seen and set(seen) == {detach}
