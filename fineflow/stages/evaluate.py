"""Stage evaluate: lm-eval on the held-out split for the base model, the candidate and the champion.

    python -m fineflow.stages.evaluate --base-dir models/base --adapter models/candidate \
        --eval-rows data/validated/eval.jsonl --out eval --champion models/champion

Writes ``<out>/scores.json`` (deterministic; the promote stage reads it): per model (``base``,
``candidate``, and ``champion`` when ``--champion`` holds an adapter or a model) its status, metrics per
task and per-doc scores, plus the eval rows' sha256. lm-eval's logged samples go to
``<out>/samples/<model>/<task>.jsonl``, its standard results JSON of each model to ``reports/lm_eval/``,
and ``reports/evaluate.json`` gets the metrics and the loading vs scoring time of each model.

A model whose evaluation fails (a corrupt champion, say) is recorded as ``{"status": "failed", "error":
...}`` and the others go on — promotion refuses on a failed evaluation. Task problems (an unknown name, a
registry task whose dataset is not cached offline) are the user's to fix and stop the stage first.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from fineflow.model_ref import resolve_base_model
from fineflow.config import Params
from fineflow.errors import FineflowError
from fineflow.evaluate.harness import (ModelScorer, champion_id, check_tasks, find_model, prepare_task_dir, resolve_tasks,
                                 results_file, summarize, write_samples)
from fineflow.reports import sha256_file, write_json_atomic
from fineflow.stages._entry import log, run_entry, stage_parser


def run(params: Params, base_dir: Path, adapter_dir: Path, eval_rows: Path, out_dir: Path, raw_dir: Path,
        champion_dir: Path | None = None) -> dict:
    import torch

    cfg = params.evaluate
    torch.manual_seed(params.seed)
    candidate = find_model(adapter_dir)
    if candidate is None:
        raise FineflowError(f"{adapter_dir}: no adapter (adapter_config.json) or model (config.json) to evaluate; "
                            f"run the train stage")
    models = {"base": ("base", None), "candidate": candidate}
    champion = find_model(champion_dir)
    if champion is not None:
        models["champion"] = champion
    shutil.rmtree(out_dir / "samples", ignore_errors=True)  # no stale champion samples from an earlier run
    for name in ("base", "candidate", "champion"):
        (raw_dir / f"{name}.json").unlink(missing_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fineflow-tasks-") as tmp:
        manager, registry = resolve_tasks(cfg.tasks, prepare_task_dir(Path(tmp) / "tasks", eval_rows,
                                                                      cfg.max_gen_toks), cfg.task_dirs)
        check_tasks(manager, cfg.tasks, registry)
        tasks_s = time.perf_counter() - started
        scorer = ModelScorer(resolve_base_model(params.model, base_dir), cfg.tasks, manager, cfg.batch_size,
                             cfg.limit)
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
            timings[name] = {"load_s": round(base_load_s if kind == "base" else load_s, 3),
                             "score_s": round(score_s, 3)}
            write_samples(out_dir / "samples" / name, results)
            write_json_atomic(raw_dir / f"{name}.json", results_file(results))
            log(f"{name}: " + ", ".join(f"{t} {m}" for t, m in metrics.items()))
    if "champion" in scores:
        scores["champion"]["id"] = champion_id(champion_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / "scores.json", {
        "tasks": cfg.tasks, "eval_rows": str(eval_rows),
        "eval_data_sha256": sha256_file(eval_rows), **scores})
    return report(scores, timings, tasks_s, base_load_s, time.perf_counter() - started)


def report(scores: dict, timings: dict, tasks_s: float, base_load_s: float, eval_s: float) -> dict:
    """Flat metrics per model ({"task/metric": value}; {} if it failed), and where the time went: indexing and
    building the tasks, loading models, scoring them, and the rest (summaries, writing samples and results)."""
    flat = {name: {f"{task}/{metric}": value for task, m in s.get("metrics", {}).items() for metric, value in m.items()}
            for name, s in scores.items()}
    per_model = {name: {"status": s["status"], **timings.get(name, {}),
                        **{key: s[key] for key in ("id", "error") if key in s}} for name, s in scores.items()}
    load_s = base_load_s + sum(t["load_s"] for name, t in timings.items() if name != "base")
    score_s = sum(t["score_s"] for t in timings.values())
    return {**flat, "models": per_model, "tasks_s": round(tasks_s, 3), "load_s": round(load_s, 3),
            "score_s": round(score_s, 3), "other_s": round(eval_s - tasks_s - load_s - score_s, 3),  # writing
            "eval_s": round(eval_s, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser("evaluate", __doc__)
    parser.add_argument("--base-dir", type=Path, required=True)
    parser.add_argument("--adapter", type=Path, required=True)
    parser.add_argument("--eval-rows", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--raw-results", type=Path, default=Path("reports/lm_eval"))
    parser.add_argument("--champion", type=Path, default=None,
                        help="the current champion (adapter or model dir with champion.json); evaluated too if present")
    args = parser.parse_args(argv)
    return run_entry("evaluate", args, lambda p: run(p, args.base_dir, args.adapter, args.eval_rows, args.out,
                                                     args.raw_results, args.champion))


if __name__ == "__main__":
    raise SystemExit(main())
