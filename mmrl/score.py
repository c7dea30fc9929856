"""``mmrl score``: mmrl's rewards on a folder of images, without training.

::

    mmrl score --config configs/gpu/sd35m_flow_grpo_pickscore.yaml --images out/ --prompts prompts.csv --out scores.csv
    mmrl score --rewards '{jpeg_compressibility: 1, brightness: 0.5}' --images out/ --out scores.json

Prompts file (paths relative to ``--images`` unless absolute):

* ``.csv`` with a header holding ``image`` and ``prompt``; other columns become metadata (strings);
* ``.jsonl``: one object per line with ``image``, ``prompt`` and any other fields as metadata (a
  ``metadata`` object is merged in).

Without ``--prompts`` every image in the folder (``.png .jpg .jpeg .webp .bmp .gif .tif .tiff``,
sorted by name; ``--recursive`` for sub-folders) is scored with no prompt, which only
prompt-free rewards accept.

Output, one row per listed image, in input order: ``image``, ``prompt``, one column per score key
(``total``, each component, each component's extras) and ``error``. A missing or unreadable image
is not fatal: its row has NaN scores and the reason in ``error``, it is logged and counted in the
summary; so is a sample a reward could not judge. ``.csv`` writes NaN as ``nan``; ``.json`` writes
``{"summary": {...}, "rows": [...]}`` with NaN as ``null``; ``.jsonl`` one row per line.
"""
from __future__ import annotations

import csv
import json
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

__all__ = ["ScoreError", "ImageRecord", "load_records", "list_images", "score_records", "write_scores", "run_score"]

log = logging.getLogger("mmrl.score")

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


class ScoreError(ValueError):
    """A problem with ``mmrl score``'s inputs (the prompts file, the folder, the output name)."""


@dataclass
class ImageRecord:
    image: str  # as written in the prompts file (or the file name relative to the folder)
    path: Path
    prompt: str | None
    metadata: dict = field(default_factory=dict)


def json_error_text(exc: json.JSONDecodeError) -> str:
    """``"Expecting value at column 1"``: json's message with its column (some messages, e.g. "Invalid control
    character at" and "Unterminated string starting at", end in "at" themselves: not doubled)."""
    msg = exc.msg[: -len(" at")] if exc.msg.endswith(" at") else exc.msg
    return f"{msg} at column {exc.colno}"


def _resolve(images_dir: Path, name: str) -> Path:
    path = Path(name).expanduser()
    return path if path.is_absolute() else images_dir / path


