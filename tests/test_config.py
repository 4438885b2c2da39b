"""params.yaml validation: unknown keys and bad values are reported at once, naming the key."""

import pytest

from fineflow.config import load_params, parse_params
from fineflow.errors import ConfigError


def test_repo_params_are_valid():
    from tests.conftest import ROOT

    params = load_params(ROOT / "params.yaml")
    assert params.train.method == "lora" and params.model.is_embedded


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"params.yaml: train.lrr is not a known key"):
        parse_params({"train": {"lrr": 0.1}})


def test_negative_learning_rate_names_key_and_value():
    with pytest.raises(ConfigError, match=r"params.yaml: train.lr must be > 0 \(got -1\)"):
        parse_params({"train": {"lr": -1}})


def test_every_problem_reported_at_once():
    with pytest.raises(ConfigError) as info:
        parse_params({"train": {"lr": -1, "steps": 0}, "bogus": 1, "model": {"hidden_size": 30, "num_heads": 4}})
    message = str(info.value)
    assert message.startswith("4 problem(s) in params.yaml")
    for fragment in ("train.lr", "train.steps", "bogus", "divisible by num_heads"):
        assert fragment in message


def test_yaml_syntax_error_names_line(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("seed: 1\ntrain:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"{path}:\d+: not valid YAML"):
        load_params(path)


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="cannot read parameters"):
        load_params(tmp_path / "nope.yaml")
