"""TACO: Tool-Augmented Credit Optimization, GRPO for code-tool agents with two coupled advantage channels."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algorithms.base import RewardContext, Rewards, TransformContext, Variant, VariantError, option, register


@dataclass
class TACOOptions:
    accuracy: str = option("", "The outcome-accuracy component (a key of `rewards`) that judges the probe answers "
                               "(TACO: the existing answer checker, no judge).")
    probe: str = option("<answer>", "DAPR's probe tokens, inserted into the reasoning before a call and after its "
                                    "response; the policy's greedy continuation is its prediction there.")
    probe_stop: str = option("</answer>", "Where a probe's continuation ends ('' : at the end-of-turn token or "
                                          "probe_max_tokens).")
    probe_max_tokens: int = option(32, "Longest probe continuation, in tokens.")
    dapr_weight: float = option(1.0, "Weight of the tool-contribution channel (DAPR) added on each call's segment "
                                     "(mmrl's: the abstract sums the two channels without a weight); 0 turns it off.")
    routing: bool = option(True, "OGAR: give a call's segment the outcome advantage only when the call is "
                                 "responsible for the outcome; false: every token keeps it (plain GRPO credit).")

    def validate(self) -> None:
        if not self.accuracy:
            raise ValueError("accuracy: name the outcome-accuracy component that judges the probe answers")
        if not self.probe:
            raise ValueError("probe: the probe tokens must not be empty")
        if self.probe_max_tokens < 1:
            raise ValueError("probe_max_tokens must be >= 1")
        if not (self.dapr_weight >= 0 and self.dapr_weight < float("inf")):
            raise ValueError("dapr_weight must be a finite number >= 0")


@register
class TACO(Variant):
    """Tool-Augmented Credit Optimization (TACO), for policies that call image tools (``generation.tools``).

    Two coupled advantage channels, as the paper's abstract states them:

    * **DAPR** (Differential Answer-Probe Reward), the tool-contribution advantage: for every call, probe tokens
      (``probe``) inserted into the reasoning elicit the policy's prediction *without* the tool (the context ends
      where the call's ``<tool>`` begins) and *with* it (the context runs through the tool's response); each is
      scored by the outcome reward ``accuracy`` and the call's value is the difference ``d = r_with - r_without``:
      positive for a useful call, negative for a misleading one, zero for one that changes nothing. It is added,
      times ``dapr_weight``, on the tokens of the segment that wrote the call.
    * **OGAR** (Outcome-Gated Advantage Routing) of the outcome advantage ``A`` (the loop's group-relative one):
      the final segment (after the last tool response) always carries ``A``; a call's segment carries it only when
      the call is responsible for the outcome, ``sign(d) == sign(A)`` with ``d != 0`` (a useful call in a success,
      a misleading call in a failure); a redundant call (``d = 0``) is credited with neither, which suppresses
      wasted calls without a cost term.

    A segment is the policy's tokens from the end of the previous tool response (or the completion's start) through
    the call's closing tag. Completions without calls keep ``A`` on every token (plain GRPO). mmrl's choices where
    the abstract gives no rule: greedy probes of at most ``probe_max_tokens`` tokens ending at ``probe_stop``, the
    "without" context ending before the call (not the whole trajectory minus one response), the gate's sign rule
    above and ``dapr_weight``. Tool calls use mmrl's own syntax and image tools (:mod:`mmrl.pipelines.vlm.tools`),
    not TACO's Python sandbox. The paper's SFT stage on tool traces is not part of this variant. Logged:
    ``taco/calls`` (per completion), ``taco/useful``, ``taco/misleading``, ``taco/redundant`` (fractions of the
    probed calls), ``taco/value`` (mean ``d``) and ``time/probe``."""

    name = "taco"
    summary = ("Tool calls credited by their own effect on a probed answer (DAPR) plus the outcome advantage routed "
               "only to the responsible segments (OGAR)")
    paper = ("TACO: Tool-Augmented Credit Optimization for code-tool agents (DAPR and OGAR as its abstract states "
             "them; the probe's decoding, the 'without' context, the gate's sign rule and dapr_weight are mmrl's)")
    Options = TACOOptions
    families = ("vlm",)

    def check(self, config) -> None:
        self.require_reward(config, "accuracy")
        if not config.generation.tools:
            raise VariantError("variant 'taco' credits tool calls: set generation.tools (e.g. [crop])")

    # ------------------------------------------------------------------------------------------ DAPR

    def rewards(self, ctx: RewardContext) -> Rewards:
        from mmrl.pipelines.vlm.tool_rollout import probe

        o, rollout = self.options, ctx.rollout
        calls = rollout.tool_calls or [[] for _ in range(len(rollout))]
        jobs = [(i, c) for i, row in enumerate(calls) for c in row]
        t0 = time.perf_counter()
        if jobs:
            rows = [i for i, _ in jobs] * 2
            lengths = [c.opened for _, c in jobs] + [c.response_end for _, c in jobs]
            answers = probe(ctx.policy, rollout, rows, lengths, o.probe, max_new_tokens=o.probe_max_tokens,
                            stop=o.probe_stop or None)
            scored = ctx.score_outputs(answers, [rollout.prompts[i] for i in rows],
                                       [rollout.metadata[i] for i in rows])
            reward = torch.nan_to_num(scored[o.accuracy].float(), nan=0.0)
            without, with_tool = reward[:len(jobs)], reward[len(jobs):]
            for (_, call), before, after in zip(jobs, without.tolist(), with_tool.tolist()):
                call.value = after - before
        ctx.timer["probe"] = ctx.timer.get("probe", 0.0) + time.perf_counter() - t0
        values = [c.value for _, c in jobs]
        stats = ctx.stats
        stats["taco/calls"] = len(jobs) / max(1, len(rollout))
        n = max(1, len(values))
        stats["taco/useful"] = sum(v > 0 for v in values) / n
        stats["taco/misleading"] = sum(v < 0 for v in values) / n
        stats["taco/redundant"] = sum(v == 0 for v in values) / n
        stats["taco/value"] = sum(values) / n
        stats["time/probe"] = ctx.timer["probe"]
        return Rewards(dict(ctx.scores), dict(ctx.weights))

    # ------------------------------------------------------------------------------------------ OGAR

    def transform(self, ctx: TransformContext) -> Tensor:
        o, rollout = self.options, ctx.rollout
        advantages = ctx.advantages
        width = rollout.mask.shape[1]
        out = advantages.unsqueeze(1).expand(-1, width).clone() if advantages.dim() == 1 else advantages.clone()
        for i, row in enumerate(rollout.tool_calls or []):
            for call in row:
                if call.value is None:
                    raise VariantError("taco: a tool call reached the transform stage without its DAPR value (the "
                                       "rewards stage probes every call)")
                segment = out[i, call.start:call.end]
                if o.routing:
                    gate = (torch.sign(segment) == torch.sign(torch.tensor(call.value))) & (call.value != 0)
                    segment = torch.where(gate, segment, torch.zeros_like(segment))
                out[i, call.start:call.end] = segment + o.dapr_weight * call.value
        return out
