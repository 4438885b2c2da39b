"""PII and secret detection for training rows: find typed spans, replace them with typed placeholders, and
preview a rejected row without the originals.

Kinds: secret, e-mail, credit-card number (13–19 digits that pass the Luhn check, so order ids and timestamps do
not trip it), US SSN-like ``123-45-6789``, IPv4 address, phone number. Secrets are found by what they are
(fineflow.data.secrets): the key formats of Yelp's detect-secrets scanner (its plugins' own patterns, plus the
few formats it lacks), a whole private key block, a value assigned to a password-like key, a random-looking
token next to a keyword such as key/token/secret/password/bearer, and an AWS secret key next to its key id.
Each span covers the whole secret, so a redaction or a preview shows no part of it. Detection is regex-based:
cheap enough to run on every row, and precise enough that the bundled data's dates and numbers never match.

Time is linear in the text's length, whatever the text: every pattern either has a bounded length (an
e-mail's parts are bounded as RFC 5321 bounds them), or starts at a literal prefix or a token's start and never
fails after a long scan, so no start position costs more than a constant; the spans of all kinds are merged in
one pass.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from fineflow.data.secrets import Span, secret_spans

# Order matters: earlier kinds claim their span first (a card number is not also reported as a phone). Secrets
# come first: a key block or a token can hold what looks like an e-mail or a phone, and a secret partly
# claimed by another kind would show the rest of itself.
KINDS = ("secret", "email", "credit_card", "ssn", "ipv4", "phone")
PATTERNS: dict[str, re.Pattern] = {
    # An e-mail starts where a run of local-part characters starts, with a local part of at most 64 and labels
    # of at most 63 characters: an unbounded `[...]+@` tried at every position rescans a long run of letters
    # from each one (quadratic); anchored and bounded, a position costs a constant.
    "email": re.compile(
        r"[A-Za-z0-9._%+-](?<![A-Za-z0-9._%+-].)[A-Za-z0-9._%+-]{0,63}"
        r"@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63}){0,8}\.[A-Za-z]{2,24}"
    ),
    # The digit patterns open with the digit and look behind it (`\d(?<![\d-]\d)`: no digit or dash before
    # the number), so the regex engine skips to the next digit instead of testing every position.
    "credit_card": re.compile(r"\d(?<![\d-]\d)(?:[ -]?\d){12,18}(?![\d-])"),
    "ssn": re.compile(r"\d(?<![\d-]\d)\d{2}-\d{2}-\d{4}(?![\d-])"),
    "ipv4": re.compile(r"\d(?<![\d.]\d)\d{0,2}(?:\.\d{1,3}){3}(?![\d.])"),  # octets checked in _valid
    # a phone is a whole group of digits: not the middle of a longer run such as an order number
    "phone": re.compile(
        r"(?<![\w+])(?<!\d[ .-])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])"
        r"\d{3,4}[ .-]?\d{3,4}(?![ .-]?\d)(?!\w)"
    ),
}
PLACEHOLDER = {kind: f"[{kind.upper()}]" for kind in KINDS}

PREVIEW_CHARS = 200  # what a quarantine record shows of a rejected row
# Longer than any bounded match (an e-mail is at most ~700 characters) and than the context a secret rule reads
# after a span's start (an AWS secret key 64 characters after its id); an open-ended secret (a key block, a
# token) is covered up to the window's end. So a span that starts inside the preview is seen whole, or at least
# as far as the preview shows, when only this much of the text is scanned.
SCAN_MARGIN = 1024
PREVIEW_SOURCE_CHARS = PREVIEW_CHARS + SCAN_MARGIN + 1  # what a reader keeps of a row it cannot parse


def luhn_valid(digits: str) -> bool:
    """The Luhn checksum every payment card number satisfies."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _octet(part: str) -> bool:
    return int(part) <= 255 and (part == "0" or not part.startswith("0"))


def _valid(kind: str, found: str) -> bool:
    """What a regex cannot say cheaply: a card number passes Luhn, an IPv4 address has four octets <= 255."""
    if kind == "credit_card":
        return luhn_valid(re.sub(r"\D", "", found))
    if kind == "ipv4":
        return all(_octet(part) for part in found.split("."))
    return True


_DIGIT = re.compile(r"\d")


def _possible(kind: str, text: str) -> bool:
    """A cheap test each match needs (an @, a digit): most text skips most scans (secrets have their own)."""
    if kind == "email":
        return "@" in text
    return _DIGIT.search(text) is not None


def _matches(kind: str, text: str) -> Iterator[Span]:
    if kind == "secret":
        yield from secret_spans(text)
        return
    if not _possible(kind, text):
        return
    for match in PATTERNS[kind].finditer(text):
        if _valid(kind, match.group()):
            yield Span(kind, match.start(), match.end())


def _claim(taken: Iterator[Span], candidates: Iterator[Span]) -> Iterator[Span]:
    """Both streams merged in position order, keeping a candidate only where no taken span overlaps it.

    Each stream is ordered and free of overlaps, so one walk over both decides every candidate: a set of
    earlier spans checked per candidate would make text with millions of matches quadratic.
    """
    head = next(taken, None)
    for span in candidates:
        while head is not None and head.end <= span.start:
            yield head
            head = next(taken, None)
        if head is None or head.start >= span.end:  # the first taken span not before it does not reach it
            yield span
    while head is not None:
        yield head
        head = next(taken, None)


def iter_pii(text: str) -> Iterator[Span]:
    """Non-overlapping PII spans in text, in order of position, produced lazily."""
    spans: Iterator[Span] = iter(())
    for kind in KINDS:
        spans = _claim(spans, _matches(kind, text))
    return spans


def find_pii(text: str) -> list[Span]:
    return list(iter_pii(text))


def pii_kinds(text: str) -> set[str]:
    """The kinds of PII in text (the check needs no more than this)."""
    return {span.kind for span in iter_pii(text)}


def redact(text: str, spans: list[Span]) -> str:
    """Replace each span with its typed placeholder, e.g. ``[EMAIL]``."""
    out, last = [], 0
    for span in spans:
        out.append(text[last : span.start])
        out.append(PLACEHOLDER[span.kind])
        last = span.end
    out.append(text[last:])
    return "".join(out)


def redacted_preview(text: str, limit: int = PREVIEW_CHARS) -> str:
    """The first `limit` characters of text with every PII span in them replaced by its placeholder ("…"
    marks a cut). A span that crosses the cut is replaced whole, so no part of an original shows."""
    window = text[: limit + SCAN_MARGIN]
    out, last = [], 0
    for span in iter_pii(window):
        if span.start >= limit:
            break
        out += [window[last : span.start], PLACEHOLDER[span.kind]]
        last = span.end
    if last < limit:
        out.append(window[last:limit])
    return "".join(out) + ("…" if len(text) > max(last, limit) else "")
