"""Mixed-R1's open-ended reward BMAS: bidirectional max-average similarity of token embeddings.

Mixed-R1 (Xu et al., "Mixed-R1: Unified Reward Perspective For Reasoning Capability in Multimodal Large Language
Models", arXiv:2505.24164) scores long-form answers (captions) with "a new open-ended reward named Bidirectional
Max-Average Similarity (BMAS) by leveraging tokenizer embedding matching between the generated response and the
ground truth". mmrl's rule (the abstract names the idea, not the formula; no parity claimed)::

    x_1..x_n = embeddings of the answer's tokens, y_1..y_m = those of the reference's (L2-normalised)
    S_ij      = cos(x_i, y_j)
    precision = (1/n) sum_i max_j S_ij        every answer token's best match in the reference
    recall    = (1/m) sum_j max_i S_ij        every reference token's best match in the answer
    bmas      = (precision + recall) / 2      in [-1, 1]; 1 when the two token sequences have the same set of
                                              tokens (repetition is not counted: 'a a b' against 'a b' is 1)

Embeddings (``embedding``): ``"input"`` (default) the text model's input token-embedding table, the "tokenizer
embedding" of the abstract (no forward pass); ``"hidden"`` its last hidden states (contextual, BERTScore-like).
The model is any Hugging Face text model with its tokenizer (``model=``: hub id, local directory, or a built model
with ``tokenizer=``); default ``Qwen/Qwen2.5-0.5B-Instruct`` (mmrl's choice: Qwen2.5's tokenizer, the one of the
Qwen2.5-VL policies). Missing weights offline raise :class:`~mmrl.rewards.MissingWeightsError` naming the files.

The answer is the ``<answer>`` block (``require_tags=False``: a completion without answer tags is read whole); an
unreadable one scores 0 and is counted. The reference is metadata ``field`` (default ``solution``; wrapped
``<answer>`` tags are removed): one text, or a list of texts (the best-matching one counts); a sample without it is
NaN. Texts are truncated to ``max_tokens`` tokens. Registered as ``bmas``; extra keys ``precision``, ``recall``.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ._base import load_pretrained, register_reward, resolve_device, resolve_dtype
from ._text import TextReward, Unjudgeable, Unparseable, answer_or_text, extract_answer, require

__all__ = ["BMAS", "DEFAULT_BMAS_MODEL", "bmas_similarity"]

DEFAULT_BMAS_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
EMBEDDINGS = ("input", "hidden")

_MODEL_FILES = [
    [["config.json"]],
    [["model.safetensors"], ["model.safetensors.index.json"], ["pytorch_model.bin"], ["pytorch_model.bin.index.json"]],
]
_TOKENIZER_FILES = [
    [["tokenizer.json"], ["vocab.json", "merges.txt"], ["vocab.txt"], ["tokenizer.model"]],
]


def bmas_similarity(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """BMAS of two token-embedding sequences ``x [n, d]`` and ``y [m, d]`` (see the module docstring):
    ``{"bmas", "precision", "recall"}``. Raises ``ValueError`` for an empty sequence."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"need two [n, d] and [m, d] embedding sequences, got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[0] == 0 or y.shape[0] == 0:
        raise ValueError("cannot compare an empty token sequence")
    x = torch.nn.functional.normalize(x.double(), dim=-1)
    y = torch.nn.functional.normalize(y.double(), dim=-1)
    sim = x @ y.T
    precision = float(sim.max(dim=1).values.mean())
    recall = float(sim.max(dim=0).values.mean())
    return {"bmas": (precision + recall) / 2, "precision": precision, "recall": recall}


def _references(meta: Mapping, field: str, reward: str) -> list[str]:
    value = require(meta, field, reward)
    values = value if isinstance(value, (list, tuple)) else [value]
    refs = []
    for v in values:
        if not isinstance(v, str):
            raise Unjudgeable(f"metadata {field!r} must be a text or a list of texts, got {type(v).__name__}")
        inner = extract_answer(v)
        text = (inner if inner is not None else v).strip()
        if text:
            refs.append(text)
    if not refs:
        raise Unjudgeable(f"metadata {field!r} holds no non-empty reference text")
    return refs


