"""Attention over packed rows: each example attends only within itself, at any micro-batch size.

A packed row of 512 tokens holds ~7 examples of ~70. transformers' default for such a row (``sdpa`` with
position ids that restart per example) builds a 512 x 512 block-diagonal mask and computes all of it:
on the bundled data 86% of that attention is masked out. Here (``train.attention: varlen``) the examples of
a micro-batch are gathered into groups of similar length (the split that minimizes padded work plus a
per-call cost, plan_groups), each group runs one causal ``scaled_dot_product_attention`` call with no mask
(the fused kernel on CPU, flash on GPU), and the outputs are scattered back into the rows: the CPU- and
any-GPU equivalent of flash-attn's varlen kernel.

``flash_attention_2`` needs the same per-example layout handed to it: transformers (5.x) infers packed
examples from position ids only when the batch is a single row (``_is_packed_sequence`` requires
batch_size == 1); with micro_batch_size > 1 it runs plain causal flash attention over each whole row, and
the examples of a row attend to each other. So fineflow passes flash-attn's own description of the
micro-batch, flattened to one sequence: ``cu_seq_lens_q/k`` (where every example starts) and
``max_length_q/k`` (flash_layout), which transformers' flash path uses as given, at any batch size.

Both layouts are computed from the rows' position ids with numpy on the loader thread, so the training
thread only does index_select / cat. Exactness: each real token's output equals the block-diagonal-mask
result (tests compare loss, gradients and logits); padding inside a group sits after an example's last
token, where causal attention never lets a real query see it.

    register()          # once, before from_pretrained(..., attn_implementation=VARLEN)
    layout = layout_of(position_ids, varlen=True)   # numpy, on the loader thread (varlen=False: flash's)
    model(input_ids, position_ids=..., **layout_kwargs(layout))
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VARLEN = "fineflow_varlen"  # the name registered with transformers' AttentionInterface
LAYOUT_KWARG = "fineflow_packing"  # the forward kwarg that carries a PackedLayout to every attention layer


@dataclass
class PackedLayout:
    """Where each example's tokens sit in the flattened (batch * seq_len) micro-batch.

    groups: per length group, (gather index of shape examples * longest, examples, longest): the
            flattened positions to gather; slots past an example's end repeat its last token.
    scatter: for every flattened position, its row in the concatenated group outputs.
    """

    groups: list[tuple[np.ndarray, int, int]]
    scatter: np.ndarray


@dataclass
class FlashLayout:
    """flash-attn's varlen description of the micro-batch flattened to one sequence of batch * seq_len tokens.

    cu_seqlens: int32, segments + 1: the flattened start of every segment (each example, and each row's
                padding tail), then the total token count; a row's end always closes a segment.
    max_length: the longest segment (flash-attn sizes its launch grid from it).
    """

    cu_seqlens: np.ndarray
    max_length: int


def segments(position_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(flat start, length) of every segment: a segment starts where the position id is 0 (each example,
    and a row's padding tail, restarts its positions) and ends at the next start or the row's end."""
    batch, seq_len = position_ids.shape
    starts_2d = position_ids == 0
    starts_2d[:, 0] = True  # a row always opens a segment, whatever its first position id says
    starts = np.flatnonzero(starts_2d.reshape(-1))
    ends = np.append(starts[1:], batch * seq_len)
    row_ends = (starts // seq_len + 1) * seq_len
    return starts, np.minimum(ends, row_ends) - starts


# What one more attention call costs, in units of (padded length)^2 of one example: measured on CPU, a
# causal fwd+bwd call has ~100 us of fixed cost, about the attention of a 64-token example.
CALL_COST = 64 * 64


def plan_groups(lengths_desc: np.ndarray, call_cost: float = CALL_COST) -> list[int]:
    """Split lengths (sorted longest first) into consecutive groups minimizing sum(examples x longest^2)
    + call_cost per group: the padded attention work plus each kernel call's fixed cost. Exact dynamic
    programme, O(n^2) in numpy terms (n = examples in one micro-batch, tens to a few hundred). Returns the
    group boundaries (end indices)."""
    n = len(lengths_desc)
    square = lengths_desc.astype(np.float64) ** 2
    best = np.zeros(n + 1)
    cut = np.zeros(n + 1, dtype=np.int64)
    for end in range(1, n + 1):
        opens = np.arange(end)  # a group [open, end) is padded to lengths_desc[open], its longest
        costs = best[:end] + (end - opens) * square[:end] + call_cost
        cut[end] = int(np.argmin(costs))
        best[end] = costs[cut[end]]
    ends, end = [], n
    while end > 0:
        ends.append(end)
        end = int(cut[end])
    return ends[::-1]


def packed_layout(position_ids: np.ndarray, call_cost: float = CALL_COST) -> PackedLayout:
    """The groups and scatter index for one micro-batch's position ids (numpy only: runs on the loader
    thread). Examples are grouped by length (plan_groups), each group padded to its longest."""
    starts, lengths = segments(np.asarray(position_ids))
    order = np.argsort(-lengths, kind="stable")
    scatter = np.empty(position_ids.size, dtype=np.int64)
    groups, offset, opened = [], 0, 0
    for end in plan_groups(lengths[order], call_cost):
        members = order[opened:end]
        longest = int(lengths[members[0]])
        slot = np.arange(longest)
        member_len = lengths[members][:, None]
        gather = starts[members][:, None] + np.minimum(slot[None, :], member_len - 1)
        valid = (slot[None, :] < member_len).reshape(-1)
        scatter[gather.reshape(-1)[valid]] = offset + np.flatnonzero(valid)
        groups.append((gather.reshape(-1), len(members), longest))
        offset += len(members) * longest
        opened = end
    return PackedLayout(groups, scatter)


def flash_layout(position_ids: np.ndarray) -> FlashLayout:
    """cu_seqlens and max_length for flash-attn from one micro-batch's position ids (numpy only)."""
    positions = np.asarray(position_ids)
    starts, lengths = segments(positions)
    return FlashLayout(np.append(starts, positions.size).astype(np.int32), int(lengths.max()))


def layout_of(position_ids: np.ndarray, varlen: bool) -> PackedLayout | FlashLayout:
    """The layout a micro-batch travels with: fineflow's varlen groups (train.attention varlen), else
    flash-attn's cu_seqlens, which flash_attention_2 needs at micro_batch_size > 1 and sdpa/eager ignore (they
    build their block-diagonal mask from the position ids)."""
    return packed_layout(position_ids) if varlen else flash_layout(position_ids)


def layout_kwargs(layout: PackedLayout | FlashLayout, device=None) -> dict:
    """The model forward kwargs carrying a layout as tensors (zero-copy from numpy; moved to device). They
    reach every attention layer through the model's **kwargs: LAYOUT_KWARG for varlen_attention, and
    transformers' own FlashAttentionKwargs (cu_seq_lens_q/k, max_length_q/k) for flash_attention_2, whose
    ``_flash_attention_forward`` then calls flash-attn's varlen kernel with them instead of inferring
    (or, at batch > 1, not inferring) packing from position ids."""
    import torch

    def tensor(array):
        return torch.from_numpy(array).to(device, non_blocking=True) if device is not None else torch.from_numpy(array)

    if isinstance(layout, FlashLayout):
        cu_seqlens = tensor(layout.cu_seqlens)
        # one python int for both: flash-attn takes max_seqlen as an int, and transformers reads it once
        return {
            "cu_seq_lens_q": cu_seqlens,
            "cu_seq_lens_k": cu_seqlens,
            "max_length_q": layout.max_length,
            "max_length_k": layout.max_length,
        }
    groups = tuple((tensor(gather), examples, longest) for gather, examples, longest in layout.groups)
    return {LAYOUT_KWARG: (groups, tensor(layout.scatter))}


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function: (B, H, L, D) query/key/value -> (B, L, H, D) output.

    Without a layout kwarg (e.g. a caller that did not go through the loader) it derives the layout from
    the ``position_ids`` transformers passes to every attention layer; without those it refuses, since
    computing attention across packed examples would silently train on the wrong context."""
    import torch
    import torch.nn.functional as F

    packing = kwargs.get(LAYOUT_KWARG)
    if attention_mask is not None:
        raise ValueError(
            f"attention implementation {VARLEN!r} trains on packed rows and got a padding mask: pass "
            "position_ids restarting at 0 per example and no attention_mask, or use "
            "attn_implementation 'sdpa'"
        )
    if packing is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise ValueError(
                f"attention implementation {VARLEN!r} needs position_ids (restarting at 0 per "
                "packed example) or a layout from fineflow.train.attention.layout_kwargs"
            )
        positions = position_ids.expand(query.shape[0], -1).detach().cpu().numpy()
        packing = layout_kwargs(packed_layout(positions), query.device)[LAYOUT_KWARG]
    groups, scatter = packing
    batch, heads, seq_len, dim = query.shape
    kv_heads = key.shape[1]
    # token-major: one row per (batch, position), so a gather picks whole tokens with all their heads
    flat_q = query.transpose(1, 2).reshape(batch * seq_len, heads, dim)
    flat_k = key.transpose(1, 2).reshape(batch * seq_len, kv_heads, dim)
    flat_v = value.transpose(1, 2).reshape(batch * seq_len, kv_heads, dim)
    outputs = []
    for gather, examples, longest in groups:
        q, k, v = (
            t.index_select(0, gather).view(examples, longest, -1, dim).transpose(1, 2) for t in (flat_q, flat_k, flat_v)
        )
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            scale=scaling,
            dropout_p=dropout if module.training else 0.0,
            enable_gqa=kv_heads != heads,
        )
        outputs.append(out.transpose(1, 2).reshape(examples * longest, heads, dim))
    out = torch.cat(outputs).index_select(0, scatter)
    return out.view(batch, seq_len, heads, dim), None


def attention_of(cfg) -> str:
    """The attn_implementation to load a model with for train.attention (cfg: TrainParams), registering fineflow's
    varlen one when chosen (the train stage's model, and the reference_logps stage's)."""
    return register() if cfg.attention == "varlen" else cfg.attention


def register() -> str:
    """Make ``attn_implementation=VARLEN`` known to transformers (idempotent); returns the name.

    Its mask function is flash-attn's: no (batch, 1, L, L) mask is ever built; a 2D padding mask with
    zeros comes through as is, so varlen_attention can refuse it rather than drop it silently."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, flash_attention_mask)
    return VARLEN
