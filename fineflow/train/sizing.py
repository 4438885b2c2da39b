"""Sizing a run before anything loads: the hardware check and the memory planner's verdict for params.

The launcher calls ``fit_plan`` to refuse (or adapt, ``train.auto_fit``) before launching; every rank calls it
again and reaches the same answer, since it is pure in its inputs. The planner's arithmetic is
``fineflow.train.planner``.
"""

from __future__ import annotations

from pathlib import Path

from fineflow.core.config import Params, TrainParams
from fineflow.core.errors import FineflowError
from fineflow.train import planner, precision
from fineflow.train.launch import read_profile, resolve_profile

GiB = 2**30
PRECISION_OF = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def check_hardware(cfg: TrainParams, has_gpu: bool) -> None:
    """Settings this machine cannot run, said before anything is loaded."""
    if cfg.method == "qlora" and not has_gpu:
        raise FineflowError(
            "params.yaml: train.method is qlora, which quantizes the base model to 4 bits with "
            "bitsandbytes and needs a CUDA GPU; this machine has none. Use train.method: lora "
            "(the same adapter on a 16/32-bit base) or run on a GPU machine."
        )
    if cfg.precision == "fp16" and not has_gpu:
        raise FineflowError(
            "params.yaml: train.precision fp16 needs a CUDA GPU (loss scaling); on CPU use train.precision: bf16 or no."
        )
    if cfg.attention == "flash_attention_2":
        from importlib.util import find_spec

        # the precision really used: "auto" on a GPU without bf16 (or on a CPU) is fp32 too
        chosen = precision.choose_precision(cfg.precision, cfg.accelerate_profile, has_gpu).mixed_precision
        if chosen == "no":  # a params conflict, whatever the machine: said before the GPU question
            raise FineflowError(
                "params.yaml: train.attention flash_attention_2 needs train.precision bf16 or fp16: flash-attn "
                f"computes only in half precision and rejects fp32 queries (train.precision {cfg.precision} runs "
                "in fp32 here). Set "
                "train.precision: bf16 (fp16 on GPUs without bf16), or keep fp32 with train.attention: varlen "
                "(the same per-example attention, any dtype)."
            )
        if not has_gpu or find_spec("flash_attn") is None:
            raise FineflowError(
                "params.yaml: train.attention flash_attention_2 needs a CUDA GPU and the flash-attn "
                "package (pip install flash-attn); train.attention: varlen does the same per-example "
                "attention on any device."
            )


def sharding_of(profile: Path | None) -> str:
    """The planner's sharding mode for an accelerate profile: how parameters/gradients/optimizer split."""
    if profile is None:
        return "none"
    data = read_profile(profile)
    kind = data["distributed_type"].upper()
    if kind == "FSDP":
        return "fsdp"
    if kind == "DEEPSPEED":
        stage = int((data.get("deepspeed_config") or {}).get("zero_stage", 2))
        return "zero3" if stage == 3 else "zero2" if stage == 2 else "none"
    return "none"


def world_size(cfg: TrainParams, profile: Path | None) -> int:
    if cfg.num_processes is not None:
        return cfg.num_processes
    return int(read_profile(profile).get("num_processes", 1)) if profile is not None else 1


def device_memory_bytes(cfg: TrainParams, has_gpu: bool, ranks_here: int) -> float:
    """What one rank may use: train.device_memory_gib, else the GPU's memory, else this machine's RAM
    shared by the ranks on it."""
    if cfg.device_memory_gib is not None:
        return cfg.device_memory_gib * GiB
    if has_gpu:
        import torch

        return float(torch.cuda.get_device_properties(0).total_memory)
    import psutil

    return psutil.virtual_memory().total / max(1, ranks_here)


def model_shape(reference: str):
    if Path(reference).exists():
        return planner.load_shape(reference)
    from transformers import AutoConfig  # a hub id: its config from the local cache (offline)

    return planner.shape_from_config(AutoConfig.from_pretrained(reference).to_dict(), name=reference)


def fit_plan(params: Params, reference: str, has_gpu: bool):
    """The planner's verdict for this run: (train params to run with, plan dict, changes made).

    Pure in its inputs, so the launcher (which refuses before launching) and every rank (which applies
    the adapted settings) reach the same answer without passing it around."""
    cfg = params.train
    profile = resolve_profile(cfg.accelerate_profile)
    ranks = world_size(cfg, profile)
    targets = tuple(t for t in cfg.lora.target_modules if t in planner.LINEARS) or planner.LINEARS
    # the one place the precision is decided (train.precision vs the profile's; fineflow.train.precision)
    chosen = precision.choose_precision(cfg.precision, cfg.accelerate_profile, has_gpu)
    sharding = sharding_of(profile)
    precision.check_qlora_sharding(cfg.method, sharding, profile)
    setup = planner.Setup(
        method=cfg.method,
        precision=PRECISION_OF[chosen.mixed_precision],
        weight_storage=precision.weight_storage(cfg.method, chosen.mixed_precision, sharding),
        optimizer="adamw",
        micro_batch_size=cfg.micro_batch_size,
        seq_len=params.tokenize.seq_len,
        grad_accum=cfg.grad_accum,
        gradient_checkpointing=cfg.gradient_checkpointing,
        num_gpus=ranks,
        sharding=sharding,
        lora_r=cfg.lora.r,
        lora_targets=targets,
    )
    device = device_memory_bytes(cfg, has_gpu, max(1, ranks // cfg.num_machines))
    result = planner.check_fit(model_shape(reference), setup, device, adapt=cfg.auto_fit)
    adapted = cfg.model_copy(
        update={
            "micro_batch_size": result.setup.micro_batch_size,
            "grad_accum": result.setup.grad_accum,
            "gradient_checkpointing": result.setup.gradient_checkpointing,
            "precision": chosen.mixed_precision,
        }
    )
    plan = {
        **result.plan.as_dict(),
        "device_bytes": int(device),
        "changes": result.changes,
        "precision": chosen.as_dict(),
    }
    return adapted, plan, result.changes
