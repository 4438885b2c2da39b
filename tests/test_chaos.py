"""The chaos test: the whole pipeline is crash-consistent, not only the train stage.

One copy of the project runs the Prefect flow (``python -m flows.pipeline``, what ``make run`` runs), and the
test SIGKILLs its whole process tree at once (the flow, ``dvc repro``, the stage, accelerate and its ranks, the
checkpoint writer: each layer runs the next in a process group of its own, so ``kill_tree`` takes them all, as a
node or container crash does) at KILL_POINTS: seeded moments in every stage of dvc.yaml, some of them aimed
at a checkpoint write, and at DVC's commit of promote (its command done, the registry written, dvc.lock not yet
written). After each kill the flow is started again: it skips what DVC finds done, resumes
training, and runs until the next kill point; after the last one, to its end. Meanwhile a second copy runs the
flow once, uninterrupted. Both then hold the same candidate adapter, champion, registry (and ``verify`` passes)
and dvc.lock, with nothing half-written: no leftover temporary files, no DVC lock held, no error record, an
intact DVC cache, ``dvc status`` clean, and no process of a killed run still alive.

Both flows talk to one Prefect server the test starts (a flow's own temporary server costs ~8 s per start,
and there are twelve starts). The kill points are printed and written to kill_points.json in the test's
tmp_path (``pytest tests/test_chaos.py -s`` shows them); FINEFLOW_CHAOS_SEED=N draws other moments.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

from fineflow.core.workspace import WorkspaceLock
from fineflow.registry.promotion_log import read_log
from fineflow.registry.verify import verify_log
from tests.conftest import ROOT, copy_project, venv_env
from tests.faults import fault_env

STAGES = list(yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"])
SEED = int(os.environ.get("FINEFLOW_CHAOS_SEED", "14"))
FLOW = [sys.executable, "-m", "flows.pipeline"]
# every checkpoint write (~12 per checkpoint on the tiny config) sleeps this long first, in the chaos copy
# only: a checkpoint takes ~1.5 s to write, long enough for a kill to land inside it
WRITE_DELAY_S = 0.1
ATTEMPT_TIMEOUT_S = 600
RUNNING = re.compile(r"Running stage '([\w-]+)'")


# ---- where to kill ---------------------------------------------------------------------------------------


def command_done(project: Path, since: float, stage: str) -> bool:
    """The stage's command finished in this attempt: its report is the last thing it writes."""
    report = project / "reports" / f"{stage}.json"
    return report.exists() and report.stat().st_mtime >= since


def committed(project: Path, since: float, stage: str) -> bool:
    """DVC wrote dvc.lock after the stage's command finished in this attempt."""
    report, lock = project / "reports" / f"{stage}.json", project / "dvc.lock"
    return command_done(project, since, stage) and lock.stat().st_mtime >= report.stat().st_mtime


def checkpoint_writes(project: Path) -> list[str]:
    """The checkpoints being written now (their .tmp- directories)."""
    return sorted(p.name for p in (project / "checkpoints").glob("*/.tmp-step-*"))


def writing_checkpoint(step: int, published: int | None = None):
    """Trigger: the checkpoint of `step` is being written, after the one of `published` was published."""

    def trigger(project: Path, _since: float, _stage: str) -> bool:
        done = published is None or any((project / "checkpoints").glob(f"*/step-{published:07d}"))
        return done and f".tmp-step-{step:07d}" in checkpoint_writes(project)

    return trigger


@dataclass(frozen=True)
class KillPoint:
    stage: str  # the stage aimed at: nothing happens before DVC's "Running stage '<stage>'" line
    where: str  # for the note
    delay: tuple[float, float]  # the seeded part: uniform seconds after the trigger (below the stage's length)
    # (project, attempt start, stage) -> whether the seeded delay starts now; None: as the stage starts
    trigger: Callable[[Path, float, str], bool] | None = None


