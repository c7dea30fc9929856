"""Tiny, randomly initialised SD3 and FLUX pipelines built from configs, offline.

What they are for
-----------------
* **Tests.** Every flow-matching code path (SDE stepping, log-probabilities, LoRA, save/load,
  the trainer loop) runs against a *real* ``diffusers.StableDiffusion3Pipeline`` /
  ``diffusers.FluxPipeline`` with real diffusers/transformers modules, just very small ones.
  No mocks, no downloads.
* **The embedded CPU default.** ``mmrl train`` with a tiny config needs some generator to run on a
  laptop without a GPU or network access; :func:`ensure_tiny` builds one once into the user cache
  and every later run reuses it.

The images they draw are noise-like (the weights are random); only shapes, dtypes, determinism
and the plumbing are meaningful.

Determinism
-----------
Each component is initialised under ``torch.random.fork_rng`` with the global RNG seeded to
``seed + k`` (k fixed per component), so a build neither depends on nor disturbs the caller's
RNG state.
Tokenizers are *not* trained (the ``tokenizers`` BPE trainer does not give the same ids from one
run to the next): the CLIP tokenizer gets a fixed byte-level vocabulary (the 256 byte symbols,
the same with the ``</w>`` end-of-word suffix, merges for a fixed list of common words, and the
two special tokens) and the T5 tokenizer a fixed Unigram vocabulary (characters, ``▁``-prefixed
characters and common words). Both cover any lowercase English prompt (CLIP's byte-level
alphabet covers any text; T5 maps characters outside its vocabulary to ``<unk>``). Two builds
with the same seed write byte-identical files.

Sizes (defaults)
----------------
SD3: transformer 2 joint blocks (SD3.5-Medium style: RMS q/k norm, dual attention in block 0),
4 heads x 8 dims; VAE 2 levels (scale factor 2), 16 latent channels; two CLIP text encoders
(hidden 32, 2 layers, projections 32 + 32 = pooled 64); T5 encoder (d_model 64, 2 layers).
FLUX: transformer 1 double + 1 single block, 2 heads x 16 dims, guidance embedding (FLUX.1-dev
style); the same VAE family with FLUX's scaling/shift; one CLIP (pooled 32); the same T5.
Each component is well under 1M parameters.

Use ``height=width=32`` (or any multiple of 4) with FLUX: ``FluxPipeline`` hard-codes a
default sample size of 128 latents, so its default height would be 256 px. For speed pass a
short ``max_sequence_length`` (e.g. 16): the pipelines pad T5 to 256 (SD3) / 512 (FLUX) tokens
by default, which makes a 10-step batch of 8 about 4x slower (still well under a second).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["build_tiny_sd3", "build_tiny_flux", "ensure_tiny", "TINY_VERSION"]

#: Bumped whenever the architecture, vocabularies or seeding change; part of the cache dir name.
TINY_VERSION = "v2"

_COMPLETE_MARKER = ".mmrl-tiny-complete"

# ------------------------------------------------------------------------------------------------
# Deterministic tokenizers
# ------------------------------------------------------------------------------------------------

#: Words that get whole-word tokens (CLIP merges, T5 Unigram pieces). Fixed, ordered: changing it
#: changes token ids, so bump TINY_VERSION if you do.
_COMMON_WORDS = (
    "a", "an", "the", "of", "and", "in", "on", "with", "to", "at", "is", "by", "for", "from",
    "photo", "picture", "image", "painting", "drawing", "style", "high", "quality", "detailed",
    "cat", "dog", "bird", "horse", "car", "house", "tree", "flower", "sky", "sea", "city",
    "man", "woman", "child", "person", "table", "apple", "red", "green", "blue", "yellow",
    "black", "white", "small", "large", "two", "three", "one", "four", "sitting", "standing",
)
_CLIP_MAX_LENGTH = 77
_T5_MAX_LENGTH = 32


def _vocabulary_words(words: Sequence[str] | None) -> Sequence[str]:
    """The whole words of the tiny vocabularies: ``_COMMON_WORDS`` as they stand, else ``words`` deduplicated and
    sorted."""
    return _COMMON_WORDS if words is None else sorted(set(words))


def _clip_vocab_and_merges(words: Sequence[str] | None = None) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A CLIP-style byte-level BPE vocabulary: byte symbols, byte symbols + ``</w>``, whole-word
    merges for ``words`` (default ``_COMMON_WORDS``), then ``<|startoftext|>`` and ``<|endoftext|>`` (as in CLIP)."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())  # the 256 byte-level symbols, fixed order
    tokens = list(alphabet) + [c + "</w>" for c in alphabet]
    merges: list[tuple[str, str]] = []
    seen = set(tokens)
    # Longer words first, so their merges outrank those of words they contain ("cat" vs "at").
    for word in sorted(_vocabulary_words(words), key=lambda w: (-len(w), w)):
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        left = symbols[0]
        for right in symbols[1:]:
            merged = left + right
            if merged not in seen:
                merges.append((left, right))
                tokens.append(merged)
                seen.add(merged)
            left = merged
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(tokens)}, merges


def _clip_tokenizer(words: Sequence[str] | None = None, max_length: int = _CLIP_MAX_LENGTH):
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocab_and_merges(words)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def _t5_vocab(words: Sequence[str] | None = None) -> list[tuple[str, float]]:
    """A T5-style Unigram vocabulary: ``<pad>``, ``</s>``, ``<unk>`` at ids 0, 1, 2 (as T5 expects),
    then ``▁``, characters, ``▁``-prefixed characters and whole words (``words``, default ``_COMMON_WORDS``).
    Words score higher than their spelled-out characters, so the Viterbi segmentation prefers them."""
    chars = "abcdefghijklmnopqrstuvwxyz0123456789.,;:!?'\"-()/&"
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(c, -6.0) for c in chars]
    vocab += [("\u2581" + c, -5.0) for c in chars]
    vocab += [("\u2581" + w, -3.0) for w in _vocabulary_words(words) if len(w) > 1]
    return vocab


def _t5_tokenizer(words: Sequence[str] | None = None, max_length: int = _T5_MAX_LENGTH):
    from transformers import T5TokenizerFast

    # transformers 5: T5TokenizerFast is T5Tokenizer, backed by `tokenizers` with a Unigram model
    # built from (piece, score) pairs, so no sentencepiece file is needed.
    return T5TokenizerFast(vocab=_t5_vocab(words), extra_ids=0, model_max_length=max_length)


# ------------------------------------------------------------------------------------------------
# Component builders (each seeded independently; see _seeded)
# ------------------------------------------------------------------------------------------------


@contextmanager
def _seeded(seed: int):
    """Run a block with the global torch RNG seeded to ``seed``, restoring the caller's state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _clip_text_encoder(vocab_size: int, eos_token_id: int, bos_token_id: int, *, hidden: int,
                       projection: int | None, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=_CLIP_MAX_LENGTH,
        hidden_act="gelu",
        projection_dim=projection or hidden,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    with _seeded(seed):
        model = (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)
    return model.eval()


