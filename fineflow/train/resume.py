"""Which checkpoint a train run resumes from, and which it must refuse.

Checkpoints live in ``<checkpoints>/<run id>/step-N``, where the run id is a hash of everything that makes
two runs' step N the same state: the base model's weights *by content*, method and adapter shape, the
training data (the shard's content key), seed, ranks, batch and optimizer/schedule settings, the training
code and the versions of the libraries it runs on. With ``train.elastic`` the ranks and the accumulation give
way to the global batch they make (``fineflow.train.elastic``): another world size with the same global batch
is the same run. A re-run with the same inputs finds its own directory and continues from the newest *valid*
checkpoint there (fineflow.checkpoint verifies hashes and skips torn or corrupt ones) — but only if that run
was interrupted: a run that finished (its model was saved, see ``mark_finished``) is never resumed, so a re-run
always trains; it cannot hand back an earlier run's result.

Other inputs get another directory and start fresh — unless a run was left unfinished with other *params*
(the same base, data and code): then ``train.resume: auto`` refuses, naming what changed, because the user
most likely edited params between a crash and its retry. An unfinished run of another base, data, code or
library version is stale (it can never be resumed by these inputs) and is left alone. ``train.resume:
never`` starts this configuration over (its old checkpoints are removed) and ignores the others.

On the ranks, ``resume_point``: rank 0 decides (``plan_resume``), every rank loads the same checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from fineflow.base_source import base_identity
from fineflow.errors import FineflowError
from fineflow.train.elastic import Layout, check_movable, elastic_identity

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
    "launcher",  # who places the ranks: the same ranks train the same way (local and ray give the same bytes)
    "max_restarts",
    "ray",
    "slurm",
}


# What a run's trajectory depends on besides its params: the code that trains (the fineflow modules a
# training rank runs, relative to the package) and the libraries under it.
TRAINING_CODE = (
    "train",
    "checkpoint",
    "tokenize",
    "core/config.py",  # and the section models whose defaults a run trains with
    "param_section.py",
    "core/model_config.py",
    "core/tokenize_config.py",
    "core/train_config.py",
    "core/launch_config.py",
    "base_source.py",
    "errors.py",
)
TRAINING_LIBRARIES = (
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "safetensors",
    "numpy",
    "bitsandbytes",
    "deepspeed",
)
FINISHED = "FINISHED"  # in a run directory: the run completed and its model was saved; never resume it
# settings that decide a run's trajectory: an unfinished run that differs in these was edited, not replaced
PARAM_KEYS = ("train", "seed", "seq_len", "world_size", "global_batch")


def code_identity() -> dict:
    """A hash of the training code (every file of TRAINING_CODE, by content) and the library versions."""
    from importlib import metadata

    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for entry in TRAINING_CODE:
        files = sorted((package / entry).rglob("*.py")) if (package / entry).is_dir() else [package / entry]
        for file in files:
            digest.update(str(file.relative_to(package)).encode() + b"\0" + file.read_bytes() + b"\0")
    versions = {}
    for name in TRAINING_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"sha256": digest.hexdigest(), "libraries": versions}


def run_fingerprint(
    params,
    base: str,
    shard_meta: dict,
    world_size: int,
    cache_dir: Path | None = None,
    code: dict | None = None,
) -> dict:
    """Plain JSON (lists, not tuples): it is compared with the copy stored in each checkpoint. cache_dir: where
    base weight hashes are cached (the train stage's --hash-cache; never inside a DVC output, whose hash would
    then depend on the checkout's paths); code: code_identity(), computed here if not given. params are the
    planner's (fineflow.train.run_plan.RunPlan.params): the train settings the run really uses (precision "auto"
    resolved, auto_fit's changes), so "auto" on a CPU and on a GPU are different runs."""
    train = {k: v for k, v in params.train.model_dump().items() if k not in NOT_IN_FINGERPRINT}
    fingerprint = {
        "base": base_identity(base, cache_dir),
        "data": shard_meta.get("content_key"),
        "code": code if code is not None else code_identity(),
        "seed": params.seed,
        "seq_len": params.tokenize.seq_len,
        "world_size": world_size,
        "train": train,
    }
    return elastic_identity(fingerprint, params.train, world_size) if params.train.elastic else fingerprint


def mark_finished(run_dir: Path, step: int) -> None:
    """Rank 0, after the run's model was saved: this run is complete and will never be resumed."""
    from fineflow.core.reports import write_json_atomic

    write_json_atomic(Path(run_dir) / FINISHED, {"step": step})


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


def plan_resume(root: Path, fingerprint: dict, mode: str, log=print, layout: Layout | None = None) -> ResumePlan:
    """Rank 0 decides (other ranks read the same directory: a shared filesystem is assumed). layout: this run's
    ranks and accumulation; an elastic run's own checkpoint of sharded states on other ranks is refused."""
    from fineflow.checkpoint import clean_stale, latest_valid

    run_dir = Path(root) / run_id(fingerprint)
    if (run_dir / FINISHED).exists():
        # a re-run of inputs that trained to completion before (dvc repro --force, a lost output): train again
        # rather than hand back that run's result without training
        log(f"{run_dir} is a finished run: training again from step 0 (only an interrupted run is resumed)")
        shutil.rmtree(run_dir)
        return ResumePlan(run_dir, None)
    if mode == "never":
        shutil.rmtree(run_dir, ignore_errors=True)
        return ResumePlan(run_dir, None)
    if run_dir.exists():
        clean_stale(run_dir)  # first: a crash mid re-save leaves the published checkpoint as .old-step-N
    own = latest_valid(run_dir, expected_fingerprint=fingerprint) if run_dir.exists() else None
    if own is not None:
        if layout is not None:
            check_movable(own, _state(own), layout)
        return ResumePlan(run_dir, own)
    for other in sorted(p for p in Path(root).glob("*") if p.is_dir() and p != run_dir):
        checkpoint = latest_valid(other, on_mismatch="ignore")
        if checkpoint is None:
            continue
        state = _state(checkpoint)
        if (other / FINISHED).exists() or state.get("step", 0) >= state.get("total_steps", 0):
            continue
        old = state.get("fingerprint") or {}
        if any(old.get(key) != fingerprint.get(key) for key in fingerprint if key not in PARAM_KEYS):
            # another base, data, code or library version: these inputs can never resume it, and nobody
            # edited params by mistake; it stays on disk for train.resume/retention to deal with
            log(f"{checkpoint}: an unfinished run of other inputs (base, data or code), not resumed")
            continue
        changes = changed_keys(old, fingerprint)
        raise FineflowError(
            f"{checkpoint} is an unfinished run (step {state['step']} of {state['total_steps']}) of another "
            f"configuration; resuming it with these params would not continue the same training. Changed: "
            f"{'; '.join(changes[:8]) or 'unknown'}. Restore those params to resume it, or set "
            f"train.resume: never to start this configuration fresh (the other run's checkpoints are kept)."
        )
    return ResumePlan(run_dir, None)


def resume_point(accelerator, checkpoints: Path, fingerprint: dict, mode: str, store=None):
    """(run directory, loaded checkpoint or None): rank 0 decides, every rank loads the same one. store
    (checkpoint.store, a fineflow.checkpoint.StoreConfig): each node first downloads the store's newest valid
    checkpoint of this run when its own directory has none as new."""
    from fineflow.checkpoint import load_checkpoint
    from fineflow.checkpoint.remote_store import fetch_for_resume
    from fineflow.train.fsdp import require_visible_to_every_rank

    fetch_for_resume(accelerator, Path(checkpoints) / run_id(fingerprint), store, FINISHED, fresh=mode == "never")
    decision = [None]
    if accelerator.is_main_process:
        layout = Layout(accelerator.num_processes, accelerator.gradient_accumulation_steps)
        plan = plan_resume(checkpoints, fingerprint, mode, layout=layout)
        decision = [str(plan.checkpoint) if plan.checkpoint else None]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        decision = broadcast_object_list(decision)
    plan = ResumePlan(checkpoints / run_id(fingerprint), Path(decision[0]) if decision[0] else None)
    if plan.checkpoint is not None:  # every rank loads it from its own mount: node-local dirs are refused
        require_visible_to_every_rank(accelerator, plan.checkpoint, "resume from")
    # latest_valid (rank 0) just hashed every file of it: load without hashing it all again
    return plan.run_dir, (load_checkpoint(plan.checkpoint, verify=False) if plan.checkpoint else None)
