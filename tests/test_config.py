"""Typed configs: YAML + dotted overrides, nearest-key errors, type and range checks, round trip."""

import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest
import yaml

from fixtures import TINY_RECIPE
from mmrl.config import (FIELDS_HEADER, Config, ConfigError, config_from_dict, config_to_dict, describe, dump_config,
                         load_config)


def test_defaults_follow_flow_grpo_and_overrides_apply():
    config = config_from_dict({"rewards": {"brightness": 1.0}, "data": {"prompt_list": ["a cat"]}},
                              ["optim.lr=1e-3", "algorithm.advantage_clamp=null", "sampling.sde=cps",
                               "data.eval_seeds=[5, 6]"])
    assert config.optim.lr == 1e-3  # YAML 1.1 reads "1e-3" as a string: coerced to float
    assert config.algorithm.advantage_clamp is None
    assert config.sampling.sde == "cps" and config.data.eval_seeds == [5, 6]
    assert config.sampling.num_steps == 10 and config.algorithm.clip_low == 1e-4 and config.data.group_size == 24


def test_a_section_given_as_a_mapping_merges_into_the_files_section():
    # "model={...}" replaced the whole section: the file's dtype, resolution and LoRA rank fell back to the GPU
    # defaults; "train={steps: 2}" lost batch_size and failed on an unrelated check
    config = load_config(TINY_RECIPE, ["model={family: sd3, lora_rank: 8}", "train={steps: 2}"])
    file = load_config(TINY_RECIPE)
    assert config.model.lora_rank == 8 and config.train.steps == 2
    assert (config.model.dtype, config.model.resolution, config.train.batch_size) == (
        file.model.dtype, file.model.resolution, file.train.batch_size)
    # a mapping-valued field is replaced, not merged
    assert load_config(TINY_RECIPE, ["rewards={saturation: 1.0}"]).rewards == {"saturation": 1.0}
    assert load_config(TINY_RECIPE, ["eval={options: {num_steps: 3}}"]).eval.options == {"num_steps": 3}
    with pytest.raises(ConfigError, match="model.lora_rnak"):
        load_config(TINY_RECIPE, ["model={lora_rnak: 8}"])
    # YAML reads an unquoted no as false: the error says to quote it
    with pytest.raises(ConfigError, match="quote the text"):
        load_config(TINY_RECIPE, ["train.mixed_precision=no"])
    assert load_config(TINY_RECIPE, ["train.mixed_precision='no'"]).train.mixed_precision == "no"


def test_flux_takes_fluxpipelines_sampling_defaults():
    # a FLUX config that leaves them out gets FluxPipeline's T5 budget and guidance (512, 3.5), not SD3's 256 and
    # Flow-GRPO's CFG 4.5; what a config sets is kept; SD3 keeps the dataclass defaults
    base = {"rewards": {"brightness": 1.0}, "data": {"prompt_list": ["a cat"]}}
    flux = config_from_dict({**base, "model": {"family": "flux", "pretrained": "tiny:flux"}})
    assert (flux.sampling.max_sequence_length, flux.sampling.guidance_scale) == (512, 3.5)
    set_here = config_from_dict({**base, "model": {"family": "flux", "pretrained": "tiny:flux"}},
                                ["sampling.guidance_scale=2.0"])
    assert (set_here.sampling.max_sequence_length, set_here.sampling.guidance_scale) == (512, 2.0)
    sd3 = config_from_dict(base)
    assert (sd3.sampling.max_sequence_length, sd3.sampling.guidance_scale) == (256, 4.5)
    with pytest.raises(ConfigError, match="max_sequence_length must be <= 512"):
        config_from_dict(base, ["sampling.max_sequence_length=600"])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.stpes=3"], "did you mean 'train.steps'"),
        (["sampling.nois_level=0.3"], "did you mean 'sampling.noise_level'"),
        (["modle.family=sd3"], "did you mean 'model'"),
        (["optim.zzz=3"], "valid keys in optim: adam_eps, betas"),
        (["model.num_steps=4"], "'model.num_steps': 'num_steps' belongs to another section; did you mean "
                                "'sampling.num_steps'"),  # listed the model section's keys
        (["lr=1e-4"], "'lr' belongs to another section; did you mean 'optim.lr'"),
        (["train.steps=abc"], "train.steps: expected int"),
        (["train.steps=1.5"], "train.steps: expected int"),
        (["model.use_lora=3"], "expected true or false"),
        (["sampling.sde=euler"], "not one of"),
        (["data.group_size=1"], "group_size must be >= 2"),
        (["train.batch_size=5"], "must divide"),
        (["sampling.train_steps=random_window", "sampling.window_size=10"], "longer than the 9 trainable steps"),
        (["sampling.num_steps=10", "sampling.timestep_fraction=0.05"], r"trains int\(10 x 0.05\) = 0 of the 10"),
        (["sampling.num_steps=10", "sampling.train_steps=random_fraction", "sampling.timestep_fraction=0.1"],
         r"int\(9 x 0.1\) = 0 .* at least 0.1111"),
        (["rewards={}"], "at least one reward"),
        (["noequals"], "key=value"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY_RECIPE, overrides)


