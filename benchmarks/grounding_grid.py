"""A picture of box-grounding evaluations side by side: for the first ``--count`` lines of ``mmrl eval``'s ``rec``
benchmark, the image with the exact box (cyan, a colour no shape has) and each evaluation's predicted box in its own colour, one column
per line; one row per evaluation folder, labelled with its Acc@0.5 over the whole set.

    python benchmarks/grounding_grid.py BASE_EVAL TRAINED_EVAL [...] --labels base trained --out grid.png

Each folder is an ``mmrl eval ... benchmarks=[rec]`` output (``samples.jsonl``, ``protocol.json`` naming the data
file whose folder holds the images); the folders must have scored the same lines."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = ["#ff4040", "#40e040", "#40a0ff", "#ffa020"]


def _rows(folder: Path) -> tuple[list[dict], Path, float]:
    protocol = json.loads((folder / "protocol.json").read_text())
    data_file = Path(protocol["benchmarks"]["rec"]["data_file"])
    rows = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["benchmark"] == "rec" and not r.get("blind")]
    accuracy = sum(r["scores"]["acc@0.5"] for r in rows) / max(len(rows), 1)
    return rows, data_file.parent, accuracy


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
