"""OCR reward for text rendering (Flow-GRPO's ``flow_grpo/ocr.py``) on rapidocr.

Engine: ``rapidocr`` with onnxruntime, whose wheel ships the PP-OCR detection and recognition ONNX
weights (rapidocr 3.x: PP-OCRv6 small, multilingual incl. English), so nothing is downloaded. It runs
on the CPU, one image at a time (as Flow-GRPO's PaddleOCR does); the engine is built once per reward.
Engine settings follow the PaddleOCR 2.x defaults Flow-GRPO ran with: no text-direction classifier
(``cls=False``), texts below confidence 0.5 dropped (``drop_score``), and the detector input shrunk
only when its longer side exceeds 960 px (``det_limit_type="max"``, ``det_limit_side_len=960``), and
PaddleOCR's box post-processing (``det_db_box_thresh=0.6``, ``det_db_unclip_ratio=1.5``, no dilation) in place of
rapidocr's (0.5, 1.6, dilation).

Target: the quoted part of the prompt (:func:`extract_target`): what follows the first ``"`` up to the next
one, or to the end when there is no next one (Flow-GRPO's ``prompt.split('"')[1]``), else the first curly ``“...”``, else the first ``'...'`` whose quotes are
not apostrophes (``'`` not preceded by a letter/digit opening, not followed by one closing). A prompt
without a non-empty quoted target scores NaN with the reason in ``last_info``.

Score, as in Flow-GRPO::

    rec    = "".join(texts the engine kept)    (rapidocr's text_score 0.5 = PaddleOCR's drop_score 0.5;
                                                Flow-GRPO then keeps every text with confidence > 0)
    rec    = rec.replace(" ", "").lower();  target = target.replace(" ", "").lower()
    dist   = 0 if target in rec else min(Levenshtein(rec, target), len(target))
    score  = 1 - dist / len(target)            (1 = the text is there, 0 = nothing like it)

Differences from Flow-GRPO, on purpose: the engine (rapidocr's PP-OCR ONNX models instead of
PaddleOCR 2.9's English PP-OCR), which gets the PIL image so it sees the right channel order
(Flow-GRPO hands PaddleOCR an RGB array where it expects BGR); and a failure inside the engine for
one image gives NaN with a reason (the mmrl contract) where Flow-GRPO gives 0.
The recognised text of each sample is kept in ``last_info["recognized"]``.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import torch

from ._base import ImageBatch, Reward, register_reward

__all__ = ["OCRReward", "extract_target", "ocr_score"]

_CURLY = re.compile(r"\u201c([^\u201d]*)\u201d")
_SINGLE = re.compile(r"(?<![A-Za-z0-9])['\u2018](.+?)['\u2019](?![A-Za-z0-9])")


def extract_target(prompt: str) -> str | None:
    """The text a prompt asks to render: its first quoted span (see the module docstring), or None."""
    if '"' in prompt:  # Flow-GRPO's prompt.split('"')[1]: an unclosed quote runs to the end of the prompt
        return prompt.split('"')[1]
    for pattern in (_CURLY, _SINGLE):
        m = pattern.search(prompt)
        if m:
            return m.group(1)
    return None


def ocr_score(recognized: str, target: str) -> float:
    """Flow-GRPO's OCR score of recognised text against a non-empty target (see the module docstring)."""
    from rapidfuzz.distance import Levenshtein

    rec = recognized.replace(" ", "").lower()
    tgt = target.replace(" ", "").lower()
    if not tgt:
        raise ValueError("the target text is empty")
    dist = 0 if tgt in rec else min(Levenshtein.distance(rec, tgt), len(tgt))
    return 1.0 - dist / len(tgt)


@register_reward("ocr")
class OCRReward(Reward):
    """Text-rendering accuracy of each image against the quoted text of its prompt (rapidocr)."""

    needs_prompts = True

    def __init__(
        self,
        engine: Callable[[Any], Any] | None = None,
        use_cls: bool = False,
        text_score: float = 0.5,
        params: dict | None = None,
    ):
        """Args:
        engine: a built OCR callable ``engine(pil_image) -> result`` with ``result.txts`` and
            ``result.scores`` (rapidocr's output; ``None`` when nothing is found). Default: a
            ``rapidocr.RapidOCR`` built once here from the weights in its wheel.
        use_cls: run the text-direction classifier (Flow-GRPO calls PaddleOCR with ``cls=False``).
        text_score: drop recognised texts below this confidence (rapidocr's ``Global.text_score``;
            0.5 matches PaddleOCR's default ``drop_score``).
        params: extra rapidocr parameters, e.g. ``{"EngineConfig.onnxruntime.intra_op_num_threads": 4}``.
        """
        super().__init__()
        self.use_cls = bool(use_cls)
        self.text_score = float(text_score)
        if engine is None:
            try:
                from rapidocr import RapidOCR
            except ImportError as exc:
                raise ImportError(
                    "the OCR reward needs rapidocr with onnxruntime: pip install rapidocr onnxruntime"
                ) from exc
            config = {
                "Global.log_level": "error",
                "Global.use_cls": self.use_cls,
                "Global.text_score": self.text_score,
                # PaddleOCR 2.x's detector sizing (what Flow-GRPO ran): shrink only when the longer side
                # exceeds 960. rapidocr's own default ("min", 736) upscales every 512 px image, ~3x slower.
                "Det.limit_type": "max",
                "Det.limit_side_len": 960,
                # and its DB post-processing (tools/infer/utility.py: det_db_box_thresh 0.6,
                # det_db_unclip_ratio 1.5, use_dilation False); rapidocr's own are 0.5, 1.6 and True
                "Det.box_thresh": 0.6,
                "Det.unclip_ratio": 1.5,
                "Det.use_dilation": False,
                **(params or {}),
            }
            engine = RapidOCR(params=config)
        elif params:
            raise ValueError("params configure the default rapidocr engine; they cannot apply to a given engine")
        self.engine = engine

    def recognize(self, image) -> str:
        """All texts the engine keeps for one PIL image, joined without separator (Flow-GRPO)."""
        result = self.engine(image)
        texts = getattr(result, "txts", None) or ()
        scores = getattr(result, "scores", None) or (1.0,) * len(texts)
        return "".join(t for t, s in zip(texts, scores) if s > 0 and s >= self.text_score)

    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        prompts = batch.valid_prompts()
        images = batch.pil()
        scores = []
        self._recognized: dict[int, str] = {}
        for sample, prompt, image in zip(batch.valid_indices, prompts, images):
            target = extract_target(prompt)
            if target is None or not target.replace(" ", ""):
                what = "an empty quoted target" if target is not None else "no quoted target text"
                reasons[sample] = f"{what} in the prompt (OCR needs the text to render in \"...\" or '...')"
                scores.append(float("nan"))
                continue
            try:
                rec = self.recognize(image)
            except Exception as exc:  # one bad image must not sink the batch
                reasons[sample] = f"OCR engine failed: {type(exc).__name__}: {exc}"
                scores.append(float("nan"))
                continue
            self._recognized[sample] = rec
            scores.append(ocr_score(rec, target))
        return {self.name: torch.tensor(scores, dtype=torch.float32)}

    def __call__(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        self._recognized = {}
        out = super().__call__(images, prompts, metadata)
        n = out[self.name].shape[0]
        self.last_info["recognized"] = [self._recognized.get(i) for i in range(n)]
        return out