def test_resolved_config_round_trips(tmp_path):
    config = load_config(TINY_RECIPE, ["train.steps=7"])
    dump_config(config, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert config_to_dict(again) == config_to_dict(config)
    assert isinstance(again, Config)


def test_every_field_is_documented():
    lines = describe()
    assert len(lines) > 60
    assert all("#" in line and not line.rstrip().endswith("#") for line in lines)


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_unknown_key_names_the_full_dotted_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.stpes'; did you mean 'train\.steps'\?"):
        load_config(TINY_RECIPE, ["train.stpes=3"])
    with pytest.raises(ConfigError, match=r"did you mean 'generation\.max_new_tokens'"):
        load_config(TINY_RECIPE, ["generation.max_new_token=3"])



def test_a_key_yaml_reads_as_a_boolean_or_number_is_a_config_error():
    """YAML 1.1 reads an unquoted on / yes / no as a boolean and 1 as an int: a section or a mapping field with such
    a key is a ConfigError naming it, not a TypeError from the nearest-key search."""
    with pytest.raises(ConfigError, match=r"config key 'logging\.True' \(bool\) is not a name"):
        load_config(TINY_RECIPE, ["logging={on: 1}"])
    with pytest.raises(ConfigError, match=r"rewards: key 1 \(int\) is not a name"):
        load_config(TINY_RECIPE, ["rewards={1: 1.0}"])
    from mmrl.pretrain import pretrain_config_from_dict

    with pytest.raises(ConfigError, match=r"config key 'vae\.1' \(int\) is not a name"):
        pretrain_config_from_dict({"vae": {1: 2}})

RANGE_ERRORS = [
    (["optim.lr=0"], "optim.lr must be > 0"),
    (["optim.lr=-1e-4"], "optim.lr must be > 0"),
    (["model.lora_rank=0"], "model.lora_rank must be >= 1"),
    (["model.lora_alpha=0"], "model.lora_alpha must be > 0"),
    (["model.lora_dropout=1.0"], r"model.lora_dropout must be in \[0, 1\)"),
    (["model.lora_dropout=-0.1"], r"model.lora_dropout must be in \[0, 1\)"),
    (["model.lora_target_modules=[3]"], "lora_target_modules must be a list of module names"),
    (["model.resolution=0"], "model.resolution must be >= 16"),
    (["model.pretrained=''"], "model.pretrained must name a model"),
    (["optim.max_grad_norm=-1"], "optim.max_grad_norm must be >= 0"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay must be >= 0"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps must be >= 0"),
    (["optim.adam_eps=0"], "optim.adam_eps must be > 0"),
    (["optim.betas=[0.9]"], "optim.betas must be two numbers"),
    (["optim.betas=[0.9, 1.0]"], "optim.betas must be two numbers"),
    (["train.sample_batch_size=0"], "train.sample_batch_size must be >= 1"),
    (["train.reward_batch_size=0"], "train.reward_batch_size must be >= 1"),
    (["sampling.eval_num_steps=0"], "sampling.eval_num_steps must be >= 1"),
    (["sampling.max_sequence_length=0"], "sampling.max_sequence_length must be >= 1"),
    (["sampling.time_shift=0"], "sampling.time_shift must be > 0"),
    (["algorithm.variants=[{name: adaptive_noise, rate: -1}]"], "rate must be >= 0"),
    (["sampling.num_steps=3", "sampling.noise_schedule=[0.1, -0.2, 0.3]"], "noise_schedule must be a list of noise"),
    (["sampling.noise_level=.nan"], "sampling.noise_level: must be a finite number"),
    (["optim.lr=.inf"], "optim.lr: must be a finite number"),
    (["logging.eval_every=-1"], "logging.eval_every must be >= 0"),
    (["logging.save_every=-1"], "logging.save_every must be >= 0"),
    (["data.num_eval_prompts=0"], "data.num_eval_prompts must be >= 1"),
    (["data.eval_seeds=[]"], "data.eval_seeds must not be empty"),
    (["data.eval_seeds=[a]"], "data.eval_seeds must be a list of integer seeds"),
    (["data.prompt_list=[3]"], "data.prompt_list must be a list of non-empty strings"),
    (["algorithm.advantage_clamp=0"], "algorithm.advantage_clamp must be > 0"),
    (["algorithm.beta=-0.1"], "algorithm.beta must be >= 0"),
    (["algorithm.kl_bias_correction=true"], "kl_bias_correction weights the KL term: it needs algorithm.beta > 0"),
    (["algorithm.kl_bias_correction=true", "algorithm.beta=0.04", "algorithm.ratio_level=sequence",
      "train.timestep_chunk=2"],
     "kl_bias_correction with ratio_level=sequence needs train.timestep_chunk: 0"),
    (["algorithm.variants=[{name: ga_grpo, reward: x, floor: 2}]"], r"floor must be in \[0, 1\]"),
    (["algorithm.variants=[{name: tw_grpo, max_weight: 0.5}]"], "max_weight must be >= 1"),
    (["algorithm.variants=[{name: tw_grpo, max_wieght: 2}]"], "has no option 'max_wieght'; did you mean 'max_weight'"),
    (["algorithm.variants=[tw_grp]"], "unknown variant 'tw_grp'; did you mean 'tw_grpo'"),
    (["algorithm.variants=[{max_weight: 2}]"], r"expected a variant name or \{name"),
    (["algorithm.variants=[tw_grpo, tw_grpo]"], "'tw_grpo' is listed 2 times"),
    (["algorithm.variants=[g2rpo, vgpo]"], "g2rpo and vgpo both replace the 'advantages' stage"),
    (["algorithm.variants=[{name: tw_grpo, max_weight: many}]"], r"variants\[0\].max_weight: expected float"),
    (["algorithm.variants=[mmrl.nothing_here:Variant]"], "cannot import 'Variant' from 'mmrl.nothing_here'"),
    (["algorithm.variants=[mmrl.config:Config]"], "not a subclass of mmrl.algorithms.Variant"),
    (["algorithm.token_weight_max=1.4"], r"'algorithm.token_weight_max' is now an algorithm variant: write "
                                         r"algorithm.variants: \[\{name: tw_grpo, max_weight: 1.4\}\]"),
    (["seed=-1"], r"seed must be in \[0, 2\*\*63\)"),
    (["rewards={brightness: 0}"], "every weight is 0"),
    (["rewards={brightness: .nan}"], r"rewards.brightness: the weight must be a finite number"),
    (["rewards={brightness: {weight: [1]}}"], r"rewards.brightness: the weight must be a finite number, got \[1\]"),
    (["rewards={box_coordinate: 1}"], r"reward 'box_coordinate' needs the argument\(s\) coordinate"),
    (["rewards={brightness: {weight: 1, kwargs: [1]}}"], "kwargs must be a mapping"),
    (["output_dir=''"], "output_dir must not be empty"),
    (["sampling.train_steps=random_window", "sampling.window_range=[0, 10]"],
     r"sampling.window_range: \[0, 10\] must lie in 0..9"),
    (["sampling.window_range=[0, 2]"], "sampling.window_range is where train_steps=random_window draws its window"),
    (["sampling.train_steps=random_fraction", "algorithm.variants=[step_gain]"],
     "its step gains need contiguous trained steps; sampling.train_steps=random_fraction"),
    (["sampling.guidance_scale=1.0", "sampling.cfg_detach_uncond=false"],
     "cfg_detach_uncond: false changes the gradient of classifier-free guidance's unconditional half"),
    (["algorithm.kl_estimator=low_var_kl", "algorithm.beta=0.04"],
     "kl_estimator=low_var_kl applies to VLM policies"),
    # values that crashed deep in the first rollout or silently meant nothing
    (["sampling.noise_level=0"], r"must be > 0 for sde=flow_grpo: its step log-probability divides by the noise"),
    (["sampling.noise_level=null", "sampling.sde=dance", "sampling.num_steps=3", "sampling.noise_schedule=[0.5, 0, 0.5]"],
     r"must be > 0 for sde=dance"),
    (["sampling.guidance_scale=-3"], "sampling.guidance_scale must be >= 0"),
    (["optim.ema=true", "optim.ema_decay=1.0"], r"optim.ema_decay in \[0, 1\) \(at 1 the EMA never moves"),
    (["algorithm.clip_low=2"], "algorithm.clip_low must be < 1"),
    (["model.pretrained=tiny:bogus"], r"model.pretrained=tiny:bogus: the tiny random models of model.family=sd3 are "
                                      r"tiny:sd3"),
]


@pytest.mark.parametrize("overrides,message", RANGE_ERRORS, ids=[o[0] for o, _ in RANGE_ERRORS])
def test_values_that_would_crash_later_are_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY_RECIPE, overrides)


