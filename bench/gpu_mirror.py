"""The parts of fineflow that bench/gpu.py needs, copied so the benchmark runs on a bare GPU image (torch,
transformers and peft only; no pydantic, accelerate or the rest of the pipeline's stack).

Imports only numpy (which transformers requires), the standard library, and torch/transformers inside functions.
Each section names the fineflow module it mirrors; keep them in step when those change:

- packed-row attention layout and the varlen attention function: fineflow/train/attention.py
- flash-attn's cu_seqlens for a micro-batch: fineflow/train/attention.py's flash_layout
- the memory plan for LoRA / QLoRA on one GPU with AdamW: fineflow/train/planner/ (``plan`` restricted to
  method lora|qlora, weights held in the compute dtype, one device, no sharding, no gradient
  checkpointing, optimizer adamw, attention sdpa)

- the price table of the goodput ledger's cost: fineflow/core/config.py's DEFAULT_PRICES (fineflow.goodput.cost)

tests/test_bench_gpu.py compares these copies with the originals, so a change there fails until it is
copied here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# --- fineflow/train/attention.py ---------------------------------------------------------------------------

VARLEN = "fineflow_varlen"
LAYOUT_KWARG = "fineflow_packing"
CALL_COST = 64 * 64  # one more SDPA call costs about the attention of a 64-token example (measured on CPU)


@dataclass
class PackedLayout:
    """groups: per length group, (gather index, examples, longest); scatter: each flat position's row in the
    concatenated group outputs. As fineflow.train.attention.PackedLayout."""

    groups: list[tuple[np.ndarray, int, int]]
    scatter: np.ndarray


def segments(position_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(flat start, length) of every segment: a segment starts where the position id is 0 and ends at the
    next start or its row's end (a row's padding tail is a segment of its own)."""
    batch, seq_len = position_ids.shape
    starts_2d = position_ids == 0
    starts_2d[:, 0] = True
    starts = np.flatnonzero(starts_2d.reshape(-1))
    ends = np.append(starts[1:], batch * seq_len)
    row_ends = (starts // seq_len + 1) * seq_len
    return starts, np.minimum(ends, row_ends) - starts


def plan_groups(lengths_desc: np.ndarray, call_cost: float = CALL_COST) -> list[int]:
    """Group boundaries minimizing sum(examples x longest^2) + call_cost per group (exact DP)."""
    n = len(lengths_desc)
    square = lengths_desc.astype(np.float64) ** 2
    best = np.zeros(n + 1)
    cut = np.zeros(n + 1, dtype=np.int64)
    for end in range(1, n + 1):
        opens = np.arange(end)
        costs = best[:end] + (end - opens) * square[:end] + call_cost
        cut[end] = int(np.argmin(costs))
        best[end] = costs[cut[end]]
    ends, end = [], n
    while end > 0:
        ends.append(end)
        end = int(cut[end])
    return ends[::-1]


def packed_layout(position_ids: np.ndarray, call_cost: float = CALL_COST) -> PackedLayout:
    """The groups and scatter index for one micro-batch (numpy only: runs on the loader thread)."""
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


def layout_kwargs(layout: PackedLayout, device=None) -> dict:
    """The forward kwarg carrying the layout as tensors, moved to device."""
    import torch

    def tensor(array):
        return torch.from_numpy(array).to(device, non_blocking=True) if device is not None else torch.from_numpy(array)

    groups = tuple((tensor(gather), examples, longest) for gather, examples, longest in layout.groups)
    return {LAYOUT_KWARG: (groups, tensor(layout.scatter))}


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function: per-example causal SDPA over length groups.
    (B, H, L, D) query/key/value -> (B, L, H, D). Refuses a padding mask and a call without a layout."""
    import torch
    import torch.nn.functional as F

    packing = kwargs.get(LAYOUT_KWARG)
    if attention_mask is not None:
        raise ValueError(f"{VARLEN}: packed rows take no attention_mask (position ids restart per example)")
    if packing is None:
        raise ValueError(f"{VARLEN}: pass the layout from layout_kwargs(packed_layout(position_ids))")
    groups, scatter = packing
    batch, heads, seq_len, dim = query.shape
    kv_heads = key.shape[1]
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


def register_varlen() -> str:
    """Make attn_implementation=VARLEN known to transformers, with flash-attn's mask function (no dense mask
    is ever built; a padding mask reaches varlen_attention, which refuses it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, flash_attention_mask)
    return VARLEN


