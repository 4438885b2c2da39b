"""params.yaml's ``train.ray`` and ``train.slurm`` sections: the cluster launchers (fineflow.train.engines)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fineflow.param_section import Section


class RayParams(Section):
    """train.launcher: ray. The train stage's driver connects to a Ray cluster and runs the ranks there under Ray
    Train's placement (fineflow.train.engines.ray)."""

    address: str | None = Field(
        None, description="the Ray cluster (ray://host:10001 or host:6379); null: RAY_ADDRESS, else a local one"
    )
    # Ray Train reserves this much per rank (plus one GPU per rank on a GPU machine); a cluster with less in all
    # is refused before anything is submitted
    cpus_per_worker: float = Field(1, gt=0, description="CPUs Ray reserves for each rank")
    # SPREAD: ranks over as many nodes as can take them; PACK: as few nodes as possible (NVLink within a node);
    # STRICT_SPREAD: one rank per node or wait
    placement: Literal["SPREAD", "PACK", "STRICT_SPREAD"] = Field(
        "SPREAD", description="Ray's placement of the ranks over nodes: SPREAD, PACK or STRICT_SPREAD"
    )


class SlurmParams(Section):
    """train.launcher: slurm. The train stage's driver submits the ranks as one Slurm allocation and waits
    (fineflow.train.engines.slurm)."""

    partition: str | None = Field(None, description="the partition to submit to; null: the cluster's default")
    account: str | None = Field(None, description="--account to charge; null: the user's default")
    qos: str | None = Field(None, description="--qos; null: the association's default")
    time: str | None = Field(
        None, description='the allocation\'s time limit ("HH:MM:SS", "D-HH:MM:SS"); null: the partition\'s default'
    )
    gpus_per_node: int | None = Field(
        None, ge=0, description="GPUs to allocate per node; null: one per rank on a GPU, none on CPU"
    )
    cpus_per_task: int = Field(1, ge=1, description="CPUs per rank (OMP_NUM_THREADS unless set)")
    signal_s: int | None = Field(
        None,
        ge=1,
        description="SIGTERM the ranks this many seconds before the time limit (they save and exit 75); null: "
        "checkpoint.preempt_grace_s + 60 (Slurm may signal up to 60 s early)",
    )
    sbatch_args: list[str] = Field(
        default_factory=list, description='more sbatch options, one per item (["--constraint=a100", "--exclusive"])'
    )
