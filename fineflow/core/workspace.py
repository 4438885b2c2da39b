"""One pipeline run at a time per workspace: an exclusive lock that a second run waits for.

Two flow runs in one checkout (a scheduled run and one started by hand, two CI triggers) would otherwise meet
inside DVC, which refuses the second at once ("'models/base' is busy") and fails it; two trainings could also
share one GPU. The run holds ``.dvc/tmp/fineflow-run.lock`` (flock) from its first stage to its end, with its
holder (pid, run name, since) written inside; a second run waits for it and says whom it waits for. The kernel
drops the lock when the holder's process dies, SIGKILL included, so a crashed run never blocks the next one.

What runs outside a flow takes its turn too (``held_for``): a stage started by a plain ``dvc repro`` or by hand
holds the workspace while it runs (a flow run waits for it), and ``registry rollback`` does; either one stops at
once with a message that names the holder when another run has the workspace. A stage the holding run started
itself (``HOLDER_ENV`` names it) goes on.

A DVC experiment run from the queue (``dvc exp run --queue`` then ``dvc queue start``) runs in a copy under
``<project>/.dvc/tmp/exps``, with DVC_ROOT naming the project: its stages take the project's turn, and wait for
it rather than stop (a queued experiment runs unattended), so an experiment never trains on the GPUs a flow run
is training on. Such an experiment does not promote (``queued_experiment``, the promote stage). Not for
``dvc exp run --temp`` or ``--run-all``: those hold DVC's own lock on the project while their stages wait, and
a flow run's next ``dvc repro`` would fail on it; queue experiments and start them with ``dvc queue start``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fineflow.errors import WorkspaceBusy

LOCK_FILE = Path(".dvc") / "tmp" / "fineflow-run.lock"
# The pid of the run that holds the workspace, in the environment of every process it starts: its stages know
# the lock they find held is their own run's.
HOLDER_ENV = "FINEFLOW_WORKSPACE_HOLDER"


@dataclass
class WorkspaceLock:
    project: Path
    owner: str  # what the holder is, for whoever waits (a flow run's name)
    _fd: int | None = field(default=None, repr=False)

    @property
    def path(self) -> Path:
        return self.project / LOCK_FILE

    def holder(self) -> dict:
        """Who holds the workspace now, as it wrote itself in the lock file ({} before it has)."""
        try:
            return json.loads(self.path.read_text(encoding="utf-8") or "{}")
        except (OSError, ValueError):
            return {}

    def try_acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # CLOEXEC: no child inherits it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        record = {"pid": os.getpid(), "owner": self.owner, "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self._fd = fd
        return True

    def acquire(self, on_wait: Callable[[dict, float], None], poll_s: float = 1.0, report_every_s: float = 30.0):
        """Block until the workspace is this run's; on_wait(holder, waited_s) at once and every report_every_s."""
        began = time.monotonic()
        reported = None
        while not self.try_acquire():
            now = time.monotonic()
            if reported is None or now - reported >= report_every_s:
                on_wait(self.holder(), now - began)
                reported = now
            time.sleep(poll_s)
        return time.monotonic() - began

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def describe(holder: dict) -> str:
    if not holder:
        return "another run (it has not named itself yet)"
    return f"{holder.get('owner', '?')} (pid {holder.get('pid', '?')}, since {holder.get('since', '?')})"


# What DVC puts in a stage's environment under `dvc exp run` (dvc/env.py): the experiment's name, and the
# project's root, which for a queued experiment is not the folder the stage runs in.
DVC_EXP_NAME_ENV = "DVC_EXP_NAME"
DVC_ROOT_ENV = "DVC_ROOT"
# where DVC runs an experiment that is not run in the workspace itself (dvc/repo/experiments: the queue's and
# --temp's copies of the project)
EXPERIMENTS_DIR = Path(".dvc") / "tmp" / "exps"


def queued_experiment(cwd: Path | None = None) -> tuple[str, Path] | None:
    """(name, project) when this process is a stage of a DVC experiment run in a temporary copy of the project
    (the queue's, or --temp); None for anything run in the project itself (`dvc repro`, `dvc exp run`)."""
    name, root = os.environ.get(DVC_EXP_NAME_ENV), os.environ.get(DVC_ROOT_ENV)
    if not name or not root:
        return None
    here = (cwd or Path.cwd()).resolve()
    project = Path(root).resolve()
    return (name, project) if here.is_relative_to(project / EXPERIMENTS_DIR) else None


def _say_waiting(project: Path):
    def on_wait(holder: dict, waited_s: float) -> None:
        print(
            f"fineflow: waiting for the workspace {project}: in use by {describe(holder)}, waited {waited_s:.0f} s",
            file=sys.stderr,
            flush=True,
        )

    return on_wait


@contextmanager
def held_for(project: Path, owner: str, wait: bool = False):
    """Hold the project's workspace while the block runs, for a process that does not queue like a flow run (a
    stage started by `dvc repro` or by hand, a registry rollback): WorkspaceBusy naming the holder when another
    run has it (with wait, it waits its turn instead, saying for whom), nothing when the holder is the run that
    started this process, nothing outside a DVC workspace."""
    if not (project / ".dvc").is_dir():  # a library caller's folder, not a pipeline workspace
        yield
        return
    lock = WorkspaceLock(project, owner)
    if lock.try_acquire():
        try:
            yield
        finally:
            lock.release()
        return
    holder = lock.holder()
    if holder and str(holder.get("pid")) == os.environ.get(HOLDER_ENV):
        yield  # started by the run that holds the workspace
        return
    if wait:
        lock.acquire(_say_waiting(project))
        try:
            yield
        finally:
            lock.release()
        return
    raise WorkspaceBusy(
        f"the workspace {project} is in use by {describe(holder)}; running the {owner} now would race it "
        f"(both write the same outputs). Wait until it ends, or stop it, then run again."
    )
