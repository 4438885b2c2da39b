"""The one interface every export format implements, and that the export stage asks instead of naming one.

A format says:
- ``name``: what the registry calls it, and for most formats its key in the export report (export.json);
- ``needs``: the formats whose files it is made from (Ollama's Modelfile is FROM a GGUF): the registry lists
  them before it, and ``write`` finds their entries in the report so far;
- ``write``: its files in the export folder and its entries in the report (for most formats one, under its name);
- ``serving``: its lines in the "Serve it" section of the exports' card (the commands that serve its files),
  from the report alone, so that the card and export.json never disagree.

Every format is handed the same ``ExportJob``: the champion, its full model, what the exports are held to
(``Trained``), the export folder, scratch and the params. fineflow.export.exporter builds it once, then asks every
format of ``FORMATS`` in order.

Adding a format: one module in this package with a subclass, and its line in ``FORMATS``
(fineflow/export/formats.py). docs/export.md walks through one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fineflow.core.config import Params
    from fineflow.export.parity import EvalDoc


@dataclass(frozen=True)
class Trained:
    """What the exports are held to: the training tokenizer, the eval docs as the evaluate stage renders them, and
    the ids the model was trained to stop on (its EOS, generation_config's eos_token_id)."""

    tokenizer: object
    docs: list[EvalDoc]
    generation_eos: int | list[int] | None
    stop_ids: list[int]


@dataclass(frozen=True)
class ExportJob:
    """What every format is handed."""

    champion_dir: Path  # the champion as promote installed it: champion.json, its adapter or its model files
    model_dir: Path  # its full model: merged/, its own files, or its adapter merged onto the base (in work_dir)
    trained: Trained
    eval_rows: Path  # the validate stage's eval rows (the parity check answers them)
    out_dir: Path  # the export folder: every format writes its files here
    work_dir: Path  # scratch, gone when the stage ends
    params: Params
    log: Callable[[str], None] = print


class ExportFormat:
    """An export format. Subclasses set the class attributes and implement ``write`` (and ``serving``)."""

    name: str = ""
    summary: str = ""  # one line: what it writes, for which runtime
    needs: tuple[str, ...] = ()

    def write(self, job: ExportJob, report: dict) -> dict:
        """Its files in job.out_dir, and its entries in the report. report: what the formats before it wrote."""
        raise NotImplementedError

    def serving(self, report: dict, out_dir: Path) -> list[str]:
        """Its lines in the card's "Serve it" section (markdown, each block ending with a blank line); none by
        default."""
        return []
