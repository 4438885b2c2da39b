"""Param overrides from the Prefect UI (issue 16): dotted keys, validated against params.yaml's schema all at
once, then written into params.yaml the way `dvc exp run -S` writes them (DVC's own code: comments kept)."""

from __future__ import annotations

import shutil

import pytest
import yaml

from fineflow.config import ConfigError, load_params
from fineflow.overrides import apply
from tests.conftest import ROOT


def test_overrides_are_written_as_dvc_exp_run_writes_them_keeping_the_files_comments(tmp_path):
    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    applied = apply(params, {"train.lr": 0.001, "seed": 3, "train.lora.r": 16, "evaluate.tasks": ["fineflow_synth"]})
    assert applied == ["train.lr=0.001", "seed=3", "train.lora.r=16", 'evaluate.tasks=["fineflow_synth"]']
    loaded = load_params(params)
    assert (loaded.train.lr, loaded.seed, loaded.train.lora.r) == (0.001, 3, 16)
    assert loaded.evaluate.tasks == ["fineflow_synth"]
    text = params.read_text(encoding="utf-8")
    assert text.startswith("# fineflow hyperparameters") and "# tiny models take a high LoRA learning rate" in text
    untouched = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
    assert yaml.safe_load(text)["base"] == untouched["base"]  # nothing else moved
    assert apply(params, {}) == []


def test_every_refused_override_is_named_at_once_and_nothing_is_written(tmp_path):
    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    before = params.read_bytes()
    with pytest.raises(ConfigError) as refused:
        apply(params, {"train.lrr": 0.1, "train.lr": -1, "seed.value": 1, "train.steps": 5})
    message = str(refused.value)
    assert "nothing applied" in message
    assert "train.lrr" in message and "train.lr" in message and "seed.value: seed is a value" in message
    assert params.read_bytes() == before
