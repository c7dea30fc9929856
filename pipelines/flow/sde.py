"""One reverse step of a rectified-flow sampler, with the step's Gaussian log-probability.

Conventions (diffusers rectified flow): ``x_sigma = (1 - sigma) * x0 + sigma * eps``, sigma runs
from 1 to 0, the model predicts the velocity ``v = eps - x0``; hence ``x0_hat = x - sigma * v`` and
``x1_hat = x + (1 - sigma) * v``. A step goes ``sigma -> sigma_next`` with ``dt = sigma_next - sigma < 0``.

Every kind turns the deterministic Euler step into a Gaussian transition
``x' ~ N(mean, std^2 I)`` whose log-density is what GRPO-style policy gradients need:

``kind="flow_grpo"``
    Flow-GRPO (Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL",
    arXiv 2505.05470), the anchor's ``sde_type="sde"`` (default noise level ``a = 0.7``)::

        sigma_t = a * sqrt(sigma / (1 - sigma))
        mean    = x * (1 + sigma_t^2 * dt / (2 sigma)) + v * (1 + sigma_t^2 * (1 - sigma) / (2 sigma)) * dt
        std     = sigma_t * sqrt(-dt)

    At ``sigma == 1`` the anchor replaces the ``sigma`` inside ``1 - sigma`` by the schedule's
    second sigma (``sigmas[1]``); pass that value as ``sigma_one_substitute``.
``kind="dance"``
    DanceGRPO (Xue et al. 2025, "DanceGRPO: Unleashing GRPO on Visual Generation",
    arXiv 2505.07818), the anchor's ``flux_step(..., sde_solver=True)`` with constant
    ``eta`` (default 0.3)::

        mean = x + dt * (v + eta^2 * (x + (1 - sigma) * v) / (2 sigma))
        std  = eta * sqrt(sigma - sigma_next)

``kind="cps"``
    Coefficients-Preserving Sampling (Wang & Yu 2025, arXiv 2509.05952) as Flow-GRPO's
    ``sde_type="cps"`` (default noise level ``a = 0.8``)::

        s    = sigma_next * sin(a * pi / 2)
        mean = (1 - sigma_next) * x0_hat + sqrt(sigma_next^2 - s^2) * x1_hat
        std  = s

``kind="ode"``
    Plain Euler: ``x' = x + dt * v``; no noise, no log-probability.

Log-probability (always a mean over all non-batch dims, which is why GRPO clip ranges for
flows are ~1e-4):

* ``flow_grpo`` and ``dance``: the full Gaussian log-density *with* its constants,
  ``mean_dims[-(x' - mean)^2 / (2 std^2) - log(std) - log(sqrt(2 pi))]``.
* ``cps``: the anchor's surrogate ``-mean_dims[(x' - mean)^2]``, with every constant
  (including the ``1 / (2 s^2)`` factor) dropped. It is *not* a normalised log-density; only
  differences between policies at the same step are meaningful.

As in the anchors, the sample inside the log-prob is detached: gradients reach the policy
only through ``mean``.

Everything is computed in float32 whatever the input dtype (the anchors do the same: bf16
overflows in the mean).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = [
    "SDE_KINDS",
    "DEFAULT_NOISE_LEVELS",
    "SDEStepOutput",
    "sde_step",
]

SDE_KINDS = ("flow_grpo", "dance", "cps", "ode")

#: The anchors' default noise level per kind (``a`` for Flow-GRPO "sde" and "cps", ``eta`` for
#: DanceGRPO). Used when ``sde_step(noise_level=None)``.
DEFAULT_NOISE_LEVELS = {"flow_grpo": 0.7, "dance": 0.3, "cps": 0.8, "ode": 0.0}

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)

Scalar = Union[float, int, Tensor]


@dataclass
class SDEStepOutput:
    """Result of :func:`sde_step` (all float32).

    Attributes:
        prev_sample: ``[B, ...]`` the next latent ``x'`` (sampled, or the ``prev_sample`` that
            was passed in).
        mean: ``[B, ...]`` the mean of the step's Gaussian transition.
        std: ``[B, 1, ..., 1]`` the real standard deviation of the step
            (flow_grpo: ``sigma_t * sqrt(-dt)``; dance: ``eta * sqrt(sigma - sigma_next)``;
            cps: ``s``; ode: 0).
        noise_scale: ``[B, 1, ..., 1]`` the scale Flow-GRPO's KL divides by, ``2 * noise_scale**2``
            (see :func:`mmrl.core.kl.flow_kl`): flow_grpo: the anchor's ``std_dev_t``, ``sigma_t``; cps: ``s``;
            ode: 0; dance: ``eta``, mmrl's rule (DanceGRPO has no KL term; its ``std_dev_t`` is the step's real
            std, ``eta * sqrt(sigma - sigma_next)``), so a dance KL is the exact Gaussian KL times ``-dt``, as
            for flow_grpo.
        log_prob: ``[B]`` log-probability of ``prev_sample`` averaged over the non-batch dims
            (surrogate for cps, see the module docstring); ``None`` for ``kind="ode"``.
    """

    prev_sample: Tensor
    mean: Tensor
    std: Tensor
    noise_scale: Tensor
    log_prob: Optional[Tensor]


def _per_sample(value: Scalar, name: str, batch: int, ndim: int, device: torch.device,
                dtype: torch.dtype = torch.float32) -> Tensor:
    """A python scalar, 0-dim, ``[1]`` or ``[B]`` tensor -> ``dtype`` (float32) ``[B or 1, 1, ..., 1]``."""
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.ndim == 0:
        t = t.reshape(1)
    elif t.ndim != 1 or t.shape[0] not in (1, batch):
        raise ValueError(
            f"{name} must be a python float, a 0-dim tensor or a [B] tensor with B={batch}; "
            f"got shape {tuple(t.shape)}"
        )
    return t.reshape(-1, *([1] * (ndim - 1)))


def _sample_noise(
    shape: torch.Size,
    device: torch.device,
    generator: Union[torch.Generator, Sequence[torch.Generator], None],
) -> Tensor:
    """Standard normal noise in float32. A generator living on another device (e.g. a CPU
    generator for CUDA latents) draws on its own device and the noise is moved, so that seeded
    noise does not depend on where the latents live; a list of generators draws one per sample."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}")
        return torch.cat([_sample_noise((1, *shape[1:]), device, g) for g in generator], dim=0)
    gen_device = generator.device if generator is not None else device
    noise = torch.randn(shape, generator=generator, device=gen_device, dtype=torch.float32)
    return noise.to(device)


