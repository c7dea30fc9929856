"""Run by test_trainer.py under torchrun: train 2 updates on 2 gloo processes, save each replica's weights."""

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from mmrl.build import build_trainer
from mmrl.config import load_config

TINY_RECIPE = str(Path(__file__).resolve().parents[1] / "configs" / "tiny" / "flow_grpo.yaml")


def main() -> None:
    out, tiny_path, *overrides = sys.argv[1:]
    config = load_config(TINY_RECIPE, [f"output_dir={out}/run", f"model.pretrained={tiny_path}", "train.steps=2",
                                "logging.eval_every=0", "optim.lr=1e-2", "algorithm.clip_low=0.01", *overrides])
    trainer = build_trainer(config)
    assert trainer.accelerator.num_processes == 2, trainer.accelerator.num_processes
    trainer.train()
    weights = {k: v.detach().cpu().contiguous() for k, v in trainer.policy.named_trainable_parameters().items()}
    save_file(weights, f"{out}/rank{trainer.accelerator.process_index}.safetensors")
    trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # every file is written and closed: leave without the interpreter's teardown, where a C++ worker thread still
    # joinable at static destruction aborted a rank once in a loaded CI run ("terminate called without an active
    # exception", SIGABRT after the results were on disk)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
