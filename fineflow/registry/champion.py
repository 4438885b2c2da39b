"""The promote procedure and the champion's assembly: what ``fineflow.stages.promote`` runs and what
``fineflow registry rollback`` runs.

``promote`` builds the run's lineage manifest, runs the gate (``gate.promotion_decision``), keeps the
candidate in the registry by id, appends the decision and its evidence to the promotion log, and on success
installs the champion atomically: the PEFT adapter, the merged model (``merged/``, when ``promote.merged`` asks
for it: ``merged_export``; otherwise the champion is the adapter and its base's identity in champion.json, and
``fineflow.registry.merge`` builds the merged model shard by shard when asked), the tokenizer, a model card
(``README.md``) and the deterministic lineage (``lineage.json``). The slow, failure-prone assembly
happens before anything is logged or replaced, so a crash leaves the registry and the champion as they were.
The whole staged directory, champion.json included, is final before the log append, and the entry records each
file's sha256 (``log_decision``): keyed, the entry binds every file that is served.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fineflow.core.config import Params
from fineflow.core.reports import write_json_atomic
from fineflow.errors import FineflowError
from fineflow.objectives import objective_for
from fineflow.objectives.interface import LANGUAGE_MODEL
from fineflow.registry.approval import Approval, apply_approval
from fineflow.registry.card import model_card, train_figures
from fineflow.registry.gate import (
    Decision,
    GatePolicy,
    bootstrap_per_metric,
    decision_record,
    flatten,
    promotion_decision,
    refusal,
)
from fineflow.registry.install import (
    champion_files_hash,
    champion_manifest,
    clear_leftovers,
    ensure_empty_champion,
    read_champion,
    staging_dir,
    swap_in,
)
from fineflow.registry.lineage import build_manifest, deterministic, missing_fields
from fineflow.registry.promotion_log import (
    append_log,
    champion_history,
    champion_kinds,
    gate_promoted,
    last_champion_entry,
    next_seq,
    read_log,
    repair_log,
    rollback_refusal,
)
from fineflow.registry.store import (
    CHAMPION_FILE,
    RECORD_FILE,
    alias_id,
    candidate_dir,
    candidate_id,
    check_id,
    current_champion,
    directory_hash,
    intact_candidate,
    kind_champion_dir,
    kind_field,
    read_alias,
    read_record,
    record_kind,
    registry_lock,
    set_alias,
    store_candidate,
    stored_candidate,
)


def promote(
    params: Params,
    scores_path: Path,
    adapter_dir: Path,
    champion_dir: Path,
    registry_dir: Path,
    base_dir: Path | None = None,
    train_report: Path | None = None,
    lineage_dir: Path | None = None,
    shards_dir: Path = Path("data/shards"),
    root: Path = Path("."),
    log=print,
    approval: Approval | None = None,
    eval_rows: Path | None = None,
    parity_check: ParityCheck | None = None,
) -> dict:
    """Judge the candidate at adapter_dir against the champion (or the base) on the evaluate stage's scores,
    record the decision in the registry, install the candidate as champion if it passed; the stage's report.
    With promote.require_approval, a candidate the gate passes needs approval, a person's answer for it (see
    fineflow.registry.approval); without one, ApprovalNeeded is raised before anything is written.

    root is the checkout the lineage's git state and dvc.lock are read from; the full manifest (with git,
    times, user, host) goes to ``<lineage_dir>/<candidate id>.json``, outside DVC's outputs. With
    export.block_promotion, the assembled champion's GGUF exports are parity-checked on eval_rows before anything
    is logged (parity_gate, by parity_check: the export's check, which the stage hands in: the registry does not
    know the export formats): a failure refuses the candidate.

    A candidate of another kind than a language model (train.objective's model_kind: the reward model) is judged
    against its own kind's champion (or the base when there is none) and installed as that kind's champion, in
    the registry (champion_home): models/champion stays the language model's."""
    scores, unreadable = read_scores(scores_path)
    eval_hash = scores.get("eval_data_sha256")
    policy = GatePolicy.from_params(params)  # the gate's settings, once: promote.* and the run's seed
    objective = objective_for(params.train.objective)
    cid = candidate_id(adapter_dir)
    manifest = build_manifest(
        params=params.model_dump(mode="json", by_alias=True),
        adapter_dir=adapter_dir,
        scores_path=scores_path,
        eval_data_sha256=eval_hash,
        shards_dir=shards_dir,
        root=root,
    )
    manifest["candidate_id"] = cid
    # one writer at a time, from reading the champion to its alias; what a writer that died left is finished first
    with registry_writes(registry_dir, champion_dir, log):
        decided = already_decided(registry_dir, cid, manifest["eval"]["scores_sha256"], params)
        if decided is not None:  # a re-run after a crash that came after the decision was logged (and finished)
            log(f"{cid} was already judged on these scores and params (log entry {decided['seq']}): not again")
            return _finish(decided_as(decided), cid, decided["seq"], lineage_dir, manifest, log)
        champion = current_champion(registry_dir, objective.model_kind)  # its own kind's: a champion per kind
        retired = rollback_refusal(registry_dir, cid)  # a re-run on old scores must not undo a rollback
        if unreadable or retired:
            decision = refusal(unreadable or retired, policy.primary_metric)
        else:
            decision = promotion_decision(scores, champion, missing_fields(manifest), policy, eval_hash)
        if params.promote.require_approval:  # a person answers for what the gate would promote, before any write
            decision = apply_approval(decision, cid, approval, stage_report(decision, cid, None, None))
        record = candidate_record(params, policy, scores, cid, adapter_dir, base_dir, eval_hash, manifest, decision)
        stored = store_candidate(registry_dir, adapter_dir, cid, record)
        ensure_empty_champion(champion_dir)
        home = champion_home(champion_dir, registry_dir, objective.model_kind)
        staging = None
        if decision.promote:  # the slow, failure-prone part happens before anything is logged or replaced
            if not record["base_model"]:
                raise FineflowError(f"{adapter_dir}: cannot tell the base model to merge into; pass --base-dir")
            staging = build_champion(
                staging_dir(home), stored, record["base_model"], record, train_figures(train_report, log)
            )
            if params.export.block_promotion and objective.generates:  # only a language model is exported
                decision, record = parity_gate(decision, record, staging, eval_rows, params, log, parity_check)
                store_candidate(registry_dir, adapter_dir, cid, record)  # its record says what parity decided
                if not decision.promote:
                    shutil.rmtree(staging)
                    staging = None
        entry = log_decision(registry_dir, log_entry(params, record, decision, champion), staging, record)
        if staging is not None:
            install_built(staging, home, registry_dir, cid, record, entry["seq"])
    return _finish(decision, cid, entry["seq"], lineage_dir, manifest, log)


def champion_home(champion_dir: Path, registry_dir: Path, kind: str) -> Path:
    """Where a champion of this kind is installed: champion_dir (models/champion) for a language model, the
    registry's champions/<kind> for another kind (store.kind_champion_dir)."""
    return champion_dir if kind == LANGUAGE_MODEL else kind_champion_dir(registry_dir, kind)


# (staged champion, base model reference, eval rows, params, log) -> {"passed", "reasons", "exports"}
ParityCheck = Callable[[Path, str, Path, Params, Callable[[str], None]], dict]


def parity_gate(
    decision: Decision,
    record: dict,
    staging: Path,
    eval_rows: Path | None,
    params: Params,
    log,
    parity_check: ParityCheck | None,
) -> tuple[Decision, dict]:
    """export.block_promotion: the staged champion's float and gated GGUF exports must pass parity_check
    (the promote stage hands in fineflow.export.gguf.parity_before_promotion), or the promotion is refused with
    every failed check's reason. The figures go into the record (and so the log entry) either way, and into the
    staged card."""
    if eval_rows is None or parity_check is None:
        raise FineflowError("export.block_promotion: the parity check needs the eval rows; pass --eval-rows")
    parity = parity_check(staging, record["base_model"], eval_rows, params, log)
    record = {**record, "export_parity": parity}
    if parity["passed"]:
        with open(staging / "README.md", "a", encoding="utf-8") as card:
            card.write(parity_card_section(parity))
        return decision, record
    reason = "export parity failed (export.block_promotion): " + "; ".join(parity["reasons"])
    decision = dataclasses.replace(decision, promote=False, reason=reason)
    return decision, {**record, "decision": verdict(decision), "reason": reason}


def parity_card_section(parity: dict) -> str:
    """The champion card's record of the parity its promotion waited for (the export stage's card has the rest)."""
    rows = [
        f"| {kind} | {e['exact_match']:.3f} | {e['delta']:+.3f} [{e['ci'][0]:+.3f}, {e['ci'][1]:+.3f}] |"
        for kind, e in parity["exports"].items()
    ]
    header = "| GGUF type | exact match (llama.cpp) | difference from transformers (CI) |\n|---|---|---|"
    return "\n## Export parity (checked before promotion)\n\n" + header + "\n" + "\n".join(rows) + "\n"


def _finish(decision: Decision, cid: str, seq: int, lineage_dir: Path | None, manifest: dict, log) -> dict:
    """After the registry: the full lineage manifest, the verdict's log line, the stage's report."""
    lineage_path = None
    if lineage_dir is not None:
        lineage_path = lineage_dir / f"{cid}.json"
        write_json_atomic(lineage_path, manifest)
    log(("PROMOTED: " if decision.promote else "NOT promoted: ") + decision.reason)
    return stage_report(decision, cid, seq, lineage_path)


def already_decided(registry_dir: Path, cid: str, scores_sha256: str | None, params: Params) -> dict | None:
    """The log's last entry when it judged this very candidate on these very scores and params: promote's
    decision is then made and recorded (a crash came after it, or DVC re-runs promote with nothing changed), and
    judging again would log a second verdict (against itself, once it is champion). Any other last entry: None."""
    entries = read_log(registry_dir)
    last = entries[-1] if entries else {}
    same = (
        last.get("decision") in ("promoted", "refused")
        and last.get("candidate_id") == cid
        and last.get("scores_sha256") == scores_sha256
        and last.get("params") == params.model_dump(mode="json", by_alias=True)
    )
    return last if same else None


def decided_as(entry: dict) -> Decision:
    """The Decision a log entry recorded (decision_record's fields)."""
    return Decision(**{f.name: entry[f.name] for f in dataclasses.fields(Decision) if f.name in entry})


def rollback(
    registry_dir: Path,
    champion_dir: Path,
    to: str | None = None,
    base_dir: str | None = None,
    log=print,
    allow_unpromoted: str | None = None,
) -> dict:
    """Reinstall an earlier champion from candidates/<id> (default: the one before the current) atomically,
    rebuilding its merged model (when it was promoted with one), tokenizer and card, and log a "rollback"
    entry; under the registry lock, after repairing what a writer that died left. The candidate rolled back
    from is not promoted again by the gate (promotion_log.rollback_refusal) unless a later rollback reinstalls
    it. A candidate the gate never promoted is installed only with allow_unpromoted (the reason), logged as an
    override and said on its card. A candidate of another kind than a language model (the reward model: its
    record's model_kind) replaces its own kind's champion only (champion_home); without ``to``, the language
    model's champion is rolled back."""
    if to is not None:
        check_id(to)
    with registry_writes(registry_dir, champion_dir, log, base_dir):
        kind = record_kind(read_record(registry_dir, to)) if to is not None else LANGUAGE_MODEL
        current = alias_id(registry_dir, kind)
        previous = to if to is not None else _previous_champion(registry_dir, current, kind)
        source = candidate_dir(registry_dir, previous)
        cid = intact_candidate(source).name
        if cid == current:
            raise FineflowError(f"{cid} is already the champion")
        override = unpromoted_override(registry_dir, cid, allow_unpromoted)
        record = read_record(registry_dir, cid)
        base_ref = base_dir or record.get("base_model")
        if not base_ref:
            raise FineflowError(f"{source}: the record names no base model; pass --base-dir")
        entry = rollback_entry(cid, current, record, override)
        home = champion_home(champion_dir, registry_dir, kind)
        staging = build_champion(staging_dir(home), source, base_ref, card_record(record, entry), None)
        entry = log_decision(registry_dir, entry, staging, record)
        install_built(staging, home, registry_dir, cid, record, entry["seq"])
    return {"from": current, "to": cid, "log_seq": entry["seq"], "override": override}


def unpromoted_override(registry_dir: Path, cid: str, reason: str | None) -> dict | None:
    """The override a rollback to cid logs when the gate never promoted cid ({"unpromoted", "reason"}); None
    when it did. Without a reason for one it needs, a FineflowError that says how to give it."""
    if gate_promoted(registry_dir, cid):
        return None
    if not (reason or "").strip():
        raise FineflowError(
            f"candidate {cid} was never promoted by the gate (its log entries refused it): to serve it anyway, "
            f"`fineflow registry rollback --to {cid} --allow-unpromoted REASON` (the reason goes into the log "
            "and the model card)"
        )
    return {"unpromoted": True, "reason": reason.strip()}


def rollback_entry(cid: str, current: str | None, record: dict, override: dict | None) -> dict:
    """The promotion log's entry for a rollback to cid (from the champion current)."""
    entry = {
        "candidate_id": cid,
        "decision": "rollback",
        "promote": True,
        "reason": f"rollback from {current} to {cid}" + (f" (override: {override['reason']})" if override else ""),
        "champion_before": current,
        "metrics": record.get("metrics"),
        "eval_data_sha256": record.get("eval_data_sha256"),
        **kind_field(record_kind(record)),
    }
    return {**entry, "override": override} if override else entry


def card_record(record: dict, entry: dict) -> dict:
    """The record the model card is written from: the candidate's, with the override of the entry that
    installs it (the card then says the gate never promoted it)."""
    return {**record, "override": entry["override"]} if entry.get("override") else record


def log_decision(registry_dir: Path, entry: dict, staging: Path | None, record: dict) -> dict:
    """Append entry to the log; when it installs the champion built at staging, first write the champion's
    champion.json there (with the seq the entry gets) and record every staged file's sha256 in the entry
    (champion_files), so the entry, keyed, binds all that will be served. Under the registry lock."""
    if staging is None:
        return append_log(registry_dir, entry)
    seq = next_seq(registry_dir)
    write_json_atomic(staging / CHAMPION_FILE, champion_json(record, seq))
    logged = append_log(registry_dir, {**entry, "champion_files": champion_manifest(staging)})
    if logged["seq"] != seq:  # only another writer, outside the registry lock, could cause it
        raise FineflowError(f"{registry_dir}: the log grew during this write (entry {logged['seq']}, not {seq})")
    return logged


def _previous_champion(registry_dir: Path, current: str | None, kind: str = LANGUAGE_MODEL) -> str:
    """The latest champion of the kind in the log other than the current one whose files the registry still holds."""
    earlier = [
        c
        for c in reversed(champion_history(registry_dir, kind))
        if c != current and (registry_dir / "candidates" / c).is_dir()
    ]
    if not earlier:
        raise FineflowError(f"{registry_dir}: no earlier champion stored in the registry to roll back to")
    return earlier[0]


# ---- after a writer died: the log is what was decided ---------------------------------------------------


@contextmanager
def registry_writes(
    registry_dir: Path, champion_dir: Path, log: Callable[[str], None] = print, base_dir: str | None = None
) -> Iterator[None]:
    """Hold the registry lock for a write (a promotion, a rollback) from its first read of the champion to
    its alias, after recover() has finished what a writer that died left: two writers never interleave, and
    each starts from a registry whose champion is the one its log names."""
    with registry_lock(registry_dir):
        recover(registry_dir, champion_dir, log, base_dir)
        yield


def recover(
    registry_dir: Path, champion_dir: Path, log: Callable[[str], None] = print, base_dir: str | None = None
) -> list[str]:
    """Bring the log, the champion directory and the alias back in line after a writer died midway; returns
    what was done, each also passed to log. The log is the record of what was decided: a half-written last line
    was never committed and is cut (promotion_log.repair_log); a promotion or rollback that was logged is finished,
    never undone: when the directory does not hold the champion it names, the staged copy whose files the entry
    recorded is swapped in, else it is rebuilt from candidates/<id>; and the alias is pointed at it. Leftover
    staged or retired directories are removed. So for each kind of model's champion (champion_home)."""
    with registry_lock(registry_dir):
        done = repair_log(registry_dir, log)
        homes = {kind: champion_home(champion_dir, registry_dir, kind) for kind in champion_kinds(registry_dir)}
        for kind, home in homes.items():
            last = last_champion_entry(registry_dir, kind)
            source = stored_candidate(registry_dir, last["candidate_id"]) if last else None
            if source is not None:  # before the leftovers go: the staged champion may be the one the entry recorded
                done += _finish_install(registry_dir, home, source, last, base_dir, log)
        for path in [path for home in homes.values() for path in clear_leftovers(home, registry_dir)]:
            done.append(f"removed {path} (left by a writer that died)")
            log(done[-1])
    return done


def _finish_install(
    registry_dir: Path, champion_dir: Path, source: Path, last: dict, base_dir: str | None, log: Callable[[str], None]
) -> list[str]:
    """Make champion_dir and the alias the install of log entry `last` (candidate source), if they are not yet."""
    cid, seq, kind = source.name, last["seq"], record_kind(last)
    installed = read_champion(champion_dir) or {}
    alias = read_alias(registry_dir, kind) or {}
    if installed.get("candidate_id") == cid and installed.get("promotion_seq") == seq:
        if alias.get("id") == cid and alias.get("seq") == seq:
            return []
        message = f"pointing the champion alias at {cid}, installed by entry {seq} (its writer died before it did)"
        log(message)
        set_alias(registry_dir, cid, seq, champion_files_hash(champion_dir), kind)  # the swap was done: the alias
        return [message]
    message = (
        f"{champion_dir}: finishing the install of {cid} that entry {seq} of the log records (its writer died "
        f"before the champion directory held it)"
    )
    log(message)
    record = read_record(registry_dir, cid)
    install_built(
        _staged_or_rebuilt(champion_dir, source, last, record, base_dir), champion_dir, registry_dir, cid, record, seq
    )
    return [message]


def _staged_or_rebuilt(champion_dir: Path, source: Path, last: dict, record: dict, base_dir: str | None) -> Path:
    """The champion entry `last` installs, assembled: the staged copy its writer left when every file is the one
    the entry recorded (a crash between the log append and the swap), else built again from the candidate."""
    staged = champion_dir.with_name(f".{champion_dir.name}.staging")
    if last.get("champion_files") and staged.is_dir() and champion_manifest(staged) == last["champion_files"]:
        return staged
    base_ref = base_dir or record.get("base_model")
    intact_candidate(source)
    if not base_ref:
        raise FineflowError(
            f"{source}: entry {last['seq']} of the log installs {source.name}, whose record names no base model to "
            "rebuild it on; pass --base-dir to `fineflow registry repair`"
        )
    return build_champion(staging_dir(champion_dir), source, base_ref, card_record(record, last), None)


# ---- the evidence ----------------------------------------------------------------------------------


def read_scores(path: Path) -> tuple[dict, str | None]:
    """The evaluate stage's scores.json, or ({}, why it cannot be read): the gate then refuses, with that reason."""
    try:
        return json.loads(path.read_text(encoding="utf-8")) or {}, None
    except (OSError, json.JSONDecodeError) as exc:
        return {}, f"{path}: cannot read evaluation scores ({exc}); run the evaluate stage"


def base_reference(params: Params, base_dir: Path | None, adapter_dir: Path) -> str:
    """What from_pretrained loads as the base: --base-dir (or the user's model.base), else the adapter's own."""
    if base_dir is not None:
        from fineflow.base_source import resolve_base_model

        return resolve_base_model(params.model, base_dir)
    try:
        return json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))["base_model_name_or_path"]
    except (OSError, KeyError, json.JSONDecodeError):
        raise FineflowError(f"{adapter_dir}: cannot tell the base model; pass --base-dir") from None


