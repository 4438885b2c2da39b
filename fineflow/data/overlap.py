"""What the gate remembers across a file: exact and near duplicates, and the eval data for leakage, as hashes.

Normalized text is NFKC, lower-cased, with every run of non-alphanumeric characters turned into one
space: rows that differ only in case, punctuation or spacing normalize to the same string.

The state is compact so that memory stays flat as the data grows: a row seen is 16 bytes (a 64-bit hash of
its text and its line) in a sorted numpy array, an eval n-gram 8 bytes. Hashes are blake2b, so the same file
gives the same result in every run; two different texts share a 64-bit hash with probability ~n²/2⁶⁵
(about 3 in a million for ten million rows), which would report the later one as a duplicate.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable

import numpy as np

_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)
_GRAM_BASE = np.uint64(0x100000001B3)  # the n-gram hash is a polynomial in its words' hashes, mod 2**64


def normalize(text: str) -> str:
    return _NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).lower()).strip()


def stable_hash(text: str) -> int:
    """A 64-bit hash of text, the same in every process (Python's hash() of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


class FirstSeen:
    """The first line each text hash was seen at, over a file read in chunks: sorted (hash, line) arrays."""

    def __init__(self) -> None:
        self.keys = np.empty(0, dtype=np.uint64)
        self.lines = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.keys)

    def first_lines(self, hashes: list[int], lines: list[int]) -> list[int | None]:
        """For each row of the next chunk (lines ascending), the line of an earlier row with the same hash,
        or None when it is the first; the chunk's first copies are remembered."""
        keys = np.asarray(hashes, dtype=np.uint64)
        at = np.asarray(lines, dtype=np.int64)
        unique, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        where = np.searchsorted(self.keys, unique)
        known = where < len(self.keys)
        known[known] = self.keys[where[known]] == unique[known]
        first_line = at[first]
        first_line[known] = self.lines[where[known]]
        new = ~known
        self.keys = np.insert(self.keys, where[new], unique[new])
        self.lines = np.insert(self.lines, where[new], at[first][new])
        earlier = first_line[inverse.reshape(-1)]
        return [None if seen == line else int(seen) for seen, line in zip(earlier.tolist(), lines)]


_EMPTY = np.empty(0, dtype=np.uint64)


class _WordHashes:
    """Words' 64-bit hashes, cached: a corpus repeats its words, and blake2b costs a microsecond a call."""

    def __init__(self, limit: int = 1 << 16):
        self.cache: dict[str, int] = {}
        self.limit = limit

    def _hash_words(self, words: list[str]) -> list[int]:
        cache = self.cache
        if len(cache) > self.limit:  # bounded: a file of unique tokens must not grow it without end
            cache.clear()
        out = []
        for word in words:
            value = cache.get(word)
            if value is None:
                value = cache[word] = stable_hash(word)
            out.append(value)
        return out

    def __call__(self, normalized: str, block: int = 1 << 20) -> np.ndarray:
        """The hashes of a normalized text's words, split a block at a time: a row of many megabytes never
        becomes one list of millions of Python strings."""
        parts, start = [], 0
        while start < len(normalized):
            end = normalized.find(" ", start + block) if len(normalized) - start > block else -1
            end = len(normalized) if end < 0 else end
            parts.append(np.asarray(self._hash_words(normalized[start:end].split()), dtype=np.uint64))
            start = end + 1
        return np.concatenate([_EMPTY, *parts])


def _gram_hashes(word_hashes: np.ndarray, n: int) -> np.ndarray:
    """The hash of every run of n consecutive words, by Horner's rule over n shifted views (memory linear in
    the words, not n times it), wrapping mod 2**64."""
    m = len(word_hashes) - n + 1
    if m <= 0:
        return _EMPTY
    out = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            out = out * _GRAM_BASE + word_hashes[k : k + m]
    return out


class LeakIndex:
    """What the evaluation data contains, to score how much of a training text it already holds.

    ``overlap(text)`` is 1.0 for an exact normalized match, else the share of the text's distinct word
    n-grams that occur in the evaluation data (0.0 for texts shorter than n words that match nothing).
    N-grams found in many eval rows (a shared prompt template, "rewrite the date as ...") are boilerplate,
    not content: they are ignored on both sides, so templated datasets do not look like leaks.

    Eval texts are added one at a time (``add``, or the constructor's iterable); the first ``overlap``
    freezes the index into sorted hash arrays.
    """

    def __init__(self, eval_texts: Iterable[str] = (), n: int = 8, boilerplate_share: float = 0.05):
        self.n, self.boilerplate_share = n, boilerplate_share
        self._words = _WordHashes()
        self._exact: list[int] = []
        self._grams: list[np.ndarray] = []  # each eval row's distinct n-gram hashes
        self._frozen = False
        for text in eval_texts:
            self.add(text)

    def add(self, text: str) -> None:
        if self._frozen:
            raise RuntimeError("LeakIndex.add after overlap(): the index is frozen")
        norm = normalize(text)
        self._exact.append(stable_hash(norm))
        self._grams.append(np.unique(_gram_hashes(self._words(norm), self.n)))

    def _freeze(self) -> None:
        if self._frozen:
            return
        self._frozen = True
        grams, rows_with = np.unique(np.concatenate([_EMPTY, *self._grams]), return_counts=True)
        self.exact = np.unique(np.asarray(self._exact, dtype=np.uint64))
        limit = max(3, self.boilerplate_share * len(self.exact))
        self.boilerplate = grams[rows_with >= limit]
        self.grams = grams[rows_with < limit]
        self._exact, self._grams = [], []

    def overlap(self, text: str) -> float:
        return self.overlaps([text])[0]

    def overlaps(self, texts: list[str], normalized: bool = False) -> list[float]:
        """overlap() of many texts (already normalize()d, with normalized=True) at once: their n-grams are
        hashed, deduplicated and looked up as arrays."""
        self._freeze()
        norms = texts if normalized else [normalize(text) for text in texts]
        exact = _contains(self.exact, np.asarray([stable_hash(norm) for norm in norms], dtype=np.uint64))
        rows, grams = self._distinct_grams(norms)
        content = ~_contains(self.boilerplate, grams)
        counted = np.bincount(rows[content], minlength=len(texts))
        shared = np.bincount(rows[content & _contains(self.grams, grams)], minlength=len(texts))
        return [
            1.0 if is_exact else (hits / total if total else 0.0)
            for is_exact, hits, total in zip(exact.tolist(), shared.tolist(), counted.tolist())
        ]

    def _distinct_grams(self, norms: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(row, n-gram hash) of every distinct n-gram of each text, all texts' words hashed as one array
        (the n-grams that would span two texts dropped): a chunk costs a few numpy calls, not a few per row."""
        hashed = [self._words(norm) for norm in norms]
        row_of = np.repeat(np.arange(len(norms)), [len(words) for words in hashed])
        grams = _gram_hashes(np.concatenate([_EMPTY, *hashed]), self.n)
        rows = row_of[: len(grams)]
        within = rows == row_of[self.n - 1 :]
        rows, grams = rows[within], grams[within]
        order = np.lexsort((grams, rows))
        rows, grams = rows[order], grams[order]
        first = np.ones(len(rows), dtype=bool)
        first[1:] = (rows[1:] != rows[:-1]) | (grams[1:] != grams[:-1])
        return rows[first], grams[first]


def _contains(sorted_keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Membership of each value in a sorted unique array."""
    if not len(sorted_keys):
        return np.zeros(len(values), dtype=bool)
    where = np.minimum(np.searchsorted(sorted_keys, values), len(sorted_keys) - 1)
    return sorted_keys[where] == values