# --- flash_attention_2 over a packed micro-batch ------------------------------------------------------------


def flash_varlen_kwargs(position_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """cu_seqlens (int32, over the flattened batch * seq_len tokens) and the longest segment, for
    transformers' flash-attn path. Given explicitly, transformers calls flash_attn_varlen_func on the
    flattened micro-batch whatever its batch size; left to infer them from position ids it only does so
    for batch size 1 (otherwise it runs plain causal attention across the packed examples)."""
    starts, lengths = segments(np.asarray(position_ids))
    cu_seqlens = np.append(starts, np.asarray(position_ids).size).astype(np.int32)
    return cu_seqlens, int(lengths.max())


# --- fineflow/train/planner/ (LoRA / QLoRA, one GPU, AdamW, no checkpointing) --------------------------------

GiB = 1024**3
PRECISION_BYTES = {"bf16": 2, "fp32": 4}
FP32 = 4
ADAPTER_BYTES = 4  # peft keeps adapters in fp32 on a 16-bit base
ADAMW_STATE_BYTES = 8.0  # exp_avg + exp_avg_sq, fp32
ADAMW_STEP_TEMP_BYTES = 4.0  # foreach AdamW's sqrt(exp_avg_sq) for all parameters at once
QLORA_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)  # NF4 with double quantization
LOGITS_FP32_COPIES = 3
CUDA_CONTEXT_BYTES = 0.5 * GiB
FRAGMENTATION = 0.10
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Shape:
    """A Llama decoder's dimensions (planner.ModelShape without biases or an explicit head_dim)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False

    @property
    def q_dim(self) -> int:
        return self.hidden

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def linear_params_per_layer(self) -> int:
        return sum(d_in * d_out for d_in, d_out in self.linear_dims().values())

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def max_linear_params(self) -> int:
        return max(d_in * d_out for d_in, d_out in self.linear_dims().values())


@dataclass(frozen=True)
class Setup:
    """planner.Setup's fields that matter here. packed: an attention mask per layer (sdpa over packed rows
    with a block-diagonal mask); False for varlen and flash, which build none."""

    method: str  # lora | qlora
    precision: str  # bf16 | fp32
    micro_batch_size: int
    seq_len: int
    lora_r: int
    lora_targets: tuple[str, ...] = LINEARS
    packed: bool = False


def lora_params(shape: Shape, r: int, targets: tuple[str, ...]) -> int:
    dims = shape.linear_dims()
    return shape.layers * sum(r * (dims[t][0] + dims[t][1]) for t in set(targets))


def weight_bytes(shape: Shape, setup: Setup) -> float:
    """planner.weight_bytes with weights held in the compute dtype (weight_storage 'compute', as this bench
    loads them): LoRA's base, norms and root (embeddings, lm_head, final norm) in the precision; QLoRA's
    decoder linears in NF4, and its root and norms in fp32 (peft's prepare_model_for_kbit_training upcasts
    them), plus one linear dequantized into the compute dtype at a time; fp32 adapters."""
    width = PRECISION_BYTES[setup.precision]
    if setup.method == "qlora":
        root = (shape.embedding_params + shape.hidden) * FP32
        per_layer = shape.linear_params_per_layer * QLORA_BYTES_PER_PARAM + 2 * shape.hidden * FP32
    else:
        root = (shape.embedding_params + shape.hidden) * width
        per_layer = (shape.linear_params_per_layer + 2 * shape.hidden) * width
    total = root + shape.layers * per_layer + lora_params(shape, setup.lora_r, setup.lora_targets) * ADAPTER_BYTES
    if setup.method == "qlora":
        total += shape.max_linear_params * width
    return total


def autocast_copy_bytes(shape: Shape, setup: Setup) -> float:
    """planner.autocast_copy_bytes for a base held in the compute dtype: only QLoRA's fp32 lm_head, cast to
    16 bits under autocast and kept for backward; nothing in fp32."""
    p = PRECISION_BYTES[setup.precision]
    return shape.vocab * shape.hidden * p if setup.method == "qlora" and p != FP32 else 0.0


def linear_input_bytes_per_token(shape: Shape, setup: Setup) -> float:
    """planner._linear_input_bytes_per_token for adapters: on a 16-bit base each adapted linear keeps its own
    16-bit copy of its input (peft's fp32 cast, autocast's cast back); in fp32 linears reading the same
    tensor share it."""
    width = PRECISION_BYTES[setup.precision]
    dims = shape.linear_dims()
    trains = set(setup.lora_targets)
    if width != ADAPTER_BYTES:
        return sum(width * dims[name][0] for name in trains)
    groups = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
    return sum(width * dims[group[0]][0] for group in groups if trains.intersection(group))


def layer_activation_bytes(shape: Shape, setup: Setup) -> float:
    """planner.layer_activation_bytes with attention 'sdpa' and a frozen base: fp32 norm inputs, linear
    inputs, rotated q/k/v + output + fp32 logsumexp (+ the b*s*s mask when packed), SwiGLU's 3 tensors."""
    p = PRECISION_BYTES[setup.precision]
    h, i, a, s = shape.hidden, shape.intermediate, shape.heads, setup.seq_len
    kv_kept = shape.q_dim if setup.packed and shape.kv_heads < shape.heads else shape.kv_dim
    norms = 2 * FP32 * h
    attention = p * (2 * shape.q_dim + 2 * kv_kept) + FP32 * a + (p * s if setup.packed else 0)
    per_token = norms + linear_input_bytes_per_token(shape, setup) + attention + 3 * p * i
    return setup.micro_batch_size * s * per_token


