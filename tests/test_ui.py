"""What a person sees on the Prefect run page: stage reports as readable tables (one row per validation check, no
JSON in a cell, numbers rounded to what they mean), the gate's interval labelled at its real confidence, a failed
stage's fix on screen, no file:// links, the goodput chart of this workspace's own runs, run names that tell runs
apart, and a log line at least every heartbeat from a silent stage. The browser test renders the artifact pages
of a real server's run in headless Chromium."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fineflow.core.reports import gate_evidence_table
from tasks import artifacts


def _check(category: str, severity: str, failed: int, lines: list[int]) -> dict:
    return {
        "category": category,
        "expectation": "expect_column_values_to_not_be_null",
        "severity": severity,
        "failed_rows": failed,
        "share": round(failed / 4120, 5),
        "max_share": 0.05,
        "passed": True,
        "first_failed_lines": lines,
    }


VALIDATE_REPORT = {
    "stage": "validate",
    "rows_in": 4120,
    "rows_kept": 4013,
    "rows_quarantined": 107,
    "truncation_rate": 0.01234,
    "pii_redacted": {"email": 3},
    "checks": {
        "empty_output": _check("completeness", "error", 7, [12, 57, 98]),
        "duplicates": _check("duplication", "warn", 100, list(range(3, 43, 2))),
    },
    "schema_problems": [],
    "eval": {"rows_in": 200, "rows_kept": 200, "checks": {"empty_output": _check("completeness", "error", 0, [])}},
    "passed": True,
}


def _cells(rows: list[dict]) -> list[str]:
    return [str(value) for row in rows for value in row.values()]


def test_the_validate_report_shows_one_row_per_check_and_no_json_in_any_cell():
    rows = artifacts.report_table(VALIDATE_REPORT)
    sections = artifacts.report_sections(VALIDATE_REPORT)
    for cell in _cells(rows) + [c for section in sections.values() for c in _cells(section)]:
        assert not cell.startswith(("{", "[")), cell  # checks.* never as one-line JSON objects
    figures = {row["figure"]: row["value"] for row in rows}
    assert figures["rows_in"] == "4,120" and figures["pii_redacted.email"] == "3" and figures["passed"] == "yes"
    assert figures["truncation_rate"] == "1.2%" and figures["eval.rows_kept"] == "200"
    assert not any(f.startswith(("checks", "eval.checks")) for f in figures)  # in their own tables
    checks = {row["name"]: row for row in sections["checks"]}
    assert set(checks) == {"empty_output", "duplicates"} and set(sections) == {"checks", "eval.checks"}
    empty = checks["empty_output"]
    assert (empty["category"], empty["severity"], empty["failed rows"]) == ("completeness", "error", "7")
    assert empty["first failed lines"] == "12, 57, 98" and empty["share"] == "0.2% (max 5.0%)"
    assert checks["duplicates"]["first failed lines"] == "3, 5, 7, …, 39, 41 (20 values)"


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("eval_loss", 1.234567891, "1.2346"),
        ("goodput", 0.18465, "18.5%"),
        ("total_s", 572.19421, "572.2 s"),
        ("tokens_per_s", 12920.537, "12,920.5"),
        ("peak_mem_mb", 1536.0, "1.5 GiB"),
        ("adapter_bytes", 3 * 2**20, "3.0 MiB"),
        ("run_usd", 0.015894123, "$0.0159"),
        ("fineflow_synth/exact_match", 0.76500000001, "0.7650"),
        ("lr", 2e-05, "2e-05"),
        ("losses", [0.5, 0.25], "0.5000, 0.2500"),
    ],
)
def test_numbers_are_rounded_to_what_they_mean(key, value, shown):
    [row] = artifacts.report_table({key: value})
    assert row["value"] == shown


def test_the_gates_interval_is_labelled_at_the_confidence_it_was_computed_at():
    report = {"delta": 0.05, "ci_low": -0.01234567, "ci_high": 0.1, "p_value": 0.21, "confidence": 0.6}
    table = "\n".join(gate_evidence_table(report))
    assert "60% bootstrap CI" in table and "95%" not in table  # the level used, not "95%"
    assert "[-0.0123, +0.1000]" in table
    assert "CI" not in "\n".join(gate_evidence_table({"delta": None, "ci_low": None}))  # no interval, no label


def test_a_failed_stages_fix_is_its_own_wrapping_line_and_the_output_tail_a_code_block(monkeypatch):
    shown = {}
    monkeypatch.setattr(artifacts, "create_markdown_artifact", lambda **kw: shown.update(kw))
    message = (
        "stage train failed (a user error, not retried): checkpoints/run-1 is an unfinished run (step 40 of 200) "
        "of another configuration. Changed: train.steps: 200 -> 60. Restore those params to resume it, or set "
        "train.resume: never to start this configuration fresh."
    )
    artifacts.publish_failure("train", RuntimeError(message))
    markdown = shown["markdown"]
    assert "```" not in markdown  # not the whole message in one code block, which does not wrap
    assert "\nChanged: train.steps: 200 -> 60.\n" in markdown and "\nRestore those params" in markdown
    crash = "stage tokenize failed (exit 255):\nERROR: failed to reproduce 'tokenize'\nTraceback: boom"
    artifacts.publish_failure("tokenize", RuntimeError(crash))
    first, _, rest = shown["markdown"].partition("```")
    assert "stage tokenize failed (exit 255):" in first and "Traceback: boom" in rest


def test_no_file_links_and_no_model_card_that_does_not_exist(tmp_path):
    report = {"decision": "refused", "reason": "delta below min_delta", "candidate_id": "abc", "confidence": 0.95}
    markdown = artifacts.promotion_markdown(report, tmp_path)
    assert "file://" not in markdown and "README.md" not in markdown  # no link to a missing file
    card = tmp_path / "models/champion/README.md"
    card.parent.mkdir(parents=True)
    card.write_text("# champion\n")
    refused = artifacts.promotion_markdown(report, tmp_path)
    assert "models/champion/README.md (the champion’s, unchanged)" in refused
    card.write_text("# champion\n\n## Evaluation\n\n| task | metric |\n|---|---|\n| synth | em |\n\n## Training\n")
    promoted = artifacts.promotion_markdown({**report, "decision": "promoted"}, tmp_path)
    assert "file://" not in promoted and "| model card | models/champion/README.md |" in promoted
    assert "| synth | em |" in promoted and "## Training" not in promoted  # the card's evaluation, embedded


def test_the_approval_request_labels_its_interval_at_its_confidence():
    from tasks.approval_pause import approval_markdown

    evidence = {"candidate_id": "abc", "delta": 0.1, "ci_low": 0.01, "ci_high": 0.2, "confidence": 0.6}
    markdown = approval_markdown(evidence)
    assert "60% bootstrap CI" in markdown and "95%" not in markdown


def test_every_report_cell_is_short_enough_for_a_table():
    """No cell longer than a line of the page: long lists are shown by their ends, sections get their own table."""
    report = {**VALIDATE_REPORT, "losses": [1.0 / (i + 1) for i in range(800)]}
    rows = artifacts.report_table(report)
    assert max(len(cell) for cell in _cells(rows)) <= 80, json.dumps(rows)[:500]


def _ledger(ended_at: str) -> dict:
    from fineflow.goodput.ledger import BUCKETS

    buckets = dict.fromkeys(BUCKETS, 0.0) | {"compute": 30.0, "orchestration": 10.0}
    return {"total_s": 40.0, "goodput": 0.75, "ended_at": ended_at, "buckets": buckets, "cost": {}}


def test_every_history_row_has_a_workspace_so_dvc_plots_can_read_the_file(tmp_path):
    """Seen on the merge of workspace ids: the committed history's rows had no "workspace" and the new run's row had
    one, and `dvc plots show` failed on the mixed file ("argument of type 'NoneType' is not iterable": the
    goodput and cost plots over runs empty; tests/test_ddp.py's plots test caught it in a fresh clone)."""
    import subprocess
    import sys

    from fineflow.goodput.chart import HISTORY_FILE, append_history

    old = [{"run": 1, "when": "2026-12-01T00:00:00Z", "goodput": 0.1, "run_usd": 0.01}]
    (tmp_path / HISTORY_FILE).write_text(json.dumps(old), encoding="utf-8")
    rows = append_history(_ledger("2026-12-02T00:00:00Z"), tmp_path)
    assert [row["workspace"] for row in rows][0] == "" and all(isinstance(row["workspace"], str) for row in rows)
    assert rows[1]["workspace"] and rows[1]["run"] == 2
    # and DVC reads it: the over-runs plot of a project holding this history shows both points
    project = tmp_path / "project"
    (project / "reports/plots").mkdir(parents=True)
    (project / "reports/plots" / HISTORY_FILE).write_text(json.dumps(rows), encoding="utf-8")
    (project / "dvc.yaml").write_text(
        "plots:\n  - goodput_over_runs:\n      x: run\n      y:\n        reports/plots/goodput_history.json: goodput\n",
        encoding="utf-8",
    )
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=project, check=True)
    shown = subprocess.run(
        [sys.executable, "-m", "dvc", "plots", "show", "--json"], cwd=project, capture_output=True, text=True
    )
    data = json.loads(shown.stdout)
    assert not data.get("errors"), data.get("errors")
    assert len(data["data"]["goodput_over_runs"][0]["content"]["data"]["values"]) == 2


