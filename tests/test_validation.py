"""The validation gate: bad rows are quarantined with file:line reasons; hard failures are clear errors."""

import json

import pytest

from fineflow.core.data_config import ValidateParams, ValidationChecks
from fineflow.data import checks
from fineflow.data.formats import read_jsonl
from fineflow.data.validation import raise_if_blocked, validate_rows
from fineflow.errors import DataError
from fineflow.objectives import EXAMPLES, FEEDBACK, PAIRS

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
    assert outcome.rows_in == 5 and outcome.quarantined == []
    assert [(row.line, row.data["output"], row.warnings) for row in outcome.kept] == [
        (i + 1, f"hi {i}", []) for i in range(5)
    ]
    raise_if_blocked(outcome, CFG)


def test_each_bad_row_is_quarantined_with_file_line_and_check(tmp_path):
    path = write(
        tmp_path / "t.jsonl",
        [
            json.dumps(GOOD),  # 1 ok
            '{"instruction": "x", "output": ',  # 2 malformed JSON
            json.dumps({"instruction": "x"}),  # 3 missing output
            json.dumps({**GOOD, "output": ""}),  # 4 empty output
            json.dumps({**GOOD, "input": "w " * 400}),  # 5 over-long
            json.dumps(GOOD),  # 6 duplicate of 1
            json.dumps({**GOOD, "input": "mail bob@example.com now"}),  # 7 PII
            json.dumps({**GOOD, "output": 42}),  # 8 wrong type
            b'{"instruction": "\xff\xfe", "output": "x"}',  # 9 not UTF-8
            json.dumps(["a", "list"]),  # 10 not an object
        ],
    )
    outcome = outcome_for(path)
    assert outcome.rows_in == 10 == len(outcome.kept) + len(outcome.quarantined)
    assert [row.line for row in outcome.kept] == [1] and outcome.kept[0].warnings == []
    expected = {  # every reason of every quarantined row: the file:line and the check (or parse error) only
        2: ["malformed JSON (Expecting value at column 32)"],
        3: ["failed not_null(output)", 'field "output" is missing'],
        4: ["failed non_empty(output)"],
        5: ["failed length_chars(text)"],
        6: ["failed unique(row) (first seen at line 1)"],
        7: ["failed no_pii(text) (email)"],
        8: ["failed type_str(output)"],
        9: ["not UTF-8 (byte 17)"],
        10: ["expected a JSON object, got list"],
    }
    assert {row.line: row.reasons for row in outcome.quarantined} == {
        line: [f"{path}:{line}: {reason}" for reason in reasons] for line, reasons in expected.items()
    }


def _bad_kind(row: dict, clean: list[dict], eval_rows: list[dict], max_chars: int) -> str:
    """Which of synth.BAD_KINDS inject_bad_rows made this row, from what it does to its victim."""
    if "output" not in row:
        return "missing_field"
    if row["output"] == "":
        return "empty_output"
    if row in eval_rows:
        return "eval_leak"
    if row in clean:
        return "duplicate"
    if len(row["instruction"] + row["input"] + row["output"]) > max_chars:
        return "over_long"
    for kind, marker in (("email", "@example.com; "), ("phone", "call +1 415 555 "), ("card", "paid with 4111 ")):
        if marker in row["input"]:
            return kind
    if row["instruction"].endswith("!"):
        return "near_duplicate"
    raise AssertionError(f"not a row inject_bad_rows makes: {row}")


def _twin(raw: list[dict], line: int, same) -> tuple[int, int]:
    """(first, second) file line of the two rows of the pair that `line` is in; same(row) says which."""
    lines = [i for i, row in enumerate(raw, start=1) if same(row)]
    assert line in lines and len(lines) == 2, (line, lines)  # one original, one copy
    return lines[0], lines[1]


