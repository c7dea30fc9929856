"""The composition root: config -> accelerator, policy, rewards, prompts, trainer.

This is the one place that knows the core, the pipelines and the rewards together.
"""

from __future__ import annotations

import inspect
import os

import torch

from mmrl.algorithms import build_variants
from mmrl.config import Config, ConfigError
from mmrl.data.prompts import DataError, PromptItem, PromptSource, read_prompts


#: The collective timeout of a run with benchmarks during training (``eval.every``): the main process evaluates
#: while the others wait in the next update's first collective, longer than NCCL's default 10 minutes allows.
EVAL_COLLECTIVE_TIMEOUT_S = 3 * 3600


def build_accelerator(config: Config):
    from accelerate import Accelerator

    # `accelerate launch` with a DeepSpeed config exports ACCELERATE_USE_DEEPSPEED; accelerate ignores DeepSpeed when
    # told cpu=True, and DeepSpeed has a CPU accelerator of its own, so a machine without GPUs runs it on gloo (named
    # here: without a backend accelerate would count one process on every rank)
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    cpu = not torch.cuda.is_available()
    process_group = {}
    if config.eval.every:
        from datetime import timedelta

        process_group["timeout"] = timedelta(seconds=EVAL_COLLECTIVE_TIMEOUT_S)
    if deepspeed and cpu:
        process_group["backend"] = "gloo"
        # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce kernel (deepspeed_shm_comm) when its
        # communication starts: about 3 minutes at the first launch on a machine (a C++ toolchain needed), for a
        # kernel only its inference all-reduce uses; training's collectives are torch.distributed's (gloo) either way
        import importlib

        # by name: `import deepspeed.comm.torch as m` binds the torch library (deepspeed.comm's attribute `torch`)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    handlers = []
    if process_group:
        from accelerate.utils import InitProcessGroupKwargs

        handlers.append(InitProcessGroupKwargs(**process_group))
    accelerator = Accelerator(mixed_precision=config.train.mixed_precision, cpu=cpu and not deepspeed,
                              gradient_accumulation_steps=1, kwargs_handlers=handlers)
    if deepspeed:
        # accelerate registers its DeepSpeed config with transformers, whose from_pretrained then builds every model
        # partitioned under ZeRO-3 (deepspeed.zero.Init), the frozen text encoders and reward models included. mmrl
        # loads its models whole and the engine partitions the policy at prepare (zero3_init_flag: false)
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    return accelerator


def build_prompt_items(config: Config) -> list[PromptItem]:
    d = config.data
    return read_prompts(d.prompts) if d.prompts else [PromptItem(p) for p in d.prompt_list]


def build_source(config: Config):
    """The seeded, resumable data order: prompts for flow policies, VLM samples for Qwen-VL.

    A VLM data set is read and checked here, before the first update (:func:`mmrl.data.vlm.read_vlm_jsonl`):
    every line's fields, every media file present, every image's structure verified, every video probed (opened
    with decord, its metadata read and its first frame decoded: milliseconds per clip, not a decode of the
    video). A bad line is a ``DataError`` naming the file and line, or with ``data.skip_bad_samples`` a logged
    skip, counted in the returned source's ``problems``. ``mmrl config validate`` checks deeper.
    """
    if config.model.family == "qwen_vl":
        from mmrl.data.vlm import VLMSampleSource, read_vlm_jsonl

        samples = read_vlm_jsonl(resolve_vlm_dataset(config), skip_bad=config.data.skip_bad_samples,
                                 verify_images=True, verify_videos=True)
        if not samples:  # read_vlm_jsonl already raises on a file with no usable sample
            raise DataError(f"{config.data.dataset}: no usable sample")
        return VLMSampleSource(samples, seed=config.seed, shuffle=config.data.shuffle, problems=samples.problems)
    items = build_prompt_items(config)
    if config.data.balance_tags:
        from mmrl.data.prompts import balance_by_tag

        items = balance_by_tag(items)
    return PromptSource(items, seed=config.seed, shuffle=config.data.shuffle)