def test_the_goodput_chart_shows_this_workspaces_runs_only_with_its_legend_clear_of_the_axis(tmp_path, monkeypatch):
    """A new user's chart leaves out the committed history's runs ("run 1", "run 2": another machine's), and
    its legend is clear of the x-axis label."""
    from fineflow.goodput import chart

    plots = tmp_path / "reports/plots"
    plots.mkdir(parents=True)
    committed = [chart.history_row(_ledger(f"2026-12-02T0{i}:00:00Z"), i) for i in (1, 2)]
    for row in committed:
        row.pop("workspace", None)  # as the history committed in the project's repository has them
    (plots / chart.HISTORY_FILE).write_text(json.dumps(committed))
    rows = chart.append_history(_ledger("2026-12-03T01:02:03Z"), plots)
    assert len(rows) == 3  # the history file keeps every row (DVC plots over runs)
    from matplotlib import pyplot

    drawn = []
    monkeypatch.setattr(pyplot, "close", drawn.append)  # the figure, kept open once saved
    chart.stacked_bar(rows, plots / "goodput.png")
    [figure] = drawn
    [axes] = figure.axes
    labels = [tick.get_text() for tick in axes.get_yticklabels()]
    assert labels == ["12-03 01:02"], labels  # this workspace's run, named by when it ended
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    legend = axes.get_legend().get_window_extent(renderer)
    xlabel = axes.xaxis.label.get_window_extent(renderer)
    assert not legend.overlaps(xlabel), (legend, xlabel)
    assert not legend.overlaps(axes.get_window_extent(renderer))  # nor over the bars


