#!/usr/bin/env python
"""The prompt-shared log-prob forward against one full row per sample, side by side (``mmrl bench prompt-sharing``).

A VLM GRPO minibatch holds several completions of the same prompt (image tokens included). With
``model.share_prompt_prefix: true`` (the default) the policy's log-prob forward runs each distinct prompt of the
minibatch once and the completions on its KV cache; with ``false`` every sample is one full prompt + completion row,
as TRL and verl do. Both are the policy's own ``logprobs`` on the same rollout and the same minibatch:

* a random mid-size Qwen2.5-VL (``overhead.mid_size_vlm``: 8 decoder layers of 512 by default) with LoRA r8, as
  ``configs/tiny/vlm_grounding.yaml`` trains it, on ShapeWorld grounding prompts;
* one rollout of ``--prompts`` x ``--group`` completions (``--max-new-tokens``), then ``--repeats`` rounds, the two
  layouts alternated within each round: the gradient forward + backward of one random minibatch of ``--batch``
  samples (as the trainer draws them), and the no-grad forward of the same minibatch (old / reference log-probs);
* the medians of each, their ratio (full rows over shared), the peak bytes of the tensors each creates (``common.
  LiveBytes``), the token positions each puts through the language model, and the largest log-prob difference
  between the two layouts (float rounding: the same computation in another order).

Prints one JSON line and writes ``benchmarks/results/prompt_sharing.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import VLM_RECIPE, finish, mid_vlm_arguments, peak_bytes, versions  # noqa: E402  (the script folder)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mid_vlm_arguments(ap, "prompt_sharing.json")
    ap.add_argument("--batch", type=int, default=8, help="samples per minibatch (drawn at random from the rollout)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from overhead import mid_size_vlm

    from mmrl.build import build_trainer
    from mmrl.cli import quiet_libraries
    from mmrl.config import load_config

    quiet_libraries()
    with tempfile.TemporaryDirectory(prefix="mmrl_prompt_sharing_") as tmp:
        model = mid_size_vlm(Path(tmp), hidden=args.hidden, layers=args.layers)
        overrides = [f"output_dir={Path(tmp) / 'run'}", "resume=null", f"seed={args.seed}",
                     f"model.pretrained={model}", "data.dataset=shapeworld:train:64:grounding",
                     f"data.prompts_per_step={args.prompts}", f"data.group_size={args.group}",
                     f"generation.max_new_tokens={args.max_new_tokens}", "logging.eval_every=0",
                     "logging.save_every=0", "logging.progress_bar=false", "logging.tensorboard=false",
                     "eval.every=0", *args.set]
        trainer = build_trainer(load_config(str(VLM_RECIPE), overrides))
        policy = trainer.policy
        items = trainer.prompts.next_batch(args.prompts, rank=0, world=1)
        generator = torch.Generator().manual_seed(args.seed)
        rollout = policy.rollout(items, args.group, generator=generator)
        n = len(rollout)
        params = policy.trainable_parameters()

        language = policy.base_model.model.language_model
        positions: list[int] = []
        language.register_forward_pre_hook(
            lambda module, a, kw: positions.append(kw["inputs_embeds"].shape[0] * kw["inputs_embeds"].shape[1]),
            with_kwargs=True)

        def gradient_pass(index):
            out = policy.logprobs(rollout, index)
            (out.logps * rollout.mask[index]).sum().backward()
            return out.logps.detach()

        def no_grad_pass(index):
            with torch.no_grad():
                return policy.logprobs(rollout, index).logps

        layouts = {"shared": True, "full_rows": False}
        times = {(layout, kind): [] for layout in layouts for kind in ("grad", "no_grad")}
        peaks, tokens, logps, distinct = {}, {}, {}, []
        for r in range(args.repeats + 1):  # round 0 warms up
            index = torch.randperm(n, generator=generator)[:args.batch]
            if r:
                distinct.append(len(set(rollout.prompt_index[index].tolist())))
            order = list(layouts) if r % 2 == 0 else list(layouts)[::-1]
            for layout in order:
                policy.share_prompt_prefix = layouts[layout]
                for kind, fn in (("grad", gradient_pass), ("no_grad", no_grad_pass)):
                    positions.clear()
                    start = time.perf_counter()
                    value = fn(index)
                    elapsed = time.perf_counter() - start
                    for p in params:
                        p.grad = None
                    if r:
                        times[(layout, kind)].append(elapsed)
                    if r == 1:
                        tokens[(layout, kind)] = sum(positions)
                        logps[(layout, kind)] = (value, rollout.mask[index].bool())
            if r == 1:
                for layout in order:
                    policy.share_prompt_prefix = layouts[layout]
                    _, peaks[layout] = peak_bytes(gradient_pass, index)
                    for p in params:
                        p.grad = None
        policy.share_prompt_prefix = True

    median = {key: statistics.median(v) for key, v in times.items()}
    (a, mask), (b, _) = logps[("shared", "grad")], logps[("full_rows", "grad")]
    diff = float((a - b)[mask].abs().max())
    line = {
        "bench": "prompt-sharing",
        "speedup_grad": median[("full_rows", "grad")] / median[("shared", "grad")],
        "speedup_no_grad": median[("full_rows", "no_grad")] / median[("shared", "no_grad")],
        "peak_bytes_ratio_full_over_shared": peaks["full_rows"] / max(peaks["shared"], 1),
        "max_abs_logp_difference": diff,
        "median_s": {f"{layout}/{kind}": v for (layout, kind), v in median.items()},
        "lm_token_positions": {f"{layout}/{kind}": v for (layout, kind), v in tokens.items()},
        "peak_mib_per_sample": {layout: v / 2**20 / args.batch for layout, v in peaks.items()},
        "prompt_tokens": int(rollout.prompt_ids.shape[1]), "completion_width": int(rollout.completion_ids.shape[1]),
        "distinct_prompts_per_round": distinct,  # the prompts each timed round's random minibatch holds
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "parameters": sum(p.numel() for p in policy.base_model.parameters()),
        "versions": versions(),
        "ok": diff < 1e-3,
    }
    return finish(line, args.out)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
