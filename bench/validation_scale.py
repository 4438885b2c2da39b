"""The validate stage's time and memory as the data grows, and on one huge row, side by side in one run.

    .venv/bin/python bench/validation_scale.py [--rows 10000 100000 1000000] [--big-mb 50] [--big-row-only]

1. Scale: unique synthetic rows (~300 bytes each, every validation check on, the embedded tokenizer's token
   checks included) at each --rows count; each count in a fresh child process, which imports everything
   and validates a tiny file first, then times ``fineflow.stages.validate.run`` on the real one and reports
   its peak RSS (ru_maxrss, imports included). Memory should stay flat in the row count.
2. One huge row: validation MB/s on a file of ordinary rows against a file holding one --big-mb row (a
   run of letters without a separator: the PII scan's and the tokenizer's worst case) plus a few ordinary
   rows, and their ratio, with validate.max_row_bytes raised over the row so the gate does all its work on
   it. Time should grow linearly in the input size, so the ratio stays near 1.
3. The same file at the default validate.max_row_bytes (1 MiB): the reader quarantines the row unparsed.
   Peak RSS side by side: the 10 ordinary rows alone, the huge row validated (2.), the huge row quarantined
   by the reader (3.); the extra memory is each minus the first. --big-row-only skips 1.
The tokenizer is trained here (fineflow.base.embedded.train_tokenizer), so no base model is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def ordinary_row(rng: random.Random, i: int) -> dict:
    """A unique instruction row of ~300 bytes: synthetic words plus its index."""
    from fineflow.corpus import WORDS

    words = " ".join(rng.choice(WORDS) for _ in range(40))
    return {"instruction": f"Summarize note {i}.", "input": words, "output": " ".join(words.split()[:8])}


def write_rows(path: Path, n: int, big_chars: int = 0, seed: int = 1) -> int:
    """n ordinary rows (plus one row of big_chars letters in the middle); returns the file's bytes."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as fh:
        for i in range(n):
            fh.write(json.dumps(ordinary_row(rng, i)) + "\n")
            if big_chars and i == n // 2:
                fh.write(json.dumps({"instruction": "Read this.", "input": "a" * big_chars, "output": "ok"}) + "\n")
    return path.stat().st_size


def make_tokenizer(out: Path) -> Path:
    from fineflow.base.embedded import train_tokenizer
    from fineflow.corpus import WORDS

    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(2000)]
    train_tokenizer(texts, vocab_size=1024, model_max_length=512).save_pretrained(out)
    return out


def child(args) -> None:
    """Runs in a fresh process: warm up on a tiny file, then time the real validation."""
    import yaml

    from fineflow.core.config import parse_params
    from fineflow.errors import DataError
    from fineflow.stages import validate

    work = Path(args.work)
    params = parse_params(yaml.safe_load((ROOT / "params.yaml").read_text()))
    # bench data is unique and clean: nothing should block the gate (the ratio compares like with like); a row
    # under max_row_bytes is under max_chars too
    limit = args.max_row_bytes or params.validate_.max_row_bytes
    update = {"max_chars": limit, "max_row_bytes": limit}
    params = params.model_copy(update={"validate_": params.validate_.model_copy(update=update)})

    def run(train: Path, tag: str) -> float:
        t0 = time.perf_counter()
        try:
            validate.run(
                params,
                train,
                work / "eval.jsonl",
                work / f"out-{tag}",
                work / f"{tag}.json",
                work / f"docs-{tag}",
                Path(args.base_dir),
            )
        except DataError:  # the huge row fails label coverage, a tenth of a tiny file: the work is done all the same
            pass
        return time.perf_counter() - t0

    run(work / "warmup.jsonl", "warmup")
    seconds = run(Path(args.train), "real")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "peak_mb": peak_mb}))


NO_ROW_LIMIT = 2**31 - 1  # validate.max_row_bytes' maximum: the gate parses and checks any row


