"""The training loop: one readable ``fit()`` on accelerate, fed from packed shards.

Side effects go through objects handed to ``fit``: a ``BatchLoader`` (batches prepared ahead on a thread),
a ``StepTimer`` (where each step's time went), a ``StepLog`` (the per-step JSONL that ``dvc plots``
renders), a ``Progress`` (a rich bar with tokens/s and ETA on a terminal, log lines elsewhere) and a
``Checkpointer`` (atomic safetensors saves). Metrics also go to accelerate's trackers (TensorBoard by
default) through ``accelerator.log``. The loop itself only computes.

Loss is token-weighted across micro-batches and data-parallel ranks: each optimizer step divides the summed
cross-entropy by the number of trained tokens in the whole global batch, so 1 process and N processes with
the same global batch take the same step.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path


from fineflow.config import TrainParams
from fineflow.errors import FineflowError
from fineflow.loader import BatchLoader, collate
from fineflow.shards import PackedShard


def lr_multiplier(step: int, warmup: int, total: int, schedule: str) -> float:
    """Linear warmup, then cosine or linear decay to 10% (or constant); step is 0-based."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return 0.1 + 0.9 * decay


def token_loss_sum(model, batch: dict):
    """Summed next-token cross-entropy over trained tokens, and how many there were.

    No attention_mask is passed: with position_ids that restart per example, transformers builds a
    block-diagonal causal mask, so packed examples never attend to each other.
    """
    import torch.nn.functional as F

    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    targets = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), targets.reshape(-1),
                           ignore_index=-100, reduction="sum")
    return loss, int((targets != -100).sum())


@dataclass
class StepTimer:
    """Where a step's wall time went: waiting for data, forward+backward, optimizer, checkpoint stall."""

    totals: dict = field(default_factory=lambda: {"data_wait_s": 0.0, "compute_s": 0.0, "optimizer_s": 0.0,
                                                  "checkpoint_s": 0.0})
    current: dict = field(default_factory=dict)

    def start_step(self) -> None:
        self.current = {key: 0.0 for key in self.totals}

    def add(self, key: str, seconds: float) -> None:
        self.current[key] += seconds
        self.totals[key] += seconds


class StepLog:
    """Per-step JSONL (loss, lr, tokens/s, timings); rank 0 only. dvc.yaml declares it as a plot."""

    def __init__(self, path: Path | None):
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = path.open("w", encoding="utf-8")

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

    def __init__(self, total: int, log_every: int, log=print, enabled: bool = True):
        self.total, self.log_every, self.log = total, log_every, log
        self.started = time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn

            self.bar = Bar(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                           TextColumn("ETA"), TimeRemainingColumn(), transient=False)
            self.task = self.bar.add_task("train", total=total, status="")
            self.bar.start()

    def eta_s(self, step: int) -> float:
        return (time.perf_counter() - self.started) / step * (self.total - step)

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


class Checkpointer:
    """Saves the trainable weights (the adapter, never the frozen base) and loop state, atomically.

    Each checkpoint is written into a temporary sibling directory and renamed into place, so a crash
    never leaves a half-written ``step-N`` directory. Only the main process writes.
    """

    def __init__(self, root: Path | None, every: int, method: str = "lora"):
        self.root, self.every, self.method = root, every, method

    def due(self, step: int) -> bool:
        """The same answer on every rank: ranks must agree, since validation before a save is collective."""
        return step % self.every == 0

    def save(self, accelerator, model, step: int, state: dict) -> None:
        if self.root is None or not accelerator.is_main_process:
            return
        final = self.root / f"step-{step:07d}"
        tmp = self.root / f".tmp-step-{step:07d}"
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        if self.method == "full":
            unwrapped.save_pretrained(tmp, safe_serialization=True)
        else:
            save_adapter(unwrapped, tmp)
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)


@dataclass
class FitResult:
    steps: int
    final_loss: float
    eval_loss: float | None
    tokens: int  # real (trained-on or attended, non-pad) tokens processed, summed over ranks
    wall_s: float
    timer: StepTimer
    peak_mem_mb: float = 0.0


