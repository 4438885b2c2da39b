"""The model registry on disk: candidate ids, stored candidates, the champion alias, and the lock every writer
holds. The registry (``models/registry``, DVC-tracked, persist)::

    candidates/<id>/          every candidate evaluated, by id (short sha256 of its adapter files):
                              the adapter (or full model) files + record.json (metrics, samples, eval data
                              hash, decision, deterministic lineage)
    champion.json             the alias: {"id", "seq" (the log entry that installed it), "files_sha256" (the
                              installed champion directory's content hash, but the card's: what verify checks a
                              champion installed by an entry without champion_files against)}
    champion.<kind>.json      the alias of another kind of model's champion (fineflow.objectives: model_kind; the
    champions/<kind>/         reward model's), installed here: a champion per kind, each candidate judged
                              against its own kind's (record.json, the log entry and champion.json say the kind)
    promotions.jsonl, HEAD    the hash-chained promotion log (an entry that installs a champion records each of
                              its files' sha256: champion_files) and its length and last line's hash
                              (promotion_log.py)

and beside it (not in it: any file inside a DVC output changes the output's hash) ``.registry.lock``, the
flock every write holds, so promote and rollback never interleave.

A write goes: candidate stored (here), log entry appended (durable once its newline is: promotion_log.py),
champion directory swapped in (one atomic exchange: install.py), alias set (here). A writer that dies midway
leaves a state ``verify.verify_log`` names and the next writer finishes (``promotion_log.repair_log`` for the
log's tail and HEAD, ``fineflow.registry.champion.recover`` for the champion and alias).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fineflow.core.reports import sha256_file, write_json_atomic
from fineflow.errors import FineflowError
from fineflow.objectives.interface import LANGUAGE_MODEL

CHAMPION_FILE = "champion.json"  # the registry's alias, and the installed champion's own record
RECORD_FILE = "record.json"
ID_LEN = 16
CARD_FILE = "README.md"  # the model card: carries run timings, so DVC ignores it; the log entry binds it
# a candidate id or a prefix of one: hex only, so a user's --to can never name a path (../x) or a glob pattern (*)
# below candidates/
_ID = re.compile(rf"[0-9a-f]{{1,{ID_LEN}}}")


# ---- ids -----------------------------------------------------------------------------------------


def file_hashes(directory: Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """{relative path: sha256} of every file below directory, skipping names in exclude, in path order (the order
    a content id hashes them in)."""
    return {
        str(p.relative_to(directory)): sha256_file(p)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name not in exclude
    }


def files_digest(files: dict[str, str]) -> str:
    """The content id of {relative path: sha256} (file_hashes's): sha256 over each name and its file's hash."""
    digest = hashlib.sha256()
    for name, sha in files.items():
        digest.update(name.encode() + b"\0")
        digest.update(bytes.fromhex(sha))
    return digest.hexdigest()


def directory_hash(path: Path, exclude: tuple[str, ...] = ()) -> str:
    """sha256 over the relative names and bytes of every file below path (sorted): a content id."""
    return files_digest(file_hashes(path, exclude))


def candidate_id(adapter_dir: Path) -> str:
    """The short content id of an adapter (or full model) directory."""
    return directory_hash(adapter_dir, exclude=(RECORD_FILE,))[:ID_LEN]


def check_id(cid: str) -> str:
    """cid, when it is a registry id (or a prefix of one); a FineflowError naming it otherwise."""
    if not isinstance(cid, str) or not _ID.fullmatch(cid):
        raise FineflowError(
            f"{cid!r}: not a registry id (lowercase hex digits: a candidate id as `fineflow registry list` "
            "prints it, or a unique prefix of one)"
        )
    return cid


# ---- the lock every registry write holds ---------------------------------------------------------


def lock_path(registry_dir: Path) -> Path:
    """The registry's lock file: beside the registry directory, not inside it (the registry is a DVC output,
    and a file inside it would change the output's hash; one that DVC's checkout could delete while it is
    held would let a second writer in)."""
    registry_dir = Path(os.path.abspath(registry_dir))
    return registry_dir.parent / f".{registry_dir.name}.lock"


class _Held:
    """This process's hold on one lock file: the open file whose flock is held, how deep the holder's nested
    registry_lock calls are, and a thread lock so that one thread at a time is that holder."""

    def __init__(self) -> None:
        self.thread_lock = threading.RLock()
        self.depth = 0
        self.file = None


_HELD: dict[str, _Held] = {}
_HELD_GUARD = threading.Lock()


def _forget_held() -> None:
    """In a forked child: it holds nothing, whatever its parent held when it forked; it takes the lock anew."""
    global _HELD_GUARD
    _HELD.clear()
    _HELD_GUARD = threading.Lock()


os.register_at_fork(after_in_child=_forget_held)


@contextmanager
def registry_lock(registry_dir: Path) -> Iterator[None]:
    """Hold the registry's exclusive lock (flock, waiting for it) for a write: a promotion or a rollback from
    its reading of the champion to its alias, or one log append. Reentrant in the process that holds it, so
    promote can hold it around the append_log that takes it too. The kernel releases it when the holder dies."""
    path = lock_path(registry_dir)
    with _HELD_GUARD:
        held = _HELD.setdefault(str(path), _Held())
    with held.thread_lock:
        if held.depth == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            held.file = open(path, "a")  # never written: only its lock matters
            fcntl.flock(held.file, fcntl.LOCK_EX)
        held.depth += 1
        try:
            yield
        finally:
            held.depth -= 1
            if held.depth == 0:
                fcntl.flock(held.file, fcntl.LOCK_UN)
                held.file.close()
                held.file = None


# ---- candidates ----------------------------------------------------------------------------------


def candidate_dir(registry_dir: Path, cid: str) -> Path:
    """candidates/<id>; a unique prefix of an id is accepted (and only an id: see check_id)."""
    root = registry_dir / "candidates"
    exact = root / check_id(cid)
    if exact.is_dir():
        return exact
    matches = (
        sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name.startswith(cid))
        if root.is_dir()
        else []
    )
    if len(matches) == 1:
        return matches[0]
    raise FineflowError(f"{root}: no single candidate with id {cid!r} ({len(matches)} match)")


def read_record(registry_dir: Path, cid: str) -> dict:
    path = candidate_dir(registry_dir, cid) / RECORD_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise FineflowError(f"{path}: cannot read the candidate record ({exc})") from None


def stored_records(registry_dir: Path) -> list[tuple[str, dict]]:
    """(id, record) of every stored candidate, by id; half-stored ones (staging, no record) are skipped."""
    root = registry_dir / "candidates"
    out = []
    for cdir in sorted(root.iterdir()) if root.is_dir() else []:
        if cdir.name.startswith(".") or not (cdir / RECORD_FILE).is_file():
            continue
        out.append((cdir.name, json.loads((cdir / RECORD_FILE).read_text(encoding="utf-8"))))
    return out


def store_candidate(registry_dir: Path, adapter_dir: Path, cid: str, record: dict) -> Path:
    """Keep the candidate's files and record under candidates/<id> (assembled aside, renamed in)."""
    dest = registry_dir / "candidates" / cid
    staging = dest.with_name(f".{cid}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    if dest.is_dir():  # the same adapter evaluated again: files are identical by construction, unless changed
        write_json_atomic(intact_candidate(dest) / RECORD_FILE, record)
        return dest
    shutil.copytree(adapter_dir, staging)
    write_json_atomic(staging / RECORD_FILE, record)
    os.replace(staging, dest)
    return dest


def intact_candidate(cdir: Path) -> Path:
    """cdir, when its files still hash to its id; a FineflowError otherwise. What a champion is built from: a
    keyed log entry must never record files someone changed in the registry."""
    if candidate_id(cdir) != cdir.name:
        raise FineflowError(
            f"{cdir}: files no longer hash to the candidate id (changed after it was stored); restore them "
            "(`dvc checkout models/registry`) or remove the directory, then try again"
        )
    return cdir


def stored_candidate(registry_dir: Path, cid: str) -> Path | None:
    """candidates/<id> for an id the log names, or None when it is not stored (or not an id)."""
    try:
        return candidate_dir(registry_dir, cid)
    except FineflowError:
        return None


# ---- the champion alias, one per kind of model -----------------------------------------------------
# A language model's champion is the one it always was (champion.json, installed at models/champion); another kind
# (Objective.model_kind) has its own alias and directory in the registry, so a candidate never replaces, nor is
# judged against, a champion of another kind. Records, log entries and champion.json of a language model carry no
# kind (as before kinds), another kind's say theirs (model_kind).


def record_kind(record: dict) -> str:
    """The kind of model a candidate record, log entry or champion.json is of (none said: a language model)."""
    return record.get("model_kind") or LANGUAGE_MODEL


def kind_field(kind: str) -> dict:
    """What a record, log entry or champion.json says of its kind: nothing for a language model."""
    return {} if kind == LANGUAGE_MODEL else {"model_kind": kind}


def alias_path(registry_dir: Path, kind: str = LANGUAGE_MODEL) -> Path:
    return registry_dir / (CHAMPION_FILE if kind == LANGUAGE_MODEL else f"champion.{kind}.json")


def kind_champion_dir(registry_dir: Path, kind: str) -> Path:
    """Where the champion of a kind other than the language models' is installed: champions/<kind>."""
    return registry_dir / "champions" / kind


def read_alias(registry_dir: Path, kind: str = LANGUAGE_MODEL) -> dict | None:
    """The kind's champion alias ({"id", "seq", "files_sha256"}), or None when none of it was promoted yet."""
    alias = alias_path(registry_dir, kind)
    return json.loads(alias.read_text(encoding="utf-8")) if alias.is_file() else None


def alias_id(registry_dir: Path, kind: str = LANGUAGE_MODEL) -> str | None:
    """The id the kind's champion alias names, or None when none of it was promoted yet."""
    return (read_alias(registry_dir, kind) or {}).get("id")


def set_alias(
    registry_dir: Path, cid: str, seq: int, files_sha256: str | None = None, kind: str = LANGUAGE_MODEL
) -> None:
    """Point the kind's alias at champion cid, installed by log entry seq, whose directory hashes to files_sha256."""
    alias = {"id": cid, "seq": seq}
    if files_sha256:
        alias["files_sha256"] = files_sha256
    write_json_atomic(alias_path(registry_dir, kind), alias)


def current_champion(registry_dir: Path, kind: str = LANGUAGE_MODEL) -> dict | None:
    """The champion the gate compares a candidate of this kind with, from the record of the candidate the kind's
    alias names: {"id", "metrics" (flat), "samples", "eval_data_sha256", "base_digest"}; None when none yet."""
    cid = alias_id(registry_dir, kind)
    if not cid:
        return None
    record = read_record(registry_dir, cid)
    return {
        "id": cid,
        "metrics": record.get("metrics") or {},
        "samples": record.get("samples"),
        "eval_data_sha256": record.get("eval_data_sha256"),
        "base_digest": record.get("base_digest"),
    }
