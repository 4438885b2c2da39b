"""``fineflow plan``: the GPU memory planner (fineflow.train.planner) from the command line; format_plan and
format_table print its plans."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    from fineflow.train.planner import KNOWN_SHAPES, METHODS, OPTIMIZERS, PRECISIONS, SHARDINGS

    p = sub.add_parser(
        "plan",
        help="predict peak GPU memory per device before launching a run",
        description="Predict peak GPU memory per device: weights, gradients, optimizer "
        "states, activations, overhead (conventions: fineflow/train/planner/memory.py).",
    )
    p.add_argument(
        "--model",
        default="7B",
        help=f"a known size ({', '.join(KNOWN_SHAPES)}), a recipe's hub id (e.g. Qwen/Qwen3-8B: sized without "
        "downloading), a parameter count, a config.json or a model directory (default: 7B)",
    )
    p.add_argument("--method", choices=METHODS, default="lora")
    p.add_argument("--precision", choices=tuple(PRECISIONS), default="bf16")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--micro-batch", type=int, default=1, help="rows per device per forward (default: 1)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per row (default: 2048)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--gpus", type=int, default=1, help="data-parallel ranks (default: 1)")
    p.add_argument(
        "--sharding",
        choices=SHARDINGS,
        default="none",
        help="none: DDP; zero2: gradients+optimizer sharded; fsdp/zero3: everything sharded",
    )
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument(
        "--lora-targets",
        default="all-linear",
        help="comma-separated linears (q_proj,v_proj,...: the model's names, or Llama's for a fused qkv/gate_up) or "
        "all-linear (default: every linear of the model's decoder layer)",
    )
    _plan_layout_args(p)
    p.add_argument("--device-gib", type=float, help="device memory in GiB: say whether the plan fits")
    p.add_argument(
        "--auto-fit",
        action="store_true",
        help="with --device-gib: enable gradient checkpointing, then lower the micro-batch, until it fits",
    )
    p.add_argument("--table", action="store_true", help="print full/lora/qlora for every known size")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=_run_plan)


def _plan_layout_args(p) -> None:
    """What the run does with its rows and weights: the attention kind, packing, the dtype weights are held in."""
    from fineflow.train.planner import ATTENTIONS, WEIGHT_STORAGES

    p.add_argument(
        "--attention",
        choices=(*ATTENTIONS, "flash"),
        default="varlen",
        help="train.attention's kind: varlen (default, as params.yaml) and flash (flash_attention_2) attend per "
        "example; sdpa keeps a row mask and expanded k/v per layer; eager the full score matrix",
    )
    p.add_argument(
        "--base-dtype",
        choices=WEIGHT_STORAGES,
        default="compute",
        help="how the weights are held: compute (the precision's; LoRA bases, FSDP2) or fp32 (cast as layers "
        "run: full fine-tuning under DDP/FSDP autocast, an FSDP1 LoRA base)",
    )
    p.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=1024,
        help="train.loss_chunk_tokens: the loss projects this many tokens onto the vocabulary at a time, so the "
        "logits never exist whole (default 1024, as params.yaml; 0: all tokens at once)",
    )
    p.add_argument(
        "--packed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rows hold several examples behind an attention mask, as fineflow packs them (default)",
    )


def _setup_from_args(args):
    from fineflow.train.planner import Setup

    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())  # "all-linear": every linear
    return Setup(
        method=args.method,
        precision=args.precision,
        optimizer=args.optimizer,
        micro_batch_size=args.micro_batch,
        seq_len=args.seq_len,
        grad_accum=args.grad_accum,
        gradient_checkpointing=args.gradient_checkpointing,
        num_gpus=args.gpus,
        sharding=args.sharding,
        lora_r=args.lora_r,
        lora_targets=targets,
        attention="flash_attention_2" if args.attention == "flash" else args.attention,
        packed=args.packed,
        weight_storage=args.base_dtype,
        loss_chunk_tokens=args.loss_chunk_tokens,
    )


def _describe_setup(setup) -> str:
    return (
        f"{setup.precision}, {setup.optimizer}, micro-batch {setup.micro_batch_size} x seq {setup.seq_len}, "
        f"gradient checkpointing {'on' if setup.gradient_checkpointing else 'off'}, {setup.num_gpus} GPU(s), "
        f"sharding {setup.sharding}, attention {setup.attention}, {'packed' if setup.packed else 'plain'} rows, "
        f"weights held in {'fp32' if setup.weight_storage == 'fp32' else setup.precision}, loss "
        f"{f'chunked by {setup.loss_chunk_tokens} tokens' if setup.loss_chunk_tokens else 'over all tokens'}"
    )


def format_plan(result, device_bytes: float | None = None) -> str:
    """A plan as an aligned breakdown in GiB, with the verdict when the device size is known."""
    from fineflow.train.planner import FRAGMENTATION, GiB

    s = result.setup
    method = s.method if s.method == "full" else f"{s.method} r={s.lora_r} on {', '.join(s.lora_targets)}"
    lines = [
        (f"{result.model}: {result.params / 1e9:.2f}B parameters, {method}, {result.trainable_params:,} trainable"),
        _describe_setup(s),
        "",
    ]
    rows = [
        ("weights", result.weights, ""),
        ("gradients", result.gradients, ""),
        (
            "optimizer states",
            result.optimizer_states,
            "incl. fp32 master weights" if s.method == "full" and s.precision != "fp32" else "",
        ),
        ("activations", result.activations, f"of which loss over the vocabulary {result.logits / GiB:.2f} GiB"),
        ("overhead", result.overhead, f"CUDA context/NCCL + {FRAGMENTATION:.0%} fragmentation"),
    ]
    if result.optimizer_step > result.activations:
        rows.append(("optimizer step", result.optimizer_step, "temporaries in step(), larger than activations"))
    lines += [f"  {name:<17}{value / GiB:>9.2f} GiB   {note}".rstrip() for name, value, note in rows]
    lines.append(f"  {'total':<17}{result.total / GiB:>9.2f} GiB per device")
    if device_bytes is not None:
        verdict = "fits in" if result.fits(device_bytes) else "does NOT fit in"
        lines.append(f"{verdict} {device_bytes / GiB:.1f} GiB ({result.total / device_bytes:.0%} of the device)")
    return "\n".join(lines)


def format_table(setup, device_bytes: float | None = None) -> str:
    """full/lora/qlora for every known size with setup's other settings, GiB per device."""
    from dataclasses import replace

    from fineflow.train.planner import KNOWN_SHAPES, METHODS, GiB, plan

    header = (
        f"{'model':<14}{'params':>8}  {'method':<6}{'weights':>9}{'grads':>8}{'optim':>8}{'activ':>8}"
        f"{'opt.step':>10}{'overhead':>10}{'total':>9}"
    )
    fits_col = f"  fits {device_bytes / GiB:g} GiB" if device_bytes is not None else ""
    lines = [
        (f"GiB per device; {_describe_setup(setup)}; LoRA r={setup.lora_r} on {', '.join(setup.lora_targets)}"),
        "total = weights + grads + optim + max(activ, opt.step) + overhead",
        header + fits_col,
        "-" * len(header + fits_col),
    ]
    for shape in KNOWN_SHAPES.values():
        for method in METHODS:
            r = plan(shape, replace(setup, method=method))
            row = (
                f"{shape.name:<14}{shape.params / 1e9:>7.2f}B  {method:<6}{r.weights / GiB:>9.1f}"
                f"{r.gradients / GiB:>8.1f}{r.optimizer_states / GiB:>8.1f}{r.activations / GiB:>8.1f}"
                f"{r.optimizer_step / GiB:>10.1f}{r.overhead / GiB:>10.1f}{r.total / GiB:>9.1f}"
            )
            lines.append(row + (f"  {'yes' if r.fits(device_bytes) else 'no'}" if fits_col else ""))
    return "\n".join(lines)


def _run_plan(args) -> int:
    from fineflow.train.planner import (
        DoesNotFit,
        GiB,
        auto_fit,
        load_shape,
        plan,
        what_to_change,
    )

    setup = _setup_from_args(args)
    device = args.device_gib * GiB if args.device_gib else None
    if args.table:
        print(format_table(setup, device))
        return 0
    shape = load_shape(args.model)
    result, changes = plan(shape, setup), []
    if device is not None and args.auto_fit:
        try:
            fitted = auto_fit(shape, setup, device)
        except DoesNotFit as exc:
            print(format_plan(result, device))
            print(f"refused: {exc}")
            return 1
        result, changes = fitted.plan, fitted.changes
    if args.json:
        print(
            json.dumps(
                {**result.as_dict(), "changes": changes, "fits": result.fits(device) if device else None}, indent=2
            )
        )
    else:
        print(format_plan(result, device))
        for change in changes:
            print(f"auto-fit: {change}")
        if device is not None and not result.fits(device):
            print(f"to fit: {what_to_change(shape, setup, device)}")
    return 0 if device is None or result.fits(device) else 1
