"""``mmrl sft CONFIG [key=value ...]``: supervised fine-tuning of a Qwen-VL model on ``<think>/<answer>`` targets.

What it is for: the RL recipes (``mmrl train``, ``model.family: qwen_vl``) need a policy that already writes
answers the rewards can parse; a random tiny model never does (every reward 0, nothing to learn). This command
trains a small Qwen-VL-architecture model (built from scratch, ``model.base: tiny:qwen2_5_vl`` with configurable
widths, or any ``save_pretrained`` folder / hub id) on the same JSONL that ``mmrl train`` reads
(:mod:`mmrl.data.vlm`), each line carrying the completion to imitate in a field (``data.target_field``, default
``"sft_target"``, e.g. ``"<think>The red circle is on the left.</think><answer>[3, 5, 20, 22]</answer>"``). The
output is a Hugging Face folder (model + processor, ``save_pretrained``) that ``mmrl train`` loads as
``model.family: qwen_vl, model.pretrained: <folder>``.

Prompts: exactly the policy's
-------------------------------
Every prompt is built by :meth:`mmrl.pipelines.vlm.qwen.QwenVLPolicy.encode_prompts` of a policy made by
:func:`mmrl.build.build_vlm_policy` from this config's ``generation`` section (the very
:class:`mmrl.config.GenerationConfig` of ``mmrl train``: system prompt, ``question_template``, chat template with
its image / video tokens, pixel budgets, video frame rule, media loading by :func:`mmrl.build.vlm_media`). So the
tokens the model is trained to continue are the tokens a GRPO rollout starts from, and nothing about prompts is
written twice. ``RUN/mmrl_train.yaml`` holds the ``model`` and ``generation`` sections to paste into a
``mmrl train`` config so its rollouts use the same settings (the saved processor carries the pixel budget too).

The loss: TRL's completion-only SFT
-----------------------------------
A batch is built as TRL's ``DataCollatorForVisionLanguageModeling._collate_prompt_completion``
(``trl/trainer/sft_trainer.py``) builds a prompt-completion batch: the prompts (with their images / video) left-padded
by the processor, the completions right-padded after them, ``mm_token_type_ids`` extended with zeros (text) over
the completion, and ``labels = input_ids`` with ``-100`` wherever ``attention_mask == 0`` (padding) or the token is
not in the completion (``completion_only_loss=True``, the default for prompt-completion data). The loss is the
causal-LM cross-entropy of transformers' ``ForCausalLMLoss`` (logits at ``t`` predict ``labels[t + 1]``,
``ignore_index=-100``), summed over the completion tokens of an optimizer step and divided by their number
(transformers ``Trainer``'s ``num_items_in_batch`` normalisation under gradient accumulation): the mean token
cross-entropy of the completion tokens, which get the only gradient. :func:`completion_loss` is that function.
TRL 1.16 applies ``num_items_in_batch`` to Qwen2-VL only: transformers marks Qwen2.5-VL and Qwen3-VL
``accepts_loss_kwargs = False``, so for them TRL averages each micro-batch's token mean over the accumulation steps
and its update depends on the split (20 % apart in gradient on a tiny Qwen2.5-VL, 2 x 2 with 51 / 116 completion
tokens); mmrl keeps the step-total rule for every model (mmrl's rule: the split never changes the update).

The completion is the target text's tokens followed by the end-of-turn token ``<|im_end|>``, the token the
policy's rollouts stop on and the last one their completion mask covers (``pipelines/vlm/qwen.py``
``_completion_mask``). TRL renders the completion with the chat template and so also trains the ``"\\n"`` the
template writes after ``<|im_end|>``, which a rollout never generates: mmrl leaves it out (mmrl's own rule).
Vision placeholder tokens only occur in prompts, so they never carry a label.

Runs
----
``output_dir`` gets ``config.yaml`` (the resolved config), ``base/`` (a from-scratch base model, built once),
``metrics.jsonl`` (``step``, ``loss``, ``lr``, ``grad_norm``, ``tokens``, ``time/step``, and every ``eval.every``
steps on ``data.eval``: ``eval/loss``, ``eval/exact_match`` (greedy answer == target), ``eval/reward/<key>``: the
routed grounding / counting / temporal rewards of ``eval.rewards``), ``checkpoints/step_<k>/`` (atomic,
:mod:`mmrl.checkpoint`: every trainable tensor, optimizer, LR schedule, RNG, data position; ``export/`` a loadable
model folder) and, at the end, ``model/`` (``save_pretrained`` model + processor, written atomically). A killed run
continues from its newest complete checkpoint with ``resume: auto`` (the default); resuming is exact (nothing in a
step is random: the data order is a seeded permutation by position, there is no dropout), so 2 steps + resume + 2
steps equal 4 steps. SIGINT / SIGTERM stop after the current step with a checkpoint.

Several processes (``accelerate launch -m mmrl.cli sft``) split each step's samples; gradients are averaged over
processes, and each process divides its token losses by the step's completion tokens over every process times the
process count, so the update is the token mean over all processes' samples whichever process holds them (TRL's
default, ``average_tokens_across_devices``; tested with a two-process reduction stand-in).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import yaml

from mmrl.config import (ConfigError, GenerationConfig, _build, _set_dotted, config_from_dict, config_to_dict,
                         dump_config, opt, parse_overrides, read_config_file, yaml_key_lines)
from mmrl.data.prompts import DataError
from mmrl.data.shapeworld import TIMELINE_FPS, check_vlm_spec
from mmrl.distributed import deepspeed_stage, is_dtensor

logger = logging.getLogger(__name__)

__all__ = ["SFTConfig", "SFTModelConfig", "SFTDataConfig", "SFTTrainConfig", "SFTEvalConfig", "SFTLoggingConfig",
           "load_sft_config", "validate_sft", "read_sft_data", "resolve_sft_data", "build_base_model",
           "policy_config", "SFTBatch", "collate", "target_ids", "completion_loss", "batch_loss", "SFTRun", "run_sft",
           "main", "TINY_KINDS", "DEFAULT_EVAL_REWARDS"]

#: ``model.base: tiny:<kind>`` kinds (the tiny builders of :mod:`mmrl.pipelines.vlm.tiny`).
TINY_KINDS = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl")

#: Default ``eval.rewards``: each held-out line scored by its task's reward (Mixed-R1's routing,
#: :class:`mmrl.rewards.routing.TaskRoutedReward`), plus the think/answer format. Box coordinates are read in the
#: model's own format (set from its model type by :func:`mmrl.build.build_reward_fn`).
DEFAULT_EVAL_REWARDS = {
    "answer": {"reward": "task_routed", "kwargs": {"routes": {
        "grounding": {"iou": 1.0},
        "counting": {"numeric_accuracy": 1.0},
        "numeric": {"numeric_accuracy": 1.0},
        "temporal_grounding": {"temporal_iou": 1.0},
    }}},
    "think_answer_format": 1.0,
}

#: Config fields a resume cannot change: they define what the checkpoint's weights, prompts and data position mean.
FIXED_ON_RESUME = ("seed", "model.", "generation.", "data.train", "data.target_field", "data.shuffle")


# ================================================================================================ config


@dataclass
class SFTModelConfig:
    """The model to fine-tune (full fine-tuning: every language-model weight, and the vision tower unless frozen)."""

    base: str = opt("tiny:qwen2_5_vl",
                    "'tiny:qwen2_5_vl' / 'tiny:qwen2_vl' / 'tiny:qwen3_vl': a randomly initialised model of that "
                    "architecture built from scratch (mmrl.pipelines.vlm.tiny's tokenizer, processor and layout, with "
                    "the widths below) into output_dir/base; or a save_pretrained folder / hub id to fine-tune.")
    revision: str | None = opt(None, "Hub revision of a hub-id `base`.")
    init_seed: int = opt(0, "Seed of a from-scratch base's random initialisation.")
    hidden_size: int | None = opt(None, "tiny base: text hidden size (null: the tiny default, 64). head_dim = "
                                  "hidden_size / num_heads must be a multiple of 16 (M-RoPE sections).")
    num_layers: int | None = opt(None, "tiny base: text decoder layers (null: 2).")
    num_heads: int | None = opt(None, "tiny base: text attention heads (null: 4).")
    num_kv_heads: int | None = opt(None, "tiny base: key/value heads, dividing num_heads (GQA; null: 2).")
    intermediate_size: int | None = opt(None, "tiny base: SwiGLU width (null: 2 x hidden_size).")
    vision_depth: int | None = opt(None, "tiny base: vision blocks (null: 2; Qwen3-VL 3).")
    vision_hidden_size: int | None = opt(None, "tiny base: vision width (null: 32).")
    vision_heads: int | None = opt(None, "tiny base: vision attention heads (null: 2).")
    vision_intermediate_size: int | None = opt(None, "tiny base: vision MLP width (null: 2 x vision_hidden_size; "
                                               "Qwen2-VL uses mlp_ratio 2 instead).")
    rope_theta: float | None = opt(None, "tiny base: the text model's RoPE base (null: the real models' 1e6 for "
                                   "Qwen2/2.5-VL, 5e6 for Qwen3-VL). M-RoPE gives the image rows and columns the "
                                   "lowest frequencies, which at 1e6 and a small head_dim turn a whole image grid by "
                                   "under a thousandth of a radian: the text model cannot tell where a patch is. A "
                                   "small base (e.g. 10) makes patch positions visible.")
    vision_position_std: float | None = opt(
        None, "tiny:qwen3_vl base: standard deviation of the vision tower's learned position embeddings at "
        "initialisation (null: transformers' initializer_range, 0.02). At 0.02 they are ~20x smaller than the patch "
        "embeddings, and the merged image tokens come out carrying no absolute position (a linear probe of a shape's "
        "token finds nothing), so the text model cannot say where a shape is. Larger values put the position into "
        "each token's content: ShapeWorld box-grounding SFT reached Acc@0.5 0.04 / 0.18 / 0.41 at null / 1.0 / 2.0 "
        "(README). Qwen2-VL / Qwen2.5-VL have no absolute position embeddings (rejected there).")
    dtype: str = opt("float32", "Dtype the model is loaded in; trained weights are kept in fp32.",
                     choices=("float32", "bfloat16", "float16"))
    freeze_vision: bool = opt(False, "Keep the vision tower frozen. A from-scratch tower must learn to see: leave "
                              "false for a tiny base; true is the usual choice for a pretrained Qwen-VL.")
    attn_implementation: str | None = opt(None, "transformers attention kernel ('sdpa', 'eager', ...); null: default.")
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory.")


@dataclass
class SFTDataConfig:
    """Training and held-out data: mmrl's VLM JSONL (mmrl.data.vlm) with a target completion per line."""

    train: str | None = opt(None, "Training JSONL (mmrl.data.vlm format; media paths relative to its folder); "
                            "every line needs `target_field`. 'shapeworld:train:<n>': n ShapeWorld lines "
                            "(mmrl.data.shapeworld.write_vlm_dataset, boxes in the model's coordinate format) "
                            "written once into output_dir/data.")
    eval: str | None = opt(None, "Held-out JSONL in the same format, for eval.every (null: no evaluation); "
                           "'shapeworld:heldout:<n>' as for train.")
    target_field: str = opt("sft_target", "The line field holding the completion to train on: "
                            "'<think>...</think><answer>...</answer>' text.")
    shuffle: bool = opt(True, "Shuffle the training lines each pass (seeded by `seed`).")
    skip_bad_samples: bool = opt(False, "Skip (and count) lines with missing or corrupt media instead of stopping.")
    thought_dropout: float = opt(0.0, "TON's thought dropout (Wang et al. 2025, arXiv 2505.16854): each training "
                                      "target's <think> block is replaced by an empty thought with this probability "
                                      "(seeded by seed, step and process), a cold start for GRPO that may skip "
                                      "thinking; 0 = off.")