def list_images(images_dir: str | Path, recursive: bool = False) -> list[ImageRecord]:
    """Every image file under ``images_dir`` (by suffix), sorted, with no prompt."""
    root = Path(images_dir)
    if not root.is_dir():
        raise ScoreError(f"--images: {root} is not a directory")
    files = root.rglob("*") if recursive else root.iterdir()
    paths = sorted(p for p in files if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    return [ImageRecord(p.relative_to(root).as_posix(), p, None) for p in paths]


def load_records(prompts_file: str | Path, images_dir: str | Path) -> list[ImageRecord]:
    """Read a ``.csv`` (columns ``image,prompt``) or ``.jsonl`` prompts file; see the module docstring."""
    path, root = Path(prompts_file), Path(images_dir)
    if not path.is_file():
        raise ScoreError(f"--prompts: file not found: {path}")
    if not root.is_dir():
        raise ScoreError(f"--images: {root} is not a directory")
    records: list[ImageRecord] = []
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            columns = reader.fieldnames or []
            missing = [c for c in ("image", "prompt") if c not in columns]
            if missing:
                raise ScoreError(f"{path}: the CSV header must name the columns image and prompt; missing "
                                 f"{missing} (header: {columns})")
            for line, row in enumerate(reader, start=2):
                if not (row.get("image") or "").strip():
                    raise ScoreError(f"{path}, line {line}: empty image name")
                meta = {k: v for k, v in row.items() if k not in ("image", "prompt") and k is not None}
                records.append(ImageRecord(row["image"].strip(), _resolve(root, row["image"].strip()),
                                           row["prompt"], meta))
    elif suffix in (".jsonl", ".ndjson"):
        with path.open(encoding="utf-8") as handle:
            for line, text in enumerate(handle, start=1):
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text.rstrip("\r\n"))  # the line end is not part of a value
                except json.JSONDecodeError as exc:
                    raise ScoreError(f"{path}, line {line}: not valid JSON ({json_error_text(exc)})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("image"), str) or not obj["image"].strip():
                    raise ScoreError(f"{path}, line {line}: expected an object with a string \"image\" field")
                prompt = obj.get("prompt")
                if prompt is not None and not isinstance(prompt, str):
                    raise ScoreError(f"{path}, line {line}: \"prompt\" must be a string")
                meta = {k: v for k, v in obj.items() if k not in ("image", "prompt", "metadata")}
                if isinstance(obj.get("metadata"), dict):
                    meta.update(obj["metadata"])
                records.append(ImageRecord(obj["image"].strip(), _resolve(root, obj["image"].strip()), prompt, meta))
    else:
        raise ScoreError(f"--prompts: {path} must be a .csv (columns image,prompt) or a .jsonl file")
    if not records:
        raise ScoreError(f"{path}: no rows")
    return records


def _load_image(path: Path):
    """``(RGB PIL image, None)`` or ``(None, reason)``; 16-bit and float images scaled to 8 bits
    (:func:`mmrl.data.vlm.to_8bit`)."""
    from PIL import Image

    from mmrl.data.vlm import to_8bit

    if not path.is_file():
        return None, f"missing image file {path}"
    try:
        with Image.open(path) as image:
            image.load()
            return (image.copy() if image.mode == "RGB" else to_8bit(image).convert("RGB")), None
    except Exception as exc:
        return None, f"cannot read image {path}: {type(exc).__name__}: {exc}"


def _batches(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def score_records(reward: Callable, records: list[ImageRecord], *, batch_size: int = 32, workers: int = 4,
                  progress: Callable[[int, int], None] | None = None) -> tuple[list[dict], dict]:
    """Score ``records`` with ``reward`` in batches of ``batch_size`` (images decoded by ``workers``
    threads, the next batch while the current one is scored). Returns ``(rows, summary)``."""
    if batch_size < 1:
        raise ScoreError(f"--batch-size must be >= 1, got {batch_size}")
    if workers < 1:
        raise ScoreError(f"--workers must be >= 1, got {workers}")
    if getattr(reward, "needs_prompts", False) and any(r.prompt is None for r in records):
        raise ScoreError("these rewards need a prompt per image: pass --prompts FILE (.csv or .jsonl) with "
                         "image and prompt for every image")
    rows: list[dict] = []
    keys: list[str] = []
    failed_load = failed_score = 0
    start = time.perf_counter()
    chunks = list(_batches(records, batch_size))
    # the next batch is gathered by a thread of its own: gathered in the decoding pool, it would wait on its own
    # decodes behind itself when the pool has one thread
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mmrl-score-load") as pool, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmrl-score-prefetch") as prefetch:
        def load(chunk):
            return list(pool.map(lambda r: _load_image(r.path), chunk))

        upcoming = prefetch.submit(load, chunks[0]) if chunks else None
        done = 0
        for index, chunk in enumerate(chunks):
            loaded = upcoming.result()
            upcoming = prefetch.submit(load, chunks[index + 1]) if index + 1 < len(chunks) else None
            good = [i for i, (img, _) in enumerate(loaded) if img is not None]
            scores: dict = {}
            reasons: dict[int, str] = {}
            if good:
                images = [loaded[i][0] for i in good]
                prompts = [chunk[i].prompt for i in good]
                metadata = [dict(chunk[i].metadata) for i in good]
                out = reward(images, None if all(p is None for p in prompts) else prompts, metadata)
                scores = {k: v.tolist() for k, v in out.items()}
                for k in scores:
                    if k not in keys:
                        keys.append(k)
                info = getattr(reward, "last_info", {}) or {}
                nan = info.get("nan_samples") or (info.get("total") or {}).get("nan_samples") or {}
                reasons = {int(i): str(why) for i, why in nan.items()}
            pos = {i: j for j, i in enumerate(good)}
            for i, record in enumerate(chunk):
                row: dict[str, Any] = {"image": record.image, "prompt": record.prompt}
                error = loaded[i][1]
                if error is not None:
                    failed_load += 1
                    log.warning("%s", error)
                    row["_scores"] = {}
                else:
                    j = pos[i]
                    row["_scores"] = {k: v[j] for k, v in scores.items()}
                    main = row["_scores"].get("total", next(iter(row["_scores"].values()), float("nan")))
                    if j in reasons or not math.isfinite(main):
                        failed_score += 1
                        error = reasons.get(j, "the reward returned NaN")
                        log.warning("%s: not scored: %s", record.image, error)
                row["error"] = error or ""
                rows.append(row)
            done += len(chunk)
            if progress is not None:
                progress(done, len(records))
    for row in rows:  # every row gets every key (NaN where the image could not be read)
        values = row.pop("_scores")
        error = row.pop("error")
        row.update({k: float(values.get(k, float("nan"))) for k in keys})
        row["error"] = error
    seconds = time.perf_counter() - start
    summary = {
        "num_images": len(records),
        "num_scored": len(records) - failed_load - failed_score,
        "num_unreadable": failed_load,
        "num_unscored": failed_score,
        "score_keys": keys,
        "seconds": round(seconds, 3),
        "images_per_second": round(len(records) / seconds, 2) if seconds > 0 else None,
    }
    for k in keys:
        finite = [r[k] for r in rows if math.isfinite(r[k])]
        summary.setdefault("mean", {})[k] = sum(finite) / len(finite) if finite else None
    return rows, summary


def _json_value(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_scores(rows: list[dict], summary: Mapping, out: str | Path) -> Path:
    """Write ``rows`` as ``.csv``, ``.json`` (with the summary) or ``.jsonl``."""
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in (".csv", ".json", ".jsonl"):
        raise ScoreError(f"--out: {out} must end in .csv, .json or .jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    columns = ["image", "prompt", *summary.get("score_keys", []), "error"]
    if suffix == ".csv":
        with out.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            for row in rows:
                writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})
    elif suffix == ".json":
        clean = [{k: _json_value(row.get(k)) for k in columns} for row in rows]
        out.write_text(json.dumps({"summary": dict(summary), "rows": clean}, indent=1) + "\n", encoding="utf-8")
    else:
        with out.open("w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps({k: _json_value(row.get(k)) for k in columns}) + "\n")
    return out


def run_score(config: str | None, rewards: str | None, images: str, prompts: str | None, out: str, *,
              batch_size: int = 32, workers: int = 4, recursive: bool = False, quiet: bool = False) -> dict:
    """What ``mmrl score`` does; returns the summary (also printed, unless ``quiet``)."""
    import sys

    from mmrl.rewards import build_rewards
    from mmrl.rewards.remote import load_reward_spec

    try:
        spec = load_reward_spec(config, rewards)
    except FileNotFoundError:
        raise
    except ValueError as exc:
        raise ScoreError(str(exc)) from None
    records = load_records(prompts, images) if prompts else list_images(images, recursive=recursive)
    if not records:
        raise ScoreError(f"--images: no image files ({' '.join(IMAGE_SUFFIXES)}) in {images}")
    if Path(out).suffix.lower() not in (".csv", ".json", ".jsonl"):
        raise ScoreError(f"--out: {out} must end in .csv, .json or .jsonl")
    try:
        reward = build_rewards(spec)
    except (ValueError, TypeError) as exc:
        raise ScoreError(f"rewards: {exc}") from None
    text_only = [k for k, (r, _) in getattr(reward, "components", {}).items() if not getattr(r, "scores_images", True)]
    if text_only:
        raise ScoreError(f"rewards {text_only} judge text (a VLM's completions), not images; mmrl score scores images")
    from mmrl.rewards.remote import probe_remote_rewards

    probe_remote_rewards(reward)  # a dead reward server: one error now, not one per batch

    def progress(done: int, total: int) -> None:
        if not quiet:
            print(f"\rscored {done}/{total}", end="", file=sys.stderr, flush=True)

    rows, summary = score_records(reward, records, batch_size=batch_size, workers=workers, progress=progress)
    path = write_scores(rows, summary, out)
    if not quiet:
        print(file=sys.stderr)
        means = ", ".join(f"{k} {v:.4g}" for k, v in summary.get("mean", {}).items() if v is not None)
        print(f"scored {summary['num_scored']}/{summary['num_images']} images "
              f"({summary['num_unreadable']} unreadable, {summary['num_unscored']} not scored by the rewards) "
              f"in {summary['seconds']:.1f}s; means: {means or '-'}; wrote {path}")
    return summary
