"""checkpoint.store: checkpoints on an object store every node sees (fineflow.checkpoint.remote_store), against a
real S3 API server on 127.0.0.1 (conftest's s3_server: moto's, started and stopped by PID).

A run on node-local disks resumes on another node, though checkpoints/ is not a DVC output (`dvc pull` cannot
bring them there): each published checkpoint is also uploaded (its marker last), and a resume on an empty local
directory downloads the store's newest valid one."""

from __future__ import annotations

import json
import shutil
import time
import uuid
import warnings
from pathlib import Path

import fsspec
import pytest
import torch
from safetensors.torch import load_file

from fineflow.checkpoint import (
    MANIFEST,
    MARKER,
    CheckpointError,
    CheckpointManager,
    CheckpointWarning,
    StoreConfig,
    fetch_newest,
    latest_valid,
    verify_checkpoint,
)
from tests.conftest import (
    S3_BUCKET,
    finish_train,
    kill_when,
    ranks_overrides,
    start_train,
    train_env,
    train_project,
)

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def store(s3_server, monkeypatch) -> StoreConfig:
    """A prefix of this test's own in the session's bucket, with the credentials the client reads from the env."""
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    return StoreConfig(f"s3://{S3_BUCKET}/ckpt-{uuid.uuid4().hex[:8]}", s3_server)


def _fs(store: StoreConfig):
    fs, root = fsspec.core.url_to_fs(store.url, endpoint_url=store.endpoint)
    fs.invalidate_cache()
    return fs, root


def _stored_steps(store: StoreConfig, run: str) -> dict[str, set[str]]:
    """Step directory -> the names of its objects, as the S3 server has them."""
    fs, root = _fs(store)
    found: dict[str, set[str]] = {}
    for key in fs.find(f"{root}/{run}"):
        step, _, name = key[len(f"{root}/{run}/") :].partition("/")
        found.setdefault(step, set()).add(name)
    return found


def _save(manager: CheckpointManager, step: int, value: float = 1.0) -> None:
    weights = {"w": torch.full((4, 4), value + step), "b": torch.arange(4.0) * step}
    manager.save(step, weights, {"state": {}, "param_groups": []}, {"last_epoch": step}, {"step": step}, [{}])
    manager.wait()


def _manager(root: Path, store: StoreConfig, **settings) -> CheckpointManager:
    return CheckpointManager(root, mode=settings.pop("mode", "sync"), keep_best=0, store=store, **settings)


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_published_checkpoints_are_uploaded_and_downloaded_bit_for_bit(store, tmp_path, backend):
    run = tmp_path / "node0/checkpoints/run-a"
    # the background writer uploads: a thread, or a spawned process (the StoreConfig travels with the job)
    with _manager(run, store, mode="async", async_backend=backend, keep_last=3) as manager:
        for step in (2, 4):
            _save(manager, step)
        assert manager.last_result["uploaded"] == f"{store.url}/run-a/step-0000004"
    stored = _stored_steps(store, "run-a")
    assert set(stored) == {"step-0000002", "step-0000004"}
    assert {MANIFEST, MARKER, "model.safetensors", "state.json"} <= stored["step-0000004"]
    fresh = tmp_path / "node1/checkpoints/run-a"  # another node: nothing on its disk
    fetched = fetch_newest(store, fresh)
    assert fetched == fresh / "step-0000004" and latest_valid(fresh) == fetched
    verify_checkpoint(fetched, deep=True)
    for name in verify_checkpoint(run / "step-0000004")["files"]:
        assert (fetched / name).read_bytes() == (run / "step-0000004" / name).read_bytes(), name
    assert not list(fresh.glob(".tmp-*"))
    assert fetch_newest(store, fresh, newer_than=4) is None  # nothing newer than what the node has


