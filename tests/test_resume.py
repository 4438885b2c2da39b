"""Exact resume after kill -9: the train stage is SIGKILLed at several points (mid-step, mid-checkpoint-
write), re-run until done, and must end with adapter tensors torch.equal to an uninterrupted run's and the
same sequence of rows trained on. Also: a corrupted newest checkpoint, disk full, a changed config.

Faults reach the stage's processes (the ranks under accelerate launch included) through the test-only
tests/faults/sitecustomize.py: every run slows each checkpoint write a little, so kills land mid-write; the
disk-full test fails step 4's writes. Each process that got a fault says so, and the tests check that."""

import json
import re

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import (
    TRAIN_OVERRIDES,
    expected_lrs,
    finish_train,
    kill_when,
    last_logged_step,
    launch_with_free_port,
    ranks_overrides,
    run_dirs,
    start_train,
    train_env,
    train_project,
    write_params,
)
from tests.faults import INJECTED, fault_env

pytestmark = pytest.mark.slow  # every test here runs the train stage as a process, most of them kill it

STEPS = TRAIN_OVERRIDES["train.steps"]


def _env(ranks, disk_full_at_step=None):
    # the write delay widens the window in which a kill lands mid-write; disk full, when asked, takes over
    return fault_env(train_env(ranks), write_delay_s=0.03, disk_full_at_step=disk_full_at_step)


def _writing(project) -> bool:
    return any(project.glob("checkpoints/*/.tmp-step-*"))


def _start(project, ranks, env=None, port=None):
    return start_train(project, ranks, env or _env(ranks), port=port)


def _kill_when(project, ranks, condition) -> bool:
    return kill_when(lambda port: _start(project, ranks, port=port), project, condition)


def _finish(project, ranks, env=None) -> str:
    return finish_train(project, ranks, env or _env(ranks))


def _steps(project):
    return [json.loads(line) for line in (project / "reports/train_steps.jsonl").read_text().splitlines()]


def _rows(project):
    return [json.loads(line)["rows"] for line in (project / "reports/train_steps.jsonl").read_text().splitlines()]


def _adapter(project):
    return load_file(project / "models/candidate/adapter_model.safetensors")


def _assert_faults_reached(output, ranks, fault="write delay 0.03s"):
    """Every rank (RANK under accelerate launch; 0 for a rank run directly) installed the fault: without
    it, kills mid-write would be luck, and a disk-full test would test nothing."""
    for rank in range(ranks):
        assert re.search(rf"{re.escape(fault)} {INJECTED} \(pid \d+, rank {rank}\)", output), (rank, output[-3000:])


def _assert_same_training(resumed, reference):
    assert [json.loads(x)["step"] for x in (resumed / "reports/train_steps.jsonl").read_text().splitlines()] == list(
        range(1, STEPS + 1)
    )  # no step logged twice, none missing
    assert _rows(resumed) == _rows(reference)  # the same rows, in the same order: nothing skipped or replayed
    # every step at the schedule's lr (a restored scheduler neither restarts nor runs N times per step under
    # DDP), and the same loss and gradient norm as the uninterrupted run
    steps, reference_steps = _steps(resumed), _steps(reference)
    params = yaml.safe_load((resumed / "params.yaml").read_text())
    assert [s["lr"] for s in steps] == pytest.approx(expected_lrs(params), rel=1e-9)
    assert [(s["loss"], s["grad_norm"]) for s in steps] == [(s["loss"], s["grad_norm"]) for s in reference_steps]
    a, b = _adapter(resumed), _adapter(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-exact


KILL_POINTS = [
    ("after step 1, before any checkpoint", lambda p: last_logged_step(p) >= 1),
    ("during a checkpoint write", _writing),
    ("after step 5, between checkpoints", lambda p: last_logged_step(p) >= 5),
    ("during a later checkpoint write", lambda p: last_logged_step(p) >= 6 and _writing(p)),
    ("after step 9", lambda p: last_logged_step(p) >= 9),
    ("after step 11, just before the end", lambda p: last_logged_step(p) >= 11),
]


@pytest.mark.scenario
# the 2-process sweep (seven accelerate launches of two ranks) is nightly; CI runs the 1-process one
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.nightly)], ids=["1-process", "2-process-ddp"])
def test_sigkill_at_many_points_then_resume_is_bit_exact(built, reference_run, tmp_path, ranks):
    reference = reference_run(ranks)
    resumed = train_project(built, tmp_path / "resumed", ranks_overrides(ranks))
    kills = 0
    for _, condition in KILL_POINTS:
        kills += _kill_when(resumed, ranks, condition)
    output = _finish(resumed, ranks)
    _assert_faults_reached(output, ranks)
    assert kills >= 5, f"only {kills} kills landed before the run finished"
    assert "resuming from" in output
    _assert_same_training(resumed, reference)
    report = json.loads((resumed / "reports/train.json").read_text())
    assert report["resumed_from_step"] > 0 and report["steps"] == STEPS
    # throughput counts only what this attempt trained, not the tokens of the steps before the resume
    reference_report = json.loads((reference / "reports/train.json").read_text())
    assert report["tokens"] == reference_report["tokens"] > report["tokens_this_attempt"]
    if report["resumed_from_step"] < STEPS:
        assert report["tokens_per_s"] == pytest.approx(report["tokens_this_attempt"] / report["loop_s"], rel=0.01)
    else:  # the last kill landed after the final checkpoint: this attempt trained nothing
        assert report["tokens_this_attempt"] == 0 and report["tokens_per_s"] is None


