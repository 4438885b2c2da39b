"""Stage goodput: the run's ledger, where its wall time and money went (fineflow.goodput.ledger).

    python -m fineflow.stages.goodput --journal reports/ledger --train-report reports/train.json \
        --steps-log reports/train_steps.jsonl --plots reports/plots

The last stage of dvc.yaml, always run: it reads the journal every stage process of this run (and of a run
that crashed before this point) wrote, and writes ``reports/goodput.json`` (its report): the buckets, goodput,
MFU/HFU, the cost per run / per 1M tokens / per bucket, the doctor's findings (fineflow.goodput.doctor). A run
with no train attempt (a promote-only run) keeps the last training's goodput, MFU and cost per 1M tokens in its
metrics (``carried_forward`` in the report says so) and no goodput point in the history plot: its own goodput, 0,
is no drop. It adds the run to ``reports/plots/goodput_history.json`` (DVC plots over runs) and draws
``reports/plots/goodput.png``.
It writes no DVC output: the lock stays a function of the inputs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from fineflow.core.entry import log, run_entry, stage_parser
from fineflow.core.journal import read, run_identity
from fineflow.core.metrics import metrics_path
from fineflow.core.reports import read_json
from fineflow.goodput import chart, cost, doctor, ledger


def parse_args(argv: list[str]):
    parser = stage_parser("goodput", __doc__)
    parser.add_argument("--journal", type=Path, required=True, help="the run's journal folder (reports/ledger)")
    parser.add_argument("--train-report", type=Path, required=True)
    parser.add_argument("--steps-log", type=Path, required=True)
    parser.add_argument("--plots", type=Path, required=True, help="history plot data and the stacked-bar PNG")
    return parser.parse_args(argv)


def previous_metrics(report_path: Path) -> dict:
    """The metrics the last goodput stage left (reports/metrics/goodput.json), {} when there are none."""
    try:
        return read_json(metrics_path(report_path, "goodput"))
    except (OSError, ValueError):
        return {}


def build_ledger(params, journal_dir: Path, train_report_path: Path, steps_log: Path) -> dict:
    """The ledger of the journal's window, with its cost, MFU/HFU and the doctor's findings."""
    run, _ = run_identity()
    now = time.time()
    try:
        train_report = read_json(train_report_path)
    except (OSError, ValueError):
        train_report = None
    result = ledger.build(read(journal_dir), journal_dir, run, now, train_report, steps_log)
    trained = ledger.trained_in_window(train_report, result)
    device = (train_report or {}).get("device") or {"type": "cpu", "name": "cpu", "count": 1}
    price, source = cost.price_per_device_hour(params.cost, device)
    # the model's tokens, those a crashed attempt trained and the resume kept included
    tokens = train_report.get("tokens") if trained else None
    # GPUs are priced each; ranks on a CPU share a machine, priced whole (cost.prices["cpu"])
    devices = int(device.get("count") or 1) if device.get("type") == "cuda" else params.train.num_machines
    result["cost"] = cost.run_cost(result, price, source, devices, tokens)
    result["trained"] = trained
    result["train"] = ledger.train_facts(train_report) if trained else None
    flops = (train_report or {}).get("flops") or {}
    result["mfu"], result["hfu"] = (flops.get("mfu"), flops.get("hfu")) if trained else (None, None)
    result["ended_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    result["run"] = run
    result["settings"] = {  # what the doctor's fixes start from
        "train.prefetch": params.train.prefetch,
        "train.grad_accum": params.train.grad_accum,
        "checkpoint.mode": params.checkpoint.mode,
        "checkpoint.every_steps": params.checkpoint.every_steps,
        "tokenize.workers": params.tokenize.workers,
    }
    result["findings"] = doctor.diagnose(result)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)

    def body(params):
        result = build_ledger(params, args.journal, args.train_report, args.steps_log)
        if not ledger.train_ran(result):
            result["carried_forward"] = ledger.carry_forward(result, previous_metrics(Path(args.report)))
            log(f"goodput: {result['carried_forward']['reason']}")
        # a run that trained nothing has no goodput point in the over-runs plot (a null: vega-lite skips it)
        history = {**result, "goodput": None} if "carried_forward" in result else result
        rows = chart.append_history(history, args.plots)
        try:
            chart.stacked_bar(rows, args.plots / "goodput.png")
        except Exception as exc:  # noqa: BLE001 - the ledger is written either way: the chart is extra
            log(f"goodput: warning: {args.plots / 'goodput.png'} was not drawn: {type(exc).__name__}: {exc}")
        ledger.consume(args.journal, result["run"])
        log(doctor.one_line(result))
        return result

    return run_entry("goodput", args, body)


if __name__ == "__main__":
    raise SystemExit(main())
