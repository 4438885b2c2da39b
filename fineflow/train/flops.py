"""Model FLOPs per token, the device's peak FLOP/s, and MFU/HFU.

MFU (model FLOPs utilization) = the FLOPs the model's maths needs per trained token x tokens/s / the device's
peak; HFU (hardware FLOPs utilization) counts what the hardware actually ran, recomputation included
(gradient checkpointing runs each layer's forward twice). Per token, for a decoder of N parameters (the
embedding lookup excluded: it is a gather, not a matmul):

- full fine-tuning: 6N (forward 2N, backward 4N: gradients of activations and of weights);
- LoRA/QLoRA: 4N + 6N_adapters (the frozen base needs activation gradients, 2N, but no weight gradients);
- attention scores and values: 6 x layers x (2 x q_dim x attended length), the attended length being the mean
  context a token attends to (packed examples attend within themselves);
- gradient checkpointing adds one more forward (2N and the forward attention) to HFU.

Peak FLOP/s come from ``PEAK_TFLOPS`` (dense, no sparsity: the vendors' datasheets) by device name and
precision; on a CPU fineflow measures it (``cpu_peak_probe``: the median of 7 1024^2 matmuls in the run's
precision, spaced over ~0.3 s, and their spread) and says so in the report; a best-of-5 on a busy machine was
whatever moment happened to be quiet, and the doctor now calls an MFU over a spread probe inconclusive.

Whether bf16 would pay (the doctor's precision finding) is ``bf16_speedup``: bf16's matmul rate over fp32's,
measured on a CPU with bf16 instructions (seen: 2.1x on an AMD EPYC with AVX-512 BF16), the table's ratio on a
known GPU. The CPU probe (``bf16_probe``) times ``PROBE_ROUNDS`` interleaved pairs (fp32, bf16, fp32, bf16, ...: a
load that comes and goes hits both dtypes alike) and keeps the median of the pairs' ratios and their spread (the
interquartile range over the median): timed in two blocks, best of 5 each, a machine that turned busy between the
blocks measured 13.7x and 25x instead of 2.1x, and the doctor trusts a ratio only when its spread is small.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

# dense TFLOP/s per device by precision (fp32: non-tensor-core; TF32 would be higher). Names are matched as
# substrings of torch.cuda.get_device_name(), longest first.
PEAK_TFLOPS = {
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "GH200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "RTX 4090": {"bf16": 165.0, "fp16": 165.0, "fp32": 82.6},
    "V100": {"bf16": None, "fp16": 125.0, "fp32": 15.7},
    "T4": {"bf16": None, "fp16": 65.0, "fp32": 8.1},
    "MI300X": {"bf16": 1307.0, "fp16": 1307.0, "fp32": 163.4},
}
PRECISION_KEY = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def table_peak(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s of a known GPU at the run's precision ("no" = fp32), or None."""
    for name in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if name.lower() in device_name.lower():
            tflops = PEAK_TFLOPS[name].get(PRECISION_KEY.get(precision, precision))
            return tflops * 1e12 if tflops else None
    return None


# a run's train.precision -> the torch dtype its matmuls run in on a CPU
CPU_DTYPES = {"no": "float32", "bf16": "bfloat16", "fp16": "float16"}


PROBE_ROUNDS = 7  # interleaved fp32/bf16 pairs of the bf16 probe: enough for a median and quartiles, ~0.5 s
PROBE_PAUSE_S = 0.02  # between the CPU peak probe's rounds: they sample the machine's load over ~0.3 s


def cpu_peak_probe(
    dtype: str = "float32", size: int = 1024, rounds: int = PROBE_ROUNDS, timer: Callable[[], float] | None = None
) -> dict:
    """{"flops_per_s", "spread", "rounds"}: this CPU's matmul rate in `dtype` (with the threads torch uses), the
    median of `rounds` timed matmuls spaced PROBE_PAUSE_S apart (a load that comes and goes hits some rounds,
    not the statistic), and their interquartile range over that median. `timer` (timing one size x size matmul)
    defaults to this CPU's (``timed_matmul``); tests pass their own."""
    timer = timer or timed_matmul(dtype, size)
    rates = []
    for _ in range(rounds):
        rates.append(2 * size**3 / timer())
        time.sleep(PROBE_PAUSE_S)
    median = statistics.median(rates)
    low, _, high = statistics.quantiles(rates, n=4)
    return {"flops_per_s": round(median), "spread": round((high - low) / median, 3), "rounds": rounds}


def peak_flops(device_type: str, device_name: str, precision: str) -> dict:
    """{"flops_per_s", "source"}: the table's figure on a known GPU, a measured one on a CPU (with the probe's
    "spread": over the doctor's MAX_PROBE_SPREAD, it calls the MFU inconclusive), else None."""
    if device_type == "cpu":
        probe = cpu_peak_probe(CPU_DTYPES.get(precision, "float32"))
        source = (
            f"measured: {PRECISION_KEY.get(precision, precision)} 1024x1024 matmul on this CPU, "
            f"median of {probe['rounds']} rounds"
        )
        return {"flops_per_s": probe["flops_per_s"], "source": source, "spread": probe["spread"]}
    value = table_peak(device_name, precision)
    if value is None:
        return {"flops_per_s": None, "source": f"unknown device {device_name!r} at {precision}: add it to PEAK_TFLOPS"}
    return {"flops_per_s": value, "source": f"table: {device_name} {PRECISION_KEY.get(precision, precision)} dense"}


