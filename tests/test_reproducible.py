"""Reproducibility: two fresh training runs with the same params, data and seed on CPU give a bit-identical
adapter (sha256 equal). In-process runs of the train worker on the tiny config, each in its own directory
(no checkpoint to resume from), with accelerate's global state reset in between."""

import hashlib

from tests.conftest import TINY_PARAMS, _merge


def _train(built, workdir, params) -> tuple[str, bytes]:
    from accelerate.state import AcceleratorState

    from fineflow.train import procedure

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        procedure.train_rank(
            params,
            built / "data/shards",
            built / "models/base",
            workdir / "checkpoints",
            workdir / "candidate",
            workdir / "train_steps.jsonl",
            workdir / "logs",
        )
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    adapter = workdir / "candidate/adapter_model.safetensors"
    return hashlib.sha256(adapter.read_bytes()).hexdigest(), (workdir / "candidate/adapter_config.json").read_bytes()


def test_two_fresh_runs_give_bit_identical_adapters(built, tmp_path):
    from fineflow.core.config import parse_params

    params = parse_params(_merge(TINY_PARAMS, {"train": {"tracker": "none"}}))
    first, second = _train(built, tmp_path / "one", params), _train(built, tmp_path / "two", params)
    assert first[0] == second[0], "the adapters differ between two identical runs"
    assert first[1] == second[1]
