"""Distribution benchmarks of ``mmrl eval``: FID / KID against a folder of reference images, and per-prompt diversity.

Reward hacking shows up here first: a policy that collapses onto what its reward likes drifts away from a reference
distribution (FID / KID rise) and makes the images of one prompt alike (diversity falls).

Benchmarks (``SET``: one of :data:`mmrl.eval.runner.REWARD_SETS`; without ``@SET`` the user's ``prompts=FILE``):

* ``fid@SET`` / ``fid``: FID and KID of all the benchmark's images against ``reference_images=DIR``, with the
  conventions and the code of clean-fid (GaParmar/clean-fid 0.1.35; Parmar et al., "On Aliased Resizing and
  Surprising Subtleties in GAN Evaluation", CVPR 2022):

  - reference files: what clean-fid's ``get_folder_features`` takes from a folder (extensions
    :data:`IMAGE_EXTENSIONS`, searched recursively, sorted; clean-fid's ``.npy`` arrays are left out), counted and
    checked (each file's header) before any model loads; a broken symbolic link among them is an error naming it
    (clean-fid would crash on it; leaving it out would silently shrink the set);
  - images: read as clean-fid's ``ResizeDataset`` reads a file (PIL ``convert("RGB")`` -> uint8), resized by
    ``cleanfid.resize.build_resizer(mode)`` (``clean``: ``make_resizer("PIL", False, "bicubic", (299, 299))``,
    PIL bicubic per channel in float32, no quantisation), features from clean-fid's
    ``cleanfid.inception_torchscript.InceptionV3W`` wrapper of the TorchScript Inception (``(x - 128) / 128``, the
    2048-d pool features) loaded from ``inception=PATH`` (``download=False``: nothing is downloaded), extracted by
    ``cleanfid.fid.get_files_features``. The generated images are the saved PNGs (the same bytes the policy made);
  - statistics: the features in float64 (clean-fid keeps the model's float32; the difference is rounding),
    ``np.mean`` and ``np.cov(rowvar=False)``; ``fid = cleanfid.fid.frechet_distance(mu_gen, sigma_gen, mu_ref,
    sigma_ref)``; ``kid = cleanfid.fid.kernel_distance(ref_feats, gen_feats, kid_subsets, kid_subset_size)``
    (clean-fid's cubic polynomial kernel ``(x.y / 2048 + 1) ** 3``, the unbiased MMD^2 on ``kid_subsets`` random
    subsets of ``min(#generated, #reference, kid_subset_size)`` images each, averaged; the raw value, not x1000).
    clean-fid draws the subsets from NumPy's global RNG unseeded; here it is seeded with :data:`KID_SEED` (and
    restored afterwards) so the same images give the same KID;
  - modes (``fid_mode=``): ``clean`` (default, clean-fid's recommended mode) and ``legacy_tensorflow`` (the
    TorchScript network resizes inside, as TensorFlow's FID code did). ``legacy_pytorch`` is refused: it runs
    pytorch-fid's other Inception weights, which clean-fid downloads from GitHub at run time;
  - minimum counts: FID needs 2 images on each side and KID a subset of 2 (else ``null`` with the reason). With
    fewer images than the 2048 feature dimensions the covariance is rank-deficient: clean-fid computes FID anyway
    (it is biased upward and comparable only between evaluations with the same counts); ``warnings`` in the
    metrics says so with the counts, and when the KID subsets are smaller than ``kid_subset_size``. When clean-fid's
    ``frechet_distance`` fails (``ValueError``: "Imaginary component ..."; ``TypeError``: a SciPy without
    ``sqrtm``'s ``disp`` argument, removed in SciPy 1.18, which clean-fid 0.1.35 passes), ``fid`` is ``null`` and
    ``fid_reason`` holds the error with what clean-fid printed and the warnings raised during the call. SciPy's
    deprecation warning about ``disp`` (1.16, 1.17) is silenced inside that call.

  Caches (nothing is recomputed on a resumed or repeated evaluation): the reference features in
  ``<eval folder>/fid_reference/<key>.npz``, keyed by the reference folder's content (sha256 over every file's
  relative path and sha256), the mode, the Inception file's sha256 and the versions of the packages that make the
  features (clean-fid, Pillow, torch: :func:`feature_packages`; a cache made under other versions is computed
  again). When the eval folder is ``RUN/eval/<checkpoint>`` (its parent is named ``eval``), a sibling eval folder's
  cache (another checkpoint's ``RUN/eval/<checkpoint>/fid_reference/``) is reused in place; other output folders
  (``output_dir=/tmp/x``) use their own cache only. The generated images' features in
  ``<eval folder>/fid_features/<benchmark>-<mode>-<inception sha>-<packages>.npz``, keyed by each PNG's sha256
  (and the same versions). ``score()`` gives every image empty scores: FID is a property of the whole set,
  computed in ``summarize``.

  A reference image that cannot be decoded is an error naming the file (never skipped: a silently smaller reference
  set would change the number): files whose header is not an image are found before any model loads, a file that
  fails later (cut short) when the features are extracted.

* ``diversity@SET`` / ``diversity``: per prompt, the mean pairwise distance of its images' embeddings
  (``diversity_distance=cosine``: ``1 - cos``, or ``euclidean``), mean over prompts, and per category where the set
  has them (GenEval tags, PartiPrompts categories). Embeddings and distances are mmrl's set-diversity reward's
  (:class:`mmrl.rewards.diversity.SetDiversity`, ``set_score="mean_pairwise"``): ``diversity_model=`` a DINOv2
  checkpoint (default ``facebook/dinov2-base``, the reward's default: :class:`~mmrl.rewards.reference.DinoEmbedder`,
  the CLS embedding) or a CLIP one (:func:`~mmrl.rewards.clipscore.clip_image_embeddings`, the L2-normalised
  projected image embedding). Each image's score is its mean distance to the other images of its prompt
  (``SetDiversity``'s ``mean_distance``); a prompt's diversity is the mean of its images' scores (which equals the
  mean pairwise distance). When a prompt's images were scored in separate calls (an evaluation resumed with more
  ``images_per_prompt``), ``summarize`` embeds the prompt's saved PNGs again and uses all of them.

Official scorer: for FID / KID, clean-fid's own functions in its ``clean`` mode with the Inception TorchScript file
clean-fid uses; ``legacy_tensorflow`` is clean-fid's named reproduction of the TensorFlow FID. No prompt set here
has an official reference image set, so an FID is comparable only between evaluations against the same reference
folder (its content sha256 is in the protocol). Diversity has no official benchmark (Flow-GRPO and DanceGRPO define
none): mmrl's measure, with DINOv2 as the default embedding (mmrl's choice, as the ``set_diversity`` reward) and
CLIP a named alternative.

Protocol defaults (:func:`defaults`): ``fid``: 1 image per prompt (mmrl's choice, the zero-shot COCO FID-30K
convention of Imagen and Parti: one image per caption), ``diversity``: 4 images per prompt (mmrl's choice: 6 pairs
per prompt); both with Flow-GRPO's SD3.5-M evaluation settings (512 px, 40 steps, CFG 4.5, seed 42).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import re
import warnings
from glob import glob
from pathlib import Path
from typing import Any

from mmrl.eval.protocol import Defaults, _FLOW_GRPO_EVAL, file_sha256
from mmrl.eval.runner import (REWARD_SETS, BenchmarkSpec, EvalError, EvalItem, EvalOptions, Scorer, _float,
                              _jsonable, _mmrl_version, _version, load_prompt_set)

__all__ = ["EVAL_KEYS", "benchmark", "load_items", "defaults", "make_scorer", "main_keys", "FIDScorer",
           "DiversityScorer", "reference_files", "feature_packages", "IMAGE_EXTENSIONS", "INCEPTION_FILE",
           "INCEPTION_URL"]

#: The Inception TorchScript file clean-fid loads (``cleanfid.inception_torchscript.InceptionV3W``) and where
#: clean-fid downloads it (``cleanfid.downloads_helper.inception_url``); mmrl never downloads it.
INCEPTION_FILE = "inception-2015-12-05.pt"
INCEPTION_URL = "https://nvlabs-fi-cdn.nvidia.com/stylegan2-ada-pytorch/pretrained/metrics/inception-2015-12-05.pt"
#: clean-fid's image extensions (``cleanfid.utils.EXTENSIONS`` without its ``npy`` arrays).
IMAGE_EXTENSIONS = ("bmp", "jpg", "jpeg", "pgm", "png", "ppm", "tif", "tiff", "webp", "JPEG", "JPG", "PNG")
#: clean-fid's defaults (``cleanfid.fid.kernel_distance``: ``num_subsets=100, max_subset_size=1000``).
KID_SUBSETS = 100
KID_SUBSET_SIZE = 1000
#: NumPy's global seed while ``kernel_distance`` draws its subsets (clean-fid leaves it unseeded): mmrl's choice.
KID_SEED = 0
FEATURE_DIM = 2048
MODES = ("clean", "legacy_tensorflow")
DISTANCES = ("cosine", "euclidean")
_BATCH_SIZE = 32  # clean-fid's compute_fid default; features do not depend on it beyond float rounding
#: the packages whose versions key the feature caches (clean-fid's code, PIL's decoding and resize, torch's network)
_FEATURE_PACKAGES = ("clean-fid", "Pillow", "torch")
#: SciPy 1.16-1.17's warning for ``sqrtm(disp=...)``, which clean-fid 0.1.35's ``frechet_distance`` passes
_SQRTM_DISP_WARNING = r"The `disp` argument is deprecated"

EVAL_KEYS: dict[str, str] = {
    "reference_images": "fid: folder of reference images (png, jpg, ...; searched recursively, as clean-fid does); "
                        "required",
    "inception": f"fid: clean-fid's Inception TorchScript file {INCEPTION_FILE} (or its folder); required, never "
                 f"downloaded (clean-fid fetches it from {INCEPTION_URL})",
    "fid_mode": "fid: clean-fid mode, clean (default) or legacy_tensorflow",
    "kid_subsets": f"fid: KID subsets (default {KID_SUBSETS}, clean-fid's)",
    "kid_subset_size": f"fid: KID subset size (default {KID_SUBSET_SIZE}, clean-fid's; the subsets hold "
                       f"min(this, #generated, #reference) images)",
    "diversity_model": "diversity: DINOv2 or CLIP hub id / folder (default facebook/dinov2-base)",
    "diversity_distance": "diversity: cosine (1 - cos, default) or euclidean",
}
_FID_KEYS = ("reference_images", "inception", "fid_mode", "kid_subsets", "kid_subset_size")
_DIVERSITY_KEYS = ("diversity_model", "diversity_distance")

_SOURCE_FID = ("FID/KID over a prompt set: no official protocol for these prompt sets; mmrl's choice: 1 image per "
               "prompt (the zero-shot COCO FID-30K convention of Imagen and Parti: one image per caption) with "
               + _FLOW_GRPO_EVAL + "; FID/KID: clean-fid 0.1.35 (GaParmar/clean-fid, Parmar et al. CVPR 2022)")
_SOURCE_DIVERSITY = ("per-prompt diversity: no official protocol (Flow-GRPO and DanceGRPO define no diversity "
                     "metric); mmrl's choice: 4 images per prompt (6 pairs) with " + _FLOW_GRPO_EVAL)


# --------------------------------------------------------------------------------------------------- plug-in


def _parse_name(name: str) -> tuple[str, str]:
    match = re.fullmatch(r"(fid|diversity)(?:@(.*))?", name)
    if match is None:
        head = re.split(r"[@:]", name, maxsplit=1)[0]
        raise EvalError(f"benchmark {name!r}: expected {head}@SET (SET: {', '.join(REWARD_SETS)}) or {head} with "
                        f"prompts=FILE")
    kind, prompt_set = match.group(1), match.group(2)
    if prompt_set is not None and prompt_set not in REWARD_SETS:
        raise EvalError(f"benchmark {name!r}: unknown prompt set {prompt_set!r}; shipped sets: "
                        f"{', '.join(REWARD_SETS)} (or leave out @SET and give prompts=FILE)")
    return kind, prompt_set or "file"


def _requested(options: EvalOptions, kind: str) -> bool:
    return any(re.split(r"[@:]", b, maxsplit=1)[0] == kind for b in options.benchmarks)


def _int_key(options: EvalOptions, key: str, default: int, low: int) -> int:
    value = options.extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise EvalError(f"{key}={value!r}: expected an integer >= {low}")
    return value


def _str_key(options: EvalOptions, key: str, default: str | None) -> str | None:
    value = options.extra.get(key, default)
    if value is None:
        return None
    if isinstance(value, (dict, list, bool)) or str(value).strip() == "":
        raise EvalError(f"{key}={value!r}: expected a path or name")
    return str(value)


def benchmark(name: str, options: EvalOptions) -> BenchmarkSpec:
    """Check ``fid[@SET]`` / ``diversity[@SET]`` and every file and value it needs (the reference folder counted and
    its files' headers read, the Inception file found), building no model."""
    import importlib.util

    kind, prompt_set = _parse_name(name)
    if prompt_set == "file" and options.prompts is None:
        raise EvalError(f"benchmark {name!r} needs prompts: a shipped set ({kind}@drawbench, @partiprompts, "
                        f"@geneval, @ocr) or prompts=FILE")
    for keys, other in ((_FID_KEYS, "fid"), (_DIVERSITY_KEYS, "diversity")):
        stray = [k for k in keys if k in options.extra]
        if stray and not _requested(options, other):
            raise EvalError(f"{stray[0]}= is for the {other} benchmark, which is not requested "
                            f"(benchmarks: {', '.join(options.benchmarks)})")
    if kind == "fid":
        if importlib.util.find_spec("cleanfid") is None:
            raise EvalError(f"benchmark {name!r} needs clean-fid: pip install 'clean-fid>=0.1.35,<0.2'")
        _fid_settings(options)  # every check
    else:
        if options.images_per_prompt is not None and options.images_per_prompt < 2:
            raise EvalError(f"benchmark {name!r}: images_per_prompt={options.images_per_prompt}: diversity compares "
                            f"the images of a prompt, it needs 2 or more")
        _diversity_settings(options)
    return BenchmarkSpec(name, kind, prompt_set)


def load_items(spec: BenchmarkSpec, options: EvalOptions) -> tuple[list[EvalItem], Path, str | None]:
    """The prompt set's items (:func:`mmrl.eval.runner.load_prompt_set`: shipped files checked against their pinned
    sha256)."""
    return load_prompt_set(spec.prompt_set, options.prompts)


def defaults(spec: BenchmarkSpec) -> Defaults:
    if spec.kind == "fid":
        return Defaults(1, 42, 512, 40, 4.5, _SOURCE_FID)
    return Defaults(4, 42, 512, 40, 4.5, _SOURCE_DIVERSITY)


def make_scorer(spec: BenchmarkSpec, options: EvalOptions) -> Scorer:
    if spec.kind == "fid":
        return FIDScorer(spec, _fid_settings(options))
    return DiversityScorer(spec, _diversity_settings(options))


def main_keys(spec: BenchmarkSpec) -> list[str]:
    return [] if spec.kind == "fid" else ["diversity"]


# --------------------------------------------------------------------------------------------------- files


_LISTINGS: dict[tuple, tuple[list[Path], str]] = {}
_CHECKED: set[tuple] = set()


def reference_files(folder: str | os.PathLike) -> list[Path]:
    """The images clean-fid's ``get_folder_features`` takes from ``folder`` (:data:`IMAGE_EXTENSIONS`, recursive,
    sorted). Folders whose names end in an image extension are not files and are left out; a broken symbolic link
    is an :class:`~mmrl.eval.runner.EvalError` naming it (clean-fid would crash on it, and leaving it out would
    silently change the reference set)."""
    found = {f for ext in IMAGE_EXTENSIONS for f in glob(os.path.join(os.fspath(folder), f"**/*.{ext}"),
                                                         recursive=True)}
    out = []
    for f in sorted(found):
        if os.path.islink(f) and not os.path.exists(f):
            try:
                target = os.readlink(f)
            except OSError:
                target = "?"
            raise EvalError(f"reference_images: {f} is a broken symbolic link (to {target}): fix or remove it")
        if os.path.isfile(f):
            out.append(Path(f))
    return out


def feature_packages() -> dict[str, str]:
    """The installed versions of the packages the FID features depend on (clean-fid, Pillow, torch): part of the
    feature caches' keys."""
    return {name: _version(name) for name in _FEATURE_PACKAGES}


def _packages_tag(packages: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(packages, sort_keys=True).encode()).hexdigest()[:8]


def _folder_digest(folder: Path, files: list[Path]) -> str:
    """sha256 over every file's relative path and content sha256 (memoised on the files' sizes and mtimes)."""
    stats = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    key = (str(folder.resolve()), stats)
    if key in _LISTINGS:
        return _LISTINGS[key][1]
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.relative_to(folder).as_posix()}\0{file_sha256(f)}\n".encode())
    _LISTINGS[key] = (files, digest.hexdigest())
    return digest.hexdigest()


