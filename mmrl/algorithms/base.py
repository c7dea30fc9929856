"""The extension point of the training loop: algorithm variants as registered plug-ins.

The loop (:mod:`mmrl.trainer`) runs the same fixed stages every update and never names a paper. A variant is one
module that subclasses :class:`Variant`, registers itself with :func:`register` under a name, owns a small typed
options dataclass (one docstring line per field, citing its paper) and overrides the stages it uses:

=================== ======================================================= ==========================================
stage               input -> output (``N`` = samples of this process)       used by
=================== ======================================================= ==========================================
``rewards``         :class:`RewardContext` -> :class:`Rewards`: the score   T-GRPO (extra rollouts on shuffled frames),
                    components ``{name: [N] or [N, T]}`` and the weights    dense credit (per-step rewards from
                    of those that enter the advantage                       intermediate images), adaptive noise, PAR,
                                                                            LENS, contrastive baselines, ...
``select``          :class:`SelectContext` -> priority ``[N]`` (one value   DAPO dynamic sampling, variance-aware
                    per group; ``-inf`` = only as filler)                   selection (Temporal-R1)
``advantages``      :class:`AdvantageContext` -> advantages ``[N_all]`` or  G2RPO, VGPO, MC-GRPO, NGRPO, DVAO, ...
                    ``[N_all, T]`` over every process's samples (one
                    variant at most; default: group normalisation)
``transform``       :class:`TransformContext` -> advantages ``[N]`` /       GA-GRPO, TW-GRPO, A-GRAE, focal scaling,
                    ``[N, T]`` (chained in config order)                    token weighting, ...
``surrogate``       :class:`SurrogateContext` -> per-action loss ``[N, T]``  RGRA, Reg-GRPO, ETR, ...
                    before aggregation (one variant at most; default: the
                    clipped PPO surrogate)
=================== ======================================================= ==========================================

A variant declares what it needs from the policy in :attr:`Variant.needs` (``"old_logps"``: the sampling policy's
per-action log-probs before the first update; ``"masked_logps"``: the same completions' log-probs with every image
replaced by a grey canvas, ``rollout.masked_logps``, VLM policies; ``"perturbed_logps"``: the same with Gaussian noise
of :meth:`Variant.perturbation_std` on the images, ``rollout.perturbed_logps``; ``"intermediate_images"``: the images each trained
denoising step leads to) and which policy families it applies to (:attr:`Variant.families`). Per-run state (running anchors, histories)
goes through :meth:`Variant.state_dict` / :meth:`Variant.load_state_dict` into every checkpoint.

Config: ``algorithm.variants: [{name: t_grpo, alpha: 0.3}, ga_grpo_name_only, ...]``. A name is a registered variant,
``package.module:ClassName`` (imported, must subclass :class:`Variant`), or one registered by an installed package
under the ``mmrl.variants`` entry-point group. Unknown names and options are a :class:`~mmrl.config.ConfigError`
naming the nearest valid one; incompatible combinations are one too, before anything is sampled.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

STAGES = ("rewards", "select", "advantages", "transform", "surrogate")
#: stages that replace the loop's default computation: at most one variant may use each
EXCLUSIVE_STAGES = ("advantages", "surrogate")
NEEDS = ("old_logps", "masked_logps", "perturbed_logps", "intermediate_images")
FAMILIES = ("flow", "vlm")


class VariantError(ValueError):
    """A variant spec that cannot be used (unknown name or option, bad value, incompatible combination)."""


# ---------------------------------------------------------------------------------------------- stage inputs


@dataclass
class Rewards:
    """Output of the ``rewards`` stage: every score component (``[N]`` or ``[N, T]``, this process's samples) and
    the weights of those that enter the advantage (a component absent from ``weights`` is only logged).

    ``rollout``: a variant with ``trained_rows_per_sample = k > 1`` returns the rollout to train instead, the given
    one followed by ``(k - 1) N`` rows of another role's samples (``policy.concat_rollouts``), each appended group
    with its own group id, and ``scores`` covering all ``k N`` rows."""

    scores: dict[str, Tensor]
    weights: dict[str, float]
    rollout: Any = None


@dataclass
class Intermediate:
    """The images ``[N, T+1, 3, H, W]`` a flow rollout's trajectories reach from the latent before the first trained
    step and after each trained step (ODE completion or one-step prediction, ``sampling.intermediate``), and their
    rewards ``step_rewards [N, T+1]`` (``R_0`` the pure-ODE sample, ``R_T`` the final one): the weighted total of the
    run's advantage components."""

    images: Tensor
    step_rewards: Tensor


@dataclass
class RewardContext:
    """What the ``rewards`` stage sees for one batch of rollouts (this process's samples).

    ``rollout`` is the policy's rollout (``outputs``, ``prompts``, ``metadata``, ``group_ids [N]``, ``mask [N, T]``;
    a flow rollout also its ``plan``), ``items`` the data items it was sampled from; ``scores`` / ``weights`` are
    the current components and advantage weights (the reward's own, then each earlier variant's output).
    ``score(rollout)`` runs the run's reward on another rollout (batched by ``train.reward_batch_size``, counted in
    ``time/reward``); ``score_outputs(outputs, prompts, metadata)`` scores other outputs (reference or baseline
    responses from the data, as texts for a VLM, images for a flow) the same way; ``sample(items, group_size, **kwargs)`` draws another rollout from the current policy with this
    update's generator (counted in ``time/rollout``). ``intermediate()`` gives :class:`Intermediate`: the images
    each trained step leads to and their rewards ``R_0 .. R_T`` (flow policies, variants that need
    ``intermediate_images``), computed once per batch whichever variants ask. ``stats`` are metrics this update
    logs (a variant that counts over several calls adds to its own entry)."""

    rollout: Any
    items: list
    scores: dict[str, Tensor]
    weights: dict[str, float]
    config: Any
    policy: Any
    accelerator: Any
    update: int
    score: Callable[[Any], dict[str, Tensor]]
    score_outputs: Callable[[Any, list, list], dict[str, Tensor]]
    sample: Callable[..., Any]
    intermediate: Callable[[], "Intermediate"]
    stats: dict[str, float]
    timer: dict[str, float]


def item_of(rollout: Any, items: list, sample: int) -> Any:
    """The data item (of ``items``, the list ``rollout`` was sampled from) that sample ``sample`` answers: a tool
    rollout keeps a prompt row per sample and the item in ``item_index``; other rollouts index ``items`` by
    ``prompt_index``."""
    index = getattr(rollout, "item_index", None)
    index = rollout.prompt_index if index is None else index
    return items[int(index[sample])]


@dataclass
class SelectContext:
    """What the ``select`` stage sees: the pool of candidate samples drawn so far this update (this process's), their
    advantage input ``total [N]`` or ``[N, T]`` (weighted sum of the components), ``group_ids [N]`` and ``scores``;
    ``need`` groups are kept. ``rounds`` sampling rounds have been drawn."""

    total: Tensor
    group_ids: Tensor
    scores: dict[str, Tensor]
    need: int
    rounds: int


@dataclass
class AdvantageContext:
    """What the ``advantages`` stage sees, gathered over every process (``N_all`` samples, process order).

    ``components`` are the score components entering the advantage, unweighted (``[N_all]`` or ``[N_all, T]``), and
    ``weights`` their weights (a component of weight 0 is not among them),
    ``labels`` the grouping of the loop's default estimator (condition keys with
    ``algorithm.per_prompt_stat_tracking``, else the sampling groups), ``group_ids`` the sampling groups and ``keys``
    the condition keys (a flow prompt's text, a VLM sample's data id). ``algorithm`` is the config's algorithm section
    (``scale``, ``eps``, ``std_ddof``, ``advantage_clamp``, ``reward_combination``, ...); ``default()`` is the loop's
    own estimate (group normalisation), for variants that adjust it; ``stats`` are metrics this update logs. A
    variant may set ``drop`` to leave samples out of the loss entirely (their action mask becomes 0: out of every
    token-count normaliser and the KL term; the ``grpo`` aggregation's mean over samples still counts them)."""

    components: dict[str, Tensor]
    weights: dict[str, float]
    labels: Any
    group_ids: Tensor
    keys: list[str]
    algorithm: Any
    update: int
    default: Callable[[], Tensor]
    stats: dict[str, float] = field(default_factory=dict)
    #: set by the variant: ``[N_all]`` bool, the samples to leave out of the loss (their actions masked out)
    drop: Tensor | None = None


@dataclass
class TransformContext:
    """What the ``transform`` stage sees (this process's samples): the advantages so far (``[N]`` or ``[N, T]``), the
    score components, the rollout (``mask [N, T]``, ``group_ids [N]``; ``old_logps [N, T]`` when a variant needs
    ``old_logps``; ``spans``: per reward component the character spans its reward reported, VLM rollouts), the update
    index and the run's total updates. ``stats`` are metrics this update logs; ``policy`` the policy (e.g.
    ``policy.span_mask(rollout, spans)``: spans -> ``[N, T]`` token masks); ``rows [N]`` the positions of these samples
    in the ``[N_all]`` tensors of the ``advantages`` stage (every process's samples, process order); ``accelerator``
    the run's (``None`` in a bare call), for a statistic of the whole batch (:func:`global_mean`,
    :func:`global_pool`)."""

    advantages: Tensor
    scores: dict[str, Tensor]
    rollout: Any
    update: int
    total_updates: int
    stats: dict[str, float] = field(default_factory=dict)
    policy: Any = None
    rows: Tensor | None = None
    accelerator: Any = None


def global_mean(values: Tensor, accelerator: Any = None, empty: float = 0.0) -> float:
    """The mean of the finite entries of ``values`` over every process (``empty`` when no process has one), in
    float64: a batch statistic a ``transform`` or ``rewards`` stage takes from its own process's samples, made the
    statistic of the whole batch (``accelerator``: the run's, or ``None`` on one process)."""
    finite = torch.isfinite(values)
    stats = torch.stack([values[finite].double().sum(), finite.sum().double()])
    if accelerator is not None and accelerator.num_processes > 1:
        stats = accelerator.reduce(stats.to(accelerator.device), "sum").cpu()
    return float(stats[0] / stats[1]) if stats[1] > 0 else empty


def global_pool(values: Tensor, accelerator: Any = None) -> tuple[Tensor, int]:
    """Every process's 1-D ``values`` (any lengths) concatenated in process order, and where this process's start
    in it: a ranking or quantile over the whole batch, whose local part is ``pool[offset : offset + len(values)]``.
    On one process (``accelerator`` ``None`` or a single process) ``(values, 0)``."""
    values = values.reshape(-1)
    if accelerator is None or accelerator.num_processes <= 1:
        return values, 0
    device = accelerator.device
    lengths = accelerator.gather(torch.tensor([values.numel()], device=device)).cpu().tolist()
    if max(lengths) == 0:
        return values, 0
    padded = accelerator.pad_across_processes(values.to(device), dim=0)
    everyone = accelerator.gather(padded).cpu().reshape(accelerator.num_processes, -1)
    pool = torch.cat([everyone[rank, :length] for rank, length in enumerate(lengths)])
    return pool, int(sum(lengths[:accelerator.process_index]))


@dataclass
class SurrogateContext:
    """What the ``surrogate`` stage sees for one forward (a minibatch's chunk of steps): ``logps`` (with grad),
    ``old_logps``, ``log_ratio`` and ``ratio`` (``[N, T]``, or ``[N, 1]`` with GSPO's sequence ratio), ``advantages``
    ``[N, 1]`` or ``[N, T]``, ``mask [N, T]``, the configured clip range, ``index [N]`` (the rows' positions in this
    update's local batch, the indexing of the ``transform`` stage's tensors: a variant may keep per-sample values from
    its ``transform`` and read them here) and the rows' ``group_ids [N]``. Returns the per-action loss to minimise;
    the loop adds the KL term and aggregates as ``algorithm.aggregation`` says, so every layout gives the same
    update."""

    logps: Tensor
    old_logps: Tensor
    log_ratio: Tensor
    ratio: Tensor
    advantages: Tensor
    mask: Tensor
    clip_low: float
    clip_high: float
    index: Tensor
    group_ids: Tensor


# ---------------------------------------------------------------------------------------------- the base class


@dataclass
class NoOptions:
    """This variant has no options."""


class Variant:
    """Base class of a plug-in. Subclasses set ``name``, ``paper``, ``Options`` (a dataclass) and the stages."""

    #: the registered name (what ``algorithm.variants`` selects)
    name: ClassVar[str] = ""
    #: the paper (title, authors, year, arXiv id) and, where the rule is mmrl's own, a word saying so
    paper: ClassVar[str] = ""
    #: one line: what the variant does
    summary: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: what the loop must provide (:data:`NEEDS`)
    needs: ClassVar[tuple[str, ...]] = ()
    #: policy families it applies to (:data:`FAMILIES`)
    families: ClassVar[tuple[str, ...]] = FAMILIES
    #: rows trained per sampled row: a ``rewards`` variant that appends another role's samples to the trained
    #: batch (:class:`Rewards` ``rollout``) sets it, so the optimizer-step count and LR schedule count them
    trained_rows_per_sample: ClassVar[int] = 1
    #: keeps its own copy of the trainable weights (an EMA reference) and swaps it into the policy: impossible
    #: where the weights are partitions outside a forward (DeepSpeed ZeRO-3), so the loop refuses it there
    copies_weights: ClassVar[bool] = False

    def __init__(self, options: Any = None):
        self.options = options if options is not None else self.Options()

    @classmethod
    def stages(cls) -> tuple[str, ...]:
        """The stages this variant overrides, in loop order."""
        return tuple(s for s in STAGES if getattr(cls, s) is not getattr(Variant, s))

    def setup(self, policy: Any, config: Any) -> None:
        """Called once when the trainer is built, before a checkpoint is loaded (e.g. to remember the policy's
        configured state)."""

    def perturbation_std(self) -> float:
        """Variants needing ``perturbed_logps``: the std of the noise on the normalised pixels."""
        return 0.0

    def check(self, config: Any) -> None:
        """Raise :class:`VariantError` when the rest of the config cannot work with this variant (called before
        anything is built)."""

    def require_reward(self, config: Any, option_name: str, *, weighted: bool = False) -> None:
        """:class:`VariantError` unless the option ``option_name`` names a configured reward (with ``weighted``: one
        whose weight is not 0, so the ``advantages`` stage sees it). An empty option is allowed when its default is
        empty-means-off (the caller checks first)."""
        key = getattr(self.options, option_name)
        if key not in config.rewards:
            raise VariantError(f"variant {self.name!r}: {option_name}={key!r} is not one of the configured rewards "
                               f"{sorted(config.rewards)}")
        spec = config.rewards[key]
        if weighted and (spec.get("weight", 1.0) if isinstance(spec, dict) else spec) == 0:
            raise VariantError(f"variant {self.name!r}: reward {key!r} has weight 0, so the advantages stage never sees "
                               f"it; give it a non-zero weight (the variant replaces the weighted sum anyway)")

    # the stages (each default is "not used"; the loop calls only the overridden ones)
    def rewards(self, ctx: RewardContext) -> Rewards:
        raise NotImplementedError

    def select(self, ctx: SelectContext) -> Tensor:
        raise NotImplementedError

    #: ``select`` variants: sampling rounds per update, at least and at most
    def sampling_rounds(self) -> tuple[int, int]:
        return 1, 1

    def advantages(self, ctx: AdvantageContext) -> Tensor:
        raise NotImplementedError

    def transform(self, ctx: TransformContext) -> Tensor:
        raise NotImplementedError

    def surrogate(self, ctx: SurrogateContext) -> Tensor:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Per-run state to checkpoint (torch-saved: tensors allowed); empty when the variant keeps none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


# ---------------------------------------------------------------------------------------------- the registry

REGISTRY: dict[str, type[Variant]] = {}
ENTRY_POINT_GROUP = "mmrl.variants"


def register(cls: type[Variant]) -> type[Variant]:
    """Class decorator: make ``cls`` selectable as ``algorithm.variants: [{name: <cls.name>}]``."""
    _check_class(cls, cls.name)
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise VariantError(f"variant {cls.name!r} is registered twice ({REGISTRY[cls.name].__module__} and "
                           f"{cls.__module__})")
    REGISTRY[cls.name] = cls
    return cls


def _check_class(cls: Any, name: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Variant)):
        raise VariantError(f"variant {name!r} is {cls!r}, not a subclass of mmrl.algorithms.Variant")
    if not cls.name or not cls.name.replace("_", "").isalnum():
        raise VariantError(f"variant class {cls.__qualname__} needs a name of letters, digits and underscores")
    if not dataclasses.is_dataclass(cls.Options):
        raise VariantError(f"variant {cls.name!r}: Options must be a dataclass")
    unknown = set(cls.needs) - set(NEEDS)
    if unknown or not cls.stages() or set(cls.families) - set(FAMILIES):
        raise VariantError(f"variant {cls.name!r}: needs must be among {NEEDS}, families among {FAMILIES}, and it "
                           f"must override at least one stage of {STAGES}")


