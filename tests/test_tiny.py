"""Tiny SD3 / FLUX pipelines: build offline, reload, generate, determinism, cache reuse."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from mmrl.pipelines.flow import tiny
from mmrl.pipelines.flow.tiny import build_tiny_flux, build_tiny_sd3, ensure_tiny

PROMPTS = ["a photo of a cat sitting on a red table", "the quick brown fox jumps over the lazy dog"]


def _load(kind: str, path: Path):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    cls = {"sd3": StableDiffusion3Pipeline, "flux": FluxPipeline}[kind]
    pipe = cls.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(pipe, prompts=PROMPTS, seed=0, steps=3):
    return pipe(
        prompts,
        height=32,
        width=32,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
        max_sequence_length=16,
    ).images


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {"sd3": build_tiny_sd3(root / "sd3"), "flux": build_tiny_flux(root / "flux")}


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_reload_generates_deterministic_images(built, kind):
    pipe_a, pipe_b = _load(kind, built[kind]), _load(kind, built[kind])
    img_a, img_b = _generate(pipe_a), _generate(pipe_b)
    assert img_a.shape == (2, 3, 32, 32)
    assert img_a.dtype == torch.float32
    assert torch.isfinite(img_a).all()
    assert img_a.min() >= 0 and img_a.max() <= 1
    assert torch.equal(img_a, img_b), "two loads of the same build must draw identical images"
    # The output depends on the noise and on the prompt (text encoders are wired in).
    assert not torch.equal(img_a, _generate(pipe_a, seed=1))
    swapped = _generate(pipe_a, prompts=PROMPTS[::-1])  # same noise, prompts exchanged
    assert not torch.equal(img_a, swapped)


def test_components_are_tiny_and_shaped_as_documented(built):
    sd3, flux = _load("sd3", built["sd3"]), _load("flux", built["flux"])
    for pipe in (sd3, flux):
        for name, module in pipe.components.items():
            if isinstance(module, torch.nn.Module):
                n = sum(p.numel() for p in module.parameters())
                assert 0 < n < 1_000_000, f"{name}: {n} parameters"
        assert pipe.vae_scale_factor == 2
        assert pipe.vae.config.latent_channels == 16
    # SD3: the pipeline's default resolution is the build's image_size.
    assert sd3.default_sample_size * sd3.vae_scale_factor == 32
    assert sd3.transformer.config.in_channels == 16
    assert sd3.transformer.config.pooled_projection_dim == (
        sd3.text_encoder.config.projection_dim + sd3.text_encoder_2.config.projection_dim
    )
    assert sd3.scheduler.config.shift == 3.0
    # FLUX: 2x2 packed latents, dynamic shift.
    assert flux.transformer.config.in_channels == 4 * flux.vae.config.latent_channels
    assert flux.scheduler.config.use_dynamic_shifting


@pytest.mark.parametrize("builder", [build_tiny_sd3, build_tiny_flux])
def test_same_seed_builds_are_byte_identical(tmp_path, builder):
    a = _files(builder(tmp_path / "a", seed=0))
    b = _files(builder(tmp_path / "b", seed=0))
    assert a.keys() == b.keys()
    assert any(k.endswith(".safetensors") for k in a)
    different = [k for k in a if a[k] != b[k]]
    assert not different, f"files differ between two seed-0 builds: {different}"
    c = _files(builder(tmp_path / "c", seed=1))
    assert a["transformer/diffusion_pytorch_model.safetensors"] != c["transformer/diffusion_pytorch_model.safetensors"]


def test_tokenizers_are_deterministic_and_cover_english(tmp_path, built):
    other = build_tiny_sd3(tmp_path / "again")
    a, b = _load("sd3", built["sd3"]), _load("sd3", other)
    text = PROMPTS + ["zebra xylophone, 42 jumping quickly!", ""]
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        tok_a, tok_b = getattr(a, name), getattr(b, name)
        assert tok_a.get_vocab() == tok_b.get_vocab()
        assert tok_a(text).input_ids == tok_b(text).input_ids

    clip, t5 = a.tokenizer, a.tokenizer_3
    ids = clip(PROMPTS[1]).input_ids
    assert ids[0] == clip.bos_token_id and ids[-1] == clip.eos_token_id
    assert clip.unk_token_id not in ids[1:-1]  # pad/unk share <|endoftext|>; only the last is the eos
    assert clip.decode(ids, skip_special_tokens=True) == PROMPTS[1]
    assert "cat</w>" in clip.convert_ids_to_tokens(clip(PROMPTS[0]).input_ids)

    t5_ids = t5(PROMPTS[1]).input_ids
    assert t5_ids[-1] == t5.eos_token_id and t5.unk_token_id not in t5_ids
    assert t5.decode(t5_ids, skip_special_tokens=True) == PROMPTS[1]
    assert "\u2581photo" in t5.convert_ids_to_tokens(t5(PROMPTS[0]).input_ids)
    # The ids the text encoders see fit their embedding tables.
    assert max(clip.get_vocab().values()) < a.text_encoder.config.vocab_size
    assert max(t5.get_vocab().values()) < a.text_encoder_3.config.vocab_size


def test_ensure_tiny_builds_once_and_reuses(tmp_path, monkeypatch):
    path = ensure_tiny("sd3", tmp_path)
    assert path == tmp_path / "tiny-sd3-v2"
    assert (path / "model_index.json").is_file()
    weights = path / "transformer" / "diffusion_pytorch_model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def no_rebuild(outdir, **kwargs):
        raise AssertionError("ensure_tiny rebuilt a complete cached build")

    monkeypatch.setitem(tiny._BUILDERS, "sd3", no_rebuild)
    assert ensure_tiny("sd3", tmp_path) == path
    assert weights.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-sd3-v2"], "temp dir left behind"
    _generate(_load("sd3", path), steps=1)


def test_ensure_tiny_default_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MMRL_CACHE", str(tmp_path / "cache"))
    path = ensure_tiny("flux")
    assert path == tmp_path / "cache" / "tiny-flux-v2"
    assert _generate(_load("flux", path), steps=1).shape == (2, 3, 32, 32)


def test_ensure_tiny_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def broken(outdir, **kwargs):
        (Path(outdir) / "partial.bin").write_bytes(b"x")
        raise RuntimeError("boom")

    monkeypatch.setitem(tiny._BUILDERS, "flux", broken)
    with pytest.raises(RuntimeError, match="boom"):
        ensure_tiny("flux", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_ensure_tiny_replaces_incomplete_dir(tmp_path):
    stale = tmp_path / "tiny-flux-v2"
    stale.mkdir()
    (stale / "junk").write_text("not a pipeline")
    path = ensure_tiny("flux", tmp_path)
    assert not (path / "junk").exists() and (path / "model_index.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-flux-v2"]


def test_ensure_tiny_loses_a_race_gracefully(tmp_path, monkeypatch):
    real = tiny._BUILDERS["flux"]
    final = tmp_path / "tiny-flux-v2"

    def racing(outdir, **kwargs):
        real(outdir, **kwargs)
        # Another process moves its complete build into place while this one is finishing.
        shutil.copytree(outdir, final)
        (final / tiny._COMPLETE_MARKER).write_text("other process\n")

    monkeypatch.setitem(tiny._BUILDERS, "flux", racing)
    assert ensure_tiny("flux", tmp_path) == final
    assert (final / tiny._COMPLETE_MARKER).read_text() == "other process\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-flux-v2"]


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown kind"):
        ensure_tiny("sdxl", tmp_path)
    with pytest.raises(ValueError, match="multiple of 4"):
        build_tiny_sd3(tmp_path / "x", image_size=30)
    with pytest.raises(ValueError, match="multiple of 4"):
        build_tiny_flux(tmp_path / "y", image_size=18)
