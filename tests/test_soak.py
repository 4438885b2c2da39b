"""The soak's short form (bench/soak.py): a few rounds of events and faults against a real Prefect server and
worker, the project's deployments and an S3 remote, every invariant checked after each round."""

import pytest

from tests.conftest import copy_reproduced


@pytest.mark.scenario
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
