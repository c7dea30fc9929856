"""Video frames for Qwen-VL policies: which frames to sample, and reading them with decord.

The frame rule is qwen-vl-utils' (``smart_nframes`` and its decord reader), so a model sees the frames it
was trained with:

* ``nframes`` given: ``n = round(nframes / 2) * 2`` (FRAME_FACTOR 2, Python's ``round``, so ties go to the
  even quotient: 5 -> 4, 7 -> 8); ``min_frames``/``max_frames`` do not apply;
* otherwise ``fps`` (default 2): ``n = total / video_fps * fps``, clipped to
  ``[ceil_even(min_frames), floor_even(max_frames)]``, then to ``total``, then floored to an even number;
* either way ``2 <= n <= total`` or a ``ValueError``;
* indices ``torch.linspace(first, last, n).round()`` (float32, round half to even) over the whole video or
  the ``start``/``end`` range (start frame ``ceil(start * video_fps)``, end frame
  ``min(floor(end * video_fps), total - 1)``);
* ``sample_fps = n / total * video_fps`` (``total`` = frames in the range) and
  ``second_per_grid_ts = temporal_patch_size / sample_fps`` (Qwen2.5-VL: temporal patch 2), the seconds one
  temporal grid step spans, passed to the model for its time-aligned position ids.

Frames are resized per video to a pixel budget with qwen-vl-utils' ``smart_resize`` (:func:`smart_resize`): each
side a multiple of ``factor`` (28 for Qwen2/2.5-VL, 32 for Qwen3-VL), aspect kept. With a total budget
(``total_pixels``) the per-frame bounds are qwen-vl-utils' ``fetch_video``'s (:func:`frame_pixel_budget`):
the maximum is an even share of the total per temporal patch, at most ``frame_max_pixels`` and at least
``1.05 * min_pixels``, then at most the given ``max_pixels``; ``smart_resize`` takes those bounds as they are.
Without one, the bounds are ``min_pixels`` / ``max_pixels`` themselves (:func:`budget_size`).

:func:`probe_video` is the cheap check run on every video when a data set is read for training: open with
decord, read the metadata (frame count, frame rate, size) and decode the first frame only. It costs about one
open plus one frame decode (milliseconds for a short clip, tens of milliseconds for a 30 s 360p one), not a
decode of the video; damage after the first frame is found when :func:`read_video` decodes the sampled frames
(``mmrl config validate`` without ``--quick`` does that for every video before a run).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from mmrl.data.prompts import DataError

FRAME_FACTOR = 2
DEFAULT_FPS = 2.0
IMAGE_FACTOR = 28
#: qwen-vl-utils' default total video budget is 90 % of this many tokens' pixels (``VIDEO_TOTAL_PIXELS`` =
#: 128000 x 28 x 28 x 0.9 for Qwen2.5-VL, ``MODEL_SEQ_LEN`` x 32 x 32 x 0.9 for Qwen3-VL); transformers' Qwen2-VL
#: video processor calls it ``max_video_tokens``.
VIDEO_CONTEXT_TOKENS = 128000


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class FramePlan:
    """Which frames to decode: ``indices`` into the video, and the timing the model needs."""

    indices: list[int]
    sample_fps: float
    second_per_grid_ts: float
    first: int  # first frame of the sampled range
    last: int  # last frame of the sampled range (inclusive)


def num_sampled_frames(total_frames: int, video_fps: float, *, fps: float | None = None, nframes: float | None = None,
                       min_frames: int = 4, max_frames: int = 768) -> int:
    """How many frames to sample from ``total_frames`` at ``video_fps`` (qwen-vl-utils' ``smart_nframes``)."""
    if fps is not None and nframes is not None:
        raise ValueError("give either fps or nframes, not both")
    if isinstance(total_frames, bool) or not isinstance(total_frames, int):
        raise ValueError(f"total_frames must be an int, got {total_frames!r}")
    if total_frames <= 0:
        raise ValueError(f"the video has no frames (total_frames={total_frames})")
    if total_frames < FRAME_FACTOR:  # Qwen-VL's temporal patch pairs frames
        raise ValueError(f"the video has {total_frames} frame; Qwen-VL video input needs at least {FRAME_FACTOR} "
                         f"(its temporal patch takes frames in pairs)")
    if not _is_number(video_fps) or video_fps <= 0:
        raise ValueError(f"video_fps must be a positive number, got {video_fps!r}")
    if nframes is not None:
        if not _is_number(nframes):
            raise ValueError(f"nframes must be a number, got {nframes!r}")
        n = round(nframes / FRAME_FACTOR) * FRAME_FACTOR
    else:
        fps = DEFAULT_FPS if fps is None else fps
        if not _is_number(fps) or fps <= 0:
            raise ValueError(f"fps must be a positive number, got {fps!r}")
        if not _is_number(min_frames) or not _is_number(max_frames):
            raise ValueError(f"min_frames and max_frames must be numbers, got {min_frames!r}, {max_frames!r}")
        low = math.ceil(min_frames / FRAME_FACTOR) * FRAME_FACTOR
        high = math.floor(max_frames / FRAME_FACTOR) * FRAME_FACTOR
        n = total_frames / video_fps * fps
        n = min(min(max(n, low), high), total_frames)
        n = math.floor(n / FRAME_FACTOR) * FRAME_FACTOR
    if not FRAME_FACTOR <= n <= total_frames:
        how = (f"nframes={nframes}" if nframes is not None
               else f"fps={fps}, min_frames={min_frames}, max_frames={max_frames}")
        raise ValueError(f"{n} frames from a {total_frames}-frame video ({how}): the number of sampled frames must "
                         f"be even and in [{FRAME_FACTOR}, {total_frames}]")
    return int(n)


def frame_range(total_frames: int, video_fps: float, start: float | None = None,
                end: float | None = None) -> tuple[int, int]:
    """First and last (inclusive) frame of the ``[start, end]`` seconds range, as qwen-vl-utils computes it."""
    if total_frames <= 0:
        raise ValueError(f"the video has no frames (total_frames={total_frames})")
    if total_frames < FRAME_FACTOR:  # Qwen-VL's temporal patch pairs frames
        raise ValueError(f"the video has {total_frames} frame; Qwen-VL video input needs at least {FRAME_FACTOR} "
                         f"(its temporal patch takes frames in pairs)")
    if start is None and end is None:
        return 0, total_frames - 1
    duration = total_frames / video_fps
    first = 0 if start is None else math.ceil(max(0.0, min(float(start), duration)) * video_fps)
    last = total_frames - 1
    if end is not None:
        last = min(math.floor(max(0.0, min(float(end), duration)) * video_fps), total_frames - 1)
    if first >= last:
        raise ValueError(f"empty time range start={start}, end={end}: frames {first}..{last} of a "
                         f"{duration:.3f} s video ({total_frames} frames at {video_fps} fps)")
    return first, last


def plan_frames(total_frames: int, video_fps: float, *, fps: float | None = None, nframes: float | None = None,
                min_frames: int = 4, max_frames: int = 768, start: float | None = None, end: float | None = None,
                temporal_patch_size: int = 2) -> FramePlan:
    """The frame indices plus ``sample_fps`` and ``second_per_grid_ts`` (see the module docstring)."""
    if fps is not None and nframes is not None:
        raise ValueError("give either fps or nframes, not both")
    if not _is_number(video_fps) or video_fps <= 0:
        raise ValueError(f"video_fps must be a positive number, got {video_fps!r}")
    first, last = frame_range(total_frames, video_fps, start, end)
    count = last - first + 1
    n = num_sampled_frames(count, video_fps, fps=fps, nframes=nframes, min_frames=min_frames, max_frames=max_frames)
    indices = torch.linspace(first, last, n, dtype=torch.float32).round().long().tolist()
    sample_fps = n / count * video_fps
    return FramePlan(indices, sample_fps, temporal_patch_size / sample_fps, first, last)


def sample_frame_indices(total_frames: int, video_fps: float, *, fps: float | None = None,
                         nframes: float | None = None, min_frames: int = 4, max_frames: int = 768) -> list[int]:
    """Frame indices to decode from a ``total_frames`` video at ``video_fps``: qwen-vl-utils' rule.

    Give ``nframes`` (rounded to an even number) or ``fps`` (default 2 frames per second, then clipped to
    ``[min_frames, min(max_frames, total_frames)]`` and floored to even). Indices are
    ``linspace(0, total_frames - 1, n).round()``. ``ValueError`` when both are given, the video has no frames,
    or the count falls outside ``[2, total_frames]``. :func:`plan_frames` also returns ``sample_fps`` and
    ``second_per_grid_ts``.
    """
    return plan_frames(total_frames, video_fps, fps=fps, nframes=nframes, min_frames=min_frames,
                       max_frames=max_frames).indices


MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, *, factor: int = IMAGE_FACTOR, min_pixels: float, max_pixels: float
                 ) -> tuple[int, int]:
    """``(height, width)`` by qwen-vl-utils' ``smart_resize`` (the same rule in 0.0.8 to 0.0.14), which its
    ``fetch_image`` and ``fetch_video`` resize to: each side rounded to a multiple of ``factor``, at least one
    ``factor``; above ``max_pixels`` both sides scaled by ``sqrt(H * W / max_pixels)`` and floored to the factor;
    below ``min_pixels`` scaled up by ``sqrt(min_pixels / (H * W))`` and ceiled (which can overshoot
    ``max_pixels`` by up to a row of patches, as there and as transformers' own ``smart_resize``). mmrl's one
    difference: the floored sides stay at least one ``factor`` (qwen-vl-utils floors a side of an extreme aspect
    ratio to 0 and then fails to resize; transformers keeps ``factor``, as here). An aspect ratio above 200 is a
    ``ValueError``, as in both.

    transformers' ``smart_resize`` differs on a side of at most ``factor / 2`` pixels: it rounds that side to 0 and
    so takes the upscaling branch (a 2 x 387 image at the defaults: 28 x 784 there, 28 x 392 here and in
    qwen-vl-utils); on other sizes the two agree.
    """
    if min(height, width) <= 0:
        raise ValueError(f"image of {height}x{width} pixels has no area")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got "
                         f"{max(height, width) / min(height, width)}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def budget_size(height: int, width: int, *, min_pixels: int | None = None, max_pixels: int | None = None,
                factor: int = IMAGE_FACTOR) -> tuple[int, int]:
    """``(height, width)`` after :func:`smart_resize` (qwen-vl-utils') to the budget; unchanged when no budget is
    given.

    Defaults for the missing bound: ``max_pixels = 16384 * factor**2``, ``min_pixels = 4 * factor**2``
    (qwen-vl-utils' image defaults), except that the default minimum never exceeds a given maximum (mmrl's rule;
    qwen-vl-utils' 0.0.13+ assert fails there). A maximum below one patch, or a minimum above the maximum, is a
    ``ValueError``.
    """
    if min_pixels is None and max_pixels is None:
        return height, width
    max_pixels = 16384 * factor * factor if max_pixels is None else int(max_pixels)
    min_pixels = min(4 * factor * factor, max_pixels) if min_pixels is None else int(min_pixels)
    if max_pixels < factor * factor:
        raise ValueError(f"max_pixels={max_pixels} is below one {factor}x{factor} patch ({factor * factor} pixels)")
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels={min_pixels} is above max_pixels={max_pixels}")
    return smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def frame_pixel_budget(num_frames: int, *, min_pixels: int, frame_max_pixels: int, total_pixels: float,
                       max_pixels: int | None = None, temporal_patch_size: int = FRAME_FACTOR) -> tuple[int, float]:
    """``(min_pixels, max_pixels)`` for each of ``num_frames`` sampled frames under a total video budget: qwen-vl-utils
    ``fetch_video`` (Qwen2.5-VL's and Qwen3-VL's alike), ``max = max(min(frame_max_pixels, total_pixels / num_frames
    * 2), int(1.05 * min_pixels))``, then ``min(max_pixels, max)`` when ``max_pixels`` is given (its
    ``max_pixels`` entry). The maximum may be fractional, as there; ``smart_resize`` takes it so."""
    if num_frames <= 0:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    cap = max(min(frame_max_pixels, total_pixels / num_frames * temporal_patch_size), int(min_pixels * 1.05))
    return int(min_pixels), cap if max_pixels is None else min(int(max_pixels), cap)


