"""The planner's memory terms: a run's peak memory per device (``plan()``: weights, gradients, optimizer states,
activations, overhead) for a model shape and a ``Setup``. Pure arithmetic, no torch import.

Conventions (what a number means):

- Weights are counted in the dtype layout really held (``Setup.weight_storage``; the train stage sets it
  from ``fineflow.train.precision``, as build_model loads the model):
  - ``compute``: weights in the compute precision. LoRA: the frozen base in bf16/fp16 (2 bytes/param;
    a 7B base is 12.6 GiB). Full fine-tuning: mixed precision with fp32 master weights, as in ZeRO
    (Rajbhandari et al. 2020) and DeepSpeed's bf16 mode: 16-bit weights (2 bytes/param) and gradients (2)
    on the device, and fp32 master weights (4) plus the optimizer's fp32 states (AdamW: 8) counted
    together under *optimizer states*: 16 bytes/param in all.
  - ``fp32``: fp32 weights (4 bytes/param; a 7B base is 25.1 GiB) that autocast casts to 16 bits as
    each layer runs: accelerate's DDP full fine-tuning (4 + 4 + 8, no master copy), a LoRA base loaded in
    fp32. The 16-bit copies autograd keeps for backward are counted with the activations
    (``autocast_copy_bytes``): they live only between forward and backward.
  - QLoRA: decoder linears in NF4; peft's prepare_model_for_kbit_training upcasts everything else
    (embeddings, lm_head, norms) to fp32.
  In fp32 precision both layouts are 4 bytes/param, and full fine-tuning has no master copy: 4 + 4 + 8.
- LoRA/QLoRA adapters are fp32 (peft upcasts adapter weights on a 16-bit base), so adapter weights,
  gradients and optimizer states are fp32.
- Activations count the tensors autograd keeps for backward, tensor by tensor, for the Llama block as
  transformers 5 implements it (RMSNorm upcast to fp32, SwiGLU MLP, rotary attention): the method of
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models". Their GPT
  figure is s*b*h*(34 + 5*a*s/h) bytes per layer at 16 bits; a Llama block keeps more (the SwiGLU MLP
  keeps three intermediate-sized tensors, the RMSNorm an fp32 copy of its input) and has no dropout
  masks. With SDPA (flash / memory-efficient kernels) the a*s^2 term is gone: only a logsumexp per head
  and token is kept, but packed rows bring a b*s*s attention mask per layer (transformers' sdpa; not
  fineflow's varlen nor flash_attention_2, which attend per example). Gradient checkpointing keeps
  each layer's input and recomputes one layer at a time. The loss adds three fp32 (tokens x vocab)
  tensors. Mixed-precision LoRA is assumed to run under autocast (each adapter keeps a 16-bit copy of
  its input).
- Peak = weights + gradients + optimizer states + the larger of (activations, the optimizer step's
  temporaries) + overhead: activations are freed by the time optimizer.step() runs.
- Per device: with ``num_gpus`` data-parallel ranks each holds its own micro-batch's activations;
  ``sharding`` decides what else is divided (see ``SHARDINGS``).

Validated on CPU against measured memory by ``bench/planner_accuracy.py`` (figures in bench/RESULTS.md):
weights and activations in fp32 with SDPA and eager attention, checkpointing, packed rows and LoRA; LoRA
under bf16 autocast on a bf16 and on an fp32 base; weights by dtype accounting for fp32, bf16 and the
QLoRA layout (the 4-bit part computed from the modules bitsandbytes would quantize). Not measured yet
(GPU only): bitsandbytes' real 4-bit storage and dequantization buffers, CUDA kernels' 16-bit
activations, 8-bit optimizer storage, sharding, and the overhead constants below.
"
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fineflow.errors import FineflowError
from fineflow.train.architecture import ALL_LINEAR, FUSED_GATE_UP, FUSED_QKV, STANDS_FOR
from fineflow.train.planner.shapes import ModelShape

GiB = 1024**3

METHODS = ("full", "lora", "qlora")
PRECISIONS = {"bf16": 2, "fp16": 2, "fp32": 4}  # bytes per element of weights and activations
OPTIMIZERS = ("adamw", "adamw_8bit", "sgd")
# train.attention's kinds, and eager. sdpa: transformers' SDPA (flash / memory-efficient kernels, no a*s^2 term) over
# the whole row; eager: the a*s*s matrix. varlen (fineflow.train.attention) and flash_attention_2 attend per
# packed example: no row mask, and grouped-query k/v are never expanded to every head
ATTENTIONS = ("sdpa", "eager", "varlen", "flash_attention_2")
PER_EXAMPLE_ATTENTIONS = ("varlen", "flash_attention_2")
# none: DDP, every rank holds everything. zero2: gradients and optimizer states sharded over the ranks.
# fsdp / zero3: weights, gradients and optimizer states sharded; layers are gathered as they run.
SHARDINGS = ("none", "zero2", "fsdp", "zero3")
# compute: weights held in the compute precision; fp32: fp32 weights cast by autocast as layers run
WEIGHT_STORAGES = ("compute", "fp32")
# Llama's linears: the default targets, and train.lora.target_modules' portable names for the projections (a model's
# own linears come from the model: ModelShape.linear_dims, ``resolve_targets``)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

FP32 = 4
MASTER_WEIGHT_BYTES = 4  # fp32 copy the optimizer updates when the working weights are 16-bit
ADAPTER_BYTES = 4  # peft keeps adapter weights in fp32 even on a 16-bit base (autocast_adapter_dtype)
# Per trainable parameter. AdamW: exp_avg + exp_avg_sq in fp32. 8-bit AdamW (bitsandbytes): two uint8
# states plus one fp32 absmax per 256-value block each. SGD: one fp32 momentum buffer (0 without momentum).
OPTIMIZER_STATE_BYTES = {"adamw": 8.0, "adamw_8bit": 2.0 + 2 * 4 / 256, "sgd": 4.0}
# torch's foreach AdamW allocates sqrt(exp_avg_sq) for all parameters at once inside step(): one fp32
# copy of one state. The bitsandbytes kernel and momentum SGD update in place.
OPTIMIZER_STEP_TEMP_BYTES = {"adamw": 4.0, "adamw_8bit": 0.0, "sgd": 0.0}
# QLoRA NF4 with double quantization (the QLoRA paper's setting): 4 bits per weight, one 8-bit absmax
# per 64-weight block, and one fp32 constant per 256 blocks. Only the decoder linears are quantized;
# embeddings, lm_head and norms are not quantized (transformers skips the output embedding), and peft's
# prepare_model_for_kbit_training upcasts them to fp32.
QLORA_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
# The loss: log-softmax output, its incoming gradient and the gradient of the logits are three fp32
# (tokens x vocab) tensors alive together at the start of backward (measured on CPU: bench/RESULTS.md).
LOGITS_FP32_COPIES = 3
# FSDP/ZeRO-3 hold one decoder layer gathered while it runs and prefetch the next; the root unit (embeddings,
# lm_head, final norm: accelerate wraps the root under FSDP1 and FSDP2 alike) stays gathered throughout.
GATHERED_LAYERS = 2
# Overhead outside tensors: CUDA context with cuBLAS workspaces (~0.5 GiB on Hopper with lazy module
# loading), NCCL communicator buffers when there is more than one rank, and the caching allocator's
# fragmentation (reserved minus allocated), typically 5-15% of the tensors: 10% assumed.
CUDA_CONTEXT_BYTES = 0.5 * GiB
NCCL_BYTES = 0.5 * GiB
FRAGMENTATION = 0.10


@dataclass(frozen=True)
class Setup:
    """The training settings that decide memory. Invalid combinations raise at construction."""

    method: str = "lora"  # full | lora | qlora
    precision: str = "bf16"  # bf16 | fp16 | fp32: weights and activations (full 16-bit keeps fp32 masters)
    optimizer: str = "adamw"  # adamw | adamw_8bit | sgd (with momentum)
    micro_batch_size: int = 1  # rows per device per forward/backward
    seq_len: int = 2048  # tokens per row
    grad_accum: int = 1  # micro-batches per optimizer step; memory does not depend on it
    gradient_checkpointing: bool = False  # keep only layer inputs; recompute in backward (~+33% compute)
    num_gpus: int = 1  # data-parallel ranks
    sharding: str = "none"  # none (DDP) | zero2 | fsdp | zero3
    lora_r: int = 16  # adapter rank: higher adapts more, costs memory
    # linears of each layer that get an adapter: the model's names, Llama's portable ones, or "all-linear"
    lora_targets: tuple[str, ...] = LINEARS
    attention: str = "sdpa"  # sdpa | eager (materializes the a*s*s matrix) | varlen | flash_attention_2 (per example)
    packed: bool = True  # rows hold several examples (fineflow's shards): sdpa keeps an attention mask per layer
    weight_storage: str = "compute"  # compute | fp32: the dtype weights are held in (see the module docstring)
    loss_chunk_tokens: int = 0  # train.loss_chunk_tokens: the loss projects this many tokens at a time (0: all)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        problems = [
            f"{name} must be one of {', '.join(choices)} (got {value!r})"
            for name, value, choices in (
                ("method", self.method, METHODS),
                ("precision", self.precision, tuple(PRECISIONS)),
                ("optimizer", self.optimizer, OPTIMIZERS),
                ("sharding", self.sharding, SHARDINGS),
                ("attention", self.attention, ATTENTIONS),
                ("weight_storage", self.weight_storage, WEIGHT_STORAGES),
            )
            if value not in choices
        ]
        problems += [
            f"{name} must be >= 1 (got {value!r})"
            for name, value in (
                ("micro_batch_size", self.micro_batch_size),
                ("seq_len", self.seq_len),
                ("grad_accum", self.grad_accum),
                ("num_gpus", self.num_gpus),
                ("lora_r", self.lora_r),
            )
            if not isinstance(value, int) or value < 1
        ]
        if not isinstance(self.loss_chunk_tokens, int) or self.loss_chunk_tokens < 0:
            problems.append(f"loss_chunk_tokens must be >= 0 (got {self.loss_chunk_tokens!r})")
        if self.method != "full" and not self.lora_targets:  # which names a model has is checked against it
            problems.append(f"lora_targets must name at least one linear, or {ALL_LINEAR} (got [])")
        if problems:
            raise FineflowError("invalid memory-plan settings: " + "; ".join(problems))

    @property
    def global_batch(self) -> int:
        """Rows per optimizer step over all ranks (auto_fit keeps it constant)."""
        return self.micro_batch_size * self.grad_accum * self.num_gpus


def resolve_targets(shape: ModelShape, targets: tuple[str, ...]) -> tuple[str, ...]:
    """The linears of shape that get an adapter, as peft adapts them (fineflow.train.architecture.lora_targets):
    ``all-linear`` is every linear of the layer; a Llama name stands for the fused linear that holds it (Phi-3's
    q_proj is its qkv_proj). A name the model has no linear for is refused, naming the model's own."""
    dims = shape.linear_dims()
    if ALL_LINEAR in targets:
        return tuple(dims)
    resolved: list[str] = []
    for name in targets:
        found = name if name in dims else next((f for f in STANDS_FOR.get(name, ()) if f in dims), None)
        if found is None:
            raise FineflowError(
                f"lora target {name!r}: the decoder layers of {shape.name} have no such linear: theirs are "
                f"{', '.join(dims)} (or use {ALL_LINEAR!r})"
            )
        resolved += [found] if found not in resolved else []
    return tuple(resolved)


