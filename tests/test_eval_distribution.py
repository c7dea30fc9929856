"""``mmrl eval``'s distribution benchmarks (mmrl.eval.distribution): FID / KID with clean-fid's code on a tiny stand-in
Inception TorchScript module (checked against numpy/scipy formulas written here, on the same features), identical sets
giving FID ~ 0, the reference and generated feature caches (counted forward calls), diversity worked by hand on fixed
embeddings, the one-line errors for bad input, and one end-to-end ``run_eval`` on the tiny flow config.

clean-fid's ``frechet_distance`` takes ~10 s on this machine (scipy's sqrtm of a 2048 x 2048 matrix), so only two
tests run it; the others replace it by the same formula on the stand-in's 6 non-zero feature dimensions."""
from __future__ import annotations

import json
import math
import os
import shutil
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import mmrl.build
import mmrl.eval.benchmarks
import mmrl.eval.distribution as dist
from fixtures import one_error, tiny_flow_config, truncate_file, write_garbage
from mmrl.cli import main
from mmrl.eval.protocol import file_sha256
from mmrl.eval.runner import EvalError, EvalItem, EvalOptions, run_eval

FAST = ["resolution=32", "num_steps=2"]
DIMS = 6  # the stand-in's non-zero feature dimensions (of 2048)


# ---------------------------------------------------------------------------------------------- stand-ins


class _Layers(torch.nn.Module):
    """[B, 3, 299, 299] in [-1, 1] -> [B, 2048, 1, 1]: tanh of a fixed projection of the 2x2 mean colours, padded
    with zeros."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("w", torch.randn(12, DIMS, generator=g) * 3)
        self.pad = 2048 - DIMS

    def forward(self, x):
        f = torch.tanh(F.adaptive_avg_pool2d(x, 2).flatten(1) @ self.w)
        return torch.cat([f, torch.zeros(x.shape[0], self.pad, dtype=f.dtype)], 1).view(-1, 2048, 1, 1)


class _StandIn(torch.nn.Module):
    """The forward signature of clean-fid's Inception TorchScript file: ``layers`` (clean mode) and
    ``forward(img, return_features)`` (legacy_tensorflow: resizes inside)."""

    def __init__(self):
        super().__init__()
        self.layers = _Layers()

    def forward(self, img, return_features: bool = False):
        x = F.interpolate(img, size=(299, 299), mode="bilinear", align_corners=False)
        return self.layers((x - 128) / 128).view(-1, 2048)


@pytest.fixture(scope="module")
def inception(tmp_path_factory):
    path = tmp_path_factory.mktemp("inception") / dist.INCEPTION_FILE
    torch.jit.script(_StandIn()).save(str(path))
    return path


def noise_images(folder, n, seed, sizes=((40, 48), (32, 32), (50, 30)), ext="png"):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        base = rng.integers(0, 256, size=3)
        array = np.clip(base + rng.normal(0, 40, size=(h, w, 3)), 0, 255).astype(np.uint8)
        path = folder / f"{i:03d}.{ext if i % 3 else 'png'}"
        Image.fromarray(array).save(path)
        paths.append(path)
    return paths


@pytest.fixture
def forwards(monkeypatch):
    """Images passed through clean-fid's Inception wrapper (forward calls counted by batch size)."""
    from cleanfid.inception_torchscript import InceptionV3W

    seen = {"images": 0, "calls": 0}
    original = InceptionV3W.forward

    def counted(self, x):
        seen["images"] += x.shape[0]
        seen["calls"] += 1
        return original(self, x)

    monkeypatch.setattr(InceptionV3W, "forward", counted)
    return seen


def fid_formula(a, b):
    """Independent FID: ||mu_a - mu_b||^2 + tr(S_a + S_b - 2 (S_a S_b)^(1/2)) on the stand-in's non-zero dimensions
    (the zero-padded ones contribute nothing), via the eigenvalues of S_a S_b."""
    assert not a[:, DIMS:].any() and not b[:, DIMS:].any()
    a, b = a[:, :DIMS].astype(np.float64), b[:, :DIMS].astype(np.float64)
    sa, sb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    eig = np.clip(np.linalg.eigvals(sa @ sb).real, 0, None)
    d = a.mean(0) - b.mean(0)
    return float(d @ d + np.trace(sa) + np.trace(sb) - 2 * np.sqrt(eig).sum())


