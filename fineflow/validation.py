"""The data gate: read instruction rows defensively, run a great-expectations suite, quarantine failures.

Rows that cannot be parsed (malformed JSON, non-UTF-8 bytes, not an object) never reach GX: they are
quarantined with the reason and their raw text. Parsed rows go through a GX 1.x suite (schema, types,
non-null, length bounds, uniqueness, PII); each failing row is quarantined with every check it failed.
Invariant: ``rows_in == rows_kept + rows_quarantined`` — nothing is dropped silently.

A hard failure (a required column absent from the whole file, no rows at all, or more quarantined rows
than ``validate.max_bad_share``) raises ``DataError`` naming the file, the first offending lines and checks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from fineflow.config import ValidateParams
from fineflow.errors import DataError

REQUIRED = ("instruction", "output")
OPTIONAL = ("input",)
EMAIL = r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}"


@dataclass
class Row:
    line: int  # 1-based line number in the source file
    data: dict | None = None  # parsed object, None when it could not be parsed
    raw: str = ""  # raw text, kept for rows that could not be parsed
    reasons: list[str] = field(default_factory=list)


@dataclass
class CheckResult:
    name: str  # e.g. "not_null(output)"
    expectation: str  # the GX expectation type
    failed_lines: list[int]

    @property
    def passed(self) -> bool:
        return not self.failed_lines


@dataclass
class ValidationOutcome:
    source: str
    kept: list[Row]
    quarantined: list[Row]
    checks: list[CheckResult]
    schema_problems: list[str]

    @property
    def rows_in(self) -> int:
        return len(self.kept) + len(self.quarantined)

    def report(self) -> dict:
        return {
            "rows_in": self.rows_in, "rows_kept": len(self.kept), "rows_quarantined": len(self.quarantined),
            "checks": {c.name: {"expectation": c.expectation, "failed_rows": len(c.failed_lines),
                                "passed": c.passed} for c in self.checks},
            "schema_problems": self.schema_problems,
        }


def read_jsonl(path: str | Path) -> list[Row]:
    """Every line of a JSONL file as a Row; unparseable lines carry their reason instead of raising."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file ({exc.strerror})") from None
    if blob.startswith(b"\xef\xbb\xbf"):
        blob = blob[3:]  # a UTF-8 byte-order mark is harmless; strip it rather than fail line 1
    rows: list[Row] = []
    for number, raw_line in enumerate(blob.split(b"\n"), start=1):
        if not raw_line.strip():
            continue
        try:
            text = raw_line.decode("utf-8")
        except UnicodeDecodeError as exc:
            rows.append(Row(number, raw=raw_line.decode("utf-8", "replace"),
                            reasons=[f"{path}:{number}: not UTF-8 (byte {exc.start})"]))
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            rows.append(Row(number, raw=text[:1000], reasons=[f"{path}:{number}: malformed JSON ({exc.msg} "
                                                              f"at column {exc.colno})"]))
            continue
        if not isinstance(obj, dict):
            rows.append(Row(number, raw=text[:1000],
                            reasons=[f"{path}:{number}: expected a JSON object, got {type(obj).__name__}"]))
            continue
        rows.append(Row(number, data=obj))
    if not rows:
        raise DataError(f"{path}: the file is empty (no rows); point data.train_path at a JSONL file with "
                        f"one object per line")
    return rows


def _frame(rows: list[Row]):
    import pandas as pd

    present = {key for row in rows for key in row.data}
    columns = [c for c in (*REQUIRED, *OPTIONAL) if c in present]
    frame = pd.DataFrame([{c: row.data.get(c) for c in columns} for row in rows],
                         index=[row.line for row in rows], columns=columns)
    if "input" not in frame:
        frame["input"] = ""
    frame["input"] = frame["input"].where(frame["input"].notna(), "")
    # What the model will see, used for length, uniqueness and PII; built in Python so that a missing
    # or non-string field becomes text instead of failing inside pandas.
    frame["text"] = ["\n".join(str(row.data.get(c) or "") for c in ("instruction", "input", "output"))
                     for row in rows]
    frame["row_key"] = frame["text"]
    return frame


def _suite(columns: list[str], cfg: ValidateParams):
    """(check name, expectation) pairs — the suite is data, so the report names each check."""
    import great_expectations.expectations as gxe

    checks = [(f"column_exists({col})", gxe.ExpectColumnToExist(column=col)) for col in REQUIRED]
    for col in REQUIRED:
        if col in columns:
            checks.append((f"not_null({col})", gxe.ExpectColumnValuesToNotBeNull(column=col)))
            checks.append((f"type_str({col})", gxe.ExpectColumnValuesToBeOfType(column=col, type_="str")))
    if "output" in columns:
        checks.append(("non_empty(output)", gxe.ExpectColumnValueLengthsToBeBetween(column="output", min_value=1)))
    checks.append(("type_str(input)", gxe.ExpectColumnValuesToBeOfType(column="input", type_="str")))
    checks.append(("length_chars(text)", gxe.ExpectColumnValueLengthsToBeBetween(
        column="text", min_value=cfg.min_chars, max_value=cfg.max_chars)))
    checks.append(("unique(row)", gxe.ExpectColumnValuesToBeUnique(column="row_key")))
    checks.append(("pii_email(text)", gxe.ExpectColumnValuesToNotMatchRegex(column="text", regex=EMAIL)))
    return checks


