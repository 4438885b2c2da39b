"""The DVC project, for fineflow's own code: ``dvc.yaml`` read in this one place, and ``dvc`` run in this one place.

The pipeline's stages are listed in ``dvc.yaml`` only. The Prefect flow runs them in this order, and lineage times a
run from their reports, so a stage added to or removed from ``dvc.yaml`` needs no second edit. Python keeps a YAML
mapping's order, and ``dvc.yaml`` lists its stages in the order they run (each after the stages it depends on). A
stage's command line is read from there too (``stage_command``): the tests and benchmarks that start a stage by
hand run what DVC runs. Which stage owns an output (``owning_stage``), which outputs persist
(``persistent_outputs``), where the project is (``project_root``): the same reading.

``dvc`` itself runs as this interpreter's module with the venv's bin first on PATH (``dvc_environment``: dvc.yaml's
``python`` is this interpreter): ``run_dvc`` for a command whose output is read at its end, ``popen_dvc`` for one
whose lines are streamed (``dvc repro``), with DVC's after-the-fact hints (``is_hint``: "To track the changes with
git, run: ...", "Use `dvc push` ...", printed after every stage) left out of what a person reads.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from fineflow.errors import FineflowError

DVC_FILE = "dvc.yaml"
PARAMS_FILE = "params.yaml"
_TEMPLATE = re.compile(r"\$\{([\w.-]+)\}")


def pipeline_stages(project: Path) -> dict | None:
    """The `stages:` of project's dvc.yaml ({} when it has none: DVC says so when it runs); None without a dvc.yaml.
    A dvc.yaml that is not YAML is a ConfigError naming it."""
    from fineflow.errors import ConfigError

    path = Path(project) / DVC_FILE
    if not path.is_file():
        return None
    try:
        pipeline = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    stages = pipeline.get("stages") if isinstance(pipeline, dict) else None
    return stages if isinstance(stages, dict) else {}


def read_stages(project_dir: str | Path) -> dict:
    """``stages:`` of ``<project_dir>/dvc.yaml``, as written (FineflowError when it cannot be read or has none)."""
    return _stages(project_dir)


def _stages(project_dir: str | Path) -> dict:
    path = Path(project_dir) / DVC_FILE
    try:
        pipeline = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise FineflowError(f"{path}: cannot read the pipeline ({exc.strerror})") from None
    stages = pipeline.get("stages") if isinstance(pipeline, dict) else None
    if not isinstance(stages, dict) or not stages:
        raise FineflowError(f"{path}: no `stages:` mapping, so there is no pipeline to run")
    return stages


def stage_names(project_dir: str | Path = ".") -> list[str]:
    """The names under ``stages:`` in ``<project_dir>/dvc.yaml``, in the file's order."""
    return list(_stages(project_dir))


