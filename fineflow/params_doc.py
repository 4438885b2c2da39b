"""The params reference (docs/reference/params.md), generated from the models that validate ``params.yaml``.

    fineflow params-doc --out docs/reference/params.md   # (re)write the page
    fineflow params-doc --check                          # exit 1 when the committed page is stale
    fineflow params-doc                                  # print it

Every key's type and bounds come from its field in fineflow.core.config (the annotation; gt/ge/lt/le;
Literal choices; min_length; bounds a validator enforces, declared with ``enforced_bounds``), its default
from the model (written as params.yaml writes it) and its meaning from the field's ``description``: there is
no second, hand-written list to drift. tests/test_params_doc.py fails on a key without a description and
on a committed page that differs from what this module writes. It lives outside fineflow/core, which every
stage of dvc.yaml depends on, so that a change to how the page is written re-runs no stage.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from fineflow.core.config import Params

DEFAULT_PAGE = Path("docs/reference/params.md")
REGENERATE = f"fineflow params-doc --out {DEFAULT_PAGE}"
SECTION = "section"  # the type shown for a key that holds a nested model (its keys follow it)

_BOUND_SIGNS = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}


@dataclass(frozen=True)
class Row:
    key: str  # dotted, as in params.yaml: train.lora.r
    type: str  # readable: "int ≥ 1", "one of `lora`, `qlora`, `full`"
    default: str  # as params.yaml writes it; "" for a section
    meaning: str


def nested_model(field: FieldInfo) -> type[BaseModel] | None:
    annotation = field.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _meaning(field: FieldInfo) -> str:
    return " ".join((field.description or "").split())


def _value_row(key: str, field: FieldInfo, default: object) -> Row:
    return Row(key, type_text(field), default_text(default), _meaning(field))


def rows(defaults: BaseModel, prefix: str = "") -> Iterator[Row]:
    """One row per field of the model, and after a nested model's row the rows of its own fields.

    Defaults are read from the enclosing default instance, not the field's class: ``validate.checks.truncation``
    is a CheckParams whose own defaults (error, 0.10) are not truncation's (warn, 0.05)."""
    for name, field in type(defaults).model_fields.items():
        key, default = f"{prefix}{field.alias or name}", getattr(defaults, name)
        if isinstance(default, BaseModel):
            yield Row(key, SECTION, "", _meaning(field))
            yield from rows(default, key + ".")
        else:
            yield _value_row(key, field, default)


# --- type and bounds ------------------------------------------------------------------------------------------


def bounds_of(field: FieldInfo) -> dict[str, float]:
    """gt/ge/lt/le and min_length from the field's constraints, plus the bounds its validator enforces."""
    bounds: dict[str, float] = {}
    for item in field.metadata:
        for name in (*_BOUND_SIGNS, "min_length"):
            if isinstance(item, annotated_types.BaseMetadata) and getattr(item, name, None) is not None:
                bounds[name] = getattr(item, name)
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    bounds.update(extra.get("enforced_bounds", {}))
    return bounds


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _scalar_text(name: str, bounds: dict[str, float]) -> str:
    """``int ≥ 1``, ``float in (0, 1]``: an int's strict bound is shown as the inclusive one it means."""
    bounds = {k: v for k, v in bounds.items() if k in _BOUND_SIGNS}
    if name == "int":
        if "gt" in bounds:
            bounds["ge"] = bounds.pop("gt") + 1
        if "lt" in bounds:
            bounds["le"] = bounds.pop("lt") - 1
    lower = [(k, v) for k, v in bounds.items() if k in ("gt", "ge")]
    upper = [(k, v) for k, v in bounds.items() if k in ("lt", "le")]
    if lower and upper:
        (low_kind, low), (high_kind, high) = lower[0], upper[0]
        opening, closing = "(" if low_kind == "gt" else "[", ")" if high_kind == "lt" else "]"
        return f"{name} in {opening}{_number(low)}, {_number(high)}{closing}"
    if lower or upper:
        kind, value = (lower or upper)[0]
        return f"{name} {_BOUND_SIGNS[kind]} {_number(value)}"
    return name


