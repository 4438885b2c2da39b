"""train.launcher: slurm. The train stage's driver submits its ranks as one Slurm allocation and follows it.

Run the stage where Slurm's client commands work (a login node: ``dvc repro`` there is the driver). The layers:

    driver (this module, in the stage's launcher process: ``run_on_slurm``)
      writes logs/slurm/train-<time>.sbatch (``batch_script``: SCRIPT filled from train.slurm), ``sbatch --parsable``
      -> the batch script, on the allocation's first node: ``srun`` starts one task per rank (``RANK_TASK``)
         -> each task derives torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
            MASTER_ADDR = the allocation's first host, MASTER_PORT from the job id) from Slurm's and execs the rank
            command, ``python -m fineflow.stages.train <argv>``; accelerate's Accelerator reads that environment
    driver: streams the job's output file (logs/slurm/train-<id>.out) and polls ``scontrol show job -o`` (no
      accounting database needed) until a final state, which becomes the local launch's exit code (``exit_code``).

Preemption and requeue: the job is submitted ``--requeue`` and ``--signal=TERM@<s>``; Slurm's SIGTERM (a time
limit coming, a preemption with GraceTime, ``scontrol requeue``) reaches every rank, which saves the step it is on
and exits 75 (fineflow.process.preempt). A requeued job (Restarts=N) runs the same script again on its next
allocation, and train.resume: auto resumes it from the newest checkpoint (so checkpoints/ must be on a file system
every node sees); the driver keeps waiting, and cancels the job after more than train.max_restarts requeues.
A SIGTERM/SIGINT to the driver becomes ``scancel --signal=TERM``: the ranks save, and the driver returns 75.
Time the job spent waiting for its allocation goes to spans["engine_queue"], waiting again after a requeue to
spans["engine_requeue"] (``EngineClock``).
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

from fineflow.errors import PREEMPTED_EXIT, USER_ERROR_EXIT, FineflowError
from fineflow.process.preempt import StopNote, budget_s
from fineflow.train.launch import accelerate_command
from fineflow.train.run_plan import PLAN_ENV

OUTPUT_DIR = Path("logs/slurm")
POLL_S = 2.0
JOB_NAME = "fineflow-train"
# what accelerate launch sets from a profile file for every rank (ACCELERATE_USE_FSDP, FSDP_*, ACCELERATE_DEEPSPEED_*)
PROFILE_ENV = ("ACCELERATE_", "FSDP_")
# Slurm may send --signal's signal up to 60 s before the time given (its event resolution): added to the grace
SIGNAL_SLACK_S = 60
# states after which the job will not run again (a requeued job goes back to PENDING, never to these)
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
}

# The batch script. Template fields: directives (#SBATCH lines), exports (the ranks' environment), cpus, task
# (RANK_TASK, quoted), command (the rank command, quoted words). srun's exit code (the highest of its tasks':
# 2 a user error, 75 a saved stop) is the script's, so scontrol's ExitCode says how the ranks ended.
SCRIPT = Template("""#!/bin/bash
# The train stage's ranks as one Slurm allocation; written and submitted by its driver
# (fineflow.train.engines.slurm). A requeued job runs it again and resumes from the newest checkpoint.
$directives
echo "fineflow: slurm job $${SLURM_JOB_ID} on $${SLURM_JOB_NODELIST}, restart $${SLURM_RESTART_COUNT:-0}"
$exports
# one task per rank; a rank that exits leaves the others to finish (rank 0 may still be writing a checkpoint)
srun --cpus-per-task=$cpus --kill-on-bad-exit=0 bash -c $task fineflow-rank $command
""")

# Each srun task: torchrun's environment from Slurm's, then the rank command ("$@") in the task's place.
RANK_TASK = """\
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID GROUP_RANK=${SLURM_NODEID:-0}
per_node=${SLURM_NTASKS_PER_NODE:-$SLURM_TASKS_PER_NODE}  # "2", or "2(x3)" / "2,1" when only the latter is set
export LOCAL_WORLD_SIZE=${per_node%%[(,]*}
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 9000))  # the same for every task, and on a requeued run
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}  # fineflow.core.threads: spinning waits collapse a shared node
exec "$@"
"""


def run_on_slurm(job, log=print, spans: dict | None = None, poll_s: float = POLL_S) -> int:
    """Submit job's ranks as one allocation, follow it to its end; the exit code as a local launch gives it."""
    spans = {} if spans is None else spans
    require_slurm_client()
    require_no_job_here()
    with StopNote() as stop:  # from before the submission: a stop signal never leaves a job behind
        script, output = write_script(job, time.strftime("%Y%m%d-%H%M%S"))
        job_id = submit(script)
        output = Path(str(output).replace("%j", job_id))
        log(f"slurm: submitted job {job_id} ({script}); its output: {output}")
        return follow(job_id, output, job, Watch(log, spans, poll_s, stop))


