"""Reading checkpoints back without ever trusting one that does not verify: the marker and the manifest
agree, every file has its size and sha256 (deep: every .safetensors parses and is finite); the newest
valid checkpoint under a root, with the fingerprint check; and loading one as CPU tensors and plain
objects. Reads only: nothing here changes a directory."""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fineflow.checkpoint.format import (
    CHUNK,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MARKER,
    SHARDED_DIR,
    STEP_DIR,
    CheckpointError,
    CheckpointWarning,
    CorruptCheckpoint,
    _step_dirs,
    from_tree,
    required_files,
)


def _candidates(root: Path) -> list[tuple[int, Path]]:
    """Step directories, newest first, plus any .old-step-N whose step-N is gone: a crash between the
    two renames of a re-save leaves the published checkpoint there until clean_stale() moves it back."""
    found = dict(_step_dirs(root))
    if root.is_dir():
        for path in root.iterdir():
            match = STEP_DIR.match(path.name[len(".old-") :]) if path.name.startswith(".old-") else None
            if match and int(match.group(1)) not in found:
                found[int(match.group(1))] = path
    return sorted(found.items(), reverse=True)


def _sha256_file(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buffer):
            digest.update(view[:n])
            size += n
    return digest.hexdigest(), size


def read_manifest(path: Path) -> dict:
    """The manifest, if the marker exists and names its hash; CorruptCheckpoint otherwise."""
    path = Path(path)
    try:
        marker = (path / MARKER).read_text(encoding="utf-8").split()
    except FileNotFoundError:
        raise CorruptCheckpoint(path / MARKER, "missing (the save did not finish)") from None
    try:
        raw = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise CorruptCheckpoint(path / MANIFEST, "missing") from None
    if marker != ["sha256", hashlib.sha256(raw).hexdigest()]:
        raise CorruptCheckpoint(path / MANIFEST, "sha256 does not match the COMPLETE marker")
    try:
        manifest = json.loads(raw)
        if manifest["format"] != FORMAT or not isinstance(manifest["files"], dict) or "step" not in manifest:
            raise ValueError("not a fineflow checkpoint")
        version = int(manifest["version"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpoint(path / MANIFEST, f"unreadable ({exc})") from None
    if version > FORMAT_VERSION:
        raise CorruptCheckpoint(
            path / MANIFEST,
            f"format version {manifest['version']} is newer than this "
            f"fineflow reads ({FORMAT_VERSION}); upgrade fineflow",
        )
    return manifest


def verify_checkpoint(path: Path, deep: bool = False) -> dict:
    """Check a checkpoint directory; returns its manifest or raises CorruptCheckpoint naming the file.

    Always: the marker and manifest agree, every required file is listed, and every listed file has its
    size and sha256. With deep=True also: each .safetensors file parses (with the safetensors library,
    not our writer's own idea of the format), its tensors are all finite, and the model is non-empty.
    """
    path = Path(path)
    manifest = read_manifest(path)
    files = manifest["files"]
    for name in required_files(manifest):
        if name not in files:
            raise CorruptCheckpoint(path / name, "not in the manifest")
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            raise CorruptCheckpoint(file, "missing")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CorruptCheckpoint(file, f"truncated or resized: {size} bytes, the manifest says {entry['size']}")
        if _sha256_file(file)[0] != entry["sha256"]:
            raise CorruptCheckpoint(file, "sha256 mismatch")
    if deep:
        for name in files:
            if name.endswith(".safetensors"):
                _check_tensors(path / name, require_nonempty=name == "model.safetensors")
    return manifest


def _check_tensors(file: Path, require_nonempty: bool) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as reader:
            names = list(reader.keys())
            elements = 0
            for name in names:
                tensor = reader.get_tensor(name)
                elements += tensor.numel()
                if not all_finite(tensor):
                    raise CorruptCheckpoint(file, f"tensor '{name}' has NaN or inf values")
    except CorruptCheckpoint:
        raise
    except Exception as exc:  # safetensors raises its own error types for a malformed file
        raise CorruptCheckpoint(file, f"not a loadable safetensors file ({exc})") from None
    if require_nonempty and elements == 0:
        raise CorruptCheckpoint(file, "empty: no trainable tensors were saved")


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or inf, checked in numpy: in the writer thread a torch op would start a second OpenMP team
    next to the training's threads and slow its steps."""
    if not tensor.is_floating_point():
        return True
    if tensor.dtype in (torch.float16, torch.float32, torch.float64):
        return bool(np.isfinite(tensor.numpy()).all())
    if tensor.dtype == torch.bfloat16:  # no numpy bfloat16: all exponent bits set means inf or NaN
        return not bool(((tensor.view(torch.int16).numpy() & 0x7F80) == 0x7F80).any())
    return bool(torch.isfinite(tensor).all())  # float8 formats: rare, and their NaN encodings differ


def _describe_fingerprint_change(found: Any, expected: Any) -> str:
    if isinstance(found, dict) and isinstance(expected, dict):
        keys = sorted(set(found) | set(expected))
        return "; ".join(
            f"{k}: {found.get(k)!r} in the checkpoint, {expected.get(k)!r} now"
            for k in keys
            if found.get(k) != expected.get(k)
        )
    return f"{found!r} in the checkpoint, {expected!r} now"


def latest_valid(root: str | Path, expected_fingerprint: Any = None, on_mismatch: str = "refuse") -> Path | None:
    """The newest checkpoint under root whose marker, manifest and hashes check out, or None.

    Torn or corrupt ones are skipped with a CheckpointWarning naming the bad file and the one used
    instead. If expected_fingerprint is given and differs from the chosen checkpoint's
    state["fingerprint"], raise CheckpointError (on_mismatch="refuse") or warn and use it ("ignore").
    Reads only; never changes the directory.
    """
    if on_mismatch not in ("refuse", "ignore"):
        raise ValueError(f"on_mismatch must be 'refuse' or 'ignore', not {on_mismatch!r}")
    root = Path(root)
    skipped: list[str] = []
    for _, path in _candidates(root):
        try:
            manifest = verify_checkpoint(path)
        except CorruptCheckpoint as exc:
            skipped.append(str(exc))
            continue
        for problem in skipped:
            warnings.warn(f"{problem}; using {path.name}", CheckpointWarning, stacklevel=2)
        if expected_fingerprint is not None:
            _check_fingerprint(path, manifest, expected_fingerprint, on_mismatch)
        return path
    for problem in skipped:
        warnings.warn(f"{problem}; no valid checkpoint left in {root}", CheckpointWarning, stacklevel=2)
    return None


def _check_fingerprint(path: Path, manifest: dict, expected: Any, on_mismatch: str) -> None:
    state = _read_part(path, "state", manifest["files"])
    found = state.get("fingerprint") if isinstance(state, dict) else None
    expected = json.loads(json.dumps(expected))  # compare as stored: tuples become lists
    if found == expected:
        return
    change = _describe_fingerprint_change(found, expected)
    message = (
        f"{path}: this checkpoint was made by a different configuration ({change}); resuming from it "
        f"would mix incompatible model, optimizer or data state"
    )
    if on_mismatch == "ignore":
        warnings.warn(message + "; using it anyway (on_mismatch='ignore')", CheckpointWarning, stacklevel=3)
        return
    raise CheckpointError(message + f". Start fresh with train.resume: never, or move {path.parent} away.")


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    model_tensors: dict[str, torch.Tensor]
    optimizer_state_dict: dict
    scheduler_state_dict: dict
    state: dict
    rng_snapshots: list
    grad_scaler_state: dict | None = None
    metric: float | None = None
    # a sharded checkpoint (FSDP): the ranks' shards of model and optimizer, which every rank loads itself
    # (fineflow.train.fsdp.load_sharded); model_tensors is then empty and optimizer_state_dict None
    sharded_dir: Path | None = None


def _read_part(path: Path, stem: str, files: dict) -> Any:
    from safetensors.torch import load_file

    tree = json.loads((path / f"{stem}.json").read_text(encoding="utf-8"))
    tensors = load_file(str(path / f"{stem}.safetensors")) if f"{stem}.safetensors" in files else {}
    return from_tree(tree, tensors)


def load_checkpoint(path: str | Path, verify: bool = True) -> LoadedCheckpoint:
    """Everything a checkpoint holds, as CPU tensors and plain objects ready for load_state_dict.
    verify=True re-checks the marker and every hash first (CorruptCheckpoint names the bad file)."""
    from safetensors.torch import load_file

    path = Path(path)
    manifest = verify_checkpoint(path) if verify else read_manifest(path)
    files = manifest["files"]
    sharded = manifest.get("layout") == "sharded"
    return LoadedCheckpoint(
        path=path,
        step=int(manifest["step"]),
        metric=manifest.get("metric"),
        model_tensors={} if sharded else load_file(str(path / "model.safetensors")),
        optimizer_state_dict=None if sharded else _read_part(path, "optimizer", files),
        sharded_dir=path / SHARDED_DIR if sharded else None,
        scheduler_state_dict=_read_part(path, "scheduler", files),
        state=_read_part(path, "state", files),
        rng_snapshots=_read_part(path, "rng", files),
        grad_scaler_state=_read_part(path, "grad_scaler", files) if "grad_scaler.json" in files else None,
    )
