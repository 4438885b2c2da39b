"""Preference pairs (train.objective dpo or simpo) as tokens: each answer rendered as SFT renders a reply, and
both answers of a pair packed side by side in one row.

A pair's side is its prompt plus one answer, rendered exactly as an SFT row whose final reply is that answer
(fineflow.tokenize.template.render_segments with ``last_assistant``): the alpaca prompt, or the chat template's
rendering of the conversation with its generation prompt; the answer is trained as SFT trains a response (its
EOS appended unless the template already ends the turn with it). Earlier assistant turns of a pair's
conversation are prompt, whatever tokenize.train_on says: a pair compares its two answers, nothing else.

A pair is packed as one unit: chosen then rejected, adjacent in one row, positions restarting at 0 for each
(they never attend to each other), never across rows. When the two sides together are longer than
tokenize.seq_len, ``pair_budget`` cuts them (the validate stage's token checks measure the same cut). The
shard format is fineflow.tokenize.shards'.

Feedback rows (train.objective kto) pack the same way: a row's unit is its answer (the chosen slot) and its KL
sample (the rejected slot): the row's prompt with the answer of the next row of its chunk that has another
prompt, as TRL's KTO builds its KL dataset by shifting answers. Both examples of a unit carry the row's label
(``EncodedBatch.tags``), which the feedback shard keeps per token (desirable.bin).
"""

from __future__ import annotations

import numpy as np

from fineflow.tokenize.conversation import Segment
from fineflow.tokenize.shards import PackedArrays, pack_rows, place_examples
from fineflow.tokenize.template import EncodedBatch, RenderError, WrongObjective, encode_segments, render_segments

SIDES = ("chosen", "rejected")  # a pair's two examples, in this order in the shard
# How pairs become tokens (in the shards' template hash and content key, so a change rebuilds them): 1 = each side
# a last_assistant SFT rendering, both in one row, cut by pair_budget.
PAIR_RENDERING = "pairs 1"
# ... and feedback rows: 1 = each answer and its KL sample (the next row of the chunk with another prompt) a unit.
FEEDBACK_RENDERING = "feedback 1"


def pair_sides(row: dict) -> tuple[dict, dict]:
    """The pair as two SFT rows, prompt + chosen and prompt + rejected: the answer is the output, or (a chat
    row) the assistant's reply that ends the conversation."""
    missing = [side for side in SIDES if not isinstance(row.get(side), str)]
    if missing:
        raise WrongObjective(f'field "{missing[0]}" is missing: the row is not a preference pair')
    sides = []
    for side in SIDES:
        answer = row[side]
        example = {"instruction": row["instruction"], "input": row.get("input") or "", "output": answer}
        if row.get("messages"):
            example["messages"] = [*row["messages"], {"role": "assistant", "content": answer}]
            if row.get("tools"):
                example["tools"] = row["tools"]
        sides.append(example)
    return sides[0], sides[1]


def pair_budget(chosen: int, rejected: int, seq_len: int) -> tuple[int, int]:
    """Tokens each side keeps of the pair's one row of seq_len: both whole when they fit; else a side of at
    most half the row stays whole and the other keeps the rest; else each keeps half. The kept tokens are
    each side's first ones, as an SFT example longer than a row keeps its first seq_len."""
    if chosen + rejected <= seq_len:
        return chosen, rejected
    half = seq_len // 2
    if chosen <= half:
        return chosen, seq_len - chosen
    if rejected <= seq_len - half:
        return seq_len - rejected, rejected
    return half, seq_len - half


def render_pairs(tokenizer, rows: list[dict], first_row: int = 1) -> list[list[Segment]]:
    """Two rendered examples per pair, chosen then rejected; a row that cannot be rendered is named by its
    number in the rows file (``first_row``: the number of rows[0])."""
    examples = []
    for number, row in enumerate(rows, start=first_row):
        try:
            examples += [render_segments(tokenizer, side, "last_assistant") for side in pair_sides(row)]
        except RenderError as exc:
            raise type(exc)(f"row {number}: {exc}") from None
    return examples


def encode_pairs(tokenizer, rows: list[dict], first_row: int = 1) -> EncodedBatch:
    """Pairs as flat arrays: examples 2p and 2p+1 are pair p's chosen and rejected."""
    return encode_segments(tokenizer, render_pairs(tokenizer, rows, first_row))


