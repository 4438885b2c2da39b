"""Test-only: one rank of the train stage on accelerate's real FSDP path, on a CPU-only machine over gloo.

    accelerate launch --config_file <an FSDP yaml> --num_processes 2 -m tests.fsdp_worker <train stage args>

(with FINEFLOW_TRAIN_WORKER=1 and ACCELERATE_USE_CPU unset; tests/test_fsdp.py writes the yaml). accelerate
picks FSDP only for a MULTI_GPU state, so this module first makes a CUDA-less rank look like one GPU rank
whose device is the CPU (the recipe /work/shared/STACK.md verified), then runs ``fineflow.stages.train``'s
own entry. Everything after that is accelerate's, torch's and fineflow's own code: wrapping, sharding,
collectives per forward, checkpoints.

With FINEFLOW_FSDP_PROBE=<dir> each rank also writes ``<dir>/rank<R>.json``: what it held at the first
optimizer step (gradient elements, local parameter and optimizer-state bytes, buffer dtypes) and how many
times the fused LoRA op ran, for the tests to compare with the report and the memory plan.

With FINEFLOW_TEST_NODE_LOCAL=1 every rank but 0 runs in a view of the project whose ``--checkpoints``
directory is its own and empty: what a multi-node run with node-local checkpoint directories sees.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

PROBE_ENV = "FINEFLOW_FSDP_PROBE"
NODE_LOCAL_ENV = "FINEFLOW_TEST_NODE_LOCAL"


def patch_accelerate_for_cpu_fsdp() -> None:
    """Each rank: a MULTI_GPU state over gloo whose device is the CPU; FSDP's plugin built as if CUDA were there."""
    import accelerate.utils.dataclasses as accelerate_dataclasses
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    real_backend = PartialState._prepare_backend

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        if int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_GPU
        return real_backend(self, cpu, sagemaker_dp, backend)

    def set_device(self):
        self.device = torch.device("cpu")

    real_post_init = FullyShardedDataParallelPlugin.__post_init__

    def post_init(self):
        with _cuda_pretended(accelerate_dataclasses, torch):
            real_post_init(self)

    PartialState._prepare_backend = prepare_backend
    PartialState.set_device = set_device
    FullyShardedDataParallelPlugin.__post_init__ = post_init


@contextmanager
def _cuda_pretended(module, torch):
    saved = module.is_cuda_available, torch.cuda.current_device
    module.is_cuda_available, torch.cuda.current_device = (lambda: True), (lambda: "cpu")
    try:
        yield
    finally:
        module.is_cuda_available, torch.cuda.current_device = saved


def install_probe(out_dir: Path) -> None:
    """Wrap fit() and the fused LoRA op so this rank records what it holds at its first optimizer step."""
    import fineflow.train.fused_lora as fused_lora
    import fineflow.train.loop as loop

    calls = {"fused": 0}

    class CountingFusedLora(fused_lora.FusedLoraLinear):
        @classmethod
        def apply(cls, *args, **kwargs):
            calls["fused"] += 1
            return super().apply(*args, **kwargs)

    fused_lora.FusedLoraLinear = CountingFusedLora  # _fused_forward looks the name up at call time
    real_fit = loop.fit

    def fit(model, optimizer, *args, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)
        record: dict = {}

        def before_first_step(opt, *_):
            if not record:
                record.update(holdings(model))

        def after_step(opt, *_):
            if "optimizer_state_bytes" not in record:
                record["optimizer_state_bytes"] = sum(_local_bytes(v) for s in opt.state.values() for v in s.values())

        inner.register_step_pre_hook(before_first_step)
        inner.register_step_post_hook(after_step)
        try:
            return real_fit(model, optimizer, *args, **kwargs)
        finally:
            record["fused_calls"] = calls["fused"]
            rank = int(os.environ.get("RANK", "0"))
            (out_dir / f"rank{rank}.json").write_text(json.dumps(record, indent=1), encoding="utf-8")

    loop.fit = fit


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard on this rank


def _local_bytes(value) -> int:
    import torch

    if not isinstance(value, torch.Tensor):
        return 0
    local = _local(value)
    return local.numel() * local.element_size()


def holdings(model) -> dict:
    """Gradient elements (FSDP1: the flat parameters' gradients; FSDP2: each parameter's shard), local
    parameter bytes, which frozen parameters hold a gradient, and the dtype of every floating buffer."""
    flat = [m._handle.flat_param for m in model.modules() if getattr(m, "_handle", None) is not None]
    params = flat or list(model.parameters())
    named = dict(model.named_parameters())
    return {
        "fsdp1_flat_params": len(flat),
        "grad_elements": sum(_local(p.grad).numel() for p in params if p.grad is not None),
        "param_bytes": sum(_local_bytes(p) for p in params),
        "frozen_with_grad": sorted(n for n, p in named.items() if not p.requires_grad and p.grad is not None),
        "buffer_dtypes": {n: str(b.dtype) for n, b in model.named_buffers() if b.is_floating_point()},
        # the dtypes of what trains and of the frozen base, as held (each shard's)
        "param_dtypes": {
            kind: sorted({str(p.dtype) for p in named.values() if p.requires_grad == trains})
            for kind, trains in (("trainable", True), ("frozen", False))
        },
    }


def move_to_own_node(argv: list[str]) -> None:
    """Ranks other than 0 run in a view of the project of their own, as on another node: the same relative
    paths, every file shared (symlinks) except the checkpoints directory, which is theirs alone and empty."""
    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get(NODE_LOCAL_ENV) != "1" or rank == 0:
        return
    project = Path.cwd()
    checkpoints = argv[argv.index("--checkpoints") + 1]
    node = project.parent / f"{project.name}-node{rank}"
    node.mkdir(exist_ok=True)
    for entry in project.iterdir():
        if entry.name != Path(checkpoints).parts[0] and not (node / entry.name).exists():
            (node / entry.name).symlink_to(entry)
    os.chdir(node)


def main(argv: list[str]) -> int:
    patch_accelerate_for_cpu_fsdp()
    if os.environ.get(PROBE_ENV):
        out_dir = Path(os.environ[PROBE_ENV])
        out_dir.mkdir(parents=True, exist_ok=True)
        install_probe(out_dir)
    from fineflow.stages.train import main as train_main

    move_to_own_node(argv)
    return train_main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