def test_lora_fields_are_not_checked_without_lora():
    config = load_config(TINY_RECIPE, ["model.use_lora=false", "model.lora_rank=0"])
    assert config.model.lora_rank == 0


VLM = Path(__file__).parents[1] / "configs/tiny/vlm_grounding.yaml"


@pytest.mark.parametrize("overrides,message", [
    (["generation.top_k=-1"], "generation.top_k must be >= 0"),
    (["generation.min_pixels=1000", "generation.max_pixels=10"], "min_pixels must be <= generation.max_pixels"),
    (["generation.video_fps=0"], "generation.video_fps must be > 0"),
    (["generation.video_nframes=1"], "generation.video_nframes must be >= 2"),
    (["generation.question_template='{question} {oops}'"], r"only \{question\} may be in braces"),
    (["data.eval_prompts=[a cat]"], "data.eval_prompts is for flow policies"),
    (["algorithm.kl_estimator=k1", "algorithm.beta=0"],
     "kl_estimator=k1 estimates the KL term: it needs algorithm.beta > 0"),
    (["algorithm.kl_estimator=k4", "algorithm.beta=0.04"], "algorithm.kl_estimator"),
])
def test_vlm_generation_values_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(VLM, overrides, check_files=False)


def test_the_section_the_other_family_reads_is_named_as_ignored(caplog):
    """A flow policy never reads ``generation.*`` and a VLM never reads ``sampling.*``: setting one is logged as
    ignored, naming the fields (a warning rather than an error: a config switched to the other family with
    ``model.family`` keeps the section it was written with). Left at its defaults it says nothing."""
    with caplog.at_level("WARNING", logger="mmrl.config"):
        load_config(TINY_RECIPE, ["generation.temperature=0.5", "generation.tools=[crop]"], check_files=False)
    assert "generation.temperature, generation.tools ignored: generation.* applies to VLM policies" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mmrl.config"):
        load_config(VLM, ["sampling.num_steps=4"], check_files=False)
        assert "sampling.num_steps ignored: sampling.* applies to flow policies" in caplog.text
        caplog.clear()
        load_config(TINY_RECIPE, ["generation.temperature=1.0"], check_files=False)  # the default: not set
        load_config(VLM, ["generation.temperature=0.5"], check_files=False)
    assert "ignored" not in caplog.text
    # the fields of the shared sections that only the other family reads
    with caplog.at_level("WARNING", logger="mmrl.config"):
        load_config(TINY_RECIPE, ["data.dataset=tiny:grounding", "model.attn_implementation=sdpa"], check_files=False)
    assert "data.dataset, model.attn_implementation ignored: they are read by VLM policies" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mmrl.config"):
        load_config(VLM, ["data.prompt_list=[a cat]", "model.resolution=64"], check_files=False)
    assert "data.prompt_list, model.resolution ignored: they are read by flow policies" in caplog.text


