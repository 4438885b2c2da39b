"""Tokenization throughput and memory, side by side in one run.

    .venv/bin/python bench/tokenization.py [--rows 1000000] [--base-dir models/base]

1. Throughput on the same texts (and 1 vs 2 workers on --scaling-rows rows, where the pool's start is
   amortized): raw `tokenizers` batch encoding (`encode_batch` of the already rendered
   prompts and responses, nothing else) vs fineflow's encode path from rows (rendering the template, loss
   mask, EOS) with 1 and 2 worker processes; best of 3 runs each.
2. Peak RSS of the whole tokenize path (stream -> encode -> pack -> write shard) on 10k vs --rows synthetic
   rows, each in a fresh child process (ru_maxrss), to show memory flat in dataset size.
Needs the embedded base model (`make run` first, or --base-dir pointing at any HF tokenizer).
Every encoder here runs with TOKENIZERS_PARALLELISM=false, as in the pipeline: one Rust thread per
process, so "2 workers" is the only way to a second core and the comparison with raw is like for like.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def synthetic_rows(n: int):
    from fineflow.data.synth import generate_examples

    for ex in generate_examples(n, seed=1):
        yield {"instruction": ex.instruction, "input": ex.input, "output": ex.output}


def write_rows(path: Path, n: int) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for row in synthetic_rows(n):
            fh.write(json.dumps(row) + "\n")


def throughput(base_dir: str, n: int) -> None:
    from transformers import AutoTokenizer

    from fineflow.tokenize.template import RESPONSE_PREFIX, render_prompt
    from fineflow.tokenize.tokenization import encode_stream

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    rows = list(synthetic_rows(n))
    texts = [render_prompt(r["instruction"], r["input"]) for r in rows] + [RESPONSE_PREFIX + r["output"] for r in rows]

    def best_of_3(fn):  # the machines are noisy: the best of three runs of each, interleaved
        return min(fn() for _ in range(3))

    def raw_run():
        t0 = time.perf_counter()
        sum(len(e.ids) for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False))
        return time.perf_counter() - t0

    lines = [json.dumps(r) + "\n" for r in rows]

    def fineflow_run(workers, source):
        t0 = time.perf_counter()
        sum(int(batch.lengths.sum()) for batch in encode_stream(iter(source), tokenizer, base_dir, workers))
        return time.perf_counter() - t0

    raw_tokens = sum(len(e.ids) for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False))
    tokens = raw_tokens + len(rows)  # fineflow also appends one EOS per example
    raw_s = best_of_3(raw_run)
    runs = {
        "fineflow, 1 worker, parsed rows": best_of_3(lambda: fineflow_run(1, rows)),
        "fineflow, 1 worker, JSON lines": best_of_3(lambda: fineflow_run(1, lines)),
        "fineflow, 2 workers, JSON lines": best_of_3(lambda: fineflow_run(2, lines)),
    }
    print(f"throughput on {n:,} rows ({raw_tokens:,} tokens), TOKENIZERS_PARALLELISM=false:")
    print(f"  {'raw tokenizers encode_batch':34}: {raw_tokens / raw_s:12,.0f} tokens/s   1.00x")
    for name, seconds in runs.items():
        rate = tokens / seconds
        note = " (incl. starting the worker processes)" if "2 workers" in name else ""
        print(f"  {name:34}: {rate:12,.0f} tokens/s   {rate / (raw_tokens / raw_s):.2f}x{note}")
    print(
        f"  2 workers vs 1 (JSON lines): "
        f"{runs['fineflow, 1 worker, JSON lines'] / runs['fineflow, 2 workers, JSON lines']:.2f}x"
    )


def worker_scaling(base_dir: str, n: int) -> None:
    """1 vs 2 workers on a larger set, where starting the pool (spawn + imports, ~2 s) is amortized."""
    from transformers import AutoTokenizer

    from fineflow.tokenize.tokenization import encode_stream

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    lines = [json.dumps(r) + "\n" for r in synthetic_rows(n)]
    seconds = {}
    for workers in (1, 2):
        t0 = time.perf_counter()
        tokens = sum(int(b.lengths.sum()) for b in encode_stream(iter(lines), tokenizer, base_dir, workers))
        seconds[workers] = time.perf_counter() - t0
    print(
        f"workers on {n:,} rows ({tokens:,} tokens, JSON lines): 1 worker {seconds[1]:.1f} s, "
        f"2 workers {seconds[2]:.1f} s -> {seconds[1] / seconds[2]:.2f}x"
    )


def child_tokenize(base_dir: str, rows_path: str, out_dir: str) -> None:
    """Run in a fresh process: the tokenize path over a rows file; print peak RSS (MiB) and seconds."""
    import numpy as np
    from transformers import AutoTokenizer

    from fineflow.tokenize.tokenization import read_lines, tokenize_to_shard

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    t0 = time.perf_counter()
    meta = tokenize_to_shard(
        read_lines(Path(rows_path)), tokenizer, base_dir, Path(out_dir), 512, np.dtype(np.uint16), 1, 20000, {}
    )
    print(
        json.dumps(
            {
                "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "seconds": time.perf_counter() - t0,
                "examples": meta["examples"],
            }
        )
    )


def peak_rss(base_dir: str, sizes: list[int]) -> None:
    print("peak RSS of tokenize (stream -> encode -> pack -> write), fresh process each:")
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            rows_path = Path(tmp) / f"rows{n}.jsonl"
            write_rows(rows_path, n)
            out = (
                subprocess.run(
                    [sys.executable, __file__, "--child", base_dir, str(rows_path), f"{tmp}/s{n}"],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            figures[n] = json.loads(out)
            print(f"  {n:>9,} rows: {figures[n]['rss_mib']:8.1f} MiB peak, {figures[n]['seconds']:7.1f} s")
    small, large = figures[sizes[0]], figures[sizes[-1]]
    print(f"  ratio {sizes[-1]:,} / {sizes[0]:,} rows: {large['rss_mib'] / small['rss_mib']:.2f}x")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_tokenize(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--throughput-rows", type=int, default=100_000)
    parser.add_argument("--base-dir", default=str(ROOT / "models/base"))
    parser.add_argument("--scaling-rows", type=int, default=400_000)
    parser.add_argument("--skip-rss", action="store_true", help="throughput only")
    args = parser.parse_args()
    throughput(args.base_dir, args.throughput_rows)
    worker_scaling(args.base_dir, args.scaling_rows)
    if not args.skip_rss:
        peak_rss(args.base_dir, [10_000, args.rows])


if __name__ == "__main__":
    main()
