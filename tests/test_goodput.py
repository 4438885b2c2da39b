"""The goodput ledger, its cost and MFU, and the bottleneck doctor.

Fast: the ledger's arithmetic on journals written by hand (a clean run, a run after a killed one, a retried
attempt), prices, FLOPs, the doctor's rules and its exit codes. Slow: each bottleneck the doctor knows, induced
on CPU in a real train stage (the launcher, accelerate launch, the ranks) and named first; the tuned defaults,
where it finds nothing severe. The whole pipeline (dvc repro, a SIGKILL, the resumed run) is in the scenario
at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fineflow.core import journal
from fineflow.core.dvc_project import stage_command
from fineflow.errors import APPROVAL_NEEDED_EXIT
from fineflow.goodput import cost, doctor, ledger
from fineflow.train import flops
from tests.conftest import (
    ROOT,
    TRAIN,
    copy_reproduced,
    last_logged_step,
    launch_with_free_port,
    train_project,
    venv_env,
)
from tests.faults import fault_env

GOODPUT = stage_command("goodput", ROOT, python=sys.executable)


def assert_adds_up(result: dict) -> None:
    """The buckets add up to the run's wall time within 1%: what no timer covered is under 1%."""
    total = result["total_s"]
    assert total > 0
    assert abs(sum(result["buckets"].values()) + result["unaccounted_s"] - total) <= 0.001 * total + 0.01, result
    assert abs(result["unaccounted_s"]) <= 0.01 * total, (result["unaccounted_s"], total, result["buckets"])
    assert all(seconds >= -1e-6 for seconds in result["buckets"].values()), result["buckets"]


# --- the ledger's arithmetic -------------------------------------------------------------------------------------


def _attempt(records, stage, run, proc_start, entry, end=None, exit_code=0, spans=None, run_started=None):
    key = f"{stage}-{proc_start}"
    records.append(
        {
            "event": "start",
            "attempt": key,
            "stage": stage,
            "run": run,
            "run_started": run_started if run_started is not None else proc_start,
            "pid": 1,
            "proc_start": proc_start,
            "t": entry,
        }
    )
    if end is not None:
        records.append({"event": "end", "attempt": key, "t": end, "exit": exit_code, "spans": spans or {}})
    return key


def test_a_clean_runs_ledger_puts_gaps_in_orchestration_and_each_stage_body_in_its_bucket(tmp_path):
    records = []
    _attempt(records, "validate", "r", 100.0, 101.0, 110.0, spans={"params": 0.5, "body": 8.0, "report": 0.5})
    train_spans = {"params": 0.2, "launch": 2.0, "rank_startup": 1.0, "model_load": 1.0, "setup": 0.5}
    train_spans |= {"loop_compute": 20.0, "loop_optimizer": 4.0, "loop_data_wait": 1.0, "loop_checkpoint": 2.0}
    train_spans |= {"loop_log": 0.1, "loop_other": 0.1, "save": 0.5, "rank_exit": 0.4}
    _attempt(records, "train", "r", 112.0, 113.0, 146.0, spans=train_spans)  # 33 s body, 32.8 s of spans + 0.2
    result = ledger.build(records, tmp_path, "r", now=150.0)
    assert result["total_s"] == 50.0
    b = result["buckets"]
    assert b["orchestration"] == pytest.approx(2.0 + 4.0)  # 110 -> 112, 146 -> 150
    assert b["startup"] == pytest.approx(1.0 + 1.0 + 0.5 + 0.5 + 0.2 + 2.0 + 1.0 + 0.5 + 0.4)
    assert b["validation"] == 8.0 and b["compute"] == 24.0 and b["data_wait"] == 1.0
    assert b["checkpoint"] == pytest.approx(2.5) and b["logging"] == pytest.approx(0.1)
    assert result["unaccounted_s"] == pytest.approx(0.1 + 0.2)  # loop_other, and what no span covered
    assert result["goodput"] == pytest.approx(24.0 / 50.0, abs=1e-4)
    assert result["train_goodput"] == pytest.approx(24.0 / 34.0, abs=1e-4)
    assert b["restart_loss"] == 0.0 and result["restart"]["failed_attempts"] == []
    assert_adds_up(result)


def test_a_killed_runs_attempt_is_restart_loss_less_the_steps_the_resumed_training_kept(tmp_path):
    """Run 1 was SIGKILLed in train (no end line: its heartbeat's last touch ends it); run 2 resumed from step 2."""
    records = []
    _attempt(records, "tokenize", "run1", 0.0, 1.0, 5.0, spans={"body": 4.0})
    killed = _attempt(records, "train", "run1", 6.0, 7.0)
    beat = journal.heartbeat_path(tmp_path, killed)
    beat.parent.mkdir(parents=True)
    beat.touch()
    os.utime(beat, (26.0, 26.0))
    steps = tmp_path / "steps.jsonl"
    steps.write_text(
        "".join(
            json.dumps({"step": s, "compute_s": 2.0, "data_wait_s": 0.5, "optimizer_s": 0.5}) + "\n" for s in (1, 2)
        )
        + json.dumps({"step": 3, "compute_s": 2.0})
        + "\n"
    )
    spans = {"model_load": 1.0, "resume_load": 0.5, "loop_compute": 5.0, "loop_other": 0.0}
    _attempt(records, "train", "run2", 1000.0, 1001.0, 1008.0, spans=spans | {"setup": 0.5})
    result = ledger.build(records, tmp_path, "run2", now=1010.0, train_report={"resumed_from_step": 2}, steps_log=steps)
    assert result["total_s"] == pytest.approx(26.0 + 10.0)  # run 1 to its last heartbeat, run 2 to now; not between
    b = result["buckets"]
    # killed train: 20 s of wall, 6 s of it (steps 1-2) kept by the resume, plus the resume's checkpoint load;
    # the steps it lost (in its wall) trained again by the resume are useful work there, counted once
    assert b["restart_loss"] == pytest.approx(20.0 - 6.0 + 0.5)
    assert b["compute"] == pytest.approx(5.0 + 5.0) and b["data_wait"] == pytest.approx(1.0)
    assert result["restart"]["kept_steps_credited"] == 2
    assert [a["status"] for a in result["attempts"]] == ["ok", "killed", "ok"]
    assert result["restart"]["failed_attempts"][0]["stage"] == "train"
    assert_adds_up(result)


