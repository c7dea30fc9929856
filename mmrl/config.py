"""Typed run configuration: dataclasses with a help text per field, YAML plus dotted overrides.

``load_config(path, overrides)`` reads a YAML file into :class:`Config`, applies ``a.b=value``
overrides (values parsed as YAML), rejects unknown keys naming the nearest valid one (by its full
dotted key), and validates choices and ranges. Keys a config file leaves out take the dataclass
defaults, which are the SD3.5-Medium / Flow-GRPO GPU settings, not those of the tiny CPU run (the
embedded default ``mmrl/default.yaml``, used when no file is given). Relative paths in a config
(``data.prompts``, ``data.dataset``, ``output_dir``, ...) are resolved from the working directory,
not from the config file's folder. ``config_to_dict`` gives the resolved config that every run saves as
``config.yaml``. Each field's ``metadata["help"]`` says what it is and which paper it comes from;
``mmrl config show`` prints them.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import logging
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger(__name__)


#: The embedded default run (`mmrl train` with no config): Flow-GRPO on the washed-out ShapeWorld SD3 base, on CPU.
#: configs/shapes/flow_grpo_faded.yaml is a copy.
DEFAULT_CONFIG = Path(__file__).resolve().parent / "default.yaml"


class ConfigError(ValueError):
    """A configuration problem, with the key path and what was expected."""


def opt(default: Any, help: str, choices: tuple | None = None, **kwargs: Any) -> Any:
    """A dataclass field with help text (and optional allowed values)."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


@dataclass
class ModelConfig:
    """The policy being trained."""

    family: str = opt("sd3", "Policy family: 'sd3' (SD3 / SD3.5) and 'flux' (mmrl.pipelines.flow), or 'qwen_vl' "
                      "(Qwen2-VL, Qwen2.5-VL, Qwen3-VL through transformers, mmrl.pipelines.vlm).",
                      choices=("sd3", "flux", "qwen_vl"))
    pretrained: str = opt("stabilityai/stable-diffusion-3.5-medium",
                          "Hub id, local directory (save_pretrained layout), or 'tiny:sd3' / 'tiny:flux' / "
                          "'tiny:qwen2_5_vl' / 'tiny:qwen2_vl' / 'tiny:qwen3_vl' for the tiny random CPU models "
                          "built on the spot, or 'shapeworld:sd3' for the shipped ShapeWorld base (assets/shapeworld).")
    revision: str | None = opt(None, "Hub revision of `pretrained`.")
    dtype: str = opt("bfloat16", "Dtype of the frozen weights; trainable weights and step math are fp32.",
                     choices=("float32", "bfloat16", "float16"))
    resolution: int = opt(512, "Image height and width in pixels (Flow-GRPO SD3.5-M: 512).")
    use_lora: bool = opt(True, "Train LoRA adapters (PEFT) on the transformer; False trains all of its weights.")
    lora_rank: int = opt(32, "LoRA rank r (Flow-GRPO: 32).")
    lora_alpha: int = opt(64, "LoRA alpha, scaling alpha / r (Flow-GRPO: 64).")
    lora_dropout: float = opt(0.0, "LoRA dropout.")
    lora_target_modules: list = opt([], "Module names that get LoRA adapters; empty = the family's default: SD3 "
                                        "Flow-GRPO's attention projections, FLUX Flow-GRPO's attention + feed-forward "
                                        "list, Qwen-VL the language model's q/k/v/o and MLP projections (never the "
                                        "vision tower).")
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory.")
    freeze_vision: bool = opt(True, "VLM: keep the vision tower frozen (its features are then computed once per "
                              "prompt per update and reused by every completion and inner epoch).")
    attn_implementation: str | None = opt(None, "VLM: transformers attention kernel ('sdpa', 'flash_attention_2', "
                                          "'eager'); null = the library default.")
    share_prompt_prefix: bool = opt(True, "VLM: each prompt computed once per group instead of once per completion: "
                                    "generation prefills it once and repeats its KV cache to the group's rows (dynamic "
                                    "cache), and a log-prob forward runs each distinct prompt of its minibatch once "
                                    "with the completions on its KV cache (the same log-probs and gradients; not under "
                                    "gradient_checkpointing). False: one full row per sample, as TRL.")


@dataclass
class SamplingConfig:
    """How trajectories are sampled and which steps are stochastic and trained (REFERENCE.md section 3)."""

    num_steps: int = opt(10, "Denoising steps per trajectory (Flow-GRPO trains with 10, evaluates with 40).")
    eval_num_steps: int = opt(40, "ODE steps for evaluation grids (Flow-GRPO: 40).")
    guidance_scale: float = opt(4.5, "Classifier-free guidance scale; 1.0 disables CFG (one forward per step). FLUX: "
                                     "the distilled guidance input (model.family flux defaults to FluxPipeline's "
                                     "3.5).")
    negative_prompt: str = opt("", "Negative prompt for classifier-free guidance (SD3 with guidance_scale > 1; "
                               "rejected for FLUX, which is guidance-distilled, and for SD3 without CFG).")
    cfg_detach_uncond: bool = opt(True, "SD3 with classifier-free guidance: the training forward detaches the "
                                  "unconditional half, so the policy gradient flows through the conditional branch "
                                  "only (guidance_scale x its gradient), as Flow-GRPO's scripts/train_sd3.py did from "
                                  "2d76907 (2025-07) and the forks built on it (TP-GRPO, ...) do. false: the gradient "
                                  "flows through both halves (plus (1 - guidance_scale) x the unconditional branch's), "
                                  "as the newest Flow-GRPO train_sd3.py / train_sd3_fast.py (74db691) compute it. The "
                                  "values (log-probs, ratios) are the same either way.")
    max_sequence_length: int = opt(256, "T5 token budget for prompt encoding, at most 512 (SD3's pipeline default "
                                        "256; model.family flux defaults to FluxPipeline's 512).")
    time_shift: float | None = opt(None, "null: the model scheduler's sigmas (SD3.5: shift 3; FLUX: resolution-"
                                   "dependent shift). A number: sigma = s t / (1 + (s - 1) t) on uniform t "
                                   "(DanceGRPO --shift 3).")
    sde: str = opt("flow_grpo", "SDE step: 'flow_grpo' (Flow-GRPO sde), 'dance' (DanceGRPO), 'cps' "
                   "(coefficient-preserving, Flow-GRPO cps).", choices=("flow_grpo", "dance", "cps"))
    noise_level: float | None = opt(None, "SDE noise level: a for flow_grpo and cps, eta for dance. null: the anchor's "
                                    "default for the chosen sde (flow_grpo 0.7, cps 0.8, dance 0.3).")
    train_steps: str = opt("fraction",
                           "Which steps are SDE and trained: 'fraction' (Flow-GRPO: SDE everywhere, train the first "
                           "int(T*timestep_fraction)), 'random_fraction' (DanceGRPO: a random int((T-1)*timestep_fraction) "
                           "of steps 0..T-2, one subset per update), "
                           "'random_window' (Flow-GRPO-Fast: a random window in the first half, ODE elsewhere), "
                           "'sliding_window' (MixGRPO: a window that moves one step every window_shift_every "
                           "updates, ODE elsewhere; it always spans W of steps 0..T-2 and wraps after T-W positions, "
                           "mmrl's rule: MixGRPO's own window is cut at step T-3, shrinks at the end of the schedule, "
                           "is empty for one position and wraps after T-1), 'entropy_merge' (E-GRPO: consecutive "
                           "low-entropy SDE steps merged into one SDE step each, every merged step trained, ODE on "
                           "the last step; set merge_threshold or merge_groups).",
                           choices=("fraction", "random_fraction", "random_window", "sliding_window", "entropy_merge"))
    timestep_fraction: float = opt(0.99, "Fraction of the T steps trained for 'fraction' / 'random_fraction' "
                                   "(0.99 -> steps 0..T-2; DanceGRPO uses 0.6 of the T-1 steps). The last step "
                                   "(to sigma 0) is never trained: 1.0 trains T-1 steps where Flow-GRPO's script "
                                   "would train all T (mmrl's rule); a fraction that trains no step is an error.")
    window_size: int = opt(2, "SDE window length W for the window modes (Flow-GRPO-Fast 2-3, MixGRPO 4).")
    window_range: list | None = opt(None, "random_window: [lo, hi], the window's steps lie in lo..hi-1, its start "
                                    "drawn uniformly from lo..hi-W (Flow-GRPO-Fast's sample.sde_window_range). null: "
                                    "[0, num_steps // 2], the first half (its recipes' setting). hi is at most "
                                    "num_steps - 1: the last step is never trained (mmrl's rule).")
    window_shift_every: int = opt(1, "MixGRPO: the window moves forward one step every this many updates.")
    merge_threshold: float | None = opt(None, "entropy_merge: entropy per dimension (nats) a merged step must reach; "
                                        "consecutive steps below it are merged (mmrl.core.credit."
                                        "merge_low_entropy_steps).")
    merge_groups: int | None = opt(None, "entropy_merge: instead of merge_threshold, the number of merged SDE steps "
                                   "(contiguous groups of near-equal noise variance over the trainable steps).")
    share_group_noise: bool = opt(False, "DanceGRPO: all samples of a group start from the same initial noise.")
    noise_schedule: list = opt([], "Timestep-specific SDE noise: one level per sampling step (empty = noise_level "
                               "on every step).")
    intermediate: str = opt("ode", "How dense credit gets the image a step leads to: 'ode' (ODE completion to "
                            "sigma = 0, as TP-GRPO / DenseGRPO / TempFlow-GRPO) or 'x0' (one-step prediction "
                            "x - sigma v, no extra model evaluations).", choices=("ode", "x0"))
    final_image: str = opt("sample", "What a rollout decodes for the rewards: 'sample' (the last step's sampled latent, "
                           "Flow-GRPO) or 'prediction' (the last step's clean prediction x - sigma v, DanceGRPO's "
                           "pred_original); the trajectory and its log-probs are the same.",
                           choices=("sample", "prediction"))


