"""Grounding rewards (mmrl.rewards.grounding): boxes and temporal spans, on hand-worked cases."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from mmrl.rewards import build_reward
from mmrl.rewards._text import Unparseable
from mmrl.rewards.grounding import (
    box_f1,
    box_iou,
    iou_matrix,
    match_boxes,
    matched_iou_completeness,
    mean_iou,
    parse_boxes,
    parse_timestamps,
    parse_timezero_span,
    recall_at,
    rescale_box,
    salience_weighted_iou,
    set_f1,
    spam_penalty,
    temporal_iou,
    weighted_precision_recall,
)

NAN = float("nan")


def same(a: torch.Tensor, b: list[float]) -> bool:
    return torch.allclose(a, torch.as_tensor(b, dtype=torch.float32), equal_nan=True, atol=1e-6)


def answer(body: str) -> str:
    return f"<think>looking</think><answer>{body}</answer>"


def strip(a: float, b: float) -> list[float]:
    """A box covering x in [a, b] and y in [0, 1]: IoUs of such boxes are 1-D interval IoUs."""
    return [a, 0.0, b, 1.0]


# --------------------------------------------------------------------------------------------
# box IoU
# --------------------------------------------------------------------------------------------


def test_box_iou_hand_worked():
    assert box_iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert box_iou([0, 0, 10, 10], [5, 0, 15, 10]) == pytest.approx(50 / 150)  # inter 5x10, union 150
    assert box_iou([0, 0, 10, 10], [0, 0, 5, 10]) == 0.5                     # half inside
    assert box_iou([0.5, 0.5, 1.5, 1.5], [1, 1, 2, 2]) == pytest.approx(0.25 / 1.75)  # continuous, no +1
    assert box_iou([0, 0, 10, 10], [20, 20, 30, 30]) == 0.0


def test_box_iou_touching_boxes_score_zero():
    assert box_iou([0, 0, 10, 10], [10, 0, 20, 10]) == 0.0   # shared edge
    assert box_iou([0, 0, 10, 10], [10, 10, 20, 20]) == 0.0  # shared corner


def test_box_iou_reversed_or_empty_boxes_score_zero():
    gt = [0, 0, 10, 10]
    assert box_iou([10, 10, 0, 0], gt) == 0.0   # fully reversed (abs-area IoU would give 1)
    assert box_iou([10, 0, 0, 10], gt) == 0.0   # x reversed
    assert box_iou([0, 10, 10, 0], gt) == 0.0   # y reversed
    assert box_iou(gt, [10, 10, 0, 0]) == 0.0   # reversed ground truth
    assert box_iou([5, 0, 5, 10], gt) == 0.0    # zero width
    assert box_iou([0, 0, float("nan"), 10], gt) == 0.0
    assert box_iou([0, 0, 10], gt) == 0.0


def test_iou_reward_exactly_half_is_not_accuracy():
    r = build_reward("iou", coord_format="absolute")
    gt = {"boxes": [[0, 0, 10, 10]]}
    out = r([answer("[0, 0, 5, 10]"), answer("[0, 0, 6, 10]"), answer("[10, 10, 0, 0]")], None, [gt] * 3)
    assert same(out["iou"], [0.5, 0.6, 0.0])
    assert same(out["acc@0.5"], [0.0, 1.0, 0.0])  # 0.5 is not > 0.5
    assert r.last_info["num_unparseable"] == 0    # a reversed box is read, and scores 0


def test_iou_reward_hit_threshold_scores_the_benchmark_hit():
    r = build_reward("iou", coord_format="absolute", hit_threshold=0.5)
    gt = {"boxes": [[0, 0, 10, 10]]}
    out = r([answer("[0, 0, 5, 10]"), answer("[0, 0, 6, 10]"), answer("[0, 0, 10, 10]"), answer("no box")],
            None, [gt] * 4)
    assert same(out["iou"], [0.0, 1.0, 1.0, 0.0])           # IoU 0.5 is no hit (strict, as acc@0.5)
    assert same(out["raw_iou"], [0.5, 0.6, 1.0, 0.0])       # the continuous value stays in the extras
    assert same(build_reward("iou", coord_format="absolute", hit_threshold=0.55)(
        [answer("[0, 0, 6, 10]")], None, [gt])["iou"], [1.0])
    assert same(build_reward("iou", coord_format="absolute", hit_threshold=0.7)(
        [answer("[0, 0, 6, 10]")], None, [gt])["iou"], [0.0])
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="thresholds must lie in"):
            build_reward("iou", hit_threshold=bad)


def test_iou_reward_first_box_and_best_ground_truth():
    r = build_reward("iou", coord_format="absolute")
    out = r([answer("[0,0,10,10] and [50,50,60,60]"), answer("[50,50,60,60] and [0,0,10,10]")], None,
            [{"boxes": [[100, 100, 110, 110], [0, 0, 10, 10]]}] * 2)
    assert same(out["iou"], [1.0, 0.0])  # first predicted box; best over the ground-truth boxes


def test_iou_reward_unparseable_counted_and_missing_metadata_nan():
    r = build_reward("iou", coord_format="absolute")
    completions = [answer("the cat on the left"), "[0, 0, 10, 10]", answer("[0, 0, 10, 10]"), answer("[0, 0, 10, 10]"),
                   answer("[0, 0, 10, 10]"), answer("[0, 0, 10, 10]")]
    meta = [{"boxes": [[0, 0, 10, 10]]}, {"boxes": [[0, 0, 10, 10]]}, {}, {"boxes": [[10, 10, 0, 0]]},
            {"boxes": [[0, 0, 10, 10]], "coord_format": "qwen2"}, {"boxes": []}]
    out = r(completions, None, meta)
    assert same(out["iou"], [0.0, 0.0, NAN, NAN, NAN, NAN])
    assert same(out["acc@0.5"], [0.0, 0.0, NAN, NAN, NAN, NAN])
    info = r.last_info
    assert info["num_unparseable"] == 2 and info["unparseable_samples"] == {
        0: "no box in the answer", 1: "no <answer>...</answer> block"}
    assert info["num_nan"] == 4
    assert "'boxes'" in info["nan_samples"][2]
    assert "not a valid" in info["nan_samples"][3]
    assert "image_size" in info["nan_samples"][4]
    assert "empty" in info["nan_samples"][5]


# --------------------------------------------------------------------------------------------
# parsing and coordinates
# --------------------------------------------------------------------------------------------


def test_parse_boxes_forms():
    qwen25 = '```json\n[{"bbox_2d": [10, 20, 30, 40], "label": "cat"}, {"bbox_2d": [1, 2, 3, 4], "label": "dog"}]\n```'
    assert parse_boxes(qwen25) == [[10, 20, 30, 40], [1, 2, 3, 4]]
    assert parse_boxes('{"bbox_2d": [10.5, 20, 30, 40]}') == [[10.5, 20, 30, 40]]
    assert parse_boxes("[10, 20, 30, 40]") == [[10, 20, 30, 40]]
    assert parse_boxes("[[1, 2, 3, 4], [5, 6, 7, 8]]") == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert parse_boxes("<|object_ref_start|>the cat<|object_ref_end|><|box_start|>(100,200),(300,400)<|box_end|>") == [
        [100, 200, 300, 400]]
    assert parse_boxes("The cat is at [1, 2, 3, 4], the dog at [5.5, 6, 7, 8].") == [[1, 2, 3, 4], [5.5, 6, 7, 8]]
    assert parse_boxes("[30, 40, 10, 20]") == [[30, 40, 10, 20]]  # reversed kept as written
    for empty in ("[]", "None", "no object", "Nothing."):
        assert parse_boxes(empty) == []
    for bad in ("a cat", "[1, 2, 3]", '{"label": "cat"}'):
        with pytest.raises(Unparseable):
            parse_boxes(bad)


def test_qwen2_coordinates_rescale_by_hand():
    # Qwen2-VL: [0, 1000) units. 640x480 image: x * 640/1000, y * 480/1000.
    assert rescale_box([500, 250, 750, 500], "qwen2", image_size=[640, 480]) == pytest.approx([320, 120, 480, 240])


def test_qwen25_coordinates_rescale_by_hand():
    # Qwen2.5-VL: pixels of the resized input. 1000x500 original resized to 504x252 (grid 36x18 * 14):
    # x * 1000/504, y * 500/252 -> 252 -> 500, 504 -> 1000, 63 -> 125, 126 -> 250.
    assert rescale_box([252, 63, 504, 126], "qwen25", image_size=[1000, 500], input_size=[504, 252]) == pytest.approx(
        [500, 125, 1000, 250])


def test_coordinate_formats_in_the_reward():
    r = build_reward("iou", coord_format="absolute")
    gt = [320, 120, 480, 240]
    meta = [
        {"boxes": [gt], "coord_format": "qwen2", "image_size": [640, 480]},
        {"boxes": [[500, 125, 1000, 250]], "coord_format": "qwen25", "image_size": [1000, 500], "input_size": [504, 252]},
        {"boxes": [gt]},  # absolute: the same numbers read as original pixels
        {"boxes": [[500, 125, 1000, 250]], "coord_format": "qwen25", "image_size": [1000, 500]},  # no input_size
    ]
    out = r([answer("[500, 250, 750, 500]"), answer('[{"bbox_2d": [252, 63, 504, 126], "label": "car"}]'),
             answer("[500, 250, 750, 500]"), answer("[252, 63, 504, 126]")], None, meta)
    # absolute: [500,250,750,500] vs [320,120,480,240] do not overlap
    assert same(out["iou"], [1.0, 1.0, 0.0, NAN])
    assert "input_size" in r.last_info["nan_samples"][3]
    # the reward's default format applies when the metadata has none
    r2 = build_reward("iou", coord_format="qwen2")
    assert r2([answer("[500, 250, 750, 500]")], None, [{"boxes": [gt], "image_size": [640, 480]}])["iou"].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="coord_format"):
        build_reward("iou", coord_format="qwen3")


# --------------------------------------------------------------------------------------------
# multi-object matching
# --------------------------------------------------------------------------------------------

# p1 overlaps g1 most, but p2 can only reach g1: greedy highest-IoU-first takes (p1, g1) and leaves p2
# without a match; the one-to-one optimum is (p1, g2) + (p2, g1).
G1, G2 = strip(0, 10), strip(4, 14)
P1, P2 = strip(1, 11), strip(-2, 8)
# IoU(p1,g1) = 9/11, IoU(p1,g2) = 7/13, IoU(p2,g1) = 8/12, IoU(p2,g2) = 4/16


def greedy_matches(pred, gt, thr):
    pairs = sorted(((box_iou(p, g), i, j) for i, p in enumerate(pred) for j, g in enumerate(gt)), reverse=True)
    used_p, used_g, out = set(), set(), []
    for iou, i, j in pairs:
        if iou >= thr and i not in used_p and j not in used_g:
            used_p.add(i), used_g.add(j), out.append((i, j))
    return out


def test_hungarian_beats_greedy():
    assert box_iou(P1, G1) == pytest.approx(9 / 11) and box_iou(P1, G2) == pytest.approx(7 / 13)
    assert box_iou(P2, G1) == pytest.approx(8 / 12) and box_iou(P2, G2) == pytest.approx(4 / 16)
    assert greedy_matches([P1, P2], [G1, G2], 0.5) == [(0, 0)]  # greedy: one match
    matches = match_boxes([P1, P2], [G1, G2], 0.5)
    assert sorted((i, j) for i, j, _ in matches) == [(0, 1), (1, 0)]
    assert box_f1([P1, P2], [G1, G2])["f1"] == 1.0  # greedy would give 0.5


def test_matching_counts_the_most_pairs_above_the_threshold_first():
    """A chain of width-10 boxes a third of a width apart: each prediction overlaps its own box at 0.99 and the
    next one just over 0.5, and a fourth overlaps the first box just over 0.5. The most IoU is 3 near-perfect
    pairs (sum 2.97); the most matches at IoU >= 0.5 is 4 (each just over 0.5), which F1 counts. Written out by
    brute force over every one-to-one assignment."""
    from itertools import permutations

    step, eps = 10 / 3, 0.05
    gt = [[i * step, 0, i * step + 10, 10] for i in range(4)]
    pred = [[i * step + eps, 0, i * step + eps + 10, 10] for i in range(3)] + [[-step + eps, 0, -step + eps + 10, 10]]
    ious = iou_matrix(pred, gt)
    best = max((sum(ious[i, j] >= 0.5 for i, j in enumerate(perm)),
                sum(ious[i, j] for i, j in enumerate(perm) if ious[i, j] >= 0.5)) for perm in permutations(range(4)))
    matches = match_boxes(pred, gt, 0.5)
    assert len(matches) == best[0] == 4
    assert sum(m[2] for m in matches) == pytest.approx(best[1])
    assert box_f1(pred, gt)["f1"] == 1.0  # was 0.75


def test_matching_ignores_sub_threshold_overlaps():
    # Plain Hungarian on IoU prefers (p1,g2)+(p2,g1) = 6/17 + 0.3 over (p1,g1) = 10/17, and then
    # finds nothing above 0.5; masking sub-threshold IoUs keeps the one match that counts.
    g1, g2, p1, p2 = strip(0, 10), strip(9, 15), strip(-2, 15), strip(5, 8)
    assert box_iou(p1, g1) == pytest.approx(10 / 17) and box_iou(p1, g2) == pytest.approx(6 / 17)
    assert box_iou(p2, g1) == pytest.approx(0.3) and box_iou(p2, g2) == 0.0
    assert [(i, j) for i, j, _ in match_boxes([p1, p2], [g1, g2], 0.5)] == [(0, 0)]
    assert match_boxes([p1, p2], [g1, g2], 0.5, mask_below_threshold=False) == []
    assert box_f1([p1, p2], [g1, g2])["f1"] == 0.5
    assert set_f1([p1, p2], [g1, g2], (0.5,))["f1"] == 0.0  # Falcon's evaluation matches without masking


def test_box_f1_and_presence_cases():
    gt = [[0, 0, 10, 10], [20, 0, 30, 10]]
    f = box_f1([[0, 0, 10, 10], [50, 50, 60, 60], [70, 70, 80, 80]], gt)
    assert (f["precision"], f["recall"], f["f1"]) == pytest.approx((1 / 3, 1 / 2, 2 / 5))
    assert box_f1([], [])["f1"] == 1.0
    assert box_f1([[0, 0, 1, 1]], [])["f1"] == 0.0
    assert box_f1([], gt)["f1"] == 0.0
    # IoU exactly 0.5 matches at IoU >= 0.5
    assert box_f1([[0, 0, 5, 10]], [[0, 0, 10, 10]])["f1"] == 1.0
    assert box_f1([[0, 0, 5, 10]], [[0, 0, 10, 10]], iou_threshold=0.51)["f1"] == 0.0


def test_spam_penalty_vlm_r1():
    assert spam_penalty(4, 1) == 0.25 and spam_penalty(6, 3) == 0.5
    assert spam_penalty(2, 3) == 1.0 and spam_penalty(0, 3) == 1.0
    gt = {"boxes": [[0, 0, 10, 10]]}
    spam = answer("[[0,0,10,10],[20,20,30,30],[40,40,50,50],[60,60,70,70]]")
    plain = build_reward("box_f1", coord_format="absolute")
    penalised = build_reward("box_f1", coord_format="absolute", spam_penalty=True)
    assert plain([spam], None, [gt])["box_f1"].item() == pytest.approx(2 / 5)
    assert penalised([spam], None, [gt])["box_f1"].item() == pytest.approx(2 / 5 * 1 / 4)
    # spam penalty on by default: extra boxes cost nothing otherwise
    m = build_reward("box_matched_iou", coord_format="absolute")
    assert m([spam], None, [gt])["box_matched_iou"].item() == pytest.approx(0.25)
    unpenalised = build_reward("box_matched_iou", coord_format="absolute", spam_penalty=False)
    assert unpenalised([spam], None, [gt])["box_matched_iou"].item() == 1.0


def _official_detection_score(pred_boxes, gt_boxes, iou_threshold=0.5, alpha=0.7, beta=0.0, gamma=0.3):
    """VLM-R1 grpo_jsonl.py detection_score after its JSON reading, its rule written out: greedy matching on its
    inclusive-pixel iou, a wrong label's match counting IoU 0, position / #gt, completeness 1 - (miss + fa) / 2."""
    def iou(b1, b2):
        x1, y1, x2, y2 = max(b1[0], b2[0]), max(b1[1], b2[1]), min(b1[2] - 1, b2[2] - 1), min(b1[3] - 1, b2[3] - 1)
        inter = (x2 - x1 + 1) * (y2 - y1 + 1) if x1 < x2 and y1 < y2 else 0
        return float(inter) / ((b1[2] - b1[0]) * (b1[3] - b1[1]) + (b2[2] - b2[0]) * (b2[3] - b2[1]) - inter)

    if not gt_boxes:
        return 1.0 if not pred_boxes else 0.0
    if not pred_boxes:
        return 0.0
    up, ug = list(range(len(pred_boxes))), list(range(len(gt_boxes)))
    m = [[iou(p["bbox_2d"], g["bbox_2d"]) for g in gt_boxes] for p in pred_boxes]
    matches = []
    while up and ug:
        best, bi, bj = -1, -1, -1
        for i in up:
            for j in ug:
                if m[i][j] > best:
                    best, bi, bj = m[i][j], i, j
        if best < iou_threshold:
            break
        ok = pred_boxes[bi]["label"].lower() == gt_boxes[bj]["label"].lower()
        matches.append((best if ok else 0, ok))
        up.remove(bi)
        ug.remove(bj)
    pos = sum(v for v, _ in matches) / len(gt_boxes) if matches else 0.0
    lab = sum(1.0 for _, ok in matches if ok) / len(gt_boxes) if matches else 0.0
    comp = 1.0 - (len(ug) / len(gt_boxes) + len(up) / len(pred_boxes)) / 2.0
    return (alpha * pos + beta * lab + gamma * comp) / (alpha + beta + gamma)


