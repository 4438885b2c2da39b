"""LoRA vs full fine-tuning on the same batches: real tokens/s and peak memory, side by side in one run.

    .venv/bin/python bench/lora_vs_full.py [--steps 80]

Each method runs the train stage's rank entry (`fineflow.stages.train.worker`) in a fresh process (peak
RSS is per process), with the repo's params.yaml except `train.method` and the step count, on the
default pipeline's shards and base model (`make run` first). The seeded sampler feeds both the same
rows in the same order. Memory is the process's peak RSS (CPU; on a GPU the report's peak is CUDA's),
which includes ~0.5 GiB of imported libraries for both.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def child(method: str, steps: int, out: str) -> None:
    from fineflow.core.config import load_params
    from fineflow.train import procedure

    raw = load_params(ROOT / "params.yaml").model_dump(by_alias=True)
    raw["checkpoint"]["every_steps"] = steps
    raw["train"].update(
        method=method,
        steps=steps,
        eval_every=steps,
        tracker="none",
        lr=raw["train"]["lr"] if method == "lora" else 3e-4,
    )
    from fineflow.core.config import parse_params

    report = procedure.train_rank(
        parse_params(raw),
        ROOT / "data/shards",
        ROOT / "models/base",
        Path(out) / "ck",
        Path(out) / "model",
        Path(out) / "steps.jsonl",
        Path(out) / "logs",
    )
    print(json.dumps(report))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    if not (ROOT / "data/shards/train/meta.json").exists():
        sys.exit("run `make run` first: needs data/shards and models/base")
    results = {}
    for method in ("lora", "full"):
        with tempfile.TemporaryDirectory() as tmp:
            out = (
                subprocess.run(
                    [sys.executable, __file__, "--child", method, str(args.steps), tmp],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            results[method] = json.loads(out)
    print(f"{args.steps} steps each, same batches (seeded sampler), CPU")
    print(
        f"{'method':8} {'trainable params':>17} {'real tok/s':>11} {'fwd+bwd s':>10} {'optimizer s':>12} "
        f"{'peak RSS MiB':>13} {'planned GiB':>12}"
    )
    for method, r in results.items():
        print(
            f"{method:8} {r['trainable_parameters']:17,} {r['tokens_per_s']:11,.0f} {r['compute_s']:10.2f} "
            f"{r['optimizer_s']:12.2f} {r['peak_mem_mb']:13.1f} {r['plan']['gib']['total']:12.3f}"
        )
    lora, full = results["lora"], results["full"]
    print(
        f"lora / full: tokens/s {lora['tokens_per_s'] / full['tokens_per_s']:.2f}x, "
        f"peak RSS {lora['peak_mem_mb'] / full['peak_mem_mb']:.2f}x, "
        f"trainable params {lora['trainable_parameters'] / full['trainable_parameters']:.3f}x"
    )


if __name__ == "__main__":
    main()
