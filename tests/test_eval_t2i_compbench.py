"""T2I-CompBench in ``mmrl eval`` (mmrl.eval.t2i_compbench): names and keys, the interleaved shipped prompt lists and
their pins, the protocol defaults, the rule-based noun phrases on the benchmark's templates, each category's official
rule wired to fixed model outputs (hand-worked numbers: BLIP-VQA products, detector-based spatial scores in UniDet's
frame, CLIP cosines, 3-in-1 per kind), the BLIP ``vqa_prob`` computation on a tiny random BLIP, the summary, a scorer
failure, and one end-to-end ``run_eval`` on the tiny SD3 with tiny random BLIP and Mask2Former."""
from __future__ import annotations

import json
import math
import string
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from fixtures import tiny_clip, tiny_flow_config, tiny_mask2former

import mmrl.eval.benchmarks
import mmrl.eval.t2i_compbench as t2i
from mmrl.data.prompts import DataError
from mmrl.eval.runner import EvalError, EvalItem, parse_benchmark, parse_eval_args
from mmrl.rewards.geneval import Detection



def options(*args: str):
    return parse_eval_args(list(args))[0]


def spec_of(name: str, *args: str):
    opts = options(*args)
    return parse_benchmark(name, opts), opts


def image(size: int = 512, colour=(120, 120, 120)) -> Image.Image:
    return Image.new("RGB", (size, size), colour)


def scorer_for(name: str, *args: str, parse=t2i.rule_parse):
    spec, opts = spec_of(name, "noun_phrases=rules", *args)
    scorer = t2i.make_scorer(spec, opts)
    scorer.parse = parse
    return scorer


def item(prompt: str, category: str, index: int = 0, **metadata) -> EvalItem:
    return EvalItem(index, prompt, {"category": category, **metadata}, category)


# ---------------------------------------------------------------------------------------------- names and keys


def test_names_select_categories_and_route_to_the_plugin():
    spec, _ = spec_of("t2i_compbench")
    assert spec.kind == "t2i_compbench" and spec.prompt_set == "t2i_compbench/val:" + ",".join(t2i.CATEGORIES)
    spec, _ = spec_of("t2i_compbench:spatial+color")
    assert spec.prompt_set == "t2i_compbench/val:spatial,color" and spec.folder == "t2i_compbench-spatial+color"
    assert spec_of("t2i_compbench:spatial,color")[0].prompt_set == spec.prompt_set  # "," too (quoted in a list)
    opts = options('benchmarks=[t2i_compbench:color+shape, "t2i_compbench:texture,spatial"]')
    assert opts.benchmarks == ["t2i_compbench:color+shape", "t2i_compbench:texture,spatial"]
    assert set(t2i.EVAL_KEYS) <= set(parse_eval_args.__globals__["_plugin_keys"]())


@pytest.mark.parametrize("name, args, words", [
    ("t2i_compbench:colour", (), ["unknown T2I-CompBench category 'colour'", "did you mean 'color'"]),
    ("t2i_compbench:numeracy", (), ["numeracy", "not in mmrl eval yet"]),
    ("t2i_compbench:color+color", (), ["listed twice"]),
    ("t2i_compbench:", (), ["empty category"]),
    ("t2i_compbench@drawbench", (), ["expected t2i_compbench or t2i_compbench:CATEGORY"]),
    ("t2i_compbench:spatial", ("t2i_split=val_seen",), ["only color, shape and texture", "spatial"]),
    ("t2i_compbench", ("t2i_split=test",), ["t2i_split='test'"]),
    ("t2i_compbench", ("np_num=0",), ["np_num=0"]),
    ("t2i_compbench", ("blip_image_size=500",), ["blip_image_size=500", "multiple of 16"]),
    ("t2i_compbench", ("noun_phrases=nltk",), ["noun_phrases='nltk'"]),
    ("t2i_compbench", ("noun_phrases=spacy", "spacy_model=/no/such/model"), ["noun_phrases=spacy needs spaCy"]),
    ("t2i_compbench", ("t2i_detector_threshold=1.5",), ["t2i_detector_threshold=1.5"]),
    ("t2i_compbench", ("official_quirks=yes please",), ["official_quirks="]),
    ("t2i_compbench", ("blip_model=[a]",), ["blip_model=['a']"]),
    ("t2i_compbench", ("blip_checkpoint=/no/such/model_base_vqa_capfilt_large.pth",),
     ["blip_checkpoint='/no/such/model_base_vqa_capfilt_large.pth'", "no such file"]),
    ("t2i_compbench", ("t2i_clip_dtype=bfloat16",), ["t2i_clip_dtype='bfloat16'", "float32 or float16"]),
])
def test_bad_names_and_keys_are_one_line(name, args, words):
    with pytest.raises(EvalError) as info:
        spec_of(name, *args)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


# ---------------------------------------------------------------------------------------------- prompts


def test_items_interleave_the_categories_with_unique_indices_and_the_complex_kinds():
    spec, opts = spec_of("t2i_compbench")
    items, path, pinned = t2i.load_items(spec, opts)
    assert len(items) == 6 * 300 and [it.index for it in items] == list(range(1800))
    assert [it.category for it in items[:12]] == list(t2i.CATEGORIES) * 2
    assert path.name == "color_val.txt" and pinned == t2i.PINNED_SHA256["color_val.txt"]
    color = mmrl.eval.benchmarks.load_t2i_compbench("color")
    assert [it.prompt for it in items if it.category == "color"] == [p.prompt for p in color]
    assert items[6].metadata == {"category": "color", "line": 2, "category_index": 1}
    kinds = [it.metadata["complex_kind"] for it in items if it.category == "complex"]
    assert len(kinds) == 300 and set(kinds) == {"spatial", "action", "all"}
    assert all("complex_kind" not in it.metadata for it in items if it.category != "complex")
    # every list read is named with its sha256 in the settings (which the protocol hash covers)
    scorer = t2i.make_scorer(spec, opts)
    files = scorer.settings["prompt_files"]
    assert set(files) == {f"{c}_val.txt" for c in t2i.CATEGORIES} | {"complex_val_spatial.txt",
                                                                      "complex_val_action.txt"}
    assert all(v["sha256"] == t2i.PINNED_SHA256[k] for k, v in files.items())