def _t5_encoder(vocab_size: int, *, d_model: int, seed: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=d_model // 4,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",  # T5 v1.1, the variant SD3 and FLUX use
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        is_encoder_decoder=False,
        use_cache=False,
    )
    with _seeded(seed):
        model = T5EncoderModel(config)
    return model.eval()


def _vae(*, scaling_factor: float, shift_factor: float, image_size: int, seed: int):
    from diffusers import AutoencoderKL

    with _seeded(seed):
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(16, 32),  # two levels -> vae_scale_factor 2
            layers_per_block=1,
            latent_channels=16,
            norm_num_groups=8,
            sample_size=image_size,
            scaling_factor=scaling_factor,
            shift_factor=shift_factor,
            use_quant_conv=False,  # as in SD3 / FLUX
            use_post_quant_conv=False,
            mid_block_add_attention=True,
        )
    return vae.eval()


_VAE_SCALE = 2  # 2 ** (len(block_out_channels) - 1)


def _check_image_size(image_size: int, multiple: int, kind: str) -> None:
    if image_size <= 0 or image_size % multiple:
        raise ValueError(f"tiny {kind}: image_size must be a positive multiple of {multiple}, got {image_size}")


def _save(pipe, outdir: str | Path) -> Path:
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(outdir, safe_serialization=True)
    return outdir


# ------------------------------------------------------------------------------------------------
# Public builders
# ------------------------------------------------------------------------------------------------


