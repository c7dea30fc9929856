"""GenEval reward (mmrl.rewards.geneval): the rule engine on hand-made detections (no model), the Mask2Former
post-processing and the CLIP colour classifier against independent computations, and the full reward with
tiny random models built from config (thresholds, per-class caps, counting, positions, NaN handling)."""
from __future__ import annotations

import json
import math
import string

import numpy as np
import pytest
import torch

from fixtures import tiny_mask2former as build_tiny_mask2former
import torch.nn.functional as F
from PIL import Image

from mmrl.rewards import MissingWeightsError, build_reward
from mmrl.rewards.geneval import (
    COLORS,
    GENEVAL_CLASSES,
    ClipColorClassifier,
    Detection,
    GenEval,
    Mask2FormerDetector,
    canonical_class,
    check_geneval_metadata,
    color_crop,
    compute_iou,
    evaluate_geneval,
    flow_grpo_geneval_score,
    geneval_summary,
    mask_to_box,
    relative_position,
    select_detections,
)

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def det(label, score=0.99, box=(0, 0, 10, 10), mask=None):
    return Detection(label=label, score=score, box=tuple(float(v) for v in box), mask=mask)


def objs(**counts):
    """class -> that many confident detections, spread left to right."""
    return {name.replace("_", " "): [det(name.replace("_", " "), 0.99 - 0.01 * k, (20 * k, 0, 20 * k + 10, 10))
                                     for k in range(n)] for name, n in counts.items()}


def fixed_colors(mapping):
    """A colour classifier naming each object by its box's x1 (dict x1 -> colour)."""
    def classify(classname, objects):
        return [mapping.get(o.box[0], "black") for o in objects]
    return classify


# --------------------------------------------------------------------------------------------
# relative position, IoU (hand-worked)
# --------------------------------------------------------------------------------------------


def test_relative_position_hand_worked():
    # centres (5, 5) and (25, 5): offset (-20, 0); revised |offset| - 0.1 * (10 + 10) = 18 -> dx = -0.9
    assert relative_position((0, 0, 10, 10), (20, 0, 30, 10)) == {"left of"}
    assert relative_position((20, 0, 30, 10), (0, 0, 10, 10)) == {"right of"}
    # diagonal: revised (-18, -18) / 28.28 = -0.636 each: left of and above (y grows downwards)
    assert relative_position((0, 0, 10, 10), (20, 20, 30, 30)) == {"left of", "above"}
    assert relative_position((20, 20, 30, 30), (0, 0, 10, 10)) == {"right of", "below"}
    # offset (-20, -10): revised (-18, -8) / 22.36 = (-0.805, -0.358): only left of
    assert relative_position((0, 0, 10, 10), (20, 10, 30, 20)) == {"left of"}
    # offset (-1, 0) is inside the 0.1 * (10 + 10) = 2 dead zone: no relation
    assert relative_position((0, 0, 10, 10), (1, 0, 11, 10)) == set()
    # large boxes: offset 30 with dims 100 + 100: 30 - 20 = 10 -> dx = 10/30 = 0.33 < 0.5: none
    assert relative_position((0, 0, 100, 100), (30, 0, 130, 100)) == set()
    # position_threshold is used: with 0 the same pair is "left of"
    assert relative_position((0, 0, 100, 100), (30, 0, 130, 100), position_threshold=0.0) == {"left of"}
    # float32 as the official code on mmdet's float32 boxes: offset (322.5, 447.5), revised (275.8, 445.4) over
    # 551.6 -> dx exactly 0.5 in float32 (not > 0.5: no "right of"), 0.50000005 in float64
    assert relative_position((323, 447, 556, 458), (0, 0, 234, 10)) == {"below"}


def test_compute_iou_uses_inclusive_pixels():
    # areas 11*11 = 121 each, intersection 6*11 = 66: 66 / (242 - 66)
    assert compute_iou((0, 0, 10, 10), (5, 0, 15, 10)) == pytest.approx(66 / 176)
    assert compute_iou((0, 0, 10, 10), (20, 20, 30, 30)) == 0.0
    assert compute_iou((0, 0, 10, 10), (0, 0, 10, 10)) == 1.0


def test_canonical_class_maps_detector_spellings():
    assert canonical_class("mouse") == "computer mouse"
    assert canonical_class("remote") == "tv remote"
    assert canonical_class("Keyboard") == "computer keyboard"
    assert canonical_class("potted_plant") == "potted plant"
    assert canonical_class("cat") == "cat"
    assert len(GENEVAL_CLASSES) == 80 and len(set(GENEVAL_CLASSES)) == 80


# --------------------------------------------------------------------------------------------
# detection filtering
# --------------------------------------------------------------------------------------------


