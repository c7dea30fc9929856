"""Tests of the model rewards CLIPScore, LAION aesthetic, ImageReward and OCR: CPU, offline.

Backbones are built tiny from their configs with random weights; every expectation is computed
independently of mmrl.rewards (the models' own sub-modules, numpy, pure PIL, and for ImageReward a
from-scratch re-implementation of the original BLIP ViT / MED BERT forward that reads the original
checkpoint key names). The OCR reward runs end to end with rapidocr's real weights on rendered text.
"""
from __future__ import annotations

import json
import math
import os
import string
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

from mmrl.rewards import MissingWeightsError, build_reward, list_rewards
from mmrl.rewards.aesthetic import AESTHETIC_HEAD_FILE, AestheticHead
from mmrl.rewards.imagereward import (
    IMAGEREWARD_FILE,
    ImageRewardModel,
    blip_preprocess,
    convert_original_state_dict,
    infer_configs,
    to_original_state_dict,
)
from mmrl.rewards.ocr import extract_target, ocr_score

OPENAI_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
OPENAI_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def quantise(x: torch.Tensor) -> np.ndarray:
    return np.clip(np.round(x.numpy().astype(np.float64) * 255.0), 0, 255).astype(np.uint8).transpose(0, 2, 3, 1)


def to_pils(x: torch.Tensor) -> list[Image.Image]:
    return [Image.fromarray(a) for a in quantise(x)]


def grid_images(n: int = 4, h: int = 24, w: int = 20, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=g).float() / 255.0


def empty_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    from mmrl.rewards._base import hub_offline

    assert hub_offline()  # conftest sets HF_HUB_OFFLINE=1
    cache = tmp_path / "empty_cache"
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_model_rewards_registered():
    for name in ["clipscore", "aesthetic", "imagereward", "ocr"]:
        assert name in list_rewards()


# --------------------------------------------------------------------------------------------
# tiny transformers CLIP (CLIPScore, aesthetic)
# --------------------------------------------------------------------------------------------


def write_tiny_bpe(directory) -> tuple[str, str]:
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
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return str(directory / "vocab.json"), str(directory / "merges.txt")


@pytest.fixture
def tiny_clip(tmp_path):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    vocab_file, merges_file = write_tiny_bpe(tmp_path)
    tokenizer = CLIPTokenizer(vocab=vocab_file, merges=merges_file)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)
    text = dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=77, projection_dim=8,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(image_size=32, patch_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, projection_dim=8)
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).eval()
    return model, processor


def reference_clip_embeddings(model, processor, images: list[Image.Image], prompts: list[str]):
    """Projected image / text embeddings straight from the CLIP sub-modules (no normalisation)."""
    pixels = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    tokens = processor.tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        img = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
        txt = model.text_projection(
            model.text_model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).pooler_output
        )
    return img, txt


# --------------------------------------------------------------------------------------------
# CLIPScore
# --------------------------------------------------------------------------------------------

PROMPTS = ["a cat", "a red dog", "a cat", "dog", "a red dog", "red", "cat dog"]


def test_clipscore_is_scaled_cosine_clipped_at_zero(tiny_clip):
    model, processor = tiny_clip
    x = grid_images(len(PROMPTS), 40, 36)
    img, txt = reference_clip_embeddings(model, processor, to_pils(x), PROMPTS)
    cos = F.cosine_similarity(img, txt, dim=-1)
    assert (cos < 0).any() and (cos > 0).any()  # both signs, so the clipping is really exercised

    plain = build_reward("clipscore", model=model, processor=processor, device="cpu")(x, PROMPTS)
    assert set(plain) == {"clipscore"}
    torch.testing.assert_close(plain["clipscore"], cos.clamp_min(0), rtol=1e-5, atol=1e-6)  # default w = 1

    hessel = build_reward("clipscore", model=model, processor=processor, scale=2.5)(x, PROMPTS)["clipscore"]
    torch.testing.assert_close(hessel, 2.5 * cos.clamp_min(0), rtol=1e-5, atol=1e-6)
    assert (hessel[cos < 0] == 0).all()

    signed = build_reward("clipscore", model=model, processor=processor, scale=100 / 30, clip_at_zero=False)
    torch.testing.assert_close(signed(x, PROMPTS)["clipscore"], 100 / 30 * cos, rtol=1e-5, atol=1e-5)


