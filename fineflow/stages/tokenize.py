"""Stage tokenize: validated rows -> packed, memory-mapped train and eval shards.

    python -m fineflow.stages.tokenize --rows data/validated --base-dir models/base --out data/shards

Reads ``<rows>/train.jsonl`` and ``<rows>/eval.jsonl``, renders each with the prompt template (or the
tokenizer's chat template for chat rows), and writes ``<out>/train`` and ``<out>/eval`` shard directories
(see fineflow.shards for the format).

Content-addressed: each shard's meta.json records a key over the rows file's bytes, the tokenizer, the
template and the packing parameters. A split whose existing shard has the same key is left as it is (no
work), e.g. when DVC re-runs the stage because the base model's weights changed but its tokenizer did
not; anything else is rebuilt into a temporary directory and swapped in only when complete.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from fineflow import __version__
from fineflow.basemodel import resolve_base_model
from fineflow.config import Params
from fineflow.reports import sha256_file
from fineflow.shards import FORMAT_VERSION, shard_key_matches, token_dtype, tokenizer_hash
from fineflow.stages._entry import log, run_stage, stage_parser
from fineflow.template import template_hash
from fineflow.tokenization import read_lines, tokenize_to_shard


def load_tokenizer(reference: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reference)
    if tokenizer.eos_token_id is None:
        from fineflow.errors import FineflowError

        raise FineflowError(f"{reference}: the tokenizer has no EOS token; fine-tuning needs one to end responses")
    return tokenizer


def content_key(rows_path: Path, tokenizer, cfg) -> str:
    """What a shard is a function of: the rows, the tokenizer, the template, the packing and the format.
    (Not the worker count: it does not change a byte.)"""
    parts = [sha256_file(rows_path), tokenizer_hash(tokenizer), template_hash(tokenizer), str(cfg.seq_len),
             str(cfg.pack_window), str(FORMAT_VERSION)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def tokenize_split(tokenizer, reference: str, rows_path: Path, out_dir: Path, cfg) -> dict:
    """Build one split's shard, or keep the existing one when its content key matches."""
    key = content_key(rows_path, tokenizer, cfg)
    existing = shard_key_matches(out_dir, key)
    if existing is not None:
        return {**existing, "reused": True}
    meta = {"vocab_size": len(tokenizer), "tokenizer_hash": tokenizer_hash(tokenizer),
            "template_hash": template_hash(tokenizer), "code_version": __version__, "content_key": key}
    building = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(building, ignore_errors=True)
    meta = tokenize_to_shard(read_lines(rows_path), tokenizer, reference, building, cfg.seq_len,
                             token_dtype(len(tokenizer)), cfg.workers, cfg.pack_window, meta)
    shutil.rmtree(out_dir, ignore_errors=True)  # a reader never sees a mix: meta.json is written last
    os.replace(building, out_dir)
    return {**meta, "reused": False}


def run(params: Params, rows_dir: Path, base_dir: Path, out_dir: Path) -> dict:
    reference = resolve_base_model(params.model, base_dir)
    tokenizer = load_tokenizer(reference)
    report = {}
    for split in ("train", "eval"):
        meta = tokenize_split(tokenizer, reference, rows_dir / f"{split}.jsonl", out_dir / split, params.tokenize)
        log(f"{split}: {meta['examples']} examples -> {meta['rows']} packed rows of {meta['seq_len']}, "
            f"real-token share {meta['real_token_share']:.1%}"
            + (f" (up to date: content key {meta['content_key']}, nothing to do)" if meta["reused"] else ""))
        report[split] = {k: meta[k] for k in ("examples", "rows", "real_tokens", "trained_tokens",
                                              "real_token_share", "truncated_examples", "content_key", "reused")}
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
