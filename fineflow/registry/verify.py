"""``fineflow registry verify``: the whole registry checked against its promotion log, first the log's own
chain (promotion_log.py), then the stored candidates, the alias and the installed champion."""

from __future__ import annotations

from pathlib import Path

from fineflow.core.reports import sha256_file
from fineflow.registry.install import champion_files_hash, read_champion
from fineflow.registry.promotion_log import LOG_FILE, REPAIRS, chain_problem, hmac_problems, last_champion_entry
from fineflow.registry.store import (
    CARD_FILE,
    CHAMPION_FILE,
    RECORD_FILE,
    alias_id,
    candidate_id,
    read_alias,
    stored_candidate,
)


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
    broken = chain_problem(registry_dir, path)
    if broken:
        return [broken]
    return (
        (hmac_problems(path, key) if key else [])
        + _changed_candidates(registry_dir)
        + _dangling_alias(registry_dir)
        + _champion_problems(registry_dir, champion_dir)
    )


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
