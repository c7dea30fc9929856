"""CLIPScore (Hessel et al. 2021, "CLIPScore: A Reference-free Evaluation Metric for Image Captioning",
arXiv:2104.08718) on any transformers ``CLIPModel``.

Backbone: named in config (``model=``, a hub id or a local directory), default
``openai/clip-vit-large-patch14`` (the backbone Flow-GRPO's CLIPScore uses); preprocessing and
tokenizer: the ``CLIPProcessor`` of the same id unless ``processor=`` names another (resize the
shortest side to 224 bicubic, centre crop 224, CLIP mean/std; text truncated to 77 tokens).

Score, computed in float32 on the L2-normalised projected embeddings::

    score = scale * max(cos(image_embeds, text_embeds), 0)        (clip_at_zero=True, the default)
    score = scale * cos(image_embeds, text_embeds)                (clip_at_zero=False)

``scale`` defaults to **1.0: the plain cosine clipped at 0**. The conventions in use elsewhere:

* Hessel et al.'s CLIPScore: ``2.5 * max(cos, 0)`` with the caption prefixed by
  ``"A photo depicts "`` (``scale=2.5, prompt_prefix="A photo depicts "``; their backbone is ViT-B/32);
* torchmetrics' ``CLIPScore``: ``100 * max(cos, 0)`` (``scale=100``; torchmetrics clamps the batch's *mean*
  at 0, mmrl each sample: the same unless some cosine is negative);
* Flow-GRPO's ``flow_grpo/clip_scorer.py`` (``convention="flow_grpo"``): ``logits_per_image.diagonal() / 30``,
  that is ``logit_scale.exp() * cos / 30`` with the model's own logit scale (100 for ViT-L/14), not clipped, on
  the float images as given (no uint8 quantisation) through torchvision tensor transforms built from the
  processor's config: ``Resize(shortest_edge)`` (torchvision's default bilinear, antialiased),
  ``CenterCrop`` (torchvision's rounded offset) and ``Normalize``.

With the default ``convention="clip"``, tensor images are quantised to uint8 PIL first (``round(x * 255)``),
as for PickScore, and take the processor's PIL bicubic resize. The text tower runs once per unique prompt;
image batches are chunked by ``batch_size``.

:func:`load_clip` (model + processor from a hub id, a local directory or built objects, with the
missing-weights checks) is shared with :mod:`~mmrl.rewards.aesthetic`.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch

from ._base import (
    ImageBatch,
    Reward,
    load_pretrained,
    prompt_image_cosine,
    register_reward,
    resolve_device,
    resolve_dtype,
)
from .pickscore import _MODEL_FILES, _PROCESSOR_FILES, _embedding

__all__ = ["CLIPScore", "load_clip", "flow_grpo_pixels", "DEFAULT_CLIP"]

DEFAULT_CLIP = "openai/clip-vit-large-patch14"


def load_clip(
    model: str | os.PathLike | torch.nn.Module,
    processor: str | os.PathLike | Any | None,
    device: str | torch.device | None,
    dtype: str | torch.dtype | None,
    what: str,
) -> tuple[torch.nn.Module, Any]:
    """A transformers ``CLIPModel`` and ``CLIPProcessor`` ready for inference (eval, no grad).

    ``model``/``processor``: hub id, local directory, or an already-built object; ``processor=None``
    means "the same source as ``model``" (a built model then needs a built processor). Missing files
    raise :class:`MissingWeightsError` naming them (checked before loading when offline or local).
    A loaded model goes to ``device`` (default CUDA if available) in ``dtype`` (default float32); a
    built model stays where it is unless ``device``/``dtype`` are given.
    """
    from transformers import CLIPModel, CLIPProcessor  # heavy: imported only when used

    dtype = resolve_dtype(dtype)
    if processor is None:
        if not isinstance(model, (str, os.PathLike)):
            raise ValueError(f"{what}: a built model needs a built processor (processor=...)")
        processor = model
    if isinstance(model, (str, os.PathLike)):
        model = load_pretrained(CLIPModel, model, _MODEL_FILES, f"{what} CLIP model", "model",
                                dtype=dtype or torch.float32)
        device = resolve_device(device)
    if isinstance(processor, (str, os.PathLike)):
        # backend pil: PIL resizing, as the anchors' processors (transformers 4, open_clip)
        processor = load_pretrained(CLIPProcessor, processor, _PROCESSOR_FILES, f"{what} processor", "processor",
                                    needs="preprocessor_config.json and tokenizer files",
                                    backend="pil")
    for attr in ("get_image_features", "get_text_features"):
        if not hasattr(model, attr):
            raise TypeError(f"model must be a transformers CLIPModel; {type(model).__name__} has no {attr}")
    for attr in ("image_processor", "tokenizer"):
        if not hasattr(processor, attr):
            raise TypeError(f"processor must be a CLIPProcessor; {type(processor).__name__} has no {attr}")
    if device is not None or dtype is not None:
        model = model.to(device=None if device is None else torch.device(device), dtype=dtype)
    return model.eval().requires_grad_(False), processor


@torch.inference_mode()
def clip_image_embeddings(model, processor, images: list, batch_size: int) -> torch.Tensor:
    """L2-normalised float32 projected image embeddings ``[len(images), D]`` for PIL images."""
    param = next(model.parameters())
    chunks = []
    for start in range(0, len(images), batch_size):
        pixels = processor.image_processor(images=images[start : start + batch_size], return_tensors="pt")["pixel_values"]
        pixels = pixels.to(param.device, param.dtype)
        chunks.append(_embedding(model.get_image_features(pixel_values=pixels)).float())
    emb = torch.cat(chunks)
    return emb / emb.norm(dim=-1, keepdim=True)


@register_reward("clipscore")
class CLIPScore(Reward):
    """``scale * max(cos(image, prompt), 0)`` on a named CLIP backbone; see the module docstring."""

    needs_prompts = True

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module = DEFAULT_CLIP,
        processor: str | os.PathLike | Any | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        scale: float = 1.0,
        clip_at_zero: bool = True,
        prompt_prefix: str = "",
        batch_size: int = 32,
        max_length: int = 77,
        convention: str = "clip",
    ):
        """Args:
        model: hub id or local directory of a transformers ``CLIPModel`` (the backbone), or a built
            model (tests pass a tiny random one).
        processor: hub id, local directory or built ``CLIPProcessor``; default: the same as ``model``.
        device: default CUDA if available, else CPU (a built model stays put unless given).
        dtype: model dtype (default float32 when loading); the cosine is computed in float32.
        scale: the weight ``w`` in ``w * max(cos, 0)``; 1.0 = plain cosine clipped at 0,
            2.5 = Hessel et al., 100 = torchmetrics (Flow-GRPO: ``convention="flow_grpo"``).
        clip_at_zero: clip negative cosines to 0 (CLIPScore's definition); False keeps the sign.
        prompt_prefix: prepended to every prompt (Hessel et al.: ``"A photo depicts "``).
        batch_size: images per vision forward.
        max_length: token truncation length (CLIP: 77).
        convention: ``"clip"`` (``scale * max(cos, 0)`` on the processor's PIL pipeline) or ``"flow_grpo"``
            (Flow-GRPO's ``clip_scorer.py``: ``logit_scale.exp() * cos / 30`` on torchvision tensor transforms;
            ``scale`` and ``clip_at_zero`` are then its own, and giving them is an error).
        """
        super().__init__()
        if convention not in ("clip", "flow_grpo"):
            raise ValueError(f"convention must be 'clip' or 'flow_grpo', got {convention!r}")
        if convention == "flow_grpo" and (scale != 1.0 or clip_at_zero is not True):
            raise ValueError("convention='flow_grpo' scores logit_scale.exp() * cos / 30, unclipped, as Flow-GRPO's "
                             "clip_scorer.py: leave scale and clip_at_zero out")
        self.convention = convention
        self.model, self.processor = load_clip(model, processor, device, dtype, "CLIPScore")
        self.scale = float(scale)
        if not math.isfinite(self.scale):
            raise ValueError(f"scale must be a finite number, got {scale}")
        self.clip_at_zero = bool(clip_at_zero)
        self.prompt_prefix = str(prompt_prefix)
        self.batch_size = int(batch_size)
        text_cfg = getattr(getattr(self.model, "config", None), "text_config", None)
        self.max_length = int(min(max_length, getattr(text_cfg, "max_position_embeddings", max_length)))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        """L2-normalised float32 text embeddings ``[len(prompts), D]`` (the prefix is added here)."""
        texts = [self.prompt_prefix + p for p in prompts]
        tokens = self.processor.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        tokens = {k: v.to(self.device) for k, v in tokens.items() if k in ("input_ids", "attention_mask")}
        emb = _embedding(self.model.get_text_features(**tokens)).float()
        return emb / emb.norm(dim=-1, keepdim=True)

    def image_embeddings(self, images) -> torch.Tensor:
        """L2-normalised float32 image embeddings ``[len(images), D]``: PIL images (``convention="clip"``), or an
        :class:`ImageBatch` whose float images go through :func:`flow_grpo_pixels` (``convention="flow_grpo"``)."""
        if not isinstance(images, ImageBatch):
            return clip_image_embeddings(self.model, self.processor, images, self.batch_size)
        param = next(self.model.parameters())
        order, chunks = [], []
        for positions, floats in images.float_groups():  # one tensor per image size
            for start in range(0, len(positions), self.batch_size):
                pixels = flow_grpo_pixels(floats[start : start + self.batch_size], self.processor.image_processor)
                chunks.append(_embedding(self.model.get_image_features(
                    pixel_values=pixels.to(param.device, param.dtype))).float())
                order += positions[start : start + self.batch_size]
        emb = torch.cat(chunks)[torch.argsort(torch.tensor(order)).to(param.device)]
        return emb / emb.norm(dim=-1, keepdim=True)

    @torch.inference_mode()
    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        flow_grpo = self.convention == "flow_grpo"
        cos = prompt_image_cosine(batch, self.text_embeddings, self.image_embeddings, pass_batch=flow_grpo)
        if flow_grpo:
            return {self.name: (self.model.logit_scale.float().exp() * cos / 30.0).cpu()}
        if self.clip_at_zero:
            cos = cos.clamp_min(0.0)
        return {self.name: (self.scale * cos).cpu()}


def flow_grpo_pixels(images: torch.Tensor, image_processor) -> torch.Tensor:
    """Float images ``[N, 3, H, W]`` in [0, 1] -> CLIP pixel values as Flow-GRPO's ``clip_scorer.py`` makes them:
    torchvision tensor transforms from the processor's config (``Resize`` of the shortest edge, or to height x
    width, with torchvision's default bilinear antialiased interpolation; ``CenterCrop``; ``Normalize`` with the
    processor's mean and std), each only where the processor's ``do_*`` flag is on; no uint8 quantisation."""
    import torchvision.transforms.functional as TF

    def size(value):
        if isinstance(value, int):
            return [value, value]
        if "height" in value and "width" in value:
            return [value["height"], value["width"]]
        return value["shortest_edge"]

    config = image_processor.to_dict()
    pixels = images.float()
    if config.get("do_resize"):
        pixels = TF.resize(pixels, size(config["size"]), antialias=True)
    if config.get("do_center_crop"):
        pixels = TF.center_crop(pixels, size(config["crop_size"]))
    if config.get("do_normalize"):
        pixels = TF.normalize(pixels, mean=image_processor.image_mean, std=image_processor.image_std)
    return pixels
