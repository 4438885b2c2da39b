"""What a checkpoint is on disk: the names (files, markers, ``step-N`` directories), the format version,
the errors, and how a state_dict becomes a JSON tree plus named tensors (and back) that are laid out as
safetensors files. Everything else in the package builds on these definitions."""

from __future__ import annotations

import json
import math
import re
import struct
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
# A sharded checkpoint (FSDP, DeepSpeed): the trainable tensors and the optimizer are each rank's own part,
# written by every rank into SHARDED_DIR: through torch's distributed checkpoint under FSDP (one file per rank
# plus DCP's .metadata), by DeepSpeed's save_checkpoint under ZeRO (its per-rank files in a subdirectory); the
# manifest covers those files like any other, and says "layout": "sharded".
SHARDED_DIR = "sharded"
SHARDED_REQUIRED_FILES = ("scheduler.json", "state.json", "rng.json")
DCP_METADATA = f"{SHARDED_DIR}/.metadata"  # written last, by DCP's coordinator: the shards are complete


def required_files(manifest: dict) -> tuple[str, ...]:
    """The files a checkpoint of this manifest's layout must list."""
    if manifest.get("layout") != "sharded":
        return REQUIRED_FILES
    dcp = any(name.endswith(".distcp") for name in manifest.get("files", {}))
    return SHARDED_REQUIRED_FILES + ((DCP_METADATA,) if dcp else ())


STEP_DIR = re.compile(r"^step-(\d+)$")
CHUNK = 8 * 2**20  # write/hash granularity: large enough to be fast, small enough to interleave with training

# tags for values plain JSON cannot represent faithfully; keys starting with "__" are reserved for them
TENSOR, TUPLE, DICT, FLOAT, NDARRAY = "__tensor__", "__tuple__", "__dict__", "__float__", "__ndarray__"

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
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


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step-N directory under root, in no order: by name, nothing else is a checkpoint."""
    if not root.is_dir():
        return []
    return [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]


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
        return {
            DICT: [
                [to_tree(k, tensors, f"{path}.key"), to_tree(v, tensors, f"{path}.{k}".lstrip("."))]
                for k, v in obj.items()
            ]
        }
    raise CheckpointError(
        f"cannot checkpoint {type(obj).__name__} at '{path or '<root>'}': only tensors, "
        "numbers, strings, None, lists, tuples, dicts and numpy arrays are stored (no pickle)"
    )


def from_tree(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of ``to_tree``."""
    if isinstance(tree, list):
        return [from_tree(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        ((tag, value),) = tree.items()
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


def _safetensors_header(
    tensors: dict[str, torch.Tensor], entries: list[tuple[str, int, int]], metadata: dict[str, str] | None
) -> bytes:
    """The 8-byte little-endian length plus JSON header of a safetensors file, padded to 8 bytes so the
    data section is aligned for memory-mapped readers."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    for name, begin, nbytes in entries:
        tensor = tensors[name]
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [begin, begin + nbytes],
        }
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
    tensor_sets: dict[str, tuple[dict, dict | None]] = {}
    if model_tensors:  # empty for a sharded checkpoint: the model's tensors are in SHARDED_DIR
        tensor_sets["model.safetensors"] = (dict(model_tensors), {"format": "pt"})
    json_files = {}
    for stem, obj in parts.items():
        tensors: dict[str, torch.Tensor] = {}
        json_files[f"{stem}.json"] = _json_bytes(to_tree(obj, tensors), compact=stem in COMPACT_PARTS)
        if tensors:
            tensor_sets[f"{stem}.safetensors"] = (tensors, None)
    return tensor_sets, json_files
