"""The planner's advice: whether a run fits a device (``check_fit``), how to adapt one that does not
(``auto_fit``: gradient checkpointing first, then smaller micro-batches with more accumulation) and what to
change when it cannot (``refusal``, ``suggestions``), naming the params.yaml keys."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fineflow.errors import FineflowError
from fineflow.train.planner.memory import METHODS, GiB, MemoryPlan, Setup, plan
from fineflow.train.planner.shapes import ModelShape

# Where each setting lives in params.yaml, for messages that say what to change.
PARAM_KEYS = {
    "micro_batch_size": "train.micro_batch_size",
    "grad_accum": "train.grad_accum",
    "gradient_checkpointing": "train.gradient_checkpointing",
    "method": "train.method",
    "sharding": "train.accelerate_profile",  # sharding is the profile's (fineflow.train.profile), not a key
    "seq_len": "tokenize.seq_len",
}
# The shipped profile (configs/accelerate) that shards the weights for each method: FSDP2 for adapters, ZeRO-3 for
# full fine-tuning (the planner counts fsdp and zero3 alike). QLoRA cannot be sharded (fineflow.train.precision).
SHARDING_PROFILE = {"lora": "fsdp_lora", "full": "deepspeed_zero3"}


class DoesNotFit(FineflowError):
    """The plan exceeds the device; the message says what to change."""


@dataclass(frozen=True)
class FitVerdict:
    """The settings to run with, their plan, and each change made to get there (empty: unchanged)."""

    setup: Setup
    plan: MemoryPlan
    changes: list[str] = field(default_factory=list)


def _smaller_micro_batch(micro: int) -> int | None:
    """The next micro-batch down: the largest divisor <= micro/2 (a halving for powers of two), so that
    micro * grad_accum stays exactly the same global batch. None at 1."""
    return next((d for d in range(micro // 2, 0, -1) if micro % d == 0), None)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def auto_fit(shape: ModelShape, setup: Setup, device_bytes: float) -> FitVerdict:
    """Adapt setup until its plan fits device_bytes, changing as little as possible, in this order:
    1. enable gradient checkpointing; 2. lower the micro-batch step by step (halving, down to 1),
    raising grad_accum so that the global batch is unchanged. Raises DoesNotFit when even that fails."""
    current, changes = setup, []
    result = plan(shape, current)
    if result.fits(device_bytes):
        return FitVerdict(current, result, changes)
    if not current.gradient_checkpointing:
        current = replace(current, gradient_checkpointing=True)
        before, result = result, plan(shape, current)
        changes.append(
            f"{PARAM_KEYS['gradient_checkpointing']}: false -> true (activations "
            f"{_gib(before.activations)} -> {_gib(result.activations)})"
        )
    while not result.fits(device_bytes):
        smaller = _smaller_micro_batch(current.micro_batch_size)
        if smaller is None:  # checkpointing on, micro-batch 1: what is left is for the user to choose
            raise DoesNotFit(
                refusal(
                    shape, current, device_bytes, note="even with gradient checkpointing and micro-batch 1 (auto_fit)"
                )
            )
        accum = current.grad_accum * current.micro_batch_size // smaller
        changes.append(
            f"{PARAM_KEYS['micro_batch_size']}: {current.micro_batch_size} -> {smaller}, "
            f"{PARAM_KEYS['grad_accum']}: {current.grad_accum} -> {accum} (global batch unchanged)"
        )
        current = replace(current, micro_batch_size=smaller, grad_accum=accum)
        result = plan(shape, current)
    return FitVerdict(current, result, changes)


def check_fit(shape: ModelShape, setup: Setup, device_bytes: float, adapt: bool) -> FitVerdict:
    """What the train stage calls before launching: adapt (``train.auto_fit: true``) or refuse."""
    if adapt:
        return auto_fit(shape, setup, device_bytes)
    result = plan(shape, setup)
    if not result.fits(device_bytes):
        raise DoesNotFit(refusal(shape, setup, device_bytes))
    return FitVerdict(setup, result)


def _largest_fitting(values: list[int], make, shape: ModelShape, device_bytes: float) -> int | None:
    """The largest value v (values ascending) for which plan(shape, make(v)) fits, or None."""
    fitting = [v for v in values if plan(shape, make(v)).fits(device_bytes)]
    return fitting[-1] if fitting else None


def _what_else(candidate: Setup, shape: ModelShape, device_bytes: float) -> str | None:
    """'' when candidate fits as is; else what it also needs (checkpointing, a smaller micro-batch);
    None when nothing within those fits."""
    if plan(shape, candidate).fits(device_bytes):
        return ""
    checkpointed = replace(candidate, gradient_checkpointing=True)
    if not candidate.gradient_checkpointing and plan(shape, checkpointed).fits(device_bytes):
        return f" with {PARAM_KEYS['gradient_checkpointing']}: true"
    micro = _largest_fitting(
        list(range(1, candidate.micro_batch_size)),
        lambda m: replace(checkpointed, micro_batch_size=m),
        shape,
        device_bytes,
    )
    if micro is None:
        return None
    return (
        f" with {PARAM_KEYS['gradient_checkpointing']}: true and {PARAM_KEYS['micro_batch_size']} <= {micro}"
        if not candidate.gradient_checkpointing
        else f" with {PARAM_KEYS['micro_batch_size']} <= {micro}"
    )


def suggestions(shape: ModelShape, setup: Setup, device_bytes: float) -> list[str]:
    """Changes to setup that would make it fit, most local first: a smaller micro-batch, gradient
    checkpointing, a cheaper method, sharding, and as a last resort shorter rows."""
    key, options = PARAM_KEYS, []
    micro = _largest_fitting(
        list(range(1, setup.micro_batch_size)), lambda m: replace(setup, micro_batch_size=m), shape, device_bytes
    )
    if micro is not None:
        options.append(
            f"set {key['micro_batch_size']} <= {micro} (and raise {key['grad_accum']} to keep the global batch)"
        )
    if not setup.gradient_checkpointing:
        extra = _what_else(replace(setup, gradient_checkpointing=True), shape, device_bytes)
        if extra is not None:
            options.append(f"set {key['gradient_checkpointing']}: true{extra}")
    for method in METHODS[METHODS.index(setup.method) + 1 :]:  # full -> lora -> qlora: less memory each
        extra = _what_else(replace(setup, method=method), shape, device_bytes)
        if extra is not None:
            options.append(f"set {key['method']}: {method}{extra}")
            break
    profile = SHARDING_PROFILE.get(setup.method)
    if profile and setup.num_gpus > 1 and setup.sharding in ("none", "zero2"):
        extra = _what_else(replace(setup, sharding="fsdp"), shape, device_bytes)
        if extra is not None:
            options.append(f"set {key['sharding']}: {profile}{extra}")
    if not options:
        lengths = [2**k for k in range(7, setup.seq_len.bit_length()) if 2**k < setup.seq_len]
        minimal = replace(setup, gradient_checkpointing=True, micro_batch_size=1)
        length = _largest_fitting(lengths, lambda n: replace(minimal, seq_len=n), shape, device_bytes)
        if length is not None:
            options.append(
                f"lower {key['seq_len']} to <= {length} (with gradient checkpointing and {key['micro_batch_size']}: 1)"
            )
    return options


def refusal(shape: ModelShape, setup: Setup, device_bytes: float, note: str = "") -> str:
    """The message for a run that does not fit: what it needs, what the device has, what to change."""
    needed = plan(shape, setup).total
    message = (
        f"{shape.name} ({setup.method}) needs {_gib(needed)} per device{' ' + note if note else ''}, "
        f"device has {_gib(device_bytes)}"
    )
    return f"{message}: {what_to_change(shape, setup, device_bytes)}"


def what_to_change(shape: ModelShape, setup: Setup, device_bytes: float) -> str:
    """The suggestions joined into one sentence, or what is left when no setting change is enough."""
    options = suggestions(shape, setup, device_bytes)
    if options:
        return " or ".join(options)
    return (
        f"no single setting change fits; use a device with more memory or more GPUs with a sharding "
        f"{PARAM_KEYS['sharding']} ({', '.join(SHARDING_PROFILE.values())})"
    )
