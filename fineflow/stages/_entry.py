"""What every stage entry does around its ``run``: environment, params, reports, and clean errors."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from fineflow.config import Params, load_params
from fineflow.errors import USER_ERROR_EXIT, FineflowError
from fineflow.reports import clear_error_record, write_error_record, write_json_atomic
from fineflow.runtime import apply_offline_environment, is_train_worker


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


def run_entry(stage: str, args: argparse.Namespace, body: Callable[[Params], dict]) -> int:
    """Run body(params), write its report with the wall time, and turn user errors into one clean line, an
    error record and exit 2."""
    apply_offline_environment()
    started = time.perf_counter()
    if not is_train_worker():  # a rank leaves it to its launcher: another rank may have written it already
        clear_error_record(args.report)
    try:
        params = load_params(args.params)
        report = body(params)
    except FineflowError as exc:
        user_error(stage, args.report, exc)
        return USER_ERROR_EXIT
    if report is not None:
        report = {"stage": stage, **report, "wall_s": round(time.perf_counter() - started, 3)}
        write_json_atomic(args.report, report)
        log(f"{stage}: report written to {args.report}")
    return 0
