"""Checkpoint library (fineflow/checkpoint/): exact round trips, corruption, disk full, torn writes
(SIGKILL at random moments), retention and fingerprints. Fast: small tensors, real files, real kills.

Faults are injected by replacing ``fineflow.checkpoint.write.write_all`` (every checkpoint byte goes through
it): with pytest's monkeypatch in this process, with tests/faults/sitecustomize.py in a spawned writer.

    .venv/bin/python -m pytest tests/test_checkpoint.py -q -s     # -s shows the torn-write counts
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import fineflow.checkpoint.write as write_module  # faults replace write_module.write_all, where it is looked up
from fineflow import checkpoint
from fineflow.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointWarning,
    capture_rng,
    from_tree,
    latest_valid,
    load_checkpoint,
    restore_rng,
    to_tree,
    verify_checkpoint,
)
from fineflow.errors import FineflowError
from tests.faults import FAULTS_DIR, INJECTED, fault_env

ROOT = Path(__file__).resolve().parent.parent
REAL_WRITE_ALL = write_module.write_all  # taken before any test replaces it: a fault wraps the real write


def small_state(step: int, fingerprint=None) -> dict:
    """A tiny, step-dependent state for tests that are about files, not about optimizers."""
    return {
        "model_tensors": {"lora_A": torch.full((4, 8), float(step)), "lora_B": torch.arange(8.0) + step},
        "optimizer_state_dict": {
            "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.ones(3)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}],
        },
        "scheduler_state_dict": {"last_epoch": step, "lr_lambdas": [None]},
        "state_json": {"step": step, "fingerprint": fingerprint or {"model": "m", "method": "lora", "data": "d"}},
        "rng_snapshots": [capture_rng()],
    }


def save_small(manager: CheckpointManager, step: int, metric=None, fingerprint=None) -> None:
    manager.save(step, **small_state(step, fingerprint), metric=metric)


def step_names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# ---------------------------------------------------------------------------------------------------------
# format
# ---------------------------------------------------------------------------------------------------------


def test_tree_keeps_types_json_would_lose():
    value = {
        "state": {0: {"step": torch.tensor(3.0)}, 7: {}},
        "betas": (0.9, 0.999),
        "nan": float("nan"),
        "inf": float("-inf"),
        "np": np.arange(5, dtype=np.uint32),
        "none": None,
        "flag": True,
        "nested": [{"__dunder": 1}, (1, (2, 3))],
        "npfloat": np.float64(0.5),
    }
    tensors: dict = {}
    tree = json.loads(json.dumps(to_tree(value, tensors)))  # through real JSON text
    back = from_tree(tree, tensors)
    assert back["state"][0]["step"] is value["state"][0]["step"] and list(back["state"]) == [0, 7]
    assert back["betas"] == (0.9, 0.999) and isinstance(back["betas"], tuple)
    assert np.isnan(back["nan"]) and back["inf"] == float("-inf")
    assert back["np"].dtype == np.uint32 and back["np"].tolist() == [0, 1, 2, 3, 4]
    assert back["nested"] == [{"__dunder": 1}, (1, (2, 3))] and back["flag"] is True and back["none"] is None
    assert back["npfloat"] == 0.5
    with pytest.raises(CheckpointError, match=r"cannot checkpoint set at 'a\.b'.*no pickle"):
        to_tree({"a": {"b": {1, 2}}}, {})


def test_files_are_safetensors_and_json_only(tmp_path):
    from safetensors.torch import load_file

    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "i64": torch.arange(7),
        "flag": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "f16": torch.randn(9).half(),
        "strided": torch.randn(6, 4).t(),
    }
    with CheckpointManager(tmp_path, mode="sync") as manager:
        manager.save(1, tensors, {"state": {}, "param_groups": []}, {}, {"step": 1}, [capture_rng()])
    path = tmp_path / "step-0000001"
    assert step_names(path) == sorted(
        [
            "COMPLETE",
            "manifest.json",
            "model.safetensors",
            "optimizer.json",
            "rng.json",
            "rng.safetensors",
            "scheduler.json",
            "state.json",
        ]
    )
    loaded = load_file(str(path / "model.safetensors"))  # the reference reader accepts our writer's files
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    for name in ("optimizer.json", "rng.json", "scheduler.json", "state.json", "manifest.json"):
        json.loads((path / name).read_text())
    manifest = verify_checkpoint(path, deep=True)
    assert set(manifest["files"]) == set(step_names(path)) - {"COMPLETE", "manifest.json"}
    sources = sorted((ROOT / "fineflow/checkpoint").glob("*.py"))
    assert len(sources) > 1  # the whole package, not just its __init__
    source = "".join(path.read_text() for path in sources)
    assert "import pickle" not in source and "torch.load(" not in source


# ---------------------------------------------------------------------------------------------------------
# exact resume
# ---------------------------------------------------------------------------------------------------------


def build(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3) * 0.9**s)
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler) -> None:
    """Draws from every global RNG (data, dropout, noise), so a resume must restore all of them."""
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    scale = 1 + 0.01 * float(np.random.rand()) + 0.01 * random.random()
    loss = ((model(x) - y) ** 2).mean() * scale
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_is_bit_exact(tmp_path, mode):
    seed_all(0)
    model, optimizer, scheduler = build(0)
    for _ in range(3):
        train_step(model, optimizer, scheduler)
    manager = CheckpointManager(tmp_path, mode=mode)
    manager.save(
        3,
        model.state_dict(),
        optimizer.state_dict(),
        scheduler.state_dict(),
        {"step": 3, "sampler": {"epoch": 0, "position": 12}},
        [capture_rng()],
    )
    for _ in range(3):  # the uninterrupted run goes on while the async save is still being written
        train_step(model, optimizer, scheduler)
    manager.close()

    seed_all(123)  # a different process state: everything must come from the checkpoint
    resumed, optimizer2, scheduler2 = build(1)
    ckpt = manager.load(manager.latest_valid())
    resumed.load_state_dict(ckpt.model_tensors)
    optimizer2.load_state_dict(ckpt.optimizer_state_dict)
    scheduler2.load_state_dict(ckpt.scheduler_state_dict)
    restore_rng(ckpt.rng_snapshots[0])
    assert all(isinstance(s["step"], torch.Tensor) for s in ckpt.optimizer_state_dict["state"].values())
    assert ckpt.state == {"step": 3, "sampler": {"epoch": 0, "position": 12}} and ckpt.step == 3
    for _ in range(3):
        train_step(resumed, optimizer2, scheduler2)

    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert scheduler.get_last_lr() == scheduler2.get_last_lr() and scheduler.last_epoch == scheduler2.last_epoch == 6
    state, resumed_state = optimizer.state_dict()["state"], optimizer2.state_dict()["state"]
    assert sorted(state) == sorted(resumed_state) == list(range(len(list(model.parameters()))))  # every parameter
    for index, tensors in state.items():
        assert sorted(tensors) == sorted(resumed_state[index]) == ["exp_avg", "exp_avg_sq", "step"], index
        for key, tensor in tensors.items():
            assert torch.equal(tensor, resumed_state[index][key]), (index, key)


def test_rng_restore_gives_the_same_draws(tmp_path):
    seed_all(5)
    torch.rand(3), np.random.rand(), random.random(), np.random.randn()  # leaves a cached gaussian
    with CheckpointManager(tmp_path, mode="sync") as manager:
        manager.save(1, {"w": torch.ones(1)}, {"state": {}, "param_groups": []}, {}, {}, [capture_rng(), capture_rng()])
    expected = (torch.rand(5), np.random.rand(3), [random.random() for _ in range(3)], np.random.randn(2))
    seed_all(99)
    snapshots = load_checkpoint(tmp_path / "step-0000001").rng_snapshots
    assert len(snapshots) == 2  # one per rank
    restore_rng(snapshots[1])
    got = (torch.rand(5), np.random.rand(3), [random.random() for _ in range(3)], np.random.randn(2))
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2] and np.array_equal(got[3], expected[3])


@pytest.mark.slow
def test_process_backend_round_trip_and_error(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=5, mode="async", async_backend="process")
    try:
        save_small(manager, 1)
        save_small(manager, 2)
        assert manager.wait() == tmp_path / "step-0000002"
        ckpt = manager.load(manager.latest_valid())
        assert ckpt.step == 2 and torch.equal(ckpt.model_tensors["lora_B"], torch.arange(8.0) + 2)
        bad = small_state(3)
        bad["model_tensors"]["lora_A"][0, 0] = float("nan")
        manager.save(3, **bad)
        bad["model_tensors"]["lora_A"][0, 0] = 0.0  # changing it after save() returned changes nothing
        with pytest.raises(CheckpointError, match=r"step-0000003/model\.safetensors: tensor 'lora_A' has NaN"):
            manager.wait()
        save_small(manager, 4)  # the writer goes on after an error
    finally:
        manager.close()
    assert step_names(tmp_path) == ["step-0000001", "step-0000002", "step-0000004"]


# ---------------------------------------------------------------------------------------------------------
# corruption and verification
# ---------------------------------------------------------------------------------------------------------


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: _flip(p / "model.safetensors"), r"step-0000002/model\.safetensors: sha256 mismatch"),
        (
            lambda p: (p / "optimizer.safetensors").write_bytes((p / "optimizer.safetensors").read_bytes()[:40]),
            r"step-0000002/optimizer\.safetensors: truncated or resized: 40 bytes",
        ),
        (lambda p: (p / "COMPLETE").unlink(), r"step-0000002/COMPLETE: missing \(the save did not finish\)"),
        (lambda p: (p / "manifest.json").write_text("{}"), r"step-0000002/manifest\.json: sha256 does not match"),
        (lambda p: (p / "state.json").unlink(), r"step-0000002/state\.json: missing"),
    ],
    ids=["flipped-byte", "truncated", "no-marker", "manifest", "missing-file"],
)
def test_corrupt_newest_falls_back_with_a_warning_naming_the_file(tmp_path, damage, message):
    with CheckpointManager(tmp_path, keep_last=5, mode="sync") as manager:
        save_small(manager, 1)
        save_small(manager, 2)
    damage(tmp_path / "step-0000002")
    with pytest.warns(CheckpointWarning, match=message + r".*; using step-0000001"):
        path = latest_valid(tmp_path)
    assert path == tmp_path / "step-0000001"
    assert load_checkpoint(path).step == 1
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / "step-0000002")


def test_nothing_valid_left_says_so(tmp_path):
    with CheckpointManager(tmp_path, mode="sync") as manager:
        save_small(manager, 1)
    _flip(tmp_path / "step-0000001" / "model.safetensors")
    with pytest.warns(CheckpointWarning, match="sha256 mismatch; no valid checkpoint left"):
        assert latest_valid(tmp_path) is None


def test_all_finite_for_every_float_format():
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert checkpoint.all_finite(torch.tensor([0.0, -1.5, 3e4], dtype=dtype)), dtype
        for bad in (float("nan"), float("inf"), float("-inf")):
            assert not checkpoint.all_finite(torch.tensor([1.0, bad], dtype=dtype)), (dtype, bad)
    assert checkpoint.all_finite(torch.arange(5)) and checkpoint.all_finite(torch.zeros(0))


def test_a_failed_verification_is_loud_and_publishes_nothing(tmp_path):
    manager = CheckpointManager(tmp_path, mode="sync")
    bad = small_state(1)
    bad["optimizer_state_dict"]["state"][0]["exp_avg"][1] = float("inf")
    with pytest.raises(
        CheckpointError,
        match=r"\.tmp-step-0000001/optimizer\.safetensors: tensor "
        r"'state\.0\.exp_avg' has NaN or inf",
    ):
        manager.save(1, **bad)
    with pytest.raises(CheckpointError, match="model_tensors is empty"):
        manager.save(2, **{**small_state(2), "model_tensors": {}})
    assert step_names(tmp_path) == []
    assert isinstance(CheckpointError("x"), FineflowError)


# ---------------------------------------------------------------------------------------------------------
# disk full
# ---------------------------------------------------------------------------------------------------------


def enospc(monkeypatch, when: str, times: int = 10**9) -> dict:
    """Make every checkpoint write to a file whose path contains `when` fail with ENOSPC, `times` times
    (then write normally); returns the failure count. The writer thread sees it too: it looks write_all up
    in the write module at each call."""
    calls = {"n": 0}

    def write_all(fd: int, data: memoryview, path: str) -> None:
        if when in path and calls["n"] < times:
            calls["n"] += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        REAL_WRITE_ALL(fd, data, path)

    monkeypatch.setattr(write_module, "write_all", write_all)
    return calls


def test_disk_full_stops_with_a_clear_error_and_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    enospc(monkeypatch, "step-0000002/optimizer.safetensors")
    manager = CheckpointManager(tmp_path, mode="async")
    save_small(manager, 1)
    save_small(manager, 2)  # returns: the failure happens in the background ...
    with pytest.raises(
        CheckpointError,
        match=r"disk full while writing \S+/\.tmp-step-0000002/optimizer\.safetensors "
        r"\(checkpoint step 2\); the previous checkpoint \S+step-0000001 is intact",
    ):
        manager.wait()  # ... and surfaces here (or from the next save())
    assert step_names(tmp_path) == ["step-0000001"]  # no temp dir left behind
    assert load_checkpoint(latest_valid(tmp_path)).step == 1
    save_small(manager, 2)  # the fault keeps failing step 2: the next save() raises too
    with pytest.raises(CheckpointError, match="disk full"):
        save_small(manager, 3)
    manager.close()
    assert step_names(tmp_path) == ["step-0000001"]


def blocked_then_full(monkeypatch, when: str) -> tuple[threading.Event, threading.Event]:
    """Writes to files whose path contains `when` wait for the returned `release`, then fail with ENOSPC;
    `entered` is set once the writer is inside such a write (a save still in flight, deterministically)."""
    entered, release = threading.Event(), threading.Event()

    def write_all(fd: int, data: memoryview, path: str) -> None:
        if when in path:
            entered.set()
            release.wait(timeout=120)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        REAL_WRITE_ALL(fd, data, path)

    monkeypatch.setattr(write_module, "write_all", write_all)
    return entered, release


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_a_failed_background_save_is_seen_by_the_per_step_check_not_at_the_next_save(tmp_path, monkeypatch, backend):
    """A failed save (ENOSPC at step 150) stops training then, not at the next save (step 200): the loop calls
    check() at every step; it does not wait for a save still writing, and raises a failed one's error at once."""
    if backend == "process":  # the spawned writer does not see this process's monkeypatch: the env fault
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAULTS_DIR), os.environ.get("PYTHONPATH", "")]))
        monkeypatch.setenv("FINEFLOW_TEST_DISK_FULL_AT_STEP", "2")
        entered = release = None
    else:
        entered, release = blocked_then_full(monkeypatch, "step-0000002")
    with CheckpointManager(tmp_path, mode="async", async_backend=backend) as manager:
        save_small(manager, 1)
        manager.wait()
        save_small(manager, 2)
        if entered is not None:
            assert entered.wait(timeout=120)
            assert manager.check() is None  # still writing: the step goes on, nothing waits for the disk
            release.set()
        with pytest.raises(CheckpointError, match=r"disk full .*\(checkpoint step 2\).*step-0000001 is intact"):
            for _ in range(1200):  # the writer fails in the background; a later step boundary sees it
                manager.check()
                threading.Event().wait(0.1)
        assert manager.check() is None  # raised once; the manager holds no save in flight any more
    assert step_names(tmp_path) == ["step-0000001"] and load_checkpoint(latest_valid(tmp_path)).step == 1


