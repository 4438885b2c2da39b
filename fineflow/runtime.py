"""Process environment every fineflow process gets: hubs offline, telemetry off, caches project-local.

Called by stage entries and the Prefect flow at start-up (never at import). Values already set by the
caller win, so a real user can turn the hub back on with ``HF_HUB_OFFLINE=0``.
"""

from __future__ import annotations

import os
from pathlib import Path

# Set for a process that already is a training rank (accelerate launch re-runs the train stage per rank):
# it trains instead of launching, and leaves the stage-level bookkeeping (the error record) to its launcher.
TRAIN_WORKER_ENV = "FINEFLOW_TRAIN_WORKER"


def is_train_worker() -> bool:
    return os.environ.get(TRAIN_WORKER_ENV) == "1"


def offline_environment(project_root: str | Path) -> dict[str, str]:
    root = Path(project_root).resolve()
    return {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(root / ".cache" / "huggingface"),
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DVC_NO_ANALYTICS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "PREFECT_HOME": str(root / ".prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    }


def apply_offline_environment(project_root: str | Path = ".") -> None:
    """Set the offline/telemetry variables for this process and its children, keeping caller overrides."""
    for key, value in offline_environment(project_root).items():
        os.environ.setdefault(key, value)
