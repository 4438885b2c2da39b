"""The great-expectations side of the gate: run a chunk's suite on its frame, and render Data Docs of a split.

GX runs once per chunk of rows (fineflow.data.validation); its results hold the failing rows' values, so each
chunk's results are read and dropped at once. The Data Docs show one validation of the whole split: each
expectation's counts summed over the chunks, no row values.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from fineflow.data.checks import Check, CheckContext, Expectation
from fineflow.errors import DataError


def _names_by_expectation(suite: list[tuple[Check, Expectation]]) -> dict[tuple[str, str], str]:
    """Check names keyed by (expectation type, column): GX does not keep the suite's order in its results,
    so that pair is how a result finds its check; two checks must not share it."""
    names: dict[tuple[str, str], str] = {}
    for check, expectation in suite:
        key = (expectation.expectation_type, expectation.column)
        if key in names:
            raise ValueError(
                f"checks {names[key]} and {check.name} both run {key[0]} on column {key[1]!r}: "
                f"GX results could not tell them apart"
            )
        names[key] = check.name
    return names


# COMPLETE gives every failing row's index (its source line); the query string repeating them is not needed
RESULT_FORMAT = {"result_format": "COMPLETE", "return_unexpected_index_query": False}
DOCS_SUITE = "fineflow_rows"


@dataclass
class _Totals:
    """One expectation's results summed over the chunks it ran on: what its Data Docs entry shows."""

    expectation: Expectation
    elements: int = 0
    unexpected: int = 0
    missing: int = 0
    success: bool = True


