"""The HPSv2 benchmark in ``mmrl eval``: benchmarks ``hpsv2`` (all four styles) and ``hpsv2:STYLE`` (one of
``anime``, ``concept-art``, ``paintings``, ``photo``).

    mmrl eval CONFIG benchmarks=[hpsv2] hpsv2_prompts=DIR [hps_model=FILE|DIR] [hps_version=v2.1] [hpsv2_jpeg=true]

Data: the user's ``DIR/{anime,concept-art,paintings,photo}.json`` (the Hugging Face dataset ``zhwang/HPDv2``,
``benchmark/``, what ``hpsv2.benchmark_prompts()`` downloads; not shipped, see
:data:`mmrl.eval.benchmarks.USER_SUPPLIED`), read by :func:`mmrl.eval.benchmarks.load_hpsv2` (a missing style file is
an error naming it). The prompts are taken style by style in that order, each style in file order (HPSv2's
``<style>/<index:05d>.jpg``). The protocol's prompt file is a manifest of exactly those prompts
(``{style: [prompts]}``, canonical JSON, written once to ``$MMRL_CACHE/eval-prompts/``), so its sha256 covers all
four files.

Protocol (``shared/benchmarks/hpsv2/SOURCE.md``; tgxs002/HPSv2 866735e): **1 image per prompt** (README "Custom
Evaluation": ``image.save("<style>/<idx:05d>.jpg")``); no seed, resolution or sampler is fixed upstream, so mmrl uses
Flow-GRPO's SD3.5-M evaluation settings. Since the official scorer only reads those ``.jpg`` files, each image is
scored after an in-memory JPEG round trip at PIL's defaults (quality 75, 4:2:0), what that ``image.save`` writes
(``hpsv2_jpeg=false`` scores the lossless image instead).

Scoring -- the official scorer is HPSv2's own ``hpsv2.evaluate(imgs_path, hps_version="v2.1")`` ->
``evaluation.py:evaluate_benchmark()``; mmrl computes the same numbers with its HPS reward
(:class:`mmrl.rewards.hps.HPSv2`: the HPS v2.1 checkpoint ``HPS_v2.1_compressed.pt`` of ``xswu/HPSv2`` on open_clip
``ViT-H-14``, HPSv2's ``resize_longest_max`` preprocessing), not a substitute model. The preprocessing is the
official ``preprocess_val`` step for step (``hpsv2/src/open_clip/transform.py``): ``ToTensor`` first, then
``ResizeMaxSize(224)``, torchvision's tensor bicubic resize of the float image (no uint8 rounding, antialiased as
torchvision >= 0.17 does by default) and a zero pad to the centred square, then the CLIP mean/std; the images
it gets here are PIL images (after the JPEG round trip), as the official scorer's are. Per image the score is
``100 x cosine(image features, text features)`` (``image_features @ text_features.T * 100``, its diagonal). Per style,
the scores in prompt order are cut into consecutive chunks of **80**; the style's score is the mean of the chunk
means and ``std`` their (population) standard deviation; ``overall`` is the official "Average" line: the mean over
**all** images of all styles (with the full 800 prompts per style this equals the mean of the four style scores,
``mean_of_styles``, also reported). An image the scorer could not judge is left out (as the official
``BenchmarkDataset`` leaves out a missing image) and counted. Differences from the official run: mmrl computes in
float32 where the original uses CUDA fp16 autocast (fp16 rounding), mmrl always pads to a square (the original skips
the pad when the longest side is already exactly 224, leaving a non-square input; identical otherwise), and the resize is
antialiased (``antialias=True``, the default the official code gets from torchvision >= 0.17, which mmrl requires;
official runs made under torchvision < 0.17 resized without antialiasing: ``mmrl.rewards.hps.HPSv2(antialias=False)``
reproduces those).
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from mmrl.eval.protocol import Defaults
from mmrl.eval.runner import BenchmarkSpec, EvalError, EvalItem, EvalOptions, Scorer

__all__ = ["EVAL_KEYS", "benchmark", "load_items", "defaults", "make_scorer", "main_keys", "HPSv2BenchmarkScorer",
           "hpsv2_style_score", "hpsv2_benchmark_summary", "CHUNK", "JPEG_QUALITY", "HPS_ARCH", "manifest_dir"]

EVAL_KEYS: dict[str, str] = {
    "hpsv2_prompts": "HPSv2 benchmark: folder holding your anime.json, concept-art.json, paintings.json and photo.json "
                     "(Hugging Face dataset zhwang/HPDv2, benchmark/; not shipped)",
    "hps_model": "HPSv2 benchmark: the HPS checkpoint (HPS_v2.1_compressed.pt, or HPS_v2_compressed.pt with "
                 "hps_version=v2.0) or a folder holding it; default: the Hugging Face cache of xswu/HPSv2",
    "hps_version": "HPSv2 benchmark: v2.1 (default, hpsv2.evaluate's) or v2.0",
    "hpsv2_jpeg": "HPSv2 benchmark: score each image after a JPEG round trip at PIL's default quality 75, as the "
                  "official <idx:05d>.jpg files (default true)",
}

#: Scores per chunk in ``evaluate_benchmark()``'s per-style mean.
CHUNK = 80
#: PIL's default JPEG quality (what ``image.save("x.jpg")`` writes).
JPEG_QUALITY = 75
#: The open_clip architecture of the HPS checkpoints.
HPS_ARCH = "ViT-H-14"
_VERSIONS = ("v2.1", "v2.0")
_SOURCE = ("HPSv2 (tgxs002/HPSv2 866735e) README 'Custom Evaluation': 1 image per prompt, saved as "
           "<style>/<idx:05d>.jpg, scored by hpsv2.evaluate(hps_version='v2.1') (evaluation.py evaluate_benchmark); "
           "upstream fixes no seed, resolution or sampler: base seed 42, 512 px, 40 steps, CFG 4.5 = Flow-GRPO's "
           "SD3.5-M evaluation settings (yifan123/flow_grpo config/grpo.py, config/base.py)")


# --------------------------------------------------------------------------------------------------- the rule


def hpsv2_style_score(scores: Iterable[Any], chunk: int = CHUNK) -> dict[str, Any]:
    """One style's number, ``evaluate_benchmark()``: the scores (already x100, in prompt order) cut into consecutive
    chunks of ``chunk`` (the last one may be shorter); ``score`` = the mean of the chunk means, ``std`` =
    ``np.std`` of the chunk means. ``None`` / NaN scores (not judged) are left out first, as a missing image is."""
    import numpy as np

    values = [float(s) for s in scores if s is not None and math.isfinite(float(s))]
    if not values:
        return {"score": math.nan, "std": math.nan, "num_images": 0, "num_chunks": 0}
    means = [float(np.mean(values[i:i + chunk])) for i in range(0, len(values), chunk)]
    return {"score": float(np.mean(means)), "std": float(np.std(means)), "num_images": len(values),
            "num_chunks": len(means)}


def hpsv2_benchmark_summary(per_style: Mapping[str, Sequence[Any]], chunk: int = CHUNK) -> dict[str, Any]:
    """The HPSv2 benchmark's numbers: per style :func:`hpsv2_style_score`; ``overall`` = the official "Average",
    the mean over all judged images of all styles; ``mean_of_styles`` = the mean of the style scores (the README
    table's "Averaged" column, equal to ``overall`` with 800 prompts per style)."""
    import numpy as np

    styles = {style: hpsv2_style_score(scores, chunk) for style, scores in per_style.items()}
    pooled = [float(s) for scores in per_style.values() for s in scores if s is not None and math.isfinite(float(s))]
    judged = [v["score"] for v in styles.values() if v["num_images"]]
    return {"overall": float(np.mean(pooled)) if pooled else math.nan,
            "mean_of_styles": float(np.mean(judged)) if judged else math.nan,
            "styles": styles, "num_images": len(pooled), "chunk": chunk}


# --------------------------------------------------------------------------------------------------- keys / data


def _text(options: EvalOptions, key: str) -> str | None:
    value = options.extra.get(key)
    if value is None:
        return None
    if isinstance(value, (dict, list, bool)) or str(value).strip() == "":
        raise EvalError(f"{key}={value!r}: expected a path")
    return str(value).strip()


def _styles(name: str) -> tuple[str, ...]:
    from mmrl.eval.benchmarks import HPSV2_STYLES

    if name == "hpsv2":
        return HPSV2_STYLES
    head, sep, style = name.partition(":")
    if head == "hpsv2" and sep and style in HPSV2_STYLES:
        return (style,)
    raise EvalError(f"benchmark {name!r}: expected hpsv2 (all four styles) or hpsv2:STYLE with STYLE one of "
                    f"{', '.join(HPSV2_STYLES)}")


def _prompts_dir(options: EvalOptions) -> Path:
    from mmrl.eval.benchmarks import USER_SUPPLIED

    value = _text(options, "hpsv2_prompts")
    if value is None:
        raise EvalError(f"benchmark hpsv2 needs hpsv2_prompts=DIR, a folder of the four style prompt files: "
                        f"{USER_SUPPLIED['hpsv2']}")
    path = Path(value).expanduser()
    if not path.is_dir():
        raise EvalError(f"hpsv2_prompts={value}: not a folder (it must hold anime.json, concept-art.json, "
                        f"paintings.json, photo.json)")
    return path


def _version(options: EvalOptions) -> str:
    value = options.extra.get("hps_version", "v2.1")
    value = {2.1: "v2.1", 2.0: "v2.0", "2.1": "v2.1", "2.0": "v2.0"}.get(value, value)
    if value not in _VERSIONS:
        raise EvalError(f"hps_version={value!r}: expected v2.1 or v2.0")
    return value


def _model(options: EvalOptions) -> str | None:
    value = _text(options, "hps_model")
    if value is not None and not os.path.exists(os.path.expanduser(value)):
        raise EvalError(f"hps_model={value}: no such file or folder (the HPS checkpoint, e.g. HPS_v2.1_compressed.pt "
                        f"from huggingface.co/xswu/HPSv2, or a folder holding it)")
    return None if value is None else os.path.expanduser(value)


def _jpeg(options: EvalOptions) -> bool:
    value = options.extra.get("hpsv2_jpeg", True)
    if not isinstance(value, bool):
        raise EvalError(f"hpsv2_jpeg={value!r}: expected true or false")
    return value


def _read(name: str, options: EvalOptions):
    """The prompts of ``name``'s styles, style by style (:func:`~mmrl.eval.benchmarks.load_hpsv2`)."""
    from mmrl.eval.benchmarks import load_hpsv2

    directory = _prompts_dir(options)
    styles = _styles(name)
    if len(styles) > 1:
        return load_hpsv2(directory)
    return load_hpsv2(directory / f"{styles[0]}.json")


def manifest_dir() -> Path:
    """Where the prompt manifests go: ``$MMRL_CACHE/eval-prompts`` (default ``~/.cache/mmrl/eval-prompts``)."""
    env = os.environ.get("MMRL_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "mmrl") / "eval-prompts"


def _manifest(prompts) -> Path:
    """A file holding exactly ``{style: [prompts]}`` (canonical JSON), named by its sha256; written once."""
    data: dict[str, list[str]] = {}
    for p in prompts:
        data.setdefault(p.style, []).append(p.prompt)
    text = json.dumps(data, ensure_ascii=False, indent=1) + "\n"
    sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    folder = manifest_dir()
    path = folder / f"hpsv2-prompts-{sha[:16]}.json"
    if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != sha:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------------------------------- plug-in API


def benchmark(name: str, options: EvalOptions) -> BenchmarkSpec:
    """Check ``hpsv2`` / ``hpsv2:STYLE`` and its keys, and read the style files (no model is built)."""
    _styles(name)
    _version(options)
    _model(options)
    _jpeg(options)
    _read(name, options)  # a missing or malformed style file: DataError naming it
    return BenchmarkSpec(name, "hpsv2", name)


def load_items(spec: BenchmarkSpec, options: EvalOptions) -> tuple[list[EvalItem], Path, str | None]:
    prompts = _read(spec.name, options)
    items = [EvalItem(i, p.prompt, {"style": p.style, "style_index": p.index}, p.style) for i, p in enumerate(prompts)]
    return items, _manifest(prompts), None


def defaults(spec: BenchmarkSpec) -> Defaults:
    return Defaults(1, 42, 512, 40, 4.5, _SOURCE)


def make_scorer(spec: BenchmarkSpec, options: EvalOptions) -> "HPSv2BenchmarkScorer":
    return HPSv2BenchmarkScorer(spec.name, _model(options), _version(options), _jpeg(options),
                                str(_prompts_dir(options)))


def main_keys(spec: BenchmarkSpec) -> list[str]:
    return ["hpsv2"]


# --------------------------------------------------------------------------------------------------- scorer


def jpeg_round_trip(image, quality: int = JPEG_QUALITY):
    """``image`` as the official pipeline sees it: saved as JPEG (PIL's defaults but ``quality``) and read back."""
    from PIL import Image

    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=quality)
    buffer.seek(0)
    with Image.open(buffer) as handle:
        return handle.convert("RGB")


def _build_reward(checkpoint: str | None, version: str):
    from mmrl.rewards.hps import HPSv2

    return HPSv2(checkpoint=checkpoint, version=version, arch=HPS_ARCH)


class HPSv2BenchmarkScorer(Scorer):
    """The HPSv2 benchmark with mmrl's HPS reward (the official checkpoint and preprocessing; see the module
    docstring): ``100 x cosine`` per image, :func:`hpsv2_benchmark_summary` per style and overall."""

    name = "hpsv2"
    headline = "overall"
    sample_score = "hpsv2"

    def __init__(self, benchmark: str, checkpoint: str | None, version: str, jpeg: bool, prompts_dir: str):
        from mmrl.eval.runner import _mmrl_version, _version as package_version

        self.benchmark = benchmark
        self.checkpoint = checkpoint
        self.hps_version = version
        self.jpeg = bool(jpeg)
        self.prompts_dir = prompts_dir  # recorded in the summary, not the protocol: the manifest's sha256 is
        file = {"v2.1": "HPS_v2.1_compressed.pt", "v2.0": "HPS_v2_compressed.pt"}[version]
        self.settings = {
            "model": f"HPS {version} ({file} of xswu/HPSv2) on open_clip {HPS_ARCH}, mmrl.rewards.hps.HPSv2",
            "checkpoint": checkpoint or f"the Hugging Face cache of xswu/HPSv2 ({file})",
            "hps_version": version,
            "role": "official: HPSv2's own model and preprocessing (tgxs002/HPSv2 evaluation.py evaluate_benchmark), "
                    "computed in float32 (the original: CUDA fp16 autocast)",
            "preprocessing": "HPSv2 preprocess_val: ToTensor, ResizeMaxSize(224) (torchvision tensor bicubic, "
                             "antialias=True, zero pad to the centred square), OpenAI CLIP mean/std",
            "score": "100 x cosine(image, text) (evaluate_benchmark: image_features @ text_features.T * 100)",
            "jpeg_quality": JPEG_QUALITY if self.jpeg else None,
            "summary": f"per style: mean of the means of consecutive chunks of {CHUNK} scores; overall: mean over "
                       f"all images (evaluate_benchmark's 'Average')",
        }
        self.defaults = {"hps_version": "v2.1", "jpeg_quality": JPEG_QUALITY}
        self.version = (f"mmrl {_mmrl_version()}, open_clip {package_version('open_clip_torch')}, "
                        f"torchvision {package_version('torchvision')}, pillow {package_version('pillow')}")
        self.reward = None

    def build(self) -> None:
        from mmrl.rewards import MissingWeightsError

        try:
            self.reward = _build_reward(self.checkpoint, self.hps_version)
        except ImportError as exc:
            raise EvalError(f"benchmark {self.benchmark}: the HPS model needs open_clip (pip install "
                            f"open_clip_torch): {exc}") from None
        except MissingWeightsError as exc:  # its advice names the reward's argument: name the eval key
            message = str(exc).replace("pass checkpoint=", "set hps_model=")
            raise EvalError(f"benchmark {self.benchmark}: {message}"
                            f"{'' if 'hps_model=' in message else ' (set hps_model=PATH)'}") from None
        except (RuntimeError, ValueError, OSError) as exc:
            raise EvalError(f"benchmark {self.benchmark}: cannot load the HPS checkpoint: {exc} (set "
                            f"hps_model=PATH)") from None

    def score(self, images: list, item: EvalItem) -> list[dict]:
        n = len(images)
        if self.jpeg:
            images = [jpeg_round_trip(im) for im in images]
        try:
            out = self.reward(images, [item.prompt] * n)
        except Exception as exc:  # the model failing on this prompt: its images unjudged, with the reason
            reason = f"HPS failed: {type(exc).__name__}: {exc}"
            return [{"scores": {"hpsv2": None}, "verdict": None, "reason": reason} for _ in range(n)]
        values = out["hpsv2"].tolist()
        reasons = getattr(self.reward, "last_info", {}).get("nan_samples", {})
        rows = []
        for i, v in enumerate(values):
            ok = v is not None and math.isfinite(v)
            rows.append({"scores": {"hpsv2": 100.0 * float(v) if ok else None},
                         "verdict": {"style": item.metadata.get("style"), "cosine": float(v) if ok else None},
                         "reason": None if ok else reasons.get(i, "HPS gave no score")})
        return rows

    def summarize(self, rows: list[dict], items: list[EvalItem], out: Path) -> dict:
        by_index = {item.index: item for item in items}
        ordered = sorted(rows, key=lambda r: (int(r["prompt_index"]), int(r["image_index"])))
        per_style: dict[str, list[Any]] = {}
        for style in dict.fromkeys(item.category for item in items):  # the styles in file order
            per_style[style] = []
        for row in ordered:
            per_style[by_index[int(row["prompt_index"])].category].append(row["scores"].get("hpsv2"))
        per_style = {s: v for s, v in per_style.items() if v}
        summary = hpsv2_benchmark_summary(per_style)
        unjudged = sum(1 for r in rows if r["scores"].get("hpsv2") is None)
        return {"overall": summary["overall"], "mean_of_styles": summary["mean_of_styles"],
                "per_style": summary["styles"], "num_images": summary["num_images"], "num_unjudged": unjudged,
                "chunk": summary["chunk"], "hps_version": self.hps_version, "prompts_dir": self.prompts_dir}
