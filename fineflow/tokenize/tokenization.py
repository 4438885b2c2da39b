"""Streaming, parallel tokenization of validated rows into packed shards, with memory flat in dataset size.

Rows are read lazily in chunks; chunks are encoded by ``workers`` processes (the Rust tokenizer runs one
thread per process here, TOKENIZERS_PARALLELISM=false) and come back in input order as flat arrays
(``EncodedBatch``: a few numpy buffers to unpickle, not millions of Python ints), so the output is
byte-identical whatever the worker count. Examples are packed within windows of ``pack_window``
examples and each window's rows are appended to the shard files: memory holds one window, never the
dataset. Preference pairs (train.objective dpo or simpo) go the same way, two examples per row of the rows
file, packed a pair at a time (fineflow.tokenize.pairs).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np

from fineflow import __version__
from fineflow.core.reports import sha256_file
from fineflow.errors import FineflowError
from fineflow.objectives import EXAMPLES, FEEDBACK, NAMES, PAIRS, objective_for
from fineflow.tokenize.pairs import (
    FEEDBACK_RENDERING,
    PAIR_RENDERING,
    encode_feedback,
    encode_pairs,
    pack_feedback,
    pack_pairs,
)
from fineflow.tokenize.shards import (
    FORMAT_VERSION,
    ShardWriter,
    pack_examples,
    shard_key_matches,
    token_dtype,
    tokenizer_hash,
)
from fineflow.tokenize.template import (
    EncodedBatch,
    RenderError,
    WrongObjective,
    chat_turns_rule,
    encode_batch,
    template_hash,
)

_WORKER_TOKENIZER = None
_WORKER_TRAIN_ON = "all_assistant"
_WORKER_SCHEMA = EXAMPLES
CHAT_ROW = b'"messages": ['  # how a validated chat row (json.dumps of clean_record) holds its conversation


def _init_worker(base: str, train_on: str, schema: str = EXAMPLES) -> None:
    global _WORKER_TOKENIZER, _WORKER_TRAIN_ON, _WORKER_SCHEMA
    from transformers import AutoTokenizer

    _WORKER_TOKENIZER = AutoTokenizer.from_pretrained(base)
    _WORKER_TRAIN_ON, _WORKER_SCHEMA = train_on, schema


def _parsed(chunk: list) -> list[dict]:
    """Rows as dicts; raw JSON lines are parsed here, i.e. in the worker when there are workers."""
    return [json.loads(item) if isinstance(item, str) else item for item in chunk]


def _encode_chunk(numbered: tuple[int, list]) -> EncodedBatch:
    first_row, chunk = numbered
    return _encode(_WORKER_TOKENIZER, _parsed(chunk), _WORKER_TRAIN_ON, first_row, _WORKER_SCHEMA)


def _encode(tokenizer, rows: list[dict], train_on: str, first_row: int, schema: str) -> EncodedBatch:
    """A chunk's examples: one per row, two per preference pair (chosen, rejected), two per feedback row (its
    answer, its KL sample)."""
    if schema == PAIRS:
        return encode_pairs(tokenizer, rows, first_row)
    if schema == FEEDBACK:
        return encode_feedback(tokenizer, rows, first_row)
    return encode_batch(tokenizer, rows, train_on, first_row)


def read_lines(path: Path) -> Iterator[str]:
    """The rows file's non-blank lines, unparsed: JSON parsing is left to whoever encodes them, so with
    workers the main process only reads and ships bytes."""
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield line


def read_rows_lazily(path: Path) -> Iterator[dict]:
    return (json.loads(line) for line in read_lines(path))


def chunks(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while chunk := list(islice(iterator, size)):
        yield chunk


def encode_stream(
    rows: Iterable[dict | str],
    tokenizer,
    base: str,
    workers: int,
    chunk_rows: int = 2000,
    train_on: str = "all_assistant",
    schema: str = EXAMPLES,
) -> Iterator[EncodedBatch]:
    """Encoded chunks of rows (dicts or raw JSON lines), in input order; workers > 1 encodes chunks in a
    process pool. ``schema``: the rows' schema (PAIRS, FEEDBACK: two examples a row)."""
    numbered = ((1 + i * chunk_rows, chunk) for i, chunk in enumerate(chunks(rows, chunk_rows)))
    if workers == 1:
        for first_row, chunk in numbered:
            yield _encode(tokenizer, _parsed(chunk), train_on, first_row, schema)
        return
    context = multiprocessing.get_context("spawn")  # no fork of a parent that may hold torch threads
    with context.Pool(workers, initializer=_init_worker, initargs=(base, train_on, schema)) as pool:
        yield from pool.imap(_encode_chunk, numbered)


def windows(batches: Iterable[EncodedBatch], size: int) -> Iterator[EncodedBatch]:
    """Regroup encoded chunks into windows of exactly `size` examples (the last may be shorter), so the
    packing — and the shard bytes — do not depend on how the rows were chunked."""
    pending: list[EncodedBatch] = []
    count = 0
    for batch in batches:
        pending.append(batch)
        count += len(batch)
        while count >= size:
            merged = EncodedBatch.concat(pending)
            head, tail = merged.split(size)
            yield head
            pending, count = ([tail] if len(tail) else []), len(tail)
    if count:
        yield EncodedBatch.concat(pending)


