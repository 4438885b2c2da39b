"""Lineage: one manifest per run that says where a model came from.

    fineflow lineage models/champion          # the installed champion
    fineflow lineage 3f2a9c0d1e7b4a55         # a candidate id from models/registry/candidates
    fineflow lineage reports/lineage/<id>.json

A manifest has two parts. The deterministic part is a function of the pipeline's inputs (resolved params,
package versions, tokenizer/template/shard hashes, adapter file hashes, eval result hashes): it is what the
registry keeps (``record.json``, ``models/champion/lineage.json``), so two identical runs leave identical
DVC outputs. The volatile part, ``run`` (git commit and dirty flag, start/end times, user, host, the
checkpoints on disk) and ``dvc_lock`` (hashes of every stage's deps and outs as dvc.lock stood when promote
ran), is written only to ``reports/lineage/<candidate id>.json``, which is not a DVC output;
``fineflow lineage`` joins the two when both are there.

Pure functions plus small readers; fineflow.registry.champion.promote builds and writes the manifest.
"""

from __future__ import annotations

import getpass
import json
import os
import platform
import socket
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import yaml

from fineflow.core.dvc_project import DVC_FILE, stage_names
from fineflow.core.reports import sha256_file
from fineflow.registry.store import file_hashes, files_digest

FORMAT = 1
PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "lm-eval",
    "datasets",
    "tokenizers",
    "safetensors",
    "dvc",
    "fineflow",
)
# The promote stage refuses a candidate whose manifest lacks any of these (dotted paths, non-empty values).
REQUIRED = (
    "params",
    "packages.torch",
    "packages.transformers",
    "packages.peft",
    "data.tokenizer_hash",
    "data.template_hash",
    "artefacts.adapter.sha256",
    "eval.scores_sha256",
    "eval.eval_data_sha256",
    "run.git.commit",
)
MANIFEST_STAGE = "promote"  # builds the manifest while it runs: its own report is not part of this run yet


def report_stages(reports_dir: Path) -> list[str]:
    """The stages whose reports time the run: those of the project's dvc.yaml (the folder that holds
    reports_dir) before the manifest's own (a stage after it, the goodput ledger, has not run yet for this
    candidate); outside a DVC project, whichever stage reports reports_dir holds."""
    project = reports_dir.parent
    if (project / DVC_FILE).is_file():
        stages = stage_names(project)
        stages = stages[: stages.index(MANIFEST_STAGE)] if MANIFEST_STAGE in stages else stages
    else:
        stages = sorted(path.stem for path in reports_dir.glob("*.json"))
    return [stage for stage in stages if stage != MANIFEST_STAGE]


def git_state(root: Path) -> dict:
    """Commit, tree and dirty flag of the checkout at root; nulls (and the reason) where there is no git."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        return {
            "commit": git("rev-parse", "HEAD"),
            "tree": git("rev-parse", "HEAD^{tree}"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        }
    except (OSError, subprocess.SubprocessError) as exc:
        return {"commit": None, "tree": None, "dirty": None, "error": f"no git state ({type(exc).__name__})"}


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        import torch

        versions["cuda"] = torch.version.cuda  # None on a CPU build
    except ImportError:
        versions["cuda"] = None
    return versions


def dvc_lock_hashes(lock_path: Path, exclude_stages: tuple[str, ...] = ("promote",)) -> dict | None:
    """{stage: {"deps": {path: hash}, "outs": {path: hash}}} from dvc.lock; None when there is no lock.

    The promote stage's own entry is left out: it describes the previous promote run, not this one."""
    try:
        lock = yaml.safe_load(lock_path.read_text(encoding="utf-8")) or {}
    except OSError:
        return None
    stages = {}
    for name, stage in sorted((lock.get("stages") or {}).items()):
        if name in exclude_stages:
            continue
        stages[name] = {
            kind: {e["path"]: e.get("md5") or e.get(e.get("hash", ""), None) for e in stage.get(kind) or []}
            for kind in ("deps", "outs")
        }
    return stages


