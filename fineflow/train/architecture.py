"""What the training code needs to know about a model's architecture, read from the loaded model itself rather
than from a list written for Llama: the decoder-layer class (FSDP's wrap unit), the linears inside one decoder
layer (LoRA's targets, the planner's per-layer linears), and whether q/k/v or gate/up are already one fused
linear (Phi-3's ``qkv_proj`` and ``gate_up_proj``).

    describe(model)                      # -> Architecture(layer_classes, linears, shapes, fused_qkv, fused_gate_up)
    describe_config(AutoConfig...)       # the same from a config alone: the model built on the meta device (no
                                         # weights, no memory), for a planner that sizes a run before it loads
    lora_targets(model, ["q_proj", ...]) # -> what peft gets: the configured names in this model's own names

Llama, Qwen2/2.5/3, Mistral and Gemma 2/3 name their linears q/k/v/o_proj and gate/up/down_proj; Phi-3 has
qkv_proj, o_proj, gate_up_proj, down_proj. ``train.lora.target_modules`` keeps Llama's names as the portable way to
say "the attention and MLP projections": on a fused model q/k/v_proj mean its qkv linear and gate/up_proj its
gate_up linear. ``all-linear`` (peft's own keyword) is every linear except the output head, in any family.
"""

from __future__ import annotations

from dataclasses import dataclass

from fineflow.errors import FineflowError

ALL_LINEAR = "all-linear"  # peft's keyword: every linear layer but the output head
# a fused linear that stands for several of Llama's separate ones, by the names the families use for it
FUSED_QKV = ("qkv_proj", "query_key_value", "Wqkv")
FUSED_GATE_UP = ("gate_up_proj",)
STANDS_FOR = {
    "q_proj": FUSED_QKV,
    "k_proj": FUSED_QKV,
    "v_proj": FUSED_QKV,
    "gate_proj": FUSED_GATE_UP,
    "up_proj": FUSED_GATE_UP,
}


@dataclass(frozen=True)
class Architecture:
    layer_classes: tuple[str, ...]  # decoder-layer class name(s): FSDP's transformer-based wrap unit
    linears: tuple[str, ...]  # the linears of one decoder layer, by leaf name, in module order
    shapes: dict[str, tuple[int, int]]  # leaf name -> (in_features, out_features) of that linear
    fused_qkv: bool  # q, k and v are one linear (no separate q_proj/k_proj/v_proj)
    fused_gate_up: bool  # gate and up are one linear


def base_of(model):
    """The transformers model under a peft wrapper (the model itself otherwise)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_layers(model):
    """The repeated decoder blocks: the ModuleList whose children all share one class, the one with the most
    parameters (a vision tower's blocks are smaller than the language model's)."""
    import torch

    candidates = [
        m
        for m in base_of(model).modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1
    ]
    if not candidates:
        raise FineflowError(
            f"cannot find the decoder layers of {type(base_of(model)).__name__}: no list of repeated blocks "
            f"in its module tree (fineflow trains decoder-only causal LMs)"
        )
    return max(candidates, key=lambda m: sum(p.numel() for p in m.parameters()))


def decoder_layer_classes(model) -> tuple[str, ...]:
    """transformers' ``_no_split_modules`` (what accelerate's FSDP wrap defaults to) that the model really contains
    (accelerate refuses a class it cannot find), else the repeated block's class. Sorted: transformers keeps a set."""
    base = base_of(model)
    present = {type(m).__name__ for m in base.modules()}
    no_split = sorted(name for name in getattr(base, "_no_split_modules", None) or () if name in present)
    return tuple(no_split) or (type(decoder_layers(model)[0]).__name__,)


def layer_linear_shapes(model) -> dict[str, tuple[int, int]]:
    """Leaf name -> (in_features, out_features) of the linears in one decoder layer, in module order. A LoRA-wrapped
    or 4-bit linear counts (peft's layer and bitsandbytes' keep in/out_features); peft's lora_A/lora_B do not."""
    import torch

    shapes: dict[str, tuple[int, int]] = {}
    for path, module in decoder_layers(model)[0].named_modules():
        leaf = path.rsplit(".", 1)[-1]
        parts = path.split(".")
        inside_lora = any(part in ("lora_A", "lora_B", "base_layer") for part in parts)
        is_lora = hasattr(module, "base_layer") and hasattr(module, "lora_A")
        if (is_lora or (isinstance(module, torch.nn.Linear) and not inside_lora)) and leaf not in shapes:
            shapes[leaf] = (module.in_features, module.out_features)
    return shapes


def layer_linears(model) -> tuple[str, ...]:
    """Leaf names of the linears in one decoder layer, in module order."""
    return tuple(layer_linear_shapes(model))


def describe(model) -> Architecture:
    shapes = layer_linear_shapes(model)
    return Architecture(
        layer_classes=decoder_layer_classes(model),
        linears=tuple(shapes),
        shapes=shapes,
        fused_qkv="q_proj" not in shapes and any(n in shapes for n in FUSED_QKV),
        fused_gate_up="gate_proj" not in shapes and any(n in shapes for n in FUSED_GATE_UP),
    )


def describe_config(config) -> Architecture:
    """describe() for a transformers config: the causal LM built on the meta device (shapes only, no storage)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return describe(AutoModelForCausalLM.from_config(config))


def lora_targets(model, configured) -> str | list[str]:
    """``train.lora.target_modules`` in this model's names, for peft's LoraConfig: ``all-linear`` as peft's keyword,
    Llama's q/k/v_proj and gate/up_proj as the fused linear standing for them where the model has one. A name the
    model has no linear for is refused (peft would drop it silently as long as another name matched)."""
    configured = [configured] if isinstance(configured, str) else list(configured)
    if ALL_LINEAR in configured:
        return ALL_LINEAR
    linears = layer_linears(model)
    targets: list[str] = []
    for name in configured:
        found = name if name in linears else next((f for f in STANDS_FOR.get(name, ()) if f in linears), None)
        if found is None:
            raise FineflowError(
                f"train.lora.target_modules names {name!r}, but the decoder layers of "
                f"{type(base_of(model)).__name__} have no such linear: theirs are {', '.join(linears)} "
                f"(or use {ALL_LINEAR!r})"
            )
        if found not in targets:
            targets.append(found)
    return targets
