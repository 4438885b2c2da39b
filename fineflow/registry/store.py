"""The model registry on disk: candidate ids, stored candidates, the champion directory and alias, and the
append-only, hash-chained promotion log, with the lock every writer holds.

The registry (``models/registry``, DVC-tracked, persist)::

    candidates/<id>/          every candidate evaluated, by id (short sha256 of its adapter files):
                              the adapter (or full model) files + record.json (metrics, samples, eval data
                              hash, decision, deterministic lineage)
    champion.json             the alias: {"id", "seq" (the log entry that installed it), "files_sha256" (the
                              installed champion directory's content hash)}
    promotions.jsonl          append-only; each entry carries the sha256 of the previous line (and, with
                              FINEFLOW_REGISTRY_KEY set, an HMAC of itself)
    HEAD                      sha256 of the last line (so editing the last entry is detectable too)

and beside it (not in it: any file inside a DVC output changes the output's hash) ``.registry.lock``, the
flock every write holds, so promote and rollback never interleave.

The log is the record of what was decided; a write goes: candidate stored, log entry appended (durable once
its newline is), champion directory swapped in (one atomic exchange), alias set. A writer that dies midway
leaves a state ``verify_log`` names and the next writer finishes (``repair_log`` here for the log's tail and
HEAD, ``fineflow.registry.champion.recover`` for the champion and alias). ``verify_log`` is what
``fineflow registry verify`` runs.

What the chain shows: an accidental edit, truncation or reordering of the log. It does not stop someone who
edits a line on purpose and recomputes the hashes after it; with the HMAC key set (kept away from the
registry's writers-by-hand), such an edit fails ``verify_log(key=...)`` too.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import hmac
import json
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fineflow.core.errors import FineflowError
from fineflow.core.reports import sha256_file, write_json_atomic, write_text_atomic

CHAMPION_FILE = "champion.json"
LOG_FILE = "promotions.jsonl"
HEAD_FILE = "HEAD"
RECORD_FILE = "record.json"
ID_LEN = 16
KEY_VAR = "FINEFLOW_REGISTRY_KEY"  # the HMAC key of keyed mode, from the environment only
CHAMPION_DECISIONS = ("promoted", "rollback")  # the log entries that install a champion
CARD_FILE = "README.md"  # the model card: carries run timings, DVC ignores it, so it is not evidence
# a candidate id or a prefix of one: hex only, so a user's --to can never name a path (../x) or a glob pattern (*)
# below candidates/
_ID = re.compile(rf"[0-9a-f]{{1,{ID_LEN}}}")


# ---- ids -----------------------------------------------------------------------------------------


def directory_hash(path: Path, exclude: tuple[str, ...] = ()) -> str:
    """sha256 over the relative names and bytes of every file below path (sorted): a content id."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.name not in exclude):
        digest.update(str(file.relative_to(path)).encode() + b"\0")
        digest.update(bytes.fromhex(sha256_file(file)))
    return digest.hexdigest()


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
    if dest.is_dir():  # the same adapter evaluated again: files are identical by construction
        write_json_atomic(dest / RECORD_FILE, record)
        return dest
    shutil.copytree(adapter_dir, staging)
    write_json_atomic(staging / RECORD_FILE, record)
    os.replace(staging, dest)
    return dest


# ---- the champion: its directory and the registry's alias ----------------------------------------


def read_alias(registry_dir: Path) -> dict | None:
    """The registry's champion alias ({"id", "seq", "files_sha256"}), or None when nothing was promoted yet."""
    alias = registry_dir / CHAMPION_FILE
    return json.loads(alias.read_text(encoding="utf-8")) if alias.is_file() else None


def alias_id(registry_dir: Path) -> str | None:
    """The id the registry's champion alias names, or None when nothing was promoted yet."""
    return (read_alias(registry_dir) or {}).get("id")


def set_alias(registry_dir: Path, cid: str, seq: int, files_sha256: str | None = None) -> None:
    """Point the alias at champion cid, installed by log entry seq, whose directory hashes to files_sha256."""
    alias = {"id": cid, "seq": seq}
    if files_sha256:
        alias["files_sha256"] = files_sha256
    write_json_atomic(registry_dir / CHAMPION_FILE, alias)


def champion_files_hash(champion_dir: Path) -> str:
    """The installed champion's content hash, as the alias records it: every file but the model card."""
    return directory_hash(champion_dir, exclude=(CARD_FILE,))


