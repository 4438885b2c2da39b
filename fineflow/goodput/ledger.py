"""The goodput ledger: a run's wall time, from its start to its ledger, split into buckets.

Built by the goodput stage (the last in dvc.yaml, so the flow, ``dvc repro`` and ``fineflow ci`` all write it)
from the run's journal (fineflow.core.journal: each stage process's start, end and timed spans) and the train
stage's report and step log.

- Between stage processes (and before the first one, after the last one) the time is **orchestration**: DVC
  and Prefect deciding, hashing and starting, and any waiting. It closes the timeline, so the 1% check is about
  the other side: inside each process its own timers must cover its wall time; what they miss is
  ``unaccounted_s``, reported, never folded into a bucket.
- An attempt that failed (a crash, a kill, a preemption, a bad input fixed later) is **restart loss**: its whole
  wall time, the wait before its retry, and a resume's checkpoint load, less the steps of it that the finished
  training kept (its step log lines up to the step resumed from: useful work). The steps it lost past its last
  checkpoint are in its wall time; the resume's training them again is useful work, counted once.
- A cluster launcher's own time (train.launcher ray or slurm: connecting, placing the ranks, waiting for nodes,
  restarting a lost rank group) is **engine**, from its ``engine_*`` spans, taken out of the launcher's span
  that contains it; the work a failed rank group did before the restart is restart loss.
- Lines a run that crashed before its ledger left in the journal are counted by the next run's ledger, whose
  total then includes the crashed run's time (the idle time between the two runs is excluded, and said).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from fineflow.core import journal
from fineflow.errors import APPROVAL_NEEDED_EXIT

BUCKETS = (
    "orchestration",
    "startup",
    "engine",
    "model_load",
    "base_pretrain",
    "validation",
    "tokenization",
    "reference_logps",
    "compute",
    "rollout",
    "reward",
    "data_wait",
    "grad_sync",
    "checkpoint",
    "train_eval",
    "logging",
    "evaluation",
    "promotion",
    "export",
    "restart_loss",
)
PRODUCTIVE = "compute"
DESCRIPTIONS = {
    "orchestration": "DVC and Prefect between stages, workspace waits, the base fingerprint, this ledger",
    "startup": "process start-up and imports, params, train planning, accelerate launch, rank set-up and exit",
    "engine": "a cluster engine's own time (train.launcher ray/slurm): connecting, placing the ranks, restarts",
    "model_load": "loading the base model and building the trainable model",
    "base_pretrain": "pretraining the embedded base model (stage base)",
    "validation": "data generation and validation (stages data, validate)",
    "tokenization": "tokenizing and packing shards (stage tokenize)",
    "reference_logps": "an objective's reference model scoring the train and eval pairs once (stage reference_logps), "
    "and online RL's reference forwards over each step's completions",
    "rollout": "online RL: generating each step's completions with the policy",
    "reward": "online RL: the rewards scoring each step's completions",
    "compute": "forward + backward + optimizer step: the useful work",
    "data_wait": "the training loop waiting for its next batch",
    "grad_sync": "gradient all-reduce (DDP) and the per-step loss/token-count all-reduces",
    "checkpoint": "the loop blocked on checkpoint saves, and the final model write",
    "train_eval": "validation loss inside training (train.eval_every)",
    "logging": "the step log, tracker, progress lines and charts",
    "evaluation": "the evaluation stage (lm-eval)",
    "promotion": "the promotion gate and registry (stage promote)",
    "export": "the champion's GGUF files written and parity-checked (stage export)",
    "restart_loss": "failed and killed attempts (less the steps a resume kept), waits before retries, resume loads",
}
STAGE_BODY = {
    "base": "base_pretrain",
    "fingerprint": "orchestration",
    "data": "validation",
    "validate": "validation",
    "tokenize": "tokenization",
    "reference_logps": "reference_logps",
    "evaluate": "evaluation",
    "promote": "promotion",
    "export": "export",
    "goodput": "orchestration",
}
# the train launcher's spans (fineflow.stages.train.rank_spans) and every stage's generic ones
SPAN_BUCKET = {
    "workspace_wait": "orchestration",
    "dvc_commit": "orchestration",  # a train stage launched by hand records itself in dvc.lock
    "params": "startup",
    "report": "startup",
    "launch": "startup",
    "rank_startup": "startup",
    "setup": "startup",
    "rank_exit": "startup",
    "model_load": "model_load",
    "resume_load": "restart_loss",
    "save": "checkpoint",
    "plots": "logging",
    "probe": "logging",
    "loop_data_wait": "data_wait",
    "loop_compute": "compute",
    "loop_optimizer": "compute",
    "loop_grad_sync": "grad_sync",
    "loop_loss_sync": "grad_sync",
    "loop_train_eval": "train_eval",
    "loop_rollout": "rollout",
    "loop_reward": "reward",
    "loop_reference": "reference_logps",
    "loop_checkpoint": "checkpoint",
    "loop_log": "logging",
    # a cluster launcher's (fineflow.train.engines): connecting, placing the ranks, waiting for nodes, restarting
    # them; the work a failed rank group did before its failure is lost like a failed attempt's
    "engine_connect": "engine",
    "engine_placement": "engine",
    "engine_queue": "engine",
    "engine_restarts": "engine",
    "engine_requeue": "engine",  # Slurm: a requeued job's wait for its new allocation
    "engine_lost": "restart_loss",
}
# the spans a cluster engine's time happens inside (launched -> rank 0's process start): they keep the rest
ENGINE_PREFIX = "engine_"
HOLDS_ENGINE_TIME = ("launch", "ranks")
# the per-step keys of a step log line, and their buckets (a crashed attempt's kept steps are credited by them)
STEP_BUCKET = {
    "data_wait_s": "data_wait",
    "compute_s": "compute",
    "optimizer_s": "compute",
    "grad_sync_s": "grad_sync",
    "loss_sync_s": "grad_sync",
    "train_eval_s": "train_eval",
    "checkpoint_s": "checkpoint",
    "rollout_s": "rollout",
    "reward_s": "reward",
    "reference_s": "reference_logps",
}
# promote's APPROVAL_NEEDED_EXIT: it succeeded and waits for a person (the wait itself is between processes)
SUCCEEDED = (0, APPROVAL_NEEDED_EXIT)


def _process_run(run: str) -> tuple[str, int, float] | None:
    """("dvc", pid, start) of a run named after a process (fineflow.core.journal.run_identity), else None."""
    parts = run.rsplit("-", 2)
    if len(parts) == 3 and parts[0] in ("dvc", "process"):
        try:
            return parts[0], int(parts[1]), float(parts[2])
        except ValueError:
            return None
    return None


def same_runs(runs: list[str]) -> dict[str, str]:
    """Each run id -> the id it is the same run as. Every stage process reads the start time of the `dvc repro`
    above it from the clock itself, so ids of one process can differ in the last digit (clock reads, NTP slewing
    the wall clock during a long run): the same pid started within a second is the same run."""
    canonical: dict[str, str] = {}
    seen: list[tuple[str, tuple[str, int, float]]] = []
    for run in runs:
        key = _process_run(run)
        match = next(
            (first for first, other in seen if key and other[:2] == key[:2] and abs(other[2] - key[2]) < 1.0), None
        )
        canonical[run] = match or run
        if match is None and key is not None:
            seen.append((run, key))
    return canonical


def attempts_of(records: list[dict], alive_dir: Path) -> list[dict]:
    """The journal's attempts, in start order: start and end joined; a killed one ends at its last heartbeat."""
    starts, ends, discarded = {}, {}, set()
    for record in records:
        if record.get("event") == "start":
            starts[record["attempt"]] = record
        elif record.get("event") == "end":
            ends[record["attempt"]] = record
        elif record.get("event") == "discard":
            discarded.add(record["attempt"])
    starts = {key: start for key, start in starts.items() if key not in discarded}
    attempts = []
    for key, start in starts.items():
        end = ends.get(key)
        if end is not None:
            t_end, exit_code, spans = end["t"], end.get("exit"), end.get("spans", {})
        else:
            beat = journal.heartbeat_path(alive_dir, key)
            t_end = beat.stat().st_mtime if beat.exists() else start["t"]
            exit_code, spans = None, {}
        attempts.append(
            {
                "attempt": key,
                "stage": start["stage"],
                "run": start["run"],
                "run_started": start.get("run_started", start["proc_start"]),
                "proc_start": start["proc_start"],
                "entry": start["t"],
                "end": max(t_end, start["t"]),
                "exit": exit_code,
                "spans": spans,
                "finished": end is not None,
            }
        )
    return sorted(attempts, key=lambda a: a["proc_start"])


