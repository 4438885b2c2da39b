"""Param overrides from the Prefect UI: dotted keys, validated against params.yaml's schema all at
once, then written into params.yaml the way `dvc exp run -S` writes them (DVC's own code: comments kept)."""

from __future__ import annotations

import shutil

import pytest
import yaml

from fineflow.core.config import load_params
from fineflow.errors import ConfigError
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
    assert text.startswith("# fineflow hyperparameters") and "# the embedded model's LoRA rate" in text
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


@pytest.mark.slow
def test_params_survive_dvc_exp_runs_rewrite_of_one_key_in_every_section(tmp_path):
    """params.yaml survives DVC's rewrite of it by `dvc exp run -S` (the README's `-S train.lr=1e-3`): the
    quoted `precision: "no"` stays a string (a bare `no` is YAML's false) and every `null` stays null. A real
    `dvc exp run` in a fresh copy sets one key of every section (train.precision to "no" among them) and runs
    the data stage, whose entry validates the whole file; then the values are as set."""
    import json
    import re
    import subprocess
    import sys

    from tests.conftest import copy_project, venv_env

    project = copy_project(tmp_path / "project")
    sets = {
        "seed": "7",
        "model.base": "models/base",
        "base.steps": "5",
        "data.n_train": "120",
        "validate.max_bad_share": "0.2",
        "tokenize.pack_window": "64",
        "train.precision": "no",
        "train.lr": "1e-3",
        "checkpoint.every_minutes": "null",
        "evaluate.limit": "4",
        "promote.min_delta": "0.1",
        "cost.device_hour_usd": "2.5",
        "export.parity_docs": "8",
    }
    assert {key.split(".")[0] for key in sets} >= set(load_params(project / "params.yaml").model_dump(by_alias=True))
    argv = [sys.executable, "-m", "dvc", "exp", "run", "--name", "every-section", "data"]
    for key, value in sets.items():
        argv += ["-S", f"{key}={value}"]
    done = subprocess.run(argv, cwd=project, env=venv_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Running stage 'data'" in done.stdout
    written = (project / "params.yaml").read_text(encoding="utf-8")
    assert re.search(r"^ +precision: no$", written, re.MULTILINE), written  # bare, as DVC writes it
    loaded = load_params(project / "params.yaml")
    assert (loaded.seed, loaded.train.precision, loaded.train.lr, loaded.data.n_train) == (7, "no", 1e-3, 120)
    assert (loaded.checkpoint.every_minutes, loaded.evaluate.limit, loaded.promote.min_delta) == (None, 4, 0.1)
    assert loaded.cost.device_hour_usd == 2.5 and loaded.export.parity_docs == 8
    assert len((project / "data/raw/train.jsonl").read_text().splitlines()) >= 120  # plus the injected bad rows
    shown = subprocess.run(
        [sys.executable, "-m", "dvc", "exp", "show", "--json"], cwd=project, env=venv_env(), capture_output=True
    )
    assert b"every-section" in shown.stdout, shown.stderr
    json.loads(shown.stdout)
