"""Packed, memory-mapped token shards: written once by the tokenize stage, re-opened cheaply by training.

Layout of a shard directory (nanoGPT's flat ``train.bin`` idea, plus what fine-tuning needs)::

    tokens.bin     rows x seq_len token ids; uint16 because the vocab is < 65,536 (uint32 otherwise)
    loss_mask.bin  rows x seq_len uint8; 1 where the token is part of a response and is trained on
    positions.bin  rows x seq_len uint16; position ids restart at 0 for every example packed in a row,
                   so attention and positions never cross examples (transformers builds a block-diagonal
                   mask from them)
    examples.idx   n_examples x 3 int64: (row, start, length) of every example — the example boundaries
    meta.json      dtype, vocab size, seq_len, counts, tokenizer/template hashes, code version

A preference shard (train.objective dpo or simpo; fineflow.tokenize.pairs) holds each pair as two examples,
prompt + chosen then prompt + rejected, adjacent in one row, and adds::

    pair_slots.bin rows x seq_len int16: for the k-th pair placed in a row, 2k on its chosen example's tokens,
                   2k+1 on its rejected example's; -1 on padding
    pairs.idx      n_pairs x 2 int64: the example indices (rows of examples.idx) of each pair's chosen and rejected
    meta.json      also "objective": "preference" and "pairs": n_pairs (an SFT shard has neither key)

A feedback shard (train.objective kto) is a preference shard whose pair is a row's answer (slot 2k) and its KL
sample (2k+1, the row's prompt with another row's answer), with meta.json's "objective": "feedback", and adds::

    desirable.bin  rows x seq_len uint8: 1 on the tokens of a row labelled desirable (both of its sides), else 0

No pickles: everything is raw arrays plus JSON.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fineflow.errors import DataError
from fineflow.tokenize.template import EncodedBatch

FORMAT_VERSION = 2  # 2: exact-fill packing, content key in meta
SHARD_FILES = ("tokens.bin", "loss_mask.bin", "positions.bin", "examples.idx")
PAIR_FILES = ("pair_slots.bin", "pairs.idx")  # a preference shard's, besides SHARD_FILES
PREFERENCE = "preference"  # meta.json's objective of a preference shard
FEEDBACK_SHARD = "feedback"  # ... and of a feedback shard, a preference shard with desirable.bin
FEEDBACK_FILES = ("desirable.bin",)
PAIRED = (PREFERENCE, FEEDBACK_SHARD)  # the shards whose rows hold units of two examples with their pair slots
# A row holds at most seq_len // 2 pairs (each side is at least one token), so slots stay below seq_len + 1:
# int16 holds them for any tokenize.seq_len below 32,767 (the writer refuses a slot beyond).
SLOT_DTYPE = np.dtype(np.int16)
# Position ids restart per example and never exceed seq_len - 1: uint16 halves positions.bin, and params refuse
# a tokenize.seq_len above what it holds (fineflow.core.tokenize_config.MAX_SEQ_LEN).
POSITION_DTYPE = np.dtype(np.uint16)


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


def _fill(space: int, by_length: dict[int, list[int]]) -> dict[int, int]:
    """How many examples of each length fill `space` most fully: a bounded subset-sum over the length
    histogram, as a bitset DP in one Python int (bit k set = a sum of k is reachable).

    Lengths are visited shortest first and the solution is read back from the last group, so longer
    examples are preferred and short ones stay available to fill later rows' gaps. Multiplicities are
    split in powers of two, so a length shared by thousands of examples costs a handful of shifts.
    """
    groups: list[tuple[int, int]] = []
    for length in sorted(by_length):
        if length > space:
            break
        count, chunk = min(len(by_length[length]), space // length), 1
        while count:
            take = min(chunk, count)
            groups.append((length, take))
            count, chunk = count - take, chunk * 2
    window = (1 << (space + 1)) - 1
    reach = [1]
    for length, take in groups:
        reach.append((reach[-1] | (reach[-1] << (length * take))) & window)
        if reach[-1] >> space & 1:  # filled exactly: no need to look further
            break
    target, used = reach[-1].bit_length() - 1, {}
    for g in range(len(reach) - 1, 0, -1):
        if not reach[g - 1] >> target & 1:  # target needs group g-1
            length, take = groups[g - 1]
            used[length] = used.get(length, 0) + take
            target -= length * take
    return used


def pack_exact_fill(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Open each row with the longest example left, then fill what is left of it as fully as possible.

    On lengths clustered around a fraction of seq_len (instruction data: 54-81 tokens in rows of 512),
    best-fit-decreasing puts the long ones together and strands gaps no example fits; filling each row
    exactly does not (bundled data at 512: 95.0% -> 99.5% real tokens).
    """
    by_length: dict[int, list[int]] = {}
    for i in sorted(range(len(lengths)), key=lambda i: (min(lengths[i], seq_len), i), reverse=True):
        by_length.setdefault(min(lengths[i], seq_len), []).append(i)  # pop() yields the lowest index
    rows: list[list[int]] = []
    while by_length:
        longest = max(by_length)
        row = [by_length[longest].pop()]
        if not by_length[longest]:
            del by_length[longest]
        for length, take in sorted(_fill(seq_len - longest, by_length).items(), reverse=True):
            row.extend(by_length[length].pop() for _ in range(take))
            if not by_length[length]:
                del by_length[length]
        rows.append(row)
    return rows


