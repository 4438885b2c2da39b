"""The fineflow Prefect flow: the stages of ``dvc.yaml``, in the order that file lists them.

    python -m flows.pipeline            # one run now (what `make run` does)
    python -m flows.deploy              # serve it on a schedule (see flows/deploy.py)

Each stage is one task that runs ``dvc repro --single-item <stage>``; unchanged stages are skipped by DVC.
A run holds the workspace (a second one waits), pulls from and pushes to the project's default DVC remote when
it has one, and is named after its commit, its edits, its start and what it re-ran or where it failed (tasks/runs.py).
With promote.require_approval, the run pauses at promote for a person's answer (tasks/approval_pause.py).
Retries: train is retried (a transient crash, or a stop of the stage alone after it saved its step: the retry
resumes); bad input or params are never retried.

Exit codes, as every entry's (docs/): 0 done; 2 a user error (bad params, a missing input path, bad data: every
FineflowError), one message at the end of stderr and no traceback, Prefect's logs included; 1 a crash (its
traceback); 130 / 143 stopped by Ctrl-C / SIGTERM. The params and every input path they name are checked before
the flow starts (fineflow.core.preflight), and again by the flow before its first stage (a deployment's run, its
overrides applied and the remote pulled).

Ctrl-C and SIGTERM: ``python -m flows.pipeline`` is a small supervisor that runs the flow in a process of its
own session and forwards it the first SIGINT/SIGTERM (fineflow.process.preempt.supervise). A terminal's Ctrl-C
would otherwise also reach Prefect's temporary server, which then dies before the run is marked, and leaves the
client retrying into nothing for minutes. The flow stops its stage (the train stage saves its step), Prefect
marks the run Crashed, the server stops; the supervisor then kills anything left and exits 130 / 143.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prefect import flow

from fineflow.core import journal
from fineflow.core.dvc_project import stage_names, upstream_stages
from fineflow.core.preflight import preflight
from fineflow.errors import USER_ERROR_EXIT
from fineflow.process import preempt
from tasks import runs
from tasks.approval_pause import answered_task_name, ask_for_approval
from tasks.stages import is_stop, is_user_error, log_user_errors_without_tracebacks, preempt_grace_s, run_stage

FLOW_PROCESS_ENV = runs.SUPERVISED_ENV  # the supervisor's pid, in the flow process it starts
# where the flow process leaves its last word (a user error's message, what a stop saved) for its supervisor, which
# prints it last (after Prefect's temporary server has logged its stop at the flow process's exit)
LAST_LINE_FILE_ENV = "FINEFLOW_FLOW_LAST_LINE"

RETRIES = {"train": 2}  # a crashed train stage resumes from its last valid checkpoint


@flow(name="fineflow", log_prints=True, flow_run_name=runs.flow_run_name)
def fineflow_pipeline(project_dir: str = ".", overrides: dict[str, Any] | None = None) -> dict[str, dict]:
    """Run every stage of the project's dvc.yaml in order, one run at a time per workspace (a second run
    waits); returns {stage: {"stage", "ran", "report"}}. Each task waits for the stages whose outputs it
    depends on (dvc.yaml's graph), so the run graph draws the pipeline. overrides: dotted params.yaml keys
    ({"train.lr": 0.001}), validated at once and written into params.yaml as `dvc exp run -S` writes them."""
    from prefect.runtime import flow_run

    from fineflow.core.runtime import RUN_NAME_ENV, apply_offline_environment

    started = time.time()
    stage = "start"  # where the run is: a failed run's name says it
    log_user_errors_without_tracebacks()  # a failed stage's user error: its message, not our plumbing's traceback
    apply_offline_environment(project_dir)  # a worker's run starts here, not in run_flow: offline for its stages
    runs.reconcile_runs(project_dir)  # this run's tags; earlier runs whose process died: marked Crashed
    runs.claim_workspace(project_dir, owner=f"flow run {flow_run.name!r}")
    os.environ[RUN_NAME_ENV] = flow_run.name or ""  # its stages name their tracker runs after it
    # its stages' lines in the goodput journal are this run's, from its start (the wait for the workspace counts)
    os.environ.update(journal.run_environment(f"flow-{flow_run.id}", started))
    try:
        applied = runs.apply_overrides(project_dir, overrides or {})
        runs.pull_state(project_dir)
        preflight(Path(project_dir))  # the params as the stages will read them, and every input path they name
        upstream = upstream_stages(project_dir)
        results = {}
        for stage in stage_names(project_dir):
            task = run_stage.with_options(retries=RETRIES.get(stage, 0), retry_delay_seconds=5)
            upstream_results = [results[name] for name in upstream[stage]]
            result = task(stage, project_dir, wait_for=upstream_results)
            if result.get("approval_needed"):  # promote.require_approval: the run pauses for a person's answer
                approval = ask_for_approval(result["approval_needed"], project_dir)
                answered = task.with_options(task_run_name=answered_task_name(stage, approval))
                result = answered(stage, project_dir, approval=approval, wait_for=upstream_results)
            results[stage] = result
        stage = "push"
        runs.push_state(project_dir, wait_for=list(results.values()))
    except Exception:  # a failed run says where in its name (a stopped one keeps its start name: no API call
        runs.rename_run(f"{flow_run.name}: failed at {stage}")  # while its server may be stopping too)
        raise
    finally:
        for name in (RUN_NAME_ENV, journal.RUN_ID_ENV, journal.RUN_STARTED_ENV):
            os.environ.pop(name, None)
        runs.release_workspace(project_dir)
    ran = [stage for stage, result in results.items() if result["ran"]]
    name = f"{flow_run.name}" + (f" ({', '.join(applied)})" if applied else "")
    runs.rename_run(f"{name}: {', '.join(ran) if ran else 'nothing changed'}")
    return results


def main() -> int:
    project = Path(__file__).resolve().parent.parent
    if not os.environ.get(FLOW_PROCESS_ENV):
        return supervise_flow(project)
    return run_flow(project)


def supervise_flow(project: Path) -> int:
    """Run this module again as the flow process, in a session of its own (see the module docstring); its exit
    code, and a user error's message as the last line of stderr."""
    with tempfile.TemporaryDirectory(prefix="fineflow-flow-") as scratch:
        last_line = Path(scratch) / "last-line.txt"
        env = {**os.environ, FLOW_PROCESS_ENV: str(os.getpid()), LAST_LINE_FILE_ENV: str(last_line)}
        # a Prefect API call to a dead server fails within seconds (2 + 4) instead of retrying 5 times for a minute
        env.setdefault("PREFECT_CLIENT_MAX_RETRIES", "2")
        budget = preempt.budget_s(preempt_grace_s(project), "flow")
        code = preempt.supervise([sys.executable, "-m", "flows.pipeline", *sys.argv[1:]], env, budget)
        if code and last_line.is_file():
            print(last_line.read_text(encoding="utf-8"), file=sys.stderr, flush=True)
    return code


def say_last(line: str) -> None:
    """For the supervisor to print last (LAST_LINE_FILE_ENV); on stderr when no supervisor asked for it."""
    target = os.environ.get(LAST_LINE_FILE_ENV)
    if target:
        Path(target).write_text(line, encoding="utf-8")
    else:
        print(line, file=sys.stderr, flush=True)


def report_user_error(message: str) -> None:
    say_last(f"fineflow run: error: {message}")


def _interrupted(signum, frame):
    runs.exit_once_the_api_is_gone(128 + signum, str(Path(__file__).resolve().parent.parent))
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def run_flow(project: Path) -> int:
    from fineflow.core.runtime import apply_offline_environment

    apply_offline_environment(project)
    # SIGTERM outside Prefect's own handler (which it installs while the flow runs): an orderly stop as well,
    # so the temporary server is stopped at exit rather than left behind. SIGINT gets a handler of its own too:
    # asyncio swaps its own in for Python's default one (and cancels a coroutine instead of raising) whenever
    # a coroutine runs in this thread, and that stop could be lost
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGINT, _interrupted)
    # a SIGKILLed supervisor (OOM killer, kill -9) stops the flow too, in order
    preempt.die_with_parent(signal.SIGTERM, parent=int(os.environ[FLOW_PROCESS_ENV]))
    started = time.time()
    log_user_errors_without_tracebacks()  # from here: Prefect's own logs of a stop carry no traceback either
    try:
        preflight(project)  # a params mistake or a missing input: refused before a server starts or a stage runs
        results = fineflow_pipeline(str(project))
    except BaseException as exc:
        if is_stop(exc):  # Ctrl-C or SIGTERM: one line, what was saved and how to go on, and 130 / 143
            signum = getattr(exc, "signal", None) or _signal_of(exc)
            say_last(stopped_line(project, started, signum))
            return 128 + signum
        if not is_user_error(exc):
            raise  # a crash: its traceback, exit 1
        report_user_error(str(exc))
        return USER_ERROR_EXIT
    print_summary(results)
    return 0