def _fenced(items) -> str:
    import json

    return "<think>found them</think><answer>```json\n" + json.dumps(items) + "\n```</answer>"


def test_box_detection_score_is_vlm_r1s_weighted_sum():
    from mmrl.rewards.grounding import vlm_r1_detection_score

    r = build_reward("box_detection_score", coord_format="absolute")
    cat, dog = {"bbox_2d": [0, 0, 10, 10], "label": "cat"}, {"bbox_2d": [20, 0, 30, 10], "label": "dog"}
    meta = {"boxes": [cat["bbox_2d"], dog["bbox_2d"]], "labels": ["Cat", "dog"]}
    spurious = {"bbox_2d": [50, 50, 60, 60], "label": "cat"}
    cases = [  # hand-worked: 0.7 position + 0.3 completeness
        ([cat, dog, spurious], 0.7 * 1 + 0.3 * (1 - (0 + 1 / 3) / 2)),  # 0.95
        ([cat], 0.7 * 0.5 + 0.3 * (1 - (0.5 + 0) / 2)),  # 0.575
        ([{**cat, "label": "dog"}, dog], 0.7 * 0.5 + 0.3 * 1),  # a wrong label: its match counts IoU 0
        ([cat, cat, dog], 0.7 * 1 + 0.3 * (1 - (0 + 1 / 3) / 2)),  # a duplicate is a false alarm
        ([{"label": "cat"}, dog], 0.7 * 0.5 + 0.3 * (1 - (0.5 + 0.5) / 2)),  # no box: a prediction with IoU 0
    ]
    out = r([_fenced(items) for items, _ in cases], None, [meta] * len(cases))
    assert out["box_detection_score"].tolist() == pytest.approx([want for _, want in cases])
    assert out["box_detection_score"][0].item() == pytest.approx(0.95)
    assert out["label_accuracy"][2].item() == pytest.approx(0.5)
    # the reading: the LAST answer block, and only a fenced json block (else unparseable, 0 and counted)
    two_blocks = "<answer>```json\n[]\n```</answer> then <answer>```json\n" + '[{"bbox_2d": [0, 0, 10, 10], ' \
        '"label": "CAT"}]\n```</answer>'
    bare = answer('[{"bbox_2d": [0, 0, 10, 10], "label": "cat"}]')
    out = r([two_blocks, bare], None, [{"boxes": [[0, 0, 10, 10]], "labels": ["cat"]}] * 2)
    assert out["box_detection_score"].tolist() == pytest.approx([1.0, 0.0])
    assert r.last_info["num_unparseable"] == 1
    # an image with nothing to detect (VLM-R1's solution "None"): 1 for the answer "none" only, not an empty list
    empty = r(["<think>r</think><answer>None</answer>", _fenced([]), _fenced([cat])], None, [{"boxes": []}] * 3)
    assert empty["box_detection_score"].tolist() == [1.0, 0.0, 0.0]
    # without labels in the metadata, labels are not checked
    assert r([_fenced([{**cat, "label": "dog"}])], None, [{"boxes": [[0, 0, 10, 10]]}])["box_detection_score"].item() \
        == pytest.approx(1.0)
    # against the official function on random scenes (labels from two classes, overlaps of every size)
    rng = np.random.default_rng(0)
    for _ in range(300):
        def boxes(n):
            out = []
            for _ in range(n):
                x, y = rng.integers(0, 40, 2).tolist()
                out.append({"bbox_2d": [x, y, x + int(rng.integers(2, 15)), y + int(rng.integers(2, 15))],
                            "label": str(rng.choice(["cat", "dog"]))})
            return out
        gt, pred = boxes(int(rng.integers(0, 4))), boxes(int(rng.integers(0, 5)))
        got = vlm_r1_detection_score([(p["bbox_2d"], p["label"]) for p in pred],
                                     [(g["bbox_2d"], g["label"]) for g in gt])["score"]
        assert got == pytest.approx(_official_detection_score(pred, gt), abs=1e-12)