def vlm_media(config: Config, processor):
    """``sample -> (images, video clip)`` with the processor's pixel budgets (or generation.*) and its resize
    factor (``patch_size * merge_size``: 28 for Qwen2/2.5-VL, 32 for Qwen3-VL): each image resized as
    qwen-vl-utils' ``fetch_image`` does, then given to the processor at that size (``images_at_final_size``: the
    policy passes ``do_resize=False``, as Qwen3-VL's README does after qwen-vl-utils), so the size the rewards
    rescale boxes against (metadata ``input_size``) is exactly the model's input (``image_grid_thw`` x patch
    size)."""
    from mmrl.data.validate import video_frame_kwargs
    from mmrl.data.vlm import load_images, load_video

    g = config.generation
    frames = video_frame_kwargs(config)  # the frame plan `mmrl config validate` decodes too
    image_processor, video_processor = processor.image_processor, processor.video_processor
    size = image_processor.size
    min_pixels = g.min_pixels or size.get("shortest_edge")
    max_pixels = g.max_pixels or size.get("longest_edge")
    image_factor = image_processor.patch_size * image_processor.merge_size
    video_factor = video_processor.patch_size * video_processor.merge_size
    video_budget = video_pixel_budget(config, processor)

    def media(sample):
        images = []
        if sample.num_images:
            images = load_images(sample, min_pixels=min_pixels, max_pixels=max_pixels, factor=image_factor)
        video = None
        if sample.video_path is not None:
            video = load_video(sample, **frames, **video_budget, factor=video_factor,
                               temporal_patch_size=video_processor.temporal_patch_size)
        return images, video

    media.images_at_final_size = True
    return media


def video_pixel_budget(config: Config, processor) -> dict:
    """``read_video``'s pixel-budget arguments for the policy's processor.

    Qwen2/2.5-VL (its video processor's ``size`` bounds each frame): qwen-vl-utils' ``fetch_video`` budget, the
    frames then passed at their final size (``do_resize=False``, as Qwen's README does after qwen-vl-utils, so the
    processor does not resize them again, to its own minimum). Per-frame minimum ``generation.video_min_pixels`` or
    the processor's ``shortest_edge`` (``Qwen2VLVideoProcessor``'s default is qwen-vl-utils' ``VIDEO_MIN_PIXELS``,
    128 x 28 x 28; a checkpoint without a video processor config gets its image processor's instead); per-frame cap
    the processor's ``longest_edge`` (default ``VIDEO_MAX_PIXELS``, 768 x 28 x 28); total
    ``generation.video_total_pixels`` or 0.9 x ``max_video_tokens`` x 28 x 28 (``VIDEO_TOTAL_PIXELS``); then at most
    ``generation.video_max_pixels``. A ``video_max_pixels`` below the default minimum (with ``video_min_pixels``
    unset) lowers the minimum to it: mmrl's rule (qwen-vl-utils 0.0.13+ asserts ``max >= min`` there; 0.0.11 upscales
    the frames past the maximum).

    Qwen3-VL's video processor budgets the whole clip (its ``size``) and resizes the frames itself: by default only
    ``video_max_pixels`` applies to them beforehand. With ``video_min_pixels`` or ``video_total_pixels`` set, the
    frames get the budget of Qwen3-VL's own pipeline instead (qwen-vl-utils ``fetch_video(...,
    image_patch_size=16)``, then ``do_resize=False``): floor ``video_min_pixels`` or 128 x 32 x 32
    (``VIDEO_MIN_TOKEN_NUM``), cap 768 x 32 x 32 (``VIDEO_MAX_TOKEN_NUM``), total ``video_total_pixels`` or 0.9 x
    128000 x 32 x 32 (``MODEL_SEQ_LEN``)."""
    from transformers import Qwen2VLVideoProcessor

    from mmrl.data.video import VIDEO_CONTEXT_TOKENS

    g, video_processor = config.generation, processor.video_processor
    size = video_processor.size
    factor = video_processor.patch_size * video_processor.merge_size
    if isinstance(video_processor, Qwen2VLVideoProcessor):  # its size bounds one frame
        frame_max = size.get("longest_edge") or 768 * factor * factor
        floor = size.get("shortest_edge") or 128 * factor * factor
        tokens = getattr(video_processor, "max_video_tokens", None) or VIDEO_CONTEXT_TOKENS
    elif g.video_min_pixels is None and g.video_total_pixels is None:  # the processor's whole-clip budget
        return {"max_pixels": g.video_max_pixels or size.get("longest_edge")}
    else:  # qwen-vl-utils' constants (its size bounds the whole clip, not a frame)
        frame_max, floor, tokens = 768 * factor * factor, 128 * factor * factor, VIDEO_CONTEXT_TOKENS
    min_pixels = g.video_min_pixels or floor
    if g.video_min_pixels is None and g.video_max_pixels is not None:
        min_pixels = min(min_pixels, g.video_max_pixels)
    total = g.video_total_pixels if g.video_total_pixels is not None else tokens * factor * factor * 0.9
    return {"min_pixels": min_pixels, "max_pixels": g.video_max_pixels, "total_pixels": total,
            "frame_max_pixels": frame_max}


