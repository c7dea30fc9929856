"""ImageReward (Xu et al. 2023, "ImageReward: Learning and Evaluating Human Preferences for
Text-to-Image Generation", arXiv:2304.05977) ported to transformers' BLIP modules.

The original (THUDM/ImageReward, ``ImageReward/ImageReward.py``) is BLIP's ViT-L/16 image encoder
(224 px) plus BLIP's "MED" BERT text encoder with cross-attention to the image tokens, and an MLP head
on the text [CLS] state. mmrl builds the same network from transformers' ``BlipVisionModel`` and
``BlipTextModel`` (transformers' port of BLIP's ``vit.py`` and ``med.py``) and loads the original
checkpoint ``ImageReward.pt`` (hub repo ``THUDM/ImageReward``) through an explicit key mapping
(:func:`convert_original_state_dict`, inverse :func:`to_original_state_dict`). Conventions checked
against the original:

* image: ``Resize(224, bicubic)`` of the shortest side, ``CenterCrop(224)``, RGB, ToTensor, OpenAI
  CLIP mean/std (torchvision on the PIL image, :func:`blip_preprocess`);
* text: ``BertTokenizer`` of ``bert-base-uncased`` with BLIP's added ``[DEC]`` (bos) and ``[ENC]``
  tokens, ``padding="max_length", truncation=True, max_length=35``; the ids go in as tokenised,
  beginning with ``[CLS]`` (ImageReward does **not** swap in ``[ENC]`` as BLIP's ITM head does);
* ``text_encoder(ids, mask, encoder_hidden_states=vit(image), encoder_attention_mask=ones)``,
  bidirectional self-attention; features = last hidden state at position 0, in float32;
* head: ``Linear(768,1024), Dropout, Linear(1024,128), Dropout, Linear(128,64), Dropout,
  Linear(64,16), Linear(16,1)`` (no activations), then ``(r - 0.16717362830052426) / 1.0333394966054072``.
* architecture constants: ViT-L/16 (1024 wide, 24 layers, 16 heads, MLP 4096, LayerNorm eps 1e-6 as
  in BLIP's ``vit.py``, exact GELU); MED BERT from ``med_config.json`` (vocab 30524, 768 wide,
  12 layers, 12 heads, MLP 3072, LayerNorm eps 1e-12, 512 positions, cross-attention width 1024).
  transformers' BLIP defaults differ (8 text heads, vision eps 1e-5), so the configs are set here.

Speed: the image tower runs once per image and prompts are tokenised once per unique prompt, but the
text tower cannot be shared across a prompt's images: it cross-attends to each image in every layer,
so it runs once per (image, prompt) pair, batched. Tensor images are quantised to uint8 PIL first
(``round(x * 255)``), as Flow-GRPO does before calling ImageReward.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any, Mapping

import torch
from PIL import Image
from torch import nn

from ._base import (
    ImageBatch,
    MissingWeightsError,
    Reward,
    hub_offline,
    register_reward,
    resolve_device,
    resolve_dtype,
)
from ._base import check_available as _check_available

__all__ = [
    "ImageReward",
    "ImageRewardModel",
    "imagereward_configs",
    "convert_original_state_dict",
    "to_original_state_dict",
    "blip_preprocess",
    "infer_configs",
    "load_imagereward_model",
    "IMAGEREWARD_REPO",
    "IMAGEREWARD_FILE",
    "IMAGEREWARD_MEAN",
    "IMAGEREWARD_STD",
]

IMAGEREWARD_REPO = "THUDM/ImageReward"
IMAGEREWARD_FILE = "ImageReward.pt"
MED_CONFIG_FILE = "med_config.json"
DEFAULT_TOKENIZER = "google-bert/bert-base-uncased"  # the original loads "bert-base-uncased" (same repo)
IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)

# BLIP's configs/med_config.json as shipped with ImageReward (encoder_width is overwritten by the ViT width).
MED_CONFIG = {
    "hidden_act": "gelu",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 512,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 0,
    "vocab_size": 30524,
}
# BLIP create_vit("large", 224): VisionTransformer(patch 16, width 1024, depth 24, heads 16, mlp 4x).
VIT_LARGE = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 224,
    "patch_size": 16,
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu",
}


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------


def imagereward_configs(
    med_config: Mapping[str, Any] | None = None, vision: Mapping[str, Any] | None = None
) -> tuple[Any, Any]:
    """``(BlipVisionConfig, BlipTextConfig)`` of ImageReward; ``med_config`` (a BERT-style dict, e.g.
    ``med_config.json``) and ``vision`` override the defaults (tests pass tiny sizes)."""
    from transformers import BlipTextConfig, BlipVisionConfig

    v = {**VIT_LARGE, **(vision or {})}
    m = {**MED_CONFIG, **{k: val for k, val in (med_config or {}).items() if k in MED_CONFIG}}
    vision_config = BlipVisionConfig(attention_dropout=0.0, **v)
    text_config = BlipTextConfig(
        vocab_size=m["vocab_size"],
        hidden_size=m["hidden_size"],
        encoder_hidden_size=v["hidden_size"],  # BLIP: encoder_config.encoder_width = vision_width
        intermediate_size=m["intermediate_size"],
        num_hidden_layers=m["num_hidden_layers"],
        num_attention_heads=m["num_attention_heads"],
        max_position_embeddings=m["max_position_embeddings"],
        hidden_act=m["hidden_act"],
        layer_norm_eps=m["layer_norm_eps"],
        pad_token_id=m["pad_token_id"],
        bos_token_id=None,  # unused by an encoder; transformers' defaults (30522, 102, 2) would
        sep_token_id=None,  # be out of range for small test vocabularies
        eos_token_id=None,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        is_decoder=True,  # transformers builds the cross-attention blocks only for a "decoder" config;
        use_cache=False,  # the forward below is bidirectional (is_decoder=False at call time)
    )
    return vision_config, text_config


class ImageRewardModel(nn.Module):
    """BLIP ViT + MED text encoder with cross-attention + MLP head, on transformers modules.

    ``forward(pixel_values, input_ids, attention_mask)`` returns the normalised reward ``[N]``
    (float32). Submodules: ``vision_model`` (``BlipVisionModel``), ``text_encoder``
    (``BlipTextModel`` without pooler), ``mlp`` (``mlp.layers`` as in the original).
    """

    def __init__(self, vision_config, text_config):
        super().__init__()
        from transformers import BlipTextModel, BlipVisionModel

        from .aesthetic import AestheticHead  # the same MLP (768-1024-128-64-16-1, no activations)

        self.vision_model = BlipVisionModel(vision_config)
        self.text_encoder = BlipTextModel(text_config, add_pooling_layer=False)
        self.mlp = AestheticHead(input_dim=text_config.hidden_size)
        self.mean = IMAGEREWARD_MEAN
        self.std = IMAGEREWARD_STD

    @property
    def image_size(self) -> int:
        size = self.vision_model.config.image_size
        return int(size[0] if isinstance(size, (tuple, list)) else size)

    def image_embeds(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """All ViT tokens after the final LayerNorm, ``[N, 1 + patches, width]`` (BLIP ``visual_encoder``)."""
        return self.vision_model(pixel_values=pixel_values).last_hidden_state

    def score_embeds(self, image_embeds: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Normalised reward ``[N]`` (float32) for image tokens and their prompts' token ids."""
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        out = self.text_encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=image_atts,
            is_decoder=False,
        )
        features = out.last_hidden_state[:, 0, :].float()
        head = next(self.mlp.parameters())
        reward = self.mlp(features.to(head.dtype)).float().squeeze(-1)
        return (reward - self.mean) / self.std

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.score_embeds(self.image_embeds(pixel_values), input_ids, attention_mask)