def measure(work: Path, base_dir: Path, train: Path, max_row_bytes: int | None = NO_ROW_LIMIT) -> dict:
    """Validation of train in a fresh process (max_row_bytes None: params.yaml's): seconds and peak RSS (MiB)."""
    command = [sys.executable, __file__, "--child", "--work", str(work), "--base-dir", str(base_dir)]
    command += ["--train", str(train)] + (["--max-row-bytes", str(max_row_bytes)] if max_row_bytes else [])
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"child failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--big-mb", type=float, default=50)
    parser.add_argument("--ordinary-rows", type=int, default=50_000, help="rows of the ordinary file (MB/s side)")
    parser.add_argument("--big-row-only", action="store_true", help="skip the scale runs (1.)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max-row-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--base-dir", help=argparse.SUPPRESS)
    parser.add_argument("--train", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory(prefix="fineflow-validation-bench-") as tmp:
        work = Path(tmp)
        base_dir = make_tokenizer(work / "tokenizer")
        write_rows(work / "eval.jsonl", 200, seed=2)
        write_rows(work / "warmup.jsonl", 50, seed=3)
        if not args.big_row_only:
            scale(work, base_dir, args.rows)
        huge_row(work, base_dir, args)


def scale(work: Path, base_dir: Path, counts: list[int]) -> None:
    print("scale: unique ~300-byte rows, every check on (token checks with the embedded-style tokenizer)")
    print(f"  {'rows':>10}  {'MB':>7}  {'seconds':>8}  {'rows/s':>9}  {'peak RSS':>10}")
    peaks = {}
    for n in counts:
        size = write_rows(work / "train.jsonl", n)
        m = measure(work, base_dir, work / "train.jsonl")
        peaks[n] = m["peak_mb"]
        rate = n / m["seconds"]
        print(f"  {n:>10,}  {size / 1e6:>7.1f}  {m['seconds']:>8.1f}  {rate:>9,.0f}  {m['peak_mb']:>7.0f} MiB")
    lo, hi = min(peaks), max(peaks)
    print(f"  peak RSS ratio {hi:,} / {lo:,} rows: {peaks[hi] / peaks[lo]:.2f}x")


def huge_row(work: Path, base_dir: Path, args) -> None:
    ordinary = write_rows(work / "ordinary.jsonl", args.ordinary_rows)
    big = write_rows(work / "big.jsonl", 10, big_chars=int(args.big_mb * 1_000_000))
    write_rows(work / "ten.jsonl", 10)
    m_ord, m_big = measure(work, base_dir, work / "ordinary.jsonl"), measure(work, base_dir, work / "big.jsonl")
    rate_ord, rate_big = ordinary / 1e6 / m_ord["seconds"], big / 1e6 / m_big["seconds"]
    print("one huge row vs ordinary rows (validate.max_row_bytes raised: the gate checks the row):")
    print(
        f"  ordinary: {args.ordinary_rows:,} rows, {ordinary / 1e6:.1f} MB: {m_ord['seconds']:.1f} s, "
        f"{rate_ord:.2f} MB/s, peak {m_ord['peak_mb']:.0f} MiB"
    )
    print(
        f"  one {args.big_mb} MB row (+10 ordinary): {big / 1e6:.1f} MB: {m_big['seconds']:.1f} s, "
        f"{rate_big:.2f} MB/s, peak {m_big['peak_mb']:.0f} MiB"
    )
    print(f"  MB/s ratio huge row / ordinary: {rate_big / rate_ord:.2f}x")
    ten, capped = measure(work, base_dir, work / "ten.jsonl"), measure(work, base_dir, work / "big.jsonl", None)
    print(f"peak RSS, the {args.big_mb} MB row's extra memory over the 10 ordinary rows alone:")
    print(f"  10 ordinary rows alone: {ten['peak_mb']:.0f} MiB")
    for label, m in (("validated (max_row_bytes raised)", m_big), ("quarantined unparsed (default)", capped)):
        extra = m["peak_mb"] - ten["peak_mb"]
        ratio = extra * 2**20 / (args.big_mb * 1e6)
        peak = f"{m['peak_mb']:.0f} MiB, {extra:+.0f} MiB ({ratio:.1f}x the row)"
        print(f"  + the row, {label}: {peak}, {m['seconds']:.1f} s")


if __name__ == "__main__":
    main()
