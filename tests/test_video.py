"""Frame sampling (qwen-vl-utils' rule, hand-worked) and decoding real mp4 files with decord."""

import pytest
import torch
from fixtures import frame_colour, nearest_frame, truncate_file, write_garbage, write_video

from mmrl.data.prompts import DataError
from mmrl.data.video import (_reason, budget_size, num_sampled_frames, plan_frames, probe_video, read_video,
                             sample_frame_indices, smart_resize)

# ------------------------------------------------------------------------------------------- the rule


def test_fps_rule_300_frames_at_30fps():
    # 300 / 30 * 2 = 20 frames; indices round(i * 299 / 19)
    expected = [0, 16, 31, 47, 63, 79, 94, 110, 126, 142, 157, 173, 189, 205, 220, 236, 252, 268, 283, 299]
    assert sample_frame_indices(300, 30.0, fps=2) == expected
    assert sample_frame_indices(300, 30.0) == expected  # fps defaults to 2
    plan = plan_frames(300, 30.0, fps=2)
    assert plan.sample_fps == pytest.approx(2.0)  # 20 / 300 * 30
    assert plan.second_per_grid_ts == pytest.approx(1.0)  # 2 / sample_fps


def test_fps_rule_floors_to_even():
    # 100 / 30 * 2 = 6.67 -> 6; linspace(0, 99, 6) = 0, 19.8, 39.6, 59.4, 79.2, 99
    assert sample_frame_indices(100, 30.0, fps=2) == [0, 20, 40, 59, 79, 99]
    plan = plan_frames(100, 30.0, fps=2)
    assert plan.sample_fps == pytest.approx(6 / 100 * 30)
    assert plan.second_per_grid_ts == pytest.approx(2 / 1.8)
    # 90 / 30 * 2.5 = 7.5 -> 6 (floor to even, never up)
    assert num_sampled_frames(90, 30.0, fps=2.5) == 6


def test_nframes_rounds_to_even():
    assert sample_frame_indices(40, 10.0, nframes=4) == [0, 13, 26, 39]
    assert sample_frame_indices(40, 10.0, nframes=8) == [0, 6, 11, 17, 22, 28, 33, 39]
    # round(n / 2) * 2 with Python's round (ties to even quotient), as qwen-vl-utils
    assert num_sampled_frames(40, 10.0, nframes=5) == 4  # round(2.5) = 2
    assert num_sampled_frames(40, 10.0, nframes=7) == 8  # round(3.5) = 4
    assert num_sampled_frames(40, 10.0, nframes=3) == 4  # round(1.5) = 2
    assert num_sampled_frames(40, 10.0, nframes=6) == 6
    # min/max_frames do not apply to nframes
    assert num_sampled_frames(40, 10.0, nframes=2, min_frames=10) == 2


def test_min_and_max_clipping():
    # 40 / 10 * 0.5 = 2 frames -> clipped up to min_frames 4
    assert sample_frame_indices(40, 10.0, fps=0.5) == [0, 13, 26, 39]
    # odd min_frames is ceiled to even: 5 -> 6
    assert num_sampled_frames(40, 10.0, fps=0.5, min_frames=5) == 6
    # 300 / 30 * 30 = 300 -> max 768 does not bind, total does: every frame
    assert sample_frame_indices(300, 30.0, fps=30) == list(range(300))
    # max_frames 9 -> floored to 8
    assert num_sampled_frames(300, 30.0, fps=30, max_frames=9) == 8
    # the default max is 768
    assert num_sampled_frames(10_000, 10.0, fps=10) == 768


def test_short_videos():
    # 3 frames: min 4 is capped by the video's length, then floored to even -> 2
    assert sample_frame_indices(3, 30.0, fps=2) == [0, 2]
    assert plan_frames(3, 30.0).sample_fps == pytest.approx(2 / 3 * 30)
    assert sample_frame_indices(2, 30.0) == [0, 1]
    assert sample_frame_indices(5, 30.0) == [0, 1, 3, 4]  # 4 frames: linspace(0, 4, 4) = 0, 1.33, 2.67, 4


