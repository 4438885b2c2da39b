"""The promotion log (``promotions.jsonl`` in the registry): append-only, each entry carrying the sha256 of
the line before it (and, with FINEFLOW_REGISTRY_KEY set, an HMAC of itself), with ``HEAD`` holding the log's
entry count and the sha256 of its last line (keyed: and an HMAC over both), so that removing entries from the
end or editing the last one is detectable too. Here: appending under the registry lock, reading and the
questions asked of it, HEAD, the repair of what a writer that died mid-append left, and the checks of its chain
and its HMACs (``verify.verify_log`` runs them first).

The log is the record of what was decided. What the chain shows: an accidental edit, truncation or reordering
of the log. It does not stop someone who edits a line on purpose and recomputes the hashes after it; with the
HMAC key set (kept away from the registry's writers-by-hand), such an edit fails ``verify_log(key=...)`` too,
and so does a log cut short or a HEAD removed (keyed, HEAD must exist).

Crash safety of HEAD: an append writes and fsyncs the line, then replaces HEAD atomically (keyed, an empty
log gets a HEAD of count 0 first). A crash between leaves HEAD one entry behind a complete, chained (keyed:
HMAC-valid) last line: repair finishes it. HEAD ahead of the log, or naming another last line, is truncation or
an edit: left for verify. HEAD's old format (a bare sha256, before it carried a count) is still read; keyed mode
does not accept it (the same HEAD is what someone who cut the log short would write): ``fineflow registry repair
--seal-head`` re-keys a log a person has checked.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fineflow.core.reports import write_text_atomic
from fineflow.errors import FineflowError
from fineflow.objectives.interface import LANGUAGE_MODEL
from fineflow.registry.store import record_kind, registry_lock

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
    is committed once its line and newline are on disk. Refused when HEAD does not vouch for the log as it
    stands: appending would vouch for a truncated or edited log (verify names what is wrong)."""
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
        key = registry_key()
        disowned = head_problem(registry_dir, lines, head_key(registry_dir, key))
        if disowned:
            raise FineflowError(f"{disowned}; no entry is appended to a log its HEAD does not vouch for")
        if key and not lines:  # a keyed HEAD from the start: a crash after the first line leaves it one behind
            write_head(registry_dir, [], key)
        full = {"seq": len(lines) + 1, "prev_sha256": entry_hash(lines[-1]) if lines else None, **entry}
        if key:
            full["hmac"] = entry_hmac(full, key)
        line = json.dumps(full, sort_keys=True)
        with path.open("a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        write_head(registry_dir, [*lines, line], key)
    return full


def next_seq(registry_dir: Path) -> int:
    """The seq the next append gets (under the registry lock, nothing else appends before it)."""
    path = registry_dir / LOG_FILE
    return (path.read_bytes().count(b"\n") if path.exists() else 0) + 1


def read_log(registry_dir: Path) -> list[dict]:
    path = registry_dir / LOG_FILE
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []


def champion_history(registry_dir: Path, kind: str = LANGUAGE_MODEL) -> list[str]:
    """Candidate ids that were champion of this kind of model, oldest first, as the log's promoted/rollback
    entries say."""
    return [e["candidate_id"] for e in _installs(registry_dir) if record_kind(e) == kind]


def champion_kinds(registry_dir: Path) -> list[str]:
    """The kinds of model the log ever installed a champion of, the language models' first."""
    kinds = {record_kind(e) for e in _installs(registry_dir)} | {LANGUAGE_MODEL}
    return sorted(kinds, key=lambda kind: (kind != LANGUAGE_MODEL, kind))


def _installs(registry_dir: Path) -> list[dict]:
    return [e for e in read_log(registry_dir) if e.get("decision") in CHAMPION_DECISIONS and e.get("candidate_id")]


def gate_promoted(registry_dir: Path, cid: str) -> bool:
    """The gate promoted candidate cid at some point (a "promoted" entry names it)."""
    return any(e.get("decision") == "promoted" and e.get("candidate_id") == cid for e in read_log(registry_dir))


def last_champion_entry(registry_dir: Path, kind: str = LANGUAGE_MODEL) -> dict | None:
    """The log's last entry that installed a champion of this kind (promoted or rollback), or None: what the
    kind's champion directory and alias must agree with."""
    installs = [e for e in _installs(registry_dir) if record_kind(e) == kind]
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


# ---- HEAD: the log's length and last line, keyed ---------------------------------------------------------


@dataclass(frozen=True)
class Head:
    """What HEAD says: how many entries the log has (None in the old format, a bare sha256), the sha256 of its
    last line (None for an empty log), and (keyed mode) an HMAC over both."""

    count: int | None
    last_sha256: str | None
    hmac: str | None = None


def head_key(registry_dir: Path, key: str | None) -> str | None:
    """The key HEAD is checked with: FINEFLOW_REGISTRY_KEY, unless the log's first entry carries no hmac. Such a
    log is one keyed verify never vouches for (keyed mode needs a log keyed from its first entry), so its HEAD
    is checked as unkeyed: setting the key on an older unkeyed registry does not stop its promotions."""
    path = registry_dir / LOG_FILE
    if not key or not path.exists():
        return key
    with path.open("rb") as fh:
        first = fh.readline()
    try:
        return key if not first or "hmac" in json.loads(first) else None
    except (json.JSONDecodeError, TypeError):
        return key


def head_hmac(count: int, last_sha256: str | None, key: str) -> str:
    """HMAC-SHA256 over HEAD's count and last line hash (a body no log entry can have, so neither can stand
    in for the other)."""
    body = json.dumps({"head": {"count": count, "last_sha256": last_sha256}}, sort_keys=True)
    return hmac.new(key.encode("utf-8"), body.encode("utf-8"), hashlib.sha256).hexdigest()


def write_head(registry_dir: Path, lines: list[str], key: str | None) -> None:
    """HEAD for a log of these lines, replaced atomically: {"count", "last_sha256"} (+ "hmac" when keyed)."""
    last = entry_hash(lines[-1]) if lines else None
    head = {"count": len(lines), "last_sha256": last}
    if key:
        head["hmac"] = head_hmac(len(lines), last, key)
    write_text_atomic(registry_dir / HEAD_FILE, json.dumps(head, sort_keys=True) + "\n")


def read_head(registry_dir: Path) -> Head | None:
    """HEAD as written, or None when there is none. The old format (a bare sha256 of the last line, before HEAD
    carried a count) reads as a Head without count or hmac."""
    path = registry_dir / HEAD_FILE
    if not path.exists():
        return None
    text = path.read_text(encoding="utf-8").strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        return Head(count=None, last_sha256=text)
    count = data.get("count")
    return Head(
        count=count if isinstance(count, int) else -1, last_sha256=data.get("last_sha256"), hmac=data.get("hmac")
    )


def _head_names(head: Head, lines: list[str]) -> bool:
    """HEAD names exactly this log: its last line (and, when it says, its length)."""
    last = entry_hash(lines[-1]) if lines else None
    return head.last_sha256 == last and head.count in (None, len(lines))


def _head_keyed(head: Head, key: str) -> bool:
    return (
        head.hmac is not None
        and head.count is not None
        and head.count >= 0
        and hmac.compare_digest(str(head.hmac), head_hmac(head.count, head.last_sha256, key))
    )


def head_behind(registry_dir: Path, lines: list[str], key: str | None = None) -> bool:
    """HEAD names the log without its last line, and that line is a complete entry chained to the one before
    (keyed: HEAD and that entry carry valid HMACs): the writer died after the log's fsync and before HEAD's
    rename. An edited last line leaves HEAD at the original line's hash, a truncated log leaves HEAD ahead."""
    head = read_head(registry_dir)
    if not lines or head is None or not _head_names(head, lines[:-1]) or (key and not _head_keyed(head, key)):
        return False
    try:
        last = json.loads(lines[-1])
    except json.JSONDecodeError:
        return False
    chained = isinstance(last, dict) and last.get("prev_sha256") == (entry_hash(lines[-2]) if len(lines) > 1 else None)
    return chained and (not key or hmac.compare_digest(str(last.get("hmac")), entry_hmac(last, key)))


def head_problem(registry_dir: Path, lines: list[str], key: str | None) -> str | None:
    """Why HEAD does not vouch for the log's lines, or None. Unkeyed, a missing HEAD is tolerated (repair
    writes it); keyed, HEAD must exist, carry a valid HMAC and name the log's length and last line."""
    path, head_path = registry_dir / LOG_FILE, registry_dir / HEAD_FILE
    head = read_head(registry_dir)
    if head is None:
        if key and lines:
            return (
                f"{head_path}: missing, and keyed mode needs it (it binds the log's length and last line: entries "
                "may have been removed from the end, or the last one edited)"
            )
        return None
    if key and not _head_keyed(head, key):
        return (
            f"{head_path}: carries no valid hmac under {KEY_VAR} (written without the key, forged, or by a fineflow "
            "that did not key HEAD: if you have checked the log, `fineflow registry repair --seal-head` re-keys it)"
        )
    if _head_names(head, lines):
        return None
    if head_behind(registry_dir, lines, key):
        return f"{path}:{len(lines)}: {head_path} is one entry behind (a writer died after appending); {REPAIRS}"
    if head.count is not None and head.count != len(lines):
        return f"{path}: {head_path} counts {head.count} entries, the log has {len(lines)} " + (
            "(entries were removed from its end)" if head.count > len(lines) else "(entries added by hand)"
        )
    return f"{path}:{len(lines)}: the last entry does not match {head_path} (the last line was edited)"


def seal_head(registry_dir: Path, log: Callable[[str], None] = print) -> None:
    """Write HEAD (keyed when the key is set) for the log as it stands, whatever HEAD said: for a log a person
    has checked, e.g. one keyed by a fineflow whose HEAD was not. Refused when the chain or an HMAC is broken."""
    path, key = registry_dir / LOG_FILE, registry_key()
    with registry_lock(registry_dir):
        if not path.exists():
            raise FineflowError(f"{path}: no promotion log to seal")
        problems = [chain_problem(path)] + (hmac_problems(path, key) if key else [])
        if any(problems):
            raise FineflowError(f"not sealing HEAD: {next(p for p in problems if p)}")
        lines = path.read_text(encoding="utf-8").splitlines()
        write_head(registry_dir, lines, key)
    log(f"{registry_dir / HEAD_FILE}: now names the log's {len(lines)} entries" + (" (keyed)" if key else ""))


# ---- what a writer that died leaves in the log, and its repair -----------------------------------


def torn_tail(data: bytes) -> int | None:
    """Where the last line starts when it has no newline (its writer died mid-append), else None."""
    cut = data.rfind(b"\n") + 1
    return cut if cut < len(data) else None


def _cut_torn_tail(registry_dir: Path, key: str | None) -> str | None:
    """Cut a last line without its newline (never committed), unless HEAD counts it: then it was committed and
    only its newline is missing, which is added back. Keyed, only under a valid HEAD. What was done, or None."""
    path = registry_dir / LOG_FILE
    data = path.read_bytes()
    cut = torn_tail(data)
    head = read_head(registry_dir)
    if cut is None or (key and (head is None or not _head_keyed(head, key))):
        return None
    complete = data[:cut].decode("utf-8").splitlines()
    whole = data.decode("utf-8", "replace").splitlines()
    if head is not None and head.count is not None and _head_names(head, whole):  # committed: a newline was lost
        with path.open("ab") as fh:
            fh.write(b"\n")
            os.fsync(fh.fileno())
        return f"{path}:{len(whole)}: added the newline missing after the last entry (HEAD counts the entry)"
    if head is not None and not (_head_names(head, complete) or head_behind(registry_dir, complete, key)):
        return None
    with path.open("r+b") as fh:
        fh.truncate(cut)
        os.fsync(fh.fileno())
    torn = data[cut:].decode("utf-8", "replace")
    return (
        f"{path}:{len(complete) + 1}: removed a half-written last entry ({len(data) - cut} bytes without a newline: "
        f"a writer died mid-append, so it was never committed): {torn[:200]}"
    )


def repair_log(registry_dir: Path, log: Callable[[str], None] = print) -> list[str]:
    """Undo what a writer that died mid-append left, and say so: a last line without its newline is cut off
    (it was never committed: nothing was installed after it), and HEAD catches up with a last entry that was
    fully written (keyed: one HEAD, with a valid HMAC, names the log without it). A complete line that breaks
    the chain, or a HEAD ahead of the log, is an edit or a truncation: it is left for verify to name. Call under
    the registry lock."""
    path = registry_dir / LOG_FILE
    if not path.exists():
        return []
    key = head_key(registry_dir, registry_key())
    done = [m for m in [_cut_torn_tail(registry_dir, key)] if m]
    lines = path.read_text(encoding="utf-8").splitlines()
    head = registry_dir / HEAD_FILE
    if lines and ((not key and not head.exists()) or head_behind(registry_dir, lines, key)):
        write_head(registry_dir, lines, key)
        done.append(f"{head}: now names entry {len(lines)}, the last one (a writer died before updating it)")
    for message in done:
        log(message)
    return done


# ---- the chain and the HMACs, checked ------------------------------------------------------------


def chain_problem(path: Path) -> str | None:
    """The first line that breaks the hash chain, or None. Stops there: every line after a broken one fails
    too, so naming them adds nothing. Each line must be the entry as the writer serialises it (sorted keys, no
    duplicate key): other bytes for the same entry are an edit the HMAC, computed on the parsed entry, cannot
    see."""
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
        if json.dumps(entry, sort_keys=True) != line:
            return f"{where}: not written as fineflow writes an entry (sorted keys, no duplicates): the line was edited"
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
    if torn_tail(data) is not None:
        return f"{path}:{len(lines)}: no newline after the last entry; {REPAIRS}"
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
