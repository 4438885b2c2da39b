"""Packed shards: layout, dtype, labels, the seeded resumable sampler, and no cross-example contamination."""

import numpy as np
import pytest
import torch

from fineflow.tokenize.shards import (
    PackedShard,
    RowSampler,
    pack_best_fit,
    pack_exact_fill,
    pack_examples,
    pack_rows,
    token_dtype,
    write_shard,
)
from fineflow.tokenize.template import EncodedBatch


def test_dtype_follows_vocab_size():
    assert token_dtype(1024) == np.uint16 and token_dtype(65_535) == np.uint16
    assert token_dtype(65_536) == np.uint32 and token_dtype(128_256) == np.uint32


def test_best_fit_packs_every_example_once_within_capacity():
    lengths = [5, 9, 3, 7, 2, 8, 1, 6]
    rows = pack_best_fit(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert len(rows) == 5  # 51 tokens need >= 6 rows of 10 only if wasteful; best-fit finds 5 (9+1,8+2,7+3,6,5)
    assert pack_best_fit(lengths, 10) == rows  # deterministic


def _is_packing(rows, lengths, seq_len):
    return sorted(i for row in rows for i in row) == list(range(len(lengths))) and all(
        sum(min(lengths[i], seq_len) for i in row) <= seq_len for row in rows
    )


def test_exact_fill_packs_clustered_lengths_where_best_fit_strands_gaps():
    # the bundled data's shape: lengths clustered at ~1/8 of the row; best-fit puts the long ones together
    lengths = [54, 56, 56, 66, 68, 68, 70, 81] * 50
    best_fit, exact = pack_best_fit(lengths, 512), pack_exact_fill(lengths, 512)
    assert _is_packing(best_fit, lengths, 512) and _is_packing(exact, lengths, 512)
    assert len(exact) < len(best_fit)
    share = sum(lengths) / (len(exact) * 512)
    assert share >= 0.97, share
    assert pack_rows(lengths, 512) == exact and pack_exact_fill(lengths, 512) == exact  # deterministic


def test_pack_rows_keeps_best_fit_when_it_is_better_and_truncates_long_examples():
    rng = np.random.default_rng(0)
    lengths = [max(8, int(x)) for x in rng.lognormal(5.0, 0.9, 3000)]  # long-tailed, some > seq_len
    rows = pack_rows(lengths, 256)
    assert _is_packing(rows, lengths, 256)
    assert len(rows) == min(len(pack_best_fit(lengths, 256)), len(pack_exact_fill(lengths, 256)))


def test_packing_arrays_match_the_layout():
    pairs = [([i] * n, [0] * (n // 2) + [1] * (n - n // 2)) for i, n in enumerate([5, 3, 7, 2, 9, 4], start=1)]
    arrays, truncated = pack_examples(EncodedBatch.from_pairs(pairs), seq_len=8, pad_id=0, dtype=np.dtype(np.uint16))
    assert truncated == 1  # the 9-token example keeps its first 8
    for i, (row, start, length) in enumerate(arrays.examples):
        ids, mask = pairs[i]
        assert arrays.tokens[row, start : start + length].tolist() == ids[:length]
        assert arrays.loss_mask[row, start : start + length].tolist() == mask[:length]
        assert arrays.positions[row, start : start + length].tolist() == list(range(length))
    used = np.bincount(arrays.examples[:, 0], weights=arrays.examples[:, 2]).astype(int)
    for row, n in enumerate(used):  # padding: never trained, positions restart after the last example
        assert arrays.loss_mask[row, n:].sum() == 0 and arrays.tokens[row, n:].sum() == 0
        assert arrays.positions[row, n:].tolist() == list(range(8 - n))


def _toy_examples():
    # (ids, mask): prompt tokens masked 0, response tokens 1
    return EncodedBatch.from_pairs(_toy_pairs())


def _toy_pairs():
    return [([5, 6, 7, 8], [0, 0, 1, 1]), ([9, 10, 11], [0, 1, 1]), ([12, 13, 14, 15, 16, 17], [0, 0, 0, 1, 1, 1])]


def test_shard_round_trip_positions_and_labels(tmp_path):
    arrays, truncated = pack_examples(_toy_examples(), seq_len=8, pad_id=0, dtype=np.dtype(np.uint16))
    meta = write_shard(tmp_path, arrays, {"vocab_size": 32})
    shard = PackedShard(tmp_path)
    assert truncated == 0 and meta["dtype"] == "uint16" and meta["examples"] == 3 and meta["real_tokens"] == 13
    assert (tmp_path / "tokens.bin").stat().st_size == meta["rows"] * 8 * 2
    assert shard.real_tokens(list(range(len(shard)))) == 13  # padding is not counted as work
    examples = np.fromfile(tmp_path / "examples.idx", dtype=np.int64).reshape(-1, 3)
    assert len(examples) == len(_toy_pairs())
    for (ids, mask), (row_index, start, length) in zip(_toy_pairs(), examples):  # each example, read back
        row = shard.row(int(row_index))
        assert row["input_ids"][start : start + length].tolist() == ids
        assert shard.loss_mask[row_index, start : start + length].tolist() == mask
        assert row["position_ids"][start : start + length].tolist() == list(range(length))
        # labels: the response tokens, except an example's first token, which is never a target
        assert row["labels"][start : start + length].tolist() == [-100] + [
            t if m else -100 for t, m in zip(ids[1:], mask[1:])
        ]
    every_label = np.concatenate([shard.row(i)["labels"] for i in range(len(shard))])
    assert sorted(int(x) for x in every_label if x != -100) == [7, 8, 10, 11, 15, 16, 17]


def test_truncation_is_counted(tmp_path):
    _, truncated = pack_examples(
        EncodedBatch.from_pairs([([1] * 12, [1] * 12)]), seq_len=8, pad_id=0, dtype=np.dtype(np.uint16)
    )
    assert truncated == 1


def test_sampler_is_deterministic_disjoint_across_ranks_and_resumable():
    a, b = RowSampler(10, seed=3, rank=0, world_size=2), RowSampler(10, seed=3, rank=1, world_size=2)
    first_a, first_b = a.next_indices(5), b.next_indices(5)
    assert not set(first_a) & set(first_b) and sorted(first_a + first_b) == list(range(10))
    assert RowSampler(10, seed=3, rank=0, world_size=2).next_indices(5) == first_a
    resumed = RowSampler(10, seed=3)
    original = RowSampler(10, seed=3)
    original.next_indices(7)
    resumed.load_state_dict(original.state_dict())
    assert resumed.next_indices(9) == original.next_indices(9)  # crosses an epoch boundary exactly


def test_sampler_refuses_fewer_rows_than_ranks_as_a_user_error():
    from fineflow.errors import DataError

    with pytest.raises(DataError, match="has 3 packed rows, fewer than the 4 processes .*train.num_processes"):
        RowSampler(3, seed=0, world_size=4)


def test_packed_row_loss_equals_sum_of_unpacked_losses(tmp_path):
    """Attention and positions never cross examples: packing changes nothing about each example's loss."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fineflow.objectives.token_loss import token_loss_sum
    from fineflow.train.loader import collate

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
        )
    ).eval()
    examples = _toy_pairs()
    arrays, _ = pack_examples(EncodedBatch.from_pairs(examples), seq_len=16, pad_id=0, dtype=np.dtype(np.uint16))
    write_shard(tmp_path / "packed", arrays, {"vocab_size": 32})
    packed = PackedShard(tmp_path / "packed")
    assert len(packed) == 1  # all three share one row
    with torch.no_grad():
        packed_loss, packed_n = token_loss_sum(model, collate(packed, [0]))
        singles = []
        for k, example in enumerate(examples):
            single, _ = pack_examples(
                EncodedBatch.from_pairs([example]), seq_len=len(example[0]), pad_id=0, dtype=np.dtype(np.uint16)
            )
            write_shard(tmp_path / f"single{k}", single, {"vocab_size": 32})
            singles.append(token_loss_sum(model, collate(PackedShard(tmp_path / f"single{k}"), [0])))
    assert packed_n == sum(n for _, n in singles) == 7
    torch.testing.assert_close(packed_loss, sum(loss for loss, _ in singles), rtol=1e-5, atol=1e-5)


def test_deal_balances_real_tokens_across_ranks_and_keeps_the_global_batch():
    row_tokens = np.array([500, 10, 480, 20, 490, 15, 470, 30] * 8)
    samplers = [RowSampler(len(row_tokens), seed=1, rank=r, world_size=2, row_tokens=row_tokens) for r in (0, 1)]
    single = RowSampler(len(row_tokens), seed=1, row_tokens=row_tokens)
    for _ in range(10):
        hands = [s.next_indices(4) for s in samplers]
        assert all(len(h) == 4 for h in hands)
        assert sorted(hands[0] + hands[1]) == sorted(single.next_indices(8))  # same rows as 1 rank, mb 8
        totals = [int(row_tokens[h].sum()) for h in hands]
        # balanced: the gap is at most one row's tokens, where striding would give up to 4 long rows to one rank
        assert abs(totals[0] - totals[1]) <= row_tokens.max()


def test_sampler_state_refuses_another_dataset():
    state = RowSampler(10, seed=3).state_dict()
    with pytest.raises(ValueError, match="seed 3 over 10 rows"):
        RowSampler(12, seed=3).load_state_dict(state)


def test_loader_prefetches_the_same_steps_and_records_the_state_after_each(tmp_path):
    from fineflow.train.loader import BatchLoader

    pairs = [([i % 30 + 1] * (3 + i % 5), [0, 1] + [1] * (1 + i % 5)) for i in range(60)]
    arrays, _ = pack_examples(EncodedBatch.from_pairs(pairs), seq_len=16, pad_id=0, dtype=np.dtype(np.uint16))
    write_shard(tmp_path, arrays, {"vocab_size": 32})
    shard = PackedShard(tmp_path)
    inline = list(BatchLoader(shard, RowSampler(len(shard), seed=2), 2, 2, steps=9, prefetch=0))
    ahead = BatchLoader(shard, RowSampler(len(shard), seed=2), 2, 2, steps=9, prefetch=3)
    prefetched = list(ahead)
    ahead.close()
    assert [b.rows for b in prefetched] == [b.rows for b in inline]
    assert [b.sampler_state for b in prefetched] == [b.sampler_state for b in inline]
    for batch in prefetched:
        torch.testing.assert_close(
            batch.micro[0]["input_ids"], torch.from_numpy(shard.batch(batch.rows[0])["input_ids"])
        )
    # resuming from step 4's recorded state yields exactly steps 5..9
    resumed = RowSampler(len(shard), seed=2)
    resumed.load_state_dict(prefetched[3].sampler_state)
    rest = list(BatchLoader(shard, resumed, 2, 2, steps=5, prefetch=2))
    assert [b.rows for b in rest] == [b.rows for b in inline[4:]]


def test_loader_reraises_a_failure_from_its_thread(tmp_path):
    from fineflow.train.loader import BatchLoader

    arrays, _ = pack_examples(_toy_examples(), seq_len=8, pad_id=0, dtype=np.dtype(np.uint16))
    write_shard(tmp_path, arrays, {"vocab_size": 32})
    shard = PackedShard(tmp_path)
    (tmp_path / "tokens.bin").unlink()  # the memory map stays valid; break the sampler instead
    sampler = RowSampler(len(shard), seed=0)
    sampler.next_indices = lambda count: (_ for _ in ()).throw(OSError("disk went away"))
    loader = BatchLoader(shard, sampler, 1, 1, steps=3, prefetch=2)
    with pytest.raises(OSError, match="disk went away"):
        next(loader)


def test_seq_len_beyond_the_position_dtype_is_a_params_error():
    """positions.bin stores position ids as uint16: a longer row would wrap them around to 0 silently."""
    import numpy as np

    from fineflow.core.config import parse_params
    from fineflow.core.tokenize_config import MAX_SEQ_LEN
    from fineflow.errors import ConfigError
    from fineflow.tokenize.shards import POSITION_DTYPE

    assert MAX_SEQ_LEN == np.iinfo(POSITION_DTYPE).max + 1  # the params bound is the shard format's
    assert parse_params({"tokenize": {"seq_len": MAX_SEQ_LEN}}).tokenize.seq_len == MAX_SEQ_LEN
    with pytest.raises(ConfigError, match=r"tokenize\.seq_len: must be <= 65,536: shards store position ids as uint16"):
        parse_params({"tokenize": {"seq_len": MAX_SEQ_LEN + 1}})


def test_a_row_of_max_seq_len_keeps_every_position():
    import numpy as np

    from fineflow.core.tokenize_config import MAX_SEQ_LEN
    from fineflow.tokenize.shards import pack_examples
    from fineflow.tokenize.template import EncodedBatch

    ids = np.arange(MAX_SEQ_LEN, dtype=np.int64) % 100
    batch = EncodedBatch(ids, np.ones(MAX_SEQ_LEN, dtype=np.uint8), np.array([MAX_SEQ_LEN]))
    arrays, truncated = pack_examples(batch, MAX_SEQ_LEN, pad_id=0, dtype=np.dtype(np.uint16))
    assert truncated == 0 and arrays.positions[0, -1] == MAX_SEQ_LEN - 1