def test_start_end_range():
    # 40 frames at 10 fps, [1 s, 3 s] -> frames 10..30 (21 frames); 21 / 10 * 2 = 4.2 -> 4
    plan = plan_frames(40, 10.0, start=1.0, end=3.0)
    assert (plan.first, plan.last) == (10, 30)
    assert plan.indices == [10, 17, 23, 30]
    assert plan.sample_fps == pytest.approx(4 / 21 * 10)
    # start past end, or a range of one frame
    with pytest.raises(ValueError, match="empty time range"):
        plan_frames(40, 10.0, start=3.0, end=1.0)
    with pytest.raises(ValueError, match="empty time range"):
        plan_frames(40, 10.0, start=2.0, end=2.05)


def test_bad_arguments():
    with pytest.raises(ValueError, match="either fps or nframes"):
        sample_frame_indices(40, 10.0, fps=2, nframes=4)
    with pytest.raises(ValueError, match="no frames"):
        sample_frame_indices(0, 10.0)
    with pytest.raises(ValueError, match=r"\[2, 40\]"):
        sample_frame_indices(40, 10.0, nframes=50)
    with pytest.raises(ValueError, match=r"the video has 1 frame; Qwen-VL video input needs at least 2"):
        sample_frame_indices(1, 30.0)  # a 1-frame video cannot give an even count
    with pytest.raises(ValueError, match=r"\[2, 40\]"):
        sample_frame_indices(40, 10.0, nframes=1)  # round(0.5) * 2 = 0
    with pytest.raises(ValueError, match="video_fps"):
        sample_frame_indices(40, 0.0)
    with pytest.raises(ValueError, match="fps must be a positive"):
        sample_frame_indices(40, 10.0, fps=-1)


# ------------------------------------------------------------------------------------------- decoding


@pytest.fixture(scope="module")
def video_40(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("video") / "v40.mp4", num_frames=40, width=64, height=48, fps=10)


def test_fixture_palette_is_distinct():
    assert len({frame_colour(i) for i in range(40)}) == 40


def test_read_video_decodes_the_sampled_frames(video_40):
    clip = read_video(video_40, fps=2)
    assert clip.indices == [0, 6, 11, 17, 22, 28, 33, 39]  # 40 / 10 * 2 = 8 frames
    assert clip.frames.dtype == torch.uint8 and clip.frames.shape == (8, 3, 48, 64)
    assert [nearest_frame(f, 40) for f in clip.frames] == clip.indices
    # solid colours survive the codec within a few levels
    for frame, index in zip(clip.frames, clip.indices):
        assert (frame.float().mean((1, 2)) - torch.tensor(frame_colour(index), dtype=torch.float)).abs().max() < 6
    assert clip.video_fps == pytest.approx(10.0) and clip.total_frames == 40
    assert clip.duration == pytest.approx(4.0)
    assert clip.sample_fps == pytest.approx(2.0) and clip.second_per_grid_ts == pytest.approx(1.0)
    assert clip.original_size == (64, 48)
    assert clip.frame_times == pytest.approx([i / 10 for i in clip.indices])


def test_read_video_every_frame_and_nframes(video_40):
    clip = read_video(video_40, nframes=40)
    assert [nearest_frame(f, 40) for f in clip.frames] == list(range(40))
    clip = read_video(video_40, nframes=4)
    assert clip.indices == [0, 13, 26, 39]
    assert [nearest_frame(f, 40) for f in clip.frames] == [0, 13, 26, 39]
    assert clip.sample_fps == pytest.approx(1.0) and clip.second_per_grid_ts == pytest.approx(2.0)


def test_read_video_time_range(video_40):
    clip = read_video(video_40, start=1.0, end=3.0)
    assert clip.indices == [10, 17, 23, 30]
    assert [nearest_frame(f, 40) for f in clip.frames] == [10, 17, 23, 30]
    assert clip.duration == pytest.approx(4.0)  # of the whole video