def test_a_corrupt_object_is_skipped_for_the_older_valid_checkpoint(store, tmp_path):
    with _manager(tmp_path / "local/run-b", store, keep_last=3) as manager:
        for step in (2, 4):
            _save(manager, step)
    fs, root = _fs(store)
    key = f"{root}/run-b/step-0000004/model.safetensors"
    data = bytearray(fs.cat_file(key))
    data[-1] ^= 0xFF  # one flipped bit in the store: same size, another sha256
    fs.pipe_file(key, bytes(data))
    fresh = tmp_path / "fresh/run-b"
    with pytest.warns(CheckpointWarning, match=r"step-0000004.*model.safetensors.*sha256 mismatch.*skipped"):
        assert fetch_newest(store, fresh) == fresh / "step-0000002"
    assert sorted(p.name for p in fresh.iterdir()) == ["step-0000002"]  # the corrupt one left nothing behind


def _replace_put_file(monkeypatch, wrap) -> None:
    """The S3 client's upload of one file becomes wrap(the real one), an async function, for this test."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "_put_file", wrap(s3fs.S3FileSystem._put_file))
    # fsspec binds each instance's sync put_file to its _put_file when the instance is made: make new ones
    s3fs.S3FileSystem.clear_instance_cache()
    monkeypatch.setattr(s3fs.S3FileSystem, "_cache", {})  # and none made while patched outlives the test


def _failing_puts(monkeypatch, name: str, failures: int) -> list[str]:
    """The S3 client's uploads of objects called `name` fail `failures` times (then work): an upload torn between
    a checkpoint's files and its manifest. Returns the failed keys."""
    failed: list[str] = []

    def wrap(real):
        async def put_file(self, lpath, rpath, *args, **kwargs):
            if rpath.endswith(f"/{name}") and len(failed) < failures:
                failed.append(rpath)
                raise PermissionError(f"injected: {rpath} refused")
            return await real(self, lpath, rpath, *args, **kwargs)

        return put_file

    _replace_put_file(monkeypatch, wrap)
    return failed


def test_a_torn_upload_is_invisible_and_stops_training_like_a_failed_write(store, tmp_path, monkeypatch):
    local = tmp_path / "local/run-c"
    manager = _manager(local, store, mode="async", keep_last=3)
    _save(manager, 2)
    failed = _failing_puts(monkeypatch, MANIFEST, failures=1)
    with pytest.raises(CheckpointError, match=r"uploading checkpoint step 4 to checkpoint.store .* failed.*injected"):
        _save(manager, 4)  # on_write_error: stop (the default): the error surfaces in the training thread
    manager.close()
    assert failed == [f"{_fs(store)[1]}/run-c/step-0000004/{MANIFEST}"]
    stored = _stored_steps(store, "run-c")
    assert "model.safetensors" in stored["step-0000004"] and MARKER not in stored["step-0000004"]  # torn
    assert latest_valid(local) == local / "step-0000004"  # the local checkpoint stays published
    assert fetch_newest(store, tmp_path / "fresh/run-c") == tmp_path / "fresh/run-c/step-0000002"


def test_a_failed_upload_is_retried_with_on_write_error_retry(store, tmp_path, monkeypatch):
    failed = _failing_puts(monkeypatch, MARKER, failures=2)
    with _manager(tmp_path / "local/run-d", store, on_write_error="retry", retries=3, retry_backoff_s=0.01) as manager:
        with pytest.warns(CheckpointWarning, match=r"uploading step 2 .* failed .* retrying"):
            _save(manager, 2)
        assert manager.last_result["upload_attempts"] == 3 and len(failed) == 2
    assert MARKER in _stored_steps(store, "run-d")["step-0000002"]


def test_retention_applies_in_the_store(store, tmp_path):
    local = tmp_path / "local/run-e"
    with _manager(local, store, keep_last=2) as manager:
        for step in (2, 4, 6):
            _save(manager, step)
        assert manager.last_result["store_deleted"] == [f"{store.url}/run-e/step-0000002"]
        manager.protect(local / "step-0000004")  # the checkpoint resumed from is never deleted, here or there
        _save(manager, 8)
    assert set(_stored_steps(store, "run-e")) == {"step-0000004", "step-0000006", "step-0000008"}
    assert sorted(p.name for p in local.iterdir()) == ["step-0000004", "step-0000006", "step-0000008"]


