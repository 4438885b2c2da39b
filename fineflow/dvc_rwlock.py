"""DVC's read/write lock file after a SIGKILL: a file left half-written, and entries of dvc processes that died.

DVC records which dvc process reads or writes which path in ``.dvc/tmp/rwlock`` (DVC 3.67: ``{"read": {path:
[{"pid", "cmd"}]}, "write": {path: {"pid", "cmd"}}}``, no start time) and rewrites that file in place
(``open(path, "w")``, then ``json.dump``) under its ``rwlock.lock`` guard. Two things a SIGKILLed dvc leaves:

- A half-written file: killed between the truncation and the write, it is left empty, and every dvc command then
  fails with "Unable to read RWLock-file '.dvc/tmp/rwlock'. JSON structure is corrupted".
  Only a writer that died leaves one, so the processes it listed are gone: the file is removed (dvc reads a
  missing one as "no holders").
- Its entries. DVC drops an entry only when its PID does not exist (``psutil.pid_exists``). On a machine with
  ``pid_max`` 32768 the PID soon belongs to another process, and DVC then reports "'<path>' is busy, it is being
  blocked by: (PID …)" for ever: every run of the stage fails until a person removes the entry. An entry
  is stale when its PID is dead, or alive but not a dvc of this repository (``holds_project``).

Both repairs are made under dvc's own guard, so never while a live dvc process edits the file, before fineflow
runs dvc: from the flow's stage tasks and from ``fineflow ci``. What is busy after that is held by a live dvc of
this repository: ``busy_error`` makes DVC's refusal a user error (never retried, no traceback) naming it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from pathlib import Path

import psutil

from fineflow.errors import WorkspaceBusy

RWLOCK = Path(".dvc/tmp/rwlock")
GUARD = Path(".dvc/tmp/rwlock.lock")

# A process started this long after the rwlock file was last written cannot have written an entry in it (the
# slack covers the file's mtime granularity and clock-tick rounding of the start time).
_START_SLACK_S = 1.0


def repair_rwlock(project: Path) -> str | None:
    """Remove the project's rwlock file if it is not JSON, or its stale entries (``stale_reason``), while no dvc
    process is editing it; what was done, or None (nothing to do, or a live dvc process holds the guard)."""
    path, guard_path = Path(project) / RWLOCK, Path(project) / GUARD
    if not path.exists():
        return None
    with open(guard_path, "a") as guard:  # dvc's guard (zc.lockfile: an exclusive flock); "a" keeps its pid
        try:
            fcntl.flock(guard.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None
        try:
            return _repair(path, Path(project))
        finally:
            fcntl.flock(guard.fileno(), fcntl.LOCK_UN)


def _repair(path: Path, project: Path) -> str | None:
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        lock = json.loads(text)
    except ValueError:
        path.unlink()
        return (
            f"removed {RWLOCK} ({len(text)} bytes, not JSON): a dvc process was killed while writing it, and no "
            "dvc process holds it now"
        )
    if not isinstance(lock, dict):
        return None  # DVC's schema error names the file; not ours to guess at
    written_at = path.stat().st_mtime
    cleared = _clear_stale(lock, project, written_at)
    if not cleared:
        return None
    path.write_text(json.dumps(lock), encoding="utf-8")
    return f"cleared stale entries from {RWLOCK} (their dvc process is gone): " + "; ".join(cleared)


def _clear_stale(lock: dict, project: Path, written_at: float) -> list[str]:
    """Remove the stale entries from lock (in place); one line per removed entry."""
    reasons: dict[int, str | None] = {}
    cleared: list[str] = []

    def stale(info: dict, lock_path: str) -> bool:
        pid = info.get("pid") if isinstance(info, dict) else None
        if not isinstance(pid, int):
            return False
        if pid not in reasons:
            reasons[pid] = stale_reason(pid, project, written_at)
        if reasons[pid]:
            cleared.append(f"{lock_path} held by (PID {pid}) {info.get('cmd', '')!r}: {reasons[pid]}")
        return bool(reasons[pid])

    writes = lock.get("write") or {}
    for lock_path in [p for p, info in writes.items() if stale(info, p)]:
        del writes[lock_path]
    reads = lock.get("read") or {}
    for lock_path, infos in list(reads.items()):
        kept = [info for info in infos if not stale(info, lock_path)]
        if kept:
            reads[lock_path] = kept
        else:
            del reads[lock_path]
    return cleared


def stale_reason(pid: int, project: Path, written_at: float) -> str | None:
    """Why the process that a rwlock entry names cannot be the dvc that wrote it, or None when it may be.

    written_at: the rwlock file's mtime. The entry's process held the path when the file was written, so a
    process started later is another one that got its PID. A live process is the holder only if it is a dvc
    (argv names dvc) working in this repository (its cwd is in it; dvc finds its repository from its cwd)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return "the process has exited"
        if process.create_time() > written_at + _START_SLACK_S:
            return "its PID now belongs to a process started after the entry was written"
        argv = process.cmdline()
    except psutil.NoSuchProcess:
        return "the process has exited"
    except psutil.Error:  # another user's process we cannot inspect: it may be the holder
        return None
    if not _is_dvc(argv):
        return f"its PID now belongs to a process that is not a dvc: {' '.join(argv)[:80]!r}"
    try:
        cwd = Path(process.cwd()).resolve()
    except (psutil.Error, OSError):
        return None
    if not cwd.is_relative_to(project.resolve()):
        return f"its PID now belongs to a dvc of another repository (working in {cwd})"
    return None


def _is_dvc(argv: list[str]) -> bool:
    """`dvc …` (the console script, run directly or by its interpreter) or `python -m dvc …`."""
    names = [os.path.basename(arg) for arg in argv[:2]]
    return "dvc" in names or any(a == "-m" and b == "dvc" for a, b in zip(argv, argv[1:]))


# DVC's refusal when a path is held: "ERROR: failed to reproduce '<stage>': '<path>' is busy, it is being blocked
# by:" then one "  (PID <pid>): <cmd>" line per holder.
_BUSY = re.compile(r"'([^']+)' is busy, it is being blocked by")
_HOLDER = re.compile(r"^\s*\(PID \d+\): .*")


def busy_error(output: list[str]) -> WorkspaceBusy | None:
    """DVC's "'<path>' is busy" in a failed dvc command's output, as a user error naming its holders, or None.

    ``repair_rwlock`` ran just before and cleared the entries of processes that are gone, so a holder named here
    is a live dvc of this repository: retrying a few seconds later changes nothing (a user error: never retried)."""
    path = next((m.group(1) for line in output if (m := _BUSY.search(line))), None)
    if path is None:
        return None
    holders = [line.strip() for line in output if _HOLDER.match(line)]
    return WorkspaceBusy(
        f"'{path}' is busy: a dvc process of this repository that is still running holds it: "
        + "; ".join(holders)
        + ". Wait for it to end (or stop it), then run again; entries of dvc processes that are gone were cleared."
    )
