"""Vision-SR1: a self-reward for perceptions that answer the question without the image."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from mmrl.algorithms.base import RewardContext, Rewards, Variant, check_tag, check_template, item_of, option, register


@dataclass
class VisionSR1Options:
    accuracy: str = option("", "The answer-accuracy component (a key of `rewards`) that judges the text-only answer.")
    weight: float = option(1.0, "Weight of the self-reward component `self_reward` in the advantage.")
    tag: str = option("perception", "The response's visual-perception block: the contents of <tag>...</tag>.")
    fallback: str = option("think", "A response without that block: 'think' re-prompts with its <think> block, "
                                    "'zero' gives self-reward 0.")
    template: str = option("Image description: {perception}\n\n{question}", "The text-only re-prompt; placeholders "
                                                                            "{perception} and {question}.")

    def validate(self) -> None:
        if not self.accuracy:
            raise ValueError("accuracy: name the answer-accuracy component that judges the text-only answer")
        if self.weight < 0:
            raise ValueError(f"weight must be >= 0 (a negative weight would reward a perception that misleads the "
                             f"text-only answer), got {self.weight}")
        if self.fallback not in ("think", "zero"):
            raise ValueError(f"fallback must be 'think' or 'zero', got {self.fallback!r}")
        check_tag("tag", self.tag)
        check_template("template", self.template, "perception", "question")


@register
class VisionSR1(Variant):
    """For every sample, the policy (greedy, the same weights) is re-prompted WITHOUT the image, with only its own
    written perception and the question (``template``); the run's ``accuracy`` reward judges that text-only answer
    against the sample's reference, and its score is the component ``self_reward`` (weight ``weight``), added to the
    outcome rewards. A perception that does not let the model answer blind earns nothing, so the perception must be
    self-contained. The two-stage decomposition and the re-prompted self-reward are the paper's; the prompt template,
    the tag and the ``think`` fallback are mmrl's. Cost: one greedy text-only rollout per sample per update (in
    ``time/rollout``); ``vision_sr1/no_perception`` counts responses without a perception block."""

    name = "vision_sr1"
    summary = "self-reward: the policy must answer from its own written perception alone, without the image"
    paper = ("Self-Rewarding Vision-Language Model via Reasoning Decomposition (Vision-SR1), Li et al. 2025, "
             "arXiv 2508.19652 (the re-prompt template and fallback are mmrl's)")
    Options = VisionSR1Options
    families = ("vlm",)

    def check(self, config) -> None:
        self.require_reward(config, "accuracy")

    def perception(self, text: str) -> str | None:
        for tag in ((self.options.tag, "think") if self.options.fallback == "think" else (self.options.tag,)):
            found = re.search(rf"<{tag}>(.*?)</{tag}>", text, re.S)
            if found and found.group(1).strip():
                return found.group(1).strip()
        return None

    def rewards(self, ctx: RewardContext) -> Rewards:
        o, r = self.options, ctx.rollout
        rows, prompts = [], []
        for i, text in enumerate(r.completions):
            perception = self.perception(text)
            if perception is None:
                continue
            item = item_of(r, ctx.items, i)
            rows.append(i)
            prompts.append(dataclasses.replace(item, question=o.template.format(perception=perception,
                                                                                question=item.question),
                                               image_paths=[], video_path=None, images=[]))
        reward = torch.zeros(len(r))
        if prompts:
            blind = ctx.sample(prompts, 1, greedy=True)
            judged = ctx.score(blind)[o.accuracy]
            reward[torch.tensor(rows)] = torch.nan_to_num(judged.float(), nan=0.0)
        missing = float(len(r) - len(rows))
        ctx.stats["vision_sr1/no_perception"] = ctx.stats.get("vision_sr1/no_perception", 0.0) + missing
        return Rewards({**ctx.scores, "self_reward": reward}, {**ctx.weights, "self_reward": o.weight})
