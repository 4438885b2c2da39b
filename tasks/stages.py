"""The one Prefect task every stage uses: ``dvc repro --single-item <stage>``, logs streamed, report published.

Running the stage through DVC (rather than calling its Python entry directly) is what makes a flow run and
a plain ``dvc repro`` leave the same ``dvc.lock``, and what skips a stage whose code, params and inputs are
unchanged. The stage's own entry (``fineflow.stages.<stage>``) is the command DVC runs.

Stopping: `dvc repro` runs in a process group of its own. When the flow is interrupted (Ctrl-C:
KeyboardInterrupt; SIGTERM: Prefect's TerminationSignal) while a stage runs, that group gets SIGINT (DVC waits
for its stage command, which stops: the train stage saves its step), is killed if it is still there a few
seconds after the train grace, and the interruption goes on up: the run ends Crashed, never retried. A stage
stopped on its own (its node preempted) exits 75 with a record: retried, it resumes from the saved step.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from fineflow.core.config import CheckpointSettings, load_params
from fineflow.core.errors import PREEMPTED_EXIT, USER_ERROR_EXIT, FineflowError
from fineflow.core.reports import gate_evidence_table, read_approval_request, read_error_record
from fineflow.dvc_rwlock import repair_rwlock
from fineflow.registry.approval import APPROVAL_ENV
from fineflow.remote import dvc_environment
from fineflow.train import preempt
from fineflow.train.plots import TRAIN_CHARTS

# The lines of a failed stage's output that its message keeps: errors, and DVC's "is busy, it is being blocked
# by: (PID …) <command>" that names the process holding the workspace.
_SALIENT = re.compile(r"error|busy|blocked by|\(PID \d+\)", re.IGNORECASE)
# A tqdm redraw ("Map:  40%|████      | 2/5 [00:01<00:01, ...]"); Popen's text mode splits at its \r. Only the
# finished bar (100%) reaches the log.
_PROGRESS_REDRAW = re.compile(r"(?<!100)%\|[^|]*\|\s*\d+/\d+")


def is_progress_redraw(line: str) -> bool:
    return bool(_PROGRESS_REDRAW.search(line))


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
    command = [sys.executable, "-m", "dvc", "repro", "--single-item", stage]
    repaired = repair_rwlock(project_dir)  # a dvc process killed mid-write would fail every stage from now on
    if repaired:
        log(f"fineflow: {repaired}")
    tail: deque[str] = deque(maxlen=60)
    ran = False  # seen DVC's "Running stage" line (a chatty stage pushes it out of the tail)
    with (
        subprocess.Popen(
            command,
            cwd=project_dir,
            env={**dvc_environment(), **(extra_env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # a terminal's Ctrl-C reaches it only through StopStage, once
        ) as proc,
        preempt.StopStage(proc.pid) as stop,
    ):
        try:
            for line in proc.stdout:
                if stop.signum is not None:  # the flow was stopped but the exception got lost above the handler
                    raise KeyboardInterrupt(f"stopped by {preempt.signal_name(stop.signum)}")
                line = line.rstrip()
                if line and not is_progress_redraw(line):
                    tail.append(line)
                    ran = ran or line.startswith(f"Running stage '{stage}'")
                    log(line)
            if stop.signum is not None:  # the stage ended on the stop before the lost exception could be raised
                raise KeyboardInterrupt(f"stopped by {preempt.signal_name(stop.signum)}")
        except BaseException:  # KeyboardInterrupt, Prefect's TerminationSignal, anything: no stage outlives it
            stop_stage(proc, stage, project_dir, log, sent=stop.signum is not None)
            raise
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


def report_table(report: dict) -> list[dict]:
    """A stage report as rows of (figure, value): nested sections flattened to dotted names, each value whole
    (lists and mappings below the first level as compact JSON)."""
    rows = []
    for key, value in sorted(report.items()):
        if isinstance(value, dict) and value:  # a section (train's "plan"): one row per field
            rows += [{"figure": f"{key}.{inner}", "value": _cell(v)} for inner, v in sorted(value.items())]
        else:
            rows.append({"figure": key, "value": _cell(value)})
    return rows


def _cell(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)


def promotion_markdown(report: dict, project: Path) -> str:
    """The gate's decision with its evidence, for the promotion artifact."""
    card = project / "models" / "champion" / "README.md"
    lines = [
        f"### Promotion: **{report.get('decision', '?')}**",
        "",
        str(report.get("reason", "")),
        "",
        *gate_evidence_table(report),
        f"| model card | [{card}]({card.as_uri()}) |",
    ]
    return "\n".join(lines)


def ledger_table(ledger: dict) -> list[dict]:
    """The goodput ledger as table rows: every bucket's seconds, share and cost, largest first, then the totals."""
    from fineflow.goodput.ledger import DESCRIPTIONS

    total = ledger.get("total_s") or 1.0
    bucket_usd = (ledger.get("cost") or {}).get("bucket_usd") or {}
    rows = [
        {
            "bucket": name,
            "seconds": round(seconds, 2),
            "share": f"{seconds / total:.1%}",
            "usd": round(bucket_usd.get(name, 0.0), 5),
            "what": DESCRIPTIONS.get(name, ""),
        }
        for name, seconds in sorted(ledger.get("buckets", {}).items(), key=lambda item: -item[1])
    ]
    rows.append(
        {
            "bucket": "unaccounted",
            "seconds": ledger.get("unaccounted_s"),
            "share": f"{ledger.get('unaccounted_share', 0):.2%}",
            "usd": None,
            "what": "inside stage processes, timed by no bucket",
        }
    )
    rows.append(
        {
            "bucket": "total",
            "seconds": ledger.get("total_s"),
            "share": f"goodput {ledger.get('goodput', 0):.1%}",
            "usd": (ledger.get("cost") or {}).get("run_usd"),
            "what": "the run, from its start to this ledger",
        }
    )
    return rows


