"""The data gate: run a great-expectations suite over parsed rows, quarantine failures, decide if the file passes.

Rows come from fineflow.data.formats: rows that could not be parsed (malformed JSON, non-UTF-8 bytes, not an
object) never reach GX, they already carry their reason. Parsed rows go through the checks declared in
fineflow.data.checks: schema, types, non-null, non-empty, length bounds, exact and near duplicates (the first
copy is kept), PII (fineflow.data.pii; or, with ``validate.pii: redact``, PII is replaced by typed placeholders
before the checks run), train/eval leakage (fineflow.data.overlap) and, with a base model, token checks. Each
check has a category in ``validate.checks`` that sets its severity: ``error`` quarantines the failing rows,
``warn`` keeps them and reports them.
Invariant: ``rows_in == rows_kept + rows_quarantined`` — nothing is dropped silently.

Preference pairs (the objective's row schema, ``schema``: PAIRS) go through the same gate: chosen and rejected take
output's place in the schema, the pair checks (identical or empty answers, a cut that leaves the two sides the
same tokens) join, and the text checks (length, duplicates, PII, leakage) read the prompt and both answers.
Feedback rows (FEEDBACK, KTO's) are SFT rows with a boolean ``label``: the SFT checks, the label's type, and no
answer labelled both ways for one prompt (feedback_conflict).

The gate streams: rows are checked a chunk at a time (``CHUNK_ROWS`` rows, or fewer that hold
``CHUNK_BYTES``), each chunk's rows go to a sink (the stage writes them out) before the next is read, and what
the gate keeps across chunks is compact — hashes for duplicates and leakage (fineflow.data.overlap), counts
and the first failing lines per check. Peak memory is one chunk plus that, whatever the row count. The GX
Data Docs show one validation of the whole split: the chunks' results summed, without row values.

A hard failure (a required column absent from the whole file, no rows at all, an error-severity check
failing on more than its ``max_share`` of the rows, or more quarantined rows than
``validate.max_bad_share``) makes ``raise_if_blocked`` raise ``DataError`` naming the file, the first
offending lines and checks.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from fineflow.core.data_config import ValidateParams
from fineflow.data import checks
from fineflow.data.checks import SCHEMA, TRUNCATION, Check, CheckContext, FailedRow, Seen
from fineflow.data.formats import (
    ANSWERS,
    LABEL,
    OPTIONAL,
    REQUIRED,
    Row,
    apply_mapping,
    example_text,
    read_rows,
    required_fields,
)
from fineflow.data.gx_suite import GxRunner
from fineflow.data.overlap import LeakIndex
from fineflow.data.pii import find_pii, redact, redacted_preview
from fineflow.data.tokens import TokenView
from fineflow.errors import DataError
from fineflow.objectives.interface import EXAMPLES

CHUNK_ROWS = 10_000  # rows checked together: GX's fixed cost per run (~0.3 s) is amortized, memory stays bounded
CHUNK_BYTES = 8 << 20  # ... and a chunk of big rows ends early: checking a row costs ~10x its bytes
FIRST_LINES = 20  # failing lines a check remembers (and the report shows); the rest are counted


@dataclass
class CheckResult:
    name: str  # e.g. "not_null(output)"
    category: str  # the validate.checks entry that sets its severity and threshold, e.g. "non_null"
    expectation: str  # the GX expectation type
    failed: int = 0  # rows it failed on
    rows: int = 0  # rows the check ran on
    severity: str = "error"
    max_share: float = 0.0
    first_failed_lines: list[int] = field(default_factory=list)  # the first FIRST_LINES of them

    def add(self, failed_lines: list[int], rows: int) -> None:
        self.failed += len(failed_lines)
        self.rows += rows
        self.first_failed_lines += failed_lines[: FIRST_LINES - len(self.first_failed_lines)]

    @property
    def share(self) -> float:
        return self.failed / self.rows if self.rows else 0.0

    @property
    def passed(self) -> bool:
        return self.share <= self.max_share


@dataclass
class ValidationOutcome:
    """What the report and the gate decision need, bounded in size whatever the row count. ``kept`` and
    ``quarantined`` hold the rows themselves only when validated in memory (validate_rows)."""

    source: str
    checks: list[CheckResult] = field(default_factory=list)
    schema_problems: list[str] = field(default_factory=list)
    rows_in: int = 0
    rows_kept: int = 0
    rows_quarantined: int = 0
    rows_warned: int = 0
    pii_redacted: dict[str, int] = field(default_factory=dict)
    first_failures: list[str] = field(default_factory=list)  # reasons of the first quarantined rows
    kept: list[Row] = field(default_factory=list)
    quarantined: list[Row] = field(default_factory=list)

    def report(self) -> dict:
        truncation = next((c.share for c in self.checks if c.category == TRUNCATION), None)
        return {
            "rows_in": self.rows_in,
            "rows_kept": self.rows_kept,
            "rows_quarantined": self.rows_quarantined,
            "truncation_rate": round(truncation, 5) if truncation is not None else None,
            "rows_warned": self.rows_warned,
            "pii_redacted": dict(sorted(self.pii_redacted.items())),
            "checks": {
                c.name: {
                    "category": c.category,
                    "expectation": c.expectation,
                    "severity": c.severity,
                    "failed_rows": c.failed,
                    "share": round(c.share, 5),
                    "max_share": c.max_share,
                    "passed": c.passed,
                    "first_failed_lines": c.first_failed_lines,
                }
                for c in self.checks
            },
            "schema_problems": self.schema_problems,
        }


def _redact_row(row: Row) -> None:
    """pii: redact — replace PII spans in every string field with typed placeholders, remembering kinds. A chat
    row's ``messages`` are redacted too (the tokenizer's chat template renders them, not the derived fields);
    their kinds are not counted twice: the derived instruction and output hold the same text."""
    for key, value in list(row.data.items()):
        if isinstance(value, str):
            spans = find_pii(value)
            if spans:
                row.data[key] = redact(value, spans)
                row.redacted.extend(span.kind for span in spans)
    messages = row.data.get("messages")
    if isinstance(messages, list):
        row.data["messages"] = [_redact_message(message) for message in messages]


def _redact_message(message):
    if not isinstance(message, dict):
        return message
    if isinstance(message.get("content"), str):
        message = {**message, "content": _redacted(message["content"])}
    if message.get("tool_calls"):  # a tool call's arguments are the model's text too
        message["tool_calls"] = [_redact_call(call) for call in message["tool_calls"]]
    return message


def _redact_call(call: dict) -> dict:
    function = call["function"]
    arguments = {k: _redacted(v) if isinstance(v, str) else v for k, v in function["arguments"].items()}
    return {**call, "function": {**function, "arguments": arguments}}


def _redacted(text: str) -> str:
    return redact(text, find_pii(text))


def _frame(ctx: CheckContext, suite: list[Check]):
    """The chunk's rows as a frame indexed by source line: the record columns they have, then each derived
    column that an applying check needs, computed once in suite order."""
    import pandas as pd

    columns = [c for c in (*REQUIRED, *OPTIONAL, *ANSWERS) if c in ctx.columns_in_rows]
    frame = pd.DataFrame(
        [{c: row.data.get(c) for c in columns} for row in ctx.rows],
        index=[row.line for row in ctx.rows],
        columns=columns,
    )
    if "input" not in frame:  # input is optional: absent or null means empty, so type_str(input) can check it
        frame["input"] = ""
    frame["input"] = frame["input"].where(frame["input"].notna(), "")
    derived: set[str] = set()
    for check in suite:
        if check.derive is not None and check.column not in derived:
            frame[check.column] = check.derive(ctx)
            derived.add(check.column)
    return frame


class RowSink(Protocol):
    """Where the gate sends each row once its chunk is checked."""

    def kept(self, row: Row) -> None: ...

    def quarantined(self, row: Row) -> None: ...


@dataclass
class JsonlSink:
    """Writes each row as the gate routes it: a kept row's clean record, a rejected row's quarantine record, and
    (pii: redact) which kept row had which PII kinds replaced: the line and kinds, never the value."""

    split: str
    kept_file: IO[str]
    quarantine_file: IO[str]
    redactions_file: IO[str]

    def kept(self, row: Row) -> None:
        _write_line(self.kept_file, clean_record(row))
        if row.redacted:
            _write_line(self.redactions_file, {"split": self.split, "line": row.line, "kinds": row.redacted})

    def quarantined(self, row: Row) -> None:
        _write_line(self.quarantine_file, quarantine_record(row, self.split))


def _write_line(fh: IO[str], record: dict) -> None:
    fh.write(json.dumps(record, ensure_ascii=False) + "\n")


@dataclass
class ListSink:
    """Keeps every row in memory (tests, small files)."""

    kept_rows: list[Row] = field(default_factory=list)
    quarantined_rows: list[Row] = field(default_factory=list)

    def kept(self, row: Row) -> None:
        self.kept_rows.append(row)

    def quarantined(self, row: Row) -> None:
        self.quarantined_rows.append(row)


def chunked(rows: Iterable[Row], max_rows: int = CHUNK_ROWS, max_bytes: int = CHUNK_BYTES) -> Iterator[list[Row]]:
    """Consecutive rows in lists of at most max_rows rows and (but for a single huge row) max_bytes bytes."""
    chunk, size = [], 0
    for row in rows:
        chunk.append(row)
        size += row.size
        if len(chunk) >= max_rows or size >= max_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class SplitGate:
    """The gate over one split, fed a chunk at a time: checks each chunk, routes its rows, and keeps only
    the compact state of the split (hashes, counts, first failing lines)."""

    def __init__(self, source: str, cfg: ValidateParams, leak_index=None, docs_dir=None, tokens=None, schema=EXAMPLES):
        self.source, self.cfg, self.leak_index, self.tokens = source, cfg, leak_index, tokens
        self.schema, self.required = schema, required_fields(schema)  # e.g. preference pairs: prompt, chosen, rejected
        self.outcome = ValidationOutcome(source)
        self.results: dict[str, CheckResult] = {}
        self.seen = Seen()
        self.gx: GxRunner | None = None
        self.docs_dir = docs_dir
        self.columns: set[str] = set()  # required columns some parsed row had
        self.parsed = 0
        self.first_parsed: list[int] = []

    def check(self, chunk: list[Row]) -> None:
        """Run every applying check on the chunk's parsed rows; add reasons (error) or warnings (warn)."""
        parsed = [row for row in chunk if row.data is not None]
        if not parsed:
            return
        if self.cfg.pii == "redact":
            for row in parsed:
                _redact_row(row)
        ctx = CheckContext(parsed, self.cfg, self.seen, self.leak_index, self.tokens, self.schema)
        # the declarations are the suite: read at every call, nothing else lists the checks
        applying = [check for check in checks.CHECKS if check.applies(ctx)]
        frame = _frame(ctx, applying)
        suite = [(check, check.expect(check.column, ctx)) for check in applying]
        if self.gx is None:
            self.gx = GxRunner(self.docs_dir)
        failing = self.gx.run(frame, suite, ctx)
        by_line = {row.line: row for row in parsed}
        for check, expectation in suite:
            lines = failing[check.name]
            knobs = check.knobs(self.cfg.checks)
            result = self.results.setdefault(
                check.name,
                CheckResult(
                    check.name,
                    check.category,
                    expectation.expectation_type,
                    severity=knobs.severity,
                    max_share=knobs.max_share,
                ),
            )
            if lines is None:  # a column absent from this chunk: the file-level verdict comes in finish()
                result.rows += len(parsed)
                continue
            result.add(lines, len(parsed))
            for line in lines:
                row = by_line[line]
                (row.reasons if knobs.severity == "error" else row.warnings).append(
                    f"{self.source}:{line}: failed {check.name}{check.detail(FailedRow(frame, line))}"
                )
        for row in parsed:
            for col in self.required:
                if col not in row.data:
                    row.reasons.append(f'{self.source}:{row.line}: field "{col}" is missing')
        self.columns |= ctx.columns_in_rows & set(self.required)
        self.parsed += len(parsed)
        self.first_parsed += [row.line for row in parsed[: FIRST_LINES - len(self.first_parsed)]]

    def route(self, row: Row, sink: RowSink) -> None:
        outcome = self.outcome
        outcome.rows_in += 1
        if row.reasons:
            outcome.rows_quarantined += 1
            if outcome.rows_quarantined <= 5:  # the error message quotes the first few
                outcome.first_failures += row.reasons[:2]
            sink.quarantined(row)
            return
        outcome.rows_kept += 1
        outcome.rows_warned += bool(row.warnings)
        for kind in row.redacted:
            outcome.pii_redacted[kind] = outcome.pii_redacted.get(kind, 0) + 1
        sink.kept(row)

    def finish(self, split: str = "rows") -> ValidationOutcome:
        """The split's outcome, with the file-level schema verdict; renders the Data Docs."""
        order = [check.name for check in checks.CHECKS]
        for col in self.required:
            result = self.results.get(f"column_exists({col})")
            if result is not None and col not in self.columns:  # absent from every chunk: from the file
                self.outcome.schema_problems.append(
                    f'{self.source}: required field "{col}" is missing from every row ({result.name})'
                )
                result.failed, result.first_failed_lines = self.parsed, list(self.first_parsed)
        self.outcome.checks = sorted(
            self.results.values(), key=lambda r: order.index(r.name) if r.name in order else len(order)
        )
        if self.gx is not None:
            self.gx.render_docs(split, order)
        return self.outcome