VLM_ERRORS = [
    (["generation.engine=vllm", "algorithm.sampler_correction_max=null", "algorithm.sampler_correction_min=-1"],
     r"algorithm.sampler_correction_min must be in \[0, sampler_correction_max\)"),
    (["model.attn_implementation=bogus"], r"model.attn_implementation='bogus': transformers' kernels are eager, sdpa"),
    (["model.pretrained=tiny:sd3"], r"the tiny random models of model.family=qwen_vl are tiny:qwen2_5_vl"),
]


@pytest.mark.parametrize("overrides,message", VLM_ERRORS, ids=[o[0] for o, _ in VLM_ERRORS])
def test_vlm_values_that_would_fail_at_load_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(VLM, overrides, check_files=False)


UNREAD = [  # (config, overrides, the warning): each was accepted silently and changed nothing
    (TINY_RECIPE, ["model.use_lora=false", "model.lora_rank=64", "model.lora_dropout=0.5"],
     "model.lora_rank, model.lora_alpha, model.lora_dropout, model.lora_target_modules ignored: they apply only "
     "with model.use_lora: true"),
    (TINY_RECIPE, ["optim.ema_decay=0.5"], "optim.ema_decay ignored: it applies only with optim.ema: true"),
    (TINY_RECIPE, ["sampling.window_size=5"], "sampling.window_size ignored: it applies only with "
                                              "sampling.train_steps: random_window or sliding_window"),
    (TINY_RECIPE, ["sampling.train_steps=random_window", "sampling.window_shift_every=5"],
     "sampling.window_shift_every ignored: it applies only with sampling.train_steps: sliding_window"),
    (TINY_RECIPE, ["sampling.train_steps=sliding_window", "sampling.timestep_fraction=0.3"],
     "sampling.timestep_fraction ignored: it applies only with sampling.train_steps: fraction or random_fraction"),
    (TINY_RECIPE, ["sampling.merge_groups=3"], "sampling.merge_groups ignored: it applies only with "
                                               "sampling.train_steps: entropy_merge"),
    (TINY_RECIPE, ["optim.ema=true", "optim.ema_every_minibatch=true", "train.gradient_accumulation_steps=1"],
     "optim.ema_every_minibatch ignored: it applies only with train.gradient_accumulation_steps > 1"),
    (TINY_RECIPE, ["data.prompts=shapeworld:train"], "data.prompt_list ignored: it applies only with data.prompts "
                                                     "unset"),
    (TINY_RECIPE, ["sampling.intermediate=x0"], "sampling.intermediate ignored: it applies only with a variant that "
                                                "uses the intermediate images"),
    (TINY_RECIPE, ["sampling.num_steps=3", "sampling.noise_schedule=[0.5, 0.5, 0.5]"],
     "sampling.noise_level ignored: it applies only with an empty sampling.noise_schedule"),
    (VLM, ["generation.max_tool_calls=0", "generation.tool_response_template=x"],
     "generation.max_tool_calls, generation.tool_response_template ignored: they apply only with generation.tools"),
    (VLM, ["generation.video_nframes=16", "generation.video_max_frames=4", "generation.video_fps=8"],
     "generation.video_fps, generation.video_max_frames ignored: they apply only with generation.video_nframes: "
     "null"),
    (VLM, ["generation.engine=vllm", "algorithm.sampler_correction=none", "algorithm.sampler_correction_max=10"],
     "algorithm.sampler_correction_max ignored: it applies only with an algorithm.sampler_correction other than "
     "none"),
    (VLM, ["train.sample_batch_size=3", "train.overlap_scoring=true"],
     "train.sample_batch_size, train.overlap_scoring ignored: they are read by flow policies"),
]


