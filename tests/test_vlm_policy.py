"""The Qwen-VL policy on tiny Qwen2.5-VL / Qwen2-VL / Qwen3-VL models: rollouts, log-prob replay, padding, vision caching."""

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmrl.core.losses import policy_loss
from mmrl.data.video import VideoClip
from mmrl.pipelines.vlm.qwen import PromptTooLongError, QwenVLPolicy, _completion_mask, load_vlm
from mmrl.pipelines.vlm.tiny import _BUILDERS

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


@dataclass
class Item:
    question: str
    images: list = field(default_factory=list)
    video: VideoClip | None = None
    metadata: dict = field(default_factory=dict)
    source: str = "test:1"


def media(item):
    return item.images, item.video


def clip(frames: int = 4) -> VideoClip:
    g = torch.Generator().manual_seed(frames)
    pixels = torch.randint(0, 255, (frames, 3, 56, 56), generator=g, dtype=torch.uint8)
    return VideoClip(path="x.mp4", frames=pixels, indices=list(range(frames)), sample_fps=2.0, second_per_grid_ts=1.0,
                     duration=frames / 2.0, video_fps=2.0, total_frames=frames, original_size=(56, 56))


ITEMS = [
    Item("what colour is it?", [Image.new("RGB", (56, 84), (200, 10, 10))]),
    Item("count the boxes in both pictures", [Image.new("RGB", (84, 56), (10, 200, 10)), Image.new("RGB", (56, 56))]),
    Item("a question without any image"),
    Item("when does the person stand up?", video=clip(4)),
]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def model_path(request, tmp_path_factory):
    return str(_BUILDERS[request.param](tmp_path_factory.mktemp(request.param) / "model"))


def make_policy(path, **kwargs):
    model, processor = load_vlm(path, dtype="float32")
    defaults = dict(lora=dict(LORA), max_new_tokens=10, media=media, system_prompt="Answer briefly.")
    defaults.update(kwargs)
    return QwenVLPolicy(model, processor, **defaults)


def test_rollout_and_replayed_logprobs_match_generation(model_path):
    policy = make_policy(model_path)
    rollout = policy.rollout(ITEMS, 3, generator=torch.Generator().manual_seed(0))
    assert len(rollout) == 12 and rollout.completion_ids.shape[0] == 12
    assert rollout.group_ids.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert rollout.prompts[4] == ITEMS[1].question and len(rollout.completions) == 12
    assert_replay_matches_generation(policy, ITEMS[:1], do_sample=True)


def assert_replay_matches_generation(policy, items, *, do_sample: bool) -> None:
    """Replay the tokens ``generate`` produced for ``items[0]`` (6 new tokens) with ``policy.logprobs``: the same
    log-probs as generate's own logits, vision placeholders masked out of both (never sampled nor scored)."""
    inputs, vision, _ = policy.encode_prompts(items[:1])
    policy._encode_vision(vision)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        gen = policy.model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                    mm_token_type_ids=inputs["mm_token_type_ids"], **policy._vision_kwargs(vision),
                                    do_sample=do_sample, max_new_tokens=6, output_logits=True,
                                    return_dict_in_generate=True, eos_token_id=policy.eos_ids,
                                    pad_token_id=policy.pad_id, suppress_tokens=policy.suppressed_ids)
    raw = torch.stack(gen.logits, dim=1).float()
    raw[..., policy.suppressed_ids] = float("-inf")
    tokens = gen.sequences[:, inputs["input_ids"].shape[1]:]
    want = raw.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    single = policy.rollout(items[:1], 1, generator=torch.Generator().manual_seed(0))
    single.completion_ids = tokens
    single.mask = _completion_mask(tokens, policy.eos_ids).float()
    got = policy.logprobs(single, torch.tensor([0])).logps
    m = single.mask.bool()
    torch.testing.assert_close(got[m], want[m], atol=1e-4, rtol=1e-4)


