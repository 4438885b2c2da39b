"""params.yaml's ``cost`` section: device-hour prices for the goodput ledger (fineflow.goodput)."""

from __future__ import annotations

from pydantic import Field, field_validator

from fineflow.param_section import Section, enforced

# $ per device-hour, on-demand list prices rounded (late 2026, one GPU of a multi-GPU instance); "gpu": any other
# GPU; "cpu": a whole 2-vCPU machine (fineflow.goodput.cost)
DEFAULT_PRICES = {
    "B200": 7.0,
    "H200": 5.0,
    "H100": 4.0,
    "A100": 2.5,
    "L40S": 1.9,
    "A10G": 1.2,
    "L4": 0.8,
    "V100": 2.5,
    "T4": 0.5,
    "MI300X": 4.0,
    "gpu": 2.0,
    "cpu": 0.1,
}


class CostParams(Section):
    """What a device-hour costs, for the goodput ledger's cost figures (fineflow.goodput.cost)."""

    device_hour_usd: float | None = Field(
        None, ge=0, description="$ per device-hour for every device of the run; null: cost.prices by device name"
    )
    # $ per device-hour by device name (matched inside the GPU's name; "gpu": any other GPU, "cpu": a CPU
    # machine); entries given here replace the defaults of the same name, the rest stay
    prices: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_PRICES),
        json_schema_extra=enforced(ge=0),
        description='$ per device-hour by a name matched inside the GPU\'s ("gpu": any other GPU, "cpu": a CPU '
        "machine); your entries replace these by name",
    )

    @field_validator("prices")
    @classmethod
    def _non_negative(cls, prices: dict[str, float]) -> dict[str, float]:
        negative = [name for name, price in prices.items() if price < 0]
        if negative:
            raise ValueError(f"prices must be >= 0 (negative: {', '.join(negative)})")
        return prices
