"""GPU benchmark: LoRA on a randomly initialized ~0.9B Llama for ~2 minutes, fed through fineflow's shards.

    python bench/gpu.py                 # on a GPU machine: 2 min measured, ~3 min in all (estimated)
    bash bench/gpu.sh                   # the same under a 9-minute timeout (installs nothing)
    python bench/gpu.py --smoke         # CPU, tiny config, a few steps: proves the script end to end

Prints tokens/s, MFU, peak memory and data-wait share as a readable block, then one JSON line.

The model is Llama-architecture (hidden 2048, 16 layers, 16 heads, 8 KV heads, MLP 5632, vocab 32000:
0.90B parameters), built directly on the GPU in bf16 with random weights (no download). LoRA (peft, r=16)
sits on every attention and MLP projection. The data path is fineflow's: random token examples of mixed
length are packed into rows of --seq-len, written with ``fineflow.tokenize.shards.write_shard`` to a temp dir, read
back through the memory-mapped ``PackedShard.batch`` in the order of the seeded ``RowSampler``, and the loss
is ``fineflow.train.loop.token_loss_sum`` (packed rows: position ids restart per example, so attention stays
within each example; ``--attention varlen``, the default as in train.attention, computes it per example
with fineflow.train.attention instead of over a dense row mask). The step loop mirrors ``fit()``'s timing
split: data wait (sample, gather from the memory map, copy to the GPU), forward+backward, optimizer.

MFU = model FLOPs per second / the chip's dense bf16 peak. Model FLOPs per token, for LoRA:

    4 * N_base + 6 * N_lora + 12 * layers * hidden * seq_len

N_base counts the frozen matmul weights (every projection and the LM head; not the embedding lookup): forward
2N, backward 2N for the activation gradients, no weight gradients. The adapters train fully (6N). The last
term is attention's score and value matmuls, forward and backward (the PaLM convention: the causal or
per-example mask is not discounted). Full fine-tuning would be 6 * N + 12 * layers * hidden * seq_len.
Recomputation under --grad-checkpointing is not counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# dense (no 2:4 sparsity) bf16 tensor-core peaks, TFLOPS; first match on torch.cuda.get_device_name wins
PEAK_BF16_TFLOPS = [
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
]
FULL = dict(hidden=2048, layers=16, heads=16, kv_heads=8, intermediate=5632, vocab=32000, seq_len=2048)
SMOKE = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, seq_len=128)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peak_tflops_for(device_name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


def model_flops_per_token(n_base: int, n_lora: int, layers: int, hidden: int, seq_len: int) -> int:
    """See the module docstring: frozen matmuls 4N, trained adapters 6N, attention 12 * L * h * s."""
    return 4 * n_base + 6 * n_lora + 12 * layers * hidden * seq_len


def build_model(shape: dict, device, lora_r: int, grad_checkpointing: bool, attention: str = "varlen"):
    """Random-weight Llama in bf16, created on device (no CPU init of 0.9B parameters), with LoRA."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fineflow.train.attention import register

    implementation = register() if attention == "varlen" else attention  # train.attention's choices
    config = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=shape["seq_len"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=implementation)
    if grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lora = LoraConfig(
        r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, lora).to(device)


def count_params(model) -> dict:
    """Parameters by role: frozen matmul weights (N_base), LoRA weights (N_lora), everything."""
    import torch

    n_base = n_lora = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            if ".lora_" in name:
                n_lora += module.weight.numel()
            else:
                n_base += module.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"n_base_matmul": n_base, "n_lora": n_lora, "total": total, "trainable": trainable}


