"""Prompt sets for text-to-image training: a file or an inline list, read in a seeded, resumable order."""

from __future__ import annotations

import hashlib

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


class DataError(ValueError):
    """Bad input data, naming the file and line."""


class EmptyBatchError(DataError):
    """Every sample of a batch was skipped (data.skip_bad_samples): the loop draws replacements."""


@dataclass
class PromptItem:
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)


def json_error(exc: json.JSONDecodeError) -> str:
    """``"not valid JSON (<reason> at column <n>)"``, read once.

    ``json``'s own reasons for strings end in ``"at"`` (``"Unterminated string starting at"``, ``"Invalid control
    character '\\t' at"``), the column being where the string starts: that ``at`` is the one used.
    """
    reason = exc.msg[:-3] if exc.msg.endswith(" at") else exc.msg
    return f"not valid JSON ({reason} at column {exc.colno})"


def iter_prompt_file(path: str | Path):
    """``(where, item, problem)`` for every non-blank line of a prompt file (``item`` or ``problem`` is None);
    the parser behind :func:`read_prompts` and :func:`mmrl.data.validate.check_data`. Format in
    :func:`read_prompts`; a missing file is a :class:`DataError`. ``shapeworld:train`` / ``shapeworld:heldout``
    read that ShapeWorld split's prompts with their GenEval metadata
    (:func:`mmrl.data.shapeworld.resolve_prompts_spec`)."""
    if str(path).startswith("shapeworld:"):
        from mmrl.data.shapeworld import resolve_prompts_spec

        try:
            path = resolve_prompts_spec(path)
        except ValueError as exc:
            raise DataError(str(exc)) from None
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path} is a folder, not a prompt file")
    if not path.is_file():
        raise DataError(f"prompt file not found: {path}")
    if path.suffix.lower() in (".json", ".csv", ".tsv"):  # read as lines of text, a header would become a prompt
        raise DataError(f"{path}: a {path.suffix.lower()} file; prompt files are .txt (one prompt per line) or .jsonl "
                        f"(one object with a 'prompt' per line)")
    jsonl = path.suffix.lower() == ".jsonl"
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.rstrip(b"\r\n").decode("utf-8-sig" if number == 1 else "utf-8")  # tolerate a BOM
            except UnicodeDecodeError as exc:
                yield where, None, f"not UTF-8 text (byte {exc.start})"
                continue
            if not line.strip():
                continue
            if not jsonl:
                yield where, PromptItem(line.strip()), None
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                yield where, None, json_error(exc)
                continue
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                got = type(record).__name__ if not isinstance(record, dict) else (
                    "no 'prompt'" if "prompt" not in record else f"'prompt' of type {type(record['prompt']).__name__}")
                yield where, None, f"expected an object with a string 'prompt' field, got {got}"
                continue
            prompt = record.pop("prompt")
            if not prompt.strip():  # data.prompt_list refuses an empty prompt too
                yield where, None, "an empty 'prompt' (a blank prompt has nothing to condition on)"
                continue
            yield where, PromptItem(prompt.strip(), record), None


def read_prompts(path: str | Path) -> list[PromptItem]:
    """``.txt``: one prompt per non-empty line. ``.jsonl``: one object per line with a string ``prompt``; the other
    fields are kept as metadata for rewards (GenEval ``include`` clauses, OCR targets, ...). UTF-8 (a BOM is
    allowed). A bad line is a :class:`DataError` ``"<file>:<line>: <what>"``."""
    items: list[PromptItem] = []
    for where, item, problem in iter_prompt_file(path):
        if problem is not None:
            raise DataError(f"{where}: {problem}")
        items.append(item)
    if not items:
        raise DataError(f"prompt file is empty: {path}")
    return items


def balance_by_tag(items: list[PromptItem]) -> list[PromptItem]:
    """Each ``metadata['tag']`` value's prompts cycled to the largest tag's count, tags in order of first appearance
    (``data.balance_tags``): a pass over the result holds every category equally often. A prompt without a tag is
    a :class:`DataError`."""
    by_tag: dict[str, list[PromptItem]] = {}
    for index, item in enumerate(items):
        tag = item.metadata.get("tag")
        if not isinstance(tag, str) or not tag:
            raise DataError(f"data.balance_tags: prompt {index + 1} ({item.prompt!r}) has no 'tag' in its metadata "
                            f"(a JSONL prompt file with GenEval metadata, or shapeworld:<split>)")
        by_tag.setdefault(tag, []).append(item)
    longest = max(len(group) for group in by_tag.values())
    return [group[i % len(group)] for group in by_tag.values() for i in range(longest)]


class OrderedSource(Generic[T]):
    """Endless, seeded order over a list of items: a fresh permutation each pass (or file order), resumable by
    position. The shared ordering behind :class:`PromptSource` and ``mmrl.data.vlm.VLMSampleSource``.

    Every process reads the same global order; process ``rank`` of ``world`` takes its own slice of each
    global batch, so the processes never sample the same slot. Subclasses set ``noun`` (used in messages and
    in the ``num_<noun>`` state key) and ``collection`` (what the item list is called in messages).
    """

    noun = "items"
    collection = "item set"

    def __init__(self, items: list[T], *, seed: int = 0, shuffle: bool = True):
        if not items:
            raise DataError(f"no {self.noun}: the {self.collection} is empty")
        self.items = items
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0  # items consumed globally

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.items)))
        return torch.randperm(len(self.items), generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def _at(self, position: int) -> T:
        epoch, offset = divmod(position, len(self.items))
        return self.items[self._order(epoch)[offset]]

    def next_batch(self, per_process: int, *, rank: int = 0, world: int = 1) -> list[T]:
        start = self.position + rank * per_process
        batch = [self._at(start + i) for i in range(per_process)]
        self.position += per_process * world
        return batch

    def fingerprint(self) -> str:
        """sha256 of the items in their order (their ``repr``), computed once: a resume can tell an edited
        ``{collection}`` of the same length from the one the checkpoint read."""
        if getattr(self, "_fingerprint", None) is None:
            digest = hashlib.sha256()
            for item in self.items:
                digest.update(repr(item).encode("utf-8", "replace") + b"\n")
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, f"num_{self.noun}": len(self.items),
                "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> str | None:
        """Restore the position. A different item count is a :class:`DataError` (the position would point
        elsewhere); the same count with other items (an edited file) is returned as a note to log, since the
        run can go on over the new items."""
        key = f"num_{self.noun}"
        if state.get(key) not in (None, len(self.items)):
            raise DataError(f"the checkpoint was taken with {state[key]} {self.noun}, this run has "
                            f"{len(self.items)}: resume with the same {self.collection}")
        self.position = int(state["position"])
        if state.get("fingerprint") not in (None, self.fingerprint()):
            return (f"the {self.collection} differs from the one the checkpoint was taken with (same count, "
                    f"{len(self.items)} {self.noun}, other contents): the run goes on at its data position over "
                    f"the new {self.noun}")
        return None


class PromptSource(OrderedSource[PromptItem]):
    """Endless, seeded prompt order: a fresh permutation each pass (or file order), resumable by position.

    Every process reads the same global order; process ``rank`` of ``world`` takes its own slice of each
    global batch, so the processes never sample the same prompt slot.
    """

    noun = "prompts"
    collection = "prompt set"