@dataclass
class GenerationConfig:
    """VLM rollouts: sampling and vision inputs (Qwen-VL)."""

    temperature: float = opt(1.0, "Sampling temperature; training log-probs divide the logits by it too (TRL).")
    top_p: float = opt(1.0, "Nucleus sampling.")
    top_k: int = opt(0, "Top-k sampling; 0 disables.")
    min_p: float = opt(0.0, "Min-p sampling: tokens below min_p x the top token's probability are dropped (HF "
                       "generate and vLLM; TRL's min_p); 0 disables. Like top_p / top_k, it shapes sampling only: "
                       "the training log-probs stay those of the tempered, untruncated distribution, as in TRL.")
    repetition_penalty: float = opt(1.0, "Repetition penalty applied while sampling (HF generate and vLLM; TRL's "
                                    "repetition_penalty); 1 disables. Sampling only, as min_p.")
    max_new_tokens: int = opt(256, "Completion budget; generation stops at the end-of-turn token.")
    cache_implementation: str = opt("dynamic", "The KV cache HF generate decodes with: 'dynamic' (DynamicCache) or "
                                    "'static' (StaticCache, preallocated: on a GPU transformers then compiles the "
                                    "decoding forward). The sampled tokens are the same; only the speed differs.",
                                    choices=("dynamic", "static"))
    engine: str = opt("hf", "What samples the rollouts: 'hf' (the trained model's own generate) or 'vllm' (a vLLM "
                      "engine colocated in the training process, the policy's weights pushed to it whenever they "
                      "changed; the training log-probs are still the trained model's, and the sampler / trainer gap is "
                      "logged as rollout/sampler_logp_gap_mean / _max; image and video prompts; one process, or "
                      "any number with generation.vllm_server; vLLM is installed apart: README, Rollouts on vLLM).", choices=("hf", "vllm"))
    vllm: dict = opt({}, "engine 'vllm': more vllm.LLM arguments (gpu_memory_utilization, default 0.3 as TRL's "
                         "colocate mode; enforce_eager; ...); model, dtype, seed, lengths and the log-prob mode are "
                         "mmrl's.")
    vllm_server: str | None = opt(None, "engine 'vllm' in server mode: the URL (http://host:port) of a running "
                                  "`mmrl vllm-serve CONFIG` instead of an engine in the training process (TRL's "
                                  "vllm_mode='server'); any number of training processes sample from it, the main "
                                  "one pushes the weights. The training machine then needs no vLLM.")
    vllm_server_timeout: float = opt(600.0, "Server mode: seconds to wait for the server to come up, for one request "
                                     "(a generation, a weight upload) and for the main process's push.")
    max_prompt_length: int = opt(4096, "Longest prompt in tokens, vision tokens included. A longer prompt is an "
                                 "error (or a counted skip with data.skip_bad_samples): never truncated through "
                                 "its vision tokens.")
    system_prompt: str | None = opt(
        "A conversation between User and Assistant. The user asks a question about the image or video, and the "
        "Assistant answers it. The Assistant first thinks about the reasoning process and then gives the answer. "
        "The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags.",
        "System message (the R1-style think/answer instruction); null for none. Video-R1 sends no system message and "
        "writes its instruction into the user text (its QUESTION_TEMPLATE: use question_template).")
    question_template: str = opt("{question}", "User text; {question} is replaced by the sample's question.")
    min_pixels: int | None = opt(None, "Image pixel budget floor for the processor (Qwen: 3136 = 4 x 28 x 28).")
    max_pixels: int | None = opt(None, "Image pixel budget ceiling (VLM-R1: 12845056; lower it to save memory).")
    video_fps: float | None = opt(2.0, "Video frames per second sampled (qwen-vl-utils rule); ignored if "
                                  "video_nframes is set.")
    video_nframes: int | None = opt(None, "Fixed number of video frames (rounded to even).")
    video_max_frames: int = opt(768, "Upper bound on sampled video frames.")
    video_max_pixels: int | None = opt(None, "Per-frame pixel budget for videos (Video-R1: 128 x 28 x 28).")
    video_min_pixels: int | None = opt(None, "Per-frame pixel floor for videos (qwen-vl-utils' min_pixels; Time-R1: "
                                       "16 x 28 x 28); null: the video processor's shortest_edge on Qwen2/2.5-VL "
                                       "(Qwen2VLVideoProcessor's default: 128 x 28 x 28, as qwen-vl-utils). On "
                                       "Qwen3-VL, setting it or video_total_pixels applies qwen-vl-utils' per-frame "
                                       "budget (floor 128 x 32 x 32, cap 768 x 32 x 32) instead of the processor's "
                                       "whole-clip one.")
    video_total_pixels: int | None = opt(None, "Pixel budget of a whole video (qwen-vl-utils' total_pixels: each "
                                         "frame gets at most total / frames x 2, at least 1.05 x the floor; Time-R1: "
                                         "3584 x 28 x 28); null: 0.9 x 128000 x 28 x 28 on Qwen2/2.5-VL "
                                         "(qwen-vl-utils' default, 90316800), 0.9 x 128000 x 32 x 32 on Qwen3-VL.")
    tools: list = opt([], "Image tools the policy may call mid-completion as <tool>name(numbers)</tool> (multi-turn "
                          "rollouts, mmrl.pipelines.vlm.tools): built-in crop, rotate, contrast, or "
                          "'package.module:function'; empty: plain single-turn rollouts.")
    max_tool_calls: int = opt(2, "With tools: calls executed per completion; a call written after that is plain text.")
    tool_response_template: str = opt("\n<observation>{image}</observation>\n",
                                      "With tools: the context appended after each call ({image}: the returned view, "
                                      "or the error message when the call failed); loss-masked, attended to.")


@dataclass
class DataConfig:
    """Prompts (flow policies) or a VLM dataset."""

    dataset: str | None = opt(None, "VLM: a JSONL dataset (see mmrl.data.vlm for the format), 'tiny:grounding' / "
                                    "'tiny:temporal_grounding' for the synthetic sets made on the spot, or "
                                    "'shapeworld:<train|heldout|test>:<n>[:<task>+<task>]' for n ShapeWorld lines "
                                    "(tasks grounding, numeric, temporal_grounding; named only: grounding_crop, "
                                    "grounding_loose, temporal_grounding_timeline, "
                                    "temporal_grounding_timeline_loose) in the policy's box format.")
    skip_bad_samples: bool = opt(False, "VLM: skip (and count) samples with missing or corrupt media or prompts over "
                                 "generation.max_prompt_length instead of stopping with an error.")
    prompts: str | None = opt(None, "Prompt file: .txt (one per line) or .jsonl (a 'prompt' field, other fields "
                                    "kept as metadata for rewards), or 'shapeworld:train' / 'shapeworld:heldout' "
                                    "for a ShapeWorld split's prompts with their GenEval metadata.")
    prompt_list: list = opt([], "Inline prompts, used when `prompts` is not set.")
    eval_prompts: list = opt([], "Fixed prompts for the evaluation grid (default: the first training prompts).")
    num_eval_prompts: int = opt(4, "Rows of the evaluation grid when eval_prompts is empty.")
    eval_seeds: list = opt([0, 1, 2, 3], "Fixed seeds (grid columns) for evaluation samples.")
    prompts_per_step: int = opt(6, "Prompts sampled per update on each process.")
    group_size: int = opt(24, "Samples per prompt G, the group of group-relative advantages (Flow-GRPO: 24).")
    shuffle: bool = opt(True, "Shuffle the prompts each pass (seeded).")
    balance_tags: bool = opt(False, "Flow prompts: every GenEval category ('tag' in a prompt's metadata) gets an "
                             "equal share of each pass, its prompts cycled to the largest category's count (mmrl's "
                             "rule, as `mmrl pretrain`'s: GenEval's overall is the mean over categories, and "
                             "ShapeWorld's train split is 68 % color_attr). Every prompt needs a tag.")


#: TRL 1.16's vllm_importance_sampling_clip_max, algorithm.sampler_correction_max's default
SAMPLER_CORRECTION_MAX = 3.0


