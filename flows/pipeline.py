"""The fineflow Prefect flow: the stages of ``dvc.yaml``, in the order that file lists them.

    python -m flows.pipeline            # one run now (what `make run` does)
    python -m flows.deploy              # serve it on a schedule (see flows/deploy.py)

Each stage is one task that runs ``dvc repro --single-item <stage>``; unchanged stages are skipped by DVC.
Retries: train is retried (a transient crash re-runs it; bad input or params are never retried).
"""

from __future__ import annotations

import sys
from pathlib import Path

from prefect import flow

from fineflow.dag import stage_names
from tasks.stages import run_stage

RETRIES = {"train": 2}  # a crashed train stage resumes from its last valid checkpoint


@flow(name="fineflow", log_prints=True)
def fineflow_pipeline(project_dir: str = ".") -> dict[str, dict]:
    """Run every stage of the project's dvc.yaml in order; returns {stage: {"stage", "ran", "report"}}."""
    results = {}
    for stage in stage_names(project_dir):
        task = run_stage.with_options(retries=RETRIES.get(stage, 0), retry_delay_seconds=5)
        results[stage] = task(stage, project_dir)
    return results


def main() -> int:
    project = Path(__file__).resolve().parent.parent
    from fineflow.runtime import apply_offline_environment

    apply_offline_environment(project)
    results = fineflow_pipeline(str(project))
    ran = [stage for stage, r in results.items() if r["ran"]]
    evaluate, promote = results["evaluate"]["report"], results["promote"]["report"]
    print(f"stages run: {', '.join(ran) or 'none (everything up to date)'}")
    print(f"base {evaluate.get('base')} -> candidate {evaluate.get('candidate')}")
    print(f"promote: {promote.get('decision')} ({promote.get('reason')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
