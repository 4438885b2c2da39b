"""Serve the fineflow flow on a schedule (a long-running process; Ctrl-C stops it).

    python -m flows.deploy                                        # nightly at 02:00 UTC
    python -m flows.deploy --cron "0 */6 * * *"                   # every six hours
    python -m flows.deploy --cron "0 2 * * *" --timezone Europe/Berlin
    make serve CRON="0 */6 * * *" TIMEZONE=America/New_York       # the same through make

The schedule's time zone is explicit (default UTC, whatever the server's or the machine's). Runs appear in the
UI of the server PREFECT_API_URL names (``prefect server start --port 4300``, then
``PREFECT_API_URL=http://127.0.0.1:4300/api``); without it, in a temporary local server's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flows.pipeline import fineflow_pipeline


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__)
    parser.add_argument("--name", default="fineflow-nightly")
    parser.add_argument("--cron", default="0 2 * * *", help="schedule, cron syntax (default: %(default)s)")
    parser.add_argument("--timezone", default="UTC", help="the cron's IANA time zone (default: %(default)s)")
    args = parser.parse_args(argv)
    from prefect.schedules import Cron

    from fineflow.core.runtime import apply_offline_environment

    project = Path(__file__).resolve().parent.parent
    apply_offline_environment(project)
    fineflow_pipeline.serve(
        name=args.name,
        schedules=[Cron(args.cron, timezone=args.timezone)],
        parameters={"project_dir": str(project)},
    )


if __name__ == "__main__":
    main()
