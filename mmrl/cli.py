"""``mmrl`` command line: train, config, sample, tiny, rewards.

    mmrl train [CONFIG] [key=value ...]     train (no CONFIG: the embedded tiny CPU default)
    mmrl config validate CONFIG [key=value ...]
    mmrl config show [CONFIG] [key=value ...]  the resolved config; --help-fields lists every field
    mmrl sample RUN_OR_CHECKPOINT --prompt P [--prompt P ...] [--seeds 0 1] [--out DIR]
    mmrl tiny KIND OUTDIR                    tiny random model (sd3, flux, qwen2_5_vl, qwen2_vl, qwen3_vl) or
                                             synthetic data set (grounding, temporal_grounding), CPU smoke runs
    mmrl rewards                             list registered rewards
    mmrl serve-rewards CONFIG [--host H --port P]   serve CONFIG's rewards over HTTP (mmrl.rewards.remote)
    mmrl score (--config CONFIG | --rewards MAP) --images DIR [--prompts F.csv|F.jsonl] --out F.csv|F.json
                                             score a folder of images with mmrl's rewards (mmrl.score)

Multi-GPU: ``accelerate launch --num_processes 8 -m mmrl.cli train CONFIG`` (or ``torchrun``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from mmrl.config import ConfigError, config_to_dict, describe, load_config


def _cmd_train(args) -> int:
    from mmrl.build import build_trainer, cpu_threads_default

    cpu_threads_default()
    config = load_config(args.config, args.overrides)
    trainer = build_trainer(config)
    history = trainer.train()
    if trainer.accelerator.is_main_process and not history:
        print(f"nothing to do: {config.output_dir} is already at update {trainer.update} of {config.train.steps}")
    if trainer.accelerator.is_main_process and history:
        first, last = history[0], history[-1]
        print(f"done: {len(history)} updates, reward {first['reward/mean']:.4g} -> {last['reward/mean']:.4g}; "
              f"outputs in {config.output_dir}")
    return 0


def _cmd_config(args) -> int:
    if args.action == "show" and args.help_fields:
        print("\n".join(describe()))
        return 0
    if args.action == "validate" and args.config is None:
        print("mmrl config validate: a CONFIG path is required", file=sys.stderr)
        return 2
    config = load_config(args.config, args.overrides, check_files=not args.no_check_files)
    if args.action == "validate":
        print(f"{args.config}: ok")
    else:
        print(yaml.safe_dump(config_to_dict(config), sort_keys=False), end="")
    return 0


def _find_checkpoint(path: Path) -> tuple[Path, Path]:
    """``(run_dir, checkpoint_dir)`` from a run folder (latest checkpoint) or a checkpoint folder."""
    from mmrl.checkpoint import latest_checkpoint

    if (path / "trainable.safetensors").is_file():
        return path.parent.parent, path
    ckpt = latest_checkpoint(path / "checkpoints")
    if ckpt is None:
        raise FileNotFoundError(f"{path}: neither a checkpoint folder nor a run folder with checkpoints/")
    return path, ckpt


def _cmd_sample(args) -> int:
    import torch
    from safetensors.torch import load_file

    from mmrl.build import build_policy
    from mmrl.tracking import make_grid_image

    run_dir, ckpt = _find_checkpoint(Path(args.run))
    config = load_config(run_dir / "config.yaml", args.overrides)
    policy = build_policy(config, device="cuda" if torch.cuda.is_available() else "cpu")
    weights = load_file(str(ckpt / "trainable.safetensors"))
    if (ckpt / "ema.pt").is_file() and not args.no_ema:  # the EMA weights are what the run evaluated
        weights = torch.load(ckpt / "ema.pt", map_location="cpu", weights_only=False)["shadow"]
    with torch.no_grad():
        for name, param in policy.named_trainable_parameters().items():
            param.copy_(weights[name])
    out = Path(args.out or run_dir / "sampled")
    out.mkdir(parents=True, exist_ok=True)
    images = policy.sample_eval(args.prompt, args.seeds, num_steps=args.steps)
    grid = make_grid_image(images, rows=len(args.prompt))
    grid.save(out / "grid.png")
    for i, image in enumerate(images):
        prompt_i, seed_i = divmod(i, len(args.seeds))
        make_grid_image(image[None], rows=1).save(out / f"p{prompt_i}_s{args.seeds[seed_i]}.png")
    print(f"wrote {len(images)} images and grid.png to {out} (checkpoint {ckpt})")
    return 0


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


def _cmd_serve_rewards(args) -> int:
    from mmrl.rewards import build_rewards
    from mmrl.rewards.remote import RewardServerError, load_reward_spec, serve

    try:
        reward = build_rewards(load_reward_spec(args.config, args.rewards))
        serve(reward, args.host, args.port, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
              max_queue=args.max_queue, max_request_mb=args.max_request_mb, log_level=args.log_level)
    except (ValueError, TypeError, RewardServerError) as exc:
        print(f"mmrl: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_score(args) -> int:
    from mmrl.rewards.remote import RewardServerError
    from mmrl.score import ScoreError, run_score

    if (args.config is None) == (args.rewards is None):
        print("mmrl score: give exactly one of --config CONFIG or --rewards MAPPING", file=sys.stderr)
        return 2
    try:
        run_score(args.config, args.rewards, args.images, args.prompts, args.out, batch_size=args.batch_size,
                  workers=args.workers, recursive=args.recursive, quiet=args.quiet)
    except (ScoreError, RewardServerError) as exc:
        print(f"mmrl: error: {exc}", file=sys.stderr)
        return 2
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmrl", description="Group-relative RL alignment of multimodal models.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a policy")
    train.add_argument("config", nargs="?", help="YAML config (default: the embedded tiny CPU run)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=4")
    train.set_defaults(func=_cmd_train)

    cfg = sub.add_parser("config", help="validate or show a config")
    cfg.add_argument("action", choices=("validate", "show"))
    cfg.add_argument("config", nargs="?")
    cfg.add_argument("overrides", nargs="*")
    cfg.add_argument("--help-fields", action="store_true", help="list every field with its default and help")
    cfg.add_argument("--no-check-files", action="store_true",
                     help="skip checking that data files exist (validate a recipe on another machine)")
    cfg.set_defaults(func=_cmd_config)

    sample = sub.add_parser("sample", help="images from a checkpoint (deterministic ODE sampling)")
    sample.add_argument("run", help="run folder (uses its latest checkpoint) or checkpoint folder")
    sample.add_argument("--prompt", action="append", required=True)
    sample.add_argument("--seeds", type=int, nargs="+", default=[0])
    sample.add_argument("--steps", type=int, default=None, help="ODE steps (default: sampling.eval_num_steps)")
    sample.add_argument("--out", default=None)
    sample.add_argument("--no-ema", action="store_true", help="use the live weights even if the run kept an EMA")
    sample.add_argument("overrides", nargs="*")
    sample.set_defaults(func=_cmd_sample)

    tiny = sub.add_parser("tiny", help="build a tiny random model or a synthetic data set")
    tiny.add_argument("kind", choices=("sd3", "flux", "qwen2_5_vl", "qwen2_vl", "qwen3_vl", "grounding",
                                              "temporal_grounding"))
    tiny.add_argument("outdir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_tiny)

    rewards = sub.add_parser("rewards", help="list registered rewards")
    rewards.set_defaults(func=_cmd_rewards)

    serve_rw = sub.add_parser("serve-rewards", help="serve a config's rewards over HTTP (batched; POST /score)")
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

    score = sub.add_parser("score", help="score a folder of images with mmrl's rewards (no training)")
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


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    # `mmrl train key=value` without a config: argparse puts the first override in `config`
    if getattr(args, "config", None) and "=" in args.config and not Path(args.config).exists():
        args.overrides = [args.config, *args.overrides]
        args.config = None
    from mmrl.data.prompts import DataError
    from mmrl.pipelines.flow.loading import ModelLoadError

    try:
        return args.func(args)
    except (ConfigError, DataError, ModelLoadError, FileNotFoundError) as exc:
        print(f"mmrl: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