def test_clipscore_flow_grpo_convention_is_its_clip_scorer(tiny_clip):
    """Flow-GRPO's flow_grpo/clip_scorer.py, written out: torchvision Compose(Resize(shortest edge), CenterCrop,
    Normalize) on the float images, the CLIP forward's logits_per_image diagonal / 30 (the model's own logit
    scale, not 100; unclipped). The default convention quantises to uint8 PIL and takes the processor's bicubic
    resize: up to 7e-3 apart on resized images (15 % of these scores), and 7x off with scale=100/30 on a model
    whose logit scale is not 100."""
    import torchvision.transforms as T

    model, processor = tiny_clip
    with torch.no_grad():
        model.logit_scale.fill_(math.log(14.28))
    ip = processor.image_processor
    transform = T.Compose([T.Resize(ip.size["shortest_edge"]), T.CenterCrop((ip.crop_size["height"],
                                                                              ip.crop_size["width"])),
                           T.Normalize(mean=ip.image_mean, std=ip.image_std)])
    reward = build_reward("clipscore", model=model, processor=processor, convention="flow_grpo", batch_size=2)
    for height, width in ((40, 48), (104, 152), (32, 32)):
        x = torch.rand(len(PROMPTS), 3, height, width, generator=torch.Generator().manual_seed(height))
        texts = processor(text=PROMPTS, padding="max_length", truncation=True, max_length=77,
                           return_tensors="pt")
        with torch.no_grad():
            expected = model(pixel_values=transform(x), **texts).logits_per_image.diagonal() / 30
        torch.testing.assert_close(reward(x, PROMPTS)["clipscore"], expected, rtol=1e-5, atol=1e-6)
    # PIL input of mixed sizes: each image as its float tensor, in the batch's order
    pils = to_pils(torch.rand(2, 3, 40, 48)) + to_pils(torch.rand(1, 3, 36, 36))
    floats = [torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 255 for im in pils]
    texts = processor(text=PROMPTS[:3], padding="max_length", truncation=True, max_length=77,
                           return_tensors="pt")
    with torch.no_grad():
        expected = torch.stack([model(pixel_values=transform(f[None]), **{k: v[i:i + 1] for k, v in texts.items()})
                                .logits_per_image[0, 0] for i, f in enumerate(floats)]) / 30
    torch.testing.assert_close(reward(pils, PROMPTS[:3])["clipscore"], expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="leave scale and clip_at_zero out"):
        build_reward("clipscore", model=model, processor=processor, convention="flow_grpo", scale=100 / 30)
    with pytest.raises(ValueError, match="convention must be"):
        build_reward("clipscore", model=model, processor=processor, convention="hessel")


def test_clipscore_prompt_prefix_and_pil_input(tiny_clip):
    model, processor = tiny_clip
    x = grid_images(3)
    prompts = ["cat", "dog", "red dog"]
    img, txt = reference_clip_embeddings(model, processor, to_pils(x), ["a " + p for p in prompts])
    expected = F.cosine_similarity(img, txt, dim=-1)
    reward = build_reward("clipscore", model=model, processor=processor, prompt_prefix="a ", clip_at_zero=False)
    torch.testing.assert_close(reward(x, prompts)["clipscore"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reward(to_pils(x), prompts)["clipscore"], expected, rtol=1e-5, atol=1e-6)


def test_clipscore_loads_model_and_processor_from_one_dir(tiny_clip, tmp_path):
    model, processor = tiny_clip
    model.save_pretrained(tmp_path / "clip")
    processor.save_pretrained(tmp_path / "clip")
    x, prompts = grid_images(2), ["a cat", "dog"]
    loaded = build_reward("clipscore", model=str(tmp_path / "clip"), device="cpu", clip_at_zero=False)
    # a processor loaded from a folder resizes with PIL, as the anchors' (transformers 4, open_clip) do; transformers
    # 5's default is its torchvision backend, up to one uint8 level apart
    assert type(loaded.processor.image_processor).__name__ == "CLIPImageProcessorPil"
    from transformers import CLIPProcessor
    pil = CLIPProcessor.from_pretrained(tmp_path / "clip", backend="pil")
    img, txt = reference_clip_embeddings(model, pil, to_pils(x), prompts)
    torch.testing.assert_close(loaded(x, prompts)["clipscore"], F.cosine_similarity(img, txt, dim=-1), rtol=1e-5, atol=1e-5)


def test_clipscore_missing_weights_offline(tmp_path, monkeypatch):
    empty_hub_cache(tmp_path, monkeypatch)
    with pytest.raises(MissingWeightsError) as err:
        build_reward("clipscore")
    msg = str(err.value)
    assert "openai/clip-vit-large-patch14" in msg and "config.json" in msg and "model.safetensors" in msg
    assert "HF_HUB_OFFLINE" in msg
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingWeightsError, match="model.safetensors"):
        build_reward("clipscore", model=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="built processor"):
        build_reward("clipscore", model=torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------------------------
# LAION aesthetic
# --------------------------------------------------------------------------------------------


def test_aesthetic_head_architecture_matches_original():
    head = AestheticHead()
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    assert shapes == {
        "layers.0.weight": (1024, 768), "layers.0.bias": (1024,),
        "layers.2.weight": (128, 1024), "layers.2.bias": (128,),
        "layers.4.weight": (64, 128), "layers.4.bias": (64,),
        "layers.6.weight": (16, 64), "layers.6.bias": (16,),
        "layers.7.weight": (1, 16), "layers.7.bias": (1,),
    }
    # no activations: the head is affine (an exact linear map plus a constant)
    head.eval()
    a, b = torch.randn(768), torch.randn(768)
    with torch.no_grad():
        torch.testing.assert_close(head(a + b) - head(b), head(a) - head(torch.zeros(768)), rtol=1e-4, atol=1e-5)


@pytest.fixture
def tiny_head():
    torch.manual_seed(1)
    head = AestheticHead(input_dim=8)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    return head.eval()


def reference_aesthetic(model, processor, head, images) -> torch.Tensor:
    """numpy: L2-normalise the projected CLIP embedding, then the head's affine layers in order."""
    pixels = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        emb = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output).numpy().astype(np.float64)
    emb = emb / np.linalg.norm(emb, axis=-1, keepdims=True)
    sd = {k: v.numpy().astype(np.float64) for k, v in head.state_dict().items()}
    h = emb
    for i in (0, 2, 4, 6, 7):
        h = h @ sd[f"layers.{i}.weight"].T + sd[f"layers.{i}.bias"]
    return torch.from_numpy(h[:, 0]).float()


