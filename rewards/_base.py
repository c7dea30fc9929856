"""The reward contract, the registry, batch validation and the weight-file checks.

Every reward is an object ``reward(images, prompts, metadata=None) -> dict[str, Tensor]``:

* ``images``: a float tensor ``[N, 3, H, W]`` in ``[0, 1]`` (uint8 ``[N, 3, H, W]`` is accepted
  too), or a list of N PIL images;
* ``prompts``: a list of N strings (may be ``None`` for rewards with ``needs_prompts = False``);
* ``metadata``: ``None`` or a list of N dicts.

It returns ``[N]`` float32 CPU tensors, the main score under the reward's registered ``name``.
A sample it cannot judge (non-finite pixels, a list entry that is not an image, a prompt that is
not a string, a failure inside the scorer for that one sample) gets NaN, and the reason is kept
in ``reward.last_info``; a wrongly *shaped batch* (not ``[N, 3, H, W]``, lengths that disagree)
raises ``ValueError`` naming what was expected.
"""
from __future__ import annotations

import difflib
import inspect
import logging
import os
from collections import Counter
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import torch
from PIL import Image

from ._images import float_to_uint8, pil_to_float, uint8_batch_to_pil, uint8_to_float

__all__ = [
    "RewardFn",
    "Reward",
    "ImageBatch",
    "prepare_batch",
    "MissingWeightsError",
    "register_reward",
    "build_reward",
    "list_rewards",
    "check_reward_arguments",
    "reward_scores_images",
    "reward_inputs",
    "reward_factory",
    "check_available",
    "load_pretrained",
    "nearest",
]


# --------------------------------------------------------------------------------------------
# Protocol
# --------------------------------------------------------------------------------------------


@runtime_checkable
class RewardFn(Protocol):
    """What the trainer relies on. Any object with these members is a reward.

    ``__call__(images, prompts, metadata=None) -> dict[str, Tensor]``: ``[N]`` float32 CPU
    tensors; the main score under ``name``, extra components under other keys. NaN marks a
    sample the reward could not judge; ``last_info`` then says why.
    """

    name: str
    needs_prompts: bool
    last_info: dict

    def __call__(
        self,
        images: torch.Tensor | Sequence[Image.Image],
        prompts: Sequence[str] | None,
        metadata: Sequence[dict] | None = None,
    ) -> dict[str, torch.Tensor]: ...


class MissingWeightsError(FileNotFoundError):
    """Weights a reward model needs are not on this machine (and may not be downloaded)."""


# --------------------------------------------------------------------------------------------
# Batch validation
# --------------------------------------------------------------------------------------------


