"""The rewards of online RL (train.grpo.rewards): one module per reward, each a subclass of ``Reward``
(interface.py) with its own typed settings; the GRPO objective's rollouts are scored by the weighted sum of a list.

interface.py      the interface: Reward (name, settings_model, needs, score), RewardFailed, missing_fields
exact_match.py    1 when the stripped completion is the stripped reference answer
numeric_match.py  1 when the completion's last number is the reference's, within a tolerance
format.py         1 when the completion matches a regular expression
length_penalty.py 0 up to a target length, then linear to -1 (DAPO's overlong shaping)
math_verify.py    1 when Math-Verify finds the answers equal (the optional math-verify package)
reward_model.py   the registry's champion reward model (fineflow.registry.reward_champion), loaded on first use
user.py           the user's function, package.module:function, in a worker process with a time limit
worker.py         that worker: started once, killed and restarted when a call passes its limit
combine.py        RewardSet and RewardScores: the weighted total, each reward's scores, errors and seconds

The list itself is a params field of fineflow/reward_spec.py (``RewardSpec``: the shape of one entry, importable by
the objectives, which stand below this package); ``build_rewards`` checks every entry's name and settings.
Adding one: a module with its subclass, and its line in REWARDS below (docs/rewards.md).

    rewards = build_rewards([{"name": "numeric_match", "weight": 1.0}, {"name": "format", "pattern": r".*\\d"}])
    rewards.score(completions, rows).total
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pydantic import ValidationError

from fineflow.errors import ConfigError
from fineflow.reward_spec import DEFAULT_REWARDS, RewardsParams, RewardSpec
from fineflow.rewards.combine import RewardScores, RewardSet
from fineflow.rewards.exact_match import ExactMatch
from fineflow.rewards.format import Format
from fineflow.rewards.interface import Reward, RewardFailed, SettingError, missing_fields
from fineflow.rewards.length_penalty import LengthPenalty
from fineflow.rewards.math_verify import MathVerify
from fineflow.rewards.numeric_match import NumericMatch
from fineflow.rewards.reward_model import ChampionReward
from fineflow.rewards.user import UserFunction

REWARDS: dict[str, type[Reward]] = {
    reward.name: reward
    for reward in (ExactMatch, NumericMatch, Format, LengthPenalty, MathVerify, ChampionReward, UserFunction)
}
NAMES = tuple(REWARDS)
WHERE = "rewards"  # the params key the specs come from, as errors name it (callers pass train.<objective>.rewards)
__all__ = [
    "DEFAULT_REWARDS",
    "NAMES",
    "REWARDS",
    "Reward",
    "RewardFailed",
    "RewardScores",
    "RewardSet",
    "RewardSpec",
    "RewardsParams",
    "build_rewards",
    "missing_fields",
    "spec_problems",
]


def spec_problems(spec) -> list[tuple[str, str]]:
    """(key, problem) for each problem of one spec ({"name", "weight", **settings}; key "" is the spec itself)."""
    if isinstance(spec, RewardSpec):
        spec = spec.as_dict()
    if not isinstance(spec, Mapping):
        return [("", f"a mapping of name, weight and the reward's settings, not {type(spec).__name__}")]
    name, weight = spec.get("name"), spec.get("weight", 1.0)
    problems = []
    if name not in REWARDS:
        known = ", ".join(REWARDS)
        problems.append(("name", f"{name!r} is not one of {known}" if name else f"is required: one of {known}"))
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        problems.append(("weight", f"a finite number (got {weight!r})"))
    if name in REWARDS:
        settings = {key: value for key, value in spec.items() if key not in ("name", "weight")}
        try:
            REWARDS[name].settings_model.model_validate(settings)
        except ValidationError as exc:
            problems += [_described(name, error) for error in exc.errors()]
    return problems


def _described(name: str, error: dict) -> tuple[str, str]:
    """A settings error as (key, what to change), in core.config's words."""
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        known = ", ".join(REWARDS[name].settings_model.model_fields) or "none"
        return key, f"is not a setting of reward {name} (its settings: {known})"
    if error["type"] == "missing":
        return key, f"is required by reward {name}"
    return key, f"{error['msg'].removeprefix('Value error, ')} (got {error['input']!r})"


def build_rewards(specs, where: str = WHERE) -> RewardSet:
    """The RewardSet of a list of specs ({"name": ..., "weight": float, **settings}, or RewardSpec); a ConfigError
    listing every problem at once, each naming its key (``train.grpo.rewards[i].field``). Nothing loads here: the
    reward model loads on its first score, the user's function in its worker at its first call."""
    specs = list(DEFAULT_REWARDS) if specs is None else list(specs)
    problems = [] if specs else [f"{where}: no rewards (give at least one, e.g. {DEFAULT_REWARDS[0]})"]
    rewards, weights = [], []
    for i, spec in enumerate(specs):
        found = spec_problems(spec)
        problems += [f"{where}[{i}]{'.' + key if key else ''}: {message}" for key, message in found]
        if found:
            continue
        spec = spec.as_dict() if isinstance(spec, RewardSpec) else dict(spec)
        name, weight = spec.pop("name"), float(spec.pop("weight", 1.0))
        reward_class = REWARDS[name]
        try:
            rewards.append(reward_class(reward_class.settings_model.model_validate(spec)))
            weights.append(weight)
        except SettingError as exc:
            problems.append(f"{where}[{i}].{exc.field}: {exc}")
        except ConfigError as exc:
            problems.append(f"{where}[{i}]: {exc}")
    if problems:
        for reward in rewards:
            reward.close()
        raise ConfigError(f"{len(problems)} problem(s) in {where}:\n  " + "\n  ".join(problems))
    return RewardSet(rewards, weights, _labels([reward.name for reward in rewards]))


def _labels(names: list[str]) -> list[str]:
    """Each reward's key in RewardScores: its name, or name[i] when the list names it more than once."""
    return [f"{name}[{i}]" if names.count(name) > 1 else name for i, name in enumerate(names)]
