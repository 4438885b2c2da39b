"""What FSDP needs beyond accelerate's defaults for LoRA: wrapping, buffer precision, fused layers, and states.

accelerate prepares FSDP from the profile's ``fsdp_config``; for a LoRA model that leaves three problems, fixed
here before ``accelerator.prepare`` (``prepare_model_for_fsdp``), after the wrap unit is set from the loaded model
(``set_wrap_classes``: its decoder-layer class, so the shipped profile names none and fits every family):

- FSDP1 flattens every parameter of a wrapped unit into one flat parameter. With
  TRANSFORMER_BASED_WRAP a decoder block's frozen base weights and its LoRA weights share one flat parameter,
  which then requires grad as a whole: gradients are computed and stored for the frozen base. peft's
  ``fsdp_auto_wrap_policy`` gives every LoRA linear a unit of its own, so the blocks' flat parameters are frozen.
  FSDP2 (``fully_shard``, the shipped profile) shards each parameter separately and never mixes them.
- FSDP1's mixed-precision policy casts buffers to the compute dtype, rotary ``inv_freq`` included (a phase error
  that grows with position: ~0.9 rad at 512 positions for head_dim 128, theta 5e5). Buffers are kept fp32.
  FSDP2's policy has no buffer dtype: it leaves buffers alone.
- A fused LoRA layer (fineflow.train.fused_lora) reads its adapter weights directly instead of calling the
  adapter modules, so under FSDP1's per-LoRA units it would read ungathered shards: those layers go back to
  peft's forward (the report then says 0 fused layers). Under FSDP2 the adapters belong to their block's unit,
  gathered while the block runs, and fusing stays on.

States: ``sharded_state`` / ``save_sharded`` / ``load_sharded`` keep the trainable parameters and the optimizer
as each rank's shards through torch's distributed checkpoint (DCP): nothing is gathered to save or resume.
``gather_trainable`` gathers the trainable parameters alone onto rank 0 for the final adapter (never the base).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


def is_fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def fsdp_version(accelerator) -> int:
    return int(getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1) or 1)


def prepare_model_for_fsdp(accelerator, model, fused_layers: int) -> int:
    """Call right before ``accelerator.prepare``: LoRA units apart from the frozen base (FSDP1), buffers in
    fp32, fused LoRA layers only where they can run. Returns how many fused LoRA layers will really run."""
    if not is_fsdp(accelerator):
        return fused_layers
    plugin = accelerator.state.fsdp_plugin
    set_wrap_classes(plugin, model)
    keep_buffers_fp32(plugin)
    if fsdp_version(accelerator) == 1:
        if _is_peft(model):
            from peft.utils.other import fsdp_auto_wrap_policy

            plugin.auto_wrap_policy = fsdp_auto_wrap_policy(model)
        unfuse_lora_layers(model)
    return count_fused_layers(model)


def set_wrap_classes(plugin, model) -> None:
    """The decoder-layer class(es) FSDP wraps, from the loaded model (fineflow.train.architecture) when the profile
    names none, so one profile fits Llama, Qwen, Mistral, Gemma and Phi-3 alike; a class the profile names that the
    model lacks is refused here with the model's own (accelerate would raise a bare ValueError inside prepare)."""
    from fineflow.errors import FineflowError
    from fineflow.train.architecture import decoder_layer_classes

    detected = decoder_layer_classes(model)
    named = plugin.transformer_cls_names_to_wrap
    if named is None:
        plugin.transformer_cls_names_to_wrap = list(detected)
        return
    present = {type(m).__name__ for m in model.modules()}
    missing = [name for name in named if name not in present]
    if missing:
        raise FineflowError(
            f"the accelerate profile's fsdp_transformer_layer_cls_to_wrap names {', '.join(missing)}, which "
            f"{type(model).__name__} does not have: its decoder layer is {', '.join(detected)}. Remove the key "
            f"(fineflow then wraps the model's own decoder layer) or name that class"
        )