def test_disk_full_by_monkeypatching_the_low_level_write(tmp_path, monkeypatch):
    with CheckpointManager(tmp_path, mode="sync") as manager:
        save_small(manager, 1)

        def full_after_a_few(fd, data, path):
            if "step-0000002" in path and path.endswith("manifest.json"):
                raise OSError(errno.ENOSPC, "No space left on device")
            REAL_WRITE_ALL(fd, data, path)

        monkeypatch.setattr(write_module, "write_all", full_after_a_few)
        with pytest.raises(CheckpointError, match=r"disk full while writing .*manifest\.json .*step-0000001 is intact"):
            save_small(manager, 2)
    assert step_names(tmp_path) == ["step-0000001"]


def test_disk_full_retry_succeeds_when_transient_and_gives_up_otherwise(tmp_path, monkeypatch):
    calls = enospc(monkeypatch, "model.safetensors", times=2)
    with CheckpointManager(
        tmp_path / "a", mode="async", on_write_error="retry", retries=3, retry_backoff_s=0.01
    ) as manager:
        with warnings.catch_warnings():  # retry warnings come from the writer thread: checked below, in sync mode
            warnings.simplefilter("ignore", CheckpointWarning)
            save_small(manager, 1)
            assert manager.wait() == tmp_path / "a" / "step-0000001"
        assert manager.last_result["attempts"] == 3 and calls["n"] == 2
    calls = enospc(monkeypatch, "model.safetensors")
    manager = CheckpointManager(tmp_path / "b", mode="sync", on_write_error="retry", retries=2, retry_backoff_s=0.01)
    with (
        pytest.raises(CheckpointError, match=r"disk full .* after 3 attempts; there is no previous checkpoint"),
        pytest.warns(CheckpointWarning) as retried,
    ):
        save_small(manager, 1)
    assert [re.sub(r"^.*/", "", str(w.message)) for w in retried] == [
        f"model.safetensors: No space left on device while saving step 1; retrying in {d}s ({i} of 2)"
        for i, d in ((1, "0.01"), (2, "0.02"))
    ]
    assert calls["n"] == 3 and step_names(tmp_path / "b") == []


