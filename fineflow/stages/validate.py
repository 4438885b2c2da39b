"""Stage validate: the great-expectations gate over the raw train and eval rows.

    python -m fineflow.stages.validate --train data/raw/train.jsonl --eval data/raw/eval.jsonl \
        --out data/validated

Writes ``<out>/train.jsonl`` and ``<out>/eval.jsonl`` (kept rows, normalized), ``<out>/quarantine.jsonl``
(every rejected row with its reasons) and the report. The report and the quarantine are written even when
the gate fails, so a failed run can be inspected; then the stage exits non-zero with the reason.
"""

from __future__ import annotations

from pathlib import Path

from fineflow.config import Params
from fineflow.stages._entry import log, run_stage, stage_parser
from fineflow.errors import DataError
from fineflow.reports import write_json_atomic, write_jsonl
from fineflow.validation import clean_record, gate, quarantine_record, read_jsonl, validate_rows


def run(params: Params, train_path: Path, eval_path: Path, out_dir: Path, report_path: Path) -> dict:
    cfg = params.validate_
    outcomes = {split: validate_rows(read_jsonl(path), str(path), cfg)
                for split, path in (("train", train_path), ("eval", eval_path))}
    for split, outcome in outcomes.items():
        write_jsonl(out_dir / f"{split}.jsonl", (clean_record(row) for row in outcome.kept))
        log(f"{split}: {outcome.rows_in} rows in, {len(outcome.kept)} kept, "
            f"{len(outcome.quarantined)} quarantined")
    write_jsonl(out_dir / "quarantine.jsonl",
                 (quarantine_record(row, split) for split, o in outcomes.items() for row in o.quarantined))
    train = outcomes["train"]
    report = {**train.report(), "eval": outcomes["eval"].report(), "passed": True}
    try:
        for outcome in outcomes.values():
            gate(outcome, cfg)
    except DataError:
        write_json_atomic(report_path, {"stage": "validate", **report, "passed": False})
        raise
    return report


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser("validate", __doc__)
    parser.add_argument("--train", type=Path, required=True)
    parser.add_argument("--eval", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    return run_stage("validate", args, lambda p: run(p, args.train, args.eval, args.out, Path(args.report)))


if __name__ == "__main__":
    raise SystemExit(main())
