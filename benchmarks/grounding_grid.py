"""A picture of box-grounding evaluations side by side: for the first ``--count`` lines of ``mmrl eval``'s ``rec``
benchmark, the image with the exact box (cyan, a colour no shape has) and each evaluation's predicted box in its own colour, one column
per line; one row per evaluation folder, labelled with its Acc@0.5 over the whole set.

    python benchmarks/grounding_grid.py BASE_EVAL TRAINED_EVAL [...] --labels base trained --out grid.png

Each folder is an ``mmrl eval ... benchmarks=[rec]`` output (read by :func:`mmrl.eval.report.load_eval`; its
protocol names the data file whose folder holds the images); the folders must have scored the same lines."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw

from mmrl.eval.report import load_eval

COLOURS = ["#ff4040", "#40e040", "#40a0ff", "#ffa020"]


def _rows(folder: Path) -> tuple[list[dict], Path, float]:
    """The ``rec`` rows of an evaluation folder (blind-control rows left out), the folder its images are relative to
    (the data file's) and its Acc@0.5 as ``summary.json`` reports it."""
    run = load_eval(folder)
    result = run.summary["benchmarks"].get("rec")
    if result is None:
        raise SystemExit(f"grounding_grid: {folder} has no rec benchmark")
    rows = [r for r in run.rows if r.get("benchmark") == "rec" and not r.get("blind")]
    return rows, Path(result["protocol"]["data_file"]).parent, result["metrics"]["acc@0.5"]


def grid(folders: list[Path], labels: list[str], count: int, scale: int = 2) -> Image.Image:
    runs = [_rows(f) for f in folders]
    ids = [r["id"] for r in runs[0][0][:count]]
    for rows, _, _ in runs[1:]:
        if [r["id"] for r in rows[:count]] != ids:
            raise SystemExit("grounding_grid: the evaluations did not score the same lines in the same order")
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
    parser.add_argument("--out", type=Path, default=Path("grounding_grid.png"))
    args = parser.parse_args(argv)
    labels = args.labels or [f.name for f in args.folders]
    if len(labels) != len(args.folders):
        parser.error("one label per folder")
    grid(args.folders, labels, args.count).save(args.out)
    print(json.dumps({"grid": str(args.out), "rows": labels, "lines": args.count}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
