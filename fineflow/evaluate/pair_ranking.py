"""Preference evaluation (train.objective dpo or simpo): every held-out pair's chosen and rejected answers scored
by a model, as the task ``fineflow_preference`` in scores.json beside the lm-eval tasks.

For each pair and model M, logp_M(y) is the sum of the log-probs of the answer's tokens given the prompt: the
tokens the tokenize stage trains for that answer (fineflow.tokenize.template.encode_batch on the pair's prompt
side with y as its reply: the same rendering, the same EOS rule, cut at tokenize.seq_len as packing cuts it). The
implicit reward is anchored to one model A, the same for every model scored (base, candidate, champion):

    r_M(y) = beta * (logp_M(y) - logp_A(y))          beta = train.preference.beta

A is DPO's reference when the champion is it (train.preference.reference champion: the candidate's own implicit
reward, the issue's definition; the model it started from scores 0.5), else the base. Anchored to the base, an SFT
champion already ranks most pairs right (0.885 of the embedded default's eval pairs) and a DPO candidate that moved
further toward the chosen answers (0.775 of the pairs, anchored to the SFT model it started from) showed no gain
(0.890): the base's own taste for copying an answer out of the prompt hides the move.
Per pair ``preference_accuracy`` is 1 when r_M(chosen) > r_M(rejected), 0 when below, 0.5 on an exact tie,
``reward_margin`` r_M(chosen) - r_M(rejected). A tie is half right because a model that cannot tell the answers
apart is at chance: the anchor ties on every pair by construction (its rewards are 0), so it scores 0.5, the level
a candidate judged against it must beat significantly; counted 0, any candidate would beat it.

Per-pair samples carry ``doc_id`` and each metric, like the lm-eval tasks' entries, so the promotion gate's paired
bootstrap works unchanged on ``promote.primary_metric: fineflow_preference/preference_accuracy``. Scoring is batched
(evaluate.batch_size pairs' answers at a time, right-padded, fixed order) and deterministic.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fineflow.errors import FineflowError
from fineflow.tokenize.template import EncodedBatch, RenderError, encode_batch

TASK = "fineflow_preference"
METRICS = ("preference_accuracy", "reward_margin")
SIDES = ("chosen", "rejected")


def answer_row(row: dict, answer: str) -> dict:
    """The SFT row of a pair's prompt with ``answer`` as its reply: ``output`` for instruction rows, and for chat
    rows (``messages``: the conversation up to the answer) the answer appended as the assistant's turn."""
    if row.get("messages"):
        return {**row, "messages": [*row["messages"], {"role": "assistant", "content": answer}], "output": answer}
    return {**row, "output": answer}


def pair_objectives() -> list[str]:
    """The objectives evaluated on this task: those that train on preference pairs (or KTO's feedback) and generate."""
    from fineflow.objectives import NAMES, objective_for

    return [name for name in NAMES if objective_for(name).eval_task == TASK]


def lm_eval_tasks(tasks: list[str], preference: bool) -> list[str]:
    """evaluate.tasks without fineflow_preference (scored here, not by lm-eval; implied by a preference objective,
    so listing it is optional), or a FineflowError when it is listed without pairs or is the only task listed."""
    if TASK in tasks and not preference:
        raise FineflowError(
            f"params.yaml: evaluate.tasks lists {TASK}, which scores preference pairs: it needs a train.objective "
            f"evaluated on preference pairs ({', '.join(pair_objectives())}); otherwise remove it from evaluate.tasks"
        )
    rest = [task for task in tasks if task != TASK]
    if not rest:
        raise FineflowError(
            f"params.yaml: evaluate.tasks lists only {TASK}; keep an lm-eval task beside it (fineflow_synth: the "
            f"chosen answers' exact match), the regression guard that the model still does its instruction task"
        )
    return rest


def read_pairs(eval_rows: Path, limit: int | None = None) -> list[dict]:
    """The eval rows (the first ``limit``, as evaluate.limit cuts every task), each a pair with string ``chosen``
    and ``rejected``; a row that is not one is a FineflowError naming the file, line and field. Feedback rows
    (with a ``label``: KTO's) make their pairs first (feedback_pairs)."""
    pairs = []
    with eval_rows.open(encoding="utf-8") as fh:
        rows = [(number, json.loads(line)) for number, line in enumerate(fh, start=1) if line.strip()]
    if rows and "label" in rows[0][1] and not any(side in rows[0][1] for side in SIDES):
        rows = list(enumerate(feedback_pairs([row for _, row in rows]), start=1))
        if not rows:
            raise FineflowError(
                f"{eval_rows}: no prompt has both a desirable and an undesirable answer: the held-out preference "
                "accuracy ranks one against the other; add such rows to the eval data"
            )
    for line_number, row in rows:
        if limit is not None and len(pairs) >= limit:
            break
        bad = [side for side in SIDES if not isinstance(row.get(side), str)]
        if bad:
            raise FineflowError(
                f"{eval_rows}:{line_number}: train.objective is a preference objective, but the eval row has no "
                f"string {' or '.join(bad)}: preference evaluation needs pairs (prompt, chosen, rejected). Map "
                f"the columns with data.mapping.chosen / data.mapping.rejected and re-run validate, or set a "
                f"train.objective that trains on instruction rows"
            )
        pairs.append(row)
    if not pairs:
        raise FineflowError(f"{eval_rows}: no eval pairs to score (the file has no rows)")
    return pairs


