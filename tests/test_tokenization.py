"""Streaming, parallel tokenization: same shards for any worker count, windows bound memory, batch == single."""

import json

import numpy as np

from fineflow.shards import PackedShard
from fineflow.template import encode_batch, encode_example
from fineflow.tokenization import read_rows_lazily, tokenize_to_shard


def _shard_bytes(path):
    return {name: (path / name).read_bytes() for name in ("tokens.bin", "loss_mask.bin", "positions.bin",
                                                           "examples.idx", "meta.json")}


def test_batch_encoding_equals_one_by_one(built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built / "models/base")
    rows = list(read_rows_lazily(built / "data/validated/train.jsonl"))[:50]
    assert encode_batch(tokenizer, rows) == [encode_example(tokenizer, r["instruction"], r["input"], r["output"])
                                             for r in rows]


def test_two_workers_write_byte_identical_shards(built, tmp_path):
    from transformers import AutoTokenizer

    reference = str(built / "models/base")
    tokenizer = AutoTokenizer.from_pretrained(reference)
    rows_path = built / "data/validated/train.jsonl"
    for workers in (1, 2):
        tokenize_to_shard(read_rows_lazily(rows_path), tokenizer, reference, tmp_path / f"w{workers}", 128,
                          np.dtype(np.uint16), workers, pack_window=50, meta={})
    assert _shard_bytes(tmp_path / "w1") == _shard_bytes(tmp_path / "w2")


def test_windowed_packing_keeps_every_example(built, tmp_path):
    from transformers import AutoTokenizer

    reference = str(built / "models/base")
    tokenizer = AutoTokenizer.from_pretrained(reference)
    rows_path = built / "data/validated/train.jsonl"
    n_rows = len(list(read_rows_lazily(rows_path)))
    meta = tokenize_to_shard(read_rows_lazily(rows_path), tokenizer, reference, tmp_path / "s", 128,
                             np.dtype(np.uint16), 1, pack_window=7, meta={})
    shard = PackedShard(tmp_path / "s")
    examples = np.fromfile(tmp_path / "s/examples.idx", dtype=np.int64).reshape(-1, 3)
    assert meta["examples"] == n_rows == len(examples) and meta["rows"] == len(shard)
    assert examples[:, 0].max() == len(shard) - 1  # window-local rows were offset into shard rows
    assert shard.real_tokens(list(range(len(shard)))) == meta["real_tokens"] == int(examples[:, 2].sum())
    assert json.loads((tmp_path / "s/meta.json").read_text())["pack_window"] == 7
