"""PII detection: each kind found, Luhn separates card numbers from other digit runs, dates never match;
secrets found by what they are, wherever they are pasted, and no part of one survives redaction."""

import json

import pytest

from fineflow.data.pii import PREVIEW_CHARS, find_pii, luhn_valid, redact, redacted_preview
from tests.secret_corpus import AWS_SECRET, ISSUE_ROW_INPUT, case_texts, leaks


@pytest.mark.parametrize(
    "text, kind",
    [
        ("write to jane.doe+x@mail.example.co.uk today", "email"),
        ("card 4111 1111 1111 1111 exp 12/29", "credit_card"),
        ("card 5500-0000-0000-0004", "credit_card"),
        ("ssn 123-45-6789", "ssn"),
        ("server at 192.168.10.254 is down", "ipv4"),
        ("call +44 20 7946 0958 now", "phone"),
        ("call (415) 555-0100", "phone"),
        ("key sk_live_4eC39HqLyjWDarjtT1zdp7dc", "secret"),
        ("AKIAIOSFODNN7EXAMPLE is the id", "secret"),
        ("api_key = 'abcd1234efgh5678'", "secret"),
        ("login with hf_" + "FAKEfake0123456789FAKEfake01234567", "secret"),  # a Hugging Face token
        ("password: hunter2hunter2", "secret"),
    ],
)
def test_each_kind_is_found(text, kind):
    assert [span.kind for span in find_pii(text)] == [kind]


@pytest.mark.parametrize(
    "text",
    [
        "order 4111 1111 1111 1112 shipped",  # 16 digits failing Luhn
        "The date 1980-01-01 is written 01/01/1980",
        "817 or 26",
        "age=18; city=Lima; job=pilot; name=Cyril",
        "version 1.2.3",
        "2024-03-05",
    ],
)
def test_clean_text_has_no_pii(text):
    assert find_pii(text) == []


def test_luhn():
    assert luhn_valid("79927398713") and not luhn_valid("79927398710")


def test_redact_replaces_spans_with_typed_placeholders():
    text = "mail a@b.io, card 4111111111111111, ip 8.8.8.8"
    assert redact(text, find_pii(text)) == "mail [EMAIL], card [CREDIT_CARD], ip [IPV4]"


def test_overlapping_kinds_keep_the_first_kind_and_every_match_in_order():
    text = "card 4111 1111 1111 1111 or call (415) 555-0100, ip 10.0.0.1 and 10.0.0.2"
    assert [(s.kind, text[s.start : s.end]) for s in find_pii(text)] == [
        ("credit_card", "4111 1111 1111 1111"),  # not also a phone
        ("phone", "(415) 555-0100"),
        ("ipv4", "10.0.0.1"),
        ("ipv4", "10.0.0.2"),
    ]


@pytest.mark.parametrize("text", ["300.1.1.1", "1.2.3.04", "1.2.3.4.5", "a" * 65 + "@example.com"])
def test_what_only_looks_like_an_address_is_not_pii(text):
    assert find_pii(text) == []  # octets above 255 or with a leading zero; a local part longer than RFC's 64


# Hostile rows: long runs without separators. Each input is 2 MB; the scan must take time linear in it. The
# quadratic e-mail pattern main had needed hours on the first of them; the bound below is a hang detector
# (fixed, all of them take a few seconds on a loaded 2-core machine), not a timing threshold.
HOSTILE = [
    '"a" * N',
    '"a@" * (N // 2)',
    '("a" * 60 + "@") * (N // 61)',
    '"a." * (N // 2)',
    '"a@" + "a-" * (N // 2)',
    '"xoxb-" + "-" * N',
    '"token=" * (N // 6)',
    '"-----BEGIN " + "A" * N',
    '"1 " * (N // 2)',
    '"1.1.1.1 " * (N // 8)',
    # the secret scanner's patterns (fineflow.data.pii.SECRET_PATTERNS), each at its worst:
    '"eyJ" * (N // 3)',  # a JWT's parts that never reach a dot
    '"eyJ-" * (N // 4) + "."',
    '"sk-" * (N // 3) + "T3BlbkFJ"',  # an OpenAI key's open-ended prefix, the marker far away
    '"://a:" * (N // 5)',  # basic auth in a URL with no @
    '"//" * (N // 2) + "/:_authToken="',
    '"glagent-" * (N // 8)',
    '"AKIA" + "A" * N',
    '("AKIA" + "B" * 16 + " ") * (N // 21)',  # access key ids, each followed by no secret key
    '"-----BEGIN PRIVATE KEY-----" + "A" * N',  # a key body with no END line
    '"-----BEGIN PRIVATE KEY-----\\n" * (N // 29)',
    '"secret " * (N // 7)',
    '"key=" * (N // 4)',
    '"key " + "a1" * (N // 2)',
    '"password: " + "x" * N',
    '"xoxb-1" * (N // 6)',
    '"xoxb-" + "1-" * (N // 2)',
    '"a" * 32 + "-us" * (N // 3)',
]


