"""The three test tiers (tests/README.md): `make test`, the CI scenarios (`make test-scenarios`) and the nightly
tier (`make test-nightly`). CI runs the first two (.ci/run), a scheduled workflow the third; every nightly test is
named in tests/README.md, so a guarantee moved out of CI is still listed with the tier that guards it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT


def _recipe(target: str) -> list[str]:
    """The command lines of a Makefile target."""
    lines = (ROOT / "Makefile").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_each_make_target_selects_its_tier_by_marker():
    assert _recipe("test") == ['$(BIN)/python -m pytest -n 2 --dist loadfile -m "not scenario and not nightly"']
    assert _recipe("test-scenarios") == ['$(BIN)/python -m pytest -n 2 --dist loadfile -m "scenario and not nightly"']
    assert _recipe("test-nightly") == ["$(BIN)/python -m pytest -m nightly"]


def test_ci_runs_the_readmes_test_command_then_the_ci_scenarios():
    commands = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith("#")]
    assert commands[-2:] == ["make test", "make test-scenarios"]
    assert "make test " in (ROOT / "README.md").read_text(encoding="utf-8")  # the README's test command


def test_the_nightly_workflow_runs_the_nightly_tier_on_a_schedule():
    workflow = yaml.safe_load((ROOT / ".github/workflows/nightly.yml").read_text(encoding="utf-8"))
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as true
    assert triggers["schedule"] and all("cron" in entry for entry in triggers["schedule"])
    [job] = workflow["jobs"].values()
    runs = [step.get("run") for step in job["steps"]]
    assert "make test-nightly" in runs
    # the llama.cpp export, parity and serve tests skip without the export extra: it is installed before the tier
    assert "make export-tools" in runs and runs.index("make export-tools") < runs.index("make test-nightly")


@pytest.mark.slow  # a pytest collection in a subprocess
def test_every_nightly_test_is_listed_in_the_tests_readme_with_its_tier():
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "nightly", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    names = {re.sub(r"\[.*", "", line.split("::")[-1]) for line in collected.stdout.splitlines() if "::" in line}
    assert names, "no test is marked nightly"
    readme = (ROOT / "tests/README.md").read_text(encoding="utf-8")
    nightly = readme[readme.index("## Nightly") :]
    assert [name for name in sorted(names) if name not in nightly] == []
