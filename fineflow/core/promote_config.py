"""params.yaml's ``promote`` section: the gate that decides the champion (fineflow.registry)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fineflow.param_section import Section


class PromoteParams(Section):
    """The promotion gate: when a candidate replaces the champion."""

    primary_metric: str = Field(
        "fineflow_synth/exact_match", description="the metric that decides, `<task>/<metric>` of evaluate.tasks"
    )
    min_delta: float = Field(
        0.05, ge=0, description="the candidate must beat the champion (or the base) by this much on primary_metric"
    )
    max_regression: float = Field(0.0, ge=0, description="no other metric may drop by more than this")
    # paired bootstrap over per-sample scores (seeded by `seed`): the delta's CI must exclude 0
    bootstrap_samples: int = Field(
        2000, ge=100, description="paired bootstrap resamples of per-sample scores: more is steadier and slower"
    )
    confidence: float = Field(0.95, gt=0.5, lt=1, description="two-sided level of the delta's CI, which must exclude 0")
    # The champion's eval data differs from this run's (the eval set was changed): compare_on_current judges the
    # candidate against the champion re-scored on the current eval data in this run (logged, with both hashes);
    # refuse stops every promotion until the eval data is put back or the policy changed.
    on_eval_change: Literal["compare_on_current", "refuse"] = Field(
        "compare_on_current",
        description="eval data changed since the champion: re-score the champion on the current data, or refuse",
    )
    # The candidate is on another base model than the champion (model.base changed): its adapter cannot wrap the
    # champion's base, nor the champion's adapter this one. compare_to_base judges the candidate against its own
    # base, with the old champion's merged model scored on the same docs side by side (logged); refuse stops.
    on_base_change: Literal["compare_to_base", "refuse"] = Field(
        "compare_to_base",
        description="model.base changed since the champion: judge against the candidate's own base, or refuse",
    )
    # A person approves what the gate would promote: the flow run pauses at promote with the gate's evidence and
    # waits for approve/reject with a comment (in the Prefect UI); the decision and the approver go into the
    # registry log. A refusal by the gate is never put to a person. Outside a flow: FINEFLOW_APPROVAL (docs/prefect.md).
    require_approval: bool = Field(
        False, description="true: a person approves what the gate would promote (the flow run pauses for them)"
    )
    approval_timeout_h: float = Field(
        24.0, gt=0, description="hours to wait for approval; then the run fails and nothing is promoted"
    )
    # the champion's merged model (merged/): always, never, or auto = only when the base's weight files are at most
    # merged_auto_max_gb (a merged copy is the base's size again in DVC's cache at every promotion: a few MB for
    # the embedded base, 16 GB for an 8B, 141 GB for a 70B). Without it the champion is the adapter plus its
    # base's identity; `python -m fineflow.registry.merge` builds the merged model shard by shard when asked
    merged: Literal["auto", "always", "never"] = Field(
        "auto", description="store the champion's merged model; auto: when the base is at most merged_auto_max_gb"
    )
    merged_auto_max_gb: float = Field(
        2.0, ge=0, description="largest base (weight files, GB) merged under merged: auto (2: ~1B params in bf16)"
    )
