"""Stage fingerprint: record which base model every later stage uses, by content (and the data sources).

python -m fineflow.stages.fingerprint --base-dir models/base --out models/base_fingerprint.json \
    --hash-cache .cache/fineflow --sources-out data/sources.json \
    --champion models/champion --champion-out models/champion_fingerprint.json

DVC tracks what is inside the project; a real base that ``model.base`` names (a local directory, or a hub id
resolved from the local cache) is outside it, and a new checkpoint written at the same path would change
nothing DVC sees. This stage always runs (``always_changed`` in dvc.yaml), hashes the base's files (cached by
path, size and mtime, so an unchanged base is not read again) and writes the hashes: when they change, DVC
re-runs every stage that depends on the file; when they don't, the file's bytes are the same and nothing
downstream runs. ``data.sources`` (fineflow.data.sources) are inputs outside the project too: with
``--sources-out`` each one's content hash goes to that file, which the validate stage depends on (without
sources it is an empty list, the same bytes on every run). The champion is another: promote writes it after
train, so no stage declares it; with ``--champion-out`` its identity goes to that file when a preference run
continues it (an anchored train.objective such as dpo or orpo, train.preference.reference champion: the
reference_logps stage depends on the file), else the
constant ``{"champion": null}`` (fineflow.train.reference_model.champion_fingerprint). llama.cpp's tools are a third:
with ``--export-tools-out`` the installed llama-cpp-python and converter (fineflow.export.tooling.toolchain) go to
that file, which the export stage depends on.
"""

from __future__ import annotations

from pathlib import Path

from fineflow.base_source import base_identity, resolve_base_model
from fineflow.core.config import Params
from fineflow.core.entry import log, run_entry, stage_parser
from fineflow.core.reports import write_json_atomic


def run(
    params: Params,
    base_dir: Path,
    out: Path,
    hash_cache: Path,
    sources_out: Path | None = None,
    champion: tuple[Path, Path] | None = None,
    export_tools_out: Path | None = None,
) -> dict:
    """champion: (the champion directory, the JSON of its identity to write)."""
    if export_tools_out is not None:
        from fineflow.export.tooling import toolchain

        export_tools_out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(export_tools_out, toolchain())
    if champion is not None:
        from fineflow.train.reference_model import champion_fingerprint

        champion_dir, champion_out = champion
        champion_out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(champion_out, champion_fingerprint(params.train, champion_dir))
    if sources_out is not None:
        from fineflow.data.sources import fingerprint_sources

        sources_out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(sources_out, fingerprint_sources(params.data.sources, hash_cache, log))
    reference = resolve_base_model(params.model, base_dir)
    identity = {"base": reference, **base_identity(reference, hash_cache)}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, identity)
    files = identity.get("files", [])
    log(f"base {reference}: {len(files)} files, {sum(size for _, size, _ in files):,} bytes, fingerprint in {out}")
    return {"base": reference, "files": len(files), "revision": identity.get("revision")}


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser("fingerprint", __doc__)
    parser.add_argument("--base-dir", type=Path, required=True, help="the base stage's output directory")
    parser.add_argument("--out", type=Path, required=True, help="the fingerprint JSON to write")
    parser.add_argument("--hash-cache", type=Path, required=True, help="directory for the file hash cache")
    parser.add_argument("--sources-out", type=Path, default=None, help="the JSON of data.sources' content hashes")
    parser.add_argument("--champion", type=Path, default=None, help="the champion directory (models/champion)")
    parser.add_argument("--champion-out", type=Path, default=None, help="the JSON of the champion's identity")
    parser.add_argument("--export-tools-out", type=Path, default=None, help="the JSON of llama.cpp's tools")
    args = parser.parse_args(argv)
    champion = (args.champion, args.champion_out) if args.champion and args.champion_out else None
    return run_entry(
        "fingerprint",
        args,
        lambda params: run(
            params, args.base_dir, args.out, args.hash_cache, args.sources_out, champion, args.export_tools_out
        ),
    )


if __name__ == "__main__":
    raise SystemExit(main())
