#!/usr/bin/env python
"""Trainer overhead on mid-size random models: one update's time divided by the model work alone (``mmrl bench
overhead``). Target (issue 12): at most 1.10.

* ``vlm``: a random Qwen2.5-VL of tens of millions of parameters (the tiny one's tokenizer and processor, 8
  decoder layers of 512, 4 vision blocks of 256) through ``configs/tiny/vlm_grounding.yaml`` (LoRA r8, ShapeWorld
  grounding, ``--prompts`` x ``--group``, ``--max-new-tokens`` new tokens forced, so both sides generate the same
  number). The floor of an update replays, on the same model object, the work the trainer asked of it: every
  ``generate`` call again with the same inputs and generation config (the same tokens' worth: ``min_new_tokens``
  = the length it produced), and every forward outside ``generate`` with the same tensors, with a backward of
  its logits where the trainer's had grad. What is left over (``mmrl_over_floor - 1``) is the loop's own cost:
  prompt building and the processor, rewards, advantages, the loss and the optimizer step.
* ``flow``: ``flow_grpo_bench.py --width 384 --layers 8 --cfg off`` (a random 41.4M-parameter SD3 transformer),
  whose ``mmrl_over_floor`` is the same quotient for the flow family.

``peak_step_mib_per_sample``: one more update of each family, untimed, and the floor's replay of its calls under
``common.LiveBytes`` (the bytes of tensor storages each creates, at their peak), per sample.

Prints one JSON line (and writes ``benchmarks/results/overhead.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import finish, peak_bytes, versions  # noqa: E402  (benchmarks/ is the script folder: on sys.path)

ROOT = Path(__file__).resolve().parent.parent
VLM_RECIPE = ROOT / "configs" / "tiny" / "vlm_grounding.yaml"


def mid_size_vlm(directory: Path, hidden: int = 512, layers: int = 8, vision_hidden: int = 256,
                 vision_depth: int = 4) -> Path:
    """The tiny Qwen2.5-VL folder with a random model of the given sizes (seeded)."""
    import shutil

    from transformers import AutoConfig, GenerationConfig, Qwen2_5_VLForConditionalGeneration

    from mmrl.pipelines.vlm.tiny import ensure_tiny_vlm

    tiny = Path(ensure_tiny_vlm("qwen2_5_vl"))
    out = directory / f"qwen25vl-h{hidden}-l{layers}"
    shutil.copytree(tiny, out)
    config = AutoConfig.from_pretrained(tiny)
    heads = hidden // 64
    text = dict(hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=64,
                layer_types=["full_attention"] * layers, max_window_layers=layers)
    for key, value in text.items():
        setattr(config.text_config, key, value)
    config.text_config.rope_parameters = {**config.text_config.rope_parameters, "mrope_section": [8, 12, 12]}
    vision = dict(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, depth=vision_depth,
                  num_heads=vision_hidden // 64, out_hidden_size=hidden, fullatt_block_indexes=[vision_depth - 1])
    for key, value in vision.items():
        setattr(config.vision_config, key, value)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig.from_pretrained(tiny)
    for path in out.glob("*.safetensors*"):
        path.unlink()
    model.save_pretrained(out)
    return out


class Recorder:
    """The calls the trainer makes to the VLM during one update: ``generate`` (its kwargs, how many tokens it
    produced and, with ``model.share_prompt_prefix``, the inputs of the prompts' one prefill that feeds it) and every
    top-level forward outside it (its tensors and whether grad was on), with the rows a prompt-shared log-prob
    forward selects from its prompts' KV cache."""

    def __init__(self, policy):
        import copy

        self.generates: list[tuple[dict, int, tuple | None]] = []  # (kwargs, tokens produced, shared prefill)
        self.forwards: list[tuple] = []  # (grad, kwargs) or ("select", the rows taken from a prompt cache)
        self._paused = False
        self._prefill_inputs = None
        self.model = policy.model  # the PEFT model (LoRA) or the model: what the policy calls
        original = self.model.generate
        self._prefill = policy._shared_prefill

        def generate(*args, **kwargs):
            self._paused = True
            try:
                sequences = original(*args, **kwargs)
            finally:
                self._paused = False
            self.generates.append((dict(kwargs), sequences.shape[1] - kwargs["input_ids"].shape[1],
                                   self._prefill_inputs))
            self._prefill_inputs = None
            return sequences

        def prefill(gen_kwargs, vision_kwargs, config):  # the prompts' one prefill: part of the generate it feeds
            self._prefill_inputs = (dict(gen_kwargs), dict(vision_kwargs), copy.deepcopy(config))
            self._paused = True
            try:
                return self._prefill(gen_kwargs, vision_kwargs, config)
            finally:
                self._paused = False

        self.model.generate = generate
        self._generate = original
        policy._shared_prefill = prefill
        policy.base_model.register_forward_pre_hook(self._hook, with_kwargs=True)
        from transformers.cache_utils import DynamicCache

        select = DynamicCache.batch_select_indices

        def recorded_select(cache, indices):
            if not self._paused:
                self.forwards.append(("select", indices.detach().clone()))
            return select(cache, indices)

        DynamicCache.batch_select_indices = recorded_select

    def _hook(self, _module, args, kwargs):
        if not self._paused:
            self.forwards.append((torch.is_grad_enabled(),
                                  {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}))

    def passes(self) -> dict[str, int]:
        """Log-prob passes with and without grad (a prompt-shared pass, prompt forward + completion forward, counts
        once) and how many of them ran their distinct prompts once (``shared_prompt_forwards``)."""
        prompt = [g != "select" and kw.get("use_cache") is True and "cache" not in kw for g, kw in self.forwards]
        passes = [g for (g, _), p in zip(self.forwards, prompt) if g != "select" and not p]
        return {"grad": sum(g is True for g in passes), "no_grad": sum(g is False for g in passes),
                "shared_prompt_forwards": sum(prompt)}

    def reset(self) -> None:
        self.generates, self.forwards = [], []

    def replay(self) -> float:
        """Seconds of the same model work, bare: each generate again (the same number of new tokens forced) and
        each forward again, backward through its logits where it had grad."""
        import copy

        calls, forwards = list(self.generates), list(self.forwards)
        self._paused = True  # the replay's own forwards are not recorded either
        start = time.perf_counter()
        for kwargs, produced, prefill in calls:
            kwargs = dict(kwargs)
            config = copy.deepcopy(kwargs.pop("generation_config"))
            config.min_new_tokens = config.max_new_tokens = produced
            with torch.no_grad():
                if prefill is not None:  # the prompts prefilled once again, a fresh cache for the group's rows
                    gen_kwargs, vision_kwargs, prefill_config = prefill
                    kwargs = self._prefill(dict(gen_kwargs), vision_kwargs, copy.deepcopy(prefill_config))
                self._generate(**kwargs, generation_config=config)
        cache, pending = None, []
        for grad, kwargs in forwards:
            if grad == "select":  # the prompt rows a prompt-shared forward's completions attend to
                cache.batch_select_indices(kwargs)
                continue
            if "cache" in kwargs:
                kwargs = dict(kwargs, cache=cache)
            with torch.set_grad_enabled(grad):
                out = self.model(**kwargs)
                if grad:  # a backward through the pass's logits (a prompt-shared pass: both forwards' at once)
                    pending.append(out.logits.float().logsumexp(-1).mean())
                if kwargs.get("use_cache") and "cache" not in kwargs:  # a shared prompt: its completions follow
                    cache = out.cache
                    continue
                if grad:
                    sum(pending).backward()
            cache, pending = None, []
        elapsed = time.perf_counter() - start
        self._paused = False
        self.model.zero_grad(set_to_none=True)
        return elapsed


def run_vlm(args, tmp: Path) -> dict:
    from mmrl.build import build_trainer
    from mmrl.cli import quiet_libraries
    from mmrl.config import load_config

    quiet_libraries()
    model = mid_size_vlm(tmp, hidden=args.hidden, layers=args.layers)
    overrides = [f"output_dir={tmp / 'run'}", "resume=null", f"model.pretrained={model}",
                 "data.dataset=shapeworld:train:64:grounding", f"data.prompts_per_step={args.prompts}",
                 f"data.group_size={args.group}", f"train.batch_size={args.group}",
                 "train.gradient_accumulation_steps=1", f"generation.max_new_tokens={args.max_new_tokens}",
                 "logging.eval_every=0", "logging.save_every=0", "logging.progress_bar=false",
                 "logging.tensorboard=false", "eval.every=0", *args.set]
    trainer = build_trainer(load_config(str(VLM_RECIPE), overrides))
    recorder = Recorder(trainer.policy)
    times, floors = [], []
    for k in range(args.warmup + args.steps):
        recorder.reset()
        start = time.perf_counter()
        trainer.step()
        elapsed = time.perf_counter() - start
        floor = recorder.replay()
        if k >= args.warmup:
            times.append(elapsed)
            floors.append(floor)
    ratios = [t / f for t, f in zip(times, floors)]
    # one more update, untimed, under the tensor tracker, and the floor's replay of its calls: the peak bytes each
    # creates (common.LiveBytes), per sample
    recorder.reset()
    mib_per_sample = 2**20 * args.prompts * args.group
    peak = {"mmrl": peak_bytes(trainer.step)[1] / mib_per_sample}
    peak["floor"] = peak_bytes(recorder.replay)[1] / mib_per_sample
    params = sum(p.numel() for p in trainer.policy.base_model.parameters())
    return {"mmrl_s": statistics.median(times), "floor_s": statistics.median(floors),
            "mmrl_over_floor": statistics.median(ratios), "ratios": ratios, "parameters": params,
            "peak_step_mib_per_sample": peak,
            "generate_calls": len(recorder.generates), "new_tokens": [n for _, n, _ in recorder.generates],
            "shared_prefills": sum(p is not None for _, _, p in recorder.generates),
            "forwards": recorder.passes()}


def run_flow(args) -> dict:
    out = Path(tempfile.mkdtemp(prefix="mmrl-overhead-")) / "flow.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "flow_grpo_bench.py"), "--width", "384", "--layers", "8",
           "--cfg", "off", "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        return {"error": result.stderr[-2000:]}
    line = json.loads(out.read_text())
    return {"mmrl_over_floor": line["mmrl_over_floor"]["no_cfg"],
            "parameters": line["settings"]["transformer_parameters"],
            "mmrl_s": line["results"]["no_cfg"]["mmrl_s"], "floor_s": line["results"]["no_cfg"]["floor_s"],
            "peak_step_mib_per_sample": line["results"]["no_cfg"]["peak_step_mib_per_image"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=("vlm", "flow", "both"), default="both")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512, help="VLM decoder width (a multiple of 64)")
    ap.add_argument("--layers", type=int, default=8, help="VLM decoder layers")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an mmrl override (VLM side)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "overhead.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    with tempfile.TemporaryDirectory(prefix="mmrl-overhead-") as tmp:
        if args.family in ("vlm", "both"):
            results["vlm"] = run_vlm(args, Path(tmp))
        if args.family in ("flow", "both"):
            results["flow"] = run_flow(args)
    line = {"bench": "overhead", "mmrl_over_floor": {k: round(v["mmrl_over_floor"], 3) for k, v in results.items()
                                                     if "mmrl_over_floor" in v},
            "peak_step_mib_per_sample": {k: {side: round(b, 3) for side, b in v["peak_step_mib_per_sample"].items()}
                                         for k, v in results.items() if "peak_step_mib_per_sample" in v},
            "target": 1.10, "results": results,
            "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"torch_threads": torch.get_num_threads()},
            "versions": versions()}
    line["ok"] = all("error" not in v for v in results.values())
    return finish(line, args.out)


if __name__ == "__main__":
    sys.exit(main())