def _named(project, monkeypatch, overrides=None) -> str:
    from prefect.runtime import flow_run

    from tasks import runs

    parameters = {"project_dir": str(project), "overrides": overrides}
    monkeypatch.setitem(flow_run.FIELDS, "parameters", lambda: parameters)  # as inside the flow run
    return runs.flow_run_name()


def test_runs_with_different_param_edits_get_different_names_from_their_start(tmp_path, monkeypatch):
    """Two runs with different param edits are not both named "<sha>+edits": a failed or crashed run keeps
    the name it started with, so the start name must tell runs apart."""
    import subprocess

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "params.yaml").write_text("train:\n  steps: 200\n")
    subprocess.run(git + ["add", "-A"], cwd=tmp_path, check=True)
    subprocess.run(git + ["commit", "-qm", "x"], cwd=tmp_path, check=True)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True)
    clean = _named(tmp_path, monkeypatch)
    (tmp_path / "params.yaml").write_text("train:\n  steps: 60\n")
    sixty = _named(tmp_path, monkeypatch)
    (tmp_path / "params.yaml").write_text("train:\n  steps: 80\n")
    eighty = _named(tmp_path, monkeypatch)
    overridden = _named(tmp_path, monkeypatch, {"train.lr": 0.001})
    edits = [name.split()[0] for name in (clean, sixty, eighty, overridden)]
    assert len(set(edits)) == 4, edits  # the commit and a short hash of the edits (overrides included)
    assert edits[1].startswith(sha.stdout.strip() + "+edits-")
    assert clean.startswith(sha.stdout.strip() + " ") and clean.endswith(" UTC")  # the commit, then its start