def _annotation_text(annotation, bounds: dict[str, float]) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(f"`{choice}`" for choice in args)
    if origin in (Union, types.UnionType):
        others = [arg for arg in args if arg is not type(None)]
        nullable = len(others) < len(args)
        inner = " or ".join(_annotation_text(arg, bounds) for arg in others)
        return f"null or {inner}" if nullable else inner
    if origin is list:
        at_least = bounds.get("min_length")
        items = _annotation_text(args[0], {})
        return f"list of {items}, at least {at_least}" if at_least else f"list of {items}"
    if origin is dict:
        return f"map of {_annotation_text(args[0], {})} to {_annotation_text(args[1], bounds)}"
    return _scalar_text(getattr(annotation, "__name__", str(annotation)), bounds)


def type_text(field: FieldInfo) -> str:
    return _annotation_text(field.annotation, bounds_of(field))


def default_text(value: object) -> str:
    """A default as params.yaml writes it: ``null``, ``false``, ``[q_proj, k_proj]``, ``{B200: 7.0}``."""
    if isinstance(value, list):  # a list of models (train.grpo.rewards' specs) as their params.yaml mappings
        value = [item.model_dump() if hasattr(item, "model_dump") else item for item in value]
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6, allow_unicode=True)
    return text.removesuffix("\n...\n").strip()


# --- Markdown -------------------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    """Text for a table cell: outside `code spans`, a pipe would end the cell and a < could open an HTML tag."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("|", "\\|").replace("<", "&lt;")
    return "`".join(parts)


def _row_line(row: Row) -> str:
    default = f"`{row.default}`" if row.default else ""
    return f"| `{row.key}` | {_cell(row.type)} | {default} | {_cell(row.meaning)} |"


def _sentence(text: str) -> str:
    text = text.strip()
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def section_lines(key: str, field: FieldInfo, default: object) -> list[str]:
    """``## key``, the section's meaning, and one table of its keys (a top-level scalar is its own section)."""
    lines = [f"## {key}", ""]
    if isinstance(default, BaseModel):
        section_rows = list(rows(default, f"{key}."))
        lines += [_cell(_sentence(_meaning(field))), ""]
    else:
        section_rows = [_value_row(key, field, default)]
    lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    return lines + [_row_line(row) for row in section_rows] + [""]


def header_lines(all_rows: list[Row]) -> list[str]:
    values = sum(1 for row in all_rows if row.type != SECTION)
    sections = len(all_rows) - values
    return [
        "# params.yaml reference",
        "",
        f"<!-- Generated from fineflow/core/config.py by `{REGENERATE}`.",
        "     Do not edit: change a field's description there and regenerate (a test fails on a stale page). -->",
        "",
        "`params.yaml` is the only place hyperparameters live (paths live in `dvc.yaml`, hardware in the accelerate",
        "profiles of `configs/accelerate/`). The typed models of `fineflow/core/config.py` validate it: an unknown",
        "key or a value out of its bounds is reported with the key's name, every problem at once.",
        "",
        "This page is generated from those same models, so it lists every key with its type and bounds, its",
        "default (the value the shipped `params.yaml` states) and its meaning. Regenerate it after changing",
        f"`fineflow/core/config.py` with `{REGENERATE}`.",
        "",
        f"{values} keys with a value, in {sections} sections (a nested section such as `train.lora` has its own row;",
        "its keys follow it).",
        "",
    ]


def render() -> str:
    defaults = Params()
    lines = header_lines(list(rows(defaults)))
    for name, field in Params.model_fields.items():
        lines += section_lines(field.alias or name, field, getattr(defaults, name))
    return "\n".join(lines).rstrip("\n") + "\n"
