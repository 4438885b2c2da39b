"""The evaluate stage's procedure: load the base once, score it, then with the candidate's adapter, then with
the champion's; record each model's metrics, per-sample scores and timings. lm-eval plumbing is
``fineflow.evaluate.harness``; the bundled tasks are ``bundled_tasks/``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from fineflow.base_source import read_base_digest, resolve_base_model
from fineflow.core.config import Params
from fineflow.core.reports import sha256_file, write_json_atomic
from fineflow.errors import FineflowError
from fineflow.evaluate.harness import (
    PAIR_LOGPS,
    LoadPlan,
    ModelScorer,
    champion_id,
    champion_record,
    check_tasks,
    find_model,
    prepare_task_dir,
    resolve_tasks,
    results_file,
    summarize,
    write_samples,
)
from fineflow.evaluate.pair_ranking import TASK as PREFERENCE_TASK
from fineflow.evaluate.pair_ranking import PairScorer, lm_eval_tasks, read_pairs, write_pair_samples
from fineflow.evaluate.sizing import (
    base_scored_note,
    choose_placement,
    device_map_for,
    eval_precision,
    qlora_base,
    visible_device_bytes,
)
from fineflow.objectives import objective_for
from fineflow.train.planner import GiB, shape_from_config
from fineflow.train.precision import TORCH_DTYPE_OF, quantization_kwargs


class EvaluationFailed(FineflowError):
    """The base's or the candidate's evaluation failed. The stage fails and writes no scores: a recorded failure
    would be a cached success to DVC, and later runs would skip the evaluation instead of retrying it. (A failed
    champion evaluation is recorded and the stage goes on: the candidate can still be judged, and refused.)"""

    def __init__(self, name: str, model, error: str):
        super().__init__(
            f"the {name}'s evaluation failed, so there is nothing to judge: {error} ({model}). Nothing was "
            f"recorded: fix the cause (a corrupt adapter: re-run train; out of memory: lower evaluate.batch_size) "
            f"and re-run the evaluate stage"
        )


def evaluate_models(
    params: Params,
    base_dir: Path,
    adapter_dir: Path,
    eval_rows: Path,
    out_dir: Path,
    raw_dir: Path,
    champion_dir: Path | None = None,
    base_fingerprint: Path | None = None,
    log=print,
    reference: Path | None = None,
) -> dict:
    """Score the base, the candidate and (when there is one) the champion on every task (and with a preference
    objective on every eval pair: fineflow.evaluate.pair_ranking); write
    ``<out_dir>/scores.json``, per-sample outputs and lm-eval's raw results; return the stage's report.

    base_dir: the base stage's output (the base when ``model.base`` is the embedded model). base_fingerprint: the
    fingerprint stage's JSON, the base by content (without it the base's files are hashed here). A champion
    trained on another base is an adapter for other weights (other shapes, even): it is scored as its merged
    model instead, never wrapped around this base. A model that scores text instead of generating (the objective's
    ``generates``: the reward model) is evaluated by fineflow.evaluate.reward_ranking instead (the stage asks)."""
    base_reference = resolve_base_model(params.model, base_dir)
    base_digest = read_base_digest(base_reference, base_fingerprint)
    import torch

    torch.manual_seed(params.seed)
    models, champion_notes = models_to_score(adapter_dir, champion_dir, base_digest, log)
    # nothing of an earlier run stays: DVC keeps the folder (a persisted output: no run cache, see dvc.yaml),
    # and a stale champion's samples would be read as this run's
    shutil.rmtree(out_dir, ignore_errors=True)
    for name in ("base", "candidate", "champion"):
        (raw_dir / f"{name}.json").unlink(missing_ok=True)
    cfg = params.evaluate
    pairs = pair_scorer(params, eval_rows)  # a preference eval set: read and checked before anything loads
    tasks = lm_eval_tasks(cfg.tasks, pairs is not None)
    load, placement, base_scored = plan_loading(params, base_reference, log)  # refuses before anything loads
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fineflow-tasks-") as tmp:
        from transformers import AutoTokenizer

        # the prompts as training rendered them: the same tokenizer (chat template included) as the tokenize stage
        tokenizer = AutoTokenizer.from_pretrained(base_reference)
        task_dir = prepare_task_dir(Path(tmp) / "tasks", eval_rows, cfg.max_gen_toks, tokenizer, pairs is not None)
        manager, registry = resolve_tasks(tasks, task_dir, cfg.task_dirs)
        check_tasks(manager, tasks, registry)
        tasks_s = time.perf_counter() - started
        scorer = ModelScorer(base_reference, tasks, manager, cfg.batch_size, cfg.limit, load, pairs)
        base_load_s = scorer.load_base()
        anchor = preference_anchor(reference, champion_dir) if pairs is not None and "champion" in models else "base"
        scores, timings, anchor = score_models(scorer, models, base_load_s, out_dir, raw_dir, anchor, log)
    if "champion" in scores:
        scores["champion"].update(id=champion_id(champion_dir), **champion_notes)
    preference = None if pairs is None else pairs.describe(anchor, scores.get(anchor, {}).get("id"))
    tasks = tasks if pairs is None else [*tasks, PREFERENCE_TASK]
    write_scores(out_dir / "scores.json", tasks, eval_rows, base_digest, scores, base_scored, preference)
    report = evaluation_report(scores, timings, tasks_s, base_load_s, time.perf_counter() - started)
    return {**report, "base_scored": base_scored, "load": placement}


def preference_anchor(reference: Path | None, champion_dir: Path | None) -> str:
    """The model a preference run's rewards are measured from: the champion when it is the reference the DPO
    candidate was trained against (the reference_logps stage's reference.json names it), so the reward is the policy's
    own implicit reward (its reference scores 0.5, a tie on every pair) and the gate asks whether the candidate
    moved toward the chosen answers past the model it started from; otherwise the base."""
    if reference is None or not reference.is_file() or champion_dir is None:
        return "base"
    record = json.loads(reference.read_text(encoding="utf-8"))
    named = record.get("champion")  # only a reference model anchored to the champion names one
    return "champion" if named and named == champion_id(champion_dir) else "base"


def models_to_score(adapter_dir: Path, champion_dir: Path | None, base_digest: str | None, log=print):
    """({name: (kind, path)} of the base, the candidate and the champion when there is one to score, the notes for
    the champion's scores entry); a FineflowError when there is no candidate."""
    candidate = find_model(adapter_dir)
    if candidate is None:
        raise FineflowError(
            f"{adapter_dir}: no adapter (adapter_config.json) or model (config.json) to evaluate; run the train stage"
        )
    models = {"base": ("base", None), "candidate": candidate}
    champion, champion_notes = champion_to_score(champion_dir, base_digest, log)
    if champion is not None:
        models["champion"] = champion
    return models, champion_notes


def pair_scorer(params: Params, eval_rows: Path) -> PairScorer | None:
    """With a preference objective (train.objective dpo or simpo), the scorer of the eval pairs (each model's
    log-probs of chosen and rejected, rewards anchored to the base with train.preference.beta); else None."""
    if objective_for(params.train.objective).eval_task != PREFERENCE_TASK:
        return None
    pairs = read_pairs(eval_rows, params.evaluate.limit)
    beta = params.train.preference.beta
    return PairScorer(pairs, beta, params.evaluate.batch_size, params.tokenize.seq_len)


def plan_loading(params: Params, base: str, log=print) -> tuple[LoadPlan, dict, str]:
    """(how to load the models, the memory plan and placement for the report, the words for the base scored):
    the run's compute dtype, one device or the fewest visible devices that hold the model sharded (accelerate's
    device map), or a FineflowError naming what to change, before any weights are read."""
    import torch
    from transformers import AutoConfig

    cfg, has_gpu = params.evaluate, torch.cuda.is_available()
    mixed = eval_precision(params, has_gpu)
    chosen = qlora_base(params.train.method, cfg.qlora_base, has_gpu)
    dtype = TORCH_DTYPE_OF[mixed]
    note = base_scored_note(params.train.method, chosen, dtype)
    quantization = quantization_kwargs(mixed) if chosen == "4bit" else None
    config = AutoConfig.from_pretrained(base)
    try:
        shape = shape_from_config(config.to_dict(), name=str(base))
    except FineflowError as exc:  # an architecture the planner cannot size: load it whole, as before
        log(f"evaluate: not sized ({exc}); loading on one device")
        return LoadPlan(dtype, "cuda" if has_gpu else "cpu", quantization=quantization), {"sized": False}, note
    device_bytes = visible_device_bytes(cfg.device_memory_gib)
    plan = choose_placement(
        shape,
        mixed,
        cfg.batch_size,
        params.tokenize.seq_len,
        device_bytes,
        quantized=chosen == "4bit",
        lora_r=params.train.lora.r,
        gpu=has_gpu,
    )
    placement = {"sized": True, **plan.as_dict()}
    if plan.devices == 1:
        return LoadPlan(dtype, "cuda" if has_gpu else "cpu", quantization=quantization), placement, note
    max_memory = {i: int(plan.weight_room) for i in range(plan.devices)}
    if quantization is not None:  # accelerate cannot size 4-bit modules from an empty model: from_pretrained does
        return LoadPlan(dtype, "cuda", None, max_memory, quantization), placement, note
    device_map = device_map_for(config, mixed, max_memory)
    log(f"evaluate: {shape.name} sharded over {plan.devices} devices ({plan.per_device / GiB:.1f} GiB each)")
    return LoadPlan(dtype, "cuda", device_map, max_memory), {**placement, "device_map": device_map}, note


def score_models(
    scorer: ModelScorer, models: dict, base_load_s: float, out_dir: Path, raw_dir: Path, anchor="base", log=print
):
    """({model: its scores entry}, {model: its load and scoring time}, the anchor of the pair rewards) for each of
    models ({name: (kind, path)}), writing its samples and lm-eval's raw results as it goes. A failed champion is
    recorded; a failed base or candidate raises EvaluationFailed. anchor: the model the preference rewards are
    measured from (preference_anchor)."""
    scores, timings, pair_logps = {}, {}, {}
    for name, (kind, path) in models.items():
        try:
            results, load_s, score_s = scorer.score(kind, path)
        except Exception as exc:  # noqa: BLE001 — the champion's is recorded; the others stop the stage
            error = f"{type(exc).__name__}: {exc}"
            log(f"{name}: evaluation FAILED: {error}")
            if name != "champion":
                raise EvaluationFailed(name, path or scorer.base_source, error) from exc
            scores[name] = {"status": "failed", "error": error}  # the gate refuses to compare with it
            continue
        metrics, samples = summarize(results)
        if PAIR_LOGPS in results:
            pair_logps[name] = results.pop(PAIR_LOGPS)
        scores[name] = {"status": "ok", "metrics": metrics, "samples": samples}
        timings[name] = {
            "load_s": round(base_load_s if kind == "base" else load_s, 3),
            "score_s": round(score_s, 3),
        }
        write_samples(out_dir / "samples" / name, results)
        write_json_atomic(raw_dir / f"{name}.json", results_file(results))
        log(f"{name}: " + ", ".join(f"{t} {m}" for t, m in metrics.items()))
    if pair_logps:
        anchor = anchor if anchor in pair_logps else "base"  # a failed champion evaluation: the base
        summarize_pairs(scorer.pair_scorer, scores, pair_logps, anchor, out_dir, log)
    return scores, timings, anchor


def summarize_pairs(pair_scorer, scores: dict, pair_logps: dict, anchor: str, out_dir: Path, log=print) -> None:
    """Each model's fineflow_preference metrics and per-pair samples, its rewards anchored to the anchor model's
    log-probs (fineflow.evaluate.pair_ranking), into its scores entry and beside its lm-eval samples."""
    for name, logps in pair_logps.items():
        metrics, samples = pair_scorer.summarize(logps, pair_logps[anchor])
        scores[name]["metrics"][PREFERENCE_TASK], scores[name]["samples"][PREFERENCE_TASK] = metrics, samples
        write_pair_samples(out_dir / "samples" / name / f"{PREFERENCE_TASK}.jsonl", samples)
        log(f"{name}: {PREFERENCE_TASK} {metrics} (rewards anchored to the {anchor})")


def write_scores(
    path: Path,
    tasks: list[str],
    eval_rows: Path,
    base_digest: str | None,
    scores: dict,
    base_scored: str | None = None,
    preference: dict | None = None,
) -> None:
    """scores.json, what the promote stage reads: the tasks, the eval rows by content, the base by content (and
    in which form it was scored: base_scored), and each model's scores; for a preference eval set also what its
    rewards are (preference: beta, anchor, pairs; no key otherwise)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        path,
        {
            "tasks": tasks,
            "eval_rows": str(eval_rows),
            "eval_data_sha256": sha256_file(eval_rows),
            "base_digest": base_digest,
            "base_scored": base_scored,
            **({"preference": preference} if preference else {}),
            **scores,
        },
    )


def champion_to_score(champion_dir: Path | None, base_digest: str | None, log=print) -> tuple[tuple | None, dict]:
    """(what to score for the champion, notes for its scores entry). Its adapter, on this run's base; but when
    its champion.json says it was trained on another base, its merged model (a whole model with its own
    tokenizer), or without one (an adapter-only champion) its adapter on the base its champion.json names."""
    champion = find_model(champion_dir)
    if champion is None:
        return None, {}
    trained_on = champion_record(champion_dir).get("base_digest")
    notes = {"base_digest": trained_on, "evaluated_as": "adapter" if champion[0] == "adapter" else "model"}
    if champion[0] != "adapter" or not (trained_on and base_digest) or trained_on == base_digest:
        return champion, notes
    merged = find_model(champion_dir / "merged")
    if merged is not None:
        log(f"champion: trained on base {trained_on}, this run's base is {base_digest}: scoring its merged model")
        return merged, {**notes, "evaluated_as": "merged model"}
    # an adapter-only champion (promote.merged): its adapter on the base its champion.json points at
    its_base = champion_record(champion_dir).get("base_model")
    if not its_base:
        log(f"champion: trained on base {trained_on}, has no merged model and names no base: not scored")
        return None, {}
    log(f"champion: trained on base {trained_on} ({its_base}), this run's is {base_digest}: its adapter on its base")
    return ("adapter_on_base", (champion[1], its_base)), {**notes, "evaluated_as": "adapter on its own base"}


def evaluation_report(scores: dict, timings: dict, tasks_s: float, base_load_s: float, eval_s: float) -> dict:
    """Flat metrics per model ({"task/metric": value}; {} if it failed), and where the time went: indexing and
    building the tasks, loading models, scoring them, and the rest (summaries, writing samples and results)."""
    flat = {
        name: {f"{task}/{metric}": value for task, m in s.get("metrics", {}).items() for metric, value in m.items()}
        for name, s in scores.items()
    }
    per_model = {
        name: {"status": s["status"], **timings.get(name, {}), **{key: s[key] for key in ("id", "error") if key in s}}
        for name, s in scores.items()
    }
    load_s = base_load_s + sum(t["load_s"] for name, t in timings.items() if name != "base")
    score_s = sum(t["score_s"] for t in timings.values())
    return {
        **flat,
        "models": per_model,
        "tasks_s": round(tasks_s, 3),
        "load_s": round(load_s, 3),
        "score_s": round(score_s, 3),
        "other_s": round(eval_s - tasks_s - load_s - score_s, 3),  # writing
        "eval_s": round(eval_s, 3),
    }
