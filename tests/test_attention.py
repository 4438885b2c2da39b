"""Variable-length attention over packed rows (fineflow.train.attention): the layout covers every token once,
and loss and gradients equal transformers' block-diagonal-mask sdpa on the same rows."""

import numpy as np
import pytest
import torch

from fineflow.objectives.token_loss import token_loss_sum
from fineflow.train.attention import LAYOUT_KWARG, VARLEN, layout_kwargs, packed_layout, plan_groups, register, segments


def packed_rows(lengths_per_row: list[list[int]], seq_len: int) -> np.ndarray:
    """Position ids of rows packed with examples of these lengths, the rest padding (its own segment)."""
    rows = []
    for lengths in lengths_per_row:
        positions = np.concatenate([np.arange(n) for n in lengths] + [np.arange(seq_len - sum(lengths))])
        rows.append(positions)
    return np.stack(rows).astype(np.int64)


def test_segments_follow_position_resets_and_stop_at_row_ends():
    positions = packed_rows([[3, 4, 2], [5, 5]], seq_len=10)  # row 0: 1 padding token; row 1: full
    starts, lengths = segments(positions)
    assert starts.tolist() == [0, 3, 7, 9, 10, 15]
    assert lengths.tolist() == [3, 4, 2, 1, 5, 5]


def test_layout_scatters_every_token_once_and_pads_each_example_only_to_its_group():
    positions = packed_rows([[40, 3, 9, 10], [17, 20, 2], [64]], seq_len=64)
    layout = packed_layout(positions)
    flat_tokens = positions.size
    assert len(set(layout.scatter.tolist())) == flat_tokens  # no two tokens read the same slot
    gathered = np.concatenate([gather for gather, _, _ in layout.groups])
    # reading the concatenated group slots back through scatter returns every token from its own position
    assert (gathered[layout.scatter] == np.arange(flat_tokens)).all()
    longest_of = {}  # example start -> the padded length of its group
    for gather, examples, longest in layout.groups:
        assert gather.shape == (examples * longest,)
        for start in gather.reshape(examples, longest)[:, 0]:
            longest_of[int(start)] = longest
    starts, lengths = segments(positions)
    for start, length in zip(starts.tolist(), lengths.tolist()):
        assert length <= longest_of[start]
    assert sum(examples * longest for _, examples, longest in layout.groups) < 3 * 64 * 2  # not rows padded to 64


def _brute_force_cost(lengths: list[int], call_cost: float) -> float:
    """Cheapest split of sorted lengths into consecutive groups, trying every split."""
    best = float("inf")
    for mask in range(1 << (len(lengths) - 1)):
        cost, opened = 0.0, 0
        for i in range(1, len(lengths) + 1):
            if i == len(lengths) or mask >> (i - 1) & 1:
                cost += (i - opened) * lengths[opened] ** 2 + call_cost
                opened = i
        best = min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(5))
def test_plan_groups_finds_the_cheapest_split(seed):
    lengths = sorted(np.random.default_rng(seed).integers(1, 300, size=9).tolist(), reverse=True)
    ends = plan_groups(np.array(lengths), call_cost=4096)
    opens = [0] + ends[:-1]
    cost = sum((e - o) * lengths[o] ** 2 + 4096 for o, e in zip(opens, ends))
    assert ends[-1] == len(lengths)
    assert cost == pytest.approx(_brute_force_cost(lengths, 4096))


def _model(kv_heads: int = 4, impl: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
    )
    config._attn_implementation = impl
    return LlamaForCausalLM(config)


def _batch(positions: np.ndarray) -> dict:
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, size=positions.shape)
    labels = np.where(rng.random(positions.shape) < 0.6, ids, -100)
    labels[positions == 0] = -100
    return {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(positions),
    }


@pytest.mark.parametrize("kv_heads", [4, 2])  # multi-head and grouped-query attention
def test_varlen_loss_and_gradients_equal_block_diagonal_sdpa(kv_heads):
    register()
    # long-tailed lengths (several groups), a padding tail, a row that is one example
    positions = packed_rows([[50, 3, 9, 10, 20], [17, 33, 2, 1], [96]], seq_len=96)
    batch = _batch(positions)
    results = []
    for impl, extra in (("sdpa", {}), (VARLEN, layout_kwargs(packed_layout(positions)))):
        model = _model(kv_heads, impl)
        loss, n = token_loss_sum(model, batch, **extra)
        loss.backward()
        results.append((loss.detach(), n, {name: p.grad.clone() for name, p in model.named_parameters()}))
    (sdpa_loss, sdpa_n, sdpa_grads), (varlen_loss, varlen_n, varlen_grads) = results
    assert sdpa_n == varlen_n
    torch.testing.assert_close(varlen_loss, sdpa_loss, rtol=1e-5, atol=1e-5)
    for name, grad in sdpa_grads.items():
        torch.testing.assert_close(varlen_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_varlen_without_a_layout_derives_it_from_position_ids():
    register()
    positions = packed_rows([[30, 10, 5], [45, 2]], seq_len=48)
    batch = _batch(positions)
    model = _model(impl=VARLEN).eval()
    with torch.no_grad():
        given, _ = token_loss_sum(model, batch, **layout_kwargs(packed_layout(positions)))
        derived, _ = token_loss_sum(model, batch)
    torch.testing.assert_close(derived, given)


def test_varlen_refuses_a_padding_mask_instead_of_attending_across_examples():
    register()
    model = _model(impl=VARLEN).eval()
    ids = torch.ones(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="packed rows"):
        model(input_ids=ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]]))


def test_layout_kwarg_name_is_what_the_attention_reads():
    assert list(layout_kwargs(packed_layout(packed_rows([[4]], seq_len=4)))) == [LAYOUT_KWARG]
