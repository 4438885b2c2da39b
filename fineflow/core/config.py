"""Typed, validated view of ``params.yaml`` — the only source of hyperparameters.

Unknown keys are rejected and every problem is reported at once, each as ``params.yaml: <key> <problem>``,
so a user fixes their file in one go. Paths are not here: they live in ``dvc.yaml`` and reach stages as
arguments (the exceptions are ``data.train_path``/``data.eval_path``, which ``dvc.yaml`` interpolates so
that a user can point the pipeline at their own files by editing params alone, and ``data.sources``, whose
paths the fingerprint stage hashes for DVC).

The field defaults below are the values the project ships: ``params.yaml`` states every one of them (with the
trade-offs in its comments) and tests/test_config.py fails on any key where the two differ. Library code
takes these values from the models instead of repeating them as defaults of its own: a second copy drifts.
Each field's ``description`` is its meaning in the params reference (docs/reference/params.md), which
``fineflow params-doc`` generates from these models (fineflow.params_doc); a test fails on a field without one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fineflow.core.errors import ConfigError

EMBEDDED_BASE = "embedded"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _enforced(**bounds: int | float) -> dict:
    """Bounds a validator enforces with its own message (so not as ``ge``/``le``): shown in the params reference."""
    return {"enforced_bounds": bounds}


class ModelParams(_Section):
    """The base model. ``embedded`` builds a tiny local Llama in the ``base`` stage."""

    base: str = Field(
        EMBEDDED_BASE,
        description='"embedded" builds a tiny local Llama (the base stage); or a local model folder or a Hugging Face '
        "hub id (`fineflow recipe apply NAME` sets one with its hyperparameters)",
    )
    hidden_size: int = Field(128, gt=0, description="embedded model: width; must be divisible by num_heads")
    intermediate_size: int = Field(384, gt=0, description="embedded model: width of each MLP's hidden layer")
    num_layers: int = Field(4, gt=0, description="embedded model: decoder layers")
    num_heads: int = Field(4, gt=0, description="embedded model: attention heads per layer")
    vocab_size: int = Field(
        1024, ge=300, description="embedded model: tokenizer vocabulary (at least the 256 byte symbols plus specials)"
    )
    max_position_embeddings: int = Field(512, gt=0, description="embedded model: longest sequence it has positions for")

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> ModelParams:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        return self

    @property
    def is_embedded(self) -> bool:
        return self.base == EMBEDDED_BASE


class BaseParams(_Section):
    """Brief pretraining of the embedded base so that LoRA has a model that has learned something."""

    corpus_docs: int = Field(20000, gt=0, description="synthetic documents in the pretraining corpus")
    steps: int = Field(1200, ge=0, description="pretraining steps: more is a stronger base and a longer base stage")
    batch_size: int = Field(16, gt=0, description="sequences per pretraining step")
    seq_len: int = Field(128, gt=8, description="tokens per pretraining sequence")
    lr: float = Field(3e-3, gt=0, description="pretraining peak learning rate")
    warmup_steps: int = Field(20, ge=0, description="pretraining steps of linear learning-rate warmup")


class DataParams(_Section):
    """The bundled synthetic dataset, and where the pipeline reads train/eval rows from."""

    train_path: str = Field(
        "data/raw/train.jsonl", description="the training rows: point it at your own file to train on it"
    )
    eval_path: str = Field("data/raw/eval.jsonl", description="the evaluation rows (held out; checked for leakage)")
    n_train: int = Field(4000, gt=0, description="rows of the bundled synthetic train split (the data stage)")
    n_eval: int = Field(200, gt=0, description="rows of the bundled synthetic eval split")
    bad_row_share: float = Field(
        0.03, ge=0, lt=0.5, description="share of deliberately bad rows in the bundled train split, for validation"
    )
    format: Literal["auto", "jsonl", "csv", "parquet"] = Field(
        "auto", description="file format of train_path and eval_path; auto: by file extension"
    )
    mapping: FieldMapping = Field(
        default_factory=lambda: FieldMapping(),
        description="which source column feeds each internal field (instruction, input, output, or chat messages)",
    )

    sources: list[SourceParams] | None = Field(
        None,
        description="several datasets mixed by weight into the train split (then train_path is unused; eval_path "
        "stays the eval split): a list of {path, kind, format, split, mapping, weight or n}, each validated on its "
        "own; null: train_path alone",
    )

    @field_validator("train_path", "eval_path")
    @classmethod
    def _quotable(cls, path: str) -> str:
        if "'" in path or "\n" in path:  # dvc.yaml puts the path in single quotes on the validate command line
            raise ValueError("must not contain a single quote or a newline (dvc.yaml quotes the path with ')")
        return path

    @field_validator("sources")
    @classmethod
    def _some_sources(cls, sources: list | None) -> list | None:
        if sources is not None and not sources:
            raise ValueError("name at least one source, or set it to null to train on data.train_path")
        return sources


SOURCE_KINDS = ("auto", "file", "shards", "saved", "hub")


class SourceParams(_Section):
    """One dataset of a mixture (``data.sources``): where its rows are, how its columns map, and how much of
    it the train split takes: ``weight`` times its kept rows (0.5: a seeded half; 2: each row twice), or exactly
    ``n`` rows. Changing a weight re-mixes; the source is not validated again (fineflow.data.mix)."""

    path: str = Field(
        description="a local JSONL/CSV/Parquet file, a folder of Parquet or JSONL shards, a folder `datasets` "
        "save_to_disk wrote, or a Hugging Face dataset id (org/name)"
    )
    kind: str = Field(
        "auto",
        description="file | shards | saved | hub; auto: an existing file or folder by what it holds, else a hub id",
    )
    format: Literal["auto", "jsonl", "csv", "parquet"] = Field(
        "auto", description="file format of the file or shards; auto: by file extension"
    )
    split: str | None = Field(
        None,
        description="which split to read: of a saved DatasetDict or a hub dataset (null: train), or the shards "
        "whose file or folder name has it (null: every shard)",
    )
    mapping: FieldMapping | None = Field(
        None, description="this source's columns (as data.mapping); null: data.mapping"
    )
    weight: float | None = Field(None, description="its kept rows times this go into the mix; null: 1 (or n)")
    n: int | None = Field(None, description="exactly this many of its rows go into the mix (instead of weight)")

    @model_validator(mode="after")
    def _one_amount(self) -> SourceParams:
        where = f"source {self.path!r}"
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"{where}: kind {self.kind!r} is not a source kind (use one of {', '.join(SOURCE_KINDS)})")
        if self.weight is not None and self.n is not None:
            raise ValueError(f"{where}: give weight or n, not both (weight scales its kept rows, n is a row count)")
        if self.weight is not None and not self.weight > 0:
            raise ValueError(f"{where}: weight must be > 0, it is {self.weight:g} (remove the source to leave it out)")
        if self.n is not None and self.n <= 0:
            raise ValueError(f"{where}: n must be > 0, it is {self.n} (remove the source to leave it out)")
        return self

    @property
    def amount(self) -> dict:
        """How much of the source the mix takes: {"n": rows} or {"weight": w} (weight 1 when neither is set)."""
        return {"n": self.n} if self.n is not None else {"weight": 1.0 if self.weight is None else self.weight}


class FieldMapping(_Section):
    """Which source column feeds each field of fineflow's internal schema (instruction, input, output).

    Alpaca data maps as is; prompt/completion data is ``{instruction: prompt, input: null, output:
    completion}``; chat data names its OpenAI-style list with ``messages: messages`` (the last message is
    the assistant's response, the conversation before it the prompt). A column named here that the file
    does not have is a clear error."""

    instruction: str = Field("instruction", description="source column of the instruction (prompt/completion: prompt)")
    input: str | None = Field("input", description="source column of the optional input; null: the data has none")
    output: str = Field("output", description="source column of the response (prompt/completion: completion)")
    messages: str | None = Field(
        None,
        description="chat data: the column of OpenAI-style {role, content} lists; the last message is the response "
        "and the three columns above are unused",
    )
    # preference data (train.objective dpo or simpo): the prompt as above (instruction/input, or messages: the
    # conversation before the answer), and two answers to it; output is then unused
    chosen: str = Field("chosen", description="preference data: the column of the preferred answer")
    rejected: str = Field("rejected", description="preference data: the column of the dispreferred answer")


SourceParams.model_rebuild()
DataParams.model_rebuild()


class CheckParams(_Section):
    """How one validation check acts: ``error`` quarantines failing rows and blocks the flow when more than
    ``max_share`` of the rows fail; ``warn`` keeps the rows and only reports them."""

    severity: Literal["error", "warn"] = Field(
        "error", description="error: quarantine failing rows, block above max_share; warn: keep them, report only"
    )
    max_share: float = Field(0.10, ge=0, le=1, description="share of rows failing this check that blocks the flow")


def _check(meaning: str, **knobs) -> CheckParams:
    """A validation check's knobs, with what the check looks for as the field's description."""
    return Field(CheckParams(**knobs), description=meaning)


class ValidationChecks(_Section):
    """Each category of data checks (fineflow.data.checks) and how it acts."""

    types: CheckParams = _check("a field that is not a string, or text with a NUL or another control character")
    non_null: CheckParams = _check("a required field (instruction, output) that is null")
    non_empty: CheckParams = _check("an output that is empty or only whitespace or invisible characters")
    length_chars: CheckParams = _check("instruction + input + output outside validate.min_chars..max_chars")
    duplicate: CheckParams = _check("an exact copy of an earlier row (the first copy passes)")
    near_duplicate: CheckParams = _check(
        "a copy of an earlier row up to case, punctuation and spacing", severity="warn"
    )
    pii: CheckParams = _check("an e-mail address, phone number or other PII (when validate.pii is quarantine)")
    leakage: CheckParams = _check("a train row that overlaps the eval data (`validate.leakage_*`)")
    # token-level (need the base tokenizer): rows longer than tokenize.seq_len get truncated ...
    truncation: CheckParams = _check(
        "a row longer than tokenize.seq_len tokens (it is truncated)", severity="warn", max_share=0.05
    )
    # ... and a row whose response is cut away entirely would train on nothing
    label_coverage: CheckParams = _check(
        "a row with no response token left to train on after truncation", max_share=0.05
    )
    # chat rows: the tokenizer's chat template must render every conversation as prompt + response
    chat_template: CheckParams = _check("a chat row that the tokenizer's chat template cannot render")
    # conversations (data.mapping.messages), before any tokenizer: the shape of the turns ...
    chat_roles: CheckParams = _check(
        "a conversation out of order: system not first, no user turn first, two assistant turns in a row, a "
        "tool result not after a tool call, a user turn right after a tool result, or not ending with the assistant"
    )
    chat_empty_turn: CheckParams = _check(
        "a message before the final reply with no text (an assistant turn may be tool calls instead); an empty final "
        "reply is non_empty's"
    )
    chat_tool_results: CheckParams = _check("an assistant tool call that no tool message answers")
    # ... and with the base tokenizer: what its chat template and tokenize.seq_len make of them
    chat_dropped_turn: CheckParams = _check("a message the chat template leaves out of its rendering")
    pair_identical: CheckParams = _check("a preference pair whose chosen and rejected answers are the same text")
    pair_empty: CheckParams = _check("a preference pair with an empty (or whitespace-only) chosen or rejected answer")
    pair_truncation: CheckParams = _check(
        "a preference pair that tokenize.seq_len would cut until chosen and rejected are the same tokens"
    )
    chat_truncation: CheckParams = _check(
        "a conversation that tokenize.seq_len would cut inside an assistant turn (quarantined, not trained cut)",
        max_share=0.05,
    )


class ValidateParams(_Section):
    """The great-expectations gate."""

    min_chars: int = Field(1, ge=0, description="shortest row, instruction + input + output, in characters")
    max_chars: int = Field(2000, gt=0, description="longest row, instruction + input + output, in characters")
    max_bad_share: float = Field(
        0.10, ge=0, le=1, description="quarantining more than this share of the rows fails the flow"
    )
    pii: Literal["quarantine", "redact"] = Field(
        "quarantine",
        description="rows with PII: quarantine them, or redact (keep the row, replace spans with [EMAIL], [PHONE]...)",
    )
    leakage_ngram: int = Field(8, gt=0, description="word n-gram length compared between train rows and the eval data")
    leakage_max_overlap: float = Field(
        0.5, gt=0, le=1, description="a train row with more than this share of its n-grams in the eval data leaks"
    )
    # a source row (a JSONL line, a CSV record, a Parquet row as JSON) over this many bytes is quarantined by
    # the reader, unparsed and never held whole: validating it would cost ~11x its size. 1 MiB is far over any
    # row that trains whole: 65,536 tokens (tokenize.seq_len's maximum) of ~4 bytes, or of JSON-escaped
    # non-ASCII (6 bytes a character), take 256-384 KiB
    max_row_bytes: int = Field(
        1 << 20,
        ge=1024,
        le=2**31 - 1,
        description="a larger source row is quarantined unparsed (validating it costs ~11x its size); >= max_chars",
    )
    checks: ValidationChecks = Field(
        ValidationChecks(), description="per check category: its severity and the share of failing rows that blocks"
    )

    @model_validator(mode="after")
    def _row_holds_max_chars(self) -> ValidateParams:
        if self.max_row_bytes < self.max_chars:  # a row of max_chars characters takes at least as many bytes
            raise ValueError(
                f"max_row_bytes ({self.max_row_bytes:,}) must be >= max_chars ({self.max_chars:,}): a row of "
                f"max_chars characters takes at least that many bytes"
            )
        return self


# Shards store position ids as uint16 (fineflow.tokenize.shards.POSITION_DTYPE): a row holds positions 0..65,535.
MAX_SEQ_LEN = 2**16


class TokenizeParams(_Section):
    """Tokenization and packing of the validated rows into fixed-length shards."""

    seq_len: int = Field(
        512,
        gt=8,
        json_schema_extra=_enforced(le=MAX_SEQ_LEN),
        description="packed row length in tokens; longer examples are truncated, attention cost grows with it",
    )
    workers: int = Field(1, gt=0, description="tokenizer processes; the shards are identical for any count")
    pack_window: int = Field(20000, gt=0, description="examples packed together at a time: bounds memory on big data")
    train_on: Literal["all_assistant", "last_assistant"] = Field(
        "all_assistant",
        description="chat rows: train on every assistant turn (system, user and tool messages masked), or only the "
        "last (the rest is prompt); instruction rows train on their output either way",
    )

    @field_validator("seq_len")
    @classmethod
    def _positions_fit(cls, seq_len: int) -> int:
        if seq_len > MAX_SEQ_LEN:
            raise ValueError(
                f"must be <= {MAX_SEQ_LEN:,}: shards store position ids as uint16, and a longer row's positions "
                f"would wrap around"
            )
        return seq_len


class LoraParams(_Section):
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


class RayParams(_Section):
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


class SlurmParams(_Section):
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


class PreferenceParams(_Section):
    """Preference tuning (train.objective dpo or simpo): the loss's constants and DPO's reference model."""

    beta: float = Field(
        0.1,
        gt=0,
        description="dpo: how far the policy may move from the reference (larger stays closer); simpo: the reward "
        "scale (its paper uses 2 to 10)",
    )
    simpo_gamma: float = Field(
        0.5, ge=0, description="simpo: the margin by which the chosen reward must beat the rejected one"
    )
    # DPO's reference scores the pairs once (the reference stage caches its log-probabilities): champion is the
    # registry's champion adapter on the base (the SFT model, after an SFT run was promoted), which the policy also
    # starts from; base is the base model and a fresh adapter. Without a champion, champion means the base.
    reference: Literal["champion", "base"] = Field(
        "champion",
        description="dpo: the model the policy is anchored to and starts from: the champion (the base when none "
        "yet) or the base",
    )


class TrainParams(_Section):
    """The train stage: method, precision, hardware, optimizer and schedule."""

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
    # the loss projects at most this many trained tokens onto the vocabulary at a time (fineflow.train.loss), so
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
    objective: Literal["sft", "dpo", "simpo"] = Field(
        "sft",
        description="sft: next-token loss on the answers; dpo: preference pairs against a reference model; simpo: "
        "preference pairs, reference-free (length-normalised)",
    )
    preference: PreferenceParams = Field(PreferenceParams(), description="train.objective dpo or simpo")


PREFERENCE_OBJECTIVES = ("dpo", "simpo")


def is_preference(objective: str) -> bool:
    """Whether train.objective trains on preference pairs (dpo, simpo) rather than single examples (sft): the one
    place this is asked (data, validate, tokenize, train, evaluate)."""
    return objective in PREFERENCE_OBJECTIVES


class CheckpointSettings(_Section):
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
    # storage every machine of a multi-machine run sees (fineflow.checkpoint.store): the local checkpoints dir stays
    # the working copy; each published checkpoint is uploaded too (its manifest and marker last), and a resume with
    # no newer valid local checkpoint downloads the store's newest valid one. Credentials: the usual AWS variables
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


class EvaluateParams(_Section):
    """lm-eval tasks (fineflow.evaluate.harness): bundled names, names from task_dirs, or lm-eval registry names."""

    # registry tasks need their dataset in the local cache (offline); only they make lm-eval index its own tasks
    tasks: list[str] = Field(
        ["fineflow_synth", "fineflow_synth_mc"],
        min_length=1,
        description="lm-eval tasks: bundled, from task_dirs, or a registry name (its dataset cached offline)",
    )
    task_dirs: list[str] = Field([], description="your folders of lm-eval task YAMLs, under eval_tasks/")
    batch_size: int = Field(32, gt=0, description="evaluation batch size")
    max_gen_toks: int = Field(24, gt=0, description="longest generation, in tokens, for generative tasks")
    limit: int | None = Field(None, gt=0, description="evaluate only the first N docs of each task; null: all")
    # which base a QLoRA adapter is scored on: as_trained (its 4-bit NF4 base; needs a GPU) or 16bit (the
    # unquantized base in the compute dtype); the eval report and the model card say which
    qlora_base: Literal["as_trained", "4bit", "16bit"] = Field(
        "as_trained",
        description="a QLoRA adapter is scored on its 4-bit base (as_trained, 4bit: GPU only) or a 16bit one",
    )
    # memory per device for the evaluation's plan (fineflow.evaluate.sizing); null = detect (each GPU's memory,
    # or the host's available RAM)
    device_memory_gib: float | None = Field(
        None, gt=0, description="memory per device for the evaluation's plan; null: detect"
    )


class PromoteParams(_Section):
    """The promotion gate: when a candidate replaces the champion."""

    primary_metric: str = Field(
        "fineflow_synth/exact_match", description="the metric that decides, `<task>/<metric>` of evaluate.tasks"
    )
    min_delta: float = Field(
        0.05, ge=0, description="the candidate must beat the champion (or the base) by this much on primary_metric"
    )
    max_regression: float = Field(0.0, ge=0, description="no other metric may drop by more than this")
    # paired bootstrap over per-sample scores (seeded by `seed`): the delta's CI must exclude 0
    bootstrap_samples: int = Field(
        2000, ge=100, description="paired bootstrap resamples of per-sample scores: more is steadier and slower"
    )
    confidence: float = Field(0.95, gt=0.5, lt=1, description="two-sided level of the delta's CI, which must exclude 0")
    # The champion's eval data differs from this run's (the eval set was changed): compare_on_current judges the
    # candidate against the champion re-scored on the current eval data in this run (logged, with both hashes);
    # refuse stops every promotion until the eval data is put back or the policy changed.
    on_eval_change: Literal["compare_on_current", "refuse"] = Field(
        "compare_on_current",
        description="eval data changed since the champion: re-score the champion on the current data, or refuse",
    )
    # The candidate is on another base model than the champion (model.base changed): its adapter cannot wrap the
    # champion's base, nor the champion's adapter this one. compare_to_base judges the candidate against its own
    # base, with the old champion's merged model scored on the same docs side by side (logged); refuse stops.
    on_base_change: Literal["compare_to_base", "refuse"] = Field(
        "compare_to_base",
        description="model.base changed since the champion: judge against the candidate's own base, or refuse",
    )
    # A person approves what the gate would promote: the flow run pauses at promote with the gate's evidence and
    # waits for approve/reject with a comment (in the Prefect UI); the decision and the approver go into the
    # registry log. A refusal by the gate is never put to a person. Outside a flow: FINEFLOW_APPROVAL (docs/prefect.md).
    require_approval: bool = Field(
        False, description="true: a person approves what the gate would promote (the flow run pauses for them)"
    )
    approval_timeout_h: float = Field(
        24.0, gt=0, description="hours to wait for approval; then the run fails and nothing is promoted"
    )
    # the champion's merged model (merged/): always, never, or auto = only when the base's weight files are at most
    # merged_auto_max_gb (a merged copy is the base's size again in DVC's cache at every promotion: a few MB for
    # the embedded base, 16 GB for an 8B, 141 GB for a 70B). Without it the champion is the adapter plus its
    # base's identity; `python -m fineflow.registry.merge` builds the merged model shard by shard when asked
    merged: Literal["auto", "always", "never"] = Field(
        "auto", description="store the champion's merged model; auto: when the base is at most merged_auto_max_gb"
    )
    merged_auto_max_gb: float = Field(
        2.0, ge=0, description="largest base (weight files, GB) merged under merged: auto (2: ~1B params in bf16)"
    )


EXPORT_QUANT_TYPES = Literal["q8_0", "q6_k", "q5_k_m", "q5_0", "q4_k_m", "q4_k_s", "q4_0"]


class ExportParams(_Section):
    """The export stage: the champion's merged model as GGUF files for llama.cpp, each checked for parity."""

    # auto: export when llama.cpp's tools are installed (`make export-tools`: a ~15 min source build, so neither
    # the quickstart nor CI needs it), else the report says why nothing was exported; true: their absence fails
    # the stage; false: never export
    enabled: bool | Literal["auto"] = Field(
        "auto", description="auto: export when llama.cpp's tools are installed; true: require them; false: never"
    )
    # a failed parity check marks the export not shippable and the champion stays champion; with this, promote
    # checks the parity of the float type and every gated type before installing, and refuses the candidate
    block_promotion: bool = Field(
        False, description="a failed parity check (float or a gated type) refuses the promotion itself"
    )
    # what llama.cpp's converter (convert_hf_to_gguf.py --outtype) writes from the merged model; the quantized
    # types are made from this file
    float_type: Literal["f16", "bf16"] = Field(
        "f16", description="the float GGUF llama.cpp's converter writes (bf16 keeps bf16-trained weights exactly)"
    )
    quantized: list[EXPORT_QUANT_TYPES] = Field(
        ["q8_0", "q4_k_m"], description="GGUF types llama.cpp's quantizer makes from the float one (may be [])"
    )
    # parity: the exact-match difference (export - transformers) on the eval docs must be within +-tolerance, and
    # its paired-bootstrap CI's lower end (promote.bootstrap_samples, promote.confidence, seeded by `seed`) at
    # least -tolerance; a type not listed here is reported, not gated (4-bit types lose a little, by design)
    tolerance: dict[str, float] = Field(
        default_factory=lambda: {"f16": 0.01, "bf16": 0.01, "q8_0": 0.01},
        json_schema_extra=_enforced(ge=0),
        description="per GGUF type: largest exact-match difference, and lowest CI end negated; unlisted: reported only",
    )
    parity_docs: int | None = Field(
        None, gt=0, description="eval docs the parity check answers with each GGUF and with transformers; null: all"
    )
    threads: int | None = Field(None, gt=0, description="llama.cpp's CPU threads for quantizing and scoring; null: all")

    @field_validator("tolerance")
    @classmethod
    def _known_non_negative(cls, tolerance: dict[str, float]) -> dict[str, float]:
        known = {"f16", "bf16", *EXPORT_QUANT_TYPES.__args__}
        unknown = sorted(set(tolerance) - known)
        if unknown:
            raise ValueError(f"unknown GGUF type(s) {unknown}: use {sorted(known)}")
        negative = [kind for kind, value in tolerance.items() if value < 0]
        if negative:
            raise ValueError(f"tolerances must be >= 0 (negative: {', '.join(negative)})")
        return tolerance


# $ per device-hour, on-demand list prices rounded (late 2026, one GPU of a multi-GPU instance); "gpu": any other
# GPU; "cpu": a whole 2-vCPU machine (fineflow.goodput.cost)
DEFAULT_PRICES = {
    "B200": 7.0,
    "H200": 5.0,
    "H100": 4.0,
    "A100": 2.5,
    "L40S": 1.9,
    "A10G": 1.2,
    "L4": 0.8,
    "V100": 2.5,
    "T4": 0.5,
    "MI300X": 4.0,
    "gpu": 2.0,
    "cpu": 0.1,
}


class CostParams(_Section):
    """What a device-hour costs, for the goodput ledger's cost figures (fineflow.goodput.cost)."""

    device_hour_usd: float | None = Field(
        None, ge=0, description="$ per device-hour for every device of the run; null: cost.prices by device name"
    )
    # $ per device-hour by device name (matched inside the GPU's name; "gpu": any other GPU, "cpu": a CPU
    # machine); entries given here replace the defaults of the same name, the rest stay
    prices: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_PRICES),
        json_schema_extra=_enforced(ge=0),
        description='$ per device-hour by a name matched inside the GPU\'s ("gpu": any other GPU, "cpu": a CPU '
        "machine); your entries replace these by name",
    )

    @field_validator("prices")
    @classmethod
    def _non_negative(cls, prices: dict[str, float]) -> dict[str, float]:
        negative = [name for name, price in prices.items() if price < 0]
        if negative:
            raise ValueError(f"prices must be >= 0 (negative: {', '.join(negative)})")
        return prices


