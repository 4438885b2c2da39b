"""``fineflow ci``: the CI retraining job as one command (fineflow.ci)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    from fineflow import ci

    p = sub.add_parser(
        "ci",
        help="the CI retraining job: pull, the pipeline and its gate, push, a summary",
        description=ci.__doc__.split("\n\nExit codes")[0],
        epilog="Exit codes: 0 promoted, up to date, or refused; 4 refused with --fail-on-refusal; 3 the candidate "
        "waits for approval; 2 bad params or input; 1 a crash.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--fail-on-refusal", action="store_true", help=f"exit {ci.REFUSED_EXIT} when the gate refuses")
    p.add_argument(
        "--commit",
        action="store_true",
        help="commit dvc.lock and reports/metrics when they changed ([skip ci]) and push them to the job's branch",
    )
    p.add_argument(
        "--base-ref",
        help="compare metrics against this git revision (default: the PR's base branch, "
        "else the commit the job started from)",
    )
    p.add_argument(
        "--summary",
        type=Path,
        help="the summary's file when $GITHUB_STEP_SUMMARY is not set (default: reports/ci-summary.md)",
    )
    p.add_argument("--project", type=Path, default=Path("."), help="the project (default: .)")
    p.set_defaults(run=_run_ci)


def _run_ci(args) -> int:
    from fineflow import ci

    options = ci.Options(args.project, args.fail_on_refusal, args.commit, args.base_ref, args.summary)
    return ci.run_ci(options).exit_code
