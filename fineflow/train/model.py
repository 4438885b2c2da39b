"""The model a run trains: LoRA / QLoRA adapters on a frozen base, or the whole base (full), and saving it."""

from __future__ import annotations

from pathlib import Path

from fineflow.config import Params, TrainParams
from fineflow.errors import FineflowError
from fineflow.train.loop import save_adapter


def attention_of(cfg: TrainParams) -> str:
    """The attn_implementation to load the model with (registering fineflow's varlen one when chosen)."""
    if cfg.attention == "varlen":
        from fineflow.train.attention import register

        return register()
    return cfg.attention


def build_model(base_reference: str, params: Params, cfg: TrainParams, fuse_lora: bool = False):
    """The model to train: LoRA / QLoRA adapters on a frozen base, or the whole base (full). fuse_lora:
    route plain LoRA linears through fineflow.train.fused_lora (same maths, fewer memory passes)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(params.seed)
    kwargs = {"dtype": torch.float32}
    if cfg.method == "qlora":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise FineflowError("train.method qlora needs bitsandbytes: pip install bitsandbytes") from None
        from transformers import BitsAndBytesConfig

        kwargs = {
            "dtype": torch.bfloat16,
            "quantization_config": BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16,
            ),
        }
    model = AutoModelForCausalLM.from_pretrained(base_reference, attn_implementation=attention_of(cfg), **kwargs)
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name for it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.method == "full":
        return model
    from peft import LoraConfig, get_peft_model

    if cfg.method == "qlora":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing)
    lora = cfg.lora
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    if fuse_lora:
        from fineflow.train.fused_lora import fuse_lora_layers

        model.fineflow_fused_layers = fuse_lora_layers(model)
    return model


def save_model(accelerator, model, out_dir: Path, method: str) -> None:
    """Every rank calls this: under FSDP/ZeRO-3 gathering the full weights is a collective; rank 0 writes.
    LoRA/QLoRA save the adapter only; full fine-tuning a whole HF model directory (safetensors)."""
    state = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return
    unwrapped = accelerator.unwrap_model(model)
    if method == "full":
        unwrapped.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    else:
        save_adapter(unwrapped, out_dir, state)