def _check_reference(value: str) -> tuple[Path, list[Path]]:
    from PIL import Image

    folder = Path(value).expanduser()
    if not folder.exists():
        raise EvalError(f"reference_images={value}: no such folder (relative paths resolve from the working "
                        f"directory)")
    if not folder.is_dir():
        raise EvalError(f"reference_images={value}: not a folder (give the folder that holds the reference images)")
    files = reference_files(folder)
    if len(files) < 2:
        raise EvalError(f"reference_images={value}: {'one image file' if files else 'no image files'} in it "
                        f"({', '.join(IMAGE_EXTENSIONS[:5])}, ...; searched recursively): FID and KID need 2 or more "
                        f"reference images")
    key = (str(folder.resolve()), tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if key not in _CHECKED:  # benchmark() and make_scorer() both check: read the headers once
        for f in files:
            try:
                with Image.open(f) as image:
                    image.size  # noqa: B018 - the header is read
            except Exception as exc:
                raise EvalError(f"reference_images: {f} is not a readable image ({type(exc).__name__}: {exc}): "
                                f"remove or replace it") from None
        _CHECKED.add(key)
    return folder, files


def _check_inception(value: str | None) -> Path:
    fetch = f"clean-fid downloads it from {INCEPTION_URL}; mmrl does not download at run time"
    if value is None:
        raise EvalError(f"fid needs inception=PATH: clean-fid's Inception TorchScript file {INCEPTION_FILE} ({fetch})")
    path = Path(value).expanduser()
    if path.is_dir():
        path = path / INCEPTION_FILE
    if not path.is_file():
        raise EvalError(f"inception={value}: no {INCEPTION_FILE} there ({fetch}: fetch it once and give its path)")
    if path.name != INCEPTION_FILE:
        raise EvalError(f"inception={value}: clean-fid loads the file named {INCEPTION_FILE} from its folder: "
                        f"rename the file or link it under that name")
    return path


def _fid_settings(options: EvalOptions) -> dict[str, Any]:
    reference = _str_key(options, "reference_images", None)
    if reference is None:
        raise EvalError("fid needs reference_images=DIR: a folder of reference images (png, jpg, ...) to compare the "
                        "generated images with")
    folder, files = _check_reference(reference)
    inception = _check_inception(_str_key(options, "inception", None))
    mode = _str_key(options, "fid_mode", "clean")
    if mode == "legacy_pytorch":
        raise EvalError("fid_mode=legacy_pytorch runs pytorch-fid's Inception weights, which clean-fid downloads from "
                        "GitHub at run time; mmrl runs the TorchScript Inception only: use clean or legacy_tensorflow")
    if mode not in MODES:
        raise EvalError(f"fid_mode={mode!r}: expected one of {', '.join(MODES)} (clean-fid's modes)")
    subsets = _int_key(options, "kid_subsets", KID_SUBSETS, 1)
    size = _int_key(options, "kid_subset_size", KID_SUBSET_SIZE, 2)
    return {"reference_images": str(folder), "reference_files": files, "inception": str(inception),
            "fid_mode": mode, "kid_subsets": subsets, "kid_subset_size": size}


def _diversity_settings(options: EvalOptions) -> dict[str, Any]:
    from mmrl.rewards.reference import DEFAULT_DINO

    model = _str_key(options, "diversity_model", DEFAULT_DINO)
    distance = _str_key(options, "diversity_distance", "cosine")
    if distance not in DISTANCES:
        raise EvalError(f"diversity_distance={distance!r}: expected one of {', '.join(DISTANCES)}")
    path = Path(model).expanduser()
    if path.is_dir():
        model = str(path)
        _model_type(model)
    elif path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise EvalError(f"diversity_model={model}: no such folder (a DINOv2 or CLIP checkpoint folder or hub id)")
    return {"diversity_model": model, "diversity_distance": distance}


def _model_type(source: str) -> str:
    """``model_type`` of a checkpoint's ``config.json`` (a folder, or a hub id in the local cache)."""
    config_file = Path(source) / "config.json"
    try:
        if config_file.is_file():
            model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
        elif Path(source).is_dir():
            raise EvalError(f"diversity_model={source}: no config.json in the folder (a DINOv2 or CLIP checkpoint)")
        else:
            from transformers import AutoConfig

            model_type = AutoConfig.from_pretrained(source).model_type
    except (OSError, ValueError) as exc:
        if isinstance(exc, EvalError):
            raise
        raise EvalError(f"diversity_model={source}: cannot read its config.json ({type(exc).__name__}: {exc}); "
                        f"give a local DINOv2 or CLIP folder") from None
    if model_type not in ("dinov2", "clip"):
        raise EvalError(f"diversity_model={source}: a {model_type!r} checkpoint; expected DINOv2 (dinov2) or CLIP "
                        f"(clip)")
    return model_type


def _save_npz(path: Path, **arrays) -> None:
    """Atomically (a temporary file renamed into place)."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as handle:
        np.savez(handle, **arrays)
    os.replace(tmp, path)


def _load_npz(path: Path, meta: dict) -> dict | None:
    """The arrays of a cache file written with ``meta``; None if absent, unreadable or of another key."""
    import numpy as np

    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            if json.loads(str(data["meta"])) != meta:
                return None
            return {k: data[k] for k in data.files}
    except Exception:  # a cut or foreign file: recomputed
        return None


# --------------------------------------------------------------------------------------------------- FID / KID


class FIDScorer(Scorer):
    """FID and KID of a benchmark's images against a reference folder with clean-fid's code (see the module
    docstring). Official: clean-fid's ``clean`` mode with its TorchScript Inception; ``legacy_tensorflow`` is
    clean-fid's reproduction of the TensorFlow FID."""

    name = "fid_kid"
    headline = "fid"
    also_printed = ("kid",)  # clean-fid's pair
    sample_score = ""  # no per-image score: FID / KID are properties of the whole set

    def __init__(self, spec: BenchmarkSpec, settings: dict):
        import torch

        self.spec = spec
        self.files: list[Path] = settings["reference_files"]
        self.folder = Path(settings["reference_images"])
        self.mode = settings["fid_mode"]
        self.kid_subsets = settings["kid_subsets"]
        self.kid_subset_size = settings["kid_subset_size"]
        self.inception = Path(settings["inception"])
        self.inception_sha256 = file_sha256(self.inception)
        self.reference_sha256 = _folder_digest(self.folder, self.files)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = None
        self.version = (f"clean-fid {_version('clean-fid')}, scipy {_version('scipy')}, numpy {_version('numpy')}, "
                        f"torch {_version('torch')}, mmrl {_mmrl_version()}")
        self.defaults = {"fid_mode": "clean", "kid_subsets": KID_SUBSETS, "kid_subset_size": KID_SUBSET_SIZE}
        resize = ("cleanfid.resize.build_resizer('clean'): make_resizer('PIL', False, 'bicubic', (299, 299))"
                  if self.mode == "clean" else
                  "inside the network (cleanfid InceptionV3W(resize_inside=True): the TorchScript model's own resize)")
        self.settings = {
            "official": "clean-fid's FID and KID (GaParmar/clean-fid, Parmar et al. CVPR 2022), mode clean with its "
                        "TorchScript Inception; legacy_tensorflow: clean-fid's reproduction of the TensorFlow FID",
            "reference_images": str(self.folder), "reference_sha256": self.reference_sha256,
            "reference_count": len(self.files),
            "reference_rule": "clean-fid get_folder_features: extensions " + ",".join(IMAGE_EXTENSIONS)
                              + " (not npy), recursive, sorted; an unreadable file is an error",
            "inception": str(self.inception), "inception_sha256": self.inception_sha256,
            "fid_mode": self.mode, "resize": resize,
            "features": "cleanfid.fid.get_files_features with cleanfid.inception_torchscript.InceptionV3W "
                        "((x - 128) / 128, 2048-d pool features); generated images: their saved PNGs",
            "statistics": "features as float64; np.mean, np.cov(rowvar=False)",
            "fid": "cleanfid.fid.frechet_distance(mu_gen, sigma_gen, mu_ref, sigma_ref)",
            "kid": "cleanfid.fid.kernel_distance(ref_feats, gen_feats, kid_subsets, kid_subset_size): cubic "
                   "polynomial kernel, unbiased MMD^2 per subset of min(#gen, #ref, kid_subset_size), mean; raw value",
            "kid_subsets": self.kid_subsets, "kid_subset_size": self.kid_subset_size,
            "kid_seed": KID_SEED,
        }

    # ---- models and features

    def build(self) -> None:
        if self.model is not None:
            return
        from cleanfid.inception_torchscript import InceptionV3W

        try:
            model = InceptionV3W(str(self.inception.parent), download=False,
                                 resize_inside=self.mode == "legacy_tensorflow")
        except Exception as exc:
            raise EvalError(f"inception={self.inception}: not a TorchScript Inception clean-fid can load "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); clean-fid's "
                            f"file is {INCEPTION_URL}") from None
        self.model = model.to(self.device).eval()

    def _features(self, files: list[Path], what: str):
        """clean-fid's features ``[len(files), 2048]`` (float32) of image files; a file that cannot be read is an
        error naming it."""
        import numpy as np
        from cleanfid.fid import get_files_features
        from PIL import Image

        if not files:
            return np.zeros((0, FEATURE_DIM), np.float32)
        self.build()
        groups: dict[Any, list[int]] = {None: list(range(len(files)))}
        if self.mode == "legacy_tensorflow":  # not resized before the network: batch images of one size together
            groups = {}
            for i, f in enumerate(files):
                with Image.open(f) as image:
                    groups.setdefault(image.size, []).append(i)
        out = np.zeros((len(files), FEATURE_DIM), np.float32)
        workers = 0 if len(files) < 512 else min(8, os.cpu_count() or 1)
        for index in groups.values():
            part = [str(files[i]) for i in index]
            try:
                feats = get_files_features(part, model=self.model, num_workers=workers, batch_size=_BATCH_SIZE,
                                           device=self.device, mode=self.mode, verbose=False)
            except Exception as exc:
                for f in part:  # which file
                    try:
                        with Image.open(f) as image:
                            image.convert("RGB")
                    except Exception as bad:
                        raise EvalError(f"{what}: {f} is not a readable image ({type(bad).__name__}: {bad}): remove "
                                        f"or replace it, then run the same command again (generated images are "
                                        f"kept)") from None
                raise exc
            feats = np.asarray(feats, dtype=np.float32).reshape(len(part), -1)
            if feats.shape[1] != FEATURE_DIM:
                raise EvalError(f"inception={self.inception}: gave {feats.shape[1]}-d features, expected {FEATURE_DIM}")
            out[index] = feats
        return out

    def _reference_features(self, out: Path) -> tuple[Any, str]:
        """The reference folder's features: from a cache in ``out`` or a sibling eval folder, else computed once
        and cached in ``out/fid_reference/``. Returns ``(features, cache file)``."""
        packages = feature_packages()
        meta = {"reference_sha256": self.reference_sha256, "fid_mode": self.mode,
                "inception_sha256": self.inception_sha256, "count": len(self.files), "packages": packages}
        name = (f"{self.reference_sha256[:16]}-{self.mode}-{self.inception_sha256[:12]}-"
                f"{_packages_tag(packages)}.npz")
        own = out / "fid_reference" / name
        candidates = [own]
        if out.parent.name == "eval":  # RUN/eval/<checkpoint>: the run's other evaluations; never a whole /tmp
            candidates += [c for c in sorted(out.parent.glob(f"*/fid_reference/{name}")) if c != own]
        for candidate in candidates:
            data = _load_npz(candidate, meta)
            if data is not None and data["feats"].shape == (len(self.files), FEATURE_DIM):
                return data["feats"], str(candidate)
        feats = self._features(self.files, "reference_images")
        import numpy as np

        _save_npz(own, meta=np.array(json.dumps(meta)), feats=feats)
        return feats, str(own)

    def _generated_features(self, paths: list[Path], out: Path):
        """The generated PNGs' features, cached per file sha256 in ``out/fid_features/``."""
        import numpy as np

        packages = feature_packages()
        meta = {"fid_mode": self.mode, "inception_sha256": self.inception_sha256, "packages": packages}
        cache = out / "fid_features" / (f"{self.spec.folder}-{self.mode}-{self.inception_sha256[:12]}-"
                                        f"{_packages_tag(packages)}.npz")
        known: dict[str, Any] = {}
        data = _load_npz(cache, meta)
        if data is not None:
            known = {str(s): f for s, f in zip(data["sha256"], data["feats"])}
        shas = [file_sha256(p) for p in paths]
        todo = sorted({s: p for s, p in zip(shas, paths) if s not in known}.items())
        if todo:
            feats = self._features([p for _, p in todo], f"generated image of {self.spec.name}")
            known.update({s: f for (s, _), f in zip(todo, feats)})
            keys = sorted(known)
            _save_npz(cache, meta=np.array(json.dumps(meta)), sha256=np.array(keys),
                      feats=np.stack([known[k] for k in keys]).astype(np.float32))
        if not paths:
            return np.zeros((0, FEATURE_DIM), np.float32)
        return np.stack([known[s] for s in shas])

    # ---- scoring

    def score(self, images: list, item: EvalItem) -> list[dict]:
        return [{"scores": {}, "verdict": None, "reason": None} for _ in images]

    def summarize(self, rows: list[dict], items: list[EvalItem], out: Path) -> dict:
        import numpy as np
        from cleanfid.fid import frechet_distance, kernel_distance

        out = Path(out)
        paths = [out / r["image"] for r in rows]
        present = [p for p in paths if p.is_file()]
        gen = self._generated_features(present, out).astype(np.float64)
        ref_feats, cache = self._reference_features(out)
        ref = ref_feats.astype(np.float64)
        n_gen, n_ref = len(gen), len(ref)
        notes: list[str] = []
        if len(present) < len(paths):
            notes.append(f"{len(paths) - len(present)} generated image file(s) missing (removed by hand?): left out")
        for n, side in ((n_gen, "generated"), (n_ref, "reference")):
            if 2 <= n < FEATURE_DIM:
                notes.append(f"FID from {n} {side} images, fewer than the {FEATURE_DIM} feature dimensions: the "
                             f"covariance is rank-deficient, so FID is biased upward and comparable only at the same "
                             f"counts (clean-fid computes it anyway; published FIDs use 10k-50k images)")
        fid = kid = None
        fid_reason = kid_reason = None
        bad_rows = {side: int((~np.isfinite(features)).any(axis=1).sum())
                    for side, features in (("generated", gen), ("reference", ref))}
        broken = [f"{count} {side} feature rows hold NaN or inf" for side, count in bad_rows.items() if count]
        if broken:  # a corrupt cache or a network gone wrong: neither metric means anything
            fid_reason = kid_reason = (f"{' and '.join(broken)} (a corrupt feature cache? delete it and rerun)")
        elif n_gen < 2 or n_ref < 2:
            fid_reason = f"FID needs 2 or more images on each side ({n_gen} generated, {n_ref} reference)"
        else:
            printed = io.StringIO()
            failure = None
            with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(printed):
                warnings.simplefilter("always")
                # scipy 1.16-1.17 deprecate sqrtm's disp argument, which clean-fid passes: not the user's concern
                warnings.filterwarnings("ignore", message=_SQRTM_DISP_WARNING, category=DeprecationWarning)
                try:
                    fid = _float(frechet_distance(gen.mean(0), np.cov(gen, rowvar=False), ref.mean(0),
                                                  np.cov(ref, rowvar=False)))
                except ValueError as exc:  # clean-fid: "Imaginary component ..."
                    failure = f"clean-fid's frechet_distance failed: {exc}"
                except TypeError as exc:  # scipy >= 1.18: sqrtm() has no disp argument any more
                    failure = (f"clean-fid's frechet_distance failed: TypeError: {exc} (clean-fid "
                               f"{_version('clean-fid')} calls scipy.linalg.sqrtm(..., disp=False), an argument "
                               f"SciPy 1.18 removed; installed: scipy {_version('scipy')}: install 'scipy<1.18')")
            said = [f"clean-fid: {line.strip()}" for line in printed.getvalue().splitlines() if line.strip()]
            said += sorted({f"{w.category.__name__}: {w.message}" for w in caught
                            if not issubclass(w.category, (DeprecationWarning, FutureWarning))})
            if failure is None:
                notes += said
            else:
                fid = None
                fid_reason = failure + (f" (during the call: {'; '.join(said)})" if said else "")
        m = min(n_gen, n_ref, self.kid_subset_size)
        if broken:
            pass
        elif m < 2:
            kid_reason = f"KID needs subsets of 2 or more images ({n_gen} generated, {n_ref} reference)"
        else:
            if m < self.kid_subset_size:
                notes.append(f"KID subsets of {m} images, fewer than kid_subset_size={self.kid_subset_size} "
                             f"(clean-fid's rule: min(#generated, #reference, kid_subset_size))")
            state = np.random.get_state()
            np.random.seed(KID_SEED)
            try:
                kid = _float(kernel_distance(ref, gen, num_subsets=self.kid_subsets, max_subset_size=m))
            finally:
                np.random.set_state(state)
            if kid is None:
                kid_reason = "clean-fid's kernel_distance gave a value that is not a finite number"
        try:
            cache = str(Path(cache).relative_to(out))
        except ValueError:
            pass
        return _jsonable({
            "fid": fid, "kid": kid, "fid_reason": fid_reason, "kid_reason": kid_reason,
            "num_generated": n_gen, "num_reference": n_ref, "feature_dim": FEATURE_DIM, "fid_mode": self.mode,
            "kid_subsets": self.kid_subsets, "kid_subset_size_used": m if m >= 2 else None,
            "reference_images": str(self.folder), "reference_sha256": self.reference_sha256,
            "reference_cache": cache, "warnings": notes})


