"""The one training loop: rollout -> score -> advantages -> inner epochs -> log / eval / save.

It knows nothing model-specific. A policy provides ``rollout(items, group_size, ...)`` returning
``outputs`` (what the rewards judge: images, completions), ``old_logps [N, T]`` (or ``None``: then the loop
computes them before the first update, in the first inner epoch's minibatch layout, so the first ratio is
exactly 1), ``mask [N, T]``, ``prompts``, ``metadata`` and ``group_ids``;
``logprobs(rollout, index, steps, with_kl)`` under current parameters; ``trainable_parameters()``;
``named_trainable_parameters()``; ``prepare(accelerator)``; ``export(dir)``; ``sample_eval(prompts, seeds)``.
A reward is ``reward(images, prompts, metadata) -> {name: [N], ..., "total": [N]}`` with ``weights``
naming the components that enter the advantage (:class:`mmrl.rewards.ComposedReward`). Everything algorithmic comes from :mod:`mmrl.core` by name.

Every random draw of update ``k`` comes from a generator seeded by ``(seed, k, process)``, and every
piece of loop state is in the checkpoint, so ``2 steps + resume + 2 steps`` equals ``4 steps``.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from mmrl.checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from mmrl.config import Config, ConfigError, config_to_dict, dump_config
from mmrl.core.advantages import PerPromptStatTracker, combine_rewards
from mmrl.core.credit import (
    cosine_similarity_credit,
    step_gain_credit,
    turning_point_credit,
    value_anchored_advantages,
)
from mmrl.core.losses import policy_loss
from mmrl.core.noise import adapt_noise_levels
from mmrl.core.variants import (
    evidence_weighted_advantages,
    select_informative_groups,
    temporal_contrast_rewards,
    token_weighted_advantages,
)
from mmrl.data.prompts import PromptSource
from mmrl.tracking import MetricsLogger, make_grid_image


def _update_seed(seed: int, update: int, rank: int) -> int:
    return (seed * 1_000_003 + update * 7_919 + rank * 104_729) % (2**63 - 1)


def build_lr_scheduler(optimizer, name: str, warmup: int, total: int):
    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        if name == "linear":
            return max(0.0, 1.0 - progress)
        if name == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class EMA:
    """Exponential moving average of the trainable weights (Flow-GRPO's optional EMA)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], decay: float):
        self.decay = decay
        self.shadow = {k: p.detach().clone() for k, p in params.items()}

    @torch.no_grad()
    def update(self, params: dict[str, torch.nn.Parameter]) -> None:
        for k, p in params.items():
            self.shadow[k].lerp_(p.detach(), 1.0 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay = state["decay"]
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}


class Trainer:
    def __init__(self, config: Config, policy, reward_fn, prompts: PromptSource, accelerator: Accelerator,
                 scorer=None):
        """``scorer``: optional background scorer (``submit(images, prompts, metadata) -> Future``) that the loop
        feeds chunk by chunk during flow rollouts, overlapping scoring with sampling."""
        self.config = config
        self.policy = policy
        self.reward_fn = reward_fn
        self.prompts = prompts
        self.accelerator = accelerator
        self.output_dir = Path(config.output_dir)
        a, o = config.algorithm, config.optim
        self.estimator_kwargs = dict(estimator=a.advantage)
        if a.advantage == "grpo":
            self.estimator_kwargs.update(scale=a.scale, eps=a.eps, std_ddof=a.std_ddof, clamp=a.advantage_clamp)
        self.tracker = PerPromptStatTracker(**self.estimator_kwargs)
        params = policy.trainable_parameters()
        if not params:
            raise ValueError("the policy has no trainable parameters")
        self.optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay,
                                           eps=o.adam_eps)
        micro_per_update = config.train.inner_epochs * self._micro_batches_per_epoch()
        total_optimizer_steps = config.train.steps * max(1, micro_per_update // self._micro_per_optimizer_step())
        self.lr_scheduler = build_lr_scheduler(self.optimizer, o.lr_scheduler, o.warmup_steps, total_optimizer_steps)
        policy.prepare(accelerator)
        self.optimizer = accelerator.prepare(self.optimizer)
        self.ema = EMA(policy.named_trainable_parameters(), o.ema_decay) if o.ema else None
        self.base_noise_levels = getattr(policy, "step_noise_levels", torch.zeros(0)).clone()
        self.value_anchor: dict[str, float] = {}  # VGPO anchors: running mean reward per prompt
        self.scorer = scorer
        self.update = 0  # completed updates
        self.optimizer_steps = 0

    # ------------------------------------------------------------------------------------------ sizes

    def _micro_batches_per_epoch(self) -> int:
        c = self.config
        return (c.data.prompts_per_step * c.data.group_size) // c.train.batch_size

    def _micro_per_optimizer_step(self) -> int:
        return self.config.train.gradient_accumulation_steps

    # ------------------------------------------------------------------------------------- checkpoints

    def save(self) -> None:
        acc = self.accelerator
        acc.wait_for_everyone()
        if acc.is_main_process:
            objects = {"optimizer": self.optimizer.state_dict(), "lr_scheduler": self.lr_scheduler.state_dict(),
                       "rng": rng_state()}
            if self.ema is not None:
                objects["ema"] = self.ema.state_dict()
            state = {"update": self.update, "optimizer_steps": self.optimizer_steps,
                     "data": self.prompts.state_dict(), "tracker": self.tracker.state_dict()}
            if self.value_anchor:
                state["value_anchor"] = self.value_anchor
            if hasattr(self.policy, "step_noise_levels"):
                state["noise_levels"] = self.policy.step_noise_levels.tolist()
            save_checkpoint(self.output_dir / "checkpoints", self.update,
                            trainable=self.policy.named_trainable_parameters(), state=state, objects=objects,
                            export=self._export, keep_last=self.config.logging.keep_last)
        acc.wait_for_everyone()

    def resume(self, target: str) -> int | None:
        """Load ``target`` ('auto' = the latest complete checkpoint in output_dir, if any). Returns its update."""
        path = latest_checkpoint(self.output_dir / "checkpoints") if target == "auto" else Path(target)
        if path is None:
            return None
        trainable, state, objects = load_checkpoint(path)
        params = self.policy.named_trainable_parameters()
        missing = set(params) - set(trainable)
        if missing:
            raise ValueError(f"checkpoint {path} lacks {len(missing)} trainable tensors (e.g. {sorted(missing)[0]}): "
                             f"was it written with another model or LoRA setup?")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(trainable[name])
        self.optimizer.load_state_dict(objects["optimizer"])
        self.lr_scheduler.load_state_dict(objects["lr_scheduler"])
        if self.ema is not None and "ema" in objects:
            self.ema.load_state_dict(objects["ema"])
        set_rng_state(objects["rng"])
        self.update = state["update"]
        self.optimizer_steps = state["optimizer_steps"]
        self.prompts.load_state_dict(state["data"])
        self.tracker.load_state_dict(state["tracker"])
        self.value_anchor = dict(state.get("value_anchor", {}))
        if "noise_levels" in state:
            self.policy.step_noise_levels = torch.tensor(state["noise_levels"])
        return self.update

    # ------------------------------------------------------------------------------------------- steps

    def _score(self, rollout) -> dict[str, torch.Tensor]:
        batch = self.config.train.reward_batch_size
        parts: list[dict[str, torch.Tensor]] = []
        for start in range(0, len(rollout), batch):
            end = start + batch
            parts.append(self.reward_fn(rollout.outputs[start:end], rollout.prompts[start:end],
                                        rollout.metadata[start:end]))
            self._count_reward_info(getattr(self.reward_fn, "last_info", {}))
        return {k: torch.cat([p[k].float().cpu() for p in parts]) for k in parts[0]}

    def _count_reward_info(self, info: dict) -> None:
        """Unparseable outputs (scored 0) and unjudgeable samples (NaN), counted per reward component."""
        for name, component in (info or {}).get("components", {}).items():
            for key in ("num_unparseable", "num_nan"):
                if component.get(key):
                    tag = f"reward_info/{name}/{key}"
                    self.reward_counts[tag] = self.reward_counts.get(tag, 0.0) + float(component[key])

    def _advantages(self, rollout, scores: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """Gather rewards from every process, compute group-relative advantages globally, keep this process's rows."""
        acc, a = self.accelerator, self.config.algorithm
        weights = self._weights()
        local = {k: scores[k].to(acc.device) for k in weights}
        gathered = {k: acc.gather(v).cpu() for k, v in local.items()}
        n_local = len(rollout)
        start = acc.process_index * n_local
        if a.per_prompt_stat_tracking:
            prompts_all = gather_object(list(rollout.prompts)) if acc.num_processes > 1 else list(rollout.prompts)
            adv = self.tracker.update(prompts_all, gathered, weights=weights, mode=a.reward_combination)
        else:
            labels = acc.gather(rollout.group_ids.to(acc.device)).cpu()
            adv = combine_rewards(gathered, labels, weights=weights, mode=a.reward_combination,
                                  **self.estimator_kwargs)
        if a.value_anchor_weight:
            adv = self._value_anchored(gathered, weights, rollout, adv)
        nan_rows = torch.zeros(len(adv), dtype=torch.bool)
        for v in gathered.values():
            nan_rows |= ~torch.isfinite(v if v.dim() == 1 else v.sum(-1))
        stats = {
            "samples/nan_reward": float(nan_rows.sum()),
            "samples/zero_advantage": float((adv.reshape(len(adv), -1).abs().sum(-1) == 0).sum()),
            "advantages/abs_mean": float(adv.abs().mean()),
        }
        return adv[start:start + n_local], stats

    def _value_anchored(self, gathered, weights, rollout, adv) -> torch.Tensor:
        """VGPO-style advantages: group term + weight (R - V) / scale, with V each prompt's running mean reward."""
        a, acc = self.config.algorithm, self.accelerator
        total = sum(w * gathered[k] for k, w in weights.items())
        prompts = gather_object(list(rollout.prompts)) if acc.num_processes > 1 else list(rollout.prompts)
        labels = acc.gather(rollout.group_ids.to(acc.device)).cpu()
        finite = total[torch.isfinite(total)]
        fallback = float(finite.mean()) if finite.numel() else 0.0
        value = torch.tensor([self.value_anchor.get(p, fallback) for p in prompts])
        adv = value_anchored_advantages(total, labels, value=value, weight=a.value_anchor_weight,
                                        scale=a.value_anchor_scale, eps=a.eps, std_ddof=a.std_ddof,
                                        clamp=a.advantage_clamp)
        for prompt, r in zip(prompts, total.tolist()):  # update the anchors after using them
            if r == r:
                self.value_anchor[prompt] = 0.9 * self.value_anchor.get(prompt, r) + 0.1 * r
        return adv

    @torch.no_grad()
    def _old_logps(self, rollout, perm: torch.Tensor, step_chunks: list[torch.Tensor]) -> torch.Tensor:
        """Log-probs of the sampling policy, computed in exactly the minibatch layout of the first inner epoch."""
        old = torch.zeros(rollout.mask.shape)
        for i in range(0, len(perm), self.config.train.batch_size):
            idx = perm[i:i + self.config.train.batch_size]
            for steps in step_chunks:
                with self.accelerator.autocast():
                    old[idx[:, None], steps[None, :]] = self.policy.logprobs(rollout, idx, steps).logps.float().cpu()
        return old

    def _train_on(self, rollout, advantages: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        """K inner epochs of minibatches over samples x trained steps; one optimizer step per GA minibatches."""
        c, acc, policy = self.config, self.accelerator, self.policy
        a, t = c.algorithm, c.train
        n, num_steps = rollout.mask.shape
        chunk = t.timestep_chunk or num_steps
        step_chunks = [torch.arange(s, min(num_steps, s + chunk)) for s in range(0, num_steps, chunk)]
        perms = [torch.randperm(n, generator=generator) for _ in range(t.inner_epochs)]
        # one optimizer step per update: the sampling policy is the current one for every minibatch, so its
        # log-probs are the current ones, detached (TRL's shortcut), and need no extra pass
        single_step = t.inner_epochs == 1 and -(-n // t.batch_size) <= t.gradient_accumulation_steps
        on_policy = rollout.old_logps is None and single_step
        if rollout.old_logps is None and not on_policy:
            rollout.old_logps = self._old_logps(rollout, perms[0], step_chunks)
        if a.advantage_transform == "token_variance" and rollout.old_logps is None:
            rollout.old_logps = self._old_logps(rollout, perms[0], step_chunks)
            on_policy = False
        if a.advantage_transform == "token_variance":  # TW-GRPO: needs the sampling policy's per-token log-probs
            advantages = token_weighted_advantages(advantages, rollout.old_logps, rollout.mask, rollout.group_ids,
                                                   max_weight=a.token_weight_max)
        ga_micro = t.gradient_accumulation_steps * len(step_chunks)
        params = policy.trainable_parameters()
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        skipped_loss = 0
        grad_norms: list[float] = []
        skipped_steps = 0

        def add(key: str, value: float) -> None:
            sums[key] = sums.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1

        for perm in perms:
            minibatches = [perm[i:i + t.batch_size] for i in range(0, n, t.batch_size)]
            for first in range(0, len(minibatches), t.gradient_accumulation_steps):
                group = minibatches[first:first + t.gradient_accumulation_steps]
                items = torch.stack([rollout.mask[idx].sum() for idx in group]).sum().to(acc.device)
                num_items = acc.reduce(items, reduction="sum") if acc.num_processes > 1 else items
                micro = [(idx, steps) for idx in group for steps in step_chunks]
                for m, (idx, steps) in enumerate(micro):
                    sync = m == len(micro) - 1
                    ctx = acc.no_sync(policy.model) if not sync and acc.num_processes > 1 else contextlib.nullcontext()
                    with ctx, acc.autocast():
                        out = policy.logprobs(rollout, idx, steps, with_kl=a.beta > 0)
                        adv = advantages[idx]
                        adv = adv[:, steps] if adv.dim() == 2 else adv
                        old = out.logps.detach() if on_policy else rollout.old_logps[idx][:, steps]
                        result = policy_loss(
                            out.logps, old.to(out.logps.device),
                            adv.to(out.logps.device), rollout.mask[idx][:, steps].to(out.logps.device),
                            clip_low=a.clip_low, clip_high=a.clip_high, aggregation=a.aggregation,
                            kl=out.kl, beta=a.beta, ratio_level=a.ratio_level,
                            gradient_accumulation_steps=ga_micro if a.aggregation != "dapo" else 1,
                            num_items_in_batch=num_items, num_processes=acc.num_processes,
                        )
                    loss = result.loss
                    if not torch.isfinite(loss):
                        # keep every process in the same backward (DDP) but contribute nothing
                        skipped_loss += 1
                        loss = sum((p * 0.0).sum() for p in params)
                    acc.backward(loss)
                    add("loss", float(result.loss.detach()) * (ga_micro if a.aggregation != "dapo" else 1))
                    for key, value in result.metrics.items():
                        add(key, float(value))
                norm = acc.clip_grad_norm_(params, c.optim.max_grad_norm) if c.optim.max_grad_norm > 0 else \
                    torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
                norm = float(norm)
                if math.isfinite(norm):
                    self.optimizer.step()
                    self.lr_scheduler.step()
                    self.optimizer_steps += 1
                    if self.ema is not None:
                        self.ema.update(policy.named_trainable_parameters())
                    grad_norms.append(norm)
                else:
                    skipped_steps += 1
                self.optimizer.zero_grad(set_to_none=True)
        metrics = {k: sums[k] / counts[k] for k in sums}
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        metrics["train/skipped_nonfinite_loss"] = float(skipped_loss)
        metrics["train/skipped_optimizer_steps"] = float(skipped_steps)
        metrics["lr"] = self.lr_scheduler.get_last_lr()[0]
        return metrics

    @contextlib.contextmanager
    def ema_weights(self):
        """Swap the EMA weights in (for evaluation and export), restoring the live ones afterwards."""
        if self.ema is None:
            yield
            return
        params = self.policy.named_trainable_parameters()
        live = {k: p.detach().clone() for k, p in params.items()}
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(self.ema.shadow[k])
        try:
            yield
        finally:
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(live[k])

    def _export(self, directory: str) -> None:
        with self.ema_weights():
            self.policy.export(directory)

    def _evaluate(self) -> dict[str, float]:
        """Fixed evaluation on the main process, EMA weights when enabled: for image policies an ODE grid of fixed
        prompts (rows) x seeds (columns) in ``samples/step_<k>.png``; for text policies greedy answers to the first
        items in ``samples/step_<k>.jsonl``. Both are scored with the run's rewards (``eval/reward/*``)."""
        if not self.accelerator.is_main_process:
            return {}
        c = self.config
        items = list(c.data.eval_prompts) or list(self.prompts.items[:c.data.num_eval_prompts])
        seeds = list(c.data.eval_seeds)
        with self.ema_weights():
            outputs = self.policy.sample_eval(items, seeds)
        samples = self.output_dir / "samples"
        samples.mkdir(parents=True, exist_ok=True)
        prompts = [item if isinstance(item, str) else getattr(item, "prompt", None) or item.question for item in items]
        metadata = [{} if isinstance(item, str) else dict(item.metadata) for item in items]
        if isinstance(outputs, torch.Tensor):
            grid = make_grid_image(outputs, rows=len(items))
            grid.save(samples / f"step_{self.update}.png")
            if self.logger is not None:
                self.logger.log_image("samples", grid, self.update)
            prompts = [p for p in prompts for _ in seeds]
            metadata = [m for m in metadata for _ in seeds]
        scores = self.reward_fn(outputs, prompts, metadata)
        if not isinstance(outputs, torch.Tensor):
            with open(samples / f"step_{self.update}.jsonl", "w") as handle:
                for i, (prompt, text) in enumerate(zip(prompts, outputs)):
                    row = {"prompt": prompt, "completion": text, **{k: float(v[i]) for k, v in scores.items()}}
                    handle.write(json.dumps(row) + "\n")
        return {f"eval/reward/{k}": float(v[torch.isfinite(v)].mean()) if torch.isfinite(v).any() else float("nan")
                for k, v in scores.items()}

    # ------------------------------------------------------------------------------------------- loop

    def train(self) -> list[dict[str, float]]:
        c, acc = self.config, self.accelerator
        if not c.resume and latest_checkpoint(self.output_dir / "checkpoints") is not None:
            raise ConfigError(f"{self.output_dir} already holds a run with checkpoints: set resume=auto to continue it "
                              f"or choose another output_dir (nothing was overwritten)")
        resumed = self.resume(c.resume) if c.resume else None
        if resumed is not None and acc.is_main_process:
            print(f"resumed from update {resumed} of {c.train.steps}")
        self.logger = None
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            dump_config(c, self.output_dir / "config.yaml")
            self.logger = MetricsLogger(self.output_dir, tensorboard=c.logging.tensorboard,
                                        wandb_project=c.logging.wandb_project, config=config_to_dict(c),
                                        resume_step=resumed)
        history: list[dict[str, float]] = []
        progress = None
        if acc.is_main_process and c.logging.progress_bar:
            from tqdm.auto import tqdm

            progress = tqdm(total=c.train.steps, initial=self.update, desc="mmrl train", dynamic_ncols=True)
        if self.update == 0 and c.logging.eval_every:
            self._evaluate()
        while self.update < c.train.steps:
            metrics = self.step()
            if c.logging.eval_every and self.update % c.logging.eval_every == 0:
                metrics.update(self._evaluate())
            history.append(metrics)
            if self.logger is not None:
                self.logger.log(metrics)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(reward=f"{metrics['reward/mean']:.4g}", loss=f"{metrics.get('loss', 0):.3g}")
            if (c.logging.save_every and self.update % c.logging.save_every == 0) or self.update == c.train.steps:
                self.save()
        if progress is not None:
            progress.close()
        if self.logger is not None:
            self.logger.close()
        return history

    def _weights(self) -> dict[str, float]:
        """Reward components entering the advantage (the reward's own, plus T-GRPO's bonus when on); with a dense
        credit method, the per-step rewards ``[N, T]`` it produced (normalised per step column within groups)."""
        if self.config.algorithm.credit != "outcome":
            return {"step_reward": 1.0}
        weights = dict(self.reward_fn.weights)
        if self.config.algorithm.temporal_contrast:
            weights["temporal_bonus"] = 1.0
        return weights

    def _sample(self, items: list, generator: torch.Generator, timer: dict[str, float]):
        """Rollout and scores for ``items``; with T-GRPO also the shuffled-frame contrast bonus."""
        c, a, acc = self.config, self.config.algorithm, self.accelerator
        t0 = time.perf_counter()
        kwargs = {"generator": generator, "update": self.update, "group_offset": acc.process_index * len(items)}
        if self.scorer is not None:  # score chunk k on a worker thread while chunk k+1 is sampled
            futures = []
            rollout = self.policy.rollout(items, c.data.group_size, **kwargs, on_chunk=lambda *chunk: futures.append(
                self.scorer.submit(*chunk)))
            t1 = time.perf_counter()
            results = [f.result() for f in futures]
            for result in results:
                self._count_reward_info(result.info)
            scores = {k: torch.cat([r[k].float().cpu() for r in results]) for k in results[0]}
        else:
            rollout = self.policy.rollout(items, c.data.group_size, **kwargs)
            t1 = time.perf_counter()
            scores = self._score(rollout)
        timer["rollout"] += t1 - t0
        timer["reward"] += time.perf_counter() - t1
        if a.temporal_contrast:
            scores["temporal_bonus"] = self._temporal_bonus(items, rollout, scores, generator, timer)
        if a.credit != "outcome":
            t2 = time.perf_counter()
            scores["step_reward"] = self._dense_credit(rollout)
            timer["credit"] = timer.get("credit", 0.0) + time.perf_counter() - t2
        return rollout, scores

    def _dense_credit(self, rollout) -> torch.Tensor:
        """Per-step rewards ``[N, T]`` from the rewards of the images each trained step leads to
        (:mod:`mmrl.core.credit`); also adapts per-step noise levels when ``sampling.adaptive_noise`` is on."""
        c, a = self.config, self.config.algorithm
        images, nfe = self.policy.intermediate_images(rollout, mode=c.sampling.intermediate)
        n, k = images.shape[:2]
        weights = self.reward_fn.weights
        totals = []
        for j in range(k):
            parts = [self.reward_fn(images[i:i + c.train.reward_batch_size, j], rollout.prompts[i:i + c.train.reward_batch_size],
                                    rollout.metadata[i:i + c.train.reward_batch_size])
                     for i in range(0, n, c.train.reward_batch_size)]
            scores = {key: torch.cat([p[key].float().cpu() for p in parts]) for key in weights}
            totals.append(sum(w * scores[key] for key, w in weights.items()))
        step_rewards = torch.stack(totals, dim=1)  # [N, T+1]: R_0 .. R_T
        if a.credit == "step_gain":
            dense = step_gain_credit(step_rewards)
        elif a.credit == "turning_point":
            result = turning_point_credit(step_rewards, balance=a.credit_balance,
                                          consistency_filter=a.credit_consistency_filter)  # balance over the batch
            dense = result.step_rewards
            self.credit_stats["credit/turning_points"] = float(result.turning_points.sum())
        else:
            # centred pixels ([-1, 1], minus each image's mean): raw [0, 1] images all have cosine ~1 to each other
            flat = images.reshape(n, k, -1) * 2 - 1
            flat = flat - flat.mean(dim=-1, keepdim=True)
            dense = cosine_similarity_credit(flat, flat[:, -1], step_rewards[:, -1])
        self.credit_stats["cost/extra_nfe"] = self.credit_stats.get("cost/extra_nfe", 0.0) + float(nfe)
        self.credit_stats["cost/reward_calls"] = self.credit_stats.get("cost/reward_calls", 0.0) + float(n * k)
        self.credit_stats["reward/ode_baseline"] = float(step_rewards[:, 0].nanmean())
        if c.sampling.adaptive_noise:
            gains = step_gain_credit(step_rewards)
            self.policy.step_noise_levels = adapt_noise_levels(
                self.policy.step_noise_levels, rollout.plan.train, gains.std(dim=0), rate=c.sampling.adaptive_noise_rate,
                base=self.base_noise_levels, max_level=1.0 if c.sampling.sde == "cps" else None)
        return dense

    def _temporal_bonus(self, items, rollout, scores, generator, timer) -> torch.Tensor:
        """T-GRPO (Video-R1): group_size/2 answers per video on shuffled frames, then
        :func:`mmrl.core.variants.temporal_contrast_rewards` on the accuracy component."""
        a = self.config.algorithm
        videos = [item for item in items if getattr(item, "video_path", None)]
        if not videos:
            return torch.zeros(len(rollout))
        t0 = time.perf_counter()
        shuffled = self.policy.rollout(videos, max(1, self.config.data.group_size // 2), generator=generator,
                                       update=self.update, shuffle_frames=True)
        t1 = time.perf_counter()
        shuffled_scores = self._score(shuffled)
        timer["rollout"] += t1 - t0
        timer["reward"] += time.perf_counter() - t1

        def keys(r):
            return [f"{m.get('id')}|{p}" for m, p in zip(r.metadata, r.prompts)]

        key = a.temporal_contrast_reward
        return temporal_contrast_rewards(
            torch.nan_to_num(scores[key]), torch.nan_to_num(shuffled_scores[key]), keys(rollout),
            shuffled_group_ids=keys(shuffled), alpha=a.temporal_contrast_alpha, mu=a.temporal_contrast_mu)

    def _dynamic_sampling(self, rollout, scores, generator, timer):
        """DAPO dynamic sampling: drop groups whose rewards are all equal, sample replacements (same number of rounds
        on every process), keep ``prompts_per_step`` groups, informative ones first."""
        c, acc = self.config, self.accelerator
        need = c.data.prompts_per_step
        weights = self._weights()
        parts = [(rollout, scores)]

        def informative(r, sc):
            total = sum(w * sc[k] for k, w in weights.items())
            return select_informative_groups(total, r.group_ids)

        def count(r, mask):
            return len(torch.unique(r.group_ids[mask]))

        have = count(rollout, informative(rollout, scores))
        rounds = 1
        while rounds < c.algorithm.max_sampling_rounds:
            short = torch.tensor(float(have < need), device=acc.device)
            if float(acc.reduce(short, reduction="sum") if acc.num_processes > 1 else short) == 0:
                break
            items = self.prompts.next_batch(need, rank=acc.process_index, world=acc.num_processes)
            parts.append(self._sample(items, generator, timer))
            have += count(parts[-1][0], informative(*parts[-1]))
            rounds += 1
        chosen, dropped = [], 0
        for want_informative in (True, False):  # informative groups first, then fill up with the rest
            for r, sc in parts:
                mask = informative(r, sc)
                for g in torch.unique(r.group_ids).tolist():
                    rows = (r.group_ids == g).nonzero().flatten()
                    if bool(mask[rows[0]]) == want_informative and len(chosen) < need:
                        chosen.append((r, sc, rows))
        dropped = sum(len(torch.unique(r.group_ids)) for r, _ in parts) - len(chosen)
        merged = self.policy.concat_rollouts([r.select(rows) for r, _, rows in chosen])
        merged.group_ids = merged.group_ids + acc.process_index * need
        merged_scores = {k: torch.cat([sc[k][rows] for _, sc, rows in chosen]) for k in scores}
        return merged, merged_scores, {"samples/sampling_rounds": float(rounds), "samples/dropped_groups": float(dropped)}

    def step(self) -> dict[str, float]:
        """One update: sample, score, advantages, optimise."""
        c, acc = self.config, self.accelerator
        generator = torch.Generator().manual_seed(_update_seed(c.seed, self.update, acc.process_index))
        timer = {"rollout": 0.0, "reward": 0.0}
        self.reward_counts: dict[str, float] = {}
        self.credit_stats: dict[str, float] = {}
        items = self.prompts.next_batch(c.data.prompts_per_step, rank=acc.process_index, world=acc.num_processes)
        rollout, scores = self._sample(items, generator, timer)
        sampling_stats = {}
        if c.algorithm.dynamic_sampling:
            rollout, scores, sampling_stats = self._dynamic_sampling(rollout, scores, generator, timer)
        t2 = time.perf_counter()
        advantages, adv_stats = self._advantages(rollout, scores)
        if c.algorithm.advantage_transform == "evidence_weighted":
            advantages = evidence_weighted_advantages(advantages, scores[c.algorithm.evidence_reward],
                                                      floor=c.algorithm.evidence_floor)
        train_metrics = self._train_on(rollout, advantages, generator)
        t3 = time.perf_counter()
        self.update += 1
        metrics: dict[str, float] = {"step": self.update}
        for key, value in scores.items():
            gathered = acc.gather(value.to(acc.device)).cpu()
            finite = gathered[torch.isfinite(gathered)]
            metrics[f"reward/{key}"] = float(finite.mean()) if finite.numel() else float("nan")
        metrics["reward/mean"] = metrics["reward/total"]
        metrics.update(adv_stats)
        metrics.update(sampling_stats)
        metrics["samples/trained"] = float(len(advantages) * acc.num_processes - adv_stats["samples/zero_advantage"])
        metrics.update(train_metrics)
        metrics["kl"] = train_metrics.get("kl", 0.0)
        if "completion_length" in rollout.extras:
            metrics["completions/mean_length"] = float(rollout.extras["completion_length"].float().mean())
        for reason, count in getattr(self.policy, "skipped", {}).items():
            metrics[f"samples/skipped_{reason}"] = float(count)
        metrics.update(self.reward_counts)
        metrics.update(self.credit_stats)
        if "credit" in timer:
            metrics["time/credit"] = timer["credit"]
        if c.sampling.adaptive_noise:
            for s, level in zip(rollout.plan.train.tolist(), self.policy.step_noise_levels[rollout.plan.train].tolist()):
                metrics[f"noise_level/step_{s}"] = level
        metrics["optimizer_steps"] = float(self.optimizer_steps)
        metrics["time/rollout"] = timer["rollout"]
        metrics["time/reward"] = timer["reward"]
        metrics["time/train"] = t3 - t2
        return metrics
