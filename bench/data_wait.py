"""Data wait: the share of step time the loop is blocked waiting for its next batch, with a fixed fake
compute step, for on-the-fly tokenization vs fineflow's packed-shard loader. Side by side, one run.

    .venv/bin/python bench/data_wait.py [--steps 300] [--compute-ms 20] [--batch 8]

on-the-fly: each step tokenizes its rows from text and pads them into tensors (what a loop without
pre-tokenized data does); shard loader, inline: each step takes packed rows from the memory-mapped shard
through the seeded sampler and collates them in the loop; shard loader, prefetch: the same steps prepared
ahead on fineflow's BatchLoader thread (what the train stage does). The fake step runs twice: releasing
the GIL (as torch kernels and a host waiting on the GPU do) and holding it (a busy Python loop, the worst
case for the loader thread). Needs `make run` first (data/validated, data/shards, models/base).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def busy_compute(seconds: float) -> None:
    """A step that holds the GIL the whole time (pure-Python work): the worst case for a loader thread."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def gpu_like_compute(seconds: float) -> None:
    """A step that releases the GIL while it runs, as torch does inside its kernels and while the host
    waits for a CUDA step to finish (what the train loop's .item() does)."""
    time.sleep(seconds)


def measure(next_batch, steps: int, compute_s: float, fake_compute) -> tuple[float, float]:
    """(seconds waiting for data, seconds in total) over steps."""
    wait = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        next_batch()
        wait += time.perf_counter() - t0
        fake_compute(compute_s)
    return wait, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--batch", type=int, default=8, help="packed rows per step (on-the-fly: as many examples)")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from fineflow.tokenize.shards import PackedShard, RowSampler
    from fineflow.tokenize.template import encode_batch
    from fineflow.train.loader import BatchLoader

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models/base")
    rows = [json.loads(line) for line in (ROOT / "data/validated/train.jsonl").read_text().splitlines()]
    shard = PackedShard(ROOT / "data/shards/train")
    per_row = shard.meta["examples"] / len(shard)
    n_examples = max(1, round(args.batch * per_row))  # the same examples per step in both loaders
    position = {"i": 0}

    def on_the_fly():
        i = position["i"]
        chunk = [rows[(i + k) % len(rows)] for k in range(n_examples)]
        position["i"] = i + n_examples
        batch = encode_batch(tokenizer, chunk)
        encoded = [batch.example(k) for k in range(len(batch))]
        longest = max(len(ids) for ids, _ in encoded)
        ids = torch.tensor([ids + [tokenizer.pad_token_id] * (longest - len(ids)) for ids, _ in encoded])
        labels = torch.tensor(
            [[t if m else -100 for t, m in zip(ids_, mask)] + [-100] * (longest - len(ids_)) for ids_, mask in encoded]
        )
        return ids, labels

    def shard_loader(prefetch: int):
        loader = BatchLoader(shard, RowSampler(len(shard), seed=0), args.batch, 1, args.steps, prefetch=prefetch)
        return lambda: next(loader)

    compute_s = args.compute_ms / 1000
    print(
        f"{args.steps} steps, fake compute {args.compute_ms:g} ms/step, {args.batch} packed rows of "
        f"{shard.meta['seq_len']} = {n_examples} examples per step"
    )
    for label, fake_compute in (
        ("GIL released (torch kernels, GPU wait)", gpu_like_compute),
        ("GIL held (busy Python step)", busy_compute),
    ):
        print(f" fake step: {label}")
        for name, loader in (
            ("on-the-fly tokenization", lambda: on_the_fly),
            ("shard loader, inline", lambda: shard_loader(0)),
            ("shard loader, prefetch 2", lambda: shard_loader(2)),
        ):
            wait, total = measure(loader(), args.steps, compute_s, fake_compute)
            print(f"  {name:26}: data wait {wait / args.steps * 1000:7.3f} ms/step = {wait / total:6.2%} of step time")


if __name__ == "__main__":
    main()