def validate_stream(
    rows: Iterable[Row],
    source: str,
    cfg: ValidateParams,
    sink: RowSink,
    leak_index: LeakIndex | None = None,
    docs_dir: Path | None = None,
    tokens: TokenView | None = None,
    split: str = "rows",
    chunk_rows: int = CHUNK_ROWS,
    schema: str = EXAMPLES,
) -> ValidationOutcome:
    """Check rows a chunk at a time, sending each to the sink (kept or quarantined) before the next chunk is
    read; return the outcome (counts, per-check results). ``schema``: the objective's row schema
    (fineflow.objectives.interface)."""
    gate = SplitGate(source, cfg, leak_index, docs_dir, tokens, schema)
    for chunk in chunked(rows, chunk_rows):
        gate.check(chunk)
        for row in chunk:
            gate.route(row, sink)
    return gate.finish(split)


def validate_rows(
    rows: Iterable[Row],
    source: str,
    cfg: ValidateParams,
    leak_index: LeakIndex | None = None,
    docs_dir: Path | None = None,
    tokens: TokenView | None = None,
    chunk_rows: int = CHUNK_ROWS,
    schema: str = EXAMPLES,
) -> ValidationOutcome:
    """The gate over rows held in memory (tests, small files): the outcome keeps every row it routed."""
    sink = ListSink()
    outcome = validate_stream(
        rows, source, cfg, sink, leak_index, docs_dir, tokens, chunk_rows=chunk_rows, schema=schema
    )
    outcome.kept, outcome.quarantined = sink.kept_rows, sink.quarantined_rows
    return outcome


