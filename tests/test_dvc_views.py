"""What DVC's own views show of a run: `dvc plots show` (offline), `dvc metrics show` (a terminal's width) and
`dvc metrics diff` after a run that trained nothing.

Fast: `dvc plots show` / `dvc metrics show` in a copy of this project with its committed reports (no stage
runs), the page rendered in headless Chromium when the machine has one; the goodput stage after a promote-only
run, in-process on hand-written reports.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import copy_project, venv_env, write_params

WIDTH = 120  # a terminal's columns


def dvc(project: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=project, env=venv_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """This project's tracked files (its committed reports/plots and reports/metrics), as a git checkout."""
    return copy_project(tmp_path_factory.mktemp("views") / "project")


@pytest.fixture(scope="module")
def plots_page(project, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plots")
    dvc(project, "plots", "show", "-o", str(out))
    return out / "index.html"


def test_dvc_plots_show_writes_a_page_that_loads_nothing_from_the_network(plots_page):
    """DVC's default page loads vega, vega-lite and vega-embed from a CDN: offline (an air-gapped cluster) it
    is a blank page. The project's template (.dvc/config plots.html_template) carries them inline."""
    page = plots_page.read_text(encoding="utf-8")
    sources = re.findall(r"<script[^>]*\bsrc\s*=\s*[\"']?([^\"' >]+)", page, flags=re.IGNORECASE)
    assert not [src for src in sources if re.match(r"(https?:)?//", src)], sources
    assert "vegaEmbed" in page and "vega-lite" in page  # the libraries are in the page itself
    # the step log's data is inline in the specs: the first logged loss is on the page
    first = json.loads((Path(__file__).parent.parent / "reports/plots/train_steps.json").read_text())[0]
    assert str(first["loss"]) in page


def test_the_plots_page_draws_its_charts_in_chromium_without_a_network(plots_page, tmp_path):
    """The page, opened in headless Chromium that resolves no host name, draws every plot dvc.yaml declares."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on this machine (Debian: apt-get install -y chromium)")
    done = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--host-resolver-rules=MAP * ~NOTFOUND",  # offline: any network load fails
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=10000",
            "--dump-dom",
            plots_page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    drawn = len(re.findall(r"<canvas|<svg", done.stdout))
    declared = len(__import__("yaml").safe_load((Path(__file__).parent.parent / "dvc.yaml").read_text())["plots"])
    assert drawn >= declared, (drawn, declared, done.stdout[:2000])


def test_dvc_metrics_show_fits_a_terminal_and_no_column_is_mostly_empty(project):
    """One table of every stage's figures was 556+ characters wide, most cells "-" (each file filled only its
    own columns). The declared metrics are one headline file; each stage's figures stay in its own file."""
    table = dvc(project, "metrics", "show").rstrip("\n").splitlines()
    assert max(len(line) for line in table) <= WIDTH, "\n".join(table)
    rows = [line.split() for line in table[1:]]
    assert rows
    for column in range(1, len(table[0].split())):
        cells = [row[column] if column < len(row) else "-" for row in rows]
        assert cells.count("-") * 2 < len(cells), (table[0].split()[column], "\n".join(table))
    for stage in sorted((project / "reports/metrics").glob("*.json")):  # each stage's own few figures
        detail = dvc(project, "metrics", "show", str(stage.relative_to(project))).splitlines()
        assert len(detail) == 2 and max(len(line) for line in detail) <= WIDTH, "\n".join(detail)


def test_each_stage_updates_its_own_headline_figures_in_the_summary(tmp_path):
    """reports/metrics/summary.json (the declared metrics) gathers each stage's headline figures: a stage
    rewrites its own (a figure it no longer reports goes) and keeps the others'."""
    from fineflow.core.metrics import write_metrics

    report = tmp_path / "reports/train.json"
    write_metrics(report, "train", {"final_loss": 0.3, "eval_loss": 0.2, "steps": 8})
    write_metrics(tmp_path / "reports/promote.json", "promote", {"decision": "refused", "delta": -0.1})
    write_metrics(report, "train", {"eval_loss": 0.25})
    summary = json.loads((tmp_path / "reports/metrics/summary.json").read_text())
    assert summary == {"decision": "refused", "delta": -0.1}
    assert json.loads((tmp_path / "reports/metrics/train.json").read_text()) == {"eval_loss": 0.25}


LAST_TRAINING = {"goodput": 0.14125, "train_goodput": 0.86966, "mfu": 0.08182, "cost.usd_per_1m_tokens": 0.03}


