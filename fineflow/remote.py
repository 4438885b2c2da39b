"""DVC from fineflow's own code: the command with this interpreter's tools, and the project's default remote.

The Prefect flow (tasks/runs.py) and the CI job (fineflow.ci) pull and push through these: with a default DVC
remote configured (``dvc remote add -d``) a run starts with ``dvc pull`` and ends with ``dvc push``; without one
both are skipped (the embedded default keeps its state in the workspace).
"""

from __future__ import annotations

from pathlib import Path

from fineflow.core import dvc_project


def default_remote(project_dir: str | Path) -> str | None:
    """The project's default DVC remote (``core.remote`` in its, the user's or the system's DVC config), or
    None when it has none. DVC's config alone, not a whole Repo: it is read twice a run."""
    from dvc.config import Config

    return Config(dvc_dir=str(Path(project_dir) / ".dvc"))["core"].get("remote") or None


def run_dvc(project_dir: str | Path, *args: str) -> str:
    """``dvc <args>`` in the project; its output, or RuntimeError with the command and the output's tail."""
    done = dvc_project.run_dvc(project_dir, *args)
    output = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        raise RuntimeError(f"dvc {' '.join(args)} failed (exit {done.returncode}):\n{output[-3000:]}")
    return output


def pull(project_dir: str | Path, log) -> str | None:
    """``dvc pull`` from the default remote, with DVC's run cache (None: no remote, nothing done). What the
    remote lacks (a first run,
    a stage never pushed) is left for the stages to build: DVC re-runs a stage whose outputs are missing. A
    remote that fails (unreachable, bad credentials) raises: going on would rebuild everything from scratch
    (hours of GPU on a real model) for what is most often a passing fault, so the caller retries, then fails.
    Files DVC never saved (a stage killed after writing an output, before DVC recorded it) are kept: DVC refuses
    to replace them, and the stage's re-run decides what they become; every other output is still pulled."""
    remote = default_remote(project_dir)
    if remote is None:
        return None
    try:
        log(run_dvc(project_dir, "pull", "--allow-missing", "--run-cache"))
    except RuntimeError as exc:
        unsaved = unsaved_files(str(exc), Path(project_dir))
        if not unsaved:
            raise
        kept = sorted({out for out in lock_outputs(project_dir) if any(_within(f, out) for f in unsaved)})
        log(
            f"dvc pull: kept {', '.join(kept)}: unsaved files there ({', '.join(unsaved[:5])}), written by a stage "
            f"stopped before DVC recorded its outputs; its re-run decides what they become. Pulling the rest"
        )
        rest = [out for out in lock_outputs(project_dir) if out not in kept]
        if rest:
            log(run_dvc(project_dir, "pull", "--allow-missing", "--run-cache", *rest))
    return remote


UNSAVED = "Can't remove the following unsaved files"


def unsaved_files(message: str, project: Path) -> list[str]:
    """The files DVC 3's checkout refused to remove (listed one per line after UNSAVED), relative to the project."""
    if UNSAVED not in message:
        return []
    root = project.resolve()
    found = []
    for line in message.split(UNSAVED, 1)[1].splitlines()[1:]:
        path = Path(line.strip())
        if path.is_absolute() and path.is_relative_to(root):
            found.append(path.relative_to(root).as_posix())
    return found


def lock_outputs(project_dir: str | Path) -> list[str]:
    """Every output path dvc.lock records, in its order."""
    import yaml

    lock = Path(project_dir) / "dvc.lock"
    stages = (yaml.safe_load(lock.read_text(encoding="utf-8")) or {}).get("stages", {}) if lock.is_file() else {}
    return [out["path"] for stage in stages.values() for out in stage.get("outs", [])]


def _within(path: str, out: str) -> bool:
    return path == out or path.startswith(out.rstrip("/") + "/")


def push(project_dir: str | Path, log) -> str | None:
    """``dvc push`` of every stage's outputs to the default remote (None: no remote), with DVC's run cache: a
    run that failed after some stages finished leaves no commit that names their outputs, but the next run
    in a fresh clone pulls the run cache and restores those stages instead of redoing them."""
    remote = default_remote(project_dir)
    if remote is None:
        return None
    log(run_dvc(project_dir, "push", "--run-cache"))
    return remote
