"""Reading instruction rows: JSONL, CSV or Parquet files, chat ``messages``, and the column mapping.

Readers stream: they yield one ``Row`` at a time, so a file of any size is read in bounded memory, and a row
over ``max_row_bytes`` (validate.max_row_bytes) is read in chunks, hashed and quarantined unparsed, so it
costs ``READ_CHUNK`` bytes, not ~11x its size in the gate's copies. They never raise on a bad row: a row that
cannot be used becomes a ``Row`` without data that carries its reason (too large, bad JSON, not UTF-8 — a
JSONL line or a CSV line alike —, an object with a duplicate key, nesting deeper than ``MAX_NESTING``, a lone
surrogate), so the gate (fineflow.data.validation) can quarantine it with everything else. They raise ``DataError`` only
when the whole file is unusable (unreadable, empty, wrong format) — when the stream reaches the problem.
Preference data (``apply_mapping(..., schema=PAIRS)``) maps to the prompt side plus ``chosen`` and ``rejected``;
feedback data (``schema=FEEDBACK``, KTO's) to an SFT row plus its ``label``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fineflow.data.conversations import call_text, normal_message
from fineflow.data.pii import PREVIEW_SOURCE_CHARS, redacted_preview
from fineflow.errors import DataError
from fineflow.objectives.interface import EXAMPLES, FEEDBACK, PAIRS

# The record every source is mapped onto (apply_mapping); the gate checks it and the tokenizer renders it.
REQUIRED = ("instruction", "output")
OPTIONAL = ("input",)
# A preference pair (train.objective dpo or simpo) has the same prompt side and two answers instead of output.
ANSWERS = ("chosen", "rejected")
PAIR_REQUIRED = ("instruction", *ANSWERS)
# Feedback (train.objective kto): an SFT row and its label, true for a desirable answer, false for an undesirable one.
LABEL = "label"
FEEDBACK_REQUIRED = (*REQUIRED, LABEL)
# Instruction data nests a few levels (chat: row -> messages -> message). Deeper rows are hostile or broken,
# and values nested near Python's recursion limit crash whatever later walks them (pickling, repr).
MAX_NESTING = 100


def required_fields(schema: str = EXAMPLES) -> tuple[str, ...]:
    """The fields every row of the row schema (fineflow.objectives.interface) must have."""
    return {EXAMPLES: REQUIRED, PAIRS: PAIR_REQUIRED, FEEDBACK: FEEDBACK_REQUIRED}[schema]


def example_text(data: dict) -> str:
    """What the model will see (instruction, input, output joined; a pair's prompt and both answers); a missing
    or non-string field becomes text here instead of failing inside pandas."""
    pair = any(answer in data for answer in ANSWERS)
    fields = ("instruction", "input", *ANSWERS) if pair else ("instruction", "input", "output")
    return "\n".join(str(data.get(c) or "") for c in fields)


@dataclass
class Row:
    """One source row: its data, or why it could not be read; the gate adds what it found wrong."""

    line: int  # 1-based line number in the source file
    data: dict | None = None  # parsed object, None when it could not be parsed
    raw: str = ""  # the start of the raw text (PREVIEW_SOURCE_CHARS), kept for rows that could not be parsed
    reasons: list[str] = field(default_factory=list)  # failed error-severity checks: the row is quarantined
    warnings: list[str] = field(default_factory=list)  # failed warn-severity checks: kept, reported
    redacted: list[str] = field(default_factory=list)  # PII kinds replaced by placeholders (pii: redact)
    digest: str = ""  # sha256 of the row's source bytes: names a rejected row without keeping it
    size: int = 0  # source bytes: the gate bounds its chunks by them


class _DuplicateKey(ValueError):
    pass


def _object_without_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """json's object hook: a key given twice makes the row ambiguous (json.loads would keep the last value)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return obj


def nesting_exceeds(value: object, limit: int = MAX_NESTING) -> bool:
    """Whether lists/dicts nest deeper than limit; iterative, so a deep value cannot exhaust the stack."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(value: object) -> bool:
    """A string holding half of a UTF-16 pair ("\\ud800"): valid JSON, but no UTF-8 file can hold it."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _short(key: str) -> str:
    return redacted_preview(key, 40)  # a key is structure, but it is still the user's text


def parse_json_row(raw_line: bytes, where: str) -> tuple[dict | None, str | None]:
    """(object, None) from one JSONL line, or (None, why the line cannot be a row)."""
    try:
        text = raw_line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"{where}: not UTF-8 (byte {exc.start})"
    try:
        obj = json.loads(text, object_pairs_hook=_object_without_duplicates)
    except _DuplicateKey as exc:
        return None, f'{where}: ambiguous JSON: key "{_short(str(exc))}" appears twice in one object'
    except json.JSONDecodeError as exc:
        return None, f"{where}: malformed JSON ({exc.msg} at column {exc.colno})"
    except RecursionError:  # thousands of nested [ or {: Python's parser gives up
        return None, f"{where}: JSON nested too deeply to read (over {MAX_NESTING} levels)"
    if not isinstance(obj, dict):
        return None, f"{where}: expected a JSON object, got {type(obj).__name__}"
    if nesting_exceeds(obj):
        return None, f"{where}: JSON nested too deeply to read (over {MAX_NESTING} levels)"
    if _SURROGATE_ESCAPE.search(raw_line) and _has_lone_surrogate(obj):
        return None, f"{where}: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text"
    return obj, None


def _open(path: Path):
    try:
        return path.open("rb")
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file ({exc.strerror})") from None


BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark is harmless; skipped rather than fail line 1
READ_CHUNK = 1 << 16  # a line over max_row_bytes is read this much at a time
HEAD_BYTES = 4 * PREVIEW_SOURCE_CHARS  # enough bytes for PREVIEW_SOURCE_CHARS characters of UTF-8


def _preview_source(raw: bytes) -> str:
    """The start of a row's bytes that a quarantine preview needs (PREVIEW_SOURCE_CHARS characters)."""
    return raw[:HEAD_BYTES].decode("utf-8", "replace")[:PREVIEW_SOURCE_CHARS]


def _skip_bom(fh) -> None:
    if fh.peek(len(BOM))[: len(BOM)] == BOM:
        fh.read(len(BOM))


@dataclass
class _Source:
    """The source bytes of one row (a JSONL line, or the lines of a CSV record) as they are read: held while
    within max_row_bytes, then only hashed, with the start its preview needs; and the first reason (a line
    not UTF-8) that it cannot be a row. An oversized row costs READ_CHUNK bytes at a time, whatever its size."""

    limit: int | None
    held: list[bytes] = field(default_factory=list)
    lines: int = 0
    size: int = 0
    hasher: Any = None  # sha256 of the bytes once over the limit (then they are no longer held)
    head: bytes = b""
    problem: str | None = None

    @property
    def oversized(self) -> bool:
        return self.hasher is not None

    def add(self, data: bytes) -> None:
        self.size += len(data)
        if self.hasher is None and (self.limit is None or self.size <= self.limit):
            self.held.append(data)
            return
        if self.hasher is None:
            held, self.held = b"".join(self.held), []
            self.hasher, self.head = hashlib.sha256(held), held[:HEAD_BYTES]
        self.head += data[: max(0, HEAD_BYTES - len(self.head))]
        self.hasher.update(data)

    def read_line(self, fh) -> bytes | int | None:
        """Read the file's next line (split on \\n only, never on U+2028) into the source. Returns the line
        without its \\n; once the source is over the limit, the count of double quotes in the line instead
        (the line is not kept); None at the end of the file."""
        piece = fh.readline() if self.limit is None else fh.readline(self.limit + 1)
        if not piece:
            return None
        if self.lines:
            self.add(b"\n")  # between two lines of one record
        self.lines += 1
        quotes = 0
        while True:
            ended = piece.endswith(b"\n")
            content = piece[:-1] if ended else piece
            self.add(content)
            quotes += content.count(b'"')
            if ended or not piece or not self.oversized:
                return quotes if self.oversized else content
            piece = fh.readline(READ_CHUNK)

    def digest(self, strip: bytes = b"") -> str:
        """sha256 of the row's bytes (without the final newline): names a rejected row without keeping it."""
        return (
            self.hasher.hexdigest() if self.oversized else hashlib.sha256(b"".join(self.held).strip(strip)).hexdigest()
        )

    def rejected(self, line: int, reason: str, strip: bytes = b"") -> Row:
        raw = self.head if self.oversized else b"".join(self.held)
        return Row(line, raw=_preview_source(raw), reasons=[reason], digest=self.digest(strip), size=self.size)

    def too_large(self, where: str) -> str:
        over = f"over validate.max_row_bytes={self.limit:,}"
        return f"{where}: the row is {self.size:,} bytes, {over} (quarantined unparsed)"


def read_jsonl(path: str | Path, max_row_bytes: int | None = None) -> Iterator[Row]:
    """Every line of a JSONL file as a Row, one at a time; unusable lines carry their reason, and a line over
    max_row_bytes is quarantined without being held or parsed."""
    path = Path(path)
    any_rows = False
    with _open(path) as fh:
        _skip_bom(fh)
        for number in itertools.count(1):
            source = _Source(max_row_bytes)
            raw_line = source.read_line(fh)
            if raw_line is None:
                break
            where = f"{path}:{number}"
            if source.oversized:
                any_rows = True
                yield source.rejected(number, source.too_large(where))
                continue
            if not raw_line.strip():
                continue
            any_rows = True
            obj, problem = parse_json_row(raw_line, where)
            row = (
                source.rejected(number, problem)
                if problem
                else Row(number, data=obj, digest=source.digest(), size=source.size)
            )
            del raw_line, source  # not held while the row is checked: a line can be many megabytes
            yield row
    if not any_rows:
        raise DataError(
            f"{path}: the file is empty (no rows); point data.train_path at a JSONL file with one object per line"
        )


class _CsvLines:
    """A CSV file's lines for csv.reader, decoded one by one: split on \\n only (str.splitlines would also
    split cells on U+2028, U+2029, \\x85 ...), each record's source bytes collected for ``take``.

    A line that is not UTF-8 makes its record a quarantined row naming the line (decoded with U+FFFD, so
    the cells and quotes around it parse as they are). Once a record is over max_row_bytes, csv.reader gets
    a stand-in for each further line, a lone quote or "x" as the line has an odd or even number of quotes
    (so it leaves a quoted cell open or closed as the line does): the record ends where the file says, and
    neither this class nor csv.reader ever holds it."""

    def __init__(self, fh, path: Path, limit: int | None):
        self.fh, self.path, self.limit, self.number = fh, path, limit, 0
        self.source = _Source(limit)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        line = self.source.read_line(self.fh)
        if line is None:
            raise StopIteration
        self.number += 1
        if self.source.oversized:
            return '"\n' if line % 2 else "x\n"
        try:
            return line.decode("utf-8") + "\n"
        except UnicodeDecodeError as exc:
            if self.source.problem is None:
                self.source.problem = f"{self.path}:{self.number}: not UTF-8 (byte {exc.start} of the line)"
            return line.decode("utf-8", "replace") + "\n"

    def take(self) -> _Source:
        """The source of the record read since the last take; the next record starts afresh."""
        source, self.source = self.source, _Source(self.limit)
        return source


def _csv_row(source: _Source, line: int, record: dict, where: str) -> Row:
    if source.oversized:
        return source.rejected(line, source.too_large(where))
    problem = source.problem or (f"{where}: more cells than the header has columns" if None in record else None)
    if problem:
        return source.rejected(line, problem, strip=b"\r\n")
    data = {k: v for k, v in record.items() if v is not None}
    return Row(line, data=data, digest=source.digest(strip=b"\r\n"), size=source.size)


def read_csv(path: str | Path, max_row_bytes: int | None = None) -> Iterator[Row]:
    """Every record of a CSV file (header first) as a Row numbered by its line in the file, one at a time."""
    import csv

    path = Path(path)
    any_rows = False
    # csv refuses a cell over 128 KiB by default, which would fail the whole file; an over-long row is the
    # length check's (or max_row_bytes') to quarantine, as in JSONL
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))
    with _open(path) as fh:
        _skip_bom(fh)
        lines = _CsvLines(fh, path, max_row_bytes)
        reader = csv.DictReader(lines)
        try:
            if reader.fieldnames is not None:
                _check_header(lines.take(), path)
            for record in reader:
                any_rows = True
                yield _csv_row(lines.take(), reader.line_num, record, f"{path}:{reader.line_num}")
        except csv.Error as exc:
            raise DataError(f"{path}:{reader.line_num}: malformed CSV ({exc})") from None
    if not any_rows:
        raise DataError(f"{path}: the file is empty (no rows below the header)")


