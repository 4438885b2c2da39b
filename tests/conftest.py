"""Shared fixtures. The offline/telemetry environment is set before anything imports prefect or HF."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from fineflow.core.dvc_project import stage_command

ROOT = Path(__file__).resolve().parent.parent
# pytest imports this file as `conftest`, and the tests import it again as `tests.conftest` (tests/ is no
# package): without this alias the second import would make a second state folder and repoint the environment
# below at it. One module, one state folder, removed when pytest exits (pytest_unconfigure).
sys.modules.setdefault("tests.conftest", sys.modules[__name__])
_STATE = Path(tempfile.mkdtemp(prefix="fineflow-tests-"))
os.environ.update(
    {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(_STATE / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DVC_NO_ANALYTICS": "1",
        "PREFECT_HOME": str(_STATE / "prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "TOKENIZERS_PARALLELISM": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
)
# The processes the tests start cache the bytecode they compile (the Makefile says why: ~7 CPU-s per start).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


# The files whose tests take longest (their --durations summed per file, both CI tiers), longest first: pytest-xdist
# hands a worker a whole file at a time in collection order (--dist loadfile), so these start first and neither
# worker is left alone with a long file at the end of a tier.
LONGEST_FILES = (
    "test_flow.py",
    "test_interrupts.py",
    "test_goodput.py",
    "test_resume.py",
    "test_preference_train.py",
    "test_base_resume.py",
    "test_rerun.py",
    "test_runs.py",
    "test_fsdp.py",
    "test_ddp.py",
    "test_ray.py",
    "test_dvc_views.py",
    "test_preference_eval.py",
    "test_sources.py",
    "test_families.py",
    "test_conversations.py",
    "test_accumulation.py",
    "test_data_gate.py",
    "test_launch.py",
)


def pytest_collection_modifyitems(config, items):
    """The longest files first (LONGEST_FILES); within a file, and for every other file, the collected order."""
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_unconfigure(config):
    """The state folder (HF and Prefect homes) goes when pytest exits: after every fixture's teardown, so
    after the processes a test started (the Prefect server included) have been stopped."""
    shutil.rmtree(_STATE, ignore_errors=True)


# The train stage exactly as dvc.yaml runs it (paths relative to a project copy), on this interpreter.
TRAIN = stage_command("train", ROOT, python=sys.executable)

# Overrides that shrink the repo's params.yaml until every stage runs in seconds on 2 cores.
TINY_OVERRIDES = {
    "seed": 7,
    "model": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 2,
        "num_heads": 2,
        "vocab_size": 400,
        "max_position_embeddings": 256,
    },
    "base": {"corpus_docs": 600, "steps": 4, "batch_size": 4, "seq_len": 64, "warmup_steps": 1},
    "data": {"n_train": 160, "n_eval": 16},
    "tokenize": {"seq_len": 128},
    "checkpoint": {"every_steps": 2},
    "train": {"steps": 4, "micro_batch_size": 2, "warmup_steps": 1, "log_every": 1, "lora": {"r": 4, "alpha": 8}},
    "evaluate": {"batch_size": 8, "max_gen_toks": 8, "limit": 6},
    "promote": {"min_delta": 0.0},
    # the same in every environment (llama.cpp's tools are in the dev venv, not CI's): the export tests ask for it
    "export": {"enabled": False},
}


def _merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


TINY_PARAMS = _merge(yaml.safe_load((ROOT / "params.yaml").read_text()), TINY_OVERRIDES)


def write_params(path: Path, overrides: dict | None = None) -> Path:
    """The tiny params, plus dotted-key overrides ("train.lr": 1e-3), written as a params.yaml."""
    params = yaml.safe_load(yaml.safe_dump(TINY_PARAMS))
    for dotted, value in (overrides or {}).items():
        node = params
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture
def tiny_params():
    from fineflow.core.config import parse_params

    return parse_params(yaml.safe_load(yaml.safe_dump(TINY_PARAMS)))


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """The first four stages run once on the tiny config: base model, raw data, validated rows, shards."""
    from fineflow.core.config import parse_params
    from fineflow.core.reports import write_json_atomic
    from fineflow.stages import base, data, tokenize, validate

    root = tmp_path_factory.mktemp("built")
    params = parse_params(TINY_PARAMS)
    base.run(params, root / "models/base")
    data.run(params, root / "data/raw/train.jsonl", root / "data/raw/eval.jsonl")
    report = validate.run(
        params,
        root / "data/raw/train.jsonl",
        root / "data/raw/eval.jsonl",
        root / "data/validated",
        root / "reports/validate.json",
        root / "reports/data_docs",
        root / "models/base",
    )
    write_json_atomic(root / "reports/validate.json", report)
    tokenize.run(params, root / "data/validated", root / "models/base", root / "data/shards")
    before = _snapshot(root)
    yield root
    # shared by every test in any order: a test writes into a folder of its own (tmp_path), never into this one
    after = _snapshot(root)
    changed = sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))
    assert not changed, f"tests changed the shared `built` folder (write into tmp_path instead): {changed}"


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its size and modification time: what a write changes."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def copy_project(dest: Path, overrides: dict | None = None) -> Path:
    """A fresh git+DVC checkout of this project's tracked files at dest, with tiny params."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for rel in files:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    write_params(dest / "params.yaml", overrides)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    _git_commit(dest, "fixture")
    return dest


