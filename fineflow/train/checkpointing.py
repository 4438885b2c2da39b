"""Checkpointing the loop's state: when to save and what (``TrainStateSaver``, handed to ``fit()``), and putting
a loaded checkpoint back in place (``restore``). Files, retention and verification are
``fineflow.checkpoint``'s; sharded state (FSDP, DeepSpeed) is written and read by every rank
(``fineflow.train.fsdp``, ``fineflow.train.zero``), chosen by the run's ``Profile.engine``.
"""

from __future__ import annotations

import time

from fineflow.errors import FineflowError
from fineflow.train import fsdp
from fineflow.train.profile import SHARDED_ENGINES


class TrainStateSaver:
    """Decides when to checkpoint and hands the loop's full state to a CheckpointManager.

    Every rank calls ``due`` and ``save`` (each contributes its RNG state, and ranks must agree on a
    time-based trigger); only rank 0 has a manager and writes. What is saved: the trainable tensors only
    (LoRA: the adapter), optimizer and LR-scheduler state, the sampler position of the last consumed batch,
    step and token counters, every rank's Python/NumPy/torch RNG state (fineflow.checkpoint), and the layout
    (ranks, accumulation) that wrote it.
    """

    def __init__(
        self,
        manager,
        every_steps: int,
        every_minutes: float | None = None,
        fingerprint: dict | None = None,
        *,
        engine: str,
    ):
        self.manager, self.every_steps, self.every_minutes = manager, every_steps, every_minutes
        self.fingerprint = fingerprint or {}
        self.engine = engine  # the run's Profile.engine: who holds the state, so who writes it
        self.last_save = time.monotonic()
        self._save_error: Exception | None = None  # rank 0's failed background save, raised on every rank

    def due(self, step: int, last_step: int, accelerator) -> bool:
        """The same answer on every rank (validation before a save is collective)."""
        due = step % self.every_steps == 0 or step == last_step
        if self.every_minutes is not None and not due:
            import torch

            late = time.monotonic() - self.last_save >= self.every_minutes * 60
            flag = accelerator.reduce(torch.tensor([int(late)], device=accelerator.device), reduction="sum")
            due = int(flag[0]) > 0  # any rank's clock decides, so no rank skips a collective the others enter
        return due

    def writer_failed(self) -> bool:
        """Whether rank 0's background save has failed (a full disk); never waits for one still writing. The
        loop rides the answer on its per-step loss all-reduce, so every rank stops at the same step boundary,
        within a step of the failed write rather than at the next save an interval later."""
        if self.manager is None or self._save_error is not None:
            return self._save_error is not None
        from fineflow.checkpoint import CheckpointError

        try:
            self.manager.check()
        except CheckpointError as exc:  # a crash (WriterCrashed) is not caught: it fails rank 0 with a traceback
            self._save_error = exc
        return self._save_error is not None

    def stop_on_failed_save(self, accelerator, last_step: int) -> None:
        """Raise rank 0's save error on every rank (one message, the same error record whichever rank writes
        it; no rank left in a collective whose peer has gone, which fails it with a traceback)."""
        from fineflow.checkpoint import CheckpointError

        message = [str(self._save_error) if self._save_error is not None else ""]
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(message, from_process=0)
        raise CheckpointError(
            f"{message[0]} Training stopped after step {last_step}; a retry resumes from the previous checkpoint."
        )

    def save(self, accelerator, model, optimizer, scheduler, step: int, state: dict, metric: float | None) -> None:
        from fineflow.checkpoint import capture_rng

        rngs = [capture_rng()]
        if accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            rngs = gather_object(rngs)  # one snapshot per rank, in rank order
        self.last_save = time.monotonic()
        sharded = self.engine in SHARDED_ENGINES
        sharded_dir = None
        if sharded:  # every rank writes its own shards; nothing is gathered to rank 0
            sharded_dir = fsdp.stage_shards(
                accelerator, self.manager, step, shard_writer(self.engine, model, optimizer)
            )
        if self.manager is None:
            return
        if sharded_dir is None:
            trainable = {
                name: p.detach() for name, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad
            }
            optimizer_state = optimizer.state_dict()
        else:
            trainable, optimizer_state = {}, None
        scaler = getattr(accelerator, "scaler", None)  # fp16 on a GPU: the loss scale must continue too
        sharding = {"sharding": self.engine} if sharded else {}
        self.manager.save(
            step,
            trainable,
            optimizer_state,
            scheduler.state_dict(),
            {**state, "fingerprint": self.fingerprint, "layout": layout(accelerator), **sharding},
            rngs,
            metric,
            grad_scaler_state=scaler.state_dict() if scaler is not None else None,
            sharded_dir=sharded_dir,
        )


