"""Qwen-VL policies (Qwen2-VL, Qwen2.5-VL and newer Qwen-VL generations that transformers supports).

The generated tokens are the action sequence: ``rollout`` samples ``G`` completions per prompt with the
prompt's images or video frames, and ``logprobs`` recomputes the per-token log-probabilities ``[n, T]``
of the stored completions under the current parameters, in one forward with the vision inputs of just
those samples, logits divided by the sampling temperature (TRL's convention).

Train and eval mode: the gradient-carrying forward of ``logprobs`` (``torch.is_grad_enabled()``) runs with the
model in train mode, so gradient checkpointing (transformers checkpoints only in train mode) and PEFT's LoRA
dropout apply there, as in TRL / PEFT training; every no-grad forward (generation, old and reference
log-probs, evaluation) runs in eval mode. With no dropout the two modes give bit-identical log-probs, so the
first ratio of an update is exactly 1.

Sampling uses exactly the policy's settings (temperature, top-p, top-k, the end-of-turn and pad ids, the
suppressed vision placeholders): the ``generation_config`` a checkpoint ships (Qwen-VL checkpoints set
``repetition_penalty``, ``top_k``, ``top_p``, ``temperature``) is not merged in, since the training
log-probs could not replay those processors.

Vision features: with the vision tower frozen (the default, as VLM-R1 / Video-R1 train), each prompt's
images or frames are encoded ONCE per update and the features are reused by generation (all ``G``
completions) and by every log-prob forward of every inner epoch, through transformers'
``mm_encoder_outputs``. TRL's ``GRPOTrainer`` instead re-encodes each image once per completion in each
forward. With ``freeze_vision=False`` the rollout still encodes each prompt once (sampling has no gradient),
and every gradient forward encodes each distinct prompt's pixels once, with gradients, however many of its
completions the batch holds (under FSDP2 the pixels go through the model's own forward, one copy per row).

Layout of a rollout: prompts are left-padded (``prompt_ids [P, Lp]``), completions right-padded
(``completion_ids [N, T]``, ``mask`` 1 up to and including the end-of-turn token). A training forward
concatenates the two, so left and right padding and mixed image / video / text-only batches all go
through the same code; 3-D rope positions come from the model's ``get_rope_index`` with the
attention mask and ``mm_token_type_ids`` (on Qwen2-VL / Qwen2.5-VL in Qwen's reference layout,
:func:`use_reference_rope_layout`), computed once per rollout for all its samples and sliced for each
forward (a row's positions depend only on its own tokens and grids).

References: TRL ``GRPOTrainer`` (log-prob conventions), VLM-R1 (Shen et al. 2025, arXiv 2504.07615),
Video-R1 (Feng et al. 2025, arXiv 2503.21776), Time-R1 (Wang et al. 2025, arXiv 2503.13377).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import itertools
import json
import logging
import os
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmrl.core.losses import kl_estimate
from mmrl.data.prompts import DataError
from mmrl.distributed import full_weights, weights_partitioned
from mmrl.data.prompts import EmptyBatchError

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LANGUAGE_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class PromptTooLongError(DataError):
    """A prompt (vision tokens included) longer than generation.max_prompt_length (a data error: printed as one line,
    and a run stopped by it keeps its completed updates)."""


@dataclass
class Vision:
    """The vision inputs of one prompt: processor outputs and (frozen tower) their encoded features."""

    image_grid_thw: Tensor | None = None  # [k, 3]
    video_grid_thw: Tensor | None = None  # [v, 3]
    second_per_grid_ts: Tensor | None = None  # [v]
    pixel_values: Tensor | None = None  # [patches, dim]
    pixel_values_videos: Tensor | None = None
    image_features: list[Tensor] = field(default_factory=list)  # one [tokens, hidden] per image
    video_features: list[Tensor] = field(default_factory=list)
    # Qwen3-VL DeepStack: per image / video, one [tokens, hidden] per deepstack layer (empty for Qwen2/2.5-VL)
    image_deepstack: list[list[Tensor]] = field(default_factory=list)
    video_deepstack: list[list[Tensor]] = field(default_factory=list)
    #: the PIL images as the processor received them (what tool calls operate on; kept only with generation.tools)
    images: list = field(default_factory=list)
    #: the prompt as a vLLM request (generation.engine: vllm): the chat template's token ids before the processor
    #: expands the vision placeholders, and the images / video (see :mod:`mmrl.pipelines.vlm.vllm_engine`)
    engine_prompt: dict | None = None

    @staticmethod
    def join(parts: list["Vision"]) -> "Vision":
        """One prompt's vision inputs followed by more images (a tool rollout's returned views, in sequence order)."""
        def cat(name):
            found = [getattr(p, name) for p in parts if getattr(p, name) is not None]
            return torch.cat(found) if found else None

        first = parts[0]
        return Vision(image_grid_thw=cat("image_grid_thw"), video_grid_thw=first.video_grid_thw,
                      second_per_grid_ts=first.second_per_grid_ts, pixel_values=cat("pixel_values"),
                      pixel_values_videos=first.pixel_values_videos,
                      image_features=[f for p in parts for f in p.image_features], video_features=first.video_features,
                      image_deepstack=[d for p in parts for d in p.image_deepstack],
                      video_deepstack=first.video_deepstack, images=first.images)


@dataclass
class VLMRollout:
    prompts: list[str]  # [N] the question of each sample
    metadata: list[dict]  # [N]
    group_ids: Tensor  # [N]
    completions: list[str]  # [N] decoded completions (what the rewards judge)
    prompt_ids: Tensor  # [P, Lp] left-padded
    prompt_mask: Tensor  # [P, Lp]
    mm_token_type_ids: Tensor | None  # [P, Lp]
    completion_ids: Tensor  # [N, T] right-padded
    mask: Tensor  # [N, T] float: real completion tokens (through the end-of-turn token)
    prompt_index: Tensor  # [N] row of the prompt tensors for each sample
    vision: list[Vision]  # [P]
    old_logps: Tensor | None = None  # computed by the trainer in its first-epoch layout
    masked_logps: Tensor | None = None  # the same, images replaced by grey canvases (visual-dependence variants)
    perturbed_logps: Tensor | None = None  # the same, images with Gaussian noise (consistency variants)
    extras: dict[str, Any] = field(default_factory=dict)
    #: reward component -> per sample, the character spans of the completion the component's reward is about
    #: (``None``: the reward reported none for that sample); see :mod:`mmrl.pipelines.vlm.spans`
    spans: dict[str, list] = field(default_factory=dict)
    #: tool rollouts (generation.tools): [N, T] 1 on every completion token the model reads (its own and the tools'
    #: responses; ``mask`` is 1 on its own only), the responses' token types, and per sample its calls
    #: (:class:`mmrl.pipelines.vlm.tools.ToolCall`); ``None`` for plain rollouts
    completion_attention: Tensor | None = None
    completion_mm_types: Tensor | None = None
    tool_calls: list | None = None
    #: [N] the sampled item of each sample where it is not ``prompt_index`` (a tool rollout: a prompt row per sample)
    item_index: Tensor | None = None
    #: [N, T] the rollout engine's own log-prob of each sampled token (generation.engine: vllm; 0 on padding), for
    #: the sampler / trainer gap the trainer logs; ``None`` with HF ``generate`` (the sampler is the trained model)
    sampler_logps: Tensor | None = None

    def __len__(self) -> int:
        return len(self.completions)

    @property
    def outputs(self) -> list[str]:
        return self.completions

    @property
    def condition_keys(self) -> list[str]:
        """What identifies each sample's condition across updates, for per-prompt statistics and value anchors:
        the data sample (its ``id``: question AND media), never the question text, which many images share."""
        return [f"sample:{m['id']}" if m.get("id") is not None else f"group:{int(g)}"
                for m, g in zip(self.metadata, self.group_ids)]

    def select(self, index: Tensor) -> "VLMRollout":
        """The samples ``index`` (whole groups, in order), with the prompts they use."""
        index = torch.as_tensor(index, dtype=torch.long)
        used = torch.unique(self.prompt_index[index])  # sorted
        remap = torch.full((len(self.vision),), -1, dtype=torch.long)
        remap[used] = torch.arange(len(used))
        return VLMRollout(
            prompts=[self.prompts[i] for i in index.tolist()], metadata=[self.metadata[i] for i in index.tolist()],
            group_ids=self.group_ids[index], completions=[self.completions[i] for i in index.tolist()],
            prompt_ids=self.prompt_ids[used], prompt_mask=self.prompt_mask[used],
            mm_token_type_ids=None if self.mm_token_type_ids is None else self.mm_token_type_ids[used],
            completion_ids=self.completion_ids[index], mask=self.mask[index], prompt_index=remap[self.prompt_index[index]],
            vision=[self.vision[i] for i in used.tolist()],
            extras={"completion_length": self.mask[index].sum(-1),
                    **tool_extras(None if self.tool_calls is None else [self.tool_calls[i] for i in index.tolist()])},
            spans={k: [v[i] for i in index.tolist()] for k, v in self.spans.items()},
            completion_attention=None if self.completion_attention is None else self.completion_attention[index],
            completion_mm_types=None if self.completion_mm_types is None else self.completion_mm_types[index],
            tool_calls=None if self.tool_calls is None else [self.tool_calls[i] for i in index.tolist()],
            item_index=None if self.item_index is None else self.item_index[index],
            sampler_logps=None if self.sampler_logps is None else self.sampler_logps[index],
        )

    @staticmethod
    def concat(parts: list["VLMRollout"], pad_id: int) -> "VLMRollout":
        """One rollout from several (prompts re-padded on the left, completions on the right); group ids renumbered."""
        width_p = max(p.prompt_ids.shape[1] for p in parts)
        width_c = max(p.completion_ids.shape[1] for p in parts)

        def left(x: Tensor, value) -> Tensor:
            return torch.nn.functional.pad(x, (width_p - x.shape[1], 0), value=value)

        def right(x: Tensor, value) -> Tensor:
            return torch.nn.functional.pad(x, (0, width_c - x.shape[1]), value=value)

        offsets, groups, total = [], [], 0
        for p in parts:
            offsets.append(sum(len(q.vision) for q in parts[:len(offsets)]))
            _, g = torch.unique(p.group_ids, return_inverse=True)
            groups.append(g + total)
            total += int(g.max()) + 1 if len(g) else 0
        token_types = [p.mm_token_type_ids for p in parts]
        tools = any(p.tool_calls is not None for p in parts)
        return VLMRollout(
            prompts=[x for p in parts for x in p.prompts], metadata=[x for p in parts for x in p.metadata],
            group_ids=torch.cat(groups), completions=[x for p in parts for x in p.completions],
            prompt_ids=torch.cat([left(p.prompt_ids, pad_id) for p in parts]),
            prompt_mask=torch.cat([left(p.prompt_mask, 0) for p in parts]),
            mm_token_type_ids=(None if any(t is None for t in token_types)
                               else torch.cat([left(t, 0) for t in token_types])),
            completion_ids=torch.cat([right(p.completion_ids, pad_id) for p in parts]),
            mask=torch.cat([right(p.mask, 0) for p in parts]),
            prompt_index=torch.cat([p.prompt_index + o for p, o in zip(parts, offsets)]),
            vision=[v for p in parts for v in p.vision],
            extras={"completion_length": torch.cat([p.mask.sum(-1) for p in parts]),
                    **tool_extras([x for p in parts for x in (p.tool_calls or [[] for _ in range(len(p))])]
                                  if tools else None)},
            spans={k: [x for p in parts for x in p.spans.get(k, [None] * len(p))]
                   for k in sorted({k for p in parts for k in p.spans})},
            completion_attention=torch.cat([right(p.attention, 0) for p in parts]) if tools else None,
            completion_mm_types=torch.cat([right(p.completion_types, 0) for p in parts]) if tools else None,
            tool_calls=[x for p in parts for x in (p.tool_calls or [[] for _ in range(len(p))])] if tools else None,
            sampler_logps=None if any(p.sampler_logps is None for p in parts) else
            torch.cat([right(p.sampler_logps, 0.0) for p in parts]),
        )

    @property
    def attention(self) -> Tensor:
        """``[N, T]``: the completion tokens the model reads (``mask`` unless tools answered inside completions)."""
        return self.mask if self.completion_attention is None else self.completion_attention

    @property
    def completion_types(self) -> Tensor:
        """``[N, T]`` token types of the completions (0 text; the tools' images are 1, as the processor marks them)."""
        if self.completion_mm_types is not None:
            return self.completion_mm_types
        dtype = self.mm_token_type_ids.dtype if self.mm_token_type_ids is not None else torch.long
        return torch.zeros(self.completion_ids.shape, dtype=dtype)


def tool_extras(calls: list | None) -> dict[str, Tensor]:
    """A tool rollout's logged counts per sample: ``tool_calls`` and ``tool_errors`` (none for plain rollouts)."""
    if calls is None:
        return {}
    return {"tool_calls": torch.tensor([len(c) for c in calls], dtype=torch.float),
            "tool_errors": torch.tensor([sum(not x.ok for x in c) for c in calls], dtype=torch.float)}


@dataclass
class LogProbOutput:
    logps: Tensor  # [n, t]
    kl: Tensor | None = None
    entropy: Tensor | None = None  # [n, t]: of each position's (tempered) next-token distribution, with_entropy


def resolve_vlm_pretrained(pretrained: str) -> str:
    """``tiny:<model_type>`` -> the cached tiny build; ``shapeworld:qwen_vl`` -> the shipped ShapeWorld base; anything
    else unchanged (:func:`mmrl.pipelines.flow.loading.resolve_pretrained` with the tiny VLM builder)."""
    from mmrl.pipelines.flow.loading import resolve_pretrained
    from mmrl.pipelines.vlm.tiny import ensure_tiny_vlm

    return resolve_pretrained(pretrained, ensure_tiny_vlm)


def load_vlm(pretrained: str, *, dtype: str = "bfloat16", revision: str | None = None,
             attn_implementation: str | None = None, min_pixels: int | None = None,
             max_pixels: int | None = None):
    """``(model, processor)`` from a hub id, a local folder or ``tiny:...``, with one clear error when it fails."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrl.pipelines.flow.loading import ModelLoadError, transformers_load_kwargs

    source = resolve_vlm_pretrained(pretrained)
    if (Path(source).exists() or source.startswith((".", "/", "~"))) and not (Path(source) / "config.json").is_file():
        raise ModelLoadError(f"model.pretrained={pretrained!r}: {source} has no config.json; "
                             f"{not_a_model_folder(Path(source))}")
    kwargs = {"dtype": DTYPES[dtype], "revision": revision, **transformers_load_kwargs()}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForImageTextToText.from_pretrained(source, **kwargs)
        processor = AutoProcessor.from_pretrained(source, revision=revision)
        _set_image_budget(processor, min_pixels, max_pixels)
    except Exception as exc:  # transformers / hub raise many types; one message naming the source
        hint = (" HF_HUB_OFFLINE=1 is set: download the weights first or point model.pretrained at a local folder."
                if os.environ.get("HF_HUB_OFFLINE") == "1" else "")
        raise ModelLoadError(f"could not load a Qwen-VL model and processor from {pretrained!r}: {exc}.{hint}") from exc
    problem = _processor_problem(processor, model.config)
    if problem:
        raise ModelLoadError(f"model.pretrained={pretrained!r}: {problem} (a partly copied model folder? it needs "
                             f"the files processor.save_pretrained writes)")
    return model, processor


def not_a_model_folder(folder: Path) -> str:
    """What a folder without ``config.json`` given as a VLM's model is, and what to give instead: an mmrl run or
    checkpoint (its model folder or export), a PEFT adapter (merge it first), else the general rule."""
    from mmrl.checkpoint import other_command_run

    other = other_command_run(folder)
    if other:
        return other
    if (folder / "adapter_config.json").is_file():
        base = ""
        try:
            base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
        except (OSError, ValueError):
            pass
        return (f"it is a PEFT LoRA adapter{f' on {base}' if base else ''}: merge it into its base first "
                f"(PeftModel.from_pretrained(base, folder).merge_and_unload(), then save_pretrained with the "
                f"processor) and give that folder")
    if (folder / "checkpoints").is_dir() or (folder / "trainable.safetensors").is_file():
        return ("it is an mmrl train run or checkpoint: give its checkpoints/step_<k>/export folder (a full "
                "fine-tune's is a model folder; a LoRA run's is an adapter, to merge into its base first), or "
                "evaluate the run itself with mmrl eval RUN")
    return "use a folder written by save_pretrained (model and processor) or a hub id"


def _set_image_budget(processor, min_pixels: int | None, max_pixels: int | None) -> None:
    """``generation.min_pixels`` / ``max_pixels`` as the image processor's budget only. Passed to
    ``AutoProcessor.from_pretrained`` they set the video processor's ``size`` too, which bounds each frame of a
    Qwen2/2.5-VL video (qwen-vl-utils keeps 128..768 x 28 x 28 per frame whatever the image budget): an image budget
    of 3136..12845056 took a 1080p clip from 2,880 video tokens to 10,764."""
    if min_pixels is None and max_pixels is None:
        return
    image_processor = processor.image_processor
    size = image_processor.size
    changes = {k: v for k, v in (("shortest_edge", min_pixels), ("longest_edge", max_pixels)) if v is not None}
    image_processor.size = dataclasses.replace(size, **changes) if dataclasses.is_dataclass(size) \
        else {**dict(size), **changes}
    for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if value is not None and getattr(image_processor, name, None) is not None:
            setattr(image_processor, name, value)


def _processor_problem(processor, config) -> str | None:
    """What a loaded processor lacks that a rollout needs, found before the first prompt: a chat template, and a
    tokenizer that reads the vision placeholders as the model's own token ids (a missing tokenizer file makes
    transformers fall back to one that splits them, and the first image fails deep in the processor)."""
    if not (getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None)):
        return "the processor has no chat template (chat_template.jinja / chat_template.json missing)"
    tokenizer = processor.tokenizer
    for name in ("image_token_id", "video_token_id", "vision_start_token_id"):
        want = getattr(config, name, None)
        if want is None:
            continue
        token = tokenizer.convert_ids_to_tokens(want)
        if token is None or tokenizer.convert_tokens_to_ids(token) != want or \
                tokenizer(token, add_special_tokens=False)["input_ids"] != [want]:
            return (f"its tokenizer does not read the model's {name.removesuffix('_id')} (id {want}) as one token "
                    f"(tokenizer.json / tokenizer_config.json missing or from another model)")
    return None


#: the families whose reference rope layout puts the text after a vision block at the block's largest position + 1
QWEN_ROPE_LAYOUT_FAMILIES = ("qwen2_vl", "qwen2_5_vl")


def text_after_vision_positions(position_ids: Tensor, mm_token_type_ids: Tensor,
                                attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Qwen's reference M-RoPE layout from transformers 5.x's: ``(position_ids [3, B, L], rope_deltas [B, 1])``.

    Qwen2-VL / Qwen2.5-VL lay each vision block out on a (temporal, height, width) grid starting at the running
    position, and the text (or next block) after it starts at the block's largest position on any axis + 1. That is
    the rule of Qwen's own implementation (transformers 4.x ``Qwen2_5_VLModel.get_rope_index``, written by
    the Qwen team: "we calculate the text start position_ids as the max vision position_ids plus 1"), of vLLM's
    ``get_mrope_input_positions`` (the positions a vLLM rollout samples with) and of verl / EasyR1's own
    ``get_rope_index``. transformers 5.x instead advances by the block's largest *spatial* extent, which is the same
    for an image (one temporal row) but not for a video whose temporal positions (``tokens_per_second`` x seconds per
    grid on Qwen2.5-VL, the frame-pair index on Qwen2-VL) run past its height and width: the text after the clip
    then starts inside the clip's temporal range, off the positions the model was trained with.

    Takes transformers' positions (its vision grids are the reference's) and shifts every block that follows a
    vision block, and everything after it, so that the block starts at the vision block's maximum + 1; padding
    columns are left as they are. The deltas are the reference's ``max + 1 - tokens`` per row.
    """
    position_ids = position_ids.clone()
    deltas = []
    for row in range(position_ids.shape[1]):
        valid = (attention_mask[row].bool() if attention_mask is not None
                 else torch.ones(position_ids.shape[2], dtype=torch.bool, device=position_ids.device))
        positions = position_ids[:, row, valid]
        kinds = mm_token_type_ids[row, valid.to(mm_token_type_ids.device)].tolist()
        start, shift, after_vision = 0, 0, None
        for kind, run in itertools.groupby(kinds):
            end = start + sum(1 for _ in run)
            block = positions[:, start:end]
            block += shift
            if after_vision is not None:  # the block after a vision block starts at its maximum + 1
                move = after_vision + 1 - int(block.min())
                block += move
                shift += move
            after_vision = int(block.max()) if kind != 0 else None
            start = end
        position_ids[:, row, valid] = positions
        deltas.append(int(positions.max()) + 1 - positions.shape[1] if positions.numel() else 0)
    return position_ids, torch.tensor(deltas, device=position_ids.device).unsqueeze(1)