@pytest.mark.parametrize("config,overrides,warning", UNREAD, ids=[o[-1] for _, o, _ in UNREAD])
def test_fields_read_only_under_another_setting_are_logged_as_ignored(caplog, config, overrides, warning):
    """A warning, not an error: turning a setting off on the command line (``model.use_lora=false`` on a LoRA recipe,
    as the README's full fine-tuning runs do) and resuming that run from its saved config.yaml must keep working."""
    with caplog.at_level("WARNING", logger="mmrl.config"):
        load_config(config, overrides, check_files=False)
    assert warning in caplog.text


def test_fields_that_need_another_setting_are_quiet_with_it(caplog):
    with caplog.at_level("WARNING", logger="mmrl.config"):
        load_config(TINY_RECIPE, ["model.use_lora=true", "model.lora_rank=64", "optim.ema=true",
                                  "optim.ema_decay=0.5", "sampling.train_steps=sliding_window",
                                  "sampling.window_size=3", "sampling.window_shift_every=5",
                                  "sampling.intermediate=x0", "algorithm.variants=[step_gain]", "eval.every=2",
                                  "eval.benchmarks=[ocr]", "eval.limit=3", "sampling.noise_level=0",
                                  "sampling.sde=cps"], check_files=False)
        load_config(VLM, ["generation.tools=[crop]", "generation.max_tool_calls=3", "generation.video_fps=8",
                          "model.attn_implementation=kernels-community/flash-attn", "model.pretrained=tiny:qwen3_vl"],
                    check_files=False)
    assert "ignored" not in caplog.text


