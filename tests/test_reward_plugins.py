"""Rewards of your own: TRL-style reward functions (``reward: function``), reward classes by import path, and the
config check that a reward judges what the policy produces."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mmrl.cli import main
from mmrl.config import ConfigError, load_config
from mmrl.rewards import build_reward, build_rewards, reward_inputs

REPO = Path(__file__).resolve().parents[1]

MODULE = '''
from mmrl.rewards import TextReward

CALLS = []


def length_reward(completions, prompts, solution=None, **kwargs):
    """TRL's signature: lists in, one float (or None: does not apply) per completion out."""
    CALLS.append({"completions": completions, "prompts": prompts, "solution": solution, **kwargs})
    return [None if s is None else float(len(c)) for c, s in zip(completions, solution or [None] * len(completions))]


def content_length(completions, **kwargs):
    return [len(c[0]["content"]) * kwargs.get("scale", 1.0) for c in completions]


def broken(completions, **kwargs):
    raise KeyError("answer")


def too_few(completions, **kwargs):
    return [1.0]


def odd_values(completions, **kwargs):
    return [float("nan"), None, True][:len(completions)]


def as_string(completions, **kwargs):
    return "1" * len(completions)


def as_column(completions, **kwargs):
    import numpy as np

    return np.ones((len(completions), 1))


def as_mapping(completions, **kwargs):
    return {i: 0.5 for i in range(len(completions))}


def a_word(completions, **kwargs):
    return ["0.5"] * len(completions)


def token_length(completions, completion_ids, **kwargs):
    return [len(c) for c in completion_ids]


def reads_ids(completions, **kwargs):
    return [len(c) for c in kwargs["completion_ids"]]


class ExactMatch(TextReward):
    """A reward class of your own, named by import path."""

    def _score_one(self, text, prompt, meta):
        return float(text.strip() == str(meta.get("solution")))
