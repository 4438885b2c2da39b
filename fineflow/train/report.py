"""The train stage's report (reports/train.json): what ran, how fast, where the time went, the device, the
FLOPs and the memory plan. The goodput ledger (fineflow.goodput.ledger), the model card and the tests read it."""

from __future__ import annotations

from fineflow.core.train_config import TrainParams
from fineflow.objectives import objective_for
from fineflow.train import flops


def device_facts(accelerator, cfg: TrainParams, runnable: dict | None = None) -> dict:
    """What the doctor and the cost need to know of the device: its type and name, how many trained, whether it
    does bf16 fast and by how much (fineflow.train.flops.bf16_facts; the speed-up measured only for a run in
    fp32, the one the doctor judges), the precision it trained in."""
    import platform

    import torch

    device = accelerator.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    return {
        "type": device.type,
        "name": name,
        "count": accelerator.num_processes,
        **flops.bf16_facts(device.type, name, measure=cfg.precision == "no"),
        "precision": cfg.precision,
        "cpu": cpu_facts(accelerator.num_processes, runnable),
    }


def cpu_facts(ranks: int, runnable: dict | None = None) -> dict:
    """The doctor's oversubscription evidence: the usable CPUs, this machine's ranks x their torch threads, the
    1-minute load average as training ends, the runnable threads then and, sampled during the loop, the
    machine's runnable threads (fineflow.core.threads.RunnableSampler)."""
    import os

    import torch

    from fineflow.core.threads import runnable_threads, usable_cpus

    runnable_now = runnable_threads()
    return {
        "cores": usable_cpus(),
        "local_ranks": int(os.environ.get("LOCAL_WORLD_SIZE") or ranks),  # torchrun's, under accelerate launch
        "threads_per_rank": torch.get_num_threads(),
        "load_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "runnable": runnable_now,
        "runnable_during": runnable,
    }


def run_flops(base: str, cfg: TrainParams, shard, report: dict, accelerator) -> dict:
    """Model and hardware FLOPs per token, the device's peak and the run's MFU/HFU (fineflow.goodput.flops).
    The attended length is the mean packed example's half (varlen) or the row's half (dense sdpa, for HFU)."""
    from fineflow.train.planner import load_shape

    try:
        shape = load_shape(base)
    except Exception as exc:  # noqa: BLE001 - a model the planner cannot read: no MFU, the run is still good
        return {"error": f"no FLOPs: {type(exc).__name__}: {exc}"}
    matmul = shape.params - (0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size)
    examples = max(1, int(shard.meta.get("examples", 1)))
    mean_example = float(sum(shard.real_per_row)) / examples
    per_token = flops.flops_per_token(
        matmul,
        report["trainable_parameters"],
        cfg.method,
        shape.num_layers,
        shape.q_dim,
        mean_example / 2,
        recompute=cfg.gradient_checkpointing,
    )
    if cfg.attention == "sdpa":  # the dense kernel computes every (masked) score of the row
        dense = flops.flops_per_token(
            matmul,
            report["trainable_parameters"],
            cfg.method,
            shape.num_layers,
            shape.q_dim,
            shard.meta["seq_len"] / 2,
            recompute=cfg.gradient_checkpointing,
        )
        per_token["hardware"] = dense["hardware"]
    device = report["device"]
    peak = flops.peak_flops(device["type"], device["name"], cfg.precision)
    return {
        "model_per_token": round(per_token["model"]),
        "hardware_per_token": round(per_token["hardware"]),
        "peak_per_device": peak["flops_per_s"],
        "peak_source": peak["source"],
        "peak_spread": peak.get("spread"),  # the CPU probe's (None: the table's figure)
        **flops.utilization(per_token, report.get("tokens_per_s"), peak, accelerator.num_processes),
    }


def preference_figures(result, cfg: TrainParams) -> dict:
    """train.objective dpo / simpo: the objective and the last step's reward accuracy and margin over its pairs
    (final_loss and eval_loss are then mean pair losses); an online objective (grpo): the last step's rollout
    figures; nothing for sft."""
    objective = objective_for(cfg.objective)
    if objective.online:
        last = {f"final_{k}": v for k, v in (result.rollout or {}).items()}
        return {"objective": cfg.objective, **last, "rollouts": result.rollout_totals}
    if not objective.pair_shards:
        return {}
    accuracy, margin = result.rewards if result.rewards is not None else (None, None)
    return {
        "objective": cfg.objective,
        "final_reward_accuracy": round(accuracy, 5) if accuracy is not None else None,
        "final_reward_margin": round(margin, 5) if margin is not None else None,
    }


def train_report(
    result,
    cfg: TrainParams,
    plan: dict,
    tokens_before: int,
    world_size: int,
    trainable: int,
    fused_layers: int,
    checkpoint_write_s: float | None,
) -> dict:
    """The train stage's report: what ran, how fast, where the time went, and the memory plan.

    tokens: the run's total; tokens/s: this attempt's own steps (a resumed attempt did not train the earlier
    ones; one resumed at its last step trained none: null)."""
    totals = result.timer.totals
    trained_now = result.steps > result.resumed_from
    return {
        "steps": result.steps,
        "resumed_from_step": result.resumed_from,
        "method": cfg.method,
        "precision": cfg.precision,
        "attention": cfg.attention,
        "fused_lora_layers": fused_layers,
        "final_loss": round(result.final_loss, 5),
        "eval_loss": round(result.eval_loss, 5) if result.eval_loss is not None else None,
        **preference_figures(result, cfg),
        "tokens": result.tokens,
        "tokens_this_attempt": result.tokens - tokens_before,
        "tokens_per_s": (round((result.tokens - tokens_before) / max(result.wall_s, 1e-9), 1) if trained_now else None),
        "world_size": world_size,
        "trainable_parameters": trainable,
        "micro_batch_size": cfg.micro_batch_size,
        "grad_accum": cfg.grad_accum,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "loop_s": round(result.wall_s, 3),
        **{k: round(v, 3) for k, v in totals.items()},
        "loop_totals": {k: round(v, 4) for k, v in totals.items()},  # the goodput ledger's split of loop_s
        "data_wait_share": round(totals["data_wait_s"] / max(result.wall_s, 1e-9), 5),
        # steps trained again after a resume (a crashed attempt had trained them past its last checkpoint)
        "recomputed_steps": result.timer.redo_steps,
        "recomputed": {k: round(v, 3) for k, v in result.timer.redo.items()},
        "checkpoint_write_s": round(checkpoint_write_s, 3) if checkpoint_write_s is not None else None,
        "peak_mem_mb": round(result.peak_mem_mb, 1),
        "plan": plan,
    }
