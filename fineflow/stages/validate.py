"""Stage validate: the great-expectations gate over the raw train and eval rows.

Reads JSONL, CSV or Parquet (``data.format``), renamed to instruction/input/output by ``data.mapping`` (with
``train.objective`` dpo or simpo: preference pairs, instruction/input or messages plus chosen/rejected). With
``data.sources`` the train split is their mix instead: each source validated on its own, its result kept by
content in ``--source-cache`` (fineflow.data.mixture, fineflow.data.source_gate).

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

import shutil
from contextlib import ExitStack
from pathlib import Path

from fineflow.core.config import Params
from fineflow.core.entry import log, run_entry, stage_parser
from fineflow.core.reports import write_json_atomic
from fineflow.data.mixture import Mixture
from fineflow.data.tokens import TokenView
from fineflow.data.validation import JsonlSink, raise_if_blocked, validate_splits
from fineflow.errors import DataError
from fineflow.objectives import objective_for


class _Files:
    """The stage's row files: each split's kept rows, and the quarantine and the redaction log all splits share."""

    def __init__(self, stack: ExitStack, out_dir: Path):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir, self.stack = out_dir, stack
        self.quarantine = self._open("quarantine.jsonl")
        self.redactions = self._open("redactions.jsonl")

    def _open(self, name: str):
        return self.stack.enter_context((self.out_dir / name).open("w", encoding="utf-8"))

    def sink(self, split: str) -> JsonlSink:
        return JsonlSink(split, self._open(f"{split}.jsonl"), self.quarantine, self.redactions)


def _token_view(params: Params, base_dir: Path | None) -> TokenView | None:
    """Token-level checks see rows exactly as the tokenize stage will (None without a base)."""
    if base_dir is None:
        return None
    from fineflow.base_source import resolve_base_model
    from fineflow.tokenize.tokenization import load_tokenizer

    tokenizer = load_tokenizer(resolve_base_model(params.model, base_dir))
    return TokenView(tokenizer, params.tokenize.seq_len, params.tokenize.train_on)


def run(
    params: Params,
    train_path: Path,
    eval_path: Path,
    out_dir: Path,
    report_path: Path,
    docs_dir: Path | None = None,
    base_dir: Path | None = None,
    source_cache: Path | None = None,
    hash_cache: Path | None = None,
) -> dict:
    cfg = params.validate_
    tokens = _token_view(params, base_dir)
    if docs_dir is not None:
        shutil.rmtree(docs_dir, ignore_errors=True)  # one run's docs, not an accumulation of old ones
    if source_cache is not None:  # a DVC output: there (empty) without data.sources too
        source_cache.mkdir(parents=True, exist_ok=True)
    if params.data.sources:
        mixture = Mixture(params, out_dir, source_cache or out_dir.parent / "source_cache", hash_cache, docs_dir)
        return _check_kept_rows(params, out_dir, report_path, mixture.run(eval_path, tokens, report_path))
    with ExitStack() as stack:
        files = _Files(stack, out_dir)
        sinks = {split: files.sink(split) for split in ("eval", "train")}
        paths = {"eval": eval_path, "train": train_path}
        schema = objective_for(params.train.objective).rows  # e.g. dpo: every row a preference pair
        outcomes = validate_splits(paths, params.data, cfg, tokens, docs_dir, sinks, schema)
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
    return _check_kept_rows(params, out_dir, report_path, report)


def _check_kept_rows(params: Params, out_dir: Path, report_path: Path, report: dict) -> dict:
    """The objective's checks of each split as a whole, after the gate's row checks (e.g. kto's both labels; an
    online objective's rows against what its rewards read): the report with what they add, or their DataError with
    the report written as failed."""
    kept = {split: out_dir / f"{split}.jsonl" for split in ("train", "eval")}
    objective = objective_for(params.train.objective)
    try:
        report.update(objective.check_kept_rows(kept, params.train))
        if objective.online:  # every row holds what its rewards read
            from fineflow.train.rollouts import check_kept_rows

            check_kept_rows(kept, params.train)
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
    parser.add_argument(
        "--source-cache",
        type=Path,
        default=None,
        help="with data.sources: each source's result by content (a persisted output; default: beside --out)",
    )
    parser.add_argument("--hash-cache", type=Path, default=None, help="directory for the sources' file hash cache")
    args = parser.parse_args(argv)
    return run_entry(
        "validate",
        args,
        lambda p: run(
            p,
            args.train,
            args.eval,
            args.out,
            Path(args.report),
            args.data_docs,
            args.base_dir,
            args.source_cache,
            args.hash_cache,
        ),
    )


if __name__ == "__main__":
    raise SystemExit(main())
