"""Resuming on another number of ranks (``train.elastic``): a run is its global batch, not its world size.

An optimizer step trains on micro_batch_size x grad_accum x ranks rows. The sampler (``RowSampler``) takes
each micro-step's rows for all ranks at once from one seeded order and its state (epoch, position) does not
depend on the ranks, and the loss is the summed cross-entropy over the global batch's trained tokens
(``fineflow.train.loop``): so 2 ranks x accumulation 1 and 1 rank x accumulation 2 train the same rows per step
with the same gradient. With ``train.elastic: true`` the run fingerprint (``fineflow.train.resume``) holds
that global batch instead of ``world_size``, ``train.num_processes`` and ``train.grad_accum``, and a checkpoint
of 2 ranks resumes on 1 (or back) with the same data order, schedule (the scheduler's step count) and
optimizer state (AdamW's moments, the same on every DDP rank, saved whole by rank 0).

How the accumulation is found: from params when they already give the ranks that run (num_processes 1,
grad_accum 2), else — an engine placed fewer or more ranks than params ask (a lost node under Ray or Slurm) —
recomputed for the ranks there are: grad_accum = global batch / (micro_batch_size x ranks), refused when it
does not divide. ``train.elastic: false`` (the default): another world size is another run, as before.

What stays bit-exact, and what cannot:
- the same world size (and accumulation): bytes. A resume continues exactly as the uninterrupted run.
- another world size: the same maths in another order. DDP sums gradients over ranks with an all-reduce,
  one rank sums them over its micro-batches, and a micro-batch holds other rows (the sampler deals a global
  micro-batch by tokens); float32 sums in another order differ at ~1e-7 relative per step, and that drift
  grows over the steps. The lr follows the same schedule exactly (it depends only on the step). Measured on
  the tiny test run (tests/test_elastic.py, 12 steps, killed after step 4's checkpoint): the loss and gradient
  norm as logged (5 decimals) equal the uninterrupted 2-rank run's at every step, the lr equal; the final
  adapters differ by at most 1.5e-8 (2 ranks -> 1, accumulation 1 -> 2) and 1.6e-7 (1 -> 2) absolute. The
  tests allow 1e-4 relative per step, as 2 ranks against 1 process (tests/test_ddp.py).
- per-rank RNG (dropout): rank r restores rank r's state when the checkpoint has one, else rank 0's (as a
  fresh run starts: every rank seeded alike). Rows move between ranks and micro-batches, so with
  ``train.lora.dropout > 0`` the masks differ and the trajectory is not the uninterrupted run's.
- sharded states (FSDP, DeepSpeed ZeRO) are split per rank: a resume on another world size is refused before
  any rank loads them, as is adapting the accumulation under them.
"""

from __future__ import annotations

from dataclasses import dataclass

from fineflow.errors import FineflowError
from fineflow.train.profile import SHARDED_ENGINES

# what an elastic run may change between attempts: the split of the global batch, not the batch
SPLIT_KEYS = ("num_processes", "grad_accum")


@dataclass(frozen=True)
class Layout:
    """How an optimizer step's global batch is split: over world_size ranks, grad_accum micro-steps each."""

    world_size: int
    grad_accum: int | None  # None: a checkpoint from before layouts were recorded

    def as_dict(self) -> dict:
        return {"world_size": self.world_size, "grad_accum": self.grad_accum}


def global_batch(cfg, world_size: int) -> int:
    """Rows per optimizer step over all ranks."""
    return cfg.micro_batch_size * cfg.grad_accum * world_size


def elastic_identity(fingerprint: dict, cfg, world_size: int) -> dict:
    """A run fingerprint whose identity is the global batch: world_size and the split keys left out."""
    out = {key: value for key, value in fingerprint.items() if key != "world_size"}
    out["train"] = {key: value for key, value in fingerprint["train"].items() if key not in SPLIT_KEYS}
    out["global_batch"] = global_batch(cfg, world_size)
    return out


def accumulation_for(cfg, world_size: int) -> int:
    """grad_accum that keeps params' global batch (micro x grad_accum x num_processes) on world_size ranks."""
    rows = global_batch(cfg, cfg.num_processes)
    per_micro_step = cfg.micro_batch_size * world_size
    if rows % per_micro_step:
        raise FineflowError(
            f"train.elastic: {world_size} rank(s) cannot train the global batch of {rows} rows (train."
            f"micro_batch_size {cfg.micro_batch_size} x grad_accum {cfg.grad_accum} x num_processes "
            f"{cfg.num_processes}): {rows} is not a multiple of micro_batch_size x ranks = {per_micro_step}. Run "
            f"on a number of ranks that divides it, or change train.micro_batch_size (another run: it starts over)"
        )
    return rows // per_micro_step


def adapt_to_world(cfg, world_size: int, engine: str):
    """(train settings for world_size ranks, a sentence saying what changed or None). Only with train.elastic,
    and only for unsharded runs: a sharded engine's batch settings were fixed for params' ranks."""
    if not cfg.elastic or world_size == cfg.num_processes:
        return cfg, None
    if engine in SHARDED_ENGINES:
        raise FineflowError(
            f"train.elastic: {world_size} rank(s) run where params give train.num_processes {cfg.num_processes}, "
            f"and the {engine} profile's states are split per rank: elastic runs are unsharded (one process or "
            f"DDP). Run on {cfg.num_processes} ranks, or use an unsharded train.accelerate_profile"
        )
    accum = accumulation_for(cfg, world_size)
    said = (
        f"train.elastic: {world_size} rank(s) where params give {cfg.num_processes}: grad_accum {cfg.grad_accum} "
        f"-> {accum}, global batch {global_batch(cfg, cfg.num_processes)}"
    )
    return cfg.model_copy(update={"grad_accum": accum, "num_processes": world_size}), said


def checkpoint_layout(state: dict) -> Layout:
    """The layout a checkpoint was written with (its state's "layout"; older ones: the sampler's world size)."""
    recorded = state.get("layout") or {}
    world = recorded.get("world_size", (state.get("sampler") or {}).get("world_size", 1))
    return Layout(int(world), recorded.get("grad_accum"))


def check_movable(path, state: dict, now: Layout) -> None:
    """Refuse a sharded checkpoint on another world size (rank 0, before any rank loads it)."""
    written = checkpoint_layout(state)
    if state.get("sharding") and written.world_size != now.world_size:
        raise FineflowError(
            f"{path} holds {state['sharding']} states split over {written.world_size} rank(s); this run has "
            f"{now.world_size}. Sharded optimizer states do not move to another world size here: resume on "
            f"{written.world_size} rank(s), or start fresh with train.resume: never"
        )


def describe_move(state: dict, now: Layout, global_rows: int) -> dict | None:
    """The train report's "elastic" entry when a checkpoint of another layout was resumed (None: the same)."""
    written = checkpoint_layout(state)
    if written == now:
        return None
    message = (
        f"resuming step {state['step']} of {written.world_size} rank(s) on {now.world_size}: grad_accum "
        f"{written.grad_accum} -> {now.grad_accum}, global batch {global_rows}"
    )
    return {"from": written.as_dict(), "to": now.as_dict(), "global_batch": global_rows, "message": message}


def rank_rng(snapshots: list, rank: int) -> dict:
    """The RNG state rank `rank` restores: its own when the checkpoint has one, else rank 0's (a resume on more
    ranks than wrote it; a fresh run seeds every rank alike too)."""
    return snapshots[rank] if rank < len(snapshots) else snapshots[0]
