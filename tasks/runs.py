"""The flow run's own bookkeeping: its turn in the workspace (one run at a time), its name, and the state it
moves to and from the DVC remote.

A run waits for the workspace in a task of its own (``wait for the workspace``, Running while it waits, its log
naming the run it waits for), so the UI shows a queued run as waiting, not as failed. Runs are named after
what they are: the commit (``a1b2c3d``; ``+edits-3f9a1c`` for uncommitted changes or overrides, a short hash of
them), when the run started (``12-03 01:24:17 UTC``), and once the stages have run what DVC re-ran (``…: train,
evaluate, promote`` or ``…: nothing changed``), or where it failed (``…: failed at train``).

With a default DVC remote configured (``dvc remote add -d``), a run starts with ``dvc pull`` and ends with
``dvc push``: a run in a fresh clone (a work-pool worker's) reuses the base, the shards, the checkpoints'
results, the champion and the registry, and retrains only what changed; the next one finds this one's. Without
a remote both are skipped (the embedded default keeps its state in the workspace).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from fineflow.core.workspace import HOLDER_ENV, WorkspaceLock, describe
from fineflow.remote import pull, push

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
    os.environ[HOLDER_ENV] = str(os.getpid())  # this run's stages know the lock they find is their run's
    return {"waited_s": round(waited, 1)}


@task(task_run_name="apply param overrides", cache_policy=NO_CACHE)
def apply_overrides(project_dir: str, overrides: dict) -> list[str]:
    """The run's dotted-key overrides, validated all at once and written into the workspace's params.yaml as
    `dvc exp run -S` writes them (fineflow.overrides); published as an artifact. A refused override fails the
    run before any stage, naming every problem."""
    from prefect.artifacts import create_markdown_artifact

    from fineflow import overrides as params_overrides

    applied = params_overrides.apply(Path(project_dir) / "params.yaml", overrides)
    if applied:
        get_run_logger().info(f"params.yaml overridden for this run: {', '.join(applied)}")
        create_markdown_artifact(
            key="fineflow-overrides",
            markdown="### Param overrides (written into params.yaml, as `dvc exp run -S`)\n\n"
            + "\n".join(f"- `{a}`" for a in applied),
            description="the run's param overrides",
        )
    return applied


def release_workspace(project_dir: str) -> None:
    lock = _HELD.pop(str(Path(project_dir).resolve()), None)
    if lock is not None:
        lock.release()
    if not _HELD:
        os.environ.pop(HOLDER_ENV, None)


def _git(project_dir: str, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=project_dir, capture_output=True, text=True, timeout=30)
    return done.stdout.strip() if done.returncode == 0 else ""


def commit_label(project_dir: str) -> str:
    """The checkout's short commit, ``+edits`` when tracked files differ from it; ``no-git`` outside git."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        sha = _git(project_dir, "rev-parse", "--short", "HEAD")
        if sha:
            return sha + ("+edits" if _git(project_dir, "status", "--porcelain", "--untracked-files=no") else "")
    return "no-git"


def edits_hash(project_dir: str, overrides: dict | None) -> str:
    """6 hex digits of what the run changes on top of its commit (tracked edits, the run's overrides); "" when
    nothing: two runs with different param edits get different names."""
    diff = ""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        diff = _git(project_dir, "diff", "HEAD")
    if not diff and not overrides:
        return ""
    payload = diff + "\n" + json.dumps(overrides or {}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:6]


def run_label(project_dir: str, overrides: dict | None, started: float) -> str:
    """``a1b2c3d 12-03 01:24:17 UTC``, ``a1b2c3d+edits-3f9a1c …`` with edits or overrides: the commit, what the
    run changes on top of it, and when it started. Given at the start, so a failed or crashed run has it too."""
    label = commit_label(project_dir)
    changed = edits_hash(project_dir, overrides)
    if changed:
        label = (label if label.endswith("+edits") else label + "+edits") + f"-{changed}"
    return f"{label} {time.strftime('%m-%d %H:%M:%S', time.gmtime(started))} UTC"


def flow_run_name() -> str:
    """The name a run starts with (the flow's flow_run_name): run_label of its project and overrides."""
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    return run_label(parameters.get("project_dir", "."), parameters.get("overrides"), time.time())


def rename_run(name: str) -> None:
    """Give the current flow run its final name (what re-ran); a failed API call leaves the first name."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    with contextlib.suppress(Exception), get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, name=name)


@task(task_run_name="pull from the DVC remote", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10)
def pull_state(project_dir: str) -> str | None:
    """Retried: a pull only adds files the workspace lacks or restores them to what dvc.lock records."""
    return pull(project_dir, get_run_logger().info)


@task(task_run_name="push to the DVC remote", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10)
def push_state(project_dir: str) -> str | None:
    """Retried: a push is idempotent (content-addressed)."""
    return push(project_dir, get_run_logger().info)