def test_a_subset_and_a_seen_split():
    spec, opts = spec_of("t2i_compbench:texture+color", "t2i_split=val_unseen")
    items, path, pinned = t2i.load_items(spec, opts)
    assert len(items) == 200 and path.name == "texture_val_unseen.txt"
    assert [it.category for it in items[:4]] == ["texture", "color", "texture", "color"]


def test_an_altered_or_missing_shipped_list_is_refused(tmp_path, monkeypatch):
    import shutil

    root = tmp_path / "benchmarks"
    shutil.copytree(mmrl.eval.benchmarks.assets_dir() / "t2i_compbench", root / "t2i_compbench")
    (root / "README.md").write_text("copy\n")
    monkeypatch.setattr(mmrl.eval.benchmarks, "assets_dir", lambda: root)
    target = root / "t2i_compbench" / "dataset" / "spatial_val.txt"
    target.write_text(target.read_text() + "a cat on the left of a dog\n")
    spec, opts = spec_of("t2i_compbench:color+spatial")
    with pytest.raises(DataError, match="spatial_val.txt: not the version of the T2I-CompBench list mmrl pins"):
        t2i.load_items(spec, opts)
    target.unlink()
    with pytest.raises(EvalError, match="spatial_val.txt is missing"):
        spec_of("t2i_compbench:spatial")


def test_protocol_defaults_are_the_official_ones():
    d = t2i.defaults(spec_of("t2i_compbench")[0])
    assert (d.images_per_prompt, d.seed, d.resolution, d.num_steps, d.guidance_scale) == (10, 42, 512, 40, 4.5)
    assert "inference_eval.py" in d.source and "42, 43, ..., 51" in d.source and "DDIM, 30 steps" in d.source


# ---------------------------------------------------------------------------------------------- noun phrases


def test_rule_parse_on_the_benchmark_templates():
    assert t2i.rule_parse("a green bench and a blue bowl").noun_chunks == ("a green bench", "a blue bowl")
    assert t2i.rule_parse("a blue rose and a green tulip").noun_chunks == ("a blue rose", "a green tulip")
    assert t2i.rule_parse("a black and white cat sits in a white sink.").noun_chunks == (
        "a black and white cat", "a white sink")
    assert t2i.rule_parse("The man on the large pink motorcycle has black chaps.").noun_chunks == (
        "The man", "the large pink motorcycle", "black chaps")
    assert t2i.rule_parse("a square cutting board and a round watermelon").noun_chunks == (
        "a square cutting board", "a round watermelon")
    assert t2i.rule_parse("The silky, flowing fabric swirled around the dancer's feet, as she glided.").noun_chunks \
        == ("The silky, flowing fabric", "the dancer's feet", "she")
    spatial = t2i.rule_parse("a woman on the left of a phone")
    assert spatial.noun_chunks == ("a woman", "the left", "a phone")
    assert t2i.blip_noun_phrases(spatial) == ["a woman", "a phone"]
    assert t2i.spatial_objects(spatial) == ("woman", "phone")
    cx = t2i.rule_parse("The red book was on top of the yellow bookshelf.")
    assert t2i.complex_spatial_objects(cx) == ("book", "bookshelf")
    assert t2i.remove_adjectives(cx) == "The book was on top of the bookshelf ."
    assert t2i.remove_adjectives(t2i.rule_parse("The red apple was next to the oval plate.")) == \
        "The apple was to the plate ."  # spaCy tags this "next" ADJ too
    assert t2i.blip_question("A Green bench.") == "a green bench?"


def test_rule_parse_covers_every_shipped_prompt_of_its_categories():
    for cat in ("color", "shape", "texture", "complex"):
        for p in mmrl.eval.benchmarks.load_t2i_compbench(cat):
            parsed = t2i.rule_parse(p.prompt)
            assert t2i.blip_noun_phrases(parsed), p.prompt
            assert "".join(t.text + t.ws for t in parsed.tokens).strip() == p.prompt.strip(), p.prompt
    from mmrl.eval.scoring import t2i_spatial_locality

    for p in mmrl.eval.benchmarks.load_t2i_compbench("spatial"):
        obj1, obj2 = t2i.spatial_objects(t2i.rule_parse(p.prompt))
        words = p.prompt.lower().split()
        assert obj1 == words[1] and obj2 == words[-1].rstrip("."), p.prompt  # "a(n) X <relation> a(n) Y"
        assert t2i_spatial_locality(p.prompt) is not None
    found = [t2i.complex_spatial_objects(t2i.rule_parse(p.prompt))
             for p in mmrl.eval.benchmarks.load_t2i_compbench("complex") if p.complex_kind == "spatial"]
    assert sum(o != (None, None) for o in found) >= 0.75 * len(found)