def feedback_pairs(rows: list[dict]) -> list[dict]:
    """Feedback rows as preference pairs: per prompt (in order of first appearance), each desirable answer with
    each undesirable one, the desirable as chosen. A pair objective's eval pairs unpaired (TRL's
    unpair_preference_dataset, fineflow.data.synth.unpaired) come back exactly."""
    groups: dict[str, dict] = {}
    for row in rows:
        prompt = {key: value for key, value in row.items() if key not in ("output", "label")}
        if row.get("messages"):
            prompt["messages"] = row["messages"][:-1]  # the conversation before the answer, as a pair's
        key = json.dumps(prompt, sort_keys=True, default=str)
        group = groups.setdefault(key, {"prompt": prompt, True: [], False: []})
        group[row.get("label") is True].append(row["output"])
    return [
        {**group["prompt"], "chosen": chosen, "rejected": rejected}
        for group in groups.values()
        for chosen in group[True]
        for rejected in group[False]
    ]


def encode_answers(tokenizer, pairs: list[dict], first_row: int = 1) -> EncodedBatch:
    """2 x len(pairs) examples, each pair's chosen then rejected, tokenized and masked as the tokenize stage does
    (prompt masked, the final reply and its EOS trained: train_on last_assistant, the answer alone)."""
    rows = [answer_row(pair, pair[side]) for pair in pairs for side in SIDES]
    try:
        return encode_batch(tokenizer, rows, train_on="last_assistant", first_row=first_row)
    except RenderError as exc:
        raise FineflowError(f"eval pairs: cannot render a pair's prompt and answer: {exc}") from None


def sequence_logprobs(model, encoded: EncodedBatch, batch_size: int, seq_len: int) -> np.ndarray:
    """Per example, the sum (float64) of log p(token | the tokens before it) over its trained tokens, at most its
    first seq_len tokens (as packing truncates): labels[1:] against logits[:-1], as the training loss reads them."""
    import torch

    starts = np.concatenate([[0], np.cumsum(encoded.lengths)])
    out = np.empty(len(encoded), dtype=np.float64)
    for first in range(0, len(encoded), batch_size):
        chunk = range(first, min(len(encoded), first + batch_size))
        spans = [(int(starts[i]), int(starts[i] + min(int(encoded.lengths[i]), seq_len))) for i in chunk]
        width = max(end - start for start, end in spans)
        ids = torch.zeros((len(spans), width), dtype=torch.long)  # right-padded: pads come after, never attended
        trained = torch.zeros((len(spans), width), dtype=torch.float64)
        attention = torch.zeros((len(spans), width), dtype=torch.long)
        for k, (start, end) in enumerate(spans):
            ids[k, : end - start] = torch.from_numpy(encoded.ids[start:end])
            trained[k, : end - start] = torch.from_numpy(encoded.mask[start:end].astype(np.float64))
            attention[k, : end - start] = 1
        with torch.inference_mode():
            logits = model(input_ids=ids.to(model.device), attention_mask=attention.to(model.device)).logits
            logits = logits[:, :-1].float()  # log p = logit - logsumexp: no second vocab-wide tensor (log_softmax's)
            labels = ids[:, 1:, None].to(logits.device)
            token_logps = (logits.gather(-1, labels).squeeze(-1) - torch.logsumexp(logits, dim=-1)).cpu().double()
        out[first : first + len(spans)] = (token_logps * trained[:, 1:]).sum(dim=1).numpy()
    return out


class PairScorer:
    """The eval pairs, scored by whatever model and tokenizer the evaluate stage has loaded (its ModelScorer calls
    it beside lm-eval): {"chosen": [logp per pair], "rejected": [...]}; ``summarize`` turns a model's log-probs and
    the base's into the task's metrics and per-pair samples."""

    def __init__(self, pairs: list[dict], beta: float, batch_size: int, seq_len: int):
        self.pairs, self.beta, self.batch_size, self.seq_len = pairs, beta, batch_size, seq_len

    def __call__(self, model, tokenizer) -> dict[str, list[float]]:
        logps = sequence_logprobs(model, encode_answers(tokenizer, self.pairs), self.batch_size, self.seq_len)
        return {"chosen": logps[0::2].tolist(), "rejected": logps[1::2].tolist()}

    def summarize(self, logps: dict, anchor_logps: dict) -> tuple[dict[str, float], list[dict]]:
        """(metrics, per-pair samples) of a model's log-probs, its rewards anchored to the anchor's log-probs."""
        reward = {side: self.beta * (np.asarray(logps[side]) - np.asarray(anchor_logps[side])) for side in SIDES}
        margin = reward["chosen"] - reward["rejected"]
        right = np.where(margin > 0, 1.0, np.where(margin == 0, 0.5, 0.0))
        samples = [
            {
                "doc_id": i,
                "target": pair["chosen"],
                "prediction": pair["chosen"] if margin[i] > 0 else pair["rejected"] if margin[i] < 0 else None,
                "logp_chosen": round(float(logps["chosen"][i]), 6),
                "logp_rejected": round(float(logps["rejected"][i]), 6),
                "preference_accuracy": float(right[i]),
                "reward_margin": round(float(margin[i]), 6),
            }
            for i, pair in enumerate(self.pairs)
        ]
        metrics = {"preference_accuracy": float(right.mean()), "reward_margin": round(float(margin.mean()), 6)}
        return metrics, samples

    def describe(self, anchor: str = "base", anchor_id: str | None = None) -> dict:
        """What scores.json records of the task: the reward's beta and anchor, and how many pairs were scored."""
        described = {"task": TASK, "beta": self.beta, "anchor": anchor, "pairs": len(self.pairs)}
        return {**described, "anchor_id": anchor_id} if anchor_id else described


def write_pair_samples(path: Path, samples: list[dict]) -> None:
    """A model's per-pair scores, one pair per line (beside lm-eval's samples of the other tasks)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for sample in samples:
            fh.write(json.dumps(sample, ensure_ascii=False) + "\n")