def test_bundled_data_quarantines_exactly_the_injected_bad_rows_each_by_its_check(tiny_params, tmp_path):
    """The stage data's train file is the clean rows in order with one bad row of each synth.BAD_KINDS
    inserted: validation quarantines exactly those, each with the check of its kind, and no clean row;
    the near-duplicate is kept with a warning, as params.yaml sets validate.checks.near_duplicate."""
    from fineflow.data.synth import BAD_KINDS, split_train_eval
    from fineflow.data.validation import validate_splits
    from fineflow.stages import data

    cfg = tiny_params.validate_
    errors = ("non_null", "non_empty", "length_chars", "duplicate", "pii", "leakage")
    assert {c: getattr(cfg.checks, c).severity for c in (*errors, "near_duplicate")} == {
        **dict.fromkeys(errors, "error"),
        "near_duplicate": "warn",  # kept and reported, not quarantined
    }
    paths = {"train": tmp_path / "train.jsonl", "eval": tmp_path / "eval.jsonl"}
    data.run(tiny_params, paths["train"], paths["eval"])
    raw = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    clean, eval_rows = split_train_eval(tiny_params.data.n_train, tiny_params.data.n_eval, tiny_params.seed)

    injected, next_clean = {}, 0  # file line -> kind; the clean rows keep their order around the inserted ones
    for line, row in enumerate(raw, start=1):
        if next_clean < len(clean) and row == clean[next_clean]:
            next_clean += 1
        else:
            injected[line] = _bad_kind(row, clean, eval_rows, cfg.max_chars)
    assert next_clean == len(clean) and sorted(injected.values()) == sorted(BAD_KINDS)  # one of each kind
    line_of = {kind: line for line, kind in injected.items()}

    expected = {  # quarantined line: its reasons
        line_of[kind]: reasons
        for kind, reasons in {
            "missing_field": ["failed not_null(output)", 'field "output" is missing'],
            "empty_output": ["failed non_empty(output)"],
            "over_long": ["failed length_chars(text)"],
            "email": ["failed no_pii(text) (email)"],
            "phone": ["failed no_pii(text) (phone)"],
            "card": ["failed no_pii(text) (credit_card)"],
            "eval_leak": ["failed no_leakage(eval) (100% of its word n-grams are in the eval data)"],
        }.items()
    }
    # the duplicate and the near-duplicate: whichever copy comes second fails (the first copy is kept)
    dup_row = raw[line_of["duplicate"] - 1]
    first, second = _twin(raw, line_of["duplicate"], lambda row: row == dup_row)
    expected[second] = [f"failed unique(row) (first seen at line {first})"]
    warned = {second: [f"failed near_unique(normalized) (same as line {first} up to case/punctuation)"]}
    near = raw[line_of["near_duplicate"] - 1]
    n_first, n_second = _twin(
        raw,
        line_of["near_duplicate"],
        lambda row: (
            (row.get("input"), row.get("output")) == (near["input"], near["output"])
            and row["instruction"].upper().rstrip(".?!") == near["instruction"].rstrip("!")
        ),
    )
    warned[n_second] = [f"failed near_unique(normalized) (same as line {n_first} up to case/punctuation)"]

    outcomes = validate_splits(paths, tiny_params.data, cfg)
    assert outcomes["eval"].quarantined == [] and not any(row.warnings for row in outcomes["eval"].kept)
    train = outcomes["train"]
    src = str(paths["train"])
    assert {row.line: row.reasons for row in train.quarantined} == {
        line: [f"{src}:{line}: {reason}" for reason in reasons] for line, reasons in expected.items()
    }
    assert [row.line for row in train.kept] == [line for line in range(1, len(raw) + 1) if line not in expected]
    assert {row.line: row.warnings for row in train.kept + train.quarantined if row.warnings} == {
        line: [f"{src}:{line}: {warning}" for warning in warnings] for line, warnings in warned.items()
    }
    raise_if_blocked(train, cfg)


def test_too_many_bad_rows_fail_with_file_line_and_check(tmp_path):
    path = write(tmp_path / "t.jsonl", [json.dumps(GOOD), "not json", "{broken"])
    outcome = outcome_for(path)
    assert [row.line for row in outcome.kept] == [1]
    assert [(row.line, len(row.reasons)) for row in outcome.quarantined] == [(2, 1), (3, 1)]
    assert all(row.reasons[0].startswith(f"{path}:{row.line}: malformed JSON") for row in outcome.quarantined)
    with pytest.raises(DataError) as info:
        raise_if_blocked(outcome, ValidateParams(max_bad_share=0.1))
    message = str(info.value)
    assert "2 of 3 rows" in message and "validate.max_bad_share" in message
    assert f"{path}:2: malformed JSON" in message


def test_required_field_missing_everywhere_is_a_schema_error(tmp_path):
    path = write(tmp_path / "t.jsonl", [json.dumps({"instruction": "a", "response": "b"})] * 2)
    with pytest.raises(
        DataError, match=r'required field "output" is missing from every row \(column_exists\(output\)\)'
    ):
        raise_if_blocked(outcome_for(path), CFG)


def test_empty_file_is_a_clear_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(DataError, match=rf"{path}: the file is empty"):
        list(read_jsonl(path))  # readers stream: the error comes with the first row asked for


def test_unreadable_path_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="cannot read the file"):
        list(read_jsonl(tmp_path / "missing.jsonl"))


def test_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n")
    outcome = outcome_for(path)
    assert outcome.quarantined == [] and [(row.line, row.data) for row in outcome.kept] == [(1, GOOD)]


def test_all_rows_bad_fails(tmp_path):
    path = write(tmp_path / "t.jsonl", ["nope", "nope either"])
    with pytest.raises(DataError, match="every one of the 2 rows failed"):
        raise_if_blocked(outcome_for(path), ValidateParams(max_bad_share=1.0))


