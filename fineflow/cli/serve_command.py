"""``fineflow serve``: the champion's GGUF export, OpenAI-compatible (fineflow.export.serve)."""

from __future__ import annotations

import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the champion's GGUF export: an OpenAI-compatible API (llama-cpp-python's server)",
        description="Serve a GGUF the export stage wrote and the parity check passed (fineflow/export/serve.py): "
        "the file's own chat template and context length, greedy at temperature 0. Runs in the foreground.",
        epilog="Exit codes: 2 when there is nothing shippable to serve (export.json names why); else the server's.",
    )
    p.add_argument(
        "--export-dir",
        type=Path,
        default=Path("models/export"),
        help="the export stage's output (default: models/export)",
    )
    p.add_argument("--type", help='which GGUF (f16, q8_0, ...; default: export.json\'s "serve")')
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1, this machine)")
    p.add_argument("--port", type=int, default=8000, help="default: 8000")
    p.add_argument("--threads", type=int, help="llama.cpp's CPU threads (default: llama-cpp-python's, half the CPUs)")
    p.add_argument(
        "--n-ctx", type=int, default=0, help="context length in tokens (default 0: the model's, as the check ran it)"
    )
    p.add_argument("--allow-unshippable", action="store_true", help="serve an export the parity check refused")
    p.set_defaults(run=_run_serve)


def _run_serve(args) -> int:
    import os

    from fineflow.export.serve import chosen_gguf, require_server, serve_command, serving_banner

    kind, _ = chosen_gguf(args.export_dir, args.type, args.allow_unshippable)
    require_server()
    command = serve_command(
        args.export_dir,
        kind,
        args.host,
        args.port,
        args.threads,
        n_ctx=args.n_ctx,
        allow_unshippable=args.allow_unshippable,
        python=sys.executable,
    )
    print(serving_banner(args.export_dir, kind, args.host, args.port))
    print(" ".join(command), flush=True)
    os.execv(sys.executable, command)  # the server in this process: its signals and exit status are the command's
    return 0  # not reached
