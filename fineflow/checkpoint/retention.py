"""Which checkpoints stay on disk: keep_last / keep_best / protected retention after each save, and the
startup cleanup of what an interrupted save or delete left behind (.tmp-, .trash-, .old- directories)."""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path

from fineflow.checkpoint.format import CheckpointWarning, CorruptCheckpoint, _step_dirs
from fineflow.checkpoint.read import read_manifest
from fineflow.checkpoint.write import fsync_dir


def _remove(path: Path) -> None:
    """Rename away first (atomic), then delete: a crash mid-delete leaves a .trash- dir, never a
    half-deleted step directory that looks like a checkpoint."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def select_retained(
    entries: list[tuple[int, Path, float | None]], keep_last: int, keep_best: int, protected: Iterable[str]
) -> set[Path]:
    """Which complete checkpoints to keep: the last keep_last by step, the best keep_best by metric
    (lower is better; the single best is always kept when any has a metric) and every protected one."""
    by_step = sorted(entries, key=lambda e: e[0], reverse=True)
    keep = {path for _, path, _ in by_step[:keep_last]}
    scored = sorted((e for e in entries if e[2] is not None), key=lambda e: (e[2], -e[0]))
    keep |= {path for _, path, _ in scored[: max(1, keep_best)]}
    protected = {Path(p).resolve() for p in protected}
    keep |= {path for _, path, _ in entries if path.resolve() in protected}
    return keep


def apply_retention(root: Path, keep_last: int, keep_best: int, protected: Iterable[str] = ()) -> list[Path]:
    """Delete complete checkpoints that select_retained does not keep; returns what was deleted.
    Directories without a valid marker are left alone (they are not counted, and not ours to judge)."""
    entries = []
    for step, path in _step_dirs(Path(root)):
        try:
            entries.append((step, path, read_manifest(path).get("metric")))
        except CorruptCheckpoint:
            continue
    keep = select_retained(entries, keep_last, keep_best, protected)
    deleted = []
    for _, path, _ in entries:
        if path not in keep:
            try:
                _remove(path)
                deleted.append(path)
            except OSError as exc:
                warnings.warn(f"{path}: could not delete an old checkpoint ({exc})", CheckpointWarning, stacklevel=2)
    return deleted


def clean_stale(root: Path) -> list[str]:
    """Remove what an interrupted save or delete left behind; returns the names handled.

    .tmp-* (a save that never published) and .trash-* (a delete that never finished) are removed.
    .old-step-N is a published checkpoint moved aside for a re-save of step N: if the re-save never
    landed it is renamed back, otherwise removed.
    """
    handled = []
    for path in sorted(Path(root).iterdir()):
        if path.name.startswith((".tmp-", ".trash-")):
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.startswith(".old-"):
            final = path.with_name(path.name[len(".old-") :])
            if final.exists():
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.rename(path, final)
        else:
            continue
        handled.append(path.name)
    if handled:
        fsync_dir(Path(root))
    return handled
