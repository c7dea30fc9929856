#!/usr/bin/env python
"""One GRPO step workload through mmrl and through TRL's ``GRPOTrainer``: throughput ratio (CPU).

Both frameworks train the same tiny random Qwen2.5-VL (``tiny:qwen2_5_vl``) on the same synthetic
grounding set (``tiny:grounding``), with the same step:

* ``--prompts`` prompts per step, ``--group`` completions each (``num_generations``), sampled with
  ``--temperature`` and at most ``--max-new-tokens`` new tokens, the vision placeholder tokens suppressed;
* the same two rewards (mmrl's ``iou`` with weight 1 and ``think_answer_format`` with weight 0.5, wrapped as
  TRL reward functions), summed then normalised per group (std ddof 1, eps 1e-4);
* ``--inner-epochs`` passes (TRL ``num_iterations``) over the step's completions in minibatches of
  ``--batch-size`` (TRL ``per_device_train_batch_size``), one AdamW step per minibatch, old log-probs from a
  separate no-grad pass, DAPO token aggregation, clip 0.2 / 0.28, gradient clipping at 1.0;
* full fine-tuning of the language model (embeddings, decoder, head), the vision tower frozen; fp32, no
  gradient checkpointing, ``--beta`` KL to a frozen reference copy (0 by default: no reference);
* CPU, one process, ``torch.set_num_threads(--threads)``.

A TRL "step" here is the ``(N / batch) * num_iterations`` optimizer steps between two generations, so one
mmrl ``trainer.step()`` and one TRL step do the same updates. Each framework runs in its own subprocess
(``--repeats`` alternates their order), warms up one step, then times ``--steps`` steps.

After the timed steps each side runs one more step under :class:`common.LiveBytes` (a ``TorchDispatchMode``
tracking the bytes of every tensor storage the step creates while it lives): its peak per sample is the
step's transient memory (activations, gradients, temporaries; the resident weights and optimizer state created
earlier are not counted), on CPU where ``torch.cuda.max_memory_allocated`` does not exist.

It also counts, per step, the vision-encoder calls (``get_image_features`` on the model, and the images and
patches they encode) and the language-model forwards (calls and token positions, with and without grad), so
the "encode each image once per prompt" difference is visible, and checks that both did the same token work.
One thing differs by default: mmrl cuts each inner epoch into minibatches in group order (``train.minibatch_order:
auto``, each prompt's completions together, as verl), TRL in a shuffled sample order; with several optimizer steps
per step that decides which completions share one (the same samples, tokens and optimizer steps either way).
``--set train.minibatch_order=samples`` gives mmrl TRL's order.

    python benchmarks/vlm_grpo_vs_trl.py [--steps 5] [--prompts 2] [--group 4] [--max-new-tokens 24]

Writes ``benchmarks/results/vlm_grpo_vs_trl.json`` (figures, versions, settings) and prints a table.
Needs TRL (``pip install "trl>=1.16,<1.17"``, the ``bench`` extra); see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / "results" / "vlm_grpo_vs_trl.json"
MMRL_CONFIG = ROOT.parent / "configs" / "tiny" / "vlm_grounding.yaml"
REWARD_WEIGHTS = {"iou": 1.0, "think_answer_format": 0.5}


# ------------------------------------------------------------------------------------------------ counters


class Counters:
    """Vision-encoder and language-model work, counted by wrapping the model (no change to what it computes)."""

    def __init__(self):
        self.v = dict(vision_calls=0, vision_images=0, vision_patches=0, vision_s=0.0, lm_calls=0, lm_tokens=0,
                      lm_grad_calls=0, lm_grad_tokens=0, lm_forward_s=0.0)
        self._lm_start: list[float] = []

    def snapshot(self) -> dict[str, int]:
        return dict(self.v)

    @staticmethod
    def diff(after: dict, before: dict) -> dict[str, float]:
        return {k: after[k] - before[k] for k in after}

    def attach(self, vlm) -> None:
        """``vlm``: the ``Qwen2_5_VLModel`` (``model.model`` of the ``ForConditionalGeneration``)."""
        import torch

        original = vlm.get_image_features

        def counted_get_image_features(pixel_values, image_grid_thw=None, *args, **kwargs):
            self.v["vision_calls"] += 1
            if image_grid_thw is not None:
                self.v["vision_images"] += int(image_grid_thw.shape[0])
                self.v["vision_patches"] += int(image_grid_thw.prod(-1).sum())
            t0 = time.perf_counter()
            out = original(pixel_values, image_grid_thw, *args, **kwargs)
            self.v["vision_s"] += time.perf_counter() - t0
            return out

        vlm.get_image_features = counted_get_image_features  # instance attribute: forward's self.get_image_features

        def lm_pre_hook(module, args, kwargs):
            embeds = kwargs.get("inputs_embeds")
            ids = kwargs.get("input_ids")
            ref = embeds if embeds is not None else (ids if ids is not None else (args[0] if args else None))
            tokens = int(ref.shape[0] * ref.shape[1]) if ref is not None else 0
            self.v["lm_calls"] += 1
            self.v["lm_tokens"] += tokens
            if torch.is_grad_enabled():
                self.v["lm_grad_calls"] += 1
                self.v["lm_grad_tokens"] += tokens
            self._lm_start.append(time.perf_counter())

        def lm_post_hook(module, args, output):
            self.v["lm_forward_s"] += time.perf_counter() - self._lm_start.pop()

        vlm.language_model.register_forward_pre_hook(lm_pre_hook, with_kwargs=True)
        vlm.language_model.register_forward_hook(lm_post_hook)


# ---------------------------------------------------------------------------------------------- shared


def setup_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def tiny_paths(args=None) -> tuple[Path, Path]:
    """The model folder (``--model-dir`` when given, else ``tiny:qwen2_5_vl``) and the grounding set."""
    from mmrl.data.synthetic import ensure_synthetic
    from mmrl.pipelines.vlm.tiny import ensure_tiny_vlm

    model = Path(args.model_dir) if args is not None and args.model_dir else Path(ensure_tiny_vlm("qwen2_5_vl"))
    return model, Path(ensure_synthetic("grounding"))


def mmrl_config(args, output_dir: str):
    from mmrl.config import load_config

    overrides = [
        f"output_dir={output_dir}", "resume=null", f"seed={args.seed}",
        f"model.pretrained={args.model_dir or 'tiny:qwen2_5_vl'}", "model.dtype=float32", "model.use_lora=false",
        f"model.freeze_vision={'false' if args.train_vision else 'true'}",
        "model.gradient_checkpointing=false",
        f"generation.temperature={args.temperature}", "generation.top_p=1.0", "generation.top_k=0",
        f"generation.max_new_tokens={args.max_new_tokens}",
        "data.dataset=tiny:grounding", f"data.prompts_per_step={args.prompts}", f"data.group_size={args.group}",
        "rewards={iou: 1.0, think_answer_format: 0.5}",
        "algorithm.scale=group", "algorithm.std_ddof=1", "algorithm.eps=1.0e-4",
        "algorithm.advantage_clamp=null", "algorithm.reward_combination=sum_then_normalize",
        "algorithm.per_prompt_stat_tracking=false", "algorithm.clip_low=0.2", "algorithm.clip_high=0.28",
        "algorithm.aggregation=dapo", "algorithm.ratio_level=token", f"algorithm.beta={args.beta}",
        f"algorithm.kl_bias_correction={str(args.beta > 0).lower()}",  # TRL 1.16's default use_bias_correction_kl
        "algorithm.variants=[]",
        f"optim.lr={args.lr}", "optim.weight_decay=0.0", "optim.adam_eps=1.0e-8", "optim.max_grad_norm=1.0",
        "optim.lr_scheduler=constant", "optim.warmup_steps=0", "optim.ema=false",
        f"train.inner_epochs={args.inner_epochs}", f"train.batch_size={args.batch_size}",
        "train.gradient_accumulation_steps=1", "train.timestep_chunk=0", 'train.mixed_precision="no"',
        "logging.progress_bar=false", "logging.tensorboard=false",
        *(["generation.engine=vllm"] if args.vllm else []),
        *args.set,
    ]
    return load_config(MMRL_CONFIG, overrides)


def summarise(step_times: list[float], completions: list[int]) -> dict:
    total = sum(step_times)
    return {
        "step_times_s": step_times,
        "total_s": total,
        "mean_step_s": total / len(step_times),
        "median_step_s": statistics.median(step_times),
        "steps_per_s": len(step_times) / total,
        "completions_per_s": sum(completions) / total,
    }


# -------------------------------------------------------------------------------------------------- mmrl


def run_mmrl(args) -> dict:
    import torch

    setup_threads(args.threads)
    from common import LiveBytes
    from mmrl.build import build_trainer

    with tempfile.TemporaryDirectory(prefix="bench_mmrl_") as tmp:
        config = mmrl_config(args, tmp)
        trainer = build_trainer(config)
        setup_threads(args.threads)
        policy = trainer.policy
        counters = Counters()
        counters.attach(policy.base_model.model)
        if policy._reference_model is not None:
            counters.attach(policy._reference_model.model)
        sampled: list[int] = []  # completions of each rollout, as the policy returned them
        rollout = policy.rollout

        def counted_rollout(*a, **kw):
            out = rollout(*a, **kw)
            sampled.append(len(out))
            return out

        policy.rollout = counted_rollout
        steps = []
        optimizer_steps = 0.0
        for _ in range(args.steps + 1):
            before = counters.snapshot()
            sampled.clear()
            t0 = time.perf_counter()
            metrics = trainer.step()
            elapsed = time.perf_counter() - t0
            steps.append({
                "time_s": elapsed,
                "rollout_s": metrics["time/rollout"], "reward_s": metrics["time/reward"],
                "train_s": metrics["time/train"],
                "completions": sum(sampled),
                "optimizer_steps": metrics["optimizer_steps"] - optimizer_steps,
                "mean_completion_tokens": metrics["completions/mean_length"],
                "reward_mean": metrics["reward/total"],
                "counts": Counters.diff(counters.snapshot(), before),
            })
            optimizer_steps = metrics["optimizer_steps"]
        steps[0]["warmup"] = True
        timed = steps[1:]
        sampled.clear()
        with LiveBytes() as tracker:  # one more step, untimed: the peak of the tensors it creates
            trainer.step()
        result = summarise([s["time_s"] for s in timed], [s["completions"] for s in timed])
        result.update(
            framework="mmrl",
            peak_step_mib=tracker.peak / 2**20, peak_step_mib_per_sample=tracker.peak / 2**20 / sum(sampled),
            optimizer_steps_per_step=statistics.mean(s["optimizer_steps"] for s in timed),
            split_s={k: statistics.mean(s[k] for s in timed) for k in ("rollout_s", "reward_s", "train_s")},
            mean_completion_tokens=statistics.mean(s["mean_completion_tokens"] for s in timed),
            counts_per_step={k: statistics.mean(s["counts"][k] for s in timed) for k in timed[0]["counts"]},
            prompt_ids=_mmrl_prompt_ids(trainer),
            trainable_params=sum(p.numel() for p in policy.trainable_parameters()),
            minibatch_order=trainer.minibatch_order,
            steps=steps,
            threads=torch.get_num_threads(),
        )
        mean_step = result["mean_step_s"]
        result["split_share"] = {k.replace("_s", ""): v / mean_step for k, v in result["split_s"].items()}
        return result


def _mmrl_prompt_ids(trainer) -> dict[str, list[int]]:
    """Every sample's prompt token ids as mmrl's rollout builds them (system prompt + image + question)."""
    out = {}
    for item in trainer.prompts.items:
        inputs, _, _ = trainer.policy.encode_prompts([item])
        out[str(item.id)] = [int(i) for i in inputs["input_ids"][0].tolist()]
    return out


# --------------------------------------------------------------------------------------------------- TRL


def build_trl_dataset(config, processor):
    """The grounding set as TRL wants a VLM dataset: a conversational ``prompt``, an ``image`` column, and the
    reward fields as columns. Images and metadata come from mmrl's own loader (same pixels, same input sizes)."""
    from datasets import Dataset

    from mmrl.build import vlm_media
    from mmrl.data.synthetic import resolve_dataset
    from mmrl.data.vlm import read_vlm_jsonl

    from mmrl.build import policy_coord_format

    media = vlm_media(config, processor)
    system = config.generation.system_prompt
    coord_format = policy_coord_format(config)  # what mmrl's rewards default to for this model type
    rows = []
    for sample in read_vlm_jsonl(resolve_dataset(config.data.dataset)):
        images, _ = media(sample)  # fills metadata image_size / input_size exactly as mmrl's rollout does
        meta = sample.metadata
        question = config.generation.question_template.format(question=sample.question)
        prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
        rows.append({
            "id": str(sample.id), "prompt": prompt, "image": images[0],
            "solution": meta["solution"], "task": meta["task"],
            "boxes": meta["boxes"], "coord_format": meta.get("coord_format", coord_format),
            "image_size": meta["image_size"], "input_size": meta["input_size"],
        })
    return Dataset.from_list(rows)


