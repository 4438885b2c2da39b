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
from fineflow.tokenize.pairs import SIDES, pair_budget, pair_sides
from fineflow.tokenize.template import RenderError, _ids, encode_segments, render_segments

EXACT_TOKEN_CHARS = 16_384  # texts up to this long are tokenized whole (exact counts) ...
TOKEN_PIECE_CHARS = 4_096  # ... longer ones in pieces of this size
TOKEN_BATCH = 2_048  # texts per encode_batch call, and at most ...
TOKEN_BATCH_CHARS = 1 << 20  # ... this many characters: the tokenizer keeps offsets and more per token
# A cut pair's two sides are compared token by token on their first CUT_CHARS_PER_TOKEN * seq_len characters
# per piece: enough for seq_len tokens unless tokens average longer than that, and a bounded cost per row.
CUT_CHARS_PER_TOKEN = 64


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


class PairMeasure(NamedTuple):
    """How the tokenize stage will see one preference pair: each side measured within what it keeps of the
    pair's shared row (fineflow.tokenize.pairs.pair_budget)."""

    chosen: Measure
    rejected: Measure
    cut: str | None = None  # how tokenize.seq_len cuts the pair's sides, None when both fit whole
    same_after_cut: str | None = None  # why the cut sides are the same tokens: nothing left to prefer

    @property
    def trained_sides(self) -> tuple[int | None, int | None]:
        return self.chosen.trained, self.rejected.trained

    def _first(self, field: str) -> str | None:
        """The first side's problem of a kind (render error, dropped or cut turn), naming the side."""
        for side, measure in zip(SIDES, (self.chosen, self.rejected)):
            if getattr(measure, field):
                return f"{side}: {getattr(measure, field)}"
        return None

    @property
    def render_error(self) -> str | None:
        return self._first("render_error")

    @property
    def dropped_turn(self) -> str | None:
        return self._first("dropped_turn")

    @property
    def cut_turn(self) -> str | None:
        return self._first("cut_turn")


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
        rows = [_as_validated(data, ("instruction", "input", "output")) for data in rows]
        rendered = self._rendered(rows, self.train_on)
        return [
            Measure(None, None, example) if sizes is None else self._measure(data, example, sizes, self.seq_len)
            for data, (example, sizes) in zip(rows, rendered)
        ]

    def measure_pairs(self, rows: list[dict]) -> list[PairMeasure]:
        """Each preference pair as the tokenize stage will pack it (fineflow.tokenize.pairs): both sides
        rendered as SFT final replies, cut together to one row of seq_len."""
        sides = [side for data in rows for side in pair_sides(_as_validated(data, ("instruction", "input", *SIDES)))]
        rendered = self._rendered(sides, "last_assistant")
        return [self._measure_pair(sides[i : i + 2], rendered[i : i + 2]) for i in range(0, len(sides), 2)]

    def _rendered(self, rows: list[dict], train_on: str) -> list[tuple[list[Segment] | str, list[int] | None]]:
        """Each row's pieces and their token counts; (the render error, None) for a row that does not render."""
        examples: list[list[Segment] | str] = []
        for row in rows:
            try:
                examples.append(render_segments(self.tokenizer, row, train_on))
            except RenderError as exc:
                examples.append(str(exc))  # only the render check fails; token checks skip (null) the row
        texts = [s.text for example in examples if not isinstance(example, str) for s in example if s.text is not None]
        counts = iter(token_counts(self.tokenizer, texts))
        # the appended EOS (text None): one token
        return [
            (
                example,
                None if isinstance(example, str) else [next(counts) if s.text is not None else 1 for s in example],
            )
            for example in examples
        ]

    def _measure_pair(self, sides: list[dict], rendered: list) -> PairMeasure:
        if any(sizes is None for _, sizes in rendered):
            return PairMeasure(
                *(Measure(None, None, example if sizes is None else None) for example, sizes in rendered)
            )
        totals = [sum(sizes) for _, sizes in rendered]
        kept = pair_budget(*totals, self.seq_len)
        chosen, rejected = (self._measure(side, *pieces, limit) for side, pieces, limit in zip(sides, rendered, kept))
        if list(kept) == totals:
            return PairMeasure(chosen, rejected)
        cut = (
            f"chosen {totals[0]} + rejected {totals[1]} tokens share one row of tokenize.seq_len={self.seq_len}: "
            f"cut to {kept[0]} + {kept[1]}"
        )
        return PairMeasure(chosen, rejected, cut, self._same_after_cut([example for example, _ in rendered], kept))

    def _same_after_cut(self, examples: list[list[Segment]], kept: tuple[int, int]) -> str | None:
        """Whether the sides' kept tokens are the same: the cut left nothing that tells the answers apart."""
        chars = CUT_CHARS_PER_TOKEN * self.seq_len
        trimmed = [[s._replace(text=s.text[:chars]) if s.text else s for s in example] for example in examples]
        encoded = encode_segments(self.tokenizer, trimmed)
        (chosen, _), (rejected, _) = encoded.example(0), encoded.example(1)
        if chosen[: kept[0]] != rejected[: kept[1]]:
            return None
        return f"after the cut to {kept[0]} + {kept[1]} tokens both sides are the same tokens"

    def _measure(self, data: dict, example: list[Segment], sizes: list[int], limit: int) -> Measure:
        """The row's counts when it keeps its first ``limit`` tokens (seq_len; a pair's side: its share)."""
        total = sum(sizes)
        trained, cut, at = 0, None, 0
        turns: dict[int, list[int]] = {}  # assistant turn -> [first token, end] of its trained pieces
        for segment, size in zip(example, sizes):
            if segment.trained:
                trained += max(0, min(at + size, limit) - at)
                if segment.turn is not None:
                    turns.setdefault(segment.turn, [at, at])[1] = at + size
            at += size
        for turn, (first, end) in turns.items():
            if first < limit < end:
                cut = (
                    f"messages[{turn}] (assistant): tokenize.seq_len={self.seq_len} cuts this turn after "
                    f"{limit - first} of its {end - first} tokens (the conversation has {total})"
                )
        dropped = None
        if turns:  # a conversation through the chat template: the pieces joined are its whole rendering
            dropped = dropped_turn(data["messages"], "".join(s.text for s in example if s.text is not None))
        return Measure(total, trained, None, dropped, cut)

    def measure(self, data: dict) -> Measure:
        return self.measure_many([data])[0]


def _as_validated(data: dict, fields: tuple[str, ...]) -> dict:
    """The row as the validate stage writes it (clean_record): its text fields as text, a bad value included
    (its own check names it), and a chat row's conversation and tool definitions."""
    row = {c: str(data.get(c) or "") for c in fields}
    row.update({c: data.get(c) for c in ("messages", "tools")})
    return row
