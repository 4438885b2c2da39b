"""Orchestration that grows with checkpoint size: what DVC spends after a train stage when checkpoints/ is an
output (the old dvc.yaml: `cache: false`, so never cached, but still md5-hashed into dvc.lock after every
run) against the current layout, where checkpoints/ is the stage's scratch and not an output at all.

    python bench/dvc_hashing.py [--sizes-mb 350 700 1400]

In a throwaway git+DVC project, one stage writes a fresh checkpoint directory of the given size (a few
safetensors-sized files of random bytes: new content every run, as a new checkpoint is) beside a small
adapter output, and `dvc repro` runs it; each layout is run at each size, the two layouts taking turns. DVC's
own time is `dvc repro`'s wall minus the stage command's (which the stage measures and prints). Sizes are
scaled-down checkpoints: the 702 MB full-fine-tuning state of bench/checkpoint_stall.py is the middle one; a
70B full fine-tuning checkpoint is ~920 GiB (fineflow plan --model 70B --method full).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STAGE = """
import os, sys, time
started = time.perf_counter()
size = int(sys.argv[1]) * 2**20
os.makedirs("checkpoints/run/step-1", exist_ok=True)
os.makedirs("adapter", exist_ok=True)
parts = 4
for i in range(parts):
    with open(f"checkpoints/run/step-1/shard-{i}.bin", "wb") as out:
        left = size // parts
        while left:
            chunk = min(left, 64 * 2**20)
            out.write(os.urandom(chunk))
            left -= chunk
with open("adapter/adapter.bin", "wb") as out:
    out.write(os.urandom(2**20))
print(f"STAGE_S {time.perf_counter() - started:.3f}")
"""

OLD_OUTS = "      - adapter\n      - checkpoints:\n          cache: false\n          persist: true\n"
NEW_OUTS = "      - adapter\n"


def project(root: Path, outs: str) -> Path:
    root.mkdir(parents=True)
    (root / "stage.py").write_text(STAGE)
    (root / "dvc.yaml").write_text(
        "stages:\n  train:\n    cmd: python stage.py ${size}\n    deps:\n      - stage.py\n    params:\n"
        "      - size\n    outs:\n" + outs
    )
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    for argv in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        subprocess.run(argv, cwd=root, check=True, env=env)
    return root


def repro(root: Path, size_mb: int) -> tuple[float, float]:
    """(dvc repro's wall, the stage command's own) for a run that writes a new checkpoint of size_mb."""
    (root / "params.yaml").write_text(f"size: {size_mb}\n")
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": str(Path(sys.executable).parent) + ":" + os.environ["PATH"]}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "dvc", "repro", "--force"], cwd=root, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - started
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [stage_s] = [float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("STAGE_S")]
    return wall, stage_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[350, 700, 1400])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dvc-hashing-") as tmp:
        layouts = {
            "checkpoints/ an output (old)": project(Path(tmp) / "old", OLD_OUTS),
            "checkpoints/ scratch (now)": project(Path(tmp) / "new", NEW_OUTS),
        }
        print(f"{'checkpoint':>11}  {'layout':<30}{'repro wall':>11}{'stage':>9}{'DVC':>9}")
        results: dict[tuple[int, str], float] = {}
        for size in args.sizes_mb:
            for name, root in layouts.items():
                repro(root, size)  # warm: the first run of a project also builds DVC's state database
                wall, stage = repro(root, size)
                results[size, name] = wall - stage
                print(f"{size:>8} MB  {name:<30}{wall:>10.2f}s{stage:>8.2f}s{wall - stage:>8.2f}s")
        print()
        old, new = layouts
        for size in args.sizes_mb:
            extra = results[size, old] - results[size, new]
            print(
                f"{size:>8} MB: DVC spends {extra:+.2f} s more per run with checkpoints/ an output "
                f"({extra / (size / 1024):.2f} s per GiB of checkpoint)"
            )


if __name__ == "__main__":
    main()