def _base_or_none(params: Params, base_dir: Path | None, adapter_dir: Path) -> str | None:
    """A refused candidate is still recorded when its base cannot be told; only a promotion needs it."""
    try:
        return base_reference(params, base_dir, adapter_dir)
    except FineflowError:
        return None


# ---- what the registry records -----------------------------------------------------------------------


def candidate_record(
    params: Params,
    policy: GatePolicy,
    scores: dict,
    cid: str,
    adapter_dir: Path,
    base_dir: Path | None,
    eval_hash: str | None,
    manifest: dict,
    decision: Decision,
) -> dict:
    """candidates/<id>/record.json: metrics, per-sample scores, the bootstrap versus the base for every metric
    (the model card's table, with the gate's bootstrap settings: policy), the decision and the deterministic
    lineage. Base figures only when both the base's and the candidate's evaluations succeeded. A model that does
    not generate (train.objective's model_kind: the reward model) is never merged, and its record says its kind."""
    cfg = params.promote
    objective = objective_for(params.train.objective)
    candidate = scores.get("candidate") or {}
    base = scores.get("base") or {}
    base_ok = base.get("status", "ok") == "ok" and candidate.get("status", "ok") == "ok"
    return {
        "candidate_id": cid,
        "adapter_sha256": directory_hash(adapter_dir),
        "metrics": flatten(candidate.get("metrics") or {}),
        "samples": candidate.get("samples"),
        "base_metrics": flatten(base.get("metrics") or {}) if base_ok else {},
        "vs_base": bootstrap_per_metric(candidate, base, policy) if base_ok and candidate else {},
        "eval_data_sha256": eval_hash,
        "scores_sha256": manifest["eval"]["scores_sha256"],
        "decision": verdict(decision),
        "reason": decision.reason,
        "stats": decision.stats,
        "base_model": _base_or_none(params, base_dir, adapter_dir),
        "base_digest": scores.get("base_digest"),  # the base by content (base_source.base_digest), as evaluated
        "base_scored": scores.get("base_scored"),  # e.g. a QLoRA adapter scored on the 16-bit base (the card says)
        "lineage": deterministic(manifest),
        # whether the champion holds merged/ (promote.merged); rollback rebuilds it as it was promoted
        "merged": objective.generates
        and merged_export(cfg.merged, cfg.merged_auto_max_gb, _base_or_none(params, base_dir, adapter_dir)),
        **kind_field(objective.model_kind),
    }