def build_vlm_policy(config: Config, device: torch.device | str = "cpu"):
    from mmrl.pipelines.vlm.qwen import LANGUAGE_LORA_TARGETS, QwenVLPolicy, load_vlm
    from mmrl.pipelines.vlm.tools import resolve_tools

    m, g = config.model, config.generation
    model, processor = load_vlm(m.pretrained, dtype=m.dtype, revision=m.revision,
                                attn_implementation=m.attn_implementation, min_pixels=g.min_pixels,
                                max_pixels=g.max_pixels)
    lora = None
    if m.use_lora:
        lora = {"rank": m.lora_rank, "alpha": m.lora_alpha, "dropout": m.lora_dropout,
                "target_modules": m.lora_target_modules or LANGUAGE_LORA_TARGETS}
    return QwenVLPolicy(
        model, processor, lora=lora, freeze_vision=m.freeze_vision, temperature=g.temperature, top_p=g.top_p,
        top_k=g.top_k, min_p=g.min_p, repetition_penalty=g.repetition_penalty, max_new_tokens=g.max_new_tokens,
        max_prompt_length=g.max_prompt_length,
        cache_implementation=g.cache_implementation, system_prompt=g.system_prompt,
        question_template=g.question_template, media=vlm_media(config, processor),
        gradient_checkpointing=m.gradient_checkpointing, skip_bad_samples=config.data.skip_bad_samples,
        device=device, tools=resolve_tools(g.tools), max_tool_calls=g.max_tool_calls,
        tool_response_template=g.tool_response_template, share_prompt_prefix=m.share_prompt_prefix,
        coord_format=policy_coord_format(config) if g.tools else None,
        sampler=build_vlm_sampler(config) if g.engine == "vllm" else None,
        kl_estimator=config.algorithm.kl_estimator,
    )


def build_vlm_sampler(config: Config):
    """generation.engine: vllm -> the rollout engine: a client of ``generation.vllm_server`` (server mode,
    :mod:`mmrl.pipelines.vlm.vllm_server`; any number of training processes) or a vLLM engine colocated in this one
    training process (:func:`build_vllm_engine`)."""
    g = config.generation
    if g.vllm_server is not None:
        from mmrl.pipelines.vlm.vllm_server import VLLMServerClient

        return VLLMServerClient(g.vllm_server, dtype=config.model.dtype,
                                max_model_len=g.max_prompt_length + g.max_new_tokens, timeout=g.vllm_server_timeout)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("generation.engine: vllm runs one colocated engine in one training process; launch a single "
                          "process, serve vLLM apart for several (generation.vllm_server, `mmrl vllm-serve`), or use "
                          "the default engine 'hf'")
    return build_vllm_engine(config)


