"""Which base model the stages load: the embedded one the base stage built, or the user's path / hub id.

Core (every stage after base uses it), so it lives outside ``fineflow.base``: reading a reference must not
make a stage depend on the code that pretrains the embedded model.
"""

from __future__ import annotations

import json
from pathlib import Path

from fineflow.config import ModelParams

EXTERNAL_MARKER = "external_base.json"


def write_external_marker(out_dir: Path, reference: str) -> dict:
    """For a real base (local dir or hub id) the stage builds nothing; it records what will be used."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / EXTERNAL_MARKER).write_text(json.dumps({"base": reference}, indent=2) + "\n", encoding="utf-8")
    return {"skipped": True, "base": reference}


def resolve_base_model(model_cfg: ModelParams, base_dir: str | Path) -> str:
    """What to pass to ``from_pretrained``: the built embedded model's dir, or the user's path/hub id.

    Kept as given (relative to the project root, where DVC runs stages) rather than made absolute: the
    adapter records it in adapter_config.json, and an absolute path would make the same training produce
    different bytes in different checkouts.
    """
    return str(base_dir) if model_cfg.is_embedded else model_cfg.base