def ledger_markdown(ledger: dict, plots_dir: Path) -> str:
    """The doctor's findings and the stacked-bar chart, for the run page."""
    from fineflow.goodput import doctor

    lines = [f"### {doctor.one_line(ledger)}", ""]
    for finding in ledger.get("findings") or []:
        fix = finding["fix"]
        lines.append(
            f"- **{finding['severity']} {finding['cause']}** ({finding['share_of_run']:.0%} of the run, "
            f"${finding['usd']:.4f}): {finding['evidence']}. Fix: `{fix['param']}`"
            + (f" = `{fix['value']}`" if fix["value"] is not None else "")
            + f" ({fix['why']})"
        )
    if not ledger.get("findings"):
        lines.append("The doctor found nothing.")
    chart = plots_dir / "goodput.png"
    if chart.is_file():
        data = base64.b64encode(chart.read_bytes()).decode("ascii")
        lines += ["", f"![goodput buckets](data:image/png;base64,{data})", f"[{chart.name}]({chart.as_uri()})"]
    return "\n".join(lines)


def publish_report(stage: str, project: Path, report: dict, ran: bool) -> None:
    """reports/<stage>.json as a table artifact (and promote's decision as markdown): the run page's figures."""
    if stage == "goodput" and report.get("buckets"):  # the ledger: its buckets as the table, findings and chart
        create_table_artifact(
            key="fineflow-goodput-ledger",
            table=ledger_table(report),
            description="where this run's wall time and money went (reports/goodput.json)",
        )
        create_markdown_artifact(
            key="fineflow-goodput-doctor",
            markdown=ledger_markdown(report, project / "reports" / "plots"),
            description="fineflow doctor on this run",
        )
        return
    create_table_artifact(
        key=f"fineflow-{stage}",
        table=report_table(report),
        description=f"reports/{stage}.json after the {stage} stage" + ("" if ran else " (unchanged, skipped by DVC)"),
    )
    if stage == "promote" and report.get("decision"):
        create_markdown_artifact(
            key="fineflow-promotion", markdown=promotion_markdown(report, project), description="the promotion gate"
        )
    if stage == "train" and ran:  # only then: the charts are read and base64-encoded, once per training
        charts = charts_markdown(project / "reports" / "plots")
        if charts:
            create_markdown_artifact(key="fineflow-train-charts", markdown=charts, description="the run's charts")


def charts_markdown(plots_dir: Path) -> str | None:
    """The train stage's PNG charts (fineflow.train.plots) embedded in markdown, so the run page shows them
    without reaching the worker's disk, each with a link to its file."""
    charts = [plots_dir / name for name in TRAIN_CHARTS if (plots_dir / name).is_file()]
    if not charts:
        return None
    lines = ["### Training charts", ""]
    for chart in charts:
        data = base64.b64encode(chart.read_bytes()).decode("ascii")
        lines += [f"![{chart.stem}](data:image/png;base64,{data})", "", f"[{chart.name}]({chart.as_uri()})", ""]
    return "\n".join(lines)


# The train stage's progress line when its output is not a terminal (fineflow.train.loop.Progress)
_TRAIN_STEP = re.compile(r"step (\d+)/(\d+) loss \S+ ([\d,.]+) tok/s.*ETA (\d+)s")


class TrainingProgress:
    """A progress artifact on the run page while training runs: step of total, tokens/s, ETA, from the stage's
    own progress lines. Updated at most every `every_s` seconds; an API error never stalls the stage's output."""

    def __init__(self, stage: str, every_s: float = 5.0):
        self.stage, self.every_s = stage, every_s
        self.artifact_id = None
        self.updated = float("-inf")

    def see(self, line: str) -> None:
        match = _TRAIN_STEP.search(line)
        if match is None:
            return
        step, total, tokens_per_s, eta = match.groups()
        finished = step == total
        if not finished and time.monotonic() - self.updated < self.every_s:
            return
        self.updated = time.monotonic()
        percent = 100.0 * int(step) / max(1, int(total))
        description = f"{self.stage}: step {step}/{total}, {tokens_per_s} tokens/s, ETA {eta} s"
        with contextlib.suppress(Exception):
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(
                    progress=percent, key=f"fineflow-{self.stage}-progress", description=description
                )
            else:
                update_progress_artifact(self.artifact_id, progress=percent, description=description)


def publish_failure(stage: str, exc: BaseException) -> None:
    """A failed stage's error on the run page (the task's state message holds it too, cut to one line)."""
    with contextlib.suppress(Exception):  # a dead API must not replace the stage's own error
        create_markdown_artifact(
            key=f"fineflow-{stage}-failed",
            markdown=f"### fineflow {stage} failed\n\n```\n{exc}\n```",
            description=f"the {stage} stage's error",
        )


def _retry_unless_user_error(task, task_run, state) -> bool:
    try:
        state.result()
    except StageFailed as exc:
        return exc.returncode != USER_ERROR_EXIT
    except Exception:
        return True
    return False


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
