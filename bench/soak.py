"""The soak: the project left running, as a team leaves it, with schedules, new data, edits and crashes.

    python bench/soak.py --runs 50 --embedded-default --out logs/soak   # 50 flow runs of the default pipeline
    python bench/soak.py --rounds 5 --fault-rate 0.6 --out logs/soak-ci  # the tiny project; or --duration 14400

What it starts (on 127.0.0.1 only, each stopped by its PID at the end): a `prefect server`, moto's S3 server as
the project's DVC remote, the project's own deployments (`prefect deploy --all` of prefect.yaml: nightly, whose
cron ``--cron`` accelerates, and on-new-data on its event) and a process worker (`make worker`). The project is a
tiny copy of this checkout (tests/conftest.py's copy_project: every stage in seconds), or with
``--embedded-default`` a copy with this checkout's own params.yaml (the embedded default: minutes a run), or
``--project``. promote.require_approval is on (a person answers every promotion, ``--approval-timeout`` to answer).

Each round draws, from one seeded schedule, an event and (at ``--fault-rate``) a fault:

- events: none (the nightly run), new data (rows appended to the training file, then `fineflow data add`: the
  on-new-data trigger starts the run; the first one moves data.train_path to a team-owned copy of the data
  stage's output, which `data add` refuses), a
  param edit (train.lr), a changed eval set (evaluate.limit), concurrent triggers (two nightly runs at once), a
  new base checkpoint at the same path (the base's weights replaced in place, as a team's base directory is
  updated; the first one moves model.base from the embedded base to that directory);
- the approver (a person): the round's first approval request is answered at once (approve or reject), late (near
  the timeout) or never (the run fails at promote.approval_timeout_h; the next run asks again);
- faults: SIGKILL of a random process of the run's tree (flow, dvc, stage, launcher, rank), SIGTERM to every
  process of the tree at once, SIGKILL of the worker or of the Prefect server (each started again), a DVC lock
  entry whose PID now names an unrelated process, a remote that refuses for a while (its endpoint pointed at a
  closed port for REFUSE_S), a disk that fills during a checkpoint write (tests/faults' injection, through the
  run's job variables).

After a fault the nightly deployment runs again until a run completes (``recovery_s``: from the fault to that
run's end). After every round the invariants (``check_invariants``): `fineflow registry verify` passes (it checks
the champion against the log entry that installed it); `dvc status` is clean; the promotion decision has its
reason and its evidence, and an answered approval its approver; the candidate's adapter is byte for byte the one
an uninterrupted train stage makes from the same inputs (one reference run per input state: the train stage's
deps and params in dvc.lock, trained in a scratch copy of the project); the goodput ledger adds up within 1%; no
process is left in the project; no flow run is left Running. A failed round's reports and journal are kept in
``evidence/``. The report: ``soak.json`` and ``soak.md`` in ``--out`` (runs, faults by kind, invariant failures,
the slowest recovery).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import (  # noqa: E402  (the project's own helpers, importable from the checkout)
    _git_commit,
    add_s3_remote,
    copy_project,
    free_port,
    prefect_server_on,
    s3_server_on,
    venv_env,
)
from tests.faults import fault_env  # noqa: E402

EVENTS = ("nightly", "new_data", "param_edit", "eval_change", "concurrent", "new_base")
# How the approver answers a round's first approval request, and how often (later requests: approved at once)
ANSWERS = {"prompt": 0.55, "reject": 0.15, "late": 0.2, "never": 0.1}
APPROVER = "soak"
LATE_SHARE = 0.6  # a late answer comes this far into promote.approval_timeout_h
FAULTS = (
    "sigkill_random",
    "sigterm_all",
    "sigkill_worker",
    "sigkill_server",
    "reused_pid_lock",
    "remote_refusing",
    "disk_full",
)
SERVER_DOWN_S = 5  # a SIGKILLed server is started again (same port, same database) after this
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
RUN_TIMEOUT_S = 1800  # the embedded default's first run builds everything: >10 min on a busy 2-core machine
REFUSE_S = 8  # the remote refuses this long: the pull task's retries (10 s apart) outlast it
MAX_RECOVERY_RUNS = 3


class Approver:
    """A person answering promotions (promote.require_approval) as the Prefect UI's Resume form does: each Paused
    run is answered as the round's draw says (its first request; any later one of the round is approved at once)."""

    def __init__(self, api: str, timeout_s: float):
        self.api, self.late_s = api, timeout_s * LATE_SHARE
        self.mode, self.answers, self.errors = "prompt", [], []
        self._plans: dict = {}  # paused run id -> (answer, first seen)
        self._drawn_this_round = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def new_round(self, mode: str) -> None:
        self.mode, self.answers, self.errors, self._drawn_this_round = mode, [], [], False

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _watch(self) -> None:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.api}):  # settings are per thread (context variables)
            while not self._stop.wait(1):
                try:
                    for run in paused_runs():
                        self._consider(run.id)
                except Exception as exc:  # the server is being started again: look again (kept for the report)
                    self.errors = [*self.errors[-4:], f"{type(exc).__name__}: {exc}"[:300]]

    def _consider(self, run_id) -> None:
        if run_id not in self._plans:
            self._plans[run_id] = ("prompt" if self._drawn_this_round else self.mode, time.monotonic())
            self._drawn_this_round = True
            if self._plans[run_id][0] == "never":
                self.answers.append({"run": str(run_id), "answer": "never"})
        answer, seen = self._plans[run_id]
        if answer == "never" or (answer == "late" and time.monotonic() - seen < self.late_s):
            return
        with client() as c:
            result = c.resume_flow_run(
                run_id, run_input={"approve": answer != "reject", "approver": APPROVER, "comment": f"soak: {answer}"}
            )
        status = getattr(result.status, "value", result.status)
        self.answers.append({"run": str(run_id), "answer": answer, "after_s": round(time.monotonic() - seen, 1)})
        self.answers[-1]["status"] = str(status)
        self._plans[run_id] = ("never", seen)  # answered: not again


