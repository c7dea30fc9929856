"""Weighted composition of several rewards.

``ComposedReward({"pickscore": (pick, 1.0), "jpeg_compressibility": (jpeg, 0.1)})`` returns every
component's main score under its component name, each component's extra keys as
``"<component>/<key>"``, and ``"total"``: the weighted sum over components with a non-zero
weight. A NaN in any weighted component makes that sample's total NaN (the sample could not be
judged); a component with weight 0 is only logged and never poisons the total. ``weights``
lists the components that enter the total (what the trainer normalises); ``all_weights`` all.

The batch is validated and converted once (tensor <-> PIL) and shared by all components; each
component object is called exactly once per call, even if it appears under several names.

Text outputs (a vision-language policy's completions: a list of strings) take the text path: the
shapes are checked (:func:`~mmrl.rewards._text.check_text_batch`) and the completions, prompts and
metadata are passed straight to every component, which reads them itself.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

from ._base import Reward, RewardFn, _info, build_reward, nearest, prepare_batch
from ._text import check_text_batch, combined_spans, is_text_batch

__all__ = ["ComposedReward", "build_rewards", "parse_reward_spec"]


class ComposedReward:
    """Several rewards and their weights, scored together (see the module docstring)."""

    name = "total"

    def __init__(self, components: Mapping[str, tuple[RewardFn, float]]):
        if not components:
            raise ValueError("ComposedReward needs at least one component")
        self.components: dict[str, tuple[RewardFn, float]] = {}
        for key, value in components.items():
            if key == "total" or "/" in key:
                raise ValueError(f"component name {key!r} is reserved or contains '/'")
            try:
                reward, weight = value
            except (TypeError, ValueError):
                raise ValueError(
                    f"component {key!r} must be a (reward, weight) pair, got {value!r}"
                ) from None
            if not callable(reward):
                raise TypeError(f"component {key!r}: {reward!r} is not callable")
            weight = float(weight)
            if not math.isfinite(weight):
                raise ValueError(f"component {key!r} has a non-finite weight {weight}")
            self.components[key] = (reward, weight)
        self.needs_prompts = any(getattr(r, "needs_prompts", True) for r, _ in self.components.values())
        self.last_info: dict = {}

    @property
    def weights(self) -> dict[str, float]:
        """The components that enter the total (and the advantage), with their weights; a
        weight-0 component is logged only and left out here."""
        return {k: w for k, (_, w) in self.components.items() if w != 0.0}

    @property
    def all_weights(self) -> dict[str, float]:
        """Every component's weight, zero weights included."""
        return {k: w for k, (_, w) in self.components.items()}

    def __call__(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        """Score ``images`` (an image batch) or completions (a list of strings, the text path)."""
        if isinstance(images, (list, tuple)) and (not images or is_text_batch(images)):
            completions, _, _ = check_text_batch(images, prompts, metadata)
            if self.needs_prompts and prompts is None:
                raise ValueError("a component needs one prompt per sample, but prompts=None was passed")
            n = len(completions)

            def score(reward):  # text rewards read the completions themselves
                return reward(images, prompts, metadata)
        else:
            batch = prepare_batch(images, prompts, metadata, needs_prompts=self.needs_prompts)
            n = batch.n

            def score(reward):  # mmrl rewards take the prepared batch (shared conversions); others the inputs
                return reward(batch if isinstance(reward, Reward) else images, batch.prompts, batch.metadata)

        results: dict[int, tuple[dict[str, torch.Tensor], dict]] = {}
        out: dict[str, torch.Tensor] = {}
        comp_info: dict[str, dict] = {}
        total = torch.zeros(n, dtype=torch.float32)
        reasons: dict[int, str] = {}
        for key, (reward, weight) in self.components.items():
            main_key = getattr(reward, "name", key)
            if id(reward) not in results:  # the same object under two names is called once
                scores = _checked_scores(score(reward), key, reward, main_key, n)
                results[id(reward)] = (scores, dict(getattr(reward, "last_info", {}) or {}))
            scores, info = results[id(reward)]
            if main_key not in scores:
                raise KeyError(
                    f"component {key!r} returned keys {sorted(scores)}, without its main key {main_key!r}"
                )
            main = scores[main_key].to("cpu", torch.float32)
            out[key] = main
            for extra, values in scores.items():
                if extra != main_key:
                    out[f"{key}/{extra}"] = values
            comp_info[key] = info
            if weight != 0.0:
                total = total + weight * main
                for i in torch.isnan(main).nonzero().flatten().tolist():
                    why = info.get("nan_samples", {}).get(i, "NaN score")
                    reasons.setdefault(i, f"{key}: {why}")
        out["total"] = total
        self.last_info = {"total": _info(n, reasons), "components": comp_info}
        spans = combined_spans([comp_info[key].get("spans") for key, (_, w) in self.components.items() if w != 0.0], n)
        if spans is not None:  # the total's spans (a served composition reports them to its client)
            self.last_info["spans"] = spans
        return out

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}: {w:g}" for k, w in self.all_weights.items())
        return f"ComposedReward({{{parts}}})"


