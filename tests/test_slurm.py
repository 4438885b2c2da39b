"""train.launcher: slurm (fineflow.train.engines.slurm): the batch script, each rank's environment, scontrol's
answers and the driver's exit codes, with fake sbatch/scontrol/scancel on PATH (fast tier); a real one-host Slurm
(munged, slurmctld, slurmd on 127.0.0.1) running the stage, requeued mid-run, bit-exact (nightly)."""

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fineflow.core.config import load_params
from fineflow.errors import FineflowError
from fineflow.train.engines import RankJob
from fineflow.train.engines.slurm import (
    EngineClock,
    batch_script,
    exit_code,
    job_state,
    parse_job_line,
    restarts,
    run_on_slurm,
)
from fineflow.train.run_plan import PLAN_ENV
from tests.conftest import (
    ROOT,
    TRAIN,
    free_port,
    last_logged_step,
    ranks_overrides,
    stop_by_pid,
    train_project,
    venv_env,
    write_params,
)
from tests.faults import fault_env

# scontrol show job -o of Slurm 22.05.8 (Debian bookworm), a running job just requeued: captured here
REQUEUED = (
    "JobId=1 JobName=j.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 Account=(null) "
    "QOS=(null) JobState=PENDING Reason=BeginTime Dependency=(null) Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 "
    "ExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-12-03T04:39:28 "
    "NodeList=(null) NumNodes=1 NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=2,node=1,billing=2 "
    "Command=/tmp/sl/j.sh WorkDir=/tmp/sl StdErr=/tmp/sl/j-1.out StdIn=/dev/null StdOut=/tmp/sl/j-1.out Power= "
)
ENV = {"FINEFLOW_TRAIN_WORKER": "1", "ACCELERATE_USE_CPU": "1"}


def _job(tmp_path: Path, overrides: dict | None = None, world=2, machines=1, module="x", grace=30.0, extra=()):
    params = load_params(write_params(tmp_path / "params.yaml", overrides))
    argv = ["--params", "params.yaml", "--report", "reports/train.json", *extra]
    return RankJob(module, argv, world, machines, False, None, params, grace, dict(ENV))


def _directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_the_batch_script_carries_every_option_from_params(tmp_path):
    slurm = {
        "partition": "gpu",
        "account": "proj42",
        "qos": "high",
        "time": "1-02:00:00",
        "gpus_per_node": 4,
        "cpus_per_task": 8,
        "signal_s": 300,
        "sbatch_args": ["--constraint=a100", "--exclusive"],
    }
    job = _job(tmp_path, {"train.slurm": slurm}, world=8, machines=2)
    script = batch_script(job, "/shared/logs/slurm/train-%j.out")
    directives = _directives(script)
    for option in [
        "--nodes=2",
        "--ntasks-per-node=4",
        "--cpus-per-task=8",
        "--partition=gpu",
        "--account=proj42",
        "--qos=high",
        "--time=1-02:00:00",
        "--gpus-per-node=4",
        "--requeue",
        "--open-mode=append",
        "--signal=TERM@300",
        "--output=/shared/logs/slurm/train-%j.out",
        "--constraint=a100",
        "--exclusive",
        f"--chdir={Path.cwd()}",
    ]:
        assert option in directives, option
    assert "export FINEFLOW_TRAIN_WORKER=1" in script
    assert "ACCELERATE_USE_CPU" not in script  # the allocation has GPUs, whatever the driver's machine has
    assert "srun --cpus-per-task=8 " in script
    assert script.rstrip().endswith(
        f"{sys.executable} -m x --params params.yaml --report reports/train.json"
    )  # the rank command, the stage's own argv
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # it parses


