"""Stage train: fine-tuning (LoRA, QLoRA or full) of the base model on the packed shards, under accelerate.

    python -m fineflow.stages.train --shards data/shards --base-dir models/base \
        --checkpoints checkpoints --out models/candidate --steps-log reports/train_steps.jsonl

Run plainly, this process is the launcher: it sizes the run with the memory planner (fineflow.planner;
``train.auto_fit`` adapts a plan that does not fit, otherwise it refuses with what to change), then
re-executes the same module under ``accelerate launch`` with ``train.accelerate_profile`` /
``train.num_processes`` ranks (see fineflow.launch). Each rank then runs ``worker()``; only rank 0 writes
the model, checkpoints, step log and report. On a cluster, run it once per machine with
``--machine-rank N --main-process-ip <machine 0> [--main-process-port P]`` (``train.num_machines`` > 1).
"""

from __future__ import annotations

import errno
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

from fineflow.basemodel import resolve_base_model
from fineflow.config import Params, TrainParams
from fineflow.errors import FineflowError
from fineflow.launch import WORKER_ENV, accelerate_command, read_profile, resolve_profile
from fineflow.stages._entry import log, run_stage, stage_parser

GiB = 2**30
PRECISION_OF = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def check_hardware(cfg: TrainParams, has_gpu: bool) -> None:
    """Settings this machine cannot run, said before anything is loaded."""
    if cfg.method == "qlora" and not has_gpu:
        raise FineflowError("params.yaml: train.method is qlora, which quantizes the base model to 4 bits with "
                            "bitsandbytes and needs a CUDA GPU; this machine has none. Use train.method: lora "
                            "(the same adapter on a 16/32-bit base) or run on a GPU machine.")
    if cfg.precision == "fp16" and not has_gpu:
        raise FineflowError("params.yaml: train.precision fp16 needs a CUDA GPU (loss scaling); on CPU use "
                            "train.precision: bf16 or no.")
    if cfg.attention == "flash_attention_2":
        from importlib.util import find_spec

        if not has_gpu or find_spec("flash_attn") is None:
            raise FineflowError("params.yaml: train.attention flash_attention_2 needs a CUDA GPU and the flash-attn "
                                "package (pip install flash-attn); train.attention: varlen does the same per-example "
                                "attention on any device.")


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
    from fineflow import planner

    if Path(reference).exists():
        return planner.load_shape(reference)
    from transformers import AutoConfig  # a hub id: its config from the local cache (offline)

    return planner.shape_from_config(AutoConfig.from_pretrained(reference).to_dict(), name=reference)


