"""Small synthetic VLM datasets made on the spot, for the tiny CPU recipes and tests.

Real images and real mp4 videos in mmrl's JSONL format (:mod:`mmrl.data.vlm`), with exact ground truth:

* ``grounding``: one coloured rectangle on a noisy background per image; "Where is the <colour> box?"
  with the box in original pixels (``boxes``) -- referring-expression grounding as VLM-R1 trains it;
* ``temporal_grounding``: a video whose frames turn a colour between two instants; "When does the screen
  turn <colour>?" with ``timestamps`` in seconds -- temporal grounding as Time-R1 trains it.

``ensure_synthetic(kind)`` builds once into the cache (``$MMRL_CACHE`` or ``~/.cache/mmrl``), atomically, and
returns the JSONL path; data sets named ``tiny:grounding`` / ``tiny:temporal_grounding`` in a config resolve here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

SYNTHETIC_VERSION = "v1"
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 60, 220), "yellow": (230, 220, 30)}


def build_grounding_set(outdir: str | Path, *, num_samples: int = 32, seed: int = 0, size: tuple[int, int] = (84, 56)
                        ) -> Path:
    """``num_samples`` images ``size`` (W, H) with one rectangle each; writes ``data.jsonl`` and ``images/``."""
    outdir = Path(outdir)
    (outdir / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    width, height = size
    records = []
    for i in range(num_samples):
        name = list(COLOURS)[i % len(COLOURS)]
        pixels = rng.integers(90, 160, (height, width, 3), dtype=np.uint8)
        w, h = int(rng.integers(width // 5, width // 2)), int(rng.integers(height // 5, height // 2))
        x1, y1 = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
        pixels[y1:y1 + h, x1:x1 + w] = COLOURS[name]
        path = outdir / "images" / f"{i:04d}.png"
        Image.fromarray(pixels).save(path)
        box = [x1, y1, x1 + w, y1 + h]
        records.append({"id": f"g{i}", "image": f"images/{path.name}", "task": "grounding",
                        "question": f"Where is the {name} box? Answer with its bounding box [x1, y1, x2, y2].",
                        "solution": json.dumps(box), "boxes": [box]})  # answers in the policy's own coord_format
    return _write_jsonl(outdir, records)


def build_temporal_set(outdir: str | Path, *, num_samples: int = 8, seed: int = 0, seconds: int = 8,
                       fps: int = 4, size: tuple[int, int] = (56, 56)) -> Path:
    """``num_samples`` mp4 videos (PyAV, H.264) of ``seconds`` at ``fps`` whose frames are one colour between two
    instants; writes ``data.jsonl`` and ``videos/``."""
    import av

    outdir = Path(outdir)
    (outdir / "videos").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    width, height = size
    total = seconds * fps
    records = []
    for i in range(num_samples):
        name = list(COLOURS)[i % len(COLOURS)]
        start = int(rng.integers(0, total - fps * 2))
        end = int(rng.integers(start + fps, total))
        path = outdir / "videos" / f"{i:04d}.mp4"
        with av.open(str(path), "w") as container:
            stream = container.add_stream("libx264", rate=fps)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.options = {"crf": "18", "preset": "ultrafast"}
            for f in range(total):
                frame = np.full((height, width, 3), 40 + 4 * (f % 8), np.uint8)
                if start <= f < end:
                    frame[:] = COLOURS[name]
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        span = [start / fps, end / fps]
        records.append({"id": f"t{i}", "video": f"videos/{path.name}", "task": "temporal_grounding",
                        "question": f"When does the screen turn {name}? Answer with the start and end time in "
                                    f"seconds, like [2.0, 5.5].",
                        "solution": json.dumps(span), "timestamps": span, "duration": total / fps})
    return _write_jsonl(outdir, records)


def _write_jsonl(outdir: Path, records: list[dict]) -> Path:
    path = outdir / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


_BUILDERS = {"grounding": build_grounding_set, "temporal_grounding": build_temporal_set}


def ensure_synthetic(kind: str, cache_dir: str | Path | None = None) -> Path:
    """The JSONL path of the synthetic data set ``kind``, built once into the cache."""
    from mmrl.pipelines.flow.tiny import ensure_built

    if kind not in _BUILDERS:
        raise ValueError(f"unknown synthetic data set {kind!r}; expected one of {sorted(_BUILDERS)}")
    folder = ensure_built(f"data-{kind}-{SYNTHETIC_VERSION}", _BUILDERS[kind], cache_dir)
    return folder / "data.jsonl"


def resolve_dataset(dataset: str) -> str:
    """``tiny:<kind>`` -> the cached synthetic JSONL; anything else unchanged."""
    if dataset.startswith("tiny:"):
        return str(ensure_synthetic(dataset.split(":", 1)[1]))
    return dataset
