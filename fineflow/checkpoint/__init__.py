"""Checkpoints you can trust: asynchronous, atomic, verified, and exactly resumable after kill -9.

One checkpoint is a directory ``<root>/step-0000123/``::

    model.safetensors        the trainable tensors only (for LoRA the adapter, never the frozen base)
    optimizer.json           the optimizer state_dict's structure (param groups, which tensor goes where)
    optimizer.safetensors    ... and its tensors (exp_avg, exp_avg_sq, step counters stay tensors)
    scheduler.json           the LR scheduler's state_dict (plain numbers; lambdas are not state)
    state.json               the caller's loop state: step, epoch, sampler position, counters, fingerprint
    rng.json, rng.safetensors  Python, NumPy and torch (CPU + CUDA) RNG states, one snapshot per rank
    grad_scaler.json         optional: the AMP GradScaler's state
    manifest.json            sha256 and size of every file above, the step and the metric
    COMPLETE                 written last; holds the manifest's sha256

A sharded checkpoint (FSDP: ``"layout": "sharded"`` in the manifest) has no model.safetensors and no
optimizer.* files: each rank writes its own shards of the trainable tensors and the optimizer state through
torch's distributed checkpoint into ``sharded/`` (``__<rank>_0.distcp`` plus DCP's ``.metadata``), and the
manifest hashes those files like the others. Every rank reads its own shards back; a resume needs the same
world size (it is part of the run's fingerprint) and a checkpoint directory every rank can see.

Nothing is pickled: tensors go to safetensors and everything else to JSON, with small tags for what plain
JSON cannot say (tuples, integer dict keys, non-finite floats, numpy arrays) so that a state_dict comes
back with exactly the types ``load_state_dict`` expects. A checkpoint without a manifest and a marker that
agree, or whose files do not hash to the manifest, is never used.

Saving (``CheckpointManager.save``) blocks only while the state is copied into a reusable host buffer (for
the process backend, shared memory); writing, fsync, verification and the atomic rename happen in the
background, one save at a time. Typical use from a training loop::

    manager = CheckpointManager("checkpoints", keep_last=2, keep_best=1)
    path = manager.latest_valid(expected_fingerprint=fingerprint)
    if path is not None:
        ckpt = manager.load(path)
        manager.protect(path)
        ...  # load ckpt.model_tensors, ckpt.optimizer_state_dict, ...; restore_rng(ckpt.rng_snapshots[rank])
    for step in ...:
        ...
        manager.check()   # every step: a background save that failed (disk full) raises now, not at the next save
        manager.save(step, trainable, optimizer.state_dict(), scheduler.state_dict(), state, rngs, metric)
    manager.close()   # waits for the last save and raises its error, if any

One manager writes to a root at a time (rank 0); it cleans stale temporary directories when created.

On nodes that share no filesystem, ``checkpoint.store`` (s3://bucket/prefix) keeps a copy every node can read:
the writer uploads each published checkpoint there (its files, then the manifest, then the marker), and a resume
downloads the newest one that verifies (``fineflow.checkpoint.remote_store``).

Where things are (each file answers one question; imports only go down this list)::

    format.py     what is on disk: names, format version, errors, state_dict <-> JSON tree + named tensors,
                  safetensors headers and layout, which parts go to which files
    snapshot.py   what a save hands to the writer: the host arena's layout, copying tensors into it, SaveJob
    write.py      how bytes reach the disk durably: write_all (every checkpoint byte; tests replace it to
                  inject faults), one file with fsync, fsync of a directory
    read.py       whether a checkpoint can be trusted and what it holds: manifest, verification,
                  latest_valid (with the fingerprint check), load_checkpoint
    retention.py  which checkpoints stay: keep_last / keep_best / protected, startup cleanup
    remote_store.py checkpoint.store, an object store every node sees: upload (marker last), the newest
                  valid one downloaded for a resume, retention there
    publish.py    one save end to end: temp dir -> files -> manifest -> marker -> verify -> rename -> retention
                  (-> upload to the store)
    rng.py        the RNG states a resume must restore
    manager.py    CheckpointManager: snapshot, then the background writer (thread or process), one at a time

This module re-exports the public names. Names with a leading underscore are private to the package
(shared between its files, not for callers). ``write_all`` is deliberately not re-exported: a test must
replace it where it is looked up, ``fineflow.checkpoint.write.write_all``.
"""

from fineflow.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MARKER,
    REQUIRED_FILES,
    SHARDED_DIR,
    STEP_DIR,
    CheckpointError,
    CheckpointWarning,
    CorruptCheckpoint,
    from_tree,
    step_dir_name,
    to_tree,
)
from fineflow.checkpoint.manager import CheckpointManager
from fineflow.checkpoint.publish import newest_complete, run_job
from fineflow.checkpoint.read import (
    LoadedCheckpoint,
    all_finite,
    latest_valid,
    load_checkpoint,
    read_manifest,
    verify_checkpoint,
)
from fineflow.checkpoint.remote_store import (
    StoreConfig,
    apply_store_retention,
    fetch_newest,
    store_config,
    upload_checkpoint,
)
from fineflow.checkpoint.retention import apply_retention, clean_stale, select_retained
from fineflow.checkpoint.rng import capture_rng, restore_rng

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "MARKER",
    "REQUIRED_FILES",
    "SHARDED_DIR",
    "STEP_DIR",
    "CheckpointError",
    "CheckpointWarning",
    "CorruptCheckpoint",
    "from_tree",
    "step_dir_name",
    "to_tree",
    "CheckpointManager",
    "newest_complete",
    "run_job",
    "LoadedCheckpoint",
    "all_finite",
    "latest_valid",
    "load_checkpoint",
    "read_manifest",
    "verify_checkpoint",
    "apply_retention",
    "clean_stale",
    "select_retained",
    "capture_rng",
    "restore_rng",
    "StoreConfig",
    "apply_store_retention",
    "fetch_newest",
    "store_config",
    "upload_checkpoint",
]
