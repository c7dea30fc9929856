"""VLM-as-judge (vlm_judge, prompt_echo) on the tiny Qwen2.5-VL, the DINOv2 reference reward, the set-level
diversity reward and the segmental video reward: each checked against an independent computation of the same
quantity (plain per-sample forwards, brute force), plus the NaN and missing-weights behaviour."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from mmrl.rewards import MissingWeightsError, Reward, build_reward
from mmrl.rewards.diversity import SetDiversity, leave_one_out_credit, pairwise_distances
from mmrl.rewards.reference import DinoEmbedder, DinoReference
from mmrl.rewards.video import SegmentalVideoReward, attenuation_weights, segment_frame_indices
from mmrl.rewards.vlm_judge import PromptEcho, VLMJudge


def random_images(n, h=56, w=56, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(n)]


def pil_to_tensor(images):
    return torch.stack([torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1) for im in images])


# --------------------------------------------------------------------------------------------
# the tiny Qwen2.5-VL
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrl.pipelines.vlm.tiny import ensure_tiny_vlm

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MMRL_CACHE", str(tmp_path_factory.mktemp("mmrl_cache")))
        path = ensure_tiny_vlm("qwen2_5_vl")
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        processor = AutoProcessor.from_pretrained(path)
        yield model, processor, path


def chat(processor, text):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


YES = ["yes", "Yes", " yes", " Yes"]  # single tokens of the tiny vocabulary ("YES" is not)
NO = ["no", "No", " no", " No"]


def reference_p_yes(model, processor, image, question):
    """One sample, no padding, full logits: softmax over the yes/no token variants, summed over yes."""
    inputs = processor(text=[chat(processor, question)], images=[image], return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1].double()
    tok = processor.tokenizer
    ids = [tok(w, add_special_tokens=False)["input_ids"] for w in YES + NO]
    assert all(len(i) == 1 for i in ids)
    ids = [i[0] for i in ids]
    p = torch.softmax(logits[ids], dim=0)
    return float(p[: len(YES)].sum())


def test_vlm_judge_matches_plain_forward(tiny_vlm):
    model, processor, _ = tiny_vlm
    judge = VLMJudge(model, processor, device="cpu", batch_size=3)
    assert judge.yes_ids == [processor.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in YES]
    # different sizes -> different numbers of image tokens -> left padding inside the batch
    images = random_images(2, 56, 56, 1) + random_images(2, 84, 112, 2) + random_images(1, 140, 56, 3)
    prompts = ["a red cat", "a dog", "two cats on the left", "a blue car", "a person"]
    out = judge(images, prompts)
    expected = [reference_p_yes(model, processor, im, f"Does this image match the description: {p}? Answer yes or no.")
                for im, p in zip(images, prompts)]
    torch.testing.assert_close(out["vlm_judge"], torch.tensor(expected, dtype=torch.float32), rtol=1e-4, atol=1e-5)
    assert ((out["vlm_judge"] > 0) & (out["vlm_judge"] < 1)).all()
    p = out["vlm_judge"].double()
    torch.testing.assert_close(out["logit_yes_no"].double(), torch.log(p / (1 - p)), rtol=1e-3, atol=1e-3)
    # tensors in [0, 1] are the same images
    torch.testing.assert_close(judge(pil_to_tensor(images[:2]), prompts[:2])["vlm_judge"], out["vlm_judge"][:2],
                               rtol=1e-5, atol=1e-6)


def test_vlm_judge_template_fields_and_nan(tiny_vlm):
    model, processor, _ = tiny_vlm
    judge = build_reward("vlm_judge", model=model, processor=processor, template="Is there a {object} in {prompt}?")
    images = random_images(3)
    x = pil_to_tensor(images)
    x[2, 0, 0, 0] = float("nan")
    out = judge(x, ["this image", "the picture", "it"], [{"object": "cat"}, {}, {"object": "dog"}])
    expected = reference_p_yes(model, processor, images[0], "Is there a cat in this image?")
    assert out["vlm_judge"][0].item() == pytest.approx(expected, rel=1e-4)
    assert torch.isnan(out["vlm_judge"][1:]).all()
    reasons = judge.last_info["nan_samples"]
    assert "template" in reasons[1] and "object" in reasons[1] and "non-finite" in reasons[2]
    with pytest.raises(ValueError, match="needs"):
        judge(x, None)
    # a field of a type its format spec cannot take is that sample's NaN, not the batch's TypeError
    typed = build_reward("vlm_judge", model=model, processor=processor, template="Is {prompt} {n:.2f} {x[0]}?")
    out = typed(x[:2], ["a", "b"], [{"n": 1.0, "x": ["c"]}, {"n": None, "x": 5}])
    assert torch.isfinite(out["vlm_judge"][0]) and torch.isnan(out["vlm_judge"][1])
    assert "TypeError" in typed.last_info["nan_samples"][1]


def test_vlm_judge_loads_tiny_by_name(tiny_vlm, monkeypatch, tmp_path):
    model, processor, path = tiny_vlm
    monkeypatch.setenv("MMRL_CACHE", str(path.parent))
    by_name = build_reward("vlm_judge", model="tiny:qwen2_5_vl", device="cpu", dtype="float32")
    by_dir = build_reward("vlm_judge", model=str(path), device="cpu", dtype="float32")
    images, prompts = random_images(2), ["a cat", "a dog"]
    expected = VLMJudge(model, processor)(images, prompts)["vlm_judge"]
    torch.testing.assert_close(by_name(images, prompts)["vlm_judge"], expected)
    torch.testing.assert_close(by_dir(images, prompts)["vlm_judge"], expected)


def reference_echo(model, processor, image, prompt, query="Describe this image in detail."):
    """One sample: the templated prefix and the prompt as one string, a full forward, the prompt's last tokens."""
    tok = processor.tokenizer
    target = tok(prompt, add_special_tokens=False)["input_ids"]
    inputs = processor(text=[chat(processor, query) + prompt], images=[image], return_tensors="pt")
    assert inputs["input_ids"][0, -len(target):].tolist() == target  # the prompt tokenises the same at the end
    with torch.no_grad():
        logits = model(**inputs).logits[0].double()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    ids = inputs["input_ids"][0, 1:]
    picked = logp[torch.arange(len(ids)), ids][-len(target):]
    return float(picked.mean()), float(picked.sum()), len(target)


