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

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fineflow import code_deps

ROOT = Path(__file__).resolve().parent.parent
DVC_STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def entry_module(stage: dict) -> str:
    entry = code_deps.entry_module(stage["cmd"])
    assert entry, f"stage command {stage['cmd']!r} does not run a fineflow.stages entry"
    return entry


def module_file(name: str) -> Path | None:
    return code_deps.module_file(ROOT, name)


def modules_on_import(module: str) -> set[str]:
    listing = "sorted(m for m in sys.modules if m.split('.')[0] == 'fineflow')"
    code = f"import json, sys, {module}; print(json.dumps({listing}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def modules_reachable(module: str) -> set[str]:
    return code_deps.reachable_modules(ROOT, module)


def _imported_names(path: Path) -> set[str]:
    return code_deps.imported_modules(ROOT, path)


def covered(path: Path, deps: list[str]) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    return any(rel == dep or rel.startswith(dep.rstrip("/") + "/") for dep in deps)


def test_dvc_yaml_code_deps_are_what_each_entry_imports():
    """The code deps are generated (fineflow dvc-deps --write): neither a module less (a stale model) nor a folder
    more (an edit re-running stages that never import it)."""
    text = (ROOT / "dvc.yaml").read_text()
    generated = code_deps.stage_code_deps(ROOT, DVC_STAGES)
    assert code_deps.rewrite(text, ROOT, generated) == text, "run `fineflow dvc-deps --write`"
    for stage, files in generated.items():
        deps = [d if isinstance(d, str) else next(iter(d)) for d in DVC_STAGES[stage]["deps"]]
        assert [d for d in deps if code_deps.is_code_dep(ROOT, d)] == files
    assert "fineflow/train/loop.py" not in generated["base"] and "fineflow/data/checks.py" in generated["validate"]