# --------------------------------------------------------------------------------------------
# checkpoint key mapping: original ImageReward.pt <-> ImageRewardModel
# --------------------------------------------------------------------------------------------

# (original, mmrl) regular-expression pairs; each maps one name to one name, both ways.
_KEY_MAP = [
    (r"blip\.visual_encoder\.cls_token", r"vision_model.embeddings.class_embedding"),
    (r"blip\.visual_encoder\.pos_embed", r"vision_model.embeddings.position_embedding"),
    (r"blip\.visual_encoder\.patch_embed\.proj\.(weight|bias)", r"vision_model.embeddings.patch_embedding.\1"),
    (r"blip\.visual_encoder\.blocks\.(\d+)\.norm1\.(weight|bias)", r"vision_model.encoder.layers.\1.layer_norm1.\2"),
    (r"blip\.visual_encoder\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)", r"vision_model.encoder.layers.\1.self_attn.qkv.\2"),
    (r"blip\.visual_encoder\.blocks\.(\d+)\.attn\.proj\.(weight|bias)", r"vision_model.encoder.layers.\1.self_attn.projection.\2"),
    (r"blip\.visual_encoder\.blocks\.(\d+)\.norm2\.(weight|bias)", r"vision_model.encoder.layers.\1.layer_norm2.\2"),
    (r"blip\.visual_encoder\.blocks\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)", r"vision_model.encoder.layers.\1.mlp.\2.\3"),
    (r"blip\.visual_encoder\.norm\.(weight|bias)", r"vision_model.post_layernorm.\1"),
    # MED BERT: transformers' BlipTextModel keeps med.py's module names
    (r"blip\.text_encoder\.((?:embeddings|encoder)\..+)", r"text_encoder.\1"),
    (r"mlp\.layers\.(\d+)\.(weight|bias)", r"mlp.layers.\1.\2"),
]
# Present in ImageReward.pt, unused by the score: the contrastive projections (BLIP_Pretrain's
# vision_proj/text_proj) and med.py's persistent position_ids buffer (non-persistent in transformers).
_IGNORED = [r"blip\.vision_proj\..+", r"blip\.text_proj\..+", r"blip\.text_encoder\.embeddings\.position_ids"]


