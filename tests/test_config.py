"""Typed configs: YAML + dotted overrides, nearest-key errors, type and range checks, round trip."""

import pytest

from mmrl.config import Config, ConfigError, config_from_dict, config_to_dict, describe, dump_config, load_config


def test_defaults_follow_flow_grpo_and_overrides_apply():
    config = config_from_dict({"rewards": {"brightness": 1.0}, "data": {"prompt_list": ["a cat"]}},
                              ["optim.lr=1e-3", "algorithm.advantage_clamp=null", "sampling.sde=cps",
                               "data.eval_seeds=[5, 6]"])
    assert config.optim.lr == 1e-3  # YAML 1.1 reads "1e-3" as a string: coerced to float
    assert config.algorithm.advantage_clamp is None
    assert config.sampling.sde == "cps" and config.data.eval_seeds == [5, 6]
    assert config.sampling.num_steps == 10 and config.algorithm.clip_low == 1e-4 and config.data.group_size == 24


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.stpes=3"], "did you mean 'steps'"),
        (["sampling.nois_level=0.3"], "did you mean 'noise_level'"),
        (["modle.family=sd3"], "did you mean 'model'"),
        (["train.steps=abc"], "train.steps: expected int"),
        (["train.steps=1.5"], "train.steps: expected int"),
        (["model.use_lora=3"], "expected true or false"),
        (["sampling.sde=euler"], "not one of"),
        (["data.group_size=1"], "group_size must be >= 2"),
        (["train.batch_size=5"], "must divide"),
        (["sampling.train_steps=random_window", "sampling.window_size=10"], "longer than the 9 trainable steps"),
        (["rewards={}"], "at least one reward"),
        (["noequals"], "key=value"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_resolved_config_round_trips(tmp_path):
    config = load_config(None, ["train.steps=7"])
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
