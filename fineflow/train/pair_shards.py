"""Packed pair shards as the pair objectives (fineflow.objectives.interface.PairObjective) train on them.

A preference shard (the tokenize stage's: fineflow.tokenize.pairs) packs each pair as two adjacent examples of
one row, and ``pair_slots.bin`` says which is which (fineflow.objectives.pair_logps). ``PairShard`` reads it
beside the shard and, for an objective that needs a reference model, the reference_logps stage's per-token
log-probs; ``write_shard_logps`` is how that stage writes them. A batch's loss is the SUM over its pairs: the loop
divides by the global batch's pair count, as SFT divides its summed token loss by the global trained tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fineflow.errors import DataError
from fineflow.objectives.pair_logps import token_logps, trained_positions
from fineflow.tokenize.shards import PAIRED

PAIR_SLOTS_FILE = "pair_slots.bin"
LOGPS_DTYPE = np.dtype(np.float32)


def logps_file(split: str) -> str:
    """The reference_logps stage's per-token log-probs of one split (rows x seq_len float32, aligned with its shard)."""
    return f"{split}.logps.bin"


def pair_count(pair_slots: np.ndarray) -> int:
    """Pairs in a batch: a row's slots run 0 .. 2k+1 for its k+1 pairs, so its largest slot says how many."""
    return int(((np.asarray(pair_slots).max(axis=1) + 1) // 2).clip(min=0).sum())


class PairShard:
    """A packed preference shard with its pair slots (and, for dpo, the reference's per-token log-probs): its
    ``batch(rows)`` is PackedShard's plus ``pair_slots`` (int64) and ``ref_logps`` (float32)."""

    def __init__(self, shard, reference_logps: Path | None = None):
        if shard.meta.get("objective") not in PAIRED:
            raise DataError(
                f'{shard.dir}/meta.json: not a preference shard (no "objective": "preference"), but '
                f"train.objective is a preference one: re-run the tokenize stage on preference rows (chosen/rejected)"
            )
        self.shard, self.meta, self.dir, self.real_per_row = shard, shard.meta, shard.dir, shard.real_per_row
        self.ref_logps = None
        if reference_logps is not None:
            self.ref_logps = _rows_map(reference_logps, LOGPS_DTYPE, shard.meta, "re-run the reference_logps stage")

    def __len__(self) -> int:
        return len(self.shard)

    def real_tokens(self, rows: list[int]) -> int:
        return self.shard.real_tokens(rows)

    def batch(self, rows: list[int]) -> dict[str, np.ndarray]:
        arrays = self.shard.batch(rows)  # a preference shard's carry its pair_slots (fineflow.tokenize.shards)
        if self.ref_logps is not None:
            arrays["ref_logps"] = np.array(self.ref_logps[np.asarray(rows, dtype=np.int64)], dtype=np.float32)
        return arrays


def _rows_map(path: Path, dtype: np.dtype, meta: dict, fix: str) -> np.ndarray:
    """A rows x seq_len array beside a shard, memory-mapped, refused unless it is exactly that size."""
    shape = (meta["rows"], meta["seq_len"])
    expected = shape[0] * shape[1] * dtype.itemsize
    size = path.stat().st_size if path.is_file() else None
    if size != expected:
        said = "is missing" if size is None else f"has {size:,} bytes, not {expected:,}"
        raise DataError(f"{path} {said} (rows x seq_len {dtype.name} of the shard beside it): {fix}")
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


def write_shard_logps(model, shard: PairShard, out: Path, batch_size: int, device, varlen: bool, autocast=None):
    """The model's log-prob of every trained token of the shard, written to out as rows x seq_len float32 (0
    where nothing is trained), batch_size rows at a time (bounded memory). autocast: makes a context for each
    forward (the training's mixed precision), or None."""
    import contextlib

    import torch

    from fineflow.train.attention import layout_kwargs, layout_of

    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as fh, torch.no_grad():
        for start in range(0, len(shard), batch_size):
            arrays = shard.batch(list(range(start, min(start + batch_size, len(shard)))))
            batch = {key: torch.from_numpy(value).to(device) for key, value in arrays.items()}
            extra = layout_kwargs(layout_of(arrays["position_ids"], varlen), device)
            with autocast() if autocast is not None else contextlib.nullcontext():
                values = token_logps(model, batch, **extra)
            _, at = trained_positions(batch["labels"])
            block = torch.zeros(at.shape, dtype=torch.float32, device=device)
            block[at] = values.float()
            fh.write(block.cpu().numpy().astype(LOGPS_DTYPE).tobytes())
