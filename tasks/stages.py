"""The one Prefect task every stage uses: ``dvc repro --single-item <stage>``, logs streamed, report published.

Running the stage through DVC (rather than calling its Python entry directly) is what makes a flow run and
a plain ``dvc repro`` leave the same ``dvc.lock``, and what skips a stage whose code, params and inputs are
unchanged. The stage's own entry (``fineflow.stages.<stage>``) is the command DVC runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from fineflow.errors import USER_ERROR_EXIT
from fineflow.reports import read_error_record


class StageFailed(RuntimeError):
    """returncode: USER_ERROR_EXIT when the stage recorded a user error (never retried), else what failed.
    The message: the stage's own (whole) for a user error, else the error lines of its output's tail."""

    def __init__(self, stage: str, returncode: int, tail: list[str], user_error: dict | None = None):
        self.returncode = USER_ERROR_EXIT if user_error else returncode
        if user_error:
            super().__init__(f"stage {stage} failed (a user error, not retried): {user_error['message']}")
        else:
            lines = [line for line in tail if "error" in line.lower()] or tail
            super().__init__(f"stage {stage} failed (exit {returncode}):\n" + "\n".join(lines[-15:]))


def stage_environment() -> dict[str, str]:
    """The venv's bin first on PATH, so dvc.yaml's ``python`` is this interpreter."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PYTHONUNBUFFERED": "1"}


def repro_single(stage: str, project_dir: Path, log) -> bool:
    """Run the stage through DVC, streaming every output line to log; raise StageFailed on failure.

    Returns whether the stage's command ran (False when DVC found it unchanged and skipped it)."""
    command = [sys.executable, "-m", "dvc", "repro", "--single-item", stage]
    tail: deque[str] = deque(maxlen=60)
    ran = False  # seen DVC's "Running stage" line (a chatty stage pushes it out of the tail)
    with subprocess.Popen(
        command,
        cwd=project_dir,
        env=stage_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    ) as proc:
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                tail.append(line)
                ran = ran or line.startswith(f"Running stage '{stage}'")
                log(line)
    if proc.returncode:
        # `dvc repro` exits 255 for any failed stage command: the stage's error record says which kind it was
        record = read_error_record(Path(project_dir) / "reports" / f"{stage}.json")
        raise StageFailed(stage, proc.returncode, list(tail), record)
    return ran


def _report_markdown(stage: str, report: dict) -> str:
    rows = [f"| {key} | {json.dumps(value)[:200]} |" for key, value in sorted(report.items())]
    return f"### fineflow {stage}\n\n| figure | value |\n|---|---|\n" + "\n".join(rows)


def _retry_unless_user_error(task, task_run, state) -> bool:
    try:
        state.result()
    except StageFailed as exc:
        return exc.returncode != USER_ERROR_EXIT
    except Exception:
        return True
    return False


@task(task_run_name="{stage}", retry_condition_fn=_retry_unless_user_error)
def run_stage(stage: str, project_dir: str = ".") -> dict:
    """Reproduce one stage (skipped by DVC when unchanged) and publish reports/<stage>.json as an artifact.

    Returns {"stage", "ran", "report"}: ran is False when DVC skipped the unchanged stage."""
    logger = get_run_logger()
    project = Path(project_dir).resolve()
    ran = repro_single(stage, project, logger.info)
    report_path = project / "reports" / f"{stage}.json"
    report = json.loads(report_path.read_text(encoding="utf-8")) if report_path.exists() else {}
    create_markdown_artifact(
        key=f"fineflow-{stage}",
        markdown=_report_markdown(stage, report),
        description=f"reports/{stage}.json after the {stage} stage" + ("" if ran else " (unchanged, skipped by DVC)"),
    )
    return {"stage": stage, "ran": ran, "report": report}
