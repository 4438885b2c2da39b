"""Text normalization for near-duplicate detection and train/eval leakage (exact and n-gram overlap).

Normalized text is NFKC, lower-cased, with every run of non-alphanumeric characters turned into one
space: rows that differ only in case, punctuation or spacing normalize to the same string.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable

_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)


def normalize(text: str) -> str:
    return _NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).lower()).strip()


def word_ngrams(normalized: str, n: int) -> set[tuple[str, ...]]:
    words = normalized.split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


class LeakIndex:
    """What the evaluation data contains, to score how much of a training text it already holds.

    ``overlap(text)`` is 1.0 for an exact normalized match, else the share of the text's word n-grams that
    occur in the evaluation data (0.0 for texts shorter than n words that match nothing). N-grams found in
    many eval rows (a shared prompt template, "rewrite the date as ...") are boilerplate, not content: they
    are ignored on both sides, so templated datasets do not look like leaks.
    """

    def __init__(self, eval_texts: Iterable[str], n: int, boilerplate_share: float = 0.05):
        self.n = n
        self.exact: set[str] = set()
        rows_with: Counter = Counter()
        for text in eval_texts:
            norm = normalize(text)
            self.exact.add(norm)
            rows_with.update(word_ngrams(norm, n))
        limit = max(3, boilerplate_share * len(self.exact))
        self.boilerplate = {gram for gram, rows in rows_with.items() if rows >= limit}
        self.grams = set(rows_with) - self.boilerplate

    def overlap(self, text: str) -> float:
        norm = normalize(text)
        if norm in self.exact:
            return 1.0
        grams = word_ngrams(norm, self.n) - self.boilerplate
        if not grams:
            return 0.0
        return len(grams & self.grams) / len(grams)
