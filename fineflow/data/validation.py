"""The data gate: run a great-expectations suite over parsed rows, quarantine failures, decide if the file passes.

Rows come from fineflow.data.formats: rows that could not be parsed (malformed JSON, non-UTF-8 bytes, not an
object) never reach GX, they already carry their reason. Parsed rows go through the checks declared in
fineflow.data.checks: schema, types, non-null, non-empty, length bounds, exact and near duplicates (the first
copy is kept), PII (fineflow.data.pii; or, with ``validate.pii: redact``, PII is replaced by typed placeholders
before the checks run), train/eval leakage (fineflow.data.overlap) and, with a base model, token checks. Each
check has a category in ``validate.checks`` that sets its severity: ``error`` quarantines the failing rows,
``warn`` keeps them and reports them.
Invariant: ``rows_in == rows_kept + rows_quarantined`` — nothing is dropped silently.

A hard failure (a required column absent from the whole file, no rows at all, an error-severity check
failing on more than its ``max_share`` of the rows, or more quarantined rows than
``validate.max_bad_share``) makes ``raise_if_blocked`` raise ``DataError`` naming the file, the first
offending lines and checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fineflow.config import ValidateParams
from fineflow.data import checks
from fineflow.data.checks import SCHEMA, TRUNCATION, Check, CheckContext, Expectation, FailedRow
from fineflow.data.formats import OPTIONAL, REQUIRED, Row, apply_mapping, example_text, read_rows
from fineflow.data.overlap import LeakIndex
from fineflow.data.pii import find_pii, redact
from fineflow.errors import DataError
from fineflow.tokenize.template import RenderError, encode_pair, render_pair


@dataclass
class CheckResult:
    name: str  # e.g. "not_null(output)"
    category: str  # the validate.checks entry that sets its severity and threshold, e.g. "non_null"
    expectation: str  # the GX expectation type
    failed_lines: list[int]
    rows: int  # rows the check ran on
    severity: str = "error"
    max_share: float = 0.0

    @property
    def share(self) -> float:
        return len(self.failed_lines) / self.rows if self.rows else 0.0

    @property
    def passed(self) -> bool:
        return self.share <= self.max_share


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
        redacted: dict[str, int] = {}
        for row in self.kept:
            for kind in row.redacted:
                redacted[kind] = redacted.get(kind, 0) + 1
        truncation = next((c.share for c in self.checks if c.category == TRUNCATION), None)
        return {
            "rows_in": self.rows_in,
            "rows_kept": len(self.kept),
            "rows_quarantined": len(self.quarantined),
            "truncation_rate": round(truncation, 5) if truncation is not None else None,
            "rows_warned": sum(1 for row in self.kept if row.warnings),
            "pii_redacted": redacted,
            "checks": {
                c.name: {
                    "category": c.category,
                    "expectation": c.expectation,
                    "severity": c.severity,
                    "failed_rows": len(c.failed_lines),
                    "share": round(c.share, 5),
                    "max_share": c.max_share,
                    "passed": c.passed,
                    "first_failed_lines": c.failed_lines[:20],
                }
                for c in self.checks
            },
            "schema_problems": self.schema_problems,
        }


def _redact_row(row: Row) -> None:
    """pii: redact — replace PII spans in every string field with typed placeholders, remembering kinds."""
    for key, value in list(row.data.items()):
        if isinstance(value, str):
            spans = find_pii(value)
            if spans:
                row.data[key] = redact(value, spans)
                row.redacted.extend(span.kind for span in spans)


@dataclass(frozen=True)
class TokenView:
    """How the tokenize stage will see a row: the tokenizer and the packed row length it truncates to."""

    tokenizer: object
    seq_len: int

    def measure(self, data: dict) -> tuple[int | None, int | None, str | None]:
        """(tokens in the rendered example, response tokens still trained on after truncation, why the
        template could not render the row or None)."""
        row = {c: str(data.get(c) or "") for c in ("instruction", "input", "output")}
        try:
            prompt, response = render_pair(self.tokenizer, {**row, "messages": data.get("messages")})
        except RenderError as exc:
            return None, None, str(exc)  # only the render check fails; token checks skip (null) the row
        ids, mask = encode_pair(self.tokenizer, prompt, response)
        return len(ids), sum(mask[: self.seq_len]), None


def _frame(ctx: CheckContext, suite: list[Check]):
    """The rows as a frame indexed by source line: the record columns they have, then each derived column
    that an applying check needs, computed once in suite order."""
    import pandas as pd

    columns = [c for c in (*REQUIRED, *OPTIONAL) if c in ctx.columns_in_rows]
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


def _names_by_expectation(suite: list[tuple[Check, Expectation]]) -> dict[tuple[str, str], str]:
    """Check names keyed by (expectation type, column): GX does not keep the suite's order in its results,
    so that pair is how a result finds its check; two checks must not share it."""
    names: dict[tuple[str, str], str] = {}
    for check, expectation in suite:
        key = (expectation.expectation_type, expectation.column)
        if key in names:
            raise ValueError(
                f"checks {names[key]} and {check.name} both run {key[0]} on column {key[1]!r}: "
                f"GX results could not tell them apart"
            )
        names[key] = check.name
    return names


def _run_gx(frame, suite: list[tuple[Check, Expectation]], docs_dir: Path | None = None) -> dict[str, list[int] | None]:
    """Run the suite on the frame; return the failing index values (source line numbers) per check.

    A table-level check that fails (a column absent from the file) maps to None: no single row is at fault.
    With docs_dir, a checkpoint action also renders GX Data Docs (static HTML) there.
    """
    import logging

    import great_expectations as gx
    from great_expectations.checkpoint import UpdateDataDocsAction

    name_of = _names_by_expectation(suite)
    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = {"globally": False}
    actions = []
    if docs_dir is not None:
        context.add_data_docs_site(
            "fineflow",
            {
                "class_name": "SiteBuilder",
                "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
                "store_backend": {
                    "class_name": "TupleFilesystemStoreBackend",
                    "base_directory": str(Path(docs_dir).resolve()),
                },
            },
        )
        actions.append(UpdateDataDocsAction(name="data_docs", site_names=["fineflow"]))
    batch_def = (
        context.data_sources.add_pandas("fineflow")
        .add_dataframe_asset("rows")
        .add_batch_definition_whole_dataframe("all")
    )
    gx_suite = context.suites.add(gx.ExpectationSuite(name="fineflow_rows"))
    for _, expectation in suite:
        gx_suite.add_expectation(expectation)
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(name="rows", data=batch_def, suite=gx_suite)
    )
    checkpoint = context.checkpoints.add(
        gx.Checkpoint(
            name="fineflow",
            validation_definitions=[definition],
            actions=actions,
            result_format={"result_format": "COMPLETE"},
        )
    )
    [result] = checkpoint.run(batch_parameters={"dataframe": frame}).run_results.values()
    failing: dict[str, list[int] | None] = {check.name: [] for check, _ in suite}
    for res in result.results:
        name = name_of[(res.expectation_config.type, res.expectation_config.kwargs["column"])]
        if res.exception_info.get("raised_exception"):
            raise DataError(f"validation check {name} could not run: {res.exception_info.get('exception_message')}")
        if res.expectation_config.type == "expect_column_to_exist":
            failing[name] = None if not res.success else []
        else:
            failing[name] = [int(i) for i in res.result.get("unexpected_index_list") or []]
    return failing


def _failures(check: Check, lines: list[int], frame) -> list[FailedRow]:
    """The rows the check fails on; a keeps_first check keeps the first copy of each value and fails the rest."""
    if not check.keeps_first:
        return [FailedRow(frame, line) for line in lines]
    first_line: dict = {}
    for line, value in frame[check.column].items():
        first_line.setdefault(value, line)
    copies = (FailedRow(frame, line, first_line[frame.at[line, check.column]]) for line in lines)
    return [row for row in copies if row.line != row.first_line]


def validate_rows(
    rows: list[Row],
    source: str,
    cfg: ValidateParams,
    leak_index: LeakIndex | None = None,
    docs_dir: Path | None = None,
    tokens: TokenView | None = None,
) -> ValidationOutcome:
    """Run every applying check on rows; quarantine (error) or flag (warn) failing rows with file:line reasons."""
    parsed = [row for row in rows if row.data is not None]
    schema_problems: list[str] = []
    results: list[CheckResult] = []
    if parsed:
        if cfg.pii == "redact":
            for row in parsed:
                _redact_row(row)
        ctx = CheckContext(parsed, cfg, leak_index, tokens)
        # the declarations are the suite: read at every call, nothing else lists the checks
        applying = [check for check in checks.CHECKS if check.applies(ctx)]
        frame = _frame(ctx, applying)
        suite = [(check, check.expect(check.column, ctx)) for check in applying]
        failing = _run_gx(frame, suite, docs_dir)
        by_line = {row.line: row for row in parsed}
        for check, expectation in suite:
            knobs = check.knobs(cfg.checks)
            lines = failing[check.name]
            if lines is None:  # table-level failure: the column is absent from the whole file
                schema_problems.append(
                    f'{source}: required field "{check.column}" is missing from every row ({check.name})'
                )
                results.append(
                    CheckResult(
                        check.name,
                        check.category,
                        expectation.expectation_type,
                        [row.line for row in parsed],
                        len(parsed),
                        knobs.severity,
                        knobs.max_share,
                    )
                )
                continue
            failures = _failures(check, lines, frame)
            results.append(
                CheckResult(
                    check.name,
                    check.category,
                    expectation.expectation_type,
                    [failed.line for failed in failures],
                    len(parsed),
                    knobs.severity,
                    knobs.max_share,
                )
            )
            for failed in failures:
                row = by_line[failed.line]
                (row.reasons if knobs.severity == "error" else row.warnings).append(
                    f"{source}:{failed.line}: failed {check.name}{check.detail(failed)}"
                )
        for row in parsed:
            for col in REQUIRED:
                if col not in row.data:
                    row.reasons.append(f'{source}:{row.line}: field "{col}" is missing')
    kept = [row for row in rows if not row.reasons]
    quarantined = [row for row in rows if row.reasons]
    return ValidationOutcome(source, kept, quarantined, results, schema_problems)


def raise_if_blocked(outcome: ValidationOutcome, cfg: ValidateParams) -> None:
    """Raise DataError when the file must not go further; the message says what and where."""
    problems = list(outcome.schema_problems)
    for check in outcome.checks:
        if check.severity == "error" and check.category != SCHEMA and not check.passed:  # schema: above
            problems.append(
                f"{outcome.source}: check {check.name} failed on {len(check.failed_lines)} of "
                f"{check.rows} rows ({check.share:.1%}), above validate.checks.{check.category}"
                f".max_share={check.max_share:g}; first lines: {check.failed_lines[:5]}"
            )
    share = len(outcome.quarantined) / outcome.rows_in
    if not outcome.kept:
        problems.append(f"{outcome.source}: every one of the {outcome.rows_in} rows failed validation")
    elif share > cfg.max_bad_share:
        problems.append(
            f"{outcome.source}: {len(outcome.quarantined)} of {outcome.rows_in} rows "
            f"({share:.1%}) failed validation, above validate.max_bad_share={cfg.max_bad_share:.0%}"
        )
    if problems:
        first = [reason for row in outcome.quarantined[:5] for reason in row.reasons[:2]]
        detail = "\n  ".join(problems + (["first failing rows:"] + first if first else []))
        raise DataError(f"validation failed:\n  {detail}")


def clean_record(row: Row) -> dict:
    """The normalized record a kept row becomes: instruction, input (may be empty), output."""
    record = {
        "instruction": row.data["instruction"],
        "input": row.data.get("input") or "",
        "output": row.data["output"],
    }
    if row.data.get("messages"):
        record["messages"] = row.data["messages"]
    return record


def clean_text(row: Row) -> str:
    return example_text(clean_record(row))


def quarantine_record(row: Row, split: str) -> dict:
    return {
        "split": split,
        "line": row.line,
        "reasons": row.reasons,
        "warnings": row.warnings,
        **({"row": row.data} if row.data is not None else {"raw": row.raw}),
    }


def validate_splits(
    paths: dict[str, Path], data_cfg, cfg: ValidateParams, tokens: TokenView | None = None, docs_dir: Path | None = None
) -> dict[str, ValidationOutcome]:
    """Read, map and validate the eval split, then the train split against it: train rows are checked for
    leakage against what evaluation will score, so a leaked eval row is caught here."""

    def load(path: Path) -> list:
        return apply_mapping(read_rows(path, data_cfg.format), data_cfg.mapping, str(path))

    eval_path, train_path = Path(paths["eval"]), Path(paths["train"])
    outcomes = {
        "eval": validate_rows(
            load(eval_path), str(eval_path), cfg, docs_dir=docs_dir / "eval" if docs_dir else None, tokens=tokens
        )
    }
    leak_index = LeakIndex((clean_text(row) for row in outcomes["eval"].kept), cfg.leakage_ngram)
    outcomes["train"] = validate_rows(
        load(train_path),
        str(train_path),
        cfg,
        leak_index,
        docs_dir=docs_dir / "train" if docs_dir else None,
        tokens=tokens,
    )
    return outcomes
