"""CheckpointManager, the training loop's interface: save() snapshots the state into the host arena and
hands the job to the background writer (a thread, or a spawned process with the arena in shared memory),
one save in flight at a time; check() (every training step, without waiting), wait() and close() surface its
errors; resuming goes through read.py."""

from __future__ import annotations

import math
import os
import signal
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fineflow.checkpoint.format import CheckpointError, split_parts
from fineflow.checkpoint.publish import newest_complete, run_job
from fineflow.checkpoint.read import LoadedCheckpoint, latest_valid, load_checkpoint
from fineflow.checkpoint.remote_store import StoreConfig
from fineflow.checkpoint.retention import clean_stale
from fineflow.checkpoint.snapshot import SaveJob, _copy_into, plan_files
from fineflow.core.train_config import CheckpointSettings

_DEFAULTS = CheckpointSettings()


def lower_priority() -> None:
    """Run this thread (the background writer) at the lowest CPU priority, so that on a busy machine it
    uses idle cycles instead of taking a core from the training threads (Linux: per-thread nice)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass


def _die_with_parent(parent: int) -> None:
    """A writer process must not outlive a SIGKILLed trainer: it would keep renaming and deleting in a
    directory that the restarted run is already cleaning."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _worker_main(jobs, results, parent: int) -> None:
    """The process backend's loop: one job at a time; the result or the error message goes back."""
    _die_with_parent(parent)
    torch.set_num_threads(1)  # leave the cores to training; the work here is I/O and hashing
    lower_priority()
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            results.put(("ok", run_job(job)))
        except CheckpointError as exc:
            results.put(("error", str(exc)))
        except BaseException as exc:
            results.put(
                (
                    "error",
                    f"checkpoint writer failed on step {job.step}: {type(exc).__name__}: {exc}\n"
                    + traceback.format_exc(),
                )
            )
        del job  # release the shared arena before waiting for the next one


class WriterCrashed(RuntimeError):
    """The writer process died (killed, out of memory): a crash, not the user's error. The stage fails with a
    traceback and exit 1, so a retry runs, and resumes from the intact previous checkpoint."""


@dataclass
class _InFlight:
    step: int
    thread: threading.Thread | None = None
    result: dict | None = None
    error: BaseException | None = None
    settled: bool = False  # the process backend's answer has arrived (result or error)


