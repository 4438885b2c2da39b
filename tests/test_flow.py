"""End to end: the Prefect flow over `dvc repro --single-item`, then plain `dvc repro`, on the tiny config.

Shows: every stage runs and reports; a second flow run skips every stage but fingerprint (which always runs);
changing only train.* re-runs train -> evaluate -> promote and nothing upstream; a plain `dvc repro` in a fresh
copy leaves the same dvc.lock as the flow. And dvc.yaml is the one list of stages: the stage entries, the flow's
order and lineage's stage reports all follow it.
"""

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPRO_LOG, ROOT, add_s3_remote, copy_project, copy_reproduced, venv_env

STAGES = list(yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"])  # in the file's order


@pytest.fixture(scope="module")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _ran_stages(output: str) -> list[str]:
    return [s for s in STAGES if f"Running stage '{s}'" in output]


def _dvc_start(project, *args, log):
    return subprocess.Popen(
        [sys.executable, "-m", "dvc", *args], cwd=project, env=venv_env(), stdout=log, stderr=subprocess.STDOUT
    )


def _dvc_wait(proc, log) -> str:
    proc.wait(timeout=900)
    output = log.read_text()
    assert proc.returncode == 0, output[-6000:]
    return output


@pytest.mark.scenario
@pytest.mark.slow
def test_flow_then_dvc_repro(prefect_harness, reproduced, s3_server, tmp_path, monkeypatch):
    """The Prefect flow in a fresh copy leaves what plain `dvc repro` of the same DAG left in another (the
    session's shared `reproduced` run); then a re-run of each, the metrics, and a push/pull round trip."""
    from flows.pipeline import fineflow_pipeline

    flow_copy = copy_project(tmp_path / "flow")
    repro_copy = copy_reproduced(reproduced, tmp_path / "repro")
    repro_output = (reproduced.parent / REPRO_LOG).read_text()
    monkeypatch.setenv("PATH", venv_env()["PATH"])
    results = fineflow_pipeline(str(flow_copy))
    assert set(results) == set(STAGES) and all(r["ran"] for r in results.values())
    assert _ran_stages(repro_output) == STAGES
    assert "Loading weights" not in repro_output  # transformers' bar per model load: the stages say what loaded
    reports = {stage: r["report"] for stage, r in results.items()}
    assert reports["validate"]["rows_in"] == reports["validate"]["rows_kept"] + reports["validate"]["rows_quarantined"]
    assert reports["train"]["world_size"] == 1
    # First run, no champion: the candidate is judged against the base model on evaluate.limit=6 docs. 4 LoRA
    # steps on the tiny base gain no exact match (both score 0), so the delta meets promote.min_delta=0.0 but the
    # paired bootstrap's CI includes 0: refused as noise (as in test_stages' test_evaluate_then_promote).
    promote = reports["promote"]
    assert (promote["decision"], promote["reference"]) == ("refused", "base model"), promote
    assert "over the base model is within noise" in promote["reason"], promote
    assert "CI [" in promote["reason"] and "] includes 0" in promote["reason"] and "n=6)" in promote["reason"], promote
    assert promote["ci_low"] <= 0 <= promote["ci_high"], promote
    for stage in STAGES:
        assert (flow_copy / "reports" / f"{stage}.json").exists()
    # the flow run's goodput ledger: one run, every stage process in it, adding up within 1%
    ledger = reports["goodput"]
    assert len(ledger["runs"]) == 1 and ledger["runs"][0].startswith("flow-"), ledger["runs"]
    assert [a["stage"] for a in ledger["attempts"]] == STAGES[:-1], ledger["attempts"]
    assert abs(ledger["unaccounted_s"]) <= 0.01 * ledger["total_s"], ledger
    assert ledger["buckets"]["restart_loss"] == 0 and ledger["buckets"]["compute"] > 0
    repro_ledger = json.loads((repro_copy / "reports/goodput.json").read_text())  # and plain dvc repro's
    assert (
        repro_ledger["runs"][0].startswith("dvc-")
        and abs(repro_ledger["unaccounted_s"]) <= 0.01 * repro_ledger["total_s"]
    )
    flow_lock = yaml.safe_load((flow_copy / "dvc.lock").read_text())
    assert set(flow_lock["stages"]) == set(STAGES)
    # plain dvc repro in its fresh copy: same artefacts, same lock
    repro_lock = yaml.safe_load((repro_copy / "dvc.lock").read_text())
    for stage in STAGES:  # outs' md5s equal: the same artefacts, byte for byte
        assert repro_lock["stages"][stage] == flow_lock["stages"][stage], stage

    # a train-only change re-runs train -> evaluate -> promote, nothing upstream (in the repro copy, while the
    # flow runs again in its own)
    params = yaml.safe_load((repro_copy / "params.yaml").read_text())
    params["train"]["lr"] = 1e-3
    (repro_copy / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    rerun_log = tmp_path / "rerun.log"
    with rerun_log.open("w") as log:
        rerun = _dvc_start(repro_copy, "repro", log=log)
    try:
        again = fineflow_pipeline(str(flow_copy))
    finally:
        rerun_output = _dvc_wait(rerun, rerun_log)
    # nothing changed: only fingerprint (always_changed: it hashes a base DVC may not see) runs, and its
    # unchanged output re-runs nothing after it
    assert [stage for stage, r in again.items() if r["ran"]] == ["fingerprint", "goodput"]  # goodput: the ledger
    assert yaml.safe_load((flow_copy / "dvc.lock").read_text()) == flow_lock
    assert _ran_stages(rerun_output) == ["fingerprint", "train", "evaluate", "promote", "goodput"]
    rerun_lock = yaml.safe_load((repro_copy / "dvc.lock").read_text())
    assert [stage for stage in STAGES if rerun_lock["stages"][stage] != flow_lock["stages"][stage]] == [
        "train",
        "evaluate",
        "promote",
        "goodput",  # its dependencies (eval, the registry) changed; it has no outputs
    ]
    # the metrics a PR comment shows: one headline row (reports/metrics/summary.json; issue 31: the per-stage files
    # made one table 608 characters wide), not every field of every report
    shown = json.loads(_dvc(repro_copy, "metrics", "show", "--json"))
    [metrics] = [entry["data"] for entry in shown.values()]
    figures = {f"{path}:{key}" for path, data in metrics.items() for key in _leaves(data["data"])}
    headline = ("rows_kept", "train_loss", "score", "delta", "decision", "goodput", "run_usd")
    assert figures == {f"reports/metrics/summary.json:{key}" for key in headline}, sorted(figures)
    diff = _dvc(repro_copy, "metrics", "diff", "--md", "HEAD")
    assert len(diff.splitlines()) <= 50, diff
    # checkpoints/ is no output (a `cache: false` output never travels, and a clone that pulled everything
    # would retrain): the lock names no checkpoint, and the pulled clone below has nothing to reproduce.
    assert "checkpoints" not in json.dumps(rerun_lock["stages"]["train"]["outs"])
    # The remote is an S3 API on 127.0.0.1 (moto's server): the round trip a team makes through object storage.
    for copy in (repro_copy, copy_project(tmp_path / "pulled")):
        add_s3_remote(copy, s3_server, prefix="flow")
    pulled = tmp_path / "pulled"
    _dvc(repro_copy, "push")
    shutil.copy(repro_copy / "params.yaml", pulled / "params.yaml")  # the commit the lock belongs to
    shutil.copy(repro_copy / "dvc.lock", pulled / "dvc.lock")
    _dvc(pulled, "pull")
    assert json.loads(_dvc(pulled, "status", "--json")) == {
        "fingerprint": ["always changed"],
        "goodput": ["always changed"],
    }
    assert json.loads(_dvc(pulled, "status", "--cloud", "--json")) == {}  # the remote holds all the lock names
    verify = subprocess.run(
        [sys.executable, "-m", "fineflow.cli", "registry", "verify"], cwd=pulled, env=venv_env(), capture_output=True
    )
    assert verify.returncode == 0 and verify.stdout.startswith(b"OK: "), verify.stdout + verify.stderr
    assert _ran_stages(_dvc(pulled, "repro")) == ["fingerprint", "goodput"]


def _leaves(data: dict, prefix: str = "") -> list[str]:
    return [
        leaf
        for key, value in data.items()
        for leaf in (_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"])
    ]


def _dvc(project, *args) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=project, env=venv_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_a_stage_counts_as_run_even_when_its_output_pushes_dvcs_line_out_of_the_log_tail(tmp_path, monkeypatch):
    """The evaluate stage prints ~90 lines: DVC's "Running stage 'evaluate'" is found wherever it is in the
    output, not only in its last lines."""
    import tasks.stages as stages

    fake = tmp_path / "fake_dvc.py"  # stands in for `python -m dvc repro`: DVC's line, then 200 of the stage's
    fake.write_text("print(\"Running stage 'evaluate':\")\nfor i in range(200):\n    print(f'line {i}')\n")
    real_popen = stages.subprocess.Popen
    monkeypatch.setattr(stages.subprocess, "Popen", lambda command, **kw: real_popen([sys.executable, str(fake)], **kw))
    lines = []
    assert stages.repro_single("evaluate", tmp_path, lines.append) is True
    assert len(lines) == 201


class _RecordingTask:
    """Stands in for the Prefect task run_stage: records the stages the flow asks for, runs nothing."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.upstream: dict[str, list[str]] = {}  # stage -> the stages whose results it was told to wait for

    def with_options(self, *, retries: int, **_):
        def run(stage: str, project_dir: str, wait_for=()) -> dict:
            self.calls.append((stage, retries))
            self.upstream[stage] = [result["stage"] for result in wait_for]
            return {"stage": stage, "ran": False, "report": {}}

        return run


def _run_the_flow_body(project_dir, monkeypatch, recorder=None, check_inputs=False) -> _RecordingTask:
    """The flow's body without Prefect (``.fn``), with a recorder in place of the task and the run's own
    bookkeeping (the workspace's lock, the run's name, the DVC remote) left out, and the preflight too unless
    check_inputs."""
    import flows.pipeline as pipeline

    recorder = recorder or _RecordingTask()
    monkeypatch.setattr(pipeline, "run_stage", recorder)
    monkeypatch.setattr(pipeline.runs, "claim_workspace", lambda project_dir, owner: {"waited_s": 0})
    monkeypatch.setattr(pipeline.runs, "rename_run", lambda name: name)
    monkeypatch.setattr(pipeline.runs, "apply_overrides", lambda project_dir, overrides: [])
    monkeypatch.setattr(pipeline.runs, "pull_state", lambda project_dir: None)
    monkeypatch.setattr(pipeline.runs, "push_state", lambda project_dir, wait_for=(): None)
    if not check_inputs:  # a bare dvc.yaml has no params.yaml
        monkeypatch.setattr(pipeline, "preflight", lambda project: None)
    pipeline.fineflow_pipeline.fn(str(project_dir))
    return recorder


def _stages_the_flow_runs(project_dir, monkeypatch) -> list[tuple[str, int]]:
    return _run_the_flow_body(project_dir, monkeypatch).calls


def test_each_task_waits_for_the_stages_whose_outputs_it_reads(monkeypatch):
    """The run graph draws dvc.yaml's edges: each task is handed its upstream stages' results (wait_for)."""
    upstream = _run_the_flow_body(ROOT, monkeypatch).upstream
    assert upstream["base"] == [] and upstream["data"] == []
    assert set(upstream["validate"]) == {"base", "fingerprint", "data"}  # data.*_path: dvc.yaml's ${...} resolved
    assert set(upstream["tokenize"]) == {"base", "fingerprint", "validate"}
    assert set(upstream["reference_logps"]) == {"base", "fingerprint", "tokenize"}  # DPO's log-probs of the shards
    assert set(upstream["train"]) == {"base", "fingerprint", "tokenize", "reference_logps"}
    assert {"train", "reference_logps"} <= set(upstream["evaluate"])
    assert {"train", "evaluate"} <= set(upstream["promote"])


def test_the_flow_checks_the_params_and_input_paths_before_its_first_stage(tmp_path, monkeypatch):
    """A deployment's run (no `make run` around it): the params as its overrides left them and every input path
    they name are checked after the pull, before any stage task; the run fails on the user error."""
    from fineflow.errors import ConfigError

    project = copy_project(tmp_path / "project", {"data.train_path": "mine/train.jsonl"})
    recorder = _RecordingTask()
    with pytest.raises(ConfigError, match=r"data.train_path: no such file: 'mine/train.jsonl'"):
        _run_the_flow_body(project, monkeypatch, recorder, check_inputs=True)
    assert recorder.calls == []


def test_stage_entries_are_exactly_dvc_yamls_stages():
    entries = sorted(p.stem for p in (ROOT / "fineflow/stages").glob("*.py") if not p.stem.startswith("_"))
    assert entries == sorted(STAGES)
    for stage, spec in yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"].items():
        assert f"python -m fineflow.stages.{stage} " in spec["cmd"] + " ", f"stage {stage} runs another entry"


def test_the_flow_runs_dvc_yamls_stages_in_its_order_and_retries_only_train_twice(monkeypatch):
    """The README's promise: the train task retries twice after a crash (and resumes); no other stage retries."""
    calls = _stages_the_flow_runs(ROOT, monkeypatch)
    assert [stage for stage, _ in calls] == STAGES
    assert dict(calls) == {stage: 2 if stage == "train" else 0 for stage in STAGES}


def test_the_flow_follows_an_edited_dvc_yaml(tmp_path, monkeypatch):
    """The order is read from the project's dvc.yaml, not written down a second time."""
    (tmp_path / "dvc.yaml").write_text("stages:\n  data: {cmd: x}\n  base: {cmd: y}\n", encoding="utf-8")
    assert [stage for stage, _ in _stages_the_flow_runs(tmp_path, monkeypatch)] == ["data", "base"]


def test_lineage_times_the_run_from_every_stage_before_promote():
    from fineflow.registry.lineage import report_stages

    assert report_stages(ROOT / "reports") == STAGES[: STAGES.index("promote")]
    # the champion's export after its promotion; the ledger last, after the candidate's lineage is written
    assert STAGES[-3:] == ["promote", "export", "goodput"]


def _count_attempts(stages, monkeypatch) -> list[str]:
    """The stages the Prefect task ran, one entry per attempt (the real repro_single still runs)."""
    calls = []
    real = stages.repro_single
    monkeypatch.setattr(stages, "repro_single", lambda *args: calls.append(args[0]) or real(*args))
    return calls


@pytest.mark.slow
def test_a_user_error_is_not_retried_through_dvc_and_prefect(prefect_harness, tmp_path, monkeypatch):
    """Invalid params: the stage exits 2, `dvc repro` exits 255 (for any failure), and the Prefect task still
    sees a user error, from the stage's error record, and does not retry it."""
    from prefect import flow

    import tasks.stages as stages

    project = copy_project(tmp_path / "project", {"train.lr": -1})
    calls = _count_attempts(stages, monkeypatch)
    monkeypatch.setenv("PATH", venv_env()["PATH"])

    @flow
    def one_stage():
        return stages.run_stage.with_options(retries=2, retry_delay_seconds=0)("base", str(project))

    with pytest.raises(stages.StageFailed) as failed:
        one_stage()
    assert calls == ["base"]  # one attempt: not retried
    assert failed.value.returncode == 2 and "a user error, not retried" in str(failed.value)
    assert "train.lr" in str(failed.value)  # the stage's own message reaches the flow
    record = json.loads((project / "reports/base.error.json").read_text())
    assert record["kind"] == "user_error" and "train.lr" in record["message"]


@pytest.mark.scenario
@pytest.mark.slow
def test_a_crash_is_retried_through_dvc_and_prefect_and_the_retry_resumes(
    prefect_harness, reproduced, tmp_path, monkeypatch
):
    """The train stage's process dies (SIGKILL, injected at step 4's checkpoint write, once): `dvc repro` fails
    with no error record, the Prefect task retries it, and the retry resumes from the step-2 checkpoint."""
    from prefect import flow

    import tasks.stages as stages
    from tests.faults import fault_env

    overrides = {"train.steps": 6, "checkpoint.every_steps": 2, "train.eval_every": 6}
    project = copy_reproduced(reproduced, tmp_path / "project", overrides)  # up to tokenize: done, unchanged
    marker = tmp_path / "crashed-once"
    for name, value in fault_env({}, crash_once_at_step=(4, marker)).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PATH", venv_env()["PATH"])
    calls = _count_attempts(stages, monkeypatch)

    @flow
    def train_only():
        return stages.run_stage.with_options(retries=2, retry_delay_seconds=0)("train", str(project))

    result = train_only()
    assert marker.exists() and calls == ["train", "train"]  # crashed once, retried once
    assert not (project / "reports/train.error.json").exists()  # a crash leaves no user-error record
    assert result["ran"] and result["report"]["resumed_from_step"] == 2 and result["report"]["steps"] == 6


@pytest.mark.slow
def test_param_overrides_are_applied_by_their_task_or_refused_all_at_once(prefect_harness, tmp_path):
    """The flow's `overrides` parameter (what the UI's run form sets) through its Prefect task."""
    from prefect import flow

    from fineflow.core.config import load_params
    from fineflow.errors import ConfigError
    from tasks import runs

    project = copy_project(tmp_path / "project")

    @flow
    def apply_only(overrides: dict):
        return runs.apply_overrides(str(project), overrides)

    assert apply_only({"train.lr": 0.002, "train.steps": 5}) == ["train.lr=0.002", "train.steps=5"]
    params = load_params(project / "params.yaml")
    assert (params.train.lr, params.train.steps) == (0.002, 5)
    before = (project / "params.yaml").read_bytes()
    with pytest.raises(ConfigError) as refused:
        apply_only({"train.lrr": 1, "train.warmup_steps": -3})
    assert "train.lrr is not a known key" in str(refused.value) and "train.warmup_steps must be >= 0" in str(
        refused.value
    )
    assert (project / "params.yaml").read_bytes() == before


# --- the exit-code contract from `make run` (python -m flows.pipeline) -------------------------------------


def _make_run(project, prefect_home):
    """`make run` in the project copy: the supervisor, the flow process, Prefect's temporary server."""
    env = {**venv_env(), "PREFECT_HOME": str(prefect_home), "PREFECT_LOGGING_LEVEL": "INFO"}
    return subprocess.run(
        [sys.executable, "-m", "flows.pipeline"], cwd=project, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, problems",
    [
        ({"train.lr": -1, "train.lrr": 1}, ["train.lr must be > 0 (got -1)", "train.lrr is not a known key"]),
        ({"data.eval_path": "mine/eval.jsonl"}, ["data.eval_path: no such file: 'mine/eval.jsonl'"]),
    ],
    ids=["bad-value-and-unknown-key", "missing-input-path"],
)
def test_make_run_with_a_params_mistake_exits_2_with_one_message_before_any_stage(tmp_path, overrides, problems):
    """A params mistake is a user error from `make run` as from a stage: exit 2, every problem named once, no
    traceback, and nothing run (the params and the input paths are checked before the flow starts)."""
    project = copy_project(tmp_path / "project", overrides)
    done = _make_run(project, tmp_path / "prefect")
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-6000:]
    assert "Traceback" not in output, output[-6000:]
    for problem in problems:
        assert output.count(problem) == 1, (problem, output[-6000:])
    assert problems[-1] in done.stderr.rstrip().splitlines()[-1]  # the message is what stderr ends with
    assert not (project / "models/base").exists()


@pytest.mark.slow
def test_serving_the_flow_with_a_params_mistake_is_refused_at_once(tmp_path):
    """`make serve` (python -m flows.deploy): every scheduled run would fail on it, so it exits 2 now."""
    project = copy_project(tmp_path / "project", {"data.train_path": "mine/train.jsonl"})
    env = {**venv_env(), "PREFECT_HOME": str(tmp_path / "prefect")}
    done = subprocess.run(
        [sys.executable, "-m", "flows.deploy"], cwd=project, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-4000:]
    assert done.stderr.startswith("fineflow serve: error: ") and "data.train_path: no such file" in done.stderr


@pytest.mark.slow  # ~14 s: the one test here that starts the flow's temporary server
def test_a_user_error_in_a_stage_of_the_flow_exits_2_with_its_message_last_and_no_traceback(tmp_path):
    """A user error only a stage can find (a hub id the offline cache lacks: no path to check beforehand) fails
    the flow at its first stage: `make run` exits 2, Prefect logs no traceback, and stderr ends with the message."""
    project = copy_project(tmp_path / "project", {"model.base": "nobody/no-such-model"})
    done = _make_run(project, tmp_path / "prefect")
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-6000:]
    assert "Traceback" not in output, output[-6000:]
    last = done.stderr.rstrip().splitlines()[-1]
    assert last.startswith("fineflow run: error: ") and "model.base 'nobody/no-such-model'" in last, last
    assert not (project / "reports/base.json").exists()  # base refused; no stage after it ran
    assert not (project / "reports/fingerprint.json").exists()


# --- runs whose process died ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_runs_left_running_by_a_dead_process_are_marked_crashed_by_the_next_run(prefect_server, tmp_path):
    """Against a real `prefect server` on 127.0.0.1: Running runs of this workspace whose process was SIGKILLed,
    or whose pid now names another process, become Crashed with a message; a live process's run, another
    workspace's and the current run stay Running."""
    import os
    import signal

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Running

    from tasks import runs

    @flow(name="fineflow-test-run")
    def nothing():
        pass

    project, other = tmp_path / "project", tmp_path / "other"
    project.mkdir(), other.mkdir()
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed_tag = runs.process_tag(killed.pid)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    host, pid, started = runs.process_tag().removeprefix(runs.PROCESS_TAG).rsplit(":", 2)
    reused_tag = f"{runs.PROCESS_TAG}{host}:{pid}:{int(started) - 3600}"  # this pid, an hour earlier: another process
    with temporary_settings({PREFECT_API_URL: prefect_server}), get_client(sync_client=True) as client:

        def run(project_dir, process):
            tags = [runs.workspace_tag(project_dir), process]
            return client.create_flow_run(nothing, tags=tags, state=Running()).id

        dead, reused, alive = (run(project, tag) for tag in (killed_tag, reused_tag, runs.process_tag()))
        elsewhere, current = run(other, killed_tag), run(project, killed_tag)
        marked = runs.mark_dead_runs_crashed(client, str(project), current=current)
        states = {key: client.read_flow_run(key).state for key in (dead, reused, alive, elsewhere, current)}
    assert len(marked) == 2, marked
    assert [states[key].type.value for key in (dead, reused)] == ["CRASHED", "CRASHED"]
    assert f"{killed.pid}" in states[dead].message and "ended without reporting" in states[dead].message
    assert [states[key].type.value for key in (alive, elsewhere, current)] == ["RUNNING"] * 3


@pytest.mark.slow
def test_two_runs_started_in_the_same_second_on_one_workspace_get_distinct_names(prefect_server, tmp_path, monkeypatch):
    """Two triggers at once (a cron tick and new data) on one commit: the names of the two queued runs differ,
    though their commit, edits and start second are the same (on main both were `<sha> <time> UTC`)."""
    import time

    from prefect import flow
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks import runs

    @flow(name="fineflow-test-names", flow_run_name=runs.flow_run_name)
    def named(project_dir: str = ".", overrides: dict | None = None) -> str:
        return flow_run.name

    monkeypatch.setattr(time, "time", lambda: 1_796_000_000.0)  # one start second for both
    with temporary_settings({PREFECT_API_URL: prefect_server}):
        first, second = named(str(tmp_path)), named(str(tmp_path))
    assert first != second, (first, second)
    assert first.split(" #")[0] == second.split(" #")[0]  # the same commit and start: only the run id tells
