"""The rewards of a run together: each completion's total is the weighted sum of its rewards,

    total_i = sum over rewards k of weight_k * reward_k(completion_i, row_i)

with each reward's own scores, its errors and its time beside the total for the step log. A reward that could not
score the batch (RewardFailed: the user's function hung, raised, returned the wrong thing) gives every completion
of the batch its ``on_error`` value and counts one error; the set keeps the run's counts and the first messages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fineflow.errors import FineflowError
from fineflow.rewards.interface import Reward, RewardFailed

KEPT_MESSAGES = 5  # per reward, over the run: the first ones say what went wrong, the count says how often


@dataclass
class RewardScores:
    """One batch's rewards. ``per_reward`` and the others are keyed by the reward's label: its name, or
    ``name[i]`` when train.grpo.rewards names it more than once (i: its place in the list)."""

    total: list[float]
    per_reward: dict[str, list[float]]
    errors: dict[str, int]  # failed calls of this batch (0 or 1 per reward)
    error_messages: dict[str, list[str]]  # what each failed with ("TimeoutError: ...")
    seconds: dict[str, float]  # time each reward took on the batch


@dataclass
class RewardSet:
    """Rewards with their weights and labels (build_rewards makes one from train.grpo.rewards)."""

    rewards: list[Reward]
    weights: list[float]
    labels: list[str]
    errors: dict[str, int] = field(default_factory=dict)  # the run's failed calls, per label
    error_messages: dict[str, list[str]] = field(default_factory=dict)  # the first KEPT_MESSAGES of each
    seconds: dict[str, float] = field(default_factory=dict)  # the run's time scoring, per label

    def __iter__(self):
        return iter(self.rewards)

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def score(self, completions: list[str], rows: list[dict]) -> RewardScores:
        """Every reward of every completion (rows[i]: the row completion i answers), and their weighted sums."""
        if len(completions) != len(rows):
            raise FineflowError(f"rewards: {len(completions)} completions but {len(rows)} rows: one row each")
        batch = RewardScores([0.0] * len(completions), {}, {}, {}, {})
        for reward, weight, label in zip(self.rewards, self.weights, self.labels):
            start = time.perf_counter()
            values = self._one(reward, label, completions, rows, batch)
            batch.seconds[label] = time.perf_counter() - start
            self.seconds[label] = self.seconds.get(label, 0.0) + batch.seconds[label]
            batch.per_reward[label] = values
            batch.total = [total + weight * value for total, value in zip(batch.total, values)]
        return batch

    def _one(self, reward: Reward, label: str, completions, rows, batch: RewardScores) -> list[float]:
        """The reward's scores of the batch, or its on_error for each completion when it failed (counted)."""
        batch.errors[label] = 0
        try:
            values = [float(v) for v in reward.score(completions, rows)]
        except RewardFailed as exc:
            batch.errors[label], batch.error_messages[label] = 1, [str(exc)]
            self.errors[label] = self.errors.get(label, 0) + 1
            kept = self.error_messages.setdefault(label, [])
            if len(kept) < KEPT_MESSAGES:
                kept.append(str(exc))
            return [reward.on_error] * len(completions)
        if len(values) != len(completions):  # a built-in's bug, never the user's (their function is checked)
            raise FineflowError(f"reward {label} gave {len(values)} scores for {len(completions)} completions")
        return values

    def summary(self) -> dict:
        """The run's figures so far, for a report: each reward's errors, first messages and seconds."""
        return {"errors": dict(self.errors), "error_messages": dict(self.error_messages), "seconds": dict(self.seconds)}

    def close(self) -> None:
        for reward in self.rewards:
            reward.close()
