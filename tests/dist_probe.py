"""A tiny distributed probe: every rank all-reduces a tensor; rank 0 alone writes one JSON file.

    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/accelerate/cpu_ddp_2proc.yaml \
        -m tests.dist_probe /tmp/probe-out

Used by tests/test_launch.py to check that a launch really forms one process group of the expected size
(and not N independent world-size-1 jobs, which is what a wrong CPU launch silently gives). Each rank
prints one ``probe rank=R world=W sum=S backend=B`` line; rank 0 writes ``<out_dir>/probe.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    import torch
    from accelerate import Accelerator

    out_dir = Path(argv[0])
    # Accelerator, not PartialState: only AcceleratorState reads ACCELERATE_USE_CPU, the switch that makes
    # CPU ranks join one gloo group (the train stage builds an Accelerator too).
    state = Accelerator()
    value = torch.tensor([float(state.process_index + 1)], device=state.device)
    if state.num_processes > 1:
        torch.distributed.all_reduce(value)  # sum of 1..W: proves one group, not W separate jobs
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
    record = {
        "rank": state.process_index,
        "world_size": state.num_processes,
        "sum": float(value[0]),
        "backend": backend,
        "distributed_type": str(state.distributed_type),
    }
    print(
        f"probe rank={record['rank']} world={record['world_size']} sum={record['sum']:g} backend={backend}", flush=True
    )
    state.wait_for_everyone()
    if state.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "probe.json").write_text(json.dumps(record, sort_keys=True) + "\n", encoding="utf-8")
    state.wait_for_everyone()
    if torch.distributed.is_initialized():  # left to interpreter exit, gloo's teardown can abort a rank whose peer
        torch.distributed.destroy_process_group()  # already left ("terminate called without an active exception")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