@dataclass
class Soak:
    """What a soak runs against, and what it has seen."""

    project: Path
    api: str
    env: dict[str, str]
    rng: random.Random
    worker: subprocess.Popen | None = None
    worker_log: Path | None = None
    server_home: Path | None = None
    servers: contextlib.ExitStack | None = None  # the Prefect servers started (again, after a kill)
    evidence: Path | None = None  # where a failed round's reports are kept
    root: Path | None = None  # the stack's folder: the moved base, the reference runs' scratch copy
    approver: Approver | None = None
    references: dict[str, str] = field(default_factory=dict)  # train input state -> its uninterrupted adapter
    rounds: list[dict] = field(default_factory=list)


# --- the stack --------------------------------------------------------------------------------------------


def prefect(soak: Soak, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "prefect", *args], cwd=soak.project, env=soak.env, capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"prefect {' '.join(args)} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def accelerate_cron(project: Path, cron: str) -> None:
    """The copy's prefect.yaml with nightly's cron replaced (the soak's clock runs faster than a night)."""
    spec = yaml.safe_load((project / "prefect.yaml").read_text())
    for deployment in spec["deployments"]:
        for schedule in deployment.get("schedules") or []:
            schedule["cron"] = cron
    (project / "prefect.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def start_worker(soak: Soak, log: Path) -> None:
    soak.worker_log = log
    with log.open("a") as fh:
        soak.worker = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", "fineflow-process"],
            cwd=soak.project,
            env=soak.env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_worker(soak: Soak) -> None:
    """SIGTERM to the worker's group, then SIGKILL to whatever of its tree is left (a worker may sit on the first
    SIGTERM for >20 s)."""
    if soak.worker is None:
        return
    tree = [psutil.Process(soak.worker.pid), *run_tree(soak)] if soak.worker.poll() is None else []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(soak.worker.pid, signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=10)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    soak.worker.wait()


def new_project(dest: Path, embedded_default: bool) -> Path:
    """A copy of this checkout: tiny params (every stage in seconds), or its own params.yaml (the default)."""
    project = copy_project(dest)
    if embedded_default:
        shutil.copy2(ROOT / "params.yaml", project / "params.yaml")
        _git_commit(project, "the checkout's own params: the embedded default")
    return project


def require_approval(project: Path, timeout_s: float) -> None:
    """promote.require_approval on, its timeout in seconds (a person's edit, uncommitted)."""
    path = project / "params.yaml"
    params = yaml.safe_load(path.read_text())
    params["promote"].update(require_approval=True, approval_timeout_h=timeout_s / 3600)
    path.write_text(yaml.safe_dump(params, sort_keys=False))


@contextlib.contextmanager
def stack(root: Path, project: Path | None, cron: str | None, seed: int, approval_timeout_s: float, embedded=False):
    """The servers, the project (deployed, its remote on S3), the worker and the approver; stopped by PID on the
    way out."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "s3").mkdir(exist_ok=True)
    (root / "prefect").mkdir(exist_ok=True)
    with s3_server_on(root / "s3") as endpoint, contextlib.ExitStack() as servers:
        api = servers.enter_context(prefect_server_on(root / "prefect"))
        project = project or new_project(root / "project", embedded)
        add_s3_remote(project, endpoint, "soak")
        require_approval(project, approval_timeout_s)
        env = {**venv_env(), "PREFECT_API_URL": api, "PREFECT_HOME": str(root / "prefect-client")}
        env.pop("HF_HOME", None)  # the flow puts it in the project (apply_offline_environment)
        soak = Soak(project, api, env, random.Random(seed), server_home=root / "prefect", servers=servers, root=root)
        soak.evidence = root.parent / "evidence"
        if cron:
            accelerate_cron(project, cron)
        prefect(soak, "work-pool", "create", "fineflow-process", "--type", "process")
        prefect(soak, "--no-prompt", "deploy", "--all")
        # as `make deploy`: the server marks a run whose process died Crashed (flows/automations.py)
        automation = [sys.executable, "-m", "flows.automations"]
        subprocess.run(automation, cwd=project, env=env, check=True, capture_output=True)
        start_worker(soak, root / "worker.log")
        soak.approver = Approver(api, approval_timeout_s)
        try:
            yield soak
        finally:
            soak.approver.stop()
            stop_worker(soak)


# --- runs ------------------------------------------------------------------------------------------------


def client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def deployment_id(name: str):
    with client() as c:
        return c.read_deployment_by_name(f"fineflow/{name}").id


def start_nightly(env: dict[str, str] | None = None):
    """A run of the nightly deployment now (what its cron does), with extra environment for its process."""
    with client() as c:
        job = {"env": env} if env else None
        return c.create_flow_run_from_deployment(deployment_id("nightly"), job_variables=job).id


def flow_runs() -> list:
    with client() as c:
        return c.read_flow_runs(limit=200)


def paused_runs() -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType

    paused = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["PAUSED"])))
    with client() as c:
        return c.read_flow_runs(flow_run_filter=paused)


def wait_for_runs(run_ids: list, timeout_s: float = RUN_TIMEOUT_S) -> dict:
    """{id: final state type} once every run is final (or "TIMEOUT")."""
    deadline, states = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        try:
            dead = {run.id for run in left_running()}  # ended, though Prefect does not know it yet
            with client() as c:
                states = {run_id: c.read_flow_run(run_id).state_type.value for run_id in run_ids}
        except Exception:  # the server is being started again: ask again
            time.sleep(1)
            continue
        states = {run_id: "LEFT_RUNNING" if run_id in dead else state for run_id, state in states.items()}
        if all(state in (*FINAL, "LEFT_RUNNING") for state in states.values()):
            return states
        time.sleep(1)
    return {run_id: (state if state in FINAL else "TIMEOUT") for run_id, state in states.items()}


def wait_for_new_run(deployment: str, after: float, timeout_s: float = 120):
    """The first run of `deployment` created after `after` (epoch seconds): a trigger's."""
    wanted = deployment_id(deployment)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = [r for r in flow_runs() if r.deployment_id == wanted and r.created.timestamp() >= after]
        if runs:
            return runs[0].id
        time.sleep(1)
    raise RuntimeError(f"no {deployment} run within {timeout_s} s of the trigger")


def run_tree(soak: Soak) -> list:
    """The processes under the worker: the flow runs' trees."""
    with contextlib.suppress(psutil.Error):
        return psutil.Process(soak.worker.pid).children(recursive=True)
    return []


def wait_for_stage(soak: Soak, timeout_s: float = 300) -> list:
    """The run's tree once one of its stages runs (a `fineflow.stages.*` process), else what is there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tree = run_tree(soak)
        if any("fineflow.stages" in " ".join(_cmdline(p)) for p in tree):
            time.sleep(soak.rng.uniform(0.5, 3.0))  # somewhere into the stage
            return run_tree(soak)
        time.sleep(0.2)
    return run_tree(soak)


def _cmdline(process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return process.cmdline()
    return []


# --- events ----------------------------------------------------------------------------------------------


def edit_param(project: Path, key: str, values: tuple) -> str:
    """Set a dotted params.yaml key to the next of `values` (an uncommitted edit, as a person makes it)."""
    path = project / "params.yaml"
    params = yaml.safe_load(path.read_text())
    section, name = key.split(".")
    current = params[section].get(name)
    params[section][name] = values[(values.index(current) + 1) % len(values)] if current in values else values[0]
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return f"{key}={params[section][name]}"


TEAM_TRAIN = "data/incoming/train.jsonl"  # the training file a team appends to (the data stage's is its output)


def new_row(round_no: int, part: int) -> dict:
    return {"instruction": f"Repeat the code of soak round {round_no}, part {part}.", "output": f"r{round_no}p{part}"}


def add_data(soak: Soak, round_no: int) -> str:
    """New rows appended to the file training reads, then `fineflow data add` (dvc add + the event). The first
    time, data.train_path moves from the data stage's output to a copy of it the team owns."""
    rows = soak.project / TEAM_TRAIN
    path = soak.project / "params.yaml"
    params = yaml.safe_load(path.read_text())
    moved = params["data"]["train_path"] != TEAM_TRAIN
    if moved:
        rows.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(soak.project / params["data"]["train_path"], rows)
        params["data"]["train_path"] = TEAM_TRAIN
        path.write_text(yaml.safe_dump(params, sort_keys=False))
    new = [new_row(round_no, part) for part in range(4)]
    with rows.open("a") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in new)
    done = subprocess.run(
        [sys.executable, "-m", "fineflow.cli", "data", "add", TEAM_TRAIN],
        cwd=soak.project,
        env=soak.env,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"fineflow data add failed: {done.stdout}{done.stderr}")
    return f"{len(new)} rows appended to {TEAM_TRAIN}" + (" (data.train_path moved there)" if moved else "")


