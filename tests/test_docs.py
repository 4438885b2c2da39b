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


# --- The docs site builds strictly ------------------------------------------------------------------------------


def _require_mkdocs():
    """Not a skip: CI installs the dev extra, which carries the docs extra; a skipped build would hide a broken site."""
    import importlib.util

    assert importlib.util.find_spec("mkdocs"), (
        "the docs build needs the docs extra: pip install -e '.[dev]' (or '.[docs]')"
    )


def _mkdocs_build(config: Path, site: Path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's end-of-life banner, not a warning of ours
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=ROOT,  # the snippets (bench/RESULTS.md, tests/README.md, the package maps) are read from the project root
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_docs_site_builds_strictly(tmp_path):
    _require_mkdocs()
    done = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site/reference/params/index.html").exists()
    results = (tmp_path / "site/results/index.html").read_text(encoding="utf-8")
    assert "Packing: real-token share" in results  # bench/RESULTS.md, included, not copied
    layout = (tmp_path / "site/layout/index.html").read_text(encoding="utf-8")
    assert "fineflow/goodput/__init__.py" in layout and "--8" not in layout  # where each package's map is


def test_the_layout_page_reads_on_github_too_and_names_every_packages_map():
    """docs/layout.md includes no snippet (GitHub shows `--8<--` markers raw) and names the map of every package."""
    page = (ROOT / "docs/layout.md").read_text(encoding="utf-8")
    assert "--8<--" not in page
    packages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "fineflow").rglob("__init__.py"))
    assert [p for p in packages if f"`{p}`" not in page] == []


def _copy_of_the_docs(tmp_path: Path) -> Path:
    """mkdocs.yml pointed at a copy of docs/, so a test can break a page without touching the project."""
    import shutil

    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "\ndocs_dir: docs\n" in config
    (tmp_path / "mkdocs.yml").write_text(config.replace("\ndocs_dir: docs\n", f"\ndocs_dir: {tmp_path / 'docs'}\n"))
    return tmp_path / "mkdocs.yml"


@pytest.mark.parametrize(
    "breakage, says",
    [
        (lambda docs: (docs / "orphan.md").write_text("# Not in the nav\n"), "orphan.md"),
        (lambda docs: (docs / "ci.md").write_text("# CI\n\n[gone](no-such-page.md)\n"), "no-such-page.md"),
        (lambda docs: (docs / "ci.md").write_text('# CI\n\n--8<-- "bench/NO_SUCH.md"\n'), "NO_SUCH.md"),
    ],
    ids=["a page missing from the nav", "a broken link", "a missing included file"],
)
def test_the_strict_build_fails_on(tmp_path, breakage, says):
    _require_mkdocs()
    config = _copy_of_the_docs(tmp_path)
    breakage(tmp_path / "docs")
    done = _mkdocs_build(config, tmp_path / "site")
    assert done.returncode != 0 and says in done.stderr, done.stderr[-4000:]


# --- The README ------------------------------------------------------------------------------------------------


def test_the_readme_is_read_in_five_minutes_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 200
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert local, "the README links into the docs"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to {missing}, which do not exist"
    assert "```bash\nmake run " in readme and "\nmake test " in readme  # the quickstart's two commands


# --- Every command the docs show is run by a test, or needs a GPU or a cluster ----------------------------------

