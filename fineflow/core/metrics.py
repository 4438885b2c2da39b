"""The figures worth diffing between runs: a headline for the whole pipeline, and a few per stage.

``dvc metrics show`` / ``dvc metrics diff --md`` read ``reports/metrics/summary.json`` (the one file dvc.yaml declares
as metrics): seven figures across the stages, one row that fits a terminal and a PR comment. DVC puts every
declared file in one table with the union of their keys as columns, so declaring each stage's file made a table
600 characters wide, each column empty but in one row. Each stage's few figures are in
``reports/metrics/<stage>.json`` (``dvc metrics show reports/metrics/train.json``), and its full report stays
where it is (``reports/<stage>.json``: every GX expectation, the planner's byte counts, the decision's sentence).
"""

from __future__ import annotations

from pathlib import Path

from fineflow.core.reports import read_json, write_json_atomic

# stage -> the report's fields (dotted for a nested one) that make its metrics, a handful each so that `dvc metrics
# show reports/metrics/<stage>.json` fits a terminal; a field the report lacks is left out. evaluate's candidate
# maps each "task/metric" to its value (the base's and the champion's are in reports/evaluate.json, the
# comparison in promote's).
CURATED = {
    "validate": ("rows_kept", "rows_quarantined", "rows_warned", "eval.rows_kept", "eval.rows_quarantined"),
    "tokenize": ("tokens", "real_token_share"),
    "train": ("final_loss", "eval_loss", "tokens", "tokens_per_s", "peak_mem_mb", "wall_s"),
    "evaluate": ("candidate",),
    "goodput": ("goodput", "train_goodput", "mfu", "total_s", "cost.run_usd", "cost.usd_per_1m_tokens"),
    "promote": ("decision", "delta", "ci_low", "ci_high", "p_value", "candidate_value", "reference_value"),
}

SUMMARY_FILE = "summary.json"
# summary key -> (stage, that stage's curated metric): the run's headline, in words a reader knows
HEADLINE = {
    "rows_kept": ("validate", "rows_kept"),
    "train_loss": ("train", "final_loss"),
    "score": ("promote", "candidate_value"),  # the candidate on promote.metric
    "delta": ("promote", "delta"),  # against the champion (or the base)
    "decision": ("promote", "decision"),
    "goodput": ("goodput", "goodput"),
    "run_usd": ("goodput", "cost.run_usd"),
}


def curated(stage: str, report: dict) -> dict | None:
    """The stage's metrics from its report (None: a stage with none, such as base or fingerprint)."""
    if stage not in CURATED:
        return None
    picked = {}
    for field in CURATED[stage]:
        value = report
        for key in field.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            picked[field] = value
    # what the stage did not measure this run and carries over from its last measurement (the goodput of a run
    # that trained nothing: fineflow.goodput.ledger.carry_forward); None drops a figure
    for field, value in ((report.get("carried_forward") or {}).get("metrics") or {}).items():
        if value is None:
            picked.pop(field, None)
        else:
            picked[field] = value
    return picked


def write_metrics(report_path: str | Path, stage: str, report: dict) -> None:
    """The stage's curated figures to reports/metrics/<stage>.json and its headline ones to the summary (the
    other stages' headline figures are kept: each stage updates its own)."""
    metrics = curated(stage, report)
    if metrics is None:
        return
    write_json_atomic(metrics_path(report_path, stage), metrics)
    summary_path = metrics_path(report_path, stage).with_name(SUMMARY_FILE)
    try:
        summary = read_json(summary_path)
    except (OSError, ValueError):
        summary = {}
    for key, (owner, field) in HEADLINE.items():
        if owner == stage:
            summary[key] = metrics.get(field)
    write_json_atomic(summary_path, {key: summary[key] for key in HEADLINE if summary.get(key) is not None})


def metrics_path(report_path: str | Path, stage: str) -> Path:
    """reports/<stage>.json -> reports/metrics/<stage>.json."""
    return Path(report_path).parent / "metrics" / f"{stage}.json"