def new_base(soak: Soak, round_no: int) -> str:
    """A new base checkpoint at the same path: its weight files replaced in place by a seeded perturbation of
    them (same names, same sizes), as a team's base directory is updated. The first one moves model.base from
    the embedded base the base stage built to a copy of it in the stack's folder."""
    target = soak.root / "base"
    path = soak.project / "params.yaml"
    params = yaml.safe_load(path.read_text())
    moved = params["model"]["base"] != str(target)
    if moved:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(soak.project / "models/base", target)
        params["model"]["base"] = str(target)
        path.write_text(yaml.safe_dump(params, sort_keys=False))
    perturb_weights(target, seed=round_no)
    return f"model.base moved to {target}, new weights there" if moved else f"new weights at {target}"


def perturb_weights(model_dir: Path, seed: int, scale: float = 0.02) -> None:
    """Every float tensor of the safetensors files plus seeded noise (`scale` of its own spread), each file
    replaced atomically (written beside it, then renamed over it)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    for weights in sorted(model_dir.glob("*.safetensors")):
        with safe_open(weights, "pt") as fh:
            metadata = fh.metadata()
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and tensor.numel() > 1:
                noise = torch.randn(tensor.shape, generator=generator) * (scale * tensor.float().std())
                tensors[name] = (tensor.float() + noise).to(tensor.dtype)
        fresh = weights.with_name(weights.name + ".new")
        save_file(tensors, fresh, metadata=metadata)
        os.replace(fresh, weights)


def start_event(soak: Soak, event: str, round_no: int, env: dict[str, str] | None) -> tuple[list, str]:
    """Apply the event and start the run(s) it causes; (run ids, what was done)."""
    if event == "new_data":
        started = time.time() - 1
        detail = add_data(soak, round_no)
        return [wait_for_new_run("on-new-data", started)], detail
    detail = ""
    if event == "param_edit":
        detail = edit_param(soak.project, "train.lr", (0.003, 0.002))
    elif event == "eval_change":
        detail = edit_param(soak.project, "evaluate.limit", (6, 5))
    elif event == "new_base":
        detail = new_base(soak, round_no)
    runs = [start_nightly(env)]
    if event == "concurrent":
        runs.append(start_nightly(env))
    return runs, detail


# --- faults ----------------------------------------------------------------------------------------------


def reused_pid_lock(project: Path) -> subprocess.Popen:
    """A `write` entry in DVC's rwlock for the candidate, held by a live process that is no dvc (a reused PID)."""
    holder = subprocess.Popen(["sleep", "600"])
    lock = project / ".dvc/tmp/rwlock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    entry = {"pid": holder.pid, "cmd": "dvc repro --single-item train"}
    lock.write_text(json.dumps({"read": {}, "write": {str(project / "models/candidate"): entry}}))
    return holder