def keep_buffers_fp32(plugin) -> None:
    """FSDP1's MixedPrecision casts buffers to buffer_dtype (accelerate sets the compute dtype): make it fp32."""
    import torch

    policy = plugin.mixed_precision_policy
    if dataclasses.is_dataclass(policy) and getattr(policy, "buffer_dtype", torch.float32) not in (None, torch.float32):
        plugin.mixed_precision_policy = dataclasses.replace(policy, buffer_dtype=torch.float32)


def _is_peft(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def count_fused_layers(model) -> int:
    """LoRA layers whose forward is fineflow's fused op right now (what the train report states)."""
    from fineflow.train.fused_lora import _fused_forward

    return sum(getattr(getattr(m, "forward", None), "__func__", None) is _fused_forward for m in model.modules())


def unfuse_lora_layers(model) -> None:
    """Give fused LoRA layers back peft's own forward (the class's)."""
    from fineflow.train.fused_lora import _fused_forward

    for module in model.modules():
        if getattr(module.__dict__.get("forward"), "__func__", None) is _fused_forward:
            del module.forward


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # frozen parameters (the LoRA base) are never part of a training state: they come from the base model
    return StateDictOptions(ignore_frozen_params=True, **kwargs)


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one


def sharded_state(model, optimizer) -> dict:
    """This rank's shards of the trainable parameters and their optimizer state (DTensor / ShardedTensor
    values, keyed by parameter name), as DCP saves and loads them."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, _inner(optimizer), options=_options())
    return {"model": model_state, "optimizer": optimizer_state}


def save_sharded(model, optimizer, directory: Path) -> None:
    """Every rank writes its own shards into directory (collective); files are fsynced."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save(sharded_state(model, optimizer), storage_writer=FileSystemWriter(str(directory), sync_files=True))


def load_sharded(model, optimizer, directory: Path) -> None:
    """Every rank reads its own shards back into the model and optimizer (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = sharded_state(model, optimizer)  # the layout to fill in place
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(
        model,
        _inner(optimizer),
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_options(strict=False),  # strict would ask for the frozen base too
    )


def gather_trainable(model) -> dict:
    """The trainable parameters as full CPU tensors on rank 0 ({} elsewhere); collective. Only these are
    gathered: for LoRA the adapter, never the frozen base (FSDP's full state dict would gather it all first)."""
    from torch.distributed._state_dict_utils import _gather_state_dict
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    shards = get_model_state_dict(model, options=_options())
    return _gather_state_dict(shards, cpu_offload=True, ranks_only=(0,))


def stage_shards(accelerator, manager, step: int, write) -> Path:
    """Every rank writes its shards for checkpoint `step` into a staging directory beside the checkpoints
    (rank 0, which holds the manager, names and creates it) with write(directory), a collective (FSDP:
    ``save_sharded``; DeepSpeed: fineflow.train.zero.save_engine_state); returns it once every rank has written.
    Rank 0's manager then moves it into the checkpoint it publishes (CheckpointManager.save(sharded_dir=...))."""
    import shutil

    from accelerate.utils import broadcast_object_list

    from fineflow.checkpoint import step_dir_name

    named = [str(Path(manager.root) / f".tmp-shards-{step_dir_name(step)}") if manager is not None else None]
    staging = Path(broadcast_object_list(named)[0])  # .tmp-*: cleaned at start-up if a kill leaves it
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    require_visible_to_every_rank(accelerator, staging, f"write the shards of checkpoint step {step} into")
    write(staging)
    accelerator.wait_for_everyone()
    return staging


def require_visible_to_every_rank(accelerator, path: Path, purpose: str) -> None:
    """Every rank checks that it sees `path`, which rank 0 chose; if one does not, every rank raises the same
    FineflowError (one rank failing alone would leave the others waiting in the next collective)."""
    from accelerate.utils import gather_object

    from fineflow.errors import FineflowError

    if accelerator.num_processes == 1:
        return
    seen = gather_object([(accelerator.process_index, Path(path).exists())])
    blind = [rank for rank, ok in seen if not ok]
    if blind:
        raise FineflowError(
            f"rank(s) {blind} cannot see {path}, which rank 0 chose to {purpose}: the checkpoints directory "
            f"(train --checkpoints) must be shared storage that every node mounts at the same path (NFS, a "
            f"cluster filesystem); a node-local checkpoints/ cannot be resumed from or saved to by a multi-node run"
        )
