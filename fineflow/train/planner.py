"""GPU memory planner: peak memory per device of a fine-tuning run, predicted before it is launched.

    fineflow plan --model 7B --method lora --precision bf16 --micro-batch 4 --seq-len 2048
    fineflow plan --table --device-gib 80

Pure arithmetic on the model's shape (no torch import, nothing happens at import). ``plan()`` breaks the
peak into weights, gradients, optimizer states, activations and overhead; ``auto_fit()`` adapts a run
that does not fit (gradient checkpointing first, then smaller micro-batches with more accumulation) and
``refusal()`` says what to change when it cannot.

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
  and token is kept, but packed rows bring a b*s*s attention mask per layer. Gradient checkpointing keeps
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
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from fineflow.core.errors import FineflowError

GiB = 1024**3

METHODS = ("full", "lora", "qlora")
PRECISIONS = {"bf16": 2, "fp16": 2, "fp32": 4}  # bytes per element of weights and activations
OPTIMIZERS = ("adamw", "adamw_8bit", "sgd")
ATTENTIONS = ("sdpa", "eager")  # sdpa: flash / memory-efficient kernels (no s^2 term); eager: the matrix
# none: DDP, every rank holds everything. zero2: gradients and optimizer states sharded over the ranks.
# fsdp / zero3: weights, gradients and optimizer states sharded; layers are gathered as they run.
SHARDINGS = ("none", "zero2", "fsdp", "zero3")
# compute: weights held in the compute precision; fp32: fp32 weights cast by autocast as layers run
WEIGHT_STORAGES = ("compute", "fp32")
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

# Where each setting lives in params.yaml, for messages that say what to change.
PARAM_KEYS = {
    "micro_batch_size": "train.micro_batch_size",
    "grad_accum": "train.grad_accum",
    "gradient_checkpointing": "train.gradient_checkpointing",
    "method": "train.method",
    "sharding": "train.sharding",
    "seq_len": "tokenize.seq_len",
}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-architecture decoder (RMSNorm, rotary attention, SwiGLU MLP)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads: grouped-query attention
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None  # None: hidden_size // num_heads
    attention_bias: bool = False
    mlp_bias: bool = False

    @property
    def q_dim(self) -> int:
        return self.num_heads * (self.head_dim or self.hidden_size // self.num_heads)

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * (self.head_dim or self.hidden_size // self.num_heads)

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
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
        """Weights (and biases) of one layer's linears: what QLoRA quantizes (biases aside, ignored)."""
        total = sum(d_in * d_out for d_in, d_out in self.linear_dims().values())
        if self.attention_bias:
            total += self.q_dim + 2 * self.kv_dim + self.hidden_size
        if self.mlp_bias:
            total += 2 * self.intermediate_size + self.hidden_size
        return total

    @property
    def embedding_params(self) -> int:
        """Input embeddings plus lm_head when it is a separate matrix."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def params(self) -> int:
        """Total parameter count (matches ``sum(p.numel() for p in model.parameters())``)."""
        per_layer = self.linear_params_per_layer + 2 * self.hidden_size  # two RMSNorm weights
        return self.embedding_params + self.num_layers * per_layer + self.hidden_size  # final norm

    @property
    def max_linear_params(self) -> int:
        return max(d_in * d_out for d_in, d_out in self.linear_dims().values())


# The real shapes behind the common sizes, from each model's config.json on the Hugging Face hub.
KNOWN_SHAPES = {
    "1B": ModelShape("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 128256, tie_word_embeddings=True),
    "7B": ModelShape("Llama-2-7B", 4096, 11008, 32, 32, 32, 32000),
    "8B": ModelShape("Llama-3-8B", 4096, 14336, 32, 32, 8, 128256),
    "13B": ModelShape("Llama-2-13B", 5120, 13824, 40, 40, 40, 32000),
    "70B": ModelShape("Llama-3-70B", 8192, 28672, 80, 64, 8, 128256),
}


def shape_from_config(config: dict, name: str = "") -> ModelShape:
    """A ModelShape from a transformers config (the dict of a ``config.json``).

    Multimodal configs are read through their ``text_config``. Absent keys take the Llama defaults
    (``num_key_value_heads`` = heads, untied embeddings, no biases)."""
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    label = name or str(config.get("_name_or_path") or config.get("model_type") or "config")
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [key for key in required if config.get(key) is None]
    if missing:
        raise FineflowError(
            f"{label}: not a Llama-like decoder config (missing {', '.join(missing)}); the "
            "planner covers Llama-architecture models (RMSNorm, rotary attention, SwiGLU MLP)"
        )
    if (config.get("num_local_experts") or config.get("num_experts") or 0) > 1:
        raise FineflowError(f"{label}: mixture-of-experts models are not covered by the planner")
    heads = int(config["num_attention_heads"])
    return ModelShape(
        name=label,
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        vocab_size=int(config["vocab_size"]),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
        attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
    )


def shape_from_file(path: str | Path) -> ModelShape:
    """A ModelShape from a ``config.json`` file, or from a model directory holding one."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FineflowError(f"{path}: no config.json there (is it a Hugging Face model directory?)")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FineflowError(f"{file}: cannot read the model config ({exc})") from None
    if not isinstance(config, dict):
        raise FineflowError(f"{file}: a model config must be a JSON object")
    return shape_from_config(config, name=str(path))


