"""Cosine-similarity credit (CoCA): the outcome spread over steps by how far each moves the image towards the final."""

from __future__ import annotations

from torch import Tensor

from mmrl.algorithms.base import Intermediate, RewardContext, register
from mmrl.algorithms.dense import DenseCredit
from mmrl.core.credit import cosine_similarity_credit


@register
class CosineCredit(DenseCredit):
    """:func:`mmrl.core.credit.cosine_similarity_credit` on centred pixels of the intermediate images."""

    name = "cosine"
    summary = "outcome reward weighted per step by the gain in cosine similarity to the final image"
    paper = ("Step-level Reward for Free in RL-based T2I Diffusion Model Fine-tuning (CoCA), Liao et al. 2025, "
             "arXiv 2505.19196")

    def credit(self, intermediate: Intermediate, ctx: RewardContext) -> Tensor:
        images = intermediate.images
        n, k = images.shape[:2]
        # centred pixels ([-1, 1], minus each image's mean): raw [0, 1] images all have cosine ~1 to each other
        flat = images.reshape(n, k, -1) * 2 - 1
        flat = flat - flat.mean(dim=-1, keepdim=True)
        return cosine_similarity_credit(flat, flat[:, -1], intermediate.step_rewards[:, -1])
