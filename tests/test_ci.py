"""The CI retraining job: `fineflow ci` (fineflow/ci.py) and the GitHub workflow that runs it
(.github/workflows/retrain.yml), whose `run:` steps are run here in fresh clones against an S3 API server on
127.0.0.1, with the environment GitHub gives a job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fineflow import ci
from fineflow.core.reports import write_approval_request, write_error_record, write_json_atomic
from fineflow.errors import APPROVAL_NEEDED_EXIT, REFUSED_EXIT, USER_ERROR_EXIT
from tests.conftest import ROOT, add_s3_remote, copy_project, copy_reproduced, gate_only_project, venv_env

WORKFLOW = ROOT / ".github" / "workflows" / "retrain.yml"

# `dvc repro`'s own lines, as DVC 3.67 prints them
REPRO_OUTPUT = """\
Stage 'base' didn't change, skipping
Running stage 'fingerprint':
> python -m fineflow.stages.fingerprint --base-dir models/base
Stage 'data' is cached - skipping run, checking out outputs
Running stage 'train':
fineflow train: error: params.yaml: train.lr: Input should be greater than 0
ERROR: failed to reproduce 'train': failed to run: python -m fineflow.stages.train --shards data/shards, exited with 2
"""


def _repro(text: str = REPRO_OUTPUT, returncode: int = 255) -> ci.Repro:
    repro = ci.Repro(returncode=returncode)
    for line in text.splitlines():
        repro.see(line)
    return repro


def test_what_dvc_repro_ran_skipped_and_where_it_failed_is_read_from_its_own_lines():
    repro = _repro()
    assert repro.stages == [("base", "skipped"), ("fingerprint", "ran"), ("data", "restored"), ("train", "ran")]
    assert (repro.failed, repro.stage_exit) == ("train", 2)
    assert repro.stage_message == "params.yaml: train.lr: Input should be greater than 0"


def test_a_failed_stage_maps_to_the_exit_code_its_kind_of_failure_has(tmp_path):
    report = tmp_path / "reports" / "train.json"
    write_error_record(report, "train", "data/shards: no shards; run tokenize first")
    outcome = ci.failure_outcome(tmp_path, _repro())
    assert (outcome.kind, outcome.exit_code) == ("bad_input", USER_ERROR_EXIT)
    assert outcome.message == "stage train: data/shards: no shards; run tokenize first"  # the record's words

    crashed = _repro(REPRO_OUTPUT.replace("exited with 2", "exited with 1"))
    assert (ci.failure_outcome(tmp_path, crashed).kind, ci.failure_outcome(tmp_path, crashed).exit_code) == ("crash", 1)
    preempted = _repro(REPRO_OUTPUT.replace("exited with 2", "exited with 75"))
    assert "preempted" in ci.failure_outcome(tmp_path, preempted).message
    assert ci.failure_outcome(tmp_path, _repro("ERROR: unexpected error", 255)).exit_code == 1

    waiting = _repro(REPRO_OUTPUT.replace("'train'", "'promote'").replace("exited with 2", "exited with 3"))
    write_approval_request(tmp_path / "reports" / "promote.json", "promote", "waits", {"candidate_id": "c1"})
    outcome = ci.failure_outcome(tmp_path, waiting)
    assert (outcome.kind, outcome.exit_code) == ("approval_needed", APPROVAL_NEEDED_EXIT)
    assert "FINEFLOW_APPROVAL" in outcome.message


def test_the_gates_decision_is_the_exit_code_refusal_failing_only_when_asked(tmp_path):
    ran = _repro("Running stage 'evaluate':\nRunning stage 'promote':\n", 0)
    report = {"decision": "refused", "candidate_id": "c9", "reason": "within noise", "p_value": 0.4}
    write_json_atomic(tmp_path / "reports" / "promote.json", report)
    assert ci.success_outcome(tmp_path, ran, fail_on_refusal=False).exit_code == 0
    refused = ci.success_outcome(tmp_path, ran, fail_on_refusal=True)
    assert (refused.kind, refused.exit_code, refused.decision_report) == ("refused", REFUSED_EXIT, report)
    write_json_atomic(tmp_path / "reports" / "promote.json", {**report, "decision": "promoted"})
    assert ci.success_outcome(tmp_path, ran, fail_on_refusal=True).kind == "promoted"
    nothing = ci.success_outcome(tmp_path, _repro("Running stage 'fingerprint':\n", 0), fail_on_refusal=True)
    assert (nothing.kind, nothing.exit_code) == ("up_to_date", 0)


def test_the_lock_goes_to_the_jobs_branch_and_never_from_a_pull_request(monkeypatch, tmp_path):
    for variable in ("GITHUB_REF_NAME", "GITHUB_REF_TYPE", "GITHUB_EVENT_NAME", "CI_COMMIT_BRANCH", "BRANCH_NAME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.delenv("CI_MERGE_REQUEST_IID", raising=False)
    monkeypatch.setenv("GITHUB_REF_NAME", "main")
    assert ci.current_branch(tmp_path) == "main"
    monkeypatch.setenv("GITHUB_REF_TYPE", "tag")  # a tag's run has no branch to commit to
    monkeypatch.setenv("CI_COMMIT_BRANCH", "release")
    assert ci.current_branch(tmp_path) == "release"
    assert not ci.is_pull_request()
    monkeypatch.setenv("GITHUB_EVENT_NAME", "pull_request")
    assert ci.is_pull_request()
    monkeypatch.setenv("GITHUB_BASE_REF", "main")
    assert ci.base_revision(tmp_path, "abc1234", None) == "origin/main"
    assert ci.base_revision(tmp_path, "abc1234", "v1.0") == "v1.0"
    monkeypatch.delenv("GITHUB_BASE_REF")
    assert ci.base_revision(tmp_path, "abc1234", None) == "abc1234"


def test_bad_params_stop_the_job_before_any_pull_with_every_problem_named(tmp_path, monkeypatch):
    project = copy_project(tmp_path / "project", {"train.lrr": 0.1, "promote.min_delta": "big"})
    summary, outputs = tmp_path / "summary.md", tmp_path / "outputs"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    monkeypatch.setenv("GITHUB_OUTPUT", str(outputs))
    outcome = ci.run_ci(ci.Options(project=project), log=lambda line: None)
    assert (outcome.kind, outcome.exit_code) == ("bad_params", USER_ERROR_EXIT)
    text = summary.read_text()
    assert "bad params" in text and "train.lrr" in text and "promote.min_delta" in text
    assert "outcome=bad_params\n" in outputs.read_text() and "exit_code=2\n" in outputs.read_text()
    assert not (project / "models/base").exists() and not (project / "reports/validate.json").exists()


def test_commit_without_a_remote_stops_before_running_anything(tmp_path):
    """A committed lock whose artefacts live on one runner only would make every clone rebuild them."""
    project = copy_project(tmp_path / "project")
    outcome = ci.run_ci(ci.Options(project=project, commit=True), log=lambda line: None)
    assert (outcome.kind, outcome.exit_code) == ("bad_params", USER_ERROR_EXIT)
    assert "configure a default DVC remote" in outcome.message
    assert not (project / "models/base").exists()
    assert "configure a default DVC remote" in (project / "reports/ci-summary.md").read_text()


@pytest.mark.slow
def test_a_missing_input_path_is_a_user_error_before_anything_is_pulled_or_run(tmp_path):
    """`fineflow ci` with params.yaml naming a file that is not there: exit 2 naming the key and the path,
    before any stage runs; not a crash to "run again"."""
    project = copy_project(tmp_path / "project", {"data.train_path": "mine/train.jsonl"})
    done = subprocess.run(
        [sys.executable, "-m", "fineflow.cli", "ci"], cwd=project, env=venv_env(), capture_output=True, text=True
    )
    output = done.stdout + done.stderr
    assert done.returncode == USER_ERROR_EXIT, output[-4000:]
    assert "data.train_path: no such file: 'mine/train.jsonl'" in output, output[-4000:]
    assert "run again" not in output and "Traceback" not in output, output[-4000:]
    assert not (project / "models/base").exists()


@pytest.mark.slow
def test_a_failed_jobs_finished_stages_come_back_from_the_run_cache_in_a_fresh_clone(tmp_path):
    """A job that fails after a stage finished commits no lock; its push carries DVC's run cache, so the next
    job's `dvc repro --pull` restores that stage ("is cached - skipping run") instead of redoing hours of
    training. A toy DVC project, through fineflow.remote's push and pull and fineflow.ci's repro."""
    from fineflow import remote

    first = tmp_path / "first"
    first.mkdir()
    (first / "params.yaml").write_text("n: 3\n")
    (first / "dvc.yaml").write_text(
        "stages:\n  slow:\n    cmd: python -c \"open('out.txt','w').write('trained')\" && echo RAN-SLOW\n"
        "    params: [n]\n    outs: [out.txt]\n"
        '  fails:\n    cmd: python -c "raise SystemExit(1)"\n    deps: [out.txt]\n    outs: [never.txt]\n'
    )
    _git(first, "init", "-q")
    _dvc(first, "init", "-q")
    _dvc(first, "remote", "add", "-d", "store", str(tmp_path / "remote"))
    _git(first, "add", "-A")
    _git(first, "commit", "-qm", "toy")
    failed = subprocess.run(
        [sys.executable, "-m", "dvc", "repro"], cwd=first, env=venv_env(), capture_output=True, text=True
    )
    assert failed.returncode != 0 and "RAN-SLOW" in failed.stdout
    remote.push(first, lambda output: None)

    second = tmp_path / "second"
    _git(tmp_path, "clone", "-q", str(first), str(second))  # the commit without a lock: nothing names out.txt
    assert remote.pull(second, lambda output: None) == "store"
    lines = []
    again = ci.run_repro(second, lines.append, pull=True)  # what `fineflow ci` runs after its pull
    assert again.stages[0] == ("slow", "restored") and "RAN-SLOW" not in lines, lines
    assert (second / "out.txt").read_text() == "trained"
    assert (again.failed, again.stage_exit) == ("fails", 1)  # and the stage that failed fails again


# --- the workflow, run as GitHub runs it --------------------------------------------------------------------


def _workflow() -> tuple[dict, dict]:
    document = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    triggers = document.get("on", document.get(True))  # YAML 1.1 reads a bare `on` as true
    [job] = document["jobs"].values()
    return triggers, job


def _github_glob(pattern: str) -> re.Pattern:
    """GitHub's paths filter: ** crosses folders, * does not."""
    parts = re.split(r"(\*\*|\*)", pattern)
    regex = "".join(".*" if part == "**" else "[^/]*" if part == "*" else re.escape(part) for part in parts)
    return re.compile(regex + r"\Z")


