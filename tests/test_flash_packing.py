"""flash_attention_2 on packed micro-batches: fineflow hands flash-attn the cu_seqlens of every example, at any
micro-batch size, because transformers infers them from position ids only for a batch of one row.

No GPU needed: transformers' own flash path (integrations.flash_attention -> _flash_attention_forward, which
picks varlen or dense flash from the kwargs and position ids) runs as is; only flash-attn's two kernels are
replaced by stand-ins with flash-attn's signatures that compute causal SDPA per cu_seqlens segment (varlen)
or over whole rows (dense), and record which one transformers chose and with what.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fineflow.core.train_config import TrainParams
from fineflow.errors import FineflowError
from fineflow.objectives.token_loss import token_loss_sum
from fineflow.tokenize.shards import PackedShard, pack_examples, write_shard
from fineflow.tokenize.template import EncodedBatch
from fineflow.train.attention import FlashLayout, flash_layout, layout_kwargs, layout_of
from fineflow.train.loader import collate, prepare_step
from fineflow.train.loop import evaluate_loss
from fineflow.train.profile import load_profile
from fineflow.train.run_plan import check_hardware

SEQ_LEN = 512
# several examples per row, all lengths different; row 0 ends in padding (its own segment), row 1 is full
LENGTHS = [[70, 133, 9, 201, 64], [300, 45, 160, 7]]
VOCAB = 64


def packed_positions(lengths_per_row: list[list[int]], seq_len: int = SEQ_LEN) -> np.ndarray:
    rows = [
        np.concatenate([np.arange(n) for n in lengths] + [np.arange(seq_len - sum(lengths))])
        for lengths in lengths_per_row
    ]
    return np.stack(rows).astype(np.int64)


def example_spans(lengths_per_row: list[list[int]], seq_len: int = SEQ_LEN) -> list[tuple[int, int]]:
    """(flat start, flat end) of every example, in the micro-batch flattened row after row."""
    spans = []
    for row, lengths in enumerate(lengths_per_row):
        start = row * seq_len
        for n in lengths:
            spans.append((start, start + n))
            start += n
    return spans


def test_cu_seqlens_cover_every_example_exactly_and_never_span_two():
    positions = packed_positions(LENGTHS)
    layout = flash_layout(positions)
    bounds = layout.cu_seqlens.tolist()
    assert layout.cu_seqlens.dtype == np.int32  # what flash-attn's varlen kernel takes
    assert bounds[0] == 0 and bounds[-1] == positions.size and all(b > a for a, b in zip(bounds, bounds[1:]))
    segments = set(zip(bounds[:-1], bounds[1:]))
    spans = example_spans(LENGTHS)
    assert set(spans) <= segments  # every example is exactly one segment: nothing cut off, nothing joined
    padding = segments - set(spans)
    assert padding == {(sum(LENGTHS[0]), SEQ_LEN)}  # the only other segment: row 0's padding tail
    assert all(start // SEQ_LEN == (end - 1) // SEQ_LEN for start, end in segments)  # none crosses rows
    assert layout.max_length == max(max(r) for r in LENGTHS)


def test_transformers_finds_the_packing_only_for_one_row_and_then_agrees_with_fineflow():
    from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

    positions = torch.from_numpy(packed_positions(LENGTHS))
    # on its own, at micro_batch_size 2 transformers sees no packing, so flash would attend over whole rows
    assert not _is_packed_sequence(positions, batch_size=2)
    flat = positions.reshape(1, -1)
    assert _is_packed_sequence(flat, batch_size=1)
    (cu_q, cu_k), (max_q, _) = prepare_fa_kwargs_from_position_ids(flat)
    layout = flash_layout(positions.numpy())
    assert cu_q.tolist() == cu_k.tolist() == layout.cu_seqlens.tolist()
    assert int(max_q) == layout.max_length


class FlashStandIn:
    """flash-attn's flash_attn_func / flash_attn_varlen_func with their signatures (transformers inspects
    them to decide which kwargs to pass), computed with SDPA; records the calls."""

    def __init__(self):
        self.varlen_calls: list[tuple[list[int], int]] = []
        self.dense_calls = 0

    def varlen(
        self,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        bounds = cu_seqlens_q.tolist()
        assert cu_seqlens_k.tolist() == bounds and cu_seqlens_q.dtype == torch.int32
        assert max_seqlen_q == max_seqlen_k == max(b - a for a, b in zip(bounds, bounds[1:]))
        self.varlen_calls.append((bounds, max_seqlen_q))
        out = torch.empty_like(q)  # q: (total tokens, heads, dim)
        for start, end in zip(bounds[:-1], bounds[1:]):
            out[start:end] = self._sdpa(
                q[start:end][None], k[start:end][None], v[start:end][None], causal, softmax_scale
            )[0]
        return out

    def dense(
        self,
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
    ):
        self.dense_calls += 1
        return self._sdpa(q, k, v, causal, softmax_scale)  # (batch, len, heads, dim): whole rows

    @staticmethod
    def _sdpa(q, k, v, causal, scale):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
        return out.transpose(1, 2)


@pytest.fixture
def flash_kernels(monkeypatch):
    """transformers' flash path with the SDPA stand-ins as flash-attn's kernels (reloaded for each test)."""
    import transformers.modeling_flash_attention_utils as fa

    kernels = FlashStandIn()
    monkeypatch.setattr(
        fa,
        "_lazy_imports",
        lambda *args, **kwargs: (kernels.dense, kernels.varlen, None, fa._pad_input, fa._unpad_input),
    )
    monkeypatch.setattr(fa, "_loaded_implementation", None)
    return kernels


def tiny_llama(impl: str):
    """The same weights under any attention implementation (grouped-query, as most real bases)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    # transformers refuses to build a flash model without flash-attn installed; every attention layer and the
    # mask builder read config._attn_implementation per call, so switching it afterwards routes the forward
    # through transformers' real flash path (and its flash mask: none)
    model.config._attn_implementation = impl
    return model