def test_matched_iou_and_completeness():
    gt = [[0, 0, 10, 10], [20, 0, 30, 10]]
    two = matched_iou_completeness([[0, 0, 10, 10], [20, 0, 26, 10]], gt)  # IoUs 1 and 0.6
    assert (two["mean_iou"], two["completeness"], two["score"]) == pytest.approx((0.8, 1.0, 0.9))
    one = matched_iou_completeness([[0, 0, 10, 10]], gt)
    assert (one["mean_iou"], one["completeness"], one["score"]) == pytest.approx((1.0, 0.5, 0.75))
    assert matched_iou_completeness([[0, 0, 10, 10]], gt, iou_weight=0.2)["score"] == pytest.approx(0.2 + 0.8 * 0.5)
    r = build_reward("box_matched_iou", coord_format="absolute")
    out = r([answer("[[0,0,10,10],[20,0,26,10]]")], None, [{"boxes": gt}])
    assert same(out["box_matched_iou"], [0.9]) and same(out["mean_iou"], [0.8]) and same(out["completeness"], [1.0])


def test_dip_weighted_precision_recall():
    gt = [[0, 0, 10, 10], [20, 0, 30, 10]]
    pred = [[0, 0, 10, 10], [20, 0, 30, 10], [40, 0, 50, 10], [60, 0, 70, 10]]  # P = 2/4, R = 2/2
    assert weighted_precision_recall(pred, gt)["score"] == pytest.approx(0.75)
    assert weighted_precision_recall(pred, gt, precision_weight=0.8)["score"] == pytest.approx(0.8 * 0.5 + 0.2 * 1.0)
    r = build_reward("box_weighted_pr", coord_format="absolute", precision_weight=0.8)
    out = r([answer(str(pred))], None, [{"boxes": gt}])
    assert same(out["box_weighted_pr"], [0.6]) and same(out["precision"], [0.5]) and same(out["recall"], [1.0])


