"""The shape of train.grpo.rewards, a params field: each entry a reward's name, its weight in the total and the
reward's own settings beside them (``{"name": "format", "weight": 0.5, "pattern": "<answer>.*</answer>"}``).

A module of its own below every package, as fineflow.param_section is, so that a params section (the GRPO
objective's, in fineflow/objectives/) may hold ``rewards: list[RewardSpec]`` without importing fineflow.rewards:
that package scores with the registry's reward champion and the thread plan, so it stands above the objectives.
Read here: the shape (a name, a finite weight). Checked when the set is built (fineflow.rewards.build_rewards, at
the start of the stage that scores): that the name is a registered reward, and its settings against that reward's
settings model, every problem at once, each naming train.grpo.rewards[i].<key>.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from fineflow.param_section import Section

DEFAULT_REWARDS = ({"name": "exact_match", "weight": 1.0},)


class RewardSpec(BaseModel):
    """One reward of the list: its name, its weight, and its own settings as the other keys."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1, description="the reward (docs/rewards.md: exact_match, numeric_match, ...)")
    weight: float = Field(
        1.0, allow_inf_nan=False, description="its weight in each completion's total (negative: a penalty)"
    )

    @property
    def settings(self) -> dict:
        """The reward's own settings: the keys beside name and weight."""
        return dict(self.model_extra or {})

    def as_dict(self) -> dict:
        return {"name": self.name, "weight": self.weight, **self.settings}


class RewardsParams(Section):
    """A section that holds the rewards (the GRPO objective's, train.grpo): subclass it, or copy its field."""

    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(**spec) for spec in DEFAULT_REWARDS],
        min_length=1,
        description="the rewards of each completion, summed with their weights (docs/rewards.md)",
    )