def test_prompt_echo_matches_teacher_forced_forward(tiny_vlm):
    model, processor, _ = tiny_vlm
    echo = PromptEcho(model, processor, device="cpu", batch_size=4)
    images = random_images(2, 56, 56, 4) + random_images(2, 112, 84, 5) + random_images(1, 56, 140, 6)
    prompts = ["a red cat", "a dog on the left of a car", "cat", "two blue cars and a person", "a photo of a dog"]
    out = echo(images, prompts)
    expected = [reference_echo(model, processor, im, p) for im, p in zip(images, prompts)]
    torch.testing.assert_close(out["prompt_echo"], torch.tensor([e[0] for e in expected], dtype=torch.float32),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out["sum_logprob"], torch.tensor([e[1] for e in expected], dtype=torch.float32),
                               rtol=1e-4, atol=1e-3)
    assert out["num_tokens"].tolist() == [float(e[2]) for e in expected]
    assert (out["prompt_echo"] < 0).all()
    # the image matters: the same prompt with another image scores differently
    other = echo(random_images(1, 56, 56, 9), prompts[:1])["prompt_echo"]
    assert other.item() != pytest.approx(out["prompt_echo"][0].item(), abs=1e-6)
    # an empty prompt cannot be echoed
    bad = echo(images[:2], ["", "a cat"])
    assert torch.isnan(bad["prompt_echo"][0]) and "empty prompt" in echo.last_info["nan_samples"][0]


