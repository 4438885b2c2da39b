"""What every stage entry does around its ``run``: environment, params and input paths, reports, and clean errors."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fineflow.core.config import Params, load_params
from fineflow.core.dvc_project import DVC_FILE
from fineflow.core.journal import Attempt, ledger_dir
from fineflow.core.metrics import write_metrics
from fineflow.core.preflight import check_input_paths
from fineflow.core.reports import (
    clear_error_record,
    write_approval_request,
    write_error_record,
    write_json_atomic,
    write_preempted_record,
)
from fineflow.core.runtime import apply_offline_environment, is_train_worker
from fineflow.core.threads import ThreadPlan, apply_threads, process_plan
from fineflow.core.workspace import held_for, queued_experiment
from fineflow.errors import (
    APPROVAL_NEEDED_EXIT,
    PREEMPTED_EXIT,
    USER_ERROR_EXIT,
    ApprovalNeeded,
    FineflowError,
    StoppedAndSaved,
    WorkspaceBusy,
)


def stage_parser(stage: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m fineflow.stages.{stage}", description=description)
    parser.add_argument("--params", default="params.yaml", help="parameters file (default: params.yaml)")
    parser.add_argument("--report", default=f"reports/{stage}.json", help="where to write the JSON report")
    return parser


def log(message: str) -> None:
    """Stage logs go to stdout, line-buffered, so Prefect streams them live."""
    print(message, flush=True)


def user_error(stage: str, report: str, exc: FineflowError) -> None:
    """One clean line for the user, and the record that tells the layers above it was not a crash."""
    print(f"fineflow {stage}: error: {exc}", file=sys.stderr, flush=True)
    write_error_record(report, stage, str(exc))


def workspace_busy(stage: str, exc: WorkspaceBusy) -> None:
    """The one line for a stage that found another run in the workspace; no error record (the record file is
    the holder's stage's: its task reads it)."""
    print(f"fineflow {stage}: error: {exc}", file=sys.stderr, flush=True)


def workspace_turn(stage: str):
    """The stage holds the workspace while it runs (fineflow.core.workspace.held_for): DVC runs it from the project
    root. A rank of the train stage runs under its launcher, which holds it. A queued DVC experiment's stage
    runs in a copy of the project: it waits for the project's turn."""
    if is_train_worker():
        return contextlib.nullcontext()
    experiment = queued_experiment()
    if experiment is not None:
        name, project = experiment
        return held_for(project, f"{stage} stage of the queued DVC experiment '{name}'", wait=True)
    return held_for(Path.cwd(), f"{stage} stage (started outside a flow run: dvc repro or by hand)")


def journal_attempt(stage: str, report: str) -> Attempt | None:
    """This stage process's lines in the run's journal (fineflow.core.journal); a training rank has none (its
    launcher's attempt covers it), nor has a process whose journal cannot be written (a read-only checkout:
    the stage still runs)."""
    if is_train_worker():
        return None
    attempt = Attempt(ledger_dir(report), stage)
    try:
        attempt.start()
    except Exception as exc:  # noqa: BLE001 - the journal is bookkeeping: the stage runs without it
        print(f"fineflow {stage}: warning: the run's journal was not written: {exc}", file=sys.stderr, flush=True)
        return None
    return attempt


def check_pipeline_inputs(params: Params) -> None:
    """A stage DVC runs (from the project root, beside dvc.yaml) refuses at once when an input path params.yaml
    names is missing (fineflow.core.preflight): so the first stage `dvc repro` runs stops the run, before the
    base is pretrained. A stage started by hand elsewhere reads the paths its arguments name; a training rank
    leaves it to its launcher."""
    project = Path.cwd()
    if not is_train_worker() and (project / DVC_FILE).is_file():
        check_input_paths(params, project)


ThreadDecision = Callable[[Params], ThreadPlan]


def one_process(params: Params) -> ThreadPlan:
    """A stage that computes in its own process only: it has every usable CPU (or what OMP_NUM_THREADS says)."""
    return process_plan(1)


def run_entry(
    stage: str, args: argparse.Namespace, body: Callable[[Params], dict], threads: ThreadDecision = one_process
) -> int:
    """Run body(params) holding the workspace, write its report with the wall time, and turn user errors into
    one clean line, an error record and exit 2 (a candidate waiting for approval: its record and exit 3). The
    process's start, end and timed spans go to the run's journal (the goodput ledger reads them).

    threads(params): the stage's thread plan (fineflow.core.threads: its processes' share of the usable CPUs),
    applied before body imports torch and recorded in the report."""
    attempt = journal_attempt(stage, args.report)
    spans: dict[str, float] = {}
    code = 1  # an exception that escapes is a crash
    try:
        code = _run_entry(stage, args, body, spans, threads)
        return code
    finally:
        if attempt is not None:
            attempt.end_quietly(code, spans)


def _run_entry(
    stage: str, args: argparse.Namespace, body: Callable[[Params], dict], spans: dict, decide: ThreadDecision
) -> int:
    started = time.perf_counter()
    try:
        with workspace_turn(stage):
            spans["workspace_wait"] = time.perf_counter() - started  # a queued experiment waits for its turn
            if not is_train_worker():  # a rank leaves it to its launcher: another rank may have written it already
                clear_error_record(args.report)
            params = load_params(args.params)
            check_pipeline_inputs(params)
            apply_offline_environment(model_base=params.model.base)  # before any HF library is imported
            threads = decide(params)
            apply_threads(threads)
            body_started = time.perf_counter()
            try:
                report = body(params)
            finally:
                spans["body"] = time.perf_counter() - body_started
                spans["params"] = body_started - started - spans["workspace_wait"]
    except WorkspaceBusy as exc:  # another run's workspace: its reports and records are not this process's
        workspace_busy(stage, exc)
        spans["discard"] = 1.0  # nor is this attempt part of the holder's ledger
        return USER_ERROR_EXIT
    except ApprovalNeeded as exc:  # before FineflowError: not a user error, the run waits for a person
        print(f"fineflow {stage}: waiting for approval: {exc}", file=sys.stderr, flush=True)
        write_approval_request(args.report, stage, str(exc), exc.evidence)
        return APPROVAL_NEEDED_EXIT
    except FineflowError as exc:
        user_error(stage, args.report, exc)
        return USER_ERROR_EXIT
    except StoppedAndSaved as stopped:  # a signal, the work saved: one line, the record a re-run resumes from
        write_preempted_record(args.report, stage, stopped.step, stopped.signum)
        log(f"{stage}: {stopped}; run again to resume (exit {PREEMPTED_EXIT})")
        return PREEMPTED_EXIT
    written = time.perf_counter()
    if report is not None:
        wall_s = round(time.perf_counter() - started, 3)
        report = {"stage": stage, **report, "threads": threads.as_record(), "wall_s": wall_s}
        write_json_atomic(args.report, report)
        write_metrics(args.report, stage, report)  # the few figures `dvc metrics diff` shows (fineflow.core.metrics)
        log(f"{stage}: report written to {args.report}")
    spans["report"] = time.perf_counter() - written
    return 0