def test_select_detections_thresholds_sorting_and_cap():
    dets = [det("cat", s) for s in (0.3, 0.31, 0.95, 0.5, 0.89, 0.9, 0.91)] + [det("mouse", 0.8)]
    kept = select_detections(dets, tag="single_object")
    # strictly above 0.3, most confident first; "mouse" mapped to GenEval's name
    assert [d.score for d in kept["cat"]] == [0.95, 0.91, 0.9, 0.89, 0.5, 0.31]
    assert [d.label for d in kept["computer mouse"]] == ["mouse"]
    counting = select_detections(dets, tag="counting")
    assert [d.score for d in counting["cat"]] == [0.95, 0.91]  # strictly above 0.9
    assert "computer mouse" not in counting  # classes with no kept detection are absent
    many = [det("dog", 0.4 + 0.01 * k) for k in range(30)]
    capped = select_detections(many, max_objects=16)["dog"]
    assert len(capped) == 16 and capped[0].score == pytest.approx(0.69) and capped[-1].score == pytest.approx(0.54)
    assert len(select_detections(many, max_objects=5)["dog"]) == 5


def test_select_detections_tie_order_and_float32_threshold_as_official():
    """evaluate_images.py: ``np.argsort(scores)[::-1]`` per class (equal scores: the later detector output first)
    and ``scores > threshold`` on float32 arrays (a float32 score of exactly 0.3 is not above 0.3)."""
    tied = [det("cat", 0.5, (0, 0, 10, 10)), det("cat", 0.5, (20, 0, 30, 10)), det("cat", 0.7, (40, 0, 50, 10)),
            det("cat", 0.5, (60, 0, 70, 10))]
    kept = select_detections(tied)["cat"]
    # argsort([.5, .5, .7, .5]) = [0, 1, 3, 2] (stable for short arrays); reversed: 2, 3, 1, 0
    assert [d.box[0] for d in kept] == [40.0, 60.0, 20.0, 0.0]
    assert len(select_detections(tied, max_objects=2)["cat"]) == 2
    assert [d.box[0] for d in select_detections(tied, max_objects=2)["cat"]] == [40.0, 60.0]
    at = float(np.float32(0.3))  # what a float32 detector score of 0.3 reads as in Python: 0.30000001192...
    assert at > 0.3  # a float64 comparison would keep it
    assert "cat" not in select_detections([det("cat", at)])
    assert len(select_detections([det("cat", 0.3000001)])["cat"]) == 1
    assert "cat" not in select_detections([det("cat", float(np.float32(0.9)))], tag="counting")


def test_select_detections_optional_nms():
    dets = [det("cat", 0.9, (0, 0, 10, 10)), det("cat", 0.8, (1, 0, 11, 10)), det("cat", 0.7, (50, 50, 60, 60))]
    assert len(select_detections(dets)["cat"]) == 3  # GenEval default: max_overlap 1.0, no NMS
    kept = select_detections(dets, max_overlap=0.5)["cat"]
    assert [d.score for d in kept] == [0.9, 0.7]


# --------------------------------------------------------------------------------------------
# the rules
# --------------------------------------------------------------------------------------------


def test_single_and_two_object():
    single = {"tag": "single_object", "include": [{"class": "cat", "count": 1}]}
    assert evaluate_geneval(objs(cat=1), single).correct
    r = evaluate_geneval(objs(dog=2), single)
    assert not r.correct and r.clauses == [False] and "expected cat>=1, found 0" in r.reasons[0]
    two = {"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}]}
    assert evaluate_geneval(objs(cat=1, dog=3), two).correct
    r = evaluate_geneval(objs(cat=1), two)
    assert not r.correct and r.clauses == [True, False] and r.partial == 0.5


def test_counting_means_exactly_n():
    meta = {"tag": "counting", "include": [{"class": "cat", "count": 3}], "exclude": [{"class": "cat", "count": 4}]}
    assert evaluate_geneval(objs(cat=3), meta).correct
    too_few = evaluate_geneval(objs(cat=2), meta)
    assert not too_few.correct and too_few.clauses == [False, True]
    too_many = evaluate_geneval(objs(cat=4), meta)
    assert not too_many.correct and too_many.clauses == [True, False] and "expected cat<4, found 4" in too_many.reasons
    assert too_many.partial == 0.5


def test_colors_checks_the_count_most_confident_objects():
    meta = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
    # objects at x1 = 0, 20, 40 (most confident first); only the first is checked for count=1
    assert evaluate_geneval(objs(car=3), meta, fixed_colors({0: "red", 20: "blue"})).correct
    r = evaluate_geneval(objs(car=3), meta, fixed_colors({0: "blue", 20: "red"}))
    assert not r.correct and "expected red car>=1, found 0 red" in r.reasons[0] and "1 blue" in r.reasons[0]
    two_red = {"tag": "color_attr", "include": [{"class": "car", "count": 2, "color": "red"}]}
    assert not evaluate_geneval(objs(car=2), two_red, fixed_colors({0: "red", 20: "green"})).correct
    assert evaluate_geneval(objs(car=2), two_red, fixed_colors({0: "red", 20: "red"})).correct
    with pytest.raises(ValueError, match="colour classifier"):
        evaluate_geneval(objs(car=1), meta)


def test_colour_classifier_sees_only_the_count_objects():
    seen = []

    def classify(classname, objects):
        seen.append((classname, len(objects)))
        return ["red"] * len(objects)

    meta = {"include": [{"class": "mouse", "count": 2, "color": "red"}]}
    assert evaluate_geneval({"mouse": [det("mouse")] * 5}, meta, classify).correct
    assert seen == [("computer mouse", 2)]


def test_position_against_the_target_clause():
    meta = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                           {"class": "cat", "count": 1, "position": ["left of", 0]}]}
    objects = {"dog": [det("dog", box=(60, 0, 70, 10))], "cat": [det("cat", box=(0, 0, 10, 10))]}
    assert evaluate_geneval(objects, meta).correct
    swapped = {"dog": [det("dog", box=(0, 0, 10, 10))], "cat": [det("cat", box=(60, 0, 70, 10))]}
    r = evaluate_geneval(swapped, meta)
    assert not r.correct and r.clauses == [True, False]
    assert "expected cat left of target, found right of" in r.reasons[0]
    # the target clause failed: "no target"
    r = evaluate_geneval({"cat": [det("cat")]}, meta)
    assert r.clauses == [False, False] and "no target for cat to be left of" in r.reasons[1]
    # every object must relate to every matched target object
    two_dogs = {"include": [{"class": "dog", "count": 2}, {"class": "cat", "count": 1, "position": ["left of", 0]}]}
    objects = {"dog": [det("dog", box=(60, 0, 70, 10)), det("dog", 0.9, box=(-60, 0, -50, 10))],
               "cat": [det("cat", box=(0, 0, 10, 10))]}
    assert not evaluate_geneval(objects, two_dogs).correct


