"""What DeepSpeed (ZeRO-2/3) needs beyond accelerate's defaults: its training state in checkpoints, and an
adapter-only final save.

A ZeRO engine's state is not a model's parameters plus ``optimizer.state_dict()``: the fp32 master weights and the
AdamW moments are flat partitions spread over the ranks (ZeRO-2 and 3), the module's parameters themselves are
partitions under ZeRO-3 (``named_parameters()`` gives empty tensors), and the optimizer wrapper holds a loss scaler
that torch cannot pickle as a state dict. So, like FSDP's shards (fineflow.train.fsdp), every rank writes its own
part with DeepSpeed's own ``save_checkpoint`` into a staging directory that rank 0's CheckpointManager hashes and
publishes atomically (``step-N/sharded/``), and every rank reads its part back with ``load_checkpoint``, which
restores the master weights, the moments, the loss scale and the engine's step counters exactly. fineflow keeps
what it owns itself (the LR schedule, the sampler, each rank's RNG) in its own files as for any other run.

The frozen base is never part of it (``exclude_frozen_parameters``): it comes from the base model, as in every
fineflow checkpoint. The final LoRA adapter is gathered from the fp32 master weights, trainable parameters only:
accelerate's ``get_state_dict`` under ZeRO-3 would gather the whole 16-bit model onto rank 0 first.
"""

from __future__ import annotations

import os
from pathlib import Path

TAG = "engine"  # DeepSpeed writes its files into <staging>/<TAG>/ (and its zero_to_fp32.py beside them)


def is_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def save_engine_state(engine, directory: Path) -> None:
    """Every rank writes its part of the engine's state into directory (collective) and fsyncs what it wrote.
    engine: the model accelerator.prepare returned (a DeepSpeedEngine)."""
    engine.save_checkpoint(str(directory), tag=TAG, client_state={}, save_latest=False, exclude_frozen_parameters=True)
    _fsync_tree(directory)


def load_engine_state(engine, directory: Path) -> None:
    """Every rank reads its part back (collective): master weights, optimizer moments, loss scale, step counters.
    The frozen base is not in it (not strict); fineflow's scheduler is restored by fineflow, not by the engine."""
    _, client_state = engine.load_checkpoint(
        str(directory),
        tag=TAG,
        load_module_strict=False,
        load_optimizer_states=True,
        load_lr_scheduler_states=False,
    )
    if client_state is None:
        from fineflow.errors import FineflowError

        raise FineflowError(f"{directory}: DeepSpeed found no engine state under {TAG}/ to resume from")


def gather_trainable(engine) -> dict:
    """The trainable parameters as full fp32 CPU tensors on rank 0 ({} elsewhere); collective under ZeRO-3.
    Taken from the optimizer's fp32 master copies (the module's own may be 16-bit), trainable ones alone."""
    from deepspeed.utils import safe_get_full_fp32_param

    rank0 = engine.global_rank == 0
    state = {}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            full = safe_get_full_fp32_param(param)  # every rank calls it: under ZeRO-3 it is an all-gather
            if rank0:
                state[name] = full.detach().to("cpu", copy=True)
    return state


def _fsync_tree(directory: Path) -> None:
    """DeepSpeed's torch.save does not fsync: a checkpoint is only published once its bytes are on disk."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
