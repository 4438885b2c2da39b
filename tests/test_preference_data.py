"""Preference data (train.objective dpo or simpo, issue 34 §2): pairs read and normalised, the gate's checks on
them, the bundled pairs, and their tokens and shards (fineflow.tokenize.pairs and its shard contract)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fineflow.core.data_config import DataParams, FieldMapping, ValidateParams
from fineflow.core.tokenize_config import TokenizeParams
from fineflow.data.formats import apply_mapping, read_rows
from fineflow.data.validation import raise_if_blocked, validate_rows, validate_splits
from fineflow.errors import DataError
from fineflow.objectives import PAIRS

CFG = ValidateParams(max_chars=300, max_bad_share=1.0)
PAIR = {"instruction": "Which number is larger?", "input": "12 or 40", "chosen": "40", "rejected": "12"}
CHAT_PROMPT = [
    {"role": "system", "content": "You compare numbers."},
    {"role": "user", "content": "Which number is larger, 12 or 40?"},
    {"role": "assistant", "content": "Let me look: 40."},
    {"role": "user", "content": "And of 7 or 3?"},
]


def _write(path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _gate(tmp_path, rows: list, tokens=None, mapping: FieldMapping | None = None, cfg: ValidateParams = CFG):
    path = _write(tmp_path / "pairs.jsonl", rows)
    mapped = apply_mapping(read_rows(path), mapping or FieldMapping(), path, schema=PAIRS)
    return validate_rows(mapped, path, cfg, tokens=tokens, schema=PAIRS)


def _reasons(outcome) -> dict[int, str]:
    rows = sorted(outcome.quarantined + outcome.kept, key=lambda row: row.line)
    return {row.line: " | ".join(row.reasons + row.warnings) for row in rows}


def _tiny_tokenizer():
    from fineflow.base.embedded import train_tokenizer

    texts = ["Which number is larger? 12 or 40 the answer is 40 and not 12 " * 3] * 50
    return train_tokenizer(texts, vocab_size=300, model_max_length=512)


# --- reading pairs ---------------------------------------------------------------------------------------------------


def test_pairs_map_from_renamed_columns_and_trl_one_message_answers(tmp_path):
    rows = [
        {"prompt": "Say hi.", "good": "hi", "bad": "bye"},
        {"prompt": "Say bye.", "good": [{"role": "assistant", "content": "bye"}], "bad": "hi"},
    ]
    mapping = FieldMapping(instruction="prompt", input=None, chosen="good", rejected="bad")
    outcome = _gate(tmp_path, rows, mapping=mapping)
    from fineflow.data.validation import clean_record

    assert [clean_record(row) for row in outcome.kept] == [
        {"instruction": "Say hi.", "input": "", "chosen": "hi", "rejected": "bye"},
        {"instruction": "Say bye.", "input": "", "chosen": "bye", "rejected": "hi"},
    ]
    assert outcome.rows_quarantined == 0


def test_a_chat_pair_keeps_its_conversation_as_the_prompt_and_its_turns_are_checked(tmp_path):
    rows = [
        {"messages": CHAT_PROMPT, "chosen": "7.", "rejected": "3."},
        {"messages": CHAT_PROMPT[:3], "chosen": "7.", "rejected": "3."},  # the prompt ends with the assistant
    ]
    outcome = _gate(tmp_path, rows, mapping=FieldMapping(messages="messages"))
    (row,) = outcome.kept
    assert row.data["messages"] == CHAT_PROMPT and (row.data["chosen"], row.data["rejected"]) == ("7.", "3.")
    assert "output" not in row.data and row.data["instruction"].endswith("User: And of 7 or 3?")
    turn = "messages[3]: the assistant turn cannot follow messages[2] (assistant)"
    assert f"failed chat_role_order(messages) ({turn})" in _reasons(outcome)[2]


def test_trl_conversational_preference_parquet_maps_with_messages_from_its_prompt_column(tmp_path):
    """TRL's conversational preference format: prompt, chosen and rejected as message lists (here in Parquet)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "prompt": CHAT_PROMPT,
            "chosen": [{"role": "assistant", "content": "7."}],
            "rejected": [{"role": "assistant", "content": "3."}],
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "trl.parquet")
    path = str(tmp_path / "trl.parquet")
    mapped = apply_mapping(read_rows(path), FieldMapping(messages="prompt"), path, schema=PAIRS)
    (row,) = validate_rows(mapped, path, CFG, schema=PAIRS).kept
    assert (row.data["messages"], row.data["chosen"], row.data["rejected"]) == (CHAT_PROMPT, "7.", "3.")


