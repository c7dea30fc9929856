"""Character spans of a completion's text -> masks over its sampled tokens (span-scoped credit).

A reward can say which part of a response it is about: besides its ``[N]`` score it reports, per sample, character
spans ``[(start, end), ...]`` into the completion text (``last_info["spans"]``). A span-scoped variant then applies that
component's advantage only on the tokens of its spans. The texts the rewards read are ``tokenizer.batch_decode(ids,
skip_special_tokens=True)`` of the sampled ids, so the mapping must follow THOSE ids, not a re-tokenisation:

* when re-encoding the text gives back exactly the sampled ids (the usual case), the fast tokenizer's
  ``offset_mapping`` gives each token's characters;
* otherwise (a sampler may produce non-canonical token sequences) each token's characters come from decoding the
  prefixes: token ``t`` covers ``[c(t), c(t+1))`` with ``c(t)`` the number of complete characters the first ``t`` tokens
  decode to (the common prefix of ``decode(ids[:t])`` and the full text, so a trailing partial UTF-8 byte sequence,
  decoded as U+FFFD, does not count). A token that completes no character (one byte of a multi-byte character) covers
  the character it belongs to, so every byte of a multi-byte character is in the character's spans.

A token is in a span when its characters overlap ``[start, end)``. Special tokens (the end-of-turn token) decode to
nothing and are in no span. Padding (``mask == 0``) is never in a span.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor

from mmrl.rewards._text import ANSWER_BLOCK, THINK_BLOCK

Span = tuple[int, int]

#: named regions of a ``<think>...</think><answer>...</answer>`` response, for variants that scope a reward by region
REGIONS = ("all", "answer", "think", "outside_answer")
_TAGS = {"answer": ANSWER_BLOCK, "think": THINK_BLOCK}


def region_spans(text: str, region: str) -> list[Span]:
    """Character spans of ``region`` in ``text``: ``all`` (the whole text), ``answer`` / ``think`` (the contents of every
    ``<answer>`` / ``<think>`` block; none when the tag is absent), ``outside_answer`` (everything but the answer
    blocks' contents)."""
    if region not in REGIONS:
        raise ValueError(f"unknown region {region!r}; expected one of {REGIONS}")
    if region == "all":
        return [(0, len(text))] if text else []
    if region in _TAGS:
        return [(m.start(1), m.end(1)) for m in _TAGS[region].finditer(text) if m.end(1) > m.start(1)]
    spans, cursor = [], 0
    for start, end in region_spans(text, "answer"):
        if start > cursor:
            spans.append((cursor, start))
        cursor = end
    if cursor < len(text):
        spans.append((cursor, len(text)))
    return spans


def token_char_ranges(tokenizer, ids: Sequence[int], text: str | None = None) -> list[Span]:
    """``(start, end)`` characters of ``text`` (default: the decoded ``ids``) that each token of ``ids`` covers (module
    docstring); special tokens get an empty range at the end of what precedes them."""
    ids = list(ids)
    if text is None:
        text = tokenizer.decode(ids, skip_special_tokens=True)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        content = [i for i in ids if i not in special]
        if encoded["input_ids"] == content:
            offsets = iter(encoded["offset_mapping"])
            ranges, last = [], 0
            for i in ids:
                if i in special:
                    ranges.append((last, last))
                else:
                    start, end = next(offsets)
                    ranges.append((start, end))
                    last = end
            return ranges
    ranges, before = [], 0
    for t in range(len(ids)):
        if ids[t] in special:
            ranges.append((before, before))
            continue
        prefix = tokenizer.decode(ids[:t + 1], skip_special_tokens=True)
        after = len(os.path.commonprefix([prefix, text]))
        ranges.append((before, after) if after > before else (before, min(before + 1, len(text))))
        before = max(before, after)
    return ranges


def spans_to_token_mask(tokenizer, completion_ids: Tensor, mask: Tensor, texts: Sequence[str],
                        spans: Sequence[Sequence[Span] | None]) -> Tensor:
    """``[N, T]`` float mask: 1 where a sampled token overlaps one of its sample's character ``spans`` (``None`` or
    ``[]``: no token). ``texts`` are the completions the spans index (the decoded sampled ids)."""
    if not (len(texts) == len(spans) == completion_ids.shape[0]):
        raise ValueError(f"{completion_ids.shape[0]} completions, {len(texts)} texts and {len(spans)} span lists")
    out = torch.zeros(completion_ids.shape, dtype=torch.float32)
    for i, sample_spans in enumerate(spans):
        if not sample_spans:
            continue
        length = int(mask[i].sum())
        for t, (start, end) in enumerate(token_char_ranges(tokenizer, completion_ids[i, :length].tolist(), texts[i])):
            if end > start and any(start < e and s < end for s, e in sample_spans):
                out[i, t] = 1.0
    return out
