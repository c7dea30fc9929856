"""Tiny, randomly initialised Qwen2.5-VL, Qwen2-VL and Qwen3-VL models + processors, built offline.

What they are for
-----------------
* **Tests.** Every VLM code path (chat templating, image/video preprocessing, sampling a group of
  completions, log-probabilities, loss/backward, LoRA, save/load) runs against a *real*
  ``Qwen2_5_VLForConditionalGeneration`` / ``Qwen2VLForConditionalGeneration`` and a real
  ``Qwen2_5_VLProcessor`` / ``Qwen2VLProcessor`` -- just very small ones. No mocks, no downloads.
* **The embedded CPU default.** A tiny VLM config needs some policy to run on a laptop without a
  GPU or network access; :func:`ensure_tiny_vlm` builds one once into the user cache and every later
  run reuses it.

The text they write is random (the weights are random); only shapes, dtypes, token bookkeeping,
determinism and the plumbing are meaningful.

Layout (mirrors the real checkpoints)
-------------------------------------
* Text decoder: hidden 64, 2 layers, 4 query heads x 16 dims, 2 KV heads (GQA), SwiGLU 128,
  M-RoPE with ``mrope_section = [2, 3, 3]`` (sums to head_dim / 2, the ratio of the real [16, 24, 24]),
  untied LM head. ``vocab_size`` is the tokenizer length rounded up to a multiple of 64 (as in the
  real models, the embedding has a few unused rows).
* Vision tower: patch 14, ``temporal_patch_size`` 2, ``spatial_merge_size`` 2 (one LLM token per
  28x28 pixels), depth 2, width 32, 2 heads. Qwen2.5-VL: SwiGLU MLP + RMSNorm, window attention
  with ``window_size`` 112 px (4x4 merged tokens), full attention in the last block
  (``fullatt_block_indexes=[1]``), ``tokens_per_second=2`` (as in the 3B/7B checkpoints).
  Qwen2-VL: quick-GELU MLP (``mlp_ratio`` 2), LayerNorm, full attention.
* Processor: ``Qwen2VLImageProcessor`` and ``Qwen2VLVideoProcessor`` (torchvision backends) with
  small pixel budgets -- images ``min_pixels=4*28*28 .. max_pixels=64*28*28`` (4..64 image tokens),
  video frames ``4*28*28 .. 16*28*28`` -- and the Qwen2-VL/2.5-VL chat template.

Qwen3-VL (:func:`build_tiny_qwen3_vl`, kind ``"qwen3_vl"``)
--------------------------------------------------------
The same text sizes (``head_dim`` 16, interleaved M-RoPE ``[2, 3, 3]``, q/k RMSNorm) and the same
tokenizer (Qwen3-VL uses the same special-token names for vision). Vision: patch 16 (one LLM token per
32x32 pixels), depth 3, width 32, learned position embeddings (8x8, interpolated), DeepStack from
blocks 0 and 1 into text layers 0 and 1. ``get_image_features`` / ``get_video_features`` return
``pooler_output`` *and* ``deepstack_features`` (per layer, per item); both are needed when
passing precomputed features through ``mm_encoder_outputs``. Processor: ``Qwen2VLImageProcessor``
(patch 16, mean = std = 0.5, 4..64 image tokens) and ``Qwen3VLVideoProcessor`` (4..16 tokens per
frame, frame sampling at 2 fps on by default). Videos need ``video_metadata`` (fps): the
processor writes ``<t seconds><|vision_start|><|video_pad|>*n<|vision_end|>`` for each temporal
grid step (nested inside the template's own ``<|vision_start|>..<|vision_end|>`` in transformers
5.x); there is no ``second_per_grid_ts``. The chat template adds no default system prompt.

Tokenizer
---------
A ``Qwen2TokenizerFast`` (in transformers 5 that name is ``Qwen2Tokenizer``: byte-level BPE with
Qwen's pre-tokenisation regex). It is *not* trained (the ``tokenizers`` BPE trainer does not give
the same ids from one run to the next). Its vocabulary is fixed:

1. the 256 byte-level symbols in GPT-2 order (ids 0..255, as in Qwen), so any text encodes;
2. merges that make each word of :data:`_WORDS` (and its space-prefixed form) one token, plus
   merges for the pieces of ``<think>``, ``</think>``, ``<answer>``, ``</answer>``. As in the
   real Qwen vocabulary the tags are *not* single tokens: Qwen's regex splits ``<think>`` into
   ``<think`` + ``>`` and ``</think>`` into ``</`` + ``think`` + ``>``, so each tag is 2 or 3
   tokens (``>\\n`` is one token too). Merges are derived by simulating BPE while they are
   appended, so each listed word provably becomes one token;
3. the Qwen special tokens, in Qwen's order: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``,
   ``<|object_ref_start|>``, ``<|object_ref_end|>``, ``<|box_start|>``, ``<|box_end|>``,
   ``<|quad_start|>``, ``<|quad_end|>``, ``<|vision_start|>``, ``<|vision_end|>``,
   ``<|vision_pad|>``, ``<|image_pad|>``, ``<|video_pad|>``.

``eos_token`` is ``<|im_end|>`` (end of an assistant turn, as in the Instruct checkpoints),
``pad_token`` is ``<|endoftext|>``, no BOS / UNK. The saved ``generation_config.json`` stops on
either ``<|im_end|>`` or ``<|endoftext|>`` and pads with ``<|endoftext|>``. Two builds with the
same seed write byte-identical files.

Videos
------
Pass videos to the processor as ``videos=[frames]`` with ``frames`` a uint8 tensor ``[T, 3, H, W]``
(or a ``[T, H, W, 3]`` numpy array, or a list of PIL images). Frame sampling is off
(``do_sample_frames=False``, the Qwen2-VL default), so all T frames are used; an odd T is padded
to a multiple of ``temporal_patch_size`` (2) by repeating the last frame, so
``video_grid_thw = [ceil(T/2), H'/14, W'/14]``. Give the frame rate as metadata (in transformers 5
there is no ``fps=`` / ``second_per_grid_ts=`` input to set it directly):
``video_metadata=[{"fps": 2.0, "total_num_frames": T}]`` (one dict or ``VideoMetadata`` per video;
``total_num_frames`` is required). Qwen2.5-VL's processor turns it into
``second_per_grid_ts = temporal_patch_size / fps`` (a list of floats, one per video; a tensor
with ``return_tensors="pt"``) next to ``pixel_values_videos`` / ``video_grid_thw``; pass all the
processor returns on to ``generate`` / ``forward`` (``second_per_grid_ts`` feeds the temporal
M-RoPE positions: ``tokens_per_second * second_per_grid_ts`` per grid step). Quirks:

* Without metadata the frame rate is taken to be 24 (``VideoMetadata.sampled_fps`` default), so
  ``second_per_grid_ts`` is ``2/24`` -- usually not what a decoded clip had.
* ``fps=`` on the processor call means "sample frames at this rate": it is silently ignored
  unless ``do_sample_frames=True`` and the metadata carries the source ``fps``; then
  ``second_per_grid_ts`` is ``2 / sampled_fps``.
* Qwen2-VL's processor returns no ``second_per_grid_ts`` (its temporal positions are frame-grid
  indices).

Batched generation needs left padding: ``processor(..., padding=True, padding_side="left")``
(the tokenizer's default ``padding_side`` is ``"right"``).
"""