def test_text_only_groups_replay_what_generation_sampled_from(model_path):
    """Prompts of different lengths and no image, several samples each, two rollouts in a row (the second with
    another group size): the replayed log-probs equal the sampling distribution's. The shared prefill of a text-only
    batch numbered the prefix over the left padding and kept the previous call's rope offsets: log-probs up to 0.85
    apart on Qwen3-VL, or a size error on the second rollout."""
    policy = make_policy(model_path, temperature=0.7)
    original = policy.model.generate
    seen = {}

    def generate(**kwargs):
        out = original(**kwargs, output_scores=True, return_dict_in_generate=True)
        seen["scores"] = torch.stack(out.scores, dim=1).float()
        return out.sequences

    policy.model.generate = generate
    items = [Item("yes?"), Item("which one is at the top of the picture and what colour is it, and why?")]
    for group in (2, 3):
        rollout = policy.rollout(items, group, generator=torch.Generator().manual_seed(group))
        width = rollout.completion_ids.shape[1]
        want = seen["scores"][:, :width].log_softmax(-1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
        got = policy.logprobs(rollout, torch.arange(len(rollout))).logps
        mask = rollout.mask.bool()
        assert (got[mask] - want[mask]).abs().max() < 1e-4, (group, float((got[mask] - want[mask]).abs().max()))


def test_logprobs_do_not_depend_on_batch_composition(model_path):
    """Left-padded prompts + right-padded completions, mixed image / two-image / text-only / video rows."""
    policy = make_policy(model_path)
    rollout = policy.rollout(ITEMS, 2, generator=torch.Generator().manual_seed(1))
    everything = policy.logprobs(rollout, torch.arange(len(rollout))).logps
    for i in range(len(rollout)):
        alone = policy.logprobs(rollout, torch.tensor([i])).logps
        mask = rollout.mask[i].bool()
        torch.testing.assert_close(alone[0][mask], everything[i][mask], atol=1e-5, rtol=1e-5)


def test_first_ratio_is_one_kl_zero_and_only_lora_trains(model_path):
    policy = make_policy(model_path)
    rollout = policy.rollout(ITEMS, 2, generator=torch.Generator().manual_seed(2))
    idx = torch.tensor([5, 0, 3])
    old = policy.logprobs(rollout, idx).logps.detach()
    out = policy.logprobs(rollout, idx, with_kl=True)
    result = policy_loss(out.logps, old, torch.tensor([1.0, -1.0, 0.5]), rollout.mask[idx], kl=out.kl, beta=0.04)
    assert result.metrics["ratio/min"].item() == 1.0 and result.metrics["ratio/max"].item() == 1.0
    assert torch.equal(out.kl, torch.zeros_like(out.kl))
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    opt = torch.optim.SGD(policy.trainable_parameters(), lr=0.5)
    result.loss.backward()
    opt.step()
    changed = {k for k, v in policy.model.state_dict().items() if not torch.equal(before[k], v)}
    assert changed and all("lora" in k for k in changed)
    assert not any("visual" in k for k in changed)
    after = policy.logprobs(rollout, idx, with_kl=True)
    assert after.kl[rollout.mask[idx].bool()].max() > 0
    # algorithm.kl_estimator reaches the policy's per-token KL: k1 is logp - ref on the same log-probs
    with torch.no_grad(), policy.reference():
        ref = policy.logprobs(rollout, idx).logps
    policy.kl_estimator = "k1"
    policy_k1 = policy.logprobs(rollout, idx, with_kl=True)
    torch.testing.assert_close(policy_k1.kl, policy_k1.logps - ref, atol=1e-6, rtol=0)


def count_encodes(policy, monkeypatch, calls: dict | None = None) -> dict:
    """Images / videos through the vision tower, outermost calls only (Qwen3-VL's video path calls the image one);
    ``calls`` (if given) counts the tower calls per kind."""
    model = policy.base_model.model
    seen = {"image": 0, "video": 0}
    active = []
    for kind in seen:
        original = getattr(model, f"get_{kind}_features")

        def counting(pixels, grid, *args, _original=original, _kind=kind, **kwargs):
            if not active:
                seen[_kind] += len(grid)
                if calls is not None:
                    calls[_kind] = calls.get(_kind, 0) + 1
            active.append(_kind)
            try:
                return _original(pixels, grid, *args, **kwargs)
            finally:
                active.pop()

        monkeypatch.setattr(model, f"get_{kind}_features", counting)
    return seen


def test_vision_is_encoded_once_per_prompt_per_update(model_path, monkeypatch):
    policy = make_policy(model_path)
    calls = {}
    seen = count_encodes(policy, monkeypatch, calls)
    rollout = policy.rollout(ITEMS, 4, generator=torch.Generator().manual_seed(3))
    for _ in range(2):  # two inner epochs of minibatches
        for idx in torch.arange(len(rollout)).split(5):
            policy.logprobs(rollout, idx)
    assert seen == {"image": 3, "video": 1}  # three images in two prompts, one video; 16 completions
    assert calls == {"image": 2, "video": 1}  # one tower call per prompt


def test_cached_vision_features_match_encoding_pixels_each_forward(model_path):
    """The cached path (mm_encoder_outputs; for Qwen3-VL with its DeepStack features) is the pixel path."""
    cached = make_policy(model_path, lora=None)
    rollout = cached.rollout(ITEMS, 2, generator=torch.Generator().manual_seed(5))
    assert all(v.image_features or v.video_features for v in rollout.vision[:2] + rollout.vision[3:])
    if "qwen3" in model_path:
        assert all(len(d) == 2 for v in rollout.vision for d in v.image_deepstack + v.video_deepstack)
        assert rollout.vision[1].image_deepstack and rollout.vision[3].video_deepstack
    pixels = make_policy(model_path, lora=None, freeze_vision=False)
    pixels._per_forward = False  # the pixels through the model's own forward, one copy per row (the FSDP2 path)
    idx = torch.arange(len(rollout))
    want = pixels.logprobs(rollout, idx).logps.detach()
    got = cached.logprobs(rollout, idx).logps
    mask = rollout.mask.bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)


