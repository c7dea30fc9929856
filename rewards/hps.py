"""HPSv2 / HPSv2.1 (Wu et al. 2023, "Human Preference Score v2", arXiv:2306.09341) on open_clip.

Backbone: open_clip ``ViT-H-14`` whose every weight is replaced by the HPS checkpoint
(``HPS_v2.1_compressed.pt`` from the hub repo ``xswu/HPSv2``; a dict whose ``"state_dict"`` holds
the CLIP weights). Conventions checked against the original (tgxs002/HPSv2 866735e, ``hpsv2/img_score.py``,
``hpsv2/src/open_clip/transform.py``):

* preprocessing is the HPSv2 fork's ``image_transform(224, is_train=False, resize_longest_max=True)``
  (what ``create_model_and_transforms(..., light_augmentation=True)`` returns as ``preprocess_val``, used by
  ``hpsv2.score``, ``hpsv2.evaluate`` and DanceGRPO's HPS reward):
  ``Compose([_convert_to_rgb_or_rgba, ToTensor(), ResizeMaxSize(224, fill=0), normalize])``. In that order:

  1. the image becomes a float32 tensor in ``[0, 1]`` (``uint8 / 255``) **before** any resize;
  2. ``ResizeMaxSize``: ``scale = 224 / max(h, w)``; if ``scale != 1`` the tensor is resized to
     ``(round(h * scale), round(w * scale))`` with torchvision's *tensor* ``F.resize`` (bicubic, on float32:
     no uint8 rounding, no clamping, so values may overshoot [0, 1] a little), then padded with
     ``F.pad(..., [w//2, h//2, w - w//2, h - h//2], fill=0)`` for the left/top/right/bottom pads
     (``w``/``h`` here the missing width/height; the odd pixel goes right/bottom): the whole image,
     centred on a black (``0.0``) canvas, not a centre crop;
  3. ``Normalize`` with the OpenAI CLIP mean/std.

  ``ResizeMaxSize`` calls ``F.resize`` without ``antialias``, so the antialiasing is torchvision's default:
  ``True`` from torchvision 0.17 on (what the torchvision pinned here gives the official code), ``None`` =
  off for tensors before. ``antialias=True`` (the default here) reproduces the former; ``antialias=False``
  reproduces HPS scores computed with torchvision < 0.17. open_clip itself (open_clip_torch 3.x) has no
  ``ResizeMaxSize``: its ``resize_mode="longest"`` resizes the PIL image before ``ToTensor`` (PIL bicubic,
  uint8) with a centre ``CenterCropOrPad``, which is not this transform, so it is written out here.

  Two deliberate differences, both where the original cannot run a batch: the original skips the pad when
  the longest side is already 224 (a non-square input, which the ViT's fixed position embedding rejects);
  mmrl always pads to the square. And ``_convert_to_rgb_or_rgba`` keeps an RGBA image's alpha (a
  4-channel input the ViT rejects); mmrl converts every image to RGB (alpha dropped, as
  ``Image.convert("RGB")``).
* score = ``diag(image_features @ text_features.T)`` with the features L2-normalised by
  open_clip's ``forward``: the plain **cosine** similarity. The original's outputs include
  ``logit_scale`` but the score does **not** multiply by it (HPSv2.1 scores are ~0.2-0.35).
* the original runs under CUDA fp16 autocast; mmrl runs in ``dtype`` (default float32) and
  computes the cosine in float32, so values differ from the original by fp16 rounding.

Inputs. PIL images go through exactly the steps above (``ToTensor`` = ``uint8 / 255``). A float tensor
batch in [0, 1] (what the trainer passes) is first quantised to uint8, ``round(x * 255)`` clipped
(:meth:`ImageBatch.uint8`), and then takes the same path: the official scorer only ever sees saved 8-bit
images (``hpsv2.evaluate`` reads ``.jpg`` files; DanceGRPO's reward ``VaeImageProcessor.postprocess``-es
the decoded image to a uint8 PIL image), so the score of a tensor equals the official score of that image
saved losslessly (PNG). The steps run batched on tensors, on the images' device (CPU for PIL images, the
trainer's GPU for its tensors), images of one size together; :func:`hps_preprocess_tensor` is the
transform from ``ToTensor`` on, for uint8 or float tensors (a float tensor is used as given, without
quantisation). The text tower runs once per unique prompt; images are batched.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch
from PIL import Image

from ._base import (
    prompt_image_cosine,
    ImageBatch,
    MissingWeightsError,
    Reward,
    hub_offline,
    load_state_dict_file,
    register_reward,
    resolve_device,
    resolve_dtype,
)
from ._images import float_to_uint8, pil_to_uint8

__all__ = ["HPSv2", "hps_preprocess", "hps_preprocess_batch", "hps_preprocess_tensor", "HPS_REPO", "HPS_FILES",
           "OPENAI_MEAN", "OPENAI_STD"]

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
# open_clip.constants.OPENAI_DATASET_MEAN / _STD (HPSv2 passes image_mean=None -> these).
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def _hps_geometry(height: int, width: int, size: int) -> tuple[int, int, int, int]:
    """``ResizeMaxSize``'s geometry, ``(new_h, new_w, top, left)``: ``scale = size / max(h, w)``; if it is not 1
    the new size is ``round(side * scale)``; then the pad's top/left offsets (``missing // 2``; the odd pixel
    goes to the right/bottom)."""
    scale = size / float(max(height, width))
    new_h, new_w = (round(height * scale), round(width * scale)) if scale != 1.0 else (height, width)
    return new_h, new_w, (size - new_h) // 2, (size - new_w) // 2


def hps_preprocess_tensor(
    images: torch.Tensor,
    size: int = 224,
    mean: tuple[float, ...] = OPENAI_MEAN,
    std: tuple[float, ...] = OPENAI_STD,
    fill: float = 0.0,
    antialias: bool = True,
) -> torch.Tensor:
    """HPSv2's evaluation transform from ``ToTensor`` on, for a batch ``[N, 3, H, W]`` -> float32
    ``[N, 3, size, size]`` on the batch's device.

    ``images``: uint8 (scaled ``x / 255``, what ``ToTensor`` does to an 8-bit image) or float in [0, 1]
    (used as given: no uint8 quantisation). Then ``ResizeMaxSize(size)``: torchvision's tensor bicubic
    ``F.resize`` to the longest side ``size`` on float32 (``antialias`` as given; the official code gets
    torchvision's default, ``True`` from torchvision 0.17), ``fill`` padding (on the [0, 1] scale, as the
    official pad runs after ``ToTensor``; 0 = black) to the centred square, always (see the module doc);
    then ``(x - mean) / std``.
    """
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode

    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images [N, 3, H, W], got shape {tuple(images.shape)}")
    x = images.to(torch.float32).div(255) if images.dtype == torch.uint8 else images.to(torch.float32)
    n, _, height, width = x.shape
    new_h, new_w, top, left = _hps_geometry(height, width, size)
    if (new_h, new_w) != (height, width):
        x = TF.resize(x, [new_h, new_w], interpolation=InterpolationMode.BICUBIC, antialias=antialias)
    if (new_h, new_w) != (size, size):
        canvas = torch.full((n, 3, size, size), float(fill), dtype=torch.float32, device=x.device)
        canvas[:, :, top : top + new_h, left : left + new_w] = x
        x = canvas
    return TF.normalize(x, list(mean), list(std), inplace=x is not images)


def hps_preprocess_batch(
    images: Sequence[Image.Image],
    size: int = 224,
    mean: tuple[float, ...] = OPENAI_MEAN,
    std: tuple[float, ...] = OPENAI_STD,
    fill: float = 0.0,
    antialias: bool = True,
) -> torch.Tensor:
    """HPSv2's evaluation transform for a list of PIL images -> float32 ``[N, 3, size, size]`` (CPU).

    Each image is converted to RGB and to its uint8 pixels; images of one size are transformed together by
    :func:`hps_preprocess_tensor` (``ToTensor`` = ``/ 255``, tensor bicubic resize, pad, normalise).
    """
    out = torch.empty((len(images), 3, size, size), dtype=torch.float32)
    by_size: dict[tuple[int, int], list[int]] = {}
    for i, image in enumerate(images):
        by_size.setdefault(image.size, []).append(i)
    for rows in by_size.values():
        pixels = torch.stack([pil_to_uint8(images[i]) for i in rows])
        out[rows] = hps_preprocess_tensor(pixels, size, mean, std, fill, antialias)
    return out


def hps_preprocess(
    image: Image.Image,
    size: int = 224,
    mean: tuple[float, ...] = OPENAI_MEAN,
    std: tuple[float, ...] = OPENAI_STD,
    fill: float = 0.0,
    antialias: bool = True,
) -> torch.Tensor:
    """HPSv2's evaluation transform on one PIL image -> float32 ``[3, size, size]``: RGB, ``ToTensor``, tensor
    bicubic resize of the longest side to ``size``, ``fill`` pad to the centred square, normalise (see
    :func:`hps_preprocess_tensor` and the module doc)."""
    return hps_preprocess_tensor(pil_to_uint8(image)[None], size, mean, std, fill, antialias)[0]


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

    state = load_state_dict_file(checkpoint, "HPS", weights_only=weights_only)
    model = open_clip.create_model(arch, pretrained=None, precision="fp32", device="cpu")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise MissingWeightsError(f"{checkpoint} does not match open_clip {arch!r}: {exc}") from exc
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
        antialias: bool = True,
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
        antialias: the bicubic resize's antialiasing. ``True`` (default) is what the official
            ``ResizeMaxSize`` gets from torchvision >= 0.17 (the versions mmrl supports); ``False``
            reproduces HPS scores computed with torchvision < 0.17, whose default was no antialiasing
            for tensors.
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
        if not isinstance(antialias, bool):
            raise ValueError(f"antialias must be true or false, got {antialias!r}")
        self.antialias = antialias

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def preprocess(self, images) -> torch.Tensor:
        """PIL images (:func:`hps_preprocess_batch`) or a ``[N, 3, H, W]`` tensor batch -> ``[N, 3, S, S]``
        float32 (:func:`hps_preprocess_tensor`, on the tensor's device). A float tensor in [0, 1] is quantised
        to uint8 first (``round(x * 255)``, clipped), as the official scorer sees a saved 8-bit image."""
        if isinstance(images, torch.Tensor):
            return hps_preprocess_tensor(float_to_uint8(images), self.image_size, antialias=self.antialias)
        return hps_preprocess_batch(images, self.image_size, antialias=self.antialias)

    @torch.inference_mode()
    def text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        tokens = self.tokenizer(prompts).to(self.device)
        emb = self.model.encode_text(tokens).float()
        return emb / emb.norm(dim=-1, keepdim=True)

    @torch.inference_mode()
    def image_embeddings(self, images) -> torch.Tensor:
        """L2-normalised float32 image embeddings for a list of PIL images, a tensor batch or an
        :class:`ImageBatch` (a tensor batch as its uint8 quantisation, on its device: no PIL round trip)."""
        if isinstance(images, ImageBatch):
            images = images.uint8() if images.is_tensor else images.pil()
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
