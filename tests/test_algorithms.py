"""The variant extension point (mmrl.algorithms): the registry's contract, config errors, third-party variants,
a loop that names no variant, the README's table, and one tiny `mmrl train` update with every registered variant."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import mmrl.algorithms as algorithms
from mmrl.algorithms.base import REGISTRY, STAGES, lookup, variants_table
from mmrl.cli import main
from mmrl.config import MOVED_KEYS, ConfigError, load_config
from mmrl.rewards import register_reward

REPO = Path(__file__).parents[1]


@register_reward("test_variant_length")
class VariantLength:
    """Test reward that varies within every group: completion length mod 4 (text) or mean brightness (images)."""

    name = "test_variant_length"
    needs_prompts = False

    def __init__(self):
        self.last_info = {}

    def __call__(self, outputs, prompts=None, metadata=None):
        if isinstance(outputs, torch.Tensor):
            return {self.name: outputs.float().mean(dim=(1, 2, 3))}
        return {self.name: torch.tensor([(len(o) % 4) / 3.0 for o in outputs])}


@register_reward("test_variant_correct")
class VariantCorrect:
    """Test reward in {0, 1}: 'correct' when the completion length is even."""

    name = "test_variant_correct"
    needs_prompts = False

    def __init__(self):
        self.last_info = {}

    def __call__(self, outputs, prompts=None, metadata=None):
        self.last_info = {"spans": [[(0, len(o) // 2)] if o else None for o in outputs]}  # "about" the first half
        return {self.name: torch.tensor([float(len(o) % 2 == 0) for o in outputs])}


def test_every_registered_variant_keeps_the_contract():
    assert len(REGISTRY) >= 11
    for name, cls in REGISTRY.items():
        assert cls.name == name and cls.summary and cls.paper, name
        assert cls.stages() and set(cls.stages()) <= set(STAGES), name
        for f in dataclasses.fields(cls.Options):
            assert f.metadata.get("help"), f"{name}.{f.name} has no help text"
        assert lookup(name) is cls


def test_the_loop_names_no_variant():
    source = (REPO / "mmrl" / "trainer.py").read_text()
    names = (set(REGISTRY) - {"cosine"}) | {"credit",  # cosine: also an LR schedule "dynamic_sampling", "temporal_contrast", "value_anchor", "evidence",
                             "token_weight", "adaptive_noise", "gaussian_rank"}
    found = [n for n in names if re.search(rf"\b{re.escape(n)}\b", source)]
    assert found == [], f"trainer.py names variants {found}"


def test_old_keys_name_the_new_spelling():
    assert len(MOVED_KEYS) == 18
    for key, spelling in MOVED_KEYS.items():
        with pytest.raises(ConfigError, match=f"'{re.escape(key)}' is now an algorithm variant: write "
                                              f"{re.escape(spelling)}"):
            load_config(None, [f"{key}=1"])


def test_readme_table_is_the_registry():
    readme = (REPO / "README.md").read_text()
    block = readme.split("<!-- variants:start -->")[1].split("<!-- variants:end -->")[0].strip()
    assert block == variants_table(), "README's variant table is stale: paste `mmrl variants --markdown`"


def test_mmrl_variants_lists_every_variant(capsys):
    assert main(["variants", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in listed] == sorted(REGISTRY)
    assert main(["variants"]) == 0
    text = capsys.readouterr().out
    assert "max_weight: 1.4  # The largest token weight" in text


THIRD_PARTY = '''
from dataclasses import dataclass
import torch
from mmrl.algorithms import Variant, option


@dataclass
class ScaleOptions:
    factor: float = option(1.0, "Multiplies every advantage.")


class ScaleAdvantages(Variant):
    name = "scale_advantages"
    summary = "multiply advantages by a constant"
    paper = "none (a test plug-in)"
    Options = ScaleOptions
    calls = 0

    def transform(self, ctx):
        ScaleAdvantages.calls += 1
        return ctx.advantages * self.options.factor
'''


def _vlm_args(tmp_path, *extra):
    return [str(REPO / "configs/tiny/vlm_grounding.yaml"), f"output_dir={tmp_path}", "train.steps=1",
            "logging.progress_bar=false", "logging.tensorboard=false", "logging.eval_every=0",
            "generation.max_new_tokens=8", "data.prompts_per_step=2", "data.group_size=4", "train.batch_size=8",
            "train.gradient_accumulation_steps=1", "rewards={test_variant_length: 1.0, test_variant_correct: 0.0}",
            *extra]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_third_party_variant_by_module_path_changes_the_update(tmp_path, monkeypatch):
    (tmp_path / "my_variants.py").write_text(textwrap.dedent(THIRD_PARTY))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_variants", None)
    assert main(["train", *_vlm_args(tmp_path / "zero", "algorithm.variants=[{name: 'my_variants:ScaleAdvantages', "
                                                        "factor: 0.0}]")]) == 0
    import my_variants

    assert my_variants.ScaleAdvantages.calls == 1
    assert _metrics(tmp_path / "zero")[0]["grad_norm"] == 0.0  # every advantage zeroed: nothing to learn
    assert main(["train", *_vlm_args(tmp_path / "one", "algorithm.variants=['my_variants:ScaleAdvantages']")]) == 0
    assert _metrics(tmp_path / "one")[0]["grad_norm"] > 0
    with pytest.raises(ConfigError, match="has no option 'fcator'; did you mean 'factor'"):
        load_config(REPO / "configs/tiny/vlm_grounding.yaml",
                    ["algorithm.variants=[{name: 'my_variants:ScaleAdvantages', fcator: 2}]"])


def test_entry_point_variants_are_found(monkeypatch):
    class FakeEntryPoint:
        def load(self):
            return REGISTRY["tw_grpo"]

    monkeypatch.setattr(algorithms.base, "_entry_points", lambda: {"from_a_package": FakeEntryPoint()})
    assert lookup("from_a_package") is REGISTRY["tw_grpo"]
    with pytest.raises(algorithms.VariantError, match="unknown variant 'from_a_pakage'; did you mean 'from_a_package'"):
        lookup("from_a_pakage")



def test_every_float_option_refuses_nan_and_inf():
    # a range check written as a comparison lets NaN through (NaN < 1 is False): tw_grpo max_weight=nan gave NaN
    # advantages; the parser refuses NaN for every float option and inf unless the option allows it
    import typing

    import yaml

    from mmrl.algorithms.base import VariantError, parse_spec

    checked = 0
    for name, cls in REGISTRY.items():
        required = {k: yaml.safe_load(v) if isinstance(v, str) else v for k, v in VLM_OPTIONS.get(name, {}).items()}
        hints = typing.get_type_hints(cls.Options)
        for f in dataclasses.fields(cls.Options):
            if hints[f.name] not in (float, typing.Optional[float]):
                continue
            checked += 1
            with pytest.raises(VariantError, match=f"{f.name} must be a finite number, got nan"):
                parse_spec({"name": name, **required, f.name: math.nan}, 0)
            if f.metadata.get("allow_inf"):
                continue
            for value in (math.inf, -math.inf):
                with pytest.raises(VariantError, match=f"{f.name} must be a finite number"):
                    parse_spec({"name": name, **required, f.name: value}, 0)
    assert checked > 80
    # the two options where an infinity means something are accepted
    assert parse_spec({"name": "g2rpo_shaping", "entropy_high": math.inf}, 0).options.entropy_high == math.inf
    spec = {"name": "trust_grpo", "thinking": "t", "outcome": "a", "judge_from": -math.inf}
    assert parse_spec(spec, 0).options.judge_from == -math.inf


# ------------------------------------------------------------------------------------------ every variant, e2e

#: options a smoke run needs (the required ones); every registered variant must be listed here or in FLOW_ONLY
VLM_OPTIONS = {
    "trust_grpo": {"thinking": "test_variant_length", "outcome": "test_variant_correct"},
    "ga_grpo": {"reward": "test_variant_correct"},
    "t_grpo": {"reward": "test_variant_correct"},
    "length_control": {"reward": "test_variant_correct", "min_tokens": 0},
    "a_grae": {"reward": "test_variant_correct"},
    "focal_advantage": {"reward": "test_variant_correct"},
    "lens": {"reward": "test_variant_correct"},
    "contrastive_baseline": {"reward": "test_variant_length"},
    "par": {"reward": "test_variant_length"},
    "papo": {"outcome": "test_variant_correct", "process": "test_variant_length"},
    "drpo": {"outcome": "test_variant_correct", "preference": "test_variant_length"},
    "etr": {"reward": "test_variant_length"},
    "blockwise": {"scopes": "{test_variant_length: answer, test_variant_correct: reward}"},
    "rs_grpo": {"evidence": "[test_variant_correct]", "answer": "[test_variant_length]"},
    "perceval": {"claims": "test_variant_correct"},
    "vision_sr1": {"accuracy": "test_variant_correct"},
    "prco": {"accuracy": "test_variant_correct"},
    "taco": {"accuracy": "test_variant_correct"},
    "factorized": {"vision": "[test_variant_correct]"},
    "grpo_care": {"accuracy": "test_variant_correct"},
    "grip_multi_heuristic": {"outcome": "test_variant_correct"},
}
#: other overrides a variant's smoke run needs: MC-GRPO's G+1 (odd) samples per group
BOTH_WEIGHTED = ["rewards={test_variant_length: 1.0, test_variant_correct: 1.0}"]
VLM_OVERRIDES = {"mc_grpo": ["data.group_size=5", "train.batch_size=10"], "papo": BOTH_WEIGHTED, "drpo": BOTH_WEIGHTED,
                 "dvao": BOTH_WEIGHTED, "blockwise": BOTH_WEIGHTED, "cspo": BOTH_WEIGHTED, "rs_grpo": BOTH_WEIGHTED,
                 "grpo_care": ["algorithm.beta=0"], "prco": BOTH_WEIGHTED,
                 "taco": ["generation.tools=[crop]"], "factorized": ["generation.tools=[crop]", *BOTH_WEIGHTED]}


@pytest.fixture(scope="module")
def dataset_with_references(tmp_path_factory):
    """The tiny grounding set with baseline and reference responses in every line (contrastive_baseline, par)."""
    from mmrl.data.synthetic import resolve_dataset

    source = Path(resolve_dataset("tiny:grounding"))
    lines = []
    for line in source.read_text().splitlines():
        row = json.loads(line)
        row["image"] = str(source.parent / row["image"])
        row["baseline_responses"] = ["<answer>[0, 0, 8, 8]</answer>", "a box"]
        row["reference_response"] = "<think>red</think><answer>[1, 1, 9, 9]</answer>"
        lines.append(json.dumps(row))
    path = tmp_path_factory.mktemp("refs") / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _spec(name: str) -> str:
    options = {"name": name, **VLM_OPTIONS.get(name, {})}
    return "{" + ", ".join(f"{k}: {v}" for k, v in options.items()) + "}"


VLM_VARIANTS = sorted(n for n, c in REGISTRY.items() if "vlm" in c.families)
FLOW_VARIANTS = sorted(n for n, c in REGISTRY.items() if "vlm" not in c.families)


@pytest.mark.parametrize("name", VLM_VARIANTS)
def test_each_vlm_variant_trains_one_update(tmp_path, name, dataset_with_references):
    config = "configs/tiny/vlm_video_tg.yaml" if name == "t_grpo" else "configs/tiny/vlm_grounding.yaml"
    extra = list(VLM_OVERRIDES.get(name, []))
    if name in ("contrastive_baseline", "par"):
        extra.append(f"data.dataset={dataset_with_references}")
    args = _vlm_args(tmp_path, f"algorithm.variants=[{_spec(name)}]", *extra)
    args[0] = str(REPO / config)
    assert main(["train", *args]) == 0
    m = _metrics(tmp_path)[0]
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]), name
    if name in ("blockwise", "cspo", "rs_grpo"):  # the reported spans reached the variant as token masks
        assert 0 < m[f"{name}/test_variant_correct_token_share"] < 1
    if name == "perceval":
        assert m["perceval/hallucinated_tokens"] > 0
    if "surrogate" in REGISTRY[name].stages():  # no clip metrics for a clip the replaced surrogate does not apply
        assert "clipfrac" not in m and "clip_ratio/low" not in m
    else:
        assert "clipfrac" in m
    if name == "prco":  # the Solver's rows were trained after the Observer's: twice the sampled rows
        assert m["samples/trained"] == 2 * 2 * 4 and m["optimizer_steps"] == 2 * 2  # 16 rows: 2 minibatches x 2 epochs
        assert 0 <= m["prco/solver_accuracy"] <= 1
    if name == "factorized":  # no call written: the vision reward credits no token, the text reward every one
        assert m["factorized/test_variant_correct_token_share"] == 0
        assert m["factorized/test_variant_length_token_share"] == 1
    if name == "taco":  # the random model writes no call: the probes have nothing to credit, GRPO's credit stays
        assert m["completions/tool_calls"] == 0 and m["taco/calls"] == 0
    if name == "mc_grpo":  # one pivot per group of G+1 = 5 leaves the loss
        assert m["samples/dropped_from_loss"] == 2 and m["samples/trained"] == 2 * 5 - 2  # 2 groups of G + 1


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    from mmrl.pipelines.flow.tiny import build_tiny_sd3

    return str(build_tiny_sd3(tmp_path_factory.mktemp("tiny") / "sd3"))


#: flow-only variants' extra overrides: E-GRPO's advantage is for the merged-step sampling mode
FLOW_OVERRIDES = {"e_grpo": ["sampling.train_steps=entropy_merge", "sampling.merge_groups=2"]}


@pytest.mark.parametrize("name", FLOW_VARIANTS)
def test_each_flow_variant_trains_one_update(tmp_path, tiny_sd3, name):
    assert main(["train", str(REPO / "configs/tiny/flow_grpo.yaml"), f"output_dir={tmp_path}",
                 f"model.pretrained={tiny_sd3}", "sampling.num_steps=4", "sampling.window_size=2",
                 "sampling.train_steps=random_window", "data.prompts_per_step=1", "data.group_size=4",
                 "train.batch_size=4", "train.steps=1", "logging.eval_every=0", "logging.progress_bar=false",
                 "logging.tensorboard=false", "sampling.max_sequence_length=16", "train.overlap_scoring=false",
                 "rewards={test_variant_length: 1.0}", f"algorithm.variants=[{_spec(name)}]",
                 *FLOW_OVERRIDES.get(name, [])]) == 0
    m = _metrics(tmp_path)[0]
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0, name
    if "intermediate_images" in REGISTRY[name].needs:  # the start and the first trained step's image were scored
        assert m["cost/reward_calls"] == 4 * 2  # (the last, the final sample, has its own reward already)


def test_variance_selection_trains_the_most_varied_groups(tmp_path):
    assert main(["train", *_vlm_args(tmp_path, "algorithm.variants=[{name: variance_selection, rounds: 3}]")]) == 0
    m = _metrics(tmp_path)[0]
    assert m["samples/sampling_rounds"] == 3 and m["samples/dropped_groups"] == 2 * 3 - 2


def test_variant_state_resumes_exactly(tmp_path):
    """A variant's per-run state (VGPO's anchors, torch-saved in the checkpoint) survives a resume: 1 + resume + 1
    updates log the same metrics as 2 straight updates."""
    common = ["algorithm.variants=[{name: vgpo, weight: 0.5}]", "algorithm.scale=group", "logging.save_every=1"]
    assert main(["train", *_vlm_args(tmp_path / "straight", *common, "train.steps=2")]) == 0
    assert main(["train", *_vlm_args(tmp_path / "resumed", *common, "train.steps=1")]) == 0
    assert main(["train", *_vlm_args(tmp_path / "resumed", *common, "train.steps=2", "resume=auto")]) == 0
    straight, resumed = _metrics(tmp_path / "straight"), _metrics(tmp_path / "resumed")
    for key in ("loss", "grad_norm", "advantages/abs_mean"):
        assert resumed[-1][key] == straight[-1][key], key
