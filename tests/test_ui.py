"""What a person sees on the Prefect run page: stage reports as readable tables (one row per validation check, no
JSON in a cell, numbers rounded to what they mean), the gate's interval labelled at its real confidence, a failed
stage's fix on screen, no file:// links, the goodput chart of this workspace's own runs, run names that tell runs
apart, and a log line at least every heartbeat from a silent stage. The browser test renders the artifact pages
of a real server's run in headless Chromium."""

from __future__ import annotations

import json

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
        assert not cell.startswith(("{", "[")), cell  # seen on main: checks.* as one-line JSON objects
    figures = {row["figure"]: row["value"] for row in rows}
    assert figures["rows_in"] == "4,120" and figures["pii_redacted.email"] == "3" and figures["passed"] == "yes"
    assert figures["truncation_rate"] == "1.2%" and figures["eval.rows_kept"] == "200"
    assert not any(f.startswith(("checks", "eval.checks")) for f in figures)  # in their own tables
    checks = {row["name"]: row for row in sections["checks"]}
    assert set(checks) == {"empty_output", "duplicates"} and set(sections) == {"checks", "eval.checks"}
    empty = checks["empty_output"]
    assert (empty["category"], empty["severity"], empty["failed rows"]) == ("completeness", "error", "7")
    assert empty["first failed lines"] == "12, 57, 98" and empty["share"] == "0.2%"
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
    assert "60% bootstrap CI" in table and "95%" not in table  # seen on main: always "95%"
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
    assert "```" not in markdown  # seen on main: the whole message in one code block that does not wrap
    assert "\nChanged: train.steps: 200 -> 60.\n" in markdown and "\nRestore those params" in markdown
    crash = "stage tokenize failed (exit 255):\nERROR: failed to reproduce 'tokenize'\nTraceback: boom"
    artifacts.publish_failure("tokenize", RuntimeError(crash))
    first, _, rest = shown["markdown"].partition("```")
    assert "stage tokenize failed (exit 255):" in first and "Traceback: boom" in rest


def test_no_file_links_and_no_model_card_that_does_not_exist(tmp_path):
    report = {"decision": "refused", "reason": "delta below min_delta", "candidate_id": "abc", "confidence": 0.95}
    markdown = artifacts.promotion_markdown(report, tmp_path)
    assert "file://" not in markdown and "README.md" not in markdown  # seen on main: a link to nothing
    card = tmp_path / "models/champion/README.md"
    card.parent.mkdir(parents=True)
    card.write_text("# champion\n")
    promoted = artifacts.promotion_markdown({**report, "decision": "promoted"}, tmp_path)
    assert "file://" not in promoted and "models/champion/README.md" in promoted


def test_the_approval_request_labels_its_interval_at_its_confidence():
    from tasks.approval import approval_markdown

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


def test_the_goodput_chart_shows_this_workspaces_runs_only_with_its_legend_clear_of_the_axis(tmp_path, monkeypatch):
    """Seen on main: "run 1" and "run 2" of the committed history (another machine's runs) on a new user's chart,
    and the legend over the x-axis label."""
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
    """Seen on main: two runs with different param edits were both named "<sha>+edits" (and a failed or
    crashed run keeps the name it started with, so the start name must tell runs apart)."""
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


def test_a_silent_stage_still_gets_a_log_line_every_heartbeat(tmp_path, monkeypatch):
    """Seen on main: the base stage's log silent for minutes while it pretrains. Whatever a stage prints, the
    task logs a line when it has been silent for a heartbeat (30 s; shortened here)."""
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
    from fineflow.base import model as base_model
    from fineflow.core.config import BaseParams, ModelParams
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