def falcon_sample_f1(pred, gt, thresholds):
    """Falcon-Perception eval/metrics.py sample_f1 on boxes, written out independently (with its 1e-8s)."""
    ious = np.array([[box_iou(p, g) for g in gt] for p in pred])
    ri, ci = linear_sum_assignment(-ious)
    matched = ious[ri, ci]
    f1s = []
    for t in thresholds:
        tp = int((matched >= t).sum())
        fp, fn = len(pred) - tp, len(gt) - tp
        prec, rec = tp / (tp + fp + 1e-8), tp / (tp + fn + 1e-8)
        f1s.append(2.0 * prec * rec / (prec + rec + 1e-8))
    return float(np.mean(f1s))


def test_falcon_set_f1_hand_worked_and_against_the_reference():
    thresholds = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
    # IoU 0.72 counts at 0.5 .. 0.7 (5 of 10 thresholds): mean F1 = 0.5
    assert set_f1([[0, 0, 72, 1]], [[0, 0, 100, 1]])["f1"] == pytest.approx(0.5)
    assert set_f1([[0, 0, 72, 1]], [[0, 0, 100, 1]])["f1@0.5"] == 1.0
    rng = np.random.default_rng(0)
    for _ in range(20):
        def boxes(k):
            xy = rng.uniform(0, 50, size=(k, 2))
            wh = rng.uniform(5, 30, size=(k, 2))
            return np.concatenate([xy, xy + wh], axis=1).tolist()
        pred, gt = boxes(int(rng.integers(1, 6))), boxes(int(rng.integers(1, 6)))
        assert set_f1(pred, gt, thresholds)["f1"] == pytest.approx(falcon_sample_f1(pred, gt, thresholds), abs=1e-5)


def test_falcon_set_reward_negatives():
    r = build_reward("box_set_f1", coord_format="absolute")
    out = r([answer("[]"), answer("no object"), answer("[0,0,10,10]"), answer("nothing to see but [0, 0, 10")], None,
            [{"boxes": []}, {"boxes": [[0, 0, 10, 10]]}, {"boxes": []}, {"boxes": []}])
    assert same(out["box_set_f1"], [1.0, 0.0, 0.0, 0.0])  # correct rejection; miss; hallucination; unreadable
    assert r.last_info["num_unparseable"] == 1 and r.last_info["num_nan"] == 0


def test_grip_salience_weighted_iou():
    gt = [[0, 0, 10, 10], [20, 0, 30, 10]]
    pred = [[0, 0, 10, 10], [20, 0, 25, 10]]  # IoUs 1.0 and 0.5
    assert salience_weighted_iou(pred, gt, [3, 1]) == pytest.approx((3 * 1.0 + 1 * 0.5) / 4)
    assert salience_weighted_iou(pred, gt) == pytest.approx(0.75)
    assert salience_weighted_iou([[20, 0, 30, 10]], gt, [3, 1]) == pytest.approx(1 / 4)  # only the minor object found
    assert salience_weighted_iou([[0, 0, 10, 10]], gt, [3, 1]) == pytest.approx(3 / 4)   # only the salient one
    r = build_reward("box_salience_iou", coord_format="absolute")
    out = r([answer(str(pred)), answer(str(pred)), answer("[[0,0,10,10],[0,0,10,10],[0,0,10,10],[0,0,10,10]]")], None,
            [{"boxes": gt, "salience": [3, 1]}, {"boxes": gt, "salience": [1]}, {"boxes": gt, "salience": [3, 1]}])
    # third: one box matched (IoU 1 on the salient object) = 3/4, times spam penalty 2/4
    assert same(out["box_salience_iou"], [0.875, NAN, 0.375])
    assert "salience" in r.last_info["nan_samples"][1]


# --------------------------------------------------------------------------------------------
# temporal grounding
# --------------------------------------------------------------------------------------------


def test_temporal_iou_hand_worked():
    assert temporal_iou([2, 6], [4, 8]) == pytest.approx(2 / 6)
    assert temporal_iou([10, 20], [10, 20]) == 1.0
    assert temporal_iou([2, 4], [0, 10]) == pytest.approx(0.2)
    assert temporal_iou([0, 5], [5, 10]) == 0.0    # touching
    assert temporal_iou([0, 2], [5, 10]) == 0.0    # disjoint
    assert temporal_iou([6, 2], [2, 6]) == 0.0     # reversed prediction
    assert temporal_iou([2, 6], [6, 2]) == 0.0     # reversed ground truth
    assert temporal_iou([5, 5], [0, 10]) == 0.0    # zero-length prediction
    assert temporal_iou([5, 5], [5, 5]) == 0.0     # zero-length both: not 0/0


@pytest.mark.parametrize("text,span", [
    ("12.5 to 20.1 seconds", (12.5, 20.1)),
    ("The event happens from 12.5s to 20.1s.", (12.5, 20.1)),
    ("[12.5, 20.1]", (12.5, 20.1)),
    ("00:12-00:20", (12.0, 20.0)),
    ("between 1:02:03 and 1:02:10", (3723.0, 3730.0)),
    ('{"start_time": "12.5", "end_time": "20.1"}', (12.5, 20.1)),  # Temporal-R1's answer format
    ("20 - 10", (20.0, 10.0)),  # reversed: returned as written, scores 0 later
])
def test_parse_timestamps(text, span):
    assert parse_timestamps(text) == pytest.approx(span)


def test_parse_timestamps_reads_the_last_span_as_timezero():
    """TimeZero's training reward reads the last ``A to B`` of its answer block."""
    assert parse_timestamps("10.0 to 15.0, more precisely 12.0 to 20.0") == (12.0, 20.0)
    assert parse_timestamps("[3, 5] then [7, 9]") == (7.0, 9.0)


