"""End to end: the Prefect flow over `dvc repro --single-item`, then plain `dvc repro`, on the tiny config.

Shows: every stage runs and reports; a second flow run skips every stage; changing only train.* re-runs
train -> evaluate -> promote and nothing upstream; a plain `dvc repro` in a fresh copy leaves the same
dvc.lock as the flow.
"""

import subprocess
import sys

import pytest
import yaml

from tests.conftest import copy_project, venv_env

STAGES = ["base", "data", "validate", "tokenize", "train", "evaluate", "promote"]


@pytest.fixture(scope="module")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _dvc(project, *args):
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, env=venv_env(), capture_output=True,
                          text=True, timeout=900)


def _ran_stages(output: str) -> list[str]:
    return [s for s in STAGES if f"Running stage '{s}'" in output]


def test_flow_then_dvc_repro(prefect_harness, tmp_path, monkeypatch):
    from flows.pipeline import fineflow_pipeline

    flow_copy = copy_project(tmp_path / "flow")
    monkeypatch.setenv("PATH", venv_env()["PATH"])
    results = fineflow_pipeline(str(flow_copy))
    assert set(results) == set(STAGES) and all(r["ran"] for r in results.values())
    reports = {stage: r["report"] for stage, r in results.items()}
    assert reports["validate"]["rows_in"] == reports["validate"]["rows_kept"] + reports["validate"]["rows_quarantined"]
    assert reports["train"]["world_size"] == 1 and reports["promote"]["decision"] in {"promoted", "refused"}
    for stage in STAGES:
        assert (flow_copy / "reports" / f"{stage}.json").exists()
    flow_lock = yaml.safe_load((flow_copy / "dvc.lock").read_text())
    assert set(flow_lock["stages"]) == set(STAGES)

    # nothing changed: the second flow run skips every stage
    again = fineflow_pipeline(str(flow_copy))
    assert [stage for stage, r in again.items() if r["ran"]] == []
    assert yaml.safe_load((flow_copy / "dvc.lock").read_text()) == flow_lock

    # a train-only change re-runs train -> evaluate -> promote, nothing upstream
    params = yaml.safe_load((flow_copy / "params.yaml").read_text())
    params["train"]["lr"] = 1e-3
    (flow_copy / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    rerun = _dvc(flow_copy, "repro")
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert _ran_stages(rerun.stdout) == ["train", "evaluate", "promote"]

    # plain dvc repro in a fresh copy: same artefacts, same lock
    repro_copy = copy_project(tmp_path / "repro")
    result = _dvc(repro_copy, "repro")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    repro_lock = yaml.safe_load((repro_copy / "dvc.lock").read_text())
    for stage in STAGES:  # outs' md5s equal: the same artefacts, byte for byte
        assert repro_lock["stages"][stage] == flow_lock["stages"][stage], stage


def test_a_stage_counts_as_run_even_when_its_output_pushes_dvcs_line_out_of_the_log_tail(tmp_path, monkeypatch):
    """The evaluate stage prints ~90 lines: "Running stage 'evaluate'" must still be seen (it was missed once,
    when only the last 60 lines were searched)."""
    import tasks.stages as stages

    fake = tmp_path / "fake_dvc.py"  # stands in for `python -m dvc repro`: DVC's line, then 200 of the stage's
    fake.write_text("print(\"Running stage 'evaluate':\")\nfor i in range(200):\n    print(f'line {i}')\n")
    real_popen = stages.subprocess.Popen
    monkeypatch.setattr(stages.subprocess, "Popen", lambda command, **kw: real_popen([sys.executable, str(fake)], **kw))
    lines = []
    assert stages.repro_single("evaluate", tmp_path, lines.append) is True
    assert len(lines) == 201