def test_complex_object_extraction_follows_the_official_loop():
    def parsed(*pairs):
        return t2i.Parsed(tuple(t2i.Token(w, p) for w, p in pairs), ())

    # the nearest NOUN/PROPN before the preposition, the first NOUN after it
    assert t2i.complex_spatial_objects(parsed(("Bob", "PROPN"), ("sat", "VERB"), ("near", "ADP"), ("the", "DET"),
                                              ("old", "ADJ"), ("tree", "NOUN"))) == ("Bob", "tree")
    # no NOUN after it up to the end: the first PROPN followed by a non-PROPN
    assert t2i.complex_spatial_objects(parsed(("cat", "NOUN"), ("next", "ADV"), ("to", "ADP"), ("Big", "PROPN"),
                                              ("Ben", "PROPN"), ("!", "PUNCT"))) == ("cat", "Ben")
    # two prepositions: four objects, not exactly two -> none
    assert t2i.complex_spatial_objects(parsed(("cat", "NOUN"), ("near", "ADP"), ("dog", "NOUN"), ("near", "ADP"),
                                              ("box", "NOUN"))) == (None, None)
    assert t2i.spatial_objects(parsed(("red", "ADJ"))) == (None, None)


def test_spacy_is_used_through_its_doc_when_chosen(monkeypatch):
    """noun_phrases=spacy: the official chunks and tags come from spacy.load(model) (a stand-in pipeline here)."""
    import sys

    calls = []

    class Doc(list):
        noun_chunks = [SimpleNamespace(text="the cat"), SimpleNamespace(text="the left")]

    def load(name):
        calls.append(name)
        return lambda text: Doc(SimpleNamespace(text=w, pos_="NOUN", whitespace_=" ") for w in text.split())

    monkeypatch.setitem(sys.modules, "spacy", SimpleNamespace(load=load))
    monkeypatch.setattr(t2i, "_spacy_available", lambda model: True)
    spec, opts = spec_of("t2i_compbench:color", "noun_phrases=spacy", "spacy_model=my_pipeline")
    scorer = t2i.make_scorer(spec, opts)
    assert scorer.settings["noun_phrases"] == "spacy" and scorer.settings["spacy_model"] == "my_pipeline"
    assert "spaCy my_pipeline (official)" in scorer.settings["scorers"]["color"]
    scorer.build = None  # no model here: only the parser
    parsed = t2i._spacy_parser("my_pipeline")("the cat")
    assert calls == ["my_pipeline"] and parsed.noun_chunks == ("the cat", "the left")
    assert t2i.blip_noun_phrases(parsed) == ["the cat"] and parsed.tokens[1] == t2i.Token("cat", "NOUN", " ")
    # auto picks spaCy when it is installed
    spec, opts = spec_of("t2i_compbench:spatial")
    assert t2i.make_scorer(spec, opts).settings["noun_phrases"] == "spacy"


# ---------------------------------------------------------------------------------------------- the rules, wired


def test_attribute_binding_is_the_product_of_the_phrases_p_yes(monkeypatch):
    scorer = scorer_for("t2i_compbench:color")
    asked = []

    def yes_probs(images, phrases):
        asked.append(list(phrases))
        table = {"a green bench": 0.9, "a blue bowl": 0.5}
        return [[table[p] * (1 if k == 0 else 0.5) for p in phrases] for k in range(len(images))]

    monkeypatch.setattr(scorer, "blip_yes_probs", yes_probs)
    rows = scorer.score([image(), image()], item("a green bench and a blue bowl", "color"))
    assert asked == [["a green bench", "a blue bowl"]]
    assert rows[0]["scores"] == {"score": pytest.approx(0.45), "blip_vqa": pytest.approx(0.45)}
    assert rows[1]["scores"]["score"] == pytest.approx(0.45 * 0.25)
    assert rows[0]["verdict"]["questions"] == ["a green bench?", "a blue bowl?"] and rows[0]["reason"] is None
    # np_num=1: only the first phrase is asked
    scorer = scorer_for("t2i_compbench:color", "np_num=1")
    monkeypatch.setattr(scorer, "blip_yes_probs", yes_probs)
    assert scorer.score([image()], item("a green bench and a blue bowl", "color"))[0]["scores"]["score"] == \
        pytest.approx(0.9)
    # official_quirks: each value and the product rounded to 4 decimals (float32)
    scorer = scorer_for("t2i_compbench:color", "official_quirks=true")
    monkeypatch.setattr(scorer, "blip_yes_probs", lambda ims, ps: [[0.12345, 0.56789]])
    assert scorer.score([image()], item("a green bench and a blue bowl", "color"))[0]["scores"]["score"] == 0.0701


def test_spatial_score_from_fixed_detections_in_unidets_frame(monkeypatch):
    scorer = scorer_for("t2i_compbench:spatial")
    queried = []

    def detect(images, names):
        queried.append(list(names))
        return [[Detection("dog", 0.9, (0, 0, 100, 100)), Detection("cat", 0.8, (300, 0, 400, 100)),
                 Detection("dog", 0.7, (400, 0, 500, 100))]]

    monkeypatch.setattr(scorer, "detect", detect)
    row = scorer.score([image()], item("a dog on the left of a cat", "spatial"))[0]
    assert queried == [["dog", "cat"]]
    assert row["scores"]["score"] == pytest.approx(0.25 * 0.9 + 0.25 * 0.8 + 0.5)  # left of, no overlap: 1
    assert row["verdict"]["objects"] == ["dog", "cat"] and row["verdict"]["locality"] == "on the left of"
    assert row["verdict"]["detections"][1]["box"] == pytest.approx([300 * 479 / 512, 0, 400 * 479 / 512,
                                                                    100 * 479 / 512], abs=0.06)
    row = scorer.score([image()], item("a cat on the left of a dog", "spatial"))[0]
    assert row["scores"]["score"] == 0.0  # the cat is right of the first dog: 0.25(0.8 + 0.9) < 0.5 -> 0

    # "next to": centres 160 px apart both ways at 512 px are 149.7 px in UniDet's 479-px frame: position 1
    monkeypatch.setattr(scorer, "detect", lambda ims, names: [[Detection("person", 0.6, (0, 0, 40, 40)),
                                                               Detection("horse", 0.6, (160, 160, 200, 200))]])
    row = scorer.score([image()], item("a woman next to a horse", "spatial"))[0]
    assert row["scores"]["score"] == pytest.approx(0.3 + 0.5)
    assert row["verdict"]["detector_labels"] == ["person", "horse"]
    # the same boxes in a 256-px image are 2x apart in the frame (320 > 150): position 150/299.4
    row = scorer.score([image(256)], item("a woman next to a horse", "spatial"))[0]
    assert row["scores"]["score"] == pytest.approx(0.3 + 0.5 * 150 / (180 * 479 / 256 - 20 * 479 / 256))