def kid_formula(ref, gen, subsets, size, seed=0):
    """Independent KID: mean over subsets of the unbiased MMD^2 with k(x, y) = (x.y / 2048 + 1)^3, the subsets drawn
    as clean-fid's kernel_distance(ref, gen) draws them (from its second argument, the generated set, first) from
    NumPy's global RNG seeded with mmrl's KID_SEED."""
    ref, gen = ref.astype(np.float64), gen.astype(np.float64)
    m = min(len(ref), len(gen), size)
    np.random.seed(seed)
    values = []
    for _ in range(subsets):
        x = gen[np.random.choice(len(gen), m, replace=False)]
        y = ref[np.random.choice(len(ref), m, replace=False)]
        kxx, kyy, kxy = ((x @ x.T / 2048 + 1) ** 3, (y @ y.T / 2048 + 1) ** 3, (x @ y.T / 2048 + 1) ** 3)
        off = lambda k: (k.sum() - np.trace(k)) / (m * (m - 1))  # noqa: E731
        values.append(off(kxx) + off(kyy) - 2 * kxy.mean())
    return float(np.mean(values))


@pytest.fixture
def fast_frechet(monkeypatch):
    """clean-fid's frechet_distance replaced by the same formula on the non-zero dimensions (clean-fid's takes ~10 s
    here); records its calls."""
    import cleanfid.fid

    calls = []

    def frechet(mu1, sigma1, mu2, sigma2, eps=1e-6):
        calls.append((mu1.dtype, sigma1.shape))
        s1, s2 = sigma1[:DIMS, :DIMS], sigma2[:DIMS, :DIMS]
        d = mu1[:DIMS] - mu2[:DIMS]
        eig = np.clip(np.linalg.eigvals(s1 @ s2).real, 0, None)
        return float(d @ d + np.trace(s1) + np.trace(s2) - 2 * np.sqrt(eig).sum())

    monkeypatch.setattr(cleanfid.fid, "frechet_distance", frechet)
    return calls


def fid_scorer(ref_dir, inception, name="fid@drawbench", **extra):
    options = EvalOptions(benchmarks=[name], extra={"reference_images": str(ref_dir), "inception": str(inception),
                                                    **extra})
    spec = dist.benchmark(name, options)
    return dist.make_scorer(spec, options)


def eval_folder(out, images, folder="fid@drawbench"):
    """An eval folder holding ``images`` as generated PNGs, and their rows."""
    (out / "images" / folder).mkdir(parents=True, exist_ok=True)
    rows = []
    for i, source in enumerate(images):
        rel = f"images/{folder}/{i:05d}_0.png"
        with Image.open(source) as image:
            image.convert("RGB").save(out / rel)
        rows.append({"prompt_index": i, "image_index": 0, "image": rel, "scores": {}})
    return rows


def clean_fid_features(files, inception, mode="clean"):
    """The features clean-fid itself gives (its get_files_features with its InceptionV3W), outside mmrl."""
    from cleanfid.fid import get_files_features
    from cleanfid.inception_torchscript import InceptionV3W

    model = InceptionV3W(str(inception.parent), download=False, resize_inside=mode == "legacy_tensorflow")
    return np.concatenate([get_files_features([str(f)], model, num_workers=0, batch_size=1, device=torch.device("cpu"),
                                              mode=mode, verbose=False) for f in files])


# ---------------------------------------------------------------------------------------------- FID / KID


def test_fid_and_kid_are_clean_fids_and_match_the_formulas(inception, tmp_path, forwards):
    refs = noise_images(tmp_path / "ref", 8, seed=1, ext="jpg")
    gens = noise_images(tmp_path / "gen", 5, seed=2, sizes=((32, 32),))
    scorer = fid_scorer(tmp_path / "ref", inception)
    out = tmp_path / "run" / "eval" / "step_1"
    rows = eval_folder(out, gens)
    with warnings.catch_warnings(record=True) as escaped:  # clean-fid's real frechet_distance, the installed scipy
        warnings.simplefilter("always")
        metrics = scorer.summarize(rows, [], out)
    # scipy 1.16-1.17's deprecation of sqrtm(disp=...), which clean-fid passes, neither reaches the console nor the
    # metrics' warnings
    assert not [w for w in escaped if "disp" in str(w.message)], [str(w.message) for w in escaped]
    assert not [n for n in metrics["warnings"] if "disp" in n]
    assert forwards["images"] == 8 + 5

    ref_feats, gen_feats = clean_fid_features(refs, inception), clean_fid_features([out / r["image"] for r in rows],
                                                                                   inception)
    assert gen_feats[:, :DIMS].std(0).min() > 1e-3  # the stand-in's features do vary
    assert metrics["fid"] == pytest.approx(fid_formula(gen_feats, ref_feats), rel=1e-4, abs=1e-6)
    assert metrics["kid"] == pytest.approx(kid_formula(ref_feats, gen_feats, 100, 1000), rel=1e-4, abs=1e-9)
    assert metrics["fid"] > 0.05
    assert (metrics["num_generated"], metrics["num_reference"], metrics["kid_subset_size_used"]) == (5, 8, 5)
    text = " ".join(metrics["warnings"])
    assert "FID from 5 generated images, fewer than the 2048 feature dimensions" in text
    assert "FID from 8 reference images" in text and "KID subsets of 5 images" in text
    # the reference cache holds clean-fid's features, keyed by content, mode and the Inception file
    cache = out / metrics["reference_cache"]
    with np.load(cache) as data:
        np.testing.assert_allclose(data["feats"], ref_feats, rtol=1e-5, atol=1e-7)
        meta = json.loads(str(data["meta"]))
    assert meta["inception_sha256"] == scorer.settings["inception_sha256"] and meta["fid_mode"] == "clean"
    assert meta["packages"] == dist.feature_packages() and set(meta["packages"]) == {"clean-fid", "Pillow", "torch"}
    assert meta["packages"]["clean-fid"] == "0.1.35"
    # the settings name the official scorer and every convention
    s = scorer.settings
    assert "clean-fid" in s["official"] and s["fid_mode"] == "clean" and s["reference_count"] == 8
    assert "make_resizer('PIL', False, 'bicubic', (299, 299))" in s["resize"]
    assert (s["kid_subsets"], s["kid_subset_size"], s["kid_seed"]) == (100, 1000, 0)