def write_random_shard(out_dir: Path, rows: int, seq_len: int, vocab: int, seed: int) -> None:
    """Rows packed with random-token examples of mixed length (positions restart per example, the last
    two thirds of each example trained), written with fineflow's shard writer.

    The packing here is a plain left-to-right fill (the example that would overflow is cut to the space
    left, as truncation would): the benchmark needs rows shaped like the tokenize stage's, not its packer.
    """
    import numpy as np

    from fineflow.tokenize.shards import PackedArrays, token_dtype, write_shard

    rng = np.random.default_rng(seed)
    tokens = np.zeros((rows, seq_len), dtype=token_dtype(vocab))
    mask = np.zeros((rows, seq_len), dtype=np.uint8)
    positions = np.zeros((rows, seq_len), dtype=np.uint16)
    examples = []
    for r in range(rows):
        start = 0
        while True:
            if seq_len - start < 8:
                break  # a sliver stays padding, as in real packed rows
            n = min(int(rng.integers(max(2, seq_len // 16), max(3, seq_len * 3 // 4))), seq_len - start)
            tokens[r, start : start + n] = rng.integers(4, vocab, size=n)
            mask[r, start + n // 3 : start + n] = 1
            positions[r, start : start + n] = np.arange(n)
            examples.append((r, start, n))
            start += n
        positions[r, start:] = np.arange(seq_len - start)  # padding is its own segment, never trained
    arrays = PackedArrays(tokens, mask, positions, np.asarray(examples, dtype=np.int64).reshape(-1, 3))
    write_shard(out_dir, arrays, {"vocab_size": vocab, "source": "bench/gpu.py random tokens"})


def to_tensors(batch: dict) -> dict:
    import torch

    return {key: torch.from_numpy(array) for key, array in batch.items()}


def run(shape: dict, args, device) -> dict:
    import torch

    from fineflow.tokenize.shards import PackedShard, RowSampler
    from fineflow.train.attention import layout_kwargs, packed_layout
    from fineflow.train.loop import token_loss_sum

    cuda = device.type == "cuda"
    t_setup = time.perf_counter()
    model = build_model(shape, device, args.lora_r, args.grad_checkpointing, args.attention)
    params = count_params(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=cuda)
    model.train()
    with tempfile.TemporaryDirectory(prefix="fineflow-gpu-bench-") as tmp:
        write_random_shard(Path(tmp) / "train", args.pool_rows, shape["seq_len"], shape["vocab"], seed=0)
        shard = PackedShard(Path(tmp) / "train")
        sampler = RowSampler(len(shard), seed=0)
        setup_s = time.perf_counter() - t_setup

        def step(micro: int) -> tuple[float, float, float, int, float]:
            t0 = time.perf_counter()
            rows = sampler.next_indices(micro)
            arrays = shard.batch(rows)
            batch = {k: v.to(device, non_blocking=True) for k, v in to_tensors(arrays).items()}
            extra = layout_kwargs(packed_layout(arrays["position_ids"]), device) if args.attention == "varlen" else {}
            real = shard.real_tokens(rows)
            t1 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss_sum, n = token_loss_sum(model, batch, **extra)
            (loss_sum / max(1, n)).backward()
            loss = loss_sum.item() / max(1, n)  # a host sync per step, as fit() has
            t2 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            t3 = time.perf_counter()
            return t1 - t0, t2 - t1, t3 - t2, real, loss

        micro = args.micro_batch or (
            1 if not cuda else 16 if torch.cuda.get_device_properties(device).total_memory > 100e9 else 8
        )
        # warm-up: kernel selection and allocator growth; halve the micro-batch on out-of-memory
        while True:
            try:
                for _ in range(args.warmup_steps):
                    step(micro)
                break
            except torch.cuda.OutOfMemoryError:
                optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                if micro == 1:
                    raise
                print(f"out of memory at micro-batch {micro}; retrying with {micro // 2}", flush=True)
                micro //= 2
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        totals = {"data_wait_s": 0.0, "compute_s": 0.0, "optimizer_s": 0.0}
        steps, real_tokens, losses = 0, 0, []
        started = time.perf_counter()
        while True:
            wait, compute, opt, real, loss = step(micro)
            totals["data_wait_s"] += wait
            totals["compute_s"] += compute
            totals["optimizer_s"] += opt
            steps += 1
            real_tokens += real
            losses.append(loss)
            elapsed = time.perf_counter() - started
            if (args.steps and steps >= args.steps) or (not args.steps and elapsed >= args.seconds):
                break
    tokens = steps * micro * shape["seq_len"]  # computed tokens, padding included: what the GPU did
    flops_token = model_flops_per_token(
        params["n_base_matmul"], params["n_lora"], shape["layers"], shape["hidden"], shape["seq_len"]
    )
    achieved_tflops = flops_token * tokens / elapsed / 1e12
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = args.peak_tflops or (peak_tflops_for(name) if cuda else None)
    peak_mem = (
        torch.cuda.max_memory_allocated(device) if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )  # Linux: KiB
    return {
        "bench": "gpu_lora",
        "device": name,
        "smoke": args.smoke,
        "shape": shape,
        "attention": args.attention,
        "params_total": params["total"],
        "params_trainable": params["trainable"],
        "n_base_matmul": params["n_base_matmul"],
        "n_lora": params["n_lora"],
        "lora_r": args.lora_r,
        "micro_batch": micro,
        "seq_len": shape["seq_len"],
        "grad_checkpointing": args.grad_checkpointing,
        "steps": steps,
        "measured_s": round(elapsed, 3),
        "setup_s": round(setup_s, 3),
        "tokens_per_s": round(tokens / elapsed, 1),
        "real_tokens_per_s": round(real_tokens / elapsed, 1),
        "real_token_share": round(real_tokens / max(1, tokens), 4),
        "flops_per_token": flops_token,
        "achieved_tflops": round(achieved_tflops, 2),
        "peak_bf16_tflops": peak,
        "mfu": round(achieved_tflops / peak, 4) if peak else None,
        "peak_memory_gib": round(peak_mem / 2**30, 3),
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if cuda else "process max RSS",
        "data_wait_share": round(totals["data_wait_s"] / elapsed, 5),
        "compute_share": round(totals["compute_s"] / elapsed, 4),
        "optimizer_share": round(totals["optimizer_s"] / elapsed, 4),
        "step_s_mean": round(elapsed / steps, 4),
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "finite_loss": all(math.isfinite(x) for x in losses),
    }


def report(r: dict) -> str:
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a (unknown chip: pass --peak-tflops)"
    peak = f"{r['peak_bf16_tflops']:g} TFLOPS bf16" if r["peak_bf16_tflops"] else "unknown"
    return "\n".join(
        [
            f"fineflow GPU benchmark{' (SMOKE: tiny config, not a measurement)' if r['smoke'] else ''}",
            f"  device            {r['device']}  (peak {peak})",
            f"  model             Llama {r['params_total'] / 1e6:,.1f}M params, LoRA r={r['lora_r']}: "
            f"{r['params_trainable']:,} trainable",
            f"  batch             {r['micro_batch']} x {r['seq_len']} packed tokens"
            f"{', gradient checkpointing' if r['grad_checkpointing'] else ''}",
            f"  measured          {r['steps']} steps in {r['measured_s']:.1f} s "
            f"({r['step_s_mean'] * 1000:.1f} ms/step; "
            f"setup {r['setup_s']:.1f} s)",
            f"  tokens/s          {r['tokens_per_s']:,.0f} computed, {r['real_tokens_per_s']:,.0f} real (non-pad, "
            f"{100 * r['real_token_share']:.1f}%)",
            f"  MFU               {mfu}  ({r['achieved_tflops']:.1f} TFLOPS achieved, "
            f"{r['flops_per_token'] / 1e9:.2f} GFLOP/token)",
            f"  peak memory       {r['peak_memory_gib']:.2f} GiB ({r['peak_memory_kind']})",
            f"  data wait         {100 * r['data_wait_share']:.2f}% of step time "
            f"(compute {100 * r['compute_share']:.1f}%, optimizer {100 * r['optimizer_share']:.1f}%)",
            f"  loss              {r['loss_first']:.3f} -> {r['loss_last']:.3f} (random tokens: ~ln(vocab))",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="measured training time (after warm-up)")
    parser.add_argument("--steps", type=int, default=0, help="measure exactly this many steps instead")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="packed rows per step (default: 16 above 100 GB of GPU memory, else 8; halved on OOM)",
    )
    parser.add_argument("--seq-len", type=int, default=0, help="packed row length (default 2048)")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--pool-rows", type=int, default=0, help="rows in the random shard (cycled by epoch)")
    parser.add_argument("--grad-checkpointing", action="store_true")
    parser.add_argument(
        "--attention",
        choices=("varlen", "sdpa", "flash_attention_2"),
        default="varlen",
        help="as train.attention (varlen: per-example attention, fineflow.train.attention)",
    )
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="override the chip's dense bf16 peak")
    parser.add_argument("--smoke", action="store_true", help="tiny config, a few steps, CPU allowed")
    args = parser.parse_args(argv)

    import torch

    shape = dict(SMOKE if args.smoke else FULL)
    if args.seq_len:
        shape["seq_len"] = args.seq_len
    if args.smoke:
        args.steps = args.steps or 4
        args.warmup_steps = min(args.warmup_steps, 1)
        args.pool_rows = args.pool_rows or 16
    else:
        args.pool_rows = args.pool_rows or 1024
        if not torch.cuda.is_available():
            print("bench/gpu.py: no CUDA GPU visible; use --smoke to check the script on CPU", file=sys.stderr)
            return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = run(shape, args, device)
    print(report(result))
    print(json.dumps(result, sort_keys=True))
    return 0 if result["finite_loss"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
