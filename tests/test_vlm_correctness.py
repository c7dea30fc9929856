"""Correctness of the Qwen-VL policy's training signal, on tiny Qwen2.5-VL / Qwen2-VL / Qwen3-VL models:
the KL penalty has TRL's gradient, sampling uses only the configured logits processors, the gradient-carrying
forward runs in train mode (gradient checkpointing, LoRA dropout) while every no-grad forward runs in eval mode,
the recorded image ``input_size`` is the processor's final size, a full-fine-tune reference keeps the
model's dtype, and Qwen2-VL / Qwen2.5-VL rope positions follow Qwen's reference layout after a video."""

import dataclasses

import pytest
import torch
from PIL import Image

from mmrl.build import vlm_media
from mmrl.config import Config
from mmrl.core.losses import policy_loss
from mmrl.data.video import VideoClip
from mmrl.data.vlm import VLMSample
from mmrl.pipelines.vlm.qwen import QwenVLPolicy, load_vlm
from mmrl.pipelines.vlm.tiny import _BUILDERS

from test_vlm_policy import (  # noqa: E402  (the policy tests' fixtures)
    LORA, Item, assert_replay_matches_generation, clip, media)

ITEMS = [
    Item("what colour is it?", [Image.new("RGB", (56, 84), (200, 10, 10))]),
    Item("a question without any image"),
    Item("when does the person stand up?", video=clip(4)),
]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def model_path(request, tmp_path_factory):
    return str(_BUILDERS[request.param](tmp_path_factory.mktemp(request.param) / "model"))


def make_policy(path, dtype="float32", **kwargs):
    model, processor = load_vlm(path, dtype=dtype)
    defaults = dict(lora=dict(LORA), max_new_tokens=8, media=media, system_prompt="Answer briefly.")
    defaults.update(kwargs)
    return QwenVLPolicy(model, processor, **defaults)


