"""GPU benchmark: LoRA fine-tuning throughput, MFU, memory and stalls, in one short unattended run.

    bash bench/gpu.sh --out /tmp/gpu.json          # on a GPU: every configuration, ~2-4 min on an H200
    bash bench/gpu.sh --device cpu --tiny          # CPU dry run of the script itself (~1 min; not a measurement)
    python3 bench/gpu.py --only lora_bf16_varlen   # one configuration

Needs torch, transformers (5.17 or newer) and peft only (peft brings accelerate with it); flash-attn and
bitsandbytes are used when they import. It does not import fineflow: the packed-row attention and the
memory planner it mirrors are copied in bench/gpu_mirror.py. No download: the model is built from a config
(Llama-3.2-1B's shape by default, random weights) and the data are random packed rows.

Configurations, each a fixed number of warm-up then timed steps on the same rows, in this order (a time
budget, --budget-s, skips what would not finish; the JSON is rewritten after each one):

    lora_bf16_varlen   the baseline: bf16 base, fp32 adapters, bf16 autocast, per-example SDPA (fineflow's
                       train.attention varlen); also measures the checkpoint stall
    lora_bf16_flash    the same with flash_attention_2, given each example's cu_seqlens explicitly
                       (skipped: flash-attn not installed, or no GPU)
    qlora_bf16_varlen  NF4 base loaded through BitsAndBytesConfig as fineflow's train stage does (skipped:
                       bitsandbytes not installed, or no GPU)
    lora_fp32_varlen   fp32 base and compute, no autocast (TF32 as torch's default: off for matmuls)

Measured per configuration:
- tokens/s: computed tokens (micro-batch x seq_len per step, padding included) and real (non-pad) tokens.
- MFU = model FLOPs per second / the chip's dense bf16 peak (also for fp32, so the ratios compare). Model
  FLOPs per step, over real tokens T, trained positions K and examples of lengths L_i:
      4 * N_frozen * T  +  4 * vocab * hidden * K  +  6 * N_lora * T  +  12 * layers * q_dim * sum(L_i^2)
  frozen decoder linears (forward 2N, input gradients 2N), lm_head on trained positions only (the loss
  takes logits there only), adapters (6N), attention's score and value matmuls forward and backward per
  example (each example attends only to itself; the causal mask is not discounted, PaLM's convention).
  ``mfu_full_row_attention`` is what counting every row's S^2 instead would claim.
- peak memory: torch.cuda.max_memory_allocated over the configuration (model built, steps run) against
  the planner's tensor estimate (bench/gpu_mirror.plan: weights + gradients + optimizer states + the larger
  of activations and the optimizer step's temporaries; the plan's total adds 0.5 GiB CUDA context and 10%
  fragmentation, which max_memory_allocated does not see). On CPU: process max RSS, not comparable.
- data wait: time the loop blocks for its next batch (a loader thread prepares rows, the varlen layout or
  cu_seqlens and pinned tensors two steps ahead) including issuing the host-to-device copies.
- checkpoint stall (baseline only): time the loop blocks to save the trainable state (adapters and AdamW
  state), synchronous (copy to host, torch.save, fsync) against asynchronous (copy into pinned host
  buffers; a thread writes), as fineflow.checkpoint does; and the step time while the async write runs.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before torch's import: the ledger's start-up counts from here

import argparse
import contextlib
import gc
import importlib
import json
import math
import os
import platform
import queue
import resource
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_mirror as mirror  # noqa: E402  (bench/ is no package; the mirror sits beside this file)

# dense (no 2:4 sparsity) bf16 tensor-core peaks, TFLOPS; first match on torch.cuda.get_device_name wins
PEAK_BF16_TFLOPS = [
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10", 125.0),
]
# Llama-3.2 shapes from their config.json (as fineflow.train.planner.KNOWN_SHAPES), and a tiny one for CPU.
SHAPES = {
    "1b": mirror.Shape(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256, tied=True),
    "3b": mirror.Shape(hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8, vocab=128256, tied=True),
    "tiny": mirror.Shape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512, tied=False),
}
LORA_TARGETS = mirror.LINEARS
CHECKPOINT_STEPS_DURING_WRITE = 2


@dataclass(frozen=True)
class RunConfig:
    name: str
    method: str  # lora | qlora
    precision: str  # bf16 | fp32
    attention: str  # varlen | flash


CONFIGS = [
    RunConfig("lora_bf16_varlen", "lora", "bf16", "varlen"),
    RunConfig("lora_bf16_flash", "lora", "bf16", "flash"),
    RunConfig("qlora_bf16_varlen", "qlora", "bf16", "varlen"),
    RunConfig("lora_fp32_varlen", "lora", "fp32", "varlen"),
]
# How long each configuration takes next to the baseline, for the budget guard (fp32 matmuls run ~8x
# slower than bf16 on tensor cores, QLoRA dequantizes every linear and saves/reloads its base).
COST_VS_BASELINE = {"lora_bf16_flash": 1.0, "qlora_bf16_varlen": 2.0, "lora_fp32_varlen": 5.0}
QLORA_SETUP_S = 60.0


# --- data -----------------------------------------------------------------------------------------------------


@dataclass
class Pool:
    """Random packed rows, as the tokenize stage's shards hold them: examples of mixed length one after
    another, position ids restarting at 0 per example, the last two thirds of each example trained
    (labels -100 elsewhere), and a short padding tail that is its own segment and never trained."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    example_lengths: list[np.ndarray]  # per row, the real examples' lengths


