"""The soak's short form (bench/soak.py): a few rounds of events and faults against a real Prefect server and
worker, the project's deployments and an S3 remote, every invariant checked after each round."""

import pytest

from tests.conftest import copy_reproduced


@pytest.mark.nightly  # ~190 s, CI's longest; CI keeps each fault it combines, one scenario each (tests/README.md)
@pytest.mark.slow
def test_a_short_soak_of_events_and_faults_leaves_every_invariant_true(reproduced, tmp_path):
    from bench.soak import soak

    project = copy_reproduced(reproduced, tmp_path / "project")  # a finished run: rounds re-run what changed
    # new data (its trigger's run) stopped by SIGTERM to every process; then a new base checkpoint at the same path
    # with a DVC lock entry whose PID now names an unrelated process. Each candidate is checked against a reference
    # run of its inputs. The long soak draws from every kind, approvals included: the tiny model never beats its
    # base, so no promotion asks for one here (bench/soak.py on the embedded default)
    plan = [("new_data", "sigterm_all"), ("new_base", "reused_pid_lock")]
    result = soak(tmp_path / "soak", 2, seed=1, fault_rate=0, project=project, plan=plan)
    summary = result["summary"]
    print(summary)  # shown with -s: the figures
    assert summary["invariant_failures"] == [], (tmp_path / "soak/soak.md").read_text()
    assert summary["faults"] == {"sigterm_all": 1, "reused_pid_lock": 1}, summary
    assert "SIGTERM to" in result["rounds"][0]["hit"], result["rounds"][0]
    assert all(r["states"][-1] == "COMPLETED" for r in result["rounds"]), result["rounds"]
    assert "new weights" in result["rounds"][1]["detail"], result["rounds"][1]
    assert [r["reference_states"] for r in result["rounds"]] == [1, 2], result["rounds"]  # one per input state


def test_a_candidate_that_is_not_its_inputs_reference_is_an_invariant_failure(tmp_path):
    """The reference invariant compares bytes: one changed weight byte of the candidate is reported, naming both."""
    import random

    import yaml

    from bench.soak import Soak, adapter_digest, reference_failures, train_inputs

    project = tmp_path / "project"
    candidate = project / "models/candidate"
    candidate.mkdir(parents=True)
    (candidate / "adapter_model.safetensors").write_bytes(bytes(range(256)))
    (candidate / "adapter_config.json").write_text("{}")
    (candidate / "README.md").write_text("a card: not the adapter")
    lock = {"stages": {"train": {"deps": [{"path": "data/shards", "md5": "abc"}], "params": {"params.yaml": {}}}}}
    (project / "dvc.lock").write_text(yaml.safe_dump(lock))
    soak = Soak(project, "", {}, random.Random(0))
    soak.references[train_inputs(project)] = adapter_digest(candidate)  # as the uninterrupted run made it
    (candidate / "README.md").write_text("another card")
    assert reference_failures(soak) == []
    (candidate / "adapter_model.safetensors").write_bytes(bytes(range(255)) + b"\x00")
    [failure] = reference_failures(soak)
    assert "is not the reference" in failure and train_inputs(project) in failure, failure


@pytest.mark.slow
def test_the_soaks_approver_answers_a_paused_promotion_late_through_the_server(prefect_server, tmp_path):
    """The approver (the soak's person) finds a run paused for PromotionApproval on a real server and answers it
    as drawn: late, at 60% of the timeout, approving, as the UI's Resume form does."""
    import os
    import subprocess
    import sys

    from bench.soak import APPROVER, Approver
    from tests.conftest import ROOT, venv_env

    script = tmp_path / "asks.py"
    script.write_text(
        "from prefect import flow\n"
        "from prefect.flow_runs import pause_flow_run\n"
        "from tasks.approval_pause import PromotionApproval\n"
        "@flow\n"
        "def asks():\n"
        "    answer = pause_flow_run(wait_for_input=PromotionApproval, timeout=60, poll_interval=1)\n"
        "    print('ANSWER', answer.approve, answer.approver, answer.comment)\n"
        "asks()\n"
    )
    env = {**venv_env(), "PREFECT_API_URL": prefect_server, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    approver = Approver(prefect_server, timeout_s=10)  # late: after 6 s
    try:
        approver.new_round("late")
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    finally:
        approver.stop()
    assert f"ANSWER True {APPROVER} soak: late" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    [answer] = approver.answers
    assert answer["answer"] == "late" and answer["after_s"] >= 6 and answer["status"] == "ACCEPT", answer
