"""Typed, validated view of ``params.yaml`` — the only source of hyperparameters.

Unknown keys are rejected and every problem is reported at once, each as ``params.yaml: <key> <problem>``,
so a user fixes their file in one go. Paths are not here: they live in ``dvc.yaml`` and reach stages as
arguments (the one exception is ``data.train_path``/``data.eval_path``, which ``dvc.yaml`` interpolates so
that a user can point the pipeline at their own files by editing params alone).

The field defaults below are the values the project ships: ``params.yaml`` states every one of them (with the
trade-offs in its comments) and tests/test_config.py fails on any key where the two differ. Library code
takes these values from the models instead of repeating them as defaults of its own: a second copy drifts.
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


class ModelParams(_Section):
    """The base model. ``embedded`` builds a tiny local Llama in the ``base`` stage."""

    base: str = EMBEDDED_BASE
    hidden_size: int = Field(128, gt=0)
    intermediate_size: int = Field(384, gt=0)
    num_layers: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    vocab_size: int = Field(1024, ge=300)  # must hold the 256 byte symbols plus specials
    max_position_embeddings: int = Field(512, gt=0)

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

    corpus_docs: int = Field(20000, gt=0)
    steps: int = Field(1200, ge=0)
    batch_size: int = Field(16, gt=0)
    seq_len: int = Field(128, gt=8)
    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)


class DataParams(_Section):
    """The bundled synthetic dataset, and where the pipeline reads train/eval rows from."""

    train_path: str = "data/raw/train.jsonl"
    eval_path: str = "data/raw/eval.jsonl"
    n_train: int = Field(4000, gt=0)
    n_eval: int = Field(200, gt=0)
    bad_row_share: float = Field(0.03, ge=0, lt=0.5)  # deliberately bad rows so validation has work
    format: Literal["auto", "jsonl", "csv", "parquet"] = "auto"  # auto: by file extension
    mapping: FieldMapping = Field(default_factory=lambda: FieldMapping())

    @field_validator("train_path", "eval_path")
    @classmethod
    def _quotable(cls, path: str) -> str:
        if "'" in path or "\n" in path:  # dvc.yaml puts the path in single quotes on the validate command line
            raise ValueError("must not contain a single quote or a newline (dvc.yaml quotes the path with ')")
        return path


class FieldMapping(_Section):
    """Which source column feeds each field of fineflow's internal schema (instruction, input, output).

    Alpaca data maps as is; prompt/completion data is ``{instruction: prompt, input: null, output:
    completion}``; chat data names its OpenAI-style list with ``messages: messages`` (the last message is
    the assistant's response, the conversation before it the prompt). A column named here that the file
    does not have is a clear error."""

    instruction: str = "instruction"
    input: str | None = "input"  # null: the data has no separate input field
    output: str = "output"
    messages: str | None = None  # set for chat data; then instruction/input/output are derived from it


DataParams.model_rebuild()


class CheckParams(_Section):
    """How one validation check acts: ``error`` quarantines failing rows and blocks the flow when more than
    ``max_share`` of the rows fail; ``warn`` keeps the rows and only reports them."""

    severity: Literal["error", "warn"] = "error"
    max_share: float = Field(0.10, ge=0, le=1)


class ValidationChecks(_Section):
    types: CheckParams = CheckParams()
    non_null: CheckParams = CheckParams()
    non_empty: CheckParams = CheckParams()
    length_chars: CheckParams = CheckParams()
    duplicate: CheckParams = CheckParams()
    near_duplicate: CheckParams = CheckParams(severity="warn")  # same text up to case/punctuation/spacing
    pii: CheckParams = CheckParams()
    leakage: CheckParams = CheckParams()  # train rows that overlap the eval data
    # token-level (need the base tokenizer): rows longer than tokenize.seq_len get truncated ...
    truncation: CheckParams = CheckParams(severity="warn", max_share=0.05)
    # ... and a row whose response is cut away entirely would train on nothing
    label_coverage: CheckParams = CheckParams(max_share=0.05)
    # chat rows: the tokenizer's chat template must render every conversation as prompt + response
    chat_template: CheckParams = CheckParams()


class ValidateParams(_Section):
    """The great-expectations gate."""

    min_chars: int = Field(1, ge=0)
    max_chars: int = Field(2000, gt=0)  # instruction+input+output, in characters
    max_bad_share: float = Field(0.10, ge=0, le=1)  # more quarantined rows than this fails the flow
    pii: Literal["quarantine", "redact"] = "quarantine"  # redact: replace spans with [EMAIL], [PHONE], ...
    leakage_ngram: int = Field(8, gt=0)  # word n-gram length for train/eval overlap
    leakage_max_overlap: float = Field(0.5, gt=0, le=1)  # a train row sharing more of its n-grams leaks
    # a source row (a JSONL line, a CSV record, a Parquet row as JSON) over this many bytes is quarantined by
    # the reader, unparsed and never held whole: validating it would cost ~11x its size. 1 MiB is far over any
    # row that trains whole: 65,536 tokens (tokenize.seq_len's maximum) of ~4 bytes, or of JSON-escaped
    # non-ASCII (6 bytes a character), take 256-384 KiB
    max_row_bytes: int = Field(1 << 20, ge=1024, le=2**31 - 1)
    checks: ValidationChecks = ValidationChecks()

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
    seq_len: int = Field(512, gt=8)  # packed row length; examples longer than this are truncated
    workers: int = Field(1, gt=0)  # tokenizer processes; the output is identical for any count
    pack_window: int = Field(20000, gt=0)  # examples packed together; bounds memory, not the result much

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
    r: int = Field(16, gt=0)  # higher adapts more and costs memory
    alpha: float = Field(32, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    # the linears of each decoder layer that get an adapter, in Llama's names (a model with a fused qkv / gate_up
    # linear adapts that one for them: fineflow.train.architecture), or "all-linear": every linear but the head
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    @field_validator("target_modules", mode="before")
    @classmethod
    def _one_name(cls, value):
        return [value] if isinstance(value, str) else value  # `target_modules: all-linear`, as peft writes it


class TrainParams(_Section):
    method: Literal["lora", "qlora", "full"] = "lora"  # qlora: 4-bit base via bitsandbytes, CUDA only
    # mixed precision. auto: the accelerate profile's mixed_precision, else bf16 on a bf16 GPU, else "no" (fp32);
    # an explicit value wins over the profile (a conflict is logged and reported). fp16 needs a GPU (loss scaling)
    precision: Literal["auto", "no", "bf16", "fp16"] = "auto"

    @field_validator("precision", mode="before")
    @classmethod
    def _bare_no(cls, value):
        # YAML 1.1 reads a bare `no` as false, and DVC writes "no" back bare whenever it rewrites params.yaml
        # (`dvc exp run -S`, the flow's overrides): read as what it was written from
        return "no" if value is False else value

    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~1/3 more compute
    # attention over packed rows. varlen: per example, cost sum(len^2) (fineflow.train.attention; any device);
    # sdpa: transformers' block-diagonal (L x L) mask over the whole row; flash_attention_2: flash-attn's
    # varlen kernel from the same position ids (CUDA + the flash-attn package)
    attention: Literal["varlen", "sdpa", "flash_attention_2"] = "varlen"
    # LoRA layers as one autograd op (base GEMM + low-rank update accumulated in place; fineflow.train.fused_lora);
    # false: peft's own forward. Not applied under DeepSpeed ZeRO-3 (parameters gathered per module)
    fused_lora: bool = True
    # the loss projects at most this many trained tokens onto the vocabulary at a time (fineflow.train.loss), so
    # the tokens x vocab logits never exist whole; a micro-batch with no more trained tokens, 0, or a model with
    # soft-capped/scaled logits takes the plain path (all at once). Memory: chunk x vocab x ~10 bytes
    loss_chunk_tokens: int = Field(1024, ge=0)
    # hardware: an accelerate config under configs/accelerate (or a path); "auto" derives it from
    # num_processes and whether there is a GPU
    accelerate_profile: str = "auto"
    # data-parallel ranks over all machines. null (the default): the profile's num_processes, 1 without a profile
    # file, so picking a profile is enough; a value set here that contradicts the profile's is refused
    # (fineflow.train.profile.resolve_processes). 2 with the auto profile on CPU = DDP over gloo
    num_processes: int | None = Field(None, gt=0)
    num_machines: int = Field(1, gt=0)  # >1: launch once per machine with --machine-rank/--main-process-ip
    auto_fit: bool = False  # plan exceeds device memory: adapt (checkpointing, smaller micro-batch) or refuse
    device_memory_gib: float | None = Field(None, gt=0)  # per device; null = detect (GPU memory, or RAM/ranks)
    steps: int = Field(800, gt=0)  # optimizer steps
    micro_batch_size: int = Field(2, gt=0)  # packed rows per process per micro-step
    grad_accum: int = Field(1, gt=0)
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(20, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    max_grad_norm: float = Field(1.0, gt=0)
    eval_every: int = Field(100, gt=0)  # validation loss on the eval shard every N steps (and at the end)
    resume: Literal["auto", "never"] = "auto"  # auto: continue from the newest valid checkpoint of this config
    log_every: int = Field(50, gt=0)
    prefetch: int = Field(2, ge=0)  # optimizer steps of batches prepared ahead on a background thread
    tracker: Literal["tensorboard", "mlflow", "none"] = "tensorboard"  # accelerate tracker (logs/<tracker>)
    lora: LoraParams = LoraParams()


class CheckpointSettings(_Section):
    """When and how the train stage checkpoints (fineflow.checkpoint)."""

    every_steps: int = Field(200, gt=0)
    every_minutes: float | None = Field(None, gt=0)  # also save when this long has passed since the last save
    keep_last: int = Field(2, ge=1)
    keep_best: int = Field(1, ge=0)  # by validation loss; never deleted, nor the one resumed from
    mode: Literal["async", "sync"] = "async"  # async: the loop blocks only for the copy to host memory
    backend: Literal["thread", "process"] = "thread"  # where async writes run (bench/checkpoint_stall.py)
    on_write_error: Literal["stop", "retry"] = "stop"  # e.g. disk full: stop with a clear error, or retry
    retries: int = Field(3, ge=0)
    # SIGTERM (preemption) or Ctrl-C: each rank finishes its step, saves it and exits 75 within this budget
    # (fineflow.train.preempt); the layers above wait a few seconds more, then kill what is left
    preempt_grace_s: float = Field(15, gt=0)


class EvaluateParams(_Section):
    """lm-eval tasks (fineflow.evaluate.harness): bundled names, names from task_dirs, or lm-eval registry names."""

    # registry tasks need their dataset in the local cache (offline); only they make lm-eval index its own tasks
    tasks: list[str] = Field(["fineflow_synth", "fineflow_synth_mc"], min_length=1)
    task_dirs: list[str] = []  # extra folders of task YAMLs, indexed with the bundled tasks
    batch_size: int = Field(32, gt=0)
    max_gen_toks: int = Field(24, gt=0)
    limit: int | None = Field(None, gt=0)  # evaluate only the first N docs of each task
    # which base a QLoRA adapter is scored on: as_trained (its 4-bit NF4 base; needs a GPU) or 16bit (the
    # unquantized base in the compute dtype); the eval report and the model card say which
    qlora_base: Literal["as_trained", "4bit", "16bit"] = "as_trained"
    # memory per device for the evaluation's plan (fineflow.evaluate.sizing); null = detect (each GPU's memory,
    # or the host's available RAM)
    device_memory_gib: float | None = Field(None, gt=0)


class PromoteParams(_Section):
    primary_metric: str = "fineflow_synth/exact_match"  # "<task>/<metric>" from evaluate.tasks
    min_delta: float = Field(0.05, ge=0)  # candidate must beat the champion (or base) by this much
    max_regression: float = Field(0.0, ge=0)  # no other task may drop by more than this
    # paired bootstrap over per-sample scores (seeded by `seed`): the delta's CI must exclude 0
    bootstrap_samples: int = Field(2000, ge=100)  # more: a steadier CI, a slower gate
    confidence: float = Field(0.95, gt=0.5, lt=1)  # two-sided CI level
    # The champion's eval data differs from this run's (the eval set was changed): compare_on_current judges the
    # candidate against the champion re-scored on the current eval data in this run (logged, with both hashes);
    # refuse stops every promotion until the eval data is put back or the policy changed.
    on_eval_change: Literal["compare_on_current", "refuse"] = "compare_on_current"
    # The candidate is on another base model than the champion (model.base changed): its adapter cannot wrap the
    # champion's base, nor the champion's adapter this one. compare_to_base judges the candidate against its own
    # base, with the old champion's merged model scored on the same docs side by side (logged); refuse stops.
    on_base_change: Literal["compare_to_base", "refuse"] = "compare_to_base"
    # A person approves what the gate would promote: the flow run pauses at promote with the gate's evidence and
    # waits for approve/reject with a comment (in the Prefect UI); the decision and the approver go into the
    # registry log. A refusal by the gate is never put to a person. Outside a flow: FINEFLOW_APPROVAL (README).
    require_approval: bool = False
    approval_timeout_h: float = Field(24.0, gt=0)  # no answer by then: the run fails, nothing is promoted or logged
    # the champion's merged model (merged/): always, never, or auto = only when the base's weight files are at most
    # merged_auto_max_gb (a merged copy is the base's size again in DVC's cache at every promotion: a few MB for
    # the embedded base, 16 GB for an 8B, 141 GB for a 70B). Without it the champion is the adapter plus its
    # base's identity; `python -m fineflow.registry.merge` builds the merged model shard by shard when asked
    merged: Literal["auto", "always", "never"] = "auto"
    merged_auto_max_gb: float = Field(2.0, ge=0)  # ~1B parameters in bf16


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

    device_hour_usd: float | None = Field(None, ge=0)  # null: cost.prices by the training device's name
    # $ per device-hour by device name (matched inside the GPU's name; "gpu": any other GPU, "cpu": a CPU
    # machine); entries given here replace the defaults of the same name, the rest stay
    prices: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_PRICES))

    @field_validator("prices")
    @classmethod
    def _non_negative(cls, prices: dict[str, float]) -> dict[str, float]:
        negative = [name for name, price in prices.items() if price < 0]
        if negative:
            raise ValueError(f"prices must be >= 0 (negative: {', '.join(negative)})")
        return prices


class Params(_Section):
    seed: int = 1234
    model: ModelParams = ModelParams()
    base: BaseParams = BaseParams()
    data: DataParams = DataParams()
    validate_: ValidateParams = Field(ValidateParams(), alias="validate")
    tokenize: TokenizeParams = TokenizeParams()
    train: TrainParams = TrainParams()
    checkpoint: CheckpointSettings = CheckpointSettings()
    evaluate: EvaluateParams = EvaluateParams()
    promote: PromoteParams = PromoteParams()
    cost: CostParams = CostParams()

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
