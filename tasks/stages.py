"""The one Prefect task every stage uses: ``dvc repro --single-item <stage>``, logs streamed, report published
(what the run page shows, and how it is rendered, is ``tasks/artifacts.py``'s).

Running the stage through DVC (rather than calling its Python entry directly) is what makes a flow run and
a plain ``dvc repro`` leave the same ``dvc.lock``, and what skips a stage whose code, params and inputs are
unchanged. The stage's own entry (``fineflow.stages.<stage>``) is the command DVC runs.

Stopping: `dvc repro` runs in a process group of its own. When the flow is interrupted (Ctrl-C:
KeyboardInterrupt; SIGTERM: Prefect's TerminationSignal) while a stage runs, that group gets SIGINT (DVC waits
for its stage command, which stops: the train stage saves its step), is killed if it is still there a few
seconds after the train grace, and the interruption goes on up: the run ends Crashed, never retried. A stage
stopped on its own (its node preempted) exits 75 with a record: retried, it resumes from the saved step.

A stage silent for HEARTBEAT_S (30 s) still gets a log line ("still running", ``Heartbeat``): the run page shows
it working. A user error (the stage's record says so; ``is_user_error``) is never retried, and Prefect logs it without a
traceback (``log_user_errors_without_tracebacks``): its message is the whole story.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

from prefect import get_run_logger, task

from fineflow.core import dvc_project
from fineflow.core.config import load_params
from fineflow.core.dvc_project import dvc_environment
from fineflow.core.reports import read_approval_request, read_error_record
from fineflow.core.train_config import CheckpointSettings
from fineflow.dvc_rwlock import busy_error, repair_rwlock
from fineflow.errors import PREEMPTED_EXIT, USER_ERROR_EXIT, FineflowError
from fineflow.process import preempt
from fineflow.registry.approval import APPROVAL_ENV
from tasks.artifacts import TrainingProgress, publish_failure, publish_report
from tasks.runs import exit_once_the_api_is_gone

# The lines of a failed stage's output that its message keeps: errors, and DVC's "is busy, it is being blocked
# by: (PID …) <command>" that names the process holding the workspace.
_SALIENT = re.compile(r"error|busy|blocked by|\(PID \d+\)", re.IGNORECASE)
# A tqdm redraw ("Map:  40%|████      | 2/5 [00:01<00:01, ...]"); Popen's text mode splits at its \r. Only the
# finished bar (100%) reaches the log.
_PROGRESS_REDRAW = re.compile(r"(?<!100)%\|[^|]*\|\s*\d+/\d+")


def is_progress_redraw(line: str) -> bool:
    return bool(_PROGRESS_REDRAW.search(line))


HEARTBEAT_S = 30.0  # the longest a running stage's log stays silent (lm-eval, a merge, pretraining print rarely)


class Heartbeat:
    """Logs "stage X: still running" whenever the stage has printed nothing for HEARTBEAT_S, from a thread of its
    own (the reading loop is blocked on the silent pipe), so a run page never looks stuck while a stage works."""

    def __init__(self, stage: str, log, every_s: float):
        self.stage, self.log, self.every_s = stage, log, every_s
        self.started = self.last = time.monotonic()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, name=f"heartbeat {stage}", daemon=True)

    def seen(self) -> None:
        self.last = time.monotonic()

    def _beat(self) -> None:
        while not self.done.wait(max(0.05, self.last + self.every_s - time.monotonic())):
            now = time.monotonic()
            if now - self.last >= self.every_s:
                self.log(
                    f"stage {self.stage}: still running ({now - self.started:.0f} s so far, "
                    f"no output for {now - self.last:.0f} s)"
                )
                self.last = now

    def __enter__(self) -> Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(timeout=5)


class StageFailed(RuntimeError):
    """returncode: USER_ERROR_EXIT when the stage recorded a user error (never retried), PREEMPTED_EXIT when it
    recorded a stop after saving its step (retried: resumes there), else what failed. The message: the stage's
    own (whole) for a user error or a stop, else the error lines of its output's tail."""

    def __init__(
        self,
        stage: str,
        returncode: int,
        tail: list[str],
        user_error: dict | None = None,
        preempted: dict | None = None,
    ):
        self.returncode = USER_ERROR_EXIT if user_error else PREEMPTED_EXIT if preempted else returncode
        if user_error:
            super().__init__(f"stage {stage} failed (a user error, not retried): {user_error['message']}")
        elif preempted:
            super().__init__(f"stage {stage} was stopped (exit {PREEMPTED_EXIT}, retried): {preempted['message']}")
        else:
            lines = [line for line in tail if _SALIENT.search(line)] or tail
            super().__init__(f"stage {stage} failed (exit {returncode}):\n" + "\n".join(lines[-15:]))


