"""``fineflow registry verify``: the whole registry checked against its promotion log, first the log's own
chain (promotion_log.py), then the stored candidates, the alias and the installed champion."""

from __future__ import annotations

from pathlib import Path

from fineflow.core.reports import sha256_file
from fineflow.objectives.interface import LANGUAGE_MODEL
from fineflow.registry.install import champion_files_hash, champion_manifest, read_champion
from fineflow.registry.promotion_log import (
    LOG_FILE,
    REPAIRS,
    chain_problem,
    champion_kinds,
    head_problem,
    hmac_problems,
    last_champion_entry,
    read_log,
)
from fineflow.registry.store import (
    CARD_FILE,
    CHAMPION_FILE,
    RECORD_FILE,
    alias_id,
    alias_path,
    candidate_id,
    kind_champion_dir,
    read_alias,
    stored_candidate,
)

BASE_HASH_CACHE = Path(".cache/fineflow")  # the fingerprint stage's --hash-cache (dvc.yaml)


def verify_log(registry_dir: Path, champion_dir: Path | None = None, key: str | None = None) -> list[str]:
    """Problems with the registry, first the first bad line of the chain; [] when it is intact.

    Checks: every line is the JSON fineflow wrote, with seq = its line number and prev_sha256 = sha256 of the
    line before; with key, every entry carries a valid HMAC; HEAD names the log's length and last line (keyed:
    it must exist and carry a valid HMAC; unkeyed, a missing one is tolerated); every rollback to a candidate
    the gate never promoted logged its override; every stored candidate's files still hash to its id; the
    champion alias names a stored candidate and agrees with the log's last promotion or rollback; and (with
    champion_dir) the installed champion is that candidate: its champion.json, its adapter files, and every
    file as that entry recorded it; an adapter-only champion's base is the content its champion.json names. So for
    each kind of model's champion (a language model's at champion_dir; another kind's in the registry)."""
    path = registry_dir / LOG_FILE
    if not path.exists():
        return [f"{path}: no promotion log"]
    broken = chain_problem(path)
    if broken:
        return [broken]
    forged = hmac_problems(path, key) if key else []
    head = None if forged else head_problem(registry_dir, path.read_text(encoding="utf-8").splitlines(), key)
    return (
        forged
        + ([head] if head else [])
        + unlogged_overrides(registry_dir)
        + _changed_candidates(registry_dir)
        + [
            problem
            for kind in champion_kinds(registry_dir)
            for problem in _kind_problems(registry_dir, champion_dir, key, kind)
        ]
    )


def _kind_problems(registry_dir: Path, champion_dir: Path | None, key: str | None, kind: str) -> list[str]:
    """The alias and the installed champion of one kind of model (champion_dir: the language model's)."""
    home = champion_dir if kind == LANGUAGE_MODEL else kind_champion_dir(registry_dir, kind)
    return _dangling_alias(registry_dir, kind) + _champion_problems(registry_dir, home, key, kind)


def _changed_candidates(registry_dir: Path) -> list[str]:
    root = registry_dir / "candidates"
    return [
        f"{cdir}: files no longer hash to the candidate id (changed after it was stored)"
        for cdir in (sorted(root.glob("*")) if root.is_dir() else [])
        if cdir.is_dir() and not cdir.name.startswith(".") and candidate_id(cdir) != cdir.name
    ]


def _dangling_alias(registry_dir: Path, kind: str = LANGUAGE_MODEL) -> list[str]:
    alias = alias_path(registry_dir, kind)
    cid = alias_id(registry_dir, kind)
    if cid and not (registry_dir / "candidates" / cid).is_dir():
        return [f"{alias}: names champion {cid}, which is not in {registry_dir / 'candidates'}"]
    return []


def _champion_problems(
    registry_dir: Path, champion_dir: Path | None, key: str | None, kind: str = LANGUAGE_MODEL
) -> list[str]:
    """The kind's alias and installed champion against the log's last promotion or rollback of that kind. When
    that entry's candidate is no longer stored there is nothing to compare them with (an alias naming it is
    _dangling_alias's)."""
    last = last_champion_entry(registry_dir, kind)
    alias = read_alias(registry_dir, kind)
    if last is None:
        return [f"{alias_path(registry_dir, kind)}: names a champion the log never installed"] if alias else []
    cid, seq = last["candidate_id"], last["seq"]
    stored = stored_candidate(registry_dir, cid)
    if stored is None:
        return []
    problems = []
    alias_ok = bool(alias) and alias.get("id") == cid and alias.get("seq") == seq
    if not alias_ok:
        named = f"{alias.get('id')} (entry {alias.get('seq')})" if alias else "nothing"
        problems.append(
            f"{alias_path(registry_dir, kind)}: the champion alias names {named}, but entry {seq} of the log installs "
            f"{cid} (a writer died between the log append and the install); {REPAIRS}"
        )
    if champion_dir is not None:
        problems += _installed_problems(champion_dir, stored, last, alias if alias_ok else None, key)
    return problems


