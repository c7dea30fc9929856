"""KL penalties to the reference policy, per action.

* :func:`k3_kl` -- TRL's k3 estimator on token / step log-probs (in :mod:`mmrl.core.losses`).
* :func:`flow_kl` -- Flow-GRPO's KL between the Gaussian step means of the policy and the reference
  (REFERENCE.md section 2), for flow-matching policies.
"""

from __future__ import annotations

import torch
from torch import Tensor


def flow_kl(mean: Tensor, ref_mean: Tensor, noise_scale: float | Tensor) -> Tensor:
    """Flow-GRPO's KL to the reference policy, per sample: ``mean_dims[(mean - ref_mean)^2] / (2 noise_scale^2)``.

    Mirrors Flow-GRPO (Liu et al. 2025, arXiv 2505.05470; ``train.beta > 0``), where the
    reference is the base model (LoRA adapters disabled) evaluated on the same ``x`` and
    ``noise_scale`` is the step's ``std_dev_t`` (:attr:`SDEStepOutput.noise_scale`). Note the
    anchor divides by ``sigma_t^2``, not by the transition variance ``std^2 = sigma_t^2 * (-dt)``,
    so this equals the exact Gaussian KL times ``-dt``. Undefined where ``noise_scale`` is 0
    (ode steps, the cps step to sigma = 0).

    Args:
        mean, ref_mean: ``[B, ...]`` step means of the policy and the reference.
        noise_scale: a float, a 0-dim, ``[B]`` or ``[B, 1, ..., 1]`` tensor.

    Returns:
        ``[B]`` float32.
    """
    if mean.shape != ref_mean.shape:
        raise ValueError(f"mean shape {tuple(mean.shape)} does not match ref_mean shape {tuple(ref_mean.shape)}")
    if mean.ndim < 2:
        raise ValueError(f"mean must be [B, ...] with at least one non-batch dim; got shape {tuple(mean.shape)}")
    sq = ((mean.float() - ref_mean.float().to(mean.device)) ** 2).mean(dim=tuple(range(1, mean.ndim)))
    ns = torch.as_tensor(noise_scale, dtype=torch.float32, device=mean.device)
    if ns.ndim > 0:
        if ns.numel() != ns.shape[0] or ns.shape[0] not in (1, mean.shape[0]):
            raise ValueError(
                f"noise_scale must be a scalar, [B] or [B, 1, ..., 1] with B={mean.shape[0]}; got shape {tuple(ns.shape)}"
            )
        ns = ns.reshape(-1)
    return sq / (2 * ns**2)
