"""Stage export: the promoted champion as GGUF files for llama.cpp (and Ollama's Modelfile, vLLM's adapter layout),
each GGUF parity-checked before it is shippable.

    python -m fineflow.stages.export --champion models/champion --eval-rows data/validated/eval.jsonl \
        --tools models/export_tools.json --out models/export

Writes each format's files (fineflow.export.formats): ``<out>/model-<type>.gguf`` for ``export.float_type`` and
each of ``export.quantized``, the Modelfile, vLLM's layout; then
``<out>/README.md`` (the exports' model card: each file with its parity figures and the command that serves it;
the same section goes last into the champion's own card, models/champion/README.md)
and ``<out>/export.json``: per file its size, sha256, whether it is shippable and, when not, each failed check's
reason, with the parity figures (fineflow.export.parity), and ``serve``: the file ``fineflow serve`` serves. A failed
check marks that file not shippable; the stage still succeeds and the champion stays champion
(``export.block_promotion`` makes promote check first and refuse instead). The console carries the stage's own
lines; what llama.cpp prints (its converter, quantizer and model loader) goes to ``<out>/llama_cpp.log``
(fineflow.export.native_log), which a failure's message names; .dvcignore keeps it out of the output's hash.

Nothing is exported, and export.json says why (``skipped``), when nothing is promoted yet, when ``export.enabled``
is false, or when it is ``auto`` and llama.cpp's tools are not installed (``make export-tools``). ``--tools`` is the
fingerprint stage's record of those tools (fineflow.export.tooling.toolchain): a dependency in dvc.yaml, so
installing them, or another llama.cpp, re-runs the export. The library is ``fineflow.export``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from fineflow.core.config import Params
from fineflow.core.entry import log, run_entry, stage_parser
from fineflow.core.reports import write_json_atomic, write_text_atomic
from fineflow.errors import FineflowError
from fineflow.objectives import objective_for
from fineflow.objectives.interface import LANGUAGE_MODEL
from fineflow.registry.install import read_champion
from fineflow.registry.store import record_kind

REPORT_FILE = "export.json"
CARD_FILE = "README.md"


def run(params: Params, champion_dir: Path, eval_rows: Path, out_dir: Path, tools: Path | None = None) -> dict:
    """Export the champion at champion_dir into out_dir (replaced whole); the stage's report."""
    from fineflow.export.exports_card import champion_card_with_exports, export_card

    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    champion = read_champion(champion_dir)
    trained = objective_for(params.train.objective)
    if not trained.generates:  # its champion is the registry's of its kind: models/champion stays the LM's
        log(f"export: train.objective {trained.name} trains a {trained.model_kind} model, never exported to GGUF")
    skipped = why_not_exported(params, champion_dir, champion, tools)
    if skipped:
        log(f"export: nothing exported: {skipped}")
        report = {"champion": (champion or {}).get("candidate_id"), "exports": {}, "skipped": skipped}
    else:
        from fineflow.export.exporter import export_champion

        # scratch (a merged model built from an adapter-only champion, the rendered eval rows) beside the output,
        # on the same disk, gone when the stage ends
        with tempfile.TemporaryDirectory(prefix=".export-work-", dir=out_dir.parent) as work:
            report = export_champion(champion_dir, eval_rows, out_dir, Path(work), params, log)
        (out_dir / CARD_FILE).write_text(export_card(report, champion, out_dir), encoding="utf-8")
    write_json_atomic(out_dir / REPORT_FILE, report)
    card = champion_dir / CARD_FILE  # outside DVC's hash of the champion (.dvcignore) and the log's (card_digest)
    if champion is not None and card.is_file():
        text = champion_card_with_exports(card.read_text(encoding="utf-8"), report, champion, out_dir)
        write_text_atomic(card, text)
    return summary(report)


def why_not_exported(params: Params, champion_dir: Path, champion: dict | None, tools: Path | None) -> str | None:
    """Why this run exports nothing (None: it exports). llama.cpp missing with export.enabled true is an error.
    Only a language model is exported: a champion of another kind (its champion.json's model_kind: a reward
    model, which scores text) has no GGUF form."""
    if champion is None:
        return f"no champion in {champion_dir} (nothing promoted yet)"
    if record_kind(champion) != LANGUAGE_MODEL:
        return f"{champion_dir} holds a {record_kind(champion)} model, which scores text: only a language model exports"
    if params.export.enabled is False:
        return "export.enabled is false"
    missing = _tools(tools).get("missing")
    if missing and params.export.enabled is True:
        raise FineflowError(f"params.yaml: export.enabled is true but {missing} (or set export.enabled: auto)")
    return missing


def _tools(tools: Path | None) -> dict:
    """The fingerprint stage's record of llama.cpp's tools, or (run by hand without it) this machine's."""
    from fineflow.export.tooling import toolchain

    if tools is None:
        return toolchain()
    try:
        return json.loads(tools.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise FineflowError(
            f"{tools}: cannot read llama.cpp's tools' record ({exc}): run the fingerprint stage"
        ) from None


def summary(report: dict) -> dict:
    """reports/export.json: which files ship, which do not and why, the one served, or why nothing was exported."""
    exports = report["exports"]
    return {
        "champion": report["champion"],
        "shippable": sorted(kind for kind, export in exports.items() if export["shippable"]),
        "not_shippable": {kind: e["reasons"] for kind, e in exports.items() if not e["shippable"]},
        **({"serve": report.get("serve")} if exports else {"skipped": report.get("skipped")}),
        **{
            f"exact_match_delta.{kind}": e["checks"]["scores"]["figures"]["delta"]
            for kind, e in exports.items()
            if "scores" in e["checks"]
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser("export", __doc__)
    parser.add_argument("--champion", type=Path, required=True, help="the champion directory (promote's output)")
    parser.add_argument("--eval-rows", type=Path, required=True, help="the eval rows the parity check answers")
    parser.add_argument("--out", type=Path, required=True, help="the export directory to write (replaced)")
    parser.add_argument("--tools", type=Path, default=None, help="the fingerprint stage's record of llama.cpp's tools")
    args = parser.parse_args(argv)
    return run_entry("export", args, lambda params: run(params, args.champion, args.eval_rows, args.out, args.tools))


if __name__ == "__main__":
    raise SystemExit(main())