def test_a_missing_answer_column_is_an_error_naming_the_file_and_the_column(tmp_path):
    with pytest.raises(DataError, match=r"pairs\.jsonl: params\.yaml data\.mapping\.rejected is 'worse'"):
        _gate(tmp_path, [PAIR], mapping=FieldMapping(rejected="worse"))
    outcome = _gate(tmp_path, [{k: v for k, v in PAIR.items() if k != "rejected"}])
    with pytest.raises(DataError, match=r'pairs\.jsonl: required field "rejected" is missing from every row'):
        raise_if_blocked(outcome, CFG)


def test_a_bad_answer_value_is_quarantined_naming_the_row_and_the_field(tmp_path):
    rows = [
        PAIR,
        {**PAIR, "chosen": [{"role": "user", "content": "40"}]},
        {**PAIR, "chosen": None},
        {**PAIR, "rejected": 12},
        {**PAIR, "rejected": [{"role": "assistant", "content": "12"}, {"role": "assistant", "content": "13"}]},
    ]
    reasons = _reasons(_gate(tmp_path, rows))
    assert reasons[1] == ""
    assert reasons[2].endswith(
        ":2: field \"chosen\" (column 'chosen') must be a string or one assistant message "
        '[{"role": "assistant", "content": "..."}]'
    )
    assert ":3: failed not_null(chosen)" in reasons[3]
    assert ":4: failed type_str(rejected)" in reasons[4]
    assert ':5: field "rejected"' in reasons[5]


# --- the gate's checks on pairs --------------------------------------------------------------------------------------


def test_each_check_catches_its_pair_with_its_reason(tmp_path):
    rows = {
        "identical": {**PAIR, "rejected": " 40 "},
        "empty chosen": {**PAIR, "input": "1 or 2", "chosen": " \u200b"},
        "empty rejected": {**PAIR, "input": "3 or 4", "rejected": ""},
        "pii": {**PAIR, "input": "5 or 6", "rejected": "mail me at ann@example.com"},
        "pii chosen": {**PAIR, "input": "15 or 16", "chosen": "call +1 415 555 0199"},
        "pii prompt": {**PAIR, "input": "paid with 4111 1111 1111 1111"},
        "control": {**PAIR, "input": "7 or 8", "chosen": "4\x000"},
        "long": {**PAIR, "input": "9 or 10", "rejected": "x" * 400},
        "good": PAIR,
        "duplicate": PAIR,
    }
    reasons = list(_reasons(_gate(tmp_path, list(rows.values()))).values())
    found = dict(zip(rows, reasons))
    assert "failed pair_distinct(chosen, rejected) (chosen and rejected are the same text)" in found["identical"]
    assert "failed pair_non_empty(chosen)" in found["empty chosen"]
    assert "failed pair_non_empty(rejected)" in found["empty rejected"]
    assert "failed no_pii(text) (email)" in found["pii"]
    assert "failed no_pii(text) (phone)" in found["pii chosen"]
    assert "failed no_pii(text) (credit_card)" in found["pii prompt"]
    assert 'failed no_control_chars(text) (field "chosen" contains a NUL byte (U+0000))' in found["control"]
    assert "failed length_chars(text)" in found["long"]
    assert found["good"] == ""
    assert "failed unique(row) (first seen at line 9)" in found["duplicate"]


