"""How many threads each fineflow process computes with: decided once, from the CPUs it may really use.

Every process of a run (a stage, each training rank) would otherwise start torch's default thread pool, one
thread per core the machine reports: ranks x intra-op threads x worker processes then exceed the cores, and on a
busy 2-core machine training ran 25-35x slower than idle. The decision, in order:

1. ``train.threads`` in params.yaml (the train stage's ranks), when set;
2. ``OMP_NUM_THREADS`` in the environment, when set (a scheduler's or the user's own choice);
3. otherwise the usable CPUs, divided among the processes of this machine that compute at once (the local ranks,
   or a stage's worker processes), at least 1.

The usable CPUs are this process's affinity mask (a container's or a Slurm job's cpuset) capped by its cgroup
CPU quota (``cpu.max``, or cgroup v1's ``cpu.cfs_quota_us``): not ``os.cpu_count()``, which is the host's.

How a waiting thread waits is decided with them: ``OMP_WAIT_POLICY=PASSIVE`` (it sleeps) unless the user set
OMP_WAIT_POLICY. OpenMP's default spin makes a shared machine collapse: two copies of the train stage at 2
threads each on 2 CPUs got 0.02-0.17 of the solo throughput each, four 0.02-0.03 (bench/threads.py); with passive
waits each of two kept 1.04-1.09 of the passive solo run. Passive costs a process alone on an idle machine: the
embedded default's loop ran at 7,500 tokens/s against 13,700 spinning. A look at the machine when the process
starts cannot tell the two cases apart (copies started together sample while each other sleeps: every copy saw an
idle machine), so the plan takes the wait that cannot collapse; on a machine of your own, OMP_WAIT_POLICY=ACTIVE.
The wait changes the speed, never a result.

    python -c "from fineflow.core.threads import plan_threads; print(plan_threads(local_processes=2))"
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
WAIT_VARIABLE = "OMP_WAIT_POLICY"
# The plan a launcher decided for the processes it starts (the train stage's ranks): they follow it, not a plan of
# their own, so that the launcher's OMP_NUM_THREADS is never mistaken for the user's.
PLAN_ENV = "FINEFLOW_THREAD_PLAN"


def affinity_cpus() -> int:
    """The CPUs this process may be scheduled on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity masks
        return os.cpu_count() or 1


def _own_cgroup_dirs(root: Path, proc_cgroup: str, controller: str) -> list[Path]:
    """The cgroup folders from this process's own up to the root, for cgroup v2 ("0::/path") or the v1
    hierarchy of `controller` ("4:cpu,cpuacct:/path"); a limit anywhere on the way applies."""
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        names, _, path = rest.partition(":")
        v2 = hierarchy == "0" and names == ""
        if v2 or controller in names.split(","):
            base = root if v2 else root / names
            if not v2 and not base.is_dir():  # v1 mounts "cpu,cpuacct" as it is named, or as "cpu"
                base = root / controller
            parts = [p for p in path.split("/") if p]
            return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return []


