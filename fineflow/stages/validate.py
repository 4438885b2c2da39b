"""Stage validate: the great-expectations gate over the raw train and eval rows.

Reads JSONL, CSV or Parquet (``data.format``), renamed to instruction/input/output by ``data.mapping``.

    python -m fineflow.stages.validate --train data/raw/train.jsonl --eval data/raw/eval.jsonl \
        --out data/validated

Writes ``<out>/train.jsonl`` and ``<out>/eval.jsonl`` (kept rows, normalized), ``<out>/quarantine.jsonl``
(every rejected row: its line, reasons, sha256 and a short preview with PII replaced by placeholders — never
the row itself), ``<out>/redactions.jsonl`` (with ``validate.pii: redact``: which row had which PII kinds
replaced), the report, and GX Data Docs HTML under ``reports/data_docs/<split>/`` (counts, no row values; its
CSS/JS load from CDNs). Rows stream through in chunks, each written as soon as it is checked, so memory does
not grow with the file. Train rows are checked for leakage against the eval rows. The report and the
quarantine are written even when the gate fails, so a failed run can be inspected; then the stage exits
non-zero with the reason.
"""

from __future__ import annotations

import json
import shutil
from contextlib import ExitStack
from pathlib import Path

from fineflow.core.config import Params
from fineflow.core.entry import log, run_entry, stage_parser
from fineflow.core.errors import DataError
from fineflow.core.reports import write_json_atomic
from fineflow.data.formats import Row
from fineflow.data.tokens import TokenView
from fineflow.data.validation import clean_record, quarantine_record, raise_if_blocked, validate_splits


class _Files:
    """The stage's row files, written as the gate routes each row: a split's kept rows, and the quarantine
    and the redaction log shared by both splits."""

    def __init__(self, stack: ExitStack, out_dir: Path):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir, self.stack = out_dir, stack
        self.quarantine = self._open("quarantine.jsonl")
        self.redactions = self._open("redactions.jsonl")

    def _open(self, name: str):
        return self.stack.enter_context((self.out_dir / name).open("w", encoding="utf-8"))

    def sink(self, split: str) -> _SplitSink:
        return _SplitSink(split, self._open(f"{split}.jsonl"), self)


def _write(fh, record: dict) -> None:
    fh.write(json.dumps(record, ensure_ascii=False) + "\n")


class _SplitSink:
    def __init__(self, split: str, kept_file, files: _Files):
        self.split, self.kept_file, self.files = split, kept_file, files

    def kept(self, row: Row) -> None:
        _write(self.kept_file, clean_record(row))
        if row.redacted:  # pii: redact keeps the row; every replacement is logged (line and kinds, never the value)
            _write(self.files.redactions, {"split": self.split, "line": row.line, "kinds": row.redacted})

    def quarantined(self, row: Row) -> None:
        _write(self.files.quarantine, quarantine_record(row, self.split))


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

        tokenizer = load_tokenizer(resolve_base_model(params.model, base_dir))
        tokens = TokenView(tokenizer, params.tokenize.seq_len, params.tokenize.train_on)
    if docs_dir is not None:
        shutil.rmtree(docs_dir, ignore_errors=True)  # one run's docs, not an accumulation of old ones
    with ExitStack() as stack:
        files = _Files(stack, out_dir)
        sinks = {split: files.sink(split) for split in ("eval", "train")}
        outcomes = validate_splits({"eval": eval_path, "train": train_path}, params.data, cfg, tokens, docs_dir, sinks)
    for split, outcome in outcomes.items():
        log(
            f"{split}: {outcome.rows_in} rows in, {outcome.rows_kept} kept, "
            f"{outcome.rows_quarantined} quarantined, {outcome.rows_warned} kept with warnings"
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
