"""Exponential moving average of the trainable weights, with Flow-GRPO's decay warm-up and update interval.

Anchor: Flow-GRPO (Liu et al. 2025, arXiv 2505.05470), ``flow_grpo/ema.py`` ``EMAModuleWrapper`` as
``scripts/train_sd3.py`` uses it: ``EMAModuleWrapper(trainable_parameters, decay=0.9, update_step_interval=8)`` and
``ema.step(trainable_parameters, global_step)``, where ``global_step`` is the number of optimizer steps taken so far
(incremented when ``accelerator.sync_gradients`` right before the call). Its ``step(parameters,
optimization_step)``:

* decay ``d = min((1 + optimization_step) / (10 + optimization_step), decay)`` (the warm-up is always on there);
* the EMA is updated only when ``(optimization_step + 1) % update_step_interval == 0``;
* the update is ``ema += (1 - d) * (param - ema)``.

:class:`EMA` does exactly this per call, with ``optimizer_step`` the same counter: the number of optimizer steps
taken, including the one just taken (1 after the first step). With ``update_interval=8`` the updates fall on optimizer
steps 7, 15, 23, ...; with the warm-up their decays are 8/17, 16/25, 24/33, ..., reaching ``decay`` = 0.9 from step
80 on. ``warmup=False`` (mmrl's default) uses ``decay`` from the first update; ``update_interval=1`` updates on
every step.

One difference in how it is *called*: Flow-GRPO's script calls ``ema.step`` after every training batch, also the
batches of a gradient-accumulation window that do not step the optimizer, so with ``k`` accumulation steps a
qualifying optimizer step gets ``k`` identical lerps (effective one-minus-decay ``1 - d^k``). mmrl's trainer calls
:meth:`EMA.update` once per optimizer step; it equals the anchor for ``train.gradient_accumulation_steps = 1``, and
calling ``update(params, optimizer_step)`` after every micro-batch with the unchanged step count reproduces the
anchor in the other cases too: ``optim.ema_every_minibatch`` makes the trainer do that.

Resume: :meth:`EMA.state_dict` holds the shadows, the step counter and the number of updates; :meth:`load_state_dict`
puts every shadow on its live parameter's device and in its dtype, at least fp32 (checkpoints are loaded on the
CPU), so the next ``lerp_`` never mixes devices. The configured decay, interval and warm-up
are kept on resume (as the anchor keeps its configured decay).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import torch

__all__ = ["EMA", "flow_grpo_decay"]


def _shadow_dtype(dtype: torch.dtype) -> torch.dtype:
    """The averages are kept in at least fp32: a bf16 / fp16 weight (full fine-tuning in half precision, or a
    DeepSpeed bf16 engine, which casts the module before the EMA is built) averaged in its own dtype loses the small
    ``(1 - d) * (param - ema)`` steps (decay 0.999: the bf16 average 56 % off the fp32 one, it stalls). Flow-GRPO
    builds its EMA from the fp32 weights before ``accelerator.prepare``."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def flow_grpo_decay(decay: float, optimizer_step: int) -> float:
    """Flow-GRPO's warmed-up decay ``min((1 + s) / (10 + s), decay)`` at optimizer step ``s``
    (``EMAModuleWrapper.get_current_decay``)."""
    return min((1 + optimizer_step) / (10 + optimizer_step), decay)