@dataclass
class VideoClip:
    """Decoded frames of one video.

    ``frames``: uint8 ``[T, 3, H, W]`` (channels first, RGB, as qwen-vl-utils returns and the transformers
    video processors accept); ``indices``: the decoded frame numbers; ``duration``: seconds of the whole
    video (``total_frames / video_fps``), against which timestamps are given; ``final_size``: the frames are at the
    size the model takes (qwen-vl-utils' total budget applied), so the processor must not resize them again.
    """

    path: str
    frames: torch.Tensor
    indices: list[int]
    sample_fps: float
    second_per_grid_ts: float
    duration: float
    video_fps: float
    total_frames: int
    original_size: tuple[int, int]  # (width, height) as stored in the file
    final_size: bool = False
    range_frames: int | None = None  # frames in the sampled range (start/end); None: the whole video

    @property
    def frame_times(self) -> list[float]:
        """Time in seconds of each sampled frame."""
        return [i / self.video_fps for i in self.indices]

    def metadata(self) -> dict:
        """The video metadata qwen-vl-utils' ``fetch_video(..., return_video_metadata=True)`` hands the processor:
        the source video's ``fps``, the sampled frames' indices in it and the frames in the sampled range. From it
        Qwen3-VL's processor writes each temporal step's ``<t seconds>`` (the mean time of its frames in the source
        video, a ``start`` offset included) and Qwen2.5-VL's its sampled fps (``len(indices) / total_num_frames x
        fps``, this clip's ``sample_fps``). The indices are sorted: frames shown out of order (T-GRPO) keep the
        timestamps of the positions they are shown at, which would otherwise tell the order."""
        total = self.total_frames if self.range_frames is None else self.range_frames
        return {"fps": self.video_fps, "frames_indices": sorted(self.indices), "total_num_frames": total}


