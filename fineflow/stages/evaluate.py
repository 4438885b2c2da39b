"""Stage evaluate: lm-eval on the held-out split for the base model, the candidate and the champion.

    python -m fineflow.stages.evaluate --base-dir models/base --adapter models/candidate \
        --eval-rows data/validated/eval.jsonl --out eval --champion models/champion \
        --base-fingerprint models/base_fingerprint.json

Writes ``<out>/scores.json`` (deterministic; the promote stage reads it): per model (``base``,
``candidate``, and ``champion`` when ``--champion`` holds an adapter or a model) its status, metrics per
task and per-doc scores, plus the eval rows' sha256. lm-eval's logged samples go to
``<out>/samples/<model>/<task>.jsonl``, its standard results JSON of each model to ``reports/lm_eval/``,
and ``reports/evaluate.json`` gets the metrics and the loading vs scoring time of each model.

With train.objective dpo or simpo the eval rows are preference pairs (prompt, chosen, rejected): the lm-eval tasks
take the chosen answer as their target (the SFT regression guard), and every model is also scored on each pair
(fineflow.evaluate.pair_ranking): the task ``fineflow_preference`` (preference_accuracy, reward_margin; rewards
anchored to the base with train.preference.beta) in scores.json, gated like any other task, and its per-pair scores
in ``<out>/samples/<model>/fineflow_preference.jsonl``. With sft, scores.json is as before, byte for byte.

Before any model loads (fineflow.evaluate.sizing): the models are loaded in the run's compute dtype (the train
stage's resolved precision; fp32 on a CPU), one lm-eval batch is sized, and a model that does not fit one device
is sharded across the visible ones with accelerate's device map, or the stage refuses, saying what to change. A
QLoRA adapter is scored on its 4-bit base or, with ``evaluate.qlora_base: 16bit``, the unquantized one: scores.json
and the report say which (``base_scored``).

A champion whose evaluation fails (a corrupt champion, say) is recorded as ``{"status": "failed", "error":
...}`` and the others go on — promotion refuses to compare with it. A failed base or candidate evaluation fails
the stage (exit 2) and records nothing, so DVC never caches it as a success. Task problems (an unknown name, a
registry task whose dataset is not cached offline) are the user's to fix and stop the stage first.
"""

from __future__ import annotations

from pathlib import Path

from fineflow.core.config import Params
from fineflow.core.entry import log, run_entry, stage_parser
from fineflow.errors import FineflowError
from fineflow.evaluate.reward_ranking import evaluate_scorer
from fineflow.evaluate.scoring import evaluate_models
from fineflow.objectives import objective_for


def check_tracked_task_dirs(task_dirs: list[str], task_root: Path | None) -> None:
    """A task folder DVC does not track would let an edited task hand back the stale evaluation of the old one."""
    if task_root is None:
        return
    root = task_root.resolve()
    outside = [d for d in task_dirs if not Path(d).resolve().is_relative_to(root)]
    if outside:
        raise FineflowError(
            f"params.yaml: evaluate.task_dirs {outside} lie outside {task_root}/, the folder dvc.yaml declares as "
            f"the evaluate stage's dependency: DVC would not see an edit to those tasks and would keep the old "
            f"scores. Move the folders under {task_root}/ (or add them to the evaluate stage's deps in dvc.yaml "
            f"and its --task-root)"
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
    parser.add_argument(
        "--base-fingerprint",
        type=Path,
        default=None,
        help="the fingerprint stage's JSON (the base by content); without it the base's files are hashed here",
    )
    parser.add_argument(
        "--task-root",
        type=Path,
        default=None,
        help="the folder dvc.yaml declares as the stage's dependency for task YAMLs: every evaluate.task_dirs "
        "entry must lie under it (DVC sees no other folder change)",
    )
    parser.add_argument(
        "--reference-logps",
        type=Path,
        default=None,
        help="the reference_logps stage's reference.json: a candidate trained against a reference model has its "
        "rewards measured from its reference when that is the champion",
    )
    args = parser.parse_args(argv)

    def body(params: Params) -> dict:
        check_tracked_task_dirs(params.evaluate.task_dirs, args.task_root)
        objective = objective_for(params.train.objective)
        if not objective.generates:  # a model that scores text (the reward model): its own task alone
            return evaluate_scorer(
                params, objective, args.base_dir, args.adapter, args.eval_rows, args.out, args.raw_results,
                args.base_fingerprint, log,
            )  # fmt: skip
        return evaluate_models(
            params,
            args.base_dir,
            args.adapter,
            args.eval_rows,
            args.out,
            args.raw_results,
            args.champion,
            args.base_fingerprint,
            log=log,
            reference=args.reference_logps,
        )

    return run_entry("evaluate", args, body)


if __name__ == "__main__":
    raise SystemExit(main())
