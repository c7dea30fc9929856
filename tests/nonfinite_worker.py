"""Run by test_multiprocess.py on 2 processes under ``accelerate launch`` (ZeRO-3): one update of the tiny flow
recipe in which the FIRST micro-step's loss is made NaN (MODE=nan), or multiplied by 0 (MODE=zero: the same
micro-step contributing nothing through the normal path). The loop must skip the NaN one on every process (a zero
contribution through the same backward, so the collectives stay in step) and train on the rest: the two modes
must give the same update. Writes ``OUT/rank<k>.pt``: the update's metrics and the trainable weights after it."""

import os
import sys
from pathlib import Path

import torch

import mmrl.trainer as trainer_module
from mmrl.build import build_trainer
from mmrl.config import load_config

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    out, model = sys.argv[1:3]
    original, calls = trainer_module.policy_loss, []

    def first_loss_nan(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            result.loss = result.loss * (float("nan") if os.environ["MODE"] == "nan" else 0.0)
        return result

    trainer_module.policy_loss = first_loss_nan
    config = load_config(str(REPO / "configs" / "tiny" / "flow_grpo.yaml"), [
        f"output_dir={out}/run", f"model.pretrained={model}", "train.steps=1", "sampling.num_steps=4",
        "sampling.eval_num_steps=4", "sampling.max_sequence_length=16", "data.prompts_per_step=1",
        "data.group_size=4", "train.batch_size=2", "train.gradient_accumulation_steps=2", "logging.eval_every=0",
        "logging.save_every=0", "logging.progress_bar=false", "logging.tensorboard=false"])
    trainer = build_trainer(config)
    metrics = trainer.step()
    with trainer._full_weights():
        weights = torch.cat([p.detach().float().flatten() for p in trainer.policy.trainable_parameters()]).clone()
    torch.save({"metrics": metrics, "weights": weights, "zero3": trainer.zero3},
               f"{out}/rank{trainer.accelerator.process_index}.pt")
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