def test_near_duplicates_warn_by_default_and_keep_the_row(tmp_path):
    path = write(tmp_path / "t.jsonl", [json.dumps(GOOD), json.dumps({**GOOD, "instruction": "  SAY hi!! "})])
    outcome = outcome_for(path)
    assert [row.line for row in outcome.kept] == [1, 2] and not outcome.quarantined
    assert outcome.kept[0].warnings == []
    assert outcome.kept[1].warnings == [
        f"{path}:2: failed near_unique(normalized) (same as line 1 up to case/punctuation)"
    ]
    assert outcome.report()["rows_warned"] == 1


def test_near_duplicates_quarantined_when_severity_is_error(tmp_path):
    from fineflow.core.config import parse_params

    cfg = parse_params(
        {"validate": {"max_bad_share": 1.0, "checks": {"near_duplicate": {"severity": "error", "max_share": 1.0}}}}
    ).validate_
    path = write(tmp_path / "t.jsonl", [json.dumps(GOOD), json.dumps({**GOOD, "output": "HI"})])
    outcome = validate_rows(read_jsonl(path), str(path), cfg)
    assert [row.line for row in outcome.kept] == [1]
    assert [(row.line, row.reasons, row.warnings) for row in outcome.quarantined] == [
        (2, [f"{path}:2: failed near_unique(normalized) (same as line 1 up to case/punctuation)"], [])
    ]


def test_error_check_above_its_max_share_blocks_the_flow(tmp_path):
    from fineflow.core.config import parse_params

    cfg = parse_params({"validate": {"max_bad_share": 1.0, "checks": {"pii": {"max_share": 0.2}}}}).validate_
    rows = [json.dumps({**GOOD, "output": f"hi {i}"}) for i in range(3)]
    rows.append(json.dumps({**GOOD, "input": "call +1 415 555 0100"}))
    path = write(tmp_path / "t.jsonl", rows)
    outcome = validate_rows(read_jsonl(path), str(path), cfg)
    assert [(row.line, row.reasons) for row in outcome.quarantined] == [(4, [f"{path}:4: failed no_pii(text) (phone)"])]
    with pytest.raises(
        DataError,
        match=r"check no_pii\(text\) failed on 1 of 4 rows \(25.0%\), above "
        r"validate.checks.pii.max_share=0.2; first lines: \[4\]",
    ):
        raise_if_blocked(outcome, cfg)


def test_pii_redact_mode_keeps_rows_with_typed_placeholders(tmp_path):
    from fineflow.core.config import parse_params

    cfg = parse_params({"validate": {"pii": "redact"}}).validate_
    path = write(tmp_path / "t.jsonl", [json.dumps({**GOOD, "input": "mail ann@example.org or 10.0.0.7"})])
    outcome = validate_rows(read_jsonl(path), str(path), cfg)
    assert not outcome.quarantined and outcome.kept[0].data["input"] == "mail [EMAIL] or [IPV4]"
    assert outcome.report()["pii_redacted"] == {"email": 1, "ipv4": 1}


def test_pii_redact_mode_redacts_the_messages_of_a_chat_row_too():
    """The chat template renders a kept chat row from its messages: they must not keep what the derived
    instruction and output lost (main redacted only the string fields and kept the messages whole)."""
    from fineflow.core.config import parse_params
    from fineflow.data.formats import Row, chat_to_record
    from tests.secret_corpus import GITHUB_PAT, leaks

    cfg = parse_params({"validate": {"pii": "redact"}}).validate_
    messages = [
        {"role": "user", "content": f"Why does git reject my token {GITHUB_PAT}?"},
        {"role": "assistant", "content": "Mail ann@example.org for a new one."},
    ]
    record, _ = chat_to_record(messages)
    outcome = validate_rows([Row(1, data=record)], "chat", cfg)
    [row] = outcome.kept
    assert leaks(GITHUB_PAT, json.dumps(row.data)) == [] and "ann@example.org" not in json.dumps(row.data)
    assert [m["content"] for m in row.data["messages"]] == [
        "Why does git reject my token [SECRET]?",
        "Mail [EMAIL] for a new one.",
    ]
    assert outcome.report()["pii_redacted"] == {"email": 1, "secret": 1}


def _secret_rows() -> list[str]:
    """Every text of tests/secret_corpus.py in a row, in the prompt (instruction, input) or the response."""
    from tests.secret_corpus import case_texts

    fields = ("input", "output", "instruction")
    return [
        json.dumps({**GOOD, "output": "ok", fields[i % 3]: f"Case {i}: {text}"})
        for i, (_, _, text) in enumerate(case_texts())
    ]


