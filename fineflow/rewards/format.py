"""format: 1 when the completion has the shape a regular expression describes; else 0.

    reward = 1  if re.fullmatch(pattern, completion)   (mode fullmatch: the whole completion)
                or re.search(pattern, completion)      (mode search: anywhere in it)
             0  otherwise

With ``dotall`` (the default) ``.`` also matches a newline, as a reasoning format's pattern needs
(``<think>.*</think>\\s*<answer>.*</answer>``). The pattern is compiled when the set is built: a bad one is a settings
error naming it.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Literal

from pydantic import Field, field_validator

from fineflow.param_section import Section
from fineflow.rewards.interface import Reward


class FormatSettings(Section):
    pattern: str = Field(description="a Python regular expression the completion must match")
    mode: Literal["fullmatch", "search"] = Field(
        "fullmatch", description="fullmatch: the whole completion has the shape; search: it appears anywhere"
    )
    dotall: bool = Field(True, description="'.' matches a newline too (re.DOTALL)")
    case_insensitive: bool = Field(False, description="match ignoring case (re.IGNORECASE)")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"not a regular expression ({exc})") from None
        return pattern


class Format(Reward):
    name = "format"
    summary = "1 when the completion matches a regular expression (wholly, or anywhere), else 0"
    settings_model = FormatSettings

    @cached_property
    def regex(self) -> re.Pattern:
        flags = (re.DOTALL if self.settings.dotall else 0) | (re.IGNORECASE if self.settings.case_insensitive else 0)
        return re.compile(self.settings.pattern, flags)

    def score(self, completions: list[str], rows: list[dict]) -> list[float]:
        match = self.regex.fullmatch if self.settings.mode == "fullmatch" else self.regex.search
        return [float(match(completion) is not None) for completion in completions]
