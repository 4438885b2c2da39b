"""The datasets of a mixture (``data.sources``): where each one's rows are, what its content is, its rows.

A source is one of four kinds (``kind: auto`` tells them apart by what the path is):

- ``file``: one JSONL, CSV or Parquet file (fineflow.data.formats.read_rows);
- ``shards``: a folder of such files, read one after another in sorted order (``split`` keeps the files whose
  path has that word: ``train-00000-of-00004.parquet``, ``train/part-1.jsonl``);
- ``saved``: a folder ``datasets``' ``save_to_disk`` wrote (``state.json`` or ``dataset_dict.json`` in it),
  memory-mapped by ``load_from_disk`` and read in batches (a DatasetDict's ``split``, default train);
- ``hub``: a Hugging Face dataset id, read from its snapshot in the HF cache as shards (default split train).
  The same offline rules as a hub model (fineflow.base_source): a cached snapshot is used as it is; one not
  cached is downloaded once when the hub is online (the sources stage), and refused, naming the source, when
  it is offline.

A source's content hash is over its files by content (cached by path, size and mtime, as the fingerprint stage
caches the base's), and for a hub source the snapshot's commit: the validate stage's per-source results are
keyed by it (fineflow.data.source_gate). Rows stream: one file, batch or line at a time.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fineflow.core.data_config import SourceParams
from fineflow.core.preflight import names_a_directory
from fineflow.core.reports import read_json, write_json_atomic
from fineflow.data.formats import EXTENSIONS, Row, read_rows, record_row
from fineflow.errors import DataError, FineflowError

SAVED_MARKERS = ("state.json", "dataset_dict.json")  # what save_to_disk writes: a Dataset's, a DatasetDict's
DEFAULT_SPLIT = "train"  # of a saved DatasetDict or a hub dataset, when the source names none
HASH_CACHE = ".source-hashes.json"  # in the hash cache dir: file hashes by path, size and mtime
BATCH_ROWS = 1_000  # rows of a saved dataset read together


@dataclass(frozen=True)
class Source:
    """One entry of data.sources, resolved: its kind and the files its rows come from."""

    index: int
    spec: SourceParams
    kind: str
    files: tuple[Path, ...]  # read in this order (a saved dataset: every file of its folder, for the hash)
    revision: str | None = None  # a hub snapshot's commit

    @property
    def label(self) -> str:
        """How messages name the source: its key in params.yaml and its path or id."""
        return f"data.sources[{self.index}] ({self.spec.path})"

    @property
    def root(self) -> Path:
        return Path(self.spec.path).expanduser()


def source_kind(index: int, spec: SourceParams) -> str:
    """The kind the source is: as given, or (auto) a file, a saved dataset, a shards folder, else a hub id.
    A path that names a local file or folder and is not there is an error naming the source."""
    path = Path(spec.path).expanduser()
    if spec.kind == "hub":
        return "hub"
    if spec.kind == "auto" and not path.exists() and not _looks_local(spec.path):
        return "hub"
    if not path.exists():
        raise FineflowError(
            f"params.yaml: data.sources[{index}].path: no such file or folder {spec.path!r} (looked in {Path.cwd()}); "
            f"fix the path, or set kind: hub for a Hugging Face dataset id"
        )
    if spec.kind != "auto":
        return spec.kind
    if path.is_file():
        return "file"
    return "saved" if any((path / marker).is_file() for marker in SAVED_MARKERS) else "shards"


def _looks_local(path: str) -> bool:
    """A path, not a hub id (org/name): the model.base rule, or a data file's extension."""
    return names_a_directory(path) or Path(path).suffix.lower() in EXTENSIONS


def resolve_source(index: int, spec: SourceParams, download: bool = False) -> Source:
    """The source's kind and files; a hub id comes from the HF cache (downloaded first when download is set
    and the hub is online)."""
    kind = source_kind(index, spec)
    path = Path(spec.path).expanduser()
    if kind == "hub":
        snapshot = hub_snapshot(index, spec.path, download)
        return Source(index, spec, kind, shard_files(index, spec, snapshot, DEFAULT_SPLIT), snapshot.name)
    if kind == "file":
        if not path.is_file():
            raise FineflowError(f"params.yaml: data.sources[{index}].path: {spec.path!r} is a folder, not a file")
        if spec.split is not None:  # silently reading the whole file would train on what the user meant to leave
            where = f"params.yaml: data.sources[{index}].split"
            raise FineflowError(f"{where}: {spec.path!r} is one file, it has no splits (remove split)")
        return Source(index, spec, kind, (path,))
    if not path.is_dir():
        where = f"params.yaml: data.sources[{index}].path"
        raise FineflowError(f"{where}: {spec.path!r} is a file; kind {kind} reads a folder (or set kind: file)")
    if kind == "saved":
        return Source(index, spec, kind, tuple(_visible_files(path)))
    return Source(index, spec, kind, shard_files(index, spec, path, None))