def merged_export(setting: str, max_gb: float, base_ref: str | None) -> bool:
    """promote.merged: always / never, or auto: a merged copy only when the base's weight files are at most
    max_gb (a copy is the base's size again in DVC's cache at every promotion). A base whose size cannot be told
    here (a hub id not in the local cache) is taken as large."""
    if setting != "auto":
        return setting == "always"
    size = base_weight_bytes(base_ref) if base_ref else None
    return size is not None and size <= max_gb * 1e9


def base_weight_bytes(base_ref: str) -> int | None:
    """The bytes of the base's weight files, or None when the base is not found locally."""
    from fineflow.registry.merge import WEIGHT_FILES, local_base

    try:
        folder = local_base(base_ref)
    except FineflowError:
        return None
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_FILES))


def verdict(decision: Decision) -> str:
    return "promoted" if decision.promote else "refused"


def log_entry(params: Params, record: dict, decision: Decision, champion: dict | None) -> dict:
    """The promotion log's entry for this decision: the evidence, and digests of what it was computed from."""
    return {
        "candidate_id": record["candidate_id"],
        "adapter_sha256": record["adapter_sha256"],
        "decision": verdict(decision),
        **decision_record(decision),
        "metrics": record["metrics"],
        "eval_data_sha256": record["eval_data_sha256"],
        "scores_sha256": record["scores_sha256"],
        "lineage_sha256": json_digest(record["lineage"]),
        "champion_before": champion["id"] if champion else None,
        "params": params.model_dump(mode="json", by_alias=True),
        **kind_field(record_kind(record)),
        **({"export_parity": record["export_parity"]} if "export_parity" in record else {}),
    }