'''


@pytest.fixture()
def module(tmp_path, monkeypatch):
    (tmp_path / "my_trl_rewards.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_trl_rewards", None)
    import my_trl_rewards

    yield my_trl_rewards
    sys.modules.pop("my_trl_rewards", None)


def test_trl_function_gets_completions_prompts_and_columns(module):
    reward = build_reward("function", function="my_trl_rewards:length_reward", kwargs={"flag": 7})
    out = reward(["abc", "hello", "x"], ["q1", "q2", "q3"], [{"solution": "a", "id": 1}, {"solution": "b"}, {"id": 3}])
    # the metadata keys as keyword lists (None where a sample lacks one), the fixed kwargs, the prompts as given
    call = module.CALLS[-1]
    assert call["completions"] == ["abc", "hello", "x"] and call["prompts"] == ["q1", "q2", "q3"]
    assert call["solution"] == ["a", "b", None] and call["id"] == [1, None, 3] and call["flag"] == 7
    # None (TRL: the reward does not apply) is NaN with its reason
    assert out["function"][:2].tolist() == [3.0, 5.0] and math.isnan(out["function"][2])
    assert "does not apply" in reward.last_info["nan_samples"][2]


def test_trl_function_conversational_nonfinite_and_errors(module):
    wrapped = build_reward("function", function="my_trl_rewards:content_length", conversational=True,
                           kwargs={"scale": 2.0})
    assert wrapped(["abcd", ""])["function"].tolist() == [8.0, 0.0]
    odd = build_reward("function", function=module.odd_values)  # a callable works too
    out = odd(["a", "b", "c"])
    assert math.isnan(out["function"][0]) and math.isnan(out["function"][1]) and out["function"][2] == 1.0
    assert set(odd.last_info["nan_samples"]) == {0, 1}
    # results TRL's torch.tensor(list) refuses or misreads are errors, not NaN or silently read keys / characters
    for name, match in (("as_string", "returned str"), ("as_column", r"shape \(3, 1\)"),
                        ("as_mapping", "returned dict"), ("a_word", "'0.5' for completion 0")):
        with pytest.raises(ValueError, match=match):
            build_reward("function", function=f"my_trl_rewards:{name}")(["a", "b", "c"])
    # what TRL passes and mmrl does not: required -> refused when the config is read; read from kwargs -> named
    with pytest.raises(ValueError, match="requires completion_ids, which TRL passes and mmrl does not"):
        build_reward("function", function="my_trl_rewards:token_length")
    with pytest.raises(RuntimeError, match="TRL passes completion_ids; mmrl passes completions"):
        build_reward("function", function="my_trl_rewards:reads_ids")(["a"])
    with pytest.raises(ValueError, match="conversational must be true or false"):
        build_reward("function", function="my_trl_rewards:content_length", conversational="false")
    with pytest.raises(RuntimeError, match="reward function my_trl_rewards:broken failed: KeyError"):
        build_reward("function", function="my_trl_rewards:broken")(["a"])
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        build_reward("function", function="my_trl_rewards:too_few")(["a", "b"])
    with pytest.raises(ValueError, match="cannot import 'nothing'"):
        build_reward("function", function="my_trl_rewards:nothing")
    with pytest.raises(ValueError, match="package.module:function_name"):
        build_reward("function", function="len")


def test_a_reward_class_by_import_path_and_in_a_composition(module):
    assert reward_inputs("my_trl_rewards:ExactMatch") == (False, True)
    combo = build_rewards({"exact": {"reward": "my_trl_rewards:ExactMatch", "weight": 2.0},
                           "length": {"reward": "function", "kwargs": {"function": "my_trl_rewards:length_reward"}}})
    out = combo(["b", "zz"], ["q", "q"], [{"solution": "b"}, {"solution": "y"}])
    assert out["exact"].tolist() == [1.0, 0.0] and out["length"].tolist() == [1.0, 2.0]
    torch.testing.assert_close(out["total"], torch.tensor([3.0, 2.0]))
    with pytest.raises(ValueError, match="unknown reward 'my_trl_rewards_typo'"):
        build_reward("my_trl_rewards_typo")


def test_config_checks_the_function_and_what_each_reward_judges(module):
    vlm = REPO / "configs/tiny/vlm_grounding.yaml"
    config = load_config(vlm, ["rewards={len: {reward: function, kwargs: {function: 'my_trl_rewards:length_reward'}}}"],
                         check_files=False)
    assert config.rewards["len"]["reward"] == "function"
    with pytest.raises(ConfigError, match="rewards.len: cannot import 'nope'"):
        load_config(vlm, ["rewards={len: {reward: function, kwargs: {function: 'my_trl_rewards:nope'}}}"],
                    check_files=False)
    # a text reward on a flow policy's images, an image reward on a VLM's completions: refused before any model load
    with pytest.raises(ConfigError, match="judges completions \\(text\\), but a model.family sd3 policy"):
        load_config(REPO / "configs/tiny/flow_grpo.yaml", ["rewards={think_answer_format: 1.0}"])
    with pytest.raises(ConfigError, match="'brightness' judges images, but a model.family qwen_vl policy"):
        load_config(vlm, ["rewards={brightness: 1.0}"], check_files=False)
    load_config(vlm, ["rewards={remote: {kwargs: {url: 'http://localhost:1'}}}"], check_files=False)  # either


def test_a_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("def f(completions, **kw)\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="importing 'broken_rewards' failed with SyntaxError.*line 1"):
        build_reward("function", function="broken_rewards:f")
    # the working directory is searched too (as python -m does), so a module next to the config imports from `mmrl`
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "cwd_rewards.py").write_text("def f(completions, **kw):\n    return [2.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path / "sub")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path / "sub"))])
    sys.modules.pop("cwd_rewards", None)
    assert build_reward("function", function="cwd_rewards:f")(["a"])["function"].tolist() == [2.0]


def test_mmrl_train_trains_on_a_trl_function_reward(module, tmp_path):
    run = tmp_path / "run"
    spec = "rewards={len: {reward: function, kwargs: {function: 'my_trl_rewards:length_reward'}}}"
    assert main(["train", str(REPO / "configs/tiny/vlm_grounding.yaml"), f"output_dir={run}", "train.steps=1",
                 "logging.progress_bar=false", "logging.tensorboard=false", "logging.eval_every=0",
                 "generation.max_new_tokens=8", "data.prompts_per_step=2", "data.group_size=4", "train.batch_size=8",
                 "train.gradient_accumulation_steps=1", spec]) == 0
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    call = module.CALLS[-1]  # the completions the function saw are the ones the update scored
    lengths = [len(c) for c in call["completions"]]
    assert len(lengths) == 8 and all(s is not None for s in call["solution"])
    assert metrics["reward/len"] == pytest.approx(sum(lengths) / len(lengths), rel=1e-5)
    assert metrics["grad_norm"] > 0


IMAGE_MODULE = '''
import torch