def kept_step_credit(steps_log: Path | None, resumed_from: int) -> tuple[dict, int]:
    """Buckets of the steps a resumed training kept from its crashed attempts (step log lines <= the step it
    resumed from), and how many."""
    credit: dict[str, float] = defaultdict(float)
    if not resumed_from or steps_log is None or not Path(steps_log).is_file():
        return {}, 0
    kept = 0
    for line in Path(steps_log).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("step", 0) > resumed_from:
            break
        kept += 1
        for key, bucket in STEP_BUCKET.items():
            credit[bucket] += float(record.get(key) or 0.0)
    return dict(credit), kept


@dataclass
class _Tally:
    """What build() adds up while it walks each run's attempts in order."""

    buckets: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    total: float = 0.0
    unaccounted: float = 0.0  # inside finished processes, time no timer split
    excluded: float = 0.0  # waits for a person's approval
    train_walls: float = 0.0
    failed_train_s: float = 0.0
    failed: list[dict] = field(default_factory=list)


def build(
    records: list[dict],
    alive_dir: Path,
    current_run: str,
    now: float,
    train_report: dict | None = None,
    steps_log: Path | None = None,
) -> dict:
    """The ledger of the journal's attempts (see the module docstring); current_run's time ends at `now`."""
    attempts, current_run = _attempts_by_canonical_run(records, alive_dir, current_run)
    tally = _Tally()
    runs: dict[str, list[dict]] = defaultdict(list)
    for attempt in attempts:
        runs[attempt["run"]].append(attempt)
    for run, members in runs.items():
        _count_run(tally, members, now, current=run == current_run)
    finished_train = any(a["stage"] == "train" and a["exit"] in SUCCEEDED for a in attempts)
    kept_steps = 0
    if train_report and tally.failed_train_s and finished_train:
        kept_steps = _credit_kept_steps(tally, train_report, steps_log)
    trained = (train_report or {}) if finished_train else None
    return _ledger(tally, attempts, sorted(runs), current_run, trained, kept_steps)


