"""A user's reward function run in a process of its own, with a time limit per call: a function that hangs, raises,
exits or crashes its interpreter never stops or stalls the run that asks it.

The worker is persistent: started (``spawn``: a fresh interpreter, nothing of the trainer's state inherited) at
the first call, it imports the function once and answers call after call over a pipe. A call that passes its time
limit has the worker killed (SIGKILL: a hung function may ignore SIGTERM) and the next call starts a new one. What
the function returns is checked in the worker: one finite number per completion, or the call failed.

- A failed call raises RewardFailed with the exception's type and message ("TimeoutError: ...", "ValueError: ...").
- A function that cannot be imported (no such module or name, an import that raised) is a ConfigError: every call
  would fail, so the run stops and says so.
- The worker computes with the caller's threads (fineflow.core.threads: its plan, which the caller does not use
  while it waits for the answer), and dies with its parent (PR_SET_PDEATHSIG) even when the function hangs. It
  is a daemon process, so the function cannot start processes of its own.

    FunctionWorker("mypackage.rewards:passes_tests").call(completions, rows, timeout_s=10)
"""

from __future__ import annotations

import importlib
import math
import multiprocessing
import numbers
import os

from fineflow.errors import ConfigError
from fineflow.rewards.interface import RewardFailed

START_TIMEOUT_S = 120  # importing the function (and, under spawn, the caller's __main__ module) on a busy machine
CONTEXT = "spawn"


class FunctionWorker:
    """The process that runs the function at ``path`` ("package.module:function")."""

    def __init__(self, path: str):
        self.path = path
        self._process = None
        self._conn = None

    def call(self, completions: list[str], rows: list[dict], timeout_s: float) -> list[float]:
        """function(completions, rows) within timeout_s seconds: one float per completion, or RewardFailed."""
        conn = self._started()
        try:
            conn.send((completions, rows))
            answered = conn.poll(timeout_s)
            reply = conn.recv() if answered else None
        except (EOFError, OSError):  # the worker died under the function (os._exit, a crash in native code)
            raise RewardFailed(f"WorkerDied: the process running {self.path} exited ({self._stop()})") from None
        if reply is None:
            self._stop()
            raise RewardFailed(f"TimeoutError: {self.path} took more than {timeout_s:g} s (stopped, restarted next)")
        status, payload = reply
        if status != "ok":
            raise RewardFailed(payload)
        return payload

    def close(self) -> None:
        self._stop()

    def _started(self):
        """The connection to a live worker that has imported the function; started when there is none."""
        if self._process is not None and self._process.is_alive():
            return self._conn
        self._stop()
        from fineflow.core.threads import process_plan

        context = multiprocessing.get_context(CONTEXT)
        conn, child = context.Pipe()
        plan = process_plan().as_record()
        process = context.Process(
            target=serve, args=(child, self.path, plan, os.getpid()), name="fineflow-reward-worker", daemon=True
        )
        process.start()
        child.close()
        self._process, self._conn = process, conn
        slow = ("config", f"importing it took more than {START_TIMEOUT_S} s")
        try:
            reply = conn.recv() if conn.poll(START_TIMEOUT_S) else slow
        except (EOFError, OSError):
            reply = ("config", f"its process exited while importing it ({self._stop()})")
        if reply[0] != "ready":
            self._stop()
            raise ConfigError(f"reward function {self.path}: {reply[1]}")
        return conn

    def _stop(self) -> str:
        """Kill and reap the worker, if any; its exit status in words."""
        process, conn, self._process, self._conn = self._process, self._conn, None, None
        if conn is not None:
            conn.close()
        if process is None:
            return "no process"
        if process.is_alive():
            process.kill()
        process.join(timeout=10)
        return f"exit code {process.exitcode}"


# ---- the worker's side -------------------------------------------------------------------------------------------


def serve(conn, path: str, plan: dict, parent: int) -> None:
    """The worker's loop: import the function, then answer each (completions, rows) with ("ok", floats) or
    ("error", "Type: message"), until the caller closes the pipe."""
    from fineflow.core.threads import ThreadPlan, apply_threads
    from fineflow.process.preempt import die_with_parent

    die_with_parent(parent=parent)
    apply_threads(ThreadPlan(**plan))
    try:
        function = load_function(path)
    except Exception as exc:
        conn.send(("config", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            completions, rows = conn.recv()
        except EOFError:  # the caller closed the pipe, or died
            return
        try:
            reply = ("ok", checked(function(completions, rows), len(completions)))
        except (Exception, SystemExit) as exc:
            reply = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(reply)


def load_function(path: str):
    """The callable "package.module:function" names (the attribute may be dotted: "module:Class.method")."""
    module_name, _, attribute = path.partition(":")
    target = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{path} is not callable (its type: {type(target).__name__})")
    return target


class BadReturn(Exception):
    """The function returned something that is not one finite number per completion."""


def checked(values, n: int) -> list[float]:
    """values as one float per completion, or BadReturn saying what is wrong with it."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise BadReturn(f"returned a {type(values).__name__}, not a list of {n} numbers")
    if len(values) != n:
        raise BadReturn(f"returned {len(values)} values for {n} completions")
    out = []
    for i, value in enumerate(values):
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise BadReturn(f"value {i} is {value!r}, not a finite number")
        out.append(float(value))
    return out
