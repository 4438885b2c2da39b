"""Stage evaluate: lm-eval on the held-out split for the base model and the fine-tuned candidate.

    python -m fineflow.stages.evaluate --base-dir models/base --adapter models/candidate \
        --eval-rows data/validated/eval.jsonl --out eval

Writes ``<out>/scores.json`` (metrics per model and task plus per-sample predictions; deterministic, the
promote stage reads it) and ``reports/evaluate.json`` (the same metrics plus timings). The raw lm-eval
results of each model are kept beside the report under ``reports/lm_eval/``.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from fineflow.basemodel import resolve_base_model
from fineflow.config import Params
from fineflow.evaluation import evaluate_model, prepare_task_dir, summarize, task_manager
from fineflow.reports import write_json_atomic
from fineflow.stages._entry import log, run_stage, stage_parser


def run(params: Params, base_dir: Path, adapter_dir: Path, eval_rows: Path, out_dir: Path,
        raw_dir: Path) -> dict:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = params.evaluate
    torch.manual_seed(params.seed)
    reference = resolve_base_model(params.model, base_dir)
    with tempfile.TemporaryDirectory(prefix="fineflow-tasks-") as tmp:
        manager = task_manager(prepare_task_dir(Path(tmp) / "tasks", eval_rows, cfg.max_gen_toks), cfg.tasks)
        t0 = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(reference)
        base = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
        load_s = time.perf_counter() - t0
        scores, timings = {}, {}
        for name in ("base", "candidate"):
            if name == "candidate":
                t0 = time.perf_counter()
                if (adapter_dir / "adapter_config.json").exists():  # wrap the loaded base: adapter not merged
                    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
                else:  # train.method full: the candidate is a whole model
                    model = AutoModelForCausalLM.from_pretrained(adapter_dir, dtype=torch.float32).eval()
                load_s += time.perf_counter() - t0
            else:
                model = base
            results, seconds = evaluate_model(model, tokenizer, cfg.tasks, manager, cfg.batch_size, cfg.limit)
            metrics, samples = summarize(results)
            scores[name] = {"metrics": metrics, "samples": samples}
            timings[f"{name}_score_s"] = round(seconds, 3)
            write_json_atomic(raw_dir / f"{name}.json", json.loads(json.dumps(results, default=str)))
            log(f"{name}: " + ", ".join(f"{t} {m}" for t, m in metrics.items()))
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / "scores.json", {"tasks": cfg.tasks, "eval_rows": str(eval_rows), **scores})
    summary = {name: {f"{task}/{metric}": value for task, m in scores[name]["metrics"].items()
                      for metric, value in m.items()} for name in scores}
    return {**summary, "load_s": round(load_s, 3), **timings}


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser("evaluate", __doc__)
    parser.add_argument("--base-dir", type=Path, required=True)
    parser.add_argument("--adapter", type=Path, required=True)
    parser.add_argument("--eval-rows", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--raw-results", type=Path, default=Path("reports/lm_eval"))
    args = parser.parse_args(argv)
    return run_stage("evaluate", args, lambda p: run(p, args.base_dir, args.adapter, args.eval_rows, args.out,
                                                     args.raw_results))


if __name__ == "__main__":
    raise SystemExit(main())
