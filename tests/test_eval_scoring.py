"""Official benchmark scoring rules (mmrl.eval.scoring), each on a synthetic case worked out by hand.

Every expected number below is computed in the comment next to it, not by the code under test.
"""
from __future__ import annotations

import math

import pytest

from mmrl.eval.scoring import (
    T2I_COMPBENCH_METRICS,
    accuracy_mean,
    blind_control,
    blip_vqa_image_score,
    charades_sta_scores,
    choice_accuracy,
    dpg_answer_score,
    dpg_bench_summary,
    dpg_category,
    dpg_gate,
    dpg_item_score,
    dpg_l1_category,
    dpg_tile_boxes,
    geneval_scores,
    mean_with_count,
    multi_object_f1,
    numeric_accuracy,
    ocr_accuracy,
    ocr_benchmark,
    ocr_target,
    paired_difference,
    rec_scores,
    t2i_category_score,
    t2i_complex_image_score,
    t2i_complex_kind,
    t2i_compbench_summary,
    t2i_position_score,
    t2i_spatial_image_score,
    t2i_spatial_locality,
)
from mmrl.rewards.geneval import Detection

NAN = float("nan")
approx = pytest.approx


# --------------------------------------------------------------------------------------------
# Common
# --------------------------------------------------------------------------------------------


def test_mean_with_count_and_accuracy_mean():
    # mean over judged only: (1 + 0 + 0.5) / 3 = 0.5; None and NaN are unjudged
    m = mean_with_count([1.0, None, 0, NAN, 0.5])
    assert m == {"mean": approx(0.5), "n": 3, "num_unjudged": 2}
    # accuracy_mean: None = unparseable -> 0 kept; NaN = unjudged -> dropped: (1 + 0 + 1) / 3
    a = accuracy_mean([1, None, NAN, True])
    assert a["accuracy"] == approx(2 / 3)
    assert (a["n"], a["num_unparseable"], a["num_unjudged"]) == (3, 1, 1)
    assert math.isnan(mean_with_count([NAN])["mean"])


# --------------------------------------------------------------------------------------------
# GenEval
# --------------------------------------------------------------------------------------------


