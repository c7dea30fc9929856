#!/usr/bin/env python
"""Run the official Flow-GRPO ``scripts/train_sd3.py`` from a checkout, unmodified, and time its epochs.

The peer side of ``benchmarks/flow_grpo_bench.py --flow-grpo PATH``. Nothing of Flow-GRPO is copied into mmrl:
this runner executes the checkout's own script (``runpy``) with its own config (``config/grpo.py:compressibility``)
and ``--config.*`` flags that point it at a local model and a prompt folder, and only observes it:

* epoch times: the script logs ``{"epoch": ..., "reward_*": ...}`` once per epoch, after that epoch's sampling and
  rewards; the interval between two such logs is one whole epoch (training of the first, sampling of the next).
  ``wandb`` runs disabled, and ``wandb.log`` is wrapped after ``wandb.init`` to take the time stamps;
* the work: ``SD3Transformer2DModel.forward`` is wrapped in this process to count the rows (samples x CFG halves)
  through the transformer with and without grad and the text tokens it sees, and a global optimizer hook counts
  optimizer steps, per epoch (nothing they compute changes).

After ``--epochs`` timed epochs (the first interval is warm-up and dropped by the caller) it runs one more epoch
under ``common.LiveBytes`` (the peak bytes of the tensors the epoch creates in the main thread), then prints one
line ``FLOW_GRPO_RESULT {json}`` and exits. Requirements beyond mmrl's: ``pip install ml_collections absl-py wandb``.

    python benchmarks/flow_grpo_official.py --checkout PATH --model DIR --prompts DIR --epochs N --threads T \\
        -- [--config.KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkout", required=True)
    ap.add_argument("--epochs", type=int, required=True, help="epoch intervals to record (then exit)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("flags", nargs="*", help="the script's own flags (after --)")
    args = ap.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    here = os.path.dirname(os.path.abspath(__file__))  # benchmarks/ (common.py), before leaving the folder
    sys.path.insert(0, args.checkout)
    os.chdir(args.checkout)

    import torch
    import wandb
    from diffusers import SD3Transformer2DModel

    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.append(here)  # after the checkout's own modules
    from common import LiveBytes
    stamps: list[float] = []
    work: list[dict] = []  # the counts between one epoch log and the next
    current = {"rows_grad": 0, "rows_no_grad": 0, "calls_grad": 0, "calls_no_grad": 0, "optimizer_steps": 0}
    forward = SD3Transformer2DModel.forward
    shapes: dict = {}  # of the transformer's inputs (one latent, the text tokens)

    def counted_forward(self, *a, **k):  # observes every transformer call (PEFT calls the class's forward)
        x = k.get("hidden_states", a[0] if a else None)
        mode = "grad" if torch.is_grad_enabled() else "no_grad"
        current[f"rows_{mode}"] += int(x.shape[0])
        current[f"calls_{mode}"] += 1
        text = k.get("encoder_hidden_states")
        shapes.setdefault("latent", list(x.shape[1:]))
        shapes.setdefault("text_tokens", None if text is None else int(text.shape[1]))
        return forward(self, *a, **k)

    SD3Transformer2DModel.forward = counted_forward
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(
        lambda *_: current.__setitem__("optimizer_steps", current["optimizer_steps"] + 1))

    tracker = LiveBytes()

    def on_log(original):
        def log(data, *a, **k):
            if "epoch" in data and "inner_epoch" not in data:  # once per epoch, after its sampling and rewards
                stamps.append(time.perf_counter())
                work.append(dict(current))
                current.update({key: 0 for key in current})
                if len(stamps) == args.epochs + 1:  # one more epoch, untimed, under the tensor tracker
                    tracker.__enter__()
                elif len(stamps) > args.epochs + 1:
                    tracker.__exit__(None, None, None)
                    # interval i: epoch i's training and epoch i + 1's sampling, i.e. one whole epoch of work
                    intervals = [b - a for a, b in zip(stamps, stamps[1:])][:args.epochs]
                    print("FLOW_GRPO_RESULT " + json.dumps({"epoch_s": intervals, "work": work[1:args.epochs + 1],
                                                            "shapes": shapes, "peak_epoch_bytes": tracker.peak}),
                          flush=True)
                    os._exit(0)
            return original(data, *a, **k)
        return log

    init = wandb.init

    def patched_init(*a, **k):
        run = init(*a, **k)
        wandb.log = on_log(wandb.log)
        return run

    wandb.init = patched_init
    script = os.path.join(args.checkout, "scripts", "train_sd3.py")
    sys.argv = [script, *args.flags]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