def test_a_train_pair_leaking_an_eval_pair_is_caught_by_its_answers_too(tmp_path):
    """The eval pairs' prompts and answers are what leakage looks for: a train pair that copies an eval pair's
    long rejected answer leaks it, even with another prompt."""
    answer = "the larger of the two numbers is forty because forty is more than twelve by far"
    evaluation = _write(tmp_path / "eval.jsonl", [{**PAIR, "rejected": answer}])
    train = _write(tmp_path / "train.jsonl", [{**PAIR, "instruction": "Pick one.", "rejected": answer}, PAIR])
    outcomes = validate_splits({"eval": evaluation, "train": train}, DataParams(), CFG, schema=PAIRS)
    reasons = _reasons(outcomes["train"])
    assert "failed no_leakage(eval)" in reasons[1] and "no_leakage" not in reasons[2]


def test_the_token_checks_measure_the_pair_as_it_is_packed(tmp_path):
    """Both sides share one row of tokenize.seq_len: a pair whose cut leaves the same tokens on both sides has
    nothing to prefer, a prompt that fills the row leaves no answer token to train."""
    from fineflow.data.tokens import TokenView

    common = "the answer is 40 and not 12 " * 12
    rows = [
        PAIR,
        {**PAIR, "chosen": common + "so 40", "rejected": common + "so 12"},  # differ only after the cut
        {**PAIR, "input": "12 or 40 " * 30},  # the prompt alone fills the row
    ]
    tokens = TokenView(_tiny_tokenizer(), seq_len=160)
    reasons = _reasons(_gate(tmp_path, rows, tokens=tokens, cfg=CFG.model_copy(update={"max_chars": 2000})))
    assert reasons[1] == ""
    assert "failed pair_distinct_after_cut(tokens) (after the cut to 80 + 80 tokens both sides are" in reasons[2]
    assert "failed fits_seq_len(pair) (chosen " in reasons[2] and "share one row of tokenize.seq_len=160" in reasons[2]
    assert "failed label_coverage(chosen) (no chosen token left to train on: the pair's two sides" in reasons[3]
    assert "failed label_coverage(rejected)" in reasons[3]


def test_pair_budget_keeps_both_sides_whole_when_they_fit_and_shares_the_row_when_not():
    from fineflow.tokenize.pairs import pair_budget

    assert pair_budget(10, 20, 64) == (10, 20)
    assert pair_budget(10, 100, 64) == (10, 54)
    assert pair_budget(100, 20, 64) == (44, 20)
    assert pair_budget(100, 100, 64) == (32, 32)
    assert pair_budget(100, 100, 65) == (32, 33)


# --- the bundled pairs -----------------------------------------------------------------------------------------------


def test_the_synthetic_pairs_are_the_sft_prompts_seeded_with_a_wrong_answer_of_the_same_family():
    from fineflow.data.synth import split_train_eval, split_train_eval_pairs

    train, evaluation = split_train_eval_pairs(200, 40, seed=3)
    assert (train, evaluation) == split_train_eval_pairs(200, 40, seed=3)
    assert train != split_train_eval_pairs(200, 40, seed=4)[0]
    sft_train, sft_eval = split_train_eval(200, 40, seed=3)
    for pairs, rows in ((train, sft_train), (evaluation, sft_eval)):
        assert [(p["instruction"], p["input"], p["chosen"]) for p in pairs] == [
            (r["instruction"], r["input"], r["output"]) for r in rows
        ]
    assert all(p["chosen"] != p["rejected"] for p in train + evaluation)
    by_family = {p["instruction"].split()[0]: p for p in train}
    compare = by_family["Which"]
    assert compare["rejected"] == str(min(int(n) for n in compare["input"].split(" or ")))
    date = by_family["Rewrite"]
    assert (
        sorted(date["rejected"].split("/")) == sorted(date["chosen"].split("/"))
        or date["rejected"][2:] == date["chosen"][2:]
    )
    words = by_family["Reverse"]
    assert sorted(words["rejected"].split()) == sorted(words["chosen"].split())


