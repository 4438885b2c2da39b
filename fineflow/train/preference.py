"""Preference objectives (train.objective dpo, simpo) over packed pair shards.

A preference shard (the tokenize stage's: fineflow.tokenize.pairs) packs each pair as two adjacent
examples of one row, prompt+chosen then prompt+rejected, each attending only to itself, and ``pair_slots.bin``
says which is which: 2k on the k-th pair's chosen tokens in that row, 2k+1 on its rejected tokens, -1 on padding.
``PairShard`` reads it beside the shard (and, for dpo, the reference_logps stage's per-token log-probs).

Per trained token (labels[:, 1:] against logits[:, :-1], as the SFT loss) the policy's log-probability is
summed per (row, slot): each pair's chosen and rejected sequence log-prob and token count. Then, with
beta and simpo_gamma from train.preference:

    dpo:   loss = -logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))     reward(y) = beta * (pi_y - ref_y)
    simpo: loss = -logsigmoid(beta * (pi_c / len_c - pi_r / len_r) - gamma)  reward(y) = beta * pi_y / len_y

A batch's loss is the SUM over its pairs: the loop divides by the global batch's pair count, as SFT divides its
summed token loss by the global trained tokens. Reward accuracy (chosen's reward above rejected's) and margin
(chosen's minus rejected's) come with it, as sums, for the step log.

The per-pair sums are a matmul with a one-hot (segment x token) matrix in float64, not a scatter-add: CUDA's
scatter-add accumulates in whatever order its atomics land, which would break bit-exact resume. The log-probs
need every trained position's logits at once (the chunked loss of fineflow.train.loss computes only their sum).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fineflow.core.errors import DataError, FineflowError

PAIR_SLOTS_FILE = "pair_slots.bin"
PREFERENCE = "preference"  # a preference shard's meta.json "objective"
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
        if shard.meta.get("objective") != PREFERENCE:
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


@dataclass
class PairScores:
    """Per pair (1-D, one entry per pair of the batch, in row then slot order): sequence log-probs and lengths."""

    chosen: object  # torch tensors, float64
    rejected: object
    chosen_len: object
    rejected_len: object


def trained_positions(labels):
    """(bool mask of the logits whose next token is trained, bool mask of those trained tokens): position t's
    logits predict token t+1."""
    import torch

    targets = labels[:, 1:] != -100
    before = torch.zeros_like(labels, dtype=torch.bool)
    before[:, :-1] = targets
    at = torch.zeros_like(labels, dtype=torch.bool)
    at[:, 1:] = targets
    return before, at


def token_logps(model, batch: dict, **forward_kwargs):
    """log p(token t | tokens < t) of every trained token of the batch, in fp32, in row-major order (as
    batch["labels"][at] of ``trained_positions``). Attention as token_loss_sum (fineflow.train.loop): position
    ids restart per example, forward_kwargs carry the varlen/flash layout."""
    import torch.nn.functional as F

    before, at = trained_positions(batch["labels"])
    logits = model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        use_cache=False,
        logits_to_keep=before,
        **forward_kwargs,
    ).logits
    logits = logits.reshape(-1, logits.size(-1)).float()
    return -F.cross_entropy(logits, batch["labels"][at], reduction="none")


def pair_sums(per_token, pair_slots, at) -> tuple[object, object]:
    """(sum of per_token over each (row, slot), token count of each (row, slot)): rows x (2 * most pairs in a
    row), float64; per_token holds one value per trained token (``at``'s True cells, row-major)."""
    import torch

    rows = pair_slots.shape[0]
    slots_per_row = int(pair_slots.max()) + 1
    slots_per_row += slots_per_row % 2  # whole pairs
    row_of = torch.arange(rows, device=pair_slots.device)[:, None].expand_as(pair_slots)
    segment = (row_of * slots_per_row + pair_slots)[at]
    if bool((pair_slots[at] < 0).any()):
        raise DataError("a trained token has pair slot -1 (padding) in pair_slots.bin: re-run the tokenize stage")
    one_hot = (segment[None, :] == torch.arange(rows * slots_per_row, device=segment.device)[:, None]).double()
    sums = one_hot @ per_token.double()
    counts = one_hot.sum(dim=1)
    return sums.reshape(rows, slots_per_row), counts.reshape(rows, slots_per_row)


def pair_scores(per_token, pair_slots, at) -> PairScores:
    """Each pair's chosen and rejected sums and lengths (the pairs that exist: k below the row's pair count)."""
    import torch

    sums, counts = pair_sums(per_token, pair_slots, at)
    pairs_in_row = (pair_slots.max(dim=1).values + 1) // 2
    exists = torch.arange(sums.shape[1] // 2, device=sums.device)[None, :] < pairs_in_row[:, None]
    return PairScores(sums[:, 0::2][exists], sums[:, 1::2][exists], counts[:, 0::2][exists], counts[:, 1::2][exists])


@dataclass
class PairLoss:
    loss_sum: object  # a torch scalar: the summed loss of the batch's pairs (backward goes through it)
    pairs: int
    correct: float  # pairs whose chosen reward is above the rejected one's
    margin_sum: float  # summed chosen reward minus rejected reward


def rewards(policy: PairScores, reference: PairScores | None, objective: str, beta: float):
    """(chosen reward, rejected reward) per pair: dpo's against the reference, simpo's length-normalised."""
    if objective == "dpo":
        return beta * (policy.chosen - reference.chosen), beta * (policy.rejected - reference.rejected)
    if objective == "simpo":
        return (
            beta * policy.chosen / policy.chosen_len.clamp(min=1),
            beta * policy.rejected / policy.rejected_len.clamp(min=1),
        )
    raise FineflowError(f"train.objective: {objective!r} is not a preference objective (dpo or simpo)")


def preference_loss(policy: PairScores, reference: PairScores | None, objective: str, prefs) -> PairLoss:
    """The batch's summed loss and reward statistics (prefs: train.preference)."""
    import torch.nn.functional as F

    chosen, rejected = rewards(policy, reference, objective, prefs.beta)
    margin = chosen - rejected
    logits = margin - prefs.simpo_gamma if objective == "simpo" else margin
    loss_sum = -F.logsigmoid(logits).sum()
    return PairLoss(loss_sum, int(margin.numel()), float((margin > 0).sum()), float(margin.detach().sum()))


def pair_loss(model, batch: dict, objective: str, prefs, **forward_kwargs) -> PairLoss:
    """A batch of a PairShard through the policy: its summed preference loss (dpo reads batch["ref_logps"])."""
    _, at = trained_positions(batch["labels"])
    policy = pair_scores(token_logps(model, batch, **forward_kwargs), batch["pair_slots"], at)
    reference = None
    if objective == "dpo":
        if "ref_logps" not in batch:
            raise FineflowError("train.objective dpo needs the reference log-probs: run the reference_logps stage")
        reference = pair_scores(batch["ref_logps"][at], batch["pair_slots"], at)
    return preference_loss(policy, reference, objective, prefs)


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
