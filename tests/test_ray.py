"""train.launcher: ray (fineflow/train/engines/ray.py): the driver's decisions in milliseconds; then a real two-node
Ray cluster on loopback trains what the local 2-process launch trains, bit for bit (scenario), and survives the
loss of a node, mid-step and mid-save (nightly).

The clusters run on 127.0.0.2 and 127.0.0.3, not 127.0.0.1: Ray rewrites 127.0.0.1 and localhost to the machine's
routable address (ray._private.services.resolve_ip_for_localhost), while the rest of 127.0.0.0/8 is loopback it
leaves alone; two addresses make two nodes Ray Train tells apart (node_rank 0 and 1). Ray's servers bind every
interface whatever the node address: the test keeps to loopback in what it addresses."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from fineflow.core import journal
from fineflow.errors import PREEMPTED_EXIT, USER_ERROR_EXIT, FineflowError
from fineflow.goodput import ledger
from fineflow.train.engines import ray as engine
from tests.conftest import (
    TRAIN,
    checkpoint_being_saved,
    free_port,
    last_logged_step,
    ranks_overrides,
    train_project,
    venv_env,
)
from tests.faults import fault_env
from tests.test_goodput import GOODPUT, _attempt, assert_adds_up

# --- the driver's decisions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ({0: 0, 1: 0}, 0),
        ({0: USER_ERROR_EXIT, 1: 1}, USER_ERROR_EXIT),  # a peer that lost the rank with the user error
        ({0: PREEMPTED_EXIT, 1: PREEMPTED_EXIT}, PREEMPTED_EXIT),
        ({0: PREEMPTED_EXIT, 1: USER_ERROR_EXIT}, USER_ERROR_EXIT),
        ({0: 0}, 1),  # rank 1 never reported (its node went away after the last restart)
        ({0: 1, 1: 0}, 1),
    ],
)
def test_the_drivers_exit_code_keeps_the_local_launchs_meaning(codes, expected):
    assert engine.outcome(codes, world=2) == expected


def test_only_crashes_are_retried_by_ray_train():
    assert [code for code in (0, 1, 2, 75, 137, -9) if code not in engine.FINAL_CODES] == [1, 137, -9]


def test_a_rank_gets_torchruns_variables_and_the_drivers_offline_and_import_settings():
    driver = {
        "PYTHONPATH": "/project",
        "HF_HOME": "/cache/hf",
        "HF_HUB_OFFLINE": "1",
        "FINEFLOW_TEST_WRITE_DELAY_S": "1",
        "OMP_NUM_THREADS": "1",
        "PATH": "/driver/bin",  # the node's own
        "HOME": "/home/driver",
        "CUDA_VISIBLE_DEVICES": "0,1",  # Ray sets it per worker
    }
    base = engine.forwarded_env(driver)
    assert base == {
        k: driver[k] for k in ("PYTHONPATH", "HF_HOME", "HF_HUB_OFFLINE", "FINEFLOW_TEST_WRITE_DELAY_S")
    } | {"OMP_NUM_THREADS": "1"}
    env = engine.rank_env(base | {"FINEFLOW_TRAIN_WORKER": "1"}, 3, 4, 1, 2, ("10.0.0.5", 29400))
    assert env["FINEFLOW_TRAIN_WORKER"] == "1" and env["PYTHONPATH"] == "/project"
    assert {
        k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    } == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29400",
    }


def test_the_cluster_is_train_ray_address_then_ray_address_then_a_local_one():
    assert engine.resolve_address("head:6379", {"RAY_ADDRESS": "other:6379"}) == "head:6379"
    assert engine.resolve_address(None, {"RAY_ADDRESS": "other:6379"}) == "other:6379"
    assert engine.resolve_address(None, {}) is None


def test_a_cluster_with_fewer_resources_than_ranks_is_refused_saying_what_it_has():
    needed = engine.needs_resources(4, has_gpu=True, cpus_per_worker=2)
    assert needed == {"CPU": 8, "GPU": 4}
    engine.check_resources(needed, {"CPU": 16.0, "GPU": 4.0, "memory": 1e9}, 2, "head:6379")  # enough
    with pytest.raises(FineflowError) as refused:
        engine.check_resources(needed, {"CPU": 16.0, "GPU": 2.0}, 2, "head:6379")
    message = str(refused.value)
    assert "head:6379 has 16 CPU, 2 GPU over 2 node(s)" in message and "needs 8 CPU, 4 GPU" in message
    assert "train.num_processes" in message


def test_strict_spread_over_fewer_nodes_than_ranks_is_refused():
    engine.check_placement("STRICT_SPREAD", 2, 2, "head:6379")
    engine.check_placement("SPREAD", 4, 1, "head:6379")  # SPREAD packs what it cannot spread
    with pytest.raises(FineflowError, match=r"head:6379 has 1 node\(s\): add nodes, or use SPREAD or PACK"):
        engine.check_placement("STRICT_SPREAD", 2, 1, "head:6379")


def test_without_ray_the_message_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(FineflowError, match=r"pip install 'fineflow\[cluster\]'"):
        engine.require_ray()


@pytest.mark.slow  # imports ray (~2 s)
def test_an_unreachable_cluster_is_named_at_once(monkeypatch, tiny_params):
    from fineflow.train.engines import RankJob

    pytest.importorskip("ray")
    for key in ("RAY_DEDUP_LOGS", "RAY_TRAIN_V2_ENABLED", "RAY_ADDRESS"):
        monkeypatch.delenv(key, raising=False)  # the driver sets the first two; restored after the test
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    train = tiny_params.train.model_copy(update={"ray": tiny_params.train.ray.model_copy(update={"address": address})})
    job = RankJob("fineflow.stages.train", [], 2, 1, False, None, tiny_params.model_copy(update={"train": train}), 5.0)
    started = time.monotonic()
    with pytest.raises(FineflowError, match=f"cannot reach the Ray cluster at {address}"):
        engine.run_on_ray(job, log=lambda line: None)
    assert time.monotonic() - started < 30  # not ray.init's minutes of retries


def test_engine_time_is_placement_restarts_and_the_failed_groups_work():
    """Group 0 starts 5 s after the submit, crashes 10 s later; group 1 is opened 1 s after the crash and its
    rank 0 starts 4 s later: placement 5, lost 10, restarts 5."""
    events = [
        ("group", 0, 100.0),
        ("start", 0, 1, 104.5),
        ("start", 0, 0, 105.0),
        ("exit", 0, 1, 1, 115.0),
        ("group", 1, 116.0),
        ("start", 1, 0, 120.0),
        ("start", 1, 1, 119.0),
        ("exit", 1, 0, 0, 150.0),
        ("exit", 1, 1, 0, 150.0),
    ]
    assert engine.engine_spans(events, world=2, submitted=100.0) == {
        "engine_placement": 5.0,
        "engine_restarts": 5.0,
        "engine_lost": 10.0,
    }
    # a lost node reports no exit: the failure is dated by the next group's opening
    lost_node = [e for e in events if e[0] != "exit" or e[1] != 0]
    assert engine.engine_spans(lost_node, world=2, submitted=100.0)["engine_restarts"] == 4.0


def test_the_ledger_puts_engine_time_in_its_bucket_once_and_still_adds_up(tmp_path):
    """The launcher's `launch` span (planning to rank 0's process) contains the engine's spans: each second is
    counted once, and the buckets add up to the wall time."""
    records: list[dict] = []
    engine_spans = {"engine_connect": 1.0, "engine_placement": 5.0, "engine_lost": 2.0, "engine_restarts": 3.0}
    spans = {"params": 0.5, "launch": 13.0, "rank_startup": 1.0, "loop_compute": 15.0, "rank_exit": 0.5}
    _attempt(records, "train", "test-run", 1000.0, 1001.0, 1031.0, spans=spans | engine_spans)
    result = ledger.build(records, tmp_path, "test-run", now=1031.0)
    assert_adds_up(result)
    assert result["buckets"]["engine"] == pytest.approx(9.0)
    assert result["buckets"]["restart_loss"] == pytest.approx(2.0)
    assert result["buckets"]["startup"] == pytest.approx(1.0 + 0.5 + 2.0 + 1.0 + 0.5)  # launch less the engine's
    assert result["unaccounted_s"] == pytest.approx(0.0, abs=1e-6)


# --- a real cluster on loopback -----------------------------------------------------------------------------

RAY = str(Path(sys.executable).parent / "ray")
# every Ray process here, the drivers too: no token authentication (a new local Ray turns it on by default and
# writes ~/.ray/auth_token, after which `ray start --head` enables it and a worker node's `ray start` is refused)
RAY_ENV = {"OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
NODE_IPS = ("127.0.0.2", "127.0.0.3")


@dataclass
class Cluster:
    address: str
    root: Path  # every node's --temp-dir is under it: how its processes are found, by PID
    env: dict

    def node_dir(self, node: int) -> Path:
        return self.root / f"n{node}"

    def start_node(self, node: int) -> None:
        """`ray start` of node 0 (the head, on the address's port) or a worker node, one CPU each."""
        where = ["--head", "--port", self.address.rpartition(":")[2]] if node == 0 else ["--address", self.address]
        if node == 0:
            where += ["--ray-client-server-port", str(free_port()), "--include-dashboard", "false"]
        command = [RAY, "start", *where, "--node-ip-address", NODE_IPS[node], "--num-cpus", "1"]
        command += ["--num-gpus", "0", "--dashboard-agent-listen-port"]
        command += [str(free_port()), "--object-store-memory", str(80 * 2**20), "--disable-usage-stats"]
        command += ["--temp-dir", str(self.node_dir(node))]
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    def processes(self) -> list:
        """The cluster's processes: those naming its temp dirs, and everything they started (the workers)."""
        import psutil

        found = []
        for process in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if any(str(self.root) in arg for arg in process.info["cmdline"] or []):
                    found += [process, *process.children(recursive=True)]
        return found

    def lose_node(self, node: int) -> None:
        """SIGKILL the node's raylet by PID, and what it started (the node's Ray workers, hence their ranks),
        as a machine that goes away takes them all."""
        import psutil

        raylet = self.raylet(node)
        tree = [raylet, *raylet.children(recursive=True)]
        for process in tree:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(tree, timeout=10)

    def raylet(self, node: int):
        import psutil

        mine = str(self.node_dir(node))
        for process in self.processes():
            with contextlib.suppress(psutil.Error):
                if process.name() == "raylet" and any(mine in arg for arg in process.cmdline()):
                    return process
        raise AssertionError(f"no raylet of node {node} under {mine}")


@contextlib.contextmanager
def ray_cluster(nodes: int = 2):
    """A Ray cluster of `nodes` one-CPU nodes on loopback, stopped with `ray stop` and by PID (also on failure)."""
    import psutil

    # short: Ray's unix sockets live under it (a socket path has 107 characters at most)
    root = Path(tempfile.mkdtemp(prefix="ffray-", dir="/tmp"))
    env = {**venv_env(), **RAY_ENV}
    cluster = Cluster(f"{NODE_IPS[0]}:{free_port()}", root, env)
    try:
        for node in range(nodes):
            cluster.start_node(node)
        yield cluster
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
        left = cluster.processes()
        for process in left:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(left, timeout=10)
        shutil.rmtree(root, ignore_errors=True)


def ray_env(extra: dict | None = None) -> dict:
    """The train stage's environment for the test clusters."""
    return {**venv_env(), **RAY_ENV, **(extra or {})}


def ray_project(built: Path, path: Path, cluster: Cluster, overrides: dict | None = None) -> Path:
    """The 2-rank reference configuration, placed by Ray on the cluster."""
    ray_overrides = {"train.launcher": "ray", "train.ray.address": cluster.address, "train.max_restarts": 2}
    return train_project(built, path, {**ranks_overrides(2), **ray_overrides, **(overrides or {})})


def adapter_bytes(project: Path) -> bytes:
    return (project / "models/candidate/adapter_model.safetensors").read_bytes()


def start_stage(project: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        TRAIN, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def finish(proc: subprocess.Popen, timeout: float = 400) -> tuple[int, str]:
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0]
    return proc.returncode, output


@pytest.mark.nightly  # a two-node Ray cluster and a run (~120 s); CI keeps two torch nodes on loopback (test_ddp)
@pytest.mark.slow
def test_two_ray_nodes_train_the_local_two_process_adapter_bit_for_bit(
    built, reference_run, tmp_path, monkeypatch, tiny_params
):
    """`train.launcher: ray` on a two-node cluster, one rank per node over gloo: the stage as dvc.yaml runs it
    drives Ray Train and ends with the adapter the local 2-process launch writes, byte for byte; its ledger
    adds up with the engine's time in its own bucket. Then, on the same cluster, a crash is restarted and a user
    error is not (crash_then_user_error)."""
    reference = adapter_bytes(reference_run(2))
    env = ray_env({journal.RUN_ID_ENV: "test-ray", journal.RUN_STARTED_ENV: repr(time.time())})
    with ray_cluster() as cluster:
        project = ray_project(built, tmp_path / "p", cluster)
        started = time.monotonic()
        code, output = finish(start_stage(project, env))
        wall = time.monotonic() - started
        assert code == 0, output[-5000:]
        crash_then_user_error(tmp_path / "stub", monkeypatch, tiny_params, cluster.address)
    assert adapter_bytes(project) == reference
    report = json.loads((project / "reports/train.json").read_text())
    assert report["world_size"] == 2
    assert "[rank 0]" in output and "[rank 1]" in output  # both ranks' lines reached the driver
    assert "node_rank=1" in output  # Ray Train placed the second rank on the second node
    done = subprocess.run(GOODPUT, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((project / "reports/goodput.json").read_text())
    assert_adds_up(result)
    assert result["buckets"]["engine"] > 0
    print(f"ray scenario: stage wall {wall:.1f} s, engine bucket {result['buckets']['engine']:.1f} s")


def lose_node_when(cluster: Cluster, proc: subprocess.Popen, project: Path, condition, timeout=300) -> float:
    """SIGKILL node 1's raylet (its workers and ranks die with it) once condition(project) holds, then bring the
    node back so Ray Train can place the restarted group; returns when the kill landed (monotonic)."""
    deadline = time.monotonic() + timeout
    while not condition(project):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the kill"
        time.sleep(0.01)
    cluster.lose_node(1)
    killed = time.monotonic()
    time.sleep(2)  # the node is seen dead before it comes back as a new one
    cluster.start_node(1)
    return killed


def lost_node_resumes_bit_exact(built, reference_run, tmp_path, condition, env):
    """The run on two nodes, node 1 lost when condition(project) holds: restarted, resumed, bit-exact. env slows
    the steps (tests/faults) so that the loss lands before the run's end."""
    reference = adapter_bytes(reference_run(2))
    env = {**env, "FINEFLOW_TEST_LOADER_DELAY_S": "0.5"}
    with ray_cluster() as cluster:
        project = ray_project(built, tmp_path / "p", cluster)
        proc = start_stage(project, env)
        try:
            killed = lose_node_when(cluster, proc, project, condition)
        finally:
            code, output = finish(proc)
        restart_wall = time.monotonic() - killed
    (tmp_path / "stage.log").write_text(output)
    assert code == 0, output[-5000:]
    assert "Ray Train restarted the ranks" in output, output[-5000:]
    report = json.loads((project / "reports/train.json").read_text())
    assert report["resumed_from_step"] >= 2, report["resumed_from_step"]  # not from step 0: from a checkpoint
    assert adapter_bytes(project) == reference
    print(f"lost node: kill to the stage's end {restart_wall:.1f} s")


@pytest.mark.nightly
@pytest.mark.scenario
@pytest.mark.slow
def test_a_lost_node_mid_training_restarts_from_the_newest_checkpoint_bit_exact(built, reference_run, tmp_path):
    lost_node_resumes_bit_exact(
        built, reference_run, tmp_path, lambda project: last_logged_step(project) >= 5, fault_env(ray_env())
    )


@pytest.mark.nightly
@pytest.mark.scenario
@pytest.mark.slow
def test_a_node_lost_during_a_checkpoint_save_restarts_bit_exact(built, reference_run, tmp_path):
    env = fault_env(ray_env(), write_delay_s=1.0)  # a save long enough to be caught mid-write

    def saving(project):  # a later save in flight, after one was published (else a restart starts from step 0)
        return any(project.glob("checkpoints/*/step-*")) and checkpoint_being_saved(project)

    lost_node_resumes_bit_exact(built, reference_run, tmp_path, saving, env)


@pytest.mark.nightly
@pytest.mark.scenario
@pytest.mark.slow
def test_sigterm_to_the_ray_driver_saves_the_step_exits_75_and_the_rerun_is_bit_exact(built, reference_run, tmp_path):
    """SIGTERM to the stage (a preemption of the driver's machine, a Prefect cancel): the ranks on Ray save the
    step they are on and the stage exits 75 within checkpoint.preempt_grace_s; run again, it resumes and ends
    with the uninterrupted adapter."""
    reference = adapter_bytes(reference_run(2))
    with ray_cluster() as cluster:
        project = ray_project(built, tmp_path / "p", cluster)
        grace = yaml.safe_load((project / "params.yaml").read_text())["checkpoint"]["preempt_grace_s"]
        # slowed steps (tests/faults): the stop must land before the run's end
        env = fault_env(ray_env()) | {"FINEFLOW_TEST_LOADER_DELAY_S": "0.5"}
        proc = start_stage(project, env)
        deadline = time.monotonic() + 300
        while last_logged_step(project) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code, output = finish(proc)
        stopped_in = time.monotonic() - signalled
        assert code == PREEMPTED_EXIT, output[-5000:]
        assert stopped_in < grace + 10, stopped_in
        code, output = finish(start_stage(project, env))
    assert code == 0, output[-5000:]
    assert json.loads((project / "reports/train.json").read_text())["resumed_from_step"] >= 3
    assert adapter_bytes(project) == reference
    print(f"SIGTERM to the driver: exit 75 in {stopped_in:.1f} s")


STUB_RANK = """
import os, signal, sys, time
from pathlib import Path
from fineflow.process.preempt import die_with_parent

die_with_parent()  # as the train stage's rank does: a torn-down Ray worker takes its rank along
rank = int(os.environ["RANK"])
print(f"stub rank {rank} of {os.environ['WORLD_SIZE']} at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
sys.stdout.flush()
if rank == 1:
    time.sleep(1)
    if not Path("crashed-once").exists():
        Path("crashed-once").touch()
        sys.exit(1)  # a crash: Ray Train restarts the group
    sys.exit(2)  # a user error: final, never retried
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))  # the stop the driver sends when rank 1 gave up
time.sleep(120)
"""


def crash_then_user_error(tmp_path: Path, monkeypatch, params, address: str) -> None:
    """The driver in this process, stub ranks (STUB_RANK) on the cluster: rank 1 crashes (exit 1) and Ray Train
    starts the group again; then it exits 2: no third group although max_restarts allows it, rank 0 is asked to
    stop (exit 75), and the driver exits 2."""
    from fineflow.train.engines import RankJob

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "stub_rank.py").write_text(STUB_RANK)
    monkeypatch.chdir(tmp_path)  # the ranks' working directory, and .cache/ray
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    for key in ("RAY_DEDUP_LOGS", "RAY_TRAIN_V2_ENABLED", "RAY_ADDRESS"):
        monkeypatch.delenv(key, raising=False)  # the driver sets the first two; restored after the test
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray_params = params.train.ray.model_copy(update={"address": address})
    train = params.train.model_copy(update={"max_restarts": 3, "ray": ray_params})
    job = RankJob("stub_rank", [], 2, 1, False, None, params.model_copy(update={"train": train}), 5.0)
    lines, spans = [], {}
    assert engine.run_on_ray(job, log=lines.append, spans=spans) == USER_ERROR_EXIT
    assert "train: Ray Train restarted the ranks 1 time(s)" in lines  # one restart, not three
    assert spans["engine_placement"] > 0 and spans["engine_restarts"] > 0 and spans["engine_lost"] > 0
    assert (tmp_path / ".cache/ray").is_dir() and not (Path.home() / "ray_results").exists()