def test_pixel_budget(video_40):
    # 48 x 64 -> each side rounded to 28: 56 x 56 = 3136, within a 3136 budget
    clip = read_video(video_40, nframes=4, max_pixels=3136)
    assert clip.frames.shape == (4, 3, 56, 56) and clip.frames.dtype == torch.uint8
    # a budget of 2 patches: 56 x 56 is over, so both sides shrink: floor(48 / 1.4 / 28) = 1, floor(64 / 1.4 / 28) = 1
    clip = read_video(video_40, nframes=4, max_pixels=2 * 28 * 28)
    assert clip.frames.shape[-2:] == (28, 28)
    assert [nearest_frame(f, 40) for f in clip.frames] == [0, 13, 26, 39]  # still the right frames
    # Qwen3-VL's factor 32
    clip = read_video(video_40, nframes=2, max_pixels=64 * 64, factor=32)
    h, w = clip.frames.shape[-2:]
    assert h % 32 == 0 and w % 32 == 0 and h * w <= 64 * 64
    with pytest.raises(ValueError, match="below one"):
        read_video(video_40, nframes=2, max_pixels=100)


def test_budget_size_hand_cases():
    assert budget_size(48, 64) == (48, 64)  # no budget: unchanged
    assert budget_size(48, 64, max_pixels=3136) == (56, 56)  # rounded to 28, within budget
    assert budget_size(50, 100, max_pixels=4000) == (28, 84)  # beta = sqrt(5000/4000): floor(1.6), floor(3.2)
    # 30 x 40 rounds to 28 x 28 = 784 < min 3136 (the default minimum, capped at the maximum): upscaled by
    # sqrt(3136 / 1200) = 1.617 and ceiled, 56 x 84 = 4704, past the maximum, as qwen-vl-utils and transformers do
    assert budget_size(30, 40, max_pixels=3136) == (56, 84)
    # an explicit minimum upscales: 48 x 64 to at least 112 x 112 pixels, sides ceiled to 28
    assert budget_size(48, 64, min_pixels=112 * 112) == (112, 140)
    with pytest.raises(ValueError, match="above max_pixels"):
        budget_size(48, 64, min_pixels=5000, max_pixels=4000)


def test_smart_resize_is_qwen_vl_utils_rule_worked_by_hand():
    """qwen-vl-utils' smart_resize (0.0.8-0.0.14): sides rounded to the factor but at least one factor; above the
    maximum scaled by sqrt(HW / max) and floored; below the minimum scaled by sqrt(min / HW) and ceiled."""
    # 2 x 387: 2 rounds to 0, kept at 28; 387 rounds to 392; 28 x 392 = 10976 is within [3136, 12845056]
    # (transformers' smart_resize rounds the 2 to 0 and upscales: 28 x 784)
    assert smart_resize(2, 387, factor=28, min_pixels=3136, max_pixels=12845056) == (28, 392)
    # 640 x 480 at min = max = 200704: 644 x 476 > max, beta = sqrt(307200 / 200704) = 1.2372,
    # floor(517.3 / 28) = 18 -> 504, floor(388.0 / 28) = 13 -> 364; below the minimum, left so (one branch)
    assert smart_resize(640, 480, factor=28, min_pixels=200704, max_pixels=200704) == (504, 364)
    # 1225 x 17 at [39645, 40382]: 1232 x 28 = 34496 < min, beta = sqrt(39645 / 20825) = 1.3798,
    # ceil(1690.2 / 28) = 61 -> 1708, ceil(23.46 / 28) = 1 -> 28
    assert smart_resize(1225, 17, factor=28, min_pixels=39645, max_pixels=40382) == (1708, 28)
    # 20 x 3000 at max 10240, factor 32: 32 x 3008 > max, beta = sqrt(60000 / 10240) = 2.4206, floor(0.26) = 0
    # kept at one factor (qwen-vl-utils would resize to a side of 0 and fail), floor(38.73) = 38 -> 1216
    assert smart_resize(20, 3000, factor=32, min_pixels=1024, max_pixels=32 * 32 * 10) == (32, 1216)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2010, factor=28, min_pixels=3136, max_pixels=12845056)


def test_pixel_budget_on_a_larger_video(tmp_path):
    path = write_video(tmp_path / "big.mp4", num_frames=8, width=320, height=180, fps=8)
    budget = 100 * 28 * 28 // 4
    clip = read_video(path, nframes=4, max_pixels=budget)
    h, w = clip.frames.shape[-2:]
    assert h % 28 == 0 and w % 28 == 0 and h * w <= budget
    assert w > h  # aspect kept (landscape stays landscape)
    assert [nearest_frame(f, 8) for f in clip.frames] == clip.indices


