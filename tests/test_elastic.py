"""train.elastic: a checkpoint resumes on another number of ranks with the same global batch (fineflow.train.elastic).

Unit tests of the run identity, the accumulation and the refusals; then the issue's test on real processes (the
train stage under accelerate launch, 2 ranks over gloo): 2 ranks killed after a checkpoint, finished on 1 rank with
the accumulation doubled, must match the uninterrupted 2-rank run's loss and lr per step (and back, 1 -> 2: nightly).
"""

from __future__ import annotations

import json

import pytest
import torch

from fineflow.errors import FineflowError
from fineflow.train import elastic, resume
from tests.conftest import (
    TRAIN_OVERRIDES,
    finish_train,
    kill_when,
    last_logged_step,
    ranks_overrides,
    run_dirs,
    start_train,
    train_env,
    train_project,
    write_params,
)

STEPS = TRAIN_OVERRIDES["train.steps"]
# Per-step tolerance against the uninterrupted run (relative, as tests/test_ddp.py): another world size sums the
# same gradients in another order (see fineflow.train.elastic). Measured here: the logged loss and gradient norm
# (5 decimals) equal at every step, the adapters 1.5e-8 (2 -> 1) and 1.6e-7 (1 -> 2) apart after 12 steps; 1e-4
# leaves room for longer runs and still fails on a real difference (test_ddp's: a wrong loss scaling moves the loss
# 2x, a schedule at another speed the lr 20-90%). The lr is the schedule's, to 1e-9.
LOSS_REL = 1e-4
PER_STEP = ("loss", "grad_norm", "lr")  # the step log's figures (loss and grad_norm rounded to 5 decimals)


def _params(tiny_params, **train):
    return tiny_params.model_copy(update={"train": tiny_params.train.model_copy(update=train)})


@pytest.fixture
def fingerprint(monkeypatch):
    """run_fingerprint without the base weights' hashing (a constant base) and with a fixed code identity."""
    monkeypatch.setattr(resume, "base_identity", lambda reference, cache_dir=None: {"weights": "base"})

    def make(params, world):
        return resume.run_fingerprint(params, "base", {"content_key": "data"}, world, code={"sha256": "code"})

    return make


def test_elastic_runs_of_one_global_batch_are_one_run_whatever_the_ranks(tiny_params, fingerprint):
    two = fingerprint(_params(tiny_params, elastic=True, num_processes=2, micro_batch_size=2, grad_accum=1), 2)
    one = fingerprint(_params(tiny_params, elastic=True, num_processes=1, micro_batch_size=2, grad_accum=2), 1)
    four = fingerprint(_params(tiny_params, elastic=True, num_processes=4, micro_batch_size=2, grad_accum=1), 4)
    assert two == one and resume.run_id(two) == resume.run_id(one)
    assert two["global_batch"] == 4 and "world_size" not in two
    assert resume.run_id(four) != resume.run_id(two)  # another global batch (8 rows) is another run
    assert resume.changed_keys(two, four) == ["global_batch: 4 -> 8"]


def test_without_elastic_another_world_size_is_another_run_named_world_size(tiny_params, fingerprint):
    two = fingerprint(_params(tiny_params, num_processes=2, micro_batch_size=2, grad_accum=1), 2)
    engine_gave_one = fingerprint(_params(tiny_params, num_processes=2, micro_batch_size=2, grad_accum=1), 1)
    assert resume.run_id(two) != resume.run_id(engine_gave_one)
    assert resume.changed_keys(two, engine_gave_one) == ["world_size: 2 -> 1"]


def test_the_accumulation_keeps_params_global_batch_on_the_ranks_there_are(tiny_params):
    cfg = _params(tiny_params, elastic=True, num_processes=2, micro_batch_size=2, grad_accum=1).train
    one, said = elastic.adapt_to_world(cfg, 1, "ddp")  # an engine gave 1 rank of 2: accumulation doubles
    assert (one.grad_accum, one.num_processes) == (2, 1)
    assert said == "train.elastic: 1 rank(s) where params give 2: grad_accum 1 -> 2, global batch 4"
    assert elastic.adapt_to_world(cfg, 2, "ddp") == (cfg, None)  # the ranks params give: nothing adapts
    off = cfg.model_copy(update={"elastic": False})
    assert elastic.adapt_to_world(off, 1, "ddp") == (off, None)  # elastic off: as before
    back, _ = elastic.adapt_to_world(one.model_copy(update={"num_processes": 1}), 2, "ddp")
    assert (back.grad_accum, back.num_processes) == (1, 2)


def test_a_global_batch_the_ranks_cannot_split_is_refused_naming_the_settings(tiny_params):
    cfg = _params(tiny_params, elastic=True, num_processes=2, micro_batch_size=2, grad_accum=1).train
    with pytest.raises(FineflowError, match=r"3 rank\(s\) cannot train the global batch of 4 rows") as error:
        elastic.adapt_to_world(cfg, 3, "ddp")
    assert "train.micro_batch_size" in str(error.value) and "multiple of micro_batch_size x ranks = 6" in str(
        error.value
    )


