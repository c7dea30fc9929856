"""Deep data validation (mmrl.data.validate.check_data, behind `mmrl config validate`) and prompt-file messages."""

import inspect
import logging
from pathlib import Path

import pytest
from fixtures import (TINY_RECIPE, truncate_file, write_garbage, write_gradient_image, write_image, write_jsonl,
                      write_video)

from mmrl.config import load_config
from mmrl.data.prompts import DataError, read_prompts
from mmrl.data.validate import MAX_LISTED, DataReport, check_data

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
VLM_RECIPE = CONFIGS / "tiny" / "vlm_video_tg.yaml"


def damage_tail(path, fraction=0.5):
    """Overwrite the bytes from ``fraction`` on: a faststart mp4 still opens and decodes its first frame."""
    data = bytearray(path.read_bytes())
    start = int(len(data) * fraction)
    data[start:] = bytes((i * 7 + 3) % 256 for i in range(len(data) - start))
    path.write_bytes(bytes(data))
    return path


def vlm_config(dataset, *overrides, check_files=True):
    return load_config(VLM_RECIPE, [f"data.dataset={dataset}", *overrides], check_files=check_files)


@pytest.fixture
def data(tmp_path):
    """A JSONL with two good lines and one of every kind of problem, in file order."""
    write_image(tmp_path / "imgs" / "a.png")
    write_garbage(tmp_path / "imgs" / "junk.png")
    truncate_file(write_gradient_image(tmp_path / "imgs" / "cut.jpg", 64, 48), fraction=0.8)  # passes verify()
    write_video(tmp_path / "videos" / "v.mp4", num_frames=40)
    write_garbage(tmp_path / "videos" / "junk.mp4")
    damage_tail(write_video(tmp_path / "videos" / "late.mp4", num_frames=40, faststart=True))  # passes the probe
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"image": "imgs/a.png", "question": "q1", "solution": "s"},            # 1 good
        '{"question": "q2", "solution": "unterminated}',                       # 2 bad JSON
        {"question": "q3"},                                                    # 3 missing field
        {"image": "imgs/gone.png", "question": "q4", "solution": "s"},         # 4 missing image
        {"images": ["imgs/junk.png", "imgs/cut.jpg"], "question": "q5", "solution": "s"},  # 5 two bad images
        {"video": "videos/junk.mp4", "question": "q6", "solution": "s"},       # 6 unreadable video
        {"video": "videos/late.mp4", "question": "q7", "solution": "s"},       # 7 damaged after frame 0
        {"video": "videos/v.mp4", "question": "q8", "solution": "s"},          # 8 good
    ])
    return path


def test_signature_is_the_cli_contract():
    """`mmrl config validate CONFIG [--quick]` calls check_data(config, media=not args.quick)."""
    params = inspect.signature(check_data).parameters
    assert list(params) == ["config", "media"]
    assert params["media"].kind is inspect.Parameter.KEYWORD_ONLY and params["media"].default is True


def test_full_check_lists_every_problem(data):
    with pytest.raises(DataError) as info:
        check_data(vlm_config(data))
    text = str(info.value)
    head, *listed = text.splitlines()
    assert head == (f"{data}: 7 problem(s) in 6 of 8 line(s) (data.skip_bad_samples=true skips and counts the bad "
                    f"lines instead):")
    where = [line.strip().split(": ")[0] for line in listed]
    assert where == [f"{data}:{n}" for n in (2, 3, 4, 5, 5, 6, 7)]
    folder = data.parent
    assert listed[0] == f"  {data}:2: not valid JSON (Unterminated string starting at column 32)"
    assert listed[1] == f"  {data}:3: missing required field 'solution' (a non-empty string)"
    assert listed[2] == (f"  {data}:4: image file not found: {folder / 'imgs' / 'gone.png'} (from 'imgs/gone.png')")
    assert listed[3].startswith(f"  {data}:5: corrupt image {folder / 'imgs' / 'junk.png'}: UnidentifiedImageError")
    assert listed[4] == (f"  {data}:5: corrupt image {folder / 'imgs' / 'cut.jpg'}: OSError: image file is truncated "
                         f"(1 bytes not processed)")
    assert listed[5].startswith(f"  {data}:6: cannot read video {folder / 'videos' / 'junk.mp4'}: ")
    assert listed[6].startswith(f"  {data}:7: cannot decode frames 0..39 of video {folder / 'videos' / 'late.mp4'}")
    for line in listed:  # each location once, no decord timestamps or source locations
        assert line.count(str(data)) == 1 and "/github/" not in line and " at at " not in line


