"""One save, end to end, as the background writer runs it: temp dir -> files -> manifest -> marker ->
fsync -> verify -> atomic rename -> fsync parent, then retention, then (checkpoint.store) the upload and the
store's retention; OSErrors and failed uploads become a clear CheckpointError (or retries). Every backend (sync,
thread, process) runs ``run_job``."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import time
import warnings
from pathlib import Path

from fineflow.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MARKER,
    SHARDED_DIR,
    CheckpointError,
    CheckpointWarning,
    _json_bytes,
    _step_dirs,
    step_dir_name,
)
from fineflow.checkpoint.read import _sha256_file, verify_checkpoint
from fineflow.checkpoint.remote_store import STORE_ADVICE, apply_store_retention, upload_checkpoint
from fineflow.checkpoint.retention import apply_retention
from fineflow.checkpoint.snapshot import SaveJob
from fineflow.checkpoint.write import _write_file, fsync_dir, publish_dir


def _write_checkpoint(job: SaveJob) -> tuple[Path, dict]:
    """Returns the published path and how long writing (with fsync) and verifying took."""
    started = time.perf_counter()
    root = Path(job.root)
    final, tmp = root / step_dir_name(job.step), root / f".tmp-{step_dir_name(job.step)}"
    if tmp.exists():
        _unstage(job, tmp)
        shutil.rmtree(tmp)  # left by a failed attempt of the same step
    tmp.mkdir(parents=True)
    data = job.arena.numpy()
    files: dict[str, dict] = _take_sharded(job, tmp)
    for spec in job.tensor_files:
        files[spec.name] = _write_file(tmp / spec.name, [spec.header, data[spec.offset : spec.offset + spec.nbytes]])
    for name, payload in job.json_files.items():
        files[name] = _write_file(tmp / name, [payload])
    # no timestamp: the same state must give the same bytes (DVC hashes checkpoints/ into dvc.lock, and
    # the Prefect flow and `dvc repro` must leave the same lock); the directory's mtime says when
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "step": job.step, "metric": job.metric, "files": files}
    if job.sharded_dir is not None:
        manifest["layout"] = "sharded"
    manifest_bytes = _json_bytes(manifest)
    _write_file(tmp / MANIFEST, [manifest_bytes])
    # the marker names the manifest's hash: a marker next to any other manifest is not a complete save
    _write_file(tmp / MARKER, [f"sha256 {hashlib.sha256(manifest_bytes).hexdigest()}\n".encode()])
    fsync_dir(tmp)
    written = time.perf_counter()
    verify_checkpoint(tmp, deep=True)  # only a verified checkpoint is ever published
    verified = time.perf_counter()
    publish_dir(tmp, final)
    return final, {"files_s": written - started, "verify_s": verified - written}


def _take_sharded(job: SaveJob, tmp: Path) -> dict[str, dict]:
    """A sharded save: move the directory the ranks wrote their shards into (already fsynced by them) into
    the checkpoint, and hash its files for the manifest (read back from disk: other processes wrote them)."""
    if job.sharded_dir is None:
        return {}
    target = tmp / SHARDED_DIR
    os.rename(job.sharded_dir, target)
    fsync_dir(tmp)
    entries = {}
    for file in sorted(p for p in target.rglob("*") if p.is_file()):  # DeepSpeed writes into a subdirectory
        digest, size = _sha256_file(file)
        entries[file.relative_to(tmp).as_posix()] = {"sha256": digest, "size": size}
    return entries


def _unstage(job: SaveJob, tmp: Path) -> None:
    """Before a failed attempt's temp dir is removed: give the ranks' shards back to the staging directory,
    so that a retry (on_write_error: retry) still has them."""
    moved = tmp / SHARDED_DIR
    if job.sharded_dir is not None and moved.is_dir() and not Path(job.sharded_dir).exists():
        os.rename(moved, job.sharded_dir)


def newest_complete(root: Path, exclude: Path | None = None) -> Path | None:
    """The newest step directory carrying a marker (no hashing: for messages and retention)."""
    for _, path in sorted(_step_dirs(root), reverse=True):
        if path != exclude and (path / MARKER).exists():
            return path
    return None


def _write_error(job: SaveJob, exc: OSError, attempts: int) -> CheckpointError:
    root = Path(job.root)
    previous = newest_complete(root, exclude=root / step_dir_name(job.step))
    intact = (
        f"the previous checkpoint {previous} is intact" if previous is not None else "there is no previous checkpoint"
    )
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    what = "disk full" if full else f"I/O error ({exc.strerror or exc})"
    advice = (
        f"Free space under {root} or lower checkpoint.keep_last."
        if full
        else f"Check the disk or mount that holds {root}."
    )
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    return CheckpointError(
        f"{what} while writing {exc.filename or root} (checkpoint step {job.step}){tries}; {intact}. {advice}"
    )


def _may_retry(job: SaveJob, attempt: int, failure: str) -> bool:
    """on_write_error: retry with attempts left: warn, wait the exponential backoff, and say to try again."""
    if job.on_write_error != "retry" or attempt >= job.retries:
        return False
    delay = job.retry_backoff_s * 2**attempt
    warnings.warn(
        f"{failure}; retrying in {delay:g}s ({attempt + 1} of {job.retries})", CheckpointWarning, stacklevel=3
    )
    time.sleep(delay)
    return True


def run_job(job: SaveJob) -> dict:
    """Write, verify and publish one checkpoint, then apply retention; every backend runs this.

    An OSError (ENOSPC, EIO) removes the temp dir and, with on_write_error="retry", is retried with
    exponential backoff up to job.retries times; the previous checkpoint is never touched.
    """
    root = Path(job.root)
    tmp = root / f".tmp-{step_dir_name(job.step)}"
    started, attempt = time.perf_counter(), 0
    while True:
        try:
            path, timings = _write_checkpoint(job)
            break
        except OSError as exc:
            _unstage(job, tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            if _may_retry(job, attempt, f"{exc.filename}: {exc.strerror or exc} while saving step {job.step}"):
                attempt += 1
                continue
            raise _write_error(job, exc, attempt + 1) from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    write_s = time.perf_counter() - started
    try:
        deleted = apply_retention(root, job.keep_last, job.keep_best, job.protected)
    except OSError as exc:  # the new checkpoint is published and valid: a failed cleanup must not undo that
        warnings.warn(f"{root}: retention failed ({exc}); old checkpoints were kept", CheckpointWarning, stacklevel=2)
        deleted = []
    return {
        "path": str(path),
        "step": job.step,
        "write_s": write_s,
        **timings,
        "attempts": attempt + 1,
        "bytes": sum(s.nbytes for s in job.tensor_files),
        "deleted": [str(p) for p in deleted],
        **(_upload(job, path) if job.store is not None else {}),
    }


def _upload(job: SaveJob, path: Path) -> dict:
    """The published checkpoint uploaded to checkpoint.store (fineflow.checkpoint.remote_store), then the store's
    retention. A failed upload follows on_write_error as a failed write does (retried with backoff, or a
    CheckpointError); the local checkpoint stays published either way. A failed cleanup in the store warns."""
    started, attempt = time.perf_counter(), 0
    while True:
        try:
            url = upload_checkpoint(job.store, path)
            break
        except Exception as exc:  # noqa: BLE001 - the object store client's errors (botocore's are not OSErrors)
            failure = f"uploading step {job.step} to {job.store.url} failed ({type(exc).__name__}: {exc})"
            if _may_retry(job, attempt, failure):
                attempt += 1
                continue
            tries = f" after {attempt + 1} attempts" if attempt else ""
            raise CheckpointError(
                f"uploading checkpoint step {job.step} to checkpoint.store {job.store.url} failed{tries} "
                f"({type(exc).__name__}: {exc}); the local checkpoint {path} is published. {STORE_ADVICE}"
            ) from exc
    upload_s = time.perf_counter() - started
    protected = {Path(p).name for p in job.protected}
    try:
        deleted = apply_store_retention(job.store, path.parent.name, job.keep_last, job.keep_best, protected)
    except Exception as exc:  # noqa: BLE001 - the new checkpoint is uploaded: a failed cleanup must not undo that
        warnings.warn(
            f"{job.store.url}: retention failed ({exc}); old checkpoints were kept", CheckpointWarning, stacklevel=2
        )
        deleted = []
    return {"uploaded": url, "upload_s": upload_s, "upload_attempts": attempt + 1, "store_deleted": deleted}
