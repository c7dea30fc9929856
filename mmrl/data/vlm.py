"""VLM datasets: questions about images or videos, with the solution and task fields rewards need.

JSONL format
------------
One JSON object per line (blank lines are ignored)::

    {"image": "imgs/cat.jpg", "question": "Where is the cat?", "solution": "[12, 30, 80, 96]",
     "task": "grounding", "boxes": [[12, 30, 80, 96]]}
    {"video": "videos/v1.mp4", "question": "When does the person sit down?", "solution": "3.0-7.5",
     "task": "temporal_grounding", "timestamps": [3.0, 7.5], "duration": 30.0}
    {"images": ["a.png", "b.png"], "question": "Which differs? A or B", "solution": "B",
     "task": "multiple_choice", "choices": ["A", "B"]}

Fields:

* ``image`` (str) or ``images`` (non-empty list of str), and/or ``video`` (str): paths relative to the JSONL
  file's folder (or to ``media_root`` when given), or absolute. None of them: a text-only sample.
* ``question`` (str, required, non-empty) and ``solution`` (str, required, non-empty).
* ``task`` (str, default ``"default"``): selects the sample's rewards when a run mixes tasks.
* ``id`` (str or int, optional; default ``"<file name>:<line>"``).
* task fields, checked when present: ``boxes`` (a list of ``[x1, y1, x2, y2]`` with ``x2 > x1``,
  ``y2 > y1``, in original image pixels; a single flat box is accepted and stored as a list of one),
  ``timestamps`` (``[start, end]`` seconds, ``0 <= start < end``), ``choices`` (non-empty list of str),
  ``duration`` (seconds, > 0);
* anything else is passed through unchanged.

``VLMSample.metadata`` holds every field except the media paths and the question: ``solution``, ``task``,
``id``, the task fields (normalised: boxes and timestamps as floats) and the pass-through fields, so a
reward that receives the metadata sees all of them. :func:`load_images` adds ``image_size`` (``[W, H]`` of
the first image as stored, for rescaling predicted boxes), ``image_sizes`` (all images), ``input_size`` /
``input_sizes`` (after the pixel budget); :func:`load_video` adds ``sample_fps``, ``second_per_grid_ts``,
``video_fps``, ``num_frames`` and ``duration`` (the decoded duration, unless the line gave one).

Bad input: a line that is not JSON, a missing or ill-typed field, a missing image or video file, an image
Pillow cannot verify, or a video whose probe fails (decord cannot open it, it has under 2 frames, or its first
frame does not decode) is a :class:`DataError` ``"<file>:<line>: <what was expected>"``, so a bad file stops a
run before its first update, not halfway. With ``skip_bad=True`` the line is skipped with a ``logging`` warning
instead, and counted: the returned :class:`SampleList` is a plain list with ``skipped`` (the count) and
``problems`` (the messages). Reading checks each file's structure, not all its pixels (startup stays at about
one open plus one frame per video); :func:`mmrl.data.validate.check_data` (``mmrl config validate``) decodes
everything training will read and lists every problem at once.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from mmrl.data.prompts import DataError, OrderedSource, json_error
from mmrl.data.video import IMAGE_FACTOR, MAX_ASPECT_RATIO, VideoClip, budget_size, probe_video, read_video

logger = logging.getLogger(__name__)

MEDIA_FIELDS = ("image", "images", "video")


@dataclass
class VLMSample:
    """One question about zero or more images and at most one video.

    ``image_paths``/``video_path`` are resolved absolute paths (str). ``images`` holds in-memory images
    (Hugging Face rows) used instead of ``image_paths``. ``source`` is ``"<file>:<line>"`` (or
    ``"<dataset>:<row>"``) for error messages.
    """

    id: str
    question: str
    solution: str
    image_paths: list[str] = field(default_factory=list)
    video_path: str | None = None
    task: str = "default"
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    images: list[Image.Image] = field(default_factory=list, repr=False)

    @property
    def num_images(self) -> int:
        return len(self.images) if self.images else len(self.image_paths)


class SampleList(list):
    """A list of :class:`VLMSample` that also says what was skipped: ``skipped`` (count) and ``problems``."""

    def __init__(self, samples: Iterable[VLMSample] = (), problems: list[str] | None = None):
        super().__init__(samples)
        self.problems = list(problems or [])

    @property
    def skipped(self) -> int:
        return len(self.problems)


class _Bad(Exception):
    """A problem with one record; becomes a DataError (or a counted skip) with the file and line."""


# ---------------------------------------------------------------------------------------------- checking


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _text(record: Mapping, key: str, *, required: bool) -> str | None:
    if key not in record or record[key] is None:
        if required:
            raise _Bad(f"missing required field {key!r} (a non-empty string)")
        return None
    value = record[key]
    if not isinstance(value, str) or not value.strip():
        raise _Bad(f"field {key!r} must be a non-empty string, got {_type_name(value)} {value!r:.60}")
    return value


#: Qwen-VL's chat and vision special tokens: a question holding one would forge a turn or a media placeholder
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
               "<|image_pad|>", "<|video_pad|>")


def _hint_other_layout(record: Mapping) -> None:
    """A record in another project's layout (no 'question'): say which fields are mmrl's."""
    if "problem" in record:
        raise _Bad("missing required field 'question': this looks like a Video-R1 / R1-V / VLM-R1 record, whose "
                   "'problem' is mmrl's 'question' (and 'path' with 'data_type' is mmrl's 'video' or 'image'; "
                   "'problem_type', 'options' and 'solution' keep their names): rename the fields (README, "
                   "'Data: JSONL')")
    if "conversations" in record or "messages" in record:
        raise _Bad("missing required field 'question': a chat record ('conversations' / 'messages') is not mmrl's "
                   "layout: one 'question' (the user turn's text), one 'solution' (the reference answer) and the "
                   "media in 'image' / 'images' / 'video' (README, 'Data: JSONL')")


def _check_box(box, what: str) -> list[float]:
    if not isinstance(box, (list, tuple)) or len(box) != 4 or not all(_number(v) for v in box):
        raise _Bad(f"{what} must be [x1, y1, x2, y2] (4 numbers), got {box!r:.80}")
    x1, y1, x2, y2 = (float(v) for v in box)
    if not (x2 > x1 and y2 > y1):
        raise _Bad(f"{what} {box!r} is empty or reversed: expected x2 > x1 and y2 > y1")
    return [x1, y1, x2, y2]


def _check_task_fields(record: Mapping) -> dict[str, Any]:
    """The metadata: every non-media, non-question field, task fields validated and normalised."""
    meta = {k: v for k, v in record.items() if k not in MEDIA_FIELDS and k != "question"}
    if "boxes" in meta:
        boxes = meta["boxes"]
        if isinstance(boxes, (list, tuple)) and len(boxes) == 4 and all(_number(v) for v in boxes):
            boxes = [boxes]  # one flat box
        if not isinstance(boxes, (list, tuple)):
            raise _Bad(f"field 'boxes' must be a list of [x1, y1, x2, y2], got {_type_name(boxes)}")
        meta["boxes"] = [_check_box(b, f"boxes[{i}]") for i, b in enumerate(boxes)]
    if "timestamps" in meta:
        span = meta["timestamps"]
        if not isinstance(span, (list, tuple)) or len(span) != 2 or not all(_number(v) for v in span):
            raise _Bad(f"field 'timestamps' must be [start, end] in seconds (2 numbers), got {span!r:.80}")
        start, end = float(span[0]), float(span[1])
        if not 0 <= start < end:
            raise _Bad(f"field 'timestamps' {list(span)} must satisfy 0 <= start < end")
        meta["timestamps"] = [start, end]
    if "choices" in meta:
        choices = meta["choices"]
        if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) for c in choices):
            raise _Bad(f"field 'choices' must be a non-empty list of strings, got {choices!r:.80}")
        meta["choices"] = list(choices)
    if "duration" in meta and meta["duration"] is not None:
        if not _number(meta["duration"]) or meta["duration"] <= 0:
            raise _Bad(f"field 'duration' must be a positive number of seconds, got {meta['duration']!r}")
    return meta


def _resolve(value: str, base: Path, key: str) -> Path:
    path = Path(value).expanduser()
    path = path if path.is_absolute() else base / path
    if not path.is_file():
        raise _Bad(f"{key} file not found: {path}" + ("" if str(path) == value else f" (from {value!r})"))
    return path


def _image_problem(path: str, *, decode: bool) -> str | None:
    """``None`` when the image opens and ``verify()`` passes (and, with ``decode``, its pixels load) and its aspect
    ratio is one Qwen-VL's processors accept (at most 200, ``smart_resize``'s limit)."""
    try:
        with Image.open(path) as image:
            width, height = image.size
            image.verify()
        if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
            return (f"image {path} is {width}x{height}: an aspect ratio above {MAX_ASPECT_RATIO}, which Qwen-VL's "
                    f"processors refuse (smart_resize)")
        if decode:  # verify() checks the structure (PNG chunks and CRCs); load() decodes every pixel
            with Image.open(path) as image:
                image.load()
    except FileNotFoundError:
        return f"image file not found: {path}"
    except Exception as exc:
        return f"corrupt image {path}: {type(exc).__name__}: {exc}"
    return None


def _video_problem(path: str, *, decode: bool, frames: Mapping[str, Any] | None) -> str | None:
    """``None`` when :func:`mmrl.data.video.probe_video` passes (with ``decode``: :func:`read_video` decodes the
    frames ``frames`` plans, the ``fps`` / ``nframes`` / ``max_frames`` training uses, without resizing)."""
    try:
        if decode:
            read_video(path, **dict(frames or {}))
        else:
            probe_video(path)
    except DataError as exc:
        return str(exc)
    return None


def check_media(sample: VLMSample, *, images: bool = True, videos: bool = True, decode: bool = False,
                video_frames: Mapping[str, Any] | None = None) -> list[str]:
    """Every problem with the sample's media files, as messages without the sample's location (``[]``: fine).

    ``images``: open and ``verify()`` each image (with ``decode``: also decode its pixels). ``videos``: probe the
    video (:func:`mmrl.data.video.probe_video`: metadata and the first frame; with ``decode``: decode the frames
    ``video_frames`` (``read_video`` keyword arguments) selects). In-memory images (Hugging Face rows) are not
    checked here: they were decoded when the rows were converted.
    """
    problems = []
    if images and not sample.images:
        problems += [p for p in (_image_problem(path, decode=decode) for path in sample.image_paths) if p]
    if videos and sample.video_path is not None:
        problem = _video_problem(sample.video_path, decode=decode, frames=video_frames)
        if problem:
            problems.append(problem)
    return problems


def media_workers() -> int:
    """Threads for checking media files (decord and Pillow release the GIL while decoding): up to 8."""
    return max(1, min(8, os.cpu_count() or 1))


def check_all_media(samples: list[VLMSample], *, workers: int | None = None, **kwargs) -> list[list[str]]:
    """:func:`check_media` for every sample (keyword arguments as there), in order, on ``workers`` threads."""
    workers = media_workers() if workers is None else max(1, int(workers))
    with_media = sum(1 for s in samples if s.image_paths or s.video_path)
    if workers == 1 or with_media < 2 * workers:
        return [check_media(s, **kwargs) for s in samples]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mmrl-media") as pool:
        return list(pool.map(lambda s: check_media(s, **kwargs), samples))


def _media_paths(record: Mapping) -> tuple[list[str], str | None]:
    if "image" in record and "images" in record:
        raise _Bad("give either 'image' (one path) or 'images' (a list), not both")
    images: list[str] = []
    if record.get("image") is not None:
        if not isinstance(record["image"], str) or not record["image"]:
            raise _Bad(f"field 'image' must be a path string, got {_type_name(record['image'])}")
        images = [record["image"]]
    elif record.get("images") is not None:
        value = record["images"]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise _Bad(f"field 'images' must be a non-empty list of path strings, got {value!r:.80}")
        images = list(value)
    video = record.get("video")
    if video is not None and (not isinstance(video, str) or not video):
        raise _Bad(f"field 'video' must be a path string, got {_type_name(video)}")
    return images, video


def _build(record, *, default_id: str, source: str, base: Path,
           in_memory: list[Image.Image] | None = None) -> VLMSample:
    """One record -> a sample: fields checked, media paths resolved and checked to exist (not opened)."""
    if not isinstance(record, Mapping):
        raise _Bad(f"expected a JSON object with 'question' and 'solution', got {_type_name(record)}")
    if "question" not in record:
        _hint_other_layout(record)
    question = _text(record, "question", required=True)
    for token in CHAT_TOKENS:
        if token in question:
            raise _Bad(f"field 'question' contains the special token {token!r}: the chat template writes the turns "
                       f"and the media placeholders itself (in the text it would forge a turn or a vision slot the "
                       f"processor cannot fill); write the question as plain text and give the media in "
                       f"'image' / 'images' / 'video'")
    solution = _text(record, "solution", required=True)
    task = _text(record, "task", required=False) or "default"
    sample_id = record.get("id", default_id)
    if not isinstance(sample_id, (str, int)) or isinstance(sample_id, bool):
        raise _Bad(f"field 'id' must be a string or an integer, got {_type_name(sample_id)}")
    image_values, video_value = _media_paths(record)
    image_paths = [_resolve(v, base, "image") for v in image_values]
    video_path = _resolve(video_value, base, "video") if video_value is not None else None
    meta = _check_task_fields(record)
    meta["task"], meta["id"] = task, str(sample_id)
    # the resolved media, for rewards that look at them (judged perception rewards): absolute paths
    if image_paths:
        meta.setdefault("image_paths", [str(p) for p in image_paths])
    if video_path is not None:
        meta.setdefault("video_path", str(video_path))
    return VLMSample(id=str(sample_id), question=question, solution=solution,
                     image_paths=[str(p) for p in image_paths],
                     video_path=None if video_path is None else str(video_path),
                     task=task, metadata=meta, source=source, images=list(in_memory or []))


@dataclass
class Entry:
    """One non-blank line (or row) as parsed: its sample, or the problem that kept it from being one."""

    where: str  # "<file>:<line>" or "<dataset>:<row>"
    sample: VLMSample | None
    problem: str | None  # without the location


def parse_vlm_jsonl(path: str | Path, *, media_root: str | Path | None = None) -> list[Entry]:
    """Every non-blank line of a VLM JSONL file parsed and checked (fields, media files exist), media unopened.

    The one parser behind :func:`read_vlm_jsonl` and :func:`mmrl.data.validate.check_data`. A missing file is a
    :class:`DataError`; a bad line is an :class:`Entry` with its ``problem``.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"VLM data file not found: {path}")
    base = Path(media_root).expanduser().absolute() if media_root is not None else path.absolute().parent
    entries: list[Entry] = []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                try:
                    # tolerate a BOM; without the line end, an error's column is on this line
                    record = json.loads(raw.rstrip(b"\r\n").decode("utf-8-sig"))
                except UnicodeDecodeError as exc:
                    raise _Bad(f"not UTF-8 text (byte {exc.start})") from None
                except json.JSONDecodeError as exc:
                    raise _Bad(json_error(exc)) from None
                entries.append(Entry(where, _build(record, default_id=f"{path.name}:{number}", source=where,
                                                   base=base), None))
            except _Bad as exc:
                entries.append(Entry(where, None, str(exc)))
    return entries