class EMA:
    """Exponential moving average of named parameters (trainer: ``policy.named_trainable_parameters()``).

    Args:
        params: ``{name: parameter}``; the shadows start as detached copies (same device; bf16 / fp16 ones in
            fp32, :func:`_shadow_dtype`).
        decay: the EMA decay (``optim.ema_decay``; Flow-GRPO: 0.9).
        update_interval: update only when ``(optimizer_step + 1) % update_interval == 0``
            (``optim.ema_update_interval``; Flow-GRPO: 8).
        warmup: use Flow-GRPO's ``min((1 + s) / (10 + s), decay)`` at optimizer step ``s`` (``optim.ema_warmup``).

    ``shadow`` is the ``{name: tensor}`` of averaged weights; ``optimizer_step`` the last step count seen by
    :meth:`update`; ``num_updates`` how many updates changed the shadows.
    """

    def __init__(self, params: Mapping[str, torch.nn.Parameter], decay: float, *, update_interval: int = 1,
                 warmup: bool = False):
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must lie in [0, 1], got {decay}")
        if int(update_interval) < 1:
            raise ValueError(f"EMA update_interval must be >= 1, got {update_interval}")
        self.decay = float(decay)
        self.update_interval = int(update_interval)
        self.warmup = bool(warmup)
        self.shadow: dict[str, torch.Tensor] = {k: p.detach().to(dtype=_shadow_dtype(p.dtype), copy=True)
                                                for k, p in params.items()}
        self.optimizer_step = 0
        self.num_updates = 0

    def current_decay(self, optimizer_step: int) -> float:
        """The decay an update at ``optimizer_step`` uses."""
        return flow_grpo_decay(self.decay, optimizer_step) if self.warmup else self.decay

    def due(self, optimizer_step: int) -> bool:
        """Whether an update happens at ``optimizer_step`` (Flow-GRPO: ``(step + 1) % interval == 0``)."""
        return (optimizer_step + 1) % self.update_interval == 0

    @torch.no_grad()
    def update(self, params: Mapping[str, torch.nn.Parameter], optimizer_step: int | None = None) -> bool:
        """Call after each optimizer step. ``optimizer_step``: the number of optimizer steps taken so far, this one
        included (the trainer's ``optimizer_steps``); ``None`` counts them here (last count + 1). Returns whether the
        shadows were updated: ``shadow += (1 - d) * (param - shadow)`` with ``d = current_decay(step)``, only when
        :meth:`due`."""
        self.optimizer_step = self.optimizer_step + 1 if optimizer_step is None else int(optimizer_step)
        if not self.due(self.optimizer_step):
            return False
        weight = 1.0 - self.current_decay(self.optimizer_step)
        for k, p in params.items():
            shadow = self.shadow[k]
            shadow.lerp_(p.detach().to(device=shadow.device, dtype=shadow.dtype), weight)
        self.num_updates += 1
        return True

    @contextmanager
    def swapped_in(self, params: Mapping[str, torch.nn.Parameter]) -> Iterator[None]:
        """Inside the block ``params`` hold the shadows (for evaluation and export); their live values are put
        back afterwards."""
        live = {k: p.detach().clone() for k, p in params.items()}
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(self.shadow[k])
        try:
            yield
        finally:
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(live[k])

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "update_interval": self.update_interval, "warmup": self.warmup,
                "optimizer_step": self.optimizer_step, "num_updates": self.num_updates, "shadow": self.shadow}

    def load_state_dict(self, state: Mapping[str, Any], params: Mapping[str, torch.nn.Parameter] | None = None
                        ) -> None:
        """Restore the shadows and counters from :meth:`state_dict`.

        Every shadow is moved to its live parameter's device and dtype (at least fp32): those of ``params`` (pass
        the live ``policy.named_trainable_parameters()``), or without ``params`` those of the current shadows, which
        were copied from the live parameters at construction. The configured decay, interval and warm-up are kept. A
        state from before the counter was saved (only ``decay`` and ``shadow``) resumes with the counter at 0.
        """
        target = params if params is not None else self.shadow
        loaded = state["shadow"]
        missing, unexpected = set(target) - set(loaded), set(loaded) - set(target)
        if missing or unexpected:
            raise ValueError(f"EMA state does not match the parameters: missing {sorted(missing)[:3]}, "
                             f"unexpected {sorted(unexpected)[:3]} (another model or LoRA setup?)")
        shadow = {}
        for k, ref in target.items():
            value = loaded[k]
            if value.shape != ref.shape:
                raise ValueError(f"EMA state {k!r} has shape {tuple(value.shape)}, the parameter {tuple(ref.shape)}")
            shadow[k] = value.detach().to(device=ref.device, dtype=_shadow_dtype(ref.dtype), copy=True)
        self.shadow = shadow
        self.optimizer_step = int(state.get("optimizer_step", 0))
        self.num_updates = int(state.get("num_updates", 0))
