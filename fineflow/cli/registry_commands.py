"""``fineflow registry verify|rollback|repair|list`` (fineflow.registry.verify, rollback and repair in
fineflow.registry.champion) and ``fineflow lineage`` (fineflow.registry.lineage)."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    _registry_parser(sub)
    _lineage_parser(sub)


def _registry_parser(sub) -> None:
    p = sub.add_parser("registry", help="verify the promotion log, roll back the champion, list candidates")
    actions = p.add_subparsers(dest="action", required=True)
    verify = actions.add_parser(
        "verify", help="check the log's hash chain (and HMACs, keyed), the stored candidates and the champion"
    )
    rollback = actions.add_parser("rollback", help="reinstall an earlier champion (logged, recorded in dvc.lock)")
    rollback.add_argument("--to", help="candidate id (or a unique prefix); default: the champion before the current")
    rollback.add_argument(
        "--allow-unpromoted",
        metavar="REASON",
        help="install a candidate the gate never promoted; the reason goes into the log entry and the model card "
        "(not needed, and not logged, for a candidate the gate promoted)",
    )
    repair = actions.add_parser("repair", help="finish what a promote or rollback that died midway left")
    repair.add_argument(
        "--seal-head",
        action="store_true",
        help="rewrite HEAD (keyed, with the key set) for the log as it stands: only for a log you have checked",
    )
    for q in (rollback, repair):
        q.add_argument("--base-dir", help="base model to merge into (default: the one recorded at promotion)")
    listing = actions.add_parser("list", help="candidates, their decisions and the champion")
    for q in (verify, rollback, repair, listing):
        q.add_argument("--registry", default="models/registry", help="registry dir (default: models/registry)")
    for q in (verify, rollback, repair):
        q.add_argument("--champion", help="installed champion dir (default: `champion` beside the registry dir)")
    verify.set_defaults(run=_run_verify)
    rollback.set_defaults(run=_run_rollback)
    repair.set_defaults(run=_run_repair)
    listing.set_defaults(run=_run_list)


def _registry_paths(args):
    """(registry dir, champion dir): the champion defaults to its place beside the registry (models/champion)."""
    from pathlib import Path

    registry = Path(args.registry)
    return registry, Path(args.champion) if args.champion else registry.parent / "champion"


def _run_verify(args) -> int:
    from fineflow.registry.promotion_log import KEY_VAR, last_champion_entry, read_log, registry_key
    from fineflow.registry.verify import override_note, verify_log

    registry, champion = _registry_paths(args)
    key = registry_key()
    problems = verify_log(registry, champion, key=key)
    if problems:
        for problem in problems:
            print(f"BROKEN: {problem}")
        return 1
    last, note = last_champion_entry(registry), override_note(registry)
    print(
        f"OK: {len(read_log(registry))} entries, hash chain intact"
        + (", every HMAC valid (HEAD's too)" if key else "")
        + ", candidates match their ids"
        + (f", champion {last['candidate_id']} as installed by entry {last['seq']}" if last else "")
    )
    if note:
        print(f"NOTE: {note}")
    if not key:
        print(f"(HMACs not checked: {KEY_VAR} is not set; the chain shows accidental edits, not deliberate ones)")
    return 0


def _run_rollback(args) -> int:
    from pathlib import Path

    from fineflow.core.workspace import held_for
    from fineflow.registry.champion import rollback
    from fineflow.registry.dvc_record import record_outputs
    from fineflow.registry.store import registry_lock

    registry, champion = _registry_paths(args)
    # not while a run holds the workspace (its promote, and the dvc.lock it writes, would race the rollback's)
    with held_for(Path.cwd(), "registry rollback"), registry_lock(registry):
        # no other write between the rollback and what dvc.lock records of it
        result = rollback(registry, champion, args.to, args.base_dir, allow_unpromoted=args.allow_unpromoted)
        note = record_outputs(registry, champion)
    print(f"rolled back: champion {result['from']} -> {result['to']} (log entry {result['log_seq']})")
    if result["override"]:
        print(f"override logged: {result['to']} was never promoted by the gate ({result['override']['reason']})")
    print(note)
    return 0


def _run_repair(args) -> int:
    from fineflow.registry.champion import recover
    from fineflow.registry.promotion_log import seal_head

    registry, champion = _registry_paths(args)
    if args.seal_head:
        seal_head(registry)
    if not recover(registry, champion, base_dir=args.base_dir):
        print("nothing to repair")
    return _run_verify(args)


def _run_list(args) -> int:
    from pathlib import Path

    from fineflow.objectives.interface import LANGUAGE_MODEL
    from fineflow.registry.promotion_log import champion_kinds
    from fineflow.registry.store import alias_id, record_kind, stored_records

    registry = Path(args.registry)
    champions = {kind: alias_id(registry, kind) for kind in champion_kinds(registry)}  # a champion per model kind
    for cid, record in stored_records(registry):
        metrics = ", ".join(f"{k} {v:.4f}" for k, v in (record.get("metrics") or {}).items())
        star = "*" if cid in champions.values() else " "
        kind = f"{record_kind(record):<7} " if len(champions) > 1 else ""  # the kind column once there are two
        print(f"{star} {cid}  {kind}{record.get('decision', '?'):<8}  {metrics}")
    others = [f"champion ({kind}): {cid}" for kind, cid in champions.items() if kind != LANGUAGE_MODEL]
    print("; ".join([f"champion: {champions[LANGUAGE_MODEL] or 'none'}", *others]))
    return 0


def _lineage_parser(sub) -> None:
    p = sub.add_parser(
        "lineage",
        help="print where a model came from, as a tree",
        description="Print a lineage manifest: a model dir (models/champion, a registry "
        "candidate), a candidate id, or a lineage JSON file.",
    )
    p.add_argument("target", help="model dir, candidate id, or lineage .json")
    p.add_argument("--registry", default="models/registry", help="where candidate ids are looked up")
    p.add_argument(
        "--runs",
        default="reports/lineage",
        help="full per-run manifests (git, times, user, host) by candidate id (default: reports/lineage)",
    )
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(run=_run_lineage)


def _run_lineage(args) -> int:
    from pathlib import Path

    from rich.console import Console

    from fineflow.registry.lineage import resolve, tree

    manifest = resolve(args.target, Path(args.registry), Path(args.runs))
    if args.json:
        print(json.dumps(manifest, indent=2, sort_keys=True))
    else:
        Console(soft_wrap=True).print(tree(manifest, f"lineage of {args.target}"))
    return 0
