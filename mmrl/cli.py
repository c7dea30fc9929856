"""``mmrl`` command line: train, eval, sft, pretrain, config, sample, tiny, rewards, serve-rewards, vllm-serve, score.

    mmrl train [CONFIG] [key=value ...]     train (no CONFIG: the embedded tiny CPU default)
    mmrl config validate CONFIG [key=value ...] [--quick | --no-check-files]   the config, then every data line
    mmrl config show [CONFIG] [key=value ...]  the resolved config; --help-fields lists every field
    mmrl sample RUN_OR_CHECKPOINT (--prompt P ... | --prompts FILE) [--seeds 0 1] [--out DIR]   image runs
    mmrl sample RUN_OR_CHECKPOINT --question Q [--question Q ...] [--image PATH ...] [--video PATH]   VLM runs
    mmrl eval CONFIG [key=value ...]          benchmarks of a checkpoint (mmrl.eval); --compare DIR ... a report
    mmrl sft CONFIG [key=value ...]           supervised fine-tuning of a Qwen-VL base (mmrl.sft)
    mmrl pretrain CONFIG [key=value ...]      flow-matching pretraining of a small SD3 base (mmrl.pretrain)
    mmrl tiny KIND OUTDIR                    tiny random model (sd3, flux, qwen2_5_vl, qwen2_vl, qwen3_vl) or
                                             synthetic data set (grounding, temporal_grounding), CPU smoke runs
    mmrl rewards                             list registered rewards
    mmrl variants [--markdown | --json]      list the algorithm variants (mmrl.algorithms) with options and papers
    mmrl serve-rewards CONFIG [--host H --port P]   serve CONFIG's rewards over HTTP (mmrl.rewards.remote)
    mmrl vllm-serve CONFIG [key=value ...] [--host H --port P]   serve CONFIG's VLM policy on vLLM for rollouts
                                             (generation.vllm_server; mmrl.pipelines.vlm.vllm_server)
    mmrl score (--config CONFIG | --rewards MAP) --images DIR [--prompts F.csv|F.jsonl] --out F.csv|F.json
                                             score a folder of images with mmrl's rewards (mmrl.score)
    mmrl doctor CONFIG [key=value ...]       porting self-check on one small batch (exit 1 when a check fails)
    mmrl bench NAME [options]                a benchmark of benchmarks/ (flow-grpo, vlm-grpo, rewards,
                                             credit-curves, overhead, prompt-sharing, vllm-rollout), side by side with its
                                             peer; one JSON line
                                             (memory: the GPU recipes' estimated peak memory and card presets)
    mmrl --version                           also: python -m mmrl ...

Options and positional arguments may come in any order (``mmrl config validate --no-check-files CONFIG``).
Every ordinary mistake (a bad config key or value, a missing file, an unreachable reward server, a model that
cannot be loaded) is one line ``mmrl: error: ...`` on stderr and exit code 2, found before any model is
loaded where possible; Ctrl-C is ``mmrl: interrupted`` (exit code 130). A training run stopped by SIGINT or
SIGTERM checkpoints and exits with 128 + the signal number. The loading and writing progress bars of
transformers and diffusers are off (downloads keep theirs); ``MMRL_VERBOSE=1`` turns them back on.

Multi-GPU: ``accelerate launch --num_processes 8 -m mmrl.cli train CONFIG`` (or ``torchrun``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

from mmrl.config import FIELDS_HEADER, ConfigError, config_to_dict, describe, load_config
from mmrl.stopping import signal_exit_code as _signal_exit_code

#: Commands that load models or libraries whose loading progress bars are silenced (see :func:`quiet_libraries`).
_LOADING_COMMANDS = ("train", "sample", "tiny", "serve-rewards", "vllm-serve", "score", "sft", "pretrain", "eval", "doctor")


class UsageError(ValueError):
    """A command-line mistake found after parsing (a flag that does not fit the run, an existing --out)."""


# ---------------------------------------------------------------------------------------------- train / config


def reward_trend(history: list[dict]) -> str:
    """``"reward A -> B"``: the mean training reward of the first and of the last ``k`` updates, ``k`` a quarter of
    the run (1 to 10), so a run whose updates draw different prompts is not judged by two single updates."""
    rewards = [h["reward/mean"] for h in history if "reward/mean" in h]
    if not rewards:
        return "no reward logged"
    k = max(1, min(10, len(rewards) // 4))
    if k == 1:
        return f"reward {rewards[0]:.4g} -> {rewards[-1]:.4g}"
    return (f"reward {sum(rewards[:k]) / k:.4g} -> {sum(rewards[-k:]) / k:.4g} (mean of the first and of the last "
            f"{k} updates)")


def _cmd_train(args) -> int:
    from mmrl.build import build_trainer, cpu_threads_default

    cpu_threads_default()
    config = load_config(args.config, args.overrides)
    trainer = build_trainer(config)
    history = trainer.train()
    stopped = getattr(trainer, "stopped_by", None)
    if stopped:  # SIGINT / SIGTERM: the trainer checkpointed and said how to continue
        return _signal_exit_code(stopped)
    if trainer.accelerator.is_main_process and not history:
        print(f"nothing to do: {config.output_dir} is already at update {trainer.update} of {config.train.steps}")
        for name, path in trainer.outputs().items():
            print(f"  {name + ':':<11} {path}")
    if trainer.accelerator.is_main_process and history:
        print(f"done: {len(history)} updates, {reward_trend(history)}; outputs in {config.output_dir}")
        held = sorted(set(trainer.eval_headlines.values()))
        for key in held:  # the headline metric of each benchmark, first -> last evaluation
            values = [h[key] for h in history if key in h]
            if not values:
                continue
            start = trainer.initial_eval.get(key, values[0])
            print(f"  {key[5:]}: {start:.4g} -> {values[-1]:.4g}")
        for name, path in trainer.outputs().items():
            print(f"  {name + ':':<11} {path}")
    return 0


def _cmd_config(args) -> int:
    if args.action == "validate" and args.help_fields:
        raise UsageError("--help-fields goes with `mmrl config show`")
    if args.action == "show" and args.help_fields:
        if args.config is None and not args.overrides:
            print(FIELDS_HEADER)
            print("\n".join(describe()))
            return 0
        config = load_config(args.config, args.overrides, check_files=not args.no_check_files)
        print(f"# {args.config or 'the embedded default (mmrl/default.yaml)'}"
              f"{' with ' + ' '.join(args.overrides) if args.overrides else ''}, resolved: every field with its "
              f"value and what it does\n# (the defaults that keys a config leaves out take: "
              f"`mmrl config show --help-fields` without a CONFIG)")
        print("\n".join(describe(values=config)))
        return 0
    if args.action == "validate" and args.config is None:
        raise UsageError("mmrl config validate: a CONFIG path is required")
    if args.quick and (args.action != "validate" or args.no_check_files):
        raise UsageError("--quick goes with `mmrl config validate` (without --no-check-files)")
    command = config_command_of(args.config)
    if command != "train":  # an `mmrl pretrain` / `mmrl sft` config: validated by its own schema
        if command == "pretrain":
            from mmrl.pretrain import load_pretrain_config

            config = load_pretrain_config(args.config, args.overrides)
        else:
            from mmrl.sft import load_sft_config

            config = load_sft_config(args.config, args.overrides, check_files=not args.no_check_files)
        if args.action == "validate":
            if command == "pretrain" and args.quick:
                raise UsageError("--quick: an `mmrl pretrain` config renders its images; it has no data lines to "
                                 "check (validate it without --quick)")
            unchecked = ", files not checked" if command == "sft" and args.no_check_files else ""
            data_lines = []
            if command == "sft" and not args.no_check_files:  # checked before "ok" is printed
                from mmrl.sft import check_sft_data

                data_lines = list(check_sft_data(config, media=not args.quick))
            print(f"{args.config}: ok (an `mmrl {command}` config{unchecked})")
            for line in data_lines:
                print(f"  data {line}")
        else:
            import yaml

            print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
        return 0
    config = load_config(args.config, args.overrides, check_files=not args.no_check_files)
    if args.action == "validate":
        if args.no_check_files:
            print(f"{args.config}: ok (files not checked)")
            return 0
        from mmrl.build import training_eval_plan

        training_eval_plan(config)  # eval.benchmarks, their options and files, as `mmrl train` checks them
        from mmrl.data.validate import check_data  # every line of the data (and its media unless --quick)

        head, _, listing = check_data(config, media=not args.quick).summary().partition("\n")
        print(f"{args.config}: ok; data: {head}")
        if listing:
            print(listing)
    else:
        import yaml

        print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
    return 0


#: Top-level keys only an `mmrl pretrain` config has, and `model` keys only an `mmrl sft` config has.
PRETRAIN_KEYS = frozenset({"image_size", "init_from", "text", "vae", "transformer"})
SFT_MODEL_KEYS = frozenset({"base", "init_seed", "hidden_size", "num_layers", "vision_depth"})


def config_command_of(path) -> str:
    """Which command a config file is for, by keys only that command's schema has: ``pretrain``, ``sft`` or
    ``train`` (also for anything unreadable: ``load_config`` then says what is wrong with it)."""
    from mmrl.config import ConfigError, read_config_file

    if path is None:
        return "train"
    try:
        _, data = read_config_file(Path(path))
    except ConfigError:
        return "train"
    if not isinstance(data, dict):
        return "train"
    if PRETRAIN_KEYS & set(data):
        return "pretrain"
    model = data.get("model")
    if isinstance(model, dict) and SFT_MODEL_KEYS & set(model):
        return "sft"
    return "train"


# ---------------------------------------------------------------------------------------------- sample


def _find_checkpoint(path: Path) -> tuple[Path, Path]:
    """``(run_dir, checkpoint_dir)`` from a run folder (latest checkpoint) or a checkpoint folder."""
    from mmrl.checkpoint import latest_checkpoint

    if not path.is_dir():
        raise UsageError(f"{path}: no such run or checkpoint folder")
    if (path / "trainable.safetensors").is_file():
        return path.parent.parent, path
    ckpt = latest_checkpoint(path / "checkpoints")
    if ckpt is None:
        raise UsageError(f"{path}: neither a checkpoint folder nor a run folder with checkpoints/")
    return path, ckpt


def _sample_out(args, run_dir: Path, ckpt: Path) -> Path:
    """The output folder, checked before any model is loaded: ``--out`` (refused when it already holds files,
    unless ``--overwrite``), else a fresh ``RUN/sampled/<checkpoint>-<n>``."""
    if args.out is not None:
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} is a file, not a folder")
        if out.is_dir() and any(out.iterdir()) and not args.overwrite:
            raise UsageError(f"--out {out} already holds files: pass --overwrite to write into it (files with the "
                             f"same names are replaced) or give another folder")
        return out
    base = run_dir / "sampled"
    taken = []
    if base.is_dir():
        for child in base.iterdir():
            stem, _, n = child.name.rpartition("-")
            if stem == ckpt.name and n.isdigit():
                taken.append(int(n))
    return base / f"{ckpt.name}-{max(taken, default=0) + 1}"


def _claim(out: Path, fresh: bool) -> Path:
    """Create the output folder; a fresh numbered one that appeared meanwhile is skipped for the next number."""
    if not fresh:
        out.mkdir(parents=True, exist_ok=True)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    stem, _, n = out.name.rpartition("-")
    number = int(n)
    while True:
        candidate = out.parent / f"{stem}-{number}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            number += 1


def _flow_inputs(args, family: str) -> tuple[list[str], list[int]]:
    vlm_flags = [flag for flag, value in (("--question", args.question), ("--image", args.image),
                                          ("--video", args.video)) if value]
    if vlm_flags:
        raise UsageError(f"{', '.join(vlm_flags)}: for vision-language runs (model.family: qwen_vl); this run is "
                         f"model.family: {family}, an image generator: give --prompt TEXT or --prompts FILE")
    prompts = list(args.prompt or [])
    if args.prompts is not None:
        from mmrl.data.prompts import read_prompts

        prompts += [item.prompt for item in read_prompts(args.prompts)]
    if not prompts:
        raise UsageError("give the prompts to draw: --prompt TEXT (repeatable) or --prompts FILE (.txt, one per "
                         "line, or .jsonl with a 'prompt' field)")
    seeds = args.seeds if args.seeds is not None else [0]
    bad = [s for s in seeds if not 0 <= s < 2**63]
    if bad:
        raise UsageError(f"--seeds: {bad[0]} is not a seed torch takes here (0 <= seed < 2**63)")
    if len(set(seeds)) < len(seeds):
        raise UsageError(f"--seeds lists a seed twice ({' '.join(map(str, seeds))}): each seed is one column and one "
                         f"p<i>_s<seed>.png")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    return prompts, seeds


def _vlm_items(args) -> list:
    """``VLMSample`` items (the class the VLM data sets use) for ``--question`` x (``--image`` ..., ``--video``)."""
    flow_flags = [flag for flag, value in (("--prompt", args.prompt), ("--prompts", args.prompts),
                                           ("--seeds", args.seeds), ("--steps", args.steps)) if value is not None]
    if flow_flags:
        raise UsageError(f"{', '.join(flow_flags)}: for image-generation runs; this run is model.family: qwen_vl "
                         f"(greedy answers are deterministic): ask with --question Q [--image PATH] [--video PATH]")
    if not args.question:
        raise UsageError("a vision-language run answers questions: give --question Q (repeatable), with --image PATH "
                         "(repeatable, shown with every question) and/or --video PATH")
    if any(not q.strip() for q in args.question):
        raise UsageError("--question must not be empty")
    from PIL import Image

    from mmrl.data.vlm import VLMSample

    images = []
    for value in args.image or []:
        path = Path(value).expanduser()
        if not path.is_file():
            raise UsageError(f"--image {value}: file not found")
        try:
            with Image.open(path) as handle:
                handle.verify()
        except Exception as exc:
            raise UsageError(f"--image {value}: not a readable image ({type(exc).__name__}: {exc})") from None
        images.append(str(path.absolute()))
    video = None
    if args.video is not None:
        path = Path(args.video).expanduser()
        if not path.is_file():
            raise UsageError(f"--video {args.video}: file not found")
        video = str(path.absolute())
    items = []
    for i, question in enumerate(args.question):
        sample_id = f"question-{i + 1}"
        items.append(VLMSample(id=sample_id, question=question, solution="", image_paths=list(images),
                               video_path=video, metadata={"task": "default", "id": sample_id},
                               source=f"--question #{i + 1}"))
    return items


def _load_weights(policy, ckpt: Path, no_ema: bool) -> None:
    from mmrl.checkpoint import CheckpointError, evaluated_weights, load_trainable

    try:
        weights, _ = evaluated_weights(ckpt, ema=not no_ema)  # the EMA weights are what the run evaluated
    except CheckpointError as exc:
        raise UsageError(exc.for_reading("sample")) from None
    try:
        load_trainable(policy.named_trainable_parameters(), weights, ckpt)
    except ValueError as exc:
        raise UsageError(f"{exc} (were the overrides changing the model or its LoRA setup?)") from None


def _cmd_sample(args) -> int:
    run_dir, ckpt = _find_checkpoint(Path(args.run))
    config = load_config(run_dir / "config.yaml", args.overrides, check_files=False)  # data files are not needed
    vlm = config.model.family == "qwen_vl"
    if vlm:
        items = _vlm_items(args)
    else:
        prompts, seeds = _flow_inputs(args, config.model.family)
    out = _sample_out(args, run_dir, ckpt)

    import torch

    from mmrl.build import build_policy

    policy = build_policy(config, device="cuda" if torch.cuda.is_available() else "cpu")
    _load_weights(policy, ckpt, args.no_ema)
    if vlm:
        policy.skip_bad_samples = False  # a question the model cannot take is an error here, never a silent skip
        answers = policy.sample_eval(items)
        out = _claim(out, fresh=args.out is None)
        with open(out / "answers.jsonl", "w", encoding="utf-8") as handle:
            for item, answer in zip(items, answers):
                row = {"question": item.question, "images": item.image_paths, "video": item.video_path,
                       "answer": answer}
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        for item, answer in zip(items, answers):
            print(f"Q: {item.question}\nA: {answer}\n")
        print(f"wrote {len(answers)} answers to {out / 'answers.jsonl'} (checkpoint {ckpt})")
        return 0
    from mmrl.tracking import make_grid_image

    images = policy.sample_eval(prompts, seeds, num_steps=args.steps)
    out = _claim(out, fresh=args.out is None)
    make_grid_image(images, rows=len(prompts)).save(out / "grid.png")
    for i, image in enumerate(images):
        prompt_i, seed_i = divmod(i, len(seeds))
        make_grid_image(image[None], rows=1).save(out / f"p{prompt_i}_s{seeds[seed_i]}.png")
    with open(out / "prompts.txt", "w", encoding="utf-8") as handle:  # row p<i> of the grid is prompt i
        handle.write("".join(f"{p}\n" for p in prompts))
    print(f"wrote {len(images)} images, grid.png and prompts.txt to {out} (checkpoint {ckpt})")
    return 0


# ---------------------------------------------------------------------------------------------- sft / pretrain


def _cmd_sft(args) -> int:
    from mmrl.sft import main as sft_main

    return sft_main(([args.config] if args.config else []) + list(args.overrides)
                    + (["--help-fields"] if args.help_fields else []))


def _cmd_pretrain(args) -> int:
    from mmrl.pretrain import main as pretrain_main

    return pretrain_main(([args.config] if args.config else []) + list(args.overrides)
                         + (["--help-fields"] if args.help_fields else []))


# ---------------------------------------------------------------------------------------------- eval


def _cmd_eval(args) -> int:
    if args.compare:  # a report of evaluations already made: no model, no config
        from mmrl.eval.report import ReportError, run_compare

        try:
            run_compare([*([args.config] if args.config is not None else []), *args.overrides])
        except ReportError as exc:
            raise UsageError(str(exc)) from None
        return 0

    from mmrl.build import cpu_threads_default
    from mmrl.eval.runner import EvalError, run_eval

    if args.config is None:
        raise UsageError("mmrl eval: a CONFIG is required (a training config, or a run folder holding config.yaml)")
    quiet_libraries()
    cpu_threads_default()
    try:
        run_eval(args.config, args.overrides)
    except EvalError as exc:
        raise UsageError(str(exc)) from None
    return 0


# ---------------------------------------------------------------------------------------------- the rest


def _cmd_tiny(args) -> int:
    from mmrl.data.synthetic import build_grounding_set, build_temporal_set
    from mmrl.pipelines.flow.tiny import build_tiny_flux, build_tiny_sd3
    from mmrl.pipelines.vlm.tiny import build_tiny_qwen2_5_vl, build_tiny_qwen2_vl, build_tiny_qwen3_vl

    builders = {"sd3": build_tiny_sd3, "flux": build_tiny_flux, "qwen2_5_vl": build_tiny_qwen2_5_vl,
                "qwen2_vl": build_tiny_qwen2_vl, "qwen3_vl": build_tiny_qwen3_vl,
                "grounding": build_grounding_set,
                "temporal_grounding": build_temporal_set}
    path = builders[args.kind](args.outdir, seed=args.seed)
    print(f"tiny {args.kind} written to {path}")
    return 0


def _cmd_rewards(args) -> int:
    from mmrl.rewards import list_rewards

    print("\n".join(list_rewards()))
    return 0


def _cmd_variants(args) -> int:
    import mmrl.algorithms  # noqa: F401 - registers the built-in variants
    from mmrl.algorithms.base import REGISTRY, describe_variant, variants_listing, variants_table

    if args.json:
        print(json.dumps([describe_variant(REGISTRY[n]) for n in sorted(REGISTRY)], indent=1, default=str))
    else:
        print(variants_table() if args.markdown else variants_listing())
    return 0


def _cmd_serve_rewards(args) -> int:
    from mmrl.rewards import build_rewards
    from mmrl.rewards.remote import RewardServerError, load_reward_spec, serve

    try:
        reward = build_rewards(load_reward_spec(args.config, args.rewards))
        serve(reward, args.host, args.port, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
              max_queue=args.max_queue, max_request_mb=args.max_request_mb, log_level=args.log_level)
    except (ValueError, TypeError, RewardServerError) as exc:
        _print_error(exc)
        return 2
    return 0


def _cmd_vllm_serve(args) -> int:
    from mmrl.build import build_vllm_engine
    from mmrl.pipelines.vlm.qwen import resolve_vlm_pretrained
    from mmrl.pipelines.vlm.vllm_server import VLLMServerError, serve_vllm

    config = load_config(args.config, args.overrides)
    if config.model.family != "qwen_vl":
        raise ConfigError(f"mmrl vllm-serve serves a vision-language policy (model.family: qwen_vl); "
                          f"{args.config} has model.family: {config.model.family}")
    g = config.generation
    engine = build_vllm_engine(config)
    try:
        serve_vllm(engine, host=args.host, port=args.port, model=resolve_vlm_pretrained(config.model.pretrained),
                   dtype=config.model.dtype, max_model_len=g.max_prompt_length + g.max_new_tokens)
    except VLLMServerError as exc:
        _print_error(exc)
        return 2
    return 0


def _cmd_score(args) -> int:
    from mmrl.score import run_score

    if (args.config is None) == (args.rewards is None):
        raise UsageError("mmrl score: give exactly one of --config CONFIG or --rewards MAPPING")
    run_score(args.config, args.rewards, args.images, args.prompts, args.out, batch_size=args.batch_size,
              workers=args.workers, recursive=args.recursive, quiet=args.quiet)
    return 0


# ---------------------------------------------------------------------------------------------- parsing


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line ``mmrl: error: ...``; ``intermixed`` parsers accept options between and after
    positional arguments (``mmrl config validate --no-check-files CONFIG key=value``)."""

    intermixed = False
    _parsing = False

    def parse_known_args(self, args=None, namespace=None):
        if self.intermixed and not self._parsing:
            self._parsing = True  # parse_known_intermixed_args calls back into parse_known_args (Python < 3.12)
            try:
                return self.parse_known_intermixed_args(args, namespace)
            finally:
                self._parsing = False
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        self.exit(2, f"mmrl: error: {self.prog.removeprefix('mmrl ')}: {message} (see `{self.prog} --help`)\n"
                  if self.prog != "mmrl" else f"mmrl: error: {message} (see `mmrl --help`)\n")


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("mmrl-align")
    except metadata.PackageNotFoundError:
        from mmrl import __version__

        return __version__


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mmrl", description="Group-relative RL alignment of multimodal models.")
    parser.add_argument("--version", action="version", version=f"mmrl {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def command(name: str, help: str, **kwargs) -> _Parser:
        p = sub.add_parser(name, help=help, description=help, **kwargs)
        p.intermixed = True
        return p

    train = command("train", "train a policy")
    train.add_argument("config", nargs="?", help="YAML config (default: the embedded tiny CPU run)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=4")
    train.set_defaults(func=_cmd_train)

    cfg = command("config", "validate or show a config")
    cfg.add_argument("action", choices=("validate", "show"))
    cfg.add_argument("config", nargs="?", help="YAML config (show: default the embedded tiny CPU run)")
    cfg.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=4")
    cfg.add_argument("--help-fields", action="store_true",
                     help="show: every field with its default (the SD3.5-Medium / Flow-GRPO settings that keys a "
                          "config leaves out take) and its help; with a CONFIG, that config's values")
    cfg.add_argument("--no-check-files", action="store_true",
                     help="skip what depends on this machine: that data files and the resume checkpoint exist, "
                          "that wandb is installed, the data check (validate a recipe on another machine)")
    cfg.add_argument("--quick", action="store_true",
                     help="validate: check every data line and that its media files exist, without decoding them "
                          "(default: decode every image and the video frames training reads)")
    cfg.set_defaults(func=_cmd_config)

    sample = command("sample", "images (image runs) or answers (VLM runs) from a checkpoint",
                     epilog="Output: without --out a fresh folder RUN/sampled/<checkpoint>-<n> (n = 1, 2, ...: a new "
                            "call never overwrites an earlier one); --out DIR must be empty or new unless "
                            "--overwrite. Image runs write grid.png (prompts x seeds), p<i>_s<seed>.png and "
                            "prompts.txt; VLM runs write answers.jsonl and print the answers.")
    sample.add_argument("run", help="run folder (uses its latest checkpoint) or checkpoint folder")
    sample.add_argument("overrides", nargs="*", help="dotted overrides of the run's config.yaml")
    image = sample.add_argument_group("image runs (deterministic ODE sampling)")
    image.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    image.add_argument("--prompts", default=None, metavar="FILE",
                       help=".txt (one prompt per line) or .jsonl (a 'prompt' field); after any --prompt")
    image.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds, the grid's columns (default: 0)")
    image.add_argument("--steps", type=int, default=None, help="ODE steps (default: sampling.eval_num_steps)")
    vlm = sample.add_argument_group("vision-language runs (greedy answers)")
    vlm.add_argument("--question", action="append", default=None, help="a question (repeatable)")
    vlm.add_argument("--image", action="append", default=None, metavar="PATH",
                     help="an image shown with every question (repeatable: several images per question)")
    vlm.add_argument("--video", default=None, metavar="PATH", help="a video shown with every question")
    sample.add_argument("--out", default=None, help="output folder (default: a fresh RUN/sampled/<checkpoint>-<n>)")
    sample.add_argument("--overwrite", action="store_true", help="write into an --out folder that holds files")
    sample.add_argument("--no-ema", action="store_true", help="use the live weights even if the run kept an EMA")
    sample.set_defaults(func=_cmd_sample)

    ev = command("eval", "evaluate a policy on benchmarks (image generators: ocr, geneval, t2i_compbench, dpg_bench, "
                         "hpsv2, reward:NAME[@SET], fid, diversity; vision-language policies: rec, multi_object, "
                         "temporal_grounding, charades_sta, multiple_choice, numeric, vsi_bench), or --compare evaluations "
                         "already made",
                 epilog="Image generators: checkpoint=PATH|base, benchmarks=[ocr,geneval,t2i_compbench[:CAT+CAT],"
                        "dpg_bench,hpsv2[:STYLE],reward:NAME[+NAME][@SET],fid[@SET],diversity[@SET]], output_dir=DIR, "
                        "limit=N, images_per_prompt=K, seed=S, num_steps=T, resolution=R, guidance=G, prompts=FILE, "
                        "detector=DIR, clip_model=DIR, reward_kwargs={NAME: {...}}, ema=BOOL, progress=BOOL; the "
                        "benchmarks' own keys: t2i_split, blip_model, blip_checkpoint, blip_image_size, np_num, noun_phrases, "
                        "spacy_model, t2i_detector, t2i_detector_threshold, t2i_clip_model, t2i_clip_dtype, official_quirks "
                        "(T2I-CompBench, DPG-Bench), dpg_csv, dpg_vqa_model, dpg_grids, hpsv2_prompts, hps_model, "
                        "hps_version, hpsv2_jpeg, reference_images, inception, fid_mode, kid_subsets, "
                        "kid_subset_size, diversity_model, diversity_distance. "
                        "Vision-language policies (model.family qwen_vl): checkpoint, benchmarks=[rec,multi_object,"
                        "temporal_grounding,charades_sta,multiple_choice,numeric,vsi_bench], data=FILE, video_dir=DIR, "
                        "batch_size=N, greedy=BOOL, seed=S, max_new_tokens=N, blind=BOOL, coord_format, "
                        "require_tags=BOOL, tg_convention=2d_tan|timezero|time_r1, rec_convention=mmrl|vlm_r1, output_dir, "
                        "limit, ema, progress. "
                        "Dotted keys override the config. Writes samples.jsonl, protocol.json, summary.json, "
                        "report.html (+ images/ and grids/ for generators) to output_dir (default "
                        "RUN/eval/<checkpoint>); an existing output_dir is resumed. "
                        "Compare: mmrl eval --compare DIR_A DIR_B ... [output_dir=DIR] [labels=[a,b,...]] writes "
                        "a side-by-side report.html (+ report_files/) of evaluations already made, DIR_A the "
                        "reference; a DIR is an evaluation folder (summary.json) or a run folder (its eval/step_N "
                        "with the largest N, else its only eval/*/summary.json); default output_dir "
                        "compare/<label>_vs_<label>... in the current folder. See the README's Evaluation section.")
    ev.add_argument("config", nargs="?", help="training config (YAML), or a run folder holding config.yaml; with "
                                              "--compare: the first (reference) evaluation or run folder")
    ev.add_argument("overrides", nargs="*", help="eval keys (checkpoint=base, benchmarks=[ocr], limit=8, ...) and "
                                                 "dotted config overrides; with --compare: the other folders and "
                                                 "output_dir=, labels=")
    ev.add_argument("--compare", action="store_true",
                    help="no evaluation: write a side-by-side report.html of the given evaluation (or evaluated "
                         "run) folders, the first the reference column")
    ev.set_defaults(func=_cmd_eval)

    sft = command("sft", "supervised fine-tuning of a Qwen-VL model on <think>/<answer> targets (a base for GRPO)")
    sft.add_argument("config", nargs="?", help="SFT YAML config (e.g. configs/shapes/sft_qwen_vl.yaml)")
    sft.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20")
    sft.add_argument("--help-fields", action="store_true", help="every field with its default and help")
    sft.set_defaults(func=_cmd_sft)

    pre = command("pretrain", "flow-matching pretraining of a small SD3 text-to-image model on ShapeWorld (a base "
                              "for GRPO)")
    pre.add_argument("config", nargs="?", help="pretraining YAML (e.g. configs/shapes/pretrain_sd3.yaml)")
    pre.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    pre.add_argument("--help-fields", action="store_true", help="every field with its default and help")
    pre.set_defaults(func=_cmd_pretrain)

    tiny = command("tiny", "build a tiny random model or a synthetic data set")
    tiny.add_argument("kind", choices=("sd3", "flux", "qwen2_5_vl", "qwen2_vl", "qwen3_vl", "grounding",
                                       "temporal_grounding"))
    tiny.add_argument("outdir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_tiny)

    variants = command("variants", "list the algorithm variants (plug-ins) with their stages, options and papers")
    variants.add_argument("--markdown", action="store_true", help="the README's table")
    variants.add_argument("--json", action="store_true", help="one JSON list")
    variants.set_defaults(func=_cmd_variants)

    rewards = command("rewards", "list registered rewards")
    rewards.set_defaults(func=_cmd_rewards)

    serve_rw = command("serve-rewards", "serve a config's rewards over HTTP (batched; POST /score, GET /health)")
    serve_rw.add_argument("config", nargs="?", default=None, help="YAML config whose `rewards:` mapping is served")
    serve_rw.add_argument("--rewards", default=None, help="inline rewards mapping instead of a config, "
                                                         "e.g. '{pickscore: {kwargs: {device: cuda}}}'")
    serve_rw.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    serve_rw.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed at start)")
    serve_rw.add_argument("--max-batch", type=int, default=64, help="most samples merged into one reward call")
    serve_rw.add_argument("--max-wait-ms", type=float, default=5.0,
                          help="how long the first request waits for others to merge with")
    serve_rw.add_argument("--max-queue", type=int, default=1024, help="queued requests before 503 answers")
    serve_rw.add_argument("--max-request-mb", type=float, default=512.0, help="largest request body (MiB)")
    serve_rw.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    serve_rw.set_defaults(func=_cmd_serve_rewards)

    vserve = command("vllm-serve", "serve CONFIG's policy on vLLM for rollouts in server mode "
                                   "(generation.vllm_server: URL in the training config; GET /health, POST /push, "
                                   "POST /generate)")
    vserve.add_argument("config", help="the training config (model, dtype, lengths, generation.vllm options)")
    vserve.add_argument("overrides", nargs="*", help="dotted overrides, e.g. generation.vllm={enforce_eager: true}")
    vserve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    vserve.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed at start)")
    vserve.set_defaults(func=_cmd_vllm_serve)

    doctor = command("doctor", "porting self-check on one small batch of CONFIG's policy: ratio 1 on-policy, replayed "
                               "= sampled log-probs, reference = base, SDE at noise 0 = ODE, exported weights reload, "
                               "finite rewards; exit 1 when a check fails")
    doctor.add_argument("config", help="YAML config")
    doctor.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.dtype=bfloat16")
    doctor.set_defaults(func=_cmd_doctor)

    bench = command("bench", f"a benchmark side by side with its peer ({', '.join(BENCHES)}); one JSON line",
                    add_help=False)
    bench.add_argument("name", nargs="?", help="; `mmrl bench NAME --help` for its options")

    score = command("score", "score a folder of images with mmrl's rewards (no training)")
    score.add_argument("--config", default=None, help="YAML config whose `rewards:` mapping is used")
    score.add_argument("--rewards", default=None, help="inline rewards mapping, e.g. '{jpeg_compressibility: 1}'")
    score.add_argument("--images", required=True, help="folder of images (prompts-file paths are relative to it)")
    score.add_argument("--prompts", default=None, help=".csv (columns image,prompt) or .jsonl (image, prompt, "
                                                      "metadata fields); default: every image, no prompt")
    score.add_argument("--out", required=True, help="output .csv, .json or .jsonl")
    score.add_argument("--batch-size", type=int, default=32, help="images per reward call")
    score.add_argument("--workers", type=int, default=4, help="image-decoding threads")
    score.add_argument("--recursive", action="store_true", help="without --prompts: include sub-folders")
    score.add_argument("--quiet", action="store_true", help="no progress or summary on the terminal")
    score.set_defaults(func=_cmd_score)
    return parser


