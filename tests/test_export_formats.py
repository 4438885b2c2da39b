"""Export formats as plug-ins (fineflow.export.formats): the exporter and the card ask every registered format, none
names one; a new format is one module and its line in the registry (docs/export.md's worked example, run here)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from fineflow.export.formats import FORMATS, NAMES
from fineflow.export.interface import ExportFormat
from tests.test_objectives import _code_mentions

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fineflow"
REGISTRY = PACKAGE / "export/formats.py"
# GGUF is named beyond its module: it is the file type the export section's types (export.float_type, quantized,
# tolerance), the parity check, `fineflow serve` and the base package's GGUF reader are about
FILE_TYPE = "gguf"


def _module_file(export_format: ExportFormat) -> Path:
    return ROOT / (type(export_format).__module__.replace(".", "/") + ".py")


def _imported(path: Path) -> set[str]:
    """Every module path.py imports, function bodies included (`from a import b` counts as a and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


def test_no_module_outside_a_formats_own_names_it_or_imports_it():
    """The exporter, the stage and the card ask fineflow.export.formats: adding a format touches its module and
    the registry only. Only promote imports the GGUF format's module: its parity check before installing."""
    own = {name: _module_file(export_format) for name, export_format in FORMATS.items()}
    format_modules = {type(export_format).__module__: own[name] for name, export_format in FORMATS.items()}
    modules = [path for path in PACKAGE.rglob("*.py") if path != REGISTRY]
    allowed = {(PACKAGE / "stages/promote.py", "fineflow.export.gguf")}  # export.block_promotion's parity check
    imports = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in modules
        for module in sorted(_imported(path) & format_modules.keys())
        if format_modules[module] != path and (path, module) not in allowed
    ]
    assert not imports, "modules that import a format (ask fineflow.export.formats instead):\n  " + "\n  ".join(imports)
    named = [
        mention
        for name, file in own.items()
        if name != FILE_TYPE
        for path in modules
        if path != file
        for mention in _code_mentions(path, (name.replace("_", " "),))
    ]
    assert not named, "modules that name a format (ask fineflow.export.formats instead):\n  " + "\n  ".join(named)


def test_the_registry_holds_every_format_under_its_own_name_after_those_it_needs():
    assert NAMES == ("gguf", "ollama", "vllm")
    for position, (name, export_format) in enumerate(FORMATS.items()):
        kind = type(export_format)
        assert isinstance(export_format, ExportFormat) and export_format.name == name and export_format.summary
        assert (kind.__dict__.get("__doc__") or "").strip(), f"{kind.__name__} has no docstring"
        assert kind.write is not ExportFormat.write and kind.serving is not ExportFormat.serving
        assert set(export_format.needs) <= set(NAMES[:position]), f"{name} needs {export_format.needs}: list it after"
    assert FORMATS["ollama"].needs == (FILE_TYPE,)


def _docs_example() -> ExportFormat:
    """docs/export.md's worked example ("Add an export format"), run as written."""
    page = (ROOT / "docs/export.md").read_text(encoding="utf-8")
    section = page.split("\n## Add an export format\n", 1)[1].split("\n## ", 1)[0]
    [example] = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    namespace: dict = {}
    exec(compile(example, "docs/export.md", "exec"), namespace)
    return namespace["ChatTemplateFile"]()


def test_the_docs_worked_example_plugs_in_as_one_module_and_its_registry_line(built, tmp_path, monkeypatch):
    """The example registered for the test's duration: the exporter writes its file and its report entry, and the
    card serves it after the formats before it, with nothing else changed. (GGUF and Ollama need llama.cpp: here
    the registry holds vLLM and the example; the report of the three shipped formats is test_export's.)"""
    from transformers import AutoTokenizer

    from fineflow.export import exporter
    from fineflow.export.exports_card import export_card
    from fineflow.export.vllm import write_vllm_layout
    from tests.test_export import _champion, _tiny_params
    from tests.test_export_stage import _export, _report

    added = _docs_example()
    assert isinstance(added, ExportFormat) and added.name == "chat_template" and added.summary
    champion = _champion(built, tmp_path / "models/champion")
    out, params = tmp_path / "models/export", _tiny_params(parity_docs=4)
    out.mkdir(parents=True)
    # the exporter's registry without the two llama.cpp formats (not deleted from FORMATS: their order would change)
    monkeypatch.setattr(exporter, "FORMATS", {"vllm": FORMATS["vllm"], added.name: added})
    report = exporter.export_champion(champion, built / "data/validated/eval.jsonl", out, tmp_path / "work", params)
    written = (out / "chat_template.jinja").read_text(encoding="utf-8")
    assert written == AutoTokenizer.from_pretrained(champion / "merged").chat_template  # the training template
    vllm = write_vllm_layout(champion, tmp_path / "models/again")  # what the stage asked vLLM's module for
    assert report == {
        "champion": "c-test",
        "vllm": vllm,
        "chat_template": {"file": "chat_template.jinja", "chars": len(written)},
    }

    # the shipped registry, plus the example: its line last in the card's "Serve it"
    monkeypatch.setitem(FORMATS, added.name, added)
    exports = {"f16": _export("f16", 4, 0.0, True)}
    card = export_card({**_report(exports), "vllm": vllm, "chat_template": report["chat_template"]}, {}, out)
    serving = card[card.index("## Serve it") : card.index("## Parity checks")]
    assert (
        serving.index("fineflow serve --export-dir")
        < serving.index("vllm serve")
        < serving.index(f"for a server that takes one: `{out / 'chat_template.jinja'}`")
    )
