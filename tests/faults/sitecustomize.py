"""Test-only fault injection into checkpoint writes, for the processes a test starts. Production code has no
fault switch: this file is the switch, and it exists only in tests/.

A test puts this directory first on PYTHONPATH for a subprocess (``tests.faults.fault_env``). Python
imports ``sitecustomize`` at startup, so this module runs in that process and in every Python process
started from it with the same environment: the train stage's launcher, ``accelerate launch`` and each
rank it starts, and the checkpoint writer process of the process backend (spawned: a fresh interpreter).

When one of these variables is set, ``fineflow.checkpoint.write.write_all`` (the one function every
checkpoint byte goes through) is replaced right after that module executes, whenever the process imports
it; with neither set, this module does nothing at all:

    FINEFLOW_TEST_WRITE_DELAY_S=<seconds>   every write sleeps this long first: checkpoint writes take long
                                            enough that a test's SIGKILL can land in the middle of one
    FINEFLOW_TEST_DISK_FULL_AT_STEP=<N>     every write of step N's checkpoint files fails with ENOSPC (the
                                            message says "injected"); takes precedence over the delay
    FINEFLOW_TEST_CRASH_ONCE_AT_STEP=<N>    the first write of step N's checkpoint SIGKILLs its own process (a
    FINEFLOW_TEST_CRASH_MARKER=<file>       hard crash), once: it creates the marker file first, and does
                                            nothing while the file exists (so the retry runs clean)

Each process that installs a fault says so on stderr, with its pid and rank (RANK, as accelerate and
torchrun set it; 0 when unset), so a test can prove that the fault reached the processes it meant.

Nothing here imports fineflow or torch: the patch waits, as an import hook (a ``sys.meta_path`` finder
whose loader patches after the module has executed), until the process imports the write module itself.
Any other Python process with these variables set (dvc, git hooks) pays only for the hook.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time

TARGET = "fineflow.checkpoint.write"
DELAY_VAR, DISK_FULL_VAR = "FINEFLOW_TEST_WRITE_DELAY_S", "FINEFLOW_TEST_DISK_FULL_AT_STEP"
CRASH_VAR, CRASH_MARKER_VAR = "FINEFLOW_TEST_CRASH_ONCE_AT_STEP", "FINEFLOW_TEST_CRASH_MARKER"
MESSAGE = "injected into fineflow.checkpoint.write.write_all"  # tests look for this in a stage's output


def slow_writes(real, delay_s: float):
    """write_all that sleeps before every write, as the old in-stage fault hook did."""

    def write_all(fd, data, path):
        time.sleep(delay_s)
        real(fd, data, path)

    return write_all


def disk_full_at(real, step: int):
    """write_all that fails every write to step `step`'s files (its .tmp- directory) with ENOSPC."""
    victim = f"step-{step:07d}"

    def write_all(fd, data, path):
        if victim in path:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        real(fd, data, path)

    return write_all


def crash_once_at(real, step: int, marker: str):
    """write_all that SIGKILLs this process at the first write of step `step`'s files, unless marker exists."""
    victim = f"step-{step:07d}"

    def write_all(fd, data, path):
        if victim in path and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        real(fd, data, path)

    return write_all


def fault_from_env():
    """(description, wrapper factory) for the fault the environment asks for, or None."""
    if os.environ.get(CRASH_VAR):
        step, marker = int(os.environ[CRASH_VAR]), os.environ[CRASH_MARKER_VAR]
        return f"crash once at step {step}", lambda real: crash_once_at(real, step, marker)
    if os.environ.get(DISK_FULL_VAR):
        step = int(os.environ[DISK_FULL_VAR])
        return f"disk full at step {step}", lambda real: disk_full_at(real, step)
    if os.environ.get(DELAY_VAR):
        delay_s = float(os.environ[DELAY_VAR])
        return f"write delay {delay_s:g}s", lambda real: slow_writes(real, delay_s)
    return None


def slowed(real, delay_s: float):
    """The function, sleeping delay_s before each call (a slow data loader, a slow all-reduce)."""

    def call(*args, **kwargs):
        time.sleep(delay_s)
        return real(*args, **kwargs)

    return call


def bottlenecks_from_env():
    """[(module, attribute, description, wrapper factory)]: the goodput doctor's induced bottlenecks.

    FINEFLOW_TEST_LOADER_DELAY_S=<s>     fineflow.train.loader.prepare_step sleeps first: a slow data loader
    FINEFLOW_TEST_ALLREDUCE_DELAY_S=<s>  fineflow.train.gradsync.allreduce sleeps first: a slow network
    FINEFLOW_TEST_BF16_CAPABLE=1         fineflow.train.flops.bf16_facts says bf16-capable at 2x fp32's rate
    (one patch per module: two finders for one module would ask each other for its spec without end)
    """
    patches = []
    if os.environ.get("FINEFLOW_TEST_LOADER_DELAY_S"):
        delay = float(os.environ["FINEFLOW_TEST_LOADER_DELAY_S"])
        wrap = lambda real, delay=delay: slowed(real, delay)  # noqa: E731
        patches.append(("fineflow.train.loader", "prepare_step", f"loader delay {delay:g}s", wrap))
    if os.environ.get("FINEFLOW_TEST_ALLREDUCE_DELAY_S"):
        delay = float(os.environ["FINEFLOW_TEST_ALLREDUCE_DELAY_S"])
        wrap = lambda real, delay=delay: slowed(real, delay)  # noqa: E731
        patches.append(("fineflow.train.gradsync", "allreduce", f"all-reduce delay {delay:g}s", wrap))
    if os.environ.get("FINEFLOW_TEST_BF16_CAPABLE") == "1":
        facts = {"bf16_capable": True, "bf16_speedup": 2.0}
        patches.append(("fineflow.train.flops", "bf16_facts", "bf16 at 2x fp32", lambda r: lambda *a, **k: facts))
    return patches


class _PatchingLoader:
    """Wraps a module's real loader: executes the module, then replaces its attribute. Everything else
    (get_source for tracebacks, is_package, ...) is the real loader's."""

    def __init__(self, inner, description: str, wrap, attribute: str = "write_all", module_name: str = TARGET):
        self.inner, self.description, self.wrap = inner, description, wrap
        self.attribute, self.module_name = attribute, module_name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        setattr(module, self.attribute, self.wrap(getattr(module, self.attribute)))
        print(
            f"tests/faults: {self.description} injected into {self.module_name}.{self.attribute} "
            f"(pid {os.getpid()}, rank {os.environ.get('RANK', '0')})",
            file=sys.stderr,
            flush=True,
        )

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _PatchWriteModule:
    """A sys.meta_path finder that answers only for one module: it asks the other finders for the real spec
    and hands it back with a patching loader."""

    def __init__(self, description: str, wrap, module_name: str = TARGET, attribute: str = "write_all"):
        self.description, self.wrap = description, wrap
        self.module_name, self.attribute = module_name, attribute

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module_name:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if finder is not self and find is not None else None
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self.description, self.wrap, self.attribute, fullname)
                return spec
        return None


def install() -> None:
    fault = fault_from_env()
    if fault is not None:
        sys.meta_path.insert(0, _PatchWriteModule(*fault))
    for module_name, attribute, description, wrap in bottlenecks_from_env():
        sys.meta_path.insert(0, _PatchWriteModule(description, wrap, module_name, attribute))


install()
