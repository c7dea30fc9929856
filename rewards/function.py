"""A reward written as a TRL reward function, ported without changes.

TRL's ``GRPOTrainer(reward_funcs=[f])`` calls ``f(prompts=..., completions=..., completion_ids=..., **columns)`` and
reads back one float per completion, ``None`` where the reward does not apply (TRL's multi-task pattern). This
reward calls such a function on a VLM policy's completions (``rewards: {my_reward: {reward: function, kwargs:
{function: "my_rewards:length_reward"}}}``):

* ``completions``: the completion texts (``list[str]``, decoded without special tokens, as TRL decodes them);
* ``prompts``: the data set's questions (``list[str]``). Where TRL passes conversational data as messages
  (``[{"role": "assistant", "content": text}]`` completions, the chat as prompts), this passes the strings; a
  function that reads ``completion[0]["content"]`` wants ``conversational: true``, which wraps each completion as
  TRL does (the prompts stay the questions: mmrl builds the chat from ``generation.system_prompt`` and
  ``question_template``);
* every metadata key of the batch as a keyword list (``solution=[...]``, ``boxes=[...]``; a sample without the key
  gives ``None``), as TRL passes the data set's columns.

It returns ``[N]`` scores under the component's name. ``None`` from the function is NaN (``reward_combination:
nansum_then_normalize`` then scores the sample by the other rewards, TRL's rule), as is a non-finite value; the
reason is kept per sample. A function that raises, or returns the wrong number of values, stops the update with an
error naming it (as it does in TRL), rather than scoring the batch NaN.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch

from ._base import register_reward
from ._text import check_text_batch


def _resolve(function: str | Callable) -> Callable:
    if callable(function):
        return function
    if not isinstance(function, str) or ":" not in function:
        raise ValueError(f"function must be 'package.module:function_name' (or a callable), got {function!r}")
    from mmrl.config import import_attribute

    found = import_attribute(function)
    if not callable(found):
        raise ValueError(f"function {function!r} is {found!r}, not a callable")
    return found


@register_reward("function")
class FunctionReward:
    """A TRL-style reward function (``f(completions, prompts, **columns) -> list[float | None]``) as an mmrl
    reward; see the module docstring for what it is called with. ``function``: ``"package.module:name"`` or the
    callable itself; ``conversational``: pass each completion as TRL's ``[{"role": "assistant", "content": text}]``;
    ``kwargs``: fixed keyword arguments added to every call."""

    name = "function"
    needs_prompts = False
    scores_images = False  # judges completions (text)

    def __init__(self, function: str | Callable, conversational: bool = False, kwargs: Mapping | None = None):
        self.function = _resolve(function)
        self.label = function if isinstance(function, str) else getattr(function, "__qualname__", repr(function))
        self.conversational = bool(conversational)
        self.fixed = dict(kwargs or {})
        self.last_info: dict = {}

    @classmethod
    def check_arguments(cls, kwargs: Mapping[str, Any]) -> None:
        """Config-time check: the function imports and is callable; ``kwargs`` is a mapping."""
        _resolve(kwargs.get("function"))
        if not isinstance(kwargs.get("kwargs") or {}, Mapping):
            raise ValueError(f"kwargs must be a mapping of fixed keyword arguments, got {kwargs.get('kwargs')!r}")

    def __call__(self, completions, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        completions, prompts, metadata = check_text_batch(completions, prompts, metadata)
        n = len(completions)
        columns: dict[str, list] = {}
        for i, meta in enumerate(metadata):
            for key in meta if isinstance(meta, Mapping) else ():
                columns.setdefault(key, [None] * n)[i] = meta[key]
        reserved = {"completions", "prompts"} & set(columns)
        if reserved:
            raise ValueError(f"reward function {self.label}: metadata key(s) {sorted(reserved)} would shadow the "
                             f"completions / prompts arguments; rename them in the data")
        texts = [[{"role": "assistant", "content": t}] for t in completions] if self.conversational else completions
        try:
            values = self.function(completions=texts, prompts=list(prompts) if prompts is not None else [None] * n,
                                   **columns, **self.fixed)
        except Exception as exc:
            raise RuntimeError(f"reward function {self.label} failed: {type(exc).__name__}: {exc}") from exc
        if isinstance(values, torch.Tensor):
            values = values.reshape(-1).tolist()
        try:
            values = list(values)
        except TypeError:
            raise ValueError(f"reward function {self.label} returned {type(values).__name__}, not one value per "
                             f"completion") from None
        if len(values) != n:
            raise ValueError(f"reward function {self.label} returned {len(values)} values for {n} completions")
        scores = torch.full((n,), float("nan"))
        reasons: dict[int, str] = {}
        for i, value in enumerate(values):
            if value is None:
                reasons[i] = "the function returned None (TRL: the reward does not apply to this sample)"
                continue
            try:
                number = float(value)
            except (TypeError, ValueError):
                reasons[i] = f"the function returned {value!r}, not a number"
                continue
            if not math.isfinite(number):
                reasons[i] = f"the function returned a non-finite value {number}"
                continue
            scores[i] = number
        self.last_info = {"num_nan": len(reasons), "nan_samples": reasons}
        return {self.name: scores}
