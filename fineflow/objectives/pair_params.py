"""train.preference: the settings the preference objectives share: the reward's scale, and which model a run starts
from (and DPO's and KTO's reference is). What one objective alone reads is its own section, train.<name>
(Objective.params: SimPO's margin, ORPO's weight, KTO's weights)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fineflow.param_section import Section


class PreferenceParams(Section):
    """Preference tuning (train.objective dpo, simpo, orpo or kto): the reward's scale, the model a run starts from."""

    beta: float = Field(
        0.1,
        gt=0,
        description="dpo, kto: how far the policy may move from the reference (larger stays closer); simpo: the reward "
        "scale (its paper uses 2 to 10)",
    )
    # The model the policy starts from: champion is the registry's champion adapter on the base (the SFT model, after
    # an SFT run was promoted); base is the base model and a fresh adapter. Without a champion, champion means the
    # base. DPO's and KTO's reference is that model, frozen (the reference_logps stage caches its log-probabilities).
    reference: Literal["champion", "base"] = Field(
        "champion",
        description="dpo, simpo, orpo, kto: the model the policy starts from and evaluate measures it from (dpo and "
        "kto: also their frozen reference): the champion (the base when none yet) or the base",
    )