def per_example_logits(model, ids: torch.Tensor, lengths_per_row) -> list[torch.Tensor]:
    """Each example's logits computed alone (a batch of itself): what packing must reproduce."""
    flat = ids.reshape(-1)
    out = []
    with torch.no_grad():
        for start, end in example_spans(lengths_per_row):
            alone = flat[start:end][None]
            out.append(model(input_ids=alone, position_ids=torch.arange(end - start)[None]).logits[0])
    return out


def test_flash_gets_every_examples_cu_seqlens_at_micro_batch_2_and_matches_each_example_alone(flash_kernels):
    positions = packed_positions(LENGTHS)
    ids = torch.from_numpy(np.random.default_rng(0).integers(1, VOCAB, size=positions.shape))
    reference = per_example_logits(tiny_llama("sdpa"), ids, LENGTHS)
    flash = tiny_llama("flash_attention_2")
    layout = flash_layout(positions)
    with torch.no_grad():
        logits = flash(input_ids=ids, position_ids=torch.from_numpy(positions), **layout_kwargs(layout)).logits
    # transformers used fineflow's layout in every layer, as given
    assert flash_kernels.dense_calls == 0
    assert flash_kernels.varlen_calls == [(layout.cu_seqlens.tolist(), layout.max_length)] * 2
    flat = logits.reshape(-1, VOCAB)
    for (start, end), alone in zip(example_spans(LENGTHS), reference):
        torch.testing.assert_close(flat[start:end], alone, rtol=1e-4, atol=1e-5)