class Params(_Section):
    """Every hyperparameter of the pipeline, one section per stage (the reference: `fineflow params-doc`)."""

    seed: int = Field(
        1234, description="every random choice: synthetic data, initialisation, data order, the bootstrap"
    )
    model: ModelParams = Field(ModelParams(), description="the base model: the embedded tiny Llama, or a real one")
    base: BaseParams = Field(BaseParams(), description="the base stage: brief pretraining of the embedded model")
    data: DataParams = Field(DataParams(), description="where the rows come from, their format and columns")
    validate_: ValidateParams = Field(
        ValidateParams(), alias="validate", description="the data gate: which rows are quarantined or block the flow"
    )
    tokenize: TokenizeParams = Field(TokenizeParams(), description="tokenizing and packing rows into shards")
    train: TrainParams = Field(TrainParams(), description="fine-tuning: method, precision, hardware, optimizer")
    checkpoint: CheckpointSettings = Field(
        CheckpointSettings(), description="when and how the train stage saves checkpoints"
    )
    evaluate: EvaluateParams = Field(
        EvaluateParams(), description="the lm-eval tasks the candidate and its base are scored on"
    )
    promote: PromoteParams = Field(
        PromoteParams(), description="the gate that decides whether the candidate is champion"
    )
    export: ExportParams = Field(
        ExportParams(), description="the champion as GGUF files for llama.cpp, and the parity check each must pass"
    )
    cost: CostParams = Field(CostParams(), description="what a device-hour costs, for the goodput ledger")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def _describe(error: dict) -> str:
    key = ".".join(str(part) for part in error["loc"]) or "(top level)"
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"{key} is not a known key (remove it or check its spelling)"
    if kind == "missing":
        return f"{key} is required"
    ctx = error.get("ctx") or {}
    bounds = {
        "greater_than": "> {gt}",
        "greater_than_equal": ">= {ge}",
        "less_than": "< {lt}",
        "less_than_equal": "<= {le}",
    }
    if kind in bounds:
        limits = {k: f"{v:g}" if isinstance(v, (int, float)) else v for k, v in ctx.items()}
        return f"{key} must be {bounds[kind].format(**limits)} (got {error['input']!r})"
    message = error["msg"].removeprefix("Value error, ")
    return f"{key}: {message} (got {error['input']!r})"


def parse_params(raw: object, source: str = "params.yaml") -> Params:
    """Validate an already-loaded mapping; raise ConfigError listing every problem."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(raw).__name__}")
    try:
        return Params.model_validate(raw)
    except ValidationError as exc:
        lines = [f"{source}: {_describe(err)}" for err in exc.errors()]
        raise ConfigError(f"{len(lines)} problem(s) in {source}:\n  " + "\n  ".join(lines)) from None


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate params.yaml; every error names the file and the key."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read parameters ({exc.strerror})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    return parse_params(raw, source=str(path))
