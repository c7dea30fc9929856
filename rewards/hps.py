"""HPSv2 / HPSv2.1 (Wu et al. 2023, "Human Preference Score v2", arXiv:2306.09341) on open_clip.

Backbone: open_clip ``ViT-H-14`` whose every weight is replaced by the HPS checkpoint
(``HPS_v2.1_compressed.pt`` from the hub repo ``xswu/HPSv2``; a dict whose ``"state_dict"`` holds
the CLIP weights). Conventions checked against the original (tgxs002/HPSv2, ``hpsv2/img_score.py``):

* preprocessing is the HPSv2 fork's ``image_transform(..., is_train=False, resize_longest_max=True)``:
  ``ResizeMaxSize(224)``: scale so the **longest** side is 224 (new size ``round(side * 224 / max)``,
  bicubic), then zero-pad to a 224x224 square, ``[w//2, h//2, w - w//2, h - h//2]`` for the
  left/top/right/bottom pads - not a centre crop; then ToTensor and the OpenAI CLIP mean/std.
  One deliberate difference: the original skips the pad when the longest side is already 224,
  leaving a non-square input for non-square images; mmrl always pads to the square.
* score = ``diag(image_features @ text_features.T)`` with the features L2-normalised by
  open_clip's ``forward``: the plain **cosine** similarity. The original's outputs include
  ``logit_scale`` but the score does **not** multiply by it (HPSv2.1 scores are ~0.2-0.35).
* the original runs under CUDA fp16 autocast; mmrl runs in ``dtype`` (default float32) and
  computes the cosine in float32, so values differ from the original by fp16 rounding only.

Tensor images are first quantised to uint8 PIL (``round(x * 255)``), as the original works on
PIL images. The text tower runs once per unique prompt; images are batched.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
from PIL import Image

from ._base import (
    prompt_image_cosine,
    ImageBatch,
    MissingWeightsError,
    Reward,
    hub_offline,
    register_reward,
    resolve_device,
    resolve_dtype,
)

__all__ = ["HPSv2", "hps_preprocess", "HPS_REPO", "HPS_FILES", "OPENAI_MEAN", "OPENAI_STD"]

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
# open_clip.constants.OPENAI_DATASET_MEAN / _STD (HPSv2 passes image_mean=None -> these).
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def hps_preprocess(
    image: Image.Image,
    size: int = 224,
    mean: tuple[float, ...] = OPENAI_MEAN,
    std: tuple[float, ...] = OPENAI_STD,
    fill: int = 0,
) -> torch.Tensor:
    """HPSv2's evaluation transform on one PIL image -> float32 ``[3, size, size]``.

    Resize the longest side to ``size`` (bicubic, aspect kept, ``round`` for the other side),
    pad with ``fill`` to a square (extra pixel on the right/bottom), scale to [0, 1], normalise.
    """
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode

    image = image if image.mode == "RGB" else image.convert("RGB")
    width, height = image.size
    scale = size / float(max(height, width))
    new_h, new_w = height, width
    if scale != 1.0:
        new_h, new_w = round(height * scale), round(width * scale)
        image = TF.resize(image, [new_h, new_w], interpolation=InterpolationMode.BICUBIC)
    pad_h, pad_w = size - new_h, size - new_w
    if pad_h or pad_w:
        image = TF.pad(image, [pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=fill)
    return TF.normalize(TF.to_tensor(image), list(mean), list(std))


def resolve_hps_checkpoint(checkpoint: str | os.PathLike | None, version: str = "v2.1") -> str:
    """Path of the HPS checkpoint: the given file (or ``<dir>/HPS_v2.1_compressed.pt``), else the
    hub cache of ``xswu/HPSv2``, else a download unless ``HF_HUB_OFFLINE=1``."""
    if version not in HPS_FILES:
        raise ValueError(f"unknown HPS version {version!r}; use one of {sorted(HPS_FILES)}")
    fname = HPS_FILES[version]
    hint = (
        f"download {fname} from https://huggingface.co/{HPS_REPO} (`hf download {HPS_REPO} {fname}`) "
        f"and pass checkpoint=/path/to/{fname}"
    )
    if checkpoint is not None:
        path = os.fspath(checkpoint)
        if os.path.isdir(path):
            path = os.path.join(path, fname)
        if not os.path.isfile(path):
            raise MissingWeightsError(f"HPS{version} checkpoint not found: {path} does not exist; {hint}.")
        return path
    from huggingface_hub import constants, try_to_load_from_cache

    hit = try_to_load_from_cache(HPS_REPO, fname)
    if isinstance(hit, str):
        return hit
    if hub_offline():
        cache = os.path.join(constants.HF_HUB_CACHE, "models--" + HPS_REPO.replace("/", "--"))
        raise MissingWeightsError(
            f"HPS{version} needs the checkpoint file {fname}, which is not in the Hugging Face cache "
            f"({cache}) and HF_HUB_OFFLINE=1 forbids downloading it; {hint}."
        )
    from huggingface_hub import hf_hub_download

    return hf_hub_download(HPS_REPO, fname)


def load_hps_model(checkpoint: str, arch: str = "ViT-H-14", weights_only: bool = True) -> torch.nn.Module:
    """Build open_clip ``arch`` (no pretrained download) and load the HPS checkpoint strictly."""
    import open_clip

    state = torch.load(checkpoint, map_location="cpu", weights_only=weights_only)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{checkpoint}: expected a state dict (or {{'state_dict': ...}}), got {type(state).__name__}")
    state = {k.removeprefix("module."): v for k, v in state.items()}
    model = open_clip.create_model(arch, pretrained=None, precision="fp32", device="cpu")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise RuntimeError(f"{checkpoint} does not match open_clip {arch!r}: {exc}") from exc
    return model


@register_reward("hpsv2")
class HPSv2(Reward):
    """HPSv2.1 reward (cosine similarity); see the module docstring for the conventions."""

    needs_prompts = True

    def __init__(
        self,
        checkpoint: str | os.PathLike | None = None,
        model: torch.nn.Module | None = None,
        tokenizer: Callable[[list[str]], torch.Tensor] | None = None,
        arch: str = "ViT-H-14",
        version: str = "v2.1",
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 32,
        image_size: int | None = None,
        weights_only: bool = True,
    ):
        """Args:
        checkpoint: path to ``HPS_v2.1_compressed.pt`` (or a directory holding it); default: the
            Hugging Face cache of ``xswu/HPSv2``, downloaded there unless ``HF_HUB_OFFLINE=1``.
        model: an already-built open_clip CLIP (``encode_image``/``encode_text``); then no
            checkpoint is read (tests pass a tiny random one).
        tokenizer: an open_clip tokenizer; default ``open_clip.get_tokenizer(arch)`` (bundled BPE).
        arch: open_clip architecture name (HPSv2: ``ViT-H-14``).
        version: ``"v2.1"`` (default) or ``"v2.0"``; picks the checkpoint file name.
        device: default CUDA if available, else CPU (a built model stays put unless given, and is
            then moved in place, as is its dtype).
        dtype: model dtype (default float32 when loading; the original used fp16 autocast).
        batch_size: images per vision forward.
        image_size: square input size; default the model's ``visual.image_size`` (224).
        weights_only: ``torch.load(weights_only=...)``; only disable for a checkpoint you trust.
        """
        super().__init__()
        import open_clip  # heavy: imported only when used

        dtype = resolve_dtype(dtype)
        if model is None:
            path = resolve_hps_checkpoint(checkpoint, version)
            model = load_hps_model(path, arch, weights_only=weights_only)
            device = resolve_device(device)
            dtype = dtype or torch.float32
        for attr in ("encode_image", "encode_text"):
            if not hasattr(model, attr):
                raise TypeError(f"model must be an open_clip CLIP; {type(model).__name__} has no {attr}")
        if device is not None or dtype is not None:
            model = model.to(device=None if device is None else torch.device(device), dtype=dtype)
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer if tokenizer is not None else open_clip.get_tokenizer(arch)
        if image_size is None:
            size: Any = getattr(getattr(model, "visual", None), "image_size", 224)
            image_size = size[0] if isinstance(size, (tuple, list)) else size
        self.image_size = int(image_size)
        self.batch_size = int(batch_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def preprocess(self, images: list[Image.Image]) -> torch.Tensor:
        """PIL images -> ``[N, 3, S, S]`` float32 via :func:`hps_preprocess`."""
        return torch.stack([hps_preprocess(img, self.image_size) for img in images])

    @torch.inference_mode()
    def text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        tokens = self.tokenizer(prompts).to(self.device)
        emb = self.model.encode_text(tokens).float()
        return emb / emb.norm(dim=-1, keepdim=True)

    @torch.inference_mode()
    def image_embeddings(self, images: list[Image.Image]) -> torch.Tensor:
        chunks = []
        for start in range(0, len(images), self.batch_size):
            pixels = self.preprocess(images[start : start + self.batch_size]).to(self.device, self.dtype)
            chunks.append(self.model.encode_image(pixels).float())
        emb = torch.cat(chunks)
        return emb / emb.norm(dim=-1, keepdim=True)

    @torch.inference_mode()
    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        cos = prompt_image_cosine(batch, self.text_embeddings, self.image_embeddings)
        return {self.name: cos.cpu()}
