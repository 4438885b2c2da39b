"""A run's journal: every stage process says when it started, when it ended and where its time went.

Each stage process (not a training rank: its launcher speaks for it) appends two lines to
``reports/ledger/journal.jsonl``: ``start`` (the process's creation time, the moment its entry began, the run it
belongs to) and ``end`` (the time, the exit code, and the seconds its own timers measured, by bucket). While it
runs, a heartbeat file under ``reports/ledger/alive/`` is touched every few seconds, so an attempt killed with
SIGKILL, which writes no end, still has one: its heartbeat's last touch.

The goodput stage (``fineflow.goodput.ledger``) turns the lines into ``reports/goodput.json`` and moves them to
``reports/ledger/runs/``. Lines it has not consumed yet (a run that crashed before reaching it) stay, so the next
run's ledger counts the crashed attempt as restart loss.

A run is one flow run or one ``fineflow ci`` (``FINEFLOW_RUN_ID`` / ``FINEFLOW_RUN_STARTED``, set by them), else
the ``dvc repro`` (or ``dvc exp run``) process that started the stage, by pid and creation time, else the stage
process alone (run by hand).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path

RUN_ID_ENV = "FINEFLOW_RUN_ID"
RUN_STARTED_ENV = "FINEFLOW_RUN_STARTED"
HEARTBEAT_S = 2.0
JOURNAL_FILE = "journal.jsonl"


def ledger_dir(report: str | Path) -> Path:
    """reports/<stage>.json -> reports/ledger (beside reports/metrics)."""
    return Path(report).parent / "ledger"


def process_started(pid: int | None = None) -> float:
    """When the process was created (epoch seconds): its interpreter start-up and imports count from here.

    On Linux from /proc/<pid>/stat's start time (clock ticks since boot) against CLOCK_BOOTTIME, on time.time()'s
    clock to the tick (psutil's create_time adds a boot time truncated to whole seconds: up to 1 s early)."""
    try:
        fields = Path(f"/proc/{pid or os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
        started_since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started_since_boot)
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc: the best the clock allows
        return time.time()


def _is_dvc_run(cmdline: list[str]) -> bool:
    names = [Path(arg).name for arg in cmdline[:3]]
    return "dvc" in names and any(arg in ("repro", "exp") for arg in cmdline[1:4])


def _parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) or None
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode("utf-8", "replace").split("\0")
    except OSError:
        return []


def run_identity() -> tuple[str, float]:
    """(run id, when the run started): the flow's or fineflow ci's, else the ancestor dvc process's (Linux's
    /proc), else this process's own."""
    if os.environ.get(RUN_ID_ENV):
        try:
            started = float(os.environ.get(RUN_STARTED_ENV) or "")
        except ValueError:
            started = process_started()
        return os.environ[RUN_ID_ENV], started
    pid = _parent_of(os.getpid())
    while pid and pid > 1:
        if _is_dvc_run(_cmdline(pid)):
            started = process_started(pid)
            return f"dvc-{pid}-{started:.2f}", started
        pid = _parent_of(pid)
    started = process_started()
    return f"process-{os.getpid()}-{started:.2f}", started


def run_environment(run_id: str | None = None, started: float | None = None) -> dict[str, str]:
    """What a flow run or fineflow ci puts in its stages' environment: they are one run."""
    return {RUN_ID_ENV: run_id or uuid.uuid4().hex[:16], RUN_STARTED_ENV: repr(started or time.time())}


def append(directory: Path, record: dict) -> None:
    """One line, appended in one write (O_APPEND): lines of processes that follow each other never mix."""
    directory.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8")
    fd = os.open(directory / JOURNAL_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read(directory: Path) -> list[dict]:
    """The journal's lines (a torn last line, from a kill in the middle of a write, is skipped)."""
    path = Path(directory) / JOURNAL_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def heartbeat_path(directory: Path, attempt: str) -> Path:
    return Path(directory) / "alive" / attempt


class Attempt:
    """One stage process in the journal: ``start()`` when its entry begins, ``end()`` when it returns.

    ``spans`` is what the process's own timers measured, bucket -> seconds (fineflow.goodput.ledger names the
    buckets); time between the entry and the end that no span covers is reported as unaccounted."""

    def __init__(self, directory: Path, stage: str):
        self.directory = Path(directory)
        self.stage = stage
        self.attempt = uuid.uuid4().hex[:12]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        run, run_started = run_identity()
        append(
            self.directory,
            {
                "event": "start",
                "attempt": self.attempt,
                "stage": self.stage,
                "run": run,
                "run_started": run_started,
                "pid": os.getpid(),
                "proc_start": process_started(),
                "t": time.time(),
            },
        )
        beat = heartbeat_path(self.directory, self.attempt)
        beat.parent.mkdir(parents=True, exist_ok=True)
        beat.touch()
        self._thread = threading.Thread(target=self._beat, args=(beat,), name="fineflow-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, path: Path) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                path.touch()
            except OSError:  # the disk is full or the folder went away: the end record still comes
                pass

    def end_quietly(self, exit_code: int, spans: dict) -> None:
        """end(), never raising (the stage's own exit code stands); a span "discard" drops the attempt from
        every ledger (a stage that found another run's workspace and did nothing)."""
        try:
            if spans.pop("discard", None):
                self._stop.set()
                append(self.directory, {"event": "discard", "attempt": self.attempt, "t": time.time()})
                heartbeat_path(self.directory, self.attempt).unlink(missing_ok=True)
            else:
                self.end(exit_code, spans)
        except Exception as exc:  # noqa: BLE001 - bookkeeping
            print(f"fineflow {self.stage}: warning: the run's journal was not written: {exc}", file=sys.stderr)

    def end(self, exit_code: int, spans: dict | None = None, extra: dict | None = None) -> None:
        self._stop.set()
        record = {"event": "end", "attempt": self.attempt, "stage": self.stage, "t": time.time(), "exit": exit_code}
        if spans:
            record["spans"] = {key: round(float(value), 4) for key, value in spans.items()}
        if extra:
            record.update(extra)
        try:
            append(self.directory, record)
        finally:
            heartbeat_path(self.directory, self.attempt).unlink(missing_ok=True)