def test_the_defaults_ask_for_no_partition_no_gpus_on_cpu_and_signal_before_the_grace(tmp_path):
    job = _job(tmp_path, grace=45.0)
    directives = _directives(batch_script(job, "out-%j"))
    assert not [d for d in directives if d.split("=")[0] in {"--partition", "--account", "--qos", "--time"}]
    assert not [d for d in directives if d.startswith("--gpus")]
    assert "--signal=TERM@105" in directives  # the grace plus Slurm's 60 s resolution
    assert "export ACCELERATE_USE_CPU=1" in batch_script(job, "out-%j")


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        ("fsdp_lora", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_SHARDING_STRATEGY": "FULL_SHARD"}),
        ("deepspeed_zero3", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}),
    ],
)
def test_ranks_get_the_settings_accelerate_launch_gives_for_the_profile_file(tmp_path, profile, expected):
    """srun's ranks skip accelerate launch: the profile's engine reaches them through the same variables."""
    from fineflow.train.profile import load_profile

    loaded = load_profile(str(ROOT / f"configs/accelerate/{profile}.yaml"))
    job = _job(tmp_path, world=loaded.processes)
    job = RankJob(job.module, job.argv, job.world, 1, True, loaded, job.params, 30.0, job.env)
    script = batch_script(job, "out")
    for key, value in expected.items():
        assert f"export {key}={value}\n" in script
    assert "export FINEFLOW_TRAIN_WORKER=1" in script and "ACCELERATE_USE_CPU" not in script


def test_the_batch_script_hands_the_ranks_the_drivers_plan_unless_their_gpus_differ(tmp_path):
    """The plan (a JSON document) survives the script's shell quoting; a driver without GPUs submitting to GPU nodes
    (train.slurm.gpus_per_node) lets the ranks plan for the devices they get instead."""
    job = _job(tmp_path)
    plan = '{"params": {"seed": 1}, "note": "it\'s $HOME; `not run`"}'
    job = RankJob(job.module, job.argv, job.world, 1, False, None, job.params, 30.0, job.env | {PLAN_ENV: plan})
    exports = [line for line in batch_script(job, tmp_path / "out").splitlines() if line.startswith("export ")]
    shown = subprocess.run(
        ["bash", "-c", "\n".join(exports) + f'\nprintf %s "${PLAN_ENV}"'], capture_output=True, text=True, check=True
    )
    assert shown.stdout == plan
    gpu_nodes = _job(tmp_path, {"train.slurm.gpus_per_node": 1})
    gpu_nodes = RankJob(
        gpu_nodes.module, gpu_nodes.argv, 2, 1, False, None, gpu_nodes.params, 30.0, gpu_nodes.env | {PLAN_ENV: plan}
    )
    assert PLAN_ENV not in batch_script(gpu_nodes, tmp_path / "out")


def test_ranks_that_do_not_divide_over_the_nodes_are_refused(tmp_path):
    with pytest.raises(FineflowError, match=r"train.num_processes.*train.num_machines"):
        batch_script(_job(tmp_path, world=3, machines=2), "out")


PROBE = """
import json, os, sys
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
        "OMP_NUM_THREADS", "FINEFLOW_TRAIN_WORKER"]
with open(os.path.join(sys.argv[-1], f"rank{os.environ['RANK']}.json"), "w") as fh:
    json.dump({key: os.environ.get(key) for key in keys} | {"argv": sys.argv[1:]}, fh)
"""

# srun on the second node of a 2-node, 4-rank job: its two tasks, with the variables Slurm gives them
FAKE_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
for local in 0 1; do
  SLURM_PROCID=$((2 + local)) SLURM_LOCALID=$local SLURM_NODEID=1 "$@" || exit $?
