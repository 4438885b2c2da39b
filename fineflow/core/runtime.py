"""Process environment every fineflow process gets: telemetry off, and the Hugging Face hub offline with a
project-local cache wherever nothing needs the hub.

Called by stage entries and the Prefect flow at start-up (never at import; the HF libraries are imported
lazily, after it). Values already set by the caller always win. The hub is only left alone when ``model.base``
is a hub id: such a user downloads it once into their own Hugging Face cache (``HF_HOME``, default
~/.cache/huggingface), and an air-gapped cluster sets the one documented variable, ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import os
from pathlib import Path

# Set for a process that already is a training rank (accelerate launch re-runs the train stage per rank):
# it trains instead of launching, and leaves the stage-level bookkeeping (the error record) to its launcher.
TRAIN_WORKER_ENV = "FINEFLOW_TRAIN_WORKER"
# The flow run's name, in the environment of its stages: the train stage names its tracker run after it.
RUN_NAME_ENV = "FINEFLOW_RUN_NAME"


def is_train_worker() -> bool:
    return os.environ.get(TRAIN_WORKER_ENV) == "1"


HUB_VARIABLES = (
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_HOME",
    "HF_HUB_DISABLE_PROGRESS_BARS",
)


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
        # transformers' "Loading weights" bar, once per model load in four stages: the stages' own lines say what
        # loaded (a hub base keeps the hub's bars: its download is worth watching)
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "PREFECT_HOME": str(root / ".prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    }


def is_hub_id(model_base: str | None, project_root: str | Path = ".") -> bool:
    """Whether model.base names a model on the Hugging Face hub: not the embedded base, not a local path."""
    from fineflow.core.model_config import EMBEDDED_BASE

    if not model_base or model_base == EMBEDDED_BASE or model_base.startswith((".", "/", "~")):
        return False
    return not (Path(project_root) / model_base).is_dir()


def process_environment(project_root: str | Path, model_base: str | None) -> dict[str, str]:
    """What a fineflow process sets by default: offline_environment, less the hub's variables when model.base is
    a hub id (the user's own network and cache settings then apply)."""
    env = offline_environment(project_root)
    if is_hub_id(model_base, project_root):
        env = {key: value for key, value in env.items() if key not in HUB_VARIABLES}
    return env


def params_model_base(project_root: str | Path) -> str | None:
    """model.base of the project's params.yaml as written (None when unreadable: the stages report that)."""
    import yaml

    try:
        params = yaml.safe_load((Path(project_root) / "params.yaml").read_text(encoding="utf-8"))
        return str(params["model"]["base"])
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return None


def apply_offline_environment(project_root: str | Path = ".", model_base: str | None = None) -> None:
    """Set process_environment for this process and its children, keeping the caller's settings; model_base:
    the run's model.base (default: read from the project's params.yaml)."""
    if model_base is None:
        model_base = params_model_base(project_root)
    for key, value in process_environment(project_root, model_base).items():
        os.environ.setdefault(key, value)