class ImageBatch:
    """A validated batch. Converting between image forms happens here, once, and is cached, so
    the components of a :class:`~mmrl.rewards.compose.ComposedReward` share the work.

    ``invalid`` maps a sample index to the reason it cannot be judged (input problems only).
    """

    def __init__(
        self,
        n: int,
        prompts: list | None,
        metadata: list | None,
        tensor: torch.Tensor | None,
        pils: list | None,
        invalid: dict[int, str],
        uint8: torch.Tensor | None = None,
    ):
        self.n = n
        self.prompts = prompts
        self.metadata = metadata
        # float [N, 3, H, W] in [0, 1] (clipped), or None for PIL input. It may be the caller's own
        # tensor (not a copy) when every value was already finite and in range: never write to it.
        self._tensor = tensor
        self._uint8_input = uint8  # the caller's uint8 [N, 3, H, W] tensor, when that was the input
        self._pils = pils  # list of N entries (PIL or garbage), or None for tensor input
        self.invalid = invalid
        self.valid_indices = [i for i in range(n) if i not in invalid]
        self._pil_cache: list[Image.Image] | None = None
        self._uint8_cache: torch.Tensor | None = None
        self._groups_cache: list[tuple[list[int], torch.Tensor]] | None = None

    @property
    def is_tensor(self) -> bool:
        return self._tensor is not None or self._uint8_input is not None

    @property
    def all_valid(self) -> bool:
        return len(self.valid_indices) == self.n

    def _valid_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` restricted to the valid samples (the tensor itself, no copy, when all are valid)."""
        if self.all_valid:
            return tensor
        idx = torch.tensor(self.valid_indices, dtype=torch.long, device=tensor.device)
        return tensor.index_select(0, idx)

    def _float_tensor(self) -> torch.Tensor:
        if self._tensor is None:  # uint8 input: the float view is made on first use only
            self._tensor = uint8_to_float(self._uint8_input)
        return self._tensor

    def uint8(self) -> torch.Tensor:
        """Valid samples of a tensor batch as contiguous uint8 ``[k, 3, H, W]`` on the input's device
        (the ``round(x * 255)`` quantisation; a uint8 input as given), computed once: :meth:`pil`
        and the rewards that preprocess tensors share it. Read-only."""
        if not self.is_tensor:
            raise ValueError("uint8() is for tensor batches; this batch holds PIL images")
        if self._uint8_cache is None:
            if self._uint8_input is not None:
                self._uint8_cache = self._valid_rows(self._uint8_input).contiguous()
            else:
                self._uint8_cache = float_to_uint8(self._valid_rows(self._tensor)).contiguous()
        return self._uint8_cache

    def pil(self, rgb: bool = True) -> list[Image.Image]:
        """RGB PIL images of the valid samples, in ``valid_indices`` order. ``rgb=False``: PIL inputs as given
        (an RGBA or palette image unconverted, for a preprocessing that converts after resizing, as ImageReward's)."""
        if not rgb and not self.is_tensor:
            return [self._pils[i] for i in self.valid_indices]
        if self._pil_cache is None:
            if self.is_tensor:
                self._pil_cache = uint8_batch_to_pil(self.uint8())
            else:
                self._pil_cache = [
                    img if img.mode == "RGB" else img.convert("RGB")
                    for img in (self._pils[i] for i in self.valid_indices)
                ]
        return self._pil_cache

    def float_groups(self) -> list[tuple[list[int], torch.Tensor]]:
        """Valid samples as float ``[k, 3, H, W]`` tensors in [0, 1], one per image size.

        Returns ``[(positions, tensor), ...]`` where ``positions`` index into ``valid_indices``.
        A tensor batch is one group (no copy when every sample is valid: treat it as read-only);
        PIL images are grouped by size.
        """
        if self._groups_cache is None:
            if self.is_tensor:
                self._groups_cache = [
                    (list(range(len(self.valid_indices))), self._valid_rows(self._float_tensor()))
                ]
            else:
                by_size: dict[tuple[int, int], list[int]] = {}
                for pos, img in enumerate(self.pil()):
                    by_size.setdefault(img.size, []).append(pos)
                pils = self.pil()
                self._groups_cache = [
                    (positions, torch.stack([pil_to_float(pils[p]) for p in positions]))
                    for positions in by_size.values()
                ]
        return self._groups_cache

    def valid_prompts(self) -> list[str]:
        if self.prompts is None:
            raise ValueError("this reward needs prompts, but prompts=None was passed")
        return [self.prompts[i] for i in self.valid_indices]


def prompt_image_cosine(
    batch: "ImageBatch", text_embeddings: Callable, image_embeddings: Callable, *, pass_batch: bool = False
) -> torch.Tensor:
    """Cosine of each valid sample's L2-normalised image embedding with its prompt's; the text tower runs once
    per unique prompt, the image tower once per batch (shared by the CLIP-family rewards).

    ``image_embeddings`` gets ``batch.pil()``, or with ``pass_batch=True`` the :class:`ImageBatch` itself
    (so a reward can preprocess a tensor batch without the PIL round trip, e.g. from ``batch.uint8()``)."""
    prompts = batch.valid_prompts()
    slot = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
    text = text_embeddings(list(slot))
    where = torch.tensor([slot[p] for p in prompts], device=text.device)
    return (image_embeddings(batch if pass_batch else batch.pil()) * text[where]).sum(dim=-1)


def _seq_len(x: Any, what: str) -> int:
    if isinstance(x, (str, bytes)) or not hasattr(x, "__len__"):
        raise ValueError(f"{what} must be a list with one entry per image, got {type(x).__name__}")
    return len(x)


_WARNED_RANGE = False


def _warn_range(low: float) -> None:
    """Once per process: a float batch reaching well below 0 is most likely in [-1, 1] (a VAE's decode), which the
    clip to [0, 1] turns into a darker, clipped image rather than an error."""
    global _WARNED_RANGE
    _WARNED_RANGE = True
    logging.getLogger("mmrl.rewards").warning(
        "reward images reach %.3g: rewards take float images in [0, 1] (values outside are clipped); a batch in "
        "[-1, 1] needs (x + 1) / 2 first", low)


def _checked_float(images: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """A float batch as float32 in [0, 1], and the indices of samples with non-finite values.

    One per-sample min/max pass finds the non-finite and out-of-range samples; the values are
    copied (``nan_to_num``, then clipped like the float -> uint8 conversion) only when some are,
    so a clean float32 batch is returned as is, without a copy.
    """
    n = images.shape[0]
    if n == 0:
        return images.float(), []
    if images.device.type == "cuda":
        lo, hi = torch.aminmax(images.reshape(n, -1), dim=1)
    else:  # on CPU aminmax over a dim is ~10x slower than these two vectorised reductions
        lo, hi = images.amin(dim=(1, 2, 3)), images.amax(dim=(1, 2, 3))
    # One transfer; NaN propagates through min/max. Checked in the input's dtype (as before: a
    # float64 value too large for float32 is finite here and is clipped to 1, not marked).
    lo, hi = torch.stack((lo, hi)).cpu()
    bad = (~(torch.isfinite(lo) & torch.isfinite(hi))).nonzero().flatten().tolist()
    if not _WARNED_RANGE:
        low = float(lo[torch.isfinite(lo)].min()) if bool(torch.isfinite(lo).any()) else 0.0
        if low < -0.25:
            _warn_range(low)
    tensor = images.float()  # no copy for float32
    if bad or bool((lo < 0).any()) or bool((hi > 1).any()):
        if tensor is images:
            tensor = torch.nan_to_num(tensor, nan=0.0, posinf=1.0, neginf=0.0)
        else:
            torch.nan_to_num(tensor, nan=0.0, posinf=1.0, neginf=0.0, out=tensor)
        tensor.clamp_(0, 1)
    return tensor, bad


def prepare_batch(
    images: Any,
    prompts: Sequence[str] | None,
    metadata: Sequence[dict] | None = None,
    *,
    needs_prompts: bool = False,
) -> ImageBatch:
    """Validate ``(images, prompts, metadata)`` and return an :class:`ImageBatch`.

    Raises ``ValueError``/``TypeError`` for a wrong-shaped batch; marks individual bad samples
    invalid (with a reason) instead of raising.
    """
    if isinstance(images, ImageBatch):
        return images

    invalid: dict[int, str] = {}
    tensor = pils = uint8 = None
    if isinstance(images, torch.Tensor):
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(
                "images must be a float tensor [N, 3, H, W] with values in [0, 1] "
                f"(or a list of PIL images); got a tensor of shape {tuple(images.shape)}"
            )
        if images.shape[2] == 0 or images.shape[3] == 0:
            raise ValueError(f"images have an empty spatial size: shape {tuple(images.shape)}")
        images = images.detach()
        if images.dtype == torch.uint8:
            uint8 = images
            n = images.shape[0]
        elif images.is_floating_point():
            tensor, bad = _checked_float(images)
            for i in bad:
                invalid[i] = "non-finite pixel values (NaN or inf)"
            n = tensor.shape[0]
        else:
            raise TypeError(
                f"images tensor must be float in [0, 1] or uint8, got dtype {images.dtype}"
            )
    elif isinstance(images, (list, tuple)):
        n = len(images)
        pils = list(images)
        for i, img in enumerate(pils):
            if not isinstance(img, Image.Image):
                invalid[i] = f"not a PIL image (got {type(img).__name__})"
            elif img.width == 0 or img.height == 0:
                invalid[i] = f"empty image of size {img.size}"
    else:
        raise TypeError(
            "images must be a float tensor [N, 3, H, W] in [0, 1] or a list of PIL images, "
            f"got {type(images).__name__}"
        )

    if prompts is None:
        if needs_prompts:
            raise ValueError("this reward needs one prompt per image, but prompts=None was passed")
    else:
        if _seq_len(prompts, "prompts") != n:
            raise ValueError(f"got {n} images but {len(prompts)} prompts; they must match")
        prompts = list(prompts)
        if needs_prompts:
            for i, p in enumerate(prompts):
                if not isinstance(p, str) and i not in invalid:
                    invalid[i] = f"prompt is not a string (got {type(p).__name__})"
    if metadata is not None:
        if _seq_len(metadata, "metadata") != n:
            raise ValueError(f"got {n} images but {len(metadata)} metadata entries; they must match")
        metadata = list(metadata)
    return ImageBatch(n, prompts, metadata, tensor, pils, invalid, uint8=uint8)


# --------------------------------------------------------------------------------------------
# Base class
# --------------------------------------------------------------------------------------------


class Reward:
    """Base class doing the contract's bookkeeping; subclasses implement :meth:`_score`.

    ``_score(batch, reasons)`` sees only the valid samples (``batch.valid_indices``) and returns
    a dict of tensors of length ``len(batch.valid_indices)`` (the main score under ``self.name``).
    It may put NaN for a sample it fails on and record ``reasons[sample_index] = "why"``.
    """

    name: str = ""
    needs_prompts: bool = False
    scores_images: bool = True  # judges a flow policy's images (text rewards say False, see reward_inputs)

    def __init__(self) -> None:
        self.last_info: dict = {}

    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def __call__(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        batch = prepare_batch(images, prompts, metadata, needs_prompts=self.needs_prompts)
        reasons: dict[int, str] = dict(batch.invalid)
        valid = batch.valid_indices
        out: dict[str, torch.Tensor] = {}
        partial: dict[str, torch.Tensor] = self._score(batch, reasons) if valid else {}
        partial.setdefault(self.name, torch.empty(0))
        index = torch.tensor(valid, dtype=torch.long)
        for key, values in partial.items():
            values = torch.as_tensor(values).detach().to("cpu", torch.float32).reshape(-1)
            if values.numel() != len(valid):
                raise RuntimeError(
                    f"reward {self.name!r} returned {values.numel()} values for key {key!r}, "
                    f"expected {len(valid)}"
                )
            full = torch.full((batch.n,), float("nan"), dtype=torch.float32)
            if len(valid):
                full[index] = torch.where(torch.isfinite(values), values, torch.nan)
            out[key] = full
        main = out[self.name]
        for i in torch.isnan(main).nonzero().flatten().tolist():
            reasons.setdefault(i, "the scorer returned a non-finite value")
        self.last_info = _info(batch.n, reasons)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _info(n: int, reasons: dict[int, str]) -> dict:
    return {
        "num_samples": n,
        "num_nan": len(reasons),
        "reasons": dict(Counter(reasons.values())),
        "nan_samples": dict(sorted(reasons.items())),
    }


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

_REGISTRY: dict[str, Callable[..., RewardFn]] = {}


def nearest(name: str, names: Sequence[str], n: int = 3) -> list[str]:
    """The closest names to ``name`` (difflib), best first."""
    return difflib.get_close_matches(name, list(names), n=n, cutoff=0.4)


def register_reward(name: str) -> Callable:
    """Decorator registering a reward class (or factory) under ``name``.

    A decorated class without its own ``name`` gets this one, so outputs are keyed by it.
    """

    def deco(factory):
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"a reward named {name!r} is already registered ({_REGISTRY[name]})")
        if isinstance(factory, type) and not factory.__dict__.get("name"):
            factory.name = name
        _REGISTRY[name] = factory
        return factory

    return deco


#: the entry-point group a package registers its rewards under (``[project.entry-points."mmrl.rewards"]``)
ENTRY_POINT_GROUP = "mmrl.rewards"


def list_rewards() -> list[str]:
    """Registered reward names, sorted."""
    return sorted(_REGISTRY)


def reward_factory(name: str) -> Callable[..., RewardFn]:
    """The factory (a class or function taking the reward's keyword arguments) of ``name``: a registered reward,
    ``"package.module:Name"`` (a reward of your own, imported), or a name an installed package gives in the
    ``mmrl.rewards`` entry-point group. ``ValueError`` naming the nearest registered ones otherwise."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if isinstance(name, str) and ":" in name:
        from mmrl.config import import_attribute

        try:
            factory = import_attribute(name)
        except ValueError as exc:
            raise ValueError(f"reward {name!r}: {exc}") from None
        if not callable(factory):
            raise ValueError(f"reward {name!r} is {factory!r}, not a class or function building a reward")
        return factory
    from importlib.metadata import entry_points

    points = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if isinstance(name, str) and name in points:
        return points[name].load()
    close = nearest(str(name), list(_REGISTRY) + list(points))
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise ValueError(
        f"unknown reward {name!r}; {hint}registered rewards: {', '.join(list_rewards())} (a reward of your own is "
        f"'package.module:ClassName' or an '{ENTRY_POINT_GROUP}' entry point)"
    )


def check_reward_arguments(name: str, kwargs: Mapping[str, Any], *, complete: bool = True) -> None:
    """Raise ``ValueError`` for an unknown reward name or keyword argument, naming the nearest valid ones, and
    (``complete``) for a required argument ``kwargs`` lacks, without building anything (config validation uses
    this). A factory with a ``check_arguments(kwargs)`` classmethod checks its values there too."""
    factory = reward_factory(name)
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"reward {name!r}: kwargs must be a mapping of argument names to values, got {kwargs!r}")
    target = factory.__init__ if isinstance(factory, type) else factory
    params = inspect.signature(target).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        valid = [k for k, p in params.items() if k != "self" and p.kind is not inspect.Parameter.VAR_POSITIONAL]
        for key in kwargs:
            if key not in valid:
                close = nearest(key, valid)
                hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
                raise ValueError(
                    f"reward {name!r} has no argument {key!r}; {hint}valid arguments: {', '.join(valid) or '(none)'}"
                )
    needed = [k for k, p in params.items() if k != "self" and p.default is inspect.Parameter.empty
              and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    missing = [k for k in needed if k not in kwargs]
    if complete and missing:
        raise ValueError(f"reward {name!r} needs the argument(s) {', '.join(missing)} (kwargs: {{{missing[0]}: ...}})")
    check = getattr(factory, "check_arguments", None)
    if complete and callable(check):
        check(kwargs)


def reward_scores_images(name: str) -> bool:
    """Whether the registered reward ``name`` judges images (``scores_images`` on its class; default True).
    Text rewards say False, so image-only uses (intermediate-step credit) can refuse them at config time."""
    return bool(getattr(reward_factory(name), "scores_images", True))


def reward_inputs(name: str) -> tuple[bool, bool] | None:
    """``(images, texts)``: whether reward ``name`` judges a flow policy's images and a VLM policy's completions,
    from its class's ``scores_images`` / ``scores_texts`` (one given: the other is its opposite); None when its
    factory says neither (a reward of your own that does not declare it: not checked)."""
    factory = reward_factory(name)
    images, texts = getattr(factory, "scores_images", None), getattr(factory, "scores_texts", None)
    if images is None and texts is None:
        return None
    images = (not texts) if images is None else bool(images)
    texts = (not images) if texts is None else bool(texts)
    return images, texts


def build_reward(name: str, **kwargs) -> RewardFn:
    """Build the reward registered as ``name`` with ``kwargs``.

    Unknown names, and unknown keyword arguments, raise ``ValueError`` naming the nearest valid
    ones. Heavy backbones (transformers, open_clip) are imported only by the reward that needs them.
    """
    check_reward_arguments(name, kwargs)
    return reward_factory(name)(**kwargs)


# --------------------------------------------------------------------------------------------
# Devices, dtypes, weight files
# --------------------------------------------------------------------------------------------


def check_available(source: str, required, what: str, kwarg: str) -> None:
    """Raise :class:`MissingWeightsError` if ``source`` lacks files and cannot be downloaded."""
    local = os.path.isdir(source) or os.path.isabs(source) or source.startswith(".")
    if not (local or hub_offline()):
        return  # from_pretrained may download
    if local and not os.path.isdir(source):
        raise MissingWeightsError(f"{what}: directory {source!r} does not exist (pass {kwarg}=<dir>)")
    missing, where = missing_hf_files(source, required)
    if missing:
        how = (
            f"put them in {source}"
            if os.path.isdir(source)
            else f"download them where there is network (`hf download {source}`) so they land in "
            f"the Hugging Face cache, or pass {kwarg}=<local dir holding them>"
        )
        raise MissingWeightsError(
            f"{what} {source!r} is not available offline (HF_HUB_OFFLINE=1): missing "
            f"{', '.join(missing)} in {where}; {how}."
        )


def load_pretrained(loader, source: str | os.PathLike, required, what: str, kwarg: str, *,
                    needs: str = "config.json and model.safetensors (or pytorch_model.bin)", **kwargs):
    """``loader.from_pretrained(source, **kwargs)`` after :func:`check_available`; a load failure becomes one
    :class:`MissingWeightsError` naming ``what``, the source and the files it needs."""
    source = os.fspath(source)
    check_available(source, required, what, kwarg)
    try:
        return loader.from_pretrained(source, **kwargs)
    except Exception as exc:  # missing files (OSError), or another model's folder (a config that does not fit)
        raise MissingWeightsError(
            f"could not load the {what} {source!r}: {type(exc).__name__}: {exc}. It needs {needs}; pass "
            f"{kwarg}=<local dir>."
        ) from exc


def load_state_dict_file(path: str | os.PathLike, what: str, weights_only: bool = True) -> dict:
    """A PyTorch checkpoint's state dict (``torch.load``, unwrapping ``{'state_dict': ...}`` and DataParallel's
    ``module.`` prefixes); a file that is not one is a :class:`MissingWeightsError` naming it and ``what``."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as exc:  # a text file, another pickle, a truncated download: torch's unpickler errors vary
        raise MissingWeightsError(f"{path} is not a readable {what} checkpoint ({type(exc).__name__}: {exc})") from exc
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise MissingWeightsError(f"{path}: expected a {what} state dict (or {{'state_dict': ...}}), got "
                                  f"{type(state).__name__}")
    return {k.removeprefix("module."): v for k, v in state.items()}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(set(_DTYPES))}")
    return _DTYPES[key]


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set to a true value (read now, not at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def missing_hf_files(source: str, required: Sequence[Sequence[str]]) -> tuple[list[str], str]:
    """Which of the ``required`` files are absent for a local directory or a hub id.

    ``required`` is a list of requirements; each requirement is a list of alternatives, and an
    alternative is a list of files that must all be present, e.g.
    ``[[["config.json"]], [["model.safetensors"], ["pytorch_model.bin"]]]``. Returns the unmet
    requirements (described) and where they were looked for. Never touches the network.
    """
    def describe(alternatives):
        return " or ".join("+".join(files) for files in alternatives)

    if os.path.isdir(source):
        have = lambda f: os.path.isfile(os.path.join(source, f))  # noqa: E731
        where = f"the local directory {os.path.abspath(source)}"
    else:
        from huggingface_hub import constants, try_to_load_from_cache

        def have(f):
            try:
                hit = try_to_load_from_cache(source, f)
            except Exception:  # not a valid repo id
                return False
            return isinstance(hit, str)

        repo_dir = "models--" + source.replace("/", "--")
        where = f"the Hugging Face cache {os.path.join(constants.HF_HUB_CACHE, repo_dir)}"
    missing = []
    for group in required:
        if not any(all(have(f) for f in alt) for alt in group):
            missing.append(describe(group))
    return missing, where