from __future__ import annotations

from pathlib import Path

from mmrl.pipelines.flow.tiny import ensure_built, _seeded

__all__ = [
    "build_tiny_qwen2_5_vl",
    "build_tiny_qwen2_vl",
    "build_tiny_qwen3_vl",
    "ensure_tiny_vlm",
    "build_tiny_vlm_tokenizer",
    "VLM_TINY_VERSION",
    "QWEN_CHAT_TEMPLATE",
    "QWEN3_VL_CHAT_TEMPLATE",
]

#: Bumped whenever the architecture, vocabulary or seeding change; part of the cache dir name.
VLM_TINY_VERSION = "v1"

# ------------------------------------------------------------------------------------------------
# Deterministic tokenizer
# ------------------------------------------------------------------------------------------------

#: Qwen's special tokens up to ``<|video_pad|>``, in the order (and relative ids) of the real
#: Qwen2-VL / Qwen2.5-VL vocabularies (151643..151656 there).
_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)

#: Words that get whole-word tokens (bare and space-prefixed). Fixed and ordered: changing it
#: changes token ids, so bump VLM_TINY_VERSION if you do.
_WORDS = (
    # chat template / system prompt
    "system", "user", "assistant", "You", "are", "a", "helpful", "Picture", "Video",
    # reasoning-format prompts
    "think", "answer", "Answer", "the", "question", "Question", "first", "then", "reason",
    "reasoning", "process", "final", "in", "within", "tags", "and", "or", "of", "to", "is", "it",
    "this", "that", "what", "What", "How", "many", "which", "Which", "where", "there", "image",
    "video", "picture", "photo", "Describe", "describe", "Please", "please", "object", "objects",
    "box", "bounding", "point", "yes", "no", "Yes", "No", "with", "on", "at", "for", "from", "by",
    "as", "an", "be", "can", "not", "The", "A", "I", "color", "number", "left", "right", "top",
    "bottom", "red", "green", "blue", "cat", "dog", "person", "car", "one", "two", "three",
)