def _attempts_by_canonical_run(records: list[dict], alive_dir: Path, current_run: str) -> tuple[list[dict], str]:
    """The journal's attempts and the current run's id, every run id replaced by the one it is the same run as."""
    attempts = attempts_of(records, alive_dir)
    canonical = same_runs([current_run, *(a["run"] for a in attempts)])
    for attempt in attempts:
        attempt["run"] = canonical[attempt["run"]]
    return attempts, canonical[current_run]


def _count_run(tally: _Tally, members: list[dict], now: float, current: bool) -> None:
    """One run's time, from its start to its last attempt's end (the current run's: to now), into buckets: the
    gaps between its attempts, then each attempt, failed or not."""
    start = min(min(a["proc_start"] for a in members), members[0]["run_started"])
    end = now if current else max(a["end"] for a in members)
    tally.total += end - start
    cursor, previous_failed, waited_for_person = start, False, False
    for attempt in members:
        gap = max(0.0, attempt["proc_start"] - cursor)
        if waited_for_person:  # promote asked for approval: the wait for a person holds no device
            tally.excluded += gap
            tally.total -= gap
        else:
            tally.buckets["restart_loss" if previous_failed else "orchestration"] += gap
        waited_for_person = attempt["exit"] == APPROVAL_NEEDED_EXIT
        wall = attempt["end"] - attempt["proc_start"]
        if attempt["stage"] == "train":
            tally.train_walls += wall
        # the current run's goodput attempt is this ledger's own process, still running
        previous_failed = (
            attempt["exit"] not in SUCCEEDED
            and attempt["end"] < now
            and not (current and attempt["stage"] == "goodput")
        )
        if previous_failed:
            _count_failed(tally, attempt, wall)
        else:
            _count_spans(tally, attempt)
        cursor = max(cursor, attempt["end"])
    if current:
        tally.buckets["orchestration"] += max(0.0, end - cursor)