def flops_per_token(
    matmul_params: int,
    trainable: int,
    method: str,
    num_layers: int,
    q_dim: int,
    attended: float,
    recompute: bool,
) -> dict:
    """{"model", "hardware"}: training FLOPs per token (see the module docstring)."""
    attention_fwd = 2 * num_layers * 2 * q_dim * attended  # QK^T and AV, 2 FLOPs per multiply-add
    if method == "full":
        model = 6 * matmul_params + 3 * attention_fwd
    else:
        model = 4 * matmul_params + 6 * trainable + 3 * attention_fwd
    hardware = model + (2 * matmul_params + attention_fwd if recompute else 0)
    return {"model": model, "hardware": hardware}


def utilization(flops: dict, tokens_per_s: float | None, peak: dict, devices: int) -> dict:
    """MFU and HFU of the run (None where the peak or the speed is unknown)."""
    if not tokens_per_s or not peak.get("flops_per_s"):
        return {"mfu": None, "hfu": None}
    total_peak = peak["flops_per_s"] * max(1, devices)
    return {
        "mfu": round(flops["model"] * tokens_per_s / total_peak, 5),
        "hfu": round(flops["hardware"] * tokens_per_s / total_peak, 5),
    }


def bf16_capable(device_type: str) -> bool:
    """Whether the device computes bf16 fast: a CUDA GPU that supports it, or a CPU with AMX / AVX-512 BF16
    (elsewhere torch emulates bf16 on a CPU, slower than fp32)."""
    if device_type == "cuda":
        import torch

        return bool(torch.cuda.is_bf16_supported(including_emulation=False))  # V100/T4 emulate it: slower
    try:
        flags = open("/proc/cpuinfo", encoding="utf-8").read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def bf16_facts(device_type: str, device_name: str, measure: bool = True) -> dict:
    """{"bf16_capable", "bf16_speedup"} of the device (the speed-up only when `measure`: ~0.5 s on a CPU), and on a
    CPU the probe's "bf16_spread" and "bf16_rounds" (``bf16_probe``)."""
    if not measure:
        return {"bf16_capable": bf16_capable(device_type), "bf16_speedup": None}
    if device_type == "cpu" and bf16_capable(device_type):
        probe = bf16_probe()
        return {"bf16_capable": True, "bf16_speedup": probe["speedup"]} | {
            f"bf16_{key}": probe[key] for key in ("spread", "rounds")
        }
    return {"bf16_capable": bf16_capable(device_type), "bf16_speedup": bf16_speedup(device_type, device_name)}


def timed_matmul(dtype: str, size: int = 1024) -> Callable[[], float]:
    """A function timing one size x size matmul in `dtype` (seconds), after a warm-up (thread pool, caches)."""
    import torch

    kind = getattr(torch, dtype)
    a, b = torch.randn(size, size, dtype=kind), torch.randn(size, size, dtype=kind)
    torch.mm(a, b)

    def one() -> float:
        started = time.perf_counter()
        torch.mm(a, b)
        return time.perf_counter() - started

    return one


def bf16_probe(rounds: int = PROBE_ROUNDS, timers: dict[str, Callable[[], float]] | None = None) -> dict:
    """{"speedup", "spread", "rounds"}: the median over `rounds` interleaved pairs of fp32's matmul time over
    bf16's, and the pairs' interquartile range over that median. `timers` ({"float32": f, "bfloat16": f}, each
    timing one matmul) default to this CPU's (``timed_matmul``); tests pass their own."""
    timers = timers or {dtype: timed_matmul(dtype) for dtype in ("float32", "bfloat16")}
    ratios = [timers["float32"]() / timers["bfloat16"]() for _ in range(rounds)]
    median = statistics.median(ratios)
    low, _, high = statistics.quantiles(ratios, n=4)
    return {"speedup": round(median, 2), "spread": round((high - low) / median, 3), "rounds": rounds}


def bf16_speedup(device_type: str, device_name: str) -> float | None:
    """bf16's matmul rate over fp32's on a device that does bf16 fast: measured on a CPU (``bf16_probe``'s
    median), the table's ratio on a known GPU; None elsewhere."""
    if not bf16_capable(device_type):
        return None
    if device_type == "cpu":
        return bf16_probe()["speedup"]
    bf16, fp32 = table_peak(device_name, "bf16"), table_peak(device_name, "no")
    if fp32 and not bf16:
        return 1.0  # a known GPU without bf16 units (V100, T4): no speed-up, no finding
    return round(bf16 / fp32, 1) if bf16 and fp32 else None
