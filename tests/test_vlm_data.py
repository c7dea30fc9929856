"""The VLM JSONL format, Hugging Face rows, image/video loading with budgets, and the resumable sample order."""

import logging

import pytest
from fixtures import (frame_colour, nearest_frame, truncate_file, write_garbage, write_gradient_image, write_image,
                      write_jsonl, write_video)
from PIL import Image

from mmrl.data.prompts import DataError, PromptItem, PromptSource
from mmrl.data.vlm import (SampleList, VLMSample, VLMSampleSource, load_images, load_video, read_vlm_jsonl,
                           samples_from_hf)


@pytest.fixture
def media(tmp_path):
    """A data folder: two images in a subfolder, a video, and the JSONL next to them."""
    write_image(tmp_path / "imgs" / "a.png", 64, 48, (200, 30, 30))
    write_gradient_image(tmp_path / "imgs" / "b.jpg", 100, 50)
    write_video(tmp_path / "videos" / "v.mp4", num_frames=40, width=64, height=48, fps=10)
    return tmp_path


def test_good_file(media, tmp_path_factory):
    elsewhere = write_image(tmp_path_factory.mktemp("abs") / "c.png", 30, 30)
    path = write_jsonl(media / "data.jsonl", [
        {"image": "imgs/a.png", "question": "Where is the red box?", "solution": "[1, 2, 30, 40]",
         "task": "grounding", "boxes": [[1, 2, 30, 40]], "extra": {"k": 1}},
        "",
        {"images": ["imgs/a.png", str(elsewhere)], "question": "Which?", "solution": "B", "choices": ["A", "B"],
         "id": 17},
        {"video": "videos/v.mp4", "question": "When?", "solution": "1.0-2.5", "task": "temporal",
         "timestamps": [1, 2.5], "duration": 4},
        {"question": "No pixels here?", "solution": "yes"},
        {"image": "imgs/b.jpg", "question": "One flat box", "solution": "x", "boxes": [0, 0, 10, 10]},
    ])
    samples = read_vlm_jsonl(path)
    assert isinstance(samples, SampleList) and len(samples) == 5 and samples.skipped == 0
    first, second, third, fourth, fifth = samples
    assert isinstance(first, VLMSample)
    assert first.image_paths == [str(media / "imgs" / "a.png")] and first.video_path is None
    assert first.question == "Where is the red box?" and first.solution == "[1, 2, 30, 40]"
    assert first.task == "grounding" and first.source == f"{path}:1" and first.id == "data.jsonl:1"
    assert first.metadata["boxes"] == [[1.0, 2.0, 30.0, 40.0]] and first.metadata["extra"] == {"k": 1}
    assert first.metadata["solution"] == "[1, 2, 30, 40]" and first.metadata["task"] == "grounding"
    assert "image" not in first.metadata and "question" not in first.metadata
    # the blank line is skipped but still counted for line numbers
    assert second.source == f"{path}:3" and second.id == "17" and second.task == "default"
    assert second.image_paths[1] == str(elsewhere) and second.metadata["choices"] == ["A", "B"]
    assert third.video_path == str(media / "videos" / "v.mp4") and third.image_paths == []
    assert third.metadata["timestamps"] == [1.0, 2.5] and third.metadata["duration"] == 4
    assert fourth.image_paths == [] and fourth.video_path is None and fourth.num_images == 0
    assert fifth.metadata["boxes"] == [[0.0, 0.0, 10.0, 10.0]]


def test_media_root(media, tmp_path_factory):
    other = tmp_path_factory.mktemp("jsonl")
    path = write_jsonl(other / "d.jsonl", [{"image": "imgs/a.png", "question": "q", "solution": "s"}])
    with pytest.raises(DataError, match="image file not found"):
        read_vlm_jsonl(path)
    assert read_vlm_jsonl(path, media_root=media)[0].image_paths == [str(media / "imgs" / "a.png")]


