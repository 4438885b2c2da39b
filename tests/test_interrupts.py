"""Interrupts and preemption: Ctrl-C and SIGTERM stop the whole run within seconds at every layer
(flow, `dvc repro`, the train launcher, accelerate, the ranks), leave no process behind, mark the Prefect run
Crashed, and the train stage saves the step it was on and exits 75, so that the re-run resumes from that step and
ends bit-exact with an uninterrupted run.

From the unit (a rank's watchdog, fit() stopping at a step's end, the task stopping a fake `dvc repro` tree) to
the real thing: SIGTERM to the train launcher of a 2-process DDP run, Ctrl-C (SIGINT to the process group, as a
terminal sends it) and SIGTERM to the PID of `python -m flows.pipeline`."""

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import psutil
import pytest
from safetensors.torch import load_file

from tests.conftest import (
    TINY_PARAMS,
    _merge,
    copy_reproduced,
    finish_train,
    last_logged_step,
    launch_with_free_port,
    prefect_server_on,
    ranks_overrides,
    run_dirs,
    start_train,
    train_env,
    train_project,
    venv_env,
    write_params,
)
from tests.test_resume import _assert_same_training

GRACE_S = 20  # checkpoint.preempt_grace_s in the process tests: generous on a busy 2-core machine
GONE_WITHIN_S = 30  # the whole process tree after Ctrl-C/SIGTERM of the flow (the "within N seconds")