def test_quick_check_decodes_nothing(data):
    with pytest.raises(DataError) as info:
        check_data(vlm_config(data), media=False)
    listed = str(info.value).splitlines()[1:]
    assert [line.strip().split(": ")[0] for line in listed] == [f"{data}:{n}" for n in (2, 3, 4)]


def test_skip_bad_returns_the_counts(data):
    report = check_data(vlm_config(data, "data.skip_bad_samples=true"))
    assert isinstance(report, DataReport) and report.checked and report.media and not report.ok
    assert (report.kind, report.source) == ("vlm", str(data))
    assert (report.records, report.usable, report.bad_records) == (8, 2, 6)
    assert (report.images, report.videos) == (3, 3)  # media named by lines that parsed (not line 4's missing one)
    assert len(report.problems) == 7
    summary = report.summary()
    assert summary.splitlines()[0] == (f"{data}: 8 line(s), 2 usable, 6 bad; 3 image(s) and 3 video(s) decoded; "
                                       f"7 problem(s):")
    quick = check_data(vlm_config(data, "data.skip_bad_samples=true"), media=False)
    assert (quick.usable, quick.bad_records, quick.media) == (5, 3, False)
    assert "found (not decoded: quick check)" in quick.summary()


def test_clean_data_passes(tmp_path):
    write_image(tmp_path / "a.png")
    write_video(tmp_path / "v.mp4", num_frames=40)
    path = write_jsonl(tmp_path / "d.jsonl", [{"image": "a.png", "question": "q", "solution": "s"},
                                              {"video": "v.mp4", "question": "q", "solution": "s"}])
    report = check_data(vlm_config(path))
    assert report.ok and (report.records, report.usable, report.images, report.videos) == (2, 2, 1, 1)
    assert report.summary() == f"{path}: 2 line(s), 2 usable, 0 bad; 1 image(s) and 1 video(s) decoded"


def test_annotations_that_load_but_look_wrong_are_noted(tmp_path):
    """Unit-square boxes (every answer's IoU 0 against them in pixels) and timestamps past the line's own duration:
    noted, not errors (Charades-STA's spans overrun their clips by a fraction; a pixel box of [0, 0, 1, 1] is odd but
    legal). Both were accepted silently."""
    write_image(tmp_path / "a.png")
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"image": "a.png", "question": "q", "solution": "s", "boxes": [[0.1, 0.1, 0.5, 0.6]]},
        {"image": "a.png", "question": "q", "solution": "s", "boxes": [[1, 2, 30, 40]]},
        {"question": "q", "solution": "s", "timestamps": [5, 9], "duration": 4.0},
        {"question": "q", "solution": "s", "timestamps": [3, 4.5], "duration": 4.0},  # under a second over
    ])
    for media in (True, False):
        report = check_data(vlm_config(path), media=media)
        assert report.ok and report.usable == 4
        assert report.notes == [
            f"{path}:1: boxes [0.1, 0.1, 0.5, 0.6] are all within [0, 1]: normalised to the unit square? mmrl's "
            f"boxes are the image's pixels (Qwen2-VL / Qwen3-VL: [0, 1000))",
            f"{path}:3: timestamps [5.0, 9.0] end after the clip's duration 4.0"]
        assert "2 line(s) load but look wrong (not errors" in report.summary()


