"""The embedded base's pretraining saves and resumes like the train stage: a stop signal ends the step in progress,
the state is saved (checkpoints/base), the stage exits 75, and the next run resumes from that step to the same bytes
as an uninterrupted run; through the function, `dvc repro` and the Prefect flow."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fineflow.base import embedded as base_model
from fineflow.core.config import parse_params
from fineflow.errors import PREEMPTED_EXIT
from tests.conftest import TINY_PARAMS, _merge, copy_project, venv_env

STEPS = 300  # tiny steps: long enough for a signal sent by another process to land in the middle
FUNCTION_STEPS = 60  # in-process, the stop comes at a chosen step (37): a fifth of STEPS' pretraining, twice a test


def _params(**base):
    return parse_params(_merge(TINY_PARAMS, {"base": {"steps": FUNCTION_STEPS, **base}}))


def _build(params, out: Path, state_dir: Path | None, stop=lambda: None) -> dict:
    return base_model.build_embedded_base(
        params.model, params.base, params.seed, out, lambda line: None, state_dir, stop_signal=stop
    )


def _weights(model_dir: Path) -> bytes:
    return (model_dir / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The base pretrained in one go (the bytes every resumed run must end with)."""
    out = tmp_path_factory.mktemp("uninterrupted") / "base"
    _build(_params(), out, None)
    return out


def test_a_stopped_pretraining_saves_its_step_and_the_resume_ends_with_the_same_bytes(uninterrupted, tmp_path):
    params, state_dir = _params(), tmp_path / "state"
    calls = {"n": 0}

    def stop_at_step_37():
        calls["n"] += 1
        return signal.SIGTERM if calls["n"] == 37 else None

    with pytest.raises(base_model.PretrainStopped, match=rf"SIGTERM after step 37 of {FUNCTION_STEPS}") as stopped:
        _build(params, tmp_path / "base", state_dir, stop_at_step_37)
    assert stopped.value.step == 37 and (state_dir / base_model.STATE_FILE).is_file()
    assert not (tmp_path / "base").exists()  # nothing half-built where the stage's output goes
    figures = _build(params, tmp_path / "base", state_dir)
    assert figures["pretrain_resumed_from_step"] == 37 and figures["pretrain_steps"] == FUNCTION_STEPS
    assert _weights(tmp_path / "base") == _weights(uninterrupted)
    assert not (state_dir / base_model.STATE_FILE).exists()  # done: the state is gone


def test_a_state_of_other_params_or_a_torn_one_is_not_resumed_from(uninterrupted, tmp_path):
    state_dir = tmp_path / "state"
    with pytest.raises(base_model.PretrainStopped):
        _build(_params(lr=1e-3), tmp_path / "other", state_dir, lambda: signal.SIGINT)  # saved after step 1
    lines = []
    params = _params()
    base_model.build_embedded_base(params.model, params.base, params.seed, tmp_path / "a", lines.append, state_dir)
    assert any("of other model/base params or seed: starting from step 0" in line for line in lines), lines
    assert _weights(tmp_path / "a") == _weights(uninterrupted)
    state_dir.mkdir(exist_ok=True)
    (state_dir / base_model.STATE_FILE).write_bytes(b"torn")
    lines.clear()
    base_model.build_embedded_base(params.model, params.base, params.seed, tmp_path / "b", lines.append, state_dir)
    assert any("unreadable" in line and "starting from step 0" in line for line in lines), lines
    assert _weights(tmp_path / "b") == _weights(uninterrupted)


def _base_only_project(dest: Path) -> Path:
    """A git+DVC copy of the project (tiny params, base.steps = STEPS) whose dvc.yaml has the base stage alone."""
    project = copy_project(dest, {"base.steps": STEPS, "base.corpus_docs": 600})
    pipeline = yaml.safe_load((project / "dvc.yaml").read_text())
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"base": pipeline["stages"]["base"]}}, sort_keys=False))
    return project


def _start(command: list[str], project: Path, log: Path, env: dict) -> subprocess.Popen:
    with log.open("w") as fh:
        return subprocess.Popen(
            command, cwd=project, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )


def _stop_during_pretraining(proc: subprocess.Popen, log: Path, send) -> str:
    """send(proc) once pretraining has logged its 51st step; the process's output when it has ended."""
    deadline = time.monotonic() + 300
    while "pretrain step 51/" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, log.read_text()[-3000:]
    send(proc)
    try:
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return log.read_text()


def _reference_bytes(tmp_path: Path) -> bytes:
    params = parse_params(yaml.safe_load((tmp_path / "p/params.yaml").read_text()))
    _build(params, tmp_path / "reference", None)
    return _weights(tmp_path / "reference")


@pytest.mark.slow
def test_ctrl_c_of_dvc_repro_during_pretraining_then_dvc_repro_resumes_it(tmp_path):
    """Ctrl-C (SIGINT to `dvc repro`'s process group) during pretraining: the stage exits 75 with its step saved
    and one line; the next `dvc repro` resumes from that step and writes the uninterrupted run's bytes."""
    project = _base_only_project(tmp_path / "p")
    dvc = [sys.executable, "-m", "dvc", "repro"]
    proc = _start(dvc, project, tmp_path / "first.log", venv_env())
    output = _stop_during_pretraining(proc, tmp_path / "first.log", lambda p: os.killpg(p.pid, signal.SIGINT))
    record = json.loads((project / "reports/base.error.json").read_text())
    assert record["kind"] == "preempted" and record["signal"] == "SIGINT", output[-3000:]
    assert f"run again to resume (exit {PREEMPTED_EXIT})" in output and "Traceback" not in output, output[-3000:]
    again = subprocess.run(dvc, cwd=project, env=venv_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"pretrain: resuming from step {record['step']} of {STEPS}" in again.stdout, again.stdout[-3000:]
    assert _weights(project / "models/base") == _reference_bytes(tmp_path)
    assert not (project / "checkpoints/base" / base_model.STATE_FILE).exists()


@pytest.mark.nightly  # a Prefect flow stopped in pretraining, then run again (~55 s); CI keeps dvc repro's Ctrl-C
@pytest.mark.slow
def test_sigterm_to_the_flow_during_pretraining_says_what_was_saved_and_the_next_run_resumes(tmp_path):
    """`python -m flows.pipeline` (what `make run` runs) SIGTERMed during base pretraining: the flow exits 143 with
    one line naming the saved step and no traceback; run again, the flow resumes pretraining from that step, not
    from 0, and ends with the uninterrupted run's bytes."""
    project = _base_only_project(tmp_path / "p")
    env = {**venv_env(), "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_LOGGING_LEVEL": "INFO"}
    flow = [sys.executable, "-m", "flows.pipeline"]
    proc = _start(flow, project, tmp_path / "first.log", env)
    output = _stop_during_pretraining(proc, tmp_path / "first.log", lambda p: p.send_signal(signal.SIGTERM))
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    record = json.loads((project / "reports/base.error.json").read_text())
    assert record["kind"] == "preempted", output[-3000:]
    assert "Traceback" not in output, output[-5000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("fineflow run: stopped by SIGTERM: base saved step ") and "again" in last, last
    again = subprocess.run(flow, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"pretrain: resuming from step {record['step']} of {STEPS}" in again.stdout + again.stderr
    assert _weights(project / "models/base") == _reference_bytes(tmp_path)
    shutil.rmtree(tmp_path / "prefect", ignore_errors=True)