# ---------------------------------------------------------------------------------------------- doctor


def _cmd_doctor(args) -> int:
    from mmrl.doctor import format_checks, run_doctor

    config = load_config(args.config, args.overrides)
    print(f"mmrl doctor: {args.config} ({config.model.family} {config.model.pretrained}, {config.model.dtype}, "
          f"{'LoRA' if config.model.use_lora else 'full fine-tuning'}), one batch of 2 prompts x 2 samples", flush=True)
    checks = run_doctor(config)
    print(format_checks(checks))
    failed = [c.name for c in checks if not c.ok]
    print(f"{len(checks) - len(failed)} of {len(checks)} checks passed" + (f"; failed: {', '.join(failed)}"
                                                                          if failed else ""))
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------- bench

#: ``mmrl bench NAME`` -> the script in the repository's benchmarks/ folder.
BENCHES = {"flow-grpo": "flow_grpo_bench.py", "vlm-grpo": "vlm_grpo_vs_trl.py", "rewards": "reward_throughput.py",
           "credit-curves": "credit_curves.py", "overhead": "overhead.py", "memory": "memory_estimate.py",
           "prompt-sharing": "prompt_sharing.py", "vllm-rollout": "vllm_rollout.py"}


def benchmarks_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "benchmarks"


def _cmd_bench(argv: list[str]) -> int:
    """``mmrl bench NAME [options]``: runs ``benchmarks/<script>`` with the options (``--help`` for its own) in a
    fresh interpreter, so its threads and its peer's imports stay out of this process; exit code = the script's."""
    import subprocess

    names = ", ".join(BENCHES)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: mmrl bench NAME [options]\n\nNAME: {names}. `mmrl bench NAME --help` lists NAME's options. "
              f"Each compares mmrl with its peer in one run and prints one JSON line (and writes its results under "
              f"benchmarks/results/).")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHES:
        import difflib

        close = difflib.get_close_matches(name, list(BENCHES), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else f"; one of {names}"
        print(f"mmrl: error: unknown benchmark {name!r}{hint}", file=sys.stderr, flush=True)
        return 2
    script = benchmarks_dir() / BENCHES[name]
    if not script.is_file():
        print(f"mmrl: error: {script} not found: mmrl bench runs the scripts of a source checkout's benchmarks/ "
              f"folder (git clone ... && pip install -e .)", file=sys.stderr, flush=True)
        return 2
    return subprocess.call([sys.executable, str(script), *rest])


# ---------------------------------------------------------------------------------------------- entry


def config_command(args: list[str] | None, *, prog: str, description: str, config_class: type, config_help: str,
                   overrides_help: str, fields_help: str, missing_config: str,
                   errors: Callable[[], tuple[type[BaseException], ...]], run: Callable[[str, list[str]], int]) -> int:
    """The entry of a ``CONFIG [key=value ...]`` command (``mmrl sft``, ``mmrl pretrain``): the arguments (in any
    order), ``--help-fields`` (every field of ``config_class`` with its default and help), no CONFIG: the line
    ``mmrl: error: <missing_config>`` and exit code 2. Then :func:`quiet_libraries` and ``run(config, overrides)``,
    whose return value is the exit code (128 + the signal's number for a run a signal stopped,
    :func:`mmrl.stopping.signal_exit_code`); an exception of ``errors()`` (imported only when a run starts) is one
    line ``mmrl: error: ...`` and exit code 2."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("config", nargs="?", help=config_help)
    parser.add_argument("overrides", nargs="*", help=overrides_help)
    parser.add_argument("--help-fields", action="store_true", help=fields_help)
    try:
        ns = parser.parse_intermixed_args(args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if ns.help_fields:
        print("\n".join(describe(config_class)))
        return 0
    if ns.config is None:
        print(f"mmrl: error: {missing_config}", file=sys.stderr, flush=True)
        return 2
    expected = tuple(errors())
    quiet_libraries()  # no "Loading weights" / "Writing model shards" bars
    try:
        return run(ns.config, ns.overrides)
    except expected as exc:
        print(f"mmrl: error: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        return 2


def quiet_libraries() -> None:
    """Turn off transformers' and diffusers' loading / writing progress bars ("Loading weights", "Loading pipeline
    components", "Writing model shards"), unless ``MMRL_VERBOSE=1``. Hub downloads keep their bars (they show
    real progress over the network), and so does mmrl's own training bar."""
    if os.environ.get("MMRL_VERBOSE", "").strip().lower() in ("1", "true", "yes", "on"):
        return
    import warnings

    # PEFT's get_peft_model reads transformers 5's deprecated `is_gradient_checkpointing`: nothing the user can act on
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    try:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # also turns huggingface_hub's off: turned back on below
    except ImportError:
        pass
    try:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

        if are_progress_bars_disabled() and not os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"):
            enable_progress_bars()
    except ImportError:
        pass


def _ordinary_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are a user's mistake or the environment's, printed as one line (imported only when one
    has been raised)."""
    from mmrl.checkpoint import CheckpointError, CheckpointWriteError
    from mmrl.data.prompts import DataError
    from mmrl.eval.runner import EvalError
    from mmrl.pipelines.flow.loading import ModelLoadError
    from mmrl.rewards.remote import RewardServerError
    from mmrl.score import ScoreError

    # EvalError: also from `mmrl train`, when an in-training benchmark's scorer cannot be built (weights not there)
    return (ConfigError, UsageError, DataError, EvalError, ModelLoadError, RewardServerError, ScoreError,
            CheckpointError, CheckpointWriteError, FileNotFoundError, PermissionError, NotADirectoryError,
            IsADirectoryError)


def _print_error(exc: BaseException) -> None:
    """``mmrl: error: <message>`` on one line; a message that lists problems on indented lines after its first
    (``mmrl config validate``'s data check) keeps that listing below it."""
    head, *rest = str(exc).strip().splitlines() or [""]
    listing = [line for line in rest if line.strip()]
    if listing and all(line.startswith("  ") for line in listing):
        print(f"mmrl: error: {head.strip()}\n" + "\n".join(listing), file=sys.stderr, flush=True)
        return
    print(f"mmrl: error: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the script parses its own options
        return _cmd_bench(argv[1:])
    try:
        try:
            args = make_parser().parse_args(argv)
        except SystemExit as exc:  # --help, --version, usage errors (already printed)
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        # `mmrl train key=value` without a config: argparse puts the first override in `config`
        if getattr(args, "config", None) and "=" in args.config and not Path(args.config).exists():
            args.overrides = [args.config, *args.overrides]
            args.config = None
        if args.command in _LOADING_COMMANDS:
            quiet_libraries()
        try:
            return args.func(args)
        except Exception as exc:
            if not isinstance(exc, _ordinary_errors()):
                raise
            _print_error(exc)
            return 2
    except KeyboardInterrupt:  # a Ctrl-C outside the trainer's own handling (e.g. while a model loads)
        print("mmrl: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