def test_identical_generated_and_reference_sets_give_fid_zero(inception, tmp_path, fast_frechet):
    gens = noise_images(tmp_path / "gen", 6, seed=3, sizes=((32, 32),))
    out = tmp_path / "out"
    rows = eval_folder(out, gens)
    ref = tmp_path / "ref"
    shutil.copytree(out / "images" / "fid@drawbench", ref)  # the very PNGs
    metrics = fid_scorer(ref, inception).summarize(rows, [], out)
    # the generated and the reference paths give the same features for the same files
    with np.load(out / metrics["reference_cache"]) as r, np.load(next((out / "fid_features").iterdir())) as g:
        generated = dict(zip(map(str, g["sha256"]), g["feats"]))
        assert len(generated) == 6 and all(np.array_equal(generated[file_sha256(f)], feats)
                                           for f, feats in zip(sorted(ref.iterdir()), r["feats"]))
    assert abs(metrics["fid"]) < 1e-6
    # KID, the unbiased MMD^2, of a set with itself (the subsets are the whole sets): 2 (mean off-diagonal k - mean k)
    f = clean_fid_features(sorted(ref.iterdir()), inception).astype(np.float64)
    k = (f @ f.T / 2048 + 1) ** 3
    expected = 2 * ((k.sum() - np.trace(k)) / (6 * 5) - k.mean())
    assert metrics["kid"] == pytest.approx(expected, rel=1e-6) and metrics["kid"] < 0


def test_the_feature_caches_are_reused(inception, tmp_path, forwards, fast_frechet):
    noise_images(tmp_path / "ref", 7, seed=1)
    gens = noise_images(tmp_path / "gen", 6, seed=2, sizes=((32, 32),))
    out = tmp_path / "run" / "eval" / "step_1"
    rows = eval_folder(out, gens[:4])
    first = fid_scorer(tmp_path / "ref", inception).summarize(rows, [], out)
    assert forwards["images"] == 7 + 4
    assert fast_frechet[0] == (np.float64, (2048, 2048))  # float64 statistics go to clean-fid's frechet_distance
    # a resumed or repeated evaluation: a fresh scorer, nothing recomputed, the model not even loaded
    again = fid_scorer(tmp_path / "ref", inception)
    assert again.summarize(rows, [], out) == first
    assert forwards["images"] == 7 + 4 and again.model is None
    # more prompts (a larger limit): only the new image's features
    rows = eval_folder(out, gens[:5])
    fid_scorer(tmp_path / "ref", inception).summarize(rows, [], out)
    assert forwards["images"] == 7 + 5
    # another checkpoint's eval folder next to it reuses the reference cache in place
    sibling = tmp_path / "run" / "eval" / "step_2"
    rows2 = eval_folder(sibling, gens[1:6])
    metrics = fid_scorer(tmp_path / "ref", inception).summarize(rows2, [], sibling)
    assert forwards["images"] == 7 + 5 + 5
    assert metrics["reference_cache"].startswith(str(out / "fid_reference"))
    assert not (sibling / "fid_reference").exists()
    # a changed reference folder is another key: computed again
    noise_images(tmp_path / "ref2", 7, seed=1)
    Image.new("RGB", (20, 20), (1, 2, 3)).save(tmp_path / "ref2" / "zzz.png")
    fid_scorer(tmp_path / "ref2", inception).summarize(rows, [], out)
    assert forwards["images"] == 7 + 5 + 5 + 8
    # legacy_tensorflow (resize inside the network) is another key too, and runs with mixed image sizes
    metrics = fid_scorer(tmp_path / "ref", inception, fid_mode="legacy_tensorflow").summarize(rows, [], out)
    assert forwards["images"] == 7 + 5 + 5 + 8 + 7 + 5 and metrics["fid_mode"] == "legacy_tensorflow"
    feats = clean_fid_features(sorted((tmp_path / "ref").iterdir()), inception, "legacy_tensorflow")
    with np.load(out / metrics["reference_cache"]) as data:
        np.testing.assert_allclose(data["feats"], feats, rtol=1e-5, atol=1e-7)