def _count_failed(tally: _Tally, attempt: dict, wall: float) -> None:
    """A failed or killed attempt: its whole wall time is restart loss (until a resume's kept steps are credited)."""
    tally.buckets["restart_loss"] += wall
    tally.failed.append({k: attempt[k] for k in ("stage", "run", "exit", "attempt")} | {"wall_s": round(wall, 3)})
    if attempt["stage"] == "train":
        tally.failed_train_s += wall


def _count_spans(tally: _Tally, attempt: dict) -> None:
    """A finished (or still running) attempt: its start-up, then its spans into their buckets; what they miss is
    unaccounted."""
    body = attempt["end"] - attempt["entry"]
    tally.buckets["startup"] += attempt["entry"] - attempt["proc_start"]
    measured = 0.0
    for name, seconds in without_engine_overlap(attempt["spans"]).items():
        if name == "body":
            tally.buckets[STAGE_BODY.get(attempt["stage"], "orchestration")] += seconds
        elif name in SPAN_BUCKET or name.startswith(ENGINE_PREFIX):  # a launcher's other engine_* time: engine
            tally.buckets[SPAN_BUCKET.get(name, "engine")] += seconds
        else:  # loop_other, a rank's time without its report: no timer split it
            tally.unaccounted += seconds
        measured += seconds
    if attempt["finished"]:
        tally.unaccounted += body - measured
    else:  # this ledger's own process: up to now it has been building the ledger
        tally.buckets["orchestration"] += body


def without_engine_overlap(spans: dict) -> dict:
    """The spans with a cluster engine's time taken out of the launcher's span that contains it: `launch`
    (planning to rank 0's process start, from the report) holds the engine's connecting, placement and
    restarts, which the engine_* spans measure; counted once, in their own buckets."""
    engine = sum(seconds for name, seconds in spans.items() if name.startswith(ENGINE_PREFIX))
    holder = next((name for name in HOLDS_ENGINE_TIME if name in spans), None)
    if not engine or holder is None:
        return spans
    return spans | {holder: max(0.0, spans[holder] - engine)}


def _credit_kept_steps(tally: _Tally, train_report: dict, steps_log: Path | None) -> int:
    """Move the crashed train attempts' steps that the finished training kept from restart loss to their
    buckets (useful work), at most the crashed attempts' wall time; how many steps."""
    credit, kept_steps = kept_step_credit(steps_log, int(train_report.get("resumed_from_step") or 0))
    scale = min(1.0, tally.failed_train_s / max(sum(credit.values()), 1e-9))
    for bucket, seconds in credit.items():
        tally.buckets[bucket] += seconds * scale
        tally.buckets["restart_loss"] -= seconds * scale
    return kept_steps


def _ledger(
    tally: _Tally, attempts: list[dict], runs: list[str], current_run: str, train_report: dict | None, kept: int
) -> dict:
    """The ledger's JSON: totals, buckets and shares, the attempts, what restarts cost. train_report: the train
    stage's report ({} without one) when a training finished in this window, else None (an older run's says
    nothing here)."""
    total, buckets = tally.total, tally.buckets
    ledger = {
        "total_s": round(total, 3),
        "buckets": {name: round(seconds, 3) for name, seconds in buckets.items()},
        "unaccounted_s": round(tally.unaccounted, 3),
        "unaccounted_share": round(tally.unaccounted / total, 5) if total else 0.0,
        "goodput": round(buckets[PRODUCTIVE] / total, 5) if total else 0.0,
        "train_goodput": round(buckets[PRODUCTIVE] / tally.train_walls, 5) if tally.train_walls else None,
        "runs": runs,
        "attempts": _attempt_rows(attempts, current_run),
        "restart": {
            "failed_attempts": tally.failed,
            "kept_steps_credited": kept,
            # lost past the crashed attempt's last checkpoint (in its wall time above) and trained again (useful
            # work now, in their buckets): how many, and what training them again took
            "recomputed_steps": int(train_report.get("recomputed_steps") or 0) if train_report is not None else 0,
            "recomputed_s": round(sum((train_report.get("recomputed") or {}).values()), 3)
            if train_report is not None
            else 0.0,
        },
        "excluded_s": round(tally.excluded, 3),  # waits for a person's approval; the time between runs is never counted
    }
    badput = {name: seconds for name, seconds in ledger["buckets"].items() if name != PRODUCTIVE}
    ledger["biggest_badput"] = max(badput, key=badput.get) if total else None
    return ledger