done
"""
FAKE_SCONTROL_HOSTNAMES = """#!/bin/bash
[[ "$1 $2 $3" == "show hostnames node[07-08]" ]] && printf 'node07\\nnode08\\n'
"""


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("per_node", [{"SLURM_NTASKS_PER_NODE": "2"}, {"SLURM_TASKS_PER_NODE": "2(x2)"}])
def test_each_task_derives_torchruns_environment_from_slurms(tmp_path, per_node):
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(), out.mkdir()
    _executable(bin_dir / "srun", FAKE_SRUN)
    _executable(bin_dir / "scontrol", FAKE_SCONTROL_HOSTNAMES)
    (tmp_path / "slurm_probe.py").write_text(PROBE)
    job = _job(tmp_path, {"train.slurm.cpus_per_task": 3}, world=4, machines=2, module="slurm_probe", extra=[str(out)])
    script = _executable(tmp_path / "job.sbatch", batch_script(job, "out"))
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM", "OMP_", "RANK"))}
    env |= {"PATH": f"{bin_dir}:{env['PATH']}", "PYTHONPATH": f"{tmp_path}:{env.get('PYTHONPATH', '')}"}
    env |= {"SLURM_JOB_ID": "123456", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "node[07-08]"} | per_node
    env |= {"SLURM_CPUS_PER_TASK": "3"}
    subprocess.run([str(script)], env=env, check=True, capture_output=True)

    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (2, 3)]
    for local, rank in enumerate(ranks):
        assert rank | {"argv": None} == {
            "RANK": str(2 + local),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "node07",  # the allocation's first host, on every node
            "MASTER_PORT": str(20000 + 123456 % 9000),
            "OMP_NUM_THREADS": "3",  # the task's CPUs
            "FINEFLOW_TRAIN_WORKER": "1",
            "argv": None,
        }
        assert rank["argv"] == job.argv


def test_scontrols_one_line_answer_parses_with_its_state_and_restarts():
    info = parse_job_line(REQUEUED + "\n")
    assert (job_state(info), info["Reason"], restarts(info), info["ExitCode"]) == ("PENDING", "BeginTime", 1, "0:0")
    assert info["TRES"] == "cpu=2,node=1,billing=2" and info["Power"] == ""
    spaced = parse_job_line("JobId=7 JobState=FAILED Reason=NonZeroExitCode Command=/a dir/run.sh ExitCode=2:0")
    assert spaced["Command"] == "/a dir/run.sh" and spaced["ExitCode"] == "2:0"


@pytest.mark.parametrize(
    ("state", "exit_status", "stopped", "expected"),
    [
        ("COMPLETED", "0:0", False, 0),
        ("FAILED", "2:0", False, 2),  # a rank's user error: its record is in the report
        ("FAILED", "75:0", False, 75),  # the ranks saved their step (a signal before the time limit)
        ("CANCELLED", "0:15", True, 75),  # the driver was stopped and cancelled the job
        ("PREEMPTED", "0:15", False, 75),
        ("CANCELLED", "0:15", False, 1),  # someone else's scancel
        ("FAILED", "1:0", False, 1),
        ("TIMEOUT", "0:1", False, 1),
        ("NODE_FAIL", "0:0", False, 1),
    ],
)
def test_the_final_state_is_the_local_launchs_exit_code(state, exit_status, stopped, expected):
    said = []
    info = parse_job_line(f"JobId=9 JobState={state} Reason=X ExitCode={exit_status}")
    assert exit_code("9", info, Path("logs/slurm/train-9.out"), said.append, stopped=stopped) == expected
    if expected == 1:
        assert state in said[-1] and "logs/slurm/train-9.out" in said[-1]


def test_the_engine_clock_splits_queueing_from_waiting_after_a_requeue():
    spans = {}
    clock = EngineClock(spans, waiting_since=100.0)
    for state, count, now in [
        ("PENDING", 0, 101),
        ("RUNNING", 0, 103),
        ("RUNNING", 0, 110),
        ("PENDING", 1, 111),
        ("PENDING", 1, 112),
        ("RUNNING", 1, 116),
        ("COMPLETED", 1, 120),
    ]:
        clock.update(state, count, now)
    assert spans == {"engine_queue": 3.0, "engine_requeue": 5.0}


# --- the driver against fake Slurm commands ----------------------------------------------------------------

FAKE_SBATCH = """#!{python}
import pathlib, sys
d = pathlib.Path({dir!r})
(d / "sbatch.args").write_text("\\n".join(sys.argv[1:]))
if (d / "refuse").exists():
    sys.exit("sbatch: error: invalid partition specified: gpu")
script = pathlib.Path(sys.argv[-1]).read_text()
output = next(l.split("=", 1)[1] for l in script.splitlines() if l.startswith("#SBATCH --output="))
pathlib.Path(output.replace("%j", "42")).write_text("rank 0: step 1\\nrank 0: step 2\\n")
print("42;cluster")
"""
# scontrol: the next line of `states` per call (the last one repeats); after a scancel, `after_cancel` if any
FAKE_SCONTROL = """#!{python}
import pathlib
d = pathlib.Path({dir!r})
calls = int((d / "calls").read_text()) if (d / "calls").exists() else 0
(d / "calls").write_text(str(calls + 1))
states = (d / "states").read_text().splitlines()
line = states[min(calls, len(states) - 1)]
if (d / "scancel.args").exists() and (d / "after_cancel").exists():
    line = (d / "after_cancel").read_text()