@pytest.mark.parametrize("width, height", [(256, 264), (264, 256), (512, 512), (256, 256), (300, 301), (480, 640),
                                           (640, 480), (1000, 1003), (479, 480), (100, 5000)])
def test_unidets_frame_is_the_size_torchvision_resizes_to(width, height):
    """Resize(479, max_size=480) as torchvision itself resizes a PIL image of that size (its public API)."""
    from torchvision import transforms

    new_w, new_h = transforms.Resize(479, max_size=480)(Image.new("RGB", (width, height))).size
    assert t2i.official_frame(width, height) == (new_w / width, new_h / height)
    assert t2i._resize_rule(height, width, 479, 480) == (new_h, new_w)  # the reproduced rule, without torchvision


def test_unidets_frame_off_by_one_case_and_the_rule_without_torchvision(monkeypatch):
    import torchvision.transforms.functional as F

    # 256 x 264: 479 * 264 / 256 = 493.97 -> 493 > 480, so the short side is int(480 * 479 / 493) = 466 (not
    # int(480 * 256 / 264) = 465 from the original sizes)
    assert t2i.official_frame(256, 264) == (466 / 256, 480 / 264)
    assert int(480 * 256 / 264) == 465
    pairs = [(w, h) for w in range(200, 1300, 37) for h in range(200, 1300, 41)]
    expected = {(w, h): tuple(F._compute_resized_output_size((h, w), [479], 480)) for w, h in pairs}
    monkeypatch.delattr(F, "_compute_resized_output_size")  # torchvision's private function gone: the fallback rule
    assert {(w, h): t2i._resized_size(h, w, 479, 480) for w, h in pairs} == expected


def test_official_quirks_never_finds_nouns_outside_unidets_words(monkeypatch):
    detections = [[Detection("cow", 0.9, (0, 0, 50, 50)), Detection("dog", 0.9, (200, 0, 250, 50))]]
    plain = scorer_for("t2i_compbench:spatial")
    quirky = scorer_for("t2i_compbench:spatial", "official_quirks=true")
    for s in (plain, quirky):
        monkeypatch.setattr(s, "detect", lambda ims, names: detections)
    prompt = item("a cow on the left of a dog", "spatial")
    assert plain.score([image()], prompt)[0]["scores"]["score"] == pytest.approx(0.25 * 1.8 + 0.5)
    row = quirky.score([image()], prompt)[0]
    assert row["scores"]["score"] == 0.0 and "UniDet" in row["verdict"]["not_findable"][0]
    # official_quirks: "on top of" gives position 0
    detections[0] = [Detection("cat", 0.9, (0, 0, 50, 50)), Detection("dog", 0.9, (0, 200, 50, 250))]
    prompt = item("a cat on top of a dog", "spatial")
    assert plain.score([image()], prompt)[0]["scores"]["score"] == pytest.approx(0.95)
    assert quirky.score([image()], prompt)[0]["scores"]["score"] == 0.0


def test_non_spatial_is_the_clip_cosine(monkeypatch):
    scorer = scorer_for("t2i_compbench:non_spatial")
    seen = []
    monkeypatch.setattr(scorer, "clip_cosines", lambda ims, text: seen.append(text) or [0.31, -0.05][:len(ims)])
    rows = scorer.score([image(), image()], item("A man is kayaking on a lake.", "non_spatial"))
    assert seen == ["A man is kayaking on a lake."]
    assert [r["scores"]["score"] for r in rows] == [0.31, -0.05]  # not clipped, not x100


@pytest.mark.parametrize("kind, expected, calls", [
    ("spatial", (0.7 + 0.8) / 2, {"blip", "detect"}),
    ("action", (0.3 + 0.8) / 2, {"blip", "clip"}),
    ("all", (0.8 + 0.7 + 0.3) / 3, {"blip", "detect", "clip"}),
])
def test_complex_is_three_in_one_per_kind(monkeypatch, kind, expected, calls):
    scorer = scorer_for("t2i_compbench:complex")
    made = set()
    clip_text = []

    def blip(ims, phrases):
        made.add("blip")
        return [[0.8] + [1.0] * (len(phrases) - 1)]

    def detect(ims, names):
        made.add("detect")
        assert names == ["book", "bookshelf"]
        return [[Detection("book", 0.4, (0, 0, 50, 50)), Detection("bookshelf", 0.4, (0, 200, 50, 250))]]

    def clip(ims, text):
        made.add("clip")
        clip_text.append(text)
        return [0.3]

    monkeypatch.setattr(scorer, "blip_yes_probs", blip)
    monkeypatch.setattr(scorer, "detect", detect)
    monkeypatch.setattr(scorer, "clip_cosines", clip)
    prompt = item("The red book was on top of the yellow bookshelf.", "complex", complex_kind=kind)
    row = scorer.score([image()], prompt)[0]
    assert made == calls
    assert row["scores"]["score"] == pytest.approx(expected)
    assert row["scores"]["blip_vqa"] == pytest.approx(0.8)
    if "detect" in calls:  # "on top of" read as "on the top of": the book above, no overlap: 0.25 * 0.4 * 2 + 0.5
        assert row["scores"]["spatial"] == pytest.approx(0.7)
    else:
        assert row["scores"]["spatial"] is None
    if "clip" in calls:
        assert clip_text == ["The book was on top of the bookshelf ."]  # the adjectives removed