def _visible_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not _hidden(p.relative_to(folder)))


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def shard_files(index: int, spec: SourceParams, folder: Path, default_split: str | None) -> tuple[Path, ...]:
    """The data files of a folder (by extension; or of spec.format), those of the split when one is named."""
    wanted = {ext for ext, fmt in EXTENSIONS.items() if spec.format in ("auto", fmt)}
    files = [p for p in _visible_files(folder) if p.suffix.lower() in wanted]
    split = spec.split or default_split
    if split is not None:
        word = re.compile(rf"(^|[/_.-]){re.escape(split)}([/_.-]|$)")
        files = [p for p in files if word.search(p.relative_to(folder).as_posix())]
    if not files:
        which = f" of split {split!r}" if split else ""
        raise FineflowError(
            f"params.yaml: data.sources[{index}] ({spec.path}): no {'/'.join(sorted(wanted))} files{which} in "
            f"{folder}; set its split (or format) to what the folder holds"
        )
    return tuple(files)


def hub_snapshot(index: int, dataset_id: str, download: bool) -> Path:
    """The HF cache's snapshot of a hub dataset; downloaded when download is set and the hub is online."""
    from huggingface_hub import snapshot_download

    from fineflow.base_source import hub_cache_dir, hub_offline

    try:
        cached = snapshot_download(dataset_id, repo_type="dataset", local_files_only=True, cache_dir=hub_cache_dir())
        return Path(cached)
    except Exception:  # not cached (or not a valid id): download, or refuse
        pass
    where = f"params.yaml: data.sources[{index}] ({dataset_id})"
    if hub_offline() or not download:
        raise FineflowError(
            f"{where}: the Hugging Face dataset is not in the cache ({hub_cache_dir()}) and the hub is offline "
            f"(HF_HUB_OFFLINE=1; fineflow sets it unless model.base is a hub id or you set HF_HUB_OFFLINE=0). Fetch "
            f"it once where there is network: `huggingface-cli download --repo-type dataset {dataset_id}` with the "
            f"same HF_HOME (or copy that cache here); or run with HF_HUB_OFFLINE=0; or fix the id or the path"
        )
    try:
        return Path(snapshot_download(dataset_id, repo_type="dataset", cache_dir=hub_cache_dir()))
    except Exception as exc:
        raise FineflowError(
            f"{where}: download into {hub_cache_dir()} failed ({type(exc).__name__}: {exc}); check the id, your "
            f"network and HF_TOKEN for a gated dataset"
        ) from None


def content_hash(source: Source, cache_dir: Path | None = None) -> str:
    """sha256 over the source's files (name, size, content) and its hub commit: what it holds, not where."""
    from fineflow.base_source import file_sha256

    cache_file = Path(cache_dir) / HASH_CACHE if cache_dir is not None else None
    cache = _read_cache(cache_file)
    known = len(cache)
    base = source.root if source.kind in ("shards", "saved") else None
    files = [
        [p.relative_to(base).as_posix() if base else p.name, p.stat().st_size, file_sha256(p, cache)]
        for p in source.files
    ]
    if cache_file is not None and len(cache) > known:
        write_json_atomic(cache_file, cache)
    content = {"kind": source.kind, "files": files, "revision": source.revision}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def fingerprint_sources(sources: list[SourceParams] | None, hash_cache: Path | None, log) -> dict:
    """{"sources": [path, kind, content hash of each]}: what the fingerprint stage writes for DVC to compare
    (a hub dataset not cached is downloaded first when the hub is online). Without sources: an empty list."""
    listing = []
    for index, spec in enumerate(sources or []):
        source = resolve_source(index, spec, download=True)
        listing.append({"path": spec.path, "kind": source.kind, "content_sha256": content_hash(source, hash_cache)})
        log(f"{source.label}: {source.kind}, {len(source.files)} files, content {listing[-1]['content_sha256'][:16]}")
    return {"sources": listing}


def _read_cache(cache_file: Path | None) -> dict:
    try:
        return read_json(cache_file) if cache_file else {}
    except (OSError, ValueError):
        return {}  # none yet, or torn: hash again


def read_source(source: Source, max_row_bytes: int | None) -> Iterator[Row]:
    """The source's rows, one at a time, numbered 1, 2, ... across its files (a reader's own reasons still
    name the file and its line)."""
    rows = _saved_rows(source, max_row_bytes) if source.kind == "saved" else _file_rows(source, max_row_bytes)
    for number, row in enumerate(rows, 1):
        row.line = number
        yield row


def _file_rows(source: Source, max_row_bytes: int | None) -> Iterator[Row]:
    for path in source.files:
        yield from read_rows(path, source.spec.format, max_row_bytes)


def _saved_rows(source: Source, max_row_bytes: int | None) -> Iterator[Row]:
    dataset = _load_saved(source)
    number = 0
    for batch in dataset.iter(batch_size=BATCH_ROWS):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns), strict=True):
            number += 1
            yield record_row(dict(zip(columns, values, strict=True)), number, f"{source.label}:{number}", max_row_bytes)
    if not number:
        raise DataError(f"{source.label}: the dataset has no rows")


def _load_saved(source: Source):
    """The saved Dataset, or the split of a saved DatasetDict (default train)."""
    from datasets import DatasetDict, load_from_disk

    try:
        dataset = load_from_disk(str(source.root))
    except Exception as exc:
        raise DataError(f"{source.label}: cannot load it with datasets.load_from_disk ({exc})") from None
    if not isinstance(dataset, DatasetDict):
        return dataset
    split = source.spec.split or DEFAULT_SPLIT
    if split not in dataset:
        raise FineflowError(
            f"params.yaml: data.sources[{source.index}].split: {split!r} is not a split of {source.spec.path} "
            f"(it has {sorted(dataset)})"
        )
    return dataset[split]
