"""Input formats (JSONL, CSV, Parquet) and the params mapping onto instruction/input/output."""

import json

import pytest

from fineflow.core.data_config import FieldMapping, ValidateParams
from fineflow.data.formats import Row, apply_mapping, read_rows
from fineflow.data.validation import validate_rows
from fineflow.errors import DataError

ROWS = [{"prompt": "Say hi.", "completion": "hi"}, {"prompt": "Say bye.", "completion": "bye"}]
PROMPT_COMPLETION = FieldMapping(instruction="prompt", input=None, output="completion")


def write_all_formats(tmp_path):
    import pandas as pd

    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    pd.DataFrame(ROWS).to_csv(tmp_path / "d.csv", index=False)
    pd.DataFrame(ROWS).to_parquet(tmp_path / "d.parquet")
    return [tmp_path / "d.jsonl", tmp_path / "d.csv", tmp_path / "d.parquet"]


def test_every_format_maps_to_the_same_records(tmp_path):
    results = []
    for path in write_all_formats(tmp_path):
        rows = apply_mapping(read_rows(path), PROMPT_COMPLETION, str(path))
        outcome = validate_rows(rows, str(path), ValidateParams())
        results.append([row.data for row in outcome.kept])
    assert (
        results[0]
        == results[1]
        == results[2]
        == [{"instruction": "Say hi.", "output": "hi"}, {"instruction": "Say bye.", "output": "bye"}]
    )


def test_wrong_mapping_is_a_clear_error(tmp_path):
    path = write_all_formats(tmp_path)[1]
    with pytest.raises(
        DataError,
        match=r"data.mapping.output is 'answer', but no row has that column "
        r"\(columns found: \['completion', 'prompt'\]\)",
    ):
        list(apply_mapping(read_rows(path), FieldMapping(instruction="prompt", input=None, output="answer"), str(path)))


def test_csv_rows_are_numbered_by_file_line_and_ragged_rows_quarantined(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('instruction,output\n"multi\nline",x\na,b,EXTRA\n')
    rows = list(read_rows(path))
    assert [row.line for row in rows] == [3, 4]
    assert rows[1].reasons == [f"{path}:4: more cells than the header has columns"]


def test_unknown_extension_asks_for_data_format(tmp_path):
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DataError, match="set data.format in params.yaml"):
        read_rows(tmp_path / "d.txt")


def test_a_non_utf8_csv_line_quarantines_its_row_like_jsonl_the_others_are_kept(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes(b'instruction,output\n"multi\nline",x\na,\xff\nc,"d\n\xfee"\ng,h\n')
    rows = list(read_rows(path))
    assert [(row.line, row.reasons) for row in rows] == [
        (3, []),
        (4, [f"{path}:4: not UTF-8 (byte 2 of the line)"]),
        (6, [f"{path}:6: not UTF-8 (byte 0 of the line)"]),  # inside a quoted cell that spans lines 5-6
        (7, []),
    ]
    assert rows[1].data is None and rows[1].raw == "a,\ufffd" and rows[3].data == {"instruction": "g", "output": "h"}


def test_a_non_utf8_csv_header_is_a_clear_error(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes(b"instruction,\xffoutput\na,b\n")
    with pytest.raises(DataError, match=rf"{path}:1: not UTF-8 \(byte 12 of the line\) in the header"):
        list(read_rows(path))


def test_a_csv_header_over_max_row_bytes_is_a_clear_error(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("instruction,output," + ",".join(f"c{i}" for i in range(400)) + "\na,b\n")
    with pytest.raises(DataError, match=rf"{path}:1: the header is over validate.max_row_bytes=1,024 bytes"):
        list(read_rows(path, max_row_bytes=1024))


def _nul_rows():
    return [{"prompt": "Say hi.", "completion": "h\x00i"}, {"prompt": "Say bye.", "completion": "bye"}]


def test_a_nul_byte_is_quarantined_alike_from_jsonl_csv_and_parquet(tmp_path):
    import pandas as pd

    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _nul_rows()))
    pd.DataFrame(_nul_rows()).to_csv(tmp_path / "d.csv", index=False)
    pd.DataFrame(_nul_rows()).to_parquet(tmp_path / "d.parquet")
    found = []
    for path, line in ((tmp_path / "d.jsonl", 1), (tmp_path / "d.csv", 2), (tmp_path / "d.parquet", 1)):
        rows = apply_mapping(read_rows(path), PROMPT_COMPLETION, str(path))
        outcome = validate_rows(rows, str(path), ValidateParams(max_bad_share=1.0))
        assert [row.line for row in outcome.quarantined] == [line]
        found.append(([r.removeprefix(f"{path}:{line}: ") for r in outcome.quarantined[0].reasons], outcome.kept))
    reasons = ['failed no_control_chars(text) (field "output" contains a NUL byte (U+0000))']
    assert [r for r, _ in found] == [reasons] * 3
    assert [[row.data for row in kept] for _, kept in found] == [[{"instruction": "Say bye.", "output": "bye"}]] * 3


def test_not_parquet_is_a_clear_error(tmp_path):
    (tmp_path / "d.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="cannot read the file as Parquet"):
        list(read_rows(tmp_path / "d.parquet"))


CHAT = FieldMapping(messages="messages")


def test_chat_messages_become_instruction_and_response(tmp_path):
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say hi."},
                {"role": "assistant", "content": "hi"},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "times 3?"},
                {"role": "assistant", "content": "12"},
            ]
        },
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mapped = list(apply_mapping(read_rows(path), CHAT, str(path)))
    assert {k: v for k, v in mapped[0].data.items() if k != "messages"} == {
        "instruction": "Be brief.\nSay hi.",
        "input": "",
        "output": "hi",
    }
    assert {k: v for k, v in mapped[1].data.items() if k != "messages"} == {
        "instruction": "User: 2+2?\nAssistant: 4\nUser: times 3?",
        "input": "",
        "output": "12",
    }
    assert mapped[1].data["messages"] == rows[1]["messages"]  # kept for the tokenizer's chat template


