"""dvc.yaml declares every piece of fineflow code a stage runs, so a code change always re-runs the stages it
affects (a missing dependency lets DVC skip a stage whose code changed: a stale model, silently).

Two views of "the code a stage runs", and each stage's deps must cover both:
- what importing its entry really loads: ``python -c "import fineflow.stages.<stage>"`` in a fresh
  interpreter, then every ``fineflow`` module in ``sys.modules``;
- every ``fineflow`` module reachable through import statements from the entry, including the imports that
  functions make lazily (heavy libraries are imported where they are used, so the first view alone would
  miss a module that only a function body imports).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DVC_STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def entry_module(stage: dict) -> str:
    match = re.search(r"python -m (fineflow\.stages\.\w+)", stage["cmd"])
    assert match, f"stage command {stage['cmd']!r} does not run a fineflow.stages entry"
    return match.group(1)


def module_file(name: str) -> Path | None:
    base = ROOT / Path(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def modules_on_import(module: str) -> set[str]:
    listing = "sorted(m for m in sys.modules if m.split('.')[0] == 'fineflow')"
    code = f"import json, sys, {module}; print(json.dumps({listing}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _imported_names(path: Path) -> set[str]:
    """fineflow modules named by every import statement in the file, function bodies included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from pkg import module`
    return {n for n in names if n.split(".")[0] == "fineflow" and module_file(n) is not None}


def with_parents(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def modules_reachable(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        for found in with_parents(name) - seen:
            seen.add(found)
            todo += sorted(_imported_names(module_file(found)))
    return seen


def covered(path: Path, deps: list[str]) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    return any(rel == dep or rel.startswith(dep.rstrip("/") + "/") for dep in deps)


@pytest.mark.parametrize("stage", sorted(DVC_STAGES))
def test_stage_deps_cover_every_module_the_stage_runs(stage):
    entry = entry_module(DVC_STAGES[stage])
    deps = [d if isinstance(d, str) else next(iter(d)) for d in DVC_STAGES[stage]["deps"]]
    loaded, reachable = modules_on_import(entry), modules_reachable(entry)
    assert entry in loaded and entry in reachable
    missing = sorted(
        {module_file(m).relative_to(ROOT).as_posix() for m in loaded | reachable if not covered(module_file(m), deps)}
    )
    assert not missing, f"dvc.yaml stage {stage} does not list code it runs: {missing}"


def test_static_view_sees_lazy_imports():
    """The second view is what catches a function-level import: the train entry imports the checkpoint
    package only inside the recipe's functions."""
    assert "fineflow.checkpoint" in modules_reachable("fineflow.stages.train")
    assert "fineflow.train.resume" in modules_reachable("fineflow.stages.train")


def test_a_missing_dependency_is_reported(tmp_path):
    """The check itself can fail: drop the tokenize package from train's deps and it names the shard code."""
    deps = [d for d in DVC_STAGES["train"]["deps"] if d != "fineflow/tokenize"]
    reachable = modules_reachable("fineflow.stages.train")
    missing = {module_file(m).relative_to(ROOT).as_posix() for m in reachable if not covered(module_file(m), deps)}
    assert "fineflow/tokenize/shards.py" in missing


def test_library_never_imports_a_stage_entry():
    """Stage entries are callers of the library, never a library themselves."""
    offenders = []
    for path in sorted((ROOT / "fineflow").rglob("*.py")):
        if path.parent.name == "stages":
            continue
        rel = path.relative_to(ROOT).as_posix()
        offenders += [f"{rel} imports {n}" for n in _imported_names(path) if n.startswith("fineflow.stages")]
    assert not offenders, offenders


@pytest.mark.parametrize("stage", sorted(DVC_STAGES))
def test_every_output_dvc_records_travels_with_dvc_push(stage):
    """Every output DVC records goes to the cache, so `dvc pull` brings back all that the lock names and a clone
    that pulled everything has nothing to reproduce. (checkpoints/ is the train stage's scratch, read only by its
    resume, and no output: a `cache: false` output never travels, and the lock would hash the checkpoints of
    every configuration left in the workspace.)"""
    for out in DVC_STAGES[stage].get("outs", []):
        path, options = (out, {}) if isinstance(out, str) else next(iter(out.items()))
        assert options.get("cache", True), f"dvc.yaml stage {stage}: output {path} is `cache: false`"
    assert "--checkpoints" not in DVC_STAGES[stage]["cmd"] or all(
        "checkpoints" not in (out if isinstance(out, str) else next(iter(out))) for out in DVC_STAGES[stage]["outs"]
    )
