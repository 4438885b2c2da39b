"""DPO (Rafailov et al. 2023): preference pairs against a frozen reference model.

    reward(y) = beta * (log pi(y|x) - log ref(y|x))
    loss      = -logsigmoid(reward(chosen) - reward(rejected))

The reference's log-probs of every pair are computed once, by the reference_logps stage (train.preference.reference:
the champion or the base), and read with the shards; beta is train.preference.beta.
"""

from __future__ import annotations

from fineflow.objectives.interface import PairObjective


class DPO(PairObjective):
    name = "dpo"
    summary = "preference pairs against a reference model"
    needs_reference = True

    def rewards(self, policy, reference, cfg):
        beta = cfg.preference.beta
        return beta * (policy.chosen - reference.chosen), beta * (policy.rejected - reference.rejected)