@pytest.mark.slow  # dvc repro
def test_a_silent_stage_still_gets_a_log_line_every_heartbeat(tmp_path, monkeypatch):
    """No stage's log is silent for minutes (the base stage's as it pretrains): whatever a stage prints,
    the task logs a line when it has been silent for a heartbeat (30 s; shortened here)."""
    import subprocess
    import sys

    from tasks import stages

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text(
        f"stages:\n  quiet:\n    cmd: {sys.executable} -c \"import time; time.sleep(3); open('out', 'w')\"\n"
        "    outs: [out]\n"
    )
    monkeypatch.setattr(stages, "HEARTBEAT_S", 0.5, raising=False)
    lines = []
    assert stages.repro_single("quiet", tmp_path, lines.append) is True
    beats = [line for line in lines if line.startswith("stage quiet: still running")]
    assert beats, lines
    assert "no output for" in beats[0]


def test_base_pretraining_prints_progress_by_time_not_only_every_50_steps(monkeypatch):
    """On a busy machine 50 pretraining steps take minutes: a line also whenever PROGRESS_S has passed (0 here)."""
    from fineflow.base import embedded as base_model
    from fineflow.core.model_config import BaseParams, ModelParams
    from fineflow.corpus import pretraining_corpus

    texts = list(pretraining_corpus(300, 0))
    tokenizer = base_model.train_tokenizer(texts, 400, 64)
    cfg = ModelParams(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, vocab_size=400)
    model = base_model.build_model(cfg, tokenizer, 0)
    monkeypatch.setattr(base_model, "PROGRESS_S", 0.0, raising=False)
    lines = []
    base = BaseParams(steps=4, batch_size=2, seq_len=16, warmup_steps=0)
    base_model.pretrain(model, tokenizer, texts, base, 0, log=lines.append)
    assert [line.split(" loss")[0] for line in lines] == [f"pretrain step {i}/4" for i in (1, 2, 3, 4)]
    assert lines[-1].endswith("ETA 0s")


# ---- the run page in a browser --------------------------------------------------------------------------------

SCREENSHOTS = Path(__file__).resolve().parent.parent / "logs" / "screenshots"  # CI keeps them (not in git)

# a stage command for the browser test's project: writes the report it is given, or fails with a user error
STAGE_SCRIPT = """
import json, shutil, sys
from fineflow.core.reports import write_error_record
stage = sys.argv[1]
if stage == "train":
    write_error_record(f"reports/{stage}.json", stage, open("given/train_error.txt").read())
    sys.exit(2)
shutil.copy(f"given/{stage}.json", f"reports/{stage}.json")
"""

FLOW_SCRIPT = """
import sys
from prefect import flow
from tasks.stages import run_stage

@flow(name="fineflow-ui-test")
def pages(project_dir):
    for stage in ("validate", "evaluate", "promote", "train"):
        run_stage(stage, project_dir, return_state=True)

pages(sys.argv[1])
"""

RESUME_ERROR = (
    "checkpoints/run-1 is an unfinished run (step 40 of 200) of another configuration; resuming it with these "
    "params would not continue the same training. Changed: train.steps: 200 -> 60. Restore those params to resume "
    "it, or set train.resume: never to start this configuration fresh (the other run's checkpoints are kept)."
)

EVALUATE_REPORT = {
    "stage": "evaluate",
    "base": {"fineflow_synth/exact_match": 0.0, "fineflow_synth/exact_match_stderr": 0.0123456789},
    "candidate": {"fineflow_synth/exact_match": 0.765000001, "fineflow_synth/exact_match_stderr": 0.021987654},
    "eval_s": 33.123456,
    "eval_loss": 1.23456789,
}