def make_pool(rows: int, seq_len: int, vocab: int, seed: int) -> Pool:
    rng = np.random.default_rng(seed)
    input_ids = np.zeros((rows, seq_len), dtype=np.int64)
    labels = np.full((rows, seq_len), -100, dtype=np.int64)
    position_ids = np.zeros((rows, seq_len), dtype=np.int64)
    lengths = []
    shortest, longest = max(4, seq_len // 16), max(5, seq_len * 3 // 4)
    for r in range(rows):
        start, row_lengths = 0, []
        while seq_len - start >= 8:  # a sliver stays padding, as in real packed rows
            n = min(int(rng.integers(shortest, longest)), seq_len - start)
            input_ids[r, start : start + n] = rng.integers(4, vocab, size=n)
            labels[r, start + n // 3 : start + n] = input_ids[r, start + n // 3 : start + n]
            position_ids[r, start : start + n] = np.arange(n)
            row_lengths.append(n)
            start += n
        position_ids[r, start:] = np.arange(seq_len - start)
        lengths.append(np.asarray(row_lengths, dtype=np.int64))
    return Pool(input_ids, labels, position_ids, lengths)


@dataclass
class HostBatch:
    """One micro-batch prepared on the loader thread (numpy work, zero-copy tensors, pinned on a GPU)."""

    tensors: dict  # input_ids, position_ids, keep (flat positions whose next token trains), targets, ...
    attention: str
    layout: mirror.PackedLayout | None
    max_length: int
    real_tokens: int
    kept: int
    sum_sq_lengths: int  # sum over examples of length^2: what per-example attention costs
    row_sq: int  # rows x seq_len^2: what attention over whole rows would cost


def prepare_batch(pool: Pool, rows: np.ndarray, attention: str, pin: bool) -> HostBatch:
    positions = pool.position_ids[rows]
    labels = pool.labels[rows]
    next_label = np.full_like(labels, -100)
    next_label[:, :-1] = labels[:, 1:]  # position t is trained on token t + 1
    flat_next = next_label.reshape(-1)
    keep = np.flatnonzero(flat_next != -100)
    arrays = {"input_ids": pool.input_ids[rows], "position_ids": positions, "keep": keep, "targets": flat_next[keep]}
    layout, max_length = None, 0
    if attention == "varlen":
        layout = mirror.packed_layout(positions)
    else:
        arrays["cu_seqlens"], max_length = mirror.flash_varlen_kwargs(positions)
    tensors = {key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in arrays.items()}
    if pin:
        tensors = {key: value.pin_memory() for key, value in tensors.items()}
    lengths = np.concatenate([pool.example_lengths[r] for r in rows])
    return HostBatch(
        tensors=tensors,
        attention=attention,
        layout=layout,
        max_length=max_length,
        real_tokens=int(lengths.sum()),
        kept=len(keep),
        sum_sq_lengths=int((lengths**2).sum()),
        row_sq=len(rows) * positions.shape[1] ** 2,
    )


class PrefetchLoader:
    """Prepares `steps` micro-batches `depth` ahead on a daemon thread (as fineflow.train.loader.BatchLoader);
    rows come from a seeded permutation of the pool, cycled. An error on the thread is raised in the loop."""

    def __init__(self, pool: Pool, micro: int, steps: int, attention: str, pin: bool, seed: int = 0, depth: int = 2):
        order = np.random.default_rng(seed).permutation(len(pool.input_ids))
        self._rows = [np.take(order, range(i * micro, (i + 1) * micro), mode="wrap") for i in range(steps)]
        self._prepare = lambda rows: prepare_batch(pool, rows, attention, pin)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="gpu-bench-loader", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            for rows in self._rows:
                item = self._prepare(rows)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as exc:
            self._queue.put(exc)

    def next(self) -> HostBatch:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass
class DeviceBatch:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    keep: torch.Tensor
    targets: torch.Tensor
    attention_kwargs: dict


def to_device(batch: HostBatch, device: torch.device) -> DeviceBatch:
    """Issue the host-to-device copies (asynchronous from pinned memory) and the attention kwargs."""
    moved = {key: value.to(device, non_blocking=True) for key, value in batch.tensors.items()}
    if batch.attention == "varlen":
        kwargs = mirror.layout_kwargs(batch.layout, device)
    else:  # flash: transformers' padding-free path, given every example's boundaries
        cu = moved["cu_seqlens"]
        kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": batch.max_length}
        kwargs["max_length_k"] = batch.max_length
    return DeviceBatch(moved["input_ids"], moved["position_ids"], moved["keep"], moved["targets"], kwargs)


# --- model ----------------------------------------------------------------------------------------------------


def llama_config(shape: mirror.Shape, seq_len: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=shape.tied,
        use_cache=False,
    )


def attn_implementation(config: RunConfig) -> str:
    return mirror.register_varlen() if config.attention == "varlen" else "flash_attention_2"


def quantized_base(llama, config: RunConfig, device: torch.device, scratch: Path):
    """A random bf16 base saved and reloaded through BitsAndBytesConfig (NF4, double quantization, bf16
    compute) and prepared by peft, as fineflow.train.model.build_model loads QLoRA."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    with torch.device(device):
        AutoModelForCausalLM.from_config(llama, dtype=torch.bfloat16).save_pretrained(scratch / "base")
    gc.collect()
    torch.cuda.empty_cache()
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        scratch / "base",
        dtype=torch.bfloat16,
        quantization_config=quantization,
        attn_implementation=attn_implementation(config),
        device_map={"": device.index or 0},
    )
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def build_model(shape: mirror.Shape, seq_len: int, config: RunConfig, lora_r: int, device: torch.device, scratch: Path):
    """Random-weight Llama with LoRA on every projection. LoRA: the base in the compute dtype, created on the
    device; the adapters stay fp32 (peft's default), as the planner assumes."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    llama = llama_config(shape, seq_len)
    torch.manual_seed(0)  # the same weights for the same dtype: first-step losses compare across attentions
    if config.method == "qlora":
        model = quantized_base(llama, config, device, scratch)
    else:
        dtype = torch.bfloat16 if config.precision == "bf16" else torch.float32
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                llama, dtype=dtype, attn_implementation=attn_implementation(config)
            )
    lora = LoraConfig(
        r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM"
    )
    return get_peft_model(model, lora)


@dataclass
class Trainer:
    """The pieces one step needs. The decoder and lm_head are called directly, the loss computed here:
    logits only at trained positions (an index_select of the hidden states) on any transformers version,
    where transformers 5.17's Llama forward refuses fineflow's 2-D boolean logits_to_keep."""

    model: torch.nn.Module
    decoder: torch.nn.Module
    lm_head: torch.nn.Module
    optimizer: torch.optim.Optimizer
    trainable: list
    autocast: bool
    device: torch.device


def make_trainer(model, precision: str, device: torch.device) -> Trainer:
    base = model.get_base_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)  # foreach, the planner's optimizer-step temporaries
    model.train()
    return Trainer(model, base.model, base.lm_head, optimizer, trainable, precision == "bf16", device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(trainer: Trainer, batch: DeviceBatch) -> tuple[float, float, float]:
    """Forward, backward, clip, AdamW. Returns (compute seconds, optimizer seconds, loss)."""
    import torch.nn.functional as F

    started = time.perf_counter()
    autocast = (
        torch.autocast(trainer.device.type, dtype=torch.bfloat16) if trainer.autocast else contextlib.nullcontext()
    )
    with autocast:
        hidden = trainer.decoder(
            input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **batch.attention_kwargs
        ).last_hidden_state
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.keep)
        logits = trainer.lm_head(picked)
    loss = F.cross_entropy(logits.float(), batch.targets)
    loss.backward()
    loss_value = loss.item()  # a host sync per step, as fit() has
    computed = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(trainer.trainable, 1.0)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    synchronize(trainer.device)
    return computed - started, time.perf_counter() - computed, loss_value


# --- checkpoint stall -----------------------------------------------------------------------------------------


def trainable_state(trainer: Trainer) -> dict:
    """What a LoRA checkpoint holds: the adapters and AdamW's state, name -> tensor (on the device)."""
    state = {}
    for index, param in enumerate(trainer.trainable):
        state[f"param.{index}"] = param
        for key, value in trainer.optimizer.state.get(param, {}).items():
            if torch.is_tensor(value):
                state[f"optim.{index}.{key}"] = value
    return state


def write_durably(tensors: dict, path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(tensors, handle)
        handle.flush()
        os.fsync(handle.fileno())


def snapshot_into(buffers: dict, state: dict, device: torch.device) -> None:
    """Copy the state into host buffers; the loop waits for the copy (the next step changes the state)."""
    with torch.no_grad():
        for name, tensor in state.items():
            buffers[name].copy_(tensor.detach(), non_blocking=True)
    synchronize(device)


def async_save(buffers: dict, state: dict, device: torch.device, path: Path) -> tuple[float, threading.Thread, dict]:
    """Snapshot, then write on a thread. Returns (seconds the loop was blocked, the thread, its timing)."""
    started = time.perf_counter()
    snapshot_into(buffers, state, device)
    timing: dict = {}

    def write() -> None:
        began = time.perf_counter()
        write_durably(buffers, path)
        timing["write_s"] = time.perf_counter() - began

    thread = threading.Thread(target=write, name="gpu-bench-checkpoint", daemon=True)
    thread.start()
    return time.perf_counter() - started, thread, timing


def measure_checkpoint_stall(trainer: Trainer, next_batch, scratch: Path) -> dict:
    """Blocked time of a synchronous and of an asynchronous save of the same state, and the step time
    while the async write is in flight (the first async save allocates its pinned buffers; the second,
    steady state, is the one reported)."""
    device = trainer.device
    state = trainable_state(trainer)
    size = sum(t.numel() * t.element_size() for t in state.values())
    started = time.perf_counter()
    host = {name: tensor.detach().to("cpu") for name, tensor in state.items()}
    write_durably(host, scratch / "sync.pt")
    sync_s = time.perf_counter() - started
    del host
    pin = device.type == "cuda"
    started = time.perf_counter()
    buffers = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for n, t in state.items()}
    allocate_s = time.perf_counter() - started
    _, thread, _ = async_save(buffers, state, device, scratch / "async-0.pt")
    thread.join()
    stall_s, thread, timing = async_save(buffers, state, device, scratch / "async-1.pt")
    step_times = []
    for _ in range(CHECKPOINT_STEPS_DURING_WRITE):
        began = time.perf_counter()
        train_step(trainer, to_device(next_batch(), device))
        step_times.append(time.perf_counter() - began)
    in_flight_after_steps = thread.is_alive()
    thread.join()
    return {
        "state_bytes": size,
        "stall_sync_s": round(sync_s, 4),
        "stall_async_s": round(stall_s, 4),
        "async_over_sync": round(stall_s / sync_s, 4) if sync_s > 0 else None,
        "async_buffer_allocation_s": round(allocate_s, 4),
        "async_write_s": round(timing.get("write_s", float("nan")), 4),
        "step_ms_during_async_write": round(1000 * sum(step_times) / len(step_times), 2),
        "write_outlasted_steps": in_flight_after_steps,
    }


# --- figures --------------------------------------------------------------------------------------------------


def model_flops(shape: mirror.Shape, n_lora: int, real: int, kept: int, sum_sq: int) -> tuple[float, float]:
    """(model FLOPs, their attention part) of one step; see the module docstring."""
    frozen = 4 * shape.layers * shape.linear_params_per_layer * real
    head = 4 * shape.vocab * shape.hidden * kept
    adapters = 6 * n_lora * real
    attention = 12 * shape.layers * shape.q_dim * sum_sq
    return float(frozen + head + adapters + attention), float(attention)


def peak_tflops_for(device_name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


def peak_memory(device: torch.device) -> tuple[int, int | None, str]:
    """(peak bytes, reserved bytes, what was measured)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device), "max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return rss, None, "process max RSS (CPU: whole process, not comparable with the plan)"


def gib(n: float | None) -> float | None:
    return None if n is None else round(n / mirror.GiB, 3)


@dataclass
class Tally:
    """Sums over the timed steps."""

    steps: int = 0
    wall_s: float = 0.0
    data_wait_s: float = 0.0
    compute_s: float = 0.0
    optimizer_s: float = 0.0
    real_tokens: int = 0
    flops: float = 0.0
    attention_flops: float = 0.0
    row_attention_flops: float = 0.0
    losses: list = field(default_factory=list)


# --- one configuration ----------------------------------------------------------------------------------------


class Budget:
    """The run's time guard: configurations that would not finish are skipped, timed loops stop early."""

    def __init__(self, seconds: float):
        self.seconds, self.started = seconds, time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)


def reset_device(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_steps(trainer, loader, steps: int, shape, n_lora: int, micro: int, budget: Budget | None) -> Tally:
    """Timed steps: data wait (queue pop + copies issued), compute, optimizer, and the model FLOPs done."""
    tally = Tally()
    started = time.perf_counter()
    for _ in range(steps):
        began = time.perf_counter()
        host = loader.next()
        batch = to_device(host, trainer.device)
        waited = time.perf_counter() - began
        compute_s, optimizer_s, loss = train_step(trainer, batch)
        flops, attention = model_flops(shape, n_lora, host.real_tokens, host.kept, host.sum_sq_lengths)
        row_attention = 12 * shape.layers * shape.q_dim * host.row_sq
        tally.steps += 1
        tally.data_wait_s += waited
        tally.compute_s += compute_s
        tally.optimizer_s += optimizer_s
        tally.real_tokens += host.real_tokens
        tally.flops += flops
        tally.attention_flops += attention
        tally.row_attention_flops += row_attention
        tally.losses.append(loss)
        if budget is not None and budget.left() <= 0:
            break
    tally.wall_s = time.perf_counter() - started
    return tally


def figures(tally: Tally, micro: int, seq_len: int, peak_tflops: float | None) -> dict:
    tokens = tally.steps * micro * seq_len
    achieved = tally.flops / tally.wall_s / 1e12
    full_row = (tally.flops - tally.attention_flops + tally.row_attention_flops) / tally.wall_s / 1e12
    return {
        "steps": tally.steps,
        "timed_s": round(tally.wall_s, 3),
        "step_ms": round(1000 * tally.wall_s / tally.steps, 2),
        "tokens_per_s": round(tokens / tally.wall_s, 1),
        "real_tokens_per_s": round(tally.real_tokens / tally.wall_s, 1),
        "real_token_share": round(tally.real_tokens / tokens, 4),
        "model_tflop_per_step": round(tally.flops / tally.steps / 1e12, 4),
        "attention_flops_share": round(tally.attention_flops / tally.flops, 4),
        "achieved_tflops": round(achieved, 3),
        "mfu": round(achieved / peak_tflops, 4) if peak_tflops else None,
        "mfu_full_row_attention": round(full_row / peak_tflops, 4) if peak_tflops else None,
        "data_wait_s": round(tally.data_wait_s, 4),
        "data_wait_share": round(tally.data_wait_s / tally.wall_s, 5),
        "compute_share": round(tally.compute_s / tally.wall_s, 4),
        "optimizer_share": round(tally.optimizer_s / tally.wall_s, 4),
        "loss_first": round(tally.losses[0], 5),
        "loss_last": round(tally.losses[-1], 5),
        "finite_loss": all(math.isfinite(x) for x in tally.losses),
    }


def memory_figures(device, shape, config: RunConfig, micro: int, seq_len: int, lora_r: int) -> dict:
    planned = mirror.plan(shape, mirror.Setup(config.method, config.precision, micro, seq_len, lora_r, LORA_TARGETS))
    measured, reserved, kind = peak_memory(device)
    comparable = device.type == "cuda"
    return {
        "peak_memory_gib": gib(measured),
        "peak_reserved_gib": gib(reserved),
        "peak_memory_kind": kind,
        "planned_tensors_gib": gib(planned["tensors"]),
        "planned_total_gib": gib(planned["total"]),
        "planned_parts_gib": {key: gib(value) for key, value in planned.items()},
        "measured_over_planned": round(measured / planned["tensors"], 4) if comparable else None,
    }


def warm_up(trainer, loader, steps: int, device) -> None:
    for _ in range(steps):
        train_step(trainer, to_device(loader.next(), device))


def run_config(config: RunConfig, shape, args, pool: Pool, device, budget: Budget, peak_tflops, scratch) -> dict:
    """Build, warm up (halving the micro-batch on out-of-memory), time, and measure one configuration. Its
    wall time is split into ``phases`` (the goodput ledger's buckets: bench_ledger)."""
    began = time.perf_counter()
    build_s = warmup_s = 0.0
    micro = args.micro_batch
    extra = CHECKPOINT_STEPS_DURING_WRITE if config.name == CONFIGS[0].name else 0
    while True:
        reset_device(device)
        model = trainer = loader = None
        try:
            model = build_model(shape, args.seq_len, config, args.lora_r, device, scratch)
            build_s = time.perf_counter() - began
            warming = time.perf_counter()
            trainer = make_trainer(model, config.precision, device)
            total = args.warmup_steps + args.steps + extra
            loader = PrefetchLoader(pool, micro, total, config.attention, pin=device.type == "cuda")
            warm_up(trainer, loader, args.warmup_steps, device)
            warmup_s = time.perf_counter() - warming
            break
        except torch.cuda.OutOfMemoryError:
            if loader is not None:
                loader.close()
            del model, trainer, loader
            if micro == 1:
                raise
            print(f"  {config.name}: out of memory at micro-batch {micro}; retrying with {micro // 2}", flush=True)
            micro //= 2
    try:
        n_lora = mirror.lora_params(shape, args.lora_r, LORA_TARGETS)
        tally = run_steps(trainer, loader, args.steps, shape, n_lora, micro, budget)
        result = {
            "status": "ok",
            "method": config.method,
            "precision": config.precision,
            "attention": config.attention,
            "micro_batch": micro,
            "seq_len": args.seq_len,
            "warmup_steps": args.warmup_steps,
            "truncated_by_budget": tally.steps < args.steps,
            "trainable_params": sum(p.numel() for p in trainer.trainable),
            "planned_trainable_params": n_lora,
            "build_s": round(build_s, 2),
            **figures(tally, micro, args.seq_len, peak_tflops),
            **memory_figures(device, shape, config, micro, args.seq_len, args.lora_r),
        }
        checkpoint_s = 0.0
        if extra:
            saving = time.perf_counter()
            result["checkpoint"] = measure_checkpoint_stall(trainer, loader.next, scratch)
            checkpoint_s = time.perf_counter() - saving
        result["wall_s"] = round(time.perf_counter() - began, 2)
        result["phases"] = {
            "model_load": round(build_s, 4),  # every attempt's build, out-of-memory retries included
            "startup": round(warmup_s, 4),  # optimizer, loader, warm-up steps (kernels, allocator)
            "compute": round(tally.compute_s + tally.optimizer_s, 4),
            "data_wait": round(tally.data_wait_s, 4),
            "checkpoint": round(checkpoint_s, 4),  # the sync and async saves measured, with steps meanwhile
            "unaccounted": round(tally.wall_s - tally.compute_s - tally.optimizer_s - tally.data_wait_s, 4),
        }
        return result
    finally:
        loader.close()
        del model, trainer
        reset_device(device)


def skip_reason(config: RunConfig, device: torch.device, optional: dict) -> str | None:
    if config.attention == "flash":
        if device.type != "cuda":
            return "skipped: flash_attention_2 needs a CUDA GPU"
        if optional["flash_attn"] is None:
            return "skipped: flash-attn not installed"
    if config.method == "qlora":
        if device.type != "cuda":
            return "skipped: QLoRA (bitsandbytes 4-bit) needs a CUDA GPU"
        if optional["bitsandbytes"] is None:
            return "skipped: bitsandbytes not installed"
    return None


# --- report ---------------------------------------------------------------------------------------------------


def ratio(results: dict, top: str, bottom: str, key: str) -> float | str:
    a, b = results.get(top, {}), results.get(bottom, {})
    for name, r in ((top, a), (bottom, b)):
        if r.get("status") != "ok":
            return f"n/a ({name}: {r.get('status', 'not run')})"
    if not a.get(key) or not b.get(key):
        return "n/a"
    return round(a[key] / b[key], 3)


def ratios(results: dict) -> dict:
    base, flash, qlora, fp32 = (c.name for c in CONFIGS)
    out = {
        "bf16_over_fp32_tokens_per_s": ratio(results, base, fp32, "tokens_per_s"),
        "bf16_over_fp32_peak_memory": ratio(results, base, fp32, "peak_memory_gib"),
        "flash_over_varlen_tokens_per_s": ratio(results, flash, base, "tokens_per_s"),
        "flash_over_varlen_peak_memory": ratio(results, flash, base, "peak_memory_gib"),
        "qlora_over_lora_tokens_per_s": ratio(results, qlora, base, "tokens_per_s"),
        "qlora_over_lora_peak_memory": ratio(results, qlora, base, "peak_memory_gib"),
    }
    ok = results.get(base, {}).get("status") == "ok" and results.get(flash, {}).get("status") == "ok"
    same_micro = ok and results[base]["micro_batch"] == results[flash]["micro_batch"]
    out["flash_vs_varlen_first_loss_abs_diff"] = (
        round(abs(results[flash]["loss_first"] - results[base]["loss_first"]), 5) if same_micro else "n/a"
    )
    checkpoint = results.get(base, {}).get("checkpoint")
    out["async_over_sync_checkpoint_stall"] = checkpoint["async_over_sync"] if checkpoint else "n/a"
    return out


def fmt(value, pattern: str = "{:,.1f}") -> str:
    return "-" if value is None else pattern.format(value)


def table(report: dict) -> str:
    header = (
        f"{'configuration':<19} {'micro':>5} {'tokens/s':>10} {'real tok/s':>10} {'MFU':>6} {'MFU row':>7} "
        f"{'peak GiB':>8} {'plan GiB':>8} {'meas/plan':>9} {'wait %':>6} {'step ms':>8} {'loss 1st':>8}"
    )
    lines = [header, "-" * len(header)]
    for name, r in report["configs"].items():
        if r.get("status") != "ok":
            lines.append(f"{name:<19} {r.get('status')}")
            continue
        lines.append(
            f"{name:<19} {r['micro_batch']:>5} {fmt(r['tokens_per_s'], '{:,.0f}'):>10} "
            f"{fmt(r['real_tokens_per_s'], '{:,.0f}'):>10} {fmt(r['mfu'], '{:.1%}'):>6} "
            f"{fmt(r['mfu_full_row_attention'], '{:.1%}'):>7} {fmt(r['peak_memory_gib'], '{:.3f}'):>8} "
            f"{fmt(r['planned_tensors_gib'], '{:.3f}'):>8} {fmt(r['measured_over_planned'], '{:.2f}'):>9} "
            f"{100 * r['data_wait_share']:>6.2f} {r['step_ms']:>8.1f} {r['loss_first']:>8.3f}"
        )
    lines.append("")
    lines += [f"  {key:<40} {value}" for key, value in report["ratios"].items()]
    checkpoint = report["configs"].get(CONFIGS[0].name, {}).get("checkpoint")
    if checkpoint:
        lines.append(
            f"  checkpoint ({checkpoint['state_bytes'] / 1e6:.1f} MB): loop blocked {checkpoint['stall_sync_s']:.3f} s "
            f"sync vs {checkpoint['stall_async_s']:.4f} s async (write {checkpoint['async_write_s']:.3f} s on a "
            f"thread; steps meanwhile {checkpoint['step_ms_during_async_write']:.1f} ms)"
        )
    return "\n".join(lines)


def bench_ledger(report: dict, total_s: float, device_name: str) -> dict:
    """The bench run's own goodput ledger, in fineflow's buckets (fineflow.goodput.ledger): each configuration's
    phases; the rest of the process (imports, the data pool, tearing down between configurations) is start-up;
    what no timer covered inside the timed loops is unaccounted. Priced with fineflow's default table
    (bench/gpu_mirror.PRICES)."""
    buckets = dict.fromkeys(("startup", "model_load", "compute", "data_wait", "checkpoint"), 0.0)
    unaccounted = 0.0
    configs_s = 0.0
    for result in report["configs"].values():
        phases = result.get("phases")
        if not phases:
            continue
        configs_s += result["wall_s"]
        for name, seconds in phases.items():
            if name == "unaccounted":
                unaccounted += seconds
            else:
                buckets[name] += seconds
        unaccounted += result["wall_s"] - sum(phases.values())  # figures, memory, closing: untimed
    buckets["startup"] += total_s - configs_s
    price = mirror.price_per_hour(device_name)
    return {
        "total_s": round(total_s, 3),
        "buckets": {name: round(seconds, 3) for name, seconds in buckets.items()},
        "unaccounted_s": round(unaccounted, 3),
        "goodput": round(buckets["compute"] / total_s, 5) if total_s else 0.0,
        "device_hour_usd": price,
        "run_usd": round(total_s / 3600 * price, 6),
        "bucket_usd": {name: round(seconds / 3600 * price, 6) for name, seconds in buckets.items()},
    }


def write_json(report: dict, path: Path) -> None:
    """Atomic, so a run killed by the time limit leaves the last complete report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(partial, path)


def optional_versions() -> dict:
    """Versions of the optional packages, None when one does not import (any error: a broken CUDA build of
    bitsandbytes raises more than ImportError)."""
    found = {}
    for name in ("flash_attn", "bitsandbytes"):
        try:
            found[name] = getattr(importlib.import_module(name), "__version__", "unknown")
        except Exception:
            found[name] = None
    return found


def environment(device: torch.device, optional: dict) -> dict:
    import peft
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        **optional,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }


# --- entry ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--tiny", action="store_true", help="tiny model, few steps: the CPU dry run")
    parser.add_argument("--shape", choices=tuple(SHAPES), default=None, help="default: 1b on a GPU, tiny on CPU")
    parser.add_argument("--seq-len", type=int, default=0, help="packed row length (default 2048; tiny 128)")
    parser.add_argument("--micro-batch", type=int, default=0, help="rows per step (default by GPU memory)")
    parser.add_argument("--warmup-steps", type=int, default=0, help="default 3 (tiny 1)")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per configuration (default 20; tiny 3)")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--budget-s", type=float, default=480.0, help="time guard for the whole run")
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="the chip's dense bf16 peak, if unknown")
    parser.add_argument("--out", type=Path, default=Path("gpu_bench.json"), help="the JSON report")
    return parser.parse_args(argv)


def resolve_defaults(args: argparse.Namespace, device: torch.device) -> None:
    tiny = args.tiny or device.type == "cpu"
    args.shape = args.shape or ("tiny" if tiny else "1b")
    args.seq_len = args.seq_len or (128 if args.shape == "tiny" else 2048)
    args.warmup_steps = args.warmup_steps or (1 if args.tiny else 3)
    args.steps = args.steps or (3 if args.tiny else 20)
    if not args.micro_batch:
        if device.type == "cuda":
            memory = torch.cuda.get_device_properties(device).total_memory
            args.micro_batch = 8 if memory > 100e9 else 4 if memory > 40e9 else 2
        else:
            args.micro_batch = 2


def pick_device(choice: str) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py: --device cuda but torch sees no CUDA GPU (torch.cuda.is_available())")
    return torch.device("cuda", torch.cuda.current_device())


def run_or_skip(config, shape, args, pool, device, budget: Budget, peak_tflops, scratch, done: dict, optional) -> dict:
    """One configuration's result: skipped (missing package, no GPU, or the time budget, estimated from the
    baseline's wall time), an error (recorded, its traceback printed, the run goes on), or its figures."""
    reason = skip_reason(config, device, optional)
    baseline = done.get(CONFIGS[0].name, {}).get("wall_s")
    needed = COST_VS_BASELINE.get(config.name, 1.0) * (baseline or 0.0)
    needed += QLORA_SETUP_S if config.method == "qlora" and device.type == "cuda" else 0.0
    if reason is None and baseline is not None and budget.left() < needed:  # the first always runs
        reason = f"skipped: time budget (needs ~{needed:.0f} s, {budget.left():.0f} s left)"
    if reason is not None:
        return {"status": reason}
    print(f"  running {config.name} ...", flush=True)
    try:
        return run_config(config, shape, args, pool, device, budget, peak_tflops, scratch)
    except Exception as exc:  # one broken configuration must not cost the others' figures
        traceback.print_exc()
        return {"status": f"error: {type(exc).__name__}: {exc}"[:500]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    if device.type == "cpu" and not args.tiny:
        print("bench/gpu.py: no CUDA GPU; add --tiny for the CPU dry run of the script", file=sys.stderr)
        return 2
    resolve_defaults(args, device)
    if device.type == "cpu":
        # the CPU run checks the script, not speed: one OpenMP thread, since on a small shared machine a
        # full team spin-waits against the other processes (seen: 5-15x slower steps at load 8 on 2 cores)
        torch.set_num_threads(1)
    budget = Budget(args.budget_s)
    optional = optional_versions()
    shape = SHAPES[args.shape]
    peak_tflops = args.peak_tflops or (
        peak_tflops_for(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    )
    selected = [c for c in CONFIGS if not args.only or c.name in args.only.split(",")]
    report = {
        "bench": "bench/gpu.py",
        "dry_run": device.type == "cpu",
        "environment": environment(device, optional),
        "shape": {"name": args.shape, **shape.__dict__, "seq_len": args.seq_len, "lora_r": args.lora_r},
        "peak_bf16_tflops": peak_tflops,
        "budget_s": args.budget_s,
        "configs": {},
    }
    print(
        f"bench/gpu.py on {report['environment']['device']}: shape {args.shape}, {args.micro_batch} x {args.seq_len}"
        f" tokens per step, {args.warmup_steps} warm-up + {args.steps} timed steps per configuration",
        flush=True,
    )
    pool = make_pool(max(64, 4 * args.micro_batch), args.seq_len, shape.vocab, seed=0)
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as scratch:
        for config in selected:
            report["configs"][config.name] = run_or_skip(
                config, shape, args, pool, device, budget, peak_tflops, Path(scratch), report["configs"], optional
            )
            print(f"  {config.name}: {report['configs'][config.name]['status']}", flush=True)
            report["ratios"] = ratios(report["configs"])
            report["elapsed_s"] = round(time.monotonic() - budget.started, 1)
            write_json(report, args.out)
    report["ledger"] = bench_ledger(
        report, time.perf_counter() - STARTED, torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    )
    write_json(report, args.out)
    print(table(report))
    ledger = report["ledger"]
    print(
        f"ledger: goodput {ledger['goodput']:.1%} of {ledger['total_s']:.1f} s, ${ledger['run_usd']:.4f} at "
        f"${ledger['device_hour_usd']}/h; " + ", ".join(f"{k} {v:.1f} s" for k, v in ledger["buckets"].items() if v)
    )
    print(f"elapsed {report['elapsed_s']:.1f} s; JSON: {args.out}")
    failed = [n for n, r in report["configs"].items() if r["status"].startswith("error") or not r.get("finite_loss", 1)]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
