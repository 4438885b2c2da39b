"""The figures worth diffing between runs: a few per stage, picked from its full report.

``dvc metrics show`` / ``dvc metrics diff --md`` read these files (``reports/metrics/<stage>.json``, declared as
metrics in dvc.yaml), not the full reports: those hold every GX expectation, the planner's byte counts and the
decision's sentence, about 400 columns that fit no PR comment. The full reports stay where they are
(``reports/<stage>.json``), as Prefect artifacts and for reading.
"""

from __future__ import annotations

from pathlib import Path

# stage -> the report's fields (dotted for a nested one) that make its metrics; a field the report lacks is
# left out. evaluate's models map each "task/metric" to its value, per model.
CURATED = {
    "validate": ("rows_in", "rows_kept", "rows_quarantined", "rows_warned", "eval.rows_kept", "eval.rows_quarantined"),
    "tokenize": ("tokens", "real_token_share"),
    "train": (
        "final_loss",
        "eval_loss",
        "tokens_per_s",
        "tokens",
        "steps",
        "world_size",
        "peak_mem_mb",
        "data_wait_share",
        "wall_s",
    ),
    "evaluate": ("base", "candidate", "champion"),
    "goodput": (
        "goodput",
        "train_goodput",
        "total_s",
        "mfu",
        "cost.run_usd",
        "cost.usd_per_1m_tokens",
        "biggest_badput",
    ),
    "promote": ("decision", "delta", "ci_low", "ci_high", "p_value", "candidate_value", "reference_value"),
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
    return picked


def metrics_path(report_path: str | Path, stage: str) -> Path:
    """reports/<stage>.json -> reports/metrics/<stage>.json."""
    return Path(report_path).parent / "metrics" / f"{stage}.json"