def test_tiny_kinds_are_the_builders():
    from mmrl.config import TINY_KINDS
    from mmrl.pipelines.flow import tiny as flow_tiny
    from mmrl.pipelines.vlm import tiny as vlm_tiny

    assert set(TINY_KINDS["sd3"] + TINY_KINDS["flux"]) == set(flow_tiny._BUILDERS)
    assert set(TINY_KINDS["qwen_vl"]) == set(vlm_tiny._BUILDERS)


def test_every_numeric_field_has_a_range_check_or_is_unbounded():
    """Guard for new fields: each int/float field is named in validate() or listed here as free."""
    import inspect

    import mmrl.config as module

    free = {"seed", "merge_threshold", "merge_groups", "noise_level", "timestep_fraction",
            "window_size", "window_shift_every", "eps", "std_ddof", "clip_high", "ema_update_interval", "keep_last", "steps", "inner_epochs",
            "batch_size", "gradient_accumulation_steps", "timestep_chunk", "num_steps", "group_size",
            "prompts_per_step", "temperature", "top_p", "max_new_tokens", "max_prompt_length", "resolution"}
    source = inspect.getsource(module.validate)

    def fields(cls):
        for f in dataclasses.fields(cls):
            hint = module.typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(hint):
                yield from fields(hint)
            elif module._type_names(hint) & {"int", "float"}:
                yield f.name

    unchecked = [name for name in fields(Config) if f".{name}" not in source and name not in free]
    assert unchecked == []


def test_wandb_project_without_wandb_is_a_config_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logging.wandb_project='demo' needs wandb.*`pip install wandb`"):
        load_config(TINY_RECIPE, ["logging.wandb_project=demo"])
    # a machine-dependent check: skipped with check_files=False (`mmrl config validate --no-check-files`)
    assert load_config(TINY_RECIPE, ["logging.wandb_project=demo"], check_files=False).logging.wandb_project == "demo"


