"""VLM-as-judge rewards on a frozen Qwen-VL model (Qwen2-VL, Qwen2.5-VL and newer Qwen-VL generations that
transformers' ``AutoModelForImageTextToText`` loads).

``vlm_judge`` -- the probability that the VLM answers "yes" to a question about the image (the
VQAScore / VIEScore family: Lin et al. 2024, "Evaluating Text-to-Visual Generation with Image-to-Text
Generation", arXiv:2404.01291; Flow-GRPO's and DanceGRPO's VLM rewards use the same yes-probability)::

    question = template.format(prompt=prompt, **metadata)     # default template below
    logits   = VLM(chat(image, question) + "<|im_start|>assistant\\n")[-1]   # next-token logits
    score    = sum_{t in YES} exp(logits[t]) / sum_{t in YES or NO} exp(logits[t])

``YES`` / ``NO`` are the token variants "yes", "Yes", " yes", " Yes", "YES" (and the "no" forms) that
the tokenizer encodes as ONE token; the probability is renormalised over just those tokens (so it is
P(yes | the answer is yes or no)). Extra key ``"logit_yes_no"``: ``logsumexp(YES) - logsumexp(NO)``.

``prompt_echo`` -- PromptEcho (Huang et al. 2026, "PromptEcho: Annotation-Free Reward from
Vision-Language Models for Text-to-Image Reinforcement Learning", arXiv:2604.12652): the frozen VLM,
teacher-forced, reads the image and a fixed query ("Describe this image in detail.") and must "echo" the
original prompt as its answer; the reward is the mean token log-likelihood of the prompt (= minus the
token-level cross-entropy)::

    tokens = chat(image, query) + "<|im_start|>assistant\\n"  ++  tokenize(prompt)
    score  = mean_{t in prompt tokens} log p(token_t | image, query, prompt tokens < t)

The prompt is tokenised on its own and appended to the templated prefix (no end-of-turn token, unless
``include_eos=True``, which adds ``<|im_end|>`` to the scored tokens). Extra keys ``"sum_logprob"``
and ``"num_tokens"``.

Both batch images (``batch_size`` per forward) with left padding (Qwen's M-RoPE positions come from the
attention mask), keep only the logits they need (``logits_to_keep``) and run the model in ``dtype``
(default bfloat16 on CUDA, float32 on CPU); scores are computed in float32. Images are given to the
processor as PIL images (tensor inputs are quantised ``round(x * 255)`` first); the processor's pixel
budget (``min_pixels`` / ``max_pixels``) applies. The model loads from a hub id, a local directory or
``tiny:qwen2_5_vl`` / ``tiny:qwen2_vl`` (mmrl's tiny random test models); missing weights offline raise
:class:`~mmrl.rewards.MissingWeightsError` naming the files.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from ._base import ImageBatch, MissingWeightsError, Reward, register_reward, resolve_device, resolve_dtype
from ._base import check_available as _check_available

__all__ = ["VLMJudge", "PromptEcho", "load_judge_vlm", "DEFAULT_JUDGE", "DEFAULT_TEMPLATE", "DEFAULT_QUERY"]

DEFAULT_JUDGE = "Qwen/Qwen2.5-VL-7B-Instruct"
DEFAULT_TEMPLATE = "Does this image match the description: {prompt}? Answer yes or no."
DEFAULT_QUERY = "Describe this image in detail."
YES_WORDS = ("yes", "Yes", " yes", " Yes", "YES")
NO_WORDS = ("no", "No", " no", " No", "NO")

_VLM_FILES = [
    [["config.json"]],
    [["model.safetensors"], ["model.safetensors.index.json"], ["pytorch_model.bin"], ["pytorch_model.bin.index.json"]],
    [["preprocessor_config.json"], ["processor_config.json"]],
    [["tokenizer.json"], ["vocab.json", "merges.txt"]],
]


def load_judge_vlm(model: str | os.PathLike, *, dtype: torch.dtype | None = None, min_pixels: int | None = None,
                   max_pixels: int | None = None):
    """``(model, processor)`` from a hub id, a local directory or ``tiny:<kind>``; missing files offline raise
    :class:`MissingWeightsError` saying which and where to put them."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrl.pipelines.flow.loading import transformers_load_kwargs

    source = os.fspath(model)
    if source.startswith("tiny:"):
        from mmrl.pipelines.vlm.tiny import ensure_tiny_vlm

        source = str(ensure_tiny_vlm(source.split(":", 1)[1]))
    _check_available(source, _VLM_FILES, "VLM judge", "model")
    try:
        vlm = AutoModelForImageTextToText.from_pretrained(source, dtype=dtype or torch.float32,
                                                          **transformers_load_kwargs())
        pixel_kwargs = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        processor = AutoProcessor.from_pretrained(source, **pixel_kwargs)
    except OSError as exc:
        raise MissingWeightsError(
            f"could not load the VLM judge {source!r}: {exc}. It needs config.json, model.safetensors (or its "
            "index and shards), preprocessor_config.json and tokenizer files; pass model=<local dir>."
        ) from exc
    return vlm, processor


