"""GPU memory planner: peak memory per device of a fine-tuning run, predicted before it is launched.

    fineflow plan --model 7B --method lora --precision bf16 --micro-batch 4 --seq-len 2048
    fineflow plan --table --device-gib 80

Pure arithmetic on the model's shape (no torch import, nothing happens at import). ``plan()`` breaks the
peak into weights, gradients, optimizer states, activations and overhead; ``auto_fit()`` adapts a run
that does not fit (gradient checkpointing first, then smaller micro-batches with more accumulation) and
``refusal()`` says what to change when it cannot.

shapes.py   what a model is made of (``ModelShape``): from a config, a directory, a hub id or a size; the
            linears of a decoder layer as the model's own class builds them (Phi-3's fused qkv_proj, ...)
memory.py   the memory terms of a run (``Setup`` -> ``plan()``: weights, gradients, optimizer, activations)
advice.py   whether it fits, ``auto_fit`` and what to change (``check_fit``, ``refusal``, ``suggestions``)

Everything is re-exported here: ``from fineflow.train.planner import plan, Setup, load_shape``.
"""

from fineflow.train.planner.advice import (  # noqa: F401
    PARAM_KEYS,
    DoesNotFit,
    FitVerdict,
    auto_fit,
    check_fit,
    refusal,
    suggestions,
    what_to_change,
)
from fineflow.train.planner.memory import (  # noqa: F401
    ADAPTER_BYTES,
    ATTENTIONS,
    CUDA_CONTEXT_BYTES,
    FP32,
    FRAGMENTATION,
    GATHERED_LAYERS,
    LINEARS,
    LOGITS_FP32_COPIES,
    MASTER_WEIGHT_BYTES,
    METHODS,
    NCCL_BYTES,
    OPTIMIZER_STATE_BYTES,
    OPTIMIZER_STEP_TEMP_BYTES,
    OPTIMIZERS,
    PER_EXAMPLE_ATTENTIONS,
    PRECISIONS,
    QLORA_BYTES_PER_PARAM,
    SHARDINGS,
    WEIGHT_STORAGES,
    GiB,
    MemoryPlan,
    Setup,
    activation_bytes,
    autocast_copy_bytes,
    backward_working_bytes,
    gradient_bytes,
    layer_activation_bytes,
    logits_bytes,
    lora_params,
    optimizer_bytes,
    optimizer_step_bytes,
    overhead_bytes,
    plan,
    resolve_targets,
    stored_width,
    trainable_params,
    weight_bytes,
)
from fineflow.train.planner.shapes import (  # noqa: F401
    HUB_CONFIGS,
    KNOWN_SHAPES,
    ModelShape,
    load_shape,
    parse_param_count,
    shape_for_params,
    shape_from_config,
    shape_from_file,
)