def _signal_of(exc: BaseException) -> int:
    """The signal a KeyboardInterrupt stands for (_interrupted names it; a plain one is Ctrl-C's)."""
    return signal.SIGTERM if "SIGTERM" in str(exc) else signal.SIGINT


def stopped_line(project: Path, since: float, signum: int) -> str:
    """`fineflow run: stopped by SIGTERM: <stage> saved ...; run again to resume`, from the stage records a stopped
    stage left (reports/<stage>.error.json, kind preempted) during this run."""
    name = signal.Signals(signum).name
    saved = []
    for record_path in sorted((project / "reports").glob("*.error.json")):
        try:
            record = json.loads(record_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if record.get("kind") == "preempted" and record_path.stat().st_mtime >= since:
            saved.append(f"{record.get('stage')} saved step {record.get('step')}")
    what = "; ".join(saved) if saved else "no stage was mid-work (the finished stages are recorded in dvc.lock)"
    return f"fineflow run: stopped by {name}: {what}; run `make run` (or `dvc repro`) again to go on from there"


def print_summary(results: dict) -> None:
    """What ran, the scores, the decision, the exports and the ledger's one line: what `make run` ends with."""
    ran = [stage for stage, r in results.items() if r["ran"]]
    # a project's dvc.yaml may leave stages out
    evaluate, promote = (results.get(stage, {}).get("report", {}) for stage in ("evaluate", "promote"))
    print(f"stages run: {', '.join(ran) or 'none (everything up to date)'}")
    print(f"base {evaluate.get('base')} -> candidate {evaluate.get('candidate')}")
    print(f"promote: {promote.get('decision')} ({promote.get('reason')})")
    export = results.get("export", {}).get("report", {})
    if export.get("skipped"):
        print(f"export: nothing exported ({export['skipped']})")
    elif export:  # which GGUF files ship, and the one `fineflow serve` serves
        print(f"export: shippable {', '.join(export.get('shippable') or []) or 'none'}; served: {export.get('serve')}")
    ledger = results.get("goodput", {}).get("report", {})
    if ledger.get("buckets"):  # the last line: goodput, cost, the biggest badput (fineflow doctor for the rest)
        from fineflow.goodput.doctor import one_line

        print(one_line(ledger))


if __name__ == "__main__":
    sys.exit(main())
