"""Sizing a run before anything loads: the hardware check and the memory planner's verdict for params.

The launcher calls ``fit_plan`` to refuse (or adapt, ``train.auto_fit``) before launching; every rank calls it
again and reaches the same answer, since it is pure in its inputs. Its ``RunPlan`` holds the one train
configuration everything after it reads (the planner's adaptations applied, the precision resolved) with the
run's Profile. The planner's arithmetic is ``fineflow.train.planner``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fineflow.core.config import Params
from fineflow.core.train_config import TrainParams
from fineflow.errors import FineflowError
from fineflow.train import planner, precision
from fineflow.train.profile import Profile

GiB = 2**30


def check_hardware(cfg: TrainParams, has_gpu: bool, profile: Profile) -> None:
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
        chosen = precision.choose_precision(cfg.precision, profile, has_gpu).mixed_precision
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
                "package (a CUDA build: pip install ninja packaging setuptools wheel && pip install "
                "flash-attn==2.8.3.post2 --no-build-isolation, see docs/install.md); train.attention: varlen does the "
                "same per-example attention on any device."
            )


def world_size(cfg: TrainParams, profile: Profile) -> int:
    return cfg.num_processes if cfg.num_processes is not None else profile.processes


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


def model_shape(base: str):
    """The planner's shape of model.base: a local dir, a hub id the planner knows (nothing downloaded), else the
    hub id's config from the local cache."""
    if Path(base).exists() or base in planner.HUB_CONFIGS:
        return planner.load_shape(base)
    from transformers import AutoConfig  # a hub id: its config from the local cache (offline)

    return planner.shape_from_config(AutoConfig.from_pretrained(base).to_dict(), name=base)


@dataclass(frozen=True)
class RunPlan:
    """What setup decided, once: every step after it reads this, never params.train or the profile file again.

    params: the run's params with ``train`` as it trains (auto_fit's micro-batch, accumulation and
    checkpointing; ``precision`` resolved from "auto"). memory: the planner's figures per device (the train
    report's "plan"). changes: what auto_fit changed, as sentences. warnings: settings known to misbehave on
    this run's model (``real_model_warnings``) or with each other (``fused_lora_warnings``), as sentences; also
    in memory["warnings"], the train report's."""

    params: Params
    profile: Profile
    memory: dict
    changes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def train(self) -> TrainParams:
        return self.params.train

    def environment(self) -> dict[str, str]:
        """The plan for the ranks a launcher starts (PLAN_ENV): they read it instead of planning again."""
        plan = {"params": self.params.model_dump(mode="json", by_alias=True), "memory": self.memory}
        return {PLAN_ENV: json.dumps(plan | {"changes": list(self.changes), "warnings": list(self.warnings)})}


# The launcher's RunPlan, in the environment of the ranks it starts (RunPlan.environment, given_plan)
PLAN_ENV = "FINEFLOW_RUN_PLAN"


def given_plan(environ) -> RunPlan | None:
    """The plan the rank's launcher decided (PLAN_ENV), or None for a rank started otherwise (in-process, by hand)."""
    from fineflow.core.config import parse_params
    from fineflow.train.profile import load_profile

    given = environ.get(PLAN_ENV)
    if not given:
        return None
    plan = json.loads(given)
    params = parse_params(plan["params"])
    changes, warnings = tuple(plan["changes"]), tuple(plan["warnings"])
    return RunPlan(params, load_profile(params.train.accelerate_profile), plan["memory"], changes, warnings)


