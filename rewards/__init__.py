"""Reward functions for mmrl (installed as ``mmrl.rewards``).

A reward is a callable object (see :class:`RewardFn`)::

    scores = reward(images, prompts, metadata=None)   # -> dict[str, Tensor]

* ``images``: float tensor ``[N, 3, H, W]`` in ``[0, 1]``, or a list of N PIL images;
* ``prompts``: list of N strings (``None`` is fine when ``reward.needs_prompts`` is False);
* ``metadata``: optional list of N dicts.

It returns ``[N]`` float32 CPU tensors, the main score under ``reward.name``. A sample it cannot
judge gets NaN and ``reward.last_info`` says why (``{"num_nan", "reasons", "nan_samples", ...}``);
a wrong-shaped batch raises ``ValueError``.

Registered rewards (``list_rewards()``): ``brightness``, ``saturation``, ``colorfulness``
(pixel statistics), ``jpeg_compressibility``, ``jpeg_incompressibility`` (DDPO), ``pickscore``
(transformers CLIP), ``hpsv2`` (open_clip). Build one with ``build_reward(name, **kwargs)`` and
several, weighted, with :func:`build_rewards`. Model backbones (transformers, open_clip) are
imported only when such a reward is built.
"""
from ._base import (
    ImageBatch,
    MissingWeightsError,
    Reward,
    RewardFn,
    build_reward,
    check_reward_arguments,
    list_rewards,
    prepare_batch,
    register_reward,
)

# Importing the modules registers their rewards; none imports a model library at import time.
from . import hps, jpeg, pickscore, pixel  # noqa: E402,F401  (registration side effect)
from .compose import ComposedReward, build_rewards  # noqa: E402
from .hps import HPSv2, hps_preprocess  # noqa: E402
from .jpeg import JpegCompressibility, JpegIncompressibility  # noqa: E402
from .pickscore import PickScore  # noqa: E402
from .pixel import Brightness, Colorfulness, Saturation  # noqa: E402

__all__ = [
    "RewardFn",
    "Reward",
    "ImageBatch",
    "prepare_batch",
    "MissingWeightsError",
    "register_reward",
    "build_reward",
    "check_reward_arguments",
    "list_rewards",
    "ComposedReward",
    "build_rewards",
    "Brightness",
    "Saturation",
    "Colorfulness",
    "JpegCompressibility",
    "JpegIncompressibility",
    "PickScore",
    "HPSv2",
    "hps_preprocess",
]