def _rewrite_meta(path, **changes):
    """Rewrite a cache file's meta (the arrays kept), as an older mmrl or older packages would have left it."""
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    meta = json.loads(str(arrays["meta"]))
    meta.update(changes)
    arrays["meta"] = np.array(json.dumps(meta))
    with open(path, "wb") as handle:
        np.savez(handle, **arrays)


def test_the_caches_are_keyed_by_the_package_versions(inception, tmp_path, forwards, fast_frechet, monkeypatch):
    noise_images(tmp_path / "ref", 7, seed=1)
    gens = noise_images(tmp_path / "gen", 4, seed=2, sizes=((32, 32),))
    out = tmp_path / "run" / "eval" / "step_1"
    rows = eval_folder(out, gens)
    first = fid_scorer(tmp_path / "ref", inception).summarize(rows, [], out)
    assert forwards["images"] == 7 + 4
    ref_cache = out / first["reference_cache"]
    gen_cache = next((out / "fid_features").iterdir())
    # a cache under the very same name whose meta records another clean-fid (an older package made it): not reused
    _rewrite_meta(ref_cache, packages={**dist.feature_packages(), "clean-fid": "0.1.30"})
    _rewrite_meta(gen_cache, packages={**dist.feature_packages(), "torch": "1.13.0"})
    again = fid_scorer(tmp_path / "ref", inception).summarize(rows, [], out)
    assert forwards["images"] == 2 * (7 + 4) and again == first
    with np.load(ref_cache) as data:
        assert json.loads(str(data["meta"]))["packages"] == dist.feature_packages()  # computed again, rewritten
    # a sibling checkpoint's reference cache made under another Pillow: another key, not reused
    real = dist._version
    monkeypatch.setattr(dist, "_version", lambda name: "9.0.0" if name == "Pillow" else real(name))
    sibling = tmp_path / "run" / "eval" / "step_2"
    metrics = fid_scorer(tmp_path / "ref", inception).summarize(eval_folder(sibling, gens), [], sibling)
    assert forwards["images"] == 3 * (7 + 4)
    assert metrics["reference_cache"].startswith("fid_reference/") and (sibling / "fid_reference").is_dir()
    with np.load(sibling / metrics["reference_cache"]) as data:
        assert json.loads(str(data["meta"]))["packages"]["Pillow"] == "9.0.0"


def test_sibling_caches_only_in_the_run_eval_layout(inception, tmp_path, forwards, fast_frechet):
    noise_images(tmp_path / "ref", 7, seed=1)
    gens = noise_images(tmp_path / "gen", 4, seed=2, sizes=((32, 32),))
    # output_dir=/tmp/x style folders: their parent is not RUN/eval, its other folders are none of this run's
    a, b = tmp_path / "scratch" / "x", tmp_path / "scratch" / "y"
    fid_scorer(tmp_path / "ref", inception).summarize(eval_folder(a, gens), [], a)
    assert forwards["images"] == 7 + 4
    metrics = fid_scorer(tmp_path / "ref", inception).summarize(eval_folder(b, gens), [], b)
    assert forwards["images"] == 2 * (7 + 4)  # a's reference cache not searched for
    assert metrics["reference_cache"].startswith("fid_reference/") and (b / "fid_reference").is_dir()


def test_a_broken_symlink_among_the_references_is_an_error_naming_it(inception, tmp_path):
    noise_images(tmp_path / "ref", 3, seed=1)
    (tmp_path / "ref" / "sub.png").mkdir()  # a folder with an image's name: not a file, left out as before
    assert len(dist.reference_files(tmp_path / "ref")) == 3
    link = tmp_path / "ref" / "zz_gone.png"
    os.symlink(tmp_path / "nowhere.png", link)
    with pytest.raises(EvalError) as info:
        dist.reference_files(tmp_path / "ref")
    message = str(info.value)
    assert f"{link} is a broken symbolic link" in message and "nowhere.png" in message and "\n" not in message
    with pytest.raises(EvalError, match="zz_gone.png is a broken symbolic link"):
        fid_scorer(tmp_path / "ref", inception)
    # a link to an existing image is an image
    link.unlink()
    os.symlink(tmp_path / "ref" / "000.png", link)
    assert link in dist.reference_files(tmp_path / "ref")


def _failing_frechet(exc):
    def frechet(mu1, sigma1, mu2, sigma2, eps=1e-6):
        print("fid calculation produces singular product; adding 1e-06 to diagonal of cov estimates")
        warnings.warn("Matrix is singular and may not have a square root.", RuntimeWarning)
        warnings.warn("The `disp` argument is deprecated and will be removed in SciPy 1.18.0.", DeprecationWarning)
        raise exc

    return frechet


