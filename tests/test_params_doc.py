"""The params reference (docs/reference/params.md) is generated from the models that validate params.yaml
(fineflow.core.config), so it cannot go stale or miss a key: every field carries its own description."""

from __future__ import annotations

import yaml
from pydantic import BaseModel

from fineflow.core.config import Params
from fineflow.params_doc import DEFAULT_PAGE, REGENERATE, SECTION, Row, render, rows
from tests.conftest import ROOT


def _fields(model: type[BaseModel], prefix: str = ""):
    """(dotted key, field) for every field of the model and of every model nested in it."""
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{field.alias or name}"
        yield dotted, field
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _fields(field.annotation, dotted + ".")


def test_every_key_has_a_description():
    undescribed = [key for key, field in _fields(Params) if not (field.description or "").strip()]
    assert not undescribed, (
        f"{len(undescribed)} key(s) of fineflow/core/config.py have no Field(description=...), so the params "
        f"reference cannot say what they mean:\n  " + "\n  ".join(undescribed)
    )


# --- the generated page (fineflow.params_doc) -------------------------------------------------------------


def _reference() -> dict[str, Row]:
    return {row.key: row for row in rows(Params())}


def _yaml_keys(tree: dict, prefix: str = "") -> dict[str, object]:
    """{dotted.key: value} for every key of params.yaml, sections included."""
    keys = {}
    for key, value in tree.items():
        keys[f"{prefix}{key}"] = value
        if isinstance(value, dict):
            keys.update(_yaml_keys(value, f"{prefix}{key}."))
    return keys


def test_committed_reference_is_current():
    page = ROOT / DEFAULT_PAGE
    assert page.is_file(), f"{DEFAULT_PAGE} is missing: write it with `{REGENERATE}`"
    assert page.read_text(encoding="utf-8") == render(), (
        f"{DEFAULT_PAGE} differs from what fineflow/core/config.py generates: regenerate it with `{REGENERATE}`"
    )


def test_reference_and_params_yaml_have_the_same_keys_and_defaults():
    """Every key of the shipped params.yaml is in the reference with the value params.yaml states, and back.

    A map's entries (cost.prices.H100) are its one key's default, not keys of their own."""
    stated = _yaml_keys(yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8")))
    reference = _reference()
    maps = [key for key, row in reference.items() if row.type.startswith("map of")]
    in_a_map = {key for key in stated if any(key.startswith(f"{name}.") for name in maps)}
    assert sorted(set(stated) - set(reference) - in_a_map) == [], "params.yaml keys missing from the reference"
    assert sorted(set(reference) - set(stated)) == [], "reference keys that params.yaml does not state"
    wrong = {
        key: (row.default, stated[key])
        for key, row in reference.items()
        if row.type != SECTION and yaml.safe_load(row.default) != stated[key]
    }
    assert wrong == {}, "the reference's default (left) differs from params.yaml's (right)"


def test_rendered_rows_show_bounds_choices_and_defaults():
    page = render().splitlines()
    expected = [
        "| `train.lr` | float > 0 | `0.003` |",
        "| `train.method` | one of `lora`, `qlora`, `full` | `lora` |",
        "| `train.num_processes` | null or int ≥ 1 | `null` |",
        "| `train.lora.target_modules` | list of str | `[q_proj, k_proj, v_proj, o_proj, gate_proj,",
        "| `validate.checks.truncation.severity` | one of `error`, `warn` | `warn` |",  # not CheckParams' own error
        "| `validate.checks.label_coverage.max_share` | float in [0, 1] | `0.05` |",
        "| `validate.max_row_bytes` | int in [1024, 2147483647] | `1048576` |",
        "| `data.bad_row_share` | float in [0, 0.5) | `0.03` |",
        "| `promote.confidence` | float in (0.5, 1) | `0.95` |",
        "| `tokenize.seq_len` | int in [9, 65536] | `512` |",  # the upper bound is the validator's
        "| `evaluate.tasks` | list of str, at least 1 | `[fineflow_synth, fineflow_synth_mc]` |",
        "| `cost.prices` | map of str to float ≥ 0 | `{B200: 7.0,",
        "| `train.lora` | section |  |",
        "| `promote.primary_metric` | str | `fineflow_synth/exact_match` | the metric that decides, `<task>/<metric>`",
    ]
    missing = [start for start in expected if not any(line.startswith(start) for line in page)]
    assert missing == [], "rows not rendered as expected"
    assert "## validate" in page and "## seed" in page


def test_cli_writes_the_page_and_check_names_the_command(tmp_path, capsys):
    from fineflow import cli

    page = tmp_path / "params.md"
    assert cli.main(["params-doc", "--check", "--out", str(page)]) == 1
    assert f"{page} is missing: regenerate it with `{REGENERATE}`" in capsys.readouterr().err
    assert cli.main(["params-doc", "--out", str(page)]) == 0
    assert page.read_text(encoding="utf-8") == render()
    assert cli.main(["params-doc", "--check", "--out", str(page)]) == 0
    page.write_text(render().replace("float > 0", "float ≥ 0"), encoding="utf-8")
    assert cli.main(["params-doc", "--check", "--out", str(page)]) == 1
    assert "differs from fineflow/core/config.py" in capsys.readouterr().err
