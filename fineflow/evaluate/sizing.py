"""Evaluation sized and placed before any model loads: the dtype, the memory per device, and the device map.

The evaluate stage loads the base in the run's compute dtype (``eval_dtype``: the train stage's resolved
precision, ``fineflow.train.precision``; fp32 on a CPU), plans the memory of one lm-eval batch
(``plan_evaluation``, built on the training planner's public terms: ``weight_bytes`` for the base and its
adapter, ``overhead_bytes``) and then either loads it on one device, shards it across the visible devices with
accelerate's ``infer_auto_device_map`` under a ``max_memory`` budget (``device_map_for``; what lm-eval's
``parallelize`` and transformers' ``device_map="auto"`` use too), or refuses with what to change
(``eval_refusal``).

What one batch of log-likelihood requests holds (lm-eval's HFLM pads a batch to its longest request and keeps
``log_softmax`` of the logits): the weights, the KV cache transformers builds during the forward (every layer,
K and V), one layer's working tensors, and the logits twice (the model's output and its log-softmax) over the
whole vocabulary, in the compute dtype. The eval length is ``tokenize.seq_len``: the rows were trained at that
length, and an eval row is one of the same rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from fineflow.errors import FineflowError
from fineflow.train.planner import (
    FRAGMENTATION,
    LINEARS,
    PRECISIONS,
    GiB,
    ModelShape,
    Setup,
    overhead_bytes,
    weight_bytes,
)
from fineflow.train.precision import PLANNER_PRECISION_OF, TORCH_DTYPE_OF

EVAL_LOGITS_COPIES = 2  # the logits, and lm-eval's log_softmax of them (HFLM._loglikelihood_tokens)
QLORA_BASES = ("as_trained", "4bit", "16bit")
MAX_DEVICES = 64  # the most devices a refusal suggests spreading the model over (8 nodes of 8)


def eval_precision(params, has_gpu: bool) -> str:
    """The mixed precision the train stage resolves for these params on this machine (no | bf16 | fp16): the
    dtype the adapter was trained against, hence the one it is scored in. A CPU resolves to "no" (fp32)."""
    from fineflow.train.precision import choose_precision
    from fineflow.train.profile import load_profile

    return choose_precision(
        params.train.precision, load_profile(params.train.accelerate_profile), has_gpu
    ).mixed_precision


def qlora_base(method: str, setting: str, has_gpu: bool) -> str | None:
    """Which base a QLoRA adapter is scored on: "4bit" (NF4, as it was trained) or "16bit" (the unquantized
    base in the compute dtype); None when the run is not QLoRA. bitsandbytes' 4-bit layers need a GPU, so 4bit
    on a CPU is refused with what to set instead."""
    if setting not in QLORA_BASES:
        raise FineflowError(f"params.yaml: evaluate.qlora_base must be one of {QLORA_BASES} (got {setting!r})")
    if method != "qlora":
        return None
    chosen = "4bit" if setting == "as_trained" else setting
    if chosen == "4bit" and not has_gpu:
        raise FineflowError(
            "params.yaml: evaluate.qlora_base "
            f"{setting!r} scores the QLoRA adapter on the 4-bit base it was trained on, which bitsandbytes cannot "
            "load without a CUDA GPU. Evaluate on a GPU machine, or set evaluate.qlora_base: 16bit to score it on "
            "the unquantized base (the report and the model card then say so)"
        )
    return chosen


def base_scored_note(method: str, chosen: str | None, dtype: str) -> str:
    """The words the eval report and the model card use for the base the adapter was scored on."""
    if chosen == "4bit":
        return f"4-bit NF4 base, as QLoRA trained it (compute dtype {dtype})"
    if chosen == "16bit":
        return f"unquantized base in {dtype}, not the 4-bit base QLoRA trained on"
    return f"base in {dtype}" + (" (full fine-tune)" if method == "full" else "")


@dataclass(frozen=True)
class EvalPlan:
    """Bytes per device for scoring one batch; ``devices`` the number it is spread over (1: not sharded)."""

    model: str
    dtype: str
    batch_size: int
    seq_len: int
    weights: float  # the whole model's, before it is split
    kv_cache: float  # the whole batch's, split with the layers
    working: float  # one layer's tensors, on whichever device runs it
    logits: float  # on the device holding lm_head
    overhead: float
    devices: int = 1
    device_bytes: list[float] = field(default_factory=list)

    @property
    def per_device(self) -> float:
        """The fullest device's bytes: its share of weights and cache, plus the working set, logits, overhead."""
        return (self.weights + self.kv_cache) / self.devices + self.working + self.logits + self.overhead

    @property
    def weight_room(self) -> float:
        """What each device can give the weights once the batch's own tensors are set aside (max_memory)."""
        smallest = min(self.device_bytes) if self.device_bytes else 0.0
        return smallest - self.kv_cache / self.devices - self.working - self.logits - self.overhead

    def fits(self) -> bool:
        return bool(self.device_bytes) and self.per_device <= min(self.device_bytes)

    def as_dict(self) -> dict:
        gib = {k: round(v / GiB, 3) for k, v in asdict(self).items() if isinstance(v, float)}
        return {
            **{k: v for k, v in asdict(self).items() if not isinstance(v, (float, list))},
            **{f"{k}_gib": v for k, v in gib.items()},
            "device_gib": [round(b / GiB, 3) for b in self.device_bytes],
            "per_device_gib": round(self.per_device / GiB, 3),
            "fits": self.fits(),
        }