def test_without_the_layout_flash_attends_across_the_examples_of_a_row(flash_kernels):
    """What fineflow's layout prevents: the same micro-batch with position ids only attends across examples."""
    positions = packed_positions(LENGTHS)
    ids = torch.from_numpy(np.random.default_rng(0).integers(1, VOCAB, size=positions.shape))
    reference = per_example_logits(tiny_llama("sdpa"), ids, LENGTHS)
    with torch.no_grad():
        logits = tiny_llama("flash_attention_2")(input_ids=ids, position_ids=torch.from_numpy(positions)).logits
    assert flash_kernels.varlen_calls == [] and flash_kernels.dense_calls == 2  # causal over whole rows
    flat = logits.reshape(-1, VOCAB)
    spans = example_spans(LENGTHS)
    torch.testing.assert_close(flat[slice(*spans[0])], reference[0], rtol=1e-4, atol=1e-5)  # first: no one before it
    with pytest.raises(AssertionError):  # the second attended to the first: off by more than the fix's tolerance
        torch.testing.assert_close(flat[slice(*spans[1])], reference[1], rtol=1e-4, atol=1e-5)


def test_the_loader_and_evaluation_hand_flash_the_layout(tmp_path, flash_kernels):
    """Wiring: train batches (prepare_step) carry a FlashLayout per micro-batch, and evaluate_loss at
    micro-batch 2 with flash equals the block-diagonal sdpa loss."""
    rng = np.random.default_rng(1)
    lengths = [70, 133, 9, 201, 64, 300, 45, 160, 7, 90, 120]
    pairs = [(rng.integers(1, VOCAB, size=n).tolist(), (rng.random(n) < 0.6).astype(int).tolist()) for n in lengths]
    arrays, _ = pack_examples(EncodedBatch.from_pairs(pairs), seq_len=SEQ_LEN, pad_id=0, dtype=np.dtype(np.uint16))
    write_shard(tmp_path, arrays, {"vocab_size": VOCAB})
    shard = PackedShard(tmp_path)
    assert len(shard) == 3  # two micro-batches, the last one short

    sampler = SimpleNamespace(next_indices=lambda count: [0, 1][:count], state_dict=dict)
    step = prepare_step(shard, sampler, micro_batch_size=2, grad_accum=1)
    (layout,) = step.layouts
    assert isinstance(layout, FlashLayout)
    assert layout.cu_seqlens.tolist() == flash_layout(shard.batch([0, 1])["position_ids"]).cu_seqlens.tolist()
    assert not isinstance(layout_of(shard.batch([0])["position_ids"], varlen=True), FlashLayout)  # varlen: groups

    accelerator = SimpleNamespace(
        device=torch.device("cpu"), process_index=0, num_processes=1, reduce=lambda tensor, reduction: tensor
    )
    sdpa = tiny_llama("sdpa")
    sdpa_loss = evaluate_loss(sdpa, shard, 2, accelerator)  # it gets the flash kwargs too, and ignores them
    with torch.no_grad():
        sums = [token_loss_sum(sdpa, collate(shard, rows)) for rows in ([0, 1], list(range(2, len(shard))))]
    assert sdpa_loss == pytest.approx(float(sum(s for s, _ in sums)) / sum(n for _, n in sums), rel=1e-6)
    flash_loss = evaluate_loss(tiny_llama("flash_attention_2"), shard, 2, accelerator)
    assert flash_kernels.dense_calls == 0 and len(flash_kernels.varlen_calls) == 2 * 2  # 2 forwards x 2 layers
    assert flash_loss == pytest.approx(sdpa_loss, rel=1e-5)


def _flash_installed(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real(name, *a)
    )


def test_fp32_flash_is_refused_before_launch_naming_both_params(monkeypatch):
    _flash_installed(monkeypatch)  # on a GPU machine with flash-attn, so only the precision is wrong
    with pytest.raises(FineflowError, match="train.attention flash_attention_2 needs train.precision bf16 or fp16"):
        check_hardware(TrainParams(attention="flash_attention_2", precision="no"), True, load_profile("auto"))
    for precision in ("bf16", "fp16"):
        check_hardware(TrainParams(attention="flash_attention_2", precision=precision), True, load_profile("auto"))
    check_hardware(
        TrainParams(attention="varlen", precision="no"), True, load_profile("auto")
    )  # fp32 is fine elsewhere
