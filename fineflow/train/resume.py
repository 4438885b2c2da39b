"""Which checkpoint a train run resumes from, and which it must refuse.

Checkpoints live in ``<checkpoints>/<run id>/step-N``, where the run id is a hash of everything that makes
two runs' step N the same state: base model, method and adapter shape, the training data (the shard's
content key), seed, ranks, batch and optimizer/schedule settings. A re-run with the same config finds its
own directory and continues from the newest *valid* checkpoint there (fineflow.checkpoint verifies
hashes and skips torn or corrupt ones). A changed config gets a new directory and starts fresh — unless a
run of another config was left unfinished (crashed before its last step): then ``train.resume: auto``
refuses, naming what changed, because the user most likely edited params between a crash and its retry.
``train.resume: never`` starts this config over (its old checkpoints are removed) and ignores the others.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from fineflow.errors import FineflowError

# settings that change neither the trajectory nor the weights: safe to edit between a crash and a retry
NOT_IN_FINGERPRINT = {
    "log_every",
    "eval_every",
    "resume",
    "prefetch",
    "tracker",
    "auto_fit",
    "device_memory_gib",
    "accelerate_profile",
    "num_machines",
}


def base_identity(reference: str) -> dict:
    """What identifies the base model: its config and weight files (names and sizes) for a local dir,
    the id otherwise. Hashing the weights themselves would cost minutes on a 70B model at every start."""
    path = Path(reference)
    if not path.is_dir():
        return {"id": reference}
    config = (path / "config.json").read_bytes() if (path / "config.json").exists() else b""
    weights = sorted([p.name, p.stat().st_size] for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
    return {"config_sha256": hashlib.sha256(config).hexdigest(), "weights": weights}


def run_fingerprint(params, reference: str, shard_meta: dict, world_size: int) -> dict:
    """Plain JSON (lists, not tuples): it is compared with the copy stored in each checkpoint."""
    train = {k: v for k, v in params.train.model_dump().items() if k not in NOT_IN_FINGERPRINT}
    return {
        "base": base_identity(reference),
        "data": shard_meta.get("content_key"),
        "seed": params.seed,
        "seq_len": params.tokenize.seq_len,
        "world_size": world_size,
        "train": train,
    }


def run_id(fingerprint: dict) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:12]


def changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ, with both values: what the user changed."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


@dataclass
class ResumePlan:
    run_dir: Path
    checkpoint: Path | None  # the newest valid checkpoint to resume from; None: a fresh start


def _state(checkpoint: Path) -> dict:
    from fineflow.checkpoint import from_tree

    return from_tree(json.loads((checkpoint / "state.json").read_text(encoding="utf-8")), {})


def plan_resume(root: Path, fingerprint: dict, mode: str) -> ResumePlan:
    """Rank 0 decides (other ranks read the same directory: a shared filesystem is assumed)."""
    from fineflow.checkpoint import clean_stale, latest_valid

    run_dir = Path(root) / run_id(fingerprint)
    if mode == "never":
        shutil.rmtree(run_dir, ignore_errors=True)
        return ResumePlan(run_dir, None)
    if run_dir.exists():
        clean_stale(run_dir)  # first: a crash mid re-save leaves the published checkpoint as .old-step-N
    own = latest_valid(run_dir, expected_fingerprint=fingerprint) if run_dir.exists() else None
    if own is not None:
        return ResumePlan(run_dir, own)
    for other in sorted(p for p in Path(root).glob("*") if p.is_dir() and p != run_dir):
        checkpoint = latest_valid(other, on_mismatch="ignore")
        if checkpoint is None:
            continue
        state = _state(checkpoint)
        if state.get("step", 0) < state.get("total_steps", 0):
            changes = changed_keys(state.get("fingerprint") or {}, fingerprint)
            raise FineflowError(
                f"{checkpoint} is an unfinished run (step {state['step']} of {state['total_steps']}) of another "
                f"configuration; resuming it with these params would not continue the same training. Changed: "
                f"{'; '.join(changes[:8]) or 'unknown'}. Restore those params to resume it, or set "
                f"train.resume: never to start this configuration fresh (the other run's checkpoints are kept)."
            )
    return ResumePlan(run_dir, None)