def refuse_remote_for(project: Path, env: dict[str, str], seconds: float) -> threading.Thread:
    """The remote's endpoint pointed at a closed port (connections refused) for `seconds`, then restored."""
    config = project / ".dvc/config.local"
    original = config.read_text()
    closed = f"http://127.0.0.1:{free_port()}"
    subprocess.run(
        [sys.executable, "-m", "dvc", "remote", "modify", "--local", "store", "endpointurl", closed],
        cwd=project,
        env=env,
        check=True,
        capture_output=True,
    )

    def restore():
        time.sleep(seconds)
        config.write_text(original)

    thread = threading.Thread(target=restore, daemon=True)
    thread.start()
    return thread


def signal_tree(soak: Soak, fault: str) -> str:
    """SIGKILL one random process of the run's tree, or SIGTERM every one at once; what was hit."""
    tree = wait_for_stage(soak)
    if not tree:
        return "no run process to hit"
    if fault == "sigterm_all":
        for process in tree:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGTERM)
        return f"SIGTERM to {len(tree)} processes"
    victim = soak.rng.choice(tree)
    name = " ".join(_cmdline(victim))[:120]
    with contextlib.suppress(psutil.Error):
        victim.kill()
    return f"SIGKILL {name}"


def kill_worker(soak: Soak) -> str:
    """SIGKILL the worker while a stage of its run runs, then start a new one (what a supervisor like systemd
    does): the run's own process goes on and ends, reported to the server as usual."""
    wait_for_stage(soak)
    soak.worker.kill()
    soak.worker.wait()
    start_worker(soak, soak.worker_log)
    return f"SIGKILL worker {soak.worker.pid}"