@dataclass
class SFTTrainConfig:
    """The optimisation loop: AdamW on the completion-token cross-entropy."""

    steps: int = opt(200, "Optimizer steps.")
    batch_size: int = opt(8, "Samples per forward pass on each process.")
    gradient_accumulation_steps: int = opt(1, "Forward passes per optimizer step; the loss is normalised by the "
                                           "completion tokens of the whole step (transformers' num_items_in_batch; TRL "
                                           "1.16 uses it for Qwen2-VL only, averaging micro-batch means for "
                                           "Qwen2.5-VL / Qwen3-VL).")
    lr: float = opt(1e-3, "Peak learning rate (a from-scratch tiny model: 1e-3; a pretrained 3B model: ~1e-5).")
    lr_scheduler: str = opt("cosine", "LR schedule after warmup.", choices=("constant", "linear", "cosine"))
    warmup_steps: int = opt(0, "Linear warmup optimizer steps: step k (from 0) of W runs at (k + 1) / W of "
                                 "the lr (mmrl's rule; transformers' and diffusers' schedulers run step 0 at lr 0, "
                                 "k / W).")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    betas: list = opt([0.9, 0.999], "AdamW betas.")
    adam_eps: float = opt(1e-8, "AdamW epsilon.")
    max_grad_norm: float = opt(1.0, "Gradient norm clipping; 0 disables (the norm is still logged).")
    mixed_precision: str = opt("no", "accelerate mixed precision.", choices=("no", "bf16", "fp16"))


@dataclass
class SFTEvalConfig:
    """Evaluation on data.eval: token loss and greedy answers scored with mmrl's rewards."""

    every: int = opt(50, "Evaluate every this many steps (and after the last); 0 off.")
    limit: int = opt(64, "Held-out lines evaluated (the first ones of data.eval).")
    batch_size: int = opt(8, "Lines per evaluation forward / generation call.")
    rewards: dict = opt(DEFAULT_EVAL_REWARDS,
                        "Rewards scoring the greedy answers (the `rewards:` format of mmrl train, logged as "
                        "eval/reward/<key>); default: task-routed iou (grounding), numeric_accuracy (counting, "
                        "numeric), temporal_iou (temporal_grounding), and think_answer_format.")


@dataclass
class SFTLoggingConfig:
    """Outputs."""

    save_every: int = opt(50, "Write checkpoints/step_<k>/ every this many steps (and at the end); 0: only the end.")
    keep_last: int = opt(2, "Checkpoints kept on disk.")
    log_every: int = opt(1, "Write a metrics.jsonl line every this many steps.")
    tensorboard: bool = opt(False, "Also write TensorBoard events under output_dir/tensorboard.")
    progress_bar: bool = opt(True, "Show a progress bar.")


@dataclass
class SFTConfig:
    """A supervised fine-tuning run (``mmrl sft``)."""

    output_dir: str = opt("runs/sft", "Where config.yaml, metrics.jsonl, base/, checkpoints/ and model/ go.")
    seed: int = opt(0, "Seed of the data order.")
    resume: str | None = opt("auto", "'auto': continue from the newest complete checkpoint in output_dir if there is "
                             "one; a checkpoint folder; null: a new run (refused if output_dir has checkpoints).")
    model: SFTModelConfig = field(default_factory=SFTModelConfig, metadata={"help": "The model."})
    generation: GenerationConfig = field(default_factory=GenerationConfig, metadata={
        "help": "Prompt construction and greedy answers: the same section (and defaults) as mmrl train's, so the "
                "prompts trained on are the policy's rollout prompts. max_new_tokens bounds the targets."})
    data: SFTDataConfig = field(default_factory=SFTDataConfig, metadata={"help": "Data."})
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig, metadata={"help": "The loop."})
    eval: SFTEvalConfig = field(default_factory=SFTEvalConfig, metadata={"help": "Evaluation."})
    logging: SFTLoggingConfig = field(default_factory=SFTLoggingConfig, metadata={"help": "Outputs."})


