"""The run's experiment tracker (accelerate's: TensorBoard or MLflow), one tracker run per training run."""

from __future__ import annotations

import os
from pathlib import Path

from fineflow.core.config import Params

TRACKER_RUN_FILE = "tracker_run.txt"  # in a checkpoint run directory: the tracker run its attempts log to


def tracker_run_name(run_dir: Path, resuming: bool) -> str:
    """Each training run its own tracker run, so curves of different runs never mix: the time it started and
    the flow run's name (FINEFLOW_RUN_NAME; "dvc-repro" outside a flow). Kept in the checkpoint run directory,
    so a resumed run goes on in its own curves (a finished run trained again starts a new one)."""
    import re
    import time

    from fineflow.core.reports import write_text_atomic
    from fineflow.core.runtime import RUN_NAME_ENV

    path = Path(run_dir) / TRACKER_RUN_FILE
    if resuming and path.is_file():
        return path.read_text(encoding="utf-8").strip()
    label = re.sub(r"[^A-Za-z0-9._+-]+", "-", os.environ.get(RUN_NAME_ENV) or "dvc-repro").strip("-")
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{label}"
    write_text_atomic(path, name + "\n")
    return name


def init_tracker(accelerator, params: Params, run_dir: Path, start_step: int = 0) -> None:
    """accelerate's tracker, one run per training run (tracker_run_name): TensorBoard under
    logs/fineflow/<run>, MLflow as run <run> of experiment fineflow. After a resume from step N, TensorBoard
    purges the events a crashed attempt logged after N, so no step appears twice in the curves."""
    cfg = params.train  # as the run trains (fineflow.train.run_plan.RunPlan.params)
    if cfg.tracker == "none":
        return
    name = tracker_run_name(run_dir, resuming=start_step > 0)
    flat = {f"train.{k}": v for k, v in cfg.model_dump().items() if isinstance(v, (int, float, str, bool))}
    init_kwargs = {"tensorboard": {"purge_step": start_step + 1}} if start_step else {}
    init_kwargs["mlflow"] = {"run_name": name}
    accelerator.init_trackers(
        f"fineflow/{name}" if cfg.tracker == "tensorboard" else "fineflow",
        config={**flat, "seed": params.seed, "tokenize.seq_len": params.tokenize.seq_len},
        init_kwargs=init_kwargs,
    )
