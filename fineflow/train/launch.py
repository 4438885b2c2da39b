"""Building the ``accelerate launch`` command line for the train stage.

The train stage's DVC command is a plain ``python -m fineflow.stages.train``; that process reads
``train.num_processes`` from params.yaml and re-executes itself under ``accelerate launch`` with the flags
that really give N processes. (On CPU, ``accelerate launch --cpu --num_processes 2`` silently runs one
process; ``ACCELERATE_USE_CPU=1`` with ``--multi_gpu`` runs N ranks of DDP over gloo.)

Hardware can instead come from an accelerate config file, a *profile* under ``configs/accelerate/``
(``fineflow.train.profile``, loaded once by the launcher). The profile then decides the distributed type, the number of
processes, mixed precision and the engine settings; this module adds only what places one launch in a
cluster (``--machine_rank``, ``--main_process_ip``, ``--main_process_port``), which the file can only hold
as placeholders, and refuses a caller's ``num_processes`` / ``num_machines`` that contradict the file rather
than silently overriding it (accelerate lets a command-line flag win over the file). train.num_processes unset
takes the profile's (``with_profile_processes``). A GPU profile where torch sees no GPU is refused in the
launcher, before the planner, saying why torch sees none (``require_gpu``).

DeepSpeed profiles (the last section): a missing deepspeed package is refused before anything loads
(``require_engine``), and the DeepSpeed batch settings come from params, checked against the profile by the
launcher and written into each rank's config before ``accelerator.prepare`` (``configure_deepspeed``).

    python -c "from fineflow.train.launch import accelerate_command; \
        from fineflow.train.profile import load_profile; \
        print(accelerate_command(None, False, 'tests.dist_probe', ['/tmp/p'], \
                                 profile=load_profile('cpu_ddp_2proc')))"
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from fineflow.core.runtime import TRAIN_WORKER_ENV
from fineflow.errors import FineflowError
from fineflow.train.profile import AUTO, Profile, load_profile, resolve_processes

if TYPE_CHECKING:
    from fineflow.core.config import Params
    from fineflow.core.train_config import TrainParams

WORKER_ENV = TRAIN_WORKER_ENV  # set for the ranks: they train instead of launching again
# distributed types that need one accelerator per rank; on a machine without one, accelerate would start
# N independent world-size-1 jobs (MULTI_GPU) or fail deep inside FSDP/DeepSpeed
_GPU_TYPES = {"MULTI_GPU", "FSDP", "DEEPSPEED", "MEGATRON_LM"}


def _placement_flags(machine_rank: int | None, main_process_ip: str | None, main_process_port: int | None) -> list[str]:
    flags: list[str] = []
    if machine_rank is not None:
        flags += ["--machine_rank", str(machine_rank)]
    if main_process_ip is not None:
        flags += ["--main_process_ip", main_process_ip]
    if main_process_port is not None:
        flags += ["--main_process_port", str(main_process_port)]
    return flags


# the stage's own placement options (fineflow.stages.train), which a per-machine command sets
PLACEMENT_OPTIONS = ("--machine-rank", "--main-process-ip", "--main-process-port")


def per_machine_command(module: str, module_args: list[str], rank: str = "<N>") -> str:
    """The command a person runs on machine `rank` of a hand-placed multi-machine launch: the stage's own command
    with this machine's placement (any placement already in module_args replaced)."""
    kept, skip = [], False
    for arg in module_args:
        if skip:
            skip = False
        elif arg in PLACEMENT_OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{option}=" for option in PLACEMENT_OPTIONS)):
            kept.append(arg)
    placement = f"--machine-rank {rank} --main-process-ip <machine 0's address> --main-process-port 29500"
    return " ".join(["python", "-m", module, *kept, placement])


def _how_to_place(num_machines: int, module: str, module_args: list[str]) -> str:
    """What to do about an unplaced multi-machine launch: a launcher that places it, or the per-machine commands."""
    return (
        f". With train.launcher: local nothing places the ranks of a {num_machines}-machine run: set train.launcher: "
        f"ray or slurm (the stage then places every rank itself), or run on every machine N = 0..{num_machines - 1}, "
        f"in the same checkout: `{per_machine_command(module, module_args)}` (checkpoints on storage every machine "
        f"sees: a shared checkpoints directory or checkpoint.store). Launched by hand, the stage runs outside `dvc "
        f"repro`: machine 0 then records the run in dvc.lock itself (`dvc commit --force train`)"
    )


