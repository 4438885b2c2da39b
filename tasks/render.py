"""How a stage report and a stage's error read on the Prefect run page: pure text, no Prefect (``tasks/artifacts.py``
publishes what this renders).

A report becomes a table of its figures, flattened to dotted names, each value a short readable text (never
JSON), rounded to what it means; a section of records (validate's ``checks``: one mapping per check) becomes a
table of its own, one row per record. A failed stage's error becomes wrapping text, one sentence a line (so the
fix is on screen), with the stage's output tail in a code block below.
"""

from __future__ import annotations

import re

LIST_SHOWN = 8  # a longer list of values shows its first and last ones and its length


def report_tables(report: dict) -> tuple[list[dict], dict[str, list[dict]]]:
    """(the report's figures as {"figure", "value"} rows, {section name: its records as rows})."""
    rows: list[dict] = []
    sections: dict[str, list[dict]] = {}
    _flatten(report, "", rows, sections)
    return rows, sections


def _flatten(mapping: dict, prefix: str, rows: list[dict], sections: dict[str, list[dict]]) -> None:
    for key, value in sorted(mapping.items()):
        name = f"{prefix}{key}"
        if is_records(value):
            sections[name] = [{"name": inner, **record_row(record)} for inner, record in value.items()]
        elif isinstance(value, dict) and value:
            _flatten(value, f"{name}.", rows, sections)
        else:
            rows.append({"figure": name, "value": fmt(key, value)})


def is_records(value) -> bool:
    """A mapping of names to mappings of plain fields (validate's checks): a table of its own."""
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(v, dict) and v and not any(isinstance(x, dict) for x in v.values()) for v in value.values())
    )


# fields a record's table leaves out: a check's Great Expectations type (its category says it for a person, and
# the long name alone would push the table past the page's width; reports/validate.json keeps it)
HIDDEN = frozenset({"expectation"})


def record_row(record: dict) -> dict:
    """A record's fields as a table row; a share and its limit (max_share) in one cell: "2.4% (max 5.0%)"."""
    row = {}
    for key, value in record.items():
        if key in HIDDEN or key == "max_share":
            continue
        row[key.replace("_", " ")] = fmt(key, value)
    if "share" in record and record.get("max_share") is not None:
        row["share"] += f" (max {fmt('max_share', record['max_share'])})"
    return row


def fmt(key: str, value) -> str:
    """A value as a person reads it, its unit from its name: losses to 4 digits, shares as %, seconds to 0.1 s,
    bytes and MB as MiB/GiB, dollars to 4 decimals; lists joined (a long one shown by its ends)."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return _fmt_list(key, value)
    if isinstance(value, dict):
        return "—" if not value else "; ".join(f"{k}: {fmt(k, v)}" for k, v in sorted(value.items()))
    if isinstance(value, int):
        return _fmt_int(key.lower(), value)
    if isinstance(value, float):
        return _fmt_float(key.lower(), value)
    return str(value)


def _fmt_list(key: str, values) -> str:
    shown = [fmt(key, v) for v in values]
    if len(shown) <= LIST_SHOWN:
        return ", ".join(shown) if shown else "—"
    return f"{', '.join(shown[:3])}, …, {', '.join(shown[-2:])} ({len(shown)} values)"


def _fmt_int(key: str, value: int) -> str:
    if key.endswith("bytes"):
        return human_bytes(value)
    if key.endswith(("_mb", "_mib")):
        return human_bytes(value * 2**20)
    return f"{value:,}"


_SHARE = re.compile(r"(share|_rate|goodput|fraction|percent|utilization|mfu)$")


def _fmt_float(key: str, value: float) -> str:
    if "loss" in key or "perplexity" in key:
        return f"{value:.4f}"
    if key.endswith("per_s") or key.endswith("per_sec"):
        return f"{value:,.1f}"
    if key.endswith(("_s", "seconds", "_sec")):
        return f"{value:,.1f} s"
    if _SHARE.search(key) and "learning" not in key:
        return f"{value:.1%}"
    if "usd" in key or "cost" in key:
        return f"${value:,.4f}"
    if key.endswith("bytes"):
        return human_bytes(value)
    if key.endswith(("_mb", "_mib")):
        return human_bytes(value * 2**20)
    if value != 0 and abs(value) < 1e-3:
        return f"{value:.3g}"
    return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4f}"


def human_bytes(count: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= size:
            return f"{count / size:,.1f} {unit}"
    return f"{count:,.0f} B"


# ---- a failed stage ----------------------------------------------------------------------------------------

# a sentence ends at ". " before a capital letter (not after "e.g." and the like)
_SENTENCE_END = re.compile(r"(?<!e\.g\.)(?<!i\.e\.)(?<=\.)\s+(?=[A-Z])")
_MARKDOWN = re.compile(r"([\\`*_\[\]<#|])")


def failure_markdown(stage: str, message: str) -> str:
    """The error's first line as wrapping text, one sentence a paragraph (the fix is its own line, on screen
    whatever the page's width); the lines after it (the stage's output tail) in a code block below."""
    head, _, tail = message.partition("\n")
    sentences = [s.strip() for s in _SENTENCE_END.split(head) if s.strip()]
    lines = [f"### fineflow {stage} failed", ""]
    for sentence in sentences:
        lines += [escape(sentence), ""]
    if tail.strip():
        lines += ["The stage's last output:", "", "```", tail.rstrip().replace("```", "'''"), "```"]
    return "\n".join(lines).rstrip() + "\n"


def escape(text: str) -> str:
    """Text shown as itself in markdown (a param name's underscores are not emphasis, a <path> not a tag)."""
    return _MARKDOWN.sub(r"\\\1", text)