def test_position_counts_on_color_failure():
    # a colour failure leaves the clause unmatched and its position unchecked; the next clause then has no target
    meta = {"include": [{"class": "dog", "count": 1, "color": "red"},
                        {"class": "cat", "count": 1, "position": ["right of", 0]}]}
    objects = {"dog": [det("dog", box=(0, 0, 10, 10))], "cat": [det("cat", box=(60, 0, 70, 10))]}
    r = evaluate_geneval(objects, meta, fixed_colors({0: "blue"}))
    assert r.clauses == [False, False] and any("no target" in x for x in r.reasons)
    r = evaluate_geneval(objects, meta, fixed_colors({0: "red"}))
    assert r.correct and r.partial == 1.0


def test_flow_grpo_graded_score_hand_worked():
    """Flow-GRPO's training score (reward server ``evaluate_reward``), worked by hand from its rules: per include
    clause ``1 - |count - n| / count`` over all kept detections, a 0 more for a colour / position clause whose count
    is wrong, the colour's ``1 - |count - hits| / count``, and for a position a 0 at a failing pair then a 1."""
    counting = {"tag": "counting", "include": [{"class": "cat", "count": 3}], "exclude": [{"class": "cat", "count": 4}]}
    assert flow_grpo_geneval_score(objs(cat=3), counting) == (True, 1.0)
    assert flow_grpo_geneval_score(objs(cat=2), counting) == (False, pytest.approx(2 / 3))
    assert flow_grpo_geneval_score(objs(cat=5), counting) == (False, pytest.approx(1 / 3))  # exclude not read
    single = {"tag": "single_object", "include": [{"class": "cat", "count": 1}]}
    assert flow_grpo_geneval_score(objs(cat=3), single) == (False, -1.0)  # GenEval's verdict: correct
    assert evaluate_geneval(objs(cat=3), single).correct
    colour = {"tag": "colors", "include": [{"class": "cat", "count": 1, "color": "red"}]}
    assert flow_grpo_geneval_score(objs(cat=2), colour, fixed_colors({0: "red"})) == (False, 0.0)  # [0, 0]
    assert flow_grpo_geneval_score(objs(cat=1), colour, fixed_colors({0: "red"})) == (True, 1.0)  # [1, 1]
    assert flow_grpo_geneval_score(objs(cat=1), colour, fixed_colors({0: "blue"})) == (False, 0.5)  # [1, 0]
    two_red = {"tag": "color_attr", "include": [{"class": "car", "count": 2, "color": "red"}]}
    assert flow_grpo_geneval_score(objs(car=2), two_red, fixed_colors({0: "red"})) == (False, 0.75)  # [1, 0.5]
    position = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                               {"class": "cat", "count": 1, "position": ["left of", 0]}]}
    right = {"dog": [det("dog", box=(60, 0, 70, 10))], "cat": [det("cat", box=(0, 0, 10, 10))]}
    wrong = {"dog": [det("dog", box=(0, 0, 10, 10))], "cat": [det("cat", box=(60, 0, 70, 10))]}
    assert flow_grpo_geneval_score(right, position) == (True, 1.0)  # [1, 1, 1]
    assert flow_grpo_geneval_score(wrong, position) == (False, 0.75)  # [1, 1, 0, 1]: the anchor's 1 after its 0
    assert flow_grpo_geneval_score({"cat": [det("cat")]}, position) == (False, 1 / 3)  # [0, 1, 0]: no target
    two_dogs = {"dog": [det("dog", box=(60, 0, 70, 10)), det("dog", 0.9, box=(70, 0, 80, 10))],
                "cat": [det("cat", box=(0, 0, 10, 10))]}
    assert flow_grpo_geneval_score(two_dogs, position) == (False, 1 / 3)  # [0, 1, 0]: 2 dogs for 1, then no target
    assert flow_grpo_geneval_score({}, {"exclude": [{"class": "cat", "count": 1}]}) == (True, 0.0)
    with pytest.raises(ValueError, match="colour classifier"):
        flow_grpo_geneval_score(objs(cat=1), colour)