def layout(accelerator) -> dict:
    """The ranks and accumulation that wrote a checkpoint: what an elastic resume adapts from
    (fineflow.train.elastic)."""
    return {"world_size": accelerator.num_processes, "grad_accum": accelerator.gradient_accumulation_steps}


ENGINE_NAMES = {"ddp": "an unsharded (one process or DDP)", "fsdp": "an FSDP", "deepspeed": "a DeepSpeed"}


def shard_writer(engine: str, model, optimizer):
    """write(directory): every rank writes its part of the training state there (a collective)."""
    from fineflow.train import zero

    if engine == "deepspeed":
        return lambda directory: zero.save_engine_state(model, directory)
    return lambda directory: fsdp.save_sharded(model, optimizer, directory)


def checkpoint_engine(checkpoint) -> str:
    """Which engine wrote a checkpoint's state (a Profile.engine): recorded under "sharding" in a sharded one's
    state since DeepSpeed checkpoints exist; before, only FSDP wrote sharded ones."""
    if checkpoint.sharded_dir is None:
        return "ddp"
    return checkpoint.state.get("sharding") or "fsdp"


def restore(checkpoint, accelerator, model, optimizer, scheduler, engine: str) -> None:
    """Put a loaded checkpoint's weights, optimizer, scheduler and this rank's RNG state back in place.
    A sharded checkpoint (FSDP, DeepSpeed) is read by every rank: each loads its own part of weights and
    optimizer. engine: the run's Profile.engine, which must be the one that wrote the checkpoint."""
    import torch

    from fineflow.checkpoint import restore_rng
    from fineflow.train import zero
    from fineflow.train.elastic import rank_rng

    written_by = checkpoint_engine(checkpoint)
    if written_by != engine:
        raise FineflowError(
            f"{checkpoint.path} is {ENGINE_NAMES[written_by]} checkpoint and this run is "
            f"{ENGINE_NAMES[engine].split(' ', 1)[1]} (train.accelerate_profile changed?); resume it with the "
            f"profile that wrote it, or start fresh with train.resume: never"
        )
    if written_by == "deepspeed":
        zero.load_engine_state(model, checkpoint.sharded_dir)
    elif written_by == "fsdp":
        fsdp.load_sharded(model, optimizer, checkpoint.sharded_dir)
    else:
        parameters = dict(accelerator.unwrap_model(model).named_parameters())
        missing = sorted(set(checkpoint.model_tensors) - set(parameters))
        if missing:
            raise FineflowError(f"{checkpoint.path}: tensors {missing[:3]} are not parameters of this model")
        with torch.no_grad():
            for name, tensor in checkpoint.model_tensors.items():
                parameters[name].copy_(tensor)
        optimizer.load_state_dict(checkpoint.optimizer_state_dict)
    scheduler.load_state_dict(checkpoint.scheduler_state_dict)
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None and checkpoint.grad_scaler_state is not None:
        scaler.load_state_dict(checkpoint.grad_scaler_state)
    # train.elastic on more ranks than wrote it: a new rank takes rank 0's state (fineflow.train.elastic)
    restore_rng(rank_rng(checkpoint.rng_snapshots, accelerator.process_index))
