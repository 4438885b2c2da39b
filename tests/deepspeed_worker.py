"""Test-only: one rank of the train stage under DeepSpeed's real engine, on a CPU-only machine over gloo.

    DS_ACCELERATOR=cpu FINEFLOW_TRAIN_WORKER=1 accelerate launch --config_file <DeepSpeed profile> \
        -m tests.deepspeed_worker <train stage args>

This is the command the DeepSpeed profiles document for a GPU node, with ``tests.deepspeed_worker`` in place of
``fineflow.stages.train``: it patches what a CUDA-less rank lacks, then runs ``fineflow.stages.train``'s own entry.
Everything after that is accelerate's, DeepSpeed's and fineflow's own code: ZeRO partitioning, its accumulation
boundary, its clipping, checkpoints, resume and the final save. (The train stage's launcher refuses a GPU profile
on a machine without a GPU, so tests start the ranks with accelerate launch, as a GPU user's cluster script would.)

Two patches, neither in the maths:
- accelerate derives its process group from the device: with no CUDA it starts DeepSpeed with no backend and every
  rank as process 0 of 1. It is given gloo and a multi-process state instead (nccl on GPUs), with the CPU as device;
- DeepSpeed's CPU accelerator would first JIT-compile a shared-memory all-reduce kernel (minutes on 2 cores); its
  collectives go through torch.distributed's gloo instead.
"""

from __future__ import annotations

import sys


def run_deepspeed_on_cpu() -> None:
    import deepspeed.comm.torch
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        return "gloo", DistributedType.MULTI_GPU

    def set_device(self):
        if self.device is None:
            self.device = torch.device("cpu")

    PartialState._prepare_backend = prepare_backend
    PartialState.set_device = set_device
    deepspeed.comm.torch.build_shm_op = lambda: None


def main(argv: list[str]) -> int:
    run_deepspeed_on_cpu()
    from fineflow.stages.train import main as train_main

    return train_main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