# --------------------------------------------------------------------------------------------------- diversity


class _ClipImageEncoder:
    """``encoder(pil_images) -> [N, D]``: a CLIP checkpoint's L2-normalised projected image embeddings
    (:func:`mmrl.rewards.clipscore.clip_image_embeddings`)."""

    def __init__(self, source: str, batch_size: int = 32):
        from mmrl.rewards.clipscore import load_clip

        self.model, self.processor = load_clip(source, None, None, None, "diversity_model")
        self.batch_size = batch_size

    def __call__(self, images):
        from mmrl.rewards.clipscore import clip_image_embeddings

        return clip_image_embeddings(self.model, self.processor,
                                     [im if im.mode == "RGB" else im.convert("RGB") for im in images], self.batch_size)


def _make_encoder(source: str):
    """The image encoder of ``diversity_model``: a DINOv2 :class:`~mmrl.rewards.reference.DinoEmbedder` or a CLIP
    :class:`_ClipImageEncoder` (which one: the checkpoint's ``config.json``)."""
    from mmrl.rewards._base import MissingWeightsError
    from mmrl.rewards.reference import DinoEmbedder

    kind = _model_type(source)
    try:
        return DinoEmbedder(source) if kind == "dinov2" else _ClipImageEncoder(source)
    except (MissingWeightsError, OSError, ValueError, TypeError) as exc:
        raise EvalError(f"diversity_model={source}: {str(exc).splitlines()[0]}") from None