def plan_evaluation(
    shape: ModelShape,
    mixed_precision: str,
    batch_size: int,
    seq_len: int,
    device_bytes: list[float],
    quantized: bool = False,
    lora_r: int = 16,
    devices: int = 1,
    gpu: bool = True,
) -> EvalPlan:
    """The evaluation's memory over `devices` of the visible devices (their sizes: device_bytes); gpu: they are
    GPUs, each with a CUDA context (the planner's overhead_bytes), else the host (its allocator's slack only)."""
    precision = PLANNER_PRECISION_OF[mixed_precision]
    width = PRECISIONS[precision]
    setup = Setup(method="qlora" if quantized else "lora", precision=precision, lora_r=lora_r, lora_targets=LINEARS)
    tokens = batch_size * seq_len
    kv = 2 * shape.num_layers * tokens * shape.kv_dim * width
    working = tokens * (4 * shape.hidden_size + 3 * shape.intermediate_size) * width + batch_size * seq_len**2
    logits = EVAL_LOGITS_COPIES * tokens * shape.vocab_size * width
    weights = weight_bytes(shape, setup)
    tensors = weights / devices + kv / devices + working + logits
    return EvalPlan(
        model=shape.name,
        dtype=TORCH_DTYPE_OF[mixed_precision],
        batch_size=batch_size,
        seq_len=seq_len,
        weights=float(weights),
        kv_cache=float(kv),
        working=float(working),
        logits=float(logits),
        overhead=float(overhead_bytes(tensors, setup) if gpu else FRAGMENTATION * tensors),
        devices=devices,
        device_bytes=[float(b) for b in device_bytes[:devices]],
    )


def choose_placement(shape: ModelShape, mixed_precision: str, batch_size: int, seq_len: int, device_bytes, **kw):
    """The plan to load with: one device when the model and a batch fit it, else the fewest of the visible
    devices that hold it sharded. A FineflowError naming what to change when even all of them cannot."""
    one = plan_evaluation(shape, mixed_precision, batch_size, seq_len, device_bytes, **kw)
    if one.fits():
        return one
    for count in range(2, len(device_bytes) + 1):
        sharded = plan_evaluation(shape, mixed_precision, batch_size, seq_len, device_bytes, devices=count, **kw)
        if sharded.fits():
            return sharded
    raise FineflowError(eval_refusal(shape, mixed_precision, batch_size, seq_len, device_bytes, **kw))


def eval_refusal(shape: ModelShape, mixed_precision: str, batch_size: int, seq_len: int, device_bytes, **kw) -> str:
    """Why the evaluation cannot fit on the visible devices, even sharded, and what to change."""
    count = max(len(device_bytes), 1)
    whole = plan_evaluation(shape, mixed_precision, batch_size, seq_len, device_bytes, devices=count, **kw)
    fitting = [
        b
        for b in (16, 8, 4, 2, 1)
        if b < batch_size
        and plan_evaluation(shape, mixed_precision, b, seq_len, device_bytes, devices=count, **kw).fits()
    ]
    smallest = min(device_bytes) / GiB if device_bytes else 0.0
    options = [f"lower evaluate.batch_size to {fitting[0]}"] if fitting else []
    # more devices of this size help only with what is split across them (weights, KV cache), not the logits
    same_size = [min(device_bytes)] * MAX_DEVICES if device_bytes else []
    enough = [
        n
        for n in range(count + 1, MAX_DEVICES + 1)
        if plan_evaluation(shape, mixed_precision, batch_size, seq_len, same_size, devices=n, **kw).fits()
    ]
    if enough:
        options.append(
            f"use {enough[0]} devices of this size (the weights alone are {whole.weights / GiB:.1f} GiB in "
            f"{whole.dtype})"
        )
    if not kw.get("quantized") and mixed_precision == "no":
        options.append("evaluate on a GPU (a CPU scores in fp32) or set train.precision: bf16")
    return (
        f"evaluation of {shape.name} does not fit: one batch of {batch_size} x {seq_len} tokens needs "
        f"{whole.per_device / GiB:.1f} GiB per device over {count} device(s) of {smallest:.1f} GiB (weights "
        f"{whole.weights / GiB:.1f}, KV cache {whole.kv_cache / GiB:.1f}, logits {whole.logits / GiB:.1f} GiB); "
        + "; or ".join(options)
        + " (evaluate.device_memory_gib overrides the detected size)"
    )


def device_map_for(config, mixed_precision: str, max_memory: dict) -> dict:
    """accelerate's placement of the model of config over max_memory ({device: bytes}), a decoder layer never
    split (the model's _no_split_modules); every module on one of those devices, or a FineflowError."""
    import torch
    from accelerate import infer_auto_device_map, init_empty_weights
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, TORCH_DTYPE_OF[mixed_precision])
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(config, dtype=dtype)
    empty.tie_weights()  # a tied head shares the embedding's place and bytes; untied, accelerate counts it twice
    device_map = infer_auto_device_map(
        empty, max_memory=dict(max_memory), no_split_module_classes=empty._no_split_modules or [], dtype=dtype
    )
    stray = sorted({str(d) for d in device_map.values() if d not in max_memory})
    if stray:
        raise FineflowError(
            f"the model does not fit {len(max_memory)} device(s) with {sorted(max_memory.values())} bytes for "
            f"weights: accelerate placed part of it on {stray}; lower evaluate.batch_size or use more devices"
        )
    return device_map


def visible_device_bytes(override_gib: float | None) -> list[float]:
    """The memory of each visible device: every CUDA GPU's total, else the host's available RAM as one device;
    evaluate.device_memory_gib (override_gib) replaces each size when set."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if override_gib is not None:
        return [override_gib * GiB] * max(count, 1)
    if count:
        return [float(torch.cuda.get_device_properties(i).total_memory) for i in range(count)]
    return [float(_available_ram())]


def _available_ram() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