class _QwenVLScorer(Reward):
    """Loading, placement and chat templating shared by the two judges."""

    needs_prompts = True

    def __init__(self, model: Any, processor: Any, device, dtype, batch_size: int, system_prompt: str | None,
                 min_pixels: int | None, max_pixels: int | None):
        super().__init__()
        dtype = resolve_dtype(dtype)
        if isinstance(model, (str, os.PathLike)):
            device = resolve_device(device)
            if dtype is None:
                dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            model, loaded_processor = load_judge_vlm(model, dtype=dtype, min_pixels=min_pixels, max_pixels=max_pixels)
            processor = processor if processor is not None else loaded_processor
        if processor is None:
            raise ValueError("a VLM passed in built needs its processor (processor=...)")
        if isinstance(processor, (str, os.PathLike)):
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(os.fspath(processor))
        if device is not None or dtype is not None:
            model = model.to(device=None if device is None else torch.device(device), dtype=dtype)
        self.model = model.eval().requires_grad_(False)
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.batch_size = int(batch_size)
        self.system_prompt = system_prompt

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def prefix(self, text: str) -> str:
        """The chat-templated user turn (image, then ``text``) and the opened assistant turn."""
        messages = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": [{"type": "text", "text": self.system_prompt}]})
        messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]})
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _forward(self, inputs: dict[str, torch.Tensor], keep: int) -> torch.Tensor:
        inputs = {k: (v.to(self.device) if torch.is_tensor(v) else v) for k, v in inputs.items()}
        for key in ("pixel_values", "pixel_values_videos"):
            if key in inputs:
                inputs[key] = inputs[key].to(next(self.model.parameters()).dtype)
        return self.model(**inputs, logits_to_keep=keep, use_cache=False).logits.float()


@register_reward("vlm_judge")
class VLMJudge(_QwenVLScorer):
    """P(yes) of a Qwen-VL judge for a question about the image; see the module docstring for the rule."""

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module = DEFAULT_JUDGE,
        processor: Any = None,
        template: str = DEFAULT_TEMPLATE,
        yes_words: Sequence[str] = YES_WORDS,
        no_words: Sequence[str] = NO_WORDS,
        system_prompt: str | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 8,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ):
        """Args:
        model: hub id / local directory / ``tiny:qwen2_5_vl`` of a Qwen-VL checkpoint, or a built model.
        processor: its processor (required for a built model; default: the checkpoint's own).
        template: the question; ``{prompt}`` is the sample's prompt, other ``{fields}`` come from its metadata
            (a sample missing one is NaN).
        yes_words, no_words: answer variants; those that are a single token are used (at least one each).
        system_prompt: an optional system message (default: the chat template's own).
        device, dtype: default CUDA + bfloat16 when available, else CPU + float32 (when loading).
        batch_size: images per forward.
        min_pixels, max_pixels: the processor's image pixel budget (when loading).
        """
        super().__init__(model, processor, device, dtype, batch_size, system_prompt, min_pixels, max_pixels)
        self.template = template
        self.yes_ids = self._single_tokens(yes_words, "yes_words")
        self.no_ids = self._single_tokens(no_words, "no_words")
        overlap = set(self.yes_ids) & set(self.no_ids)
        if overlap:
            raise ValueError(f"yes and no words share token ids {sorted(overlap)}")

    def _single_tokens(self, words: Sequence[str], what: str) -> list[int]:
        ids = []
        for w in words:
            enc = self.tokenizer(w, add_special_tokens=False)["input_ids"]
            if len(enc) == 1 and enc[0] not in ids:
                ids.append(int(enc[0]))
        if not ids:
            raise ValueError(f"none of {what}={list(words)} is a single token for this tokenizer")
        return ids

    def question(self, prompt: str, metadata: dict | None) -> str:
        fields = dict(metadata or {})
        fields["prompt"] = prompt
        return self.template.format(**fields)

    @torch.inference_mode()
    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        valid = batch.valid_indices
        prompts = batch.valid_prompts()
        pils = batch.pil()
        score = torch.full((len(valid),), float("nan"))
        margin = torch.full((len(valid),), float("nan"))
        todo, texts = [], []
        for pos, i in enumerate(valid):
            meta = batch.metadata[i] if batch.metadata is not None else None
            try:
                texts.append(self.prefix(self.question(prompts[pos], meta if isinstance(meta, dict) else None)))
                todo.append(pos)
            except (KeyError, IndexError, ValueError, TypeError, AttributeError) as exc:  # a field missing or of a
                # type its format spec cannot take ({n:.2f} of None, {x[0]} of an int)
                reasons[i] = f"cannot fill the question template: {type(exc).__name__}: {exc}"
        yes = torch.tensor(self.yes_ids)
        no = torch.tensor(self.no_ids)
        for start in range(0, len(todo), self.batch_size):
            chunk = todo[start:start + self.batch_size]
            try:
                inputs = self.processor(text=texts[start:start + self.batch_size], images=[pils[p] for p in chunk],
                                        padding=True, padding_side="left", return_tensors="pt")
                logits = self._forward(dict(inputs), keep=1)[:, -1].cpu()
            except Exception as exc:  # a failing chunk is NaN for its samples, with the reason
                for p in chunk:
                    reasons[valid[p]] = f"VLM forward failed: {type(exc).__name__}: {exc}"
                continue
            lse_yes = torch.logsumexp(logits[:, yes], dim=-1)
            lse_no = torch.logsumexp(logits[:, no], dim=-1)
            index = torch.tensor(chunk)
            score[index] = torch.exp(lse_yes - torch.logaddexp(lse_yes, lse_no))
            margin[index] = lse_yes - lse_no
        return {self.name: score, "logit_yes_no": margin}


