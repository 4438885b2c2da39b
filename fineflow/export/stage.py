"""Stage export: the promoted champion as GGUF files for llama.cpp, each parity-checked before it is shippable.

    python -m fineflow.export.stage --champion models/champion --eval-rows data/validated/eval.jsonl \
        --out models/export

Writes ``<out>/model-<type>.gguf`` for ``export.float_type`` and each of ``export.quantized``, and
``<out>/export.json``: per file its size, sha256, whether it is shippable and, when not, each failed check's reason,
with the parity figures (fineflow.export.parity). A failed check marks that file not shippable; the stage still
succeeds and the champion stays champion. With no champion (nothing promoted yet) it writes an export.json that
says so and no GGUF. Needs the ``export`` extra (``make export-tools``); the library is ``fineflow.export``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from fineflow.core.config import Params
from fineflow.core.entry import log, run_entry, stage_parser
from fineflow.core.reports import write_json_atomic
from fineflow.export.champion import export_champion
from fineflow.registry.install import read_champion

REPORT_FILE = "export.json"


def run(params: Params, champion_dir: Path, eval_rows: Path, out_dir: Path) -> dict:
    """Export the champion at champion_dir into out_dir (replaced whole); the stage's report."""
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    if read_champion(champion_dir) is None:
        log(f"export: no champion in {champion_dir} (nothing promoted yet): nothing to export")
        report = {"champion": None, "exports": {}}
    else:
        # scratch (a merged model built from an adapter-only champion, the rendered eval rows) beside the output,
        # on the same disk, gone when the stage ends
        with tempfile.TemporaryDirectory(prefix=".export-work-", dir=out_dir.parent) as work:
            report = export_champion(champion_dir, eval_rows, out_dir, Path(work), params, log)
    write_json_atomic(out_dir / REPORT_FILE, report)
    return {
        "champion": report["champion"],
        "shippable": sorted(kind for kind, export in report["exports"].items() if export["shippable"]),
        "not_shippable": {kind: e["reasons"] for kind, e in report["exports"].items() if not e["shippable"]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser("export", __doc__)
    parser.add_argument("--champion", type=Path, required=True, help="the champion directory (promote's output)")
    parser.add_argument("--eval-rows", type=Path, required=True, help="the eval rows the parity check answers")
    parser.add_argument("--out", type=Path, required=True, help="the export directory to write (replaced)")
    args = parser.parse_args(argv)
    return run_entry("export", args, lambda params: run(params, args.champion, args.eval_rows, args.out))


if __name__ == "__main__":
    raise SystemExit(main())
