"""Atomic, resumable checkpoints.

``checkpoints/step_<k>/`` holds the trainable weights (``trainable.safetensors``, the live ones that
resuming needs), the exported adapter (diffusers LoRA / PEFT format, EMA weights when EMA is on, under
``export/``), optimizer, LR scheduler, EMA, RNG states
and the loop state (update index, data position, statistics tracker) in ``state.json``. A
checkpoint is written into a hidden temporary folder and renamed into place in one ``os.replace``,
so a run killed while saving leaves the previous checkpoint intact; ``latest_checkpoint`` only ever
returns complete ones. Older checkpoints beyond ``keep_last`` are removed after the new one lands.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from mmrl.distributed import copy_full_into

STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE_MARKER = "state.json"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def process_rng_states(accelerator: Any = None) -> dict[str, Any]:
    """What a checkpoint keeps of the random state: this process's (:func:`rng_state`) on one process; with several,
    every process's in rank order (``{"per_process": [...]}``, a collective: every process calls it), since each
    was seeded differently (``seed + rank``) and a resume must give each its own stream back."""
    if accelerator is None or accelerator.num_processes <= 1:
        return rng_state()
    from accelerate.utils import gather_object

    return {"per_process": gather_object([rng_state()])}


def restore_rng_states(saved: dict[str, Any], accelerator: Any = None, *, reseed: Callable[[int], int]) -> str | None:
    """Give this process its own saved random state (:func:`process_rng_states`; a checkpoint of one process holds
    one). When the checkpoint was written by another number of processes, every process is seeded afresh with
    ``reseed(rank)`` instead (there is no stream of its own to continue) and the returned note says so."""
    rank = accelerator.process_index if accelerator is not None else 0
    count = accelerator.num_processes if accelerator is not None else 1
    states = saved["per_process"] if "per_process" in saved else [saved]
    if len(states) == count:
        set_rng_state(states[rank])
        return None
    seed = reseed(rank) % 2**32
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # all devices too
    return (f"the checkpoint's random state is of {len(states)} process(es), this run has {count}: each process's "
            f"random stream starts afresh (sampling noise, minibatch order and data order are seeded per update "
            f"and do not depend on it; dropout does)")


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints under ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = STEP_DIR.match(child.name)
        if match and (child / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def current_umask() -> int:
    """The process's file-creation mask (read from ``/proc`` where it is there: setting it to read it would race
    with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: str | Path) -> None:
    """Give ``root`` and everything under it the modes a plain ``open`` / ``mkdir`` would have: files
    ``0o666 & ~umask``, folders ``0o777 & ~umask`` (executable files keep their execute bits). Atomic writers call it
    on their temporary folder before renaming it into place, because safetensors (0.8) writes its files 0600 and
    ``tempfile.mkdtemp`` makes folders 0700: a checkpoint or base model would otherwise be unreadable by the rest of a
    group that shares the run folder."""
    mask = current_umask()
    root = Path(root)
    paths = [root, *root.rglob("*")] if root.is_dir() else [root]
    for path in paths:
        if path.is_symlink():
            continue
        if path.is_dir():
            os.chmod(path, 0o777 & ~mask)
        elif path.is_file():
            executable = os.stat(path).st_mode & 0o111
            os.chmod(path, (0o777 if executable else 0o666) & ~mask)


def other_command_run(run: str | Path) -> str | None:
    """What to do instead when the run folder ``run`` was written by ``mmrl pretrain`` or ``mmrl sft``, whose results
    are a model to start from, not a policy of ``mmrl train``; None otherwise. :func:`mmrl.config.load_config` asks
    it of a run's folder or ``config.yaml``, which every command that takes a training run reads first."""
    run = Path(run)
    if (run / "pipeline" / "model_index.json").is_file():
        return (f"{run} is an mmrl pretrain run: its result is the pipeline {run / 'pipeline'}; use it as "
                f"model.pretrained in a training config (mmrl train, or mmrl eval CONFIG checkpoint=base)")
    if (run / "mmrl_train.yaml").is_file() and (run / "model").is_dir():
        return (f"{run} is an mmrl sft run: its result is the model {run / 'model'}; {run / 'mmrl_train.yaml'} "
                f"holds the model and generation sections to paste into a training config (with its data and "
                f"rewards) for mmrl train, or mmrl eval CONFIG checkpoint=base")
    return None


