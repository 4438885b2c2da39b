"""Building the ``accelerate launch`` command line for the train stage.

The train stage's DVC command is a plain ``python -m fineflow.stages.train``; that process reads
``train.num_processes`` from params.yaml and re-executes itself under ``accelerate launch`` with the flags
that really give N processes. (On CPU, ``accelerate launch --cpu --num_processes 2`` silently runs one
process; ``ACCELERATE_USE_CPU=1`` with ``--multi_gpu`` runs N ranks of DDP over gloo.)
"""

from __future__ import annotations

import sys

WORKER_ENV = "FINEFLOW_TRAIN_WORKER"


def accelerate_command(num_processes: int, has_gpu: bool, module: str, module_args: list[str],
                       main_process_port: int | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) that runs ``python -m module module_args`` on num_processes ranks."""
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1",
            "--num_processes", str(num_processes), "--dynamo_backend", "no", "--mixed_precision", "no"]
    env = {WORKER_ENV: "1"}
    if num_processes > 1:
        argv.append("--multi_gpu")
        if not has_gpu:
            env["ACCELERATE_USE_CPU"] = "1"  # DDP over gloo; see the module docstring
        if main_process_port is not None:
            argv += ["--main_process_port", str(main_process_port)]
    elif not has_gpu:
        argv.append("--cpu")
    return argv + ["-m", module, *module_args], env
