"""Record a registry write made outside ``dvc repro`` (a rollback) in dvc.lock.

``models/champion`` and ``models/registry`` are the promote stage's outputs. A rollback rewrites them by hand.
Unless dvc.lock records the result, ``dvc repro`` (and the flow, which runs it) sees promote's outputs
changed and runs promote again on the old scores, and ``dvc checkout`` restores the outputs from before the
rollback, dropping its log entry. ``dvc commit <stage>`` records the outputs as they are now, but it
records the stage's dependencies as they are now too: run while a new candidate waits to be judged, it would
mark that candidate judged. So the commit is made only when DVC reports nothing changed but the outputs.
When it is not made, the next promote run keeps the rollback anyway: the outputs persist, and the gate does not
promote a candidate that was rolled back (``store.rollback_refusal``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fineflow.core.dvc_project import dvc_environment, owning_stage, project_root, run_dvc
from fineflow.core.runtime import offline_environment


def _dvc(root: Path, *args: str):
    return run_dvc(root, *args, env=dvc_environment(offline_environment(root) | dict(os.environ)))  # caller's win


def record_outputs(registry_dir: Path, champion_dir: Path) -> str:
    """Commit the stage that owns the registry and the champion to dvc.lock when only its outputs changed;
    what was done, in a line to print."""
    root = project_root(registry_dir)
    inside = root is not None and all(root in p.resolve().parents for p in (registry_dir, champion_dir))
    stage = owning_stage(root, [registry_dir, champion_dir]) if inside else None
    if stage is None:
        return "dvc.lock: not recorded (the registry is no DVC stage's output here)"
    status = _dvc(root, "status", "--json", stage)
    if status.returncode != 0:
        return f"dvc.lock: not recorded (`dvc status {stage}` failed: {status.stderr.strip()[-300:]})"
    changes = [key for item in json.loads(status.stdout or "{}").get(stage, []) for key in item]
    if changes and set(changes) != {"changed outs"}:
        return (
            f"dvc.lock: not recorded, because {stage}'s inputs changed since it last ran ({', '.join(changes)}): "
            f"the next `dvc repro` runs {stage} on them, keeps this registry (its outputs persist) and does not "
            "promote the candidate rolled back from"
        )
    committed = _dvc(root, "commit", "--force", stage)
    if committed.returncode != 0:
        return (
            f"dvc.lock: not recorded (`dvc commit {stage}` failed: {committed.stderr.strip()[-300:]}); "
            f"run `dvc commit --force {stage}` once no other DVC command is running"
        )
    return (
        f"dvc.lock: recorded (`dvc commit {stage}`), so `dvc repro` keeps this champion and `dvc checkout` "
        "restores it; commit dvc.lock to git to keep it there too"
    )