def _unreplace(template: str) -> str:
    """Turn a replacement template with \\N groups into a regex matching its outputs."""
    parts = re.split(r"(\\\d)", template)
    return "".join(r"(.+?)" if re.fullmatch(r"\\\d", p) else re.escape(p) for p in parts)


def _regex_to_template(pattern: str) -> str:
    """Turn a pattern with capture groups into a replacement template (\\1, \\2, ...)."""
    out, n, i = [], 0, 0
    while i < len(pattern):
        if pattern[i] == "(" and not pattern.startswith("(?:", i):
            depth, j = 1, i + 1
            while depth:
                depth += {"(": 1, ")": -1}.get(pattern[j], 0)
                j += 1
            n += 1
            out.append(f"\\{n}")
            i = j
        elif pattern[i] == "\\" and i + 1 < len(pattern):
            out.append(pattern[i + 1])
            i += 2
        else:
            out.append(pattern[i])
            i += 1
    return "".join(out)


def _rename(state: Mapping[str, torch.Tensor], pairs) -> tuple[dict, list[str]]:
    renamed, unmatched = {}, []
    for key, value in state.items():
        for src, dst in pairs:
            m = re.fullmatch(src, key)
            if m:
                new = m.expand(dst)
                if new in renamed:
                    raise ValueError(f"two checkpoint keys map to {new!r}")
                renamed[new] = value
                break
        else:
            unmatched.append(key)
    return renamed, unmatched


def convert_original_state_dict(state: Mapping[str, torch.Tensor]) -> tuple[dict, list[str]]:
    """Rename an original ``ImageReward.pt`` state dict to :class:`ImageRewardModel` names.

    Accepts a ``"state_dict"``/``"model"`` wrapper and a ``module.`` prefix. Returns
    ``(renamed, unknown)``: ``unknown`` lists keys that are neither mapped nor known to be unused.
    """
    if "state_dict" in state and isinstance(state["state_dict"], Mapping):
        state = state["state_dict"]
    elif "model" in state and isinstance(state["model"], Mapping):
        state = state["model"]
    state = {k.removeprefix("module."): v for k, v in state.items()}
    used = {k: v for k, v in state.items() if not any(re.fullmatch(p, k) for p in _IGNORED)}
    return _rename(used, _KEY_MAP)


def to_original_state_dict(state: Mapping[str, torch.Tensor]) -> dict:
    """The inverse of :func:`convert_original_state_dict`: :class:`ImageRewardModel` names back to
    the original's (``blip.visual_encoder.*``, ``blip.text_encoder.*``, ``mlp.layers.*``)."""
    inverse = [(_unreplace(dst), _regex_to_template(src)) for src, dst in _KEY_MAP]
    skip = r"text_encoder\.embeddings\.position_ids"
    renamed, unmatched = _rename({k: v for k, v in state.items() if not re.fullmatch(skip, k)}, inverse)
    if unmatched:
        raise ValueError(f"keys with no original name: {unmatched[:10]}")
    return renamed


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------


