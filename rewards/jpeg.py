"""JPEG (in)compressibility rewards (DDPO, Black et al. 2023, arXiv:2305.13301).

Mirrors ``ddpo_pytorch/rewards.py`` (kvablack/ddpo-pytorch): each image is quantised to uint8
with ``(x * 255).round().clamp(0, 255)``, encoded with pillow as ``JPEG`` at ``quality=95`` and
scored by its encoded size in **kilobytes, decimal: bytes / 1000** (not KiB). Incompressibility is
the size; compressibility is its negation. The defaults are Flow-GRPO's (yifan123/flow_grpo
``flow_grpo/rewards.py``), the anchor of mmrl's flow trainer: ``jpeg_incompressibility`` is the size
in kB (as DDPO), ``jpeg_compressibility`` is ``-size_kb / 500`` (``scale_divisor=500``; DDPO's
``-size_kb`` is ``scale_divisor=1``). The raw size is also returned as ``jpeg_size_kb``. With
group-normalised advantages the divisor changes nothing; it matters for ``algorithm.scale: none``
and for a sum with other rewards.

Images are encoded one after another: pillow (13.0) holds the GIL while encoding a JPEG, to a
``BytesIO`` or to a file descriptor alike, so a thread pool measured no faster (0.95-0.98x on 2
cores for 256-1024 px images). The batch's PIL images come from one batched quantisation
(:meth:`ImageBatch.pil`), shared with the other rewards of a composition.
"""
from __future__ import annotations

import io

import torch

from ._base import ImageBatch, Reward, register_reward

__all__ = ["JpegIncompressibility", "JpegCompressibility", "jpeg_size_kb"]


def jpeg_size_kb(image, quality: int = 95) -> float:
    """Encoded size of one RGB PIL image as JPEG at ``quality``, in kB (bytes / 1000)."""
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000.0


class _JpegSize(Reward):
    sign: float = 1.0
    #: Flow-GRPO's divisor for this reward.
    flow_grpo_divisor: float = 1.0

    def __init__(self, quality: int = 95, scale_divisor: float | None = None):
        """Args:
        quality: pillow JPEG quality (DDPO and Flow-GRPO: 95).
        scale_divisor: the score is divided by this; default Flow-GRPO's (compressibility 500,
            incompressibility 1); DDPO: 1.
        """
        if scale_divisor is None:
            scale_divisor = self.flow_grpo_divisor
        super().__init__()
        if not 1 <= int(quality) <= 100:
            raise ValueError(f"quality must be in [1, 100], got {quality}")
        if not scale_divisor or scale_divisor != scale_divisor:
            raise ValueError(f"scale_divisor must be a non-zero number, got {scale_divisor}")
        self.quality = int(quality)
        self.scale_divisor = float(scale_divisor)

    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        sizes = []
        for index, image in zip(batch.valid_indices, batch.pil()):
            try:
                sizes.append(jpeg_size_kb(image, self.quality))
            except Exception as exc:  # one image failing to encode must not sink the batch
                reasons[index] = f"JPEG encoding failed: {type(exc).__name__}: {exc}"
                sizes.append(float("nan"))
        kb = torch.tensor(sizes, dtype=torch.float64)
        return {self.name: self.sign * kb / self.scale_divisor, "jpeg_size_kb": kb}


@register_reward("jpeg_incompressibility")
class JpegIncompressibility(_JpegSize):
    """JPEG size in kB (bytes / 1000) at quality 95: larger = more detail (DDPO)."""

    sign = 1.0


@register_reward("jpeg_compressibility")
class JpegCompressibility(_JpegSize):
    """Negated JPEG size in kB (bytes / 1000) at quality 95, divided by 500 (Flow-GRPO; DDPO: ``scale_divisor=1``):
    larger = simpler image."""

    sign = -1.0
    flow_grpo_divisor = 500.0
