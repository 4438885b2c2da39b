"""The data gate through DVC, as a user runs it: no PII original lands in any artefact, data paths may hold
spaces, and the user's eval task folders are DVC dependencies."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import copy_project, venv_env

# Found by the gate's PII check, and unique to this test (the bundled data has other card numbers and e-mails).
# Built at run time: this file is copied into the project the test searches.
CARD = " ".join(["5555"] * 3 + ["4444"])  # a Mastercard test number: passes Luhn
EMAIL = "@".join(["zoe.planted", "mailbox.test"])
API_KEY = "_".join(["sk", "live", "PLANTED0123456789abcdef"])
AWS_SECRET_KEY = "/".join(["wJalrXUtnFEMI", "K7MDENG", "bPxRfiCYPLANTEDKEY"])  # 40 characters, as AWS's
PLANTED = [CARD, CARD.replace(" ", ""), EMAIL, API_KEY, AWS_SECRET_KEY]


def _planted_rows() -> list[str]:
    """Rows that carry the secrets down every path a rejected row takes: a PII row, its duplicate (GX's
    unique check once showed duplicated texts), an over-long row, a wrong type (GX shows the value), a
    duplicate key and a line that is not JSON at all (stored raw); and issue 29's row, an AWS secret key after
    its key id and the word "secret" (main quarantined it for the id and showed the secret in the preview)."""
    pii = {"instruction": "Remember this.", "input": f"card {CARD}, mail {EMAIL}, key {API_KEY}", "output": "ok"}
    return [
        json.dumps(pii),
        json.dumps(pii),
        json.dumps({"instruction": "Long.", "input": f"{EMAIL} " + "word " * 600, "output": "ok"}),
        json.dumps({"instruction": "Typed.", "input": "", "output": [f"card {CARD}", API_KEY]}),
        f'{{"instruction": "Dup.", "output": "{EMAIL}", "output": "{API_KEY}"}}',
        f'{{"instruction": "Broken {CARD} {EMAIL}", "output": ',
        json.dumps(
            {
                "instruction": "Store these.",
                "input": f"key AKIAIOSFODNN7PLANTED secret {AWS_SECRET_KEY}",
                "output": "ok",
            }
        ),
    ]


def _files_under(root: Path, skip: Path):
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink() and path != skip:
            yield path


@pytest.mark.slow  # ~1 min: dvc repro of base, fingerprint, data and validate on the tiny config
def test_no_pii_original_lands_in_any_artefact(tmp_path):
    from fineflow.core.config import parse_params
    from fineflow.stages import data
    from tests.conftest import TINY_PARAMS

    project = copy_project(tmp_path / "project", {"data.train_path": "user/train.jsonl"})
    user_rows = project / "user/train.jsonl"  # the user's own file: the input, the one place the secrets may be
    user_rows.parent.mkdir()
    data.run(parse_params(TINY_PARAMS), user_rows, tmp_path / "unused-eval.jsonl")
    with user_rows.open("a", encoding="utf-8") as fh:
        fh.write("\n".join(_planted_rows()) + "\n")

    out = subprocess.run(["dvc", "repro", "validate"], cwd=project, env=venv_env(), capture_output=True, text=True)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]

    leaks = {secret: [] for secret in PLANTED}
    for path in _files_under(project, skip=user_rows):
        blob = path.read_bytes()
        for secret in PLANTED:
            if secret.encode() in blob:
                leaks[secret].append(str(path.relative_to(project)))
    for secret in PLANTED:
        if secret in log:
            leaks[secret].append("<dvc repro output>")
    assert leaks == {secret: [] for secret in PLANTED}
    quarantine = [json.loads(line) for line in (project / "data/validated/quarantine.jsonl").read_text().splitlines()]
    planted_lines = {r["line"] for r in quarantine if "[CREDIT_CARD]" in r["preview"] or "[EMAIL]" in r["preview"]}
    assert len(planted_lines) >= 5 and all(
        set(r) == {"split", "line", "reasons", "warnings", "sha256", "preview"} for r in quarantine
    )
    assert list(_files_under(project / ".dvc/cache", skip=user_rows)), "the search covered DVC's cache"


def _dvc_stage(project: Path, name: str, monkeypatch):
    from dvc.repo import Repo

    monkeypatch.chdir(project)  # DVC resolves the repo's paths from the working directory
    with Repo(str(project)) as repo:
        [stage] = repo.stage.collect(name)
        return stage


def test_data_paths_with_spaces_reach_the_validate_stage_whole(built, tmp_path, monkeypatch):
    """The validate command exactly as DVC renders it from dvc.yaml and params.yaml, run by the shell."""
    project = copy_project(
        tmp_path / "project", {"data.train_path": "my data/train rows.jsonl", "data.eval_path": "my data/eval.jsonl"}
    )
    (project / "my data").mkdir()
    shutil.copy(built / "data/raw/train.jsonl", project / "my data/train rows.jsonl")
    shutil.copy(built / "data/raw/eval.jsonl", project / "my data/eval.jsonl")
    shutil.copytree(built / "models/base", project / "models/base")
    stage = _dvc_stage(project, "validate", monkeypatch)
    assert {dep.def_path for dep in stage.deps} >= {"my data/train rows.jsonl", "my data/eval.jsonl"}
    out = subprocess.run(stage.cmd, shell=True, cwd=project, env=venv_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((project / "reports/validate.json").read_text())
    assert report["rows_in"] == len((built / "data/raw/train.jsonl").read_text().splitlines()) and report["passed"]


def test_a_quote_in_a_data_path_is_a_params_error():
    from fineflow.core.config import parse_params
    from fineflow.errors import ConfigError

    with pytest.raises(ConfigError, match=r"data\.train_path: must not contain a single quote"):
        parse_params({"data": {"train_path": "it's/train.jsonl"}})


def test_eval_task_folders_are_dependencies_of_the_evaluate_stage(tmp_path, monkeypatch):
    """evaluate.task_dirs live under eval_tasks/, which dvc.yaml declares as an evaluate dependency: DVC
    hashes the task YAMLs, so an edited task re-runs evaluate."""
    project = copy_project(tmp_path / "project", {"evaluate.task_dirs": ["eval_tasks/mine"]})
    task = project / "eval_tasks/mine/my_task.yaml"
    task.parent.mkdir(parents=True)
    task.write_text("task: my_task\n")
    stage = _dvc_stage(project, "evaluate", monkeypatch)
    [dep] = [dep for dep in stage.deps if dep.def_path == "eval_tasks"]
    before = dep.get_hash()
    task.write_text("task: my_task\nmetadata: {version: 2}\n")
    assert dep.get_hash() != before
