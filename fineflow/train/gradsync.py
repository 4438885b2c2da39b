"""Time DDP's gradient all-reduce, which otherwise hides inside backward.

DDP all-reduces gradients bucket by bucket while backward still runs, so the loop's "forward+backward" timer
holds the gradient sync as well. A comm hook (``register``) does what DDP's default does (divide by the world
size, all-reduce, asynchronously) and times the part of it the loop waits for: the hook's own synchronous time
(launching the collective) plus, per step, the wait after the last bucket's launch, when backward has nothing
left to overlap with (``settle``). The loop moves that time from compute to gradient sync
(fineflow.train.loop.fit). On a GPU the completion times are the host's view of NCCL's queue: an estimate; use
the PyTorch profiler for a kernel-level split. FSDP and DeepSpeed reduce inside their own engines: there the sync
stays in compute (the report says so: ``grad_sync_measured``).
"""

from __future__ import annotations

import threading
import time

_lock = threading.Lock()
_state = {"seconds": 0.0, "last_launch": None, "last_done": None}


def seconds() -> float:
    """The gradient sync timed so far in this process."""
    return _state["seconds"]


def allreduce(group, tensor):
    """Start the all-reduce of one bucket (a test injects a delay here: tests/faults)."""
    import torch.distributed as dist

    return dist.all_reduce(tensor, group=group, async_op=True).get_future()


def timed_allreduce_hook(group, bucket):
    import torch.distributed as dist

    started = time.perf_counter()
    group = group if group is not None else dist.group.WORLD
    tensor = bucket.buffer().div_(dist.get_world_size(group))
    future = allreduce(group, tensor)
    launched = time.perf_counter()
    with _lock:
        _state["seconds"] += launched - started
        _state["last_launch"] = launched

    def done(fut):
        with _lock:
            _state["last_done"] = time.perf_counter()
        return fut.value()[0]

    return future.then(done)


def settle() -> None:
    """After a step's backward: add the wait for the last bucket's all-reduce (DDP waited for it before
    backward returned), then start the next step afresh."""
    with _lock:
        launch, done = _state["last_launch"], _state["last_done"]
        if launch is not None and done is not None and done > launch:
            _state["seconds"] += done - launch
        _state["last_launch"] = _state["last_done"] = None


def register(model) -> bool:
    """Time a DDP-wrapped model's gradient all-reduce. True when the timing is a measurement: gloo, whose
    futures complete when the reduction has; over NCCL they complete when it is queued, so the wait shows up
    later (in compute) and the hook's figure is a lower bound. False for anything else (one process, FSDP,
    DeepSpeed: their sync stays in compute)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return False
    model.register_comm_hook(None, timed_allreduce_hook)
    return dist.get_backend() == "gloo"
