"""Outcome vs dense credit on ShapeWorld at equal wall-clock time: training reward and the held-out GenEval-style
score per second of training, not only per update.

Each credit method -- outcome (Flow-GRPO), step_gain (DenseGRPO-style), turning_point (TP-GRPO), cosine (CoCA) --
trains the shipped ShapeWorld SD3 base with ``configs/shapes/tp_grpo.yaml`` (CPS noise on a window of 9 of 10
steps, ODE on the last, the ShapeWorld partial reward), the credit the only difference, with the same seeds, for the
same wall-clock budget (``--seconds``). A dense method pays for its ODE completions (extra transformer calls and
reward calls) and so gets fewer updates in the same time. At ``--evals`` equally spaced moments of the budget the
clock stops and the live weights are scored on the first ``--eval-limit`` held-out prompts (``shapeworld@heldout``,
2 images per prompt, 20 steps: ``mmrl eval``'s scoring through :func:`mmrl.eval.runner.evaluate_policy`), so every
method is judged at the same training seconds. Writes into ``--out DIR`` (default ``runs/credit_curves``):

    DIR/credit_curves.csv      method, step, reward, wall-clock seconds, extra NFE, reward calls (one row per update)
    DIR/credit_heldout.csv     method, seconds, update, held-out overall and per category
    DIR/credit_curves.png      reward vs update, reward vs wall clock, held-out score vs wall clock

    python benchmarks/credit_curves.py [--seconds 300] [--methods outcome step_gain turning_point] [--out DIR]

Any recipe and any variants: ``--recipe configs/shapes/vlm_grounding_grpo.yaml --benchmark rec --metric miou
--blind --methods outcome vig "blockwise={scopes: {iou: answer, think_answer_format: all}}"`` compares VLM credit
variants on ShapeWorld box grounding (held-out data from the recipe's ``eval.options``), with the blind control's
real - blind differences (``blind/<metric>``) in the held-out CSV. A method is ``outcome`` (no variant), a variant
name, or ``name={options as YAML}``.

The committed results are rewritten only when asked for: ``--out benchmarks/results``. This is a benchmark, not a
test: one seed, so read the differences with the spread between evaluations.
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
RECIPE = REPO / "configs" / "shapes" / "tp_grpo.yaml"


def heldout(trainer, config, planned, label: str, workdir: Path, benchmark: str = "shapeworld@heldout") -> dict:
    """The held-out metrics of the trainer's live weights (clock stopped by the caller), flattened to one row:
    ShapeWorld's ``overall`` and ``tag/<category>``, else every scalar metric of ``benchmark`` and, with the blind
    control, ``blind/<metric>`` (real - blind). ``planned``: :func:`mmrl.eval.runner.plan_training_eval` of
    ``config``, read once per run."""
    from mmrl.eval.runner import evaluate_policy

    summary = evaluate_policy(trainer.policy, config, trainer.update, workdir / "eval" / label, planned=planned,
                              echo=lambda _: None)
    result = summary["benchmarks"][benchmark]
    metrics = result["metrics"]
    if "per_tag" in metrics:
        return {"overall": metrics["overall"], **{f"tag/{k}": v for k, v in metrics["per_tag"].items()}}
    row = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    for name, paired in (result.get("blind_control") or {}).get("metrics", {}).items():
        row[f"blind/{name}"] = paired["delta"]
    return row


def method_variants(method: str) -> str:
    """The ``algorithm.variants`` override of a method: ``outcome`` (none), ``name`` or ``name={YAML options}``."""
    if method == "outcome":
        return "algorithm.variants=[]"
    name, _, options = method.partition("=")
    if not options:
        return f"algorithm.variants=[{name}]"
    return f"algorithm.variants=[{{name: {name}, {options.strip()[1:-1]}}}]"


def run(method: str, seconds: float, evals: int, eval_limit: int, seed: int, workdir: Path, recipe: Path,
        pretrained: str | None, benchmark: str = "shapeworld@heldout", blind: bool = False
        ) -> tuple[list[dict], list[dict]]:
    label = method.partition("=")[0]
    overrides = [f"output_dir={workdir / label}", method_variants(method), "train.steps=100000",
                 f"seed={seed}", "logging.eval_every=0", "logging.save_every=0", "logging.progress_bar=false",
                 "logging.tensorboard=false", "resume=null", "eval.every=0", f"eval.benchmarks=[{benchmark}]",
                 f"eval.limit={eval_limit}"]
    if pretrained:
        overrides.append(f"model.pretrained={pretrained}")
    if blind:
        overrides.append("eval.options.blind=true")
    config = load_config(recipe, overrides)
    from mmrl.eval.runner import plan_training_eval

    planned = plan_training_eval(config)
    torch.manual_seed(seed)
    trainer = build_trainer(config)
    samples = config.data.prompts_per_step * config.data.group_size  # final-image reward calls per update
    marks = [seconds * (k + 1) / evals for k in range(evals)]
    rows, scores, spent = [], [], 0.0

    def score(at: float) -> None:  # ``at``: the budget mark; ``trained_s``: the training seconds really spent
        metrics = heldout(trainer, config, planned, f"{label}-{len(scores)}", workdir, benchmark)
        scores.append({"method": label, "seconds": round(at, 1), "trained_s": round(spent, 1),
                       "update": trainer.update, **metrics})
        print(json.dumps(scores[-1]), flush=True)

    score(0.0)
    while marks:
        start = time.perf_counter()
        metrics = trainer.step()
        spent += time.perf_counter() - start
        rows.append({"method": label, "step": int(metrics["step"]), "reward": metrics["reward/mean"],
                     "wall_s": round(spent, 3), "extra_nfe": metrics.get("cost/extra_nfe", 0.0),
                     "reward_calls": samples + metrics.get("cost/reward_calls", 0.0)})
        print(json.dumps(rows[-1]), flush=True)
        while marks and spent >= marks[0]:
            score(marks.pop(0))
    return rows, scores


def plot(rows: list[dict], scores: list[dict], path: Path, metric: str = "overall") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time, held) = plt.subplots(1, 3, figsize=(15, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        by_step.plot([r["step"] for r in mine], [r["reward"] for r in mine], marker="o", ms=2, label=method)
        by_time.plot([r["wall_s"] for r in mine], [r["reward"] for r in mine], marker="o", ms=2, label=method)
        evals = [s for s in scores if s["method"] == method]
        held.plot([s["trained_s"] for s in evals], [s[metric] for s in evals], marker="o", label=method)
    by_step.set(xlabel="update", ylabel="mean training reward", title="reward per update")
    by_time.set(xlabel="training wall clock (s)", ylabel="mean training reward", title="reward per second")
    held.set(xlabel="training wall clock (s)", ylabel=f"held-out {metric}", title="held-out")
    by_step.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_csv(path: Path, rows: list[dict]) -> None:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--seconds", type=float, default=300.0, help="training wall-clock budget per method")
    parser.add_argument("--evals", type=int, default=3, help="held-out evaluations within the budget (+ one at 0 s)")
    parser.add_argument("--eval-limit", type=int, default=36, help="held-out prompts per evaluation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", nargs="+", default=["outcome", "step_gain", "turning_point"])
    parser.add_argument("--recipe", type=Path, default=RECIPE, help=f"the training config (default: {RECIPE})")
    parser.add_argument("--pretrained", default=None, help="model.pretrained override (default: the recipe's)")
    parser.add_argument("--benchmark", default="shapeworld@heldout", help="the held-out benchmark (mmrl eval name)")
    parser.add_argument("--metric", default="overall", help="the held-out metric plotted and summarised")
    parser.add_argument("--blind", action="store_true", help="VLM benchmarks: also the blind control (real - blind)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"folder for the CSVs and the PNG (default: {DEFAULT_OUT}); the committed results need "
                             f"an explicit --out benchmarks/results")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.evals < 1 or args.eval_limit < 1:
        parser.error("--seconds must be > 0, --evals and --eval-limit >= 1")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    scores: list[dict] = []
    with tempfile.TemporaryDirectory() as workdir:
        for method in args.methods:
            mine, held = run(method, args.seconds, args.evals, args.eval_limit, args.seed, Path(workdir),
                             args.recipe, args.pretrained, args.benchmark, args.blind)
            rows += mine
            scores += held
    write_csv(out / "credit_curves.csv", rows)
    write_csv(out / "credit_heldout.csv", scores)
    plot(rows, scores, out / "credit_curves.png", args.metric)
    print(f"wrote {out / 'credit_curves.csv'}, {out / 'credit_heldout.csv'} and {out / 'credit_curves.png'}")
    print(f"{'method':<14} {'updates':>8} {'reward first 3':>15} {'last 3':>8} {'held-out 0 s':>13} "
          f"{'at ' + format(args.seconds, 'g') + ' s':>10} {'extra NFE/upd':>14}")
    for method in (m.partition("=")[0] for m in args.methods):
        mine = [r for r in rows if r["method"] == method]
        held = [s for s in scores if s["method"] == method]
        first = sum(r["reward"] for r in mine[:3]) / len(mine[:3])
        last = sum(r["reward"] for r in mine[-3:]) / len(mine[-3:])
        print(f"{method:<14} {len(mine):8d} {first:15.4f} {last:8.4f} {held[0][args.metric]:13.4f} "
              f"{held[-1][args.metric]:10.4f} {mine[0]['extra_nfe']:14.0f}")


if __name__ == "__main__":
    main()