@pytest.mark.parametrize(
    "messages, problem",
    [
        ("hello", "messages must be a non-empty list"),
        ([{"role": "robot", "content": "x"}], "messages[0].role must be one of"),
        (
            [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}],
            "messages[0].content must be a string",
        ),
        # the order of the turns is a declared check of the gate (validate.checks.chat_roles), naming the turn
        (
            [{"role": "user", "content": "hi"}],
            "failed chat_role_order(messages) (messages[0]: the last message must be the assistant's response)",
        ),
        (
            [{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"}],
            "failed chat_role_order(messages) (messages[1]: the assistant turn cannot follow messages[0] (system))",
        ),
    ],
)
def test_malformed_chat_rows_are_quarantined_with_the_reason(tmp_path, messages, problem):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": messages}) + "\n")
    outcome = validate_rows(apply_mapping(read_rows(path), CHAT, str(path)), str(path), ValidateParams())
    assert [row.line for row in outcome.kept] == [1]
    assert outcome.quarantined[0].reasons[0].startswith(f"{path}:2: {problem}")


def test_chat_mapping_to_a_missing_column_is_a_clear_error(tmp_path):
    path = write_all_formats(tmp_path)[0]
    with pytest.raises(DataError, match="data.mapping.messages is 'messages', but no row has that column"):
        list(apply_mapping(read_rows(path), CHAT, str(path)))


# A strict chat template in the style of Llama-2's: roles must alternate user/assistant after an optional
# system message, else the template itself raises.
STRICT_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% if not loop.first %}{{ raise_exception('system must come first') }}{% endif %}"
    "<<SYS>>{{ m['content'] }}<</SYS>>"
    "{% elif (m['role'] == 'user') != ((loop.index0 - (1 if messages[0]['role'] == 'system' else 0)) % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{% endif %}"
)


def _chat_tokenizer(built, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built / "models/base")
    tokenizer.chat_template = STRICT_CHAT_TEMPLATE
    return tokenizer


def test_chat_rows_render_through_the_tokenizers_chat_template(built, tmp_path):
    from fineflow.tokenize.template import encode_batch, render_pair

    tokenizer = _chat_tokenizer(built, tmp_path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "hi"},
    ]
    [row] = apply_mapping([Row(1, {"messages": messages})], CHAT, "chat.jsonl")  # a stream of one
    prompt, response = render_pair(tokenizer, row.data)
    assert prompt == "<<SYS>>Be brief.<</SYS>>[INST] Say hi. [/INST]" and response == " hi"
    batch = encode_batch(tokenizer, [row.data])
    ids, mask = batch.example(0)
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == " hi</s>"  # only the response is trained on


