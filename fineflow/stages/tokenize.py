"""Stage tokenize: validated rows -> packed, memory-mapped train and eval shards.

    python -m fineflow.stages.tokenize --rows data/validated --base-dir models/base --out data/shards

Reads ``<rows>/train.jsonl`` and ``<rows>/eval.jsonl``, renders each with the prompt template, and writes
``<out>/train`` and ``<out>/eval`` shard directories (see fineflow.shards for the format).
"""

from __future__ import annotations

from pathlib import Path

from fineflow import __version__
from fineflow.basemodel import resolve_base_model
from fineflow.config import Params
from fineflow.shards import token_dtype, tokenizer_hash
from fineflow.stages._entry import log, run_stage, stage_parser
from fineflow.template import template_hash
from fineflow.tokenization import read_rows_lazily, tokenize_to_shard


def load_tokenizer(reference: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reference)
    if tokenizer.eos_token_id is None:
        from fineflow.errors import FineflowError

        raise FineflowError(f"{reference}: the tokenizer has no EOS token; fine-tuning needs one to end responses")
    return tokenizer


def tokenize_split(tokenizer, reference: str, rows_path: Path, out_dir: Path, cfg) -> dict:
    meta = {"vocab_size": len(tokenizer), "tokenizer_hash": tokenizer_hash(tokenizer),
            "template_hash": template_hash(), "code_version": __version__, "source": str(rows_path)}
    return tokenize_to_shard(read_rows_lazily(rows_path), tokenizer, reference, out_dir, cfg.seq_len,
                             token_dtype(len(tokenizer)), cfg.workers, cfg.pack_window, meta)


def run(params: Params, rows_dir: Path, base_dir: Path, out_dir: Path) -> dict:
    reference = resolve_base_model(params.model, base_dir)
    tokenizer = load_tokenizer(reference)
    report = {}
    for split in ("train", "eval"):
        meta = tokenize_split(tokenizer, reference, rows_dir / f"{split}.jsonl", out_dir / split, params.tokenize)
        log(f"{split}: {meta['examples']} examples -> {meta['rows']} packed rows of {meta['seq_len']}, "
            f"real-token share {meta['real_token_share']:.1%}")
        report[split] = {k: meta[k] for k in ("examples", "rows", "real_tokens", "trained_tokens",
                                              "real_token_share", "truncated_examples")}
    train = report["train"]
    return {"examples": train["examples"], "tokens": train["real_tokens"],
            "real_token_share": train["real_token_share"], **report}


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser("tokenize", __doc__)
    parser.add_argument("--rows", type=Path, required=True)
    parser.add_argument("--base-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    return run_stage("tokenize", args, lambda p: run(p, args.rows, args.base_dir, args.out))


if __name__ == "__main__":
    raise SystemExit(main())
