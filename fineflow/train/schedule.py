"""The learning-rate schedule: linear warmup, then cosine or linear decay to 10% of ``train.lr`` (or constant).

One schedule for every caller (the train stage, the TRL comparison bench). It is a function of the optimizer
step, so every world size follows the same schedule per optimizer step.
"""

from __future__ import annotations

import math

from fineflow.core.config import TrainParams


def lr_multiplier(step: int, warmup: int, total: int, schedule: str) -> float:
    """Linear warmup, then cosine or linear decay to 10% (or constant); step is 0-based."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return 0.1 + 0.9 * decay


def build_scheduler(optimizer, cfg: TrainParams):
    """A LambdaLR over ``lr_multiplier`` for the run's warmup, length and schedule kind."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, cfg.warmup_steps, cfg.steps, cfg.schedule)
    )
