"""The data gate: read instruction rows defensively, run a great-expectations suite, quarantine failures.

Rows that cannot be parsed (malformed JSON, non-UTF-8 bytes, not an object) never reach GX: they are
quarantined with the reason and their raw text. Parsed rows go through a GX 1.x suite: schema, types,
non-null, non-empty, length bounds, exact and near duplicates (the first copy is kept), PII (fineflow.data.pii;
or, with ``validate.pii: redact``, PII is replaced by typed placeholders before the checks run) and
train/eval leakage (fineflow.data.overlap). Each check has a category in ``validate.checks`` that sets its
severity: ``error`` quarantines the failing rows, ``warn`` keeps them and reports them.
Invariant: ``rows_in == rows_kept + rows_quarantined`` — nothing is dropped silently.

A hard failure (a required column absent from the whole file, no rows at all, an error-severity check
failing on more than its ``max_share`` of the rows, or more quarantined rows than
``validate.max_bad_share``) raises ``DataError`` naming the file, the first offending lines and checks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fineflow.config import CheckParams, ValidateParams
from fineflow.errors import DataError
from fineflow.data.overlap import LeakIndex, normalize
from fineflow.data.pii import find_pii, redact
from fineflow.tokenize.template import RenderError, encode_pair, render_pair

REQUIRED = ("instruction", "output")
OPTIONAL = ("input",)


@dataclass
class Row:
    line: int  # 1-based line number in the source file
    data: dict | None = None  # parsed object, None when it could not be parsed
    raw: str = ""  # raw text, kept for rows that could not be parsed
    reasons: list[str] = field(default_factory=list)  # failed error-severity checks: the row is quarantined
    warnings: list[str] = field(default_factory=list)  # failed warn-severity checks: kept, reported
    redacted: list[str] = field(default_factory=list)  # PII kinds replaced by placeholders (pii: redact)


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
        truncation = next((c.share for c in self.checks if c.category == "truncation"), None)
        return {
            "rows_in": self.rows_in, "rows_kept": len(self.kept), "rows_quarantined": len(self.quarantined),
            "truncation_rate": round(truncation, 5) if truncation is not None else None,
            "rows_warned": sum(1 for row in self.kept if row.warnings), "pii_redacted": redacted,
            "checks": {c.name: {"category": c.category, "expectation": c.expectation, "severity": c.severity,
                                "failed_rows": len(c.failed_lines), "share": round(c.share, 5),
                                "max_share": c.max_share, "passed": c.passed,
                                "first_failed_lines": c.failed_lines[:20]} for c in self.checks},
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


def read_csv(path: str | Path) -> list[Row]:
    """Every record of a CSV file (header first) as a Row numbered by its line in the file."""
    import csv

    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 (byte {exc.start}); re-encode the file as UTF-8") from None
    reader = csv.DictReader(text.splitlines(keepends=True))
    rows: list[Row] = []
    try:
        for record in reader:
            if None in record:  # more cells than header columns
                rows.append(Row(reader.line_num, raw=str(record)[:1000],
                                reasons=[f"{path}:{reader.line_num}: more cells than the header has columns"]))
            else:
                rows.append(Row(reader.line_num, data={k: v for k, v in record.items() if v is not None}))
    except csv.Error as exc:
        raise DataError(f"{path}:{reader.line_num}: malformed CSV ({exc})") from None
    if not rows:
        raise DataError(f"{path}: the file is empty (no rows below the header)")
    return rows


def read_parquet(path: str | Path) -> list[Row]:
    """Every row of a Parquet file as a Row numbered from 1."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: cannot read the file as Parquet ({exc})") from None
    rows = [Row(i, data={k: v for k, v in record.items() if v is not None})
            for i, record in enumerate(table.to_pylist(), start=1)]
    if not rows:
        raise DataError(f"{path}: the file is empty (no rows)")
    return rows


READERS = {"jsonl": read_jsonl, "csv": read_csv, "parquet": read_parquet}
EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet",
              ".pq": "parquet"}


def read_rows(path: str | Path, fmt: str = "auto") -> list[Row]:
    """Rows of a JSONL, CSV or Parquet file; with fmt "auto" the extension decides."""
    path = Path(path)
    if fmt == "auto":
        fmt = EXTENSIONS.get(path.suffix.lower())
        if fmt is None:
            raise DataError(f"{path}: cannot tell the format from the extension {path.suffix!r}; set "
                            f"data.format in params.yaml to jsonl, csv or parquet")
    return READERS[fmt](path)


