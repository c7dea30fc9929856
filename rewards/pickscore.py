"""PickScore (Kirstain et al. 2023, "Pick-a-Pic", arXiv:2305.01569) on transformers CLIP.

Backbone: ``CLIPModel`` from ``yuvalkirstain/PickScore_v1`` (CLIP ViT-H/14 fine-tuned on
Pick-a-Pic preferences); preprocessing and tokenizer: ``CLIPProcessor`` of
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (resize shortest side 224, centre crop 224, CLIP mean/std;
text padded, truncated to 77 tokens).

Score, as in the PickScore model card and Flow-GRPO's ``pickscore_scorer.py``::

    score = logit_scale.exp() * cos(image_embeds, text_embeds) / scale_divisor

``scale_divisor`` defaults to 1.0 (the raw PickScore, ~20-23 for real images); Flow-GRPO divides
by 26 ("norm to 0-1") and its recipes are tuned for that, so mmrl's Flow-GRPO recipes set 26.
Tensor images are quantised to uint8 first (``round(x * 255)``), as Flow-GRPO does before calling
the processor. With transformers' torchvision-backed CLIPImageProcessor (the default one in
transformers 5) the uint8 tensor goes to the processor directly, on the tensor's device, without a
PIL round trip: on CPU the pixel values are bit-identical to the PIL path (tested); on a GPU the
resize runs there, which may move a resized pixel by one uint8 step. Any other processor gets PIL
images. The text tower runs once per unique prompt (a group of G images sharing a prompt costs one
text forward), and text embeddings are cached per prompt across calls (an LRU of
``text_cache_size`` prompts, emptied when the model's weights, device or dtype change); image
batches are chunked by ``batch_size``.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

from ._images import is_torchvision_clip_processor
from ._base import (
    load_pretrained,
    prompt_image_cosine,
    ImageBatch,
    Reward,
    register_reward,
    resolve_device,
    resolve_dtype,
)

__all__ = ["PickScore", "DEFAULT_MODEL", "DEFAULT_PROCESSOR"]

DEFAULT_MODEL = "yuvalkirstain/PickScore_v1"
DEFAULT_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"

_MODEL_FILES = [
    [["config.json"]],
    [["model.safetensors"], ["model.safetensors.index.json"], ["pytorch_model.bin"], ["pytorch_model.bin.index.json"]],
]
_PROCESSOR_FILES = [
    [["preprocessor_config.json"], ["processor_config.json"]],  # transformers 5 saves the latter
    [["tokenizer.json"], ["vocab.json", "merges.txt"]],
]


def _embedding(features: Any) -> torch.Tensor:
    """transformers < 5 returns the projected embedding; >= 5 a ``BaseModelOutputWithPooling``
    whose ``pooler_output`` is the projected embedding."""
    if isinstance(features, torch.Tensor):
        return features
    pooled = getattr(features, "pooler_output", None)
    if isinstance(pooled, torch.Tensor):
        return pooled
    raise TypeError(f"cannot read an embedding from {type(features).__name__}")


@register_reward("pickscore")
class PickScore(Reward):
    """PickScore reward; see the module docstring for the exact formula and conventions."""

    needs_prompts = True

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module = DEFAULT_MODEL,
        processor: str | os.PathLike | Any = DEFAULT_PROCESSOR,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        scale_divisor: float = 1.0,
        batch_size: int = 32,
        max_length: int = 77,
        text_cache_size: int = 4096,
    ):
        """Args:
        model: hub id or local directory of a transformers ``CLIPModel``, or a built model
            (e.g. a tiny random ``CLIPModel(CLIPConfig(...))`` in tests).
        processor: hub id or local directory of a ``CLIPProcessor``, or a built processor (an
            object with ``image_processor`` and ``tokenizer``).
        device: where the model runs (default: CUDA if available, else CPU; a built model stays
            where it is unless a device is given, and is then moved in place).
        dtype: model dtype (``"float32"``, ``"bfloat16"``, ``"float16"``; default float32 when
            loading, unchanged for a built model). Similarities are computed in float32.
        scale_divisor: the score is divided by this; 1.0 = raw PickScore, 26 = Flow-GRPO.
        batch_size: images per vision forward.
        max_length: token truncation length (CLIP: 77).
        text_cache_size: prompts whose text embeddings are kept between calls (least recently
            used dropped first; 0 disables the cache).
        """
        super().__init__()
        from transformers import CLIPModel, CLIPProcessor  # heavy: imported only when used

        dtype = resolve_dtype(dtype)
        if isinstance(model, (str, os.PathLike)):
            model = load_pretrained(CLIPModel, model, _MODEL_FILES, "PickScore model", "model",
                                    dtype=dtype or torch.float32)
            device = resolve_device(device)
        if isinstance(processor, (str, os.PathLike)):
            # backend pil: PIL resizing, as the anchors' processors (transformers 4, open_clip)
            processor = load_pretrained(CLIPProcessor, processor, _PROCESSOR_FILES, "PickScore processor", "processor",
                                        needs="preprocessor_config.json and tokenizer files",
                                        backend="pil")
        for attr in ("get_image_features", "get_text_features", "logit_scale"):
            if not hasattr(model, attr):
                raise TypeError(f"model must be a transformers CLIPModel; {type(model).__name__} has no {attr}")
        for attr in ("image_processor", "tokenizer"):
            if not hasattr(processor, attr):
                raise TypeError(f"processor must be a CLIPProcessor; {type(processor).__name__} has no {attr}")
        if device is not None or dtype is not None:
            model = model.to(device=None if device is None else torch.device(device), dtype=dtype)
        self.model = model.eval().requires_grad_(False)
        self.processor = processor
        self.scale_divisor = float(scale_divisor)
        if self.scale_divisor == 0 or self.scale_divisor != self.scale_divisor:
            raise ValueError(f"scale_divisor must be a non-zero number, got {scale_divisor}")
        self.batch_size = int(batch_size)
        text_cfg = getattr(getattr(model, "config", None), "text_config", None)
        limit = getattr(text_cfg, "max_position_embeddings", max_length)
        self.max_length = int(min(max_length, limit))
        if int(text_cache_size) < 0:
            raise ValueError(f"text_cache_size must be >= 0, got {text_cache_size}")
        self.text_cache_size = int(text_cache_size)
        self._text_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._text_cache_key: tuple | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _text_state(self) -> tuple | None:
        """What the cached text embeddings depend on: the model object and every parameter's storage,
        version counter (bumped by in-place updates: optimiser steps, ``load_state_dict``), device and
        dtype, plus the tokenizer and the truncation length. None (do not cache) for parameters made
        under ``torch.inference_mode``, which keep no version counter."""
        params = []
        for p in self.model.parameters():
            if p.is_inference():
                return None
            params.append((p.data_ptr(), p._version, p.device, p.dtype))
        return (id(self.model), id(self.processor.tokenizer), self.max_length, hash(tuple(params)))

    @torch.inference_mode()
    def _encode_text(self, prompts: list[str]) -> torch.Tensor:
        tokens = self.processor.tokenizer(
            prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        tokens = {k: v.to(self.device) for k, v in tokens.items() if k in ("input_ids", "attention_mask")}
        emb = _embedding(self.model.get_text_features(**tokens)).float()
        return emb / emb.norm(dim=-1, keepdim=True)

    @torch.inference_mode()
    def text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        """L2-normalised float32 text embeddings ``[len(prompts), D]``; prompts not in the cache are
        encoded together in one text forward."""
        state = self._text_state() if self.text_cache_size else None
        if state is None:
            self._text_cache.clear()
            return self._encode_text(list(prompts))
        cache = self._text_cache
        if state != self._text_cache_key:
            cache.clear()
            self._text_cache_key = state
        missing = [p for p in dict.fromkeys(prompts) if p not in cache]
        fresh = dict(zip(missing, self._encode_text(missing))) if missing else {}
        rows = [fresh[p] if p in fresh else cache[p] for p in prompts]
        for p in dict.fromkeys(prompts):  # most recently used last
            if p in fresh:
                cache[p] = fresh[p].clone()
            else:
                cache.move_to_end(p)
        while len(cache) > self.text_cache_size:
            cache.popitem(last=False)
        return torch.stack(rows)

    def _pixel_values(self, images) -> torch.Tensor:
        """The processor's ``pixel_values`` for a list of PIL images or a uint8 ``[k, 3, H, W]`` tensor."""
        if isinstance(images, torch.Tensor):
            return self.processor.image_processor(
                images=images, return_tensors="pt", input_data_format="channels_first", device=images.device
            )["pixel_values"]
        return self.processor.image_processor(images=images, return_tensors="pt")["pixel_values"]

    @torch.inference_mode()
    def image_embeddings(self, images) -> torch.Tensor:
        """L2-normalised float32 image embeddings ``[len(images), D]`` for a list of PIL images or an
        :class:`ImageBatch` (a tensor batch skips PIL when the processor allows it; see the module doc)."""
        if isinstance(images, ImageBatch):
            use_tensor = images.is_tensor and is_torchvision_clip_processor(self.processor.image_processor)
            images = images.uint8() if use_tensor else images.pil()
        chunks = []
        for start in range(0, len(images), self.batch_size):
            pixels = self._pixel_values(images[start : start + self.batch_size])
            pixels = pixels.to(self.device, self.dtype)
            chunks.append(_embedding(self.model.get_image_features(pixel_values=pixels)).float())
        emb = torch.cat(chunks)
        return emb / emb.norm(dim=-1, keepdim=True)

    @torch.inference_mode()
    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        cos = prompt_image_cosine(batch, self.text_embeddings, self.image_embeddings, pass_batch=True)
        scale = self.model.logit_scale.float().exp()
        return {self.name: (scale * cos / self.scale_divisor).cpu()}
