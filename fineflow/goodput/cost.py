"""What a run cost: its wall time x the devices it held x a price per device-hour (params.yaml ``cost:``).

The devices are held for the whole run, not only while the loop trains: an idle GPU during evaluation, a DVC
hash or a crashed attempt costs the same per hour. So every bucket of the ledger has a price, and the badput
buckets are money lost ("$ lost to checkpoint stalls").
"""

from __future__ import annotations

from fineflow.core.cost_config import DEFAULT_PRICES


def price_per_device_hour(cost, device: dict) -> tuple[float, str]:
    """(price, where it came from): cost.device_hour_usd, else the table entry whose name is in the device's
    name (longest first), else the table's "gpu" or "cpu" fallback."""
    if cost.device_hour_usd is not None:
        return cost.device_hour_usd, "cost.device_hour_usd"
    prices = {**DEFAULT_PRICES, **cost.prices}
    name = str(device.get("name") or "")
    if device.get("type") == "cuda":
        for model in sorted((m for m in prices if m not in ("gpu", "cpu")), key=len, reverse=True):
            if model.lower() in name.lower():
                return prices[model], f"cost.prices[{model!r}] ({name})"
        return prices["gpu"], f"cost.prices['gpu'] (no entry for {name!r})"
    return prices["cpu"], "cost.prices['cpu']"


def run_cost(ledger: dict, price: float, source: str, devices: int, tokens: int | None) -> dict:
    """The run's cost, per 1M trained tokens, and per bucket (the badput ones are money lost)."""
    hours = ledger["total_s"] / 3600
    total = hours * devices * price
    per_bucket = {
        name: round(seconds / ledger["total_s"] * total, 6) if ledger["total_s"] else 0.0
        for name, seconds in ledger["buckets"].items()
    }
    return {
        "device_hour_usd": price,
        "price_source": source,
        "devices": devices,
        "run_usd": round(total, 6),
        "usd_per_1m_tokens": round(total / (tokens / 1e6), 6) if tokens else None,
        "bucket_usd": per_bucket,
        "badput_usd": round(total - per_bucket.get("compute", 0.0), 6),
    }
