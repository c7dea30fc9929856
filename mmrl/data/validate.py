"""Deep data validation: every problem in a run's data, found before the run starts.

``mmrl config validate CONFIG [--quick]`` runs this after the config itself validated::

    from mmrl.data.validate import check_data
    report = check_data(config, media=not args.quick)

What :func:`check_data` checks:

* VLM configs (``model.family: qwen_vl``) with a JSONL ``data.dataset``: every line through the parser
  :func:`mmrl.data.vlm.read_vlm_jsonl` uses (:func:`mmrl.data.vlm.parse_vlm_jsonl`, so the rules are its own:
  valid UTF-8 JSON, ``question`` / ``solution`` present, field types, task fields, every media file exists).
  With ``media=True`` every image is decoded (``verify()`` and a full ``load()``) and every video is opened
  with decord and the frames training will read are decoded (the frame plan of ``generation.video_fps`` /
  ``video_nframes`` / ``video_max_frames``, as :func:`mmrl.build.vlm_media`; no resizing). ``media=False``
  (``--quick``) decodes nothing: the files only have to exist. ``tiny:`` data sets are synthetic, built
  correct by mmrl, and not checked.
* flow configs: every line of the prompt file ``data.prompts`` (``.txt`` or ``.jsonl``) through the parser
  :func:`mmrl.data.prompts.read_prompts` uses; an inline ``data.prompt_list`` has nothing to check.

Every problem is collected, in file order, as ``"<file>:<line>: <what>"`` (several per line when several of
its media files are bad). Without ``data.skip_bad_samples`` any problem is a :class:`DataError` listing the
first :data:`MAX_LISTED` and how many more. With it the :class:`DataReport` is returned with the counts (the
bad lines are what training would skip); a data set with no usable line is an error either way.

Cost: ``--quick`` reads the JSONL and checks that each media file exists. The full check decodes every image
and the sampled frames of every video on up to 8 threads, about one epoch of data loading. What
``mmrl train`` itself checks at startup is cheaper (see :mod:`mmrl.data.vlm`): image structure, and for videos
only decord's metadata and the first frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmrl.data.prompts import DataError

MAX_LISTED = 20


@dataclass
class DataReport:
    """What :func:`check_data` found.

    ``kind``: ``"vlm"`` or ``"prompts"``; ``source``: the file checked (or the ``tiny:`` / inline set);
    ``checked``: False when there was nothing to check (synthetic sets, inline prompts); ``media``: whether media
    were decoded (False with ``--quick``); ``records``: non-blank lines read; ``usable``: lines with no problem;
    ``images`` / ``videos``: media files named by the lines that parsed; ``problems``: ``"<file>:<line>: <what>"``.
    """

    kind: str
    source: str
    checked: bool = True
    media: bool = False
    records: int = 0
    usable: int = 0
    images: int = 0
    videos: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # lines that load but look wrong (:func:`annotation_notes`)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bad_records(self) -> int:
        """Lines with at least one problem (what ``data.skip_bad_samples`` skips)."""
        return self.records - self.usable

    def summary(self) -> str:
        """One line of counts, then the problems (the first :data:`MAX_LISTED` and how many more)."""
        if not self.checked:
            return f"{self.source}: {self.records} {self._unit()}(s); nothing to check"
        text = f"{self.source}: {self.records} {self._unit()}(s), {self.usable} usable, {self.bad_records} bad"
        if self.kind == "vlm":
            how = "decoded" if self.media else "found (not decoded: quick check)"
            text += f"; {self.images} image(s) and {self.videos} video(s) {how}"
        if self.problems:
            text += f"; {len(self.problems)} problem(s):\n" + format_problems(self.problems)
        if self.notes:
            what = "a reward would score every answer to them 0" if self.kind == "vlm" else \
                "the rewards cannot score them, or a tag is not GenEval's"
            text += f"\n{len(self.notes)} line(s) load but look wrong (not errors; {what}):\n" + \
                format_problems(self.notes)
        return text

    def _unit(self) -> str:
        return "prompt" if self.source == "data.prompt_list" else "line"


def format_problems(problems: list[str], limit: int = MAX_LISTED) -> str:
    """The first ``limit`` problems, one per indented line, then ``"... and N more"``."""
    lines = [f"  {p}" for p in problems[:limit]]
    if len(problems) > limit:
        lines.append(f"  ... and {len(problems) - limit} more")
    return "\n".join(lines)


def video_frame_kwargs(config) -> dict[str, Any]:
    """The ``read_video`` frame-plan arguments training uses (``generation.video_*``): shared with
    :func:`mmrl.build.vlm_media`, so the full check decodes exactly the frames training reads."""
    g = config.generation
    return {"fps": None if g.video_nframes else g.video_fps, "nframes": g.video_nframes,
            "max_frames": g.video_max_frames}


def check_data(config, *, media: bool = True) -> DataReport:
    """Check every line of the config's data (the module docstring says what is checked), collecting every problem.

    ``media=False`` skips decoding media (``mmrl config validate --quick``). Returns the :class:`DataReport`;
    raises :class:`DataError` listing the problems when there are any and ``data.skip_bad_samples`` is off, or
    when no line is usable.
    """
    if config.model.family == "qwen_vl":
        report = _check_vlm(config, media=media)
    else:
        report = _check_prompts(config)
    if not report.checked:
        return report
    noun = "samples" if report.kind == "vlm" else "prompts"
    if report.records == 0:  # a missing data set (the one problem), or an empty file
        raise DataError(report.problems[0] if report.problems else f"no usable {noun} in {report.source}: it has no "
                        "non-blank line")
    if report.usable == 0:
        raise DataError(_message(report, f"no usable {noun}: "))
    if report.problems and not config.data.skip_bad_samples:
        raise DataError(_message(report, "", hint=" (data.skip_bad_samples=true skips and counts the bad lines "
                                                 "instead)"))
    return report


def _message(report: DataReport, what: str, hint: str = "") -> str:
    return (f"{report.source}: {what}{len(report.problems)} problem(s) in {report.bad_records} of {report.records} "
            f"line(s){hint}:\n" + format_problems(report.problems))


def _check_vlm(config, *, media: bool) -> DataReport:
    from mmrl.data.vlm import check_all_media, parse_vlm_jsonl

    dataset = config.data.dataset
    if not dataset:
        return DataReport("vlm", "data.dataset", problems=["data.dataset is not set: a JSONL file or tiny:<kind>"])
    if dataset.startswith("tiny:"):
        return DataReport("vlm", dataset, checked=False)
    if dataset.startswith("shapeworld:"):  # written on the spot in the policy's box format, then checked
        from mmrl.build import resolve_vlm_dataset

        dataset = resolve_vlm_dataset(config)
    report = DataReport("vlm", dataset, media=media)
    try:
        entries = parse_vlm_jsonl(dataset)
    except DataError as exc:  # the file itself is missing
        report.problems.append(str(exc))
        return report
    report.records = len(entries)
    samples = [e.sample for e in entries if e.sample is not None]
    report.images = sum(len(s.image_paths) for s in samples)
    report.videos = sum(s.video_path is not None for s in samples)
    found = iter(check_all_media(samples, images=True, videos=True, decode=True,
                                 video_frames=video_frame_kwargs(config)) if media else ())
    for entry in entries:
        if entry.problem is not None:
            report.problems.append(f"{entry.where}: {entry.problem}")
            continue
        bad = next(found) if media else []
        report.problems += [f"{entry.where}: {p}" for p in bad]
        report.usable += not bad
        if not bad:
            report.notes += [f"{entry.where}: {n}" for n in annotation_notes(entry.sample)]
    return report


def annotation_notes(sample) -> list[str]:
    """What a line's annotations suggest is wrong although it loads: ``boxes`` all within [0, 1] (normalised to the
    unit square, which no box convention mmrl reads uses: the image's pixels, or Qwen2-VL / Qwen3-VL's [0, 1000)),
    and ``timestamps`` ending after the line's own ``duration`` by more than a second (datasets such as
    Charades-STA overrun it by a fraction)."""
    meta, notes = sample.metadata, []
    boxes = meta.get("boxes") or []
    if boxes and all(0.0 <= v <= 1.0 for box in boxes for v in box):
        notes.append(f"boxes {boxes[0]}{' ...' if len(boxes) > 1 else ''} are all within [0, 1]: normalised to the "
                     f"unit square? mmrl's boxes are the image's pixels (Qwen2-VL / Qwen3-VL: [0, 1000))")
    span, duration = meta.get("timestamps"), meta.get("duration")
    if span and duration and span[1] > float(duration) + 1.0:
        notes.append(f"timestamps {span} end after the clip's duration {duration}")
    return notes


def _check_prompts(config) -> DataReport:
    from mmrl.data.prompts import iter_prompt_file

    d = config.data
    if not d.prompts:
        return DataReport("prompts", "data.prompt_list", checked=False, records=len(d.prompt_list))
    from mmrl.rewards.geneval import TAGS as GENEVAL_CATEGORIES  # its evaluation groups the scores by tag

    report = DataReport("prompts", d.prompts)
    checkers = _metadata_checkers(config)
    tags: dict[str, str] = {}
    try:
        for where, item, problem in iter_prompt_file(d.prompts):
            report.records += 1
            if problem is None:  # the line parses: does each reward that reads metadata understand it?
                unscorable = [f"rewards.{key}: {why}" for key, check in checkers
                              if (why := check(item.metadata)) is not None]
                if unscorable:
                    report.notes.append(f"{where}: every sample of this prompt gets a NaN reward (counted in "
                                        f"samples/nan_reward): {'; '.join(unscorable)}")
                tag = item.metadata.get("tag")
                if isinstance(tag, str) and checkers and tag not in GENEVAL_CATEGORIES:
                    tags.setdefault(tag, where)
            if problem is None:
                report.usable += 1
            else:
                report.problems.append(f"{where}: {problem}")
    except DataError as exc:  # the file itself is missing
        report.problems.append(str(exc))
    for tag, where in tags.items():
        report.notes.append(f"{where}: tag {tag!r} is none of GenEval's categories ({', '.join(GENEVAL_CATEGORIES)}):"
                            f" its prompts are scored, and reported under that name")
    return report


def _metadata_checkers(config) -> list[tuple[str, Any]]:
    """``(reward key, check)`` for each of the config's weighted rewards whose class reads the prompts' metadata and
    says what it cannot score (``check_metadata(metadata) -> reason | None``: GenEval's and ShapeWorld's rules, which
    give such a prompt a NaN reward on every sample)."""
    from mmrl.rewards import reward_factory
    from mmrl.rewards.compose import parse_reward_spec

    checkers = []
    for key, entry in (config.rewards or {}).items():
        try:
            name, _, weight = parse_reward_spec(key, entry)
            check = getattr(reward_factory(name), "check_metadata", None)
        except (ValueError, TypeError, KeyError):  # the config's own check names a bad spec
            continue
        if check is not None and weight != 0:
            checkers.append((key, check))
    return checkers