def json_digest(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def stage_report(decision: Decision, cid: str, log_seq: int, lineage_path: Path | None) -> dict:
    stats = decision.stats or {}
    return {
        "decision": verdict(decision),
        "reason": decision.reason,
        "candidate_id": cid,
        "primary_metric": decision.primary,
        "candidate_value": decision.candidate,
        "reference_value": decision.reference,
        "reference": decision.reference_name,
        "delta": stats.get("delta"),
        "ci_low": stats.get("ci_low"),
        "ci_high": stats.get("ci_high"),
        "p_value": stats.get("p_value"),
        "confidence": stats.get("confidence"),  # what the CI's label says (promote.confidence)
        "log_seq": log_seq,
        "lineage": str(lineage_path) if lineage_path else None,
        # what changed since the champion (eval data, base model) and how the policy handled it
        **decision.context,
    }


# ---- the champion directory --------------------------------------------------------------------------


def build_champion(staging: Path, source: Path, base_ref: str, record: dict, train: dict | None) -> Path:
    """Assemble a complete champion directory at staging: adapter files, merged model (unless the record says
    not: promote.merged; the champion is then the adapter and its base's identity in champion.json), tokenizer,
    card, lineage.json. log_decision then writes champion.json and logs every file's hash; install_built swaps
    it in."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(source, staging, ignore=shutil.ignore_patterns(RECORD_FILE))
    is_adapter = (source / "adapter_config.json").exists()
    merged = is_adapter and record.get("merged", True)  # records from before promote.merged: merged
    if is_adapter and not merged and not record.get("base_digest"):
        raise FineflowError(
            f"{source}: an adapter-only champion (promote.merged) points at its base by content, but the scores "
            "name no base_digest; run the evaluate stage (it records it), or set promote.merged: always"
        )
    tokenizer = AutoTokenizer.from_pretrained(base_ref)
    if merged:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(base_ref, dtype="auto")
        merged = PeftModel.from_pretrained(base, str(source)).merge_and_unload()
        with torch.no_grad():
            merged.save_pretrained(staging / "merged")  # transformers 5 writes safetensors only
        tokenizer.save_pretrained(staging / "merged")
    tokenizer.save_pretrained(staging)
    lineage = {"candidate_id": record["candidate_id"], **(record.get("lineage") or {})}
    write_json_atomic(staging / "lineage.json", lineage)
    (staging / "README.md").write_text(model_card(record, base_ref, train, is_adapter, merged), encoding="utf-8")
    return staging


def install_built(staging: Path, champion_dir: Path, registry_dir: Path, cid: str, record: dict, seq: int) -> None:
    """Make the assembled staging dir the champion cid, after log entry seq was written: its champion.json (the
    one log_decision wrote, again), the atomic swap, then the registry's alias, which records the installed
    directory's content hash (what verify checks a champion whose entry has no champion_files against)."""
    write_json_atomic(staging / CHAMPION_FILE, champion_json(record, seq))
    files_sha256 = champion_files_hash(staging)
    swap_in(staging, champion_dir)
    set_alias(registry_dir, cid, seq, files_sha256, record_kind(record))


def champion_json(record: dict, seq: int) -> dict:
    """models/champion/champion.json: which candidate is installed, by which log entry, and its evidence."""
    return {
        "candidate_id": record["candidate_id"],
        "metrics": record.get("metrics"),
        "promotion_seq": seq,
        "eval_data_sha256": record.get("eval_data_sha256"),
        "base_model": record.get("base_model"),
        "base_digest": record.get("base_digest"),
        "stats": record.get("stats"),
        **kind_field(record_kind(record)),
    }
