"""The goodput buckets as a stacked bar (PNG, offline) and the runs' history as DVC plot data.

Each history row names the workspace it was measured in (a random id kept in ``reports/ledger/workspace_id``,
never committed): the history file may hold rows committed from other clones (CI's, or the project's authors'),
and the run page's chart shows only this workspace's runs, each named by when it ended."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from fineflow.core.reports import write_text_atomic
from fineflow.goodput.ledger import BUCKETS

HISTORY_FILE = "goodput_history.json"
HISTORY_RUNS = 50  # kept in the plot data (the ledgers of older runs stay in reports/ledger/runs)


def workspace_id(plots_dir: Path) -> str:
    """This workspace's id (reports/ledger/workspace_id beside reports/plots), made on first use."""
    path = Path(plots_dir).parent / "ledger" / "workspace_id"
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        write_text_atomic(path, uuid.uuid4().hex[:12] + "\n")
        return path.read_text(encoding="utf-8").strip()


def history_row(ledger: dict, index: int, workspace: str | None = None) -> dict:
    cost = ledger.get("cost") or {}
    total = ledger["total_s"] or 1.0
    return {
        "run": index,
        "workspace": workspace,
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
    rows = same_keys((rows + [history_row(ledger, index, workspace_id(plots_dir))])[-HISTORY_RUNS:])
    write_text_atomic(path, json.dumps(rows, indent=1) + "\n")
    return rows


def same_keys(rows: list[dict]) -> list[dict]:
    """Every row with every key (a missing value null; a missing workspace "", a run from before the ids): DVC's
    plots fail on a file whose first row lacks a key a later row has ("argument of type 'NoneType' is not
    iterable", the plots over runs empty), as the committed rows did once a run added its workspace."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    return [{key: row.get(key, "" if key == "workspace" else None) for key in keys} for row in rows]


def own_runs(rows: list[dict], workspace: str) -> list[dict]:
    """The rows measured in this workspace (committed rows of other clones have another id, or none)."""
    return [row for row in rows if row.get("workspace") == workspace]


def run_label(row: dict) -> str:
    """A run as the chart names it: when it ended (UTC, "12-03 01:02"), else its number."""
    when = str(row.get("when") or "")
    return f"{when[5:10]} {when[11:16]}" if len(when) >= 16 else f"run {row.get('run')}"


def stacked_bar(rows: list[dict], path: Path, title: str = "where this workspace's runs spent their wall time") -> Path:
    """One horizontal bar per run of this workspace (the last 10), its buckets' shares stacked; the legend to
    the right of the bars, clear of them and of the axis label."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no network
    from matplotlib import pyplot

    rows = own_runs(rows, workspace_id(Path(path).parent))[-10:]
    figure, axes = pyplot.subplots(figsize=(10, 1.6 + 0.45 * len(rows)), dpi=100)
    colors = pyplot.get_cmap("tab20").colors
    labels = [run_label(row) for row in rows]
    left = [0.0] * len(rows)
    for i, name in enumerate(BUCKETS):
        shares = [row.get(f"{name}_share") or 0.0 for row in rows]
        if not any(shares):
            continue
        axes.barh(labels, shares, left=left, color=colors[i % len(colors)], label=name)
        left = [a + b for a, b in zip(left, shares, strict=True)]
    axes.set(title=title, xlabel="share of the run's wall time", xlim=(0, 1))
    axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    figure.savefig(tmp, format="png", bbox_inches="tight")  # tight: the legend outside the axes is kept
    pyplot.close(figure)
    tmp.replace(path)
    return path