def test_metadata_validation():
    assert check_geneval_metadata({"include": [{"class": "cat", "count": 1}]}) is None
    bad = [
        None, "cat", {}, {"include": []}, {"include": [{"count": 1}]}, {"include": [{"class": "cat", "count": 0}]},
        {"include": [{"class": "cat", "count": 1, "color": "teal"}]},
        {"include": [{"class": "cat", "count": 1, "position": ["left of", 0]}]},  # no earlier clause
        {"include": [{"class": "a", "count": 1}, {"class": "b", "count": 1, "position": ["near", 0]}]},
        {"include": [{"class": "cat", "count": 1}], "tag": 3},
    ]
    for meta in bad:
        assert isinstance(check_geneval_metadata(meta), str), meta
    with pytest.raises(ValueError):
        evaluate_geneval({}, {"include": []})


def test_summary_is_the_mean_of_tag_accuracies():
    tags = ["single_object"] * 4 + ["counting"] * 2 + ["position"] * 1
    correct = [1, 1, 1, 0, 1, 0, 0]
    s = geneval_summary(tags, correct)
    assert s["per_tag"] == {"single_object": 0.75, "counting": 0.5, "position": 0.0}
    assert s["overall"] == pytest.approx((0.75 + 0.5 + 0.0) / 3)
    assert s["image_accuracy"] == pytest.approx(4 / 7)
    assert set(s["missing_tags"]) == {"two_object", "colors", "color_attr"}
    s = geneval_summary(["colors", "colors"], [1.0, float("nan")])
    assert s["per_tag"] == {"colors": 1.0} and s["num_unjudged"] == 1


def test_color_crop_masks_then_crops():
    image = Image.fromarray(np.full((20, 30, 3), 200, dtype=np.uint8))
    mask = np.zeros((20, 30), dtype=bool)
    mask[5:10, 5:15] = True
    crop = color_crop(image, det("cat", box=(4, 4, 16, 11), mask=mask))
    a = np.asarray(crop)
    assert crop.size == (12, 7)
    assert (a[1:6, 1:11] == 200).all()  # inside the mask: the image
    assert (a[0] == 0x99).all() and (a[:, 0] == 0x99).all()  # outside: #999
    original = color_crop(image, det("cat", box=(4, 4, 16, 11), mask=mask), bgcolor="original")
    assert (np.asarray(original) == 200).all()
    boxed = color_crop(image, det("cat", box=(0, 0, 5, 5)))  # no mask: plain box crop
    assert boxed.size == (5, 5)


# --------------------------------------------------------------------------------------------
# tiny models
# --------------------------------------------------------------------------------------------

#: The detector's own (COCO) spellings; mmrl maps mouse / remote / keyboard to GenEval's names.
COCO_NAMES = [{"computer mouse": "mouse", "tv remote": "remote", "computer keyboard": "keyboard"}.get(n, n)
              for n in GENEVAL_CLASSES]
CAT, DOG, MOUSE = COCO_NAMES.index("cat"), COCO_NAMES.index("dog"), COCO_NAMES.index("mouse")


@pytest.fixture(scope="module")
def tiny_mask2former():
    return build_tiny_mask2former(COCO_NAMES)


def write_tiny_bpe(directory) -> tuple[str, str]:
    vocab = {}
    for c in string.ascii_lowercase:
        vocab[c] = len(vocab)
    for c in string.ascii_lowercase:
        vocab[c + "</w>"] = len(vocab)
    vocab["-</w>"] = len(vocab)
    vocab["-"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    vocab_file, merges_file = directory / "vocab.json", directory / "merges.txt"
    vocab_file.write_text(json.dumps(vocab))
    merges_file.write_text("#version: 0.2\n")
    return str(vocab_file), str(merges_file)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    vocab_file, merges_file = write_tiny_bpe(tmp_path_factory.mktemp("bpe"))
    tokenizer = CLIPTokenizer(vocab=vocab_file, merges=merges_file)
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                 crop_size={"height": 32, "width": 32}),
                              tokenizer=tokenizer)
    text = dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=77, projection_dim=8,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(image_size=32, patch_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, projection_dim=8)
    torch.manual_seed(0)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).eval(), processor


def random_images(n, h=64, w=64, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(n)]


