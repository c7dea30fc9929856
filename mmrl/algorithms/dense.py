"""Shared base of the dense-credit variants: per-step rewards ``[N, T]`` from the images each trained step leads to.

A dense-credit variant turns ``R_0 .. R_T`` (:class:`~mmrl.algorithms.base.Intermediate`) into one reward per trained
step; the loop then normalises each step column within its group (REFERENCE.md section 4) instead of the outcome.
The per-step rewards replace the outcome as the only advantage component (``step_reward``), so one dense-credit
variant at most may be on.
"""

from __future__ import annotations

from torch import Tensor

from mmrl.algorithms.base import Intermediate, RewardContext, Rewards, Variant, VariantError, lookup


class DenseCredit(Variant):
    """Base of the credit rules over denoising steps (flow policies). Subclasses implement :meth:`credit`."""

    needs = ("intermediate_images",)
    families = ("flow",)

    def credit(self, intermediate: Intermediate, ctx: RewardContext) -> Tensor:
        """Per-step rewards ``[N, T]`` from ``R_0 .. R_T`` (and the images)."""
        raise NotImplementedError

    def rewards(self, ctx: RewardContext) -> Rewards:
        dense = self.credit(ctx.intermediate(), ctx)
        return Rewards({**ctx.scores, "step_reward": dense}, {"step_reward": 1.0})

    def check(self, config) -> None:
        others = [spec_name(s) for s in config.algorithm.variants if spec_name(s) != self.name]
        dense = [n for n in others if issubclass(lookup(n), DenseCredit)]
        if dense:
            raise VariantError(f"variants {self.name!r} and {dense[0]!r} both assign credit over denoising steps; "
                               f"choose one")
        # every reward of a flow policy judges images: the config refuses a text reward for any flow run
        if config.sampling.train_steps == "entropy_merge":
            raise VariantError(f"sampling.train_steps=entropy_merge samples on a merged sigma grid: variant "
                               f"{self.name!r} needs the intermediate images of the full grid (use outcome credit)")


def spec_name(spec) -> str:
    """The variant name of one ``algorithm.variants`` entry (a name or ``{name: ...}``)."""
    return spec if isinstance(spec, str) else spec.get("name", "") if isinstance(spec, dict) else ""


def configured(config, cls: type) -> list[str]:
    """Names of the configured variants that are subclasses of ``cls``."""
    names = []
    for spec in config.algorithm.variants:
        try:
            if issubclass(lookup(spec_name(spec)), cls):
                names.append(spec_name(spec))
        except VariantError:
            continue  # reported by its own parse
    return names
