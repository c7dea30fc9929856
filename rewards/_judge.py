"""Judged perception rewards: a FROZEN Qwen-VL judge reads a sample's media, the policy's response and the
sample's reference annotations, and its answers become the score.

The five rewards built on this module (``perception_r1``, ``claimdiff``, ``medix_composite``, ``pest_feature``,
``video_ver``) are text rewards (they score what a vision-language policy wrote) with the text-reward contract
of :mod:`mmrl.rewards._text`::

    scores = reward(completions, prompts, metadata)   # -> {name: [N], extra keys: [N]}

* judged: a number;
* **unparseable** response (empty, no ``<think>``/``<answer>`` block where the reward reads one): main score 0,
  counted in ``last_info["num_unparseable"]`` / ``["unparseable"]`` / ``["unparseable_samples"]``; the judge is
  not called for it;
* **not judgeable**: the sample's metadata lacks the media or the annotations the reward needs, a media file does
  not open, a template field is missing, or the judge failed or wrote something unreadable: every key NaN, the
  reason in ``last_info["nan_samples"]``. Never an exception for one bad sample; a wrongly shaped batch raises
  ``ValueError`` (:func:`~mmrl.rewards._text.check_text_batch`).

What the judge answered is kept: ``last_info["judge"]`` maps each sample index to the list of its judge calls,
``{"kind": "yes_no", "label": ..., "p_yes": p, "logit_yes_no": m}`` (a yes/no question),
``{"kind": "generate", "label": ..., "text": decoded}`` (free text) or ``{"kind": "embed", "label": ..., "norm":
float}`` (an embedding), plus any parse notes the reward adds; ``last_info["judge_forwards"]`` counts the model
forwards (``generate`` calls) the batch took.

The judge (:class:`JudgeVLM`) is :mod:`mmrl.rewards.vlm_judge`'s Qwen-VL scorer (its loading, placement, dtype,
chat templating and yes-probability rule: ``P(yes) = sum exp(logit[YES]) / sum exp(logit[YES or NO])`` over the
single-token "yes"/"no" variants, at the first answer position) with three additions: any number of images per
query (video frames), greedy generation, and text embeddings from the judge's own language model. Every query
of a batch, from every sample, is run ``batch_size`` per forward (left padding); a chunk whose forward fails is
re-run one query at a time, so one bad query costs only its own sample. Rewards built from the same checkpoint
name (``model="Qwen/..."`` / a directory / ``tiny:...``) with the same device, dtype and pixel budget share ONE
loaded model (it is frozen), so five judged rewards in a config hold one copy of the judge.

Media (metadata fields; the first present one is used)
-------------------------------------------------------
* images: ``image`` / ``image_path`` (a path or a PIL image), ``images`` / ``image_paths`` (a list of them);
* video: ``frames`` (a list of PIL images or paths, or a uint8 ``[T, 3, H, W]`` tensor), else ``video`` /
  ``video_path`` (a file, read with :func:`mmrl.data.video.read_video`).

Relative paths are resolved against the reward's ``media_root`` (default: the working directory). In a training
run the VLM data loader puts each sample's resolved, absolute ``image_paths`` / ``video_path`` into its metadata
(:func:`mmrl.data.vlm` loading), so the judged rewards find the media with no extra field. Through the reward server (:mod:`mmrl.rewards.remote`)
the metadata travels as JSON: media must be paths readable on the server machine, and only the scores and
``nan_samples`` come back (``last_info["judge"]`` stays on the server).

Templates
---------
Each judge prompt is a keyword argument (a ``str.format`` template; write literal braces as ``{{ }}``). Its
placeholders are listed by each reward; every template may also use ``{meta[field]}`` (a field of the sample's
metadata; a sample without it is NaN). An unknown placeholder is a ``ValueError`` when the reward is built.
"""
from __future__ import annotations

import os
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generator, Iterable, Mapping, Sequence

import torch
from PIL import Image

from ._base import resolve_device, resolve_dtype
from ._text import THINK_BLOCK, Unjudgeable, Unparseable, answer_or_text, as_spans, check_text_batch, collect_rows
from .vlm_judge import NO_WORDS, YES_WORDS, VLMJudge, _QwenVLScorer, load_judge_vlm

