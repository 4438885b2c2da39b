"""Gradient accumulation on every backend: one optimizer step per train.grad_accum micro-batches, and every step's
loss still "sum / global trained tokens". fit() accumulates through accelerate (accelerator.accumulate), which
DeepSpeed's engine needs to step once per optimizer step; accelerate (DDP, one process) and DeepSpeed (inside its
backward) each divide the loss by the accumulation steps, which fit() compensates.

Every run here trains grad_accum 2 on the reference run's global batch (4 rows a step: micro-batch 4 on 1 process,
no accumulation; shared with tests/test_ddp.py) and must match it step by step: the train stage on 1 process and on 2
DDP ranks over gloo, and fit() under DeepSpeed's real engine (ZeRO-2 and ZeRO-3, 2 ranks over gloo on the CPU,
tests/deepspeed_worker.py; skipped without the deepspeed package).

    .venv/bin/python -m pytest tests/test_accumulation.py -q -p no:randomly
"""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from fineflow.train.launch import resolve_profile
from tests.conftest import (
    ROOT,
    TRAIN_OVERRIDES,
    expected_lrs,
    finish_train,
    launch_with_free_port,
    run_together,
    train_project,
)

pytestmark = pytest.mark.slow  # every test here launches training processes

STEPS = TRAIN_OVERRIDES["train.steps"]


def _steps(folder):
    return [json.loads(line) for line in (folder / "train_steps.jsonl").read_text().splitlines()]


def _accumulating(built, path, ranks: int):
    """A project that trains the reference's 4 rows a step as ranks x micro-batch x 2 accumulated micro-batches."""
    overrides = {"train.num_processes": ranks, "train.micro_batch_size": 2 // ranks, "train.grad_accum": 2}
    return train_project(built, path, overrides)


def _matches_the_reference(steps, reference, project):
    """The same rows, schedule, loss and gradient norm at every step. 1e-4 (not bit equality): the gradient sums run
    in another order; an uncompensated division by the accumulation steps halves the gradient norm."""
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["tokens"] for s in steps] == [s["tokens"] for s in reference]
    lrs = expected_lrs(yaml.safe_load((project / "params.yaml").read_text()))
    assert [s["lr"] for s in steps] == pytest.approx(lrs, rel=1e-9)
    for key in ("loss", "grad_norm"):
        assert [s[key] for s in steps] == pytest.approx([s[key] for s in reference], rel=1e-4), key


def _optimizer_steps(project) -> set[int]:
    """How often the optimizer really stepped: AdamW's per-parameter step counters in the final checkpoint
    (accelerate's optimizer wrapper skips a step() that falls before the accumulation boundary)."""
    from fineflow.checkpoint import load_checkpoint

    (final,) = [c for c in map(load_checkpoint, project.glob("checkpoints/*/step-*")) if c.step == STEPS]
    return {int(entry["step"]) for entry in final.optimizer_state_dict["state"].values()}


@pytest.mark.parametrize("ranks", [1, 2], ids=["1 process", "2 DDP ranks"])
def test_the_train_stage_steps_once_per_grad_accum_micro_batches(ranks, built, reference_run, tmp_path):
    project = _accumulating(built, tmp_path, ranks)
    finish_train(project, ranks)
    _matches_the_reference(_steps(project / "reports"), _steps(reference_run(1) / "reports"), project)
    assert _optimizer_steps(project) == {STEPS}  # not STEPS x grad_accum


def _cpu_deepspeed_profile(name: str, path, port: int):
    """The shipped DeepSpeed profile (its deepspeed_config as is) on 2 CPU ranks in fp32 on the given port."""
    profile = yaml.safe_load(resolve_profile(name).read_text())
    profile.update(num_processes=2, mixed_precision="no", main_process_port=port)
    path.write_text(yaml.safe_dump(profile))
    return path


@pytest.mark.parametrize("name", ["deepspeed_zero2", "deepspeed_zero3"])
def test_deepspeed_steps_once_per_grad_accum_micro_batches(name, built, reference_run, tmp_path):
    """DeepSpeed's engine takes train.steps optimizer steps (before the fix: one per micro-batch, 24), with the batch
    settings from params, and trains what DDP and one process train."""
    pytest.importorskip("deepspeed")
    project, out, log = _accumulating(built, tmp_path / "project", 2), tmp_path / "out", tmp_path / "launch.log"
    out.mkdir()

    def launch(port):
        profile = _cpu_deepspeed_profile(name, tmp_path / f"{name}.yaml", port)
        argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(profile)]
        argv += ["-m", "tests.deepspeed_worker", str(project), str(out)]
        codes = run_together([(argv, {"DS_ACCELERATOR": "cpu"})], ROOT, [log], timeout=600)
        return codes == [0], log.read_text()

    ok, output = launch_with_free_port(launch)
    assert ok, output[-4000:]
    record = json.loads((out / "worker.json").read_text())
    assert (record["distributed_type"], record["world_size"]) == ("DEEPSPEED", 2)
    assert record["engine_steps"] == STEPS
    assert record["deepspeed_config"] == {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 4,
        "gradient_clipping": 1.0,
    }
    _matches_the_reference(_steps(out), _steps(reference_run(1) / "reports"), project)
