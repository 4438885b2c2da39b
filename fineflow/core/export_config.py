"""params.yaml's ``export`` section: the champion's GGUF files and their parity check (fineflow.export)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fineflow.param_section import Section, enforced

EXPORT_QUANT_TYPES = Literal["q8_0", "q6_k", "q5_k_m", "q5_0", "q4_k_m", "q4_k_s", "q4_0"]


class ExportParams(Section):
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
        json_schema_extra=enforced(ge=0),
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