def test_aesthetic_matches_reference(tiny_clip, tiny_head):
    model, processor = tiny_clip
    x = grid_images(4, 30, 44)
    reward = build_reward("aesthetic", head=tiny_head, model=model, processor=processor, device="cpu", batch_size=3)
    assert reward.needs_prompts is False
    out = reward(x, None)
    assert set(out) == {"aesthetic"}
    expected = reference_aesthetic(model, processor, tiny_head, to_pils(x))
    torch.testing.assert_close(out["aesthetic"], expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(reward(to_pils(x), ["ignored"] * 4)["aesthetic"], expected, rtol=1e-4, atol=1e-5)


def test_aesthetic_head_from_file_and_dir(tiny_clip, tiny_head, tmp_path):
    model, processor = tiny_clip
    torch.save(tiny_head.state_dict(), tmp_path / AESTHETIC_HEAD_FILE)
    x = grid_images(2)
    expected = reference_aesthetic(model, processor, tiny_head, to_pils(x))
    for head in (str(tmp_path / AESTHETIC_HEAD_FILE), str(tmp_path)):
        reward = build_reward("aesthetic", head=head, model=model, processor=processor)
        torch.testing.assert_close(reward(x)["aesthetic"], expected, rtol=1e-4, atol=1e-5)


def test_aesthetic_missing_weights(tiny_clip, tiny_head, tmp_path, monkeypatch):
    model, processor = tiny_clip
    with pytest.raises(MissingWeightsError) as err:
        build_reward("aesthetic", model=model, processor=processor)
    assert AESTHETIC_HEAD_FILE in str(err.value) and "head=" in str(err.value)
    assert "improved-aesthetic-predictor" in str(err.value)
    missing = tmp_path / "nowhere" / AESTHETIC_HEAD_FILE
    with pytest.raises(MissingWeightsError, match="does not exist") as err:
        build_reward("aesthetic", head=str(missing))
    assert str(missing) in str(err.value)
    with pytest.raises(ValueError, match="768"):
        build_reward("aesthetic", head=AestheticHead(), model=model, processor=processor)
    # head present, backbone absent offline
    torch.save(tiny_head.state_dict(), tmp_path / AESTHETIC_HEAD_FILE)
    empty_hub_cache(tmp_path, monkeypatch)
    with pytest.raises(MissingWeightsError, match="openai/clip-vit-large-patch14"):
        build_reward("aesthetic", head=str(tmp_path / AESTHETIC_HEAD_FILE))


# --------------------------------------------------------------------------------------------
# ImageReward: tiny BLIP, original checkpoint names, an independent re-implementation
# --------------------------------------------------------------------------------------------

TINY_IR = dict(v_width=128, v_layers=2, v_mlp=96, patch=8, image=32, t_width=128, t_layers=2, t_mlp=80,
               t_heads=2, positions=40)
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "cat", "dog", "red", "photo", "of", "the", "##s",
         "sign", "says", "hello", "world", "on", "blue", "sky"]


@pytest.fixture
def bert_tokenizer():
    from transformers import BertTokenizer

    return BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)})