def _entry_points() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def lookup(name: str) -> type[Variant]:
    """The variant class for ``name``: registered, ``module:Class``, or an ``mmrl.variants`` entry point."""
    if not isinstance(name, str) or not name:
        raise VariantError(f"a variant name must be a non-empty string, got {name!r}")
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" in name:
        from mmrl.config import import_attribute

        try:
            cls = import_attribute(name)
        except ValueError as exc:
            raise VariantError(f"variant {name!r}: {exc}") from None
        _check_class(cls, name)
        return cls
    points = _entry_points()
    if name in points:
        cls = points[name].load()
        _check_class(cls, name)
        return cls
    names = sorted(set(REGISTRY) | set(points))
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else f"; registered: {', '.join(names)}"
    raise VariantError(f"unknown variant {name!r}{hint} (`mmrl variants` lists them; a third-party variant is "
                       f"'package.module:ClassName' or an '{ENTRY_POINT_GROUP}' entry point)")


def _coerce_option(cls: type, f: dataclasses.Field, value: Any, where: str) -> Any:
    from mmrl.config import ConfigError, _coerce

    hint = typing.get_type_hints(cls.Options)[f.name]
    try:
        return _coerce(value, hint, where)
    except ConfigError as exc:
        raise VariantError(str(exc)) from None


