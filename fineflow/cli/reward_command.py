"""``fineflow reward score FILE``: each row of a JSONL file scored by the registry's champion reward model (for
data filtering, or an online-RL loop's rewards).

A row is a prompt and the answer to score, as the training rows are: ``instruction`` (and ``input``) with
``output``, or ``messages`` ending in the assistant's answer. Each is rendered and cut as the tokenize stage
renders and cuts a pair's answer (the champion's tokenizer and chat template, its tokenize.seq_len) and scored alone;
the row is written back with a float ``reward`` beside its fields. Every row is checked before the model loads: a
malformed one is an error naming ``FILE:LINE: field``.

The champion is the registry's champion of the reward kind, installed in the registry at ``champions/<kind>/``,
scored on the base its champion.json names (or --base-dir): found, loaded and run by
fineflow.registry.reward_champion, which the online-RL reward of the same name uses too. This module is the
command's I/O: the parser, reading and checking the file, writing the scored rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fineflow.errors import FineflowError


def add_parser(sub) -> None:
    p = sub.add_parser("reward", help="use the champion reward model", description=__doc__.split("\n")[0])
    actions = p.add_subparsers(dest="reward_command", required=True)
    score = actions.add_parser(
        "score",
        help="score each row of a JSONL file with the champion reward model",
        description=__doc__.split("\n\n", 1)[1],
        epilog="Exit codes: 0 scored; 2 on a malformed row, or when the registry has no champion reward model.",
    )
    score.add_argument("file", type=Path, help="JSONL rows: instruction/input/output, or messages ending in the answer")
    score.add_argument("--out", type=Path, help="where to write the scored rows (default: standard output)")
    score.add_argument("--registry", type=Path, default=Path("models/registry"), help="default: models/registry")
    score.add_argument("--base-dir", help="the base model to load the champion on (default: the one it names)")
    score.add_argument("--batch-size", type=int, default=8, help="rows scored together (default: 8)")
    score.set_defaults(run=_run_score)


def _run_score(args) -> int:
    from fineflow.core.reports import write_text_atomic
    from fineflow.registry.reward_champion import ChampionScorer, reward_champion

    objective, champion_dir, record = reward_champion(args.registry)
    rows = read_rows(args.file)  # every row checked before anything loads
    scorer = ChampionScorer(objective, champion_dir, record, args.base_dir)
    rewards = scorer.score(rows, args.batch_size, where=str(args.file))
    lines = "".join(
        json.dumps({**row, "reward": round(float(r), 6)}, ensure_ascii=False) + "\n" for row, r in zip(rows, rewards)
    )
    if args.out is None:
        sys.stdout.write(lines)
    else:
        write_text_atomic(args.out, lines)
        print(f"{len(rows)} rows scored by reward model {record['candidate_id']}: {args.out}", file=sys.stderr)
    return 0


def read_rows(path: Path) -> list[dict]:
    """The file's rows, each a prompt and its answer; a FineflowError naming FILE:LINE: field for the first that
    is not one."""
    from fineflow.registry.reward_champion import row_problem

    if not path.is_file():
        raise FineflowError(f"{path}: no such file")
    rows = []
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise FineflowError(f"{path}:{number}: not JSON ({exc.msg})") from None
            problem = row_problem(row)
            if problem:
                raise FineflowError(f"{path}:{number}: {problem}")
            rows.append(row)
    if not rows:
        raise FineflowError(f"{path}: no rows to score")
    return rows
