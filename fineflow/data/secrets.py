"""Secrets in a row's text, found by what they are: spans that cover each whole secret (fineflow.data.pii turns
them into ``[SECRET]``).

Five rules, their spans merged (overlapping spans become one):

1. Key formats: the ``denylist`` patterns of Yelp's detect-secrets plugins (``DETECT_SECRETS_PLUGINS``: AWS,
   Azure storage, basic auth in a URL, Discord, GitHub, GitLab, JWT, Mailchimp, OpenAI, private-key headers,
   PyPI, SendGrid, Slack, Square, Stripe, Telegram, Twilio), read from the installed package, plus the formats
   it lacks (``EXTRA_FORMATS``: GCP API keys, Hugging Face and GitHub fine-grained tokens, Stripe test keys,
   any-length Slack tokens). A match is widened to the end of its token, so the rest of a longer key shows
   nothing.
2. A private key block (PEM, OpenSSH, PGP, SSH2, PuTTY) with its whole body up to its END line (or, with no
   END line, as far as base64 goes), also inside a JSON string whose line breaks are ``\\n``.
3. A value assigned to a password-like key (detect-secrets' KeywordDetector list: ``password``, ``secret``,
   ``api_key``, ``private_key``, ``account_key``... with any suffix such as ``_id``, and ``token`` as a whole
   word): ``key: value``, ``KEY=value``, ``"key": "value"``, ``key := value``, ``key => value``; any value of 8+
   characters, whatever its entropy, but a placeholder (detect-secrets' heuristics: ``<password>``,
   ``${PASSWORD}``, ``$PASSWORD``, ``********``), a call or an index (``get_password()``, ``tokens[0]``), or an
   unquoted name without digits that names a secret or is shaped as code (``self.password``,
   ``include_secrets``, ``run_id``, ``SecretStr``).
4. A random-looking token next to a keyword (those above and key, token, auth, bearer, credential), separated
   by spaces, colons, equals signs, quotes or brackets: 16+ characters of the base64/URL alphabet holding a digit
   and a letter, with a Shannon entropy (detect-secrets' measure) of at least ``ENTROPY_SHARE`` of the most its
   length allows (log2 of its length, up to 64), and not a call (``key = Attention3(config)``). A hex string or
   a UUID (a commit, a digest, a row id) counts only when assigned (``key: <hex>``, ``key=<hex>``), never after
   a space in prose.
5. An AWS secret access key (40 base64 characters) within 64 characters after an access key id.

Not detected: a password or token with no keyword before it and no known format (``my dog is hunter2``), a
low-entropy value after a keyword in prose (``the key is pancakes``), a digitless password assigned unquoted in
the shape of code (``password: CorrectHorse``), and formats no rule knows.

Time is linear in the text's length: each pattern is bounded, starts at a literal or a token's start, or
matches whatever it scans; the few detect-secrets patterns that are not are anchored or left out (see
``_ANCHORED`` and ``DETECT_SECRETS_PLUGINS``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class Span:
    kind: str
    start: int
    end: int


# detect-secrets' RegexBasedDetector plugins whose patterns are used as they are (module, class). Left out:
# ArtifactoryDetector (its password pattern `AP[0-9A-F][a-zA-Z0-9]{8,}` matches capitalised words such as
# "APACHESPARK"), NpmDetector (`//.+/:_authToken=` rescans a line from every `//`: quadratic; an `_authToken=`
# value is rule 3's), the IBM/Cloudant/SoftLayer keyword detectors (rule 3's assignments) and IPPublicDetector
# (an address is PII: pii.py's ipv4 kind).
DETECT_SECRETS_PLUGINS = (
    ("aws", "AWSKeyDetector"),
    ("azure_storage_key", "AzureStorageKeyDetector"),
    ("basic_auth", "BasicAuthDetector"),
    ("discord", "DiscordBotTokenDetector"),
    ("github_token", "GitHubTokenDetector"),
    ("gitlab_token", "GitLabTokenDetector"),
    ("jwt", "JwtTokenDetector"),
    ("mailchimp", "MailchimpDetector"),
    ("openai", "OpenAIDetector"),
    ("private_key", "PrivateKeyDetector"),
    ("pypi_token", "PypiTokenDetector"),
    ("sendgrid", "SendGridDetector"),
    ("slack", "SlackDetector"),
    ("square_oauth", "SquareOAuthDetector"),
    ("stripe", "StripeDetector"),
    ("telegram_token", "TelegramBotTokenDetector"),
    ("twilio", "TwilioKeyDetector"),
)
# Patterns that open with an unbounded run and can fail after scanning it (a JWT's parts before a dot, an OpenAI
# key's prefix before its marker): tried at every position of a long run, each rescans the run (quadratic). They
# may only start where a token starts, after a character their run cannot hold: then each run is scanned from
# one start.
_ANCHORED = {"eyJ": r"(?<![A-Za-z0-9_=-])", "sk-": r"(?<![A-Za-z0-9_-])"}

EXTRA_FORMATS = (
    r"AIza[0-9A-Za-z_-]{35}",  # GCP API key
    r"\bhf_[A-Za-z0-9]{34,}",  # Hugging Face access token
    r"github_pat_[A-Za-z0-9_]{22,}",  # GitHub fine-grained personal access token
    r"\b(?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{16,}",  # Stripe keys of any mode and length
    r"\bxox[abposr]-[A-Za-z0-9-]{10,}",  # Slack tokens of any shape
    r"\bgh[pousr]_[A-Za-z0-9]{30,}",  # GitHub tokens of any length
)

# A private key block: its header, then its body lazily up to the END line; with no END line (a cut text), the
# body as far as it goes. A body character is base64, space, a header's `:`/`,`, a line break escaped (once or
# twice: a JSON string inside a JSON record), or a dash that does not open a `-----` line, so a body stops at
# the next block and each block is scanned once.
_BODY = r"(?:[A-Za-z0-9+/=\s:,.]|\\{1,4}[nrt]|-(?!----))"
_KEY_HEADER = r"(?:-----BEGIN[ A-Z0-9]{0,40}PRIVATE KEY(?: BLOCK)?-----|---- BEGIN SSH2 ENCRYPTED PRIVATE KEY ----"
_KEY_HEADER += r"|PuTTY-User-Key-File-\d)"
_KEY_END = r"-{4,5} ?END[ A-Z0-9]{0,40}PRIVATE KEY(?: BLOCK)? ?-{4,5}"
KEY_BLOCK = re.compile(rf"{_KEY_HEADER}(?:{_BODY}*?{_KEY_END}|{_BODY}*)")

# Keywords. Suffixes are bounded (`\w{0,32}`) and no pattern has an unbounded prefix: `\w*secret` would rescan a
# long word from each of its letters.
_KEYWORDS = r"key|token|auth|bearer|credential"
_SUFFIX = r"\w{0,32}"  # aws_secret_access_key, DB_PASSWORD
# A weak keyword's suffix starts a new part of the name (tokens, token_id, authToken, key-id), so tokenizer,
# keyboard and author are not keywords.
_WEAK_SUFFIX = r"(?:s\b|[_-]\w{0,32}|[A-Z]\w{0,32})?"
_VALUE = r"[^\s'\"`\\]{8,}"  # an assigned value: everything up to a space, a quote or an escape
_ASSIGN = r"[\]'\"\\]{0,3}\s{0,16}(?::=|=>|[:=])\s{0,16}([\\'\"`]{0,2})"  # group 1: an opening quote
_NEAR = r"[\s'\"`:=\\\]>]{1,8}"  # between a keyword and its token: spaces, quotes, `:`, `=`, escapes, brackets
_TOKEN = r"[A-Za-z0-9+/_.~%-]{16,}={0,2}"  # no `=` or `:` inside: a rejected token never hides an assignment
ENTROPY_SHARE = 0.8  # of log2(length): random base64 of 16-64 characters scores above 0.83 in 99 cases of 100
HEX_ENTROPY = 3.0  # detect-secrets' HexHighEntropyString limit
_HEX = re.compile(r"[0-9a-fA-F-]+")
AWS_SECRET_NEAR_ID = r"[\s\S]{0,64}?(?<![A-Za-z0-9+/])([A-Za-z0-9+/]{40})(?![A-Za-z0-9+/=])"
# How far a match is widened: the rest of its token (base64, URL-safe base64, `.`-joined JWT parts).
_TOKEN_TAIL = re.compile(r"[A-Za-z0-9_+/=-]*(?:\.[A-Za-z0-9_+/=-]+)*")


def _anchored(pattern: str) -> str:
    for start, guard in _ANCHORED.items():
        if pattern.startswith(start):
            return guard + pattern
    return pattern


@dataclass(frozen=True)
class _Rules:
    tokens: list[re.Pattern]  # key formats: each holds a run of 16+ token characters
    headers: list[re.Pattern]  # private key block headers (detect-secrets') and whole blocks
    urls: list[re.Pattern]  # credentials in a URL (user:password@host); group 1 is the password
    assignment: re.Pattern  # rule 3; group 1 is an opening quote, group 2 the value
    keyword: re.Pattern  # rule 4; group 1 the separator, group 2 the token
    aws_pair: re.Pattern  # rule 5; group 1 is the secret key


# The cheap tests that let ordinary text skip most patterns: every token format and rules 4-5 need a run of 16
# token characters, a key block its header's words, a URL credential `://`, an assignment `:` or `=`.
_LONG_RUN = re.compile(r"[A-Za-z0-9_+/=.-]{16}")
_GROUPS = {"PrivateKeyDetector": "headers", "BasicAuthDetector": "urls"}


@cache
def _rules() -> _Rules:
    """The rules compiled at first use: importing detect-secrets costs ~0.1 s that a process which never scans a
    row does not pay."""
    import importlib

    from detect_secrets.plugins.aws import AWSKeyDetector
    from detect_secrets.plugins.keyword import DENYLIST

    groups: dict[str, list[re.Pattern]] = {"tokens": [], "headers": [KEY_BLOCK], "urls": []}
    for module, name in DETECT_SECRETS_PLUGINS:
        plugin = getattr(importlib.import_module(f"detect_secrets.plugins.{module}"), name)
        groups[_GROUPS.get(name, "tokens")] += [re.compile(_anchored(r.pattern), r.flags) for r in plugin.denylist]
    groups["tokens"] += [re.compile(pattern) for pattern in EXTRA_FORMATS]
    passwords = "|".join(DENYLIST) + r"|\btoken\b"
    return _Rules(
        **groups,
        assignment=re.compile(rf"(?i:{passwords}){_SUFFIX}{_ASSIGN}({_VALUE})"),
        keyword=re.compile(rf"(?:(?i:{passwords}){_SUFFIX}|(?i:{_KEYWORDS}){_WEAK_SUFFIX})({_NEAR})({_TOKEN})"),
        aws_pair=re.compile(AWSKeyDetector.denylist[0].pattern + AWS_SECRET_NEAR_ID),
    )


@cache
def _entropy_plugin(charset: str):
    from detect_secrets.plugins.high_entropy_strings import Base64HighEntropyString, HexHighEntropyString

    return HexHighEntropyString() if charset == "hex" else Base64HighEntropyString()


def shannon_entropy(token: str, charset: str = "base64") -> float:
    """detect-secrets' measure (bits per character over its alphabet, "base64" or "hex"; a hex string of digits
    only scores less): what a random-looking token scores."""
    return _entropy_plugin(charset).calculate_shannon_entropy(token)


# Code, not a value: a call or an index (secret = get_secret(), token = tokens[0]) or, unquoted, a name without
# digits that names a secret or is shaped as code (token=reservation.token, include_secrets=include_secrets,
# api_key: SecretStr, secret: flow_run_id).
_REFERENCE = re.compile(r"[\w)\]][\[(]")
_NAME = re.compile(r"[A-Za-z_][A-Za-z_.]*")
_NAMED = re.compile(r"(?i)pass|pwd|secret|token|key|auth|[._]|[a-z][A-Z]")  # or shaped as code: a.b, a_b, aB


def assigned_secret(value: str, quoted: bool) -> bool:
    """Rule 3's filters, detect-secrets' heuristics: a value assigned to a password-like key is a secret unless it
    is a template (``{x}``, ``<x>``, ``${x}``), a ``$VARIABLE``, letterless (``********``), a call or an index,
    or, unquoted, a name without digits that names a secret or is shaped as code (``self.password``)."""
    from detect_secrets.filters.heuristic import (
        is_not_alphanumeric_string,
        is_prefixed_with_dollar_sign,
        is_templated_secret,
    )

    template = value.rstrip(".,;:)")  # a template ending a sentence or a call: {token}.
    if is_templated_secret(template) or is_prefixed_with_dollar_sign(value) or is_not_alphanumeric_string(value):
        return False
    name = value.rstrip(".,;:)}]")
    return not (_REFERENCE.search(value) or (not quoted and _NAME.fullmatch(name) and _NAMED.search(name)))


def random_looking(token: str, assigned: bool) -> bool:
    """Rule 4's test of a token next to a keyword: long, mixed, and close to the most entropy its length allows.
    A hex string or UUID passes only when assigned: in prose it is a commit, a digest or a row id."""
    token = token.rstrip("=.")
    if len(token) < 16 or not re.search(r"\d", token) or not re.search(r"[A-Za-z]", token):
        return False
    if _HEX.fullmatch(token):
        return assigned and shannon_entropy(token, "hex") > HEX_ENTROPY
    return shannon_entropy(token) >= ENTROPY_SHARE * math.log2(min(len(token), 64))


def _spans(patterns: list[re.Pattern], text: str, group: int = 0) -> Iterator[tuple[int, int]]:
    for pattern in patterns:
        for match in pattern.finditer(text):
            yield match.start(group), match.end(group)


def _candidates(text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of every secret each rule finds, unordered and possibly overlapping."""
    rules = _rules()
    if "PRIVATE KEY" in text or "PuTTY-User-Key-File" in text:
        yield from _spans(rules.headers, text)
    if "://" in text:
        yield from _spans(rules.urls, text, 1)  # the password: user and host stay readable
    if ":" in text or "=" in text:
        for match in rules.assignment.finditer(text):
            if assigned_secret(match.group(2), quoted=bool(match.group(1))):
                yield match.start(2), match.end(2)
    if _LONG_RUN.search(text) is None:
        return
    yield from _spans(rules.tokens, text)
    yield from _spans([rules.aws_pair], text, 1)
    for match in rules.keyword.finditer(text):
        called = text[match.end(2) : match.end(2) + 1] in ("(", "[")  # code: key = Attention(config)
        if not called and random_looking(match.group(2), assigned=bool(set(match.group(1)) & set(":="))):
            yield match.start(2), match.start(2) + len(match.group(2).rstrip("."))  # a sentence's full stop stays


def secret_spans(text: str) -> Iterator[Span]:
    """Every secret in text as non-overlapping spans in order: the rules' matches sorted, each widened to the end
    of its token, overlapping ones merged. A widening only scans past the merged span's end, so the text is
    walked once."""
    start = end = -1
    for found_start, found_end in sorted(_candidates(text)):
        if found_start > end:  # past the merged span: it is whole
            if start >= 0:
                yield Span("secret", start, end)
            start = found_start
        if found_end > end:
            end = _TOKEN_TAIL.match(text, found_end).end()
    if start >= 0:
        yield Span("secret", start, end)