def trl_reward_funcs():
    """mmrl's rewards as TRL reward functions: ``f(completions, **dataset columns) -> list[float]``."""
    from mmrl.rewards import build_reward

    keys = ("solution", "task", "boxes", "coord_format", "image_size", "input_size")

    def wrap(name):
        reward = build_reward(name)

        def reward_func(completions, prompts=None, **columns):
            texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
            metadata = [{k: columns[k][i] for k in keys if k in columns} for i in range(len(texts))]
            questions = [None] * len(texts)
            return [float(x) for x in reward(texts, questions, metadata)[reward.name]]

        reward_func.__name__ = name
        return reward_func

    return [wrap(name) for name in REWARD_WEIGHTS]


def run_trl(args) -> dict:
    import torch

    setup_threads(args.threads)
    import transformers
    import trl
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from common import LiveBytes

    from mmrl.pipelines.vlm.qwen import QwenVLPolicy

    model_dir, _ = tiny_paths(args)
    n = args.prompts * args.group
    steps_per_generation = n // args.batch_size
    global_per_step = steps_per_generation * args.inner_epochs  # optimizer steps (GA=1) between generations

    with tempfile.TemporaryDirectory(prefix="bench_trl_") as tmp:
        config = mmrl_config(args, tmp)  # the same settings, read by the dataset builder
        model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
        processor = AutoProcessor.from_pretrained(str(model_dir))
        for name, param in model.named_parameters():  # mmrl's rule: everything but the vision tower trains
            param.requires_grad_(args.train_vision or not QwenVLPolicy._is_vision(name))
        suppressed = sorted({i for i in (getattr(model.config, k, None) for k in (
            "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")) if i is not None})
        dataset = build_trl_dataset(config, processor)
        if args.vllm:  # TRL's colocated vLLM (one process); vLLM's sampling takes the suppression as a logit bias
            engine = dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False,
                          generation_kwargs={"logit_bias": {i: -100.0 for i in suppressed}})
        else:
            engine = dict(generation_kwargs={"suppress_tokens": suppressed})

        grpo_args = GRPOConfig(
            output_dir=tmp, seed=args.seed, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
            per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1,
            steps_per_generation=steps_per_generation, num_generations=args.group,
            num_iterations=args.inner_epochs, max_completion_length=args.max_new_tokens,
            temperature=args.temperature, top_p=1.0, top_k=0, **engine,
            beta=args.beta, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
            multi_objective_aggregation="sum_then_normalize", reward_weights=list(REWARD_WEIGHTS.values()),
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            optim="adamw_torch_fused", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
            max_steps=global_per_step * (args.steps + 2), logging_steps=global_per_step,
            save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
            log_completions=False,
        )
        counters = Counters()
        marks: list[dict] = []

        tracker = LiveBytes()

        class StepClock(TrainerCallback):
            def on_step_end(self, _args, state, control, **kwargs):
                marks.append({"t": time.perf_counter(), "global_step": state.global_step,
                              "counts": counters.snapshot()})
                # the last cycle, untimed, runs under the tensor tracker: from the end of the cycle before it to
                # the end of its own last optimizer step, the same span as a timed step
                if state.global_step == global_per_step * (args.steps + 1):
                    tracker.__enter__()
                elif state.global_step == global_per_step * (args.steps + 2):
                    tracker.__exit__(None, None, None)

        trainer = GRPOTrainer(model=model, reward_funcs=trl_reward_funcs(), args=grpo_args, train_dataset=dataset,
                              processing_class=processor, callbacks=[StepClock()])
        setup_threads(args.threads)
        counters.attach(trainer.model.model)
        if trainer.ref_model is not None:
            counters.attach(trainer.accelerator.unwrap_model(trainer.ref_model).model)

        phases: list[dict] = []  # one per generation: its timings and completion counts

        def timed(name, fn):
            def wrapper(*a, **kw):
                if name == "generate_and_score":
                    phases.append({})
                t0 = time.perf_counter()
                out = fn(*a, **kw)
                record = phases[-1]
                record[name + "_s"] = record.get(name + "_s", 0.0) + time.perf_counter() - t0
                if name == "generate":
                    record["completions"] = len(out[1])
                    record["completion_tokens"] = [len(c) for c in out[1]]
                    record["prompt_tokens"] = [len(ids) for ids in out[0]]
                return out
            return wrapper

        # instance attributes: _generate_and_score_completions calls self._generate / self._calculate_rewards
        trainer._generate = timed("generate", trainer._generate)
        trainer._calculate_rewards = timed("rewards", trainer._calculate_rewards)
        trainer._generate_and_score_completions = timed("generate_and_score", trainer._generate_and_score_completions)

        t_start = time.perf_counter()
        trainer.train()
        assert len(marks) == global_per_step * (args.steps + 2), (len(marks), global_per_step)
        assert len(phases) == args.steps + 2, len(phases)
        measured = phases.pop()["completions"]

        boundaries = [t_start] + [marks[global_per_step * (j + 1) - 1]["t"] for j in range(args.steps + 1)]
        zero = {k: 0 for k in counters.snapshot()}
        counts = [zero] + [marks[global_per_step * (j + 1) - 1]["counts"] for j in range(args.steps + 1)]
        steps = []
        for j in range(args.steps + 1):
            ph = phases[j]
            elapsed = boundaries[j + 1] - boundaries[j]
            steps.append({
                "time_s": elapsed,
                "generate_s": ph["generate_s"], "reward_s": ph["rewards_s"],
                "score_other_s": ph["generate_and_score_s"] - ph["generate_s"] - ph["rewards_s"],
                "train_s": elapsed - ph["generate_and_score_s"],
                "completions": ph["completions"],
                "mean_completion_tokens": statistics.mean(ph["completion_tokens"]),
                "prompt_tokens": ph["prompt_tokens"],
                "counts": Counters.diff(counts[j + 1], counts[j]),
            })
        steps[0]["warmup"] = True
        timed_steps = steps[1:]
        result = summarise([s["time_s"] for s in timed_steps], [s["completions"] for s in timed_steps])
        split = {k: statistics.mean(s[k] for s in timed_steps)
                 for k in ("generate_s", "reward_s", "score_other_s", "train_s")}
        result.update(
            framework="trl",
            peak_step_mib=tracker.peak / 2**20, peak_step_mib_per_sample=tracker.peak / 2**20 / measured,
            optimizer_steps_per_step=global_per_step,
            split_s=split,
            split_share={k.replace("_s", ""): v / result["mean_step_s"] for k, v in split.items()},
            mean_completion_tokens=statistics.mean(s["mean_completion_tokens"] for s in timed_steps),
            counts_per_step={k: statistics.mean(s["counts"][k] for s in timed_steps) for k in timed_steps[0]["counts"]},
            prompt_ids=_trl_prompt_ids(trainer, dataset),
            trainable_params=sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            steps=steps,
            threads=torch.get_num_threads(),
            versions={"trl": trl.__version__, "transformers": transformers.__version__},
        )
        return result