def reference_instance_postprocess(class_logits, mask_logits, padded, resized, original, max_per_image=100):
    """mmdetection's Mask2Former instance post-processing, written out query by query (no top-k trick)."""
    probs = torch.softmax(class_logits.double(), -1)[:, :-1]
    pairs = sorted(((float(probs[q, c]), q, c) for q in range(probs.shape[0]) for c in range(probs.shape[1])),
                   reverse=True)[:max_per_image]
    out = []
    for p, q, c in pairs:
        m = F.interpolate(mask_logits[q][None, None].float(), size=padded, mode="bilinear", align_corners=False)
        m = m[..., : resized[0], : resized[1]]
        m = F.interpolate(m, size=original, mode="bilinear", align_corners=False)[0, 0]
        binary = (m > 0).numpy()
        mask_score = float((torch.sigmoid(m).numpy() * binary).sum() / (binary.sum() + 1e-6))
        ys, xs = np.nonzero(binary)
        box = (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) if len(xs) else (0, 0, 0, 0)
        out.append((COCO_NAMES[c], p * mask_score, tuple(float(v) for v in box), binary))
    return sorted(out, key=lambda t: -t[1])


def test_mask2former_postprocess_matches_reference(tiny_mask2former):
    model, processor = tiny_mask2former
    detector = Mask2FormerDetector(model, processor, device="cpu")
    images = random_images(1, 48, 80, seed=1) + random_images(1, 64, 64, seed=2)
    inputs = processor(images=images, return_tensors="pt")
    with torch.no_grad():
        out = model(pixel_values=inputs["pixel_values"], pixel_mask=inputs["pixel_mask"])
    got = detector(images, min_score=0.0)
    padded = tuple(inputs["pixel_values"].shape[-2:])
    for k, image in enumerate(images):
        # the 48x80 image is resized to 64x107 rounded up to the size divisor 32: 64x128 (no padding); the
        # 64x64 one stays 64x64 and is padded to the batch's 64x128 (right-hand half is padding)
        resized = (64, 128) if k == 0 else (64, 64)
        expected = reference_instance_postprocess(out.class_queries_logits[k], out.masks_queries_logits[k], padded,
                                                  resized, (image.height, image.width))
        expected = [e for e in expected if e[1] > 0]
        assert len(got[k]) == len(expected)
        np.testing.assert_allclose([d.score for d in got[k]], [e[1] for e in expected], rtol=1e-4, atol=1e-7)
        for d in got[k]:  # each detection is one of the reference's (same class, score, box and mask)
            assert any(canonical_class(lab) == d.label and abs(sc - d.score) < 1e-6 and box == d.box
                       and (mask == d.mask).all() for lab, sc, box, mask in expected)


def test_mask_to_box():
    masks = torch.zeros(3, 6, 8, dtype=torch.bool)
    masks[0, 1:3, 2:5] = True
    masks[1, 5, 7] = True
    boxes = mask_to_box(masks)
    assert boxes.tolist() == [[2, 1, 5, 3], [7, 5, 8, 6], [0, 0, 0, 0]]


def test_clip_color_classifier_matches_reference(tiny_clip):
    model, processor = tiny_clip
    clf = ClipColorClassifier(model, processor, device="cpu")
    crops = random_images(5, 20, 30, seed=3)
    got = clf(crops, "cat")
    # independent: per colour, mean of the normalised template embeddings, renormalised; argmax of cosine
    with torch.no_grad():
        weights = []
        for c in COLORS:
            texts = [f"a photo of a {c} cat", f"a photo of a {c}-colored cat", f"a photo of a {c} object"]
            tok = processor.tokenizer(texts, padding=True, return_tensors="pt")
            t = model.text_projection(model.text_model(input_ids=tok["input_ids"],
                                                       attention_mask=tok["attention_mask"]).pooler_output)
            w = F.normalize(F.normalize(t, dim=-1).mean(0), dim=0)
            weights.append(w)
        weights = torch.stack(weights, 1)
        # open_clip's openai transform as GenEval's evaluate_images.py builds it, in torchvision: Resize (shorter
        # side, bicubic), CenterCrop (rounded offset), ToTensor, Normalize
        from torchvision import transforms

        ip = processor.image_processor
        side, crop = ip.size["shortest_edge"], (ip.crop_size["height"], ip.crop_size["width"])
        transform = transforms.Compose([transforms.Resize(side, interpolation=transforms.InterpolationMode.BICUBIC),
                                        transforms.CenterCrop(crop), transforms.ToTensor(),
                                        transforms.Normalize(ip.image_mean, ip.image_std)])
        pixels = torch.stack([transform(c.convert("RGB")) for c in crops])
        img = F.normalize(model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output), dim=-1)
    torch.testing.assert_close(clf.weights("cat"), weights, rtol=1e-5, atol=1e-6)
    assert got == [COLORS[i] for i in (img @ weights).argmax(1).tolist()]
    assert set(got) <= set(COLORS)
    # the pixels the classifier sees: a 22 x 20 crop resizes to 35 x 32, an excess of 3 where torchvision's centre
    # crop starts at round(1.5) = 2 and transformers' at 1
    seen = []
    original = model.get_image_features
    model.get_image_features = lambda pixel_values: seen.append(pixel_values) or original(pixel_values=pixel_values)
    try:
        odd = random_images(1, 20, 22, seed=4)
        clf(odd, "cat")
    finally:
        model.get_image_features = original
    torch.testing.assert_close(seen[0][0], transform(odd[0].convert("RGB")), rtol=0, atol=1e-5)
    assert not torch.allclose(seen[0][0], processor.image_processor(images=odd, return_tensors="pt")["pixel_values"][0])