def _alive(processes) -> list:
    """The processes still running (a zombie has exited: only its parent has not read its status yet)."""
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_gone(processes, seconds: float) -> list:
    deadline = time.monotonic() + seconds
    while _alive(processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive(processes)


# --- a rank ----------------------------------------------------------------------------------------------


def test_a_rank_stuck_after_a_stop_signal_exits_75_when_the_grace_runs_out():
    """The watchdog is woken at C level: it ends the rank even when its main thread never runs Python again
    (here SIGTERM is blocked in the main thread, so no Python handler runs: as in a hung collective)."""
    code = (
        "import os, signal, threading, time\n"
        "from fineflow.process import preempt\n"
        "preempt.install(1.0)\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
        "threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
        "lock = threading.Lock(); lock.acquire(); lock.acquire()  # blocks forever\n"
    )
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 75, result.stderr
    assert "preempt_grace_s (1s) ran out" in result.stderr
    assert time.monotonic() - started < 30  # 1 s of grace after the signal, plus an interpreter start


def _params(**overrides):
    from fineflow.core.config import parse_params

    return parse_params(_merge(TINY_PARAMS, overrides))


def _train_in_process(built, out, params):
    from accelerate.state import AcceleratorState

    from fineflow.train import procedure

    AcceleratorState._reset_state(reset_partial_state=True)  # a launched rank is a fresh process; here, reset
    return procedure.train_rank(
        params,
        built / "data/shards",
        built / "models/base",
        out / "checkpoints",
        out / "candidate",
        out / "steps.jsonl",
        out / "logs",
    )


def test_fit_finishes_the_step_saves_it_and_stops_and_the_resume_is_bit_exact(built, tmp_path, monkeypatch):
    """SIGTERM lands in the middle of step 3's forward: step 3 completes, is saved (no periodic checkpoint is
    due: every_steps 100) and fit() raises Preempted; the next run resumes from step 3 and ends with the adapter
    of an uninterrupted run, bit for bit."""
    from fineflow.checkpoint import load_checkpoint
    from fineflow.objectives import token_loss
    from fineflow.process import preempt

    params = _params(
        train={"steps": 6, "eval_every": 6, "tracker": "none", "log_every": 1}, checkpoint={"every_steps": 100}
    )
    reference = _train_in_process(built, tmp_path / "reference", params)

    forwards = []
    real = token_loss.token_loss_sum

    def signalled_in_step_3(model, batch, **kwargs):
        if model.training:
            forwards.append(1)
            if len(forwards) == 2 * params.train.grad_accum + 1:  # step 3's first micro-batch
                os.kill(os.getpid(), signal.SIGTERM)
        return real(model, batch, **kwargs)

    monkeypatch.setattr(token_loss, "token_loss_sum", signalled_in_step_3)
    out = tmp_path / "stopped"
    preempt.install(60)
    try:
        with pytest.raises(preempt.Preempted) as stopped:
            _train_in_process(built, out, params)
    finally:
        preempt.uninstall()
    assert (stopped.value.step, stopped.value.signum) == (3, signal.SIGTERM)
    [run_dir] = run_dirs(out / "checkpoints")
    assert [p.name for p in sorted(run_dir.glob("step-*"))] == ["step-0000003"]
    assert load_checkpoint(run_dir / "step-0000003").step == 3  # published and verified by hash
    assert [json.loads(line)["step"] for line in (out / "steps.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert not (out / "candidate").exists()

    monkeypatch.undo()
    report = _train_in_process(built, out, params)
    assert report["resumed_from_step"] == 3 and report["steps"] == 6
    a, b = (
        load_file(out / "candidate/adapter_model.safetensors"),
        load_file(tmp_path / "reference/candidate/adapter_model.safetensors"),
    )
    assert reference["steps"] == 6 and a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


# --- the Prefect task and `dvc repro` --------------------------------------------------------------------

# Stands in for `python -m dvc repro`: like DVC, it ignores SIGINT while its stage command runs, waits for it
# and exits 255 when it failed. The stage starts a helper in a session of its own (as torch elastic starts
# ranks) and records the pids of all three in pids.txt. A "stopping" stage saves (the record) and exits 75 on
# SIGINT, its helper with it; a "stuck" one ignores SIGINT, and so does its helper.
FAKE_DVC = """
import os, signal, subprocess, sys
stage = subprocess.Popen([sys.executable, "-c", STAGE])
signal.signal(signal.SIGINT, signal.SIG_IGN)
print("Running stage 'train':", flush=True)
sys.exit(255 if stage.wait() else 0)
"""
STAGE = """
import os, signal, subprocess, sys, time
from fineflow.process import preempt
helper = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN)"
                           "; time.sleep(300)"], start_new_session=True)
with open("pids.txt", "w") as fh:
    fh.write(f"{os.getppid()} {os.getpid()} {helper.pid}")
def stop(signum, frame):
    helper.kill()
    preempt.write_preempted_record("reports/train.json", "train", 7, signum)
    sys.exit(75)
signal.signal(signal.SIGINT, signal.SIG_IGN if MODE == "stuck" else stop)
print("step 1", flush=True)
time.sleep(300)
"""


def _fake_dvc(tmp_path, monkeypatch, mode: str, grace_s: float):
    import tasks.stages as stages

    write_params(tmp_path / "params.yaml", {"checkpoint.preempt_grace_s": grace_s})
    (tmp_path / "reports").mkdir()
    fake = tmp_path / "fake_dvc.py"
    stage = f"MODE = {mode!r}\n" + STAGE
    fake.write_text(f"STAGE = {stage!r}\n" + FAKE_DVC)
    real_popen = stages.subprocess.Popen
    monkeypatch.setattr(stages.subprocess, "Popen", lambda command, **kw: real_popen([sys.executable, str(fake)], **kw))
    return stages


def _pids(tmp_path) -> list:
    """The fake dvc, its stage and the stage's helper, as processes (they remember their start time)."""
    return [psutil.Process(int(pid)) for pid in (tmp_path / "pids.txt").read_text().split()]


def _interrupt_at(text: str, tmp_path, seen: dict):
    """A log that raises KeyboardInterrupt (Ctrl-C in the flow) when the stage prints `text`. seen gets the
    lines, and the fake's processes and the time at the interrupt."""
    seen["lines"] = []

    def log(line):
        seen["lines"].append(line)
        if line == text:
            seen.update(processes=_pids(tmp_path), at=time.monotonic())
            raise KeyboardInterrupt

    return log


def test_ctrl_c_in_the_task_stops_the_stage_through_dvc_and_reads_its_saved_step(tmp_path, monkeypatch):
    stages = _fake_dvc(tmp_path, monkeypatch, "stopping", grace_s=GRACE_S)
    seen = {}
    with pytest.raises(KeyboardInterrupt):  # the interruption goes on up: Prefect marks the run Crashed
        stages.repro_single("train", tmp_path, _interrupt_at("step 1", tmp_path, seen))
    assert time.monotonic() - seen["at"] < GRACE_S  # the stage stopped at once: no budget ran out
    assert len(seen["processes"]) == 3 and _wait_gone(seen["processes"], 5) == []
    assert "stage train: stopped by SIGINT after step 7, which is saved: a re-run resumes from it" in seen["lines"]


def test_a_ctrl_c_whose_exception_is_swallowed_above_the_task_still_stops_the_stage(tmp_path, monkeypatch):
    """Ctrl-C of the flow stops the train stage even when the KeyboardInterrupt never reaches the task's `except`
    (code between the handler and the task swallows it: asyncio cancels a coroutine instead of raising while it
    runs in the main thread): the signal handler itself sends SIGINT to `dvc repro`."""
    stages = _fake_dvc(tmp_path, monkeypatch, "stopping", grace_s=GRACE_S)
    seen = {"lines": []}

    def log(line):  # a real SIGINT to this process, while "library code" that swallows it runs
        seen["lines"].append(line)
        if line == "step 1":
            seen.update(processes=_pids(tmp_path), at=time.monotonic())
            threading.Timer(30, lambda: [p.kill() for p in _alive(seen["processes"])]).start()  # never hang
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)  # the handler runs here
            except KeyboardInterrupt:
                pass

    with pytest.raises(KeyboardInterrupt):  # raised once the stage is down: the flow still ends Crashed
        stages.repro_single("train", tmp_path, log)
    assert time.monotonic() - seen["at"] < 20  # stopped by the signal, not by the timer's kill
    assert _wait_gone(seen["processes"], 5) == []
    assert "stage train: stopped by SIGINT after step 7, which is saved: a re-run resumes from it" in seen["lines"]


def test_a_stage_that_ignores_the_stop_is_killed_with_everything_under_it_after_the_budget(tmp_path, monkeypatch):
    """Even the helper in a session of its own, which no process group signal reaches, is gone."""
    from fineflow.process.preempt import budget_s

    stages = _fake_dvc(tmp_path, monkeypatch, "stuck", grace_s=0.5)
    seen = {}
    with pytest.raises(KeyboardInterrupt):
        stages.repro_single("train", tmp_path, _interrupt_at("step 1", tmp_path, seen))
    took = time.monotonic() - seen["at"]
    assert budget_s(0.5, "task") <= took < budget_s(0.5, "task") + 20, took  # its budget, then killed
    assert len(seen["processes"]) == 3 and _wait_gone(seen["processes"], 5) == []


def test_a_stage_stopped_on_its_own_after_saving_is_retried(tmp_path, monkeypatch):
    """The stage alone was stopped (its node preempted), the flow was not: exit 75 through `dvc repro`'s 255,
    read from the record, and the task's retry condition says retry (it resumes from the saved step)."""
    from fineflow.process import preempt

    stages = _fake_dvc(tmp_path, monkeypatch, "stopping", grace_s=GRACE_S)

    def log(line):
        if line == "step 1":
            os.kill(_pids(tmp_path)[1].pid, signal.SIGINT)  # to the stage alone

    with pytest.raises(stages.StageFailed) as failed:
        stages.repro_single("train", tmp_path, log)
    assert failed.value.returncode == 75 and "was stopped (exit 75, retried)" in str(failed.value)
    assert preempt.read_preempted_record(tmp_path / "reports/train.json")["step"] == 7

    class Failed:  # a task state whose result is this failure
        def result(self):
            raise failed.value

    assert stages._retry_unless_user_error(None, None, Failed()) is True


# --- the real train stage ----------------------------------------------------------------------------------

STEPS = 12  # conftest.TRAIN_OVERRIDES: the reference run's length


@pytest.mark.scenario
@pytest.mark.slow
def test_sigterm_to_the_train_launcher_saves_the_current_step_and_the_rerun_is_bit_exact(
    built, reference_run, tmp_path
):
    """2-process DDP through the launcher and accelerate launch (torch elastic). SIGTERM to the launcher's PID
    alone (as Kubernetes sends it) after step 5; the last periodic checkpoint would be step 0 (every_steps 100).
    The stage exits 75 within the grace, having saved the step it was on; the re-run resumes from that step and
    ends bit-exact with an uninterrupted run (same rows, losses, learning rates, adapter tensors)."""
    reference = reference_run(2)
    overrides = {**ranks_overrides(2), "checkpoint.every_steps": 100, "checkpoint.preempt_grace_s": GRACE_S}
    project = train_project(built, tmp_path, overrides)
    stopped = {}

    def launch(port):
        proc = start_train(project, 2, train_env(2), port=port)
        deadline = time.monotonic() + 300
        while proc.poll() is None and last_logged_step(project) < 5 and time.monotonic() < deadline:
            time.sleep(0.002)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=GRACE_S + 60)[0]
        stopped.update(code=proc.returncode, took=time.monotonic() - started, tree=tree, output=output)
        return proc.returncode == 75, output

    ok, output = launch_with_free_port(launch)
    assert ok, output[-4000:]
    print(f"SIGTERM -> launcher exit 75: {stopped['took']:.1f}s")  # shown with -s: the figure in the README
    assert stopped["took"] < GRACE_S, stopped["took"]
    assert _wait_gone(stopped["tree"], 5) == []  # accelerate, the elastic agent, both ranks: none left
    record = json.loads((project / "reports/train.error.json").read_text())
    step = record["step"]
    assert record["kind"] == "preempted" and record["signal"] == "SIGTERM" and 5 <= step < STEPS, record
    assert f"stopped by SIGTERM after step {step}, which is saved" in output and "(exit 75)" in output
    [run_dir] = run_dirs(project / "checkpoints")
    assert [p.name for p in run_dir.glob("step-*")] == [f"step-{step:07d}"]  # the current step, nothing older
    assert last_logged_step(project) == step

    output = finish_train(project, 2)
    assert f"(step {step} of {STEPS})" in output and "resuming from" in output
    assert json.loads((project / "reports/train.json").read_text())["resumed_from_step"] == step
    assert not (project / "reports/train.error.json").exists()  # the re-run cleared the record
    _assert_same_training(project, reference)


@pytest.mark.slow
def test_sigkill_of_the_launcher_leaves_no_rank_training_on(built, tmp_path):
    """kill -9 (or the OOM killer) cannot be handled, but accelerate launch and every rank die with their parent:
    none trains on as an orphan beside the next attempt."""
    project = train_project(built, tmp_path, ranks_overrides(2))
    seen = {}

    def launch(port):
        proc = start_train(project, 2, train_env(2), port=port)
        deadline = time.monotonic() + 300
        while proc.poll() is None and last_logged_step(project) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        if proc.poll() is not None:
            return False, proc.communicate()[0]
        seen["tree"] = psutil.Process(proc.pid).children(recursive=True)
        seen["commands"] = [" ".join(p.cmdline()) for p in seen["tree"]]
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group: the ranks run in sessions of their own
        proc.wait()
        return True, ""

    ok, output = launch_with_free_port(launch)
    assert ok, output[-4000:]
    commands = seen["commands"]
    assert len([c for c in commands if "fineflow.stages.train" in c and "accelerate" not in c]) == 2, commands
    left = _wait_gone(seen["tree"], 10)
    for process in left:  # a failing run leaves nothing behind either
        process.kill()
    assert left == []


# --- the flow: `python -m flows.pipeline` ----------------------------------------------------------------


@pytest.fixture(scope="module")
def flow_project(reproduced, tmp_path_factory):
    """A project whose stages up to tokenize are done (DVC skips them in the flow) and whose train stage runs
    long enough to be interrupted (3000 tiny steps), plus a Prefect home of its own (the flow's run states)."""
    return _long_train_project(reproduced, tmp_path_factory.mktemp("interrupts"), GRACE_S)


def _long_train_project(reproduced, root, grace_s: float) -> tuple:
    overrides = {
        "train.steps": 3000,
        "train.eval_every": 3000,
        "train.log_every": 1,
        "train.tracker": "none",
        "checkpoint.every_steps": 1000,
        "checkpoint.preempt_grace_s": grace_s,
    }
    project = copy_reproduced(reproduced, root / "project", overrides)  # the session's finished run, retrained
    return project, root / "prefect"


def _steps_logged(project) -> int:
    try:
        return len((project / "reports/train_steps.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _interrupt_flow(flow_project, send, within_s: float = GONE_WITHIN_S) -> dict:
    """Start `python -m flows.pipeline` in its own session (as a terminal starts a job in its own process
    group), call send(proc, tree) once the train stage has logged a few more steps, and time the whole tree's
    end (at most within_s)."""
    project, prefect_home = flow_project
    env = {**venv_env(), "PREFECT_HOME": str(prefect_home), "PREFECT_LOGGING_LEVEL": "INFO"}
    log = project / "flow.log"
    before = _steps_logged(project)
    with log.open("w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.pipeline"],
            cwd=project,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 600
    while proc.poll() is None and _steps_logged(project) < before + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, log.read_text()[-4000:]
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    names = " ".join(" ".join(p.cmdline()) for p in tree)
    for layer in ("flows.pipeline", "uvicorn", "dvc repro", "fineflow.stages.train", "accelerate.commands.launch"):
        assert layer in names, (layer, names)  # every layer was running when the signal came
    started = time.monotonic()
    try:
        send(proc, tree)
        left = [" ".join(p.cmdline()) for p in _wait_gone(tree, within_s)]
        took = time.monotonic() - started
    finally:
        for process in _alive(tree):  # a failing run leaves nothing behind either
            process.kill()
        proc.wait()
    output = log.read_text()
    assert not left, (f"still running {within_s}s after the signal:", left, output[-4000:])
    return {"code": proc.returncode, "took": took, "output": output, "project": project, "home": prefect_home}


def _last_flow_run_state(prefect_home) -> str:
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        return db.execute("select state_type from flow_run order by created desc limit 1").fetchone()[0]


def _assert_stopped_cleanly(run: dict, signame: str):
    print(f"exit {run['code']}, every process of the flow gone after {run['took']:.1f}s")  # shown with -s
    assert run["took"] < GONE_WITHIN_S
    assert _last_flow_run_state(run["home"]) in ("CRASHED", "CANCELLED"), run["output"][-3000:]
    # the train stage saved the step it was on before it went: the next run resumes from there
    record = json.loads((run["project"] / "reports/train.error.json").read_text())
    assert record["kind"] == "preempted" and record["signal"] == signame, record
    [run_dir] = run_dirs(run["project"] / "checkpoints")
    assert (run_dir / f"step-{record['step']:07d}" / "manifest.json").exists()
    assert last_logged_step(run["project"]) == record["step"]


@pytest.mark.scenario
@pytest.mark.slow
def test_ctrl_c_of_the_flow_ends_every_process_within_seconds(flow_project):
    """SIGINT to the flow's whole process group, what Ctrl-C in a terminal does."""
    run = _interrupt_flow(flow_project, lambda proc, tree: os.killpg(proc.pid, signal.SIGINT))
    assert run["code"] == 128 + signal.SIGINT, run["output"][-3000:]
    _assert_stopped_cleanly(run, "SIGINT")  # the task forwards SIGINT to dvc's group, the launcher to the ranks


@pytest.mark.nightly  # CI keeps Ctrl-C of the flow (the supervisor's same forwarding) and SIGTERM to every process
@pytest.mark.slow
def test_sigterm_to_the_flows_pid_alone_ends_every_process_within_seconds(flow_project):
    """SIGTERM to one PID, what `kill` or a Kubernetes eviction (PID 1) does."""
    run = _interrupt_flow(flow_project, lambda proc, tree: proc.send_signal(signal.SIGTERM))
    assert run["code"] == 128 + signal.SIGTERM, run["output"][-3000:]
    _assert_stopped_cleanly(run, "SIGINT")  # the task stops `dvc repro` with SIGINT, whatever stopped the flow


@pytest.mark.scenario
@pytest.mark.slow
def test_sigterm_to_every_process_at_once_ends_within_the_readmes_grace(reproduced, tmp_path):
    """SIGTERM to every PID of the tree at the same moment, what Slurm (every process of a job step) and systemd's
    default KillMode (the whole control group) do: the flow's temporary Prefect server dies with the rest, and the
    flow's report of the stop must not hang on it. The whole tree ends within the README's preempt_grace_s + 15."""

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks import runs

    def sigterm_everyone(proc, tree):
        for process in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGTERM)

    grace_s = 8  # the stage saves its step in ~2 s; the README's bound is then 23 s
    project = _long_train_project(reproduced, tmp_path, grace_s)
    run = _interrupt_flow(project, sigterm_everyone, within_s=2 * GONE_WITHIN_S)
    print(f"exit {run['code']}, every process of the flow gone after {run['took']:.1f}s")  # shown with -s
    assert run["code"] == 128 + signal.SIGTERM, run["output"][-3000:]
    assert run["took"] < grace_s + 15, run["output"][-3000:]  # the README's bound for platforms
    record = json.loads((run["project"] / "reports/train.error.json").read_text())
    assert record["kind"] == "preempted", record  # the stage saved the step it was on
    # its server died with it: the run is left Running in the server's database until the next run of the
    # workspace marks it Crashed (a server over the same database, and what the next run does first)
    with prefect_server_on(run["home"]) as url, temporary_settings({PREFECT_API_URL: url}):
        with get_client(sync_client=True) as client:
            runs.mark_dead_runs_crashed(client, str(project[0]))
    assert _last_flow_run_state(run["home"]) in ("CRASHED", "CANCELLED"), run["output"][-3000:]


@pytest.mark.nightly  # a third flow stopped during train; CI keeps Ctrl-C and SIGTERM of a live flow
@pytest.mark.slow
def test_a_dead_prefect_server_does_not_hang_the_stop(flow_project):
    """The temporary server dies (here: SIGKILL) and then the flow is stopped: every call to report the stop
    fails after 2 quick retries instead of 5 backing off to a minute each, so the flow still ends in seconds."""

    def kill_server_then_ctrl_c(proc, tree):
        [server] = [p for p in tree if "uvicorn" in " ".join(p.cmdline())]
        server.kill()
        assert _wait_gone([server], 10) == []
        os.killpg(proc.pid, signal.SIGINT)

    run = _interrupt_flow(flow_project, kill_server_then_ctrl_c, within_s=2 * GONE_WITHIN_S)
    print(f"exit {run['code']}, every process of the flow gone after {run['took']:.1f}s")  # shown with -s
    assert run["code"] == 128 + signal.SIGINT, run["output"][-3000:]
    record = json.loads((run["project"] / "reports/train.error.json").read_text())
    assert record["kind"] == "preempted"  # the stage was stopped and saved all the same


# --- the launcher's output on a user error ---------------------------------------------------------------

DRIVER = (  # run_ranks on the argv it is given, as the train launcher calls it
    "import os, sys; from fineflow.process.preempt import run_ranks; "
    "sys.exit(run_ranks(sys.argv[1:], {**os.environ}, 5))"
)
USER_ERROR_RANK = """import sys
print("fineflow train: error: params.yaml: train.lr must be > 0 (got -1)", file=sys.stderr, flush=True)
sys.exit(2)
"""


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_rank_user_error_through_the_launcher_prints_its_message_and_no_traceback(tmp_path, ranks):
    """A rank that exits 2 (a FineflowError: bad params or data) under `accelerate launch`: accelerate's simple
    launcher raises CalledProcessError, torch elastic's ChildFailedError, each with ~40 lines of traceback and
    report; run_ranks keeps the rank's message, the exit code, and drops the launcher's traceback."""
    from fineflow.train.launch import accelerate_command

    (tmp_path / "user_error_rank.py").write_text(USER_ERROR_RANK)
    env = {**venv_env(), "PYTHONPATH": f"{tmp_path}{os.pathsep}{venv_env().get('PYTHONPATH', '')}"}

    codes = []

    def launch(port):
        argv, extra = accelerate_command(ranks, False, "user_error_rank", [], port)
        done = subprocess.run(
            [sys.executable, "-c", DRIVER, *argv],
            env={**env, **extra},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        codes.append(done.returncode)
        return done.returncode == 0, done.stdout + done.stderr

    _, output = launch_with_free_port(launch)
    assert codes[-1] != 0 and "train.lr must be > 0" in output, output[-3000:]
    assert "Traceback" not in output and "ChildFailedError" not in output and "CalledProcessError" not in output, (
        output[-3000:]
    )
