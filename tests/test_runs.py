"""A flow run's bookkeeping and what it shows in the Prefect UI: one run at a time per workspace
(a second run waits and names the one it waits for; a killed holder frees the workspace), the run's name, the
stage reports as whole tables, the promotion's evidence, progress-bar redraws kept out of the logs, and a busy
workspace named in a failed stage's message."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import pytest
import yaml

from fineflow.core.dvc_project import upstream_stages
from fineflow.core.workspace import WorkspaceLock, describe
from tasks.artifacts import promotion_markdown, report_table
from tasks.runs import commit_label
from tasks.stages import StageFailed, is_progress_redraw
from tests.conftest import copy_project


def test_a_second_holder_waits_and_is_told_who_holds_the_workspace(tmp_path):
    first = WorkspaceLock(tmp_path, "flow run 'nightly'")
    assert first.try_acquire()
    second = WorkspaceLock(tmp_path, "flow run 'by hand'")
    assert not second.try_acquire()
    assert first.holder()["owner"] == "flow run 'nightly'" and first.holder()["pid"] == os.getpid()
    told, acquired, tries = [], {}, []
    try_acquire = second.try_acquire
    second.try_acquire = lambda: tries.append(time.monotonic()) or try_acquire()  # counts the waiter's polls

    def wait():
        acquired["waited_s"] = second.acquire(on_wait=lambda holder, waited: told.append(describe(holder)), poll_s=0.05)

    waiter = threading.Thread(target=wait)
    waiter.start()
    deadline = time.monotonic() + 30
    while len(tries) < 3 and time.monotonic() < deadline:  # the waiter has found it held three times
        time.sleep(0.01)
    assert waiter.is_alive() and len(tries) >= 3  # still waiting: the workspace is held
    assert told and told[0].startswith("flow run 'nightly' (pid ")  # and it said for whom, at once
    released_at = time.monotonic()
    first.release()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and acquired["waited_s"] >= released_at - tries[0]  # only after the release
    assert second.holder()["owner"] == "flow run 'by hand'"
    second.release()


def test_a_sigkilled_holder_never_blocks_the_next_run(tmp_path):
    """The kernel drops a flock with its process: a crashed run leaves nothing to clean up by hand."""
    holder = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from fineflow.core.workspace import WorkspaceLock
        assert WorkspaceLock(Path({str(tmp_path)!r}), "doomed").try_acquire()
        print("held", flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        lock = WorkspaceLock(tmp_path, "next")
        assert not lock.try_acquire() and lock.holder()["pid"] == proc.pid
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert lock.try_acquire()
    lock.release()


def test_the_lock_is_not_inherited_by_the_stages_a_run_starts(tmp_path):
    """A stage process that outlives its run (an orphan) must not keep the workspace: the fd is close-on-exec."""
    lock = WorkspaceLock(tmp_path, "parent")
    assert lock.try_acquire()
    try:
        child = subprocess.run(["ls", f"/proc/self/fd/{lock._fd}"], capture_output=True)
        assert child.returncode != 0
    finally:
        lock.release()


@pytest.mark.slow
def test_a_stage_dvc_repro_or_rollback_outside_the_holding_run_stops_with_one_message_naming_it(tmp_path):
    """While a flow run holds the workspace: a stage called by hand, `dvc repro`, `fineflow registry rollback` and
    the train launcher each stop at once (exit 2) with one message naming the run, its pid and since when, and
    write nothing, not even an error record over the holder's; the holding run's own stages
    (FINEFLOW_WORKSPACE_HOLDER: its pid) go on. Once it is free, the stage runs and gives the workspace back."""
    from tests.conftest import venv_env

    project = copy_project(tmp_path / "project")
    flow = WorkspaceLock(project, "flow run 'a1b2c3d'")
    assert flow.try_acquire()
    env = {k: v for k, v in venv_env().items() if k != "FINEFLOW_WORKSPACE_HOLDER"}
    stage = [sys.executable, "-m", "fineflow.stages.data", "--train", "data/raw/train.jsonl", "--eval", "e.jsonl"]
    commands = {
        "by hand": stage,
        "dvc repro": [sys.executable, "-m", "dvc", "repro", "data"],
        "rollback": [sys.executable, "-m", "fineflow.cli", "registry", "rollback"],
        "train launcher": [sys.executable, "-m", "fineflow.stages.train", "--shards", "data/shards", "--base-dir"]
        + ["models/base", "--checkpoints", "checkpoints", "--out", "models/candidate", "--steps-log", "s.jsonl"],
    }
    holder = f"in use by flow run 'a1b2c3d' (pid {os.getpid()}, since "
    # the holding run's own stage record (its task reads it): a stopped stage must neither remove nor replace it
    record = project / "reports/data.error.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text('{"stage": "data", "kind": "preempted", "message": "the holding run\'s"}')
    for caller, command in commands.items():
        done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=300)
        output = done.stdout + done.stderr
        assert done.returncode != 0 and output.count(holder) == 1, (caller, output[-3000:])
        assert "Wait until it ends, or stop it" in output and "Traceback" not in output, (caller, output[-3000:])
        assert not (project / "data/raw/train.jsonl").exists() and not (project / "models/registry").exists()
        assert "the holding run's" in record.read_text(), caller
    own = subprocess.run(stage, cwd=project, env={**env, "FINEFLOW_WORKSPACE_HOLDER": str(os.getpid())})
    assert own.returncode == 0 and (project / "data/raw/train.jsonl").exists()  # the holding run's own stage
    flow.release()
    (project / "data/raw/train.jsonl").unlink()
    done = subprocess.run(stage, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and (project / "data/raw/train.jsonl").exists(), done.stderr
    assert WorkspaceLock(project, "next run").try_acquire()  # the stage gave it back


def test_approval_with_prefects_temporary_server_fails_at_once_saying_how_to_answer(tmp_path):
    """Nobody can resume a run on the temporary server `make run` starts without PREFECT_API_URL: rather than
    wait for hours, the flow says where to run it, or how to give the answer up front."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from fineflow.errors import FineflowError
    from tasks import approval_pause
    from tests.conftest import write_params

    write_params(tmp_path / "params.yaml", {"promote.require_approval": True})
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert not approval_pause.api_is_a_server()
        with pytest.raises(FineflowError, match="temporary server") as failed:
            approval_pause.ask_for_approval({"candidate_id": "c1"}, str(tmp_path))
    assert "PREFECT_API_URL=" in str(failed.value) and "FINEFLOW_APPROVAL=" in str(failed.value)
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        assert approval_pause.api_is_a_server()


