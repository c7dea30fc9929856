"""Tiny real media for tests: images written with Pillow, mp4 videos encoded with PyAV, corrupt copies.

Video frames are solid colours from :data:`PALETTE` (levels 0/85/170/255 per channel, 64 colours at least
85 apart), so a decoded frame is identified by its nearest palette colour despite codec error.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

#: The tiny CPU recipe on a random SD3 (tiny:sd3, brightness): what most tests start from (the embedded default
#: mmrl/default.yaml is the ShapeWorld main job).
TINY_RECIPE = str(Path(__file__).resolve().parents[1] / "configs" / "tiny" / "flow_grpo.yaml")

LEVELS = (0, 85, 170, 255)
PALETTE = [(LEVELS[i % 4], LEVELS[(i // 4) % 4], LEVELS[(i // 16) % 4]) for i in range(64)]


def frame_colour(index: int) -> tuple[int, int, int]:
    """The solid RGB colour of frame ``index`` in videos from :func:`write_video` (cycles every 64 frames)."""
    return PALETTE[index % len(PALETTE)]


def nearest_frame(frame, num_frames: int = 64) -> int:
    """Which frame (``< num_frames``, ``<= 64``) a decoded solid frame shows: the nearest palette colour to
    its mean. ``frame`` is ``[3, H, W]`` or ``[H, W, 3]`` (tensor or array)."""
    array = np.asarray(frame, dtype=np.float64)
    channels_first = array.shape[0] == 3 and array.shape[-1] != 3
    mean = array.reshape(3, -1).mean(1) if channels_first else array.reshape(-1, 3).mean(0)
    distances = [np.abs(mean - np.array(frame_colour(i))).sum() for i in range(min(num_frames, len(PALETTE)))]
    return int(np.argmin(distances))


def write_image(path: str | Path, width: int = 64, height: int = 48, colour=(200, 30, 30), *,
                mode: str = "RGB") -> Path:
    """A solid image; the format follows the suffix (``.png``, ``.jpg``, ...). ``mode="RGBA"`` writes half
    transparency (PNG)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fill = tuple(colour) + ((128,) if mode == "RGBA" else ())
    Image.new(mode, (width, height), fill).save(path)
    return path


def write_gradient_image(path: str | Path, width: int = 64, height: int = 48) -> Path:
    """An image whose pixels all differ (a red/green gradient), for resize checks."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    x = np.linspace(0, 255, width, dtype=np.float64)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height, dtype=np.float64)[:, None].repeat(width, 1)
    array = np.stack([x, y, np.full_like(x, 64)], -1).round().astype(np.uint8)
    Image.fromarray(array).save(path)
    return path


def write_video(path: str | Path, num_frames: int = 40, width: int = 64, height: int = 48, fps: int = 10, *,
                codec: str = "libx264", faststart: bool = False) -> Path:
    """An mp4 whose frame ``i`` is solid :func:`frame_colour` ``(i)``, encoded with PyAV (near-lossless)."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), "w", options=options) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "10", "preset": "ultrafast"}
        for index in range(num_frames):
            array = np.empty((height, width, 3), np.uint8)
            array[:] = frame_colour(index)
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def truncate_file(source: str | Path, target: str | Path | None = None, fraction: float = 0.5) -> Path:
    """Keep the first ``fraction`` of ``source``'s bytes (in place, or into ``target``): a corrupt file."""
    source = Path(source)
    target = source if target is None else Path(target)
    data = source.read_bytes()
    target.write_bytes(data[:int(len(data) * fraction)])
    return target


def write_garbage(path: str | Path, size: int = 256) -> Path:
    """A file of non-media bytes (named like an image or a video)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes((i * 7 + 3) % 256 for i in range(size)))
    return path


def write_jsonl(path: str | Path, records: list) -> Path:
    """One JSON value per line; a ``str`` (UTF-8) or ``bytes`` record is written verbatim (malformed lines)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode("utf-8")
             for r in records]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def tiny_clip(directory: str | Path, extra_tokens: tuple[str, ...] = ("-</w>", "-")):
    """A tiny random transformers CLIP (16 wide, 32 px) and its processor with a letters-only BPE vocabulary written
    into ``directory``: ``(model, processor)``, the same every call (seeded)."""
    import string

    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {c: i for i, c in enumerate(string.ascii_lowercase)}
    vocab.update({c + "</w>": len(vocab) + i for i, c in enumerate(string.ascii_lowercase)})
    for token in (*extra_tokens, "<|startoftext|>", "<|endoftext|>"):
        vocab[token] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(vocab=str(directory / "vocab.json"), merges=str(directory / "merges.txt"))
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                 crop_size={"height": 32, "width": 32}),
                              tokenizer=tokenizer)
    text = dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=77, projection_dim=8,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(image_size=32, patch_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, projection_dim=8)
    torch.manual_seed(0)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).eval(), processor


def tiny_mask2former(names: list[str]):
    """A tiny random transformers Mask2Former (Swin backbone, 20 queries) over the class ``names`` and its processor:
    ``(model, processor)``, the same every call (seeded)."""
    import torch
    from transformers import (Mask2FormerConfig, Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessor,
                              SwinConfig)

    backbone = SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2],
                          window_size=4, out_features=["stage1", "stage2", "stage3", "stage4"])
    config = Mask2FormerConfig(
        backbone_config=backbone, num_labels=len(names), id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)}, hidden_dim=32, mask_feature_size=32, feature_size=32,
        encoder_layers=1, decoder_layers=2, num_queries=20, encoder_feedforward_dim=64, dim_feedforward=64,
        num_attention_heads=2, common_stride=4, use_pretrained_backbone=False)
    torch.manual_seed(0)
    model = Mask2FormerForUniversalSegmentation(config).eval()
    return model, Mask2FormerImageProcessor(size={"shortest_edge": 64, "longest_edge": 128})


# ------------------------------------------------------------------------------------------------ CLI helpers


def one_error(capsys, *words) -> str:
    """The single ``mmrl: error:`` line a failed command printed (asserting there is exactly one, holding every
    one of ``words``)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mmrl: error: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def tiny_flow_config(base: Path, *, max_sequence_length: int = 16, cached: bool = False) -> Path:
    """``base/tiny.yaml``: the repository's tiny CPU recipe (configs/tiny/flow_grpo.yaml) on a tiny random SD3 built in
    ``base/sd3`` (``cached``: the recipe's own ``tiny:sd3``, built once into ``$MMRL_CACHE``), its runs in
    ``base/run``."""
    import yaml

    from mmrl.pipelines.flow.tiny import build_tiny_sd3

    data = yaml.safe_load((Path(__file__).parents[1] / "configs/tiny/flow_grpo.yaml").read_text())
    if not cached:
        data["model"]["pretrained"] = str(build_tiny_sd3(base / "sd3"))
    data["sampling"]["max_sequence_length"] = max_sequence_length
    data["output_dir"] = str(base / "run")
    path = base / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def metrics_rows(run: Path) -> list[dict]:
    """The rows of a run's ``metrics.jsonl``."""
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
