"""The params reference (docs/reference/params.md) is generated from the models that validate params.yaml
(fineflow.core.config), so it cannot go stale or miss a key: every field carries its own description."""

from __future__ import annotations

from pydantic import BaseModel

from fineflow.core.config import Params


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
