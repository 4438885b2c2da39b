"""The pipeline's stages, read from ``dvc.yaml``: the one place they are listed.

The Prefect flow runs them in this order, and lineage times a run from their reports, so a stage added to or
removed from ``dvc.yaml`` needs no second edit. Python keeps a YAML mapping's order, and ``dvc.yaml`` lists its
stages in the order they run (each after the stages it depends on).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from fineflow.errors import FineflowError

DVC_FILE = "dvc.yaml"


def stage_names(project_dir: str | Path = ".") -> list[str]:
    """The names under ``stages:`` in ``<project_dir>/dvc.yaml``, in the file's order."""
    path = Path(project_dir) / DVC_FILE
    try:
        pipeline = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise FineflowError(f"{path}: cannot read the pipeline ({exc.strerror})") from None
    stages = pipeline.get("stages") if isinstance(pipeline, dict) else None
    if not isinstance(stages, dict) or not stages:
        raise FineflowError(f"{path}: no `stages:` mapping, so there is no pipeline to run")
    return list(stages)