@pytest.mark.slow
def test_disk_full_reaches_the_spawned_writer_process(tmp_path, monkeypatch, capfd):
    """The process backend's writer is a fresh interpreter that monkeypatch cannot reach; the test-only
    sitecustomize (tests/faults, on the inherited PYTHONPATH) does. This process keeps the real write_all."""
    env = fault_env(dict(os.environ), disk_full_at_step=2)
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    monkeypatch.setenv("FINEFLOW_TEST_DISK_FULL_AT_STEP", "2")
    monkeypatch.delenv("FINEFLOW_TEST_WRITE_DELAY_S", raising=False)
    manager = CheckpointManager(tmp_path, mode="async", async_backend="process")
    try:
        save_small(manager, 1)
        assert manager.wait() == tmp_path / "step-0000001"
        save_small(manager, 2)
        with pytest.raises(
            CheckpointError,
            match=r"disk full while writing \S+/\.tmp-step-0000002/\S+ \(checkpoint "
            r"step 2\); the previous checkpoint \S+step-0000001 is intact",
        ):
            manager.wait()
    finally:
        manager.close()
    assert step_names(tmp_path) == ["step-0000001"]
    assert write_module.write_all is REAL_WRITE_ALL
    assert f"disk full at step 2 {INJECTED}" in capfd.readouterr().err  # said by the writer process itself


