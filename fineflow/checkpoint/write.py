"""Low-level durable writing: create a file, write it in chunks, fsync it, fsync a directory; publish a finished
directory under its final name atomically (publish_dir).

Every byte of a checkpoint goes through ``write_all``, and nothing else in the package calls os.write:
that single function is where tests inject faults (ENOSPC, slow writes), by replacing it: in process with
``monkeypatch.setattr(fineflow.checkpoint.write, "write_all", ...)``, in the processes a test starts with
tests/faults/sitecustomize.py. Callers look it up at call time (a module global), so a replacement takes
effect without any switch in production code.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from fineflow.checkpoint.format import CHUNK


def write_all(fd: int, data: memoryview, path: str) -> None:
    """Write all of data to fd. The one place a checkpoint byte is written, so a test that replaces this
    function controls every write (see the module docstring); path is the file being written, unused here
    but what a replacement picks its victim by (which step, which file)."""
    while len(data):
        written = os.write(fd, data)  # releases the GIL: a writer thread does not stall the training loop
        data = data[written:]


def _write_file(path: Path, chunks: Iterable) -> dict:
    """Create path, write the chunks, fsync; returns the manifest entry (sha256 of what was meant to be
    written, computed from memory, so verification compares the disk against the source)."""
    digest, size = hashlib.sha256(), 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                for start in range(0, len(view), CHUNK):
                    piece = view[start : start + CHUNK]
                    write_all(fd, piece, str(path))
                    digest.update(piece)
                    size += len(piece)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        exc.filename = exc.filename or str(path)  # os.write does not say which file: the message must
        raise
    return {"sha256": digest.hexdigest(), "size": size}


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a new file, a rename) durable; without it a crash can lose them."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename tmp to final atomically. Re-saving an existing step moves the old one aside first, so the
    rename never meets 'Directory not empty'; a crash between the renames is undone by clean_stale()."""
    aside = final.with_name(f".old-{final.name}")
    if final.exists():
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if aside.exists():
        shutil.rmtree(aside)