def move_adapters(policy, seed: int = 0, scale: float = 0.1) -> None:
    """Random non-zero lora_B: the adapted policy differs from the reference (PEFT initialises B to 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def plain_logps(policy, rollout, index) -> torch.Tensor:
    """Per-token log-probs of the stored completions from one plain model forward + log_softmax (TRL's recipe:
    logits of the completion positions / temperature; vision placeholders are never sampled)."""
    rows = rollout.prompt_index[index]
    completion = rollout.completion_ids[index]
    width = completion.shape[1]
    kwargs = {"input_ids": torch.cat([rollout.prompt_ids[rows], completion], 1),
              "attention_mask": torch.cat([rollout.prompt_mask[rows], rollout.mask[index].long()], 1),
              **policy._vision_kwargs([rollout.vision[r] for r in rows.tolist()])}
    if rollout.mm_token_type_ids is not None:
        kwargs["mm_token_type_ids"] = torch.cat([rollout.mm_token_type_ids[rows], torch.zeros_like(completion)], 1)
    logits = policy.model(**kwargs, use_cache=False).logits[:, -width - 1:-1].float() / policy.temperature
    logits[..., policy.suppressed_ids] = float("-inf")
    return logits.log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)


# ------------------------------------------------------------------------------------------- 1. KL gradient


def test_kl_penalty_has_trl_k3_gradient(model_path):
    policy = make_policy(model_path, temperature=0.9)
    move_adapters(policy)
    rollout = policy.rollout(ITEMS, 2, generator=torch.Generator().manual_seed(0))
    idx = torch.arange(len(rollout))
    mask = rollout.mask[idx]
    params = policy.trainable_parameters()
    with torch.no_grad():
        old = policy.logprobs(rollout, idx).logps
    zeros = torch.zeros(len(idx))

    def policy_grads(beta):
        out = policy.logprobs(rollout, idx, with_kl=True)
        loss = policy_loss(out.logps, old, zeros, mask, kl=out.kl, beta=beta, aggregation="grpo").loss
        return torch.autograd.grad(loss, params, allow_unused=True)

    # beta = 0: zero advantages give exactly no gradient
    assert all(g is None or torch.count_nonzero(g) == 0 for g in policy_grads(0.0))
    beta = 0.3
    got = policy_grads(beta)
    assert any(g is not None and g.abs().sum() > 0 for g in got)
    # TRL: per token exp(ref - logp) - (ref - logp) - 1 with the live logp and the reference detached
    live = plain_logps(policy, rollout, idx)
    with torch.no_grad(), policy.model.disable_adapter():
        ref = plain_logps(policy, rollout, idx)
    delta = ref - live
    k3 = torch.exp(delta) - delta - 1
    loss = (beta * (k3 * mask).sum(-1) / mask.sum(-1)).mean()
    want = torch.autograd.grad(loss, params)
    for g, w in zip(got, want):
        # float32 rounding scales with the largest entries summed, not with each entry: a tiny entry of a gradient
        # may differ by 1e-8 absolute between GEMM kernels (CPU-dependent), so the tolerance is relative to the max
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())


# ------------------------------------------------------------------------------- 2. only configured sampling


def test_sampling_ignores_the_checkpoint_generation_config(model_path, monkeypatch):
    """Real checkpoints ship repetition_penalty, top_k, ... in generation_config.json: sampling must use only the
    policy's settings, so the log-probs of the sampled tokens under generate's processed scores are the replayed
    ones."""
    policy = make_policy(model_path, max_new_tokens=12)
    shipped = policy.base_model.generation_config
    shipped.repetition_penalty, shipped.top_k, shipped.no_repeat_ngram_size = 1.5, 3, 2
    shipped.min_p, shipped.temperature, shipped.do_sample = 0.2, 0.3, True
    hf = policy.base_model
    original = hf.generate
    scores = []

    def capturing(*args, **kwargs):
        out = original(*args, **kwargs, output_scores=True, return_dict_in_generate=True)
        scores.append(torch.stack(out.scores, dim=1).float())
        return out.sequences

    monkeypatch.setattr(hf, "generate", capturing)
    rollout = policy.rollout(ITEMS, 3, generator=torch.Generator().manual_seed(1))
    (processed,) = scores
    want = processed.log_softmax(-1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    got = policy.logprobs(rollout, torch.arange(len(rollout))).logps
    m = rollout.mask.bool()
    assert m.sum() > len(rollout)
    torch.testing.assert_close(got[m], want[m], atol=1e-5, rtol=1e-5)
    # the checkpoint's config is left as it was
    assert hf.generation_config is shipped and shipped.repetition_penalty == 1.5


# ----------------------------------------------------- 3. gradient checkpointing in the training forward


def test_gradient_checkpointing_runs_in_the_training_forward_and_first_ratio_is_one(model_path):
    policy = make_policy(model_path, gradient_checkpointing=True)
    move_adapters(policy)
    calls = []
    layers = [m for m in policy.model.modules()
              if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func")]
    assert layers
    for layer in layers:
        def counting(*args, _f=layer._gradient_checkpointing_func, **kwargs):
            calls.append(1)
            return _f(*args, **kwargs)

        layer._gradient_checkpointing_func = counting
    rollout = policy.rollout(ITEMS, 2, generator=torch.Generator().manual_seed(2))
    idx = torch.arange(len(rollout))
    with torch.no_grad():
        old = policy.logprobs(rollout, idx).logps
    assert not calls  # generation and no-grad log-probs run in eval mode
    out = policy.logprobs(rollout, idx)
    assert calls  # the gradient-carrying forward is checkpointed
    # still in train mode until its backward, which recomputes the checkpointed layers (dropout included)
    assert policy.model.training
    assert torch.equal(out.logps, old)  # first ratio exactly 1
    (out.logps * rollout.mask).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.trainable_parameters())
    with torch.no_grad():
        policy.logprobs(rollout, idx)
    assert not policy.model.training  # the next no-grad forward runs in eval mode


def test_lora_dropout_with_checkpointing_gives_the_gradient_of_its_own_forward(model_path):
    """Dropout masks are replayed when checkpointed layers are recomputed in backward: the gradient equals the
    one without checkpointing under the same RNG state (it would not if the model left train mode before
    backward)."""
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(5)  # the same LoRA initialisation and adapter weights for both builds
        # one full row per sample in both (a checkpointed gradient forward cannot share the prompt's KV cache, and
        # with dropout the shared prompt would draw other masks)
        policy = make_policy(model_path, lora=dict(LORA, dropout=0.5), gradient_checkpointing=checkpointing,
                             share_prompt_prefix=False)
        move_adapters(policy, scale=0.5)
        rollout = policy.rollout(ITEMS, 2, generator=torch.Generator().manual_seed(3))
        idx = torch.arange(len(rollout))
        torch.manual_seed(11)
        out = policy.logprobs(rollout, idx, with_kl=True)
        (out.logps * rollout.mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.trainable_parameters()]))
    assert grads[1].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_rope_positions_computed_once_per_rollout_equal_the_models_own(model_path, monkeypatch):
    """The rope positions of the whole rollout, computed once and sliced per minibatch, give bit-identical
    log-probs to forwards where the model computes them itself, for any subset of a mixed image / text / video
    rollout; the model's ``compute_3d_position_ids`` runs once per rollout however many forwards read it (one full
    row per sample: the prompt-sharing forward needs the positions, tested apart)."""
    policy = make_policy(model_path, share_prompt_prefix=False)
    move_adapters(policy)
    rollout = policy.rollout(ITEMS, 2, generator=torch.Generator().manual_seed(4))
    core = policy.base_model.model
    calls = []
    original = core.compute_3d_position_ids

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(core, "compute_3d_position_ids", counting)
    subsets = [torch.arange(len(rollout)), torch.tensor([5, 0, 3]), torch.tensor([4]), torch.tensor([1, 2])]
    with torch.no_grad():
        cached = [policy.logprobs(rollout, idx).logps for idx in subsets]
    assert len(calls) == 1 and rollout.extras["rope_positions"].shape[1] == len(rollout)
    monkeypatch.setattr(QwenVLPolicy, "_rope_positions", lambda self, r: None)  # the model computes its own
    with torch.no_grad():
        own = [policy.logprobs(rollout, idx).logps for idx in subsets]
    assert len(calls) == 1 + len(subsets)
    for a, b in zip(cached, own):
        assert torch.equal(a, b)
    assert torch.equal(cached[1], cached[0][subsets[1]])


# ---------------------------------------------------------------------------------------- 4. LoRA dropout


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_lora_dropout_applies_in_the_training_forward_only(model_path, dropout):
    policy = make_policy(model_path, lora=dict(LORA, dropout=dropout))
    move_adapters(policy, scale=0.5)
    rollout = policy.rollout(ITEMS, 2, generator=torch.Generator().manual_seed(3))
    idx = torch.arange(len(rollout))
    with torch.no_grad():
        first = policy.logprobs(rollout, idx).logps
        again = policy.logprobs(rollout, idx).logps
    assert torch.equal(first, again)  # no-grad forwards are deterministic (eval mode)
    live = policy.logprobs(rollout, idx).logps
    m = rollout.mask.bool()
    assert torch.equal(live[m], first[m]) == (dropout == 0.0)


# ------------------------------------------------------------------------------------ 5. input_size metadata


def test_recorded_input_size_is_the_processor_input(model_path):
    policy = make_policy(model_path, lora=None)
    policy.media = vlm_media(Config(), policy.processor)
    sample = VLMSample("s", "where is it?", "[1, 2, 3, 4]",
                       images=[Image.new("RGB", (157, 61), (9, 90, 200)), Image.new("RGB", (47, 203), (90, 9, 20))])
    rollout = policy.rollout([sample], 2, generator=torch.Generator().manual_seed(4))
    patch = policy.processor.image_processor.patch_size
    grid = rollout.vision[0].image_grid_thw
    want = [[int(w) * patch, int(h) * patch] for _, h, w in grid.tolist()]
    assert rollout.metadata[0]["input_sizes"] == want and rollout.metadata[1]["input_size"] == want[0]
    assert rollout.metadata[0]["image_sizes"] == [[157, 61], [47, 203]]


def test_an_image_at_a_tight_budget_reaches_the_model_at_qwen_vl_utils_size(model_path):
    """min_pixels near max_pixels: qwen-vl-utils' size can lie below the minimum (smart_resize's downscaling branch
    does not check it), and transformers' smart_resize applied a second time would then upscale it. The processor,
    built with the run's budget as mmrl.build does, must take the image as resized (do_resize=False), so the model's
    grid is qwen-vl-utils' size and input_size (the boxes' frame) is the model's input."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as transformers_resize

    from mmrl.data.video import budget_size

    probe = load_vlm(model_path, dtype="float32")[1].image_processor
    factor, patch = probe.patch_size * probe.merge_size, probe.patch_size
    budget = 6 * factor * factor
    size = next((h, w) for h in range(2 * factor, 6 * factor) for w in range(2 * factor, 6 * factor)
                if transformers_resize(*budget_size(h, w, min_pixels=budget, max_pixels=budget, factor=factor),
                                       factor=factor, min_pixels=budget, max_pixels=budget)
                != budget_size(h, w, min_pixels=budget, max_pixels=budget, factor=factor))
    want_h, want_w = budget_size(*size, min_pixels=budget, max_pixels=budget, factor=factor)
    model, processor = load_vlm(model_path, dtype="float32", min_pixels=budget, max_pixels=budget)
    policy = QwenVLPolicy(model, processor, max_new_tokens=4)
    cfg = Config()
    cfg.generation.min_pixels = cfg.generation.max_pixels = budget
    policy.media = vlm_media(cfg, processor)
    sample = VLMSample("s", "where is it?", "[1, 2, 3, 4]",
                       images=[Image.new("RGB", (size[1], size[0]), (9, 90, 200))])
    _, vision, kept = policy.encode_prompts([sample])
    assert kept == [0]
    _, grid_h, grid_w = vision[0].image_grid_thw[0].tolist()
    assert [grid_w * patch, grid_h * patch] == [want_w, want_h] == sample.metadata["input_size"]
    # the blind control's grey canvases (mmrl eval blind=true) reach the model at the same size
    from mmrl.eval.vlm import grey_media

    policy.media = grey_media(policy.media)
    _, blind, _ = policy.encode_prompts([sample])
    assert torch.equal(blind[0].image_grid_thw, vision[0].image_grid_thw)


