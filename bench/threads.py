"""Sharing a busy machine: the default train stage alone, then 2 and 4 copies of it at once, each copy's throughput
as a share of the solo run's, under each thread setting, side by side in one run.

    .venv/bin/python bench/threads.py [--steps 150] [--copies 1 2 4]

Each copy is the train stage as dvc.yaml runs it (its launcher, `accelerate launch`, one rank) on the default
pipeline's base and shards (`make run` first), params.yaml as shipped but train.steps (and no tracker), in a
folder of its own. The settings:

- "torch default": every process at torch's own thread count (the machine's cores) with OpenMP's default busy
  wait, what main did for a one-rank run: OMP_NUM_THREADS set to the core count and OMP_WAIT_POLICY set empty
  (a user's choice the plan keeps; OpenMP reads it as unset);
- "fineflow plan": fineflow.core.threads as shipped (OMP_NUM_THREADS and OMP_WAIT_POLICY unset: the plan decides
  the count, and a passive wait);
- "fineflow, spinning": the plan's count with OMP_WAIT_POLICY=ACTIVE, what a user with a machine of their own
  may choose;
- "1 thread": one intra-op thread per process;
(GOMP_SPINCOUNT=10000, a short spin before a waiting thread sleeps, was tried too: 0.09 of solo each, no better
than the default.)

A fair share of n copies is 1/n of the solo throughput; the goal is at least 0.9/n each. Throughput is the train
report's tokens_per_s (the training loop's own), so the copies' start-up does not count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fineflow.core.dvc_project import stage_command  # noqa: E402

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "FINEFLOW_THREAD_PLAN")


def settings() -> dict[str, dict[str, str]]:
    cores = str(os.cpu_count() or 1)
    return {
        "torch default": {"OMP_NUM_THREADS": cores, "OMP_WAIT_POLICY": ""},
        "fineflow plan": {},
        "fineflow, spinning": {"OMP_WAIT_POLICY": "ACTIVE"},
        "1 thread": {"OMP_NUM_THREADS": "1"},
    }


def copy_project(dest: Path, steps: int) -> Path:
    """A folder with the pipeline's base and shards (linked) and params.yaml as shipped but the steps."""
    dest.mkdir(parents=True)
    for rel in ("models/base", "data/shards"):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).symlink_to(ROOT / rel)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["train"].update({"steps": steps, "tracker": "none", "eval_every": steps})
    params["checkpoint"]["every_steps"] = steps
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return dest


def run_copies(root: Path, copies: int, steps: int, extra_env: dict[str, str]) -> list[dict]:
    """`copies` train stages started together; each one's train report."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES} | extra_env
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    command = stage_command("train", ROOT, python=sys.executable)
    projects = [copy_project(root / f"copy{i}", steps) for i in range(copies)]
    procs = [
        subprocess.Popen(command, cwd=p, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for p in projects
    ]
    for proc, project in zip(procs, projects, strict=True):
        _, err = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"{project}: train exited {proc.returncode}:\n{err[-3000:]}")
    reports = [json.loads((p / "reports/train.json").read_text()) for p in projects]
    shutil.rmtree(root)
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--settings", nargs="+", default=list(settings()), help="which settings, by name")
    args = parser.parse_args()
    if not (ROOT / "data/shards").is_dir() or not (ROOT / "models/base").is_dir():
        raise SystemExit("needs the default pipeline's base and shards: run `make run` first")
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; {args.steps} steps per copy\n")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fineflow-threads-") as scratch:
        for name, extra in ((n, settings()[n]) for n in args.settings):
            solo = None
            for copies in args.copies:
                started = time.perf_counter()
                reports = run_copies(Path(scratch) / f"{name.replace(' ', '_')}_{copies}", copies, args.steps, extra)
                wall = time.perf_counter() - started
                rates = [r["tokens_per_s"] for r in reports]
                solo = solo or (rates[0] if copies == 1 else None)
                shares = [rate / solo for rate in rates] if solo else []
                cpu = reports[0].get("device", {}).get("cpu", {})
                waits = [r.get("threads", {}).get("wait") for r in reports]
                during = cpu.get("runnable_during") or {}
                rows.append((name, copies, rates, shares, wall, cpu.get("threads_per_rank"), during.get("mean")))
                fair = f"min share x copies {min(shares) * copies:.2f}" if shares else ""
                print(
                    f"{name:<14} copies {copies}: tokens/s {', '.join(f'{r:.0f}' for r in rates)}; share of solo "
                    f"{', '.join(f'{s:.2f}' for s in shares)} ({fair}); threads/copy {cpu.get('threads_per_rank')}, "
                    f"runnable during the loop {during.get('mean')}; waits {', '.join(map(str, waits))}; "
                    f"wall {wall:.0f} s",
                    flush=True,
                )
    print("\nside by side: the smallest copy's share x copies (1.0 = a fair share; the goal is >= 0.9)")
    for copies in args.copies:
        cells = [f"{name}: {min(s) * copies:.2f}" for name, c, _, s, *_ in rows if c == copies and s]
        print(f"  {copies} copies: " + "; ".join(cells))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