def parse_spec(spec: Any, index: int) -> Variant:
    """One entry of ``algorithm.variants`` (a name, or a mapping with ``name`` and options) -> a variant instance."""
    where = f"algorithm.variants[{index}]"
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or "name" not in spec:
        raise VariantError(f"{where}: expected a variant name or {{name: ..., <options>}}, got {spec!r}")
    cls = lookup(spec["name"])
    fields = {f.name: f for f in dataclasses.fields(cls.Options)}
    values = {}
    for key, value in spec.items():
        if key == "name":
            continue
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else (
                f"; its options: {', '.join(fields)}" if fields else "; it has no options")
            raise VariantError(f"{where}: variant {cls.name!r} has no option {key!r}{hint}")
        values[key] = _coerce_option(cls, fields[key], value, f"{where}.{key}")
    try:
        options = cls.Options(**values)
        for f in dataclasses.fields(options):  # NaN passes every range check written as a comparison
            value = getattr(options, f.name)
            if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and
                                                                   not f.metadata.get("allow_inf"))):
                raise ValueError(f"{f.name} must be a finite number, got {value}")
        validate_options = getattr(options, "validate", None)
        if validate_options is not None:
            validate_options()
    except (TypeError, ValueError) as exc:
        raise VariantError(f"{where} ({cls.name}): {exc}") from None
    return cls(options)