def pack_rows(lengths: list[int], seq_len: int) -> list[list[int]]:
    """The packing with fewer rows of best-fit-decreasing and exact-fill (each wins on some length
    distributions; both are fast next to tokenization). Deterministic; ties go to best-fit."""
    best_fit, exact = pack_best_fit(lengths, seq_len), pack_exact_fill(lengths, seq_len)
    return exact if len(exact) < len(best_fit) else best_fit


@dataclass
class PackedArrays:
    tokens: np.ndarray
    loss_mask: np.ndarray
    positions: np.ndarray
    examples: np.ndarray  # (n, 3): row, start, length
    pair_slots: np.ndarray | None = None  # preference shards: (rows, seq_len) int16, -1 on padding
    pairs: np.ndarray | None = None  # preference shards: (n_pairs, 2) example indices of chosen, rejected
    desirable: np.ndarray | None = None  # feedback shards: (rows, seq_len) uint8, 1 on a desirable row's tokens


def pack_examples(encoded: EncodedBatch, seq_len: int, pad_id: int, dtype: np.dtype) -> tuple[PackedArrays, int]:
    """Pack encoded examples into fixed rows; returns the arrays and how many examples were truncated."""
    kept = np.minimum(encoded.lengths, seq_len)  # an example longer than a row keeps its first seq_len tokens
    layout = pack_rows(kept.tolist(), seq_len)
    return place_examples(encoded, kept, layout, seq_len, pad_id, dtype), int((encoded.lengths > seq_len).sum())


def place_examples(
    encoded: EncodedBatch,
    kept: np.ndarray,
    layout: list[list[int]],
    seq_len: int,
    pad_id: int,
    dtype: np.dtype,
    slots: bool = False,
) -> PackedArrays:
    """Copy each example's first ``kept`` tokens into its row of ``layout`` (the example indices of each
    row, in placement order), back to back; with ``slots``, also each example's place in its row as its
    pair slot (a pair's layout alternates chosen and rejected, so the j-th example of a row is slot j).

    The copy is vectorized: every token's source offset and destination cell are computed as arrays, so
    a window of 20,000 examples costs a few numpy calls, not a Python loop over tokens.
    """
    row_of = np.empty(len(kept), dtype=np.int64)
    start_of = np.empty(len(kept), dtype=np.int64)
    slot_of = np.empty(len(kept), dtype=np.int64)
    used = np.zeros(len(layout), dtype=np.int64)
    for r, members in enumerate(layout):
        offset = 0
        for j, i in enumerate(members):
            row_of[i], start_of[i], slot_of[i] = r, offset, j
            offset += int(kept[i])
        used[r] = offset
    within = np.arange(int(kept.sum())) - np.repeat(np.cumsum(kept) - kept, kept)  # token index in its example
    source = np.repeat(np.cumsum(encoded.lengths) - encoded.lengths, kept) + within
    target = np.repeat(row_of * seq_len + start_of, kept) + within
    tokens = np.full((len(layout), seq_len), pad_id, dtype=dtype)
    mask = np.zeros((len(layout), seq_len), dtype=np.uint8)
    columns = np.arange(seq_len)
    # padding is its own segment (positions from 0 after the last example), never trained on
    positions = np.where(columns >= used[:, None], columns - used[:, None], 0).astype(POSITION_DTYPE)
    tokens.reshape(-1)[target] = encoded.ids[source]
    mask.reshape(-1)[target] = encoded.mask[source]
    positions.reshape(-1)[target] = within
    examples = np.stack([row_of, start_of, kept], axis=1)
    arrays = PackedArrays(tokens, mask, positions, examples)
    if slots:
        if len(slot_of) and int(slot_of.max()) > np.iinfo(SLOT_DTYPE).max:
            raise DataError(
                f"a packed row holds more than {np.iinfo(SLOT_DTYPE).max} pair sides; lower tokenize.seq_len"
            )
        arrays.pair_slots = np.full((len(layout), seq_len), -1, dtype=SLOT_DTYPE)
        arrays.pair_slots.reshape(-1)[target] = np.repeat(slot_of, kept)
    return arrays


