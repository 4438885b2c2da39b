"""Before the first stage runs: params.yaml is valid and every input path it names is there.

    python -c "from pathlib import Path; from fineflow.core.preflight import preflight; preflight(Path('.'))"

Every entry checks before any work, so a wrong path costs seconds, not a pretrained base: the flow process
(``make run``) before it starts the flow, the flow before its first stage, ``fineflow ci`` before it pulls, and
every stage entry (fineflow.core.entry), so that the first stage ``dvc repro`` runs refuses at once.

A path counts as there when it exists, when a stage of ``dvc.yaml`` writes it (``data.train_path``'s default,
``data/raw/train.jsonl``, is the data stage's output), or when DVC tracks it (a ``<path>.dvc`` beside it or
beside a folder above it: ``dvc pull`` or ``dvc repro --pull`` brings it). A path is checked only when
``dvc.yaml`` has the stage that reads it (a pipeline cut down to promote needs no training data). Relative
paths are read from the project root, where DVC runs the stages. Missing paths are reported all at once, each
with its key.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from fineflow.core.config import Params, load_params
from fineflow.core.dvc_project import output_paths, pipeline_stages
from fineflow.errors import ConfigError

PARAMS_FILE = "params.yaml"
# where train.accelerate_profile's names live: the folder fineflow.train.profile resolves them in (beside the package)
PROFILE_DIR = Path(__file__).resolve().parents[2] / "configs" / "accelerate"


class InputPath(NamedTuple):
    key: str  # the params key that names it
    path: str  # as params.yaml gives it
    kind: str  # "file" | "folder": what must be there
    reader: str | None  # the stage that reads it (None: several); unchecked when dvc.yaml has no such stage


def preflight(project: Path) -> Params:
    """The project's params, validated, with every input path they name there; else one ConfigError that lists
    every problem (the params' own problems first: paths read from invalid params are not checked)."""
    params = load_params(project / PARAMS_FILE)
    check_input_paths(params, project)
    return params


def input_paths(params: Params) -> list[InputPath]:
    """Every path params.yaml names as an input of the pipeline, with the stage that reads it."""
    paths = [InputPath("data.train_path", params.data.train_path, "file", "validate")]
    paths.append(InputPath("data.eval_path", params.data.eval_path, "file", "validate"))
    if names_a_directory(params.model.base):
        paths.append(InputPath("model.base", params.model.base, "folder", None))
    paths += [InputPath("evaluate.task_dirs", folder, "folder", "evaluate") for folder in params.evaluate.task_dirs]
    profile = params.train.accelerate_profile
    if profile.endswith((".yaml", ".yml")):
        paths.append(InputPath("train.accelerate_profile", profile, "file", "train"))
    elif profile != "auto":  # a name: a file of configs/accelerate/
        profile_file = str(PROFILE_DIR / f"{profile}.yaml")
        paths.append(InputPath("train.accelerate_profile", profile_file, "file", "train"))
    return paths


def names_a_directory(base: str) -> bool:
    """model.base names a local directory, not a hub id (`name`, `org/name`). fineflow.base_source.base_source
    uses this rule too: such a reference that is no directory fails the base stage."""
    return base.startswith((".", "/", "~")) or base.count("/") > 1


def check_input_paths(params: Params, project: Path) -> None:
    """Raise one ConfigError naming every input path (key and path) that is missing from project. Only the
    inputs of the stages project's dvc.yaml has are checked (all of them without a dvc.yaml), and a path one
    of its stages writes counts as there."""
    stages = pipeline_stages(project)
    produced = [out for spec in (stages or {}).values() if isinstance(spec, dict) for out in output_paths(spec)]
    wanted = [entry for entry in input_paths(params) if stages is None or entry.reader in (None, *stages)]
    missing = [entry for entry in wanted if not _available(entry, project, produced)]
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