# ----------------------------------------------------------------------- 6. full fine-tune reference dtype


def test_full_finetune_reference_keeps_the_model_dtype(model_path):
    policy = make_policy(model_path, dtype="bfloat16", lora=None)
    trainable = policy.trainable_parameters()
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    policy.init_reference()
    with policy.reference() as ref:
        params = list(ref.parameters())
        assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in params)
        assert not ref.training
        loaded, _ = load_vlm(model_path, dtype="bfloat16")
        want = loaded.state_dict()
        assert all(torch.equal(v, want[k]) for k, v in ref.state_dict().items())


def test_offline_loads_without_hub_kernels(monkeypatch):
    """Offline, transformers' default hub kernels (fetched from the Hub, a failure on a GPU when not cached) are
    off unless the user set USE_HUB_KERNELS; online, or with the switch set, transformers decides."""
    from mmrl.pipelines.flow.loading import transformers_load_kwargs
    from mmrl.pipelines.vlm.tiny import ensure_tiny_vlm

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    assert transformers_load_kwargs() == {"use_kernels": False}
    model, _ = load_vlm(str(ensure_tiny_vlm("qwen2_5_vl")), dtype="float32")
    assert model.use_kernels is False
    monkeypatch.setenv("USE_HUB_KERNELS", "1")
    assert transformers_load_kwargs() == {}
    monkeypatch.delenv("USE_HUB_KERNELS")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert transformers_load_kwargs() == {}