class _Image:
    needs_prompts = False
    scores_images = True
    name = "mine"

    def __init__(self, **kwargs):
        self.last_info = {}

    def brightness(self, images):
        return images.float().mean(dim=(1, 2, 3))


class WrongLength(_Image):
    def __call__(self, images, prompts=None, metadata=None):
        return {self.name: self.brightness(images)[:-1]}


class Column(_Image):
    def __call__(self, images, prompts=None, metadata=None):
        return {self.name: self.brightness(images)[:, None]}


class Word(_Image):
    def __call__(self, images, prompts=None, metadata=None):
        return {self.name: "0.5"}


class Number(_Image):
    def __call__(self, images, prompts=None, metadata=None):
        return 0.5


class AsList(_Image):
    def __call__(self, images, prompts=None, metadata=None):
        return {self.name: [float(v) for v in self.brightness(images)][:-1] + [None]}


class Bare(_Image):
    def __call__(self, images, prompts=None, metadata=None):
        return self.brightness(images)
'''


@pytest.mark.parametrize("name,error", [
    ("WrongLength", r"rewards\.x \(WrongLength\) returned 'mine' scores of shape \(2,\) for 3 samples; expected \[3\]"),
    ("Column", r"rewards\.x \(Column\) returned 'mine' scores of shape \(3, 1\) for 3 samples; expected \[3\]"),
    ("Word", r"rewards\.x \(Word\) returned 'mine' scores that are not numbers"),
    ("Number", r"rewards\.x \(Number\) returned a float; expected \{'mine': \[3\] scores\} or a list of 3 numbers"),
])
def test_an_image_reward_of_your_own_returning_the_wrong_shape_is_one_error_naming_it(tmp_path, monkeypatch, name,
                                                                                       error):
    """A custom reward's output of the wrong length or shape failed deep in the composition, or (an [N, 1] column,
    broadcast to [N, N]) in the advantages, naming neither the reward nor the N expected."""
    (tmp_path / "my_image_rewards.py").write_text(textwrap.dedent(IMAGE_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_image_rewards", None)
    images = torch.rand(3, 3, 8, 8)
    with pytest.raises(ValueError, match=error):
        build_rewards({"x": {"reward": f"my_image_rewards:{name}"}})(images, ["a"] * 3)
    # a list (None: unscored) and a bare tensor are the main score
    out = build_rewards({"x": {"reward": "my_image_rewards:AsList"}})(images, ["a"] * 3)
    assert out["x"].shape == (3,) and math.isnan(out["x"][2]) and math.isfinite(out["x"][0])
    out = build_rewards({"x": {"reward": "my_image_rewards:Bare"}})(images, ["a"] * 3)
    torch.testing.assert_close(out["total"], images.mean(dim=(1, 2, 3)))
    sys.modules.pop("my_image_rewards", None)
