"""Stopping a run on a signal: promptly, at every layer, without orphans, and resumably.

Where signals come from (Linux): Ctrl-C in a terminal sends SIGINT to the whole foreground process group;
``kill``, Kubernetes evictions, Slurm preemption and spot reclaims send SIGTERM, often to one PID only (PID 1 in
a container). So every layer runs the layer below it in a process group of its own, forwards the first signal to
it once, waits a bounded time and then kills what is left; a signal therefore reaches each process exactly once,
by one path, whichever PID got it:

    flow supervisor (flows/pipeline.py, ``supervise``) -> the flow process, its Prefect server beside it
      -> `dvc repro` (tasks/stages.py, ``stop_group``) -> the train launcher
      -> `accelerate launch` (``run_ranks``) -> the ranks (torch elastic forwards to each rank's own session)

A rank (``install``) only notes the signal in its handler. fit() finishes the step it is on (a step is never cut
in half; steps are short), every rank learns of the stop at that step's end (the flag rides on the loss
all-reduce, so no rank skips a collective), the step is saved and its write awaited, and the stage exits 75
(PREEMPTED_EXIT) leaving a record of the saved step (``write_preempted_record``): a retry resumes from that step,
not from the last periodic checkpoint. A watchdog thread, woken at C level by the signal (``signal.set_wakeup_fd``:
even while the main thread is stuck in a collective), ends the rank when checkpoint.preempt_grace_s runs out.

Budgets: the ranks have the grace; every layer above waits a few seconds longer than the one below it
(``MARGINS_S``), so the lowest layer that can still finish cleanly does. No orphans: accelerate launch and each
rank die with their parent (PR_SET_PDEATHSIG), and the flow's supervisor adopts and kills whatever is left.
This one module holds every layer's part (the flow and the task import it too) so that the chain reads in one
place, and the train stage, whose DVC dependencies list ``fineflow/train``, runs its own part from here.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

# the stage record of a saved stop lives with the other records (fineflow.core.reports); named here for the layers
from fineflow.core.reports import read_preempted_record, write_preempted_record  # noqa: F401
from fineflow.errors import PREEMPTED_EXIT, USER_ERROR_EXIT

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Seconds each layer waits, after the signal, beyond the ranks' grace before it kills the layer below.
MARGINS_S = {"elastic": 2, "launcher": 4, "task": 6, "flow": 15}
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


def budget_s(grace_s: float, layer: str) -> float:
    """How long `layer` waits for the layers below it after a stop signal (see MARGINS_S)."""
    return grace_s + MARGINS_S[layer]


# --- in a rank -------------------------------------------------------------------------------------------


class Preempted(Exception):
    """fit() stopped on a signal after saving `step` (and, on rank 0, waiting for the write)."""

    def __init__(self, step: int, signum: int | None):
        self.step, self.signum = step, signum  # None: another rank got the signal
        super().__init__(f"stopped by {signal_name(signum)} after step {step}, which is saved")


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum is not None else "a stop signal to another rank"


class StopOnSignals:
    """A rank's SIGINT/SIGTERM handling: the handler notes the first signal and nothing more (fit() acts on it
    at the step's end); a watchdog thread exits the process PREEMPTED_EXIT when grace_s has passed since."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s  # read when a signal comes: the stage sets it once params are loaded
        self.signum: int | None = None
        self._previous: dict = {}
        self._wakeup, self._wakeup_in = socket.socketpair()
        self._disarmed = threading.Event()

    def install(self) -> StopOnSignals:
        self._wakeup_in.setblocking(False)  # set_wakeup_fd's requirement: a full buffer must not block a signal
        self._previous_fd = signal.set_wakeup_fd(self._wakeup_in.fileno(), warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._note)
        self._watchdog = threading.Thread(target=self._watch, name="fineflow-preempt-watchdog", daemon=True)
        self._watchdog.start()
        return self

    def uninstall(self) -> None:
        """Previous handlers back and the watchdog off (a rank never needs it: it exits; tests do)."""
        self._disarmed.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd)
        self._wakeup_in.close()  # ends the watchdog's wait for a signal
        self._watchdog.join(timeout=5)
        self._wakeup.close()

    def _note(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum

    def _watch(self) -> None:
        """Woken by the byte the C-level handler writes for every signal, before any Python code runs."""
        while True:
            try:
                data = self._wakeup.recv(64)
            except OSError:
                return
            if not data:  # uninstalled: the write end was closed
                return
            if any(byte in STOP_SIGNALS for byte in data):
                break
        if not self._disarmed.wait(self.grace_s):
            print(
                f"fineflow: checkpoint.preempt_grace_s ({self.grace_s:g}s) ran out before the step was saved; "
                f"exiting {PREEMPTED_EXIT}: a retry resumes from the last complete checkpoint",
                file=sys.stderr,
                flush=True,
            )
            os._exit(PREEMPTED_EXIT)


_active: StopOnSignals | None = None


def install(grace_s: float) -> StopOnSignals:
    """Handle SIGINT/SIGTERM in this rank from now on (main thread only)."""
    global _active
    _active = StopOnSignals(grace_s).install()
    return _active


def uninstall() -> None:
    global _active
    if _active is not None:
        _active.uninstall()
        _active = None


def stop_signal() -> int | None:
    """The signal that asked this process to stop, or None (also when no handler is installed)."""
    return _active.signum if _active is not None else None


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Linux: get sig when the parent process (pid `parent`, when known) dies, so a rank never outlives its
    launcher (a SIGKILLed stage kills its ranks too, as one process group would). Elsewhere a no-op."""
    parent = parent or os.getppid()
    if _prctl(_PR_SET_PDEATHSIG, int(sig)) and os.getppid() != parent:
        os.kill(os.getpid(), sig)  # the parent died before the request took effect


# --- the layers above the ranks --------------------------------------------------------------------------


class StopNote:
    """While active (a context manager; inert outside the main thread, the only one that may set signal
    handlers): the first SIGINT/SIGTERM is noted (signum, and ``at``: its time.monotonic()); later ones are only
    noted too. A cluster driver's wait loop acts on the note (fineflow.train.engines)."""

    def __init__(self):
        self.signum: int | None = None
        self.at: float | None = None
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> bool:
        """Note the signal; true for the first one."""
        if self.signum is not None:
            return False
        self.signum, self.at = signum, time.monotonic()
        return True

    def overdue(self, seconds: float) -> bool:
        return self.at is not None and time.monotonic() - self.at > seconds


class Forwarder(StopNote):
    """A StopNote that also sends the first SIGINT/SIGTERM on to pid (its whole process group when group is true);
    later ones are only noted, since a second signal would abort torch elastic's own orderly shutdown of the
    ranks. ``send`` replaces the signal sent on (None: the one received)."""

    def __init__(self, pid: int, group: bool, send: int | None = None):
        super().__init__()
        self.pid, self.group, self.send = pid, group, send

    def _handle(self, signum, frame) -> bool:
        first = super()._handle(signum, frame)
        if first:
            with contextlib.suppress(ProcessLookupError):
                (os.killpg if self.group else os.kill)(self.pid, self.send or signum)
        return first


class StopStage(Forwarder):
    """The Prefect task's part while `dvc repro` runs: the first SIGINT/SIGTERM sends SIGINT to the stage's
    process group (pid's) from the handler itself, then goes on as the handler it replaced would
    (KeyboardInterrupt, Prefect's TerminationSignal). Sending it here, not in the code that catches the
    exception, means the stage stops even when that exception is lost on its way up (library code that catches
    BaseException; asyncio, which swaps in its own SIGINT handler while a coroutine runs in the main thread,
    cancels the coroutine instead). Later signals are only noted: one must not cut the stop's bounded wait
    short. ``signum`` tells the task afterwards that the flow was stopped."""

    def __init__(self, pid: int):
        super().__init__(pid, group=True, send=signal.SIGINT)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            return
        super()._handle(signum, frame)
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)  # raises: KeyboardInterrupt, TerminationSignal
        raise KeyboardInterrupt(f"stopped by {signal_name(signum)}")


