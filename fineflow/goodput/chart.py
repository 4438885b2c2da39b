"""The goodput buckets as a stacked bar (PNG, offline) and the runs' history as DVC plot data."""

from __future__ import annotations

import json
from pathlib import Path

from fineflow.core.reports import write_text_atomic
from fineflow.goodput.ledger import BUCKETS

HISTORY_FILE = "goodput_history.json"
HISTORY_RUNS = 50  # kept in the plot data (the ledgers of older runs stay in reports/ledger/runs)


def history_row(ledger: dict, index: int) -> dict:
    cost = ledger.get("cost") or {}
    total = ledger["total_s"] or 1.0
    return {
        "run": index,
        "when": ledger.get("ended_at"),
        "goodput": ledger["goodput"],
        "total_s": ledger["total_s"],
        "run_usd": cost.get("run_usd"),
        "usd_per_1m_tokens": cost.get("usd_per_1m_tokens"),
        **{f"{name}_share": round(ledger["buckets"][name] / total, 5) for name in BUCKETS},
    }


def append_history(ledger: dict, plots_dir: Path) -> list[dict]:
    """reports/plots/goodput_history.json: one row per ledger (dvc.yaml's goodput and cost plots over runs)."""
    path = Path(plots_dir) / HISTORY_FILE
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        rows = []
    rows = [row for row in rows if isinstance(row, dict)]
    index = (rows[-1].get("run", len(rows)) + 1) if rows else 1
    rows = (rows + [history_row(ledger, index)])[-HISTORY_RUNS:]
    write_text_atomic(path, json.dumps(rows, indent=1) + "\n")
    return rows


def stacked_bar(rows: list[dict], path: Path, title: str = "where each run's wall time went") -> Path:
    """One horizontal bar per run (the last 10), its buckets' shares stacked."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no network
    from matplotlib import pyplot

    rows = rows[-10:]
    figure, axes = pyplot.subplots(figsize=(9, 1.2 + 0.45 * len(rows)), dpi=100)
    colors = pyplot.get_cmap("tab20").colors
    labels = [f"run {row['run']}" for row in rows]
    left = [0.0] * len(rows)
    for i, name in enumerate(BUCKETS):
        shares = [row.get(f"{name}_share") or 0.0 for row in rows]
        if not any(shares):
            continue
        axes.barh(labels, shares, left=left, color=colors[i % len(colors)], label=name)
        left = [a + b for a, b in zip(left, shares, strict=True)]
    axes.set(title=title, xlabel="share of the run's wall time", xlim=(0, 1))
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(rows) < 3 else -0.15), ncol=5, fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    figure.savefig(tmp, format="png", bbox_inches="tight")
    pyplot.close(figure)
    tmp.replace(path)
    return path