def lora_params(shape: ModelShape, r: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters: A (r x d_in) and B (d_out x r) for each targeted linear of every layer."""
    dims = shape.linear_dims()
    return shape.num_layers * sum(r * (dims[t][0] + dims[t][1]) for t in resolve_targets(shape, targets))


def trainable_params(shape: ModelShape, setup: Setup) -> int:
    """Parameters that get gradients and optimizer states."""
    if setup.method == "full":
        return shape.params
    return lora_params(shape, setup.lora_r, setup.lora_targets)


def _sharded(setup: Setup, *kinds: str) -> int:
    """How many ways a quantity is divided: num_gpus when the sharding covers it, else 1."""
    covers = {
        "none": (),
        "zero2": ("gradients", "optimizer"),
        "fsdp": ("weights", "gradients", "optimizer"),
        "zero3": ("weights", "gradients", "optimizer"),
    }
    return setup.num_gpus if any(k in covers[setup.sharding] for k in kinds) else 1


def stored_width(setup: Setup) -> int:
    """Bytes per element of the held (unquantized) weights: the compute precision's, or fp32."""
    return FP32 if setup.weight_storage == "fp32" else PRECISIONS[setup.precision]


def _base_weight_bytes_per_layer(shape: ModelShape, setup: Setup, width: float | None = None) -> float:
    """One decoder layer's stored weights (the frozen base for LoRA, the working copy for full); width:
    bytes per element of the linears and norms (default: as held; QLoRA: NF4 linears, fp32 norms)."""
    if setup.method == "qlora":
        return shape.linear_params_per_layer * QLORA_BYTES_PER_PARAM + 2 * shape.hidden_size * FP32
    width = stored_width(setup) if width is None else width
    return (shape.linear_params_per_layer + 2 * shape.hidden_size) * width


def _root_weight_bytes(shape: ModelShape, setup: Setup, width: float | None = None) -> float:
    """Embeddings, lm_head and the final norm (QLoRA: upcast to fp32 by peft's kbit preparation)."""
    if width is None:
        width = FP32 if setup.method == "qlora" else stored_width(setup)
    return (shape.embedding_params + shape.hidden_size) * width


def weight_bytes(shape: ModelShape, setup: Setup) -> float:
    """Model weights per device: base (or working copy) plus adapters, sharded, plus gathered layers."""
    root = _root_weight_bytes(shape, setup)
    layers = shape.num_layers * _base_weight_bytes_per_layer(shape, setup)
    adapters = 0 if setup.method == "full" else trainable_params(shape, setup) * ADAPTER_BYTES
    ways = _sharded(setup, "weights")
    total = (root + layers + adapters) / ways
    if ways > 1:
        # what FSDP/ZeRO-3 gathers: the running and the prefetched layer, and the root unit, in the
        # compute dtype (FSDP's mixed-precision policy gathers 16-bit copies of fp32 shards)
        width = None if setup.method == "qlora" else PRECISIONS[setup.precision]
        total += GATHERED_LAYERS * _base_weight_bytes_per_layer(shape, setup, width) + _root_weight_bytes(
            shape, setup, width
        )
    if setup.method == "qlora":  # bitsandbytes dequantizes one linear at a time into the compute dtype
        total += shape.max_linear_params * PRECISIONS[setup.precision]
    return total


def autocast_copy_bytes(shape: ModelShape, setup: Setup) -> float:
    """16-bit copies of fp32 weights that autocast makes and autograd keeps for backward, per device.

    A linear under autocast casts its fp32 weight to 16 bits and autograd keeps that copy to compute the
    input's gradient, until the layer's backward. Full fine-tuning (trainable leaves): autocast also caches
    the copies until forward ends, so every linear's copy is counted, with or without checkpointing
    (conservative: with checkpointing the cache is gone before backward). A frozen base: without
    checkpointing every layer's copies but the first layer's q/k/v (their input, from the frozen
    embeddings, needs no gradient) plus lm_head's, all alive when backward starts; with checkpointing
    lm_head's copy, freed by its backward, then one recomputed layer's at a time: the larger of the two.
    (Measured with saved-tensor hooks on CPU: exact for these cases.) QLoRA: the fp32 lm_head's copy (the
    decoder linears are 4-bit: see the dequantization buffer). Embedding lookups and RMSNorm weights are
    not cast. Zero in fp32, for weights held in the compute dtype, and under FSDP/ZeRO-3 (their gathered
    16-bit layers are counted with the weights)."""
    p = PRECISIONS[setup.precision]
    if p == FP32 or _sharded(setup, "weights") > 1:
        return 0.0
    lm_head = shape.vocab_size * shape.hidden_size * p
    if setup.method == "qlora":
        return lm_head
    if setup.weight_storage != "fp32":
        return 0.0
    layer = shape.linear_params_per_layer * p
    if setup.method == "full":
        return shape.num_layers * layer + lm_head
    if setup.gradient_checkpointing:
        return max(layer, lm_head)
    dims = shape.linear_dims().items()
    first_qkv = sum(d_in * d_out for name, (d_in, d_out) in dims if _input_read_by(name) == "attention input") * p
    return shape.num_layers * layer - first_qkv + lm_head


def gradient_bytes(shape: ModelShape, setup: Setup) -> float:
    """Gradients per device, in the dtype of what trains (the working weights, fp32 adapters)."""
    width = stored_width(setup) if setup.method == "full" else ADAPTER_BYTES
    total = trainable_params(shape, setup) * width
    if setup.sharding == "none" and setup.num_gpus > 1:
        # DDP copies gradients into its all-reduce buckets (gradient_as_bucket_view is off by default)
        total *= 2
    return total / _sharded(setup, "gradients")


def optimizer_bytes(shape: ModelShape, setup: Setup) -> float:
    """Optimizer states per device, plus fp32 master weights when full fine-tuning works in 16 bits."""
    trainable = trainable_params(shape, setup)
    total = trainable * OPTIMIZER_STATE_BYTES[setup.optimizer]
    if setup.method == "full" and stored_width(setup) < MASTER_WEIGHT_BYTES:
        total += trainable * MASTER_WEIGHT_BYTES
    return total / _sharded(setup, "optimizer")


def optimizer_step_bytes(shape: ModelShape, setup: Setup) -> float:
    """Temporaries allocated inside optimizer.step() (after activations are freed)."""
    return trainable_params(shape, setup) * OPTIMIZER_STEP_TEMP_BYTES[setup.optimizer] / _sharded(setup, "optimizer")


def _linear_input_bytes_per_token(shape: ModelShape, setup: Setup) -> float:
    """Inputs that linears keep to compute their weight (or adapter) gradients, per token.

    A frozen linear keeps nothing (its input gradient needs only the weight). Linears reading the same
    tensor share it (q/k/v read the attention norm's output, gate/up the MLP norm's). But on a 16-bit
    base peft casts the input to each adapter's fp32 dtype and autocast casts it back to 16 bits for the
    matmul, so every adapted linear keeps its own 16-bit copy (assumed: mixed precision runs under
    autocast, as accelerate does; without autocast each would keep the fp32 copy, twice as much)."""
    width = PRECISIONS[setup.precision]
    dims = shape.linear_dims()
    trains = set(dims) if setup.method == "full" else set(resolve_targets(shape, setup.lora_targets))
    if setup.method != "full" and width != ADAPTER_BYTES:
        return sum(width * dims[name][0] for name in trains)
    # one kept input per tensor read: q/k/v (or a fused qkv) read the attention norm's output, gate/up the MLP's
    inputs = {_input_read_by(name) for name in trains}
    return sum(width * dims[next(n for n in trains if _input_read_by(n) == read)][0] for read in inputs)


def _input_read_by(name: str) -> str:
    """Which tensor a linear reads: the attention norm's output, the MLP norm's, or its own input."""
    if name in ("q_proj", "k_proj", "v_proj", *FUSED_QKV):
        return "attention input"
    return "mlp input" if name in ("gate_proj", "up_proj", *FUSED_GATE_UP) else name


def layer_activation_bytes(shape: ModelShape, setup: Setup) -> float:
    """Bytes one decoder layer keeps for backward, for one micro-batch, without checkpointing.

    Tensor by tensor, per token (h hidden, q/kv attention widths, i intermediate, p bytes per element):
    - each RMSNorm upcasts its input to fp32 and keeps it (4h); the normalized tensor before the weight
      multiply (p*h) is kept only when the norm weight trains (full fine-tuning);
    - linear inputs, see ``_linear_input_bytes_per_token``;
    - attention: rotated q, k and v, and for SDPA its output and an fp32 logsumexp per head. Grouped-query
      k/v are expanded to all heads (repeat_kv) when an attention mask is passed or attention is eager,
      else SDPA takes them as they are (enable_gqa). Eager attention keeps the fp32 softmax (4*a*s per
      token) and its cast to the compute dtype when that is 16-bit (Korthikanti's 5*a*s at 16 bits counts
      2+2 bytes and a 1-byte dropout mask; transformers' softmax runs in fp32 and p=0 has no mask);
    - packed rows under sdpa: transformers passes a block-diagonal boolean mask and SDPA keeps it converted
      to the compute dtype in every layer: b*s*s*p bytes per layer (measured on CPU, bench/RESULTS.md);
    - per-example attention (varlen, flash_attention_2): no mask and k/v as they are (varlen gathers each
      length group's q/k/v, padded to the group's longest example, and calls SDPA with enable_gqa; flash-attn
      takes GQA natively): q, k, v, the output and the logsumexp, as unmasked SDPA (the group padding, a few
      percent of the tokens, is not counted);
    - SwiGLU MLP: SiLU keeps its input, the product keeps both factors (3*p*i).
    """
    p = PRECISIONS[setup.precision]
    h, i, a, s = shape.hidden_size, shape.intermediate_size, shape.num_heads, setup.seq_len
    row_mask = setup.packed and setup.attention == "sdpa"  # per-example kinds pass no mask
    masked = row_mask or setup.attention == "eager"
    kv_kept = shape.q_dim if masked and shape.num_kv_heads < shape.num_heads else shape.kv_dim
    norms = 2 * (FP32 * h + (p * h if setup.method == "full" else 0))
    if setup.attention != "eager":
        attention = p * (2 * shape.q_dim + 2 * kv_kept) + FP32 * a + (p * s if row_mask else 0)
    else:
        attention = p * (shape.q_dim + 2 * kv_kept) + a * s * (FP32 + (p if p != FP32 else 0))
    per_token = norms + _linear_input_bytes_per_token(shape, setup) + attention + 3 * p * i
    return setup.micro_batch_size * s * per_token


def logits_bytes(shape: ModelShape, setup: Setup) -> float:
    """The loss over the vocabulary: LOGITS_FP32_COPIES fp32 (rows x vocab) tensors at its peak, rows = every
    token, or one chunk of them under the chunked loss (fineflow.objectives.token_loss). Chunked, the loss also holds
    the
    hidden states' gradient from forward to backward, and full fine-tuning an fp32 gradient of the head."""
    tokens = setup.micro_batch_size * setup.seq_len
    chunk = setup.loss_chunk_tokens
    if not 0 < chunk < tokens or not shape.chunked_loss:  # the plain path (a soft-capped head takes it too)
        return tokens * shape.vocab_size * FP32 * LOGITS_FP32_COPIES
    hidden_grad = tokens * shape.hidden_size * PRECISIONS[setup.precision]
    head_grad = shape.vocab_size * shape.hidden_size * FP32 if setup.method == "full" else 0
    return chunk * shape.vocab_size * FP32 * LOGITS_FP32_COPIES + hidden_grad + head_grad


def backward_working_bytes(shape: ModelShape, setup: Setup) -> float:
    """Gradients alive while one layer is back-propagated: the incoming gradient of the hidden state and
    two intermediate-sized gradients of the MLP (of the product's two factors)."""
    p = PRECISIONS[setup.precision]
    return setup.micro_batch_size * setup.seq_len * p * (shape.hidden_size + 2 * shape.intermediate_size)


def activation_bytes(shape: ModelShape, setup: Setup) -> float:
    """Peak activation memory per device during forward+backward, logits included.

    Without checkpointing every layer's tensors are kept; with it only each layer's input (p*h per
    token), and during backward one layer at a time is recomputed. On top of what is kept, the peak is
    either the loss's (back-propagated first) or, later, one layer's backward: its gradient buffers, plus
    its recomputed tensors under checkpointing. The two do not coincide, so the larger one counts. The
    16-bit copies of fp32 weights kept for backward (``autocast_copy_bytes``) are added."""
    p = PRECISIONS[setup.precision]
    tokens = setup.micro_batch_size * setup.seq_len
    layer = layer_activation_bytes(shape, setup)
    full = setup.method == "full"
    # final norm (fp32 input copy, normalized tensor when it trains) and lm_head's input when it trains
    head = tokens * (FP32 * shape.hidden_size + (2 * p * shape.hidden_size if full else 0))
    working = backward_working_bytes(shape, setup)
    if setup.gradient_checkpointing:
        kept, working = shape.num_layers * tokens * p * shape.hidden_size, layer + working
    else:
        kept = shape.num_layers * layer
    return kept + head + max(logits_bytes(shape, setup), working) + autocast_copy_bytes(shape, setup)


@dataclass(frozen=True)
class MemoryPlan:
    """Predicted peak memory per device, in bytes, by component."""

    model: str
    params: int
    trainable_params: int
    setup: Setup
    weights: float
    gradients: float
    optimizer_states: float
    activations: float  # logits included
    logits: float  # the part of activations that the loss over the vocabulary takes
    optimizer_step: float  # temporaries inside optimizer.step(); never alive together with activations
    overhead: float

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.gradients
            + self.optimizer_states
            + max(self.activations, self.optimizer_step)
            + self.overhead
        )

    def fits(self, device_bytes: float) -> bool:
        """True when the predicted peak fits in a device of device_bytes."""
        return self.total <= device_bytes

    def as_dict(self) -> dict:
        """JSON-ready: settings, counts and each component in bytes and GiB."""
        parts = (
            "weights",
            "gradients",
            "optimizer_states",
            "activations",
            "logits",
            "optimizer_step",
            "overhead",
            "total",
        )
        return {
            "model": self.model,
            "params": self.params,
            "trainable_params": self.trainable_params,
            "setup": {**asdict(self.setup), "lora_targets": list(self.setup.lora_targets)},
            "bytes": {k: round(getattr(self, k)) for k in parts},
            "gib": {k: round(getattr(self, k) / GiB, 3) for k in parts},
        }


def overhead_bytes(tensor_bytes: float, setup: Setup) -> float:
    """CUDA context, NCCL buffers when distributed, and allocator fragmentation over the tensors."""
    fixed = CUDA_CONTEXT_BYTES + (NCCL_BYTES if setup.num_gpus > 1 else 0)
    return fixed + FRAGMENTATION * tensor_bytes


def plan(shape: ModelShape, setup: Setup) -> MemoryPlan:
    """Predict the peak memory per device of training shape with setup."""
    weights, grads = weight_bytes(shape, setup), gradient_bytes(shape, setup)
    states, step = optimizer_bytes(shape, setup), optimizer_step_bytes(shape, setup)
    activations = activation_bytes(shape, setup)
    tensors = weights + grads + states + max(activations, step)
    return MemoryPlan(
        model=shape.name,
        params=shape.params,
        trainable_params=trainable_params(shape, setup),
        setup=setup,
        weights=weights,
        gradients=grads,
        optimizer_states=states,
        activations=activations,
        logits=logits_bytes(shape, setup),
        optimizer_step=step,
        overhead=overhead_bytes(tensors, setup),
    )