@dataclass(frozen=True)
class VideoInfo:
    """What :func:`probe_video` read: the metadata decord reports, and the first frame decoded."""

    path: str
    total_frames: int
    video_fps: float
    width: int
    height: int

    @property
    def duration(self) -> float:
        return self.total_frames / self.video_fps


def _open_video(path: Path):
    """``(decord reader, frame count, average fps)``, or a :class:`DataError` naming the file."""
    import decord

    if not path.is_file():
        raise DataError(f"video not found: {path}")
    try:
        reader = decord.VideoReader(str(path), ctx=decord.cpu(0))
        return reader, len(reader), float(reader.get_avg_fps())
    except Exception as exc:  # decord raises RuntimeError / DECORDError with ffmpeg's reason
        raise DataError(f"cannot read video {path}: {_reason(exc)}") from None


def probe_video(path: str | Path) -> VideoInfo:
    """Open ``path`` with decord, read its metadata and decode its first frame (not the others).

    A :class:`DataError` naming the file when it is missing, cannot be opened, has fewer than the
    ``FRAME_FACTOR`` (2) frames every frame plan needs, reports no frame rate, or its first frame does not
    decode. The messages are the ones :func:`read_video` gives for the same faults.
    """
    path = Path(path)
    reader, total_frames, video_fps = _open_video(path)
    try:
        if total_frames < FRAME_FACTOR:
            raise DataError(f"video {path} has {total_frames} frame(s): at least {FRAME_FACTOR} are needed")
        if not _is_number(video_fps) or video_fps <= 0:
            raise DataError(f"video {path} reports no frame rate (fps={video_fps})")
        try:
            shape = reader[0].shape
        except Exception as exc:
            raise DataError(f"cannot decode the first frame of video {path} (corrupt?): {_reason(exc)}") from None
        _check_rgb_frames(shape, path)
        height, width = shape[:2]
        if max(height, width) > 200 * min(height, width):  # smart_resize's limit, whatever the budget
            raise DataError(f"video {path} ({width}x{height}): absolute aspect ratio must be smaller than 200, got "
                            f"{max(height, width) / min(height, width):.1f}")
    finally:
        del reader
    return VideoInfo(str(path), total_frames, video_fps, int(width), int(height))