# In pipeline order: each re-run skips the stages done and meets the next point. The delays stay below the
# stage's length on an idle machine (base ~10 s, fingerprint and data ~1 s, validate ~15 s, tokenize ~8 s, train
# ~17 s, evaluate ~11 s, promote ~3 s, goodput ~4 s, with DVC's own time); a loaded machine only makes the stages
# longer.
KILL_POINTS = [
    KillPoint("base", "seeded", (1.0, 6.0)),
    KillPoint("fingerprint", "seeded", (0.05, 0.4)),
    KillPoint("data", "seeded", (0.05, 0.4)),
    KillPoint("validate", "seeded", (1.0, 9.0)),
    KillPoint("tokenize", "seeded", (0.5, 5.0)),
    KillPoint("reference_logps", "seeded", (0.05, 0.4)),  # sft: only its constant reference.json
    KillPoint("train", "in the step-2 checkpoint write", (0.0, 0.8), writing_checkpoint(2)),
    KillPoint("train", "in the step-4 checkpoint write, step 2 published", (0.0, 0.8), writing_checkpoint(4, 2)),
    KillPoint("evaluate", "seeded", (1.0, 7.0)),
    KillPoint("promote", "seeded", (0.3, 2.0)),
    KillPoint("promote", "its command done (registry written), DVC committing", (0.0, 0.3), command_done),
    KillPoint("export", "seeded", (0.05, 0.4)),  # tiny params: export.enabled false, its report alone
    KillPoint("goodput", "seeded", (0.2, 2.0)),  # the ledger: the next run's counts the killed attempts
]


# ---- running the flow ------------------------------------------------------------------------------------


def flow_env(api_url: str, chaos: bool) -> dict[str, str]:
    """What `make run` gets, against the test's server: the HF and Prefect homes left for the flow to put in
    its project (apply_offline_environment), INFO logs (the kill points read DVC's "Running stage" lines),
    unbuffered; in the chaos copy, slow checkpoint writes."""
    env = venv_env()
    for name in ("HF_HOME", "PREFECT_HOME"):
        env.pop(name)
    env.update({"PREFECT_API_URL": api_url, "PREFECT_LOGGING_LEVEL": "INFO", "PYTHONUNBUFFERED": "1"})
    return fault_env(env, write_delay_s=WRITE_DELAY_S) if chaos else env


