"""The validate stage with ``data.sources``: the eval split, each source on its own, then their mix.

The eval split (``data.eval_path``) is validated as without sources. Each source is validated against it
(leakage) on its own, with its own mapping, quarantine and report section, or read back from the per-source
cache (fineflow.data.source_gate); the gate's verdict is per source, and every blocked source is named in
the one error. The kept rows are then mixed (fineflow.data.mix) into ``<out>/train.jsonl``, the file the
tokenize stage reads. Beside it: ``eval.jsonl``, ``quarantine.jsonl`` and ``redactions.jsonl`` (a source's
entries carry ``"source": "data.sources[i] (path)"``), and ``sources.json``, the list the lineage and the model
card show: every source with its content hash, rows kept, weight (or n) and rows mixed.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

from fineflow.core.config import Params
from fineflow.core.entry import log
from fineflow.core.reports import sha256_file, write_json_atomic
from fineflow.data.formats import apply_mapping, read_rows
from fineflow.data.mix import target_rows, write_mix
from fineflow.data.source_gate import (
    KEPT,
    QUARANTINE,
    REDACTIONS,
    SourceResult,
    code_digest,
    prune,
    source_key,
    token_identity,
    validate_source,
)
from fineflow.data.sources import content_hash, resolve_source
from fineflow.data.tokens import TokenView
from fineflow.data.validation import JsonlSink, ValidationOutcome, raise_if_blocked, validate_eval
from fineflow.errors import DataError
from fineflow.objectives import objective_for

SOURCES_FILE = "sources.json"  # beside the rows: the mixture's sources, for the lineage and the model card


class Mixture:
    """One run of the validate stage over data.sources (module docstring)."""

    def __init__(self, params: Params, out_dir: Path, cache: Path, hash_cache: Path | None, docs_dir: Path | None):
        self.params, self.out_dir, self.cache = params, out_dir, cache
        self.hash_cache, self.docs_dir = hash_cache, docs_dir

    def run(self, eval_path: Path, tokens: TokenView | None, report_path: Path) -> dict:
        sources = [resolve_source(i, spec) for i, spec in enumerate(self.params.data.sources)]
        contents = [content_hash(source, self.hash_cache) for source in sources]
        evaluation, leak_index = self._eval(eval_path, tokens)
        eval_sha, code, identity = sha256_file(self.out_dir / "eval.jsonl"), code_digest(), token_identity(tokens)
        results = []
        for source, content in zip(sources, contents, strict=True):
            key = source_key(source, content, self.params, identity, eval_sha, code)
            docs = self.docs_dir / f"source-{source.index}" if self.docs_dir else None
            result = validate_source(source, key, self.cache, self.params, leak_index, tokens, docs)
            log(f"{source.label}: {'validated' if result.validated else 'unchanged, validation reused'} (key {key})")
            results.append(result)
        self._append_logs(results)
        report = self._report(evaluation, results, contents)
        self._gate(evaluation, results, report, report_path)
        report["rows_mixed"] = self._mix(results, contents, report)
        prune(self.cache, {result.key for result in results})
        return report

    def _eval(self, eval_path: Path, tokens):
        data, cfg = self.params.data, self.params.validate_
        schema = objective_for(self.params.train.objective).rows
        rows = apply_mapping(
            read_rows(eval_path, data.format, cfg.max_row_bytes), data.mapping, str(eval_path), schema=schema
        )
        docs = self.docs_dir / "eval" if self.docs_dir else None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with ExitStack() as stack:
            files = (stack.enter_context((self.out_dir / n).open("w", encoding="utf-8")) for n in _EVAL_FILES)
            outcome, leak_index = validate_eval(
                rows, str(eval_path), cfg, JsonlSink("eval", *files), docs, tokens, schema
            )
        log(f"eval: {outcome.rows_in} rows in, {outcome.rows_kept} kept, {outcome.rows_quarantined} quarantined")
        return outcome, leak_index

    def _append_logs(self, results: list[SourceResult]) -> None:
        """Each source's quarantine and redaction entries after the eval split's, marked with the source."""
        for name in (QUARANTINE, REDACTIONS):
            with (self.out_dir / name).open("a", encoding="utf-8") as out:
                for result in results:
                    with (result.folder / name).open(encoding="utf-8") as entries:
                        for line in entries:
                            out.write(json.dumps({"source": result.source.label, **json.loads(line)}) + "\n")

    def _report(self, evaluation: ValidationOutcome, results: list[SourceResult], contents: list[str]) -> dict:
        sections = [_source_section(result, content) for result, content in zip(results, contents, strict=True)]
        totals = {key: sum(s["report"][key] for s in sections) for key in _TOTALS}
        return {
            **totals,
            "eval": evaluation.report(),
            "sources": sections,
            "validated_sources": [r.source.index for r in results if r.validated],
            "reused_sources": [r.source.index for r in results if not r.validated],
            "passed": True,
        }

    def _gate(self, evaluation, results: list[SourceResult], report: dict, report_path: Path) -> None:
        """Every blocked split or source in one error; the report is written first, as without sources."""
        problems = []
        checks = [lambda: raise_if_blocked(evaluation, self.params.validate_)]
        for check in checks + [result.raise_if_blocked for result in results]:
            try:
                check()
            except DataError as exc:
                problems.append(str(exc))
        if problems:
            write_json_atomic(report_path, {"stage": "validate", **report, "passed": False})
            raise DataError("\n".join(problems))

    def _mix(self, results: list[SourceResult], contents: list[str], report: dict) -> int:
        parts = []
        for result, section in zip(results, report["sources"], strict=True):
            target = target_rows(result.source.spec.amount, result.rows_kept)
            section["rows_mixed"] = target
            parts.append((result.folder / KEPT, result.rows_kept, target, result.key))
        written = write_mix(parts, self.params.seed, self.out_dir / "train.jsonl")
        listing = [_lineage_entry(section) for section in report["sources"]]
        write_json_atomic(self.out_dir / SOURCES_FILE, {"rows_mixed": written, "sources": listing})
        for section in report["sources"]:
            log(f"{section['label']}: {section['rows_mixed']} of the mix's {written} train rows")
        return written


_EVAL_FILES = ("eval.jsonl", QUARANTINE, REDACTIONS)
_TOTALS = ("rows_in", "rows_kept", "rows_quarantined", "rows_warned")


def _source_section(result: SourceResult, content: str) -> dict:
    source = result.source
    return {
        "index": source.index,
        "label": source.label,
        "path": source.spec.path,
        "kind": source.kind,
        "split": source.spec.split,
        "revision": source.revision,
        "content_sha256": content,
        **source.spec.amount,
        "key": result.key,
        "validated": result.validated,
        "report": result.outcome["report"],
    }


def _lineage_entry(section: dict) -> dict:
    """What the lineage keeps of a source: what it is, by content, and how much of it was trained on."""
    keys = ("path", "kind", "split", "revision", "content_sha256", "weight", "n", "rows_mixed")
    entry = {key: section[key] for key in keys if key in section}
    return {**entry, "rows_kept": section["report"]["rows_kept"]}
