"""The learning-rate schedule (fineflow.train.schedule): linear warmup to the full rate, then cosine or linear
decay to 10% of it after the last step (or constant); the scheduler the train stage builds follows it."""

import math

import pytest

from fineflow.core.train_config import TrainParams
from fineflow.train.schedule import build_scheduler, lr_multiplier

SCHEDULES = ["cosine", "linear", "constant"]
WARMUP, TOTAL = 4, 24


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_warmup_ramps_linearly_to_the_full_rate(schedule):
    ramp = [lr_multiplier(step, WARMUP, TOTAL, schedule) for step in range(WARMUP)]
    assert ramp == pytest.approx([0.25, 0.5, 0.75, 1.0])  # (step + 1) / warmup: step 0 already trains
    assert lr_multiplier(WARMUP, WARMUP, TOTAL, schedule) == 1.0  # decay starts from the full rate


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_no_warmup_starts_at_the_full_rate(schedule):
    assert lr_multiplier(0, 0, TOTAL, schedule) == 1.0


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_reaches_ten_percent_after_the_last_step_and_stays_there(schedule):
    assert lr_multiplier(TOTAL, WARMUP, TOTAL, schedule) == pytest.approx(0.1)
    assert lr_multiplier(TOTAL + 50, WARMUP, TOTAL, schedule) == pytest.approx(0.1)  # a longer run does not go below
    assert lr_multiplier(TOTAL - 1, WARMUP, TOTAL, schedule) > 0.1  # the last step (0-based) still decays


@pytest.mark.parametrize("schedule, expected", [("cosine", 0.55), ("linear", 0.55)])
def test_halfway_through_the_decay_is_halfway_between_full_and_ten_percent(schedule, expected):
    middle = WARMUP + (TOTAL - WARMUP) // 2
    assert lr_multiplier(middle, WARMUP, TOTAL, schedule) == pytest.approx(expected)


def test_cosine_follows_the_cosine_curve_not_a_line():
    quarter = WARMUP + (TOTAL - WARMUP) // 4
    cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))  # 0.868...
    assert lr_multiplier(quarter, WARMUP, TOTAL, "cosine") == pytest.approx(cosine)
    assert lr_multiplier(quarter, WARMUP, TOTAL, "linear") == pytest.approx(0.1 + 0.9 * 0.75)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_never_rises_after_warmup(schedule):
    values = [lr_multiplier(step, WARMUP, TOTAL, schedule) for step in range(WARMUP, TOTAL + 5)]
    assert all(later <= earlier for earlier, later in zip(values, values[1:]))
    assert values[0] > values[TOTAL - WARMUP]  # and it does decay


def test_constant_keeps_the_full_rate_after_warmup():
    assert {lr_multiplier(step, WARMUP, TOTAL, "constant") for step in range(WARMUP, TOTAL + 5)} == {1.0}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("n", [0, 1, WARMUP - 1, WARMUP, 13, TOTAL])
def test_scheduler_stepped_n_times_sets_lr_times_the_multiplier_of_n(schedule, n):
    import torch

    lr = 3e-3
    cfg = TrainParams(steps=TOTAL, warmup_steps=WARMUP, schedule=schedule, lr=lr)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    scheduler = build_scheduler(optimizer, cfg)
    for _ in range(n):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lr * lr_multiplier(n, WARMUP, TOTAL, schedule))
    assert scheduler.get_last_lr() == [optimizer.param_groups[0]["lr"]]  # what the step log records