@pytest.mark.parametrize("exc, words", [
    (ValueError("Imaginary component 3.2"), ["frechet_distance failed: Imaginary component 3.2"]),
    (TypeError("sqrtm() got an unexpected keyword argument 'disp'"),
     ["TypeError: sqrtm() got an unexpected keyword argument 'disp'", "disp=False", "SciPy 1.18 removed",
      "scipy<1.18"]),
])
def test_a_failing_frechet_distance_gives_null_with_what_it_said(exc, words, inception, tmp_path, monkeypatch,
                                                                 capsys):
    import cleanfid.fid

    monkeypatch.setattr(cleanfid.fid, "frechet_distance", _failing_frechet(exc))
    noise_images(tmp_path / "ref", 4, seed=1)
    out = tmp_path / "out"
    rows = eval_folder(out, noise_images(tmp_path / "gen", 3, seed=2))
    with warnings.catch_warnings(record=True) as escaped:
        warnings.simplefilter("always")
        metrics = fid_scorer(tmp_path / "ref", inception).summarize(rows, [], out)
    assert metrics["fid"] is None and metrics["kid"] is not None
    reason = metrics["fid_reason"]
    for word in words:
        assert word in reason, (word, reason)
    assert "clean-fid: fid calculation produces singular product" in reason  # its printed message
    assert "RuntimeWarning: Matrix is singular" in reason  # scipy's warning
    assert "disp" not in reason.replace("disp=False", "").replace("'disp'", "")  # not the deprecation warning
    # nothing of the call reached the console (loading the TorchScript file may warn on its own: not checked here)
    assert not [w for w in escaped if "disp" in str(w.message) or "singular" in str(w.message)]
    assert "singular" not in capsys.readouterr().out


def test_what_a_working_frechet_distance_says_is_in_the_warnings(inception, tmp_path, monkeypatch):
    import cleanfid.fid

    def frechet(mu1, sigma1, mu2, sigma2, eps=1e-6):
        warnings.warn("The `disp` argument is deprecated and will be removed in SciPy 1.18.0.", DeprecationWarning)
        warnings.warn("Matrix is singular and may not have a square root.", RuntimeWarning)
        return 1.5

    monkeypatch.setattr(cleanfid.fid, "frechet_distance", frechet)
    noise_images(tmp_path / "ref", 4, seed=1)
    out = tmp_path / "out"
    rows = eval_folder(out, noise_images(tmp_path / "gen", 3, seed=2))
    with warnings.catch_warnings(record=True) as escaped:
        warnings.simplefilter("always")
        metrics = fid_scorer(tmp_path / "ref", inception).summarize(rows, [], out)
    assert metrics["fid"] == 1.5 and metrics["fid_reason"] is None
    assert not [w for w in escaped if "disp" in str(w.message) or "singular" in str(w.message)]
    assert "RuntimeWarning: Matrix is singular and may not have a square root." in metrics["warnings"]
    assert not [n for n in metrics["warnings"] if "disp" in n]


def test_too_few_images_give_null_with_the_reason(inception, tmp_path, fast_frechet):
    noise_images(tmp_path / "ref", 3, seed=1)
    out = tmp_path / "out"
    rows = eval_folder(out, noise_images(tmp_path / "gen", 1, seed=2))
    metrics = fid_scorer(tmp_path / "ref", inception).summarize(rows, [], out)
    assert metrics["fid"] is None and "FID needs 2 or more images on each side (1 generated, 3 reference)" in \
        metrics["fid_reason"]
    assert metrics["kid"] is None and "KID needs subsets of 2 or more" in metrics["kid_reason"]
    assert not fast_frechet


def test_non_finite_features_give_null_fid_and_kid_naming_the_side(inception, tmp_path, fast_frechet,
                                                                    monkeypatch):
    """A NaN in the features (a corrupt cache): both metrics null with the side and the row count (KID was null
    with no reason, FID's reason a SciPy internal error)."""
    noise_images(tmp_path / "ref", 3, seed=1)
    out = tmp_path / "out"
    rows = eval_folder(out, noise_images(tmp_path / "gen", 3, seed=2))
    scorer = fid_scorer(tmp_path / "ref", inception)
    original = type(scorer)._generated_features

    def poisoned(self, present, out):
        features = original(self, present, out).copy()
        features[1, 5] = np.nan
        return features

    monkeypatch.setattr(type(scorer), "_generated_features", poisoned)
    metrics = scorer.summarize(rows, [], out)
    assert metrics["fid"] is None and metrics["kid"] is None
    assert metrics["fid_reason"] == metrics["kid_reason"]
    assert metrics["kid_reason"].startswith("1 generated feature rows hold NaN or inf")
    assert not fast_frechet  # clean-fid's frechet_distance is not called on them
    from mmrl.eval.runner import _headline

    also = scorer.also_printed
    assert _headline(metrics, "fid", also) == f"fid nan ({metrics['fid_reason']}), kid nan ({metrics['kid_reason']})"
    assert _headline({"fid": 12.5, "kid": 0.01, "fid_reason": None}, "fid", also) == "fid 12.5, kid 0.01"


