"""The model registry on disk: candidate ids, stored candidates, the champion directory and alias, and the
append-only, hash-chained promotion log.

The registry (``models/registry``, DVC-tracked, persist)::

    candidates/<id>/          every candidate evaluated, by id (short sha256 of its adapter files):
                              the adapter (or full model) files + record.json (metrics, samples, eval data
                              hash, decision, deterministic lineage)
    champion.json             the alias: {"id": ..., "seq": <log entry that installed it>}
    promotions.jsonl          append-only; each entry carries the sha256 of the previous line
    HEAD                      sha256 of the last line (so editing the last entry is detectable too)

The champion is a stable path (``models/champion``) replaced atomically: the new one is assembled in a
temporary sibling directory and swapped in with renames. ``verify_log`` is what ``fineflow registry verify``
runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from fineflow.errors import FineflowError
from fineflow.reports import sha256_file, write_json_atomic

CHAMPION_FILE = "champion.json"
LOG_FILE = "promotions.jsonl"
HEAD_FILE = "HEAD"
RECORD_FILE = "record.json"
ID_LEN = 16


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


def same_id(a: str | None, b: str | None) -> bool:
    """Candidate ids match when one is a prefix of the other (short ids vs the log's older full hashes)."""
    return bool(a and b) and (a.startswith(b) or b.startswith(a))


# ---- candidates ----------------------------------------------------------------------------------


def candidate_dir(registry_dir: Path, cid: str) -> Path:
    """candidates/<id>; a unique prefix of an id is accepted."""
    root = registry_dir / "candidates"
    exact = root / cid
    if exact.is_dir():
        return exact
    matches = sorted(p for p in root.glob(f"{cid}*") if p.is_dir()) if root.is_dir() else []
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


def alias_id(registry_dir: Path) -> str | None:
    """The id the registry's champion alias names, or None when nothing was promoted yet."""
    alias = registry_dir / CHAMPION_FILE
    return json.loads(alias.read_text(encoding="utf-8")).get("id") if alias.is_file() else None


def set_alias(registry_dir: Path, cid: str, seq: int) -> None:
    write_json_atomic(registry_dir / CHAMPION_FILE, {"id": cid, "seq": seq})


def read_champion(champion_dir: Path) -> dict | None:
    """The installed champion's record (its metrics at promotion), or None when there is no champion yet."""
    try:
        record = json.loads((champion_dir / CHAMPION_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    return record if record.get("candidate_id") else None


def current_champion(registry_dir: Path, champion_dir: Path) -> dict | None:
    """The champion the gate compares with: {"id", "metrics" (flat), "samples", "eval_data_sha256"}.

    The registry alias is authoritative; a champion installed before the registry had candidates (an
    older champion.json with metrics only) is still honoured, with no samples and no eval data hash."""
    cid = alias_id(registry_dir)
    if cid:
        record = read_record(registry_dir, cid)
        return {
            "id": cid,
            "metrics": record.get("metrics") or {},
            "samples": record.get("samples"),
            "eval_data_sha256": record.get("eval_data_sha256"),
        }
    legacy = read_champion(champion_dir)
    if legacy is None:
        return None
    return {
        "id": legacy["candidate_id"],
        "metrics": legacy.get("metrics") or {},
        "samples": legacy.get("samples"),
        "eval_data_sha256": legacy.get("eval_data_sha256"),
    }


def staging_dir(champion_dir: Path) -> Path:
    """An empty sibling of champion_dir to assemble the next champion in (on the same filesystem, so the
    swap is a rename)."""
    staging = champion_dir.with_name(f".{champion_dir.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def swap_in(staging: Path, champion_dir: Path) -> None:
    """Replace champion_dir by the complete staging dir with two renames; nothing half-written is visible."""
    retired = champion_dir.with_name(f".{champion_dir.name}.retired")
    shutil.rmtree(retired, ignore_errors=True)
    if champion_dir.exists():
        os.replace(champion_dir, retired)
    os.replace(staging, champion_dir)
    shutil.rmtree(retired, ignore_errors=True)


def ensure_empty_champion(champion_dir: Path) -> None:
    """Before the first promotion the champion path still exists (DVC tracks it), holding a null record."""
    champion_dir.mkdir(parents=True, exist_ok=True)
    if not (champion_dir / CHAMPION_FILE).exists():
        (champion_dir / CHAMPION_FILE).write_text(json.dumps({"candidate_id": None}) + "\n", encoding="utf-8")


# ---- the promotion log ---------------------------------------------------------------------------


def _entry_hash(line: str) -> str:
    return hashlib.sha256(line.encode("utf-8")).hexdigest()


def append_log(registry_dir: Path, entry: dict) -> dict:
    """Append entry to the promotion log, chained to the previous entry by its sha256; HEAD follows."""
    registry_dir.mkdir(parents=True, exist_ok=True)
    path = registry_dir / LOG_FILE
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    full = {"seq": len(lines) + 1, "prev_sha256": _entry_hash(lines[-1]) if lines else None, **entry}
    line = json.dumps(full, sort_keys=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    (registry_dir / HEAD_FILE).write_text(_entry_hash(line) + "\n", encoding="utf-8")
    return full


def read_log(registry_dir: Path) -> list[dict]:
    path = registry_dir / LOG_FILE
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []


def champion_history(registry_dir: Path) -> list[str]:
    """Candidate ids that were champion, oldest first, as the log's promoted/rollback entries say."""
    return [
        e["candidate_id"]
        for e in read_log(registry_dir)
        if e.get("decision") in ("promoted", "rollback") and e.get("candidate_id")
    ]


def verify_log(registry_dir: Path) -> list[str]:
    """Problems with the registry, first the first bad line of the chain; [] when it is intact.

    Checks: every line is JSON with seq = its line number and prev_sha256 = sha256 of the line before;
    HEAD (when present) is the sha256 of the last line; every stored candidate's files still hash to its
    id; the champion alias names a stored candidate."""
    path = registry_dir / LOG_FILE
    if not path.exists():
        return [f"{path}: no promotion log"]
    broken = _chain_problem(registry_dir, path)
    if broken:
        return [broken]
    return _changed_candidates(registry_dir) + _dangling_alias(registry_dir)


def _chain_problem(registry_dir: Path, path: Path) -> str | None:
    """The first line that breaks the hash chain (or that HEAD disowns), or None. Stops there: every line
    after a broken one fails too, so naming them adds nothing."""
    lines = path.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    previous = None
    for number, line in enumerate(lines, start=1):
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
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
        return f"{path}:{len(lines)}: the last entry does not match {head} (the last line was edited)"
    return None


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