def kill_server(soak: Soak) -> str:
    """SIGKILL the Prefect server while a stage runs, and start it again SERVER_DOWN_S later on the same port
    over the same database: the run's client retries through the gap, or its run is left Running with its
    process gone, for the next run to mark Crashed."""
    wait_for_stage(soak)
    port = int(soak.api.rsplit(":", 1)[1].split("/")[0])
    [server] = [p for p in psutil.process_iter(["cmdline"]) if _is_server(p.info["cmdline"] or [], port)]
    os.killpg(server.pid, signal.SIGKILL)
    time.sleep(SERVER_DOWN_S)
    soak.servers.enter_context(prefect_server_on(soak.server_home, port))
    return f"SIGKILL server {server.pid}, up again after {SERVER_DOWN_S} s"


def _is_server(cmdline: list[str], port: int) -> bool:
    return "prefect" in cmdline and "server" in cmdline and "start" in cmdline and str(port) in cmdline


# --- invariants ------------------------------------------------------------------------------------------


def _cli(soak: Soak, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *argv], cwd=soak.project, env=soak.env, capture_output=True, text=True, timeout=300
    )


def check_invariants(soak: Soak, own_pids: set[int]) -> list[str]:
    """What is wrong after a round (empty: nothing). See the module docstring."""
    failures = []
    verify = _cli(soak, "fineflow.cli", "registry", "verify")
    if verify.returncode:
        failures.append(f"registry verify exit {verify.returncode}: {(verify.stdout + verify.stderr)[-300:]}")
    status = dvc_status_failures(soak)
    failures += status or reference_failures(soak)  # the lock names the candidate's inputs only when clean
    failures += decision_failures(soak.project) + ledger_failures(soak.project)
    failures += [f"orphan process: {line}" for line in orphans(soak, own_pids)]
    failures += [f"flow run left Running by a process that is gone: {run.name}" for run in left_running()]
    return failures


def left_running() -> list:
    """Runs in Running whose process (tasks.runs' process tag) is gone: nothing will ever end them."""
    from tasks.runs import PROCESS_TAG, process_gone

    runs = [r for r in flow_runs() if r.state_type.value == "RUNNING"]
    return [r for r in runs if any(t.startswith(PROCESS_TAG) and process_gone(t) for t in r.tags)]


def wait_idle(timeout_s: float = RUN_TIMEOUT_S) -> None:
    """Until no run is active but those left Running by a dead process (a cron run may have started)."""
    deadline = time.monotonic() + timeout_s
    time.sleep(2)
    while time.monotonic() < deadline:
        active = {r.id for r in flow_runs() if r.state_type.value in ("RUNNING", "PENDING")}
        if active <= {r.id for r in left_running()}:
            return
        time.sleep(1)


def dvc_status_failures(soak: Soak) -> list[str]:
    """`dvc status` clean but for the stages dvc.yaml marks always_changed (fingerprint, goodput)."""
    status = _cli(soak, "dvc", "status", "--json")
    try:
        changed = {stage: why for stage, why in json.loads(status.stdout or "{}").items() if why != ["always changed"]}
    except json.JSONDecodeError:
        return [f"dvc status failed: {(status.stdout + status.stderr)[-300:]}"]
    return [f"dvc status not clean: {changed}"] if changed or status.returncode else []


