"""Streaming, parallel tokenization: same shards for any worker count, windows bound memory, batch == single."""

import json

import numpy as np
import pytest

from fineflow.tokenize.shards import PackedShard
from fineflow.tokenize.template import encode_batch, encode_example
from fineflow.tokenize.tokenization import read_rows_lazily, tokenize_to_shard


def _shard_bytes(path):
    return {
        name: (path / name).read_bytes()
        for name in ("tokens.bin", "loss_mask.bin", "positions.bin", "examples.idx", "meta.json")
    }


def test_batch_encoding_equals_one_by_one(built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built / "models/base")
    rows = list(read_rows_lazily(built / "data/validated/train.jsonl"))[:50]
    batch = encode_batch(tokenizer, rows)
    assert [batch.example(i) for i in range(len(rows))] == [
        encode_example(tokenizer, r["instruction"], r["input"], r["output"]) for r in rows
    ]


@pytest.mark.slow
def test_two_workers_write_byte_identical_shards(built, tmp_path):
    from transformers import AutoTokenizer

    reference = str(built / "models/base")
    tokenizer = AutoTokenizer.from_pretrained(reference)
    rows_path = built / "data/validated/train.jsonl"
    for workers in (1, 2):
        tokenize_to_shard(
            read_rows_lazily(rows_path),
            tokenizer,
            reference,
            tmp_path / f"w{workers}",
            128,
            np.dtype(np.uint16),
            workers,
            pack_window=50,
            meta={},
        )
    assert _shard_bytes(tmp_path / "w1") == _shard_bytes(tmp_path / "w2")


def test_windowed_packing_keeps_every_example(built, tmp_path):
    """Packed in windows of 7, every row's example is in the shard once, in input order, with its own token ids and
    loss mask: window-local row numbers were offset into shard rows, nothing was dropped, cut or mixed up."""
    from transformers import AutoTokenizer

    reference = str(built / "models/base")
    tokenizer = AutoTokenizer.from_pretrained(reference)
    rows_path = built / "data/validated/train.jsonl"
    rows = list(read_rows_lazily(rows_path))
    meta = tokenize_to_shard(
        read_rows_lazily(rows_path),
        tokenizer,
        reference,
        tmp_path / "s",
        128,
        np.dtype(np.uint16),
        1,
        pack_window=7,
        meta={},
    )
    shard = PackedShard(tmp_path / "s")
    examples = np.fromfile(tmp_path / "s/examples.idx", dtype=np.int64).reshape(-1, 3)
    expected = [encode_example(tokenizer, r["instruction"], r["input"], r["output"]) for r in rows]
    assert meta["truncated_examples"] == 0 and max(len(ids) for ids, _ in expected) <= 128  # whole examples
    found = [
        (shard.tokens[row, start : start + length].tolist(), shard.loss_mask[row, start : start + length].tolist())
        for row, start, length in examples
    ]
    assert found == expected
    assert shard.real_tokens(list(range(len(shard)))) == meta["real_tokens"] == sum(len(ids) for ids, _ in expected)
    assert json.loads((tmp_path / "s/meta.json").read_text())["pack_window"] == 7


def _tokenize_stage(built, out, **overrides):
    from fineflow.core.config import parse_params
    from fineflow.stages import tokenize
    from tests.conftest import TINY_PARAMS, _merge

    params = parse_params(_merge(TINY_PARAMS, {"tokenize": overrides}) if overrides else TINY_PARAMS)
    return tokenize.run(params, built / "data/validated", built / "models/base", out)


def test_tokenize_is_content_addressed(built, tmp_path):
    """Same rows + tokenizer + template + packing: no work. Any of them changed (or a torn shard): rebuilt."""
    out = tmp_path / "shards"
    first = _tokenize_stage(built, out)
    assert first["train"]["reused"] is False
    before = {p.name: p.stat().st_mtime_ns for p in (out / "train").iterdir()}
    again = _tokenize_stage(built, out, workers=2)  # the worker count is not part of the key
    assert again["train"]["reused"] is True and again["eval"]["reused"] is True
    assert {p.name: p.stat().st_mtime_ns for p in (out / "train").iterdir()} == before
    assert again["train"]["content_key"] == first["train"]["content_key"]

    changed = _tokenize_stage(built, out, seq_len=64)  # packing params are part of the key
    assert changed["train"]["reused"] is False and changed["train"]["content_key"] != first["train"]["content_key"]
    assert json.loads((out / "train/meta.json").read_text())["seq_len"] == 64

    with (out / "train/tokens.bin").open("r+b") as fh:  # a torn shard (e.g. a crash mid-write) is rebuilt
        fh.truncate(10)
    assert _tokenize_stage(built, out, seq_len=64)["train"]["reused"] is False
    assert not list(tmp_path.glob("shards/.tmp-*"))


