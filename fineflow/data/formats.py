"""Reading instruction rows: JSONL, CSV or Parquet files, chat ``messages``, and the column mapping.

Readers never raise on a bad row: a line that cannot be parsed becomes a ``Row`` without data that carries
its reason, so the gate (fineflow.data.validation) can quarantine it with everything else. They raise
``DataError`` only when the whole file is unusable (unreadable, empty, wrong format).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fineflow.errors import DataError

# The record every source is mapped onto (apply_mapping); the gate checks it and the tokenizer renders it.
REQUIRED = ("instruction", "output")
OPTIONAL = ("input",)


def example_text(data: dict) -> str:
    """What the model will see (instruction, input, output joined); a missing or non-string field becomes
    text here instead of failing inside pandas."""
    return "\n".join(str(data.get(c) or "") for c in ("instruction", "input", "output"))


@dataclass
class Row:
    """One source row: its data, or why it could not be read; the gate adds what it found wrong."""

    line: int  # 1-based line number in the source file
    data: dict | None = None  # parsed object, None when it could not be parsed
    raw: str = ""  # raw text, kept for rows that could not be parsed
    reasons: list[str] = field(default_factory=list)  # failed error-severity checks: the row is quarantined
    warnings: list[str] = field(default_factory=list)  # failed warn-severity checks: kept, reported
    redacted: list[str] = field(default_factory=list)  # PII kinds replaced by placeholders (pii: redact)


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
            rows.append(
                Row(
                    number,
                    raw=raw_line.decode("utf-8", "replace"),
                    reasons=[f"{path}:{number}: not UTF-8 (byte {exc.start})"],
                )
            )
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            rows.append(
                Row(
                    number,
                    raw=text[:1000],
                    reasons=[f"{path}:{number}: malformed JSON ({exc.msg} at column {exc.colno})"],
                )
            )
            continue
        except RecursionError:  # thousands of nested [ or {: Python's parser gives up; the row is quarantined
            rows.append(Row(number, raw=text[:1000], reasons=[f"{path}:{number}: JSON nested too deeply to read"]))
            continue
        if not isinstance(obj, dict):
            rows.append(
                Row(
                    number,
                    raw=text[:1000],
                    reasons=[f"{path}:{number}: expected a JSON object, got {type(obj).__name__}"],
                )
            )
            continue
        rows.append(Row(number, data=obj))
    if not rows:
        raise DataError(
            f"{path}: the file is empty (no rows); point data.train_path at a JSONL file with one object per line"
        )
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
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 (byte {exc.start}); re-encode the file as UTF-8") from None
    reader = csv.DictReader(text.splitlines(keepends=True))
    rows: list[Row] = []
    try:
        for record in reader:
            if None in record:  # more cells than header columns
                rows.append(
                    Row(
                        reader.line_num,
                        raw=str(record)[:1000],
                        reasons=[f"{path}:{reader.line_num}: more cells than the header has columns"],
                    )
                )
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
    rows = [
        Row(i, data={k: v for k, v in record.items() if v is not None})
        for i, record in enumerate(table.to_pylist(), start=1)
    ]
    if not rows:
        raise DataError(f"{path}: the file is empty (no rows)")
    return rows


READERS = {"jsonl": read_jsonl, "csv": read_csv, "parquet": read_parquet}
EXTENSIONS = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}


def read_rows(path: str | Path, fmt: str = "auto") -> list[Row]:
    """Rows of a JSONL, CSV or Parquet file; with fmt "auto" the extension decides."""
    path = Path(path)
    if fmt == "auto":
        fmt = EXTENSIONS.get(path.suffix.lower())
        if fmt is None:
            raise DataError(
                f"{path}: cannot tell the format from the extension {path.suffix!r}; set "
                f"data.format in params.yaml to jsonl, csv or parquet"
            )
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
    return {
        "instruction": instruction,
        "input": "",
        "output": messages[-1]["content"],
        "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
    }, None


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
        if (
            column is not None
            and (column != field_name or field_name == "messages")
            and present
            and column not in present
        ):
            raise DataError(
                f"{source}: params.yaml data.mapping.{field_name} is {column!r}, but no row has that "
                f"column (columns found: {sorted(present)})"
            )
    for row in rows:
        if row.data is None:
            continue
        if mapping.messages is None:
            row.data = {
                field_name: row.data[column]
                for field_name, column in wanted.items()
                if column is not None and column in row.data
            }
            continue
        record, problem = chat_to_record(row.data.get(mapping.messages))
        if problem:
            row.raw, row.data = json.dumps(row.data, ensure_ascii=False, default=str)[:1000], None
            row.reasons.append(f"{source}:{row.line}: {problem}")
        else:
            row.data = record
    return rows