# --------------------------------------------------------------------- 7. each distinct prompt once per forward


@pytest.mark.parametrize("setting", ["lora", "full", "trained_vision"])
def test_prompt_shared_forward_gives_the_full_rows_logprobs_and_gradients(model_path, setting):
    """``share_prompt_prefix``: a minibatch's distinct prompts run once and their completions on the KV cache. Its
    log-probs equal TRL's one-forward-per-row recipe and its gradients those of full rows (LoRA, full fine-tuning,
    and a trained vision tower, whose gradient reaches the tower through the shared prompt), and the language model
    really sees each prompt once."""
    kwargs = {"lora": dict(LORA)} if setting == "lora" else {"lora": None, "freeze_vision": setting != "trained_vision"}
    shared = make_policy(model_path, **kwargs)
    rows = make_policy(model_path, share_prompt_prefix=False, **kwargs)
    if setting == "lora":
        move_adapters(shared)
    rows.model.load_state_dict(shared.model.state_dict())
    rollout = shared.rollout(ITEMS, 3, generator=torch.Generator().manual_seed(6))
    idx = torch.tensor([4, 0, 7, 1, 5, 8, 3])  # the three prompts (image, text only, video), repeated, out of order
    mask = rollout.mask[idx].bool()
    seen = []
    language = shared.base_model.model.language_model
    hook = language.register_forward_pre_hook(
        lambda module, args, kw: seen.append(tuple(kw["inputs_embeds"].shape[:2])), with_kwargs=True)
    with torch.no_grad():
        live = shared.logprobs(rollout, idx).logps
    hook.remove()
    prompt_length, width = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    assert seen == [(3, prompt_length), (7, width)]  # not (7, prompt_length + width)
    with torch.no_grad():
        torch.testing.assert_close(live[mask], plain_logps(rows, rollout, idx)[mask], atol=2e-5, rtol=2e-5)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    grads = []
    for policy in (shared, rows):
        params = policy.trainable_parameters()
        grads.append(torch.autograd.grad((policy.logprobs(rollout, idx).logps * weights).sum(), params,
                                         allow_unused=True))
    if setting == "trained_vision":
        vision = [g for (name, _), g in zip(shared.named_trainable_parameters().items(), grads[0])
                  if shared._is_vision(name)]
        assert any(g is not None and g.abs().sum() > 0 for g in vision)  # the tower learns through the prompt
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-6 + 1e-5 * float(b.abs().max()), rtol=1e-4)