#: Byte-level pieces (raw text) that get their own tokens: the parts Qwen's pre-tokeniser cuts the
#: reasoning tags into, plus a few frequent punctuation/newline runs.
_PIECES = (
    "<think", "<answer", "</", ">", ">\n", ">\n\n", "\n\n", ".\n", ". ", ", ", "?", ".", ",", ":",
    " (", ")", "\n", "  ",
)


def _byte_alphabet() -> list[str]:
    """The 256 byte-level symbols in GPT-2 / Qwen order (== sorted by code point)."""
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet())


def _byte_encoder() -> dict[int, str]:
    """GPT-2's ``bytes_to_unicode``: byte value -> printable byte-level symbol."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
    bs += list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Plain BPE: repeatedly merge the adjacent pair with the lowest rank."""
    symbols = list(symbols)
    while len(symbols) > 1:
        best = min(range(len(symbols) - 1), key=lambda i: ranks.get((symbols[i], symbols[i + 1]), 1 << 30))
        pair = (symbols[best], symbols[best + 1])
        if pair not in ranks:
            break
        merged, i = [], 0
        while i < len(symbols):
            if i < len(symbols) - 1 and (symbols[i], symbols[i + 1]) == pair:
                merged.append(symbols[i] + symbols[i + 1])
                i += 2
            else:
                merged.append(symbols[i])
                i += 1
        symbols = merged
    return symbols


