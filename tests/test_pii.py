"""PII detection: each kind found, Luhn separates card numbers from other digit runs, dates never match."""

import pytest

from fineflow.data.pii import find_pii, luhn_valid, redact


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
