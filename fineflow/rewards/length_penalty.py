"""length_penalty: a penalty for a completion longer than a target, DAPO's overlong reward shaping (Yu et al. 2025,
eq. 13) in characters:

    reward = 0                               if n <= target_chars
             -(n - target_chars) / scale_chars   if target_chars < n <= target_chars + scale_chars
             -1                              if n > target_chars + scale_chars

n = len(completion). Weighted beside a correctness reward it breaks ties toward the shorter answer without
outweighing being right (weight <= the correctness reward's).
"""

from __future__ import annotations

from pydantic import Field

from fineflow.param_section import Section
from fineflow.rewards.interface import Reward


class LengthPenaltySettings(Section):
    target_chars: int = Field(1000, ge=0, description="the length a completion may have without penalty")
    scale_chars: int = Field(
        200, gt=0, description="the characters beyond target_chars over which the penalty grows linearly to -1"
    )


class LengthPenalty(Reward):
    name = "length_penalty"
    summary = "0 up to target_chars, then linear to -1 at target_chars + scale_chars (DAPO's overlong shaping)"
    settings_model = LengthPenaltySettings

    def score(self, completions: list[str], rows: list[dict]) -> list[float]:
        return [self._one(len(completion)) for completion in completions]

    def _one(self, n: int) -> float:
        over = n - self.settings.target_chars
        return 0.0 if over <= 0 else -min(1.0, over / self.settings.scale_chars)
