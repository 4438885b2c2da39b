"""params.yaml's ``data`` and ``validate`` sections: where the rows come from, their columns, and the data
gate's checks (fineflow.data).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from fineflow.param_section import Section


class DataParams(Section):
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


class SourceParams(Section):
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


class FieldMapping(Section):
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
    # feedback data (train.objective kto): an SFT row as above and its label
    label: str = Field(
        "label", description="feedback data: the column of the label, true (a desirable answer) or false"
    )


class CheckParams(Section):
    """How one validation check acts: ``error`` quarantines failing rows and blocks the flow when more than
    ``max_share`` of the rows fail; ``warn`` keeps the rows and only reports them."""

    severity: Literal["error", "warn"] = Field(
        "error", description="error: quarantine failing rows, block above max_share; warn: keep them, report only"
    )
    max_share: float = Field(0.10, ge=0, le=1, description="share of rows failing this check that blocks the flow")


def _check(meaning: str, **knobs) -> CheckParams:
    """A validation check's knobs, with what the check looks for as the field's description."""
    return Field(CheckParams(**knobs), description=meaning)


class ValidationChecks(Section):
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
    feedback_conflict: CheckParams = _check(
        "a feedback row whose answer to the same prompt an earlier row labels the other way"
    )
    chat_truncation: CheckParams = _check(
        "a conversation that tokenize.seq_len would cut inside an assistant turn (quarantined, not trained cut)",
        max_share=0.05,
    )


class ValidateParams(Section):
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
