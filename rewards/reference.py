"""Reference-image reward from DINOv2 features (as in Adv-GRPO: Mao et al. 2025, "The Image as Its Own
Reward: Reinforcement Learning with Adversarial Reward for Image Generation", arXiv:2511.20256).

Adv-GRPO uses reference images and a vision foundation model (DINOv2) as a dense visual reward; its
simplest, non-adversarial form, implemented here, is the cosine similarity of DINOv2 embeddings::

    score = cos(DINOv2_cls(generated), DINOv2_cls(reference))        in [-1, 1]

* backbone: transformers ``Dinov2Model`` (default ``facebook/dinov2-base``; ``-small`` / ``-large`` /
  ``-giant`` or a local directory work the same), embedding = ``pooler_output``, the final-LayerNorm'd CLS
  token (``pooling="cls"``; ``"mean"`` averages the patch tokens instead);
* preprocessing: the checkpoint's image processor (DINOv2's ``BitImageProcessor``: resize the shortest
  side to 256 bicubic, centre crop 224, ImageNet mean/std). A model passed in built, without a processor,
  gets those same settings. Adv-GRPO's own discriminator instead resizes to 518x518; pass a processor
  to match that;
* the reference comes from ``metadata[i]["reference_image"]``: a file path, a PIL image, or an image
  tensor ``[3, H, W]`` (float in [0, 1] or uint8). Reference embeddings are computed once per distinct
  reference in a batch (the G images of a group share theirs) and kept in a small cache keyed by path.

A sample without a usable reference (no key, unreadable file) is NaN with the reason; it never raises.
:class:`DinoEmbedder` is also the default image encoder of :mod:`mmrl.rewards.diversity`.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Sequence

import torch
from PIL import Image

from ._base import (
    check_available as _check_available,
    load_pretrained,
    ImageBatch,
    MissingWeightsError,
    Reward,
    missing_hf_files,
    register_reward,
    resolve_device,
    resolve_dtype,
)
from ._images import tensor_to_pil
from mmrl.data.vlm import to_8bit

__all__ = ["DinoEmbedder", "DinoReference", "DEFAULT_DINO", "load_reference_image"]

DEFAULT_DINO = "facebook/dinov2-base"

_DINO_FILES = [
    [["config.json"]],
    [["model.safetensors"], ["model.safetensors.index.json"], ["pytorch_model.bin"], ["pytorch_model.bin.index.json"]],
]
_PROCESSOR_FILES = [[["preprocessor_config.json"], ["processor_config.json"]]]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def dinov2_image_processor():
    """DINOv2's preprocessing (the ``facebook/dinov2-*`` hub configs): shortest side 256 bicubic, centre crop
    224, rescale 1/255, ImageNet mean/std."""
    from transformers import BitImageProcessor

    return BitImageProcessor(
        do_resize=True, size={"shortest_edge": 256}, resample=3, do_center_crop=True,
        crop_size={"height": 224, "width": 224}, do_rescale=True, rescale_factor=1 / 255,
        do_normalize=True, image_mean=list(IMAGENET_MEAN), image_std=list(IMAGENET_STD), do_convert_rgb=True,
    )


class DinoEmbedder:
    """``embedder(pil_images) -> [N, D]`` float32 DINOv2 embeddings (not normalised), batched.

    Args:
        model: hub id or local directory of a ``Dinov2Model`` (or any checkpoint whose ``AutoModel`` is one),
            or a built model (e.g. ``Dinov2Model(Dinov2Config(...))`` in tests).
        processor: hub id / directory of its image processor, or a built one; default: the checkpoint's own
            when it has one, else DINOv2's standard settings (:func:`dinov2_image_processor`).
        pooling: ``"cls"`` (``pooler_output``: the LayerNorm'd CLS token) or ``"mean"`` (mean patch token).
    """

    def __init__(self, model: str | os.PathLike | torch.nn.Module = DEFAULT_DINO, processor: Any = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 batch_size: int = 32, pooling: str = "cls"):
        from transformers import AutoImageProcessor, AutoModel

        if pooling not in ("cls", "mean"):
            raise ValueError(f"pooling must be 'cls' or 'mean', got {pooling!r}")
        dtype = resolve_dtype(dtype)
        if isinstance(model, (str, os.PathLike)):
            source = os.fspath(model)
            model = load_pretrained(AutoModel, source, _DINO_FILES, "DINOv2 model", "model",
                                    dtype=dtype or torch.float32)
            if processor is None and (not os.path.isdir(source) or not missing_hf_files(source, _PROCESSOR_FILES)[0]):
                processor = source  # the checkpoint's own; a local dir without one gets DINOv2's standard settings
            device = resolve_device(device)
        if isinstance(processor, (str, os.PathLike)):
            source = os.fspath(processor)
            _check_available(source, _PROCESSOR_FILES, "DINOv2 image processor", "processor")
            try:
                processor = AutoImageProcessor.from_pretrained(source)
            except OSError as exc:
                raise MissingWeightsError(
                    f"could not load the DINOv2 image processor {source!r}: {exc}. It needs "
                    "preprocessor_config.json; pass processor=<local dir>."
                ) from exc
        if processor is None:
            processor = dinov2_image_processor()
        if device is not None or dtype is not None:
            model = model.to(device=None if device is None else torch.device(device), dtype=dtype)
        self.model = model.eval().requires_grad_(False)
        self.processor = processor
        self.batch_size = int(batch_size)
        self.pooling = pooling

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.inference_mode()
    def __call__(self, images: Sequence[Image.Image]) -> torch.Tensor:
        chunks = []
        for start in range(0, len(images), self.batch_size):
            part = [im if im.mode == "RGB" else im.convert("RGB") for im in images[start:start + self.batch_size]]
            pixels = self.processor(images=part, return_tensors="pt")["pixel_values"].to(self.device, self.dtype)
            out = self.model(pixel_values=pixels)
            if self.pooling == "cls":
                emb = out.pooler_output
            else:
                emb = out.last_hidden_state[:, 1:].mean(dim=1)
            chunks.append(emb.float())
        if not chunks:
            return torch.empty(0, 0)
        return torch.cat(chunks)


def load_reference_image(ref: Any) -> Image.Image:
    """A reference given as a path, a PIL image or an image tensor ``[3, H, W]`` -> RGB PIL image.

    Raises ``ValueError`` / ``OSError`` naming the problem (the reward turns that into a NaN reason)."""
    if isinstance(ref, Image.Image):
        return ref if ref.mode == "RGB" else ref.convert("RGB")
    if isinstance(ref, (str, os.PathLike)):
        path = os.fspath(ref)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"reference image {path!r} does not exist")
        with Image.open(path) as im:
            im.load()
            return to_8bit(im).convert("RGB")  # 16-bit and float files scaled to 8 bits, not clipped
    if isinstance(ref, torch.Tensor):
        if ref.dim() != 3 or ref.shape[0] != 3:
            raise ValueError(f"a reference tensor must be [3, H, W], got shape {tuple(ref.shape)}")
        if ref.is_floating_point() and not torch.isfinite(ref).all():
            raise ValueError("reference tensor has non-finite values")
        return tensor_to_pil(ref.unsqueeze(0))[0]
    raise ValueError(f"reference_image must be a path, a PIL image or a [3, H, W] tensor, got {type(ref).__name__}")


@register_reward("dino_reference")
class DinoReference(Reward):
    """Cosine similarity of DINOv2 embeddings of each image and its reference (Adv-GRPO); see the module
    docstring for the rule, the preprocessing and the metadata field."""

    needs_prompts = False

    def __init__(self, model: str | os.PathLike | torch.nn.Module = DEFAULT_DINO, processor: Any = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 batch_size: int = 32, pooling: str = "cls", reference_key: str = "reference_image",
                 cache_size: int = 256):
        """Args:
        model, processor, device, dtype, batch_size, pooling: see :class:`DinoEmbedder`.
        reference_key: the metadata field holding each sample's reference image.
        cache_size: how many reference embeddings (keyed by file path) to keep between calls.
        """
        super().__init__()
        self.embedder = model if isinstance(model, DinoEmbedder) else DinoEmbedder(
            model, processor, device=device, dtype=dtype, batch_size=batch_size, pooling=pooling)
        self.reference_key = reference_key
        self.cache_size = int(cache_size)
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def _reference_embeddings(self, refs: list[Any]) -> tuple[list[torch.Tensor | None], list[str | None]]:
        """One embedding per entry (None + reason when unusable), each distinct reference embedded once."""
        out: list[torch.Tensor | None] = [None] * len(refs)
        errors: list[str | None] = [None] * len(refs)
        todo: dict[Any, list[int]] = {}
        images: dict[Any, Image.Image] = {}
        for k, ref in enumerate(refs):
            key = os.path.abspath(os.fspath(ref)) if isinstance(ref, (str, os.PathLike)) else ("id", id(ref))
            if isinstance(key, str) and key in self._cache:
                self._cache.move_to_end(key)
                out[k] = self._cache[key]
                continue
            if key not in images:
                try:
                    images[key] = load_reference_image(ref)
                except Exception as exc:  # one bad reference is a NaN, never an exception
                    errors[k] = f"unusable reference image: {exc}"
                    continue
            todo.setdefault(key, []).append(k)
        if todo:
            keys = list(todo)
            emb = self.embedder([images[key] for key in keys])
            for key, e in zip(keys, emb):
                for k in todo[key]:
                    out[k] = e
                if isinstance(key, str) and self.cache_size > 0:
                    self._cache[key] = e
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
        return out, errors

    @torch.inference_mode()
    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        valid = batch.valid_indices
        scores = torch.full((len(valid),), float("nan"))
        refs, have = [], []
        for pos, i in enumerate(valid):
            meta = batch.metadata[i] if batch.metadata is not None else None
            if not isinstance(meta, dict) or meta.get(self.reference_key) is None:
                reasons[i] = f"no {self.reference_key!r} in metadata"
                continue
            refs.append(meta[self.reference_key])
            have.append(pos)
        if not have:
            return {self.name: scores}
        ref_emb, errors = self._reference_embeddings(refs)
        usable = [(pos, e) for pos, e, err in zip(have, ref_emb, errors) if err is None]
        for pos, err in zip(have, errors):
            if err is not None:
                reasons[valid[pos]] = err
        if not usable:
            return {self.name: scores}
        pils = batch.pil()
        gen = self.embedder([pils[pos] for pos, _ in usable])
        ref = torch.stack([e for _, e in usable]).to(gen.device)
        cos = torch.nn.functional.cosine_similarity(gen, ref, dim=-1).cpu()
        scores[torch.tensor([pos for pos, _ in usable])] = cos
        return {self.name: scores}