def descendants(pid: int) -> list:
    """psutil.Process objects of pid's descendants (they remember their start time: never a reused pid)."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_tree(proc: subprocess.Popen, processes: list, group: bool) -> None:
    """SIGKILL proc (its process group when group is true) and the given descendants, then reap proc."""
    import psutil

    with contextlib.suppress(ProcessLookupError, PermissionError):
        (os.killpg if group else os.kill)(proc.pid, signal.SIGKILL)
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()
    proc.wait()


def wait_bounded(proc: subprocess.Popen, forwarder: Forwarder, seconds: float, group: bool) -> int:
    """proc's exit code; once a signal was forwarded, wait at most `seconds` after it, then kill proc's tree."""
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            if forwarder.overdue(seconds):
                print(f"fineflow: still running {seconds:g}s after the stop signal: killing it", file=sys.stderr)
                kill_tree(proc, descendants(proc.pid), group)
                return proc.returncode


def _launched_by_launcher() -> None:
    """accelerate launch, between fork and exec: dies with the launcher, and ignores the stop signals, which
    the launcher forwards to its whole process group: a one-process launch (accelerate's simple launcher, which
    would die of them and take its rank along) must outlive the rank's save. torch elastic (N ranks) installs
    its own handlers, which forward to the ranks. Safe between fork and exec: two system calls, no lock taken
    (libc is loaded beforehand)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


