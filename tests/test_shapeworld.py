"""ShapeWorld (GitHub issue 11): the deterministic renderer, the GenEval-format prompt sets and their held-out split,
the weightless evaluator (right on >= 99 % of thousands of rendered ground-truth scenes of all six categories, 0 on
hand-made wrong ones, robust to blur and noise), the ``shapeworld`` reward's strict / partial scores, the VLM data
(PNG images, mp4 videos read back with decord, temporal ground truth checked frame by frame, SFT targets that the
rewards score 1) and ``mmrl eval ... benchmarks=[shapeworld@heldout]`` end to end on the tiny SD3."""
from __future__ import annotations

import hashlib
import io
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from fixtures import TINY_RECIPE, one_error, tiny_flow_config
from mmrl.data import shapeworld as sw
from mmrl.data.shapeworld import COLORS, SHAPES, TAGS, Obj, Scene, prompt_set, render, scene_for
from mmrl.rewards import build_reward
from mmrl.rewards.geneval import check_geneval_metadata
from mmrl.rewards.shapeworld import classify, detect, score_image

META = {p: m for split in sw.SPLITS for p, m in prompt_set(split)}


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def meta(prompt: str) -> dict:
    return META[prompt]


def as_tensor(*scenes: Scene) -> torch.Tensor:
    return torch.stack([torch.from_numpy(sw.render_array(s)).permute(2, 0, 1).float() / 255 for s in scenes])


# ---------------------------------------------------------------------------------------------- renderer


def test_renderer_is_deterministic_and_shapes_fill_their_boxes():
    m = meta("a photo of a red circle and a blue square")
    a, b = scene_for(m, np.random.default_rng(7)), scene_for(m, np.random.default_rng(7))
    assert a == b and png_bytes(render(a)) == png_bytes(render(b))
    assert render(a).mode == "RGB" and render(a).size == (32, 32)
    assert scene_for(m, np.random.default_rng(8)) != a
    # each shape's pixels reach exactly to its box, in its colour, on the plain background
    for shape in SHAPES:
        scene = Scene((Obj(shape, "green", (3, 5, 15, 17)),))
        pixels = sw.render_array(scene)
        ys, xs = np.nonzero((pixels != sw.BACKGROUND).any(-1))
        assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == (3, 5, 15, 17)
        assert {tuple(p) for p in pixels.reshape(-1, 3)} == {sw.BACKGROUND, COLORS["green"]}
    fills = {s: sw.shape_mask(s, 40, 40).mean() for s in SHAPES}
    assert fills["square"] == 1 and abs(fills["circle"] - np.pi / 4) < 0.01 and abs(fills["triangle"] - 0.5) < 0.03
    with pytest.raises(ValueError, match="unknown shape 'star'"):
        Obj("star", "red", (0, 0, 4, 4))
    with pytest.raises(ValueError, match="leaves the 32x32 image"):
        Scene((Obj("circle", "red", (20, 20, 40, 40)),))


# ---------------------------------------------------------------------------------------------- prompts


def test_prompt_sets_counts_split_and_metadata(tmp_path):
    from mmrl.data.prompts import read_prompts

    train, held = prompt_set("train"), prompt_set("heldout")
    assert Counter(m["tag"] for _, m in train) == {"single_object": 2, "two_object": 3, "counting": 6, "colors": 12,
                                                  "position": 16, "color_attr": 84}
    assert Counter(m["tag"] for _, m in held) == {"single_object": 1, "two_object": 3, "counting": 3, "colors": 6,
                                                 "position": 8, "color_attr": 96}
    assert not {p for p, _ in train} & {p for p, _ in held}
    assert [m["tag"] for _, m in held[:6]] == list(TAGS) == [m["tag"] for _, m in train[:6]]  # round robin
    for prompt, m in train + held:
        assert check_geneval_metadata(m) is None and m["prompt"] == prompt
        assert list(m) == (["tag", "include", "exclude", "prompt"] if m["tag"] == "counting" else
                           ["tag", "include", "prompt"])
    # held-out colour prompts name a held-out colour-shape pairing; training ones never do
    for split, items in (("train", train), ("heldout", held)):
        for _, m in items:
            if m["tag"] in ("colors", "color_attr"):
                pairs = {(c["class"], c["color"]) for c in m["include"]}
                assert bool(pairs & sw.HELDOUT_PAIRINGS) == (split == "heldout")
    assert meta("a photo of three triangles")["include"] == [{"class": "triangle", "count": 3}]
    assert meta("a photo of three triangles")["exclude"] == [{"class": "triangle", "count": 4}]
    assert meta("a photo of a circle left of a square")["include"] == [
        {"class": "square", "count": 1}, {"class": "circle", "count": 1, "position": ["left of", 0]}]
    path = sw.write_prompts(tmp_path / "train.jsonl", "train")
    read = read_prompts(path)
    assert [(p.prompt, {**p.metadata, "prompt": p.prompt}) for p in read] == train
    # training scenes never show a held-out pairing, even for prompts that name no colour
    rng = np.random.default_rng(0)
    shown = {(o.shape, o.color) for _, m in train for _ in range(3) for o in scene_for(m, rng, split="train").objects}
    assert not shown & sw.HELDOUT_PAIRINGS and len(shown) == 12
    shown = {(o.shape, o.color) for _, m in held for o in scene_for(m, rng, split="heldout").objects}
    assert sw.HELDOUT_PAIRINGS <= shown
    # the test split holds out seeds, not prompts: the training prompts, their scenes never a held-out pairing
    assert prompt_set("test") == train
    shown = {(o.shape, o.color) for _, m in train for o in scene_for(m, rng, split="test").objects}
    assert not shown & sw.HELDOUT_PAIRINGS
    with pytest.raises(ValueError, match="unknown ShapeWorld split 'val'"):
        prompt_set("val")
    with pytest.raises(ValueError, match="not a ShapeWorld shape"):
        scene_for({"tag": "single_object", "include": [{"class": "dog", "count": 1}]}, 0)
    with pytest.raises(ValueError, match="forbids"):
        scene_for({"include": [{"class": "circle", "count": 2}], "exclude": [{"class": "circle", "count": 2}]}, 0)