@dataclass
class AlgorithmConfig:
    """Advantages and the clipped loss (mmrl.core)."""

    scale: str = opt("batch", "Advantage scale: group | batch (group mean, batch std: Flow-GRPO global_std) | "
                     "none (Dr. GRPO).", choices=("group", "batch", "none"))
    std_ddof: int = opt(0, "0: biased std (Flow-GRPO tracker), 1: unbiased (TRL).", choices=(0, 1))
    eps: float = opt(1e-4, "Added to the std before dividing.")
    advantage_clamp: float | None = opt(5.0, "Clamp advantages to +-this (Flow-GRPO: 5); null disables.")
    reward_combination: str = opt("sum_then_normalize", "Several rewards: sum_then_normalize (Flow-GRPO; TRL's default "
                                  "too, except that a NaN in any weighted component here leaves the sample out), "
                                  "nansum_then_normalize (TRL's nansum exactly: a NaN component, a reward that does "
                                  "not apply to the sample, is left out of its sum) or normalize_then_sum "
                                  "(DanceGRPO, MixGRPO, GDPO).",
                                  choices=("sum_then_normalize", "normalize_then_sum", "nansum_then_normalize"))
    clamp_summed_advantage: bool = opt(False, "normalize_then_sum only: advantage_clamp applies to the weighted "
                                       "sum (MixGRPO's train_grpo_flux.py) instead of to each reward's advantage "
                                       "(DanceGRPO's video script, the default). MixGRPO also divides its reward "
                                       "weights by their sum: give weights summing to 1 to match it.")
    drop_zero_advantage: bool = opt(False, "Flow-GRPO's filter (scripts/train_sd3.py): before training, each "
                                    "process leaves out its samples whose advantage is 0 at every trained step, "
                                    "keeping randomly chosen ones back in until the kept count divides into the "
                                    "update's minibatches (one per minibatch where none moves, as TP-GRPO's fork "
                                    "pads); the "
                                    "minibatch count stays ceil(samples / train.batch_size) and each holds an "
                                    "equal share of the kept samples, so a minibatch's mean runs over the "
                                    "informative samples (a larger step than over all of them) and the dropped ones "
                                    "carry no KL term. false (TRL, DanceGRPO): every sample is trained.")
    batch_normalize_sum: bool = opt(False, "normalize_then_sum only: GDPO's final step, the summed advantages "
                                    "normalised over the whole batch, (A - mean) / (std + eps), unbiased std (GDPO, "
                                    "arXiv 2601.05242).")
    per_prompt_stat_tracking: bool = opt(True, "Group samples by their condition across processes (Flow-GRPO's "
                                         "tracker): a flow prompt by its text, a VLM sample by its data id (question "
                                         "and media; never by question text, which many images share). False groups "
                                         "by sampling group.")
    clip_low: float = opt(1e-4, "Clip range below 1 (Flow-GRPO 1e-4, Fast/TP-GRPO 1e-5, TRL 0.2).")
    clip_high: float | None = opt(None, "Clip range above 1 (DAPO clip-higher); null = clip_low.")
    delta: float | None = opt(None, "Two-sided clipping (INTELLECT-2, arXiv 2505.07291; TRL's `delta`): the "
                              "unclipped ratio of the surrogate is capped at delta, so a negative advantage cannot "
                              "drive a token whose ratio has run away; must exceed 1 + clip_high. null = off.")
    mask_truncated_completions: bool = opt(False, "VLM: leave completions that hit generation.max_new_tokens "
                                           "without their end-of-turn token out of the loss (TRL's option of this "
                                           "name; DAPO's overlong filtering, arXiv 2503.14476): they are still "
                                           "scored and count in their group's statistics, and a `grpo` mean still "
                                           "divides by them, as TRL's does.")
    top_entropy_quantile: float = opt(1.0, "VLM: keep in the policy term only the tokens whose entropy is in the top "
                                      "rho quantile (\"Beyond the 80/20 Rule\", arXiv 2506.01939; TRL's option of "
                                      "this name; the paper uses 0.2); 1 keeps all. mmrl takes the quantile over "
                                      "every real token of the whole update (all processes) from one no-gradient "
                                      "pass of the sampling policy, so it is the same for every batch layout (TRL: "
                                      "per micro-batch, in its training forward; equal when one micro-batch is the "
                                      "whole update). The KL term and the loss's token counts are unchanged, as in "
                                      "TRL.")
    entropy_coef: float = opt(0.0, "VLM: entropy bonus, loss - coef x the mean entropy of the tempered next-token "
                              "distribution over the trained tokens (the high-entropy ones under "
                              "top_entropy_quantile), with gradient; TRL's entropy_coef with a fixed coefficient "
                              "(its adaptive mode is not built). mmrl's mean is over every trained token of the "
                              "optimizer step on every process (the same update for every layout); TRL's per "
                              "micro-batch, equal when one micro-batch is the whole step. 0: off.")
    sampler_correction: str | None = opt(None, "VLM rollouts sampled by vLLM (generation.engine: vllm): "
                                         "importance correction of the engine / trainer log-prob gap, TRL 1.16's "
                                         "vllm_importance_sampling_mode: token_truncate | token_mask | "
                                         "sequence_truncate | sequence_mask, or none; null: sequence_mask with vLLM "
                                         "(TRL's default), nothing with HF generate (no gap to correct).",
                                         choices=(None, "none", "token_truncate", "token_mask", "sequence_truncate",
                                                  "sequence_mask"))
    sampler_correction_max: float | None = opt(SAMPLER_CORRECTION_MAX, "sampler_correction's upper bound C_max "
                                               "(TRL's vllm_importance_sampling_clip_max, 3.0); null: none.")
    sampler_correction_min: float | None = opt(None, "sampler_correction's lower bound C_min (TRL's "
                                               "vllm_importance_sampling_clip_min); null: none.")
    aggregation: str = opt("grpo", "Loss aggregation: grpo | bnpo | dr_grpo | dapo (TRL definitions).",
                           choices=("grpo", "bnpo", "dr_grpo", "dapo"))
    ratio_level: str = opt("token", "Importance ratio per action ('token') or per sample ('sequence', GSPO).",
                           choices=("token", "sequence"))
    beta: float = opt(0.0, "KL coefficient to the reference policy (Flow-GRPO: 0.04 for GenEval, 0 for PickScore).")
    kl_estimator: str = opt("k3", "VLM policies, with beta > 0: the per-token KL estimate. k3: exp(ref - logp) - "
                                  "(ref - logp) - 1 (TRL); low_var_kl: k3 with ref - logp clamped to +-20 and the "
                                  "estimate to +-10 (verl's and EasyR1's default); k1: logp - ref; k2: (logp - ref)^2 "
                                  "/ 2; abs: |logp - ref|. Flow policies take Flow-GRPO's Gaussian KL of the step "
                                  "means (k3 here).", choices=("k3", "low_var_kl", "k1", "k2", "abs"))
    kl_bias_correction: bool = opt(False, "With beta > 0: multiply each action's KL by its importance ratio, gradient "
                                   "kept (TRL 1.16's use_bias_correction_kl, on by default there; the unbiased "
                                   "reverse-KL gradient of DeepSeek-V3.2, arXiv 2512.02556). Off: the plain KL of "
                                   "Flow-GRPO, EasyR1 / verl and TRL before 1.16.")
    variants: list = opt([], "Algorithm variants, registered plug-ins applied in this order, each a name or {name: "
                         "..., <options>} (e.g. [{name: turning_point, balance: true}, {name: adaptive_noise}]); "
                         "`mmrl variants` lists them with their options and papers. A third-party variant is "
                         "'package.module:ClassName' or an 'mmrl.variants' entry point.")


@dataclass
class OptimConfig:
    """AdamW, clipping, schedule, EMA."""

    lr: float = opt(3e-4, "Learning rate (Flow-GRPO LoRA: 3e-4).")
    betas: list = opt([0.9, 0.999], "AdamW betas.")
    weight_decay: float = opt(1e-4, "AdamW weight decay.")
    adam_eps: float = opt(1e-8, "AdamW epsilon.")
    max_grad_norm: float = opt(1.0, "Gradient norm clipping; 0 disables.")
    lr_scheduler: str = opt("constant", "LR schedule after warmup.", choices=("constant", "linear", "cosine"))
    warmup_steps: int = opt(0, "Linear warmup optimizer steps: step k (from 0) of W runs at (k + 1) / W of "
                                 "the lr (mmrl's rule; transformers' and diffusers' schedulers run step 0 at lr 0, "
                                 "k / W).")
    ema: bool = opt(False, "Keep an exponential moving average of the trainable weights (used for eval and export).")
    ema_decay: float = opt(0.9, "EMA decay per EMA update.")
    ema_update_interval: int = opt(1, "Update the EMA only at optimizer steps s (steps taken, this one included) "
                                   "with (s + 1) % interval == 0 (Flow-GRPO's EMAModuleWrapper "
                                   "update_step_interval: 8 -> steps 7, 15, ...).")
    ema_warmup: bool = opt(False, "Flow-GRPO's EMA decay warm-up: at optimizer step s the decay is "
                           "min(ema_decay, (1 + s) / (10 + s)) (Flow-GRPO always warms up; its recipes: decay 0.9, "
                           "interval 8, warm-up on).")
    ema_every_minibatch: bool = opt(False, "Flow-GRPO's call pattern: its train_sd3.py calls ema.step after every "
                                    "training batch with the number of optimizer steps taken so far, so each "
                                    "qualifying step's update is applied once after the step and again after each "
                                    "of the next window's first gradient_accumulation_steps - 1 minibatches (on "
                                    "unchanged weights): with 8 minibatches per step, one-minus-decay 1 - 0.9^8 = "
                                    "0.57 instead of 0.1. false: one update per optimizer step.")


@dataclass
class TrainConfig:
    """The loop."""

    steps: int = opt(1000, "Number of updates (sample -> score -> optimise).")
    inner_epochs: int = opt(1, "Passes over each sampled batch (K).")
    batch_size: int = opt(9, "Samples per minibatch on each process (Flow-GRPO: 9).")
    gradient_accumulation_steps: int = opt(8, "Minibatches per optimizer step (Flow-GRPO: 2 optimizer steps per "
                                           "update). The loss is a mean over the minibatches really accumulated: one "
                                           "step of GA minibatches equals one minibatch GA times larger, a shorter "
                                           "last step is a mean over its own, and a GA above the minibatches of an "
                                           "update (warned at start) accumulates all of them.")
    timestep_chunk: int = opt(0, "Trained steps (flows) or tokens (VLMs) per forward pass (0 = all at once). A "
                              "memory knob only: every chunk is normalised by the whole trajectory, and GSPO's "
                              "sequence ratio spans the whole trajectory (one extra no-grad pass per minibatch "
                              "computes it), so the loss and gradient do not depend on the chunk size.")
    minibatch_order: str = opt("auto", "How each inner epoch orders an update's samples before cutting minibatches: "
                               "'samples' shuffles every sample (TRL, Flow-GRPO); 'groups' shuffles the groups and "
                               "keeps each group's samples together (verl's repeat-interleaved groups with "
                               "balance_batch off, in a seeded order), so a minibatch holds as few distinct "
                               "prompts as its size allows; 'auto': 'groups' where the policy runs each distinct prompt once per forward (VLM, model.share_prompt_prefix), "
                               "'samples' otherwise. With one optimizer step per update the order changes nothing "
                               "but float summation order; with several it decides which samples share a step.",
                               choices=("auto", "samples", "groups"))
    mixed_precision: str = opt("bf16", "accelerate mixed precision.", choices=("no", "bf16", "fp16"))
    allow_tf32: bool = opt(False, "CUDA: let float32 matmuls use TF32 (torch.backends.cuda.matmul.allow_tf32, for "
                           "the whole process), as Flow-GRPO (config.allow_tf32, default on) and DanceGRPO "
                           "(--allow_tf32) run: the fp32 parts (VAE decode, fp32 reward models) get faster and "
                           "round to TF32. false leaves PyTorch's default (off). No effect on CPU.")
    reward_batch_size: int = opt(32, "Images per reward call.")
    sample_batch_size: int = opt(16, "Trajectories per sampling forward pass on each process.")
    overlap_scoring: bool | str = opt("auto", "Flow policies: score each decoded chunk of sample_batch_size images "
                                      "on a worker thread (its own CUDA stream) while the next chunk is sampled. "
                                      "'auto': on when the policy runs on a GPU, off on CPU, where the sampler "
                                      "already keeps every core busy and a second thread of torch ops only "
                                      "competes for them (measured: no faster, up to 1.5x slower).",
                                      choices=(True, False, "auto"))


