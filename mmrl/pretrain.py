"""``mmrl pretrain CONFIG [key=value ...]``: flow-matching pretraining of a small SD3 text-to-image model on ShapeWorld.

The result is a standard diffusers ``StableDiffusion3Pipeline`` folder (``save_pretrained``) that mmrl's flow policy
loads with ``model.family: sd3, model.pretrained: <output_dir>/pipeline``: the base model for RL on ShapeWorld
(GenEval-style prompts, :mod:`mmrl.data.shapeworld`) without any downloaded weights.

Two stages, one step counter (``step`` in ``metrics.jsonl`` and ``checkpoints/step_<k>``):

1. **VAE** (``vae.steps`` steps; skipped with ``vae.pretrained``): a small diffusers ``AutoencoderKL`` trained on
   rendered images with the latent-diffusion objective, reconstruction plus a small KL to N(0, I) (Rombach et al.
   2022, "High-Resolution Image Synthesis with Latent Diffusion Models": KL weight 1e-6 on summed terms; here the
   MSE is a per-pixel mean and the KL sum is divided by the number of pixel values, so ``vae.kl_weight`` keeps that
   ratio; no LPIPS or GAN term, the images are flat-coloured shapes). Then the latent statistics are measured (on
   the first ``vae.stats_images`` pool images) and written to the VAE config as SD3 keeps them (``scaling_factor =
   1 / std``, ``shift_factor = mean``; the pipeline decodes ``z / scaling_factor + shift_factor``), so the flow
   model sees unit-variance latents.
2. **Flow** (``train.steps`` steps): an ``SD3Transformer2DModel`` trained with SD3's rectified-flow objective exactly
   as diffusers' ``examples/dreambooth/train_dreambooth_sd3.py`` implements it (Esser et al. 2024, "Scaling
   Rectified Flow Transformers for High-Resolution Image Synthesis", arXiv 2403.03206): ``u`` from
   ``diffusers.training_utils.compute_density_for_timestep_sampling`` (logit-normal by default, the paper's
   ``lognorm(0, 1)``; or uniform / mode), the timestep ``scheduler.timesteps[int(u * 1000)]`` of a training copy
   of the pipeline's ``FlowMatchEulerDiscreteScheduler`` (so its ``shift`` is applied, sigma = shift t / (1 + (shift
   - 1) t)), ``x_t = (1 - sigma) x_0 + sigma noise``, target ``noise - x_0`` (the velocity), loss
   ``mean(weighting * (v_pred - target)^2)`` with ``compute_loss_weighting_for_sd3`` (1 for logit-normal): the
   script run with ``--precondition_outputs 0`` (its default, 1, predicts ``x_0 = x_t - sigma v`` against ``x_0``,
   i.e. this loss times ``sigma^2`` per sample; diffusers added the flag because rectified flows train better
   without it, PR #8917). The
   prompt is replaced by the empty prompt with probability ``train.cfg_dropout`` (classifier-free guidance, Ho &
   Salimans 2022; SD3 drops each text encoder's input independently at 46.3 %, mmrl drops the whole prompt, the
   rule the sampler's unconditional branch uses). An EMA of the transformer weights (``train.ema_decay`` with
   Flow-GRPO's decay warm-up, :class:`mmrl.ema.EMA`) is what the final pipeline holds.

Text encoders: two CLIP text encoders and a T5 encoder, as SD3 has, tiny and random. With ``text.train: false``
(default) they stay frozen at their seeded initialisation and each prompt is encoded once (cached); ``true`` trains
them with the transformer. Their tokenizers give every word of the ShapeWorld prompts (both splits) its own token
(checked at build time), so "red circle" and "blue circle" differ in a token, not in a spelling the random encoder
would have to compose; the vocabularies follow :mod:`mmrl.pipelines.flow.tiny` (byte-level CLIP BPE plus whole-word
merges, a T5 Unigram of characters plus whole words), deterministic without training a tokenizer.

Data: (prompt, image) pairs from :mod:`mmrl.data.shapeworld`: a GenEval category drawn uniformly (``data.balance_tags``,
mmrl's rule), then one of its prompts of ``prompt_set(data.split)`` (optionally only ``data.tags``), a random
ground-truth scene from ``scene_for`` and ``render``. With ``data.pool_size: N`` (the recipe) N pairs are rendered
once, batches are drawn from them with replacement, and the flow stage encodes them once into VAE posterior means and
stds and samples ``z = mean + std * eps`` per step (what ``latent_dist.sample()`` of a fresh encoding gives); with
``0`` every step renders and encodes fresh scenes. Every random draw (scenes, pool indices, noise, timesteps, the CFG
dropout, the VAE posterior sample) is a seeded function of ``(seed, stage, step)``, so a run resumed from a
checkpoint (weights, AdamW and LR-scheduler state, EMA, the step) continues exactly as the uninterrupted run would
have (a test); the pool is rebuilt identically on resume.

``init_from: PIPELINE`` (a ``pipeline/`` folder of an earlier run, or ``shapeworld:sd3``) continues from a saved
pipeline instead of the seeded initialisation: its text encoders, VAE (with its latent statistics, which its
transformer was trained on) and transformer are loaded strictly into the components this config builds (so the
sizes must be the same, and its tokenizers must hold this config's vocabulary), and only the flow stage runs, with a
fresh optimizer, schedule and EMA. ``data.shape_noise: p`` is a careless annotator, mmrl's own construction (as
``grounding_loose`` is for the VLM): each object of a rendered scene is drawn, with probability ``p``, as another
shape than the caption names (uniformly among the others, colour and box kept), from its own random stream, so the
captions and scenes are those of the exact run. ``data.faded: p`` is a washed-out photographer, also mmrl's own:
each rendered image is, with probability ``p``, faded towards the background to :data:`FADED_CONTRAST` of its
contrast (under the ShapeWorld detector's half-coverage rule), from a stream of its own, captions and scenes
unchanged. With ``init_from`` they make bases that are imperfect on purpose, with an error the ShapeWorld reward sees
(``configs/shapes/pretrain_sd3_mislabeled.yaml``: the shipped base continued on mislabeled shapes;
``configs/shapes/pretrain_sd3_faded.yaml``: on washed-out images); what GRPO made of them is in the README.

Outputs in ``output_dir``: ``config.yaml``, ``metrics.jsonl`` (one row every ``logging.log_every`` steps: the mean
loss since the previous row, seconds per step), ``checkpoints/step_<k>/`` (atomic, :mod:`mmrl.checkpoint`),
``samples/step_<k>.png`` (a grid, rows = fixed prompts, columns = fixed seeds, drawn with the pipeline itself), and
``pipeline/`` (written into a temporary folder and renamed into place). SIGINT / SIGTERM stop after the current step
with a checkpoint; rerunning the command (``resume: auto``, the default) continues. Rules that are mmrl's own: the
stage layout and its single step counter, the whole-prompt dropout, and which config fields a resume may change
(``train.steps``, ``logging.*``).
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.config import ConfigError, _build, _changed_fields, _non_finite_floats, _set_dotted, config_to_dict, \
    dump_config, opt, parse_overrides, read_config_file, yaml_key_lines

__all__ = ["PretrainConfig", "load_pretrain_config", "run_pretrain", "main", "flow_matching_loss",
           "sample_flow_timesteps", "build_tokenizers", "PretrainStopped"]

# ================================================================================================ config


@dataclass
class PretrainDataConfig:
    """Where the (prompt, image) pairs come from: mmrl.data.shapeworld, rendered on the fly."""

    split: str = opt("train", "Prompt split the pairs are drawn from (prompt_set(split)); keep 'heldout' for "
                     "evaluation.", choices=("train", "heldout"))
    tags: list = opt([], "GenEval categories to draw from (single_object, two_object, counting, colors, position, "
                     "color_attr); empty = all of them.")
    max_prompts: int = opt(0, "Use only the first N prompts of the (filtered) split; 0 = all.")
    balance_tags: bool = opt(True, "Draw a GenEval category uniformly, then a prompt of it (mmrl's rule: GenEval's "
                             "overall is the mean over categories, and the train split is mostly color_attr); false "
                             "draws prompts uniformly.")
    pool_size: int = opt(16384, "0: every step renders fresh scenes (and the flow stage VAE-encodes them). N: render N "
                         "pairs once; both stages draw batches from them, and the flow stage encodes them once into "
                         "posterior means and stds and draws z = mean + std * eps per step, which is what encoding "
                         "again would give (faster when steps x batch_size > N).")
    fixed_batch: bool = opt(False, "Debugging: every step sees the same images, prompts, noise and timesteps (an "
                            "overfitting check: the loss must fall).")
    shape_noise: float = opt(0.0, "A careless annotator (mmrl's own construction, not a paper's): each object of a "
                             "rendered scene is drawn, with this probability, as another shape than its caption "
                             "names (uniformly among the others; colour and box kept), an error the ShapeWorld "
                             "reward sees. 0 = exact captions.")
    faded: float = opt(0.0, "A washed-out photographer (mmrl's own construction, not a paper's): each rendered image "
                       "is, with this probability, faded towards the background to FADED_CONTRAST (0.35) of its "
                       "contrast, below the ShapeWorld detector's half-coverage rule, so the reward sees no shape in "
                       "it; captions and scenes unchanged. An error of the whole image, not of one prompt's "
                       "pairing. 0 = every image at full contrast.")


@dataclass
class TextConfig:
    """The SD3 text encoders (two CLIP, one T5), tiny and random."""

    max_length: int = opt(12, "Tokens per prompt for both CLIP tokenizers (their model_max_length) and for T5 "
                          "(max_sequence_length). Set sampling.max_sequence_length to the same value in mmrl "
                          "train / eval configs: T5 pads to it and SD3 attends to the padding.")
    clip_hidden: int = opt(32, "Hidden size of each CLIP text encoder (their penultimate states, concatenated, are "
                           "zero-padded to t5_dim as in SD3).")
    clip_layers: int = opt(2, "Layers of each CLIP text encoder.")
    clip_heads: int = opt(4, "Attention heads of each CLIP text encoder.")
    clip_projection: int = opt(32, "Projection size of each CLIP encoder; the pooled condition is 2 x this.")
    t5_dim: int = opt(64, "d_model of the T5 encoder = the transformer's joint_attention_dim (>= 2 x clip_hidden).")
    t5_layers: int = opt(2, "Layers of the T5 encoder.")
    t5_heads: int = opt(4, "Attention heads of the T5 encoder.")
    train: bool = opt(False, "Train the text encoders jointly with the transformer; false keeps them frozen at "
                      "their seeded random initialisation and encodes each prompt once.")


@dataclass
class VAEConfig:
    """The AutoencoderKL: trained first (stage 1) or taken from an earlier run."""

    pretrained: str | None = opt(None, "An AutoencoderKL folder (or a pipeline folder with vae/) to use instead of "
                                 "training one; needs vae.steps: 0. Its latent statistics are measured again.")
    block_out_channels: list = opt([16, 32], "Channels per level; L levels downsample by 2^(L-1) (2 levels: 32 px "
                                   "-> 16x16 latents).")
    layers_per_block: int = opt(1, "ResNet blocks per level.")
    latent_channels: int = opt(4, "Latent channels (the transformer's in/out channels; SD3: 16).")
    norm_num_groups: int = opt(8, "GroupNorm groups (must divide every block_out_channels entry).")
    mid_attention: bool = opt(False, "Self-attention in the VAE's mid block (SD3's VAE has it; off is faster).")
    steps: int = opt(400, "Stage-1 training steps; 0 with vae.pretrained.")
    batch_size: int = opt(32, "Images per stage-1 step.")
    lr: float = opt(1e-3, "AdamW learning rate of stage 1 (constant after a 20-step warmup).")
    kl_weight: float = opt(1e-6, "KL weight relative to the reconstruction (latent diffusion: 1e-6).")
    stats_images: int = opt(256, "Fresh images whose latents give shift_factor (mean) and scaling_factor (1 / std).")


@dataclass
class TransformerConfig:
    """The SD3Transformer2DModel (MMDiT)."""

    num_layers: int = opt(6, "Joint transformer blocks (SD3.5-Medium: 24).")
    num_heads: int = opt(4, "Attention heads; width = num_heads x head_dim.")
    head_dim: int = opt(16, "Dimensions per head (SD3: 64).")
    patch_size: int = opt(2, "Latent patch size (SD3: 2); image tokens = (image_size / 2^(L-1) / patch)^2.")
    qk_norm: str | None = opt("rms_norm", "Query/key normalisation (SD3.5: rms_norm; null: none, as SD3).",
                              choices=("rms_norm", "layer_norm", None))
    dual_attention_layers: list = opt([], "Blocks with a second image self-attention (SD3.5-Medium MMDiT-X: 0..12).")


@dataclass
class FlowTrainConfig:
    """Stage 2: the rectified-flow objective (SD3)."""

    steps: int = opt(3000, "Transformer training steps.")
    batch_size: int = opt(64, "(prompt, image) pairs per step.")
    lr: float = opt(1e-3, "AdamW learning rate (after warmup, then lr_scheduler).")
    betas: list = opt([0.9, 0.999], "AdamW betas.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    warmup_steps: int = opt(100, "Linear warmup optimizer steps: step k (from 0) of W runs at (k + 1) / W of "
                                 "the lr (mmrl's rule; transformers' and diffusers' schedulers run step 0 at lr 0, "
                                 "k / W).")
    lr_scheduler: str = opt("cosine", "LR schedule after warmup (to 0 at train.steps for linear / cosine).",
                            choices=("constant", "linear", "cosine"))
    max_grad_norm: float = opt(1.0, "Gradient norm clipping; 0 disables.")
    weighting_scheme: str = opt("logit_normal", "Timestep density (SD3 paper section 3.1; diffusers' "
                                "compute_density_for_timestep_sampling): logit_normal (SD3's choice), uniform "
                                "(plain rectified flow), mode (mode sampling with heavy tails); sigma_sqrt and cosmap "
                                "sample uniformly and weight the loss.",
                                choices=("logit_normal", "uniform", "mode", "sigma_sqrt", "cosmap"))
    logit_mean: float = opt(0.0, "Logit-normal mean m (SD3: 0).")
    logit_std: float = opt(1.0, "Logit-normal scale s (SD3: 1).")
    mode_scale: float = opt(1.29, "Mode-sampling scale (SD3: 1.29).")
    shift: float = opt(3.0, "Timestep shift of the FlowMatchEulerDiscreteScheduler, used in training and saved "
                       "with the pipeline for sampling: sigma = shift t / (1 + (shift - 1) t) (SD3 / SD3.5: 3.0). "
                       "Measured on ShapeWorld: 1.0 left the shapes as blobs (held-out 0.035), 3.0 gave 0.146; the "
                       "shapes are decided at high noise, where the shift puts more of the training.")
    cfg_dropout: float = opt(0.1, "Probability that a pair's prompt is replaced by the empty prompt (classifier-free "
                             "guidance).")
    ema_decay: float = opt(0.995, "EMA decay of the transformer weights saved in the pipeline; 0 saves the live "
                           "weights.")
    ema_warmup: bool = opt(True, "Warm the EMA decay up as Flow-GRPO's EMAModuleWrapper does, min(ema_decay, (1 + s) / "
                           "(10 + s)) at step s, so the random initialisation fades from the average within the "
                           "first steps (without it 0.995^250 = 29 % of it is still there after 250 steps).")


@dataclass
class PretrainLoggingConfig:
    """Outputs."""

    log_every: int = opt(10, "A metrics.jsonl row every this many steps (mean loss since the previous row).")
    save_every: int = opt(200, "A checkpoint every this many steps (and at the end of each stage); 0 = only then.")
    keep_last: int = opt(2, "Checkpoints kept on disk.")
    sample_every: int = opt(0, "A samples/step_<k>.png grid every this many flow steps; 0 = only at the end.")
    sample_prompts: list = opt([], "Grid rows; empty = num_sample_prompts prompts spread over the training split.")
    num_sample_prompts: int = opt(6, "Rows of the grid when sample_prompts is empty.")
    sample_seeds: list = opt([0, 1, 2, 3], "Grid columns: the seeds of the initial noise.")
    sample_steps: int = opt(20, "Euler steps of the grid's sampler.")
    guidance_scale: float = opt(4.0, "Classifier-free guidance of the grid (1 = none).")
    progress_bar: bool = opt(True, "Show a progress bar.")


@dataclass
class PretrainConfig:
    """A pretraining run (``mmrl pretrain``)."""

    output_dir: str = opt("runs/pretrain_sd3", "Where config.yaml, metrics.jsonl, checkpoints/, samples/ and "
                          "pipeline/ go.")
    seed: int = opt(0, "Seed of the initialisation, the data stream and the noise.")
    resume: str | None = opt("auto", "'auto' (continue from the latest checkpoint in output_dir, if any), a "
                             "checkpoint folder, or null (refuse an output_dir that holds checkpoints).")
    image_size: int = opt(32, "Image side in pixels (rendered and generated).")
    init_from: str | None = opt(None, "Continue from a StableDiffusion3Pipeline folder (an earlier `mmrl pretrain`'s "
                                "pipeline/, or shapeworld:sd3): its tokenizers, text encoders, VAE (latent "
                                "statistics included) and transformer replace the seeded initialisation, and only "
                                "the flow stage runs (vae.steps: 0). text / vae / transformer sizes must match it.")
    data: PretrainDataConfig = field(default_factory=PretrainDataConfig, metadata={"help": "The pairs."})
    text: TextConfig = field(default_factory=TextConfig, metadata={"help": "Text encoders."})
    vae: VAEConfig = field(default_factory=VAEConfig, metadata={"help": "The autoencoder (stage 1)."})
    transformer: TransformerConfig = field(default_factory=TransformerConfig, metadata={"help": "The MMDiT."})
    train: FlowTrainConfig = field(default_factory=FlowTrainConfig, metadata={"help": "Stage 2."})
    logging: PretrainLoggingConfig = field(default_factory=PretrainLoggingConfig, metadata={"help": "Outputs."})


GENEVAL_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

#: What a resume may change (mmrl's rule): everything else defines what the checkpoint's weights and step mean.
RESUME_MAY_CHANGE = ("resume", "output_dir", "train.steps", "logging.")
#: ... except these: the sample prompts' words are part of the text vocabulary, whose size shapes the text
#: encoders and their seeded initialisation (frozen ones are rebuilt from the seed, not saved: a new word swapped
#: them under the checkpointed transformer)
RESUME_MAY_NOT_CHANGE = ("logging.sample_prompts",)


def validate_pretrain(config: PretrainConfig) -> None:
    """Range checks that the types cannot express; a :class:`ConfigError` naming the key."""
    c, t, v, x, f, log = config, config.text, config.vae, config.transformer, config.train, config.logging
    factor = 2 ** (len(v.block_out_channels) - 1) if v.block_out_channels else 1
    for key in _non_finite_floats(c):
        raise ConfigError(f"{key}: must be a finite number")
    checks = [
        (0 <= c.seed < 2**63, "seed must be in [0, 2**63)"),
        (bool(c.output_dir.strip()), "output_dir must not be empty"),
        (all(tag in GENEVAL_TAGS for tag in c.data.tags), f"data.tags must be among {list(GENEVAL_TAGS)}"),
        (c.data.max_prompts >= 0, "data.max_prompts must be >= 0 (0 = all)"),
        (c.data.pool_size >= 0, "data.pool_size must be >= 0 (0 = fresh scenes every step)"),
        (0.0 <= c.data.shape_noise <= 1.0, "data.shape_noise must be in [0, 1]"),
        (0.0 <= c.data.faded <= 1.0, "data.faded must be in [0, 1]"),
        (c.init_from is None or (v.steps == 0 and v.pretrained is None),
         "init_from brings its own VAE: set vae.steps: 0 and leave vae.pretrained unset"),
        (t.max_length >= 4, "text.max_length must be >= 4"),
        (min(t.clip_hidden, t.clip_layers, t.clip_heads, t.clip_projection, t.t5_dim, t.t5_layers, t.t5_heads) >= 1,
         "text: every size must be >= 1"),
        (t.clip_hidden % t.clip_heads == 0, "text.clip_hidden must be a multiple of text.clip_heads"),
        (t.t5_dim % t.t5_heads == 0, "text.t5_dim must be a multiple of text.t5_heads"),
        (t.t5_dim >= 2 * t.clip_hidden, "text.t5_dim must be >= 2 x text.clip_hidden (SD3 zero-pads the two CLIP "
                                        "states to T5's width)"),
        (len(v.block_out_channels) >= 1 and all(isinstance(ch, int) and ch >= 1 for ch in v.block_out_channels),
         "vae.block_out_channels must be a list of positive integers"),
        (v.norm_num_groups >= 1 and all(ch % v.norm_num_groups == 0 for ch in v.block_out_channels),
         "vae.norm_num_groups must divide every vae.block_out_channels entry"),
        (v.layers_per_block >= 1 and v.latent_channels >= 1, "vae.layers_per_block and vae.latent_channels must be "
                                                             ">= 1"),
        (v.steps >= 0 and v.batch_size >= 1 and v.lr > 0 and v.kl_weight >= 0 and v.stats_images >= 2,
         "vae: steps >= 0, batch_size >= 1, lr > 0, kl_weight >= 0, stats_images >= 2"),
        (v.pretrained is None or v.steps == 0, "vae.pretrained replaces stage 1: set vae.steps: 0"),
        (v.pretrained is not None or c.init_from is not None or v.steps >= 1,
         "vae.steps must be >= 1 (or give vae.pretrained or init_from)"),
        (min(x.num_layers, x.num_heads, x.head_dim, x.patch_size) >= 1, "transformer: every size must be >= 1"),
        (all(isinstance(i, int) and 0 <= i < x.num_layers for i in x.dual_attention_layers),
         "transformer.dual_attention_layers must be block indices below transformer.num_layers"),
        (c.image_size >= 16 and c.image_size % (factor * x.patch_size) == 0,
         f"image_size must be a multiple of {factor * x.patch_size} (VAE factor {factor} x patch "
         f"{x.patch_size})"),
        (f.steps >= 1 and f.batch_size >= 1 and f.lr > 0, "train: steps >= 1, batch_size >= 1, lr > 0"),
        (len(f.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in f.betas),
         "train.betas must be two numbers in [0, 1)"),
        (f.weight_decay >= 0 and f.warmup_steps >= 0 and f.max_grad_norm >= 0,
         "train: weight_decay, warmup_steps, max_grad_norm must be >= 0"),
        (f.logit_std > 0 and f.shift > 0, "train.logit_std and train.shift must be > 0"),
        (f.weighting_scheme != "mode" or -1.0 <= f.mode_scale <= 2 / (math.pi - 2),
         f"train.mode_scale must be in [-1, {2 / (math.pi - 2):.4f}] (SD3's mode sampling, 2 / (pi - 2) at most: "
         f"outside it the density leaves [0, 1] or is not monotone), got {f.mode_scale}"),
        (0.0 <= f.cfg_dropout < 1.0, "train.cfg_dropout must be in [0, 1)"),
        (0.0 <= f.ema_decay < 1.0, "train.ema_decay must be in [0, 1) (0 = no EMA)"),
        (log.log_every >= 1 and log.save_every >= 0 and log.keep_last >= 1 and log.sample_every >= 0,
         "logging: log_every >= 1, save_every >= 0, keep_last >= 1, sample_every >= 0"),
        (all(isinstance(p, str) and p.strip() for p in log.sample_prompts),
         "logging.sample_prompts must be non-empty strings"),
        (log.num_sample_prompts >= 1 and log.sample_steps >= 1 and log.guidance_scale >= 1.0,
         "logging: num_sample_prompts >= 1, sample_steps >= 1, guidance_scale >= 1"),
        (bool(log.sample_seeds) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                        for s in log.sample_seeds),
         "logging.sample_seeds must be a non-empty list of integer seeds >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    changed = _changed_fields(v)
    for keys, unread, why in ((("batch_size", "lr", "kl_weight"), v.steps == 0, "stage 1 is skipped (vae.steps: 0)"),
                              (("block_out_channels", "layers_per_block", "latent_channels", "norm_num_groups",
                                "mid_attention"), v.pretrained is not None,
                               "vae.pretrained brings its own architecture"),
                              (("stats_images",), c.init_from is not None,
                               "init_from brings its VAE's latent statistics")):
        named = [f"vae.{k}" for k in keys if k in changed]
        if unread and named:  # logged, as mmrl train's unread fields are (an override may turn a stage off)
            logging.getLogger("mmrl.pretrain").warning("%s ignored: %s", ", ".join(named), why)


def pretrain_config_from_dict(data: dict[str, Any], overrides: list[str] | None = None) -> PretrainConfig:
    data = dict(data or {})
    for key, value in parse_overrides(overrides or []):
        _set_dotted(data, key, value, PretrainConfig)
    config = _build(PretrainConfig, data)
    validate_pretrain(config)
    return config


def load_pretrain_config(path: str | Path, overrides: list[str] | None = None) -> PretrainConfig:
    """Read a pretraining YAML, apply dotted ``key=value`` overrides, validate. Unknown keys are errors naming the
    nearest valid key (:mod:`mmrl.config`'s rules); every error is one line naming the file (and the line of the
    offending key when it is in the file)."""
    path = Path(path)
    text, data = read_config_file(path)
    parse_overrides(overrides or [])
    try:
        return pretrain_config_from_dict(data, overrides)
    except ConfigError as exc:
        message = str(exc)
        match = re.match(r"(?:unknown config key '([^']+)'|([\w.]+):)", message)
        key = match and (match.group(1) or match.group(2))
        line = yaml_key_lines(text).get(key) if key else None
        where = f"{path}:{line}" if line and not any(o.split("=", 1)[0].strip() == key for o in overrides or []) \
            else str(path)
        where = f"{where} with overrides {overrides}" if overrides else where
        raise ConfigError(f"{where}: {message}") from None


# ================================================================================================ tokenizers


def prompt_words(prompts: list[str]) -> list[str]:
    """The distinct lowercase words of ``prompts``, sorted (the whole-word vocabulary of the tokenizers)."""
    return sorted({w for p in prompts for w in p.lower().split()})


def build_tokenizers(words: list[str], max_length: int):
    """``(clip_tokenizer, t5_tokenizer)`` giving each of ``words`` one token, deterministically.

    The tiny models' builders of :mod:`mmrl.pipelines.flow.tiny` with ``words=words``. CLIP: the byte-level BPE of
    :func:`mmrl.pipelines.flow.tiny._clip_vocab_and_merges` (256 byte symbols, the same
    with ``</w>``, whole-word merges, longer words first so their merges outrank those of words they contain, then
    ``<|startoftext|>`` and ``<|endoftext|>``) over ``words``. T5: a Unigram of ``<pad> </s> <unk>``, ``▁``,
    characters and ``▁``-prefixed whole words (as :func:`mmrl.pipelines.flow.tiny._t5_vocab`). Any other text still
    tokenizes (CLIP by bytes, T5 by characters or ``<unk>``). Raises ``ValueError`` if a word does not come out as
    one token."""
    from mmrl.pipelines.flow.tiny import _clip_tokenizer, _t5_tokenizer

    clip = _clip_tokenizer(words, max_length)
    t5 = _t5_tokenizer(words, max_length)
    for word in words:
        if len(clip.tokenize(word)) != 1 or len(t5.tokenize(word)) != 1:
            raise ValueError(f"tokenizers: {word!r} is not a single token (CLIP {clip.tokenize(word)}, "
                             f"T5 {t5.tokenize(word)})")
    return clip, t5


# ================================================================================================ the objective


def sample_flow_timesteps(scheduler, batch_size: int, *, weighting_scheme: str, logit_mean: float = 0.0,
                          logit_std: float = 1.0, mode_scale: float = 1.29,
                          generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sigmas [B], timesteps [B])`` as diffusers' SD3 training script draws them: ``u`` from
    ``compute_density_for_timestep_sampling``, ``index = int(u * num_train_timesteps)``, the training scheduler's
    ``timesteps[index]`` and ``sigmas[index]`` (shift applied; never ``set_timesteps`` on it)."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    u = compute_density_for_timestep_sampling(weighting_scheme=weighting_scheme, batch_size=batch_size,
                                              logit_mean=logit_mean, logit_std=logit_std, mode_scale=mode_scale,
                                              generator=generator)
    indices = (u * scheduler.config.num_train_timesteps).long().clamp(0, len(scheduler.timesteps) - 1)
    return scheduler.sigmas[indices].float(), scheduler.timesteps[indices].float()


def flow_matching_loss(model, x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor, timesteps: torch.Tensor,
                       *, weighting_scheme: str = "logit_normal", **cond) -> torch.Tensor:
    """SD3's rectified-flow loss (Esser et al. 2024, eq. 1 with the velocity target; diffusers
    ``train_dreambooth_sd3.py``): ``x_t = (1 - sigma) x0 + sigma noise``, ``v = model(x_t, timesteps, **cond)``,
    ``mean(weighting(sigma) * (v - (noise - x0))^2)``; ``model`` is called as an ``SD3Transformer2DModel``."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    s = sigmas.view(-1, *([1] * (x0.ndim - 1))).to(x0.dtype)
    noisy = (1.0 - s) * x0 + s * noise
    pred = model(hidden_states=noisy, timestep=timesteps, return_dict=False, **cond)[0].float()
    target = noise - x0
    weighting = compute_loss_weighting_for_sd3(weighting_scheme, s)
    return (weighting.float() * (pred - target.float()) ** 2).reshape(x0.shape[0], -1).mean(1).mean()