def read_report(project: Path, name: str) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((project / "reports" / name).read_text())
    return None


def decision_failures(project: Path) -> list[str]:
    report = read_report(project, "promote.json")
    if report is None:
        return ["no promotion decision: reports/promote.json is missing or unreadable"]
    missing = [key for key in ("decision", "reason", "p_value", "delta", "lineage") if report.get(key) in (None, "")]
    if not missing and not (project / report["lineage"]).is_file():
        missing.append(f"lineage file {report['lineage']}")
    approval = (report.get("context") or {}).get("approval") or report.get("approval")
    if approval is not None and approval.get("approver") != APPROVER:
        missing.append(f"its approver (recorded: {approval!r})")
    return [f"promotion decision without {', '.join(missing)}"] if missing else []


def train_inputs(project: Path) -> str:
    """The train stage's input state as dvc.lock records it (its deps' hashes and its params), as one digest."""
    stage = yaml.safe_load((project / "dvc.lock").read_text())["stages"]["train"]
    state = json.dumps({"deps": stage["deps"], "params": stage["params"]}, sort_keys=True)
    return hashlib.sha256(state.encode()).hexdigest()[:16]


def adapter_digest(candidate: Path) -> str:
    """The trained adapter, byte for byte: its weight files and its config."""
    digest = hashlib.sha256()
    for path in sorted(candidate.rglob("*")):
        if path.is_file() and (path.suffix in (".safetensors", ".bin") or path.name == "adapter_config.json"):
            digest.update(str(path.relative_to(candidate)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def reference_failures(soak: Soak) -> list[str]:
    """The candidate must be what an uninterrupted train stage makes from the same inputs (exact resume, and no
    result reused from other inputs): one reference run per input state, in a scratch copy of the project."""
    state = train_inputs(soak.project)
    if state not in soak.references:
        try:
            soak.references[state] = reference_adapter(soak)
        except RuntimeError as exc:
            return [str(exc)]
    found, wanted = adapter_digest(soak.project / "models/candidate"), soak.references[state]
    return [] if found == wanted else [f"candidate adapter {found} is not the reference {wanted} of inputs {state}"]


def reference_adapter(soak: Soak) -> str:
    """`dvc repro --force --single-item train` in a scratch copy of the project (no checkpoints, no DVC cache or
    locks, no fault), the digest of the adapter it makes."""
    scratch = soak.root / "reference"
    shutil.rmtree(scratch, ignore_errors=True)
    skip = {str(soak.project): ["checkpoints", "logs"], str(soak.project / ".dvc"): ["cache", "tmp"]}
    shutil.copytree(soak.project, scratch, symlinks=True, ignore=lambda d, names: skip.get(d, []))
    done = subprocess.run(
        [sys.executable, "-m", "dvc", "repro", "--force", "--single-item", "train"],
        cwd=scratch,
        env=soak.env,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"the reference train run failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return adapter_digest(scratch / "models/candidate")


def ledger_failures(project: Path) -> list[str]:
    share = (read_report(project, "goodput.json") or {}).get("unaccounted_share")
    return [] if share is not None and abs(share) <= 0.01 else [f"goodput ledger off by {share!r} of the run"]


def orphans(soak: Soak, own_pids: set[int]) -> list[str]:
    """Processes working in the project that are neither the worker nor this script's own helpers."""
    worker = soak.worker.pid if soak.worker else None
    found = []
    for process in psutil.process_iter(["pid", "cwd", "cmdline", "status"]):
        info = process.info
        if info["pid"] in own_pids | {worker, os.getpid()} or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if (info["cwd"] or "").startswith(str(soak.project)):
            found.append(f"{info['pid']} {' '.join(info['cmdline'] or [])[:120]}")
    return found


# --- a round ---------------------------------------------------------------------------------------------


def draw(soak: Soak, fault_rate: float) -> tuple[str, str | None, str]:
    """(event, fault, the approver's answer) of a round."""
    event = soak.rng.choice(EVENTS)
    fault = soak.rng.choice(FAULTS) if soak.rng.random() < fault_rate else None
    if fault == "disk_full":
        event = "param_edit"  # the disk fills during a checkpoint write: the round must train (an eval change does not)
    answer = soak.rng.choices(list(ANSWERS), weights=list(ANSWERS.values()))[0]
    return event, fault, answer


def checkpoint_interval(project: Path) -> int:
    return yaml.safe_load((project / "params.yaml").read_text())["checkpoint"]["every_steps"]


def one_round(soak: Soak, round_no: int, fault_rate: float, planned: tuple | None = None) -> dict:
    """Draw (or take the planned (event, fault[, answer])), apply, run, fault, recover, check: the round's record."""
    wait_idle()  # a cron run that started between rounds ends before the event changes its inputs
    event, fault, answer = (*planned, "prompt")[:3] if planned else draw(soak, fault_rate)
    record = {"round": round_no, "event": event, "fault": fault, "answer": answer, "started": time.time()}
    soak.approver.new_round(answer)
    worker_gone = soak.worker.poll()  # exited on its own (a killed one is started again at once): its code
    if worker_gone is not None:
        start_worker(soak, soak.worker_log)
    helpers, env = [], None
    if fault == "reused_pid_lock":
        helpers.append(reused_pid_lock(soak.project))
    elif fault == "remote_refusing":
        refuse_remote_for(soak.project, soak.env, REFUSE_S)
    elif fault == "disk_full":
        env = fault_env({}, disk_full_at_step=checkpoint_interval(soak.project))  # the first save fills the disk
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (env["PYTHONPATH"], soak.env.get("PYTHONPATH"))))
    runs, record["detail"] = start_event(soak, event, round_no, env)
    if fault in ("sigkill_random", "sigterm_all"):
        record["hit"] = signal_tree(soak, fault)
    elif fault == "sigkill_worker":
        record["hit"] = kill_worker(soak)
    elif fault == "sigkill_server":
        record["hit"] = kill_server(soak)
    faulted_at = time.time()
    record["states"] = list(wait_for_runs(runs).values())
    record["recovery_runs"] = 0
    while "COMPLETED" not in record["states"][-1:] and record["recovery_runs"] < MAX_RECOVERY_RUNS:
        record["recovery_runs"] += 1
        record["states"].append(_recover())
    if fault:
        record["recovery_s"] = round(time.time() - faulted_at, 1)
    wait_idle()  # a killed run's last processes and its worker's report; a cron run that started meanwhile
    record["approvals"] = list(soak.approver.answers)
    if soak.approver.errors:
        record["approver_errors"] = list(soak.approver.errors)
    checked = time.monotonic()
    try:
        record["invariant_failures"] = check_invariants(soak, {h.pid for h in helpers})
    except Exception as exc:  # a harness left for hours reports what broke and goes on
        record["invariant_failures"] = [f"checking the invariants failed: {type(exc).__name__}: {exc}"]
    record["check_s"] = round(time.monotonic() - checked, 1)  # a new input state's reference run is most of it
    record["reference_states"] = len(soak.references)
    if record["invariant_failures"]:
        keep_evidence(soak, round_no)
    if worker_gone is not None:
        record["invariant_failures"].append(f"the worker had exited by itself (code {worker_gone}): restarted")
    for helper in helpers:
        helper.kill()
        helper.wait()
    record["s"] = round(time.time() - record["started"], 1)
    return record


def keep_evidence(soak: Soak, round_no: int) -> None:
    """A failed round's reports (the ledger, the decision, the stage reports), before the next run rewrites them."""
    target = soak.evidence / f"round-{round_no}"
    target.mkdir(parents=True, exist_ok=True)
    for report in (soak.project / "reports").glob("*.json"):
        shutil.copy2(report, target / report.name)
    journal = soak.project / "reports/ledger"  # every stage process's lines: what the ledger was built from
    if journal.is_dir():
        shutil.copytree(journal, target / "ledger", dirs_exist_ok=True)


def _recover() -> str:
    run = start_nightly()
    return wait_for_runs([run])[run]


# --- the report ------------------------------------------------------------------------------------------


def summary(rounds: list[dict], wall_s: float) -> dict:
    faults: dict[str, int] = {}
    for r in rounds:
        if r["fault"]:
            faults[r["fault"]] = faults.get(r["fault"], 0) + 1
    recoveries = [r for r in rounds if "recovery_s" in r]
    slowest = max(recoveries, key=lambda r: r["recovery_s"], default=None)
    return {
        "rounds": len(rounds),
        "runs": sum(len(r["states"]) for r in rounds),
        "completed_runs": sum(s == "COMPLETED" for r in rounds for s in r["states"]),
        "events": {e: sum(r["event"] == e for r in rounds) for e in EVENTS},
        "faults": faults,
        "approvals": {a: sum(x["answer"] == a for r in rounds for x in r.get("approvals", [])) for a in ANSWERS},
        "invariant_failures": [f"round {r['round']}: {f}" for r in rounds for f in r["invariant_failures"]],
        "slowest_recovery": {k: slowest[k] for k in ("round", "fault", "recovery_s")} if slowest else None,
        "wall_s": round(wall_s, 1),
    }


def write_report(out: Path, rounds: list[dict], wall_s: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    result = {"summary": summary(rounds, wall_s), "rounds": rounds}
    (out / "soak.json").write_text(json.dumps(result, indent=2, default=str))
    s = result["summary"]
    lines = [
        "# Soak report",
        "",
        f"{s['rounds']} rounds, {s['runs']} runs ({s['completed_runs']} completed) in {s['wall_s']:.0f} s",
        f"faults: {', '.join(f'{k} {v}' for k, v in s['faults'].items()) or 'none'}",
        f"events: {', '.join(f'{k} {v}' for k, v in s['events'].items())}",
        f"approval requests answered: {', '.join(f'{k} {v}' for k, v in s['approvals'].items())}",
        f"invariant failures: {len(s['invariant_failures'])}",
        f"slowest recovery: {s['slowest_recovery']}",
        "",
        "| round | event | fault | approvals | run states | recovery s | failures |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rounds:
        answers = " ".join(a["answer"] for a in r.get("approvals", []))
        lines.append(
            f"| {r['round']} | {r['event']} | {r['fault'] or ''} | {answers} | {' '.join(r['states'])} | "
            f"{r.get('recovery_s', '')} | {'; '.join(r['invariant_failures']).replace(chr(10), ' ')} |"
        )
    lines += [f"- {failure}" for failure in s["invariant_failures"]]
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    return result


def soak(
    out: Path,
    rounds_wanted: int | None = None,
    duration_s: float | None = None,
    seed: int = 1,
    fault_rate: float = 0.5,
    project=None,
    cron=None,
    plan: list[tuple] = (),
    runs_wanted: int | None = None,
    embedded_default: bool = False,
    approval_timeout_s: float = 60,
) -> dict:
    """Run rounds until `rounds_wanted` rounds, `runs_wanted` flow runs or `duration_s` seconds (the first rounds
    as `plan` says: (event, fault[, answer])); the report (also written to out)."""
    started = time.monotonic()
    rounds: list[dict] = []

    def more() -> bool:
        runs = sum(len(r["states"]) for r in rounds)
        return (
            (rounds_wanted is None or len(rounds) < rounds_wanted)
            and (runs_wanted is None or runs < runs_wanted)
            and (duration_s is None or time.monotonic() - started < duration_s)
        )

    with stack(out / "stack", project, cron, seed, approval_timeout_s, embedded_default) as state:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: state.api}):
            while more():
                planned = plan[len(rounds)] if len(rounds) < len(plan) else None
                rounds.append(one_round(state, len(rounds) + 1, fault_rate, planned))
                write_report(out, rounds, time.monotonic() - started)  # a report at every round: kill it any time
    return write_report(out, rounds, time.monotonic() - started)


def stop_on_signal(signum, frame):
    """SIGTERM or Ctrl-C: unwind (the worker, the servers and the approver are stopped on the way out)."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, stop_on_signal)
    signal.signal(signal.SIGINT, stop_on_signal)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, help="stop after this many flow runs (a faulted round makes several)")
    parser.add_argument("--rounds", type=int, help="stop after this many rounds")
    parser.add_argument("--duration", type=float, help="seconds to run")
    parser.add_argument("--embedded-default", action="store_true", help="the checkout's own params, not tiny ones")
    parser.add_argument("--approval-timeout", type=float, default=60, help="promote.approval_timeout_h, in seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fault-rate", type=float, default=0.5, help="share of rounds with a fault")
    parser.add_argument("--cron", default="*/10 * * * *", help="nightly's accelerated cron ('' keeps prefect.yaml's)")
    parser.add_argument("--out", type=Path, default=ROOT / "logs/soak")
    args = parser.parse_args(argv)
    if args.runs is None and args.rounds is None and args.duration is None:
        parser.error("give --runs, --rounds or --duration")
    result = soak(
        args.out,
        args.rounds,
        args.duration,
        args.seed,
        args.fault_rate,
        cron=args.cron or None,
        runs_wanted=args.runs,
        embedded_default=args.embedded_default,
        approval_timeout_s=args.approval_timeout,
    )
    print((args.out / "soak.md").read_text())
    return 1 if result["summary"]["invariant_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