def build_vllm_engine(config: Config):
    """A vLLM engine over the policy's checkpoint (:class:`mmrl.pipelines.vlm.vllm_engine.VLLMSampler`), with the
    processor's pixel budget when the config sets one: colocated in training, or what ``mmrl vllm-serve`` serves."""
    from mmrl.pipelines.vlm.qwen import resolve_vlm_pretrained
    from mmrl.pipelines.vlm.vllm_engine import VLLMSampler, vllm_missing

    m, g = config.model, config.generation
    problem = vllm_missing()
    if problem:
        raise ConfigError(problem)
    options = dict(g.vllm)
    pixels = {k: v for k, v in (("min_pixels", g.min_pixels), ("max_pixels", g.max_pixels)) if v is not None}
    if pixels:
        options["mm_processor_kwargs"] = {**pixels, **options.get("mm_processor_kwargs", {})}
    if m.revision is not None:
        options.setdefault("revision", m.revision)
    return VLLMSampler(resolve_vlm_pretrained(m.pretrained), dtype=m.dtype, seed=config.seed,
                       max_model_len=g.max_prompt_length + g.max_new_tokens, options=options)


def build_policy(config: Config, device: torch.device | str = "cpu"):
    """The configured policy; LoRA target modules that match no module of the model are a :class:`ConfigError`
    naming ``model.lora_target_modules`` (not PEFT's error from inside the model)."""
    try:
        return _build_policy(config, device)
    except ValueError as exc:
        if type(exc).__name__ != "NoMatchingPeftModuleError":
            raise
        raise ConfigError(f"model.lora_target_modules={list(config.model.lora_target_modules)}: {exc}") from None


def _build_policy(config: Config, device: torch.device | str = "cpu"):
    if config.model.family == "qwen_vl":
        return build_vlm_policy(config, device)
    from mmrl.pipelines.flow.policy import FlowPolicy, build_family

    m, s = config.model, config.sampling
    family = build_family(m.family, m.pretrained, dtype=m.dtype, revision=m.revision,
                          max_sequence_length=s.max_sequence_length)
    try:
        family.latent_shape(m.resolution)  # a side this model cannot generate: one line naming the key
    except ValueError as exc:
        raise ConfigError(f"model.resolution={m.resolution}: {exc}") from None
    limit = family.text_token_limit()
    if limit is not None and s.max_sequence_length > limit:  # padding it never saw: a condition it cannot read
        raise ConfigError(f"sampling.max_sequence_length={s.max_sequence_length} pads prompts past the "
                          f"{limit} tokens this pipeline's T5 tokenizer states (model_max_length: the length it was "
                          f"trained with, e.g. an mmrl pretrain base's text.max_length); set "
                          f"sampling.max_sequence_length: {limit} or less")
    lora = None
    if m.use_lora:
        lora = {"rank": m.lora_rank, "alpha": m.lora_alpha, "dropout": m.lora_dropout,
                "target_modules": m.lora_target_modules or family.default_lora_targets}
    return FlowPolicy(
        family, num_steps=s.num_steps, eval_num_steps=s.eval_num_steps, resolution=m.resolution, sde=s.sde,
        noise_level=s.noise_level, guidance_scale=s.guidance_scale, negative_prompt=s.negative_prompt,
        cfg_detach_uncond=s.cfg_detach_uncond,
        train_steps=s.train_steps, timestep_fraction=s.timestep_fraction, window_size=s.window_size,
        window_shift_every=s.window_shift_every, window_range=s.window_range, share_group_noise=s.share_group_noise, lora=lora,
        gradient_checkpointing=m.gradient_checkpointing, time_shift=s.time_shift,
        noise_schedule=list(s.noise_schedule) or None,
        keep_x0=s.intermediate == "x0" and any("intermediate_images" in v.needs for v in build_variants(config)),
        merge_threshold=s.merge_threshold, merge_groups=s.merge_groups, final_image=s.final_image,
        sample_batch_size=config.train.sample_batch_size, device=device,
    )