def test_full_check_decodes_the_frames_training_reads(tmp_path):
    """A 3-frame video probes fine, and the plan of generation.video_nframes=4 cannot be met: found before training."""
    write_video(tmp_path / "short.mp4", num_frames=3)
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "solution": "s"},
                                              {"video": "short.mp4", "question": "q", "solution": "s"}])
    assert check_data(vlm_config(path, "generation.video_fps=null", "generation.video_nframes=2")).ok
    with pytest.raises(DataError, match=rf"{path}:2: video .*short.mp4: 4 frames from a 3-frame video"):
        check_data(vlm_config(path, "generation.video_fps=null", "generation.video_nframes=4"))


def test_many_problems_are_capped(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "ok", "solution": "s"}] + ["{bad"] * (MAX_LISTED + 5))
    with pytest.raises(DataError) as info:
        check_data(vlm_config(path))
    lines = str(info.value).splitlines()
    assert len(lines) == 1 + MAX_LISTED + 1 and lines[-1] == "  ... and 5 more"
    assert lines[1] == f"  {path}:2: not valid JSON (Expecting property name enclosed in double quotes at column 2)"


def test_nothing_usable_is_an_error_even_when_skipping(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["{bad", {"question": "q"}])
    with pytest.raises(DataError) as info:
        check_data(vlm_config(path, "data.skip_bad_samples=true"))
    assert str(info.value).splitlines()[0] == f"{path}: no usable samples: 2 problem(s) in 2 of 2 line(s):"
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no usable samples in .*empty.jsonl: it has no non-blank line"):
        check_data(vlm_config(tmp_path / "empty.jsonl"))
    with pytest.raises(DataError) as info:
        check_data(vlm_config(tmp_path / "nowhere.jsonl", check_files=False))
    assert str(info.value) == f"VLM data file not found: {tmp_path / 'nowhere.jsonl'}"


def test_synthetic_sets_are_not_checked(monkeypatch):
    import mmrl.data.synthetic as synthetic

    monkeypatch.setattr(synthetic, "ensure_synthetic", lambda *a, **k: pytest.fail("built a synthetic set"))
    report = check_data(vlm_config("tiny:temporal_grounding"))
    assert not report.checked and report.ok
    assert report.summary() == "tiny:temporal_grounding: 0 line(s); nothing to check"


def test_check_data_logs_no_skip_warnings(data, caplog):
    with caplog.at_level(logging.WARNING):
        check_data(vlm_config(data, "data.skip_bad_samples=true"), media=False)
    assert not [r for r in caplog.records if "skipping" in r.getMessage()]


# ------------------------------------------------------------------------------------------- prompt files


def flow_config(prompts, check_files=True):
    return load_config(TINY_RECIPE, [f"data.prompts={prompts}"], check_files=check_files)


def test_prompt_file_problems_all_listed(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "a red apple", "tag": 1},
        '{"prompt": "unterminated}',
        {"prompt": 3},
        {"text": "no prompt"},
        [1, 2],
        b'{"prompt": "caf\xe9"}',
        {"prompt": "a blue cube"},
    ])
    with pytest.raises(DataError) as info:
        check_data(flow_config(path))
    assert str(info.value).splitlines() == [
        f"{path}: 5 problem(s) in 5 of 7 line(s) (data.skip_bad_samples=true skips and counts the bad lines instead):",
        f"  {path}:2: not valid JSON (Unterminated string starting at column 12)",
        f"  {path}:3: expected an object with a string 'prompt' field, got 'prompt' of type int",
        f"  {path}:4: expected an object with a string 'prompt' field, got no 'prompt'",
        f"  {path}:5: expected an object with a string 'prompt' field, got list",
        f"  {path}:6: not UTF-8 text (byte 15)",
    ]
    # read_prompts (training) stops at the first, with the same text
    with pytest.raises(DataError) as info:
        read_prompts(path)
    assert str(info.value) == f"{path}:2: not valid JSON (Unterminated string starting at column 12)"


