"""``fineflow reward score FILE``: each row of a JSONL file scored by the registry's champion reward model (for
data filtering, or an online-RL loop's rewards).

A row is a prompt and the answer to score, as the training rows are: ``instruction`` (and ``input``) with
``output``, or ``messages`` ending in the assistant's answer. Each is rendered and cut as the tokenize stage
renders and cuts a pair's answer (the champion's tokenizer and chat template, its tokenize.seq_len) and scored alone;
the row is written back with a float ``reward`` beside its fields. Every row is checked before the model loads: a
malformed one is an error naming ``FILE:LINE: field``.

The champion is the registry's champion of the reward kind (fineflow.registry.store: a champion per model kind),
installed in the registry at ``champions/<kind>/``: its adapter, head and tokenizer, and champion.json naming its
base, scored on that base (or --base-dir).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fineflow.errors import FineflowError

SEQ_LEN = 512  # a champion whose lineage records no tokenize.seq_len (params.yaml's default)


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

    objective, champion_dir, record = reward_champion(args.registry)
    rows = read_rows(args.file)  # every row checked before anything loads
    rewards = score_rows(objective, champion_dir, record, rows, args.base_dir, args.batch_size, args.file)
    lines = "".join(
        json.dumps({**row, "reward": round(float(r), 6)}, ensure_ascii=False) + "\n" for row, r in zip(rows, rewards)
    )
    if args.out is None:
        sys.stdout.write(lines)
    else:
        write_text_atomic(args.out, lines)
        print(f"{len(rows)} rows scored by reward model {record['candidate_id']}: {args.out}", file=sys.stderr)
    return 0


def scoring_objective():
    """The objective that trains the reward kind of model (fineflow.objectives asked, never named)."""
    from fineflow.objectives import OBJECTIVES
    from fineflow.objectives.reward_model import REWARD

    return next(objective for objective in OBJECTIVES.values() if objective.model_kind == REWARD)


def reward_champion(registry_dir: Path):
    """(the objective, the installed champion reward model's directory, its champion.json); a FineflowError that
    says what to do when there is none, or it is not the one the registry's alias names."""
    from fineflow.registry.install import read_champion
    from fineflow.registry.store import alias_id, kind_champion_dir

    objective = scoring_objective()
    cid = alias_id(registry_dir, objective.model_kind)
    if cid is None:
        raise FineflowError(
            f"{registry_dir}: no champion {objective.model_kind} model: train one (train.objective "
            f"{objective.name}, promote.primary_metric {objective.eval_task}/pairwise_accuracy) and let promote "
            "install it"
        )
    champion_dir = kind_champion_dir(registry_dir, objective.model_kind)
    record = read_champion(champion_dir) or {}
    if record.get("candidate_id") != cid:
        raise FineflowError(
            f"{champion_dir}: holds {record.get('candidate_id') or 'no champion'}, but the registry's champion "
            f"{objective.model_kind} model is {cid}: run `fineflow registry repair`"
        )
    return objective, champion_dir, record


def read_rows(path: Path) -> list[dict]:
    """The file's rows, each a prompt and its answer; a FineflowError naming FILE:LINE: field for the first that
    is not one."""
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


def row_problem(row) -> str | None:
    """Why a row is not a prompt with its answer (the field, and what it needs), or None."""
    if not isinstance(row, dict):
        return "a row must be a JSON object (instruction/input/output, or messages)"
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return "messages: a list of {role, content} objects"
        last = messages[-1]
        if last.get("role") != "assistant" or not isinstance(last.get("content"), str) or not last["content"]:
            return "messages: the last message must be the assistant's answer to score (role assistant, content text)"
        return None
    for field in ("instruction", "output"):
        if not isinstance(row.get(field), str) or not row[field]:
            return f"{field}: a non-empty string (the prompt and the answer to score; or messages)"
    if not isinstance(row.get("input") or "", str):
        return "input: a string (or absent)"
    return None


def score_rows(objective, champion_dir: Path, record: dict, rows: list[dict], base_dir, batch_size: int, path: Path):
    """Each row's reward under the champion on its base (base_dir, else the one its champion.json names)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fineflow.tokenize.template import RenderError, encode_batch

    base = base_dir or record.get("base_model")
    if not base:
        raise FineflowError(f"{champion_dir}/champion.json names no base model: pass --base-dir")
    tokenizer = AutoTokenizer.from_pretrained(champion_dir)
    try:  # the answer trained, as a pair's answer is (fineflow.evaluate.pair_ranking.encode_answers)
        encoded = encode_batch(tokenizer, rows, train_on="last_assistant")
    except RenderError as exc:
        raise FineflowError(f"{path}: {exc}") from None
    scorer = objective.load_trained(AutoModelForCausalLM.from_pretrained(base).eval(), champion_dir)
    return objective.score_examples(scorer, encoded, batch_size, trained_seq_len(champion_dir))


def trained_seq_len(champion_dir: Path) -> int:
    """tokenize.seq_len of the champion's training run (its lineage.json's params), where answers are cut."""
    try:
        params = json.loads((champion_dir / "lineage.json").read_text(encoding="utf-8")).get("params") or {}
    except (OSError, json.JSONDecodeError):
        return SEQ_LEN
    return int((params.get("tokenize") or {}).get("seq_len") or SEQ_LEN)
