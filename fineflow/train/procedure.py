"""The training procedure, read in order: what the launcher does, then what each rank does.

``launch_ranks`` decides once (the accelerate profile, ``fineflow.train.profile``; the memory planner's verdict,
``fineflow.train.run_plan``: refuse, or adapt with ``train.auto_fit``) and re-executes the stage entry under
``accelerate launch`` on ``train.num_processes`` ranks (``fineflow.train.launch``). Each rank runs
``train_rank``, a ``TrainProcedure``: ``setup()`` (one ``_setup_*`` per concern: the plan, the accelerator, model
and optimizer and schedule, the data, the resume, checkpointing, the tracker), ``train()`` (``fit()``,
``fineflow.train.loop``), ``cleanup()`` (the model saved, the run marked finished) and ``report()``
(``fineflow.train.report``). Only rank 0 writes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from fineflow.base_source import resolve_base_model
from fineflow.core.config import Params
from fineflow.core.journal import process_started
from fineflow.core.threads import RunnableSampler, plan_threads
from fineflow.objectives import objective_for
from fineflow.process.preempt import run_ranks
from fineflow.train import gradsync
from fineflow.train.fsdp import prepare_model_for_fsdp
from fineflow.train.launch import (
    WORKER_ENV,
    accelerate_command,
    check_deepspeed_profile,
    configure_deepspeed,
    require_engine,
    require_enough_gpus,
    require_gpu,
    require_tracker,
    with_profile_processes,
)
from fineflow.train.model import build_model, save_model
from fineflow.train.profile import load_profile
from fineflow.train.report import device_facts, run_flops, train_report
from fineflow.train.run_plan import GiB, RunPlan, check_hardware, fit_plan, given_plan, world_size


def launch_ranks(
    params: Params, module: str, argv: list[str], placement: dict, log=print, spans: dict | None = None
) -> int:
    """Size the run, then run ``python -m <module> <argv>`` under accelerate launch on the configured ranks (or
    on train.launcher's cluster engine, which adds its time to spans); returns the launch's exit code."""
    import torch

    has_gpu = torch.cuda.is_available()
    profile = load_profile(params.train.accelerate_profile)
    require_engine(profile)  # a DeepSpeed profile without deepspeed: one message before anything loads
    require_gpu(profile, has_gpu)  # a GPU profile where torch sees none: before the planner and any rank
    params = with_profile_processes(params, profile)  # unset: the profile's ranks
    require_enough_gpus(profile, params.train, torch.cuda.device_count() if has_gpu else 0)
    require_tracker(params.train.tracker)
    check_objective(params.train, profile)  # what the objective cannot train with, refused before any model loads
    check_hardware(params.train, has_gpu, profile)
    run = fit_plan(params, profile, resolve_base_model(params.model, Path(placement["base_dir"])), has_gpu)
    cfg = run.train
    check_deepspeed_profile(profile, cfg, world_size(cfg, profile))  # params vs profile, before any rank
    gib = run.memory["gib"]
    log(
        f"memory plan per device: weights {gib['weights']:.2f} GiB, gradients {gib['gradients']:.2f}, "
        f"optimizer {gib['optimizer_states']:.2f}, activations {gib['activations']:.2f}, overhead "
        f"{gib['overhead']:.2f} = {gib['total']:.2f} GiB of {run.memory['device_bytes'] / GiB:.1f} GiB"
        + ("; auto_fit: " + "; ".join(run.changes) if run.changes else "")
    )
    for warning in run.warnings:  # also in the train report's plan (memory["warnings"])
        log(f"WARNING: {warning}")
    if cfg.launcher != "local":  # a cluster engine places the ranks; this process drives and waits
        return run_cluster_job(run, profile, has_gpu, module, argv, log, spans)
    command, env = accelerate_command(
        cfg.num_processes,
        has_gpu,
        module,
        argv,
        placement["main_process_port"],
        profile=profile,
        num_machines=cfg.num_machines if cfg.num_machines > 1 or profile.path is None else None,
        machine_rank=placement["machine_rank"],
        main_process_ip=placement["main_process_ip"],
    )
    # decided here, once, for every rank of this machine (fineflow.core.threads); each rank follows and records it
    threads = plan_threads(cfg.num_processes // max(1, cfg.num_machines), cfg.threads)
    log(f"launching: {' '.join(command[2:])}; threads: {threads.describe()}")
    # its own process group: a stop signal reaches the ranks once, forwarded (fineflow.process.preempt)
    environ = {**os.environ, **env, **threads.child_environment(), **run.environment()}  # the ranks read both
    return run_ranks(command, environ, run.params.checkpoint.preempt_grace_s, log)


def run_cluster_job(run: RunPlan, profile, has_gpu: bool, module: str, argv: list[str], log=print, spans=None) -> int:
    """train.launcher ray or slurm: the same rank command, placed by the engine (fineflow.train.engines). The ranks
    get this launcher's plan (RunPlan.environment) as local ranks do, and do not plan again."""
    from fineflow.train.engines import RankJob, run_job

    cfg = run.train
    env = {WORKER_ENV: "1", **run.environment()} | ({} if has_gpu else {"ACCELERATE_USE_CPU": "1"})
    job = RankJob(
        module,
        argv,
        world_size(cfg, profile),
        cfg.num_machines,
        has_gpu,
        profile,
        run.params,
        run.params.checkpoint.preempt_grace_s,
        env,
    )
    return run_job(cfg.launcher, job, log, spans)


@dataclass(frozen=True)
class RankPaths:
    """Where a rank reads and writes: the shards and base model in; checkpoints, the model, the step log and the
    tracker's logs out. hash_cache: where the base weights' content hashes are cached (None: hashed every run);
    reference: the reference_logps stage's output (train.objective dpo reads it)."""

    shards: Path
    base_dir: Path
    checkpoints: Path
    out_dir: Path
    steps_log: Path
    logs_dir: Path | None = None
    hash_cache: Path | None = None
    reference: Path | None = None


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
    reference: Path | None = None,
) -> dict | None:
    """One rank of training; returns the report on rank 0 and None elsewhere."""
    paths = RankPaths(shards, base_dir, checkpoints, out_dir, steps_log, logs_dir, hash_cache, reference)
    procedure = TrainProcedure(params, paths, log)
    procedure.setup()
    result = procedure.train()
    procedure.cleanup()
    return procedure.report(result)


