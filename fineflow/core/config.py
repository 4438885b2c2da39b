"""Typed, validated view of ``params.yaml`` — the only source of hyperparameters.

Unknown keys are rejected and every problem is reported at once, each as ``params.yaml: <key> <problem>``,
so a user fixes their file in one go. Paths are not here: they live in ``dvc.yaml`` and reach stages as
arguments (the exceptions are ``data.train_path``/``data.eval_path``, which ``dvc.yaml`` interpolates so
that a user can point the pipeline at their own files by editing params alone, and ``data.sources``, whose
paths the fingerprint stage hashes for DVC).

Each section's model lives beside the others in ``fineflow/core/<section>_config.py`` (one module per package
it configures: data_config for fineflow.data, train_config for fineflow.train...); this module assembles them.
The field defaults are the values the project ships: ``params.yaml`` states every one of them (with the
trade-offs in its comments) and tests/test_config.py fails on any key where the two differ. Library code
takes these values from the models instead of repeating them as defaults of its own: a second copy drifts.
Each field's ``description`` is its meaning in the params reference (docs/reference/params.md), which
``fineflow params-doc`` generates from these models (fineflow.params_doc); a test fails on a field without one.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ConfigDict, Field, ValidationError

from fineflow.core.cost_config import CostParams
from fineflow.core.data_config import DataParams, ValidateParams
from fineflow.core.evaluate_config import EvaluateParams
from fineflow.core.export_config import ExportParams
from fineflow.core.model_config import BaseParams, ModelParams
from fineflow.core.promote_config import PromoteParams
from fineflow.core.tokenize_config import TokenizeParams
from fineflow.core.train_config import CheckpointSettings, TrainParams
from fineflow.errors import ConfigError
from fineflow.param_section import Section


class Params(Section):
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
