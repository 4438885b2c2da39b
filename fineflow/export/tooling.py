"""llama.cpp's own tools for the GGUF export: its converter and its runtime, pinned to one llama.cpp revision.

    python -m fineflow.export.tooling fetch [--sdist PATH]    # the converter, out of llama-cpp-python's sdist
    python -m fineflow.export.tooling where                   # where it is, and the runtime's version

The runtime (tokenizer, quantizer, CPU inference) is ``llama-cpp-python`` (the ``export`` extra; it builds
llama.cpp from source, see ``make export-tools``). llama.cpp's converter, ``convert_hf_to_gguf.py`` with its
``conversion`` package and its own ``gguf-py``, is in no wheel: it ships only inside that same sdist
(``vendor/llama.cpp/``). ``fetch`` takes it from there, so the converter that writes the GGUF and the runtime that
reads it are the same llama.cpp revision (the pre-tokenizer names, the architecture keys and the quantization
types agree by construction). The sdist is checked against the sha256 pinned here (that of the file PyPI serves)
before anything is extracted; pip downloads it (``pip download --no-binary``), or ``--sdist`` names a copy already
on disk (the one the wheel was built from). Only the converter's files are extracted (~2 MB), into the user's
cache, once.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from fineflow.errors import FineflowError

LLAMA_CPP_PYTHON = "0.3.36"  # the `export` extra pins the same version (pyproject.toml)
SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"  # the file pip downloads from PyPI
VENDOR = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")
CONVERTER_SCRIPT = "convert_hf_to_gguf.py"
SOURCE_RECORD = "SOURCE.json"  # beside the extracted files: which sdist, by sha256
CONVERTER_ENV = "FINEFLOW_LLAMA_CPP_CONVERTER"  # a converter folder elsewhere (e.g. a llama.cpp checkout)
INSTALL_HINT = "make export-tools (or: pip install 'fineflow[export]' && python -m fineflow.export.tooling fetch)"


def default_converter_dir() -> Path:
    """The converter's folder in the user's cache (XDG_CACHE_HOME), one per llama-cpp-python version."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "fineflow" / f"llama.cpp-converter-{LLAMA_CPP_PYTHON}"


def converter_dir() -> Path:
    """The folder holding convert_hf_to_gguf.py: $FINEFLOW_LLAMA_CPP_CONVERTER, or the one ``fetch`` filled."""
    configured = os.environ.get(CONVERTER_ENV)
    folder = Path(configured) if configured else default_converter_dir()
    if not (folder / CONVERTER_SCRIPT).is_file():
        where = f"${CONVERTER_ENV}={configured}" if configured else str(folder)
        raise FineflowError(f"llama.cpp's converter is not at {where} ({CONVERTER_SCRIPT} missing): {INSTALL_HINT}")
    return folder


def require_llama_cpp():
    """The llama_cpp module, of the pinned version; a clear error instead of an ImportError."""
    try:
        installed = importlib.metadata.version("llama_cpp_python")
        import llama_cpp
    except (importlib.metadata.PackageNotFoundError, ImportError) as exc:
        raise FineflowError(
            f"the GGUF export needs llama-cpp-python=={LLAMA_CPP_PYTHON} ({exc}): {INSTALL_HINT}"
        ) from None
    if installed != LLAMA_CPP_PYTHON:
        raise FineflowError(
            f"llama-cpp-python {installed} is installed, the export is pinned to {LLAMA_CPP_PYTHON} (its converter "
            f"and runtime must be one llama.cpp revision): {INSTALL_HINT}"
        )
    return llama_cpp