CHAT_ROLES = ("system", "user", "assistant")


def chat_to_record(messages: object) -> tuple[dict | None, str | None]:
    """(instruction/input/output record, None) from an OpenAI-style messages list, or (None, problem).

    The last message must be the assistant's: it is the response. Everything before it is the prompt;
    a single (system +) user turn becomes the instruction as is, longer conversations one "Role: text"
    line per turn.
    """
    if not isinstance(messages, list) or not messages:
        return None, "messages must be a non-empty list of {role, content} objects"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            return None, f"messages[{i}].role must be one of {list(CHAT_ROLES)}"
        if not isinstance(message.get("content"), str):
            return None, f"messages[{i}].content must be a string"
    if messages[-1]["role"] != "assistant":
        return None, "the last message must be the assistant's response"
    prompt = messages[:-1]
    if not any(m["role"] == "user" for m in prompt):
        return None, "no user message before the assistant's response"
    if [m["role"] for m in prompt] in (["user"], ["system", "user"]):
        instruction = "\n".join(m["content"] for m in prompt)
    else:
        instruction = "\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in prompt)
    # the conversation itself travels on: the tokenizer's chat template (when it has one) renders it
    return {"instruction": instruction, "input": "", "output": messages[-1]["content"],
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages]}, None


def apply_mapping(rows: list[Row], mapping, source: str) -> list[Row]:
    """Rename source columns to the internal schema (instruction, input, output), in place.

    A mapped column that no row has is a wrong mapping, not bad rows: raise naming the key and the
    columns the file does have. A chat row whose messages are malformed is quarantined with the reason.
    """
    if mapping.messages is not None:
        wanted = {"messages": mapping.messages}
    else:
        wanted = {"instruction": mapping.instruction, "input": mapping.input, "output": mapping.output}
    present = {key for row in rows if row.data is not None for key in row.data}
    for field_name, column in wanted.items():
        if column is not None and (column != field_name or field_name == "messages") and present \
                and column not in present:
            raise DataError(f"{source}: params.yaml data.mapping.{field_name} is {column!r}, but no row has that "
                            f"column (columns found: {sorted(present)})")
    for row in rows:
        if row.data is None:
            continue
        if mapping.messages is None:
            row.data = {field_name: row.data[column] for field_name, column in wanted.items()
                        if column is not None and column in row.data}
            continue
        record, problem = chat_to_record(row.data.get(mapping.messages))
        if problem:
            row.raw, row.data = json.dumps(row.data, ensure_ascii=False, default=str)[:1000], None
            row.reasons.append(f"{source}:{row.line}: {problem}")
        else:
            row.data = record
    return rows


def _text(data: dict) -> str:
    """What the model will see (instruction, input, output joined); a missing or non-string field becomes
    text here instead of failing inside pandas."""
    return "\n".join(str(data.get(c) or "") for c in ("instruction", "input", "output"))


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
        return len(ids), sum(mask[:self.seq_len]), None


def _frame(rows: list[Row], leak_index: LeakIndex | None, tokens: TokenView | None, find_pii_kinds: bool):
    import pandas as pd

    present = {key for row in rows for key in row.data}
    columns = [c for c in (*REQUIRED, *OPTIONAL) if c in present]
    frame = pd.DataFrame([{c: row.data.get(c) for c in columns} for row in rows],
                         index=[row.line for row in rows], columns=columns)
    if "input" not in frame:
        frame["input"] = ""
    frame["input"] = frame["input"].where(frame["input"].notna(), "")
    texts = [_text(row.data) for row in rows]
    frame["text"] = texts
    frame["norm_key"] = [normalize(t) for t in texts]
    # Derived columns that GX then checks: the PII kinds found (None when clean) and the share of the
    # row's word n-grams that the eval data already contains.
    if find_pii_kinds:  # with pii: redact the spans were already replaced; scanning again finds nothing
        frame["pii_kinds"] = [",".join(sorted({s.kind for s in find_pii(t)})) or None for t in texts]
    if tokens is not None:
        measured = [tokens.measure(row.data) for row in rows]
        frame["n_tokens"] = [n for n, _, _ in measured]
        frame["trained_tokens"] = [t for _, t, _ in measured]
        frame["render_error"] = [error for _, _, error in measured]
    if leak_index is not None:
        frame["eval_overlap"] = [leak_index.overlap(t) for t in texts]
    return frame