# ================================================================================================ the run


class PretrainStopped(RuntimeError):
    """SIGINT / SIGTERM stopped the run after a checkpoint; ``signal`` is the signal's name."""

    def __init__(self, message: str, signal_name: str):
        super().__init__(message)
        self.signal = signal_name


def _step_seed(seed: int, stage: int, step: int) -> int:
    """A seed that is a function of ``(seed, stage, step)`` only (numpy's SeedSequence mixing)."""
    return int(np.random.SeedSequence([seed, stage, step]).generate_state(1, np.uint64)[0] % (2**63 - 1))


@contextmanager
def _seeded(seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class ShapeWorldPairs:
    """The seeded stream of (prompt, image) pairs: batch ``k`` of stage ``s`` depends on ``(seed, s, k)`` only."""

    def __init__(self, config: PretrainConfig):
        from mmrl.data import shapeworld

        self.world = shapeworld
        d = config.data
        items = list(shapeworld.prompt_set(d.split))
        if d.tags:
            items = [(p, m) for p, m in items if m.get("tag") in d.tags]
        if d.max_prompts:
            items = items[:d.max_prompts]
        if not items:
            raise ConfigError(f"data: no prompts in split {d.split!r} with tags {d.tags}")
        self.items = items
        self.seed, self.size, self.fixed = config.seed, config.image_size, d.fixed_batch
        self.shape_noise, self.faded = d.shape_noise, d.faded
        tags = sorted({m.get("tag") for _, m in items}, key=lambda t: (GENEVAL_TAGS + (t,)).index(t))
        self.by_tag = [[it for it in items if it[1].get("tag") == t] for t in tags] if d.balance_tags else []
        self.pool_prompts: list[str] | None = None
        self.pool_images: torch.Tensor | None = None
        self.words = prompt_words([p for split in ("train", "heldout") for p, _ in shapeworld.prompt_set(split)]
                                  + [p for p in config.logging.sample_prompts])

    def _draw(self, rng: np.random.Generator) -> tuple[str, dict]:
        if self.by_tag:  # a category uniformly, then one of its prompts
            group = self.by_tag[int(rng.integers(len(self.by_tag)))]
            return group[int(rng.integers(len(group)))]
        return self.items[int(rng.integers(len(self.items)))]

    def render(self, stage: int, step: int, n: int) -> tuple[list[str], torch.Tensor]:
        """``(prompts [n], images [n, 3, H, W] uint8)``: fresh scenes, a function of ``(seed, stage, step)``."""
        rng = np.random.default_rng(_step_seed(self.seed, stage, 0 if self.fixed else step))
        # data.shape_noise draws from its own stream, so the scenes are those of the exact-caption run
        noise = np.random.default_rng(_step_seed(self.seed, stage + 40, 0 if self.fixed else step)) \
            if self.shape_noise else None
        fade = np.random.default_rng(_step_seed(self.seed, stage + 60, 0 if self.fixed else step)) \
            if self.faded else None
        prompts, images = [], []
        for _ in range(n):
            prompt, metadata = self._draw(rng)
            scene = self.world.scene_for(metadata, rng, size=self.size)
            if noise is not None:
                scene = self.mislabel(scene, noise)
            pixels = self.world.render_array(scene)
            if fade is not None and fade.random() < self.faded:
                pixels = fade_to_background(pixels, FADED_CONTRAST)
            prompts.append(prompt)
            images.append(torch.from_numpy(pixels))  # a fresh array per image: no copy needed
        return prompts, torch.stack(images).permute(0, 3, 1, 2).contiguous()

    def mislabel(self, scene, rng: np.random.Generator):
        """``data.shape_noise``: each object, with that probability, becomes another shape drawn uniformly from the
        others, colour and box kept. Uniformly: keeping the redrawn shapes off the held-out colour-shape pairings
        (measured, README) taught the model that a colour rules its shape out, which is the held-out prompts'
        pairing; the captions, which define which pairings a model has seen, are never changed."""
        from dataclasses import replace

        objects = []
        for obj in scene.objects:
            if rng.random() < self.shape_noise:
                options = [s for s in self.world.SHAPES if s != obj.shape]
                obj = replace(obj, shape=options[int(rng.integers(len(options)))])
            objects.append(obj)
        return self.world.Scene(tuple(objects), scene.size)

    def batch(self, stage: int, step: int, n: int) -> tuple[list[str], torch.Tensor]:
        """``(prompts [n], images [n, 3, H, W] in [-1, 1])``: from the pool when there is one, else fresh."""
        if self.pool_images is None:
            prompts, images = self.render(stage, step, n)
        else:
            index = self.indices(stage, step, n)
            prompts, images = [self.pool_prompts[i] for i in index.tolist()], self.pool_images[index]
        return prompts, to_unit_range(images)

    def indices(self, stage: int, step: int, n: int) -> torch.Tensor:
        """``n`` pool indices, uniform with replacement, a function of ``(seed, stage, step)``."""
        rng = np.random.default_rng(_step_seed(self.seed, stage + 20, 0 if self.fixed else step))
        return torch.from_numpy(rng.integers(len(self.pool_prompts), size=n))

    def build_pool(self, n: int, chunk: int = 256) -> None:
        """Render the pool of ``n`` pairs once (chunk ``j`` is :meth:`render` of stage 3, step ``j``)."""
        prompts, images = [], []
        for j in range(0, n, chunk):
            p, x = self.render(3, j // chunk, min(chunk, n - j))
            prompts += p
            images.append(x)
        self.pool_prompts, self.pool_images = prompts, torch.cat(images)


#: ``data.faded``'s contrast: under the ShapeWorld detector's 0.5 coverage, so a faded shape is background to it.
FADED_CONTRAST = 0.35


def fade_to_background(pixels: np.ndarray, contrast: float) -> np.ndarray:
    """``background + contrast * (pixels - background)``, rounded to uint8: the image washed out towards the
    ShapeWorld background (``data.faded``)."""
    from mmrl.data.shapeworld import BACKGROUND

    background = np.asarray(BACKGROUND, dtype=np.float32)
    faded = background + float(contrast) * (pixels.astype(np.float32) - background)
    return np.clip(np.rint(faded), 0, 255).astype(np.uint8)


def to_unit_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[0, 255]`` -> float ``[-1, 1]`` (the VAE's input range, as diffusers' VaeImageProcessor)."""
    return images.float() / 127.5 - 1.0


def build_components(config: PretrainConfig, words: list[str]) -> dict[str, Any]:
    """The pipeline's components, each initialised under its own seed (``seed + k``) without touching the caller's
    RNG: tokenizers, two CLIP text encoders, T5, AutoencoderKL, SD3Transformer2DModel, the scheduler."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    t, v, x = config.text, config.vae, config.transformer
    tokenizer, tokenizer_3 = build_tokenizers(words, t.max_length)
    clip_config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=t.clip_hidden, intermediate_size=4 * t.clip_hidden,
        num_hidden_layers=t.clip_layers, num_attention_heads=t.clip_heads, max_position_embeddings=t.max_length,
        hidden_act="gelu", projection_dim=t.clip_projection, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    encoders = []
    for k in (1, 2):
        with _seeded(config.seed + k):
            encoders.append(CLIPTextModelWithProjection(clip_config).eval())
    t5_config = T5Config(
        vocab_size=len(tokenizer_3), d_model=t.t5_dim, d_kv=t.t5_dim // t.t5_heads, d_ff=2 * t.t5_dim,
        num_layers=t.t5_layers, num_heads=t.t5_heads, relative_attention_num_buckets=8,
        relative_attention_max_distance=max(8, t.max_length), feed_forward_proj="gated-gelu", dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0, is_encoder_decoder=False, use_cache=False)
    with _seeded(config.seed + 3):
        text_encoder_3 = T5EncoderModel(t5_config).eval()
    if v.pretrained:
        source = Path(v.pretrained)
        sub = "vae" if (source / "vae" / "config.json").is_file() else None
        try:
            vae = AutoencoderKL.from_pretrained(str(source), subfolder=sub)
        except Exception as exc:
            raise ConfigError(f"vae.pretrained={v.pretrained!r}: not an AutoencoderKL folder ({exc})") from None
        factor = 2 ** (len(vae.config.block_out_channels) - 1)
    else:
        levels = len(v.block_out_channels)
        with _seeded(config.seed + 4):
            vae = AutoencoderKL(
                in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * levels,
                up_block_types=("UpDecoderBlock2D",) * levels, block_out_channels=tuple(v.block_out_channels),
                layers_per_block=v.layers_per_block, latent_channels=v.latent_channels,
                norm_num_groups=v.norm_num_groups, sample_size=config.image_size, scaling_factor=1.0,
                shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False,  # as SD3's VAE
                mid_block_add_attention=v.mid_attention)
        factor = 2 ** (levels - 1)
    latent = config.image_size // factor
    if latent % x.patch_size:
        raise ConfigError(f"image_size {config.image_size}: the {latent}x{latent} latents are not a multiple of "
                          f"transformer.patch_size {x.patch_size}")
    with _seeded(config.seed + 5):
        transformer = SD3Transformer2DModel(
            sample_size=latent, patch_size=x.patch_size, in_channels=vae.config.latent_channels,
            out_channels=vae.config.latent_channels, num_layers=x.num_layers, attention_head_dim=x.head_dim,
            num_attention_heads=x.num_heads, joint_attention_dim=t.t5_dim,
            caption_projection_dim=x.num_heads * x.head_dim, pooled_projection_dim=2 * t.clip_projection,
            pos_embed_max_size=4 * (latent // x.patch_size),  # lets the weights draw up to 4x the side
            dual_attention_layers=tuple(x.dual_attention_layers), qk_norm=x.qk_norm)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=config.train.shift)
    components = dict(tokenizer=tokenizer, tokenizer_2=build_tokenizers(words, t.max_length)[0],
                      tokenizer_3=tokenizer_3, text_encoder=encoders[0], text_encoder_2=encoders[1],
                      text_encoder_3=text_encoder_3, vae=vae, transformer=transformer, scheduler=scheduler)
    if config.init_from:
        load_initial_pipeline(components, config.init_from)
    return components


def load_initial_pipeline(components: dict[str, Any], source: str) -> None:
    """``init_from``: copy a saved pipeline's weights into the freshly built ``components`` (strictly: every tensor
    must fit, so the config's sizes are the pipeline's) and take its VAE latent statistics; its tokenizers must hold
    the vocabulary this config builds (the same word -> id map, or the text encoders would read other words)."""
    from diffusers import StableDiffusion3Pipeline

    from mmrl.data.shapeworld import base_model_path

    name = str(source)
    try:
        path = base_model_path(name.split(":", 1)[1]) if name.startswith("shapeworld:") else Path(name)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"init_from: {exc}") from None
    if not (path / "model_index.json").is_file():
        raise ConfigError(f"init_from={name!r}: {path} is not a StableDiffusion3Pipeline folder (no model_index.json)")
    try:
        pipe = StableDiffusion3Pipeline.from_pretrained(str(path), dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - any load failure is the folder's problem, said in one line
        raise ConfigError(f"init_from={name!r}: cannot load the pipeline ({' '.join(str(exc).split())[:300]})") from None
    for key in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        if getattr(pipe, key).get_vocab() != components[key].get_vocab():
            raise ConfigError(f"init_from={name!r}: its {key} has another vocabulary than this config builds "
                              f"(text.max_length, logging.sample_prompts and the ShapeWorld words must be the same)")
    modules = ("text_encoder", "text_encoder_2", "text_encoder_3", "vae", "transformer")
    weights = {f"{key}.{k}": v for key in modules for k, v in getattr(pipe, key).state_dict().items()}
    _load_state({key: components[key] for key in modules}, weights, path, what="init_from")
    stats = {k: float(pipe.vae.config[k]) for k in ("shift_factor", "scaling_factor")}
    components["vae"].register_to_config(**stats)


def _state_of(modules: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every tensor of ``modules`` as ``{"<module>.<key>": clone}`` (clones: safetensors refuses tied storage)."""
    return {f"{name}.{k}": v.detach().clone() for name, m in modules.items() for k, v in m.state_dict().items()}


def _load_state(modules: dict[str, torch.nn.Module], weights: dict[str, torch.Tensor], where: Path,
                what: str = "checkpoint") -> None:
    for name, module in modules.items():
        prefix = f"{name}."
        part = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        try:
            module.load_state_dict(part, strict=True)
        except RuntimeError as exc:
            raise ConfigError(f"{what} {where}: its {name} weights do not fit this config "
                              f"({' '.join(str(exc).split())[:300]})") from None


class Pretrainer:
    """The two-stage loop (see the module docstring). ``run()`` returns the pipeline folder."""

    VAE_STAGE, FLOW_STAGE = 0, 1

    def __init__(self, config: PretrainConfig):
        self.config = config
        self.output_dir = Path(config.output_dir)
        self.pairs = ShapeWorldPairs(config)
        self.c = build_components(config, self.pairs.words)
        self.vae_steps = config.vae.steps
        self.total = self.vae_steps + config.train.steps
        self.step = 0  # steps done, both stages
        self.latent_stats: dict[str, float] | None = None
        if config.init_from:  # the pipeline's own normalisation: its transformer was trained on it
            self.latent_stats = {k: float(self.c["vae"].config[k]) for k in ("shift_factor", "scaling_factor")}
        self.window: list[float] = []
        self.window_time = self.window_cpu = 0.0
        self.optimizer = self.lr_scheduler = self.ema = None
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool_latents: tuple[torch.Tensor, torch.Tensor] | None = None
        self.stop_signal: str | None = None

    # ------------------------------------------------------------------------------------ modules & stages

    @property
    def text_encoders(self) -> dict[str, torch.nn.Module]:
        return {k: self.c[k] for k in ("text_encoder", "text_encoder_2", "text_encoder_3")}

    def _saved_modules(self) -> dict[str, torch.nn.Module]:
        """The modules a checkpoint holds: the VAE and the transformer, and the text encoders when trained (frozen
        ones are rebuilt from the seed)."""
        modules = {"vae": self.c["vae"], "transformer": self.c["transformer"]}
        if self.config.text.train:
            modules.update(self.text_encoders)
        return modules

    def _flow_params(self) -> dict[str, torch.nn.Parameter]:
        modules = {"transformer": self.c["transformer"]}
        if self.config.text.train:
            modules.update(self.text_encoders)
        return {f"{n}.{k}": p for n, m in modules.items() for k, p in m.named_parameters()}

    def _start_stage(self, stage: int) -> None:
        from mmrl.ema import EMA
        from mmrl.trainer import build_lr_scheduler

        if stage == self.VAE_STAGE:
            params = list(self.c["vae"].parameters())
            self.optimizer = torch.optim.AdamW(params, lr=self.config.vae.lr, weight_decay=0.0)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, "constant", 20, self.vae_steps)
            self.ema = None
            return
        f = self.config.train
        self.c["vae"].requires_grad_(False).eval()
        for module in self.text_encoders.values():
            module.requires_grad_(self.config.text.train)
        params = self._flow_params()
        self.optimizer = torch.optim.AdamW(list(params.values()), lr=f.lr, betas=tuple(f.betas),
                                           weight_decay=f.weight_decay)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, f.lr_scheduler, f.warmup_steps, f.steps)
        self.ema = EMA(params, f.ema_decay, warmup=f.ema_warmup) if f.ema_decay > 0 else None

    # ------------------------------------------------------------------------------------ checkpoints

    def _state(self) -> dict[str, Any]:
        return {"step": self.step, "stage": "vae" if self.step < self.vae_steps else "flow",
                "latent_stats": self.latent_stats, "window": self.window, "window_time": self.window_time,
                "window_cpu": self.window_cpu,
                "config": config_to_dict(self.config)}

    def save(self) -> Path:
        from mmrl.checkpoint import save_checkpoint

        objects = {}
        if self.optimizer is not None:
            objects = {"optimizer": self.optimizer.state_dict(), "lr_scheduler": self.lr_scheduler.state_dict()}
            if self.ema is not None:
                objects["ema"] = self.ema.state_dict()
        return save_checkpoint(self.output_dir / "checkpoints", self.step, trainable=_state_of(self._saved_modules()),
                               state=self._state(), objects=objects, keep_last=self.config.logging.keep_last)

    def _checkpoint_to_resume(self) -> Path | None:
        from mmrl.checkpoint import COMPLETE_MARKER, latest_checkpoint

        c = self.config
        latest = latest_checkpoint(self.output_dir / "checkpoints")
        if not c.resume:
            if latest is not None:
                raise ConfigError(f"{self.output_dir} already holds a pretraining run with checkpoints: set "
                                  f"resume=auto to continue it or choose another output_dir (nothing was overwritten)")
            return None
        if c.resume == "auto":
            return latest
        path = Path(c.resume)
        if not (path / COMPLETE_MARKER).is_file():
            raise ConfigError(f"resume: {c.resume} is not a complete checkpoint (no {COMPLETE_MARKER})")
        return path

    def resume(self, path: Path) -> None:
        from mmrl.checkpoint import load_checkpoint

        weights, state, objects = load_checkpoint(path)
        changed = _resume_changes(state.get("config") or {}, config_to_dict(self.config))
        if changed:
            raise ConfigError(f"cannot resume {path} with a changed {', '.join(changed)}: these define what the "
                              f"checkpoint's weights and steps mean (a resume may change {', '.join(RESUME_MAY_CHANGE)}"
                              f"); start a new output_dir instead")
        _load_state(self._saved_modules(), weights, path)
        self.step = int(state["step"])
        self.latent_stats = state.get("latent_stats")
        self.window = list(state.get("window", []))
        self.window_time = float(state.get("window_time", 0.0))
        self.window_cpu = float(state.get("window_cpu", 0.0))
        if self.latent_stats is not None:
            self.c["vae"].register_to_config(**self.latent_stats)
        stage = self.VAE_STAGE if self.step < self.vae_steps else self.FLOW_STAGE
        self._start_stage(stage)
        if "optimizer" in objects and not (stage == self.FLOW_STAGE and state.get("stage") == "vae"):
            self.optimizer.load_state_dict(objects["optimizer"])
            self.lr_scheduler.load_state_dict(objects["lr_scheduler"])
            if self.ema is not None and "ema" in objects:
                self.ema.load_state_dict(objects["ema"], self._flow_params())
        from mmrl.checkpoint import set_aside_newer

        moved = set_aside_newer(self.output_dir / "checkpoints", self.step)  # a rollback: the newer ones set aside
        if moved:
            print(f"resume from step {self.step}: the newer checkpoints {', '.join(m.name for m in moved)} moved to "
                  f"{moved[0].parent}", file=sys.stderr)

    # ------------------------------------------------------------------------------------ steps

    def _generator(self, stage: int, step: int) -> torch.Generator:
        return torch.Generator().manual_seed(_step_seed(self.config.seed, stage + 10, 0 if self.pairs.fixed else step))

    def vae_step(self, k: int) -> float:
        v, vae = self.config.vae, self.c["vae"]
        _, x = self.pairs.batch(self.VAE_STAGE, k, v.batch_size)
        vae.train()
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample(generator=self._generator(self.VAE_STAGE, k))).sample
        rec = torch.nn.functional.mse_loss(recon, x)
        kl = posterior.kl().mean() / x[0].numel()
        loss = rec + v.kl_weight * kl
        self._optimize(loss, list(vae.parameters()), max_norm=1.0)
        return float(loss.detach())

    @torch.no_grad()
    def _posteriors(self, images: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE posterior ``(mean, std)`` of uint8 ``images``, encoded in fixed chunks (deterministic)."""
        vae = self.c["vae"].eval()
        means, stds = [], []
        for i in range(0, len(images), chunk):
            dist = vae.encode(to_unit_range(images[i:i + chunk])).latent_dist
            means.append(dist.mean)
            stds.append(dist.std)
        return torch.cat(means), torch.cat(stds)

    @torch.no_grad()
    def measure_latents(self) -> dict[str, float]:
        """SD3's latent normalisation: ``shift_factor`` = mean, ``scaling_factor`` = 1 / std of VAE latent samples of
        ``vae.stats_images`` images (the first of the pool, else fresh ones: stage index 2 of the data stream)."""
        n, vae = self.config.vae.stats_images, self.c["vae"]
        if self.pool_latents is not None:
            mean, std = (t[:n] for t in self.pool_latents)
        else:
            mean, std = self._posteriors(self.pairs.render(2, 0, n)[1])
        z = (mean + std * torch.randn(mean.shape, generator=self._generator(2, 0))).double()
        stats = {"shift_factor": float(z.mean()), "scaling_factor": float(1.0 / z.std())}
        vae.register_to_config(**stats)
        return stats

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prompt_embeds [B, 2L, D], pooled [B, P])`` through the pipeline's own ``encode_prompt``; cached per
        prompt when the encoders are frozen."""
        pipe = self.pipeline()
        L = self.config.text.max_length

        def encode(batch):
            embeds, _, pooled, _ = pipe.encode_prompt(prompt=batch, prompt_2=None, prompt_3=None, device="cpu",
                                                      do_classifier_free_guidance=False, max_sequence_length=L)
            return embeds, pooled

        if self.config.text.train:
            return encode(prompts)
        with torch.no_grad():
            for p in prompts:
                if p not in self._cache:  # one prompt per call: the same numbers whatever the batch (resume)
                    embeds, pooled = encode([p])
                    self._cache[p] = (embeds[0], pooled[0])
        return (torch.stack([self._cache[p][0] for p in prompts]), torch.stack([self._cache[p][1] for p in prompts]))

    def flow_step(self, k: int) -> float:
        f, vae, transformer = self.config.train, self.c["vae"], self.c["transformer"]
        generator = self._generator(self.FLOW_STAGE, k)
        if self.pool_latents is not None:
            index = self.pairs.indices(self.FLOW_STAGE, k, f.batch_size)
            prompts = [self.pairs.pool_prompts[i] for i in index.tolist()]
            mean, std = self.pool_latents[0][index], self.pool_latents[1][index]
        else:
            prompts, images = self.pairs.render(self.FLOW_STAGE, k, f.batch_size)
            mean, std = self._posteriors(images)
        drop = torch.rand(len(prompts), generator=generator) < f.cfg_dropout
        prompts = ["" if d else p for p, d in zip(prompts, drop.tolist())]
        z = mean + std * torch.randn(mean.shape, generator=generator)  # DiagonalGaussianDistribution.sample
        x0 = (z - vae.config.shift_factor) * vae.config.scaling_factor
        noise = torch.randn(x0.shape, generator=generator)
        sigmas, timesteps = sample_flow_timesteps(self.train_scheduler, len(prompts),
                                                  weighting_scheme=f.weighting_scheme, logit_mean=f.logit_mean,
                                                  logit_std=f.logit_std, mode_scale=f.mode_scale,
                                                  generator=generator)
        transformer.train()
        for m in self.text_encoders.values():
            m.train(self.config.text.train)
        embeds, pooled = self._encode(prompts)
        loss = flow_matching_loss(transformer, x0, noise, sigmas, timesteps, weighting_scheme=f.weighting_scheme,
                                  encoder_hidden_states=embeds, pooled_projections=pooled)
        params = self._flow_params()
        self._optimize(loss, list(params.values()), max_norm=f.max_grad_norm)
        if self.ema is not None:
            self.ema.update(params)
        return float(loss.detach())

    def _optimize(self, loss: torch.Tensor, params: list[torch.nn.Parameter], max_norm: float) -> None:
        if not torch.isfinite(loss):
            raise FloatingPointError(f"pretrain: the loss is {float(loss)} at step {self.step + 1}; lower the "
                                     f"learning rate")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if max_norm:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        self.lr_scheduler.step()

    # ------------------------------------------------------------------------------------ pipeline & samples

    def pipeline(self):
        from diffusers import StableDiffusion3Pipeline

        if getattr(self, "_pipe", None) is None:
            self._pipe = StableDiffusion3Pipeline(**self.c)
            self._pipe.set_progress_bar_config(disable=True)
        return self._pipe

    @contextmanager
    def ema_weights(self):
        """The transformer holds the EMA weights inside the block (live ones restored after)."""
        if self.ema is None:
            yield
            return
        params = {k: p for k, p in self._flow_params().items()}
        with self.ema.swapped_in(params):
            yield

    def sample_prompts(self) -> list[str]:
        log = self.config.logging
        if log.sample_prompts:
            return list(log.sample_prompts)
        items = self.pairs.items
        n = min(log.num_sample_prompts, len(items))
        return [items[round(i * (len(items) - 1) / max(1, n - 1))][0] for i in range(n)]

    @torch.no_grad()
    def samples(self, name: str) -> Path:
        """``samples/<name>.png``: rows = :meth:`sample_prompts`, columns = ``logging.sample_seeds``, drawn with the
        ``StableDiffusion3Pipeline`` itself (Euler, CFG)."""
        from mmrl.tracking import make_grid_image

        log, pipe = self.config.logging, self.pipeline()
        for m in self.c.values():
            if isinstance(m, torch.nn.Module):
                m.eval()
        prompts, rows = self.sample_prompts(), []
        with self.ema_weights():
            for prompt in prompts:
                out = pipe(prompt=[prompt] * len(log.sample_seeds), height=self.config.image_size,
                           width=self.config.image_size, num_inference_steps=log.sample_steps,
                           guidance_scale=log.guidance_scale, max_sequence_length=self.config.text.max_length,
                           generator=[torch.Generator().manual_seed(s) for s in log.sample_seeds], output_type="pt")
                rows.append(out.images.float().cpu())
        path = self.output_dir / "samples" / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        make_grid_image(torch.cat(rows), rows=len(prompts)).save(path)
        (path.parent / "prompts.txt").write_text("".join(p + "\n" for p in prompts))
        return path

    def save_pipeline(self) -> Path:
        """``output_dir/pipeline`` (``save_pretrained``; EMA weights), written beside it and renamed into place."""
        from mmrl.checkpoint import apply_umask

        final = self.output_dir / "pipeline"
        tmp = self.output_dir / f".pipeline.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        for m in self.c.values():
            if isinstance(m, torch.nn.Module):
                m.eval()
        with self.ema_weights():
            self.pipeline().save_pretrained(tmp, safe_serialization=True)
        dump_config(self.config, tmp / "mmrl_pretrain.yaml")
        apply_umask(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        return final

    # ------------------------------------------------------------------------------------ the loop

    def _install_stop_signals(self):
        from mmrl.stopping import install_stop_signals

        def on_signal(name: str) -> None:
            self.stop_signal = name
            print(f"mmrl pretrain: {self.stop_signal} received: stopping after step {self.step + 1} with a "
                  f"checkpoint (Ctrl-C again to stop at once)", flush=True)

        return install_stop_signals(on_signal, lambda: self.stop_signal is not None)

    def run(self) -> Path:
        from mmrl.tracking import MetricsLogger

        c, log = self.config, self.config.logging
        path = self._checkpoint_to_resume()
        if path is not None:
            self.resume(path)
        elif self.vae_steps:
            self._start_stage(self.VAE_STAGE)  # (with vae.pretrained the flow stage starts in _begin_flow below)
        final = self.output_dir / "pipeline"
        if self.step >= self.total and (final / "model_index.json").is_file():
            print(f"nothing to do: {self.output_dir} is complete ({self.step} steps); the pipeline is {final}")
            return final
        if path is not None:  # as mmrl train and mmrl sft say it
            stage = "VAE" if self.step < self.vae_steps else "flow"
            print(f"mmrl pretrain: resumed at step {self.step} of {self.total} ({stage} stage) from {path}", flush=True)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if path is None or not (self.output_dir / "config.yaml").exists():
            dump_config(c, self.output_dir / "config.yaml")
        else:
            dump_config(c, self.output_dir / f"config.resume_{self.step}.yaml")
        logger = MetricsLogger(self.output_dir, tensorboard=False, resume_step=self.step if path else None)
        from diffusers import FlowMatchEulerDiscreteScheduler

        self.train_scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.c["scheduler"].config)
        progress = None
        if log.progress_bar:
            from tqdm.auto import tqdm

            progress = tqdm(total=self.total, initial=self.step, desc="mmrl pretrain", dynamic_ncols=True)
        restore = self._install_stop_signals()
        try:
            if c.data.pool_size and self.pairs.pool_images is None:
                started = time.perf_counter()
                self.pairs.build_pool(c.data.pool_size)
                print(f"mmrl pretrain: rendered a pool of {c.data.pool_size} pairs in "
                      f"{time.perf_counter() - started:.1f} s", flush=True)
            if self.step >= self.vae_steps and self.optimizer is None:
                self._begin_flow()
            elif self.step >= self.vae_steps:
                self._encode_pool()  # resumed in the flow stage
            while self.step < self.total:
                started, cpu_started = time.perf_counter(), time.process_time()
                lr = self.optimizer.param_groups[0]["lr"]  # the rate this step trains at (its scheduler steps after)
                if self.step < self.vae_steps:
                    stage, loss = "vae", self.vae_step(self.step)
                else:
                    stage, loss = "flow", self.flow_step(self.step - self.vae_steps)
                self.step += 1
                self.window.append(loss)
                self.window_time += time.perf_counter() - started
                self.window_cpu += time.process_time() - cpu_started
                boundary = self.step == self.vae_steps or self.step == self.total
                if self.step % log.log_every == 0 or boundary:
                    row = {"step": self.step, "stage": stage, "loss": sum(self.window) / len(self.window),
                           "loss_last": loss, "lr": lr,
                           "seconds_per_step": self.window_time / len(self.window),
                           "cpu_seconds_per_step": self.window_cpu / len(self.window)}
                    logger.log(row)
                    self.window, self.window_time, self.window_cpu = [], 0.0, 0.0
                    if progress is not None:
                        progress.set_postfix(stage=stage, loss=f"{row['loss']:.4g}")
                if progress is not None:
                    progress.update(1)
                if self.step == self.vae_steps:
                    self._begin_flow()
                if (log.save_every and self.step % log.save_every == 0) or boundary or self.stop_signal:
                    self.save()
                flow_done = self.step - self.vae_steps
                if log.sample_every and stage == "flow" and flow_done % log.sample_every == 0 \
                        and self.step < self.total:
                    self.samples(f"step_{self.step}")
                if self.stop_signal and self.step < self.total:
                    raise PretrainStopped(
                        f"stopped by {self.stop_signal} after step {self.step} of {self.total}; checkpoint "
                        f"{self.output_dir / 'checkpoints' / f'step_{self.step}'} written: rerun `mmrl pretrain "
                        f"{self.output_dir / 'config.yaml'}` (resume: auto) to continue", self.stop_signal)
        finally:
            restore()
            if progress is not None:
                progress.close()
            logger.close()
        self.samples(f"step_{self.step}")
        return self.save_pipeline()

    def _begin_flow(self) -> None:
        """Stage 1 -> 2: freeze the VAE, encode the pool, measure the latent statistics, start the transformer's
        optimizer."""
        self._encode_pool()
        if not self.config.init_from:
            self.latent_stats = self.measure_latents()
        self._start_stage(self.FLOW_STAGE)

    def _encode_pool(self) -> None:
        if self.pairs.pool_images is not None and self.pool_latents is None:
            self.pool_latents = self._posteriors(self.pairs.pool_images)


def _resume_changes(saved: dict, now: dict) -> list[str]:
    from mmrl.trainer import _flatten

    before, after = _flatten(saved), _flatten(now)
    return [k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)
            and (k in RESUME_MAY_NOT_CHANGE or not any(k == allowed or (allowed.endswith(".") and k.startswith(allowed))
                                                      for allowed in RESUME_MAY_CHANGE))]


def run_pretrain(config_path: str | Path, overrides: list[str] | None = None) -> Path:
    """Load the config, pretrain (or resume), and return the ``StableDiffusion3Pipeline`` folder
    (``output_dir/pipeline``). Raises :class:`ConfigError` for a bad config, :class:`PretrainStopped` after a
    SIGINT / SIGTERM checkpoint."""
    from mmrl.build import cpu_threads_default

    config = load_pretrain_config(config_path, overrides)
    cpu_threads_default()
    return Pretrainer(config).run()


def main(args: list[str] | None = None) -> int:
    """``mmrl pretrain CONFIG [key=value ...]``: 0 when the pipeline is written, 2 with one ``mmrl: error:`` line
    for a bad config or input, 128 + the signal's number when SIGINT / SIGTERM stopped it after a checkpoint
    (:func:`mmrl.cli.config_command`)."""
    from mmrl.cli import config_command

    def errors():
        from mmrl.data.prompts import DataError

        return ConfigError, DataError, FileNotFoundError

    def run(config: str, overrides: list[str]) -> int:
        from mmrl.stopping import signal_exit_code

        try:
            path = run_pretrain(config, overrides)
        except PretrainStopped as exc:
            print(f"mmrl pretrain: {exc}", file=sys.stderr, flush=True)
            return signal_exit_code(exc.signal)
        print(f"done: pipeline in {path} (model.family: sd3, model.pretrained: {path})")
        return 0

    return config_command(
        args, prog="mmrl pretrain", description="flow-matching pretraining of a small SD3 text-to-image model on "
        "ShapeWorld images (mmrl.pretrain)", config_class=PretrainConfig,
        config_help="YAML config, e.g. configs/shapes/pretrain_sd3.yaml",
        overrides_help="dotted overrides, e.g. train.steps=100",
        fields_help="every config field with its default and help",
        missing_config="pretrain: a CONFIG path is required (e.g. configs/shapes/pretrain_sd3.yaml)",
        errors=errors, run=run)


if __name__ == "__main__":
    sys.exit(main())