def toolchain() -> dict:
    """Which llama.cpp the export would run, without loading it: llama-cpp-python's installed version and the
    converter's source (its sdist's sha256), or why the export cannot run here (``missing``). The fingerprint stage
    writes this to a file the export stage depends on: another llama.cpp writes other bytes, and tools installed
    after a run that could not export re-run the export."""
    try:
        runtime = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        runtime = None
    try:
        folder = converter_dir()
    except FineflowError:
        source = None
    else:  # fetched: its sdist's sha256; a converter of the user's own (FINEFLOW_LLAMA_CPP_CONVERTER): the script's
        record = folder / SOURCE_RECORD
        source = (
            json.loads(record.read_text("utf-8"))["sha256"]
            if record.is_file()
            else sha256_of(folder / CONVERTER_SCRIPT)
        )
    missing = None
    if runtime != LLAMA_CPP_PYTHON:
        missing = f"llama-cpp-python=={LLAMA_CPP_PYTHON} is not installed (found: {runtime})"
    elif source is None:
        missing = "llama.cpp's converter has not been fetched"
    return {
        "llama_cpp_python": runtime,
        "converter_sha256": source,
        "missing": missing and f"{missing}: {INSTALL_HINT}",
    }


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_sdist(into: Path) -> Path:
    """llama-cpp-python's sdist, by pip (its own index and proxy settings apply)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", str(into)]
    done = subprocess.run([*command, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], capture_output=True, text=True)
    if done.returncode != 0 or not (into / SDIST).is_file():
        raise FineflowError(
            f"pip could not download {SDIST} ({done.stderr.strip()[-400:]}); download it elsewhere and pass --sdist"
        )
    return into / SDIST


def _converter_members(archive: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """The archive's members under vendor/llama.cpp/ that the converter needs, regular files only."""
    wanted = [VENDOR + part for part in CONVERTER_PARTS]
    return [
        member
        for member in archive.getmembers()
        if member.isfile() and any(member.name == w or (w.endswith("/") and member.name.startswith(w)) for w in wanted)
    ]


def extract_converter(sdist: Path, dest: Path) -> Path:
    """Check the sdist's sha256, then extract the converter's files into dest (replaced whole, atomically)."""
    found = sha256_of(sdist)
    if found != SDIST_SHA256:
        raise FineflowError(
            f"{sdist}: sha256 {found} is not the pinned {SDIST_SHA256} of {SDIST}; fetch it again from PyPI"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converter-", dir=dest.parent))
    try:
        with tarfile.open(sdist, "r:gz") as archive:
            members = _converter_members(archive)
            archive.extractall(staging, members=members, filter="data")  # "data": no links, no paths outside
        root = staging / VENDOR
        if not (root / CONVERTER_SCRIPT).is_file():
            raise FineflowError(f"{sdist}: no {VENDOR}{CONVERTER_SCRIPT} inside")
        record = {"sdist": SDIST, "sha256": found, "files": len(members)}
        (root / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        shutil.rmtree(dest, ignore_errors=True)
        root.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def fetch(sdist: Path | None = None, dest: Path | None = None) -> Path:
    """The converter extracted from sdist (downloaded by pip when not given) into dest (default: the cache)."""
    dest = dest or default_converter_dir()
    if sdist is not None:
        return extract_converter(sdist, dest)
    with tempfile.TemporaryDirectory(prefix="fineflow-sdist-") as tmp:
        return extract_converter(download_sdist(Path(tmp)), dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fineflow.export.tooling", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fetch_cmd = commands.add_parser("fetch", help="extract llama.cpp's converter from llama-cpp-python's sdist")
    fetch_cmd.add_argument("--sdist", type=Path, help=f"a local {SDIST} (default: pip downloads it)")
    fetch_cmd.add_argument("--dest", type=Path, help=f"where to put it (default: {default_converter_dir()})")
    commands.add_parser("where", help="where the converter is and which runtime is installed")
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            print(f"llama.cpp's converter ({SDIST}, sha256 checked) is in {fetch(args.sdist, args.dest)}")
        else:
            print(f"converter: {converter_dir()}\nllama-cpp-python: {require_llama_cpp().__version__}")
    except FineflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