def _suite(columns: list[str], cfg: ValidateParams, seq_len: int | None = None):
    """(check name, category, expectation) triples — the suite is data, so the report names each check."""
    import great_expectations.expectations as gxe

    checks = [(f"column_exists({col})", "schema", gxe.ExpectColumnToExist(column=col)) for col in REQUIRED]
    for col in REQUIRED:
        if col in columns:
            checks.append((f"not_null({col})", "non_null", gxe.ExpectColumnValuesToNotBeNull(column=col)))
            checks.append((f"type_str({col})", "types", gxe.ExpectColumnValuesToBeOfType(column=col, type_="str")))
    if "output" in columns:
        checks.append(("non_empty(output)", "non_empty",
                       gxe.ExpectColumnValueLengthsToBeBetween(column="output", min_value=1)))
    checks += [
        ("type_str(input)", "types", gxe.ExpectColumnValuesToBeOfType(column="input", type_="str")),
        ("length_chars(text)", "length_chars", gxe.ExpectColumnValueLengthsToBeBetween(
            column="text", min_value=cfg.min_chars, max_value=cfg.max_chars)),
        ("unique(row)", "duplicate", gxe.ExpectColumnValuesToBeUnique(column="text")),
        ("near_unique(normalized)", "near_duplicate", gxe.ExpectColumnValuesToBeUnique(column="norm_key")),
    ]
    if cfg.pii == "quarantine":
        checks.append(("no_pii(text)", "pii", gxe.ExpectColumnValuesToBeNull(column="pii_kinds")))
    if "n_tokens" in columns:
        checks.append(("fits_seq_len(tokens)", "truncation",
                       gxe.ExpectColumnValuesToBeBetween(column="n_tokens", max_value=seq_len)))
        checks.append(("label_coverage(tokens)", "label_coverage",
                       gxe.ExpectColumnValuesToBeBetween(column="trained_tokens", min_value=1)))
        checks.append(("chat_template_renders(row)", "chat_template",
                       gxe.ExpectColumnValuesToBeNull(column="render_error")))
    if "eval_overlap" in columns:
        checks.append(("no_leakage(eval)", "leakage", gxe.ExpectColumnValuesToBeBetween(
            column="eval_overlap", max_value=cfg.leakage_max_overlap)))
    return checks


def _run_gx(frame, checks, docs_dir: Path | None = None) -> dict[str, list[int] | None]:
    """Run the suite on the frame; return the failing index values (source line numbers) per check.

    A table-level check that fails (a column absent from the file) maps to None: no single row is at fault.
    With docs_dir, a checkpoint action also renders GX Data Docs (static HTML) there.
    """
    import logging

    import great_expectations as gx
    from great_expectations.checkpoint import UpdateDataDocsAction

    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = {"globally": False}
    actions = []
    if docs_dir is not None:
        context.add_data_docs_site("fineflow", {
            "class_name": "SiteBuilder", "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            "store_backend": {"class_name": "TupleFilesystemStoreBackend",
                              "base_directory": str(Path(docs_dir).resolve())}})
        actions.append(UpdateDataDocsAction(name="data_docs", site_names=["fineflow"]))
    batch_def = (context.data_sources.add_pandas("fineflow").add_dataframe_asset("rows")
                 .add_batch_definition_whole_dataframe("all"))
    suite = context.suites.add(gx.ExpectationSuite(name="fineflow_rows"))
    for _, _, expectation in checks:
        suite.add_expectation(expectation)
    definition = context.validation_definitions.add(gx.ValidationDefinition(name="rows", data=batch_def,
                                                                            suite=suite))
    checkpoint = context.checkpoints.add(gx.Checkpoint(name="fineflow", validation_definitions=[definition],
                                                       actions=actions,
                                                       result_format={"result_format": "COMPLETE"}))
    [result] = checkpoint.run(batch_parameters={"dataframe": frame}).run_results.values()
    # GX does not keep the suite's order in its results: key them by (expectation type, column).
    name_of = {(exp.expectation_type, exp.column): name for name, _, exp in checks}
    failing: dict[str, list[int] | None] = {name: [] for name, _, _ in checks}
    for res in result.results:
        name = name_of[(res.expectation_config.type, res.expectation_config.kwargs["column"])]
        if res.exception_info.get("raised_exception"):
            raise DataError(f"validation check {name} could not run: {res.exception_info.get('exception_message')}")
        if res.expectation_config.type == "expect_column_to_exist":
            failing[name] = None if not res.success else []
        else:
            failing[name] = [int(i) for i in res.result.get("unexpected_index_list") or []]
    return failing