def build_tiny_sd3(outdir: str | Path, *, seed: int = 0, image_size: int = 32) -> Path:
    """Build a random-weight ``StableDiffusion3Pipeline`` (SD3.5-Medium architecture, tiny) and
    save it with ``save_pretrained`` into ``outdir``; returns ``outdir`` as a ``Path``.

    Default height/width of the saved pipeline is ``image_size`` (a multiple of 4: VAE factor 2 x
    patch 2). Load with ``StableDiffusion3Pipeline.from_pretrained(outdir)``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    patch = 2
    _check_image_size(image_size, _VAE_SCALE * patch, "sd3")
    sample_size = image_size // _VAE_SCALE
    clip_hidden, clip_proj, t5_dim = 32, 32, 64

    tokenizer = _clip_tokenizer()
    tokenizer_3 = _t5_tokenizer()
    vocab = len(tokenizer)
    text_encoder = _clip_text_encoder(vocab, tokenizer.eos_token_id, tokenizer.bos_token_id,
                                      hidden=clip_hidden, projection=clip_proj, seed=seed + 1)
    text_encoder_2 = _clip_text_encoder(vocab, tokenizer.eos_token_id, tokenizer.bos_token_id,
                                        hidden=clip_hidden, projection=clip_proj, seed=seed + 2)
    text_encoder_3 = _t5_encoder(len(tokenizer_3), d_model=t5_dim, seed=seed + 3)
    # SD3/SD3.5 VAE latent statistics.
    vae = _vae(scaling_factor=1.5305, shift_factor=0.0609, image_size=image_size, seed=seed + 4)
    with _seeded(seed + 5):
        transformer = SD3Transformer2DModel(
            sample_size=sample_size,
            patch_size=patch,
            in_channels=16,
            out_channels=16,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            # CLIP hidden states (32 + 32) are zero-padded to the T5 width and concatenated with T5's.
            joint_attention_dim=t5_dim,
            caption_projection_dim=32,
            pooled_projection_dim=2 * clip_proj,
            # in patches; lets the same weights draw up to 4x the default side length
            pos_embed_max_size=4 * (sample_size // patch),
            dual_attention_layers=(0,),
            qk_norm="rms_norm",
        ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=_clip_tokenizer(),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    return _save(pipe, outdir)


def build_tiny_flux(outdir: str | Path, *, seed: int = 0, image_size: int = 32) -> Path:
    """Build a random-weight ``FluxPipeline`` (FLUX.1-dev architecture, tiny) and save it with
    ``save_pretrained`` into ``outdir``; returns ``outdir`` as a ``Path``.

    ``FluxPipeline`` packs 2x2 latent patches into tokens, so height/width must be multiples of
    4 (VAE factor 2 x packing 2). Always pass ``height``/``width``: FluxPipeline's default sample
    size is hard-coded (256 px with this VAE).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    _check_image_size(image_size, _VAE_SCALE * 2, "flux")
    clip_hidden, t5_dim = 32, 64

    tokenizer = _clip_tokenizer()
    tokenizer_2 = _t5_tokenizer()
    text_encoder = _clip_text_encoder(len(tokenizer), tokenizer.eos_token_id, tokenizer.bos_token_id,
                                      hidden=clip_hidden, projection=None, seed=seed + 1)
    text_encoder_2 = _t5_encoder(len(tokenizer_2), d_model=t5_dim, seed=seed + 3)
    # FLUX VAE latent statistics.
    vae = _vae(scaling_factor=0.3611, shift_factor=0.1159, image_size=image_size, seed=seed + 4)
    with _seeded(seed + 5):
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=16 * 4,  # 16 latent channels packed 2x2
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=t5_dim,
            pooled_projection_dim=clip_hidden,  # CLIPTextModel pooler output
            guidance_embeds=True,  # FLUX.1-dev: distilled guidance as an input
            axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
        ).eval()
    # FLUX.1's scheduler config: resolution-dependent (dynamic) shift.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    return _save(pipe, outdir)


_BUILDERS = {"sd3": build_tiny_sd3, "flux": build_tiny_flux}


