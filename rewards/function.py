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


#: what TRL 1.16 passes and mmrl does not: a function that needs one of these cannot run unchanged
NOT_PASSED = ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


def _needs_unpassed(function: Callable) -> list[str]:
    """The parameters of ``function`` that TRL passes, mmrl does not, and the function requires (no default)."""
    import inspect

    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature: not checked
        return []
    return [n for n in NOT_PASSED if n in params and params[n].default is inspect.Parameter.empty
            and params[n].kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]


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
        self.check_arguments({"function": function, "conversational": conversational, "kwargs": kwargs})
        self.function = _resolve(function)
        self.label = function if isinstance(function, str) else getattr(function, "__qualname__", repr(function))
        self.conversational = conversational
        self.fixed = dict(kwargs or {})
        self.last_info: dict = {}

    @classmethod
    def check_arguments(cls, kwargs: Mapping[str, Any]) -> None:
        """Config-time check: the function imports, is callable and requires nothing mmrl does not pass;
        ``conversational`` is a boolean; ``kwargs`` a mapping."""
        function = _resolve(kwargs.get("function"))
        missing = _needs_unpassed(function)
        if missing:
            raise ValueError(f"function {kwargs.get('function')!r} requires {', '.join(missing)}, which TRL passes and "
                             f"mmrl does not (it passes completions, prompts and the data's columns); give "
                             f"{'it a default' if len(missing) == 1 else 'them defaults'} or read what it needs from "
                             f"the columns")
        if not isinstance(kwargs.get("conversational", False), bool):
            raise ValueError(f"conversational must be true or false, got {kwargs.get('conversational')!r}")
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
            hint = ""
            if isinstance(exc, KeyError) and exc.args and exc.args[0] in NOT_PASSED:
                hint = f" (TRL passes {exc.args[0]}; mmrl passes completions, prompts and the data's columns)"
            raise RuntimeError(f"reward function {self.label} failed: {type(exc).__name__}: {exc}{hint}") from exc
        values = self._one_per_completion(values, n)
        scores = torch.full((n,), float("nan"))
        reasons: dict[int, str] = {}
        for i, value in enumerate(values):
            if value is None:
                reasons[i] = "the function returned None (TRL: the reward does not apply to this sample)"
            elif not math.isfinite(value):
                reasons[i] = f"the function returned a non-finite value {value}"
            else:
                scores[i] = value
        self.last_info = {"num_nan": len(reasons), "nan_samples": reasons}
        return {self.name: scores}

    def _one_per_completion(self, values: Any, n: int) -> list[float | None]:
        """``values`` as ``n`` floats or None, as TRL reads them (``torch.tensor(list, dtype=float32)``): a list,
        tuple, 1-D array or tensor of numbers (bools count) and None; anything else is an error naming the
        function (a string, a mapping, a 2-D array: TRL raises on them too, or reads them wrongly)."""
        import numpy as np

        what = f"reward function {self.label} returned"
        if isinstance(values, (torch.Tensor, np.ndarray)):
            if values.ndim != 1:
                raise ValueError(f"{what} an array of shape {tuple(values.shape)}; expected one value per completion, "
                                 f"shape ({n},)")
            values = values.tolist()
        elif isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__iter__"):
            raise ValueError(f"{what} {type(values).__name__}; expected a list of {n} numbers (None: does not apply)")
        values = list(values)
        if len(values) != n:
            raise ValueError(f"{what} {len(values)} values for {n} completions")
        out: list[float | None] = []
        for i, value in enumerate(values):
            if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
                value = value.item()
            if value is not None and not isinstance(value, (int, float, np.number, np.bool_)):
                raise ValueError(f"{what} {value!r} for completion {i}; expected a number or None")
            out.append(None if value is None else float(value))
        return out