# ---------------------------------------------------------------------------------------------------------
# async behaviour, atomic replace, startup cleanup
# ---------------------------------------------------------------------------------------------------------


def test_async_save_returns_before_its_write_and_one_save_is_in_flight_at_a_time(tmp_path, monkeypatch):
    """save() hands the write to the background writer and returns; the next save() waits until that write
    is published. Shown with a step-1 write that blocks on an event, not with a clock (how long the training
    thread stalls is measured by bench/checkpoint_stall.py)."""
    writing, release = threading.Event(), threading.Event()
    step1_published_at_step2_writes: list[bool] = []

    def blocking(fd: int, data: memoryview, path: str) -> None:
        if "step-0000001" in path:
            if threading.current_thread() is threading.main_thread():
                raise AssertionError(f"save() wrote {path} in the caller's thread")
            writing.set()
            if not release.wait(timeout=60):  # fail the save rather than hang the suite
                raise AssertionError(f"the blocked write of {path} was never released")
        else:
            step1_published_at_step2_writes.append((tmp_path / "step-0000001" / "COMPLETE").exists())
        REAL_WRITE_ALL(fd, data, path)

    monkeypatch.setattr(write_module, "write_all", blocking)
    manager = CheckpointManager(tmp_path, keep_last=2, mode="async")
    second_errors: list[BaseException] = []

    def second_save() -> None:
        try:
            save_small(manager, 2)
        except BaseException as exc:  # re-raised below, in the test's thread
            second_errors.append(exc)

    second = threading.Thread(target=second_save)
    try:
        save_small(manager, 1)  # returned: the snapshot is taken, the write is the writer's
        assert writing.wait(timeout=60), "the background writer never started writing step 1"
        assert step_names(tmp_path) == [".tmp-step-0000001"]  # step 1 is being written, not published
        second.start()
        second.join(timeout=0.5)  # a slow machine can only let a wrong save() pass here, never fail a right one
        assert second.is_alive(), "save(2) returned while step 1 was still being written"
        assert step_names(tmp_path) == [".tmp-step-0000001"] and step1_published_at_step2_writes == []
        release.set()
        second.join(timeout=60)
        assert not second.is_alive() and not second_errors, second_errors
        assert (tmp_path / "step-0000001" / "COMPLETE").exists()  # save(2) returned once step 1 was published
        assert manager.wait() == tmp_path / "step-0000002"
    finally:
        release.set()  # a failed assertion must not leave the writer blocked
        if second.ident is not None:
            second.join(timeout=60)
        manager.close()
    assert step1_published_at_step2_writes and all(step1_published_at_step2_writes)  # no overlap of the two writes
    assert step_names(tmp_path) == ["step-0000001", "step-0000002"]
    for step in (1, 2):  # step 1's bytes came from its own snapshot, not from the arena step 2 reused
        assert torch.equal(
            load_checkpoint(tmp_path / f"step-{step:07d}").model_tensors["lora_B"], torch.arange(8.0) + step
        )


