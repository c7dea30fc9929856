"""Pinned evaluation protocols for ``mmrl eval``'s generation benchmarks.

A :class:`Protocol` fixes everything that decides a benchmark's images and their scores: the prompt file
(with its sha256), how many prompts and images per prompt, the seed of every image, the resolution, the
sampler and its steps, the guidance scale, and the scorer with its version and settings. It is written into
``summary.json`` (and ``protocol.json``, which a resumed evaluation checks against).

Defaults (:data:`DEFAULTS`) are the official settings named in ``shared/benchmarks/<name>/SOURCE.md``, per
prompt set; a value the user changes is listed in ``overridden`` with the default it replaces:

=============  ==========  ====  ==========  =====  ========  =================================================
prompt set     images/pr.  seed  resolution  steps  guidance  source
=============  ==========  ====  ==========  =====  ========  =================================================
ocr            1           42    512         40     4.5       Flow-GRPO ``config/grpo.py:general_ocr_sd3``
geneval        4           42    512         40     4.5       GenEval (4 images, seed 42) + Flow-GRPO's SD3.5-M
                                                              settings (``config/grpo.py:geneval_sd3``)
drawbench      5           42    512         40     4.5       no official metric: the RL papers' 5 images/prompt
partiprompts   1           42    512         40     4.5       no official metric or seed: mmrl's choice
file           1           42    512         40     4.5       a user's prompt file: mmrl's choice
=============  ==========  ====  ==========  =====  ========  =================================================

Seeds: image ``k`` (``0 .. images_per_prompt - 1``) of **every** prompt has seed ``seed + k``; its initial noise
is ``torch.randn(latent shape, generator=torch.Generator().manual_seed(seed + k))`` on the CPU, and each image is
generated in its own call, so every image is reproducible on its own (bitwise on the CPU) and a resumed or
extended evaluation (more prompts, more images per prompt) makes exactly the images a straight run makes.
GenEval's own script seeds once per prompt and draws its 4 images in one batch; the seeds are the same rule in
spirit (every prompt restarts at 42), not the same noise.

FLUX (``model.family: flux``): the guidance default is the config's ``sampling.guidance_scale`` (FLUX.1's
distilled guidance), since the 4.5 of the table is SD3's classifier-free guidance.

:meth:`Protocol.hash` covers what decides one image and its score (prompt file content, seed rule, resolution,
steps, guidance, sampler, scorer, its version and settings), not how many prompts or images are taken: an
evaluation resumed with a larger ``limit`` or more ``images_per_prompt`` keeps its rows; any other change is a
different protocol.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = [
    "Defaults",
    "DEFAULTS",
    "PINNED_SHA256",
    "SEED_RULE",
    "SAMPLER",
    "Protocol",
    "file_sha256",
    "resolve_protocol",
    "OVERRIDABLE",
]

#: How each image's seed is made (recorded in every protocol).
SEED_RULE = ("seed of image k (0..images_per_prompt-1) of every prompt = seed + k; initial noise "
             "torch.randn(latent shape, generator=torch.Generator().manual_seed(seed + k)) on the CPU; one image per "
             "generation call")
#: The sampler (recorded in every protocol).
SAMPLER = ("deterministic Euler ODE on the model scheduler's sigmas (mmrl FlowPolicy.sample_eval; sampling.time_shift "
           "of the config if set), images quantised to uint8 PNG before scoring")


@dataclass(frozen=True)
class Defaults:
    """The official (or documented) generation settings of one prompt set, and where they come from."""

    images_per_prompt: int
    seed: int
    resolution: int
    num_steps: int
    guidance_scale: float
    source: str


_FLOW_GRPO_EVAL = ("Flow-GRPO's SD3.5-M evaluation settings (yifan123/flow_grpo config/grpo.py: 512 px, 40 steps, "
                   "CFG 4.5; base seed 42, config/base.py)")

#: Defaults per prompt set (``shared/benchmarks/<name>/SOURCE.md``).
DEFAULTS: dict[str, Defaults] = {
    "ocr": Defaults(1, 42, 512, 40, 4.5,
                    "Flow-GRPO (yifan123/flow_grpo ac4c86e) config/grpo.py:general_ocr_sd3: SD3.5-M at 512x512, "
                    "40 eval steps, CFG 4.5, 1 image per prompt; base seed 42 (config/base.py); scoring "
                    "flow_grpo/ocr.py OcrScorer.__call__"),
    "geneval": Defaults(4, 42, 512, 40, 4.5,
                        "GenEval (djghosh13/geneval af4902f) generation/diffusers_generate.py: 4 images per prompt, "
                        "seed 42; resolution, steps and CFG: Flow-GRPO config/grpo.py:geneval_sd3 (SD3.5-M, 512, "
                        "40, 4.5) - GenEval's own script (for SD 1.x/2.x) uses 50 steps and CFG 9.0 at the "
                        "model's default size"),
    "drawbench": Defaults(5, 42, 512, 40, 4.5,
                          "DrawBench has no official automatic metric (Imagen: human ratings); the diffusion-RL papers "
                          "average reward models over 5 images per prompt at 512 (NVlabs/DiffusionNFT "
                          "scripts/evaluation.py, whose --guidance_scale 1.0 default is for CFG-free models); "
                          "steps, CFG and seed: " + _FLOW_GRPO_EVAL),
    "partiprompts": Defaults(1, 42, 512, 40, 4.5,
                             "PartiPrompts defines no automatic metric, seed or resolution (Parti: human "
                             "side-by-side); mmrl's choice: 1 image per prompt with " + _FLOW_GRPO_EVAL),
    "file": Defaults(1, 42, 512, 40, 4.5,
                     "a user's prompt file: mmrl's choice, 1 image per prompt with " + _FLOW_GRPO_EVAL),
}

#: sha256 of the shipped benchmark files (``assets/benchmarks/<path>``): a shipped file with another content is
#: refused as not the pinned version.
PINNED_SHA256: dict[str, str] = {
    "ocr/test.txt": "4dd8caf3ab6ade73bd376c7d14c6ca49b6eacfb1bd321e22c40714ae4a98d4dc",
    "geneval/evaluation_metadata.jsonl": "5c48e0813e812e3c373fa5c8ed07a8f0a483be30272b4427b0559c8048e67c13",
    "drawbench/prompts_unique.txt": "7c4d2518b7642eef86637001fea3f826a950d3c2fdfab70cd7cb45e6f10fdbea",
    "partiprompts/PartiPrompts.tsv": "fab29e41bb512a169b56acab4cf2a41dcb675e285df2efcde6640c7dd3c440eb",
}

#: Eval keys that override a protocol default -> the Protocol field they set.
OVERRIDABLE = {"images_per_prompt": "images_per_prompt", "seed": "seed", "resolution": "resolution",
               "num_steps": "num_steps", "guidance": "guidance_scale"}

#: Protocol fields that decide one image and its score (what :meth:`Protocol.hash` covers).
_HASHED = ("benchmark", "prompts_sha256", "seed", "seed_rule", "resolution", "num_steps", "guidance_scale",
           "sampler", "scorer", "scorer_version", "scorer_settings")


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Protocol:
    """One benchmark's pinned protocol (see the module docstring).

    * ``prompts_file`` / ``prompts_sha256``: the file read and its content's sha256; ``pinned_sha256`` the
      sha256 mmrl pins for a shipped file (None for a user's file);
    * ``num_prompts`` of ``total_prompts`` (the first ones, in file order: ``limit``);
    * ``overridden``: ``{field: {"default": official value, "used": value}}`` for every value the user changed
      (``num_prompts`` when ``limit`` cut the set, ``scorer_settings`` keys such as the GenEval detector).
    """

    benchmark: str
    prompts_file: str
    prompts_sha256: str
    pinned_sha256: str | None
    total_prompts: int
    num_prompts: int
    images_per_prompt: int
    seed: int
    resolution: int
    num_steps: int
    guidance_scale: float
    scorer: str
    scorer_version: str
    scorer_settings: dict = field(default_factory=dict)
    seed_rule: str = SEED_RULE
    sampler: str = SAMPLER
    source: str = ""
    overridden: dict = field(default_factory=dict)

    def seeds(self) -> list[int]:
        """The seed of each image index ``k`` (the same for every prompt)."""
        return [self.seed + k for k in range(self.images_per_prompt)]

    def hash(self) -> str:
        """sha256 of what decides one image and its score (not the number of prompts or images)."""
        key = {name: getattr(self, name) for name in _HASHED}
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hash": self.hash()}

    def differences(self, other: Mapping[str, Any]) -> list[str]:
        """``"field: theirs -> ours"`` for each hashed field where ``other`` (a :meth:`to_dict`) differs."""
        out = []
        for name in _HASHED:
            mine, theirs = getattr(self, name), other.get(name)
            if json.dumps(mine, sort_keys=True, default=str) != json.dumps(theirs, sort_keys=True, default=str):
                out.append(f"{name}: {theirs!r} -> {mine!r}")
        return out


def resolve_protocol(
    benchmark: str,
    prompt_set: str | Defaults,
    *,
    prompts_file: str | Path,
    pinned_sha256: str | None,
    total_prompts: int,
    scorer: str,
    scorer_version: str,
    scorer_settings: Mapping[str, Any],
    scorer_defaults: Mapping[str, Any] | None = None,
    user: Mapping[str, Any] | None = None,
    limit: int | None = None,
    family: str = "sd3",
    config_guidance: float | None = None,
) -> Protocol:
    """The protocol of ``benchmark`` on ``prompt_set`` (a :data:`DEFAULTS` key, or a plug-in's own
    :class:`Defaults`): its defaults with the user's values
    (``user``: eval keys of :data:`OVERRIDABLE`, ``None`` = not given) applied and recorded.

    ``scorer_defaults``: the scorer's default settings; a setting that differs is recorded as overridden.
    ``family="flux"`` takes the guidance default from ``config_guidance`` (FLUX.1's distilled guidance)."""
    d = prompt_set if isinstance(prompt_set, Defaults) else DEFAULTS[prompt_set]
    values: dict[str, Any] = {"images_per_prompt": d.images_per_prompt, "seed": d.seed, "resolution": d.resolution,
                              "num_steps": d.num_steps, "guidance_scale": float(d.guidance_scale)}
    source = d.source
    if family == "flux" and config_guidance is not None:
        values["guidance_scale"] = float(config_guidance)
        source += ("; model.family flux: guidance = the config's sampling.guidance_scale (FLUX.1's distilled guidance, "
                   "not SD3's classifier-free guidance)")
    overridden: dict[str, Any] = {}
    for key, value in (user or {}).items():
        if value is None:
            continue
        name = OVERRIDABLE[key]
        value = float(value) if name == "guidance_scale" else int(value)
        if value != values[name]:
            overridden[name] = {"default": values[name], "used": value}
        values[name] = value
    num_prompts = total_prompts if limit is None else min(int(limit), total_prompts)
    if num_prompts != total_prompts:
        overridden["num_prompts"] = {"default": total_prompts, "used": num_prompts}
    sha = file_sha256(prompts_file)
    for key, default in (scorer_defaults or {}).items():
        if scorer_settings.get(key) != default:
            overridden[f"scorer_settings.{key}"] = {"default": default, "used": scorer_settings.get(key)}
    return Protocol(
        benchmark=benchmark, prompts_file=str(prompts_file), prompts_sha256=sha, pinned_sha256=pinned_sha256,
        total_prompts=total_prompts, num_prompts=num_prompts, scorer=scorer, scorer_version=scorer_version,
        scorer_settings=dict(scorer_settings), source=source, overridden=overridden, **values)