_WIDTHS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vision_depth",
           "vision_hidden_size", "vision_heads", "vision_intermediate_size", "rope_theta")


def _tiny_kind(base: str) -> str | None:
    return base.split(":", 1)[1] if base.startswith("tiny:") else None


def _timeline_specs(d: SFTDataConfig) -> list[tuple[str, str]]:
    """``(key, spec)`` of the ShapeWorld specs in ``data.train`` / ``data.eval`` that name a timeline task, whose
    targets copy the timestamps of a Qwen3-VL prompt at :data:`~mmrl.data.shapeworld.TIMELINE_FPS`."""
    return [(key, spec) for key, spec in (("data.train", d.train), ("data.eval", d.eval))
            if isinstance(spec, str) and spec.startswith("shapeworld:") and "temporal_grounding_timeline" in spec]


def validate_sft(config: SFTConfig, *, check_files: bool = True) -> None:
    """Ranges and consistency (messages start with the dotted key), then what ``generation`` and ``eval.rewards``
    must satisfy, checked by :func:`mmrl.config.validate` on the policy config they become."""
    m, d, t, e, log = config.model, config.data, config.train, config.eval, config.logging
    kind = _tiny_kind(m.base)
    checks = [
        (0 <= config.seed < 2**63, "seed: must be in [0, 2**63)"),
        (bool(config.output_dir.strip()), "output_dir: must not be empty"),
        (bool(m.base.strip()), "model.base: must name a model (tiny:<kind>, a folder or a hub id)"),
        (kind is None or kind in TINY_KINDS, f"model.base: unknown tiny kind {kind!r}; expected one of "
                                             f"{', '.join('tiny:' + k for k in TINY_KINDS)}"),
        (d.train is not None, "data.train: a training JSONL is required (mmrl.data.vlm format with a "
                              f"{d.target_field!r} field per line)"),
        (bool(d.target_field.strip()), "data.target_field: must name a field"),
        (0.0 <= d.thought_dropout <= 1.0, "data.thought_dropout must be in [0, 1]"),
        (t.steps >= 1, "train.steps: must be >= 1"),
        (t.batch_size >= 1, "train.batch_size: must be >= 1"),
        (t.gradient_accumulation_steps >= 1, "train.gradient_accumulation_steps: must be >= 1"),
        (t.lr > 0 and math.isfinite(t.lr), "train.lr: must be a number > 0"),
        (t.warmup_steps >= 0, "train.warmup_steps: must be >= 0"),
        (t.weight_decay >= 0, "train.weight_decay: must be >= 0"),
        (t.max_grad_norm >= 0, "train.max_grad_norm: must be >= 0 (0 disables clipping)"),
        (t.adam_eps > 0, "train.adam_eps: must be > 0"),
        (len(t.betas) == 2 and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                   for b in t.betas), "train.betas: must be two numbers in [0, 1)"),
        (e.every >= 0, "eval.every: must be >= 0 (0 turns evaluation off)"),
        (e.limit >= 1 and e.batch_size >= 1, "eval.limit: eval.limit and eval.batch_size must be >= 1"),
        (not e.every or bool(e.rewards), "eval.rewards: at least one reward is needed while eval.every > 0"),
        (log.save_every >= 0, "logging.save_every: must be >= 0 (0 saves only at the end)"),
        (log.keep_last >= 1, "logging.keep_last: must be >= 1"),
        (log.log_every >= 1, "logging.log_every: must be >= 1"),
    ]
    for key in _WIDTHS:
        value = getattr(m, key)
        checks.append((value is None or value >= 1, f"model.{key}: must be >= 1 (or null for the tiny default)"))
        checks.append((value is None or kind is not None,
                       f"model.{key}: widths apply to a from-scratch base (model.base: tiny:<kind>), not to "
                       f"{m.base!r}; remove it"))
    std = m.vision_position_std
    checks += [
        (std is None or (std > 0 and math.isfinite(std)), "model.vision_position_std: must be a number > 0 (or null)"),
        (std is None or kind == "qwen3_vl",
         f"model.vision_position_std: only a from-scratch tiny:qwen3_vl base has learned absolute position "
         f"embeddings in its vision tower (model.base is {m.base!r}); remove it"),
    ]
    g = config.generation
    timeline = _timeline_specs(d)
    checks.append((not timeline or (g.video_nframes is None and g.video_fps == TIMELINE_FPS),
                   f"{timeline[0][0] if timeline else 'data.train'}: the temporal_grounding_timeline targets name the "
                   f"timestamps a prompt shows at {TIMELINE_FPS:g} frames per second (mmrl.data.shapeworld."
                   f"TIMELINE_FPS); set generation.video_fps: {TIMELINE_FPS:g} and leave generation.video_nframes "
                   f"null (got video_fps {g.video_fps}, video_nframes {g.video_nframes})"))
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if kind is not None:
        hidden, heads = m.hidden_size or 64, m.num_heads or 4
        kv = m.num_kv_heads or min(2, heads)
        if hidden % heads or (hidden // heads) % 16:
            raise ConfigError(f"model.hidden_size: {hidden} / num_heads {heads} must be a whole head_dim that is a "
                              f"multiple of 16 (M-RoPE splits head_dim / 2 into t, h, w sections as 1:1.5:1.5)")
        if heads % kv:
            raise ConfigError(f"model.num_kv_heads: {kv} must divide num_heads {heads}")
        vhidden, vheads = m.vision_hidden_size or 32, m.vision_heads or 2
        if vhidden % vheads or (vhidden // vheads) % 4:
            raise ConfigError(f"model.vision_hidden_size: {vhidden} / vision_heads {vheads} must be a whole head "
                              f"dim that is a multiple of 4 (2-D rotary positions)")
    if e.every and d.eval is None:
        logger.info("data.eval is not set: no evaluation")
    # generation.* and eval.rewards: mmrl train's own checks, on the policy config they make
    try:
        policy_config(config, "tiny:qwen2_5_vl" if kind is None else m.base, d.train or "x.jsonl", check_files=False)
    except ConfigError as exc:
        raise ConfigError(re.sub(r"^rewards\b", "eval.rewards", str(exc))) from None
    if check_files:
        for key, path in (("data.train", d.train), ("data.eval", d.eval)):
            if path is not None and path.startswith("shapeworld:"):
                problem = check_vlm_spec(path)
                if problem:
                    raise ConfigError(f"{key}: {problem}")
            elif path is not None and not Path(path).expanduser().is_file():
                where = "" if Path(path).expanduser().is_absolute() else \
                    f"relative paths are resolved from the working directory {Path.cwd()}; "
                raise ConfigError(f"{key}: file not found: {path} ({where}or write ShapeWorld lines on the spot with "
                                  f"shapeworld:train:<n> / shapeworld:heldout:<n>)")
        local = Path(m.base).expanduser()
        if kind is None and (local.exists() or m.base.startswith((".", "/", "~"))) and \
                not (local / "config.json").is_file():
            raise ConfigError(f"model.base: {m.base} is not a save_pretrained folder (no config.json)")
        resume = config.resume
        if resume not in (None, "auto"):
            if not (Path(resume).expanduser() / "state.json").is_file():
                raise ConfigError(f"resume: {resume} is not a complete checkpoint (no state.json); resume=auto "
                                  f"continues from the newest one in output_dir")


def _where(path: Path, text: str, message: str, overrides: Sequence[str]) -> str:
    """``file:line`` of the key a config error is about (the override that set it, if one did), else the file."""
    match = (re.match(r"unknown config key '([^']+)'", message) or re.match(r"([A-Za-z_]\w*(?:\.\w+)+)\b", message)
             or re.match(r"([A-Za-z_]\w*):", message))
    key = match.group(1) if match else None
    if key:
        for item in overrides:
            if item.split("=", 1)[0].strip() == key or key.startswith(item.split("=", 1)[0].strip() + "."):
                return f"{path} (override {item!r})"
        lines = yaml_key_lines(text)
        parts = key.split(".")
        for n in range(len(parts), 0, -1):  # the key itself, else its nearest enclosing section
            line = lines.get(".".join(parts[:n]))
            if line is not None:
                return f"{path}:{line}"
    return str(path)


def load_sft_config(path: str | Path, overrides: Sequence[str] | None = None, *,
                    check_files: bool = True) -> SFTConfig:
    """Read an SFT YAML config, apply dotted ``key=value`` overrides (YAML values), validate.

    Loading is :mod:`mmrl.config`'s (its ``_build``: unknown keys rejected naming the nearest full key, types
    checked, choices enforced; ``parse_overrides``), so ``mmrl sft`` configs behave like ``mmrl train`` ones. Every
    error is one :class:`~mmrl.config.ConfigError` line naming the file and the line of the key
    (``cfg.yaml:7: unknown config key 'train.stpes'; did you mean 'train.steps'?``), or the override that set it.
    Relative paths resolve from the working directory. ``check_files=False`` skips the checks of this machine's
    files (data, base folder, resume checkpoint)."""
    path = Path(path)
    overrides = list(overrides or [])
    text, data = read_config_file(path)
    try:
        if not isinstance(data, dict):
            raise ConfigError(f"config: expected a mapping of sections, got {type(data).__name__}")
        for key, value in parse_overrides(overrides):
            _set_dotted(data, key, value, SFTConfig)
        config = _build(SFTConfig, data)
        validate_sft(config, check_files=check_files)
    except ConfigError as exc:
        raise ConfigError(f"{_where(path, text, str(exc), overrides)}: {exc}") from None
    return config


def policy_config(config: SFTConfig, pretrained: str, dataset: str, *, check_files: bool = True):
    """The :class:`mmrl.config.Config` of the policy that builds the SFT prompts and answers (full fine-tuning of
    ``pretrained``, this config's ``generation`` section, ``eval.rewards``): the config ``mmrl train`` would have
    for the same model and generation settings."""
    m = config.model
    return config_from_dict({
        "output_dir": config.output_dir, "seed": config.seed,
        "model": {"family": "qwen_vl", "pretrained": pretrained, "revision": m.revision, "dtype": m.dtype,
                  "use_lora": False, "freeze_vision": m.freeze_vision, "attn_implementation": m.attn_implementation,
                  "gradient_checkpointing": m.gradient_checkpointing},
        "generation": dataclasses.asdict(config.generation),
        "data": {"dataset": dataset, "skip_bad_samples": config.data.skip_bad_samples, "prompts_per_step": 1,
                 "group_size": 2},
        "train": {"batch_size": 1, "mixed_precision": config.train.mixed_precision},
        "rewards": config.eval.rewards or {"think_answer_format": 1.0},
    }, check_files=check_files)


# ================================================================================================ data


def read_sft_data(path: str | Path, target_field: str, *, skip_bad: bool = False) -> list:
    """The lines of a VLM JSONL (:func:`mmrl.data.vlm.read_vlm_jsonl`: fields, media files and their structure
    checked) whose ``target_field`` is a non-empty string (kept in ``sample.metadata[target_field]``). A line
    without it is a :class:`DataError` ``"<file>:<line>: ..."`` (with ``skip_bad``: skipped and counted)."""
    from mmrl.data.vlm import read_vlm_jsonl

    samples = read_vlm_jsonl(path, skip_bad=skip_bad, verify_images=True, verify_videos=True)
    return _with_target(samples, path, target_field, skip_bad=skip_bad)


def _with_target(samples, path: str | Path, target_field: str, *, skip_bad: bool):
    """The samples whose ``target_field`` is a non-empty string (:func:`read_sft_data`'s rule)."""
    from mmrl.data.vlm import SampleList

    kept, problems = [], list(samples.problems)
    for sample in samples:
        target = sample.metadata.get(target_field)
        if not isinstance(target, str) or not target.strip():
            got = "missing" if target_field not in sample.metadata else f"{type(target).__name__} {target!r:.40}"
            problem = (f"{sample.source}: field {target_field!r} (the completion to train on, a non-empty string "
                       f"such as '<think>...</think><answer>...</answer>') is {got}")
            if not skip_bad:
                raise DataError(problem)
            logger.warning("skipping %s", problem)
            problems.append(problem)
            continue
        kept.append(sample)
    if not kept:
        raise DataError(f"{path}: no line with a {target_field!r} field")
    return SampleList(kept, problems)


def check_sft_data(config: SFTConfig, *, media: bool = True) -> list[str]:
    """``mmrl config validate`` of an ``mmrl sft`` config: every line of ``data.train`` and ``data.eval`` checked
    as ``mmrl train`` checks its data (:func:`mmrl.data.validate.check_data`: fields, media files, and with
    ``media`` every image and the video frames training reads decoded), then each line's ``data.target_field``.
    Returns one summary per set; raises :class:`DataError` listing the problems (unless
    ``data.skip_bad_samples``). A ``shapeworld:`` set is written by the run itself and is not read here."""
    from mmrl.data.validate import check_data
    from mmrl.data.vlm import read_vlm_jsonl

    lines = []
    for role, spec in (("train", config.data.train), ("eval", config.data.eval)):
        if spec is None:
            continue
        if spec.startswith("shapeworld:"):
            lines.append(f"{role}: {spec} (written by the run)")
            continue
        report = check_data(policy_config(config, "tiny:qwen2_5_vl", spec, check_files=False), media=media)
        # the lines check_data read (its problems raised unless skip_bad_samples), media checked already
        parsed = read_vlm_jsonl(spec, skip_bad=True, verify_images=False, verify_videos=False)
        targets = _with_target(parsed, spec, config.data.target_field, skip_bad=config.data.skip_bad_samples)
        head = report.summary().partition("\n")[0]
        missing = len(parsed) - len(targets)
        lines.append(f"{role}: {head}" + (f"; {missing} without {config.data.target_field!r} skipped" if missing > 0
                                          else ""))
    return lines


def resolve_sft_data(spec: str, directory: str | Path, *, coord_format: str | None, seed: int = 0) -> str:
    """A JSONL path for ``data.train`` / ``data.eval``: a path as given, or for ``shapeworld:<split>:<n>[:<tasks>]``
    the ShapeWorld VLM set (:func:`mmrl.data.shapeworld.resolve_vlm_spec`: grounding, counting and temporal
    grounding lines with their ``sft_target``) written once into ``directory``, its boxes in ``coord_format``: the
    format the model answers in (Qwen2.5-VL ``qwen25``, Qwen2-VL / Qwen3-VL ``qwen2``)."""
    from mmrl.data.shapeworld import resolve_vlm_spec

    try:
        return resolve_vlm_spec(spec, coord_format=coord_format, seed=seed, directory=directory)
    except ValueError as exc:
        raise ConfigError(f"data: {exc}") from None


# ================================================================================================ model


def _tiny_dims(kind: str, m: SFTModelConfig, text: dict, vision: dict) -> None:
    """Write the configured widths into a tiny model's text / vision config dicts (in place)."""
    hidden = m.hidden_size or text["hidden_size"]
    heads = m.num_heads or text["num_attention_heads"]
    layers = m.num_layers or text["num_hidden_layers"]
    head_dim = hidden // heads
    text.update(hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=layers,
                num_key_value_heads=m.num_kv_heads or min(text["num_key_value_heads"], heads),
                intermediate_size=m.intermediate_size or 2 * hidden)
    if "max_window_layers" in text:
        text["max_window_layers"] = layers
    if text.get("layer_types") is not None:
        text["layer_types"] = ["full_attention"] * layers
    if "head_dim" in text:
        text["head_dim"] = head_dim
    rope = dict(text.get("rope_parameters") or {})
    rope["mrope_section"] = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]  # the real [16, 24, 24] ratio
    if m.rope_theta is not None:
        rope["rope_theta"] = float(m.rope_theta)
    text["rope_parameters"] = rope
    depth = m.vision_depth or vision["depth"]
    vheads = m.vision_heads or vision["num_heads"]
    vision.update(depth=depth, num_heads=vheads)
    if kind == "qwen2_vl":
        vision.update(embed_dim=m.vision_hidden_size or vision["embed_dim"], hidden_size=hidden)
    else:
        vwidth = m.vision_hidden_size or vision["hidden_size"]
        vision.update(hidden_size=vwidth, intermediate_size=m.vision_intermediate_size or 2 * vwidth,
                      out_hidden_size=hidden)
    if kind == "qwen2_5_vl":
        vision["fullatt_block_indexes"] = [depth - 1]
    if kind == "qwen3_vl":
        vision["deepstack_visual_indexes"] = [i for i in (0, 1) if i < depth - 1 and i < layers]


def build_base_model(m: SFTModelConfig, outdir: str | Path) -> Path:
    """A from-scratch ``tiny:<kind>`` base: the tiny model's tokenizer, processor, chat template and layout
    (:func:`mmrl.pipelines.vlm.tiny.ensure_tiny_vlm`) with ``m``'s widths, weights drawn with ``m.init_seed``;
    ``save_pretrained`` (model + processor) into ``outdir`` atomically. Returns ``outdir``."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, GenerationConfig as HFGen

    from mmrl.checkpoint import apply_umask
    from mmrl.pipelines.flow.tiny import _seeded
    from mmrl.pipelines.vlm.tiny import ensure_tiny_vlm

    kind = _tiny_kind(m.base)
    source = ensure_tiny_vlm(kind)
    config = AutoConfig.from_pretrained(source)
    data = config.to_dict()
    _tiny_dims(kind, m, data["text_config"], data["vision_config"])
    data.pop("_name_or_path", None)
    config = type(config).from_dict(data)
    with _seeded(m.init_seed):
        model = AutoModelForImageTextToText.from_config(config).eval()
        if m.vision_position_std is not None:
            with torch.no_grad():
                model.model.visual.pos_embed.weight.normal_(0.0, float(m.vision_position_std))
    model.generation_config = HFGen.from_pretrained(source)
    outdir = Path(outdir)
    tmp = outdir.with_name(f".{outdir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    AutoProcessor.from_pretrained(source).save_pretrained(tmp)
    apply_umask(tmp)
    shutil.rmtree(outdir, ignore_errors=True)
    os.replace(tmp, outdir)
    return outdir


# ================================================================================================ batches and loss


@dataclass
class SFTBatch:
    """A prompt-completion batch as TRL's VLM collator makes it: prompts left-padded, completions right-padded
    after them. ``labels`` is ``input_ids`` with -100 on prompt and padding tokens; ``model_kwargs`` the vision
    inputs (and ``mm_token_type_ids``) for the forward; ``completion_width`` the completion columns ``T``."""

    input_ids: torch.Tensor  # [B, Lp + T]
    attention_mask: torch.Tensor  # [B, Lp + T]
    labels: torch.Tensor  # [B, Lp + T]
    model_kwargs: dict
    completion_width: int
    samples: list  # the samples kept (bad media skipped with data.skip_bad_samples)
    targets: list[str]

    @property
    def num_tokens(self) -> int:
        return int((self.labels != -100).sum())


def target_ids(tokenizer, text: str, end_id: int) -> list[int]:
    """The completion tokens of a target: its text tokenized alone (no special tokens added), then ``end_id``."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [end_id]


def end_of_turn_id(policy) -> int:
    """The token a rollout ends on (``<|im_end|>`` in Qwen-VL vocabularies, the first of the policy's eos ids)."""
    return policy.eos_ids[0]


EMPTY_THOUGHT = "<think>\n\n</think>"
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.S)