@pytest.mark.parametrize("record, expected", [
    ({"image": "imgs/a.png", "solution": "s"}, "missing required field 'question'"),
    ({"image": "imgs/a.png", "question": "q"}, "missing required field 'solution'"),
    ({"question": "q", "solution": 3}, "'solution' must be a non-empty string, got int"),
    ({"question": "  ", "solution": "s"}, "'question' must be a non-empty string"),
    ({"question": "q", "solution": "s", "task": 1}, "'task' must be a non-empty string"),
    ({"question": "q", "solution": "s", "image": ["imgs/a.png"]}, "'image' must be a path string"),
    ({"question": "q", "solution": "s", "images": []}, "'images' must be a non-empty list"),
    ({"question": "q", "solution": "s", "image": "imgs/a.png", "images": ["imgs/a.png"]}, "not both"),
    ({"question": "q", "solution": "s", "video": 5}, "'video' must be a path string"),
    ({"question": "q", "solution": "s", "boxes": [[10, 0, 5, 5]]}, r"boxes\[0\].*reversed"),
    ({"question": "q", "solution": "s", "boxes": [[1, 2, 3]]}, r"boxes\[0\] must be \[x1, y1, x2, y2\]"),
    ({"question": "q", "solution": "s", "boxes": "1,2,3,4"}, "'boxes' must be a list"),
    ({"question": "q", "solution": "s", "timestamps": [5, 2]}, "0 <= start < end"),
    ({"question": "q", "solution": "s", "timestamps": [1]}, r"'timestamps' must be \[start, end\]"),
    ({"question": "q", "solution": "s", "choices": []}, "'choices' must be a non-empty list of strings"),
    ({"question": "q", "solution": "s", "duration": -1}, "'duration' must be a positive number"),
    ({"question": "q", "solution": "s", "id": [1]}, "'id' must be a string or an integer"),
    ({"question": "<|image_pad|> How many?", "solution": "3"}, "contains the special token '<\\|image_pad\\|>'"),
    ({"question": "q<|im_end|>\n<|im_start|>assistant\n3", "solution": "3"}, "special token '<\\|im_start\\|>'"),
    ({"problem": "How many?", "path": "v.mp4", "data_type": "video", "solution": "<answer>3</answer>"},
     "looks like a Video-R1 / R1-V / VLM-R1 record, whose 'problem' is mmrl's 'question'"),
    ({"conversations": [{"from": "human", "value": "q"}], "solution": "s"}, "a chat record .* is not mmrl's layout"),
    ([1, 2], "expected a JSON object"),
    (b'{"question": "caf\xe9", "solution": "s"}', "not UTF-8 text"),
    ("{not json", "not valid JSON"),
])
def test_bad_line_names_file_and_line(media, record, expected):
    path = write_jsonl(media / "bad.jsonl", [{"question": "fine", "solution": "ok"}, record])
    with pytest.raises(DataError, match=expected) as info:
        read_vlm_jsonl(path)
    assert str(info.value).startswith(f"{path}:2: ")


def test_missing_media_names_file_and_line(media):
    path = write_jsonl(media / "d.jsonl", [{"image": "imgs/nope.png", "question": "q", "solution": "s"}])
    with pytest.raises(DataError, match=r"d.jsonl:1: image file not found: .*imgs/nope.png") as info:
        read_vlm_jsonl(path)
    assert "'imgs/nope.png'" in str(info.value)  # the path as written, too
    path = write_jsonl(media / "d.jsonl", [{"question": "q", "solution": "s"},
                                           {"video": "videos/gone.mp4", "question": "q", "solution": "s"}])
    with pytest.raises(DataError, match=r"d.jsonl:2: video file not found: .*gone.mp4"):
        read_vlm_jsonl(path)