def test_prompt_metadata_a_reward_cannot_score_is_noted_by_line(tmp_path):
    """GenEval metadata the configured reward cannot score (a class ShapeWorld cannot draw, a count that is not a
    number, no clause) validated as "0 bad" and then gave NaN on every sample; an unknown tag went unmentioned."""
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "a red giraffe", "tag": "color_attr", "include": [{"class": "giraffe", "count": 1, "color": "red"}]},
        {"prompt": "a blue square", "tag": "colors", "include": [{"class": "square", "count": "one"}]},
        {"prompt": "a photo", "tag": "single_object"},
        {"prompt": "a circle", "tag": "colour_attribute", "include": [{"class": "circle", "count": 1}]},
    ])
    report = check_data(load_config(TINY_RECIPE, [f"data.prompts={path}", "rewards={shapeworld: 1.0}"]))
    assert (report.records, report.usable, report.problems) == (4, 4, [])
    assert [n.split(": ", 1)[0] for n in report.notes] == [f"{path}:{k}" for k in (1, 2, 3, 4)]
    assert "gets a NaN reward" in report.notes[0] and "rewards.shapeworld: include clause 0 names 'giraffe'" in \
        report.notes[0]
    assert "invalid count 'one'" in report.notes[1] and "no 'include' or 'exclude' clause" in report.notes[2]
    assert "tag 'colour_attribute' is none of GenEval's categories" in report.notes[3]
    # a reward that reads no metadata checks none of it
    assert check_data(load_config(TINY_RECIPE, [f"data.prompts={path}", "rewards={brightness: 1.0}"])).notes == []


def test_prompt_files_ok(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_bytes("\ufeffa red apple\n\n  a blue cube  \n".encode())
    report = check_data(flow_config(txt))
    assert (report.kind, report.records, report.usable, report.problems) == ("prompts", 2, 2, [])
    assert [p.prompt for p in read_prompts(txt)] == ["a red apple", "a blue cube"]  # the BOM is not a prompt
    jsonl = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "include": [{"class": "cat"}]}])
    jsonl.write_bytes(b"\xef\xbb\xbf" + jsonl.read_bytes())
    assert read_prompts(jsonl)[0].metadata == {"include": [{"class": "cat"}]}
    inline = check_data(load_config(TINY_RECIPE))
    assert not inline.checked and inline.source == "data.prompt_list"


def test_prompt_file_missing_or_empty(tmp_path):
    with pytest.raises(DataError) as info:
        check_data(flow_config(tmp_path / "none.txt", check_files=False))
    assert str(info.value) == f"prompt file not found: {tmp_path / 'none.txt'}"
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(DataError, match=r"no usable prompts in .*empty.txt: it has no non-blank line"):
        check_data(flow_config(tmp_path / "empty.txt"))
    with pytest.raises(DataError, match=r"prompt file is empty: .*empty.txt"):
        read_prompts(tmp_path / "empty.txt")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\n\xff\xfe broken\n")
    with pytest.raises(DataError) as info:
        read_prompts(bad)
    assert str(info.value) == f"{bad}:2: not UTF-8 text (byte 0)"


