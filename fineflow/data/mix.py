"""Mixing validated sources into one train split, deterministically in ``seed``, streamed.

A source contributes ``n`` rows, or ``weight`` times its kept rows (rounded): each kept row ``n // kept`` times
in full passes, then ``n % kept`` rows more picked by selection sampling (Knuth's algorithm S: every subset of
that size equally likely, one pass, nothing held). Sources are interleaved by a seeded draw weighted by the
rows each has left, so every stretch of the mix holds the sources in their shares; within a source the file
order is kept. Each source's picks are seeded by the seed and its own cache key, not its position: changing
another source's weight, or adding one, does not change which rows this one gives. Memory is one line per
source, whatever the row counts.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path


def target_rows(amount: dict, kept: int) -> int:
    """Rows the mix takes from a source with `kept` rows: {"n": rows} or {"weight": w}."""
    return amount["n"] if "n" in amount else round(amount["weight"] * kept)


def source_lines(path: Path, kept: int, target: int, rng: random.Random) -> Iterator[str]:
    """`target` lines of a file of `kept` lines: full passes, then a uniform sample of the remainder."""
    for _ in range(target // kept if kept else 0):
        with path.open(encoding="utf-8") as fh:
            yield from fh
    wanted = target % kept if kept else 0
    if not wanted:
        return
    with path.open(encoding="utf-8") as fh:
        for seen, line in enumerate(fh):
            if rng.random() * (kept - seen) < wanted:  # algorithm S: wanted left of the kept - seen lines left
                wanted -= 1
                yield line
                if not wanted:
                    return


def interleave(streams: list[Iterator[str]], counts: list[int], rng: random.Random) -> Iterator[str]:
    """Lines of the streams (stream i gives counts[i]) in a seeded order weighted by what each has left."""
    left = list(counts)
    total = sum(left)
    while total:
        pick = rng.random() * total
        i = 0
        while pick >= left[i]:
            pick -= left[i]
            i += 1
        left[i] -= 1
        total -= 1
        yield next(streams[i])


def write_mix(parts: list[tuple[Path, int, int, str]], seed: int, out: Path) -> int:
    """Write the mix of parts (kept rows file, kept rows, target rows, source key) to out; rows written."""
    streams = [source_lines(path, kept, target, random.Random(f"{seed}:{key}")) for path, kept, target, key in parts]
    counts = [target for _, _, target, _ in parts]
    written = 0
    with out.open("w", encoding="utf-8") as fh:
        for line in interleave(streams, counts, random.Random(f"{seed}:mix")):
            fh.write(line)
            written += 1
    return written