def test_paths_with_a_tilde_are_the_home_folder_and_one_reference_image_is_too_few(inception, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    noise_images(tmp_path / "ref", 2, seed=1)
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / dist.INCEPTION_FILE).write_bytes(inception.read_bytes())
    settings = dist._fid_settings(EvalOptions(benchmarks=["fid@drawbench"], extra={
        "reference_images": "~/ref", "inception": "~/weights"}))
    assert settings["reference_images"] == str(tmp_path / "ref") and len(settings["reference_files"]) == 2
    assert settings["inception"] == str(tmp_path / "weights" / dist.INCEPTION_FILE)
    noise_images(tmp_path / "one", 1, seed=1)
    with pytest.raises(EvalError, match="reference_images=~/one: one image file in it .*FID and KID need 2 or more"):
        dist._fid_settings(EvalOptions(benchmarks=["fid@drawbench"], extra={
            "reference_images": "~/one", "inception": "~/weights"}))


def test_a_reference_image_cut_short_is_an_error_naming_it(inception, tmp_path, fast_frechet):
    refs = noise_images(tmp_path / "ref", 4, seed=1)
    truncate_file(refs[2], fraction=0.6)  # its header still reads: found when the features are extracted
    out = tmp_path / "out"
    rows = eval_folder(out, noise_images(tmp_path / "gen", 3, seed=2))
    scorer = fid_scorer(tmp_path / "ref", inception)
    with pytest.raises(EvalError, match=f"reference_images: {refs[2]} is not a readable image"):
        scorer.summarize(rows, [], out)


def test_an_inception_file_clean_fid_cannot_load_is_one_line(tmp_path):
    bad = write_garbage(tmp_path / "inc" / dist.INCEPTION_FILE)
    noise_images(tmp_path / "ref", 2, seed=1)
    scorer = fid_scorer(tmp_path / "ref", bad)
    with pytest.raises(EvalError, match="not a TorchScript Inception clean-fid can load") as info:
        scorer.build()
    assert "\n" not in str(info.value)


def test_the_constants_are_clean_fids():
    import cleanfid.downloads_helper
    import cleanfid.fid
    import cleanfid.utils

    assert dist.INCEPTION_URL == cleanfid.downloads_helper.inception_url
    assert set(dist.IMAGE_EXTENSIONS) == cleanfid.utils.EXTENSIONS - {"npy"}
    import inspect

    params = inspect.signature(cleanfid.fid.kernel_distance).parameters
    assert (params["num_subsets"].default, params["max_subset_size"].default) == (dist.KID_SUBSETS,
                                                                                  dist.KID_SUBSET_SIZE)


# ---------------------------------------------------------------------------------------------- diversity


COLOURS = {(255, 0, 0): [1.0, 0.0], (0, 255, 0): [0.0, 1.0], (255, 255, 0): [1.0, 1.0], (0, 0, 255): [-1.0, 0.0],
           (9, 9, 9): [float("nan"), 0.0]}


@pytest.fixture
def fixed_embeddings(monkeypatch):
    """diversity's encoder replaced by fixed embeddings of each solid colour."""
    calls = []

    def encoder(images):
        calls.append(len(images))
        return torch.tensor([COLOURS[im.getpixel((0, 0))] for im in images])

    monkeypatch.setattr(dist, "_make_encoder", lambda source: encoder)
    return calls


def solid(*colours):
    return [Image.new("RGB", (8, 8), c) for c in colours]


def diversity_scorer(name="diversity@partiprompts", **extra):
    options = EvalOptions(benchmarks=[name], extra=extra)
    return dist.make_scorer(dist.benchmark(name, options), options)


