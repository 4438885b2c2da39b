"""Planner accuracy on CPU: fineflow.train.planner's weight and activation terms against measured memory, for
the tiny model and a ~50M-parameter Llama, in fp32 and under bf16 autocast, side by side in one run.

    .venv/bin/python bench/planner_accuracy.py [--threads 2]

Each row runs in a fresh process (nothing left over from the previous row): build the model (transformers 5
LlamaForCausalLM, attn_implementation as listed: SDPA unless the row says eager; weights in fp32, or for the
bf16 rows in the dtype the row's layout says: a bf16 base as fineflow's build_model loads it for LoRA, or an
fp32 base under autocast), run one forward+backward with fineflow's loss (the same lines as
fineflow.objectives.token_loss.token_loss_sum; bf16 rows under torch.autocast as accelerate runs the forward), and
measure:

- weights: the process's resident memory (VmRSS) just before and just after building the model (and
  wrapping it with peft for the LoRA row). A throwaway model is built first so that transformers' lazy
  imports and torch's one-time allocations are not counted.
- activations: a small warm-up step first allocates the gradients (kept, zeroed, so the measured step
  allocates none) and the kernels' one-time buffers; then the peak resident memory is reset (writing 5 to
  /proc/self/clear_refs resets VmHWM) and the measured step's peak (VmHWM) minus the resident memory before
  it is the activation memory, loss included. Falls back to ru_maxrss when clear_refs is not writable.
- dtype accounting: numel x element_size of every parameter and buffer of the built model, against the
  planner's weight term (exact bookkeeping, no allocator in between).
- step peak: the step's peak resident memory minus the resident memory before the model was built, against
  the planner's weights + gradients + activations (what a device holds at the peak of forward+backward).
- the QLoRA row measures no step (bitsandbytes needs CUDA): its weights are the layout after peft's real
  prepare_model_for_kbit_training, the linears transformers would quantize replaced by stand-ins holding the
  packed 4-bit bytes (dtype accounting only; bitsandbytes' own storage is for a GPU to confirm).
- glibc's malloc is told to serve every block over 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_), so a freed
  tensor leaves resident memory at once and RSS tracks live tensors instead of the heap's high-water mark.

Predictions come from fineflow.train.planner with the settings actually run: the row's precision and weight
layout, the attention implementation of the row, method full (LoRA r=16 on all seven linears for the LoRA
rows), the model's LlamaConfig passed through shape_from_config. Overhead (CUDA context, fragmentation) is
not compared.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 1024**2
# fineflow's embedded default (tied embeddings) at the brief's tiny size, and a ~50M Llama-2-like model.
TINY = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1024,
    "tie_word_embeddings": True,
}
FIFTY_M = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}
# (label, config, method, micro-batch, seq_len, gradient checkpointing, attention, packed rows, precision,
#  weight layout: the planner's Setup.weight_storage -- compute: weights in the compute dtype; fp32: fp32 weights
#  cast by autocast)
CASES = [
    ("tiny", TINY, "full", 4, 128, False, "sdpa", False, "fp32", "compute"),
    ("tiny", TINY, "full", 8, 256, False, "sdpa", False, "fp32", "compute"),
    ("tiny", TINY, "full", 8, 256, True, "sdpa", False, "fp32", "compute"),
    ("tiny", TINY, "full", 8, 256, False, "eager", False, "fp32", "compute"),
    ("tiny", TINY, "full", 8, 256, False, "sdpa", True, "fp32", "compute"),
    ("50M", FIFTY_M, "full", 2, 256, False, "sdpa", False, "fp32", "compute"),
    ("50M", FIFTY_M, "full", 2, 512, False, "sdpa", False, "fp32", "compute"),
    ("50M", FIFTY_M, "full", 2, 512, True, "sdpa", False, "fp32", "compute"),
    ("50M", FIFTY_M, "lora", 2, 512, False, "sdpa", True, "fp32", "compute"),
    ("50M", FIFTY_M, "lora", 2, 256, False, "sdpa", True, "bf16", "compute"),  # fineflow's LoRA: bf16 base
    ("50M", FIFTY_M, "lora", 2, 256, False, "sdpa", True, "bf16", "fp32"),  # fp32 base under bf16 autocast
    ("50M", FIFTY_M, "lora", 2, 256, True, "sdpa", True, "bf16", "fp32"),
    ("50M", FIFTY_M, "qlora", 2, 256, False, "sdpa", True, "bf16", "compute"),  # layout only, no step
]
LORA_R = 16


def _status_bytes(key: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak() -> str:
    """Reset the peak-RSS counter; returns which counter the measurement will read."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "VmHWM"
    except OSError:
        return "ru_maxrss"