__all__ = [
    "Ask",
    "Generate",
    "Embed",
    "JudgeFailure",
    "JudgeVLM",
    "JudgedReward",
    "MediaReader",
    "response_part",
    "annotation_list",
    "bullets",
    "check_template",
    "fill",
    "IMAGE_KEYS",
    "VIDEO_KEYS",
    "RESPONSE_PARTS",
]

IMAGE_KEYS = ("image", "image_path", "images", "image_paths")
VIDEO_KEYS = ("frames", "video", "video_path")
RESPONSE_PARTS = ("all", "think", "answer", "answer_or_all", "think_or_all")


# --------------------------------------------------------------------------------------------
# Requests to the judge
# --------------------------------------------------------------------------------------------


@dataclass
class Ask:
    """A yes/no question; the answer is ``P(yes)``. ``content``: images (PIL) and text in order."""

    content: list
    label: str = ""


@dataclass
class Generate:
    """A free-text question; the answer is the judge's greedy decoded text."""

    content: list
    label: str = ""
    max_new_tokens: int = 256


@dataclass
class Embed:
    """A text to embed with the judge's own language model; the answer is a 1-D float32 tensor."""

    text: str
    label: str = ""


@dataclass
class JudgeFailure:
    """What a request gets when the judge could not answer it (its forward failed)."""

    reason: str


# --------------------------------------------------------------------------------------------
# The judge
# --------------------------------------------------------------------------------------------

_SHARED: dict[tuple, tuple[Any, Any]] = {}


def shared_judge_vlm(source: str | os.PathLike, *, device: torch.device, dtype: torch.dtype,
                     min_pixels: int | None, max_pixels: int | None):
    """``(model, processor)`` of :func:`~mmrl.rewards.vlm_judge.load_judge_vlm`, loaded once per
    ``(source, device, dtype, pixel budget)`` and shared by every judged reward that asks for it (frozen)."""
    source = os.fspath(source)
    if source.startswith("tiny:"):  # the built folder (it depends on MMRL_CACHE), not the name
        from mmrl.pipelines.vlm.tiny import ensure_tiny_vlm

        source = str(ensure_tiny_vlm(source.split(":", 1)[1]))
    elif os.path.isdir(source):
        source = os.path.abspath(source)
    key = (source, str(device), str(dtype), min_pixels, max_pixels)
    if key not in _SHARED:
        model, processor = load_judge_vlm(source, dtype=dtype, min_pixels=min_pixels, max_pixels=max_pixels)
        _SHARED[key] = (model.to(device=device, dtype=dtype).eval().requires_grad_(False), processor)
    return _SHARED[key]