def test_the_workflow_retrains_on_a_push_that_changes_any_input_of_a_stage_on_dispatch_and_on_a_schedule():
    triggers, job = _workflow()
    assert {"push", "workflow_dispatch", "schedule"} <= set(triggers)
    assert triggers["schedule"][0]["cron"]
    assert set(triggers["workflow_dispatch"]["inputs"]) == {"fail_on_refusal", "approval"}
    patterns = [_github_glob(p) for p in triggers["push"]["paths"]]
    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split())
    pipeline = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))
    inputs = {"params.yaml", "dvc.yaml", "dvc.lock", "data/new.jsonl.dvc"}
    for stage in pipeline["stages"].values():
        for dep in stage.get("deps", []):  # the tracked ones: code, eval tasks; the rest are stage outputs
            inputs |= {path for path in tracked if path == dep or path.startswith(dep.rstrip("/") + "/")}
    unwatched = sorted(path for path in inputs if not any(p.match(path) for p in patterns))
    assert not unwatched, f"a push changing these would not retrain: {unwatched}"
    document = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    assert document["permissions"]["contents"] == "write"  # --commit pushes the lock back
    assert document["concurrency"]["cancel-in-progress"] is False  # a newer trigger never kills a training run


def _expand(text: str, context: dict[str, str]) -> str:
    def value(match: re.Match) -> str:
        expression = match[1].strip()
        if expression not in context:
            pytest.fail(f"the workflow uses ${{{{ {expression} }}}}, which this test does not simulate")
        return context[expression]

    return re.sub(r"\$\{\{(.*?)\}\}", value, text)