def build_variants(config: Any) -> list[Variant]:
    """The configured variants, checked against each other and against the rest of ``config``."""
    variants = [parse_spec(spec, i) for i, spec in enumerate(config.algorithm.variants)]
    family = "vlm" if config.model.family == "qwen_vl" else "flow"
    names = [v.name for v in variants]
    for name in set(names):
        if names.count(name) > 1:
            raise VariantError(f"algorithm.variants: {name!r} is listed {names.count(name)} times")
    for stage in EXCLUSIVE_STAGES:
        owners = [v.name for v in variants if stage in v.stages()]
        if len(owners) > 1:
            raise VariantError(f"algorithm.variants: {' and '.join(owners)} both replace the {stage!r} stage; "
                               f"choose one")
    replacing = [v.name for v in variants if "surrogate" in v.stages()]
    if replacing and config.algorithm.delta is not None:
        raise VariantError(f"algorithm.delta (two-sided clipping of the clipped surrogate) does not apply with "
                           f"{replacing[0]}, which replaces the surrogate; drop one")
    growing = [v.name for v in variants if v.trained_rows_per_sample > 1]
    if len(growing) > 1:
        raise VariantError(f"algorithm.variants: {' and '.join(growing)} both add rows to the trained batch; choose one")
    selecting = [v.name for v in variants if "select" in v.stages()]
    if growing and selecting:
        raise VariantError(f"algorithm.variants: {growing[0]} adds another role's groups to the trained batch, which "
                           f"the select stage of {', '.join(selecting)} would drop; use one or the other")
    for v in variants:
        if family not in v.families:
            raise VariantError(f"variant {v.name!r} applies to {'/'.join(v.families)} policies, not "
                               f"model.family={config.model.family}")
        if "intermediate_images" in v.needs and family != "flow":
            raise VariantError(f"variant {v.name!r} needs intermediate images (flow policies only)")
        if "intermediate_images" in v.needs and config.sampling.train_steps == "random_fraction":
            raise VariantError(f"variant {v.name!r} scores the image each trained step leads to, so its step gains "
                               f"need contiguous trained steps; sampling.train_steps=random_fraction trains a random "
                               f"subset, and each gain would include the untrained steps before it: use fraction, "
                               f"random_window or sliding_window")
        if ("masked_logps" in v.needs or "perturbed_logps" in v.needs) and family != "vlm":
            raise VariantError(f"variant {v.name!r} needs grey-canvas log-probs (VLM policies only)")
        v.check(config)
    return variants


