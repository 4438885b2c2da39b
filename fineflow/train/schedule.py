"""The learning-rate schedule: linear warmup, then cosine or linear decay to 10% of ``train.lr`` (or constant).

One schedule for every caller (the train stage, the embedded base's pretraining, the TRL comparison bench). It is a
function of the optimizer step, so every world size follows the same schedule per optimizer step.
"""

from __future__ import annotations

import math

from fineflow.core.train_config import TrainParams


def lr_multiplier(step: int, warmup: int, total: int, schedule: str) -> float:
    """Linear warmup, then cosine or linear decay to 10% (or constant); step is 0-based."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return 0.1 + 0.9 * decay


def learning_rate(step: int, peak: float, warmup: int, total: int, schedule: str = "cosine") -> float:
    """The rate itself at a 0-based step, for a loop that sets it by hand (the embedded base's pretraining):
    peak x lr_multiplier, but in warmup peak x (step + 1) / warmup, multiplied before the division as pretraining
    always has (peak x the multiplier rounds 8 of its 20 warmup steps one bit differently, and every byte of the
    base and of each model trained on it would change)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * lr_multiplier(step, warmup, total, schedule)


def build_scheduler(optimizer, cfg: TrainParams):
    """A LambdaLR over ``lr_multiplier`` for the run's warmup, length and schedule kind."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, cfg.warmup_steps, cfg.steps, cfg.schedule)
    )