def test_missing_video_names_the_file(tmp_path):
    with pytest.raises(DataError, match="video not found: .*nowhere.mp4"):
        read_video(tmp_path / "nowhere.mp4")


@pytest.mark.parametrize("faststart", [False, True])
def test_truncated_video_names_the_file(tmp_path, faststart):
    path = write_video(tmp_path / "cut.mp4", num_frames=40, faststart=faststart)
    truncate_file(path, fraction=0.6)
    with pytest.raises(DataError, match="cut.mp4") as info:
        read_video(path, nframes=40)
    assert "video" in str(info.value)


def test_garbage_and_one_frame_videos(tmp_path):
    with pytest.raises(DataError, match="cannot read video .*junk.mp4"):
        read_video(write_garbage(tmp_path / "junk.mp4"))
    one = write_video(tmp_path / "one.mp4", num_frames=1)
    with pytest.raises(DataError, match=r"one.mp4: the video has 1 frame; Qwen-VL video input needs at least 2"):
        read_video(one)


# ------------------------------------------------------------------------------------------- probing


def test_probe_video_reads_metadata_and_the_first_frame(video_40, monkeypatch):
    import decord

    decoded = []
    real = decord.VideoReader.__getitem__
    monkeypatch.setattr(decord.VideoReader, "__getitem__", lambda self, i: decoded.append(i) or real(self, i))
    info = probe_video(video_40)
    assert (info.total_frames, info.video_fps, info.width, info.height) == (40, 10.0, 64, 48)
    assert info.duration == 4.0 and info.path == str(video_40)
    assert decoded == [0]  # one frame, not the video


def test_probe_video_errors_name_the_file(tmp_path):
    with pytest.raises(DataError) as info:
        probe_video(tmp_path / "nowhere.mp4")
    assert str(info.value) == f"video not found: {tmp_path / 'nowhere.mp4'}"
    junk = write_garbage(tmp_path / "junk.mp4")
    with pytest.raises(DataError) as info:
        probe_video(junk)
    assert str(info.value).startswith(f"cannot read video {junk}: ")
    cut = truncate_file(write_video(tmp_path / "cut.mp4", num_frames=40), fraction=0.6)
    with pytest.raises(DataError) as info:
        probe_video(cut)
    assert str(info.value) == f"cannot read video {cut}: ffmpeg cannot open it (truncated, or not a video file)"
    one = write_video(tmp_path / "one.mp4", num_frames=1)
    with pytest.raises(DataError) as info:
        probe_video(one)
    assert str(info.value) == f"video {one} has 1 frame(s): at least 2 are needed"


@pytest.mark.parametrize("raw, expected", [
    ("[09:51:26] /github/workspace/src/video/ffmpeg/threaded_decoder.cc:292: [09:51:26] /github/workspace/src/video/"
     "ffmpeg/threaded_decoder.cc:218: Check failed: avcodec_send_packet(dec_ctx_.get(), pkt.get()) >= 0 "
     "(-1094995529 vs. 0) Thread worker: Error sending packet.", "Thread worker: Error sending packet."),
    ("[09:51:26] /github/workspace/src/video/video_reader.cc:151: Check failed: st_nb >= 0 (-1381258232 vs. 0) "
     "ERROR cannot find video stream with wanted index: -1", "ERROR cannot find video stream with wanted index: -1"),
    ('[09:51:26] /github/workspace/src/video/ffmpeg/filter_graph.cc:61: Check failed: avfilter_graph_create_filter('
     '&buffersrc_ctx_, buffersrc, "in", args, __null, filter_graph_.get()) >= 0 (-22 vs. 0) Cannot create buffer '
     'source', "Cannot create buffer source"),
    ("[09:51:26] /github/workspace/src/video/video_reader.cc:486: Error: av_read_frame failed with 1094995529",
     "Error: av_read_frame failed with 1094995529 (invalid data found when processing input)"),
    ("Error reading /data/v/cut.mp4...", "ffmpeg cannot open it (truncated, or not a video file)"),
    ("first line\nStack trace:\n  [bt] (0) libdecord.so", "first line"),
    ("", "RuntimeError"),
])
def test_decord_reasons_read_cleanly(raw, expected):
    assert _reason(RuntimeError(raw)) == expected