def start_flow(project: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("w") as fh:
        return subprocess.Popen(FLOW, cwd=project, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def finish_flow(proc: subprocess.Popen, log: Path) -> str:
    proc.wait(timeout=ATTEMPT_TIMEOUT_S)
    output = log.read_text()
    assert proc.returncode == 0, output[-6000:]
    return output


def kill_at(project: Path, point: KillPoint, delay: float, env: dict[str, str], log: Path) -> dict:
    """Start the flow, wait for the point's stage to start and its trigger, then `delay` seconds, and SIGKILL
    the flow's whole process group. Returns what the kill hit."""
    since = time.time()  # file mtimes are wall-clock
    proc = start_flow(project, env, log)
    marker = f"Running stage '{point.stage}'"
    stage_began = triggered = None
    text = ""
    try:
        with log.open() as reader:
            deadline = time.monotonic() + ATTEMPT_TIMEOUT_S
            while proc.poll() is None and time.monotonic() < deadline:
                text += reader.read()
                now = time.monotonic()
                if stage_began is None and marker in text:
                    stage_began = now
                if triggered is None and stage_began is not None:
                    fired = point.trigger is None or point.trigger(project, since, point.stage)
                    triggered = now if fired else None
                if triggered is not None and now >= triggered + delay:
                    kill_tree(proc)
                    text += reader.read()
                    return {
                        "stage": point.stage,
                        "where": point.where,
                        "landed_in": RUNNING.findall(text)[-1],
                        "s_into_stage": round(now - stage_began, 2),
                        "delay_s": round(delay, 3),
                        "command_done": command_done(project, since, point.stage),
                        "committed": committed(project, since, point.stage),
                        "checkpoint_writes": checkpoint_writes(project),
                    }
                time.sleep(0.02)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    pytest.fail(f"kill point {point} never came (flow exit {proc.returncode}):\n{log.read_text()[-5000:]}")


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the flow and every process under it at once, whatever process group or session each runs in: what
    a node or container crash does. (The flow's layers each run the next in a process group of its own, to
    forward Ctrl-C and SIGTERM; the flow's own group alone would miss them.) Everything is frozen first
    (SIGSTOP), so no process reacts to another's death or starts a new one before all are killed."""
    try:
        root = psutil.Process(proc.pid)
        frozen: dict[int, psutil.Process] = {}
        while True:  # freeze, then look again: a child started while we froze its parent is frozen too
            found = {p.pid: p for p in [root, *root.children(recursive=True)] if p.pid not in frozen}
            if not found:
                break
            for p in found.values():
                try:
                    p.suspend()
                except psutil.Error:
                    pass
            frozen.update(found)
        for p in frozen.values():
            try:
                p.kill()
            except psutil.Error:
                pass
    except psutil.NoSuchProcess:
        pass
    proc.wait()


def survivors(project: Path, timeout: float = 10) -> list[psutil.Process]:
    """Processes still working in the project (cwd inside it) after a kill, once the dying had time to die."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [
            proc
            for proc in psutil.process_iter(["cwd", "status"])
            if proc.info["status"] != psutil.STATUS_ZOMBIE and (proc.info["cwd"] or "").startswith(str(project))
        ]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def assert_none_survived(project: Path, kill: dict) -> None:
    """Nothing of the killed run lives on (a process outside the flow's group would: it keeps writing and
    holding DVC's lock under the re-run). Any that does is named, then killed: the test started it."""
    alive = survivors(project)
    named = []
    for proc in alive:
        try:
            named.append(f"{proc.pid} (pgid {os.getpgid(proc.pid)}): {' '.join(proc.cmdline())[:200]}")
            proc.kill()
        except (psutil.Error, ProcessLookupError):
            pass
    assert not alive, f"kill {kill['index']} ({kill['stage']}, {kill['where']}) left processes alive: {named}"


# ---- what a run leaves -----------------------------------------------------------------------------------


def tree(path: Path) -> dict[str, str]:
    """sha256 of every file below path, by relative name."""
    return {
        str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.rglob("*"))
        if f.is_file()
    }


def half_written(project: Path) -> list[str]:
    """Temporary names an interrupted write leaves (checkpoints' .tmp-/.trash-/.old-, write_json_atomic's
    .tmp, the registry's .staging/.retired), outside git, the DVC cache and DVC's own lock files (checked
    apart) and the HF cache."""
    skip = (".git", ".dvc", ".cache/huggingface", ".prefect")
    found = []
    for path in project.rglob("*"):
        rel = path.relative_to(project).as_posix()
        if rel.startswith(skip):
            continue
        if path.name.startswith((".tmp-", ".trash-", ".old-")) or path.name.endswith((".tmp", ".staging", ".retired")):
            found.append(rel)
    return sorted(found)


def corrupt_cache_objects(project: Path) -> list[str]:
    """DVC cache objects whose bytes do not hash to their name (a copy into the cache cut short)."""
    bad = []
    for obj in (project / ".dvc/cache/files/md5").glob("*/*"):
        name = obj.parent.name + obj.name.removesuffix(".dir")
        if hashlib.md5(obj.read_bytes()).hexdigest() != name:
            bad.append(str(obj.relative_to(project)))
    return bad


def live_lock_holders(project: Path) -> list[dict]:
    """Processes working in the project that DVC's rwlock says hold a path. A killed `dvc repro` leaves its
    entries behind; DVC ignores those of dead PIDs (and drops them when a stage writing those paths runs)."""
    lock = json.loads((project / ".dvc/tmp/rwlock").read_text())
    holders = [*lock.get("write", {}).values(), *(h for hs in lock.get("read", {}).values() for h in hs)]
    return [holder for holder in holders if _works_in(holder["pid"], project)]


def _works_in(pid: int, project: Path) -> bool:
    try:
        return psutil.Process(pid).cwd().startswith(str(project))
    except psutil.Error:  # gone, or a process of another user: not one of the pipeline's
        return False


def dvc_status(project: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "dvc", "status", "--json"], cwd=project, env=venv_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def stage_locks(project: Path) -> dict:
    return yaml.safe_load((project / "dvc.lock").read_text(encoding="utf-8"))["stages"]


# ---- the test --------------------------------------------------------------------------------------------


def test_the_kill_points_cover_every_stage_in_pipeline_order():
    assert {p.stage for p in KILL_POINTS} == set(STAGES) and len(KILL_POINTS) >= 10
    order = [STAGES.index(p.stage) for p in KILL_POINTS]
    assert order == sorted(order)  # each re-run meets the next point: none is skipped over


@pytest.mark.scenario
@pytest.mark.nightly  # ~13 flow starts, 11 of them killed: longer than CI's whole budget
@pytest.mark.slow
def test_sigkills_in_every_stage_leave_what_an_uninterrupted_run_leaves(prefect_server, tmp_path):
    reference, chaos = copy_project(tmp_path / "reference"), copy_project(tmp_path / "chaos")
    began = time.monotonic()
    uninterrupted = start_flow(reference, flow_env(prefect_server, chaos=False), tmp_path / "reference.log")
    rng, env = random.Random(SEED), flow_env(prefect_server, chaos=True)
    kills = []
    try:
        for i, point in enumerate(KILL_POINTS):
            kill = kill_at(chaos, point, rng.uniform(*point.delay), env, tmp_path / f"attempt-{i:02d}.log")
            kills.append({"index": i, **kill})
            assert_none_survived(chaos, kills[-1])
        last = tmp_path / "attempt-final.log"
        final = finish_flow(start_flow(chaos, env, last), last)
        chaos_s = time.monotonic() - began
    except BaseException:  # the chaos run's failure is the news: the reference is not waited for
        if uninterrupted.poll() is None:
            kill_tree(uninterrupted)
            uninterrupted.wait()
        for proc in survivors(reference, timeout=0) + survivors(chaos, timeout=0):
            proc.kill()
        raise
    finish_flow(uninterrupted, tmp_path / "reference.log")
    reran = RUNNING.findall(final)
    note = json.dumps({"seed": SEED, "kills": kills, "final_run_ran": reran, "chaos_s": round(chaos_s, 1)}, indent=1)
    (tmp_path / "kill_points.json").write_text(note)
    print(note)

    assert [k["landed_in"] for k in kills] == [p.stage for p in KILL_POINTS], note
    # what the pipeline produced: byte for byte the uninterrupted run's
    assert tree(chaos / "models/candidate") == tree(reference / "models/candidate")
    assert tree(chaos / "models/champion") == tree(reference / "models/champion")
    decisions = [(e["seq"], e["candidate_id"], e["decision"]) for e in read_log(chaos / "models/registry")]
    assert read_log(chaos / "models/registry") == read_log(reference / "models/registry"), (decisions, note)
    assert tree(chaos / "models/registry") == tree(reference / "models/registry")
    assert verify_log(chaos / "models/registry") == []
    chaos_lock, reference_lock = stage_locks(chaos), stage_locks(reference)
    assert [s for s in STAGES if chaos_lock.get(s) != reference_lock.get(s)] == [], note
    # and nothing half-written: no temporary leftovers, no error record, no DVC lock held, an intact cache
    assert half_written(chaos) == []
    assert sorted(p.name for p in (chaos / "reports").glob("*.error.json")) == []
    assert live_lock_holders(chaos) == []
    workspace = WorkspaceLock(chaos, "the test")  # the killed runs' hold on the workspace died with them
    assert workspace.try_acquire(), workspace.holder()
    workspace.release()
    assert corrupt_cache_objects(chaos) == []
    # dvc status takes DVC's lock: not held
    assert dvc_status(chaos) == {"fingerprint": ["always changed"], "goodput": ["always changed"]}