@pytest.mark.parametrize("mode", ["quarantine", "redact"])
def test_no_part_of_a_planted_secret_reaches_any_file_or_output_of_the_validate_stage(
    mode, tmp_path, monkeypatch, capfd
):
    """The stage's CLI on a corpus of real credential formats: neither the quarantine's previews, the kept rows
    (pii: redact keeps the rows, secrets replaced), the report, the Data Docs, the run's records nor its output
    show an 8-character piece of any of them. In quarantine mode the gate also refuses the file (too many bad
    rows), so the refusal's message is searched too."""
    from fineflow.stages import validate
    from tests.conftest import write_params
    from tests.secret_corpus import CASES, leaks_of_every_case

    monkeypatch.chdir(tmp_path)
    write_params(tmp_path / "params.yaml", {"validate.pii": mode})
    inputs = tmp_path / "in"
    inputs.mkdir()
    good = [json.dumps({**GOOD, "output": f"hi number {i} of the good rows"}) for i in range(200)]
    write(inputs / "train.jsonl", good[:180] + _secret_rows())
    write(inputs / "eval.jsonl", good[180:])
    argv = ["--train", "in/train.jsonl", "--eval", "in/eval.jsonl", "--out", "data/validated"]
    code = validate.main([*argv, "--report", "reports/validate.json", "--data-docs", "reports/data_docs"])

    captured = capfd.readouterr()
    written = [p for p in tmp_path.rglob("*") if p.is_file() and inputs not in p.parents]
    blob = "\n".join([captured.out, captured.err, *(p.read_text(errors="replace") for p in written)])
    assert leaks_of_every_case(blob) == {name: [] for name, _, _ in CASES}
    kept = (tmp_path / "data/validated/train.jsonl").read_text().splitlines()
    quarantined = (tmp_path / "data/validated/quarantine.jsonl").read_text().splitlines()
    if mode == "quarantine":  # every secret row quarantined for it, and too many of them: the gate refuses
        assert code == 2 and "failed validation" in captured.err
        assert len(kept) == 180 and all("no_pii(text)" in " ".join(json.loads(r)["reasons"]) for r in quarantined)
    else:  # kept, each with the secret replaced
        assert code == 0 and quarantined == [] and len(kept) == 180 + len(_secret_rows())
        assert all("[SECRET]" in row for row in kept[180:])
    assert any(p.name.endswith(".html") for p in written) and (tmp_path / "reports/validate.json").exists()


def test_train_rows_leaking_the_eval_split_are_quarantined(tmp_path):
    from fineflow.data.overlap import LeakIndex

    long_text = "the quick brown fox jumps over the lazy dog near the river bank today"
    eval_rows = [{"instruction": "Summarize.", "input": long_text, "output": "fox"}]
    index = LeakIndex(["\n".join([r["instruction"], r["input"], r["output"]]) for r in eval_rows], n=8)
    path = write(
        tmp_path / "t.jsonl",
        [
            json.dumps(GOOD),
            json.dumps({"instruction": "summarize", "input": long_text.upper(), "output": "FOX."}),  # exact, normalized
            json.dumps({"instruction": "Retell.", "input": long_text + " and more", "output": "x"}),  # n-gram overlap
        ],
    )
    outcome = validate_rows(read_jsonl(path), str(path), CFG, index)
    assert [row.line for row in outcome.kept] == [1]
    assert reasons(outcome) == {
        2: f"{path}:2: failed no_leakage(eval) (100% of its word n-grams are in the eval data)",
        3: f"{path}:3: failed no_leakage(eval) (64% of its word n-grams are in the eval data)",  # > 0.5
    }


def test_shared_prompt_template_is_not_leakage():
    from fineflow.data.overlap import LeakIndex

    template = "rewrite the date as day month year please"
    index = LeakIndex([f"{template} {y} 01 0{d}" for y in range(1990, 2000) for d in range(1, 4)], n=8)
    assert index.overlap(f"{template} 2044 05 07") == 0.0  # only the template is shared
    assert index.overlap(f"{template} 1995 01 02") == 1.0  # an eval row verbatim