def _git_commit(project: Path, message: str) -> None:
    git = ["git", "-c", "user.name=fineflow-test", "-c", "user.email=test@localhost"]
    subprocess.run(git + ["add", "-A"], cwd=project, check=True)
    subprocess.run(git + ["commit", "-qm", message], cwd=project, check=True)


REPRO_LOG = "repro.log"


@pytest.fixture(scope="session")
def reproduced(tmp_path_factory, worker_id):
    """A project copy (copy_project, tiny params) after a plain `dvc repro` of the whole pipeline, its dvc.lock
    and metrics committed: what a finished run leaves (DVC's output is in REPRO_LOG beside it). Built once per
    test run, for the scenarios that start from a finished run; a test works in its own copy (copy_reproduced).
    pytest-xdist's workers share it: the first to ask builds it under a file lock, the others wait for it (a
    whole `dvc repro`, ~65 CPU-s, not paid again by each worker)."""
    import filelock

    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent  # xdist: the workers' basetemps share this parent
    home, project = shared / "reproduced", shared / "reproduced" / "project"
    with filelock.FileLock(str(shared / "reproduced.lock")):
        if not (home / "built").is_file():
            shutil.rmtree(home, ignore_errors=True)  # a build another worker left half done when it failed
            home.mkdir()
            copy_project(project)
            done = subprocess.run(
                [sys.executable, "-m", "dvc", "repro"], cwd=project, env=venv_env(), capture_output=True, text=True
            )
            assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
            (home / REPRO_LOG).write_text(done.stdout)  # what DVC ran, beside the project
            _git_commit(project, "baseline: dvc.lock and metrics")
            (home / "built").write_text("")
    before = _snapshot(project)
    yield project
    assert _snapshot(project) == before, "a test changed the shared `reproduced` project (work in a copy)"


def copy_reproduced(reproduced: Path, dest: Path, overrides: dict | None = None) -> Path:
    """The finished project copied to dest (git history, DVC cache and lock, outputs, reports), without the train
    stage's scratch (checkpoints/: a copy trains in its own); with overrides, the tiny params plus those,
    committed: the next `dvc repro` re-runs what they change."""
    top = str(reproduced)
    shutil.copytree(reproduced, dest, symlinks=True, ignore=lambda d, names: ["checkpoints"] if d == top else [])
    if overrides:
        write_params(dest / "params.yaml", overrides)
        _git_commit(dest, f"params: {overrides}")
    return dest


def random_adapter(
    base_dir: Path, out: Path, seed: int, std: float = 0.2, targets=("q_proj", "v_proj", "down_proj")
) -> Path:
    """A LoRA adapter on base_dir with random lora_B (so it changes the model), saved like train's: a stand-in
    for a trained candidate where only the registry, the evaluation or the flow around it is under test."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, std)
    model.save_pretrained(out)
    return out


EVAL_SHA = "e" * 64


def score_entry(right: int, n: int = 40, cid: str | None = None) -> dict:
    """A model's evaluation as eval/scores.json holds it: `right` of n exact matches, per sample."""
    samples = [{"doc_id": i, "target": "t", "prediction": "p", "exact_match": float(i < right)} for i in range(n)]
    out = {
        "status": "ok",
        "metrics": {"fineflow_synth": {"exact_match": right / n}},
        "samples": {"fineflow_synth": samples},
    }
    return {**out, "id": cid} if cid else out


