"""Every RNG a training step draws from (Python, NumPy's global generator, torch CPU and CUDA): captured
per rank into a checkpoint and restored from it, so a resumed run draws the same numbers."""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch

from fineflow.checkpoint.format import CheckpointWarning


def capture_rng() -> dict:
    """This process's RNG states: Python, NumPy's global generator, torch CPU and (if in use) CUDA.
    Call it on every rank; gather the snapshots and hand the list to save()."""
    snapshot = {"python": random.getstate(), "numpy": np.random.get_state(), "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # capturing must not initialize CUDA
        snapshot["torch_cuda"] = torch.cuda.get_rng_state_all()
    return snapshot


def restore_rng(snapshot: dict) -> None:
    """Put back the RNG states capture_rng() took (from a loaded checkpoint: rng_snapshots[rank])."""
    random.setstate(snapshot["python"])
    np.random.set_state(snapshot["numpy"])
    torch.set_rng_state(snapshot["torch_cpu"])
    if "torch_cuda" in snapshot:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(snapshot["torch_cuda"])
        else:
            warnings.warn(
                "the checkpoint holds CUDA RNG states but CUDA is not available here; CUDA "
                "random draws (dropout on a GPU) will not continue the saved sequence",
                CheckpointWarning,
                stacklevel=2,
            )
