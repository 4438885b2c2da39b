"""The train stage's step log as files DVC's plots and a person can open.

The loop appends one JSON line per step to ``reports/train_steps.jsonl`` (crash-safe: a resume keeps the lines up
to its step). DVC 3 reads JSON, YAML, CSV and TSV plots, not JSONL, and its HTML loads vega from a CDN that a
machine without internet cannot reach. So after training the launcher writes, under ``reports/plots/``:

- ``train_steps.json``: every step's record (loss, lr, tokens/s, memory, the step time's split), without the
  row ids; ``eval_loss.json``: the steps that evaluated. dvc.yaml's plots read these.
- ``loss.png`` (loss and eval loss), ``tokens_per_s.png`` and ``memory.png``: static charts that render
  anywhere (matplotlib's Agg backend: no display, no network).
"""

from __future__ import annotations

import json
from pathlib import Path

from fineflow.core.reports import write_text_atomic

# the fields of a step record that are figures over steps (the rest, such as the rows trained on, are not)
PLOTTED = (
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "peak_mem_mb",
    "step_s",
    "data_wait_s",
    "compute_s",
    "optimizer_s",
    "checkpoint_s",
)

TRAIN_CHARTS = ("loss.png", "tokens_per_s.png", "memory.png")  # write_charts' files (the goodput stage draws others)


def read_steps(steps_log: Path) -> list[dict]:
    """The step log's records; a torn last line (a crash while writing it) is left out."""
    records = []
    for line in steps_log.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            break
    return records


def write_plot_data(records: list[dict], out_dir: Path) -> list[Path]:
    steps = [{key: record[key] for key in PLOTTED if key in record} for record in records]
    evals = [{"step": r["step"], "eval_loss": r["eval_loss"]} for r in records if r.get("eval_loss") is not None]
    paths = [out_dir / "train_steps.json", out_dir / "eval_loss.json"]
    for path, rows in zip(paths, (steps, evals), strict=True):
        write_text_atomic(path, json.dumps(rows, indent=1) + "\n")
    return paths


def _chart(path: Path, title: str, ylabel: str, series: list[tuple[str, list, list]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no network
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 3.5), dpi=100)
    for label, xs, ys in series:
        if xs:
            axes.plot(xs, ys, marker="." if len(xs) < 50 else None, label=label)
    axes.set(title=title, xlabel="step", ylabel=ylabel)
    axes.grid(alpha=0.3)
    if len(series) > 1:
        axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    figure.savefig(tmp, format="png")
    pyplot.close(figure)
    tmp.replace(path)
    return path


def write_charts(records: list[dict], out_dir: Path) -> list[Path]:
    def series(field: str) -> tuple[list, list]:
        rows = [r for r in records if r.get(field) is not None]
        return [r["step"] for r in rows], [r[field] for r in rows]

    return [
        _chart(
            out_dir / "loss.png", "loss", "loss", [("train loss", *series("loss")), ("eval loss", *series("eval_loss"))]
        ),
        _chart(out_dir / "tokens_per_s.png", "real tokens/s", "tokens/s", [("tokens/s", *series("tokens_per_s"))]),
        _chart(out_dir / "memory.png", "peak memory", "MiB", [("peak memory", *series("peak_mem_mb"))]),
    ]


def write_run_plots(steps_log: Path, out_dir: Path) -> list[Path]:
    """The plot data and the charts of the run in steps_log (nothing when it has no step)."""
    if not steps_log.exists():
        return []
    records = read_steps(steps_log)
    if not records:
        return []
    return write_plot_data(records, out_dir) + write_charts(records, out_dir)
