"""train.launcher: ray. (Being built: issue 32.)"""

from __future__ import annotations

from fineflow.core.errors import FineflowError


def run_on_ray(job, log=print, spans: dict | None = None) -> int:
    raise FineflowError("train.launcher: ray is not built yet")
