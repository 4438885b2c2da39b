"""Fake but format-valid credentials, in the places people paste them: the secret scanner's test corpus
(tests/test_pii.py) and the data gate's (tests/test_validation.py).

Every value is built here at run time from obviously fake parts, so no file holds a live-looking key verbatim
(the data-gate tests grep a copied project for them). ``leaks(secret, blob)`` is the check every test makes:
no 8-character piece of the secret survives.
"""

from __future__ import annotations

import base64
import hashlib
import json


def _b64(seed: str, n: int, alphabet: str = "std") -> str:
    """n characters of deterministic base64 (std or url-safe alphabet), from a seed."""
    raw = b"".join(hashlib.sha256(f"{seed}-{i}".encode()).digest() for i in range(n // 32 + 2))
    text = (base64.urlsafe_b64encode(raw) if alphabet == "url" else base64.b64encode(raw)).decode()
    return text[:n]


def _hex(seed: str, n: int) -> str:
    return hashlib.sha256(seed.encode()).hexdigest()[:n] if n <= 64 else (_hex(seed, 64) + _hex(seed + "+", n - 64))


def _alnum(seed: str, n: int) -> str:
    return "".join(ch for ch in _b64(seed, 3 * n) if ch.isalnum())[:n]


def _pem(kind: str, seed: str, lines: int = 12) -> tuple[str, str]:
    """A private key block (kind: "RSA ", "EC ", "OPENSSH ", "") and its base64 body."""
    body = "\n".join(_b64(f"{seed}{i}", 64) for i in range(lines))
    return f"-----BEGIN {kind}PRIVATE KEY-----\n{body}\n-----END {kind}PRIVATE KEY-----\n", body


def _jwt() -> str:
    header = base64.urlsafe_b64encode(b'{"alg":"HS256","typ":"JWT"}').rstrip(b"=").decode()
    payload = base64.urlsafe_b64encode(b'{"sub":"fake-user-0001","name":"Fake Person"}').rstrip(b"=").decode()
    return f"{header}.{payload}.{_b64('jwt-sig', 43, 'url')}"


AWS_KEY_ID = "AKIA" + "FAKE" + "EXAMPLE0" + "1234"  # 20 characters, as AWS's
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCY" + "EXAMPLEKEY"  # AWS's documentation example: 40 base64
ISSUE_ROW_INPUT = "key AKIA" + "IOSFODNN7EXAMPLE" + " secret " + AWS_SECRET  # issue 29's row, verbatim
GCP_API_KEY = "AIza" + "Sy" + _alnum("gcp", 31) + "-_"  # AIza + 35
GCP_KEY_ID = _hex("gcp-key-id", 40)
GCP_PEM, GCP_PEM_BODY = _pem("", "gcp")
GCP_SERVICE_ACCOUNT = json.dumps(
    {
        "type": "service_account",
        "project_id": "fake-project-123",
        "private_key_id": GCP_KEY_ID,
        "private_key": GCP_PEM,
        "client_id": "100000000000000000001",
    },
    indent=2,
)
AZURE_KEY = _b64("azure", 86) + "=="  # a storage account key: 88 base64 characters
AZURE_CONNECTION = (
    f"DefaultEndpointsProtocol=https;AccountName=fakeaccount;AccountKey={AZURE_KEY};EndpointSuffix=core.windows.net"
)
GITHUB_PAT = "ghp" + "_" + _alnum("ghp", 36)
GITHUB_FINE_GRAINED = "github" + "_pat_" + _alnum("gh-fg-a", 22) + "_" + _alnum("gh-fg-b", 59)
SLACK_BOT = "xoxb" + "-123456789012-1234567890123-" + _alnum("slack", 24)
SLACK_WEBHOOK_PATH = "services/T0FAKE001/B0FAKE002/" + _alnum("hook", 24)
SLACK_WEBHOOK = "https://hooks.slack.com/" + SLACK_WEBHOOK_PATH
RSA_PEM, RSA_BODY = _pem("RSA ", "rsa")
EC_PEM, EC_BODY = _pem("EC ", "ec", lines=3)
SSH_PEM, SSH_BODY = _pem("OPENSSH ", "ssh", lines=6)
JWT = _jwt()


S = "<S>"  # where the secret goes in a template
TOKEN_POSITIONS = (
    "my token is <S>, keep it safe",  # prose
    "<S>",  # alone, unquoted
    "export API_TOKEN=<S>",  # env
    'config = {"token": "<S>"}',  # JSON value
    "token: <S>\nregion: eu-west-1",  # YAML
    'curl -H "Authorization: Bearer <S>" https://api.example.com/v1/me',  # curl header
    "GET https://api.example.com/v1/items?access_token=<S>&page=2",  # URL query string
    "use '<S>' here",  # quoted
)


def _in(secret: str, *templates: str) -> list[str]:
    return [template.replace(S, secret) for template in templates]


def _key_blocks(block: str) -> list[str]:
    return [
        f"here is my key:\n{block}\nwhy does ssh reject it?",
        block,
        f"cat > id <<EOF\n{block}EOF",
        json.dumps({"key": block}),  # a JSON string: its line breaks are escaped
    ]


# (name, the secret that must not survive, texts that hold it)
CASES: list[tuple[str, str, list[str]]] = [
    ("issue 29 row", AWS_SECRET, [ISSUE_ROW_INPUT]),
    (
        "aws secret access key",
        AWS_SECRET,
        _in(
            AWS_SECRET,
            f"key {AWS_KEY_ID} secret <S>",
            f"aws_access_key_id = {AWS_KEY_ID}\naws_secret_access_key = <S>",
            "export AWS_SECRET_ACCESS_KEY=<S>",
            '{"SecretAccessKey": "<S>"}',
            "aws:\n  secret_access_key: <S>",
            "the secret key <S> is in the vault",
            "AWS_SECRET_ACCESS_KEY='<S>'",
        ),
    ),
    ("aws access key id", AWS_KEY_ID, _in(AWS_KEY_ID, *TOKEN_POSITIONS)),
    (
        "gcp api key",
        GCP_API_KEY,
        _in(GCP_API_KEY, *TOKEN_POSITIONS, "https://maps.googleapis.com/maps/api/geocode/json?key=<S>"),
    ),
    ("gcp service account key id", GCP_KEY_ID, [GCP_SERVICE_ACCOUNT]),
    ("gcp service account key", GCP_PEM_BODY, [GCP_SERVICE_ACCOUNT]),
    (
        "azure storage key",
        AZURE_KEY,
        [
            AZURE_CONNECTION,
            f'AZURE_STORAGE_CONNECTION_STRING="{AZURE_CONNECTION}"',
            json.dumps({"conn": AZURE_CONNECTION}),
        ],
    ),
    ("github token", GITHUB_PAT, _in(GITHUB_PAT, *TOKEN_POSITIONS, "git clone https://<S>@github.com/fake/repo.git")),
    ("github fine-grained token", GITHUB_FINE_GRAINED, _in(GITHUB_FINE_GRAINED, *TOKEN_POSITIONS)),
    ("slack bot token", SLACK_BOT, _in(SLACK_BOT, *TOKEN_POSITIONS)),
    (
        "slack webhook",
        SLACK_WEBHOOK_PATH,
        _in(SLACK_WEBHOOK, "post to <S> when done", 'SLACK_WEBHOOK_URL="<S>"'),
    ),
    ("jwt", JWT, _in(JWT, *TOKEN_POSITIONS)),
    ("rsa key", RSA_BODY, _key_blocks(RSA_PEM)),
    ("ec key", EC_BODY, _key_blocks(EC_PEM)),
    ("openssh key", SSH_BODY, _key_blocks(SSH_PEM)),
]


def case_texts() -> list[tuple[str, str, str]]:
    """(case name, secret, text) for every case in every position."""
    return [(name, secret, text) for name, secret, texts in CASES for text in texts]


def pieces(secret: str, size: int = 8) -> set[str]:
    """Every piece of the secret of `size` characters (line breaks of a key body are not part of any piece)."""
    out = set()
    for part in secret.split("\n"):
        out |= {part[i : i + size] for i in range(len(part) - size + 1)}
    return out


def _grams(blob: str, size: int = 8) -> set[str]:
    return {blob[i : i + size] for i in range(len(blob) - size + 1)}


def leaks(secret: str, blob: str) -> list[str]:
    """The pieces of the secret that blob still shows."""
    return sorted(pieces(secret) & _grams(blob))


def leaks_of_every_case(blob: str) -> dict[str, list[str]]:
    """For each case of CASES, the pieces of its secret that blob still shows."""
    shown = _grams(blob)
    return {name: sorted(pieces(secret) & shown) for name, secret, _ in CASES}