class GxRunner:
    """One ephemeral GX context per split: runs a chunk's suite on its frame, forgets the chunk's results
    (they hold row values and would pile up), and sums what the Data Docs show."""

    def __init__(self, docs_dir: Path | None):
        import logging

        import great_expectations as gx

        logging.getLogger("great_expectations").setLevel(logging.ERROR)
        self.context = gx.get_context(mode="ephemeral")
        self.context.variables.progress_bars = {"globally": False}
        self.docs_dir = docs_dir
        if docs_dir is not None:
            self.context.add_data_docs_site(
                "fineflow",
                {
                    "class_name": "SiteBuilder",
                    "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
                    "store_backend": {
                        "class_name": "TupleFilesystemStoreBackend",
                        "base_directory": str(Path(docs_dir).resolve()),
                    },
                },
            )
        self.batch = (
            self.context.data_sources.add_pandas("fineflow")
            .add_dataframe_asset("rows")
            .add_batch_definition_whole_dataframe("all")
        )
        self.definitions: dict[tuple[str, ...], object] = {}  # one per distinct set of applying checks
        self.totals: dict[str, _Totals] = {}
        self.meta: dict = {}

    def _definition(self, suite: list[tuple[Check, Expectation]]):
        import great_expectations as gx

        key = tuple(check.name for check, _ in suite)
        if key not in self.definitions:
            name = f"chunk-suite-{len(self.definitions)}"
            gx_suite = self.context.suites.add(gx.ExpectationSuite(name=name))
            for _, expectation in suite:
                gx_suite.add_expectation(expectation)
            self.definitions[key] = self.context.validation_definitions.add(
                gx.ValidationDefinition(name=name, data=self.batch, suite=gx_suite)
            )
        return self.definitions[key]

    def run(self, frame, suite: list[tuple[Check, Expectation]], ctx: CheckContext) -> dict[str, list[int] | None]:
        """The failing index values (source line numbers) per check on this chunk. A table-level check that
        fails (a column absent from the chunk) maps to None: no single row is at fault."""
        name_of = _names_by_expectation(suite)
        result = self._definition(suite).run(batch_parameters={"dataframe": frame}, result_format=RESULT_FORMAT)
        store = self.context.validation_results_store
        for key in store.list_keys():
            store.remove_key(key)
        self.meta = {k: result.meta[k] for k in ("great_expectations_version", "batch_spec") if k in result.meta}
        failing: dict[str, list[int] | None] = {check.name: [] for check, _ in suite}
        by_name = {check.name: check for check, _ in suite}
        for res in result.results:
            name = name_of[(res.expectation_config.type, res.expectation_config.kwargs["column"])]
            if res.exception_info.get("raised_exception"):
                raise DataError(f"validation check {name} could not run: {res.exception_info.get('exception_message')}")
            if name not in self.totals:  # a fresh expectation for the docs suite (GX ties one to its suite)
                self.totals[name] = _Totals(by_name[name].expect(by_name[name].column, ctx))
            totals = self.totals[name]
            totals.success &= bool(res.success)
            if res.expectation_config.type == "expect_column_to_exist":
                failing[name] = None if not res.success else []
                continue
            failing[name] = [int(i) for i in res.result.get("unexpected_index_list") or []]
            totals.elements += int(res.result.get("element_count") or 0)
            totals.unexpected += int(res.result.get("unexpected_count") or 0)
            totals.missing += int(res.result.get("missing_count") or 0)
        return failing

    def render_docs(self, split: str, order: list[str]) -> None:
        """Data Docs of the whole split: one validation result, each expectation's counts summed over the
        chunks; no row values (the chunks' unexpected values were never stored)."""
        if self.docs_dir is None or not self.totals:
            return
        import great_expectations as gx
        from great_expectations.core import ExpectationSuiteValidationResult, ExpectationValidationResult
        from great_expectations.core.run_identifier import RunIdentifier
        from great_expectations.data_context.types.resource_identifiers import (
            ExpectationSuiteIdentifier,
            ValidationResultIdentifier,
        )

        for definition in self.definitions.values():  # only the whole split's suite gets a page
            self.context.validation_definitions.delete(definition.name)
            self.context.suites.delete(definition.suite.name)
        suite = self.context.suites.add(gx.ExpectationSuite(name=DOCS_SUITE))
        results = []
        for name in (name for name in order if name in self.totals):
            totals = self.totals[name]
            configuration = suite.add_expectation(totals.expectation).configuration
            results.append(
                ExpectationValidationResult(
                    success=totals.success,
                    expectation_config=configuration,
                    result=_summed(totals),
                    exception_info={"raised_exception": False, "exception_traceback": None, "exception_message": None},
                )
            )
        passed = sum(r.success for r in results)
        now = datetime.datetime.now(datetime.UTC)
        run_id = RunIdentifier(run_name=f"fineflow-{split}", run_time=now)
        merged = ExpectationSuiteValidationResult(
            success=passed == len(results),
            results=results,
            suite_name=DOCS_SUITE,
            statistics={
                "evaluated_expectations": len(results),
                "successful_expectations": passed,
                "unsuccessful_expectations": len(results) - passed,
                "success_percent": 100.0 * passed / len(results),
            },
            meta={**self.meta, "run_id": run_id, "validation_time": now, "batch_parameters": {"split": split}},
        )
        key = ValidationResultIdentifier(ExpectationSuiteIdentifier(name=DOCS_SUITE), run_id, split)
        self.context.validation_results_store.set(key, merged)
        self.context.build_data_docs(site_names=["fineflow"])


def _summed(totals: _Totals) -> dict:
    if not totals.elements:  # a table-level expectation (column exists): no per-row counts
        return {}
    percent = 100.0 * totals.unexpected / totals.elements
    present = totals.elements - totals.missing
    return {
        "element_count": totals.elements,
        "unexpected_count": totals.unexpected,
        "unexpected_percent": percent,
        "missing_count": totals.missing,
        "missing_percent": 100.0 * totals.missing / totals.elements,
        "unexpected_percent_total": percent,
        "unexpected_percent_nonmissing": 100.0 * totals.unexpected / present if present else 0.0,
        "partial_unexpected_list": [],  # values are the user's rows: never in the docs
    }