def _params(project_dir: str | Path) -> dict:
    """``<project_dir>/params.yaml`` as a mapping (empty when there is none)."""
    path = Path(project_dir) / PARAMS_FILE
    return (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.exists() else {}


def _resolve(text: str, params: dict) -> str:
    """DVC's ``${dotted.key}`` templating, resolved from params."""
    return _TEMPLATE.sub(lambda m: str(_lookup(params, m.group(1))), text)


def _paths(entries, params: dict) -> list[str]:
    """The paths of a stage's ``deps``/``outs`` list (plain strings, or one-key mappings with options), with
    DVC's ``${dotted.key}`` templating resolved from params.yaml."""
    paths = [next(iter(e)) if isinstance(e, dict) else str(e) for e in entries or []]
    return [_resolve(path, params) for path in paths]


def _lookup(params: dict, dotted: str):
    node = params
    for key in dotted.split("."):
        node = node.get(key, "") if isinstance(node, dict) else ""
    return node


def _overlap(a: str, b: str) -> bool:
    """One path is the other or lies under it (a stage may depend on a file inside another's output dir)."""
    a, b = a.rstrip("/"), b.rstrip("/")
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def upstream_stages(project_dir: str | Path = ".") -> dict[str, list[str]]:
    """{stage: the stages whose outputs it depends on}, as DVC builds its graph from ``dvc.yaml``: what the
    Prefect flow hands each task as its upstream, so the run graph draws the pipeline's edges."""
    stages = _stages(project_dir)
    params = _params(project_dir)
    outs = {name: _paths(spec.get("outs"), params) for name, spec in stages.items()}
    deps = {name: _paths(spec.get("deps"), params) for name, spec in stages.items()}
    return {
        name: [
            other for other in stages if other != name and any(_overlap(d, o) for d in deps[name] for o in outs[other])
        ]
        for name in stages
    }


def stage_command(name: str, project_dir: str | Path = ".", python: str | None = None) -> list[str]:
    """The argv of stage ``name``'s ``cmd`` in ``<project_dir>/dvc.yaml``: ``${dotted.key}`` resolved from
    params.yaml, then split as a shell would. ``python``: an interpreter to run in place of a leading
    ``python`` (DVC finds ``python`` on PATH; a caller outside the venv passes ``sys.executable``)."""
    stage = _stages(project_dir).get(name)
    cmd = stage.get("cmd") if isinstance(stage, dict) else None
    if not isinstance(cmd, str) or not cmd.strip():
        raise FineflowError(f"{Path(project_dir) / DVC_FILE}: no stage {name!r} with a one-line `cmd`")
    argv = shlex.split(_resolve(cmd, _params(project_dir)))
    if python and argv[0] == "python":
        argv[0] = python
    return argv


def output_paths(spec: dict) -> list[str]:
    """A stage's ``outs`` as paths (an entry with options is a one-key mapping), as written."""
    return [next(iter(out)) if isinstance(out, dict) else str(out) for out in (spec or {}).get("outs") or []]


def persistent_outputs(project_dir: str | Path) -> dict[str, list[str]]:
    """{stage: its ``persist: true`` outputs}: what DVC keeps when it re-runs the stage."""
    persisted = {}
    for name, spec in _stages(project_dir).items():
        paths = [
            next(iter(out))
            for out in (spec or {}).get("outs") or []
            if isinstance(out, dict) and (next(iter(out.values())) or {}).get("persist")
        ]
        if paths:
            persisted[name] = paths
    return persisted


def project_root(path: str | Path) -> Path | None:
    """The DVC project (a dvc.yaml beside a .dvc directory) that path is inside, or None."""
    for folder in [Path(path).resolve(), *Path(path).resolve().parents]:
        if (folder / DVC_FILE).is_file() and (folder / ".dvc").is_dir():
            return folder
    return None


def owning_stage(root: Path, paths: list[Path]) -> str | None:
    """The dvc.yaml stage whose outputs include every one of paths, or None (also without a readable dvc.yaml)."""
    wanted = {Path(p).resolve().relative_to(root).as_posix() for p in paths}
    try:
        stages = _stages(root)
    except FineflowError:
        return None
    for name, spec in stages.items():
        if wanted <= {out.rstrip("/") for out in output_paths(spec)}:
            return name
    return None


# --- running dvc ----------------------------------------------------------------------------------------------


def dvc_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment with the venv's bin first on PATH, so dvc.yaml's ``python`` is this interpreter."""
    bin_dir = str(Path(sys.executable).parent)
    path = bin_dir + os.pathsep + os.environ.get("PATH", "")
    return {**os.environ, "PATH": path, "PYTHONUNBUFFERED": "1", **(extra or {})}


def dvc_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "dvc", *args]


def run_dvc(project_dir: str | Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``dvc <args>`` in the project, its output captured; the caller reads the exit code."""
    return subprocess.run(
        dvc_command(*args), cwd=project_dir, env=env or dvc_environment(), capture_output=True, text=True
    )


def popen_dvc(project_dir: str | Path, *args: str, env: dict[str, str] | None = None, **options) -> subprocess.Popen:
    """``dvc <args>`` started in the project, its stdout and stderr one line-buffered text stream."""
    return subprocess.Popen(
        dvc_command(*args),
        cwd=project_dir,
        env=env or dvc_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        **options,
    )


# DVC's hints after a stage ran (dvc/repo/scm_context.py, dvc/commands/repro.py): five lines repeated after every
# stage of a run, about git and remotes, that fineflow's own commands already take care of
_HINTS = (
    re.compile(r"^To track the changes with git, run:$"),
    re.compile(r"^\s*git add( \S+)+$"),
    re.compile(r"^To enable auto staging, run:$"),
    re.compile(r"^\s*dvc config core\.autostage true$"),
    re.compile(r"^Use `dvc push` to send your updates to remote storage\.$"),
)


def is_hint(line: str) -> bool:
    """Whether a line of `dvc repro`'s output is one of DVC's git/remote hints, not the run's own."""
    return any(pattern.match(line) for pattern in _HINTS)
