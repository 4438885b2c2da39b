"""The flow run's own bookkeeping: its turn in the workspace (one run at a time) and its name.

A run waits for the workspace in a task of its own (``wait for the workspace``, Running while it waits, its log
naming the run it waits for), so the UI shows a queued run as waiting, not as failed. Runs are named after
what they are: the commit (``a1b2c3d``, ``+edits`` for uncommitted changes) and, once the stages have run,
what DVC re-ran (``a1b2c3d: train, evaluate, promote`` or ``a1b2c3d: nothing changed``).
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from fineflow.workspace import WorkspaceLock, describe

_HELD: dict[str, WorkspaceLock] = {}  # project path -> the lock this process holds for it


@task(task_run_name="wait for the workspace", cache_policy=NO_CACHE)
def claim_workspace(project_dir: str, owner: str) -> dict:
    """Wait until no other run uses the project's workspace, then hold it (release_workspace gives it back)."""
    logger = get_run_logger()
    project = str(Path(project_dir).resolve())
    lock = WorkspaceLock(Path(project), owner)

    def waiting(holder: dict, waited_s: float) -> None:
        logger.info(f"waiting for the workspace {project}: held by {describe(holder)}, waited {waited_s:.0f} s")

    waited = lock.acquire(on_wait=waiting)
    _HELD[project] = lock
    return {"waited_s": round(waited, 1)}


def release_workspace(project_dir: str) -> None:
    lock = _HELD.pop(str(Path(project_dir).resolve()), None)
    if lock is not None:
        lock.release()


def commit_label(project_dir: str) -> str:
    """The checkout's short commit, ``+edits`` when tracked files differ from it; ``no-git`` outside git."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=project_dir, capture_output=True, text=True, timeout=30)
        return done.stdout.strip() if done.returncode == 0 else ""

    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        sha = git("rev-parse", "--short", "HEAD")
        if sha:
            return sha + ("+edits" if git("status", "--porcelain", "--untracked-files=no") else "")
    return "no-git"


def flow_run_name() -> str:
    """The name a run starts with (the flow's flow_run_name): its commit."""
    from prefect.runtime import flow_run

    return commit_label(flow_run.parameters.get("project_dir", "."))


def rename_run(name: str) -> None:
    """Give the current flow run its final name (what re-ran); a failed API call leaves the first name."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    with contextlib.suppress(Exception), get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, name=name)
