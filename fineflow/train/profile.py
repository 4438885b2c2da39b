"""The accelerate profile, read once: ``load_profile(train.accelerate_profile)`` -> a frozen ``Profile``.

A profile is an accelerate config file under ``configs/accelerate/`` (by name, ``"fsdp_lora"``), a path to
one, or ``"auto"`` (no file: flags derived from train.num_processes and the GPU). train.num_processes null
(the default) takes the profile's ranks (``resolve_processes``), so picking a profile is enough. The launcher
and each rank load it once, at the top of their setup; every decision below (the precision rule, the planner's
sharding, the model's dtypes, the launch command, DeepSpeed's batch keys, how the training state is
checkpointed) takes that value and never reads the file again.

    python -c "from fineflow.train.profile import load_profile; print(load_profile('fsdp_lora'))"
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from fineflow.errors import FineflowError

PROFILE_DIR = Path(__file__).resolve().parents[2] / "configs" / "accelerate"
AUTO = "auto"

# who holds the training state: "ddp" every rank all of it (one process or DDP), "fsdp" and "deepspeed" each
# rank its shards (fineflow.train.checkpointing saves and restores it accordingly)
ENGINE_OF = {"FSDP": "fsdp", "DEEPSPEED": "deepspeed"}


MIXED_PRECISIONS = ("no", "bf16", "fp16")  # accelerate's names, what Accelerator(mixed_precision=) takes
SHARDED_ENGINES = ("fsdp", "deepspeed")  # each rank holds (and writes) its own part of the state


def profile_mixed_precision(profile: dict, path: Path | str) -> str | None:
    """The ``mixed_precision`` an accelerate profile asks for, or None when it sets none.

    YAML reads a bare ``no`` as False: that is "no" too. fp8 and other modes fineflow does not train in are
    refused with the file named."""
    value = profile.get("mixed_precision")
    if value is None:
        return None
    if value is False:
        return "no"
    value = str(value).lower()
    if value not in MIXED_PRECISIONS:
        raise FineflowError(
            f"accelerate profile {path}: mixed_precision {value!r} is not supported by fineflow; use one of "
            f"{', '.join(MIXED_PRECISIONS)} (quote 'no': bare no is a YAML boolean)"
        )
    return value


@dataclass(frozen=True)
class Profile:
    """What a run's accelerate profile decides, read once.

    engine: "ddp" | "fsdp" | "deepspeed" (who holds the training state; see ENGINE_OF). sharding: the one
    sharding vocabulary, "none" | "fsdp" | "zero2" | "zero3" (how parameters, gradients and optimizer states
    split over the ranks: the memory planner's and the dtype rules' terms). mixed_precision: the profile's own
    (None: it sets none, or no profile). processes: its num_processes (1 without one). settings: the file's
    top-level keys, read-only (empty for "auto"), for the launch command and DeepSpeed's section."""

    path: Path | None
    engine: str = "ddp"
    sharding: str = "none"
    mixed_precision: str | None = None
    processes: int = 1
    settings: Mapping = field(default_factory=lambda: MappingProxyType({}), compare=False, repr=False)

    @property
    def deepspeed(self) -> bool:
        return self.engine == "deepspeed"

    @property
    def needs_gpu(self) -> bool:
        """A file that does not say use_cpu: true runs its ranks on GPUs ("auto" adapts to the machine)."""
        return self.path is not None and not self.settings.get("use_cpu", False)


def resolve_processes(asked: int | None, profile: Profile) -> int:
    """The ranks a run takes: train.num_processes when set (the launcher refuses one that contradicts the
    profile's file), else the profile's num_processes, else 1 (the "auto" profile). The one rule: the launcher,
    the planner and every rank use this value."""
    return asked if asked is not None else profile.processes


def load_profile(name: str, profile_dir: Path = PROFILE_DIR) -> Profile:
    """train.accelerate_profile (a name, a path or "auto") -> the Profile every later step reads."""
    path = resolve_profile(name, profile_dir)
    if path is None:
        return Profile(None)
    data = read_profile(path)
    kind = data["distributed_type"].upper()
    return Profile(
        path,
        engine=ENGINE_OF.get(kind, "ddp"),
        sharding=_sharding(kind, data),
        mixed_precision=profile_mixed_precision(data, path),
        processes=int(data.get("num_processes", 1)),
        settings=MappingProxyType(data),
    )


def _sharding(kind: str, data: dict) -> str:
    """How parameters/gradients/optimizer states split: FSDP, DeepSpeed's ZeRO stage (2 unless it says), else none."""
    if kind == "FSDP":
        return "fsdp"
    if kind == "DEEPSPEED":
        stage = int((data.get("deepspeed_config") or {}).get("zero_stage", 2))
        return "zero3" if stage == 3 else "zero2" if stage == 2 else "none"
    return "none"


def profile_names(profile_dir: Path = PROFILE_DIR) -> list[str]:
    """The profiles shipped in configs/accelerate, by name (file stem)."""
    return sorted(p.stem for p in profile_dir.glob("*.yaml"))


def resolve_profile(profile: str, profile_dir: Path = PROFILE_DIR) -> Path | None:
    """A profile name or path -> the accelerate config file to launch with.

    ``"auto"`` gives None: no config file, flags derived from num_processes and GPU presence (the behaviour
    of ``accelerate_command`` without a profile). A name (``"fsdp_lora"``) gives
    ``configs/accelerate/fsdp_lora.yaml``; a path to an existing .yaml/.yml file is returned as is.
    """
    if profile == AUTO:
        return None
    path = Path(profile)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise FineflowError(f"accelerate profile {profile}: no such file")
        return path
    candidate = profile_dir / f"{profile}.yaml"
    if not candidate.is_file():
        raise FineflowError(
            f"accelerate profile {profile!r} is unknown: use {AUTO!r}, one of "
            f"{', '.join(profile_names(profile_dir))} (files in {profile_dir}), or a path to an "
            f"accelerate config .yaml"
        )
    return candidate


def read_profile(path: Path) -> dict:
    """The profile's top-level keys (yaml), with a message naming the file when it is not a profile."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise FineflowError(f"accelerate profile {path}: cannot read it ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("distributed_type"), str):
        raise FineflowError(
            f"accelerate profile {path}: not an accelerate config file (it needs a "
            f"distributed_type such as MULTI_GPU; quote 'NO', which YAML reads as false)"
        )
    return data