def fit_plan(params: Params, reference: str, has_gpu: bool):
    """The planner's verdict for this run: (train params to run with, plan dict, changes made).

    Pure in its inputs, so the launcher (which refuses before launching) and every rank (which applies
    the adapted settings) reach the same answer without passing it around."""
    from fineflow import planner

    cfg = params.train
    profile = resolve_profile(cfg.accelerate_profile)
    ranks = world_size(cfg, profile)
    targets = tuple(t for t in cfg.lora.target_modules if t in planner.LINEARS) or planner.LINEARS
    setup = planner.Setup(method=cfg.method, precision=PRECISION_OF[cfg.precision], optimizer="adamw",
                          micro_batch_size=cfg.micro_batch_size, seq_len=params.tokenize.seq_len,
                          grad_accum=cfg.grad_accum, gradient_checkpointing=cfg.gradient_checkpointing,
                          num_gpus=ranks, sharding=sharding_of(profile), lora_r=cfg.lora.r, lora_targets=targets)
    device = device_memory_bytes(cfg, has_gpu, max(1, ranks // cfg.num_machines))
    result = planner.check_fit(model_shape(reference), setup, device, adapt=cfg.auto_fit)
    adapted = cfg.model_copy(update={"micro_batch_size": result.setup.micro_batch_size,
                                     "grad_accum": result.setup.grad_accum,
                                     "gradient_checkpointing": result.setup.gradient_checkpointing})
    plan = {**result.plan.as_dict(), "device_bytes": int(device), "changes": result.changes}
    return adapted, plan, result.changes


def attention_of(cfg: TrainParams) -> str:
    """The attn_implementation to load the model with (registering fineflow's varlen one when chosen)."""
    if cfg.attention == "varlen":
        from fineflow.attention import register

        return register()
    return cfg.attention


def build_model(base_reference: str, params: Params, cfg: TrainParams, fuse_lora: bool = False):
    """The model to train: LoRA / QLoRA adapters on a frozen base, or the whole base (full). fuse_lora:
    route plain LoRA linears through fineflow.fused_lora (same maths, fewer memory passes)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(params.seed)
    kwargs = {"dtype": torch.float32}
    if cfg.method == "qlora":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise FineflowError("train.method qlora needs bitsandbytes: pip install bitsandbytes") from None
        from transformers import BitsAndBytesConfig

        kwargs = {"dtype": torch.bfloat16, "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)}
    model = AutoModelForCausalLM.from_pretrained(base_reference, attn_implementation=attention_of(cfg), **kwargs)
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name for it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.method == "full":
        return model
    from peft import LoraConfig, get_peft_model

    if cfg.method == "qlora":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing)
    lora = cfg.lora
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    if fuse_lora:
        from fineflow.fused_lora import fuse_lora_layers

        model.fineflow_fused_layers = fuse_lora_layers(model)
    return model


def save_model(accelerator, model, out_dir: Path, method: str) -> None:
    """Every rank calls this: under FSDP/ZeRO-3 gathering the full weights is a collective; rank 0 writes.
    LoRA/QLoRA save the adapter only; full fine-tuning a whole HF model directory (safetensors)."""
    from fineflow.training import save_adapter

    state = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return
    unwrapped = accelerator.unwrap_model(model)
    if method == "full":
        unwrapped.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    else:
        save_adapter(unwrapped, out_dir, state)


def init_tracker(accelerator, params: Params, cfg: TrainParams, start_step: int = 0) -> None:
    """accelerate's tracker; after a resume from step N, TensorBoard purges the events a crashed attempt
    logged after N, so no step appears twice in the curves."""
    if cfg.tracker == "none":
        return
    flat = {f"train.{k}": v for k, v in cfg.model_dump().items() if isinstance(v, (int, float, str, bool))}
    init_kwargs = {"tensorboard": {"purge_step": start_step + 1}} if start_step else {}
    accelerator.init_trackers("fineflow", config={**flat, "seed": params.seed,
                                                  "tokenize.seq_len": params.tokenize.seq_len},
                              init_kwargs=init_kwargs)


def _slow_write(delay_s: float, path, nbytes) -> None:
    time.sleep(delay_s)


def _disk_full_at(step: int, path, nbytes) -> None:
    if f"step-{step:07d}" in str(path):
        raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))


def fault_hook():
    """Fault injection for the kill -9 and disk-full tests, from the environment (never set in normal
    runs): FINEFLOW_FAULT_WRITE_DELAY_S slows every checkpoint write, so a kill can land mid-write;
    FINEFLOW_FAULT_DISK_FULL_AT_STEP makes the writer of that step's checkpoint hit ENOSPC."""
    if os.environ.get("FINEFLOW_FAULT_DISK_FULL_AT_STEP"):
        return functools.partial(_disk_full_at, int(os.environ["FINEFLOW_FAULT_DISK_FULL_AT_STEP"]))
    if os.environ.get("FINEFLOW_FAULT_WRITE_DELAY_S"):
        return functools.partial(_slow_write, float(os.environ["FINEFLOW_FAULT_WRITE_DELAY_S"]))
    return None


def resume_point(accelerator, checkpoints: Path, print_: dict, mode: str):
    """(run directory, loaded checkpoint or None): rank 0 decides, every rank loads the same one."""
    from fineflow.checkpoint import load_checkpoint
    from fineflow.resume import ResumePlan, plan_resume, run_id

    decision = [None]
    if accelerator.is_main_process:
        plan = plan_resume(checkpoints, print_, mode)
        decision = [str(plan.checkpoint) if plan.checkpoint else None]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        decision = broadcast_object_list(decision)
    plan = ResumePlan(checkpoints / run_id(print_), Path(decision[0]) if decision[0] else None)
    # latest_valid (rank 0) just hashed every file of it: load without hashing it all again
    return plan.run_dir, (load_checkpoint(plan.checkpoint, verify=False) if plan.checkpoint else None)


def worker(params: Params, shards: Path, base_dir: Path, checkpoints: Path, out_dir: Path,
           steps_log: Path, logs_dir: Path | None = None) -> dict | None:
    """One rank of training; returns the report on rank 0 and None elsewhere."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from fineflow.checkpoint import CheckpointManager
    from fineflow.loader import BatchLoader
    from fineflow.resume import fingerprint
    from fineflow.shards import PackedShard, RowSampler
    from fineflow.training import Checkpointer, Progress, StepLog, StepTimer, fit, lr_multiplier, restore

    has_gpu = torch.cuda.is_available()
    check_hardware(params.train, has_gpu)
    reference = resolve_base_model(params.model, base_dir)
    cfg, plan, changes = fit_plan(params, reference, has_gpu)
    tracker = None if cfg.tracker == "none" else cfg.tracker
    accelerator = Accelerator(mixed_precision=cfg.precision, log_with=tracker,
                              project_dir=str(logs_dir or Path("logs")))
    set_seed(params.seed)
    # ZeRO-3 gathers each module's parameters in that module's own forward hook: leave peft's forward there
    model = build_model(reference, params, cfg, fuse_lora=cfg.fused_lora and sharding_of(
        resolve_profile(cfg.accelerate_profile)) != "zero3")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fused_layers = getattr(model, "fineflow_fused_layers", 0)
    # fused: one kernel per parameter instead of ~10 small ops each (CPU and CUDA; 3.9 -> 2.4 ms/step here)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, cfg.warmup_steps, cfg.steps, cfg.schedule))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    train, evaluation = PackedShard(shards / "train"), PackedShard(shards / "eval")
    sampler = RowSampler(len(train), params.seed, accelerator.process_index, accelerator.num_processes,
                         row_tokens=train.real_per_row)
    print_ = fingerprint(params, reference, train.meta, accelerator.num_processes)
    run_dir, resumed = resume_point(accelerator, checkpoints, print_, cfg.resume)
    start_step, tokens_seen = 0, 0
    if resumed is not None:  # weights, optimizer, schedule, RNG and the sampler's position: no replay
        restore(resumed, accelerator, model, optimizer, scheduler)
        sampler.load_state_dict(resumed.state["sampler"])
        start_step, tokens_seen = resumed.state["step"], resumed.state["tokens_seen"]
    batches = BatchLoader(train, sampler, cfg.micro_batch_size, cfg.grad_accum, cfg.steps - start_step,
                          prefetch=cfg.prefetch, pin_memory=accelerator.device.type == "cuda",
                          varlen=cfg.attention == "varlen")
    main = accelerator.is_main_process
    ck = params.checkpoint
    manager = CheckpointManager(run_dir, keep_last=ck.keep_last, keep_best=ck.keep_best, mode=ck.mode,
                                async_backend=ck.backend, on_write_error=ck.on_write_error, retries=ck.retries,
                                write_hook=fault_hook()) if main else None
    if main:
        if resumed is not None:
            manager.protect(resumed.path)
            log(f"resuming from {resumed.path} (step {start_step} of {cfg.steps})")
        init_tracker(accelerator, params, cfg, start_step)
        log(f"training {cfg.method}" + (f" r={cfg.lora.r}" if cfg.method != "full" else "")
            + f": {trainable:,} trainable parameters on {accelerator.num_processes} process(es), device "
              f"{accelerator.device}, precision {cfg.precision}, attention {cfg.attention}, {fused_layers} fused LoRA "
              f"layers, planned peak {plan['gib']['total']:.2f} GiB per device")
        for change in changes:
            log(f"auto_fit: {change}")
    timer = StepTimer()
    step_log = StepLog(steps_log if main else None, resume_after=start_step)
    progress = Progress(cfg.steps, cfg.log_every, log, start=start_step) if main else None
    try:
        result = fit(model, optimizer, scheduler, accelerator, batches, cfg, timer, step_log,
                     Checkpointer(manager, ck.every_steps, ck.every_minutes, print_), evaluation, progress,
                     start_step=start_step, tokens_seen=tokens_seen)
        if manager is not None:
            manager.close()  # the last save is complete and verified before the stage reports success
    finally:
        batches.close()
        step_log.close()
        if progress is not None:
            progress.close()
    accelerator.wait_for_everyone()
    save_model(accelerator, model, out_dir, cfg.method)
    accelerator.end_training()
    if not main:
        return None
    totals = result.timer.totals
    return {"steps": result.steps, "resumed_from_step": result.resumed_from, "method": cfg.method,
            "precision": cfg.precision, "attention": cfg.attention, "fused_lora_layers": fused_layers,
            "final_loss": round(result.final_loss, 5),
            "eval_loss": round(result.eval_loss, 5) if result.eval_loss is not None else None,
            # tokens: the run's total; tokens/s: this attempt's own steps (a resumed attempt did not train
            # the earlier ones; one resumed at its last step trained none: null)
            "tokens": result.tokens, "tokens_this_attempt": result.tokens - tokens_seen,
            "tokens_per_s": (round((result.tokens - tokens_seen) / max(result.wall_s, 1e-9), 1)
                             if result.steps > result.resumed_from else None),
            "world_size": accelerator.num_processes, "trainable_parameters": trainable,
            "micro_batch_size": cfg.micro_batch_size, "grad_accum": cfg.grad_accum,
            "gradient_checkpointing": cfg.gradient_checkpointing,
            "loop_s": round(result.wall_s, 3), **{k: round(v, 3) for k, v in totals.items()},
            "data_wait_share": round(totals["data_wait_s"] / max(result.wall_s, 1e-9), 5),
            "checkpoint_write_s": round(manager.last_result.get("write_s", 0.0), 3)
            if manager is not None and manager.last_result else None,
            "peak_mem_mb": round(result.peak_mem_mb, 1), "plan": plan}


def launch(params: Params, argv: list[str], placement: dict) -> int:
    """Size the run, then re-run this module under accelerate launch on the configured ranks."""
    import torch

    has_gpu = torch.cuda.is_available()
    cfg = params.train
    check_hardware(cfg, has_gpu)
    _, plan, changes = fit_plan(params, resolve_base_model(params.model, Path(placement["base_dir"])), has_gpu)
    gib = plan["gib"]
    log(f"memory plan per device: weights {gib['weights']:.2f} GiB, gradients {gib['gradients']:.2f}, "
        f"optimizer {gib['optimizer_states']:.2f}, activations {gib['activations']:.2f}, overhead "
        f"{gib['overhead']:.2f} = {gib['total']:.2f} GiB of {plan['device_bytes'] / GiB:.1f} GiB"
        + ("; auto_fit: " + "; ".join(changes) if changes else ""))
    profile = resolve_profile(cfg.accelerate_profile)
    command, env = accelerate_command(
        cfg.num_processes, has_gpu, "fineflow.stages.train", argv, placement["main_process_port"],
        config_file=profile, num_machines=cfg.num_machines if cfg.num_machines > 1 or profile is None else None,
        machine_rank=placement["machine_rank"], main_process_ip=placement["main_process_ip"])
    log(f"launching: {' '.join(command[2:])}")
    return subprocess.run(command, env={**os.environ, **env}).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = stage_parser("train", __doc__)
    parser.add_argument("--shards", type=Path, required=True)
    parser.add_argument("--base-dir", type=Path, required=True)
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps-log", type=Path, required=True)
    parser.add_argument("--logs-dir", type=Path, default=Path("logs"), help="tracker logs (TensorBoard, MLflow)")
    parser.add_argument("--machine-rank", type=int, default=None, help="this machine's rank (num_machines > 1)")
    parser.add_argument("--main-process-ip", default=None, help="machine 0's address (num_machines > 1)")
    parser.add_argument("--main-process-port", type=int, default=None)
    args = parser.parse_args(argv)
    if os.environ.get(WORKER_ENV) != "1":
        from fineflow.config import load_params

        try:
            params = load_params(args.params)
            return launch(params, argv, {"base_dir": args.base_dir, "machine_rank": args.machine_rank,
                                         "main_process_ip": args.main_process_ip,
                                         "main_process_port": args.main_process_port})
        except FineflowError as exc:
            print(f"fineflow train: error: {exc}", file=sys.stderr)
            return 2
    return run_stage("train", args, lambda p: worker(p, args.shards, args.base_dir, args.checkpoints,
                                                      args.out, args.steps_log, args.logs_dir))


if __name__ == "__main__":
    raise SystemExit(main())
