"""The training recipe, read in order: what the launcher does, then what each rank does.

``launch_ranks`` sizes the run with the memory planner (``fineflow.train.sizing``: refuse, or adapt with
``train.auto_fit``) and re-executes the stage entry under ``accelerate launch`` on ``train.num_processes``
ranks (``fineflow.train.launch``). Each rank runs ``train_rank``: build the model (``fineflow.train.model``),
decide whether to resume (``fineflow.train.resume``), run ``fit()`` (``fineflow.train.loop``) with a
checkpoint manager (``fineflow.checkpoint``), save the model. Only rank 0 writes.
"""

from __future__ import annotations

import os
from pathlib import Path

from fineflow.core.config import Params, TrainParams
from fineflow.core.journal import process_started
from fineflow.model_ref import resolve_base_model
from fineflow.train import flops, gradsync
from fineflow.train.fsdp import prepare_model_for_fsdp, require_visible_to_every_rank
from fineflow.train.launch import (
    accelerate_command,
    check_deepspeed_profile,
    configure_deepspeed,
    require_engine,
    require_tracker,
    resolve_profile,
)
from fineflow.train.model import build_model, save_model
from fineflow.train.preempt import run_ranks
from fineflow.train.sizing import GiB, check_hardware, fit_plan, sharding_of, world_size


def launch_ranks(params: Params, module: str, argv: list[str], placement: dict, log=print) -> int:
    """Size the run, then run ``python -m <module> <argv>`` under accelerate launch on the configured ranks;
    returns the launch's exit code."""
    import torch

    has_gpu = torch.cuda.is_available()
    cfg = params.train
    profile = resolve_profile(cfg.accelerate_profile)
    require_engine(profile)  # a DeepSpeed profile without deepspeed: one message before anything loads
    require_tracker(cfg.tracker)
    check_hardware(cfg, has_gpu)
    planned, plan, changes = fit_plan(params, resolve_base_model(params.model, Path(placement["base_dir"])), has_gpu)
    check_deepspeed_profile(profile, planned, world_size(planned, profile))  # params vs profile, before any rank
    gib = plan["gib"]
    log(
        f"memory plan per device: weights {gib['weights']:.2f} GiB, gradients {gib['gradients']:.2f}, "
        f"optimizer {gib['optimizer_states']:.2f}, activations {gib['activations']:.2f}, overhead "
        f"{gib['overhead']:.2f} = {gib['total']:.2f} GiB of {plan['device_bytes'] / GiB:.1f} GiB"
        + ("; auto_fit: " + "; ".join(changes) if changes else "")
    )
    command, env = accelerate_command(
        cfg.num_processes,
        has_gpu,
        module,
        argv,
        placement["main_process_port"],
        config_file=profile,
        num_machines=cfg.num_machines if cfg.num_machines > 1 or profile is None else None,
        machine_rank=placement["machine_rank"],
        main_process_ip=placement["main_process_ip"],
    )
    log(f"launching: {' '.join(command[2:])}")
    # its own process group: a stop signal reaches the ranks once, forwarded (fineflow.train.preempt)
    return run_ranks(command, {**os.environ, **env}, params.checkpoint.preempt_grace_s, log)


TRACKER_RUN_FILE = "tracker_run.txt"  # in a checkpoint run directory: the tracker run its attempts log to


def tracker_run_name(run_dir: Path, resuming: bool) -> str:
    """Each training run its own tracker run, so curves of different runs never mix: the time it started and
    the flow run's name (FINEFLOW_RUN_NAME; "dvc-repro" outside a flow). Kept in the checkpoint run directory,
    so a resumed run goes on in its own curves (a finished run trained again starts a new one)."""
    import re
    import time

    from fineflow.core.reports import write_text_atomic
    from fineflow.core.runtime import RUN_NAME_ENV

    path = Path(run_dir) / TRACKER_RUN_FILE
    if resuming and path.is_file():
        return path.read_text(encoding="utf-8").strip()
    label = re.sub(r"[^A-Za-z0-9._+-]+", "-", os.environ.get(RUN_NAME_ENV) or "dvc-repro").strip("-")
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{label}"
    write_text_atomic(path, name + "\n")
    return name


def init_tracker(accelerator, params: Params, cfg: TrainParams, run_dir: Path, start_step: int = 0) -> None:
    """accelerate's tracker, one run per training run (tracker_run_name): TensorBoard under
    logs/fineflow/<run>, MLflow as run <run> of experiment fineflow. After a resume from step N, TensorBoard
    purges the events a crashed attempt logged after N, so no step appears twice in the curves."""
    if cfg.tracker == "none":
        return
    name = tracker_run_name(run_dir, resuming=start_step > 0)
    flat = {f"train.{k}": v for k, v in cfg.model_dump().items() if isinstance(v, (int, float, str, bool))}
    init_kwargs = {"tensorboard": {"purge_step": start_step + 1}} if start_step else {}
    init_kwargs["mlflow"] = {"run_name": name}
    accelerator.init_trackers(
        f"fineflow/{name}" if cfg.tracker == "tensorboard" else "fineflow",
        config={**flat, "seed": params.seed, "tokenize.seq_len": params.tokenize.seq_len},
        init_kwargs=init_kwargs,
    )


