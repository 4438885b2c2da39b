"""A train rank for tests/test_accumulation.py: fit() on a project's params under whatever backend `accelerate launch`
gives it, DeepSpeed on the CPU included. Rank 0 writes the step log and what the backend did to <out>.

    DS_ACCELERATOR=cpu accelerate launch --config_file <DeepSpeed profile> -m tests.deepspeed_worker <project> <out>

The rank is built as fineflow.train.recipe.train_rank builds it (fit_plan, the Accelerator with train.grad_accum,
configure_deepspeed before prepare, the same model, optimizer, schedule and sampler), without checkpoints and the
final save: those store DeepSpeed's optimizer state, which is the sharded-checkpoint work, not accumulation's.

DeepSpeed runs its real engine here (ZeRO partitioning, its accumulation boundary, its clipping) over gloo. Two
patches make that possible without CUDA, neither in the maths:
- accelerate derives its process group from the device: with no CUDA it starts DeepSpeed with no backend and every
  rank as process 0 of 1. It is given gloo and a multi-process state instead (nccl on GPUs), with the CPU as device;
- DeepSpeed's CPU accelerator would first JIT-compile a shared-memory all-reduce kernel (minutes on 2 cores); its
  collectives go through torch.distributed's gloo instead.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def run_deepspeed_on_cpu() -> None:
    import deepspeed.comm.torch
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        return "gloo", DistributedType.MULTI_GPU

    def set_device(self):
        if self.device is None:
            self.device = torch.device("cpu")

    PartialState._prepare_backend = prepare_backend
    PartialState.set_device = set_device
    deepspeed.comm.torch.build_shm_op = lambda: None


def train(project: Path, out: Path) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, set_seed

    from fineflow.config import load_params
    from fineflow.tokenize.shards import PackedShard, RowSampler
    from fineflow.train.launch import DEEPSPEED_FROM_PARAMS, configure_deepspeed
    from fineflow.train.loader import BatchLoader
    from fineflow.train.loop import StepLog, StepTimer, TrainStateSaver, fit
    from fineflow.train.model import build_model
    from fineflow.train.schedule import build_scheduler
    from fineflow.train.sizing import fit_plan

    params = load_params(project / "params.yaml")
    reference = str(project / "models/base")
    cfg, _, _ = fit_plan(params, reference, has_gpu=False)
    accelerator = Accelerator(mixed_precision=cfg.precision, gradient_accumulation_steps=cfg.grad_accum)
    configure_deepspeed(accelerator, cfg)
    set_seed(params.seed)
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    zero3 = deepspeed and accelerator.state.deepspeed_plugin.zero_stage == 3
    model = build_model(reference, params, cfg, fuse_lora=cfg.fused_lora and not zero3)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True
    )
    scheduler = build_scheduler(optimizer, cfg)
    model, optimizer = accelerator.prepare(model, optimizer)
    shard = PackedShard(project / "data/shards/train")
    rank, world = accelerator.process_index, accelerator.num_processes
    sampler = RowSampler(len(shard), params.seed, rank, world, row_tokens=shard.real_per_row)
    batches = BatchLoader(
        shard, sampler, cfg.micro_batch_size, cfg.grad_accum, cfg.steps, prefetch=0, varlen=cfg.attention == "varlen"
    )
    main = accelerator.is_main_process
    step_log = StepLog(out / "train_steps.jsonl" if main else None)
    try:
        fit(model, optimizer, scheduler, accelerator, batches, cfg, StepTimer(), step_log, TrainStateSaver(None, 10**9))
    finally:
        step_log.close()
        batches.close()
    if main:
        engine = accelerator.deepspeed_engine_wrapped.engine if deepspeed else None
        record = {
            "distributed_type": accelerator.distributed_type.value,
            "world_size": world,
            "engine_steps": engine.global_steps if engine else None,  # optimizer steps DeepSpeed's engine took
            "deepspeed_config": {key: accelerator.deepspeed_config[key] for key in DEEPSPEED_FROM_PARAMS}
            if deepspeed
            else None,
        }
        (out / "worker.json").write_text(json.dumps(record), encoding="utf-8")
    accelerator.end_training()


if __name__ == "__main__":
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and os.environ.get("DS_ACCELERATOR") == "cpu":
        run_deepspeed_on_cpu()
    train(Path(sys.argv[1]), Path(sys.argv[2]))