def test_chat_template_check_quarantines_conversations_the_template_rejects(built, tmp_path):
    from fineflow.data.tokens import TokenView

    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    bad = [
        {"role": "user", "content": "hi"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "hello"},
    ]  # valid OpenAI messages, but not alternating
    path = tmp_path / "chat.jsonl"
    third = good[:1] + [good[1] | {"content": "hey"}]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (good, bad, third)))
    tokens = TokenView(_chat_tokenizer(built, tmp_path), 128)
    outcome = validate_rows(apply_mapping(read_rows(path), CHAT, str(path)), str(path), ValidateParams(), tokens=tokens)
    assert [row.line for row in outcome.kept] == [1, 3]
    [reason] = outcome.quarantined[0].reasons
    assert reason.startswith(f"{path}:2: failed chat_template_renders(row)") and "must alternate" in reason
    check = next(c for c in outcome.checks if c.category == "chat_template")
    assert (check.failed, check.first_failed_lines, check.severity) == (1, [2], "error")
    # the embedded tokenizer has no chat template: chat rows render through the fineflow template
    plain = validate_rows(
        apply_mapping(read_rows(path), CHAT, str(path)),
        str(path),
        ValidateParams(),
        tokens=TokenView(tokens.tokenizer.__class__.from_pretrained(built / "models/base"), 128),
    )
    assert len(plain.kept) == 3


def test_a_chat_template_error_that_quotes_the_row_shows_no_secret_in_the_reason(built, tmp_path):
    """A template's raise_exception may quote a message: the reason carries its text, redacted (issue 29)."""
    from fineflow.data.tokens import TokenView

    tokenizer = _chat_tokenizer(built, tmp_path)
    tokenizer.chat_template = "{{ raise_exception('bad turn: ' + messages[0]['content']) }}"
    secret = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
    path = tmp_path / "chat.jsonl"
    messages = [{"role": "user", "content": f"my token {secret}"}, {"role": "assistant", "content": "ok"}]
    path.write_text(json.dumps({"messages": messages}) + "\n")
    tokens = TokenView(tokenizer, 128)
    outcome = validate_rows(apply_mapping(read_rows(path), CHAT, str(path)), str(path), ValidateParams(), tokens=tokens)
    reasons = " ".join(outcome.quarantined[0].reasons)
    assert "chat_template_renders(row)" in reasons and "[SECRET]" in reasons
    assert not any(secret[i : i + 8] in reasons for i in range(len(secret) - 7))


def test_json_nested_too_deeply_is_quarantined_not_a_crash(tmp_path):
    from fineflow.data.formats import read_jsonl

    path = tmp_path / "t.jsonl"
    good = json.dumps({"instruction": "a", "output": "b"})
    path.write_text(good + "\n" + "[" * 200_000 + "]" * 200_000 + "\n" + good + "\n")
    rows = read_jsonl(path)
    assert [row.reasons for row in rows] == [[], [f"{path}:2: JSON nested too deeply to read (over 100 levels)"], []]


# Hostile input: every row below is quarantined with its reason (or read as it is), never a traceback.


def test_csv_cells_with_unicode_line_separators_stay_one_row(tmp_path):
    import csv

    path = tmp_path / "d.csv"
    cells = [("a\u2028b", "c\u2029d"), ("e\x85f", "g\x0bh\x0ci\x1cj"), ('quoted "x"\nsecond line', "k")]
    with path.open("w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["instruction", "output"])
        writer.writerows(cells)
    rows = list(read_rows(path))
    assert [(row.line, row.data) for row in rows] == [
        (2, {"instruction": "a\u2028b", "output": "c\u2029d"}),
        (3, {"instruction": "e\x85f", "output": "g\x0bh\x0ci\x1cj"}),
        (5, {"instruction": 'quoted "x"\nsecond line', "output": "k"}),  # a record spans lines 4-5
    ]


def test_json_object_with_a_duplicate_key_is_quarantined_as_ambiguous(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"instruction": "a", "output": "b"}\n'
        '{"instruction": "a", "output": "safe", "output": "other"}\n'
        '{"messages": [{"role": "user", "role": "assistant", "content": "x"}], "instruction": "c", "output": "d"}\n'
    )
    outcome = validate_rows(read_rows(path), str(path), ValidateParams(max_bad_share=1.0))
    assert [row.line for row in outcome.kept] == [1]
    assert [row.reasons for row in outcome.quarantined] == [
        [f'{path}:2: ambiguous JSON: key "output" appears twice in one object'],
        [f'{path}:3: ambiguous JSON: key "role" appears twice in one object'],  # nested objects too
    ]


@pytest.mark.parametrize("depth", [150, 900, 100_000])
def test_deeply_nested_values_are_quarantined_not_a_recursion_error(tmp_path, depth):
    """900 levels parse (json's limit is ~1,000) but crashed GX's pickling of the frame with a RecursionError;
    100,000 levels do not parse at all."""
    path = tmp_path / "t.jsonl"
    nested = "[" * depth + "]" * depth
    path.write_text(
        '{"instruction": "a", "output": "b"}\n'
        f'{{"instruction": "a", "output": {nested}}}\n'
        f'{{"instruction": "a", "output": "b", "unmapped": {nested}}}\n'  # checked before mapping drops it
    )
    outcome = validate_rows(read_rows(path), str(path), ValidateParams(max_bad_share=1.0))
    assert [row.line for row in outcome.kept] == [1]
    reason = "JSON nested too deeply to read (over 100 levels)"
    assert [row.reasons for row in outcome.quarantined] == [[f"{path}:2: {reason}"], [f"{path}:3: {reason}"]]