def test_parse_timestamps_prefers_a_range_to_a_comma_pair():
    """A number next to the span is not read as its start or end: a pair joined by a word or a dash wins over one
    joined by a comma (one scan over both read "1, 2.0" in the first; an overlapping one would read "5.5 s, 3.5" in
    the second)."""
    assert parse_timestamps("Step 1, 2.0 to 5.5") == (2.0, 5.5)
    assert parse_timestamps("from 2.0 to 5.5 s, 3.5 s long") == (2.0, 5.5)
    assert parse_timestamps("clip 2, [2.0, 5.5]") == (2.0, 5.5)  # only comma pairs: still the last


def test_malformed_items_of_a_box_list_count_as_predictions():
    """A malformed item of a JSON box list is a prediction that matches nothing, not dropped: one right box among
    four written items is F1 2/5 (it scored 1.0 on every set reward, the penalty for extra boxes dodged)."""
    text = '[{"bbox_2d": [0, 0, 10, 10]}, {"bbox_2d": [1, 2, 3]}, {"bbox_2d": "x"}, {"bbox_2d": [NaN, 0, 5, 5]}]'
    boxes = parse_boxes(text)
    assert boxes[0] == [0.0, 0.0, 10.0, 10.0] and len(boxes) == 4 and all(math.isnan(v) for v in boxes[3])
    meta = [{"boxes": [[0, 0, 10, 10]], "coord_format": "absolute"}]
    answer = [f"<think>x</think><answer>{text}</answer>"]
    assert build_reward("box_f1")(answer, None, meta)["box_f1"].item() == pytest.approx(0.4)
    assert build_reward("box_set_f1")(answer, None, meta)["box_set_f1"].item() == pytest.approx(0.4)
    with pytest.raises(Unparseable):  # nothing readable at all: unparseable, as before
        parse_boxes('[{"bbox_2d": [1, 2, 3]}]')
    assert parse_boxes('[{"bbox_2d": [0, 0, 4, 4], "label": "cat"}, {"label": "note"}]') == [[0.0, 0.0, 4.0, 4.0]]


def test_parse_timestamps_refuses_signed_and_exponent_numbers():
    """A sign or an exponent belongs to the number: "-3 to 5" read as (3, 5) and "0 to 1e1" as (0, 1), both scoring
    tIoU 1 against [3, 5] and [0, 1]; a dash between two times still joins them."""
    for text in ("-3 to 5", "from -3 to 5", "[-1.0, 3]", "0 to 1e1", "1e3 to 2e3", "5 to 1e999", "3 to -5"):
        with pytest.raises(Unparseable, match="no time span"):
            parse_timestamps(text)
    assert parse_timestamps("10-20") == (10.0, 20.0) and parse_timestamps("10s-20s") == (10.0, 20.0)
    assert parse_timestamps("00:12-00:20") == (12.0, 20.0) and parse_timestamps("12.5 - 20.1") == (12.5, 20.1)
    out = build_reward("temporal_iou")(["<answer>-3 to 5</answer>"], None, [{"timestamps": [3.0, 5.0]}])
    assert out["temporal_iou"].tolist() == [0.0]


def test_parse_timezero_span_is_timezero_evaluate_py():
    """``evaluate.py`` ``parse_timestamp_output``: ``re.findall(r"(\\d+\\.?\\d*) (to|and) (\\d+\\.?\\d*)")`` over
    the whole output, the last match; nothing else reads."""
    assert parse_timezero_span("<think>maybe 1 to 2</think><answer>12.0 to 19.0</answer>") == (12.0, 19.0)
    assert parse_timezero_span("12.0 to 19.0") == (12.0, 19.0)  # untagged: read
    assert parse_timezero_span("<answer>between 3 and 5.5</answer> or 4 and 6") == (4.0, 6.0)
    assert parse_timezero_span("00:12 to 00:19") == (12.0, 0.0)  # '12 to 00': TimeZero's regex, as it reads
    for unread in ("12.5-19.0", "[12, 19]", '{"start_time": 12, "end_time": 19}', "from 12.5s to 19s", None):
        with pytest.raises(Unparseable):
            parse_timezero_span(unread)


def test_parse_timestamps_unparseable():
    for bad in ("at the end of the video", "around 12 seconds"):
        with pytest.raises(Unparseable):
            parse_timestamps(bad)


def test_recall_at_is_strict_and_mean_iou():
    tious = [0.5, 0.7, 0.3, float("nan")]
    assert recall_at(tious, 0.5) == pytest.approx(1 / 3)  # 0.5 itself does not count; NaN left out
    assert recall_at(tious, 0.3) == pytest.approx(2 / 3)
    assert mean_iou(tious) == pytest.approx(0.5)
    assert recall_at(torch.tensor([0.6, 0.4]), 0.5) == 0.5
    assert math.isnan(mean_iou([float("nan")]))


def test_temporal_iou_reward():
    r = build_reward("temporal_iou")
    completions = [answer("15 to 25 seconds"), answer("10 - 20"), answer("25 to 15"), answer("soon"), answer("10 to 20")]
    meta = [{"timestamps": [10, 20]}] * 4 + [{"timestamps": [20, 20]}]
    out = r(completions, None, meta)
    assert same(out["temporal_iou"], [1 / 3, 1.0, 0.0, 0.0, NAN])
    assert same(out["r1@0.3"], [1, 1, 0, 0, NAN]) and same(out["r1@0.5"], [0, 1, 0, 0, NAN])
    assert r.last_info["num_unparseable"] == 1 and "end > start" in r.last_info["nan_samples"][4]
    assert recall_at(out["temporal_iou"], 0.3) == pytest.approx(2 / 4)
    frac = build_reward("temporal_iou", time_unit="fraction")
    out = frac([answer("0.25 to 0.5"), answer("0.25 to 0.5")], None,
               [{"timestamps": [10, 20], "duration": 40}, {"timestamps": [10, 20]}])
    assert same(out["temporal_iou"], [1.0, NAN])


def test_temporal_iou_reward_hit_threshold():
    r = build_reward("temporal_iou", hit_threshold=0.5)
    out = r([answer("15 to 25"), answer("10 to 15"), answer("11 to 19"), answer("soon")], None,
            [{"timestamps": [10, 20]}] * 4)
    assert same(out["temporal_iou"], [0.0, 0.0, 1.0, 0.0])   # 1/3, exactly 0.5 (no hit), 0.8
    assert same(out["raw_tiou"], [1 / 3, 0.5, 0.8, 0.0])
    assert same(out["r1@0.5"], out["temporal_iou"])           # the reward is R1@0.5 itself
    assert r.last_info["num_unparseable"] == 1
    assert same(build_reward("temporal_iou", hit_threshold=0.3)(
        [answer("15 to 25")], None, [{"timestamps": [10, 20]}])["temporal_iou"], [1.0])


def test_temporal_iou_boundary_penalty_is_time_r1_iou_v2():
    """Time-R1's RL reward (main.py iou_timestamp_reward_v2): tIoU * (1 - |ds| / d) * (1 - |de| / d), unclipped;
    values worked by hand from that formula."""
    r = build_reward("temporal_iou", boundary_penalty=True)
    meta = {"timestamps": [10, 20], "duration": 30}
    out = r([answer("12.5 to 25.0"), answer("10 to 20"), answer("0 to 75"), answer("soon"), answer("10 to 20")],
            None, [meta] * 4 + [{"timestamps": [10, 20]}])
    # 0.5 * (1 - 2.5/30) * (1 - 5/30); exact; (2/15) * (1 - 10/30) * (1 - 55/30) < 0 as in Time-R1; no duration: NaN
    assert same(out["temporal_iou"], [0.5 * (27.5 / 30) * (25 / 30), 1.0, (2 / 15) * (20 / 30) * (-25 / 30), 0.0, NAN])
    assert same(out["raw_tiou"], [0.5, 1.0, 2 / 15, 0.0, NAN]) and same(out["r1@0.3"], [1, 1, 0, 0, NAN])
    assert r.last_info["num_unparseable"] == 1 and "duration" in r.last_info["nan_samples"][4]
    frac = build_reward("temporal_iou", boundary_penalty=True, time_unit="fraction")  # fractions scaled first
    assert same(frac([answer("0.25 to 0.5")], None, [{"timestamps": [10, 20], "duration": 40}])["temporal_iou"],
                [1.0])
    with pytest.raises(ValueError, match="set one"):
        build_reward("temporal_iou", boundary_penalty=True, hit_threshold=0.5)
    with pytest.raises(ValueError, match="boundary_penalty must be true or false"):
        build_reward("temporal_iou", boundary_penalty="yes")