def test_resume_path_must_be_a_complete_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="resume: checkpoint folder not found"):
        load_config(TINY_RECIPE, [f"resume={tmp_path / 'nope'}"])
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match="not a complete checkpoint .*resume=auto with output_dir="):
        load_config(TINY_RECIPE, [f"resume={tmp_path / 'run'}"])


def test_help_fields_are_yaml_literals_that_parse_back_to_the_defaults():
    text = FIELDS_HEADER + "\n" + "\n".join(describe())
    assert yaml.safe_load(text) == config_to_dict(Config())
    lines = describe()
    assert "  revision: null  # " in "\n".join(lines) and "  use_lora: true  # " in "\n".join(lines)
    assert any(line.startswith("  betas: [0.9, 0.999]  #") for line in lines)
    assert not any(": None  #" in line or ": True  #" in line or ": False  #" in line for line in lines)
    assert all(line.startswith("# ") for line in FIELDS_HEADER.splitlines())
    header = " ".join(FIELDS_HEADER.split())
    assert "Keys a config file leaves out take these defaults" in header
    assert "SD3.5-Medium / Flow-GRPO GPU settings, NOT the CPU run" in header
    assert "mmrl/default.yaml" in header


def test_help_fields_with_values_show_a_configs_values():
    config = load_config(VLM, check_files=False)
    assert yaml.safe_load("\n".join(describe(values=config))) == config_to_dict(config)


def test_load_config_documents_where_defaults_come_from():
    doc = " ".join(load_config.__doc__.split())
    assert "Keys a config file leaves out take the dataclass defaults" in doc
    assert "SD3.5-Medium / Flow-GRPO GPU settings, not the CPU ones" in doc


def test_yaml_errors_are_one_line_with_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: 3\n bad: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    message = str(info.value)
    assert "\n" not in message and "at at" not in message
    assert message.startswith(f"{bad}: not valid YAML: line 3, column 2: ")
    with pytest.raises(ConfigError) as info:
        load_config(TINY_RECIPE, ["train.steps=["])
    message = str(info.value)
    assert message.startswith("override 'train.steps=[': the value is not valid YAML (line 1, column 2")
    assert "\n" not in message
    with pytest.raises(ConfigError, match="is not a dotted key"):
        load_config(TINY_RECIPE, ["train.=3"])