def test_lone_surrogate_is_quarantined_so_the_outputs_stay_writable(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"instruction": "a", "output": "b"}\n'
        '{"instruction": "a\\ud800", "output": "b"}\n'
        '{"instruction": "emoji \\ud83d\\ude00", "output": "b"}\n'  # a whole pair is one character: fine
    )
    outcome = validate_rows(read_rows(path), str(path), ValidateParams(max_bad_share=1.0))
    assert [row.line for row in outcome.kept] == [1, 3] and outcome.kept[1].data["instruction"] == "emoji \U0001f600"
    [bad] = outcome.quarantined
    assert bad.reasons == [f"{path}:2: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text"]


def test_a_csv_cell_of_megabytes_is_a_row_for_the_gate_not_a_file_error(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("instruction,output\na,b\n" + "x" * 2_000_000 + ",c\n", encoding="utf-8")
    outcome = validate_rows(read_rows(path), str(path), ValidateParams(max_bad_share=1.0))
    assert [row.line for row in outcome.kept] == [2]
    assert outcome.quarantined[0].reasons == [f"{path}:3: failed length_chars(text)"]


def _too_large(path, line: int, size: int, limit: int) -> str:
    return f"{path}:{line}: the row is {size:,} bytes, over validate.max_row_bytes={limit:,} (quarantined unparsed)"


def test_a_jsonl_row_over_max_row_bytes_is_quarantined_unparsed_and_the_next_row_read(tmp_path):
    import hashlib

    path = tmp_path / "d.jsonl"
    big = b'{"instruction": "a", "output": "' + b"x" * 5000 + b'"}'
    path.write_bytes(b'{"instruction": "a", "output": "b"}\n' + big + b'\n{"instruction": "c", "output": "d"}\n')
    rows = list(read_rows(path, max_row_bytes=1024))
    assert [(row.line, row.data) for row in rows] == [
        (1, {"instruction": "a", "output": "b"}),
        (2, None),
        (3, {"instruction": "c", "output": "d"}),
    ]
    assert rows[1].reasons == [_too_large(path, 2, len(big), 1024)]
    assert rows[1].digest == hashlib.sha256(big).hexdigest() and rows[1].size == len(big)
    assert rows[1].raw == big.decode()[: len(rows[1].raw)] and len(rows[1].raw) >= 200  # enough for the preview
    assert [row.reasons for row in read_rows(path, max_row_bytes=len(big))] == [[], [], []]  # at the limit: read


def test_a_csv_record_over_max_row_bytes_is_quarantined_and_line_numbers_stay_right(tmp_path):
    path = tmp_path / "d.csv"
    long_line = "e," + "q" * 5000  # one line over the limit
    quoted = '"' + "y" * 99 + "\n" + ("y" * 99 + "\n") * 20 + '",z'  # 22 short lines, 2,101 bytes together
    opens_a_quote = 'f,"' + "w" * 5000 + '\nstill the cell",g'  # over the limit, and its quote closes on the next line
    path.write_text(f"instruction,output\na,b\n{long_line}\n{quoted}\n{opens_a_quote}\nc,d\n", encoding="utf-8")
    rows = list(read_rows(path, max_row_bytes=1024))
    assert [(row.line, row.data) for row in rows] == [
        (2, {"instruction": "a", "output": "b"}),
        (3, None),
        (25, None),
        (27, None),
        (28, {"instruction": "c", "output": "d"}),
    ]
    assert rows[1].reasons == [_too_large(path, 3, len(long_line), 1024)]
    assert rows[2].reasons == [_too_large(path, 25, len(quoted), 1024)]
    assert rows[3].reasons == [_too_large(path, 27, len(opens_a_quote), 1024)]
    assert rows[2].raw.startswith('"yyy')


def test_a_parquet_row_over_max_row_bytes_is_quarantined(tmp_path):
    import pandas as pd

    path = tmp_path / "d.parquet"
    pd.DataFrame([{"instruction": "a", "output": "b"}, {"instruction": "c", "output": "x" * 5000}]).to_parquet(path)
    rows = list(read_rows(path, max_row_bytes=1024))
    assert [(row.line, row.data) for row in rows] == [(1, {"instruction": "a", "output": "b"}), (2, None)]
    assert rows[1].reasons == [_too_large(path, 2, rows[1].size, 1024)] and rows[1].size > 5000