def test_upstream_stages_resolve_dvc_templating_and_paths_inside_outputs(tmp_path):
    (tmp_path / "params.yaml").write_text("data:\n  path: raw/rows.jsonl\n", encoding="utf-8")
    (tmp_path / "dvc.yaml").write_text(
        textwrap.dedent(
            """
            stages:
              fetch: {cmd: a, outs: [raw]}
              check: {cmd: b, deps: ['${data.path}', code.py], outs: [{checked: {persist: true}}]}
              use: {cmd: c, deps: [checked/part-0.jsonl]}
            """
        ),
        encoding="utf-8",
    )
    assert upstream_stages(tmp_path) == {"fetch": [], "check": ["fetch"], "use": ["check"]}


def test_a_run_is_named_after_its_commit_and_uncommitted_edits(tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    assert commit_label(str(tmp_path)) == "no-git"
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "params.yaml").write_text("seed: 1\n")
    subprocess.run(git + ["add", "-A"], cwd=tmp_path, check=True)
    subprocess.run(git + ["commit", "-qm", "x"], cwd=tmp_path, check=True)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True)
    assert commit_label(str(tmp_path)) == sha.stdout.strip()
    (tmp_path / "params.yaml").write_text("seed: 2\n")
    assert commit_label(str(tmp_path)) == sha.stdout.strip() + "+edits"


def test_a_report_is_a_table_of_whole_values():
    plan = {"micro_batch_size": 8, "why": "fits in 80 GiB with activation checkpointing " * 10}
    rows = report_table({"stage": "train", "tokens_per_s": 12920.5, "plan": plan, "losses": [0.5, 0.25]})
    table = {row["figure"]: row["value"] for row in rows}
    assert table["stage"] == "train" and table["tokens_per_s"] == "12,920.5" and table["losses"] == "0.5000, 0.2500"
    assert table["plan.why"] == plan["why"]  # nothing cut off (it was at 200 characters)
    assert table["plan.micro_batch_size"] == "8"


def test_the_promotion_artifact_carries_the_gates_evidence(tmp_path):
    report = {
        "decision": "promoted",
        "reason": "exact_match 0.7650 beats the base model's 0.0000",
        "candidate_id": "215b44c9bc1e947a",
        "primary_metric": "fineflow_synth/exact_match",
        "reference": "base model",
        "candidate_value": 0.765,
        "reference_value": 0.0,
        "delta": 0.765,
        "ci_low": 0.71,
        "ci_high": 0.825,
        "p_value": 0.0,
    }
    (tmp_path / "models/champion").mkdir(parents=True)
    (tmp_path / "models/champion/README.md").write_text("# card\n")
    markdown = promotion_markdown(report, tmp_path)
    shown = ("**promoted**", "215b44c9bc1e947a", "[+0.7100, +0.8250]", "| p-value | 0.000 |", "models/champion")
    for text in shown:
        assert text in markdown


