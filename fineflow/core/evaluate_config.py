"""params.yaml's ``evaluate`` section: the lm-eval tasks a candidate is scored on (fineflow.evaluate)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fineflow.param_section import Section


class EvaluateParams(Section):
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
