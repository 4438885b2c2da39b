"""A three-source mixture (data.sources) through validate and tokenize: time and peak memory in the row count.

    nice -n 15 .venv/bin/python bench/mix.py [--rows 100000 300000 1000000]

For each total row count: three sources of unique ~300-byte rows (bench/validation_scale.py's rows), half a
JSONL file (weight 1), 30% a folder of three Parquet shards (weight 0.5), 20% a `datasets` save_to_disk
folder (n: all its rows); every validation check on, token checks through the embedded-style 1,024-token
tokenizer; a 200-row eval split. Each step runs in a fresh process (imports done first), whose peak RSS
(ru_maxrss, imports included) is reported:
1. validate: each source validated on its own into the per-source cache, then mixed into train.jsonl;
2. tokenize: the mixed rows packed into shards;
3. validate again after one source's weight changed: the cache answers for every source, only the mix runs.
Memory should stay flat in the row count (one chunk of rows per source, one line per source in the mix).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from validation_scale import ROOT, make_tokenizer, ordinary_row, write_rows

SHARES = (0.5, 0.3, 0.2)  # of the rows: the JSONL file, the Parquet shards, the saved dataset


def write_sources(work: Path, total: int) -> list[dict]:
    """The three sources (unique rows across all of them), and their data.sources entries."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset, disable_progress_bars

    disable_progress_bars()
    rng = random.Random(5)
    counts = [int(total * share) for share in SHARES]
    rows = (ordinary_row(rng, i) for i in range(sum(counts)))
    with (work / "file.jsonl").open("w", encoding="utf-8") as fh:
        for _ in range(counts[0]):
            fh.write(json.dumps(next(rows)) + "\n")
    (work / "shards").mkdir()
    for shard in range(3):
        part = [next(rows) for _ in range(counts[1] // 3)]
        pq.write_table(pa.Table.from_pylist(part), work / "shards" / f"train-{shard:05d}-of-00003.parquet")
    Dataset(pa.Table.from_pylist([next(rows) for _ in range(counts[2])])).save_to_disk(str(work / "saved"))
    return [
        {"path": str(work / "file.jsonl"), "weight": 1.0},
        {"path": str(work / "shards"), "weight": 0.5},
        {"path": str(work / "saved"), "n": counts[2]},
    ]


def child(args) -> None:
    """Runs in a fresh process: one step (validate or tokenize), timed, with this process's peak RSS."""
    import yaml

    from fineflow.core.config import parse_params
    from fineflow.stages import tokenize, validate

    work = Path(args.work)
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["data"]["sources"] = json.loads((work / "sources.json").read_text())
    params = parse_params(raw)
    t0 = time.perf_counter()
    if args.child == "tokenize":
        report = tokenize.run(params, work / "validated", Path(args.base_dir), work / "shards-out")
        summary = {"examples": report["examples"]}
    else:
        eval_rows = work / "eval.jsonl"
        out = work / "validated"
        report = validate.run(
            params, eval_rows, eval_rows, out, work / "validate.json", None, Path(args.base_dir), work / "cache"
        )
        summary = {k: report[k] for k in ("rows_in", "rows_kept", "rows_mixed", "validated_sources")}
    seconds = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "peak_mb": peak_mb, **summary}))


def step(work: Path, base_dir: Path, name: str) -> dict:
    command = [sys.executable, __file__, "--child", name, "--work", str(work), "--base-dir", str(base_dir)]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"    {work.name} {name}: {json.dumps(result)}", file=sys.stderr, flush=True)  # a long run's progress
    return result


def measure(root: Path, base_dir: Path, total: int) -> dict:
    work = root / f"rows-{total}"
    work.mkdir()
    write_rows(work / "eval.jsonl", 200, seed=2)
    sources = write_sources(work, total)
    (work / "sources.json").write_text(json.dumps(sources))
    validated, tokenized = step(work, base_dir, "validate"), step(work, base_dir, "tokenize")
    sources[1]["weight"] = 1.0  # one weight changed: nothing is validated again
    (work / "sources.json").write_text(json.dumps(sources))
    return {"validate": validated, "tokenize": tokenized, "remix": step(work, base_dir, "validate")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 300_000, 1_000_000])
    parser.add_argument("--child", choices=("validate", "tokenize"), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--base-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    print("three sources (JSONL 50% w=1, Parquet shards 30% w=0.5, save_to_disk 20% n=all), ~300-byte rows")
    print(f"  {'rows':>10}  {'validate s':>10}  {'peak':>9}  {'tokenize s':>10}  {'peak':>9}  {'re-mix s':>8}  mixed")
    peaks = {}
    with tempfile.TemporaryDirectory(prefix="fineflow-mix-bench-") as tmp:
        base_dir = make_tokenizer(Path(tmp) / "tokenizer")
        for total in args.rows:
            m = measure(Path(tmp), base_dir, total)
            v, t, r = m["validate"], m["tokenize"], m["remix"]
            assert r["validated_sources"] == [], r  # the weight change validated nothing
            peaks[total] = (v["peak_mb"], t["peak_mb"])
            print(
                f"  {total:>10,}  {v['seconds']:>10.1f}  {v['peak_mb']:>5.0f} MiB  {t['seconds']:>10.1f}  "
                f"{t['peak_mb']:>5.0f} MiB  {r['seconds']:>8.1f}  {v['rows_mixed']:,}",
                flush=True,
            )
    lo, hi = min(peaks), max(peaks)
    print(
        f"  peak RSS ratio {hi:,} / {lo:,} rows: validate {peaks[hi][0] / peaks[lo][0]:.2f}x, "
        f"tokenize {peaks[hi][1] / peaks[lo][1]:.2f}x"
    )


if __name__ == "__main__":
    main()
