"""Run outputs on the main process: ``metrics.jsonl`` (one object per update), TensorBoard, optional wandb,
and image grids."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def make_grid_image(images: torch.Tensor, rows: int):
    """``[R*C, 3, H, W]`` in [0, 1] -> a PIL image grid with ``rows`` rows."""
    from PIL import Image

    count, _, height, width = images.shape
    cols = math.ceil(count / rows)
    grid = torch.zeros(3, rows * height, cols * width)
    for i, image in enumerate(images):
        r, c = divmod(i, cols)
        grid[:, r * height:(r + 1) * height, c * width:(c + 1) * width] = image
    array = (grid.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(array)


class MetricsLogger:
    """Appends metrics to ``metrics.jsonl`` and mirrors them to TensorBoard / wandb."""

    def __init__(self, output_dir: str | Path, *, tensorboard: bool = True, wandb_project: str | None = None,
                 config: dict[str, Any] | None = None, resume_step: int | None = None):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        elif resume_step is None:  # a new run where another left its logs (killed before any checkpoint): kept aside
            from mmrl.checkpoint import move_aside

            for old in (self.path, self.output_dir / "tensorboard"):
                if old.exists() and (old.is_file() or any(old.iterdir())):
                    logger.warning("%s is from an earlier run in this output_dir (no checkpoint to resume): moved "
                                   "to %s", old, move_aside(old).name)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # on resume, drop the events a killed run logged after its checkpoint (they are redone)
            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(str(self.output_dir / "tensorboard"), purge_step=purge)
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError as exc:
                raise RuntimeError("logging.wandb_project is set but wandb is not installed: "
                                   "pip install 'mmrl-align[wandb]'") from exc
            self._wandb = wandb.init(project=wandb_project, config=config, dir=str(self.output_dir),
                                     resume="allow")

    def _truncate_after(self, step: int) -> None:
        """Drop lines logged after the checkpoint we resume from (a killed run may have logged further) and lines
        that are not a JSON object (a run killed while writing one leaves half a line), then replace the file in one
        ``os.replace`` so a kill during the rewrite keeps the old file."""
        kept, broken = [], 0
        for line in self.path.read_text(errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict):
                broken += 1
                continue
            if row.get("step", 0) <= step:
                kept.append(line)
        if broken:
            logger.warning("%s: dropped %d line(s) that are not a JSON object (a run killed while logging)",
                           self.path, broken)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def log(self, metrics: dict[str, Any]) -> None:
        step = int(metrics["step"])
        clean = {k: (float(v) if isinstance(v, (int, float, torch.Tensor)) and k != "step" else v)
                 for k, v in metrics.items()}
        with self.path.open("a") as handle:
            handle.write(json.dumps(clean) + "\n")
        if self._tb is not None:
            for key, value in clean.items():
                if key != "step" and isinstance(value, float) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def log_image(self, key: str, image, step: int) -> None:
        if self._tb is not None:
            import numpy as np

            self._tb.add_image(key, np.asarray(image), step, dataformats="HWC")
        if self._wandb is not None:
            import wandb

            self._wandb.log({key: wandb.Image(image)}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
