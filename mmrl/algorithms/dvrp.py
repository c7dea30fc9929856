"""DVRP (Thinking with Deltas): sensitive to the image's removal, robust to its small perturbation."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from mmrl.algorithms.base import TransformContext, option, register
from mmrl.algorithms.visual import VisualDependence


@dataclass
class DVRPOptions:
    divergence_weight: float = option(0.1, "alpha: weight of the per-token divergence from the masked input "
                                           "log p(y|image) - log p(y|grey).")
    consistency_weight: float = option(0.1, "beta: weight of the per-token divergence from the perturbed input "
                                            "|log p(y|image) - log p(y|perturbed)|.")
    noise_std: float = option(0.1, "Std of the Gaussian noise added to the normalised pixels for the perturbed input.")
    clip: float = option(1.0, "Each per-token divergence is clipped to [-clip, clip] nats before weighting.")

    def validate(self) -> None:
        if self.divergence_weight < 0 or self.consistency_weight < 0:
            raise ValueError("divergence_weight and consistency_weight must be >= 0")
        if self.noise_std <= 0 or self.clip <= 0:
            raise ValueError("noise_std and clip must be > 0")


@register
class DVRP(VisualDependence):
    """Visual triplets: the original images, grey canvases (masked) and noise-perturbed images (one extra no-gradient
    forward each, ``time/masked_forward``, ``time/perturbed_forward``). Per token:

        D_mask_t = clip(log p(y_t | image) - log p(y_t | grey))          to be large (visual sensitivity)
        D_pert_t = clip(|log p(y_t | image) - log p(y_t | perturbed)|)    to be small (visual robustness)
        A'[i, t] = A_i + alpha * D_mask_t - beta * D_pert_t

    The paper maximises reasoning divergence from masked inputs and minimises it from perturbed inputs; mmrl carries
    both as a per-token intrinsic term on the advantage (log-prob differences of the sampled tokens under the sampling
    policy), its form and weights are mmrl's."""

    name = "dvrp"
    summary = "per-token bonus for depending on the image, penalty for changing under a small perturbation of it"
    paper = ("Thinking with Deltas: Differential Visual Reasoning Policy (DVRP) for multimodal RLVR (2026; arXiv id "
             "not found offline); the additive per-token form is mmrl's")
    Options = DVRPOptions
    needs = ("old_logps", "masked_logps", "perturbed_logps")

    def perturbation_std(self) -> float:
        return self.options.noise_std

    def transform(self, ctx: TransformContext) -> Tensor:
        o, r = self.options, ctx.rollout
        mask = r.mask.float()
        sensitive = self.visual_gain(ctx).clamp(-o.clip, o.clip)
        unstable = ((r.old_logps.float() - r.perturbed_logps.float()).abs() * mask).clamp(max=o.clip)
        ctx.stats["dvrp/perturbed_divergence"] = float(unstable.sum() / mask.sum().clamp(min=1.0))
        adv = ctx.advantages if ctx.advantages.dim() == 2 else ctx.advantages.unsqueeze(1)
        return (adv.float() + o.divergence_weight * sensitive - o.consistency_weight * unstable) * mask