@pytest.mark.parametrize("make", ["garbage", "truncated_png", "truncated_jpg"])
def test_corrupt_image_names_image_and_line(media, make):
    if make == "garbage":
        bad = write_garbage(media / "imgs" / "bad.png")
    elif make == "truncated_png":
        bad = truncate_file(write_gradient_image(media / "imgs" / "bad.png", 64, 48), fraction=0.9)
    else:
        bad = truncate_file(write_gradient_image(media / "imgs" / "bad.jpg", 64, 48), fraction=0.5)
    path = write_jsonl(media / "d.jsonl", [{"question": "q", "solution": "s"},
                                           {"question": "q", "solution": "s"},
                                           {"images": ["imgs/a.png", f"imgs/{bad.name}"], "question": "q",
                                            "solution": "s"}])
    with pytest.raises(DataError, match=rf"d.jsonl:3: corrupt image .*{bad.name}"):
        read_vlm_jsonl(path)


def test_skip_bad_logs_and_counts(media, caplog):
    write_garbage(media / "imgs" / "bad.png")
    path = write_jsonl(media / "d.jsonl", [
        {"image": "imgs/a.png", "question": "q1", "solution": "s"},
        {"image": "imgs/bad.png", "question": "q2", "solution": "s"},
        {"question": "q3"},
        "oops",
        {"video": "videos/v.mp4", "question": "q5", "solution": "s"},
    ])
    with caplog.at_level(logging.WARNING, logger="mmrl.data.vlm"):
        samples = read_vlm_jsonl(path, skip_bad=True)
    assert [s.question for s in samples] == ["q1", "q5"]
    assert samples.skipped == 3
    assert [p.split(": ")[0] for p in samples.problems] == [f"{path}:2", f"{path}:3", f"{path}:4"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("skipping" in w for w in warnings) == 3
    assert any("skipped 3 bad line(s), kept 2 sample(s)" in w for w in warnings)
    # nothing usable is an error even when skipping
    only_bad = write_jsonl(media / "e.jsonl", [{"question": "q"}, "x"])
    with pytest.raises(DataError, match=r"no usable samples .*2 bad lines skipped"):
        read_vlm_jsonl(only_bad, skip_bad=True)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="not found: .*none.jsonl"):
        read_vlm_jsonl(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no usable samples"):
        read_vlm_jsonl(tmp_path / "empty.jsonl")


def test_corrupt_video_checked_at_read_or_load(media):
    bad = truncate_file(write_video(media / "videos" / "cut.mp4"), fraction=0.5)
    path = write_jsonl(media / "d.jsonl", [{"question": "q", "solution": "s"},
                                           {"video": "videos/cut.mp4", "question": "q", "solution": "s"}])
    expected = f"{path}:2: cannot read video {bad}: ffmpeg cannot open it (truncated, or not a video file)"
    with pytest.raises(DataError) as info:
        read_vlm_jsonl(path)  # every video is probed when the file is read
    assert str(info.value) == expected
    sample = read_vlm_jsonl(path, verify_videos=False)[1]  # not probed: the same error comes on load
    with pytest.raises(DataError) as info:
        load_video(sample, nframes=4)
    assert str(info.value) == expected


def damage_tail(path, fraction=0.5):
    """Overwrite the bytes of ``path`` from ``fraction`` on (a faststart mp4: its index survives, later frames
    do not)."""
    data = bytearray(path.read_bytes())
    start = int(len(data) * fraction)
    data[start:] = bytes((i * 7 + 3) % 256 for i in range(len(data) - start))
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("skip_bad", [False, True])
def test_bad_videos_probed_at_read(media, caplog, skip_bad):
    """Garbage, a truncated file and a one-frame clip are found when the file is read, before any training."""
    write_garbage(media / "videos" / "junk.mp4")
    truncate_file(write_video(media / "videos" / "cut.mp4", faststart=True), fraction=0.6)
    write_video(media / "videos" / "one.mp4", num_frames=1)
    path = write_jsonl(media / "d.jsonl", [
        {"video": "videos/v.mp4", "question": "q1", "solution": "s"},
        {"video": "videos/junk.mp4", "question": "q2", "solution": "s"},
        {"video": "videos/cut.mp4", "question": "q3", "solution": "s"},
        {"video": "videos/one.mp4", "question": "q4", "solution": "s"},
    ])
    videos = media / "videos"
    if not skip_bad:
        with pytest.raises(DataError) as info:
            read_vlm_jsonl(path)
        assert str(info.value).startswith(f"{path}:2: cannot read video {videos / 'junk.mp4'}: ")
        return
    with caplog.at_level(logging.WARNING, logger="mmrl.data.vlm"):
        samples = read_vlm_jsonl(path, skip_bad=True)
    assert [s.question for s in samples] == ["q1"] and samples.skipped == 3
    assert samples.problems[0].startswith(f"{path}:2: cannot read video {videos / 'junk.mp4'}: ")
    assert samples.problems[1].startswith(f"{path}:3: cannot read video {videos / 'cut.mp4'}: ")
    assert samples.problems[2] == f"{path}:4: video {videos / 'one.mp4'} has 1 frame(s): at least 2 are needed"
    assert "[" not in samples.problems[1]  # decord's timestamps and source locations are gone
    assert any("skipped 3 bad line(s), kept 1 sample(s)" in r.getMessage() for r in caplog.records)


def test_probe_reads_the_first_frame_only(media):
    """The probe at read time is one open and one frame: damage further in is found when the frames are decoded
    (at load time, or by mmrl config validate)."""
    damage_tail(write_video(media / "videos" / "late.mp4", num_frames=40, faststart=True), 0.5)
    path = write_jsonl(media / "d.jsonl", [{"video": "videos/late.mp4", "question": "q", "solution": "s"}])
    sample = read_vlm_jsonl(path)[0]  # passes the probe
    with pytest.raises(DataError, match=rf"^{path}:1: cannot decode frames 0\.\.39 of video .*late.mp4 "):
        load_video(sample, nframes=40)


def test_media_checks_on_threads_keep_the_order(media):
    from mmrl.data.vlm import check_all_media

    write_garbage(media / "imgs" / "bad.png")
    write_garbage(media / "videos" / "junk.mp4")
    records = []
    for i in range(24):
        records.append({"image": "imgs/bad.png" if i % 5 == 1 else "imgs/a.png", "question": f"q{i}", "solution": "s"})
        if i % 7 == 3:
            records[-1] = {"video": "videos/junk.mp4", "question": f"q{i}", "solution": "s"}
    path = write_jsonl(media / "d.jsonl", records)
    samples = read_vlm_jsonl(path, verify_images=False, verify_videos=False)
    serial = check_all_media(samples, workers=1)
    threaded = check_all_media(samples, workers=4)
    assert threaded == serial
    assert [bool(p) for p in serial] == [i % 5 == 1 or i % 7 == 3 for i in range(24)]
    skipped = read_vlm_jsonl(path, skip_bad=True)
    assert [p.split(": ")[0] for p in skipped.problems] == [f"{path}:{i + 1}" for i in range(24)
                                                             if i % 5 == 1 or i % 7 == 3]


def test_first_bad_line_raises_without_opening_later_media(media, monkeypatch):
    """Without skip_bad the first bad line is the error, as before; media after it are not opened."""
    import mmrl.data.vlm as vlm

    opened = []
    real = vlm._image_problem
    monkeypatch.setattr(vlm, "_image_problem", lambda p, **k: opened.append(p) or real(p, **k))
    path = write_jsonl(media / "d.jsonl", [{"image": "imgs/a.png", "question": "q", "solution": "s"},
                                           "{oops", {"image": "imgs/b.jpg", "question": "q", "solution": "s"}])
    with pytest.raises(DataError, match=rf"^{path}:2: not valid JSON"):
        read_vlm_jsonl(path)
    assert opened == [str(media / "imgs" / "a.png")]


# ------------------------------------------------------------------------------------------- messages


@pytest.mark.parametrize("line, expected", [
    ('{"question": "q", "solution": "unterminated}', "not valid JSON (Unterminated string starting at column 31)"),
    ('{"question": "tab\there", "solution": "s"}', "not valid JSON (Invalid control character at column 18)"),
    ('{"question": "q", "solution": "s"', "not valid JSON (Expecting ',' delimiter at column 34)"),
    ('{"question": "q", "solution": "s"} extra', "not valid JSON (Extra data at column 36)"),
    ('{"question": "q" "solution": "s"}', "not valid JSON (Expecting ',' delimiter at column 18)"),
    ('{"question": "q", "solution": "\\x"}', "not valid JSON (Invalid \\escape at column 32)"),
    (b'{"question": "caf\xe9", "solution": "s"}', "not UTF-8 text (byte 17)"),
    ({"question": 3, "solution": "s"}, "field 'question' must be a non-empty string, got int 3"),
    ({"question": "q"}, "missing required field 'solution' (a non-empty string)"),
    ({"question": "q", "solution": "s", "boxes": [[10, 0, 5, 5]]},
     "boxes[0] [10, 0, 5, 5] is empty or reversed: expected x2 > x1 and y2 > y1"),
])
def test_line_messages_read_once(media, caplog, line, expected):
    """Each message names the file and line once and reads cleanly (no "at at column", no doubled prefix), in the
    error, in the skip warning and in ``problems``."""
    path = write_jsonl(media / "m.jsonl", [{"question": "fine", "solution": "ok"}, line])
    with pytest.raises(DataError) as info:
        read_vlm_jsonl(path)
    assert str(info.value) == f"{path}:2: {expected}"
    with caplog.at_level(logging.WARNING, logger="mmrl.data.vlm"):
        kept = read_vlm_jsonl(path, skip_bad=True)
    assert kept.problems == [f"{path}:2: {expected}"]
    assert f"skipping {path}:2: {expected}" in [r.getMessage() for r in caplog.records]


def test_load_time_messages_name_the_line_once(media):
    truncate_file(write_gradient_image(media / "imgs" / "cut.jpg", 64, 48), fraction=0.8)  # passes verify()
    path = write_jsonl(media / "d.jsonl", [{"image": "imgs/cut.jpg", "question": "q", "solution": "s"}])
    sample = read_vlm_jsonl(path)[0]
    with pytest.raises(DataError) as info:
        load_images(sample)
    assert str(info.value) == (f"{path}:1: corrupt image {media / 'imgs' / 'cut.jpg'}: OSError: image file is "
                               f"truncated (1 bytes not processed)")
    assert str(info.value).count(f"{path}:1") == 1


def test_build_source_probes_videos_before_training(media, caplog):
    from pathlib import Path

    from mmrl.build import build_source
    from mmrl.config import load_config

    write_garbage(media / "videos" / "junk.mp4")
    path = write_jsonl(media / "d.jsonl", [{"video": "videos/v.mp4", "question": "q1", "solution": "s"},
                                           {"video": "videos/junk.mp4", "question": "q2", "solution": "s"}])
    recipe = Path(__file__).resolve().parent.parent / "configs" / "tiny" / "vlm_video_tg.yaml"
    with pytest.raises(DataError, match=rf"^{path}:2: cannot read video .*junk.mp4: "):
        build_source(load_config(recipe, [f"data.dataset={path}"]))
    with caplog.at_level(logging.WARNING, logger="mmrl.data.vlm"):
        source = build_source(load_config(recipe, [f"data.dataset={path}", "data.skip_bad_samples=true"]))
    assert [s.question for s in source.items] == ["q1"]
    assert source.skipped == 1 and source.problems[0].startswith(f"{path}:2: cannot read video ")
    assert any(r.getMessage().startswith(f"skipping {path}:2: ") for r in caplog.records)


# ------------------------------------------------------------------------------------------- loading


def test_load_images_without_budget(media):
    write_image(media / "imgs" / "t.png", 20, 10, (0, 0, 255), mode="RGBA")
    Image.new("L", (12, 8), 90).save(media / "imgs" / "g.png")
    path = write_jsonl(media / "d.jsonl", [{"images": ["imgs/a.png", "imgs/t.png", "imgs/g.png"],
                                            "question": "q", "solution": "s"}])
    sample = read_vlm_jsonl(path)[0]
    a, t, g = load_images(sample)
    assert all(im.mode == "RGB" for im in (a, t, g))
    assert a.size == (64, 48) and a.getpixel((5, 5)) == (200, 30, 30)
    # half-transparent blue on white: (255 * 127 + 0 * 128) / 255 ~ 127 for red/green
    r, gr, b = t.getpixel((3, 3))
    assert abs(r - 127) <= 1 and abs(gr - 127) <= 1 and b == 255
    assert g.getpixel((0, 0)) == (90, 90, 90)
    assert sample.metadata["image_size"] == [64, 48]
    assert sample.metadata["image_sizes"] == [[64, 48], [20, 10], [12, 8]]
    assert sample.metadata["input_sizes"] == sample.metadata["image_sizes"]


def test_load_images_with_budget(media):
    path = write_jsonl(media / "d.jsonl", [{"images": ["imgs/b.jpg", "imgs/a.png"], "question": "q",
                                            "solution": "s", "boxes": [[0, 0, 50, 25]]}])
    sample = read_vlm_jsonl(path)[0]
    # 100 x 50: rounded to 112 x 56 = 6272 > 4000, so beta = sqrt(5000 / 4000); floor(100 / 1.118 / 28) = 3,
    # floor(50 / 1.118 / 28) = 1 -> 84 x 28
    b, a = load_images(sample, max_pixels=4000)
    assert b.size == (84, 28)
    assert a.size == (56, 56)  # 64 x 48 rounds to 56 x 56 = 3136 <= 4000
    for im in (a, b):
        assert im.width % 28 == 0 and im.height % 28 == 0 and im.width * im.height <= 4000
    assert sample.metadata["image_size"] == [100, 50] and sample.metadata["input_size"] == [84, 28]
    assert sample.metadata["boxes"] == [[0.0, 0.0, 50.0, 25.0]]  # ground truth stays in original pixels
    # a minimum upscales: 64 x 48 with min 112 * 112 -> ceil to multiples of 28 above the minimum
    (a,) = load_images(VLMSample("x", "q", "s", image_paths=[str(media / "imgs" / "a.png")]), min_pixels=112 * 112)
    assert a.width % 28 == 0 and a.height % 28 == 0 and a.width * a.height >= 112 * 112


def test_load_images_corrupt_at_load_time(media):
    bad = truncate_file(write_gradient_image(media / "imgs" / "late.png", 64, 48), fraction=0.5)
    path = write_jsonl(media / "d.jsonl", [{"image": "imgs/late.png", "question": "q", "solution": "s"}])
    sample = read_vlm_jsonl(path, verify_images=False)[0]
    with pytest.raises(DataError, match=rf"d.jsonl:1: corrupt image {bad}"):
        load_images(sample)


def test_load_video_records_timing(media):
    path = write_jsonl(media / "d.jsonl", [
        {"video": "videos/v.mp4", "question": "q", "solution": "s", "timestamps": [1, 2]},
        {"video": "videos/v.mp4", "question": "q", "solution": "s", "duration": 4.2},
        {"question": "q", "solution": "s"},
    ])
    first, second, text_only = read_vlm_jsonl(path)
    clip = load_video(first, fps=2, max_pixels=3136)
    assert clip.indices == [0, 6, 11, 17, 22, 28, 33, 39]
    assert clip.frames.shape == (8, 3, 56, 56)
    assert [nearest_frame(f, 40) for f in clip.frames] == clip.indices
    meta = first.metadata
    assert meta["duration"] == pytest.approx(4.0) and meta["sample_fps"] == pytest.approx(2.0)
    assert meta["second_per_grid_ts"] == pytest.approx(1.0) and meta["num_frames"] == 8
    assert meta["video_fps"] == pytest.approx(10.0) and meta["timestamps"] == [1.0, 2.0]
    load_video(second, nframes=4)
    assert second.metadata["duration"] == 4.2  # the line's own duration is kept
    assert second.metadata["second_per_grid_ts"] == pytest.approx(2.0)
    with pytest.raises(DataError, match="d.jsonl:3: the sample has no video"):
        load_video(text_only)
    missing = VLMSample("m", "q", "s", video_path=str(media / "gone.mp4"), source="x.jsonl:9")
    with pytest.raises(DataError, match="x.jsonl:9: video not found: .*gone.mp4"):
        load_video(missing)


# ------------------------------------------------------------------------------------------- Hugging Face rows


def _rows(media):
    return [
        {"image": Image.new("RGB", (40, 30), frame_colour(5)), "problem": "What colour?", "answer": "olive",
         "kind": "vqa", "source_ds": "toy"},
        {"image": [Image.new("RGBA", (10, 10), (0, 0, 0, 0)), Image.new("L", (8, 8), 3)], "problem": "Two?",
         "answer": "2"},
        {"image": str(media / "imgs" / "a.png"), "problem": "Path?", "answer": "p", "boxes": [[1, 1, 5, 5]]},
        {"image": {"bytes": (media / "imgs" / "a.png").read_bytes(), "path": None}, "problem": "Bytes?",
         "answer": "b"},
        {"image": None, "video": str(media / "videos" / "v.mp4"), "problem": "Video?", "answer": "v"},
    ]


def test_samples_from_rows(media):
    samples = samples_from_hf(_rows(media), question_column="problem", solution_column="answer",
                              task_column="kind", name="toy")
    assert len(samples) == 5 and samples.skipped == 0
    first = samples[0]
    assert first.question == "What colour?" and first.solution == "olive" and first.task == "vqa"
    assert first.source == "toy:0" and first.metadata["source_ds"] == "toy" and first.num_images == 1
    (image,) = load_images(first, max_pixels=28 * 28 * 4)
    # qwen-vl-utils' smart_resize: 30 x 40 rounds to 28 x 28, under the minimum (3136, capped at the maximum), so
    # upscaled by sqrt(3136 / 1200) and ceiled: 56 x 84, past the maximum by a row of patches as there
    assert image.size == (84, 56) and first.metadata["image_size"] == [40, 30]
    assert first.metadata["input_size"] == [84, 56]
    two = load_images(samples[1])
    assert [im.mode for im in two] == ["RGB", "RGB"] and two[0].getpixel((0, 0)) == (255, 255, 255)
    assert samples[2].image_paths == [str(media / "imgs" / "a.png")] and samples[2].metadata["boxes"]
    assert load_images(samples[3])[0].getpixel((1, 1)) == (200, 30, 30)
    assert samples[4].video_path == str(media / "videos" / "v.mp4") and samples[4].task == "default"


def test_bad_rows(media):
    rows = _rows(media)
    rows[1]["answer"] = None
    with pytest.raises(DataError, match="toy:1: missing required field 'solution'"):
        samples_from_hf(rows, question_column="problem", solution_column="answer", name="toy")
    kept = samples_from_hf(rows, question_column="problem", solution_column="answer", name="toy", skip_bad=True)
    assert len(kept) == 4 and kept.skipped == 1
    with pytest.raises(DataError, match="dataset:0: image column: expected a PIL image"):
        samples_from_hf([{"image": 3, "question": "q", "solution": "s"}])
    with pytest.raises(DataError, match=r"pass e.g. dataset\['train'\]"):
        samples_from_hf({"train": rows})


def test_datasets_dataset(media):
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (optional; rows are converted "
                                                      "the same way from any iterable of dicts)")
    ds = datasets.Dataset.from_list([{"image": str(media / "imgs" / "a.png"), "question": "q", "solution": "s"}])
    ds = ds.cast_column("image", datasets.Image())
    (sample,) = samples_from_hf(ds)
    assert load_images(sample)[0].getpixel((1, 1)) == (200, 30, 30)


# ------------------------------------------------------------------------------------------- order and resume


def _samples(n):
    return [VLMSample(str(i), f"q{i}", "s", source=f"f:{i + 1}") for i in range(n)]


def test_source_order_is_seeded_permutations():
    source = VLMSampleSource(_samples(7), seed=3)
    seen = [s.id for s in source.next_batch(7)]
    assert sorted(seen) == [str(i) for i in range(7)]  # one epoch = one permutation
    again = VLMSampleSource(_samples(7), seed=3)
    assert [s.id for s in again.next_batch(7)] == seen  # same seed, same order
    assert [s.id for s in VLMSampleSource(_samples(7), seed=3, shuffle=False).next_batch(7)] == list("0123456")
    # matches PromptSource's order for the same seed and size (one shared ordering)
    prompts = PromptSource([PromptItem(str(i)) for i in range(7)], seed=3)
    assert [p.prompt for p in prompts.next_batch(7)] == seen


def test_source_ranks_and_resume():
    # two processes, 2 samples each per step: one epoch of 12 in 3 steps, every sample exactly once
    world = [VLMSampleSource(_samples(12), seed=1) for _ in range(2)]
    taken = []
    for _ in range(3):
        taken += [s.id for s in world[0].next_batch(2, rank=0, world=2)]
        taken += [s.id for s in world[1].next_batch(2, rank=1, world=2)]
    assert sorted(taken, key=int) == [str(i) for i in range(12)]
    state = world[0].state_dict()
    assert state == {"position": 12, "seed": 1, "num_samples": 12, "fingerprint": world[1].fingerprint()}
    expected = [s.id for s in world[0].next_batch(5)]
    assert expected == [s.id for s in VLMSampleSource(_samples(12), seed=1).next_batch(17)[12:]]
    resumed = VLMSampleSource(_samples(12), seed=1)
    resumed.load_state_dict(state)
    assert [s.id for s in resumed.next_batch(5)] == expected
    with pytest.raises(DataError, match="taken with 12 samples, this run has 9"):
        VLMSampleSource(_samples(9), seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="no samples"):
        VLMSampleSource([])


def test_prompt_source_state_unchanged():
    source = PromptSource([PromptItem("a"), PromptItem("b")], seed=0)
    source.next_batch(1)
    state = source.state_dict()
    assert {k: v for k, v in state.items() if k != "fingerprint"} == {"position": 1, "seed": 0, "num_prompts": 2}
    with pytest.raises(DataError, match="taken with 3 prompts, this run has 2: resume with the same prompt set"):
        source.load_state_dict({"position": 0, "seed": 0, "num_prompts": 3})
    with pytest.raises(DataError, match="no prompts: the prompt set is empty"):
        PromptSource([])
    # the same prompts resume silently (a checkpoint without a fingerprint too); an edited set of the same length
    # resumes at its position with a note
    assert PromptSource([PromptItem("a"), PromptItem("b")]).load_state_dict(state) is None
    assert PromptSource([PromptItem("a"), PromptItem("b")]).load_state_dict({"position": 1, "num_prompts": 2}) is None
    edited = PromptSource([PromptItem("a"), PromptItem("c")])
    assert "differs from the one the checkpoint was taken with (same count, 2 prompts" in edited.load_state_dict(state)
    assert edited.position == 1


def test_a_resume_over_changed_data_says_the_checkpoint_is_intact(tmp_path):
    """A prompt file edited before a resume read as a damaged checkpoint, whose advice (resume from the previous
    one, or delete it) failed the same way on every checkpoint and deleted good ones."""
    from mmrl.checkpoint import CheckpointError, restore_data_state

    folder = tmp_path / "checkpoints" / "step_2"
    state = {"data": PromptSource([PromptItem(str(i)) for i in range(6)]).state_dict()}
    with pytest.raises(DataError) as info:
        restore_data_state(PromptSource([PromptItem("only")]), state, folder)
    assert str(info.value).startswith(f"cannot resume from {folder}: the checkpoint was taken with 6 prompts, this "
                                      f"run has 1") and "the checkpoint is intact" in str(info.value)
    assert not isinstance(info.value, CheckpointError) and "damaged" not in str(info.value)
    with pytest.raises(CheckpointError, match="is damaged: state.json's data state does not fit this run"):
        restore_data_state(PromptSource([PromptItem("only")]), {"data": {"num_prompts": 1}}, folder)
