"""Stable Diffusion 3 / 3.5 family adapter (diffusers ``StableDiffusion3Pipeline``).

What is specific to SD3 lives here: prompt encoding with the two CLIP encoders and T5, the
transformer call with classifier-free guidance (negative and positive batches concatenated, one
forward), the timestep convention (``t = 1000 * sigma``), VAE decoding with SD3's scaling and shift
factors, and the diffusers LoRA file format. Sampling, log-probabilities and training are shared
(:mod:`mmrl.pipelines.flow.policy`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmrl.pipelines.flow.loading import PromptTruncation, load_pipeline, tokenizer_limit
from mmrl.pipelines.flow.policy import model_dtype


class SD3Family:
    """Adapter over a loaded ``StableDiffusion3Pipeline``."""

    name = "sd3"
    default_lora_targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]

    def __init__(self, pipe, *, max_sequence_length: int = 256):
        self.pipe = pipe
        self.transformer = pipe.transformer
        #: the dtype the weights were loaded in (the policy later adds fp32 LoRA weights, or casts all of them to
        #: fp32 for full fine-tuning; the transformer's inputs follow the model called, see :meth:`velocity`)
        self.dtype = pipe.transformer.dtype
        self.max_sequence_length = max_sequence_length
        #: the prompts the text encoders cut, said once each (diffusers warned on every encode)
        self.truncation = PromptTruncation(lambda: [
            ("CLIP", getattr(pipe, "tokenizer", None), getattr(pipe, "tokenizer_max_length", None)),
            ("T5", getattr(pipe, "tokenizer_3", None), self.max_sequence_length)])

    @classmethod
    def from_pretrained(cls, pretrained: str, *, dtype: torch.dtype, revision: str | None = None, **kwargs):
        from diffusers import StableDiffusion3Pipeline

        return cls(load_pipeline(StableDiffusion3Pipeline, pretrained, dtype=dtype, revision=revision), **kwargs)

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    def text_token_limit(self) -> int | None:
        """The T5 tokenizer's ``model_max_length`` (None when it states none): prompts padded past it reach the
        transformer as a condition it was not made for."""
        return tokenizer_limit(getattr(self.pipe, "tokenizer_3", None))

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict[str, Tensor]:
        """Conditioning tensors, one row per prompt (batch-first)."""
        embeds, _, pooled, _ = self.truncation.encode(prompts, lambda: self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        ))
        return {"prompt_embeds": embeds, "pooled_projections": pooled}

    def max_resolution(self) -> int | None:
        """The largest image side the transformer's positional embedding covers (``pos_embed_max_size`` patches x
        patch size x VAE factor), None when it has no limit."""
        config = self.transformer.config
        patches = getattr(config, "pos_embed_max_size", None)
        return None if patches is None else patches * config.patch_size * self.pipe.vae_scale_factor

    def latent_shape(self, resolution: int) -> tuple[int, ...]:
        """``(C, H, W)`` of one latent; a ``ValueError`` for a side the model cannot generate."""
        config, factor = self.transformer.config, self.pipe.vae_scale_factor
        multiple = factor * config.patch_size
        if resolution <= 0 or resolution % multiple:
            raise ValueError(f"SD3 resolution must be a positive multiple of {multiple} (VAE factor {factor} x "
                             f"patch {config.patch_size}), got {resolution}")
        largest = self.max_resolution()
        if largest is not None and resolution > largest:
            raise ValueError(f"resolution {resolution} is larger than this SD3 model can generate: its positional "
                             f"embedding covers {largest} px (pos_embed_max_size {config.pos_embed_max_size} x "
                             f"{multiple}); set model.resolution (mmrl train) or resolution= (mmrl eval) to at most "
                             f"{largest}")
        return (config.in_channels, resolution // factor, resolution // factor)

    def seeded_noise(self, resolution: int, seed: int) -> Tensor:
        """One image's starting noise ``(C, H, W)`` for ``seed``, as ``StableDiffusion3Pipeline(generator=
        manual_seed(seed))`` draws it on the CPU."""
        return torch.randn(self.latent_shape(resolution), generator=torch.Generator().manual_seed(int(seed)))

    def schedule(self, num_steps: int, resolution: int) -> tuple[Tensor, Tensor]:
        """``(sigmas [S+1] with the terminal 0, timesteps [S])`` from the pipeline's scheduler (shift 3 for SD3.5), as
        ``StableDiffusion3Pipeline.__call__`` sets them: a scheduler with ``use_dynamic_shifting`` gets the shift
        ``mu`` of the image's token count (``calculate_shift``, its defaults 256 / 4096 / 0.5 / 1.16)."""
        scheduler = self.pipe.scheduler
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", None):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            _, height, width = self.latent_shape(resolution)
            patch = self.transformer.config.patch_size
            config = scheduler.config
            kwargs["mu"] = calculate_shift((height // patch) * (width // patch), config.get("base_image_seq_len", 256),
                                           config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                                           config.get("max_shift", 1.16))
        scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
        return scheduler.sigmas.float().clone(), scheduler.timesteps.float().clone()

    def velocity(self, model, latents: Tensor, timesteps: Tensor, cond: dict[str, Tensor],
                 negative: dict[str, Tensor] | None, guidance_scale: float, *, detach_uncond: bool = True) -> Tensor:
        """The model's velocity ``v = eps - x0`` (fp32), with CFG in one batched forward when ``negative`` is given.

        ``detach_uncond`` (``sampling.cfg_detach_uncond``): the unconditional half enters the guided velocity
        detached, as Flow-GRPO's training forward from 2d76907 (``scripts/train_sd3.py`` ``compute_log_prob``:
        ``noise_pred_uncond.detach()``) and the forks built on it do: the values are the same, and the policy gradient
        flows through the conditional branch only (``guidance_scale`` x its gradient). False: through both halves,
        ``(1 - guidance_scale)`` x the unconditional branch's gradient besides, as the newest Flow-GRPO
        ``compute_log_prob`` (74db691, no detach) computes it.

        Inputs are cast to ``model``'s own dtype (:func:`~mmrl.pipelines.flow.policy.model_dtype`): the load dtype
        for a LoRA policy and for any reference, fp32 for a fully fine-tuned policy."""
        dtype = model_dtype(model)
        x = latents.to(dtype)
        embeds, pooled = cond["prompt_embeds"].to(dtype), cond["pooled_projections"].to(dtype)
        if negative is not None:
            n = x.shape[0]
            x = torch.cat([x, x])
            timesteps = torch.cat([timesteps, timesteps])
            embeds = torch.cat([negative["prompt_embeds"].to(dtype).expand(n, -1, -1), embeds])
            pooled = torch.cat([negative["pooled_projections"].to(dtype).expand(n, -1), pooled])
        out = model(hidden_states=x, timestep=timesteps.float(), encoder_hidden_states=embeds,
                    pooled_projections=pooled, return_dict=False)[0].float()
        if negative is None:
            return out
        uncond, text = out.chunk(2)
        if detach_uncond:
            uncond = uncond.detach()
        return uncond + guidance_scale * (text - uncond)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents -> images ``[B, 3, H, W]`` in [0, 1] (fp32)."""
        vae = self.pipe.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    def save_lora(self, directory: str, transformer_lora_layers: dict[str, Tensor]) -> None:
        """Write ``pytorch_lora_weights.safetensors`` that ``StableDiffusion3Pipeline.load_lora_weights`` loads, with
        the adapter config as metadata so rank *and* alpha (the scale) load back."""
        self.pipe.save_lora_weights(directory, transformer_lora_layers=transformer_lora_layers,
                                    transformer_lora_adapter_metadata=self.transformer.peft_config["default"].to_dict())
