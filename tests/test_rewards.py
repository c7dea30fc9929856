"""Tests of mmrl.rewards: CPU, offline, tiny models built from config, expectations computed
independently (pillow / numpy / the models' own forward) rather than through the code under test."""
from __future__ import annotations

import io
import json
import math
import string

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import mmrl.rewards as R
from mmrl.rewards import (
    ComposedReward,
    MissingWeightsError,
    Reward,
    RewardFn,
    build_reward,
    build_rewards,
    list_rewards,
    register_reward,
)

# --------------------------------------------------------------------------------------------
# helpers (independent of mmrl.rewards._images on purpose)
# --------------------------------------------------------------------------------------------


def quantise(x: torch.Tensor) -> np.ndarray:
    """[N, 3, H, W] float -> N x H x W x 3 uint8, DDPO's round(x * 255) clipped, via numpy."""
    return np.clip(np.round(x.numpy().astype(np.float64) * 255.0), 0, 255).astype(np.uint8).transpose(0, 2, 3, 1)


def to_pils(x: torch.Tensor) -> list[Image.Image]:
    return [Image.fromarray(a) for a in quantise(x)]


def jpeg_kb(array: np.ndarray, quality: int = 95) -> float:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="JPEG", quality=quality)
    return len(buf.getvalue()) / 1000.0


