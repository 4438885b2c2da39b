"""Checkpoints on an object store every node sees (``checkpoint.store``: s3://bucket/prefix, or any fsspec URL).

The local checkpoints directory stays the working copy. Each checkpoint the writer publishes there is also uploaded
to ``<store>/<run id>/step-N/`` by the same background writer (``upload_checkpoint``): every file of the manifest
first, then ``manifest.json``, then the ``COMPLETE`` marker, LAST. A reader only considers a step whose marker
exists, and uses it only after its download verifies (marker names the manifest's sha256, every file its size and
sha256, deep: tensors parse and are finite), so a torn upload (killed between the files and the marker) or a
corrupt object is never resumed from: it is skipped and an older one used (``fetch_newest``). Retention applies in
the store too (``apply_store_retention``: keep_last, keep_best, the checkpoint resumed from), deleting a step's marker
first so that a half-deleted step is invisible.

A resume (``fetch_for_resume``, on every node's local main process before rank 0 decides) downloads the store's
newest valid checkpoint into the run directory when it is newer than the newest valid one there, so that every node
loads the same step from its own disk. The client is fsspec's (s3fs for S3, with ``checkpoint.store_endpoint`` for
an S3-compatible store such as MinIO or Ceph; credentials from the usual AWS variables or ~/.aws files).
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

from fineflow.checkpoint.format import MANIFEST, MARKER, STEP_DIR, CheckpointWarning, CorruptCheckpoint
from fineflow.checkpoint.read import latest_valid, read_manifest, verify_checkpoint
from fineflow.checkpoint.retention import select_retained
from fineflow.checkpoint.write import publish_dir

STORE_ADVICE = (
    "Check checkpoint.store, checkpoint.store_endpoint and the credentials (AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, or ~/.aws)"
)


@dataclass(frozen=True)
class StoreConfig:
    """Where a run's checkpoints are uploaded: url (s3://bucket/prefix, or another fsspec URL) and, for an
    S3-compatible store, its endpoint URL. Picklable: it travels with a SaveJob to the writer process."""

    url: str
    endpoint: str | None = None

    def where(self, run: str, step_name: str = "") -> str:
        """The URL of a run's (or one of its steps') directory in the store, for messages."""
        return "/".join(part for part in (self.url.rstrip("/"), run, step_name) if part)


def store_config(settings) -> StoreConfig | None:
    """The params' CheckpointSettings as a StoreConfig, or None without checkpoint.store."""
    return StoreConfig(settings.store, settings.store_endpoint) if settings.store else None


def _filesystem(config: StoreConfig):
    """(fsspec filesystem, the store's root path in it), with no cached listing: another node may have written."""
    import fsspec

    options = {"endpoint_url": config.endpoint} if config.endpoint and config.url.startswith("s3") else {}
    fs, root = fsspec.core.url_to_fs(config.url, **options)
    fs.invalidate_cache()
    return fs, root.rstrip("/")


def upload_checkpoint(config: StoreConfig, local: Path) -> str:
    """Upload a published, verified checkpoint directory (<run id>/step-N) to the store; its marker last. A step
    already there (a re-save) loses its marker first, so a reader never pairs its old marker with new files.
    Returns the step's URL in the store. Raises what the client raises (the writer applies on_write_error)."""
    fs, root = _filesystem(config)
    target = f"{root}/{local.parent.name}/{local.name}"
    if fs.exists(f"{target}/{MARKER}"):
        fs.rm_file(f"{target}/{MARKER}")
    for name in read_manifest(local)["files"]:
        fs.put_file(str(local / name), f"{target}/{name}")
    fs.put_file(str(local / MANIFEST), f"{target}/{MANIFEST}")
    fs.put_file(str(local / MARKER), f"{target}/{MARKER}")  # last: from now on the step is visible
    return config.where(local.parent.name, local.name)


def _complete_steps(fs, run_path: str) -> list[tuple[int, str]]:
    """(step, path) of the run's steps in the store that carry a marker, newest first."""
    found = []
    for marker in fs.glob(f"{run_path}/step-*/{MARKER}"):
        step_path = marker.rsplit("/", 1)[0]
        match = STEP_DIR.match(step_path.rsplit("/", 1)[1])
        if match:
            found.append((int(match.group(1)), step_path))
    return sorted(found, reverse=True)