def test_trained_tower_encodes_each_prompt_once_per_forward_with_the_pixel_paths_gradient(model_path, monkeypatch):
    """freeze_vision=False: the rollout encodes each prompt once, each gradient forward each distinct prompt of its
    rows once (the rows' gradients meet in the shared features); log-probs and gradients equal the pixel path's,
    which encodes one copy per row."""
    shared = make_policy(model_path, lora=None, freeze_vision=False)
    seen = count_encodes(shared, monkeypatch)
    rollout = shared.rollout(ITEMS, 3, generator=torch.Generator().manual_seed(6))
    assert seen == {"image": 3, "video": 1}  # 3 images in two prompts, one video; 12 completions
    pixels = make_policy(model_path, lora=None, freeze_vision=False)
    pixels._per_forward = False
    idx = torch.tensor([0, 1, 2, 3, 4, 9, 10])  # 3 + 2 rows of two image prompts, 2 rows of the video prompt
    weights = torch.linspace(-1.0, 1.0, rollout.mask.shape[1])
    for policy in (shared, pixels):
        policy.model.zero_grad()
        for k in seen:
            seen[k] = 0
        out = policy.logprobs(rollout, idx).logps
        (out * rollout.mask[idx] * weights).sum().backward()
        if policy is shared:
            assert seen == {"image": 3, "video": 1}  # each distinct prompt of the batch once
            got, got_grads = out.detach(), {n: p.grad.clone() for n, p in policy.named_trainable_parameters().items()
                                            if p.grad is not None}
    mask = rollout.mask[idx].bool()
    torch.testing.assert_close(got[mask], out.detach()[mask], atol=1e-5, rtol=1e-5)
    want_grads = {n: p.grad for n, p in pixels.named_trainable_parameters().items() if p.grad is not None}
    assert got_grads.keys() == want_grads.keys() and any("visual" in n for n in got_grads)
    for name, grad in want_grads.items():
        scale = grad.abs().max().clamp_min(1e-12)
        assert (got_grads[name] - grad).abs().max() <= 1e-4 * scale, name


def test_full_finetuning_trains_the_vision_tower_when_unfrozen(model_path):
    policy = make_policy(model_path, lora=None, freeze_vision=False)
    names = policy.named_trainable_parameters()
    assert any("visual" in n for n in names) and any("visual" not in n for n in names)
    rollout = policy.rollout(ITEMS[:2], 2, generator=torch.Generator().manual_seed(4))
    out = policy.logprobs(rollout, torch.arange(4))
    (out.logps * rollout.mask).sum().backward()
    grads = [p.grad for n, p in names.items() if "visual" in n]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    frozen = make_policy(model_path, lora=None, freeze_vision=True)
    assert not any("visual" in n for n in frozen.named_trainable_parameters())


def test_long_prompt_is_an_error_or_a_counted_skip(model_path):
    long_item = Item("describe " * 200, [Image.new("RGB", (56, 56))], source="data.jsonl:7")
    with pytest.raises(PromptTooLongError, match="data.jsonl:7"):
        make_policy(model_path, max_prompt_length=64).rollout([long_item], 2, generator=torch.Generator())
    policy = make_policy(model_path, max_prompt_length=64, skip_bad_samples=True)
    rollout = policy.rollout([long_item, ITEMS[0]], 2, generator=torch.Generator())
    assert len(rollout) == 2 and rollout.prompts == [ITEMS[0].question] * 2
    assert policy.skipped == {"prompt_too_long": 1}