# A command line shown in a ```bash / ```console block of README.md or docs/ -> the test that runs it (for a
# synopsis or a placeholder: the test that runs that command with real values). Blocks under a
# `!!! warning "Needs a GPU"` or `"Needs a cluster"` admonition are exempt.
COMMANDS = {
    "python bench/soak.py --runs 50 --embedded-default --seed 3 --out logs/soak": (
        "tests/test_soak.py::test_a_short_soak_of_events_and_faults_leaves_every_invariant_true"
    ),
    "python bench/soak.py --rounds 30 --seed 7 --out logs/soak-tiny": (
        "tests/test_soak.py::test_a_short_soak_of_events_and_faults_leaves_every_invariant_true"
    ),
    "make export-tools": "tests/test_export.py::test_the_embedded_champion_exports_to_gguf_and_passes_parity",
    "python -m fineflow.stages.export --champion models/champion --eval-rows data/validated/eval.jsonl --out "
    "models/export": "tests/test_export.py::test_the_embedded_champion_exports_to_gguf_and_passes_parity",
    "fineflow serve --export-dir models/export --port 8000": (
        "tests/test_serve.py::test_the_served_embedded_champion_answers_an_openai_client_as_pytorch_does"
    ),
    "make run": "tests/test_flow.py::test_flow_then_dvc_repro",  # make run = python -m flows.pipeline
    "make test": "tests/test_tiers.py::test_ci_runs_the_readmes_test_command_then_the_ci_scenarios",
    "fineflow ci [--commit] [--fail-on-refusal] [--base-ref REF] [--summary FILE]": (
        "tests/test_ci.py::test_the_workflows_steps_in_fresh_clones_refuse_then_promote_then_stop_on_bad_params"
    ),
    "fineflow doctor": (
        "tests/test_goodput.py::test_fineflow_doctor_prints_text_or_json_and_its_exit_code_follows_fail_on"
    ),
    "fineflow doctor --json": (
        "tests/test_goodput.py::test_fineflow_doctor_prints_text_or_json_and_its_exit_code_follows_fail_on"
    ),
    "fineflow doctor --fail-on warn": (
        "tests/test_goodput.py::test_fineflow_doctor_prints_text_or_json_and_its_exit_code_follows_fail_on"
    ),
    **dict.fromkeys(
        [
            "dvc exp run --queue --name lr-high -S train.lr=0.02 -S train.lora.r=8 evaluate",
            "dvc exp run --queue --name r-small -S train.lr=0.004 -S train.lora.r=4 evaluate",
            "dvc queue start",
            "dvc exp show",
            "dvc exp apply lr-high && dvc repro",
        ],
        "tests/test_ci.py::test_queued_experiments_wait_for_the_workspace_reuse_the_shards_compare_in_exp_show_and_never_promote",
    ),
    "make serve": "tests/test_runs.py::test_make_serves_schedule_is_in_its_own_time_zone_and_its_scheduled_run_fires",
    'make serve CRON="0 */6 * * *" TIMEZONE=Europe/Berlin': (
        "tests/test_runs.py::test_make_serves_schedule_is_in_its_own_time_zone_and_its_scheduled_run_fires"
    ),
    **dict.fromkeys(
        [
            "export PREFECT_API_URL=http://127.0.0.1:4300/api",
            "make deploy",
            "make worker",
            "fineflow data add data/incoming/rows.jsonl",
        ],
        "tests/test_runs.py::test_prefect_yaml_deploys_both_deployments_a_worker_runs_them_and_new_data_triggers_a_run",
    ),
    **dict.fromkeys(
        [
            "dvc remote add -d store s3://my-bucket/fineflow",
            "dvc remote modify store endpointurl https://minio.example:9000",
            "dvc remote modify --local store access_key_id …",
            "dvc remote modify --local store secret_access_key …",
            "dvc push",
            "dvc pull && dvc repro",
        ],
        "tests/test_flow.py::test_flow_then_dvc_repro",  # through conftest.add_s3_remote, against moto's S3 server
    ),
    "fineflow registry verify": "tests/test_registry.py::test_tampered_log_fails_verify_naming_the_line",
    "fineflow registry list": (
        "tests/test_registry.py::test_registry_list_names_every_candidate_its_decision_and_the_champion"
    ),
    "fineflow registry rollback [--to ID]": (
        "tests/test_registry.py::test_rollback_reinstalls_the_previous_champion_and_is_logged"
    ),
    "fineflow registry repair": (
        "tests/test_registry.py::test_promote_killed_inside_its_registry_write_is_named_by_verify_and_repaired"
    ),
    "fineflow lineage models/champion": "tests/test_registry.py::test_lineage_cli_prints_a_tree",
    "fineflow plan --model 8B --method lora": (
        "tests/test_planner.py::test_plan_prints_a_breakdown_and_exit_status_says_whether_it_fits"
    ),
    "bash bench/gpu.sh --device cpu --tiny": (
        "tests/test_bench_gpu.py::test_the_cpu_dry_run_trains_through_the_stages_and_resumes_bit_exact"
    ),
}
SHELL_FENCES = ("bash", "console", "sh", "shell")
EXEMPT = re.compile(r'^!!! \w+ "Needs a (GPU|cluster)"', re.IGNORECASE)


