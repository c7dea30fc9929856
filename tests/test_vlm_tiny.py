"""Tiny Qwen2.5-VL / Qwen2-VL / Qwen3-VL: build offline, reload, chat template, image/video/text generation,
loss + gradients, determinism, cache reuse."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.pipelines.flow.tiny import _COMPLETE_MARKER
from mmrl.pipelines.vlm import tiny
from mmrl.pipelines.vlm.tiny import (
    build_tiny_qwen2_5_vl,
    build_tiny_qwen2_vl,
    build_tiny_qwen3_vl,
    build_tiny_vlm_tokenizer,
    ensure_tiny_vlm,
)

KINDS = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl")
BUILDERS = {"qwen2_5_vl": build_tiny_qwen2_5_vl, "qwen2_vl": build_tiny_qwen2_vl, "qwen3_vl": build_tiny_qwen3_vl}
MERGE = 2
PATCH = {"qwen2_5_vl": 14, "qwen2_vl": 14, "qwen3_vl": 16}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_vlm")
    return {kind: BUILDERS[kind](root / kind) for kind in KINDS}


@pytest.fixture(scope="module")
def loaded(built):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out = {}
    for kind, path in built.items():
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).eval()
        out[kind] = (processor, model)
    return out


def _image(h=56, w=84, seed=0):
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8))


def _prompt(processor, content):
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


def _check_generated(out, inputs, max_new):
    ids = inputs["input_ids"]
    assert out.shape[0] == ids.shape[0]
    assert ids.shape[1] < out.shape[1] <= ids.shape[1] + max_new
    assert torch.equal(out[:, : ids.shape[1]], ids)  # the prompt is echoed unchanged


# ------------------------------------------------------------------------------------------------
# Files, classes, configuration
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_reloads_as_the_real_classes_with_consistent_config(loaded, built, kind):
    import transformers

    processor, model = loaded[kind]
    expect_model = {"qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
                    "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
                    "qwen3_vl": transformers.Qwen3VLForConditionalGeneration}[kind]
    expect_proc = {"qwen2_5_vl": transformers.Qwen2_5_VLProcessor, "qwen2_vl": transformers.Qwen2VLProcessor,
                   "qwen3_vl": transformers.Qwen3VLProcessor}[kind]
    assert type(model) is expect_model and type(processor) is expect_proc
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    expect_video = "Qwen3VLVideoProcessor" if kind == "qwen3_vl" else "Qwen2VLVideoProcessor"
    assert type(processor.video_processor).__name__ == expect_video
    assert type(processor.tokenizer) is transformers.Qwen2TokenizerFast

    cfg, tok = model.config, processor.tokenizer
    for attr, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
        assert getattr(cfg, attr) == tok.convert_tokens_to_ids(token)
    text = cfg.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    assert text.vocab_size >= len(tok)
    vision = cfg.vision_config
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (PATCH[kind], MERGE, 2)
    assert processor.image_processor.merge_size == processor.video_processor.merge_size == MERGE
    assert processor.image_processor.patch_size == processor.video_processor.patch_size == PATCH[kind]
    if kind == "qwen3_vl":
        assert getattr(text, "head_dim", head_dim) == head_dim and text.rope_parameters["mrope_interleaved"]
        assert vision.out_hidden_size == text.hidden_size
        # DeepStack: each listed vision block feeds one of the first text layers
        assert len(vision.deepstack_visual_indexes) <= text.num_hidden_layers
        assert all(0 <= i < vision.depth for i in vision.deepstack_visual_indexes)
        assert int(vision.num_position_embeddings ** 0.5) ** 2 == vision.num_position_embeddings
    elif kind == "qwen2_5_vl":
        assert vision.out_hidden_size == text.hidden_size
        assert vision.window_size % (vision.patch_size * vision.spatial_merge_size) == 0
        assert all(0 <= i < vision.depth for i in vision.fullatt_block_indexes)
    else:
        assert vision.hidden_size == text.hidden_size
    # Generation stops at the end of an assistant turn (or end of text) and pads with <|endoftext|>.
    gen = model.generation_config
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert set(gen.eos_token_id) == {tok.eos_token_id, tok.pad_token_id}
    assert gen.pad_token_id == tok.pad_token_id
    n_params = sum(p.numel() for p in model.parameters())
    assert 100_000 < n_params < 1_500_000, n_params
    names = {p.name for p in Path(built[kind]).iterdir()}
    assert {"config.json", "model.safetensors", "processor_config.json", "tokenizer.json",
            "chat_template.jinja", "generation_config.json"} <= names


# ------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------


def test_tokenizer_vocabulary_is_pinned():
    """Golden ids: if this fails the vocabulary changed; bump VLM_TINY_VERSION (cached builds)."""
    tok = build_tiny_vlm_tokenizer()
    assert len(tok) == 603
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                                      "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]) == [
        589, 590, 591, 598, 599, 601, 602]
    assert tok.convert_ids_to_tokens(list(range(4))) == ["!", '"', "#", "$"]  # GPT-2 byte order


def test_tokenizer_covers_any_text_and_keeps_tags_short(loaded):
    tok = loaded["qwen2_5_vl"][0].tokenizer
    for text in ["The quick brown fox jumps over the lazy dog.", "Zürich — 東京 🙂\ttabs\n\nand  spaces",
                 "x = [1, 2.5e-3]; print(f'{x!r}')"]:
        ids = tok(text).input_ids
        assert tok.decode(ids) == text
        assert max(ids) < 589  # no special token from plain text
    for tag, n in (("<think>", 2), ("</think>", 3), ("<answer>", 2), ("</answer>", 3)):
        assert len(tok(tag).input_ids) == n, tok.tokenize(tag)
        assert tok.decode(tok(tag).input_ids) == tag
    # Listed words are single tokens, with and without a leading space.
    for word in ("assistant", " answer", " image", " reasoning"):
        assert len(tok(word).input_ids) == 1
    # Special tokens are atomic and dropped by skip_special_tokens; the tags are ordinary text.
    text = "<|im_start|>assistant\n<think>a</think><answer>two</answer><|im_end|>"
    ids = tok(text).input_ids
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>a</think><answer>two</answer>"


def test_chat_template_matches_qwen(loaded):
    processor = loaded["qwen2_5_vl"][0]
    content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "What is this?"}]
    text = _prompt(processor, content)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
                    "<|vision_start|><|video_pad|><|vision_end|>What is this?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    chat = [{"role": "system", "content": "Answer in <answer> tags."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "<answer>hello</answer>"}]
    assert processor.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>system\nAnswer in <answer> tags.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n<answer>hello</answer><|im_end|>\n")
    # The tokenizer alone loads the same template.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(processor.tokenizer.name_or_path, local_files_only=True)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False).endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------------------------------------
# Images, videos, text
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_image_placeholder_count_and_generate(loaded, kind):
    processor, model = loaded[kind]
    text = _prompt(processor, [{"type": "image"}, {"type": "text", "text": "What is this?"}])
    inputs = processor(text=[text], images=[_image(56, 84)], return_tensors="pt")
    thw = inputs["image_grid_thw"]
    # 56x84 px is within the pixel budget: 4x6 patches of 14 px (Qwen3-VL: resized to 64x96, 4x6 patches of 16)
    assert thw.tolist() == [[1, 4, 6]]
    n_pad = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert n_pad == int(thw.prod()) // MERGE**2 == 6
    assert inputs["pixel_values"].shape == (int(thw.prod()), 3 * 2 * PATCH[kind] ** 2)
    out = model.generate(**inputs, do_sample=True, max_new_tokens=8)
    _check_generated(out, inputs, 8)


def test_image_pixel_budget_is_small(loaded):
    processor, model = loaded["qwen2_5_vl"]
    text = _prompt(processor, [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}])
    inputs = processor(text=[text], images=[_image(480, 640), _image(20, 20, 1)], return_tensors="pt")
    tokens = (inputs["image_grid_thw"].prod(-1) // MERGE**2).tolist()
    assert 4 <= tokens[1] <= tokens[0] <= 64  # min_pixels 4*28*28 .. max_pixels 64*28*28
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == sum(tokens)
    _check_generated(model.generate(**inputs, do_sample=True, max_new_tokens=4), inputs, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_video_generate_uint8_tensor(loaded, kind):
    processor, model = loaded[kind]
    text = _prompt(processor, [{"type": "video"}, {"type": "text", "text": "Describe the video."}])
    frames = torch.randint(0, 256, (4, 3, 56, 56), dtype=torch.uint8)
    inputs = processor(text=[text], videos=[frames], video_metadata=[{"fps": 2.0, "total_num_frames": 4}],
                       return_tensors="pt")
    thw = inputs["video_grid_thw"]
    assert thw.tolist() == [[2, 4, 4]]  # 4 frames / temporal patch 2
    assert int((inputs["input_ids"] == model.config.video_token_id).sum()) == int(thw.prod()) // MERGE**2
    if kind == "qwen2_5_vl":
        # second_per_grid_ts = temporal_patch_size / fps
        assert inputs["second_per_grid_ts"].tolist() == [1.0]
    else:
        assert "second_per_grid_ts" not in inputs
    if kind == "qwen3_vl":
        # one "<t seconds><|vision_start|>...<|vision_end|>" per temporal grid step (mean time of its 2 frames)
        text_in = processor.tokenizer.decode(inputs["input_ids"][0])
        assert "<0.2 seconds><|vision_start|>" in text_in and "<1.2 seconds><|vision_start|>" in text_in
    _check_generated(model.generate(**inputs, do_sample=True, max_new_tokens=8), inputs, 8)


def test_video_pil_frames_odd_count_and_fps_handling(loaded):
    processor, model = loaded["qwen2_5_vl"]
    text = _prompt(processor, [{"type": "video"}, {"type": "text", "text": "What happens?"}])
    frames = [_image(60, 90, seed=i) for i in range(3)]
    inputs = processor(text=[text], videos=[frames], video_metadata=[{"fps": 4.0, "total_num_frames": 3}],
                       return_tensors="pt")
    assert inputs["video_grid_thw"][0, 0].item() == 2  # 3 frames padded to 4 -> 2 temporal patches
    assert inputs["second_per_grid_ts"].tolist() == [0.5]
    _check_generated(model.generate(**inputs, do_sample=True, max_new_tokens=8), inputs, 8)

    clip = torch.randint(0, 256, (8, 3, 56, 56), dtype=torch.uint8)
    # No metadata: the processor assumes 24 fps.
    no_meta = processor(text=[text], videos=[clip], return_tensors="pt")
    assert no_meta["second_per_grid_ts"].tolist() == pytest.approx([2 / 24])
    assert no_meta["video_grid_thw"][0, 0].item() == 4
    # fps= only resamples with do_sample_frames=True and the source fps in the metadata.
    sampled = processor(text=[text], videos=[clip], video_metadata=[{"fps": 4.0, "total_num_frames": 8}],
                        do_sample_frames=True, fps=2.0, return_tensors="pt")
    assert sampled["video_grid_thw"][0, 0].item() == 2  # 8 frames at 4 fps -> 4 frames at 2 fps
    assert sampled["second_per_grid_ts"].tolist() == [1.0]


@pytest.mark.parametrize("kind", KINDS)
def test_text_only_chat(loaded, kind):
    processor, model = loaded[kind]
    text = _prompt(processor, "What is two and two?")
    inputs = processor(text=[text], return_tensors="pt")
    assert "pixel_values" not in inputs and "pixel_values_videos" not in inputs
    _check_generated(model.generate(**inputs, do_sample=True, max_new_tokens=8), inputs, 8)


def test_batched_left_padded_image_generation(loaded):
    processor, model = loaded["qwen2_5_vl"]
    texts = [_prompt(processor, [{"type": "image"}, {"type": "text", "text": "What is" + " this" * i + "?"}])
             for i in range(4)]
    inputs = processor(text=texts, images=[_image(seed=i) for i in range(4)], padding=True,
                       padding_side="left", return_tensors="pt")
    assert inputs["attention_mask"].sum(1).tolist() == sorted(inputs["attention_mask"].sum(1).tolist())
    assert (inputs["attention_mask"][:, -1] == 1).all()  # left padded
    out = model.generate(**inputs, do_sample=True, max_new_tokens=16, min_new_tokens=16)
    assert out.shape == (4, inputs["input_ids"].shape[1] + 16)


def test_qwen3_vl_chat_template_and_deepstack_features(loaded):
    processor, model = loaded["qwen3_vl"]
    # Qwen3-VL adds no default system prompt
    text = _prompt(processor, [{"type": "image"}, {"type": "text", "text": "What is this?"}])
    assert text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    inputs = processor(text=[text], images=[_image()], return_tensors="pt")
    with torch.no_grad():
        out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
    n = int(inputs["image_grid_thw"].prod()) // MERGE**2
    assert [f.shape for f in out.pooler_output] == [(n, model.config.text_config.hidden_size)]
    assert len(out.deepstack_features) == len(model.config.vision_config.deepstack_visual_indexes)
    assert all([f.shape for f in layer] == [(n, model.config.text_config.hidden_size)]
               for layer in out.deepstack_features)


# ------------------------------------------------------------------------------------------------
# Training signal
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_forward_with_labels_gives_finite_loss_and_gradients(built, kind):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(built[kind], local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(built[kind], local_files_only=True).train()
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]},
            {"role": "assistant", "content": "<think>count</think><answer>two</answer>"}]
    text = processor.apply_chat_template(chat, tokenize=False)
    inputs = processor(text=[text], images=[_image()], return_tensors="pt")
    labels = inputs["input_ids"].clone()
    labels[labels == model.config.image_token_id] = -100
    out = model(**inputs, labels=labels)
    assert torch.isfinite(out.loss) and out.loss.item() > 0
    # Random init: close to uniform over the vocabulary.
    assert abs(out.loss.item() - math.log(model.config.text_config.vocab_size)) < 1.0
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "visual" in n)
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "lm_head" in n)


# ------------------------------------------------------------------------------------------------
# Determinism and the cache
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_builds_are_byte_identical(tmp_path, built, kind):
    again = BUILDERS[kind](tmp_path / "again")
    files = sorted(p.name for p in Path(built[kind]).iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (Path(built[kind]) / name).read_bytes() == (again / name).read_bytes(), name


def test_other_seed_changes_weights_not_tokenizer(tmp_path, built):
    from safetensors.torch import load_file

    other = build_tiny_qwen2_5_vl(tmp_path / "seed1", seed=1)
    base = Path(built["qwen2_5_vl"])
    w0, w1 = load_file(base / "model.safetensors"), load_file(other / "model.safetensors")
    assert w0.keys() == w1.keys()
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)
    for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "config.json"):
        assert (base / name).read_bytes() == (other / name).read_bytes(), name


def test_build_does_not_touch_caller_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_qwen2_vl(tmp_path / "rng")
    assert torch.equal(torch.rand(3), expected)


def test_ensure_tiny_vlm_builds_once_and_reuses(tmp_path, monkeypatch):
    path = ensure_tiny_vlm("qwen2_5_vl", tmp_path)
    assert path == tmp_path / f"tiny-qwen2_5_vl-{tiny.VLM_TINY_VERSION}"
    assert (path / _COMPLETE_MARKER).is_file() and (path / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left

    def no_rebuild(outdir, **kw):
        raise AssertionError("ensure_tiny_vlm rebuilt a complete cached build")

    monkeypatch.setitem(tiny._BUILDERS, "qwen2_5_vl", no_rebuild)
    assert ensure_tiny_vlm("qwen2_5_vl", tmp_path) == path


def test_ensure_tiny_vlm_env_cache_and_incomplete_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MMRL_CACHE", str(tmp_path / "cache"))
    stale = tmp_path / "cache" / f"tiny-qwen2_vl-{tiny.VLM_TINY_VERSION}"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("half a build")
    path = ensure_tiny_vlm("qwen2_vl")
    assert path == stale and not (path / "junk").exists() and (path / _COMPLETE_MARKER).is_file()


def test_ensure_tiny_vlm_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def broken(outdir, **kw):
        (Path(outdir) / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setitem(tiny._BUILDERS, "qwen2_vl", broken)
    with pytest.raises(RuntimeError, match="boom"):
        ensure_tiny_vlm("qwen2_vl", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_ensure_tiny_vlm_builds_qwen3_vl(tmp_path):
    path = ensure_tiny_vlm("qwen3_vl", tmp_path)
    assert path == tmp_path / f"tiny-qwen3_vl-{tiny.VLM_TINY_VERSION}" and (path / _COMPLETE_MARKER).is_file()
    assert '"model_type": "qwen3_vl"' in (path / "config.json").read_text()


def test_ensure_tiny_vlm_rejects_unknown_kind(tmp_path):
    with pytest.raises(ValueError, match="unknown kind"):
        ensure_tiny_vlm("llava", tmp_path)
    assert list(tmp_path.iterdir()) == []