def test_geneval_summary_scores_by_hand():
    meta_a = {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"}
    rows = (
        # prompt A (metadata as a dict, a fresh equal dict each row): T F T T -> single_object 3/4
        [{"tag": "single_object", "correct": c, "metadata": dict(meta_a)} for c in (True, False, True, True)]
        # counting, prompt B: F F; prompt C: T and one unjudged image -> counting 1/3 (per IMAGE)
        + [{"tag": "counting", "correct": c, "metadata": '{"p": "B"}'} for c in (False, False)]
        + [{"tag": "counting", "correct": c, "metadata": '{"p": "C"}'} for c in (True, NAN)]
        # colors, prompt D: T T -> 1.0
        + [{"tag": "colors", "correct": c, "metadata": '{"p": "D"}'} for c in (1, 1)]
    )
    out = geneval_scores(rows)
    # tags in order of first appearance, as groupby(sort=False)
    assert list(out["per_tag"]) == ["single_object", "counting", "colors"]
    assert out["per_tag"]["single_object"] == approx(0.75)
    assert out["per_tag"]["counting"] == approx(1 / 3)  # per prompt first would give (0 + 1) / 2 = 0.5
    assert out["per_tag"]["colors"] == approx(1.0)
    # overall = mean over the PRESENT tags: (0.75 + 1/3 + 1) / 3 = 0.694444...
    assert out["overall"] == approx((0.75 + 1 / 3 + 1.0) / 3)
    assert out["missing_tags"] == ["two_object", "position", "color_attr"]
    # % correct images: 6 correct of 9 judged
    assert out["image_accuracy"] == approx(6 / 9)
    # % correct prompts (any image correct): A yes, B no, C yes, D yes -> 3/4
    assert out["prompt_accuracy"] == approx(0.75)
    assert out["num_prompts"] == 4
    assert out["num_unjudged"] == 1
    assert out["num_images"] == 10
    assert out["counts"] == {"single_object": 4, "counting": 3, "colors": 2}


def test_geneval_without_prompt_keys_has_no_prompt_accuracy():
    out = geneval_scores([{"tag": "position", "correct": False}, {"tag": "position", "correct": True}])
    assert out["overall"] == approx(0.5)
    assert math.isnan(out["prompt_accuracy"])


# --------------------------------------------------------------------------------------------
# DPG-Bench
# --------------------------------------------------------------------------------------------


def q(item, pid, dep, tup):
    return {"item_id": item, "proposition_id": pid, "dependency": dep, "tuple": tup}


ITEM_X = [
    q("x", 1, "0", "entity - whole (cat)"),
    q("x", 2, "1", "attribute - color (cat, black)"),
    q("x", 3, "2", "attribute - size (cat, small)"),  # chain 1 -> 2 -> 3
    q("x", 4, "0", "relation - spatial (cat, mat, on)"),
    q("x", 5, "1,4", "global (photo)"),
]
#          q1     q2     q3     q4     q5
TILES_X = [
    ["yes", "yes", "yes", "yes", "yes"],  # gated 1 1 1 1 1          -> 5/5 = 1.0
    ["no", "yes", "yes", "yes", "yes"],   # q2<-q1 0, q3<-q2 0 (chain), q5<-q1 0 -> 0 0 0 1 0 = 0.2
    ["yes", "no", "yes", "no", "yes"],    # q3<-q2 0, q5<-q4 0        -> 1 0 0 0 0 = 0.2
    ["yes", "yes", "no", "yes", "Yes"],   # "Yes" != 'yes' (official)  -> 1 1 0 1 0 = 0.6
]
ITEM_Y = [q("y", 1, "0", "entity - whole (dog)"), q("y", 2, "1", "attribute - color (dog, brown)")]
TILES_Y = [
    {1: "yes", 2: "yes"},  # 1.0
    {1: "no", 2: "yes"},   # p2 gated -> 0.0
    {1: "yes", 2: "yes"},  # 1.0
    {1: "yes", 2: "no"},   # 0.5
]


def test_dpg_tiles_and_categories():
    # compute_dpg_one_sample's crop order: TL, TR, BL, BR with R = tile size
    assert dpg_tile_boxes(512) == [(0, 0, 512, 512), (512, 0, 1024, 512), (0, 512, 512, 1024), (512, 512, 1024, 1024)]
    assert dpg_tile_boxes(512, pic_num=1) == [(0, 0, 512, 512)]
    assert dpg_category("entity - whole (cat)") == "entity - whole"
    assert dpg_l1_category("entity - whole") == "entity"
    assert dpg_l1_category("global") == "global"
    assert dpg_answer_score("yes") == 1.0 and dpg_answer_score("Yes") == 0.0 and dpg_answer_score("no") == 0.0
    assert dpg_answer_score("Yes.", exact=False) == 1.0
    assert math.isnan(dpg_answer_score(None))


def test_dpg_gating_is_in_place_in_question_order():
    # q1 depends on q2 (later), q2 on q3, q3 none; raw 1, 1, 0.
    # Official order: q1 reads q2 = 1 (not yet gated) -> stays 1; q2 reads q3 = 0 -> 0; q3 stays 0.
    gated = dpg_gate({1: 1.0, 2: 1.0, 3: 0.0}, {1: [2], 2: [3], 3: [0]})
    assert gated == {1: 1.0, 2: 0.0, 3: 0.0}
    # forward chain in order: q2 <- q1 (0) -> 0, then q3 <- q2 (now 0) -> 0
    assert dpg_gate({1: 0.0, 2: 1.0, 3: 1.0}, {1: [0], 2: [1], 3: [2]}) == {1: 0.0, 2: 0.0, 3: 0.0}
    with pytest.raises(KeyError):
        dpg_gate({2: 1.0}, {2: [1]})


def test_dpg_item_scores_by_hand():
    x = dpg_item_score(ITEM_X, TILES_X)
    assert x["tile_scores"] == approx([1.0, 0.2, 0.2, 0.6])
    assert x["score"] == approx(0.5)  # (1 + 0.2 + 0.2 + 0.6) / 4
    # documented rule: gated score averaged over the 4 tiles
    assert x["question_scores"] == approx({1: 0.75, 2: 0.5, 3: 0.25, 4: 0.75, 5: 0.25})
    # official quirk: ungated scores of the LAST tile only
    xq = dpg_item_score(ITEM_X, TILES_X, official_quirks=True)
    assert xq["score"] == approx(0.5)
    assert xq["question_scores"] == {1: 1.0, 2: 1.0, 3: 0.0, 4: 1.0, 5: 0.0}
    # a judge that writes "Yes": with exact_answers=False tile 4 is 1 1 0 1 1 = 0.8 -> (1+.2+.2+.8)/4 = 0.55
    assert dpg_item_score(ITEM_X, TILES_X, exact_answers=False)["score"] == approx(0.55)
    y = dpg_item_score(ITEM_Y, TILES_Y)
    assert y["tile_scores"] == approx([1.0, 0.0, 1.0, 0.5])
    assert y["score"] == approx(0.625)
    assert y["question_scores"] == approx({1: 0.75, 2: 0.5})


def test_dpg_summary_both_modes():
    items = [(ITEM_X, TILES_X), (ITEM_Y, TILES_Y)]
    plain = dpg_bench_summary(items)
    assert plain["score"] == approx(56.25)  # 100 * (0.5 + 0.625) / 2
    # L2 pooled over items: entity - whole (0.75, 0.75); attribute - color (0.5, 0.5); size 0.25; ...
    assert plain["l2"] == approx({
        "attribute - color": 50.0, "attribute - size": 25.0, "entity - whole": 75.0,
        "global": 25.0, "relation - spatial": 75.0,
    })
    assert list(plain["l2"]) == sorted(plain["l2"])
    # L1: attribute pools (0.5, 0.5, 0.25) -> 41.666...
    assert plain["l1"] == approx({"attribute": 125 / 3, "entity": 75.0, "global": 25.0, "relation": 75.0})
    quirks = dpg_bench_summary(items, official_quirks=True)
    assert quirks["score"] == approx(56.25)  # the item score is the same in both modes
    # last tile ungated: x = (1, 1, 0, 1, 0), y = (1, 0)
    assert quirks["l2"] == approx({
        "attribute - color": 50.0, "attribute - size": 0.0, "entity - whole": 100.0,
        "global": 0.0, "relation - spatial": 100.0,
    })
    assert quirks["l1"] == approx({"attribute": 100 / 3, "entity": 100.0, "global": 0.0, "relation": 100.0})
    assert quirks["official_quirks"] is True and plain["num_scored"] == 2
    # precomputed item results give the same summary
    again = dpg_bench_summary([dpg_item_score(ITEM_X, TILES_X), dpg_item_score(ITEM_Y, TILES_Y)])
    assert again["score"] == approx(56.25) and again["l2"] == approx(plain["l2"])


def test_dpg_missing_parent_and_unjudged():
    # the loader's first-row quirk removed proposition 1; proposition 2 still depends on it
    item_z = [q("z", 2, "1", "attribute - color (a, b)"), q("z", 3, "0", "entity - whole (c)")]
    tiles_z = [{2: "yes", 3: "yes"}] * 4
    failed = dpg_item_score(item_z, tiles_z, official_quirks=True)
    assert failed["failed"] and math.isnan(failed["score"])
    with pytest.raises(ValueError, match="proposition 1"):
        dpg_item_score(item_z, tiles_z)
    # one tile's judge failed -> unjudged
    tiles_bad = [dict(t) for t in TILES_Y]
    tiles_bad[2][2] = None
    unj = dpg_item_score(ITEM_Y, tiles_bad)
    assert unj["unjudged"] and math.isnan(unj["score"])
    s = dpg_bench_summary([(ITEM_X, TILES_X), (item_z, tiles_z), (ITEM_Y, tiles_bad)], official_quirks=True)
    assert s["score"] == approx(50.0)  # only x is scored
    assert (s["num_items"], s["num_scored"], s["num_failed"], s["num_unjudged"]) == (3, 1, 1, 1)


# --------------------------------------------------------------------------------------------
# T2I-CompBench
# --------------------------------------------------------------------------------------------


def test_blip_vqa_product():
    assert T2I_COMPBENCH_METRICS["color"] == "blip_vqa" and T2I_COMPBENCH_METRICS["complex"] == "3_in_1"
    assert blip_vqa_image_score([0.9, 0.8]) == approx(0.72)
    # only np_num=8 phrases are asked: 0.5 ** 8, the 9th is ignored
    assert blip_vqa_image_score([0.5] * 9) == approx(0.00390625)
    assert blip_vqa_image_score([]) == 1.0  # no noun phrase: every index counts 1
    # official number formats: 0.33333 -> '0.3333', 0.66666 -> '0.6667'; product 0.22221... -> '0.2222'
    assert blip_vqa_image_score([0.33333, 0.66666], official_quirks=True) == 0.2222
    assert blip_vqa_image_score([0.33333, 0.66666]) == approx(0.33333 * 0.66666, abs=1e-12)
    assert math.isnan(blip_vqa_image_score([0.5, NAN]))


def test_spatial_locality_vocabulary_order():
    assert t2i_spatial_locality("a girl on the left of a dog") == "on the left of"
    # 'next to' comes before 'near' in the vocabulary
    assert t2i_spatial_locality("a cat near a dog next to a tree") == "next to"
    assert t2i_spatial_locality("a book on top of a table") == "on top of"
    assert t2i_spatial_locality("a red apple") is None


def test_position_score_each_relation():
    a = [0, 0, 100, 100]          # centre (50, 50)
    right = [200, 0, 300, 100]    # centre (250, 50): dx = +200, dy = 0, IoU 0
    assert t2i_position_score("on the left of", a, right) == 1.0
    assert t2i_position_score("on the right of", a, right) == 0.0
    assert t2i_position_score("on the right of", right, a) == 1.0
    assert t2i_position_score("on the top of", a, right) == 0.0
    # near: |dy| = 0 < 150 is enough ("or")
    assert t2i_position_score("near", a, right) == 1.0
    # diagonal (250, 250): dx = dy = 200 -> near = 150 / 200; left needs |dx| > |dy| strictly -> 0
    diag = [200, 200, 300, 300]
    assert t2i_position_score("next to", a, diag) == approx(0.75)
    assert t2i_position_score("on side of", a, diag) == approx(0.75)
    assert t2i_position_score("on the left of", a, diag) == 0.0
    # overlapping: inter 50*100 = 5000, union 15000, IoU 1/3 >= 0.1 -> 0.1 / (1/3) = 0.3
    assert t2i_position_score("on the left of", a, [50, 0, 150, 100]) == approx(0.3)
    below = [0, 300, 100, 400]    # centre (50, 350): dy = +300
    assert t2i_position_score("on the top of", a, below) == 1.0
    assert t2i_position_score("on the bottom of", a, below) == 0.0
    assert t2i_position_score("on the bottom of", below, a) == 1.0
    # 'on top of' falls through to 0 in the official code; read as 'on the top of' otherwise
    assert t2i_position_score("on top of", a, below, official_quirks=True) == 0.0
    assert t2i_position_score("on top of", a, below) == 1.0
    assert t2i_position_score(None, a, below) == 0.0
    assert t2i_position_score("on the left of", {"x_min": 0, "y_min": 0, "x_max": 100, "y_max": 100}, right) == 1.0


def test_spatial_image_score():
    dets = [
        ("dog", 0.9, [200, 0, 300, 100]),
        Detection(label="person", score=0.8, box=(0, 0, 100, 100)),  # first person: taken
        {"label": "person", "score": 0.6, "box": [250, 0, 350, 100]},
    ]
    # girl -> person (0.8, left of the dog): 0.25*0.8 + 0.25*0.9 + 0.5*1 = 0.925
    assert t2i_spatial_image_score("on the left of", "girl", "dog", dets) == approx(0.925)
    # wrong side: 0.2 + 0.225 + 0 = 0.425 < 0.5 -> 0
    assert t2i_spatial_image_score("on the right of", "girl", "dog", dets) == 0.0
    # one object only: 0.25 * 0.9 = 0.225 < 0.5 -> 0
    assert t2i_spatial_image_score("on the left of", "cat", "dog", dets) == 0.0
    assert t2i_spatial_image_score("on the left of", None, None, dets) == 0.0
    # near with overlap-free boxes 200 px apart horizontally, |dy| = 0: 0.2 + 0.225 + 0.5 = 0.925
    assert t2i_spatial_image_score("near", "man", "dog", dets) == approx(0.925)


def test_complex_3_in_1():
    spatial = ["A cat on top of a table.\r\n"]
    action = ["A man riding a horse.\r\n"]
    assert t2i_complex_kind("a cat on top of a table", spatial, action) == "spatial"
    assert t2i_complex_kind("A man riding a horse. Sunny day", spatial, action) == "action"
    assert t2i_complex_kind("a blue bird singing on a branch", spatial, action) == "all"
    # blip 0.6, unidet 0.8, clip 0.3
    assert t2i_complex_image_score("spatial", 0.6, 0.8, 0.3) == approx(0.7)
    assert t2i_complex_image_score("action", 0.6, 0.8, 0.3) == approx(0.45)
    assert t2i_complex_image_score("all", 0.6, 0.8, 0.3) == approx(1.7 / 3)
    with pytest.raises(ValueError):
        t2i_complex_image_score("other", 0.6, 0.8, 0.3)


def test_t2i_category_means():
    assert t2i_category_score([0.5, NAN, 0.7]) == {"score": approx(0.6), "n": 2, "num_unjudged": 1}
    s = t2i_compbench_summary({"non_spatial": [0.30, 0.32], "spatial": [0.0, 0.925]})
    assert s["non_spatial"]["score"] == approx(0.31) and s["non_spatial"]["metric"] == "clipscore"
    assert s["spatial"]["score"] == approx(0.4625) and s["spatial"]["metric"] == "unidet"


# --------------------------------------------------------------------------------------------
# OCR
# --------------------------------------------------------------------------------------------


def test_ocr_rules():
    assert ocr_target('a neon sign that says "Open Late" over a door') == "Open Late"
    assert ocr_accuracy("Hello World", "hello world") == 1.0
    assert ocr_accuracy("SALE: HELLO WORLD!!!", "Hello World") == 1.0  # target is a substring
    assert ocr_accuracy("helo", "hello") == approx(0.8)  # 1 edit / 5
    assert ocr_accuracy("", "abc") == 0.0  # 3 edits / 3
    assert ocr_accuracy("xyzxyzxyzxyz", "ab") == 0.0  # distance 12 capped at len 2
    out = ocr_benchmark([1.0, 0.8, NAN, 0.0])
    assert out["accuracy"] == approx(0.6)  # 1.8 / 3
    assert out["accuracy_failed_as_zero"] == approx(0.45)  # 1.8 / 4 (Flow-GRPO: a failure scores 0)
    assert (out["n"], out["num_unjudged"]) == (3, 1)


# --------------------------------------------------------------------------------------------
# Grounding and answers
# --------------------------------------------------------------------------------------------


def test_rec_acc_is_strict():
    gt = [0, 0, 10, 10]
    preds = [[0, 0, 10, 10], [0, 0, 10, 5], [0, 0, 10, 6], None, [0, 0, 5, 5], [5, 5, 15, 15]]
    gts = [gt, gt, gt, gt, None, gt]
    out = rec_scores(preds, gts)
    # IoUs: 1, 0.5 (NOT > 0.5), 0.6, 0 (unparseable), unjudged, 25/175 = 1/7
    assert out["ious"][:4] == approx([1.0, 0.5, 0.6, 0.0]) and math.isnan(out["ious"][4])
    assert out["ious"][5] == approx(1 / 7)
    assert out["acc@0.5"] == approx(2 / 5)
    assert out["miou"] == approx((1 + 0.5 + 0.6 + 0 + 1 / 7) / 5)
    assert (out["n"], out["num_unparseable"], out["num_unjudged"]) == (5, 1, 1)


def test_multi_object_f1():
    a, b, far = [0, 0, 10, 10], [20, 20, 30, 30], [50, 50, 60, 60]
    preds = [[a, far], [a], None, [], [a]]
    gts = [[a, b], [a], [a], [], None]
    out = multi_object_f1(preds, gts)
    # per sample f1: 2*1/4 = 0.5; 1; 0 (unparseable); 1 (both empty); unjudged
    assert out["f1"] == approx((0.5 + 1 + 0 + 1) / 4)
    assert out["precision"] == approx(0.625) and out["recall"] == approx(0.625)
    # pooled: TP = 2, pred = 2 + 1 + 0 + 0 = 3, gt = 2 + 1 + 1 + 0 = 4
    assert out["micro_f1"] == approx(4 / 7)
    assert out["micro_precision"] == approx(2 / 3) and out["micro_recall"] == approx(0.5)
    assert (out["n"], out["num_unparseable"], out["num_unjudged"]) == (4, 1, 1)


def test_charades_sta_both_conventions():
    preds = [[0, 5], [10, 20], None, [7, 17], [25, 30], [8, 2]]
    gts = [[0, 10], [10, 30], [0, 10], [0, 10], [25, 30], [0, 10]]
    durations = [30, 20, 30, 30, 20, 30]
    out = charades_sta_scores(preds, gts, durations)
    # clipped GT: #2 -> [10, 20] (tIoU 1), #5 -> [25, 20] empty -> unjudged
    # tIoUs: 0.5, 1, 0 (unparseable), 3/17, -, 0 (reversed prediction)
    assert out["tious"][:4] == approx([0.5, 1.0, 0.0, 3 / 17]) and math.isnan(out["tious"][4])
    assert out["r1@0.3"] == approx(2 / 5)  # 0.5 and 1
    assert out["r1@0.5"] == approx(1 / 5)  # 0.5 is not > 0.5
    assert out["r1@0.7"] == approx(1 / 5)
    assert out["miou"] == approx((0.5 + 1 + 0 + 3 / 17 + 0) / 5)
    assert (out["n"], out["num_unparseable"], out["num_unjudged"], out["num_gt_clipped"]) == (5, 1, 1, 2)
    # TimeZero's evaluate.py: no clipping, iou >= threshold
    tz = charades_sta_scores(preds, gts, durations, clip_gt_to_duration=False, strict=False)
    # tIoUs: 0.5, 10/20 = 0.5, 0, 3/17, 1, 0
    assert tz["r1@0.3"] == approx(3 / 6)
    assert tz["r1@0.5"] == approx(3 / 6)
    assert tz["r1@0.7"] == approx(1 / 6)
    assert tz["miou"] == approx((0.5 + 0.5 + 0 + 3 / 17 + 1 + 0) / 6)
    assert (tz["n"], tz["num_gt_clipped"]) == (6, 0)


def test_choice_and_numeric_accuracy():
    c = choice_accuracy(["B", "a", None, "C"], ["B", "A", "A", None])
    assert c["accuracy"] == approx(2 / 3)  # 1, 1, 0 (unparseable); the last is unjudged
    assert (c["n"], c["num_unparseable"], c["num_unjudged"]) == (3, 1, 1)
    n = numeric_accuracy([3.0, 2.5, None, 1e-10, 4], [3, 2.4, 7, 0, NAN])
    # 1, 0, 0 (unparseable), |1e-10| <= abs_tol 1e-9 -> 1; NaN GT unjudged -> 2/4
    assert n["accuracy"] == approx(0.5)
    assert (n["n"], n["num_unparseable"], n["num_unjudged"]) == (4, 1, 1)


# --------------------------------------------------------------------------------------------
# Blind control
# --------------------------------------------------------------------------------------------


def test_blind_control_paired_difference():
    real = [
        {"id": "a", "acc": 1.0, "iou": 0.8, "reason": "ok"},
        {"id": "b", "acc": 0.0, "iou": 0.4},
        {"id": "c", "acc": 1.0, "iou": NAN},
        {"id": "d", "acc": 1.0, "iou": 0.9},
    ]
    blind = [
        {"id": "b", "acc": 0.0, "iou": 0.1},
        {"id": "a", "acc": 0.0, "iou": 0.2},
        {"id": "c", "acc": 1.0, "iou": 0.3},
        {"id": "e", "acc": 1.0, "iou": 0.5},
    ]
    out = blind_control(real, blind)
    assert out["num_unpaired"] == 2  # d and e
    assert sorted(out["metrics"]) == ["acc", "iou"]
    acc = out["metrics"]["acc"]
    # pairs a, b, c: diffs 1, 0, 0 -> delta 1/3; sd (ddof 1) = sqrt(1/3), se = sqrt(1/3)/sqrt(3) = 1/3
    assert (acc["real"], acc["blind"]) == (approx(2 / 3), approx(1 / 3))
    assert acc["delta"] == approx(1 / 3) and acc["delta_se"] == approx(1 / 3)
    assert acc["n_pairs"] == 3
    iou = out["metrics"]["iou"]
    # c dropped (NaN): diffs 0.6, 0.3 -> delta 0.45; sd = 0.3/sqrt(2), se = 0.15
    assert iou["delta"] == approx(0.45) and iou["delta_se"] == approx(0.15)
    assert (iou["real"], iou["blind"], iou["n_pairs"], iou["num_dropped"]) == (approx(0.6), approx(0.15), 2, 1)
    # by position, one metric
    p = paired_difference([1, 0], [0, 0])
    assert p["delta"] == approx(0.5) and p["n_pairs"] == 2
    assert math.isnan(paired_difference([1], [0])["delta_se"])
    pos = blind_control(real[:2], blind[:2], metrics=["acc"], key=None)
    assert pos["metrics"]["acc"]["delta"] == approx(0.5)  # (1-0) and (0-0) paired by position


def test_dpg_item_objects_are_read_by_attribute():
    # the loader's shape (mmrl.eval.benchmarks.DPGItem / DPGQuestion): attributes, ``tuple_``, int tuples
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Question:
        proposition_id: int
        dependency: tuple
        tuple_: str

    @dataclass(frozen=True)
    class Item:
        item_id: str
        questions: tuple

    item = Item("y", tuple(Question(int(r["proposition_id"]), (int(r["dependency"]),), r["tuple"]) for r in ITEM_Y))
    out = dpg_item_score(item, TILES_Y)
    assert out["item_id"] == "y" and out["score"] == approx(0.625)
    assert out["categories"] == {1: "entity - whole", 2: "attribute - color"}
