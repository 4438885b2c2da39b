"""DVC's rwlock file after a dvc process was SIGKILLed while rewriting it (fineflow.dvc_rwlock).

Seen in the chaos scenario: a kill in the goodput stage landed in dvc's own bookkeeping; ``.dvc/tmp/rwlock`` was
left empty and the next flow run failed at its first stage ("Unable to read RWLock-file '.dvc/tmp/rwlock'. JSON
structure is corrupted"). The flow's stage task and ``fineflow ci`` remove such a file before they run dvc."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

from fineflow.dvc_rwlock import GUARD, RWLOCK, repair_rwlock
from fineflow.remote import dvc_environment
from tasks.stages import repro_single


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
    held = {"read": {}, "write": {"out.txt": {"pid": 1, "cmd": "dvc repro"}}}
    (project / RWLOCK).write_text(json.dumps(held))
    assert repair_rwlock(project) is None and json.loads((project / RWLOCK).read_text()) == held
    (project / RWLOCK).write_text('{"read": {')  # mid-write by a process that still runs and holds dvc's guard
    with open(project / GUARD, "a") as guard:
        fcntl.flock(guard.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert repair_rwlock(project) is None
        assert (project / RWLOCK).read_text() == '{"read": {'
    assert "not JSON" in repair_rwlock(project) and not (project / RWLOCK).exists()
