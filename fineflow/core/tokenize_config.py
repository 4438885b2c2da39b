"""params.yaml's ``tokenize`` section: tokenizing and packing rows into shards (fineflow.tokenize)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fineflow.param_section import Section, enforced

# Shards store position ids as uint16 (fineflow.tokenize.shards.POSITION_DTYPE): a row holds positions 0..65,535.
MAX_SEQ_LEN = 2**16


class TokenizeParams(Section):
    """Tokenization and packing of the validated rows into fixed-length shards."""

    seq_len: int = Field(
        512,
        gt=8,
        json_schema_extra=enforced(le=MAX_SEQ_LEN),
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