def test_a_failing_model_gives_none_with_the_reason(monkeypatch):
    scorer = scorer_for("t2i_compbench:color")

    def broken(ims, phrases):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(scorer, "blip_yes_probs", broken)
    rows = scorer.score([image(), image()], item("a red cup and a blue bowl", "color"))
    assert [r["scores"] for r in rows] == [{"score": None}] * 2
    assert rows[0]["reason"] == "T2I-CompBench color scoring failed: RuntimeError: CUDA out of memory"


def test_summary_per_category_and_mmrls_own_mean():
    scorer = scorer_for("t2i_compbench:color+complex")
    items = [item("a", "color", 0), item("b", "complex", 1, complex_kind="action")]
    rows = [{"prompt_index": 0, "image_index": 0, "scores": {"score": 0.5, "blip_vqa": 0.5}},
            {"prompt_index": 0, "image_index": 1, "scores": {"score": None}},
            {"prompt_index": 1, "image_index": 0, "scores": {"score": 0.4, "blip_vqa": 0.5, "spatial": None,
                                                             "clip": 0.3}},
            {"prompt_index": 1, "image_index": 1, "scores": {"score": 0.2, "blip_vqa": 0.1, "spatial": None,
                                                             "clip": 0.3}}]
    m = scorer.summarize(rows, items, None)
    assert m["color"] == {"score": 0.5, "n": 1, "num_unjudged": 1, "metric": "blip_vqa",
                          "scorer": scorer.scorers["color"]}
    assert m["complex"]["score"] == pytest.approx(0.3) and m["complex"]["metric"] == "3_in_1"
    assert m["complex"]["parts"]["clip"]["mean"] == pytest.approx(0.3) and m["complex"]["parts"]["spatial"]["n"] == 0
    assert m["complex"]["images_per_kind"] == {"spatial": 0, "action": 2, "all": 0}
    assert m["mean_of_categories"]["score"] == pytest.approx(0.4) and "mmrl's own" in m["mean_of_categories"]["note"]
    assert scorer.headline == "mean_of_categories.score"
    assert scorer_for("t2i_compbench:spatial").headline == "spatial.score"


def test_settings_name_the_official_scorers_and_the_substitutes():
    scorer = scorer_for("t2i_compbench")
    s = scorer.settings
    assert s["blip_model"] == "Salesforce/blip-vqa-capfilt-large" and s["t2i_clip_model"] == \
        "openai/clip-vit-base-patch32"
    assert s["t2i_detector"] == "facebook/mask2former-swin-small-coco-instance" and s["t2i_detector_threshold"] == 0.5
    assert s["noun_phrases"] == "rules" and scorer.defaults["noun_phrases"] == "spacy"
    assert "official" in s["scorers"]["color"] and "substitute for spaCy" in s["scorers"]["color"]
    assert "substitute for UniDet" in s["scorers"]["spatial"]
    assert s["scorers"]["non_spatial"].startswith("CLIPScore (official")
    assert "3-in-1" in s["scorers"]["complex"]
    clip_only = scorer_for("t2i_compbench:non_spatial").settings
    assert "blip_model" not in clip_only and "t2i_detector" not in clip_only and "noun_phrases" not in clip_only


# ---------------------------------------------------------------------------------------------- tiny models


