"""Stage validate: the great-expectations gate over the raw train and eval rows.

Reads JSONL, CSV or Parquet (``data.format``), renamed to instruction/input/output by ``data.mapping``.

    python -m fineflow.stages.validate --train data/raw/train.jsonl --eval data/raw/eval.jsonl \
        --out data/validated

Writes ``<out>/train.jsonl`` and ``<out>/eval.jsonl`` (kept rows, normalized), ``<out>/quarantine.jsonl``
(every rejected row with its reasons), ``<out>/redactions.jsonl`` (with ``validate.pii: redact``: which
row had which PII kinds replaced), the report, and GX Data Docs HTML under ``reports/data_docs/<split>/``
(its CSS/JS load from CDNs). Train rows are checked for leakage against the eval rows. The report and the
quarantine are written even when the gate fails, so a failed run can be inspected; then the stage exits
non-zero with the reason.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fineflow.config import Params
from fineflow.data.validation import TokenView, clean_record, quarantine_record, raise_if_blocked, validate_splits
from fineflow.errors import DataError
from fineflow.reports import write_json_atomic, write_jsonl
from fineflow.stages._entry import log, run_entry, stage_parser


def run(
    params: Params,
    train_path: Path,
    eval_path: Path,
    out_dir: Path,
    report_path: Path,
    docs_dir: Path | None = None,
    base_dir: Path | None = None,
) -> dict:
    cfg = params.validate_
    tokens = None
    if base_dir is not None:  # token-level checks see rows exactly as the tokenize stage will
        from fineflow.model_ref import resolve_base_model
        from fineflow.tokenize.tokenization import load_tokenizer

        tokens = TokenView(load_tokenizer(resolve_base_model(params.model, base_dir)), params.tokenize.seq_len)
    if docs_dir is not None:
        shutil.rmtree(docs_dir, ignore_errors=True)  # one run's docs, not an accumulation of old ones
    outcomes = validate_splits({"eval": eval_path, "train": train_path}, params.data, cfg, tokens, docs_dir)
    for split, outcome in outcomes.items():
        write_jsonl(out_dir / f"{split}.jsonl", (clean_record(row) for row in outcome.kept))
        log(
            f"{split}: {outcome.rows_in} rows in, {len(outcome.kept)} kept, "
            f"{len(outcome.quarantined)} quarantined, {sum(1 for r in outcome.kept if r.warnings)} kept with warnings"
        )
    write_jsonl(
        out_dir / "quarantine.jsonl",
        (quarantine_record(row, split) for split, o in outcomes.items() for row in o.quarantined),
    )
    # pii: redact keeps the rows; every replacement is logged (line and kinds, never the value)
    write_jsonl(
        out_dir / "redactions.jsonl",
        (
            {"split": split, "line": row.line, "kinds": row.redacted}
            for split, o in outcomes.items()
            for row in o.kept
            if row.redacted
        ),
    )
    train = outcomes["train"]
    report = {**train.report(), "eval": outcomes["eval"].report(), "passed": True}
    try:
        for outcome in outcomes.values():
            raise_if_blocked(outcome, cfg)
    except DataError:
        write_json_atomic(report_path, {"stage": "validate", **report, "passed": False})
        raise
    return report


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser("validate", __doc__)
    parser.add_argument("--train", type=Path, required=True)
    parser.add_argument("--eval", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--base-dir",
        type=Path,
        default=None,
        help="base model dir; enables the token-level checks (truncation, label coverage)",
    )
    parser.add_argument(
        "--data-docs",
        type=Path,
        default=Path("reports/data_docs"),
        help="where GX renders its Data Docs HTML (one site per split)",
    )
    args = parser.parse_args(argv)
    return run_entry(
        "validate",
        args,
        lambda p: run(p, args.train, args.eval, args.out, Path(args.report), args.data_docs, args.base_dir),
    )


if __name__ == "__main__":
    raise SystemExit(main())