def write_scores(path, candidate: int, base: int, champion: tuple[int, str] | None = None):
    """eval/scores.json written by hand (no lm-eval run): the candidate's and the base's exact matches of 40."""
    scores = {
        "tasks": ["fineflow_synth"],
        "eval_rows": "data/validated/eval.jsonl",
        "eval_data_sha256": EVAL_SHA,
        "base": score_entry(base),
        "candidate": score_entry(candidate),
    }
    if champion:
        scores["champion"] = score_entry(champion[0], cid=champion[1])
    path.write_text(json.dumps(scores))
    return path


def gate_only_project(built: Path, path: Path, overrides: dict | None = None) -> Path:
    """A copy of the project whose dvc.yaml keeps the promote stage alone (and its metrics), with its inputs in
    place: the tiny base, the shards, the validated rows, and a candidate (a random adapter) evaluated at 30/40
    exact matches against the base's 5/40. The gate's outcomes in seconds, without training or lm-eval."""
    project = copy_project(path, overrides)
    pipeline = yaml.safe_load((project / "dvc.yaml").read_text(encoding="utf-8"))
    pipeline["stages"] = {"promote": pipeline["stages"]["promote"]}
    pipeline["metrics"] = ["reports/metrics/promote.json"]
    pipeline.pop("plots", None)
    (project / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False), encoding="utf-8")
    (project / "dvc.lock").unlink(missing_ok=True)  # the whole pipeline's
    shutil.rmtree(project / "reports", ignore_errors=True)
    shutil.copytree(built / "models/base", project / "models/base")
    shutil.copytree(built / "data/shards", project / "data/shards")
    shutil.copytree(built / "data/validated", project / "data/validated")  # promote's lineage reads its sources
    (project / "models/base_fingerprint.json").write_text("{}\n")
    (project / "eval").mkdir()
    write_scores(project / "eval/scores.json", 30, 5)
    random_adapter(built / "models/base", project / "models/candidate", seed=1)
    return project


def venv_env() -> dict[str, str]:
    """Environment for subprocesses: this interpreter's bin first on PATH (dvc.yaml calls `python`)."""
    return {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]}