def _vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte alphabet + merges making every listed word/piece a single token + special tokens.

    Merges are appended greedily: the current merges are applied to the next word and, while it is
    still split, a merge of its first two pieces is appended. A merge appended later has a lower
    priority than every earlier one, so it can never change how an earlier word is segmented: each
    listed word ends as exactly one token.
    """
    enc = _byte_encoder()
    tokens = _byte_alphabet()
    seen = set(tokens)
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    items = [w for word in _WORDS for w in (word, " " + word)] + list(_PIECES)
    for text in items:
        symbols = [enc[b] for b in text.encode("utf-8")]
        parts = _bpe(symbols, ranks)
        while len(parts) > 1:
            pair = (parts[0], parts[1])
            ranks[pair] = len(merges)
            merges.append(pair)
            if pair[0] + pair[1] not in seen:
                tokens.append(pair[0] + pair[1])
                seen.add(pair[0] + pair[1])
            parts = _bpe(symbols, ranks)
    tokens += list(_SPECIAL_TOKENS)
    return {tok: i for i, tok in enumerate(tokens)}, merges


_TEMPLATE_START = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
)
_TEMPLATE_DEFAULT_SYSTEM = (
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
)
_TEMPLATE_MESSAGES = (
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: The Qwen2-VL / Qwen2.5-VL Instruct chat template (identical in both), verbatim.
QWEN_CHAT_TEMPLATE = _TEMPLATE_START + _TEMPLATE_DEFAULT_SYSTEM + _TEMPLATE_MESSAGES

#: The Qwen3-VL Instruct chat template reduced to what the tiny model needs: no tool calls / tool
#: responses (the real one has them) and, unlike Qwen2-VL, no default system prompt. Vision items render
#: exactly as in the real template; a video's single ``<|video_pad|>`` is expanded by the processor into
#: ``<t seconds><|vision_start|><|video_pad|>*n<|vision_end|>`` per temporal grid step.
QWEN3_VL_CHAT_TEMPLATE = _TEMPLATE_START + _TEMPLATE_MESSAGES

_MODEL_MAX_LENGTH = 32768


def build_tiny_vlm_tokenizer(chat_template: str = QWEN_CHAT_TEMPLATE):
    """The deterministic tiny Qwen tokenizer (a ``Qwen2TokenizerFast``), with the chat template."""
    from transformers import Qwen2TokenizerFast

    vocab, merges = _vocab_and_merges()
    tok = Qwen2TokenizerFast(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in _SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
        model_max_length=_MODEL_MAX_LENGTH,
        errors="replace",
        split_special_tokens=False,
        clean_up_tokenization_spaces=False,
        chat_template=chat_template,
    )
    return tok


# ------------------------------------------------------------------------------------------------
# Processor and model
# ------------------------------------------------------------------------------------------------

_PATCH, _TEMPORAL_PATCH, _MERGE = 14, 2, 2
_IMAGE_MIN_PIXELS, _IMAGE_MAX_PIXELS = 4 * 28 * 28, 64 * 28 * 28
_VIDEO_MIN_PIXELS, _VIDEO_MAX_PIXELS = 4 * 28 * 28, 16 * 28 * 28
_TEXT_HIDDEN = 64


def _processor(kind: str, tokenizer):
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    common = dict(patch_size=_PATCH, temporal_patch_size=_TEMPORAL_PATCH, merge_size=_MERGE)
    image_processor = Qwen2VLImageProcessor(min_pixels=_IMAGE_MIN_PIXELS, max_pixels=_IMAGE_MAX_PIXELS, **common)
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=_VIDEO_MIN_PIXELS,
        max_pixels=_VIDEO_MAX_PIXELS,
        # qwen-vl-utils' behaviour (also the transformers default from v5.22 on); setting it
        # silences a per-call warning.
        cap_pixels_per_frame=True,
        **common,
    )
    cls = Qwen2_5_VLProcessor if kind == "qwen2_5_vl" else Qwen2VLProcessor
    return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
               chat_template=QWEN_CHAT_TEMPLATE)


def _text_config(tokenizer) -> dict:
    vocab_size = -(-len(tokenizer) // 64) * 64
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return dict(
        vocab_size=vocab_size,
        hidden_size=_TEXT_HIDDEN,
        intermediate_size=2 * _TEXT_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=_MODEL_MAX_LENGTH,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        max_window_layers=2,
        # head_dim 16 -> 8 rotary frequencies split over (t, h, w) like the real [16, 24, 24].
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=eot,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )


def _vision_token_ids(tokenizer) -> dict:
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    )}
    return ids


def _generation_config(tokenizer):
    from transformers import GenerationConfig

    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return GenerationConfig(bos_token_id=eot, eos_token_id=[tokenizer.eos_token_id, eot], pad_token_id=eot)


def _save(model, processor, outdir: str | Path) -> Path:
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(outdir, safe_serialization=True)
    processor.save_pretrained(outdir)
    return outdir


def build_tiny_qwen2_5_vl(outdir: str | Path, *, seed: int = 0, text_overrides: dict | None = None) -> Path:
    """Build a random-weight ``Qwen2_5_VLForConditionalGeneration`` (tiny) and its
    ``Qwen2_5_VLProcessor``; ``save_pretrained`` both into ``outdir`` and return it as a ``Path``.
    ``text_overrides`` replace text-config fields (vLLM's CPU attention needs a head size of at least 32:
    ``{"num_attention_heads": 2, "num_key_value_heads": 1, "rope_parameters": {..., "mrope_section": [4, 6, 6]}}``).

    Load with ``AutoModelForImageTextToText.from_pretrained(outdir)`` (or the specific class) and
    ``AutoProcessor.from_pretrained(outdir)``.
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = build_tiny_vlm_tokenizer()
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        hidden_act="silu",
        in_channels=3,
        patch_size=_PATCH,
        spatial_merge_size=_MERGE,
        temporal_patch_size=_TEMPORAL_PATCH,
        tokens_per_second=2,
        window_size=4 * _PATCH * _MERGE,  # 112 px: 4x4 merged tokens per window
        fullatt_block_indexes=[1],
        out_hidden_size=_TEXT_HIDDEN,
    )
    config = Qwen2_5_VLConfig(text_config={**_text_config(tokenizer), **(text_overrides or {})}, vision_config=vision,
                              tie_word_embeddings=False, **_vision_token_ids(tokenizer))
    with _seeded(seed):
        model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.generation_config = _generation_config(tokenizer)
    return _save(model, _processor("qwen2_5_vl", tokenizer), outdir)


