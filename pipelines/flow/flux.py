"""FLUX.1 family adapter (diffusers ``FluxPipeline``: FLUX.1-dev, FLUX.1-schnell).

What is specific to FLUX lives here; sampling, log-probabilities and training are shared
(:mod:`mmrl.pipelines.flow.policy`):

* **Prompt encoding.** CLIP gives only the pooled vector (``pooled_projections``), T5 gives the
  token sequence (``prompt_embeds``). The text position ids (``txt_ids``) are all zeros and the
  same for every prompt, so they are kept once on the adapter (:attr:`FluxFamily.text_ids`), not
  per sample.
* **Packed latents.** The state the SDE steps on is FLUX's *packed* latent: 2x2 patches of the
  16-channel VAE latent become tokens, ``[L, 64]`` per sample with ``L = (res / (8 * 2))^2`` for
  the real VAE. The policy's log-probabilities are means over all non-batch dimensions, so packing
  changes nothing there. Image position ids come from the pipeline's ``_prepare_latent_image_ids``.
* **Schedule.** Exactly ``FluxPipeline.__call__``'s: ``sigmas = linspace(1, 1/S, S)``, then the
  resolution-dependent shift ``mu = calculate_shift(image_seq_len, ...)`` from the scheduler
  config, ``scheduler.set_timesteps(sigmas=..., mu=...)``; the scheduler appends the terminal 0.
* **Transformer call.** The transformer takes ``timestep / 1000`` (it multiplies by 1000 inside)
  and, on guidance-distilled checkpoints (FLUX.1-dev, ``config.guidance_embeds``), the guidance
  scale as an *input* (``guidance``, one value per sample). There is no classifier-free guidance:
  one forward per step, and the policy passes ``negative=None``. A non-empty ``sampling.negative_prompt``
  is rejected (``ValueError`` from :class:`~mmrl.pipelines.flow.policy.FlowPolicy`): FLUX.1-dev is
  guidance-distilled, so there is no unconditional branch for it to steer (diffusers' ``FluxPipeline``
  can run a second, "true CFG" forward with ``true_cfg_scale``; mmrl does not implement it).
* **Decoding.** Unpack, ``/ scaling_factor + shift_factor`` (0.3611 / 0.1159 for FLUX.1), VAE.
* **LoRA.** ``FluxPipeline.save_lora_weights`` with the PEFT adapter config as metadata, so
  ``FluxPipeline.load_lora_weights`` restores the same rank *and* alpha (scale).

Anchors: Flow-GRPO's FLUX script (Liu et al. 2025, arXiv 2505.05470; ``scripts/train_flux.py``:
``timestep / 1000``, ``guidance = config.sample.guidance_scale`` per sample, zero ``txt_ids``,
packed latents and image ids from the pipeline, the LoRA targets in
:attr:`FluxFamily.default_lora_targets`), and DanceGRPO's FLUX trainer (Xue et al. 2025,
arXiv 2505.07818; ``fastvideo/train_grpo_flux.py``: packed latents, ``timestep / 1000``, distilled
guidance 3.5, ``/ 0.3611 + 0.1159`` decoding; it fine-tunes the full transformer and uses its own
``shift``-ed sigma list rather than the pipeline's dynamic shift). Flow-GRPO's FLUX recipe (``pickscore_flux``)
encodes prompts with 128 T5 tokens and samples 6 steps at noise level 0.9; mmrl's FLUX defaults are
``FluxPipeline``'s 512 tokens and the ``flow_grpo`` SDE's 0.7 (set ``sampling.max_sequence_length: 128``,
``sampling.noise_level: 0.9``, ``sampling.num_steps: 6`` for that recipe). Precision: mmrl keeps the trajectory in
fp32 and casts only the transformer's input, so its first ratio is exactly 1 under bf16 autocast; Flow-GRPO's FLUX
rollout stores bf16 latents and computes the old log-prob against the fp32 sample (its replayed log-probs differ
by up to 2.6e-4 on the tiny model, beside its clip range of 1e-4).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from mmrl.pipelines.flow.loading import PromptTruncation, load_pipeline, tokenizer_limit
from mmrl.pipelines.flow.policy import model_dtype


class FluxFamily:
    """Adapter over a loaded ``FluxPipeline``.

    Latents are packed, ``latent_shape(resolution) == (L, 4 * C)``. ``resolution`` must be a
    multiple of ``2 * vae_scale_factor`` (16 for FLUX.1, 4 for the tiny test model).
    """

    name = "flux"
    #: Flow-GRPO's FLUX LoRA targets (``scripts/train_flux.py``): attention projections of the
    #: double-stream blocks (image and text streams) and of the single-stream blocks (``attn.to_q/k/v``
    #: match both), plus the feed-forwards of both streams of the double-stream blocks.
    default_lora_targets = [
        "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
    ]

    def __init__(self, pipe, *, max_sequence_length: int = 512):
        self.pipe = pipe
        self.transformer = pipe.transformer
        #: the dtype the weights were loaded in (the policy later adds fp32 LoRA weights, or casts all of them to
        #: fp32 for full fine-tuning; the transformer's inputs follow the model called, see :meth:`velocity`)
        self.dtype = pipe.transformer.dtype
        self.max_sequence_length = max_sequence_length
        #: the prompts the text encoders cut, said once each (diffusers warned on every encode)
        self.truncation = PromptTruncation(lambda: [
            ("CLIP", getattr(pipe, "tokenizer", None), getattr(pipe, "tokenizer_max_length", None)),
            ("T5", getattr(pipe, "tokenizer_2", None), self.max_sequence_length)])
        #: ``[L_txt, 3]`` zeros: FLUX's text position ids, identical for every prompt (set by :meth:`encode`).
        self.text_ids: Tensor | None = None
        self._grids: dict[int, tuple[int, int]] = {}  # packed sequence length -> (height, width) in pixels

    @classmethod
    def from_pretrained(cls, pretrained: str, *, dtype: torch.dtype, revision: str | None = None, **kwargs):
        from diffusers import FluxPipeline

        return cls(load_pipeline(FluxPipeline, pretrained, dtype=dtype, revision=revision), **kwargs)

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    def text_token_limit(self) -> int | None:
        """The T5 tokenizer's ``model_max_length`` (None when it states none): prompts padded past it reach the
        transformer as a condition it was not made for."""
        return tokenizer_limit(getattr(self.pipe, "tokenizer_2", None))

    # ------------------------------------------------------------------------------------ conditioning

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict[str, Tensor]:
        """Conditioning tensors, one row per prompt (batch-first): T5 ``prompt_embeds [P, L_txt, D]`` and
        CLIP ``pooled_projections [P, D_pooled]``. The shared ``txt_ids`` are kept on :attr:`text_ids`."""
        embeds, pooled, text_ids = self.truncation.encode(list(prompts), lambda: self.pipe.encode_prompt(
            prompt=list(prompts), prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length,
        ))
        self.text_ids = text_ids
        return {"prompt_embeds": embeds, "pooled_projections": pooled}

    def _text_ids(self, length: int, device: torch.device) -> Tensor:
        if self.text_ids is None or self.text_ids.shape[0] != length:
            self.text_ids = torch.zeros(length, 3)  # what FluxPipeline.encode_prompt returns
        return self.text_ids.to(device)

    # ------------------------------------------------------------------------------------ latent layout

    def _check_resolution(self, resolution: int) -> int:
        multiple = 2 * self.pipe.vae_scale_factor
        if resolution <= 0 or resolution % multiple:
            raise ValueError(f"FLUX resolution must be a positive multiple of {multiple} "
                             f"(VAE factor {self.pipe.vae_scale_factor} x 2x2 packing), got {resolution}")
        return resolution // multiple  # tokens per side

    def latent_shape(self, resolution: int) -> tuple[int, ...]:
        """The packed latent of one sample: ``(L, 4 * C)``, ``L = (resolution / (2 * vae_scale_factor))^2``."""
        side = self._check_resolution(resolution)
        self._grids[side * side] = (resolution, resolution)
        return (side * side, self.transformer.config.in_channels)

    def seeded_noise(self, resolution: int, seed: int) -> Tensor:
        """One image's starting noise ``(L, 4C)`` for ``seed``, as ``FluxPipeline(generator=manual_seed(seed))``
        draws it: ``randn`` of the VAE latent ``(1, C, 2s, 2s)`` on the CPU, then packed into 2x2 patches (drawn in
        the packed shape directly, the same numbers land on other pixels: another image)."""
        side = self._check_resolution(resolution)
        self.latent_shape(resolution)  # registers the grid of this resolution
        channels = self.transformer.config.in_channels // 4
        noise = torch.randn((1, channels, 2 * side, 2 * side), generator=torch.Generator().manual_seed(int(seed)))
        return self.pipe._pack_latents(noise, 1, channels, 2 * side, 2 * side)[0]

    def _size(self, seq_len: int) -> tuple[int, int]:
        """Pixel ``(height, width)`` of a packed latent with ``seq_len`` tokens (square unless registered)."""
        if seq_len not in self._grids:
            side = math.isqrt(seq_len)
            if side * side != seq_len:
                raise ValueError(f"packed FLUX latent with {seq_len} tokens is not square; call latent_shape first")
            px = side * 2 * self.pipe.vae_scale_factor
            self._grids[seq_len] = (px, px)
        return self._grids[seq_len]

    def image_ids(self, seq_len: int, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
        """``[L, 3]`` image position ids, from the pipeline's ``_prepare_latent_image_ids``."""
        height, width = self._size(seq_len)
        factor = 2 * self.pipe.vae_scale_factor
        return self.pipe._prepare_latent_image_ids(1, height // factor, width // factor, device, dtype)

    # ----------------------------------------------------------------------------------------- schedule

    def schedule(self, num_steps: int, resolution: int) -> tuple[Tensor, Tensor]:
        """``(sigmas [S+1] with the terminal 0, timesteps [S])`` exactly as ``FluxPipeline.__call__`` sets them:
        ``linspace(1, 1/S, S)`` sigmas with the resolution-dependent shift ``mu`` (``use_dynamic_shifting``)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        seq_len = self.latent_shape(resolution)[0]
        scheduler = self.pipe.scheduler
        config = scheduler.config
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        if getattr(config, "use_flow_sigmas", False):
            sigmas = None
        mu = calculate_shift(
            seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        if sigmas is None:
            scheduler.set_timesteps(num_steps, device="cpu", mu=mu)
        else:
            scheduler.set_timesteps(sigmas=sigmas, device="cpu", mu=mu)
        return scheduler.sigmas.float().clone(), scheduler.timesteps.float().clone()

    # ----------------------------------------------------------------------------------------- velocity

    def velocity(self, model, latents: Tensor, timesteps: Tensor, cond: dict[str, Tensor],
                 negative: dict[str, Tensor] | None, guidance_scale: float, *, detach_uncond: bool = True) -> Tensor:
        """The model's velocity ``v = eps - x0`` (fp32) on packed latents ``[B, L, 4C]``.

        ``timesteps`` ``[B]`` are on the scheduler's 0..1000 scale; the transformer gets ``timesteps / 1000``.
        ``guidance_scale`` is FLUX.1-dev's distilled guidance (an input of the transformer, used only when
        ``transformer.config.guidance_embeds``). ``negative`` is always None: FLUX has no classifier-free guidance
        here (so ``detach_uncond`` has nothing to detach), and :class:`~mmrl.pipelines.flow.policy.FlowPolicy`
        rejects a non-empty ``negative_prompt`` for FLUX.
        Inputs are cast to ``model``'s own dtype (:func:`~mmrl.pipelines.flow.policy.model_dtype`): the load dtype
        for a LoRA policy and for any reference, fp32 for a fully fine-tuned policy.
        """
        dtype = model_dtype(model)
        x = latents.to(dtype)
        b, seq_len = x.shape[0], x.shape[1]
        embeds = cond["prompt_embeds"].to(dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((b,), float(guidance_scale), device=x.device, dtype=torch.float32)
        out = model(
            hidden_states=x,
            timestep=timesteps.to(device=x.device, dtype=torch.float32) / 1000,
            guidance=guidance,
            pooled_projections=cond["pooled_projections"].to(dtype),
            encoder_hidden_states=embeds,
            txt_ids=self._text_ids(embeds.shape[1], x.device).to(dtype),
            img_ids=self.image_ids(seq_len, x.device, dtype),
            return_dict=False,
        )[0]
        return out.float()

    # ------------------------------------------------------------------------------------------- output

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Packed latents ``[B, L, 4C]`` -> images ``[B, 3, H, W]`` in [0, 1] (fp32)."""
        vae = self.pipe.vae
        height, width = self._size(latents.shape[1])
        z = self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor)
        z = z.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    def save_lora(self, directory: str, transformer_lora_layers: dict[str, Tensor]) -> None:
        """Write ``pytorch_lora_weights.safetensors`` that ``FluxPipeline.load_lora_weights`` loads.

        The PEFT adapter config (rank, alpha, targets) is stored as metadata, so the loaded LoRA has the
        trained scale ``alpha / rank`` even when ``alpha != rank``.
        """
        peft_config = getattr(self.transformer, "peft_config", None) or {}
        metadata = next(iter(peft_config.values())).to_dict() if len(peft_config) == 1 else None
        self.pipe.save_lora_weights(directory, transformer_lora_layers=transformer_lora_layers,
                                    transformer_lora_adapter_metadata=metadata)