def shard_hashes(shards_dir: Path) -> dict:
    """Tokenizer and template hashes and each split's content key, from the shards' meta.json."""
    out: dict = {"tokenizer_hash": None, "template_hash": None}
    for split in ("train", "eval"):
        try:
            meta = json.loads((shards_dir / split / "meta.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        out["tokenizer_hash"] = out["tokenizer_hash"] or meta.get("tokenizer_hash")
        out["template_hash"] = out["template_hash"] or meta.get("template_hash")
        out[f"{split}_shard_key"] = meta.get("content_key")
        out[f"{split}_examples"] = meta.get("examples")
    return out


def mixture_sources(rows_dir: Path) -> dict:
    """{"sources": [...]} from the validate stage's sources.json when the train split is a mixture of
    data.sources (each with its content hash, rows kept, weight or n, rows mixed); {} otherwise."""
    try:
        listing = json.loads((rows_dir / "sources.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return {"sources": listing.get("sources", [])}


def checkpoint_hashes(checkpoints: Path) -> dict[str, str]:
    """{checkpoint dir: sha256 of its manifest.json (which lists every file's sha256)}."""
    if not checkpoints.is_dir():
        return {}
    return {
        str(m.parent.relative_to(checkpoints)): sha256_file(m) for m in sorted(checkpoints.glob("*/*/manifest.json"))
    }


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="seconds")


def run_times(reports_dir: Path, now: float | None = None) -> dict:
    """Start and end of the run: each stage report's mtime is its end, minus its wall_s its start."""
    starts, ends = [], []
    for stage in report_stages(reports_dir):
        path = reports_dir / f"{stage}.json"
        try:
            end = path.stat().st_mtime
            wall = float(json.loads(path.read_text(encoding="utf-8")).get("wall_s") or 0.0)
        except (OSError, ValueError, AttributeError):
            continue
        starts.append(end - wall)
        ends.append(end)
    end = now if now is not None else datetime.now(UTC).timestamp()
    return {"started": _iso(min(starts)) if starts else None, "ended": _iso(end)}


def _user() -> str | None:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return os.environ.get("USER")


def build_manifest(
    *,
    params: dict,
    adapter_dir: Path,
    scores_path: Path,
    eval_data_sha256: str | None,
    shards_dir: Path,
    root: Path = Path("."),
    checkpoints: Path | None = None,
    reports_dir: Path | None = None,
    dvc_lock: Path | None = None,
) -> dict:
    """The full manifest of this run (see the module docstring for which parts are deterministic)."""
    adapter_files = file_hashes(adapter_dir) if adapter_dir.is_dir() else {}
    return {
        "fineflow_lineage": FORMAT,
        "params": params,
        "packages": package_versions(),
        # the validate stage's rows lie beside the shards (dvc.yaml: data/validated, a dependency of promote)
        "data": {**shard_hashes(shards_dir), **mixture_sources(shards_dir.parent / "validated")},
        "dvc_lock": dvc_lock_hashes(dvc_lock or root / "dvc.lock"),
        "artefacts": {
            "adapter": {
                "path": str(adapter_dir),
                "files": adapter_files,
                "sha256": files_digest(adapter_files) if adapter_files else None,
            }
        },
        "eval": {
            "scores_sha256": sha256_file(scores_path) if scores_path.is_file() else None,
            "eval_data_sha256": eval_data_sha256,
        },
        "run": {
            "git": git_state(root),
            **run_times(reports_dir or root / "reports"),
            "user": _user(),
            "host": socket.gethostname(),
            "checkpoints": checkpoint_hashes(checkpoints or root / "checkpoints"),
            "argv": sys.argv[1:],
        },
    }


# Left out of what DVC outputs hold: ``run`` varies by time, place and person; ``dvc_lock`` is the lock as it
# stood when promote ran, which depends on how the pipeline was driven (per-stage vs whole repro, a stale
# lock after a manual run), not only on the inputs.
VOLATILE = ("run", "dvc_lock")


def deterministic(manifest: dict) -> dict:
    """The part of a manifest that is a function of the pipeline's inputs: what DVC outputs may hold."""
    return {key: value for key, value in manifest.items() if key not in VOLATILE}


def missing_fields(manifest: dict | None) -> list[str]:
    """The REQUIRED dotted paths that are absent, null or empty in manifest."""
    if not manifest:
        return list(REQUIRED)
    missing = []
    for dotted in REQUIRED:
        node = manifest
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node in (None, "", {}, []):
            missing.append(dotted)
    return missing


# ---- reading and printing --------------------------------------------------------------------------


def resolve(target: str, registry: Path = Path("models/registry"), runs: Path = Path("reports/lineage")) -> dict:
    """A manifest from a lineage JSON file, a model dir (champion or registry candidate), or a candidate id.

    The registry keeps the deterministic part; the run part is joined from ``runs/<id>.json`` if present."""
    from fineflow.errors import FineflowError

    path = Path(target)
    record = None
    if path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
        record = data if "fineflow_lineage" in data else data.get("lineage")
        if record is None:
            raise FineflowError(f"{path}: not a lineage manifest nor a registry record")
        cid = data.get("candidate_id") or data.get("id")
    elif path.is_dir():
        for name in ("lineage.json", "record.json"):
            if (path / name).is_file():
                return resolve(str(path / name), registry, runs)
        raise FineflowError(f"{path}: no lineage.json or record.json here (is it a champion or candidate dir?)")
    else:  # a candidate id (or a unique prefix): checked as an id, never used as a glob or a path
        from fineflow.registry.store import candidate_dir

        try:
            found = candidate_dir(registry, target)
        except FineflowError as exc:
            raise FineflowError(f"{target}: not a file, a directory or a candidate id ({exc})") from None
        return resolve(str(found / "record.json"), registry, runs)
    manifest = dict(record)
    cid = cid or manifest.get("candidate_id")
    if "run" not in manifest and cid and (runs / f"{cid}.json").is_file():
        full = json.loads((runs / f"{cid}.json").read_text(encoding="utf-8"))
        manifest.update({key: full.get(key) for key in VOLATILE})
    return manifest


def _short(value) -> str:
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:16] + "…"
    return str(value)


def source_line(source: dict) -> str:
    """One source of a mixture: where, what (content hash), how much was kept and trained on."""
    amount = f"n {source['n']}" if source.get("n") is not None else f"weight {source.get('weight'):g}"
    return (
        f"{source['path']}  {_short(source['content_sha256'])}  kept {source['rows_kept']}  {amount}  "
        f"mixed {source['rows_mixed']}"
    )


def tree(manifest: dict, title: str = "lineage"):
    """A rich Tree of the manifest, the questions people ask first at the top. Values are plain Text, so a
    bracket in a path or a param is never read as rich markup."""
    from rich.text import Text
    from rich.tree import Tree

    def add(node, label: str):
        return node.add(Text(label))

    def section(name: str):
        return root.add(Text(name, style="bold"))

    root = Tree(Text(title + (f" {manifest['candidate_id']}" if manifest.get("candidate_id") else ""), style="bold"))
    run = manifest.get("run")
    node = section("run")
    if run:
        git = run.get("git") or {}
        add(
            node,
            f"git {git.get('commit') or 'unknown'}"
            + {True: " (dirty)", False: " (clean)"}.get(git.get("dirty"), "")
            + (f" — {git['error']}" if git.get("error") else ""),
        )
        add(node, f"started {run.get('started')}  ended {run.get('ended')}")
        add(node, f"by {run.get('user')} on {run.get('host')}")
        checkpoints = run.get("checkpoints") or {}
        if checkpoints:
            ck = add(node, f"checkpoints ({len(checkpoints)})")
            for name, sha in checkpoints.items():
                add(ck, f"{name}  {_short(sha)}")
    else:
        add(node, "not recorded here (reports/lineage/<candidate id>.json holds git, times, user, host)")
    pk = section("packages")
    for name, version in (manifest.get("packages") or {}).items():
        add(pk, f"{name} {version}")
    data = section("data")
    for key, value in (manifest.get("data") or {}).items():
        if key == "sources":  # a mixture's sources (data.sources): one line each
            node = add(data, f"sources ({len(value)})")
            for source in value:
                add(node, source_line(source))
            continue
        add(data, f"{key} {_short(value)}")
    art = section("artefacts")
    adapter = (manifest.get("artefacts") or {}).get("adapter") or {}
    ad = add(art, f"adapter {_short(adapter.get('sha256'))}")
    for name, sha in (adapter.get("files") or {}).items():
        add(ad, f"{name}  {_short(sha)}")
    ev = section("eval")
    for key, value in (manifest.get("eval") or {}).items():
        add(ev, f"{key} {_short(value)}")
    lock = manifest.get("dvc_lock")
    dl = section("dvc.lock" + ("" if lock else " (none)"))
    for stage, entry in (lock or {}).items():
        st = add(dl, stage)
        for kind in ("deps", "outs"):
            for path, md5 in (entry.get(kind) or {}).items():
                add(st, f"{kind[:-1]} {path}  {md5}")
    _add_mapping(section("params"), manifest.get("params") or {})
    return root


def _add_mapping(node, mapping: dict) -> None:
    from rich.text import Text

    for key, value in mapping.items():
        if isinstance(value, dict):
            _add_mapping(node.add(Text(str(key))), value)
        else:
            node.add(Text(f"{key}: {json.dumps(value)}"))
