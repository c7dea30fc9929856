"""Image conversions shared by every reward: the one place where tensors, uint8 and PIL meet.

Conventions (the DDPO / Flow-GRPO ones, so scores match the anchors):

* a float image is ``[3, H, W]`` (a batch ``[N, 3, H, W]``) with values in ``[0, 1]``;
* float -> uint8 is ``(x * 255).round().clamp(0, 255)`` (values outside ``[0, 1]`` are clipped);
* uint8 -> float is ``x / 255``;
* PIL images are converted to RGB first (``L``, ``RGBA``, ``P`` ... all become 3 channels;
  alpha is dropped, as ``Image.convert("RGB")`` does).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from PIL import Image

__all__ = [
    "float_to_uint8",
    "uint8_to_float",
    "uint8_to_pil",
    "tensor_to_pil",
    "uint8_batch_to_pil",
    "pil_to_uint8",
    "pil_to_float",
    "pils_to_float",
    "is_torchvision_clip_processor",
]


# Elements per chunk when quantising a CPU batch: the temporaries of one chunk (a few MB) are
# reused from chunk to chunk instead of fresh full-batch buffers, whose pages the OS must
# zero-fill on every call (on a VM, page faults cost more than the arithmetic).
_CHUNK_ELEMENTS = 1 << 20


def float_to_uint8(images: torch.Tensor) -> torch.Tensor:
    """``[..., 3, H, W]`` float in [0, 1] -> uint8 of the same shape, ``round(x * 255)`` clipped.

    A CPU batch is quantised in chunks along its first dimension (same values, fewer and smaller
    temporaries); the result is contiguous.
    """
    if images.dtype == torch.uint8:
        return images
    if images.device.type != "cpu" or images.dim() < 2 or images.numel() <= _CHUNK_ELEMENTS:
        return (images.float() * 255).round().clamp(0, 255).to(torch.uint8)
    out = torch.empty(images.shape, dtype=torch.uint8)
    step = max(1, _CHUNK_ELEMENTS // max(1, images[0].numel()))
    for start in range(0, images.shape[0], step):
        chunk = images[start : start + step]
        scaled = chunk.float()
        scaled = scaled * 255 if scaled is chunk else scaled.mul_(255)
        out[start : start + step].copy_(scaled.round_().clamp_(0, 255))  # integral values: exact
    return out


def uint8_to_float(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 3, H, W]`` -> float32 in [0, 1] (``x / 255``)."""
    return images.to(torch.float32) / 255.0


def _planes_to_pil(planes: np.ndarray) -> Image.Image:
    """A C-contiguous uint8 ``[3, H, W]`` array -> an RGB PIL image (pillow interleaves the three
    planes itself: much faster than transposing to H x W x 3 first, same pixels)."""
    height, width = planes.shape[1:]
    bands = [Image.frombuffer("L", (width, height), plane, "raw", "L", 0, 1) for plane in planes]
    return Image.merge("RGB", bands)


def uint8_to_pil(image: torch.Tensor) -> Image.Image:
    """One uint8 ``[3, H, W]`` tensor -> an RGB PIL image."""
    if image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"expected a uint8 image [3, H, W], got shape {tuple(image.shape)}")
    return _planes_to_pil(image.detach().cpu().contiguous().numpy())


def uint8_batch_to_pil(images: torch.Tensor) -> list[Image.Image]:
    """uint8 ``[N, 3, H, W]`` -> N RGB PIL images (each owns a copy of its pixels)."""
    if images.dim() != 4 or images.shape[1] != 3 or images.dtype != torch.uint8:
        raise ValueError(f"expected uint8 images [N, 3, H, W], got {images.dtype} {tuple(images.shape)}")
    array = images.detach().cpu().contiguous().numpy()
    return [_planes_to_pil(a) for a in array]


def tensor_to_pil(images: torch.Tensor) -> list[Image.Image]:
    """``[N, 3, H, W]`` float in [0, 1] (or uint8) -> N RGB PIL images (DDPO's quantisation)."""
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images [N, 3, H, W], got shape {tuple(images.shape)}")
    # the whole batch quantised at once, then one pillow call per image (no per-image tensor ops)
    return uint8_batch_to_pil(float_to_uint8(images.detach()))


def pil_to_uint8(image: Image.Image) -> torch.Tensor:
    """A PIL image (any mode) -> uint8 ``[3, H, W]`` RGB tensor."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    array = np.asarray(rgb, dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def pil_to_float(image: Image.Image) -> torch.Tensor:
    """A PIL image (any mode) -> float32 ``[3, H, W]`` in [0, 1]."""
    return uint8_to_float(pil_to_uint8(image))


def pils_to_float(images: Sequence[Image.Image]) -> torch.Tensor:
    """Same-sized PIL images -> float32 ``[N, 3, H, W]`` in [0, 1]."""
    sizes = {img.size for img in images}
    if len(sizes) > 1:
        raise ValueError(f"cannot stack PIL images of different sizes {sorted(sizes)}")
    return torch.stack([pil_to_float(img) for img in images]) if images else torch.empty(0, 3, 0, 0)


def is_torchvision_clip_processor(image_processor) -> bool:
    """Whether ``image_processor`` is exactly transformers' torchvision-backed ("fast")
    ``CLIPImageProcessor`` (transformers >= 5: ``CLIPImageProcessor`` with the torchvision backend;
    4.x: ``CLIPImageProcessorFast``). That one turns a PIL image into a uint8 CHW tensor before any
    other step, so a uint8 ``[N, 3, H, W]`` tensor gives the same pixel values as the PIL images
    (checked in the tests); a subclass, or the PIL/numpy processor, is not assumed to."""
    try:
        from transformers import CLIPImageProcessor
    except ImportError:  # pragma: no cover - transformers is a dependency of the CLIP rewards
        return False
    if isinstance(getattr(CLIPImageProcessor, "backend", None), property):  # transformers >= 5
        return type(image_processor) is CLIPImageProcessor and image_processor.backend == "torchvision"
    try:  # transformers 4.x
        from transformers import CLIPImageProcessorFast
    except ImportError:
        return False
    return type(image_processor) is CLIPImageProcessorFast