def original_state_dict(cfg=TINY_IR, vocab=len(WORDS) + 2, seed=0) -> dict[str, torch.Tensor]:
    """Random tensors under the ORIGINAL ImageReward.pt names and shapes (BLIP vit.py + med.py + MLP)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std=0.3, mean=0.0):
        return torch.randn(*shape, generator=g) * std + mean

    W, T, P = cfg["v_width"], cfg["t_width"], cfg["patch"]
    n_tokens = (cfg["image"] // P) ** 2 + 1
    sd = {
        "blip.visual_encoder.cls_token": r(1, 1, W),
        "blip.visual_encoder.pos_embed": r(1, n_tokens, W),
        "blip.visual_encoder.patch_embed.proj.weight": r(W, 3, P, P, std=0.05),
        "blip.visual_encoder.patch_embed.proj.bias": r(W),
        "blip.visual_encoder.norm.weight": r(W, mean=1.0),
        "blip.visual_encoder.norm.bias": r(W),
    }
    for i in range(cfg["v_layers"]):
        b = f"blip.visual_encoder.blocks.{i}."
        sd.update({
            b + "norm1.weight": r(W, mean=1.0), b + "norm1.bias": r(W),
            b + "attn.qkv.weight": r(3 * W, W, std=0.1), b + "attn.qkv.bias": r(3 * W),
            b + "attn.proj.weight": r(W, W, std=0.1), b + "attn.proj.bias": r(W),
            b + "norm2.weight": r(W, mean=1.0), b + "norm2.bias": r(W),
            b + "mlp.fc1.weight": r(cfg["v_mlp"], W, std=0.1), b + "mlp.fc1.bias": r(cfg["v_mlp"]),
            b + "mlp.fc2.weight": r(W, cfg["v_mlp"], std=0.1), b + "mlp.fc2.bias": r(W),
        })
    t = "blip.text_encoder."
    sd.update({
        t + "embeddings.word_embeddings.weight": r(vocab, T),
        t + "embeddings.position_embeddings.weight": r(cfg["positions"], T),
        t + "embeddings.LayerNorm.weight": r(T, mean=1.0), t + "embeddings.LayerNorm.bias": r(T),
        t + "embeddings.position_ids": torch.arange(cfg["positions"]).unsqueeze(0),
    })
    for i in range(cfg["t_layers"]):
        b = f"{t}encoder.layer.{i}."
        for block, kv_width in (("attention", T), ("crossattention", W)):
            sd.update({
                f"{b}{block}.self.query.weight": r(T, T, std=0.1), f"{b}{block}.self.query.bias": r(T),
                f"{b}{block}.self.key.weight": r(T, kv_width, std=0.1), f"{b}{block}.self.key.bias": r(T),
                f"{b}{block}.self.value.weight": r(T, kv_width, std=0.1), f"{b}{block}.self.value.bias": r(T),
                f"{b}{block}.output.dense.weight": r(T, T, std=0.1), f"{b}{block}.output.dense.bias": r(T),
                f"{b}{block}.output.LayerNorm.weight": r(T, mean=1.0), f"{b}{block}.output.LayerNorm.bias": r(T),
            })
        sd.update({
            b + "intermediate.dense.weight": r(cfg["t_mlp"], T, std=0.1), b + "intermediate.dense.bias": r(cfg["t_mlp"]),
            b + "output.dense.weight": r(T, cfg["t_mlp"], std=0.1), b + "output.dense.bias": r(T),
            b + "output.LayerNorm.weight": r(T, mean=1.0), b + "output.LayerNorm.bias": r(T),
        })
    sd.update({"blip.vision_proj.weight": r(256, W), "blip.vision_proj.bias": r(256),
               "blip.text_proj.weight": r(256, T), "blip.text_proj.bias": r(256)})
    for i, (o, n) in zip((0, 2, 4, 6, 7), ((1024, T), (128, 1024), (64, 128), (16, 64), (1, 16))):
        sd[f"mlp.layers.{i}.weight"] = r(o, n, std=1 / math.sqrt(n))
        sd[f"mlp.layers.{i}.bias"] = r(o, std=0.1)
    return sd


def _heads(x, n):  # [B, L, D] -> [B, n, L, D/n]
    return x.reshape(x.shape[0], x.shape[1], n, -1).transpose(1, 2)


def reference_imagereward(sd, pixels, ids, mask, v_heads, t_heads) -> torch.Tensor:
    """The original forward, written from BLIP's vit.py / med.py and ImageReward.py, on original names."""
    p = "blip.visual_encoder."
    B = pixels.shape[0]
    w = sd[p + "patch_embed.proj.weight"]
    x = F.conv2d(pixels, w, sd[p + "patch_embed.proj.bias"], stride=w.shape[-1]).flatten(2).transpose(1, 2)
    x = torch.cat([sd[p + "cls_token"].expand(B, -1, -1), x], dim=1)
    x = x + sd[p + "pos_embed"][:, : x.shape[1]]
    W = x.shape[-1]
    i = 0
    while f"{p}blocks.{i}.norm1.weight" in sd:
        b = f"{p}blocks.{i}."
        h = F.layer_norm(x, (W,), sd[b + "norm1.weight"], sd[b + "norm1.bias"], eps=1e-6)
        q, k, v = F.linear(h, sd[b + "attn.qkv.weight"], sd[b + "attn.qkv.bias"]).reshape(
            B, -1, 3, v_heads, W // v_heads).permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * (W // v_heads) ** -0.5).softmax(dim=-1)
        h = (attn @ v).transpose(1, 2).reshape(B, -1, W)
        x = x + F.linear(h, sd[b + "attn.proj.weight"], sd[b + "attn.proj.bias"])
        h = F.layer_norm(x, (W,), sd[b + "norm2.weight"], sd[b + "norm2.bias"], eps=1e-6)
        h = F.linear(F.gelu(F.linear(h, sd[b + "mlp.fc1.weight"], sd[b + "mlp.fc1.bias"])),
                     sd[b + "mlp.fc2.weight"], sd[b + "mlp.fc2.bias"])
        x = x + h
        i += 1
    image_embeds = F.layer_norm(x, (W,), sd[p + "norm.weight"], sd[p + "norm.bias"], eps=1e-6)

    t = "blip.text_encoder."
    T = sd[t + "embeddings.word_embeddings.weight"].shape[1]
    L = ids.shape[1]
    y = sd[t + "embeddings.word_embeddings.weight"][ids] + sd[t + "embeddings.position_embeddings.weight"][:L]
    y = F.layer_norm(y, (T,), sd[t + "embeddings.LayerNorm.weight"], sd[t + "embeddings.LayerNorm.bias"], eps=1e-12)
    ext = (1.0 - mask[:, None, None, :].float()) * -10000.0  # med.py get_extended_attention_mask

    def attention(prefix, hidden, context, add_mask):
        q = _heads(F.linear(hidden, sd[prefix + "self.query.weight"], sd[prefix + "self.query.bias"]), t_heads)
        k = _heads(F.linear(context, sd[prefix + "self.key.weight"], sd[prefix + "self.key.bias"]), t_heads)
        v = _heads(F.linear(context, sd[prefix + "self.value.weight"], sd[prefix + "self.value.bias"]), t_heads)
        scores = q @ k.transpose(-1, -2) / math.sqrt(T // t_heads)
        if add_mask is not None:
            scores = scores + add_mask
        ctx = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(hidden.shape)
        out = F.linear(ctx, sd[prefix + "output.dense.weight"], sd[prefix + "output.dense.bias"])
        return F.layer_norm(out + hidden, (T,), sd[prefix + "output.LayerNorm.weight"],
                            sd[prefix + "output.LayerNorm.bias"], eps=1e-12)

    i = 0
    while f"{t}encoder.layer.{i}.intermediate.dense.weight" in sd:
        b = f"{t}encoder.layer.{i}."
        y = attention(b + "attention.", y, y, ext)
        y = attention(b + "crossattention.", y, image_embeds, None)  # image_atts are all ones
        h = F.gelu(F.linear(y, sd[b + "intermediate.dense.weight"], sd[b + "intermediate.dense.bias"]))
        h = F.linear(h, sd[b + "output.dense.weight"], sd[b + "output.dense.bias"])
        y = F.layer_norm(h + y, (T,), sd[b + "output.LayerNorm.weight"], sd[b + "output.LayerNorm.bias"], eps=1e-12)
        i += 1
    r = y[:, 0, :].float()
    for j in (0, 2, 4, 6, 7):
        r = F.linear(r, sd[f"mlp.layers.{j}.weight"], sd[f"mlp.layers.{j}.bias"])
    return ((r - 0.16717362830052426) / 1.0333394966054072).squeeze(-1)


def reference_blip_preprocess(image: Image.Image, size: int) -> torch.Tensor:
    """Resize(size) of the shortest side (bicubic, int() of the long side as torchvision), centre crop
    with round() offsets, CLIP normalisation; pure PIL + numpy."""
    w, h = image.size
    if w <= h:
        nw, nh = size, int(size * h / w)
    else:
        nw, nh = int(size * w / h), size
    resized = image.resize((nw, nh), Image.BICUBIC) if (nw, nh) != (w, h) else image
    left, top = int(round((nw - size) / 2.0)), int(round((nh - size) / 2.0))
    crop = resized.crop((left, top, left + size, top + size)).convert("RGB")
    a = (np.asarray(crop, dtype=np.float32) / 255.0 - OPENAI_MEAN) / OPENAI_STD
    return torch.from_numpy(a).permute(2, 0, 1)


@pytest.mark.parametrize("wh", [(100, 50), (37, 90), (32, 32), (224, 300), (31, 33)])
def test_blip_preprocess_matches_pil_reference(wh):
    rng = np.random.default_rng(sum(wh))
    image = Image.fromarray(rng.integers(0, 256, (wh[1], wh[0], 3), dtype=np.uint8))
    got = blip_preprocess(image, 32)
    assert got.shape == (3, 32, 32)
    torch.testing.assert_close(got, reference_blip_preprocess(image, 32), rtol=0, atol=1e-5)


def test_imagereward_state_dict_mapping_both_ways():
    orig = original_state_dict()
    converted, unknown = convert_original_state_dict({"module." + k: v for k, v in orig.items()})
    assert unknown == []
    assert not any(k.startswith("blip.") for k in converted)
    # a strict load: every parameter of the transformers model is filled, nothing left over
    model = ImageRewardModel(*infer_configs(converted))
    missing, unexpected = model.load_state_dict(converted, strict=False)
    assert [k for k in missing if not k.endswith("position_ids")] == [] and unexpected == []
    for key, value in converted.items():
        assert torch.equal(model.state_dict()[key], value), key
    # back to the original names: everything but the unused projections / position_ids buffer
    back = to_original_state_dict(model.state_dict())
    dropped = {k for k in orig if "vision_proj" in k or "text_proj" in k or k.endswith("position_ids")}
    assert set(back) == set(orig) - dropped
    for key, value in back.items():
        assert torch.equal(value, orig[key]), key
    # and a model's own state dict survives the round trip model -> original -> model
    again, unknown = convert_original_state_dict(back)
    assert unknown == [] and set(again) == {k for k in model.state_dict() if not k.endswith("position_ids")}
    # a few names spelled out, as the original checkpoint has them
    assert {"blip.visual_encoder.blocks.1.attn.qkv.weight", "blip.visual_encoder.norm.bias",
            "blip.text_encoder.encoder.layer.0.crossattention.self.key.weight",
            "mlp.layers.7.bias"} <= set(back)
    assert converted["vision_model.encoder.layers.1.self_attn.projection.weight"] is orig["blip.visual_encoder.blocks.1.attn.proj.weight"]
    assert converted["vision_model.post_layernorm.weight"] is orig["blip.visual_encoder.norm.weight"]
    assert converted["vision_model.embeddings.class_embedding"] is orig["blip.visual_encoder.cls_token"]


def test_imagereward_unknown_checkpoint_keys_are_reported():
    orig = original_state_dict()
    orig["blip.itm_head.weight"] = torch.zeros(2, 2)
    _, unknown = convert_original_state_dict({"state_dict": orig})
    assert unknown == ["blip.itm_head.weight"]


def test_infer_configs_full_size_is_vit_large_and_med_bert():
    from transformers import BlipTextConfig, BlipVisionConfig  # noqa: F401  (importable)

    from mmrl.rewards.imagereward import imagereward_configs

    vision, text = imagereward_configs()
    assert (vision.hidden_size, vision.num_hidden_layers, vision.num_attention_heads, vision.intermediate_size,
            vision.patch_size, vision.image_size, vision.layer_norm_eps) == (1024, 24, 16, 4096, 16, 224, 1e-6)
    assert (text.vocab_size, text.hidden_size, text.num_hidden_layers, text.num_attention_heads,
            text.intermediate_size, text.encoder_hidden_size, text.layer_norm_eps) == (30524, 768, 12, 12, 3072, 1024, 1e-12)
    # shapes alone give the same configs back for a checkpoint of that size (checked on meta tensors)
    shapes = {
        "vision_model.embeddings.class_embedding": (1, 1, 1024),
        "vision_model.embeddings.patch_embedding.weight": (1024, 3, 16, 16),
        "vision_model.embeddings.position_embedding": (1, 197, 1024),
        "vision_model.encoder.layers.0.mlp.fc1.weight": (4096, 1024),
        "text_encoder.embeddings.word_embeddings.weight": (30524, 768),
        "text_encoder.embeddings.position_embeddings.weight": (512, 768),
        "text_encoder.encoder.layer.0.intermediate.dense.weight": (3072, 768),
    }
    state = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    state.update({f"vision_model.encoder.layers.{i}.x": torch.empty(0, device="meta") for i in range(24)})
    state.update({f"text_encoder.encoder.layer.{i}.x": torch.empty(0, device="meta") for i in range(12)})
    v2, t2 = infer_configs(state)
    assert v2.to_dict() == vision.to_dict() and t2.to_dict() == text.to_dict()


PROMPTS_IR = ["a red cat", "the dog says hello", "a red cat", "photo of a sign on blue sky", "cats"]


def test_imagereward_matches_original_forward(bert_tokenizer, tmp_path):
    orig = original_state_dict(vocab=len(WORDS) + 2)
    torch.save(orig, tmp_path / IMAGEREWARD_FILE)
    reward = build_reward("imagereward", checkpoint=str(tmp_path / IMAGEREWARD_FILE), tokenizer=bert_tokenizer,
                          device="cpu", batch_size=2)
    # BLIP's init_tokenizer: [DEC] bos and [ENC] added after the vocabulary
    assert reward.tokenizer.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [len(WORDS), len(WORDS) + 1]
    x = grid_images(len(PROMPTS_IR), 40, 52)
    out = reward(x, PROMPTS_IR)
    assert set(out) == {"imagereward"}

    pixels = torch.stack([reference_blip_preprocess(img, 32) for img in to_pils(x)])
    tokens = bert_tokenizer(PROMPTS_IR, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    assert tokens["input_ids"].shape == (len(PROMPTS_IR), 35)
    assert (tokens["input_ids"][:, 0] == bert_tokenizer.cls_token_id).all()  # [CLS], not [ENC]
    with torch.no_grad():
        expected = reference_imagereward(orig, pixels, tokens["input_ids"], tokens["attention_mask"], 2, 2)
    assert expected.std() > 0.05  # the samples really differ
    torch.testing.assert_close(out["imagereward"], expected, rtol=1e-4, atol=1e-4)
    # PIL input, a larger batch and a NaN for an unjudgeable sample
    torch.testing.assert_close(build_reward("imagereward", checkpoint=str(tmp_path / IMAGEREWARD_FILE),
                                            tokenizer=bert_tokenizer, batch_size=32)(to_pils(x), PROMPTS_IR)["imagereward"],
                               expected, rtol=1e-4, atol=1e-4)
    # an RGBA PIL image is resized and cropped with its alpha, then converted, in the original's order
    rgba = []
    for img in to_pils(x):
        alpha = Image.linear_gradient("L").resize(img.size)
        rgba.append(Image.merge("RGBA", (*img.split(), alpha)))
    pixels_rgba = torch.stack([reference_blip_preprocess(img, 32) for img in rgba])
    converted_first = torch.stack([reference_blip_preprocess(img.convert("RGB"), 32) for img in rgba])
    assert (pixels_rgba - converted_first).abs().max() > 0.05  # the order matters for this input
    with torch.no_grad():
        expected_rgba = reference_imagereward(orig, pixels_rgba, tokens["input_ids"], tokens["attention_mask"], 2, 2)
    torch.testing.assert_close(reward(rgba, PROMPTS_IR)["imagereward"], expected_rgba, rtol=1e-4, atol=1e-4)
    bad = reward(x[:2], [PROMPTS_IR[0], None])
    assert torch.isnan(bad["imagereward"][1]) and "prompt is not a string" in reward.last_info["nan_samples"][1]
    torch.testing.assert_close(bad["imagereward"][0], expected[0], rtol=1e-4, atol=1e-4)


def test_imagereward_dir_with_med_config_sets_heads(bert_tokenizer, tmp_path):
    cfg = dict(TINY_IR)
    orig = original_state_dict(cfg, seed=3)
    (tmp_path / "ir").mkdir()
    torch.save(orig, tmp_path / "ir" / IMAGEREWARD_FILE)
    (tmp_path / "ir" / "med_config.json").write_text(json.dumps({"num_attention_heads": 4, "hidden_size": 128}))
    reward = build_reward("imagereward", checkpoint=str(tmp_path / "ir"), tokenizer=bert_tokenizer)
    assert reward.model.text_encoder.config.num_attention_heads == 4
    assert reward.model.vision_model.config.num_attention_heads == 2  # 128 / 64
    x = grid_images(2, 32, 32)
    prompts = ["a cat", "red dog"]
    pixels = torch.stack([reference_blip_preprocess(img, 32) for img in to_pils(x)])
    tokens = bert_tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    with torch.no_grad():
        expected = reference_imagereward(orig, pixels, tokens["input_ids"], tokens["attention_mask"], 2, 4)
    torch.testing.assert_close(reward(x, prompts)["imagereward"], expected, rtol=1e-4, atol=1e-4)


def test_imagereward_incomplete_checkpoint_raises(bert_tokenizer, tmp_path):
    orig = original_state_dict()
    del orig["blip.visual_encoder.blocks.1.norm2.weight"]
    torch.save(orig, tmp_path / IMAGEREWARD_FILE)
    with pytest.raises(RuntimeError, match=r"missing \['vision_model.encoder.layers.1.layer_norm2.weight'\]"):
        build_reward("imagereward", checkpoint=str(tmp_path / IMAGEREWARD_FILE), tokenizer=bert_tokenizer)


def test_imagereward_tokenises_each_unique_prompt_once(bert_tokenizer, tmp_path):
    torch.save(original_state_dict(), tmp_path / IMAGEREWARD_FILE)
    reward = build_reward("imagereward", checkpoint=str(tmp_path / IMAGEREWARD_FILE), tokenizer=bert_tokenizer)
    seen = []
    original = reward.tokenize
    reward.tokenize = lambda prompts: (seen.append(list(prompts)), original(prompts))[1]
    reward(grid_images(4), ["a cat", "a dog", "a cat", "a dog"])
    assert seen == [["a cat", "a dog"]]


def test_imagereward_missing_weights(bert_tokenizer, tmp_path, monkeypatch):
    missing = tmp_path / "nope" / IMAGEREWARD_FILE
    with pytest.raises(MissingWeightsError) as err:
        build_reward("imagereward", checkpoint=str(missing), tokenizer=bert_tokenizer)
    assert str(missing) in str(err.value) and "THUDM/ImageReward" in str(err.value)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(MissingWeightsError, match=IMAGEREWARD_FILE):
        build_reward("imagereward", checkpoint=str(tmp_path / "emptydir"), tokenizer=bert_tokenizer)
    cache = empty_hub_cache(tmp_path, monkeypatch)
    with pytest.raises(MissingWeightsError) as err:
        build_reward("imagereward", tokenizer=bert_tokenizer)
    msg = str(err.value)
    assert IMAGEREWARD_FILE in msg and "THUDM/ImageReward" in msg and "HF_HUB_OFFLINE" in msg
    assert "checkpoint=" in msg and str(cache) in msg
    # checkpoint present, tokenizer absent offline
    torch.save(original_state_dict(), tmp_path / IMAGEREWARD_FILE)
    with pytest.raises(MissingWeightsError) as err:
        build_reward("imagereward", checkpoint=str(tmp_path / IMAGEREWARD_FILE))
    assert "bert-base-uncased" in str(err.value) and "vocab.txt" in str(err.value)


# --------------------------------------------------------------------------------------------
# OCR
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, target",
    [
        ('A sign that says "Hello World"', "Hello World"),
        ('both "first" and "second"', "first"),
        ("a neon sign reading 'OPEN 24 HOURS' at night", "OPEN 24 HOURS"),
        ("the cat's poster says 'don't panic' in red", "don't panic"),
        ("a mug printed with \u201cCaf\u00e9 Noir\u201d", "Caf\u00e9 Noir"),
        ('a quote "it\'s fine" inside', "it's fine"),
        ("the dog's bowl and the cat's toy", None),
        ("no quotes here", None),
        ('an empty "" sign', ""),
        ('an unclosed "OPEN late', "OPEN late"),  # Flow-GRPO's prompt.split('"')[1] runs to the end
    ],
)
def test_extract_target(prompt, target):
    assert extract_target(prompt) == target


@pytest.mark.parametrize(
    "recognized, target, expected",
    [
        ("Hello World", "hello world", 1.0),
        ("xx HELLO world yy", "Hello World", 1.0),  # substring after lower-casing / dropping spaces
        ("HELLO  wor1d", "hello world", 1 - 1 / 10),  # one substitution over 10 letters
        ("abd", "abc", 1 - 1 / 3),
        ("ab", "abc", 1 - 1 / 3),  # one deletion
        ("hello", "hello world", 1 - 5 / 10),
        ("completely different text", "abc", 0.0),  # distance capped at len(target)
        ("", "abc", 0.0),
    ],
)
def test_ocr_score_formula(recognized, target, expected):
    assert ocr_score(recognized, target) == pytest.approx(expected)


class FakeEngine:
    def __init__(self, outputs):
        self.outputs = list(outputs)
        self.seen = []

    def __call__(self, image):
        self.seen.append(image)
        out = self.outputs.pop(0)
        if isinstance(out, Exception):
            raise out
        return out


def test_ocr_reward_with_fake_engine_nan_and_info():
    engine = FakeEngine([
        SimpleNamespace(txts=("Hello", "Wor1d"), scores=(0.9, 0.3)),  # the low-confidence text is dropped
        SimpleNamespace(txts=None, scores=None),  # nothing detected
        RuntimeError("boom"),
        SimpleNamespace(txts=("say", "CHEESE"), scores=(0.8, 0.99)),
    ])
    reward = build_reward("ocr", engine=engine)
    x = grid_images(6, 16, 16)
    prompts = ['"Hello World"', "a sign 'OK'", '"x"', "no target", 'a "" sign', "photo saying 'cheese'"]
    out = reward(x, prompts)["ocr"]
    assert len(engine.seen) == 4 and all(isinstance(im, Image.Image) for im in engine.seen)  # no OCR without a target
    assert out[0].item() == pytest.approx(0.5) and out[1].item() == 0.0 and out[5].item() == 1.0
    assert torch.isnan(out[2]) and torch.isnan(out[3]) and torch.isnan(out[4])
    info = reward.last_info
    assert "OCR engine failed" in info["nan_samples"][2] and "boom" in info["nan_samples"][2]
    assert "no quoted target" in info["nan_samples"][3] and "empty quoted target" in info["nan_samples"][4]
    assert info["recognized"] == ["Hello", "", None, None, None, "sayCHEESE"]


FONT_CANDIDATES = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
]


def font(size: int) -> ImageFont.FreeTypeFont:
    paths = list(FONT_CANDIDATES)
    try:
        import matplotlib

        paths.insert(0, os.path.join(matplotlib.get_data_path(), "fonts", "ttf", "DejaVuSans.ttf"))
    except ImportError:
        pass
    for path in paths:
        if os.path.isfile(path):
            return ImageFont.truetype(path, size)
    pytest.skip("no DejaVuSans TrueType font on this machine (matplotlib's or /usr/share/fonts)")


def render(text: str, size=(256, 256), font_size=36) -> Image.Image:
    image = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(image)
    f = font(font_size)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=f)
    draw.text(((size[0] - (right - left)) / 2 - left, (size[1] - (bottom - top)) / 2 - top), text, font=f, fill=(10, 10, 10))
    return image