class JudgeVLM(_QwenVLScorer):
    """The frozen Qwen-VL judge: :class:`~mmrl.rewards.vlm_judge._QwenVLScorer` (loading, placement, dtype,
    ``_forward``) answering batches of :class:`Ask` / :class:`Generate` / :class:`Embed` requests.

    ``embedding``: ``"last_hidden"`` (default) mean-pools the language model's final hidden states (after its
    final RMSNorm) over the text's tokens, the text run alone (no chat template, no image); ``"input"``
    mean-pools the input token embeddings (a bag of tokens). Both are the judge's own, not a separate embedder.
    """

    def __init__(self, model: Any, processor: Any = None, *, device=None, dtype=None, batch_size: int = 8,
                 system_prompt: str | None = None, min_pixels: int | None = None, max_pixels: int | None = None,
                 yes_words: Sequence[str] = YES_WORDS, no_words: Sequence[str] = NO_WORDS,
                 embedding: str = "last_hidden"):
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if embedding not in ("last_hidden", "input"):
            raise ValueError(f"embedding must be 'last_hidden' or 'input', got {embedding!r}")
        if isinstance(model, (str, os.PathLike)):
            device = resolve_device(device)
            dtype = resolve_dtype(dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
            model, loaded = shared_judge_vlm(model, device=device, dtype=dtype, min_pixels=min_pixels,
                                             max_pixels=max_pixels)
            processor = processor if processor is not None else loaded
        super().__init__(model, processor, device, dtype, batch_size, system_prompt, min_pixels, max_pixels)
        self.yes_ids = VLMJudge._single_tokens(self, yes_words, "yes_words")
        self.no_ids = VLMJudge._single_tokens(self, no_words, "no_words")
        if set(self.yes_ids) & set(self.no_ids):
            raise ValueError(f"yes and no words share token ids {sorted(set(self.yes_ids) & set(self.no_ids))}")
        self.embedding = embedding
        eos = [self.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        self.eos_ids = [i for i in eos if isinstance(i, int) and i >= 0 and i != self.tokenizer.unk_token_id]
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[-1] if self.eos_ids else 0)
        config = getattr(self.model, "config", None)
        self.suppressed_ids = sorted({i for i in (getattr(config, k, None) for k in (
            "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")) if i is not None})
        self.forwards = 0  # model forwards / generate calls so far (batching is checked against it)

    # ---- templating

    def chat(self, content: Sequence) -> tuple[str, list]:
        """The chat-templated user turn (``content``: PIL images and strings, in order) with the assistant turn
        opened, and the images in order."""
        parts, images = [], []
        for item in content:
            if isinstance(item, Image.Image):
                parts.append({"type": "image"})
                images.append(item if item.mode == "RGB" else item.convert("RGB"))
            else:
                parts.append({"type": "text", "text": str(item)})
        messages = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": [{"type": "text", "text": self.system_prompt}]})
        messages.append({"role": "user", "content": parts})
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), images

    def _encode(self, requests: Sequence) -> dict:
        texts, images = [], []
        for r in requests:
            text, imgs = self.chat(r.content)
            texts.append(text)
            images += imgs
        return dict(self.processor(text=texts, images=images or None, padding=True, padding_side="left",
                                   return_tensors="pt"))

    # ---- batched answering

    def run(self, requests: Sequence) -> list:
        """Answers in request order: ``(p_yes, logit_yes_no)`` for an :class:`Ask`, ``str`` for a
        :class:`Generate`, a tensor for an :class:`Embed`, a :class:`JudgeFailure` where the judge failed."""
        out: list = [None] * len(requests)
        for kind, fn in ((Ask, self.yes_prob), (Generate, self.generate), (Embed, self.embed)):
            where = [k for k, r in enumerate(requests) if isinstance(r, kind)]
            if where:
                for k, answer in zip(where, fn([requests[k] for k in where])):
                    out[k] = answer
        return out

    def _chunks(self, requests: Sequence, fn: Callable[[Sequence], list]) -> list:
        """``fn`` on ``batch_size`` requests at a time; a failing chunk is retried one request at a time."""
        out: list = []
        for start in range(0, len(requests), self.batch_size):
            chunk = list(requests[start:start + self.batch_size])
            try:
                out += fn(chunk)
            except Exception as exc:
                if len(chunk) == 1:
                    out.append(JudgeFailure(f"judge forward failed: {type(exc).__name__}: {exc}"))
                    continue
                for r in chunk:
                    try:
                        out += fn([r])
                    except Exception as one:
                        out.append(JudgeFailure(f"judge forward failed: {type(one).__name__}: {one}"))
        return out

    @torch.inference_mode()
    def yes_prob(self, asks: Sequence[Ask]) -> list:
        yes, no = torch.tensor(self.yes_ids), torch.tensor(self.no_ids)

        def one_chunk(chunk):
            inputs = self._encode(chunk)
            self.forwards += 1
            logits = self._forward(inputs, keep=1)[:, -1].cpu()
            lse_yes = torch.logsumexp(logits[:, yes], dim=-1)
            lse_no = torch.logsumexp(logits[:, no], dim=-1)
            p = torch.exp(lse_yes - torch.logaddexp(lse_yes, lse_no))
            return [(float(a), float(b)) for a, b in zip(p, lse_yes - lse_no)]

        return self._chunks(asks, one_chunk)

    @torch.inference_mode()
    def generate(self, requests: Sequence[Generate]) -> list:
        from transformers import GenerationConfig

        def one_chunk(chunk):
            inputs = self._encode(chunk)
            inputs = {k: (v.to(self.device) if torch.is_tensor(v) else v) for k, v in inputs.items()}
            dtype = next(self.model.parameters()).dtype
            for key in ("pixel_values", "pixel_values_videos"):
                if key in inputs:
                    inputs[key] = inputs[key].to(dtype)
            # a fresh config: greedy, nothing the checkpoint ships (repetition_penalty, top_k, ...) applies
            config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_new_tokens for r in chunk),
                                      eos_token_id=self.eos_ids or None, pad_token_id=self.pad_id,
                                      suppress_tokens=self.suppressed_ids or None)
            shipped = self.model.generation_config
            self.model.generation_config = config
            try:
                self.forwards += 1
                sequences = self.model.generate(**inputs, generation_config=config)
            finally:
                self.model.generation_config = shipped
            new = sequences[:, inputs["input_ids"].shape[1]:].cpu()
            texts = []
            for row, r in zip(new, chunk):
                row = row[: r.max_new_tokens].tolist()
                cut = next((j for j, t in enumerate(row) if t in self.eos_ids), len(row))
                texts.append(self.tokenizer.decode(row[:cut], skip_special_tokens=True).strip())
            return texts

        return self._chunks(requests, one_chunk)

    @torch.inference_mode()
    def embed(self, requests: Sequence[Embed]) -> list:
        """One embedding per request; identical texts are embedded once."""
        unique = list(dict.fromkeys(r.text for r in requests))

        def one_chunk(chunk):
            enc = self.tokenizer([r.text for r in chunk], padding=True, padding_side="right",
                                 add_special_tokens=False, return_tensors="pt")
            ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
            if self.embedding == "input":
                hidden = self.model.get_input_embeddings()(ids)
            else:
                self.forwards += 1
                hidden = self.model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1).float() / weights.sum(1).float().clamp_min(1.0)
            return list(pooled.cpu())

        answers = dict(zip(unique, self._chunks([Embed(t) for t in unique], one_chunk)))
        return [answers[r.text] for r in requests]