def _hub_file(repo: str, filename: str, required: bool) -> str | None:
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    try:
        hit = try_to_load_from_cache(repo, filename)
    except Exception:
        hit = None
    if isinstance(hit, str):
        return hit
    if hub_offline():
        if not required:
            return None
        cache = os.path.join(constants.HF_HUB_CACHE, "models--" + repo.replace("/", "--"))
        raise MissingWeightsError(
            f"ImageReward needs {filename} from the hub repo {repo}, which is not in the Hugging Face cache "
            f"({cache}) and HF_HUB_OFFLINE=1 forbids downloading it; download it where there is network "
            f"(`hf download {repo} {filename}`) or pass checkpoint=/path/to/{filename} (or a directory holding "
            f"{IMAGEREWARD_FILE} and {MED_CONFIG_FILE})."
        )
    try:
        return hf_hub_download(repo, filename)
    except Exception as exc:
        if required:
            raise MissingWeightsError(f"could not get {filename} from {repo}: {exc}") from exc
        return None


def resolve_imagereward_files(checkpoint: str | os.PathLike | None) -> tuple[str, str | None]:
    """``(ImageReward.pt path, med_config.json path or None)`` for a file, a directory, a hub repo id
    or ``None`` (= ``THUDM/ImageReward``, from the cache or downloaded unless ``HF_HUB_OFFLINE=1``)."""
    source = IMAGEREWARD_REPO if checkpoint is None else os.fspath(checkpoint)
    if os.path.isfile(source):
        med = os.path.join(os.path.dirname(source), MED_CONFIG_FILE)
        return source, med if os.path.isfile(med) else None
    if os.path.isdir(source):
        path = os.path.join(source, IMAGEREWARD_FILE)
        if not os.path.isfile(path):
            raise MissingWeightsError(
                f"ImageReward checkpoint not found: {path} does not exist; put {IMAGEREWARD_FILE} (and "
                f"{MED_CONFIG_FILE}) from https://huggingface.co/{IMAGEREWARD_REPO} there."
            )
        med = os.path.join(source, MED_CONFIG_FILE)
        return path, med if os.path.isfile(med) else None
    looks_local = os.path.isabs(source) or source.startswith(".") or source.endswith((".pt", ".pth")) or source.count("/") != 1
    if looks_local:
        raise MissingWeightsError(
            f"ImageReward checkpoint not found: {source} does not exist; download {IMAGEREWARD_FILE} from "
            f"https://huggingface.co/{IMAGEREWARD_REPO} (`hf download {IMAGEREWARD_REPO} {IMAGEREWARD_FILE}`) and "
            f"pass checkpoint=/path/to/{IMAGEREWARD_FILE}."
        )
    return _hub_file(source, IMAGEREWARD_FILE, True), _hub_file(source, MED_CONFIG_FILE, False)


