"""train.launcher: ray. Ray Train places the ranks over the cluster's nodes and restarts them after a lost node;
the train stage's launcher process drives and waits.

How the layers connect (each line starts the next):

    run_on_ray (the driver: the train stage's launcher, fineflow.train.procedure.run_cluster_job)
      connects (train.ray.address, else RAY_ADDRESS, else a local Ray for one machine), checks the cluster's
      resources, creates a Coordinator actor and submits a Ray Train DataParallelTrainer, then waits
      -> Ray Train's controller: places job.world workers (ScalingConfig) and, when one fails, tears the group
         down and starts it again, up to train.max_restarts times (FailureConfig)
         -> rank_worker, one per rank, in a Ray worker process: starts the rank as a SUBPROCESS (its signal
            handlers and os._exit need a main thread of their own) with torchrun's environment (RANK,
            WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT: rank 0's node and a free port there), prints its lines
            prefixed by rank (Ray forwards them to the driver), and reports its exit to the Coordinator
            -> the rank: ``python -m fineflow.stages.train`` with FINEFLOW_TRAIN_WORKER; accelerate's Accelerator
               reads the torchrun environment; a restarted rank resumes from the newest checkpoint itself
               (train.resume auto), so the engine never touches checkpoints

Exit codes keep the local launch's meaning. A crash (any other code; a lost node) raises in the worker, so Ray
Train restarts the whole group. A user error (2) or a saved stop (75) is final: the worker reports it, asks
every rank to stop, and returns, so nothing is retried; the driver returns 2 or 75. SIGINT/SIGTERM to the
driver asks the ranks (through the Coordinator) to save and exit 75 within checkpoint.preempt_grace_s.

The Coordinator also keeps the ranks' starts and exits on one clock: the driver turns them into ``engine_*``
spans (placement, restarts, the work lost by failed groups) for the goodput ledger (fineflow.goodput.ledger).
Ray Train's own run state goes to .cache/ray/ in the project (never ~/ray_results); it holds no checkpoints.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from fineflow.errors import PREEMPTED_EXIT, USER_ERROR_EXIT, FineflowError
from fineflow.process.preempt import StopNote, budget_s

INSTALL_HINT = "pip install 'fineflow[cluster]'"
STORAGE_DIR = Path(".cache/ray")  # Ray Train's run state, under the project the driver runs in
FINAL_CODES = (0, USER_ERROR_EXIT, PREEMPTED_EXIT)  # a rank exit Ray Train must not retry
# the driver's environment the ranks get too (the offline switches, the tests' import path, thread counts, the
# distributed libraries' knobs); the rest of a rank's environment is its node's (PATH, HOME, the Ray worker's)
FORWARDED_PREFIXES = (
    "FINEFLOW_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "ACCELERATE_",
    "TORCH_",
    "NCCL_",
    "GLOO_",
    "PYTHONPATH",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "DO_NOT_TRACK",
    "CUDA_VISIBLE_DEVICES_",  # never CUDA_VISIBLE_DEVICES itself: Ray sets it per worker
)
POLL_S = 0.5


# --- pure decisions (unit-tested) ---------------------------------------------------------------------------


def resolve_address(configured: str | None, environ) -> str | None:
    """The cluster to connect to: train.ray.address, else RAY_ADDRESS, else None (start a local Ray)."""
    return configured or environ.get("RAY_ADDRESS") or None


def forwarded_env(environ) -> dict[str, str]:
    """The driver's variables every rank gets (FORWARDED_PREFIXES)."""
    return {key: value for key, value in environ.items() if key.startswith(FORWARDED_PREFIXES)}


def rank_env(base: dict[str, str], rank: int, world: int, local_rank: int, local_world: int, master: tuple) -> dict:
    """A rank's torchrun-style variables over base: what accelerate's Accelerator reads to join the group."""
    addr, port = master
    return base | {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
    }


def outcome(codes: dict[int, int], world: int) -> int:
    """The driver's exit code from the last group's rank exits: a user error wins, then a saved stop; 0 only
    when every rank finished; 1 otherwise (a rank never reported)."""
    values = set(codes.values())
    if USER_ERROR_EXIT in values:
        return USER_ERROR_EXIT
    if PREEMPTED_EXIT in values:
        return PREEMPTED_EXIT
    return 0 if len(codes) == world and values == {0} else 1


def needs_resources(world: int, has_gpu: bool, cpus_per_worker: float) -> dict[str, float]:
    """What the whole job reserves on the cluster."""
    return {"CPU": world * cpus_per_worker} | ({"GPU": float(world)} if has_gpu else {})


