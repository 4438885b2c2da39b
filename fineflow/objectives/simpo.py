"""SimPO (Meng et al. 2024): preference pairs, reference-free, each answer's log-prob normalised by its length.

    reward(y) = beta * log pi(y|x) / |y|
    loss      = -logsigmoid(reward(chosen) - reward(rejected) - gamma)

beta is train.preference.beta, gamma train.simpo.gamma (SimPOParams, its own section); no reference model runs.
"""

from __future__ import annotations

from pydantic import Field

from fineflow.objectives.interface import PairObjective
from fineflow.param_section import Section


class SimPOParams(Section):
    """train.simpo: SimPO's own settings (its reward scale is train.preference.beta)."""

    gamma: float = Field(0.5, ge=0, description="the margin by which the chosen reward must beat the rejected one")


class SimPO(PairObjective):
    name = "simpo"
    summary = "preference pairs, reference-free (length-normalised)"
    params = SimPOParams

    def rewards(self, policy, reference, cfg):
        beta = cfg.preference.beta
        return (
            beta * policy.chosen / policy.chosen_len.clamp(min=1),
            beta * policy.rejected / policy.rejected_len.clamp(min=1),
        )

    def offset(self, cfg) -> float:
        return cfg.simpo.gamma
