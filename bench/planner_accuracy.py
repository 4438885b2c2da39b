"""Planner accuracy on CPU: fineflow.train.planner's weight and activation terms against measured memory, for
the tiny model and a ~50M-parameter Llama, side by side in one run.

    .venv/bin/python bench/planner_accuracy.py [--threads 2]

Each row runs in a fresh process (nothing left over from the previous row): build the model (fp32,
transformers 5 LlamaForCausalLM, attn_implementation as listed: SDPA unless the row says eager), run one
forward+backward with fineflow's loss (the same lines as fineflow.train.loop.token_loss_sum), and measure:

- weights: the process's resident memory (VmRSS) just before and just after building the model (and
  wrapping it with peft for the LoRA row). A throwaway model is built first so that transformers' lazy
  imports and torch's one-time allocations are not counted.
- activations: a small warm-up step first allocates the gradients (kept, zeroed, so the measured step
  allocates none) and the kernels' one-time buffers; then the peak resident memory is reset (writing 5 to
  /proc/self/clear_refs resets VmHWM) and the measured step's peak (VmHWM) minus the resident memory before
  it is the activation memory, loss included. Falls back to ru_maxrss when clear_refs is not writable.
- glibc's malloc is told to serve every block over 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_), so a freed
  tensor leaves resident memory at once and RSS tracks live tensors instead of the heap's high-water mark.

Predictions come from fineflow.train.planner with the settings actually run: precision fp32, the attention
implementation of the row, method full (LoRA r=16 on all seven linears for the LoRA row), the model's
LlamaConfig passed through shape_from_config. Overhead (CUDA context, fragmentation) is not compared.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
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
# (label, config, method, micro-batch, seq_len, gradient checkpointing, attention, packed rows)
CASES = [
    ("tiny", TINY, "full", 4, 128, False, "sdpa", False),
    ("tiny", TINY, "full", 8, 256, False, "sdpa", False),
    ("tiny", TINY, "full", 8, 256, True, "sdpa", False),
    ("tiny", TINY, "full", 8, 256, False, "eager", False),
    ("tiny", TINY, "full", 8, 256, False, "sdpa", True),
    ("50M", FIFTY_M, "full", 2, 256, False, "sdpa", False),
    ("50M", FIFTY_M, "full", 2, 512, False, "sdpa", False),
    ("50M", FIFTY_M, "full", 2, 512, True, "sdpa", False),
    ("50M", FIFTY_M, "lora", 2, 512, False, "sdpa", True),
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
    """fineflow.train.loop.token_loss_sum's loss (summed next-token cross-entropy, fp32), every token trained."""
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


def child(case: dict, threads: int) -> dict:
    """Build, warm up and measure one case in this (fresh) process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    config = case["config"]

    def build():
        model = LlamaForCausalLM(
            LlamaConfig(**config, max_position_embeddings=4096, attn_implementation=case["attention"])
        )
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
    if case["checkpointing"]:
        model.activation_checkpointing_enable()
    model.train()

    ids, positions = _batch(config["vocab_size"], 1, 16, case["packed"], seed=1)
    _loss(model, ids, positions).backward()  # allocates every gradient and the kernels' one-time buffers
    model.zero_grad(set_to_none=False)
    ids, positions = _batch(config["vocab_size"], case["batch"], case["seq_len"], case["packed"], seed=2)
    gc.collect()
    base = _status_bytes("VmRSS")
    counter = _reset_peak()
    started = time.perf_counter()
    _loss(model, ids, positions).backward()
    step_s = time.perf_counter() - started
    activations = _peak(counter) - base
    return {
        "weights": weights,
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
        precision="fp32",
        micro_batch_size=case["batch"],
        seq_len=case["seq_len"],
        gradient_checkpointing=case["checkpointing"],
        attention=case["attention"],
        lora_r=LORA_R,
        lora_targets=LINEARS,
        packed=case["packed"],
    )
    return shape, plan(shape, setup)


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
        f"planner vs measured on CPU: fp32, fresh process per row, {args.threads} threads; MiB; "
        "err = (predicted - measured) / measured"
    )
    print(
        f"{'model':<6}{'method':<7}{'b x s':>10}  {'ckpt':<5}{'attn':<6}{'rows':<7}"
        f"{'weights: pred':>14}{'meas':>8}{'err':>8}   {'activations: pred':>18}{'meas':>9}{'err':>8}{'step s':>8}"
    )
    worst = {"weights": 0.0, "activations": 0.0}
    for label, config, method, batch, seq_len, checkpointing, attention, packed in CASES:
        case = {
            "label": label,
            "config": config,
            "method": method,
            "batch": batch,
            "seq_len": seq_len,
            "checkpointing": checkpointing,
            "attention": attention,
            "packed": packed,
        }
        shape, predicted = predict(case)
        measured = measure(case, args.threads)
        params = shape.params + (predicted.trainable_params if method == "lora" else 0)  # peft adds adapters
        if measured["params"] != params or measured["trainable"] != predicted.trainable_params:
            print(
                f"  ! parameter counts differ: measured {measured['params']:,} / {measured['trainable']:,} "
                f"trainable, planner {params:,} / {predicted.trainable_params:,}"
            )
        for term in ("weights", "activations"):
            worst[term] = max(worst[term], abs(getattr(predicted, term) - measured[term]) / measured[term])
        print(
            f"{label:<6}{method:<7}{f'{batch} x {seq_len}':>10}  {'yes' if checkpointing else 'no':<5}"
            f"{attention:<6}{'packed' if packed else 'plain':<7}"
            f"{predicted.weights / MiB:>14.1f}{measured['weights'] / MiB:>8.1f}"
            f"{_err(predicted.weights, measured['weights']):>8}   "
            f"{predicted.activations / MiB:>18.1f}{measured['activations'] / MiB:>9.1f}"
            f"{_err(predicted.activations, measured['activations']):>8}{measured['step_s']:>8.2f}"
        )
    print(
        f"parameter counts: planner == model.parameters() for every row (else flagged above); peak counter: "
        f"{measured['counter']}"
    )
    print(
        f"largest |err|: weights {worst['weights']:.1%}, activations {worst['activations']:.1%}; "
        f"total {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
