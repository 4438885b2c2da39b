"""Stage train: LoRA fine-tuning of the base model on the packed shards, under accelerate.

    python -m fineflow.stages.train --shards data/shards --base-dir models/base \
        --checkpoints checkpoints --out models/candidate --steps-log reports/train_steps.jsonl

Run plainly, this process is the launcher: it re-executes the same module under ``accelerate launch``
with ``train.num_processes`` ranks (see fineflow.launch). Each rank then runs ``worker()``; only rank 0
writes the adapter, checkpoints, step log and report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fineflow.basemodel import resolve_base_model
from fineflow.config import Params
from fineflow.launch import WORKER_ENV, accelerate_command
from fineflow.stages._entry import log, run_stage, stage_parser


def build_lora_model(base_reference: str, params: Params):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(params.seed)
    model = AutoModelForCausalLM.from_pretrained(base_reference, dtype=torch.float32)
    lora = params.train.lora
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def worker(params: Params, shards: Path, base_dir: Path, checkpoints: Path, out_dir: Path,
           steps_log: Path) -> dict | None:
    """One rank of training; returns the report on rank 0 and None elsewhere."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from fineflow.loader import BatchLoader
    from fineflow.shards import PackedShard, RowSampler
    from fineflow.training import Checkpointer, StepLog, StepTimer, fit, lr_multiplier, save_adapter

    cfg = params.train
    accelerator = Accelerator()
    set_seed(params.seed)
    model = build_lora_model(resolve_base_model(params.model, base_dir), params)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, cfg.warmup_steps, cfg.steps, cfg.schedule))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    train, evaluation = PackedShard(shards / "train"), PackedShard(shards / "eval")
    sampler = RowSampler(len(train), params.seed, accelerator.process_index, accelerator.num_processes,
                         row_tokens=train.real_per_row)
    batches = BatchLoader(train, sampler, cfg.micro_batch_size, cfg.grad_accum, cfg.steps,
                          pin_memory=accelerator.device.type == "cuda")
    main = accelerator.is_main_process
    if main:
        log(f"training LoRA r={cfg.lora.r}: {trainable:,} trainable parameters on "
            f"{accelerator.num_processes} process(es), device {accelerator.device}")
    timer = StepTimer()
    step_log = StepLog(steps_log if main else None)
    try:
        result = fit(model, optimizer, scheduler, accelerator, batches, cfg, timer, step_log,
                     Checkpointer(checkpoints if main else None, cfg.checkpoint_every), evaluation, log=log)
    finally:
        batches.close()
        step_log.close()
    accelerator.wait_for_everyone()
    if not main:
        return None
    save_adapter(accelerator.unwrap_model(model), out_dir)
    totals = result.timer.totals
    return {"steps": result.steps, "final_loss": round(result.final_loss, 5),
            "eval_loss": round(result.eval_loss, 5) if result.eval_loss is not None else None,
            "tokens": result.tokens, "tokens_per_s": round(result.tokens / result.wall_s, 1),
            "world_size": accelerator.num_processes, "trainable_parameters": trainable,
            "loop_s": round(result.wall_s, 3), **{k: round(v, 3) for k, v in totals.items()},
            "data_wait_share": round(totals["data_wait_s"] / result.wall_s, 5)}


def launch(params: Params, argv: list[str]) -> int:
    """Re-run this module under accelerate launch with train.num_processes ranks."""
    import torch

    command, env = accelerate_command(params.train.num_processes, torch.cuda.is_available(),
                                      "fineflow.stages.train", argv)
    log(f"launching {params.train.num_processes} process(es): {' '.join(command[2:])}")
    return subprocess.run(command, env={**os.environ, **env}).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = stage_parser("train", __doc__)
    parser.add_argument("--shards", type=Path, required=True)
    parser.add_argument("--base-dir", type=Path, required=True)
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps-log", type=Path, required=True)
    args = parser.parse_args(argv)
    if os.environ.get(WORKER_ENV) != "1":
        from fineflow.config import load_params
        from fineflow.errors import FineflowError

        try:
            params = load_params(args.params)
        except FineflowError as exc:
            print(f"fineflow train: error: {exc}", file=sys.stderr)
            return 2
        return launch(params, argv)
    return run_stage("train", args, lambda p: worker(p, args.shards, args.base_dir, args.checkpoints,
                                                      args.out, args.steps_log))


if __name__ == "__main__":
    raise SystemExit(main())
