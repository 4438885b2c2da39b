"""numeric_match: 1 when the last number in the completion is the reference's number, within a tolerance; else 0.

    reward = 1  if |last_number(completion) - last_number(reference)| <= tolerance
             0  otherwise, and when either holds no number

A number is written as people write one: a sign, digits with or without thousands separators (``1,234``), a
fraction part, an exponent (``-1,234.5``, ``.5``, ``3e-2``, ``\u22123``: a Unicode minus). Text around it is
ignored (``$1,000.``, ``50%``, ``#### 42``), so a GSM8K reference (``... #### 72``) gives its final answer. A minus
right after a digit or a letter is a dash, not a sign (``3-5`` ends in 5). A comma that is not a thousands separator
ends the number (``1,2,3`` ends in 3).
"""

from __future__ import annotations

import math
import re

from pydantic import Field

from fineflow.param_section import Section
from fineflow.rewards.interface import ANSWER, ReferenceReward

NUMBER = re.compile(
    r"(?:(?<![\w.])[-\u2212]|(?<![\w.]))"  # a sign, unless the minus joins a word or number before it; or none
    r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+|(?=\.\d))"  # 1,234 or 1234 (or nothing before .5)
    r"(?:\.\d+)?(?:[eE][-+]?\d+)?"  # a fraction, an exponent
)


def last_number(text: str) -> float | None:
    """The last number written in text, or None when it holds none."""
    found = NUMBER.findall(text)
    if not found:
        return None
    value = float(found[-1].replace(",", "").replace("\u2212", "-"))
    return value if math.isfinite(value) else None


class NumericMatchSettings(Section):
    field: str = Field(ANSWER, min_length=1, description="the row field holding the reference (its last number)")
    tolerance: float = Field(1e-6, ge=0, description="the largest absolute difference that still matches")


class NumericMatch(ReferenceReward):
    name = "numeric_match"
    summary = "1 when the completion's last number equals the reference's within a tolerance, else 0"
    settings_model = NumericMatchSettings

    def _one(self, completion: str, reference: str | None) -> float:
        want = last_number(reference) if reference is not None else None
        got = last_number(completion)
        if want is None or got is None:
            return 0.0
        return float(abs(got - want) <= self.settings.tolerance)
