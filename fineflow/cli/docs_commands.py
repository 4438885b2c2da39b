"""``fineflow params-doc`` (the params reference: fineflow.params_doc) and ``fineflow dvc-deps`` (each stage's
code deps in dvc.yaml: fineflow.code_deps): the generated pages and files, written or checked."""

from __future__ import annotations

import sys
from pathlib import Path


def add_parser(sub) -> None:
    _params_doc_parser(sub)
    _dvc_deps_parser(sub)


def _params_doc_parser(sub) -> None:
    from fineflow.params_doc import DEFAULT_PAGE

    p = sub.add_parser(
        "params-doc",
        help="the params.yaml reference (every key's type, default, bounds, meaning) from fineflow/core/config.py",
        description="Write the params reference, generated from the typed models that validate params.yaml "
        "(fineflow/params_doc.py): to stdout, to --out, or compare it with the committed page (--check).",
        epilog=f"Exit codes: 0 written (or up to date); 1 --check found the page stale or missing. Regenerate: "
        f"fineflow params-doc --out {DEFAULT_PAGE}",
    )
    p.add_argument("--out", type=Path, help="write the page to this file (docs/reference/params.md) instead of stdout")
    p.add_argument("--check", action="store_true", help=f"exit 1 when --out (default {DEFAULT_PAGE}) is not current")
    p.set_defaults(run=_run_params_doc)


def _run_params_doc(args) -> int:
    from fineflow.params_doc import DEFAULT_PAGE, REGENERATE, render

    page = render()
    if args.check:
        path = args.out or DEFAULT_PAGE
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current != page:
            state = "differs from fineflow/core/config.py" if current is not None else "is missing"
            print(f"{path} {state}: regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
    elif args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(page, encoding="utf-8")
        print(f"wrote {args.out}")
    else:
        print(page, end="")
    return 0


def _dvc_deps_parser(sub) -> None:
    p = sub.add_parser(
        "dvc-deps",
        help="each stage's code deps in dvc.yaml, from what its entry imports (fineflow/code_deps.py)",
        description="Compare each dvc.yaml stage's code dependencies with the fineflow modules its entry imports "
        "(function-level imports included), or rewrite them (--write); data deps, params and outs are kept.",
        epilog="Exit codes: 0 up to date (or written); 1 a stage's code deps differ from its imports.",
    )
    p.add_argument("--dvc-file", type=Path, default=Path("dvc.yaml"), help="the pipeline file (default dvc.yaml)")
    p.add_argument("--write", action="store_true", help="rewrite the code deps in the file")
    p.set_defaults(run=_run_dvc_deps)


def _run_dvc_deps(args) -> int:
    import yaml

    from fineflow.code_deps import rewrite, stage_code_deps

    root = args.dvc_file.resolve().parent
    text = args.dvc_file.read_text(encoding="utf-8")
    updated = rewrite(text, root, stage_code_deps(root, yaml.safe_load(text)["stages"]))
    if updated == text:
        print(f"{args.dvc_file}: every stage's code deps are what its entry imports")
        return 0
    if args.write:
        args.dvc_file.write_text(updated, encoding="utf-8")
        print(f"wrote {args.dvc_file}")
        return 0
    print(f"{args.dvc_file}: code deps differ from the imports: run `fineflow dvc-deps --write`", file=sys.stderr)
    return 1
