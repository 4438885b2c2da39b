"""``fineflow serve``: the champion's GGUF behind an OpenAI-compatible API, by llama-cpp-python's own server.

    fineflow serve [--export-dir models/export] [--type q8_0] [--host 127.0.0.1] [--port 8000] [--threads N]
    python -m fineflow.export.serve --model models/export/model-q8_0.gguf ...   # what it runs (serve_command)

Which GGUF: the export stage's report (``<export-dir>/export.json``) names each file with its parity verdict;
``--type`` picks one, else the report's ``serve`` (the smallest shippable export whose score check was gated),
else that same rule applied here. An export the parity check refused is not served (unless
``--allow-unshippable``), nor a file whose size is not the report's (a cheap guard against a GGUF replaced or cut
short after the check; the sha256 is in export.json for a full check).

How it is served, so that a client gets the answers that were checked:

- the chat template is the GGUF's own (``--chat_format chat_template.default``: llama-cpp-python's
  ``Jinja2ChatFormatter`` of the file's ``tokenizer.chat_template`` with its BOS/EOS texts, the renderer the parity
  check compared with training). Left unset, llama-cpp-python swaps a template it recognizes (ChatML, Llama-3,
  Mistral) for its own hand-written format, and falls back to llama-2's when the file has none;
- the context is the file's (``--n_ctx 0``: the length the model was trained for, what the parity check ran with;
  llama_cpp.server's default is 2048 whatever the model), unless ``--n-ctx`` caps it (memory for long contexts);
- requests default to no repeat penalty. llama_cpp.server defaults ``repeat_penalty`` to 1.1, a parameter OpenAI's
  API does not have, so an OpenAI client never sends it and temperature 0 would not be the greedy decoding that was
  evaluated. ``python -m fineflow.export.serve`` sets that default to 1.0 (OpenAI's own penalties,
  frequency/presence, already default to 0), then runs llama_cpp.server's ``main`` unchanged, with its own
  arguments; a request may still send ``repeat_penalty``;
- the model is named ``fineflow-<champion id>`` (``--model_alias``): what ``/v1/models`` lists.

Needs the ``export`` extra (llama-cpp-python and its server's packages: ``make export-tools``).
"""

from __future__ import annotations

import json
from pathlib import Path

from fineflow.errors import FineflowError

REPORT_FILE = "export.json"  # the export stage's report (its own REPORT_FILE; not imported: the CLI stays light)
CHAT_FORMAT = "chat_template.default"  # llama-cpp-python's name for the handler of the file's own template
SERVER_MODULE = "fineflow.export.serve"  # llama_cpp.server's main with OpenAI's sampling defaults
# what llama-cpp-python[server] requires, as modules (pyproject.toml's export extra pins them)
SERVER_PACKAGES = ("uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings", "yaml")


def read_report(export_dir: Path) -> dict:
    """export.json, or a FineflowError saying how to get one."""
    path = export_dir / REPORT_FILE
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FineflowError(
            f"{path}: no readable export report ({type(exc).__name__}: {exc}); the export stage writes it after "
            "promote (dvc repro export), or pass --export-dir"
        ) from None
    if not isinstance(report, dict) or not isinstance(report.get("exports"), dict):
        raise FineflowError(f'{path}: not an export report (no "exports" mapping): re-run the export stage')
    if not report["exports"]:
        why = report.get("skipped") or f"champion: {report.get('champion')}"
        raise FineflowError(f"{path}: no GGUF exported ({why}): nothing to serve")
    return report


def serving_choice(exports: dict) -> str | None:
    """The GGUF served by default: the smallest shippable one whose scores were gated (held within a tolerance);
    an ungated type (4-bit: reported only) is served only when asked for by name. None: nothing qualifies. The
    export stage writes it into export.json as "serve"."""
    gated = [
        (export.get("bytes", 0), kind)
        for kind, export in exports.items()
        if export.get("shippable") and export.get("checks", {}).get("scores", {}).get("figures", {}).get("gated")
    ]
    return min(gated)[1] if gated else None


def default_kind(report: dict) -> str | None:
    """The report's "serve", else serving_choice's (a report written before the stage named one)."""
    return report.get("serve") or serving_choice(report["exports"])