def _check_rgb_frames(shape, path: Path) -> None:
    """decord decodes a video narrower than about 20 px into frames of another shape (64 x w x 72/w, not h x w x
    3), which failed later as "corrupt or truncated": name the cause."""
    if len(shape) < 3 or shape[-1] != 3:
        raise DataError(f"video {path} decodes to frames of shape {tuple(shape)}, not height x width x 3: decord "
                        f"cannot read a video this narrow (about 20 px wide or more is needed)")


def read_video(path: str | Path, *, fps: float | None = None, nframes: float | None = None, min_frames: int = 4,
               max_frames: int = 768, max_pixels: int | None = None, min_pixels: int | None = None,
               total_pixels: float | None = None, frame_max_pixels: int | None = None,
               start: float | None = None, end: float | None = None, factor: int = IMAGE_FACTOR,
               temporal_patch_size: int = 2) -> VideoClip:
    """Decode the frames :func:`plan_frames` picks with ``decord`` and resize them to the pixel budget.

    ``max_pixels``/``min_pixels`` bound each frame (``smart_resize``, bicubic with antialiasing as
    qwen-vl-utils); with neither the frames keep their stored size. With ``total_pixels`` (which needs
    ``min_pixels`` and ``frame_max_pixels``) the bounds are :func:`frame_pixel_budget`'s for the number of frames
    sampled. ``start``/``end`` (seconds) restrict the sampled range. A missing, unreadable or too-short video is a
    :class:`DataError` naming the file.
    """
    if total_pixels is not None and (min_pixels is None or frame_max_pixels is None):
        raise ValueError("read_video: total_pixels needs min_pixels and frame_max_pixels")
    path = Path(path)
    reader, total_frames, video_fps = _open_video(path)
    try:
        plan = plan_frames(total_frames, video_fps, fps=fps, nframes=nframes, min_frames=min_frames,
                           max_frames=max_frames, start=start, end=end, temporal_patch_size=temporal_patch_size)
    except ValueError as exc:
        raise DataError(f"video {path}: {exc}") from None
    try:
        _check_rgb_frames(reader[0].shape, path)
        array = reader.get_batch(plan.indices).asnumpy()
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"cannot decode frames {plan.indices[0]}..{plan.indices[-1]} of video {path} "
                        f"(corrupt or truncated?): {_reason(exc)}") from None
    finally:
        del reader
    frames = torch.from_numpy(array).permute(0, 3, 1, 2).contiguous()
    height, width = frames.shape[-2:]
    try:  # a ValueError here is an aspect ratio over 200
        if total_pixels is None:
            new_h, new_w = budget_size(height, width, min_pixels=min_pixels, max_pixels=max_pixels, factor=factor)
        else:
            low, high = frame_pixel_budget(len(plan.indices), min_pixels=min_pixels,
                                           frame_max_pixels=frame_max_pixels, total_pixels=total_pixels,
                                           max_pixels=max_pixels, temporal_patch_size=temporal_patch_size)
            new_h, new_w = smart_resize(height, width, factor=factor, min_pixels=low, max_pixels=high)
    except ValueError as exc:
        raise DataError(f"video {path}: {exc}") from None
    if (new_h, new_w) != (height, width):
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.functional import resize

        frames = resize(frames, [new_h, new_w], interpolation=InterpolationMode.BICUBIC, antialias=True)
    return VideoClip(path=str(path), frames=frames, indices=plan.indices, sample_fps=plan.sample_fps,
                     second_per_grid_ts=plan.second_per_grid_ts, duration=total_frames / video_fps,
                     video_fps=video_fps, total_frames=total_frames, original_size=(int(width), int(height)),
                     final_size=total_pixels is not None, range_frames=plan.last - plan.first + 1)


