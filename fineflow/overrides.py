"""Param overrides with dotted keys (``{"train.lr": 1e-3}``), as ``dvc exp run -S train.lr=1e-3`` applies them.

A run started from the Prefect UI with overrides first validates them against params.yaml's schema, all at once
(a misspelt key, a bad value, a key under a leaf: every problem named, nothing applied); then writes them into
the workspace's params.yaml with DVC's own override code (``dvc.utils.hydra.apply_overrides``, which keeps the
file's comments and layout), so ``dvc.lock`` records the values the stages ran with and ``git diff params.yaml``
shows them. Never silent: the run publishes them and carries them in its name.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

from fineflow.core.config import parse_params
from fineflow.errors import ConfigError


def merged(raw: dict, overrides: dict[str, Any]) -> tuple[dict, list[str]]:
    """raw with every dotted override set; the problems that stop one from being set (its parent is a value)."""
    out, problems = copy.deepcopy(raw), []
    for dotted, value in overrides.items():
        node, *parents, leaf = [out, *dotted.split(".")]
        for depth, key in enumerate(parents):
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                problems.append(f"{dotted}: {'.'.join(parents[: depth + 1])} is a value, not a section")
                break
            node = child
        else:
            node[leaf] = value
    return out, problems


def validate(params_file: Path, overrides: dict[str, Any]) -> None:
    """Raise ConfigError naming every override that params.yaml's schema refuses (nothing is written)."""
    raw = yaml.safe_load(params_file.read_text(encoding="utf-8")) or {}
    candidate, problems = merged(raw, overrides)
    try:
        parse_params(candidate, source="the run's param overrides")
    except ConfigError as exc:
        problems.append(str(exc))
    if problems:
        raise ConfigError("param overrides refused, nothing applied:\n  " + "\n  ".join(problems))


def apply(params_file: Path, overrides: dict[str, Any]) -> list[str]:
    """Validate, then write the overrides into params_file as `dvc exp run -S` does; returns them as
    ``key=value`` strings (JSON values)."""
    if not overrides:
        return []
    validate(params_file, overrides)
    from dvc.utils.hydra import apply_overrides

    assignments = [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    apply_overrides(params_file, assignments)
    return assignments