def test_a_failed_attempt_and_the_wait_before_its_retry_are_restart_loss(tmp_path):
    records = []
    _attempt(records, "train", "r", 10.0, 11.0, 20.0, exit_code=1, spans={"ranks": 9.0})
    _attempt(records, "train", "r", 25.0, 26.0, 40.0, spans={"loop_compute": 14.0})
    result = ledger.build(records, tmp_path, "r", now=41.0)
    assert result["buckets"]["restart_loss"] == pytest.approx(10.0 + 5.0)  # the attempt, then the retry delay
    assert result["buckets"]["orchestration"] == pytest.approx(1.0)  # after the last attempt, to now
    assert_adds_up(result)


def test_ids_of_one_dvc_process_read_a_hair_apart_are_one_run_and_other_runs_stay_apart(tmp_path):
    """Each stage process computes the dvc process's start from the clock: its ids may differ in the last digit."""
    records = []
    _attempt(records, "validate", "dvc-4242-1000.00", 1000.0, 1001.0, 1010.0, spans={"body": 9.0})
    _attempt(records, "train", "dvc-4242-1000.01", 1011.0, 1012.0, 1020.0, spans={"loop_compute": 8.0})
    _attempt(records, "tokenize", "dvc-777-500.00", 500.0, 501.0, 505.0, spans={"body": 4.0})
    result = ledger.build(records, tmp_path, "dvc-4242-999.99", now=1021.0)
    assert result["runs"] == ["dvc-4242-999.99", "dvc-777-500.00"]
    assert result["total_s"] == pytest.approx(21.0 + 5.0)  # each run once, nothing counted twice
    assert result["buckets"]["orchestration"] == pytest.approx(1.0 + 1.0)
    assert_adds_up(result)


def test_a_busy_stages_attempt_is_discarded_and_a_paused_approval_is_left_out(tmp_path):
    records = []
    _attempt(records, "evaluate", "r", 0.0, 1.0, 10.0, spans={"body": 9.0})
    busy = _attempt(records, "train", "other-run", 3.0, 3.5, 4.0, exit_code=2)
    records.append({"event": "discard", "attempt": busy, "t": 4.0})
    # promote asks a person
    _attempt(records, "promote", "r", 11.0, 12.0, 15.0, exit_code=APPROVAL_NEEDED_EXIT, spans={"body": 3.0})
    _attempt(records, "promote", "r", 3615.0, 3616.0, 3620.0, spans={"body": 4.0})  # an hour later: answered
    result = ledger.build(records, tmp_path, "r", now=3621.0)
    assert result["runs"] == ["r"] and len(result["attempts"]) == 3
    assert result["excluded_s"] == pytest.approx(3600.0) and result["total_s"] == pytest.approx(3621.0 - 3600.0)
    assert result["buckets"]["restart_loss"] == 0.0
    assert_adds_up(result)


def test_a_stale_train_report_credits_nothing_without_a_finished_training_in_the_window(tmp_path):
    records = []
    killed = _attempt(records, "train", "r", 0.0, 1.0)
    beat = journal.heartbeat_path(tmp_path, killed)
    beat.parent.mkdir(parents=True)
    beat.touch()
    os.utime(beat, (20.0, 20.0))
    steps = tmp_path / "steps.jsonl"
    steps.write_text(json.dumps({"step": 1, "compute_s": 5.0}) + "\n")
    result = ledger.build(records, tmp_path, "r", now=21.0, train_report={"resumed_from_step": 1}, steps_log=steps)
    assert result["buckets"]["compute"] == 0.0 and result["restart"]["kept_steps_credited"] == 0
    assert result["buckets"]["restart_loss"] == pytest.approx(20.0)


def test_the_journal_writes_a_start_an_end_and_a_heartbeat_and_names_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv(journal.RUN_ID_ENV, "nightly")
    monkeypatch.setenv(journal.RUN_STARTED_ENV, "123.5")
    attempt = journal.Attempt(tmp_path, "validate")
    attempt.start()
    assert journal.heartbeat_path(tmp_path, attempt.attempt).exists()
    attempt.end(0, {"body": 1.23456})
    start, end = journal.read(tmp_path)
    assert (start["run"], start["run_started"], start["stage"]) == ("nightly", 123.5, "validate")
    assert start["proc_start"] <= start["t"] <= end["t"] and end["spans"] == {"body": 1.2346}
    assert not journal.heartbeat_path(tmp_path, attempt.attempt).exists()
    (tmp_path / journal.JOURNAL_FILE).open("a").write('{"event": "start", "torn')  # a kill mid-write
    assert len(journal.read(tmp_path)) == 2