def test_prompt_sharing_steps_aside_where_it_cannot_apply(model_path):
    """One full row per sample when every prompt is distinct (nothing to share) and under gradient checkpointing, in
    its no-grad passes too (so the first ratio stays exactly 1); ``share_prompt_prefix`` is rejected for flows."""
    from mmrl.config import ConfigError, load_config

    for policy, index in ((make_policy(model_path), torch.tensor([0, 3, 6])),
                          (make_policy(model_path, gradient_checkpointing=True), torch.tensor([0, 1, 3]))):
        rollout = policy.rollout(ITEMS, 3, generator=torch.Generator().manual_seed(7))
        seen = []
        hook = policy.base_model.model.language_model.register_forward_pre_hook(
            lambda module, args, kw: seen.append(tuple(kw["inputs_embeds"].shape[:2])), with_kwargs=True)
        with torch.no_grad():
            policy.logprobs(rollout, index)
        hook.remove()
        assert seen == [(3, rollout.prompt_ids.shape[1] + rollout.completion_ids.shape[1])]
    with pytest.raises(ConfigError, match="share_prompt_prefix applies to VLM"):
        load_config(None, ["model.share_prompt_prefix=false"])


# ------------------------------------------------------------- 7. video frames at qwen-vl-utils' pixel budget


def _video_prompt_grid(policy, path, **generation):
    cfg = Config()
    cfg.generation.video_nframes = 4
    for key, value in generation.items():
        setattr(cfg.generation, key, value)
    policy.media = vlm_media(cfg, policy.processor)
    sample = VLMSample("v", "when does it change?", "[0.5, 1.0]", video_path=str(path), source="t.jsonl:1")
    _, vision, kept = policy.encode_prompts([sample])
    assert kept == [0]
    return vision[0].video_grid_thw.tolist()