def _run_gx(frame, checks) -> dict[str, list[int] | None]:
    """Run the suite on the frame; return the failing index values (source line numbers) per check.

    A table-level check that fails (a column absent from the file) maps to None: no single row is at fault.
    """
    import logging

    import great_expectations as gx

    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = {"globally": False}
    batch_def = (context.data_sources.add_pandas("fineflow").add_dataframe_asset("rows")
                 .add_batch_definition_whole_dataframe("all"))
    suite = context.suites.add(gx.ExpectationSuite(name="fineflow_rows"))
    for _, expectation in checks:
        suite.add_expectation(expectation)
    batch = batch_def.get_batch(batch_parameters={"dataframe": frame})
    result = batch.validate(suite, result_format={"result_format": "COMPLETE"})
    # GX does not keep the suite's order in its results: key them by (expectation type, column).
    name_of = {(exp.expectation_type, exp.column): name for name, exp in checks}
    failing: dict[str, list[int]] = {name: [] for name, _ in checks}
    for res in result.results:
        name = name_of[(res.expectation_config.type, res.expectation_config.kwargs["column"])]
        if res.exception_info.get("raised_exception"):
            raise DataError(f"validation check {name} could not run: {res.exception_info.get('exception_message')}")
        if res.expectation_config.type == "expect_column_to_exist":
            failing[name] = None if not res.success else []
        else:
            failing[name] = [int(i) for i in res.result.get("unexpected_index_list") or []]
    return failing


def validate_rows(rows: list[Row], source: str, cfg: ValidateParams) -> ValidationOutcome:
    parsed = [row for row in rows if row.data is not None]
    schema_problems: list[str] = []
    checks: list[CheckResult] = []
    if parsed:
        frame = _frame(parsed)
        suite = _suite(list(frame.columns), cfg)
        failing = _run_gx(frame, suite)
        by_line = {row.line: row for row in parsed}
        first_seen: dict[str, int] = {}
        for line, key in frame["row_key"].items():
            first_seen.setdefault(key, line)
        for name, expectation in suite:
            lines = failing[name]
            if lines is None:
                column = name[name.index("(") + 1:-1]
                schema_problems.append(f"{source}: required field \"{column}\" is missing from every row ({name})")
                checks.append(CheckResult(name, expectation.expectation_type, [row.line for row in parsed]))
                continue
            if name == "unique(row)":  # keep the first copy of a duplicate, quarantine the rest
                lines = [ln for ln in lines if first_seen[frame.at[ln, "row_key"]] != ln]
            checks.append(CheckResult(name, expectation.expectation_type, lines))
            for line in lines:
                detail = f" (first seen at line {first_seen[frame.at[line, 'row_key']]})" if name == "unique(row)" else ""
                by_line[line].reasons.append(f"{source}:{line}: failed {name}{detail}")
        for row in parsed:
            for col in REQUIRED:
                if col not in row.data:
                    row.reasons.append(f"{source}:{row.line}: field \"{col}\" is missing")
    kept = [row for row in rows if not row.reasons]
    quarantined = [row for row in rows if row.reasons]
    return ValidationOutcome(source, kept, quarantined, checks, schema_problems)


def gate(outcome: ValidationOutcome, cfg: ValidateParams) -> None:
    """Raise DataError when the file must not go further; the message says what and where."""
    problems = list(outcome.schema_problems)
    share = len(outcome.quarantined) / outcome.rows_in
    if not outcome.kept:
        problems.append(f"{outcome.source}: every one of the {outcome.rows_in} rows failed validation")
    elif share > cfg.max_bad_share:
        problems.append(f"{outcome.source}: {len(outcome.quarantined)} of {outcome.rows_in} rows "
                        f"({share:.1%}) failed validation, above validate.max_bad_share={cfg.max_bad_share:.0%}")
    if problems:
        first = [reason for row in outcome.quarantined[:5] for reason in row.reasons[:2]]
        detail = "\n  ".join(problems + (["first failing rows:"] + first if first else []))
        raise DataError(f"validation failed:\n  {detail}")


def clean_record(row: Row) -> dict:
    """The normalized record a kept row becomes: instruction, input (may be empty), output."""
    return {"instruction": row.data["instruction"], "input": row.data.get("input") or "",
            "output": row.data["output"]}


def quarantine_record(row: Row, split: str) -> dict:
    return {"split": split, "line": row.line, "reasons": row.reasons,
            **({"row": row.data} if row.data is not None else {"raw": row.raw})}
