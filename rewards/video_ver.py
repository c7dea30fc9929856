"""``video_ver``: Video-VER's Visual Evidence Reward: is the reasoning grounded in the video's frames?

The paper (Video-VER): chain-of-thought in video reasoning drifts from the visual evidence ("visual thinking
drift": verbose monologues with hallucinated visual details); the Visual Evidence Reward explicitly rewards
reasoning traces that are verifiably grounded in visual evidence.

mmrl's rule (the abstract gives no formula; no parity claim). ``num_frames`` frames are read from the sample's
video with the project's reader (:func:`mmrl.data.video.read_video`, qwen-vl-utils' frame rule: evenly spaced,
an even count, at most the video's frames, at least 2) or taken from its ``frames``; a FROZEN Qwen-VL judge sees them as
images, in order (each after a ``Frame k (t s):`` label with ``label_frames``), with the reasoning, and, when the
sample has them, its reference visual evidence (``visual_evidence``: a string or a list)::

    score = P(yes | frames, template(reasoning, evidence))     "is every visual detail it states visible?"
    score = [P(yes) >= threshold]                              with threshold set

Extra keys: ``p_yes`` (the unthresholded probability) and ``num_frames`` (the frames shown). The reasoning is the
``<think>`` block, or the whole response when it has no think tag (``part``). A sample without a video/frames
(or whose video does not decode) is NaN with the reason; an empty or malformed reasoning is a counted 0.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import torch

from ._base import register_reward
from ._judge import Ask, JudgedReward, annotation_list, bullets, check_part, check_template, fill, response_part
from .vlm_judge import DEFAULT_JUDGE, NO_WORDS, YES_WORDS

__all__ = ["VideoVER", "DEFAULT_VER_TEMPLATE"]

DEFAULT_VER_TEMPLATE = (
    "The images above are {num_frames} frames sampled in order from a video (at {frame_times} seconds).\n"
    "Question: {question}\n"
    "Reference visual evidence:\n{evidence}\n"
    "Model's reasoning:\n{reasoning}\n\n"
    "Is the reasoning grounded in what these frames show: is every visual detail it states (objects, actions, "
    "events, their order) actually visible in them, with nothing invented? Answer yes or no."
)
VER_PLACEHOLDERS = ("reasoning", "response", "question", "evidence", "num_frames", "frame_times")


@register_reward("video_ver")
class VideoVER(JudgedReward):
    """Video-VER's visual-evidence reward on a frozen Qwen-VL judge; see the module docstring."""

    extra_keys = ("p_yes", "num_frames")

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module = DEFAULT_JUDGE,
        processor: Any = None,
        template: str = DEFAULT_VER_TEMPLATE,
        num_frames: int = 8,
        frame_max_pixels: int | None = None,
        label_frames: bool = True,
        evidence_key: str = "visual_evidence",
        part: str = "think_or_all",
        threshold: float | None = None,
        system_prompt: str | None = None,
        yes_words: Sequence[str] = YES_WORDS,
        no_words: Sequence[str] = NO_WORDS,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 4,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        media_root: str | os.PathLike | None = None,
    ):
        """Args:
        model, processor, system_prompt, yes_words, no_words, device, dtype, min_pixels, max_pixels: the judge, as
            :class:`~mmrl.rewards.vlm_judge.VLMJudge` (``min_pixels``/``max_pixels``: its per-frame image budget).
        template: the yes/no question after the frames. Placeholders ``{reasoning}`` (the judged part),
            ``{response}`` (the whole response), ``{question}``, ``{evidence}`` (the sample's reference evidence,
            ``- `` lines, or ``(none)``), ``{num_frames}``, ``{frame_times}`` (comma-separated seconds, or
            ``unknown`` for given frames), ``{meta[field]}``.
        num_frames: frames shown to the judge (read from a video: rounded down to even, at least 2).
        frame_max_pixels: pixel budget when decoding (None: as stored; the judge's processor resizes anyway).
        label_frames: put ``Frame k (t s):`` before each frame.
        evidence_key: the metadata field with reference visual evidence (optional).
        part: the judged part of the response. threshold: None (soft) or a probability.
        batch_size: judge queries (samples) per forward. media_root: folder for relative video/frame paths.
        """
        super().__init__(model=model, processor=processor, device=device, dtype=dtype, batch_size=batch_size,
                         system_prompt=system_prompt, min_pixels=min_pixels, max_pixels=max_pixels,
                         yes_words=yes_words, no_words=no_words, media_root=media_root)
        self.template = check_template(template, VER_PLACEHOLDERS, "template")
        if int(num_frames) < 1:
            raise ValueError(f"num_frames must be >= 1, got {num_frames}")
        self.num_frames = int(num_frames)
        self.frame_max_pixels = None if frame_max_pixels is None else int(frame_max_pixels)
        self.label_frames = bool(label_frames)
        self.evidence_key = str(evidence_key)
        self.part = check_part(part)
        if threshold is not None and not 0.0 < float(threshold) < 1.0:
            raise ValueError(f"threshold must be None or in (0, 1), got {threshold}")
        self.threshold = None if threshold is None else float(threshold)

    def _plan(self, text: str, prompt: str | None, meta: Mapping, record: list):
        frames, times = self.media.frames(meta, self.name, num_frames=self.num_frames, max_pixels=self.frame_max_pixels)
        evidence = annotation_list(meta, self.evidence_key, self.name, required=False)
        reasoning = response_part(text, self.part)
        content: list = []
        for k, frame in enumerate(frames):
            if self.label_frames:
                content.append(f"Frame {k + 1}" + (f" ({times[k]:g} s):" if times is not None else ":"))
            content.append(frame)
        content.append(fill(self.template, meta, reasoning=reasoning, response=text.strip(), question=prompt or "",
                            evidence=bullets(evidence), num_frames=len(frames),
                            frame_times="unknown" if times is None else ", ".join(f"{t:g}" for t in times)))
        (p_yes,) = yield [Ask(content, label="visual evidence")]
        score = p_yes if self.threshold is None else (1.0 if p_yes >= self.threshold else 0.0)
        return {self.name: score, "p_yes": p_yes, "num_frames": float(len(frames))}