PROMOTE_REPORT = {
    "decision": "promoted",
    "reason": "exact_match 0.7650 beats the champion's 0.7500 by +0.0150, 60% CI [+0.0010, +0.1000]",
    "candidate_id": "215b44c9bc1e947a",
    "primary_metric": "fineflow_synth/exact_match",
    "reference": "champion",
    "candidate_value": 0.765,
    "reference_value": 0.75,
    "delta": 0.015,
    "ci_low": 0.001,
    "ci_high": 0.1,
    "p_value": 0.21,
    "confidence": 0.6,
}

# the champion's card as fineflow.registry.card writes its evaluation section
CARD = """# fineflow champion 215b44c9bc1e947a

## Evaluation

Per-sample paired bootstrap versus the base model (seeded; percentile CI; p = share of resampled deltas <= 0).

| task | metric | value | base | delta | CI | p |
|---|---|---|---|---|---|---|
| fineflow_synth | exact_match | 0.7650 | 0.0000 | +0.7650 | [+0.7100, +0.8250] (60%) | 0.000 |
| fineflow_synth_long_task_name | exact_match_stderr | 0.0212 | 0.0000 | +0.0212 | [+0.0100, +0.0300] (60%) | 0.000 |

## Training
"""


def _page_project(root: Path) -> Path:
    """A DVC project whose stages write the given reports (and train fails with the resume error)."""
    import subprocess
    import sys

    root.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=root, check=True)
    given = root / "given"
    given.mkdir()
    for stage, report in (("validate", VALIDATE_REPORT), ("evaluate", EVALUATE_REPORT), ("promote", PROMOTE_REPORT)):
        (given / f"{stage}.json").write_text(json.dumps(report))
    (root / "reports").mkdir()
    (root / "models/champion").mkdir(parents=True)
    (root / "models/champion/README.md").write_text(CARD)
    (root / "stage.py").write_text(STAGE_SCRIPT)
    lines = ["stages:"]
    for stage in ("validate", "evaluate", "promote"):
        lines += [
            f"  {stage}:",
            f"    cmd: python stage.py {stage}",
            f"    outs: [{{reports/{stage}.json: {{cache: false}}}}]",
        ]
    (given / "train_error.txt").write_text(RESUME_ERROR)
    lines += ["  train:", "    cmd: python stage.py train", "    always_changed: true"]
    (root / "dvc.yaml").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory):
    """A Prefect server with its UI, on 127.0.0.1 (the UI's own API URL pointed at it), stopped by its PID."""
    import subprocess
    import sys

    from tests import browser
    from tests.conftest import _wait_healthy, free_port, stop_by_pid, venv_env

    if browser.CHROMIUM is None:  # before a server is started for nothing
        pytest.skip(f"no chromium on PATH (Debian: {browser.INSTALL})")
    home = tmp_path_factory.mktemp("prefect-ui")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**venv_env(), "PREFECT_HOME": str(home), "PREFECT_UI_ENABLED": "true", "PREFECT_UI_API_URL": f"{url}/api"}
    argv = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with (home / "server.log").open("w") as log:
        server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(server, f"{url}/api", home / "server.log")
        yield url
    finally:
        stop_by_pid(server)