# --------------------------------------------------------------------------------------------
# the full reward, with crafted detector outputs
# --------------------------------------------------------------------------------------------


def craft(model, spec):
    """Make the tiny Mask2Former output ``spec``: per query ``(class index, probability, cell)`` where ``cell``
    ``(row, col)`` is a 2x2 block of the 16x16 mask grid (an 8x8 pixel square of a 64x64 image) that the query's
    mask covers. Unlisted queries predict "no object". Returns the hook handle."""
    num_queries, num_classes = model.config.num_queries, model.config.num_labels

    def hook(module, args, output):
        b, _, h, w = output.masks_queries_logits.shape
        logits = torch.full((b, num_queries, num_classes + 1), -1e4)
        logits[..., -1] = 0.0
        masks = torch.full((b, num_queries, h, w), -50.0)
        for q, (cls, prob, (r, c)) in enumerate(spec):
            logits[:, q, -1] = math.log((1 - prob) / prob) if prob < 1 else -1e4
            logits[:, q, cls] = 0.0
            masks[:, q, 2 * r:2 * r + 2, 2 * c:2 * c + 2] = 50.0
        output.class_queries_logits = logits
        output.masks_queries_logits = masks
        return output

    return model.register_forward_hook(hook)


@pytest.fixture
def reward(tiny_mask2former):
    model, processor = tiny_mask2former
    return GenEval(detector=model, detector_processor=processor,
                   clip_model=lambda crops, classname: ["red"] * len(crops), device="cpu")


def test_full_reward_caps_detections_per_class(tiny_mask2former, reward):
    model, _ = tiny_mask2former
    spec = [(CAT, 1.0, (r, c)) for r in range(0, 8, 2) for c in range(0, 8, 2)][:20]  # 20 confident cats
    handle = craft(model, spec)
    try:
        out = reward(random_images(1), None, [{"tag": "single_object", "include": [{"class": "cat", "count": 1}]}])
    finally:
        handle.remove()
    assert out["geneval"].tolist() == [1.0] and out["strict"].tolist() == [1.0] and out["partial"].tolist() == [1.0]
    assert reward.last_details[0]["detected"] == {"cat": 16}  # <= 16 per class


def test_full_reward_counting_threshold(tiny_mask2former, reward):
    model, _ = tiny_mask2former
    # 2 confident cats and 3 at probability 0.6 (kept at 0.3, dropped at the counting threshold 0.9)
    spec = [(CAT, 1.0, (0, 0)), (CAT, 1.0, (0, 4)), (CAT, 0.6, (4, 0)), (CAT, 0.6, (4, 4)), (CAT, 0.6, (6, 6))]
    clauses = {"include": [{"class": "cat", "count": 2}], "exclude": [{"class": "cat", "count": 3}]}
    meta = [dict(clauses, tag="counting"), dict(clauses, tag="two_object")]
    handle = craft(model, spec)
    try:
        out = reward(random_images(2), None, meta)
    finally:
        handle.remove()
    assert out["strict"].tolist() == [1.0, 0.0]
    assert out["partial"].tolist() == [1.0, 0.5]
    assert reward.last_details[0]["detected"] == {"cat": 2} and reward.last_details[1]["detected"] == {"cat": 5}
    assert "expected cat<3, found 5" in reward.last_details[1]["reason"]


