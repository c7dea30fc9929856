"""Run under torchrun by the multi-process tests: train a config on 2 gloo processes, save each replica's weights
(``rank<k>.safetensors``) and, on every rank, the data position it ended at (``rank<k>.json``)."""

import json
import os
import sys

import torch
from safetensors.torch import save_file

from mmrl.build import build_trainer
from mmrl.config import load_config


def main() -> None:
    out, config_path, *overrides = sys.argv[1:]
    config = load_config(config_path, [f"output_dir={out}/run", *overrides])
    trainer = build_trainer(config)
    assert trainer.accelerator.num_processes == 2, trainer.accelerator.num_processes
    trainer.train()
    rank = trainer.accelerator.process_index
    weights = {k: v.detach().cpu().contiguous() for k, v in trainer.policy.named_trainable_parameters().items()}
    save_file(weights, f"{out}/rank{rank}.safetensors")
    state = {"data": trainer.prompts.state_dict(), "skipped": dict(getattr(trainer.policy, "skipped", {}))}
    if hasattr(trainer.policy, "step_noise_levels"):
        state["noise_levels"] = trainer.policy.step_noise_levels.tolist()
    with open(f"{out}/rank{rank}.json", "w") as handle:
        json.dump(state, handle)
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
