"""math_verify: 1 when the completion's final answer is mathematically the reference's, by Hugging Face's Math-Verify
(``pip install math-verify``: LaTeX and plain expressions parsed with SymPy, so ``\\frac{1}{2}``, ``0.5`` and
``1/2`` agree); else 0.

    reward = 1  if verify(parse(reference), parse(completion))
             0  otherwise: a wrong answer, nothing to parse, or a parse or comparison that raised or timed out

The package is optional: fineflow never requires it, and building this reward without it is a ConfigError saying
how to install it. Its timeouts are signal alarms, which work only on a process's main thread: elsewhere they are
off (``timeout_s`` then does not apply; put the reward's caller on the main thread, or use a ``user`` reward, whose
time limit is a process's).
"""

from __future__ import annotations

import threading

from pydantic import Field

from fineflow.errors import ConfigError
from fineflow.param_section import Section
from fineflow.rewards.interface import ANSWER, ReferenceReward, reference_text

PACKAGE = "math-verify"  # on PyPI; imported as math_verify


class MathVerifySettings(Section):
    field: str = Field(ANSWER, min_length=1, description="the row field holding the reference answer")
    timeout_s: int = Field(5, ge=1, description="each parse and comparison's time limit (on the main thread)")


def _library():
    """math_verify's parse and verify; a ConfigError saying how to install it when it is not."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ConfigError(
            f"reward math_verify needs the {PACKAGE} package, which is not installed: pip install {PACKAGE}"
        ) from None
    return parse, verify


class MathVerify(ReferenceReward):
    name = "math_verify"
    summary = "1 when Math-Verify finds the completion's answer equal to the reference (needs pip install math-verify)"
    settings_model = MathVerifySettings

    def __init__(self, settings=None):
        super().__init__(settings)
        self._parse, self._verify = _library()  # refused when built, before any rollout

    def score(self, completions: list[str], rows: list[dict]) -> list[float]:
        timeout = self.settings.timeout_s if threading.current_thread() is threading.main_thread() else None
        return [
            self._one(completion, reference_text(row, self.settings.field), timeout)
            for completion, row in zip(completions, rows)
        ]

    def _one(self, completion: str, reference: str | None, timeout: int | None) -> float:
        if reference is None or not completion.strip():
            return 0.0
        try:
            gold = self._parse(reference, parsing_timeout=timeout)
            answer = self._parse(completion, parsing_timeout=timeout)
            return float(bool(self._verify(gold, answer, timeout_seconds=timeout)))
        except Exception:  # Math-Verify raises what SymPy raises on odd input: not this answer, not the run
            return 0.0