@dataclass
class LoggingConfig:
    """Outputs."""

    eval_every: int = opt(60, "Write samples/step_<k>.png (ODE, fixed prompts and seeds) every this many updates; 0 off.")
    save_every: int = opt(60, "Write checkpoints/step_<k>/ every this many updates; 0 only at the end.")
    keep_last: int = opt(2, "Checkpoints kept on disk.")
    tensorboard: bool = opt(True, "Write TensorBoard events under output_dir/tensorboard.")
    wandb_project: str | None = opt(None, "Also log to this Weights & Biases project (needs `pip install wandb`).")
    progress_bar: bool = opt(True, "Show a progress bar on the main process.")


@dataclass
class EvalConfig:
    """Benchmarks during training: ``mmrl eval``'s benchmarks on a subset, logged as ``eval/<benchmark>/<metric>``."""

    every: int = opt(0, "Run eval.benchmarks every this many updates (and before the first update); 0 off. Files "
                        "in output_dir/eval/update_<k>/, as `mmrl eval` writes them.")
    benchmarks: list = opt([], "Benchmarks as `mmrl eval benchmarks=` takes them, e.g. [geneval, ocr, "
                               "reward:pickscore@drawbench] (image policies) or the VLM ones.")
    limit: int = opt(16, "Prompts (VLM: samples) per benchmark: the first ones of each set.")
    options: dict = opt({}, "Other `mmrl eval` keys -> value (images_per_prompt, num_steps, resolution, guidance, "
                            "detector, reward_kwargs, ...); benchmarks, limit, checkpoint and output_dir are set "
                            "by the trainer.")


@dataclass
class Config:
    """A training run."""

    output_dir: str = opt("runs/mmrl", "Where config.yaml, metrics.jsonl, samples/ and checkpoints/ go.")
    seed: int = opt(0, "Seed for data order, noise and initialisation.")
    resume: str | None = opt(None, "'auto' (latest checkpoint in output_dir, if any), a checkpoint path, or null.")
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "The policy."})
    sampling: SamplingConfig = field(default_factory=SamplingConfig, metadata={"help": "Flow rollouts."})
    generation: GenerationConfig = field(default_factory=GenerationConfig, metadata={"help": "VLM rollouts."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Prompts."})
    rewards: dict = opt({},
                        "Reward name -> weight, or -> {weight: w, kwargs: {...}, reward: registered name} "
                        "(see `mmrl rewards`).")
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig, metadata={"help": "Advantages and loss."})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"help": "Optimizer."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "The loop."})
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"help": "Outputs."})
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"help": "Benchmarks during training."})


def import_attribute(spec: str) -> Any:
    """``"package.module:name"`` -> that object (a plug-in named in a config). The working directory is searched
    after the installed packages (as ``python -m`` does), so a ``my_rewards.py`` next to the config imports from the
    ``mmrl`` command too. ValueError saying what failed (a module that does not import: its error and line)."""
    import sys

    module, _, attr = spec.partition(":")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.append(str(Path.cwd()))
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {attr!r} from {module!r} ({exc})") from None
    except Exception as exc:  # the module itself fails: a SyntaxError, an exception at import time
        where = f" ({exc.filename}, line {exc.lineno})" if isinstance(exc, SyntaxError) else ""
        raise ValueError(f"cannot import {attr!r} from {module!r}: importing {module!r} failed with "
                         f"{type(exc).__name__}: {exc}{where}") from None


#: the tiny random models ``model.pretrained: tiny:<kind>`` builds, per model.family (pipelines.flow.tiny and
#: pipelines.vlm.tiny's builders)
TINY_KINDS = {"sd3": ("sd3",), "flux": ("flux",), "qwen_vl": ("qwen2_5_vl", "qwen2_vl", "qwen3_vl")}
#: transformers' attention kernels (``attn_implementation``)
ATTENTION_KERNELS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention")

#: fields of the shared sections that one family reads and the other ignores (a set one is warned about)
VLM_ONLY_FIELDS = {"data": ("dataset", "skip_bad_samples"),
                   "model": ("freeze_vision", "attn_implementation", "share_prompt_prefix")}
FLOW_ONLY_FIELDS = {"data": ("prompts", "prompt_list", "eval_prompts", "eval_seeds"), "model": ("resolution",),
                    "train": ("sample_batch_size", "overlap_scoring")}


def _changed_fields(section: Any) -> list[str]:
    """The fields of a config section whose values differ from their defaults."""
    defaults = type(section)()
    return [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(defaults, f.name)]


def _nearest(key: str, options: list[str], prefix: str = "") -> str:
    """``"; did you mean 'train.steps'?"`` (the full dotted key), or the section's valid keys."""
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    if close:
        return f"; did you mean {prefix + close[0]!r}?"
    return f"; valid keys{' in ' + prefix.rstrip('.') if prefix else ''}: {', '.join(sorted(options))}"


def _file_above(path: str) -> Path | None:
    """The nearest existing ancestor of ``path`` when it is a file (nothing can be made under it), else None."""
    for parent in Path(path).expanduser().absolute().parents:
        if parent.exists():
            return parent if not parent.is_dir() else None
    return None


def _not_a_name(what: str, key: Any) -> ConfigError:
    """A mapping key that is not a string: YAML reads an unquoted on / off / yes / no as a boolean, 1 as an int."""
    return ConfigError(f"{what} ({type(key).__name__}) is not a name (YAML reads an unquoted on / off / yes / no as a "
                       f"boolean and a number as a number: quote it)")


def _type_names(annotation: Any) -> set[str]:
    args = typing.get_args(annotation) or (annotation,)
    return {getattr(a, "__name__", str(a)) for a in args}


def _coerce(value: Any, annotation: Any, path: str) -> Any:
    """Check ``value`` against a field's annotation (int, float, bool, str, list, dict, optionally | None)."""
    names = _type_names(annotation)
    if value is None:
        if "NoneType" in names:
            return None
        raise ConfigError(f"{path}: null is not allowed here")
    if "bool" in names and (isinstance(value, bool) or "str" not in names):
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if isinstance(value, bool) and names & {"int", "float"}:
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if "float" in names and isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
        except ValueError:
            pass
    if "float" in names and isinstance(value, (int, float)):
        return float(value)
    if "int" in names and isinstance(value, int):
        return value
    if "dict" in names and isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise _not_a_name(f"{path}: key {key!r}", key)
        return value
    for name, kind in (("str", str), ("list", list)):
        if name in names and isinstance(value, kind):
            return value
    expected = " or ".join(sorted(names - {"NoneType"}))
    hint = ""
    if isinstance(value, bool) and "str" in names:  # YAML 1.1: no / yes / on / off (unquoted) are booleans
        hint = f" (YAML reads an unquoted no / yes / on / off as a boolean: quote the text, e.g. \"{path}='no'\")"
    raise ConfigError(f"{path}: expected {expected}, got {value!r}{hint}")


#: keys that became algorithm variants (:mod:`mmrl.algorithms`): the error names the new spelling
MOVED_KEYS = {
    "algorithm.advantage": "algorithm.variants: [g2rpo] (advantage: gaussian_rank); grpo is the default estimator",
    "algorithm.credit": "algorithm.variants: [step_gain] (or turning_point, cosine); outcome credit is the default",
    "algorithm.credit_balance": "algorithm.variants: [{name: turning_point, balance: true}]",
    "algorithm.credit_consistency_filter": "algorithm.variants: [{name: turning_point, consistency_filter: false}]",
    "algorithm.value_anchor_weight": "algorithm.variants: [{name: vgpo, weight: 1.0}]",
    "algorithm.value_anchor_scale": "algorithm.variants: [{name: vgpo, scale: 1.0}]",
    "algorithm.advantage_transform": "algorithm.variants: [{name: ga_grpo, reward: iou}] (evidence_weighted) or "
                                     "[tw_grpo] (token_variance)",
    "algorithm.evidence_reward": "algorithm.variants: [{name: ga_grpo, reward: <component>}]",
    "algorithm.evidence_floor": "algorithm.variants: [{name: ga_grpo, reward: <component>, floor: 0.0}]",
    "algorithm.token_weight_max": "algorithm.variants: [{name: tw_grpo, max_weight: 1.4}]",
    "algorithm.dynamic_sampling": "algorithm.variants: [dynamic_sampling]",
    "algorithm.max_sampling_rounds": "algorithm.variants: [{name: dynamic_sampling, max_rounds: 3}]",
    "algorithm.temporal_contrast": "algorithm.variants: [{name: t_grpo, reward: <accuracy component>}]",
    "algorithm.temporal_contrast_reward": "algorithm.variants: [{name: t_grpo, reward: <accuracy component>}]",
    "algorithm.temporal_contrast_alpha": "algorithm.variants: [{name: t_grpo, reward: <component>, alpha: 0.3}]",
    "algorithm.temporal_contrast_mu": "algorithm.variants: [{name: t_grpo, reward: <component>, mu: 0.8}]",
    "sampling.adaptive_noise": "algorithm.variants: [..., adaptive_noise]",
    "sampling.adaptive_noise_rate": "algorithm.variants: [..., {name: adaptive_noise, rate: 0.1}]",
}


def _other_sections(root: type, key: str, prefix: str) -> list[str]:
    """``section.key`` for each section of the ``root`` config class (not the one at ``prefix``) with a field
    ``key``: where a key written in the wrong section belongs."""
    hints = typing.get_type_hints(root)
    return [f"{f.name}.{key}" for f in dataclasses.fields(root) if dataclasses.is_dataclass(hints[f.name])
            and f"{f.name}." != prefix and key in {g.name for g in dataclasses.fields(hints[f.name])}]


