"""The validation gate: bad rows are quarantined with file:line reasons; hard failures are clear errors."""

import json

import pytest

from fineflow.config import ValidateParams
from fineflow.errors import DataError
from fineflow.validation import gate, read_jsonl, validate_rows

CFG = ValidateParams(max_chars=300, max_bad_share=0.5)
GOOD = {"instruction": "Say hi.", "input": "", "output": "hi"}


def write(path, lines):
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else line.encode() for line in lines) + b"\n")
    return path


def outcome_for(path):
    return validate_rows(read_jsonl(path), str(path), CFG)


def reasons(outcome):
    return {row.line: " ".join(row.reasons) for row in outcome.quarantined}


def test_good_rows_pass(tmp_path):
    rows = [json.dumps({**GOOD, "output": f"hi {i}"}) for i in range(5)]
    outcome = outcome_for(write(tmp_path / "t.jsonl", rows))
    assert (outcome.rows_in, len(outcome.kept), len(outcome.quarantined)) == (5, 5, 0)
    gate(outcome, CFG)


def test_each_bad_row_is_quarantined_with_file_line_and_check(tmp_path):
    path = write(tmp_path / "t.jsonl", [
        json.dumps(GOOD),                                            # 1 ok
        '{"instruction": "x", "output": ',                          # 2 malformed JSON
        json.dumps({"instruction": "x"}),                            # 3 missing output
        json.dumps({**GOOD, "output": ""}),                          # 4 empty output
        json.dumps({**GOOD, "input": "w " * 400}),                   # 5 over-long
        json.dumps(GOOD),                                            # 6 duplicate of 1
        json.dumps({**GOOD, "input": "mail bob@example.com now"}),   # 7 PII
        json.dumps({**GOOD, "output": 42}),                          # 8 wrong type
        b'{"instruction": "\xff\xfe", "output": "x"}',               # 9 not UTF-8
        json.dumps(["a", "list"]),                                   # 10 not an object
    ])
    outcome = outcome_for(path)
    got = reasons(outcome)
    assert outcome.rows_in == 10 == len(outcome.kept) + len(outcome.quarantined)
    assert [row.line for row in outcome.kept] == [1]
    expected = {2: "malformed JSON", 3: 'field "output" is missing', 4: "non_empty(output)",
                5: "length_chars(text)", 6: "unique(row) (first seen at line 1)", 7: "pii_email(text)",
                8: "type_str(output)", 9: "not UTF-8", 10: "expected a JSON object"}
    for line, fragment in expected.items():
        assert f"{path}:{line}:" in got[line] and fragment in got[line], (line, got.get(line))


def test_too_many_bad_rows_fail_with_file_line_and_check(tmp_path):
    path = write(tmp_path / "t.jsonl", [json.dumps(GOOD), "not json", "{broken"])
    outcome = outcome_for(path)
    with pytest.raises(DataError) as info:
        gate(outcome, ValidateParams(max_bad_share=0.1))
    message = str(info.value)
    assert "2 of 3 rows" in message and "validate.max_bad_share" in message
    assert f"{path}:2: malformed JSON" in message


def test_required_field_missing_everywhere_is_a_schema_error(tmp_path):
    path = write(tmp_path / "t.jsonl", [json.dumps({"instruction": "a", "response": "b"})] * 2)
    with pytest.raises(DataError, match=r'required field "output" is missing from every row \(column_exists\(output\)\)'):
        gate(outcome_for(path), CFG)


def test_empty_file_is_a_clear_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(DataError, match=rf"{path}: the file is empty"):
        read_jsonl(path)


def test_unreadable_path_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="cannot read the file"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n")
    assert len(outcome_for(path).kept) == 1


def test_all_rows_bad_fails(tmp_path):
    path = write(tmp_path / "t.jsonl", ["nope", "nope either"])
    with pytest.raises(DataError, match="every one of the 2 rows failed"):
        gate(outcome_for(path), ValidateParams(max_bad_share=1.0))