# --------------------------------------------------------------------------------------------
# Media
# --------------------------------------------------------------------------------------------


class MediaReader:
    """Reads a sample's images or video frames from its metadata (see the module docstring), caching by path
    within one reward call (a group's completions share their sample's media)."""

    def __init__(self, media_root: str | os.PathLike | None = None):
        self.media_root = None if media_root is None else Path(media_root).expanduser()
        self._cache: dict[tuple, Any] = {}

    def _path(self, value: str | os.PathLike) -> Path:
        path = Path(value).expanduser()
        if not path.is_absolute() and self.media_root is not None:
            path = self.media_root / path
        return path

    def _image(self, value: Any, what: str) -> Image.Image:
        if isinstance(value, Image.Image):
            if value.width == 0 or value.height == 0:
                raise Unjudgeable(f"{what} is an empty image of size {value.size}")
            return value if value.mode == "RGB" else value.convert("RGB")
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise Unjudgeable(f"{what} is not an image or a path (got {type(value).__name__})")
        path = self._path(value)
        key = ("image", str(path))
        if key not in self._cache:
            try:
                with Image.open(path) as image:
                    self._cache[key] = image.convert("RGB")
            except FileNotFoundError:
                self._cache[key] = Unjudgeable(f"{what}: image file not found: {path}")
            except Exception as exc:
                self._cache[key] = Unjudgeable(f"{what}: cannot open image {path}: {type(exc).__name__}: {exc}")
        hit = self._cache[key]
        if isinstance(hit, Unjudgeable):
            raise hit
        return hit

    def images(self, meta: Mapping, reward: str) -> list[Image.Image]:
        """The sample's images (at least one), or :class:`Unjudgeable` naming what is missing."""
        for key in IMAGE_KEYS:
            value = meta.get(key)
            if value is None:
                continue
            values = list(value) if isinstance(value, (list, tuple)) else [value]
            if not values:
                raise Unjudgeable(f"metadata {key!r} is an empty list (needed by {reward})")
            return [self._image(v, f"metadata {key!r}") for v in values]
        raise Unjudgeable(f"metadata has no image ({' / '.join(repr(k) for k in IMAGE_KEYS)}; needed by {reward})")

    def frames(self, meta: Mapping, reward: str, *, num_frames: int, max_pixels: int | None
               ) -> tuple[list[Image.Image], list[float] | None]:
        """The sample's video frames (PIL, in order) and their times in seconds (None when frames are given).

        ``frames`` in the metadata are used as given (at most ``num_frames``, evenly spaced); a ``video`` file is
        read with :func:`mmrl.data.video.read_video` (``nframes = min(num_frames, frames in the video)``, even,
        qwen-vl-utils' rule; ``max_pixels`` per frame)."""
        frames = meta.get("frames")
        if frames is not None:
            if torch.is_tensor(frames):
                if frames.dim() != 4 or frames.shape[1] != 3 or frames.dtype != torch.uint8 or not len(frames):
                    raise Unjudgeable(f"metadata 'frames' must be a uint8 [T, 3, H, W] tensor, got "
                                      f"{frames.dtype} {tuple(frames.shape)}")
                frames = [Image.fromarray(f.permute(1, 2, 0).contiguous().numpy()) for f in frames]
            elif not isinstance(frames, (list, tuple)) or not frames:
                raise Unjudgeable("metadata 'frames' must be a non-empty list of images or paths")
            pick = _even_pick(len(frames), num_frames)
            return [self._image(frames[i], f"metadata 'frames'[{i}]") for i in pick], None
        for key in ("video", "video_path"):
            value = meta.get(key)
            if value is None:
                continue
            if not isinstance(value, (str, os.PathLike)) or not str(value):
                raise Unjudgeable(f"metadata {key!r} must be a video path (got {type(value).__name__})")
            path = self._path(value)
            cache_key = ("video", str(path), num_frames, max_pixels)
            if cache_key not in self._cache:
                self._cache[cache_key] = _read_frames(path, num_frames, max_pixels, key)
            hit = self._cache[cache_key]
            if isinstance(hit, Unjudgeable):
                raise hit
            return hit
        raise Unjudgeable(f"metadata has no video ({' / '.join(repr(k) for k in VIDEO_KEYS)}; needed by {reward})")