def test_the_training_charts_are_embedded_in_the_run_page_with_their_files_paths(tmp_path):
    from fineflow.train.plots import write_run_plots
    from tasks.artifacts import charts_markdown

    steps = tmp_path / "train_steps.jsonl"
    records = [{"step": s, "loss": 6 - s / 10, "lr": 1e-3, "tokens_per_s": 900.0, "peak_mem_mb": 400.0} for s in (1, 2)]
    records[-1]["eval_loss"] = 5.5
    steps.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 3, "lo')  # a torn last line
    written = write_run_plots(steps, tmp_path / "plots")
    assert json.loads((tmp_path / "plots/train_steps.json").read_text())[-1]["step"] == 2
    assert json.loads((tmp_path / "plots/eval_loss.json").read_text()) == [{"step": 2, "eval_loss": 5.5}]
    markdown = charts_markdown(tmp_path / "plots")
    assert markdown.count("](data:image/png;base64,iVBORw0KGgo") == 3  # PNG magic, base64
    for chart in ("loss.png", "memory.png", "tokens_per_s.png"):
        assert f"\nreports/plots/{chart}\n" in markdown and tmp_path / "plots" / chart in written
    assert "file://" not in markdown  # a browser page opens no file:// link
    assert charts_markdown(tmp_path / "nothing") is None


@pytest.mark.parametrize(
    ("line", "redraw"),
    [
        ("Map:  40%|████      | 2/5 [00:01<00:01,  2.30 examples/s]", True),
        ("  0%|          | 0/3 [00:00<?, ?it/s]", True),
        ("Map: 100%|██████████| 5/5 [00:01<00:00,  4.10 examples/s]", False),  # the finished bar stays
        ("step 40/800 loss 0.3120 tokens/s 12920", False),
        ("Running stage 'train':", False),
    ],
)
def test_progress_bar_redraws_are_kept_out_of_the_logs(line, redraw):
    assert is_progress_redraw(line) is redraw


def test_a_busy_workspace_is_named_in_the_failed_stages_message():
    """DVC's line naming the process that holds the workspace was filtered out of the task's state message."""
    tail = [
        "Running stage 'base':",
        "ERROR: failed to reproduce 'base': 'models/base' is busy, it is being blocked by:",
        "  (PID 4242): dvc repro --single-item evaluate",
        "",
        "If there are no processes with such PIDs, you can manually remove '.dvc/tmp/rwlock' and try again.",
    ]
    message = str(StageFailed("base", 255, tail))
    assert "is being blocked by" in message and "(PID 4242): dvc repro --single-item evaluate" in message


def _post(api_url: str, path: str, body: dict | None = None) -> list | dict:
    request = urllib.request.Request(
        f"{api_url}{path}", data=json.dumps(body or {}).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _flow_runs(api_url: str) -> list[dict]:
    return _post(api_url, "/flow_runs/filter")


@pytest.mark.scenario
@pytest.mark.nightly  # two whole flow runs
@pytest.mark.slow
def test_two_flow_runs_started_at_once_in_one_workspace_run_one_after_the_other(prefect_server, tmp_path):
    """A run started while another runs in the same workspace waits for it (its log says for which run, instead
    of dying on DVC's "'models/base' is busy"), then finds everything done; both succeed, `dvc status` is clean,
    and each run is named after its commit and what it re-ran."""
    from tests.test_chaos import STAGES, dvc_status, finish_flow, flow_env, start_flow

    project = copy_project(tmp_path / "project")
    env = flow_env(prefect_server, chaos=False)
    logs = tmp_path / "first.log", tmp_path / "second.log"
    first = start_flow(project, env, logs[0])
    deadline = time.monotonic() + 300
    while "Running stage 'base'" not in logs[0].read_text() and time.monotonic() < deadline:
        assert first.poll() is None, logs[0].read_text()[-3000:]
        time.sleep(0.2)
    second = start_flow(project, env, logs[1])
    outputs = finish_flow(first, logs[0]), finish_flow(second, logs[1])
    ran = [[stage for stage in STAGES if f"Running stage '{stage}'" in output] for output in outputs]
    # the second found the first's work done (fingerprint and the goodput ledger always run)
    assert ran == [STAGES, ["fingerprint", "goodput"]]
    assert "waiting for the workspace" in outputs[1] and "held by flow run '" in outputs[1], outputs[1][-3000:]
    assert "is busy" not in outputs[1]
    assert dvc_status(project) == {"fingerprint": ["always changed"], "goodput": ["always changed"]}
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=project, capture_output=True, text=True)
    names = sorted(r["name"] for r in _flow_runs(prefect_server) if r["parameters"].get("project_dir") == str(project))
    commit = sha.stdout.strip()
    # commit, start (UTC), the run id's start, what re-ran
    named = re.compile(rf"{commit} \d\d-\d\d \d\d:\d\d:\d\d UTC #[0-9a-f]{{4}}: (.+)")
    reran = sorted(named.fullmatch(name).group(1) for name in names)
    assert reran == sorted([", ".join(STAGES), "fingerprint, goodput"])