def test_diversity_by_hand_on_fixed_embeddings(fixed_embeddings, tmp_path):
    scorer = diversity_scorer()
    c = 1 - 1 / math.sqrt(2)  # cosine distance of [1, 0] or [0, 1] to [1, 1]
    items = [EvalItem(0, "p0", {}, "Animals"), EvalItem(1, "p1", {}, "Animals"), EvalItem(2, "p2", {}, "Food")]
    got = scorer.score(solid((255, 0, 0), (0, 255, 0), (255, 255, 0)), items[0])
    # red-green 1, red-yellow c, green-yellow c: each image's mean distance to the other two
    assert [r["scores"]["diversity"] for r in got] == pytest.approx([(1 + c) / 2, (1 + c) / 2, c])
    assert all(r["verdict"] == {"compared": 3} and r["reason"] is None for r in got)
    got1 = scorer.score(solid((255, 0, 0), (0, 0, 255), (255, 0, 0)), items[1])  # 2, 0, 2 -> (2+0)/2, 2, 1
    assert [r["scores"]["diversity"] for r in got1] == pytest.approx([1, 2, 1])
    got2 = scorer.score(solid((0, 255, 0), (9, 9, 9), (0, 255, 0)), items[2])  # a NaN embedding: left out
    assert [r["scores"]["diversity"] for r in got2] == [0, None, 0]
    assert "non-finite embedding" in got2[1]["reason"] and got2[0]["verdict"] == {"compared": 2}
    rows = [{"prompt_index": i, "image_index": k, "image": f"x/{i}_{k}.png", **r}
            for i, group in enumerate([got, got1, got2]) for k, r in enumerate(group)]
    metrics = scorer.summarize(rows, items, tmp_path)
    p0, p1 = (1 + 2 * c) / 3, (2 + 0 + 2) / 3
    assert metrics["diversity"] == {"mean": pytest.approx((p0 + p1 + 0) / 3), "n": 3, "num_unjudged": 0}
    assert metrics["per_category"]["Animals"]["mean"] == pytest.approx((p0 + p1) / 2)
    assert metrics["per_category"]["Food"]["mean"] == 0
    assert metrics["num_prompts_recomputed"] == 0  # the rows' means, no embedding again
    assert fixed_embeddings == [3, 3, 3]
    # euclidean: red-green sqrt 2, red-yellow 1, green-yellow 1
    euclid = diversity_scorer(diversity_distance="euclidean").score(solid((255, 0, 0), (0, 255, 0), (255, 255, 0)),
                                                                    items[0])
    r2 = math.sqrt(2)
    assert [r["scores"]["diversity"] for r in euclid] == pytest.approx([(r2 + 1) / 2, (r2 + 1) / 2, 1])
    assert diversity_scorer().score(solid((255, 0, 0)), items[0])[0]["scores"]["diversity"] is None


def test_diversity_of_images_scored_in_separate_calls_embeds_them_together(fixed_embeddings, tmp_path):
    scorer = diversity_scorer("diversity@drawbench")
    item = EvalItem(0, "p0")
    colours = [(255, 0, 0), (0, 255, 0), (255, 255, 0), (0, 0, 255)]
    (tmp_path / "images").mkdir()
    for k, image in enumerate(solid(*colours)):
        image.save(tmp_path / "images" / f"00000_{k}.png")
    # images 0, 1 in a first run; 2, 3 when resumed with images_per_prompt=4
    rows = [{"prompt_index": 0, "image_index": k, "image": f"images/00000_{k}.png", **r}
            for k, r in zip(range(4), scorer.score(solid(*colours[:2]), item) + scorer.score(solid(*colours[2:]),
                                                                                              item))]
    metrics = scorer.summarize(rows, [item], tmp_path)
    c = 1 - 1 / math.sqrt(2)
    pairs = [1, c, 2, c, 1, 1 + 1 / math.sqrt(2)]  # rg, ry, rb, gy, gb, yb
    assert metrics["diversity"]["mean"] == pytest.approx(sum(pairs) / 6)
    assert metrics["num_prompts_recomputed"] == 1 and fixed_embeddings == [2, 2, 4]


# ---------------------------------------------------------------------------------------------- run_eval


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    """The tiny CPU recipe on a tiny SD3 built here."""
    return tiny_flow_config(tmp_path_factory.mktemp("dist-model"))


@pytest.fixture(scope="module")
def tiny_dino_dir(tmp_path_factory):
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    directory = tmp_path_factory.mktemp("dino")
    torch.manual_seed(0)
    Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                             image_size=28, patch_size=7)).save_pretrained(directory)
    BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 28, "width": 28}, resample=3,
                      image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]).save_pretrained(directory)
    return directory