def evaluate_loss(model, shard: PackedShard, batch_size: int, accelerator) -> float:
    """Mean token loss over an eval shard, this rank's share of rows, reduced across ranks."""
    import torch

    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        rows = list(range(accelerator.process_index, len(shard), accelerator.num_processes))
        for i in range(0, len(rows), batch_size):
            batch = {k: v.to(accelerator.device) for k, v in collate(shard, rows[i:i + batch_size]).items()}
            loss_sum, n = token_loss_sum(model, batch)
            total += torch.tensor([loss_sum.item(), n], dtype=torch.float64, device=accelerator.device)
    total = accelerator.reduce(total, reduction="sum")
    model.train()
    return float(total[0] / max(1.0, float(total[1])))


def fit(model, optimizer, scheduler, accelerator, batches: BatchLoader, cfg: TrainParams, timer: StepTimer,
        step_log: StepLog, checkpointer: Checkpointer, eval_shard: PackedShard | None = None,
        progress: Progress | None = None) -> FitResult:
    """Run cfg.steps optimizer steps on the batches the loader prepares; returns the report's figures."""
    import torch

    model.train()
    started = time.perf_counter()
    tokens_seen, loss_value = 0, float("nan")
    world = accelerator.num_processes
    for step in range(1, cfg.steps + 1):
        timer.start_step()
        step_start = time.perf_counter()

        t0 = time.perf_counter()
        prepared = next(batches)  # blocks only if the loader thread has fallen behind
        timer.add("data_wait_s", time.perf_counter() - t0)

        t0 = time.perf_counter()
        micro = [{k: v.to(accelerator.device, non_blocking=True) for k, v in b.items()} for b in prepared.micro]
        counts = accelerator.reduce(torch.tensor([prepared.targets, prepared.real_tokens],
                                                 device=accelerator.device), reduction="sum")
        global_targets, step_real = int(counts[0]), int(counts[1])
        step_loss = 0.0
        for i, batch in enumerate(micro):
            # DDP averages gradients over ranks; scale by world size so the result is sum / global tokens.
            sync = accelerator.no_sync(model) if i < len(micro) - 1 else nullcontext()
            with sync:
                loss_sum, _ = token_loss_sum(model, batch)
                accelerator.backward(loss_sum * world / max(1, global_targets))
            step_loss += loss_sum.item()
        timer.add("compute_s", time.perf_counter() - t0)

        t0 = time.perf_counter()
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        timer.add("optimizer_s", time.perf_counter() - t0)

        reduced = accelerator.reduce(torch.tensor([step_loss], dtype=torch.float64, device=accelerator.device),
                                     reduction="sum")
        loss_value = float(reduced[0]) / max(1, global_targets)
        if not math.isfinite(loss_value):
            raise FineflowError(f"training stopped at step {step}: the loss is {loss_value}. Lower train.lr "
                                f"(now {cfg.lr}) or check the data for empty responses.")
        tokens_seen += step_real

        eval_loss = None
        if eval_shard is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
            eval_loss = evaluate_loss(model, eval_shard, cfg.micro_batch_size, accelerator)
        if checkpointer.due(step) or step == cfg.steps:
            t0 = time.perf_counter()
            checkpointer.save(accelerator, model, step, {"step": step, "sampler": prepared.sampler_state,
                                                          "tokens_seen": tokens_seen, "loss": loss_value})
            timer.add("checkpoint_s", time.perf_counter() - t0)

        step_s = time.perf_counter() - step_start
        record = {"step": step, "loss": round(loss_value, 5), "lr": scheduler.get_last_lr()[0],
                  # DeepSpeed clips inside its engine and hands back no norm
                  "grad_norm": round(float(grad_norm), 5) if grad_norm is not None else None,
                  "tokens": step_real, "tokens_per_s": round(step_real / step_s, 1), "step_s": round(step_s, 5),
                  **{k: round(v, 5) for k, v in timer.current.items()},
                  "peak_mem_mb": round(peak_memory_mb(accelerator.device), 1)}
        if eval_loss is not None:
            record["eval_loss"] = round(eval_loss, 5)
        if accelerator.is_main_process:
            step_log.log(record)
            accelerator.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=step)
            if progress is not None:
                progress.update(step, record)
    return FitResult(cfg.steps, loss_value, eval_loss, tokens_seen, time.perf_counter() - started, timer,
                     peak_memory_mb(accelerator.device))