def _build(cls: type, data: dict[str, Any], prefix: str = "", root: type | None = None) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    root = root or cls
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if not isinstance(key, str):
            raise _not_a_name(f"config key {path!r}", key)
        if key not in fields:
            if path in MOVED_KEYS:
                raise ConfigError(f"config key {path!r} is now an algorithm variant: write {MOVED_KEYS[path]} "
                                  f"(`mmrl variants` lists them)")
            elsewhere = _other_sections(root, key, prefix)
            if elsewhere:
                raise ConfigError(f"unknown config key {path!r}: {key!r} belongs to another section; did you mean "
                                  f"{' or '.join(repr(k) for k in elsewhere)}?")
            raise ConfigError(f"unknown config key {path!r}{_nearest(key, list(fields), prefix)}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value or {}, prefix=f"{path}.", root=root)
            continue
        value = _coerce(value, hint, path)
        choices = fields[key].metadata.get("choices")
        if choices is not None and value is not None and value not in choices:
            raise ConfigError(f"{path}: {value!r} is not one of {list(choices)}")
        kwargs[key] = value
    return cls(**kwargs)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any, schema: type | None = None) -> None:
    """Set ``dotted`` in the raw config ``data``. A mapping given for a whole section of ``schema`` (a dataclass
    field, e.g. ``model={dtype: float32}``) is merged into what the file has, key by key, as OmegaConf merges; a
    mapping-valued field (``rewards``, ``eval.options``) is replaced."""
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
    current, section = node.get(parts[-1]), _section_type(schema, parts)
    if isinstance(value, dict) and isinstance(current, dict) and section is not None:
        for key, item in value.items():
            if isinstance(key, str):
                _set_dotted(current, key, item, section)
            else:  # a key YAML read as a boolean or number: _build names it
                current[key] = item
        return
    node[parts[-1]] = value


def _section_type(schema: type | None, parts: list[str]) -> type | None:
    """The dataclass type at ``parts`` of ``schema`` (None where it is not one)."""
    for part in parts:
        if schema is None or not dataclasses.is_dataclass(schema):
            return None
        hint = typing.get_type_hints(schema).get(part)
        schema = hint if dataclasses.is_dataclass(hint) else None
    return schema


def yaml_error_text(exc: yaml.YAMLError) -> str:
    """One line for a YAML error: ``line 3, column 2: <problem> (<context>)`` (PyYAML's own text spans several
    lines and quotes the offending line)."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if problem is None:
        return " ".join(str(exc).split())
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context = getattr(exc, "context", None)
    return f"{where}{problem}" + (f" ({context})" if context else "")


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader refusing a key written twice in one mapping (plain YAML keeps the last silently, so a second
    ``logging:`` section would drop the first's fields)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, (str, int, float, bool)) and key is not None:
                    continue  # an unhashable key is YAML's own error below
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (also on line {seen[key] + 1}): the later one would "
                        f"replace the earlier one whole; merge them", key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def read_config_file(path: Path, *, folder_hint: str = "") -> tuple[str, Any]:
    """``(text, data)`` of a YAML config file (``data`` is ``{}`` for an empty file); a one-line
    :class:`ConfigError` for a folder (``folder_hint`` appended), a missing file, a file that is not UTF-8 text or
    not valid YAML."""
    if path.is_dir():
        raise ConfigError(f"{path} is a folder, not a config file" + folder_hint)
    if not path.is_file():
        hint = "" if path.is_absolute() else f" (relative paths resolve from the working directory {Path.cwd()})"
        raise ConfigError(f"config file not found: {path}{hint}")
    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text file (byte {exc.start} is not UTF-8)") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {yaml_error_text(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level (model:, data:, train:, ...), "
                          f"got a {type(data).__name__}")
    return text, data


def yaml_key_lines(text: str) -> dict[str, int]:
    """``{dotted key: 1-based line}`` of a YAML mapping document (for errors that name the line)."""
    lines: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    dotted = f"{prefix}{key.value}"
                    lines[dotted] = key.start_mark.line + 1
                    walk(value, dotted + ".")

    try:
        walk(yaml.compose(text), "")
    except yaml.YAMLError:
        pass
    return lines


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["train.steps=4", "rewards={jpeg_compressibility: 1}"]`` -> ``[(key, parsed value), ...]``."""
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. train.steps=4)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: {key!r} is not a dotted key (e.g. train.steps=4)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({yaml_error_text(exc)}); "
                              "values are parsed as YAML: quote a string that is meant literally") from None
        parsed.append((key, value))
    return parsed


#: ``model.family: qwen_vl``: the advantage and loss settings a config leaves out are TRL 1.16's ``GRPOConfig``
#: defaults (``scale_rewards="group"``, the unbiased std, no clamp, ``epsilon=0.2``, ``loss_type="dapo"``); the
#: dataclass defaults are Flow-GRPO's SD3.5 settings (clip 1e-4, batch std, clamp 5, ``grpo``), which would clip a
#: VLM's second optimizer step at 1 +- 1e-4
VLM_ALGORITHM_DEFAULTS: dict[str, Any] = {"scale": "group", "std_ddof": 1, "advantage_clamp": None, "clip_low": 0.2,
                                          "aggregation": "dapo"}


#: ``model.family: flux``: the sampling settings a config leaves out are ``FluxPipeline.__call__``'s defaults (T5 at
#: 512 tokens, distilled guidance 3.5); the dataclass defaults (256, 4.5) are SD3's pipeline and Flow-GRPO's CFG
FLUX_SAMPLING_DEFAULTS: dict[str, Any] = {"max_sequence_length": 512, "guidance_scale": 3.5}