def describe_variant(cls: type[Variant]) -> dict[str, Any]:
    """A variant's listing: name, stages, needs, families, summary, paper and options (name, default, help)."""
    options = []
    for f in dataclasses.fields(cls.Options):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        options.append({"name": f.name, "default": default, "help": f.metadata.get("help", "")})
    return {"name": cls.name, "stages": list(cls.stages()), "needs": list(cls.needs), "families": list(cls.families),
            "summary": cls.summary, "paper": cls.paper, "options": options}


def check_template(option_name: str, template: str, *placeholders: str) -> None:
    """ValueError unless ``template`` formats with exactly these named ``placeholders`` (an option's prompt text)."""
    try:
        template.format(**{name: "" for name in placeholders})
    except (KeyError, IndexError, ValueError) as exc:
        names = " and ".join(f"{{{name}}}" for name in placeholders)
        raise ValueError(f"{option_name}: only {names} may be in braces ({exc})") from None


def check_tag(option_name: str, tag: str) -> None:
    """ValueError unless ``tag`` is a tag name (``<tag>...</tag>`` in a completion)."""
    if not re.fullmatch(r"[A-Za-z_][\w-]*", tag):
        raise ValueError(f"{option_name} must be a tag name, got {tag!r}")


def option(default: Any, help: str, **kwargs: Any) -> Any:  # noqa: A002 - mirrors mmrl.config.opt
    """A variant option with its help text (shown by ``mmrl variants``). A float option must be finite unless it
    is declared with ``allow_inf=True`` (NaN never passes)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


def _literal(value: Any) -> str:
    from mmrl.config import yaml_literal

    return yaml_literal(value)


def variants_table() -> str:
    """The Markdown table of every registered variant (the README's, written by ``mmrl variants --markdown``)."""
    rows = ["| variant | stage(s) | policies | what it does | options (default) | paper |",
            "|---|---|---|---|---|---|"]
    for name in sorted(REGISTRY):
        d = describe_variant(REGISTRY[name])
        options = ", ".join(f"`{o['name']}` ({_cell(o['default'])})" for o in d["options"]) or "none"
        needs = f"; needs {', '.join(d['needs'])}" if d["needs"] else ""
        rows.append(f"| `{name}` | {', '.join(d['stages'])}{needs} | {', '.join(d['families'])} | {d['summary']} | "
                    f"{options} | {d['paper']} |")
    return "\n".join(rows)


def _cell(value: Any) -> str:
    """A default as one table cell: a string with line breaks in JSON's escaped spelling (YAML's would break the
    row), any other value as YAML writes it."""
    if isinstance(value, str) and "\n" in value:
        return json.dumps(value)
    return _literal(value)


def variants_listing() -> str:
    """The plain-text listing of ``mmrl variants``: each variant with its stages, paper and options' help."""
    lines = []
    for name in sorted(REGISTRY):
        d = describe_variant(REGISTRY[name])
        lines.append(f"{name}  [{', '.join(d['stages'])}; {'/'.join(d['families'])}"
                     + (f"; needs {', '.join(d['needs'])}" if d["needs"] else "") + "]")
        lines.append(f"    {d['summary']}")
        lines.append(f"    paper: {d['paper']}")
        for o in d["options"]:
            lines.append(f"    {o['name']}: {_literal(o['default'])}  # {o['help']}")
    return "\n".join(lines)
