"""The flow run's own bookkeeping: its turn in the workspace (one run at a time), its name, and the state it
moves to and from the DVC remote.

A run waits for the workspace in a task of its own (``wait for the workspace``, Running while it waits, its log
naming the run it waits for), so the UI shows a queued run as waiting, not as failed. Runs are named after
what they are: the commit (``a1b2c3d``; ``+edits-3f9a1c`` for uncommitted changes or overrides, a short hash of
them), when the run started (``12-03 01:24:17 UTC``), the start of its run id (``#7c1e``: runs triggered in the
same second differ), and once the stages have run what DVC re-ran (``…: train,
evaluate, promote`` or ``…: nothing changed``), or where it failed (``…: failed at train``).

With a default DVC remote configured (``dvc remote add -d``), a run starts with ``dvc pull`` and ends with
``dvc push``: a run in a fresh clone (a work-pool worker's) reuses the base, the shards, the checkpoints'
results, the champion and the registry, and retrains only what changed; the next one finds this one's. Without
a remote both are skipped (the embedded default keeps its state in the workspace).

Runs whose process died (SIGKILL, the OOM killer, a server stopped with them) cannot report their end, and Prefect
would show them Running forever: every run carries its workspace's and its process's tags, and a run's start marks
Crashed the Running runs of its workspace whose process is gone (``reconcile_runs``). After a stop signal, a flow
process whose Prefect server died with it exits as soon as its stage has stopped (``exit_once_the_api_is_gone``)
instead of retrying a dead API past the grace the platform allows.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from fineflow.core.workspace import HOLDER_ENV, WorkspaceLock, describe
from fineflow.remote import pull, push

SUPERVISED_ENV = "FINEFLOW_FLOW_SUPERVISOR"  # the supervisor's pid, in the flow process it starts (flows.pipeline)
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
    """The name a run starts with (the flow's flow_run_name): run_label of its project and overrides, then the
    first 4 hex digits of the run's id: two runs triggered at once (same commit, same second) differ."""
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    label = run_label(parameters.get("project_dir", "."), parameters.get("overrides"), time.time())
    return f"{label} #{str(flow_run.id)[:4]}" if flow_run.id else label


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


_WATCHING: list[threading.Thread] = []  # the one watchdog of exit_once_the_api_is_gone


def exit_once_the_api_is_gone(code: int, project_dir: str, poll_s: float = 0.5) -> None:
    """After a stop signal: once no stage of the project runs any more and Prefect's API does not answer, exit
    `code` at once. A signal to every process (Slurm's job step, systemd's control group) also stops the flow's
    temporary server; Prefect would then spend its report of the stop and its exit handlers (events, logs)
    retrying a dead server, past the grace the platform allows (measured: 33 s). The run stays Running in that
    server's database; the next run marks it Crashed (mark_dead_runs_crashed). Only in the flow process of
    `python -m flows.pipeline` (SUPERVISED_ENV), whose supervisor ends whatever it leaves: elsewhere (a worker's
    run, a test) the process is not this function's to end."""
    if _WATCHING or not os.environ.get(SUPERVISED_ENV):
        return
    project = Path(project_dir).resolve()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            # the stage first: it may still be saving its step, and this process's exit would close the pipe
            # its output goes to (dvc, its parent, may be gone already: the stage is then no descendant of ours)
            if not _stage_running(project) and not _api_answers():
                print("fineflow run: Prefect's server is gone: the next run marks this run Crashed", file=sys.stderr)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    _WATCHING.append(threading.Thread(target=watch, name="fineflow-exit-when-api-gone", daemon=True))
    _WATCHING[0].start()


def _stage_running(project: Path) -> bool:
    """Whether a `dvc` or a stage process works in the project (whoever its parent is now)."""
    import psutil

    for process in psutil.process_iter(["cmdline", "cwd", "status"]):
        info = process.info
        command = info["cmdline"] or []
        if info["status"] == psutil.STATUS_ZOMBIE or not info["cwd"] or Path(info["cwd"]) != project:
            continue
        if "dvc" in command or any(part.startswith("fineflow.stages") for part in command):
            return True
    return False


def _api_answers(timeout_s: float = 0.5) -> bool:
    """Whether the Prefect API this process uses (PREFECT_API_URL, or its temporary server) accepts a
    connection."""
    from urllib.parse import urlsplit

    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    servers = [server.address for server in SubprocessASGIServer._instances.values() if server.port]
    urls = [PREFECT_API_URL.value(), *servers]
    urls = [url for url in urls if url]
    if not urls:
        return True  # no API known to this process: none that went away
    for url in urls:
        parts = urlsplit(url)
        with contextlib.suppress(OSError, ValueError):
            port = parts.port or (443 if parts.scheme == "https" else 80)
            with socket.create_connection((parts.hostname, port), timeout_s):
                return True
    return False


# --- runs whose process died: marked Crashed by the next run -------------------------------------------------
# A run killed outright (SIGKILL, the OOM killer, a lost machine, a server stopped with it) cannot report its
# end: Prefect keeps it Running forever. Each run carries two tags, its workspace's and its process's (host,
# pid, start time: a reused pid is another process); a run's start marks Crashed every Running run of its
# workspace whose process on this host is gone.
WORKSPACE_TAG = "fineflow-workspace:"
PROCESS_TAG = "fineflow-process:"


def workspace_tag(project_dir: str) -> str:
    """The tag of a workspace's runs: its host and a short hash of its absolute path."""
    path = str(Path(project_dir).resolve())
    return f"{WORKSPACE_TAG}{socket.gethostname()}:{hashlib.sha256(path.encode()).hexdigest()[:8]}"


def process_tag(pid: int | None = None) -> str:
    """The tag of the process running a run: host, pid and the process's start time (whole seconds)."""
    import psutil

    process = psutil.Process(pid or os.getpid())
    return f"{PROCESS_TAG}{socket.gethostname()}:{process.pid}:{int(process.create_time())}"


def process_gone(tag: str) -> bool:
    """Whether the process a process tag names has ended: False for another host's (not knowable here)."""
    import psutil

    host, pid, started = tag.removeprefix(PROCESS_TAG).rsplit(":", 2)
    if host != socket.gethostname():
        return False
    try:
        return abs(psutil.Process(int(pid)).create_time() - int(started)) > 1  # the pid now names another process
    except psutil.NoSuchProcess:
        return True


def tag_this_run(client, run_id, project_dir: str) -> None:
    """Give the run its workspace's and its process's tags (kept with the tags it has)."""
    run = client.read_flow_run(run_id)
    ours = [workspace_tag(project_dir), process_tag()]
    kept = [tag for tag in run.tags if not tag.startswith((WORKSPACE_TAG, PROCESS_TAG))]
    client.update_flow_run(run_id, tags=[*kept, *ours])


def mark_dead_runs_crashed(client, project_dir: str, current=None) -> list[str]:
    """Set Crashed every Running run of the workspace (but `current`) whose process is gone; their names."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    running = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING]))
    ours = FlowRunFilter(state=running, tags=FlowRunFilterTags(all_=[workspace_tag(project_dir)]))
    marked = []
    for run in client.read_flow_runs(flow_run_filter=ours):
        process = next((tag for tag in run.tags if tag.startswith(PROCESS_TAG)), None)
        if run.id == current or process is None or not process_gone(process):
            continue
        message = f"its process ({process.removeprefix(PROCESS_TAG)}) ended without reporting: marked by a later run"
        client.set_flow_run_state(run.id, Crashed(message=message), force=True)
        marked.append(run.name)
    return marked


def reconcile_runs(project_dir: str) -> None:
    """The current run's tags, then Crashed for the workspace's dead runs (logged); never fails the run."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if not flow_run.id:
        return  # the flow's function called outside a flow run: no run to tag
    logger = get_run_logger()
    try:
        with get_client(sync_client=True) as client:
            tag_this_run(client, flow_run.id, project_dir)
            for name in mark_dead_runs_crashed(client, project_dir, current=flow_run.id):
                logger.warning(f"run {name!r} was left Running by a process that is gone: marked Crashed")
    except Exception as exc:  # bookkeeping: the run itself goes on
        logger.warning(f"could not check this workspace's earlier runs: {exc}")
