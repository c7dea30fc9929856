#!/usr/bin/env python
"""One Flow-GRPO update: mmrl's trainer vs a plain loop written the way such loops usually are, with and without CFG.

Workload (the Flow-GRPO epoch of issue 12): the tiny random SD3 (``tiny:sd3``, 32 px), ``--prompts`` prompts x
``--group`` images, ``--num-steps`` SDE steps (Flow-GRPO's ``sde``, noise level 0.7), every step but the last
trained (``timestep_fraction`` 0.99), LoRA r32 on the attention projections, the brightness reward, one AdamW step
per update, CFG 4.5 (and 1.0, no unconditional half).

* ``mmrl``: ``build_trainer(config).step()`` with mmrl's defaults (``train.overlap_scoring: auto``, every trained
  step of a minibatch in one batched forward).
* ``plain``: the same model, LoRA, optimizer and formulas (:func:`mmrl.pipelines.flow.sde.sde_step`), in the loop
  Flow-GRPO's ``scripts/train_sd3.py`` runs: sampling one batch after another, the rewards after all sampling, then
  one forward + backward per sample batch and trained timestep, one optimizer step at the end.

mmrl and the plain loop are timed alternately in one process (a busy machine slows both), ``--warmup`` updates
first, then the median of ``--steps`` updates is reported with the ratio plain / mmrl (> 1: mmrl faster). The check
that both did the same work counts, by a forward pre-hook on the transformer, the calls and the rows (samples x CFG
halves) each side ran through it with and without grad; rows must be equal (mmrl makes fewer, larger calls), as must
the images sampled and the optimizer steps. The compute floor (``floor_s``) replays mmrl's transformer calls of an
update at the same shapes with random inputs, forward only for sampling and forward + backward for training:
``mmrl_over_floor`` is the trainer's overhead over the bare model work (issue 12's ``overhead`` target: at most
1.10).

* ``flow-grpo`` (with ``--flow-grpo PATH``, a checkout of https://github.com/yifan123/flow_grpo, and
  ``pip install ml_collections absl-py wandb``): the official ``scripts/train_sd3.py``, unmodified, run by
  ``benchmarks/flow_grpo_official.py`` in a process of its own with its ``config/grpo.py:compressibility`` config
  and flags for the same workload (the same local model, 2 sampling batches of 4 images of one prompt each, 10 SDE
  steps at noise 0.7, ``timestep_fraction`` 0.99, CFG 4.5 or 1, two training batches of 4 accumulated into one
  AdamW step; its LoRA is r32 on the same projections; its reward ``jpeg_compressibility`` instead of
  ``brightness``, both a few milliseconds on 32 px images). Its text encoding is fixed at 128 T5 tokens, so with
  it every side runs ``sampling.max_sequence_length=128``. Its epochs are timed between its own once-per-epoch logs
  (``wandb`` disabled), in two runs, one before and one after the in-process sides (a separate process cannot be
  alternated update by update), ``--warmup`` intervals of each run dropped; its transformer rows with and without
  grad and its optimizer steps are counted per epoch and must equal mmrl's. Without ``--flow-grpo`` (or without
  its requirements) that side is skipped and the JSON line says why.

    python benchmarks/flow_grpo_bench.py [--steps 5] [--warmup 1] [--prompts 2] [--group 4] [--num-steps 10] \
        [--threads 1] [--cfg both|on|off] [--width 384 --layers 8] [--set KEY=VALUE ...] [--flow-grpo PATH] \
        [--out PATH]
    mmrl bench flow-grpo [same options]

Memory: after the timed updates each side runs one more (the official script one more epoch) under
``common.LiveBytes``, a ``TorchDispatchMode`` that tracks the bytes of every tensor storage the update creates in
the main thread while it lives; ``peak_step_mib_per_image`` is its peak divided by the images of the update: the
update's transient memory (activations, gradients, sampled latents, temporaries; not the weights and optimizer
state made before it), measured on CPU where ``torch.cuda.max_memory_allocated`` does not exist.

Prints one JSON line (and writes it to ``--out``, default ``benchmarks/results/flow_grpo_bench.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import finish, peak_bytes, versions  # noqa: E402  (benchmarks/ is the script folder: on sys.path)

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "configs" / "tiny" / "flow_grpo.yaml"


def mid_size_pipeline(width: int, layers: int, directory: Path) -> Path:
    """The tiny SD3 pipeline with its transformer replaced by a random one of ``layers`` joint blocks and ``width``
    channels (heads of 64), seeded: the ``overhead`` workload of a mid-size model (tens of millions of parameters)
    without downloading anything. The text encoders and the VAE stay tiny."""
    import json
    import shutil

    from diffusers import SD3Transformer2DModel

    from mmrl.pipelines.flow.loading import resolve_pretrained

    tiny = Path(resolve_pretrained("tiny:sd3"))
    out = directory / f"sd3-w{width}-l{layers}"
    if not out.exists():
        shutil.copytree(tiny, out, ignore=shutil.ignore_patterns("transformer"))
        config = {k: v for k, v in json.loads((tiny / "transformer" / "config.json").read_text()).items()
                  if not k.startswith("_")}
        config.update(num_layers=layers, attention_head_dim=64, num_attention_heads=width // 64,
                      caption_projection_dim=width, dual_attention_layers=())
        torch.manual_seed(0)
        SD3Transformer2DModel(**config).save_pretrained(out / "transformer")
    return out


def with_t5_budget(pipeline: Path, tokens: int, directory: Path) -> Path:
    """A copy of ``pipeline`` whose T5 tokenizer states a ``model_max_length`` of ``tokens``: Flow-GRPO encodes its
    prompts with 128 T5 tokens, more than the tiny pipeline's tokenizer states (32), which mmrl refuses to pad
    past; the tiny T5 encoder (relative positions) takes any length, so both sides run 128 on this copy."""
    import json
    import shutil

    out = directory / f"{Path(pipeline).name}-t5-{tokens}"
    if not out.exists():
        shutil.copytree(pipeline, out)
        config = out / "tokenizer_3" / "tokenizer_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": tokens}, indent=2))
    return out


def overrides(args, guidance: float, out_dir: Path) -> list[str]:
    model = [f"model.pretrained={args.pipeline}"] if args.pipeline else []
    return [*model,
        f"output_dir={out_dir}", "resume=null", f"data.prompts_per_step={args.prompts}",
        f"data.group_size={args.group}", f"sampling.num_steps={args.num_steps}", "sampling.sde=flow_grpo",
        "sampling.noise_level=0.7", "sampling.train_steps=fraction", "sampling.timestep_fraction=0.99",
        f"sampling.guidance_scale={guidance}", "model.lora_rank=32", "model.lora_alpha=64",
        "train.inner_epochs=1", f"train.batch_size={args.prompts * args.group}", "train.gradient_accumulation_steps=1",
        f"train.sample_batch_size={args.prompts * args.group}", "algorithm.beta=0.0",
        "logging.eval_every=0", "logging.save_every=0", "logging.progress_bar=false", "eval.every=0",
        "rewards={brightness: 1.0}", *(["sampling.max_sequence_length=128"] if args.flow_grpo else []), *args.set,
    ]


OFFICIAL_RUNNER = Path(__file__).resolve().parent / "flow_grpo_official.py"


def official_missing(args) -> str | None:
    """Why the official Flow-GRPO side cannot run (``None`` when it can)."""
    if not args.flow_grpo:
        return "no --flow-grpo PATH (a checkout of https://github.com/yifan123/flow_grpo) given"
    if not (Path(args.flow_grpo) / "scripts" / "train_sd3.py").is_file():
        return f"{args.flow_grpo} has no scripts/train_sd3.py"
    import importlib.util

    missing = [m for m in ("ml_collections", "absl", "wandb") if importlib.util.find_spec(m) is None]
    if missing:
        return f"Flow-GRPO's script needs {', '.join(missing)}: pip install ml_collections absl-py wandb"
    return None


def run_official(args, guidance: float, tmp: Path, epochs: int) -> dict:
    """One run of the official script for ``epochs`` epoch intervals (``benchmarks/flow_grpo_official.py``)."""
    import subprocess

    from mmrl.pipelines.flow.loading import resolve_pretrained

    prompts = tmp / "flow_grpo_prompts"
    prompts.mkdir(exist_ok=True)
    for split in ("train", "test"):
        (prompts / f"{split}.txt").write_text("a red circle\na blue square\na green triangle\na white circle\n")
    model = args.pipeline or resolve_pretrained("tiny:sd3")
    images = args.prompts * args.group
    flags = ["--config", "config/grpo.py:compressibility", f"--config.pretrained.model={model}",
             f"--config.dataset={prompts}", "--config.mixed_precision=no", "--config.resolution=32",
             f"--config.sample.num_steps={args.num_steps}", "--config.sample.eval_num_steps=2",
             f"--config.sample.guidance_scale={guidance}", f"--config.train.cfg={guidance > 1}",
             f"--config.sample.train_batch_size={args.group}", f"--config.sample.num_image_per_prompt={args.group}",
             f"--config.sample.num_batches_per_epoch={args.prompts}", "--config.sample.test_batch_size=1",
             f"--config.train.batch_size={args.group}", f"--config.train.gradient_accumulation_steps={args.prompts}",
             "--config.train.timestep_fraction=0.99", "--config.train.beta=0", "--config.eval_freq=1000000",
             "--config.save_freq=1000000", f"--config.logdir={tmp / 'flow_grpo_logs'}",
             f"--config.save_dir={tmp / 'flow_grpo_save'}"]
    cmd = [sys.executable, str(OFFICIAL_RUNNER), "--checkout", str(Path(args.flow_grpo).resolve()), "--epochs",
           str(epochs), "--threads", str(args.threads or 0), "--", *flags]
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("FLOW_GRPO_RESULT "):
            out = json.loads(line.split(" ", 1)[1])
            out["images"] = images
            return out
    raise RuntimeError(f"the official Flow-GRPO script gave no result (rc {proc.returncode}):\n"
                       f"{proc.stderr[-3000:]}")


class Counter:
    """Calls and rows through the transformer's forward, split by grad mode."""

    def __init__(self, module: torch.nn.Module):
        self.calls = {"grad": 0, "no_grad": 0}
        self.rows = {"grad": 0, "no_grad": 0}
        self.log: list[tuple[bool, dict]] = []  # (with grad, the tensor kwargs' shapes and dtypes) of each call
        module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        key = "grad" if torch.is_grad_enabled() else "no_grad"
        self.calls[key] += 1
        self.rows[key] += int(x.shape[0])
        self.log.append((torch.is_grad_enabled(), {k: (v.shape, v.dtype) for k, v in kwargs.items()
                                                   if isinstance(v, torch.Tensor)}))

    def snapshot(self) -> dict:
        return {"calls": dict(self.calls), "rows": dict(self.rows)}


