"""What the training loop reports through: where each step's time went (``StepTimer``, a span per phase), the
per-step JSONL (``StepLog``), the console (``Progress``) and the memory peak (``peak_memory_mb``).

``fit()`` (fineflow.train.loop) is handed these objects; the goodput ledger (fineflow.goodput.ledger) reads
the timer's totals from the train report, so its split of the loop's time is the sum of the spans.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


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
        # an online objective's rollout spans (rollout_s, reward_s, reference_s) appear with its first step
        self.current[key] = self.current.get(key, 0.0) + seconds
        self.totals[key] = self.totals.get(key, 0.0) + seconds
        if self._redoing:
            self.redo[key] = self.redo.get(key, 0.0) + seconds

    @contextmanager
    def span(self, key: str):
        """``with timer.span("optimizer_s"):`` - the block's wall time goes to that bucket (this step's and the
        run's); a block that raises adds nothing."""
        started = time.perf_counter()
        yield
        self.add(key, time.perf_counter() - started)

    def move(self, source: str, target: str, seconds: float) -> None:
        """Re-file seconds a span took for one bucket under another: the one phase no span can isolate is
        DDP's gradient all-reduce, which runs inside backward (its comm hook measures it,
        fineflow.train.gradsync), so it is moved from compute to grad_sync afterwards."""
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
