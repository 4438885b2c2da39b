"""Cluster launchers: the train stage hands its ranks to a distributed engine and waits (train.launcher).

The stage's launcher process stays the *driver*: it plans the run (the same planner, checks and rank command as
a local launch), hands rank placement to the engine, streams the ranks' logs, waits, and returns one exit code
with the local launch's meaning (0, 2 user error, 75 saved stop). The ranks are the same per-rank worker
(``python -m fineflow.stages.train`` with FINEFLOW_TRAIN_WORKER set), placed by the engine instead of by
``accelerate launch``; rank 0 writes models/candidate, the step log and the report where DVC expects them, so
DVC keeps owning the outputs and the Prefect flow does not change.

__init__.py  RankJob (what every launcher runs) and run_job (the dispatch on train.launcher)
ray.py       train.launcher: ray (Ray Train's placement and failure handling)
slurm.py     train.launcher: slurm (one allocation; Slurm's preemption and requeue)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fineflow.core.config import Params
    from fineflow.train.profile import Profile


@dataclass(frozen=True)
class RankJob:
    """Everything a cluster launcher needs to start the ranks of one training run.

    module/argv: the rank command, ``python -m <module> <argv>`` (the train stage's own argv); world: ranks over
    all machines; env: what every rank's environment adds (the worker flag, ACCELERATE_USE_CPU on CPU, thread
    counts); params: the planned params (fineflow.train.run_plan.RunPlan.params); grace_s: the preemption grace."""

    module: str
    argv: list[str]
    world: int
    num_machines: int
    has_gpu: bool
    profile: Profile
    params: Params
    grace_s: float
    env: dict[str, str] = field(default_factory=dict)


def run_job(launcher: str, job: RankJob, log=print, spans: dict | None = None) -> int:
    """Run the job's ranks on train.launcher's engine and wait; the exit code as a local launch gives it. spans:
    the stage attempt's journal spans, where the engine adds its own time (``engine_*`` keys: placement, queueing,
    waiting for nodes, restarts), which the goodput ledger puts in its own bucket."""
    spans = {} if spans is None else spans
    if launcher == "ray":
        from fineflow.train.engines.ray import run_on_ray

        return run_on_ray(job, log, spans)
    if launcher == "slurm":
        from fineflow.train.engines.slurm import run_on_slurm

        return run_on_slurm(job, log, spans)
    raise ValueError(f"not a cluster launcher: {launcher!r}")
