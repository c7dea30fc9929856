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

Tensor images are first quantised to uint8 (``round(x * 255)``) and resized as PIL images, as the
original works on PIL images (``resize="pil"``, the default); ``resize="tensor"`` resizes the uint8
tensor batch with torchvision's antialiased bicubic instead, on the tensor's device (no PIL round
trip; it differs from PIL's by at most 1-2 uint8 steps on about 1% of pixels). Images whose longest
side is already the input size need no resize and take the tensor path either way (exact). After
the resize, padding, scaling and normalisation run batched on the stacked uint8 images, exactly
:func:`hps_preprocess`'s arithmetic. The text tower runs once per unique prompt; images are batched.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import numpy as np
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

__all__ = ["HPSv2", "hps_preprocess", "hps_preprocess_batch", "HPS_REPO", "HPS_FILES", "OPENAI_MEAN", "OPENAI_STD"]

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


def _hps_geometry(height: int, width: int, size: int) -> tuple[int, int, int, int]:
    """``(new_h, new_w, top, left)`` of :func:`hps_preprocess`: longest side to ``size`` (``round``
    for the other), then the pad's top/left offsets (the extra pixel goes right/bottom)."""
    scale = size / float(max(height, width))
    new_h, new_w = (round(height * scale), round(width * scale)) if scale != 1.0 else (height, width)
    return new_h, new_w, (size - new_h) // 2, (size - new_w) // 2


def _normalise_uint8(canvas: torch.Tensor, mean, std) -> torch.Tensor:
    """uint8 ``[N, 3, S, S]`` -> float32, ``x / 255`` then ``(x - mean) / std`` per channel: the same
    float32 operations as torchvision's ``to_tensor`` + ``normalize`` on each image."""
    x = canvas.to(torch.float32).div_(255)
    mean_t = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    std_t = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return x.sub_(mean_t).div_(std_t)


def hps_preprocess_batch(
    images: Sequence[Image.Image],
    size: int = 224,
    mean: tuple[float, ...] = OPENAI_MEAN,
    std: tuple[float, ...] = OPENAI_STD,
    fill: int = 0,
) -> torch.Tensor:
    """:func:`hps_preprocess` for a list of PIL images -> float32 ``[N, 3, size, size]``, bit-identical.

    Each image is resized with PIL (bicubic) as there; the padded uint8 images are stacked and
    scaled/normalised in one batched step instead of one tensor conversion per image.
    """
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode

    canvas = torch.full((len(images), 3, size, size), int(fill), dtype=torch.uint8)
    planes = canvas.numpy()  # shares memory with canvas
    for i, image in enumerate(images):
        image = image if image.mode == "RGB" else image.convert("RGB")
        width, height = image.size
        new_h, new_w, top, left = _hps_geometry(height, width, size)
        if (new_h, new_w) != (height, width):
            image = TF.resize(image, [new_h, new_w], interpolation=InterpolationMode.BICUBIC)
        for c, band in enumerate(image.split()):  # pillow's planes: no H x W x 3 transpose
            planes[i, c, top : top + new_h, left : left + new_w] = np.asarray(band)
    return _normalise_uint8(canvas, mean, std)


def hps_preprocess_uint8(
    images: torch.Tensor,
    size: int = 224,
    mean: tuple[float, ...] = OPENAI_MEAN,
    std: tuple[float, ...] = OPENAI_STD,
    fill: int = 0,
) -> torch.Tensor:
    """HPSv2's transform for a uint8 ``[N, 3, H, W]`` tensor batch, on its device. Without a resize
    (longest side already ``size``) it equals :func:`hps_preprocess` exactly; otherwise the resize is
    torchvision's antialiased bicubic on uint8, not PIL's (at most a step or two apart)."""
    n, _, height, width = images.shape
    new_h, new_w, top, left = _hps_geometry(height, width, size)
    if (new_h, new_w) != (height, width):
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.v2 import functional as F2

        images = F2.resize(images, [new_h, new_w], interpolation=InterpolationMode.BICUBIC, antialias=True)
    canvas = torch.full((n, 3, size, size), int(fill), dtype=torch.uint8, device=images.device)
    canvas[:, :, top : top + new_h, left : left + new_w] = images
    return _normalise_uint8(canvas, mean, std)


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
        resize: str = "pil",
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
        resize: ``"pil"`` (default): tensor images are resized as PIL images, as the original does;
            ``"tensor"``: with torchvision on the uint8 tensor, on its device (see the module doc).
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
        if resize not in ("pil", "tensor"):
            raise ValueError(f"resize must be 'pil' or 'tensor', got {resize!r}")
        self.resize = resize

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def preprocess(self, images) -> torch.Tensor:
        """PIL images (as :func:`hps_preprocess`, batched) or a uint8 ``[N, 3, H, W]`` tensor (as
        :func:`hps_preprocess_uint8`) -> ``[N, 3, S, S]`` float32."""
        if isinstance(images, torch.Tensor):
            return hps_preprocess_uint8(images, self.image_size)
        return hps_preprocess_batch(images, self.image_size)

    @torch.inference_mode()
    def text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        tokens = self.tokenizer(prompts).to(self.device)
        emb = self.model.encode_text(tokens).float()
        return emb / emb.norm(dim=-1, keepdim=True)

    @torch.inference_mode()
    def image_embeddings(self, images) -> torch.Tensor:
        """L2-normalised float32 image embeddings for a list of PIL images or an :class:`ImageBatch`
        (a tensor batch skips PIL when no resize is needed, or with ``resize="tensor"``)."""
        if isinstance(images, ImageBatch):
            tensor_path = images.is_tensor and (
                self.resize == "tensor" or max(images.uint8().shape[-2:]) == self.image_size
            )
            images = images.uint8() if tensor_path else images.pil()
        chunks = []
        for start in range(0, len(images), self.batch_size):
            pixels = self.preprocess(images[start : start + self.batch_size]).to(self.device, self.dtype)
            chunks.append(self.model.encode_image(pixels).float())
        emb = torch.cat(chunks)
        return emb / emb.norm(dim=-1, keepdim=True)

    @torch.inference_mode()
    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        cos = prompt_image_cosine(batch, self.text_embeddings, self.image_embeddings, pass_batch=True)
        return {self.name: cos.cpu()}