def preempt_grace_s(project_dir: str | Path) -> float:
    """checkpoint.preempt_grace_s of the project's params.yaml: what the layers' stop budgets are built on."""
    try:
        return load_params(Path(project_dir) / "params.yaml").checkpoint.preempt_grace_s
    except FineflowError:  # unreadable params: the stage itself is failing on them
        return CheckpointSettings().preempt_grace_s


def repro_single(stage: str, project_dir: Path, log, extra_env: dict[str, str] | None = None) -> bool:
    """Run the stage through DVC, streaming every output line to log; raise StageFailed on failure.

    Returns whether the stage's command ran (False when DVC found it unchanged and skipped it)."""
    repaired = repair_rwlock(project_dir)  # a dvc process killed mid-write would fail every stage from now on
    if repaired:
        log(f"fineflow: {repaired}")
    tail: deque[str] = deque(maxlen=60)
    ran = False  # seen DVC's "Running stage" line (a chatty stage pushes it out of the tail)
    with (
        dvc_project.popen_dvc(
            project_dir,
            "repro",
            "--single-item",
            stage,
            env=dvc_environment(extra_env),
            start_new_session=True,  # a terminal's Ctrl-C reaches it only through StopStage, once
        ) as proc,
        preempt.StopStage(proc.pid) as stop,
        Heartbeat(stage, log, HEARTBEAT_S) as heartbeat,
    ):
        try:
            for line in proc.stdout:
                if stop.signum is not None:  # the flow was stopped but the exception got lost above the handler
                    raise KeyboardInterrupt(f"stopped by {preempt.signal_name(stop.signum)}")
                line = line.rstrip()
                heartbeat.seen()
                if line and not is_progress_redraw(line) and not dvc_project.is_hint(line):
                    tail.append(line)
                    ran = ran or line.startswith(f"Running stage '{stage}'")
                    log(line)
            if stop.signum is not None:  # the stage ended on the stop before the lost exception could be raised
                raise KeyboardInterrupt(f"stopped by {preempt.signal_name(stop.signum)}")
        except BaseException as exc:  # KeyboardInterrupt, Prefect's TerminationSignal, anything: no stage outlives it
            if stop.signum is not None or isinstance(exc, KeyboardInterrupt) or hasattr(exc, "signal"):
                # stopped: should Prefect's server have got the signal too, the flow must not wait for it
                exit_once_the_api_is_gone(128 + (stop.signum or getattr(exc, "signal", signal.SIGTERM)), project_dir)
            stop_stage(proc, stage, project_dir, log, sent=stop.signum is not None)
            raise
    if proc.returncode and (busy := busy_error(list(tail))):
        raise busy  # held by a live dvc of this repository (repair_rwlock cleared the dead): retrying cannot help
    if proc.returncode:
        # `dvc repro` exits 255 for any failed stage command: the stage's error record says which kind it was
        report = Path(project_dir) / "reports" / f"{stage}.json"
        raise StageFailed(
            stage, proc.returncode, list(tail), read_error_record(report), preempt.read_preempted_record(report)
        )
    return ran