@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_sharded_states_do_not_adapt_to_another_world(tiny_params, engine):
    cfg = _params(tiny_params, elastic=True, num_processes=2).train
    with pytest.raises(FineflowError, match=f"the {engine} profile's states are split per rank"):
        elastic.adapt_to_world(cfg, 1, engine)


def test_the_sampler_gives_a_step_the_same_rows_and_state_however_it_is_split():
    """2 ranks x accumulation 1 and 1 rank x accumulation 2 (micro-batch 2) train the same 4 rows per step, across
    an epoch's end, and their states match after every step: a checkpoint of one resumes in the other."""
    from fineflow.tokenize.shards import RowSampler

    tokens = torch.randint(1, 100, (10,)).numpy()
    ranks = [RowSampler(10, seed=3, rank=r, world_size=2, row_tokens=tokens) for r in (0, 1)]
    one = RowSampler(10, seed=3, row_tokens=tokens)
    for _ in range(7):  # 28 rows: two epochs' ends
        split = sorted(ranks[0].next_indices(2) + ranks[1].next_indices(2))
        assert split == sorted(one.next_indices(2) + one.next_indices(2))
        state = one.state_dict()
        assert {k: v for k, v in ranks[0].state_dict().items() if k != "world_size"} == {
            k: v for k, v in state.items() if k != "world_size"
        }
    resumed = RowSampler(10, seed=3, rank=1, world_size=2, row_tokens=tokens)
    resumed.load_state_dict(one.state_dict())  # 1 rank's state on rank 1 of 2
    assert resumed.next_indices(2) == ranks[1].next_indices(2)


def _checkpoint(run_dir, fingerprint, state):
    """A real (small) checkpoint of fingerprint's run, as the train loop's saver writes one."""
    from fineflow.checkpoint import CheckpointManager, capture_rng

    with CheckpointManager(run_dir, mode="sync") as manager:
        full = {"step": 4, "total_steps": STEPS, "fingerprint": fingerprint, **state}
        manager.save(4, {"w": torch.ones(2)}, {"state": {}, "param_groups": []}, {}, full, [capture_rng()] * 2)


def test_a_sharded_checkpoint_is_refused_on_another_world_before_any_rank_loads_it(tiny_params, fingerprint, tmp_path):
    params = _params(tiny_params, elastic=True, num_processes=2, micro_batch_size=2, grad_accum=1)
    fp = fingerprint(params, 2)
    _checkpoint(tmp_path / resume.run_id(fp), fp, {"sharding": "fsdp", "layout": {"world_size": 2, "grad_accum": 1}})
    with pytest.raises(FineflowError, match=r"fsdp states split over 2 rank\(s\); this run has 1"):
        resume.plan_resume(tmp_path, fp, "auto", layout=elastic.Layout(1, 2))
    plan = resume.plan_resume(tmp_path, fp, "auto", layout=elastic.Layout(2, 1))  # its own world: resumed
    assert plan.checkpoint is not None and plan.checkpoint.name == "step-0000004"


def test_without_elastic_a_crash_on_2_ranks_retried_on_1_is_refused_naming_world_size(
    tiny_params, fingerprint, tmp_path
):
    params = _params(tiny_params, num_processes=2, micro_batch_size=2, grad_accum=1)
    two = fingerprint(params, 2)
    _checkpoint(tmp_path / resume.run_id(two), two, {"layout": {"world_size": 2, "grad_accum": 1}})
    with pytest.raises(FineflowError, match=r"Changed: world_size: 2 -> 1\."):
        resume.plan_resume(tmp_path, fingerprint(params, 1), "auto", layout=elastic.Layout(1, 1))


def test_an_elastic_resume_says_what_moved_and_new_ranks_take_rank_0s_rng():
    state = {"step": 40, "layout": {"world_size": 2, "grad_accum": 1}}
    moved = elastic.describe_move(state, elastic.Layout(1, 2), 4)
    assert moved["message"] == "resuming step 40 of 2 rank(s) on 1: grad_accum 1 -> 2, global batch 4"
    assert moved["from"] == {"world_size": 2, "grad_accum": 1} and moved["to"] == {"world_size": 1, "grad_accum": 2}
    assert elastic.describe_move(state, elastic.Layout(2, 1), 4) is None
    # a checkpoint from before layouts were recorded: the sampler's world size
    assert elastic.checkpoint_layout({"sampler": {"world_size": 2}}) == elastic.Layout(2, None)
    assert elastic.rank_rng(["r0", "r1"], 1) == "r1" and elastic.rank_rng(["r0"], 1) == "r0"


# ---- the test: real ranks, killed and resumed on another world size ----


def _steps(project):
    return [json.loads(line) for line in (project / "reports/train_steps.jsonl").read_text().splitlines()]