# ---------------------------------------------------------------------------------------------- the evaluator


def test_evaluator_is_right_on_rendered_ground_truth():
    """>= 2000 ground-truth scenes from scene_for, every prompt of both splits, all six tags, at 32 and 64 px."""
    rng = np.random.default_rng(2024)
    prompts = prompt_set("train") + prompt_set("heldout")
    by_tag = {t: [m for _, m in prompts if m["tag"] == t] for t in TAGS}
    right, total = Counter(), Counter()
    for i in range(2100):
        tag = TAGS[i % 6]
        m = by_tag[tag][(i // 6) % len(by_tag[tag])]
        scene = scene_for(m, rng, 32 if i % 3 else 64)
        result, _ = score_image(render(scene), m)
        right[tag] += result.correct
        total[tag] += 1
    accuracy = sum(right.values()) / sum(total.values())
    per_tag = {t: right[t] / total[t] for t in TAGS}
    print(f"\nShapeWorld evaluator on {sum(total.values())} rendered ground-truth scenes: {accuracy:.2%} "
          f"strict-correct; per tag {per_tag}")
    assert accuracy >= 0.99 and min(per_tag.values()) >= 0.98


def test_evaluator_tolerates_blur_and_noise():
    """A generator's images are not exact: blurred edges (Gaussian 0.6 px) and pixel noise (sigma 8)."""
    rng = np.random.default_rng(5)
    prompts = prompt_set("heldout")
    right = 0
    for i in range(300):
        m = prompts[i % len(prompts)][1]
        pixels = np.asarray(render(scene_for(m, rng)).filter(ImageFilter.GaussianBlur(0.6)), dtype=np.float64)
        noisy = np.clip(pixels + rng.normal(0, 8, pixels.shape), 0, 255).round().astype(np.uint8)
        right += score_image(Image.fromarray(noisy), m)[0].correct
    print(f"\nShapeWorld evaluator on 300 blurred + noisy scenes: {right / 300:.2%}")
    assert right / 300 >= 0.95


def test_detections_are_exact_on_a_rendered_scene_and_the_score_means_clarity():
    scene = Scene((Obj("circle", "red", (1, 1, 11, 11)), Obj("square", "white", (14, 2, 24, 12)),
                   Obj("triangle", "purple", (4, 18, 16, 30))))
    dets = detect(render(scene))
    assert sorted((d.label, d.color, d.box, d.score) for d in dets) == sorted(
        (o.shape, o.color, tuple(float(v) for v in o.box), 1.0) for o in scene.objects)
    assert all(d.mask.sum() == sw.shape_mask(d.label, 10 if d.label != "triangle" else 12,
                                             10 if d.label != "triangle" else 12).sum() for d in dets)
    # the confidence: 1 for an exact shape, low for one halfway between two, 0 for a 2:1 bar or nothing clear
    octagon = np.ones((12, 12), bool)
    for y in range(12):
        for x in range(12):
            octagon[y, x] = min(x, 11 - x) + min(y, 11 - y) >= 3
    label, score, _ = classify(octagon)
    assert label == "circle" and 0.3 < score < 0.9  # counts as a circle, but not for counting prompts
    assert classify(np.ones((6, 12), bool))[1] == 0.0
    assert classify(sw.shape_mask("triangle", 12, 12)[::-1])[1] < 0.3  # upside down: no shape
    assert detect(Image.new("RGB", (32, 32), sw.BACKGROUND)) == []
    assert detect(Image.new("RGB", (32, 32), (255, 128, 0))) == []  # orange is no ShapeWorld colour


WRONG = [  # (prompt, a scene that satisfies it, scenes that do not: wrong colour, count, position, shape, binding)
    ("a photo of a square", [("square", "blue", (10, 10, 22, 22))],
     [[("circle", "blue", (10, 10, 22, 22))], [("triangle", "blue", (10, 10, 22, 22))], []]),
    ("a photo of a circle and a triangle", [("circle", "red", (2, 2, 12, 12)), ("triangle", "green", (16, 16, 28, 28))],
     [[("circle", "red", (2, 2, 12, 12)), ("square", "green", (16, 16, 28, 28))],
      [("triangle", "red", (2, 2, 12, 12)), ("triangle", "green", (16, 16, 28, 28))]]),
    ("a photo of three triangles", [("triangle", "red", (1, 1, 10, 10)), ("triangle", "red", (14, 1, 23, 10)),
                                    ("triangle", "blue", (1, 14, 10, 23))],
     [[("triangle", "red", (1, 1, 10, 10)), ("triangle", "red", (14, 1, 23, 10))],
      [("triangle", "red", (1, 1, 10, 10)), ("triangle", "red", (14, 1, 23, 10)), ("triangle", "blue", (1, 14, 10, 23)),
       ("triangle", "white", (14, 14, 23, 23))],
      [("square", "red", (1, 1, 10, 10)), ("square", "red", (14, 1, 23, 10)), ("square", "blue", (1, 14, 10, 23))]]),
    ("a photo of a yellow circle", [("circle", "yellow", (8, 8, 20, 20))],
     [[("circle", "red", (8, 8, 20, 20))], [("square", "yellow", (8, 8, 20, 20))]]),
    ("a photo of a circle left of a square",
     [("circle", "white", (2, 10, 12, 20)), ("square", "red", (20, 10, 30, 20))],
     [[("circle", "white", (20, 10, 30, 20)), ("square", "red", (2, 10, 12, 20))],
      [("circle", "white", (10, 2, 20, 12)), ("square", "red", (10, 18, 20, 28))],
      [("triangle", "white", (2, 10, 12, 20)), ("square", "red", (20, 10, 30, 20))]]),
    ("a photo of a red circle and a blue square",
     [("circle", "red", (2, 2, 13, 13)), ("square", "blue", (18, 18, 29, 29))],
     [[("circle", "blue", (2, 2, 13, 13)), ("square", "red", (18, 18, 29, 29))],
      [("circle", "red", (2, 2, 13, 13)), ("square", "green", (18, 18, 29, 29))],
      [("circle", "red", (2, 2, 13, 13)), ("circle", "blue", (18, 18, 29, 29))]]),
]


@pytest.mark.parametrize("prompt,good,bad", WRONG, ids=[w[0] for w in WRONG])
def test_wrong_scenes_score_zero(prompt, good, bad):
    m = meta(prompt)
    assert score_image(render(Scene(tuple(Obj(*o) for o in good))), m)[0].correct
    for objects in bad:
        result, _ = score_image(render(Scene(tuple(Obj(*o) for o in objects))), m)
        assert not result.correct, (prompt, objects)


# ---------------------------------------------------------------------------------------------- the reward


def test_reward_strict_and_partial_hand_worked():
    three = meta("a photo of three circles")
    circles = [Obj("circle", "red", b) for b in [(1, 1, 10, 10), (14, 1, 23, 10), (1, 14, 10, 23), (14, 14, 23, 23)]]
    binding = meta("a photo of a red circle and a blue square")
    left = meta("a photo of a circle left of a square")
    cases = [  # (scene, metadata, strict, partial)
        (Scene(tuple(circles[:3])), three, 1.0, 1.0),
        (Scene(tuple(circles[:2])), three, 0.0, 0.5),  # include (>= 3) fails, exclude (< 4) holds
        (Scene(tuple(circles)), three, 0.0, 0.5),  # include holds, exclude fails
        (Scene((Obj("circle", "red", (2, 2, 13, 13)), Obj("square", "green", (18, 18, 29, 29)))), binding, 0.0, 0.5),
        (Scene((Obj("circle", "blue", (2, 2, 13, 13)), Obj("square", "red", (18, 18, 29, 29)))), binding, 0.0, 0.0),
        (Scene((Obj("circle", "white", (20, 10, 30, 20)), Obj("square", "red", (2, 10, 12, 20)))), left, 0.0, 0.5),
        (Scene(()), left, 0.0, 0.0),
    ]
    strict, partial = build_reward("shapeworld"), build_reward("shapeworld_partial")
    images = as_tensor(*[c[0] for c in cases])
    metas = [c[1] for c in cases]
    out, out_p = strict(images, None, metas), partial([render(c[0]) for c in cases], None, metas)
    assert out["shapeworld"].tolist() == [c[2] for c in cases] == out["strict"].tolist()
    assert out["partial"].tolist() == [c[3] for c in cases] == out_p["shapeworld_partial"].tolist()
    assert strict.last_details[1]["detected"] == {"circle": 2} and strict.last_info["num_nan"] == 0
    # soft: top-n confidences per include clause (all 1 on exact renders), halved when misplaced; exclude as GenEval
    soft = build_reward("shapeworld_soft")([render(c[0]) for c in cases], None, metas)
    assert soft["shapeworld_soft"].tolist() == pytest.approx([1.0, 5 / 6, 0.5, 0.5, 0.0, 0.75, 0.0])
    assert soft["soft"].tolist() == out["soft"].tolist() == soft["shapeworld_soft"].tolist()
    # a blob between two shapes earns part of the credit where strict and partial give none
    blob = np.asarray(render(Scene((Obj("circle", "red", (8, 8, 22, 22)),))).filter(ImageFilter.GaussianBlur(2.5)))
    single = meta("a photo of a circle")
    graded = build_reward("shapeworld_soft")([Image.fromarray(blob)], None, [single])
    assert 0.0 < graded["shapeworld_soft"].item() < 1.0
    # metadata no ShapeWorld image can satisfy is the data's fault: NaN with the reason
    bad = [{"tag": "single_object", "include": [{"class": "dog", "count": 1}]},
           {"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "pink"}]}, {"include": []}]
    out = strict(as_tensor(*[cases[0][0]] * 3), None, bad)
    assert torch.isnan(out["shapeworld"]).all()
    reasons = strict.last_info["nan_samples"]
    assert "not a ShapeWorld shape" in reasons[0] and "not a ShapeWorld colour" in reasons[1] and 2 in reasons
    with pytest.raises(ValueError, match="variant must be"):
        build_reward("shapeworld", variant="loose")


# ---------------------------------------------------------------------------------------------- VLM data


def _event_frames(frames: np.ndarray, event: dict) -> set[int]:
    """The frames in which the event is visible, read off the decoded frames with the evaluator."""
    seen, previous = set(), None
    for f, frame in enumerate(frames):
        dets = [d for d in detect(frame) if d.label == event["shape"]]
        if event["kind"] == "visible":
            if any(d.color == event["color"] for d in dets):
                seen.add(f)
        elif event["kind"] == "color":
            assert len(dets) == 1, (f, dets)
            if dets[0].color == event["color_during"]:
                seen.add(f)
        else:
            box = [d.box for d in dets if d.color == event["color"]]
            assert len(box) == 1, (f, dets)
            if previous is not None and box[0] != previous:
                seen.add(f)
            previous = box[0]
    return seen


def test_videos_decode_and_temporal_ground_truth_matches_the_frames(tmp_path):
    import decord

    path = sw.write_vlm_dataset(tmp_path, "heldout", 10, seed=0, tasks=("temporal_grounding",))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert {line["event"]["kind"] for line in lines} == {"visible", "move", "color"}
    for line in lines:
        reader = decord.VideoReader(str(tmp_path / line["video"]))
        assert len(reader) == sw.VIDEO_FRAMES and reader.get_avg_fps() == sw.VIDEO_FPS
        frames = reader.get_batch(list(range(len(reader)))).asnumpy()
        assert frames.shape == (sw.VIDEO_FRAMES, sw.VLM_IMAGE_SIZE, sw.VLM_IMAGE_SIZE, 3)
        start, end = line["timestamps"]
        expected = {f for f in range(len(reader)) if start <= f / sw.VIDEO_FPS < end}
        assert _event_frames(frames, line["event"]) == expected, line
        assert line["duration"] == sw.VIDEO_FRAMES / sw.VIDEO_FPS and json.loads(line["solution"]) == [start, end]


def test_vlm_dataset_reads_and_its_sft_targets_score_full_marks(tmp_path):
    from mmrl.data.vlm import load_images, read_vlm_jsonl
    from mmrl.rewards import think_answer_format

    rewards = {"grounding": build_reward("iou"), "numeric": build_reward("numeric_accuracy"),
               "temporal_grounding": build_reward("temporal_iou")}
    for split in sw.SPLITS:
        path = sw.write_vlm_dataset(tmp_path, split, 9, seed=3)
        samples = read_vlm_jsonl(path)  # every image verified, every video probed
        assert len(samples) == 9 and samples.skipped == 0
        assert Counter(s.task for s in samples) == {"grounding": 3, "numeric": 3, "temporal_grounding": 3}
        for sample in samples:
            target = sample.metadata["sft_target"]
            assert think_answer_format(target) == 1.0
            if sample.image_paths:
                load_images(sample)  # image_size / input_size, as training records them
            reward = rewards[sample.task]
            assert reward([target], None, [sample.metadata])[reward.name].item() == 1.0, sample
            if sample.task == "grounding":
                pairing = tuple(sample.metadata["target"].split()[::-1])
                assert (pairing in sw.HELDOUT_PAIRINGS) == (split == "heldout")
            if split != "heldout" and "objects" in sample.metadata:  # no held-out pairing in train / test data
                assert not {(o["shape"], o["color"]) for o in sample.metadata["objects"]} & sw.HELDOUT_PAIRINGS
                assert sample.metadata["image_size"] == sample.metadata["input_size"] == [112, 112]
    # test lines are new scenes of the training world: none of them is a training line of the same seed
    media = {split: {f.read_bytes() for f in (tmp_path / split).rglob("*.*")} for split in ("train", "test")}
    assert len(media["test"]) == 9 and not media["train"] & media["test"]
    # the same arguments write the same files
    again = sw.write_vlm_dataset(tmp_path / "again", "train", 9, seed=3)
    assert again.read_text() == (tmp_path / "train.jsonl").read_text()
    assert (again.parent / "train/images/00000.png").read_bytes() == (tmp_path / "train/images/00000.png").read_bytes()
    # Qwen2-VL / Qwen3-VL targets: 0-1000 normalised
    path = sw.write_vlm_dataset(tmp_path / "q2", "train", 2, seed=0, tasks=("grounding",), coord_format="qwen2")
    for sample in read_vlm_jsonl(path):
        load_images(sample)
        assert rewards["grounding"]([sample.metadata["sft_target"]], None, [sample.metadata])["iou"].item() > 0.9
    with pytest.raises(ValueError, match="coord_format 'pixels'"):
        sw.write_vlm_dataset(tmp_path, "train", 1, coord_format="pixels")


def test_grounding_crop_lines_are_tool_traces_that_crop_around_the_target(tmp_path):
    """grounding_crop: grounding's questions and boxes, the target a trace whose crop holds the whole box (crop_recall
    1 in the answers' frame) inside the think block, the answer scoring IoU 1; the crop tool cuts that region."""
    from mmrl.data.vlm import load_images, read_vlm_jsonl
    from mmrl.pipelines.vlm.tools import answer_frame, calls_in, resolve_tools, run_call
    from mmrl.rewards import think_answer_format

    assert sw.check_vlm_spec("shapeworld:train:8:grounding_crop") is None
    for fmt in ("qwen25", "qwen2"):
        path = sw.write_vlm_dataset(tmp_path / fmt, "heldout", 6, seed=1, tasks=("grounding_crop",), coord_format=fmt)
        plain = sw.write_vlm_dataset(tmp_path / f"{fmt}-plain", "heldout", 6, seed=1, tasks=("grounding",),
                                     coord_format=fmt)
        first_plain = read_vlm_jsonl(plain)[0].metadata
        for k, sample in enumerate(read_vlm_jsonl(path)):
            images = load_images(sample)
            meta, target = sample.metadata, sample.metadata["sft_target"]
            assert sample.task == "grounding" and meta["tool"] == "crop" and think_answer_format(target) == 1.0
            (start, end, inside), = calls_in(target)
            assert target.index("<think>") < start < end < target.index("</think>")
            box, crop = meta["boxes"][0], meta["crop"]
            assert crop[0] < box[0] or crop[0] == 0
            assert crop[0] <= box[0] and crop[1] <= box[1] and crop[2] >= box[2] and crop[3] >= box[3]
            exact = 1.0 if fmt == "qwen25" else pytest.approx(1.0, abs=0.03)  # 0-1000 rounds the pixels
            assert build_reward("iou")([target], None, [meta])["iou"].item() == exact
            assert build_reward("crop_recall")([target], None, [meta])["crop_recall"].item() == exact
            view = run_call(inside, resolve_tools(["crop"]), images[0], answer_frame(meta, None))
            width, height = crop[2] - crop[0], crop[3] - crop[1]
            assert abs(view.size[0] - width) <= 2 and abs(view.size[1] - height) <= 2  # 0-1000 rounding
            if k == 0:  # the same scene and question as the grounding line
                assert meta["target"] == first_plain["target"] and meta["boxes"] == first_plain["boxes"]
    with pytest.raises(ValueError, match="unknown task"):
        sw.write_vlm_dataset(tmp_path, "train", 1, tasks=("cropping",))


def test_grounding_loose_lines_teach_boxes_too_large_by_the_fraction_and_score_against_the_exact_box(tmp_path):
    """grounding_loose: grounding's scenes, questions and exact solution; the taught box is each side moved out by
    LOOSE_BOX_FRACTION of the box's side (clamped to the image), so its IoU with the object is 1 / (1 + 2f)^2 away from
    the edges, which is what the IoU reward scores the SFT target."""
    from mmrl.data.vlm import load_images, read_vlm_jsonl
    from mmrl.rewards import think_answer_format

    assert sw.check_vlm_spec("shapeworld:heldout:8:grounding_loose") is None
    f = sw.LOOSE_BOX_FRACTION
    path = sw.write_vlm_dataset(tmp_path / "loose", "heldout", 12, seed=2, tasks=("grounding_loose",),
                                coord_format="qwen25")
    plain = read_vlm_jsonl(sw.write_vlm_dataset(tmp_path / "plain", "heldout", 12, seed=2, tasks=("grounding",),
                                                coord_format="qwen25"))
    interior = 0
    for sample, exact in zip(read_vlm_jsonl(path), plain):
        load_images(sample)  # the image size the boxes' coordinates refer to
        meta, target = sample.metadata, sample.metadata["sft_target"]
        assert sample.task == "grounding" and think_answer_format(target) == 1.0
        assert meta["boxes"] == exact.metadata["boxes"] and meta["solution"] == exact.metadata["solution"]
        box, loose = meta["boxes"][0], meta["loose_box"]
        side = box[2] - box[0]
        expected = [max(0, round(box[0] - f * side)), max(0, round(box[1] - f * side)),
                    min(sw.VLM_IMAGE_SIZE, round(box[2] + f * side)), min(sw.VLM_IMAGE_SIZE, round(box[3] + f * side))]
        assert loose == expected and target.endswith(f"<answer>{json.dumps(loose)}</answer>")
        iou = build_reward("iou")([target], None, [meta])["iou"].item()
        assert iou == pytest.approx(side * side / ((loose[2] - loose[0]) * (loose[3] - loose[1])))
        if 0 < loose[0] and 0 < loose[1] and loose[2] < sw.VLM_IMAGE_SIZE and loose[3] < sw.VLM_IMAGE_SIZE:
            interior += 1
            assert iou == pytest.approx(1 / (1 + 2 * f) ** 2, abs=0.04)  # whole pixels
            assert iou < 0.62
    assert interior >= 3


def test_timeline_timestamps_are_the_ones_a_qwen3_vl_prompt_shows(tmp_path):
    """The timeline's stamps are, step for step, the ``<t seconds>`` the tiny Qwen3-VL processor writes into the
    prompt of a ShapeWorld clip decoded as training decodes it (2 fps): the frames of qwen-vl-utils' rounded
    linspace, 0 2 | 4 6 | 8 10 | 13 15 | 17 19 | 21 23 (not evenly spaced), so 3.5 s and not 3.2 s."""
    from transformers import AutoProcessor

    from mmrl.data.video import read_video
    from mmrl.pipelines.vlm.tiny import ensure_tiny_vlm

    steps = sw.timeline_steps()
    assert [frames for frames, _ in steps] == [(0, 2), (4, 6), (8, 10), (13, 15), (17, 19), (21, 23)]
    assert [stamp for _, stamp in steps] == ["0.2", "1.2", "2.2", "3.5", "4.5", "5.5"]  # (0 + 2) / 2 / 4 = 0.25 -> 0.2
    path = sw.write_vlm_dataset(tmp_path, "train", 1, seed=0, tasks=("temporal_grounding_timeline",))
    line = json.loads(path.read_text())
    clip = read_video(tmp_path / line["video"], fps=sw.TIMELINE_FPS)
    processor = AutoProcessor.from_pretrained(ensure_tiny_vlm("qwen3_vl"))
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text",
                                                                                             "text": "When?"}]}],
                                         add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], videos=[clip.frames], video_metadata=[clip.metadata()], do_sample_frames=False,
                       return_tensors="pt")
    shown = [part[part.rindex("<") + 1:-len(" seconds>")]
             for part in processor.tokenizer.decode(inputs["input_ids"][0]).split("<|vision_start|>")[:-1]
             if part.endswith(" seconds>")]
    assert shown == [stamp for stamp, _ in line["timeline"]] == [stamp for _, stamp in steps]
    assert clip.indices == [f for frames, _ in steps for f in frames]