class ShardWriter:
    """Appends packed windows to a shard directory, so a dataset of any size is written in bounded memory."""

    def __init__(self, out_dir: Path, seq_len: int, dtype: np.dtype, pairs: bool = False, feedback: bool = False):
        out_dir.mkdir(parents=True, exist_ok=True)
        pairs = pairs or feedback  # a feedback shard is a preference shard with its labels
        self.out_dir, self.seq_len, self.dtype, self.is_pairs = out_dir, seq_len, np.dtype(dtype), pairs
        self.is_feedback = feedback
        names = SHARD_FILES + (PAIR_FILES if pairs else ()) + (FEEDBACK_FILES if feedback else ())
        self.files = {name: (out_dir / name).open("wb") for name in names}
        self.rows = self.examples = self.real_tokens = self.trained_tokens = self.pairs = 0

    def append(self, arrays: PackedArrays) -> None:
        examples = arrays.examples.copy()
        examples[:, 0] += self.rows  # window-local row numbers -> shard row numbers
        for name, array in (
            ("tokens.bin", arrays.tokens),
            ("loss_mask.bin", arrays.loss_mask),
            ("positions.bin", arrays.positions),
            ("examples.idx", examples),
        ):
            array.tofile(self.files[name])
        if self.is_pairs:
            arrays.pair_slots.tofile(self.files["pair_slots.bin"])
            (arrays.pairs + self.examples).astype(np.int64).tofile(self.files["pairs.idx"])  # window -> shard
            self.pairs += len(arrays.pairs)
        if self.is_feedback:
            arrays.desirable.tofile(self.files["desirable.bin"])
        self.rows += arrays.tokens.shape[0]
        self.examples += examples.shape[0]
        self.real_tokens += int(examples[:, 2].sum()) if len(examples) else 0
        self.trained_tokens += int(arrays.loss_mask.sum())

    def close(self, meta: dict) -> dict:
        for fh in self.files.values():
            fh.close()
        full = {
            "format_version": FORMAT_VERSION,
            "rows": self.rows,
            "seq_len": self.seq_len,
            "dtype": self.dtype.name,
            "examples": self.examples,
            "real_tokens": self.real_tokens,
            "trained_tokens": self.trained_tokens,
            "real_token_share": round(self.real_tokens / max(1, self.rows * self.seq_len), 4),
            **(
                {"objective": FEEDBACK_SHARD if self.is_feedback else PREFERENCE, "pairs": self.pairs}
                if self.is_pairs
                else {}
            ),
            **meta,
        }
        (self.out_dir / "meta.json").write_text(json.dumps(full, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return full


def expected_sizes(meta: dict) -> dict[str, int]:
    cells = meta["rows"] * meta["seq_len"]
    sizes = {
        "tokens.bin": cells * np.dtype(meta["dtype"]).itemsize,
        "loss_mask.bin": cells,
        "positions.bin": cells * POSITION_DTYPE.itemsize,
        "examples.idx": meta["examples"] * 3 * 8,
    }
    if meta.get("objective") in PAIRED:
        sizes.update({"pair_slots.bin": cells * SLOT_DTYPE.itemsize, "pairs.idx": meta["pairs"] * 2 * 8})
    if meta.get("objective") == FEEDBACK_SHARD:
        sizes["desirable.bin"] = cells
    return sizes


def shard_key_matches(shard_dir: Path, key: str) -> dict | None:
    """The shard's meta when it is complete (every file at its expected size) and was built from the
    inputs `key` stands for; None otherwise (missing, partial, or built from something else)."""
    try:
        meta = json.loads((shard_dir / "meta.json").read_text(encoding="utf-8"))
        complete = all((shard_dir / name).stat().st_size == size for name, size in expected_sizes(meta).items())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (
        meta if complete and meta.get("content_key") == key and meta.get("format_version") == FORMAT_VERSION else None
    )


def write_shard(out_dir: Path, arrays: PackedArrays, meta: dict) -> dict:
    """One packed window as a whole shard (tests and small data)."""
    writer = ShardWriter(
        out_dir, arrays.tokens.shape[1], arrays.tokens.dtype, arrays.pairs is not None, arrays.desirable is not None
    )
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
        self.positions = np.memmap(self.dir / "positions.bin", dtype=POSITION_DTYPE, mode="r", shape=shape)
        examples = np.fromfile(self.dir / "examples.idx", dtype=np.int64).reshape(-1, 3)
        self.pair_slots = self.desirable = None
        if self.meta.get("objective") in PAIRED:  # pair k of a row: slot 2k chosen, 2k+1 rejected
            self.pair_slots = np.memmap(self.dir / "pair_slots.bin", dtype=SLOT_DTYPE, mode="r", shape=shape)
        if self.meta.get("objective") == FEEDBACK_SHARD:
            self.desirable = np.memmap(self.dir / "desirable.bin", dtype=np.uint8, mode="r", shape=shape)
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
        batch = {"input_ids": ids, "labels": labels, "position_ids": positions}
        if self.pair_slots is not None:
            batch["pair_slots"] = self.pair_slots[index].astype(np.int64)
        if self.desirable is not None:
            batch["desirable"] = self.desirable[index].astype(np.int64)
        return batch


class RowSampler:
    """Deterministic, seeded order over rows, dealt to data-parallel ranks by token count, with an exactly
    restorable position.

    Every epoch is a fresh permutation (seed + epoch). Each call takes the next ``count * world_size`` rows
    of it — the global micro-batch, the same rows whatever the number of ranks — and deals them so every
    rank gets ``count`` rows and as equal a number of real tokens as a greedy longest-first deal allows
    (ranks wait for the slowest at every gradient sync). Every rank computes the same deal, so no
    communication is needed. The state is two integers (epoch, position): resuming restores them directly,
    without replaying the data loader. Neither depends on the number of ranks (the state's world_size only
    records it), so with train.elastic a checkpoint of 2 ranks x 1 micro-step continues on 1 rank x 2 with the
    same rows per optimizer step (fineflow.train.elastic).
    """

    def __init__(
        self, n_rows: int, seed: int, rank: int = 0, world_size: int = 1, row_tokens: np.ndarray | None = None
    ):
        if n_rows < world_size:
            raise DataError(
                f"the training shard has {n_rows} packed rows, fewer than the {world_size} processes that need one "
                f"each: add training rows, lower tokenize.seq_len, or train on fewer processes (train.num_processes)"
            )
        self.n_rows, self.seed, self.rank, self.world_size = n_rows, seed, rank, world_size
        self.row_tokens = np.ones(n_rows, dtype=np.int64) if row_tokens is None else np.asarray(row_tokens)
        self.epoch, self.position = 0, 0

    def _epoch_rows(self) -> np.ndarray:
        """The current epoch's permutation (computed once per epoch, not per batch)."""
        if getattr(self, "_cached_epoch", None) != self.epoch:
            self._cached_rows = np.random.default_rng(self.seed + self.epoch).permutation(self.n_rows)
            self._cached_epoch = self.epoch
        return self._cached_rows

    def _take(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            if self.position == self.n_rows:
                self.epoch, self.position = self.epoch + 1, 0
            rows = self._epoch_rows()
            take = min(count - len(out), self.n_rows - self.position)
            out.extend(int(i) for i in rows[self.position : self.position + take])
            self.position += take
        return out

    def deal(self, rows: list[int], count: int) -> list[list[int]]:
        """Split a global micro-batch into world_size lists of `count` rows with balanced token totals."""
        hands: list[list[int]] = [[] for _ in range(self.world_size)]
        if self.world_size == 1:
            return [rows]
        tokens = [0] * self.world_size
        for k in sorted(range(len(rows)), key=lambda k: (-int(self.row_tokens[rows[k]]), k)):
            rank = min((r for r in range(self.world_size) if len(hands[r]) < count), key=lambda r: (tokens[r], r))
            hands[rank].append(rows[k])
            tokens[rank] += int(self.row_tokens[rows[k]])
        return hands

    def next_indices(self, count: int) -> list[int]:
        """This rank's next `count` rows."""
        return self.deal(self._take(count * self.world_size), count)[self.rank]

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "n_rows": self.n_rows,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        if (state["seed"], state["n_rows"]) != (self.seed, self.n_rows):
            raise ValueError(
                f"sampler state is for seed {state['seed']} over {state['n_rows']} rows, "
                f"not seed {self.seed} over {self.n_rows}"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
