"""What every stage entry does around its ``run``: environment, params, reports, and clean errors."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from fineflow.config import Params, load_params
from fineflow.errors import FineflowError
from fineflow.reports import write_json_atomic
from fineflow.runtime import apply_offline_environment


def stage_parser(stage: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m fineflow.stages.{stage}", description=description)
    parser.add_argument("--params", default="params.yaml", help="parameters file (default: params.yaml)")
    parser.add_argument("--report", default=f"reports/{stage}.json", help="where to write the JSON report")
    return parser


def log(message: str) -> None:
    """Stage logs go to stdout, line-buffered, so Prefect streams them live."""
    print(message, flush=True)


def run_entry(stage: str, args: argparse.Namespace, body: Callable[[Params], dict]) -> int:
    """Run body(params), write its report with the wall time, and turn user errors into one clean line."""
    apply_offline_environment()
    started = time.perf_counter()
    try:
        params = load_params(args.params)
        report = body(params)
    except FineflowError as exc:
        print(f"fineflow {stage}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if report is not None:
        report = {"stage": stage, **report, "wall_s": round(time.perf_counter() - started, 3)}
        write_json_atomic(args.report, report)
        log(f"{stage}: report written to {args.report}")
    return 0