def check_objective(cfg, profile) -> None:
    """The objective's own refusals of this run configuration, and an online objective's rewards built (every bad
    entry named at once) and closed again."""
    objective = objective_for(cfg.objective)
    objective.check_run(cfg, profile)
    if objective.online:
        from fineflow.train.rollouts import built_rewards

        built_rewards(cfg).close()


def import_training_modules() -> None:
    """What a rank imports before its entry (the libraries and fineflow's training modules)."""
    import torch  # noqa: F401
    from accelerate import Accelerator  # noqa: F401

    import fineflow.checkpoint  # noqa: F401
    import fineflow.tokenize.shards  # noqa: F401
    from fineflow.train import checkpointing, loader, loop, resume, schedule, steps  # noqa: F401


class TrainProcedure:
    """One rank's training, read in order: setup() -> train() -> cleanup() -> report().

    Its phases are timed for the goodput ledger (fineflow.goodput.ledger): model load, set-up, a resume's
    checkpoint load, the loop (its spans: fineflow.train.steps.StepTimer), the final save. From _setup_plan on,
    ``self.run`` is the one configuration every step reads: ``self.params`` becomes its params (the planner's
    adaptations applied), ``self.cfg`` its train settings; the params the rank was given are not kept."""

    def __init__(self, params: Params, paths: RankPaths, log=print):
        self.params, self.paths, self.log = params, paths, log
        self.phases = {"model_load_s": 0.0, "resume_load_s": 0.0}

    def setup(self) -> None:
        import_training_modules()  # imports are the rank's start-up, before its entry (the ledger's rank_startup)
        self.entered = time.time()
        self._setup_plan()
        self._setup_accelerator()
        self._setup_reference()
        self._setup_rollouts()  # before the model loads: a bad reward is named first
        self._setup_model()
        self._setup_data()
        self._setup_resume()
        self._setup_loader()
        self._setup_checkpointing()
        self._setup_tracker()

    def _setup_plan(self) -> None:
        """The launcher's plan (fineflow.train.run_plan.given_plan: the profile, the hardware check and the planner's
        configuration, decided once before any rank started); planned here only for a rank started otherwise."""
        import torch

        run = given_plan(os.environ)
        if run is None:  # in-process or by hand: the same pure planning the launcher does
            params = self.params  # as given: replaced by the plan's below
            has_gpu = torch.cuda.is_available()
            profile = load_profile(params.train.accelerate_profile)
            params = with_profile_processes(params, profile)  # as the launcher's
            check_hardware(params.train, has_gpu, profile)
            run = fit_plan(params, profile, resolve_base_model(params.model, self.paths.base_dir), has_gpu)
        self.base_source = resolve_base_model(run.params.model, self.paths.base_dir)
        # train.precision comes back resolved ("auto" -> the profile's or the device's; fineflow.train.precision):
        # the one value the Accelerator, build_model and the report use
        self.run: RunPlan = run
        self.params, self.cfg = self.run.params, self.run.train
        if self.run.memory["precision"]["conflict"] and os.environ.get("RANK", "0") == "0":
            self.log(f"precision: {self.run.memory['precision']['conflict']}")

    def _setup_accelerator(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        cfg = self.cfg
        self.accelerator = Accelerator(
            mixed_precision=cfg.precision,
            # fit() accumulates through accelerate: under DeepSpeed the engine steps on the last micro-batch only
            gradient_accumulation_steps=cfg.grad_accum,
            log_with=None if cfg.tracker == "none" else cfg.tracker,
            project_dir=str(self.paths.logs_dir or Path("logs")),
        )
        configure_deepspeed(self.accelerator, cfg)  # DeepSpeed: batch sizes and clipping from params, before prepare
        set_seed(self.params.seed)
        self.main = self.accelerator.is_main_process

    def _setup_reference(self) -> None:
        """An anchored objective: the reference_logps stage's record (the model the policy starts from: its adapter,
        if any) and, for one that needs a reference, its per-token log-probs beside it. None for sft and the reward
        model."""
        from fineflow.train.reference_model import load_reference

        self.preference_reference = load_reference(self.cfg, self.paths.reference)
        if self.preference_reference is not None and self.main:
            said = "reference" if self.preference_reference.logps else "start"
            self.log(f"{self.cfg.objective} {said}: {self.preference_reference.record['note']}")

    def _setup_model(self) -> None:
        """The model (its load timed), the optimizer and the LR schedule, prepared by accelerate."""
        import peft  # noqa: F401 - imported here, not inside the model-load timer: imports are start-up
        import torch
        import transformers  # noqa: F401

        from fineflow.train.schedule import build_scheduler

        cfg, profile = self.cfg, self.run.profile
        loading = time.perf_counter()
        # ZeRO-3 gathers each module's parameters in that module's own forward hook: leave peft's forward there
        start = self.preference_reference.adapter if self.preference_reference is not None else None
        model = build_model(
            self.base_source,
            self.params,
            profile,
            fuse_lora=cfg.fused_lora and profile.sharding != "zero3",
            start_adapter=start,
        )
        self.phases["model_load_s"] = time.perf_counter() - loading
        self.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # fused: one kernel per parameter instead of ~10 small ops each (CPU and CUDA; 3.9 -> 2.4 ms/step here)
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True
        )
        # The scheduler is deliberately not passed through accelerator.prepare: accelerate steps a prepared
        # scheduler once per process on every optimizer step, so N ranks would run the schedule N times faster
        # (warmup over after 1/N of its steps, the decay finished at 1/N of the run). Stepped by fit() once per
        # optimizer step, every world size follows the same schedule.
        self.scheduler = build_scheduler(optimizer, cfg)
        fused = getattr(model, "fineflow_fused_layers", 0)
        self.fused_layers = prepare_model_for_fsdp(self.accelerator, model, fused)  # LoRA wrapping, fp32 buffers
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.grad_sync_measured = gradsync.register(self.model)  # DDP: the all-reduce timed apart from backward

    def _setup_rollouts(self) -> None:
        """An online objective (train.objective grpo): what its rollouts need, built once (the tokenizer, the
        rewards, the reference); None for every other objective."""
        from fineflow.train.rollouts import RolloutContext

        objective = objective_for(self.cfg.objective)
        objective.check_run(self.cfg, self.run.profile)
        self.rollouts = None
        if objective.online:
            start = self.preference_reference.adapter if self.preference_reference is not None else None
            self.rollouts = RolloutContext.build(
                self.base_source, start, self.cfg, self.params.seed, self.accelerator.device
            )

    def _setup_data(self) -> None:
        """The shards and the seeded row order, dealt over the ranks there are (with train.elastic on other ranks
        than params give, first the accumulation that keeps params' global batch)."""
        from fineflow.tokenize.shards import PackedShard, RowSampler

        self._adapt_to_world()
        accelerator = self.accelerator
        self.train_shard, self.eval_shard = (
            PackedShard(self.paths.shards / "train"),
            PackedShard(self.paths.shards / "eval"),
        )
        # pairs: the shards with their pair slots (and the reference's log-probs, when the objective needs one)
        if objective_for(self.cfg.objective).pair_shards:
            from fineflow.train.pair_shards import PairShard
            from fineflow.train.reference_model import check_reference_shards

            logps = {}
            if self.preference_reference is not None and self.preference_reference.logps:
                shards = {"train": self.train_shard, "eval": self.eval_shard}
                check_reference_shards(
                    self.preference_reference, {k: s.meta.get("content_key") for k, s in shards.items()}
                )
                logps = self.preference_reference.logps
            self.train_shard = PairShard(self.train_shard, logps.get("train"))
            self.eval_shard = PairShard(self.eval_shard, logps.get("eval"))
        self.sampler = RowSampler(
            len(self.train_shard),
            self.params.seed,
            accelerator.process_index,
            accelerator.num_processes,
            row_tokens=self.train_shard.real_per_row,
        )

    def _adapt_to_world(self) -> None:
        """train.elastic: grad_accum for the ranks that run (fineflow.train.elastic), before the loader reads it;
        the train report's "elastic" says what was adapted."""
        from dataclasses import replace

        from fineflow.train.elastic import adapt_to_world, global_batch

        n = self.accelerator.num_processes
        cfg, adapted = adapt_to_world(self.cfg, n, self.run.profile.engine)
        if adapted is not None:
            self.run = replace(self.run, params=self.params.model_copy(update={"train": cfg}))
            self.params, self.cfg = self.run.params, self.run.train
            self.accelerator.gradient_accumulation_steps = cfg.grad_accum  # accumulate() steps at its boundary
            if self.main:
                self.log(adapted)
        self.elastic = (
            {"global_batch": global_batch(cfg, n), "adapted": adapted, "resumed": None} if cfg.elastic else None
        )

    def _setup_resume(self) -> None:
        """The run's fingerprint (rank 0 hashes the base weights, once), its checkpoint directory, and the
        checkpoint to resume from: weights, optimizer, schedule, RNG and the sampler's position, no replay."""
        from fineflow.checkpoint import store_config
        from fineflow.train.checkpointing import restore
        from fineflow.train.resume import resume_point, run_fingerprint

        accelerator, paths = self.accelerator, self.paths
        fingerprint = [None]
        if self.main:  # the base weights' hashes are cached in hash_cache
            n = accelerator.num_processes
            fingerprint = [run_fingerprint(self.params, self.base_source, self.train_shard.meta, n, paths.hash_cache)]
            if self.preference_reference is not None:  # another reference (or start) is another run
                fingerprint[0]["reference"] = self.preference_reference.record["key"]
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            fingerprint = broadcast_object_list(fingerprint)
        self.fingerprint = fingerprint[0]
        resuming = time.perf_counter()
        store = store_config(self.params.checkpoint)  # checkpoint.store: the newest valid one there is fetched first
        self.run_dir, self.resumed = resume_point(
            accelerator, paths.checkpoints, self.fingerprint, self.cfg.resume, store
        )
        self.start_step, self.tokens_seen = 0, 0
        if self.resumed is not None:
            restore(self.resumed, accelerator, self.model, self.optimizer, self.scheduler, self.run.profile.engine)
            self.sampler.load_state_dict(self.resumed.state["sampler"])
            self.start_step, self.tokens_seen = self.resumed.state["step"], self.resumed.state["tokens_seen"]
            self._note_layout_change()
            self.phases["resume_load_s"] = time.perf_counter() - resuming  # a cost of the restart

    def _note_layout_change(self) -> None:
        """train.elastic: a checkpoint of other ranks or accumulation was resumed: say so (rank 0) and report it."""
        from fineflow.train.elastic import Layout, describe_move

        if self.elastic is None:
            return
        now = Layout(self.accelerator.num_processes, self.cfg.grad_accum)
        self.elastic["resumed"] = describe_move(self.resumed.state, now, self.elastic["global_batch"])
        if self.elastic["resumed"] is not None and self.main:
            self.log(self.elastic["resumed"]["message"])

    def _setup_loader(self) -> None:
        from fineflow.train.loader import BatchLoader

        cfg = self.cfg
        self.batches = BatchLoader(
            self.train_shard,
            self.sampler,
            cfg.micro_batch_size,
            cfg.grad_accum,
            cfg.steps - self.start_step,
            prefetch=cfg.prefetch,
            pin_memory=self.accelerator.device.type == "cuda",
            varlen=cfg.attention == "varlen",
        )

    def _setup_checkpointing(self) -> None:
        """Rank 0's checkpoint manager: the files, their retention and verification (fineflow.checkpoint)."""
        from fineflow.checkpoint import CheckpointManager, store_config

        ck = self.params.checkpoint
        self.manager = None
        if self.main:
            self.manager = CheckpointManager(
                self.run_dir,
                keep_last=ck.keep_last,
                keep_best=ck.keep_best,
                mode=ck.mode,
                async_backend=ck.backend,
                on_write_error=ck.on_write_error,
                retries=ck.retries,
                store=store_config(ck),  # checkpoint.store: each published checkpoint is uploaded there too
            )
            if self.resumed is not None:
                self.manager.protect(self.resumed.path)
                self.log(f"resuming from {self.resumed.path} (step {self.start_step} of {self.cfg.steps})")

    def _setup_tracker(self) -> None:
        """The tracker run (rank 0) and the lines that say what trains."""
        from fineflow.train.tracker import init_tracker

        if not self.main:
            return
        cfg, accelerator = self.cfg, self.accelerator
        init_tracker(accelerator, self.params, self.run_dir, self.start_step)
        self.log(
            f"training {cfg.method}"
            + (f" r={cfg.lora.r}" if cfg.method != "full" else "")
            + f": {self.trainable:,} trainable parameters on {accelerator.num_processes} process(es), device "
            f"{accelerator.device}, precision {cfg.precision}, attention {cfg.attention}, {self.fused_layers} fused "
            f"LoRA layers, planned peak {self.run.memory['gib']['total']:.2f} GiB per device"
        )
        for change in self.run.changes:
            self.log(f"auto_fit: {change}")

    def train(self):
        """fit() over the prepared batches; rank 0's last checkpoint is complete and verified when it returns."""
        from fineflow.train.checkpointing import TrainStateSaver
        from fineflow.train.loop import fit
        from fineflow.train.steps import Progress, StepLog, StepTimer

        cfg, main, ck = self.cfg, self.main, self.params.checkpoint
        step_log = StepLog(self.paths.steps_log if main else None, resume_after=self.start_step)
        progress = Progress(cfg.steps, cfg.log_every, self.log, start=self.start_step) if main else None
        self.loop_started = time.time()
        # when to save and what (every rank); its minute clock starts with the loop
        saver = TrainStateSaver(
            self.manager, ck.every_steps, ck.every_minutes, self.fingerprint, engine=self.run.profile.engine
        )
        try:
            with RunnableSampler() as self.runnable:  # the machine's load during the loop: the doctor's evidence
                result = fit(
                    self.model,
                    self.optimizer,
                    self.scheduler,
                    self.accelerator,
                    self.batches,
                    cfg,
                    StepTimer(),
                    step_log,
                    saver,
                    self.eval_shard,
                    progress,
                    start_step=self.start_step,
                    tokens_seen=self.tokens_seen,
                    redo_through=step_log.dropped_through if main else 0,
                    rollouts=self.rollouts,
                )
            if self.manager is not None:
                self.manager.close()  # the last save is complete and verified before the stage reports success
        finally:
            self.batches.close()
            step_log.close()
            if progress is not None:
                progress.close()
        return result

    def cleanup(self) -> None:
        """The trained model saved (a collective under FSDP/ZeRO-3), the run marked finished, trackers closed."""
        from fineflow.checkpoint.remote_store import mark_run_finished, store_config
        from fineflow.train.resume import FINISHED, mark_finished

        self.accelerator.wait_for_everyone()
        save_model(self.accelerator, self.model, self.paths.out_dir, self.cfg.method, self.cfg.objective)
        if self.main:
            mark_finished(self.run_dir, self.cfg.steps)  # a later run of the same inputs trains again, never resumes
            mark_run_finished(store_config(self.params.checkpoint), self.run_dir, FINISHED)  # on any node
        self.accelerator.end_training()

    def report(self, result) -> dict | None:
        """Rank 0's report (fineflow.train.report) with the rank's phases and timeline; None on other ranks."""
        if not self.main:
            return None
        accelerator, cfg = self.accelerator, self.cfg
        last = self.manager.last_result
        write_s = last.get("write_s", 0.0) if last else None
        n = accelerator.num_processes
        report = train_report(
            result, cfg, self.run.memory, self.tokens_seen, n, self.trainable, self.fused_layers, write_s
        )
        probe_started = time.time()
        try:  # the ledger's facts: a finished training never fails on them
            report["device"] = device_facts(accelerator, cfg, self.runnable.summary())
            report["flops"] = run_flops(self.base_source, cfg, self.train_shard, report, accelerator)
        except Exception as exc:  # noqa: BLE001
            report.setdefault("device", {"type": accelerator.device.type, "count": n})
            report["flops"] = {"error": f"{type(exc).__name__}: {exc}"}
        report["grad_sync_measured"] = self.grad_sync_measured
        report["elastic"] = self.elastic  # train.elastic: the global batch, and what a resume adapted
        finished = time.time()
        report["phases"] = self.timed_phases(result, probe_started, finished)
        report["timeline"] = {
            "proc_start": process_started(),
            "entry": self.entered,
            "loop_start": self.loop_started,
            "done": finished,
        }
        return report

    def timed_phases(self, result, probe_started: float, finished: float) -> dict:
        """The rank's time outside the loop, by phase. The device probe (a CPU's matmul rates, ~0.5-1 s) is
        measuring the run, not saving it; set-up is the time to the loop less the model and checkpoint loads."""
        phases = dict(self.phases)
        phases["probe_s"] = finished - probe_started
        phases["setup_s"] = self.loop_started - self.entered - phases["model_load_s"] - phases["resume_load_s"]
        phases["save_s"] = probe_started - self.loop_started - result.wall_s
        return {key: round(value, 4) for key, value in phases.items()}
