"""What a model's exports are held to (the trained side): its tokenizer, the eval rows rendered as the evaluate
stage renders them, and the token ids it stops on. The exporter builds it once for every format; the GGUF format
builds it itself when it exports a model directory on its own (fineflow.export.gguf.export_model).
"""

from __future__ import annotations

from pathlib import Path

from fineflow.core.config import Params
from fineflow.errors import FineflowError
from fineflow.export.interface import Trained
from fineflow.export.parity import EvalDoc, eval_docs, trained_stop_ids
from fineflow.objectives import objective_for


def rendered_eval_docs(
    eval_rows: Path, tokenizer, work_dir: Path, limit: int | None, pairs: bool = False
) -> list[EvalDoc]:
    """The eval rows with their prompts as the evaluate stage renders them (the training rendering). pairs: the
    rows are preference pairs (a pair objective's eval rows), each answered with its chosen answer."""
    from fineflow.evaluate.harness import render_eval_rows

    if not eval_rows.is_file():
        raise FineflowError(f"{eval_rows}: no eval rows: the parity check answers the evaluate stage's eval docs")
    work_dir.mkdir(parents=True, exist_ok=True)
    docs = eval_docs(render_eval_rows(eval_rows, tokenizer, work_dir / "eval_rows.jsonl", pairs=pairs), limit)
    if not docs:
        raise FineflowError(f"{eval_rows}: no eval rows to check the exports on")
    return docs


def trained_side(model_dir: Path, eval_rows: Path, work_dir: Path, params: Params) -> Trained:
    """What the exports of model_dir are held to: its tokenizer, the eval rows rendered, the ids it stops on."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # the validate stage wrote the eval rows the objective trains on
    pairs = objective_for(params.train.objective).trains_pairs
    docs = rendered_eval_docs(eval_rows, tokenizer, work_dir, params.export.parity_docs, pairs)
    generation_eos = _generation_eos(model_dir, GenerationConfig)
    return Trained(tokenizer, docs, generation_eos, trained_stop_ids(tokenizer, generation_eos))


def _generation_eos(model_dir: Path, generation_config_class) -> int | list[int] | None:
    """generation_config.json's eos_token_id (the ids generation stopped on in evaluation), if the model has one."""
    try:
        return generation_config_class.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        return None
