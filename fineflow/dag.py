"""The pipeline's stages, read from ``dvc.yaml``: the one place they are listed.

The Prefect flow runs them in this order, and lineage times a run from their reports, so a stage added to or
removed from ``dvc.yaml`` needs no second edit. Python keeps a YAML mapping's order, and ``dvc.yaml`` lists its
stages in the order they run (each after the stages it depends on). A stage's command line is read from there
too (``stage_command``): the tests and benchmarks that start a stage by hand run what DVC runs.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from fineflow.core.errors import FineflowError

DVC_FILE = "dvc.yaml"
PARAMS_FILE = "params.yaml"
_TEMPLATE = re.compile(r"\$\{([\w.-]+)\}")


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