def test_a_stage_under_dvc_repro_belongs_to_that_dvc_process(tmp_path):
    """Outside a flow, a stage's run is the `dvc repro` process above it: every stage of one repro shares it."""
    fake_dvc = tmp_path / "dvc"
    fake_dvc.write_text(
        "import subprocess, sys\n"
        "code = 'from fineflow.core.journal import run_identity; print(run_identity()[0])'\n"
        "print(subprocess.run([sys.executable, '-c', code], capture_output=True, text=True).stdout.strip())\n"
    )
    env = {k: v for k, v in venv_env().items() if k != journal.RUN_ID_ENV}
    out = subprocess.run([sys.executable, str(fake_dvc), "repro"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.stdout.startswith("dvc-"), out.stdout + out.stderr


# --- money and FLOPs ---------------------------------------------------------------------------------------------


def test_prices_come_from_params_then_the_table_by_device_name_then_the_fallbacks(tiny_params):
    table = tiny_params.cost
    assert cost.price_per_device_hour(table, {"type": "cuda", "name": "NVIDIA H100 80GB HBM3"})[0] == 4.0
    assert cost.price_per_device_hour(table, {"type": "cuda", "name": "NVIDIA L40S"})[0] == 1.9  # not L4's
    assert cost.price_per_device_hour(table, {"type": "cuda", "name": "Some New GPU"})[0] == 2.0
    assert cost.price_per_device_hour(table, {"type": "cpu", "name": "x86_64"})[0] == 0.1
    own = table.model_copy(update={"prices": {"H100": 2.25}})
    assert cost.price_per_device_hour(own, {"type": "cuda", "name": "NVIDIA H100"})[0] == 2.25
    assert cost.price_per_device_hour(own, {"type": "cuda", "name": "NVIDIA A100"})[0] == 2.5  # the rest stay
    fixed = table.model_copy(update={"device_hour_usd": 9.0})
    assert cost.price_per_device_hour(fixed, {"type": "cuda", "name": "NVIDIA A100"}) == (9.0, "cost.device_hour_usd")


def test_a_runs_cost_is_per_device_hour_and_splits_by_bucket():
    run = {"total_s": 1800.0, "buckets": {"compute": 900.0, "checkpoint": 600.0, "orchestration": 300.0}}
    money = cost.run_cost(run, 4.0, "test", devices=8, tokens=2_000_000)
    assert money["run_usd"] == pytest.approx(0.5 * 8 * 4.0)
    assert money["usd_per_1m_tokens"] == pytest.approx(16.0 / 2)
    assert money["bucket_usd"]["checkpoint"] == pytest.approx(16.0 / 3)
    assert money["badput_usd"] == pytest.approx(8.0)
    assert sum(money["bucket_usd"].values()) == pytest.approx(money["run_usd"])


def test_flops_per_token_mfu_and_the_peak_table():
    n, adapters = 7_000_000_000, 40_000_000
    full = flops.flops_per_token(n, n, "full", 32, 4096, 1024, recompute=False)
    lora = flops.flops_per_token(n, adapters, "lora", 32, 4096, 1024, recompute=True)
    attention = 2 * 32 * 2 * 4096 * 1024
    assert full["model"] == full["hardware"] == 6 * n + 3 * attention
    assert lora["model"] == 4 * n + 6 * adapters + 3 * attention
    assert lora["hardware"] == lora["model"] + 2 * n + attention  # checkpointing runs the forward again
    assert flops.table_peak("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert flops.table_peak("NVIDIA H100 PCIe", "bf16") == 756e12  # the longer name wins
    assert flops.table_peak("NVIDIA A100-SXM4-80GB", "no") == 19.5e12
    assert flops.table_peak("Tesla T4", "bf16") is None  # no bf16 there
    use = flops.utilization(full, 1000.0, {"flops_per_s": 989e12}, devices=8)
    assert use["mfu"] == pytest.approx(full["model"] * 1000 / (8 * 989e12), rel=1e-3)
    measured = flops.peak_flops("cpu", "cpu", "no")
    assert measured["flops_per_s"] > 1e8 and measured["source"].startswith("measured: fp32")
    # a run in bf16 on a CPU is measured against bf16's matmul rate, not fp32's (its MFU would be off by ~2x)
    assert flops.peak_flops("cpu", "cpu", "bf16")["source"].startswith("measured: bf16")


def test_bf16_speedup_is_measured_on_a_cpu_with_bf16_instructions_and_read_from_the_table_on_a_gpu(monkeypatch):
    monkeypatch.setattr(flops, "bf16_capable", lambda device_type: True)
    assert flops.bf16_speedup("cuda", "NVIDIA H100 80GB HBM3") == pytest.approx(989 / 67, abs=0.1)
    assert flops.bf16_speedup("cuda", "Some New GPU") is None  # unknown: the doctor assumes fast
    assert flops.bf16_speedup("cuda", "Tesla T4") == 1.0  # known, no bf16 units (torch emulates it): no finding
    seconds = {"bfloat16": lambda: 0.01, "float32": lambda: 0.02}
    assert flops.bf16_probe(timers=seconds) == {"speedup": 2.0, "spread": 0.0, "rounds": flops.PROBE_ROUNDS}
    monkeypatch.setattr(flops, "bf16_probe", lambda: {"speedup": 2.0, "spread": 0.0, "rounds": 7})
    assert flops.bf16_speedup("cpu", "cpu") == 2.0
    monkeypatch.setattr(flops, "bf16_capable", lambda device_type: False)
    assert flops.bf16_speedup("cpu", "cpu") is None  # emulated bf16 (slower than fp32): never measured


# --- the doctor's rules ------------------------------------------------------------------------------------------


def _ledger(buckets: dict, train: dict | None = None, settings: dict | None = None, total: float | None = None):
    full = dict.fromkeys(ledger.BUCKETS, 0.0) | buckets
    total = total or sum(full.values())
    return {
        "total_s": total,
        "buckets": full,
        "unaccounted_s": 0.0,
        "unaccounted_share": 0.0,
        "goodput": full["compute"] / total,
        "trained": train is not None,
        "train": train,
        "settings": settings or {"train.prefetch": 2, "checkpoint.mode": "async", "checkpoint.every_steps": 200},
        "cost": {"run_usd": 1.0, "device_hour_usd": 4.0, "devices": 1, "bucket_usd": dict.fromkeys(full, 0.0)},
        "biggest_badput": "orchestration",
    }


def _train(loop_s=100.0, **totals):
    base = {"compute_s": 0.0, "optimizer_s": 0.0, "data_wait_s": 0.0, "checkpoint_s": 0.0, "grad_sync_s": 0.0}
    return {
        "loop_s": loop_s,
        "loop_totals": base | totals,
        "precision": "bf16",
        "device": {"type": "cuda", "name": "NVIDIA H100", "bf16_capable": True},
        "plan": {"total_gib": 40.0, "device_bytes": 80 * 2**30, "changes": []},
        "peak_mem_mb": 40 * 1024,
        "world_size": 1,
        "grad_accum": 1,
    }


@pytest.mark.parametrize(
    ("train", "settings", "cause", "param"),
    [
        (_train(data_wait_s=30.0, compute_s=60.0), {"train.prefetch": 0}, "data_loading", "train.prefetch"),
        (_train(checkpoint_s=25.0, compute_s=70.0), {"checkpoint.mode": "sync"}, "checkpoint", "checkpoint.mode"),
        (_train(grad_sync_s=40.0, compute_s=50.0), {}, "network_sync", "train.grad_accum"),
        (
            _train(data_wait_s=30.0, compute_s=60.0) | {"preprocess_s": 28.0},
            {},
            "cpu_preprocessing",
            "tokenize.workers",
        ),
        (_train(compute_s=90.0) | {"peak_mem_mb": 79 * 1024}, {}, "vram", "train.gradient_checkpointing"),
        (_train(compute_s=90.0) | {"precision": "no"}, {}, "precision", "train.precision"),
    ],
)
def test_the_doctor_names_each_cause_with_its_evidence_share_and_fix(train, settings, cause, param):
    run = _ledger({"compute": 80.0, "data_wait": 10.0, "orchestration": 10.0}, train, settings)
    first = doctor.diagnose(run)[0]
    assert (first["cause"], first["severity"], first["fix"]["param"]) == (cause, "severe", param), first
    assert first["evidence"] and 0 <= first["share_of_run"] <= 1


def test_the_doctor_finds_nothing_in_a_clean_run_and_warns_of_short_runs_overhead_without_failing_them():
    clean = _ledger({"compute": 80.0, "orchestration": 10.0, "startup": 10.0}, _train(compute_s=95.0))
    assert doctor.diagnose(clean) == []
    short = _ledger({"compute": 10.0, "orchestration": 40.0, "startup": 50.0}, _train(loop_s=10.0, compute_s=10.0))
    [finding] = doctor.diagnose(short)
    assert (finding["cause"], finding["severity"]) == ("orchestration", "warn")  # 90 s: not worth a failed job
    long = _ledger({"compute": 100.0, "orchestration": 400.0, "startup": 500.0}, _train(compute_s=95.0))
    assert doctor.diagnose(long)[0]["severity"] == "severe"
    nothing = _ledger({"orchestration": 3.0}, None)
    assert doctor.diagnose(nothing) == []


def test_a_loop_stall_of_a_second_is_a_warning_however_large_its_share_of_a_smoke_runs_loop():
    """A stall is severe only in a loop of at least SEVERE_LOOP_S; below it, it warns whatever its share (a smoke
    run's one 0.2 s final save in a 0.7 s loop), and a real cause such as fp32 on a bf16 device comes first."""
    fp32 = {"precision": "no", "device": {"name": "cpu", "bf16_capable": True}}
    smoke = _ledger({"compute": 0.5, "checkpoint": 0.2}, _train(loop_s=0.7, compute_s=0.5, checkpoint_s=0.2) | fp32)
    findings = doctor.diagnose(smoke)
    assert [(f["cause"], f["severity"]) for f in findings] == [("precision", "severe"), ("checkpoint", "warn")]
    stalled = _ledger({"compute": 5.0, "checkpoint": 1.0}, _train(loop_s=6.0, compute_s=5.0, checkpoint_s=1.0))
    assert [(f["cause"], f["severity"]) for f in doctor.diagnose(stalled)] == [("checkpoint", "severe")]


@pytest.mark.parametrize(
    ("speedup", "expected"),
    [(None, "it computes bf16 fast"), (2.1, "measured at 2.1x fp32's rate"), (1.2, None)],
)
def test_fp32_is_a_finding_only_where_bf16_measures_fast_enough_to_pay(speedup, expected):
    device = {"type": "cpu", "name": "cpu", "bf16_capable": True, "bf16_speedup": speedup}
    run = _ledger(
        {"compute": 90.0, "orchestration": 10.0}, _train(compute_s=90.0) | {"precision": "no", "device": device}
    )
    findings = doctor.diagnose(run)
    if expected is None:  # bf16 instructions that run it at 1.2x: not worth a change
        assert findings == []
        return
    [finding] = findings
    assert (finding["cause"], finding["severity"], finding["fix"]["value"]) == ("precision", "severe", "bf16")
    assert expected in finding["evidence"]
    assert finding["seconds"] == pytest.approx(45.0, abs=1e-3)  # conservatively: at most half of the compute


# --- a busy machine: the bf16 probe and CPU oversubscription -----------------------------------------------------

QUIET_MATMUL_S = {"float32": 0.021, "bfloat16": 0.010}  # bf16 at 2.1x fp32's rate, as measured here when quiet
# each matmul's load factor, in the order the probe runs them: quiet, then the machine turns busy mid-probe (load
# 8-28 on 2 cores, as seen) and stays busy, unevenly
BUSY = [1.0] * 6 + [8, 14, 6.5, 28, 9, 20, 12, 25, 7, 17, 22, 10, 26, 8.5, 15, 19]
# quiet, then evenly busy: the ratio of the rates holds, only the order of the probe's matmuls decides what it sees
QUIET_THEN_BUSY = [1.0] * 6 + [8.0] * 40


def probe_on(monkeypatch, loads: list[float]) -> dict:
    """The device facts the train stage records on a CPU with bf16 instructions whose matmuls take their quiet
    time x the machine's load at their turn (a fake clock and a fake torch.mm: deterministic)."""
    import itertools
    import types

    import torch

    clock, turns = [0.0], itertools.cycle(loads)

    def matmul(a, b):
        clock[0] += QUIET_MATMUL_S[str(a.dtype).removeprefix("torch.")] * next(turns)
        return a

    monkeypatch.setattr(flops, "bf16_capable", lambda device_type: True)
    monkeypatch.setattr(flops, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(torch, "mm", matmul)
    return {"type": "cpu", "name": "cpu", **flops.bf16_facts("cpu", "cpu")}


def _fp32_run_with_a_checkpoint_stall(device: dict) -> dict:
    """An fp32 run whose induced bottleneck is its checkpoint saves (30% of the loop)."""
    train = _train(compute_s=70.0, checkpoint_s=30.0) | {"precision": "no", "device": device}
    return _ledger({"compute": 70.0, "checkpoint": 30.0}, train, {"checkpoint.mode": "sync"})


def test_a_bf16_probe_on_a_busy_machine_is_inconclusive_and_never_ahead_of_the_induced_bottleneck(monkeypatch):
    """On main the probe timed bf16 (quiet) then fp32 (busy), best of 5 each: 13.65x, and fp32 came first as the
    severe cause. Interleaved rounds' ratios spread too widely to conclude anything: an info finding, last."""
    device = probe_on(monkeypatch, BUSY)
    findings = doctor.diagnose(_fp32_run_with_a_checkpoint_stall(device))
    assert [(f["cause"], f["severity"]) for f in findings] == [("checkpoint", "severe"), ("precision", "info")]
    assert "inconclusive: machine busy" in findings[1]["evidence"], findings[1]
    assert device["bf16_spread"] > doctor.MAX_PROBE_SPREAD and device["bf16_rounds"] == flops.PROBE_ROUNDS


def test_a_bf16_probe_that_is_stable_still_finds_fp32_at_the_quiet_ratio(monkeypatch):
    """Quiet, then evenly busy: interleaved rounds see the same load for both dtypes and the median ratio is the
    quiet 2.1x (main's probe said 16.8x: bf16 timed quiet, fp32 busy)."""
    device = probe_on(monkeypatch, QUIET_THEN_BUSY)
    assert device["bf16_speedup"] == 2.1 and device["bf16_spread"] <= doctor.MAX_PROBE_SPREAD
    [precision] = [f for f in doctor.diagnose(_fp32_run_with_a_checkpoint_stall(device)) if f["cause"] == "precision"]
    assert precision["severity"] == "severe" and "measured at 2.1x fp32's rate" in precision["evidence"]


def _timer(seconds: list[float]):
    """A matmul timer that returns the given seconds, one per call (a probe under a load that comes and goes)."""
    left = iter(seconds)
    return lambda: next(left)


def test_the_cpu_peak_is_the_median_of_spaced_rounds_and_a_busy_probe_makes_the_mfu_inconclusive(monkeypatch):
    """On main the CPU peak was the best of 5 back-to-back matmuls: on a busy machine whatever instant happened to
    be quiet, and nothing said so. Now: the median of spaced rounds, their spread, and an MFU line that says
    "inconclusive" when the rounds disagree."""
    monkeypatch.setattr(flops, "PROBE_PAUSE_S", 0.0)
    rate = 2 * 1024**3
    quiet = flops.cpu_peak_probe(timer=_timer([0.01] * 6 + [0.05]), rounds=7)  # one round hit by a burst
    assert quiet == {"flops_per_s": round(rate / 0.01), "spread": 0.0, "rounds": 7}  # the median ignores it
    busy = flops.cpu_peak_probe(timer=_timer([0.01, 0.08, 0.02, 0.05, 0.01, 0.09, 0.03]), rounds=7)
    assert busy["spread"] > doctor.MAX_PROBE_SPREAD and busy["flops_per_s"] == round(rate / 0.03)
    for probe, inconclusive in ((quiet, False), (busy, True)):
        flops_facts = {"peak_source": "measured", "peak_spread": probe["spread"]}
        run = _ledger({"compute": 90.0}, _train(compute_s=90.0) | {"flops": flops_facts}) | {"mfu": 0.1, "hfu": 0.1}
        text = doctor.format_text(run, doctor.diagnose(run))
        assert ("inconclusive: machine busy" in text) is inconclusive, text
    monkeypatch.setattr(flops, "timed_matmul", lambda dtype, size=1024: _timer([0.01] * 7))
    measured = flops.peak_flops("cpu", "cpu", "no")
    assert measured["spread"] == 0.0 and "median of 7 rounds" in measured["source"]


def _cpu_run(cpu: dict) -> dict:
    train = _train(compute_s=90.0) | {"device": {"type": "cpu", "name": "cpu", "bf16_capable": False, "cpu": cpu}}
    return _ledger({"compute": 90.0, "orchestration": 10.0}, train)


@pytest.mark.parametrize(
    ("cpu", "expected"),
    [
        # every rank at torch's default thread count: 4 ranks x 2 threads on 2 cores
        ({"cores": 2, "threads_per_rank": 2, "local_ranks": 4, "load_1m": 3.0, "runnable": 9}, ("severe", 1)),
        ({"cores": 16, "threads_per_rank": 12, "local_ranks": 2, "load_1m": 20.0, "runnable": 25}, ("warn", 8)),
        # one thread per rank, but the machine shared with others: a load of 18 on 2 cores (no samples: the load)
        ({"cores": 2, "threads_per_rank": 1, "local_ranks": 1, "load_1m": 18.0, "runnable": 19}, ("severe", 1)),
        ({"cores": 2, "threads_per_rank": 1, "local_ranks": 2, "load_1m": 2.5, "runnable": 3}, None),  # quiet
        # sampled during the loop: 4.5 runnable threads on 2 CPUs (another job's), whatever the last minute's load
        (
            {"cores": 2, "threads_per_rank": 2, "local_ranks": 1, "load_1m": 0.5, "runnable": 1}
            | {"runnable_during": {"samples": 60, "mean": 4.5, "max": 6, "machine_cpus": 2}},
            ("warn", 2),
        ),
        (
            {"cores": 2, "threads_per_rank": 2, "local_ranks": 1, "load_1m": 9.0, "runnable": 9}
            | {"runnable_during": {"samples": 60, "mean": 2.2, "max": 3, "machine_cpus": 2}},
            None,  # alone during the loop: the load came after it
        ),
    ],
)
def test_the_doctor_notices_cpu_oversubscription_and_says_how_many_threads_per_rank(cpu, expected):
    findings = [f for f in doctor.diagnose(_cpu_run(cpu)) if f["cause"] == "cpu_oversubscription"]
    if expected is None:
        assert findings == []
        return
    [finding] = findings
    assert (finding["severity"], finding["fix"]["param"], finding["fix"]["value"]) == (
        expected[0],
        "train.threads",
        expected[1],
    )
    assert f"{cpu['cores']} usable CPUs" in finding["evidence"] and "train.num_processes" in finding["fix"]["why"]


def test_an_oversubscribed_cpu_run_in_fp32_is_blamed_on_the_contention_not_the_precision():
    """fp32 on a bf16-capable CPU, 6 runnable threads on 2 CPUs during the loop: the doctor names the
    oversubscription and says the precision was not judged (its probe and compute time measured the contention)."""
    cpu = {"cores": 2, "threads_per_rank": 2, "local_ranks": 1, "load_1m": 6.0, "runnable": 6}
    cpu["runnable_during"] = {"samples": 90, "mean": 6.0, "max": 8, "machine_cpus": 2}
    device = {"type": "cpu", "name": "cpu", "bf16_capable": True, "bf16_speedup": 3.0, "bf16_spread": 0.1}
    fp32 = _train(compute_s=90.0) | {"precision": "no"}
    run = _ledger({"compute": 90.0, "orchestration": 10.0}, fp32 | {"device": device | {"cpu": cpu}})
    findings = {f["cause"]: f for f in doctor.diagnose(run)}
    assert findings["cpu_oversubscription"]["severity"] == "severe"
    assert findings["precision"]["severity"] == "info" and "not judged" in findings["precision"]["evidence"]
    assert doctor.diagnose(run)[0]["cause"] == "cpu_oversubscription"
    quiet = cpu | {"runnable_during": {"samples": 90, "mean": 2.1, "max": 3, "machine_cpus": 2}, "load_1m": 1.0}
    alone = _ledger({"compute": 90.0}, fp32 | {"device": device | {"cpu": quiet}})
    assert {f["cause"]: f["severity"] for f in doctor.diagnose(alone)}["precision"] == "severe"  # quiet: judged


def test_the_train_report_records_the_cpus_threads_and_load():
    """What the doctor's oversubscription finding reads: cores, threads per rank x ranks, the load during the run."""
    import types

    import torch

    from fineflow.train.report import device_facts

    accelerator = types.SimpleNamespace(device=torch.device("cpu"), num_processes=2)
    cpu = device_facts(accelerator, types.SimpleNamespace(precision="bf16"))["cpu"]
    assert cpu["cores"] >= 1 and cpu["threads_per_rank"] == torch.get_num_threads() and cpu["local_ranks"] == 2
    assert cpu["load_1m"] >= 0 and cpu["runnable"] >= 0


def test_fineflow_doctor_prints_text_or_json_and_its_exit_code_follows_fail_on(tmp_path):
    severe = _ledger({"compute": 60.0, "data_wait": 30.0}, _train(data_wait_s=30.0, compute_s=60.0))
    path = tmp_path / "goodput.json"
    path.write_text(json.dumps(severe))

    def doctor_cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "fineflow.cli", "doctor", str(path), *args], capture_output=True, text=True
        )

    text = doctor_cli()
    assert text.returncode == 1 and "[severe] data_loading" in text.stdout and "train.prefetch" in text.stdout
    assert doctor_cli("--fail-on", "never").returncode == 0
    as_json = json.loads(doctor_cli("--json", "--fail-on", "never").stdout)
    assert as_json["findings"][0]["cause"] == "data_loading" and as_json["total_s"] == 90.0
    path.write_text("{not json")
    bad = doctor_cli()
    assert bad.returncode == 2 and "goodput stage" in bad.stderr and "Traceback" not in bad.stderr


# --- induced bottlenecks in real training runs -------------------------------------------------------------------

# An induced delay must dominate its share of the loop on a loaded 2-core CI runner too, where evaluation and
# saves run slower than on an idle machine and a prefetching loader hides its delay behind them (a 1 s loader
# delay with prefetch 2 can be 10% of such a loop, a mere warning). The loader and all-reduce cases therefore
# evaluate and save at the end only.
QUIET = {"train.eval_every": 1000, "checkpoint.every_steps": 1000}
INDUCED = {
    # name: (params overrides, fault variables, ranks, the cause the doctor must name first)
    # no prefetch: every step waits the loader's whole delay (a loaded runner's slower compute cannot hide it)
    "slow loader": (
        {**QUIET, "train.steps": 8, "train.prefetch": 0},
        {"FINEFLOW_TEST_LOADER_DELAY_S": "1.0"},
        1,
        "data_loading",
    ),
    "sync checkpoints of a slow disk": (
        {"train.steps": 8, "checkpoint.mode": "sync", "checkpoint.every_steps": 2},
        {"FINEFLOW_TEST_WRITE_DELAY_S": "0.4"},
        1,
        "checkpoint",
    ),
    "slow all-reduce in 2-process DDP": (
        {**QUIET, "train.steps": 8, "train.num_processes": 2, "train.micro_batch_size": 1},
        {"FINEFLOW_TEST_ALLREDUCE_DELAY_S": "0.6"},
        2,
        "network_sync",
    ),
    # the tiny config saves every 2 steps (a checkpoint stall of its own): these two save at the end only, and
    # evaluate every 4 steps, so that the one final save is not most of a loop of a second
    "a plan at the edge of the device": (
        {"train.device_memory_gib": 0.52, "checkpoint.every_steps": 100},
        {},
        1,
        "vram",
    ),
    "fp32 on a bf16 device": ({"checkpoint.every_steps": 100}, {"FINEFLOW_TEST_BF16_CAPABLE": "1"}, 1, "precision"),
}


def train_then_ledger(project: Path, env: dict, ranks: int) -> dict:
    """The train stage as dvc.yaml runs it, then the goodput stage, as one run; the ledger."""
    env = {**env, journal.RUN_ID_ENV: f"test-{project.name}", journal.RUN_STARTED_ENV: repr(time.time())}

    def launch(port):
        extra = ["--main-process-port", str(port)] if ranks > 1 else []
        done = subprocess.run(TRAIN + extra, cwd=project, env=env, capture_output=True, text=True, timeout=600)
        return done.returncode == 0, done.stdout + done.stderr

    ok, output = launch_with_free_port(launch)
    assert ok, output[-4000:]
    done = subprocess.run(GOODPUT, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((project / "reports/goodput.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(INDUCED))
def test_the_doctor_names_an_induced_bottleneck_first(built, tmp_path, name):
    overrides, faults, ranks, cause = INDUCED[name]
    project = train_project(built, tmp_path / "p", {"train.tracker": "none", **overrides})
    env = fault_env(venv_env())
    env.update(faults)
    result = train_then_ledger(project, env, ranks)
    assert_adds_up(result)
    first = result["findings"][0]
    assert (first["cause"], first["severity"]) == (cause, "severe"), json.dumps(result["findings"], indent=1)
    assert result["buckets"]["restart_loss"] == 0.0
    if name == next(iter(INDUCED)):  # the command a user runs reads the same ledger (once: a process each)
        out = subprocess.run(
            [sys.executable, "-m", "fineflow.cli", "doctor", "--json"], cwd=project, capture_output=True, text=True
        )
        assert out.returncode == 1 and json.loads(out.stdout)["findings"][0]["cause"] == cause


@pytest.mark.slow
def test_the_doctor_names_on_the_fly_tokenization_in_the_naive_loop_of_the_benchmark(built, tmp_path, monkeypatch):
    """bench/goodput.py's naive job tokenizes each step's rows inside the loop; with long documents (every row's
    input is thousands of words, truncated to tokenize.seq_len after tokenizing) that is where the loop's time
    goes. One torch thread: the loop's many small ops share the cores with the other test worker's training."""
    import importlib.util

    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    spec = importlib.util.spec_from_file_location("bench_goodput", ROOT / "bench/goodput.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    source = tmp_path / "source"
    train_project(built, source)
    rows = [json.loads(line) for line in (built / "data/validated/train.jsonl").read_text().splitlines()]
    long_rows = [row | {"input": " ".join([row["instruction"]] * 8000)} for row in rows]
    (source / "data/validated").mkdir(parents=True)
    (source / "data/validated/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in long_rows))
    result = bench.job("naive", source, source / "params.yaml", tmp_path / "naive", steps=16, every=100, price=4.0)
    assert_adds_up(result)
    first = result["findings"][0]
    assert (first["cause"], first["severity"]) == ("cpu_preprocessing", "severe"), json.dumps(result["findings"])
    assert "on the fly" in first["evidence"] and first["fix"]["param"] == "tokenize.workers"


def _train_attempt(project: Path) -> tuple[dict, dict]:
    """The consumed journal's train attempt (its start and end lines), as the ledger read it."""
    [run_file] = (project / "reports/ledger/runs").glob("*.jsonl")
    records = [json.loads(line) for line in run_file.read_text().splitlines()]
    [start] = [r for r in records if r["event"] == "start" and r["stage"] == "train"]
    [end] = [r for r in records if r["event"] == "end" and r["attempt"] == start["attempt"]]
    return start, end


# every objective nightly (dpo moved there on 2026-12-07, CI near its 20 minutes): per PR, sft's ledger adds up
# through the induced bottlenecks above
OBJECTIVES_PER_PR: tuple[str, ...] = ()


@pytest.mark.slow
@pytest.mark.parametrize(
    "objective",
    [
        name if name in OBJECTIVES_PER_PR else pytest.param(name, marks=pytest.mark.nightly)
        for name in ("sft", "dpo", "simpo", "orpo", "kto", "reward_model", "grpo")
    ],
)
def test_each_objectives_train_stage_writes_a_ledger_that_adds_up(built, tmp_path, objective):
    """The train stage with train.objective <objective> (after the fingerprint and reference_logps stages, as dvc.yaml
    orders them, for an objective trained on pairs or feedback), then the goodput stage: the ledger's buckets add up
    to the wall time (assert_adds_up); the train attempt's spans cover its wall within 1%, its loop's timers
    (compute, optimizer, data wait, checkpoint, eval, logging, syncs) never overlap (their sum is at most the
    loop's time) and they are the ledger's train buckets; compute and checkpoint saves were measured, and the
    reference_logps stage's time is in its own bucket."""
    from tests.test_preference_train import preference_project

    if objective == "sft":
        project = train_project(built, tmp_path / "p")
    elif objective == "grpo":  # SFT shards: its prompts, and the reference stage for its start
        from tests.test_grpo import grpo_project

        project = grpo_project(built, tmp_path / "p", {"train.steps": 12})
    else:
        project = preference_project(built, tmp_path / "p", objective)
    result = train_then_ledger(project, venv_env(), 1)
    assert_adds_up(result)
    assert [a["stage"] for a in result["attempts"]] == (
        ["train"] if objective == "sft" else ["fingerprint", "reference_logps", "train"]
    ), result["attempts"]
    assert result["buckets"]["restart_loss"] == 0.0 and result["trained"]
    start, end = _train_attempt(project)
    spans, body = end["spans"], end["t"] - start["t"]
    untimed = body - sum(spans.values()) + spans["loop_other"]
    assert abs(untimed) <= 0.01 * body, (untimed, body, spans)
    report = json.loads((project / "reports/train.json").read_text())
    assert report.get("objective", "sft") == objective  # an SFT report names none
    totals, loop_s = report["loop_totals"], report["loop_s"]
    assert all(seconds >= 0 for seconds in totals.values()) and sum(totals.values()) <= loop_s + 1e-3, (totals, loop_s)
    b = result["buckets"]
    assert b["compute"] == pytest.approx(totals["compute_s"] + totals["optimizer_s"], abs=2e-3), (b, totals)
    assert b["data_wait"] == pytest.approx(totals["data_wait_s"], abs=1e-3)
    assert b["train_eval"] == pytest.approx(totals["train_eval_s"], abs=1e-3)
    assert b["checkpoint"] == pytest.approx(totals["checkpoint_s"] + spans["save"], abs=2e-3)
    assert b["compute"] > 0 and totals["checkpoint_s"] > 0  # TRAIN_OVERRIDES: a checkpoint every 2 of 12 steps
    assert (b["reference_logps"] > 0) == (objective != "sft"), b
    if objective == "grpo":  # its rollouts: generation and the rewards, each in its own bucket
        assert b["rollout"] == pytest.approx(totals["rollout_s"], abs=1e-3) and b["rollout"] > 0, (b, totals)
        assert b["reward"] == pytest.approx(totals["reward_s"], abs=1e-3) and b["reward"] > 0, (b, totals)


@pytest.mark.slow
@pytest.mark.nightly  # 800 steps as shipped: the longest test of all (10 min on a busy 2-core machine)
def test_the_tuned_defaults_train_with_nothing_severe_and_the_ledger_adds_up(built, tmp_path):
    """params.yaml's train and checkpoint sections as shipped (800 steps, prefetch, async checkpoints every 200),
    on the tiny model."""
    import yaml

    defaults = yaml.safe_load((ROOT / "params.yaml").read_text())
    overrides = {f"train.{k}": v for k, v in defaults["train"].items() if k not in ("lora", "tracker")}
    overrides |= {f"checkpoint.{k}": v for k, v in defaults["checkpoint"].items()}
    project = train_project(built, tmp_path / "p", overrides | {"train.tracker": "none"})
    result = train_then_ledger(project, venv_env(), 1)
    assert_adds_up(result)
    severe = [f for f in result["findings"] if f["severity"] == "severe"]
    # auto trains fp32 on any CPU; on one whose bf16 instructions measure >= 1.5x fp32 (AMX, AVX-512 BF16) the
    # doctor says to set bf16, with the measured ratio as its evidence (a probe whose rounds disagree, on a busy
    # machine, is only an info finding)
    device = result["train"]["device"]
    stable = (device.get("bf16_spread") or 0.0) <= doctor.MAX_PROBE_SPREAD
    fast_bf16 = device["bf16_capable"] and (device["bf16_speedup"] or 0) >= doctor.MIN_BF16_SPEEDUP and stable
    if fast_bf16:
        [precision] = [f for f in severe if f["cause"] == "precision"]
        assert f"measured at {device['bf16_speedup']:g}x" in precision["evidence"], precision
        severe.remove(precision)
    assert severe == [], result["findings"]
    assert result["buckets"]["restart_loss"] == 0.0 and result["restart"]["failed_attempts"] == []
    assert result["mfu"] and 0 < result["mfu"] < 1 and "measured" in result["train"]["flops"]["peak_source"]
    assert result["cost"]["usd_per_1m_tokens"] > 0 and result["cost"]["price_source"] == "cost.prices['cpu']"
    assert (project / "reports/plots/goodput.png").stat().st_size > 1000
    # consumed: the next run's ledger starts after this one (only the goodput stage's own end line is left)
    left = journal.read(project / "reports/ledger")
    assert [(r["event"], r["stage"]) for r in left] == [("end", "goodput")], left
    assert len(list((project / "reports/ledger/runs").glob("*.jsonl"))) == 1
    doctor_cli = [sys.executable, "-m", "fineflow.cli", "doctor"]
    if fast_bf16:
        doctor_cli += ["--fail-on", "never"]  # its one severe finding there is fp32 (above)
    out = subprocess.run(doctor_cli, cwd=project, capture_output=True, text=True)
    assert out.returncode == 0 and "goodput" in out.stdout.splitlines()[0], out.stdout + out.stderr


# --- the whole pipeline: dvc repro, a SIGKILL, the run after it ----------------------------------------------------


def group_gone(pgid: int, timeout: float) -> bool:
    """Whether every process of the process group has exited (and been reaped) within timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def dvc(project: Path, *args: str, env: dict | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=project, env=env or venv_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.scenario
@pytest.mark.slow
def test_dvc_repro_writes_the_ledger_and_after_a_sigkill_the_next_run_counts_the_lost_attempt(reproduced, tmp_path):
    """A whole `dvc repro` (the session's shared one) writes a ledger of every stage's attempt; after a param edit,
    a `dvc repro` SIGKILLed mid-train, then the next one: its ledger counts the killed attempt's lost time and
    credits the checkpointed steps it resumed from, and DVC's metrics and plots show the history over runs."""
    project = copy_reproduced(reproduced, tmp_path / "p")
    first = json.loads((project / "reports/goodput.json").read_text())
    assert_adds_up(first)
    assert first["buckets"]["restart_loss"] == 0.0 and first["trained"]
    stages = [a["stage"] for a in first["attempts"]]
    assert stages == [
        "base",
        "fingerprint",
        "data",
        "validate",
        "tokenize",
        "reference_logps",
        "train",
        "evaluate",
        "promote",
        "export",  # the tiny project's is off (export.enabled false): its report alone, in its own bucket
    ], stages
    for bucket in ("base_pretrain", "validation", "tokenization", "compute", "evaluation", "promotion", "startup"):
        assert first["buckets"][bucket] > 0, bucket
    assert len(first["runs"]) == 1 and first["runs"][0].startswith("dvc-")

    # a param edit, then `dvc repro` SIGKILLed (the whole process group: dvc, the launcher, the rank) mid-train
    import yaml

    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(lr=0.002, steps=40, tracker="none")  # 40 steps: long enough to be killed in
    params["checkpoint"]["every_steps"] = 10
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (project / "reports/train_steps.jsonl").unlink()  # the kill waits for this run's own steps
    proc = subprocess.Popen(
        [sys.executable, "-m", "dvc", "repro"],
        cwd=project,
        env=venv_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while last_logged_step(project) < 25 and time.monotonic() < deadline:
        assert proc.poll() is None
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert group_gone(proc.pid, timeout=30)  # the launcher and the rank too, not only dvc
    output = dvc(project, "repro")
    assert "resuming from" in output, output[-3000:]  # the re-run resumed from the killed run's checkpoint
    second = json.loads((project / "reports/goodput.json").read_text())
    assert_adds_up(second)
    train = json.loads((project / "reports/train.json").read_text())
    assert train["resumed_from_step"] in (10, 20), train["resumed_from_step"]
    assert second["buckets"]["restart_loss"] > 1.0, second["buckets"]
    [killed] = second["restart"]["failed_attempts"]
    assert killed["stage"] == "train" and killed["exit"] is None
    assert second["restart"]["kept_steps_credited"] == train["resumed_from_step"]
    assert len(second["runs"]) == 2  # the killed run's time is in this ledger; the time between runs is not
    # the history over runs: DVC metrics and plots
    shown = json.loads(dvc(project, "plots", "show", "--json"))
    assert not shown.get("errors"), shown.get("errors")
    for plot in ("goodput_over_runs", "cost_over_runs"):
        [entry] = shown["data"][plot]
        assert len(entry["content"]["data"]["values"]) >= 2, entry  # this run and the one before (and the lock's)
    metrics = json.loads(dvc(project, "metrics", "show", "--json"))
    assert "goodput" in json.dumps(metrics)