def test_prompt_echo_include_eos_scores_one_more_token(tiny_vlm):
    model, processor, _ = tiny_vlm
    images, prompts = random_images(2), ["a red cat", "a dog"]
    plain = PromptEcho(model, processor)(images, prompts)
    with_eos = PromptEcho(model, processor, include_eos=True)(images, prompts)
    assert (with_eos["num_tokens"] == plain["num_tokens"] + 1).all()
    assert not torch.allclose(with_eos["sum_logprob"], plain["sum_logprob"])


def test_vlm_missing_weights_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    for name in ("vlm_judge", "prompt_echo"):
        with pytest.raises(MissingWeightsError) as err:
            build_reward(name)
        msg = str(err.value)
        assert "Qwen/Qwen2.5-VL-7B-Instruct" in msg and "config.json" in msg and "model.safetensors" in msg
        assert "HF_HUB_OFFLINE" in msg
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingWeightsError, match="preprocessor_config.json"):
        build_reward("vlm_judge", model=str(tmp_path / "empty"))


# --------------------------------------------------------------------------------------------
# DINOv2 reference reward
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dino():
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          image_size=28, patch_size=7)
    model = Dinov2Model(config).eval()
    processor = BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 28, "width": 28}, resample=3,
                                  image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    return model, processor


def reference_cls(model, processor, images):
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        hidden = model(pixel_values=pixels).last_hidden_state
    return hidden[:, 0]  # Dinov2Model's last_hidden_state is after the final LayerNorm: its CLS token


def test_dino_reference_matches_cls_cosine(tiny_dino, tmp_path):
    model, processor = tiny_dino
    reward = build_reward("dino_reference", model=model, processor=processor, device="cpu")
    images = random_images(4, 40, 48, seed=1)
    refs = random_images(2, 36, 30, seed=2)
    refs[0].save(tmp_path / "ref0.png")
    meta = [{"reference_image": str(tmp_path / "ref0.png")}, {"reference_image": refs[1]},
            {"reference_image": pil_to_tensor([refs[1]])[0]}, {"reference_image": tmp_path / "ref0.png"}]
    out = reward(images, None, meta)["dino_reference"]
    gen, ref = reference_cls(model, processor, images), reference_cls(model, processor, [refs[0], refs[1]])
    expected = F.cosine_similarity(gen, ref[[0, 1, 1, 0]], dim=-1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # an image is its own best reference
    same = reward(images[:1], None, [{"reference_image": images[0]}])["dino_reference"]
    assert same.item() == pytest.approx(1.0, abs=1e-5)


def test_dino_reference_embeds_each_reference_once(tiny_dino, tmp_path):
    model, processor = tiny_dino
    reward = DinoReference(model, processor)
    Image.fromarray(np.zeros((30, 30, 3), dtype=np.uint8)).save(tmp_path / "r.png")
    calls = []
    embedder = reward.embedder

    class Spy:
        def __call__(self, images):
            calls.append(len(images))
            return embedder(images)

    reward.embedder = Spy()
    meta = [{"reference_image": str(tmp_path / "r.png")}] * 4
    reward(random_images(4), None, meta)
    assert calls == [1, 4]  # one reference, four generated images
    reward(random_images(4), None, meta)
    assert calls == [1, 4, 4]  # the path's embedding is cached


def test_dino_reference_nan_reasons(tiny_dino, tmp_path):
    model, processor = tiny_dino
    reward = build_reward("dino_reference", model=model, processor=processor)
    meta = [{}, {"reference_image": str(tmp_path / "missing.png")}, {"reference_image": 3}, None,
            {"reference_image": random_images(1)[0]}]
    out = reward(random_images(5), None, meta)["dino_reference"]
    assert torch.isnan(out[:4]).all() and torch.isfinite(out[4])
    reasons = reward.last_info["nan_samples"]
    assert "no 'reference_image'" in reasons[0] and "does not exist" in reasons[1]
    assert "must be a path" in reasons[2] and "no 'reference_image'" in reasons[3]


def test_dino_loads_from_local_dir_and_missing_weights(tiny_dino, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    model, processor = tiny_dino
    model.save_pretrained(tmp_path / "dino")
    processor.save_pretrained(tmp_path / "dino")
    images, meta = random_images(2), [{"reference_image": im} for im in random_images(2, seed=5)]
    loaded = build_reward("dino_reference", model=str(tmp_path / "dino"), device="cpu")
    direct = build_reward("dino_reference", model=model, processor=processor)
    torch.testing.assert_close(loaded(images, None, meta)["dino_reference"],
                               direct(images, None, meta)["dino_reference"], rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(MissingWeightsError) as err:
        build_reward("dino_reference")
    assert "facebook/dinov2-base" in str(err.value) and "model.safetensors" in str(err.value)
    with pytest.raises(MissingWeightsError):
        build_reward("set_diversity")  # its default encoder is the same DINOv2


# --------------------------------------------------------------------------------------------
# set-level diversity
# --------------------------------------------------------------------------------------------


def test_leave_one_out_hand_worked():
    d = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 3.0], [2.0, 3.0, 0.0]])
    # D(S) = (1 + 2 + 3) / 3 = 2; without 1: 3; without 2: 2; without 3: 1
    credit, score = leave_one_out_credit(d, "mean_pairwise")
    assert score == pytest.approx(2.0) and credit.tolist() == pytest.approx([-1.0, 0.0, 1.0])
    credit, score = leave_one_out_credit(d, "sum_pairwise")  # sum over pairs: credit = row sums
    assert score == pytest.approx(6.0) and credit.tolist() == pytest.approx([3.0, 4.0, 5.0])
    # two members: D(S) = d12, D of a singleton = 0
    credit, score = leave_one_out_credit(torch.tensor([[0.0, 0.5], [0.5, 0.0]]))
    assert score == pytest.approx(0.5) and credit.tolist() == pytest.approx([0.5, 0.5])


