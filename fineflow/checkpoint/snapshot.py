"""The snapshot a save hands to the background writer: where every tensor goes in one reusable host
buffer (the arena, laid out as the safetensors files' data sections), the copy into it, and the picklable
SaveJob that carries arena and JSON parts to a writer thread or process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from fineflow.checkpoint.format import _safetensors_header, _safetensors_layout

if TYPE_CHECKING:
    from fineflow.checkpoint.remote_store import StoreConfig


@dataclass
class TensorFile:
    """One .safetensors file of a snapshot: its header bytes and where its data lies in the arena."""

    name: str
    header: bytes
    offset: int
    nbytes: int


@dataclass
class SaveJob:
    """Everything the background writer needs; picklable, so the process backend can receive it."""

    root: str
    step: int
    metric: float | None
    tensor_files: list[TensorFile]
    json_files: dict[str, bytes]
    arena: torch.Tensor  # uint8; for the process backend in shared memory (passed by file descriptor)
    keep_last: int
    keep_best: int
    protected: list[str]
    on_write_error: str
    retries: int
    retry_backoff_s: float
    # a sharded save: the directory every rank has written its shards into, moved into the checkpoint
    sharded_dir: str | None = None
    # checkpoint.store: where the published checkpoint is uploaded too (fineflow.checkpoint.remote_store.StoreConfig)
    store: StoreConfig | None = None


def plan_files(tensor_sets: dict) -> tuple[list[tuple[TensorFile, dict, list]], int]:
    """Where each file's data goes in the arena (64-byte aligned), with its header; and the arena size."""
    planned, offset = [], 0
    for name, (tensors, metadata) in tensor_sets.items():
        entries, nbytes = _safetensors_layout(tensors)
        planned.append(
            (TensorFile(name, _safetensors_header(tensors, entries, metadata), offset, nbytes), tensors, entries)
        )
        offset += -(-nbytes // 64) * 64
    return planned, offset


def _copy_into(
    arena: torch.Tensor, arena_bytes: np.ndarray, begin: int, tensor: torch.Tensor, non_blocking: bool
) -> None:
    """Copy one tensor's bytes to arena[begin:], in the file's byte order."""
    nbytes = tensor.numel() * tensor.element_size()
    source = tensor.detach()
    if source.device.type == "cpu":
        # A plain single-threaded memcpy. torch's copy_ splits every tensor over the intra-op threads, and on
        # a busy machine each split waits for a descheduled thread: 700 MB took 1.4 s that way on 2 shared
        # cores, 0.07 s like this.
        source = source if source.is_contiguous() else source.contiguous()
        np.copyto(arena_bytes[begin : begin + nbytes], source.reshape(-1).view(torch.uint8).numpy())
    else:  # device-to-host: a DMA into the (pinned) arena, synchronized once after all copies
        target = arena[begin : begin + nbytes].view(tensor.dtype).view(tensor.shape)
        target.copy_(source, non_blocking=non_blocking)