@pytest.mark.nightly  # a served flow waits for its scheduled minute; CI keeps prefect.yaml + worker
@pytest.mark.slow
def test_make_serves_schedule_is_in_its_own_time_zone_and_its_scheduled_run_fires(prefect_server, tmp_path):
    """`python -m flows.deploy` (what `make serve CRON=… TIMEZONE=…` runs), in a copy of the project, against a
    server on loopback: the deployment carries the cron and its explicit time zone, and the schedule fires a
    run that starts the pipeline in that copy. The serve process is then stopped by its PID."""
    from tests.test_chaos import flow_env, kill_tree

    project = copy_project(tmp_path / "project")
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "flows.deploy", "--name", "t", "--cron", "* * * * *", "--timezone", "Europe/Berlin"]
    with log.open("w") as fh:
        serve = subprocess.Popen(
            argv, cwd=project, env=flow_env(prefect_server, chaos=False), stdout=fh, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 180
        started = []
        while not started and time.monotonic() < deadline:
            assert serve.poll() is None, log.read_text()[-3000:]
            time.sleep(2)
            # this copy's runs (the module's server also holds the other tests' runs and deployments)
            runs = [r for r in _flow_runs(prefect_server) if r["parameters"].get("project_dir") == str(project)]
            started = [r for r in runs if r["state_type"] in ("RUNNING", "COMPLETED")]
        assert started, log.read_text()[-3000:]
        [deployment] = [d for d in _post(prefect_server, "/deployments/filter") if d["name"] == "t"]
        [schedule] = deployment["schedules"]
        assert schedule["schedule"]["cron"] == "* * * * *" and schedule["schedule"]["timezone"] == "Europe/Berlin"
        assert started[0]["deployment_id"] == deployment["id"] and started[0]["parameters"]["project_dir"] == str(
            project
        )
        assert (project / ".dvc/tmp/fineflow-run.lock").exists()  # the run took its turn in the copy's workspace
    finally:
        kill_tree(serve)  # the serve process and the run it started, with every stage process under it


def test_training_progress_becomes_a_progress_artifact_throttled_and_finished(monkeypatch):
    """The train stage's plain progress lines (fineflow.train.steps.Progress, no terminal) drive one progress
    artifact: created on the first step line, updated at most every few seconds, and always at the last step."""
    import tasks.artifacts as artifacts

    calls = []
    monkeypatch.setattr(artifacts, "create_progress_artifact", lambda **kw: calls.append(("create", kw)) or "id-1")
    monkeypatch.setattr(artifacts, "update_progress_artifact", lambda aid, **kw: calls.append(("update", aid, kw)))
    progress = artifacts.TrainingProgress("train", every_s=3600)
    progress.see("Running stage 'train':")
    progress.see("[train] step 100/800 loss 0.5123 12,920 tok/s lr 3.00e-04 ETA 52s")
    progress.see("[train] step 200/800 loss 0.4021 13,001 tok/s lr 3.00e-04 ETA 45s")  # within every_s: skipped
    progress.see("[train] step 800/800 loss 0.3640 12,950 tok/s eval_loss 0.2630 lr 3.00e-04 ETA 0s")
    assert [c[0] for c in calls] == ["create", "update"]
    assert calls[0][1]["progress"] == 12.5 and calls[0][1]["key"] == "fineflow-train-progress"
    assert calls[0][1]["description"] == "train: step 100/800, 12,920 tokens/s, ETA 52 s"
    assert calls[1][1] == "id-1" and calls[1][2]["progress"] == 100.0


def test_a_failing_progress_api_never_breaks_the_stage(monkeypatch):
    import tasks.artifacts as artifacts

    def dead(**kw):
        raise ConnectionError("the API is gone")

    monkeypatch.setattr(artifacts, "create_progress_artifact", dead)
    artifacts.TrainingProgress("train").see("step 1/2 loss 0.5 10 tok/s lr 1.00e-03 ETA 1s")


def _dvc(project, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_run_pushes_to_the_dvc_remote_and_a_fresh_clone_pulls_what_it_pushed(kind, tmp_path, request):
    """The flow's first and last tasks (pull_state, push_state): a worker's fresh clone gets the last run's
    outputs from the default remote instead of rebuilding them, and leaves its own there. Without a remote
    neither does anything. The remote is a folder, or an S3 API server on 127.0.0.1."""
    from tasks.runs import pull, push
    from tests.conftest import add_s3_remote

    def add_remote(project):
        if kind == "s3":
            add_s3_remote(project, request.getfixturevalue("s3_server"), prefix=tmp_path.name)
        else:
            _dvc(project, "remote", "add", "-d", "store", str(tmp_path / "remote"))

    assert pull(str(copy_project(tmp_path / "no-remote")), print) is None
    first = copy_project(tmp_path / "first")
    add_remote(first)
    _dvc(first, "repro", "--single-item", "data")
    logs = []
    assert push(str(first), logs.append) == "store", logs
    assert "3 files pushed" in logs[-1], logs  # the data stage's two files, and its run-cache entry
    fresh = copy_project(tmp_path / "fresh")  # a new clone of the commit the first run's dvc.lock was pushed with
    (fresh / "dvc.lock").write_bytes((first / "dvc.lock").read_bytes())
    add_remote(fresh)
    assert pull(str(fresh), logs.append) == "store"
    for split in ("train", "eval"):
        assert (fresh / f"data/raw/{split}.jsonl").read_bytes() == (first / f"data/raw/{split}.jsonl").read_bytes()
    assert json.loads(_dvc(fresh, "status", "--json", "data")) == {}  # nothing to rebuild


@pytest.mark.slow
def test_a_pull_keeps_the_unsaved_outputs_a_killed_stage_left_and_still_restores_the_rest(tmp_path):
    """Seen in the soak: a promote stage killed after it wrote the champion but before DVC recorded it left
    files DVC never saved; every later run's `dvc pull` then refused ("Can't remove the following unsaved
    files") and failed, run after run, until a person intervened. The pull now keeps those files (the stage's
    re-run decides what they become) and still restores every other output the workspace lacks."""
    from tasks.runs import pull

    project = copy_project(tmp_path / "project")
    _dvc(project, "remote", "add", "-d", "store", str(tmp_path / "remote"))
    _dvc(project, "repro", "--single-item", "data")
    _dvc(project, "push")
    shutil.rmtree(project / ".dvc/cache")  # another machine's run: the lock's outputs are on the remote only
    (project / "data/raw/eval.jsonl").unlink()  # missing here: the pull must restore it
    killed = project / "data/raw/train.jsonl"  # what a killed stage left: written, never saved by DVC
    killed.write_text('{"instruction": "half", "output": "written"}\n')
    logs = []
    assert pull(str(project), logs.append) == "store"
    assert killed.read_text() == '{"instruction": "half", "output": "written"}\n'  # kept
    assert (project / "data/raw/eval.jsonl").is_file()  # restored from the remote
    assert any("unsaved" in line and "data/raw/train.jsonl" in line for line in logs), logs


def test_a_failing_remote_fails_the_pull_so_its_task_retries_instead_of_rebuilding_everything(tmp_path, monkeypatch):
    """A failed `dvc pull` (an unreachable remote, expired credentials) fails pull_state, whose task retries it,
    instead of being logged while the run goes on to rebuild the base and retrain from scratch."""
    from fineflow import remote
    from tasks import runs

    project = copy_project(tmp_path / "project")
    _dvc(project, "remote", "add", "-d", "store", str(tmp_path / "remote"))

    def unreachable(project_dir, *args):
        raise RuntimeError("dvc pull --allow-missing failed (exit 1): ERROR: unexpected error - Unable to connect")

    monkeypatch.setattr(remote, "run_dvc", unreachable)
    assert runs.pull is remote.pull  # the flow's task and `fineflow ci` pull through the same function
    with pytest.raises(RuntimeError, match="Unable to connect"):
        runs.pull(str(project), print)
    assert runs.pull_state.retries == 2


def _prefect(project, env, *args: str) -> str:
    argv = [sys.executable, "-m", "prefect", *args]
    done = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _start_worker(pool: str, cwd, env, log) -> subprocess.Popen:
    """A process worker for the pool (`make worker`), in its own session, its output in log."""
    with log.open("w") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool],
            cwd=cwd,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_for(what, timeout: float, proc, log):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        found = what()
        if found:
            return found
        time.sleep(2)
    pytest.fail(f"timed out after {timeout} s: {log.read_text()[-3000:]}")


def _deploy_like_nightly(api_url: str, tmp_path, name: str, source: str, parameters: dict):
    """The flow `name` of `source` deployed with prefect.yaml's nightly options (name, entrypoint, schedule and
    parameters aside) on a process pool of its own: (the env a worker for it needs, the pool, the flow's folder)."""
    from tests.conftest import ROOT
    from tests.test_chaos import flow_env

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    [nightly] = [d for d in spec["deployments"] if d["name"] == "nightly"]
    options = {k: v for k, v in nightly.items() if k not in ("name", "entrypoint", "schedules", "parameters")}
    pool = f"{name}-{tmp_path.name}"[:40]
    deployment = {**options, "name": name, "entrypoint": f"{name}.py:{name}", "work_pool": {"name": pool}}
    spec["deployments"] = [{**deployment, "parameters": parameters}]
    flows = tmp_path / "flows"
    flows.mkdir()
    (flows / f"{name}.py").write_text(source)
    (flows / "prefect.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    env = {**flow_env(api_url, chaos=False), "PREFECT_HOME": str(tmp_path / "prefect-home")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(flows)])
    _prefect(flows, env, "work-pool", "create", pool, "--type", "process")
    _prefect(flows, env, "--no-prompt", "deploy", "--all")
    return env, pool, flows


def _worker_and_a_run(api_url: str, pool: str, flows, env):
    """A worker for the pool (its log beside the flow's folder) and a run of the pool's one deployment."""
    [ours] = [d for d in _post(api_url, "/deployments/filter") if d["work_pool_name"] == pool]
    log = flows.parent / "worker.log"
    worker = _start_worker(pool, flows, env, log)
    return worker, log, _post(api_url, f"/deployments/{ours['id']}/create_flow_run")


def _state_of(api_url: str, run: dict) -> dict:
    [found] = [r for r in _flow_runs(api_url) if r["id"] == run["id"]]
    return found["state"]


ASKS = """
import time
from prefect import flow
from prefect.flow_runs import pause_flow_run
from tasks.approval_pause import PromotionApproval

@flow
def asks(hold_s: float):
    started = time.monotonic()
    answer = pause_flow_run(wait_for_input=PromotionApproval, timeout=120, poll_interval=1)
    time.sleep(max(0.0, hold_s - (time.monotonic() - started)))  # past the engine's next lease renewal
    return answer.approver
"""


@pytest.mark.nightly  # a run held past the engine's 225 s lease renewal
@pytest.mark.slow
def test_a_run_of_the_projects_deployments_paused_for_approval_completes_past_a_lease_renewal(prefect_server, tmp_path):
    """Seen in the soak: every approved promotion on the project's deployments crashed inside promote
    ("Concurrency lease renewal failed - slots are no longer reserved"): the server revokes a deployment
    concurrency limit's lease when the run pauses, and the engine's next renewal (every 225 s) cancels the run.
    A flow deployed with prefect.yaml's nightly options (name, entrypoint and schedule aside) pauses for a
    PromotionApproval, is answered at once, and runs on past the renewal: it must complete."""
    from tests.test_chaos import kill_tree

    env, pool, flows = _deploy_like_nightly(prefect_server, tmp_path, "asks", ASKS, {"hold_s": 260})
    worker, log, run = _worker_and_a_run(prefect_server, pool, flows, env)
    try:

        def state() -> str:
            return _state_of(prefect_server, run)["type"]

        _wait_for(lambda: state() == "PAUSED", 180, worker, log)
        answer = {"approve": True, "approver": "alice", "comment": "checked"}
        assert _post(prefect_server, f"/flow_runs/{run['id']}/resume", {"run_input": answer})["status"] == "ACCEPT"
        _wait_for(lambda: state() in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"), 420, worker, log)
        assert state() == "COMPLETED", log.read_text()[-4000:]
    finally:
        kill_tree(worker)


@pytest.mark.nightly  # CI keeps the soak's short form (tests/test_soak.py): deploy --all, a worker, the trigger
@pytest.mark.slow
def test_prefect_yaml_deploys_both_deployments_a_worker_runs_them_and_new_data_triggers_a_run(prefect_server, tmp_path):
    """From a fresh copy: `prefect deploy --all` (what `make deploy` runs) registers nightly (cron in UTC) and
    on-new-data on the process pool, with no deployment concurrency limit (the workspace lock takes turns; see
    the pause test below); a process worker (`make worker`) runs
    a nightly run to completion with its artifacts (a table per stage, the promotion, training progress) and
    the stages' edges; `fineflow data add` then emits fineflow.data.added and the trigger starts an
    on-new-data run. The worker and everything under it is stopped by PID."""
    from tests.test_chaos import flow_env, kill_tree

    project = copy_project(tmp_path / "project")
    env = {**flow_env(prefect_server, chaos=False), "PREFECT_HOME": str(tmp_path / "prefect-home")}
    _prefect(project, env, "work-pool", "create", "fineflow-process", "--type", "process")
    _prefect(project, env, "--no-prompt", "deploy", "--all")
    ours = ("nightly", "on-new-data")  # the module's server also holds the other tests' deployments
    deployments = {d["name"]: d for d in _post(prefect_server, "/deployments/filter") if d["name"] in ours}
    assert set(deployments) == {"nightly", "on-new-data"}
    [nightly] = deployments["nightly"]["schedules"]
    assert (nightly["schedule"]["cron"], nightly["schedule"]["timezone"]) == ("0 2 * * *", "UTC")
    for deployment in deployments.values():
        assert deployment["work_pool_name"] == "fineflow-process"
        assert deployment["global_concurrency_limit"] is None

    log = tmp_path / "worker.log"
    worker = _start_worker("fineflow-process", project, env, log)
    try:
        run = _post(prefect_server, f"/deployments/{deployments['nightly']['id']}/create_flow_run")

        def finished():
            [state] = [r["state_type"] for r in _flow_runs(prefect_server) if r["id"] == run["id"]]
            assert state not in ("FAILED", "CRASHED", "CANCELLED"), log.read_text()[-4000:]
            return state == "COMPLETED"

        _wait_for(finished, 600, worker, log)
        artifacts = {a["key"]: a["type"] for a in _post(prefect_server, "/artifacts/filter") if a["key"]}
        assert artifacts["fineflow-train"] == "table" and artifacts["fineflow-promotion"] == "markdown"
        assert artifacts["fineflow-train-progress"] == "progress"
        assert artifacts["fineflow-train-charts"] == "markdown"  # the PNGs, embedded
        # the goodput ledger as a table on the run page, and the doctor's findings with the stacked bar
        assert artifacts["fineflow-goodput-ledger"] == "table" and artifacts["fineflow-goodput-doctor"] == "markdown"
        ledger = [a for a in _post(prefect_server, "/artifacts/filter") if a["key"] == "fineflow-goodput-ledger"]
        rows = json.loads(ledger[0]["data"]) if isinstance(ledger[0]["data"], str) else ledger[0]["data"]
        assert {row["bucket"] for row in rows} >= {"compute", "orchestration", "restart_loss", "total"}, rows
        tasks = {t["name"]: t for t in _post(prefect_server, "/task_runs/filter") if t["flow_run_id"] == run["id"]}
        waited = {i["id"] for i in tasks["train"]["task_inputs"]["wait_for"]}
        assert tasks["tokenize"]["id"] in waited and tasks["base"]["id"] in waited  # the graph's edges

        new_rows = project / "data/incoming/rows.jsonl"
        new_rows.parent.mkdir(parents=True)
        new_rows.write_text('{"instruction": "Say hi.", "output": "hi"}\n', encoding="utf-8")
        cli = subprocess.run(
            [sys.executable, "-m", "fineflow.cli", "data", "add", "data/incoming/rows.jsonl"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
        )
        assert cli.returncode == 0 and "sent fineflow.data.added" in cli.stdout, cli.stdout + cli.stderr
        assert (project / "data/incoming/rows.jsonl.dvc").exists()
        on_new_data = deployments["on-new-data"]["id"]
        triggered = lambda: [r for r in _flow_runs(prefect_server) if r["deployment_id"] == on_new_data]  # noqa: E731
        _wait_for(triggered, 120, worker, log)
    finally:
        kill_tree(worker)


def _promote_only_project(built, path, overrides: dict):
    """A copy of the project whose candidate waits for promote, the one stage its dvc.yaml keeps: the flow's
    promotion alone (tests/conftest.py: gate_only_project)."""
    from tests.conftest import gate_only_project

    return gate_only_project(built, path, overrides)


def _answer_when_paused(api_url: str, project, proc, log, answer: dict, seen: set) -> dict:
    """Wait for this copy's next flow run to pause at promotion, check what it shows, resume it with answer
    through the API (as the UI's Resume form does); the run as it was while paused."""
    from fineflow.core.workspace import WorkspaceLock

    def paused():
        runs = [r for r in _flow_runs(api_url) if r["parameters"].get("project_dir") == str(project)]
        return [r for r in runs if r["state_type"] == "PAUSED" and r["id"] not in seen]

    [run] = _wait_for(paused, 300, proc, log)
    seen.add(run["id"])
    [shown] = [
        a
        for a in _post(api_url, "/artifacts/filter")
        if a["flow_run_id"] == run["id"] and a["key"] == "fineflow-promotion-approval"
    ]
    assert "waits for your approval" in shown["data"] and "p-value" in shown["data"] and "CI" in shown["data"]
    assert not WorkspaceLock(project, "another run").try_acquire()  # a paused run keeps the workspace
    resumed = _post(api_url, f"/flow_runs/{run['id']}/resume", {"run_input": answer})
    assert resumed["status"] == "ACCEPT", resumed
    return run


@pytest.mark.scenario
@pytest.mark.slow
def test_a_flow_run_pauses_at_promotion_for_a_persons_answer_rejected_then_approved_through_the_api(
    prefect_server, built, tmp_path
):
    """promote.require_approval: the run pauses at promote (Paused, the gate's evidence as an artifact, the
    workspace still held) until a person answers through the server's API. Rejected by bob: the candidate is
    refused, bob and his comment in the registry log, no champion. One param edit later (min_delta) the next
    run re-runs promote only, pauses again, and alice's approval installs the champion, logged as hers."""
    from fineflow.registry.promotion_log import read_log
    from fineflow.registry.verify import verify_log
    from tests.conftest import write_params
    from tests.test_chaos import dvc_status, finish_flow, flow_env, start_flow

    project = _promote_only_project(built, tmp_path / "project", {"promote.require_approval": True})
    registry, champion = project / "models/registry", project / "models/champion"
    env, seen = flow_env(prefect_server, chaos=False), set()

    log = tmp_path / "rejected.log"
    proc = start_flow(project, env, log)
    bob = {"approve": False, "approver": "bob", "comment": "too few eval rows"}
    run = _answer_when_paused(prefect_server, project, proc, log, bob, seen)
    finish_flow(proc, log)
    last = read_log(registry)[-1]
    assert last["decision"] == "refused" and last["reason"].startswith("rejected by bob: too few eval rows")
    assert last["context"]["approval"] == {"approved": False, "approver": "bob", "comment": "too few eval rows"}
    assert json.loads((champion / "champion.json").read_text())["candidate_id"] is None  # no champion
    tasks = [t["name"] for t in _post(prefect_server, "/task_runs/filter") if t["flow_run_id"] == run["id"]]
    assert "promote" in tasks and "promote (rejected by bob)" in tasks

    write_params(project / "params.yaml", {"promote.require_approval": True, "promote.min_delta": 0.04})
    log = tmp_path / "approved.log"
    proc = start_flow(project, env, log)
    alice = {"approve": True, "approver": "alice", "comment": "checked 20 samples"}
    _answer_when_paused(prefect_server, project, proc, log, alice, seen)
    finish_flow(proc, log)
    last = read_log(registry)[-1]
    assert last["decision"] == "promoted" and "approved by alice: checked 20 samples" in last["reason"]
    assert last["context"]["approval"]["approver"] == "alice"
    assert json.loads((champion / "champion.json").read_text())["candidate_id"] == last["candidate_id"]
    assert verify_log(registry, champion) == [] and dvc_status(project) == {}


SLEEPER = """
import time
from prefect import flow
from prefect.flow_runs import pause_flow_run
from tasks.approval_pause import PromotionApproval

@flow(name="fineflow")  # the flow the automation watches
def sleeper(sleep_s: float):
    pause_flow_run(wait_for_input=PromotionApproval, timeout=600, poll_interval=1)
    time.sleep(sleep_s)
"""


@pytest.mark.nightly  # heartbeats are at least 30 s apart: the automation acts after 90 s without one
@pytest.mark.slow
def test_a_run_whose_machine_died_is_marked_crashed_by_the_server_and_a_paused_one_is_not(prefect_server, tmp_path):
    """A run whose process dies with its worker (a machine lost: nothing left to report) stayed Running until
    the workspace's next run reconciled it, a day later on a nightly schedule. The server's own automation
    (`python -m flows.automations`, run by `make deploy`) marks it Crashed once its heartbeats stop; a run paused
    for an approval for longer than that window keeps beating and stays Paused."""
    from flows.automations import AUTOMATION_NAME, MISSED_BEATS
    from tests.conftest import ROOT
    from tests.test_chaos import kill_tree

    env, pool, flows = _deploy_like_nightly(prefect_server, tmp_path, "sleeper", SLEEPER, {"sleep_s": 900})
    env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = "30"  # the shortest Prefect allows
    made = subprocess.run(
        [sys.executable, "-m", "flows.automations"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert made.returncode == 0 and AUTOMATION_NAME in made.stdout, made.stdout + made.stderr
    worker, log, run = _worker_and_a_run(prefect_server, pool, flows, env)

    def state() -> dict:
        return _state_of(prefect_server, run)

    try:
        _wait_for(lambda: state()["type"] == "PAUSED", 180, worker, log)
        time.sleep(MISSED_BEATS * 30 + 20)  # longer than the automation's window
        assert state()["type"] == "PAUSED", state()
        answer = {"approve": True, "approver": "alice", "comment": "ok"}
        assert _post(prefect_server, f"/flow_runs/{run['id']}/resume", {"run_input": answer})["status"] == "ACCEPT"
        _wait_for(lambda: state()["type"] == "RUNNING", 60, worker, log)
    finally:
        kill_tree(worker)  # the worker and the flow's process at once: no one left to report the run
    deadline = time.monotonic() + MISSED_BEATS * 30 + 120
    while state()["type"] == "RUNNING" and time.monotonic() < deadline:
        time.sleep(5)
    assert state()["type"] == "CRASHED" and "no heartbeat" in state()["message"], state()
