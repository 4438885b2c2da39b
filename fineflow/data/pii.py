"""PII and secret detection for training rows: find typed spans, or replace them with typed placeholders.

Kinds: e-mail, credit-card number (13–19 digits that pass the Luhn check, so order ids and timestamps do
not trip it), US SSN-like ``123-45-6789``, IPv4 address, phone number, and API-key/secret-like strings
(well-known key prefixes, or ``api_key=…``/``password: …`` assignments). Detection is regex-based: cheap
enough to run on every row, and precise enough that the bundled data's dates and numbers never match.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Order matters: earlier kinds claim their span first (a card number is not also reported as a phone).
PATTERNS: dict[str, re.Pattern] = {
    "email": re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"),
    "secret": re.compile(
        r"\b(?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{16,}\b"  # Stripe-style
        r"|\bAKIA[0-9A-Z]{16}\b"  # AWS access key id
        r"|\bgh[pousr]_[A-Za-z0-9]{30,}\b"  # GitHub tokens
        r"|\bxox[abpr]-[A-Za-z0-9-]{10,}\b"  # Slack tokens
        r"|-----BEGIN [A-Z ]*PRIVATE KEY-----"
        r"|(?i:\b(?:api[_-]?key|secret|token|passw(?:or)?d)\b\s*[:=]\s*['\"]?[^\s'\"]{8,})"
    ),
    "credit_card": re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])"),
    "ssn": re.compile(r"(?<![\d-])\d{3}-\d{2}-\d{4}(?![\d-])"),
    "ipv4": re.compile(
        r"(?<![\d.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?![\d.])"
    ),
    # a phone is a whole group of digits: not the middle of a longer run such as an order number
    "phone": re.compile(
        r"(?<![\w+])(?<!\d[ .-])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])"
        r"\d{3,4}[ .-]?\d{3,4}(?![ .-]?\d)(?!\w)"
    ),
}
PLACEHOLDER = {kind: f"[{kind.upper()}]" for kind in PATTERNS}


@dataclass(frozen=True)
class Span:
    kind: str
    start: int
    end: int


def luhn_valid(digits: str) -> bool:
    """The Luhn checksum every payment card number satisfies."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def find_pii(text: str) -> list[Span]:
    """Non-overlapping PII spans in text, in order of position."""
    taken: list[Span] = []
    for kind, pattern in PATTERNS.items():
        for match in pattern.finditer(text):
            if kind == "credit_card" and not luhn_valid(re.sub(r"\D", "", match.group())):
                continue
            span = Span(kind, match.start(), match.end())
            if not any(s.start < span.end and span.start < s.end for s in taken):
                taken.append(span)
    return sorted(taken, key=lambda s: s.start)


def redact(text: str, spans: list[Span]) -> str:
    """Replace each span with its typed placeholder, e.g. ``[EMAIL]``."""
    out, last = [], 0
    for span in spans:
        out.append(text[last : span.start])
        out.append(PLACEHOLDER[span.kind])
        last = span.end
    out.append(text[last:])
    return "".join(out)