def _finish(entries: list[Entry], *, name: str, unit: str, skip_bad: bool, verify_images: bool,
            verify_videos: bool) -> SampleList:
    """Check the media of the parsed samples, then raise on (or skip and count) every bad entry, in order."""
    first_bad = next((i for i, e in enumerate(entries) if e.problem is not None), len(entries))
    # without skip_bad the first bad entry raises: media after it need not be opened
    checked = [e for e in (entries if skip_bad else entries[:first_bad]) if e.sample is not None]
    media = check_all_media([e.sample for e in checked], images=verify_images, videos=verify_videos)
    media_problems = {id(e): found for e, found in zip(checked, media) if found}
    samples: list[VLMSample] = []
    problems: list[str] = []
    for entry in entries:
        problem = entry.problem or "; ".join(media_problems.get(id(entry), ()))
        if problem:
            _keep_or_raise(f"{entry.where}: {problem}", skip_bad, problems)
        else:
            samples.append(entry.sample)
    if problems:
        logger.warning("%s: skipped %d bad %s(s), kept %d sample(s)", name, len(problems), unit, len(samples))
    if not samples:
        skipped = f" ({len(problems)} bad {unit}s skipped)" if problems else ""
        raise DataError(f"no usable samples in {name}{skipped}")
    return SampleList(samples, problems)


