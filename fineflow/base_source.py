"""Which base model the stages load: the embedded one the base stage built, or the user's path / hub id.

Core (every stage after base uses it), so it lives outside ``fineflow.base``: reading a reference must not
make a stage depend on the code that pretrains the embedded model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fineflow.core.model_config import ModelParams
from fineflow.core.preflight import names_a_directory
from fineflow.core.reports import read_json, sha256_file, write_json_atomic
from fineflow.errors import FineflowError

EXTERNAL_MARKER = "external_base.json"
HASH_CACHE = ".base-hashes.json"  # in a cache dir: content hashes of base model files, by path/size/mtime


def write_external_marker(out_dir: Path, base: str) -> dict:
    """For a real base (local dir or hub id) the stage builds nothing; it records what will be used."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / EXTERNAL_MARKER).write_text(json.dumps({"base": base}, indent=2) + "\n", encoding="utf-8")
    return {"skipped": True, "base": base}


def resolve_base_model(model_cfg: ModelParams, base_dir: str | Path) -> str:
    """What to pass to ``from_pretrained``: the built embedded model's dir, or the user's path/hub id.

    Kept as given (relative to the project root, where DVC runs stages) rather than made absolute: the
    adapter records it in adapter_config.json, and an absolute path would make the same training produce
    different bytes in different checkouts.
    """
    if model_cfg.is_embedded:
        return str(base_dir)
    check_base_reference(model_cfg.base)
    return model_cfg.base


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (read here, not from its constants, which are frozen at its
    import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps models: HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    return Path(os.environ.get("HF_HOME") or "~/.cache/huggingface").expanduser() / "hub"


def hub_model_cached(base: str) -> bool:
    """Whether the HF cache holds a usable snapshot of the hub id: its config.json, not just a folder (a
    download cut short, or one of the README alone, leaves a snapshot folder without it)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(base, "config.json", cache_dir=hub_cache_dir())
    except Exception:  # not a valid repo id
        return False
    return isinstance(found, str)


def base_source(base: str) -> str:
    """Where model.base comes from: "dir" (a local model directory), "cache" (a hub id the HF cache holds), or
    "download" (a hub id to fetch once into the user's HF cache; the hub is online). Anything else is a user
    error naming the param, raised before a stage loads anything (not a traceback from from_pretrained)."""
    if Path(base).expanduser().is_dir():
        return "dir"
    if names_a_directory(base):
        raise FineflowError(
            f"params.yaml: model.base {base!r} is not a directory (looked in {Path.cwd()}): point it at a "
            f"Hugging Face model directory (config.json, weights, tokenizer), or at a hub id such as org/name"
        )
    if hub_model_cached(base):
        return "cache"
    if hub_offline():
        raise FineflowError(
            f"params.yaml: model.base {base!r} is not in the Hugging Face cache ({hub_cache_dir()}) and the "
            f"hub is offline (HF_HUB_OFFLINE=1). Fetch it once where there is network: `huggingface-cli download "
            f"{base}` with the same HF_HOME (or copy that cache here); or unset HF_HUB_OFFLINE and the base "
            f"stage downloads it; or fix the name, or point model.base at a local model directory"
        )
    return "download"


def check_base_reference(base: str) -> None:
    """model.base must be a local model directory, a hub id the HF cache holds, or one the hub can serve."""
    base_source(base)


def download_hub_base(base: str, log) -> str:
    """Fetch the hub id's snapshot into the user's HF cache, once (the base stage, when the hub is online); its
    commit. A failure is a user error naming the id and the cache."""
    from huggingface_hub import snapshot_download

    log(f"model.base {base!r}: downloading it once into the Hugging Face cache {hub_cache_dir()}")
    try:
        return Path(snapshot_download(base, cache_dir=hub_cache_dir())).name
    except Exception as exc:
        raise FineflowError(
            f"params.yaml: model.base {base!r}: download into {hub_cache_dir()} failed ({type(exc).__name__}: "
            f"{exc}); check the name, your network and HF_TOKEN for a gated model, or set HF_HUB_OFFLINE=1 and "
            f"fetch it yourself"
        ) from None


def file_sha256(path: Path, cache: dict) -> str:
    """The file's sha256, read once and then cached by (absolute path, size, mtime) as DVC does: a new
    checkpoint written over the same path has a new mtime and is hashed again."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    if key not in cache:
        cache[key] = sha256_file(path)
    return cache[key]


def _hub_revision(base: str) -> str | None:
    """The commit of the locally cached snapshot of a hub id (offline: what from_pretrained will load)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(base, local_files_only=True, cache_dir=hub_cache_dir())).name
    except Exception:  # not cached, or not a hub id: the id alone identifies it
        return None


def base_identity(base: str, cache_dir: Path | None = None) -> dict:
    """What identifies the base model: for a local dir, every file in it *by content* (weights, config,
    tokenizer: same-shape new weights are another base); for a hub id, the id and the cached snapshot's commit.

    Hashing a 70B model's weights takes a minute, so the hashes are cached in ``cache_dir`` by path, size and
    mtime: a re-run of an unchanged base reads nothing."""
    path = Path(base)
    if not path.is_dir():
        return {"id": base, "revision": _hub_revision(base)}
    cache_file = Path(cache_dir) / HASH_CACHE if cache_dir is not None else None
    cache = _read_cache(cache_file)
    known = len(cache)
    files = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path)))
    identity = {"files": [[str(p.relative_to(path)), p.stat().st_size, file_sha256(p, cache)] for p in files]}
    if cache_file is not None and len(cache) > known:  # a file was hashed: keep its hash for the next run
        write_json_atomic(cache_file, cache)
    return identity


def base_digest(identity: dict) -> str:
    """One short id for a base model's identity (``base_identity``'s dict, or the fingerprint stage's JSON): the
    same files by content, or the same hub id and snapshot; not where the base lies (the "base" key)."""
    import hashlib

    content = {key: value for key, value in identity.items() if key != "base"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def read_base_digest(base: str, fingerprint: Path | None = None, cache_dir: Path | None = None) -> str:
    """The base's digest from the fingerprint stage's JSON when given (it hashed the base this run), else by
    hashing the base itself (cached in cache_dir)."""
    if fingerprint is not None:
        try:
            return base_digest(read_json(fingerprint))
        except (OSError, ValueError) as exc:
            message = f"{fingerprint}: cannot read the base fingerprint ({exc}); run the fingerprint stage"
            raise FineflowError(message) from None
    return base_digest(base_identity(base, cache_dir))


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)  # .cache/, .git/: not the model


def _read_cache(cache_file: Path | None) -> dict:
    try:
        return read_json(cache_file) if cache_file else {}
    except (OSError, ValueError):
        return {}  # no cache yet, or a torn one: hash again
