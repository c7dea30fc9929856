"""What a trained video model reads of its clip: the per-token loss of each line's target completion (its SFT target
field, teacher-forced) with the clip as given and with its pixels replaced, over the first ``--limit`` lines:

* ``reversed``: the temporal slots (the tower's frame pairs) in reverse order: a model that reads *when* something
  happens loses here, one that reads only *what* is in the clip does not;
* ``first_slot``: every slot replaced by the first (a still clip of its opening);
* ``other_clip``: the next line's clip (of the same grid) in the batch: a model that reads the clip's content loses;
* ``zero``: every pixel value 0 (an input no training clip has).

    python benchmarks/clip_dependence.py CONFIG DATA.jsonl [--limit 48] [--batch-size 8] [--target-field sft_target]
                                         [--out report.json]

CONFIG is an ``mmrl train`` config of a ``qwen_vl`` model (its ``generation`` section builds the prompts exactly as
rollouts and ``mmrl sft`` do); DATA a VLM JSONL whose lines have a video and the target field, or a ShapeWorld set
(``shapeworld:heldout:96:temporal_grounding``). Prints one JSON line:
the mean per-token loss of each input, the number of lines, and the lines left out of ``other_clip`` (no other line
of the same grid in their batch). The README's ShapeWorld section reports it for the tiny video bases."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

VARIANTS = ("clip", "reversed", "first_slot", "other_clip", "zero")


def _per_line_loss(policy, batch, pixels: torch.Tensor) -> torch.Tensor:
    """Mean per-token cross-entropy of each row's labelled tokens with ``pixels`` as the batch's video pixels."""
    kwargs = dict(batch.model_kwargs, pixel_values_videos=pixels)
    with torch.no_grad():
        logits = policy.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **kwargs,
                              use_cache=False).logits[:, :-1].float()
    labels = batch.labels[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return ce.sum(1) / (labels != -100).sum(1)


def replaced(pixels: torch.Tensor, grids: torch.Tensor, variant: str) -> tuple[torch.Tensor, list[int]]:
    """The batch's video pixel rows (processor order: each clip's rows slot by slot) under ``variant``, and the
    clips ``other_clip`` could not replace (no other clip of the same grid): those keep their own pixels."""
    clips, start = [], 0
    for t, h, w in grids.tolist():
        clips.append(pixels[start:start + t * h * w].view(t, h * w, -1))
        start += t * h * w
    kept: list[int] = []
    if variant == "clip":
        out = clips
    elif variant == "reversed":
        out = [c.flip(0) for c in clips]
    elif variant == "first_slot":
        out = [c[:1].expand_as(c) for c in clips]
    elif variant == "zero":
        out = [torch.zeros_like(c) for c in clips]
    elif variant == "other_clip":
        out = []
        for i, c in enumerate(clips):
            same = [j for j in range(len(clips)) if j != i and clips[j].shape == c.shape]
            partner = min((j for j in same if j > i), default=min(same, default=None))
            if partner is None:
                kept.append(i)
            out.append(c if partner is None else clips[partner])
    else:
        raise ValueError(f"unknown variant {variant!r}; variants: {', '.join(VARIANTS)}")
    return torch.cat([c.reshape(-1, c.shape[-1]) for c in out]), kept


def clip_dependence(config_path: str, data: str, *, limit: int = 48, batch_size: int = 8,
                    target_field: str = "sft_target") -> dict:
    from mmrl.build import build_vlm_policy, policy_coord_format
    from mmrl.config import load_config
    from mmrl.data.shapeworld import resolve_vlm_spec
    from mmrl.data.vlm import read_vlm_jsonl
    from mmrl.sft import collate

    config = load_config(config_path, ["model.freeze_vision=false"])  # the pixels, not cached features, reach the tower
    if config.model.family != "qwen_vl":
        raise SystemExit(f"clip_dependence: {config_path} is not a qwen_vl config")
    spec, data = data, resolve_vlm_spec(data, coord_format=policy_coord_format(config), seed=0)  # shapeworld:...
    policy = build_vlm_policy(config)
    policy.model.eval()
    samples = [s for s in read_vlm_jsonl(data) if s.video_path is not None][:limit]
    missing = [s.source for s in samples if not s.metadata.get(target_field)]
    if not samples or missing:
        raise SystemExit(f"clip_dependence: {data}: " + (f"lines without {target_field!r}: {missing[:3]}" if missing
                                                         else "no line with a video"))
    losses: dict[str, list[float]] = {v: [] for v in VARIANTS}
    left_out = 0
    for i in range(0, len(samples), batch_size):
        batch = collate(policy, samples[i:i + batch_size], target_field)
        pixels, grids = batch.model_kwargs["pixel_values_videos"], batch.model_kwargs["video_grid_thw"]
        for variant in VARIANTS:
            new, kept = replaced(pixels, grids, variant)
            per_line = _per_line_loss(policy, batch, new).tolist()
            if variant == "other_clip":
                left_out += len(kept)
                per_line = [x for j, x in enumerate(per_line) if j not in kept]
            losses[variant] += per_line
    return {"config": str(config_path), "data": str(spec), "pretrained": config.model.pretrained,
            "lines": len(samples), "other_clip_left_out": left_out,
            "loss": {v: (sum(x) / len(x) if x else None) for v, x in losses.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("data")
    parser.add_argument("--limit", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--target-field", default="sft_target")
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    report = clip_dependence(args.config, args.data, limit=args.limit, batch_size=args.batch_size,
                             target_field=args.target_field)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
