"""The promotion log (``promotions.jsonl`` in the registry): append-only, each entry carrying the sha256 of
the line before it (and, with FINEFLOW_REGISTRY_KEY set, an HMAC of itself), with ``HEAD`` holding the sha256 of
the last line so that editing the last entry is detectable too. Here: appending under the registry lock, reading
and the questions asked of it, the repair of what a writer that died mid-append left, and the checks of its
chain and its HMACs (``verify.verify_log`` runs them first).

The log is the record of what was decided. What the chain shows: an accidental edit, truncation or reordering
of the log. It does not stop someone who edits a line on purpose and recomputes the hashes after it; with the
HMAC key set (kept away from the registry's writers-by-hand), such an edit fails ``verify_log(key=...)`` too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Callable
from pathlib import Path

from fineflow.core.errors import FineflowError
from fineflow.core.reports import write_text_atomic
from fineflow.registry.store import registry_lock

LOG_FILE = "promotions.jsonl"
HEAD_FILE = "HEAD"
KEY_VAR = "FINEFLOW_REGISTRY_KEY"  # the HMAC key of keyed mode, from the environment only
CHAMPION_DECISIONS = ("promoted", "rollback")  # the log entries that install a champion
REPAIRS = "the next promote or rollback repairs it, or `fineflow registry repair`"


# ---- appending and reading -----------------------------------------------------------------------


def entry_hash(line: str) -> str:
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
        full = {"seq": len(lines) + 1, "prev_sha256": entry_hash(lines[-1]) if lines else None, **entry}
        key = registry_key()
        if key:
            full["hmac"] = entry_hmac(full, key)
        line = json.dumps(full, sort_keys=True)
        with path.open("a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        write_text_atomic(registry_dir / HEAD_FILE, entry_hash(line) + "\n")
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


# ---- what a writer that died leaves in the log, and its repair -----------------------------------


def torn_tail(data: bytes) -> int | None:
    """Where the last line starts when it has no newline (its writer died mid-append), else None."""
    cut = data.rfind(b"\n") + 1
    return cut if cut < len(data) else None


def head_behind(registry_dir: Path, lines: list[str]) -> bool:
    """HEAD names the entry before the last, and the last chains to it: the writer died after the log's fsync
    and before HEAD's rename. An edited last line leaves HEAD at the original line's hash instead."""
    head = registry_dir / HEAD_FILE
    if len(lines) < 2 or not head.exists() or head.read_text(encoding="utf-8").strip() != entry_hash(lines[-2]):
        return False
    try:
        return json.loads(lines[-1]).get("prev_sha256") == entry_hash(lines[-2])
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
    cut = torn_tail(data)
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
    if lines and (not head.exists() or head_behind(registry_dir, lines)):
        write_text_atomic(head, entry_hash(lines[-1]) + "\n")
        done.append(f"{head}: now names entry {len(lines)}, the last one (a writer died before updating it)")
    for message in done:
        log(message)
    return done


# ---- the chain and the HMACs, checked ------------------------------------------------------------


def chain_problem(registry_dir: Path, path: Path) -> str | None:
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
            if number == len(lines) and torn_tail(data) is not None:
                return f"{where}: half-written (no newline: a writer died mid-append); {REPAIRS}"
            return f"{where}: not valid JSON (the line was edited or truncated)"
        if not isinstance(entry, dict):
            return f"{where}: not a JSON object"
        expected = entry_hash(previous) if previous is not None else None
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
    if head.exists() and previous is not None and head.read_text(encoding="utf-8").strip() != entry_hash(previous):
        if head_behind(registry_dir, lines):
            return f"{path}:{len(lines)}: {head} is one entry behind (a writer died after appending); {REPAIRS}"
        return f"{path}:{len(lines)}: the last entry does not match {head} (the last line was edited)"
    return None


def hmac_problems(path: Path, key: str) -> list[str]:
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