def _attempt_rows(attempts: list[dict], current_run: str) -> list[dict]:
    """Each attempt as the ledger lists it; this ledger's own process, still running, is not one of them."""
    return [
        {
            "stage": a["stage"],
            "run": a["run"],
            "exit": a["exit"],
            "wall_s": round(a["end"] - a["proc_start"], 3),
            "status": "ok" if a["exit"] in SUCCEEDED else ("killed" if a["exit"] is None else "failed"),
        }
        for a in attempts
        if not (a["run"] == current_run and a["stage"] == "goodput" and not a["finished"])
    ]


def trained_in_window(train_report: dict | None, ledger: dict) -> bool:
    """Whether the train report on disk is of a training this ledger's window ran (not an older run's)."""
    return bool(train_report) and any(a["stage"] == "train" and a["status"] == "ok" for a in ledger["attempts"])


def train_ran(ledger: dict) -> bool:
    """Whether a train attempt ran in this ledger's window, finished or not (a failed one is the run's real
    goodput: its time went to restart loss)."""
    return any(a["stage"] == "train" for a in ledger["attempts"])


# the ledger's figures that measure a training: a run that trained nothing has none of its own
TRAINING_METRICS = ("goodput", "train_goodput", "mfu", "cost.usd_per_1m_tokens")


def carry_forward(ledger: dict, previous_metrics: dict) -> dict:
    """What a run with no train attempt (train was up to date: a promote-only run) reports for its training
    figures: the last training run's, from the metrics it left (reports/metrics/goodput.json), so `dvc metrics
    diff` shows no drop to zero; the run's own wall time, cost and buckets stay its own."""
    return {
        "reason": (
            f"this run trained nothing (the train stage was up to date): its own goodput, {ledger['goodput']}, "
            "measures no training, so the metrics keep the last training run's goodput, train_goodput, MFU and "
            "cost per 1M tokens"
        ),
        "metrics": {key: previous_metrics.get(key) for key in TRAINING_METRICS},
    }


def train_facts(train_report: dict) -> dict:
    """What the doctor reads of the training (the ledger carries it, so the ledger alone is enough)."""
    keys = (
        "steps",
        "tokens_this_attempt",
        "tokens_per_s",
        "loop_s",
        "loop_totals",
        "world_size",
        "precision",
        "method",
        "attention",
        "micro_batch_size",
        "grad_accum",
        "gradient_checkpointing",
        "peak_mem_mb",
        "device",
        "flops",
        "grad_sync_measured",
        "resumed_from_step",
        "recomputed_steps",
        "preprocess_s",
        "settings",
        "objective",  # named by a report of an objective other than sft
        "rollouts",  # an online objective's rollout sums over the attempt (groups, flat groups, reward errors)
    )
    facts = {key: train_report.get(key) for key in keys if key in train_report}
    plan = train_report.get("plan") or {}
    facts["plan"] = {
        "total_gib": (plan.get("gib") or {}).get("total"),
        "device_bytes": plan.get("device_bytes"),
        "changes": plan.get("changes"),
    }
    return facts


def consume(directory: Path, run: str) -> Path | None:
    """Move the journal's lines (this ledger's window) to runs/<time>-<run>.jsonl, and forget the heartbeats
    of the attempts they hold: the next ledger starts from a clean journal."""
    path = Path(directory) / journal.JOURNAL_FILE
    if not path.is_file():
        return None
    consumed = {record.get("attempt") for record in journal.read(directory)}
    target = Path(directory) / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{run}.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, target)
    for attempt in consumed:
        if attempt:
            journal.heartbeat_path(directory, attempt).unlink(missing_ok=True)
    return target
