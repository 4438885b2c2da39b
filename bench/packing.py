"""Real-token share of three batching strategies, side by side, on the bundled data and a long-tailed
length distribution.

    .venv/bin/python bench/packing.py [--rows data/validated/train.jsonl] [--base-dir models/base]

real-token share = non-pad tokens / tokens in the batches the model computes on. Strategies:
  pad-to-max      every example padded to seq_len (what a fixed-shape loader does)
  pad-to-longest  batches of --batch examples in data order, padded to the longest in the batch
  best-fit        best-fit-decreasing packing into rows of seq_len (the classic bin-packing heuristic)
  packed          fineflow's packing (fineflow.tokenize.shards.pack_rows: the better of best-fit-decreasing and
                  exact-fill, which fills each row's gap with a subset-sum over the lengths left)
The bundled data needs the tokenize stage's inputs (run `make run` first); the long-tailed distribution is
synthetic (log-normal lengths, the shape of real instruction datasets: most short, a few very long).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fineflow.tokenize.shards import pack_best_fit, pack_rows  # noqa: E402


def shares(lengths: list[int], seq_len: int, batch: int) -> dict[str, float]:
    truncated = sum(n > seq_len for n in lengths) / len(lengths)
    lengths = [min(n, seq_len) for n in lengths]
    real = sum(lengths)
    pad_to_longest = sum(
        max(lengths[i : i + batch]) * len(lengths[i : i + batch]) for i in range(0, len(lengths), batch)
    )
    best_fit, packed = pack_best_fit(lengths, seq_len), pack_rows(lengths, seq_len)
    return {
        "pad-to-max": real / (len(lengths) * seq_len),
        "pad-to-longest": real / pad_to_longest,
        "best-fit": real / (len(best_fit) * seq_len),
        "packed": real / (len(packed) * seq_len),
        "truncated": truncated,
    }


def bundled_lengths(rows_path: Path, base_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    from fineflow.tokenize.template import encode_example

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    rows = [json.loads(line) for line in rows_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [len(encode_example(tokenizer, r["instruction"], r["input"], r["output"])[0]) for r in rows]


def long_tailed_lengths(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [max(8, int(x)) for x in rng.lognormal(mean=5.0, sigma=0.9, size=n)]  # median ~150, p99 ~1,200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=Path, default=Path("data/validated/train.jsonl"))
    parser.add_argument("--base-dir", type=Path, default=Path("models/base"))
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    datasets = {"long-tailed (20k, log-normal)": long_tailed_lengths(20_000)}
    if args.rows.exists() and args.base_dir.exists():
        datasets = {"bundled train split": bundled_lengths(args.rows, args.base_dir), **datasets}
    else:
        print(f"(no {args.rows} / {args.base_dir}: run `make run` first for the bundled data)")
    print(
        f"{'data':32} {'seq_len':>7} {'pad-to-max':>11} {'pad-to-longest':>15} {'best-fit':>9} {'packed':>8} "
        f"{'truncated':>10}"
    )
    for name, lengths in datasets.items():
        for seq_len in (256, 512, 1024, 2048):
            s = shares(lengths, seq_len, args.batch)
            print(
                f"{name:32} {seq_len:7d} {s['pad-to-max']:11.1%} {s['pad-to-longest']:15.1%} {s['best-fit']:9.1%} "
                f"{s['packed']:8.1%} {s['truncated']:10.1%}"
            )


if __name__ == "__main__":
    main()
