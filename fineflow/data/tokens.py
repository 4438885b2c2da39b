"""How the tokenize stage will see a row, for the gate's token checks: counts in time linear in the text.

A tokenizer's time grows faster than its input's length on long texts (a row of megabytes can stall it for
minutes), so texts over ``EXACT_TOKEN_CHARS`` are counted in pieces cut before whitespace, and texts are
encoded in batches of at most ``TOKEN_BATCH`` texts and ``TOKEN_BATCH_CHARS`` characters, which bounds the
tokenizer's per-token bookkeeping.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from fineflow.tokenize.template import RenderError, _ids, ends_with_eos, render_pair

EXACT_TOKEN_CHARS = 16_384  # texts up to this long are tokenized whole (exact counts) ...
TOKEN_PIECE_CHARS = 4_096  # ... longer ones in pieces of this size
TOKEN_BATCH = 2_048  # texts per encode_batch call, and at most ...
TOKEN_BATCH_CHARS = 1 << 20  # ... this many characters: the tokenizer keeps offsets and more per token


def _pieces(text: str) -> Iterator[str]:
    """A long text in pieces of at most TOKEN_PIECE_CHARS, cut before whitespace where there is some, so a
    word-splitting tokenizer sees the same words as in the whole text."""
    start = 0
    while len(text) - start > TOKEN_PIECE_CHARS:
        cut = text.rfind(" ", start + 1, start + TOKEN_PIECE_CHARS)
        cut = start + TOKEN_PIECE_CHARS if cut <= start else cut
        yield text[start:cut]
        start = cut
    yield text[start:]


def token_counts(tokenizer, texts: list[str]) -> list[int]:
    """Tokens in each text as the tokenize stage encodes it (fineflow.tokenize.template._ids), in time linear
    in the texts' length: texts over EXACT_TOKEN_CHARS are counted piece by piece (exact up to a token at a
    cut, where a cut falls inside a word). Pieces are encoded a batch at a time, never all at once."""
    counts = [0] * len(texts)
    owners: list[int] = []
    batch: list[str] = []
    size = 0

    def flush() -> None:
        for owner, ids in zip(owners, _ids(tokenizer, batch)):
            counts[owner] += len(ids)
        owners.clear()
        batch.clear()

    for i, text in enumerate(texts):
        for piece in _pieces(text) if len(text) > EXACT_TOKEN_CHARS else (text,):
            owners.append(i)
            batch.append(piece)
            size += len(piece)
            if len(batch) >= TOKEN_BATCH or size >= TOKEN_BATCH_CHARS:
                flush()
                size = 0
    if batch:
        flush()
    return counts


@dataclass(frozen=True)
class TokenView:
    """How the tokenize stage will see a row: the tokenizer and the packed row length it truncates to."""

    tokenizer: object
    seq_len: int

    def measure_many(self, rows: list[dict]) -> list[tuple[int | None, int | None, str | None]]:
        """Per row: (tokens in the rendered example with its EOS, response tokens still trained on after
        truncation to seq_len, why the template could not render the row or None)."""
        pairs: list[tuple[str, str] | str] = []
        for data in rows:
            row = {c: str(data.get(c) or "") for c in ("instruction", "input", "output")}
            try:
                pairs.append(render_pair(self.tokenizer, {**row, "messages": data.get("messages")}))
            except RenderError as exc:
                pairs.append(str(exc))  # only the render check fails; token checks skip (null) the row
        rendered = [pair for pair in pairs if isinstance(pair, tuple)]
        counts = iter(token_counts(self.tokenizer, [text for pair in rendered for text in pair]))
        out = []
        for pair in pairs:
            if isinstance(pair, str):
                out.append((None, None, pair))
                continue
            # the EOS that ends every response is trained on: appended unless the template already wrote it
            appended = 0 if ends_with_eos(self.tokenizer, pair[1]) else 1
            prompt, response = next(counts), next(counts) + appended
            total = prompt + response
            out.append((total, max(0, min(self.seq_len, total) - prompt), None))
        return out

    def measure(self, data: dict) -> tuple[int | None, int | None, str | None]:
        return self.measure_many([data])[0]