def infer_configs(state: Mapping[str, torch.Tensor], med_config: Mapping[str, Any] | None = None) -> tuple[Any, Any]:
    """ImageReward's ``(BlipVisionConfig, BlipTextConfig)`` read off an :class:`ImageRewardModel`-named
    state dict: widths, depths, patch and image size, vocabulary and positions from the tensor shapes;
    attention heads from ``med_config`` (text) or 64-wide heads (BLIP's ViT-B/16 and ViT-L/16 both use
    64: 12 and 16 heads). For ``ImageReward.pt`` this gives ViT-L/16 at 224 px and the MED BERT."""
    def count(prefix: str) -> int:
        found = {int(m.group(1)) for k in state for m in [re.match(re.escape(prefix) + r"(\d+)\.", k)] if m}
        return max(found) + 1 if found else 0

    try:
        width = state["vision_model.embeddings.class_embedding"].shape[-1]
        patch = state["vision_model.embeddings.patch_embedding.weight"].shape[-1]
        positions = state["vision_model.embeddings.position_embedding"].shape[1] - 1
        vision = {
            "hidden_size": width,
            "num_hidden_layers": count("vision_model.encoder.layers."),
            "intermediate_size": state["vision_model.encoder.layers.0.mlp.fc1.weight"].shape[0],
            "num_attention_heads": max(1, width // 64),
            "patch_size": patch,
            "image_size": int(round(positions**0.5)) * patch,
        }
        words = state["text_encoder.embeddings.word_embeddings.weight"]
        med = {
            "vocab_size": words.shape[0],
            "hidden_size": words.shape[1],
            "max_position_embeddings": state["text_encoder.embeddings.position_embeddings.weight"].shape[0],
            "num_hidden_layers": count("text_encoder.encoder.layer."),
            "intermediate_size": state["text_encoder.encoder.layer.0.intermediate.dense.weight"].shape[0],
            "num_attention_heads": max(1, words.shape[1] // 64),
        }
    except KeyError as exc:
        raise RuntimeError(f"not an ImageReward checkpoint: no {exc.args[0]!r} after renaming") from exc
    for key in ("num_attention_heads", "hidden_act", "layer_norm_eps", "pad_token_id"):
        if med_config and key in med_config:
            med[key] = med_config[key]
    return imagereward_configs(med, vision)


def load_imagereward_model(
    checkpoint: str, med_config: str | None = None, weights_only: bool = True
) -> ImageRewardModel:
    """Build :class:`ImageRewardModel` for an original ``ImageReward.pt`` and load it through the key
    mapping (sizes from :func:`infer_configs`, heads from ``med_config.json`` when given).

    Every parameter must be filled (missing ones raise); checkpoint keys that are neither mapped nor
    known to be unused are reported in a warning.
    """
    med = None
    if med_config is not None:
        with open(med_config) as fh:
            med = json.load(fh)
    state = torch.load(checkpoint, map_location="cpu", weights_only=weights_only)
    if not isinstance(state, Mapping):
        raise ValueError(f"{checkpoint}: expected a state dict, got {type(state).__name__}")
    renamed, unknown = convert_original_state_dict(state)
    configs = infer_configs(renamed, med)
    with torch.device("meta"):  # no random init of ~450M parameters that the checkpoint overwrites
        model = ImageRewardModel(*configs)
    missing, unexpected = model.load_state_dict(renamed, strict=False, assign=True)
    embeddings = model.text_encoder.embeddings  # the one buffer, non-persistent: rebuild it
    embeddings.position_ids = torch.arange(embeddings.position_ids.shape[-1]).expand((1, -1))
    missing = [k for k in missing if not k.endswith("position_ids")]
    missing += [n for n, p in model.named_parameters() if p.is_meta and n not in missing]
    if missing or unexpected:
        raise RuntimeError(
            f"{checkpoint} does not match ImageReward (BLIP ViT + MED BERT + MLP): missing {missing[:10]}, "
            f"unexpected {unexpected[:10]}"
        )
    if unknown:
        warnings.warn(f"{checkpoint}: ignored {len(unknown)} unknown keys, e.g. {unknown[:5]}", stacklevel=2)
    return model


def init_blip_tokenizer(tokenizer):
    """BLIP's ``init_tokenizer``: add ``[DEC]`` as bos and ``[ENC]`` as an extra special token (ids
    30522 and 30523 for bert-base-uncased, hence the MED vocabulary of 30524)."""
    if tokenizer.convert_tokens_to_ids("[DEC]") in (None, tokenizer.unk_token_id):
        tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    if tokenizer.convert_tokens_to_ids("[ENC]") in (None, tokenizer.unk_token_id):
        tokenizer.add_tokens(["[ENC]"], special_tokens=True)
    return tokenizer


def blip_preprocess(image: Image.Image, size: int = 224) -> torch.Tensor:
    """ImageReward's ``_transform(224)`` on one PIL image -> float32 ``[3, size, size]``: resize the
    shortest side to ``size`` (bicubic), centre crop, RGB, to [0, 1], OpenAI CLIP mean/std."""
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode

    image = TF.resize(image, size, interpolation=InterpolationMode.BICUBIC)
    image = TF.center_crop(image, size)
    image = image if image.mode == "RGB" else image.convert("RGB")
    return TF.normalize(TF.to_tensor(image), list(OPENAI_MEAN), list(OPENAI_STD))


# --------------------------------------------------------------------------------------------
# reward
# --------------------------------------------------------------------------------------------


@register_reward("imagereward")
class ImageReward(Reward):
    """ImageReward score ``(r - 0.16717) / 1.03334`` per (image, prompt); see the module docstring."""

    needs_prompts = True

    def __init__(
        self,
        checkpoint: str | os.PathLike | None = None,
        model: ImageRewardModel | None = None,
        tokenizer: str | os.PathLike | Any = DEFAULT_TOKENIZER,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 32,
        max_length: int = 35,
        weights_only: bool = True,
    ):
        """Args:
        checkpoint: ``ImageReward.pt`` (or a directory holding it and ``med_config.json``), or a hub
            repo id; default ``THUDM/ImageReward`` from the Hugging Face cache, downloaded there
            unless ``HF_HUB_OFFLINE=1``.
        model: a built :class:`ImageRewardModel` (then no checkpoint is read; tests pass a tiny one).
        tokenizer: hub id, local directory or built BERT tokenizer (default ``bert-base-uncased``);
            BLIP's ``[DEC]``/``[ENC]`` tokens are added if absent.
        device: default CUDA if available, else CPU (a built model stays put unless given).
        dtype: backbone dtype (default float32 when loading); the head runs in float32.
        batch_size: (image, prompt) pairs per forward.
        max_length: token padding/truncation length (ImageReward: 35).
        weights_only: ``torch.load(weights_only=...)``; only disable for a checkpoint you trust.
        """
        super().__init__()
        from transformers import BertTokenizer  # heavy: imported only when used

        dtype = resolve_dtype(dtype)
        files = resolve_imagereward_files(checkpoint) if model is None else None  # cheap: fail early
        if isinstance(tokenizer, (str, os.PathLike)):
            source = os.fspath(tokenizer)
            _check_available(
                source, [[["tokenizer.json"], ["vocab.txt"]]], "ImageReward tokenizer (bert-base-uncased)", "tokenizer"
            )
            try:
                tokenizer = BertTokenizer.from_pretrained(source)
            except OSError as exc:
                raise MissingWeightsError(
                    f"could not load the ImageReward tokenizer {source!r}: {exc}. It needs vocab.txt or "
                    "tokenizer.json of bert-base-uncased; pass tokenizer=<local dir>."
                ) from exc
        if model is None:
            model = load_imagereward_model(*files, weights_only=weights_only)
            device = resolve_device(device)
            dtype = dtype or torch.float32
        if not isinstance(model, ImageRewardModel):
            raise TypeError(f"model must be an ImageRewardModel, got {type(model).__name__}")
        if device is not None or dtype is not None:
            model = model.to(device=None if device is None else torch.device(device), dtype=dtype)
        model.mlp.float()  # the original scores in float32 (``.float()`` before the head)
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = init_blip_tokenizer(tokenizer)
        vocab = model.text_encoder.config.vocab_size
        if len(self.tokenizer) > vocab:
            raise ValueError(f"tokenizer has {len(self.tokenizer)} tokens but the text encoder only {vocab}")
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)

    @property
    def device(self) -> torch.device:
        return next(self.model.vision_model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.vision_model.parameters()).dtype

    def preprocess(self, images: list[Image.Image]) -> torch.Tensor:
        size = self.model.image_size
        return torch.stack([blip_preprocess(img, size) for img in images])

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.tokenizer(
            prompts, padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        return tokens["input_ids"], tokens["attention_mask"]

    @torch.inference_mode()
    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        prompts = batch.valid_prompts()
        slot = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
        ids, mask = self.tokenize(list(slot))  # once per unique prompt
        where = torch.tensor([slot[p] for p in prompts])
        images = batch.pil(rgb=False)  # converted to RGB after the resize and crop, as the original
        out = []
        for start in range(0, len(images), self.batch_size):
            stop = min(start + self.batch_size, len(images))
            pixels = self.preprocess(images[start:stop]).to(self.device, self.dtype)
            rows = where[start:stop]
            out.append(
                self.model(pixels, ids[rows].to(self.device), mask[rows].to(self.device)).float().cpu()
            )
        return {self.name: torch.cat(out)}
