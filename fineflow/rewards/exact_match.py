"""exact_match: 1 when the completion is the reference answer, whitespace at either end aside; else 0.

    reward = 1  if completion.strip() == reference.strip()   (casefolded both, with case_insensitive)
             0  otherwise (a row without a reference scores 0)

The reference is row[field]; the default field, ``output``, is a messages row's last assistant message.
"""

from __future__ import annotations

from pydantic import Field

from fineflow.param_section import Section
from fineflow.rewards.interface import ANSWER, ReferenceReward


class ExactMatchSettings(Section):
    field: str = Field(ANSWER, min_length=1, description="the row field holding the reference answer")
    case_insensitive: bool = Field(False, description="compare casefolded (Unicode-aware lower case)")


class ExactMatch(ReferenceReward):
    name = "exact_match"
    summary = "1 when the stripped completion equals the stripped reference answer, else 0"
    settings_model = ExactMatchSettings

    def _one(self, completion: str, reference: str | None) -> float:
        if reference is None:
            return 0.0
        got, want = completion.strip(), reference.strip()
        if self.settings.case_insensitive:
            got, want = got.casefold(), want.casefold()
        return float(got == want)