def _keep_or_raise(problem: str, skip_bad: bool, problems: list[str]) -> None:
    if not skip_bad:
        raise DataError(problem)
    logger.warning("skipping %s", problem)
    problems.append(problem)


# ---------------------------------------------------------------------------------------------- readers


def read_vlm_jsonl(path: str | Path, *, skip_bad: bool = False, media_root: str | Path | None = None,
                   verify_images: bool = True, verify_videos: bool = True) -> SampleList:
    """Read a VLM JSONL file (format in the module docstring) into :class:`VLMSample` s.

    ``media_root``: folder for relative media paths (default: the JSONL file's folder). Every media file must
    exist. ``verify_images``: open and ``verify()`` every image now (its structure, not a decode of its pixels: a
    truncated image can still fail later, in :func:`load_images`). ``verify_videos``: probe every video now
    (:func:`mmrl.data.video.probe_video`: open with decord, read the metadata, decode the first frame; not the
    other frames, so damage further in fails later, in :func:`load_video`). Media are checked on up to 8
    threads. ``skip_bad``: skip and count bad lines instead of raising on the first. A file with no usable
    sample is always an error. ``mmrl config validate`` (:func:`mmrl.data.validate.check_data`) decodes every
    image and the frames training reads from every video, and lists every problem at once.
    """
    path = Path(path)
    return _finish(parse_vlm_jsonl(path, media_root=media_root), name=str(path), unit="line", skip_bad=skip_bad,
                   verify_images=verify_images, verify_videos=verify_videos)


