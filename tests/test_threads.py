"""The thread policy (fineflow.core.threads): each process computes with its share of the CPUs it may really use
(affinity mask, cgroup quota), decided once (params, then OMP_NUM_THREADS, then the share), recorded in the
stage's report; through the real train stage, its launcher and accelerate launch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from fineflow.core import threads
from fineflow.core.threads import ThreadPlan, cgroup_cpu_quota, plan_threads, process_plan, usable_cpus


def _cgroup(root, files: dict[str, str]):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_cgroup_quota_caps_the_usable_cpus_v2_and_v1(tmp_path):
    """A container limited to 1.5 CPUs on a 16-CPU affinity mask has 1 usable CPU; "max" and -1 are no limit;
    the tightest quota from the process's own cgroup up to the root applies."""
    v2 = _cgroup(tmp_path / "v2", {"cpu.max": "max 100000\n", "job/cpu.max": "150000 100000\n", "job/step/x": ""})
    assert cgroup_cpu_quota(v2, "0::/job/step\n") == 1.5
    assert usable_cpus(affinity=16, quota=cgroup_cpu_quota(v2, "0::/job/step\n")) == 1
    assert cgroup_cpu_quota(v2, "0::/\n") is None  # the root's "max"
    v1 = _cgroup(
        tmp_path / "v1",
        {"cpu,cpuacct/docker/c1/cpu.cfs_quota_us": "400000\n", "cpu,cpuacct/docker/c1/cpu.cfs_period_us": "100000\n"},
    )
    assert cgroup_cpu_quota(v1, "4:cpu,cpuacct:/docker/c1\n1:name=systemd:/\n") == 4.0
    unlimited = _cgroup(tmp_path / "v1u", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota(unlimited, "3:cpu:/\n") is None
    assert usable_cpus(affinity=2, quota=None) == 2 and usable_cpus(affinity=8, quota=0.5) == 1  # at least 1


def test_the_usable_cpus_follow_the_affinity_mask_not_the_machine():
    assert usable_cpus(quota=None) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("processes", "setting", "environ", "expected"),
    [
        (2, None, {}, (8, "auto")),  # each rank its share of 16 CPUs
        (4, None, {}, (4, "auto")),
        (32, None, {}, (1, "auto")),  # at least one
        (1, None, {}, (16, "auto")),  # one process: every usable CPU
        (2, None, {"OMP_NUM_THREADS": "3"}, (3, "OMP_NUM_THREADS")),  # the user's (or a scheduler's) choice
        (2, 5, {"OMP_NUM_THREADS": "3"}, (5, "params")),  # train.threads wins
        (2, None, {"OMP_NUM_THREADS": ""}, (8, "auto")),  # set but empty: not a choice
    ],
)
def test_the_plan_is_params_then_omp_num_threads_then_the_share(processes, setting, environ, expected):
    plan = plan_threads(processes, setting, environ, cpus=16)
    assert (plan.per_process, plan.source) == expected
    threads = str(expected[0])
    assert plan.environment() == {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, ("passive", "fineflow", "PASSIVE")),  # a waiting thread sleeps: a shared machine cannot collapse
        ({"OMP_WAIT_POLICY": "ACTIVE"}, ("ACTIVE", "OMP_WAIT_POLICY", None)),  # the user's, inherited as set
        ({"OMP_WAIT_POLICY": ""}, ("", "OMP_WAIT_POLICY", None)),  # set empty: OpenMP's own default, kept
        ({"OMP_WAIT_POLICY": "PASSIVE"}, ("passive", "fineflow", "PASSIVE")),  # the plan's own, inherited
    ],
)
def test_waiting_threads_sleep_unless_the_user_chose_how(environ, expected):
    """Spinning OpenMP threads take a shared machine's CPUs from the threads with work (bench/threads.py: 0.02 of
    the solo throughput each for two copies): the plan exports a passive wait, and leaves a user's own
    OMP_WAIT_POLICY to the process, which inherits it, and to the record."""
    plan = plan_threads(2, None, environ, cpus=4)
    assert (plan.wait, plan.wait_source, plan.environment().get("OMP_WAIT_POLICY")) == expected
    assert plan.per_process == 2  # the wait never changes the thread count (nor, so, a result)
    assert process_plan(2, None, plan.child_environment()) == plan


def test_a_process_follows_its_launchers_plan_not_the_variables_it_was_given():
    """The launcher exports OMP_NUM_THREADS for its ranks: a rank must not read it back as the user's choice."""
    plan = plan_threads(2, None, {}, cpus=2)
    given = process_plan(2, None, plan.child_environment())
    assert given == plan and given.source == "auto" and given.per_process == 1