@pytest.mark.slow
def test_an_edit_makes_dvc_see_only_the_stages_that_import_the_file_changed(tmp_path):
    """DVC itself, on this checkout's code and dvc.yaml's code deps (the commands replaced by a no-op, outputs and
    params left out, so the whole pipeline "runs" in seconds): after one line added to a file, `dvc status` names
    exactly the stages whose entries import it: a validate-only check re-runs validate, never base pretraining;
    the tokenizer code re-runs tokenize and validate (which counts tokens with it); the config, every stage."""
    import shutil

    from tests.conftest import venv_env

    project = tmp_path / "p"
    shutil.copytree(ROOT / "fineflow", project / "fineflow", ignore=shutil.ignore_patterns("__pycache__"))
    stages = {
        name: {
            "cmd": "true",
            "deps": [d for d in spec["deps"] if isinstance(d, str) and code_deps.is_code_dep(ROOT, d)],
        }
        for name, spec in DVC_STAGES.items()
    }
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))

    def dvc(*args):
        done = subprocess.run(
            [sys.executable, "-m", "dvc", *args], cwd=project, env=venv_env(), capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    dvc("init", "-q")
    dvc("repro", "-q")
    generated = code_deps.stage_code_deps(ROOT, DVC_STAGES)
    for edited in ("fineflow/data/checks.py", "fineflow/tokenize/tokenization.py", "fineflow/core/config.py"):
        with (project / edited).open("a", encoding="utf-8") as f:
            f.write("# one line\n")
        stale = set(json.loads(dvc("status", "--json")))
        assert stale == {name for name, files in generated.items() if edited in files}, edited
        assert stale and ("base" in stale) == (edited == "fineflow/core/config.py"), (edited, stale)
        dvc("repro", "-q")
    assert json.loads(dvc("status", "--json")) == {}


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
    """The check itself can fail: drop the shard code from train's deps and it names it."""
    deps = [d for d in DVC_STAGES["train"]["deps"] if d != "fineflow/tokenize/shards.py"]
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


# --- params: an edit re-runs the stages that read the key ---------------------------------------------------------

OBJECTIVE_NAMES = ("sft", "dpo", "simpo", "orpo", "kto", "reward_model", "grpo")


def _objectives(test) -> set[str]:
    from fineflow.objectives import OBJECTIVES

    return {name for name, objective in OBJECTIVES.items() if test(objective)}


def params_read(objective: str) -> dict[str, set[str]]:
    """The keys an objective's runs read beside train.lr, and the stages whose code reads each one for it: beta and
    every objective's own section (train.<name>, its Objective.params: fineflow/objectives/<name>.py) in train,
    beta in evaluate's pair scoring (the objectives whose eval task is fineflow_preference), the choice of the model
    a run starts from in train, the fingerprint stage (the champion's identity) and the reference_logps stage (the
    anchored objectives), the batch there too for those with a reference model to score."""
    from fineflow.objectives import OBJECTIVES, PREFERENCE_TASK

    referenced = objective in _objectives(lambda o: o.needs_reference)
    anchored = objective in _objectives(lambda o: o.anchored)
    scored_in_pairs = objective in _objectives(lambda o: o.eval_task == PREFERENCE_TASK)
    loss_reads = {"train.preference.beta": {"dpo", "simpo", "kto"}}  # orpo's weight is its own; the reward model none
    for name, other in OBJECTIVES.items():
        for field in other.params.model_fields if other.params is not None else ():
            loss_reads[f"train.{name}.{field}"] = {name}
    loss_reads["train.preference.reference"] = _objectives(lambda o: o.anchored)  # the policy starts from its model
    read = {"train.lr": {"train"}, "train.micro_batch_size": {"train"} | ({"reference_logps"} if referenced else set())}
    for key, objectives in loss_reads.items():
        read[key] = {"train"} if objective in objectives else set()
    if scored_in_pairs:
        read["train.preference.beta"].add("evaluate")
    if anchored:
        read["train.preference.reference"] |= {"fingerprint", "reference_logps"}
    return read


# per PR: sft, an objective with a reference model (dpo) and an online one (grpo); the others nightly (~3 s each)
@pytest.mark.parametrize(
    "objective",
    [n if n in ("sft", "dpo", "grpo") else pytest.param(n, marks=pytest.mark.nightly) for n in OBJECTIVE_NAMES],
)
def test_a_param_edit_makes_dvc_see_only_the_stages_that_read_it_for_any_objective(tmp_path, monkeypatch, objective):
    """DVC itself (its API, in this process: no interpreter start per call), on dvc.yaml's params declarations (the
    commands replaced by a no-op, deps and outputs left out: no training): after `dvc repro` with train.objective
    <objective>, each edit of one key (train.lr, the micro-batch, the pair objectives' constants, the reference's
    choice) makes `dvc status` name the stages that always run and exactly the stages whose code reads the key for
    some objective. So no stage that reads it for this objective is left stale, and the reference_logps stage never
    re-runs for train.lr, beta, gamma, lambda or kto's weights. (DVC's params cannot depend on train.objective: a
    key that only another objective's stage reads dirties that stage here too; the train stage declares its whole
    section, so any train.* key re-trains.)"""
    from dvc.repo import Repo

    from tests.conftest import write_params

    project = tmp_path / "p"
    project.mkdir()
    stages = {
        name: {"cmd": "true", "params": spec["params"], "always_changed": bool(spec.get("always_changed"))}
        for name, spec in DVC_STAGES.items()
    }
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    monkeypatch.chdir(project)  # DVC's API, as its CLI, works from inside the repository

    def stale() -> set[str]:
        with Repo(str(project)) as repo:
            return set(repo.status())

    always = {name for name, spec in DVC_STAGES.items() if spec.get("always_changed")}
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    Repo.init(str(project)).close()
    base = {"train.objective": objective, "train.preference.reference": "champion"}
    write_params(project / "params.yaml", base)
    with Repo(str(project)) as repo:
        repo.reproduce()
    assert stale() == always
    read = params_read(objective)
    read_by_any = {key: set().union(*(params_read(other)[key] for other in OBJECTIVE_NAMES)) for key in read}
    edits = {"train.lr": 0.123, "train.micro_batch_size": 3, "train.preference.reference": "base"}
    for key in read:
        write_params(project / "params.yaml", {**base, key: edits.get(key, 0.789)})
        dirty = stale()
        assert read[key] <= dirty, (key, dirty)  # nothing that reads it for this objective is left stale
        assert dirty == always | read_by_any[key], (key, dirty)
    assert read_by_any["train.preference.beta"] - always == {"train", "evaluate"}  # the check tells stages apart
