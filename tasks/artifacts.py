"""What a stage's task shows on the Prefect run page: its report as a table artifact, promote's decision and
the goodput ledger's findings as markdown, the training charts embedded, a progress bar while training runs, and
a failed stage's error: published here (how they read is tasks/render.py's), beside nothing else. Running the
stage (``dvc repro``, its logs, stops and retries) is ``tasks/stages.py``'s.

Artifact keys (the run page and tests/test_runs.py read them): ``fineflow-<stage>`` (a report's table),
``fineflow-<stage>-<section>`` (a section of records, one row each: ``fineflow-validate-checks``),
``fineflow-promotion`` (again after the export stage, with the champion's exports), ``fineflow-train-charts``,
``fineflow-train-progress``, ``fineflow-goodput-ledger``,
``fineflow-goodput-doctor``, ``fineflow-<stage>-failed``.
"""

from __future__ import annotations

import base64
import contextlib
import re
import time
from pathlib import Path

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from fineflow.core.reports import gate_evidence_table, read_json
from fineflow.train.plots import TRAIN_CHARTS
from tasks import render
from tasks.render import failure_markdown

PLOTS = "reports/plots"  # where the charts are, relative to the project (shown as text under each)


def publish_report(stage: str, project: Path, report: dict, ran: bool) -> None:
    """reports/<stage>.json as a table artifact (and promote's decision as markdown): the run page's figures."""
    if stage == "goodput" and report.get("buckets"):  # the ledger: its buckets as the table, findings and chart
        create_table_artifact(
            key="fineflow-goodput-ledger",
            table=ledger_table(report),
            description="where this run's wall time and money went (reports/goodput.json)",
        )
        create_markdown_artifact(
            key="fineflow-goodput-doctor",
            markdown=ledger_markdown(report, project / "reports" / "plots"),
            description="fineflow doctor on this run",
        )
        return
    skipped = "" if ran else " (unchanged, skipped by DVC)"
    create_table_artifact(
        key=artifact_key(stage),
        table=report_table(report),
        description=f"reports/{stage}.json after the {stage} stage{skipped}",
    )
    for section, rows in report_sections(report).items():  # validate's checks: one row per check
        create_table_artifact(
            key=artifact_key(stage, section),
            table=rows,
            description=f"{section} of reports/{stage}.json, one row each{skipped}",
        )
    if stage == "promote" and report.get("decision"):
        create_markdown_artifact(
            key="fineflow-promotion", markdown=promotion_markdown(report, project), description="the promotion gate"
        )
    if stage == "export" and ran and report.get("champion"):  # the promotion's page entry, now with its exports
        promotion = _json_or_empty(project / "reports" / "promote.json")
        create_markdown_artifact(
            key="fineflow-promotion",
            markdown=promotion_markdown(promotion, project) + "\n\n" + exports_markdown(project),
            description="the promotion gate and the champion's exports",
        )
    if stage == "train" and ran:  # only then: the charts are read and base64-encoded, once per training
        charts = charts_markdown(project / "reports" / "plots")
        if charts:
            create_markdown_artifact(key="fineflow-train-charts", markdown=charts, description="the run's charts")


def publish_failure(stage: str, exc: BaseException) -> None:
    """A failed stage's error on the run page (the task's state message holds it too, cut to one line)."""
    with contextlib.suppress(Exception):  # a dead API must not replace the stage's own error
        create_markdown_artifact(
            key=artifact_key(stage, "failed"),
            markdown=failure_markdown(stage, str(exc)),
            description=f"the {stage} stage's error",
        )


# The train stage's progress line when its output is not a terminal (fineflow.train.steps.Progress)
_TRAIN_STEP = re.compile(r"step (\d+)/(\d+) loss \S+ ([\d,.]+) tok/s.*ETA (\d+)s")


class TrainingProgress:
    """A progress artifact on the run page while training runs: step of total, tokens/s, ETA, from the stage's
    own progress lines. Updated at most every `every_s` seconds; an API error never stalls the stage's output."""

    def __init__(self, stage: str, every_s: float = 5.0):
        self.stage, self.every_s = stage, every_s
        self.artifact_id = None
        self.updated = float("-inf")

    def see(self, line: str) -> None:
        match = _TRAIN_STEP.search(line)
        if match is None:
            return
        step, total, tokens_per_s, eta = match.groups()
        finished = step == total
        if not finished and time.monotonic() - self.updated < self.every_s:
            return
        self.updated = time.monotonic()
        percent = 100.0 * int(step) / max(1, int(total))
        description = f"{self.stage}: step {step}/{total}, {tokens_per_s} tokens/s, ETA {eta} s"
        with contextlib.suppress(Exception):
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(
                    progress=percent, key=artifact_key(self.stage, "progress"), description=description
                )
            else:
                update_progress_artifact(self.artifact_id, progress=percent, description=description)


def report_table(report: dict) -> list[dict]:
    """A stage report's figures as rows of (figure, value): nested sections flattened to dotted names, each value
    a short readable text rounded to what it means (tasks.render); sections of records are report_sections'."""
    return render.report_tables(report)[0]


def report_sections(report: dict) -> dict[str, list[dict]]:
    """The report's sections of records (validate's checks, eval.checks) as tables of their own, one row each."""
    return render.report_tables(report)[1]


def artifact_key(stage: str, *parts: str) -> str:
    """A stage's artifact key: Prefect takes lowercase letters, digits and dashes only (a stage name such as
    reference_logps has an underscore: the flow failed publishing its report)."""
    return "-".join(["fineflow", *(section_key(part) for part in (stage, *parts))])


def section_key(section: str) -> str:
    """An artifact key's part for a section ("eval.checks" -> "eval-checks"): lowercase letters, digits, dashes."""
    return re.sub(r"[^a-z0-9]+", "-", section.lower()).strip("-")


