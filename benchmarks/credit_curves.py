"""Outcome vs dense credit on the same tiny setup and seeds: reward per update and per second of wall clock.

Runs the tiny TP-GRPO recipe (tiny SD3, CPS noise on a window of 9 of 10 steps, brightness reward) once per
credit method -- outcome (Flow-GRPO), step_gain (DenseGRPO-style), turning_point (TP-GRPO), cosine (CoCA) --
with identical seeds, and writes into ``--out DIR`` (default ``runs/credit_curves``, under the working directory)

    DIR/credit_curves.csv   method, step, reward, wall-clock seconds, extra NFE, reward calls
    DIR/credit_curves.png   reward vs update and reward vs wall clock

    python benchmarks/credit_curves.py [--steps 15] [--methods outcome step_gain turning_point cosine] [--out DIR]

The committed results are rewritten only when asked for: ``--out benchmarks/results``.

This is a benchmark, not a test: on a random tiny model the curves are noisy; read them with their cost.
"""

from __future__ import annotations

import argparse
import csv
import json
import tempfile
import time
from pathlib import Path

import torch

from mmrl.build import build_trainer
from mmrl.config import load_config

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"  # the committed results: written only with an explicit --out
DEFAULT_OUT = Path("runs") / "credit_curves"


def run(method: str, steps: int, seed: int, workdir: Path) -> list[dict]:
    config = load_config(REPO / "configs/tiny/tp_grpo.yaml", [
        f"output_dir={workdir / method}", f"algorithm.credit={method}", f"train.steps={steps}", f"seed={seed}",
        "logging.eval_every=0", "logging.save_every=0", "logging.progress_bar=false", "logging.tensorboard=false",
        "resume=null",
    ])
    torch.manual_seed(seed)
    trainer = build_trainer(config)
    samples = config.data.prompts_per_step * config.data.group_size  # final-image reward calls per update
    rows, start = [], time.perf_counter()
    while trainer.update < steps:
        metrics = trainer.step()
        rows.append({"method": method, "step": int(metrics["step"]), "reward": metrics["reward/mean"],
                     "wall_s": time.perf_counter() - start, "extra_nfe": metrics.get("cost/extra_nfe", 0.0),
                     "reward_calls": samples + metrics.get("cost/reward_calls", 0.0)})
        print(json.dumps(rows[-1]))
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        by_step.plot([r["step"] for r in mine], [r["reward"] for r in mine], marker="o", ms=3, label=method)
        by_time.plot([r["wall_s"] for r in mine], [r["reward"] for r in mine], marker="o", ms=3, label=method)
    by_step.set(xlabel="update", ylabel="mean reward (brightness)", title="reward per update")
    by_time.set(xlabel="wall clock (s)", ylabel="mean reward (brightness)", title="reward per second")
    by_step.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", nargs="+", default=["outcome", "step_gain", "turning_point", "cosine"])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"folder for credit_curves.csv and .png (default: {DEFAULT_OUT}); the committed "
                             f"results need an explicit --out benchmarks/results")
    args = parser.parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as workdir:
        for method in args.methods:
            rows += run(method, args.steps, args.seed, Path(workdir))
    with open(out / "credit_curves.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out / "credit_curves.png")
    print(f"wrote {out / 'credit_curves.csv'} and {out / 'credit_curves.png'}")
    print(f"{'method':<14} {'first 3':>9} {'last 3':>9} {'wall s':>8} {'extra NFE/upd':>14}")
    for method in args.methods:
        mine = [r for r in rows if r["method"] == method]
        first = sum(r["reward"] for r in mine[:3]) / 3
        last = sum(r["reward"] for r in mine[-3:]) / 3
        print(f"{method:<14} {first:9.4f} {last:9.4f} {mine[-1]['wall_s']:8.1f} {mine[0]['extra_nfe']:14.0f}")


if __name__ == "__main__":
    main()
