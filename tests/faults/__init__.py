"""Test-only fault injection into checkpoint writes of the processes a test starts: see sitecustomize.py
here, which does the injecting. This package only builds the environment that turns it on."""

from __future__ import annotations

import os
from pathlib import Path

FAULTS_DIR = Path(__file__).resolve().parent
INJECTED = "injected into fineflow.checkpoint.write.write_all"  # sitecustomize.MESSAGE: one line per process


def fault_env(
    env: dict[str, str],
    write_delay_s: float | None = None,
    disk_full_at_step: int | None = None,
    crash_once_at_step: tuple[int, Path] | None = None,
) -> dict[str, str]:
    """env with this directory first on PYTHONPATH (so every Python process started with it imports our
    sitecustomize) and the variables for the faults given; None leaves a fault off. crash_once_at_step:
    (step, marker file)."""
    env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(FAULTS_DIR), env.get("PYTHONPATH")) if p)}
    step, marker = crash_once_at_step or (None, None)
    for name, value in (
        ("FINEFLOW_TEST_WRITE_DELAY_S", write_delay_s),
        ("FINEFLOW_TEST_DISK_FULL_AT_STEP", disk_full_at_step),
        ("FINEFLOW_TEST_CRASH_ONCE_AT_STEP", step),
        ("FINEFLOW_TEST_CRASH_MARKER", marker),
    ):
        env.pop(name, None)  # only what this call asks for, never a leftover from the caller's environment
        if value is not None:
            env[name] = str(value)
    return env