def sde_step(
    sample: Tensor,
    model_output: Tensor,
    sigma: Scalar,
    sigma_next: Scalar,
    *,
    kind: str = "flow_grpo",
    noise_level: Optional[Scalar] = None,
    prev_sample: Optional[Tensor] = None,
    noise: Optional[Tensor] = None,
    generator: Union[torch.Generator, Sequence[torch.Generator], None] = None,
    sigma_one_substitute: Optional[Scalar] = None,
) -> SDEStepOutput:
    """One reverse step ``sigma -> sigma_next`` of a rectified flow, with its log-probability.

    Args:
        sample: ``[B, ...]`` current latent ``x`` at noise level ``sigma``.
        model_output: ``[B, ...]`` predicted velocity ``v = eps - x0`` (same shape as ``sample``).
        sigma, sigma_next: python floats, 0-dim tensors or ``[B]`` tensors with
            ``0 <= sigma_next < sigma <= 1``.
        kind: one of :data:`SDE_KINDS`; see the module docstring for the formulas and which
            anchor option each mirrors (``flow_grpo`` = Flow-GRPO ``sde_type="sde"``,
            ``dance`` = DanceGRPO ``flux_step(sde_solver=True)``, ``cps`` = Flow-GRPO
            ``sde_type="cps"``, ``ode`` = diffusers' Euler step).
        noise_level: ``a`` (flow_grpo, cps) or ``eta`` (dance); a float or a ``[B]`` tensor for
            per-sample levels. ``None`` takes the anchor's default for ``kind``
            (:data:`DEFAULT_NOISE_LEVELS`: 0.7, 0.3, 0.8). Ignored for ``ode``.
        prev_sample: if given, no sampling: the log-prob of this ``x'`` is evaluated (and it is
            returned, cast to float32, as ``prev_sample``).
        noise: ``[B, ...]`` standard normal noise to use instead of drawing it.
        generator: a ``torch.Generator`` (or one per sample) for drawing the noise.
        sigma_one_substitute: flow_grpo only: where ``sigma == 1`` the value put in place of
            ``sigma`` in the ``1 - sigma`` denominator; Flow-GRPO uses the schedule's second
            sigma ``sigmas[1]``. Required when any ``sigma == 1``.

    Returns:
        :class:`SDEStepOutput` with float32 tensors.
    """
    if kind not in SDE_KINDS:
        raise ValueError(f"unknown SDE kind {kind!r}; expected one of {SDE_KINDS}")
    if not isinstance(sample, Tensor) or not isinstance(model_output, Tensor):
        raise ValueError("sample and model_output must be tensors")
    if sample.ndim < 2:
        raise ValueError(f"sample must be [B, ...] with at least one non-batch dim; got shape {tuple(sample.shape)}")
    if model_output.shape != sample.shape:
        raise ValueError(
            f"model_output shape {tuple(model_output.shape)} does not match sample shape {tuple(sample.shape)}"
        )
    if prev_sample is not None and prev_sample.shape != sample.shape:
        raise ValueError(
            f"prev_sample shape {tuple(prev_sample.shape)} does not match sample shape {tuple(sample.shape)}"
        )
    if noise is not None:
        if prev_sample is not None:
            raise ValueError("pass either prev_sample (evaluate its log-prob) or noise (sample), not both")
        if noise.shape != sample.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} does not match sample shape {tuple(sample.shape)}")

    device = sample.device
    batch, ndim = sample.shape[0], sample.ndim
    x = sample.float()
    v = model_output.float().to(device)
    s = _per_sample(sigma, "sigma", batch, ndim, device)
    s_next = _per_sample(sigma_next, "sigma_next", batch, ndim, device)
    if not bool(torch.all(s_next < s)):
        raise ValueError(
            "sigma_next must be strictly smaller than sigma (the reverse process runs sigma from 1 to 0, "
            f"dt = sigma_next - sigma < 0); got sigma={sigma!r}, sigma_next={sigma_next!r}"
        )
    if not bool(torch.all(s_next >= 0)) or not bool(torch.all(s <= 1)):
        raise ValueError(
            f"rectified-flow sigmas must satisfy 0 <= sigma_next < sigma <= 1; got sigma={sigma!r}, "
            f"sigma_next={sigma_next!r}"
        )
    dt = s_next - s
    ones = torch.ones((batch,) + (1,) * (ndim - 1), dtype=torch.float32, device=device)

    if kind == "ode":
        mean = x + dt * v
        zero = torch.zeros_like(ones)
        out = mean if prev_sample is None else prev_sample.float().to(device)
        return SDEStepOutput(prev_sample=out, mean=mean, std=zero, noise_scale=zero, log_prob=None)

    # cps: Flow-GRPO takes the sine of its python-float noise level in float64 (math.sin), then scales in fp32
    level_dtype = torch.float32 if kind != "cps" or device.type == "mps" else torch.float64  # MPS has no float64
    a = _per_sample(DEFAULT_NOISE_LEVELS[kind] if noise_level is None else noise_level, "noise_level", batch, ndim,
                    device, level_dtype)
    if kind == "cps":
        if not bool(torch.all(a >= 0)):
            raise ValueError(f"noise_level must be >= 0 for kind='cps'; got {noise_level!r}")
    elif not bool(torch.all(a > 0)):
        raise ValueError(f"noise_level must be > 0 for kind={kind!r} (the log-prob divides by it); got {noise_level!r}")

    if kind == "flow_grpo":
        at_one = s == 1
        if bool(torch.any(at_one)):
            if sigma_one_substitute is None:
                raise ValueError(
                    "kind='flow_grpo' at sigma == 1 divides by 1 - sigma = 0; pass sigma_one_substitute "
                    "(Flow-GRPO uses the schedule's second sigma, sigmas[1]) to use in the 1 - sigma denominator"
                )
            sub = torch.as_tensor(sigma_one_substitute, dtype=torch.float32, device=device)
            if sub.numel() != 1 or not 0 <= float(sub) < 1:
                raise ValueError(f"sigma_one_substitute must be a scalar in [0, 1); got {sigma_one_substitute!r}")
            denom_sigma = torch.where(at_one, sub.reshape(()), s)
        else:
            denom_sigma = s
        sigma_t = torch.sqrt(s / (1 - denom_sigma)) * a
        mean = x * (1 + sigma_t**2 / (2 * s) * dt) + v * (1 + sigma_t**2 * (1 - s) / (2 * s)) * dt
        std = sigma_t * torch.sqrt(-dt)
        noise_scale = sigma_t
    elif kind == "dance":
        mean = x + dt * (v + a**2 * (x + (1 - s) * v) / (2 * s))
        std = a * torch.sqrt(s - s_next)
        noise_scale = a
    else:  # cps (a in float64, above)
        s_cps = s_next * torch.sin(a * (math.pi / 2)).float()
        x0_hat = x - s * v
        x1_hat = x + (1 - s) * v
        mean = x0_hat * (1 - s_next) + x1_hat * torch.sqrt(s_next**2 - s_cps**2)
        std = s_cps
        noise_scale = s_cps

    std = std * ones
    noise_scale = noise_scale * ones

    if prev_sample is None:
        eps = noise.float().to(device) if noise is not None else _sample_noise(x.shape, device, generator)
        prev = mean + std * eps
    else:
        prev = prev_sample.float().to(device)

    diff = prev.detach() - mean
    if kind == "cps":
        lp = -(diff**2)
    else:
        lp = -(diff**2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    log_prob = lp.mean(dim=tuple(range(1, ndim)))
    return SDEStepOutput(prev_sample=prev, mean=mean, std=std, noise_scale=noise_scale, log_prob=log_prob)
