"""PRCO: one policy in two roles, an Observer that writes an evidence caption and a Solver that answers from it."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from mmrl.algorithms.base import (RewardContext, Rewards, Variant, VariantError, check_tag, check_template, item_of,
                                  option, register)


@dataclass
class PRCOOptions:
    accuracy: str = option("", "The outcome-accuracy component (a key of `rewards`) that judges the Solver's answer; "
                               "the Observer's utility is its Solver's score on it.")
    caption_tag: str = option("", "The Observer's caption: the contents of <tag>...</tag> in its completion; empty: "
                                  "the whole completion.")
    solver_template: str = option("Evidence: {caption}\n\nQuestion: {question}",
                                  "The Solver's question (text only, no image); placeholders {caption} and {question}.")
    solver_system_prompt: str = option("same", "The Solver's system prompt: 'same' keeps the run's "
                                               "(generation.system_prompt), '' none, any other text replaces it.")

    def validate(self) -> None:
        if not self.accuracy:
            raise ValueError("accuracy: name the outcome-accuracy component that judges the Solver's answer")
        if self.caption_tag:
            check_tag("caption_tag", self.caption_tag)
        check_template("solver_template", self.solver_template, "caption", "question")


@register
class PRCO(Variant):
    """Perception-Reasoning Coevolution (PRCO): a dual-role RLVR framework with one shared policy.

    The update's rollout is the **Observer**'s: its prompts are the run's (``generation.question_template`` is where
    the Observer is told to describe the evidence the question needs), each completion an evidence caption. For every
    caption the same policy, as the **Solver**, is sampled once on a text-only prompt (``solver_template``: the
    caption and the question, no image; the run's system prompt unless ``solver_system_prompt`` says otherwise, the
    question template ``{question}``). Role-specific rewards, as the paper states: the Solver's rows carry the run's
    reward components on its answer (the verifiable outcome reward); the Observer's rows carry its Solver's score on
    ``accuracy`` as that component (its utility: the Solver's downstream success) and 0 on every other component.
    Both roles are trained in the same update: the Solver's rows follow the Observer's (twice the rows per update,
    counted in the optimizer-step schedule), each role's group the ``group_size`` samples of one question, so the
    group-relative advantage compares Observers with Observers and Solvers with Solvers.

    mmrl's choices where the abstract gives no rule: one Solver sample per caption, the Solver prompt template, the
    other components' 0 on Observer rows (the accuracy reward's extra keys follow the Solver's), and the Solver group
    (the answers to one question from its ``group_size`` captions). Logged: ``prco/solver_accuracy`` (mean over Solver rows), ``prco/empty_captions``. Not combinable
    with ``select`` variants (they would drop one role's groups) or ``data.skip_bad_samples``."""

    name = "prco"
    summary = "Observer captions the evidence, Solver answers from the caption alone; both roles trained"
    paper = ("PRCO: Perception-Reasoning Coevolution, a dual-role RLVR framework with a shared policy (as its abstract "
             "states it; one Solver sample per caption, the Solver template and the Solver grouping are mmrl's)")
    Options = PRCOOptions
    families = ("vlm",)
    trained_rows_per_sample = 2

    def check(self, config) -> None:
        self.require_reward(config, "accuracy", weighted=True)
        if config.data.skip_bad_samples:
            raise VariantError("variant 'prco' trains a Solver row per Observer row; data.skip_bad_samples would "
                               "refill Observer groups without their Solvers: turn it off")

    def caption(self, text: str) -> str:
        tag = self.options.caption_tag
        if tag:
            found = re.search(rf"<{tag}>(.*?)</{tag}>", text, re.S)
            return found.group(1).strip() if found else ""
        return text.strip()

    def rewards(self, ctx: RewardContext) -> Rewards:
        o, observer = self.options, ctx.rollout
        captions = [self.caption(text) for text in observer.completions]
        items = [item_of(observer, ctx.items, i) for i in range(len(observer))]
        solver_items = [dataclasses.replace(item, question=o.solver_template.format(caption=caption,
                                                                                     question=item.question),
                                            image_paths=[], video_path=None, images=[])
                        for item, caption in zip(items, captions)]
        policy = ctx.policy
        system = policy.system_prompt if o.solver_system_prompt == "same" else (o.solver_system_prompt or None)
        with policy.prompting(system_prompt=system, question_template="{question}"):
            solver = ctx.sample(solver_items, 1)
        solver_scores = ctx.score(solver)
        groups = ctx.config.data.prompts_per_step * ctx.accelerator.num_processes  # unique on every process
        both = policy.concat_rollouts([observer, solver])
        both.group_ids = torch.cat([observer.group_ids, observer.group_ids + groups])
        utility = torch.nan_to_num(solver_scores[o.accuracy].float(), nan=0.0)
        scores = {}
        for key in ctx.scores:
            if key == "total":
                continue
            theirs = solver_scores[key].float()
            if key == o.accuracy:
                mine = utility
            elif key.startswith(f"{o.accuracy}/"):  # the accuracy reward's extras (acc@0.5, r1@m, ...) follow it
                mine = theirs
            else:
                mine = torch.zeros_like(theirs)
            scores[key] = torch.cat([mine, theirs])
        if "total" in ctx.scores:  # the logged total: the Observer's is its utility's weighted share
            mine = ctx.weights.get(o.accuracy, 0.0) * utility
            scores["total"] = torch.cat([mine, solver_scores["total"].float()])
        stats = ctx.stats
        stats["prco/solver_accuracy"] = float(utility.mean())
        stats["prco/empty_captions"] = stats.get("prco/empty_captions", 0.0) + float(sum(not c for c in captions))
        return Rewards(scores, dict(ctx.weights), rollout=both)
