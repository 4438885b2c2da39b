"""Checkpoints you can trust: asynchronous, atomic, verified, and exactly resumable after kill -9.

One checkpoint is a directory ``<root>/step-0000123/``::

    model.safetensors        the trainable tensors only (for LoRA the adapter, never the frozen base)
    optimizer.json           the optimizer state_dict's structure (param groups, which tensor goes where)
    optimizer.safetensors    ... and its tensors (exp_avg, exp_avg_sq, step counters stay tensors)
    scheduler.json           the LR scheduler's state_dict (plain numbers; lambdas are not state)
    state.json               the caller's loop state: step, epoch, sampler position, counters, fingerprint
    rng.json, rng.safetensors  Python, NumPy and torch (CPU + CUDA) RNG states, one snapshot per rank
    grad_scaler.json         optional: the AMP GradScaler's state
    manifest.json            sha256 and size of every file above, the step and the metric
    COMPLETE                 written last; holds the manifest's sha256

Nothing is pickled: tensors go to safetensors and everything else to JSON, with small tags for what plain
JSON cannot say (tuples, integer dict keys, non-finite floats, numpy arrays) so that a state_dict comes
back with exactly the types ``load_state_dict`` expects. A checkpoint without a manifest and a marker that
agree, or whose files do not hash to the manifest, is never used.

Saving (``CheckpointManager.save``) blocks only while the state is copied into a reusable host buffer (for
the process backend, shared memory); writing, fsync, verification and the atomic rename happen in the
background, one save at a time. Typical use from a training loop::

    manager = CheckpointManager("checkpoints", keep_last=3, keep_best=1)
    path = manager.latest_valid(expected_fingerprint=fingerprint)
    if path is not None:
        ckpt = manager.load(path)
        manager.protect(path)
        ...  # load ckpt.model_tensors, ckpt.optimizer_state_dict, ...; restore_rng(ckpt.rng_snapshots[rank])
    for step in ...:
        ...
        manager.save(step, trainable, optimizer.state_dict(), scheduler.state_dict(), state, rngs, metric)
    manager.close()   # waits for the last save and raises its error, if any

One manager writes to a root at a time (rank 0); it cleans stale temporary directories when created.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import struct
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fineflow.errors import FineflowError

FORMAT = "fineflow-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MARKER = "COMPLETE"
REQUIRED_FILES = ("model.safetensors", "optimizer.json", "scheduler.json", "state.json", "rng.json")
STEP_DIR = re.compile(r"^step-(\d+)$")
CHUNK = 8 * 2**20  # write/hash granularity: large enough to be fast, small enough to interleave with training

# tags for values plain JSON cannot represent faithfully; keys starting with "__" are reserved for them
TENSOR, TUPLE, DICT, FLOAT, NDARRAY = "__tensor__", "__tuple__", "__dict__", "__float__", "__ndarray__"

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


class CheckpointError(FineflowError):
    """A checkpoint could not be written, verified or used; the message names the file and what to do."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint directory failed verification (torn, truncated, flipped bytes, missing marker)."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = path, problem


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupt or torn) or used despite a fingerprint mismatch."""


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


# ---------------------------------------------------------------------------------------------------------
# state_dict <-> (JSON structure, named tensors)
# ---------------------------------------------------------------------------------------------------------

def to_tree(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """A JSON-able copy of obj with every tensor replaced by a reference into `tensors` (filled here).

    Types that JSON would silently change are tagged so ``from_tree`` restores them exactly: tuples
    (AdamW's betas), dicts with non-string keys (an optimizer's per-parameter state is keyed by int),
    NaN/inf, numpy arrays (NumPy's RNG key). Anything else is refused rather than pickled.
    """
    if isinstance(obj, torch.Tensor):
        name = path or "tensor"
        while name in tensors:  # "a.b" as a key and as a path could collide
            name += "_"
        tensors[name] = obj
        return {TENSOR: name}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {FLOAT: repr(obj)}
    if isinstance(obj, np.ndarray):
        return {NDARRAY: {"dtype": obj.dtype.str, "shape": list(obj.shape), "data": obj.ravel().tolist()}}
    if isinstance(obj, np.generic):
        return to_tree(obj.item(), tensors, path)
    if isinstance(obj, tuple):
        return {TUPLE: [to_tree(v, tensors, f"{path}.{i}".lstrip(".")) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [to_tree(v, tensors, f"{path}.{i}".lstrip(".")) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: to_tree(v, tensors, f"{path}.{k}".lstrip(".")) for k, v in obj.items()}
        return {DICT: [[to_tree(k, tensors, f"{path}.key"), to_tree(v, tensors, f"{path}.{k}".lstrip("."))]
                       for k, v in obj.items()]}
    raise CheckpointError(f"cannot checkpoint {type(obj).__name__} at '{path or '<root>'}': only tensors, "
                          "numbers, strings, None, lists, tuples, dicts and numpy arrays are stored (no pickle)")


def from_tree(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of ``to_tree``."""
    if isinstance(tree, list):
        return [from_tree(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        (tag, value), = tree.items()
        if tag == TENSOR:
            return tensors[value]
        if tag == TUPLE:
            return tuple(from_tree(v, tensors) for v in value)
        if tag == DICT:
            return {_hashable(from_tree(k, tensors)): from_tree(v, tensors) for k, v in value}
        if tag == FLOAT:
            return float(value)
        if tag == NDARRAY:
            return np.asarray(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
    return {k: from_tree(v, tensors) for k, v in tree.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


# ---------------------------------------------------------------------------------------------------------
# snapshot: every tensor copied into one reusable host buffer laid out as the safetensors data sections
# ---------------------------------------------------------------------------------------------------------

@dataclass
class TensorFile:
    """One .safetensors file of a snapshot: its header bytes and where its data lies in the arena."""

    name: str
    header: bytes
    offset: int
    nbytes: int


@dataclass
class SaveJob:
    """Everything the background writer needs; picklable, so the process backend can receive it."""

    root: str
    step: int
    metric: float | None
    tensor_files: list[TensorFile]
    json_files: dict[str, bytes]
    arena: torch.Tensor  # uint8; for the process backend in shared memory (passed by file descriptor)
    keep_last: int
    keep_best: int
    protected: list[str]
    on_write_error: str
    retries: int
    retry_backoff_s: float


def _safetensors_layout(tensors: dict[str, torch.Tensor]) -> tuple[list[tuple[str, int, int]], int]:
    """(name, begin, nbytes) per tensor and the data size. Sorted by element size, largest first, so
    every tensor starts at a multiple of its element size with no padding (safetensors allows none)."""
    entries, offset = [], 0
    for name in sorted(tensors, key=lambda k: (-tensors[k].element_size(), k)):
        tensor = tensors[name]
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"cannot checkpoint tensor '{name}': dtype {tensor.dtype} has no safetensors type")
        nbytes = tensor.numel() * tensor.element_size()
        entries.append((name, offset, nbytes))
        offset += nbytes
    return entries, offset


def _safetensors_header(tensors: dict[str, torch.Tensor], entries: list[tuple[str, int, int]],
                        metadata: dict[str, str] | None) -> bytes:
    """The 8-byte little-endian length plus JSON header of a safetensors file, padded to 8 bytes so the
    data section is aligned for memory-mapped readers."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    for name, begin, nbytes in entries:
        tensor = tensors[name]
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [begin, begin + nbytes]}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _json_bytes(obj: Any, compact: bool = False) -> bytes:
    text = json.dumps(obj, separators=(",", ":")) if compact else json.dumps(obj, indent=2)
    return (text + "\n").encode("utf-8")


COMPACT_PARTS = ("optimizer", "rng")  # long lists of numbers: one line; the rest indented for people


def split_parts(model_tensors: dict[str, torch.Tensor], parts: dict[str, Any]) -> tuple[dict, dict[str, bytes]]:
    """{file name: (tensors, safetensors metadata)} and {file name: JSON bytes} for one checkpoint: the model
    as model.safetensors (names kept, so peft/transformers read it too), every other part as <part>.json
    plus <part>.safetensors when it holds tensors."""
    tensor_sets: dict[str, tuple[dict, dict | None]] = {"model.safetensors": (dict(model_tensors), {"format": "pt"})}
    json_files = {}
    for stem, obj in parts.items():
        tensors: dict[str, torch.Tensor] = {}
        json_files[f"{stem}.json"] = _json_bytes(to_tree(obj, tensors), compact=stem in COMPACT_PARTS)
        if tensors:
            tensor_sets[f"{stem}.safetensors"] = (tensors, None)
    return tensor_sets, json_files


def plan_files(tensor_sets: dict) -> tuple[list[tuple[TensorFile, dict, list]], int]:
    """Where each file's data goes in the arena (64-byte aligned), with its header; and the arena size."""
    planned, offset = [], 0
    for name, (tensors, metadata) in tensor_sets.items():
        entries, nbytes = _safetensors_layout(tensors)
        planned.append((TensorFile(name, _safetensors_header(tensors, entries, metadata), offset, nbytes),
                        tensors, entries))
        offset += -(-nbytes // 64) * 64
    return planned, offset


def _copy_into(arena: torch.Tensor, arena_bytes: np.ndarray, begin: int, tensor: torch.Tensor,
               non_blocking: bool) -> None:
    """Copy one tensor's bytes to arena[begin:], in the file's byte order."""
    nbytes = tensor.numel() * tensor.element_size()
    source = tensor.detach()
    if source.device.type == "cpu":
        # A plain single-threaded memcpy. torch's copy_ splits every tensor over the intra-op threads, and on
        # a busy machine each split waits for a descheduled thread: 700 MB took 1.4 s that way on 2 shared
        # cores, 0.07 s like this.
        source = source if source.is_contiguous() else source.contiguous()
        np.copyto(arena_bytes[begin:begin + nbytes], source.reshape(-1).view(torch.uint8).numpy())
    else:  # device-to-host: a DMA into the (pinned) arena, synchronized once after all copies
        target = arena[begin:begin + nbytes].view(tensor.dtype).view(tensor.shape)
        target.copy_(source, non_blocking=non_blocking)


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


def lower_priority() -> None:
    """Run this thread (the background writer) at the lowest CPU priority, so that on a busy machine it
    uses idle cycles instead of taking a core from the training threads (Linux: per-thread nice)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------------------------------------
# low-level writing: every byte of a checkpoint goes through write_all (tests inject faults here)
# ---------------------------------------------------------------------------------------------------------

WriteHook = Callable[[str, int], None]


def write_all(fd: int, data: memoryview, path: str, write_hook: WriteHook | None = None) -> None:
    """Write all of data to fd. The one place a checkpoint byte is written: a test injects ENOSPC by
    monkeypatching this function or by passing a write_hook(path, nbytes) that raises OSError."""
    if write_hook is not None:
        write_hook(path, len(data))
    while len(data):
        written = os.write(fd, data)  # releases the GIL: a writer thread does not stall the training loop
        data = data[written:]


def _write_file(path: Path, chunks: Iterable, write_hook: WriteHook | None) -> dict:
    """Create path, write the chunks, fsync; returns the manifest entry (sha256 of what was meant to be
    written, computed from memory, so verification compares the disk against the source)."""
    digest, size = hashlib.sha256(), 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                for start in range(0, len(view), CHUNK):
                    piece = view[start:start + CHUNK]
                    write_all(fd, piece, str(path), write_hook)
                    digest.update(piece)
                    size += len(piece)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        exc.filename = exc.filename or str(path)  # os.write does not say which file: the message must
        raise
    return {"sha256": digest.hexdigest(), "size": size}


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a new file, a rename) durable; without it a crash can lose them."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------
# the writer: temp dir -> files -> manifest -> marker -> fsync -> verify -> rename -> fsync parent
# ---------------------------------------------------------------------------------------------------------

def _write_checkpoint(job: SaveJob, write_hook: WriteHook | None) -> tuple[Path, dict]:
    """Returns the published path and how long writing (with fsync) and verifying took."""
    started = time.perf_counter()
    root = Path(job.root)
    final, tmp = root / step_dir_name(job.step), root / f".tmp-{step_dir_name(job.step)}"
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a failed attempt of the same step
    tmp.mkdir(parents=True)
    data = job.arena.numpy()
    files: dict[str, dict] = {}
    for spec in job.tensor_files:
        files[spec.name] = _write_file(tmp / spec.name, [spec.header, data[spec.offset:spec.offset + spec.nbytes]],
                                       write_hook)
    for name, payload in job.json_files.items():
        files[name] = _write_file(tmp / name, [payload], write_hook)
    # no timestamp: the same state must give the same bytes (DVC hashes checkpoints/ into dvc.lock, and
    # the Prefect flow and `dvc repro` must leave the same lock); the directory's mtime says when
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "step": job.step, "metric": job.metric,
                "files": files}
    manifest_bytes = _json_bytes(manifest)
    _write_file(tmp / MANIFEST, [manifest_bytes], write_hook)
    # the marker names the manifest's hash: a marker next to any other manifest is not a complete save
    _write_file(tmp / MARKER, [f"sha256 {hashlib.sha256(manifest_bytes).hexdigest()}\n".encode()], write_hook)
    fsync_dir(tmp)
    written = time.perf_counter()
    verify_checkpoint(tmp, deep=True)  # only a verified checkpoint is ever published
    verified = time.perf_counter()
    _publish(tmp, final)
    return final, {"files_s": written - started, "verify_s": verified - written}


def _publish(tmp: Path, final: Path) -> None:
    """Rename tmp to final atomically. Re-saving an existing step moves the old one aside first, so the
    rename never meets 'Directory not empty'; a crash between the renames is undone by clean_stale()."""
    aside = final.with_name(f".old-{final.name}")
    if final.exists():
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if aside.exists():
        shutil.rmtree(aside)


def newest_complete(root: Path, exclude: Path | None = None) -> Path | None:
    """The newest step directory carrying a marker (no hashing: for messages and retention)."""
    for _, path in sorted(_step_dirs(root), reverse=True):
        if path != exclude and (path / MARKER).exists():
            return path
    return None


def _write_error(job: SaveJob, exc: OSError, attempts: int) -> CheckpointError:
    root = Path(job.root)
    previous = newest_complete(root, exclude=root / step_dir_name(job.step))
    intact = (f"the previous checkpoint {previous} is intact" if previous is not None
              else "there is no previous checkpoint")
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    what = "disk full" if full else f"I/O error ({exc.strerror or exc})"
    advice = (f"Free space under {root} or lower checkpoint.keep_last." if full
              else f"Check the disk or mount that holds {root}.")
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    return CheckpointError(f"{what} while writing {exc.filename or root} (checkpoint step {job.step}){tries}; "
                           f"{intact}. {advice}")


def run_job(job: SaveJob, write_hook: WriteHook | None = None) -> dict:
    """Write, verify and publish one checkpoint, then apply retention; every backend runs this.

    An OSError (ENOSPC, EIO) removes the temp dir and, with on_write_error="retry", is retried with
    exponential backoff up to job.retries times; the previous checkpoint is never touched.
    """
    root = Path(job.root)
    tmp = root / f".tmp-{step_dir_name(job.step)}"
    started, attempt = time.perf_counter(), 0
    while True:
        try:
            path, timings = _write_checkpoint(job, write_hook)
            break
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if job.on_write_error == "retry" and attempt < job.retries:
                delay = job.retry_backoff_s * 2**attempt
                warnings.warn(f"{exc.filename}: {exc.strerror or exc} while saving step {job.step}; retrying in "
                              f"{delay:g}s ({attempt + 1} of {job.retries})", CheckpointWarning)
                time.sleep(delay)
                attempt += 1
                continue
            raise _write_error(job, exc, attempt + 1) from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    write_s = time.perf_counter() - started
    try:
        deleted = apply_retention(root, job.keep_last, job.keep_best, job.protected)
    except OSError as exc:  # the new checkpoint is published and valid: a failed cleanup must not undo that
        warnings.warn(f"{root}: retention failed ({exc}); old checkpoints were kept", CheckpointWarning)
        deleted = []
    return {"path": str(path), "step": job.step, "write_s": write_s, **timings, "attempts": attempt + 1,
            "bytes": sum(s.nbytes for s in job.tensor_files), "deleted": [str(p) for p in deleted]}


# ---------------------------------------------------------------------------------------------------------
# verification and reading
# ---------------------------------------------------------------------------------------------------------

def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]


def _candidates(root: Path) -> list[tuple[int, Path]]:
    """Step directories, newest first, plus any .old-step-N whose step-N is gone: a crash between the
    two renames of a re-save leaves the published checkpoint there until clean_stale() moves it back."""
    found = dict(_step_dirs(root))
    if root.is_dir():
        for path in root.iterdir():
            match = STEP_DIR.match(path.name[len(".old-"):]) if path.name.startswith(".old-") else None
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
        raise CorruptCheckpoint(path / MANIFEST, f"format version {manifest['version']} is newer than this "
                                                 f"fineflow reads ({FORMAT_VERSION}); upgrade fineflow")
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
    for name in REQUIRED_FILES:
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


def _describe_fingerprint_change(found: Any, expected: Any) -> str:
    if isinstance(found, dict) and isinstance(expected, dict):
        keys = sorted(set(found) | set(expected))
        return "; ".join(f"{k}: {found.get(k)!r} in the checkpoint, {expected.get(k)!r} now"
                         for k in keys if found.get(k) != expected.get(k))
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
    message = (f"{path}: this checkpoint was made by a different configuration ({change}); resuming from it "
               f"would mix incompatible model, optimizer or data state")
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
    return LoadedCheckpoint(
        path=path, step=int(manifest["step"]), metric=manifest.get("metric"),
        model_tensors=load_file(str(path / "model.safetensors")),
        optimizer_state_dict=_read_part(path, "optimizer", files),
        scheduler_state_dict=_read_part(path, "scheduler", files),
        state=_read_part(path, "state", files),
        rng_snapshots=_read_part(path, "rng", files),
        grad_scaler_state=_read_part(path, "grad_scaler", files) if "grad_scaler.json" in files else None)


# ---------------------------------------------------------------------------------------------------------
# retention and startup cleanup
# ---------------------------------------------------------------------------------------------------------

def _remove(path: Path) -> None:
    """Rename away first (atomic), then delete: a crash mid-delete leaves a .trash- dir, never a
    half-deleted step directory that looks like a checkpoint."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def select_retained(entries: list[tuple[int, Path, float | None]], keep_last: int, keep_best: int,
                    protected: Iterable[str]) -> set[Path]:
    """Which complete checkpoints to keep: the last keep_last by step, the best keep_best by metric
    (lower is better; the single best is always kept when any has a metric) and every protected one."""
    by_step = sorted(entries, key=lambda e: e[0], reverse=True)
    keep = {path for _, path, _ in by_step[:keep_last]}
    scored = sorted((e for e in entries if e[2] is not None), key=lambda e: (e[2], -e[0]))
    keep |= {path for _, path, _ in scored[:max(1, keep_best)]}
    protected = {Path(p).resolve() for p in protected}
    keep |= {path for _, path, _ in entries if path.resolve() in protected}
    return keep


def apply_retention(root: Path, keep_last: int, keep_best: int, protected: Iterable[str] = ()) -> list[Path]:
    """Delete complete checkpoints that select_retained does not keep; returns what was deleted.
    Directories without a valid marker are left alone (they are not counted, and not ours to judge)."""
    entries = []
    for step, path in _step_dirs(Path(root)):
        try:
            entries.append((step, path, read_manifest(path).get("metric")))
        except CorruptCheckpoint:
            continue
    keep = select_retained(entries, keep_last, keep_best, protected)
    deleted = []
    for _, path, _ in entries:
        if path not in keep:
            try:
                _remove(path)
                deleted.append(path)
            except OSError as exc:
                warnings.warn(f"{path}: could not delete an old checkpoint ({exc})", CheckpointWarning)
    return deleted


def clean_stale(root: Path) -> list[str]:
    """Remove what an interrupted save or delete left behind; returns the names handled.

    .tmp-* (a save that never published) and .trash-* (a delete that never finished) are removed.
    .old-step-N is a published checkpoint moved aside for a re-save of step N: if the re-save never
    landed it is renamed back, otherwise removed.
    """
    handled = []
    for path in sorted(Path(root).iterdir()):
        if path.name.startswith((".tmp-", ".trash-")):
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.startswith(".old-"):
            final = path.with_name(path.name[len(".old-"):])
            if final.exists():
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.rename(path, final)
        else:
            continue
        handled.append(path.name)
    if handled:
        fsync_dir(Path(root))
    return handled


# ---------------------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------------------

def capture_rng() -> dict:
    """This process's RNG states: Python, NumPy's global generator, torch CPU and (if in use) CUDA.
    Call it on every rank; gather the snapshots and hand the list to save()."""
    snapshot = {"python": random.getstate(), "numpy": np.random.get_state(), "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # capturing must not initialize CUDA
        snapshot["torch_cuda"] = torch.cuda.get_rng_state_all()
    return snapshot


def restore_rng(snapshot: dict) -> None:
    """Put back the RNG states capture_rng() took (from a loaded checkpoint: rng_snapshots[rank])."""
    random.setstate(snapshot["python"])
    np.random.set_state(snapshot["numpy"])
    torch.set_rng_state(snapshot["torch_cpu"])
    if "torch_cuda" in snapshot:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(snapshot["torch_cuda"])
        else:
            warnings.warn("the checkpoint holds CUDA RNG states but CUDA is not available here; CUDA "
                          "random draws (dropout on a GPU) will not continue the saved sequence", CheckpointWarning)


# ---------------------------------------------------------------------------------------------------------
# the manager
# ---------------------------------------------------------------------------------------------------------

def _die_with_parent(parent: int) -> None:
    """A writer process must not outlive a SIGKILLed trainer: it would keep renaming and deleting in a
    directory that the restarted run is already cleaning."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _worker_main(jobs, results, write_hook: WriteHook | None, parent: int) -> None:
    """The process backend's loop: one job at a time; the result or the error message goes back."""
    _die_with_parent(parent)
    torch.set_num_threads(1)  # leave the cores to training; the work here is I/O and hashing
    lower_priority()
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            results.put(("ok", run_job(job, write_hook)))
        except CheckpointError as exc:
            results.put(("error", str(exc)))
        except BaseException as exc:
            results.put(("error", f"checkpoint writer failed on step {job.step}: {type(exc).__name__}: {exc}\n"
                                  + traceback.format_exc()))
        del job  # release the shared arena before waiting for the next one


@dataclass
class _InFlight:
    step: int
    thread: threading.Thread | None = None
    result: dict | None = None
    error: BaseException | None = None


@dataclass
class CheckpointManager:
    """Saves checkpoints into root, one at a time, in the background; finds and loads the newest valid one.

    mode: "async" (save() returns once the state is in host memory) or "sync" (save() returns when the
    checkpoint is published). async_backend: "thread" (no extra process; the writer releases the GIL
    while writing and hashing) or "process" (a spawned writer; the snapshot goes to shared memory; it
    cannot stall the training thread at all, at the cost of a process start). on_write_error: "stop"
    (the error surfaces from the next save()/wait()/close()) or "retry" (up to `retries` times with
    exponential backoff from retry_backoff_s, then the error). write_hook(path, nbytes) is called before
    every write (fault injection; it must be picklable for the process backend). The background writer
    runs at nice 19: on a busy machine a save takes longer, but the training steps do not pay for it.
    """

    root: str | Path
    keep_last: int = 3
    keep_best: int = 1
    mode: str = "async"
    async_backend: str = "thread"
    on_write_error: str = "stop"
    retries: int = 3
    retry_backoff_s: float = 1.0
    write_hook: WriteHook | None = None
    last_result: dict | None = field(default=None, init=False)  # the last completed save: path, write_s, ...

    def __post_init__(self) -> None:
        problems = []
        if self.keep_last < 1:
            problems.append(f"keep_last must be >= 1 (got {self.keep_last})")
        if self.keep_best < 0:
            problems.append(f"keep_best must be >= 0 (got {self.keep_best})")
        if self.mode not in ("async", "sync"):
            problems.append(f"mode must be 'async' or 'sync' (got {self.mode!r})")
        if self.async_backend not in ("thread", "process"):
            problems.append(f"async_backend must be 'thread' or 'process' (got {self.async_backend!r})")
        if self.on_write_error not in ("stop", "retry"):
            problems.append(f"on_write_error must be 'stop' or 'retry' (got {self.on_write_error!r})")
        if self.retries < 0:
            problems.append(f"retries must be >= 0 (got {self.retries})")
        if problems:
            raise CheckpointError("checkpoint settings: " + "; ".join(problems))
        self.root = Path(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.cleaned = clean_stale(self.root)
        self._protected: set[str] = set()
        self._arena: torch.Tensor | None = None
        self._pinned = False
        self._in_flight: _InFlight | None = None
        self._process = None
        if self.mode == "async" and self.async_backend == "process":
            self._start_process()  # now, so its start (importing torch) overlaps model building

    # -- resuming ------------------------------------------------------------------------------------

    def latest_valid(self, expected_fingerprint: Any = None, on_mismatch: str = "refuse") -> Path | None:
        return latest_valid(self.root, expected_fingerprint, on_mismatch)

    def load(self, path: str | Path, verify: bool = True) -> LoadedCheckpoint:
        return load_checkpoint(path, verify)

    def protect(self, path: str | Path) -> None:
        """Never delete this checkpoint (the one being resumed from) while this manager lives."""
        self._protected.add(str(Path(path).resolve()))

    # -- saving --------------------------------------------------------------------------------------

    def save(self, step: int, model_tensors: dict[str, torch.Tensor], optimizer_state_dict: dict,
             scheduler_state_dict: dict, state_json: dict, rng_snapshots: list[dict], metric: float | None = None,
             grad_scaler_state: dict | None = None) -> None:
        """Snapshot the state and write it as step-<step>. Waits for the previous save first and raises
        its error; in async mode returns once the snapshot is in host memory."""
        self.wait()
        if not model_tensors:
            raise CheckpointError(f"nothing to checkpoint at step {step}: model_tensors is empty (pass the "
                                  "trainable tensors: for LoRA, the adapter's state dict)")
        if metric is not None and not math.isfinite(float(metric)):
            metric = None  # a NaN metric would win or lose every comparison; it ranks nowhere
        job = self._snapshot(step, model_tensors, optimizer_state_dict, scheduler_state_dict, state_json,
                             rng_snapshots, None if metric is None else float(metric), grad_scaler_state)
        if self.mode == "sync":
            self.last_result = run_job(job, self.write_hook)
        elif self.async_backend == "thread":
            flight = _InFlight(step)
            flight.thread = threading.Thread(target=self._run_in_thread, args=(flight, job),
                                             name=f"fineflow-checkpoint-{step}")
            self._in_flight = flight
            flight.thread.start()
        else:
            if self._process is None or not self._process.is_alive():
                self._start_process()
            self._in_flight = _InFlight(step)
            self._jobs.put(job)

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is published; raise its error. Returns its path."""
        flight = self._in_flight
        if flight is None:
            return None
        if flight.thread is not None:
            flight.thread.join()
        else:
            self._await_process(flight)
        self._in_flight = None  # only now: an interrupted wait() must not lose track of the save in flight
        if flight.error is not None:
            raise flight.error
        self.last_result = flight.result
        return Path(flight.result["path"])

    def close(self) -> None:
        """Wait for the last save (raising its error) and stop the writer process, if any."""
        try:
            self.wait()
        finally:
            if self._process is not None:
                self._jobs.put(None)
                self._process.join(timeout=30)
                if self._process.is_alive():
                    self._process.kill()
                self._process = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------------

    def _snapshot(self, step, model_tensors, optimizer_state_dict, scheduler_state_dict, state_json,
                  rng_snapshots, metric, grad_scaler_state) -> SaveJob:
        """Serialize the JSON parts and copy every tensor into the host arena: after this returns, the
        caller may change its model and optimizer freely. The only part of an async save the loop waits for."""
        parts = {"optimizer": optimizer_state_dict, "scheduler": scheduler_state_dict, "state": state_json,
                 "rng": list(rng_snapshots)}
        if grad_scaler_state is not None:
            parts["grad_scaler"] = grad_scaler_state
        tensor_sets, json_files = split_parts(model_tensors, parts)
        planned, total = plan_files(tensor_sets)
        arena = self._arena_for(total)
        arena_bytes = arena.numpy()
        on_gpu = False
        for spec, tensors, entries in planned:
            for name, begin, _ in entries:
                on_gpu |= tensors[name].device.type == "cuda"
                _copy_into(arena, arena_bytes, spec.offset + begin, tensors[name], non_blocking=self._pinned)
        if on_gpu:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies must land before we return
        return SaveJob(root=str(self.root), step=step, metric=metric, json_files=json_files,
                       tensor_files=[spec for spec, _, _ in planned], arena=arena, keep_last=self.keep_last,
                       keep_best=self.keep_best, protected=sorted(self._protected),
                       on_write_error=self.on_write_error, retries=self.retries, retry_backoff_s=self.retry_backoff_s)

    def _arena_for(self, nbytes: int) -> torch.Tensor:
        """The host buffer, reused across saves (no allocation or page faults after the first): safe
        because the previous save has finished with it before the next snapshot starts."""
        if self._arena is None or self._arena.numel() < nbytes:
            self._arena = None  # drop the old one before allocating the new one
            if self.mode == "async" and self.async_backend == "process":
                new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
                if new_shared is not None:  # created in shared memory, not copied there
                    self._arena = torch.empty(0, dtype=torch.uint8).set_(new_shared(max(nbytes, 1)))
                else:
                    self._arena = torch.empty(max(nbytes, 1), dtype=torch.uint8).share_memory_()
            else:
                self._pinned = torch.cuda.is_available() and torch.cuda.is_initialized()  # async D2H copies
                self._arena = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self._pinned)
        return self._arena[:max(nbytes, 1)] if nbytes else self._arena[:0]

    def _run_in_thread(self, flight: _InFlight, job: SaveJob) -> None:
        lower_priority()
        try:
            flight.result = run_job(job, self.write_hook)
        except BaseException as exc:  # re-raised in the training thread by wait()
            flight.error = exc

    def _start_process(self) -> None:
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")  # never fork a process that may hold CUDA or OpenMP state
        self._jobs, self._results = context.Queue(), context.Queue()
        self._process = context.Process(target=_worker_main, name="fineflow-checkpoint-writer", daemon=True,
                                        args=(self._jobs, self._results, self.write_hook, os.getpid()))
        self._process.start()

    def _await_process(self, flight: _InFlight) -> None:
        import queue

        while True:
            try:
                status, payload = self._results.get(timeout=0.5)
                break
            except queue.Empty:
                if not self._process.is_alive():
                    code = self._process.exitcode
                    self._process = None
                    previous = newest_complete(Path(self.root))
                    intact = (f"the previous checkpoint {previous} is intact" if previous is not None
                              else "there is no previous checkpoint")
                    flight.error = CheckpointError(f"the checkpoint writer process died (exit code {code}) while "
                                                   f"saving step {flight.step}; {intact}")
                    return
        if status == "ok":
            flight.result = payload
        else:
            flight.error = CheckpointError(payload)