def fit_plan(params: Params, profile: Profile, base: str, has_gpu: bool) -> RunPlan:
    """The planner's verdict for this run, with the train configuration to run with.

    Pure in its inputs, so the launcher (which refuses before launching) and every rank (which applies
    the adapted settings) reach the same answer without passing it around."""
    cfg = params.train
    ranks = world_size(cfg, profile)
    # the one place the precision is decided (train.precision vs the profile's; fineflow.train.precision)
    chosen = precision.choose_precision(cfg.precision, profile, has_gpu)
    precision.check_qlora_sharding(cfg.method, profile.sharding, profile.path)
    setup = planner_setup(params, profile, chosen.mixed_precision, ranks)
    device = device_memory_bytes(cfg, has_gpu, max(1, ranks // cfg.num_machines))
    warnings = real_model_warnings(params) + fused_lora_warnings(params)
    try:
        result = planner.check_fit(model_shape(base), setup, device, adapt=cfg.auto_fit)
    except planner.DoesNotFit as refused:  # said together: fixing the memory alone would still leave the lr
        raise planner.DoesNotFit("; ".join([str(refused), *(f"also: {w}" for w in warnings)])) from None
    adapted = cfg.model_copy(
        update={
            "micro_batch_size": result.setup.micro_batch_size,
            "grad_accum": result.setup.grad_accum,
            "gradient_checkpointing": result.setup.gradient_checkpointing,
            "precision": chosen.mixed_precision,
        }
    )
    memory = {
        **result.plan.as_dict(),
        "device_bytes": int(device),
        "changes": result.changes,
        "precision": chosen.as_dict(),
        "warnings": warnings,
    }
    train_params = params.model_copy(update={"train": adapted})
    return RunPlan(train_params, profile, memory, tuple(result.changes), tuple(warnings))


# Learning rates above these are the embedded model's, not a real one's: LoRA on 7-8B bases is trained at
# 1e-4 to 3e-4 (QLoRA paper, Dettmers et al. 2023: 2e-4 for 7-13B; torchtune's Llama 3 8B LoRA recipe 3e-4;
# Axolotl's Llama 3 LoRA examples 2e-4), full fine-tuning at 1e-5 to 2e-5 (Llama/Alpaca-style SFT).
HIGH_LR = {"lora": (5e-4, "1e-4 to 3e-4"), "qlora": (5e-4, "1e-4 to 3e-4"), "full": (5e-5, "1e-5 to 2e-5")}


def real_model_warnings(params: Params) -> list[str]:
    """What params.yaml still holds for the embedded 1M-parameter model that a real base will not take.

    A warning, not a refusal nor a silent change: the value may be deliberate (a short probe), and a recipe
    (recipes/, ``fineflow recipe apply``: fineflow.recipes) is where real-model values come from; the train report
    and the launcher's log carry it."""
    cfg = params.train
    limit, usual = HIGH_LR[cfg.method]
    if params.model.base == "embedded" or cfg.lr <= limit:
        return []
    return [
        f"params.yaml train.lr {cfg.lr:g} is the embedded model's learning rate: for {cfg.method} on a real base "
        f"({params.model.base}) the usual range is {usual} (QLoRA paper, torchtune and Axolotl recipes); above "
        f"{limit:g} a loss spike or the NaN stop is likely. Set train.lr, or start from a recipe "
        f"(fineflow recipe list; fineflow recipe apply NAME writes its values into params.yaml)"
    ]


def fused_lora_warnings(params: Params) -> list[str]:
    """train.fused_lora asked for, but lora.dropout leaves nothing to fuse: the fused op computes no dropout, so
    every layer takes peft's forward (fineflow.train.fused_lora.fusable), which only the report's
    fused_lora_layers: 0 would otherwise show."""
    cfg = params.train
    if cfg.method == "full" or not cfg.fused_lora or cfg.lora.dropout == 0:
        return []
    return [
        f"params.yaml train.fused_lora is true but train.lora.dropout {cfg.lora.dropout:g} leaves no layer fusable "
        f"(the fused op computes no dropout): every LoRA layer runs peft's forward, 8-12% slower here. Set "
        f"train.lora.dropout: 0.0 to fuse, or train.fused_lora: false to say so"
    ]


def planner_setup(params: Params, profile: Profile, mixed_precision: str, ranks: int) -> planner.Setup:
    """The planner's terms for what this run holds on each device."""
    cfg = params.train
    targets = tuple(cfg.lora.target_modules)  # resolved against the model's own linears by the planner
    storage = precision.weight_storage(cfg.method, mixed_precision, profile.sharding, precision.fsdp_version(profile))
    return planner.Setup(
        method=cfg.method,
        precision=precision.PLANNER_PRECISION_OF[mixed_precision],
        weight_storage=storage,
        optimizer="adamw",
        micro_batch_size=cfg.micro_batch_size,
        seq_len=params.tokenize.seq_len,
        grad_accum=cfg.grad_accum,
        gradient_checkpointing=cfg.gradient_checkpointing,
        num_gpus=ranks,
        sharding=profile.sharding,
        lora_r=cfg.lora.r,
        lora_targets=targets,
        attention=cfg.attention,  # varlen / flash_attention_2: no row mask, no expanded k/v
        packed=True,  # fineflow's shards always pack examples into rows
        loss_chunk_tokens=cfg.loss_chunk_tokens,
    )
