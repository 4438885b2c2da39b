"""The champion directory (``models/champion``): its record (champion.json), its content hash and per-file
manifest (what the log entry that installs it records), and its install: assembled in a staging sibling, then
swapped in with one atomic exchange. What writers that died left beside it is cleared here too. What goes into
the directory is ``fineflow.registry.champion``'s."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import sys
from pathlib import Path

from fineflow.core.reports import sha256_file
from fineflow.registry.card import card_digest
from fineflow.registry.store import CARD_FILE, CHAMPION_FILE, directory_hash


def champion_files_hash(champion_dir: Path) -> str:
    """The installed champion's content hash, as the alias records it: every file but the model card (what
    verify checks a champion installed by a log entry without champion_files against, unkeyed only)."""
    return directory_hash(champion_dir, exclude=(CARD_FILE,))


def champion_manifest(champion_dir: Path) -> dict[str, str]:
    """{relative path: sha256} of every file in the champion directory, model card and champion.json included:
    what the log entry that installs it records (its champion_files), so a keyed entry binds all that is served.
    The card's is card_digest: every line but its run figures, so the registry stays a function of the inputs."""
    files = sorted(p for p in champion_dir.rglob("*") if p.is_file())
    return {str(p.relative_to(champion_dir)): _file_digest(champion_dir, p) for p in files}


def _file_digest(champion_dir: Path, path: Path) -> str:
    if path == champion_dir / CARD_FILE:
        return card_digest(path.read_text(encoding="utf-8", errors="replace"))
    return sha256_file(path)


def read_champion(champion_dir: Path) -> dict | None:
    """The installed champion's record (its metrics at promotion), or None when there is no champion yet."""
    try:
        record = json.loads((champion_dir / CHAMPION_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    return record if record.get("candidate_id") else None


def staging_dir(champion_dir: Path) -> Path:
    """An empty sibling of champion_dir to assemble the next champion in (on the same filesystem, so the
    swap is a rename)."""
    staging = champion_dir.with_name(f".{champion_dir.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def swap_in(staging: Path, champion_dir: Path) -> None:
    """Make the complete staging dir the champion. One atomic exchange of the two directories (Linux
    renameat2 RENAME_EXCHANGE): champion_dir names a whole champion at every moment, the old one or the new;
    the old one, now at the staging path, is removed after. Where the filesystem cannot exchange, two renames,
    with a moment between them when there is no champion directory; a writer that dies there leaves a state the
    next one repairs (fineflow.registry.champion.recover rebuilds the champion the log names)."""
    if not champion_dir.exists():
        os.replace(staging, champion_dir)
        return
    try:
        _exchange(staging, champion_dir)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        _two_renames(staging, champion_dir)
        return
    shutil.rmtree(staging)  # the old champion


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100  # linux/fcntl.h


def _exchange(a: Path, b: Path) -> None:
    """Swap the names a and b atomically, or an OSError (ENOSYS where there is no renameat2)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available here")
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))


def _two_renames(staging: Path, champion_dir: Path) -> None:
    retired = champion_dir.with_name(f".{champion_dir.name}.retired")
    shutil.rmtree(retired, ignore_errors=True)
    os.replace(champion_dir, retired)
    os.replace(staging, champion_dir)
    shutil.rmtree(retired, ignore_errors=True)


def clear_leftovers(champion_dir: Path, registry_dir: Path) -> list[Path]:
    """Remove what writers that died left beside the champion and in the registry (a staged champion, a retired
    one, a half-stored candidate, a temporary HEAD); only under the registry lock, when no writer is running."""
    found = [champion_dir.with_name(f".{champion_dir.name}.{kind}") for kind in ("staging", "retired")]
    found += list((registry_dir / "candidates").glob(".*.staging")) + list(registry_dir.glob(".*.tmp"))
    found += list(registry_dir.glob("candidates/*/.*.tmp"))  # a record.json being rewritten
    found = [p for p in found if p.exists()]
    for path in found:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return found


def ensure_empty_champion(champion_dir: Path) -> None:
    """Before the first promotion the champion path still exists (DVC tracks it), holding a null record."""
    champion_dir.mkdir(parents=True, exist_ok=True)
    if not (champion_dir / CHAMPION_FILE).exists():
        (champion_dir / CHAMPION_FILE).write_text(json.dumps({"candidate_id": None}) + "\n", encoding="utf-8")
