"""params.yaml's ``model`` and ``base`` sections: the base model, and the base stage's pretraining of the
embedded one (fineflow.base).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from fineflow.param_section import Section

EMBEDDED_BASE = "embedded"


class ModelParams(Section):
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


class BaseParams(Section):
    """Brief pretraining of the embedded base so that LoRA has a model that has learned something."""

    corpus_docs: int = Field(20000, gt=0, description="synthetic documents in the pretraining corpus")
    steps: int = Field(1200, ge=0, description="pretraining steps: more is a stronger base and a longer base stage")
    batch_size: int = Field(16, gt=0, description="sequences per pretraining step")
    seq_len: int = Field(128, gt=8, description="tokens per pretraining sequence")
    lr: float = Field(3e-3, gt=0, description="pretraining peak learning rate")
    warmup_steps: int = Field(20, ge=0, description="pretraining steps of linear learning-rate warmup")
