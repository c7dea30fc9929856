"""What every benchmark script ends with: its JSON line written to ``--out`` and printed."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch


def versions() -> dict:
    return {"torch": torch.__version__, "python": platform.python_version()}


def finish(line: dict, out: Path) -> int:
    """Write ``line`` (indented) to ``out``, print it as one line; exit code 0 when ``line["ok"]``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(line, indent=1, default=str) + "\n")
    print(json.dumps(line, default=str))
    return 0 if line["ok"] else 1