def launched_env(params, monkeypatch) -> tuple[dict, list[str]]:
    """The environment fineflow.train.procedure.launch_ranks hands the ranks, and its log (the planner and the launch
    itself replaced: only the command and environment it builds are real)."""
    from fineflow.train import procedure
    from fineflow.train.profile import load_profile
    from fineflow.train.run_plan import RunPlan

    memory = {
        "gib": dict.fromkeys(("weights", "gradients", "optimizer_states", "activations", "overhead", "total"), 0.1),
        "device_bytes": 2**30,
    }
    plan = RunPlan(params, load_profile(params.train.accelerate_profile), memory)
    seen = {}
    monkeypatch.setattr(procedure, "resolve_base_model", lambda model, base_dir: None)
    monkeypatch.setattr(procedure, "fit_plan", lambda *args: plan)
    monkeypatch.setattr(procedure, "run_ranks", lambda command, env, grace, log: seen.update(env) or 0)
    lines: list[str] = []
    placement = {"base_dir": "b", "main_process_port": None, "machine_rank": None, "main_process_ip": None}
    assert procedure.launch_ranks(params, "m", [], placement, log=lines.append) == 0
    return seen, lines


def _with_train(params, **update):
    return params.model_copy(update={"train": params.train.model_copy(update=update)})


def test_the_launcher_decides_each_local_ranks_share_once_and_says_it(tiny_params, monkeypatch):
    """Every rank of the machine gets usable CPUs // ranks, one rank included (torch's default would be the
    machine's cores, whatever its quota), with the plan itself, which the rank records."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 6)
    for ranks, share in ((1, 6), (2, 3), (4, 1)):
        env, lines = launched_env(_with_train(tiny_params, num_processes=ranks), monkeypatch)
        assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == str(share) and env["OMP_WAIT_POLICY"] == "PASSIVE"
        assert json.loads(env[threads.PLAN_ENV]) == {
            "usable_cpus": 6,
            "local_processes": ranks,
            "per_process": share,
            "source": "auto",
            "wait": "passive",
            "wait_source": "fineflow",
        }
        assert any(f"threads: {share} threads per process (6 usable CPUs / {ranks} processes" in x for x in lines)


def test_a_thread_count_the_user_set_is_kept_and_train_threads_wins_over_it(tiny_params, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    env, lines = launched_env(_with_train(tiny_params, num_processes=2), monkeypatch)
    assert env["OMP_NUM_THREADS"] == "3" and any("3 threads per process (OMP_NUM_THREADS)" in x for x in lines)
    env, lines = launched_env(_with_train(tiny_params, num_processes=2, threads=1), monkeypatch)
    assert env["OMP_NUM_THREADS"] == "1" and any("1 threads per process (params)" in x for x in lines)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs util-linux's taskset")
def test_the_train_stage_on_one_cpu_of_the_affinity_mask_trains_with_one_thread_and_records_it(built, tmp_path):
    """The real layers (the stage's launcher, accelerate launch, the rank) pinned to one CPU by taskset, with no
    OMP_NUM_THREADS: the launcher plans 1 thread, the rank computes with 1 (torch's own count, in the report's
    device facts) and reports/train.json records the plan; the CPU facts say what the doctor reads."""
    from tests.conftest import TRAIN, train_project, venv_env

    project = train_project(built, tmp_path / "p", {"train.steps": 2, "train.eval_every": 2})
    env = {k: v for k, v in venv_env().items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    first = sorted(os.sched_getaffinity(0))[0]
    done = subprocess.run(
        ["taskset", "-c", str(first), *TRAIN], cwd=project, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "threads: 1 threads per process (1 usable CPUs / 1 processes on this machine" in done.stdout
    report = json.loads((project / "reports/train.json").read_text())
    assert report["threads"] == {
        "usable_cpus": 1,
        "local_processes": 1,
        "per_process": 1,
        "source": "auto",
        "wait": "passive",
        "wait_source": "fineflow",
    }
    cpu = report["device"]["cpu"]
    assert cpu["cores"] == 1 and cpu["threads_per_rank"] == 1 and cpu["local_ranks"] == 1
    assert cpu["runnable_during"]["machine_cpus"] >= 1


def test_every_stage_report_records_its_thread_plan(tmp_path, monkeypatch):
    """The data stage through its entry: its one process has every usable CPU, and its report says so."""
    from fineflow.stages import data
    from tests.conftest import write_params

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 3)
    params = write_params(tmp_path / "params.yaml")
    argv = ["--params", str(params), "--train", "raw/train.jsonl", "--eval", "raw/eval.jsonl", "--report", "r.json"]
    assert data.main(argv) == 0
    assert json.loads((tmp_path / "r.json").read_text())["threads"] == ThreadPlan(3, 1, 3, "auto").as_record()
    assert os.environ["OMP_NUM_THREADS"] == "3"  # what the stage's own child processes inherit
