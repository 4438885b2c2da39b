"""DVC's read/write lock file after a SIGKILL.

DVC records which dvc process reads or writes which path in ``.dvc/tmp/rwlock`` and rewrites that file in place
(``open(path, "w")``, then ``json.dump``) under its ``rwlock.lock`` guard. A dvc process SIGKILLed between the
truncation and the write leaves it empty, and from then on every dvc command in the project fails with "Unable to
read RWLock-file '.dvc/tmp/rwlock'. JSON structure is corrupted" until a person deletes it (seen in the chaos
test: a kill during the goodput stage's half second of work landed in dvc's own bookkeeping, and the next run
failed at its first stage).

Only a writer that died leaves a partial file, so the processes it listed are gone. fineflow removes such a file
(dvc reads a missing one as "no holders") under dvc's own guard, so never while a live dvc process edits it,
before it runs dvc: from the flow's stage tasks and from ``fineflow ci``.
"""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

RWLOCK = Path(".dvc/tmp/rwlock")
GUARD = Path(".dvc/tmp/rwlock.lock")


def repair_rwlock(project: Path) -> str | None:
    """Remove the project's rwlock file if it is not JSON and no dvc process is editing it; what was done, or
    None (nothing to do, or a live dvc process holds the guard: its file is its own)."""
    path, guard_path = Path(project) / RWLOCK, Path(project) / GUARD
    if not path.exists():
        return None
    with open(guard_path, "a") as guard:  # dvc's guard (zc.lockfile: an exclusive flock); "a" keeps its pid
        try:
            fcntl.flock(guard.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
            try:
                json.loads(text)
                return None
            except ValueError:
                path.unlink()
            return (
                f"removed {RWLOCK} ({len(text)} bytes, not JSON): a dvc process was killed while writing it, and "
                "no dvc process holds it now"
            )
        finally:
            fcntl.flock(guard.fileno(), fcntl.LOCK_UN)