def _check_header(header: _Source, path: Path) -> None:
    """The header names the columns: one that cannot be read fails the file, not a row."""
    if header.oversized:
        raise DataError(f"{path}:1: the header is over validate.max_row_bytes={header.limit:,} bytes")
    if header.problem:
        raise DataError(f"{header.problem} in the header; re-encode the file as UTF-8")


def read_parquet(path: str | Path, batch_rows: int = 10_000, max_row_bytes: int | None = None) -> Iterator[Row]:
    """Every row of a Parquet file as a Row numbered from 1, read in record batches. A row's size is its
    canonical JSON's: pyarrow has read it by then, so max_row_bytes bounds the gate's copies, not the read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=batch_rows)
        number = 0
        for batch in batches:
            for record in batch.to_pylist():
                number += 1
                yield record_row(record, number, f"{path}:{number}", max_row_bytes)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: cannot read the file as Parquet ({exc})") from None
    if not number:
        raise DataError(f"{path}: the file is empty (no rows)")


def record_row(record: dict, number: int, where: str, max_row_bytes: int | None) -> Row:
    """A row from a decoded record (Parquet, a saved dataset): its size and hash are its canonical JSON's."""
    data = {k: v for k, v in record.items() if v is not None}
    source = _Source(max_row_bytes)
    source.add(json.dumps(data, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8", "replace"))
    if source.oversized:
        return source.rejected(number, source.too_large(where))
    if nesting_exceeds(data):
        return source.rejected(number, f"{where}: nested too deeply to read (over {MAX_NESTING} levels)")
    return Row(number, data=data, digest=source.digest(), size=source.size)


READERS = {"jsonl": read_jsonl, "csv": read_csv, "parquet": read_parquet}
EXTENSIONS = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}


def read_rows(path: str | Path, fmt: str = "auto", max_row_bytes: int | None = None) -> Iterator[Row]:
    """Rows of a JSONL, CSV or Parquet file, one at a time; with fmt "auto" the extension decides. A row over
    max_row_bytes (validate.max_row_bytes) comes quarantined, unparsed."""
    path = Path(path)
    if fmt == "auto":
        fmt = EXTENSIONS.get(path.suffix.lower())
        if fmt is None:
            raise DataError(
                f"{path}: cannot tell the format from the extension {path.suffix!r}; set "
                f"data.format in params.yaml to jsonl, csv or parquet"
            )
    return READERS[fmt](path, max_row_bytes=max_row_bytes)


def chat_to_record(messages: object, tools: object = None, pairs: bool = False) -> tuple[dict | None, str | None]:
    """(instruction/input/output record, None) from an OpenAI-style messages list, or (None, problem).

    The record keeps the conversation in normal form (fineflow.data.conversations), and the tool definitions
    of the row (``tools``) when it has some: the tokenizer's chat template renders them. Its derived fields
    are what the text checks read: the final message is the output, everything before it the instruction (a
    single (system +) user turn as is, longer conversations one "Role: text" line per turn, tool calls
    written out). Whether the turns are in order is the gate's check (fineflow.data.checks), not a reason to
    refuse the row here. A preference pair's conversation (``pairs``) is all prompt: it ends before the answer
    (its chosen and rejected), so the record has no output.
    """
    if not isinstance(messages, list) or not messages:
        return None, "messages must be a non-empty list of {role, content} objects"
    normal = []
    for i, message in enumerate(messages):
        message, problem = normal_message(i, message)
        if problem:
            return None, problem
        normal.append(message)
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return None, "tools must be a list of tool definitions ({type, function: {name, parameters}} objects)"
    prompt = normal if pairs else normal[:-1]
    if [m["role"] for m in prompt] in (["user"], ["system", "user"]):
        instruction = "\n".join(m["content"] for m in prompt)
    else:
        instruction = "\n".join(f"{m['role'].capitalize()}: {_turn_text(m)}" for m in prompt)
    # the conversation itself travels on: the tokenizer's chat template (when it has one) renders it
    answer = {} if pairs else {"output": _turn_text(normal[-1])}
    record = {"instruction": instruction, "input": "", **answer, "messages": normal}
    return ({**record, "tools": tools} if tools else record), None


def normal_answer(value: object) -> tuple[object, str | None]:
    """A preference answer as its text: a string as is, TRL's conversational form (one assistant message,
    ``[{"role": "assistant", "content": "..."}]``) as its content. Other structures are (None, the problem);
    any other value (null, a number) is left for the gate's not_null and type_str checks to name."""
    if not isinstance(value, (list, dict)):
        return value, None
    message = value[0] if isinstance(value, list) and len(value) == 1 else None
    if isinstance(message, dict) and message.get("role") == "assistant" and isinstance(message.get("content"), str):
        return message["content"], None
    return None, 'must be a string or one assistant message [{"role": "assistant", "content": "..."}]'


def _turn_text(message: dict) -> str:
    calls = " ".join(call_text(call) for call in message.get("tool_calls", []))
    return f"{message['content']} {calls}".strip() if calls else message["content"]


def _wanted_columns(mapping, schema: str = EXAMPLES) -> dict[str, str | None]:
    answers = {answer: getattr(mapping, answer) for answer in ANSWERS} if schema == PAIRS else {}
    label = {LABEL: mapping.label} if schema == FEEDBACK else {}
    if mapping.messages is not None:
        return {"messages": mapping.messages, **answers, **label}
    if schema == PAIRS:
        return {"instruction": mapping.instruction, "input": mapping.input, **answers}
    return {"instruction": mapping.instruction, "input": mapping.input, "output": mapping.output, **label}


def _renamed(wanted: dict[str, str | None]) -> dict[str, str]:
    """The mapped columns a file must have somewhere: a renamed one (an identity mapping of a required
    field that no row has is the schema check's failure, not a wrong mapping)."""
    return {
        name: column for name, column in wanted.items() if column is not None and (column != name or name == "messages")
    }


def apply_mapping(
    rows: Iterable[Row], mapping, source: str, key: str = "data.mapping", schema: str = EXAMPLES
) -> Iterator[Row]:
    """Rename source columns to the internal schema (instruction, input, output; PAIRS, preference data:
    instruction, input, chosen, rejected; FEEDBACK: instruction, input, output, label), row by row.

    A mapped column that no row has is a wrong mapping, not bad rows: when the stream ends without having
    seen it, raise naming the key (``key``: data.mapping, or a source's) and the columns the file does have.
    A chat row whose messages are malformed, or a pair whose answer is neither text nor one assistant
    message, is quarantined with the reason.
    """
    wanted = _wanted_columns(mapping, schema)
    unseen = _renamed(wanted)
    present: set[str] = set()  # only while some mapped column is unseen, and at most 1,000 names
    for row in rows:
        if row.data is not None and unseen:
            present.update(list(row.data)[: max(0, 1000 - len(present))])
            unseen = {name: column for name, column in unseen.items() if column not in row.data}
        yield _mapped(row, mapping, wanted, source, schema)
    if unseen and present:
        name, column = next(iter(unseen.items()))
        raise DataError(
            f"{source}: params.yaml {key}.{name} is {column!r}, but no row has that "
            f"column (columns found: {sorted(present)})"
        )


def _mapped(row: Row, mapping, wanted: dict[str, str | None], source: str, schema: str = EXAMPLES) -> Row:
    if row.data is None:
        return row
    answers, problem = _answers(row.data, wanted) if schema == PAIRS else ({}, None)
    if problem is None and mapping.messages is None:
        record = {
            name: row.data[column] for name, column in wanted.items() if column is not None and column in row.data
        }
    elif problem is None:
        record, problem = chat_to_record(row.data.get(mapping.messages), row.data.get("tools"), schema == PAIRS)
        if record is not None and LABEL in wanted and wanted[LABEL] in row.data:
            record[LABEL] = row.data[wanted[LABEL]]
    if problem:
        row.raw = json.dumps(row.data, ensure_ascii=False, default=str)[:PREVIEW_SOURCE_CHARS]
        row.data = None
        row.reasons.append(f"{source}:{row.line}: {problem}")
    else:
        row.data = {**record, **answers}
    return row


def _answers(data: dict, wanted: dict[str, str | None]) -> tuple[dict, str | None]:
    """A pair's chosen and rejected as text (normal_answer), or the problem naming the field and its column."""
    answers = {}
    for answer in ANSWERS:
        column = wanted[answer]
        if column in data:
            answers[answer], problem = normal_answer(data[column])
            if problem:
                return {}, f'field "{answer}" (column {column!r}) {problem}'
    return answers, None