def drop_thoughts(samples: list, probability: float, generator: torch.Generator, target_field: str) -> tuple[list, int]:
    """TON's thought dropout: each sample's target ``<think>...</think>`` replaced by :data:`EMPTY_THOUGHT` with
    ``probability`` (one draw per sample from ``generator``; a target without a think block is kept). Returns copies
    (the data source's samples are not changed) and how many were dropped."""
    if probability <= 0:
        return list(samples), 0
    draws = torch.rand(len(samples), generator=generator).tolist()
    out, dropped = [], 0
    for sample, draw in zip(samples, draws):
        target = sample.metadata[target_field]
        if draw < probability and _THINK_BLOCK.search(target):
            sample = dataclasses.replace(sample, metadata={**sample.metadata,
                                                           target_field: _THINK_BLOCK.sub(EMPTY_THOUGHT, target, 1)})
            dropped += 1
        out.append(sample)
    return out, dropped


def collate(policy, samples: list, target_field: str = "sft_target") -> SFTBatch:
    """One SFT batch for ``samples`` (each with ``metadata[target_field]``): the prompts exactly as the policy's
    rollouts encode them (:meth:`~mmrl.pipelines.vlm.qwen.QwenVLPolicy.encode_prompts`: chat template, system
    prompt, question template, images / video, left padding), the target tokens + end-of-turn right-padded after
    them, TRL's completion-only labels, and the vision kwargs the policy's own forward passes use."""
    from mmrl.data.prompts import EmptyBatchError

    inputs, vision, kept = policy.encode_prompts(samples)
    if not kept:
        raise EmptyBatchError("no usable sample in this batch (all skipped: see the skip counts)")
    samples = [samples[i] for i in kept]
    targets = [s.metadata[target_field] for s in samples]
    end = end_of_turn_id(policy)
    if policy.tools:
        return _collate_tool_traces(policy, samples, targets, inputs, vision, end)
    ids = [target_ids(policy.tokenizer, t, end) for t in targets]
    width = max(len(x) for x in ids)
    completion = torch.full((len(ids), width), policy.pad_id, dtype=inputs["input_ids"].dtype)
    completion_mask = torch.zeros((len(ids), width), dtype=inputs["attention_mask"].dtype)
    for row, x in enumerate(ids):
        completion[row, :len(x)] = torch.tensor(x)
        completion_mask[row, :len(x)] = 1
    prompt_ids, prompt_mask = inputs["input_ids"], inputs["attention_mask"]
    input_ids = torch.cat([prompt_ids, completion], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100  # padding
    labels[:, :prompt_ids.shape[1]] = -100  # completion_only_loss: every prompt token
    if policy.freeze_vision:
        policy._encode_vision(vision)  # frozen tower: features once, as in a rollout
    kwargs = policy._vision_kwargs(vision)
    if inputs.get("mm_token_type_ids") is not None:
        mm = inputs["mm_token_type_ids"]
        kwargs["mm_token_type_ids"] = torch.cat([mm, torch.zeros_like(completion, dtype=mm.dtype)], dim=1)
    return SFTBatch(input_ids, attention_mask, labels, kwargs, width, samples, targets)


def _collate_tool_traces(policy, samples, targets, inputs, vision, end) -> SFTBatch:
    """:func:`collate` with ``generation.tools``: each target's calls run on its image and their responses inserted
    as in a tool rollout (:func:`mmrl.pipelines.vlm.tool_rollout.trace`): attended to, labelled -100, their views
    after the prompt's images (TACO's first stage: SFT on tool-call traces)."""
    from mmrl.pipelines.vlm.qwen import Vision
    from mmrl.pipelines.vlm.tool_rollout import trace

    if policy.freeze_vision:
        policy._encode_vision(vision)
    rows = [trace(policy, t, v.images[0] if v.images else None, end, s.metadata)
            for t, v, s in zip(targets, vision, samples)]
    width = max(len(r.ids) for r in rows)
    prompt_ids, prompt_mask = inputs["input_ids"], inputs["attention_mask"]
    completion = torch.full((len(rows), width), policy.pad_id, dtype=prompt_ids.dtype)
    attention = torch.zeros((len(rows), width), dtype=prompt_mask.dtype)
    labels = torch.full((len(rows), width), -100, dtype=prompt_ids.dtype)
    types = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids = torch.tensor(r.ids, dtype=prompt_ids.dtype)
        completion[i, :len(ids)] = ids
        attention[i, :len(ids)] = 1
        labels[i, :len(ids)] = torch.where(torch.tensor(r.own, dtype=torch.bool), ids, torch.full_like(ids, -100))
        types[i, :len(ids)] = torch.tensor(r.types)
    kwargs = policy._vision_kwargs([Vision.join([v, *r.views]) for v, r in zip(vision, rows)])
    if inputs.get("mm_token_type_ids") is not None:
        mm = inputs["mm_token_type_ids"]
        kwargs["mm_token_type_ids"] = torch.cat([mm, types.to(mm.dtype)], dim=1)
    input_ids = torch.cat([prompt_ids, completion], dim=1)
    full_labels = torch.cat([torch.full_like(prompt_ids, -100), labels], dim=1)
    return SFTBatch(input_ids, torch.cat([prompt_mask, attention], dim=1), full_labels, kwargs, width, samples,
                    targets)


def completion_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(sum of token cross-entropies, number of labelled tokens)``: transformers' causal-LM loss
    (``ForCausalLMLoss``: ``logits[:, t]`` predicts ``labels[:, t + 1]``, ``ignore_index=-100``, fp32) with
    ``reduction="sum"``, so the caller divides by the tokens of the whole optimizer step. ``logits`` may cover
    only the last ``k`` positions (``logits_to_keep``): they are aligned with the last ``k`` labels."""
    k = logits.shape[1]
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, -k:][:, 1:].to(logits.device)
    total = torch.nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]),
                                              shift_labels.reshape(-1), ignore_index=-100, reduction="sum")
    return total, int((shift_labels != -100).sum())


def summed_over_processes(accelerator, value: float) -> float:
    """``value`` summed over every process (itself with one process), in float64."""
    if accelerator.num_processes == 1:
        return value
    total = torch.tensor([float(value)], dtype=torch.float64, device=accelerator.device)
    return float(accelerator.reduce(total, "sum").item())


def batch_loss(policy, batch: SFTBatch, *, train: bool) -> tuple[torch.Tensor, int]:
    """The forward of one batch (train mode with gradients, else eval mode) -> :func:`completion_loss`. Logits
    are computed for the completion columns (+ the last prompt position) only: the prompt carries no label."""
    model = policy.train_model if train else policy.model
    model.train(train)
    device = policy.device
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.model_kwargs.items()}
    out = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device), **kwargs,
                logits_to_keep=batch.completion_width + 1, use_cache=False)
    return completion_loss(out.logits, batch.labels)


# ================================================================================================ the run


def _fixed_changes(saved: dict | None, now: dict, where) -> None:
    """A resume that changes a field of :data:`FIXED_ON_RESUME` is a :class:`ConfigError` listing the changes (the
    rule of :func:`mmrl.trainer.resume_changes`, with SFT's fixed fields); ``train.*``, ``eval.*`` and
    ``logging.*`` may change (e.g. more ``train.steps``)."""
    from mmrl.trainer import _flatten

    if not saved:
        return
    before, after = _flatten(saved), _flatten(now)
    fixed = [k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)
             and any(k == f or (f.endswith(".") and k.startswith(f)) for f in FIXED_ON_RESUME)]
    if fixed:
        diff = "; ".join(f"{k}: {before.get(k)!r} in the checkpoint, {after.get(k)!r} now" for k in fixed)
        raise ConfigError(f"cannot resume {where} with a changed {', '.join(fixed)} ({diff}): they define what the "
                          f"checkpoint's weights, prompts and data position mean; start a new output_dir instead")


class SFTRun:
    """One ``mmrl sft`` run: data read and checked, model built, then :meth:`train`. See the module docstring."""

    def __init__(self, config: SFTConfig):
        from accelerate import Accelerator

        from mmrl.build import build_reward_fn, build_vlm_policy
        from mmrl.checkpoint import latest_checkpoint, read_state
        from mmrl.data.vlm import VLMSampleSource
        from mmrl.trainer import build_lr_scheduler

        self.config = c = config
        self.output_dir = Path(c.output_dir)
        ckpts = self.output_dir / "checkpoints"
        self.resume_from = None
        if c.resume == "auto":
            self.resume_from = latest_checkpoint(ckpts)
        elif c.resume:
            self.resume_from = Path(c.resume)
        elif latest_checkpoint(ckpts) is not None:
            raise ConfigError(f"{self.output_dir} already holds a run with checkpoints: set resume=auto to continue "
                              f"it or choose another output_dir (nothing was overwritten)")
        self.saved_state = None
        if self.resume_from is not None:
            self.saved_state = read_state(self.resume_from)
            _fixed_changes(self.saved_state.get("config"), config_to_dict(c), self.resume_from)
        # data before any model: a bad line stops the run at once
        from mmrl.eval.vlm import _model_coord_format

        d = c.data
        self.model_type, coord_format = _model_coord_format(policy_config(c, c.model.base, "x.jsonl",
                                                                          check_files=False))
        timeline = _timeline_specs(d)
        if timeline and self.model_type is not None and self.model_type != "qwen3_vl":
            raise ConfigError(f"{timeline[0][0]}: the temporal_grounding_timeline targets copy the <t seconds> "
                              f"timestamps a Qwen3-VL prompt shows; model.base {c.model.base!r} is a "
                              f"{self.model_type}, whose prompt has none (use a Qwen3-VL base, e.g. "
                              f"shapeworld:qwen_vl_grounding or tiny:qwen3_vl)")
        data_dir = self.output_dir / "data"
        self.train_path = resolve_sft_data(d.train, data_dir, coord_format=coord_format, seed=c.seed)
        self.train_samples = read_sft_data(self.train_path, d.target_field, skip_bad=d.skip_bad_samples)
        self.eval_path, self.eval_samples = None, []
        if d.eval is not None and c.eval.every:
            self.eval_path = resolve_sft_data(d.eval, data_dir, coord_format=coord_format, seed=c.seed)
            self.eval_samples = list(read_sft_data(self.eval_path, d.target_field,
                                                   skip_bad=d.skip_bad_samples))[:c.eval.limit]
        self.accelerator = acc = Accelerator(mixed_precision=c.train.mixed_precision,
                                             cpu=not torch.cuda.is_available())
        pretrained = c.model.base
        if _tiny_kind(c.model.base) is not None:
            base = self.output_dir / "base"
            if acc.is_main_process and (self.resume_from is None or not (base / "config.json").is_file()):
                build_base_model(c.model, base)
            acc.wait_for_everyone()
            pretrained = str(base)
        self.pretrained = pretrained
        self.policy_config = policy_config(c, pretrained, self.train_path)
        self.policy = build_vlm_policy(self.policy_config, device=acc.device)
        self._check_targets(self.train_samples)
        self._check_targets(self.eval_samples)
        self.reward_fn = build_reward_fn(self.policy_config, probe=False) if self.eval_samples else None
        self.source = VLMSampleSource(self.train_samples, seed=c.seed, shuffle=d.shuffle)
        params = self.policy.trainable_parameters()
        t = c.train
        self.optimizer = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                                           eps=t.adam_eps)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, t.lr_scheduler, t.warmup_steps, t.steps)
        if deepspeed_stage(acc) is not None:
            raise ConfigError("mmrl sft does not run under DeepSpeed (its optimizer step and checkpoints are the "
                              "plain loop's): launch it with DDP (configs/accelerate/ddp_one_node.yaml)")
        self.optimizer = self.policy.prepare(acc, self.optimizer)
        if any(is_dtensor(p) for p in self.policy.trainable_parameters()):
            raise ConfigError("mmrl sft does not shard with FSDP (its generation-based evaluation and checkpoints "
                              "expect whole weights): launch it with DDP (configs/accelerate/ddp_one_node.yaml)")
        self.step = 0
        self.stop_signal = None

    # ------------------------------------------------------------------------------------------ checks

    def _check_targets(self, samples: list) -> None:
        """A target longer than ``generation.max_new_tokens`` (with its end token) could never be written by a
        rollout: an error naming the line, before training."""
        budget = self.config.generation.max_new_tokens
        end = end_of_turn_id(self.policy)
        field_name = self.config.data.target_field
        for s in samples:
            n = len(target_ids(self.policy.tokenizer, s.metadata[field_name], end))
            if n > budget:
                raise DataError(f"{s.source}: field {field_name!r} is {n} tokens with the end-of-turn token, more "
                                f"than generation.max_new_tokens={budget}: a rollout could never write it; raise "
                                f"generation.max_new_tokens or shorten the target")

    # ------------------------------------------------------------------------------------------ checkpoints

    def save(self) -> None:
        from mmrl.checkpoint import process_rng_states, save_checkpoint

        acc = self.accelerator
        acc.wait_for_everyone()
        rng = process_rng_states(acc)  # every process's own stream (a collective)
        if acc.is_main_process:
            state = {"step": self.step, "data": self.source.state_dict(), "config": config_to_dict(self.config)}
            objects = {"optimizer": self.optimizer.state_dict(), "lr_scheduler": self.lr_scheduler.state_dict(),
                       "rng": rng}
            if acc.scaler is not None:  # fp16's loss scale
                objects["scaler"] = acc.scaler.state_dict()
            save_checkpoint(self.output_dir / "checkpoints", self.step,
                            trainable=self.policy.named_trainable_parameters(), state=state, objects=objects,
                            export=self.policy.export, keep_last=self.config.logging.keep_last)
        acc.wait_for_everyone()

    def resume(self) -> int | None:
        from mmrl.checkpoint import load_checkpoint, load_trainable, restore_rng_states

        if self.resume_from is None:
            return None
        trainable, state, objects = load_checkpoint(self.resume_from, objects=("optimizer", "lr_scheduler", "rng"),
                                                    state_keys=("data", "step"))
        try:
            load_trainable(self.policy.named_trainable_parameters(), trainable, self.resume_from)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.optimizer.load_state_dict(objects["optimizer"])
        self.lr_scheduler.load_state_dict(objects["lr_scheduler"])
        if self.accelerator.scaler is not None and "scaler" in objects:
            self.accelerator.scaler.load_state_dict(objects["scaler"])
        from mmrl.trainer import _update_seed

        note = restore_rng_states(objects["rng"], self.accelerator,
                                  reseed=lambda rank: _update_seed(self.config.seed, int(state["step"]), rank))
        if note and self.accelerator.is_main_process:
            print(f"resume: {note}", file=sys.stderr)
        from mmrl.checkpoint import restore_data_state

        data_note = restore_data_state(self.source, state, self.resume_from)
        if data_note and self.accelerator.is_main_process:
            print(f"resume: {data_note}", file=sys.stderr)
        self.step = int(state["step"])
        if self.accelerator.is_main_process:  # a rollback: the newer checkpoints set aside
            from mmrl.checkpoint import set_aside_newer

            moved = set_aside_newer(self.output_dir / "checkpoints", self.step)
            if moved:
                print(f"resume from step {self.step}: the newer checkpoints {', '.join(m.name for m in moved)} "
                      f"moved to {moved[0].parent}", file=sys.stderr)
        return self.step

    def save_final(self) -> Path:
        """``output_dir/model``: ``save_pretrained`` model + processor, written into a temporary folder and renamed
        into place; plus ``mmrl_train.yaml``, the sections a ``mmrl train`` config needs to load it."""
        from mmrl.checkpoint import apply_umask

        final = self.output_dir / "model"
        acc = self.accelerator
        acc.wait_for_everyone()
        if acc.is_main_process:
            tmp = self.output_dir / f".model.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            self.policy.export(str(tmp))
            apply_umask(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            snippet = {"model": {"family": "qwen_vl", "pretrained": str(final), "dtype": self.config.model.dtype},
                       "generation": dataclasses.asdict(self.config.generation)}
            (self.output_dir / "mmrl_train.yaml").write_text(
                "# the model and generation sections of an `mmrl train` config that continues from this SFT run\n"
                + yaml.safe_dump(snippet, sort_keys=False))
        acc.wait_for_everyone()
        return final

    # ------------------------------------------------------------------------------------------ steps

    def train_step(self) -> dict[str, float]:
        """One optimizer step over ``batch_size x gradient_accumulation_steps`` samples per process: the loss is
        the sum of the completion-token cross-entropies divided by the step's completion tokens on every process."""
        c, acc, policy = self.config, self.accelerator, self.policy
        t = c.train
        start = time.perf_counter()
        per_process = t.batch_size * t.gradient_accumulation_steps
        items = self.source.next_batch(per_process, rank=acc.process_index, world=acc.num_processes)
        generator = torch.Generator().manual_seed(c.seed * 1_000_003 + self.step * 7_919 + acc.process_index)
        items, dropped = drop_thoughts(items, c.data.thought_dropout, generator, c.data.target_field)
        self.thoughts_dropped = dropped
        batches = [collate(policy, items[i:i + t.batch_size], c.data.target_field)
                   for i in range(0, len(items), t.batch_size)]
        tokens = sum(b.num_tokens for b in batches)
        all_tokens = summed_over_processes(acc, tokens)
        total = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(batches):
            sync = i == len(batches) - 1
            context = contextlib.nullcontext() if sync or acc.num_processes == 1 else acc.no_sync(policy.train_model)
            with context:
                loss_sum, _ = batch_loss(policy, batch, train=True)
                # the step's token mean over every process: DDP averages the gradients over the P processes, so each
                # divides its sum by all tokens / P (transformers' average_tokens_across_devices, TRL's default)
                acc.backward(loss_sum * (acc.num_processes / max(all_tokens, 1)))
            total += float(loss_sum.detach())
        total, tokens = summed_over_processes(acc, total), all_tokens
        params = policy.trainable_parameters()
        norm = acc.clip_grad_norm_(params, t.max_grad_norm if t.max_grad_norm > 0 else float("inf"))
        grad_norm = float(norm)
        skipped = not math.isfinite(grad_norm)
        if skipped:  # a non-finite gradient: no update (fp16 overflow, a bad batch)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        lr = self.lr_scheduler.get_last_lr()[0]
        self.lr_scheduler.step()
        self.step += 1
        return {"step": self.step, "loss": total / max(tokens, 1), "tokens": float(tokens), "lr": lr,
                "grad_norm": grad_norm, "samples": float(sum(len(b.samples) for b in batches)),
                "train/skipped_steps": float(skipped), "train/thoughts_dropped": float(self.thoughts_dropped),
                "time/step": time.perf_counter() - start}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """On the first ``eval.limit`` lines of ``data.eval`` (main process): ``eval/loss`` (token-mean completion
        cross-entropy), ``eval/exact_match`` (the greedy answer, decoded as the rewards read rollouts, equals the
        target), ``eval/reward/<key>`` (``eval.rewards`` on the greedy answers, mean over judged samples), and
        ``samples/step_<k>.jsonl`` with every answer."""
        if not self.eval_samples or not self.accelerator.is_main_process:
            return {}
        c, policy = self.config, self.policy
        start = time.perf_counter()
        loss_sum, tokens, answers, targets, prompts, metadata = 0.0, 0, [], [], [], []
        for i in range(0, len(self.eval_samples), c.eval.batch_size):
            batch = collate(policy, self.eval_samples[i:i + c.eval.batch_size], c.data.target_field)
            s, n = batch_loss(policy, batch, train=False)
            loss_sum, tokens = loss_sum + float(s), tokens + n
            rollout = policy.rollout(batch.samples, 1, generator=torch.Generator().manual_seed(0), greedy=True)
            answers += rollout.completions
            targets += batch.targets
            prompts += rollout.prompts
            metadata += rollout.metadata
        exact = [float(a.strip() == t.strip()) for a, t in zip(answers, targets)]
        scores = self.reward_fn(answers, prompts, metadata)
        metrics = {"eval/loss": loss_sum / max(tokens, 1), "eval/exact_match": sum(exact) / len(exact)}
        for key, values in scores.items():
            finite = values[torch.isfinite(values)]
            metrics[f"eval/reward/{key}"] = float(finite.mean()) if len(finite) else float("nan")
        out = self.output_dir / "samples"
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"step_{self.step}.jsonl", "w") as handle:
            for j, (answer, target) in enumerate(zip(answers, targets)):
                row = {"id": metadata[j].get("id"), "task": metadata[j].get("task"), "question": prompts[j],
                       "completion": answer, "target": target, "exact_match": exact[j],
                       **{f"reward/{k}": float(v[j]) for k, v in scores.items()}}
                handle.write(json.dumps(row) + "\n")
        metrics["time/eval"] = time.perf_counter() - start
        return metrics

    # ------------------------------------------------------------------------------------------ loop

    def summary(self, resumed: int | None) -> str:
        c, acc = self.config, self.accelerator
        model = self.policy.model
        trainable = sum(p.numel() for p in self.policy.trainable_parameters())
        total = sum(p.numel() for p in model.parameters())
        t = c.train
        return "\n".join([
            f"mmrl sft -> {self.output_dir}",
            f"  model     {c.model.base}" + (f" (built in {self.pretrained})" if self.pretrained != c.model.base
                                             else "") + f", {model.config.model_type}: {trainable:,} trainable "
            f"parameters of {total:,}" + (" (vision tower frozen)" if c.model.freeze_vision else ""),
            f"  data      {len(self.train_samples)} training lines ({self.train_path}), "
            f"{len(self.eval_samples)} held-out ({self.eval_path}); target field {c.data.target_field!r}",
            f"  device    {acc.device}, {acc.num_processes} process(es), mixed precision {t.mixed_precision}",
            f"  schedule  {t.steps} steps of {t.batch_size} x {t.gradient_accumulation_steps} samples per process, "
            f"lr {t.lr:g} ({t.lr_scheduler}, warmup {t.warmup_steps})",
            "  start     " + (f"resumed at step {resumed} of {t.steps}" if resumed is not None else "a new run"),
        ])

    @contextlib.contextmanager
    def _stop_signals(self):
        """SIGINT / SIGTERM: stop after the current step with a checkpoint (a second SIGINT stops at once)."""
        from mmrl.stopping import install_stop_signals

        def on_signal(name: str) -> None:
            self.stop_signal = name
            print(f"mmrl: {self.stop_signal} received: stopping after step {self.step + 1} with a checkpoint",
                  flush=True)

        restore = install_stop_signals(on_signal, lambda: self.stop_signal is not None)
        try:
            yield
        finally:
            restore()

    def train(self) -> Path:
        """Train to ``train.steps`` (resuming first), evaluating and checkpointing on schedule; returns the final
        ``output_dir/model`` folder (or, when stopped by a signal, the last checkpoint's ``export`` folder)."""
        from mmrl.tracking import MetricsLogger

        c, acc = self.config, self.accelerator
        resumed = self.resume()
        metrics_log = None
        if acc.is_main_process:
            print(self.summary(resumed), flush=True)
            self.output_dir.mkdir(parents=True, exist_ok=True)
            if resumed is None or not (self.output_dir / "config.yaml").exists():
                dump_config(c, self.output_dir / "config.yaml")
            if resumed is not None:
                dump_config(c, self.output_dir / f"config.resume_{resumed}.yaml")
            metrics_log = MetricsLogger(self.output_dir, tensorboard=c.logging.tensorboard, resume_step=resumed)
        progress = None
        if acc.is_main_process and c.logging.progress_bar:
            from tqdm.auto import tqdm

            progress = tqdm(total=c.train.steps, initial=self.step, desc="mmrl sft", dynamic_ncols=True)
        self.history: list[dict[str, float]] = []
        try:
            with self._stop_signals():
                while self.step < c.train.steps:
                    metrics = self.train_step()
                    last = self.step == c.train.steps
                    if c.eval.every and (self.step % c.eval.every == 0 or last):
                        metrics.update(self.evaluate())
                    self.history.append(metrics)
                    if metrics_log is not None and (self.step % c.logging.log_every == 0 or last
                                                    or any(k.startswith("eval/") for k in metrics)):
                        metrics_log.log(metrics)
                    if progress is not None:
                        progress.update(1)
                        progress.set_postfix(loss=f"{metrics['loss']:.4g}")
                    stop = self.stop_signal is not None
                    if stop or last or (c.logging.save_every and self.step % c.logging.save_every == 0):
                        self.save()
                    if stop and not last:
                        if acc.is_main_process:
                            print(f"mmrl: stopped by {self.stop_signal} after step {self.step} of {c.train.steps}; "
                                  f"`mmrl sft {self.output_dir / 'config.yaml'}` continues from the checkpoint",
                                  flush=True)
                        return self.output_dir / "checkpoints" / f"step_{self.step}" / "export"
        finally:
            if progress is not None:
                progress.close()
            if metrics_log is not None:
                metrics_log.close()
        return self.save_final()


def run_sft(config_path: str | Path, overrides: Sequence[str] = ()) -> Path:
    """Load the config, train (resuming a killed run from its newest checkpoint with ``resume: auto``) and return
    the ``save_pretrained`` folder ``output_dir/model`` that ``mmrl train`` loads as ``model.pretrained``."""
    config = load_sft_config(config_path, list(overrides))
    run = SFTRun(config)
    return run.train()


# ================================================================================================ command line


def main(args: list[str] | None = None) -> int:
    """``mmrl sft CONFIG [key=value ...]`` (``--help-fields``: every field with its default and help). Mistakes are
    one line ``mmrl: error: ...`` and exit code 2; a run stopped by SIGINT / SIGTERM exits 130 / 143 after its
    checkpoint (:func:`mmrl.cli.config_command`)."""
    from mmrl.cli import config_command

    def errors():
        from mmrl.pipelines.flow.loading import ModelLoadError
        from mmrl.pipelines.vlm.qwen import PromptTooLongError

        return ConfigError, DataError, ModelLoadError, PromptTooLongError, FileNotFoundError

    def start(config_path: str, overrides: list[str]) -> int:
        from mmrl.build import cpu_threads_default
        from mmrl.stopping import signal_exit_code

        cpu_threads_default()
        try:
            config = load_sft_config(config_path, overrides)
            run = SFTRun(config)
            final = run.train()
        except KeyboardInterrupt:
            print("mmrl: interrupted", file=sys.stderr, flush=True)
            return 130
        if run.stop_signal:
            return signal_exit_code(run.stop_signal)
        if run.accelerator.is_main_process:
            if run.history:
                first, last = run.history[0], run.history[-1]
                print(f"done: {len(run.history)} steps, loss {first['loss']:.4g} -> {last['loss']:.4g}; model in "
                      f"{final} (mmrl train: model.pretrained={final}, sections in "
                      f"{run.output_dir / 'mmrl_train.yaml'})")
            else:
                print(f"nothing to do: {run.output_dir} is already at step {run.step}; model in {final}")
        return 0

    return config_command(
        args, prog="mmrl sft", description="supervised fine-tuning of a Qwen-VL model on <think>/<answer> targets "
        "(mmrl.sft)", config_class=SFTConfig, config_help="SFT YAML config (e.g. configs/shapes/sft_qwen_vl.yaml)",
        overrides_help="dotted overrides, e.g. train.steps=20", fields_help="every field with its default and help",
        missing_config="mmrl sft: a CONFIG path is required", errors=errors, run=start)


if __name__ == "__main__":
    sys.exit(main())
