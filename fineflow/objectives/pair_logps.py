"""What every pair objective computes first: each preference pair's sequence log-probability under a model.

A preference shard (the tokenize stage's: fineflow.tokenize.pairs) packs each pair as two adjacent examples of
one row, prompt+chosen then prompt+rejected, each attending only to itself, and its ``pair_slots`` say which is
which: 2k on the k-th pair's chosen tokens in that row, 2k+1 on its rejected tokens, -1 on padding. Per trained
token (labels[:, 1:] against logits[:, :-1], as the SFT loss) the log-probability is summed per (row, slot):
each pair's chosen and rejected sequence log-prob and token count (``PairScores``).

The per-pair sums are a matmul with a one-hot (segment x token) matrix in float64, not a scatter-add: CUDA's
scatter-add accumulates in whatever order its atomics land, which would break bit-exact resume. The log-probs
need every trained position's logits at once (the chunked loss of fineflow.objectives.token_loss computes only
their sum).
"""

from __future__ import annotations

from dataclasses import dataclass

from fineflow.errors import DataError


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