def _installed_problems(champion_dir: Path, stored: Path, last: dict, alias: dict | None, key: str | None) -> list[str]:
    """The champion directory is the one entry `last` installed: its champion.json, the stored candidate's
    files byte for byte, and every file as the entry recorded it (champion_files: keyed, so no one without the
    key can change a served file and its recorded hash together). Entries older than champion_files: the
    content hash in the alias, unkeyed only."""
    cid, seq = stored.name, last["seq"]
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
    pointer = base_pointer_problems(champion_dir, installed)
    if last.get("champion_files") is not None:
        return manifest_problems(champion_dir, last["champion_files"], seq) + pointer
    if key:
        return [
            f"{champion_dir}: entry {seq} installed it before the log recorded a champion's files, so keyed verify "
            "cannot vouch for what is served; a promotion or a rollback binds them"
        ]
    recorded = (alias or {}).get("files_sha256")
    if recorded and champion_files_hash(champion_dir) != recorded:
        return [
            f"{champion_dir}: its files no longer hash to what entry {seq} installed (files_sha256 in the alias): "
            "a file was changed, added or removed after the install"
        ]
    return pointer


def base_pointer_problems(champion_dir: Path, installed: dict, cache_dir: Path = BASE_HASH_CACHE) -> list[str]:
    """An adapter-only champion (no merged/: promote.merged) is served on its base: champion.json must name it
    (base_model) and its content (base_digest), and the base found there must still be that content (hashes
    cached by path, size and mtime with the fingerprint stage's, so an unchanged 70B base is not read again)."""
    if not (champion_dir / "adapter_config.json").is_file() or (champion_dir / "merged").is_dir():
        return []
    where = champion_dir / CHAMPION_FILE
    base, digest = installed.get("base_model"), installed.get("base_digest")
    if not base or not digest:
        return [f"{where}: an adapter-only champion must name its base (base_model) and its digest (base_digest)"]
    from fineflow.base_source import read_base_digest
    from fineflow.errors import FineflowError

    try:
        found = read_base_digest(base, cache_dir=cache_dir)
    except (FineflowError, OSError) as exc:
        return [f"{where}: its base {base} cannot be read here ({exc}): the adapter cannot be served or merged"]
    if found != digest:
        return [
            f"{where}: its base {base} is now other content (digest {found}, the champion was trained on {digest}): "
            "the adapter would be served on weights it was not trained on; restore that base"
        ]
    return []


def manifest_problems(champion_dir: Path, recorded: dict, seq: int) -> list[str]:
    """Every file of champion_dir against the sha256 entry seq recorded for it: changed, missing, or added.
    A missing model card is not one: DVC does not restore it (.dvcignore), and a card that is absent is not
    served."""
    found = champion_manifest(champion_dir)
    problems = []
    for rel, sha in sorted(recorded.items()):
        if rel not in found and rel != CARD_FILE:
            problems.append(f"{champion_dir / rel}: missing (entry {seq} installed it)")
        elif rel in found and found[rel] != sha:
            problems.append(f"{champion_dir / rel}: differs from what entry {seq} installed (changed after it)")
    added = sorted(set(found) - set(recorded))
    return problems + [f"{champion_dir / rel}: not installed by entry {seq} (added after it)" for rel in added]


def unlogged_overrides(registry_dir: Path) -> list[str]:
    """Rollback entries that install a candidate the gate never promoted before them, without the override
    (`rollback --allow-unpromoted REASON`) logged: what a rollback before the override existed wrote, or an
    unkeyed hand edit."""
    promoted, problems = set(), []
    for entry in read_log(registry_dir):
        cid = entry.get("candidate_id")
        if entry.get("decision") == "promoted":
            promoted.add(cid)
        elif entry.get("decision") == "rollback" and cid not in promoted and not is_override(entry):
            problems.append(
                f"{registry_dir / LOG_FILE}:{entry.get('seq')}: rolls back to {cid}, which the gate never promoted, "
                "with no override logged (`fineflow registry rollback --allow-unpromoted REASON` logs one); roll "
                "back to a candidate the gate promoted"
            )
    return problems


def is_override(entry: dict) -> bool:
    return bool((entry.get("override") or {}).get("unpromoted"))


def override_note(registry_dir: Path) -> str | None:
    """What verify's OK says when the champion was installed by an override: never promoted by the gate."""
    last = last_champion_entry(registry_dir)
    if last is None or not is_override(last):
        return None
    return (
        f"champion {last['candidate_id']} was never promoted by the gate: entry {last['seq']} installed it with "
        f"--allow-unpromoted (reason: {last['override'].get('reason')})"
    )