def raise_if_blocked(outcome: ValidationOutcome, cfg: ValidateParams) -> None:
    """Raise DataError when the file must not go further; the message says what and where."""
    problems = list(outcome.schema_problems)
    for check in outcome.checks:
        if check.severity == "error" and check.category != SCHEMA and not check.passed:  # schema: above
            problems.append(
                f"{outcome.source}: check {check.name} failed on {check.failed} of "
                f"{check.rows} rows ({check.share:.1%}), above validate.checks.{check.category}"
                f".max_share={check.max_share:g}; first lines: {check.first_failed_lines[:5]}"
            )
    share = outcome.rows_quarantined / outcome.rows_in
    if not outcome.rows_kept:
        problems.append(f"{outcome.source}: every one of the {outcome.rows_in} rows failed validation")
    elif share > cfg.max_bad_share:
        problems.append(
            f"{outcome.source}: {outcome.rows_quarantined} of {outcome.rows_in} rows "
            f"({share:.1%}) failed validation, above validate.max_bad_share={cfg.max_bad_share:.0%}"
        )
    if problems:
        first = outcome.first_failures
        detail = "\n  ".join(problems + (["first failing rows:"] + first if first else []))
        raise DataError(f"validation failed:\n  {detail}")


def clean_record(row: Row) -> dict:
    """The normalized record a kept row becomes: instruction, input (may be empty), output; a preference pair
    has chosen and rejected instead of output; a feedback row its label too."""
    record = {"instruction": row.data["instruction"], "input": row.data.get("input") or ""}
    for key in ("output", *ANSWERS, LABEL):
        if key in row.data:
            record[key] = row.data[key]
    for key in ("messages", "tools"):  # a conversation and its tool definitions: the chat template renders them
        if row.data.get(key):
            record[key] = row.data[key]
    return record