def test_completion_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 6, 9, 7, 9], [5, 6, 7, 8, 4], [9, 1, 1, 1, 1]])
    assert _completion_mask(ids, [9]).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_shared_prefill_samples_the_same_tokens_and_prefills_each_prompt_once(model_path):
    """share_prompt_prefix in generation: each prompt is prefilled once and its KV cache repeated to its group's rows.
    Same seed, same sampled completions as one prefill per returned sequence (image, two-image, text-only and video
    rows); the language model sees the prompts once (all but their last token), then the expanded rows. (Greedy
    rollouts return one sequence per prompt: nothing to share.)"""
    shared = make_policy(model_path, max_new_tokens=8)
    rows = make_policy(model_path, max_new_tokens=8, share_prompt_prefix=False)
    rows.model.load_state_dict(shared.model.state_dict())
    seen = []
    hook = shared.base_model.model.language_model.register_forward_pre_hook(
        lambda module, args, kw: seen.append(tuple(kw["inputs_embeds"].shape[:2])), with_kwargs=True)
    a = shared.rollout(ITEMS, 3, generator=torch.Generator().manual_seed(5))
    hook.remove()
    b = rows.rollout(ITEMS, 3, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.completion_ids, b.completion_ids) and a.completions == b.completions
    prompt = a.prompt_ids.shape[1]
    assert seen[:2] == [(len(ITEMS), prompt - 1), (3 * len(ITEMS), 1)]


def test_static_cache_samples_the_same_tokens(model_path):
    """generation.cache_implementation: static decodes with HF's StaticCache (compiled on a GPU); on the same seed the
    sampled and the greedy completions are the dynamic cache's, for image, multi-image, text-only and video rows."""
    dynamic = make_policy(model_path, max_new_tokens=8)
    static = make_policy(model_path, max_new_tokens=8, cache_implementation="static")
    assert static.sampling_config().cache_implementation == "static"
    assert dynamic.sampling_config().cache_implementation is None  # HF's default: a DynamicCache
    for greedy in (False, True):
        a = dynamic.rollout(ITEMS, 2, generator=torch.Generator().manual_seed(3), greedy=greedy)
        b = static.rollout(ITEMS, 2, generator=torch.Generator().manual_seed(3), greedy=greedy)
        assert torch.equal(a.completion_ids, b.completion_ids) and a.completions == b.completions
    # the cache is sized to the power of two above prompt + new tokens (at least 256): few shapes to compile
    prompt = static.encode_prompts(ITEMS)[0]["input_ids"].shape[1]
    model = static.base_model
    assert model._previous_max_cache_length == max(256, 1 << (prompt + 8 - 1).bit_length())
    from mmrl.pipelines.vlm.qwen import static_cache_length
    assert [static_cache_length(n) for n in (1, 256, 257, 1000, 1025)] == [256, 256, 512, 1024, 2048]
    with pytest.raises(ValueError, match="cache_implementation"):
        make_policy(model_path, cache_implementation="paged")


def test_min_p_and_repetition_penalty_shape_sampling():
    """min_p = 1 keeps only the most likely token: the 3 samples of a prompt are one completion (without it, not). A
    huge repetition penalty (HF's: every token already in the sequence, prompt included) keeps any token from
    appearing twice."""
    path = str(_BUILDERS["qwen2_5_vl"](Path(tempfile.mkdtemp()) / "model"))
    free = make_policy(path, lora=None).rollout(ITEMS[:2], 3, generator=torch.Generator().manual_seed(1))
    assert any(len(set(free.completions[i:i + 3])) > 1 for i in (0, 3))
    sharp = make_policy(path, lora=None, min_p=1.0)
    assert sharp.sampling_config(group_size=3).min_p == 1.0
    sampled = sharp.rollout(ITEMS[:2], 3, generator=torch.Generator().manual_seed(1))
    assert all(len(set(sampled.completions[i:i + 3])) == 1 for i in (0, 3))
    assert any(len(set(ids[m > 0].tolist())) < int(m.sum()) for ids, m in zip(sampled.completion_ids, sampled.mask))
    fresh = make_policy(path, lora=None, min_p=1.0, repetition_penalty=1e9).rollout(
        ITEMS[:2], 1, generator=torch.Generator().manual_seed(1))
    for row in range(len(fresh)):
        ids = fresh.completion_ids[row][fresh.mask[row] > 0].tolist()
        prompt = set(fresh.prompt_ids[fresh.prompt_index[row]].tolist())
        assert len(set(ids)) == len(ids) and not set(ids) & prompt


