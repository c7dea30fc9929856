"""Video rewards built from image reward models (InstructVideo: Yuan et al. 2024, "InstructVideo:
Instructing Video Diffusion Models with Human Feedback", CVPR 2024, arXiv:2312.12490).

There is no video preference model, so InstructVideo scores a few frames with an image reward model
(HPSv2 there; any registered image reward here) and combines them. The rules follow its released code
(ali-vilab/VGen ``utils/reward/reward.py``, ``DiffRewardModel.reward_scorer``):

* **Segmental Video Reward (SegVR)**, segmental sparse sampling as in TSN: a video of ``T`` frames is cut
  into ``S = segments`` equal segments of ``span = T // S`` frames (the last ``T - S * span`` frames are
  never sampled, as in the original); one frame is taken per segment: a uniformly random offset in the
  segment (``sampling="tsn"``, InstructVideo's training setting, reproducible through ``seed``), its first
  frame (``"first"``, the original's ``fixed_first``), or its middle frame (``"middle"``). A video shorter
  than ``segments`` frames uses one segment per frame.
* **Temporally Attenuated Reward (TAR)**: the frame at index ``f`` is weighted
  ``exp(-lambda_tar * |f - T // 2|)`` (``lambda_tar = 1`` in the released config), so frames near the
  middle count most, and the video's reward is the **mean over segments** of ``weight * r(frame)`` --
  not a normalised weighted mean, exactly as the original (so the scale shrinks with the weights); set
  ``normalize_weights=True`` to divide by the sum of the weights instead, or ``attenuation=False`` for the
  plain mean of the sampled frames.

Input: videos as a float tensor ``[N, T, 3, H, W]`` in ``[0, 1]`` (or uint8), or a list of N such
``[T_i, 3, H, W]`` tensors (lengths and sizes may differ). The wrapped image reward is called once on all
sampled frames (``N * S`` images as a float tensor, each with its video's prompt and metadata; once per
frame size when sizes differ). A video with non-finite
pixels, or any sampled frame the image reward could not judge, is NaN with the reason. Extra keys: the
plain mean of the sampled frames' rewards (``"frame_mean"``).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from ._base import Reward, _info, build_reward, register_reward
from ._images import uint8_to_float

__all__ = ["SegmentalVideoReward", "segment_frame_indices", "attenuation_weights"]


def segment_frame_indices(num_frames: int, segments: int, sampling: str = "tsn",
                          generator: torch.Generator | None = None) -> list[int]:
    """One frame index per segment (see the module docstring)."""
    if num_frames < 1:
        raise ValueError(f"a video needs at least one frame, got {num_frames}")
    if segments < 1:
        raise ValueError(f"segments must be positive, got {segments}")
    s = min(segments, num_frames)
    span = num_frames // s
    if sampling == "tsn":
        offsets = torch.randint(span, (s,), generator=generator).tolist()
    elif sampling == "first":
        offsets = [0] * s
    elif sampling == "middle":
        offsets = [span // 2] * s
    else:
        raise ValueError(f"sampling must be 'tsn', 'first' or 'middle', got {sampling!r}")
    return [k * span + o for k, o in enumerate(offsets)]


def attenuation_weights(indices: Sequence[int], num_frames: int, lambda_tar: float = 1.0) -> torch.Tensor:
    """InstructVideo's TAR weights ``exp(-lambda_tar * |f - num_frames // 2|)``."""
    idx = torch.tensor(list(indices), dtype=torch.float64)
    return torch.exp(-abs(float(lambda_tar)) * (idx - num_frames // 2).abs()).float()


@register_reward("video_segmental")
class SegmentalVideoReward(Reward):
    """A video reward from an image reward (InstructVideo's SegVR + TAR); see the module docstring."""

    needs_prompts = False
    scores_images = False  # it scores videos [N, T, 3, H, W]; image-only uses must not pick it
    scores_texts = False

    def __init__(
        self,
        image_reward: str | Any = "pickscore",
        image_reward_kwargs: Mapping[str, Any] | None = None,
        segments: int = 4,
        sampling: str = "tsn",
        attenuation: bool = True,
        lambda_tar: float = 1.0,
        normalize_weights: bool = False,
        seed: int = 0,
    ):
        """Args:
        image_reward: a registered reward name (built with ``image_reward_kwargs``) or a built image reward.
        image_reward_kwargs: keyword arguments for building ``image_reward`` by name.
        segments: frames sampled per video (InstructVideo: 4 in its training config).
        sampling: ``"tsn"`` (random offset in each segment), ``"first"`` or ``"middle"``.
        attenuation: apply the temporally attenuated weights (TAR).
        lambda_tar: TAR's decay rate per frame (1.0 as released).
        normalize_weights: divide by the sum of the weights instead of by the number of segments.
        seed: seed of the random generator used by ``sampling="tsn"``.
        """
        super().__init__()
        if isinstance(image_reward, str):
            image_reward = build_reward(image_reward, **dict(image_reward_kwargs or {}))
        elif image_reward_kwargs:
            raise ValueError("image_reward_kwargs is only used when image_reward is a registered name")
        if not callable(image_reward):
            raise TypeError(f"image_reward must be a reward name or a reward object, got {type(image_reward).__name__}")
        if sampling not in ("tsn", "first", "middle"):
            raise ValueError(f"sampling must be 'tsn', 'first' or 'middle', got {sampling!r}")
        if int(segments) < 1:
            raise ValueError(f"segments must be positive, got {segments}")
        self.image_reward = image_reward
        self.needs_prompts = bool(getattr(image_reward, "needs_prompts", True))
        self.segments = int(segments)
        self.sampling = sampling
        self.attenuation = bool(attenuation)
        self.lambda_tar = float(lambda_tar)
        self.normalize_weights = bool(normalize_weights)
        self.generator = torch.Generator().manual_seed(int(seed))

    @staticmethod
    def _videos(videos: Any) -> list[Any]:
        if isinstance(videos, torch.Tensor):
            if videos.dim() != 5 or videos.shape[2] != 3:
                raise ValueError("videos must be a tensor [N, T, 3, H, W] (or a list of [T, 3, H, W] tensors); "
                                 f"got a tensor of shape {tuple(videos.shape)}")
            return list(videos)
        if isinstance(videos, (list, tuple)):
            return list(videos)
        raise TypeError(f"videos must be a [N, T, 3, H, W] tensor or a list of [T, 3, H, W] tensors, "
                        f"got {type(videos).__name__}")

    def __call__(self, videos, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        items = self._videos(videos)
        n = len(items)
        if prompts is not None and len(prompts) != n:
            raise ValueError(f"got {n} videos but {len(prompts)} prompts; they must match")
        if prompts is None and self.needs_prompts:
            raise ValueError("this reward needs one prompt per video, but prompts=None was passed")
        if metadata is not None and len(metadata) != n:
            raise ValueError(f"got {n} videos but {len(metadata)} metadata entries; they must match")
        reasons: dict[int, str] = {}
        frames, owners, weights = [], [], {}
        for i, v in enumerate(items):
            if not isinstance(v, torch.Tensor) or v.dim() != 4 or v.shape[1] != 3 or v.shape[0] < 1:
                shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                reasons[i] = f"not a video tensor [T, 3, H, W] (got {shape})"
                continue
            v = v.detach()
            if v.dtype == torch.uint8:
                v = uint8_to_float(v)
            elif not v.is_floating_point():
                reasons[i] = f"video dtype {v.dtype} is neither float nor uint8"
                continue
            if not torch.isfinite(v).all():
                reasons[i] = "non-finite pixel values (NaN or inf)"
                continue
            t = v.shape[0]
            idx = segment_frame_indices(t, self.segments, self.sampling, self.generator)
            w = attenuation_weights(idx, t, self.lambda_tar) if self.attenuation else torch.ones(len(idx))
            weights[i] = w
            for f in idx:
                frames.append(v[f].float().clamp(0, 1))
                owners.append(i)
        weighted = torch.full((n,), float("nan"))
        plain = torch.full((n,), float("nan"))
        if frames:
            # one call per frame size (usually one call for the whole batch); frames stay float tensors
            by_size: dict[tuple[int, int], list[int]] = {}
            for k, f in enumerate(frames):
                by_size.setdefault(tuple(f.shape[-2:]), []).append(k)
            scores = [float("nan")] * len(frames)
            inner: dict[int, str] = {}
            key = getattr(self.image_reward, "name", None)
            for ks in by_size.values():
                out = self.image_reward(
                    torch.stack([frames[k] for k in ks]),
                    None if prompts is None else [prompts[owners[k]] for k in ks],
                    None if metadata is None else [metadata[owners[k]] for k in ks],
                )
                values = out[key] if key in out else next(iter(out.values()))
                nan_samples = getattr(self.image_reward, "last_info", {}).get("nan_samples", {})
                for j, (k, v) in enumerate(zip(ks, values.tolist())):
                    scores[k] = v
                    if j in nan_samples:
                        inner[k] = nan_samples[j]
            by_video: dict[int, list[float]] = {}
            for k, (i, s) in enumerate(zip(owners, scores)):
                by_video.setdefault(i, []).append(s)
                if not math.isfinite(s):
                    reasons.setdefault(i, f"frame not judged by the image reward: {inner.get(k, 'non-finite score')}")
            for i, vals in by_video.items():
                if i in reasons:
                    continue
                r = torch.tensor(vals)
                w = weights[i]
                weighted[i] = (w * r).sum() / (w.sum() if self.normalize_weights else len(vals))
                plain[i] = r.mean()
        for i in reasons:
            weighted[i] = float("nan")
            plain[i] = float("nan")
        self.last_info = _info(n, reasons)
        return {self.name: weighted, "frame_mean": plain}
