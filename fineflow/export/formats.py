"""The export formats, in the order the export stage asks them (fineflow.export.exporter): each one module of
fineflow/export/ with a subclass of ``ExportFormat`` (interface.py) that writes its files and its entries in
export.json, and its lines in the exports' card. No other module names a format.

    gguf.py     GGUF files for llama.cpp, each parity-checked; the one `fineflow serve` serves
    ollama.py   an Ollama Modelfile FROM the served GGUF (so after gguf: its ``needs``)
    vllm.py     the adapter laid out for vLLM's LoRA loader, and the `vllm serve` commands

The registry is this module, not the package's __init__.py: the fingerprint stage and `fineflow serve` import light
modules of fineflow.export, and should neither load every format nor, in dvc.yaml, depend on them. Adding a format:
its module and its line below (docs/export.md, "Add an export format").
"""

from __future__ import annotations

from fineflow.export.gguf import GGUF
from fineflow.export.interface import ExportFormat
from fineflow.export.ollama import Ollama
from fineflow.export.vllm import VLLM

FORMATS: dict[str, ExportFormat] = {export_format.name: export_format for export_format in (GGUF(), Ollama(), VLLM())}
NAMES = tuple(FORMATS)