def _run_job(clone: Path, home: Path, event: str, inputs: dict[str, str], secrets: dict[str, str]) -> int:
    """The job's `run:` steps in clone, as a GitHub runner runs them (bash -eo pipefail, the job's env with its
    expressions filled in, GITHUB_* files, GITHUB_PATH honoured, the first failing step ends the job); its exit
    code. The set-up step (make venv) is the one not run: this test's venv stands in for the one it builds."""
    _, job = _workflow()
    context = {"inputs.fail_on_refusal": inputs.get("fail_on_refusal", ""), "inputs.approval": ""}
    context |= {f"secrets.{name}": value for name, value in secrets.items()}
    home.mkdir(parents=True, exist_ok=True)
    names = ("GITHUB_STEP_SUMMARY", "GITHUB_OUTPUT", "GITHUB_PATH", "GITHUB_ENV")
    files = {name: home / name.lower() for name in names}
    for path in files.values():
        path.write_text("")
    base = {k: v for k, v in venv_env().items() if not k.startswith(("GITHUB_", "AWS_", "FINEFLOW_"))}
    env = base | {name: str(path) for name, path in files.items()}
    env |= {
        "CI": "true",
        "GITHUB_ACTIONS": "true",
        "GITHUB_EVENT_NAME": event,
        "GITHUB_REF": "refs/heads/main",
        "GITHUB_REF_NAME": "main",
        "GITHUB_REF_TYPE": "branch",
        "GITHUB_WORKSPACE": str(clone),
        "RUNNER_TEMP": str(home),
    }
    env |= {key: _expand(str(value), context) for key, value in job.get("env", {}).items()}
    for step in job["steps"]:
        if "run" not in step:
            continue  # actions (checkout: the clone; upload-artifact)
        if "make venv" in step["run"]:
            assert 'echo "$PWD/.venv/bin" >> "$GITHUB_PATH"' in step["run"]
            files["GITHUB_PATH"].write_text(str(Path(sys.executable).parent) + "\n")
            continue
        path = [line for line in files["GITHUB_PATH"].read_text().splitlines() if line]
        step_env = env | {"PATH": os.pathsep.join([*reversed(path), env["PATH"]])}
        step_env |= {key: _expand(str(value), context) for key, value in step.get("env", {}).items()}
        done = subprocess.run(
            ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", _expand(step["run"], context)],
            cwd=clone,
            env=step_env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        (home / f"{step.get('name', 'step')}.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            return done.returncode
    return 0


def _git(cwd: Path, *args: str) -> str:
    identity = ["-c", "user.name=a-user", "-c", "user.email=user@localhost"]
    done = subprocess.run(["git", *identity, *args], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


def _dvc(cwd: Path, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=cwd, env=venv_env() | (env or {}), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _gate_only_origin(built: Path, tmp_path: Path, s3_server: str) -> Path:
    """A bare git origin of a gate-only project (conftest.gate_only_project) whose inputs are tracked with
    `dvc add` and pushed to the S3 remote its .dvc/config names: the gate's outcomes without training."""
    seed = gate_only_project(built, tmp_path / "seed", {"promote.min_delta": 0.9})  # refused until lowered
    inputs = ["models/base", "data/shards", "data/validated", "models/base_fingerprint.json", "eval"]
    inputs.append("models/candidate")
    _dvc(seed, "add", *inputs)
    add_s3_remote(seed, s3_server, prefix="ci")  # the keys go to .dvc/config.local: never committed
    _dvc(seed, "push")
    _git(seed, "add", "-A")
    _git(seed, "commit", "-qm", "a gate-only project, its inputs tracked by DVC")
    _git(seed, "branch", "-M", "main")
    origin = tmp_path / "origin.git"
    _git(tmp_path, "clone", "-q", "--bare", str(seed), str(origin))
    return origin


def _clone(origin: Path, dest: Path) -> Path:
    _git(origin.parent, "clone", "-q", "--branch", "main", str(origin), str(dest))
    return dest


def _push_params(origin: Path, where: Path, edit: dict) -> None:
    """A person's commit to main: one params edit, pushed."""
    clone = _clone(origin, where)
    params = yaml.safe_load((clone / "params.yaml").read_text(encoding="utf-8"))
    for dotted, value in edit.items():
        section, key = dotted.split(".")
        params[section][key] = value
    (clone / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    _git(clone, "commit", "-qam", f"params: {edit}")
    _git(clone, "push", "-q", "origin", "HEAD:main")


def _outputs(home: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in (home / "github_output").read_text().splitlines())


@pytest.mark.nightly  # four fresh clones, two full pipeline runs against S3
@pytest.mark.slow
def test_the_workflows_steps_in_fresh_clones_refuse_then_promote_then_stop_on_bad_params(built, s3_server, tmp_path):
    """Each job starts from a fresh clone of origin (what actions/checkout gives), the S3 keys only in the job's
    env (the repository's secrets). 1: dispatched with fail_on_refusal, the gate refuses (min_delta 0.9): exit 4,
    the evidence in the summary, the lock committed back to main. 2: a person lowers min_delta and pushes:
    promoted, exit 0, the metrics diff shows refused -> promoted. 3: a scheduled run finds nothing to do. A clone
    of origin then pulls everything and reproduces nothing. 4: a push with a misspelt key: exit 2, naming it,
    nothing pulled, nothing committed."""
    origin = _gate_only_origin(built, tmp_path, s3_server)
    secrets = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    head = _git(origin, "rev-parse", "main")

    # 1: refused, and asked to fail on it
    job = tmp_path / "job1"
    code = _run_job(_clone(origin, job / "repo"), job, "workflow_dispatch", {"fail_on_refusal": "true"}, secrets)
    summary = (job / "github_step_summary").read_text()
    assert code == REFUSED_EXIT, summary + (job / "Retrain.log").read_text()[-3000:]
    assert "fineflow retraining: **refused** (exit 4)" in summary
    assert "| promote | ran" in summary and "p-value" in summary and "delta (95% bootstrap CI)" in summary
    assert "pulled from `store`, pushed to `store`" in summary
    assert _outputs(job)["outcome"] == "refused" and _outputs(job)["lock_committed"] == "true"
    log = _git(origin, "log", "--format=%s", "main")
    assert log.splitlines()[0].endswith("[skip ci]") and _git(origin, "rev-parse", "main~1") == head

    # 2: a person lowers the bar; the push retrains (promote re-runs) and promotes
    _push_params(origin, tmp_path / "person", {"promote.min_delta": 0.05})
    job = tmp_path / "job2"
    clone = _clone(origin, job / "repo")
    meanwhile = _clone(origin, tmp_path / "meanwhile")  # while the job runs, someone pushes to main
    (meanwhile / "NOTES.md").write_text("pushed while CI trained\n")
    _git(meanwhile, "add", "NOTES.md")
    _git(meanwhile, "commit", "-qm", "notes")
    _git(meanwhile, "push", "-q", "origin", "HEAD:main")
    code = _run_job(clone, job, "push", {}, secrets)
    summary = (job / "github_step_summary").read_text()
    assert code == 0, summary + (job / "Retrain.log").read_text()[-3000:]
    assert "fineflow retraining: **promoted** (exit 0)" in summary
    assert "which moved during the run" in summary  # rebased onto the new tip, not refused
    assert _git(origin, "log", "-2", "--format=%s", "main").splitlines()[1] == "notes"
    assert (clone / "reports/ci-summary.md").read_text() in summary  # the file a PR-comment step posts
    assert re.search(r"\| reports/metrics/promote.json\s*\| decision\s*\| refused\s*\| promoted", summary), summary
    assert _outputs(job)["decision"] == "promoted"

    # 3: the nightly finds the champion up to date: nothing runs, nothing is committed
    before = _git(origin, "rev-parse", "main")
    job = tmp_path / "job3"
    assert _run_job(_clone(origin, job / "repo"), job, "schedule", {}, secrets) == 0
    summary = (job / "github_step_summary").read_text()
    assert "**up to date** (exit 0)" in summary and "| promote | skipped: unchanged |" in summary, summary
    assert "dvc.lock: unchanged" in summary and _git(origin, "rev-parse", "main") == before
    assert "_no metric changed since `" in summary

    # what main now names is all in the remote: a clone pulls it and reproduces nothing; the registry holds both
    pulled = _clone(origin, tmp_path / "pulled")
    _dvc(pulled, "pull", env=secrets)
    assert json.loads(_dvc(pulled, "status", "--json")) == {}
    assert json.loads(_dvc(pulled, "status", "--cloud", "--json", env=secrets)) == {}
    from fineflow.registry.promotion_log import read_log

    assert [entry["decision"] for entry in read_log(pulled / "models/registry")] == ["refused", "promoted"]
    verify = subprocess.run(
        [sys.executable, "-m", "fineflow.cli", "registry", "verify"], cwd=pulled, env=venv_env(), capture_output=True
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr

    # 4: a misspelt key: exit 2 before anything is pulled, the key named, main untouched
    _push_params(origin, tmp_path / "typo", {"promote.min_delt": 0.1})
    before = _git(origin, "rev-parse", "main")
    job = tmp_path / "job4"
    assert _run_job(_clone(origin, job / "repo"), job, "push", {}, secrets) == USER_ERROR_EXIT
    summary = (job / "github_step_summary").read_text()
    assert "**bad params** (exit 2)" in summary and "promote.min_delt" in summary, summary
    assert "nothing was pulled or run" in summary and not (job / "repo/models/candidate").exists()
    assert _git(origin, "rev-parse", "main") == before


# --- sweeps: `dvc exp run --queue` ----------------------------------------------------------------------------


def _queue_status(project: Path) -> dict[str, str]:
    """`dvc queue status`'s table: experiment name -> Queued | Running | Success | Failed."""
    table = _dvc(project, "queue", "status")
    rows = [line.split() for line in table.splitlines()]
    return {row[1]: row[-1] for row in rows if len(row) >= 4 and row[-1] in ("Queued", "Running", "Success", "Failed")}


def _queue_log(project: Path, name: str) -> str:
    argv = [sys.executable, "-m", "dvc", "queue", "logs", name]
    done = subprocess.run(argv, cwd=project, env=venv_env(), capture_output=True, text=True)
    return done.stdout + done.stderr


def _poll(what, timeout: float, describe):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := what():
            return result
        time.sleep(2)
    pytest.fail(f"timed out after {timeout} s: {describe()}")


@pytest.mark.scenario
@pytest.mark.nightly  # three queued experiments train and evaluate, one after the other
@pytest.mark.slow
def test_queued_experiments_wait_for_the_workspace_reuse_the_shards_compare_in_exp_show_and_never_promote(
    reproduced, tmp_path
):
    """After a committed baseline run, two experiments queued up to evaluate (lr and LoRA rank, as the README
    shows) and one queued all the way to promote, then `dvc queue start`. While another run holds the workspace
    the first experiment's stage waits, naming it, and trains nothing. Then: both train from the shards the
    baseline made (tokenize skipped), `dvc exp show` holds each one's params and metrics, and the one that
    reaches promote fails there saying how to promote it: the workspace's registry and champion are untouched."""
    from fineflow.core.workspace import WorkspaceLock
    from fineflow.registry.promotion_log import read_log

    project = copy_reproduced(reproduced, tmp_path / "project")  # the committed baseline run
    registry_before = read_log(project / "models/registry")
    sweep = {"lr-high": ("train.lr=0.02", "train.lora.r=8"), "r-small": ("train.lr=0.004", "train.lora.r=4")}
    for name, sets in sweep.items():
        _dvc(project, "exp", "run", "--queue", "--name", name, *(f"-S{s}" for s in sets), "evaluate")
    _dvc(project, "exp", "run", "--queue", "--name", "to-promote", "-Spromote.min_delta=0.1")

    holder = WorkspaceLock(project, "flow run 'nightly' (the test)")
    assert holder.try_acquire()
    try:
        with (tmp_path / "queue-start.log").open("w") as log:  # not a pipe: the worker it leaves behind keeps it
            start = [sys.executable, "-m", "dvc", "queue", "start"]  # one worker, in the background
            subprocess.run(start, cwd=project, env=venv_env(), stdout=log, stderr=subprocess.STDOUT, check=True)

        def first_waits() -> str | None:
            log = _queue_log(project, "lr-high")
            return log if "waiting for the workspace" in log else None

        waiting = _poll(first_waits, 180, lambda: _queue_log(project, "lr-high")[-2000:])
        assert "in use by flow run 'nightly' (the test)" in waiting and "Running stage 'train'" not in waiting
        assert _queue_status(project).get("lr-high") == "Running"
    finally:
        holder.release()

    def all_finished() -> dict | None:
        status = _queue_status(project)
        return status if len(status) == 3 and set(status.values()) <= {"Success", "Failed"} else None

    try:
        done = _poll(all_finished, 900, lambda: _dvc(project, "queue", "status"))
    finally:  # nothing outlives the test: what is queued is dropped, then what runs is killed with its worker
        for stop in (["remove", "--queued"], ["stop", "--kill"]):
            subprocess.run([sys.executable, "-m", "dvc", "queue", *stop], cwd=project, env=venv_env(), check=False)
    assert done == {"lr-high": "Success", "r-small": "Success", "to-promote": "Failed"}, done
    for name in sweep:
        log = _queue_log(project, name)
        assert "Running stage 'train'" in log and "Running stage 'evaluate'" in log, log[-3000:]
        assert "Stage 'tokenize' didn't change, skipping" in log and "Running stage 'tokenize'" not in log
        assert "Running stage 'promote'" not in log
    refused = _queue_log(project, "to-promote")
    assert "promote does not run in the queued DVC experiment 'to-promote'" in refused, refused[-3000:]
    assert "dvc exp apply to-promote" in refused and "Running stage 'train'" not in refused  # nothing retrained

    shown = json.loads(_dvc(project, "exp", "show", "--json"))
    experiments = {
        exp["name"]: exp["data"]
        for baseline in shown
        for experiment in baseline.get("experiments") or []
        for exp in experiment.get("revs") or []
        if exp.get("name")
    }
    assert set(sweep) <= set(experiments), sorted(experiments)
    losses = set()
    for name, sets in sweep.items():
        params = experiments[name]["params"]["params.yaml"]["data"]["train"]
        assert (params["lr"], params["lora"]["r"]) == tuple(float(v.split("=")[1]) for v in sets), params
        metrics = experiments[name]["metrics"]
        losses.add(metrics["reports/metrics/summary.json"]["data"]["train_loss"])  # the declared headline
    assert len(losses) == 2  # two trainings, two results
    assert read_log(project / "models/registry") == registry_before  # the workspace's registry: untouched

    # what promote's message prescribes: the experiment into the workspace, where promote runs (nothing retrains)
    _dvc(project, "exp", "apply", "lr-high")
    applied = _dvc(project, "repro")
    ran = [line.split("'")[1] for line in applied.splitlines() if line.startswith("Running stage")]
    log = read_log(project / "models/registry")
    assert len(log) == len(registry_before) + 1
    exported = ["export"] if log[-1]["decision"] == "promoted" else []  # a new champion is exported, only then
    assert ran == ["fingerprint", "promote", *exported, "goodput"], applied[-3000:]