# --- the script ------------------------------------------------------------------------------------------


def write_script(job, stamp: str, out_dir: Path = OUTPUT_DIR) -> tuple[Path, Path]:
    """logs/slurm/train-<stamp>.sbatch for job; returns it and its output file's pattern (%j: the job id)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    script, output = out_dir / f"train-{stamp}.sbatch", out_dir.resolve() / "train-%j.out"
    script.write_text(batch_script(job, output))
    return script, output


def batch_script(job, output: Path | str) -> str:
    """The batch script that runs job's ranks, every option from train.slurm (see SCRIPT)."""
    settings = job.params.train.slurm
    env = rank_env(job, gpus_per_node(job))
    return SCRIPT.substitute(
        directives="\n".join(f"#SBATCH {option}" for option in sbatch_options(job, output)),
        exports="\n".join(f"export {key}={shlex.quote(value)}" for key, value in sorted(env.items())),
        cpus=settings.cpus_per_task,
        task=shlex.quote(RANK_TASK),
        command=shlex.join([sys.executable, "-m", job.module, *job.argv]),
    )


def sbatch_options(job, output: Path | str) -> list[str]:
    """The allocation: nodes x ranks per node, GPUs, time, where it may run, requeue and the stop signal."""
    settings = job.params.train.slurm
    options = [
        f"--job-name={JOB_NAME}",
        f"--nodes={job.num_machines}",
        f"--ntasks-per-node={ranks_per_node(job)}",
        f"--cpus-per-task={settings.cpus_per_task}",
        f"--chdir={Path.cwd()}",
        f"--output={output}",
        "--open-mode=append",  # a requeued run appends: the driver's stream keeps its place
        "--export=ALL",  # the driver's environment (PATH, the venv, SLURM_CONF) reaches the ranks
        "--requeue",
        f"--signal=TERM@{signal_seconds(job)}",  # to every rank (no B:): they save before the time limit
    ]
    gpus = gpus_per_node(job)
    optional = {
        "partition": settings.partition,
        "account": settings.account,
        "qos": settings.qos,
        "time": settings.time,
        "gpus-per-node": gpus or None,
    }
    options += [f"--{name}={value}" for name, value in optional.items() if value is not None]
    return options + list(settings.sbatch_args)


def ranks_per_node(job) -> int:
    if job.world % job.num_machines:
        raise FineflowError(
            f"params.yaml: train.launcher slurm places the same number of ranks on every node: "
            f"{job.world} ranks (train.num_processes) do not divide over {job.num_machines} (train.num_machines)"
        )
    return job.world // job.num_machines


def gpus_per_node(job) -> int:
    """train.slurm.gpus_per_node, else one per rank when the driver's machine has a GPU (a login node may not:
    set it)."""
    configured = job.params.train.slurm.gpus_per_node
    if configured is not None:
        return configured
    return ranks_per_node(job) if job.has_gpu else 0


def rank_env(job, gpus: int) -> dict[str, str]:
    """What the ranks' environment adds: the profile's settings, then the job's, less ACCELERATE_USE_CPU when the
    allocation has GPUs. The driver's plan (PLAN_ENV) goes along unless the allocation's GPUs differ from the
    driver's (a login node without GPUs submitting to GPU nodes, train.slurm.gpus_per_node): the ranks then plan
    for the devices they get."""
    env = profile_env(job) | job.env
    dropped = {"ACCELERATE_USE_CPU"} if gpus else set()
    if bool(gpus) != job.has_gpu:
        dropped.add(PLAN_ENV)
    return {key: value for key, value in env.items() if key not in dropped}


