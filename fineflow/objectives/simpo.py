"""SimPO (Meng et al. 2024): preference pairs, reference-free, each answer's log-prob normalised by its length.

    reward(y) = beta * log pi(y|x) / |y|
    loss      = -logsigmoid(reward(chosen) - reward(rejected) - gamma)

beta is train.preference.beta, gamma train.preference.simpo_gamma; no reference model runs.
"""

from __future__ import annotations

from fineflow.objectives.interface import PairObjective


class SimPO(PairObjective):
    name = "simpo"
    summary = "preference pairs, reference-free (length-normalised)"

    def rewards(self, policy, reference, prefs):
        return (
            prefs.beta * policy.chosen / policy.chosen_len.clamp(min=1),
            prefs.beta * policy.rejected / policy.rejected_len.clamp(min=1),
        )

    def offset(self, prefs) -> float:
        return prefs.simpo_gamma