def test_the_data_stage_writes_pairs_with_injected_bad_pairs_for_the_gate(tmp_path):
    from fineflow.core.config import Params
    from fineflow.stages import data

    params = Params.model_validate({"train": {"objective": "dpo"}, "data": {"n_train": 60, "n_eval": 10}})
    data.run(params, tmp_path / "train.jsonl", tmp_path / "eval.jsonl")
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    evaluation = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert all(set(row) == {"instruction", "input", "chosen", "rejected"} for row in evaluation)
    assert any(row.get("chosen") == row.get("rejected") for row in train)  # the injected identical pair
    assert any("rejected" not in row for row in train)
    outcomes = validate_splits(
        {"eval": tmp_path / "eval.jsonl", "train": tmp_path / "train.jsonl"}, params.data, CFG, schema=PAIRS
    )
    reasons = " ".join(r for row in outcomes["train"].quarantined for r in row.reasons)
    for expected in ("pair_distinct(chosen, rejected)", "pair_non_empty(rejected)", 'field "rejected" is missing'):
        assert expected in reasons
    assert outcomes["eval"].rows_quarantined == 0


# --- tokens: each side as SFT renders it -----------------------------------------------------------------------------


def _trained(ids: list[int], mask: list[int]) -> list[int]:
    return [t for t, m in zip(ids, mask) if m]


def test_each_side_of_an_alpaca_pair_is_the_sft_example_of_its_answer():
    from fineflow.tokenize.pairs import encode_pairs
    from fineflow.tokenize.template import encode_example

    tokenizer = _tiny_tokenizer()
    rows = [PAIR, {**PAIR, "input": "", "chosen": "forty", "rejected": "twelve"}]
    encoded = encode_pairs(tokenizer, rows)
    assert len(encoded) == 4
    for i, (row, side) in enumerate((r, s) for r in rows for s in ("chosen", "rejected")):
        ids, mask = encoded.example(i)
        assert (ids, mask) == encode_example(tokenizer, row["instruction"], row["input"], row[side])
        assert tokenizer.decode(_trained(ids, mask)) == " " + row[side] + tokenizer.eos_token