def shown_commands(text: str):
    """(command, exempt) for each command line in a shell fence: trailing comments dropped, a `$ ` prompt too."""
    fence, exempt = None, False
    for line in text.splitlines():
        stripped = line.strip()
        if EXEMPT.match(line):
            exempt = True
        elif line and not line[0].isspace() and fence is None:
            exempt = False  # an admonition ends at the first unindented line
        opening = re.match(r"```(\w*)", stripped)
        if fence is None and opening:
            fence = opening.group(1)
        elif fence is not None and stripped.startswith("```"):
            fence = None
        elif fence in SHELL_FENCES and stripped and not stripped.startswith("#"):
            yield re.sub(r"\s+#.*$", "", stripped).removeprefix("$ "), exempt


def _doc_files():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_command_the_docs_show_is_run_by_a_test_or_needs_a_gpu_or_a_cluster():
    shown = {
        (f.relative_to(ROOT), c) for f in _doc_files() for c, exempt in shown_commands(f.read_text()) if not exempt
    }
    unknown = sorted(f"{f}: {c}" for f, c in shown if c not in COMMANDS)
    assert not unknown, "commands no test runs (add the test to COMMANDS, or mark them as needing a GPU/cluster):\n" + (
        "\n".join(unknown)
    )
    assert {c for _, c in shown} == set(COMMANDS), "COMMANDS lists a command no page shows any more"


def test_the_tests_named_for_the_commands_exist():
    for test in sorted(set(COMMANDS.values())):
        path, name = test.split("::")
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, f"{test} does not exist"


def test_the_command_check_reads_fences_and_exempts_only_gpu_and_cluster_admonitions():
    text = (
        "```bash\nmake run   # a comment\n$ fineflow doctor\n```\n"
        '!!! warning "Needs a GPU"\n\n    ```bash\n    bash bench/gpu.sh\n    ```\n'
        "After.\n```console\ndvc push\n```\n```yaml\nnot: a command\n```\n"
    )
    assert list(shown_commands(text)) == [
        ("make run", False),
        ("fineflow doctor", False),
        ("bash bench/gpu.sh", True),
        ("dvc push", False),
    ]


# --- Facts the docs state ---------------------------------------------------------------------------------------

SOURCE_PATH = re.compile(r"`((?:fineflow|tests|bench|configs|recipes|tasks|flows|eval_tasks)/[\w./-]*)`")


def _stated_text(files=None):
    """README.md, the docs pages and what they include (bench/RESULTS.md, tests/README.md)."""
    files = files or [*_doc_files(), ROOT / "bench/RESULTS.md", ROOT / "tests/README.md"]
    return {f: f.read_text(encoding="utf-8") for f in files}


def test_every_source_path_the_docs_name_exists():
    """One underscore apart (fineflow/evaluate/bundled_tasks/ against eval_tasks/): a stale name fails here."""
    missing = sorted(
        f"{f.relative_to(ROOT)}: {path}"
        for f, text in _stated_text().items()
        for path in SOURCE_PATH.findall(text)
        if not (ROOT / path.rstrip("/")).exists()
    )
    assert not missing, "the docs name paths that do not exist:\n" + "\n".join(missing)


def count_statements(text: str) -> list[str]:
    """Test counts (e.g. 'the 796 tests', 'the 10 CI scenarios', 'tests (497)'), which go stale with every test."""
    return re.findall(r"\b\d[\d,]* (?:tests|CI scenarios|scenarios)\b|\btests \(\d+\)|\bthe \d+ marked\b", text)


def test_test_counts_are_stated_only_in_tests_readme():
    stated = {f: count_statements(t) for f, t in _stated_text().items() if f != ROOT / "tests/README.md"}
    assert not {f: c for f, c in stated.items() if c}, "a test count outside tests/README.md (it goes stale)"


def test_your_own_data_names_the_format_the_mapping_and_the_params_reference():
    page = (ROOT / "docs/your-model-and-data.md").read_text(encoding="utf-8")
    data = page[page.index("- **Data:**") :].split("\n- **")[0]
    assert "`data.format`" in data and "`data.mapping`" in data and "(reference/params.md)" in data


def test_the_two_task_folders_are_told_apart_where_a_task_is_added():
    page = (ROOT / "docs/extending.md").read_text(encoding="utf-8")
    assert "`fineflow/evaluate/bundled_tasks/`" in page and "`eval_tasks/`" in page
    evaluate_map = ast.get_docstring(ast.parse((ROOT / "fineflow/evaluate/__init__.py").read_text()))
    assert "eval_tasks/" in evaluate_map and "refuses a ``task_dirs`` folder outside it" in evaluate_map