def logits_bytes(shape: Shape, setup: Setup) -> float:
    return setup.micro_batch_size * setup.seq_len * shape.vocab * FP32 * LOGITS_FP32_COPIES


def activation_bytes(shape: Shape, setup: Setup) -> float:
    """planner.activation_bytes without checkpointing: every layer kept, the final norm's fp32 input, the
    larger of the loss's peak and one layer's backward gradients, and autocast's kept weight copies."""
    p = PRECISION_BYTES[setup.precision]
    tokens = setup.micro_batch_size * setup.seq_len
    head = tokens * FP32 * shape.hidden
    working = tokens * p * (shape.hidden + 2 * shape.intermediate)
    kept = shape.layers * layer_activation_bytes(shape, setup)
    return kept + head + max(logits_bytes(shape, setup), working) + autocast_copy_bytes(shape, setup)


def plan(shape: Shape, setup: Setup) -> dict:
    """The planned peak, by component, in bytes. 'tensors' is what torch.cuda.max_memory_allocated measures;
    'total' adds the CUDA context and 10% allocator fragmentation (planner.overhead_bytes, one GPU)."""
    trainable = lora_params(shape, setup.lora_r, setup.lora_targets)
    parts = {
        "weights": weight_bytes(shape, setup),
        "gradients": trainable * ADAPTER_BYTES,
        "optimizer_states": trainable * ADAMW_STATE_BYTES,
        "activations": activation_bytes(shape, setup),
        "logits": logits_bytes(shape, setup),
        "optimizer_step": trainable * ADAMW_STEP_TEMP_BYTES,
    }
    tensors = (
        parts["weights"]
        + parts["gradients"]
        + parts["optimizer_states"]
        + max(parts["activations"], parts["optimizer_step"])
    )
    parts["tensors"] = tensors
    parts["total"] = tensors + CUDA_CONTEXT_BYTES + FRAGMENTATION * tensors
    return parts


# --- fineflow/core/config.py DEFAULT_PRICES, fineflow/goodput/cost.py --------------------------------------------

PRICES = {
    "B200": 7.0,
    "H200": 5.0,
    "H100": 4.0,
    "A100": 2.5,
    "L40S": 1.9,
    "A10G": 1.2,
    "L4": 0.8,
    "V100": 2.5,
    "T4": 0.5,
    "MI300X": 4.0,
    "gpu": 2.0,
    "cpu": 0.1,
}


def price_per_hour(device_name: str) -> float:
    """$ per device-hour: the table's entry named inside the device's name (longest first), else "gpu"; "cpu"
    for a CPU (as fineflow.goodput.cost.price_per_device_hour without params overrides)."""
    if device_name == "cpu":
        return PRICES["cpu"]
    for model in sorted((m for m in PRICES if m not in ("gpu", "cpu")), key=len, reverse=True):
        if model.lower() in device_name.lower():
            return PRICES[model]
    return PRICES["gpu"]
