"""Shared fixtures. The offline/telemetry environment is set before anything imports prefect or HF."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
_STATE = Path(tempfile.mkdtemp(prefix="fineflow-tests-"))
os.environ.update(
    {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(_STATE / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DVC_NO_ANALYTICS": "1",
        "PREFECT_HOME": str(_STATE / "prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "TOKENIZERS_PARALLELISM": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
)

# Overrides that shrink the repo's params.yaml until every stage runs in seconds on 2 cores.
TINY_OVERRIDES = {
    "seed": 7,
    "model": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 2,
        "num_heads": 2,
        "vocab_size": 400,
        "max_position_embeddings": 256,
    },
    "base": {"corpus_docs": 600, "steps": 4, "batch_size": 4, "seq_len": 64, "warmup_steps": 1},
    "data": {"n_train": 160, "n_eval": 16},
    "tokenize": {"seq_len": 128},
    "checkpoint": {"every_steps": 2},
    "train": {"steps": 4, "micro_batch_size": 2, "warmup_steps": 1, "log_every": 1, "lora": {"r": 4, "alpha": 8}},
    "evaluate": {"batch_size": 8, "max_gen_toks": 8, "limit": 6},
    "promote": {"min_delta": 0.0},
}


def _merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


TINY_PARAMS = _merge(yaml.safe_load((ROOT / "params.yaml").read_text()), TINY_OVERRIDES)


def write_params(path: Path, overrides: dict | None = None) -> Path:
    """The tiny params, plus dotted-key overrides ("train.lr": 1e-3), written as a params.yaml."""
    params = yaml.safe_load(yaml.safe_dump(TINY_PARAMS))
    for dotted, value in (overrides or {}).items():
        node = params
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture
def tiny_params():
    from fineflow.config import parse_params

    return parse_params(yaml.safe_load(yaml.safe_dump(TINY_PARAMS)))


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """The first four stages run once on the tiny config: base model, raw data, validated rows, shards."""
    from fineflow.config import parse_params
    from fineflow.reports import write_json_atomic
    from fineflow.stages import base, data, tokenize, validate

    root = tmp_path_factory.mktemp("built")
    params = parse_params(TINY_PARAMS)
    base.run(params, root / "models/base")
    data.run(params, root / "data/raw/train.jsonl", root / "data/raw/eval.jsonl")
    report = validate.run(
        params,
        root / "data/raw/train.jsonl",
        root / "data/raw/eval.jsonl",
        root / "data/validated",
        root / "reports/validate.json",
        root / "reports/data_docs",
        root / "models/base",
    )
    write_json_atomic(root / "reports/validate.json", report)
    tokenize.run(params, root / "data/validated", root / "models/base", root / "data/shards")
    return root


def copy_project(dest: Path, overrides: dict | None = None) -> Path:
    """A fresh git+DVC checkout of this project's tracked files at dest, with tiny params."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for rel in files:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    write_params(dest / "params.yaml", overrides)
    git = ["git", "-c", "user.name=fineflow-test", "-c", "user.email=test@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run(git + ["add", "-A"], cwd=dest, check=True)
    subprocess.run(git + ["commit", "-qm", "fixture"], cwd=dest, check=True)
    return dest


def venv_env() -> dict[str, str]:
    """Environment for subprocesses: this interpreter's bin first on PATH (dvc.yaml calls `python`)."""
    return {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a test's own rendezvous; never another address)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def expected_lrs(params: dict) -> list[float]:
    """The schedule per optimizer step as fineflow.train.schedule defines it, for any world size."""
    from fineflow.train.schedule import lr_multiplier

    train = params["train"]
    # the logged lr is the one the next step will use: after step s the scheduler has stepped s times
    return [
        train["lr"] * lr_multiplier(s, train["warmup_steps"], train["steps"], train["schedule"])
        for s in range(1, train["steps"] + 1)
    ]
