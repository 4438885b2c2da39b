"""The registry's champion reward model, found, loaded on its base and run on rows: what ``fineflow reward score``
(fineflow/cli/reward_command.py) and the online-RL reward of that name (fineflow/rewards/reward_model.py) share.

The champion is the registry's champion of the reward kind (fineflow.registry.store: a champion per model kind),
installed in the registry at ``champions/<kind>/``: its adapter, head and tokenizer, and champion.json naming its
base. A row is a prompt and the answer to score, as the training rows are: ``instruction`` (and ``input``) with
``output``, or ``messages`` ending in the assistant's answer; it is rendered and cut as the tokenize stage renders
and cuts a pair's answer (the champion's tokenizer and chat template, its training run's tokenize.seq_len) and
scored alone.

    scorer = ChampionScorer.load(Path("models/registry"))
    scorer.score(rows, batch_size=8)  # float64 numpy, one reward per row
"""

from __future__ import annotations

import json
from pathlib import Path

from fineflow.errors import FineflowError

SEQ_LEN = 512  # a champion whose lineage records no tokenize.seq_len (params.yaml's default)


def scoring_objective():
    """The objective that trains the reward kind of model, from its own module: the registry of objectives
    (fineflow.objectives) holds objectives whose settings use fineflow.rewards, which loads this module."""
    from fineflow.objectives.reward_model import RewardModel

    return RewardModel()


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


def trained_seq_len(champion_dir: Path) -> int:
    """tokenize.seq_len of the champion's training run (its lineage.json's params), where answers are cut."""
    try:
        params = json.loads((champion_dir / "lineage.json").read_text(encoding="utf-8")).get("params") or {}
    except (OSError, json.JSONDecodeError):
        return SEQ_LEN
    return int((params.get("tokenize") or {}).get("seq_len") or SEQ_LEN)


class ChampionScorer:
    """The champion reward model loaded once on its base (``base_dir``, else the one its champion.json names), on
    ``device`` ("cpu", "cuda", ...; None: the CPU); ``score`` renders, cuts and scores rows, call after call."""

    def __init__(self, objective, champion_dir: Path, record: dict, base_dir=None, device: str | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base = base_dir or record.get("base_model")
        if not base:
            raise FineflowError(f"{champion_dir}/champion.json names no base model: pass --base-dir")
        self.objective, self.champion_dir, self.candidate_id = objective, champion_dir, record.get("candidate_id")
        self.tokenizer = AutoTokenizer.from_pretrained(champion_dir)
        model = AutoModelForCausalLM.from_pretrained(base).eval()
        self.model = objective.load_trained(model.to(device) if device else model, champion_dir)
        self.seq_len = trained_seq_len(champion_dir)

    @classmethod
    def load(cls, registry_dir: Path, base_dir=None, device: str | None = None) -> ChampionScorer:
        """The registry's champion reward model, loaded (a FineflowError when there is none)."""
        objective, champion_dir, record = reward_champion(registry_dir)
        return cls(objective, champion_dir, record, base_dir, device)

    def score(self, rows: list[dict], batch_size: int = 8, where: str = "rows"):
        """Each row's reward (float64 numpy); a FineflowError naming ``where`` for a row its template rejects."""
        from fineflow.tokenize.template import RenderError, encode_batch

        try:  # the answer trained, as a pair's answer is (fineflow.evaluate.pair_ranking.encode_answers)
            encoded = encode_batch(self.tokenizer, rows, train_on="last_assistant")
        except RenderError as exc:
            raise FineflowError(f"{where}: {exc}") from None
        return self.objective.score_examples(self.model, encoded, batch_size, self.seq_len)