def _with_family_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with :data:`VLM_ALGORITHM_DEFAULTS` under the keys a ``qwen_vl`` config leaves out of ``algorithm``,
    and :data:`FLUX_SAMPLING_DEFAULTS` under those a ``flux`` config leaves out of ``sampling``."""
    model, algorithm, sampling = data.get("model"), data.get("algorithm") or {}, data.get("sampling") or {}
    family = model.get("family") if isinstance(model, dict) else None
    if family == "qwen_vl" and isinstance(algorithm, dict):
        data["algorithm"] = {**VLM_ALGORITHM_DEFAULTS, **algorithm}
    if family == "flux" and isinstance(sampling, dict):
        data["sampling"] = {**FLUX_SAMPLING_DEFAULTS, **sampling}
    return data


def config_from_dict(data: dict[str, Any], overrides: list[str] | None = None, *, check_files: bool = True) -> Config:
    data = dict(data or {})
    for key, value in parse_overrides(overrides or []):
        _set_dotted(data, key, value, Config)
    config = _build(Config, _with_family_defaults(data))
    validate(config, check_files=check_files)
    return config


def load_config(path: str | Path | None, overrides: list[str] | None = None, *, check_files: bool = True) -> Config:
    """Read YAML (``None``: the embedded default, the ShapeWorld CPU Flow-GRPO run), apply overrides, validate.

    Keys a config file leaves out take the dataclass defaults (``mmrl config show --help-fields``), which are
    the SD3.5-Medium / Flow-GRPO GPU settings, not the CPU ones of the embedded default
    (``mmrl/default.yaml``). Relative paths in the config are resolved from the working directory.
    ``check_files=False`` skips the checks that depend on this machine: that input files exist and that
    optional packages the config asks for (wandb) are installed."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if path.is_dir() or path.name == "config.yaml":  # a pretrain or sft run's folder or config: not a train config
        from mmrl.checkpoint import other_command_run

        other = other_command_run(path if path.is_dir() else path.parent)
        if other is not None:
            raise ConfigError(other)
    _, data = read_config_file(path, folder_hint=f" (a run folder: its config is {path / 'config.yaml'})"
                               if (path / "config.yaml").is_file() else "")
    parse_overrides(overrides or [])  # a malformed override is its own error, whatever the file
    try:
        return config_from_dict(data, overrides, check_files=check_files)
    except ConfigError as exc:
        where = str(path) if path != DEFAULT_CONFIG else "the embedded default config (mmrl/default.yaml)"
        where = f"{where} with overrides {overrides}" if overrides else where
        raise ConfigError(f"{where}: {exc}") from None


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def dump_config(config: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _non_finite_floats(obj: Any, prefix: str = "") -> list[str]:
    """Dotted keys of float fields holding NaN or +-inf (YAML reads ``.nan`` and ``.inf`` as floats)."""
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys += _non_finite_floats(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            keys.append(f"{prefix}{f.name}")
    return keys


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _path_hint(path: str) -> str:
    """The file-not-found hint: where a relative path was looked for, and how to skip the check."""
    where = ""
    if not Path(path).expanduser().is_absolute():
        where = f"relative paths are resolved from the working directory {Path.cwd()}; "
    return f" ({where}`mmrl config validate --no-check-files` skips this check)"


def _check_environment(config: Config) -> None:
    """What this machine must have for the config: the resume checkpoint, wandb when it is asked for."""
    resume = config.resume
    if resume not in (None, "auto"):
        path = Path(resume).expanduser()
        if not path.is_dir():
            raise ConfigError(f"resume: checkpoint folder not found: {resume}{_path_hint(resume)}; resume=auto "
                              f"continues from the latest checkpoint in output_dir")
        if not (path / "state.json").is_file():
            hint = (f"; it is a run folder: resume=auto with output_dir={resume} continues it"
                    if (path / "checkpoints").is_dir() else "")
            raise ConfigError(f"resume: {resume} is not a complete checkpoint (no state.json){hint}")
    if config.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"logging.wandb_project={config.logging.wandb_project!r} needs wandb, which is not "
                          f"installed: `pip install wandb` (or `pip install 'mmrl-align[wandb]'`), or set "
                          f"logging.wandb_project=null")


def _check_engine(g: GenerationConfig, *, check_files: bool) -> None:
    """generation.engine and generation.vllm: what the vLLM engine takes (its module states why)."""
    if g.engine != "vllm":
        if g.vllm:
            raise ConfigError(f"generation.vllm is for generation.engine: vllm (engine is {g.engine!r})")
        if g.vllm_server is not None:
            raise ConfigError(f"generation.vllm_server is for generation.engine: vllm (engine is {g.engine!r})")
    if g.vllm_server is None and g.vllm_server_timeout != GenerationConfig.vllm_server_timeout:
        raise ConfigError("generation.vllm_server_timeout is for server mode (generation.vllm_server: URL)")
    if g.engine != "vllm":
        return
    if g.vllm_server is not None:
        if not re.fullmatch(r"https?://[^\s/]+(:\d+)?/?", str(g.vllm_server)):
            raise ConfigError(f"generation.vllm_server must be a URL http://host:port, got {g.vllm_server!r}")
    from mmrl.pipelines.vlm.vllm_engine import RESERVED_OPTIONS, vllm_missing

    if not isinstance(g.vllm, dict):
        raise ConfigError(f"generation.vllm must be a mapping of vllm.LLM arguments, got {g.vllm!r}")
    reserved = sorted(set(g.vllm) & set(RESERVED_OPTIONS))
    if reserved:
        raise ConfigError(f"generation.vllm: {reserved} are set by mmrl (the policy's checkpoint, dtype, seed, lengths "
                          f"and log-prob mode)")
    if g.tools:
        raise ConfigError("generation.engine: vllm samples single-turn completions; tool calls (generation.tools) "
                          "need the default engine 'hf'")
    if g.cache_implementation != "dynamic":
        raise ConfigError("generation.cache_implementation is HF generate's KV cache; with generation.engine: vllm "
                          "vLLM manages its own (leave it 'dynamic')")
    problem = vllm_missing() if check_files and g.vllm_server is None else None  # a server runs vLLM elsewhere
    if problem:
        raise ConfigError(problem)


#: (section, fields, what they need, whether a config has it): fields read only under another setting, so that
#: setting one without it changes nothing (logged as ignored); flow-only ones are checked on flow configs (a VLM
#: config's sampling.* is ignored as a whole, with a warning)
def _dependent_fields(config: Config, flow: bool,
                      variants: list) -> list[tuple[str, tuple[str, ...], str, bool]]:
    s, m, o, g, a = config.sampling, config.model, config.optim, config.generation, config.algorithm
    rules = [
        ("model", ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules"), "model.use_lora: true",
         m.use_lora),
        ("optim", ("ema_decay", "ema_update_interval", "ema_warmup"), "optim.ema: true", o.ema),
        ("optim", ("ema_every_minibatch",), "train.gradient_accumulation_steps > 1 (one minibatch per optimizer "
         "step: it calls the update once, as without it)", config.train.gradient_accumulation_steps > 1),
        ("algorithm", ("sampler_correction_max", "sampler_correction_min"),
         "an algorithm.sampler_correction other than none (the bounds of its weights)",
         a.sampler_correction != "none"),
    ]
    if flow:
        rules += [
            ("sampling", ("window_size",), "sampling.train_steps: random_window or sliding_window",
             s.train_steps in ("random_window", "sliding_window")),
            ("sampling", ("window_shift_every",), "sampling.train_steps: sliding_window",
             s.train_steps == "sliding_window"),
            ("sampling", ("timestep_fraction",), "sampling.train_steps: fraction or random_fraction",
             s.train_steps in ("fraction", "random_fraction")),
            ("sampling", ("merge_threshold", "merge_groups"), "sampling.train_steps: entropy_merge",
             s.train_steps == "entropy_merge"),
            ("sampling", ("intermediate",), "a variant that uses the intermediate images (step_gain, "
             "turning_point, ...; `mmrl variants`)", any("intermediate_images" in v.needs for v in variants)),
            ("sampling", ("noise_level",), "an empty sampling.noise_schedule (a schedule gives every step's level)",
             not s.noise_schedule),
            ("data", ("prompt_list",), "data.prompts unset (a prompt file, when set, is what the run reads)",
             config.data.prompts is None),
        ]
    else:
        rules += [
            ("generation", ("max_tool_calls", "tool_response_template"), "generation.tools", bool(g.tools)),
            ("generation", ("video_fps", "video_max_frames"), "generation.video_nframes: null (a fixed frame "
             "count takes neither: qwen-vl-utils' rule)", g.video_nframes is None),
        ]
    return rules


def _check_dependent_fields(config: Config, flow: bool, variants: list) -> None:
    """Log a field set (away from its default) where nothing reads it (:func:`_dependent_fields`) as ignored, as
    the other family's fields are: a warning, not an error, so that turning a setting off on the command line
    (``model.use_lora=false`` on a LoRA recipe) and resuming that run from its saved config keep working."""
    for section, keys, needs, present in _dependent_fields(config, flow, variants):
        changed = [f"{section}.{k}" for k in keys if k in _changed_fields(getattr(config, section))]
        if changed and not present:
            logger.warning("%s ignored: %s only with %s, which this config does not have", ", ".join(changed),
                           "it applies" if len(changed) == 1 else "they apply", needs)


def validate(config: Config, *, check_files: bool = True) -> None:
    """Range checks that types alone cannot express, and (``check_files``) what this machine must have: the
    named input files (relative paths from the working directory), the ``resume`` checkpoint, wandb when
    ``logging.wandb_project`` is set. Raises :class:`ConfigError`."""
    s, d, t, a = config.sampling, config.data, config.train, config.algorithm
    m, o, log, g = config.model, config.optim, config.logging, config.generation
    flow = m.family != "qwen_vl"
    for key in _non_finite_floats(config):
        raise ConfigError(f"{key}: must be a finite number, got {_get(config, key)!r}")
    checks = [
        (0 <= config.seed < 2**63, "seed must be in [0, 2**63)"),
        (bool(config.output_dir.strip()), "output_dir must not be empty"),
        (not Path(config.output_dir).is_file(), f"output_dir={config.output_dir} is a file; name a folder"),
        (_file_above(config.output_dir) is None, f"output_dir={config.output_dir}: {_file_above(config.output_dir)} "
                                                 f"is a file, so no folder can be made under it"),
        (bool(m.pretrained.strip()), "model.pretrained must name a model: a hub id, a local folder or tiny:<kind>"),
        (not m.pretrained.startswith("tiny:") or m.pretrained[5:] in TINY_KINDS.get(m.family, ()),
         f"model.pretrained={m.pretrained}: the tiny random models of model.family={m.family} are "
         f"{', '.join('tiny:' + k for k in TINY_KINDS.get(m.family, ()))}"),
        (m.attn_implementation is None or m.attn_implementation in ATTENTION_KERNELS
         or "/" in m.attn_implementation or m.attn_implementation.startswith("paged|"),
         f"model.attn_implementation={m.attn_implementation!r}: transformers' kernels are "
         f"{', '.join(ATTENTION_KERNELS)} (or a hub kernel, 'owner/repo'); null picks its default"),
        (not m.use_lora or m.lora_rank >= 1, "model.lora_rank must be >= 1 (or model.use_lora: false)"),
        (not m.use_lora or m.lora_alpha > 0, "model.lora_alpha must be > 0"),
        (0.0 <= m.lora_dropout < 1.0, "model.lora_dropout must be in [0, 1)"),
        (all(isinstance(x, str) and x for x in m.lora_target_modules),
         "model.lora_target_modules must be a list of module names (strings)"),
        (not flow or m.resolution >= 16, "model.resolution must be >= 16"),
        (not flow or a.kl_estimator == "k3", f"algorithm.kl_estimator={a.kl_estimator} applies to VLM policies "
                                             f"(qwen_vl): a flow policy's KL is Flow-GRPO's Gaussian KL of the step "
                                             f"means"),
        (a.kl_estimator == "k3" or a.beta > 0, f"algorithm.kl_estimator={a.kl_estimator} estimates the KL term: it "
                                               f"needs algorithm.beta > 0"),
        (flow or not d.balance_tags, "data.balance_tags applies to flow prompts, not a VLM data set (qwen_vl)"),
        (not flow or m.share_prompt_prefix, "model.share_prompt_prefix applies to VLM policies (qwen_vl); a flow "
                                            "policy has no prompt prefix in its forwards"),
        (s.eval_num_steps >= 1, "sampling.eval_num_steps must be >= 1"),
        (s.max_sequence_length >= 1, "sampling.max_sequence_length must be >= 1"),
        (not flow or s.max_sequence_length <= 512, "sampling.max_sequence_length must be <= 512 (the T5 budget the "
                                                   "SD3 and FLUX pipelines accept)"),
        (s.time_shift is None or s.time_shift > 0, "sampling.time_shift must be > 0 (or null)"),
        (all(_is_number(x) and x >= 0 for x in s.noise_schedule),
         "sampling.noise_schedule must be a list of noise levels >= 0"),
        (o.lr > 0, "optim.lr must be > 0"),
        (len(o.betas) == 2 and all(_is_number(b) and 0.0 <= b < 1.0 for b in o.betas),
         "optim.betas must be two numbers in [0, 1), e.g. [0.9, 0.999]"),
        (o.weight_decay >= 0, "optim.weight_decay must be >= 0"),
        (o.adam_eps > 0, "optim.adam_eps must be > 0"),
        (o.max_grad_norm >= 0, "optim.max_grad_norm must be >= 0 (0 disables clipping)"),
        (o.warmup_steps >= 0, "optim.warmup_steps must be >= 0"),
        (t.sample_batch_size >= 1, "train.sample_batch_size must be >= 1"),
        (t.reward_batch_size >= 1, "train.reward_batch_size must be >= 1"),
        (log.eval_every >= 0, "logging.eval_every must be >= 0 (0 turns evaluation off)"),
        (config.eval.every >= 0, "eval.every must be >= 0 (0 turns benchmarks during training off)"),
        (config.eval.limit >= 1, "eval.limit must be >= 1"),
        (not config.eval.every or bool(config.eval.benchmarks),
         "eval.benchmarks must not be empty while eval.every > 0 (e.g. eval.benchmarks=[ocr])"),
        (all(isinstance(b, str) and b.strip() for b in config.eval.benchmarks),
         "eval.benchmarks must be a list of benchmark names (as `mmrl eval benchmarks=` takes them)"),
        (log.save_every >= 0, "logging.save_every must be >= 0 (0 saves only at the end)"),
        (log.wandb_project is None or bool(log.wandb_project.strip()),
         "logging.wandb_project must be a project name (or null)"),
        (d.num_eval_prompts >= 1, "data.num_eval_prompts must be >= 1"),
        (all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63 for x in d.eval_seeds),
         "data.eval_seeds must be a list of integer seeds >= 0"),
        (not flow or not log.eval_every or bool(d.eval_seeds),
         "data.eval_seeds must not be empty while logging.eval_every > 0 (they are the grid's columns)"),
        (all(isinstance(x, str) and x.strip() for x in d.prompt_list),
         "data.prompt_list must be a list of non-empty strings"),
        (all(isinstance(x, str) and x.strip() for x in d.eval_prompts),
         "data.eval_prompts must be a list of non-empty strings"),
        (flow or not d.eval_prompts, "data.eval_prompts is for flow policies; a VLM run evaluates the first "
                                     "data.num_eval_prompts samples of data.dataset"),
        (a.advantage_clamp is None or a.advantage_clamp > 0, "algorithm.advantage_clamp must be > 0 (or null)"),
        (a.beta >= 0, "algorithm.beta must be >= 0"),
        (not a.kl_bias_correction or a.beta > 0, "algorithm.kl_bias_correction weights the KL term: it needs "
                                                 "algorithm.beta > 0 (with beta 0 there is no KL term to weight)"),
        (not (a.kl_bias_correction and a.ratio_level == "sequence" and t.timestep_chunk > 0),
         "algorithm.kl_bias_correction with ratio_level=sequence needs train.timestep_chunk: 0 (a chunked sequence "
         "ratio would weight each chunk's KL by the whole trajectory's ratio with only the chunk's gradient)"),
        (s.num_steps >= 2, "sampling.num_steps must be >= 2"),
        (0.0 < s.timestep_fraction <= 1.0, "sampling.timestep_fraction must be in (0, 1]"),
        (s.noise_level is None or s.noise_level >= 0.0, "sampling.noise_level must be >= 0"),
        (not flow or s.sde == "cps" or ((s.noise_level is None or s.noise_level > 0.0)
                                        and all(not _is_number(x) or x > 0 for x in s.noise_schedule)),
         f"sampling.noise_level (and every sampling.noise_schedule entry) must be > 0 for sde={s.sde}: its step "
         f"log-probability divides by the noise (0 is allowed with sde: cps only)"),
        (s.guidance_scale >= 0.0, "sampling.guidance_scale must be >= 0 (SD3: 1 or less disables classifier-free "
                                  "guidance; FLUX: the distilled guidance input)"),
        (s.window_size >= 1, "sampling.window_size must be >= 1"),
        (s.window_shift_every >= 1, "sampling.window_shift_every must be >= 1"),
        (d.group_size >= 2, "data.group_size must be >= 2 (group-relative advantages need a group)"),
        (d.prompts_per_step >= 1, "data.prompts_per_step must be >= 1"),
        (t.steps >= 1 and t.inner_epochs >= 1, "train.steps and train.inner_epochs must be >= 1"),
        (t.batch_size >= 1 and t.gradient_accumulation_steps >= 1, "train.batch_size and "
                                                                     "train.gradient_accumulation_steps must be >= 1"),
        (t.timestep_chunk >= 0, "train.timestep_chunk must be >= 0"),
        (a.clip_low > 0 and (a.clip_high is None or a.clip_high > 0), "algorithm.clip_low/clip_high must be > 0"),
        (a.clip_low < 1, "algorithm.clip_low must be < 1: the ratio's lower bound is 1 - clip_low, and a ratio is "
                         "never below 0 (TRL's epsilon, 0.2 by default)"),
        (a.delta is None or a.delta > 1.0 + (a.clip_low if a.clip_high is None else a.clip_high),
         "algorithm.delta (two-sided clipping) must be > 1 + clip_high (the clip range's upper end); INTELLECT-2 "
         "uses 4 with 0.2"),
        (a.eps >= 0, "algorithm.eps must be >= 0"),
        (a.sampler_correction_max is None or a.sampler_correction_max > 0,
         "algorithm.sampler_correction_max must be > 0 (or null)"),
        (a.sampler_correction_min is None or (a.sampler_correction_min >= 0 and (
            a.sampler_correction_max is None or a.sampler_correction_min < a.sampler_correction_max)),
         "algorithm.sampler_correction_min must be in [0, sampler_correction_max) (TRL: min < max; equal bounds "
         "truncate every weight to one value, or mask all but the ratios exactly at it)"),
        (a.sampler_correction not in ("token_truncate", "sequence_truncate") or a.sampler_correction_max is not None
         or a.sampler_correction_min is not None,
         f"algorithm.sampler_correction: {a.sampler_correction} clamps the weights: it needs sampler_correction_max "
         f"or sampler_correction_min (both null failed in torch.clamp at the first update; TRL refuses it too)"),
        ((config.model.family == "qwen_vl" and config.generation.engine == "vllm")
         or (a.sampler_correction is None and a.sampler_correction_max == SAMPLER_CORRECTION_MAX
             and a.sampler_correction_min is None),
         "algorithm.sampler_correction / sampler_correction_max / sampler_correction_min correct the gap between "
         "vLLM's log-probs and the trained model's: they need model.family: qwen_vl with generation.engine: vllm (HF "
         "generate samples from the trained model itself)"),
        (0.0 <= a.top_entropy_quantile <= 1.0, "algorithm.top_entropy_quantile must be in [0, 1] (1 keeps every "
                                                "token; the paper uses 0.2)"),
        (config.model.family == "qwen_vl" or a.top_entropy_quantile == 1.0,
         "algorithm.top_entropy_quantile selects high-entropy tokens of VLM completions (model.family: qwen_vl); a "
         "flow's SDE step has no token distribution"),
        (config.model.family == "qwen_vl" or a.entropy_coef == 0.0,
         "algorithm.entropy_coef is a bonus on the entropy of VLM token distributions (model.family: qwen_vl); a "
         "flow's SDE step has a fixed Gaussian entropy"),
        (config.model.family == "qwen_vl" or not a.mask_truncated_completions,
         "algorithm.mask_truncated_completions applies to VLM completions (model.family: qwen_vl); a flow "
         "trajectory always has its sampling.num_steps steps"),
        (config.optim.ema or not config.optim.ema_every_minibatch,
         "optim.ema_every_minibatch is how the EMA is updated: set optim.ema: true (or, without an EMA, "
         "optim.ema_every_minibatch: false)"),
        (config.logging.keep_last >= 1, "logging.keep_last must be >= 1"),
        (config.optim.ema_update_interval >= 1 and 0.0 <= config.optim.ema_decay < 1.0,
         "optim.ema_update_interval must be >= 1 and optim.ema_decay in [0, 1) (at 1 the EMA never moves from "
         "the initial weights, and evaluations and exports read it)"),
        (config.model.family != "flux" or not s.negative_prompt,
         "sampling.negative_prompt must be empty for model.family=flux: FLUX.1 is guidance-distilled "
         "(sampling.guidance_scale is its distilled-guidance input); there is no classifier-free guidance for a "
         "negative prompt to steer"),
        (config.model.family != "sd3" or not s.negative_prompt or s.guidance_scale > 1.0,
         "sampling.negative_prompt is used by classifier-free guidance only: set sampling.guidance_scale > 1 or "
         "leave the negative prompt empty"),
        (s.cfg_detach_uncond or (config.model.family == "sd3" and s.guidance_scale > 1.0),
         "sampling.cfg_detach_uncond: false changes the gradient of classifier-free guidance's unconditional half, "
         "which only SD3 with sampling.guidance_scale > 1 has; leave it at true"),
        (bool(config.rewards), "rewards: at least one reward is needed"),
        (config.model.family == "qwen_vl" or config.model.resolution % 16 == 0,
         "model.resolution must be a multiple of 16"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if s.train_steps in ("random_window", "sliding_window"):
        trainable = s.num_steps - 1
        if s.window_size > trainable:
            raise ConfigError(f"sampling.window_size={s.window_size} is longer than the {trainable} trainable steps "
                              f"of a {s.num_steps}-step schedule (the last step is never trained)")
    if s.window_range is not None:
        from mmrl.pipelines.flow.schedule import check_window_range

        if s.train_steps != "random_window":
            raise ConfigError(f"sampling.window_range is where train_steps=random_window draws its window; with "
                              f"train_steps={s.train_steps} leave it null")
        try:
            check_window_range(s.window_range, s.window_size, s.num_steps)
        except ValueError as exc:
            raise ConfigError(f"sampling.window_range: {exc}") from None
    if s.train_steps in ("fraction", "random_fraction") and config.model.family != "qwen_vl":
        base = s.num_steps if s.train_steps == "fraction" else s.num_steps - 1
        if int(base * s.timestep_fraction) < 1:
            raise ConfigError(f"sampling.timestep_fraction={s.timestep_fraction} trains int({base} x "
                              f"{s.timestep_fraction}) = 0 of the {s.num_steps} steps (train_steps={s.train_steps}): "
                              f"raise it to at least {1 / base:.4g}")
    if s.train_steps == "entropy_merge":
        if (s.merge_threshold is None) == (s.merge_groups is None):
            raise ConfigError("sampling.train_steps=entropy_merge needs exactly one of sampling.merge_threshold "
                              "(nats) or sampling.merge_groups")
        if s.merge_groups is not None and not 1 <= s.merge_groups <= s.num_steps - 1:
            raise ConfigError(f"sampling.merge_groups={s.merge_groups} must be in 1..{s.num_steps - 1} (the "
                              f"trainable steps of a {s.num_steps}-step schedule)")
    if s.noise_schedule and len(s.noise_schedule) != s.num_steps:
        raise ConfigError(f"sampling.noise_schedule has {len(s.noise_schedule)} levels for {s.num_steps} steps")
    if a.clamp_summed_advantage and a.reward_combination != "normalize_then_sum":
        raise ConfigError("algorithm.clamp_summed_advantage clamps the sum of normalize_then_sum: set "
                          "algorithm.reward_combination=normalize_then_sum")
    if a.batch_normalize_sum and a.reward_combination != "normalize_then_sum":
        raise ConfigError("algorithm.batch_normalize_sum is GDPO's step after normalize_then_sum: set "
                          "algorithm.reward_combination=normalize_then_sum")
    other = "generation" if flow else "sampling"  # the section the other kind of policy reads
    changed = _changed_fields(getattr(config, other))
    if changed:  # a warning, not an error: a config turned into the other family by model.family keeps its section
        logger.warning(
            "%s ignored: %s applies to %s; a %s policy %s", ", ".join(f"{other}.{k}" for k in changed),
            f"{other}.*", "VLM policies (model.family: qwen_vl)" if flow else "flow policies (sd3, flux)", m.family,
            "samples with sampling.*" if flow else "generates with generation.*")
    foreign = [f"{section}.{key}" for section, keys in (VLM_ONLY_FIELDS if flow else FLOW_ONLY_FIELDS).items()
               for key in keys if key in _changed_fields(getattr(config, section))]
    if foreign:  # the same for the fields of the shared sections that only the other family reads
        logger.warning("%s ignored: %s read by %s only; this is a %s run", ", ".join(foreign),
                       "it is" if len(foreign) == 1 else "they are",
                       "VLM policies (model.family: qwen_vl)" if flow else "flow policies (sd3, flux)", m.family)
    if config.model.family == "qwen_vl":
        if d.dataset is None:
            raise ConfigError("data.dataset: a VLM run needs a JSONL dataset (see mmrl.data.vlm)")
        if d.dataset.startswith("shapeworld:"):
            from mmrl.data.shapeworld import check_vlm_spec

            problem = check_vlm_spec(d.dataset)
            if problem:
                raise ConfigError(f"data.dataset: {problem}")
        elif check_files and not d.dataset.startswith("tiny:") and not Path(d.dataset).is_file():
            raise ConfigError(f"data.dataset: file not found: {d.dataset}{_path_hint(d.dataset)}")
        if not (g.temperature > 0 and 0 < g.top_p <= 1 and g.max_new_tokens >= 1 and g.max_prompt_length >= 1):
            raise ConfigError("generation: temperature > 0, 0 < top_p <= 1, max_new_tokens >= 1 and "
                              "max_prompt_length >= 1 are required")
        generation_checks = [
            (g.top_k >= 0, "generation.top_k must be >= 0 (0 disables top-k)"),
            (0.0 <= g.min_p <= 1.0, "generation.min_p must be in [0, 1] (0 disables min-p)"),
            (g.repetition_penalty > 0, "generation.repetition_penalty must be > 0 (1 disables it)"),
            (g.vllm_server_timeout > 0, "generation.vllm_server_timeout must be > 0 (seconds)"),
            (g.min_pixels is None or g.min_pixels >= 1, "generation.min_pixels must be >= 1 (or null)"),
            (g.max_pixels is None or g.max_pixels >= 1, "generation.max_pixels must be >= 1 (or null)"),
            (g.min_pixels is None or g.max_pixels is None or g.min_pixels <= g.max_pixels,
             "generation.min_pixels must be <= generation.max_pixels"),
            (g.video_fps is None or g.video_fps > 0, "generation.video_fps must be > 0 (or null)"),
            (g.video_nframes is None or g.video_nframes >= 2, "generation.video_nframes must be >= 2 (or null)"),
            (g.video_max_frames >= 2, "generation.video_max_frames must be >= 2"),
            (g.video_max_pixels is None or g.video_max_pixels >= 1,
             "generation.video_max_pixels must be >= 1 (or null)"),
            (g.video_min_pixels is None or g.video_min_pixels >= 1,
             "generation.video_min_pixels must be >= 1 (or null)"),
            (g.video_total_pixels is None or g.video_total_pixels >= 1,
             "generation.video_total_pixels must be >= 1 (or null)"),
            (g.video_min_pixels is None or g.video_max_pixels is None or g.video_min_pixels <= g.video_max_pixels,
             "generation.video_min_pixels must be <= generation.video_max_pixels"),
        ]
        for ok, message in generation_checks:
            if not ok:
                raise ConfigError(message)
        # a pixel floor that alone needs more vision tokens than a prompt may hold (counted at Qwen3-VL's 32 x 32
        # pixels a token, the most of any family): refused before an image or video is decoded at that size
        for key, floor, what in (("min_pixels", g.min_pixels, "every image"),
                                 ("video_min_pixels", g.video_min_pixels, "every pair of video frames")):
            if floor is not None and floor // (32 * 32) > g.max_prompt_length:
                raise ConfigError(f"generation.{key}={floor}: {what} would take at least {floor // (32 * 32)} vision "
                                  f"tokens, more than generation.max_prompt_length={g.max_prompt_length}")
        try:
            g.question_template.format(question="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"generation.question_template: only {{question}} may be in braces (write {{{{ and "
                              f"}}}} for literal braces); got {g.question_template!r} ({type(exc).__name__}: "
                              f"{exc})") from None
        if "{question}" not in g.question_template:
            raise ConfigError("generation.question_template must contain {question}")
        _check_engine(g, check_files=check_files)
        if g.tools:
            from mmrl.pipelines.vlm.tools import resolve_tools

            try:
                resolve_tools(g.tools)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            if g.max_tool_calls < 1:
                raise ConfigError("generation.max_tool_calls must be >= 1 when generation.tools is set")
            try:
                g.tool_response_template.format(image="")
            except (KeyError, IndexError, ValueError) as exc:
                raise ConfigError(f"generation.tool_response_template: only {{image}} may be in braces "
                                  f"({exc})") from None
            if "{image}" not in g.tool_response_template:
                raise ConfigError("generation.tool_response_template must contain {image}")
    else:
        if d.prompts is None and not d.prompt_list:
            raise ConfigError("data: set data.prompts (a .txt or .jsonl file) or data.prompt_list")
        if d.prompts is not None and d.prompts.startswith("shapeworld:"):
            from mmrl.data.shapeworld import check_prompts_spec

            problem = check_prompts_spec(d.prompts)
            if problem:
                raise ConfigError(f"data.prompts: {problem}")
        elif check_files and d.prompts is not None and Path(d.prompts).expanduser().is_dir():
            raise ConfigError(f"data.prompts: {d.prompts} is a folder; name a prompt file (.txt, one prompt per "
                              f"line, or .jsonl)")
        elif check_files and d.prompts is not None and not Path(d.prompts).is_file():
            raise ConfigError(f"data.prompts: prompt file not found: {d.prompts}{_path_hint(d.prompts)}")
    if check_files:
        _check_environment(config)
    samples = d.prompts_per_step * d.group_size
    if samples % t.batch_size:
        raise ConfigError(f"train.batch_size={t.batch_size} must divide the {samples} samples of an update "
                          f"(data.prompts_per_step x data.group_size)")
    from mmrl.algorithms import VariantError, build_variants
    from mmrl.rewards import check_reward_arguments, reward_inputs  # composition root: knows the reward registry

    weights = []
    for key, spec in config.rewards.items():
        if isinstance(spec, dict):
            extra = set(spec) - {"weight", "kwargs", "reward"}
            if extra:
                raise ConfigError(f"rewards.{key}: unknown keys {sorted(extra)}; expected weight, kwargs, reward")
            name, kwargs = spec.get("reward", key), spec.get("kwargs") or {}
            weight = spec.get("weight", 1.0)
        elif isinstance(spec, (int, float)) and not isinstance(spec, bool):
            name, kwargs, weight = key, {}, spec
        else:
            hint = ""
            if spec is None and ":" in key:
                name, weight = key.split(":", 1)
                hint = f" (YAML needs a space after the colon: {{{name}: {weight}}})"
            raise ConfigError(f"rewards.{key}: expected a weight or {{weight, kwargs}}, got {spec!r}{hint}")
        if not _is_number(weight) or not math.isfinite(weight):
            raise ConfigError(f"rewards.{key}: the weight must be a finite number, got {weight!r}")
        weights.append(weight)
        try:
            check_reward_arguments(name, kwargs)
            inputs = reward_inputs(name)
        except ValueError as exc:
            raise ConfigError(f"rewards.{key}: {exc}") from None
        if inputs is not None and not inputs[0 if flow else 1]:
            judged, given = ("completions (text)", "images") if flow else ("images", "completions (text)")
            raise ConfigError(f"rewards.{key}: reward {name!r} judges {judged}, but a model.family "
                              f"{m.family} policy's rewards get its {given}; choose a reward for them "
                              f"(`mmrl rewards` lists them)")
    if weights and not any(weights):
        raise ConfigError("rewards: every weight is 0, so no reward enters the advantages (a weight-0 reward is only "
                          "logged); give at least one a non-zero weight")
    try:  # names, options and combinations of the algorithm variants, before anything is built
        variants = build_variants(config)
    except VariantError as exc:
        raise ConfigError(str(exc)) from None
    _check_dependent_fields(config, flow, variants)


#: The header of ``mmrl config show --help-fields`` (YAML comments, so the whole listing parses as YAML).
FIELDS_HEADER = (
    "# Every config field with its default and what it does. Keys a config file leaves out take these defaults,\n"
    "# which are the SD3.5-Medium / Flow-GRPO GPU settings, NOT the CPU run: `mmrl train` without a CONFIG uses\n"
    "# the embedded mmrl/default.yaml (a copy: configs/shapes/flow_grpo_faded.yaml), which sets its own values.\n"
    "# Values are YAML literals (null, true, false, [lists]): the listing parses as YAML to exactly these values.\n"
    "# Relative paths in a config are resolved from the working directory."
)


def yaml_literal(value: Any) -> str:
    """``value`` as one line of YAML that reads back as the same value (``null``, ``true``, ``[0.9, 0.999]``)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), allow_unicode=True).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    elif text.endswith("..."):
        text = text[: -len("...")].strip()
    return text


def describe(cls: type = Config, prefix: str = "", values: Any = None) -> list[str]:
    """Lines ``key: default  # help`` for every field (``mmrl config show --help-fields``), nested sections
    indented, defaults as YAML literals: the lines (with :data:`FIELDS_HEADER`) parse as YAML to the defaults.
    ``values``: a config instance whose values are shown instead of the defaults."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            lines.append(f"{prefix}{f.name}:  # {f.metadata.get('help', '')}")
            lines.extend(describe(hints[f.name], prefix + "  ", None if values is None else getattr(values, f.name)))
            continue
        if values is not None:
            default = getattr(values, f.name)
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        choices = f.metadata.get("choices")
        suffix = f" [{' | '.join(yaml_literal(c) for c in choices)}]" if choices else ""
        lines.append(f"{prefix}{f.name}: {yaml_literal(default)}  # {f.metadata.get('help', '')}{suffix}")
    return lines