@dataclass
class CheckpointManager:
    """Saves checkpoints into root, one at a time, in the background; finds and loads the newest valid one.

    mode: "async" (save() returns once the state is in host memory) or "sync" (save() returns when the
    checkpoint is published). async_backend: "thread" (no extra process; the writer releases the GIL
    while writing and hashing) or "process" (a spawned writer; the snapshot goes to shared memory; it
    cannot stall the training thread at all, at the cost of a process start). on_write_error: "stop"
    (the error surfaces from the next check()/save()/wait()/close()) or "retry" (up to `retries` times with
    exponential backoff from retry_backoff_s, then the error). The background writer runs at nice 19: on
    a busy machine a save takes longer, but the training steps do not pay for it.
    store: also upload each published checkpoint there (fineflow.checkpoint.remote_store), in the same background
    writer; a failed upload follows on_write_error.
    """

    root: str | Path
    # the defaults are params.yaml's `checkpoint` section (fineflow.core.train_config): one source, not a second copy
    keep_last: int = _DEFAULTS.keep_last
    keep_best: int = _DEFAULTS.keep_best
    mode: str = _DEFAULTS.mode
    async_backend: str = _DEFAULTS.backend
    on_write_error: str = _DEFAULTS.on_write_error
    retries: int = _DEFAULTS.retries
    retry_backoff_s: float = 1.0
    # checkpoint.store: every published checkpoint is uploaded there too, by the writer
    # (fineflow.checkpoint.remote_store)
    store: StoreConfig | None = None
    last_result: dict | None = field(default=None, init=False)  # the last completed save: path, write_s, ...

    def __post_init__(self) -> None:
        problems = []
        if self.keep_last < 1:
            problems.append(f"keep_last must be >= 1 (got {self.keep_last})")
        if self.keep_best < 0:
            problems.append(f"keep_best must be >= 0 (got {self.keep_best})")
        if self.mode not in ("async", "sync"):
            problems.append(f"mode must be 'async' or 'sync' (got {self.mode!r})")
        if self.async_backend not in ("thread", "process"):
            problems.append(f"async_backend must be 'thread' or 'process' (got {self.async_backend!r})")
        if self.on_write_error not in ("stop", "retry"):
            problems.append(f"on_write_error must be 'stop' or 'retry' (got {self.on_write_error!r})")
        if self.retries < 0:
            problems.append(f"retries must be >= 0 (got {self.retries})")
        if problems:
            raise CheckpointError("checkpoint settings: " + "; ".join(problems))
        self.root = Path(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.cleaned = clean_stale(self.root)
        self._protected: set[str] = set()
        self._arena: torch.Tensor | None = None
        self._pinned = False
        self._in_flight: _InFlight | None = None
        self._process = None
        if self.mode == "async" and self.async_backend == "process":
            self._start_process()  # now, so its start (importing torch) overlaps model building

    # -- resuming ------------------------------------------------------------------------------------

    def latest_valid(self, expected_fingerprint: Any = None, on_mismatch: str = "refuse") -> Path | None:
        return latest_valid(self.root, expected_fingerprint, on_mismatch)

    def load(self, path: str | Path, verify: bool = True) -> LoadedCheckpoint:
        return load_checkpoint(path, verify)

    def protect(self, path: str | Path) -> None:
        """Never delete this checkpoint (the one being resumed from) while this manager lives."""
        self._protected.add(str(Path(path).resolve()))

    # -- saving --------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model_tensors: dict[str, torch.Tensor],
        optimizer_state_dict: dict,
        scheduler_state_dict: dict,
        state_json: dict,
        rng_snapshots: list[dict],
        metric: float | None = None,
        grad_scaler_state: dict | None = None,
        sharded_dir: str | Path | None = None,
    ) -> None:
        """Snapshot the state and write it as step-<step>. Waits for the previous save first and raises
        its error; in async mode returns once the snapshot is in host memory.

        sharded_dir: a sharded save (FSDP). Every rank has already written its shards of the trainable
        tensors and the optimizer there (fineflow.train.fsdp.save_sharded); the writer moves that directory
        into the checkpoint and hashes its files into the manifest. model_tensors is then empty and
        optimizer_state_dict None."""
        self.wait()
        if not model_tensors and sharded_dir is None:
            raise CheckpointError(
                f"nothing to checkpoint at step {step}: model_tensors is empty (pass the "
                "trainable tensors: for LoRA, the adapter's state dict)"
            )
        if metric is not None and not math.isfinite(float(metric)):
            metric = None  # a NaN metric would win or lose every comparison; it ranks nowhere
        job = self._snapshot(
            step,
            model_tensors,
            optimizer_state_dict,
            scheduler_state_dict,
            state_json,
            rng_snapshots,
            None if metric is None else float(metric),
            grad_scaler_state,
            None if sharded_dir is None else str(sharded_dir),
        )
        if self.mode == "sync":
            self.last_result = run_job(job)
        elif self.async_backend == "thread":
            flight = _InFlight(step)
            flight.thread = threading.Thread(
                target=self._run_in_thread, args=(flight, job), name=f"fineflow-checkpoint-{step}"
            )
            self._in_flight = flight
            flight.thread.start()
        else:
            if self._process is None or not self._process.is_alive():
                self._start_process()
            self._in_flight = _InFlight(step)
            self._jobs.put(job)

    def check(self) -> None:
        """Raise the error of a save in flight that has already failed; never waits for one still writing.

        The loop calls it at every step: a failed background write (a full disk) then stops training at the
        next step boundary, not at the next save an interval later (ENOSPC at step 150: stopped then, not at
        step 200). A save being retried (on_write_error: retry) is still in flight: training goes on."""
        flight = self._in_flight
        if flight is None:
            return
        if flight.thread is not None:
            if flight.thread.is_alive():
                return
        elif not flight.settled and not self._await_process(flight, block=False):
            return
        self.wait()  # finished: records its result, or raises its error

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is published; raise its error. Returns its path."""
        flight = self._in_flight
        if flight is None:
            return None
        if flight.thread is not None:
            flight.thread.join()
        elif not flight.settled:
            self._await_process(flight)
        self._in_flight = None  # only now: an interrupted wait() must not lose track of the save in flight
        if flight.error is not None:
            raise flight.error
        self.last_result = flight.result
        return Path(flight.result["path"])

    def close(self) -> None:
        """Wait for the last save (raising its error) and stop the writer process, if any."""
        try:
            self.wait()
        finally:
            if self._process is not None:
                self._jobs.put(None)
                self._process.join(timeout=30)
                if self._process.is_alive():
                    self._process.kill()
                self._process = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------------

    def _snapshot(
        self,
        step,
        model_tensors,
        optimizer_state_dict,
        scheduler_state_dict,
        state_json,
        rng_snapshots,
        metric,
        grad_scaler_state,
        sharded_dir=None,
    ) -> SaveJob:
        """Serialize the JSON parts and copy every tensor into the host arena: after this returns, the
        caller may change its model and optimizer freely. The only part of an async save the loop waits for."""
        parts = {
            "optimizer": optimizer_state_dict,
            "scheduler": scheduler_state_dict,
            "state": state_json,
            "rng": list(rng_snapshots),
        }
        if optimizer_state_dict is None:  # sharded: the optimizer's state is in the ranks' shards
            del parts["optimizer"]
        if grad_scaler_state is not None:
            parts["grad_scaler"] = grad_scaler_state
        tensor_sets, json_files = split_parts(model_tensors, parts)
        planned, total = plan_files(tensor_sets)
        arena = self._arena_for(total)
        arena_bytes = arena.numpy()
        on_gpu = False
        for spec, tensors, entries in planned:
            for name, begin, _ in entries:
                on_gpu |= tensors[name].device.type == "cuda"
                _copy_into(arena, arena_bytes, spec.offset + begin, tensors[name], non_blocking=self._pinned)
        if on_gpu:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies must land before we return
        return SaveJob(
            root=str(self.root),
            step=step,
            metric=metric,
            json_files=json_files,
            tensor_files=[spec for spec, _, _ in planned],
            arena=arena,
            keep_last=self.keep_last,
            keep_best=self.keep_best,
            protected=sorted(self._protected),
            on_write_error=self.on_write_error,
            retries=self.retries,
            retry_backoff_s=self.retry_backoff_s,
            sharded_dir=sharded_dir,
            store=self.store,
        )

    def _arena_for(self, nbytes: int) -> torch.Tensor:
        """The host buffer, reused across saves (no allocation or page faults after the first): safe
        because the previous save has finished with it before the next snapshot starts."""
        if self._arena is None or self._arena.numel() < nbytes:
            self._arena = None  # drop the old one before allocating the new one
            if self.mode == "async" and self.async_backend == "process":
                new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
                if new_shared is not None:  # created in shared memory, not copied there
                    self._arena = torch.empty(0, dtype=torch.uint8).set_(new_shared(max(nbytes, 1)))
                else:
                    self._arena = torch.empty(max(nbytes, 1), dtype=torch.uint8).share_memory_()
            else:
                self._pinned = torch.cuda.is_available() and torch.cuda.is_initialized()  # async D2H copies
                self._arena = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self._pinned)
        return self._arena[: max(nbytes, 1)] if nbytes else self._arena[:0]

    def _run_in_thread(self, flight: _InFlight, job: SaveJob) -> None:
        lower_priority()
        try:
            flight.result = run_job(job)
        except BaseException as exc:  # re-raised in the training thread by wait()
            flight.error = exc

    def _start_process(self) -> None:
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")  # never fork a process that may hold CUDA or OpenMP state
        self._jobs, self._results = context.Queue(), context.Queue()
        self._process = context.Process(
            target=_worker_main,
            name="fineflow-checkpoint-writer",
            daemon=True,
            args=(self._jobs, self._results, os.getpid()),
        )
        self._process.start()

    def _await_process(self, flight: _InFlight, block: bool = True) -> bool:
        """The writer process's answer into flight (result, or error); block=False: only if it has arrived.
        Whether flight is settled."""
        import queue

        while True:
            try:
                status, payload = self._results.get(timeout=0.5) if block else self._results.get_nowait()
                break
            except queue.Empty:
                if block and self._process.is_alive():
                    continue
                if not self._process.is_alive():
                    code = self._process.exitcode
                    self._process = None
                    previous = newest_complete(Path(self.root))
                    intact = (
                        f"the previous checkpoint {previous} is intact"
                        if previous is not None
                        else "there is no previous checkpoint"
                    )
                    flight.error = WriterCrashed(
                        f"the checkpoint writer process died (exit code {code}) while "
                        f"saving step {flight.step}; {intact}"
                    )
                    flight.settled = True
                    return True
                return False  # not blocking, and the writer is still at work
        if status == "ok":
            flight.result = payload
        else:
            flight.error = CheckpointError(payload)
        flight.settled = True
        return True