@pytest.mark.parametrize("field,value", [("top_k", 1), ("top_p", 1e-6)])
def test_top_k_and_top_p_reach_sampling(field, value):
    """top_k = 1, or a top_p below the likeliest token's probability, keeps one token: the 3 samples of a prompt are
    one completion (without it, not)."""
    path = str(_BUILDERS["qwen2_5_vl"](Path(tempfile.mkdtemp()) / "model"))
    sharp = make_policy(path, lora=None, **{field: value})
    assert getattr(sharp.sampling_config(group_size=3), field) == value
    sampled = sharp.rollout(ITEMS[:2], 3, generator=torch.Generator().manual_seed(1))
    assert all(len(set(sampled.completions[i:i + 3])) == 1 for i in (0, 3))


def test_the_checkpoints_own_eos_ids_also_end_a_completion(model_path):
    """Generation stops at <|im_end|> / <|endoftext|> and at whatever generation_config.eos_token_id names (Qwen's
    own list is both; TRL's HF path stops at the tokenizer's EOS alone), so a checkpoint with an end token of its
    own is cut there too."""
    model, processor = load_vlm(model_path, dtype="float32")
    extra = processor.tokenizer.convert_tokens_to_ids(".")
    model.generation_config.eos_token_id = [extra]
    policy = QwenVLPolicy(model, processor, lora=dict(LORA), max_new_tokens=10, media=media)
    named = [processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    assert policy.eos_ids == [*named, extra] and policy.pad_id == processor.tokenizer.pad_token_id
    assert _completion_mask(torch.tensor([[5, extra, 7, 8]]), policy.eos_ids).tolist() == [[1, 1, 0, 0]]


def test_the_image_budget_leaves_the_video_processors_frame_budget_alone(model_path):
    """generation.min_pixels / max_pixels bound images only: passed to AutoProcessor.from_pretrained they also set
    the video processor's size, which is Qwen2/2.5-VL's per-frame floor and cap (1080p clip: 2,880 -> 10,764 video
    tokens under an image budget of 3136..12845056)."""
    _, plain = load_vlm(model_path, dtype="float32")
    _, budgeted = load_vlm(model_path, dtype="float32", min_pixels=3136, max_pixels=12845056)
    assert (budgeted.image_processor.size.get("shortest_edge"), budgeted.image_processor.size.get("longest_edge")) \
        == (3136, 12845056)
    assert dict(budgeted.video_processor.size) == dict(plain.video_processor.size)
    assert plain.video_processor.size.get("longest_edge") != 12845056


def test_lora_targets_that_match_no_language_module_are_a_config_error(model_path):
    from mmrl.config import ConfigError

    model, processor = load_vlm(model_path, dtype="float32")
    with pytest.raises(ConfigError, match=r"no language-model module matches model.lora_target_modules=\['nomatch'\]"):
        QwenVLPolicy(model, processor, lora={"rank": 2, "alpha": 4, "target_modules": ["nomatch"]}, media=media)


def test_a_model_folder_missing_its_chat_template_or_tokenizer_is_one_error_at_load(model_path, tmp_path):
    """Without chat_template.jinja a rollout fails in apply_chat_template; without tokenizer.json /
    tokenizer_config.json transformers falls back to a tokenizer that splits the vision placeholders and the first
    image fails deep in the processor. load_vlm names either at load time."""
    import shutil

    from mmrl.pipelines.flow.loading import ModelLoadError

    for missing, words in ((["chat_template.jinja"], "has no chat template"),
                           (["tokenizer.json", "tokenizer_config.json"], "its tokenizer does not read the model's")):
        folder = tmp_path / missing[0]
        shutil.copytree(model_path, folder)
        for name in missing:
            (folder / name).unlink()
        with pytest.raises(ModelLoadError, match=words):
            load_vlm(str(folder), dtype="float32")


def test_a_folder_that_is_not_a_model_says_what_it_is(tmp_path):
    """model.pretrained pointed at an mmrl sft run, a PEFT adapter or an mmrl train run said only "no config.json"."""
    import json as _json

    from mmrl.pipelines.flow.loading import ModelLoadError

    sft = tmp_path / "sft"
    (sft / "model").mkdir(parents=True)
    (sft / "mmrl_train.yaml").write_text("model: {}\n")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(_json.dumps({"base_model_name_or_path": "/models/base"}))
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for folder, words in ((sft, f"is an mmrl sft run: its result is the model {sft / 'model'}"),
                          (adapter, "a PEFT LoRA adapter on /models/base: merge it into its base first"),
                          (run, "an mmrl train run or checkpoint: give its checkpoints/step_<k>/export folder")):
        with pytest.raises(ModelLoadError) as info:
            load_vlm(str(folder), dtype="float32")
        assert "has no config.json" in str(info.value) and words in str(info.value), str(info.value)