print("JobId=42 JobName=fineflow-train " + line)
"""
FAKE_SCANCEL = """#!{python}
import pathlib, sys
d = pathlib.Path({dir!r})
with (d / "scancel.args").open("a") as fh:
    fh.write(" ".join(sys.argv[1:]) + "\\n")
"""

# squeue --me --name=fineflow-train --format="%i %T %Z": the lines of `queue`, if any
FAKE_SQUEUE = """#!{python}
import pathlib
d = pathlib.Path({dir!r})
if (d / "queue").exists():
    print((d / "queue").read_text())
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """Fake sbatch/scontrol/scancel on PATH, the project in tmp_path/project; returns the fakes' folder."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = [("sbatch", FAKE_SBATCH), ("scontrol", FAKE_SCONTROL), ("scancel", FAKE_SCANCEL), ("squeue", FAKE_SQUEUE)]
    for name, text in fakes:
        _executable(bin_dir / name, text.format(python=sys.executable, dir=str(bin_dir)))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    (tmp_path / "project").mkdir()
    monkeypatch.chdir(tmp_path / "project")
    return bin_dir


def _states(bin_dir: Path, *lines: str) -> None:
    (bin_dir / "states").write_text("\n".join(lines))


def _drive(tmp_path, overrides=None):
    said, spans = [], {}
    code = run_on_slurm(_job(tmp_path, overrides), said.append, spans, poll_s=0.01)
    return code, said, spans


def test_the_driver_submits_streams_the_output_and_waits_for_completion(tmp_path, fake_slurm):
    _states(
        fake_slurm,
        "JobState=PENDING Restarts=0 ExitCode=0:0",
        "JobState=RUNNING Restarts=0 ExitCode=0:0",
        "JobState=COMPLETING Restarts=0 ExitCode=0:0",
        "JobState=COMPLETED Restarts=0 ExitCode=0:0",
    )
    code, said, spans = _drive(tmp_path)
    assert code == 0
    args = (fake_slurm / "sbatch.args").read_text().splitlines()
    assert args[0] == "--parsable" and args[1].startswith("logs/slurm/train-") and args[1].endswith(".sbatch")
    assert ["rank 0: step 1", "rank 0: step 2"] == [line for line in said if line.startswith("rank")]
    assert any("job 42" in line and "logs/slurm/train-42.out" in line for line in said)
    assert set(spans) == {"engine_queue"} and int((fake_slurm / "calls").read_text()) == 4


def test_a_requeued_job_keeps_the_driver_waiting_and_its_wait_is_engine_time(tmp_path, fake_slurm):
    _states(
        fake_slurm,
        "JobState=RUNNING Restarts=0 ExitCode=0:0",
        "JobState=PENDING Restarts=1 ExitCode=0:0",
        "JobState=PENDING Restarts=1 ExitCode=0:0",
        "JobState=RUNNING Restarts=1 ExitCode=0:0",
        "JobState=COMPLETED Restarts=1 ExitCode=0:0",
    )
    code, said, spans = _drive(tmp_path)
    assert code == 0 and set(spans) == {"engine_queue", "engine_requeue"}
    assert not (fake_slurm / "scancel.args").exists()


def test_more_requeues_than_max_restarts_cancel_the_job_and_fail(tmp_path, fake_slurm):
    _states(
        fake_slurm,
        "JobState=RUNNING Restarts=0 ExitCode=0:0",
        "JobState=PENDING Restarts=1 ExitCode=0:0",
        "JobState=PENDING Restarts=2 ExitCode=0:0",
        "JobState=RUNNING Restarts=2 ExitCode=0:0",
    )
    code, said, _ = _drive(tmp_path, {"train.max_restarts": 1})
    assert code == 1
    assert (fake_slurm / "scancel.args").read_text() == "42\n"
    assert "requeued 2 times, more than train.max_restarts (1)" in said[-1]


def test_a_ranks_user_error_exits_2(tmp_path, fake_slurm):
    _states(fake_slurm, "JobState=RUNNING Restarts=0 ExitCode=0:0", "JobState=FAILED Restarts=0 ExitCode=2:0")
    assert _drive(tmp_path)[0] == 2


def test_a_stopped_driver_signals_the_ranks_and_returns_75_once_they_saved(tmp_path, fake_slurm):
    _states(fake_slurm, "JobState=RUNNING Restarts=0 ExitCode=0:0")
    (fake_slurm / "after_cancel").write_text("JobState=FAILED Restarts=0 ExitCode=75:0")
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        code, said, _ = _drive(tmp_path)
    finally:
        timer.cancel()
    assert code == 75
    assert (fake_slurm / "scancel.args").read_text() == "--signal=TERM 42\n"


def test_sbatchs_refusal_is_a_user_error_with_its_message(tmp_path, fake_slurm):
    (fake_slurm / "refuse").touch()
    with pytest.raises(FineflowError, match=r"sbatch refused .*train\.slurm.*invalid partition specified: gpu"):
        _drive(tmp_path)


def test_no_slurm_client_on_path_is_a_user_error_naming_the_package(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FineflowError, match=r"sbatch, scontrol, scancel, squeue not found.*slurm-client"):
        run_on_slurm(_job(tmp_path), print, {})


# --- a real one-host Slurm (nightly) -----------------------------------------------------------------------

SLURM_CONF = """\
ClusterName=fineflow-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser={user}
SlurmdUser={user}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.sock
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
# no cgroups in a container: processes tracked by parentage, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobRequeue=1
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName=localhost NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun")


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as fh:
        return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(condition, timeout: float, what: str, logs: list[Path]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(0.2)
    said = "\n".join(f"--- {log}\n{log.read_text()[-2000:]}" for log in logs if log.exists())
    raise AssertionError(f"{what} within {timeout:g} s\n{said}")


def _squeue(env) -> str:
    return subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30).stdout.strip()


