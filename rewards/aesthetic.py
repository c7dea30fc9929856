"""LAION aesthetic predictor v2 ("improved aesthetic predictor", C. Schuhmann) on transformers CLIP.

Backbone: ``CLIPModel`` ``openai/clip-vit-large-patch14`` (CLIP ViT-L/14) and its ``CLIPProcessor``
(resize the shortest side to 224 bicubic, centre crop 224, CLIP mean/std), as in DDPO's and
Flow-GRPO's ``aesthetic_scorer.py``; the original ``simple_inference.py`` uses OpenAI ``clip``'s
preprocess for ViT-L/14 (torchvision ``Resize(224)`` + ``CenterCrop``), the same transform except that torchvision
rounds an odd crop margin's half where transformers floors it: a one-pixel shift on some non-square sizes (e.g.
1216 x 832), none on square images.

Head: ``sac+logos+ava1-l14-linearMSE.pth`` from christophschuhmann/improved-aesthetic-predictor.
Despite the file name it is an MLP ``768 -> 1024 -> 128 -> 64 -> 16 -> 1`` whose ``nn.Sequential`` is
``Linear, Dropout(0.2), Linear, Dropout(0.2), Linear, Dropout(0.1), Linear, Linear`` with **no
activations** (the ReLUs are commented out in the original; "linear" refers to that), so the state
dict keys are ``layers.{0,2,4,6,7}.{weight,bias}``. Dropout is inactive at inference.

Score (checked against the original's ``simple_inference.py`` and DDPO's scorer)::

    e = image_embeds / ||image_embeds||_2        (projected CLIP image embedding; a zero norm counts as 1)
    score = head(e)                               (roughly 1-10; most real images score 4-7)

The head runs in float32 whatever the backbone dtype. Tensor images are quantised to uint8 PIL first
(``round(x * 255)``), as Flow-GRPO does. The head weights are not on the Hugging Face hub under an
official id, so they come from a local file (``head=``); without one the error says what to download.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ._base import ImageBatch, MissingWeightsError, Reward, load_state_dict_file, register_reward
from .clipscore import DEFAULT_CLIP, load_clip
from .pickscore import _embedding

__all__ = ["LaionAesthetic", "AestheticHead", "load_aesthetic_head", "AESTHETIC_HEAD_FILE", "AESTHETIC_HEAD_URL"]

AESTHETIC_HEAD_FILE = "sac+logos+ava1-l14-linearMSE.pth"
AESTHETIC_HEAD_URL = (
    "https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/sac%2Blogos%2Bava1-l14-linearMSE.pth"
)


class AestheticHead(nn.Module):
    """The improved-aesthetic-predictor MLP (no activations; dropout only in training)."""

    def __init__(self, input_dim: int = 768):
        super().__init__()
        self.input_dim = int(input_dim)
        self.layers = nn.Sequential(
            nn.Linear(self.input_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embed: torch.Tensor) -> torch.Tensor:
        return self.layers(embed)


def _missing_head(detail: str) -> MissingWeightsError:
    return MissingWeightsError(
        f"the LAION aesthetic reward needs its head weights {AESTHETIC_HEAD_FILE}: {detail}. Download it from "
        f"{AESTHETIC_HEAD_URL} (the christophschuhmann/improved-aesthetic-predictor repository) and pass "
        f"head=/path/to/{AESTHETIC_HEAD_FILE} (or the directory holding it)."
    )


def load_aesthetic_head(path: str | os.PathLike, weights_only: bool = True) -> AestheticHead:
    """Read ``sac+logos+ava1-l14-linearMSE.pth`` (a file, or a directory holding it) strictly."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, AESTHETIC_HEAD_FILE)
    if not os.path.isfile(path):
        raise _missing_head(f"{path} does not exist")
    state = load_state_dict_file(path, "LAION aesthetic head", weights_only=weights_only)
    weight = state.get("layers.0.weight")
    if weight is None:
        raise MissingWeightsError(f"{path} is not an aesthetic head: no 'layers.0.weight' among {sorted(state)[:8]}")
    head = AestheticHead(input_dim=weight.shape[1])
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise MissingWeightsError(f"{path} does not match the aesthetic MLP 768-1024-128-64-16-1: {exc}") from exc
    return head


@register_reward("aesthetic")
class LaionAesthetic(Reward):
    """LAION aesthetic score of each image (no prompt); see the module docstring."""

    needs_prompts = False

    def __init__(
        self,
        head: str | os.PathLike | nn.Module | None = None,
        model: str | os.PathLike | nn.Module = DEFAULT_CLIP,
        processor: str | os.PathLike | Any | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 32,
        weights_only: bool = True,
    ):
        """Args:
        head: path to ``sac+logos+ava1-l14-linearMSE.pth`` (or a directory holding it), or a built
            :class:`AestheticHead`. Required: there is no official hub copy to fall back on.
        model: hub id or local directory of the CLIP ViT-L/14 ``CLIPModel`` (default
            ``openai/clip-vit-large-patch14``), or a built model.
        processor: its ``CLIPProcessor`` (default: the same source as ``model``).
        device: default CUDA if available, else CPU (built modules stay put unless given).
        dtype: backbone dtype (default float32 when loading); the head always runs in float32.
        batch_size: images per vision forward.
        weights_only: ``torch.load(weights_only=...)`` for the head file.
        """
        super().__init__()
        if head is None:
            raise _missing_head("no head= was given")
        if isinstance(head, (str, os.PathLike)):
            head = load_aesthetic_head(head, weights_only=weights_only)
        if not isinstance(head, nn.Module):
            raise TypeError(f"head must be a path or an nn.Module, got {type(head).__name__}")
        self.model, self.processor = load_clip(model, processor, device, dtype, "LAION aesthetic")
        width = getattr(getattr(self.model, "config", None), "projection_dim", None)
        first = next((m for m in head.modules() if isinstance(m, nn.Linear)), None)
        if width is not None and first is not None and first.in_features != width:
            raise ValueError(
                f"the aesthetic head takes {first.in_features}-dim embeddings but the CLIP model gives {width} "
                "(the LAION head needs CLIP ViT-L/14: 768)"
            )
        self.head = head.to(device=next(self.model.parameters()).device, dtype=torch.float32).eval().requires_grad_(False)
        self.batch_size = int(batch_size)

    @torch.inference_mode()
    def image_embeddings(self, images: list) -> torch.Tensor:
        """L2-normalised float32 CLIP image embeddings ``[len(images), D]`` (zero norm -> unchanged)."""
        param = next(self.model.parameters())
        chunks = []
        for start in range(0, len(images), self.batch_size):
            pixels = self.processor.image_processor(images=images[start : start + self.batch_size], return_tensors="pt")["pixel_values"]
            chunks.append(_embedding(self.model.get_image_features(pixel_values=pixels.to(param.device, param.dtype))).float())
        emb = torch.cat(chunks)
        norm = emb.norm(dim=-1, keepdim=True)
        return emb / torch.where(norm == 0, torch.ones_like(norm), norm)

    @torch.inference_mode()
    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        emb = self.image_embeddings(batch.pil())
        return {self.name: self.head(emb.to(next(self.head.parameters()).device)).squeeze(-1).cpu()}