def test_timeline_lines_walk_through_the_frames_and_keep_the_exact_solution(tmp_path):
    """temporal_grounding_timeline: temporal grounding's clips, questions and solutions (the same files for the same
    seed); the target lists the other shapes, then at each stamp the state the decoded frames show (read off them
    with the evaluator), then the sentence and the exact span, which the tIoU reward scores 1. The loose variant
    answers the span widened by ceil(LOOSE_SPAN_FRACTION x length) frames per side (clamped to the clip): at best
    tIoU 0.5 away from the ends, never a hit at R1@0.5 there."""
    import decord

    from mmrl.rewards import think_answer_format

    n, words = 12, {"visible": ("here", "none"), "move": ("moving", "still")}
    plain = sw.write_vlm_dataset(tmp_path / "plain", "heldout", n, seed=4, tasks=("temporal_grounding",))
    tiou, hit = build_reward("temporal_iou"), build_reward("temporal_iou", hit_threshold=0.5)
    interior = 0
    for task in ("temporal_grounding_timeline", "temporal_grounding_timeline_loose"):
        assert sw.check_vlm_spec(f"shapeworld:train:8:{task}") is None
        path = sw.write_vlm_dataset(tmp_path / task, "heldout", n, seed=4, tasks=(task,))
        kinds = set()
        for line, exact in zip(map(json.loads, path.read_text().splitlines()),
                               map(json.loads, plain.read_text().splitlines())):
            assert line["task"] == "temporal_grounding" and line["solution"] == exact["solution"]
            assert line["question"] == exact["question"] and line["event"] == exact["event"]
            assert (tmp_path / task / line["video"]).read_bytes() == (plain.parent / exact["video"]).read_bytes()
            event, target = line["event"], line["sft_target"]
            kinds.add(event["kind"])
            reader = decord.VideoReader(str(tmp_path / task / line["video"]))
            frames = reader.get_batch(list(range(len(reader)))).asnumpy()
            active = _event_frames(frames, event)
            on, off = words.get(event["kind"], (event["color_during"], event["color"]))
            expected = [[stamp, on if set(step) & active else off] for step, stamp in sw.timeline_steps()]
            assert line["timeline"] == expected
            others = sorted(f"a {d.color} {d.label}" for d in detect(frames[0]) if d.label != event["shape"])
            in_view = target[len("<think>In view: "):target.index(". ")]
            assert sorted(in_view.split(", ")) == others if others else in_view == "no other shape"
            assert "; ".join(f"{t} s {w}" for t, w in expected) in target and think_answer_format(target) == 1.0
            s, e = event["frames"]
            if task.endswith("_loose"):
                pad = -(-(e - s) // 2)
                taught = [max(0, s - pad) / sw.VIDEO_FPS, min(sw.VIDEO_FRAMES, e + pad) / sw.VIDEO_FPS]
                assert line["loose_timestamps"] == taught and target.endswith(f"<answer>{json.dumps(taught)}</answer>")
                score = tiou([target], None, [line])["temporal_iou"].item()
                assert score == pytest.approx((e - s) / sw.VIDEO_FPS / (taught[1] - taught[0]))
                if s - pad > 0 and e + pad < sw.VIDEO_FRAMES:
                    interior += 1
                    assert score <= 0.5 and hit([target], None, [line])["temporal_iou"].item() == 0.0
            else:
                assert "loose_timestamps" not in line
                assert tiou([target], None, [line])["temporal_iou"].item() == 1.0
        assert kinds == {"visible", "move", "color"}
    assert interior >= 2
    # the loose set is cached under its own name: a changed fraction writes a new set
    assert "looseSpan0.5" in sw.resolve_vlm_spec("shapeworld:heldout:2:temporal_grounding_timeline_loose",
                                                 coord_format="qwen2", directory=tmp_path / "cache")


# ---------------------------------------------------------------------------------------------- mmrl eval


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    """The tiny CPU recipe (tiny:sd3, built once into $MMRL_CACHE)."""
    return tiny_flow_config(tmp_path_factory.mktemp("shapeworld-config"), cached=True)


def test_mmrl_eval_shapeworld_heldout_end_to_end(config_file, tmp_path, capsys):
    from mmrl.cli import main

    out = tmp_path / "out"
    assert main(["eval", str(config_file), "benchmarks=[shapeworld@heldout]", "limit=6", "resolution=32",
                 "num_steps=2", f"output_dir={out}"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    result = summary["benchmarks"]["shapeworld@heldout"]
    metrics = result["metrics"]
    assert set(metrics["per_tag"]) == set(TAGS) and metrics["missing_tags"] == []
    assert metrics["overall"] == pytest.approx(np.mean(list(metrics["per_tag"].values())))
    assert metrics["counts"] == {t: 4 for t in TAGS} and metrics["num_images"] == 24 and result["num_unjudged"] == 0
    protocol = result["protocol"]
    assert (protocol["resolution"], protocol["num_steps"], protocol["images_per_prompt"]) == (32, 2, 4)
    assert protocol["prompts_sha256"] == hashlib.sha256(Path(protocol["prompts_file"]).read_bytes()).hexdigest()
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows[::4]] == [p for p, _ in prompt_set("heldout")[:6]]
    assert all(r["scores"]["correct"] in (0.0, 1.0) and isinstance(r["verdict"]["detections"], list) for r in rows)
    capsys.readouterr()
    assert main(["eval", str(config_file), "benchmarks=[shapeworld@val]", f"output_dir={tmp_path / 'bad'}"]) == 2
    one_error(capsys, "unknown ShapeWorld split 'val'")


def test_mmrl_eval_without_benchmarks_evaluates_the_configs_eval_section(config_file, tmp_path):
    # `mmrl eval RUN` with no benchmarks= ran geneval and ocr at 512 px, not what the run evaluates during training
    from mmrl.cli import main

    out = tmp_path / "out"
    assert main(["eval", str(config_file), "eval.benchmarks=[shapeworld@test:single_object]",
                 "eval.options={images_per_prompt: 2, num_steps: 3, resolution: 32}", "num_steps=2", "limit=1",
                 f"output_dir={out}"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["benchmarks"]) == ["shapeworld@test:single_object"]
    protocol = summary["benchmarks"]["shapeworld@test:single_object"]["protocol"]
    # the eval section's options, a key given on the command line winning (num_steps)
    assert (protocol["images_per_prompt"], protocol["num_steps"], protocol["resolution"]) == (2, 2, 32)


def test_shapeworld_prompt_spec_reads_the_split_with_metadata(tmp_path, monkeypatch):
    from mmrl.config import ConfigError, load_config
    from mmrl.data.prompts import DataError, read_prompts

    monkeypatch.setenv("MMRL_CACHE", str(tmp_path / "cache"))
    for split in ("train", "heldout"):
        items = read_prompts(f"shapeworld:{split}")
        assert [(i.prompt, i.metadata["tag"]) for i in items] == [(p, m["tag"]) for p, m in prompt_set(split)]
        assert all(i.metadata["include"] == m["include"] for i, (_, m) in zip(items, prompt_set(split)))
        # the cached file is named by its content and written once
        assert sw.prompts_file(split) == sw.prompts_file(split)
        assert sw.prompts_file(split).name.startswith(f"shapeworld-{split}-")
    assert [i.prompt for i in read_prompts("shapeworld:test")] == [p for p, _ in prompt_set("train")]
    with pytest.raises(DataError, match="unknown ShapeWorld split 'val'"):
        read_prompts("shapeworld:val")
    assert sw.resolve_prompts_spec("prompts.jsonl") == "prompts.jsonl"
    load_config(TINY_RECIPE, ["data.prompts=shapeworld:train", "data.prompt_list=[]"])  # no file check on the spelling
    with pytest.raises(ConfigError, match="unknown ShapeWorld split"):
        load_config(TINY_RECIPE, ["data.prompts=shapeworld:val"])


def test_shapeworld_category_subsets_keep_the_split_order_and_refuse_unknown_categories(tmp_path, monkeypatch):
    from mmrl.config import ConfigError, load_config
    from mmrl.data.prompts import DataError, read_prompts
    from mmrl.eval.runner import EvalError, EvalOptions, parse_benchmark

    monkeypatch.setenv("MMRL_CACHE", str(tmp_path / "cache"))
    train = prompt_set("train")
    # any spelling order; the subset is the split's prompts of those categories, in the split's own order
    for tags in (("colors", "single_object"), ("single_object", "colors")):
        subset = prompt_set("train", tags)
        assert subset == [(p, m) for p, m in train if m["tag"] in ("single_object", "colors")]
        assert Counter(m["tag"] for _, m in subset) == {"single_object": 2, "colors": 12}
    assert prompt_set("heldout", ["position"]) == [(p, m) for p, m in prompt_set("heldout") if m["tag"] == "position"]
    items = read_prompts("shapeworld:train:colors+single_object")
    assert [(i.prompt, i.metadata["tag"]) for i in items] == [(p, m["tag"]) for p, m in prompt_set("train", tags)]
    assert sw.prompts_file("train", ["colors"]).name.startswith("shapeworld-train-colors-")
    assert sw.prompts_file("train", ["colors"]) != sw.prompts_file("train")
    for bad, what in (("shapeworld:train:shapes", "unknown GenEval category 'shapes'"),
                      ("shapeworld:train:", "an empty GenEval category"),
                      ("shapeworld:train:colors+", "an empty GenEval category"),
                      ("shapeworld:val:colors", "unknown ShapeWorld split 'val'")):
        with pytest.raises(DataError, match=what):
            read_prompts(bad)
        with pytest.raises(ConfigError, match=what):
            load_config(TINY_RECIPE, [f"data.prompts='{bad}'", "data.prompt_list=[]"])
    # the benchmark takes the same subsets: the spec's prompt set is the split and the categories, checked
    assert parse_benchmark("shapeworld@test:colors+single_object", EvalOptions()).prompt_set == \
        "test:single_object+colors"
    assert parse_benchmark("shapeworld", EvalOptions()).prompt_set == "heldout"
    for bad, what in (("shapeworld@test:dogs", "unknown GenEval category 'dogs'"),
                      ("shapeworld:colors", "expected shapeworld, shapeworld@train"),
                      ("shapeworld@val:colors", "unknown ShapeWorld split 'val'")):
        with pytest.raises(EvalError, match=what):
            parse_benchmark(bad, EvalOptions())


def test_mmrl_eval_shapeworld_category_subset_scores_only_those_categories(config_file, tmp_path):
    from mmrl.cli import main

    out = tmp_path / "out"
    assert main(["eval", str(config_file), "benchmarks=[shapeworld@test:single_object+colors]", "resolution=32",
                 "num_steps=2", "images_per_prompt=1", f"output_dir={out}", "progress=false"]) == 0
    result = json.loads((out / "summary.json").read_text())["benchmarks"]["shapeworld@test:single_object+colors"]
    metrics = result["metrics"]
    assert metrics["counts"] == {"single_object": 2, "colors": 12} and metrics["num_images"] == 14
    assert metrics["overall"] == pytest.approx((metrics["per_tag"]["single_object"] + metrics["per_tag"]["colors"]) / 2)
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [p for p, _ in prompt_set("train", ["single_object", "colors"])]


def test_shapeworld_base_spelling_names_what_is_missing(monkeypatch, tmp_path):
    from mmrl.pipelines.flow.loading import ModelLoadError, resolve_pretrained

    with pytest.raises(ModelLoadError, match="unknown ShapeWorld base .flux."):
        resolve_pretrained("shapeworld:flux")
    # an install without the shipped folder says how to make it
    monkeypatch.setattr(sw, "__file__", str(tmp_path / "mmrl" / "data" / "shapeworld.py"))
    with pytest.raises(ModelLoadError, match="mmrl pretrain configs/shapes/pretrain_sd3.yaml"):
        resolve_pretrained("shapeworld:sd3")


def test_shapeworld_vlm_spec_writes_the_tasks_in_the_policys_box_format(tmp_path, monkeypatch):
    from mmrl.build import build_source
    from mmrl.config import ConfigError, load_config

    monkeypatch.setenv("MMRL_CACHE", str(tmp_path / "cache"))
    vlm = ["model.family=qwen_vl", "rewards={iou: 1.0}"]
    for model, coord in (("tiny:qwen2_5_vl", "qwen25"), ("tiny:qwen2_vl", "qwen2")):
        config = load_config(TINY_RECIPE, [*vlm, f"model.pretrained={model}", "data.dataset=shapeworld:train:4:grounding"])
        source = build_source(config)
        samples = [source._at(k) for k in range(4)]
        assert {s.metadata["task"] for s in samples} == {"grounding"}
        assert {s.metadata["coord_format"] for s in samples} == {coord}
    config = load_config(TINY_RECIPE, [*vlm, "model.pretrained=tiny:qwen2_5_vl",
                                "data.dataset=shapeworld:heldout:3:numeric+temporal_grounding"])
    assert [build_source(config)._at(k).metadata["task"] for k in range(3)].count("numeric") == 2
    with pytest.raises(ConfigError, match="unknown ShapeWorld task 'boxes'"):
        load_config(TINY_RECIPE, [*vlm, "model.pretrained=tiny:qwen2_5_vl", "data.dataset=shapeworld:train:4:boxes"])
    with pytest.raises(ConfigError, match="not a ShapeWorld VLM set"):
        load_config(TINY_RECIPE, [*vlm, "model.pretrained=tiny:qwen2_5_vl", "data.dataset=shapeworld:train"])
