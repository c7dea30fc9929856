"""A picture of box-grounding evaluations side by side: for the first ``--count`` lines of ``mmrl eval``'s ``rec``
benchmark, the image with the exact box (cyan, a colour no shape has) and each evaluation's predicted box in its own colour, one column
per line; one row per evaluation folder, labelled with its Acc@0.5 over the whole set.

    python benchmarks/grounding_grid.py BASE_EVAL TRAINED_EVAL [...] --labels base trained --out grid.png

Each folder is an ``mmrl eval ... benchmarks=[rec]`` output (read by :func:`mmrl.eval.report.load_eval`; its
protocol names the data file whose folder holds the images); the folders must have scored the same lines.

Folders of ``benchmarks=[temporal_grounding]`` get a span chart instead: one row per clip, the frames it is shown at
(the first of each temporal step, at ``--fps``, as training reads it) and under them the clip's time axis with the
exact span (cyan) and each evaluation's answered span in its colour, labelled with its R1@0.5 over the whole set."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw

from mmrl.eval.report import load_eval

COLOURS = ["#ff4040", "#40e040", "#40a0ff", "#ffa020"]


#: The benchmark each picture draws and its headline metric.
HEADLINE = {"rec": "acc@0.5", "temporal_grounding": "r1@0.5"}


def _rows(folder: Path, benchmark: str = "rec") -> tuple[list[dict], Path, float]:
    """The ``benchmark`` rows of an evaluation folder (blind-control rows left out), the folder its media are
    relative to (the data file's) and its headline metric as ``summary.json`` reports it."""
    run = load_eval(folder)
    result = run.summary["benchmarks"].get(benchmark)
    if result is None:
        raise SystemExit(f"grounding_grid: {folder} has no {benchmark} benchmark")
    rows = [r for r in run.rows if r.get("benchmark") == benchmark and not r.get("blind")]
    return rows, Path(result["protocol"]["data_file"]).parent, result["metrics"][HEADLINE[benchmark]]


def _runs(folders: list[Path], count: int, benchmark: str) -> list[tuple[list[dict], Path, float]]:
    runs = [_rows(f, benchmark) for f in folders]
    ids = [r["id"] for r in runs[0][0][:count]]
    for rows, _, _ in runs[1:]:
        if [r["id"] for r in rows[:count]] != ids:
            raise SystemExit("grounding_grid: the evaluations did not score the same lines in the same order")
    return runs


def benchmark_of(folder: Path) -> str:
    """``rec`` or ``temporal_grounding``: the one of them the folder's ``summary.json`` holds (``rec`` first)."""
    names = load_eval(folder).summary["benchmarks"]
    for name in HEADLINE:
        if name in names:
            return name
    raise SystemExit(f"grounding_grid: {folder} has neither a rec nor a temporal_grounding benchmark")


def span_grid(folders: list[Path], labels: list[str], count: int, *, fps: float = 2.0, tile: int = 56,
              bar: int = 8) -> Image.Image:
    """One row per clip: its frames at the first frame of each temporal step, then the time axis (the strip's width
    is the clip's duration) with the exact span in cyan and one bar per evaluation in its colour."""
    from mmrl.data.video import FRAME_FACTOR, read_video

    runs = _runs(folders, count, "temporal_grounding")
    clips = [read_video(runs[0][1] / row["video"], fps=fps) for row in runs[0][0][:count]]
    label_width, gap = 150, 6
    steps = len(clips[0].indices) // FRAME_FACTOR  # the temporal steps (frame pairs) the model is shown
    width = steps * tile
    row_height = tile + (1 + len(runs)) * (bar + 2) + gap
    canvas = Image.new("RGB", (label_width + width, 18 * len(runs) + count * row_height), "black")
    draw = ImageDraw.Draw(canvas)
    for k, ((_, _, headline), label) in enumerate(zip(runs, labels)):
        draw.text((6, 4 + 18 * k), f"{label}: R1@0.5 {headline:.3f}", fill=COLOURS[k % len(COLOURS)])
    top = 18 * len(runs)
    for j, (row, clip) in enumerate(zip(runs[0][0][:count], clips)):
        y = top + j * row_height
        for t in range(steps):
            frame = Image.fromarray(clip.frames[FRAME_FACTOR * t].permute(1, 2, 0).numpy())
            frame = frame.resize((tile, tile), Image.NEAREST)
            canvas.paste(frame, (label_width + t * tile, y))
        draw.text((6, y + tile // 2 - 6), str(row["id"]).rsplit("-", 1)[-1], fill="white")
        spans = [("cyan", row["target"])] + [(COLOURS[k % len(COLOURS)], rows[j]["verdict"].get("pred"))
                                             for k, (rows, _, _) in enumerate(runs)]
        for b, (colour, span) in enumerate(spans):
            y0 = y + tile + 2 + b * (bar + 2)
            draw.rectangle([label_width, y0, label_width + width - 1, y0 + bar - 1], fill=(40, 40, 40))
            if span:
                x0, x1 = (label_width + round(min(max(v / clip.duration, 0.0), 1.0) * (width - 1)) for v in span)
                draw.rectangle([x0, y0, max(x0, x1), y0 + bar - 1], fill=colour)
    return canvas


def grid(folders: list[Path], labels: list[str], count: int, scale: int = 2) -> Image.Image:
    runs = _runs(folders, count, "rec")
    first = runs[0][0][0]
    size = Image.open(runs[0][1] / first["image"]).size[0] * scale
    label_width = 150
    canvas = Image.new("RGB", (label_width + count * (size + 4), len(runs) * (size + 4)), "black")
    draw = ImageDraw.Draw(canvas)
    for k, ((rows, root, accuracy), label) in enumerate(zip(runs, labels)):
        y = k * (size + 4)
        colour = COLOURS[k % len(COLOURS)]
        draw.text((6, y + size // 2 - 12), f"{label}\nAcc@0.5 {accuracy:.3f}", fill=colour)
        for j, row in enumerate(rows[:count]):
            tile = Image.open(root / row["image"]).convert("RGB").resize((size, size), Image.NEAREST)
            pen = ImageDraw.Draw(tile)
            pen.rectangle([v * scale for v in row["target"]], outline="cyan", width=1)
            pred = row["verdict"].get("pred")
            if pred:
                pen.rectangle([v * scale for v in pred], outline=colour, width=2)
            canvas.paste(tile, (label_width + j * (size + 4), y))
    return canvas


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--labels", nargs="+")
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--fps", type=float, default=2.0, help="temporal_grounding: the rate the clips are read at "
                                                                "(the evaluation's generation.video_fps)")
    parser.add_argument("--out", type=Path, default=Path("grounding_grid.png"))
    args = parser.parse_args(argv)
    labels = args.labels or [f.name for f in args.folders]
    if len(labels) != len(args.folders):
        parser.error("one label per folder")
    if benchmark_of(args.folders[0]) == "temporal_grounding":
        span_grid(args.folders, labels, args.count, fps=args.fps).save(args.out)
    else:
        grid(args.folders, labels, args.count).save(args.out)
    print(json.dumps({"grid": str(args.out), "rows": labels, "lines": args.count}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
