"""Multi-turn rollouts of a Qwen-VL policy that calls image tools (:mod:`mmrl.pipelines.vlm.tools`).

Every sample is generated turn by turn: a turn ends at the end-of-turn token, at the completion budget
(``generation.max_new_tokens`` counts the policy's own tokens over all turns) or when the policy closes a tool call;
then the call runs, its response (``generation.tool_response_template`` around the returned view) is appended, and
the next turn is sampled from the whole context: the prompt, everything the policy wrote and every response so far.
A turn of a row that has used ``generation.max_tool_calls`` calls does not stop at a call.

The rollout keeps one prompt row and one :class:`~mmrl.pipelines.vlm.qwen.Vision` per sample (the prompt's images
followed by its views, in sequence order), the completion's tokens with ``mask`` 1 on the policy's own tokens only,
``completion_attention`` 1 on all of them and the responses' token types, so the loop's replay
(:meth:`QwenVLPolicy.logprobs`) scores each sampled token in the context it was sampled in.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mmrl.pipelines.vlm.tools import TOOL_CLOSE, TOOL_OPEN, ToolCall, answer_frame, last_call, run_call

logger = logging.getLogger(__name__)


@dataclass
class _Row:
    """One sample being generated."""

    prompt: int  # its prompt row
    ids: list[int] = field(default_factory=list)  # completion tokens so far (the policy's and the responses')
    own: list[int] = field(default_factory=list)  # 1 on the policy's own tokens
    types: list[int] = field(default_factory=list)  # token types (1 on the responses' image tokens)
    views: list = field(default_factory=list)  # Vision of each returned view, in order
    calls: list[ToolCall] = field(default_factory=list)
    generated: int = 0  # the policy's own tokens so far
    segment_start: int = 0
    done: bool = False


def _first_containing(tokenizer, ids: list[int], needle: str) -> int | None:
    """The smallest ``k`` with ``needle`` in ``decode(ids[:k + 1])`` (``None`` when the whole does not contain it)."""
    if needle not in tokenizer.decode(ids, skip_special_tokens=False):
        return None
    low, high = 0, len(ids) - 1
    while low < high:
        mid = (low + high) // 2
        if needle in tokenizer.decode(ids[:mid + 1], skip_special_tokens=False):
            high = mid
        else:
            low = mid + 1
    return low


def _where_begins(tokenizer, ids: list[int], needle: str) -> int:
    """The token where the first ``needle`` in ``decode(ids)`` begins (0 when there is none): the last start from
    which the tokens through the one completing it still hold it."""
    last = _first_containing(tokenizer, ids, needle)
    if last is None:
        return 0
    begin = last
    while begin > 0 and needle not in tokenizer.decode(ids[begin:last + 1], skip_special_tokens=False):
        begin -= 1
    return begin


def _unpadded(prompt_ids: Tensor, prompt_mask: Tensor, mm_types: Tensor | None, row: int):
    keep = prompt_mask[row].bool()
    types = mm_types[row][keep].tolist() if mm_types is not None else [0] * int(keep.sum())
    return prompt_ids[row][keep].tolist(), types


def contexts(policy, prompts: list[tuple[list[int], list[int]]], completions: list[tuple[list[int], list[int]]]):
    """Left-padded ``input_ids``, ``attention_mask`` and token types of prompt + completion-prefix rows."""
    rows = [(p + c, pt + ct) for (p, pt), (c, ct) in zip(prompts, completions)]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), policy.pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    types = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, tt) in enumerate(rows):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        attention[i, width - len(ids):] = 1
        types[i, width - len(ids):] = torch.tensor(tt)
    return input_ids, attention, types


#: A special token written out as text (``<|image_pad|>``): taken out of an error message that echoes the policy's
#: call, which would otherwise tokenize into the special id (an image placeholder with no image behind it)
_SPECIAL = re.compile(r"<\|[^|<>\s]*\|>")


def _response(policy, text: str, view) -> tuple[list[int], list[int], object]:
    """Token ids, token types and (with a view) the Vision of one tool response."""
    from mmrl.pipelines.vlm.qwen import Vision

    tokenizer, config = policy.tokenizer, policy.base_model.config
    if view is None:
        ids = tokenizer(policy.tool_response_template.format(image=text), add_special_tokens=False)["input_ids"]
        return ids, [0] * len(ids), None
    start, end = (tokenizer.convert_ids_to_tokens(config.vision_start_token_id),
                  tokenizer.convert_ids_to_tokens(config.vision_end_token_id))
    placeholder = f"{start}{policy.processor.image_token}{end}"
    out = policy.processor(text=[policy.tool_response_template.format(image=placeholder)], images=[view],
                           return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    types = out["mm_token_type_ids"][0].tolist() if "mm_token_type_ids" in out else [
        int(i == config.image_token_id) for i in ids]
    vision = Vision(image_grid_thw=out["image_grid_thw"], pixel_values=out["pixel_values"])
    if policy.freeze_vision:
        policy._encode_vision([vision])
    return ids, types, vision


def _extend(policy, row: _Row, new: list[int], may_call: bool, image, frame=None) -> None:
    """Append one turn's generated tokens to ``row``: through the end-of-turn token, the budget, or a closed call
    (which then runs, its response appended)."""
    budget = policy.max_new_tokens - row.generated
    ends = [k for k, t in enumerate(new) if t in policy.eos_ids]
    stop = _first_containing(policy.tokenizer, new[:budget], TOOL_CLOSE) if may_call else None
    eos = ends[0] if ends else None
    if stop is not None and (eos is None or stop < eos):
        take, finished = stop + 1, False
    elif eos is not None and eos < budget:
        take, finished = eos + 1, True
    else:
        take, finished = min(len(new), budget), True
    _own(row, new[:take])
    if finished or row.generated >= policy.max_new_tokens:
        row.done = True
        return
    _respond(policy, row, image, frame)


def _own(row: _Row, ids: list[int]) -> None:
    """Append tokens the policy wrote (or, in SFT, is taught to write)."""
    row.ids += ids
    row.own += [1] * len(ids)
    row.types += [0] * len(ids)
    row.generated += len(ids)


def _respond(policy, row: _Row, image, frame=None) -> None:
    """Run the call the current segment of ``row`` ends with (a box tool's numbers read through ``frame``,
    :func:`~mmrl.pipelines.vlm.tools.answer_frame`) and append its response (context tokens)."""
    segment = row.ids[row.segment_start:]
    text = policy.tokenizer.decode(segment, skip_special_tokens=True)
    call = last_call(text) or ""
    try:  # a view the processor cannot take (a tool of the user's) is the call's error too, not the run's end
        ids, types, vision = _response(policy, None, run_call(call, policy.tools, image, frame))
        error = ""
    except ValueError as exc:  # ToolError included
        error = str(exc)
        ids, types, vision = _response(policy, "error: " + _SPECIAL.sub("", error), None)
    opened = _where_begins(policy.tokenizer, segment, TOOL_OPEN)
    end = len(row.ids)
    row.ids += ids
    row.own += [0] * len(ids)
    row.types += types
    if vision is not None:
        row.views.append(vision)
    row.calls.append(ToolCall(start=row.segment_start, end=end, response_end=len(row.ids), call=call.strip(),
                              error=error, opened=row.segment_start + opened))
    row.segment_start = len(row.ids)


@torch.no_grad()
def tool_rollout(policy, items: list, inputs, vision: list, n_per: int, *, generator: torch.Generator,
                 group_offset: int, greedy: bool):
    """``n_per`` multi-turn completions per item (module docstring): a ``VLMRollout`` with one prompt row per
    sample."""
    from mmrl.pipelines.vlm.qwen import Vision, VLMRollout, tool_extras

    prompt_ids, prompt_mask = inputs["input_ids"], inputs["attention_mask"]
    mm_types = inputs.get("mm_token_type_ids")
    prompt_index = torch.arange(len(items)).repeat_interleave(n_per)
    rows = [_Row(prompt=int(p)) for p in prompt_index]
    first_image = [v.images[0] if v.images else None for v in vision]
    frames = [answer_frame(item.metadata, policy.coord_format) for item in items]
    stop = {"tokenizer": policy.tokenizer}

    def config(may_call: bool, n: int, budget: int):
        c = policy.sampling_config(greedy=greedy, group_size=n)
        c.max_new_tokens = budget
        if may_call:
            c.stop_strings = [TOOL_CLOSE]
        return c

    sequences = policy.generate(prompt_ids, prompt_mask, mm_types, vision, config(True, n_per, policy.max_new_tokens),
                                generator, **stop)
    new = sequences[:, prompt_ids.shape[1]:].cpu().tolist()
    for row, ids in zip(rows, new):
        _extend(policy, row, ids, policy.max_tool_calls > 0, first_image[row.prompt], frames[row.prompt])
    while True:
        active = [r for r in rows if not r.done]
        if not active:
            break
        for may_call in (True, False):  # rows that may still call stop at a call; the others do not
            batch = [r for r in active if (len(r.calls) < policy.max_tool_calls) == may_call]
            if not batch:
                continue
            prompts = [_unpadded(prompt_ids, prompt_mask, mm_types, r.prompt) for r in batch]
            ids, attention, types = contexts(policy, prompts, [(r.ids, r.types) for r in batch])
            row_vision = [Vision.join([vision[r.prompt], *r.views]) for r in batch]
            budget = max(policy.max_new_tokens - r.generated for r in batch)
            sequences = policy.generate(ids, attention, types if mm_types is not None else None, row_vision,
                                        config(may_call, 1, budget), generator, **stop)
            for row, out in zip(batch, sequences[:, ids.shape[1]:].cpu().tolist()):
                _extend(policy, row, out, may_call, first_image[row.prompt], frames[row.prompt])
    width = max(1, max(len(r.ids) for r in rows))
    completion_ids = torch.full((len(rows), width), policy.pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width))
    attention = torch.zeros((len(rows), width))
    completion_types = torch.zeros((len(rows), width), dtype=mm_types.dtype if mm_types is not None else torch.long)
    for i, r in enumerate(rows):
        completion_ids[i, :len(r.ids)] = torch.tensor(r.ids, dtype=torch.long)
        mask[i, :len(r.own)] = torch.tensor(r.own, dtype=torch.float)
        attention[i, :len(r.ids)] = 1.0
        completion_types[i, :len(r.types)] = torch.tensor(r.types, dtype=completion_types.dtype)
    texts = policy.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    calls = [r.calls for r in rows]
    return VLMRollout(
        prompts=[items[i].question for i in prompt_index.tolist()],
        metadata=[dict(items[i].metadata) for i in prompt_index.tolist()],
        group_ids=prompt_index + group_offset, completions=texts,
        prompt_ids=prompt_ids[prompt_index], prompt_mask=prompt_mask[prompt_index],
        mm_token_type_ids=None if mm_types is None else mm_types[prompt_index],
        completion_ids=completion_ids, mask=mask, prompt_index=torch.arange(len(rows)),
        vision=[Vision.join([vision[r.prompt], *r.views]) for r in rows],
        extras={"num_samples": len(rows), "completion_length": mask.sum(-1), **tool_extras(calls)},
        completion_attention=attention, completion_mm_types=completion_types, tool_calls=calls,
        item_index=prompt_index,
    )


def trace(policy, target: str, image, end_id: int, metadata: dict | None = None) -> _Row:
    """An SFT target with tool calls as a rollout would hold it: each piece through a call's closing tag tokenized
    alone, the call run on ``image`` (box numbers in the answers' frame of ``metadata``, as in a rollout) and its
    response inserted (context: label -100 in SFT), the rest of the target, then ``end_id``. Calls after
    ``generation.max_tool_calls`` are plain text, as in a rollout."""
    frame = answer_frame(metadata or {}, policy.coord_format)
    row, rest = _Row(prompt=0), target
    while len(row.calls) < policy.max_tool_calls and TOOL_CLOSE in rest:
        cut = rest.index(TOOL_CLOSE) + len(TOOL_CLOSE)
        _own(row, policy.tokenizer(rest[:cut], add_special_tokens=False)["input_ids"])
        _respond(policy, row, image, frame)
        rest = rest[cut:]
    _own(row, policy.tokenizer(rest, add_special_tokens=False)["input_ids"] + [end_id])
    return row


@torch.no_grad()
def probe(policy, rollout, rows: list[int], lengths: list[int], suffix: str, *, max_new_tokens: int,
          stop: str | None) -> list[str]:
    """Greedy continuations of ``rollout``'s samples ``rows`` cut after ``lengths[j]`` completion tokens, with
    ``suffix`` (probe tokens) appended: ``suffix`` + the decoded continuation for each. The context keeps the views
    whose responses end inside the cut (TACO's answer probes)."""
    if not rows:
        return []
    suffix_ids = policy.tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix else []
    prompts, completions, row_vision = [], [], []
    types_all = rollout.completion_types
    for row, length in zip(rows, lengths):
        p = int(rollout.prompt_index[row])
        prompts.append(_unpadded(rollout.prompt_ids, rollout.prompt_mask, rollout.mm_token_type_ids, p))
        ids = rollout.completion_ids[row, :length].tolist() + suffix_ids
        types = types_all[row, :length].tolist() + [0] * len(suffix_ids)
        completions.append((ids, types))
        calls = (rollout.tool_calls or [[]] * len(rollout))[row]
        kept = sum(1 for c in calls if c.ok and c.response_end <= length)
        full = rollout.vision[p]
        row_vision.append(_first_images(full, kept, calls))
    ids, attention, types = contexts(policy, prompts, completions)
    config = policy.sampling_config(greedy=True)
    config.max_new_tokens = max_new_tokens
    kwargs = {}
    if stop:
        config.stop_strings = [stop]
        kwargs["tokenizer"] = policy.tokenizer
    sequences = policy.generate(ids, attention, types if rollout.mm_token_type_ids is not None else None, row_vision,
                                config, torch.Generator().manual_seed(0), **kwargs)
    new = sequences[:, ids.shape[1]:].cpu()
    outs = []
    for out in new.tolist():
        ends = [k for k, t in enumerate(out) if t in policy.eos_ids]
        text = policy.tokenizer.decode(out[:ends[0]] if ends else out, skip_special_tokens=True)
        if stop and stop in text:
            text = text[:text.index(stop) + len(stop)]
        outs.append(suffix + text)
    return outs


def _first_images(full, kept_views: int, calls: list[ToolCall]):
    """``full`` (a tool rollout's per-sample Vision: the prompt's images, then one per successful call) with only
    the first ``kept_views`` views."""
    from mmrl.pipelines.vlm.qwen import Vision

    views = sum(1 for c in calls if c.ok)
    n_images = 0 if full.image_grid_thw is None else len(full.image_grid_thw)
    keep = n_images - views + kept_views
    if keep == n_images:
        return full
    grid = full.image_grid_thw[:keep] if keep else None
    rows = int(full.image_grid_thw[:keep].prod(-1).sum()) if keep else 0
    return Vision(image_grid_thw=grid, video_grid_thw=full.video_grid_thw, second_per_grid_ts=full.second_per_grid_ts,
                  pixel_values=full.pixel_values[:rows] if keep and full.pixel_values is not None else None,
                  pixel_values_videos=full.pixel_values_videos, image_features=full.image_features[:keep],
                  video_features=full.video_features, image_deepstack=full.image_deepstack[:keep],
                  video_deepstack=full.video_deepstack, images=full.images)
