"""What the benchmark scripts share: their JSON line written to ``--out`` and printed, and a live tensor-memory
tracker (:class:`LiveBytes`, :func:`peak_bytes`)."""

from __future__ import annotations

import json
import platform
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


ROOT = Path(__file__).resolve().parent.parent
#: the VLM recipe the mid-size VLM benchmarks train (LoRA r8 on ShapeWorld grounding prompts)
VLM_RECIPE = ROOT / "configs" / "tiny" / "vlm_grounding.yaml"


def mid_vlm_arguments(ap, result_name: str, *, set_help: str = "an mmrl config override") -> None:
    """The options the benchmarks on ``overhead.mid_size_vlm`` share: the rollout's shape, the model's size, the
    rounds, the seed, config overrides and the result file ``benchmarks/results/<result_name>``."""
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=512, help="decoder width (a multiple of 64)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=set_help)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / result_name)


def versions() -> dict:
    return {"torch": torch.__version__, "python": platform.python_version()}


def skipped(bench: str, reason: str) -> int:
    """A bench that cannot run here (its peer or engine is absent): one JSON line saying why, exit code 0, and
    nothing written, so the results a machine that can run it committed stay."""
    print(json.dumps({"bench": bench, "ok": True, "skipped": reason}))
    return 0


def finish(line: dict, out: Path) -> int:
    """Write ``line`` (indented) to ``out``, print it as one line; exit code 0 when ``line["ok"]``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(line, indent=1, default=str) + "\n")
    print(json.dumps(line, default=str))
    return 0 if line["ok"] else 1


class LiveBytes(TorchDispatchMode):
    """Inside the block: ``current`` is the bytes of every live tensor storage seen (those passed to the
    constructor, and every storage an op creates from then on), ``peak`` its maximum. A storage counts from the op
    that creates it until it is freed (a finalizer on the storage), once however many tensors view it."""

    def __init__(self, existing=()):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        for tensor in existing:
            self.track(tensor)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        size = storage.nbytes()
        self.live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.track(value)
        return out


def peak_bytes(fn, *args, **kwargs) -> tuple[Any, int]:
    """``fn(*args, **kwargs)`` under :class:`LiveBytes`: its result and the peak bytes of the tensors it created
    (in this thread)."""
    with LiveBytes() as tracker:
        result = fn(*args, **kwargs)
    return result, tracker.peak
