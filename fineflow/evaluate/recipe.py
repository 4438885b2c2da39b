"""The evaluate stage's procedure: load the base once, score it, then with the candidate's adapter, then with
the champion's; record each model's metrics, per-sample scores and timings. lm-eval plumbing is
``fineflow.evaluate.harness``; the bundled tasks are ``evaltasks/``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from fineflow.config import EvaluateParams
from fineflow.errors import FineflowError
from fineflow.evaluate.harness import (
    ModelScorer,
    champion_id,
    check_tasks,
    find_model,
    prepare_task_dir,
    resolve_tasks,
    results_file,
    summarize,
    write_samples,
)
from fineflow.reports import sha256_file, write_json_atomic


def evaluate_models(
    cfg: EvaluateParams,
    seed: int,
    base_reference: str,
    adapter_dir: Path,
    eval_rows: Path,
    out_dir: Path,
    raw_dir: Path,
    champion_dir: Path | None = None,
    log=print,
) -> dict:
    """Score the base, the candidate and (when there is one) the champion on every task; write
    ``<out_dir>/scores.json``, per-sample outputs and lm-eval's raw results; return the stage's report."""
    import torch

    torch.manual_seed(seed)
    candidate = find_model(adapter_dir)
    if candidate is None:
        raise FineflowError(
            f"{adapter_dir}: no adapter (adapter_config.json) or model (config.json) to evaluate; run the train stage"
        )
    models = {"base": ("base", None), "candidate": candidate}
    champion = find_model(champion_dir)
    if champion is not None:
        models["champion"] = champion
    shutil.rmtree(out_dir / "samples", ignore_errors=True)  # no stale champion samples from an earlier run
    for name in ("base", "candidate", "champion"):
        (raw_dir / f"{name}.json").unlink(missing_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fineflow-tasks-") as tmp:
        manager, registry = resolve_tasks(
            cfg.tasks, prepare_task_dir(Path(tmp) / "tasks", eval_rows, cfg.max_gen_toks), cfg.task_dirs
        )
        check_tasks(manager, cfg.tasks, registry)
        tasks_s = time.perf_counter() - started
        scorer = ModelScorer(base_reference, cfg.tasks, manager, cfg.batch_size, cfg.limit)
        base_load_s = scorer.load_base()
        scores, timings = {}, {}
        for name, (kind, path) in models.items():
            try:
                results, load_s, score_s = scorer.score(kind, path)
            except Exception as exc:  # noqa: BLE001 — recorded; the promote stage refuses on a failed evaluation
                scores[name] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
                log(f"{name}: evaluation FAILED: {scores[name]['error']}")
                continue
            metrics, samples = summarize(results)
            scores[name] = {"status": "ok", "metrics": metrics, "samples": samples}
            timings[name] = {
                "load_s": round(base_load_s if kind == "base" else load_s, 3),
                "score_s": round(score_s, 3),
            }
            write_samples(out_dir / "samples" / name, results)
            write_json_atomic(raw_dir / f"{name}.json", results_file(results))
            log(f"{name}: " + ", ".join(f"{t} {m}" for t, m in metrics.items()))
    if "champion" in scores:
        scores["champion"]["id"] = champion_id(champion_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        out_dir / "scores.json",
        {"tasks": cfg.tasks, "eval_rows": str(eval_rows), "eval_data_sha256": sha256_file(eval_rows), **scores},
    )
    return evaluation_report(scores, timings, tasks_s, base_load_s, time.perf_counter() - started)


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
