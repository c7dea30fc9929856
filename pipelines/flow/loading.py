"""Loading a diffusers pipeline from a hub id, a local directory or the tiny random test models."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

import torch


class ModelLoadError(RuntimeError):
    """A model that could not be loaded, with the path and what is missing."""


def resolve_pretrained(pretrained: str, build_tiny: Callable[[str], Path] | None = None) -> str:
    """``tiny:<kind>`` -> the cached tiny build, made on first use by ``build_tiny`` (default the flow pipelines'
    :func:`mmrl.pipelines.flow.tiny.ensure_tiny`: ``sd3`` / ``flux``); ``shapeworld:<name>`` -> the shipped ShapeWorld
    base (:func:`mmrl.data.shapeworld.base_model_path`); anything else unchanged. An unknown name is a
    :class:`ModelLoadError`."""
    try:
        if pretrained.startswith("shapeworld:"):
            from mmrl.data.shapeworld import base_model_path

            return str(base_model_path(pretrained.split(":", 1)[1]))
        if pretrained.startswith("tiny:"):
            if build_tiny is None:
                from mmrl.pipelines.flow.tiny import ensure_tiny as build_tiny
            return str(build_tiny(pretrained.split(":", 1)[1]))
    except (ValueError, FileNotFoundError) as exc:  # an unknown kind or base, a base not shipped with this install
        raise ModelLoadError(f"model.pretrained={pretrained!r}: {exc}") from None
    return pretrained


def load_pipeline(pipeline_cls, pretrained: str, *, dtype: torch.dtype, revision: str | None = None):
    """``pipeline_cls.from_pretrained`` with one clear error naming the path when it cannot be loaded."""
    source = resolve_pretrained(pretrained)
    local = Path(source)
    looks_local = local.exists() or source.startswith((".", "/", "~")) or os.sep in source and not _is_hub_id(source)
    if looks_local and not (local / "model_index.json").is_file():
        raise ModelLoadError(
            f"model.pretrained={pretrained!r}: {local} is not a diffusers pipeline directory "
            f"(no model_index.json there). Use a folder written by save_pretrained, or a hub id."
        )
    if looks_local:
        missing = _missing_components(local)
        if missing:
            raise ModelLoadError(
                f"model.pretrained={pretrained!r}: {local}/model_index.json names components whose folders are "
                f"missing: {', '.join(missing)} (a partly copied pipeline; diffusers would build a default tokenizer "
                f"in place of a missing one and train on the wrong token ids)")
    try:
        pipe = pipeline_cls.from_pretrained(source, revision=revision, dtype=dtype)  # dtype= since diffusers 0.40
        pipe.set_progress_bar_config(disable=True)
    except Exception as exc:  # diffusers / hub raise many types; one message that names the source
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = (" HF_HUB_OFFLINE=1 is set: download the weights first or point model.pretrained at a local folder."
                if offline else "")
        raise ModelLoadError(f"could not load {pipeline_cls.__name__} from {pretrained!r}: {exc}.{hint}") from exc
    # diffusers only warns when a component is of another family's class (an SD3 folder loaded as FLUX), and the
    # first prompt then fails deep inside the pipeline
    expected = pipeline_cls._get_signature_types().get("transformer") if hasattr(
        pipeline_cls, "_get_signature_types") else None
    transformer = getattr(pipe, "transformer", None)
    if expected and transformer is not None and not isinstance(transformer, expected):
        raise ModelLoadError(
            f"model.pretrained={pretrained!r} holds a {type(transformer).__name__}, not the "
            f"{' / '.join(t.__name__ for t in expected)} of {pipeline_cls.__name__}: set model.family to the "
            f"checkpoint's family")
    return pipe


def transformers_load_kwargs() -> dict:
    """Extra ``from_pretrained`` kwargs for a transformers model: offline (``HF_HUB_OFFLINE=1``) and unless the user
    set ``USE_HUB_KERNELS`` (transformers' own switch), ``use_kernels=False``. With the ``kernels`` package installed
    (a transformers 5.2x requirement) transformers swaps layers for kernels fetched from the Hub by default; offline a
    kernel missing from the local cache fails at the model's first train / eval switch on a GPU ("Version 4 of
    'kernels-community/liger-kernels' is not available in the local cache and Hugging Face Hub is in offline mode",
    seen on an H200 with a Qwen2.5-VL), so offline runs use the model's own layers."""
    if os.environ.get("HF_HUB_OFFLINE") == "1" and "USE_HUB_KERNELS" not in os.environ:
        return {"use_kernels": False}
    return {}


def _missing_components(folder: Path) -> list[str]:
    """The components ``model_index.json`` names (``[library, class]``, not null) that have no folder of their own."""
    import json

    try:
        index = json.loads((folder / "model_index.json").read_text())
    except (OSError, ValueError):  # unreadable: diffusers' own error names it
        return []
    if not isinstance(index, dict):
        return []
    return sorted(name for name, entry in index.items()
                  if not name.startswith("_") and isinstance(entry, list) and len(entry) == 2
                  and all(isinstance(part, str) for part in entry) and not (folder / name).is_dir())


def _is_hub_id(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not Path(source).exists()


def tokenizer_limit(tokenizer) -> int | None:
    """A tokenizer's ``model_max_length`` when it states one (transformers puts a huge sentinel where none is set),
    else None: for a T5 text encoder, the prompt length the pipeline was made for (an ``mmrl pretrain`` base: its
    ``text.max_length``)."""
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if isinstance(limit, int) and 0 < limit < 1_000_000 else None


class PromptTruncation:
    """What a family's text encoders cut off, said once per prompt instead of diffusers' warning on every encode
    (each listing the cut tokens: a 170-word prompt filled a tiny run's log with 29 KB of ``<|endoftext|>``).

    ``encoders()``: ``(name, tokenizer, limit)`` for each text encoder the pipeline truncates (CLIP at its 77
    tokens, T5 at ``sampling.max_sequence_length``), read at each call; :meth:`encode` runs the pipeline's
    ``encode_prompt`` with diffusers' logging at errors only, after logging one warning naming the prompts new to
    this run that an encoder cuts."""

    def __init__(self, encoders: Callable[[], list[tuple[str, object, int | None]]]):
        self.encoders = encoders
        self.seen: set[str] = set()

    def encode(self, prompts: list[str], encode_prompt: Callable):
        from diffusers.utils import logging as diffusers_logging
        from transformers.utils import logging as transformers_logging

        levels = [(lib, lib.get_verbosity()) for lib in (diffusers_logging, transformers_logging)]
        for lib, _ in levels:  # both warn of a long prompt ("Token indices sequence length is longer ...")
            lib.set_verbosity_error()
        try:
            self._notice([p for p in dict.fromkeys(prompts) if p not in self.seen])
            return encode_prompt()
        finally:
            for lib, level in levels:
                lib.set_verbosity(level)

    def _notice(self, new: list[str]) -> None:
        if not new:
            return
        self.seen.update(new)
        cut = []
        for name, tokenizer, limit in self.encoders():
            if tokenizer is None or not limit:
                continue
            lengths = [len(ids) for ids in tokenizer(new, add_special_tokens=True)["input_ids"]]
            over = [(p, n) for p, n in zip(new, lengths) if n > limit]
            if over:
                cut.append(f"{len(over)} longer than {name}'s {limit} tokens (e.g. {over[0][1]} tokens: "
                           f"{over[0][0][:60]!r}...)")
        if cut:
            logging.getLogger("mmrl.pipelines.flow").warning(
                "prompts truncated by the text encoders, the part past the limit is not seen by the model: %s",
                "; ".join(cut))