def test_missing_files_say_how_relative_paths_resolve(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(VLM, ["data.dataset=data/x.jsonl"])
    assert (f"data.dataset: file not found: data/x.jsonl (relative paths are resolved from the working directory "
            f"{Path.cwd()}; `mmrl config validate --no-check-files` skips this check)") in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(TINY_RECIPE, ["data.prompts=prompts/p.txt"])
    assert "data.prompts: prompt file not found: prompts/p.txt (relative paths are resolved from" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(TINY_RECIPE, [f"data.prompts={tmp_path / 'abs.txt'}"])
    assert "relative paths" not in str(info.value) and "--no-check-files` skips this check" in str(info.value)
    with pytest.raises(ConfigError, match=f"data.prompts: {tmp_path} is a folder; name a prompt file"):
        load_config(TINY_RECIPE, [f"data.prompts={tmp_path}"])  # said "prompt file not found" of a folder
    # relative to the working directory, not to the config file's folder
    (tmp_path / "sub").mkdir()
    (tmp_path / "p.txt").write_text("a cat\n")
    config_file = tmp_path / "sub" / "c.yaml"
    config_file.write_text("data: {prompts: p.txt}\nrewards: {brightness: 1.0}\n")
    assert load_config(config_file).data.prompts == "p.txt"
    os.chdir(tmp_path / "sub")
    with pytest.raises(ConfigError, match="prompt file not found: p.txt"):
        load_config(config_file)


def test_a_config_that_is_not_a_mapping_or_repeats_a_section_is_refused(tmp_path):
    for text, message in (("- 1\n- 2\n", "expected a mapping of sections at the top level"),
                          ("3\n", "got a int"),
                          ("seed: 1\nlogging:\n  keep_last: 2\ntrain:\n  steps: 2\nlogging:\n  keep_last: 3\n",
                           r"line 6, column 1: duplicate key 'logging' \(also on line 2\)")):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_config(path)


def test_a_pixel_floor_beyond_the_prompt_length_is_refused_before_any_media_is_decoded():
    """generation.min_pixels / video_min_pixels that alone need more vision tokens than max_prompt_length (at 32 x 32
    pixels a token, the fewest tokens of any Qwen-VL) are a ConfigError, not a run that decodes every frame at 100 MP
    and dies of memory."""
    from mmrl.config import config_from_dict

    vlm = {"model": {"family": "qwen_vl", "pretrained": "tiny:qwen2_5_vl"}, "rewards": {"iou": 1.0},
           "data": {"dataset": "tiny:grounding"}, "generation": {"max_prompt_length": 1024}}
    for key, what in (("video_min_pixels", "every pair of video frames"), ("min_pixels", "every image")):
        with pytest.raises(ConfigError, match=rf"generation.{key}=100000000: {what} would take at least 97656 "
                                              rf"vision tokens, more than generation.max_prompt_length=1024"):
            config_from_dict({**vlm, "generation": {"max_prompt_length": 1024, key: 100_000_000}}, check_files=False)
        # at the limit it is the data check's business (a prompt's text adds tokens too)
        config_from_dict({**vlm, "generation": {"max_prompt_length": 1024, key: 1024 * 1024}}, check_files=False)

def test_output_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="is a file; name a folder"):
        load_config(TINY_RECIPE, [f"output_dir={tmp_path / 'afile'}"])
    # a folder under a file failed after the model loaded, with a bare [Errno 20] naming no field
    with pytest.raises(ConfigError, match=f"output_dir={tmp_path / 'afile' / 'sub' / 'run'}: {tmp_path / 'afile'} is "
                                          f"a file, so no folder can be made under it"):
        load_config(TINY_RECIPE, [f"output_dir={tmp_path / 'afile' / 'sub' / 'run'}"])


def test_vlm_configs_take_trls_advantage_and_loss_defaults():
    """model.family: qwen_vl: the algorithm keys a config leaves out are TRL 1.16's GRPOConfig defaults
    (scale_rewards group, unbiased std, no clamp, epsilon 0.2, loss_type dapo), not Flow-GRPO's clip 1e-4; a key the
    config or an override sets wins; flow configs keep the dataclass (Flow-GRPO) defaults."""
    from mmrl.config import config_from_dict

    vlm = {"model": {"family": "qwen_vl", "pretrained": "tiny:qwen2_5_vl"}, "rewards": {"iou": 1.0},
           "data": {"dataset": "tiny:grounding"}}
    a = config_from_dict(vlm, check_files=False).algorithm
    assert (a.scale, a.std_ddof, a.advantage_clamp, a.clip_low, a.clip_high, a.aggregation, a.eps) == \
        ("group", 1, None, 0.2, None, "dapo", 1e-4)
    a = config_from_dict({**vlm, "algorithm": {"clip_low": 0.3}}, ["algorithm.aggregation=grpo"],
                         check_files=False).algorithm
    assert (a.clip_low, a.aggregation, a.scale) == (0.3, "grpo", "group")
    assert config_from_dict({**vlm, "algorithm": None}, check_files=False).algorithm.clip_low == 0.2  # `algorithm:`
    flow = config_from_dict({"rewards": {"brightness": 1.0}, "data": {"prompt_list": ["a cat"]}},
                            check_files=False).algorithm
    assert (flow.scale, flow.std_ddof, flow.advantage_clamp, flow.clip_low, flow.aggregation) == \
        ("batch", 0, 5.0, 1e-4, "grpo")