def test_frame_pixel_budget_hand_cases():
    from mmrl.data.video import frame_pixel_budget

    # Time-R1 (train_rl.sh): min 16 x 28 x 28, total 3584 x 28 x 28; 60 frames: 2809856 / 60 * 2 = 93661.87
    low, high = frame_pixel_budget(60, min_pixels=12544, frame_max_pixels=602112, total_pixels=2809856)
    assert low == 12544 and high == pytest.approx(2809856 / 60 * 2, rel=1e-15)
    # 768 frames: 7317.3 is below the floor int(12544 * 1.05) = 13171
    assert frame_pixel_budget(768, min_pixels=12544, frame_max_pixels=602112, total_pixels=2809856)[1] == 13171
    # qwen-vl-utils' default total 128000 x 784 x 0.9: 400 frames -> 451584, 4 frames -> the cap 602112
    total = 128000 * 28 * 28 * 0.9
    assert frame_pixel_budget(400, min_pixels=100352, frame_max_pixels=602112, total_pixels=total)[1] == 451584
    assert frame_pixel_budget(4, min_pixels=100352, frame_max_pixels=602112, total_pixels=total)[1] == 602112
    # an explicit max_pixels comes last, below the floor too
    assert frame_pixel_budget(60, min_pixels=12544, frame_max_pixels=602112, total_pixels=2809856,
                              max_pixels=10000)[1] == 10000
    with pytest.raises(ValueError, match="num_frames"):
        frame_pixel_budget(0, min_pixels=1, frame_max_pixels=1, total_pixels=1)


def test_read_video_with_a_total_budget(tmp_path):
    # a 180 x 320 clip, 4 frames sampled; total 12544 -> max(min(602112, 12544 / 4 * 2), int(3136 * 1.05)) = 6272:
    # beta = sqrt(57600 / 6272) = 3.030, floor(180 / 3.030 / 28) = 2, floor(320 / 3.030 / 28) = 3 -> 56 x 84
    path = write_video(tmp_path / "wide.mp4", num_frames=8, width=320, height=180, fps=8)
    clip = read_video(path, nframes=4, min_pixels=3136, frame_max_pixels=602112, total_pixels=12544)
    assert clip.frames.shape == (4, 3, 56, 84) and clip.final_size
    assert [nearest_frame(f, 8) for f in clip.frames] == clip.indices
    # Time-R1's budget on a 360 x 640 Charades-like clip at 60 frames would be 224 x 392 (87808 < 128 x 28 x 28, the
    # processor's own floor, which is why the processor must not resize again); a per-frame budget alone is not final
    assert not read_video(path, nframes=4, max_pixels=3136).final_size
    with pytest.raises(ValueError, match="needs min_pixels"):
        read_video(path, nframes=4, total_pixels=12544)


def test_a_video_too_narrow_for_decord_or_too_wide_to_resize_is_one_error_naming_the_file(tmp_path):
    """decord decodes a clip 8 px wide into frames 64 x 8 x 9 (not h x w x 3): it read as "corrupt or truncated" at
    the first rollout and passed the probe. An aspect ratio over 200 passed the probe and, under a max_pixels-only
    budget (Qwen3-VL's path), was a bare ValueError naming no file."""
    narrow = write_video(tmp_path / "narrow.mp4", num_frames=8, width=8, height=64)
    for read in (probe_video, lambda p: read_video(p, nframes=4, max_pixels=64 * 28 * 28)):
        with pytest.raises(DataError, match=f"video {narrow} decodes to frames of shape .* this narrow"):
            read(narrow)
    wide = write_video(tmp_path / "wide.mp4", num_frames=8, width=812, height=4)
    with pytest.raises(DataError, match=f"video {wide} \\(812x4\\): absolute aspect ratio must be smaller than 200"):
        probe_video(wide)
    with pytest.raises(DataError, match=f"video {wide}: absolute aspect ratio must be smaller than 200"):
        read_video(wide, nframes=4, max_pixels=64 * 28 * 28)