def _even_pick(total: int, wanted: int) -> list[int]:
    if total <= wanted:
        return list(range(total))
    return sorted({round(i * (total - 1) / (wanted - 1)) for i in range(wanted)}) if wanted > 1 else [0]


def _read_frames(path: Path, num_frames: int, max_pixels: int | None, key: str):
    from mmrl.data.prompts import DataError
    from mmrl.data.video import FRAME_FACTOR, probe_video, read_video

    try:
        info = probe_video(path)
        n = max(FRAME_FACTOR, min(int(num_frames), info.total_frames) // FRAME_FACTOR * FRAME_FACTOR)
        clip = read_video(path, nframes=n, max_pixels=max_pixels)
    except (DataError, ValueError, OSError) as exc:
        return Unjudgeable(f"metadata {key!r}: {exc}")
    except ImportError as exc:  # decord missing
        return Unjudgeable(f"metadata {key!r}: cannot read videos here: {exc}")
    images = [Image.fromarray(f.permute(1, 2, 0).contiguous().numpy()) for f in clip.frames]
    return images, [round(t, 2) for t in clip.frame_times]


# --------------------------------------------------------------------------------------------
# Responses, annotations, templates
# --------------------------------------------------------------------------------------------



def response_part(text: str, part: str) -> str:
    """The part of a response a reward judges; raises :class:`Unparseable`.

    ``"all"``: the whole response; ``"think"``: the one ``<think>...</think>`` block; ``"answer"``: the one
    ``<answer>...</answer>`` block; ``"answer_or_all"``: the answer block, or the whole response when it has no
    answer tag at all; ``"think_or_all"``: the think block, or the whole response when it has no think tag at all.
    Empty text, or a repeated/unclosed/empty block, is unparseable.
    """
    if part == "all":
        if not text.strip():
            raise Unparseable("empty response")
        return text.strip()
    if part in ("answer", "answer_or_all"):
        return answer_or_text(text, require_tags=part == "answer")
    if part in ("think", "think_or_all"):
        if part == "think_or_all" and "<think>" not in text and "</think>" not in text:
            return response_part(text, "all")
        if text.count("<think>") != 1 or text.count("</think>") != 1:
            raise Unparseable("no single <think>...</think> block")
        match = THINK_BLOCK.search(text)
        if match is None:
            raise Unparseable("no single <think>...</think> block")
        if not match.group(1).strip():
            raise Unparseable("empty <think> block")
        return match.group(1).strip()
    raise ValueError(f"unknown response part {part!r}; use one of {RESPONSE_PARTS}")


def check_part(part: str) -> str:
    if part not in RESPONSE_PARTS:
        raise ValueError(f"part must be one of {RESPONSE_PARTS}, got {part!r}")
    return part


_INFO_ITEM = re.compile(r"<info(\d+)>(.+?)</info\1>", re.DOTALL)


def annotation_list(meta: Mapping, key: str, reward: str, *, required: bool = True) -> list[str]:
    """``meta[key]`` as a list of non-empty strings (one string is one annotation; a dict's values are used). A
    string of numbered items ``<info1>...</info1><info2>...</info2>`` (Perception-R1's released data format) is
    one annotation per item, in order.

    Missing or empty: :class:`Unjudgeable` when ``required``, else ``[]``. A non-text entry is Unjudgeable."""
    value = meta.get(key)
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, str):
        items = _INFO_ITEM.findall(value)
        value = [text for _, text in items] if items else [value]
    if value is None or (isinstance(value, (list, tuple)) and not value):
        if required:
            raise Unjudgeable(f"metadata has no {key!r} (needed by {reward})")
        return []
    if not isinstance(value, (list, tuple)):
        raise Unjudgeable(f"metadata {key!r} must be a string or a list of strings, got {type(value).__name__}")
    items = []
    for k, v in enumerate(value):
        if not isinstance(v, str):
            raise Unjudgeable(f"metadata {key!r}[{k}] is not a string (got {type(v).__name__})")
        if v.strip():
            items.append(v.strip())
    if not items and required:
        raise Unjudgeable(f"metadata {key!r} holds only empty strings (needed by {reward})")
    return items