def _check_multi_node(
    num_processes: int,
    num_machines: int,
    machine_rank: int | None,
    main_process_ip: str | None,
    where: str,
    command: tuple[str, list[str]] | None = None,
) -> None:
    """command: (module, module_args) of the launch, for the per-machine commands a placement problem names."""
    problems = []
    if num_processes % num_machines:
        problems.append(
            f"num_processes ({num_processes}) is the total over all machines and must be a "
            f"multiple of num_machines ({num_machines})"
        )
    if machine_rank is None or not 0 <= machine_rank < num_machines:
        problems.append(f"machine_rank must be given for every launch, 0..{num_machines - 1} (got {machine_rank})")
    if not main_process_ip:
        problems.append("main_process_ip (the address of machine 0, reachable from every machine) must be given")
    if problems:
        unplaced = command is not None and (machine_rank is None or not main_process_ip)
        advice = _how_to_place(num_machines, *command) if unplaced else ""
        raise FineflowError(
            f"{where}: a {num_machines}-machine launch is not fully placed: " + "; ".join(problems) + advice
        )


def accelerate_command(
    num_processes: int | None,
    has_gpu: bool,
    module: str,
    module_args: list[str],
    main_process_port: int | None = None,
    *,
    profile: Profile | None = None,
    num_machines: int | None = None,
    machine_rank: int | None = None,
    main_process_ip: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) that runs ``python -m module module_args`` on num_processes ranks.

    Without a profile file (None, or "auto"), flags are derived from num_processes (the total over all
    machines, accelerate's convention) and has_gpu. With one (``fineflow.train.profile.load_profile``) the
    file decides; num_processes and num_machines may be None (take the file's; without a file, 1) and must
    otherwise agree with it; a GPU profile on a machine where torch sees no GPU is refused (``require_gpu``).
    machine_rank, main_process_ip and main_process_port place this launch in a multi-machine job, in both modes.
    """
    placement = _placement_flags(machine_rank, main_process_ip, main_process_port)
    if profile is not None and profile.path is not None:
        return _profile_command(
            profile,
            num_processes,
            num_machines,
            has_gpu,
            module,
            module_args,
            machine_rank,
            main_process_ip,
            placement,
        )
    num_processes = resolve_processes(num_processes, Profile(None))  # None: one process
    machines = num_machines or 1
    argv = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_machines",
        str(machines),
        "--num_processes",
        str(num_processes),
        "--dynamo_backend",
        "no",
        "--mixed_precision",  # only the env default: each rank passes the resolved train.precision to
        "no",  # Accelerator(mixed_precision=...) explicitly, which wins (fineflow.train.precision)
    ]
    env = {WORKER_ENV: "1"}
    if machines > 1:
        _check_multi_node(
            num_processes, machines, machine_rank, main_process_ip, "accelerate_command", (module, module_args)
        )
    if num_processes > 1:
        argv.append("--multi_gpu")
        if not has_gpu:
            env["ACCELERATE_USE_CPU"] = "1"  # DDP over gloo; see the module docstring
        argv += placement
    elif not has_gpu:
        argv.append("--cpu")
    return argv + ["-m", module, *module_args], env


def _profile_command(
    chosen: Profile,
    num_processes: int | None,
    num_machines: int | None,
    has_gpu: bool,
    module: str,
    module_args: list[str],
    machine_rank: int | None,
    main_process_ip: str | None,
    placement: list[str],
) -> tuple[list[str], dict[str, str]]:
    require_engine(chosen)  # a missing deepspeed first: no other problem with the profile matters before it
    require_gpu(chosen, has_gpu)
    path, profile = chosen.path, chosen.settings
    kind = profile["distributed_type"].upper()
    use_cpu = bool(profile.get("use_cpu", False))
    problems = []
    for key, asked in (("num_processes", num_processes), ("num_machines", num_machines)):
        if asked is not None and key in profile and profile[key] != asked:
            problems.append(f"it sets {key}: {profile[key]} but {asked} was asked for")
    if kind == "MULTI_CPU":
        problems.append(
            "distributed_type MULTI_CPU starts ONE process without mpirun; for N CPU ranks use "
            "distributed_type: MULTI_GPU with use_cpu: true (see configs/accelerate/cpu_ddp_2proc.yaml)"
        )
    if problems:
        raise FineflowError(
            f"accelerate profile {path}: " + "; ".join(problems) + ". Edit the profile or the "
            "train params so that they agree."
        )
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path)]
    if "num_processes" not in profile and num_processes is not None:
        argv += ["--num_processes", str(num_processes)]  # the profile leaves it open; nothing is overridden
    machines = num_machines or int(profile.get("num_machines", 1))
    if machines > 1:
        total = num_processes if num_processes is not None else int(profile.get("num_processes", machines))
        _check_multi_node(
            total,
            machines,
            machine_rank,
            main_process_ip or profile.get("main_process_ip"),
            f"accelerate profile {path}",
            (module, module_args),
        )
        if "num_machines" not in profile:
            argv += ["--num_machines", str(machines)]
    env = {WORKER_ENV: "1"}
    if use_cpu:
        # accelerate's multi-GPU launcher does not hand use_cpu on to the ranks; this variable makes each
        # rank's Accelerator join one gloo group on the CPU instead of running as its own world of size 1
        env["ACCELERATE_USE_CPU"] = "1"
    return argv + placement + ["-m", module, *module_args], env


def with_profile_processes(params: Params, profile: Profile) -> Params:
    """params with train.num_processes resolved (``fineflow.train.profile.resolve_processes``): what the
    launcher, the planner, the run's fingerprint and the report see. Unset, it is the profile's ranks."""
    ranks = resolve_processes(params.train.num_processes, profile)
    return params.model_copy(update={"train": params.train.model_copy(update={"num_processes": ranks})})


def require_gpu(profile: Profile, has_gpu: bool) -> None:
    """A GPU profile where torch sees no GPU stops here, in the launcher before the planner and any rank, instead
    of training on the CPU or failing deep inside a library. Ranks do not check: the tests run FSDP and DeepSpeed
    profiles on CPU ranks started by hand, on purpose."""
    if profile.needs_gpu and not has_gpu:
        raise FineflowError(
            f"train.accelerate_profile {profile.path.stem} ({profile.path}) runs on GPUs and torch sees no GPU "
            f"on this machine: {cuda_diagnosis()}. Or train on the CPU with train.accelerate_profile: auto (or "
            f"cpu_ddp_2proc)"
        )


def require_enough_gpus(profile: Profile, cfg: TrainParams, visible: int) -> None:
    """More ranks on this machine than GPUs torch sees (multi_gpu_ddp's 8 on a 4-GPU node): accelerate would start
    them all and the ranks past the last GPU fail deep in torch (invalid device ordinal). cfg: num_processes
    resolved (``with_profile_processes``)."""
    machines = cfg.num_machines if cfg.num_machines > 1 else int(profile.settings.get("num_machines", 1))
    ranks_here = -(-(cfg.num_processes or 1) // machines)
    if profile.needs_gpu and 0 < visible < ranks_here:
        raise FineflowError(
            f"train.accelerate_profile {profile.path.stem} starts {ranks_here} ranks on this machine and torch sees "
            f"{visible} GPU(s): copy {profile.path}, set its num_processes to {visible} x its num_machines, and "
            f"point train.accelerate_profile at the copy (or make more GPUs visible: CUDA_VISIBLE_DEVICES)"
        )


def cuda_diagnosis() -> str:
    """Why torch sees no GPU, and what to do: a CPU-only wheel, or a CUDA build without a usable device."""
    import os

    import torch

    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None); install the CUDA "
            f"build: pip install --force-reinstall torch=={torch.__version__.split('+')[0]} from PyPI's "
            f"default index, not download.pytorch.org/whl/cpu (docs/install.md)"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = f"; CUDA_VISIBLE_DEVICES is {visible!r}" if visible is not None else ""
    return (
        f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no device{hidden}; run "
        f"nvidia-smi: no driver, or a driver older than CUDA {torch.version.cuda} needs, gives no GPU"
    )


# --- DeepSpeed profiles ---------------------------------------------------------------------------------
#
# fineflow hands accelerate no DataLoader, so accelerate cannot fill a DeepSpeed config's "auto" batch sizes
# (accelerator.prepare raises, after the model has loaded), and it fills an "auto" gradient_clipping with 1.0
# whatever train.max_grad_norm says. These keys therefore come from params and are written into the config on
# every rank before prepare (configure_deepspeed). The rule: a DeepSpeed profile (its deepspeed_config section,
# or the DeepSpeed JSON it names in deepspeed_config_file) leaves them out or sets them to "auto", and params
# fill them; the same value as params is accepted; another value is refused, naming both. Params never lose
# silently to the file, nor the file to params.

DEEPSPEED_INSTALL = "pip install 'fineflow[deepspeed]'"
# DeepSpeed config key -> the params it comes from
DEEPSPEED_FROM_PARAMS = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "train_batch_size": "train.micro_batch_size x train.grad_accum x ranks",
    "gradient_clipping": "train.max_grad_norm",
}


def require_tracker(tracker: str) -> None:
    """The tracker's package, checked before any rank starts: otherwise accelerate only warns and trains
    untracked."""
    from importlib.util import find_spec

    package = {"tensorboard": "tensorboard", "mlflow": "mlflow"}.get(tracker)
    if package and find_spec(package) is None:
        extra = " (pip install '.[mlflow]')" if tracker == "mlflow" else ""
        raise FineflowError(
            f"params.yaml: train.tracker is {tracker!r} but the {package} package is not installed{extra}: "
            f"install it, or set train.tracker to another tracker or none; nothing was trained"
        )


def require_engine(profile: Profile) -> None:
    """A DeepSpeed profile without the deepspeed package: one message, before anything loads (accelerate's own
    launcher would raise an ImportError traceback, and only after the memory planner ran)."""
    from importlib.util import find_spec

    if profile.deepspeed and find_spec("deepspeed") is None:
        raise FineflowError(
            f"accelerate profile {profile.path} runs DeepSpeed (distributed_type: DEEPSPEED) and the deepspeed "
            f"package is not installed: {DEEPSPEED_INSTALL} on the GPU machines (it compiles its CUDA ops on first "
            f"use, with a CUDA toolkit matching torch), or pick another train.accelerate_profile (fsdp_lora shards "
            f"like ZeRO-3 without it)"
        )


def deepspeed_batch_config(cfg: TrainParams, world: int) -> dict:
    """The DeepSpeed config keys that params decide. DeepSpeed itself checks that train_batch_size is
    micro-batch x accumulation steps x data-parallel ranks."""
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.micro_batch_size * cfg.grad_accum * world,
        "gradient_clipping": float(cfg.max_grad_norm),
    }


def _agrees(given, wanted) -> bool:
    try:
        return float(given) == float(wanted)
    except (TypeError, ValueError):
        return False


def resolve_deepspeed_config(ds_config: dict, batch: dict, where: str) -> dict:
    """A copy of ds_config with the batch keys (``deepspeed_batch_config``) filled in where it leaves them out or
    "auto"; a key it sets to another value is a FineflowError naming both (the rule above)."""
    conflicts = [
        f"{key}: {ds_config[key]}, but {DEEPSPEED_FROM_PARAMS[key]} gives {value}"
        for key, value in batch.items()
        if ds_config.get(key, AUTO) != AUTO and not _agrees(ds_config[key], value)
    ]
    if conflicts:
        raise FineflowError(
            f"{where} sets " + "; ".join(conflicts) + ". fineflow takes these DeepSpeed settings from the train "
            "params: delete them from the profile (or set them to auto) and change the train params instead"
        )
    return {**ds_config, **batch}


def profile_deepspeed_config(profile: Profile) -> dict:
    """The batch keys a DeepSpeed profile sets itself: gradient_accumulation_steps and gradient_clipping in its
    deepspeed_config section (accelerate hands them to the ranks as environment variables), and any of them in
    the DeepSpeed JSON it names (deepspeed_config_file)."""
    import json

    section = profile.settings.get("deepspeed_config") or {}
    fixed = {}
    if section.get("deepspeed_config_file"):
        path = Path(section["deepspeed_config_file"])
        try:
            ds_json = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise FineflowError(f"accelerate profile {profile.path}: deepspeed_config_file {path}: {exc}") from None
        fixed.update({key: ds_json[key] for key in DEEPSPEED_FROM_PARAMS if key in ds_json})
    if section.get("gradient_accumulation_steps") == AUTO:
        raise FineflowError(
            f"accelerate profile {profile.path}: deepspeed_config sets gradient_accumulation_steps: auto, which "
            f"accelerate's Accelerator reads as an integer and fails on; delete the line (train.grad_accum decides it)"
        )
    fixed.update({key: section[key] for key in ("gradient_accumulation_steps", "gradient_clipping") if key in section})
    return fixed


def check_deepspeed_profile(profile: Profile, cfg: TrainParams, world: int) -> None:
    """The launcher's check of a DeepSpeed profile against the (planned) train params, before any rank starts."""
    if profile.deepspeed:
        resolve_deepspeed_config(
            profile_deepspeed_config(profile), deepspeed_batch_config(cfg, world), f"accelerate profile {profile.path}"
        )


def fill_deepspeed_plugin(plugin, cfg: TrainParams, world: int) -> None:
    """Write params' batch keys into accelerate's DeepSpeedPlugin config (the dict deepspeed.initialize gets)."""
    batch = deepspeed_batch_config(cfg, world)
    where = "the DeepSpeed config accelerate built from the profile"
    plugin.deepspeed_config.update(resolve_deepspeed_config(plugin.deepspeed_config, batch, where))
    plugin.gradient_accumulation_steps, plugin.gradient_clipping = cfg.grad_accum, float(cfg.max_grad_norm)


def configure_deepspeed(accelerator, cfg: TrainParams) -> None:
    """On a rank under DeepSpeed, before ``accelerator.prepare``: batch sizes, accumulation and clipping from
    params (see the rule above). Nothing to do on other backends."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        fill_deepspeed_plugin(accelerator.state.deepspeed_plugin, cfg, accelerator.num_processes)


# --- where a multi-machine run's checkpoints live ---------------------------------------------------------
#
# Every rank of a multi-machine run reads the checkpoint it resumes from (and, sharded, writes its shards) under
# the checkpoints directory at the same path. A node-local directory is refused in the launcher, before any rank
# starts: the ranks would otherwise find out deep in a collective (fineflow.train.fsdp.require_visible_to_every_rank).
# The filesystem type comes from /proc/self/mountinfo; fuse.* counts as shared (sshfs, JuiceFS, gcsfuse, s3fs).
SHARED_FILESYSTEMS = {"nfs", "nfs4", "lustre", "gpfs", "ceph", "cephfs", "beegfs", "glusterfs", "cifs", "smb3"}
MOUNTINFO = Path("/proc/self/mountinfo")


def _unescape_mount_path(field: str) -> str:
    """mountinfo writes a space, tab, newline or backslash in a path as a three-digit octal escape (\\040)."""
    import re

    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def filesystem_of(path: Path, mountinfo: Path = MOUNTINFO) -> tuple[str, str] | None:
    """(mount point, filesystem type) of the mount that holds path (which may not exist yet), or None where there is
    no mountinfo to read (not Linux)."""
    try:
        lines = mountinfo.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    target = Path(os.path.abspath(path)).resolve()
    best: tuple[str, str] | None = None
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, kind = head.split(), tail.split()
        if len(fields) < 5 or not kind:
            continue
        mount = Path(_unescape_mount_path(fields[4]))
        if (mount == target or mount in target.parents) and (best is None or len(str(mount)) >= len(best[0])):
            best = (str(mount), kind[0])
    return best


def is_shared_filesystem(kind: str) -> bool:
    return kind in SHARED_FILESYSTEMS or kind.startswith("fuse.")


def require_shared_checkpoints(
    checkpoints: Path, machines: int, settings, sharded: bool, mountinfo: Path = MOUNTINFO
) -> None:
    """A multi-machine run whose checkpoints directory only this machine sees is refused here, before any rank
    starts. Fine: one machine; checkpoint.shared: true (a shared filesystem this check does not know); a shared
    filesystem; or checkpoint.store (each node downloads the checkpoint it resumes from), except for a sharded engine
    (FSDP, DeepSpeed: every rank writes its shards into the directory, so it must be shared). settings: the params'
    CheckpointSettings."""
    if machines <= 1 or settings.shared:
        return
    found = filesystem_of(checkpoints, mountinfo)
    if found is None or is_shared_filesystem(found[1]) or (settings.store and not sharded):
        return
    mount, kind = found
    if settings.store:
        fixes = (
            f"a sharded engine (FSDP, DeepSpeed) writes every rank's shards into {checkpoints}, which checkpoint.store "
            f"({settings.store}) does not replace: put --checkpoints on a filesystem every machine mounts at the same "
            f"path (NFS, Lustre, GPFS, CephFS, BeeGFS)"
        )
    else:
        fixes = (
            "either put --checkpoints on a filesystem every machine mounts at the same path (NFS, Lustre, GPFS, "
            "CephFS, BeeGFS), or set checkpoint.store (e.g. s3://bucket/prefix; checkpoint.store_endpoint for an "
            "S3-compatible store): every checkpoint is then uploaded there and each machine downloads the one it "
            "resumes from"
        )
    raise FineflowError(
        f"a {machines}-machine run cannot keep its checkpoints in {checkpoints}: it is on a {kind} filesystem "
        f"(mounted at {mount}), which only this machine sees; {fixes}. If it is shared storage this check does not "
        f"recognise, set checkpoint.shared: true"
    )


def check_checkpoint_storage(params: Params, checkpoints: Path, mountinfo: Path = MOUNTINFO) -> None:
    """The launcher's check of where checkpoints live (require_shared_checkpoints), with the machines and the engine
    from train.num_machines and the accelerate profile."""
    profile = load_profile(params.train.accelerate_profile)
    machines = params.train.num_machines
    if machines <= 1 and profile.path is not None:
        machines = int(profile.settings.get("num_machines", 1))
    require_shared_checkpoints(checkpoints, machines, params.checkpoint, profile.engine != "ddp", mountinfo)
