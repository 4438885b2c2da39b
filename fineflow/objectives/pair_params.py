"""train.preference: the settings of the pair objectives (fineflow.objectives.interface.PairObjective): the reward's
scale, SimPO's margin, and which model a run starts from (and DPO's reference is)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fineflow.param_section import Section


class PreferenceParams(Section):
    """Preference tuning (train.objective dpo, simpo, orpo or kto): the loss's constants and DPO's reference model."""

    beta: float = Field(
        0.1,
        gt=0,
        description="dpo, kto: how far the policy may move from the reference (larger stays closer); simpo: the reward "
        "scale (its paper uses 2 to 10)",
    )
    simpo_gamma: float = Field(
        0.5, ge=0, description="simpo: the margin by which the chosen reward must beat the rejected one"
    )
    orpo_lambda: float = Field(
        0.1, gt=0, description="orpo: the weight of the odds-ratio term beside the chosen answer's SFT loss"
    )
    kto_desirable_weight: float = Field(
        1.0, gt=0, description="kto: the weight of a desirable answer's loss (raise it when desirable rows are rarer)"
    )
    kto_undesirable_weight: float = Field(1.0, gt=0, description="kto: the weight of an undesirable answer's loss")
    # The model the policy starts from: champion is the registry's champion adapter on the base (the SFT model, after
    # an SFT run was promoted); base is the base model and a fresh adapter. Without a champion, champion means the
    # base. DPO's and KTO's reference is that model, frozen (the reference_logps stage caches its log-probabilities).
    reference: Literal["champion", "base"] = Field(
        "champion",
        description="dpo, simpo, orpo, kto: the model the policy starts from and evaluate measures it from (dpo and "
        "kto: also their frozen reference): the champion (the base when none yet) or the base",
    )
