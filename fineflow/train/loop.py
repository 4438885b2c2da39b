"""The training loop: one readable ``fit()`` on accelerate, fed from packed shards.

Side effects go through objects handed to ``fit``: a ``BatchLoader`` (batches prepared ahead on a thread),
a ``StepTimer`` (where each step's time went), a ``StepLog`` (the per-step JSONL that ``dvc plots``
renders), a ``Progress`` (a rich bar with tokens/s and ETA on a terminal, log lines elsewhere) and a
``TrainStateSaver`` (atomic safetensors saves). Metrics also go to accelerate's trackers (TensorBoard by
default) through ``accelerator.log``. The loop itself only computes.

Loss is token-weighted across micro-batches and data-parallel ranks: each optimizer step divides the summed
cross-entropy by the number of trained tokens in the whole global batch, so 1 process and N processes with
the same global batch take the same step.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fineflow.core.config import TrainParams
from fineflow.core.errors import FineflowError
from fineflow.tokenize.shards import PackedShard
from fineflow.train import fsdp
from fineflow.train.attention import layout_kwargs, layout_of
from fineflow.train.loader import BatchLoader, as_tensors


def token_loss_sum(model, batch: dict, **forward_kwargs):
    """Summed next-token cross-entropy over trained tokens, and how many there were.

    No attention_mask is passed: position_ids restart per example, and packed examples never attend to each
    other only if the attention gets that layout. sdpa/eager: transformers builds a block-diagonal causal
    mask from the position ids (any batch size). flash_attention_2: transformers infers packing from
    position ids only for a batch of one row, so ``forward_kwargs`` must carry flash-attn's cu_seqlens;
    varlen: its groups (both from fineflow.train.attention.layout_kwargs). Logits are computed only at
    positions whose next token is trained on (``logits_to_keep`` as a boolean mask): in instruction data
    that is a small share of the row (6% on the bundled data), and the vocabulary projection and its fp32
    loss are the largest per-token cost after the layers.
    """
    import torch
    import torch.nn.functional as F

    targets = batch["labels"][:, 1:]
    keep = torch.zeros_like(batch["labels"], dtype=torch.bool)
    keep[:, :-1] = targets != -100
    logits = model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        use_cache=False,
        logits_to_keep=keep,
        **forward_kwargs,
    ).logits  # (trained positions, vocab)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets[keep[:, :-1]], reduction="sum")
    return loss, int(keep.sum())


@dataclass
class StepTimer:
    """Where a step's wall time went: waiting for data, forward+backward, optimizer, the gradient and loss
    all-reduces, in-training evaluation, checkpoint stall, and the step log. Steps a resume trains again (a
    crashed attempt had trained them past its last checkpoint, and lost them) add to ``redo`` as well: the
    ledger reports how long training them again took (the loss itself is in the crashed attempt's wall time)."""

    totals: dict = field(
        default_factory=lambda: {
            "data_wait_s": 0.0,
            "compute_s": 0.0,
            "optimizer_s": 0.0,
            "grad_sync_s": 0.0,
            "loss_sync_s": 0.0,
            "train_eval_s": 0.0,
            "checkpoint_s": 0.0,
            "log_s": 0.0,
        }
    )
    current: dict = field(default_factory=dict)
    redo: dict = field(default_factory=dict)
    redo_steps: int = 0
    _redoing: bool = False

    def start_step(self, redo: bool = False) -> None:
        self.current = {key: 0.0 for key in self.totals}
        self._redoing = redo
        if redo:
            self.redo_steps += 1

    def add(self, key: str, seconds: float) -> None:
        self.current[key] += seconds
        self.totals[key] += seconds
        if self._redoing:
            self.redo[key] = self.redo.get(key, 0.0) + seconds

    def move(self, source: str, target: str, seconds: float) -> None:
        """Re-file seconds a timer took for one bucket under another (gradient all-reduce inside backward)."""
        seconds = min(seconds, self.current[source])
        self.add(source, -seconds)
        self.add(target, seconds)


class StepLog:
    """Per-step JSONL (loss, lr, tokens/s, timings, the rows trained on); rank 0 only. dvc.yaml declares it
    as a plot. On a resume from step N the log keeps its lines up to N and continues after them, so no
    step appears twice (the lines a crashed attempt wrote after its last checkpoint are dropped)."""

    def __init__(self, path: Path | None, resume_after: int = 0):
        self.path = path
        self.dropped_through = resume_after  # the last step a crashed attempt logged: resumed, these run again
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if resume_after and path.exists():
                for line in path.read_text(encoding="utf-8").splitlines():
                    try:
                        step = json.loads(line)["step"]
                    except (ValueError, KeyError, TypeError):
                        break  # a torn last line from the crash
                    if step <= resume_after:
                        kept.append(line + "\n")
                    else:
                        self.dropped_through = max(self.dropped_through, step)
            self._fh = path.open("w", encoding="utf-8")
            self._fh.writelines(kept)
            self._fh.flush()

    def log(self, record: dict) -> None:
        if self.path is not None:
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self.path is not None:
            self._fh.close()


def peak_memory_mb(device) -> float:
    """Peak memory so far: CUDA's allocator peak on a GPU, the process's peak RSS otherwise (Linux: KiB)."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Progress:
    """Console progress, rank 0: a rich bar (step, loss, tokens/s, ETA) when stderr is a terminal; a log
    line every log_every steps (with the ETA) when it is not — Prefect and DVC capture plain lines."""

    def __init__(self, total: int, log_every: int, log=print, enabled: bool = True, start: int = 0):
        self.total, self.log_every, self.log, self.start = total, log_every, log, start
        self.started = time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar

            self.bar = Bar(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                transient=False,
            )
            self.task = self.bar.add_task("train", total=total, completed=start, status="")
            self.bar.start()

    def eta_s(self, step: int) -> float:
        return (time.perf_counter() - self.started) / max(1, step - self.start) * (self.total - step)

    def update(self, step: int, record: dict) -> None:
        status = f"loss {record['loss']:.4f} {record['tokens_per_s']:,.0f} tok/s"
        if "eval_loss" in record:
            status += f" eval_loss {record['eval_loss']:.4f}"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, status=status)
        elif step % self.log_every == 0 or step == self.total:
            self.log(f"step {step}/{self.total} {status} lr {record['lr']:.2e} ETA {self.eta_s(step):.0f}s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def save_adapter(model, out_dir: Path, state_dict: dict | None = None) -> None:
    """save_pretrained, then make adapter_config.json byte-stable.

    peft keeps target_modules as a set, which it writes in hash order (random per process), so the same
    training would give different bytes — and a different DVC hash — run to run.
    """
    model.save_pretrained(out_dir, state_dict=state_dict)  # peft keeps only the adapter's entries
    config_path = Path(out_dir) / "adapter_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


class TrainStateSaver:
    """Decides when to checkpoint and hands the loop's full state to a CheckpointManager.

    Every rank calls ``due`` and ``save`` (each contributes its RNG state, and ranks must agree on a
    time-based trigger); only rank 0 has a manager and writes. What is saved: the trainable tensors only
    (LoRA: the adapter), optimizer and LR-scheduler state, the sampler position of the last consumed batch,
    step and token counters, and every rank's Python/NumPy/torch RNG state (fineflow.checkpoint).
    """

    def __init__(self, manager, every_steps: int, every_minutes: float | None = None, fingerprint: dict | None = None):
        self.manager, self.every_steps, self.every_minutes = manager, every_steps, every_minutes
        self.fingerprint = fingerprint or {}
        self.last_save = time.monotonic()

    def due(self, step: int, last_step: int, accelerator) -> bool:
        """The same answer on every rank (validation before a save is collective)."""
        due = step % self.every_steps == 0 or step == last_step
        if self.every_minutes is not None and not due:
            import torch

            late = time.monotonic() - self.last_save >= self.every_minutes * 60
            flag = accelerator.reduce(torch.tensor([int(late)], device=accelerator.device), reduction="sum")
            due = int(flag[0]) > 0  # any rank's clock decides, so no rank skips a collective the others enter
        return due

    def save(self, accelerator, model, optimizer, scheduler, step: int, state: dict, metric: float | None) -> None:
        from fineflow.checkpoint import capture_rng

        rngs = [capture_rng()]
        if accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            rngs = gather_object(rngs)  # one snapshot per rank, in rank order
        self.last_save = time.monotonic()
        sharding, sharded_dir = sharding_of(accelerator), None
        if sharding is not None:  # every rank writes its own shards; nothing is gathered to rank 0
            sharded_dir = fsdp.stage_shards(accelerator, self.manager, step, shard_writer(sharding, model, optimizer))
        if self.manager is None:
            return
        if sharded_dir is None:
            trainable = {
                name: p.detach() for name, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad
            }
            optimizer_state = optimizer.state_dict()
        else:
            trainable, optimizer_state = {}, None
        scaler = getattr(accelerator, "scaler", None)  # fp16 on a GPU: the loss scale must continue too
        self.manager.save(
            step,
            trainable,
            optimizer_state,
            scheduler.state_dict(),
            {**state, "fingerprint": self.fingerprint, **({"sharding": sharding} if sharding else {})},
            rngs,
            metric,
            grad_scaler_state=scaler.state_dict() if scaler is not None else None,
            sharded_dir=sharded_dir,
        )


SHARDING_NAMES = {None: "an unsharded (one process or DDP)", "fsdp": "an FSDP", "deepspeed": "a DeepSpeed"}


def sharding_of(accelerator) -> str | None:
    """How this run's training state is split over the ranks: "fsdp", "deepspeed" (ZeRO) or None (every rank
    holds all of it: one process, DDP)."""
    from fineflow.train import zero

    return "fsdp" if fsdp.is_fsdp(accelerator) else "deepspeed" if zero.is_deepspeed(accelerator) else None


def shard_writer(sharding: str, model, optimizer):
    """write(directory): every rank writes its part of the training state there (a collective)."""
    from fineflow.train import zero

    if sharding == "deepspeed":
        return lambda directory: zero.save_engine_state(model, directory)
    return lambda directory: fsdp.save_sharded(model, optimizer, directory)


def checkpoint_sharding(checkpoint) -> str | None:
    """Who wrote a checkpoint's state: recorded in its state since DeepSpeed checkpoints exist; before, only FSDP
    wrote sharded ones."""
    if checkpoint.sharded_dir is None:
        return None
    return checkpoint.state.get("sharding") or "fsdp"


def restore(checkpoint, accelerator, model, optimizer, scheduler) -> None:
    """Put a loaded checkpoint's weights, optimizer, scheduler and this rank's RNG state back in place.
    A sharded checkpoint (FSDP, DeepSpeed) is read by every rank: each loads its own part of weights and
    optimizer."""
    import torch

    from fineflow.checkpoint import restore_rng
    from fineflow.train import zero

    written_by, running = checkpoint_sharding(checkpoint), sharding_of(accelerator)
    if written_by != running:
        raise FineflowError(
            f"{checkpoint.path} is {SHARDING_NAMES[written_by]} checkpoint and this run is "
            f"{SHARDING_NAMES[running].split(' ', 1)[1]} (train.accelerate_profile changed?); resume it with the "
            f"profile that wrote it, or start fresh with train.resume: never"
        )
    if written_by == "deepspeed":
        zero.load_engine_state(model, checkpoint.sharded_dir)
    elif written_by == "fsdp":
        fsdp.load_sharded(model, optimizer, checkpoint.sharded_dir)
    else:
        parameters = dict(accelerator.unwrap_model(model).named_parameters())
        missing = sorted(set(checkpoint.model_tensors) - set(parameters))
        if missing:
            raise FineflowError(f"{checkpoint.path}: tensors {missing[:3]} are not parameters of this model")
        with torch.no_grad():
            for name, tensor in checkpoint.model_tensors.items():
                parameters[name].copy_(tensor)
        optimizer.load_state_dict(checkpoint.optimizer_state_dict)
    scheduler.load_state_dict(checkpoint.scheduler_state_dict)
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None and checkpoint.grad_scaler_state is not None:
        scaler.load_state_dict(checkpoint.grad_scaler_state)
    restore_rng(checkpoint.rng_snapshots[accelerator.process_index])


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


def evaluate_loss(model, shard: PackedShard, batch_size: int, accelerator, varlen: bool = False) -> float:
    """Mean token loss over an eval shard, this rank's share of rows, reduced across ranks.

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
            loss_sum, n = token_loss_sum(model, batch, **extra)
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
) -> FitResult:
    """Run optimizer steps start_step+1 .. cfg.steps on the batches the loader prepares (after a resume,
    the loader's sampler, the weights and the optimizer were restored to start_step); returns the report's
    figures.

    A stop signal (SIGTERM: preemption; SIGINT: Ctrl-C; noted by fineflow.train.preempt) lets the step in
    progress finish, saves that step, waits for the write and raises preempt.Preempted: a retry resumes there."""
    import torch

    from fineflow.train import gradsync, preempt

    model.train()
    started = time.perf_counter()
    loss_value, eval_loss = float("nan"), None
    world, accum = accelerator.num_processes, cfg.grad_accum
    if accelerator.gradient_accumulation_steps != accum:  # accumulate() below would step at the wrong boundary
        raise FineflowError(
            f"accelerate accumulates over {accelerator.gradient_accumulation_steps} micro-batches but train.grad_accum "
            f"is {accum}: build the Accelerator with gradient_accumulation_steps=train.grad_accum (and set no other "
            f"gradient_accumulation_steps in the accelerate profile)"
        )
    for step in range(start_step + 1, cfg.steps + 1):
        timer.start_step(redo=step <= redo_through)
        step_start = time.perf_counter()

        t0 = time.perf_counter()
        prepared = next(batches)  # blocks only if the loader thread has fallen behind
        timer.add("data_wait_s", time.perf_counter() - t0)

        t0 = time.perf_counter()
        micro = [{k: v.to(accelerator.device, non_blocking=True) for k, v in b.items()} for b in prepared.micro]
        extras = (
            [layout_kwargs(layout, accelerator.device) for layout in prepared.layouts]
            if prepared.layouts
            else [{}] * len(micro)
        )
        counted = time.perf_counter()
        counts = accelerator.reduce(
            torch.tensor([prepared.targets, prepared.real_tokens], device=accelerator.device), reduction="sum"
        )
        global_targets, step_real = int(counts[0]), int(counts[1])
        timer.add("loss_sync_s", time.perf_counter() - counted)  # the step's token counts, summed over ranks
        t0 += time.perf_counter() - counted  # not compute
        step_loss = 0.0
        sync_before = gradsync.seconds()
        for i, batch in enumerate(micro):
            # accumulate(): before the step's last micro-batch DDP/FSDP skip their gradient sync (no_sync) and
            # DeepSpeed's engine does not step; on the last one accelerator.sync_gradients turns true, and
            # accelerate's DeepSpeed backward steps the engine there: one optimizer step per grad_accum
            # micro-batches on every backend. The loss stays sum / global trained tokens: x world, since DDP and
            # DeepSpeed average gradients over ranks; x accum, since accelerate (DDP, FSDP, one process) and
            # DeepSpeed's engine (inside its backward) both divide the loss by the accumulation steps.
            with accelerator.accumulate(model):
                loss_sum, _ = token_loss_sum(model, batch, **extras[i])
                accelerator.backward(loss_sum * (world * accum) / max(1, global_targets))
            step_loss += loss_sum.item()
        gradsync.settle()
        timer.add("compute_s", time.perf_counter() - t0)
        # the gradient all-reduce runs inside backward (DDP's comm hook timed it: fineflow.train.gradsync)
        timer.move("compute_s", "grad_sync_s", gradsync.seconds() - sync_before)

        t0 = time.perf_counter()
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        if not accelerator.optimizer_step_was_skipped:  # fp16: a step the loss scaler skipped is not a step
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        timer.add("optimizer_s", time.perf_counter() - t0)

        # a stop signal rides on the loss all-reduce: every rank learns of it at the same step, without a
        # collective of its own, whichever rank (or how many) got the signal
        t0 = time.perf_counter()
        stop = float(preempt.stop_signal() is not None)
        reduced = accelerator.reduce(
            torch.tensor([step_loss, stop], dtype=torch.float64, device=accelerator.device), reduction="sum"
        )
        loss_value = float(reduced[0]) / max(1, global_targets)
        stopping = float(reduced[1]) > 0
        timer.add("loss_sync_s", time.perf_counter() - t0)
        if not math.isfinite(loss_value):
            raise FineflowError(
                f"training stopped at step {step}: the loss is {loss_value}. Lower train.lr "
                f"(now {cfg.lr}) or check the data for empty responses."
            )
        tokens_seen += step_real

        step_eval = None
        if eval_shard is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
            t0 = time.perf_counter()
            step_eval = eval_loss = evaluate_loss(
                model, eval_shard, cfg.micro_batch_size, accelerator, varlen=cfg.attention == "varlen"
            )
            timer.add("train_eval_s", time.perf_counter() - t0)
        if stopping or saver.due(step, cfg.steps, accelerator):  # stopping: the same on every rank
            t0 = time.perf_counter()  # the stall: async saves block only for the copy to host memory
            saver.save(
                accelerator,
                model,
                optimizer,
                scheduler,
                step,
                {
                    "step": step,
                    "total_steps": cfg.steps,
                    "sampler": prepared.sampler_state,
                    "tokens_seen": tokens_seen,
                    "loss": loss_value,
                },
                step_eval,
            )
            timer.add("checkpoint_s", time.perf_counter() - t0)

        t0 = time.perf_counter()
        step_s = t0 - step_start
        record = {
            "step": step,
            "loss": round(loss_value, 5),
            "lr": scheduler.get_last_lr()[0],
            # DeepSpeed clips inside its engine step; accelerate hands back the engine's norm (or None)
            "grad_norm": round(float(grad_norm), 5) if grad_norm is not None else None,
            "rows": prepared.rows,
            "tokens": step_real,
            "tokens_per_s": round(step_real / step_s, 1),
            "step_s": round(step_s, 5),
            **{k: round(v, 5) for k, v in timer.current.items() if k != "log_s"},
            "peak_mem_mb": round(peak_memory_mb(accelerator.device), 1),
        }
        if step_eval is not None:
            record["eval_loss"] = round(step_eval, 5)
        if accelerator.is_main_process:
            step_log.log(record)
            accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}, step=step)
            if progress is not None:
                progress.update(step, record)
        timer.add("log_s", time.perf_counter() - t0)
        if stopping:
            if saver.manager is not None:
                saver.manager.wait()  # rank 0: the step's checkpoint is published before the process exits
            accelerator.end_training()  # trackers flushed, as at a normal end
            raise preempt.Preempted(step, preempt.stop_signal())
    return FitResult(
        cfg.steps,
        loss_value,
        eval_loss,
        tokens_seen,
        time.perf_counter() - started,
        timer,
        peak_memory_mb(accelerator.device),
        start_step,
    )
