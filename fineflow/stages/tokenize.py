"""Stage tokenize: validated rows -> packed, memory-mapped train and eval shards.

    python -m fineflow.stages.tokenize --rows data/validated --base-dir models/base --out data/shards

Reads ``<rows>/train.jsonl`` and ``<rows>/eval.jsonl``, renders each with the prompt template (or the
tokenizer's chat template for chat rows: every assistant turn trained, or only the last, as
``tokenize.train_on`` says; fineflow.tokenize.conversation), and writes ``<out>/train`` and ``<out>/eval``
shard directories (see fineflow.tokenize.shards for the format). A conversation is one example: packed
whole into one row, attending only to itself. With ``train.objective`` dpo or simpo the rows are preference
pairs and each pair is packed whole into one row, prompt + chosen then prompt + rejected
(fineflow.tokenize.pairs).

Content-addressed: each shard's meta.json records a key over the rows file's bytes, the tokenizer, the
template and the packing parameters. A split whose existing shard has the same key is left as it is (no
work), e.g. when DVC re-runs the stage because the base model's weights changed but its tokenizer did
not; anything else is rebuilt into a temporary directory and swapped in only when complete.
"""

from __future__ import annotations

from pathlib import Path

from fineflow.base_source import resolve_base_model
from fineflow.core.config import Params
from fineflow.core.entry import log, run_entry, stage_parser
from fineflow.core.threads import process_plan
from fineflow.tokenize.tokenization import load_tokenizer, tokenize_split


def run(params: Params, rows_dir: Path, base_dir: Path, out_dir: Path) -> dict:
    reference = resolve_base_model(params.model, base_dir)
    tokenizer = load_tokenizer(reference)
    report = {}
    for split in ("train", "eval"):
        rows = rows_dir / f"{split}.jsonl"
        meta = tokenize_split(tokenizer, reference, rows, out_dir / split, params.tokenize, params.train.objective)
        log(
            f"{split}: {meta['examples']} examples -> {meta['rows']} packed rows of {meta['seq_len']}, "
            f"real-token share {meta['real_token_share']:.1%}"
            + (f" (up to date: content key {meta['content_key']}, nothing to do)" if meta["reused"] else "")
        )
        report[split] = {
            k: meta[k]
            for k in (
                "examples",
                "rows",
                "real_tokens",
                "trained_tokens",
                "real_token_share",
                "truncated_examples",
                "content_key",
                "reused",
            )
        }
        if "pairs" in meta:  # a preference shard: two examples per pair
            report[split]["pairs"] = meta["pairs"]
    train = report["train"]
    return {
        "examples": train["examples"],
        "tokens": train["real_tokens"],
        "real_token_share": train["real_token_share"],
        **report,
    }


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser("tokenize", __doc__)
    parser.add_argument("--rows", type=Path, required=True)
    parser.add_argument("--base-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    return run_entry("tokenize", args, lambda p: run(p, args.rows, args.base_dir, args.out), threads=tokenizer_threads)


def tokenizer_threads(params: Params):
    """Each of the tokenize.workers processes its share of the usable CPUs (fineflow.core.threads)."""
    return process_plan(params.tokenize.workers)


if __name__ == "__main__":
    raise SystemExit(main())