def check_resources(needed: dict[str, float], total: dict[str, float], nodes: int, address: str) -> None:
    """Refuse, before submitting, a job the cluster can never place (Ray would wait for it forever)."""
    short = {key: amount for key, amount in needed.items() if total.get(key, 0.0) < amount}
    if short:
        has = ", ".join(f"{total.get(key, 0.0):g} {key}" for key in needed)
        wants = ", ".join(f"{amount:g} {key}" for key, amount in needed.items())
        raise FineflowError(
            f"train.launcher ray: the Ray cluster at {address} has {has} over {nodes} node(s); the job needs "
            f"{wants} (train.num_processes x train.ray.cpus_per_worker, one GPU per rank on GPUs): add nodes, "
            "or lower train.num_processes or train.ray.cpus_per_worker"
        )


def check_placement(placement: str, world: int, nodes: int, address: str) -> None:
    """STRICT_SPREAD needs a node per rank: with fewer, Ray would wait for nodes forever."""
    if placement == "STRICT_SPREAD" and nodes < world:
        raise FineflowError(
            f"train.ray.placement STRICT_SPREAD puts each of the {world} ranks on a node of its own, and the Ray "
            f"cluster at {address} has {nodes} node(s): add nodes, or use SPREAD or PACK"
        )


def engine_spans(events: list[tuple], world: int, submitted: float) -> dict[str, float]:
    """The engine's time from the Coordinator's events (one clock): ``engine_placement`` (submit to the first
    group's ranks started; rank 0's start), ``engine_restarts`` (a failure to the next group's ranks started:
    waiting for nodes included) and ``engine_lost`` (failed groups' running time: work the restart repeats).

    events: ("group", g, t) when rank 0 opened group g; ("start", g, rank, t); ("exit", g, rank, code, t)."""
    opened = {e[1]: e[2] for e in events if e[0] == "group"}
    running, failed = {}, {}
    for group in opened:
        starts = {e[2]: e[3] for e in events if e[0] == "start" and e[1] == group}
        if len(starts) == world:  # rank 0's start: where the launcher's span up to rank 0's process ends
            running[group] = starts[0]
        # the first crash reported, or (a lost node reports nothing) when the next group opened
        ends = [e[4] for e in events if e[0] == "exit" and e[1] == group and e[3] not in FINAL_CODES]
        ends += [opened[group + 1]] if group + 1 in opened else []
        failed[group] = min(ends, default=max(starts.values(), default=opened[group]))
    spans = {"engine_placement": 0.0, "engine_restarts": 0.0, "engine_lost": 0.0}
    groups = sorted(running)
    if groups:
        spans["engine_placement"] = running[groups[0]] - submitted
    for previous, group in zip(groups, groups[1:]):
        spans["engine_lost"] += max(0.0, failed[previous] - running[previous])
        spans["engine_restarts"] += running[group] - failed[previous]
    return {key: round(value, 4) for key, value in spans.items()}


# --- the Coordinator: one small actor the driver and every worker talk to ----------------------------------