def test_resaving_a_step_replaces_it_atomically(tmp_path):
    with CheckpointManager(tmp_path, mode="sync") as manager:
        save_small(manager, 5)
        state = small_state(5)
        state["state_json"]["again"] = True
        manager.save(5, **state)  # no "Directory not empty"
    assert step_names(tmp_path) == ["step-0000005"]
    assert load_checkpoint(tmp_path / "step-0000005").state["again"] is True


def test_startup_cleans_what_a_crash_left(tmp_path):
    with CheckpointManager(tmp_path, keep_last=5, mode="sync") as manager:
        save_small(manager, 1)
        save_small(manager, 3)
    (tmp_path / ".tmp-step-0000004").mkdir()
    (tmp_path / ".tmp-step-0000004" / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".trash-step-0000000-123").mkdir()
    os.rename(tmp_path / "step-0000003", tmp_path / ".old-step-0000003")  # crash mid re-save of step 3
    assert latest_valid(tmp_path) == tmp_path / ".old-step-0000003"  # still found before cleanup
    manager = CheckpointManager(tmp_path, mode="sync")
    assert sorted(manager.cleaned) == [".old-step-0000003", ".tmp-step-0000004", ".trash-step-0000000-123"]
    assert step_names(tmp_path) == ["step-0000001", "step-0000003"]
    assert manager.latest_valid() == tmp_path / "step-0000003"