def test_tokenize_key_follows_rows_tokenizer_and_template(built, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from fineflow.core.config import parse_params
    from fineflow.tokenize import template
    from fineflow.tokenize.tokenization import content_key
    from tests.conftest import TINY_PARAMS

    cfg = parse_params(TINY_PARAMS).tokenize
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes((built / "data/validated/train.jsonl").read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(built / "models/base")
    key = content_key(rows, tokenizer, cfg)
    assert content_key(rows, tokenizer, cfg) == key
    with rows.open("a") as fh:
        fh.write(json.dumps({"instruction": "one more", "input": "", "output": "row"}) + "\n")
    assert content_key(rows, tokenizer, cfg) != key
    rows.write_bytes((built / "data/validated/train.jsonl").read_bytes())
    monkeypatch.setattr(template, "PROMPT_NO_INPUT", "Q: {instruction}\nA:")
    assert content_key(rows, tokenizer, cfg) != key
    monkeypatch.undo()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert content_key(rows, tokenizer, cfg) != key


def test_a_chat_template_that_ends_the_turn_with_the_eos_trains_one_eos_not_two():
    """ChatML models (SmolLM2, Qwen) end an assistant turn with their EOS (<|im_end|>) and a newline. The
    response is trained as the template renders it, with its one EOS: not "<|im_end|>\\n<|im_end|>"."""
    from fineflow.base.embedded import EOS, train_tokenizer
    from fineflow.data.tokens import TokenView

    tokenizer = train_tokenizer(["the user asks and the assistant answers 07/03/2024"] * 20, 300, 128)
    tokenizer.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}" + EOS + "\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    messages = [{"role": "user", "content": "the date"}, {"role": "assistant", "content": "07/03/2024"}]
    row = {"instruction": "the date", "input": "", "output": "07/03/2024", "messages": messages}
    ids, mask = encode_batch(tokenizer, [row]).example(0)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "07/03/2024" + EOS + "\n"
    assert TokenView(tokenizer, 128).measure(row)[0] == len(ids)  # validation counts the tokens trained


# --- chat templates of the real families (tests/families) --------------------------------------------------------


def _family_row(family: str):
    from tests.families import build_tokenizer

    messages = [
        {"role": "user", "content": "Which number is larger?\n\n17 or 62"},
        {"role": "assistant", "content": "62"},
    ]
    row = {"instruction": messages[0]["content"], "input": "", "output": "62", "messages": messages}
    texts = ["Which number is larger? 17 or 62", "62 is larger than 17"] * 20
    return build_tokenizer(family, texts, vocab_size=300), row


@pytest.mark.parametrize("family", ["llama3", "qwen2.5", "mistral"])
def test_a_turn_the_template_ends_with_the_eos_token_is_trained_on_one_eos(family):
    """Llama 3.1's template ends the assistant's turn with <|eot_id|>, Qwen's with <|im_end|>\\n, Mistral's with
    </s>, each the tokenizer's EOS: the tokenize stage appends no second EOS after it, or the model learns to end
    every answer with two (<|eot_id|><|eot_id|>)."""
    tokenizer, row = _family_row(family)
    ids, mask = encode_batch(tokenizer, [row]).example(0)
    trained = [t for t, m in zip(ids, mask) if m]
    assert trained.count(tokenizer.eos_token_id) == 1
    assert tokenizer.decode(trained).rstrip().endswith(tokenizer.eos_token)


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_a_turn_the_template_ends_with_another_token_still_ends_with_eos(family):
    """Gemma's turn ends with <end_of_turn>, Phi-3's with <|end|>: not the EOS, which training appends."""
    tokenizer, row = _family_row(family)
    ids, mask = encode_batch(tokenizer, [row]).example(0)
    assert ids[-1] == tokenizer.eos_token_id and mask[-1] == 1
    assert [t for t, m in zip(ids, mask) if m].count(tokenizer.eos_token_id) == 1


def test_qwen3s_empty_think_block_is_part_of_the_prompt():
    """Qwen3's template opens the last assistant turn with an empty "<think>\\n\\n</think>\\n\\n". The block ends
    the prompt (Qwen3's own non-thinking prompt, enable_thinking=False), for training and evaluation alike, and
    the response is the answer: as the response's start, evaluation's generation (prompted up to
    "<|im_start|>assistant\\n", stopped at the first newline) would read "<think>" and never the answer, exact
    match 0 whatever the model learned."""
    from fineflow.tokenize.template import render_pair

    tokenizer, row = _family_row("qwen3")
    prompt, response = render_pair(tokenizer, row)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert response == "62<|im_end|>\n"
    assert prompt == tokenizer.apply_chat_template(
        row["messages"][:1], add_generation_prompt=True, enable_thinking=False, tokenize=False
    )


def test_a_whitespace_the_template_puts_before_the_answer_stays_in_the_response():
    """Mistral's " " + content: a lone space stays with the answer (a prompt ending in a space tokenizes unlike
    anything the model saw), so the prompt still ends at [/INST]."""
    from fineflow.tokenize.template import render_pair

    tokenizer, row = _family_row("mistral")
    prompt, response = render_pair(tokenizer, row)
    assert prompt.endswith("[/INST]") and response == " 62</s>"


def test_a_system_message_mistrals_template_moves_is_refused_with_where_and_what_to_do():
    """Mistral v0.3's template writes the system message into the last user turn only: with the answer after it,
    the user turn is no longer last and the system text vanishes, so the prompt is not the start of the whole
    conversation and no (prompt, response) split exists. The refusal names where the two renderings part and what
    to change, not a generic message (every such row quarantined, nothing said about why)."""
    from fineflow.tokenize.template import RenderError, render_pair

    tokenizer, row = _family_row("mistral")
    row = {**row, "messages": [{"role": "system", "content": "Be brief."}, *row["messages"]]}
    with pytest.raises(RenderError, match=r"part at character \d+: the prompt has '.*Be brief.*' where the whole "):
        render_pair(tokenizer, row)
    with pytest.raises(RenderError, match="put the system text into the first user message"):
        render_pair(tokenizer, row)