class DiversityScorer(Scorer):
    """Per-prompt diversity: mean pairwise embedding distance of a prompt's images (mmrl's measure; see the module
    docstring). No official scorer exists; DINOv2 (the default) and CLIP are both mmrl's choices."""

    name = "diversity"
    headline = "diversity.mean"
    sample_score = "diversity"

    def __init__(self, spec: BenchmarkSpec, settings: dict):
        from mmrl.rewards.reference import DEFAULT_DINO

        self.spec = spec
        self.model_id = settings["diversity_model"]
        self.distance = settings["diversity_distance"]
        self.reward = None
        self.version = f"mmrl {_mmrl_version()}, transformers {_version('transformers')}, torch {_version('torch')}"
        self.defaults = {"diversity_model": DEFAULT_DINO, "diversity_distance": "cosine"}
        self.settings = {
            "official": "none: no benchmark defines a diversity score (Flow-GRPO, DanceGRPO report none); mmrl's "
                        "measure, DINOv2 by default (the set_diversity reward's encoder), CLIP a named alternative",
            "diversity_model": self.model_id, "diversity_distance": self.distance,
            "embedding": "DINOv2: mmrl.rewards.reference.DinoEmbedder (pooler_output, DINOv2 preprocessing); CLIP: "
                         "mmrl.rewards.clipscore.clip_image_embeddings (L2-normalised projected image embedding)",
            "distance": "1 - cos(a, b)" if self.distance == "cosine" else "||a - b||_2",
            "per_image": "mean distance to the other images of the prompt (mmrl.rewards.diversity.SetDiversity "
                         "mean_distance)",
            "per_prompt": "mean pairwise distance of the prompt's images (= the mean of their scores)",
            "summary": "mean over prompts (mmrl.eval.scoring.mean_with_count), per category where the set has them",
        }

    def build(self) -> None:
        if self.reward is not None:
            return
        from mmrl.rewards import build_reward

        self.reward = build_reward("set_diversity", encoder=_make_encoder(self.model_id), distance=self.distance,
                                   set_score="mean_pairwise")

    def _judge(self, images: list, prompt: str) -> tuple[list[float | None], list[str | None], float | None]:
        """Per image its mean distance to the others, the reasons for a None, and the set's mean pairwise distance."""
        n = len(images)
        if n < 2:
            return [None] * n, ["diversity needs 2 or more images of a prompt"] * n, None
        self.build()
        try:
            out = self.reward(images, [prompt] * n)
        except Exception as exc:
            reason = f"diversity embedding failed: {type(exc).__name__}: {exc}"
            return [None] * n, [reason] * n, None
        reasons = self.reward.last_info.get("nan_samples", {})
        scores = [_float(out["mean_distance"][i]) for i in range(n)]
        group = [_float(v) for v in out["group_score"].tolist() if math.isfinite(v)]
        return scores, [reasons.get(i) if s is None else None for i, s in enumerate(scores)], \
            (group[0] if group else None)

    def score(self, images: list, item: EvalItem) -> list[dict]:
        scores, reasons, _ = self._judge(images, item.prompt)
        judged = sum(s is not None for s in scores)
        return [{"scores": {"diversity": s}, "verdict": {"compared": judged}, "reason": r}
                for s, r in zip(scores, reasons)]

    def summarize(self, rows: list[dict], items: list[EvalItem], out: Path) -> dict:
        from PIL import Image

        from mmrl.eval.scoring import mean_with_count

        by_prompt: dict[int, list[dict]] = {}
        for r in rows:
            by_prompt.setdefault(int(r["prompt_index"]), []).append(r)
        by_index = {item.index: item for item in items}
        per_prompt: dict[int, float | None] = {}
        recomputed = 0
        for index, prompt_rows in by_prompt.items():
            judged = [r["scores"].get("diversity") for r in prompt_rows if r["scores"].get("diversity") is not None]
            compared = {(r.get("verdict") or {}).get("compared") for r in prompt_rows
                        if r["scores"].get("diversity") is not None}
            if judged and compared == {len(judged)}:  # scored together: the rows' mean is the mean pairwise distance
                per_prompt[index] = sum(judged) / len(judged)
                continue
            # scored in separate calls (a resume with more images_per_prompt, or fewer), or not judged: embed the
            # prompt's saved images together
            images = []
            for r in sorted(prompt_rows, key=lambda r: int(r["image_index"])):
                path = Path(out) / r["image"]
                if path.is_file():
                    with Image.open(path) as image:
                        images.append(image.convert("RGB"))
            recomputed += 1
            per_prompt[index] = self._judge(images, by_index[index].prompt)[2] if len(images) >= 2 else None
        values = [per_prompt[i] for i in sorted(per_prompt)]
        metrics: dict[str, Any] = {"diversity": mean_with_count(_nan_list(values)),
                                   "diversity_model": self.model_id, "diversity_distance": self.distance,
                                   "num_prompts": len(per_prompt), "num_prompts_recomputed": recomputed}
        categories = sorted({by_index[i].category for i in per_prompt} - {None})
        if categories:
            metrics["per_category"] = {c: mean_with_count(_nan_list([per_prompt[i] for i in sorted(per_prompt)
                                                                     if by_index[i].category == c]))
                                       for c in categories}
        return _jsonable(metrics)


def _nan_list(values):
    return [float("nan") if v is None else float(v) for v in values]