CARD = "models/champion/README.md"  # the champion's model card, relative to the project


def promotion_markdown(report: dict, project: Path) -> str:
    """The gate's decision with its evidence, for the promotion artifact."""
    lines = [
        f"### Promotion: **{report.get('decision', '?')}**",
        "",
        render.escape(str(report.get("reason", ""))),
        "",
        *gate_evidence_table(report),
    ]
    # the card as a path to read on the worker (a browser opens no file:// link from the page), only when it is there
    card = project / CARD
    if card.is_file():
        promoted = report.get("decision") == "promoted"
        lines.append(f"| model card | {CARD}{'' if promoted else ' (the champion’s, unchanged)'} |")
        evaluation = card_section(card.read_text(encoding="utf-8"), "Evaluation") if promoted else []
        if evaluation:  # what matters of the card, on the page: every metric against the base, with its CI
            lines += ["", "#### The new champion's evaluation (from its model card)", *evaluation]
    return "\n".join(lines)


EXPORTS = "models/export"  # the export stage's output, relative to the project


def exports_markdown(project: Path) -> str:
    """The champion's exports for the promotion artifact: each GGUF, shippable or why not, with its parity figures
    (models/export/export.json), or why nothing was exported."""
    report = _json_or_empty(project / EXPORTS / "export.json")
    exports = report.get("exports") or {}
    if not exports:
        return f"#### Exports\n\nNothing exported: {render.escape(str(report.get('skipped', 'no export report')))}"
    lines = ["#### Exports", "", "| file | shippable | exact match (llama.cpp) | vs transformers (CI) | why not |"]
    lines.append("|---|---|---|---|---|")
    for export in exports.values():
        scores = export["checks"]["scores"]["figures"]
        ci = scores["ci"]
        lines.append(
            f"| {export['file']} | {'yes' if export['shippable'] else '**no**'} | {scores['exact_match']:.3f} | "
            f"{scores['delta']:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}] | {render.escape('; '.join(export['reasons']))} |"
        )
    lines += ["", f"| exports' card | {EXPORTS}/README.md |", f"| served by default | {report.get('serve')} |"]
    return "\n".join(lines)


def _json_or_empty(path: Path) -> dict:
    try:
        return read_json(path)
    except (OSError, ValueError):
        return {}


def card_section(card: str, title: str) -> list[str]:
    """The lines of the card's "## <title>" section, without its heading ([] when it has none)."""
    lines = card.splitlines()
    if f"## {title}" not in lines:
        return []
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def charts_markdown(plots_dir: Path) -> str | None:
    """The train stage's PNG charts (fineflow.train.plots) embedded in markdown, so the run page shows them
    without reaching the worker's disk, each with its file's path as text (a page opens no file:// link)."""
    charts = [plots_dir / name for name in TRAIN_CHARTS if (plots_dir / name).is_file()]
    if not charts:
        return None
    lines = ["### Training charts", ""]
    for chart in charts:
        data = base64.b64encode(chart.read_bytes()).decode("ascii")
        lines += [f"![{chart.stem}](data:image/png;base64,{data})", "", f"{PLOTS}/{chart.name}", ""]
    return "\n".join(lines)


def ledger_table(ledger: dict) -> list[dict]:
    """The goodput ledger as table rows: every bucket's seconds, share and cost, largest first, then the totals."""
    from fineflow.goodput.ledger import DESCRIPTIONS

    total = ledger.get("total_s") or 1.0
    bucket_usd = (ledger.get("cost") or {}).get("bucket_usd") or {}
    rows = [
        {
            "bucket": name,
            "seconds": render.fmt("seconds", seconds),
            "share": f"{seconds / total:.1%}",
            "usd": render.fmt("usd", bucket_usd.get(name, 0.0)),
            "what": DESCRIPTIONS.get(name, ""),
        }
        for name, seconds in sorted(ledger.get("buckets", {}).items(), key=lambda item: -item[1])
    ]
    rows.append(
        {
            "bucket": "unaccounted",
            "seconds": render.fmt("seconds", ledger.get("unaccounted_s")),
            "share": f"{ledger.get('unaccounted_share', 0):.2%}",
            "usd": "—",
            "what": "inside stage processes, timed by no bucket",
        }
    )
    rows.append(
        {
            "bucket": "total",
            "seconds": render.fmt("seconds", ledger.get("total_s")),
            "share": f"goodput {ledger.get('goodput', 0):.1%}",
            "usd": render.fmt("usd", (ledger.get("cost") or {}).get("run_usd")),
            "what": "the run, from its start to this ledger",
        }
    )
    return rows


def ledger_markdown(ledger: dict, plots_dir: Path) -> str:
    """The doctor's findings and the stacked-bar chart, for the run page."""
    from fineflow.goodput import doctor

    lines = [f"### {doctor.one_line(ledger)}", ""]
    for finding in ledger.get("findings") or []:
        fix = finding["fix"]
        lines.append(
            f"- **{finding['severity']} {finding['cause']}** ({finding['share_of_run']:.0%} of the run, "
            f"${finding['usd']:.4f}): {finding['evidence']}. Fix: `{fix['param']}`"
            + (f" = `{fix['value']}`" if fix["value"] is not None else "")
            + f" ({fix['why']})"
        )
    if not ledger.get("findings"):
        lines.append("The doctor found nothing.")
    chart = plots_dir / "goodput.png"
    if chart.is_file():
        data = base64.b64encode(chart.read_bytes()).decode("ascii")
        lines += ["", f"![goodput buckets](data:image/png;base64,{data})", "", f"{PLOTS}/{chart.name}"]
    return "\n".join(lines)
