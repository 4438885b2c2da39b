"""The train stage as DVC runs it, launching 2 ranks of DDP over gloo on CPU."""

import json
import shutil
import subprocess
import sys

from tests.conftest import venv_env, write_params


def test_train_stage_runs_two_processes(built, tmp_path):
    shutil.copytree(built / "data/shards", tmp_path / "data/shards")
    shutil.copytree(built / "models/base", tmp_path / "models/base")
    write_params(tmp_path / "params.yaml", {"train.num_processes": 2})
    result = subprocess.run(
        [sys.executable, "-m", "fineflow.stages.train", "--shards", "data/shards", "--base-dir", "models/base",
         "--checkpoints", "checkpoints", "--out", "models/candidate", "--steps-log", "reports/train_steps.jsonl"],
        cwd=tmp_path, env=venv_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "reports/train.json").read_text())
    assert report["world_size"] == 2 and report["steps"] == 4
    assert (tmp_path / "models/candidate/adapter_model.safetensors").exists()
    # rank 0 alone writes: one step log line per step, not one per rank
    assert len((tmp_path / "reports/train_steps.jsonl").read_text().splitlines()) == 4