def _peak(counter: str) -> int:
    if counter == "VmHWM":
        return _status_bytes("VmHWM")
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _loss(model, ids, positions):
    """fineflow.objectives.token_loss.token_loss_sum's loss (summed next-token cross-entropy, fp32), every token
    trained."""
    import torch.nn.functional as F

    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1), reduction="sum")


def _batch(vocab: int, batch: int, seq_len: int, packed: bool, seed: int):
    """Random token rows; position ids restart mid-row when packed (two examples per row, as fineflow packs)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (batch, seq_len), generator=gen)
    if packed:
        half = seq_len // 2
        positions = torch.cat([torch.arange(half), torch.arange(seq_len - half)])
    else:
        positions = torch.arange(seq_len)
    return ids, positions.repeat(batch, 1)


def _bytes_by_dtype(model) -> dict[str, int]:
    """numel x element_size of every parameter and buffer, per dtype (shared tensors once)."""
    seen, totals = set(), {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            key = str(tensor.dtype).removeprefix("torch.")
            totals[key] = totals.get(key, 0) + tensor.numel() * tensor.element_size()
    return totals


def _qlora_layout(model):
    """The dtype layout QLoRA holds, without bitsandbytes: every linear transformers would quantize (all but
    get_keys_to_not_convert's) becomes a stand-in of peft's Params4bit class name holding the packed bytes
    (4 bits per weight plus the double-quantized block constants), then peft's real
    prepare_model_for_kbit_training upcasts the rest to fp32."""
    import math

    import torch
    from peft import prepare_model_for_kbit_training
    from transformers.quantizers.base import get_keys_to_not_convert

    from fineflow.train.planner import QLORA_BYTES_PER_PARAM

    class Params4bit(torch.nn.Parameter):  # the class name peft leaves alone
        pass

    keep = get_keys_to_not_convert(model)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not any(name == k or name.endswith("." + k) for k in keep):
            packed = math.ceil(module.weight.numel() * QLORA_BYTES_PER_PARAM)
            module.weight = Params4bit(torch.zeros(packed, dtype=torch.uint8), requires_grad=False)
    model.is_loaded_in_4bit = True
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def child(case: dict, threads: int) -> dict:
    """Build, warm up and measure one case in this (fresh) process."""
    from contextlib import nullcontext

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    config = case["config"]
    sixteen = case["precision"] != "fp32"
    dtype = torch.bfloat16 if sixteen and case["storage"] == "compute" else torch.float32

    def build():
        # _from_config with dtype builds in that dtype as from_pretrained(dtype=...) loads (rotary buffers fp32)
        model = LlamaForCausalLM._from_config(
            LlamaConfig(**config, max_position_embeddings=4096, attn_implementation=case["attention"]), dtype=dtype
        )
        if case["method"] == "qlora":
            return _qlora_layout(model)
        if case["method"] == "lora":
            from peft import LoraConfig, get_peft_model

            from fineflow.train.planner import LINEARS

            model = get_peft_model(
                model,
                LoraConfig(
                    r=LORA_R, lora_alpha=32, lora_dropout=0.0, target_modules=list(LINEARS), task_type="CAUSAL_LM"
                ),
            )
        return model

    throwaway = LlamaForCausalLM(
        LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    )
    del throwaway
    if case["method"] == "lora":
        import peft  # noqa: F401  (import cost is not weight memory)
    gc.collect()
    torch.manual_seed(0)
    before = _status_bytes("VmRSS")
    model = build()
    weights = _status_bytes("VmRSS") - before
    by_dtype = _bytes_by_dtype(model)
    if case["method"] == "qlora":  # no step: bitsandbytes' kernels need CUDA
        return {"weights": weights, "by_dtype": by_dtype, "params": None, "trainable": None}
    if case["checkpointing"]:
        model.activation_checkpointing_enable()
    model.train()

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if sixteen else nullcontext()
    ids, positions = _batch(config["vocab_size"], 1, 16, case["packed"], seed=1)
    with autocast:
        loss = _loss(model, ids, positions)
    loss.backward()  # allocates every gradient and the kernels' one-time buffers
    model.zero_grad(set_to_none=False)
    ids, positions = _batch(config["vocab_size"], case["batch"], case["seq_len"], case["packed"], seed=2)
    gc.collect()
    base = _status_bytes("VmRSS")
    counter = _reset_peak()
    started = time.perf_counter()
    with autocast:  # as accelerate wraps the forward; the loss's .float() is outside either way
        loss = _loss(model, ids, positions)
    loss.backward()
    step_s = time.perf_counter() - started
    peak = _peak(counter)
    activations = peak - base
    return {
        "weights": weights,
        "by_dtype": by_dtype,
        "step_peak": peak - before,
        "activations": activations,
        "step_s": round(step_s, 2),
        "counter": counter,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def measure(case: dict, threads: int) -> dict:
    """Run child() in a fresh interpreter with malloc returning freed blocks to the OS at once."""
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": str(64 * 1024),
        "OMP_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(case), "--threads", str(threads)],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"case {case} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def predict(case: dict):
    """The planner's plan for exactly what the child runs."""
    from fineflow.train.planner import LINEARS, Setup, plan, shape_from_config

    shape = shape_from_config(case["config"], name=case["label"])
    setup = Setup(
        method=case["method"],
        precision=case["precision"],
        weight_storage=case["storage"],
        micro_batch_size=case["batch"],
        seq_len=case["seq_len"],
        gradient_checkpointing=case["checkpointing"],
        attention=case["attention"],
        lora_r=LORA_R,
        lora_targets=LINEARS,
        packed=case["packed"],
    )
    result = plan(shape, setup)
    if case["method"] == "qlora":  # the built layout holds neither adapters nor bitsandbytes' dequantization buffer
        from fineflow.train.planner import ADAPTER_BYTES

        held = result.weights - result.trainable_params * ADAPTER_BYTES - shape.max_linear_params * 2
        result = replace(result, weights=held)
    return shape, result


def _err(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+6.1%}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child), args.threads)))
        return 0

    started = time.perf_counter()
    print(
        f"planner vs measured on CPU: fresh process per row, {args.threads} threads; MiB; "
        "err = (predicted - measured) / measured; layout = precision/weights held (compute dtype or fp32)"
    )
    print(
        f"{'model':<6}{'method':<7}{'b x s':>10}  {'ckpt':<5}{'attn':<6}{'rows':<7}{'layout':<14}"
        f"{'weights: pred':>14}{'RSS':>8}{'err':>8}{'dtypes':>8}{'err':>8}"
        f"{'activations: pred':>19}{'meas':>8}{'err':>8}{'step peak: pred':>17}{'meas':>8}{'err':>8}{'step s':>8}"
    )
    worst = {"weights": 0.0, "dtypes": 0.0, "activations": 0.0, "step peak": 0.0}
    counter = "none"
    for label, config, method, batch, seq_len, checkpointing, attention, packed, precision, storage in CASES:
        case = {
            "label": label,
            "config": config,
            "method": method,
            "batch": batch,
            "seq_len": seq_len,
            "checkpointing": checkpointing,
            "attention": attention,
            "packed": packed,
            "precision": precision,
            "storage": storage,
        }
        shape, predicted = predict(case)
        measured = measure(case, args.threads)
        dtypes = sum(measured["by_dtype"].values())
        row = (
            f"{label:<6}{method:<7}{f'{batch} x {seq_len}':>10}  {'yes' if checkpointing else 'no':<5}"
            f"{attention:<6}{'packed' if packed else 'plain':<7}{f'{precision}/{storage}':<14}"
            f"{predicted.weights / MiB:>14.1f}"
        )
        worst["dtypes"] = max(worst["dtypes"], abs(predicted.weights - dtypes) / dtypes)
        if method == "qlora":  # dtype accounting only: the layout is built by swapping modules, not loaded
            layout = ", ".join(f"{k} {v / MiB:.1f}" for k, v in sorted(measured["by_dtype"].items()))
            print(f"{row}{'-':>8}{'':>8}{dtypes / MiB:>8.1f}{_err(predicted.weights, dtypes):>8}   ({layout})")
            continue
        params = shape.params + (predicted.trainable_params if method == "lora" else 0)  # peft adds adapters
        if measured["params"] != params or measured["trainable"] != predicted.trainable_params:
            print(
                f"  ! parameter counts differ: measured {measured['params']:,} / {measured['trainable']:,} "
                f"trainable, planner {params:,} / {predicted.trainable_params:,}"
            )
        step_peak = predicted.weights + predicted.gradients + predicted.activations
        counter = measured["counter"]
        for term, pred, meas in (
            ("weights", predicted.weights, measured["weights"]),
            ("activations", predicted.activations, measured["activations"]),
            ("step peak", step_peak, measured["step_peak"]),
        ):
            worst[term] = max(worst[term], abs(pred - meas) / meas)
        print(
            f"{row}{measured['weights'] / MiB:>8.1f}{_err(predicted.weights, measured['weights']):>8}"
            f"{dtypes / MiB:>8.1f}{_err(predicted.weights, dtypes):>8}"
            f"{predicted.activations / MiB:>19.1f}{measured['activations'] / MiB:>8.1f}"
            f"{_err(predicted.activations, measured['activations']):>8}"
            f"{step_peak / MiB:>17.1f}{measured['step_peak'] / MiB:>8.1f}{_err(step_peak, measured['step_peak']):>8}"
            f"{measured['step_s']:>8.2f}"
        )
    print(
        f"parameter counts: planner == model.parameters() for every row (else flagged above); peak counter: {counter}"
    )
    print(
        "largest |err|: "
        + ", ".join(f"{term} {value:.1%}" for term, value in worst.items())
        + f"; total {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