_DECORD_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+?:\d+: ")
_CHECK_FAILED = re.compile(r"^Check failed: .*? \(-?\d+ vs\. -?\d+\) ")
_FFMPEG_CODES = {1094995529: "invalid data found when processing input", 541478725: "end of file"}


def _reason(exc: Exception) -> str:
    """The readable part of a decord message.

    decord prefixes each nested failure with ``[hh:mm:ss] <source file>:<line>: `` and its checks with
    ``Check failed: <expression> (<a> vs. <b>)``; what is left is ffmpeg's reason. ffmpeg's common error codes
    are named, and decord's ``"Error reading <path>..."`` (the file did not open) says why in words. For
    example ``"[09:51:26] .../threaded_decoder.cc:292: [09:51:26] .../threaded_decoder.cc:218: Check failed:
    avcodec_send_packet(...) >= 0 (-1094995529 vs. 0) Thread worker: Error sending packet."`` reads
    ``"Thread worker: Error sending packet."``.
    """
    text = str(exc).strip() or type(exc).__name__
    line = text.splitlines()[0].strip()
    if line.startswith("Error reading ") and line.endswith("..."):  # decord's open failure names only the path
        return "ffmpeg cannot open it (truncated, or not a video file)"
    while True:
        stripped = _DECORD_PREFIX.sub("", line, count=1)
        if stripped == line:
            break
        line = stripped
    line = _CHECK_FAILED.sub("", line, count=1).strip() or line
    match = re.search(r"failed with (-?\d+)$", line)
    if match and abs(int(match.group(1))) in _FFMPEG_CODES:
        line += f" ({_FFMPEG_CODES[abs(int(match.group(1)))]})"
    return line[:300]