def run_ranks(argv: list[str], env: dict[str, str], grace_s: float, log=print) -> int:
    """The train launcher's `accelerate launch` (argv), in a process group of its own: the first SIGINT/SIGTERM
    the launcher gets goes to that group once; it is killed budget_s(grace, "launcher") after. Returns its exit
    code (128 + signal when it had to be killed)."""
    # torch elastic's wait before it SIGKILLs the ranks it asked to stop (default 30 s): just beyond the grace
    env = {**env, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(math.ceil(budget_s(grace_s, "elastic")))}
    _libc()  # loaded here: between fork and exec only the call is made
    proc = subprocess.Popen(
        argv, env=env, start_new_session=True, preexec_fn=_launched_by_launcher, stderr=subprocess.PIPE
    )
    relay = threading.Thread(target=relay_launcher_stderr, args=(proc.stderr, sys.stderr), daemon=True)
    relay.start()
    with Forwarder(proc.pid, group=True) as forwarder:
        code = wait_bounded(proc, forwarder, budget_s(grace_s, "launcher"), group=True)
    relay.join(timeout=5)  # the ranks' last lines (a rank outliving the launcher is killed with it)
    if forwarder.signum is not None:
        log(f"train: {signal.Signals(forwarder.signum).name} forwarded to the ranks; accelerate exited {code}")
    return 128 - code if code < 0 else code


# A rank's user error (exit 2: its message already printed) makes the launcher raise: accelerate's simple launcher
# a CalledProcessError, torch elastic a ChildFailedError and its failure report, ~40 lines that bury the message.
_LAUNCHER_FAILURES = ("CalledProcessError", "ChildFailedError")
_EXIT_CODES = (re.compile(r"exitcode\s*:\s*(-?\d+)"), re.compile(r"returned non-zero exit status (-?\d+)"))
_ELASTIC_FAILED_LINE = re.compile(r"failed \(exitcode: 2\) local_rank: \d+")  # torch elastic's log line of it


def _is_user_error_report(block: list[str]) -> bool:
    """Whether a held traceback is the launcher's own, for ranks that all exited with the user-error code."""
    text = "".join(block)
    if not any(f"{name}:" in text for name in _LAUNCHER_FAILURES):
        return False
    codes = [int(code) for pattern in _EXIT_CODES for code in pattern.findall(text)]
    return bool(codes) and all(code == USER_ERROR_EXIT for code in codes)


def _traceback_over(block: list[str]) -> bool:
    """Whether a held traceback is complete: its exception line came (the first unindented line after the
    header), and for a ChildFailedError its report too (closed by the second ``====`` rule)."""
    body = block[1:]
    if any("ChildFailedError" in line for line in body if not line.startswith(" ")):
        return sum(line.startswith("=====") for line in body) >= 2
    return bool(body) and not body[-1].startswith((" ", "\n"))


def relay_launcher_stderr(stream, out) -> None:
    """Copy the launcher's stderr (the ranks' too) to `out` line by line, holding back each traceback until it
    is over: the launcher's own for a rank's user error is dropped (``_is_user_error_report``), any other passed
    on whole."""
    held: list[str] = []
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        if held or line.startswith("Traceback (most recent call last):"):
            held.append(line)
            if not (_traceback_over(held) or len(held) > 500):
                continue
            line, held = ("" if _is_user_error_report(held) else "".join(held)), []
        elif _ELASTIC_FAILED_LINE.search(line):
            continue
        out.write(line)
        out.flush()
    out.write("".join(held))  # a traceback cut short: as it came
    out.flush()


def stop_group(proc: subprocess.Popen, sig: int, seconds: float, sent: bool = False) -> None:
    """Send sig to proc's process group (unless it was sent already), give it `seconds` to exit, then SIGKILL
    the group and every descendant seen when the stop began (those in sessions of their own too)."""
    import psutil

    tree = descendants(proc.pid)
    deadline = time.monotonic() + seconds
    if not sent:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        print(f"fineflow: still running {seconds:g}s after {signal.Signals(sig).name}: killing it", file=sys.stderr)
        kill_tree(proc, tree, group=True)
        return
    # proc ended before its children: killed by the same signal (Slurm, systemd and a container runtime signal
    # every process at once, and `dvc repro` dies of SIGTERM at once). They were signalled too (proc's group, or
    # directly) and may be saving their step: they get the rest of the budget, then are killed
    leftovers = [process for process in tree if process.is_running()]
    _, alive = psutil.wait_procs(leftovers, timeout=max(0.0, deadline - time.monotonic()))
    if alive:
        kill_tree(proc, alive, group=True)


def become_subreaper() -> None:
    """Linux: orphaned descendants are re-parented to this process instead of init, so it can find them."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def supervise(argv: list[str], env: dict[str, str], seconds: float) -> int:
    """Run argv in a session of its own; forward the first SIGINT/SIGTERM to it (to its PID alone: processes
    it started in its session, such as the flow's Prefect server, must outlive its orderly stop); kill its tree
    `seconds` after the signal; on exit, end whatever it left behind. Returns its exit code, or 128 + signal."""
    import psutil

    become_subreaper()
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    with Forwarder(proc.pid, group=False) as forwarder:
        code = wait_bounded(proc, forwarder, seconds, group=False)
        left = descendants(os.getpid())  # adopted: their parents are gone
        for process in left:
            with contextlib.suppress(psutil.Error):
                process.terminate()
        _, alive = psutil.wait_procs(left, timeout=5)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
    return 128 + forwarder.signum if forwarder.signum is not None else code


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None and sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError):
            _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
    return _LIBC


def _prctl(option: int, value: int) -> bool:
    libc = _libc()
    return libc is not None and libc.prctl(option, value, 0, 0, 0) == 0