def bullets(items: Iterable[str], empty: str = "(none)") -> str:
    lines = [f"- {s}" for s in items]
    return "\n".join(lines) if lines else empty


def check_template(template: str, placeholders: Sequence[str], what: str) -> str:
    """``template`` if every ``{field}`` in it is one of ``placeholders`` or ``meta[...]``; else ``ValueError``."""
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"{what} must be a non-empty string")
    allowed = set(placeholders) | {"meta"}
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise ValueError(f"{what} is not a valid format string: {exc}") from None
    for f in fields:
        root = re.split(r"[.\[]", f, maxsplit=1)[0]
        if root not in allowed:
            raise ValueError(f"{what} has an unknown placeholder {{{f}}}; it may use "
                             f"{', '.join('{' + p + '}' for p in placeholders)} and {{meta[field]}}")
        if root != "meta" and root != f:
            raise ValueError(f"{what}: {{{f}}}: only {{meta[field]}} may index into a value")
    return template


def fill(template: str, meta: Mapping, **fields: Any) -> str:
    """``template.format(**fields, meta=meta)``; a missing metadata field is :class:`Unjudgeable`."""
    try:
        return template.format(meta=meta, **fields)
    except (KeyError, IndexError) as exc:
        raise Unjudgeable(f"cannot fill the judge template: metadata has no {exc}") from None


# --------------------------------------------------------------------------------------------
# The reward base class
# --------------------------------------------------------------------------------------------

Plan = Generator[list, list, Any]


