"""A thin adapter around lm-eval's ``simple_evaluate`` (heavy imports inside functions).

The bundled task folder (``fineflow/evaltasks``) is copied to a working directory with the eval rows'
absolute path filled in, and indexed with ``include_defaults=False`` so lm-eval does not scan its 200+
built-in task folders. The base model is loaded once: it is evaluated plain, then wrapped with the
candidate's LoRA adapter (not merged) and evaluated again.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from fineflow.errors import FineflowError

BUNDLED_TASKS = Path(__file__).parent / "evaltasks"


def prepare_task_dir(work_dir: Path, eval_file: Path, max_gen_toks: int) -> Path:
    """Copy the bundled task YAMLs into work_dir with the eval file's absolute path substituted."""
    shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir(parents=True)
    for source in BUNDLED_TASKS.iterdir():
        if source.suffix == ".yaml":
            text = source.read_text(encoding="utf-8")
            text = text.replace("{eval_file}", str(eval_file.resolve())).replace("{max_gen_toks}", str(max_gen_toks))
            (work_dir / source.name).write_text(text, encoding="utf-8")
        elif source.suffix == ".py":
            shutil.copy(source, work_dir / source.name)
    return work_dir


def task_manager(task_dir: Path, tasks: list[str]):
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise FineflowError(f"params.yaml: evaluate.tasks names unknown task(s) {unknown}; "
                            f"available here: {sorted(manager.all_tasks)}")
    return manager


def summarize(results: dict) -> tuple[dict, dict]:
    """(metrics per task, per-sample scores per task) from an lm-eval results dict."""
    metrics: dict[str, dict[str, float]] = {}
    for task, values in results["results"].items():
        metrics[task] = {key.split(",")[0]: float(v) for key, v in values.items()
                         if "," in key and "_stderr" not in key and isinstance(v, (int, float))}
    samples: dict[str, list[dict]] = {}
    for task, rows in (results.get("samples") or {}).items():
        samples[task] = [{"doc_id": r["doc_id"], "target": r["target"],
                          "prediction": r["filtered_resps"][0] if r["filtered_resps"] else None,
                          **{m: r[m] for m in metrics[task] if m in r}} for r in rows]
    return metrics, samples


def evaluate_model(model, tokenizer, tasks: list[str], manager, batch_size: int, limit: int | None) -> tuple[dict, float]:
    """Run lm-eval on an in-memory model; returns (results dict, seconds spent scoring)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    started = time.perf_counter()
    results = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=True,
                              bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    return results, time.perf_counter() - started
