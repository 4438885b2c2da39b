"""The model a run trains: LoRA / QLoRA adapters on a frozen base, or the whole base (full), and saving it."""

from __future__ import annotations

import json
from pathlib import Path

from fineflow.core.config import Params
from fineflow.errors import FineflowError
from fineflow.objectives import objective_for
from fineflow.train import precision
from fineflow.train.attention import attention_of
from fineflow.train.profile import Profile


def build_model(
    base: str, params: Params, profile: Profile, fuse_lora: bool = False, start_adapter: Path | None = None
):
    """The model to train: LoRA / QLoRA adapters on a frozen base, or the whole base (full). fuse_lora:
    route plain LoRA linears through fineflow.train.fused_lora (same maths, fewer memory passes).
    start_adapter: an adapter to go on training (dpo from the champion: fineflow.train.reference_model), trainable,
    with its own LoRA shape instead of train.lora's.

    params: as fit_plan returns them (RunPlan.params: params.train.precision resolved from "auto"); profile:
    the run's (its sharding decides the base's dtype). The weights are loaded in
    ``precision.base_dtype``: a LoRA base in the 16-bit compute dtype (bf16/fp16; the adapters stay fp32),
    full fine-tuning and fp32 runs in fp32 (CPU runs with the default precision are fp32 as before)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg, sharding = params.train, profile.sharding
    mixed_precision = cfg.precision
    if mixed_precision == precision.AUTO:  # a caller that did not go through fit_plan
        mixed_precision = precision.choose_precision(cfg.precision, profile, torch.cuda.is_available()).mixed_precision
    torch.manual_seed(params.seed)
    loaded = precision.base_dtype(cfg.method, mixed_precision, sharding, precision.fsdp_version(profile))
    kwargs = {"dtype": getattr(torch, loaded)}
    if cfg.method == "qlora":
        precision.check_qlora_sharding(cfg.method, sharding, profile.path)
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise FineflowError(
                "train.method qlora needs bitsandbytes: pip install -e '.[gpu]' (bitsandbytes==0.50.2)"
            ) from None
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(**precision.quantization_kwargs(mixed_precision))
    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation=attention_of(cfg), **kwargs)
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name for it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.method == "full":
        if start_adapter is not None:
            raise FineflowError(
                f"train.method full cannot start from the champion's adapter (train.objective {cfg.objective} with "
                "train.preference.reference champion): set train.preference.reference: base, or train.method lora"
            )
        return objective_for(cfg.objective).prepare_model(model, cfg)
    # what the objective trains beside the adapters (the reward model's head), before the optimizer sees the model
    model = objective_for(cfg.objective).prepare_model(add_adapters(model, cfg, start_adapter), cfg)
    if fuse_lora:
        from fineflow.train.fused_lora import fuse_lora_layers

        model.fineflow_fused_layers = fuse_lora_layers(model)
    return model


def add_adapters(model, cfg, start_adapter: Path | None = None):
    """LoRA adapters on the loaded base (cfg: train params; QLoRA: the 4-bit base prepared for training first):
    fresh ones of train.lora's shape, or start_adapter's, trainable."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if cfg.method == "qlora":
        from peft import prepare_model_for_kbit_training

        # upcasts norms, embeddings and lm_head to fp32 and re-enables checkpointing (non-reentrant here)
        model = prepare_model_for_kbit_training(model, **precision.kbit_preparation_kwargs(cfg.gradient_checkpointing))
    if start_adapter is not None:  # its own config; the adapter weights loaded in fp32 as get_peft_model's
        return PeftModel.from_pretrained(model, str(start_adapter), is_trainable=True)
    from fineflow.train.architecture import lora_targets

    lora = cfg.lora
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora_targets(model, lora.target_modules),  # in this family's names (Phi-3: qkv_proj, ...)
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)  # autocast_adapter_dtype: adapters in fp32 on a 16-bit base


def save_model(accelerator, model, out_dir: Path, method: str, objective: str | None = None) -> None:
    """Every rank calls this: under FSDP/ZeRO-3 gathering the full weights is a collective; rank 0 writes.
    LoRA/QLoRA save the adapter (and what train.objective ``objective`` trained beside it: its save_extra); full
    fine-tuning a whole HF model directory (safetensors). Under FSDP
    and DeepSpeed a LoRA run gathers only the adapter onto rank 0 (accelerate's full state dict would gather the
    whole base there first: ~280 GB for a 70B in fp32)."""
    from fineflow.train import fsdp, zero

    if method != "full" and fsdp.is_fsdp(accelerator):
        state = fsdp.gather_trainable(model)
    elif method != "full" and zero.is_deepspeed(accelerator):  # the fp32 master weights, the adapter alone
        state = zero.gather_trainable(model)
    else:
        state = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return
    unwrapped = accelerator.unwrap_model(model)
    if method == "full":
        unwrapped.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    else:
        save_adapter(unwrapped, out_dir, state)
        if objective is not None:
            objective_for(objective).save_extra(unwrapped, out_dir, state)


def save_adapter(model, out_dir: Path, state_dict: dict | None = None) -> None:
    """save_pretrained, then make adapter_config.json byte-stable.

    peft keeps target_modules as a set, which it writes in hash order (random per process), so the same
    training would give different bytes — and a different DVC hash — run to run.
    """
    model.save_pretrained(out_dir, state_dict=state_dict)  # peft keeps only the adapter's entries
    config_path = Path(out_dir) / "adapter_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