def test_video_frames_reach_the_model_at_qwen_vl_utils_total_budget(model_path, tmp_path):
    """qwen-vl-utils fetch_video: per-frame max = max(min(frame cap, total / frames x 2), int(1.05 x min)), then
    smart_resize; the processor must not resize the frames again (Qwen's README passes do_resize=False)."""
    from fixtures import write_video

    path = write_video(tmp_path / "clip.mp4", num_frames=8, width=160, height=96, fps=4)
    policy = make_policy(model_path, lora=None)
    if "qwen3_vl" in model_path:
        # by default its video processor budgets the whole clip (tiny: 16 tokens a frame, 8 frames' worth): 96 x 160
        # is 15 tokens of 32 x 32, under both, so rounded to 96 x 160 (patch 16: grid [2, 6, 10])
        assert _video_prompt_grid(policy, path) == [[2, 6, 10]]
        # a qwen-vl-utils field asks for Qwen3-VL's own pipeline (fetch_video, image_patch_size 16: factor 32):
        # max(min(768 x 1024, 8192 / 4 x 2), int(1024 x 1.05)) = 4096 per frame; beta = sqrt(15360 / 4096) = 1.936,
        # floor(96 / 1.936 / 32) = 1, floor(160 / 1.936 / 32) = 2 -> 32 x 64, and the processor keeps it
        assert _video_prompt_grid(policy, path, video_min_pixels=1024, video_total_pixels=8192) == [[2, 2, 4]]
        # the floor alone: the default total (0.9 x 128000 x 1024) binds nothing, the cap 768 x 1024 neither; a floor
        # of 16384 (16 tokens) lifts 96 x 160: beta = sqrt(16384 / 15360) = 1.033, ceil(3.1) = 4, ceil(5.16) = 6
        assert _video_prompt_grid(policy, path, video_min_pixels=16384) == [[2, 8, 12]]
        return
    # tiny Qwen2/2.5-VL video processor: shortest_edge 3136, longest_edge 12544, patch 14 (factor 28).
    # total 4704 over 4 frames: max(min(12544, 4704 / 4 * 2), int(784 * 1.05)) = 2352 per frame; 96 x 160 is over
    # it, beta = sqrt(15360 / 2352) = 2.556: floor(96 / 2.556 / 28) = 1, floor(160 / 2.556 / 28) = 2 -> 28 x 56,
    # 1568 pixels: below the processor's own 3136 floor, which would have made it 56 x 84 (grid [2, 4, 6]).
    assert _video_prompt_grid(policy, path, video_min_pixels=784, video_total_pixels=4704) == [[2, 2, 4]]
    # defaults: floor 3136, cap 12544, total 0.9 x 128000 x 784 (no bind): beta = sqrt(15360 / 12544) = 1.107,
    # floor(3.10) = 3, floor(5.16) = 5 -> 84 x 140
    assert _video_prompt_grid(policy, path) == [[2, 6, 10]]
    # video_max_pixels is the last bound: min(2000, 12544) -> beta = sqrt(15360 / 2000) = 2.771: 28 x 56
    assert _video_prompt_grid(policy, path, video_max_pixels=2000) == [[2, 2, 4]]


# ---------------------------------------------------------------- 8. Qwen's rope layout after a video (not 5.x's)


def qwen_reference_positions(config, ids: list[int], image_grids: list, video_grids: list, seconds: list) -> list:
    """Qwen2-VL / Qwen2.5-VL rope positions ``[[t, h, w], ...]`` of one unpadded row by the rule of Qwen's own
    ``get_rope_index`` (transformers 4.x) and vLLM's ``get_mrope_input_positions``, written out here from
    that rule: a text token takes the running position on all three axes; a vision block lays out its merged
    (t, h, w) grid from the running position, t scaled by ``tokens_per_second`` x seconds per grid on a
    Qwen2.5-VL video (0 for an image, the grid index on Qwen2-VL), and the running position after it is the
    block's largest position + 1."""
    merge = config.vision_config.spatial_merge_size
    per_second = getattr(config.vision_config, "tokens_per_second", None)
    images, videos, clock = iter(image_grids), iter(video_grids), iter(seconds)
    out, running, i = [], 0, 0
    while i < len(ids):
        if ids[i] not in (config.image_token_id, config.video_token_id):
            out.append([running] * 3)
            running, i = running + 1, i + 1
            continue
        video = ids[i] == config.video_token_id
        t, h, w = next(videos if video else images)
        h, w = h // merge, w // merge
        step = (per_second * next(clock)) if video and per_second is not None else (1 if video else 0)
        block = [[running + int(k * step), running + y, running + x] for k in range(t) for y in range(h)
                 for x in range(w)]
        out += block
        running, i = max(max(p) for p in block) + 1, i + len(block)
    return out