def tiny_blip_dir(directory, init: float = 0.5):
    """A tiny random transformers BlipForQuestionAnswering (16 wide, 32 px) with a letters-only BERT vocabulary that
    has BLIP's [DEC] and [ENC] and the answers yes / no."""
    from transformers import BertTokenizer, BlipConfig, BlipForQuestionAnswering

    directory.mkdir(parents=True, exist_ok=True)
    vocab = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "yes", "no"] + list(string.ascii_lowercase)
             + ["##" + c for c in string.ascii_lowercase] + list("?.,'-") + ["[DEC]", "[ENC]"])
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizer(str(directory / "vocab.txt"))
    config = BlipConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=64, encoder_hidden_size=16,
                         bos_token_id=vocab.index("[DEC]"), pad_token_id=0, sep_token_id=3, initializer_range=init),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=16, initializer_range=init),
        projection_dim=8, image_text_hidden_size=8, initializer_range=init)
    torch.manual_seed(0)
    BlipForQuestionAnswering(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def blip_dir(tmp_path_factory):
    return tiny_blip_dir(tmp_path_factory.mktemp("t2i-blip") / "blip")


def test_vqa_prob_on_a_tiny_blip(blip_dir):
    """The official vqa_prob: [ENC] first, one decoder step from [DEC], P(yes)/(P(yes)+P(no)); batched over images and
    questions as each pair alone."""
    model, tokenizer = t2i._load_blip(str(blip_dir), torch.device("cpu"))
    images = [Image.new("RGB", (40, 40), (200, 30, 30)), Image.new("RGB", (40, 40), (20, 90, 220))]
    questions = ["a green bench?", "a blue bowl with a long name?"]
    batched = t2i._blip_yes_probs(model, tokenizer, images, questions, 32)
    enc, dec = tokenizer.convert_tokens_to_ids(["[ENC]", "[DEC]"])
    yes, no = tokenizer.convert_tokens_to_ids(["yes", "no"])
    for i, im in enumerate(images):
        for j, q in enumerate(questions):
            with torch.no_grad():
                pixels = t2i.blip_pixels([im], 32)
                embeds = model.vision_model(pixel_values=pixels)[0]
                ids = tokenizer([q], return_tensors="pt")["input_ids"]
                ids[:, 0] = enc
                states = model.text_encoder(input_ids=ids, encoder_hidden_states=embeds)[0]
                logits = model.text_decoder(input_ids=torch.tensor([[dec]]), encoder_hidden_states=states).logits
                p = logits[0, 0].softmax(-1)
            assert batched[i][j] == pytest.approx(float(p[yes] / (p[yes] + p[no])), abs=1e-5)
    assert 0 < batched[0][0] < 1 and batched[0][0] != pytest.approx(batched[1][0], abs=1e-6)
    # another input size interpolates the position embeddings instead of failing
    other = t2i._blip_yes_probs(model, tokenizer, images, questions, 48)
    assert all(0 < v < 1 for row in other for v in row)


def fake_blip_checkpoint(path, model, positions: int = (480 // 16) ** 2 + 1, **state):
    """An original-BLIP-style ``.pth`` (``{"model": state dict}``) whose ``visual_encoder.pos_embed`` is
    ``[1, positions, D]`` random (901 = 30x30 + 1 at the tiny BLIP's patch 16 and 480 px), with the model's own
    ``cls_token`` unless ``state`` overrides it."""
    generator = torch.Generator().manual_seed(7)
    emb = model.vision_model.embeddings
    pos = torch.randn(1, positions, emb.position_embedding.shape[-1], generator=generator)
    full = {"visual_encoder.pos_embed": pos, "visual_encoder.cls_token": emb.class_embedding.detach().clone(),
            "text_encoder.embeddings.word_embeddings.weight": torch.zeros(3, 2), **state}
    torch.save({"model": full, "epoch": 9, "config": {"image_size": 480}}, path)
    return pos


def test_blip_checkpoint_puts_the_original_480px_position_embeddings_in(blip_dir, tmp_path, monkeypatch):
    """blip_checkpoint: the .pth's visual_encoder.pos_embed becomes the model's position embedding and 480-px input
    runs without interpolation, equal to the ViT computed by hand from those embeddings; the vision LayerNorms run
    with BLIP's eps 1e-6."""
    import torch.nn.functional as F

    plain, tokenizer = t2i._load_blip(str(blip_dir), torch.device("cpu"))
    path = tmp_path / "model_base_vqa_capfilt_large.pth"
    pos = fake_blip_checkpoint(path, plain)
    model, _ = t2i._load_blip(str(blip_dir), torch.device("cpu"), str(path))
    emb = model.vision_model.embeddings
    assert torch.equal(emb.position_embedding.detach(), pos) and emb.position_embedding.shape == (1, 901, 16)
    assert model.config.vision_config.image_size == 480 and emb.num_positions == 901
    # BLIP's models/vit.py eps in every vision LayerNorm (the text model's BERT eps untouched)
    vision_norms = [m for m in model.vision_model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(vision_norms) == 3 and all(m.eps == 1e-6 for m in vision_norms)
    assert model.config.vision_config.layer_norm_eps == 1e-6
    assert all(m.eps == 1e-12 for m in model.text_encoder.modules() if isinstance(m, torch.nn.LayerNorm))

    def no_interpolation(*args, **kwargs):
        raise AssertionError("interpolated")

    monkeypatch.setattr(emb, "interpolate_pos_encoding", no_interpolation)
    images = [Image.new("RGB", (500, 470), (200, 30, 30)), Image.new("RGB", (64, 64), (20, 90, 220))]
    questions = ["a green bench?", "a blue bowl?"]
    probs = t2i._blip_yes_probs(model, tokenizer, images, questions, 480)
    enc, dec, yes, no = tokenizer.convert_tokens_to_ids(["[ENC]", "[DEC]", "yes", "no"])
    for i, im in enumerate(images):
        with torch.no_grad():
            pixels = t2i.blip_pixels([im], 480)
            patches = F.conv2d(pixels, emb.patch_embedding.weight, emb.patch_embedding.bias, stride=16)
            x = torch.cat([emb.class_embedding.view(1, 1, 16), patches.flatten(2).transpose(1, 2)], 1) + pos
            hidden = model.vision_model.encoder(inputs_embeds=x).last_hidden_state
            post = model.vision_model.post_layernorm
            embeds = F.layer_norm(hidden, (16,), post.weight, post.bias, eps=1e-6)
            assert torch.allclose(model.vision_model(pixel_values=pixels)[0], embeds, atol=1e-6)
            for j, q in enumerate(questions):
                ids = tokenizer([q], return_tensors="pt")["input_ids"]
                ids[:, 0] = enc
                states = model.text_encoder(input_ids=ids, encoder_hidden_states=embeds)[0]
                p = model.text_decoder(input_ids=torch.tensor([[dec]]), encoder_hidden_states=states).logits[0, 0]
                p = p.softmax(-1)
                assert probs[i][j] == pytest.approx(float(p[yes] / (p[yes] + p[no])), abs=1e-5)
    # without the checkpoint the stored 2x2 grid is interpolated to 30x30: other numbers
    other = t2i._blip_yes_probs(plain, tokenizer, images, questions, 480)
    assert other[0] != pytest.approx(probs[0], abs=1e-4)


@pytest.mark.parametrize("state, positions, words", [
    ({"visual_encoder.cls_token": torch.ones(1, 1, 16)}, 901, ["visual_encoder.cls_token differs",
                                                                 "not the checkpoint blip_model was converted from"]),
    ({}, 900, ["visual_encoder.pos_embed has shape [1, 900, 16]", "[1, g*g + 1, 16]"]),
])
def test_a_blip_checkpoint_that_does_not_fit_is_refused(blip_dir, tmp_path, state, positions, words):
    model, _ = t2i._load_blip(str(blip_dir), torch.device("cpu"))
    path = tmp_path / "other.pth"
    fake_blip_checkpoint(path, model, positions, **state)
    with pytest.raises(EvalError) as info:
        t2i.apply_blip_checkpoint(model, str(path))
    assert all(w in str(info.value) for w in words), str(info.value)
    torch.save({"model": {"visual_encoder.cls_token": torch.zeros(1)}}, path)
    with pytest.raises(EvalError, match="no visual_encoder.pos_embed tensor under 'model'"):
        t2i.apply_blip_checkpoint(model, str(path))
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(EvalError, match="could not load it as a weights-only torch checkpoint"):
        t2i.apply_blip_checkpoint(model, str(path))


def test_blip_checkpoint_in_the_settings_and_the_build(blip_dir, tmp_path):
    plain, _ = t2i._load_blip(str(blip_dir), torch.device("cpu"))
    path = tmp_path / "model_base_vqa_capfilt_large.pth"
    pos = fake_blip_checkpoint(path, plain)
    default = scorer_for("t2i_compbench:color")
    s = default.settings
    assert s["blip_checkpoint"] is None and s["blip_position_embeddings"] == "blip_model"
    assert default.defaults["blip_position_embeddings"] == "blip_checkpoint"  # official: shown as overridden
    assert "does not restore" in s["blip_position_embeddings_note"] and "577" in s["blip_position_embeddings_note"]
    assert s["blip_vision_layer_norm_eps"] == 1e-6 == default.defaults["blip_vision_layer_norm_eps"]
    assert "named difference" in default.scorers["color"]
    scorer = scorer_for("t2i_compbench:color", f"blip_model={blip_dir}", f"blip_checkpoint={path}")
    assert scorer.settings["blip_position_embeddings"] == "blip_checkpoint"
    assert scorer.settings["blip_checkpoint"] == str(path) and "480-px ones from blip_checkpoint" in \
        scorer.scorers["color"]
    scorer.build()
    assert torch.equal(scorer.blip.vision_model.embeddings.position_embedding.detach(), pos)


def test_the_test_transform_is_a_bicubic_resize_and_clip_normalisation():
    im = Image.new("RGB", (7, 5), (255, 0, 128))
    x = t2i.blip_pixels([im], 16)
    assert x.shape == (1, 3, 16, 16)
    assert x[0, 0, 0, 0].item() == pytest.approx((1 - 0.48145466) / 0.26862954, abs=1e-5)
    assert x[0, 1, 3, 3].item() == pytest.approx((0 - 0.4578275) / 0.26130258, abs=1e-5)


def test_clip_cosine_on_a_tiny_clip(tmp_path):
    from mmrl.rewards.clipscore import CLIPScore

    model, processor = tiny_clip(tmp_path / "clip")
    images = [Image.new("RGB", (32, 32), (200, 30, 30)), Image.new("RGB", (32, 32), (20, 90, 220))]
    cos = t2i._clip_cosines(model, processor, images, "a red box")
    reward = CLIPScore(model=model, processor=processor, device="cpu", clip_at_zero=False)
    expected = reward(images, ["a red box"] * 2)["clipscore"]
    assert cos == pytest.approx(expected.tolist(), abs=1e-5)


def openai_clip_transform(n_px: int):
    """OpenAI CLIP's own preprocessing (clip/clip.py ``_transform``), written out with torchvision."""
    from torchvision import transforms as T

    return T.Compose([T.Resize(n_px, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(n_px),
                      lambda im: im.convert("RGB"), T.ToTensor(),
                      T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])


def random_image(width: int, height: int, seed: int = 0) -> Image.Image:
    import numpy as np

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("t2i-clip") / "clip"
    model, processor = tiny_clip(directory)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("width, height", [(512, 512), (640, 480), (256, 301), (301, 256), (224, 230)])
def test_clip_preprocessing_is_openais_pil_transform(width, height):
    """clip_pixels with CLIP ViT-B/32's processor settings = OpenAI's _transform(224), also where transformers'
    centre crop rounds the offset differently (256 x 301: 263 - 224 = 39 rows to drop)."""
    from transformers import CLIPImageProcessorPil

    im = random_image(width, height)
    ours = t2i.clip_pixels([im], CLIPImageProcessorPil())
    assert ours.shape == (1, 3, 224, 224) and ours.dtype == torch.float32
    assert torch.equal(ours[0], openai_clip_transform(224)(im))


def test_the_clip_processor_is_loaded_with_the_pil_backend(clip_dir):
    model, processor = t2i._load_clip(str(clip_dir), torch.device("cpu"))
    assert processor.image_processor.backend == "pil" and next(model.parameters()).dtype == torch.float32
    im = random_image(48, 48, seed=1)
    openai = openai_clip_transform(32)(im)
    assert torch.equal(processor.image_processor(images=[im], return_tensors="pt")["pixel_values"][0], openai)
    assert torch.equal(t2i.clip_pixels([im], processor.image_processor)[0], openai)


def test_clip_float16_as_the_official_clip_load(clip_dir):
    """t2i_clip_dtype=float16: a half model, features normalised and the cosine taken in float16 (each value a
    float16 number), as computed here by hand from OpenAI's preprocessing; float32 differs in the last digits."""
    import copy

    from mmrl.rewards.pickscore import _embedding

    model32, processor = t2i._load_clip(str(clip_dir), torch.device("cpu"))
    model16, _ = t2i._load_clip(str(clip_dir), torch.device("cpu"), "float16")
    assert next(model16.parameters()).dtype == torch.float16
    images = [random_image(40, 52, seed=k) for k in range(3)]
    text = "a red box"
    cos16 = t2i._clip_cosines(model16, processor, images, text)
    half = copy.deepcopy(model32).half()
    with torch.no_grad():
        t = _embedding(half.get_text_features(**processor.tokenizer([text], return_tensors="pt")))
        t /= t.norm(dim=-1, keepdim=True)
        for k, im in enumerate(images):
            f = _embedding(half.get_image_features(pixel_values=openai_clip_transform(32)(im)[None].half()))
            f /= f.norm(dim=-1, keepdim=True)
            assert f.dtype == t.dtype == torch.float16
            assert cos16[k] == (f @ t.T).item()
    assert all(float(torch.tensor(c, dtype=torch.float16)) == c for c in cos16)  # float16 numbers
    cos32 = t2i._clip_cosines(model32, processor, images, text)
    assert cos16 == pytest.approx(cos32, abs=2e-2) and cos16 != cos32
    assert not all(float(torch.tensor(c, dtype=torch.float16)) == c for c in cos32)


def test_clip_dtype_in_the_settings_and_the_build(clip_dir):
    default = scorer_for("t2i_compbench:non_spatial")
    assert default.settings["t2i_clip_dtype"] == "float32" and default.defaults["t2i_clip_dtype"] == "float16"
    assert "named difference" in default.settings["clip_dtype_note"]
    assert "float32 (a named difference" in default.scorers["non_spatial"]
    assert "PIL backend" in default.settings["clip_preprocess"]
    scorer = scorer_for("t2i_compbench:non_spatial", f"t2i_clip_model={clip_dir}", "t2i_clip_dtype=float16")
    assert scorer.settings["t2i_clip_dtype"] == "float16" and "float16, as the official" in \
        scorer.scorers["non_spatial"]
    scorer.build()
    model, processor = scorer.clip
    assert next(model.parameters()).dtype == torch.float16 and processor.image_processor.backend == "pil"
    rows = scorer.score([random_image(32, 32)], item("a red box", "non_spatial"))
    assert rows[0]["reason"] is None and -1 <= rows[0]["scores"]["score"] <= 1


def test_a_missing_model_names_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    scorer = scorer_for("t2i_compbench:color", f"blip_model={tmp_path / 'nothing'}")
    with pytest.raises(EvalError, match="set blip_model="):
        scorer.build()


# ---------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    """The tiny CPU recipe on a tiny SD3 built here."""
    return tiny_flow_config(tmp_path_factory.mktemp("t2i-model"))


def test_end_to_end_color_and_spatial(config_file, blip_dir, tmp_path):
    from mmrl.eval.runner import run_eval
    from mmrl.rewards.geneval import GENEVAL_CLASSES

    detector = tmp_path / "det"
    model, processor = tiny_mask2former([{"computer mouse": "mouse", "tv remote": "remote",
                                          "computer keyboard": "keyboard"}.get(n, n) for n in GENEVAL_CLASSES])
    model.save_pretrained(detector)
    processor.save_pretrained(detector)
    out = tmp_path / "out"
    args = ["checkpoint=base", "benchmarks=[t2i_compbench:color+spatial]", "limit=2", "images_per_prompt=2",
            "resolution=32", "num_steps=2", f"blip_model={blip_dir}", "blip_image_size=32", f"t2i_detector={detector}",
            "t2i_detector_threshold=0.0", "noun_phrases=rules", f"output_dir={out}"]
    summary = run_eval(config_file, args, echo=lambda *a: None)
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(r["prompt_index"], r["image_index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert rows[2]["prompt"] == mmrl.eval.benchmarks.load_t2i_compbench("spatial")[0].prompt
    assert [r["verdict"]["category"] for r in rows] == ["color", "color", "spatial", "spatial"]
    assert [r["seed"] for r in rows] == [42, 43, 42, 43]
    color = [r for r in rows if r["verdict"]["category"] == "color"]
    for r in color:  # the product of the recorded P(yes) values
        assert r["scores"]["score"] == pytest.approx(math.prod(r["verdict"]["yes_probs"]), rel=1e-6)
        assert 0 < r["scores"]["score"] < 1 and r["verdict"]["questions"]
    spatial = [r for r in rows if r["verdict"]["category"] == "spatial"]
    assert all(r["scores"]["score"] is not None and r["verdict"]["locality"] for r in spatial)

    b = summary["benchmarks"]["t2i_compbench:color+spatial"]
    m = b["metrics"]
    assert m["color"]["n"] == 2 and m["color"]["score"] == pytest.approx(sum(r["scores"]["score"] for r in color) / 2)
    assert m["spatial"]["n"] == 2 and m["spatial"]["metric"] == "unidet"
    assert m["mean_of_categories"]["score"] == pytest.approx((m["color"]["score"] + m["spatial"]["score"]) / 2)
    assert b["headline"] == "mean_of_categories.score" and b["num_unjudged"] == 0
    p = b["protocol"]
    assert p["images_per_prompt"] == 2 and p["overridden"]["images_per_prompt"] == {"default": 10, "used": 2}
    assert p["prompts_file"].endswith("color_val.txt") and p["pinned_sha256"] == t2i.PINNED_SHA256["color_val.txt"]
    assert set(p["scorer_settings"]["prompt_files"]) == {"color_val.txt", "spatial_val.txt"}
    assert p["overridden"]["scorer_settings.noun_phrases"] == {"default": "spacy", "used": "rules"}
    assert "substitute for UniDet" in m["spatial"]["scorer"]
    saved = json.loads((out / "summary.json").read_text())
    assert saved["benchmarks"]["t2i_compbench:color+spatial"]["metrics"]["color"]["n"] == 2