def chosen_gguf(export_dir: Path, kind: str | None = None, allow_unshippable: bool = False) -> tuple[str, Path]:
    """(kind, path) of the GGUF to serve, after the checks the report allows: shippable, the size it was checked at."""
    report = read_report(export_dir)
    path = export_dir / REPORT_FILE
    kind = kind or default_kind(report)
    if kind is None:
        refused = {k: e.get("reasons") for k, e in report["exports"].items()}
        raise FineflowError(
            f"{path}: no export is shippable with a gated score check ({refused}); "
            "name one with --type (and --allow-unshippable to serve a refused one)"
        )
    export = report["exports"].get(kind)
    if export is None:
        raise FineflowError(f"{path}: no {kind!r} export (exported: {sorted(report['exports'])}): --type names one")
    if not export.get("shippable") and not allow_unshippable:
        reasons = "; ".join(export.get("reasons") or ["no verdict recorded"])
        raise FineflowError(
            f"{path}: the {kind} export is not shippable (the parity check refused it: {reasons}); serve another "
            "--type, or pass --allow-unshippable to serve it anyway"
        )
    gguf = export_dir / export["file"]
    size = gguf.stat().st_size if gguf.is_file() else None
    if size != export.get("bytes"):
        found = "missing" if size is None else f"{size:,} bytes"
        raise FineflowError(
            f"{gguf}: {found}, but {path} recorded {export.get('bytes')} bytes for the {kind} export: the file is not "
            "the one the parity check passed (a size check only; export.json has its sha256): re-run the export stage"
        )
    return kind, gguf


def model_name(export_dir: Path) -> str:
    """The name clients call the model by: fineflow-<champion id>."""
    return f"fineflow-{read_report(export_dir).get('champion') or 'model'}"


def serve_command(
    export_dir: Path,
    kind: str | None,
    host: str,
    port: int,
    threads: int | None = None,
    *,
    n_ctx: int = 0,
    allow_unshippable: bool = False,
    python: str = "python",
) -> list[str]:
    """The command line that serves export_dir's GGUF of kind (None: the default one), after its checks."""
    kind, gguf = chosen_gguf(export_dir, kind, allow_unshippable)
    command = [python, "-m", SERVER_MODULE, "--model", str(gguf), "--model_alias", model_name(export_dir)]
    if _has_chat_template(read_report(export_dir)["exports"][kind]):
        command += ["--chat_format", CHAT_FORMAT]
    command += ["--n_ctx", str(n_ctx), "--host", host, "--port", str(port)]
    if threads:
        command += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
    return command


def _has_chat_template(export: dict) -> bool:
    """False only when the parity check found the model without a chat template (then no chat format is named:
    llama-cpp-python's fallback renders chats, and /v1/completions takes the model's own prompts)."""
    figures = export.get("checks", {}).get("chat_template", {}).get("figures", {})
    return figures.get("conversations") != 0


def base_url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


def require_server() -> None:
    """llama-cpp-python of the pinned version and its server's packages, or a FineflowError saying how to get them."""
    import importlib.util

    from fineflow.export.tooling import INSTALL_HINT, require_llama_cpp

    require_llama_cpp()
    missing = [name for name in SERVER_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise FineflowError(f"llama-cpp-python's server needs {', '.join(missing)} (the export extra): {INSTALL_HINT}")


def serving_banner(export_dir: Path, kind: str, host: str, port: int) -> str:
    """What `fineflow serve` prints first: which file, where, under which name, and its parity verdict."""
    export = read_report(export_dir)["exports"][kind]
    verdict = "shippable" if export.get("shippable") else "NOT shippable: " + "; ".join(export.get("reasons") or [])
    return (
        f"serving {export_dir / export['file']} ({kind}, {verdict}) at {base_url(host, port)} as model "
        f"{model_name(export_dir)!r}: OpenAI chat completions, temperature 0 is greedy; Ctrl-C stops it"
    )


def use_openai_sampling_defaults() -> None:
    """llama_cpp.server's request models with repeat_penalty defaulting to 1.0 (see the module's docstring).
    Before llama_cpp.server.app is imported: its routes bind these models when they are defined."""
    from llama_cpp.server import types

    for request in (types.CreateCompletionRequest, types.CreateChatCompletionRequest):
        request.model_fields["repeat_penalty"].default = 1.0
        request.model_rebuild(force=True)


def main() -> None:
    """python -m fineflow.export.serve <llama_cpp.server's arguments>"""
    use_openai_sampling_defaults()
    from llama_cpp.server.__main__ import main as server_main

    server_main()


if __name__ == "__main__":
    main()