def _published_and_idle(project) -> bool:
    """Step 5 logged, and nothing being written: the newest checkpoint (step 4) is published."""
    return last_logged_step(project) >= 5 and not any(project.glob("checkpoints/*/.tmp-*"))


def _assert_matches_uninterrupted(resumed, reference, exact_through: int) -> dict:
    """The resumed run's steps against the uninterrupted run's: steps 1..exact_through bit for bit (trained on
    the reference's world size), every step's lr to 1e-9, loss and gradient norm to LOSS_REL, the same real
    tokens per step (the same rows: the sampler's order and position moved with the checkpoint). Returns the
    largest relative difference per figure."""
    steps, ref = _steps(resumed), _steps(reference)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["tokens"] for s in steps] == [s["tokens"] for s in ref]
    assert [s["loss"] for s in steps[:exact_through]] == [s["loss"] for s in ref[:exact_through]]
    assert [s["lr"] for s in steps] == pytest.approx([s["lr"] for s in ref], rel=1e-9)
    for key in ("loss", "grad_norm"):
        assert [s[key] for s in steps] == pytest.approx([s[key] for s in ref], rel=LOSS_REL), key
    return {key: max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(steps, ref)) for key in PER_STEP}


def _adapter_difference(a, b) -> float:
    from safetensors.torch import load_file

    x, y = (load_file(p / "models/candidate/adapter_model.safetensors") for p in (a, b))
    assert x.keys() == y.keys()
    return max(float((x[k] - y[k]).abs().max()) for k in x)


@pytest.mark.slow
@pytest.mark.scenario
def test_two_ranks_killed_then_finished_on_one_rank_match_the_uninterrupted_two_rank_run(
    built, reference_run, tmp_path
):
    """A lost node: 2 ranks (micro-batch 2, accumulation 1) are killed after step 4's checkpoint; the stage's
    rank then runs alone with params unchanged (as an engine that placed 1 of 2 ranks runs it), so it finds the
    accumulation itself (1 -> 2) and resumes step 4."""
    reference = reference_run(2)  # the same params without train.elastic: shared with tests/test_ddp.py
    project = train_project(built, tmp_path, {**ranks_overrides(2), "train.elastic": True})
    assert kill_when(lambda port: start_train(project, 2, train_env(2), port=port), project, _published_and_idle)
    [run_dir] = run_dirs(project / "checkpoints")
    resumed_from = int(sorted(run_dir.glob("step-*"))[-1].name.removeprefix("step-"))
    output = finish_train(project, 1)  # one rank, run directly; params still say num_processes 2
    assert "train.elastic: 1 rank(s) where params give 2: grad_accum 1 -> 2, global batch 4" in output
    assert f"resuming step {resumed_from} of 2 rank(s) on 1: grad_accum 1 -> 2, global batch 4" in output
    measured = _assert_matches_uninterrupted(project, reference, exact_through=resumed_from)
    report = json.loads((project / "reports/train.json").read_text())
    assert (report["world_size"], report["grad_accum"], report["resumed_from_step"]) == (1, 2, resumed_from)
    assert report["elastic"]["resumed"]["from"] == {"world_size": 2, "grad_accum": 1}
    assert report["elastic"]["global_batch"] == 4
    adapter = _adapter_difference(project, reference)
    assert adapter < 1e-4
    print(f"2 -> 1 ranks after step {resumed_from}: max relative difference per step {measured}; adapter {adapter}")


@pytest.mark.slow
@pytest.mark.nightly
def test_one_rank_killed_then_finished_on_two_ranks_match_the_uninterrupted_two_rank_run(
    built, reference_run, tmp_path
):
    """Capacity came back: 1 rank (accumulation 2) killed after step 4's checkpoint, the user's params then give 2
    ranks x accumulation 1 (the same global batch): resumed under accelerate launch, rank 1 takes rank 0's RNG."""
    reference = reference_run(2)
    one = {"train.num_processes": 1, "train.micro_batch_size": 2, "train.grad_accum": 2, "train.elastic": True}
    project = train_project(built, tmp_path, one)
    assert kill_when(lambda port: start_train(project, 1, train_env(1)), project, _published_and_idle)
    [run_dir] = run_dirs(project / "checkpoints")
    resumed_from = int(sorted(run_dir.glob("step-*"))[-1].name.removeprefix("step-"))
    write_params(project / "params.yaml", {**TRAIN_OVERRIDES, **ranks_overrides(2), "train.elastic": True})
    output = finish_train(project, 2)
    assert f"resuming step {resumed_from} of 1 rank(s) on 2: grad_accum 2 -> 1, global batch 4" in output
    measured = _assert_matches_uninterrupted(project, reference, exact_through=0)  # steps 1-4 ran on 1 rank
    adapter = _adapter_difference(project, reference)
    assert adapter < 1e-4
    print(f"1 -> 2 ranks after step {resumed_from}: max relative difference per step {measured}; adapter {adapter}")