def stop_stage(proc: subprocess.Popen, stage: str, project_dir: Path, log, sent: bool = False) -> None:
    """SIGINT to `dvc repro`'s group (DVC ignores it while its stage command runs and returns when that has
    stopped; sent: StopStage's handler sent it already), its output still streamed; killed, with every process
    under it, if it outlives the budget."""
    log(f"stopping stage {stage}: SIGINT to dvc repro and the stage")
    drain = threading.Thread(target=_stream, args=(proc.stdout, log), daemon=True)
    drain.start()
    preempt.stop_group(proc, signal.SIGINT, preempt.budget_s(preempt_grace_s(project_dir), "task"), sent=sent)
    drain.join(timeout=2)  # the last lines; Popen's exit closes the pipe after this
    record = preempt.read_preempted_record(Path(project_dir) / "reports" / f"{stage}.json")
    if record is not None:
        log(f"stage {stage}: {record['message']}")


def _stream(pipe, log) -> None:
    """The rest of a stopping stage's output to log, until the pipe ends or is closed under it."""
    try:
        for line in pipe:
            if line.rstrip() and not is_progress_redraw(line):
                log(line.rstrip())
    except (OSError, ValueError):
        pass


def is_user_error(exc: BaseException | None) -> bool:
    """A FineflowError, or a stage that recorded one: exit 2 and one message at every layer, never retried."""
    if isinstance(exc, StageFailed):
        return exc.returncode == USER_ERROR_EXIT
    return isinstance(exc, FineflowError)


def _retry_unless_user_error(task, task_run, state) -> bool:
    try:
        state.result()
    except Exception as exc:
        return not is_user_error(exc)
    return False


def is_stop(exc: BaseException | None) -> bool:
    """Ctrl-C or SIGTERM (KeyboardInterrupt; Prefect's TerminationSignal, which carries the signal): a stop asked
    for, not a crash."""
    return isinstance(exc, KeyboardInterrupt) or hasattr(exc, "signal")


class _WithoutUserErrorTracebacks(logging.Filter):
    """Prefect logs a failed task or flow run with the exception's traceback. A user error's traceback shows
    only fineflow's own plumbing (the stage ran in another process, and its message is the whole story), and a
    stop's (Ctrl-C, SIGTERM) is the signal's way up the stack: both are logged without one, on the console and in
    the UI alike; a crash keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and (is_user_error(record.exc_info[1]) or is_stop(record.exc_info[1])):
            record.exc_info, record.exc_text = None, None
        return True


_QUIET = _WithoutUserErrorTracebacks()


def log_user_errors_without_tracebacks() -> None:
    """On Prefect's task-run and flow-run loggers, in this process (idempotent: a filter is added once)."""
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logging.getLogger(name).addFilter(_QUIET)


@task(task_run_name="{stage}", retry_condition_fn=_retry_unless_user_error)
def run_stage(stage: str, project_dir: str = ".", approval: dict | None = None) -> dict:
    """Reproduce one stage (skipped by DVC when unchanged) and publish reports/<stage>.json as an artifact.

    Returns {"stage", "ran", "report"}: ran is False when DVC skipped the unchanged stage. A promote stage
    whose candidate waits for a person (promote.require_approval) returns {"approval_needed": the gate's
    evidence} instead; the flow asks and runs it again with approval, the answer (FINEFLOW_APPROVAL)."""
    logger = get_run_logger()
    project = Path(project_dir).resolve()
    progress = TrainingProgress(stage)
    report_path = project / "reports" / f"{stage}.json"

    def log(line: str) -> None:
        logger.info(line)
        progress.see(line)

    extra_env = {APPROVAL_ENV: json.dumps(approval)} if approval else None
    try:
        ran = repro_single(stage, project, log, extra_env)
    except StageFailed as exc:
        request = read_approval_request(report_path)
        if request is not None:
            return {"stage": stage, "ran": True, "report": {}, "approval_needed": request["evidence"]}
        publish_failure(stage, exc)
        raise
    report = json.loads(report_path.read_text(encoding="utf-8")) if report_path.exists() else {}
    publish_report(stage, project, report, ran)
    return {"stage": stage, "ran": ran, "report": report}