def _hf_images(value) -> tuple[list[str], list[Image.Image]]:
    """An image column value -> (path strings, in-memory images)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    paths, images = [], []
    for item in values:
        if isinstance(item, Image.Image):
            images.append(item)
        elif isinstance(item, str):
            paths.append(item)
        elif isinstance(item, Mapping) and (item.get("bytes") or item.get("path")):  # Image(decode=False)
            if item.get("bytes"):
                try:
                    image = Image.open(io.BytesIO(item["bytes"]))
                    image.load()
                except Exception as exc:
                    raise _Bad(f"corrupt image bytes ({item.get('path') or 'no path'}): {exc}") from None
                images.append(image)
            else:
                paths.append(item["path"])
        else:
            raise _Bad(f"image column: expected a PIL image, a path or {{'bytes', 'path'}}, got {_type_name(item)}")
    if paths and images:
        raise _Bad("image column mixes paths and in-memory images")
    return paths, images


def samples_from_hf(dataset, *, image_column: str = "image", video_column: str = "video",
                    question_column: str = "question", solution_column: str = "solution",
                    task_column: str = "task", id_column: str = "id", media_root: str | Path | None = None,
                    skip_bad: bool = False, verify_images: bool = True, verify_videos: bool = True,
                    name: str | None = None) -> SampleList:
    """Convert a Hugging Face ``datasets.Dataset`` (one split), or any iterable of row dicts, into samples.

    The image column may hold a PIL image (the ``Image`` feature), a list of them, paths, or
    ``{"bytes", "path"}`` dicts (``Image(decode=False)``); the video column a path. Columns are renamed to
    the JSONL field names (``question_column`` -> ``question``, ...); the other columns are task fields
    and metadata, checked as in the JSONL format (``verify_images`` / ``verify_videos`` as in
    :func:`read_vlm_jsonl`). Relative paths resolve against ``media_root`` (default: the working directory).
    Errors name ``"<name>:<row>"`` (``name`` defaults to the dataset's name).
    ``datasets`` itself is not needed: nothing is imported from it.
    """
    if isinstance(dataset, Mapping):
        raise DataError(f"expected one split of rows, got a mapping with keys {list(dataset)[:5]}: "
                        "pass e.g. dataset['train']")
    info = getattr(dataset, "info", None)
    name = name or getattr(info, "dataset_name", None) or "dataset"
    base = Path(media_root) if media_root is not None else Path.cwd()
    renames = {question_column: "question", solution_column: "solution", task_column: "task", id_column: "id",
               image_column: "image", video_column: "video"}
    entries: list[Entry] = []
    for index, row in enumerate(dataset):
        where = f"{name}:{index}"
        try:
            if not isinstance(row, Mapping):
                raise _Bad(f"expected a row mapping column names to values, got {_type_name(row)}")
            record = {renames.get(k, k): v for k, v in row.items()}
            in_memory: list[Image.Image] = []
            image_value = record.pop("image", None)
            if image_value is not None:
                paths, in_memory = _hf_images(image_value)
                if paths:
                    record["images"] = paths
            entries.append(Entry(where, _build(record, default_id=where, source=where, base=base,
                                               in_memory=in_memory), None))
        except _Bad as exc:
            entries.append(Entry(where, None, str(exc)))
    return _finish(entries, name=name, unit="row", skip_bad=skip_bad, verify_images=verify_images,
                   verify_videos=verify_videos)


# ---------------------------------------------------------------------------------------------- loading


def to_8bit(image: Image.Image) -> Image.Image:
    """Grey images of more than 8 bits as 8-bit ``L`` (PIL's ``convert("RGB")`` clips them, so a 16-bit PNG would
    turn white): ``I;16`` scaled by 255 / 65535; ``I`` (32-bit integers) the same when a value exceeds 255, else
    read as 8-bit; ``F`` (floats) scaled by 255 when every value is in [0, 1], else clipped to [0, 255]. Any other
    mode is returned as it is."""
    if not (image.mode.startswith("I;16") or image.mode in ("I", "F")):
        return image
    import numpy as np

    values = np.asarray(image, dtype=np.float64)
    top = float(values.max()) if values.size else 0.0
    if image.mode.startswith("I;16") or (image.mode == "I" and top > 255):
        values = np.clip(values, 0, 65535) / 257.0
    elif image.mode == "F" and 0.0 <= float(values.min(initial=0.0)) and top <= 1.0:
        values = values * 255.0
    return Image.fromarray(np.clip(np.round(values), 0, 255).astype(np.uint8), mode="L")


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB; transparent pixels composited on white; more than 8 bits scaled to 8 (:func:`to_8bit`).

    qwen-vl-utils' ``to_rgb`` composites RGBA on white the same way, but converts ``LA`` and transparent ``P``
    images with ``convert("RGB")``, which drops the alpha (a transparent black pixel stays black), and clips 16-bit
    images (nearly white); mmrl composites every transparent mode, as transformers' ``convert_to_rgb`` does."""
    image = to_8bit(image)
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.split()[3])
        return background
    return image.convert("RGB")


