"""Judged perception rewards (perception_r1, claimdiff, medix_composite, pest_feature, video_ver) on the tiny random
Qwen2.5-VL judge: end to end (shapes, finite, raw judge output kept, batching = one by one, a plain single forward
reproduces the judge's P(yes) for an image and for video frames), the scoring rules hand-worked with the judge
monkeypatched to fixed answers, and bad inputs (missing/unreadable media, missing annotations, unparseable
responses, a failing judge) as counted 0s or NaNs with reasons, never exceptions."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from fixtures import write_garbage, write_video
from PIL import Image

from mmrl.rewards import ComposedReward, build_reward, check_reward_arguments, reward_scores_images
from mmrl.rewards._judge import JudgeFailure, response_part
from mmrl.rewards.claimdiff import parse_differences, split_claims
from mmrl.rewards._text import Unparseable

NAMES = ("perception_r1", "claimdiff", "medix_composite", "pest_feature", "video_ver")
YES = ["yes", "Yes", " yes", " Yes"]  # the single-token variants of the tiny vocabulary
NO = ["no", "No", " no", " No"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrl.pipelines.vlm.tiny import ensure_tiny_vlm

    cache = tmp_path_factory.mktemp("mmrl_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MMRL_CACHE", str(cache))
        path = ensure_tiny_vlm("qwen2_5_vl")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    return model, processor, cache


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)
    for k, (h, w) in enumerate([(56, 56), (84, 112), (56, 84)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"img{k}.png")
    write_video(root / "clip.mp4", num_frames=20, width=56, height=56, fps=10)
    write_garbage(root / "broken.mp4")
    write_garbage(root / "broken.png")
    return root


def build(name, tiny, media, **kwargs):
    model, processor, _ = tiny
    defaults = {"claimdiff": {"differences": "split"}, "video_ver": {"num_frames": 4}}.get(name, {})
    return build_reward(name, model=model, processor=processor, media_root=str(media),
                        **{**defaults, **kwargs})


RESPONSES = [
    "<think>The cat on the left is red.</think><answer>a red cat</answer>",
    "<think>Two dogs. The car is blue.</think><answer>two dogs</answer>",
    "<think>I see a person at the top.</think><answer>a person</answer>",
    "<think>The blue car is on the right.</think><answer>a blue car</answer>",
    "<think>It is a dog.</think><answer>one dog</answer>",
]


def sample_meta(k):
    return {"image_path": f"img{k % 3}.png", "video": "clip.mp4", "solution": "A red cat. Two dogs on the left.",
            "visual_annotations": ["a red cat", "two dogs on the left"][: 1 + k % 2],
            "features": ["red wings"] if k % 2 else None, "visual_evidence": ["a cat walks"]}


METADATA = [sample_meta(k) for k in range(5)]
PROMPTS = ["What is in the image?"] * 5


# --------------------------------------------------------------------------------------------
# end to end on the tiny judge
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_end_to_end_batched_equals_one_by_one(name, tiny, media):
    batched = build(name, tiny, media, batch_size=8)
    single = build(name, tiny, media, batch_size=1)
    assert batched.judge.model is single.judge.model  # a built model is used as is
    out = batched(RESPONSES, PROMPTS, METADATA)
    info = batched.last_info
    assert set(out) >= {name, *batched.extra_keys}
    assert all(v.shape == (5,) and v.dtype == torch.float32 for v in out.values())
    assert torch.isfinite(out[name]).all(), info["nan_samples"]
    assert ((out[name] >= 0) & (out[name] <= 1)).all()
    assert info["num_nan"] == 0 and info["num_unparseable"] == 0
    # the judge's raw output is kept per sample
    assert sorted(info["judge"]) == [0, 1, 2, 3, 4]
    asked = [e for e in info["judge"][0] if e["kind"] == "yes_no"]
    assert asked and all(0 < e["p_yes"] < 1 and math.isfinite(e["logit_yes_no"]) for e in asked)
    one = single(RESPONSES, PROMPTS, METADATA)
    for key in out:
        torch.testing.assert_close(one[key], out[key], rtol=1e-4, atol=1e-5)
    # every sample's queries go to the judge together: fewer forwards in the batched run
    assert info["judge_forwards"] < single.last_info["judge_forwards"]


def plain_p_yes(tiny, content):
    """One query, no padding, full logits: softmax over the yes/no variants, summed over yes."""
    model, processor, _ = tiny
    parts = [{"type": "image"} if isinstance(c, Image.Image) else {"type": "text", "text": c} for c in content]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                         add_generation_prompt=True)
    images = [c for c in content if isinstance(c, Image.Image)]
    inputs = processor(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1].double()
    ids = [processor.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in YES + NO]
    return float(torch.softmax(logits[ids], dim=0)[: len(YES)].sum())


def test_perception_r1_matches_a_plain_forward(tiny, media):
    reward = build("perception_r1", tiny, media)
    out = reward(RESPONSES[:2], PROMPTS[:2], METADATA[:2])
    image = Image.open(media / "img1.png").convert("RGB")
    expected = [plain_p_yes(tiny, [image, reward.template.format(annotation=a, annotations="- a red cat\n- two dogs "
                                                                "on the left", response=RESPONSES[1], question="",
                                                                meta={})])
                for a in METADATA[1]["visual_annotations"]]
    assert out["perception_r1"][1].item() == pytest.approx(sum(expected) / 2, rel=1e-4)
    got = [e["p_yes"] for e in reward.last_info["judge"][1]]
    assert got == pytest.approx(expected, rel=1e-4)
    assert out["num_annotations"].tolist() == [1.0, 2.0]


def test_video_ver_reads_frames_with_the_project_reader(tiny, media):
    from mmrl.data.video import read_video

    reward = build("video_ver", tiny, media)
    out = reward(RESPONSES[:1], PROMPTS[:1], METADATA[:1])
    clip = read_video(media / "clip.mp4", nframes=4)
    assert clip.indices == [0, 6, 13, 19]
    content = []
    for k, (frame, t) in enumerate(zip(clip.frames, clip.frame_times)):
        content += [f"Frame {k + 1} ({round(t, 2):g} s):", Image.fromarray(frame.permute(1, 2, 0).numpy())]
    content.append(reward.template.format(
        reasoning="The cat on the left is red.", response=RESPONSES[0], question=PROMPTS[0], evidence="- a cat walks",
        num_frames=4, frame_times="0, 0.6, 1.3, 1.9", meta={}))
    assert out["video_ver"].item() == pytest.approx(plain_p_yes(tiny, content), rel=1e-4)
    assert out["num_frames"].item() == 4.0 and out["p_yes"].item() == out["video_ver"].item()
    # frames given in the metadata (PIL) instead of a video file
    frames = [Image.fromarray(f.permute(1, 2, 0).numpy()) for f in clip.frames]
    given = reward(RESPONSES[:1], PROMPTS[:1], [{"frames": frames}])
    assert torch.isfinite(given["video_ver"]).all() and given["num_frames"].item() == 4.0


def test_claimdiff_judge_mode_on_the_tiny_judge(tiny, media):
    """Generation is greedy and batched; the random judge writes no difference list: NaN with the reason, text kept."""
    reward = build("claimdiff", tiny, media, differences="judge", max_new_tokens=12, batch_size=4)
    out = reward(RESPONSES[:3], PROMPTS[:3], METADATA[:3])
    texts = [reward.last_info["judge"][i][0]["text"] for i in range(3)]
    assert all(isinstance(t, str) for t in texts)
    assert torch.isnan(out["claimdiff"]).all()
    assert all("no difference line" in why for why in reward.last_info["nan_samples"].values())
    alone = build("claimdiff", tiny, media, differences="judge", max_new_tokens=12, batch_size=1)
    alone(RESPONSES[:3], PROMPTS[:3], METADATA[:3])
    assert [alone.last_info["judge"][i][0]["text"] for i in range(3)] == texts


def test_rewards_are_text_rewards_and_validate_kwargs(tiny, media):
    for name in NAMES:
        assert reward_scores_images(name) is False
    with pytest.raises(ValueError, match="max_claims"):
        check_reward_arguments("claimdiff", {"max_claim": 3})
    with pytest.raises(ValueError, match="unknown placeholder"):
        build("perception_r1", tiny, media, template="Is {anotation} right?")
    with pytest.raises(ValueError, match="differences"):
        build("claimdiff", tiny, media, differences="llm")
    with pytest.raises(ValueError, match="part"):
        build("pest_feature", tiny, media, part="reasoning")
    with pytest.raises(ValueError, match="completions"):
        build("perception_r1", tiny, media)("one string", None, None)


def test_judge_loaded_by_name_is_shared(tiny, media, monkeypatch):
    monkeypatch.setenv("MMRL_CACHE", str(tiny[2]))
    a = build_reward("perception_r1", model="tiny:qwen2_5_vl", device="cpu", dtype="float32", media_root=str(media))
    b = build_reward("video_ver", model="tiny:qwen2_5_vl", device="cpu", dtype="float32", media_root=str(media))
    assert a.judge.model is b.judge.model  # one loaded judge for both
    expected = build("perception_r1", tiny, media)(RESPONSES[:2], PROMPTS[:2], METADATA[:2])
    torch.testing.assert_close(a(RESPONSES[:2], PROMPTS[:2], METADATA[:2]), expected)


def test_composed_and_served(tiny, media):
    from mmrl.rewards.remote import RemoteReward, RewardServer

    local = ComposedReward({"perception_r1": (build("perception_r1", tiny, media), 1.0),
                            "claimdiff": (build("claimdiff", tiny, media), 0.5)})
    scores = local(RESPONSES[:3], PROMPTS[:3], METADATA[:3])
    assert {"total", "perception_r1", "claimdiff", "claimdiff/hallucinated", "claimdiff/missing"} <= set(scores)
    assert local.last_info["components"]["claimdiff"]["judge"][0][0]["kind"] == "claims"
    with RewardServer(local, "127.0.0.1", 0) as server:
        remote = RemoteReward(server.url, timeout=60)(RESPONSES[:3], PROMPTS[:3], METADATA[:3])
    torch.testing.assert_close(remote["remote"], scores["total"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(remote["claimdiff/missing"], scores["claimdiff/missing"], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# the scoring rules, hand-worked (judge answers fixed by label)
# --------------------------------------------------------------------------------------------


def fix_judge(monkeypatch, reward, p_yes=None, texts=None, vectors=None):
    if p_yes is not None:
        monkeypatch.setattr(reward.judge, "yes_prob", lambda asks: [
            p_yes[a.label] if isinstance(p_yes[a.label], JudgeFailure) else (p_yes[a.label], 0.0) for a in asks])
    if texts is not None:
        monkeypatch.setattr(reward.judge, "generate", lambda gens: [texts for _ in gens])
    if vectors is not None:
        monkeypatch.setattr(reward.judge, "embed", lambda embeds: [torch.tensor(vectors[e.text]) for e in embeds])


IMG = {"image_path": "img0.png"}


def test_perception_r1_rule(tiny, media, monkeypatch):
    meta = {**IMG, "visual_annotations": ["a red cat", "two dogs", "a blue car"]}
    p = {"a red cat": 0.9, "two dogs": 0.3, "a blue car": 0.6}
    soft = build("perception_r1", tiny, media)
    hard = build("perception_r1", tiny, media, threshold=0.5)
    fix_judge(monkeypatch, soft, p)
    fix_judge(monkeypatch, hard, p)
    out = soft(["a red cat and a blue car"], None, [meta])
    assert out["perception_r1"].item() == pytest.approx((0.9 + 0.3 + 0.6) / 3)  # 0.6
    assert out["consistent"].item() == pytest.approx(2 / 3) and out["num_annotations"].item() == 3
    assert hard(["a red cat and a blue car"], None, [meta])["perception_r1"].item() == pytest.approx(2 / 3)
    assert [e["p_yes"] for e in soft.last_info["judge"][0]] == [0.9, 0.3, 0.6]
    # one annotation given as a plain string
    single = soft(["x"], None, [{**IMG, "visual_annotations": "two dogs"}])
    assert single["perception_r1"].item() == pytest.approx(0.3)
    # Perception-R1's released data: one string of numbered items, one annotation each (it was one annotation)
    numbered = soft(["x"], None, [{**IMG, "visual_annotations": "<info1>a red cat</info1>\n<info2>two dogs</info2>"
                                                                "<info3>a blue car</info3>"}])
    assert numbered["num_annotations"].item() == 3 and numbered["perception_r1"].item() == pytest.approx(0.6)


LISTING = """Here are the differences:
1. HALLUCINATED | count | major | three dogs
- MISSING | object | minor | a red ball
**missing** | color | critical | the sky is blue
this line is not a difference
MISSING | nothing here"""


def test_claimdiff_parses_the_listing():
    diffs = parse_differences(LISTING)
    assert [(d.kind, d.error_type, d.severity, d.claim) for d in diffs] == [
        ("hallucinated", "count", "major", "three dogs"), ("missing", "object", "minor", "a red ball"),
        ("missing", "color", "critical", "the sky is blue")]
    assert parse_differences("NONE") == [] and parse_differences("**None.**") == []
    assert parse_differences("the captions agree mostly") is None
    assert [d.severity for d in parse_differences("EXTRA | big | a hat")] == ["big"]  # three fields: no type


def test_claimdiff_rule_judge_mode(tiny, media, monkeypatch):
    meta = {**IMG, "solution": "Two dogs and a red ball under a blue sky."}
    reward = build("claimdiff", tiny, media, differences="judge")
    fix_judge(monkeypatch, reward, {"three dogs": 0.2, "a red ball": 0.8, "the sky is blue": 0.5}, texts=LISTING)
    out = reward(["<answer>Three dogs.</answer>"], None, [meta])
    # H = w(major) * (1 - 0.2) = 0.8 ; M = w(minor) * 0.8 + w(critical) * 0.5 = 0.4 + 1.0 = 1.4
    assert out["hallucinated"].item() == pytest.approx(0.8)
    assert out["missing"].item() == pytest.approx(1.4)
    assert out["claimdiff"].item() == pytest.approx(1 / 3.2)
    assert out["num_differences"].item() == 3
    record = reward.last_info["judge"][0]
    assert record[0] == {"kind": "generate", "label": "differences", "text": LISTING}
    assert record[1]["kind"] == "differences" and len(record[1]["items"]) == 3
    # the one hallucination the image refutes (p 0.2 < 0.5), located in the response case-insensitively
    assert reward.last_info["spans"] == [[(8, 18)]]  # "Three dogs" of "<answer>Three dogs.</answer>"
    assert record[-1] == {"kind": "hallucinated_spans", "located": 1, "unlocated": 0}
    weighted = build("claimdiff", tiny, media, differences="judge", hallucination_weight=2.0, missing_weight=0.5)
    fix_judge(monkeypatch, weighted, {"three dogs": 0.2, "a red ball": 0.8, "the sky is blue": 0.5}, texts=LISTING)
    assert weighted(["Three dogs."], None, [meta])["claimdiff"].item() == pytest.approx(1 / (1 + 1.6 + 0.7))
    unverified = build("claimdiff", tiny, media, differences="judge", verify=False)
    fix_judge(monkeypatch, unverified, {}, texts=LISTING)  # stage 2 is never asked
    out = unverified(["Three dogs."], None, [meta])  # H = 1.0, M = 0.5 + 2.0
    assert out["claimdiff"].item() == pytest.approx(1 / 4.5) and out["missing"].item() == pytest.approx(2.5)
    agree = build("claimdiff", tiny, media, differences="judge")
    fix_judge(monkeypatch, agree, {}, texts="NONE")
    out = agree(["Two dogs."], None, [meta])
    assert out["claimdiff"].item() == 1.0 and out["hallucinated"].item() == 0 and out["num_differences"].item() == 0


def test_claimdiff_rule_split_mode(tiny, media, monkeypatch):
    assert split_claims("A cat sits. Two dogs run!\n- A ball; a hat", 10) == ["A cat sits.", "Two dogs run!",
                                                                             "A ball;", "a hat"]
    reward = build("claimdiff", tiny, media)
    fix_judge(monkeypatch, reward, {"caption: A cat sits.": 0.9, "caption: Two dogs run.": 0.4,
                                    "reference: A cat sits.": 0.9, "reference: A ball.": 0.8,
                                    "covered: A cat sits.": 0.95, "covered: A ball.": 0.25})
    out = reward(["A cat sits. Two dogs run."], None, [{**IMG, "solution": "A cat sits. A ball."}])
    # H = 0.1 + 0.6 ; M = 0.9 * 0.05 + 0.8 * 0.75 = 0.645
    assert out["hallucinated"].item() == pytest.approx(0.7)
    assert out["missing"].item() == pytest.approx(0.645)
    assert out["claimdiff"].item() == pytest.approx(1 / 2.345)
    assert out["num_differences"].item() == 4
    text = "A cat sits. Two dogs run."
    (span,) = reward.last_info["spans"][0]  # the sentence the image refutes (0.4 < 0.5), not the true one (0.9)
    assert text[span[0]:span[1]] == "Two dogs run"


def test_medix_rule(tiny, media, monkeypatch):
    meta = {**IMG, "solution": "pneumonia"}
    vectors = {"lung infection": [1.0, 0.0], "pneumonia": [0.6, 0.8], "fracture": [-1.0, 0.0]}
    good = "<think>opacity in the lower lobe</think><answer>lung infection</answer>"
    reward = build("medix_composite", tiny, media)
    fix_judge(monkeypatch, reward, {"accuracy": 0.7}, vectors=vectors)
    out = reward([good, "<answer>lung infection</answer>", "<think>x</think><answer>fracture</answer>"], None,
                 [meta] * 3)
    # (1 * accuracy + 1 * semantic + 0.5 * format) / 2.5 ; cos([1, 0], [0.6, 0.8]) = 0.6
    assert out["medix_composite"].tolist() == pytest.approx([(1 + 0.6 + 0.5) / 2.5, (1 + 0.6) / 2.5, (1 + 0.5) / 2.5])
    assert out["semantic"].tolist() == pytest.approx([0.6, 0.6, 0.0])  # a negative cosine is clipped to 0
    assert out["format"].tolist() == [1.0, 0.0, 1.0] and out["p_yes"].tolist() == pytest.approx([0.7] * 3)
    strict = build("medix_composite", tiny, media, semantic_threshold=0.5, format_weight=0.0)
    fix_judge(monkeypatch, strict, {"accuracy": 0.3}, vectors=vectors)
    out = strict([good], None, [meta])  # accuracy 0 (0.3 < 0.5), semantic 1 (0.6 >= 0.5)
    assert out["medix_composite"].item() == pytest.approx(0.5) and out["accuracy"].item() == 0.0
    kinds = [e["kind"] for e in strict.last_info["judge"][0]]
    assert kinds == ["yes_no", "embed", "embed"]
    # no image: the accuracy judge reads text only
    text_only = reward([good], None, [{"solution": "pneumonia"}])
    assert torch.isfinite(text_only["medix_composite"]).all()


def test_medix_embeddings_are_the_judges_own(tiny, media):
    model, processor, _ = tiny
    reward = build("medix_composite", tiny, media)
    ids = processor.tokenizer(["a red cat"], add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        hidden = model.model(**ids).last_hidden_state[0].mean(0)
    from mmrl.rewards._judge import Embed

    got = reward.judge.embed([Embed("a red cat"), Embed("two dogs on the left"), Embed("a red cat")])
    torch.testing.assert_close(got[0], hidden, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[2], got[0])
    by_input = build("medix_composite", tiny, media, embedding="input").judge.embed([Embed("a red cat")])[0]
    torch.testing.assert_close(by_input, model.get_input_embeddings()(ids["input_ids"])[0].mean(0).detach())


def test_pest_feature_rule(tiny, media, monkeypatch):
    reward = build("pest_feature", tiny, media)
    fix_judge(monkeypatch, reward, {"red wings": 0.8, "long antennae": 0.2, "observable evidence": 0.7})
    out = reward(["<think>It has red wings.</think><answer>moth</answer>", "a moth"], None,
                 [{**IMG, "features": ["red wings", "long antennae"]}, IMG])
    assert out["pest_feature"].tolist() == pytest.approx([0.5, 0.7])
    assert out["num_features"].tolist() == [2.0, 0.0] and out["cited"].tolist() == [0.5, 1.0]
    strict = build("pest_feature", tiny, media, require_features=True, threshold=0.75)
    fix_judge(monkeypatch, strict, {"red wings": 0.8, "long antennae": 0.2})
    out = strict(["<think>red wings</think>", "<think>red wings</think>"], None,
                 [{**IMG, "features": ["red wings", "long antennae"]}, IMG])
    assert out["pest_feature"][0].item() == 0.5 and torch.isnan(out["pest_feature"][1])
    assert "features" in strict.last_info["nan_samples"][1]


def test_video_ver_rule(tiny, media, monkeypatch):
    soft = build("video_ver", tiny, media)
    hard = build("video_ver", tiny, media, threshold=0.6)
    fix_judge(monkeypatch, soft, {"visual evidence": 0.65})
    fix_judge(monkeypatch, hard, {"visual evidence": 0.55})
    meta = [{"video": "clip.mp4"}]
    assert soft(["<think>a cat walks</think>"], None, meta)["video_ver"].item() == pytest.approx(0.65)
    out = hard(["<think>a cat walks</think>"], None, meta)
    assert out["video_ver"].item() == 0.0 and out["p_yes"].item() == pytest.approx(0.55)


# --------------------------------------------------------------------------------------------
# bad inputs: counted 0s and NaNs with reasons, never an exception
# --------------------------------------------------------------------------------------------


def test_response_parts():
    assert response_part("<think> a </think><answer>b</answer>", "think") == "a"
    assert response_part("plain words", "think_or_all") == "plain words"
    assert response_part("plain words", "answer_or_all") == "plain words"
    for text, part, why in [("  ", "all", "empty"), ("no tags", "think", "think"), ("<think></think>", "think", "empty"),
                            ("<think>a", "think_or_all", "think"), ("x <answer></answer>", "answer", "empty")]:
        with pytest.raises(Unparseable, match=why):
            response_part(text, part)


@pytest.mark.parametrize("name", NAMES)
def test_missing_and_unreadable_media_are_nan(name, tiny, media):
    reward = build(name, tiny, media)
    if name == "medix_composite":  # an image is optional here (text-only judging), but a broken one is not
        metas = [{"solution": "x", "image_path": "nowhere.png"}, {"solution": "x", "image_path": "broken.png"}]
    elif name == "video_ver":
        metas = [{"visual_annotations": ["x"]}, {"video": "broken.mp4"}, {"video": "nowhere.mp4"}]
    else:
        metas = [{"visual_annotations": ["x"], "solution": "x"}, {**sample_meta(1), "image_path": "broken.png"},
                 {**sample_meta(1), "image_path": "nowhere.png"}]
    out = reward(["<think>a red cat</think><answer>a cat</answer>"] * len(metas), None, metas)
    assert all(torch.isnan(v).all() for v in out.values())
    reasons = reward.last_info["nan_samples"]
    assert sorted(reasons) == list(range(len(metas)))
    text = " ".join(reasons.values())
    assert ("video" if name == "video_ver" else "image") in text
    assert reward.last_info["judge_forwards"] == 0 and reward.last_info["judge"] == {}


def test_missing_annotations_and_bad_entries_are_nan(tiny, media):
    reward = build("perception_r1", tiny, media)
    out = reward(["a cat", "a cat", "a cat", 7, "a cat"], None,
                 [IMG, {**IMG, "visual_annotations": []}, {**IMG, "visual_annotations": [3]},
                  {**IMG, "visual_annotations": ["x"]}, "not a dict"])
    assert torch.isnan(out["perception_r1"]).all()
    reasons = reward.last_info["nan_samples"]
    assert "visual_annotations" in reasons[0] and "visual_annotations" in reasons[1] and "not a string" in reasons[2]
    assert "completion is not a string" in reasons[3] and "not a dict" in reasons[4]
    claim = build("claimdiff", tiny, media)
    assert torch.isnan(claim(["a cat"], None, [IMG])["claimdiff"]).all()
    assert "solution" in claim.last_info["nan_samples"][0]
    # metadata=None: nothing to judge against
    assert torch.isnan(reward(["a", "b"], None, None)["perception_r1"]).all()
    # a template field from the metadata that a sample lacks
    fielded = build("perception_r1", tiny, media, template="{meta[organ]}: {annotation} in {response}? yes or no")
    out = fielded(["a cat", "a cat"], None, [{**sample_meta(0), "organ": "lung"}, sample_meta(0)])
    assert torch.isfinite(out["perception_r1"][0]) and torch.isnan(out["perception_r1"][1])
    assert "organ" in fielded.last_info["nan_samples"][1]


@pytest.mark.parametrize("name", NAMES)
def test_unparseable_responses_are_counted_zeros(name, tiny, media):
    reads_think = name in ("perception_r1", "pest_feature", "video_ver")
    reward = build(name, tiny, media, **({"part": "think"} if reads_think else {}))
    twice = "<think>a</think><think>b</think>" if reads_think else "<answer>a cat</answer><answer>a dog</answer>"
    bad = ["", twice + "<answer>c</answer>", "<think></think><answer></answer>"]
    out = reward(bad, None, [sample_meta(1)] * 3)
    assert out[name].tolist() == [0.0, 0.0, 0.0]
    info = reward.last_info
    assert info["num_unparseable"] == 3 and info["num_nan"] == 0 and sorted(info["unparseable_samples"]) == [0, 1, 2]
    assert info["judge_forwards"] == 0  # the judge is not asked about unreadable responses


def test_judge_failures_are_nan_and_a_failing_chunk_is_retried(tiny, media, monkeypatch):
    reward = build("perception_r1", tiny, media)
    fix_judge(monkeypatch, reward, {"a red cat": 0.9, "two dogs on the left": JudgeFailure("judge forward failed: boom")})
    out = reward(RESPONSES[:2], None, METADATA[:2])
    assert out["perception_r1"][0].item() == pytest.approx(0.9) and torch.isnan(out["perception_r1"][1])
    assert reward.last_info["nan_samples"][1] == "judge forward failed: boom"
    assert reward.last_info["judge"][1][1]["error"] == "judge forward failed: boom"

    # a real forward that fails on batches: the chunk is re-run one query at a time, same scores
    batched = build("pest_feature", tiny, media, batch_size=8)
    expected = build("pest_feature", tiny, media, batch_size=1)(RESPONSES, PROMPTS, METADATA)["pest_feature"]
    real = batched.judge._forward

    def flaky(inputs, keep):
        if inputs["input_ids"].shape[0] > 1:
            raise RuntimeError("out of memory")
        return real(inputs, keep)

    monkeypatch.setattr(batched.judge, "_forward", flaky)
    torch.testing.assert_close(batched(RESPONSES, PROMPTS, METADATA)["pest_feature"], expected, rtol=1e-4, atol=1e-5)
    # and a query that fails alone is NaN for its sample only
    monkeypatch.setattr(batched.judge, "_forward", lambda inputs, keep: (_ for _ in ()).throw(RuntimeError("bad")))
    out = batched(RESPONSES[:2], PROMPTS[:2], METADATA[:2])
    assert torch.isnan(out["pest_feature"]).all() and "RuntimeError: bad" in batched.last_info["nan_samples"][0]