def profile_env(job) -> dict[str, str]:
    """The environment `accelerate launch` gives each rank for job's accelerate profile file (FSDP's or DeepSpeed's
    settings, its mixed precision), from accelerate's own launch code: ranks placed by srun run the engine the
    planner planned for. Empty without a profile file (the ranks' defaults are the auto profile's)."""
    if job.profile is None or job.profile.path is None:
        return {}
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    machines = job.num_machines if job.num_machines > 1 else None  # the profile's own when one
    command, _ = accelerate_command(
        job.world, job.has_gpu, job.module, job.argv, 0, profile=job.profile, num_machines=machines,
        machine_rank=0, main_process_ip="localhost",
    )  # fmt: skip
    args, defaults, precision_from_file = _validate_launch_command(launch_command_parser().parse_args(command[3:]))
    if args.use_deepspeed and not args.cpu:  # what accelerate's launch_command sets before it asks for the env
        fields = [*(defaults.deepspeed_config if defaults else [])] + ["mixed_precision"] * precision_from_file
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        env = prepare_deepspeed_cmd_env(args)[1]
    else:
        env = prepare_multi_gpu_env(args)
    return {key: value for key, value in env.items() if key.startswith(PROFILE_ENV) and os.environ.get(key) != value}


def signal_seconds(job) -> int:
    configured = job.params.train.slurm.signal_s
    return configured if configured is not None else math.ceil(job.grace_s) + SIGNAL_SLACK_S


# --- submitting ------------------------------------------------------------------------------------------


def require_slurm_client() -> None:
    missing = [name for name in ("sbatch", "scontrol", "scancel", "squeue") if shutil.which(name) is None]
    if missing:
        raise FineflowError(
            f"train.launcher: slurm needs Slurm's client commands on PATH; {', '.join(missing)} not found. Run the "
            "stage on a login node (`module load slurm` where the cluster uses modules; Debian/Ubuntu: "
            "apt-get install slurm-client), or set train.launcher: local"
        )


def require_no_job_here() -> None:
    """Refuse while a train job of this workspace is still queued or running (its driver was killed, or runs in
    another shell): two jobs would write the same checkpoints and model."""
    done = subprocess.run(
        ["squeue", "--me", "--noheader", f"--name={JOB_NAME}", "--format=%i %T %Z"], capture_output=True, text=True
    )
    here = str(Path.cwd().resolve())
    for job_id, state, workdir in (line.split(maxsplit=2) for line in done.stdout.splitlines() if line.strip()):
        if workdir == here:
            raise FineflowError(
                f"slurm job {job_id} ({state}) is already training in {here}: wait for it, or `scancel {job_id}` "
                f"(its ranks save their step on `scancel --signal=TERM {job_id}`) and run the stage again"
            )


def submit(script: Path) -> str:
    """sbatch --parsable script -> the job id; a refusal is the user's to fix (its stderr says why)."""
    done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    job_id = done.stdout.strip().split(";")[0]
    if done.returncode or not job_id.isdigit():
        said = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}")[-2000:]
        raise FineflowError(f"sbatch refused {script} (train.slurm in params.yaml): {said}")
    return job_id


def scancel(job_id: str, *args: str) -> None:
    subprocess.run(["scancel", *args, job_id], capture_output=True, text=True)


# --- following the job -----------------------------------------------------------------------------------


def job_info(job_id: str) -> dict[str, str] | None:
    """``scontrol show job -o`` as a dict (JobState, Reason, Restarts, ExitCode ...); None once slurmctld has
    forgotten the job (MinJobAge after its end) or when it cannot be asked."""
    done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    return parse_job_line(done.stdout) if done.returncode == 0 and done.stdout.strip() else None


def parse_job_line(line: str) -> dict[str, str]:
    """``Key=value Key=value`` (one job, -o); a value runs up to the next `` Key=`` (some hold spaces)."""
    pairs = re.finditer(r"(?:^|\s)([A-Za-z][\w/:]*)=(.*?)(?=\s+[A-Za-z][\w/:]*=|\s*$)", line.strip())
    return {key: value for key, value in (match.groups() for match in pairs)}


def job_state(info: dict[str, str]) -> str:
    return info.get("JobState", "UNKNOWN").split()[0]


def restarts(info: dict[str, str]) -> int:
    return int(info.get("Restarts", "0") or 0)


@dataclass
class EngineClock:
    """Adds the time the job waits for an allocation to spans: engine_queue (from submission to running),
    engine_requeue (from a requeue, seen as a higher Restarts count, to running again)."""

    spans: dict
    waiting_since: float | None = field(default_factory=time.perf_counter)
    key: str = "engine_queue"
    restarts: int = 0

    def update(self, state: str, restart_count: int, now: float) -> None:
        if restart_count > self.restarts:
            self.restarts, self.key = restart_count, "engine_requeue"
            self.waiting_since = self.waiting_since or now
        if state == "RUNNING" and self.waiting_since is not None:
            self.stop(now)

    def stop(self, now: float) -> None:
        if self.waiting_since is not None:
            self.spans[self.key] = self.spans.get(self.key, 0.0) + now - self.waiting_since
            self.waiting_since = None


