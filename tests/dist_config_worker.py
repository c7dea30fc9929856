"""Run under torchrun by the multi-process tests: train a config on 2 gloo processes, save each replica's weights
(``rank<k>.safetensors``) and, on every rank, the data position it ended at (``rank<k>.json``). A first argument
``--fsdp`` shards the model with FSDP2 (``configs/accelerate/fsdp2.yaml``, see ``layout.select_fsdp2``) instead of
DDP; ``--deepspeed``: the test launched this under ``accelerate launch`` with the DeepSpeed ZeRO-2 config (the
process count may then be 1)."""

import json
import os
import sys

from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))

from layout import select_fsdp2  # noqa: E402
from mmrl.build import build_trainer  # noqa: E402
from mmrl.config import load_config  # noqa: E402


def main() -> None:
    args = sys.argv[1:]
    fsdp, deepspeed = args[0] == "--fsdp", args[0] == "--deepspeed"
    if fsdp:
        select_fsdp2()
    if fsdp or deepspeed:
        args = args[1:]
    out, config_path, *overrides = args
    config = load_config(config_path, [f"output_dir={out}/run", *overrides])
    trainer = build_trainer(config)
    assert trainer.accelerator.num_processes == int(os.environ["WORLD_SIZE"]), trainer.accelerator.num_processes
    assert trainer.sharded == fsdp and (trainer.engine is not None) == deepspeed
    trainer.train()
    rank = trainer.accelerator.process_index
    with trainer._full_weights():  # sharded: the whole tensors (a collective)
        weights = {k: v.detach().cpu().contiguous().clone()
                   for k, v in trainer.policy.named_trainable_parameters().items()}
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