def run_goodput_after(stages: dict, tmp_path: Path, monkeypatch) -> Path:
    """A workspace whose last training left LAST_TRAINING in reports/metrics/goodput.json, then a run of the
    given stages (name -> body) and the goodput stage, in-process as one run; its reports folder."""
    from fineflow.core.entry import run_entry
    from fineflow.core.journal import RUN_ID_ENV, RUN_STARTED_ENV
    from fineflow.stages import goodput

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(RUN_ID_ENV, "this-run")
    monkeypatch.setenv(RUN_STARTED_ENV, repr(time.time()))
    monkeypatch.delenv("FINEFLOW_TRAIN_WORKER", raising=False)
    params = str(write_params(tmp_path / "params.yaml"))
    reports = tmp_path / "reports"
    (reports / "metrics").mkdir(parents=True)
    (reports / "metrics/goodput.json").write_text(json.dumps({**LAST_TRAINING, "cost.run_usd": 0.02}))
    (reports / "train.json").write_text(json.dumps({"tokens": 800000, "flops": {"mfu": 0.08182}}))  # stale
    for stage, body in stages.items():
        run_entry(stage, argparse.Namespace(params=params, report=str(reports / f"{stage}.json")), body)
    argv = ["--params", params, "--report", str(reports / "goodput.json"), "--journal", str(reports / "ledger")]
    argv += ["--train-report", str(reports / "train.json"), "--steps-log", str(reports / "train_steps.jsonl")]
    assert goodput.main([*argv, "--plots", str(reports / "plots")]) == 0
    return reports


def test_a_run_that_trained_nothing_does_not_report_its_goodput_as_a_drop_to_zero(tmp_path, monkeypatch):
    """A promote-only run (train up to date): its ledger has no training, so goodput came out 0.0 and `dvc
    metrics diff` showed a drop from the last training run's. The stage keeps the last training's figures in
    the metrics and says so in its report, and puts no goodput point for it in the history plot; the run's own
    wall time and cost are still its own."""
    reports = run_goodput_after({"promote": lambda p: {"decision": "promoted", "delta": 0.1}}, tmp_path, monkeypatch)
    metrics = json.loads((reports / "metrics/goodput.json").read_text())
    assert {key: metrics.get(key) for key in LAST_TRAINING} == LAST_TRAINING, metrics
    assert metrics["cost.run_usd"] != 0.02  # this run's own cost
    report = json.loads((reports / "goodput.json").read_text())
    assert report["trained"] is False
    assert "trained nothing" in report["carried_forward"]["reason"]
    assert json.loads((reports / "metrics/summary.json").read_text())["goodput"] == 0.14125
    # the goodput-over-runs plot: no point for this run (vega-lite skips a null), not a dip to 0
    assert json.loads((reports / "plots/goodput_history.json").read_text())[-1]["goodput"] is None


def test_a_run_whose_training_failed_reports_its_own_goodput(tmp_path, monkeypatch):
    """A training that ran and failed is a run's real goodput (its wall time went to restart loss), not a run
    that trained nothing: nothing is carried over."""
    from fineflow.errors import FineflowError

    def failing_train(params):
        raise FineflowError("train.steps: the shards hold no rows")

    reports = run_goodput_after({"train": failing_train}, tmp_path, monkeypatch)
    assert json.loads((reports / "metrics/goodput.json").read_text())["goodput"] == 0.0
    assert "carried_forward" not in json.loads((reports / "goodput.json").read_text())


@pytest.mark.scenario
@pytest.mark.slow
def test_after_a_promote_only_dvc_repro_metrics_diff_shows_no_goodput_drop(reproduced, tmp_path):
    """The finished pipeline, then a promote-only edit (promote.confidence) and `dvc repro`: promote and goodput
    run (and fingerprint, which always does), no training; `dvc metrics diff` against the finished run shows the
    run's own cost but no goodput change; the freshly written headline fits a terminal."""
    from tests.conftest import copy_reproduced

    project = copy_reproduced(reproduced, tmp_path / "p", {"promote.min_delta": 0.0, "promote.confidence": 0.9})
    ran = re.findall(r"Running stage '([^']+)'", dvc(project, "repro"))
    # fingerprint: always_changed; export: its parity bootstrap is the gate's (promote.confidence)
    assert ran == ["fingerprint", "promote", "export", "goodput"], ran
    changed = json.loads(dvc(project, "metrics", "diff", "--json", "HEAD"))["reports/metrics/summary.json"]
    assert "goodput" not in changed and "run_usd" in changed, changed
    assert json.loads((project / "reports/goodput.json").read_text())["carried_forward"]["metrics"]["goodput"] > 0
    table = dvc(project, "metrics", "show").splitlines()
    assert max(len(line) for line in table) <= WIDTH, "\n".join(table)