def test_numbers_too_large_for_a_float_are_unparseable_not_scorer_failures():
    """A 400-digit integer (JSON or bare) overflows float(): a counted, unparseable 0, not a NaN 'scorer failed'."""
    big = "1" + "0" * 400
    iou = build_reward("iou", coord_format="absolute")
    out = iou([answer(f"[{big}, 0, 5, 5]"), answer('{"bbox_2d": [' + big + ', 0, 5, 5]}')], None,
              [{"boxes": [[0, 0, 5, 5]]}] * 2)
    assert same(out["iou"], [0.0, 0.0]) and iou.last_info["num_nan"] == 0
    span = build_reward("temporal_iou")
    out = span([answer('{"start": ' + big + ', "end": 15}')], None, [{"timestamps": [10, 20]}])
    assert same(out["temporal_iou"], [0.0]) and span.last_info["num_unparseable"] == 1
    assert span.last_info["num_nan"] == 0


def test_temporal_dual_reward():
    r = build_reward("temporal_dual")
    completions = [
        answer("B, from 10 to 20 seconds"),   # grounded QA: right letter, exact span -> 1 + 1
        answer("(C) 15 to 25 s"),             # wrong letter, tIoU 1/3
        answer("B"),                          # grounded QA without span: 1 + 0, counted unparseable
        answer("C"),                          # multiple choice only
        answer("12 to 18"),                   # temporal grounding only: tIoU 0.6
        answer("B"),                          # neither field: NaN
    ]
    meta = [
        {"solution": "B", "timestamps": [10, 20]},
        {"solution": "B", "timestamps": [10, 20]},
        {"solution": "B", "timestamps": [10, 20]},
        {"solution": "C"},
        {"timestamps": [10, 20]},
        {},
    ]
    out = r(completions, None, meta)
    assert same(out["temporal_dual"], [2.0, 1 / 3, 1.0, 1.0, 0.6, NAN])
    assert same(out["semantic"], [1.0, 0.0, 1.0, 1.0, NAN, NAN])
    assert same(out["temporal"], [1.0, 1 / 3, 0.0, NAN, 0.6, NAN])
    assert r.last_info["num_unparseable"] == 1 and "temporal" in r.last_info["unparseable_samples"][2]
    assert r.last_info["num_nan"] == 1


def test_temporal_dual_on_temporal_grounding_lines():
    """A temporal-grounding line (mmrl.data.vlm, tiny:temporal_grounding) carries the span as its `solution` text:
    only its temporal part is scored, never a NaN for a 'solution' that is not a choice letter."""
    r = build_reward("temporal_dual")
    meta = [
        {"task": "temporal_grounding", "solution": "[10.0, 20.0]", "timestamps": [10.0, 20.0], "duration": 30.0},
        {"task": "temporal_grounding", "solution": "10.0-20.0", "timestamps": [10.0, 20.0]},
        {"task": "temporal_grounding", "solution": "A man sits down from 10 to 20", "timestamps": [10.0, 20.0]},
        {"task": "temporal_grounding", "solution": "[10.0, 20.0]", "timestamps": [10.0, 20.0]},
    ]
    completions = [answer("[12.0, 18.0]"), answer("15 to 25 seconds"), answer("10 to 20"), answer("soon")]
    out = r(completions, None, meta)
    # [12, 18] in [10, 20]: 6 / 10; [15, 25] vs [10, 20]: 5 / 15; exact: 1; no span: unparseable 0
    assert same(out["temporal_dual"], [0.6, 1 / 3, 1.0, 0.0])
    assert same(out["temporal"], [0.6, 1 / 3, 1.0, 0.0])
    assert same(out["semantic"], [NAN, NAN, NAN, NAN])  # no semantic part on a grounding line
    assert r.last_info["num_nan"] == 0
    assert r.last_info["unparseable_samples"] == {3: "temporal: no time span in the answer"}


def test_temporal_dual_on_multiple_choice_and_mixed_lines():
    r = build_reward("temporal_dual")
    options = ["sits down", "stands up", "runs away"]
    meta = [
        {"task": "multiple_choice", "solution": "B", "choices": options},        # MC: letter
        {"task": "multiple_choice", "solution": "stands up", "choices": options},  # MC: option text -> B
        {"solution": "(C)"},                                                     # MC without choices: bare letter
        {"solution": "B", "choices": options, "timestamps": [10, 20]},           # grounded QA: both parts
        {"solution": "B", "choices": options, "timestamps": [10, 20]},
        {"solution": "D", "choices": options, "timestamps": [10, 20]},           # not one of the 3 options
        {"solution": "a short description"},                                     # neither part
    ]
    completions = [answer("B"), answer("(A)"), answer("C"), answer("B, from 15 to 25 seconds"),
                   answer("C 10 to 20"), answer("B 10 to 20"), answer("B")]
    out = r(completions, None, meta)
    # grounded QA: right letter + tIoU([15, 25], [10, 20]) = 1 + 5/15; wrong letter + exact span = 0 + 1
    assert same(out["temporal_dual"], [1.0, 0.0, 1.0, 1 + 1 / 3, 1.0, NAN, NAN])
    assert same(out["semantic"], [1.0, 0.0, 1.0, 1.0, 0.0, NAN, NAN])
    assert same(out["temporal"], [NAN, NAN, NAN, 1 / 3, 1.0, NAN, NAN])
    reasons = r.last_info["nan_samples"]
    assert "'solution'" in reasons[5] and "choices" in reasons[5]
    assert "timestamps" in reasons[6] and "multiple-choice" in reasons[6]


def test_temporal_dual_on_the_synthetic_temporal_set():
    """The lines tiny:temporal_grounding writes (mmrl.data.synthetic.build_temporal_set) are judged, not NaN."""
    import json

    span = [1.25, 4.5]
    line = {"id": "t0", "task": "temporal_grounding", "solution": json.dumps(span), "timestamps": span,
            "duration": 8.0}
    out = build_reward("temporal_dual")([answer(json.dumps(span))], None, [line])
    assert out["temporal_dual"].item() == pytest.approx(1.0) and math.isnan(out["semantic"].item())


# --------------------------------------------------------------------------------------------
# coordinate format: never silently absolute; from the model type in build_reward_fn
# --------------------------------------------------------------------------------------------

BOX_REWARDS = ["iou", "box_f1", "box_matched_iou", "box_weighted_pr", "box_set_f1", "box_salience_iou"]


