"""user: a reward the user writes, a function named by its import path and run in a worker process with a time limit.

    function(completions: list[str], rows: list[dict]) -> list[float]    one number per completion

rows[i] is the training row completion i answers, with every column the user kept (a test suite, an answer key).
The function runs in its own process (fineflow.rewards.worker): a call that takes more than ``timeout_s``, raises,
or returns anything but one finite number per completion gives that batch ``on_error`` for this reward and counts
an error (its type and message kept), and the run goes on. A path that cannot be imported stops the run when the
reward is first asked to score: no batch could be scored. ``needs`` declares the row fields the function reads,
so that a row without one is named before any rollout.
"""

from __future__ import annotations

import importlib.util

from pydantic import Field

from fineflow.param_section import Section
from fineflow.rewards.interface import Reward, SettingError
from fineflow.rewards.worker import FunctionWorker

IDENTIFIERS = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
IMPORT_PATH = rf"^{IDENTIFIERS}:{IDENTIFIERS}$"


class UserSettings(Section):
    function: str = Field(
        pattern=IMPORT_PATH, description="the function's import path, package.module:function (on PYTHONPATH)"
    )
    timeout_s: float = Field(10.0, gt=0, description="a call's time limit, after which its batch gets on_error")
    on_error: float = Field(0.0, description="this reward of every completion of a batch whose call failed")
    needs: tuple[str, ...] = Field((), description="the row fields the function reads (checked before scoring)")


class UserFunction(Reward):
    name = "user"
    summary = "a function of yours, package.module:function(completions, rows) -> floats, in a worker with a time limit"
    settings_model = UserSettings

    def __init__(self, settings=None):
        super().__init__(settings)
        self.on_error = self.settings.on_error
        module = self.settings.function.partition(":")[0]
        if not _module_exists(module):
            raise SettingError("function", f"no module {module!r} to import (is its folder on PYTHONPATH?)")
        self._worker = FunctionWorker(self.settings.function)

    @property
    def needs(self) -> tuple[str, ...]:
        return self.settings.needs

    def score(self, completions: list[str], rows: list[dict]) -> list[float]:
        if not completions:
            return []
        return self._worker.call(list(completions), list(rows), self.settings.timeout_s)

    def close(self) -> None:
        self._worker.close()


def _module_exists(name: str) -> bool:
    """Whether the module can be found, without running it (its parent packages are imported, as Python does)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
