"""Re-runs never reuse a result made from other inputs: a train run is resumed only when it was
interrupted and everything that decides its trajectory is identical — the base weights by content, the
training code, the data, params, seed and world size. Through the real train stage command."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.conftest import ROOT, copy_project, finish_train, start_train, train_env, train_project, venv_env

STEPS = 6
OVERRIDES = {"train.steps": STEPS, "train.eval_every": STEPS, "checkpoint.every_steps": 2}


def _steps(project) -> list[int]:
    return [json.loads(line)["step"] for line in (project / "reports/train_steps.jsonl").read_text().splitlines()]


def _adapter(project):
    return load_file(project / "models/candidate/adapter_model.safetensors")


def _interrupt_after_a_checkpoint(project):
    """Start the stage and SIGKILL it once its step-2 checkpoint is published: an interrupted run."""
    proc = start_train(project, 1, train_env(1))
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if any(project.glob("checkpoints/*/step-0000002/manifest.json")) and len(_steps(project)) >= 3:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return
        time.sleep(0.01)
    pytest.fail(f"the run ended before it could be interrupted: {proc.communicate()[0][-2000:]}")


def _assert_trained_from_step_0(project, output):
    assert "resuming from" not in output, output[-3000:]
    assert _steps(project) == list(range(1, STEPS + 1))
    assert json.loads((project / "reports/train.json").read_text())["resumed_from_step"] == 0


@pytest.mark.slow
def test_a_finished_run_is_trained_again_not_handed_back(built, tmp_path):
    project = train_project(built, tmp_path, OVERRIDES)
    finish_train(project, 1)
    first = _adapter(project)
    (project / "models/candidate/adapter_model.safetensors").unlink()  # what a forced re-run starts from
    output = finish_train(project, 1)
    assert "is a finished run: training again from step 0" in output
    _assert_trained_from_step_0(project, output)
    again = _adapter(project)
    assert all(torch.equal(first[k], again[k]) for k in first)  # same inputs, trained again: same bytes


@pytest.mark.slow
def test_same_shape_new_base_weights_train_from_step_0(built, tmp_path):
    project = train_project(built, tmp_path, OVERRIDES)
    _interrupt_after_a_checkpoint(project)
    weights = project / "models/base/model.safetensors"
    with safe_open(weights, "pt") as fh:
        metadata = fh.metadata()
    tensors = {k: v * 1.01 if v.is_floating_point() else v for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata=metadata)  # same names, shapes and file size: only the values differ
    assert weights.stat().st_size == (built / "models/base/model.safetensors").stat().st_size
    output = finish_train(project, 1)
    _assert_trained_from_step_0(project, output)
    assert "an unfinished run of other inputs (base, data or code), not resumed" in output


@pytest.mark.slow
def test_a_change_to_the_training_code_trains_from_step_0(built, tmp_path):
    project = train_project(built, tmp_path, OVERRIDES)
    # the stage runs `python -m fineflow.stages.train` in the project: this copy of the package is what it runs
    shutil.copytree(ROOT / "fineflow", project / "fineflow", ignore=shutil.ignore_patterns("__pycache__"))
    _interrupt_after_a_checkpoint(project)
    loop = project / "fineflow/train/loop.py"
    loop.write_text(loop.read_text() + "\n# a change to the training code\n")
    output = finish_train(project, 1)
    _assert_trained_from_step_0(project, output)


def test_base_weights_are_identified_by_content_and_hashed_once(tmp_path):
    from fineflow.base_source import HASH_CACHE, base_identity

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    weights = base / "model.safetensors"
    weights.write_bytes(b"a" * 64)
    cache = tmp_path / "checkpoints"
    first = base_identity(str(base), cache)
    stat = weights.stat()
    weights.write_bytes(b"b" * 64)  # same size: only the content tells them apart
    second = base_identity(str(base), cache)
    (config_first, weights_first), (config_second, weights_second) = first["files"], second["files"]
    assert config_first == config_second and weights_first[:2] == weights_second[:2] == ["model.safetensors", 64]
    assert weights_first[2] != weights_second[2]
    # the cache is keyed by path, size and mtime: with the old mtime back, the cached (old) hash is used —
    # proof that an unchanged file is not read again
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert base_identity(str(base), cache) == first
    assert len(json.loads((cache / HASH_CACHE).read_text())) == 3  # config + two versions of the weights


def test_a_hub_id_is_identified_with_its_cached_revision_when_there_is_one():
    from fineflow.base_source import base_identity

    assert base_identity("some-org/not-cached-model") == {"id": "some-org/not-cached-model", "revision": None}


def _dvc_repro(project, *targets) -> list[str]:
    """`dvc repro` in the project; the stages it ran, in order."""
    result = subprocess.run(
        [sys.executable, "-m", "dvc", "repro", *targets],
        cwd=project,
        env=venv_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return re.findall(r"Running stage '(\w+)'", result.stdout)


@pytest.mark.scenario
@pytest.mark.nightly  # dvc repro up to train three times; CI keeps the other re-run tests
@pytest.mark.slow
def test_a_local_base_whose_files_change_at_the_same_path_reruns_what_depends_on_it(built, tmp_path):
    """model.base names a directory outside the project: DVC tracks only a marker for it, so the fingerprint
    stage (always run) hashes its files; a new checkpoint written at the same path re-runs everything after."""
    base = tmp_path / "my-base"
    shutil.copytree(built / "models/base", base)
    project = copy_project(tmp_path / "project", {"model.base": str(base), "train.steps": 2})
    upstream = ["base", "fingerprint", "data", "validate", "tokenize", "reference_logps", "train"]
    assert _dvc_repro(project, "train") == upstream
    assert _dvc_repro(project, "train") == ["fingerprint"]  # unchanged: the same hashes, nothing after it runs
    first = _adapter(project)
    weights = base / "model.safetensors"
    with safe_open(weights, "pt") as fh:
        metadata = fh.metadata()
    save_file({k: v * 1.01 for k, v in load_file(weights).items()}, weights, metadata=metadata)
    assert _dvc_repro(project, "train") == ["fingerprint", "validate", "tokenize", "reference_logps", "train"]
    assert json.loads((project / "reports/train.json").read_text())["resumed_from_step"] == 0
    second = _adapter(project)
    assert any(not torch.equal(first[k], second[k]) for k in first)  # trained on the new weights


def _install_champion(project, seed: int, tiny_params) -> str:
    """A random adapter promoted (by the registry's own promote, on hand-written scores) over whatever the
    project's champion is: a champion the evaluate stage has to score beside the candidate. Its id."""
    from fineflow.registry.champion import promote
    from fineflow.registry.store import alias_id
    from tests.conftest import random_adapter, write_scores

    adapter = random_adapter(project / "models/base", project.parent / f"champion-{seed}", seed=seed)
    current = alias_id(project / "models/registry")
    scores = write_scores(project.parent / f"scores-{seed}.json", 40, 0, (0, current) if current else None)
    report = promote(
        tiny_params,
        scores,
        adapter,
        project / "models/champion",
        project / "models/registry",
        base_dir=project / "models/base",
        shards_dir=project / "data/shards",
        root=project,
        log=lambda _: None,
    )
    assert report["decision"] == "promoted", report
    return report["candidate_id"]


def _scored_champion(project) -> str:
    return json.loads((project / "eval/scores.json").read_text())["champion"]["id"]


def test_evaluate_keeps_no_run_cache_entry_so_it_always_scores_the_champion_of_the_moment():
    """The per-PR form of the nightly scenario below: evaluate reads the champion, which it cannot declare (promote
    makes it), so its output is persisted, and DVC keeps no run-cache entry for a stage with a persisted output:
    a return of evaluate's declared inputs to an earlier state can never hand back an earlier champion's scores."""
    from fineflow.core.dvc_project import persistent_outputs, read_stages

    assert persistent_outputs(ROOT)["evaluate"] == ["eval"]
    assert "models/champion" not in read_stages(ROOT)["evaluate"].get("deps", [])  # undeclared: the reason


@pytest.mark.nightly
@pytest.mark.slow
def test_evaluate_scores_the_current_champion_when_its_other_inputs_return_to_an_earlier_state(
    reproduced, tmp_path, tiny_params
):
    """Evaluate is never restored from the run cache: it scores the champion of the moment. It reads the champion
    but cannot declare it (promote makes it: a cycle), so DVC's run cache, keyed on the declared inputs alone,
    would hand back an earlier champion's scores when evaluate.limit returns to an earlier value, and promote
    would refuse every run until a person forced evaluate."""
    from tests.conftest import copy_reproduced, write_params

    project = copy_reproduced(reproduced, tmp_path / "project")
    first = _install_champion(project, 11, tiny_params)
    second = _install_champion(project, 12, tiny_params)  # the champion now

    def repro_with_limit(limit: int) -> list[str]:
        write_params(project / "params.yaml", {"evaluate.limit": limit})
        return _dvc_repro(project)

    assert "evaluate" in repro_with_limit(4) and _scored_champion(project) == second
    rollback = subprocess.run(
        [sys.executable, "-m", "fineflow.cli", "registry", "rollback", "--to", first],
        cwd=project,
        env=venv_env(),
        capture_output=True,
        text=True,
    )
    assert rollback.returncode == 0, rollback.stderr
    assert "evaluate" in repro_with_limit(5) and _scored_champion(project) == first
    ran = repro_with_limit(4)  # evaluate's declared inputs as in the first run; the champion is not
    assert "evaluate" in ran and _scored_champion(project) == first
    promote = json.loads((project / "reports/promote.json").read_text())
    assert "re-run the evaluate stage" not in promote.get("reason", ""), promote
