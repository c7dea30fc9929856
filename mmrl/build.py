"""The composition root: config -> accelerator, policy, rewards, prompts, trainer.

This is the one place that knows the core, the pipelines and the rewards together.
"""

from __future__ import annotations

import os

import torch

from mmrl.config import Config
from mmrl.data.prompts import PromptItem, PromptSource, read_prompts


def build_accelerator(config: Config):
    from accelerate import Accelerator

    return Accelerator(mixed_precision=config.train.mixed_precision, cpu=not torch.cuda.is_available(),
                       gradient_accumulation_steps=1)


def build_prompt_items(config: Config) -> list[PromptItem]:
    d = config.data
    return read_prompts(d.prompts) if d.prompts else [PromptItem(p) for p in d.prompt_list]


def build_policy(config: Config, device: torch.device | str = "cpu"):
    from mmrl.pipelines.flow.policy import FlowPolicy, build_family

    m, s = config.model, config.sampling
    family = build_family(m.family, m.pretrained, dtype=m.dtype, revision=m.revision,
                          max_sequence_length=s.max_sequence_length)
    lora = None
    if m.use_lora:
        lora = {"rank": m.lora_rank, "alpha": m.lora_alpha, "dropout": m.lora_dropout,
                "target_modules": m.lora_target_modules}
    return FlowPolicy(
        family, num_steps=s.num_steps, eval_num_steps=s.eval_num_steps, resolution=m.resolution, sde=s.sde,
        noise_level=s.noise_level, guidance_scale=s.guidance_scale, negative_prompt=s.negative_prompt,
        train_steps=s.train_steps, timestep_fraction=s.timestep_fraction, window_size=s.window_size,
        window_shift_every=s.window_shift_every, share_group_noise=s.share_group_noise, lora=lora,
        gradient_checkpointing=m.gradient_checkpointing, time_shift=s.time_shift, sample_batch_size=config.train.sample_batch_size,
        device=device,
    )


def build_reward_fn(config: Config):
    from mmrl.rewards import build_rewards

    return build_rewards(config.rewards)


def build_trainer(config: Config):
    from mmrl.trainer import Trainer

    accelerator = build_accelerator(config)
    torch.manual_seed(config.seed + accelerator.process_index)
    prompts = PromptSource(build_prompt_items(config), seed=config.seed, shuffle=config.data.shuffle)
    reward_fn = build_reward_fn(config)
    policy = build_policy(config, device=accelerator.device)
    if config.algorithm.beta > 0:
        policy.init_reference()
    return Trainer(config, policy, reward_fn, prompts, accelerator)


def cpu_threads_default() -> None:
    """Leave torch's default thread count unless the user set OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