def test_balance_tags_gives_every_category_an_equal_share_of_a_pass(tmp_path):
    from collections import Counter

    from mmrl.build import build_source
    from mmrl.config import ConfigError
    from mmrl.data.prompts import PromptItem, balance_by_tag

    items = [PromptItem("a", {"tag": "x"}), PromptItem("b", {"tag": "y"}), PromptItem("c", {"tag": "y"}),
             PromptItem("d", {"tag": "y"})]
    assert [i.prompt for i in balance_by_tag(items)] == ["a", "a", "a", "b", "c", "d"]  # cycled to the largest
    source = build_source(load_config(TINY_RECIPE, ["data.prompts=shapeworld:train", "data.balance_tags=true"]))
    plain = build_source(load_config(TINY_RECIPE, ["data.prompts=shapeworld:train"]))
    per_tag = Counter(i.metadata["tag"] for i in plain.items)
    assert per_tag["color_attr"] == 84 and per_tag["single_object"] == 2  # the split itself is unbalanced
    batch = source.next_batch(len(source.items))  # one whole pass, shuffled
    assert Counter(i.metadata["tag"] for i in batch) == {tag: 84 for tag in per_tag}
    assert {i.prompt for i in batch} == {i.prompt for i in plain.items}  # every prompt still in it
    untagged = tmp_path / "p.jsonl"
    untagged.write_text('{"prompt": "a cat", "tag": "animals"}\n{"prompt": "a dog"}\n')
    with pytest.raises(DataError, match="prompt 2 .*'a dog'.* no 'tag'"):
        build_source(load_config(TINY_RECIPE, [f"data.prompts={untagged}", "data.balance_tags=true"]))
    with pytest.raises(ConfigError, match="balance_tags applies to flow prompts"):
        load_config(None, ["model.family=qwen_vl", "data.dataset=tiny:grounding", "data.balance_tags=true"],
                    check_files=False)


def test_an_image_qwen_vl_cannot_take_is_listed_by_the_check(tmp_path):
    """Aspect ratios above 200 are refused by Qwen's smart_resize: the data check lists them before training."""
    from PIL import Image

    Image.new("RGB", (5000, 20), (10, 20, 30)).save(tmp_path / "wide.png")
    write_image(tmp_path / "a.png")
    path = write_jsonl(tmp_path / "d.jsonl", [{"image": "a.png", "question": "q", "solution": "s"},
                                              {"image": "wide.png", "question": "q", "solution": "s"}])
    with pytest.raises(DataError, match="wide.png is 5000x20: an aspect ratio above 200"):
        check_data(vlm_config(path))
    report = check_data(vlm_config(path, "data.skip_bad_samples=true"))
    assert report.usable == 1 and len(report.problems) == 1


def test_16_bit_and_float_images_are_scaled_not_clipped(tmp_path):
    """PIL's convert("RGB") clips 16-bit grey to 255 (a white image); to_rgb scales it to 8 bits."""
    import numpy as np
    from PIL import Image

    from mmrl.data.vlm import to_rgb

    ramp = (np.arange(32 * 32).reshape(32, 32) * 64).astype(np.uint16)  # 0 .. 65472
    Image.fromarray(ramp).save(tmp_path / "g16.png")
    with Image.open(tmp_path / "g16.png") as image:
        assert image.mode.startswith("I")
        got = np.asarray(to_rgb(image))
    assert got.shape == (32, 32, 3) and (got[..., 0] == got[..., 2]).all()
    np.testing.assert_allclose(got[..., 0], np.round(ramp / 257.0), atol=1)
    floats = Image.fromarray(np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8), mode="F")
    assert np.asarray(to_rgb(floats))[..., 0].max() == 255 and np.asarray(to_rgb(floats))[0, 0, 0] == 0
    small = Image.fromarray(np.full((4, 4), 200, dtype=np.int32), mode="I")  # an 8-bit range in 32-bit ints
    assert (np.asarray(to_rgb(small)) == 200).all()


def test_a_json_prompt_file_or_a_folder_is_named(tmp_path):
    (tmp_path / "p.json").write_text('[{"prompt": "a"}]')
    with pytest.raises(DataError, match=r"p.json: a .json file; prompt files are .txt .* or .jsonl"):
        read_prompts(tmp_path / "p.json")
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="is a folder, not a prompt file"):
        read_prompts(tmp_path / "folder")
    (tmp_path / "p.csv").write_text("prompt\na red apple\n")  # the header would be trained on as a prompt
    with pytest.raises(DataError, match=r"p.csv: a .csv file; prompt files are .txt"):
        read_prompts(tmp_path / "p.csv")


def test_an_empty_jsonl_prompt_is_a_data_error_as_in_prompt_list(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a cat"}\n{"prompt": "   "}\n')
    with pytest.raises(DataError, match=r"p.jsonl:2: an empty 'prompt'"):
        read_prompts(path)