# A test's own rendezvous port (accelerate/torchrun's TCPStore on 127.0.0.1) comes from 20000-29999: below
# Linux's ephemeral range (ip_local_port_range, 32768-60999 by default), from which the kernel hands out every
# bind to port 0 and the source port of every outgoing connection (the gloo connections between ranks, of this
# run or a parallel one, take dozens). A released port in that range can go to one of those before torchrun
# binds it; one below it is taken only by a process that asks for that very number. 29500 is torch's default,
# which leftover runs hold.
PORTS = [port for port in range(20000, 30000) if port != 29500]
# What accelerate/torch print when the rendezvous port was taken between free_port() and the launch.
PORT_TAKEN = ("address already in use", "eaddrinuse", "failed to listen", "another process is utilizing it")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a test's own rendezvous; never another address). Something
    may still take it before the launch binds it: launches that pass it use launch_with_free_port."""
    # SystemRandom: a test that seeds `random` must not make parallel test runs draw the same ports
    for port in random.SystemRandom().sample(PORTS, 100):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port among 100 tried in {PORTS[0]}-{PORTS[-1]}")


def launch_with_free_port(launch, attempts: int = 3) -> tuple[bool, str]:
    """launch(port) -> (succeeded, output), retried with a fresh free port, up to attempts times in all, only
    while it fails because the port was taken (the race free_port leaves open). Returns the last result."""
    for _ in range(attempts):
        ok, output = launch(free_port())
        if ok or not any(sign in output.lower() for sign in PORT_TAKEN):
            break
    return ok, output


def run_together(commands: list[tuple[list[str], dict[str, str]]], cwd: Path, logs: list[Path], timeout: float):
    """Start every (argv, extra env) at once, each in its own process group writing to its log, and return
    their exit codes. As soon as one fails (or on timeout) the others are killed: a rank whose peer is gone
    would otherwise wait for it until its rendezvous times out."""
    procs = []
    try:
        for (argv, env), log in zip(commands, logs):
            with log.open("w") as fh:
                procs.append(
                    subprocess.Popen(
                        argv,
                        cwd=cwd,
                        env={**venv_env(), **env},
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [proc.poll() for proc in procs]
            if None not in codes or any(codes):  # all done, or one failed
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks torchrun started under it
                proc.wait()
    return [proc.returncode for proc in procs]


def expected_lrs(params: dict) -> list[float]:
    """The schedule per optimizer step as fineflow.train.schedule defines it, for any world size."""
    from fineflow.train.schedule import lr_multiplier

    train = params["train"]
    # the logged lr is the one the next step will use: after step s the scheduler has stepped s times
    return [
        train["lr"] * lr_multiplier(s, train["warmup_steps"], train["steps"], train["schedule"])
        for s in range(1, train["steps"] + 1)
    ]


# The train stage's own test run: long enough for evaluation, checkpoints every 2 steps and a resume in the
# middle, short enough to take seconds. The DDP, loopback and resume tests all train it; each world size's
# uninterrupted run is trained once per session (reference_run) and compared against by all of them.
TRAIN_OVERRIDES = {
    "train.steps": 12,
    "train.eval_every": 4,
    "train.tracker": "none",
    "train.warmup_steps": 2,
    "checkpoint.every_steps": 2,
    "checkpoint.keep_last": 2,
}


def ranks_overrides(ranks: int) -> dict:
    """The same global batch (4 rows a step) on any world size: micro-batch 4 // ranks per rank."""
    return {"train.num_processes": ranks, "train.micro_batch_size": 4 // ranks}


def train_project(built: Path, path: Path, overrides: dict | None = None) -> Path:
    """A project with the built shards and base model and TRAIN_OVERRIDES (plus overrides) as its params."""
    shutil.copytree(built / "data/shards", path / "data/shards")
    shutil.copytree(built / "models/base", path / "models/base")
    write_params(path / "params.yaml", {**TRAIN_OVERRIDES, **(overrides or {})})
    return path


def train_env(ranks: int) -> dict[str, str]:
    """The train stage's environment: one rank runs directly (no launcher in between), more under accelerate
    launch. The resume tests compare bit for bit, so their runs and the reference are started alike."""
    env = venv_env()
    if ranks == 1:
        env["FINEFLOW_TRAIN_WORKER"] = "1"
    return env


def run_dirs(checkpoints: Path) -> list[Path]:
    """The run directories under a checkpoints root (one per training configuration), without the root's own
    files (the base weights' hash cache)."""
    return sorted(p for p in checkpoints.iterdir() if p.is_dir())


def start_train(project: Path, ranks: int, env: dict[str, str], port: int | None = None, extra=()):
    """The train stage as dvc.yaml runs it, in its own process group (so a test can SIGKILL all of it)."""
    args = list(extra)
    if ranks > 1:  # the rendezvous port: the callers pass a free one and retry if it was taken meanwhile
        args += ["--main-process-port", str(port)]
    return subprocess.Popen(
        TRAIN + args,
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def kill_when(start, project: Path, condition, timeout: float = 240) -> bool:
    """start(port) -> a Popen in its own process group; SIGKILL that whole group as soon as condition(project)
    holds. Returns whether the kill landed (False: the run finished first, successfully)."""
    killed = False

    def launch(port):
        nonlocal killed
        proc = start(port)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if condition(project):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                killed = True
                return True, ""
            time.sleep(0.002)
        output = proc.communicate()[0]
        return proc.returncode == 0, output

    ok, output = launch_with_free_port(launch)
    assert ok, output[-3000:]
    return killed


def last_logged_step(project: Path) -> int:
    """The last step in the project's step log (0 before the first)."""
    try:
        lines = (project / "reports/train_steps.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def checkpoint_being_saved(project: Path) -> bool:
    return any(project.glob("checkpoints/*/.tmp-*"))  # shards being staged, or the checkpoint being written


def finish_train(project: Path, ranks: int, env: dict[str, str] | None = None) -> str:
    """Run the train stage to its end (asserting it succeeded); returns its output."""

    def launch(port):
        proc = start_train(project, ranks, env or train_env(ranks), port=port)
        output = proc.communicate(timeout=600)[0]
        return proc.returncode == 0, output

    ok, output = launch_with_free_port(launch)
    assert ok, output[-4000:]
    return output


@pytest.fixture(scope="session")
def reference_run(built, tmp_path_factory):
    """reference_run(ranks) -> the project of one uninterrupted train-stage run at that world size (same global
    batch at every size), trained on first use and shared by the session's tests, which only read it."""
    runs: dict[int, tuple[Path, dict]] = {}

    def get(ranks: int) -> Path:
        if ranks not in runs:
            project = train_project(built, tmp_path_factory.mktemp(f"reference-{ranks}"), ranks_overrides(ranks))
            finish_train(project, ranks)
            runs[ranks] = project, _snapshot(project)
        return runs[ranks][0]

    yield get
    for ranks, (project, before) in runs.items():
        assert _snapshot(project) == before, f"a test changed the shared {ranks}-process reference run"


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """A Prefect server on 127.0.0.1 for the flows the test starts (PREFECT_API_URL), stopped by its PID."""
    with prefect_server_on(tmp_path_factory.mktemp("prefect-server")) as url:
        yield url


@contextlib.contextmanager
def prefect_server_on(home: Path, port: int | None = None):
    """`prefect server start` on 127.0.0.1:port (a free one by default) over the database in PREFECT_HOME=home;
    its API URL; stopped by PID."""
    port = port or free_port()
    env = {**venv_env(), "PREFECT_HOME": str(home), "PREFECT_UI_ENABLED": "false"}
    argv = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with (home / "server.log").open("a") as log:
        server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        _wait_healthy(server, url, home / "server.log")
        yield url
    finally:
        stop_by_pid(server)


def stop_by_pid(server: subprocess.Popen) -> None:
    """SIGTERM to a server the test started (its own process group), SIGKILL if it is still there after 20 s
    (a server already killed, as the soak kills one: nothing to do)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def _wait_healthy(server: subprocess.Popen, url: str, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the Prefect server exited: {log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    pytest.fail(f"the Prefect server was not healthy after {timeout} s: {log.read_text()[-3000:]}")


S3_BUCKET = "fineflow"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """An S3 API server on 127.0.0.1 (moto's, as DVC's own S3 plugin tests use), with the bucket S3_BUCKET;
    its endpoint URL. Started as a process of its own, once per session, and stopped by its PID; each test uses
    a prefix of its own in the bucket."""
    with s3_server_on(tmp_path_factory.mktemp("s3-server")) as endpoint:
        yield endpoint


@contextlib.contextmanager
def s3_server_on(home: Path, port: int | None = None):
    """moto's S3 server on 127.0.0.1:port (a free one by default) with the bucket S3_BUCKET; its endpoint URL;
    stopped by its PID. A server started again on the same port serves an empty store (moto keeps it in memory)."""
    port = port or free_port()
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with (home / "server.log").open("a") as log:
        server = subprocess.Popen(argv, env=venv_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, f"the S3 server exited: {(home / 'server.log').read_text()[-3000:]}"
            try:  # CreateBucket is a PUT of /<bucket>; moto checks no signature
                request = urllib.request.Request(f"{endpoint}/{S3_BUCKET}", method="PUT")
                with urllib.request.urlopen(request, timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"no S3 server at {endpoint}: {(home / 'server.log').read_text()[-3000:]}")
                time.sleep(0.3)
        yield endpoint
    finally:
        stop_by_pid(server)


def add_s3_remote(project: Path, endpoint: str, prefix: str) -> None:
    """The project's default DVC remote: s3://S3_BUCKET/<prefix> on the test's S3 server, as a user configures
    MinIO or Ceph (endpointurl; the keys in the untracked .dvc/config.local)."""
    for args in (
        ["remote", "add", "-d", "store", f"s3://{S3_BUCKET}/{prefix}"],
        ["remote", "modify", "store", "endpointurl", endpoint],
        ["remote", "modify", "store", "region", "us-east-1"],
        ["remote", "modify", "--local", "store", "access_key_id", "testing"],
        ["remote", "modify", "--local", "store", "secret_access_key", "testing"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "dvc", *args], cwd=project, env=venv_env(), capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