def _checked_scores(scores, key: str, reward, main_key: str, n: int) -> dict:
    """A component's output as ``{name: [n] tensor}``, or a ``ValueError`` naming the component, what it returned
    and the ``n`` expected (a list of the wrong length, a string or an ``[n, 1]`` tensor failed deep in the
    composition or, broadcast to ``[n, n]``, in the advantages). A bare list / array / tensor is the main score
    (what a TRL reward function returns; ``None`` entries read as NaN, unscored)."""
    what = f"rewards.{key} ({type(reward).__name__})"
    if not isinstance(scores, Mapping):
        if isinstance(scores, (str, bytes)) or not hasattr(scores, "__len__"):
            raise ValueError(f"{what} returned a {type(scores).__name__}; expected {{{main_key!r}: [{n}] scores}} "
                             f"or a list of {n} numbers, one per sample")
        scores = {main_key: scores}
    out = {}
    for name, values in scores.items():
        if not isinstance(values, torch.Tensor):
            try:
                if isinstance(values, (list, tuple)):
                    values = [float("nan") if v is None else v for v in values]
                values = torch.as_tensor(values, dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError) as exc:
                if name != main_key:  # an extra (logged) entry of another kind is kept as it is
                    out[name] = values
                    continue
                raise ValueError(f"{what} returned {name!r} scores that are not numbers: {exc}") from None
        if name == main_key and (values.dim() != 1 or len(values) != n):
            raise ValueError(f"{what} returned {name!r} scores of shape {tuple(values.shape)} for {n} samples; "
                             f"expected [{n}], one score per sample")
        out[name] = values
    return out


_SPEC_KEYS = ("weight", "kwargs", "reward")


def build_rewards(spec: Mapping[str, float | Mapping]) -> ComposedReward:
    """Build a :class:`ComposedReward` from a config mapping.

    Each entry is ``name: weight`` or ``name: {"weight": w, "kwargs": {...}, "reward": reg_name}``
    (``weight`` defaults to 1.0, ``kwargs`` to ``{}``, ``reward`` to ``name``; ``reward`` lets the
    same registered reward appear twice with different settings). Examples::

        build_rewards({"jpeg_compressibility": 1.0})
        build_rewards({"pickscore": {"weight": 1.0, "kwargs": {"scale_divisor": 26}}})
    """
    if not isinstance(spec, Mapping) or not spec:
        raise ValueError(f"reward spec must be a non-empty mapping name -> weight | dict, got {spec!r}")
    components = {}
    for key, entry in spec.items():
        reg_name, kwargs, weight = parse_reward_spec(key, entry)
        try:
            components[key] = (build_reward(reg_name, **kwargs), weight)
        except RewardBuildError:
            raise
        except (TypeError, ValueError) as exc:  # the constructor refusing a value: name the component
            raise RewardBuildError(key, exc) from exc
    return ComposedReward(components)


class RewardBuildError(ValueError):
    """A reward's constructor refusing its arguments, naming the component (``rewards.<key>``) and the cause."""

    def __init__(self, key: str, cause: BaseException):
        super().__init__(f"rewards.{key}: {type(cause).__name__}: {cause}")
        self.key, self.cause = key, cause


def parse_reward_spec(key: str, entry: float | Mapping) -> tuple[str, dict, float]:
    """One entry of a reward spec -> ``(registered name, kwargs, weight)`` (see :func:`build_rewards`)."""
    if isinstance(entry, Mapping):
        for k in entry:
            if k not in _SPEC_KEYS:
                close = nearest(k, _SPEC_KEYS)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(
                    f"reward spec {key!r} has unknown key {k!r}; {hint}valid keys: {', '.join(_SPEC_KEYS)}"
                )
        return entry.get("reward", key), dict(entry.get("kwargs") or {}), entry.get("weight", 1.0)
    if isinstance(entry, (int, float)) and not isinstance(entry, bool):
        return key, {}, entry
    raise ValueError(f"reward spec {key!r} must be a weight or a dict with {_SPEC_KEYS}, got {entry!r}")