def test_full_reward_positions_colours_and_aliases(tiny_mask2former):
    model, processor = tiny_mask2former
    seen = []

    def colours(crops, classname):
        seen.append((classname, [c.size for c in crops]))
        return ["red"] * len(crops)

    reward = build_reward("geneval_partial", detector=model, detector_processor=processor, clip_model=colours,
                          device="cpu")
    # a mouse in the left column, a dog in the right one
    handle = craft(model, [(MOUSE, 1.0, (3, 0)), (DOG, 1.0, (3, 7))])
    meta = [
        {"tag": "position", "include": [{"class": "dog", "count": 1},
                                        {"class": "computer mouse", "count": 1, "position": ["left of", 0]}]},
        {"tag": "position", "include": [{"class": "dog", "count": 1},
                                        {"class": "computer mouse", "count": 1, "position": ["right of", 0]}]},
        {"tag": "color_attr", "include": [{"class": "dog", "count": 1, "color": "red"},
                                          {"class": "cat", "count": 1, "color": "red"}]},
    ]
    try:
        out = reward(random_images(3), None, meta)
    finally:
        handle.remove()
    assert out["geneval_partial"].tolist() == [1.0, 0.5, 0.5]
    assert out["strict"].tolist() == [1.0, 0.0, 0.0]
    graded = build_reward("geneval", detector=model, detector_processor=processor, clip_model=colours, device="cpu",
                          variant="flow_grpo")
    handle = craft(model, [(MOUSE, 1.0, (3, 0)), (DOG, 1.0, (3, 7))])
    try:
        out = graded(random_images(3), None, meta)
    finally:
        handle.remove()
    # [1, 1, 1]; [1, 1, 0, 1]; dog [1, 1 (red)], cat [0, 0]
    assert out["geneval"].tolist() == [1.0, 0.75, 0.5]
    assert seen[-1][0] == "dog" and len(seen) == 2  # the dog's colour: classified once for both rules
    assert out["flow_grpo_strict"].tolist() == [1.0, 0.0, 0.0] and out["strict"].tolist() == [1.0, 0.0, 0.0]
    # the colour classifier saw the dog's masked crop: an 8x8 box (+-1 px of bilinear spread)
    assert seen and seen[0][0] == "dog" and all(6 <= s <= 10 for s in seen[0][1][0])


def test_full_reward_bad_samples_are_nan_with_reasons(tiny_mask2former, reward):
    model, _ = tiny_mask2former
    x = torch.rand(4, 3, 64, 64)
    x[1, 0, 0, 0] = float("nan")
    meta = [{"include": [{"class": "cat", "count": 1}]}, {"include": [{"class": "cat", "count": 1}]},
            {"tag": "colors"}, None]
    handle = craft(model, [(CAT, 1.0, (1, 1))])
    try:
        out = reward(x, None, meta)
    finally:
        handle.remove()
    assert out["geneval"][0] == 1.0 and torch.isnan(out["geneval"][1:]).all()
    reasons = reward.last_info["nan_samples"]
    assert "non-finite" in reasons[1] and "no 'include' or 'exclude'" in reasons[2] and "must be a dict" in reasons[3]
    out = reward(x[:1], None, None)  # no metadata at all
    assert torch.isnan(out["geneval"]).all()


def test_full_reward_with_tiny_clip_runs(tiny_mask2former, tiny_clip):
    model, processor = tiny_mask2former
    clip, clip_processor = tiny_clip
    reward = build_reward("geneval", detector=model, detector_processor=processor, clip_model=clip,
                          clip_processor=clip_processor, device="cpu")
    handle = craft(model, [(CAT, 1.0, (2, 2)), (DOG, 1.0, (5, 5))])
    meta = [{"tag": "colors", "include": [{"class": "cat", "count": 1, "color": c}]} for c in COLORS]
    try:
        out = reward(random_images(1) * len(COLORS), None, meta)
    finally:
        handle.remove()
    # the same image: exactly one colour is the classifier's answer
    assert out["geneval"].sum().item() == 1.0 and torch.isfinite(out["geneval"]).all()
    # the random detector (no hook) also runs end to end
    out = reward(random_images(2, 40, 56), None, [{"include": [{"class": "cat", "count": 1}]}] * 2)
    assert torch.isfinite(out["geneval"]).all()


def test_detector_failure_is_a_nan_not_an_exception(tiny_mask2former):
    calls = []

    def flaky(images, classes=None, min_score=0.0):
        calls.append(len(images))
        if len(images) > 1 or images[0].width == 40:
            raise RuntimeError("boom")
        return [[det("cat", 0.99, (0, 0, 5, 5))]]

    reward = GenEval(detector=flaky, clip_model=lambda crops, c: ["red"] * len(crops))
    images = random_images(1, 64, 64) + random_images(1, 64, 40)
    out = reward(images, None, [{"include": [{"class": "cat", "count": 1}]}] * 2)
    assert out["geneval"][0] == 1.0 and torch.isnan(out["geneval"][1])
    assert "detector failed" in reward.last_info["nan_samples"][1] and calls == [2, 1, 1]


def test_missing_weights_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(MissingWeightsError) as err:
        build_reward("geneval")
    msg = str(err.value)
    assert "facebook/mask2former-swin-small-coco-instance" in msg and "config.json" in msg and "detector=" in msg
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingWeightsError, match="config.json"):
        build_reward("geneval", detector=str(tmp_path / "empty"))
    with pytest.raises(MissingWeightsError, match="does not exist"):
        build_reward("geneval", detector=str(tmp_path / "nowhere"))
    with pytest.raises(MissingWeightsError) as err:  # the detector is fine, the CLIP weights are not
        build_reward("geneval", detector=lambda *a, **k: [], clip_model=str(tmp_path / "empty"))
    assert "model.safetensors" in str(err.value) and "CLIP" in str(err.value)