@dataclass
class Watch:
    """What following a job needs besides the job: the log, the spans, the poll interval, the driver's stop."""

    log: object
    spans: dict
    poll_s: float
    stop: StopNote


def follow(job_id: str, output: Path, job, watch: Watch) -> int:
    """Poll the job and stream its output until it ends, is requeued too often or the driver is stopped."""
    clock, tail, cancelled = EngineClock(watch.spans), OutputTail(output, watch.log), False
    while True:
        tail.pump()
        info = job_info(job_id)
        if info is None:
            return vanished(job_id, output, watch.log)
        state = job_state(info)
        clock.update(state, restarts(info), time.perf_counter())
        if state in FINAL_STATES:
            tail.pump()
            clock.stop(time.perf_counter())
            return exit_code(job_id, info, output, watch.log, stopped=watch.stop.signum is not None)
        if restarts(info) > job.params.train.max_restarts:
            return too_many_restarts(job_id, info, job.params.train.max_restarts, watch.log)
        if watch.stop.signum is not None and not cancelled:
            cancelled = stop_job(job_id, state, watch.log)
        if watch.stop.overdue(budget_s(job.grace_s, "launcher")):
            scancel(job_id)  # the ranks had their grace: end the allocation
            watch.log(f"slurm: job {job_id} still running after the grace: cancelled (exit {PREEMPTED_EXIT})")
            return PREEMPTED_EXIT
        time.sleep(watch.poll_s)


def stop_job(job_id: str, state: str, log) -> bool:
    """The driver was asked to stop: the ranks get SIGTERM (they save and exit 75); a job not running yet is
    cancelled outright."""
    if state == "RUNNING":
        scancel(job_id, "--signal=TERM")
        log(f"slurm: stop requested: SIGTERM sent to job {job_id}'s ranks (scancel --signal=TERM)")
    else:
        scancel(job_id)
        log(f"slurm: stop requested: job {job_id} ({state}) cancelled")
    return True


def exit_code(job_id: str, info: dict[str, str], output: Path, log, stopped: bool = False) -> int:
    """The final state as the local launch's exit code: 0 done, 2 a rank's user error (its record in the
    report), 75 a saved stop (the ranks exited 75, or the job was stopped/preempted on request), else 1."""
    state, (code, signum) = job_state(info), exit_status(info)
    if state == "COMPLETED" and code == 0:
        return 0
    if code == USER_ERROR_EXIT:
        return USER_ERROR_EXIT
    if code == PREEMPTED_EXIT or state == "PREEMPTED" or (stopped and state == "CANCELLED"):
        log(f"slurm: job {job_id} stopped ({state}) after the ranks saved their step (exit {PREEMPTED_EXIT})")
        return PREEMPTED_EXIT
    log(
        f"slurm: job {job_id} ended {state} (reason {info.get('Reason', '?')}, exit code {code}, signal {signum}); "
        f"the ranks' output: {output}"
    )
    return 1


def exit_status(info: dict[str, str]) -> tuple[int, int]:
    """scontrol's ExitCode=<code>:<signal> of the batch script (srun's: the ranks' highest)."""
    code, _, signum = info.get("ExitCode", "0:0").partition(":")
    return int(code or 0), int(signum or 0)


def too_many_restarts(job_id: str, info: dict[str, str], limit: int, log) -> int:
    scancel(job_id)
    log(
        f"slurm: job {job_id} was requeued {restarts(info)} times, more than train.max_restarts ({limit}): "
        f"cancelled. Its output says why the allocations ended; raise train.max_restarts to allow more"
    )
    return 1


def vanished(job_id: str, output: Path, log) -> int:
    log(f"slurm: job {job_id} is no longer known to scontrol (ended long ago, or cancelled); its output: {output}")
    return 1


class OutputTail:
    """The job's output file, logged line by line as it grows (it may not exist yet: the job is pending)."""

    def __init__(self, path: Path, log):
        self.path, self.log, self.offset, self.partial = path, log, 0, b""

    def pump(self) -> None:
        try:
            with self.path.open("rb") as fh:
                if os.fstat(fh.fileno()).st_size < self.offset:  # truncated: a run that did not append
                    self.offset = 0
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for line in lines:
            self.log(line.decode(errors="replace"))