def resume_point(accelerator, checkpoints: Path, fingerprint: dict, mode: str):
    """(run directory, loaded checkpoint or None): rank 0 decides, every rank loads the same one."""
    from fineflow.checkpoint import load_checkpoint
    from fineflow.train.resume import ResumePlan, plan_resume, run_id

    decision = [None]
    if accelerator.is_main_process:
        plan = plan_resume(checkpoints, fingerprint, mode)
        decision = [str(plan.checkpoint) if plan.checkpoint else None]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        decision = broadcast_object_list(decision)
    plan = ResumePlan(checkpoints / run_id(fingerprint), Path(decision[0]) if decision[0] else None)
    if plan.checkpoint is not None:  # every rank loads it from its own mount: node-local dirs are refused
        require_visible_to_every_rank(accelerator, plan.checkpoint, "resume from")
    # latest_valid (rank 0) just hashed every file of it: load without hashing it all again
    return plan.run_dir, (load_checkpoint(plan.checkpoint, verify=False) if plan.checkpoint else None)


def train_rank(
    params: Params,
    shards: Path,
    base_dir: Path,
    checkpoints: Path,
    out_dir: Path,
    steps_log: Path,
    logs_dir: Path | None = None,
    log=print,
    hash_cache: Path | None = None,
) -> dict | None:
    """One rank of training; returns the report on rank 0 and None elsewhere. hash_cache: where the base
    weights' content hashes are cached (by path, size and mtime); None hashes them every run.

    Its phases are timed for the goodput ledger (fineflow.goodput.ledger): model load, set-up, a resume's
    checkpoint load, the loop (fineflow.train.loop.StepTimer), the final save."""
    import time

    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from fineflow.checkpoint import CheckpointManager
    from fineflow.tokenize.shards import PackedShard, RowSampler
    from fineflow.train.loader import BatchLoader
    from fineflow.train.loop import Progress, StepLog, StepTimer, TrainStateSaver, fit, restore
    from fineflow.train.resume import mark_finished, run_fingerprint
    from fineflow.train.schedule import build_scheduler

    entered = time.time()
    phases = {"model_load_s": 0.0, "resume_load_s": 0.0}
    has_gpu = torch.cuda.is_available()
    check_hardware(params.train, has_gpu)
    reference = resolve_base_model(params.model, base_dir)
    # cfg.precision comes back resolved (train.precision "auto" -> the profile's or the device's; see
    # fineflow.train.precision): the one value the Accelerator, build_model and the report use
    cfg, plan, changes = fit_plan(params, reference, has_gpu)
    if plan["precision"]["conflict"] and os.environ.get("RANK", "0") == "0":
        log(f"precision: {plan['precision']['conflict']}")
    tracker = None if cfg.tracker == "none" else cfg.tracker
    accelerator = Accelerator(
        mixed_precision=cfg.precision,
        # fit() accumulates through accelerate: under DeepSpeed the engine steps on the last micro-batch only
        gradient_accumulation_steps=cfg.grad_accum,
        log_with=tracker,
        project_dir=str(logs_dir or Path("logs")),
    )
    configure_deepspeed(accelerator, cfg)  # DeepSpeed: batch sizes and clipping from params, before prepare
    set_seed(params.seed)
    # ZeRO-3 gathers each module's parameters in that module's own forward hook: leave peft's forward there
    import peft  # noqa: F401 - imported here, not inside the model-load timer: imports are start-up
    import transformers  # noqa: F401

    loading = time.perf_counter()
    model = build_model(
        reference,
        params,
        cfg,
        fuse_lora=cfg.fused_lora and sharding_of(resolve_profile(cfg.accelerate_profile)) != "zero3",
    )
    phases["model_load_s"] = time.perf_counter() - loading
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fused_layers = getattr(model, "fineflow_fused_layers", 0)
    # fused: one kernel per parameter instead of ~10 small ops each (CPU and CUDA; 3.9 -> 2.4 ms/step here)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True
    )
    # The scheduler is deliberately not passed through accelerator.prepare: accelerate steps a prepared
    # scheduler once per process on every optimizer step, so N ranks would run the schedule N times faster
    # (warmup over after 1/N of its steps, the decay finished at 1/N of the run). Stepped by fit() once per
    # optimizer step, every world size follows the same schedule.
    scheduler = build_scheduler(optimizer, cfg)
    fused_layers = prepare_model_for_fsdp(accelerator, model, fused_layers)  # LoRA wrapping, fp32 buffers
    model, optimizer = accelerator.prepare(model, optimizer)
    grad_sync_measured = gradsync.register(model)  # DDP: the all-reduce timed apart from backward
    train, evaluation = PackedShard(shards / "train"), PackedShard(shards / "eval")
    sampler = RowSampler(
        len(train), params.seed, accelerator.process_index, accelerator.num_processes, row_tokens=train.real_per_row
    )
    fingerprint = [None]
    if accelerator.is_main_process:  # hashes the base weights (cached in hash_cache): once, not per rank
        fingerprint = [run_fingerprint(params, reference, train.meta, accelerator.num_processes, hash_cache, train=cfg)]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        fingerprint = broadcast_object_list(fingerprint)
    fingerprint = fingerprint[0]
    resuming = time.perf_counter()
    run_dir, resumed = resume_point(accelerator, checkpoints, fingerprint, cfg.resume)
    start_step, tokens_seen = 0, 0
    if resumed is not None:  # weights, optimizer, schedule, RNG and the sampler's position: no replay
        restore(resumed, accelerator, model, optimizer, scheduler)
        sampler.load_state_dict(resumed.state["sampler"])
        start_step, tokens_seen = resumed.state["step"], resumed.state["tokens_seen"]
        phases["resume_load_s"] = time.perf_counter() - resuming  # a cost of the restart
    batches = BatchLoader(
        train,
        sampler,
        cfg.micro_batch_size,
        cfg.grad_accum,
        cfg.steps - start_step,
        prefetch=cfg.prefetch,
        pin_memory=accelerator.device.type == "cuda",
        varlen=cfg.attention == "varlen",
    )
    main = accelerator.is_main_process
    ck = params.checkpoint
    manager = (
        CheckpointManager(
            run_dir,
            keep_last=ck.keep_last,
            keep_best=ck.keep_best,
            mode=ck.mode,
            async_backend=ck.backend,
            on_write_error=ck.on_write_error,
            retries=ck.retries,
        )
        if main
        else None
    )
    if main:
        if resumed is not None:
            manager.protect(resumed.path)
            log(f"resuming from {resumed.path} (step {start_step} of {cfg.steps})")
        init_tracker(accelerator, params, cfg, run_dir, start_step)
        log(
            f"training {cfg.method}"
            + (f" r={cfg.lora.r}" if cfg.method != "full" else "")
            + f": {trainable:,} trainable parameters on {accelerator.num_processes} process(es), device "
            f"{accelerator.device}, precision {cfg.precision}, attention {cfg.attention}, {fused_layers} fused LoRA "
            f"layers, planned peak {plan['gib']['total']:.2f} GiB per device"
        )
        for change in changes:
            log(f"auto_fit: {change}")
    timer = StepTimer()
    step_log = StepLog(steps_log if main else None, resume_after=start_step)
    progress = Progress(cfg.steps, cfg.log_every, log, start=start_step) if main else None
    loop_started = time.time()
    try:
        result = fit(
            model,
            optimizer,
            scheduler,
            accelerator,
            batches,
            cfg,
            timer,
            step_log,
            TrainStateSaver(manager, ck.every_steps, ck.every_minutes, fingerprint),
            evaluation,
            progress,
            start_step=start_step,
            tokens_seen=tokens_seen,
            redo_through=step_log.dropped_through if main else 0,
        )
        if manager is not None:
            manager.close()  # the last save is complete and verified before the stage reports success
    finally:
        batches.close()
        step_log.close()
        if progress is not None:
            progress.close()
    accelerator.wait_for_everyone()
    save_model(accelerator, model, out_dir, cfg.method)
    if main:
        mark_finished(run_dir, cfg.steps)  # a later run of the same inputs trains again, never resumes this one
    accelerator.end_training()
    if not main:
        return None
    write_s = manager.last_result.get("write_s", 0.0) if manager.last_result else None
    report = train_report(result, cfg, plan, tokens_seen, accelerator.num_processes, trainable, fused_layers, write_s)
    probe_started = time.time()
    try:  # the ledger's facts: a finished training never fails on them
        report["device"] = device_facts(accelerator, cfg)
        report["flops"] = run_flops(reference, cfg, train, report, accelerator)
    except Exception as exc:  # noqa: BLE001
        report.setdefault("device", {"type": accelerator.device.type, "count": accelerator.num_processes})
        report["flops"] = {"error": f"{type(exc).__name__}: {exc}"}
    report["grad_sync_measured"] = grad_sync_measured
    finished = time.time()
    # the device probe (a CPU's matmul rates, ~0.5-1 s) is measuring the run, not saving it
    phases["probe_s"] = finished - probe_started
    phases["setup_s"] = loop_started - entered - phases["model_load_s"] - phases["resume_load_s"]
    phases["save_s"] = probe_started - loop_started - result.wall_s
    report["phases"] = {key: round(value, 4) for key, value in phases.items()}
    report["timeline"] = {
        "proc_start": process_started(),
        "entry": entered,
        "loop_start": loop_started,
        "done": finished,
    }
    return report


def device_facts(accelerator, cfg: TrainParams) -> dict:
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
    }


def run_flops(reference: str, cfg: TrainParams, shard, report: dict, accelerator) -> dict:
    """Model and hardware FLOPs per token, the device's peak and the run's MFU/HFU (fineflow.goodput.flops).
    The attended length is the mean packed example's half (varlen) or the row's half (dense sdpa, for HFU)."""
    from fineflow.train.planner import load_shape

    try:
        shape = load_shape(reference)
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
        **flops.utilization(per_token, report.get("tokens_per_s"), peak, accelerator.num_processes),
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