# ---------------------------------------------------------------------------------------------------------
# retention and fingerprints
# ---------------------------------------------------------------------------------------------------------


def test_retention_keeps_last_best_and_protected(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2, keep_best=2, mode="async")
    for step, metric in zip(range(1, 8), [5.0, 1.0, 2.0, 3.0, 6.0, 7.0, 8.0]):
        save_small(manager, step, metric=metric)
    manager.close()
    # last 2 (6, 7) + best 2 by metric (2: 1.0, 3: 2.0)
    assert step_names(tmp_path) == ["step-0000002", "step-0000003", "step-0000006", "step-0000007"]

    manager = CheckpointManager(tmp_path, keep_last=1, keep_best=0, mode="sync")
    manager.protect(tmp_path / "step-0000006")  # resumed from here
    save_small(manager, 8, metric=9.0)
    # keep_best=0 still keeps the single best (step 2); the protected one stays; the last one stays
    assert step_names(tmp_path) == ["step-0000002", "step-0000006", "step-0000008"]
    save_small(manager, 9)  # no metric: ranks nowhere, but it is the newest
    assert step_names(tmp_path) == ["step-0000002", "step-0000006", "step-0000009"]
    with pytest.raises(CheckpointError, match=r"keep_last must be >= 1 \(got 0\); mode must be"):
        CheckpointManager(tmp_path, keep_last=0, mode="later")