class Coordinator:
    """Stop requests, rank-group numbering and the ranks' starts and exits, on this actor's clock."""

    def __init__(self):
        self.events: list[tuple] = []
        self.group = -1
        self.stop_reason: str | None = None
        self.submitted = time.time()

    def mark_submitted(self) -> float:
        self.submitted = time.time()
        return self.submitted

    def open_group(self) -> int:
        self.group += 1
        self.events.append(("group", self.group, time.time()))
        return self.group

    def started(self, group: int, rank: int) -> None:
        self.events.append(("start", group, rank, time.time()))

    def exited(self, group: int, rank: int, code: int) -> None:
        self.events.append(("exit", group, rank, code, time.time()))

    def request_stop(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason

    def stopping(self) -> str | None:
        return self.stop_reason

    def summary(self) -> dict:
        """The events, and the exit codes of the last group whose ranks ran (a group opened after a final exit
        starts none)."""
        exits = [e for e in self.events if e[0] == "exit"]
        last = max((e[1] for e in exits), default=-1)
        codes = {e[2]: e[3] for e in exits if e[1] == last}
        return {"events": self.events, "codes": codes, "submitted": self.submitted, "groups": self.group + 1}


# --- in each Ray Train worker -------------------------------------------------------------------------------


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rendezvous(coordinator) -> tuple[int, str, int]:
    """(group, MASTER_ADDR, MASTER_PORT), chosen on rank 0's node and shared with every worker of the group."""
    import ray
    from ray.train import get_context
    from ray.train.collective import broadcast_from_rank_zero

    chosen = None
    if get_context().get_world_rank() == 0:
        host = ray.util.get_node_ip_address()
        chosen = (ray.get(coordinator.open_group.remote()), host, free_port(host))
    return broadcast_from_rank_zero(chosen)


def stream(proc: subprocess.Popen, rank: int) -> threading.Thread:
    """Print the rank's lines prefixed by its rank (Ray forwards a worker's output to the driver)."""

    def pump():
        for line in proc.stdout:  # one write per line: Ray's capture makes a line of every write
            sys.stdout.write(f"[rank {rank}] {line.rstrip()}\n")
            sys.stdout.flush()

    thread = threading.Thread(target=pump, name=f"fineflow-rank{rank}-log", daemon=True)
    thread.start()
    return thread


def wait_rank(proc: subprocess.Popen, coordinator, grace_s: float) -> int:
    """The rank's exit code; a stop request (the driver's signal, another rank's final exit) is sent on to it
    as SIGTERM once, and it is killed when it outlives the grace."""
    import ray

    signalled_at = None
    while True:
        try:
            return proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if signalled_at is None and ray.get(coordinator.stopping.remote()):
            proc.send_signal(signal.SIGTERM)
            signalled_at = time.monotonic()
        elif signalled_at is not None and time.monotonic() - signalled_at > budget_s(grace_s, "elastic"):
            proc.kill()


def rank_worker(config: dict) -> None:
    """One rank under Ray Train (the train_loop_per_worker): run it, report its exit, raise on a crash."""
    import ray
    from ray.train import get_context

    coordinator, context = config["coordinator"], get_context()
    group, host, port = rendezvous(coordinator)
    rank = context.get_world_rank()
    if ray.get(coordinator.stopping.remote()):  # a final exit already happened: never start again
        return
    env = rank_env(
        {**os.environ, **config["env"]},
        rank,
        context.get_world_size(),
        context.get_local_rank(),
        context.get_local_world_size(),
        (host, port),
    )
    command = [sys.executable, "-m", config["module"], *config["argv"]]
    proc = subprocess.Popen(
        command, cwd=config["cwd"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    coordinator.started.remote(group, rank)
    pump = stream(proc, rank)
    code = wait_rank(proc, coordinator, config["grace_s"])
    pump.join(timeout=5)
    ray.get(coordinator.exited.remote(group, rank, code))
    report_exit(coordinator, rank, code)


def report_exit(coordinator, rank: int, code: int) -> None:
    """A final exit stops every rank (nothing retries it); a crash raises, unless a stop was asked meanwhile
    (a rank that lost its peer to another rank's user error is no crash to restart)."""
    import ray

    if code in FINAL_CODES:
        if code:
            coordinator.request_stop.remote(f"rank {rank} exited {code}")
        return
    deadline = time.monotonic() + 2 * POLL_S  # the peer whose final exit broke this rank reports it by then
    while time.monotonic() < deadline:
        if ray.get(coordinator.stopping.remote()):
            return
        time.sleep(POLL_S / 5)
    raise RuntimeError(f"rank {rank} exited {code}: Ray Train restarts the group from the newest checkpoint")


# --- the driver ---------------------------------------------------------------------------------------------


def require_ray():
    # read when ray is imported: every rank's lines, not "repeated 2x across cluster"; Ray Train's V2 controller
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    try:
        import ray
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer  # noqa: F401
    except ImportError as exc:
        raise FineflowError(
            f"train.launcher ray needs Ray Train, which is not installed ({exc}): {INSTALL_HINT}, on the driver "
            "and on every node of the cluster"
        ) from None
    return ray


def connect(ray, address: str | None, needed: dict[str, float], log) -> str:
    """ray.init to the cluster (or a local one sized for the job); returns the address it names in messages."""
    # the Ray workers import fineflow as the driver does (the project at the same path on every node)
    runtime_env = {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}} if os.environ.get("PYTHONPATH") else None
    options = {"include_dashboard": False, "configure_logging": False, "runtime_env": runtime_env}
    if address is None:
        cpus = max(os.cpu_count() or 1, int(needed["CPU"] + 0.999))
        log(f"train: starting a local Ray for this machine ({cpus} CPUs)")
        ray.init(address="local", num_cpus=cpus, **options)  # a new one: never a cluster found on the machine
        return "a local Ray (train.ray.address and RAY_ADDRESS unset)"
    try:
        require_reachable(address)  # ray.init itself retries an unreachable address for minutes
        ray.init(address=address, **options)
    except (OSError, ValueError, RuntimeError) as exc:  # ConnectionError and TimeoutError are OSErrors
        raise unreachable(address, exc) from None
    return address


def unreachable(address: str, exc: BaseException) -> FineflowError:
    said = str(exc).splitlines()[0] if str(exc) else ""
    return FineflowError(
        f"train.launcher ray: cannot reach the Ray cluster at {address} (train.ray.address or RAY_ADDRESS): "
        f"{type(exc).__name__}: {said} -- start it (`ray start --head` on the head node) or fix the address"
    )


def require_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A TCP connection to host:port (the GCS, or ray://'s client server) opens, or OSError; "auto" is not
    checked (Ray looks for a cluster on this machine)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        if address == "auto":
            return
        raise ValueError(f"not host:port: {address!r}")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
        pass


def cluster_nodes(ray) -> int:
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def build_trainer(job, coordinator):
    """The DataParallelTrainer of the job: placement, resources and restarts from params."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    ray_params = job.params.train.ray
    config = {
        "coordinator": coordinator,
        "module": job.module,
        "argv": list(job.argv),
        "env": forwarded_env(os.environ) | job.env,
        "cwd": str(Path.cwd()),
        "grace_s": job.grace_s,
    }
    scaling = ScalingConfig(
        num_workers=job.world,
        use_gpu=job.has_gpu,
        resources_per_worker={"CPU": ray_params.cpus_per_worker} | ({"GPU": 1} if job.has_gpu else {}),
        placement_strategy=ray_params.placement,
    )
    run = RunConfig(
        name=f"fineflow-train-{int(time.time())}",
        storage_path=str(STORAGE_DIR.resolve()),
        failure_config=FailureConfig(max_failures=job.params.train.max_restarts),
    )
    return DataParallelTrainer(rank_worker, train_loop_config=config, scaling_config=scaling, run_config=run)


def wait_for(trainer, coordinator, grace_s: float, log) -> tuple[BaseException | None, int | None]:
    """Run trainer.fit() on a thread and wait; a stop signal asks the ranks to save and stop, and the wait ends
    budget_s(grace, "launcher") after it. Returns (fit's exception, the stop signal)."""
    failure: list[BaseException] = []

    def fit():
        try:
            trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - handed to the driver's thread
            failure.append(exc)

    thread = threading.Thread(target=fit, name="fineflow-ray-fit", daemon=True)
    with StopNote() as stop:
        thread.start()
        asked = False
        while thread.is_alive():
            thread.join(timeout=POLL_S / 2)
            if stop.signum is not None and not asked:
                log(f"train: {signal.Signals(stop.signum).name}: asking the ranks on Ray to save and stop")
                coordinator.request_stop.remote(f"the driver got {signal.Signals(stop.signum).name}")
                asked = True
            if stop.at is not None and time.monotonic() - stop.at > budget_s(grace_s, "launcher"):
                log("train: the ranks did not stop within the grace: leaving Ray to end the job")
                break
    return (failure[0] if failure else None), stop.signum


def run_on_ray(job, log=print, spans: dict | None = None) -> int:
    """Run the job's ranks under Ray Train and wait (see the module docstring); the local launch's exit code."""
    spans = {} if spans is None else spans
    connecting = time.perf_counter()
    ray = require_ray()
    needed = needs_resources(job.world, job.has_gpu, job.params.train.ray.cpus_per_worker)
    address = connect(ray, resolve_address(job.params.train.ray.address, os.environ), needed, log)
    try:
        nodes = cluster_nodes(ray)
        check_resources(needed, ray.cluster_resources(), nodes, address)
        check_placement(job.params.train.ray.placement, job.world, nodes, address)
        spans["engine_connect"] = round(time.perf_counter() - connecting, 4)
        return submit_and_wait(ray, job, log, spans)
    finally:
        ray.shutdown()


def start_coordinator(ray):
    """The Coordinator on the driver's node: it outlives any other node's loss (a lost node is what it dates)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0, scheduling_strategy=here)(Coordinator).remote()


def submit_and_wait(ray, job, log, spans: dict) -> int:
    """Submit the trainer, wait, and map what the ranks reported to one exit code."""
    coordinator = start_coordinator(ray)
    submitted = ray.get(coordinator.mark_submitted.remote())
    log(f"train: {job.world} ranks submitted to Ray Train (up to {job.params.train.max_restarts} restarts)")
    error, signum = wait_for(build_trainer(job, coordinator), coordinator, job.grace_s, log)
    summary = ray.get(coordinator.summary.remote())
    spans.update(engine_spans(summary["events"], job.world, submitted))
    code = outcome(summary["codes"], job.world)
    if summary["groups"] > 1:
        log(f"train: Ray Train restarted the ranks {summary['groups'] - 1} time(s)")
    if error is not None and code == 1:
        log(f"train: Ray Train gave up: {type(error).__name__}: {str(error).splitlines()[0]}")
    if signum is not None and code not in (0, USER_ERROR_EXIT, PREEMPTED_EXIT):
        return 128 + signum
    return code
