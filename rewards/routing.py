"""Per-task reward routing (Mixed-R1): each sample's task type selects its rewards and weights.

Mixed-R1 (Xu et al., "Mixed-R1: Unified Reward Perspective For Reasoning Capability in Multimodal
Large Language Models", arXiv:2505.24164) trains one policy on a mixture of tasks and scores each
sample with the reward of its own task type (matching for yes/no and multiple choice, a chart reward,
IoU for grounding, an open-ended similarity for captions), plus a format reward.
:class:`TaskRoutedReward` does that for any mmrl rewards::

    reward = TaskRoutedReward(
        routes={
            "grounding": {"iou": 1.0, "think_answer_format": 0.5},
            "counting": {"numeric_fuzzy": 1.0, "think_answer_format": 0.5},
            "mc": {"choice_accuracy": 1.0, "think_answer_format": 0.5},
        },
        default=None,   # or a route ({reward: weight}) or the name of a task in ``routes``
    )
    scores = reward(completions, prompts, metadata)   # metadata[i]["task"] picks the route

Route entries take the same forms as :func:`~mmrl.rewards.compose.build_rewards`: ``name: weight`` or
``name: {"weight": w, "kwargs": {...}, "reward": registered_name}``. A key means one reward object,
built once: the same key in several routes must have the same registered name and kwargs (its weight
may differ per task); use two keys for two settings.

Output: every component under its key (NaN for samples whose route does not include it), extra keys
as ``"<key>/<extra>"``, and ``"total"``: the sum of each sample's own route's weighted components. A
sample whose route has a NaN component, or whose task has no route (and no ``default``), gets a NaN
total with the reason in ``last_info["total"]``. Each component is called once per call, on the
samples that use it. Spans (span-scoped credit): a component's reported spans come back per sample of the call in
``last_info["components"][key]["spans"]``, and ``last_info["spans"]`` holds the total's: per sample the union of its
route's (non-zero weight) components' spans, ``None`` where one of them reported none (it is about the whole response),
so ``cspo`` / ``span_scoped`` can scope a routed reward. ``weights == {"total": 1.0}``: the trainer normalises the routed total.
Registered as ``task_routed`` with kwargs ``routes`` and ``default``.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Mapping, Sequence

import torch

from ._base import _info, build_reward, register_reward
from ._text import combined_spans
from .compose import parse_reward_spec

__all__ = ["TaskRoutedReward"]

_REMAP = ("nan_samples", "unparseable_samples")


def _take(outputs: Any, idx: list[int]) -> Any:
    if isinstance(outputs, torch.Tensor):
        return outputs.index_select(0, torch.tensor(idx, dtype=torch.long, device=outputs.device))
    if isinstance(outputs, (list, tuple)):
        return [outputs[i] for i in idx]
    raise TypeError(
        f"TaskRoutedReward needs outputs it can index per sample (a list or a tensor), got {type(outputs).__name__}"
    )


def _length(x: Any, what: str) -> int:
    if isinstance(x, torch.Tensor):
        return int(x.shape[0])
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise ValueError(f"{what} must be a list with one entry per sample, got {type(x).__name__}")
    return len(x)


@register_reward("task_routed")
class TaskRoutedReward:
    """Rewards and weights chosen per sample by ``metadata[i]["task"]`` (see the module docstring)."""

    scores_images = False  # routes text rewards by task

    name = "total"

    def __init__(self, routes: Mapping[str, Mapping[str, Any]], default: Mapping[str, Any] | str | None = None):
        if not isinstance(routes, Mapping) or not routes:
            raise ValueError(f"routes must be a non-empty mapping task -> {{reward: weight}}, got {routes!r}")
        specs: dict[str, tuple[str, dict]] = {}  # key -> (registered name, kwargs)
        self.routes: dict[str, dict[str, float]] = {}
        for task, route in routes.items():
            self.routes[str(task)] = self._parse_route(f"routes[{task!r}]", route, specs)
        if isinstance(default, str):
            if default not in self.routes:
                raise ValueError(f"default {default!r} is not a task in routes ({', '.join(self.routes)})")
            self.default: dict[str, float] | None = self.routes[default]
        elif default is None:
            self.default = None
        else:
            self.default = self._parse_route("default", default, specs)
        self.components = {key: build_reward(reg, **kwargs) for key, (reg, kwargs) in specs.items()}
        self.needs_prompts = any(getattr(r, "needs_prompts", True) for r in self.components.values())
        self.last_info: dict = {}

    @staticmethod
    def _parse_route(where: str, route: Any, specs: dict[str, tuple[str, dict]]) -> dict[str, float]:
        if not isinstance(route, Mapping) or not route:
            raise ValueError(f"{where} must be a non-empty mapping reward -> weight, got {route!r}")
        weights: dict[str, float] = {}
        for key, entry in route.items():
            if key == "total" or "/" in key:
                raise ValueError(f"{where}: reward key {key!r} is reserved or contains '/'")
            reg, kwargs, weight = parse_reward_spec(key, entry)
            weight = float(weight)
            if not math.isfinite(weight):
                raise ValueError(f"{where}[{key!r}] has a non-finite weight {weight}")
            if key in specs and specs[key] != (reg, kwargs):
                raise ValueError(
                    f"{where}[{key!r}] is {reg!r} with {kwargs}, but another route uses the key {key!r} for "
                    f"{specs[key][0]!r} with {specs[key][1]}; give the two settings different keys"
                )
            specs[key] = (reg, kwargs)
            weights[key] = weight
        return weights

    @property
    def weights(self) -> dict[str, float]:
        """What the trainer normalises: the routed total, with weight 1."""
        return {"total": 1.0}

    @property
    def task_weights(self) -> dict[str, dict[str, float]]:
        """Each task's reward weights (``"*"`` for the default route, when there is one)."""
        out = {task: dict(w) for task, w in self.routes.items()}
        if self.default is not None:
            out["*"] = dict(self.default)
        return out

    def _route(self, meta: Any) -> tuple[str | None, dict[str, float] | None, str | None]:
        """``(task, route, reason_if_unrouted)`` for one sample's metadata."""
        task = meta.get("task") if isinstance(meta, Mapping) else None
        if task is not None and not isinstance(task, str):
            return None, None, f"metadata 'task' is not a string (got {type(task).__name__})"
        if task in self.routes:
            return task, self.routes[task], None
        if self.default is not None:
            return task, self.default, None
        if task is None:
            return None, None, "metadata has no 'task' and there is no default route"
        return task, None, f"no route for task {task!r} (routes: {', '.join(self.routes)})"

    def __call__(self, outputs, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        n = _length(outputs, "outputs")
        if prompts is not None and _length(prompts, "prompts") != n:
            raise ValueError(f"got {n} outputs but {len(prompts)} prompts; they must match")
        if prompts is None and self.needs_prompts:
            raise ValueError("a routed reward needs one prompt per sample, but prompts=None was passed")
        if metadata is not None and _length(metadata, "metadata") != n:
            raise ValueError(f"got {n} outputs but {len(metadata)} metadata entries; they must match")
        metas = list(metadata) if metadata is not None else [None] * n

        tasks, routes, reasons = [], [], {}
        for i, meta in enumerate(metas):
            task, route, why = self._route(meta)
            tasks.append(task)
            routes.append(route)
            if why is not None:
                reasons[i] = why

        out: dict[str, torch.Tensor] = {}
        comp_info: dict[str, dict] = {}
        for key, reward in self.components.items():
            idx = [i for i in range(n) if routes[i] is not None and key in routes[i]]
            main = torch.full((n,), float("nan"), dtype=torch.float32)
            extras: dict[str, torch.Tensor] = {}
            info: dict = {"num_samples": 0}
            if idx:
                scores = reward(
                    _take(outputs, idx),
                    _take(prompts, idx) if prompts is not None else None,
                    _take(metas, idx) if metadata is not None else None,
                )
                main_key = getattr(reward, "name", key)
                if main_key not in scores:
                    raise KeyError(f"route reward {key!r} returned keys {sorted(scores)}, without its main key {main_key!r}")
                where = torch.tensor(idx, dtype=torch.long)
                for k, values in scores.items():
                    full = main if k == main_key else extras.setdefault(k, torch.full((n,), float("nan")))
                    full[where] = values.detach().to("cpu", torch.float32).reshape(-1)
                info = dict(getattr(reward, "last_info", {}) or {})
                for field in _REMAP:
                    if isinstance(info.get(field), Mapping):
                        info[field] = {idx[j]: why for j, why in info[field].items()}
                if info.get("spans") is not None:  # per routed sample -> per sample of the call (None elsewhere)
                    spans: list = [None] * n
                    for j, reported in zip(idx, info["spans"]):
                        spans[j] = reported
                    info["spans"] = spans
            out[key] = main
            for k, values in extras.items():
                out[f"{key}/{k}"] = values
            comp_info[key] = info

        total = torch.full((n,), float("nan"), dtype=torch.float32)
        for i, route in enumerate(routes):
            if route is None:
                continue
            value = 0.0
            for key, weight in route.items():
                if weight == 0.0:
                    continue  # logged only, never poisons the total
                v = float(out[key][i])
                if math.isnan(v):
                    why = comp_info[key].get("nan_samples", {}).get(i, "NaN score")
                    reasons.setdefault(i, f"{key}: {why}")
                value += weight * v
            total[i] = value
        out["total"] = total
        self.last_info = {
            "total": _info(n, reasons),
            "components": comp_info,
            "tasks": dict(Counter(t if t is not None else "(none)" for t in tasks)),
            "num_unrouted": sum(1 for r in routes if r is None),
        }
        if any(info.get("spans") is not None for info in comp_info.values()):
            # each sample's total is the sum over its own route: its spans combine that route's components'
            spans = [None] * n
            for i, route in enumerate(routes):
                if route is not None:
                    reported = [comp_info[k].get("spans") for k, w in route.items() if w != 0.0]
                    merged = combined_spans([None if s is None else s[i:i + 1] for s in reported], 1)
                    spans[i] = merged[0] if merged else None
            self.last_info["spans"] = spans
        return out

    def __repr__(self) -> str:
        return f"TaskRoutedReward(tasks={list(self.routes)}, default={'yes' if self.default is not None else 'none'})"
