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
    "pil_to_uint8",
    "pil_to_float",
    "pils_to_float",
]


def float_to_uint8(images: torch.Tensor) -> torch.Tensor:
    """``[..., 3, H, W]`` float in [0, 1] -> uint8 of the same shape, ``round(x * 255)`` clipped."""
    if images.dtype == torch.uint8:
        return images
    return (images.float() * 255).round().clamp(0, 255).to(torch.uint8)


def uint8_to_float(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 3, H, W]`` -> float32 in [0, 1] (``x / 255``)."""
    return images.to(torch.float32) / 255.0


def uint8_to_pil(image: torch.Tensor) -> Image.Image:
    """One uint8 ``[3, H, W]`` tensor -> an RGB PIL image."""
    if image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"expected a uint8 image [3, H, W], got shape {tuple(image.shape)}")
    array = image.detach().cpu().permute(1, 2, 0).contiguous().numpy()
    return Image.fromarray(array)  # a uint8 H x W x 3 array is RGB


def tensor_to_pil(images: torch.Tensor) -> list[Image.Image]:
    """``[N, 3, H, W]`` float in [0, 1] (or uint8) -> N RGB PIL images (DDPO's quantisation)."""
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images [N, 3, H, W], got shape {tuple(images.shape)}")
    u8 = float_to_uint8(images.detach()).cpu()
    return [uint8_to_pil(img) for img in u8]


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

