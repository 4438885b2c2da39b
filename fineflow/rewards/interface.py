"""The one interface every reward of online RL implements (the GRPO objective's rollouts are scored by a set of them).

A reward says:
- ``name``: how train.grpo.rewards names it (``{"name": ..., "weight": ..., **settings}``);
- ``settings_model``: its settings, a fineflow.param_section.Section (typed, unknown keys rejected, frozen), validated
  from the spec's other keys when the set is built; the instance holds them as ``settings``;
- ``needs``: the row fields it reads, so that a row without one is named before any scoring ("a|b": either field);
- ``score(completions, rows)``: one float per completion, where rows[i] is the training row completion i answers
  (an SFT row, ``instruction``, ``input`` and ``output``, the reference answer; or ``messages``; plus any column the
  user kept, e.g. ``answer`` or ``tests``).

A reward that cannot score a batch (the user's function hung, raised or returned the wrong thing) raises
``RewardFailed``: the set gives that batch the reward's ``on_error`` value and counts the error. Anything else it
raises is a bug or a user error and stops the run.

Adding a reward: one module in this package with a subclass, and its line in ``REWARDS``
(fineflow/rewards/__init__.py). docs/rewards.md walks through one.
"""

from __future__ import annotations

from fineflow.errors import ConfigError
from fineflow.param_section import Section

ANSWER = "output"  # the SFT row's reference answer (a messages row's is its last assistant message)
MESSAGES = "messages"


class RewardSettings(Section):
    """A reward without settings."""


class RewardFailed(Exception):
    """A batch the reward could not score; the message says why (the set counts it, the batch gets on_error)."""


class SettingError(ConfigError):
    """A setting that is well-formed but unusable here (a module that cannot be found): building the reward raises it,
    and the set names its key (train.grpo.rewards[i].<field>) beside every other problem."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class Reward:
    """A reward (train.grpo.rewards[i].name). Subclasses set the class attributes and implement ``score``."""

    name: str = ""
    summary: str = ""  # one line: what it rewards
    settings_model: type[Section] = RewardSettings
    on_error: float = 0.0  # a failed batch's reward (RewardFailed); the user reward takes it from its settings

    def __init__(self, settings: Section | None = None):
        self.settings = settings if settings is not None else self.settings_model()

    @property
    def needs(self) -> tuple[str, ...]:
        """The row fields score reads; "a|b" when either will do. Nothing by default."""
        return ()

    def score(self, completions: list[str], rows: list[dict]) -> list[float]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what scoring holds (a worker process, a loaded model). Nothing by default."""


def missing_fields(rewards, row: dict) -> list[str]:
    """What a row lacks for the rewards (a RewardSet or a list of Reward): one line per missing field, e.g.
    'no field "answer" that reward numeric_match needs'. Empty when the row has all they read."""
    problems = []
    for reward in rewards:
        for need in reward.needs:
            options = need.split("|")
            if not any(option in row for option in options):
                fields = " or ".join(f'"{option}"' for option in options)
                problems.append(f"no field {fields} that reward {reward.name} needs")
    return problems


def reference_text(row: dict, field: str) -> str | None:
    """The reference answer in row[field]; for the default field, a messages row's last assistant message. None when
    the row holds no text there."""
    value = row.get(field)
    if value is None and field == ANSWER:
        messages = row.get(MESSAGES) or []
        if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
            value = messages[-1].get("content")
    if value is None or isinstance(value, (dict, list)):
        return None
    return str(value)


def reference_needs(field: str) -> tuple[str, ...]:
    """The needs of a reward that reads its reference in ``field``: the default reads output or messages."""
    return (f"{ANSWER}|{MESSAGES}",) if field == ANSWER else (field,)


class ReferenceReward(Reward):
    """A reward that scores each completion against its row's reference answer, read from ``settings.field``
    (exact_match, numeric_match, math_verify): subclasses define ``_one(completion, reference)``, reference None
    when the row holds no text there."""

    @property
    def needs(self) -> tuple[str, ...]:
        return reference_needs(self.settings.field)

    def score(self, completions: list[str], rows: list[dict]) -> list[float]:
        return [
            self._one(completion, reference_text(row, self.settings.field))
            for completion, row in zip(completions, rows)
        ]

    def _one(self, completion: str, reference: str | None) -> float:
        raise NotImplementedError
