"""The promotion gate and the on-disk model registry.

A candidate becomes champion only if its primary metric beats the reference (the current champion, or
the base model when there is none) by ``promote.min_delta`` and no other metric regresses by more than
``promote.max_regression``. Every decision, promoted or not, is appended to the registry's promotion log
with the evidence; each entry carries the sha256 of the previous one, so edited history is detectable.

The champion is a stable path (``models/champion``) replaced atomically: the new one is assembled in a
temporary sibling directory and swapped in with renames.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

CHAMPION_FILE = "champion.json"
LOG_FILE = "promotions.jsonl"


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    primary: str
    candidate: float | None
    reference: float | None
    reference_name: str
    regressions: dict


def flatten(metrics: dict[str, dict[str, float]]) -> dict[str, float]:
    """{task: {metric: v}} -> {"task/metric": v}."""
    return {f"{task}/{name}": value for task, values in metrics.items() for name, value in values.items()}


def decide(candidate: dict[str, float], reference: dict[str, float], reference_name: str, primary: str,
           min_delta: float, max_regression: float) -> Decision:
    """The gate. Metrics are flat {"task/metric": value}, higher is better."""
    cand, ref = candidate.get(primary), reference.get(primary)
    if cand is None:
        return Decision(False, f"the candidate has no value for the primary metric {primary}", primary, None, ref,
                        reference_name, {})
    if ref is None:
        return Decision(False, f"the {reference_name} has no value for the primary metric {primary}", primary,
                        cand, None, reference_name, {})
    regressions = {key: round(reference[key] - value, 6) for key, value in candidate.items()
                   if key != primary and key in reference and reference[key] - value > max_regression}
    if regressions:
        return Decision(False, f"regressed beyond promote.max_regression={max_regression} on "
                               f"{sorted(regressions)} versus the {reference_name}", primary, cand, ref,
                        reference_name, regressions)
    if cand - ref < min_delta:
        return Decision(False, f"{primary} {cand:.4f} does not beat the {reference_name}'s {ref:.4f} by "
                               f"promote.min_delta={min_delta}", primary, cand, ref, reference_name, {})
    return Decision(True, f"{primary} {cand:.4f} beats the {reference_name}'s {ref:.4f} by {cand - ref:+.4f} "
                          f"(>= {min_delta}) with no regression", primary, cand, ref, reference_name, {})


def directory_hash(path: Path) -> str:
    """sha256 over the relative names and bytes of every file below path (sorted): a content id."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode() + b"\0")
        digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def read_champion(champion_dir: Path) -> dict | None:
    """The champion's record (its metrics at promotion), or None when there is no champion yet."""
    try:
        record = json.loads((champion_dir / CHAMPION_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    return record if record.get("candidate_id") else None


def install_champion(adapter_dir: Path, champion_dir: Path, record: dict) -> None:
    """Replace champion_dir with the adapter plus its record, via a temp dir and renames."""
    staging = champion_dir.with_name(f".{champion_dir.name}.staging")
    retired = champion_dir.with_name(f".{champion_dir.name}.retired")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(retired, ignore_errors=True)
    shutil.copytree(adapter_dir, staging)
    (staging / CHAMPION_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if champion_dir.exists():
        os.replace(champion_dir, retired)
    os.replace(staging, champion_dir)
    shutil.rmtree(retired, ignore_errors=True)


def ensure_empty_champion(champion_dir: Path) -> None:
    """Before the first promotion the champion path still exists (DVC tracks it), holding a null record."""
    champion_dir.mkdir(parents=True, exist_ok=True)
    if not (champion_dir / CHAMPION_FILE).exists():
        (champion_dir / CHAMPION_FILE).write_text(json.dumps({"candidate_id": None}) + "\n", encoding="utf-8")


def _entry_hash(line: str) -> str:
    return hashlib.sha256(line.encode("utf-8")).hexdigest()


def append_log(registry_dir: Path, entry: dict) -> dict:
    """Append entry to the promotion log, chained to the previous entry by its sha256."""
    registry_dir.mkdir(parents=True, exist_ok=True)
    path = registry_dir / LOG_FILE
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    full = {"seq": len(lines) + 1, "prev_sha256": _entry_hash(lines[-1]) if lines else None, **entry}
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(full, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return full


def decision_record(decision: Decision) -> dict:
    return asdict(decision)
