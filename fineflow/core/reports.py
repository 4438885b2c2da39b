"""Small JSON/JSONL writers: the reports every stage writes (``reports/<stage>.json``) and row files."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write via a temp file + fsync + rename: a reader (or a crash) sees the old text or the new, whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, payload: dict) -> None:
    """Write JSON via a temp file + rename so a reader never sees half a report."""
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_jsonl(path: str | Path, records: Iterable[dict]) -> None:
    """One JSON object per line, UTF-8 kept as is (not \\u-escaped)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")


def sha256_file(path: str | Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks (a rows file or a model can be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# A stage's error record, reports/<stage>.error.json: written by the stage process that met a user error
# (every rank of a training run that did), removed when the stage starts again. It is how the layers above
# the stage (the train launcher, the Prefect task), whose child exit codes accelerate and DVC rewrite, tell
# a user error from a crash.


def error_record_path(report: str | Path) -> Path:
    report = Path(report)
    return report.with_name(f"{report.stem}.error.json")


def write_error_record(report: str | Path, stage: str, message: str) -> None:
    write_json_atomic(error_record_path(report), {"stage": stage, "kind": "user_error", "message": message})


def read_record(report: str | Path, kind: str) -> dict | None:
    """The stage's record of this kind from its current run (reports/<stage>.error.json), or None."""
    try:
        record = read_json(error_record_path(report))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("kind") == kind else None


def read_error_record(report: str | Path) -> dict | None:
    """The record of a user error met by the stage's current run, or None (no record: success or a crash)."""
    return read_record(report, "user_error")


def write_preempted_record(report: str | Path, stage: str, step: int, signum: int | None) -> None:
    """The stage's record (reports/<stage>.error.json, kind "preempted"): the layers above, whose exit codes
    accelerate and DVC rewrite, read it to tell a resumable stop from a crash."""
    import signal

    name = signal.Signals(signum).name if signum is not None else "a stop signal to another rank"
    message = f"stopped by {name} after step {step}, which is saved: a re-run resumes from it"
    write_json_atomic(
        error_record_path(report),
        {"stage": stage, "kind": "preempted", "step": step, "signal": name, "message": message},
    )


def read_preempted_record(report: str | Path) -> dict | None:
    return read_record(report, "preempted")


def write_approval_request(report: str | Path, stage: str, message: str, evidence: dict) -> None:
    """The record of a candidate that passed the gate and waits for a person (fineflow.registry.approval)."""
    record = {"stage": stage, "kind": "approval_needed", "message": message, "evidence": evidence}
    write_json_atomic(error_record_path(report), record)


def read_approval_request(report: str | Path) -> dict | None:
    return read_record(report, "approval_needed")


def clear_error_record(report: str | Path) -> None:
    error_record_path(report).unlink(missing_ok=True)


def gate_evidence_table(report: dict) -> list[str]:
    """The gate's evidence as markdown table rows: the Prefect promotion artifact's, the approval
    request's and the CI summary's. The interval is labelled at the confidence it was computed at
    (promote.confidence, in the report), and shown only when one was computed."""
    rows = [
        "| | |",
        "|---|---|",
        f"| candidate id | `{report.get('candidate_id')}` |",
        f"| metric | `{report.get('primary_metric')}` |",
        f"| candidate | {_number(report.get('candidate_value'))} |",
        f"| {report.get('reference')} | {_number(report.get('reference_value'))} |",
    ]
    if report.get("ci_low") is not None:
        confidence = report.get("confidence")
        label = f"{confidence:.0%} bootstrap CI" if isinstance(confidence, (int, float)) else "bootstrap CI"
        interval = f"[{_number(report['ci_low'], '+.4f')}, {_number(report.get('ci_high'), '+.4f')}]"
        rows.append(f"| delta ({label}) | {_number(report.get('delta'), '+.4f')} {interval} |")
    elif report.get("delta") is not None:
        rows.append(f"| delta | {_number(report['delta'], '+.4f')} |")
    rows.append(f"| p-value | {_number(report.get('p_value'), '.3f')} |")
    return rows


def _number(value, spec: str = ".4f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