def use_reference_rope_layout(hf_model) -> bool:
    """Make a Qwen2-VL / Qwen2.5-VL model compute Qwen's reference rope positions (:func:`text_after_vision_positions`)
    wherever transformers computes them: generation's prefill, every forward without explicit positions (SFT,
    evaluation, a plain ``model(...)`` call) and mmrl's cached replay positions. Replaces ``get_rope_index`` on the
    model's instance (transformers' class is untouched); a no-op for other families. Returns whether it applied."""
    core = getattr(hf_model, "model", None)
    if getattr(hf_model.config, "model_type", None) not in QWEN_ROPE_LAYOUT_FAMILIES or core is None:
        return False
    if getattr(core, "_mmrl_reference_rope_layout", False):
        return True
    transformers_index = type(core).get_rope_index
    signature = inspect.signature(transformers_index)

    def get_rope_index(self, *args, **kwargs):
        position_ids, _ = transformers_index(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs).arguments
        return text_after_vision_positions(position_ids, bound["mm_token_type_ids"], bound.get("attention_mask"))

    core.get_rope_index = types.MethodType(get_rope_index, core)
    core._mmrl_reference_rope_layout = True
    return True


def static_cache_length(tokens: int, smallest: int = 256) -> int:
    """The static KV cache's length for ``tokens`` (prompt + new tokens): the next power of two, at least ``smallest``.
    transformers recompiles the decoding forward for each new cache shape and keeps the largest length so far, and
    torch.compile gives up compiling a function after a few shapes (``torch._dynamo.config.recompile_limit``, 8), so
    a data set of varying prompt lengths meets a handful of lengths instead of one per new longest prompt."""
    return max(int(smallest), 1 << max(int(tokens) - 1, 0).bit_length())