def test_end_to_end_fid_and_diversity_on_drawbench(config_file, inception, tiny_dino_dir, tmp_path, forwards,
                                                   fast_frechet, monkeypatch):
    ref = tmp_path / "ref"
    noise_images(ref, 4, seed=5)
    out = tmp_path / "out"
    args = ["checkpoint=base", "benchmarks=[fid@drawbench,diversity@drawbench]", "limit=3", *FAST,
            f"reference_images={ref}", f"inception={inception}", f"diversity_model={tiny_dino_dir}",
            f"output_dir={out}"]
    summary = run_eval(config_file, args, echo=lambda s: None)
    assert json.loads((out / "summary.json").read_text()) == summary
    fid, div = summary["benchmarks"]["fid@drawbench"], summary["benchmarks"]["diversity@drawbench"]
    m = fid["metrics"]
    assert m["fid"] is not None and m["fid"] > 0 and m["kid"] is not None
    assert (m["num_generated"], m["num_reference"], fid["num_images"], fid["num_unjudged"]) == (3, 4, 3, 0)
    assert fid["headline"] == "fid" and div["headline"] == "diversity.mean"
    assert div["metrics"]["diversity"]["n"] == 3 and div["metrics"]["diversity"]["mean"] > 0
    assert div["num_images"] == 12 and div["num_unjudged"] == 0
    p_fid, p_div = fid["protocol"], div["protocol"]
    assert (p_fid["images_per_prompt"], p_div["images_per_prompt"]) == (1, 4)
    assert "mmrl's choice" in p_fid["source"] and "mmrl's choice" in p_div["source"]
    assert p_fid["scorer_settings"]["reference_count"] == 4 and p_fid["pinned_sha256"]
    assert p_div["overridden"]["scorer_settings.diversity_model"]["used"] == str(tiny_dino_dir)
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["scores"] for r in rows if r["benchmark"] == "fid@drawbench"] == [{}, {}, {}]
    div_rows = [r for r in rows if r["benchmark"] == "diversity@drawbench"]
    assert len(div_rows) == 12 and all(r["verdict"] == {"compared": 4} for r in div_rows)
    first = [r["scores"]["diversity"] for r in div_rows[:4]]
    assert div["metrics"]["diversity"]["mean"] == pytest.approx(
        np.mean([np.mean([r["scores"]["diversity"] for r in div_rows[4 * i:4 * i + 4]]) for i in range(3)]))
    assert all(v > 0 for v in first)
    assert forwards["images"] == 4 + 3
    # the same command again: nothing generated, no feature recomputed, the same numbers
    monkeypatch.setattr(mmrl.build, "build_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    again = run_eval(config_file, args, echo=lambda s: None)
    assert forwards["images"] == 4 + 3
    assert again["benchmarks"]["fid@drawbench"]["metrics"] == m
    assert again["benchmarks"]["diversity@drawbench"]["metrics"] == div["metrics"]


@pytest.mark.parametrize("extra, words", [
    (["benchmarks=[fid@drawbench]", "reference_images=nowhere", "inception=INC"],
     ["reference_images=nowhere: no such folder"]),
    (["benchmarks=[fid@drawbench]", "reference_images=EMPTY", "inception=INC"], ["no image files in it"]),
    (["benchmarks=[fid@drawbench]", "reference_images=BAD", "inception=INC"],
     ["is not a readable image", "broken.png"]),
    (["benchmarks=[fid@drawbench]", "reference_images=LINKED", "inception=INC"],
     ["LINKED/gone.png is a broken symbolic link"]),
    (["benchmarks=[fid@drawbench]", "reference_images=REF"], ["fid needs inception=PATH", dist.INCEPTION_URL]),
    (["benchmarks=[fid@drawbench]", "reference_images=REF", "inception=missing/inception-2015-12-05.pt"],
     ["inception=missing/inception-2015-12-05.pt: no inception-2015-12-05.pt there", dist.INCEPTION_URL,
      "does not download"]),
    (["benchmarks=[fid@drawbench]", "inception=INC"], ["fid needs reference_images=DIR"]),
    (["benchmarks=[fid@drawbench]", "reference_images=REF", "inception=INC", "fid_mode=legacy_pytorch"],
     ["legacy_pytorch", "use clean or legacy_tensorflow"]),
    (["benchmarks=[fid@drawbench]", "reference_images=REF", "inception=INC", "kid_subset_size=1"],
     ["kid_subset_size=1: expected an integer >= 2"]),
    (["benchmarks=[fid@coco]", "reference_images=REF", "inception=INC"], ["unknown prompt set 'coco'"]),
    (["benchmarks=[fid]", "reference_images=REF", "inception=INC"], ["needs prompts", "prompts=FILE"]),
    (["benchmarks=[diversity@drawbench]", "images_per_prompt=1"], ["needs 2 or more"]),
    (["benchmarks=[diversity@drawbench]", "diversity_distance=manhattan"], ["expected one of cosine, euclidean"]),
    (["benchmarks=[diversity@drawbench]", "diversity_model=./nowhere"], ["diversity_model=./nowhere: no such folder"]),
    (["benchmarks=[diversity@drawbench]", "reference_images=REF"], ["reference_images= is for the fid benchmark"]),
])
def test_bad_input_is_one_line_before_any_model_loads(extra, words, config_file, inception, capsys, tmp_path,
                                                      monkeypatch):
    monkeypatch.setattr(mmrl.build, "build_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    work = tmp_path / "work"
    work.mkdir()
    (work / "EMPTY").mkdir()
    (work / "EMPTY" / "notes.txt").write_text("not an image")
    noise_images(work / "REF", 2, seed=1)
    noise_images(work / "BAD", 2, seed=1)
    write_garbage(work / "BAD" / "broken.png")
    noise_images(work / "LINKED", 2, seed=1)
    os.symlink(work / "missing.png", work / "LINKED" / "gone.png")
    monkeypatch.chdir(work)
    extra = [e.replace("=INC", f"={inception}") for e in extra]
    assert main(["eval", str(config_file), "checkpoint=base", *extra, f"output_dir={tmp_path / 'out'}"]) == 2
    one_error(capsys, *words)
    assert not (tmp_path / "out").exists()
