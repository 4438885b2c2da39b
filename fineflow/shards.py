"""Packed, memory-mapped token shards: written once by the tokenize stage, re-opened cheaply by training.

Layout of a shard directory (nanoGPT's flat ``train.bin`` idea, plus what fine-tuning needs)::

    tokens.bin     rows x seq_len token ids; uint16 because the vocab is < 65,536 (uint32 otherwise)
    loss_mask.bin  rows x seq_len uint8; 1 where the token is part of a response and is trained on
    positions.bin  rows x seq_len uint16; position ids restart at 0 for every example packed in a row,
                   so attention and positions never cross examples (transformers builds a block-diagonal
                   mask from them)
    examples.idx   n_examples x 3 int64: (row, start, length) of every example — the example boundaries
    meta.json      dtype, vocab size, seq_len, counts, tokenizer/template hashes, code version

No pickles: everything is raw arrays plus JSON.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 holds ids below 65,536 and halves the bytes moved per batch; larger vocabs need uint32."""
    return np.dtype(np.uint16) if vocab_size < 2**16 else np.dtype(np.uint32)


def tokenizer_hash(tokenizer) -> str:
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]


def pack_best_fit(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Assign examples (by index) to rows of capacity seq_len, best-fit in decreasing length order.

    Best-fit-decreasing wastes little space on skewed length distributions; ties break by example index,
    so the packing is deterministic. Returns the example indices of each row, in placement order.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    by_space: list[list[int]] = [[] for _ in range(seq_len + 1)]  # free space -> rows with that space
    space: list[int] = []
    for i in order:
        need = min(lengths[i], seq_len)
        target = next((s for s in range(need, seq_len + 1) if by_space[s]), None)
        if target is None:
            rows.append([])
            space.append(seq_len)
            row = len(rows) - 1
        else:
            row = by_space[target].pop()
        rows[row].append(i)
        space[row] -= need
        by_space[space[row]].append(row)
    return rows


@dataclass
class PackedArrays:
    tokens: np.ndarray
    loss_mask: np.ndarray
    positions: np.ndarray
    examples: np.ndarray  # (n, 3): row, start, length


def pack_examples(encoded: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int,
                  dtype: np.dtype) -> tuple[PackedArrays, int]:
    """Pack (ids, mask) examples into fixed rows; returns the arrays and how many examples were truncated."""
    truncated = sum(1 for ids, _ in encoded if len(ids) > seq_len)
    layout = pack_best_fit([len(ids) for ids, _ in encoded], seq_len)
    tokens = np.full((len(layout), seq_len), pad_id, dtype=dtype)
    mask = np.zeros((len(layout), seq_len), dtype=np.uint8)
    positions = np.zeros((len(layout), seq_len), dtype=np.uint16)
    examples = np.zeros((len(encoded), 3), dtype=np.int64)
    for r, members in enumerate(layout):
        start = 0
        for i in members:
            ids, m = encoded[i]
            n = min(len(ids), seq_len)
            tokens[r, start:start + n] = ids[:n]
            mask[r, start:start + n] = m[:n]
            positions[r, start:start + n] = np.arange(n)
            examples[i] = (r, start, n)
            start += n
        positions[r, start:] = np.arange(seq_len - start)  # padding is its own segment, never trained
    return PackedArrays(tokens, mask, positions, examples), truncated


class ShardWriter:
    """Appends packed windows to a shard directory, so a dataset of any size is written in bounded memory."""

    def __init__(self, out_dir: Path, seq_len: int, dtype: np.dtype):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir, self.seq_len, self.dtype = out_dir, seq_len, np.dtype(dtype)
        self.files = {name: (out_dir / name).open("wb") for name in
                      ("tokens.bin", "loss_mask.bin", "positions.bin", "examples.idx")}
        self.rows = self.examples = self.real_tokens = self.trained_tokens = 0

    def append(self, arrays: PackedArrays) -> None:
        examples = arrays.examples.copy()
        examples[:, 0] += self.rows  # window-local row numbers -> shard row numbers
        for name, array in (("tokens.bin", arrays.tokens), ("loss_mask.bin", arrays.loss_mask),
                            ("positions.bin", arrays.positions), ("examples.idx", examples)):
            array.tofile(self.files[name])
        self.rows += arrays.tokens.shape[0]
        self.examples += examples.shape[0]
        self.real_tokens += int(examples[:, 2].sum()) if len(examples) else 0
        self.trained_tokens += int(arrays.loss_mask.sum())

    def close(self, meta: dict) -> dict:
        for fh in self.files.values():
            fh.close()
        full = {"format_version": FORMAT_VERSION, "rows": self.rows, "seq_len": self.seq_len,
                "dtype": self.dtype.name, "examples": self.examples, "real_tokens": self.real_tokens,
                "trained_tokens": self.trained_tokens,
                "real_token_share": round(self.real_tokens / max(1, self.rows * self.seq_len), 4), **meta}
        (self.out_dir / "meta.json").write_text(json.dumps(full, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return full


def write_shard(out_dir: Path, arrays: PackedArrays, meta: dict) -> dict:
    """One packed window as a whole shard (tests and small data)."""
    writer = ShardWriter(out_dir, arrays.tokens.shape[1], arrays.tokens.dtype)
    writer.append(arrays)
    return writer.close(meta)


class PackedShard:
    """Read-only, memory-mapped view of a shard directory; rows are fetched without loading the file."""

    def __init__(self, shard_dir: str | Path):
        self.dir = Path(shard_dir)
        try:
            self.meta = json.loads((self.dir / "meta.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            from fineflow.errors import DataError

            raise DataError(f"{self.dir}/meta.json: not a fineflow shard ({exc}); run the tokenize stage") from None
        shape = (self.meta["rows"], self.meta["seq_len"])
        self.tokens = np.memmap(self.dir / "tokens.bin", dtype=self.meta["dtype"], mode="r", shape=shape)
        self.loss_mask = np.memmap(self.dir / "loss_mask.bin", dtype=np.uint8, mode="r", shape=shape)
        self.positions = np.memmap(self.dir / "positions.bin", dtype=np.uint16, mode="r", shape=shape)
        examples = np.fromfile(self.dir / "examples.idx", dtype=np.int64).reshape(-1, 3)
        # non-pad tokens per row, so throughput counts real tokens, not padding
        self.real_per_row = np.bincount(examples[:, 0], weights=examples[:, 2], minlength=shape[0]).astype(np.int64)

    def __len__(self) -> int:
        return self.meta["rows"]

    def real_tokens(self, rows: list[int]) -> int:
        return int(self.real_per_row[rows].sum())

    def row(self, i: int) -> dict[str, np.ndarray]:
        """input_ids, labels (-100 where not trained) and position_ids of packed row i, as int64."""
        return {key: value[0] for key, value in self.batch([i]).items()}

    def batch(self, rows: list[int]) -> dict[str, np.ndarray]:
        """The rows stacked, gathered from the memory maps in one vectorized read per array (the loop's
        data wait is this call)."""
        index = np.asarray(rows, dtype=np.int64)
        ids = self.tokens[index].astype(np.int64)
        positions = self.positions[index].astype(np.int64)
        labels = np.where(self.loss_mask[index] == 1, ids, -100)
        labels[positions == 0] = -100  # the first token of an example is never predicted from the previous one
        return {"input_ids": ids, "labels": labels, "position_ids": positions}


class RowSampler:
    """Deterministic, seeded, rank-sharded order over rows, with an exactly restorable position.

    Every epoch is a fresh permutation (seed + epoch); rank r takes every world_size-th row of it, so ranks
    see disjoint rows and the same number of them (the tail that does not divide evenly is dropped for that
    epoch rather than replayed, which would skew DDP's averaged gradients).
    """

    def __init__(self, n_rows: int, seed: int, rank: int = 0, world_size: int = 1):
        if n_rows < world_size:
            raise ValueError(f"{n_rows} packed rows cannot feed {world_size} processes")
        self.n_rows, self.seed, self.rank, self.world_size = n_rows, seed, rank, world_size
        self.per_rank = n_rows // world_size
        self.epoch, self.position = 0, 0

    def _epoch_rows(self) -> np.ndarray:
        """This rank's rows for the current epoch (computed once per epoch, not per batch)."""
        if getattr(self, "_cached_epoch", None) != self.epoch:
            order = np.random.default_rng(self.seed + self.epoch).permutation(self.n_rows)
            self._cached_rows = order[self.rank: self.per_rank * self.world_size: self.world_size]
            self._cached_epoch = self.epoch
        return self._cached_rows

    def next_indices(self, count: int) -> list[int]:
        out: list[int] = []
        rows = self._epoch_rows()
        while len(out) < count:
            if self.position == self.per_rank:
                self.epoch, self.position = self.epoch + 1, 0
                rows = self._epoch_rows()
            take = min(count - len(out), self.per_rank - self.position)
            out.extend(int(i) for i in rows[self.position:self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n_rows": self.n_rows,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