@pytest.mark.parametrize("set_score", ["mean_pairwise", "sum_pairwise"])
def test_leave_one_out_brute_force(set_score):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g)
    d = pairwise_distances(x, "euclidean")

    def score(members):
        pairs = [float(torch.dist(x[a], x[b])) for a, b in itertools.combinations(members, 2)]
        if not pairs:
            return 0.0
        return sum(pairs) / len(pairs) if set_score == "mean_pairwise" else sum(pairs)

    credit, total = leave_one_out_credit(d, set_score)
    full = list(range(6))
    assert total == pytest.approx(score(full), rel=1e-5)
    expected = [score(full) - score([j for j in full if j != i]) for i in full]
    assert credit.tolist() == pytest.approx(expected, rel=1e-4, abs=1e-5)


def colour_encoder(images):
    """A fake image encoder: the mean RGB colour."""
    return torch.stack([torch.from_numpy(np.asarray(im, dtype=np.float32).reshape(-1, 3).mean(0)) for im in images])


def solid(rgb, size=8):
    return Image.fromarray(np.full((size, size, 3), rgb, dtype=np.uint8))


def test_set_diversity_groups_and_outliers():
    reward = build_reward("set_diversity", encoder=colour_encoder, distance="euclidean")
    # group "a": two near-duplicates and one outlier; group "b": two images
    images = [solid((10, 10, 10)), solid((12, 10, 10)), solid((200, 10, 10)), solid((0, 0, 0)), solid((0, 0, 30))]
    meta = [{"group": "a"}] * 3 + [{"group": "b"}] * 2
    out = reward(images, None, meta)
    x = colour_encoder(images)
    for members in ([0, 1, 2], [3, 4]):
        c, s = leave_one_out_credit(pairwise_distances(x[members], "euclidean"))
        torch.testing.assert_close(out["set_diversity"][members], c)
        assert out["group_score"][members].tolist() == pytest.approx([s] * len(members))
    assert out["set_diversity"][2] > 0 > out["set_diversity"][0]  # the outlier earns, the duplicates lose
    assert out["mean_distance"][3].item() == pytest.approx(30.0)


