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

Scores are computed on the float input (a PIL image is read as uint8 / 255).
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
    rg = (r - g).flatten(1)
    yb = (0.5 * (r + g) - b).flatten(1)
    std = torch.sqrt(rg.var(dim=1, unbiased=False) + yb.var(dim=1, unbiased=False))
    mean = torch.sqrt(rg.mean(dim=1) ** 2 + yb.mean(dim=1) ** 2)
    return std + 0.3 * mean


class _PixelReward(Reward):
    fn = staticmethod(brightness)

    def __init__(self):
        super().__init__()

    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        out = torch.empty(len(batch.valid_indices), dtype=torch.float64)
        for positions, images in batch.float_groups():
            # float64 so PIL and tensor inputs give bit-identical sums whatever the device.
            out[torch.tensor(positions)] = type(self).fn(images.double()).cpu()
        return {self.name: out}


@register_reward("brightness")
class Brightness(_PixelReward):
    """Mean pixel value in [0, 1]."""

    fn = staticmethod(brightness)


@register_reward("saturation")
class Saturation(_PixelReward):
    """Mean HSV saturation in [0, 1]."""

    fn = staticmethod(saturation)


@register_reward("colorfulness")
class Colorfulness(_PixelReward):
    """Hasler & Suesstrunk (2003) colourfulness, 0-255 scale (0 for a grey image)."""

    fn = staticmethod(colorfulness)