def grid_images(n: int = 4, h: int = 24, w: int = 20, seed: int = 0) -> torch.Tensor:
    """Random images whose values are exact multiples of 1/255 (so PIL and tensor agree)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=g).float() / 255.0


def flat(rgb, h=8, w=8) -> torch.Tensor:
    return torch.tensor(rgb, dtype=torch.float32).view(3, 1, 1).expand(3, h, w).clone()


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------


def test_registry_lists_all_rewards():
    names = list_rewards()
    for name in ["brightness", "saturation", "colorfulness", "jpeg_compressibility",
                 "jpeg_incompressibility", "pickscore", "hpsv2"]:
        assert name in names
    assert names == sorted(names)


def test_unknown_reward_names_nearest_and_lists_all():
    with pytest.raises(ValueError) as err:
        build_reward("pickscor")
    msg = str(err.value)
    assert "'pickscore'" in msg and "did you mean" in msg
    for name in list_rewards():
        assert name in msg
    with pytest.raises(ValueError, match="jpeg_compressibility"):
        build_reward("jpeg_compresibility")


def test_unknown_reward_kwarg_names_nearest():
    with pytest.raises(ValueError, match="did you mean 'quality'"):
        build_reward("jpeg_compressibility", qualty=90)


def test_register_duplicate_name_rejected():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("brightness")(type("Other", (Reward,), {}))


def test_rewards_satisfy_protocol():
    for name in ["brightness", "saturation", "colorfulness", "jpeg_compressibility", "jpeg_incompressibility"]:
        reward = build_reward(name)
        assert isinstance(reward, RewardFn)
        assert reward.name == name and reward.needs_prompts is False


def test_package_import_does_not_import_model_libraries():
    import subprocess
    import sys

    code = (
        "import sys, mmrl.rewards as r; r.build_reward('brightness');"
        "print(sorted(m for m in ('transformers', 'open_clip') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------
# JPEG
# --------------------------------------------------------------------------------------------


def test_jpeg_sizes_match_pillow_in_kb():
    x = torch.rand(3, 3, 32, 48)
    x[0] = 0.5  # flat
    expected = torch.tensor([jpeg_kb(a) for a in quantise(x)])
    inc = build_reward("jpeg_incompressibility")(x, None)
    com = build_reward("jpeg_compressibility")(x, None)
    torch.testing.assert_close(inc["jpeg_incompressibility"], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(com["jpeg_compressibility"], -expected / 500, rtol=0, atol=1e-8)  # Flow-GRPO's scale
    torch.testing.assert_close(com["jpeg_size_kb"], expected, rtol=0, atol=1e-6)
    assert inc["jpeg_incompressibility"].dtype == torch.float32
    assert inc["jpeg_incompressibility"].device.type == "cpu"
    # kB is bytes / 1000: a byte count is an integer
    assert torch.allclose(expected * 1000, (expected * 1000).round())


def test_jpeg_flat_more_compressible_than_noise():
    x = torch.stack([flat([0.3, 0.6, 0.2], 64, 64), torch.rand(3, 64, 64)])
    scores = build_reward("jpeg_compressibility")(x, None)["jpeg_compressibility"]
    assert scores[0] > scores[1]
    inc = build_reward("jpeg_incompressibility")(x, None)["jpeg_incompressibility"]
    assert inc[1] > inc[0]


def test_jpeg_scale_divisor_flow_grpo_default_ddpo_on_request():
    x = grid_images(2)
    ddpo = build_reward("jpeg_compressibility", scale_divisor=1)(x, None)["jpeg_compressibility"]
    default = build_reward("jpeg_compressibility")(x, None)["jpeg_compressibility"]
    torch.testing.assert_close(default, ddpo / 500)  # Flow-GRPO: -size_kb / 500
    inc = build_reward("jpeg_incompressibility")(x, None)["jpeg_incompressibility"]
    torch.testing.assert_close(inc, -ddpo)  # incompressibility: the size itself in both anchors


# --------------------------------------------------------------------------------------------
# pixel statistics
# --------------------------------------------------------------------------------------------


def test_brightness_known_values():
    half = torch.zeros(3, 8, 8)
    half[:, :, :4] = 1.0
    x = torch.stack([flat([1, 0, 0]), half, flat([0.2, 0.4, 0.6]), torch.ones(3, 8, 8)])
    got = build_reward("brightness")(x, None)["brightness"]
    torch.testing.assert_close(got, torch.tensor([1 / 3, 0.5, 0.4, 1.0]))


def test_saturation_known_values():
    x = torch.stack([flat([1, 0, 0]), flat([0.5, 0.5, 0.5]), torch.zeros(3, 8, 8), flat([0.8, 0.4, 0.2])])
    got = build_reward("saturation")(x, None)["saturation"]
    torch.testing.assert_close(got, torch.tensor([1.0, 0.0, 0.0, 0.75]))


def test_colorfulness_known_values():
    red_blue = torch.zeros(3, 8, 8)
    red_blue[0, :, :4] = 1.0  # left half pure red
    red_blue[2, :, 4:] = 1.0  # right half pure blue
    x = torch.stack([flat([0.5, 0.5, 0.5]), flat([1, 0, 0]), red_blue])
    got = build_reward("colorfulness")(x, None)["colorfulness"]
    # Hasler & Suesstrunk on 0-255: rg = R - G, yb = (R + G)/2 - B
    red = 0.3 * math.hypot(255.0, 127.5)
    # red pixels: rg=255, yb=127.5; blue pixels: rg=0, yb=-255 (half each)
    std = math.hypot(127.5, (127.5 + 255.0) / 2)
    mean = math.hypot(127.5, (127.5 - 255.0) / 2)
    torch.testing.assert_close(got, torch.tensor([0.0, red, std + 0.3 * mean]))


def test_pixel_rewards_pil_and_different_sizes():
    pils = [Image.new("RGB", (10, 6), (255, 0, 0)), Image.new("RGB", (7, 9), (51, 102, 153)),
            Image.new("L", (5, 5), 255)]
    got = build_reward("brightness")(pils, None)["brightness"]
    torch.testing.assert_close(got, torch.tensor([1 / 3, (51 + 102 + 153) / 3 / 255, 1.0]))


# --------------------------------------------------------------------------------------------
# input forms, NaN for unjudgeable samples, wrong-shaped batches
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["brightness", "saturation", "colorfulness",
                                  "jpeg_compressibility", "jpeg_incompressibility"])
def test_pil_and_tensor_inputs_agree(name):
    x = grid_images(4)
    reward = build_reward(name)
    a = reward(x, ["p"] * 4)[name]
    b = reward(to_pils(x), ["p"] * 4)[name]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_uint8_tensor_input_accepted():
    x = grid_images(2)
    u8 = torch.from_numpy(quantise(x)).permute(0, 3, 1, 2).contiguous()
    reward = build_reward("brightness")
    torch.testing.assert_close(reward(u8, None)["brightness"], reward(x, None)["brightness"])


@pytest.mark.parametrize("name", ["brightness", "colorfulness", "jpeg_compressibility"])
def test_non_finite_image_gives_nan_with_reason(name):
    x = grid_images(3)
    x[1, 0, 2, 3] = float("nan")
    x[2, 1, 0, 0] = float("inf")
    reward = build_reward(name)
    out = reward(x, None)[name]
    assert out.shape == (3,)
    assert torch.isfinite(out[0]) and torch.isnan(out[1]) and torch.isnan(out[2])
    info = reward.last_info
    assert info["num_samples"] == 3 and info["num_nan"] == 2
    assert "non-finite" in info["nan_samples"][1] and "non-finite" in info["nan_samples"][2]
    assert info["reasons"] == {"non-finite pixel values (NaN or inf)": 2}
    # the good sample scores as it would alone
    alone = reward(x[:1], None)[name]
    torch.testing.assert_close(out[:1], alone)


def test_bad_list_entry_gives_nan_with_reason():
    pils = [Image.new("RGB", (8, 8), (10, 20, 30)), None, "not an image"]
    reward = build_reward("jpeg_incompressibility")
    out = reward(pils, None)["jpeg_incompressibility"]
    assert torch.isfinite(out[0]) and torch.isnan(out[1:]).all()
    assert "not a PIL image" in reward.last_info["nan_samples"][1]
    assert reward.last_info["num_nan"] == 2


def test_out_of_range_values_are_clipped():
    x = torch.stack([flat([1.5, -0.2, 0.5]), flat([1.0, 0.0, 0.5])])
    out = build_reward("brightness")(x, None)["brightness"]
    torch.testing.assert_close(out[0], out[1])


def test_a_batch_in_minus_one_to_one_is_warned_once(monkeypatch, caplog):
    """Clipped as before (the scores equal the official (x * 255).round().clamp), and said once: a [-1, 1] batch is
    a darker image, not an error."""
    import mmrl.rewards._base as base

    monkeypatch.setattr(base, "_WARNED_RANGE", False)
    with caplog.at_level("WARNING", logger="mmrl.rewards"):
        build_reward("brightness")(torch.stack([flat([0.0, -0.01, 0.5])]), None)  # rounding noise: quiet
        assert "rewards take float images in [0, 1]" not in caplog.text
        build_reward("brightness")(torch.stack([flat([-1.0, 0.2, 0.5])]), None)
        build_reward("brightness")(torch.stack([flat([-0.9, 0.2, 0.5])]), None)
    assert caplog.text.count("reward images reach -1: rewards take float images in [0, 1]") == 1


@pytest.mark.parametrize(
    "images, prompts, metadata, match",
    [
        (torch.rand(3, 8, 8), None, None, r"\[N, 3, H, W\]"),
        (torch.rand(2, 4, 8, 8), None, None, r"\[N, 3, H, W\]"),
        (torch.rand(2, 3, 8, 8), ["a"], None, "2 images but 1 prompts"),
        (torch.rand(2, 3, 8, 8), ["a", "b"], [{}], "2 images but 1 metadata"),
        (torch.rand(2, 3, 8, 8), "ab", None, "prompts must be a list"),
    ],
)
def test_wrong_shaped_batch_raises(images, prompts, metadata, match):
    with pytest.raises(ValueError, match=match):
        build_reward("brightness")(images, prompts, metadata)


def test_wrong_image_type_raises():
    with pytest.raises(TypeError):
        build_reward("brightness")(np.zeros((2, 3, 8, 8)), None)
    with pytest.raises(TypeError):
        build_reward("brightness")(torch.zeros(2, 3, 8, 8, dtype=torch.int64), None)


def test_empty_batch():
    out = build_reward("brightness")(torch.rand(0, 3, 8, 8), [])
    assert out["brightness"].shape == (0,)


# --------------------------------------------------------------------------------------------
# composition
# --------------------------------------------------------------------------------------------


class Counting(Reward):
    """A test reward: per-image brightness times a constant, counting its calls."""

    name = "counting"

    def __init__(self, factor=1.0):
        super().__init__()
        self.factor = factor
        self.calls = 0

    def _score(self, batch, reasons):
        self.calls += 1
        return {self.name: torch.cat([g.mean(dim=(1, 2, 3)) for _, g in batch.float_groups()]) * self.factor,
                "extra": torch.zeros(len(batch.valid_indices))}


def test_composed_weighted_total():
    x = torch.stack([flat([1, 0, 0]), flat([0.8, 0.4, 0.2])])
    composed = ComposedReward({
        "brightness": (build_reward("brightness"), 2.0),
        "saturation": (build_reward("saturation"), -0.5),
    })
    out = composed(x, ["a", "b"])
    torch.testing.assert_close(out["brightness"], torch.tensor([1 / 3, 1.4 / 3]))
    torch.testing.assert_close(out["saturation"], torch.tensor([1.0, 0.75]))
    torch.testing.assert_close(out["total"], 2.0 * out["brightness"] - 0.5 * out["saturation"])


def test_composed_nan_in_weighted_component_makes_total_nan():
    x = grid_images(3)
    x[1, 0, 0, 0] = float("nan")
    composed = ComposedReward({
        "brightness": (build_reward("brightness"), 1.0),
        "jpeg_incompressibility": (build_reward("jpeg_incompressibility"), 0.1),
    })
    out = composed(x, None)
    assert torch.isnan(out["total"][1]) and torch.isfinite(out["total"][[0, 2]]).all()
    assert "non-finite" in composed.last_info["total"]["nan_samples"][1]
    assert composed.last_info["components"]["brightness"]["num_nan"] == 1


def test_composed_zero_weight_component_is_logged_not_summed():
    x = grid_images(2)
    bright = build_reward("brightness")
    composed = ComposedReward({"brightness": (bright, 1.0), "jpeg_compressibility": (build_reward("jpeg_compressibility"), 0.0)})
    out = composed(x, None)
    torch.testing.assert_close(out["total"], out["brightness"])
    assert "jpeg_compressibility" in out and "jpeg_compressibility/jpeg_size_kb" in out
    assert composed.weights == {"brightness": 1.0}  # what enters the advantage
    assert composed.all_weights == {"brightness": 1.0, "jpeg_compressibility": 0.0}


def test_composed_calls_each_component_once():
    x = grid_images(4)
    a, b = Counting(), Counting(factor=3.0)
    composed = ComposedReward({"a": (a, 1.0), "a_again": (a, 2.0), "b": (b, 1.0)})
    out = composed(x, ["same"] * 4)
    assert a.calls == 1 and b.calls == 1
    torch.testing.assert_close(out["a"], out["a_again"])
    torch.testing.assert_close(out["total"], 3.0 * out["a"] + out["b"])
    assert "a/extra" in out
    composed(to_pils(x), ["same"] * 4)
    assert a.calls == 2 and b.calls == 2


def test_composed_accepts_plain_callable_components():
    def plain(images, prompts, metadata=None):
        assert isinstance(images, torch.Tensor)  # a non-mmrl reward gets the original inputs
        return {"plain": torch.full((images.shape[0],), 2.0)}

    plain.name, plain.needs_prompts = "plain", False
    out = ComposedReward({"plain": (plain, 0.5)})(grid_images(2), None)
    torch.testing.assert_close(out["total"], torch.tensor([1.0, 1.0]))


def test_build_rewards_spec_forms():
    composed = build_rewards({
        "brightness": 1.0,
        "jpeg_compressibility": {"weight": 0.25, "kwargs": {"scale_divisor": 500}},
        "bright_twice": {"reward": "brightness", "weight": 2},
    })
    assert composed.weights == {"brightness": 1.0, "jpeg_compressibility": 0.25, "bright_twice": 2.0}
    assert composed.components["jpeg_compressibility"][0].scale_divisor == 500
    x = grid_images(2)
    out = composed(x, None)
    torch.testing.assert_close(
        out["total"], 3.0 * out["brightness"] + 0.25 * out["jpeg_compressibility"]
    )


def test_build_rewards_errors():
    with pytest.raises(ValueError, match="did you mean 'weight'"):
        build_rewards({"brightness": {"wieght": 1.0}})
    with pytest.raises(ValueError, match="did you mean 'brightness'"):
        build_rewards({"brightnes": 1.0})
    with pytest.raises(ValueError):
        build_rewards({})
    with pytest.raises(ValueError, match="non-finite weight"):
        build_rewards({"brightness": float("nan")})


# --------------------------------------------------------------------------------------------
# PickScore with a tiny random transformers CLIP
# --------------------------------------------------------------------------------------------


def write_tiny_bpe(directory) -> tuple[str, str]:
    """A fixed CLIP BPE vocabulary (letters, word-final letters, a few merges, specials)."""
    vocab = {}
    for c in string.ascii_lowercase:
        vocab[c] = len(vocab)
    for c in string.ascii_lowercase:
        vocab[c + "</w>"] = len(vocab)
    merges = ["c a", "ca t</w>", "d o", "do g</w>", "r e", "re d</w>"]
    for m in merges:
        vocab[m.replace(" ", "")] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    vocab_file, merges_file = directory / "vocab.json", directory / "merges.txt"
    vocab_file.write_text(json.dumps(vocab))
    merges_file.write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return str(vocab_file), str(merges_file)


@pytest.fixture
def tiny_clip(tmp_path):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    vocab_file, merges_file = write_tiny_bpe(tmp_path)
    tokenizer = CLIPTokenizer(vocab=vocab_file, merges=merges_file)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert tokenizer(["a cat"])["input_ids"] == [[bos, 26, 53, eos]]  # "a</w>", "cat</w>": fixed ids
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)
    text = dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=77, projection_dim=8,
                bos_token_id=bos, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    vision = dict(image_size=32, patch_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, projection_dim=8)
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).eval()
    with torch.no_grad():
        model.logit_scale.fill_(math.log(50.0))  # not the init value, so the scale is really used
    return model, processor


def reference_pickscore(model, processor, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """logit_scale.exp() * cos(img, txt), straight from the CLIP sub-modules, no deduplication."""
    pixels = processor.image_processor(images=to_pils(images), return_tensors="pt")["pixel_values"]
    tokens = processor.tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        img = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
        txt = model.text_projection(
            model.text_model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).pooler_output
        )
        return model.logit_scale.exp() * F.cosine_similarity(img, txt, dim=-1)


def test_pickscore_matches_reference(tiny_clip):
    model, processor = tiny_clip
    x = grid_images(5, 40, 36)
    prompts = ["a cat", "a red dog", "a cat", "dog", "a red dog"]
    reward = build_reward("pickscore", model=model, processor=processor, device="cpu")
    out = reward(x, prompts)
    expected = reference_pickscore(model, processor, x, prompts)
    assert set(out) == {"pickscore"}
    torch.testing.assert_close(out["pickscore"], expected.float(), rtol=1e-5, atol=1e-5)
    # the forward's own logits agree too
    inputs = processor(text=prompts, images=to_pils(x), return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**inputs).logits_per_image.diagonal()
    torch.testing.assert_close(out["pickscore"], logits, rtol=1e-5, atol=1e-5)
    # Flow-GRPO's divide-by-26
    flow = build_reward("pickscore", model=model, processor=processor, scale_divisor=26)(x, prompts)
    torch.testing.assert_close(flow["pickscore"], expected / 26, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["pickscore", "clipscore"])
def test_clip_rewards_run_the_text_tower_once_per_unique_prompt(tiny_clip, name):
    model, processor = tiny_clip
    reward = build_reward(name, model=model, processor=processor, batch_size=2)
    seen = []
    original = model.get_text_features

    def spy(**kwargs):
        seen.append(kwargs["input_ids"].shape[0])
        return original(**kwargs)

    model.get_text_features = spy
    try:
        reward(grid_images(6), ["a cat"] * 3 + ["dog"] * 3)
    finally:
        del model.get_text_features
    assert seen == [2]


def test_pickscore_pil_tensor_and_nan(tiny_clip):
    model, processor = tiny_clip
    reward = build_reward("pickscore", model=model, processor=processor)
    x = grid_images(3)
    prompts = ["a cat", "dog", "a red dog"]
    a = reward(x, prompts)["pickscore"]
    b = reward(to_pils(x), prompts)["pickscore"]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    x[1, 2, 3, 4] = float("nan")
    c = reward(x, [prompts[0], prompts[1], 7])["pickscore"]
    assert torch.isnan(c[1:]).all()
    torch.testing.assert_close(c[0], a[0], rtol=1e-6, atol=1e-6)
    assert "non-finite" in reward.last_info["nan_samples"][1]
    assert "prompt is not a string" in reward.last_info["nan_samples"][2]
    with pytest.raises(ValueError, match="needs"):
        reward(x, None)


def test_pickscore_loads_from_local_dirs(tiny_clip, tmp_path):
    model, processor = tiny_clip
    model.save_pretrained(tmp_path / "model")
    processor.save_pretrained(tmp_path / "processor")
    x, prompts = grid_images(2), ["a cat", "dog"]
    loaded = build_reward("pickscore", model=str(tmp_path / "model"), processor=str(tmp_path / "processor"), device="cpu")
    assert type(loaded.processor.image_processor).__name__ == "CLIPImageProcessorPil"  # PIL resizing, as the anchor's
    from transformers import CLIPProcessor
    direct = build_reward("pickscore", model=model,
                          processor=CLIPProcessor.from_pretrained(tmp_path / "processor", backend="pil"))
    torch.testing.assert_close(loaded(x, prompts)["pickscore"], direct(x, prompts)["pickscore"], rtol=1e-5, atol=1e-5)


def test_pickscore_missing_weights_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    assert R._base.hub_offline()  # conftest sets HF_HUB_OFFLINE=1
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(MissingWeightsError) as err:
        build_reward("pickscore")
    msg = str(err.value)
    assert "yuvalkirstain/PickScore_v1" in msg and "config.json" in msg and "model.safetensors" in msg
    assert "models--yuvalkirstain--PickScore_v1" in msg and "HF_HUB_OFFLINE" in msg
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingWeightsError, match="model.safetensors"):
        build_reward("pickscore", model=str(tmp_path / "empty"))
    with pytest.raises(MissingWeightsError, match="does not exist"):
        build_reward("pickscore", model=str(tmp_path / "nowhere"))


# --------------------------------------------------------------------------------------------
# HPSv2 with a tiny open_clip model
# --------------------------------------------------------------------------------------------

OPENAI_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
OPENAI_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


def official_hps_transform(image: Image.Image, size: int, antialias: bool | None = None, fill: float = 0) -> torch.Tensor:
    """tgxs002/HPSv2 866735e ``hpsv2/src/open_clip/transform.py`` ``image_transform(size, is_train=False,
    resize_longest_max=True)``, composed here from torchvision ops in its order: ``_convert_to_rgb_or_rgba``,
    ``ToTensor()``, ``ResizeMaxSize(size, fill=fill)`` (its ``forward`` line by line), ``Normalize`` (OpenAI
    mean/std). ``antialias=None`` calls ``F.resize`` as ResizeMaxSize does, without the argument (torchvision's
    default). Then mmrl's one deviation: a non-square input the original leaves unpadded (longest side already
    ``size``) is padded the same way. RGBA images are converted to RGB (the original keeps a 4th channel the ViT
    cannot take)."""
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode

    img = image.convert("RGB")                                # _convert_to_rgb_or_rgba (RGBA: see above)
    img = TF.to_tensor(img)                                   # ToTensor()
    height, width = img.shape[1:]                             # ResizeMaxSize.forward, tensor branch
    scale = size / float(max(height, width))
    if scale != 1.0:
        new_size = tuple(round(dim * scale) for dim in (height, width))
        if antialias is None:
            img = TF.resize(img, new_size, InterpolationMode.BICUBIC)
        else:
            img = TF.resize(img, new_size, InterpolationMode.BICUBIC, antialias=antialias)
        pad_h = size - new_size[0]
        pad_w = size - new_size[1]
        img = TF.pad(img, padding=[pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=fill)
    elif (height, width) != (size, size):                     # mmrl: pad to the square here too
        pad_h, pad_w = size - height, size - width
        img = TF.pad(img, padding=[pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=fill)
    return TF.normalize(img, list(OPENAI_MEAN), list(OPENAI_STD))  # Normalize(OPENAI_DATASET_MEAN, _STD)


def reference_hps_preprocess(image: Image.Image, size: int) -> torch.Tensor:
    return official_hps_transform(image, size)


def random_image(w: int, h: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    shape = {"RGB": (h, w, 3), "RGBA": (h, w, 4), "L": (h, w)}[mode]
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))


HPS_SIZES = [(512, 512), (640, 384), (384, 640), (100, 50), (37, 90), (224, 112), (300, 300), (61, 61),
             (224, 224), (10, 3), (1000, 997)]


def test_official_transform_premises():
    # the pinned torchvision's F.resize antialiases by default: what the official ResizeMaxSize gets
    import inspect
    import torchvision.transforms.functional as TF

    assert inspect.signature(TF.resize).parameters["antialias"].default is True
    image = random_image(512, 320, 1)
    torch.testing.assert_close(official_hps_transform(image, 224), official_hps_transform(image, 224, True),
                               rtol=0, atol=0)


@pytest.mark.parametrize("antialias", [True, False])
@pytest.mark.parametrize("wh", HPS_SIZES)
def test_hps_preprocess_matches_official_transform(wh, antialias):
    image = random_image(*wh, seed=sum(wh))
    expected = official_hps_transform(image, 224, antialias)
    got = R.hps_preprocess(image, 224, antialias=antialias)
    assert got.shape == expected.shape == (3, 224, 224) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # the tensor path from uint8 pixels gives the same
    pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)[None]
    torch.testing.assert_close(R.hps.hps_preprocess_tensor(pixels, 224, antialias=antialias)[0], expected,
                               rtol=0, atol=1e-6)


def test_hps_preprocess_is_the_float_resize_not_pils():
    # a 512 -> 224 resize on the float tensor: no uint8 rounding, no clamping (bicubic overshoots [0, 1]),
    # and not PIL's bicubic on the uint8 image (the earlier mmrl preprocessing)
    import torchvision.transforms.functional as TF

    mean = torch.tensor(OPENAI_MEAN).view(3, 1, 1)
    std = torch.tensor(OPENAI_STD).view(3, 1, 1)
    edges = np.zeros((512, 512, 3), dtype=np.uint8)  # hard edges: bicubic rings past black and white
    edges[:, 200:330] = 255
    edges[150:360, :, 1] = 255
    pixels = R.hps_preprocess(Image.fromarray(edges), 224) * std + mean
    assert float(pixels.min()) < -0.05 and float(pixels.max()) > 1.03  # not clamped to [0, 1]
    image = random_image(512, 512, 7)
    got = R.hps_preprocess(image, 224)
    pixels = got * std + mean
    off_grid = (pixels * 255 - (pixels * 255).round()).abs()
    assert float(off_grid.mean()) > 0.1  # not on the k / 255 grid: no uint8 rounding after the resize
    pil_way = TF.normalize(TF.to_tensor(image.resize((224, 224), Image.BICUBIC)), list(OPENAI_MEAN), list(OPENAI_STD))
    levels = ((got - pil_way) * std * 255).abs()  # in uint8 steps
    assert float(levels.mean()) > 0.1 and float(levels.max()) > 1.5


def test_hps_preprocess_is_not_a_centre_crop():
    # a wide image: the whole width is kept, black bars above and below
    image = Image.new("RGB", (200, 100), (255, 255, 255))
    got = R.hps_preprocess(image, 224)
    pad_value = torch.from_numpy(-OPENAI_MEAN / OPENAI_STD)
    white = torch.from_numpy((1 - OPENAI_MEAN) / OPENAI_STD)
    torch.testing.assert_close(got[:, 0, 112], pad_value)  # top bar
    torch.testing.assert_close(got[:, 223, 112], pad_value)  # bottom bar
    torch.testing.assert_close(got[:, 112, 0], white)  # left edge is image, not cropped away
    torch.testing.assert_close(got[:, 112, 223], white)
    # 200 x 100 -> 224 x 112: pads of 56 on top and on the bottom
    assert torch.equal(got[:, :56], pad_value.view(3, 1, 1).expand(3, 56, 224))
    assert torch.equal(got[:, 168:], pad_value.view(3, 1, 1).expand(3, 56, 224))
    torch.testing.assert_close(got[:, 56:168], white.view(3, 1, 1).expand(3, 112, 224))


TINY_OPEN_CLIP = {
    "embed_dim": 8,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 16, "head_width": 8, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 2},
}


@pytest.fixture
def tiny_open_clip(tmp_path):
    import open_clip

    (tmp_path / "mmrl-tiny-hps.json").write_text(json.dumps(TINY_OPEN_CLIP))
    open_clip.add_model_config(str(tmp_path / "mmrl-tiny-hps.json"))
    torch.manual_seed(0)
    model = open_clip.create_model("mmrl-tiny-hps", pretrained=None).eval()
    with torch.no_grad():
        model.logit_scale.fill_(math.log(100.0))
    return model


def reference_hps(model, images: list[Image.Image], prompts: list[str]) -> torch.Tensor:
    """HPSv2's formula: diag(image_features @ text_features.T) from the model's own forward."""
    import open_clip

    pixels = torch.stack([reference_hps_preprocess(img, 32) for img in images])
    text = open_clip.get_tokenizer("ViT-H-14")(prompts)
    with torch.no_grad():
        image_features, text_features, _ = model(pixels, text)
    return torch.diagonal(image_features @ text_features.T)


def test_hps_matches_reference_and_is_cosine(tiny_open_clip):
    model = tiny_open_clip
    x = grid_images(4, 40, 24)
    prompts = ["a cat", "a dog", "a cat", "a red car"]
    reward = build_reward("hpsv2", model=model, device="cpu")
    out = reward(x, prompts)["hpsv2"]
    expected = reference_hps(model, to_pils(x), prompts)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert out.abs().max() <= 1.0  # a cosine: logit_scale (100 here) is not applied
    pil = reward(to_pils(x), prompts)["hpsv2"]
    torch.testing.assert_close(out, pil, rtol=0, atol=1e-6)


def test_hps_loads_checkpoint_file(tiny_open_clip, tmp_path):
    model = tiny_open_clip
    ckpt_dir = tmp_path / "hps"
    ckpt_dir.mkdir()
    torch.save({"state_dict": model.state_dict()}, ckpt_dir / "HPS_v2.1_compressed.pt")
    x, prompts = grid_images(2), ["a cat", "a dog"]
    expected = reference_hps(model, to_pils(x), prompts)
    by_file = build_reward("hpsv2", checkpoint=str(ckpt_dir / "HPS_v2.1_compressed.pt"), arch="mmrl-tiny-hps", device="cpu")
    by_dir = build_reward("hpsv2", checkpoint=str(ckpt_dir), arch="mmrl-tiny-hps", device="cpu")
    torch.testing.assert_close(by_file(x, prompts)["hpsv2"], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_dir(x, prompts)["hpsv2"], expected, rtol=1e-5, atol=1e-5)


def test_hps_nan_for_bad_sample(tiny_open_clip):
    reward = build_reward("hpsv2", model=tiny_open_clip)
    x = grid_images(3)
    x[0] = float("inf")
    out = reward(x, ["a", "b", "c"])["hpsv2"]
    assert torch.isnan(out[0]) and torch.isfinite(out[1:]).all()
    assert reward.last_info["num_nan"] == 1


def test_hps_missing_checkpoint_errors(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    missing = tmp_path / "nope" / "HPS_v2.1_compressed.pt"
    with pytest.raises(MissingWeightsError) as err:
        build_reward("hpsv2", checkpoint=str(missing))
    assert str(missing) in str(err.value) and "xswu/HPSv2" in str(err.value)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(MissingWeightsError) as err:
        build_reward("hpsv2")
    msg = str(err.value)
    assert "HPS_v2.1_compressed.pt" in msg and "HF_HUB_OFFLINE" in msg and "checkpoint=" in msg
    assert str(tmp_path / "empty_cache") in msg


def test_composed_model_rewards_share_one_conversion(tiny_clip, tiny_open_clip):
    model, processor = tiny_clip
    composed = ComposedReward({
        "pickscore": (build_reward("pickscore", model=model, processor=processor), 1.0),
        "hpsv2": (build_reward("hpsv2", model=tiny_open_clip), 2.0),
        "jpeg_compressibility": (build_reward("jpeg_compressibility"), 0.0),
    })
    x = grid_images(3)
    prompts = ["a cat", "dog", "a cat"]
    out = composed(x, prompts)
    torch.testing.assert_close(out["pickscore"], reference_pickscore(model, processor, x, prompts), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["total"], out["pickscore"] + 2.0 * out["hpsv2"])


# --------------------------------------------------------------------------------------------
# batch-handling fast paths: no copies, no PIL round trips, same values
# --------------------------------------------------------------------------------------------


def test_clean_float32_batch_is_not_copied():
    x = grid_images(3)
    batch = R.prepare_batch(x, None)
    (_, group), = batch.float_groups()
    assert group.data_ptr() == x.data_ptr() and group.dtype == torch.float32 and batch.invalid == {}
    # a bad sample: the others are scored from a cleaned copy; the caller's tensor is untouched
    y = grid_images(3)
    y[1, 0, 0, 0] = float("nan")
    y[2, 0, 0, 0] = 1.5
    before = y.clone()
    batch = R.prepare_batch(y, None)
    (_, group), = batch.float_groups()
    assert list(batch.invalid) == [1] and group.shape[0] == 2
    assert float(group.max()) <= 1.0 and torch.isfinite(group).all()
    assert torch.equal(y.isnan(), before.isnan()) and torch.equal(y.nan_to_num(), before.nan_to_num())
    # float64: checked in float64 (a finite value too large for float32 is clipped, not marked)
    z = grid_images(2).double()
    z[0, 0, 0, 0] = 1e300
    batch = R.prepare_batch(z, None)
    assert batch.invalid == {} and batch.float_groups()[0][1].dtype == torch.float32
    assert float(batch.float_groups()[0][1][0, 0, 0, 0]) == 1.0


def test_uint8_batch_conversions_match_numpy():
    x = grid_images(9, 130, 150)  # 9 * 3 * 130 * 150 > one conversion chunk
    u8 = torch.from_numpy(quantise(x)).permute(0, 3, 1, 2).contiguous()
    for images in (x, x.double(), x[:, :, ::2, 1:], u8):
        batch = R.prepare_batch(images, None)
        expected = quantise(images.float() / 255.0 if images.dtype == torch.uint8 else images.float())
        assert torch.equal(batch.uint8(), torch.from_numpy(expected).permute(0, 3, 1, 2))
        pils = batch.pil()
        assert all(p.mode == "RGB" and np.array_equal(np.asarray(p), e) for p, e in zip(pils, expected))
    assert R.prepare_batch(u8, None).uint8().data_ptr() == u8.data_ptr()  # a uint8 input is used as given


@pytest.mark.parametrize("name", ["brightness", "saturation", "colorfulness"])
def test_pixel_rewards_chunked_equal_whole_batch_float64(name):
    from mmrl.rewards import pixel

    x = torch.rand(7, 3, 200, 190, generator=torch.Generator().manual_seed(1))  # several chunks
    x[0, :, :5, :5] = 0.0  # black pixels (saturation's max = 0 branch)
    x[1] = x[1, :1]  # grey image
    got = build_reward(name)(x, None)[name]
    expected = getattr(pixel, name)(x.double()).float()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_jpeg_sizes_of_a_batch_match_pillow_per_image():
    x = grid_images(9, 40, 36)
    expected = torch.tensor([jpeg_kb(a) for a in quantise(x)])
    got = build_reward("jpeg_incompressibility")(x, None)["jpeg_incompressibility"]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("crop", [32, 224])
def test_clip_processor_tensor_path_bit_identical(tiny_clip, crop):
    from transformers import CLIPImageProcessor

    from mmrl.rewards._images import is_torchvision_clip_processor

    processor = CLIPImageProcessor(size={"shortest_edge": crop}, crop_size={"height": crop, "width": crop})
    if not is_torchvision_clip_processor(processor):
        pytest.skip("the installed transformers' CLIPImageProcessor is not the torchvision one")
    model, tiny = tiny_clip
    tiny.image_processor = processor
    reward = build_reward("pickscore", model=model, processor=tiny)
    for h, w in [(40, 36), (256, 256), (300, 170)]:
        x = grid_images(3, h, w, seed=h)
        batch = R.prepare_batch(x, ["a"] * 3)
        pil = reward._pixel_values(batch.pil())
        tensor = reward._pixel_values(batch.uint8())
        assert tensor.shape == (3, 3, crop, crop) and torch.equal(pil, tensor)


def test_pickscore_tensor_batch_skips_pil_and_caches_text(tiny_clip):
    model, processor = tiny_clip
    reward = build_reward("pickscore", model=model, processor=processor)
    seen_images, seen_text = [], []
    original_ip, original_text = processor.image_processor.__class__.__call__, model.get_text_features

    def spy_ip(self, images=None, **kwargs):
        seen_images.append(type(images))
        return original_ip(self, images=images, **kwargs)

    def spy_text(**kwargs):
        seen_text.append(kwargs["input_ids"].shape[0])
        return original_text(**kwargs)

    x, prompts = grid_images(4), ["a cat", "dog", "a cat", "a red dog"]
    expected = reference_pickscore(model, processor, x, prompts)
    processor.image_processor.__class__.__call__ = spy_ip
    model.get_text_features = spy_text
    try:
        first = reward(x, prompts)["pickscore"]
        second = reward(x, list(reversed(prompts)))["pickscore"]
        third = reward(to_pils(x), ["dog", "cat", "dog", "dog"])["pickscore"]
    finally:
        processor.image_processor.__class__.__call__ = original_ip
        del model.get_text_features
    from mmrl.rewards._images import is_torchvision_clip_processor

    if is_torchvision_clip_processor(processor.image_processor):
        assert seen_images[:2] == [torch.Tensor, torch.Tensor]
    assert seen_images[2] is list  # PIL input keeps the PIL path
    assert seen_text == [3, 1]  # the second call is served from the cache; "cat" is new
    torch.testing.assert_close(first, expected.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, reference_pickscore(model, processor, x, list(reversed(prompts))).float(),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(third, reference_pickscore(model, processor, x, ["dog", "cat", "dog", "dog"]).float(),
                               rtol=1e-5, atol=1e-5)


def test_pickscore_text_cache_invalidated_and_bounded(tiny_clip):
    model, processor = tiny_clip
    reward = build_reward("pickscore", model=model, processor=processor, text_cache_size=2)
    x, prompts = grid_images(2), ["a cat", "dog"]
    before = reward(x, prompts)["pickscore"]
    with torch.no_grad():  # an in-place update of the weights (as an optimiser step) empties the cache
        model.text_projection.weight.mul_(-1.0)
    after = reward(x, prompts)["pickscore"]
    torch.testing.assert_close(after, reference_pickscore(model, processor, x, prompts).float(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)
    reward(x, ["a red dog", "a red dog"])
    assert list(reward._text_cache) == ["dog", "a red dog"]  # LRU: "a cat" dropped first
    with pytest.raises(ValueError, match="text_cache_size"):
        build_reward("pickscore", model=model, processor=processor, text_cache_size=-1)
    off = build_reward("pickscore", model=model, processor=processor, text_cache_size=0)
    torch.testing.assert_close(off(x, prompts)["pickscore"], after)
    assert len(off._text_cache) == 0


@pytest.mark.parametrize("fill", [0, 0.5])
def test_hps_batched_preprocess_matches_official(fill):
    # fill is on the [0, 1] scale: the official pad runs after ToTensor
    images = [random_image(w, h, seed=i) for i, (w, h) in enumerate(HPS_SIZES)]
    images += [random_image(640, 384, 5), random_image(50, 40, 8, "L"), random_image(50, 40, 9, "RGBA")]
    expected = torch.stack([official_hps_transform(img, 224, fill=fill) for img in images])
    torch.testing.assert_close(R.hps.hps_preprocess_batch(images, 224, fill=fill), expected, rtol=0, atol=1e-6)
    singles = torch.stack([R.hps.hps_preprocess(img, 224, fill=fill) for img in images])
    torch.testing.assert_close(singles, expected, rtol=0, atol=1e-6)


def test_hps_tensor_paths(tiny_open_clip):
    from mmrl.rewards.hps import hps_preprocess_tensor

    prompts = ["a", "b", "c"]
    reward = build_reward("hpsv2", model=tiny_open_clip)
    for h, w in [(32, 20), (100, 70), (48, 48), (30, 90)]:  # no resize, landscape, square, portrait
        x = torch.rand(3, 3, h, w, generator=torch.Generator().manual_seed(h))  # not on the k / 255 grid
        pils = to_pils(x)  # round(x * 255): the image as saved losslessly
        expected = torch.stack([official_hps_transform(p, 32) for p in pils])
        # a float batch is quantised to uint8 first, then the official float path
        torch.testing.assert_close(reward.preprocess(x), expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(reward.preprocess(pils), expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(reward(x, prompts)["hpsv2"], reference_hps(tiny_open_clip, pils, prompts),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(reward(x, prompts)["hpsv2"], reward(pils, prompts)["hpsv2"], rtol=0, atol=1e-6)
    # hps_preprocess_tensor on a float batch: the transform from ToTensor on, with no quantisation at all
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode

    y = torch.rand(2, 3, 100, 70, generator=torch.Generator().manual_seed(3))
    by_hand = TF.pad(TF.resize(y, (32, round(70 * 32 / 100)), InterpolationMode.BICUBIC), [5, 0, 5, 0], fill=0)
    by_hand = TF.normalize(by_hand, list(OPENAI_MEAN), list(OPENAI_STD))
    torch.testing.assert_close(hps_preprocess_tensor(y, 32), by_hand, rtol=0, atol=1e-6)
    assert hps_preprocess_tensor(y, 32).shape == (2, 3, 32, 32)


def test_hps_antialias_argument(tiny_open_clip):
    # antialias=False: the official scores under torchvision < 0.17 (F.resize's tensor default then: off)
    x = grid_images(2, 100, 70)
    pils = to_pils(x)
    old = build_reward("hpsv2", model=tiny_open_clip, antialias=False)
    expected = torch.stack([official_hps_transform(p, 32, antialias=False) for p in pils])
    torch.testing.assert_close(old.preprocess(x), expected, rtol=0, atol=1e-6)
    new = build_reward("hpsv2", model=tiny_open_clip)
    assert float((new.preprocess(x) - old.preprocess(x)).abs().max()) > 1e-2
    with pytest.raises(ValueError, match="antialias"):
        build_reward("hpsv2", model=tiny_open_clip, antialias="yes")


# --------------------------------------------------------------------------------------------
# real weights, where present on this machine
# --------------------------------------------------------------------------------------------


def _cached(repo: str, filename: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo, filename), str)


@pytest.mark.skipif(
    not (_cached("yuvalkirstain/PickScore_v1", "config.json")
         and _cached("laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "preprocessor_config.json")),
    reason="PickScore_v1 / CLIP-ViT-H-14 processor not in the Hugging Face cache (offline tests)",
)
def test_pickscore_real_weights_plausible():
    reward = build_reward("pickscore")
    scores = reward(grid_images(2, 224, 224), ["a photo of a cat", "random noise"])["pickscore"]
    assert torch.isfinite(scores).all() and (scores > 5).all() and (scores < 35).all()


@pytest.mark.skipif(
    not _cached("xswu/HPSv2", "HPS_v2.1_compressed.pt"),
    reason="HPS_v2.1_compressed.pt not in the Hugging Face cache (offline tests)",
)
def test_hps_real_weights_plausible():
    reward = build_reward("hpsv2")
    scores = reward(grid_images(2, 224, 224), ["a photo of a cat", "random noise"])["hpsv2"]
    assert torch.isfinite(scores).all() and (scores.abs() < 0.6).all()
