"""Serve the fineflow flow on a schedule (a long-running process; Ctrl-C stops it).

    python -m flows.deploy                          # nightly at 02:00, see the Prefect UI
    python -m flows.deploy --cron "0 */6 * * *"     # every six hours

For a work pool (Kubernetes, Slurm via a process worker, ...) use the same flow with
``fineflow_pipeline.from_source(<repo>, "flows/pipeline.py:fineflow_pipeline").deploy(work_pool_name=...)``;
the README shows both.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flows.pipeline import fineflow_pipeline


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__)
    parser.add_argument("--name", default="fineflow-nightly")
    parser.add_argument("--cron", default="0 2 * * *", help="schedule (cron syntax, server time zone)")
    args = parser.parse_args(argv)
    from fineflow.runtime import apply_offline_environment

    project = Path(__file__).resolve().parent.parent
    apply_offline_environment(project)
    fineflow_pipeline.serve(name=args.name, cron=args.cron, parameters={"project_dir": str(project)})


if __name__ == "__main__":
    main()