def test_fingerprint_mismatch_is_refused_with_a_clear_message(tmp_path):
    fingerprint = {"model": "models/base@abc", "method": "lora", "data": "sha256:111"}
    with CheckpointManager(tmp_path, mode="sync") as manager:
        save_small(manager, 1, fingerprint=fingerprint)
    assert latest_valid(tmp_path, expected_fingerprint=dict(fingerprint)) == tmp_path / "step-0000001"
    changed = {**fingerprint, "method": "full", "data": "sha256:222"}
    with pytest.raises(CheckpointError) as error:
        latest_valid(tmp_path, expected_fingerprint=changed)
    message = str(error.value)
    assert re.search(
        r"step-0000001: this checkpoint was made by a different configuration \(data: 'sha256:111' "
        r"in the checkpoint, 'sha256:222' now; method: 'lora' in the checkpoint, 'full' now\)",
        message,
    )
    assert "train.resume: never" in message and "model:" not in message
    with pytest.warns(CheckpointWarning, match="using it anyway"):
        assert latest_valid(tmp_path, changed, on_mismatch="ignore") == tmp_path / "step-0000001"


# ---------------------------------------------------------------------------------------------------------
# torn writes: SIGKILL at random moments
# ---------------------------------------------------------------------------------------------------------


def torn_writes_harness():
    spec = importlib.util.spec_from_file_location("torn_writes", ROOT / "bench" / "torn_writes.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    return harness


@pytest.mark.slow
def test_torn_writes_never_picked(tmp_path):
    """30 seeded kills here (bench/torn_writes.py runs 200+): after each, every step dir verifies and
    latest_valid() loads the newest published step with exactly its content."""
    counts = torn_writes_harness().run_trials(tmp_path / "checkpoints", trials=30, seed=0)
    assert counts["trials"] == 30 and counts["torn_picked"] == 0
    assert counts["kills_during_a_save"] >= 3 and counts["saves_published"] >= 5  # timing-dependent: loose


# ---------------------------------------------------------------------------------------------------------
# fault injection is test-only
# ---------------------------------------------------------------------------------------------------------


def test_production_code_has_no_fault_switches():
    """Faults live in tests/ (monkeypatch, tests/faults/sitecustomize.py); fineflow/ reads no fault variable
    and passes no hook."""
    offenders = [
        f"{path.relative_to(ROOT)}: {word}"
        for path in sorted((ROOT / "fineflow").rglob("*.py"))
        for word in ("write_hook", "FINEFLOW_FAULT", "FINEFLOW_TEST_")
        if word in path.read_text(encoding="utf-8")
    ]
    assert not offenders, offenders


def _python(code: str, env: dict) -> str:
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.mark.slow
def test_fault_sitecustomize_is_inert_without_its_variables_and_lazy_with_them(tmp_path):
    """Ours is the only sitecustomize (the interpreter has none that it would shadow); without its variables
    it installs nothing; with them it imports neither fineflow nor torch until the write module is imported,
    and then patches exactly that module (so dvc or git hooks in a test's environment stay untouched)."""
    bare = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("FINEFLOW_TEST_")}
    shadowed = subprocess.run([sys.executable, "-c", "import sitecustomize"], env=bare, capture_output=True)
    assert shadowed.returncode != 0, "the interpreter has a sitecustomize of its own: tests/faults would shadow it"
    probe = (
        "import sys, sitecustomize; print(sitecustomize.__file__); print('hooks', len(sys.meta_path)); "
        "print('heavy', sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'fineflow'}))"
    )
    plain = _python(probe, fault_env(bare))
    assert str(FAULTS_DIR / "sitecustomize.py") in plain and "heavy []" in plain
    armed = _python(
        probe + "; import fineflow.checkpoint.write as w; print('patched', w.write_all.__qualname__)",
        fault_env(bare, write_delay_s=0.5),
    )
    hooks = int(re.search(r"hooks (\d+)", plain).group(1))
    assert f"hooks {hooks + 1}" in armed and "heavy []" in armed  # one finder, nothing heavy imported yet
    assert "patched slow_writes.<locals>.write_all" in armed
    assert re.search(rf"write delay 0.5s {INJECTED} \(pid \d+, rank 0\)", armed)