def policy_model_type(config: Config, *, warn: bool = True) -> str | None:
    """The transformers model type of a ``qwen_vl`` policy: the name of a ``tiny:<model_type>`` model, else
    ``transformers.AutoConfig.from_pretrained(model.pretrained).model_type`` (a local folder, the shipped
    ``shapeworld:qwen_vl``, or the hub cache when offline); None (with a warning when ``warn``) when it cannot be
    read."""
    import logging

    m = config.model
    if m.pretrained.startswith("tiny:"):
        return m.pretrained.split(":", 1)[1]
    try:
        from transformers import AutoConfig

        from mmrl.pipelines.vlm.qwen import resolve_vlm_pretrained

        return AutoConfig.from_pretrained(resolve_vlm_pretrained(m.pretrained), revision=m.revision).model_type
    except Exception as exc:  # offline without the config, a bad path...: no default, samples must say
        from pathlib import Path

        folder = Path(m.pretrained).expanduser()
        # a local folder without config.json fails to load with its own message: no warning before it
        if warn and not (folder.is_dir() and not (folder / "config.json").is_file()):
            logging.getLogger(__name__).warning(
                "could not read the model type of model.pretrained=%r (%s: %s); box rewards get no default "
                "coord_format", m.pretrained, type(exc).__name__, exc)
        return None


def policy_coord_format(config: Config) -> str | None:
    """The box coordinate format a ``qwen_vl`` policy answers in (:data:`mmrl.rewards.grounding.QWEN_COORD_FORMATS`),
    from its model type (:func:`policy_model_type`). None, with a warning, when that cannot be read or is not a known
    Qwen-VL."""
    import logging

    from mmrl.rewards.grounding import QWEN_COORD_FORMATS

    model_type = policy_model_type(config)
    coord_format = QWEN_COORD_FORMATS.get(model_type)
    if coord_format is None and model_type is not None:
        logging.getLogger(__name__).warning(
            "model type %r of model.pretrained=%r has no known box coordinate format (known: %s); box rewards "
            "get no default coord_format", model_type, config.model.pretrained, sorted(QWEN_COORD_FORMATS))
    return coord_format


def resolve_vlm_dataset(config: Config, value: str | None = None, *, where: str = "data.dataset") -> str:
    """``value`` (default ``data.dataset``) as a JSONL path: ``tiny:<kind>`` the cached synthetic set, a ShapeWorld
    spec (``shapeworld:<split>:<n>[:<tasks>]``) the set written with the policy's coordinate format
    (:func:`policy_coord_format`), anything else unchanged. A bad spec is a ConfigError ``"<where>: ..."``."""
    from mmrl.data.shapeworld import resolve_vlm_spec
    from mmrl.data.synthetic import resolve_dataset

    value = config.data.dataset if value is None else value
    if isinstance(value, str) and value.startswith("shapeworld:"):
        try:
            return resolve_vlm_spec(value, coord_format=policy_coord_format(config), seed=0)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return resolve_dataset(value)