@pytest.fixture(scope="module")
def ocr_reward():
    return build_reward("ocr")  # the real rapidocr engine, weights from its wheel


def test_ocr_real_engine_on_rendered_text(ocr_reward):
    prompt = 'A storefront sign that says "Hello World"'
    images = [render("Hello World"), render("Hello Wrld"), render("Goodbye Moon"), Image.new("RGB", (256, 256), "white")]
    start = time.perf_counter()
    out = ocr_reward(images, [prompt] * 4)["ocr"]
    elapsed = (time.perf_counter() - start) / len(images)
    rec = ocr_reward.last_info["recognized"]
    assert out[0] >= 0.95, rec  # the right text: near 1 (1.0 when read exactly)
    assert 0.6 <= out[1] < 1.0, rec  # one letter missing: about 1 - 1/10
    assert out[2] <= 0.4, rec  # a wrong text: clearly lower
    assert out[3] == 0.0 and rec[3] == ""  # nothing to read
    assert out[0] > out[1] > out[2]
    print(f"rapidocr: {elapsed:.3f} s per 256x256 image")


def test_ocr_real_engine_tensor_input_and_single_quotes(ocr_reward):
    images = [render("OPEN"), render("CLOSED")]
    x = torch.from_numpy(np.stack([np.asarray(im) for im in images])).permute(0, 3, 1, 2).float() / 255.0
    out = ocr_reward(x, ["a shop sign reading 'open' in neon"] * 2)["ocr"]
    assert out[0] >= 0.95 and out[1] <= 0.5, ocr_reward.last_info["recognized"]
    pil = ocr_reward(images, ["a shop sign reading 'open' in neon"] * 2)["ocr"]
    torch.testing.assert_close(out, pil)