def test_set_diversity_group_rules_and_nan():
    images = [solid((k * 40, 0, 0)) for k in range(6)]
    by_size = build_reward("set_diversity", encoder=colour_encoder, group_size=3)(images)
    by_prompt = build_reward("set_diversity", encoder=colour_encoder)(images, ["p"] * 3 + ["q"] * 3)
    torch.testing.assert_close(by_size["set_diversity"], by_prompt["set_diversity"])
    whole = build_reward("set_diversity", encoder=colour_encoder)(images)  # no groups: the whole batch
    assert whole["group_score"].unique().numel() == 1
    with pytest.raises(ValueError, match="multiple of group_size"):
        build_reward("set_diversity", encoder=colour_encoder, group_size=4)(images)
    # a bad image leaves its group of two with one member: both NaN, with reasons
    x = pil_to_tensor(images[:4])
    x[1, 0, 0, 0] = float("nan")
    reward = SetDiversity(encoder=colour_encoder, group_size=2)
    out = reward(x)
    assert torch.isnan(out["set_diversity"][:2]).all() and torch.isfinite(out["set_diversity"][2:]).all()
    reasons = reward.last_info["nan_samples"]
    assert "non-finite" in reasons[1] and "no other judgeable member" in reasons[0]


def test_set_diversity_with_tiny_dino(tiny_dino):
    model, processor = tiny_dino
    reward = build_reward("set_diversity", encoder=model, processor=processor, group_size=4)
    images = random_images(8, seed=7)
    out = reward(images)
    emb = DinoEmbedder(model, processor)(images)
    for members in (list(range(4)), list(range(4, 8))):
        c, _ = leave_one_out_credit(pairwise_distances(emb[members], "cosine"))
        torch.testing.assert_close(out["set_diversity"][members], c, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------------------
# segmental video reward
# --------------------------------------------------------------------------------------------


def test_segment_frame_indices():
    assert segment_frame_indices(16, 4, "first") == [0, 4, 8, 12]
    assert segment_frame_indices(16, 4, "middle") == [2, 6, 10, 14]
    assert segment_frame_indices(3, 4, "first") == [0, 1, 2]  # fewer frames than segments
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        idx = segment_frame_indices(10, 4, "tsn", g)  # span 2: frames 8, 9 are never used
        assert [i // 2 for i in idx] == [0, 1, 2, 3]
    a = segment_frame_indices(64, 8, "tsn", torch.Generator().manual_seed(3))
    b = segment_frame_indices(64, 8, "tsn", torch.Generator().manual_seed(3))
    assert a == b
    with pytest.raises(ValueError):
        segment_frame_indices(8, 2, "random")


def test_attenuation_weights():
    w = attenuation_weights([0, 4, 8, 12], 16, 1.0)
    assert w.tolist() == pytest.approx([math.exp(-8), math.exp(-4), 1.0, math.exp(-4)])
    assert attenuation_weights([0, 4, 8, 12], 16, 0.0).tolist() == [1.0] * 4


class FrameValue(Reward):
    """An image reward: the mean pixel value; NaN for a frame whose mean is exactly 0.5 (to test propagation)."""

    name = "frame_value"
    needs_prompts = False

    def _score(self, batch, reasons):
        v = torch.empty(len(batch.valid_indices))
        for pos, x in batch.float_groups():
            v[pos] = x.mean(dim=(1, 2, 3))
        v[(v - 0.5).abs() < 1e-6] = float("nan")
        return {self.name: v}


def ramp_video(t, h=4, w=4, offset=0.0):
    """Frame f has every pixel (f + 1) / (t + 3) + offset (never 0.5 for even t)."""
    return torch.stack([torch.full((3, h, w), (f + 1) / (t + 3) + offset) for f in range(t)])


def test_video_reward_segmental_attenuated():
    videos = torch.stack([ramp_video(16), ramp_video(16, offset=0.01)])
    reward = SegmentalVideoReward(FrameValue(), segments=4, sampling="first")
    out = reward(videos)
    idx = [0, 4, 8, 12]
    for n, off in enumerate((0.0, 0.01)):
        r = torch.tensor([(f + 1) / 19 + off for f in idx])
        w = torch.exp(-torch.tensor([abs(f - 8) for f in idx], dtype=torch.float32))
        assert out["video_segmental"][n].item() == pytest.approx(float((w * r).mean()), rel=1e-5)
        assert out["frame_mean"][n].item() == pytest.approx(float(r.mean()), rel=1e-5)
    normalized = SegmentalVideoReward(FrameValue(), segments=4, sampling="first", normalize_weights=True)(videos)
    r = torch.tensor([(f + 1) / 19 for f in idx])
    w = torch.exp(-torch.tensor([abs(f - 8) for f in idx], dtype=torch.float32))
    assert normalized["video_segmental"][0].item() == pytest.approx(float((w * r).sum() / w.sum()), rel=1e-5)
    plain = SegmentalVideoReward(FrameValue(), segments=4, sampling="first", attenuation=False)(videos)
    torch.testing.assert_close(plain["video_segmental"], plain["frame_mean"])


def test_video_reward_tsn_is_seeded_and_wraps_registered_rewards():
    videos = torch.rand(3, 12, 3, 8, 8)
    a = build_reward("video_segmental", image_reward="brightness", segments=3, seed=1)(videos)
    b = build_reward("video_segmental", image_reward="brightness", segments=3, seed=1)(videos)
    torch.testing.assert_close(a["video_segmental"], b["video_segmental"])
    # independent: the same generator draws, brightness of the chosen frames, TAR weights, mean over segments
    g = torch.Generator().manual_seed(1)
    for n in range(3):
        idx = [k * 4 + int(o) for k, o in enumerate(torch.randint(4, (3,), generator=g))]
        r = videos[n, idx].mean(dim=(1, 2, 3))
        w = torch.exp(-torch.tensor([abs(f - 6) for f in idx], dtype=torch.float32))
        assert a["video_segmental"][n].item() == pytest.approx(float((w * r).mean()), rel=1e-5)


def test_video_reward_lists_uint8_and_nan():
    reward = SegmentalVideoReward(FrameValue(), segments=2, sampling="first", attenuation=False)
    videos = [ramp_video(4), ramp_video(6, h=6, w=5), (ramp_video(4) * 255).round().to(torch.uint8),
              ramp_video(4).clone(), torch.zeros(3, 4, 4), ramp_video(8)]
    videos[3][2, 0, 0, 0] = float("nan")
    videos[5][4] = 0.5  # frame 4 (the 2nd segment's first frame) makes the image reward return NaN
    out = reward(videos)
    assert out["video_segmental"][0].item() == pytest.approx((1 / 7 + 3 / 7) / 2, rel=1e-5)
    assert out["video_segmental"][1].item() == pytest.approx((1 / 9 + 4 / 9) / 2, rel=1e-5)
    assert out["video_segmental"][2].item() == pytest.approx((1 / 7 + 3 / 7) / 2, abs=3e-3)  # uint8 rounding
    assert torch.isnan(out["video_segmental"][3:]).all()
    reasons = reward.last_info["nan_samples"]
    assert "non-finite" in reasons[3] and "not a video tensor" in reasons[4] and "frame not judged" in reasons[5]
    with pytest.raises(ValueError, match=r"\[N, T, 3, H, W\]"):
        reward(torch.rand(2, 3, 8, 8))
    with pytest.raises(ValueError, match="prompts"):
        reward(torch.rand(2, 4, 3, 8, 8), ["only one"])
    with pytest.raises(ValueError, match="image_reward_kwargs"):
        SegmentalVideoReward(FrameValue(), image_reward_kwargs={"x": 1})