def clean_text(row: Row) -> str:
    return example_text(clean_record(row))


def quarantine_record(row: Row, split: str) -> dict:
    """What is kept of a rejected row: where it was, why, a hash to find it by, and a short preview with every
    PII span replaced by its placeholder — never the row itself (the quarantine is a DVC output: cached,
    pushed, shared)."""
    text = row.raw if row.data is None else json.dumps(row.data, ensure_ascii=False, default=str)
    return {
        "split": split,
        "line": row.line,
        "reasons": row.reasons,
        "warnings": row.warnings,
        "sha256": row.digest,
        "preview": redacted_preview(text),
    }


def validate_splits(
    paths: dict[str, Path],
    data_cfg,
    cfg: ValidateParams,
    tokens: TokenView | None = None,
    docs_dir: Path | None = None,
    sinks: dict[str, RowSink] | None = None,
    schema: str = EXAMPLES,
) -> dict[str, ValidationOutcome]:
    """Stream, map and validate the eval split, then the train split against it: train rows are checked for
    leakage against what evaluation will score, so a leaked eval row is caught here. Without sinks the rows
    are kept in memory (the outcomes' kept/quarantined). ``schema``: the objective's row schema, leakage
    included: a train pair is checked against the eval pairs' prompts and answers."""
    sinks = sinks or {"eval": ListSink(), "train": ListSink()}

    def load(path: Path) -> Iterator[Row]:
        rows = read_rows(path, data_cfg.format, cfg.max_row_bytes)
        return apply_mapping(rows, data_cfg.mapping, str(path), schema=schema)

    def docs(split: str) -> Path | None:
        return docs_dir / split if docs_dir else None

    eval_path, train_path = Path(paths["eval"]), Path(paths["train"])
    outcome, leak_index = validate_eval(
        load(eval_path), str(eval_path), cfg, sinks["eval"], docs("eval"), tokens, schema
    )
    outcomes = {"eval": outcome}
    outcomes["train"] = validate_stream(
        load(train_path),
        str(train_path),
        cfg,
        sinks["train"],
        leak_index,
        docs("train"),
        tokens,
        "train",
        schema=schema,
    )
    for split, outcome in outcomes.items():
        if isinstance(sinks[split], ListSink):
            outcome.kept, outcome.quarantined = sinks[split].kept_rows, sinks[split].quarantined_rows
    return outcomes


def validate_eval(
    rows: Iterable[Row], source: str, cfg: ValidateParams, sink: RowSink, docs_dir: Path | None, tokens, schema=EXAMPLES
) -> tuple[ValidationOutcome, LeakIndex]:
    """The eval split's gate, and the index of its kept rows that train rows are checked for leakage against."""
    leak_index = LeakIndex(n=cfg.leakage_ngram)
    outcome = validate_stream(rows, source, cfg, _Tee(sink, leak_index), None, docs_dir, tokens, "eval", schema=schema)
    return outcome, leak_index


@dataclass
class _Tee:
    """The eval split's sink that also indexes every kept eval row for the train split's leakage check."""

    sink: RowSink
    leak_index: LeakIndex

    def kept(self, row: Row) -> None:
        self.leak_index.add(clean_text(row))
        self.sink.kept(row)

    def quarantined(self, row: Row) -> None:
        self.sink.quarantined(row)
