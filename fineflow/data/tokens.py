"""How the tokenize stage will see a row, for the gate's token checks: counts in time linear in the text.

A tokenizer's time grows faster than its input's length on long texts (a row of megabytes can stall it for
minutes), so texts over ``EXACT_TOKEN_CHARS`` are counted in pieces cut before whitespace, and texts are
encoded in batches of at most ``TOKEN_BATCH`` texts and ``TOKEN_BATCH_CHARS`` characters, which bounds the
tokenizer's per-token bookkeeping.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from fineflow.tokenize.conversation import Segment, dropped_turn
from fineflow.tokenize.template import RenderError, _ids, render_segments

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


class Measure(NamedTuple):
    """How the tokenize stage will see one row."""

    n_tokens: int | None  # tokens of the rendered example with its EOS (None: it does not render)
    trained: int | None  # trained tokens left after truncation to seq_len
    render_error: str | None  # why the template cannot render the row
    dropped_turn: str | None = None  # a chat row's message the chat template leaves out
    cut_turn: str | None = None  # a chat row's assistant turn that truncation to seq_len would cut


@dataclass(frozen=True)
class TokenView:
    """How the tokenize stage will see a row: the tokenizer, the packed row length it truncates to, and which
    assistant turns of a chat row it trains (tokenize.train_on)."""

    tokenizer: object
    seq_len: int
    train_on: str = "all_assistant"

    def measure_many(self, rows: list[dict]) -> list[Measure]:
        """Each row rendered as the tokenize stage renders it (fineflow.tokenize.template.render_segments) and
        counted piece by piece."""
        examples: list[list[Segment] | str] = []
        for data in rows:
            row = {c: str(data.get(c) or "") for c in ("instruction", "input", "output")}
            row.update({c: data.get(c) for c in ("messages", "tools")})  # as validated (clean_record)
            try:
                examples.append(render_segments(self.tokenizer, row, self.train_on))
            except RenderError as exc:
                examples.append(str(exc))  # only the render check fails; token checks skip (null) the row
        texts = [s.text for example in examples if not isinstance(example, str) for s in example if s.text is not None]
        counts = iter(token_counts(self.tokenizer, texts))
        out = []
        for data, example in zip(rows, examples):
            if isinstance(example, str):
                out.append(Measure(None, None, example))
                continue
            sizes = [next(counts) if s.text is not None else 1 for s in example]  # the appended EOS: one token
            out.append(self._measure(data, example, sizes))
        return out

    def _measure(self, data: dict, example: list[Segment], sizes: list[int]) -> Measure:
        total = sum(sizes)
        trained, cut, at = 0, None, 0
        turns: dict[int, list[int]] = {}  # assistant turn -> [first token, end] of its trained pieces
        for segment, size in zip(example, sizes):
            if segment.trained:
                trained += max(0, min(at + size, self.seq_len) - at)
                if segment.turn is not None:
                    turns.setdefault(segment.turn, [at, at])[1] = at + size
            at += size
        for turn, (first, end) in turns.items():
            if first < self.seq_len < end:
                cut = (
                    f"messages[{turn}] (assistant): tokenize.seq_len={self.seq_len} cuts this turn after "
                    f"{self.seq_len - first} of its {end - first} tokens (the conversation has {total})"
                )
        dropped = None
        if turns:  # a conversation through the chat template: the pieces joined are its whole rendering
            dropped = dropped_turn(data["messages"], "".join(s.text for s in example if s.text is not None))
        return Measure(total, trained, None, dropped, cut)

    def measure(self, data: dict) -> Measure:
        return self.measure_many([data])[0]
