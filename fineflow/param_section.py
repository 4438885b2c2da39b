"""The base every params.yaml section model shares (unknown keys rejected, frozen), and the marker for
bounds a validator enforces itself (shown in the params reference).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def enforced(**bounds: int | float) -> dict:
    """Bounds a validator enforces with its own message (so not as ``ge``/``le``): shown in the params reference."""
    return {"enforced_bounds": bounds}
