"""Reward functions for mmrl (installed as ``mmrl.rewards``).

A reward is a callable object (see :class:`RewardFn`)::

    scores = reward(images, prompts, metadata=None)   # -> dict[str, Tensor]

* ``images``: float tensor ``[N, 3, H, W]`` in ``[0, 1]``, or a list of N PIL images;
* ``prompts``: list of N strings (``None`` is fine when ``reward.needs_prompts`` is False);
* ``metadata``: optional list of N dicts.

It returns ``[N]`` float32 CPU tensors, the main score under ``reward.name``. A sample it cannot
judge gets NaN and ``reward.last_info`` says why (``{"num_nan", "reasons", "nan_samples", ...}``);
a wrong-shaped batch raises ``ValueError``.

Registered rewards (``list_rewards()``; the README has the table): image rewards ``pickscore``,
``hpsv2``, ``clipscore``, ``aesthetic``, ``imagereward``, ``ocr``, ``geneval`` / ``geneval_partial``,
``shapeworld`` / ``shapeworld_partial`` (GenEval's rules with a weightless detector, :mod:`mmrl.rewards.shapeworld`),
``vlm_judge``, ``prompt_echo``, ``dino_reference``, ``set_diversity``, the weightless ``brightness``,
``saturation``, ``colorfulness``, ``jpeg_compressibility``, ``jpeg_incompressibility``; video
``video_segmental``; text (VLM) rewards ``think_answer_format``, the answer-accuracy and grounding
families and ``task_routed``; and ``remote`` (a reward server, :mod:`mmrl.rewards.remote`). Build one
with ``build_reward(name, **kwargs)`` and several, weighted, with :func:`build_rewards`. Model
backbones (transformers, open_clip, rapidocr) are imported only when such a reward is built.

Text rewards for vision-language policies take completions instead of images::

    scores = reward(completions, prompts, metadata)   # completions: list of N strings

with the per-sample ground truth in ``metadata`` (fields documented in :mod:`mmrl.rewards._text`).
An unparseable answer scores 0 and is counted (``last_info["num_unparseable"]``); a sample whose
metadata lacks what the reward needs is NaN. :class:`ComposedReward` and :func:`build_rewards` take
either kind of batch. Registered: ``think_answer_format``, ``choice_accuracy``,
``multi_choice_accuracy`` (TW-GRPO), ``numeric_accuracy``, ``numeric_fuzzy`` (FGRPR),
``math_accuracy`` (math-verify), ``chart_accuracy`` (ChartQA's relaxed accuracy) in :mod:`~mmrl.rewards.answer`;
``video_r1_accuracy`` (Video-R1's accuracy by problem type) in :mod:`~mmrl.rewards.video_r1`;
``iou``, ``box_coordinate`` (one coordinate, reporting its characters as spans), ``box_f1``,
``box_matched_iou``, ``box_detection_score`` (VLM-R1's open-vocabulary detection reward), ``box_weighted_pr`` (DIP-R1), ``box_set_f1`` (Falcon-Perception),
``box_salience_iou`` (GRiP), ``temporal_iou``, ``temporal_dual`` (Temporal-R1) in
:mod:`~mmrl.rewards.grounding`; ``task_routed`` (Mixed-R1) in :mod:`~mmrl.rewards.routing`; ``bmas``
(Mixed-R1's open-ended reward: bidirectional max-average token-embedding similarity to ``solution``, on a
Hugging Face text model) in :mod:`~mmrl.rewards.bmas`.
The box rewards read coordinates in the sample's ``coord_format``, else their own ``coord_format``
argument (``mmrl.build.build_reward_fn`` sets it from the Qwen-VL model type); with neither the sample
is NaN, never silently taken as absolute pixels.

Judged perception rewards (text rewards on a frozen Qwen-VL judge that sees the sample's media, the response and
its annotations; shared machinery in :mod:`~mmrl.rewards._judge`):
``perception_r1`` (Perception-R1: response consistent with the visual annotations) in :mod:`~mmrl.rewards.perception_r1`;
``claimdiff`` (ClaimDiff-RL: verified claim differences, hallucinated and missing apart) in :mod:`~mmrl.rewards.claimdiff`;
``medix_composite`` (MediX-R1: strict yes/no accuracy + judge-embedding similarity + format) in :mod:`~mmrl.rewards.medix`;
``pest_feature`` (Pest-Thinker: the response cites observable evidence) in :mod:`~mmrl.rewards.pest_feature`;
``video_ver`` (Video-VER: the reasoning is grounded in the video's frames) in :mod:`~mmrl.rewards.video_ver`.
"""
from ._base import (
    ImageBatch,
    MissingWeightsError,
    Reward,
    RewardFn,
    build_reward,
    check_reward_arguments,
    list_rewards,
    reward_factory,
    reward_inputs,
    reward_scores_images,
    prepare_batch,
    register_reward,
)

