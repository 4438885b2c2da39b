"""The champion's exports: its full model found (or built, streamed), what the exports are held to (the trained
side, fineflow.export.trained), and every format of fineflow.export.formats written from them, in order: the export
stage's report.

``export_champion`` is what the export stage runs. The report is the champion's id and each format's entries: the
GGUF files with their parity verdicts ("exports", "serve", ...), then "ollama", "vllm" (the formats' modules).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from fineflow.core.config import Params
from fineflow.errors import FineflowError
from fineflow.export.formats import FORMATS
from fineflow.export.interface import ExportJob
from fineflow.export.trained import trained_side


def champion_model_dir(champion_dir: Path, work_dir: Path, log: Callable[[str], None] = print) -> Path:
    """The champion's full model: merged/ when promote stored it, its own files for a fully fine-tuned champion,
    else the adapter merged onto its base now, shard by shard (fineflow.registry.merge), into work_dir."""
    from fineflow.registry.install import read_champion
    from fineflow.registry.merge import build_merged

    if not read_champion(champion_dir):
        raise FineflowError(f"{champion_dir}: no champion (champion.json) to export: the export follows a promotion")
    if (champion_dir / "merged" / "config.json").is_file():
        return champion_dir / "merged"
    if (champion_dir / "adapter_config.json").is_file():
        log(f"export: {champion_dir} is adapter-only: merging it onto its base, streamed")
        shutil.rmtree(work_dir / "merged", ignore_errors=True)
        build_merged(champion_dir, work_dir / "merged")
        return work_dir / "merged"
    if (champion_dir / "config.json").is_file():
        return champion_dir
    raise FineflowError(f"{champion_dir}: neither merged/, an adapter nor a model: re-run promote")


def export_champion(
    champion_dir: Path, eval_rows: Path, out_dir: Path, work_dir: Path, params: Params, log=print
) -> dict:
    """The champion in every format of FORMATS, in order, into out_dir: the report, with each format's entries (the
    export stage's library call)."""
    from fineflow.registry.install import read_champion

    model_dir = champion_model_dir(champion_dir, work_dir, log)
    trained = trained_side(model_dir, eval_rows, work_dir, params)
    job = ExportJob(champion_dir, model_dir, trained, eval_rows, out_dir, work_dir, params, log)
    report = {"champion": (read_champion(champion_dir) or {}).get("candidate_id")}
    for export_format in FORMATS.values():
        report |= export_format.write(job, report)
    return report