def build_reward_fn(config: Config, *, probe: bool = True):
    """The configured rewards (:func:`mmrl.rewards.build_rewards` on ``config.rewards``).

    ``probe``: check every remote reward's server now (:func:`mmrl.rewards.remote.probe_remote_rewards`, one
    ``GET /health``), so an unreachable server is a :class:`~mmrl.rewards.remote.RewardServerError` before any
    model is loaded (:func:`build_trainer` builds the rewards before the policy).

    For ``model.family: qwen_vl`` the box rewards (every reward with a ``coord_format`` argument, also inside
    ``task_routed`` routes) that the config gives no ``coord_format`` get the one the policy answers in, from its
    model type (:data:`mmrl.rewards.grounding.QWEN_COORD_FORMATS`): Qwen2-VL and Qwen3-VL [0, 1000) normalised
    (``qwen2``), Qwen2.5-VL absolute pixels of the resized input (``qwen25``). The model type is the name of a
    ``tiny:<model_type>`` model, else ``transformers.AutoConfig.from_pretrained(model.pretrained).model_type``
    (a local folder, or the hub cache when offline). When it cannot be read, or is not a known Qwen-VL, no
    default is set (with a warning): a sample whose metadata has no ``coord_format`` is then NaN, never read as
    absolute pixels. A sample's own ``coord_format`` always wins over the reward's default.
    """
    from mmrl.rewards import build_rewards
    from mmrl.rewards.grounding import with_coord_format

    spec = config.rewards
    if config.model.family == "qwen_vl":
        coord_format = policy_coord_format(config)
        if coord_format is not None:
            spec = with_coord_format(spec, coord_format)
    from mmrl.rewards.compose import RewardBuildError

    try:
        reward_fn = build_rewards(spec)
    except RewardBuildError as exc:  # a reward's constructor refusing a value: the user's config, one line
        raise ConfigError(str(exc)) from exc
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"rewards: {type(exc).__name__}: {exc}") from exc
    if probe:
        from mmrl.rewards.remote import probe_remote_rewards

        probe_remote_rewards(reward_fn)
    return reward_fn


def training_eval_plan(config: Config):
    """``eval.benchmarks`` during training, every benchmark name, option and file checked without loading anything
    (None with ``eval.every: 0``); a :class:`ConfigError` naming the problem (``mmrl train`` and ``mmrl config
    validate`` both ask)."""
    if not config.eval.every:
        return None
    from mmrl.eval.runner import EvalError, plan_training_eval

    try:
        return plan_training_eval(config)
    except (EvalError, ValueError) as exc:
        raise ConfigError(f"eval: {exc}") from None


def build_trainer(config: Config):
    from mmrl.trainer import Trainer, check_resume

    check_resume(config)  # a resume that changes what the checkpoint fixes: refused before anything loads
    eval_plan = training_eval_plan(config)
    accelerator = build_accelerator(config)
    torch.manual_seed(config.seed + accelerator.process_index)
    if config.train.allow_tf32:  # for the whole process, as the anchors set it (PyTorch's default: off)
        torch.backends.cuda.matmul.allow_tf32 = True
    prompts = build_source(config)
    reward_fn = build_reward_fn(config)  # also probes remote reward servers: before the (slow) policy load
    policy = build_policy(config, device=accelerator.device)
    if config.algorithm.beta > 0:
        policy.init_reference()
    scorer = None
    if overlap_scoring_on(config, accelerator.device) and "on_chunk" in inspect.signature(policy.rollout).parameters:
        from mmrl.rewards.async_scoring import AsyncScorer

        scorer = AsyncScorer(reward_fn)
    trainer = Trainer(config, policy, reward_fn, prompts, accelerator, scorer=scorer)
    trainer._eval_plan = eval_plan
    return trainer


def overlap_scoring_on(config: Config, device: torch.device) -> bool:
    """``train.overlap_scoring`` resolved for the device the policy runs on: ``'auto'`` is on for an accelerator (the
    reward's kernels on their own stream, its CPU work beside the sampler's kernels) and off on the CPU (the sampler
    uses every core already; scoring in between chunks costs the same work without two threads competing)."""
    value = config.train.overlap_scoring
    return torch.device(device).type != "cpu" if value == "auto" else bool(value)


def cpu_threads_default() -> None:
    """Leave torch's default thread count unless the user set OMP_NUM_THREADS (its first number: OpenMP also
    accepts a nested list such as ``4,2``; a value that is not a positive number is ignored)."""
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if value.isdigit() and int(value) >= 1:
        torch.set_num_threads(int(value))