def pack_pairs(
    encoded: EncodedBatch, seq_len: int, pad_id: int, dtype: np.dtype, budget=pair_budget
) -> tuple[PackedArrays, int]:
    """Pack encoded pairs (chosen, rejected alternating) into rows, each pair whole in one row, chosen first;
    returns the arrays (with pair_slots and pairs) and how many sides were cut. ``budget``: the tokens each side
    keeps of a row (pair_budget; feedback_budget for feedback units)."""
    lengths = encoded.lengths.reshape(-1, 2)
    kept = np.array([budget(int(c), int(r), seq_len) for c, r in lengths], dtype=np.int64).reshape(-1, 2)
    units = pack_rows(kept.sum(axis=1).tolist(), seq_len)
    layout = [[example for pair in row for example in (2 * pair, 2 * pair + 1)] for row in units]
    arrays = place_examples(encoded, kept.reshape(-1), layout, seq_len, pad_id, dtype, slots=True)
    arrays.pairs = np.arange(2 * len(kept), dtype=np.int64).reshape(-1, 2)
    return arrays, int((kept < lengths).sum())


def feedback_units(rows: list[dict]) -> list[tuple[dict, dict]]:
    """Per feedback row, (the row, its KL sample): the row's prompt with the answer of the next row (cyclically,
    within rows) whose prompt differs; the row's own answer when every row has its prompt."""
    prompts = [_prompt_key(row) for row in rows]
    units = []
    for i, row in enumerate(rows):
        partner = next(
            (rows[j % len(rows)] for j in range(i + 1, i + len(rows)) if prompts[j % len(rows)] != prompts[i]), row
        )
        units.append((row, _with_answer(row, _answer(partner))))
    return units


def _prompt_key(row: dict) -> str:
    import json

    return json.dumps([row.get("instruction"), row.get("input") or "", row.get("messages", [])[:-1]], default=str)


def _answer(row: dict) -> str:
    """A feedback row's answer: its output (a chat row's final assistant turn is its output too)."""
    return row["output"]


def _with_answer(row: dict, answer: str) -> dict:
    example = {**row, "output": answer}
    if row.get("messages"):  # a chat row: the final assistant turn is the answer
        example["messages"] = [*row["messages"][:-1], {"role": "assistant", "content": answer}]
    return example


def encode_feedback(tokenizer, rows: list[dict], first_row: int = 1) -> EncodedBatch:
    """Feedback rows as flat arrays: examples 2i and 2i+1 are row i's answer and its KL sample, each tagged with
    the row's label (1: desirable); a row that cannot be rendered is named by its number in the rows file."""
    missing = next((n for n, row in enumerate(rows, start=first_row) if not isinstance(row.get("label"), bool)), None)
    if missing is not None:
        raise WrongObjective(f'row {missing}: field "label" is missing or not true/false: the row is not feedback')
    examples = []
    for number, (row, sample) in enumerate(feedback_units(rows), start=first_row):
        try:
            examples += [render_segments(tokenizer, side, "last_assistant") for side in (row, sample)]
        except RenderError as exc:
            raise type(exc)(f"row {number}: {exc}") from None
    encoded = encode_segments(tokenizer, examples)
    encoded.tags = np.repeat(np.array([row["label"] for row in rows], dtype=np.uint8), 2)
    return encoded


def feedback_budget(answer: int, sample: int, seq_len: int) -> tuple[int, int]:
    """Tokens a feedback unit's answer and KL sample keep of its one row: the answer first, as an SFT row keeps its
    first tokens (the validate stage's token checks measure the same), the sample what is left, at least one token
    (its unit's slot must exist in the row: fineflow.objectives.pair_logps counts a row's units by their slots). A
    sample cut to its prompt has no trained token: the KL estimate leaves it out (fineflow.objectives.kto)."""
    kept = min(answer, seq_len - 1)
    return kept, min(sample, seq_len - kept)


def pack_feedback(encoded: EncodedBatch, seq_len: int, pad_id: int, dtype: np.dtype) -> tuple[PackedArrays, int]:
    """Pack encoded feedback units as pairs (pack_pairs, feedback_budget) and mark each desirable row's tokens in
    ``desirable``."""
    arrays, cut = pack_pairs(encoded, seq_len, pad_id, dtype, feedback_budget)
    arrays.desirable = np.zeros(arrays.tokens.shape, dtype=np.uint8)
    flat = arrays.desirable.reshape(-1)
    for (row, start, length), tag in zip(arrays.examples.tolist(), encoded.tags.tolist()):
        if tag:
            flat[row * seq_len + start : row * seq_len + start + length] = 1
    return arrays, cut