@pytest.mark.slow  # ~30 s of building and scanning a 50 MB line: not for the inner loop
def test_fifty_megabyte_row_is_quarantined_not_a_crash(tmp_path):
    big = "lorem ipsum " * (50 * 1024 * 1024 // 12)
    path = write(tmp_path / "t.jsonl", [json.dumps(GOOD), json.dumps({**GOOD, "input": big})])
    outcome = outcome_for(path)
    assert [row.line for row in outcome.kept] == [1]
    assert [row.line for row in outcome.quarantined] == [2]
    assert f"{path}:2: failed length_chars(text)" in outcome.quarantined[0].reasons[0]


def test_token_checks_flag_truncation_and_quarantine_rows_with_nothing_to_train(tmp_path):
    from fineflow.base.embedded import train_tokenizer
    from fineflow.data.tokens import TokenView

    tokenizer = train_tokenizer(
        ["say hi and bye to everyone in the room " * 3] * 50, vocab_size=300, model_max_length=128
    )
    words = "say hi and bye to everyone in the room"
    path = write(
        tmp_path / "t.jsonl",
        [
            json.dumps(GOOD),
            json.dumps({"instruction": "Say hi.", "input": "", "output": words * 4}),  # response cut short
            json.dumps({"instruction": words * 6, "input": "", "output": "hi"}),  # prompt alone fills the row
        ],
    )
    outcome = validate_rows(read_jsonl(path), str(path), CFG, tokens=TokenView(tokenizer, seq_len=40))
    assert [row.line for row in outcome.quarantined] == [3]
    assert "label_coverage(tokens) (no response token left to train on" in outcome.quarantined[0].reasons[0]
    assert outcome.kept[1].warnings[0].startswith(f"{path}:2: failed fits_seq_len(tokens)")
    assert outcome.report()["truncation_rate"] == round(2 / 3, 5)


# The check declarations (fineflow.data.checks) are the single source of what the gate runs and reports.


def _tiny_tokenizer():
    from fineflow.base.embedded import train_tokenizer

    return train_tokenizer(["say hi and bye to everyone in the room " * 3] * 50, vocab_size=300, model_max_length=128)


def test_every_reported_check_is_declared_once_in_suite_order(tmp_path):
    from fineflow.data.formats import chat_to_record
    from fineflow.data.overlap import LeakIndex
    from fineflow.data.tokens import TokenView

    chat, _ = chat_to_record([{"role": "user", "content": "Say bye."}, {"role": "assistant", "content": "bye"}])
    pair_chat, _ = chat_to_record([{"role": "user", "content": "Say bye."}], pairs=True)
    pair = {"instruction": "Say hi.", "chosen": "hi", "rejected": "bye"}
    sft_rows = [GOOD, {**GOOD, "output": "bye"}, chat]
    pair_rows = [pair, {**pair_chat, "chosen": "bye", "rejected": "hi"}]
    feedback_rows = [{**GOOD, "label": True}, {**GOOD, "output": "bye", "label": False}, {**chat, "label": True}]
    reports = {}
    # SFT rows, preference pairs (dpo, simpo, orpo), feedback rows (kto)
    for schema, rows in ((EXAMPLES, sft_rows), (PAIRS, pair_rows), (FEEDBACK, feedback_rows)):
        path = write(tmp_path / f"{schema}.jsonl", [json.dumps(row) for row in rows])
        outcome = validate_rows(
            read_jsonl(path),
            str(path),
            CFG,
            LeakIndex(["an eval row"], n=8),
            tokens=TokenView(_tiny_tokenizer(), seq_len=40),
            schema=schema,
        )
        reports[schema] = outcome.report()["checks"]
    names = [check.name for check in checks.CHECKS]
    assert len(names) == len(set(names))
    for report in reports.values():
        assert list(report) == [name for name in names if name in report]  # in suite order
    # every declaration applies to some row schema: token view, leak index, pii: quarantine, a chat row
    assert set(reports[EXAMPLES]) | set(reports[PAIRS]) | set(reports[FEEDBACK]) == set(names)
    assert "non_empty(output)" not in reports[PAIRS] and "pair_distinct(chosen, rejected)" not in reports[EXAMPLES]
    assert "feedback_consistent(label)" in reports[FEEDBACK] and "type_bool(label)" not in reports[EXAMPLES]
    report = {**reports[EXAMPLES], **reports[PAIRS], **reports[FEEDBACK]}
    for check in checks.CHECKS:
        entry = report[check.name]
        knobs = check.knobs(CFG.checks)
        assert (entry["category"], entry["severity"], entry["max_share"]) == (
            check.category,
            knobs.severity,
            knobs.max_share,
        )


def test_every_declared_category_has_its_knob_in_config():
    categories = {check.category for check in checks.CHECKS} - {checks.SCHEMA}
    assert categories <= set(ValidationChecks.model_fields), "add the category to ValidationChecks and params.yaml"
    assert checks.SCHEMA not in ValidationChecks.model_fields  # the schema is not negotiable: no knob


def test_checks_on_one_derived_column_derive_it_the_same_way():
    derivations: dict[str, object] = {}
    for check in checks.CHECKS:
        if check.derive is not None:
            assert derivations.setdefault(check.column, check.derive) is check.derive, check.name


def test_a_new_declaration_alone_runs_reports_and_explains_itself(tmp_path, monkeypatch):
    from fineflow.core.config import parse_params

    short_output = checks.Check(
        "min_output_chars(output)",
        "non_empty",
        "output_chars",
        lambda col, ctx: checks._gxe().ExpectColumnValuesToBeBetween(column=col, min_value=3),
        derive=lambda ctx: [len(str(row.data.get("output") or "")) for row in ctx.rows],
        detail=lambda row: f" ({row['output_chars']} characters)",
    )
    monkeypatch.setattr(checks, "CHECKS", [*checks.CHECKS, short_output])
    path = write(tmp_path / "t.jsonl", [json.dumps({**GOOD, "output": "hello"}), json.dumps(GOOD)])
    outcome = outcome_for(path)
    assert [row.line for row in outcome.quarantined] == [2]
    assert outcome.quarantined[0].reasons == [f"{path}:2: failed min_output_chars(output) (2 characters)"]
    entry = outcome.report()["checks"]["min_output_chars(output)"]
    assert entry["category"] == "non_empty" and entry["first_failed_lines"] == [2] and entry["severity"] == "error"
    # its category's knob sets its severity, like every other check of that category
    warn = parse_params({"validate": {"checks": {"non_empty": {"severity": "warn"}}}}).validate_
    outcome = validate_rows(read_jsonl(path), str(path), warn)
    assert not outcome.quarantined
    assert outcome.kept[1].warnings == [f"{path}:2: failed min_output_chars(output) (2 characters)"]


# What is kept of a rejected row, and a gate that streams in bounded chunks.


def test_quarantine_keeps_line_reasons_hash_and_a_redacted_preview_never_the_row(tmp_path):
    import hashlib

    from fineflow.data.validation import quarantine_record

    secret_row = {
        **GOOD,
        "input": "card 4111 1111 1111 1111, mail ann@example.org, key sk_live_4eC39HqLyjWDarjtT1zdp7dc",
    }
    broken = '{"instruction": "ssn 123-45-6789 and ' + "x" * 3000
    path = write(tmp_path / "t.jsonl", [json.dumps(GOOD), json.dumps(secret_row), broken])
    outcome = validate_rows(read_jsonl(path), str(path), ValidateParams(max_bad_share=1.0))
    records = [quarantine_record(row, "train") for row in outcome.quarantined]
    lines = path.read_bytes().split(b"\n")
    assert records == [
        {
            "split": "train",
            "line": 2,
            "reasons": [f"{path}:2: failed no_pii(text) (credit_card,email,secret)"],
            "warnings": [],
            "sha256": hashlib.sha256(lines[1]).hexdigest(),  # the source line's bytes: find it with sha256sum
            "preview": '{"instruction": "Say hi.", "input": "card [CREDIT_CARD], mail [EMAIL], key [SECRET]", '
            '"output": "hi"}',
        },
        {
            "split": "train",
            "line": 3,
            "reasons": [f"{path}:3: malformed JSON (Unterminated string starting at at column 17)"],
            "warnings": [],
            "sha256": hashlib.sha256(lines[2]).hexdigest(),
            "preview": '{"instruction": "ssn [SSN] and ' + "x" * 163 + "…",  # the first 200 characters, redacted
        },
    ]


def _rows_source(n: int, pulled: list[int]):
    """n rows, built as they are pulled (pulled[0] counts them); rows 301.. copy rows 1..100."""
    from fineflow.data.formats import Row

    for i in range(1, n + 1):
        pulled[0] += 1
        data = {"instruction": "Say.", "input": f"row {i % 100 + 1 if i > 300 else i}", "output": "ok"}
        yield Row(i, data=data, size=40)


def test_rows_stream_through_in_bounded_chunks_and_duplicates_are_found_across_them():
    from fineflow.data.validation import validate_stream

    pulled, held = [0], []

    class CountingSink:
        routed = 0

        def kept(self, row):
            self.routed += 1
            held.append(pulled[0] - self.routed)  # rows read but not yet handed on

        quarantined = kept

    outcome = validate_stream(
        _rows_source(500, pulled), "rows", ValidateParams(max_bad_share=1.0), CountingSink(), chunk_rows=50
    )
    assert max(held) < 50  # never more than one chunk in memory, whatever the row count
    assert (outcome.rows_in, outcome.rows_kept, outcome.rows_quarantined) == (500, 300, 200)
    [unique] = [check for check in outcome.checks if check.name == "unique(row)"]
    # rows 301.. repeat rows 1..100: the first copy is always in an earlier chunk
    assert (unique.failed, unique.rows, unique.first_failed_lines[:3]) == (200, 500, [301, 302, 303])


def test_chunked_validation_finds_exactly_what_one_chunk_finds(tiny_params, tmp_path):
    """The bundled data (one bad row of each kind) validated 7 rows at a time: the same reasons, warnings
    and report as in one chunk — duplicates, near-duplicates and leaks across chunk boundaries included."""
    from fineflow.data.overlap import LeakIndex
    from fineflow.data.validation import clean_text
    from fineflow.stages import data

    paths = {"train": tmp_path / "train.jsonl", "eval": tmp_path / "eval.jsonl"}
    data.run(tiny_params, paths["train"], paths["eval"])
    cfg = tiny_params.validate_
    index = LeakIndex(
        (clean_text(r) for r in validate_rows(read_jsonl(paths["eval"]), "e", cfg).kept), cfg.leakage_ngram
    )
    whole = validate_rows(read_jsonl(paths["train"]), "t", cfg, index)
    chunked = validate_rows(read_jsonl(paths["train"]), "t", cfg, index, chunk_rows=7)
    assert [(r.line, r.reasons, r.warnings) for r in chunked.quarantined + chunked.kept] == [
        (r.line, r.reasons, r.warnings) for r in whole.quarantined + whole.kept
    ]
    assert chunked.report() == whole.report() and whole.rows_quarantined == 8


def test_data_docs_sum_the_chunks_and_show_no_row_values(tmp_path):
    rows = [json.dumps({**GOOD, "output": f"hi {i}"}) for i in range(30)]
    rows[12] = json.dumps({**GOOD, "input": "mail zed@example.com"})
    rows[25] = json.dumps({**GOOD, "output": ["card 4111 1111 1111 1111"]})  # a list: its value fails type_str
    path = write(tmp_path / "t.jsonl", rows + [rows[3]])  # and a duplicate: GX's unique check showed the text
    docs = tmp_path / "docs"
    outcome = validate_rows(read_jsonl(path), str(path), CFG, docs_dir=docs, chunk_rows=8)
    assert [row.line for row in outcome.quarantined] == [13, 26, 31]
    [page] = (docs / "validations").rglob("*.html")
    html = page.read_text()
    assert "zed@example.com" not in html and "4111" not in html and "hi 3" not in html
    assert "31" in html  # the element count of the whole file (four chunks)
    assert sorted(p.name for p in (docs / "expectations").iterdir()) == ["fineflow_rows.html"]


@pytest.mark.slow  # ~20 s: an 8 MB hostile row through every check, token checks included
def test_a_huge_row_without_separators_validates_in_linear_time(tmp_path):
    """A row of 8 MB of one letter (the PII scan's and the tokenizer's worst case): the gate runs in a
    subprocess with a generous bound, as a hang detector: a pattern that rescans the run from every position
    is quadratic (days on such a row), and so is a superlinear tokenizer call on the whole row."""
    import subprocess
    import sys

    path = write(tmp_path / "t.jsonl", [json.dumps(GOOD), json.dumps({**GOOD, "input": "a" * 8_000_000})])
    code = f"""
import json
from fineflow.base.embedded import train_tokenizer
from fineflow.core.config import ValidateParams
from fineflow.data.formats import read_jsonl
from fineflow.data.tokens import TokenView
from fineflow.data.validation import validate_rows
tok = train_tokenizer(["say hi and bye to everyone in the room " * 3] * 50, vocab_size=300, model_max_length=128)
outcome = validate_rows(read_jsonl({str(path)!r}), "t", ValidateParams(max_bad_share=1.0), tokens=TokenView(tok, 64))
print(json.dumps([[row.line, row.reasons, row.warnings] for row in outcome.quarantined]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    [[line, reasons, [warning]]] = json.loads(out.stdout.strip().splitlines()[-1])
    assert line == 2 and reasons == [
        "t:2: failed length_chars(text)",
        "t:2: failed label_coverage(tokens) (no response token left to train on after truncation)",
    ]
    tokens = int(warning.removeprefix("t:2: failed fits_seq_len(tokens) (").split()[0])
    assert 8_000_000 <= tokens < 8_000_100  # counted in pieces: every character of the row, one token each here


# Hostile input: blank outputs, control characters, rows too large to train on.

BLANK_OUTPUTS = [
    "   ",
    "\t\n",
    "\u200b\u200c\u200d\ufeff",  # zero-width space, non-joiner, joiner, byte-order mark
    "\u2060",  # word joiner
    "\u00a0",  # no-break space
    " \u00a0\u200b\t\u3000\u2800\u3164",  # mixed, with the ideographic space, braille blank and Hangul filler
]


def test_outputs_of_only_whitespace_or_invisible_characters_fail_non_empty(tmp_path):
    rows = [{"instruction": f"Say hi {i}.", "input": "", "output": blank} for i, blank in enumerate(BLANK_OUTPUTS)]
    rows += [
        {"instruction": "Say hi.", "input": "", "output": "\u200bhi\u00a0"},  # visible text among invisible: kept
        {"instruction": "Say yes.", "input": "", "output": "\u662f"},  # a CJK character is text
    ]
    path = write(tmp_path / "t.jsonl", [json.dumps(row) for row in rows])
    outcome = outcome_for(path)
    blank_lines = range(1, len(BLANK_OUTPUTS) + 1)
    assert reasons(outcome) == {line: f"{path}:{line}: failed non_empty(output)" for line in blank_lines}
    assert [row.line for row in outcome.kept] == [len(BLANK_OUTPUTS) + 1, len(BLANK_OUTPUTS) + 2]


def test_a_chat_response_of_only_whitespace_fails_non_empty(tmp_path):
    from fineflow.core.data_config import FieldMapping
    from fineflow.data.formats import apply_mapping

    conversation = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": " \u200b\n"}]
    path = write(tmp_path / "t.jsonl", [json.dumps({"messages": conversation})])
    rows = apply_mapping(read_jsonl(path), FieldMapping(messages="messages"), str(path))
    outcome = validate_rows(rows, str(path), CFG)
    assert reasons(outcome) == {1: f"{path}:1: failed non_empty(output)"}


def test_control_characters_are_quarantined_naming_the_field(tmp_path):
    path = write(
        tmp_path / "t.jsonl",
        [
            json.dumps({**GOOD, "output": "h\x00i"}),  # 1: JSON's "\u0000"
            json.dumps({**GOOD, "instruction": "Ring\x07."}),  # 2: a bell
            json.dumps({**GOOD, "input": "\x1b[31mred"}),  # 3: a terminal escape
            json.dumps({**GOOD, "output": "tab\tnew\nline\r\n"}),  # 4: tab, newline, return are text: kept
            json.dumps({**GOOD, "output": "the escape \\u0000 as text"}),  # 5: a backslash, not a NUL: kept
            json.dumps({**GOOD, "output": "hi", "source": "\x00"}),  # 6: a column the gate drops: kept
        ],
    )
    outcome = validate_rows(read_jsonl(path), str(path), CFG)
    check = "failed no_control_chars(text)"
    assert reasons(outcome) == {
        1: f'{path}:1: {check} (field "output" contains a NUL byte (U+0000))',
        2: f'{path}:2: {check} (field "instruction" contains a control character (U+0007))',
        3: f'{path}:3: {check} (field "input" contains a control character (U+001B))',
    }
    assert [row.line for row in outcome.kept] == [4, 5, 6]


def _one_huge_row(path, mb: int):
    """Two ordinary rows around one row of mb megabytes (a JSON string of letters)."""
    with path.open("wb") as fh:
        fh.write(json.dumps(GOOD).encode() + b"\n")
        fh.write(b'{"instruction": "Read this.", "input": "')
        for _ in range(mb):
            fh.write(b"a" * 1_000_000)
        fh.write(b'", "output": "ok"}\n')
        fh.write(json.dumps({**GOOD, "output": "bye"}).encode() + b"\n")
    return path


def test_a_row_over_max_row_bytes_is_quarantined_by_the_reader_in_bounded_memory(tmp_path):
    """The reader streams an oversized line in chunks (hashing it, keeping its preview's bytes) and never
    parses it: the gate's memory is bounded by the limit, not the row. Peak traced memory, not time."""
    import hashlib
    import tracemalloc

    from fineflow.core.data_config import DataParams
    from fineflow.data.validation import validate_splits

    limit, mb = 64 * 1024, 40
    train = _one_huge_row(tmp_path / "train.jsonl", mb)
    (tmp_path / "eval.jsonl").write_text(json.dumps({**GOOD, "output": "an eval row"}) + "\n")
    cfg = ValidateParams(max_row_bytes=limit, max_bad_share=0.5)
    paths = {"train": train, "eval": tmp_path / "eval.jsonl"}
    validate_splits(paths, DataParams(), cfg)  # warm: imports and GX's first-run caches are not the row's
    tracemalloc.start()
    try:
        outcome = validate_splits(paths, DataParams(), cfg)["train"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    [big] = outcome.quarantined
    size = mb * 1_000_000 + len('{"instruction": "Read this.", "input": "", "output": "ok"}')
    assert big.line == 2 and big.reasons == [
        f"{train}:2: the row is {size:,} bytes, over validate.max_row_bytes={limit:,} (quarantined unparsed)"
    ]
    assert big.digest == hashlib.sha256(train.read_bytes().split(b"\n")[1]).hexdigest() and big.size == size
    assert big.raw.startswith('{"instruction": "Read this.", "input": "aaa') and big.data is None
    assert [row.line for row in outcome.kept] == [1, 3]
    # ~0.8 MB measured: the limit's bytes and the gate's own objects; on main, 11x the row (440 MB here)
    assert peak < 32 * limit + 2_000_000, f"peak {peak / 1e6:.1f} MB for a {mb} MB row"


def test_max_row_bytes_is_bounded_and_leaves_room_for_max_chars():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_row_bytes"):
        ValidateParams(max_row_bytes=100)
    with pytest.raises(ValidationError, match=r"max_row_bytes \(4,096\) must be >= max_chars \(10,000\)"):
        ValidateParams(max_row_bytes=4096, max_chars=10_000)
    assert ValidateParams().max_row_bytes == 1 << 20