def tokenize_to_shard(
    rows: Iterable[dict | str],
    tokenizer,
    base: str,
    out_dir: Path,
    seq_len: int,
    dtype: np.dtype,
    workers: int,
    pack_window: int,
    meta: dict,
    train_on: str = "all_assistant",
    schema: str = EXAMPLES,
) -> dict:
    """Encode, pack window by window and append to a shard directory; returns the shard's meta. Each example
    (a whole conversation of a chat row) is packed whole into one row, where it attends only to itself; each
    preference pair (``schema`` PAIRS) or feedback row (FEEDBACK) whole into one row, its two examples side by
    side."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pairs = schema in (PAIRS, FEEDBACK)
    writer = ShardWriter(out_dir, seq_len, dtype, pairs, feedback=schema == FEEDBACK)
    truncated = 0
    encoded = encode_stream(rows, tokenizer, base, workers, min(2000, pack_window), train_on, schema)
    pack = {PAIRS: pack_pairs, FEEDBACK: pack_feedback}.get(schema, pack_examples)
    # a window of pairs holds an even count of examples: chunks hold whole pairs, so no pair is cut in two
    for window in windows(encoded, max(2, pack_window - pack_window % 2) if pairs else pack_window):
        arrays, cut = pack(window, seq_len, pad_id, dtype)
        writer.append(arrays)
        truncated += cut
    # the worker count is not recorded: it must not change the shard (or its DVC hash)
    return writer.close({**meta, "truncated_examples": truncated, "pack_window": pack_window})


def load_tokenizer(base: str):
    """The base model's tokenizer, refused when it cannot end a response (no EOS token)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    if tokenizer.eos_token_id is None:
        raise FineflowError(f"{base}: the tokenizer has no EOS token; fine-tuning needs one to end responses")
    return tokenizer


def has_chat_rows(rows_path: Path, block: int = 1 << 20) -> bool:
    """Whether a validated rows file holds a chat row: read in blocks, as bytes (a quote inside a JSON string
    is escaped, so the marker occurs only as a row's key)."""
    tail = b""
    with rows_path.open("rb") as fh:
        while data := fh.read(block):
            if CHAT_ROW in tail + data:
                return True
            tail = data[-len(CHAT_ROW) :]
    return False


def _schema(objective: str | None) -> str:
    """train.objective's row schema (None: instruction rows, as an SFT run's)."""
    return EXAMPLES if objective is None else objective_for(objective).rows


def split_template_hash(rows_path: Path, tokenizer, cfg, objective: str | None = None) -> str:
    """The template hash of one split: with the chat-turn rule and tokenize.train_on when its rows hold
    conversations (they decide which of their tokens are trained), without for instruction rows; for
    preference pairs, the pair rule (their chat rows always train the final reply only)."""
    if _schema(objective) == PAIRS:
        return template_hash(tokenizer, PAIR_RENDERING)
    if _schema(objective) == FEEDBACK:
        return template_hash(tokenizer, FEEDBACK_RENDERING)
    rule = chat_turns_rule(tokenizer, cfg.train_on) if has_chat_rows(rows_path) else None
    return template_hash(tokenizer, rule)


def content_key(rows_path: Path, tokenizer, cfg, objective: str | None = None) -> str:
    """What a shard is a function of: the rows, the tokenizer, the template, the packing and the format, and
    for preference pairs the objective (an SFT shard is never reused for pairs, nor the reverse; an SFT key
    is as it always was). (Not the worker count: it does not change a byte.)"""
    parts = [
        sha256_file(rows_path),
        tokenizer_hash(tokenizer),
        split_template_hash(rows_path, tokenizer, cfg, objective),
        str(cfg.seq_len),
        str(cfg.pack_window),
        str(FORMAT_VERSION),
    ]
    if _schema(objective) == PAIRS:
        parts.append("objective=preference")  # every pair objective trains the same shards
    elif _schema(objective) == FEEDBACK:
        parts.append("objective=feedback")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def tokenize_split(tokenizer, base: str, rows_path: Path, out_dir: Path, cfg, objective: str | None = None) -> dict:
    """Build one split's shard, or keep the existing one when its content key matches. Built in a temp dir
    and swapped in, so a reader never sees a half-written shard. With a preference objective (dpo, simpo)
    the rows are pairs and the shard a preference shard."""
    key = content_key(rows_path, tokenizer, cfg, objective)
    existing = shard_key_matches(out_dir, key)
    if existing is not None:
        return {**existing, "reused": True}
    meta = {
        "vocab_size": len(tokenizer),
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "template_hash": split_template_hash(rows_path, tokenizer, cfg, objective),
        "code_version": __version__,
        "content_key": key,
    }
    building = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(building, ignore_errors=True)
    try:
        meta = tokenize_to_shard(
            read_lines(rows_path),
            tokenizer,
            base,
            building,
            cfg.seq_len,
            token_dtype(len(tokenizer)),
            cfg.workers,
            cfg.pack_window,
            meta,
            cfg.train_on,
            _schema(objective),
        )
    except WrongObjective as exc:
        shutil.rmtree(building, ignore_errors=True)
        raise FineflowError(
            f"{rows_path}: {exc}; train.objective is {objective or NAMES[0]}, which trains on "
            f"{objective_for(objective or NAMES[0]).rows}: run the validate stage again for it (dvc repro validate "
            "reads train.objective: it writes the rows the objective trains on)"
        ) from None
    except RenderError as exc:  # a row kept with validate.checks.chat_template at severity warn
        shutil.rmtree(building, ignore_errors=True)
        raise FineflowError(
            f"{rows_path}: {exc}; the validate stage quarantines such rows unless validate.checks.chat_template "
            "is a warning"
        ) from None
    shutil.rmtree(out_dir, ignore_errors=True)  # a reader never sees a mix: meta.json is written last
    os.replace(building, out_dir)
    return {**meta, "reused": False}
