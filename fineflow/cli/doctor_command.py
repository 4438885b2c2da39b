"""``fineflow doctor``: a run's bottlenecks from its goodput ledger (fineflow.goodput.doctor)."""

from __future__ import annotations

import json
from pathlib import Path

from fineflow.errors import FineflowError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="read a run's goodput ledger: what starved the devices, its share of time and money, the fix",
        description="Name the bottlenecks of a run from its ledger (reports/goodput.json, written by the goodput "
        "stage): the evidence, the share of the run's time and cost, and the param to change.",
        epilog="Exit codes: 0 nothing at or above --fail-on; 1 a finding at or above it; 2 no readable ledger.",
    )
    p.add_argument("report", nargs="?", type=Path, default=Path("reports/goodput.json"), help="the ledger")
    p.add_argument("--json", action="store_true", help="print the findings (and the ledger's figures) as JSON")
    p.add_argument("--fail-on", choices=("severe", "warn", "never"), default="severe", help="exit 1 at this severity")
    p.set_defaults(run=_run_doctor)


def _run_doctor(args) -> int:
    from fineflow.goodput import doctor

    try:
        ledger = json.loads(args.report.read_text(encoding="utf-8"))
        findings = doctor.diagnose(ledger)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FineflowError(
            f"no readable goodput ledger at {args.report} ({type(exc).__name__}: {exc}); it is written by the "
            f"goodput stage at the end of `make run` / `dvc repro`"
        ) from exc
    if args.json:
        keys = ("total_s", "goodput", "train_goodput", "mfu", "hfu", "buckets", "unaccounted_s", "cost")
        print(json.dumps({"findings": findings, **{key: ledger.get(key) for key in keys}}, indent=2))
    else:
        print(doctor.format_text(ledger, findings))
    worst = doctor.worst(findings)
    if args.fail_on == "never" or worst is None:
        return 0
    return 1 if doctor.SEVERITY_RANK[worst] >= doctor.SEVERITY_RANK[args.fail_on] else 0
