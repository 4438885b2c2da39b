"""Before the first stage runs: params.yaml is valid and every input path it names is there.

    python -c "from pathlib import Path; from fineflow.core.preflight import preflight; preflight(Path('.'))"

Every entry checks before any work, so a wrong path costs seconds, not a pretrained base: the flow process
(``make run``) before it starts the flow, the flow before its first stage, ``fineflow ci`` before it pulls, and
every stage entry (fineflow.core.entry), so that the first stage ``dvc repro`` runs refuses at once.

A path counts as there when it exists, when a stage of ``dvc.yaml`` writes it (``data.train_path``'s default,
``data/raw/train.jsonl``, is the data stage's output), or when DVC tracks it (a ``<path>.dvc`` beside it or
beside a folder above it: ``dvc pull`` or ``dvc repro --pull`` brings it). Relative paths are read from the
project root, where DVC runs the stages. Missing paths are reported all at once, each with its key.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import yaml

from fineflow.core.config import Params, load_params
from fineflow.core.errors import ConfigError

PARAMS_FILE = "params.yaml"
DVC_FILE = "dvc.yaml"
# where train.accelerate_profile's names live: the folder fineflow.train.profile resolves them in (beside the package)
PROFILE_DIR = Path(__file__).resolve().parents[2] / "configs" / "accelerate"


class InputPath(NamedTuple):
    key: str  # the params key that names it
    path: str  # as params.yaml gives it
    kind: str  # "file" | "folder": what must be there


def preflight(project: Path) -> Params:
    """The project's params, validated, with every input path they name there; else one ConfigError that lists
    every problem (the params' own problems first: paths read from invalid params are not checked)."""
    params = load_params(project / PARAMS_FILE)
    check_input_paths(params, project)
    return params


def input_paths(params: Params) -> list[InputPath]:
    """Every path params.yaml names that the pipeline reads and does not write itself."""
    paths = [InputPath("data.train_path", params.data.train_path, "file")]
    paths.append(InputPath("data.eval_path", params.data.eval_path, "file"))
    if names_a_directory(params.model.base):
        paths.append(InputPath("model.base", params.model.base, "folder"))
    paths += [InputPath("evaluate.task_dirs", folder, "folder") for folder in params.evaluate.task_dirs]
    profile = params.train.accelerate_profile
    if profile.endswith((".yaml", ".yml")):
        paths.append(InputPath("train.accelerate_profile", profile, "file"))
    elif profile != "auto":  # a name: a file of configs/accelerate/
        paths.append(InputPath("train.accelerate_profile", str(PROFILE_DIR / f"{profile}.yaml"), "file"))
    return paths


def names_a_directory(reference: str) -> bool:
    """model.base names a local directory, not a hub id (`name`, `org/name`): fineflow.model_ref.base_source's
    rule, which fails the base stage for such a reference that is no directory."""
    return reference.startswith((".", "/", "~")) or reference.count("/") > 1


def check_input_paths(params: Params, project: Path) -> None:
    """Raise one ConfigError naming every input path (key and path) that is missing from project."""
    produced = stage_outputs(project)
    missing = [entry for entry in input_paths(params) if not _available(entry, project, produced)]
    if missing:
        lines = [f"{PARAMS_FILE}: {entry.key}: no such {entry.kind}: {entry.path!r}" for entry in missing]
        raise ConfigError(
            f"{len(lines)} input path(s) named in {PARAMS_FILE} do not exist (relative ones are read from "
            f"{project.resolve()}): point each key at an existing file or folder, or at one DVC tracks (`fineflow "
            f"data add FILE`):\n  " + "\n  ".join(lines)
        )


def _available(entry: InputPath, project: Path, produced: list[str]) -> bool:
    path = project / Path(entry.path).expanduser()
    there = path.is_dir() if entry.kind == "folder" else path.is_file()
    return there or _under_any(entry.path, produced) or _tracked_by_dvc(path, project)


def stage_outputs(project: Path) -> list[str]:
    """The outputs the stages of project's dvc.yaml declare (as written there); none without a dvc.yaml."""
    path = project / DVC_FILE
    if not path.is_file():
        return []
    try:
        pipeline = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    stages = pipeline.get("stages") if isinstance(pipeline, dict) else None
    if not isinstance(stages, dict):
        return []  # no pipeline to write anything (DVC says so when it runs)
    outs = [out for stage in stages.values() if isinstance(stage, dict) for out in stage.get("outs") or []]
    return [next(iter(out)) if isinstance(out, dict) else str(out) for out in outs]


def _under_any(path: str, folders: list[str]) -> bool:
    """path is one of folders, or lies under one (an output may be a folder)."""
    path = path.removeprefix("./").rstrip("/")
    return any(path == out.rstrip("/") or path.startswith(out.rstrip("/") + "/") for out in folders)


def _tracked_by_dvc(path: Path, project: Path) -> bool:
    """A `<name>.dvc` beside path or beside a folder above it, inside project (DVC tracks nothing outside)."""
    root = project.resolve()
    path = path.resolve()
    if not path.is_relative_to(root):
        return False
    inside = [p for p in [path, *path.parents] if p != root and p.is_relative_to(root)]
    return any(p.with_name(p.name + ".dvc").is_file() for p in inside)
