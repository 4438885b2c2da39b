"""fineflow.train.launch: the accelerate command lines (fast), the shipped profiles as accelerate itself reads them
(fast), and real launches on loopback that must form ONE process group (seconds).

    .venv/bin/python -m pytest tests/test_launch.py -q
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fineflow.errors import FineflowError
from fineflow.train.launch import WORKER_ENV, accelerate_command
from fineflow.train.profile import PROFILE_DIR, load_profile, profile_names, read_profile, resolve_profile
from tests.conftest import PORTS, ROOT, launch_with_free_port, run_together

LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]
SHIPPED = {
    "cpu_ddp_2proc",
    "single_gpu",
    "multi_gpu_ddp",
    "fsdp_lora",
    "deepspeed_zero2",
    "deepspeed_zero3",
    "multi_node",
}


# --- profile names -------------------------------------------------------------------------------------


def test_every_profile_is_shipped_and_resolves():
    assert set(profile_names()) == SHIPPED
    assert resolve_profile("auto") is None
    for name in SHIPPED:
        assert resolve_profile(name) == PROFILE_DIR / f"{name}.yaml"


@pytest.mark.parametrize(
    ("name", "engine", "sharding", "mixed_precision", "processes"),
    [
        ("auto", "ddp", "none", None, 1),
        ("cpu_ddp_2proc", "ddp", "none", "no", 2),
        ("single_gpu", "ddp", "none", "bf16", 1),
        ("multi_gpu_ddp", "ddp", "none", "bf16", 8),
        ("fsdp_lora", "fsdp", "fsdp", "bf16", 8),
        ("deepspeed_zero2", "deepspeed", "zero2", "bf16", 8),
        ("deepspeed_zero3", "deepspeed", "zero3", "bf16", 8),
        ("multi_node", "ddp", "none", "bf16", 16),
    ],
)
def test_a_profile_is_read_once_into_what_every_decision_takes(name, engine, sharding, mixed_precision, processes):
    """load_profile decides the engine (who holds the training state), the sharding (the planner's and the dtype
    rules' one vocabulary), the profile's precision and its ranks; the value is frozen."""
    import dataclasses

    profile = load_profile(name)
    assert (profile.engine, profile.sharding, profile.mixed_precision, profile.processes) == (
        engine,
        sharding,
        mixed_precision,
        processes,
    )
    assert profile.path == resolve_profile(name) and profile.deepspeed == (engine == "deepspeed")
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.sharding = "zero3"


def test_profile_by_path_and_unknown_name(tmp_path):
    custom = tmp_path / "mine.yaml"
    custom.write_text("distributed_type: MULTI_GPU\n")
    assert resolve_profile(str(custom)) == custom
    with pytest.raises(FineflowError, match="unknown.*fsdp_lora"):
        resolve_profile("fsdp")
    with pytest.raises(FineflowError, match="no such file"):
        resolve_profile(str(tmp_path / "missing.yaml"))


def test_each_profile_opens_with_the_command_that_uses_it():
    for name in SHIPPED:
        text = (PROFILE_DIR / f"{name}.yaml").read_text()
        header = text.split("\ncompute_environment:")[0]
        assert text.startswith("#") and "accelerate launch --config_file configs/accelerate/" + name in header


# --- flags, no profile (the train stage's behaviour since the walking skeleton) ----------------------


def test_auto_flags_unchanged():
    base = LAUNCH + ["--num_machines", "1"]
    tail = ["--dynamo_backend", "no", "--mixed_precision", "no"]
    argv, env = accelerate_command(2, False, "m", ["--x"], main_process_port=1234)
    assert argv == base + [
        "--num_processes",
        "2",
        *tail,
        "--multi_gpu",
        "--main_process_port",
        "1234",
        "-m",
        "m",
        "--x",
    ]
    assert env == {WORKER_ENV: "1", "ACCELERATE_USE_CPU": "1"}
    argv, env = accelerate_command(1, False, "m", [])
    assert argv == base + ["--num_processes", "1", *tail, "--cpu", "-m", "m"] and env == {WORKER_ENV: "1"}
    argv, env = accelerate_command(4, True, "m", [])
    assert "--multi_gpu" in argv and "--cpu" not in argv and env == {WORKER_ENV: "1"}


def test_multi_node_flags():
    argv, _ = accelerate_command(4, True, "m", [], 29500, num_machines=2, machine_rank=1, main_process_ip="10.0.0.1")
    joined = " ".join(argv)
    assert "--num_machines 2 --num_processes 4" in joined and "--multi_gpu" in argv
    assert "--machine_rank 1 --main_process_ip 10.0.0.1 --main_process_port 29500" in joined
    with pytest.raises(FineflowError, match="main_process_ip"):
        accelerate_command(4, True, "m", [], num_machines=2, machine_rank=0)
    with pytest.raises(FineflowError, match="machine_rank"):
        accelerate_command(4, True, "m", [], num_machines=2, main_process_ip="10.0.0.1")
    with pytest.raises(FineflowError, match="multiple of num_machines"):
        accelerate_command(3, True, "m", [], num_machines=2, machine_rank=0, main_process_ip="10.0.0.1")


# --- profiles ------------------------------------------------------------------------------------------


def test_profile_decides_and_is_not_overridden():
    argv, env = accelerate_command(None, False, "m", ["--x"], profile=load_profile("cpu_ddp_2proc"))
    assert argv == LAUNCH + ["--config_file", str(PROFILE_DIR / "cpu_ddp_2proc.yaml"), "-m", "m", "--x"]
    assert env == {WORKER_ENV: "1", "ACCELERATE_USE_CPU": "1"}
    # agreeing values are fine and still not passed as flags
    argv, _ = accelerate_command(2, False, "m", [], profile=load_profile("cpu_ddp_2proc"), num_machines=1)
    assert "--num_processes" not in argv and "--num_machines" not in argv
    with pytest.raises(FineflowError, match="num_processes: 2 but 4"):
        accelerate_command(4, False, "m", [], profile=load_profile("cpu_ddp_2proc"))
    argv, env = accelerate_command(None, True, "m", [], profile=load_profile("fsdp_lora"))
    assert not {"--multi_gpu", "--cpu", "--mixed_precision", "--num_processes"} & set(argv)
    assert env == {WORKER_ENV: "1"}


def test_gpu_profile_refused_without_gpu_and_multi_cpu_refused(tmp_path):
    with pytest.raises(FineflowError, match="no GPU"):
        accelerate_command(None, False, "m", [], profile=load_profile("multi_gpu_ddp"))
    multi_cpu = tmp_path / "multi_cpu.yaml"
    multi_cpu.write_text("distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\n")
    with pytest.raises(FineflowError, match="ONE process"):
        accelerate_command(None, False, "m", [], profile=load_profile(str(multi_cpu)))
    no_type = tmp_path / "bad.yaml"
    no_type.write_text("distributed_type: NO\n")  # unquoted NO is a YAML boolean
    with pytest.raises(FineflowError, match="quote 'NO'"):
        read_profile(no_type)


def _shipped_params(**train):
    """The shipped params.yaml with some train keys changed (a user's edit of that file)."""
    from fineflow.core.config import load_params

    params = load_params(ROOT / "params.yaml")
    return params.model_copy(update={"train": params.train.model_copy(update=train)})


def test_picking_a_multi_gpu_profile_is_enough():
    """Issue 30 item 4: with the shipped params, train.accelerate_profile alone picks the ranks (on main the default
    num_processes 1 contradicted every multi-GPU profile's 8 or 16 and the launch was refused)."""
    from fineflow.train.launch import with_profile_processes

    cfg = _shipped_params(accelerate_profile="multi_gpu_ddp").train
    argv, _ = accelerate_command(cfg.num_processes, True, "m", [], profile=load_profile("multi_gpu_ddp"))
    assert argv == LAUNCH + ["--config_file", str(PROFILE_DIR / "multi_gpu_ddp.yaml"), "-m", "m"]
    for name, ranks in (("multi_gpu_ddp", 8), ("fsdp_lora", 8), ("multi_node", 16), ("auto", 1)):
        params = _shipped_params(accelerate_profile=name)
        profile = load_profile(name)
        cfg = with_profile_processes(params, profile).train
        assert cfg.num_processes == ranks, name
    # the default "auto" profile still runs one process, the CPU flags as before
    cfg = _shipped_params().train
    argv, _ = accelerate_command(cfg.num_processes, False, "m", [], profile=load_profile(cfg.accelerate_profile))
    assert argv[argv.index("--num_processes") + 1] == "1" and "--cpu" in argv


def test_a_num_processes_you_set_that_contradicts_the_profile_is_still_refused():
    from fineflow.train.launch import with_profile_processes

    params = _shipped_params(accelerate_profile="multi_gpu_ddp", num_processes=4)
    assert with_profile_processes(params, load_profile("multi_gpu_ddp")).train.num_processes == 4
    with pytest.raises(FineflowError, match="num_processes: 8 but 4"):
        accelerate_command(4, True, "m", [], profile=load_profile("multi_gpu_ddp"))


@pytest.mark.parametrize("cuda", [None, "12.8"])
def test_a_gpu_profile_without_a_visible_gpu_stops_before_the_planner(cuda, monkeypatch):
    """Issue 30 item 6: a GPU profile on a machine where torch sees no GPU stops in the launcher, before the
    planner and before any rank, naming the profile, what was found (a CPU build of torch, or a CUDA build
    that sees no device) and what to do. On main the planner ran first and the message said neither."""
    import torch

    from fineflow.train import procedure

    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_planner(*args, **kwargs):
        raise AssertionError("the planner ran before the GPU check")

    monkeypatch.setattr(procedure, "fit_plan", no_planner)
    monkeypatch.setattr(procedure, "run_ranks", no_planner)
    params = _shipped_params(accelerate_profile="single_gpu")
    placement = {"base_dir": "models/base", "machine_rank": None, "main_process_ip": None, "main_process_port": None}
    with pytest.raises(FineflowError) as raised:
        procedure.launch_ranks(params, "m", [], placement, log=lambda line: None)
    message = str(raised.value)
    assert "single_gpu" in message and "no GPU" in message
    found = "CPU-only build" if cuda is None else "built for CUDA 12.8"
    assert found in message and "train.accelerate_profile" in message


def test_more_ranks_than_visible_gpus_is_said_before_launching():
    """multi_gpu_ddp's 8 ranks on a machine where torch sees 4 GPUs: refused with the fix, not 4 ranks failing on
    an invalid device ordinal; 8 GPUs (or more) pass, and multi_node's 16 ranks are 8 per machine."""
    from fineflow.train.launch import require_enough_gpus, with_profile_processes

    for name, visible, enough in (("multi_gpu_ddp", 4, False), ("multi_gpu_ddp", 8, True), ("multi_node", 8, True)):
        profile = load_profile(name)
        cfg = with_profile_processes(_shipped_params(accelerate_profile=name), profile).train
        if enough:
            require_enough_gpus(profile, cfg, visible)
        else:
            with pytest.raises(FineflowError, match="starts 8 ranks on this machine and torch sees 4 GPU"):
                require_enough_gpus(profile, cfg, visible)


def test_cpu_profiles_need_no_gpu(monkeypatch):
    import torch

    from fineflow.train.launch import require_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("auto", "cpu_ddp_2proc"):
        require_gpu(load_profile(name), has_gpu=False)
    with pytest.raises(FineflowError, match="multi_gpu_ddp"):
        require_gpu(load_profile("multi_gpu_ddp"), has_gpu=False)


def test_multi_node_profile_needs_placement_per_launch():
    profile = load_profile("multi_node")
    with pytest.raises(FineflowError, match="machine_rank.*main_process_ip"):
        accelerate_command(None, True, "m", [], profile=profile)
    argv, _ = accelerate_command(
        None, True, "m", [], 29501, profile=profile, machine_rank=1, main_process_ip="10.0.0.1"
    )
    assert " ".join(argv).endswith("--machine_rank 1 --main_process_ip 10.0.0.1 --main_process_port 29501 -m m")


# accelerate's own reading of each file (its private validator: the same code `accelerate launch` runs)
EXPECTED = {
    "cpu_ddp_2proc": dict(multi_gpu=True, use_cpu=True, num_processes=2, num_machines=1, mixed_precision="no"),
    "single_gpu": dict(
        multi_gpu=False,
        use_fsdp=False,
        use_deepspeed=False,
        use_cpu=False,
        num_processes=1,
        mixed_precision="bf16",
        gpu_ids="0",
    ),
    "multi_gpu_ddp": dict(multi_gpu=True, use_cpu=False, num_processes=8, mixed_precision="bf16"),
    "fsdp_lora": dict(
        use_fsdp=True,
        num_processes=8,
        mixed_precision="bf16",
        fsdp_version=2,
        fsdp_auto_wrap_policy="TRANSFORMER_BASED_WRAP",
        fsdp_transformer_layer_cls_to_wrap=None,  # the loaded model's decoder layer (fineflow.train.fsdp)
        fsdp_reshard_after_forward=True,
        fsdp_state_dict_type="FULL_STATE_DICT",
    ),
    "deepspeed_zero2": dict(use_deepspeed=True, zero_stage=2, num_processes=8, mixed_precision="bf16"),
    "deepspeed_zero3": dict(use_deepspeed=True, zero_stage=3, zero3_init_flag=True, num_processes=8),
    "multi_node": dict(
        multi_gpu=True,
        num_machines=2,
        num_processes=16,
        machine_rank=1,
        main_process_ip="10.9.8.7",
        main_process_port=29500,
    ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_accelerate_reads_each_profile_as_intended(name):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    extra = ["--machine_rank", "1", "--main_process_ip", "10.9.8.7"] if name == "multi_node" else []
    args = launch_command_parser().parse_args(["--config_file", str(PROFILE_DIR / f"{name}.yaml"), *extra, "-m", "m"])
    args, _, _ = _validate_launch_command(args)
    got = {key: getattr(args, key, None) for key in EXPECTED[name]}
    assert got == EXPECTED[name]


def test_fsdp_profile_reaches_the_ranks_environment():
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(PROFILE_DIR / "fsdp_lora.yaml"), "-m", "m"])
    args, _, _ = _validate_launch_command(args)
    args.main_process_port = 0  # prepare_multi_gpu_env probes the port; 0 = any free one
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert "FSDP_TRANSFORMER_CLS_TO_WRAP" not in env and env["FSDP_RESHARD_AFTER_FORWARD"] == "true"
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"


# --- real launches on loopback -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cpu_ddp_2proc profile", "2 machines x 1 process"])
def test_real_launch_forms_one_group(layout, tmp_path):
    """Every rank sees world size 2 and the all-reduced sum 1+2; rank 0 alone writes probe.json."""
    profile = layout == "cpu_ddp_2proc profile"
    outs = [tmp_path / "out"] if profile else [tmp_path / f"machine{rank}" for rank in (0, 1)]
    logs = [tmp_path / f"launch{i}.log" for i in range(len(outs))]

    def commands(port):
        if profile:  # the profile's own port, 0: accelerate picks a free one (the same race, retried alike)
            return [
                accelerate_command(
                    None, False, "tests.dist_probe", [str(outs[0])], profile=load_profile("cpu_ddp_2proc")
                )
            ]
        return [
            accelerate_command(
                2,
                False,
                "tests.dist_probe",
                [str(out)],
                port,
                num_machines=2,
                machine_rank=rank,
                main_process_ip="127.0.0.1",
            )
            for rank, out in enumerate(outs)
        ]

    def launch(port):
        codes = run_together(commands(port), ROOT, logs, timeout=240)
        return codes == [0] * len(logs), "".join(log.read_text() for log in logs)

    ok, text = launch_with_free_port(launch)
    assert ok, text[-4000:]
    for rank in (0, 1):
        assert f"probe rank={rank} world=2 sum=3 backend=gloo" in text, text[-4000:]
    written = sorted(p for out in outs for p in out.rglob("*") if p.is_file())
    assert written == [outs[0] / "probe.json"]
    record = json.loads(written[0].read_text())
    assert record["world_size"] == 2 and record["rank"] == 0


# --- the rendezvous port: free when picked, maybe taken by the time torchrun binds it ----------------------

TAKEN = (
    "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
    "port: 20001, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
)


def test_a_launch_is_retried_on_a_fresh_port_only_when_its_port_was_taken():
    tried = []

    def launch(port, outcomes):
        tried.append(port)
        return outcomes[len(tried) - 1]

    assert launch_with_free_port(lambda port: launch(port, [(False, TAKEN), (True, "ok")])) == (True, "ok")
    assert len(tried) == 2 and all(port in PORTS for port in tried)
    tried.clear()
    assert launch_with_free_port(lambda port: launch(port, [(False, TAKEN)] * 3)) == (False, TAKEN)
    assert len(tried) == 3  # then it gives up and the test shows the output
    tried.clear()
    assert launch_with_free_port(lambda port: launch(port, [(False, "ValueError: no")])) == (False, "ValueError: no")
    assert len(tried) == 1  # any other failure is the test's to report, not retried


@pytest.mark.slow
def test_a_port_taken_before_the_launch_binds_it_is_retried(tmp_path, monkeypatch):
    """The race forced: the first port handed out is held by another socket (bound, not listening, so
    accelerate's own check passes it), torch's store fails to bind it, and the launch reruns on a fresh port."""
    import tests.conftest as conftest

    real_free_port = conftest.free_port
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", real_free_port()))
        held = holder.getsockname()[1]
        handed_out = iter([held])  # the held port first, then fresh ones
        monkeypatch.setattr(conftest, "free_port", lambda: next(handed_out, None) or real_free_port())
        tried, log = [], tmp_path / "launch.log"

        def launch(port):
            tried.append(port)
            command = accelerate_command(2, False, "tests.dist_probe", [str(tmp_path / "out")], port)
            return run_together([command], ROOT, [log], timeout=240) == [0], log.read_text()

        ok, text = launch_with_free_port(launch)
    assert ok and len(tried) == 2 and tried[0] == held, text[-4000:]


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is not None, reason="mlflow is installed here")
def test_a_tracker_whose_package_is_missing_stops_the_launch_with_one_message(built, tmp_path):
    """`train.tracker: mlflow` without mlflow installed stops the train stage's launcher before any rank starts,
    with a user error naming the param and the install (accelerate alone would skip a tracker it cannot import
    and train untracked)."""
    from tests.conftest import train_project, venv_env

    project = train_project(built, tmp_path, {"train.tracker": "mlflow"})
    argv = ["--shards", "data/shards", "--base-dir", "models/base", "--checkpoints", "checkpoints"]
    argv += ["--out", "models/candidate", "--steps-log", "reports/train_steps.jsonl"]
    env = {k: v for k, v in venv_env().items() if k != "FINEFLOW_TRAIN_WORKER"}
    done = subprocess.run(
        [sys.executable, "-m", "fineflow.stages.train", *argv], cwd=project, env=env, capture_output=True, text=True
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "train.tracker is 'mlflow' but the mlflow package is not installed (pip install '.[mlflow]')" in done.stderr
    assert "launching:" not in done.stdout and not (project / "models/candidate").exists()


def test_a_finished_rank_runs_its_exit_handlers_then_exits_without_the_interpreters_teardown(tmp_path):
    """A rank that succeeded ends with exit_without_teardown: its other threads are joined, atexit handlers
    (logging, multiprocessing) run, objects are not finalized (tearing down what gloo and DeepSpeed leave behind
    can abort a finished ZeRO-2 rank: SIGABRT, "terminate called without an active exception"). A failed rank
    exits as usual, so a checkpoint writer thread still finishing a save is waited for."""
    script = """
import atexit, pathlib, sys, threading, time
from fineflow.stages.train import exit_without_teardown

out = pathlib.Path(sys.argv[1])

class Finalized:
    def __del__(self):
        (out / "finalized").write_text("teardown ran")

def slow_save():
    time.sleep(1.0)
    (out / "saved").write_text("published")

left_behind = Finalized()
atexit.register(lambda: (out / "atexit").write_text("handlers ran"))
threading.Thread(target=slow_save).start()  # like the async checkpoint writer: not a daemon
print("report written", flush=False)
raise SystemExit(exit_without_teardown(int(sys.argv[2])))
"""
    for code in (0, 3):
        out = tmp_path / str(code)
        out.mkdir()
        done = subprocess.run([sys.executable, "-c", script, str(out), str(code)], capture_output=True, text=True)
        assert done.returncode == code, done.stderr
        assert done.stdout == "report written\n"  # buffered output is flushed
        assert (out / "atexit").read_text() == "handlers ran"
        assert (out / "saved").read_text() == "published"  # the save in flight was waited for
        # after a success the teardown is skipped; a failure exits as usual, finalizers and all
        assert (out / "finalized").exists() == (code != 0)


def test_the_gpu_packages_have_an_install_that_works():
    """Issue 30 item 6: bitsandbytes (QLoRA) is a pinned extra, and flash-attn's install is the one that builds
    (against the venv's torch, without build isolation); on main neither was in an extra and the README said
    `pip install flash-attn`, which fails at build time. The torch line says which build comes from where."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = [req for reqs in project["optional-dependencies"].values() for req in reqs]
    assert any(re.fullmatch(r"bitsandbytes==[0-9.]+", req) for req in extras), extras
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # the README moved into docs/
    readme = "\n".join(path.read_text(encoding="utf-8") for path in docs)
    flash_installs = re.findall(r"pip install flash-attn[^`]*", readme)
    assert flash_installs and all("--no-build-isolation" in line for line in flash_installs), flash_installs
    assert "(CPU build)" not in readme and "download.pytorch.org/whl/cpu" in readme


def test_an_unplaced_multi_machine_local_launch_says_what_to_do():
    """train.num_machines 2 with the default local launcher and dvc.yaml's command (no placement) is refused
    with the fix, not only "machine_rank must be given ... main_process_ip must be given"."""
    stage_args = ["--shards", "data/shards", "--checkpoints", "checkpoints", "--main-process-port", "29511"]
    with pytest.raises(FineflowError) as refused:
        accelerate_command(4, False, "fineflow.stages.train", stage_args, num_machines=2)
    message = str(refused.value)
    assert "machine_rank must be given" in message and "main_process_ip" in message
    assert "train.launcher: ray or slurm" in message
    # the exact per-machine command: the stage's own arguments, its placement replaced by this machine's
    assert (
        "`python -m fineflow.stages.train --shards data/shards --checkpoints checkpoints --machine-rank <N> "
        "--main-process-ip <machine 0's address> --main-process-port 29500`" in message
    )
    assert "N = 0..1" in message and "checkpoint.store" in message and "dvc commit --force train" in message
    # a profile that spans machines gives the same advice
    with pytest.raises(FineflowError, match="train.launcher: ray or slurm"):
        accelerate_command(None, True, "fineflow.stages.train", stage_args, profile=load_profile("multi_node"))


# --- where a multi-machine run's checkpoints live (fineflow.train.launch.require_shared_checkpoints) --------------
MOUNTINFO = """\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
40 22 0:38 / /mnt/shared rw,relatime shared:20 - nfs4 fs1:/export rw,vers=4.2
41 22 0:39 / /scratch rw,relatime shared:21 - xfs /dev/sdb1 rw
42 41 0:40 / /scratch/lustre rw shared:22 - lustre 10.0.0.1@o2ib:/fs rw
43 22 0:41 / /mnt/juice\\040fs rw shared:23 - fuse.juicefs JuiceFS:vol rw
44 22 0:42 / /dev/shm rw shared:24 - tmpfs tmpfs rw
"""


@pytest.fixture
def mountinfo(tmp_path):
    path = tmp_path / "mountinfo"
    path.write_text(MOUNTINFO)
    return path


def test_the_filesystem_of_a_path_is_its_longest_mount(mountinfo):
    from fineflow.train.launch import filesystem_of

    assert filesystem_of("/home/me/project/checkpoints", mountinfo) == ("/", "ext4")
    assert filesystem_of("/mnt/shared/ckpt/not-yet-made", mountinfo) == ("/mnt/shared", "nfs4")
    assert filesystem_of("/scratch/run", mountinfo) == ("/scratch", "xfs")
    assert filesystem_of("/scratch/lustre/run", mountinfo) == ("/scratch/lustre", "lustre")
    assert filesystem_of("/mnt/juice fs/ckpt", mountinfo) == ("/mnt/juice fs", "fuse.juicefs")
    assert filesystem_of("/x", mountinfo.with_name("absent")) is None  # no mountinfo (not Linux): no verdict


def test_a_multi_machine_run_on_node_local_checkpoints_is_refused_naming_the_fixes(mountinfo):
    from fineflow.core.train_config import CheckpointSettings
    from fineflow.train.launch import require_shared_checkpoints

    plain = CheckpointSettings()
    with pytest.raises(FineflowError) as refused:
        require_shared_checkpoints(Path("/scratch/ckpt"), 2, plain, sharded=False, mountinfo=mountinfo)
    message = str(refused.value)
    for said in (
        "/scratch/ckpt",
        "xfs filesystem",
        "mounted at /scratch",
        "checkpoint.store",
        "checkpoint.shared: true",
    ):
        assert said in message, message
    with pytest.raises(FineflowError, match="ext4 filesystem"):
        require_shared_checkpoints(Path("/home/me/checkpoints"), 4, plain, sharded=False, mountinfo=mountinfo)
    with pytest.raises(FineflowError, match="tmpfs"):
        require_shared_checkpoints(Path("/dev/shm/c"), 2, plain, sharded=False, mountinfo=mountinfo)
    # accepted: one machine; a shared filesystem (nfs4, lustre, fuse.*); a store; the escape hatch
    require_shared_checkpoints(Path("/home/me/checkpoints"), 1, plain, sharded=True, mountinfo=mountinfo)
    for shared in ("/mnt/shared/c", "/scratch/lustre/c", "/mnt/juice fs/c"):
        require_shared_checkpoints(Path(shared), 2, plain, sharded=True, mountinfo=mountinfo)
    stored = CheckpointSettings(store="s3://bucket/ckpt")
    require_shared_checkpoints(Path("/scratch/c"), 2, stored, sharded=False, mountinfo=mountinfo)
    require_shared_checkpoints(
        Path("/scratch/c"), 2, CheckpointSettings(shared=True), sharded=True, mountinfo=mountinfo
    )
    # a sharded engine writes every rank's shards into the directory: a store does not replace sharing it
    with pytest.raises(FineflowError, match=r"sharded engine .*checkpoint.store \(s3://bucket/ckpt\)"):
        require_shared_checkpoints(Path("/scratch/c"), 2, stored, sharded=True, mountinfo=mountinfo)


@pytest.mark.slow
def test_the_stage_refuses_node_local_checkpoints_before_any_rank_starts(built, tmp_path):
    from fineflow.train.launch import filesystem_of, is_shared_filesystem
    from tests.conftest import TRAIN, train_project, venv_env

    project = train_project(built, tmp_path / "p", {"train.num_machines": 2, "train.num_processes": 2})
    found = filesystem_of(project / "checkpoints")
    if found is None or is_shared_filesystem(found[1]):
        pytest.skip(f"this machine's temporary directory is not on a local filesystem ({found})")
    done = subprocess.run(TRAIN, cwd=project, env=venv_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"on a {found[1]} filesystem" in done.stderr and "checkpoint.store" in done.stderr
    assert "launching" not in done.stdout and not (project / "checkpoints").exists()  # no rank, no planner


# --- a training launched by hand, outside `dvc repro` (fineflow.stages.train.record_manual_run) ----------------
def _dvc(project: Path, *args: str) -> subprocess.CompletedProcess:
    from tests.conftest import venv_env

    return subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=project, env=venv_env(), capture_output=True, text=True, timeout=300
    )


def _train_stage_project(built, path: Path) -> Path:
    """A tiny git+DVC project whose dvc.yaml has the repo's train stage (its command and outputs; only the data
    and params as dependencies, the code being this checkout's)."""
    import yaml

    from tests.conftest import train_project

    project = train_project(built, path, {"train.steps": 2, "train.eval_every": 2})
    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]
    stage["deps"] = ["data/shards", "models/base"]
    stage["params"] = ["train"]
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": stage}}, sort_keys=False))
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    assert _dvc(project, "init", "-q").returncode == 0
    return project


@pytest.mark.slow
def test_a_training_launched_by_hand_records_itself_in_dvc_lock(built, tmp_path):
    """The stage run by hand (the per-machine commands) must not leave dvc.lock stale, or the next `dvc repro`
    trains again: machine 0's launcher, not started by DVC, runs `dvc commit --force train` on success."""
    from tests.conftest import TRAIN, venv_env

    project = _train_stage_project(built, tmp_path / "p")
    done = subprocess.run(TRAIN, cwd=project, env=venv_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "the run is recorded in dvc.lock (dvc commit --force train)" in done.stdout
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    assert lock["stages"]["train"]["outs"][0]["path"] == "models/candidate"
    status = _dvc(project, "status", "--json")
    assert status.returncode == 0 and json.loads(status.stdout) == {}, status.stdout + status.stderr
    again = _dvc(project, "repro")  # the pipeline is up to date: DVC does not train again
    assert again.returncode == 0 and "Stage 'train' didn't change, skipping" in again.stdout, again.stdout


def test_a_failed_record_of_a_manual_launch_names_the_command(tmp_path, capsys):
    """Where `dvc commit` fails (here: a dvc.yaml outside any DVC repository), the launcher says so and gives the
    exact command; a launch that is not dvc.yaml's train stage (another --out, no dvc.yaml) records nothing."""
    import yaml

    from fineflow.stages.train import record_manual_run

    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": stage}}))
    assert not record_manual_run(Path("models/candidate"), tmp_path)
    said = capsys.readouterr().out
    assert "recording the run in dvc.lock failed" in said and f"run `dvc commit --force train` in {tmp_path}" in said
    assert not record_manual_run(Path("elsewhere"), tmp_path) and not capsys.readouterr().out
    assert not record_manual_run(Path("models/candidate"), tmp_path / "absent") and not capsys.readouterr().out