class QwenVLPolicy:
    """A Qwen-VL model as a policy over generated tokens.

    Args:
        model, processor: a transformers ``*ForConditionalGeneration`` Qwen-VL model and its processor.
        lora: ``{"rank", "alpha", "dropout", "target_modules"}`` (language-model module names; the vision tower is
            never targeted), or ``None`` for full fine-tuning of the language model (and of the vision tower when
            ``freeze_vision`` is False).
        media: callable ``(item) -> (images, video)`` loading a data item's media (see :mod:`mmrl.data.vlm`).
        temperature, top_p, top_k, min_p, repetition_penalty: the sampling distribution. The replayed log-probs
            are TRL's log-softmax of ``logits / temperature`` with one difference, mmrl's: the vision placeholders
            are masked out of the softmax, as they are suppressed in sampling (TRL scores the full vocabulary). With
            ``top_p < 1``, ``top_k > 0``, ``min_p > 0`` or ``repetition_penalty != 1`` tokens are sampled from the
            modified distribution but scored under the unmodified tempered one, as in TRL's ``GRPOTrainer``;
            without them the scores are exactly those of the sampling distribution.

    LoRA dropout (``lora["dropout"]``) applies in the gradient-carrying forward only (train mode), as in
    TRL / PEFT; the old and reference log-probs are computed in eval mode, so with dropout > 0 the first ratio
    of an update is no longer exactly 1. A full-fine-tune reference (``init_reference``) is a frozen copy in
    the dtype the model was loaded in (trainable parameters are kept in fp32 for the optimizer).
    """

    def __init__(self, model, processor, *, lora: dict | None = None, freeze_vision: bool = True,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                 repetition_penalty: float = 1.0, max_new_tokens: int = 256,
                 max_prompt_length: int = 4096, cache_implementation: str = "dynamic", system_prompt: str | None = None,
                 question_template: str = "{question}", media=None, gradient_checkpointing: bool = False,
                 skip_bad_samples: bool = False, device: torch.device | str = "cpu", tools: dict | None = None,
                 max_tool_calls: int = 2, tool_response_template: str = "\n<observation>{image}</observation>\n",
                 share_prompt_prefix: bool = True, sampler=None, coord_format: str | None = None,
                 kl_estimator: str = "k3"):
        self.processor = processor
        #: the rollout engine when it is not HF ``generate`` (a :class:`~mmrl.pipelines.vlm.vllm_engine.VLLMSampler`)
        self.sampler = sampler
        self._pushed_weights: tuple | None = None  # what the sampler last received (see _sync_sampler)
        self.share_prompt_prefix = share_prompt_prefix
        self.tokenizer = processor.tokenizer
        self.temperature = temperature
        #: the per-token KL estimate of ``logprobs(with_kl=True)`` (:func:`mmrl.core.losses.kl_estimate`)
        self.kl_estimator = kl_estimator
        self.top_p = top_p
        self.top_k = top_k
        self.min_p = min_p
        self.repetition_penalty = repetition_penalty
        self.max_new_tokens = max_new_tokens
        if cache_implementation not in ("dynamic", "static"):
            raise ValueError(f"cache_implementation must be 'dynamic' or 'static', got {cache_implementation!r}")
        self.cache_implementation = cache_implementation
        self.max_prompt_length = max_prompt_length
        self.system_prompt = system_prompt
        self.question_template = question_template
        self.media = media
        self.skip_bad_samples = skip_bad_samples
        self.freeze_vision = freeze_vision
        self.device = torch.device(device)
        self.skipped: dict[str, int] = {}
        self.tools = dict(tools or {})
        self.max_tool_calls = max_tool_calls
        #: the frame of the policy's box answers (:func:`mmrl.build.policy_coord_format`): box tools read their numbers
        #: in it unless a sample's ``coord_format`` says otherwise (:func:`mmrl.pipelines.vlm.tools.answer_frame`)
        self.coord_format = coord_format
        self.tool_response_template = tool_response_template
        self.dtype = model.dtype  # the loaded dtype; trainable parameters are upcast to fp32 below
        use_reference_rope_layout(model)  # Qwen's positions for text after a video, not transformers 5.x's
        model.to(self.device)
        model.eval()  # no-grad forwards run in eval mode; logprobs switches to train mode for its grad forward
        model.requires_grad_(False)
        self.use_lora = lora is not None
        if self.use_lora:
            from peft import LoraConfig, get_peft_model

            targets = self.language_modules(model, lora["target_modules"])
            if not targets:
                from mmrl.config import ConfigError

                raise ConfigError(f"no language-model module matches model.lora_target_modules="
                                  f"{lora['target_modules']}")
            model = get_peft_model(model, LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"],
                                                     lora_dropout=lora.get("dropout", 0.0), target_modules=targets))
        else:
            for name, param in model.named_parameters():
                param.requires_grad_(not (freeze_vision and self._is_vision(name)))
        if not freeze_vision and self.use_lora:
            logger.warning("freeze_vision=False with LoRA: LoRA adapters are on the language model only; the vision "
                           "tower stays frozen (full fine-tuning trains it)")
        self.model = model  # unwrapped; self.train_model is the DDP-wrapped one after prepare()
        self.train_model = model
        for p in self.trainable_parameters():
            p.data = p.data.float()
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()
        self._reference_model = None
        self._per_forward: bool | None = None  # see _encodes_per_forward
        # the chat turn's end and the text's end, plus whatever the checkpoint's generation_config names (Qwen's own
        # generation_config lists both; TRL's HF path passes eos_token_id=tokenizer.eos_token_id and stops there alone)
        named = [self.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        named = [i for i in named if isinstance(i, int) and i >= 0]
        configured = getattr(getattr(self.base_model, "generation_config", None), "eos_token_id", None)
        configured = list(configured) if isinstance(configured, (list, tuple)) else [configured]
        self.eos_ids = list(dict.fromkeys(named + [i for i in configured if isinstance(i, int) and i >= 0]))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else named[-1]
        # vision placeholders are never sampled: a generated <|image_pad|> would be read as an image slot when the
        # completion is replayed. They are suppressed in generation and masked identically in the training softmax,
        # so the sampling and training distributions stay the same.
        config = self.base_model.config
        self.suppressed_ids = sorted({i for i in (getattr(config, k, None) for k in (
            "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")) if i is not None})

    # ----------------------------------------------------------------------------------- parameters

    @staticmethod
    def _is_vision(name: str) -> bool:
        return ".visual." in f".{name}" or name.startswith("visual.")

    @classmethod
    def language_modules(cls, model, suffixes: list[str]) -> list[str]:
        """Full names of the language-model linear layers whose name ends with one of ``suffixes``."""
        names = []
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and not cls._is_vision(name) and "lm_head" not in name:
                if any(name == s or name.endswith("." + s) for s in suffixes):
                    names.append(name)
        return names

    @property
    def base_model(self):
        return self.model.get_base_model() if self.use_lora else self.model

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def named_trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def prepare(self, accelerator, optimizer):
        """Wrap the model and its optimizer with ``accelerator.prepare``, together (FSDP2 swaps the optimizer's
        parameters for their shards): DDP wraps, FSDP2 shards in place. Returns the prepared optimizer."""
        self.train_model, optimizer = accelerator.prepare(self.model, optimizer)
        self._per_forward = None  # FSDP2 may shard now: decided again at the next forward
        return optimizer

    def full_weights(self):
        """Every parameter whole, with no per-forward collective, for the block (:func:`mmrl.distributed.full_weights`;
        a no-op unless the model is FSDP-sharded): ``generate`` may run a different number of forwards on each
        process. Every process enters it."""
        return full_weights(self.train_model)

    def init_reference(self) -> None:
        """Full fine-tuning: freeze a copy of the current model as the reference, with the trainable parameters
        (upcast to fp32 for the optimizer) back in the dtype the model was loaded in."""
        if not self.use_lora and self._reference_model is None:
            trainable = set(self.named_trainable_parameters())
            reference = copy.deepcopy(self.model).requires_grad_(False).eval()
            for name, param in reference.named_parameters():
                if name in trainable:
                    param.data = param.data.to(self.dtype)
            self._reference_model = reference

    @contextlib.contextmanager
    def reference(self):
        """The reference policy: LoRA adapters disabled, or a frozen copy of the initial model."""
        if self.use_lora:
            with self.model.disable_adapter():
                yield self.model
        else:
            self.init_reference()
            yield self._reference_model

    def export(self, directory: str, state_dict: dict[str, Tensor] | None = None) -> None:
        """The trainable part as its ecosystem loads it: a PEFT adapter folder, or the full model, with the processor
        (chat template included) either way, as TRL saves its ``processing_class`` beside the weights (a LoRA export
        had none: ``AutoProcessor.from_pretrained(export)`` failed). ``state_dict``: the model's whole state when FSDP
        shards it (:func:`mmrl.distributed.full_model_state`)."""
        self.model.save_pretrained(directory, **({} if state_dict is None else {"state_dict": state_dict}))
        self.processor.save_pretrained(directory)

    # ------------------------------------------------------------------------------------- prompts

    @contextlib.contextmanager
    def prompting(self, *, system_prompt: str | None, question_template: str):
        """Build prompts inside the block with another ``system_prompt`` / ``question_template`` (a second role of the
        same policy, as PRCO's Solver); the rollout keeps its prompt ids, so training reads what was sampled."""
        saved = self.system_prompt, self.question_template
        self.system_prompt, self.question_template = system_prompt, question_template
        try:
            yield self
        finally:
            self.system_prompt, self.question_template = saved

    def messages(self, item, n_images: int, has_video: bool) -> list[dict]:
        content = [{"type": "image"} for _ in range(n_images)]
        if has_video:
            content.append({"type": "video"})
        content.append({"type": "text", "text": self.question_template.format(question=item.question)})
        messages = [{"role": "user", "content": content}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": [{"type": "text", "text": self.system_prompt}]})
        return messages

    def encode_prompts(self, items: list, *, shuffle_frames: torch.Generator | None = None
                       ) -> tuple[dict[str, Any], list[Vision], list[int]]:
        """Processor inputs for one batch of prompts (left-padded), their per-prompt vision inputs, and the indices
        of the items kept (items with bad media or over-long prompts are skipped when skip_bad_samples)."""
        texts, images, videos, kept = [], [], [], []
        for i, item in enumerate(items):
            try:
                item_images, video = self.media(item) if self.media is not None else ([], None)
                if shuffle_frames is not None and video is not None:  # T-GRPO: the same frames, out of order
                    order = torch.randperm(len(video.frames), generator=shuffle_frames)
                    video = dataclasses.replace(video, frames=video.frames[order],
                                                indices=[video.indices[i] for i in order.tolist()])
            except Exception as exc:
                if not self.skip_bad_samples:
                    raise
                source, text = getattr(item, "source", i), str(exc)  # data errors already name their line
                self._skip("bad_media", text if text.startswith(f"{source}: ") else f"{source}: {text}")
                continue
            texts.append(self.processor.apply_chat_template(self.messages(item, len(item_images), video is not None),
                                                            add_generation_prompt=True, tokenize=False))
            images.append(item_images)
            videos.append(video)
            kept.append(i)
        kwargs: dict[str, Any] = {"text": texts, "padding": True, "padding_side": "left", "return_tensors": "pt"}
        flat_images = [im for ims in images for im in ims]
        if flat_images:
            kwargs["images"] = flat_images
            if self._images_at_final_size:  # resized by qwen-vl-utils' rule already (mmrl.build.vlm_media)
                kwargs["images_kwargs"] = {"do_resize": False}
        clips = [v for v in videos if v is not None]
        if clips:
            kwargs["videos"] = [clip.frames for clip in clips]
            kwargs["video_metadata"] = [clip.metadata() for clip in clips]  # as qwen-vl-utils passes it
            kwargs["do_sample_frames"] = False
            if all(clip.final_size for clip in clips):  # sized by qwen-vl-utils' budget: as Qwen's README passes them
                kwargs["videos_kwargs"] = {"do_resize": False}
        inputs = self.processor(**kwargs) if texts else None
        if inputs is None:
            return {}, [], kept
        too_long = inputs["attention_mask"].sum(-1) > self.max_prompt_length
        if too_long.any():
            bad = [items[kept[j]] for j in too_long.nonzero().flatten().tolist()]
            names = ", ".join(str(getattr(b, "source", "?")) for b in bad)
            message = (f"prompt longer than generation.max_prompt_length={self.max_prompt_length} tokens (vision "
                       f"tokens included) for {names}: lower the pixel budget or raise the limit; prompts are never "
                       f"truncated through their vision tokens")
            if not self.skip_bad_samples:
                raise PromptTooLongError(message)
            self._skip("prompt_too_long", message)
            keep = [kept[j] for j in range(len(kept)) if not too_long[j]]
            if not keep:
                return {}, [], []
            inputs, vision, sub_kept = self.encode_prompts([items[i] for i in keep], shuffle_frames=shuffle_frames)
            return inputs, vision, [keep[j] for j in sub_kept]
        vision = self._split_vision(inputs, [len(ims) for ims in images], [v is not None for v in videos])
        if self.tools:
            for v, item_images in zip(vision, images):
                v.images = item_images
        if self.sampler is not None:
            for v, text, item_images, video in zip(vision, texts, images, videos):
                v.engine_prompt = self._engine_prompt(text, item_images, video)
        return inputs, vision, kept

    @property
    def _images_at_final_size(self) -> bool:
        """Whether ``media`` gives images already at the model's input size (:func:`mmrl.build.vlm_media`), so the
        processor must not resize them again."""
        return bool(getattr(self.media, "images_at_final_size", False))

    def _engine_prompt(self, text: str, images: list, video) -> dict:
        """One prompt as a vLLM request: the chat text's token ids (one placeholder per image / video; vLLM expands
        them with the same processor) and the media as the training processor received them."""
        request: dict = {"prompt_token_ids": self.tokenizer(text, add_special_tokens=False)["input_ids"]}
        media: dict = {}
        if images:
            media["image"] = images if len(images) > 1 else images[0]
        if video is not None:  # the frames mmrl sampled, as the training processor got them (no resampling)
            frames = video.frames.permute(0, 2, 3, 1).contiguous().numpy()  # [T, H, W, 3] uint8
            metadata = video.metadata()  # the training processor's (qwen-vl-utils'), so the same timestamps
            media["video"] = (frames, {**metadata, "duration": metadata["total_num_frames"] / metadata["fps"],
                                       "video_backend": "mmrl", "do_sample_frames": False})
        if media:
            request["multi_modal_data"] = media
        processor_kwargs = {}
        if images and self._images_at_final_size:  # the images are at the model's size, as in training
            processor_kwargs["images_kwargs"] = {"do_resize": False}
        if video is not None and video.final_size:  # the frames are at the model's size, as in training
            processor_kwargs["videos_kwargs"] = {"do_resize": False}
        if processor_kwargs:
            request["mm_processor_kwargs"] = processor_kwargs
        return request

    def _skip(self, reason: str, message: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        logger.warning("skipping sample (%s): %s", reason, message)

    def _split_vision(self, inputs, n_images: list[int], has_video: list[bool]) -> list[Vision]:
        """Slice the processor's flattened vision tensors per prompt."""
        out = []
        img_grid = inputs.get("image_grid_thw")
        vid_grid = inputs.get("video_grid_thw")
        seconds = inputs.get("second_per_grid_ts")
        img_rows = _row_offsets(img_grid)
        vid_rows = _row_offsets(vid_grid)
        ii = vi = 0
        for k, video in zip(n_images, has_video):
            v = Vision()
            if k:
                v.image_grid_thw = img_grid[ii:ii + k]
                v.pixel_values = inputs["pixel_values"][img_rows[ii]:img_rows[ii + k]]
                ii += k
            if video:
                v.video_grid_thw = vid_grid[vi:vi + 1]
                v.pixel_values_videos = inputs["pixel_values_videos"][vid_rows[vi]:vid_rows[vi + 1]]
                if seconds is not None:
                    v.second_per_grid_ts = torch.as_tensor(seconds, dtype=torch.float32).reshape(-1)[vi:vi + 1]
                vi += 1
            out.append(v)
        return out

    @torch.no_grad()
    def _encode_vision(self, vision: list[Vision]) -> None:
        """Encode every prompt's images / frames once without gradients and keep the features on each ``Vision``:
        for a frozen tower they serve the whole update; for a trained one, only the rollout (sampling is gradient
        free, so ``generate`` reads each prompt's features instead of encoding one copy per returned sequence)."""
        set_mode(self.model, train=False)
        for v in vision:  # one prompt per tower call, so a prompt's features never depend on the batch it came in
            (encoded,) = self._encode(self.base_model, [v], detach=True)
            v.image_features, v.image_deepstack, v.video_features, v.video_deepstack = encoded

    def _encode(self, hf_model, vision: list[Vision], *, detach: bool) -> list[tuple[list, list, list, list]]:
        """Per ``Vision``: its image features, image DeepStack features, video features and video DeepStack
        features from ``hf_model``'s vision tower (one entry per image / video), all images in one tower call and
        all videos in another, on the policy's device; ``detach`` cuts them from the graph."""
        device = self.device
        encoded = [([], [], [], []) for _ in vision]
        for slot, pixels_of, grid_of, encode in (
                (0, "pixel_values", "image_grid_thw", hf_model.model.get_image_features),
                (2, "pixel_values_videos", "video_grid_thw", hf_model.model.get_video_features)):
            owners = [i for i, v in enumerate(vision) if getattr(v, pixels_of) is not None]
            if not owners:
                continue
            grids = [getattr(vision[i], grid_of) for i in owners]
            out = encode(torch.cat([getattr(vision[i], pixels_of) for i in owners]).to(device),
                         torch.cat(grids).to(device), return_dict=True)
            features = [f.detach() if detach else f for f in out.pooler_output]
            deepstack = _per_item_deepstack(out, len(features), detach=detach)
            start = 0
            for i, grid in zip(owners, grids):
                stop = start + len(grid)
                encoded[i][slot].extend(features[start:stop])
                encoded[i][slot + 1].extend(deepstack[start:stop])
                start = stop
        return encoded

    @property
    def deterministic_training_forward(self) -> bool:
        """Whether the gradient-carrying forward (train mode) gives the same log-probs as a no-grad one (eval mode):
        no dropout with ``p > 0`` anywhere (LoRA dropout, a checkpoint's hidden or attention dropout). The trainer
        then takes the old log-probs of an update's first optimizer step from its live forwards, detached."""
        active = any(float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0 or
                     (isinstance(m, torch.nn.Dropout) and m.p > 0) for m in self.model.modules())
        return not active

    def _encodes_per_forward(self) -> bool:
        """A trained tower is encoded in the gradient forward itself, each distinct prompt's pixels once however
        many of its completions the batch holds (their gradients meet in the shared features); not under FSDP2,
        whose root forward is what gathers the tower's sharded weights, nor under ZeRO-3, whose per-forward gathers
        are collectives (the distinct prompts of a minibatch, so the tower calls, may differ between processes)."""
        if self.freeze_vision or self.use_lora:
            return False
        if self._per_forward is None:
            self._per_forward = not weights_partitioned(self.train_model)
        return self._per_forward

    def _vision_kwargs(self, vision: list[Vision], encoded: dict[int, tuple] | None = None,
                       cached: bool | None = None) -> dict[str, Any]:
        """Model kwargs for a batch whose rows use these per-row vision inputs: the features of ``encoded``
        (``id(Vision)`` -> :meth:`_encode`'s tuple, computed for this forward), else the cached features when
        ``cached`` (default: the tower is frozen), else the pixels."""
        cached = self.freeze_vision if cached is None else cached

        def features(v: Vision) -> tuple:
            return encoded[id(v)] if encoded is not None else \
                (v.image_features, v.image_deepstack, v.video_features, v.video_deepstack)

        use_features = encoded is not None or cached
        kwargs = self._grid_kwargs(vision)
        img = [v for v in vision if v.image_grid_thw is not None]
        vid = [v for v in vision if v.video_grid_thw is not None]
        if img:
            if use_features:
                kwargs.setdefault("mm_encoder_outputs", {})["image"] = _encoder_output(
                    [f for v in img for f in features(v)[0]], [d for v in img for d in features(v)[1]])
            else:
                kwargs["pixel_values"] = torch.cat([v.pixel_values for v in img]).to(self.device)
        if vid:
            if use_features:
                kwargs.setdefault("mm_encoder_outputs", {})["video"] = _encoder_output(
                    [f for v in vid for f in features(v)[2]], [d for v in vid for d in features(v)[3]])
            else:
                kwargs["pixel_values_videos"] = torch.cat([v.pixel_values_videos for v in vid]).to(self.device)
        return kwargs

    def _grid_kwargs(self, vision: list[Vision]) -> dict[str, Tensor]:
        """The vision grids of a batch whose rows use these per-row vision inputs (``image_grid_thw``,
        ``video_grid_thw``, ``second_per_grid_ts``): what the placeholders and the rope positions are built from."""
        kwargs: dict[str, Any] = {}
        img = [v for v in vision if v.image_grid_thw is not None]
        vid = [v for v in vision if v.video_grid_thw is not None]
        if img:
            kwargs["image_grid_thw"] = torch.cat([v.image_grid_thw for v in img]).to(self.device)
        if vid:
            kwargs["video_grid_thw"] = torch.cat([v.video_grid_thw for v in vid]).to(self.device)
            if vid[0].second_per_grid_ts is not None:
                kwargs["second_per_grid_ts"] = torch.cat([v.second_per_grid_ts for v in vid]).to(self.device)
        return kwargs

    # -------------------------------------------------------------------------------------- rollout

    @torch.no_grad()
    def rollout(self, items: list, group_size: int, *, generator: torch.Generator, update: int = 0,
                group_offset: int = 0, greedy: bool = False, shuffle_frames: bool = False) -> VLMRollout:
        """``group_size`` sampled completions per item (``N = len(items) * group_size``). ``shuffle_frames``
        permutes each video's frames (T-GRPO's contrast rollouts)."""
        inputs, vision, kept = self.encode_prompts(items, shuffle_frames=generator if shuffle_frames else None)
        if not kept:
            raise EmptyBatchError("no usable sample in this batch (all skipped: see the skip counts)")
        items = [items[i] for i in kept]
        if self.freeze_vision or not self.tools:
            self._encode_vision(vision)
        if self.tools:
            from mmrl.pipelines.vlm.tool_rollout import tool_rollout

            return tool_rollout(self, items, inputs, vision, 1 if greedy else group_size, generator=generator,
                                group_offset=group_offset, greedy=greedy)
        prompt_ids = inputs["input_ids"]
        prompt_mask = inputs["attention_mask"]
        mm_types = inputs.get("mm_token_type_ids")
        sampler_logps = None
        if self.sampler is not None:
            completion_ids, sampler_logps = self._sample_on_engine(prompt_ids, prompt_mask, vision, group_size,
                                                                   generator, greedy)
        else:
            sequences = self.generate(prompt_ids, prompt_mask, mm_types, vision,
                                      self.sampling_config(greedy=greedy, group_size=group_size), generator)
            completion_ids = sequences[:, prompt_ids.shape[1]:].cpu()
        if greedy:
            group_size = 1
        mask = _completion_mask(completion_ids, self.eos_ids)
        completion_ids = completion_ids.masked_fill(mask == 0, self.pad_id)
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        n = len(items) * group_size
        prompt_index = torch.arange(len(items)).repeat_interleave(group_size)
        return VLMRollout(
            prompts=[items[i].question for i in prompt_index.tolist()],
            metadata=[dict(items[i].metadata) for i in prompt_index.tolist()],
            group_ids=prompt_index + group_offset,
            completions=texts, prompt_ids=prompt_ids, prompt_mask=prompt_mask, mm_token_type_ids=mm_types,
            completion_ids=completion_ids, mask=mask.float(), prompt_index=prompt_index, vision=vision,
            extras={"num_samples": n, "completion_length": mask.sum(-1).float()},
            sampler_logps=None if sampler_logps is None else sampler_logps * mask,
        )

    def _sync_sampler(self) -> None:
        """Push the trained weights to the rollout engine when they changed since the last push: an optimizer step,
        a loaded checkpoint or swapped-in EMA weights all write the parameters in place, which bumps their version
        counters (so the first rollout of a run, fresh or resumed, always pushes)."""
        from mmrl.pipelines.vlm.vllm_engine import merged_weights

        trained = self.named_trainable_parameters()
        if getattr(self.sampler, "syncs_weights", False):  # a vLLM server: shared by processes, checked by content
            from mmrl.pipelines.vlm.vllm_server import weights_fingerprint

            self.sampler.sync(weights_fingerprint(trained.items()), lambda: list(merged_weights(
                self.model, trained=trained, use_lora=self.use_lora, dtype=self.dtype)))
            return
        state = tuple((name, id(p), p._version) for name, p in trained.items())
        if state == self._pushed_weights:
            return
        self.sampler.push(list(merged_weights(self.model, trained=trained, use_lora=self.use_lora, dtype=self.dtype)))
        self._pushed_weights = state

    def _sample_on_engine(self, prompt_ids: Tensor, prompt_mask: Tensor, vision: list[Vision], group_size: int,
                          generator: torch.Generator, greedy: bool) -> tuple[Tensor, Tensor]:
        """``group_size`` completions per prompt from the rollout engine (1 when ``greedy``): ``[N, T]`` token ids
        (right-padded) and the engine's log-prob of each (0 on padding). The prompt the engine expanded must be the
        training processor's, token for token."""
        self._sync_sampler()
        seed = int(torch.randint(0, 2**31 - 1 - len(vision), (1,), generator=generator))
        results = self.sampler.generate(
            [v.engine_prompt for v in vision], n=group_size, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            max_tokens=self.max_new_tokens, stop_token_ids=self.eos_ids,
            suppressed_ids=self.suppressed_ids, seed=seed, greedy=greedy)
        rows, logps = [], []
        for p, (engine_prompt, completions, completion_logps) in enumerate(results):
            ours = prompt_ids[p][prompt_mask[p].bool()].tolist()
            if engine_prompt != ours:
                first = next((i for i, (a, b) in enumerate(zip(engine_prompt, ours)) if a != b),
                             min(len(ours), len(engine_prompt)))
                raise RuntimeError(
                    f"the rollout engine expanded prompt {p} to {len(engine_prompt)} tokens where the training "
                    f"processor has {len(ours)} (first difference at token {first}): the engine and the trainer "
                    f"would read different sequences; check that vLLM loads the same processor settings "
                    f"(generation.min_pixels / max_pixels)")
            rows.extend(completions)
            logps.extend(completion_logps)
        width = max(1, max(len(r) for r in rows))
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        values = torch.zeros(len(rows), width)
        for i, (r, lp) in enumerate(zip(rows, logps)):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            values[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
        return ids, values

    def generate(self, input_ids: Tensor, attention_mask: Tensor, mm_types: Tensor | None, vision: list[Vision],
                 config, generator: torch.Generator, **kwargs) -> Tensor:
        """``model.generate`` on left-padded rows with per-row ``vision``, seeded from ``generator``; the sequences
        (prompt columns included) on the model's device. ``kwargs`` go to ``generate`` (e.g. the tokenizer for stop
        strings)."""
        vision_kwargs = self._vision_kwargs(vision, cached=self.freeze_vision or all(map(_has_features, vision)))
        gen_kwargs = {"input_ids": input_ids.to(self.device), "attention_mask": attention_mask.to(self.device),
                      **vision_kwargs, **kwargs}
        if mm_types is not None:
            gen_kwargs["mm_token_type_ids"] = mm_types.to(self.device)
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        set_mode(self.model, train=False)
        if self._shares_prefill(config, input_ids, vision_kwargs):
            gen_kwargs = self._shared_prefill(gen_kwargs, vision_kwargs, config)
        # generate() fills every field the passed config leaves unset from model.generation_config (transformers
        # 5.x GenerationMixin._prepare_generation_config, no opt-out): for this call the model's config is ours,
        # so nothing the checkpoint ships (repetition_penalty, min_p, ...) reaches the sampling distribution
        if getattr(config, "cache_implementation", None) == "static":
            config.max_cache_len = static_cache_length(input_ids.shape[1] + config.max_new_tokens)
        hf_model = self.base_model
        shipped = hf_model.generation_config
        hf_model.generation_config = config
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(seed)
                return self.model.generate(**gen_kwargs, generation_config=config)
        finally:
            hf_model.generation_config = shipped

    def _shares_prefill(self, config, input_ids: Tensor, vision_kwargs: dict) -> bool:
        """Whether ``generate`` prefills each prompt once for its ``num_return_sequences`` samples
        (:meth:`_shared_prefill`): ``share_prompt_prefix`` is on, more than one sequence per prompt is asked for, the
        cache is HF's dynamic one (a static cache is allocated by ``generate`` itself), the prompts have a token to
        leave to ``generate``, and the batch holds an image or a video. A text-only batch is prefilled by
        ``generate`` itself: without vision grids the model numbers the prefix's positions from 0 over the left
        padding (``generate`` skips it) and keeps the previous call's ``rope_deltas``, so the shared prefill sampled
        from positions the replay does not use (log-probs up to 0.85 apart on Qwen3-VL) or failed on the stale
        offsets' size."""
        vision = any(vision_kwargs.get(k) is not None for k in ("image_grid_thw", "video_grid_thw"))
        return (self.share_prompt_prefix and vision and int(getattr(config, "num_return_sequences", 1) or 1) > 1
                and getattr(config, "cache_implementation", None) in (None, "dynamic") and input_ids.shape[1] > 1)

    @torch.no_grad()
    def _shared_prefill(self, gen_kwargs: dict, vision_kwargs: dict, config) -> dict:
        """One prefill forward per distinct prompt instead of one per returned sequence: the prompt rows but their last
        token run once with the vision inputs, their KV cache is repeated to the ``num_return_sequences`` rows of each
        prompt (as ``generate`` expands its inputs), and ``generate`` continues from it (transformers' "re-use the
        cache to continue generation") on the expanded rows, computing the last prompt token and sampling from there.
        The model's rope offsets of the prompts (``rope_deltas``, which ``generate`` reads once a cache is given) are
        repeated alike. The same sampling distribution (the same sampled tokens on the same seed, tested); ``config``
        is changed to return one sequence per (expanded) row. Returns the kwargs for ``generate``."""
        group = int(config.num_return_sequences)
        prefix = {k: gen_kwargs[k][:, :-1] for k in ("input_ids", "attention_mask", "mm_token_type_ids")
                  if k in gen_kwargs}
        cache = self.model(**prefix, **vision_kwargs, use_cache=True, logits_to_keep=1).cache
        cache.batch_repeat_interleave(group)
        core = getattr(self.base_model, "model", None)
        if getattr(core, "rope_deltas", None) is not None:
            core.rope_deltas = core.rope_deltas.repeat_interleave(group, dim=0)
        config.num_return_sequences = 1
        out = {k: v.repeat_interleave(group, dim=0) for k, v in gen_kwargs.items()
               if k in ("input_ids", "attention_mask", "mm_token_type_ids")}
        extra = {k: v for k, v in gen_kwargs.items() if k not in out and k not in vision_kwargs}
        return {**out, **extra, "cache": cache}

    def sampling_config(self, *, greedy: bool = False, group_size: int = 1):
        """A fresh ``GenerationConfig`` holding only the policy's settings: the processors that sampling applies
        are exactly temperature, top-k, top-p (``top_k=0`` and ``top_p=1`` are off) and the suppressed vision
        placeholders; greedy decoding applies only the suppression."""
        from transformers import GenerationConfig

        common = dict(max_new_tokens=self.max_new_tokens, eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
                      suppress_tokens=self.suppressed_ids or None)
        if self.cache_implementation == "static":
            common["cache_implementation"] = "static"
        if greedy:
            return GenerationConfig(do_sample=False, num_return_sequences=1, **common)
        shaping = {"min_p": self.min_p} if self.min_p > 0 else {}
        if self.repetition_penalty != 1.0:
            shaping["repetition_penalty"] = self.repetition_penalty
        return GenerationConfig(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                num_return_sequences=group_size, **shaping, **common)

    def logprobs(self, rollout: VLMRollout, index: Tensor, steps: Tensor | None = None, *,
                 with_kl: bool = False, masked_vision: bool = False, perturbed_vision: float = 0.0,
                 with_entropy: bool = False) -> LogProbOutput:
        """Per-token log-probs ``[n, T]`` (or the ``steps`` columns) of the stored completions of samples ``index``.

        ``masked_vision``: the same completions with every image and video frame replaced by a grey canvas of the
        same size (:meth:`masked_vision`), for visual-dependence credit ``log p(y | image) - log p(y | grey)``;
        ``perturbed_vision`` (> 0): the images with Gaussian noise of this std added to the normalised pixels
        (:meth:`perturbed_vision`), for consistency under a small visual perturbation.

        With gradients enabled the forward runs in train mode (gradient checkpointing, LoRA dropout); without, in
        eval mode. ``with_kl``: also an estimate of KL(policy || reference) per token (``kl_estimator``; TRL's k3
        ``exp(ref - logp) - (ref - logp) - 1`` by default), on the live log-probs (so ``beta`` has a gradient) with the
        reference log-probs computed without gradients (eval mode) and cached for the update. ``with_entropy``: also
        the entropy ``-sum_v p log p`` (nats) of the tempered distribution each completion token was drawn from (0 at
        positions that are not the policy's own tokens), for ``algorithm.top_entropy_quantile``.
        """
        index = torch.as_tensor(index, dtype=torch.long)
        rows = rollout.prompt_index[index]
        width = rollout.completion_ids.shape[1]
        vision = self.masked_vision(rollout) if masked_vision else \
            self.perturbed_vision(rollout, perturbed_vision) if perturbed_vision > 0 else rollout.vision
        row_vision = [vision[r] for r in rows.tolist()]
        targets = rollout.completion_ids[index].to(self.device)

        own = None if rollout.completion_attention is None else (rollout.mask[index] > 0).to(self.device)
        positions = self._rope_positions(rollout)  # the model's own 3-D rope positions, computed once per rollout

        entropies: list[Tensor] = []

        def token_logps(model, train: bool, entropy: bool = False) -> Tensor:
            # the mode is set at the start of each forward and left as it is: a gradient-carrying forward stays in
            # train mode through its backward, where gradient checkpointing recomputes it (dropout included)
            set_mode(model, train)
            encoded = None
            if self._encodes_per_forward():
                hf_model = self.base_model if model is self.model or model is self.train_model else model
                unique = list({id(v): v for v in row_vision}.values())
                encoded = dict(zip(map(id, unique), self._encode(hf_model, unique,
                                                                 detach=not torch.is_grad_enabled())))
            if self._shares_prompts(rows, rollout, positions):
                logits = self._prefix_shared_logits(model, rollout, index, vision, encoded, positions)
            else:
                kwargs = self._sequence_inputs(rollout, index)
                if positions is not None:
                    kwargs["position_ids"] = positions[:, index.to(positions.device)]
                vision_kwargs = self._vision_kwargs(row_vision, encoded)
                logits = model(**kwargs, **vision_kwargs, logits_to_keep=width + 1, use_cache=False).logits[:, :-1]
            logits = logits.float() / self.temperature
            if self.suppressed_ids:
                logits[..., self.suppressed_ids] = float("-inf")
            picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            logps = picked - torch.logsumexp(logits, dim=-1)
            if own is not None:  # a tool response's vision placeholders are suppressed ids: -inf, never actions
                logps = torch.where(own, logps, torch.zeros_like(logps))
            if entropy:  # one row at a time: a [T, V] copy of the log-softmax, not [n, T, V] (with gradient when
                rows_h = []  # the forward has one: algorithm.entropy_coef's bonus)
                for row in (logits if torch.is_grad_enabled() else logits.detach()):
                    log_p = torch.log_softmax(row, dim=-1)
                    rows_h.append(-(log_p.exp() * torch.nan_to_num(log_p, neginf=0.0)).sum(-1))  # suppressed: p = 0
                h = torch.stack(rows_h)
                entropies.append(h if own is None else torch.where(own, h, torch.zeros_like(h)))
            return logps

        ref = None
        if with_kl and (masked_vision or perturbed_vision > 0):
            raise ValueError("masked_vision / perturbed_vision log-probs carry no KL term")
        if with_kl:
            # the reference never changes within an update: its log-probs are computed once per sample and reused
            # by every later minibatch and inner epoch; computed BEFORE the policy's forward, so the policy's
            # forward is the last one before backward
            cache = rollout.extras.setdefault("ref_logps", {})
            rows_list = index.tolist()
            if any(i not in cache for i in rows_list):
                with torch.no_grad(), self.reference() as ref_model:
                    fresh = token_logps(ref_model, train=False)
                for j, i in enumerate(rows_list):
                    cache[i] = fresh[j]
            ref = torch.stack([cache[i] for i in rows_list])
        logps = token_logps(self.train_model, train=torch.is_grad_enabled(), entropy=with_entropy)
        # TRL: live log-probs, reference without gradient
        kl = None if ref is None else kl_estimate(logps, ref, self.kl_estimator)
        entropy = entropies[0] if entropies else None
        if steps is not None:
            steps = torch.as_tensor(steps, device=logps.device)
            logps = logps[:, steps]
            kl = kl[:, steps] if kl is not None else None
            entropy = entropy[:, steps] if entropy is not None else None
        return LogProbOutput(logps=logps, kl=kl, entropy=entropy)

    def _shares_prompts(self, rows: Tensor, rollout: VLMRollout, positions: Tensor | None) -> bool:
        """Whether a log-prob forward over samples with these prompt ``rows`` runs each distinct prompt once
        (:meth:`_prefix_shared_logits`): ``share_prompt_prefix`` is on, some prompt is repeated, the rope positions
        are known (the model would derive the completions' from the prompt forward's rows), the completions hold no
        tool responses (their images would need the vision inputs), and gradient checkpointing is off (it recomputes
        each layer in backward and cannot keep a KV cache; no-grad passes follow the gradient forward's layout so the
        first ratio stays exactly 1)."""
        return (self.share_prompt_prefix and positions is not None and rollout.completion_attention is None
                and len(set(rows.tolist())) < len(rows)
                and not getattr(self.base_model, "is_activation_checkpointing", False))

    def _prefix_shared_logits(self, model, rollout: VLMRollout, index: Tensor, vision: list[Vision],
                              encoded: dict[int, tuple] | None, positions: Tensor) -> Tensor:
        """The logits ``[n, T, V]`` that predict the completion tokens of samples ``index``, each distinct prompt
        run once: one forward of the distinct prompt rows builds their KV cache (the logits of the last prompt token
        predict each completion's first token), the cache is indexed out to one row per sample, and one forward of
        the completions attends to it. The same log-probs as one forward of every prompt + completion row (tested)
        with the prompt's tokens computed once per group instead of once per completion; gradients reach the prompt
        positions through the cache."""
        rows = rollout.prompt_index[index]
        prompts, inverse = torch.unique(rows, return_inverse=True)
        first = torch.zeros(len(prompts), dtype=torch.long).scatter_reduce(
            0, inverse, torch.arange(len(rows)), reduce="amin", include_self=False)  # a sample of each prompt
        prompt_length = rollout.prompt_ids.shape[1]
        rows_kwargs = self._sequence_inputs(rollout, index)  # the full rows: prompt columns, then completion columns
        # the completions attend to the whole row (the cached prompt's mask included), their own columns are input
        completion_kwargs = {k: v if k == "attention_mask" else v[:, prompt_length:] for k, v in rows_kwargs.items()}
        prompt_kwargs = {"input_ids": rollout.prompt_ids[prompts], "attention_mask": rollout.prompt_mask[prompts]}
        if rollout.mm_token_type_ids is not None:
            prompt_kwargs["mm_token_type_ids"] = rollout.mm_token_type_ids[prompts]
        prompt_kwargs = {k: v.to(self.device) for k, v in prompt_kwargs.items()}
        prompt_kwargs["position_ids"] = positions[:, index[first].to(positions.device), :prompt_length]
        completion_kwargs["position_ids"] = positions[:, index.to(positions.device), prompt_length:]
        out = model(**prompt_kwargs, **self._vision_kwargs([vision[p] for p in prompts.tolist()], encoded),
                    logits_to_keep=1, use_cache=True)
        cache = out.cache
        cache.batch_select_indices(inverse.to(self.device))
        completion = model(**completion_kwargs, cache=cache, use_cache=True).logits
        return torch.cat([out.logits[inverse.to(self.device)], completion[:, :-1]], dim=1)

    def _sequence_inputs(self, rollout: VLMRollout, index: Tensor) -> dict[str, Tensor]:
        """``input_ids``, ``attention_mask`` (and ``mm_token_type_ids``) of samples ``index``: each one's prompt row
        followed by its completion, as the policy's forwards read them."""
        rows = rollout.prompt_index[index]
        kwargs = {"input_ids": torch.cat([rollout.prompt_ids[rows], rollout.completion_ids[index]], dim=1),
                  "attention_mask": torch.cat([rollout.prompt_mask[rows], rollout.attention[index].long()], dim=1)}
        if rollout.mm_token_type_ids is not None:
            kwargs["mm_token_type_ids"] = torch.cat(
                [rollout.mm_token_type_ids[rows], rollout.completion_types[index].to(rollout.mm_token_type_ids.dtype)],
                dim=1)
        return {k: v.to(self.device) for k, v in kwargs.items()}

    @torch.no_grad()
    def _rope_positions(self, rollout: VLMRollout) -> Tensor | None:
        """The rope position ids ``[3, N, Lp + T]`` of every sample's prompt + completion, from the model's own
        ``compute_3d_position_ids`` (``get_rope_index``) on the whole rollout once and cached in ``rollout.extras``;
        ``None`` where the model computes none (text only). A row's positions depend only on its own tokens and
        vision grids, so slicing the rollout's rows gives exactly what the model computes for any minibatch of
        them, and each log-prob forward (every minibatch of every inner epoch, old, reference and masked passes)
        skips the per-row Python loop of ``get_rope_index``."""
        if "rope_positions" in rollout.extras:
            return rollout.extras["rope_positions"]
        compute = getattr(getattr(self.base_model, "model", None), "compute_3d_position_ids", None)
        positions = None
        if compute is not None:
            every = torch.arange(len(rollout))
            kwargs = {"image_grid_thw": None, "video_grid_thw": None,  # Qwen2.5-VL's have no default
                      **self._sequence_inputs(rollout, every),
                      **self._grid_kwargs([rollout.vision[r] for r in rollout.prompt_index.tolist()])}
            positions = compute(inputs_embeds=None, cache=None, **kwargs)
        rollout.extras["rope_positions"] = positions
        return positions

    def concat_rollouts(self, parts: list[VLMRollout]) -> VLMRollout:
        return VLMRollout.concat(parts, self.pad_id)

    def masked_vision(self, rollout: VLMRollout) -> list[Vision]:
        """Each prompt's vision inputs with every image / frame a uniform grey canvas (0.5 in [0, 1] before the
        processor's normalisation) of the same size, so the prompt's vision tokens and positions are unchanged; with
        a frozen tower the grey features are encoded once per rollout (cached in ``rollout.extras``)."""
        return self._intervened(rollout, "masked_vision", lambda pixels, kind: self._grey_like(pixels, kind))

    def perturbed_vision(self, rollout: VLMRollout, std: float) -> list[Vision]:
        """Each prompt's vision inputs plus Gaussian noise of ``std`` on the normalised pixels (seeded by the
        rollout's size, so every call and every process sees the same noise); cached per rollout and ``std``."""
        generator = torch.Generator().manual_seed(1_000_003 + len(rollout))

        def noisy(pixels: Tensor, kind: str) -> Tensor:
            noise = torch.randn(pixels.shape, generator=generator, dtype=torch.float32)
            return (pixels.float() + std * noise).to(pixels.dtype)

        return self._intervened(rollout, f"perturbed_vision_{std:g}", noisy)

    def _intervened(self, rollout: VLMRollout, key: str, change) -> list[Vision]:
        """The rollout's vision inputs with ``change(pixels, kind)`` applied to every image / video tensor (the grids,
        so the prompt's vision tokens, unchanged); features re-encoded once with a frozen tower; cached under ``key``."""
        cached = rollout.extras.get(key)
        if cached is not None:
            return cached
        out = []
        for v in rollout.vision:
            out.append(Vision(image_grid_thw=v.image_grid_thw, video_grid_thw=v.video_grid_thw,
                              second_per_grid_ts=v.second_per_grid_ts,
                              pixel_values=None if v.pixel_values is None else change(v.pixel_values, "image"),
                              pixel_values_videos=None if v.pixel_values_videos is None else
                              change(v.pixel_values_videos, "video")))
        if self.freeze_vision:
            self._encode_vision(out)
        rollout.extras[key] = out
        return out

    def _grey_like(self, pixel_values: Tensor, kind: str) -> Tensor:
        """A normalised grey canvas in the processor's flattened patch layout (channel-major ``C x t x p x p`` per
        row, as the Qwen-VL image and video processors flatten patches)."""
        processor = getattr(self.processor, "video_processor" if kind == "video" else "image_processor", None) \
            or self.processor.image_processor
        mean = torch.as_tensor(processor.image_mean, dtype=torch.float32)
        std = torch.as_tensor(processor.image_std, dtype=torch.float32)
        channels = len(mean)
        if pixel_values.shape[-1] % channels:
            raise ValueError(f"{kind} patches of width {pixel_values.shape[-1]} do not split into {channels} channels")
        per_channel = ((0.5 - mean) / std).repeat_interleave(pixel_values.shape[-1] // channels)
        return per_channel.to(pixel_values.dtype).expand_as(pixel_values).clone()

    def truncated(self, rollout: VLMRollout) -> Tensor:
        """``[N]`` bool: the completions the token budget cut off, whose last token the model wrote (``mask``, so a
        tool rollout's responses are not counted) is none of the end-of-turn tokens (TRL's ``is_truncated``, its
        ``completions/clipped_ratio``). A row without any written token is not truncated."""
        mask = rollout.mask > 0
        width = mask.shape[1]
        last = width - 1 - mask.flip(-1).to(torch.uint8).argmax(-1)  # index of the last written token
        token = rollout.completion_ids.gather(1, last.unsqueeze(1)).squeeze(1)
        return mask.any(-1) & ~torch.isin(token, torch.tensor(self.eos_ids, dtype=token.dtype))

    def span_mask(self, rollout: VLMRollout, spans: list) -> Tensor:
        """``[N, T]`` mask of the sampled tokens inside each sample's character ``spans`` of its completion text
        (:func:`mmrl.pipelines.vlm.spans.spans_to_token_mask`)."""
        from mmrl.pipelines.vlm.spans import spans_to_token_mask

        return spans_to_token_mask(self.tokenizer, rollout.completion_ids, rollout.mask, rollout.completions, spans)

    @torch.no_grad()
    def sample_eval(self, items: list, seeds: list[int] | None = None) -> "EvalAnswers":
        """Greedy answers for evaluation items (``seeds`` unused: decoding is deterministic), with the questions and
        metadata of the items answered: under ``data.skip_bad_samples`` an item whose media do not load is left
        out, so the answers may be fewer than the items."""
        rollout = self.rollout(items, 1, generator=torch.Generator().manual_seed(0), greedy=True)
        return EvalAnswers(rollout.completions, rollout.prompts, rollout.metadata)


class EvalAnswers(list):
    """Greedy answers (a list of str) with ``prompts`` and ``metadata``, one per answer (:meth:`sample_eval`)."""

    def __init__(self, answers: list[str], prompts: list[str], metadata: list[dict]):
        super().__init__(answers)
        self.prompts, self.metadata = list(prompts), [dict(m) for m in metadata]


def _per_item_deepstack(out, n: int, *, detach: bool = True) -> list[list[Tensor]]:
    """Qwen3-VL's ``get_*_features`` also return DeepStack features: a list over deepstack layers of per-item
    tuples. Transposed to one list over layers per image / video (so prompts can be regrouped); ``[]`` per item
    for models without DeepStack."""
    layers = getattr(out, "deepstack_features", None)
    if not layers:
        return []
    return [[layer[i].detach() if detach else layer[i] for layer in layers] for i in range(n)]


def set_mode(model: torch.nn.Module, train: bool) -> None:
    """``model.train(train)`` where some module is in the other mode: ``nn.Module.train`` walks and sets every module
    even when nothing changes (tiny Qwen2.5-VL, 67 modules: 0.16 ms a call that changes nothing, about 0.6 ms a real
    switch with transformers' hub kernels on; the check is 0.05 ms)."""
    if any(module.training != train for module in model.modules()):
        model.train(train)


def _has_features(v: Vision) -> bool:
    """Whether every image / video of ``v`` has its encoded features."""
    return (v.pixel_values is None or bool(v.image_features)) and \
        (v.pixel_values_videos is None or bool(v.video_features))


def _encoder_output(features: list[Tensor], deepstack: list[list[Tensor]]):
    """``mm_encoder_outputs`` entry for cached features: ``pooler_output`` is the per-item feature list; with
    DeepStack (Qwen3-VL) ``deepstack_features`` is rebuilt as the model returns it (per layer, per item)."""
    if not deepstack:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        return BaseModelOutputWithPooling(pooler_output=features)
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    if len(deepstack) != len(features):
        raise ValueError("cached vision features mix models with and without DeepStack features")
    layers = [[item[layer] for item in deepstack] for layer in range(len(deepstack[0]))]
    return BaseModelOutputWithDeepstackFeatures(pooler_output=features, deepstack_features=layers)


def _row_offsets(grid: Tensor | None) -> list[int]:
    """Cumulative patch rows of each image / video in the processor's flattened pixel tensor."""
    if grid is None:
        return [0]
    counts = grid.prod(-1).tolist()
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + int(c))
    return offsets


def _completion_mask(completion_ids: Tensor, eos_ids: list[int]) -> Tensor:
    """1 for every token up to and including the first end-of-turn token, 0 after (TRL's completion mask)."""
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for eos in eos_ids:
        is_eos |= completion_ids == eos
    seq = torch.arange(completion_ids.shape[1]).expand_as(completion_ids)
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((len(completion_ids),),
                                                                            completion_ids.shape[1]))
    return (seq <= first.unsqueeze(1)).long()
