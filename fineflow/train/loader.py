"""The train loop's feeder: a background thread prepares the next optimizer step's micro-batches while
the current step computes, so the loop's data wait is a queue pop.

Rows come from the seeded ``RowSampler`` and are gathered from the memory-mapped shard (one vectorized
read per array); on a GPU they are pinned so the host-to-device copy can overlap compute. Each prepared
step carries the sampler state *after* its rows were drawn: checkpointing that state (not the sampler's
own, which runs ahead by the prefetch depth) is what makes resume exact — no row skipped or replayed.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import numpy as np

from fineflow.tokenize.shards import PackedShard, RowSampler
from fineflow.train.attention import FlashLayout, PackedLayout, layout_of
from fineflow.train.pair_shards import pair_count


@dataclass
class StepBatch:
    micro: list[dict]  # one dict of CPU tensors (input_ids, labels, position_ids) per micro-batch
    rows: list[list[int]]  # the shard rows of each micro-batch
    targets: int  # tokens trained on (labels != -100) in this rank's micro-batches; a preference shard: its pairs
    real_tokens: int  # non-pad tokens in them
    sampler_state: dict  # the sampler's state once these rows were drawn
    # per micro-batch, where its examples sit: varlen's groups, or flash-attn's cu_seqlens (attention.layout_of)
    layouts: list[PackedLayout | FlashLayout] | None = None
    stats: dict | None = None  # an online objective's rollout sums (Objective.rollout), reduced over ranks by the loop


def as_tensors(arrays: dict, pin_memory: bool = False) -> dict:
    """torch views of a batch's numpy arrays (zero-copy), pinned for an async host-to-GPU copy if asked."""
    import torch

    batch = {key: torch.from_numpy(value) for key, value in arrays.items()}
    return {key: value.pin_memory() for key, value in batch.items()} if pin_memory else batch


def count_targets(arrays: dict) -> int:
    """What a batch's loss is averaged over: its trained tokens, or for a preference shard (fineflow.train.pair_shards
    .PairShard: the batch carries pair_slots) its pairs."""
    if "pair_slots" in arrays:
        return pair_count(arrays["pair_slots"])
    return int(np.count_nonzero(arrays["labels"][:, 1:] != -100))


def collate(shard: PackedShard, indices: list[int], pin_memory: bool = False) -> dict:
    return as_tensors(shard.batch(indices), pin_memory)


def prepare_step(
    shard: PackedShard,
    sampler: RowSampler,
    micro_batch_size: int,
    grad_accum: int,
    pin_memory: bool = False,
    varlen: bool = False,
) -> StepBatch:
    """One optimizer step's batches and where each example sits in them (varlen: fineflow's varlen groups;
    otherwise flash-attn's cu_seqlens, without which flash_attention_2 attends across the examples of a row
    at micro_batch_size > 1). Runs on the loader thread, so it uses numpy only (no torch op): a torch op here
    would open a second OpenMP team beside the training thread's and, on a machine with few cores, the two
    spin-wait against each other (a 10x slowdown on 2 cores)."""
    rows = [sampler.next_indices(micro_batch_size) for _ in range(grad_accum)]
    arrays = [shard.batch(r) for r in rows]
    targets = sum(count_targets(a) for a in arrays)
    layouts = [layout_of(a["position_ids"], varlen) for a in arrays]
    micro = [as_tensors(a, pin_memory) for a in arrays]
    return StepBatch(micro, rows, targets, sum(shard.real_tokens(r) for r in rows), sampler.state_dict(), layouts)


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class BatchLoader:
    """Yields `steps` StepBatches, prepared `prefetch` steps ahead on a daemon thread (0 = inline).

    The thread owns the sampler from construction on; restore its state before building the loader.
    An error in the thread is re-raised in the loop at the step it would have fed.
    """

    def __init__(
        self,
        shard: PackedShard,
        sampler: RowSampler,
        micro_batch_size: int,
        grad_accum: int,
        steps: int,
        prefetch: int = 2,
        pin_memory: bool = False,
        varlen: bool = False,
    ):
        self._prepare = lambda: prepare_step(shard, sampler, micro_batch_size, grad_accum, pin_memory, varlen)
        self.steps, self.prefetch = steps, prefetch
        self._served = 0
        self._stop = threading.Event()
        if prefetch > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
            self._thread = threading.Thread(target=self._fill, name="fineflow-batch-loader", daemon=True)
            self._thread.start()

    def _fill(self) -> None:
        try:
            for _ in range(self.steps):
                item = self._prepare()
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as exc:  # handed to the loop, which raises it with its own traceback context
            self._queue.put(_Failed(exc))

    def __iter__(self):
        return self

    def __next__(self) -> StepBatch:
        if self._served == self.steps:
            raise StopIteration
        self._served += 1
        if self.prefetch == 0:
            return self._prepare()
        item = self._queue.get()
        if isinstance(item, _Failed):
            raise item.error
        return item

    def close(self) -> None:
        self._stop.set()
        if self.prefetch > 0:
            self._thread.join(timeout=5)