class JudgedReward:
    """Base class of the judged rewards: the text-reward bookkeeping with batched judge calls.

    A subclass implements :meth:`_plan` as a generator for one sample: it reads the response, the media
    (``self.media``: a :class:`MediaReader`) and the annotations, ``yield``s a list of requests
    (:class:`Ask` / :class:`Generate` / :class:`Embed`) and receives their answers in order (``p_yes`` floats for
    asks, texts, tensors), may yield again (a second stage), and ``return``s ``{name: score, extra: value}`` (or a
    float). It raises :class:`Unparseable` / :class:`Unjudgeable` like a text reward's ``_score_one``. All
    samples' requests of one stage go to the judge together (``batch_size`` per forward). ``record`` (a list) is
    the sample's ``last_info["judge"]`` entry; a plan may append parse notes to it. A reward with
    ``reports_spans = True`` returns ``(result, spans)``: the character spans of the response its score is about
    (as :class:`~mmrl.rewards._text.TextReward`), gathered in ``last_info["spans"]``.
    """

    name: str = ""
    needs_prompts: bool = False
    scores_images: bool = False  # judges completions (text), not generated images
    extra_keys: tuple[str, ...] = ()
    reports_spans: bool = False

    def __init__(self, *, model, processor, device, dtype, batch_size, system_prompt, min_pixels, max_pixels,
                 yes_words, no_words, media_root, embedding: str = "last_hidden"):
        self.last_info: dict = {}
        self.judge = JudgeVLM(model, processor, device=device, dtype=dtype, batch_size=batch_size,
                              system_prompt=system_prompt, min_pixels=min_pixels, max_pixels=max_pixels,
                              yes_words=yes_words, no_words=no_words, embedding=embedding)
        self.media_root = media_root
        self.media = MediaReader(media_root)

    @property
    def batch_size(self) -> int:
        return self.judge.batch_size

    def _plan(self, text: str, prompt: str | None, meta: Mapping, record: list) -> Plan:
        raise NotImplementedError

    def _step(self, i: int, plan: Plan, answers, live: dict, rows: list, nan: dict, unparseable: dict,
              spans: list) -> None:
        while True:
            try:
                requests = plan.send(answers)
            except StopIteration as stop:
                value = stop.value
                if self.reports_spans:
                    value, reported = value
                    spans[i] = as_spans(reported)
                rows[i] = {k: float(v) for k, v in value.items()} if isinstance(value, Mapping) \
                    else {self.name: float(value)}
                return
            except Unparseable as exc:
                unparseable[i] = exc.reason
                rows[i] = {**exc.extras, self.name: exc.score}
                return
            except Unjudgeable as exc:
                nan[i] = str(exc)
                return
            except Exception as exc:  # one bad sample never takes the batch down
                nan[i] = f"scorer failed: {type(exc).__name__}: {exc}"
                return
            requests = list(requests or [])
            if requests:
                live[i] = (plan, requests)
                return
            answers = []  # nothing asked: continue at once

    def __call__(self, completions, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        completions, prompts, metadata = check_text_batch(completions, prompts, metadata)
        n = len(completions)
        rows: list[dict[str, float]] = [{} for _ in range(n)]
        nan: dict[int, str] = {}
        unparseable: dict[int, str] = {}
        records: dict[int, list] = {i: [] for i in range(n)}
        spans: list = [None] * n
        live: dict[int, tuple[Plan, list]] = {}
        self.media = MediaReader(self.media_root)  # the cache lives for one call
        forwards = self.judge.forwards
        for i, text in enumerate(completions):
            meta = metadata[i]
            if not isinstance(text, str):
                nan[i] = f"completion is not a string (got {type(text).__name__})"
            elif not isinstance(meta, Mapping):
                nan[i] = f"metadata entry is not a dict (got {type(meta).__name__})"
            else:
                prompt = prompts[i] if prompts is not None else None
                prompt = prompt if isinstance(prompt, str) else None
                self._step(i, self._plan(text, prompt, meta, records[i]), None, live, rows, nan, unparseable, spans)
        while live:
            order = sorted(live)
            flat = [(i, r) for i in order for r in live[i][1]]
            answers = self.judge.run([r for _, r in flat])
            grouped: dict[int, list] = {i: [] for i in order}
            for (i, request), answer in zip(flat, answers):
                grouped[i].append((request, answer))
            current, live = live, {}
            for i in order:
                plan = current[i][0]
                given, failure = [], None
                for request, answer in grouped[i]:
                    records[i].append(_raw(request, answer))
                    if isinstance(answer, JudgeFailure):
                        failure = failure or answer.reason
                    given.append(answer[0] if isinstance(request, Ask) and not isinstance(answer, JudgeFailure)
                                 else answer)
                if failure is not None:
                    nan[i] = failure
                    plan.close()
                    continue
                self._step(i, plan, given, live, rows, nan, unparseable, spans)
        for i in nan:
            rows[i], spans[i] = {}, None

        out, info = collect_rows(self.name, self.extra_keys, rows, nan, unparseable)
        info["judge"] = {i: r for i, r in records.items() if r}
        info["judge_forwards"] = self.judge.forwards - forwards
        if self.reports_spans:
            info["spans"] = spans
        self.last_info = info
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, batch_size={self.batch_size})"


def _raw(request, answer) -> dict:
    kind = {Ask: "yes_no", Generate: "generate", Embed: "embed"}[type(request)]
    entry: dict[str, Any] = {"kind": kind, "label": request.label}
    if isinstance(answer, JudgeFailure):
        entry["error"] = answer.reason
    elif kind == "yes_no":
        entry["p_yes"], entry["logit_yes_no"] = float(answer[0]), float(answer[1])
    elif kind == "generate":
        entry["text"] = answer
    else:
        entry["norm"] = float(torch.as_tensor(answer).float().norm())
    return entry


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = torch.as_tensor(a).double().flatten(), torch.as_tensor(b).double().flatten()
    denom = float(a.norm() * b.norm())
    if denom == 0.0:
        raise Unjudgeable("an embedding is all zeros")
    return float(a @ b) / denom