def test_a_run_that_starts_over_fetches_nothing_and_clears_its_store_copy(store, tmp_path):
    """The local rule (fineflow.train.resume: a finished run, or train.resume never, trains again from step 0) holds
    on a node whose disk is empty: the store's copy of the run is deleted instead of resumed from."""
    from types import SimpleNamespace

    from fineflow.checkpoint.remote_store import fetch_for_resume, mark_run_finished

    one_rank = SimpleNamespace(is_local_main_process=True, is_main_process=True, num_processes=1)
    local = tmp_path / "node0/run-g"
    with _manager(local, store, keep_last=3) as manager:
        _save(manager, 2)
    fetch_for_resume(one_rank, tmp_path / "node1/run-g", store, "FINISHED")  # resumable: fetched
    assert (tmp_path / "node1/run-g/step-0000002").is_dir()
    fetch_for_resume(one_rank, tmp_path / "node2/run-g", store, "FINISHED", fresh=True)  # train.resume: never
    assert not (tmp_path / "node2/run-g").exists() and _stored_steps(store, "run-g") == {}
    with _manager(local, store, keep_last=3) as manager:
        _save(manager, 4)
    (local / "FINISHED").write_text("{}")
    mark_run_finished(store, local, "FINISHED")
    assert "FINISHED" in _stored_steps(store, "run-g")
    fetch_for_resume(one_rank, tmp_path / "node3/run-g", store, "FINISHED")  # finished: trains again
    assert not list((tmp_path / "node3").rglob("step-*")) and _stored_steps(store, "run-g") == {}


def _store_has_a_checkpoint(store: StoreConfig, project: Path, after: list[float]) -> bool:
    """kill_when's condition: a complete checkpoint of step 4 or later is in the store (asked at most every 0.1 s)."""
    if time.monotonic() < after[0]:
        return False
    after[0] = time.monotonic() + 0.1
    fs, root = _fs(store)
    return any(int(marker.split("/")[-2][len("step-") :]) >= 4 for marker in fs.glob(f"{root}/*/step-*/{MARKER}"))


def _logged_steps(project: Path) -> list[dict]:
    return [json.loads(line) for line in (project / "reports/train_steps.jsonl").read_text().splitlines()]


@pytest.mark.scenario
def test_a_run_resumes_from_the_store_on_an_empty_local_disk_bit_exact(built, reference_run, store, tmp_path):
    """The train stage, 1 rank: killed once the store holds a checkpoint, its local checkpoints/ deleted (another
    node's empty disk), run again: it downloads the store's newest valid checkpoint, resumes, and ends with the
    uninterrupted run's adapter, bit for bit, having trained each step once."""
    settings = {"checkpoint.store": store.url, "checkpoint.store_endpoint": store.endpoint}
    project = train_project(built, tmp_path / "p", {**ranks_overrides(1), **settings})
    env = {**train_env(1), **CREDENTIALS}
    throttle = [0.0]
    killed = kill_when(
        lambda port: start_train(project, 1, env, port), project, lambda p: _store_has_a_checkpoint(store, p, throttle)
    )
    assert killed, "the run finished before the store held a checkpoint"
    shutil.rmtree(project / "checkpoints")
    output = finish_train(project, 1, env)
    assert "checkpoint.store: downloaded " in output and "resuming from " in output, output[-3000:]
    reference = reference_run(1)
    resumed_steps, reference_steps = (_logged_steps(p) for p in (project, reference))
    assert [s["step"] for s in resumed_steps] == [s["step"] for s in reference_steps]  # each step once
    assert [(s["loss"], s["grad_norm"]) for s in resumed_steps] == [
        (s["loss"], s["grad_norm"]) for s in reference_steps
    ]
    resumed, uninterrupted = (load_file(p / "models/candidate/adapter_model.safetensors") for p in (project, reference))
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)  # bit-exact