@register_reward("bmas")
class BMAS(TextReward):
    """Mixed-R1's BMAS open-ended reward on a text model's token embeddings; see the module docstring."""

    extra_keys = ("precision", "recall")

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module = DEFAULT_BMAS_MODEL,
        tokenizer: str | os.PathLike | Any | None = None,
        embedding: str = "input",
        field: str = "solution",
        require_tags: bool = True,
        max_tokens: int = 512,
        batch_size: int = 16,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
    ):
        """Args:
        model: hub id or local directory of a transformers text model, or a built model (tests pass a tiny random
            one; it then needs ``tokenizer``).
        tokenizer: hub id, local directory or built tokenizer; default: the same source as ``model``.
        embedding: ``"input"`` token-embedding table (default) or ``"hidden"`` last hidden states.
        field: the metadata key of the reference answer.
        require_tags: read the answer from the ``<answer>`` block only (False: a completion without tags whole).
        max_tokens: truncation length of each text, in tokens.
        batch_size: texts per forward (``embedding="hidden"``).
        device: default CUDA if available (a built model stays put unless given).
        dtype: model dtype when loading (default float32); similarities are computed in float64.
        """
        super().__init__()
        if embedding not in EMBEDDINGS:
            raise ValueError(f"embedding must be one of {EMBEDDINGS}, got {embedding!r}")
        if int(max_tokens) < 1 or int(batch_size) < 1:
            raise ValueError(f"max_tokens and batch_size must be >= 1, got {max_tokens} and {batch_size}")
        if not field:
            raise ValueError("field must name the metadata key of the reference answer")
        dtype = resolve_dtype(dtype)
        if tokenizer is None:
            if not isinstance(model, (str, os.PathLike)):
                raise ValueError("BMAS: a built model needs its tokenizer (tokenizer=...)")
            tokenizer = model
        if isinstance(model, (str, os.PathLike)):
            from transformers import AutoModel  # heavy: imported only when used

            model = load_pretrained(AutoModel, model, _MODEL_FILES, "BMAS text model", "model",
                                    dtype=dtype or torch.float32)
            device = resolve_device(device)
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            tokenizer = load_pretrained(AutoTokenizer, tokenizer, _TOKENIZER_FILES, "BMAS tokenizer", "tokenizer",
                                        needs="tokenizer files (tokenizer.json, or vocab.json and merges.txt)")
        if not hasattr(model, "get_input_embeddings"):
            raise TypeError(f"model must be a transformers model; {type(model).__name__} has no get_input_embeddings")
        if device is not None or dtype is not None:
            model = model.to(device=None if device is None else torch.device(device), dtype=dtype)
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.embedding = embedding
        self.field = str(field)
        self.require_tags = bool(require_tags)
        self.max_tokens = int(max_tokens)
        self.batch_size = int(batch_size)
        self._cache: dict[str, torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def token_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, truncation=True,
                                   max_length=self.max_tokens)["input_ids"])

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> list[torch.Tensor]:
        """Each text's token embeddings ``[n_tokens, d]`` (float32, CPU)."""
        ids = [self.token_ids(t) for t in texts]
        if self.embedding == "input":
            table = self.model.get_input_embeddings()
            return [table(torch.tensor(i, dtype=torch.long, device=self.device)).float().cpu() for i in ids]
        out: list[torch.Tensor] = []
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for start in range(0, len(ids), self.batch_size):
            chunk = ids[start:start + self.batch_size]
            width = max(len(i) for i in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            attention = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):
                input_ids[row, :len(i)] = torch.tensor(i, dtype=torch.long)
                attention[row, :len(i)] = 1
            hidden = self.model(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                                output_hidden_states=True).hidden_states[-1].float().cpu()
            out += [hidden[row, :len(i)] for row, i in enumerate(chunk)]
        return out

    def _vectors(self, text: str) -> torch.Tensor:
        if text not in self._cache:
            self._cache[text] = self.embed([text])[0]
        return self._cache[text]

    def __call__(self, completions, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        # embed every readable answer and reference of the batch at once, then score sample by sample
        texts: dict[str, None] = {}
        if isinstance(completions, (list, tuple)):
            metas = metadata if isinstance(metadata, (list, tuple)) else [None] * len(completions)
            for text, meta in zip(completions, metas):
                if not isinstance(text, str):  # scored (and reported) per sample below
                    continue
                try:
                    texts[answer_or_text(text, self.require_tags)] = None
                except Unparseable:
                    pass
                try:
                    texts.update(dict.fromkeys(_references(meta, self.field, self.name)))
                except (Unjudgeable, AttributeError, TypeError):
                    pass
        texts = {t: None for t in texts if t and self.token_ids(t)}
        self._cache = dict(zip(texts, self.embed(list(texts)))) if texts else {}
        try:
            return super().__call__(completions, prompts, metadata)
        finally:
            self._cache = {}

    def _score_one(self, text, prompt, meta):
        refs = _references(meta, self.field, self.name)
        answer = answer_or_text(text, self.require_tags)
        if not self.token_ids(answer):
            raise Unparseable("the answer has no tokens")
        x = self._vectors(answer)
        best = None
        for ref in refs:
            if not self.token_ids(ref):
                continue
            s = bmas_similarity(x, self._vectors(ref))
            if best is None or s["bmas"] > best["bmas"]:
                best = s
        if best is None:
            raise Unjudgeable(f"metadata {self.field!r} has no reference text with tokens")
        return {self.name: best["bmas"], "precision": best["precision"], "recall": best["recall"]}