@pytest.mark.parametrize("name", BOX_REWARDS)
def test_box_reward_without_coord_format_is_nan_with_reason(name):
    r = build_reward(name)
    meta = [{"boxes": [[0, 0, 10, 10]], "image_size": [100, 100]},
            {"boxes": [[0, 0, 10, 10]], "image_size": [100, 100], "coord_format": "absolute"}]
    out = r([answer("[0, 0, 10, 10]")] * 2, None, meta)
    assert math.isnan(out[name][0].item())
    assert out[name][1].item() == pytest.approx(1.0)  # 'absolute' still works when a sample names it
    assert "coord_format" in r.last_info["nan_samples"][0]
    # configured explicitly, the reward-level default applies
    assert build_reward(name, coord_format="absolute")([answer("[0, 0, 10, 10]")], None, meta[:1])[name].item() == \
        pytest.approx(1.0)


def _vlm_config(pretrained: str, rewards: dict | None = None):
    from mmrl.config import load_config

    overrides = [f"model.pretrained={pretrained}"]
    config = load_config("configs/tiny/vlm_grounding.yaml", overrides, check_files=False)
    if rewards is not None:
        config.rewards = rewards
    return config


# ground truth [320, 120, 480, 240] in a 640x480 image, resized for the model to 504x252
GT = [320.0, 120.0, 480.0, 240.0]
SIZES = {"image_size": [640, 480], "input_size": [504, 252]}


def test_build_reward_fn_qwen2_vl_reads_boxes_in_thousandths():
    from mmrl.build import build_reward_fn

    reward = build_reward_fn(_vlm_config("tiny:qwen2_vl"))
    assert reward.components["iou"][0].coord_format == "qwen2"
    # [500, 250, 750, 500] / 1000 * [640, 480] = [320, 120, 480, 240]: IoU 1.
    # [500, 250, 625, 500] -> [320, 120, 400, 240]: IoU = 80*120 / (160*120) = 0.5
    out = reward([answer("[500, 250, 750, 500]"), answer("[500, 250, 625, 500]")], None,
                 [{"boxes": [GT], **SIZES}] * 2)
    assert same(out["iou"], [1.0, 0.5])


def test_build_reward_fn_qwen2_5_vl_reads_boxes_in_input_pixels():
    from mmrl.build import build_reward_fn

    reward = build_reward_fn(_vlm_config("tiny:qwen2_5_vl"))
    assert reward.components["iou"][0].coord_format == "qwen25"
    # x * 640/504, y * 480/252: [252, 63, 378, 126] -> [320, 120, 480, 240] IoU 1;
    # [252, 63, 315, 126] -> [320, 120, 400, 240] IoU 0.5. Read as thousandths it would be far off.
    out = reward([answer("[252, 63, 378, 126]"), answer("[252, 63, 315, 126]")], None,
                 [{"boxes": [GT], **SIZES}] * 2)
    assert same(out["iou"], [1.0, 0.5])


def test_build_reward_fn_reads_the_model_type_of_a_folder(tmp_path):
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    from mmrl.build import build_reward_fn

    Qwen3VLConfig().save_pretrained(tmp_path / "q3")
    Qwen2_5_VLConfig().save_pretrained(tmp_path / "q25")
    assert build_reward_fn(_vlm_config(str(tmp_path / "q3"))).components["iou"][0].coord_format == "qwen2"
    assert build_reward_fn(_vlm_config(str(tmp_path / "q25"))).components["iou"][0].coord_format == "qwen25"
    assert build_reward_fn(_vlm_config("tiny:qwen3_vl")).components["iou"][0].coord_format == "qwen2"


def test_build_reward_fn_keeps_configured_formats_and_walks_routes(tmp_path):
    from mmrl.build import build_reward_fn

    rewards = {
        "iou": {"weight": 1.0, "kwargs": {"coord_format": "absolute"}},
        "f1": {"reward": "box_f1", "weight": 0.5},
        "think_answer_format": 0.5,
        "routed": {"reward": "task_routed", "kwargs": {"routes": {"grounding": {"iou": 1.0}}}},
    }
    reward = build_reward_fn(_vlm_config("tiny:qwen2_vl", rewards))
    assert reward.components["iou"][0].coord_format == "absolute"
    assert reward.components["f1"][0].coord_format == "qwen2"
    assert reward.components["routed"][0].components["iou"].coord_format == "qwen2"
    assert rewards["f1"] == {"reward": "box_f1", "weight": 0.5}  # the config is not modified


def test_build_reward_fn_without_a_known_model_type_sets_no_default(tmp_path):
    from mmrl.build import build_reward_fn

    reward = build_reward_fn(_vlm_config(str(tmp_path / "no-such-model")))
    assert reward.components["iou"][0].coord_format is None
    out = reward([answer("[500, 250, 750, 500]")], None, [{"boxes": [GT], **SIZES}])
    assert math.isnan(out["iou"].item())
    assert "coord_format" in reward.last_info["components"]["iou"]["nan_samples"][0]


# ------------------------------------------------------------------------------------------ box_coordinate


def test_box_coordinate_scores_each_coordinate_and_reports_its_characters():
    # qwen2: 0-1000 units of a 200 x 100 image; predicted [100, 200, 500, 800] -> pixels [20, 20, 100, 80]
    text = "<think>from x 100 to 500, y 200 to 800</think><answer>[100, 200, 500, 800]</answer>"
    meta = {"boxes": [[30, 20, 100, 60]], "image_size": [200, 100], "coord_format": "qwen2"}
    # errors in pixels 10, 0, 0, 20; tolerance 0.25 of the side: 50 px for x, 25 px for y
    expected = {"x1": 1 - 10 / 50, "y1": 1.0, "x2": 1.0, "y2": 1 - 20 / 25}
    for coordinate, value in expected.items():
        reward = build_reward("box_coordinate", coordinate=coordinate)
        scores = reward([text], None, [meta])
        assert scores["box_coordinate"].item() == pytest.approx(value, abs=1e-6)
        written = {"x1": "100", "y1": "200", "x2": "500", "y2": "800"}[coordinate]
        spans = reward.last_info["spans"][0]
        assert [text[a:b] for a, b in spans] == [written, written]  # its number in <think>, then in <answer>
        assert spans[1][0] > text.index("<answer>") and spans[0][1] <= text.index("</think>")
    alone = build_reward("box_coordinate", coordinate="x2", reasoning=False)
    alone([text], None, [meta])
    assert alone.last_info["spans"] == [[(text.index("500, 800]"), text.index("500, 800]") + 3)]]


def test_box_coordinate_picks_the_overlapped_box_clamps_and_counts_failures():
    reward = build_reward("box_coordinate", coordinate="x1", tolerance=0.1, coord_format="absolute")
    meta = {"boxes": [[0, 0, 10, 10], [50, 50, 70, 70]], "image_size": [100, 100]}
    texts = [answer("[52, 50, 70, 70]"),   # the second box: error 2 of 10 px
             answer("[90, 50, 99, 70]"),   # overlaps neither more than the other: the first listed, error 90 -> 0
             answer("no box here"),        # unparseable: 0, no spans
             "[52, 50, 70, 70]"]           # no <answer> block (require_tags): unparseable
    scores = reward(texts, None, [meta] * 4)
    assert same(scores["box_coordinate"], [0.8, 0.0, 0.0, 0.0])
    assert reward.last_info["num_unparseable"] == 2
    assert reward.last_info["spans"][2:] == [None, None] and reward.last_info["spans"][0] is not None
    nan = reward([answer("[1, 2, 3, 4]")], None, [{"boxes": [[0, 0, 5, 5]]}])  # no image_size: NaN, with its reason
    assert math.isnan(nan["box_coordinate"].item()) and "image_size" in reward.last_info["nan_samples"][0]
    with pytest.raises(ValueError, match="coordinate must be one of"):
        build_reward("box_coordinate", coordinate="w")
    with pytest.raises(ValueError, match="tolerance must be > 0"):
        build_reward("box_coordinate", coordinate="x1", tolerance=0)