def load_images(sample: VLMSample, *, min_pixels: int | None = None, max_pixels: int | None = None,
                factor: int = IMAGE_FACTOR) -> list[Image.Image]:
    """The sample's images as RGB PIL images, resized to the pixel budget when one is given.

    With ``min_pixels``/``max_pixels`` each image is resized (PIL bicubic) to qwen-vl-utils' ``smart_resize``
    size, as its ``fetch_image`` does (:func:`mmrl.data.video.budget_size`): sides multiples of ``factor`` (28 for
    Qwen2/2.5-VL, 32 for Qwen3-VL), pixels within the budget (an upscaled size may pass the maximum by a row of
    patches, as there), aspect kept. ``factor`` must be the processor's ``patch_size * merge_size`` (as
    :func:`mmrl.build.vlm_media` passes it), and the processor must take the image as it is (``do_resize=False``, as
    the policy passes images from ``vlm_media``): resized again, to the processor's own bounds by transformers' rule,
    a size near the budget's edges can change, and ``input_size`` would not be the model's input
    (``image_grid_thw[1:] * patch_size``). Records ``image_size``/``image_sizes`` (stored ``[W, H]``) and
    ``input_size``/``input_sizes`` (after resizing) in ``sample.metadata``. An unreadable image is a
    :class:`DataError` naming the image and the sample's line.
    """
    originals: list[Image.Image] = []
    if sample.images:
        originals = list(sample.images)
    else:
        for path in sample.image_paths:
            try:
                with Image.open(path) as handle:
                    handle.load()
                    originals.append(handle.copy())
            except FileNotFoundError:
                raise DataError(f"{sample.source}: image file not found: {path}") from None
            except Exception as exc:
                raise DataError(f"{sample.source}: corrupt image {path}: {type(exc).__name__}: {exc}") from None
    images, sizes, inputs = [], [], []
    for index, original in enumerate(originals):
        what = sample.image_paths[index] if index < len(sample.image_paths) else f"image {index}"
        try:
            image = to_rgb(original)
        except Exception as exc:  # in-memory images decode lazily
            raise DataError(f"{sample.source}: corrupt image {what}: {type(exc).__name__}: {exc}") from None
        width, height = image.size
        try:
            new_h, new_w = budget_size(height, width, min_pixels=min_pixels, max_pixels=max_pixels, factor=factor)
        except ValueError as exc:
            raise DataError(f"{sample.source}: {what} ({width}x{height}): {exc}") from None
        if (new_w, new_h) != (width, height):
            image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
        images.append(image)
        sizes.append([width, height])
        inputs.append([new_w, new_h])
    if images:
        sample.metadata.update(image_size=sizes[0], image_sizes=sizes, input_size=inputs[0], input_sizes=inputs)
    return images