def _default_cache_dir() -> Path:
    env = os.environ.get("MMRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mmrl"


def ensure_tiny(kind: str, cache_dir: str | Path | None = None) -> Path:
    """Return the path of the tiny ``kind`` pipeline (``"sd3"`` or ``"flux"``), building it once
    (see :func:`ensure_built`) as ``tiny-<kind>-<TINY_VERSION>``."""
    if kind not in _BUILDERS:
        raise ValueError(f"ensure_tiny: unknown kind {kind!r}; expected one of {sorted(_BUILDERS)}")
    return ensure_built(f"tiny-{kind}-{TINY_VERSION}", _BUILDERS[kind], cache_dir)


#: A ``.<name>.tmp-*`` / ``.<name>.stale-*`` folder older than this whose builder is gone is removed by the next build.
STALE_AFTER_S = 3600.0


@contextmanager
def _build_lock(parent: Path, name: str):
    """An exclusive ``fcntl.flock`` on ``parent/.<name>.lock``, held by one builder at a time across processes and
    torchrun ranks (the kernel releases it if the holder dies). The holder deletes the file before unlocking, so
    the cache keeps no lock files; a waiter that then gets the lock of the deleted file sees that the path no
    longer names it and locks afresh (the usual pattern for removable lock files). Without fcntl: no lock."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    path = parent / f".{name}.lock"
    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                break
        except FileNotFoundError:  # deleted by the previous holder between our open and our lock
            pass
        handle.close()
    try:
        yield
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        handle.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    except OSError:
        return False
    return True


def _remove_stale_siblings(parent: Path, name: str, max_age_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove ``.<name>.tmp-*`` and ``.<name>.stale-*`` folders left by builds that were killed: older than
    ``max_age_s`` and, when the folder names its builder (``.<name>.tmp-<pid>-...``), that process is gone.
    Called with the build lock held, so no live build of this version owns them. Returns what was removed."""
    import time

    removed = []
    now = time.time()
    for prefix in (f".{name}.tmp-", f".{name}.stale-"):
        for path in parent.glob(f"{prefix}*"):
            try:
                age = now - path.lstat().st_mtime
            except FileNotFoundError:
                continue
            if age < max_age_s:
                continue
            pid = path.name[len(prefix):].split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
                continue
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(path)
    return removed


def ensure_built(name: str, builder, cache_dir: str | Path | None = None) -> Path:
    """``cache_dir/name`` (default ``$MMRL_CACHE`` or ``~/.cache/mmrl``), made once by ``builder(path)``.

    A complete build carries a marker file and is never moved or changed again, so a caller that found the
    marker can load from it while others run. Building happens under an exclusive lock (``.<name>.lock``,
    ``fcntl.flock``, removed afterwards): concurrent callers (torchrun ranks, parallel test processes) wait
    for the first, find its marker and reuse its build; only the lock holder ever builds, sets an unmarked
    ``name`` folder aside or renames into place. The build goes into ``.<name>.tmp-<pid>-*`` next to it and
    is moved into place with ``os.replace`` (atomic), so ``name`` is either absent or complete. Temporary
    and set-aside folders that killed builds left behind (older than :data:`STALE_AFTER_S`, builder gone)
    are removed when building.
    """
    from mmrl.checkpoint import apply_umask

    parent = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir()
    final = parent / name
    if (final / _COMPLETE_MARKER).is_file():
        return final
    parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(parent, final.name):
        if (final / _COMPLETE_MARKER).is_file():  # another process built it while we waited for the lock
            return final
        _remove_stale_siblings(parent, final.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=parent))
        try:
            builder(tmp)
            (tmp / _COMPLETE_MARKER).write_text(f"mmrl {name} seed=0\n")
            apply_umask(tmp)  # mkdtemp makes it 0700 and safetensors its files 0600: read like a normal folder
            if (final / _COMPLETE_MARKER).is_file():
                return final  # a builder that takes no lock (an older mmrl) finished first: use its build
            if final.exists() or final.is_symlink():
                # Not ours to trust (no marker: left by something other than this function): set it aside. A
                # marked build is never moved, so a caller that found the marker can load from it.
                stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.stale-{os.getpid()}-", dir=parent))
                os.replace(final, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            try:
                os.replace(tmp, final)
            except OSError:
                if not (final / _COMPLETE_MARKER).is_file():  # not a complete build that appeared meanwhile
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final