def test_box_coordinate_spans_follow_the_box_not_other_numbers():
    from mmrl.rewards.grounding import coordinate_spans

    text = '<answer>{"label": "shape 2", "bbox_2d": [7, 8.5, 12, 20]}</answer>'
    (span,) = coordinate_spans(text, [7, 8.5, 12, 20], 1)
    assert text[slice(*span)] == "8.5"
    assert coordinate_spans(text, [1, 2, 3, 4], 0) == []  # not written: no spans (the variant's fallback applies)
    # Qwen2-VL's native pair form, and no tags at all
    assert [text2[a:b] for text2 in ["(1,2),(30,40)"] for a, b in coordinate_spans(text2, [1, 2, 30, 40], 3)] == ["40"]


def test_crop_recall_scores_the_best_crop_and_reports_the_calls():
    reward = build_reward("crop_recall")
    first, second = "<tool>crop(0, 0, 50, 50)</tool>", "<tool>crop(10,10,30,30)</tool>"
    text = f"<think>look</think>{first}\n<observation></observation>\n{second}<answer>[1, 2, 3, 4]</answer>"
    meta = {"boxes": [[20, 20, 60, 60]], "coord_format": "absolute"}
    # crop 1 covers [20, 50]^2 of the 40 x 40 box: 900 / 1600; crop 2 covers [20, 30]^2: 100 / 1600
    scores = reward([text, "<answer>[20, 20, 60, 60]</answer>", "<tool>crop(0, 0)</tool>"], [None] * 3, [meta] * 3)
    assert scores["crop_recall"].tolist() == pytest.approx([0.5625, 0.0, 0.0])
    start = text.index(first)
    assert reward.last_info["spans"][0] == [(start, start + len(first)),
                                            (text.index(second), text.index(second) + len(second))]
    assert reward.last_info["spans"][1] is None and reward.last_info["num_unparseable"] == 2


def test_crop_recall_reads_the_crop_in_the_answers_frame():
    # Qwen2-VL's 0-1000 frame on a 200 x 100 image: crop(0, 0, 500, 1000) is the left half, [0, 100] x [0, 100]
    meta = {"boxes": [[50, 0, 150, 100]], "coord_format": "qwen2", "image_size": [200, 100]}
    scores = build_reward("crop_recall")(["<tool>crop(0, 0, 500, 1000)</tool>"], [None], [meta])
    assert scores["crop_recall"].tolist() == pytest.approx([0.5])
    missing = build_reward("crop_recall")(["<tool>crop(0, 0, 5, 5)</tool>"], [None], [{"boxes": [[0, 0, 1, 1]]}])
    assert math.isnan(float(missing["crop_recall"][0]))  # no coord_format: not judged, never read as pixels


def test_iou_vlm_r1_convention_is_vlm_r1s_training_iou_reward():
    """convention="vlm_r1": qwen_module.py iou_reward written out (first answer block, first whole-number box, its
    inclusive-pixel IoU; anything unreadable 0), on absolute coordinates (its resize is the coord_format rescale)."""
    import re

    def official(content, sol):
        def iou(b1, b2):
            x1, y1 = max(b1[0], b2[0]), max(b1[1], b2[1])
            x2, y2 = min(b1[2] - 1, b2[2] - 1), min(b1[3] - 1, b2[3] - 1)
            inter = (x2 - x1 + 1) * (y2 - y1 + 1) if x1 < x2 and y1 < y2 else 0
            return float(inter) / ((b1[2] - b1[0]) * (b1[3] - b1[1]) + (b2[2] - b2[0]) * (b2[3] - b2[1]) - inter)
        reward = 0.0
        try:
            block = re.search(r"<answer>(.*?)</answer>", content, re.DOTALL)
            if block:
                box = re.search(r"\[(\d+),\s*(\d+),\s*(\d+),\s*(\d+)]", block.group(1).strip())
                if box:
                    reward = iou([int(v) for v in box.groups()], sol)
        except Exception:
            pass
        return reward

    gt = [10, 10, 30, 30]
    answers = ['<answer>{"bbox_2d": [10, 10, 30, 30]}</answer>', "<answer>[12,11,30,31] and [0,0,5,5]</answer>",
               "<answer>[0, 0, 5, 5]</answer><answer>[10, 10, 30, 30]</answer>",  # the FIRST block
               "<answer>[10.5, 10, 30, 30]</answer>", "no tags [10, 10, 30, 30]", "<answer>[29, 10, 40, 30]</answer>",
               "<think>[1, 1, 2, 2]</think><answer>box [15, 15, 25, 25]</answer>"]
    r = build_reward("iou", coord_format="absolute", convention="vlm_r1")
    got = r(answers, None, [{"boxes": [gt]}] * len(answers))["iou"].tolist()
    want = [official(a, gt) for a in answers]
    assert got == pytest.approx(want, abs=1e-6)
    assert want[:3] == pytest.approx([1.0, (18 * 19) / (400 + 18 * 20 - 18 * 19), 0.0])
    assert want[5] == 0.0 and build_reward("iou", coord_format="absolute")(  # 1 px overlap: continuous IoU > 0
        [answers[5]], None, [{"boxes": [gt]}])["iou"].item() > 0
    assert r.last_info["num_unparseable"] == 2  # the float box and the untagged answer
    with pytest.raises(ValueError, match="unknown convention"):
        build_reward("iou", convention="vlm-r1")


def test_temporal_iou_time_r1_convention_is_time_r1s_training_parse():
    """convention="time_r1": main.py parse_timestamp_output written out (the LAST answer block's last
    '<a> to|and <b>', case-insensitive) and iou_timestamp_reward_v2's boundary factors."""
    import re

    def official(content, sol, duration):
        blocks = re.findall(r"<answer>(.*?)</answer>", content, re.DOTALL)
        if not blocks:
            return 0.0
        spans = re.findall(r"(\d+\.?\d*) (to|and) (\d+\.?\d*)", blocks[-1], re.IGNORECASE)
        if not spans:
            return 0.0
        a, b = float(spans[-1][0]), float(spans[-1][2])
        s, e = sol
        iou = max(0, min(b, e) - max(a, s)) / (max(b, e) - min(a, s))
        return iou * (1 - abs(s / duration - a / duration)) * (1 - abs(e / duration - b / duration))

    sol, duration = (2.0, 6.0), 20.0
    answers = ["<answer>2.0 to 6.0</answer>", "<answer>1 to 2</answer><answer>3 TO 7.5</answer>",
               "<answer>from 2 and 5 then 3 to 6</answer>", "<answer>[2.0, 6.0]</answer>", "2.0 to 6.0",
               "<answer>2.0-6.0</answer>"]
    r = build_reward("temporal_iou", boundary_penalty=True, convention="time_r1")
    got = r(answers, None, [{"timestamps": list(sol), "duration": duration}] * len(answers))["temporal_iou"].tolist()
    assert got == pytest.approx([official(a, sol, duration) for a in answers], abs=1e-6)
    assert got[1] == pytest.approx(3 / 5.5 * (1 - 1 / 20) * (1 - 1.5 / 20))  # the last block, "TO" read
    assert got[3:] == [0.0, 0.0, 0.0]  # mmrl's default reads [2.0, 6.0] and 2.0-6.0; Time-R1's parse does not
    assert r.last_info["num_unparseable"] == 3