@pytest.mark.parametrize("family, end", [("qwen2.5", "<|im_end|>\n"), ("llama3", "<|eot_id|>")])
def test_each_side_of_a_chat_pair_trains_its_answer_after_the_templates_generation_prompt(family, end):
    from fineflow.tokenize.pairs import encode_pairs
    from tests.families import build_tokenizer

    texts = [m["content"] for m in CHAT_PROMPT] * 20 + ["Seven is larger. Three is smaller."] * 20
    tokenizer = build_tokenizer(family, texts)
    row = {"instruction": "", "input": "", "messages": CHAT_PROMPT, "chosen": "Seven is larger.", "rejected": "Three."}
    encoded = encode_pairs(tokenizer, [row])
    prompt = tokenizer.apply_chat_template(CHAT_PROMPT, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    for i, side in enumerate(("chosen", "rejected")):
        ids, mask = encoded.example(i)
        assert ids[: len(prompt_ids)] == prompt_ids and not any(mask[: len(prompt_ids)])  # earlier answers: prompt
        assert all(mask[len(prompt_ids) :])
        assert tokenizer.decode(_trained(ids, mask)) == row[side] + end  # the template's own end of turn, once


# --- shards: a pair per row ------------------------------------------------------------------------------------------


def _pairs(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    words = "the answer is 40 and not 12 so".split()
    return [
        {
            **PAIR,
            "input": f"{i} or {i + 1}",
            "chosen": " ".join(rng.choice(words, rng.integers(1, 30))),
            "rejected": " ".join(rng.choice(words, rng.integers(1, 50))),
        }
        for i in range(n)
    ]


def test_pairs_pack_whole_in_one_row_chosen_first_with_their_slots(tmp_path):
    from fineflow.tokenize.pairs import encode_pairs, pair_budget
    from fineflow.tokenize.shards import PackedShard, shard_key_matches
    from fineflow.tokenize.tokenization import tokenize_to_shard

    tokenizer, seq_len = _tiny_tokenizer(), 96
    rows = _pairs(60)
    expected = encode_pairs(tokenizer, rows)
    meta = tokenize_to_shard(
        rows,
        tokenizer,
        "unused",
        tmp_path / "s",
        seq_len,
        np.dtype(np.uint16),
        1,
        16,
        {"content_key": "k"},
        schema=PAIRS,
    )
    shard = PackedShard(tmp_path / "s")
    examples = np.fromfile(tmp_path / "s/examples.idx", dtype=np.int64).reshape(-1, 3)
    pairs = np.fromfile(tmp_path / "s/pairs.idx", dtype=np.int64).reshape(-1, 2)
    assert (meta["objective"], meta["pairs"], meta["examples"]) == ("preference", 60, 120)
    assert shard_key_matches(tmp_path / "s", "k") is not None  # every file at its expected size
    assert meta["truncated_examples"] > 0  # some pairs are cut to share their row
    slots_seen: dict[int, list[int]] = {}
    for p, (c, r) in enumerate(pairs):
        (row_c, start_c, len_c), (row_r, start_r, len_r) = examples[c], examples[r]
        assert row_c == row_r and start_c + len_c == start_r  # one row, adjacent, chosen first
        full = [expected.example(2 * p), expected.example(2 * p + 1)]
        assert (len_c, len_r) == pair_budget(len(full[0][0]), len(full[1][0]), seq_len)
        for (start, length), (ids, mask) in zip(((start_c, len_c), (start_r, len_r)), full):
            assert shard.tokens[row_c, start : start + length].tolist() == ids[:length]
            assert shard.loss_mask[row_c, start : start + length].tolist() == mask[:length]
            assert shard.positions[row_c, start : start + length].tolist() == list(range(length))  # restart at 0
        slots_c = set(shard.pair_slots[row_c, start_c : start_c + len_c].tolist())
        slots_r = set(shard.pair_slots[row_c, start_r : start_r + len_r].tolist())
        assert len(slots_c) == 1 and slots_r == {slots_c.pop() + 1} and min(slots_r) % 2 == 1
        slots_seen.setdefault(int(row_c), []).append(min(slots_r) // 2)
    for row, ks in slots_seen.items():
        assert sorted(ks) == list(range(len(ks)))  # the k-th pair of a row: 2k, 2k+1
        used = int(examples[examples[:, 0] == row][:, 2].sum())
        assert (shard.pair_slots[row, used:] == -1).all() and (shard.pair_slots[row, :used] >= 0).all()
    batch = shard.batch([0, 1])
    assert batch["pair_slots"].dtype == np.int64 and batch["pair_slots"].shape == (2, seq_len)
    assert (batch["labels"][batch["pair_slots"] == -1] == -100).all()


def test_pair_shards_do_not_depend_on_the_worker_count_and_are_keyed_by_the_objective(tmp_path):
    from fineflow.tokenize.shards import PAIR_FILES, SHARD_FILES
    from fineflow.tokenize.tokenization import content_key, tokenize_split

    tokenizer = _tiny_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tok")
    rows = tmp_path / "train.jsonl"
    _write(rows, _pairs(50))
    shards = {}
    for workers in (1, 2):
        cfg = TokenizeParams(seq_len=96, workers=workers, pack_window=8)
        meta = tokenize_split(tokenizer, str(tmp_path / "tok"), rows, tmp_path / f"w{workers}", cfg, "dpo")
        shards[workers] = {name: (tmp_path / f"w{workers}" / name).read_bytes() for name in SHARD_FILES + PAIR_FILES}
        assert meta["pairs"] == 50 and not meta["reused"]
    assert shards[1] == shards[2]
    cfg = TokenizeParams(seq_len=96)
    assert content_key(rows, tokenizer, cfg, "dpo") == content_key(rows, tokenizer, cfg, "simpo")
    assert content_key(rows, tokenizer, cfg, "dpo") != content_key(rows, tokenizer, cfg, "sft")
    assert content_key(rows, tokenizer, cfg) == content_key(rows, tokenizer, cfg, "sft")  # SFT keys as before


def test_tokenizing_rows_of_another_objective_names_the_file_and_what_to_run(tmp_path):
    from fineflow.errors import FineflowError
    from fineflow.tokenize.tokenization import tokenize_split

    tokenizer = _tiny_tokenizer()
    rows = tmp_path / "train.jsonl"
    _write(rows, [{"instruction": "Say hi.", "input": "", "output": "hi"}])
    with pytest.raises(FineflowError, match=r'train\.jsonl: row 1: field "chosen" is missing.*train\.objective is dpo'):
        tokenize_split(tokenizer, "unused", rows, tmp_path / "s", TokenizeParams(seq_len=96), "dpo")
    _write(rows, [PAIR])
    with pytest.raises(FineflowError, match=r"train\.jsonl: row 1: field 'output' is missing.*train\.objective is sft"):
        tokenize_split(tokenizer, "unused", rows, tmp_path / "s", TokenizeParams(seq_len=96), "sft")


def test_the_data_validate_and_tokenize_stages_make_preference_shards(tmp_path):
    """train.objective dpo through the stages' entries: bundled pairs, gated with the token checks, packed."""
    from fineflow.core.config import Params
    from fineflow.stages import data, tokenize, validate
    from fineflow.tokenize.shards import PackedShard

    params = Params.model_validate(
        {"train": {"objective": "dpo"}, "data": {"n_train": 80, "n_eval": 16}, "tokenize": {"seq_len": 256}}
    )
    _tiny_tokenizer().save_pretrained(tmp_path / "base")
    raw, validated, shards = tmp_path / "raw", tmp_path / "validated", tmp_path / "shards"
    data.run(params, raw / "train.jsonl", raw / "eval.jsonl")
    report = validate.run(
        params, raw / "train.jsonl", raw / "eval.jsonl", validated, tmp_path / "v.json", base_dir=tmp_path / "base"
    )
    kept = [json.loads(line) for line in (validated / "train.jsonl").read_text().splitlines()]
    assert len(kept) == report["rows_kept"] and all(
        set(row) == {"instruction", "input", "chosen", "rejected"} for row in kept
    )
    assert report["checks"]["pair_distinct(chosen, rejected)"]["failed_rows"] == 1  # the injected identical pair
    assert "label_coverage(chosen)" in report["checks"]  # the token checks ran on the pairs
    out = tokenize.run(params, validated, tmp_path / "base", shards)
    assert out["train"]["pairs"] == len(kept) and out["eval"]["pairs"] == report["eval"]["rows_kept"] == 16
    shard = PackedShard(shards / "train")
    assert shard.meta["objective"] == "preference" and "pair_slots" in shard.batch([0])


def test_preference_sources_are_each_validated_as_pairs_then_mixed(tmp_path):
    """data.sources with train.objective dpo: each source mapped and gated as pairs (its own mapping of chosen
    and rejected), the mix made of pairs; the source's cached result is keyed by the objective."""
    from fineflow.core.config import Params
    from fineflow.data.source_gate import source_key
    from fineflow.data.sources import resolve_source
    from fineflow.stages import validate

    numbers = [{**PAIR, "input": f"{i} or {i + 50}", "chosen": str(i + 50), "rejected": str(i)} for i in range(20)]
    renamed = [{"prompt": f"Say the word number {i}.", "good": f"word {i}", "bad": f"word {i + 1}"} for i in range(20)]
    renamed[3]["bad"] = renamed[3]["good"]
    sources = [
        {"path": _write(tmp_path / "numbers.jsonl", numbers), "weight": 1.0},
        {
            "path": _write(tmp_path / "words.jsonl", renamed),
            "weight": 1.0,
            "mapping": {"instruction": "prompt", "input": None, "chosen": "good", "rejected": "bad"},
        },
    ]
    _write(tmp_path / "eval.jsonl", [{**PAIR, "input": "1000 or 2000", "chosen": "2000", "rejected": "1000"}])
    params = Params.model_validate({"train": {"objective": "dpo"}, "data": {"sources": sources}})
    out = tmp_path / "validated"
    args = (tmp_path / "unused.jsonl", tmp_path / "eval.jsonl", out, tmp_path / "v.json", None, None)
    validate.run(params, *args, tmp_path / "cache", tmp_path / "hashes")
    mixed = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(mixed) == 39 and all(set(row) == {"instruction", "input", "chosen", "rejected"} for row in mixed)
    quarantined = [json.loads(line) for line in (out / "quarantine.jsonl").read_text().splitlines()]
    assert [q["line"] for q in quarantined] == [4] and "pair_distinct(chosen, rejected)" in quarantined[0]["reasons"][0]

    sft = Params.model_validate({"data": {"sources": sources}})
    source = resolve_source(0, params.data.sources[0])
    assert source_key(source, "c", params, None, "e", "code") != source_key(source, "c", sft, None, "e", "code")


def test_the_example_chat_preference_set_passes_the_gate_and_trains_its_answers():
    """data/examples/preference_chat*.jsonl (TRL's conversational format: answers as one assistant message)."""
    from fineflow.data.tokens import TokenView
    from fineflow.data.validation import clean_record
    from fineflow.tokenize.pairs import encode_pairs
    from tests.conftest import ROOT
    from tests.families import build_tokenizer

    paths = {
        split: ROOT / f"data/examples/preference_chat{suffix}.jsonl"
        for split, suffix in (("train", ""), ("eval", "_eval"))
    }
    texts = [line for path in paths.values() for line in path.read_text().splitlines()] * 4
    tokenizer = build_tokenizer("qwen2.5", texts)
    data_cfg = DataParams(mapping=FieldMapping(messages="messages"))
    outcomes = validate_splits(paths, data_cfg, ValidateParams(), TokenView(tokenizer, 1024), schema=PAIRS)
    assert [o.rows_quarantined for o in outcomes.values()] == [0, 0] and outcomes["train"].rows_kept == 16
    rows = [clean_record(row) for row in outcomes["train"].kept]
    encoded = encode_pairs(tokenizer, rows)
    for i, row in enumerate(rows):
        for j, side in enumerate(("chosen", "rejected")):
            assert tokenizer.decode(_trained(*encoded.example(2 * i + j))) == row[side] + "<|im_end|>\n"


@pytest.mark.scenario
@pytest.mark.nightly  # CI runs dpo through every stage (test_preference_pipeline); this adds the switch to sft
@pytest.mark.slow
def test_dvc_repro_with_dpo_makes_preference_shards_and_a_switch_to_sft_stales_the_data_stages_only(tmp_path):
    """train.objective is a param of the data, validate and tokenize stages (dvc.yaml): the tiny project with dpo
    bundles, gates and packs pairs through `dvc repro`; a switch to sft makes those three stale, not the base."""
    import subprocess
    import sys

    from tests.conftest import copy_project, venv_env, write_params

    def repro(project) -> str:
        cmd = [sys.executable, "-m", "dvc", "repro", "tokenize"]
        done = subprocess.run(cmd, cwd=project, env=venv_env(), capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    # a pair's row holds its prompt twice: twice the tiny project's 128 tokens
    project = copy_project(tmp_path / "project", {"train.objective": "dpo", "tokenize.seq_len": 256})
    repro(project)
    kept = (project / "data/validated/train.jsonl").read_text().splitlines()
    assert all({"chosen", "rejected"} <= set(json.loads(line)) for line in kept)
    meta = json.loads((project / "data/shards/train/meta.json").read_text())
    assert (meta["objective"], meta["pairs"], meta["examples"]) == ("preference", len(kept), 2 * len(kept))
    write_params(project / "params.yaml", {"train.objective": "sft", "tokenize.seq_len": 256})
    cmd = [sys.executable, "-m", "dvc", "status", "--json", "base", "data", "validate", "tokenize"]
    status = json.loads(subprocess.run(cmd, cwd=project, env=venv_env(), capture_output=True, text=True).stdout)
    assert sorted(status) == ["data", "tokenize", "validate"]  # what a switch to sft re-runs: not the base
    assert all("train.objective" in json.dumps(changes) for changes in status.values()), status
