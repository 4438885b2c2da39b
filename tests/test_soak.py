"""The soak's short form (bench/soak.py): a few rounds of events and faults against a real Prefect server and
worker, the project's deployments and an S3 remote, every invariant checked after each round."""

import pytest

from tests.conftest import copy_reproduced


@pytest.mark.scenario
@pytest.mark.slow
def test_a_short_soak_of_events_and_faults_leaves_every_invariant_true(reproduced, tmp_path):
    from bench.soak import soak

    project = copy_reproduced(reproduced, tmp_path / "project")  # a finished run: rounds re-run what changed
    # new data (its trigger's run) stopped by SIGTERM to every process; then the nightly run with a DVC lock entry
    # whose PID now names an unrelated process. The long soak draws from every kind (bench/soak.py)
    plan = [("new_data", "sigterm_all"), ("nightly", "reused_pid_lock")]
    result = soak(tmp_path / "soak", runs=2, duration_s=None, seed=1, fault_rate=0, project=project, plan=plan)
    summary = result["summary"]
    print(summary)  # shown with -s: the figures
    assert summary["invariant_failures"] == [], (tmp_path / "soak/soak.md").read_text()
    assert summary["faults"] == {"sigterm_all": 1, "reused_pid_lock": 1}, summary
    assert "SIGTERM to" in result["rounds"][0]["hit"], result["rounds"][0]
    assert all(r["states"][-1] == "COMPLETED" for r in result["rounds"]), result["rounds"]
