"""The documentation: the package maps, the README's links, the docs site's strict build, and the commands
the docs show.

The docs site is docs/ + mkdocs.yml (MkDocs with the Material theme, the ``docs`` extra). Every command a page
or the README shows in a fenced ``bash``/``console`` block is either run by a test named in ``COMMANDS``
below, or sits under a "needs a GPU/cluster" admonition.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _package_dirs():
    return sorted(p.parent for p in (ROOT / "fineflow").rglob("__init__.py") if "__pycache__" not in p.parts)


def _entries(package):
    """What a package's map must name: its modules and its folders (a subpackage names its own files)."""
    for entry in sorted(package.iterdir()):
        if entry.name.startswith((".", "__")):
            continue
        if entry.is_dir():
            yield entry.name + "/"
        elif entry.suffix == ".py":
            yield entry.name


@pytest.mark.parametrize("package", _package_dirs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_package_map_names_all_its_files(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    missing = [name for name in _entries(package) if not re.search(rf"(?<![\w/]){re.escape(name)}", doc)]
    assert not missing, f"{package.relative_to(ROOT)}/__init__.py's docstring does not name {missing}"
