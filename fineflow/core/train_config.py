"""params.yaml's ``train`` and ``checkpoint`` sections: fine-tuning (fineflow.train) and its checkpoints
(fineflow.checkpoint).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, create_model, field_validator

from fineflow.core.launch_config import RayParams, SlurmParams
from fineflow.objectives import NAMES, OBJECTIVES, described
from fineflow.objectives.pair_params import PreferenceParams
from fineflow.param_section import Section


class LoraParams(Section):
    """The LoRA adapter (train.method lora or qlora)."""

    r: int = Field(16, gt=0, description="adapter rank: higher adapts more and costs memory")
    alpha: float = Field(32, gt=0, description="adapter scaling numerator (the update is scaled by alpha / r)")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="dropout on the adapter's input; non-zero makes every layer take peft's forward, not fused_lora",
    )
    # the linears of each decoder layer that get an adapter, in Llama's names (a model with a fused qkv / gate_up
    # linear adapts that one for them: fineflow.train.architecture), or "all-linear": every linear but the head
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description='linears of each decoder layer that get an adapter, in Llama\'s names; or "all-linear" (all but '
        "the head)",
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _one_name(cls, value):
        return [value] if isinstance(value, str) else value  # `target_modules: all-linear`, as peft writes it


class TrainSettings(Section):
    """The train stage: method, precision, hardware, optimizer and schedule (TrainParams adds each objective's own
    settings section)."""

    method: Literal["lora", "qlora", "full"] = Field(
        "lora",
        description="lora: adapters on a frozen base; qlora: the same on a 4-bit base (bitsandbytes, CUDA only); "
        "full: every weight",
    )
    # mixed precision. auto: the accelerate profile's mixed_precision, else bf16 on a bf16 GPU, else "no" (fp32);
    # an explicit value wins over the profile (a conflict is logged and reported). fp16 needs a GPU (loss scaling)
    precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto",
        description='mixed precision; auto: the profile\'s (else bf16 on a bf16 GPU, else "no": fp32); fp16: GPU only',
    )

    @field_validator("precision", mode="before")
    @classmethod
    def _bare_no(cls, value):
        # YAML 1.1 reads a bare `no` as false, and DVC writes "no" back bare whenever it rewrites params.yaml
        # (`dvc exp run -S`, the flow's overrides): read as what it was written from
        return "no" if value is False else value

    gradient_checkpointing: bool = Field(
        False, description="recompute activations in backward: less memory, ~1/3 more compute"
    )
    # attention over packed rows. varlen: per example, cost sum(len^2) (fineflow.train.attention; any device);
    # sdpa: transformers' block-diagonal (L x L) mask over the whole row; flash_attention_2: flash-attn's
    # varlen kernel from the same position ids (CUDA + the flash-attn package)
    attention: Literal["varlen", "sdpa", "flash_attention_2"] = Field(
        "varlen",
        description="attention over packed rows; varlen: per example (any device); sdpa: a dense block-diagonal "
        "mask; flash_attention_2: CUDA + flash-attn",
    )
    # LoRA layers as one autograd op (base GEMM + low-rank update accumulated in place; fineflow.train.fused_lora);
    # false: peft's own forward. Not applied under DeepSpeed ZeRO-3 (parameters gathered per module)
    fused_lora: bool = Field(
        True, description="LoRA layers as one fused op (same maths, faster); false: peft's forward"
    )
    # the loss projects at most this many trained tokens onto the vocabulary at a time
    # (fineflow.objectives.token_loss), so
    # the tokens x vocab logits never exist whole; a micro-batch with no more trained tokens, 0, or a model with
    # soft-capped/scaled logits takes the plain path (all at once). Memory: chunk x vocab x ~10 bytes
    loss_chunk_tokens: int = Field(
        1024, ge=0, description="trained tokens projected onto the vocabulary at a time in the loss; 0: all at once"
    )
    # hardware: an accelerate config under configs/accelerate (or a path); "auto" derives it from
    # num_processes and whether there is a GPU
    accelerate_profile: str = Field(
        "auto",
        description="hardware: a file of configs/accelerate (fsdp_lora, deepspeed_zero3...) or a path; auto: derived",
    )
    # data-parallel ranks over all machines. null (the default): the profile's num_processes, 1 without a profile
    # file, so picking a profile is enough; a value set here that contradicts the profile's is refused
    # (fineflow.train.profile.resolve_processes). 2 with the auto profile on CPU = DDP over gloo
    num_processes: int | None = Field(
        None, gt=0, description="data-parallel ranks over all machines; null: the profile's (1 with auto)"
    )
    num_machines: int = Field(
        1, gt=0, description=">1: launch the stage on every machine with --machine-rank/--main-process-ip"
    )
    # null: the CPUs each rank may really use (affinity and cgroup quota) shared among the ranks of its machine
    # (fineflow.core.threads); OMP_NUM_THREADS, when set, is the next choice
    threads: int | None = Field(
        None, gt=0, description="intra-op threads per rank; null: the usable CPUs / the ranks on the machine"
    )
    # who places the ranks: local (accelerate launch on this machine, or one launch per machine by hand), or a
    # cluster engine the stage hands the job to and waits for (fineflow.train.engines)
    launcher: Literal["local", "ray", "slurm"] = Field(
        "local", description="who places the ranks: local (accelerate launch here), ray or slurm (a cluster job)"
    )
    max_restarts: int = Field(
        3, ge=0, description="ray/slurm: restarts from the newest checkpoint after a lost node or rank, then fail"
    )
    # a checkpoint of another world size (a lost node, a smaller allocation) is resumed with the same global
    # batch (micro_batch_size x grad_accum x ranks as params give it): the run's identity is that batch, and
    # grad_accum is recomputed for the ranks there are, refused when it does not divide (fineflow.train.elastic).
    # Same data order, schedule and optimizer state; the same maths in another reduction order (not bit-exact).
    # Unsharded runs (one process, DDP): FSDP/DeepSpeed states stay on their world size. Set it before the run
    # starts (it is part of the run's identity); off: another world size is another run
    elastic: bool = Field(
        False,
        description="resume on another number of ranks with the same global batch (grad_accum adapts); unsharded runs",
    )
    ray: RayParams = Field(RayParams(), description="train.launcher: ray")
    slurm: SlurmParams = Field(SlurmParams(), description="train.launcher: slurm")
    auto_fit: bool = Field(
        False,
        description="when the plan exceeds device memory: true adapts (checkpointing, smaller micro-batch), false "
        "refuses",
    )
    device_memory_gib: float | None = Field(
        None, gt=0, description="memory per device for the plan; null: detect (GPU memory, or RAM per rank)"
    )
    steps: int = Field(800, gt=0, description="optimizer steps")
    micro_batch_size: int = Field(2, gt=0, description="packed rows per rank per micro-step")
    grad_accum: int = Field(1, gt=0, description="micro-steps accumulated into each optimizer step")
    lr: float = Field(
        3e-3, gt=0, description="peak learning rate (a real base takes 1e-4 to 3e-4: start from a recipe)"
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    warmup_steps: int = Field(20, ge=0, description="steps of linear learning-rate warmup")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="learning-rate decay after warmup")
    max_grad_norm: float = Field(1.0, gt=0, description="gradients are clipped to this global norm")
    eval_every: int = Field(100, gt=0, description="validation loss on the eval shard every N steps (and at the end)")
    resume: Literal["auto", "never"] = Field(
        "auto", description="auto: a re-run continues from the newest valid checkpoint of this config; never"
    )
    log_every: int = Field(
        50, gt=0, description="a progress line (step, loss, tokens/s, ETA) every N steps when not on a terminal"
    )
    prefetch: int = Field(2, ge=0, description="optimizer steps of batches prepared ahead on a background thread")
    tracker: Literal["tensorboard", "mlflow", "none"] = Field(
        "tensorboard", description="accelerate experiment tracker, logging under logs/"
    )
    lora: LoraParams = Field(LoraParams(), description="the LoRA adapter (lora and qlora)")
    # the objectives and what each trains on: fineflow.objectives (one module each, asked by every stage)
    objective: Literal[NAMES] = Field(NAMES[0], description=described())
    preference: PreferenceParams = Field(PreferenceParams(), description="what the preference objectives share")


def with_objective_sections(settings: type[Section]) -> type[Section]:
    """``settings`` plus one section per objective that has its own settings: train.<name>, its Objective.params
    (fineflow.objectives), so an objective's settings live in its module and params.yaml validates them like any
    other section."""
    sections = {}
    for objective in OBJECTIVES.values():
        if objective.params is None:
            continue
        if objective.name in settings.model_fields:  # a programming error: an objective named like a train setting
            raise TypeError(f"objective {objective.name!r}: train.{objective.name} is already a train setting")
        summary = (objective.params.__doc__ or "").strip().split("\n")[0]
        sections[objective.name] = (objective.params, Field(objective.params(), description=summary))
    doc = f"{settings.__doc__.split(' (')[0]}; train.<objective>: that objective's own settings."
    return create_model("TrainParams", __base__=settings, __module__=__name__, __doc__=doc, **sections)


TrainParams = with_objective_sections(TrainSettings)


class CheckpointSettings(Section):
    """When and how the train stage checkpoints (fineflow.checkpoint)."""

    every_steps: int = Field(200, gt=0, description="save a checkpoint every N optimizer steps")
    every_minutes: float | None = Field(
        None, gt=0, description="also save when this long has passed since the last save; null: by steps only"
    )
    keep_last: int = Field(2, ge=1, description="newest checkpoints kept")
    keep_best: int = Field(
        1, ge=0, description="checkpoints of lowest eval loss kept (never deleted, nor the one resumed from)"
    )
    mode: Literal["async", "sync"] = Field(
        "async", description="async: the loop blocks only while the state is copied to host memory"
    )
    backend: Literal["thread", "process"] = Field("thread", description="where async writes run")
    on_write_error: Literal["stop", "retry"] = Field(
        "stop",
        description="a failed write (disk full...): stop at the next step with a clear error (the previous "
        "checkpoint intact), or retry while training goes on",
    )
    retries: int = Field(3, ge=0, description="write attempts after the first, with on_write_error: retry")
    # SIGTERM (preemption) or Ctrl-C: each rank finishes its step, saves it and exits 75 within this budget
    # (fineflow.process.preempt); the layers above wait a few seconds more, then kill what is left
    preempt_grace_s: float = Field(
        15, gt=0, description="on SIGTERM or Ctrl-C: seconds to finish the step, save it and exit 75 (resumable)"
    )
    # storage every machine of a multi-machine run sees (fineflow.checkpoint.remote_store): the local checkpoints dir
    # stays the working copy; each published checkpoint is uploaded too (its manifest and marker last), and a resume
    # with no newer valid local checkpoint downloads the store's newest valid one. Credentials: the usual AWS variables
    # or ~/.aws files.
    store: str | None = Field(
        None,
        description="also upload every checkpoint to this URL (s3://bucket/prefix) and resume from it; null: none",
    )
    store_endpoint: str | None = Field(
        None, description="endpoint URL of an S3-compatible checkpoint.store (MinIO, Ceph); null: AWS S3"
    )
    shared: bool = Field(
        False,
        description="the checkpoints dir is on shared storage the multi-machine check does not recognise: allow it",
    )
