"""DVC's rwlock file after a dvc process was SIGKILLed while rewriting it (fineflow.dvc_rwlock).

Seen in the chaos scenario: a kill in the goodput stage landed in dvc's own bookkeeping; ``.dvc/tmp/rwlock`` was
left empty and the next flow run failed at its first stage ("Unable to read RWLock-file '.dvc/tmp/rwlock'. JSON
structure is corrupted"). The flow's stage task and ``fineflow ci`` remove such a file before they run dvc."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fineflow.core.dvc_project import dvc_environment
from fineflow.dvc_rwlock import GUARD, RWLOCK, repair_rwlock
from tasks.stages import is_user_error, repro_single


def dvc_project(path: Path) -> Path:
    """A git + dvc project with one stage that writes a file."""
    path.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=path, check=True, env=dvc_environment())
    (path / "dvc.yaml").write_text("stages:\n  hello:\n    cmd: echo hi > out.txt\n    outs:\n      - out.txt\n")
    return path


def test_an_empty_rwlock_left_by_a_killed_dvc_is_removed_and_the_next_stage_runs(tmp_path):
    project = dvc_project(tmp_path / "p")
    (project / RWLOCK).parent.mkdir(parents=True, exist_ok=True)
    (project / RWLOCK).write_text("")  # truncated by open("w"), killed before json.dump
    plain = subprocess.run(
        [sys.executable, "-m", "dvc", "repro"], cwd=project, env=dvc_environment(), capture_output=True, text=True
    )
    assert plain.returncode != 0 and "rwlock" in (plain.stdout + plain.stderr).lower()  # what users saw
    lines: list[str] = []
    assert repro_single("hello", project, lines.append) is True
    assert (project / "out.txt").read_text() == "hi\n"
    assert any("removed .dvc/tmp/rwlock (0 bytes, not JSON)" in line for line in lines), lines
    json.loads((project / RWLOCK).read_text())  # dvc wrote its own again


def test_a_valid_rwlock_and_one_a_live_dvc_is_editing_are_left_alone(tmp_path):
    project = tmp_path / "p"
    (project / RWLOCK).parent.mkdir(parents=True)
    assert repair_rwlock(project) is None  # no file: nothing to do
    held = {"read": {}, "write": {}}  # valid, no holders (one a live dvc holds: the test below)
    (project / RWLOCK).write_text(json.dumps(held))
    assert repair_rwlock(project) is None and json.loads((project / RWLOCK).read_text()) == held
    (project / RWLOCK).write_text('{"read": {')  # mid-write by a process that still runs and holds dvc's guard
    with open(project / GUARD, "a") as guard:
        fcntl.flock(guard.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert repair_rwlock(project) is None
        assert (project / RWLOCK).read_text() == '{"read": {'
    assert "not JSON" in repair_rwlock(project) and not (project / RWLOCK).exists()


# ---- an entry of a dead dvc whose PID now belongs to another process ------------------------------------------
# A SIGKILLed `dvc repro` leaves its write entry; its PID may be reused within the hour (pid_max 32768). The new
# process must not be taken for the holder (as DVC's psutil.pid_exists check does), or train fails three
# times with "'models/candidate' is busy, it is being blocked by: (PID …)" until the file is deleted.


def write_entry(project: Path, pid: int, path: str = "out.txt", cmd: str = "dvc repro --single-item hello") -> dict:
    """DVC 3.67's rwlock as a `dvc repro` writing path leaves it: {"write": {abs path: {"pid", "cmd"}}}."""
    held = {"write": {str((project / path).resolve()): {"pid": pid, "cmd": cmd}}}
    (project / RWLOCK).parent.mkdir(parents=True, exist_ok=True)
    (project / RWLOCK).write_text(json.dumps(held))
    return held


def test_an_entry_whose_pid_now_belongs_to_an_unrelated_process_is_cleared_and_the_stage_runs(tmp_path):
    project = dvc_project(tmp_path / "p")
    with subprocess.Popen(["sleep", "120"], cwd=project) as unrelated:  # the reused PID: alive, not a dvc
        try:
            write_entry(project, unrelated.pid)
            plain = subprocess.run(
                [sys.executable, "-m", "dvc", "repro"],
                cwd=project,
                env=dvc_environment(),
                capture_output=True,
                text=True,
            )
            assert plain.returncode != 0 and "is busy" in plain.stdout + plain.stderr  # what the runs saw
            lines: list[str] = []
            assert repro_single("hello", project, lines.append) is True
            assert (project / "out.txt").read_text() == "hi\n"
            assert any(f"(PID {unrelated.pid})" in line and "not a dvc" in line for line in lines), lines
            assert json.loads((project / RWLOCK).read_text()).get("write", {}) == {}
        finally:
            unrelated.kill()


def test_entries_of_a_dead_pid_and_of_a_dvc_of_another_repository_are_cleared(tmp_path):
    project, elsewhere = dvc_project(tmp_path / "p"), tmp_path / "other"
    elsewhere.mkdir()
    # a process whose argv[0] is "dvc" working in another directory: a dvc, but of another repository
    with subprocess.Popen(["bash", "-c", "exec -a dvc sleep 120"], cwd=elsewhere) as other_dvc:
        try:
            held = {
                "write": {str(project / "out.txt"): {"pid": other_dvc.pid, "cmd": "dvc repro"}},
                "read": {str(project / "in.txt"): [{"pid": 2**22 + 7, "cmd": "dvc repro"}]},  # above any pid_max
            }
            (project / RWLOCK).parent.mkdir(parents=True, exist_ok=True)
            (project / RWLOCK).write_text(json.dumps(held))
            message = repair_rwlock(project)
            assert message and f"(PID {other_dvc.pid})" in message and f"(PID {2**22 + 7})" in message, message
            left = json.loads((project / RWLOCK).read_text())
            assert left.get("write", {}) == {} and left.get("read", {}) == {}
        finally:
            other_dvc.kill()


def test_an_entry_held_by_a_live_dvc_of_this_repository_is_kept(tmp_path):
    project = dvc_project(tmp_path / "p")
    (project / "dvc.yaml").write_text(
        "stages:\n  slow:\n    cmd: sleep 120 && echo hi > out.txt\n    outs:\n      - out.txt\n"
    )
    running = subprocess.Popen(
        [sys.executable, "-m", "dvc", "repro", "slow"], cwd=project, env=dvc_environment(), start_new_session=True
    )
    try:
        while not (project / RWLOCK).exists() or not json.loads((project / RWLOCK).read_text() or "{}").get("write"):
            assert running.poll() is None, "dvc repro ended before it took its lock"
            time.sleep(0.2)
        before = json.loads((project / RWLOCK).read_text())
        assert [info["pid"] for info in before["write"].values()] == [running.pid]
        assert repair_rwlock(project) is None
        assert json.loads((project / RWLOCK).read_text()) == before
        # the stage then finds the path busy: a user error (never retried: nothing changes between tries),
        # naming the holder, not a StageFailed with exit 255, retried twice.
        with pytest.raises(Exception) as busy:
            repro_single("slow", project, lambda line: None)
        assert is_user_error(busy.value), busy.value
        assert "is busy" in str(busy.value) and f"(PID {running.pid})" in str(busy.value), busy.value
    finally:
        os.killpg(running.pid, signal.SIGKILL)
        running.wait()