def _detail(name: str, line: int, frame, first_seen: dict) -> str:
    """Extra words for a failed check's reason: which line a duplicate repeats, which PII kinds, ..."""
    if name == "unique(row)":
        return f" (first seen at line {first_seen['text'][frame.at[line, 'text']]})"
    if name == "near_unique(normalized)":
        return f" (same as line {first_seen['norm_key'][frame.at[line, 'norm_key']]} up to case/punctuation)"
    if name == "no_pii(text)":
        return f" ({frame.at[line, 'pii_kinds']})"
    if name == "fits_seq_len(tokens)":
        return f" ({frame.at[line, 'n_tokens']} tokens, truncated to tokenize.seq_len)"
    if name == "label_coverage(tokens)":
        return " (no response token left to train on after truncation)"
    if name == "chat_template_renders(row)":
        return f" ({frame.at[line, 'render_error']})"
    if name == "no_leakage(eval)":
        return f" ({frame.at[line, 'eval_overlap']:.0%} of its word n-grams are in the eval data)"
    return ""


def validate_rows(rows: list[Row], source: str, cfg: ValidateParams, leak_index: LeakIndex | None = None,
                  docs_dir: Path | None = None, tokens: TokenView | None = None) -> ValidationOutcome:
    """Run every check on rows; quarantine (error) or flag (warn) failing rows with file:line reasons."""
    parsed = [row for row in rows if row.data is not None]
    schema_problems: list[str] = []
    checks: list[CheckResult] = []
    if parsed:
        if cfg.pii == "redact":
            for row in parsed:
                _redact_row(row)
        frame = _frame(parsed, leak_index, tokens, find_pii_kinds=cfg.pii == "quarantine")
        suite = _suite(list(frame.columns), cfg, tokens.seq_len if tokens else None)
        failing = _run_gx(frame, suite, docs_dir)
        by_line = {row.line: row for row in parsed}
        first_seen: dict[str, dict[str, int]] = {"text": {}, "norm_key": {}}
        for column, seen in first_seen.items():
            for line, key in frame[column].items():
                seen.setdefault(key, line)
        for name, category, expectation in suite:
            lines = failing[name]
            if lines is None:
                column = name[name.index("(") + 1:-1]
                schema_problems.append(f"{source}: required field \"{column}\" is missing from every row ({name})")
                checks.append(CheckResult(name, category, expectation.expectation_type,
                                          [row.line for row in parsed], len(parsed)))
                continue
            if name in ("unique(row)", "near_unique(normalized)"):  # keep the first copy, flag the rest
                key = "text" if name == "unique(row)" else "norm_key"
                lines = [ln for ln in lines if first_seen[key][frame.at[ln, key]] != ln]
            # the schema is not negotiable: a required column missing from the file always blocks
            knobs = CheckParams(max_share=0.0) if category == "schema" else getattr(cfg.checks, category)
            checks.append(CheckResult(name, category, expectation.expectation_type, lines, len(parsed),
                                      knobs.severity, knobs.max_share))
            for line in lines:
                message = f"{source}:{line}: failed {name}{_detail(name, line, frame, first_seen)}"
                (by_line[line].reasons if knobs.severity == "error" else by_line[line].warnings).append(message)
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
    for check in outcome.checks:
        if check.severity == "error" and check.category != "schema" and not check.passed:  # schema: above
            problems.append(f"{outcome.source}: check {check.name} failed on {len(check.failed_lines)} of "
                            f"{check.rows} rows ({check.share:.1%}), above validate.checks.{check.category}"
                            f".max_share={check.max_share:g}; first lines: {check.failed_lines[:5]}")
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
    record = {"instruction": row.data["instruction"], "input": row.data.get("input") or "",
              "output": row.data["output"]}
    if row.data.get("messages"):
        record["messages"] = row.data["messages"]
    return record


def clean_text(row: Row) -> str:
    return _text(clean_record(row))


def quarantine_record(row: Row, split: str) -> dict:
    return {"split": split, "line": row.line, "reasons": row.reasons, "warnings": row.warnings,
            **({"row": row.data} if row.data is not None else {"raw": row.raw})}