def latest_checkpoint(directory: str | Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def save_checkpoint(
    directory: str | Path,
    step: int,
    *,
    trainable: dict[str, torch.Tensor],
    state: dict[str, Any],
    objects: dict[str, Any],
    export: Callable[[str], None] | None = None,
    keep_last: int = 2,
    folders: dict[str, Path] | None = None,
) -> Path:
    """Write ``directory/step_<step>`` atomically and prune to ``keep_last``. ``objects`` are torch-saved
    (optimizer, scheduler, EMA, RNG state dicts); ``state`` is JSON; ``export`` writes the ecosystem format;
    ``folders`` (name -> a folder written beforehand, e.g. DeepSpeed's per-process files) are moved in under their
    names before the checkpoint is marked complete."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step_{step}"
    tmp = directory / f".step_{step}.tmp-{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        save_file({k: v.detach().contiguous().cpu() for k, v in trainable.items()},
                  str(tmp / "trainable.safetensors"))
        for name, obj in objects.items():
            torch.save(obj, tmp / f"{name}.pt")
        if export is not None:
            export(str(tmp / "export"))
        for name, folder in (folders or {}).items():
            os.replace(folder, tmp / name)
        (tmp / COMPLETE_MARKER).write_text(json.dumps(state, indent=2))
        apply_umask(tmp)
        for path in tmp.rglob("*"):
            if path.is_file():
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
    except Exception as exc:  # a full disk, a quota, a vanished mount: a raw library traceback before
        reason = _write_failure(exc)
        if reason is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        earlier = list_checkpoints(directory)
        kept = f"the last complete checkpoint, {earlier[-1]}, is intact" if earlier else "no earlier checkpoint"
        raise CheckpointWriteError(f"could not write checkpoint step_{step} in {directory}: {reason}; {kept} "
                                   f"(fix the cause, then `resume=auto` continues from it)") from exc
    replaced = directory / f".step_{step}.old-{os.getpid()}"
    if final.exists():  # the same step written again: the old one set aside first, so no kill leaves neither
        os.replace(final, replaced)
    os.replace(tmp, final)
    _fsync_directory(directory)  # the rename is on disk before older checkpoints are pruned
    for old in list_checkpoints(directory)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in [*directory.glob(".step_*.tmp-*"), *directory.glob(".step_*.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (the disk full, a quota): its partial folder removed, the message
    names the cause and the last complete checkpoint."""


def _write_failure(exc: BaseException) -> str | None:
    """The reason an exception from writing a checkpoint is the file system's (an ``OSError``, or the safetensors
    library's error wrapping one, "I/O error: No space left on device"), else ``None``."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    text = str(exc)
    for cause in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO):  # torch.save's writer raises RuntimeError
        if os.strerror(cause) in text:
            return os.strerror(cause)
    if type(exc).__name__ == "SafetensorError" and "I/O error" in text:
        return text.split("I/O error:", 1)[1].strip()
    return None


def _fsync_directory(directory: Path) -> None:
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:  # a file system that cannot open folders: the rename stands on its own
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def set_aside_newer(directory: str | Path, step: int) -> list[Path]:
    """Move this run's checkpoints after ``step`` into ``directory/abandoned/`` (kept, out of reach of
    ``resume=auto`` and of pruning): a run resumed from an older checkpoint (a rollback) continues from there, and
    the newer ones of the line it left would otherwise be what the next ``resume=auto`` picks, or what pruning keeps
    in place of the new steps. Returns where they went."""
    directory = Path(directory)
    moved = []
    for path in list_checkpoints(directory):
        if int(STEP_DIR.match(path.name).group(1)) <= step:
            continue
        target = directory / "abandoned" / path.name
        suffix = 1
        while target.exists():
            target = directory / "abandoned" / f"{path.name}.{suffix}"
            suffix += 1
        target.parent.mkdir(exist_ok=True)
        os.replace(path, target)
        moved.append(target)
    return moved


class CheckpointError(ValueError):
    """A checkpoint that is there but cannot be read (a damaged file, a missing part): the message names it and
    the previous complete checkpoint to resume from instead (:meth:`for_reading` words it for ``mmrl eval`` and
    ``mmrl sample``, which read a checkpoint rather than resume one)."""

    def __init__(self, message: str, *, path: Path | None = None, what: str | None = None,
                 earlier: Path | None = None):
        super().__init__(message)
        self.path, self.what, self.earlier = path, what, earlier

    def for_reading(self, command: str) -> str:
        """The message for a command that reads the checkpoint: ``command`` ``"eval"`` (``checkpoint=``) or
        ``"sample"`` (the folder argument)."""
        if self.path is None:
            return str(self)
        if self.earlier is None:
            hint = "the run has no earlier complete checkpoint"
        elif command == "eval":
            hint = f"evaluate the previous complete one with checkpoint={self.earlier}"
        else:
            hint = f"sample from the previous complete one: mmrl sample {self.earlier}"
        return f"checkpoint {self.path} is damaged: {self.what}; {hint}"


def damaged(path: str | Path, what: str) -> CheckpointError:
    """The error for checkpoint ``path`` whose ``what`` cannot be read, naming the previous complete one."""
    path = Path(path)
    match = STEP_DIR.match(path.name)
    earlier = [p for p in list_checkpoints(path.parent)
               if match and int(STEP_DIR.match(p.name).group(1)) < int(match.group(1))]
    hint = (f"resume from the previous complete one with resume={earlier[-1]}, or delete {path} (resume=auto then "
            f"takes the latest complete checkpoint)") if earlier else f"delete {path} to start over"
    return CheckpointError(f"checkpoint {path} is damaged: {what}; {hint}", path=path, what=what,
                           earlier=earlier[-1] if earlier else None)


def move_aside(path: str | Path) -> Path:
    """Rename ``path`` (a file or folder) to the first free ``<name>.stale-<n>`` beside it and return the new path:
    what another run left there is kept, not overwritten or deleted."""
    path = Path(path)
    n = 1
    while path.with_name(f"{path.name}.stale-{n}").exists():
        n += 1
    stale = path.with_name(f"{path.name}.stale-{n}")
    os.replace(path, stale)
    return stale


def restore_data_state(source, state: dict[str, Any], path: str | Path) -> str | None:
    """``source.load_state_dict(state["data"])`` for a resume from checkpoint ``path``: data that changed since the
    checkpoint (another item count) is a ``DataError`` saying the checkpoint is intact (it read as damaged, and the
    advice deleted good checkpoints); a state that does not parse is :func:`damaged`. Returns the source's note
    (same count, other contents) for the caller to log."""
    from mmrl.data.prompts import DataError

    try:
        return source.load_state_dict(state["data"])
    except DataError as exc:
        raise DataError(f"cannot resume from {path}: {exc} (the checkpoint is intact: restore the data it was taken "
                        f"with, or start a new output_dir)") from None
    except (KeyError, TypeError, ValueError, IndexError) as exc:  # edited by hand or written by another version
        raise damaged(path, f"state.json's data state does not fit this run ({type(exc).__name__}: {exc})") from None


def read_state(path: str | Path, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``state.json`` of checkpoint ``path`` (a JSON object holding ``required`` keys), else
    :class:`CheckpointError`."""
    path = Path(path)
    try:
        state = json.loads((path / COMPLETE_MARKER).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise damaged(path, f"{COMPLETE_MARKER} cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise damaged(path, f"{COMPLETE_MARKER} holds a {type(state).__name__}, not the loop state")
    missing = [key for key in required if key not in state]
    if missing:
        raise damaged(path, f"{COMPLETE_MARKER} lacks {', '.join(missing)}")
    for key, kind in STATE_TYPES.items():  # a hand edit or another version's file: named here, not deep in the loop
        if key in state and (not isinstance(state[key], kind) or isinstance(state[key], bool)):
            raise damaged(path, f"{COMPLETE_MARKER}: {key} is {state[key]!r}, not {STATE_KINDS[kind]}")
    return state


#: the types of the loop state's keys that commands read back (``update`` / ``step`` counters, mappings)
STATE_TYPES = {"update": int, "optimizer_steps": int, "step": int, "data": dict, "tracker": dict, "config": dict}
STATE_KINDS = {int: "a whole number", dict: "a mapping"}


def read_trainable(path: str | Path, name: str = "trainable.safetensors") -> dict[str, torch.Tensor]:
    """The weights file ``name`` of checkpoint ``path``, else :class:`CheckpointError` (a truncated or missing
    file)."""
    path = Path(path)
    try:
        return load_file(str(path / name))
    except Exception as exc:  # safetensors' own error type, OSError, FileNotFoundError
        raise damaged(path, f"{name} cannot be read ({type(exc).__name__}: {exc})") from None


def read_object(path: str | Path, name: str) -> Any:
    """The ``name.pt`` object of checkpoint ``path``, else :class:`CheckpointError`."""
    path = Path(path)
    try:
        return torch.load(path / f"{name}.pt", map_location="cpu", weights_only=False)
    except Exception as exc:  # truncated pickle / zip: EOFError, RuntimeError, OSError, UnpicklingError
        raise damaged(path, f"{name}.pt cannot be read ({type(exc).__name__}: {exc})") from None


def evaluated_weights(path: str | Path, ema: bool = True) -> tuple[dict[str, torch.Tensor], bool]:
    """``(weights, is_ema)``: what a run evaluates from checkpoint ``path``, the EMA weights when it has them and
    ``ema`` is set (the run's own evaluations used them), else the trainable weights; :class:`CheckpointError` for a
    damaged file."""
    path = Path(path)
    if ema and (path / "ema.pt").is_file():
        return read_object(path, "ema")["shadow"], True
    return read_trainable(path), False


def load_checkpoint(path: str | Path, *, objects: tuple[str, ...] = (), state_keys: tuple[str, ...] = (),
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """``(trainable tensors, state, objects)`` of a complete checkpoint: every ``*.pt`` in it, which must include
    ``objects``, and a state holding ``state_keys``. A part that is missing or cannot be read is a
    :class:`CheckpointError` naming the checkpoint and the previous complete one."""
    path = Path(path)
    if not (path / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER})")
    state = read_state(path, state_keys)
    trainable = read_trainable(path)
    missing = [name for name in objects if not (path / f"{name}.pt").is_file()]
    if missing:
        raise damaged(path, f"{', '.join(f'{m}.pt' for m in missing)} missing")
    loaded = {p.stem: read_object(path, p.stem) for p in sorted(path.glob("*.pt"))}
    return trainable, state, loaded


def load_trainable(params: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], where: str | Path) -> None:
    """Copy checkpoint ``weights`` into the live trainable ``params`` after checking every tensor is there with
    its shape; a ``ValueError`` naming ``where`` and the first misfit (another model or LoRA setup) otherwise."""
    missing = sorted(set(params) - set(weights))
    if missing:
        raise ValueError(f"checkpoint {where} lacks {len(missing)} of the policy's trainable tensors (e.g. "
                         f"{missing[0]}): was it written with another model or LoRA setup?")
    wrong = [name for name, param in params.items() if tuple(weights[name].shape) != tuple(param.shape)]
    if wrong:
        name = wrong[0]
        raise ValueError(f"checkpoint {where}: {len(wrong)} trainable tensor(s) have another shape than the policy's "
                         f"(e.g. {name}: {tuple(weights[name].shape)} in the checkpoint, {tuple(params[name].shape)} "
                         f"now): was it written with another model or LoRA setup?")
    with torch.no_grad():
        for name, param in params.items():
            copy_full_into(param, weights[name])  # an FSDP shard keeps its slice