@register_reward("prompt_echo")
class PromptEcho(_QwenVLScorer):
    """PromptEcho: mean log-likelihood of the prompt under a frozen Qwen-VL given the image; see the module
    docstring for the rule."""

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module = DEFAULT_JUDGE,
        processor: Any = None,
        query: str = DEFAULT_QUERY,
        include_eos: bool = False,
        system_prompt: str | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 8,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ):
        """Args:
        model, processor, system_prompt, device, dtype, batch_size, min_pixels, max_pixels: as
            :class:`VLMJudge`.
        query: the user's instruction shown with the image (PromptEcho: "Describe this image in detail.").
        include_eos: also score the end-of-turn token after the prompt.
        """
        super().__init__(model, processor, device, dtype, batch_size, system_prompt, min_pixels, max_pixels)
        self.query = query
        self.include_eos = bool(include_eos)
        self.eos_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>") if include_eos else None
        if include_eos and (self.eos_id is None or self.eos_id == self.tokenizer.unk_token_id):
            raise ValueError("include_eos=True but the tokenizer has no <|im_end|> token")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def target_ids(self, prompt: str) -> list[int]:
        ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if self.include_eos:
            ids.append(int(self.eos_id))
        return ids

    def _inputs(self, prefixes: list[str], images: list, targets: list[list[int]]) -> dict[str, torch.Tensor]:
        """Processor output for the prefixes (image tokens expanded), the targets appended, left-padded."""
        enc = self.processor(text=prefixes, images=images, padding=True, padding_side="left", return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        types = enc.get("mm_token_type_ids")
        rows = []
        for r in range(len(prefixes)):
            keep = mask[r].bool()
            rows.append((ids[r][keep], None if types is None else types[r][keep]))
        full = [torch.cat([p, torch.tensor(t, dtype=p.dtype)]) for (p, _), t in zip(rows, targets)]
        width = max(len(f) for f in full)
        out = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        out["input_ids"] = torch.stack([torch.cat([f.new_full((width - len(f),), self.pad_id), f]) for f in full])
        out["attention_mask"] = torch.stack(
            [torch.cat([torch.zeros(width - len(f), dtype=mask.dtype), torch.ones(len(f), dtype=mask.dtype)])
             for f in full])
        if types is not None:
            out["mm_token_type_ids"] = torch.stack([
                torch.cat([tt.new_zeros(width - len(f)), tt, tt.new_zeros(len(t))])
                for (_, tt), f, t in zip(rows, full, targets)])
        return out

    @torch.inference_mode()
    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        valid = batch.valid_indices
        prompts = batch.valid_prompts()
        pils = batch.pil()
        mean = torch.full((len(valid),), float("nan"))
        total = torch.full((len(valid),), float("nan"))
        count = torch.full((len(valid),), float("nan"))
        todo, targets = [], []
        for pos, i in enumerate(valid):
            t = self.target_ids(prompts[pos])
            if not t:
                reasons[i] = "empty prompt: nothing to echo"
                continue
            todo.append(pos)
            targets.append(t)
        prefix = self.prefix(self.query)
        for start in range(0, len(todo), self.batch_size):
            chunk = todo[start:start + self.batch_size]
            tgt = targets[start:start + self.batch_size]
            longest = max(len(t) for t in tgt)
            try:
                inputs = self._inputs([prefix] * len(chunk), [pils[p] for p in chunk], tgt)
                logits = self._forward(inputs, keep=longest + 1).cpu()  # [b, longest + 1, V]
            except Exception as exc:
                for p in chunk:
                    reasons[valid[p]] = f"VLM forward failed: {type(exc).__name__}: {exc}"
                continue
            logps = torch.log_softmax(logits[:, :-1], dim=-1)  # position j predicts token j + 1 of the kept window
            for row, (p, t) in enumerate(zip(chunk, tgt)):
                n = len(t)
                picked = logps[row, longest - n:].gather(-1, torch.tensor(t).unsqueeze(-1)).squeeze(-1)
                total[p] = picked.sum()
                count[p] = n
                mean[p] = picked.mean()
        return {self.name: mean, "sum_logprob": total, "num_tokens": count}
