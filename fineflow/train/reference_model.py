"""The model a preference run continues, by content: the champion's identity (for the fingerprint stage) and the
reference_logps stage's ``reference.json``.

An anchored objective (fineflow.objectives: dpo, simpo, orpo, kto) starts its policy from the model that
train.preference.reference names: ``champion`` (the registry's champion adapter on the base: the SFT model once an
SFT run was promoted; the base while there is none) or ``base`` (a fresh adapter). dpo and kto (needs_reference)
also score every row once with that model frozen, their reference; simpo and orpo only start from it. Either way
evaluate measures the candidate's preference rewards from it. The champion lives in models/champion, which promote
writes after train, so no stage can declare it as a dependency (a cycle): the fingerprint stage, which always runs,
writes its identity to models/champion_fingerprint.json, and the reference stage depends on that file. Only a run
that anchors to the champion records one; every other configuration writes the constant ``{"champion": null}``,
so a promotion re-runs nothing in an SFT pipeline (or one anchored to the base).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from fineflow.core.reports import read_json, sha256_file
from fineflow.core.train_config import TrainParams
from fineflow.errors import FineflowError
from fineflow.objectives import objective_for

NO_CHAMPION = {"champion": None}
REFERENCE_FILE = "reference.json"
ADAPTER_DIR = "adapter"  # in models/reference_logps: the champion's adapter the reference and the policy start from
CHAMPION_RECORD = "champion.json"  # in models/champion (fineflow.registry.champion.champion_json)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def needs_reference(cfg: TrainParams) -> bool:
    """Whether train.objective scores its pairs against a frozen reference model (fineflow.objectives)."""
    return objective_for(cfg.objective).needs_reference


def anchored(cfg: TrainParams) -> bool:
    """Whether train.objective starts from train.preference.reference's model (fineflow.objectives)."""
    return objective_for(cfg.objective).anchored


def anchors_to_champion(cfg: TrainParams) -> bool:
    return anchored(cfg) and cfg.preference.reference == "champion"


def champion_adapter(champion_dir: Path) -> Path | None:
    """The champion's PEFT adapter folder (at the top of models/champion, or in its adapter/), None when there is
    no champion or it is a fully fine-tuned model (no adapter to start a policy from)."""
    for folder in (Path(champion_dir), Path(champion_dir) / ADAPTER_DIR):
        if all((folder / name).is_file() for name in ADAPTER_FILES):
            return folder
    return None


def adapter_sha256(adapter: Path) -> str:
    """One sha256 over the adapter's config and weights (what the reference's log-probs are a function of)."""
    digest = hashlib.sha256()
    for name in ADAPTER_FILES:
        digest.update(name.encode() + b"\0" + bytes.fromhex(sha256_file(adapter / name)))
    return digest.hexdigest()


def champion_identity(champion_dir: Path) -> dict | None:
    """{"champion": id, "base_digest": the base it was trained on, "adapter_sha256": ...}; None without one."""
    adapter = champion_adapter(champion_dir)
    if adapter is None:
        return None
    try:
        record = read_json(Path(champion_dir) / CHAMPION_RECORD)
    except (OSError, ValueError):
        record = {}
    return {
        "champion": record.get("candidate_id"),
        "base_digest": record.get("base_digest"),
        "adapter_sha256": adapter_sha256(adapter),
    }


def champion_fingerprint(cfg: TrainParams, champion_dir: Path) -> dict:
    """The fingerprint stage's models/champion_fingerprint.json: the champion's identity when this run anchors
    to it (an anchored objective, reference champion), else NO_CHAMPION (also while nothing was promoted yet)."""
    if not anchors_to_champion(cfg):
        return dict(NO_CHAMPION)
    return champion_identity(champion_dir) or dict(NO_CHAMPION)


def reference_record(
    cfg: TrainParams, base: str | None, adapter: dict | None, shard_keys: dict, compute: str, note: str
) -> dict:
    """reference.json: the model the run starts from, whether its log-probs were computed (``needed``), and its key
    (a function of everything the start and those log-probs depend on). An objective that is not anchored (sft, the
    reward model) gets a constant record, so its pipelines never re-run train over it."""
    if not anchored(cfg):
        return {"objective": cfg.objective, "needed": False}
    record = {
        "objective": cfg.objective,
        "needed": needs_reference(cfg),
        "reference": cfg.preference.reference,
        "base_digest": base,
        "champion": adapter.get("champion") if adapter else None,
        "adapter_sha256": adapter.get("adapter_sha256") if adapter else None,
        "shards": shard_keys,
        "compute": compute,  # the dtype the log-probs were computed in
        "note": note,
    }
    record["key"] = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:32]
    return record


@dataclass(frozen=True)
class Reference:
    """The reference_logps stage's output as the train stage reads it (an anchored objective)."""

    record: dict  # reference.json
    adapter: Path | None  # the adapter the policy starts from (the reference's); None: a fresh one on the base
    logps: dict  # split -> the per-token log-probs file; empty when the objective needs no reference


def load_reference(cfg: TrainParams, reference_dir: Path | None) -> Reference | None:
    """An anchored objective: models/reference_logps as the reference_logps stage wrote it, checked against params
    (the stage ran for this configuration); None for an objective that starts from nothing (sft, the reward model)."""
    from fineflow.train.pair_shards import logps_file

    if not anchored(cfg):
        return None
    rerun = "run the reference_logps stage (dvc repro reference_logps) before train"
    if reference_dir is None:
        raise FineflowError(f"train.objective {cfg.objective} needs the reference_logps stage's output: {rerun}")
    try:
        record = read_json(Path(reference_dir) / REFERENCE_FILE)
    except (OSError, ValueError) as exc:
        raise FineflowError(f"{reference_dir}/{REFERENCE_FILE}: cannot read it ({exc}): {rerun}") from None
    needed = needs_reference(cfg)
    if record.get("needed") != needed or record.get("reference") != cfg.preference.reference:
        said = record.get("reference") or "none"
        said += f" (objective {record.get('objective')}, log-probs {'computed' if record.get('needed') else 'none'})"
        raise FineflowError(
            f"{reference_dir}/{REFERENCE_FILE}: the reference was computed for reference {said}, but params say "
            f"train.objective {cfg.objective}, train.preference.reference {cfg.preference.reference}: {rerun}"
        )
    adapter = Path(reference_dir) / ADAPTER_DIR if record.get("adapter_sha256") else None
    logps = {split: Path(reference_dir) / logps_file(split) for split in ("train", "eval")} if needed else {}
    return Reference(record, adapter, logps)


def check_reference_shards(reference: Reference, shard_keys: dict) -> None:
    """The reference's log-probs are aligned with these very shards (their content keys), else refused."""
    computed = reference.record.get("shards") or {}
    stale = [split for split, key in shard_keys.items() if computed.get(split) != key]
    if stale:
        raise FineflowError(
            f"the reference log-probs were computed on other {'/'.join(stale)} shards (content key "
            f"{computed.get(stale[0])}, the shard's is {shard_keys[stale[0]]}): run the reference_logps stage again "
            f"(dvc repro reference_logps) after tokenize"
        )