def test_scan_time_is_linear_on_long_runs_without_separators():
    import subprocess
    import sys

    code = "\n".join(
        # 400,000 characters: ~1 s a pattern when linear; a quadratic scan of them would take minutes (timeout)
        ["from fineflow.data.pii import find_pii", "N = 400_000"]
        + [f"find_pii({expr})" for expr in HOSTILE]
        + ["print('done')"]
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "done", out.stderr


def test_preview_replaces_pii_even_across_its_cut():
    card = "4111 1111 1111 1111"
    head = "x" * (PREVIEW_CHARS - 5)  # the card starts 5 characters before the cut and ends after it
    preview = redacted_preview(f"{head}{card} and mail bob@example.com")
    assert preview == f"{head}[CREDIT_CARD]…"
    assert redacted_preview("mail bob@example.com now") == "mail [EMAIL] now"
    key = "sk_live_" + "A" * 5000  # an open-ended secret longer than the scanned window still matches
    assert redacted_preview(f"key {key}") == "key [SECRET]…"
    assert redacted_preview("y" * 500) == "y" * PREVIEW_CHARS + "…"


# Secrets: the issue's row, then every format of tests/secret_corpus.py in every position it is pasted in.


def test_the_secret_access_key_after_an_access_key_id_is_redacted_not_only_the_id():
    """issue 29: the id was found, the secret key beside it was written in clear to the quarantine preview."""
    spans = find_pii(ISSUE_ROW_INPUT)
    assert leaks(AWS_SECRET, redact(ISSUE_ROW_INPUT, spans)) == []
    assert leaks(AWS_SECRET, redacted_preview(ISSUE_ROW_INPUT)) == []
    assert redact(ISSUE_ROW_INPUT, spans) == "key [SECRET] secret [SECRET]"
    text = f"{ISSUE_ROW_INPUT}. Then redis://admin:hunter2hunter2@cache.local:6379 too."
    assert (
        redact(text, find_pii(text))
        == "key [SECRET] secret [SECRET]. Then redis://admin:[SECRET]@cache.local:6379 too."
    )


CASE_TEXTS = case_texts()


@pytest.mark.parametrize(
    "name, secret, text", CASE_TEXTS, ids=[f"{name}-{i}" for i, (name, _, _) in enumerate(CASE_TEXTS)]
)
def test_each_secret_format_is_found_and_no_part_of_it_survives(name, secret, text):
    spans = find_pii(text)
    assert "secret" in {span.kind for span in spans}
    assert leaks(secret, redact(text, spans)) == []
    assert leaks(secret, redacted_preview(text, limit=len(text))) == []
    record = json.dumps({"instruction": "Fix this.", "input": text, "output": "ok"})  # as a quarantine preview
    assert leaks(secret, redacted_preview(record, limit=len(record))) == []


@pytest.mark.parametrize(
    "text",
    [
        # hex digests and UUIDs in prose next to "key": not secrets unless assigned (key: <hex>, key=<hex>)
        "the cache key 3f786850e387550fdab836ed7e6dc881de23001b changed after the rebase",
        "sha256 key e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855 of the empty file",
        "its primary key 550e8400-e29b-41d4-a716-446655440000 is a UUID",
        "Key takeaways: configuration_management matters",
        "the token count is 12345678 for this document",
        "password reset instructions were sent to your inbox",
        "a monkey, a donkey and a turkey walk into a bar",
        "python3 -m pip install --upgrade setuptools-scm wheel",
        # placeholders and code where a password-like key is assigned (detect-secrets' heuristics)
        "password: <your-password-here>",
        "export DB_PASSWORD=${DB_PASSWORD}",
        "secret = get_secret_key(name)",
        "token = tokens[0]",
        "password: ********",
        'raise ValueError(f"disallowed special token: {token}.")',
        "client = Client(token=reservation.token, include_secrets=include_secrets, password=password)",
        "class Settings:\n    api_key: SecretStr = Field(default=None)",
        "self._tokens_to_id[token] = flow_run_id",
        "self.cross_attn_token_to_image = Sam3TrackerAttention(config)",
        "sha = list_repo_commits(model_id, token=token)[0].commit_id",
        "the tokenizer=openai-community/gpt2 and the author: Jane2024-Smith-Jones",
    ],
)
def test_ordinary_text_near_a_keyword_is_not_a_secret(text):
    assert find_pii(text) == []


def test_a_low_entropy_password_in_prose_with_no_keyword_is_not_detected():
    """The documented limit: without a keyword (password: ...) or a known format, a weak password is text."""
    assert find_pii("my dog is called hunter2hunter2 and he is a good boy") == []
    assert [s.kind for s in find_pii("password: hunter2hunter2")] == ["secret"]
    assert [s.kind for s in find_pii('connect(password="SuperSecret")')] == ["secret"]  # quoted: a literal