def test_the_harness_counts_a_torn_pick(tmp_path):
    """torn_picked is measured: the harness's check rejects a checkpoint with flipped bytes or with
    another step's content, and accepts an intact one."""
    harness = torn_writes_harness()
    data = harness.payload(3)
    with CheckpointManager(tmp_path, mode="sync") as manager:
        manager.save(
            3,
            data["model_tensors"],
            data["optimizer_state_dict"],
            data["scheduler_state_dict"],
            data["state_json"],
            [capture_rng()],
            metric=data["metric"],
        )
    path = tmp_path / "step-0000003"
    assert harness.torn(path, 3) is None
    assert harness.torn(path, 4).startswith("AssertionError")  # step 3's content where step 4's belongs
    _flip(path / "optimizer.safetensors")
    assert "sha256 mismatch" in harness.torn(path, 3)


@pytest.mark.slow  # spawns the writer process
def test_a_writer_process_killed_mid_save_is_a_crash_not_a_user_error(tmp_path, monkeypatch):
    """A writer process SIGKILLed (e.g. by the OOM killer) in the middle of a save fails it as a crash: the stage
    exits 1 and its retry resumes, instead of exit 2, which no layer retries. A slow write (the test-only
    sitecustomize, which reaches the spawned writer) keeps the save in flight while it is killed."""
    import signal
    import time

    from fineflow.checkpoint.manager import WriterCrashed
    from fineflow.errors import FineflowError

    monkeypatch.setenv("PYTHONPATH", fault_env(dict(os.environ))["PYTHONPATH"])
    monkeypatch.setenv("FINEFLOW_TEST_WRITE_DELAY_S", "30")
    monkeypatch.delenv("FINEFLOW_TEST_DISK_FULL_AT_STEP", raising=False)
    manager = CheckpointManager(tmp_path, keep_last=5, mode="async", async_backend="process")
    try:
        save_small(manager, 1)
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".tmp-step-0000001")) and time.monotonic() < deadline:
            time.sleep(0.01)  # the writer has started on it
        os.kill(manager._process.pid, signal.SIGKILL)
        with pytest.raises(WriterCrashed, match="writer process died .* step 1; there is no previous") as died:
            manager.wait()
        assert not isinstance(died.value, FineflowError)
    finally:
        manager.close()
    assert not (tmp_path / "step-0000001").exists()  # nothing half-written was published
    from fineflow.checkpoint import clean_stale

    clean_stale(tmp_path)  # what the retry's start does with the killed writer's temp dir
    assert list(tmp_path.iterdir()) == []
