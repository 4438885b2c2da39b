"""Serve the fineflow flow on a schedule (a long-running process; Ctrl-C stops it).

    python -m flows.deploy                                        # nightly at 02:00 UTC
    python -m flows.deploy --cron "0 */6 * * *"                   # every six hours
    python -m flows.deploy --cron "0 2 * * *" --timezone Europe/Berlin
    make serve CRON="0 */6 * * *" TIMEZONE=America/New_York       # the same through make

The schedule's time zone is explicit (default UTC, whatever the server's or the machine's). Runs appear in the
UI of the server PREFECT_API_URL names (``prefect server start --port 4300``, then
``PREFECT_API_URL=http://127.0.0.1:4300/api``); without it, in a temporary local server's.

Bad params or a missing input path refuse to serve at once (exit 2, the message): every scheduled run would fail
on them. Each run checks them again before its first stage (flows/pipeline.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from fineflow.core.preflight import preflight
from fineflow.errors import USER_ERROR_EXIT, FineflowError
from flows.pipeline import fineflow_pipeline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__)
    parser.add_argument("--name", default="fineflow-nightly")
    parser.add_argument("--cron", default="0 2 * * *", help="schedule, cron syntax (default: %(default)s)")
    parser.add_argument("--timezone", default="UTC", help="the cron's IANA time zone (default: %(default)s)")
    args = parser.parse_args(argv)
    from prefect.schedules import Cron

    from fineflow.core.runtime import apply_offline_environment

    project = Path(__file__).resolve().parent.parent
    try:
        preflight(project)
    except FineflowError as exc:
        print(f"fineflow serve: error: {exc}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    apply_offline_environment(project)
    if os.environ.get("PREFECT_API_URL"):  # a server that outlives this process: it marks a run that died Crashed
        from flows.automations import ensure_crash_automation

        print(ensure_crash_automation(), flush=True)
    fineflow_pipeline.serve(
        name=args.name,
        schedules=[Cron(args.cron, timezone=args.timezone)],
        parameters={"project_dir": str(project)},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