@pytest.mark.scenario
@pytest.mark.slow
def test_the_artifact_pages_read_in_a_browser(ui_server, tmp_path):
    """A flow run of stages through run_stage (DVC, the real publishing path) against a real server; each artifact
    page rendered in headless Chromium: what a person needs is in the page's text, no table cell runs past its
    table, the failed stage's fix is a line of its own on screen. Screenshots: logs/screenshots/."""
    import subprocess
    import sys

    from tests import browser
    from tests.conftest import free_port, venv_env

    if browser.CHROMIUM is None:
        pytest.skip(f"no chromium on PATH (Debian: {browser.INSTALL})")
    project = _page_project(tmp_path / "project")
    env = {**venv_env(), "PREFECT_API_URL": f"{ui_server}/api"}
    done = subprocess.run(
        [sys.executable, "-c", FLOW_SCRIPT, str(project)], cwd=project, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = _artifacts(ui_server)
    expected = {"fineflow-validate", "fineflow-validate-checks", "fineflow-validate-eval-checks", "fineflow-evaluate"}
    expected |= {"fineflow-promote", "fineflow-promotion", "fineflow-train-failed"}
    assert expected <= set(found), sorted(found)
    page = browser.Browser(free_port(), tmp_path / "chromium")
    try:
        texts = {}
        for key in sorted(expected):
            ready = f"document.body.innerText.includes({key!r}) && document.body.innerText.includes('Show raw data')"
            page.open(f"{ui_server}/artifacts/artifact/{found[key]}", ready=ready)
            page.screenshot(SCREENSHOTS / f"{key}.png")
            texts[key] = page.evaluate("document.body.innerText")
            if key == "fineflow-train-failed":  # on screen, not off the right edge of an unwrapped code block
                for fix in ("Changed: train.steps: 200 -> 60.", "Restore those params to resume it"):
                    assert page.evaluate(browser.text_on_screen(fix)), fix
            assert page.evaluate(browser.OVERFLOWING_CELLS) == [], key
            assert "{" not in texts[key] and "file://" not in texts[key], texts[key]
    finally:
        page.close()
    checks = texts["fineflow-validate-checks"]
    for shown in ("empty_output", "completeness", "error", "12, 57, 98", "duplicates", "warn", "2.4% (max 5.0%)"):
        assert shown in checks, checks
    assert "0.7650" in texts["fineflow-evaluate"] and "0.765000001" not in texts["fineflow-evaluate"]
    promotion = texts["fineflow-promotion"]
    assert "60% bootstrap CI" in promotion and "95%" not in promotion
    assert "models/champion/README.md" in promotion and "[+0.7100, +0.8250] (60%)" in promotion  # the card's table
    assert "\nChanged: train.steps: 200 → 60.\n" in texts["fineflow-train-failed"].replace("->", "→")


def _artifacts(api_url: str) -> dict[str, str]:
    """The latest artifact id of each key."""
    import urllib.request

    request = urllib.request.Request(
        f"{api_url}/api/artifacts/filter",
        data=json.dumps({"sort": "CREATED_DESC"}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        artifacts = json.load(response)
    latest = {}
    for artifact in artifacts:
        if artifact["key"]:
            latest.setdefault(artifact["key"], artifact["id"])
    return latest


def test_the_ledger_table_rounds_seconds_and_dollars():
    ledger = _ledger("2026-12-03T01:02:03Z") | {"unaccounted_s": 0.01234, "unaccounted_share": 0.0003}
    ledger["cost"] = {"bucket_usd": {"compute": 0.0012345678}, "run_usd": 0.0015894123}
    rows = {row["bucket"]: row for row in artifacts.ledger_table(ledger)}
    assert (rows["compute"]["seconds"], rows["compute"]["usd"]) == ("30.0 s", "$0.0012")
    assert (rows["total"]["seconds"], rows["total"]["usd"]) == ("40.0 s", "$0.0016")


def test_every_stages_artifact_keys_are_keys_prefect_accepts():
    """Each dvc.yaml stage's report, section, failure and progress keys pass Prefect's own key check (lowercase
    letters, digits, dashes): reference_logps's underscore failed the flow when it published its report."""
    from prefect.types.names import raise_on_name_alphanumeric_dashes_only

    from fineflow.core.dvc_project import stage_names

    for stage in stage_names(Path(__file__).resolve().parents[1]):
        for key in (
            artifacts.artifact_key(stage),
            artifacts.artifact_key(stage, "eval.checks"),
            artifacts.artifact_key(stage, "failed"),
            artifacts.artifact_key(stage, "progress"),
        ):
            assert raise_on_name_alphanumeric_dashes_only(key, "key") == key, (stage, key)
    assert artifacts.artifact_key("reference_logps", "progress") == "fineflow-reference-logps-progress"
