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
import os
import signal
import subprocess
import sys

import pytest
import yaml

from fineflow.train.launch import DEEPSPEED_FROM_PARAMS
from fineflow.train.profile import resolve_profile
from fineflow.train.zero import TAG as ENGINE_TAG
from tests.conftest import (
    ROOT,
    TRAIN,
    TRAIN_OVERRIDES,
    checkpoint_being_saved,
    expected_lrs,
    finish_train,
    kill_when,
    last_logged_step,
    launch_with_free_port,
    run_dirs,
    train_project,
    venv_env,
)
from tests.faults import fault_env

pytestmark = pytest.mark.slow  # every test here launches training processes

STEPS = TRAIN_OVERRIDES["train.steps"]


def _steps(folder):
    return [json.loads(line) for line in (folder / "train_steps.jsonl").read_text().splitlines()]


def _accumulating(built, path, ranks: int, overrides=None):
    """A project that trains the reference's 4 rows a step as ranks x micro-batch x 2 accumulated micro-batches."""
    accumulating = {"train.num_processes": ranks, "train.micro_batch_size": 2 // ranks, "train.grad_accum": 2}
    return train_project(built, path, {**accumulating, **(overrides or {})})


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


ZERO = ["deepspeed_zero2", "deepspeed_zero3"]


def deepspeed_project(built, path, name: str):
    """An accumulating 2-rank project (as _accumulating) whose train.accelerate_profile is the shipped DeepSpeed
    profile (its deepspeed_config as is) on 2 CPU ranks in fp32."""
    path.mkdir(parents=True, exist_ok=True)
    profile = yaml.safe_load(resolve_profile(name).read_text())
    profile.update(num_processes=2, mixed_precision="no", main_process_port=0)
    (path / f"{name}.yaml").write_text(yaml.safe_dump(profile))
    return _accumulating(built, path, 2, {"train.accelerate_profile": str(path / f"{name}.yaml")})


def deepspeed_env(extra=None) -> dict[str, str]:
    env = {**venv_env(), "FINEFLOW_TRAIN_WORKER": "1", "DS_ACCELERATOR": "cpu", **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)  # tests.deepspeed_worker
    return env


def start_deepspeed(project, port, env=None):
    """The train stage's ranks under DeepSpeed, started as the profiles document (accelerate launch with
    FINEFLOW_TRAIN_WORKER=1) through tests/deepspeed_worker.py, in a process group of their own."""
    profile = yaml.safe_load((project / "params.yaml").read_text())["train"]["accelerate_profile"]
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", profile]
    argv += ["--main_process_port", str(port), "-m", "tests.deepspeed_worker", *TRAIN[3:]]
    return subprocess.Popen(
        argv,
        cwd=project,
        env=env or deepspeed_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def run_deepspeed(project, env=None) -> str:
    """The DeepSpeed ranks to their end (asserting they succeeded); their output."""

    def launch(port):
        proc = start_deepspeed(project, port, env)
        try:
            output = proc.communicate(timeout=600)[0]
        except subprocess.TimeoutExpired:  # a hang: fail, not wait forever
            os.killpg(proc.pid, signal.SIGKILL)
            output = proc.communicate()[0] + "\nTIMEOUT: the ranks hung"
        return proc.returncode == 0, output

    ok, output = launch_with_free_port(launch)
    assert ok, output[-4000:]
    return output


@pytest.fixture(scope="module")
def deepspeed_run(built, tmp_path_factory):
    """deepspeed_run(profile name) -> one uninterrupted run's project, trained on first use; tests only read it."""
    pytest.importorskip("deepspeed")
    runs = {}

    def get(name: str):
        if name not in runs:
            runs[name] = deepspeed_project(built, tmp_path_factory.mktemp(name), name)
            run_deepspeed(runs[name])
        return runs[name]

    return get


def _final_checkpoint(project):
    from fineflow.checkpoint import latest_valid

    [run_dir] = run_dirs(project / "checkpoints")
    return latest_valid(run_dir)


def _engine_files(checkpoint) -> list[str]:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    return sorted(name for name in manifest["files"] if name.startswith("sharded/"))


@pytest.mark.scenario
@pytest.mark.nightly  # DeepSpeed ZeRO-2 and ZeRO-3 runs on 2 ranks: minutes each on 2 cores
@pytest.mark.parametrize("name", ZERO)
def test_deepspeed_steps_once_per_grad_accum_micro_batches(name, deepspeed_run, reference_run):
    """The train stage under DeepSpeed's engine: the engine takes train.steps optimizer steps (one per
    grad_accum micro-batches, not one per micro-batch), with the batch settings from params, and trains what DDP
    and one process train."""
    import torch

    project = deepspeed_run(name)
    _matches_the_reference(_steps(project / "reports"), _steps(reference_run(1) / "reports"), project)
    engine = _final_checkpoint(project) / "sharded" / ENGINE_TAG
    [model_states] = sorted(engine.glob("*mp_rank_00_model_states.pt"))[:1]
    [optimizer_states] = engine.glob("*_rank_0_mp_rank_00_optim_states.pt")
    assert torch.load(model_states, weights_only=False)["global_steps"] == STEPS  # engine steps, not micro-batches
    ds_config = torch.load(optimizer_states, weights_only=False)["ds_config"]
    assert {key: ds_config[key] for key in DEEPSPEED_FROM_PARAMS} == {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 4,
        "gradient_clipping": 1.0,
    }


@pytest.mark.scenario
@pytest.mark.nightly
@pytest.mark.parametrize("name", ZERO)
def test_deepspeed_checkpoints_resume_bit_exact(name, deepspeed_run, built, tmp_path):
    """ZeRO's state (fp32 master partitions, AdamW moments, step counters) is each rank's own part, written by
    DeepSpeed into the checkpoint, hashed and published atomically like FSDP's shards. A SIGKILL in the middle of
    a save, then a resume: the same steps, losses and grad norms, and a bit-exact adapter (gathered from the fp32
    master weights, the adapter alone)."""
    import torch
    from safetensors.torch import load_file

    reference = deepspeed_run(name)
    project = deepspeed_project(built, tmp_path / "resumed", name)
    env = fault_env(deepspeed_env(), write_delay_s=0.03)  # slow writes: the kill lands mid-save
    assert kill_when(
        lambda port: start_deepspeed(project, port, env),
        project,
        lambda p: last_logged_step(p) >= 4 and checkpoint_being_saved(p),
    )
    output = run_deepspeed(project, env)
    resumed_from = json.loads((project / "reports/train.json").read_text())["resumed_from_step"]
    assert "resuming from" in output and resumed_from in (2, 4), output[-3000:]
    files = _engine_files(_final_checkpoint(project))
    for rank in (0, 1):  # every rank's own part of the optimizer state
        assert any(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in f for f in files), files
    steps, expected = _steps(project / "reports"), _steps(reference / "reports")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for key in ("tokens", "loss", "grad_norm", "lr"):
        assert [s[key] for s in steps] == [s[key] for s in expected], key
    a = load_file(project / "models/candidate/adapter_model.safetensors")
    b = load_file(reference / "models/candidate/adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-exact
    assert all(t.dtype == torch.float32 for t in a.values())