def load_video(sample: VLMSample, *, fps: float | None = None, nframes: float | None = None, min_frames: int = 4,
               max_frames: int = 768, min_pixels: int | None = None, max_pixels: int | None = None,
               total_pixels: float | None = None, frame_max_pixels: int | None = None,
               start: float | None = None, end: float | None = None, factor: int = IMAGE_FACTOR,
               temporal_patch_size: int = 2) -> VideoClip:
    """Decode the sample's video with :func:`mmrl.data.video.read_video` (frame rule and budget there).

    Records ``sample_fps``, ``second_per_grid_ts``, ``video_fps``, ``num_frames`` and (unless the line gave
    it) ``duration`` in ``sample.metadata``. Errors name the video and the sample's line.
    """
    if sample.video_path is None:
        raise DataError(f"{sample.source}: the sample has no video")
    try:
        clip = read_video(sample.video_path, fps=fps, nframes=nframes, min_frames=min_frames, max_frames=max_frames,
                          min_pixels=min_pixels, max_pixels=max_pixels, total_pixels=total_pixels,
                          frame_max_pixels=frame_max_pixels, start=start, end=end, factor=factor,
                          temporal_patch_size=temporal_patch_size)
    except DataError as exc:
        raise DataError(f"{sample.source}: {exc}") from None
    sample.metadata.update(sample_fps=clip.sample_fps, second_per_grid_ts=clip.second_per_grid_ts,
                           video_fps=clip.video_fps, num_frames=len(clip.indices))
    if sample.metadata.get("duration") is None:
        sample.metadata["duration"] = clip.duration
    return clip


class VLMSampleSource(OrderedSource[VLMSample]):
    """Endless, seeded, resumable order over VLM samples (the same ordering as ``PromptSource``):
    ``next_batch(per_process, rank=, world=)``, ``state_dict()`` / ``load_state_dict()`` by position.
    ``problems``: the lines skipped when the data set was read (``SampleList.problems``), ``skipped`` their count."""

    noun = "samples"
    collection = "VLM dataset"

    def __init__(self, items: list[VLMSample], *, seed: int = 0, shuffle: bool = True,
                 problems: list[str] | None = None):
        super().__init__(items, seed=seed, shuffle=shuffle)
        self.problems = list(problems if problems is not None else getattr(items, "problems", []))

    @property
    def skipped(self) -> int:
        return len(self.problems)