def test_loads_from_local_dirs(tiny_mask2former, tiny_clip, tmp_path):
    model, processor = tiny_mask2former
    clip, clip_processor = tiny_clip
    model.save_pretrained(tmp_path / "det")
    processor.save_pretrained(tmp_path / "det")
    clip.save_pretrained(tmp_path / "clip")
    clip_processor.save_pretrained(tmp_path / "clip")
    loaded = build_reward("geneval", detector=str(tmp_path / "det"), clip_model=str(tmp_path / "clip"), device="cpu")
    direct = build_reward("geneval", detector=model, detector_processor=processor, clip_model=clip,
                          clip_processor=clip_processor, device="cpu")
    images = random_images(2)
    meta = [{"include": [{"class": "cat", "count": 1, "color": "red"}]}] * 2
    a, b = loaded(images, None, meta), direct(images, None, meta)
    torch.testing.assert_close(a["geneval"], b["geneval"], equal_nan=True)
    assert loaded.last_details == direct.last_details


# --------------------------------------------------------------------------------------------
# open-vocabulary detection (OWL-ViT / OWLv2)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["owlv2", "owlvit"])
def tiny_owl(request, tmp_path_factory):
    from transformers import (CLIPTokenizer, Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor,
                              Owlv2Processor, OwlViTConfig, OwlViTForObjectDetection, OwlViTImageProcessor,
                              OwlViTProcessor)

    vocab_file, merges_file = write_tiny_bpe(tmp_path_factory.mktemp("owl_bpe"))
    tok = CLIPTokenizer(vocab=vocab_file, merges=merges_file)
    text = dict(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=32, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    vision = dict(image_size=32, patch_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2)
    torch.manual_seed(0)
    if request.param == "owlv2":
        model = Owlv2ForObjectDetection(Owlv2Config(text_config=text, vision_config=vision, projection_dim=16))
        processor = Owlv2Processor(image_processor=Owlv2ImageProcessor(size={"height": 32, "width": 32}), tokenizer=tok)
    else:
        model = OwlViTForObjectDetection(OwlViTConfig(text_config=text, vision_config=vision, projection_dim=16))
        processor = OwlViTProcessor(image_processor=OwlViTImageProcessor(size={"height": 32, "width": 32},
                                                                         crop_size={"height": 32, "width": 32}),
                                    tokenizer=tok)
    with torch.no_grad():  # unsaturated scores: logit = cos(box, query) * (elu(-0.5) + 1), no shift
        model.class_head.logit_shift.weight.zero_()
        model.class_head.logit_shift.bias.zero_()
        model.class_head.logit_scale.weight.zero_()
        model.class_head.logit_scale.bias.fill_(-0.5)
    return request.param, model.eval(), processor


def test_owl_detector_matches_transformers_postprocessing(tiny_owl):
    from mmrl.rewards.geneval import OwlDetector

    kind, model, processor = tiny_owl
    detector = OwlDetector(model, processor, device="cpu")
    images = random_images(1, 40, 60) + random_images(1, 64, 64, seed=3)
    got = detector(images, classes=[["cat", "dog", "cat"], ["mouse"]], min_score=0.0)
    queries = [["a photo of a cat", "a photo of a dog"], ["a photo of a computer mouse"]]
    expected = []
    for image, q in zip(images, queries):  # one image at a time: no padding queries
        inputs = processor(text=[q], images=[image], return_tensors="pt", padding="max_length", max_length=32)
        with torch.no_grad():
            out = model(**inputs)
        # OWLv2 pads to a square: boxes are relative to the longer side
        size = (max(image.size),) * 2 if kind == "owlv2" else (image.height, image.width)
        expected += processor.post_process_grounded_object_detection(out, threshold=0.0, target_sizes=[size])
    for k, (image, dets, exp) in enumerate(zip(images, got, expected)):
        order = exp["scores"].argsort(descending=True)
        np.testing.assert_allclose([d.score for d in dets], exp["scores"][order].numpy(), rtol=1e-5, atol=1e-6)
        boxes = exp["boxes"][order].clone()
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, image.width)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, image.height)
        np.testing.assert_allclose([d.box for d in dets], boxes.numpy(), rtol=1e-4, atol=1e-3)
        names = ["cat", "dog"] if k == 0 else ["computer mouse"]
        assert [d.label for d in dets] == [names[int(i)] for i in exp["labels"][order]]
        assert all(d.mask is None for d in dets)
    with pytest.raises(ValueError, match="class names"):
        detector(images)


def test_full_reward_with_owl_runs(tiny_owl, tiny_clip):
    _, model, processor = tiny_owl
    clip, clip_processor = tiny_clip
    reward = build_reward("geneval", detector=model, detector_processor=processor, clip_model=clip,
                          clip_processor=clip_processor, threshold=0.0, device="cpu")
    meta = [{"tag": "color_attr", "include": [{"class": "cat", "count": 1, "color": "red"}]},
            {"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}]}]
    out = reward(random_images(2, 48, 40), None, meta)
    assert torch.isfinite(out["geneval"]).all() and set(out) == {"geneval", "strict", "partial"}