def clip_at(fps: float, frames: int) -> VideoClip:
    """``clip(frames)`` sampled at ``fps``: Qwen2.5-VL's temporal rows are ``2 / fps`` seconds apart."""
    return dataclasses.replace(clip(frames), sample_fps=fps, second_per_grid_ts=2.0 / fps, video_fps=fps,
                               duration=frames / fps)


LONG_CLIP = [Item("when?", video=clip(16)), Item("what colour is it?", [Image.new("RGB", (56, 84), (200, 10, 10))]),
             Item("a question without any image"), Item("when does the person stand up?", video=clip(4)),
             Item("when?", video=clip_at(4.0, 8))]  # 0.5 s a row: 1 position apart on Qwen2.5-VL, not 0


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_text_after_a_video_takes_qwens_positions_in_sampling_replay_and_plain_forwards(family, tmp_path):
    """A 16-frame clip (8 temporal rows, t positions past the 4 x 4 grid's height and width) with a short
    question, and a 4 fps clip (rows 0.5 s apart): every row's positions are Qwen's reference rule (the text after
    a vision block at the block's maximum + 1), not transformers 5.x's (the block's spatial extent), in left-padded
    mixed batches; generation's own logits equal the replayed log-probs, and a plain ``model(...)`` forward reads
    the same positions."""
    policy = make_policy(str(_BUILDERS[family](tmp_path / "model")), system_prompt=None)
    config = policy.base_model.config
    rollout = policy.rollout(LONG_CLIP, 2, generator=torch.Generator().manual_seed(0))
    positions = policy._rope_positions(rollout)
    if family == "qwen2_5_vl":  # the 4 fps clip's rows are 0.5 s apart: a fractional step the layout must keep
        assert rollout.vision[4].second_per_grid_ts.tolist() == [0.5]
    for row in range(len(rollout)):
        prompt = rollout.prompt_index[row]
        mask = torch.cat([rollout.prompt_mask[prompt], rollout.mask[row].long()]).bool()
        ids = torch.cat([rollout.prompt_ids[prompt], rollout.completion_ids[row]])[mask].tolist()
        v = rollout.vision[prompt]
        want = qwen_reference_positions(
            config, ids, [] if v.image_grid_thw is None else v.image_grid_thw.tolist(),
            [] if v.video_grid_thw is None else v.video_grid_thw.tolist(),
            [] if v.second_per_grid_ts is None else v.second_per_grid_ts.tolist())
        assert positions[:, row, mask].T.tolist() == want
    # transformers' own layout for the long clip's row puts the text after it inside the clip's temporal range
    core = policy.base_model.model
    inputs, _, _ = policy.encode_prompts(LONG_CLIP[:1])
    grids = {k: inputs[k] for k in ("video_grid_thw", "second_per_grid_ts", "attention_mask") if k in inputs}
    theirs, _ = type(core).get_rope_index(core, inputs["input_ids"], inputs["mm_token_type_ids"], **grids)
    ours, deltas = core.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], **grids)
    video = inputs["input_ids"][0] == config.video_token_id
    after, clip_end = int(video.nonzero()[-1]) + 1, int(ours[:, 0][:, video].max())
    assert int(ours[0, 0, after]) == clip_end + 1 and int(theirs[0, 0, after]) <= clip_end
    assert deltas.tolist() == [[int(ours[0, 0].max()) + 1 - inputs["input_ids"].shape[1]]]
    # sampling read the same positions: generate's own logits are the replayed log-probs
    assert_replay_matches_generation(policy, LONG_CLIP[:1], do_sample=False)
    # a plain forward without positions (SFT, evaluation) computes them the same way
    idx = torch.arange(len(rollout))
    with torch.no_grad():
        torch.testing.assert_close(plain_logps(policy, rollout, idx) * rollout.mask,
                                   policy.logprobs(rollout, idx).logps * rollout.mask, atol=1e-5, rtol=1e-5)