def _trl_prompt_ids(trainer, dataset) -> dict[str, list[int]]:
    """Every sample's prompt token ids as TRL's generation tokenises them (its own multimodal message path)."""
    from trl.data_utils import prepare_multimodal_messages

    out = {}
    for row in dataset:
        prompt = prepare_multimodal_messages(row["prompt"], images=[row["image"]])
        ids = trainer._tokenize_prompts([prompt])[0][0]
        out[row["id"]] = [int(i) for i in ids]
    return out


# ------------------------------------------------------------------------------------------------ parent


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count()}
    for dist in ("mmrl-align", "torch", "transformers", "trl", "accelerate", "datasets", "peft"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def run_child(framework: str, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    cmd = [sys.executable, __file__, "--child", framework, "--child-out", out]
    for key in ("steps", "prompts", "group", "max_new_tokens", "batch_size", "inner_epochs", "beta", "lr",
                "temperature", "threads", "seed"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.train_vision:
        cmd.append("--train-vision")
    if args.vllm:
        cmd.append("--vllm")
    if args.model_dir:
        cmd += ["--model-dir", str(args.model_dir)]
    for override in args.set:
        cmd += ["--set", override]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_DATASETS_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{framework} run failed (exit {proc.returncode})")
    result = json.loads(Path(out).read_text())
    Path(out).unlink()
    return result


def check_workload(args, mmrl: dict, trl: dict) -> list[str]:
    """What must be equal for the comparison to be fair; returns the problems found (empty: all equal)."""
    problems = []
    n = args.prompts * args.group
    for r in (mmrl, trl):
        if any(s["completions"] != n for s in r["steps"]):
            problems.append(f"{r['framework']}: a step did not sample {n} completions")
    if mmrl["optimizer_steps_per_step"] != trl["optimizer_steps_per_step"]:
        problems.append("optimizer steps per step differ")
    a, b = mmrl["prompt_ids"], trl["prompt_ids"]
    if a.keys() != b.keys() or any(a[k] != b[k] for k in a):
        differ = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
        problems.append(f"prompt token ids differ for {len(differ)} samples (e.g. {differ[:3]})")
    if mmrl["trainable_params"] != trl["trainable_params"]:
        problems.append(f"trainable parameters differ: {mmrl['trainable_params']} vs {trl['trainable_params']}")
    return problems


def table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        cells = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5, help="timed GRPO steps per framework (after 1 warm-up step)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="completions per prompt (num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=4, help="completions per minibatch / optimizer step")
    p.add_argument("--inner-epochs", type=int, default=2, help="passes over each step's completions (num_iterations)")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (>0 adds a frozen reference model)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-vision", action="store_true",
                   help="train every parameter, the vision tower included (mmrl: model.freeze_vision=false)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in both runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="runs per framework, order alternated")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an mmrl config override after the benchmark's own (e.g. model.share_prompt_prefix=false: "
                        "one full row per sample in mmrl's log-prob forwards); TRL's side is unchanged")
    p.add_argument("--vllm", action="store_true",
                   help="both sides sample with vLLM colocated in the training process (mmrl: generation.engine=vllm; "
                        "TRL: use_vllm, vllm_mode colocate), on a random Qwen2.5-VL of --hidden / --layers (head size "
                        "64, which vLLM's CPU attention needs); needs vLLM (README, 'Rollouts on vLLM')")
    p.add_argument("--hidden", type=int, default=None,
                   help="train a random Qwen2.5-VL of this decoder width (head size 64) instead of tiny:qwen2_5_vl "
                        "(default with --vllm: 128)")
    p.add_argument("--layers", type=int, default=None, help="its decoder layers (with --hidden or --vllm; default 4)")
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--child", choices=("mmrl", "trl"), help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    n = args.prompts * args.group
    if n % args.batch_size:
        p.error(f"--prompts x --group ({n}) must be a multiple of --batch-size ({args.batch_size})")
    if args.group < 2:
        p.error("--group must be at least 2 (TRL requires it)")
    if args.layers is not None and not (args.hidden or args.vllm):
        p.error("--layers sizes the random model of --hidden / --vllm; give --hidden too")
    args.layers = args.layers or 4

    if args.child:
        result = run_mmrl(args) if args.child == "mmrl" else run_trl(args)
        Path(args.child_out).write_text(json.dumps(result))
        return 0

    try:
        import trl  # noqa: F401
    except ImportError:  # the comparison is the bench: without its peer there is nothing to measure
        from common import skipped

        return skipped("vlm-grpo", 'TRL is not installed: pip install "trl>=1.16,<1.17" (or pip install -e '
                                   '".[bench]")')
    if args.vllm:
        from mmrl.pipelines.vlm.vllm_engine import vllm_missing

        missing = vllm_missing()
        if missing:
            from common import skipped

            return skipped("vlm-grpo", f"--vllm: {missing}")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        args.hidden = args.hidden or 128
    with tempfile.TemporaryDirectory(prefix="bench_vlm_model_") as model_tmp:
        if args.hidden:
            from overhead import mid_size_vlm

            args.model_dir = str(mid_size_vlm(Path(model_tmp), hidden=args.hidden, layers=args.layers))
        model_dir, data = tiny_paths(args)  # build once, before the timed children
        runs: dict[str, list[dict]] = {"mmrl": [], "trl": []}
        for r in range(args.repeats):
            order = ("mmrl", "trl") if r % 2 == 0 else ("trl", "mmrl")
            for framework in order:
                print(f"[repeat {r + 1}/{args.repeats}] {framework} ...", flush=True)
                runs[framework].append(run_child(framework, args))

    def pooled(framework: str) -> dict:
        rs = runs[framework]
        times = [t for r in rs for t in r["step_times_s"]]
        comps = [s["completions"] for r in rs for s in r["steps"] if not s.get("warmup")]
        out = summarise(times, comps)
        out["split_s"] = {k: statistics.mean(r["split_s"][k] for r in rs) for k in rs[0]["split_s"]}
        out["split_share"] = {k: statistics.mean(r["split_share"][k] for r in rs) for k in rs[0]["split_share"]}
        out["mean_completion_tokens"] = statistics.mean(r["mean_completion_tokens"] for r in rs)
        out["counts_per_step"] = {k: statistics.mean(r["counts_per_step"][k] for r in rs)
                                  for k in rs[0]["counts_per_step"]}
        out["optimizer_steps_per_step"] = rs[0]["optimizer_steps_per_step"]
        out["completions_per_step"] = statistics.mean(comps)
        out["prompt_lengths"] = sorted({len(ids) for ids in rs[0]["prompt_ids"].values()})
        out["trainable_params"] = rs[0]["trainable_params"]
        out["peak_step_mib_per_sample"] = statistics.median(r["peak_step_mib_per_sample"] for r in rs)
        return out

    m, t = pooled("mmrl"), pooled("trl")
    problems = check_workload(args, runs["mmrl"][0], runs["trl"][0])
    same_prompts = len(runs["mmrl"][0]["prompt_ids"])
    for r in runs["mmrl"] + runs["trl"]:
        r.pop("prompt_ids")  # checked above; too long to keep
    ratio = m["steps_per_s"] / t["steps_per_s"]
    ratio_median = t["median_step_s"] / m["median_step_s"]  # less sensitive to a busy machine's outliers
    cm, ct = m["counts_per_step"], t["counts_per_step"]
    memory_ratio = t["peak_step_mib_per_sample"] / m["peak_step_mib_per_sample"]
    rows = [
        ("per GRPO step", "mmrl", "TRL", "mmrl/TRL"),
        ("steps/s", f"{m['steps_per_s']:.3f}", f"{t['steps_per_s']:.3f}", f"{ratio:.2f}x"),
        ("completions/s", f"{m['completions_per_s']:.1f}", f"{t['completions_per_s']:.1f}",
         f"{m['completions_per_s'] / t['completions_per_s']:.2f}x"),
        ("mean step (s)", f"{m['mean_step_s']:.3f}", f"{t['mean_step_s']:.3f}", ""),
        ("median step (s)", f"{m['median_step_s']:.3f}", f"{t['median_step_s']:.3f}", f"{ratio_median:.2f}x"),
        ("generation (s, share)", f"{m['split_s']['rollout_s']:.3f} ({m['split_share']['rollout']:.0%})",
         f"{t['split_s']['generate_s']:.3f} ({t['split_share']['generate']:.0%})", ""),
        ("reward (s)", f"{m['split_s']['reward_s']:.4f}", f"{t['split_s']['reward_s']:.4f}", ""),
        ("old/ref logps, re-encode, adv (s)", "in train", f"{t['split_s']['score_other_s']:.3f}", ""),
        ("train incl. advantages (s)", f"{m['split_s']['train_s']:.3f}", f"{t['split_s']['train_s']:.3f}", ""),
        ("completions", f"{m['completions_per_step']:g}", f"{t['completions_per_step']:g}", ""),
        ("mean completion tokens", f"{m['mean_completion_tokens']:.1f}", f"{t['mean_completion_tokens']:.1f}", ""),
        ("prompt tokens (dataset)", "/".join(map(str, m["prompt_lengths"])), "/".join(map(str, t["prompt_lengths"])),
         ""),
        ("trainable parameters", f"{m['trainable_params']}", f"{t['trainable_params']}", ""),
        ("optimizer steps", f"{m['optimizer_steps_per_step']:g}", f"{t['optimizer_steps_per_step']:g}", ""),
        ("vision-encoder calls", f"{cm['vision_calls']:g}", f"{ct['vision_calls']:g}", ""),
        ("images encoded", f"{cm['vision_images']:g}", f"{ct['vision_images']:g}", ""),
        ("patches encoded", f"{cm['vision_patches']:g}", f"{ct['vision_patches']:g}", ""),
        ("LM forwards (with grad)", f"{cm['lm_calls']:g} ({cm['lm_grad_calls']:g})",
         f"{ct['lm_calls']:g} ({ct['lm_grad_calls']:g})", ""),
        ("LM token positions (with grad)", f"{cm['lm_tokens']:g} ({cm['lm_grad_tokens']:g})",
         f"{ct['lm_tokens']:g} ({ct['lm_grad_tokens']:g})", ""),
        ("vision encoder time (s)", f"{cm['vision_s']:.4f}", f"{ct['vision_s']:.4f}", ""),
        ("LM forward time, no backward (s)", f"{cm['lm_forward_s']:.3f}", f"{ct['lm_forward_s']:.3f}", ""),
        ("peak step tensor memory per sample (MiB)", f"{m['peak_step_mib_per_sample']:.2f}",
         f"{t['peak_step_mib_per_sample']:.2f}", f"{memory_ratio:.2f}x less" if memory_ratio >= 1 else
         f"{1 / memory_ratio:.2f}x more"),
    ]
    print()
    print(table(rows))
    print(f"\nsettings: {args.prompts} prompts x {args.group} completions, max_new_tokens {args.max_new_tokens}, "
          f"batch {args.batch_size}, {args.inner_epochs} inner epochs, beta {args.beta}, lr {args.lr}, "
          f"{args.threads} thread(s), {args.steps} timed steps x {args.repeats} run(s) each")
    if problems:
        print("WORKLOAD MISMATCH: " + "; ".join(problems))
    report = {
        "benchmark": "vlm_grpo_vs_trl",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k not in ("child", "child_out")} | {
            "model": (f"random Qwen2.5-VL, decoder {args.hidden} x {args.layers}" if args.hidden
                      else "tiny:qwen2_5_vl"),
            "model_dir": str(model_dir), "engine": "vLLM colocated" if args.vllm else "HF generate",
            "dataset": "tiny:grounding",
            "dataset_jsonl": str(data), "rewards": REWARD_WEIGHTS, "completions_per_step": n,
            "fine_tuning": "every parameter, vision tower included" if args.train_vision
            else "full language model, vision tower frozen", "dtype": "float32", "device": "cpu",
            "processes": 1,
            "minibatch_order": {
                "mmrl": runs["mmrl"][0]["minibatch_order"] + (
                    " (each prompt's completions together, verl's order)"
                    if runs["mmrl"][0]["minibatch_order"] == "groups" else " (shuffled)"),
                "trl": "samples (GRPOTrainer shuffles each generation batch, shuffle_sequence_dict)"}},
        "versions": versions(),
        "ratio_steps_per_s_mmrl_over_trl": ratio,
        "ratio_median_step_trl_over_mmrl": ratio_median,
        "ratio_peak_step_memory_per_sample_trl_over_mmrl": memory_ratio,
        "mmrl": m, "trl": t,
        "workload_problems": problems,
        "workload_checks": {
            "completions_per_step": n,
            "prompt_token_ids_identical_samples": None if problems else same_prompts,
            "lm_token_positions_per_step": {"mmrl": cm["lm_tokens"], "trl": ct["lm_tokens"]},
        },
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    print(json.dumps({"bench": "vlm-grpo", "speedup_vs_trl": ratio, "median_step_speedup_vs_trl": ratio_median,
                      "peak_step_memory_per_sample_trl_over_mmrl": memory_ratio, "ok": not problems,
                      "problems": problems, "out": str(args.out)}))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