def _node_idle(env) -> bool:
    done = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
    return done.stdout.strip() == "idle"


@pytest.fixture
def slurm_cluster(tmp_path):
    """munged, slurmctld and slurmd of one node (localhost, 2 CPUs) on 127.0.0.1, state under tmp_path; yields
    the environment (SLURM_CONF) for its clients. Stopped by PID afterwards, whatever happened."""
    missing = [name for name in (*DAEMONS, "sinfo", "squeue") if shutil.which(name) is None]
    if missing:
        pytest.skip(
            f"no Slurm here ({', '.join(missing)} missing): apt-get install slurmctld slurmd munge slurm-client"
        )
    if os.geteuid() != 0:
        pytest.skip("a one-host Slurm needs root: slurmd starts each job as its user (the workflow runs it with sudo)")
    root = tmp_path / "slurm"
    for name in ("munge", "state", "spool", "log"):
        (root / name).mkdir(parents=True)
    (root / "munge").chmod(0o700)
    key = root / "munge/munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    user = pwd.getpwuid(os.geteuid()).pw_name  # not $USER: sudo -E keeps the caller's
    conf.write_text(
        SLURM_CONF.format(
            host=os.uname().nodename.split(".")[0], user=user, root=root, ctld_port=free_port(), d_port=free_port()
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    logs = [root / "log/munged.out", root / "log/slurmctld.out", root / "log/slurmd.out", root / "log/slurmctld.log"]
    munge = root / "munge"
    daemons = [
        _start(
            [
                "munged",
                "-F",
                "--force",
                f"--key-file={key}",
                f"--socket={munge}/munge.sock",
                f"--pid-file={munge}/munged.pid",
                f"--seed-file={munge}/seed",
                f"--log-file={munge}/log",
            ],
            logs[0],
        )
    ]
    try:
        _wait_for(lambda: (munge / "munge.sock").exists(), 30, "munged did not open its socket", logs)
        daemons.append(_start(["slurmctld", "-D", "-i", "-f", str(conf)], logs[1]))
        daemons.append(_start(["slurmd", "-D", "-N", "localhost", "-f", str(conf)], logs[2]))
        _wait_for(lambda: _node_idle(env), 60, "the node did not become idle", logs)
        yield env
    finally:
        if len(daemons) == 3:  # a test that failed mid-job: its ranks end with the job, before slurmd does
            subprocess.run(["scancel", "--user", user], env=env, capture_output=True, timeout=30)
            with contextlib.suppress(AssertionError):
                _wait_for(lambda: not _squeue(env), 60, "the cancelled jobs did not end", [])
        for daemon in reversed(daemons):
            stop_by_pid(daemon)


def _slurm_job_id(project: Path) -> str | None:
    outputs = sorted((project / "logs/slurm").glob("train-*.out")) if (project / "logs/slurm").exists() else []
    return outputs[0].name.removeprefix("train-").removesuffix(".out") if outputs else None


@contextlib.contextmanager
def _driver(project: Path, env: dict):
    """The train stage (the driver) running in project, checkpoint writes slowed 0.1 s so that a run lasts long
    enough for a requeue or a stop to land mid-run; SIGKILLed (its process group) if a test leaves it running."""
    driver = subprocess.Popen(
        TRAIN,
        cwd=project,
        env=fault_env(env, write_delay_s=0.1),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        yield driver
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()


def _scontrol(env, *args: str) -> str:
    return subprocess.run(["scontrol", *args], env=env, capture_output=True, text=True, check=True).stdout


@pytest.mark.nightly
def test_a_slurm_job_trains_what_the_local_launch_trains_and_a_requeue_resumes_bit_exact(
    built, reference_run, slurm_cluster, tmp_path
):
    from safetensors.torch import load_file

    reference = load_file(reference_run(2) / "models/candidate/adapter_model.safetensors")
    overrides = ranks_overrides(2) | {"train.launcher": "slurm", "train.slurm.partition": "debug"}
    env = venv_env() | {"SLURM_CONF": slurm_cluster["SLURM_CONF"], "OMP_NUM_THREADS": "1"}

    # an uninterrupted run: the adapter the local 2-process launch trains, bit for bit
    plain = train_project(built, tmp_path / "plain", overrides)
    started = time.monotonic()
    done = subprocess.run(TRAIN, cwd=plain, env=env, capture_output=True, text=True, timeout=600)
    print(f"slurm run: {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "slurm: submitted job" in done.stdout + done.stderr
    adapter = load_file(plain / "models/candidate/adapter_model.safetensors")
    assert adapter.keys() == reference.keys() and all(adapter[k].equal(reference[k]) for k in adapter)

    # requeued mid-run (what a preemption with PreemptMode=REQUEUE does): the next allocation resumes from the
    # step the ranks saved on SIGTERM and ends with the same adapter.
    requeued = train_project(built, tmp_path / "requeued", overrides)
    started = time.monotonic()
    with _driver(requeued, env) as driver:
        _wait_for(lambda: last_logged_step(requeued) >= 3, 300, "the job did not reach step 3", [])
        job_id = _slurm_job_id(requeued)
        _scontrol(slurm_cluster, "requeue", job_id)
        requeued_at = last_logged_step(requeued)
        # Slurm holds a requeued job ~2 minutes (its BeginTime)
        _wait_for(
            lambda: "JobState=PENDING" in _scontrol(slurm_cluster, "show", "job", "-o", job_id),
            60,
            "the requeued job did not go back to PENDING",
            [],
        )
        # while it waits, a second driver in the same workspace is refused, naming the job (squeue's answer)
        second = subprocess.run(TRAIN, cwd=requeued, env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, (second.stdout + second.stderr)[-3000:]
        assert f"slurm job {job_id} (PENDING) is already training in" in second.stdout + second.stderr
        _scontrol(slurm_cluster, "update", f"JobId={job_id}", "StartTime=now")  # start it as soon as the node is free
        output = driver.communicate(timeout=600)[0]
    print(f"requeued slurm run: {time.monotonic() - started:.1f} s")
    assert driver.returncode == 0, output[-4000:]
    assert requeued_at < 12 and "restart 1" in output, output[-4000:]
    assert "Restarts=1" in _scontrol(slurm_cluster, "show", "job", "-o", job_id)
    report = json.loads((requeued / "reports/train.json").read_text())
    assert report["resumed_from_step"] >= requeued_at - 1 > 0
    steps = [json.loads(line)["step"] for line in (requeued / "reports/train_steps.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))
    adapter = load_file(requeued / "models/candidate/adapter_model.safetensors")
    assert all(adapter[k].equal(reference[k]) for k in reference)
    # the driver's journal: the wait for the first allocation and for the one after the requeue, as engine time
    journal = [json.loads(line) for line in (requeued / "reports/ledger/journal.jsonl").read_text().splitlines()]
    ends = [line for line in journal if line["event"] == "end" and line["stage"] == "train"]
    assert [end["exit"] for end in ends] == [2, 0]  # the refused second driver, then the requeued job's
    end = ends[-1]
    assert end["spans"]["engine_queue"] > 0 and end["spans"]["engine_requeue"] > 0
    print(f"engine time: queue {end['spans']['engine_queue']:.1f} s, requeue {end['spans']['engine_requeue']:.1f} s")


@pytest.mark.nightly
def test_a_stopped_slurm_driver_has_the_ranks_save_their_step_and_exits_75(built, slurm_cluster, tmp_path):
    """SIGTERM to the driver (what the Prefect task or Ctrl-C sends): scancel --signal=TERM reaches the ranks
    through slurmstepd, they save the step they are on, and the stage exits 75 like a local launch."""
    overrides = ranks_overrides(2) | {"train.launcher": "slurm"}
    env = venv_env() | {"SLURM_CONF": slurm_cluster["SLURM_CONF"], "OMP_NUM_THREADS": "1"}
    project = train_project(built, tmp_path / "stopped", overrides)
    with _driver(project, env) as driver:
        _wait_for(lambda: last_logged_step(project) >= 3, 300, "the job did not reach step 3", [])
        stopped = time.monotonic()
        driver.send_signal(signal.SIGTERM)  # the driver alone: the ranks are Slurm's, not its children
        output = driver.communicate(timeout=120)[0]
    print(f"stop to exit: {time.monotonic() - stopped:.1f} s")
    assert driver.returncode == 75, output[-4000:]
    assert "SIGTERM sent to job" in output and "Exited with exit code 75" in output, output[-4000:]
    info = parse_job_line(_scontrol(slurm_cluster, "show", "job", "-o", _slurm_job_id(project)))
    assert (job_state(info), info["ExitCode"]) == ("FAILED", "75:0")
    assert last_logged_step(project) < 12  # stopped, not finished
    assert "ran out before the step was saved" not in output, output[-4000:]


def test_the_stage_on_two_machines_submits_one_two_node_job_instead_of_refusing(built, tmp_path, fake_slurm):
    """train.num_machines: 2 with train.launcher: slurm is not refused ("machine_rank must be given ...") though
    dvc.yaml's command passes no placement: the stage's planner runs, then one 2-node allocation is submitted
    (here to fake Slurm commands whose job fails at once: the stage exits 1, naming it)."""
    # the test machine's tmp dir is node-local: the refusal of a node-local checkpoints dir is test_launch's
    overrides = ranks_overrides(2) | {"train.launcher": "slurm", "train.num_machines": 2, "checkpoint.shared": True}
    project = train_project(built, tmp_path / "two-machines", overrides)
    _states(fake_slurm, "JobState=FAILED Reason=NonZeroExitCode Restarts=0 ExitCode=1:0")
    env = venv_env() | {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1"}
    done = subprocess.run(TRAIN, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert "machine_rank must be given" not in output
    assert "slurm: job 42 ended FAILED (reason NonZeroExitCode, exit code 1, signal 0)" in output
    script = (project / (fake_slurm / "sbatch.args").read_text().splitlines()[-1]).read_text()
    assert {"--nodes=2", "--ntasks-per-node=1"} <= set(_directives(script))


def test_a_job_still_training_in_this_workspace_is_named_instead_of_submitting_a_second(tmp_path, fake_slurm):
    """A driver killed by SIGKILL leaves its job running: a second job would write the same checkpoints."""
    _states(fake_slurm, "JobState=COMPLETED Restarts=0 ExitCode=0:0")
    elsewhere = tmp_path / "other-project"
    (fake_slurm / "queue").write_text(f"41 RUNNING {elsewhere}\n")
    assert _drive(tmp_path)[0] == 0  # another workspace's job: not ours
    (fake_slurm / "queue").write_text(f"41 RUNNING {elsewhere}\n39 PENDING {Path.cwd().resolve()}\n")
    (fake_slurm / "sbatch.args").unlink()
    with pytest.raises(FineflowError, match=r"slurm job 39 \(PENDING\) is already training in .*scancel 39"):
        _drive(tmp_path)
    assert not (fake_slurm / "sbatch.args").exists()