def diff(after: dict, before: dict) -> dict:
    return {k: {m: after[k][m] - before[k][m] for m in after[k]} for k in after}


class PlainLoop:
    """A Flow-GRPO-style update on the trainer's own policy objects (see the module docstring)."""

    def __init__(self, trainer):
        self.t = trainer
        self.policy = trainer.policy
        self.optimizer = trainer.optimizer
        self.steps = 0

    def update(self, items, generator: torch.Generator) -> int:
        from mmrl.pipelines.flow.sde import sde_step

        p, c = self.policy, self.t.config
        family, model = p.family, p.transformer
        prompts = [i.prompt for i in items for _ in range(c.data.group_size)]
        metadata = [i.metadata for i in items for _ in range(c.data.group_size)]
        sigmas, timesteps = p.schedule(c.sampling.num_steps)
        trained = list(range(int(c.sampling.num_steps * c.sampling.timestep_fraction)))
        negative = p._negative
        batch = c.train.sample_batch_size
        shape = family.latent_shape(p.resolution)
        samples = []
        model.eval()
        with torch.no_grad():  # sampling, batch after batch
            for start in range(0, len(prompts), batch):
                chunk = prompts[start:start + batch]
                cond = family.encode(chunk)
                x = torch.randn((len(chunk), *shape), generator=generator)
                lat, logps = [x], []
                for s in range(c.sampling.num_steps):
                    t = torch.full((len(chunk),), float(timesteps[s]))
                    v = family.velocity(model, x, t, cond, negative, p.guidance_scale)
                    out = sde_step(x, v, sigmas[s].item(), sigmas[s + 1].item(), kind="flow_grpo",
                                   noise_level=0.7, generator=generator, sigma_one_substitute=sigmas[1].item())
                    x = out.prev_sample
                    lat.append(x)
                    logps.append(out.log_prob)
                samples.append({"cond": cond, "latents": torch.stack(lat, 1), "logps": torch.stack(logps, 1),
                                "images": family.decode(x)})
        images = torch.cat([s["images"] for s in samples])
        rewards = self.t.reward_fn(images, prompts, metadata)["total"].float()  # after all sampling
        groups = rewards.view(-1, c.data.group_size)
        adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, unbiased=False, keepdim=True) + 1e-4))
        adv = adv.flatten().clamp(-5, 5)
        model.train()
        row = 0
        for s_batch in samples:  # one forward + backward per batch and trained timestep
            n = s_batch["latents"].shape[0]
            a = adv[row:row + n]
            row += n
            for j in trained:
                x, x_next = s_batch["latents"][:, j], s_batch["latents"][:, j + 1]
                t = torch.full((n,), float(timesteps[j]))
                v = family.velocity(model, x, t, s_batch["cond"], negative, p.guidance_scale)
                out = sde_step(x, v, sigmas[j].item(), sigmas[j + 1].item(), kind="flow_grpo", noise_level=0.7,
                               prev_sample=x_next, sigma_one_substitute=sigmas[1].item())
                ratio = torch.exp(out.log_prob - s_batch["logps"][:, j])
                loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - 0.2, 1 + 0.2)).mean()
                (loss / len(trained) * n / len(prompts)).backward()
        torch.nn.utils.clip_grad_norm_(self.policy.trainable_parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return len(prompts)


def replay_floor(model: torch.nn.Module, calls: list[tuple[bool, dict]]) -> float:
    """Seconds of the bare transformer work of one update: the same calls at the same shapes, random inputs, a
    forward (no grad) for each sampling call and a forward + backward for each training call (the compute floor)."""
    generator = torch.Generator().manual_seed(1)
    inputs = [(grad, {k: (torch.rand(shape, generator=generator) * 999).to(dtype) if k == "timestep"
                      else torch.randn(shape, generator=generator).to(dtype) for k, (shape, dtype) in spec.items()})
              for grad, spec in calls]
    start = time.perf_counter()
    for grad, kwargs in inputs:
        with torch.set_grad_enabled(grad):
            out = model(**kwargs, return_dict=False)[0]
            if grad:
                out.float().square().mean().backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def run_setting(args, guidance: float, tmp: Path) -> dict:
    from mmrl.build import build_trainer
    from mmrl.cli import quiet_libraries
    from mmrl.config import load_config

    quiet_libraries()

    trainer = build_trainer(load_config(RECIPE, overrides(args, guidance, tmp / f"cfg{guidance}")))
    counter = Counter(trainer.policy.transformer)
    plain = PlainLoop(trainer)
    times = {"mmrl": [], "plain": [], "floor": []}
    work = {"mmrl": [], "plain": []}
    generator = torch.Generator().manual_seed(0)
    official_runs = []
    if args.official_missing is None:  # before the in-process sides (and again after them)
        official_runs.append(run_official(args, guidance, tmp, args.warmup + args.steps))
    mmrl_opt_steps = 0.0  # the trainer's optimizer_steps metric counts from the start of the run
    for k in range(args.warmup + args.steps):
        for side in (("mmrl", "plain") if k % 2 == 0 else ("plain", "mmrl")):
            before = counter.snapshot()
            counter.log = []
            start = time.perf_counter()
            if side == "mmrl":
                metrics = trainer.step()
                images = args.prompts * args.group
                opt_steps, mmrl_opt_steps = metrics["optimizer_steps"] - mmrl_opt_steps, metrics["optimizer_steps"]
            else:
                items = trainer.prompts.next_batch(args.prompts)
                images = plain.update(items, generator)
                opt_steps = 1.0
            elapsed = time.perf_counter() - start
            if k >= args.warmup:
                times[side].append(elapsed)
                work[side].append({**diff(counter.snapshot(), before), "images": images, "optimizer_steps": opt_steps})
                if side == "mmrl":
                    times["floor"].append(replay_floor(trainer.policy.transformer, counter.log))
    # one more update of each in-process side, untimed, under the tensor tracker: the peak of what it creates; and
    # the floor's replay of that update's calls (one forward, with its backward where trained, per call)
    counter.log = []
    per_update = args.prompts * args.group
    peak = {"mmrl": peak_bytes(trainer.step)[1] / per_update}
    peak["floor"] = peak_bytes(replay_floor, trainer.policy.transformer, list(counter.log))[1] / per_update
    images, plain_peak = peak_bytes(plain.update, trainer.prompts.next_batch(args.prompts), generator)
    peak["plain"] = plain_peak / images
    official = None
    if args.official_missing is None:
        official_runs.append(run_official(args, guidance, tmp, args.warmup + args.steps))
        peak["flow_grpo"] = statistics.median(run["peak_epoch_bytes"] for run in official_runs) / (
            args.prompts * args.group)
        times["flow_grpo"] = [t for run in official_runs for t in run["epoch_s"][args.warmup:]]
        official = official_runs[0]
    med = {side: statistics.median(v) for side, v in times.items()}
    problems = []
    if official is not None:
        ours = work["mmrl"][0]
        theirs = {"grad": official["work"][-1]["rows_grad"], "no_grad": official["work"][-1]["rows_no_grad"]}
        for mode in ("grad", "no_grad"):
            if ours["rows"][mode] != theirs[mode]:
                problems.append(f"transformer rows ({mode}) differ: mmrl {ours['rows'][mode]}, flow-grpo "
                                f"{theirs[mode]}")
        if official["work"][-1]["optimizer_steps"] != ours["optimizer_steps"]:
            problems.append(f"optimizer steps differ: mmrl {ours['optimizer_steps']}, flow-grpo "
                            f"{official['work'][-1]['optimizer_steps']}")
        text = {spec["encoder_hidden_states"][0][1] for _, spec in counter.log if "encoder_hidden_states" in spec}
        if text != {official["shapes"].get("text_tokens")}:
            problems.append(f"text tokens differ: mmrl {sorted(text)}, flow-grpo "
                            f"{official['shapes'].get('text_tokens')}")
    for key in ("images", "optimizer_steps"):
        if {w[key] for w in work["mmrl"]} != {w[key] for w in work["plain"]}:
            problems.append(f"{key} differ: mmrl {work['mmrl'][0][key]}, plain {work['plain'][0][key]}")
    for mode in ("grad", "no_grad"):
        m, p = work["mmrl"][0]["rows"][mode], work["plain"][0]["rows"][mode]
        if m != p:
            problems.append(f"transformer rows ({mode}) differ: mmrl {m}, plain {p}")
    versus = {} if official is None else {
        "flow_grpo_s": med["flow_grpo"], "speedup_vs_flow_grpo": med["flow_grpo"] / med["mmrl"],
        "flow_grpo_over_floor": med["flow_grpo"] / med["floor"], "flow_grpo_epochs_s": times["flow_grpo"],
        "flow_grpo_work": official["work"][-1]}
    return {"guidance_scale": guidance, **versus, "mmrl_s": med["mmrl"], "plain_s": med["plain"],
            "floor_s": med["floor"],
            "speedup_vs_plain": med["plain"] / med["mmrl"], "mmrl_over_floor": med["mmrl"] / med["floor"],
            "plain_over_floor": med["plain"] / med["floor"], "mmrl_steps_s": times["mmrl"],
            "plain_steps_s": times["plain"], "work": {"mmrl": work["mmrl"][0], "plain": work["plain"][0]},
            "peak_step_mib_per_image": {side: b / 2**20 for side, b in peak.items()},
            "problems": problems}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed updates per side")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--num-steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or None)
    ap.add_argument("--cfg", choices=("both", "on", "off"), default="both")
    ap.add_argument("--width", type=int, default=0, help="a random transformer of this width (a multiple of 64) "
                    "instead of the tiny one's, with --layers joint blocks: the mid-size overhead workload")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an mmrl config override for the mmrl side (repeatable), e.g. train.overlap_scoring=true")
    ap.add_argument("--flow-grpo", default=None, metavar="PATH",
                    help="a checkout of the official Flow-GRPO (github.com/yifan123/flow_grpo): also time its "
                         "scripts/train_sd3.py on the same workload")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "flow_grpo_bench.json")
    args = ap.parse_args(argv)
    args.official_missing = official_missing(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    import tempfile

    settings = {"both": (4.5, 1.0), "on": (4.5,), "off": (1.0,)}[args.cfg]
    if args.width and (args.width % 64 or args.layers < 1):
        ap.error("--width must be a multiple of 64 and --layers >= 1")
    with tempfile.TemporaryDirectory(prefix="mmrl-bench-") as tmp:
        args.pipeline = mid_size_pipeline(args.width, args.layers, Path(tmp)) if args.width else None
        if args.flow_grpo:  # its 128 T5 tokens on every side (the tiny tokenizer states 32)
            from mmrl.pipelines.flow.loading import resolve_pretrained

            args.pipeline = with_t5_budget(Path(args.pipeline or resolve_pretrained("tiny:sd3")), 128, Path(tmp))
        results = {("cfg" if g > 1 else "no_cfg"): run_setting(args, g, Path(tmp)) for g in settings}
        from diffusers import SD3Transformer2DModel

        from mmrl.pipelines.flow.loading import resolve_pretrained

        folder = Path(args.pipeline or resolve_pretrained("tiny:sd3")) / "transformer"
        transformer_params = sum(p.numel() for p in SD3Transformer2DModel.from_pretrained(folder).parameters())
    versus = ({"speedup_vs_flow_grpo": {k: round(v["speedup_vs_flow_grpo"], 3) for k, v in results.items()}}
              if args.official_missing is None else {"flow_grpo_skipped": args.official_missing})
    line = {"bench": "flow-grpo", **versus,
            "speedup_vs_plain": {k: round(v["speedup_vs_plain"], 3) for k, v in results.items()},
            "mmrl_over_floor": {k: round(v["mmrl_over_floor"], 3) for k, v in results.items()},
            "peak_step_mib_per_image": {k: {side: round(b, 3) for side, b in v["peak_step_mib_per_image"].items()}
                                        for k, v in results.items()},
            "results": results, "ok": not any(v["problems"] for v in results.values()),
            "settings": {k: v for k, v in vars(args).items()
                         if k not in ("out", "pipeline", "official_missing")}
            | {"torch_threads": torch.get_num_threads(), "transformer_parameters": transformer_params},
            "versions": versions()}
    return finish(line, args.out)


if __name__ == "__main__":
    sys.exit(main())