def read_champion(champion_dir: Path) -> dict | None:
    """The installed champion's record (its metrics at promotion), or None when there is no champion yet."""
    try:
        record = json.loads((champion_dir / CHAMPION_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    return record if record.get("candidate_id") else None


def current_champion(registry_dir: Path) -> dict | None:
    """The champion the gate compares with, from the record of the candidate the alias names: {"id", "metrics"
    (flat), "samples", "eval_data_sha256", "base_digest"}; None when nothing was promoted yet."""
    cid = alias_id(registry_dir)
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


# ---- the promotion log ---------------------------------------------------------------------------


def _entry_hash(line: str) -> str:
    return hashlib.sha256(line.encode("utf-8")).hexdigest()


def entry_hmac(entry: dict, key: str) -> str:
    """HMAC-SHA256, under key, of the entry's canonical JSON without its own hmac field."""
    body = json.dumps({k: v for k, v in entry.items() if k != "hmac"}, sort_keys=True)
    return hmac.new(key.encode("utf-8"), body.encode("utf-8"), hashlib.sha256).hexdigest()


def registry_key() -> str | None:
    """The HMAC key of keyed mode (FINEFLOW_REGISTRY_KEY), or None: the log is then chained, not keyed."""
    return os.environ.get(KEY_VAR) or None


def append_log(registry_dir: Path, entry: dict) -> dict:
    """Append entry to the promotion log, chained to the previous entry by its sha256 (and keyed by an HMAC
    when FINEFLOW_REGISTRY_KEY is set), under the registry lock; HEAD follows, replaced atomically. The entry
    is committed once its line and newline are on disk."""
    with registry_lock(registry_dir):
        registry_dir.mkdir(parents=True, exist_ok=True)
        path = registry_dir / LOG_FILE
        data = path.read_text(encoding="utf-8") if path.exists() else ""
        if data and not data.endswith("\n"):
            raise FineflowError(
                f"{path}: the last line is half-written (a writer died mid-append); "
                "`fineflow registry repair` removes it (the next promote or rollback does too)"
            )
        lines = data.splitlines()
        full = {"seq": len(lines) + 1, "prev_sha256": _entry_hash(lines[-1]) if lines else None, **entry}
        key = registry_key()
        if key:
            full["hmac"] = entry_hmac(full, key)
        line = json.dumps(full, sort_keys=True)
        with path.open("a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        write_text_atomic(registry_dir / HEAD_FILE, _entry_hash(line) + "\n")
    return full


def read_log(registry_dir: Path) -> list[dict]:
    path = registry_dir / LOG_FILE
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []


def champion_history(registry_dir: Path) -> list[str]:
    """Candidate ids that were champion, oldest first, as the log's promoted/rollback entries say."""
    return [
        e["candidate_id"]
        for e in read_log(registry_dir)
        if e.get("decision") in CHAMPION_DECISIONS and e.get("candidate_id")
    ]


def last_champion_entry(registry_dir: Path) -> dict | None:
    """The log's last entry that installed a champion (promoted or rollback), or None: what the champion
    directory and the alias must agree with."""
    installs = [e for e in read_log(registry_dir) if e.get("decision") in CHAMPION_DECISIONS and e.get("candidate_id")]
    return installs[-1] if installs else None


def rollback_refusal(registry_dir: Path, cid: str) -> str | None:
    """Why the gate must not promote candidate cid, when a rollback replaced it as champion and nothing has
    installed it since (a deliberate `fineflow registry rollback --to <cid>` does); None otherwise. Without this
    a re-run of promote on the old scores would undo the rollback."""
    retired = None
    for entry in read_log(registry_dir):
        if entry.get("decision") == "rollback" and entry.get("champion_before") == cid:
            retired = entry
        elif entry.get("decision") in CHAMPION_DECISIONS and entry.get("candidate_id") == cid:
            retired = None
    if retired is None:
        return None
    return (
        f"candidate {cid} was rolled back by entry {retired['seq']} of the promotion log "
        f"({retired.get('reason') or 'rollback'}), so the gate does not promote it again: train a new candidate, "
        f"or reinstall this one deliberately with `fineflow registry rollback --to {cid}`"
    )


# ---- what a writer that died leaves in the log, and its repair --------------------------------------------


def _torn_tail(data: bytes) -> int | None:
    """Where the last line starts when it has no newline (its writer died mid-append), else None."""
    cut = data.rfind(b"\n") + 1
    return cut if cut < len(data) else None


def _head_behind(registry_dir: Path, lines: list[str]) -> bool:
    """HEAD names the entry before the last, and the last chains to it: the writer died after the log's fsync
    and before HEAD's rename. An edited last line leaves HEAD at the original line's hash instead."""
    head = registry_dir / HEAD_FILE
    if len(lines) < 2 or not head.exists() or head.read_text(encoding="utf-8").strip() != _entry_hash(lines[-2]):
        return False
    try:
        return json.loads(lines[-1]).get("prev_sha256") == _entry_hash(lines[-2])
    except (json.JSONDecodeError, AttributeError):
        return False


def repair_log(registry_dir: Path, log: Callable[[str], None] = print) -> list[str]:
    """Undo what a writer that died mid-append left, and say so: a last line without its newline is cut off
    (it was never committed: nothing was installed after it), and HEAD catches up with a last entry that was
    fully written. A complete line that breaks the chain is an edit: it is left for verify to name. Call under
    the registry lock."""
    path = registry_dir / LOG_FILE
    if not path.exists():
        return []
    done = []
    data = path.read_bytes()
    cut = _torn_tail(data)
    if cut is not None:
        with path.open("r+b") as fh:
            fh.truncate(cut)
            os.fsync(fh.fileno())
        torn = data[cut:].decode("utf-8", "replace")
        number = data.count(b"\n") + 1
        done.append(
            f"{path}:{number}: removed a half-written last entry ({len(data) - cut} bytes without a newline: a "
            f"writer died mid-append, so it was never committed): {torn[:200]}"
        )
    lines = path.read_text(encoding="utf-8").splitlines()
    head = registry_dir / HEAD_FILE
    if lines and (not head.exists() or _head_behind(registry_dir, lines)):
        write_text_atomic(head, _entry_hash(lines[-1]) + "\n")
        done.append(f"{head}: now names entry {len(lines)}, the last one (a writer died before updating it)")
    for message in done:
        log(message)
    return done


# ---- verify --------------------------------------------------------------------------------------------


def verify_log(registry_dir: Path, champion_dir: Path | None = None, key: str | None = None) -> list[str]:
    """Problems with the registry, first the first bad line of the chain; [] when it is intact.

    Checks: every line is JSON with seq = its line number and prev_sha256 = sha256 of the line before;
    HEAD (when present) is the sha256 of the last line; with key, every entry carries a valid HMAC; every
    stored candidate's files still hash to its id; the champion alias names a stored candidate and agrees
    with the log's last promotion or rollback; and (with champion_dir) the installed champion is that
    candidate: its champion.json, its adapter files and the content hash its install recorded."""
    path = registry_dir / LOG_FILE
    if not path.exists():
        return [f"{path}: no promotion log"]
    broken = _chain_problem(registry_dir, path)
    if broken:
        return [broken]
    return (
        (_hmac_problems(path, key) if key else [])
        + _changed_candidates(registry_dir)
        + _dangling_alias(registry_dir)
        + _champion_problems(registry_dir, champion_dir)
    )


REPAIRS = "the next promote or rollback repairs it, or `fineflow registry repair`"


def _chain_problem(registry_dir: Path, path: Path) -> str | None:
    """The first line that breaks the hash chain (or that HEAD disowns), or None. Stops there: every line
    after a broken one fails too, so naming them adds nothing."""
    data = path.read_bytes()
    lines = data.decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    previous = None
    for number, line in enumerate(lines, start=1):
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and _torn_tail(data) is not None:
                return f"{where}: half-written (no newline: a writer died mid-append); {REPAIRS}"
            return f"{where}: not valid JSON (the line was edited or truncated)"
        if not isinstance(entry, dict):
            return f"{where}: not a JSON object"
        expected = _entry_hash(previous) if previous is not None else None
        if entry.get("prev_sha256") != expected:
            return (
                f"{where}: prev_sha256 does not match the sha256 of line {number - 1} (line {number - 1} was "
                "edited, inserted or removed)"
                if number > 1
                else f"{where}: the first entry has a prev_sha256"
            )
        if entry.get("seq") != number:
            return f"{where}: seq {entry.get('seq')} != line number {number} (entries removed or reordered)"
        previous = line
    head = registry_dir / HEAD_FILE
    if head.exists() and previous is not None and head.read_text(encoding="utf-8").strip() != _entry_hash(previous):
        if _head_behind(registry_dir, lines):
            return f"{path}:{len(lines)}: {head} is one entry behind (a writer died after appending); {REPAIRS}"
        return f"{path}:{len(lines)}: the last entry does not match {head} (the last line was edited)"
    return None


def _hmac_problems(path: Path, key: str) -> list[str]:
    """The first entry whose HMAC does not match (an edit by someone without the key), and the entries that
    carry none (written without the key, or stripped of it); with the key set every entry must carry one."""
    unkeyed = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        entry = json.loads(line)
        if "hmac" not in entry:
            unkeyed.append(number)
        elif not hmac.compare_digest(str(entry["hmac"]), entry_hmac(entry, key)):
            return [
                f"{path}:{number}: the hmac does not match under {KEY_VAR} (the entry was edited by someone "
                "without the key, or the key is not the one it was written with)"
            ]
    if unkeyed:
        lines = ", ".join(map(str, unkeyed[:10])) + (", ..." if len(unkeyed) > 10 else "")
        return [
            f"{path}:{unkeyed[0]}: {len(unkeyed)} entries carry no hmac (lines {lines}): written while {KEY_VAR} "
            "was not set, or their hmac was removed (keyed mode vouches for a log keyed from its first entry)"
        ]
    return []


def _changed_candidates(registry_dir: Path) -> list[str]:
    root = registry_dir / "candidates"
    return [
        f"{cdir}: files no longer hash to the candidate id (changed after it was stored)"
        for cdir in (sorted(root.glob("*")) if root.is_dir() else [])
        if cdir.is_dir() and not cdir.name.startswith(".") and candidate_id(cdir) != cdir.name
    ]


def _dangling_alias(registry_dir: Path) -> list[str]:
    alias = registry_dir / CHAMPION_FILE
    cid = alias_id(registry_dir)
    if cid and not (registry_dir / "candidates" / cid).is_dir():
        return [f"{alias}: names champion {cid}, which is not in {registry_dir / 'candidates'}"]
    return []


def stored_candidate(registry_dir: Path, cid: str) -> Path | None:
    """candidates/<id> for an id the log names, or None when it is not stored (or not an id)."""
    try:
        return candidate_dir(registry_dir, cid)
    except FineflowError:
        return None


def _champion_problems(registry_dir: Path, champion_dir: Path | None) -> list[str]:
    """The alias and the installed champion against the log's last promotion or rollback. When that entry's
    candidate is no longer stored there is nothing to compare them with (an alias naming it is _dangling_alias's)."""
    last = last_champion_entry(registry_dir)
    alias = read_alias(registry_dir)
    if last is None:
        return [f"{registry_dir / CHAMPION_FILE}: names a champion the log never installed"] if alias else []
    cid, seq = last["candidate_id"], last["seq"]
    stored = stored_candidate(registry_dir, cid)
    if stored is None:
        return []
    problems = []
    alias_ok = bool(alias) and alias.get("id") == cid and alias.get("seq") == seq
    if not alias_ok:
        named = f"{alias.get('id')} (entry {alias.get('seq')})" if alias else "nothing"
        problems.append(
            f"{registry_dir / CHAMPION_FILE}: the champion alias names {named}, but entry {seq} of the log installs "
            f"{cid} (a writer died between the log append and the install); {REPAIRS}"
        )
    if champion_dir is not None:
        problems += _installed_problems(champion_dir, stored, seq, alias if alias_ok else None)
    return problems


def _installed_problems(champion_dir: Path, stored: Path, seq: int, alias: dict | None) -> list[str]:
    """The champion directory is the one entry seq installed: its champion.json, the stored candidate's
    files byte for byte, and (when the alias agrees with the log) the content hash recorded at the install."""
    cid = stored.name
    installed = read_champion(champion_dir)
    if installed is None or installed.get("candidate_id") != cid or installed.get("promotion_seq") != seq:
        holds = f"{installed['candidate_id']} (entry {installed.get('promotion_seq')})" if installed else "no champion"
        return [
            f"{champion_dir / CHAMPION_FILE}: {champion_dir} holds {holds}, but entry {seq} of the log installs "
            f"{cid}; {REPAIRS}"
        ]
    # the candidate's own README.md (PEFT writes one) is replaced by the champion's model card
    for file in sorted(p for p in stored.rglob("*") if p.is_file() and p.name not in (RECORD_FILE, CARD_FILE)):
        rel = file.relative_to(stored)
        mine = champion_dir / rel
        if not mine.is_file() or sha256_file(mine) != sha256_file(file):
            return [
                f"{mine}: differs from {stored.parent.name}/{cid}/{rel} (the champion was changed after its install)"
            ]
    recorded = (alias or {}).get("files_sha256")
    if recorded and champion_files_hash(champion_dir) != recorded:
        return [
            f"{champion_dir}: its files no longer hash to what entry {seq} installed (files_sha256 in the alias): "
            "a file was changed, added or removed after the install"
        ]
    return []