def test_corrupt_newest_checkpoint_is_skipped_with_a_warning_and_resume_stays_exact(built, reference_run, tmp_path):
    reference = reference_run(1)
    resumed = train_project(built, tmp_path / "resumed", ranks_overrides(1))
    assert _kill_when(resumed, 1, lambda p: last_logged_step(p) >= 7 and not _writing(p))
    [run_dir] = run_dirs(resumed / "checkpoints")
    newest = sorted(run_dir.glob("step-*"))[-1]
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[-3] ^= 0xFF  # one flipped bit pattern in a tensor
    (newest / "model.safetensors").write_bytes(bytes(data))
    output = _finish(resumed, 1)
    assert f"{newest.name}/model.safetensors: sha256 mismatch" in output  # the warning names the file
    _assert_same_training(resumed, reference)


def test_disk_full_stops_with_a_clear_error_and_keeps_the_previous_checkpoint(built, tmp_path):
    from fineflow.checkpoint import latest_valid, load_checkpoint

    project = train_project(built, tmp_path)
    proc = _start(project, 1, env=_env(1, disk_full_at_step=4))
    output = proc.communicate(timeout=600)[0]
    _assert_faults_reached(output, 1, fault="disk full at step 4")  # the rank got it; without it the run passes
    assert proc.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert "disk full" in output.lower() and "step-0000002" in output
    assert "(checkpoint step 4)" in output  # the injected step failed, not some other write
    [run_dir] = run_dirs(project / "checkpoints")
    assert latest_valid(run_dir).name == "step-0000002" and load_checkpoint(run_dir / "step-0000002").step == 2
    assert not list(run_dir.glob(".tmp-*"))
    # space is back: the retry resumes from step 2 and finishes
    output = _finish(project, 1)
    assert "resuming from" in output and "step-0000002" in output


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_disk_full_in_a_background_save_stops_training_within_a_step_not_at_the_next_save(built, tmp_path, ranks):
    """An async save that hits ENOSPC (step 150) stops training at the next step, not at the next save (step 200),
    an interval of work later, with two ranks its message not after two tracebacks (rank 1's, whose peer had gone
    mid-collective, and accelerate's). Here saves every 4 steps, step 8's fails: every rank stops after step 8
    or 9 (the step boundary after the write failed), not at step 12's save (last step logged 11). Each step
    waits 0.5 s for its batch (an induced slow loader) so that the writer thread has long failed by then."""
    from fineflow.checkpoint import latest_valid, load_checkpoint

    project = train_project(built, tmp_path, {"checkpoint.every_steps": 4, **ranks_overrides(ranks)})
    env = {**_env(ranks, disk_full_at_step=8), "FINEFLOW_TEST_LOADER_DELAY_S": "0.5"}

    def launch(port):
        proc = _start(project, ranks, env=env, port=port)
        output = proc.communicate(timeout=600)[0]
        return proc.returncode == 0, output

    _, output = launch_with_free_port(launch)
    _assert_faults_reached(output, ranks, fault="disk full at step 8")
    assert "disk full" in output.lower() and "(checkpoint step 8)" in output and "step-0000004 is intact" in output
    last, stopped = last_logged_step(project), re.findall(r"Training stopped after step (\d+)", output)
    assert 8 <= last <= 9 and stopped == [str(last)] * ranks, (last, output[-3000:])  # every rank, the same step
    # no rank's traceback (accelerate's own launcher still prints one for a rank's exit 2 under torch elastic)
    assert "[rank" not in output and (ranks > 1 or "Traceback" not in output), output[-3000:]
    [run_dir] = run_dirs(project / "checkpoints")
    assert latest_valid(run_dir).name == "step-0000004" and load_checkpoint(run_dir / "step-0000004").step == 4
    assert not list(run_dir.glob(".tmp-*"))


def test_changed_config_after_a_crash_is_refused_unless_resume_never(built, tmp_path):
    project = train_project(built, tmp_path)
    assert _kill_when(project, 1, lambda p: last_logged_step(p) >= 5 and not _writing(p))
    write_params(project / "params.yaml", {**TRAIN_OVERRIDES, "train.lr": 1e-3})
    proc = _start(project, 1)
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 2 and "Traceback" not in output
    assert "unfinished run" in output and "lr: 0.003 -> 0.001" in output and "train.resume: never" in output
    write_params(project / "params.yaml", {**TRAIN_OVERRIDES, "train.lr": 1e-3, "train.resume": "never"})
    output = _finish(project, 1)
    assert "resuming from" not in output
    assert len(run_dirs(project / "checkpoints")) == 2  # the other config's run is kept


@pytest.mark.nightly  # two trainings with tensorboard (~25 s); make test keeps the resumed step log's continuity
def test_tensorboard_curves_have_no_duplicate_steps_after_a_resume(built, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    project = train_project(built, tmp_path, {"train.tracker": "tensorboard"})
    assert _kill_when(project, 1, lambda p: last_logged_step(p) >= 7 and not _writing(p))
    _finish(project, 1)
    [run] = (project / "logs/fineflow").iterdir()  # the resumed attempt went on in the crashed one's run
    assert run.name.endswith("-dvc-repro")  # started outside a flow (a flow run's name otherwise)
    events = EventAccumulator(str(run))
    events.Reload()
    steps = [event.step for event in events.Scalars("loss")]
    assert steps == list(range(1, STEPS + 1))  # the crashed attempt's steps after its checkpoint were purged
    # the next run logs to a tracker run of its own (named after it): the curves of two runs never mix
    write_params(project / "params.yaml", {**TRAIN_OVERRIDES, "train.tracker": "tensorboard", "train.lr": 1e-3})
    _finish(project, 1, env={**_env(1), "FINEFLOW_RUN_NAME": "a1b2c3d: train, evaluate"})
    runs = sorted(p.name for p in (project / "logs/fineflow").iterdir())
    assert len(runs) == 2 and run.name in runs and any(r.endswith("-a1b2c3d-train-evaluate") for r in runs), runs
