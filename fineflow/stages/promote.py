"""Stage promote: the gate between a candidate adapter and the champion.

    python -m fineflow.stages.promote --scores eval/scores.json --adapter models/candidate \
        --champion models/champion --registry models/registry --base-dir models/base \
        --shards data/shards --train-report reports/train.json --lineage reports/lineage

Builds the run's lineage manifest, runs the gate (fineflow.registry.gate.promotion_decision: min_delta, paired
bootstrap CI, no regression, refusal on missing/failed/mismatched evaluations or incomplete lineage), keeps the
candidate in the registry by id, appends the decision and its evidence to ``<registry>/promotions.jsonl``, and on
success installs the champion atomically: the PEFT adapter, the merged model (``merged/``; ``promote.merged``:
auto merges only a base of at most ``merged_auto_max_gb``, else the champion is the adapter + its base's identity
and ``python -m fineflow.registry.merge`` builds the merged model shard by shard when asked), the tokenizer,
a model card (``README.md``) and the deterministic lineage (``lineage.json``). With ``export.block_promotion``, the
assembled champion's GGUF exports must pass the parity check first (on ``--eval-rows``). The full manifest (with git,
times, user, host) goes to ``<lineage>/<candidate id>.json``, outside DVC's outputs. The procedure is
``fineflow.registry.champion.promote``.

With ``promote.require_approval``, a candidate the gate passes waits for a person: without an answer in
FINEFLOW_APPROVAL the stage writes nothing, records the gate's evidence and exits ``APPROVAL_NEEDED_EXIT`` (3;
the Prefect flow pauses for the answer and runs the stage again with it; fineflow.registry.approval).

Only the project's own workspace promotes: a DVC experiment run from the queue (in a copy of the project) stops
here with a user error that says how to promote it (queue experiments up to ``evaluate``, compare them with
``dvc exp show``, ``dvc exp apply`` the best one and ``dvc repro``, which runs promote in the workspace). Its
registry and champion are copies: a promotion there would be lost, or applied later over the real ones.
"""

from __future__ import annotations

from pathlib import Path

from fineflow.core.config import Params
from fineflow.core.entry import log, run_entry, stage_parser, user_error
from fineflow.core.workspace import queued_experiment
from fineflow.errors import USER_ERROR_EXIT, FineflowError
from fineflow.export.gguf import parity_before_promotion
from fineflow.registry.approval import approval_from_env
from fineflow.registry.champion import promote


def queued_experiment_refusal() -> FineflowError | None:
    """The error for promote in a queued DVC experiment's copy of the project (workspace.queued_experiment)."""
    experiment = queued_experiment()
    if experiment is None:
        return None
    name, project = experiment
    return FineflowError(
        f"promote does not run in the queued DVC experiment '{name}': only the workspace {project} writes the "
        "registry and installs the champion. Queue experiments up to evaluate (`dvc exp run --queue -S ... "
        f"evaluate`), compare them with `dvc exp show`, then `dvc exp apply {name}` and `dvc repro` in the "
        "workspace: it runs promote on this experiment's candidate (already in the cache: nothing retrains)."
    )


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser("promote", __doc__)
    parser.add_argument("--scores", type=Path, required=True)
    parser.add_argument("--adapter", type=Path, required=True)
    parser.add_argument("--champion", type=Path, required=True)
    parser.add_argument("--registry", type=Path, required=True)
    parser.add_argument("--base-dir", type=Path, help="the base model dir (merged model, tokenizer, card)")
    parser.add_argument(
        "--shards",
        type=Path,
        default=Path("data/shards"),
        help="shards dir: tokenizer/template hashes for the lineage (default: data/shards)",
    )
    parser.add_argument("--train-report", type=Path, help="reports/train.json: wall time and tokens/s for the card")
    parser.add_argument("--eval-rows", type=Path, help="the eval rows export.block_promotion's parity check answers")
    parser.add_argument(
        "--lineage",
        type=Path,
        default=Path("reports/lineage"),
        help="where the full lineage manifest <candidate id>.json goes (default: reports/lineage)",
    )
    args = parser.parse_args(argv)
    refusal = queued_experiment_refusal()
    if refusal is not None:  # at once: not after waiting, maybe for hours, for the project's workspace
        user_error("promote", args.report, refusal)
        return USER_ERROR_EXIT

    def promote_in_this_workspace(params: Params) -> dict:
        return promote(
            params,
            args.scores,
            args.adapter,
            args.champion,
            args.registry,
            args.base_dir,
            args.train_report,
            args.lineage,
            args.shards,
            log=log,
            approval=approval_from_env(),  # a person's answer (promote.require_approval), given by the flow
            eval_rows=args.eval_rows,
            parity_check=parity_before_promotion,  # export.block_promotion: the export's own parity check
        )

    return run_entry("promote", args, promote_in_this_workspace)


if __name__ == "__main__":
    raise SystemExit(main())
