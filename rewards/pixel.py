"""Weightless pixel-statistics rewards, vectorised in torch (no per-image loop).

They need no model and no prompt, so a tiny random policy can visibly push them up in a few
steps: the smoke tests and tiny CPU recipes train against them.

* ``brightness``: mean of all R, G, B values in [0, 1].
* ``saturation``: mean HSV saturation ``(max - min) / max`` over pixels (0 where ``max = 0``).
* ``colorfulness``: Hasler & Suesstrunk (2003), "Measuring colourfulness in natural images",
  on sRGB values in **[0, 255]** (the paper's scale, so its thresholds apply: ~15 slightly,
  ~33 moderately, ~59 quite, ~82 highly, ~109 extremely colourful):
  ``rg = R - G``, ``yb = (R + G) / 2 - B``,
  ``C = sqrt(std(rg)^2 + std(yb)^2) + 0.3 * sqrt(mean(rg)^2 + mean(yb)^2)``,
  std being the population std (ddof 0) over the pixels.

Scores are computed on the float input (a PIL image is read as uint8 / 255), in float64. On CPU the
batch is scored in chunks of about 2 MB of float64 through buffers reused from chunk to chunk (no
full-batch float64 copy); on an accelerator the whole group at once. Elementwise the arithmetic is
the functions' below on ``x.double()``; only the order of float64 additions inside a reduction can
depend on the chunking, a difference far below float32 resolution.
"""
from __future__ import annotations

import torch

from ._base import ImageBatch, Reward, register_reward

__all__ = ["Brightness", "Saturation", "Colorfulness", "brightness", "saturation", "colorfulness"]


def brightness(x: torch.Tensor) -> torch.Tensor:
    """``[N, 3, H, W]`` in [0, 1] -> ``[N]`` mean pixel value."""
    return x.mean(dim=(1, 2, 3))


def saturation(x: torch.Tensor) -> torch.Tensor:
    """``[N, 3, H, W]`` in [0, 1] -> ``[N]`` mean HSV saturation."""
    cmax = x.amax(dim=1)
    cmin = x.amin(dim=1)
    sat = torch.where(cmax > 0, (cmax - cmin) / cmax.clamp_min(1e-12), torch.zeros_like(cmax))
    return sat.mean(dim=(1, 2))


def colorfulness(x: torch.Tensor) -> torch.Tensor:
    """``[N, 3, H, W]`` in [0, 1] -> ``[N]`` Hasler-Suesstrunk colourfulness on the 0-255 scale."""
    x = x * 255.0
    r, g, b = x[:, 0], x[:, 1], x[:, 2]
    return _colorfulness_from(r - g, 0.5 * (r + g) - b)


def _colorfulness_from(rg: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    rg, yb = rg.flatten(1), yb.flatten(1)
    std = torch.sqrt(rg.var(dim=1, unbiased=False) + yb.var(dim=1, unbiased=False))
    mean = torch.sqrt(rg.mean(dim=1) ** 2 + yb.mean(dim=1) ** 2)
    return std + 0.3 * mean


# float64 elements per CPU chunk (2 MB): the chunk's buffers are allocated once per call and reused,
# instead of full-batch float64 temporaries (whose fresh pages cost more than the arithmetic).
_CHUNK_ELEMENTS = 1 << 18


class _PixelReward(Reward):
    fn = staticmethod(brightness)

    def __init__(self):
        super().__init__()

    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        out = torch.empty(len(batch.valid_indices), dtype=torch.float64)
        for positions, images in batch.float_groups():
            # float64 so PIL and tensor inputs give the same sums whatever the device.
            if images.device.type == "cpu":
                scores = self._chunked(images)
            else:
                scores = type(self).fn(images.double()).cpu()
            out[torch.tensor(positions)] = scores
        return {self.name: out}

    def _chunked(self, images: torch.Tensor) -> torch.Tensor:
        n, _, h, w = images.shape
        step = max(1, _CHUNK_ELEMENTS // max(1, 3 * h * w))
        work: dict = {}
        scores = torch.empty(n, dtype=torch.float64)
        for start in range(0, n, step):
            chunk = images[start : start + step]
            scores[start : start + chunk.shape[0]] = self._chunk_scores(chunk, work, min(step, n))
        return scores

    @staticmethod
    def _buffer(work: dict, name: str, shape: tuple, dtype: torch.dtype, rows: int) -> torch.Tensor:
        """A reusable buffer of ``shape`` (first dim = the chunk's ``rows``), allocated on first use."""
        if name not in work:
            work[name] = torch.empty((rows, *shape[1:]), dtype=dtype)
        return work[name][: shape[0]]

    def _chunk_scores(self, chunk: torch.Tensor, work: dict, rows: int) -> torch.Tensor:
        """Scores of one float chunk ``[m, 3, H, W]`` (as ``fn(chunk.double())``)."""
        x = self._buffer(work, "x", tuple(chunk.shape), torch.float64, rows).copy_(chunk)
        return type(self).fn(x)


@register_reward("brightness")
class Brightness(_PixelReward):
    """Mean pixel value in [0, 1]."""

    fn = staticmethod(brightness)


@register_reward("saturation")
class Saturation(_PixelReward):
    """Mean HSV saturation in [0, 1]."""

    fn = staticmethod(saturation)

    def _chunk_scores(self, chunk, work, rows):
        # saturation(chunk.double()) through reused buffers: min/max over channels are exact in
        # float32, the ratio is taken in float64.
        m, _, h, w = chunk.shape
        plane = (m, h, w)
        cmax = torch.amax(chunk, dim=1, out=self._buffer(work, "max32", plane, chunk.dtype, rows))
        cmin = torch.amin(chunk, dim=1, out=self._buffer(work, "min32", plane, chunk.dtype, rows))
        cmax64 = self._buffer(work, "max64", plane, torch.float64, rows).copy_(cmax)
        sat = self._buffer(work, "min64", plane, torch.float64, rows).copy_(cmin)
        zero = torch.gt(cmax64, 0, out=self._buffer(work, "mask", plane, torch.bool, rows))
        torch.logical_not(zero, out=zero)
        torch.sub(cmax64, sat, out=sat)
        sat.div_(cmax64.clamp_min_(1e-12)).masked_fill_(zero, 0.0)
        return sat.mean(dim=(1, 2))


@register_reward("colorfulness")
class Colorfulness(_PixelReward):
    """Hasler & Suesstrunk (2003) colourfulness, 0-255 scale (0 for a grey image)."""

    fn = staticmethod(colorfulness)

    def _chunk_scores(self, chunk, work, rows):
        # colorfulness(chunk.double()) through reused buffers, the same float64 operations in order.
        m, _, h, w = chunk.shape
        x = self._buffer(work, "x", tuple(chunk.shape), torch.float64, rows).copy_(chunk).mul_(255.0)
        r, g, b = x[:, 0], x[:, 1], x[:, 2]
        rg = torch.sub(r, g, out=self._buffer(work, "rg", (m, h, w), torch.float64, rows))
        yb = torch.add(r, g, out=self._buffer(work, "yb", (m, h, w), torch.float64, rows)).mul_(0.5).sub_(b)
        return _colorfulness_from(rg, yb)
