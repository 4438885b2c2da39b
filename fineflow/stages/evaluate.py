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

from pathlib import Path

from fineflow.config import Params
from fineflow.evaluate.recipe import evaluate_models
from fineflow.model_ref import resolve_base_model
from fineflow.stages._entry import log, run_entry, stage_parser


def run(
    params: Params,
    base_dir: Path,
    adapter_dir: Path,
    eval_rows: Path,
    out_dir: Path,
    raw_dir: Path,
    champion_dir: Path | None = None,
) -> dict:
    return evaluate_models(
        params.evaluate,
        params.seed,
        resolve_base_model(params.model, base_dir),
        adapter_dir,
        eval_rows,
        out_dir,
        raw_dir,
        champion_dir,
        log=log,
    )


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser("evaluate", __doc__)
    parser.add_argument("--base-dir", type=Path, required=True)
    parser.add_argument("--adapter", type=Path, required=True)
    parser.add_argument("--eval-rows", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--raw-results", type=Path, default=Path("reports/lm_eval"))
    parser.add_argument(
        "--champion",
        type=Path,
        default=None,
        help="the current champion (adapter or model dir with champion.json); evaluated too if present",
    )
    args = parser.parse_args(argv)
    return run_entry(
        "evaluate",
        args,
        lambda p: run(p, args.base_dir, args.adapter, args.eval_rows, args.out, args.raw_results, args.champion),
    )


if __name__ == "__main__":
    raise SystemExit(main())
