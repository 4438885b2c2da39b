"""The evaluate stage for a model that scores text instead of generating (an objective whose ``generates`` is
false: the reward model): every held-out pair's chosen and rejected answers scored by the candidate, as the
objective's task (its ``eval_task``: ``fineflow_reward``) in scores.json, and nothing else: evaluate.tasks score
a generator's answers, and this model gives none.

Per pair, ``pairwise_accuracy`` is 1 when the candidate's reward of the chosen answer is above the rejected one's,
0 when below and 0.5 on an exact tie (pair_ranking's rule: a model that cannot tell the answers apart is at chance).
Each answer is rendered and cut as the tokenize stage renders and cuts it (pair_ranking.encode_answers) and scored
alone (the objective's ``score_examples``). Per-pair samples carry ``doc_id`` and the metric, so the promotion gate's
paired bootstrap works unchanged on ``promote.primary_metric: fineflow_reward/pairwise_accuracy``.

The references the gate compares with: the base has no reward head, so it is recorded as chance, a tie on every pair
(0.5 each): the first reward model is judged against chance. After that, the registry's champion of the same kind
(fineflow.registry.store: a champion per model kind), from the per-pair scores recorded at its promotion on the same
eval data (the language model champion at ``--champion`` is not scored: it is another kind of model).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np

from fineflow.base_source import read_base_digest, resolve_base_model
from fineflow.core.config import Params
from fineflow.errors import FineflowError
from fineflow.evaluate.harness import find_model
from fineflow.evaluate.pair_ranking import encode_answers, read_pairs, write_pair_samples
from fineflow.evaluate.scoring import EvaluationFailed, evaluation_report, plan_loading, write_scores

METRIC = "pairwise_accuracy"
BASE_NOTE = "the base has no reward head: every pair a tie, chance (0.5)"


def evaluate_scorer(
    params: Params,
    objective,
    base_dir: Path,
    adapter_dir: Path,
    eval_rows: Path,
    out_dir: Path,
    raw_dir: Path,
    base_fingerprint: Path | None = None,
    log=print,
) -> dict:
    """Score the candidate (objective's kind, at adapter_dir) on every eval pair; write ``<out_dir>/scores.json`` (the
    base as chance) and the per-pair samples; return the stage's report."""
    import torch

    task = objective.eval_task
    base_reference = resolve_base_model(params.model, base_dir)
    base_digest = read_base_digest(base_reference, base_fingerprint)
    torch.manual_seed(params.seed)
    candidate = find_model(adapter_dir)
    if candidate is None or candidate[0] != "adapter":
        raise FineflowError(f"{adapter_dir}: no adapter (adapter_config.json) of a reward model to evaluate")
    shutil.rmtree(out_dir, ignore_errors=True)  # as evaluate_models: nothing of an earlier run stays
    for name in ("base", "candidate", "champion"):
        (raw_dir / f"{name}.json").unlink(missing_ok=True)
    pairs = read_pairs(eval_rows, params.evaluate.limit)
    _note_primary_metric(params, task, log)
    load, placement, base_scored = plan_loading(params, base_reference, log)
    started = time.perf_counter()
    rewards, load_s, score_s = score_candidate(params, objective, base_reference, load, candidate[1], pairs)
    scores = {"base": chance_entry(task, len(pairs)), "candidate": reward_entry(task, pairs, rewards)}
    for name, entry in scores.items():
        write_pair_samples(out_dir / "samples" / name / f"{task}.jsonl", entry["samples"][task])
        log(f"{name}: {task} {entry['metrics'][task]}")
    described = {"task": task, "pairs": len(pairs), "base": BASE_NOTE}
    write_scores(out_dir / "scores.json", [task], eval_rows, base_digest, scores, base_scored, described)
    timings = {"base": {"load_s": round(load_s, 3), "score_s": 0.0}, "candidate": {"load_s": 0.0, "score_s": score_s}}
    report = evaluation_report(scores, timings, 0.0, load_s, time.perf_counter() - started)
    return {**report, "base_scored": base_scored, "load": placement}


def _note_primary_metric(params: Params, task: str, log) -> None:
    """The gate judges promote.primary_metric: say so when it is not this task's (the gate then refuses)."""
    wanted = f"{task}/{METRIC}"
    if params.promote.primary_metric != wanted:
        log(
            f"evaluate: promote.primary_metric is {params.promote.primary_metric}, but train.objective "
            f"{params.train.objective} is scored on {wanted} alone: set promote.primary_metric: {wanted}"
        )


def score_candidate(params: Params, objective, base_reference: str, load, adapter: Path, pairs: list[dict]):
    """(rewards: {"chosen", "rejected"} per pair, load seconds, scoring seconds); EvaluationFailed when the candidate
    cannot be loaded or scored."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(base_reference)
        kwargs = load.kwargs(same_as_base=True)
        base = AutoModelForCausalLM.from_pretrained(base_reference, **kwargs)
        if "device_map" not in kwargs:
            base = base.to(load.device)
        scorer = objective.load_trained(base.eval(), adapter)
        load_s = time.perf_counter() - started
        encoded = encode_answers(tokenizer, pairs)  # chosen then rejected, pair by pair
        scores = objective.score_examples(scorer, encoded, params.evaluate.batch_size, params.tokenize.seq_len)
    except FineflowError:
        raise
    except Exception as exc:  # noqa: BLE001 - a failed candidate stops the stage with what failed
        raise EvaluationFailed("candidate", adapter, f"{type(exc).__name__}: {exc}") from exc
    rewards = {"chosen": scores[0::2].tolist(), "rejected": scores[1::2].tolist()}
    return rewards, load_s, round(time.perf_counter() - started - load_s, 3)


def reward_entry(task: str, pairs: list[dict], rewards: dict) -> dict:
    """A scores.json entry from each pair's rewards: the pairwise accuracy and, per pair, both rewards."""
    chosen, rejected = np.asarray(rewards["chosen"]), np.asarray(rewards["rejected"])
    margin = chosen - rejected
    right = np.where(margin > 0, 1.0, np.where(margin == 0, 0.5, 0.0))
    samples = [
        {
            "doc_id": i,
            "target": pair["chosen"],
            "prediction": pair["chosen"] if margin[i] > 0 else pair["rejected"] if margin[i] < 0 else None,
            "reward_chosen": round(float(chosen[i]), 6),
            "reward_rejected": round(float(rejected[i]), 6),
            METRIC: float(right[i]),
        }
        for i, pair in enumerate(pairs)
    ]
    return {"status": "ok", "metrics": {task: {METRIC: float(right.mean())}}, "samples": {task: samples}}


def chance_entry(task: str, pairs: int) -> dict:
    """The base's entry: no reward head, so every pair a tie (0.5), what a first reward model must beat."""
    samples = [{"doc_id": i, METRIC: 0.5} for i in range(pairs)]
    return {"status": "ok", "metrics": {task: {METRIC: 0.5}}, "samples": {task: samples}, "note": BASE_NOTE}