def test_a_weights_file_of_the_wrong_kind_is_one_missing_weights_error(tmp_path):
    """A text file, another pickle or a head of the wrong shape as a reward's weights, and another model's folder as
    a transformers reward backbone: each a MissingWeightsError naming the file (one line from mmrl score / eval /
    train), never torch's unpickler KeyError or a config validation error from inside transformers."""
    from transformers import CLIPModel

    from mmrl.pipelines.vlm.tiny import build_tiny_qwen2_5_vl
    from mmrl.rewards._base import load_pretrained
    from mmrl.rewards.aesthetic import load_aesthetic_head
    from mmrl.rewards.hps import load_hps_model

    text = tmp_path / "notes.pth"
    text.write_text("not a checkpoint")
    with pytest.raises(MissingWeightsError, match=r"notes.pth is not a readable LAION aesthetic head checkpoint"):
        load_aesthetic_head(text)
    with pytest.raises(MissingWeightsError, match=r"notes.pth is not a readable HPS checkpoint"):
        load_hps_model(str(text))
    listed = tmp_path / "list.pth"
    torch.save([1, 2], listed)
    with pytest.raises(MissingWeightsError, match=r"expected a LAION aesthetic head state dict .* got list"):
        load_aesthetic_head(listed)
    narrow = tmp_path / AESTHETIC_HEAD_FILE
    torch.save({k: v[..., :3] if k == "layers.2.weight" else v for k, v in AestheticHead().state_dict().items()},
               narrow)
    with pytest.raises(MissingWeightsError, match=r"does not match the aesthetic MLP"):
        load_aesthetic_head(narrow)
    qwen = build_tiny_qwen2_5_vl(tmp_path / "qwen")
    with pytest.raises(MissingWeightsError, match=r"could not load the PickScore model .*qwen"):
        load_pretrained(CLIPModel, qwen, [[["config.json"]]], "PickScore model", "model")