# Importing the modules registers their rewards; none imports a model library at import time.
from . import aesthetic, answer, bmas, clipscore, diversity, geneval, grounding, hps, imagereward, jpeg, ocr, pickscore, pixel, reference, remote, routing, shapeworld, video, video_r1, vlm_judge  # noqa: E402,F401  (registration side effect)
from . import claimdiff, medix, perception_r1, pest_feature, video_ver  # noqa: E402,F401  (judged perception rewards)
from . import function  # noqa: E402,F401  (TRL-style reward functions)
from ._text import TextReward  # noqa: E402
from .answer import (  # noqa: E402
    ChoiceAccuracy,
    MathAccuracy,
    MultiChoiceAccuracy,
    NumericAccuracy,
    NumericFuzzy,
    ThinkAnswerFormat,
    extract_answer,
    think_answer_format,
)
from .async_scoring import AsyncScorer  # noqa: E402
from .compose import ComposedReward, build_rewards  # noqa: E402
from .function import FunctionReward  # noqa: E402
from .remote import RemoteReward, RewardServerError  # noqa: E402
from .grounding import (  # noqa: E402
    BoxDetectionScore,
    BoxF1,
    BoxIoU,
    BoxMatchedIoU,
    BoxSalienceIoU,
    BoxSetF1,
    BoxWeightedPR,
    TemporalDual,
    TemporalIoU,
    box_iou,
    temporal_iou,
)
from .hps import HPSv2, hps_preprocess  # noqa: E402
from .jpeg import JpegCompressibility, JpegIncompressibility  # noqa: E402
from .pickscore import PickScore  # noqa: E402
from .pixel import Brightness, Colorfulness, Saturation  # noqa: E402
from .routing import TaskRoutedReward  # noqa: E402
from .aesthetic import LaionAesthetic  # noqa: E402
from .clipscore import CLIPScore  # noqa: E402
from .imagereward import ImageReward  # noqa: E402
from .ocr import OCRReward  # noqa: E402
from .diversity import SetDiversity  # noqa: E402
from .geneval import GenEval, GenEvalPartial, geneval_summary  # noqa: E402
from .shapeworld import ShapeWorldPartial, ShapeWorldReward  # noqa: E402
from .reference import DinoEmbedder, DinoReference  # noqa: E402
from .video import SegmentalVideoReward  # noqa: E402
from .video_r1 import VideoR1Accuracy  # noqa: E402
from .vlm_judge import PromptEcho, VLMJudge  # noqa: E402

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
    "reward_scores_images",
    "reward_factory",
    "reward_inputs",
    "FunctionReward",
    "ComposedReward",
    "RemoteReward",
    "RewardServerError",
    "AsyncScorer",
    "build_rewards",
    "Brightness",
    "Saturation",
    "Colorfulness",
    "JpegCompressibility",
    "JpegIncompressibility",
    "PickScore",
    "HPSv2",
    "hps_preprocess",
    "TextReward",
    "think_answer_format",
    "extract_answer",
    "ThinkAnswerFormat",
    "ChoiceAccuracy",
    "MultiChoiceAccuracy",
    "NumericAccuracy",
    "NumericFuzzy",
    "MathAccuracy",
    "box_iou",
    "temporal_iou",
    "BoxIoU",
    "BoxF1",
    "BoxDetectionScore",
    "VideoR1Accuracy",
    "BoxMatchedIoU",
    "BoxWeightedPR",
    "BoxSetF1",
    "BoxSalienceIoU",
    "TemporalIoU",
    "TemporalDual",
    "TaskRoutedReward",
    "CLIPScore",
    "LaionAesthetic",
    "ImageReward",
    "OCRReward",
    "GenEval",
    "GenEvalPartial",
    "geneval_summary",
    "ShapeWorldReward",
    "ShapeWorldPartial",
    "VLMJudge",
    "PromptEcho",
    "DinoEmbedder",
    "DinoReference",
    "SetDiversity",
    "SegmentalVideoReward",
]