def test_a_store_that_cannot_be_reached_is_said_on_resume(tmp_path, monkeypatch):
    """A resume that cannot read the store stops with one message naming it and what to check."""
    from types import SimpleNamespace

    from fineflow.checkpoint.remote_store import fetch_for_resume

    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    unreachable = StoreConfig("s3://nowhere/ckpt", "http://127.0.0.1:9")  # the discard port: nothing listens
    one_rank = SimpleNamespace(is_local_main_process=True, num_processes=1)
    with warnings.catch_warnings(), pytest.raises(CheckpointError, match=r"checkpoint.store s3://nowhere/ckpt: .*"):
        fetch_for_resume(one_rank, tmp_path / "run-f", unreachable, "FINISHED")


def _two_nodes(run_dirs: list[Path], store: StoreConfig, endpoints: list[str], tmp_path: Path) -> tuple[list, str]:
    """tests.store_probe on two "machines" on loopback (one process each, each with its own run directory and
    store endpoint): (exit codes, their output)."""
    from fineflow.train.launch import accelerate_command
    from tests.conftest import ROOT, launch_with_free_port, run_together

    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    result: list = []

    def launch(port):
        commands = [
            accelerate_command(
                2,
                False,
                "tests.store_probe",
                [str(run_dir), store.url, endpoint],
                port,
                num_machines=2,
                machine_rank=rank,
                main_process_ip="127.0.0.1",
            )
            for rank, (run_dir, endpoint) in enumerate(zip(run_dirs, endpoints))
        ]
        extra = {**CREDENTIALS, "AWS_MAX_ATTEMPTS": "1"}  # an unreachable endpoint fails at once
        result[:] = run_together([(argv, {**env, **extra}) for argv, env in commands], ROOT, logs, 240)
        text = "".join(log.read_text() for log in logs)
        return "store_probe rank=1" in text, text

    _, text = launch_with_free_port(launch)
    return result, text


@pytest.mark.slow
def test_every_node_fetches_the_newest_valid_checkpoint_into_its_own_disk(store, tmp_path):
    """Two machines without a shared filesystem: each one's local main process downloads the store's newest valid
    checkpoint into its own run directory; a node that cannot read the store stops every rank with one error."""
    with _manager(tmp_path / "writer/run-h", store, keep_last=3) as manager:
        for step in (2, 4):
            _save(manager, step)
    nodes = [tmp_path / f"node{rank}/checkpoints/run-h" for rank in (0, 1)]
    codes, text = _two_nodes(nodes, store, [store.endpoint, store.endpoint], tmp_path)
    assert codes == [0, 0], text[-4000:]
    for rank, node in enumerate(nodes):
        assert f"store_probe rank={rank} steps=['step-0000004']" in text, text[-4000:]
        verify_checkpoint(node / "step-0000004", deep=True)
    blind = [tmp_path / f"blind{rank}/run-h" for rank in (0, 1)]
    codes, text = _two_nodes(blind, store, [store.endpoint, "http://127.0.0.1:9"], tmp_path)
    assert 0 not in codes, text[-4000:]  # accelerate launch exits 1 for a failed rank; the other is then stopped
    for rank in (0, 1):
        assert f"store_probe rank={rank} error=checkpoint.store {store.url}: the checkpoints of this run" in text


def test_an_upload_runs_in_the_background_writer_not_the_training_loop(store, tmp_path, monkeypatch):
    """save() (async) returns while the upload is still blocked in the writer thread; the loop's check() does not
    wait for it; wait() does."""
    import asyncio
    import threading

    release, uploading = threading.Event(), threading.Event()

    def wrap(real):
        async def held_put_file(self, lpath, rpath, *args, **kwargs):
            uploading.set()
            await asyncio.get_running_loop().run_in_executor(None, release.wait)
            return await real(self, lpath, rpath, *args, **kwargs)

        return held_put_file

    _replace_put_file(monkeypatch, wrap)
    manager = _manager(tmp_path / "local/run-i", store, mode="async")
    weights = {"w": torch.ones(4, 4)}
    manager.save(2, weights, {"state": {}, "param_groups": []}, {}, {"step": 2}, [{}])  # returns: nothing waits
    assert uploading.wait(timeout=60), "the writer never started uploading"
    manager.check()  # the loop's per-step check: the upload is in flight, not failed
    assert manager.last_result is None
    release.set()
    manager.close()
    assert manager.last_result["uploaded"].endswith("run-i/step-0000002")
