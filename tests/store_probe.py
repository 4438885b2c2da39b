"""One rank of a multi-node resume from checkpoint.store (fineflow.checkpoint.remote_store.fetch_for_resume), for
tests/test_checkpoint_store.py: each "machine" (a launch of its own on loopback) has its own node-local run directory.

    accelerate launch ... -m tests.store_probe <node-local run dir> <store url> <endpoint>

Prints ``store_probe rank=R steps=[...]`` (the step directories on its disk after the fetch) or ``store_probe rank=R
error=...`` (exit 2), the same error on every rank when one node could not read the store.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from accelerate import Accelerator

    from fineflow.checkpoint import CheckpointError, StoreConfig
    from fineflow.checkpoint.remote_store import fetch_for_resume

    run_dir, url, endpoint = Path(argv[0]), argv[1], argv[2]
    accelerator = Accelerator()
    rank = accelerator.process_index
    try:
        fetch_for_resume(accelerator, run_dir, StoreConfig(url, endpoint), "FINISHED")
    except CheckpointError as exc:
        print(f"store_probe rank={rank} error={exc}", flush=True)
        return 2
    steps = sorted(p.name for p in run_dir.glob("step-*")) if run_dir.is_dir() else []
    print(f"store_probe rank={rank} steps={steps}", flush=True)
    accelerator.wait_for_everyone()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # no interpreter teardown after gloo: it can abort a finished rank (SIGABRT, "terminate called without an
    # active exception"; seen in make test), as the train stage's ranks avoid (stages.train.exit_without_teardown)
    sys.stdout.flush()
    os._exit(code)
