"""Stage data: generate the bundled synthetic instruction dataset (seeded, deterministic).

    python -m fineflow.stages.data --train data/raw/train.jsonl --eval data/raw/eval.jsonl

The train file carries a small share of deliberately bad rows (fineflow.data.synth.BAD_KINDS) so that every
validation check has something to catch;
the eval split is clean and disjoint from train. With ``train.objective`` dpo or simpo the rows are preference
pairs: the same prompts, chosen = the right answer, rejected = a plausible wrong one of the same task family
(fineflow.data.synth.WRONG_ANSWERS); with kto, feedback rows: each pair's prompt twice, its right answer labelled
true and its wrong one false. Real users point ``data.train_path`` at their own file.
"""

from __future__ import annotations

from pathlib import Path

from fineflow.core.config import Params
from fineflow.core.entry import run_entry, stage_parser
from fineflow.core.reports import write_jsonl
from fineflow.data.synth import inject_bad_rows, split_train_eval, split_train_eval_feedback, split_train_eval_pairs
from fineflow.objectives import EXAMPLES, FEEDBACK, PAIRS, objective_for

# the bundled rows of each row schema (fineflow.objectives.interface): the same prompts every time
SPLITS = {EXAMPLES: split_train_eval, PAIRS: split_train_eval_pairs, FEEDBACK: split_train_eval_feedback}


def run(params: Params, train_path: Path, eval_path: Path) -> dict:
    cfg = params.data
    schema = objective_for(params.train.objective).rows  # e.g. dpo: preference pairs
    train, evaluation = SPLITS[schema](cfg.n_train, cfg.n_eval, params.seed)
    train_with_bad = inject_bad_rows(train, cfg.bad_row_share, params.seed, evaluation, schema)
    write_jsonl(train_path, train_with_bad)
    write_jsonl(eval_path, evaluation)
    return {
        "train_rows": len(train_with_bad),
        "bad_rows_injected": len(train_with_bad) - len(train),
        "eval_rows": len(evaluation),
    }


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser("data", __doc__)
    parser.add_argument("--train", type=Path, required=True)
    parser.add_argument("--eval", type=Path, required=True)
    args = parser.parse_args(argv)
    return run_entry("data", args, lambda params: run(params, args.train, args.eval))


if __name__ == "__main__":
    raise SystemExit(main())
