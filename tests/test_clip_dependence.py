"""benchmarks/clip_dependence.py: the clip replacements it scores a video model under (README, ShapeWorld)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("clip_dependence", ROOT / "benchmarks" / "clip_dependence.py")
clip_dependence = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(clip_dependence)


def test_replacements_move_whole_slots_and_clips():
    grids = torch.tensor([[3, 2, 2], [3, 2, 2], [2, 2, 2]])
    rows = [torch.arange(t * h * w * 2, dtype=torch.float32).view(t * h * w, 2) + 100 * i
            for i, (t, h, w) in enumerate(grids.tolist())]
    pixels = torch.cat(rows)
    same, kept = clip_dependence.replaced(pixels, grids, "clip")
    assert torch.equal(same, pixels) and kept == []
    rev, _ = clip_dependence.replaced(pixels, grids, "reversed")
    first = rev[:12].view(3, 4, 2)
    assert torch.equal(first[0], rows[0][8:12]) and torch.equal(first[2], rows[0][:4])  # slots reversed, rows kept
    still, _ = clip_dependence.replaced(pixels, grids, "first_slot")
    assert torch.equal(still[12:24].view(3, 4, 2), rows[1][:4].expand(3, 4, 2))
    other, kept = clip_dependence.replaced(pixels, grids, "other_clip")
    assert torch.equal(other[:12], rows[1]) and torch.equal(other[12:24], rows[0])  # the two 3-slot clips swap
    assert kept == [2] and torch.equal(other[24:], rows[2])  # no other 2-slot clip: its own pixels, counted
    with pytest.raises(ValueError, match="unknown variant"):
        clip_dependence.replaced(pixels, grids, "shuffled")


def test_clip_dependence_on_a_tiny_model(tmp_path, monkeypatch):
    """A random tiny Qwen2.5-VL on ShapeWorld clips: every replacement is scored and finite, zero pixels change the
    loss (the probe reaches the model), and a still clip (every frame the same) loses nothing when reversed."""
    import yaml

    from mmrl.data.shapeworld import Obj, Scene, write_video, write_vlm_dataset

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = write_vlm_dataset(tmp_path / "data", "heldout", 3, tasks=("temporal_grounding",))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    still = dict(lines[0], id="still", video="heldout/videos/still.mp4")
    write_video(tmp_path / "data" / still["video"], [Scene((Obj("circle", "red", (20, 20, 60, 60)),), 112)] * 24)
    path.write_text("\n".join(json.dumps(x) for x in [still, *lines]) + "\n")
    config = yaml.safe_load((ROOT / "configs" / "shapes" / "vlm_video_tg_grpo.yaml").read_text())
    config["model"]["pretrained"] = "tiny:qwen2_5_vl"
    config["data"]["dataset"] = str(path)
    config["output_dir"] = str(tmp_path / "run")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    torch.manual_seed(0)
    report = clip_dependence.clip_dependence(str(tmp_path / "config.yaml"), str(path), limit=4, batch_size=4)
    loss = report["loss"]
    assert report["lines"] == 4 and report["other_clip_left_out"] == 0
    assert set(loss) == set(clip_dependence.VARIANTS) and all(torch.isfinite(torch.tensor(v)) for v in loss.values())
    assert abs(loss["zero"] - loss["clip"]) > 1e-4
    one_by_one = clip_dependence.clip_dependence(str(tmp_path / "config.yaml"), str(path), limit=4, batch_size=1)
    for variant in ("clip", "reversed", "first_slot", "zero"):  # the batch layout changes no line's loss
        assert one_by_one["loss"][variant] == pytest.approx(loss[variant], rel=1e-4), variant
    assert one_by_one["other_clip_left_out"] == 4  # alone in its batch, no line has another clip to show
    alone = clip_dependence.clip_dependence(str(tmp_path / "config.yaml"), str(path), limit=1, batch_size=1)["loss"]
    assert alone["reversed"] == pytest.approx(alone["clip"], abs=1e-6)  # a still clip reversed is the same clip
    assert alone["other_clip"] is None  # one line: no other clip to show it
    assert alone["zero"] != pytest.approx(alone["clip"], abs=1e-4)