def _quota(folder: Path) -> float | None:
    """The CPUs a cgroup folder's quota allows (quota / period), or None for no limit there."""
    try:
        quota, period = (folder / "cpu.max").read_text(encoding="utf-8").split()[:2]  # v2: "max 100000"
    except (OSError, ValueError):
        try:
            quota = (folder / "cpu.cfs_quota_us").read_text(encoding="utf-8").strip()  # v1: -1 is no limit
            period = (folder / "cpu.cfs_period_us").read_text(encoding="utf-8").strip()
        except OSError:
            return None
    if quota in ("max", "-1") or not period.isdigit() or int(period) == 0:
        return None
    return int(quota) / int(period)


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> float | None:
    """The tightest CPU quota of this process's cgroups, in CPUs (1.5: one and a half), or None for none."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text(encoding="utf-8")
        except OSError:  # not Linux
            return None
    quotas = [q for d in _own_cgroup_dirs(root, proc_cgroup, "cpu") if (q := _quota(d)) is not None]
    return min(quotas, default=None)


def usable_cpus(affinity: int | None = None, quota: float | None | str = "read") -> int:
    """The CPUs this process may really use: its affinity mask, capped by its cgroup quota (rounded down, >= 1)."""
    cpus = affinity if affinity is not None else affinity_cpus()
    limit = cgroup_cpu_quota() if quota == "read" else quota
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit)))
    return max(1, cpus)


@dataclass(frozen=True)
class ThreadPlan:
    """One process's threads: `per_process` intra-op threads for each of `local_processes` that compute at once
    on this machine, out of `usable_cpus`; `source` says who decided (params, OMP_NUM_THREADS, auto). `wait`:
    how a waiting OpenMP thread waits ("passive": it sleeps; "default": OpenMP's own spin, then sleep; or the
    user's other OMP_WAIT_POLICY), and `wait_source` who decided ("fineflow", "OMP_WAIT_POLICY")."""

    usable_cpus: int
    local_processes: int
    per_process: int
    source: str
    wait: str = "passive"
    wait_source: str = "fineflow"

    def environment(self) -> dict[str, str]:
        """What a child process needs to follow the plan: torch, OpenMP and MKL read these at start-up."""
        threads = {name: str(self.per_process) for name in THREAD_VARIABLES}
        return threads | ({WAIT_VARIABLE: "PASSIVE"} if self.wait == "passive" else {})

    def child_environment(self) -> dict[str, str]:
        """The environment of a process this plan was decided for (a rank): the variables and the plan itself."""
        return self.environment() | {PLAN_ENV: json.dumps(self.as_record())}

    def describe(self) -> str:
        wait = f"; OMP_WAIT_POLICY {self.wait}" if self.wait_source == "OMP_WAIT_POLICY" else ""
        if self.source == "auto":
            return (
                f"{self.per_process} threads per process ({self.usable_cpus} usable CPUs / "
                f"{self.local_processes} processes on this machine{wait})"
            )
        return f"{self.per_process} threads per process ({self.source}{wait})"

    def as_record(self) -> dict:
        return asdict(self)


def plan_threads(
    local_processes: int = 1,
    setting: int | None = None,
    environ: Mapping[str, str] | None = None,
    cpus: int | None = None,
) -> ThreadPlan:
    """The thread decision for `local_processes` processes computing at once on this machine: the params'
    `setting` wins, then OMP_NUM_THREADS, then the usable CPUs shared among them; waiting threads sleep
    unless the user's OMP_WAIT_POLICY says otherwise."""
    environ = os.environ if environ is None else environ
    cpus = cpus if cpus is not None else usable_cpus()
    local_processes = max(1, local_processes)
    wait = _wait(environ)
    if setting is not None:
        return ThreadPlan(cpus, local_processes, setting, "params", *wait)
    explicit = environ.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) > 0:
        return ThreadPlan(cpus, local_processes, int(explicit), "OMP_NUM_THREADS", *wait)
    return ThreadPlan(cpus, local_processes, max(1, cpus // local_processes), "auto", *wait)


def _wait(environ: Mapping[str, str]) -> tuple[str, str]:
    """(wait, wait_source): passive, unless OMP_WAIT_POLICY says otherwise. PASSIVE in the environment is this
    plan's own choice as a process inherits it (apply_threads exports it), never read back as a user's."""
    given = environ.get(WAIT_VARIABLE)
    if given is None or given.strip().upper() == "PASSIVE":
        return "passive", "fineflow"
    return given, WAIT_VARIABLE


def process_plan(local_processes: int = 1, setting: int | None = None, environ: Mapping[str, str] | None = None):
    """This process's plan: the one its launcher decided for it (PLAN_ENV), else decided here."""
    environ = os.environ if environ is None else environ
    given = environ.get(PLAN_ENV)
    if given:
        return ThreadPlan(**json.loads(given))
    return plan_threads(local_processes, setting, environ)


def apply_threads(plan: ThreadPlan) -> None:
    """This process computes with the plan's threads and the processes it starts inherit them. Before torch is
    imported the variables are enough (OpenMP reads them when torch loads); after, torch is told the thread
    count directly (the wait policy then applies to the processes this one starts)."""
    os.environ.update(plan.environment())
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != plan.per_process:
        torch.set_num_threads(plan.per_process)


def runnable_threads() -> int | None:
    """The machine's runnable threads now (/proc/loadavg's fourth field), less the one reading it; None off Linux."""
    try:
        return int(Path("/proc/loadavg").read_text(encoding="utf-8").split()[3].split("/")[0]) - 1
    except (OSError, IndexError, ValueError):
        return None


class RunnableSampler:
    """The machine's runnable threads sampled every interval_s on a daemon thread while a loop runs: the doctor's
    evidence of oversubscription during the run (more runnable threads than CPUs), not only at its end.

        with RunnableSampler() as sampler:
            fit(...)
        sampler.summary()  # {"samples": 120, "mean": 3.4, "max": 7, "machine_cpus": 2}
    """

    def __init__(self, interval_s: float = 1.0):
        import threading

        self.interval_s, self.samples = interval_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fineflow-runnable-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            count = runnable_threads()
            if count is None:
                return
            self.samples.append(count)

    def __enter__(self) -> RunnableSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s)

    def summary(self) -> dict:
        samples = list(self.samples)
        return {
            "samples": len(samples),
            "mean": round(sum(samples) / len(samples), 2) if samples else None,
            "max": max(samples, default=None),
            "machine_cpus": os.cpu_count() or 1,
        }
