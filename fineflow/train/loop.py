"""The training loop: one readable ``fit()`` on accelerate, fed from packed shards.

Side effects go through objects handed to ``fit``: a ``BatchLoader`` (batches prepared ahead on a thread,
fineflow.train.loader), a ``StepTimer`` (a span per phase of each step), a ``StepLog`` (the per-step JSONL
that ``dvc plots`` renders) and a ``Progress`` (a rich bar on a terminal, log lines elsewhere), all three in
fineflow.train.steps, and a ``TrainStateSaver`` (fineflow.train.checkpointing). Metrics also go to
accelerate's trackers (TensorBoard by default) through ``accelerator.log``. The loop itself only computes.

Loss is token-weighted across micro-batches and data-parallel ranks: each optimizer step divides the summed
cross-entropy by the number of trained tokens in the whole global batch, so 1 process and N processes with
the same global batch take the same step. A preference objective (train.objective dpo, simpo:
fineflow.train.pair_shards) is pair-weighted the same way: its summed pair loss over the global batch's pairs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from fineflow.core.train_config import TrainParams
from fineflow.errors import FineflowError
from fineflow.objectives import NAMES, objective_for
from fineflow.tokenize.shards import PackedShard
from fineflow.train.attention import layout_kwargs, layout_of
from fineflow.train.checkpointing import TrainStateSaver
from fineflow.train.loader import BatchLoader, as_tensors
from fineflow.train.rollouts import rollout_step, step_fields
from fineflow.train.steps import Progress, StepLog, StepTimer, peak_memory_mb


def objective_loss(model, batch: dict, cfg: TrainParams | None = None, **forward_kwargs):
    """(this batch's summed loss, its targets: trained tokens or pairs, reward statistics or None) under
    train.objective (fineflow.objectives; cfg None: the default objective and settings)."""
    objective = objective_for(cfg.objective if cfg is not None else NAMES[0])
    result = objective.loss(model, batch, cfg, **forward_kwargs)
    return result.loss_sum, result.count, result.rewards


@dataclass
class FitResult:
    steps: int
    final_loss: float
    eval_loss: float | None
    tokens: int  # real (trained-on or attended, non-pad) tokens processed, summed over ranks
    wall_s: float
    timer: StepTimer
    peak_mem_mb: float = 0.0
    resumed_from: int = 0  # the step this attempt started after (0: a fresh start)
    rewards: tuple[float, float] | None = None  # a preference objective: the last step's reward accuracy and margin
    rollout: dict | None = None  # an online objective: the last step's rollout figures (rollouts.step_fields)
    rollout_totals: dict | None = None  # and its rollout sums over this attempt's steps (rollouts.STATS)


def evaluate_loss(
    model,
    shard: PackedShard,
    batch_size: int,
    accelerator,
    varlen: bool = False,
    cfg: TrainParams | None = None,
) -> float:
    """Mean token loss over an eval shard (a preference objective: the mean pair loss over a PairShard), this
    rank's share of rows, reduced across ranks.

    Every rank runs the same number of forwards: under FSDP/ZeRO-3 each forward is a collective (weights are
    gathered layer by layer), so a rank with one batch fewer would leave the others waiting forever. A rank
    whose share runs out first pads with forwards of a real row whose loss counts with weight 0."""
    import torch

    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        rows = list(range(accelerator.process_index, len(shard), accelerator.num_processes))
        most_rows = -(-len(shard) // accelerator.num_processes)  # rank 0's share, the largest
        for i in range(0, most_rows, batch_size):
            weight = 1.0 if rows[i : i + batch_size] else 0.0
            arrays = shard.batch(rows[i : i + batch_size] or [0])
            batch = {k: v.to(accelerator.device) for k, v in as_tensors(arrays).items()}
            extra = layout_kwargs(layout_of(arrays["position_ids"], varlen), accelerator.device)
            loss_sum, n, _ = objective_loss(model, batch, cfg, **extra)
            total += weight * torch.tensor([loss_sum.item(), n], dtype=torch.float64, device=accelerator.device)
    total = accelerator.reduce(total, reduction="sum")
    model.train()
    return float(total[0] / max(1.0, float(total[1])))


def fit(
    model,
    optimizer,
    scheduler,
    accelerator,
    batches: BatchLoader,
    cfg: TrainParams,
    timer: StepTimer,
    step_log: StepLog,
    saver: TrainStateSaver,
    eval_shard: PackedShard | None = None,
    progress: Progress | None = None,
    start_step: int = 0,
    tokens_seen: int = 0,
    redo_through: int = 0,
    rollouts=None,
) -> FitResult:
    """Run optimizer steps start_step+1 .. cfg.steps on the batches the loader prepares (after a resume,
    the loader's sampler, the weights and the optimizer were restored to start_step); returns the report's
    figures. rollouts: an online objective's context (fineflow.train.rollouts.RolloutContext): each step's
    sampled rows are its prompts, and its rollout makes the step's batch from them.

    A stop signal (SIGTERM: preemption; SIGINT: Ctrl-C; noted by fineflow.process.preempt) lets the step in
    progress finish, saves that step, waits for the write and raises preempt.Preempted: a retry resumes there."""
    from fineflow.process import preempt

    model.train()
    started = time.perf_counter()
    loss_value, eval_loss, rewards, rollout, run_rollouts = float("nan"), None, None, None, None
    check_accumulation(accelerator, cfg.grad_accum)
    for step in range(start_step + 1, cfg.steps + 1):
        timer.start_step(redo=step <= redo_through)
        step_start = time.perf_counter()
        with timer.span("data_wait_s"):
            prepared = next(batches)  # blocks only if the loader thread has fallen behind
        if rollouts is not None:  # its own spans: rollout_s, reward_s, reference_s
            began, spanned = time.perf_counter(), sum(timer.current.values())
            prepared = rollout_step(model, prepared, cfg, step, accelerator, timer, rollouts)
            # what the rollout did between its spans (assembling the batch) is rollout time too
            timer.add("rollout_s", time.perf_counter() - began - (sum(timer.current.values()) - spanned))
        targets, step_tokens, step_loss, step_rewards = forward_backward(model, accelerator, prepared, cfg, timer)
        with timer.span("optimizer_s"):
            grad_norm = optimizer_step(model, optimizer, scheduler, accelerator, cfg.max_grad_norm)
        save_failed = saver.writer_failed()  # rank 0's background save: on the loss all-reduce, to every rank
        with timer.span("loss_sync_s"):
            loss_value, stopping, save_failed, rewards = global_loss(
                accelerator, step_loss, targets, save_failed, step_rewards
            )
        if save_failed:  # a full disk stops training here (within a step of the failed write), not at the next save
            saver.stop_on_failed_save(accelerator, step - 1)
        check_finite(loss_value, step, cfg)
        tokens_seen += step_tokens
        step_eval = None
        if eval_shard is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
            with timer.span("train_eval_s"):
                step_eval = eval_loss = train_eval(model, eval_shard, accelerator, cfg)
        if stopping or saver.due(step, cfg.steps, accelerator):  # stopping: the same on every rank
            with timer.span("checkpoint_s"):  # the stall: async saves block only for the copy to host memory
                state = {
                    "step": step,
                    "total_steps": cfg.steps,
                    "sampler": prepared.sampler_state,
                    "tokens_seen": tokens_seen,
                    "loss": loss_value,
                }
                saver.save(accelerator, model, optimizer, scheduler, step, state, step_eval)
        with timer.span("log_s"):
            lr = scheduler.get_last_lr()[0]
            record = step_record(step, step_start, loss_value, lr, grad_norm, prepared.rows, step_tokens, timer)
            record["peak_mem_mb"] = round(peak_memory_mb(accelerator.device), 1)
            if rewards is not None:  # a preference objective: the global batch's reward accuracy and mean margin
                record["reward_accuracy"], record["reward_margin"] = round(rewards[0], 5), round(rewards[1], 5)
            if prepared.stats is not None:  # an online objective's rollout figures, over the global batch
                step_totals = rollout_totals(accelerator, prepared.stats)
                run_rollouts = {k: (run_rollouts or {}).get(k, 0.0) + v for k, v in step_totals.items()}
                rollout = step_fields(step_totals)
                record.update(rollout)
            if step_eval is not None:
                record["eval_loss"] = round(step_eval, 5)
            log_step(accelerator, step_log, progress, record)
        if stopping:
            stop(accelerator, saver, step, preempt)
    wall_s = time.perf_counter() - started
    peak = peak_memory_mb(accelerator.device)
    return FitResult(
        cfg.steps, loss_value, eval_loss, tokens_seen, wall_s, timer, peak, start_step, rewards, rollout, run_rollouts
    )


def train_eval(model, eval_shard, accelerator, cfg: TrainParams) -> float:
    """The loop's eval loss (train.eval_every) under the run's objective and attention."""
    return evaluate_loss(
        model,
        eval_shard,
        cfg.micro_batch_size,
        accelerator,
        varlen=cfg.attention == "varlen",
        cfg=cfg,
    )


def check_accumulation(accelerator, accum: int) -> None:
    """accelerate must accumulate over train.grad_accum micro-batches, or accumulate() steps at the wrong boundary."""
    if accelerator.gradient_accumulation_steps != accum:
        raise FineflowError(
            f"accelerate accumulates over {accelerator.gradient_accumulation_steps} micro-batches but train.grad_accum "
            f"is {accum}: build the Accelerator with gradient_accumulation_steps=train.grad_accum (and set no other "
            f"gradient_accumulation_steps in the accelerate profile)"
        )


def forward_backward(model, accelerator, prepared, cfg: TrainParams, timer: StepTimer):
    """One optimizer step's micro-batches through forward and backward: (trained tokens of the global batch (a
    preference objective: its pairs), real tokens of the global batch, this rank's summed loss, this rank's
    summed reward accuracy and margin: None for sft). Spans: compute (the copy to the device and the
    passes), loss_sync (the step's token counts, summed over ranks) and grad_sync (DDP's all-reduce)."""
    import torch

    from fineflow.train import gradsync

    device, world, accum = accelerator.device, accelerator.num_processes, cfg.grad_accum
    with timer.span("compute_s"):
        micro = [{k: v.to(device, non_blocking=True) for k, v in b.items()} for b in prepared.micro]
        extras = (
            [layout_kwargs(layout, device) for layout in prepared.layouts] if prepared.layouts else [{}] * len(micro)
        )
    with timer.span("loss_sync_s"):
        counts = accelerator.reduce(
            torch.tensor([prepared.targets, prepared.real_tokens], device=device), reduction="sum"
        )
        targets, real_tokens = int(counts[0]), int(counts[1])
    step_loss, step_rewards = 0.0, None
    sync_before = gradsync.seconds()
    with timer.span("compute_s"):
        for batch, extra in zip(micro, extras):
            # accumulate(): before the step's last micro-batch DDP/FSDP skip their gradient sync (no_sync) and
            # DeepSpeed's engine does not step; on the last one accelerator.sync_gradients turns true, and
            # accelerate's DeepSpeed backward steps the engine there: one optimizer step per grad_accum
            # micro-batches on every backend. The loss stays sum / global trained tokens: x world, since DDP and
            # DeepSpeed average gradients over ranks; x accum, since accelerate (DDP, FSDP, one process) and
            # DeepSpeed's engine (inside its backward) both divide the loss by the accumulation steps.
            with accelerator.accumulate(model):
                loss_sum, _, rewards = objective_loss(model, batch, cfg, **extra)
                accelerator.backward(loss_sum * (world * accum) / max(1, targets))
            step_loss += loss_sum.item()
            if rewards is not None:
                step_rewards = [a + b for a, b in zip(step_rewards or (0.0, 0.0), rewards)]
        gradsync.settle()
    # the gradient all-reduce runs inside backward (DDP's comm hook timed it: fineflow.train.gradsync)
    timer.move("compute_s", "grad_sync_s", gradsync.seconds() - sync_before)
    return targets, real_tokens, step_loss, step_rewards


def optimizer_step(model, optimizer, scheduler, accelerator, max_grad_norm: float):
    """Clip, step, schedule, zero the gradients; returns the gradient norm (None: DeepSpeed clips inside)."""
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    if not accelerator.optimizer_step_was_skipped:  # fp16: a step the loss scaler skipped is not a step
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def global_loss(accelerator, step_loss: float, targets: int, save_failed: bool = False, rewards=None):
    """(the step's loss over the global batch, whether any rank got a stop signal, whether any rank's background
    checkpoint save failed, the global batch's (reward accuracy, mean margin) or None). The flags and the reward
    sums ride on the loss all-reduce: every rank learns of them at the same step, without a collective of their
    own, whichever rank (or how many) raised them."""
    import torch

    from fineflow.process import preempt

    signalled = float(preempt.stop_signal() is not None)
    values = [step_loss, signalled, float(save_failed), *(rewards or ())]
    reduced = accelerator.reduce(torch.tensor(values, dtype=torch.float64, device=accelerator.device), reduction="sum")
    per_pair = None if rewards is None else (float(reduced[3]) / max(1, targets), float(reduced[4]) / max(1, targets))
    return float(reduced[0]) / max(1, targets), float(reduced[1]) > 0, float(reduced[2]) > 0, per_pair


def rollout_totals(accelerator, stats: dict) -> dict:
    """An online objective's per-rank rollout sums, summed over the ranks (every rank calls it each step)."""
    import torch

    values = torch.tensor(list(stats.values()), dtype=torch.float64, device=accelerator.device)
    reduced = accelerator.reduce(values, reduction="sum")
    return dict(zip(stats, (float(v) for v in reduced)))


def check_finite(loss_value: float, step: int, cfg: TrainParams) -> None:
    if not math.isfinite(loss_value):
        raise FineflowError(
            f"training stopped at step {step}: the loss is {loss_value}. Lower train.lr "
            f"(now {cfg.lr}) or check the data for empty responses."
        )


def step_record(step: int, step_start: float, loss: float, lr: float, grad_norm, rows, tokens: int, timer) -> dict:
    """The step log's line up to this step's spans (the log's own span is still running: left out)."""
    step_s = time.perf_counter() - step_start
    return {
        "step": step,
        "loss": round(loss, 5),
        "lr": lr,
        # DeepSpeed clips inside its engine step; accelerate hands back the engine's norm (or None)
        "grad_norm": round(float(grad_norm), 5) if grad_norm is not None else None,
        "rows": rows,
        "tokens": tokens,
        "tokens_per_s": round(tokens / step_s, 1),
        "step_s": round(step_s, 5),
        **{k: round(v, 5) for k, v in timer.current.items() if k != "log_s"},
    }


def log_step(accelerator, step_log: StepLog, progress: Progress | None, record: dict) -> None:
    """The step's line in the step log, the trackers and the progress display (rank 0)."""
    if accelerator.is_main_process:
        step = record["step"]
        step_log.log(record)
        accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}, step=step)
        if progress is not None:
            progress.update(step, record)


def stop(accelerator, saver: TrainStateSaver, step: int, preempt) -> None:
    """After the step a stop signal ended: its checkpoint published (rank 0), trackers flushed, Preempted."""
    if saver.manager is not None:
        saver.manager.wait()  # rank 0: the step's checkpoint is published before the process exits
    accelerator.end_training()  # trackers flushed, as at a normal end
    raise preempt.Preempted(step, preempt.stop_signal())