def parse_param_count(text: str) -> float | None:
    """'7B' -> 7e9, '1500M' -> 1.5e9, '6.7e9' -> 6.7e9; None when text is not a count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMbBtT]?)\s*", text)
    if match:
        scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
        return float(match.group(1)) * scale
    try:
        return float(text)
    except ValueError:
        return None


def shape_for_params(count: float) -> ModelShape:
    """The known shape nearest to a parameter count, within 30%; a count elsewhere needs a config."""
    nearest = min(KNOWN_SHAPES.values(), key=lambda s: abs(math.log(s.params / count)))
    if abs(math.log(nearest.params / count)) > math.log(1.3):
        raise FineflowError(
            f"no standard shape near {count / 1e9:.2f}B parameters (known: "
            f"{', '.join(KNOWN_SHAPES)}); pass the model's config.json or directory instead"
        )
    return nearest


def load_shape(reference: str) -> ModelShape:
    """Resolve what a user typed: a known size ('7B'), a parameter count, a config.json or a model dir."""
    known = {key.lower(): shape for key, shape in KNOWN_SHAPES.items()}
    if reference.strip().lower() in known:
        return known[reference.strip().lower()]
    if Path(reference).exists():
        return shape_from_file(reference)
    count = parse_param_count(reference)
    if count is None or count <= 0:
        raise FineflowError(
            f"--model {reference!r} is neither a known size ({', '.join(KNOWN_SHAPES)}), a "
            "parameter count, a config.json nor a model directory"
        )
    return shape_for_params(count)


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
    lora_targets: tuple[str, ...] = LINEARS  # linears of each layer that get an adapter
    attention: str = "sdpa"  # sdpa (flash / memory-efficient) | eager (materializes the a*s*s matrix)
    packed: bool = True  # rows hold several examples (fineflow's shards): an attention mask per layer
    weight_storage: str = "compute"  # compute | fp32: the dtype weights are held in (see the module docstring)

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
        unknown = [t for t in self.lora_targets if t not in LINEARS]
        if unknown or (self.method != "full" and not self.lora_targets):
            problems.append(f"lora_targets must be among {', '.join(LINEARS)} (got {list(self.lora_targets)})")
        if problems:
            raise FineflowError("invalid memory-plan settings: " + "; ".join(problems))

    @property
    def global_batch(self) -> int:
        """Rows per optimizer step over all ranks (auto_fit keeps it constant)."""
        return self.micro_batch_size * self.grad_accum * self.num_gpus


def lora_params(shape: ModelShape, r: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters: A (r x d_in) and B (d_out x r) for each targeted linear of every layer."""
    dims = shape.linear_dims()
    return shape.num_layers * sum(r * (dims[t][0] + dims[t][1]) for t in set(targets))


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
    first_qkv = sum(d_in * d_out for name, (d_in, d_out) in shape.linear_dims().items() if name[0] in "qkv") * p
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
    trains = set(LINEARS) if setup.method == "full" else set(setup.lora_targets)
    if setup.method != "full" and width != ADAPTER_BYTES:
        return sum(width * dims[name][0] for name in trains)
    groups = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
    return sum(width * dims[group[0]][0] for group in groups if trains.intersection(group))


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
    - packed rows: transformers passes a block-diagonal boolean mask and SDPA keeps it converted to the
      compute dtype in every layer: b*s*s*p bytes per layer (measured on CPU, bench/RESULTS.md);
    - SwiGLU MLP: SiLU keeps its input, the product keeps both factors (3*p*i).
    """
    p = PRECISIONS[setup.precision]
    h, i, a, s = shape.hidden_size, shape.intermediate_size, shape.num_heads, setup.seq_len
    masked = setup.packed or setup.attention == "eager"
    kv_kept = shape.q_dim if masked and shape.num_kv_heads < shape.num_heads else shape.kv_dim
    norms = 2 * (FP32 * h + (p * h if setup.method == "full" else 0))
    if setup.attention == "sdpa":
        attention = p * (2 * shape.q_dim + 2 * kv_kept) + FP32 * a + (p * s if setup.packed else 0)
    else:
        attention = p * (shape.q_dim + 2 * kv_kept) + a * s * (FP32 + (p if p != FP32 else 0))
    per_token = norms + _linear_input_bytes_per_token(shape, setup) + attention + 3 * p * i
    return setup.micro_batch_size * s * per_token


def logits_bytes(shape: ModelShape, setup: Setup) -> float:
    """The loss over the vocabulary: LOGITS_FP32_COPIES fp32 (tokens x vocab) tensors at its peak."""
    return setup.micro_batch_size * setup.seq_len * shape.vocab_size * FP32 * LOGITS_FP32_COPIES


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


class DoesNotFit(FineflowError):
    """The plan exceeds the device; the message says what to change."""


@dataclass(frozen=True)
class FitVerdict:
    """The settings to run with, their plan, and each change made to get there (empty: unchanged)."""

    setup: Setup
    plan: MemoryPlan
    changes: list[str] = field(default_factory=list)


def _smaller_micro_batch(micro: int) -> int | None:
    """The next micro-batch down: the largest divisor <= micro/2 (a halving for powers of two), so that
    micro * grad_accum stays exactly the same global batch. None at 1."""
    return next((d for d in range(micro // 2, 0, -1) if micro % d == 0), None)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def auto_fit(shape: ModelShape, setup: Setup, device_bytes: float) -> FitVerdict:
    """Adapt setup until its plan fits device_bytes, changing as little as possible, in this order:
    1. enable gradient checkpointing; 2. lower the micro-batch step by step (halving, down to 1),
    raising grad_accum so that the global batch is unchanged. Raises DoesNotFit when even that fails."""
    current, changes = setup, []
    result = plan(shape, current)
    if result.fits(device_bytes):
        return FitVerdict(current, result, changes)
    if not current.gradient_checkpointing:
        current = replace(current, gradient_checkpointing=True)
        before, result = result, plan(shape, current)
        changes.append(
            f"{PARAM_KEYS['gradient_checkpointing']}: false -> true (activations "
            f"{_gib(before.activations)} -> {_gib(result.activations)})"
        )
    while not result.fits(device_bytes):
        smaller = _smaller_micro_batch(current.micro_batch_size)
        if smaller is None:  # checkpointing on, micro-batch 1: what is left is for the user to choose
            raise DoesNotFit(
                refusal(
                    shape, current, device_bytes, note="even with gradient checkpointing and micro-batch 1 (auto_fit)"
                )
            )
        accum = current.grad_accum * current.micro_batch_size // smaller
        changes.append(
            f"{PARAM_KEYS['micro_batch_size']}: {current.micro_batch_size} -> {smaller}, "
            f"{PARAM_KEYS['grad_accum']}: {current.grad_accum} -> {accum} (global batch unchanged)"
        )
        current = replace(current, micro_batch_size=smaller, grad_accum=accum)
        result = plan(shape, current)
    return FitVerdict(current, result, changes)


def check_fit(shape: ModelShape, setup: Setup, device_bytes: float, adapt: bool) -> FitVerdict:
    """What the train stage calls before launching: adapt (``train.auto_fit: true``) or refuse."""
    if adapt:
        return auto_fit(shape, setup, device_bytes)
    result = plan(shape, setup)
    if not result.fits(device_bytes):
        raise DoesNotFit(refusal(shape, setup, device_bytes))
    return FitVerdict(setup, result)


def _largest_fitting(values: list[int], make, shape: ModelShape, device_bytes: float) -> int | None:
    """The largest value v (values ascending) for which plan(shape, make(v)) fits, or None."""
    fitting = [v for v in values if plan(shape, make(v)).fits(device_bytes)]
    return fitting[-1] if fitting else None


def _what_else(candidate: Setup, shape: ModelShape, device_bytes: float) -> str | None:
    """'' when candidate fits as is; else what it also needs (checkpointing, a smaller micro-batch);
    None when nothing within those fits."""
    if plan(shape, candidate).fits(device_bytes):
        return ""
    checkpointed = replace(candidate, gradient_checkpointing=True)
    if not candidate.gradient_checkpointing and plan(shape, checkpointed).fits(device_bytes):
        return f" with {PARAM_KEYS['gradient_checkpointing']}: true"
    micro = _largest_fitting(
        list(range(1, candidate.micro_batch_size)),
        lambda m: replace(checkpointed, micro_batch_size=m),
        shape,
        device_bytes,
    )
    if micro is None:
        return None
    return (
        f" with {PARAM_KEYS['gradient_checkpointing']}: true and {PARAM_KEYS['micro_batch_size']} <= {micro}"
        if not candidate.gradient_checkpointing
        else f" with {PARAM_KEYS['micro_batch_size']} <= {micro}"
    )


def suggestions(shape: ModelShape, setup: Setup, device_bytes: float) -> list[str]:
    """Changes to setup that would make it fit, most local first: a smaller micro-batch, gradient
    checkpointing, a cheaper method, sharding, and as a last resort shorter rows."""
    key, options = PARAM_KEYS, []
    micro = _largest_fitting(
        list(range(1, setup.micro_batch_size)), lambda m: replace(setup, micro_batch_size=m), shape, device_bytes
    )
    if micro is not None:
        options.append(
            f"set {key['micro_batch_size']} <= {micro} (and raise {key['grad_accum']} to keep the global batch)"
        )
    if not setup.gradient_checkpointing:
        extra = _what_else(replace(setup, gradient_checkpointing=True), shape, device_bytes)
        if extra is not None:
            options.append(f"set {key['gradient_checkpointing']}: true{extra}")
    for method in METHODS[METHODS.index(setup.method) + 1 :]:  # full -> lora -> qlora: less memory each
        extra = _what_else(replace(setup, method=method), shape, device_bytes)
        if extra is not None:
            options.append(f"set {key['method']}: {method}{extra}")
            break
    if setup.num_gpus > 1 and setup.sharding in ("none", "zero2"):
        extra = _what_else(replace(setup, sharding="fsdp"), shape, device_bytes)
        if extra is not None:
            options.append(f"set {key['sharding']}: fsdp{extra}")
    if not options:
        lengths = [2**k for k in range(7, setup.seq_len.bit_length()) if 2**k < setup.seq_len]
        minimal = replace(setup, gradient_checkpointing=True, micro_batch_size=1)
        length = _largest_fitting(lengths, lambda n: replace(minimal, seq_len=n), shape, device_bytes)
        if length is not None:
            options.append(
                f"lower {key['seq_len']} to <= {length} (with gradient checkpointing and {key['micro_batch_size']}: 1)"
            )
    return options


def refusal(shape: ModelShape, setup: Setup, device_bytes: float, note: str = "") -> str:
    """The message for a run that does not fit: what it needs, what the device has, what to change."""
    needed = plan(shape, setup).total
    message = (
        f"{shape.name} ({setup.method}) needs {_gib(needed)} per device{' ' + note if note else ''}, "
        f"device has {_gib(device_bytes)}"
    )
    return f"{message}: {what_to_change(shape, setup, device_bytes)}"


def what_to_change(shape: ModelShape, setup: Setup, device_bytes: float) -> str:
    """The suggestions joined into one sentence, or what is left when no setting change is enough."""
    options = suggestions(shape, setup, device_bytes)
    if options:
        return " or ".join(options)
    return "no single setting change fits; use a device with more memory or more GPUs with fsdp sharding"