def _download(fs, remote: str, tmp: Path) -> None:
    """The step's marker and manifest first (they must agree before anything large is fetched), then its files."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in (MARKER, MANIFEST):
        fs.get_file(f"{remote}/{name}", str(tmp / name))
    for name in read_manifest(tmp)["files"]:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f"{remote}/{name}", str(tmp / name))


def fetch_newest(config: StoreConfig, run_dir: Path, newer_than: int = -1) -> Path | None:
    """Download the store's newest valid checkpoint of this run (run_dir's name) that is newer than step
    newer_than into run_dir, verified before it is renamed into place; a torn or corrupt one is skipped with a
    CheckpointWarning and an older one tried. Returns its local path, or None (nothing newer and valid)."""
    fs, root = _filesystem(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    for step, remote in _complete_steps(fs, f"{root}/{run_dir.name}"):
        if step <= newer_than:
            break
        name = Path(remote).name
        tmp = run_dir / f".tmp-fetch-{name}"  # a kill mid-download leaves a .tmp-: clean_stale removes it
        try:
            _download(fs, remote, tmp)
            verify_checkpoint(tmp, deep=True)
        except (CorruptCheckpoint, FileNotFoundError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            warnings.warn(f"{config.where(run_dir.name, name)}: {exc}; skipped", CheckpointWarning, stacklevel=2)
            continue
        publish_dir(tmp, run_dir / name)
        return run_dir / name
    return None


def apply_store_retention(
    config: StoreConfig, run: str, keep_last: int, keep_best: int, protected_steps: set[str]
) -> list[str]:
    """The local retention rule (select_retained) over the run's complete steps in the store; protected_steps:
    step directory names never deleted (the checkpoint resumed from). Deletes a step's marker first. Returns the
    deleted steps' URLs."""
    import json

    fs, root = _filesystem(config)
    entries = []
    for step, remote in _complete_steps(fs, f"{root}/{run}"):
        try:
            metric = json.loads(fs.cat_file(f"{remote}/{MANIFEST}")).get("metric")
        except (FileNotFoundError, ValueError):
            continue  # not a checkpoint this rule may judge: left alone, as locally
        entries.append((step, Path(remote), metric))
    protected = [str(path) for _, path, _ in entries if path.name in protected_steps]
    keep = select_retained(entries, keep_last, keep_best, protected)
    deleted = []
    for _, path, _ in entries:
        if path not in keep:
            fs.rm_file(f"{path.as_posix()}/{MARKER}")
            fs.rm(path.as_posix(), recursive=True)
            deleted.append(config.where(run, path.name))
    return deleted


def mark_run_finished(config: StoreConfig | None, run_dir: Path, marker: str) -> None:
    """Rank 0, after the run's model was saved: run_dir's finished marker goes to the store too, so that a later
    run of the same inputs on any node trains again instead of resuming (the local rule, fineflow.train.resume). A
    failure warns: the model is saved."""
    if config is None:
        return
    try:
        fs, root = _filesystem(config)
        fs.put_file(str(run_dir / marker), f"{root}/{run_dir.name}/{marker}")
    except Exception as exc:  # noqa: BLE001 - the client's errors; the training is done
        said = f"{config.where(run_dir.name)}: the run was not marked finished ({exc})"
        warnings.warn(said, CheckpointWarning, stacklevel=2)


def _remove_run(fs, run_path: str, marker: str) -> None:
    """A run's directory in the store deleted, its finished marker last (a crash midway leaves it finished)."""
    for _, step_path in _complete_steps(fs, run_path):
        fs.rm_file(f"{step_path}/{MARKER}")
    keys = [key for key in fs.find(run_path) if not key.endswith(f"/{marker}")]
    if keys:
        fs.rm(keys)
    if fs.exists(f"{run_path}/{marker}"):
        fs.rm_file(f"{run_path}/{marker}")


def _sync_for_resume(config: StoreConfig, run_dir: Path, marker: str, fresh: bool, main: bool) -> None:
    """One node's part of fetch_for_resume: a run that starts over (fresh, or finished here or in the store) has its
    store copy deleted by rank 0 (main) and nothing fetched; otherwise the store's newest valid checkpoint is
    downloaded when it is newer than run_dir's own newest valid one."""
    fs, root = _filesystem(config)
    run_path = f"{root}/{run_dir.name}"
    if fresh or (run_dir / marker).exists() or fs.exists(f"{run_path}/{marker}"):
        if main:
            _remove_run(fs, run_path, marker)
        return
    local = latest_valid(run_dir) if run_dir.is_dir() else None
    newest = fetch_newest(config, run_dir, read_manifest(local)["step"] if local else -1)
    if newest is not None:
        print(f"checkpoint.store: downloaded {config.where(run_dir.name, newest.name)} to {newest}", flush=True)


def fetch_for_resume(
    accelerator, run_dir: Path, config: StoreConfig | None, finished_marker: str, fresh: bool = False
) -> None:
    """Before rank 0 decides where to resume: each node's local main process downloads the store's newest valid
    checkpoint into run_dir when it is newer than run_dir's own newest valid one (every node then sees the same
    step on its own disk). A run that starts over (fresh: train.resume never; or finished_marker in run_dir or in
    the store) fetches nothing, and rank 0 deletes its copy in the store. A failure on any node is raised on every
    rank (one rank failing alone would leave the others waiting)."""
    from fineflow.checkpoint.format import CheckpointError

    if config is None:
        return
    problem = None
    if accelerator.is_local_main_process:
        try:
            _sync_for_resume(config, run_dir, finished_marker, fresh, accelerator.is_main_process)
        except Exception as exc:  # noqa: BLE001 - the client's errors: said on every rank, below
            problem = f"{type(exc).__name__}: {exc}"
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        problems = [p for p in gather_object([problem]) if p]
        accelerator.wait_for_everyone()
    else:
        problems = [problem] if problem else []
    if problems:
        raise CheckpointError(
            f"checkpoint.store {config.url}: the checkpoints of this run ({run_dir.name}) could not be read: "
            f"{problems[0]}. {STORE_ADVICE}"
        )