def test_reference_rope_layout_applies_to_qwen2_families_only(model_path):
    from mmrl.pipelines.vlm.qwen import use_reference_rope_layout

    policy = make_policy(model_path)
    core = policy.base_model.model
    assert ("get_rope_index" in vars(core)) == ("qwen3_vl" not in model_path)
    assert use_reference_rope_layout(policy.base_model) == ("qwen3_vl" not in model_path)  # idempotent


# ------------------------------------------- 9. the video metadata qwen-vl-utils passes: timestamps and sampled fps


def reference_timestamps(indices: list[int], video_fps: float) -> list[str]:
    """Qwen3-VL's ``<t seconds>`` texts for frames ``indices`` of a ``video_fps`` source video, written out from
    qwen-vl-utils (metadata: the source fps and the sampled frames' indices in it) and Qwen3-VL's processor (each
    pair of frames: the mean of their times, one decimal)."""
    times = [i / video_fps for i in indices]
    return [f"<{(times[k] + times[k + 1]) / 2:.1f} seconds>" for k in range(0, len(times), 2)]


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_video_metadata_is_qwen_vl_utils(family, tmp_path):
    """A 24-frame 4 fps mp4 read at 2 fps samples frames 0, 2, ..., 10, 13, 15, ... 23 (qwen-vl-utils' rounded
    linspace, not evenly spaced): Qwen3-VL's timestamps are those frames' times in the source video (3.5 s for the
    fourth step, not 3.2), from ``start`` on when the clip is cut, in order when T-GRPO shuffles the frames (the
    pixels move, the clock does not); Qwen2.5-VL's seconds per temporal step stay 2 / sample fps; the vLLM request
    carries the same metadata."""
    from fixtures import write_video

    from mmrl.data.video import read_video

    path = write_video(tmp_path / "clip.mp4", num_frames=24, width=64, height=64, fps=4)
    policy = make_policy(str(_BUILDERS[family](tmp_path / "model")), lora=None)
    sample = VLMSample("v", "when does it change?", "[0.5, 1.0]", video_path=str(path), source="t.jsonl:1")
    for start, indices in ((None, [0, 2, 4, 6, 8, 10, 13, 15, 17, 19, 21, 23]),
                           (1.0, [4, 6, 8, 10, 12, 15, 17, 19, 21, 23])):
        clip_read = read_video(path, fps=2.0, start=start)
        assert clip_read.indices == indices and clip_read.sample_fps == 2.0
        policy.media = lambda s, c=clip_read: ([], c)
        inputs, vision, _ = policy.encode_prompts([sample])
        text = policy.tokenizer.decode(inputs["input_ids"][0])
        if family == "qwen3_vl":
            found = [t for t in text.split("<|vision_start|>")[:-1] if t.endswith(" seconds>")]
            assert [t[t.rindex("<"):] for t in found] == reference_timestamps(indices, 4.0)
        else:
            assert vision[0].second_per_grid_ts.tolist() == [1.0]
        shuffled, shuffled_vision, _ = policy.encode_prompts([sample], shuffle_frames=torch.Generator().manual_seed(1))
        assert torch.equal(shuffled["input_ids"], inputs["input_ids"])  # the same timestamps, in order
        assert not torch.equal(shuffled_vision[0].pixel_values_videos, vision[0].pixel_values_videos)
        request = policy._engine_prompt(text, [], clip_read)["multi_modal_data"]["video"][1]
        assert request["frames_indices"] == indices and request["fps"] == 4.0
        assert request["total_num_frames"] == 24 - 4 * (start or 0)
