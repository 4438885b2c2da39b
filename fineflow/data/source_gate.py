"""The data gate over each of ``data.sources``, one source at a time, its result kept by content.

A source's result (its kept rows, its quarantine, its redaction log and its outcome) is a function of: the
source's content, how it is read (kind, format, split, mapping), the validate params, how the tokenize stage
will see a row (the base's tokenizer and chat template, tokenize.seq_len and train_on), the kept eval rows
(leakage is checked against them) and the gate's code. ``source_key`` hashes exactly those, and the result
lives in ``<cache>/<key>/``, a persisted DVC output (as data/shards is): a re-run whose key is already there
reads it instead of validating again. So changing a source's weight re-mixes without validating anything, and
adding a source validates only that one. Entries no current source uses are removed at the end of a run.

A cached source that failed the gate fails it again, with the same message: the outcome keeps the verdict.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from fineflow import __version__
from fineflow.core.config import Params
from fineflow.core.reports import read_json, write_json_atomic
from fineflow.data.formats import apply_mapping
from fineflow.data.overlap import LeakIndex
from fineflow.data.sources import Source, read_source
from fineflow.data.tokens import TokenView
from fineflow.data.validation import JsonlSink, raise_if_blocked, validate_stream
from fineflow.errors import DataError
from fineflow.objectives import EXAMPLES, PAIRS, objective_for

KEPT, QUARANTINE, REDACTIONS, OUTCOME = "kept.jsonl", "quarantine.jsonl", "redactions.jsonl", "outcome.json"
_CODE = ("data", "tokenize")  # the packages whose code decides a row's verdict


def code_digest() -> str:
    """sha256 of the gate's code (fineflow/data and fineflow/tokenize): new checks make new results."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256(__version__.encode())
    for path in sorted(p for package in _CODE for p in (root / package).glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def token_identity(tokens: TokenView | None) -> dict | None:
    """How the token checks see a row: the tokenizer, its chat template, seq_len and train_on."""
    if tokens is None:
        return None
    from fineflow.tokenize.shards import tokenizer_hash

    template = getattr(tokens.tokenizer, "chat_template", None) or ""
    return {
        "tokenizer": tokenizer_hash(tokens.tokenizer),
        "chat_template": hashlib.sha256(str(template).encode()).hexdigest(),
        "seq_len": tokens.seq_len,
        "train_on": tokens.train_on,
    }


def source_key(source: Source, content: str, params: Params, tokens: dict | None, eval_sha: str, code: str) -> str:
    """What the source's validation result is a function of, as one id (module docstring)."""
    spec = source.spec
    mapping = spec.mapping or params.data.mapping
    parts = {
        "content": content,
        "read": [source.kind, spec.format, spec.split],
        "mapping": mapping.model_dump(),
        "validate": params.validate_.model_dump(mode="json"),
        "tokens": tokens,
        "eval": eval_sha,
        "code": code,
    }
    # preference pairs or feedback: another mapping and other checks (SFT keys as before)
    schema = objective_for(params.train.objective).rows
    if schema != EXAMPLES:
        parts["objective"] = "preference" if schema == PAIRS else schema
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class SourceResult:
    """A source's validation result, as the mix and the report read it."""

    source: Source
    key: str
    folder: Path
    outcome: dict  # report, blocked (the gate's message or None)
    validated: bool  # False: read from the cache

    @property
    def rows_kept(self) -> int:
        return self.outcome["report"]["rows_kept"]

    def raise_if_blocked(self) -> None:
        if self.outcome["blocked"]:
            raise DataError(self.outcome["blocked"])


def validate_source(
    source: Source,
    key: str,
    cache: Path,
    params: Params,
    leak_index: LeakIndex,
    tokens: TokenView | None,
    docs_dir: Path | None,
) -> SourceResult:
    """The source's result from the cache when its key is there, else validated into it (built in a temp
    folder and renamed in, so a killed run leaves no half entry)."""
    folder = cache / key
    if (folder / OUTCOME).is_file():
        return SourceResult(source, key, folder, read_json(folder / OUTCOME), validated=False)
    building = cache / f".tmp-{key}"
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    outcome = _validate_into(building, source, params, leak_index, tokens, docs_dir)
    write_json_atomic(building / OUTCOME, outcome)
    building.rename(folder)
    return SourceResult(source, key, folder, outcome, validated=True)


def _validate_into(folder: Path, source: Source, params: Params, leak_index, tokens, docs_dir) -> dict:
    cfg = params.validate_
    mapping = source.spec.mapping or params.data.mapping
    key = f"data.sources[{source.index}].mapping" if source.spec.mapping else "data.mapping"
    schema = objective_for(params.train.objective).rows
    rows = apply_mapping(read_source(source, cfg.max_row_bytes), mapping, source.label, key, schema)
    with ExitStack() as stack:
        names = (KEPT, QUARANTINE, REDACTIONS)
        files = (stack.enter_context((folder / name).open("w", encoding="utf-8")) for name in names)
        sink = JsonlSink("train", *files)
        outcome = validate_stream(rows, source.label, cfg, sink, leak_index, docs_dir, tokens, "train", schema=schema)
    try:
        raise_if_blocked(outcome, cfg)
        blocked = None
    except DataError as exc:
        blocked = str(exc)
    return {"report": outcome.report(), "blocked": blocked}


def prune(cache: Path, keep: set[str]) -> list[str]:
    """Remove the cache entries (and torn temp folders) no current source uses; their names."""
    removed = []
    for entry in sorted(cache.iterdir()) if cache.is_dir() else []:
        if entry.name not in keep:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed
