"""The training plan is decided once, by the launcher (fineflow.train.run_plan.fit_plan), and handed to its ranks
(RunPlan.environment): a rank reads it instead of planning again."""

from __future__ import annotations

import pytest

from fineflow.train import procedure, run_plan
from fineflow.train.profile import load_profile


@pytest.fixture
def plan(tiny_params, built):
    from fineflow.base_source import resolve_base_model

    reference = resolve_base_model(tiny_params.model, built / "models/base")
    return run_plan.fit_plan(tiny_params, load_profile("auto"), reference, has_gpu=False)


def test_the_plan_survives_the_trip_to_the_ranks_unchanged(plan):
    given = run_plan.given_plan(plan.environment())
    assert given.params == plan.params and given.profile == plan.profile
    assert (given.changes, given.warnings) == (plan.changes, plan.warnings)
    assert given.memory["gib"] == plan.memory["gib"] and given.memory["precision"] == plan.memory["precision"]
    assert run_plan.given_plan({}) is None  # a rank started in-process or by hand plans for itself


def test_a_rank_given_its_launchers_plan_does_not_plan_again(plan, built, tmp_path, monkeypatch):
    """Even params the rank was handed that differ (here its micro-batch) do not matter: the plan decides."""
    for name, value in plan.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(procedure, "fit_plan", lambda *args: pytest.fail("a rank planned again"))
    other = plan.params.model_copy(update={"train": plan.params.train.model_copy(update={"micro_batch_size": 7})})
    paths = procedure.RankPaths(built / "data/shards", built / "models/base", tmp_path, tmp_path, tmp_path / "s.jsonl")
    rank = procedure.TrainProcedure(other, paths, log=lambda line: None)
    rank._setup_plan()
    assert rank.run.params == plan.params and rank.cfg.micro_batch_size == plan.train.micro_batch_size


def test_a_cluster_engines_ranks_get_the_launchers_plan(plan, monkeypatch):
    """train.launcher ray or slurm: the job the engine places carries the same plan local ranks get."""
    from fineflow.train import engines

    jobs = []
    monkeypatch.setattr(engines, "run_job", lambda launcher, job, log, spans: jobs.append(job) or 0)
    assert procedure.run_cluster_job(plan, plan.profile, False, "fineflow.stages.train", [], log=lambda line: None) == 0
    given = run_plan.given_plan(jobs[0].env)
    assert given is not None and given.params == plan.params and given.memory["gib"] == plan.memory["gib"]
