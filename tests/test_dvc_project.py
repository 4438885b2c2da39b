"""fineflow.core.dvc_project.stage_command: a stage's command line read from dvc.yaml, as DVC would run it."""

from __future__ import annotations

import importlib
import sys

import pytest
import yaml

from fineflow.core.dvc_project import stage_command, stage_names
from fineflow.errors import FineflowError
from tests.conftest import ROOT


def _project(path, stages: dict, params: dict | None = None):
    (path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}), encoding="utf-8")
    if params is not None:
        (path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    return path


def test_a_command_is_split_as_the_shell_splits_it_with_templates_resolved_from_params(tmp_path):
    cmd = "python -m tool --train '${data.train_path}' --n ${data.n} --out out"
    project = _project(tmp_path, {"s": {"cmd": cmd}}, {"data": {"train_path": "my data/a b.jsonl", "n": 3}})
    assert stage_command("s", project) == [
        "python",
        "-m",
        "tool",
        "--train",
        "my data/a b.jsonl",
        "--n",
        "3",
        "--out",
        "out",
    ]


def test_a_folded_multi_line_command_is_one_argv_and_only_a_leading_python_is_replaced(tmp_path):
    project = _project(tmp_path, {"s": {"cmd": "python -m tool\n--say python\n"}, "t": {"cmd": "dvc status"}})
    assert stage_command("s", project, python="/venv/bin/python") == [
        "/venv/bin/python",
        "-m",
        "tool",
        "--say",
        "python",
    ]
    assert stage_command("t", project, python="/venv/bin/python") == ["dvc", "status"]


@pytest.mark.parametrize("stages", [{"s": {"cmd": ["a", "b"]}}, {"s": {"deps": ["x"]}}, {"other": {"cmd": "x"}}])
def test_a_missing_stage_or_a_command_that_is_not_one_line_is_an_error_naming_it(tmp_path, stages):
    with pytest.raises(FineflowError, match="'s'"):
        stage_command("s", _project(tmp_path, stages))


@pytest.mark.parametrize("name", ["train", "goodput"])
def test_the_stages_tests_start_by_hand_are_this_projects_dvc_yaml_commands_and_their_parsers_accept_them(name):
    """The train and goodput stages, which tests and bench/goodput.py start without DVC, run the argv dvc.yaml
    gives them on this interpreter, and the stage's own parser accepts every argument in it."""
    argv = stage_command(name, ROOT, python=sys.executable)
    assert argv[:3] == [sys.executable, "-m", f"fineflow.stages.{name}"]
    importlib.import_module(argv[2]).parse_args(argv[3:])  # an unknown or missing argument exits


def test_no_stage_of_this_projects_dvc_yaml_is_left_with_a_template_or_a_bare_python():
    for name in stage_names(ROOT):
        argv = stage_command(name, ROOT, python=sys.executable)
        assert argv[:2] == [sys.executable, "-m"] and "${" not in " ".join(argv), (name, argv)


def test_the_committed_dvc_lock_holds_only_stages_dvc_yaml_defines():
    """DVC keeps a renamed stage's old entry in dvc.lock: `dvc pull` of the lock's outputs then names a path no
    stage has and fails (the reference stage's models/reference after its rename to reference_logps)."""
    locked = yaml.safe_load((ROOT / "dvc.lock").read_text(encoding="utf-8"))["stages"]
    assert sorted(set(locked) - set(stage_names(ROOT))) == []