def build_tiny_qwen2_vl(outdir: str | Path, *, seed: int = 0) -> Path:
    """Build a random-weight ``Qwen2VLForConditionalGeneration`` (tiny) and its
    ``Qwen2VLProcessor``; ``save_pretrained`` both into ``outdir`` and return it as a ``Path``."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tokenizer = build_tiny_vlm_tokenizer()
    vision = dict(
        depth=2,
        embed_dim=32,
        hidden_size=_TEXT_HIDDEN,  # Qwen2-VL: the merger's output width (= text hidden size)
        mlp_ratio=2,
        num_heads=2,
        hidden_act="quick_gelu",
        in_channels=3,
        patch_size=_PATCH,
        spatial_merge_size=_MERGE,
        temporal_patch_size=_TEMPORAL_PATCH,
    )
    config = Qwen2VLConfig(text_config=_text_config(tokenizer), vision_config=vision,
                           tie_word_embeddings=False, **_vision_token_ids(tokenizer))
    with _seeded(seed):
        model = Qwen2VLForConditionalGeneration(config).eval()
    model.generation_config = _generation_config(tokenizer)
    return _save(model, _processor("qwen2_vl", tokenizer), outdir)


# Qwen3-VL: patch 16 (one LLM token per 32x32 pixels); same token budgets as the Qwen2 builds.
_Q3_PATCH = 16
_Q3_FACTOR = _Q3_PATCH * _MERGE


def _qwen3_vl_processor(tokenizer):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    common = dict(patch_size=_Q3_PATCH, temporal_patch_size=_TEMPORAL_PATCH, merge_size=_MERGE)
    # as in the real checkpoints: the Qwen2-VL image processor with patch 16 and mean = std = 0.5
    norm = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": 4 * _Q3_FACTOR**2, "longest_edge": 64 * _Q3_FACTOR**2}, **norm, **common)
    video_processor = Qwen3VLVideoProcessor(
        # smart_resize budgets count all frames: at most 16 tokens per frame (max_video_tokens with the
        # per-frame cap) and 8 frames' worth in total; at least 4 tokens.
        size={"shortest_edge": 4 * _Q3_FACTOR**2, "longest_edge": 8 * 16 * _Q3_FACTOR**2},
        max_video_tokens=16,
        cap_pixels_per_frame=True,
        **norm,
        **common,
    )
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                            chat_template=QWEN3_VL_CHAT_TEMPLATE)


def build_tiny_qwen3_vl(outdir: str | Path, *, seed: int = 0) -> Path:
    """Build a random-weight ``Qwen3VLForConditionalGeneration`` (tiny) and its ``Qwen3VLProcessor``;
    ``save_pretrained`` both into ``outdir`` and return it as a ``Path``.

    Differences from the Qwen2 builds (as in the real models): vision patch 16 (32x32 px per LLM token),
    learned (interpolated) position embeddings, DeepStack (vision blocks ``deepstack_visual_indexes``
    feed extra mergers whose outputs are added to the hidden states of the first text layers at the
    vision positions), interleaved M-RoPE, and q/k RMSNorm in the text attention. The video processor
    samples frames at 2 fps by default (``do_sample_frames=True``) and the processor writes a
    ``<t seconds>`` timestamp before each temporal grid step, so it needs ``video_metadata`` (fps).
    There is no ``second_per_grid_ts``: time is carried by the timestamps in the text.
    """
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = build_tiny_vlm_tokenizer(QWEN3_VL_CHAT_TEMPLATE)
    vocab_size = -(-len(tokenizer) // 64) * 64
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text = dict(
        vocab_size=vocab_size,
        hidden_size=_TEXT_HIDDEN,
        intermediate_size=2 * _TEXT_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=_TEXT_HIDDEN // 4,
        hidden_act="silu",
        max_position_embeddings=_MODEL_MAX_LENGTH,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True},
        bos_token_id=eot,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        hidden_act="gelu_pytorch_tanh",
        in_channels=3,
        patch_size=_Q3_PATCH,
        spatial_merge_size=_MERGE,
        temporal_patch_size=_TEMPORAL_PATCH,
        out_hidden_size=_TEXT_HIDDEN,
        num_position_embeddings=64,  # an 8x8 grid, bilinearly interpolated to each image's patch grid
        deepstack_visual_indexes=[0, 1],  # -> added to text layers 0 and 1
    )
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                           **_vision_token_ids(tokenizer))
    with _seeded(seed):
        model = Qwen3VLForConditionalGeneration(config).eval()
    model.generation_config = _generation_config(tokenizer)
    return _save(model, _qwen3_vl_processor(tokenizer), outdir)


_BUILDERS = {"qwen2_5_vl": build_tiny_qwen2_5_vl, "qwen2_vl": build_tiny_qwen2_vl, "qwen3_vl": build_tiny_qwen3_vl}


def ensure_tiny_vlm(kind: str, cache_dir: str | Path | None = None) -> Path:
    """Return the path of the tiny ``kind`` VLM (``"qwen2_5_vl"``, ``"qwen2_vl"`` or ``"qwen3_vl"``), built once as
    ``tiny-<kind>-<VLM_TINY_VERSION>`` with the same atomic cache as the tiny pipelines
    (:func:`mmrl.pipelines.flow.tiny.ensure_built`)."""
    if kind not in _BUILDERS:
        raise ValueError(f"ensure_tiny_vlm: unknown kind {kind!r}; expected one of {sorted(_BUILDERS)}")
    return ensure_built(f"tiny-{kind}-{VLM_TINY_VERSION}", _BUILDERS[kind], cache_dir)
