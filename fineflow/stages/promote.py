"""Stage promote: the gate between a candidate adapter and the champion.

    python -m fineflow.stages.promote --scores eval/scores.json --adapter models/candidate \
        --champion models/champion --registry models/registry

Compares the candidate's metrics with the current champion's (or the base model's when there is none),
appends the decision and its evidence to ``<registry>/promotions.jsonl``, and on success replaces the
champion directory atomically. The champion and registry persist across runs (``persist: true``).
"""

from __future__ import annotations

import json
from pathlib import Path

from fineflow.config import Params
from fineflow.errors import FineflowError
from fineflow.promotion import (append_log, decide, decision_record, directory_hash, ensure_empty_champion,
                                flatten, install_champion, read_champion)
from fineflow.stages._entry import log, run_stage, stage_parser


def run(params: Params, scores_path: Path, adapter_dir: Path, champion_dir: Path, registry_dir: Path) -> dict:
    cfg = params.promote
    try:
        scores = json.loads(scores_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise FineflowError(f"{scores_path}: cannot read evaluation scores ({exc}); run the evaluate stage") from None
    candidate = flatten(scores["candidate"]["metrics"])
    champion = read_champion(champion_dir)
    if champion is not None:
        reference, reference_name = champion["metrics"], f"champion {champion['candidate_id'][:12]}"
    else:
        reference, reference_name = flatten(scores["base"]["metrics"]), "base model"
    decision = decide(candidate, reference, reference_name, cfg.primary_metric, cfg.min_delta, cfg.max_regression)
    candidate_id = directory_hash(adapter_dir)
    entry = append_log(registry_dir, {"candidate_id": candidate_id, "decision": "promoted" if decision.promote
                                      else "refused", **decision_record(decision), "metrics": candidate,
                                      "params": params.model_dump(mode="json", by_alias=True)})
    ensure_empty_champion(champion_dir)
    if decision.promote:
        install_champion(adapter_dir, champion_dir, {"candidate_id": candidate_id, "metrics": candidate,
                                                     "promotion_seq": entry["seq"]})
    log(("PROMOTED: " if decision.promote else "NOT promoted: ") + decision.reason)
    return {"decision": "promoted" if decision.promote else "refused", "reason": decision.reason,
            "candidate_id": candidate_id, "primary_metric": decision.primary,
            "candidate_value": decision.candidate, "reference_value": decision.reference,
            "reference": reference_name, "log_seq": entry["seq"]}


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser("promote", __doc__)
    parser.add_argument("--scores", type=Path, required=True)
    parser.add_argument("--adapter", type=Path, required=True)
    parser.add_argument("--champion", type=Path, required=True)
    parser.add_argument("--registry", type=Path, required=True)
    args = parser.parse_args(argv)
    return run_stage("promote", args, lambda p: run(p, args.scores, args.adapter, args.champion, args.registry))


if __name__ == "__main__":
    raise SystemExit(main())
