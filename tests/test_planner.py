"""The GPU memory planner (fineflow.train.planner) and ``fineflow plan``: formulas on known numbers, the order in
which auto_fit adapts a run, refusals, config loading and the CLI. Pure arithmetic: milliseconds."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
import tomllib
from dataclasses import replace

import pytest

from fineflow.cli import main
from fineflow.errors import FineflowError
from fineflow.train.planner import (
    KNOWN_SHAPES,
    LINEARS,
    QLORA_BYTES_PER_PARAM,
    DoesNotFit,
    GiB,
    ModelShape,
    Setup,
    activation_bytes,
    auto_fit,
    autocast_copy_bytes,
    check_fit,
    layer_activation_bytes,
    load_shape,
    logits_bytes,
    lora_params,
    plan,
    refusal,
    shape_from_config,
    shape_from_file,
    suggestions,
)

SEVEN_B = KNOWN_SHAPES["7B"]
# The bench's tiny model (bench/planner_accuracy.py): LlamaConfig(hidden 128, intermediate 384, 4 layers, 4 heads,
# vocab 1024, untied); transformers counts 1,115,264 parameters.
TINY = ModelShape(
    "tiny", hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=4, vocab_size=1024
)
LLAMA_3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
}
LLAMA_2_7B_CONFIG = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}


# ---------------------------------------------------------------- shapes and parameter counts


@pytest.mark.parametrize(
    "size, count",
    [
        ("1B", 1_235_814_400),
        ("7B", 6_738_415_616),
        ("8B", 8_030_261_248),
        ("13B", 13_015_864_320),
        ("70B", 70_553_706_496),
    ],
)
def test_known_shapes_have_the_published_parameter_counts(size, count):
    assert KNOWN_SHAPES[size].params == count


def test_parameter_count_matches_transformers_for_small_configs():
    # counted by transformers for the two models bench/planner_accuracy.py builds
    assert TINY.params == 1_115_264
    fifty_m = ModelShape("50M", 512, 1408, 8, 8, 8, 32000)
    assert fifty_m.params == 58_466_816


def test_lora_trainable_parameters_match_peft():
    # what peft's print_trainable_parameters() reports for Llama-2-7B at r=16
    assert lora_params(SEVEN_B, 16, ("q_proj", "v_proj")) == 8_388_608
    assert lora_params(SEVEN_B, 16, LINEARS) == 39_976_960
    # grouped-query attention: k/v adapters are narrower (Llama-3-8B, r=8, q and v)
    assert lora_params(KNOWN_SHAPES["8B"], 8, ("q_proj", "v_proj")) == 32 * 8 * ((4096 + 4096) + (4096 + 1024))


# ---------------------------------------------------------------- weights, gradients, optimizer states


def test_full_bf16_adamw_follows_the_mixed_precision_convention():
    p = SEVEN_B.params
    result = plan(SEVEN_B, Setup(method="full", precision="bf16", optimizer="adamw"))
    assert result.weights == 2 * p  # 16-bit working weights
    assert result.gradients == 2 * p  # 16-bit gradients
    assert result.optimizer_states == (8 + 4) * p  # fp32 exp_avg + exp_avg_sq, plus fp32 master weights


def test_full_fp32_has_no_master_copy():
    p = SEVEN_B.params
    result = plan(SEVEN_B, Setup(method="full", precision="fp32", optimizer="adamw"))
    assert (result.weights, result.gradients, result.optimizer_states) == (4 * p, 4 * p, 8 * p)


def test_optimizers_order_by_state_size():
    states = {
        opt: plan(SEVEN_B, Setup(method="full", optimizer=opt)).optimizer_states
        for opt in ("adamw", "adamw_8bit", "sgd")
    }
    p = SEVEN_B.params
    assert states["sgd"] == (4 + 4) * p  # momentum + master weights
    assert 6 * p < states["adamw_8bit"] < 6.1 * p  # two 1-byte states + block constants + master weights
    assert states["adamw_8bit"] < states["sgd"] < states["adamw"]


def test_lora_is_much_smaller_than_full():
    full = plan(SEVEN_B, Setup(method="full"))
    lora = plan(SEVEN_B, Setup(method="lora"))
    assert lora.gradients + lora.optimizer_states < 0.01 * (full.gradients + full.optimizer_states)
    assert lora.total < full.total / 3
    # adapters are fp32: 4 bytes of weight, 4 of gradient, 8 of AdamW state per adapter parameter
    assert lora.gradients == 4 * lora.trainable_params and lora.optimizer_states == 8 * lora.trainable_params


@pytest.mark.parametrize("size", ["7B", "70B"])
def test_qlora_holds_4bit_linears_and_fp32_for_everything_else(size):
    # peft's prepare_model_for_kbit_training upcasts embeddings, lm_head and norms to fp32 (tests/test_precision.py
    # checks that layout on a real model); bitsandbytes dequantizes one linear at a time in the compute dtype
    shape, setup = KNOWN_SHAPES[size], Setup(method="qlora")
    linears = shape.num_layers * shape.linear_params_per_layer
    expected = (
        linears * QLORA_BYTES_PER_PARAM
        + (shape.params - linears) * 4
        + lora_params(shape, setup.lora_r, LINEARS) * 4
        + shape.max_linear_params * 2
    )
    assert plan(shape, setup).weights == pytest.approx(expected)
    ratio = plan(shape, setup).weights / plan(shape, Setup(method="lora")).weights
    assert 0.25 < ratio < 0.36  # about a quarter of the bf16 base, more where the vocabulary is large


def test_a_7b_lora_base_is_counted_in_the_dtype_it_is_held_in():
    # the frozen base's bytes follow the dtype it is held in: 12.7 GiB for a 7B LoRA in bf16, 25.3 GiB in fp32
    p, adapters = SEVEN_B.params, lora_params(SEVEN_B, 16, LINEARS)
    bf16_base = plan(SEVEN_B, Setup(method="lora", precision="bf16"))
    fp32_base = plan(SEVEN_B, Setup(method="lora", precision="bf16", weight_storage="fp32"))
    assert bf16_base.weights == 2 * p + 4 * adapters and f"{bf16_base.weights / GiB:.1f}" == "12.7"
    assert fp32_base.weights == 4 * p + 4 * adapters and f"{fp32_base.weights / GiB:.1f}" == "25.3"
    # under autocast the fp32 base's 16-bit copies stay alive from forward to backward: every linear (but layer 0's
    # q/k/v, whose input needs no gradient) and lm_head; 12.2 GiB more at the start of backward
    h, layer = SEVEN_B.hidden_size, SEVEN_B.linear_params_per_layer
    copies = (SEVEN_B.num_layers * layer - 3 * h * h + SEVEN_B.vocab_size * h) * 2
    assert autocast_copy_bytes(SEVEN_B, fp32_base.setup) == copies and f"{copies / GiB:.1f}" == "12.2"
    assert fp32_base.activations - bf16_base.activations == copies
    # with checkpointing one recomputed layer's copies at a time (larger than lm_head's here)
    checkpointed = replace(fp32_base.setup, gradient_checkpointing=True)
    assert autocast_copy_bytes(SEVEN_B, checkpointed) == layer * 2
    assert autocast_copy_bytes(SEVEN_B, bf16_base.setup) == 0


def test_the_train_stage_plans_the_layout_build_model_loads(tmp_path):
    """fit_plan (what the launcher checks) sets the layout from fineflow.train.precision, as build_model loads it:
    a 7B LoRA in bf16 holds a bf16 base (12.7 GiB); full fine-tuning under DDP autocast holds fp32 weights."""
    from fineflow.core.config import parse_params
    from fineflow.train.precision import base_dtype
    from fineflow.train.profile import load_profile
    from fineflow.train.run_plan import fit_plan
    from tests.conftest import TINY_PARAMS, _merge

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_2_7B_CONFIG))

    def stage_plan(method):
        train = {"method": method, "precision": "bf16", "device_memory_gib": 4096, "lora": {"r": 16}}
        params = parse_params(_merge(TINY_PARAMS, {"train": train}))
        return fit_plan(params, load_profile(params.train.accelerate_profile), str(tmp_path), has_gpu=False).memory

    p = SEVEN_B.params
    lora = stage_plan("lora")
    assert base_dtype("lora", "bf16", "none") == "bfloat16"
    assert lora["bytes"]["weights"] == 2 * p + 4 * lora_params(SEVEN_B, 16, LINEARS)
    assert lora["gib"]["weights"] == pytest.approx(12.7, abs=0.005)
    full = stage_plan("full")
    assert base_dtype("full", "bf16", "none") == "float32" and full["setup"]["weight_storage"] == "fp32"
    assert (full["bytes"]["weights"], full["bytes"]["gradients"], full["bytes"]["optimizer_states"]) == (
        4 * p,
        4 * p,
        8 * p,
    )


def test_full_fine_tuning_under_autocast_keeps_copies_even_with_checkpointing():
    # autocast caches the 16-bit copy of a trainable (leaf) weight until forward ends, checkpointing or not
    fp32 = Setup(method="full", precision="bf16", weight_storage="fp32", gradient_checkpointing=True)
    copies = (SEVEN_B.num_layers * SEVEN_B.linear_params_per_layer + SEVEN_B.vocab_size * SEVEN_B.hidden_size) * 2
    assert autocast_copy_bytes(SEVEN_B, fp32) == copies
    assert autocast_copy_bytes(SEVEN_B, replace(fp32, precision="fp32")) == 0
    assert autocast_copy_bytes(SEVEN_B, replace(fp32, num_gpus=8, sharding="fsdp")) == 0  # FSDP gathers 16-bit


# ---------------------------------------------------------------- activations


def test_layer_activations_on_hand_computed_numbers():
    # fp32, full, SDPA, per token of one layer: two RMSNorms 2*(4h + 4h), linear inputs 4*(3h + i),
    # q, k, v and SDPA output 4*4h, logsumexp 4*a, SwiGLU 3*4*i  ->  1024+1024 + 3072 + 2048+16 + 4608
    setup = Setup(method="full", precision="fp32", micro_batch_size=8, seq_len=256, packed=False)
    per_token = (1024 + 1024) + (1536 + 1536) + (2048 + 16) + 4608
    assert per_token == 11792
    assert layer_activation_bytes(TINY, setup) == 8 * 256 * per_token


def test_packed_rows_keep_an_attention_mask_per_layer():
    plain = Setup(method="full", precision="bf16", micro_batch_size=4, seq_len=2048, packed=False)
    packed = replace(plain, packed=True)
    assert layer_activation_bytes(SEVEN_B, packed) - layer_activation_bytes(SEVEN_B, plain) == 4 * 2048 * 2048 * 2
    # grouped-query k/v: expanded to all heads once a mask is passed (repeat_kv), kept narrow without one
    eight_b, one = KNOWN_SHAPES["8B"], replace(plain, micro_batch_size=1, seq_len=1)
    expanded = layer_activation_bytes(eight_b, replace(one, packed=True)) - 2  # minus the 1x1 mask
    assert expanded - layer_activation_bytes(eight_b, one) == 2 * 2 * (4096 - 1024)


def test_korthikanti_quadratic_term_appears_only_with_eager_attention():
    sdpa = Setup(method="full", precision="bf16", micro_batch_size=2, seq_len=1024, packed=False)
    eager = replace(sdpa, attention="eager")
    b, s, a, h = 2, 1024, SEVEN_B.num_heads, SEVEN_B.hidden_size
    # eager keeps the fp32 softmax and its 16-bit cast (4 + 2 bytes per score) and no SDPA output/logsumexp
    difference = layer_activation_bytes(SEVEN_B, eager) - layer_activation_bytes(SEVEN_B, sdpa)
    assert difference == b * s * (a * s * 6 - 2 * h - 4 * a)
    # with SDPA the cost is linear in the sequence; eager is super-linear
    longer = replace(sdpa, seq_len=2048)
    assert layer_activation_bytes(SEVEN_B, longer) == 2 * layer_activation_bytes(SEVEN_B, sdpa)
    assert layer_activation_bytes(SEVEN_B, replace(eager, seq_len=2048)) > 2.5 * layer_activation_bytes(SEVEN_B, eager)


def test_logits_are_three_fp32_vocabulary_tensors():
    setup = Setup(micro_batch_size=4, seq_len=2048)
    assert logits_bytes(KNOWN_SHAPES["8B"], setup) == 4 * 2048 * 128256 * 4 * 3


def test_gradient_checkpointing_keeps_only_layer_inputs():
    setup = Setup(method="lora", micro_batch_size=4, seq_len=2048)
    plain = activation_bytes(SEVEN_B, setup)
    checkpointed = activation_bytes(SEVEN_B, replace(setup, gradient_checkpointing=True))
    assert checkpointed < 0.15 * plain
    tokens, layer = 4 * 2048, layer_activation_bytes(SEVEN_B, setup)
    head = tokens * 4 * SEVEN_B.hidden_size  # final norm's fp32 input (frozen norm, frozen lm_head)
    kept = SEVEN_B.num_layers * tokens * 2 * SEVEN_B.hidden_size  # one bf16 hidden state per layer
    working = tokens * 2 * (SEVEN_B.hidden_size + 2 * SEVEN_B.intermediate_size)  # gradients in one layer
    assert checkpointed == kept + head + max(logits_bytes(SEVEN_B, setup), layer + working)


def test_lora_on_a_16bit_base_keeps_a_copy_of_the_input_per_adapter():
    # peft casts each adapted linear's input to the adapter dtype: q, k and v no longer share one tensor
    qkv = Setup(method="lora", lora_targets=("q_proj", "k_proj", "v_proj"), micro_batch_size=1, seq_len=1)
    q_only = replace(qkv, lora_targets=("q_proj",))
    assert layer_activation_bytes(SEVEN_B, qkv) - layer_activation_bytes(SEVEN_B, q_only) == 2 * 2 * SEVEN_B.hidden_size
    # in fp32 there is no cast: the three share the norm's output
    assert layer_activation_bytes(SEVEN_B, replace(qkv, precision="fp32")) == layer_activation_bytes(
        SEVEN_B, replace(q_only, precision="fp32")
    )


# ---------------------------------------------------------------- sharding


def test_zero2_divides_gradients_and_optimizer_states_only():
    single = plan(KNOWN_SHAPES["13B"], Setup(method="full"))
    zero2 = plan(KNOWN_SHAPES["13B"], Setup(method="full", num_gpus=8, sharding="zero2"))
    assert zero2.weights == single.weights
    assert zero2.gradients == single.gradients / 8
    assert zero2.optimizer_states == single.optimizer_states / 8


def test_fsdp_divides_everything_but_holds_the_gathered_layers():
    single = plan(KNOWN_SHAPES["13B"], Setup(method="full"))
    fsdp = plan(KNOWN_SHAPES["13B"], Setup(method="full", num_gpus=8, sharding="fsdp"))
    assert fsdp.optimizer_states == single.optimizer_states / 8 and fsdp.gradients == single.gradients / 8
    assert single.weights / 8 < fsdp.weights < single.weights / 4
    assert fsdp.activations == single.activations  # each rank runs its own micro-batch
    assert plan(KNOWN_SHAPES["13B"], Setup(method="full", num_gpus=8, sharding="zero3")).total == fsdp.total


def test_ddp_replicates_and_adds_gradient_buckets():
    single = plan(SEVEN_B, Setup(method="full"))
    ddp = plan(SEVEN_B, Setup(method="full", num_gpus=8))
    assert ddp.weights == single.weights and ddp.optimizer_states == single.optimizer_states
    assert ddp.gradients == 2 * single.gradients
    assert ddp.overhead > single.overhead  # NCCL buffers


# ---------------------------------------------------------------- fits, auto_fit, refusal


def test_fits_compares_the_total():
    result = plan(SEVEN_B, Setup())
    assert result.fits(result.total) and not result.fits(result.total - 1)
    assert result.total == pytest.approx(
        result.weights + result.gradients + result.optimizer_states + result.activations + result.overhead
    )


def test_auto_fit_leaves_a_fitting_run_alone():
    setup = Setup(micro_batch_size=2, seq_len=1024)
    fitted = auto_fit(SEVEN_B, setup, 80 * GiB)
    assert fitted.setup == setup and fitted.changes == []


def test_auto_fit_enables_checkpointing_first():
    setup = Setup(micro_batch_size=8, seq_len=2048)
    budget = plan(SEVEN_B, replace(setup, gradient_checkpointing=True)).total + GiB
    assert not plan(SEVEN_B, setup).fits(budget)
    fitted = auto_fit(SEVEN_B, setup, budget)
    assert fitted.setup == replace(setup, gradient_checkpointing=True)
    assert len(fitted.changes) == 1 and "gradient_checkpointing: false -> true" in fitted.changes[0]


def test_auto_fit_then_halves_the_micro_batch_keeping_the_global_batch():
    setup = Setup(method="full", micro_batch_size=8, grad_accum=1, seq_len=4096)
    shape = KNOWN_SHAPES["1B"]
    two = plan(shape, replace(setup, gradient_checkpointing=True, micro_batch_size=2)).total
    four = plan(shape, replace(setup, gradient_checkpointing=True, micro_batch_size=4)).total
    fitted = auto_fit(shape, setup, (two + four) / 2)
    assert (fitted.setup.gradient_checkpointing, fitted.setup.micro_batch_size, fitted.setup.grad_accum) == (True, 2, 4)
    assert fitted.setup.global_batch == setup.global_batch
    assert [c.split(":")[0] for c in fitted.changes] == [
        "train.gradient_checkpointing",
        "train.micro_batch_size",
        "train.micro_batch_size",
    ]
    assert "8 -> 4" in fitted.changes[1] and "4 -> 2" in fitted.changes[2]


def test_auto_fit_steps_an_odd_micro_batch_through_its_divisors():
    setup = Setup(micro_batch_size=6, seq_len=4096)
    smallest = plan(SEVEN_B, replace(setup, gradient_checkpointing=True, micro_batch_size=1)).total
    fitted = auto_fit(SEVEN_B, setup, smallest)
    assert (fitted.setup.micro_batch_size, fitted.setup.grad_accum) == (1, 6)  # 6 -> 3 -> 1


def test_auto_fit_refuses_when_nothing_it_may_change_is_enough():
    with pytest.raises(DoesNotFit) as info:
        auto_fit(SEVEN_B, Setup(method="lora", micro_batch_size=4), 10 * GiB)
    message = str(info.value)
    assert isinstance(info.value, FineflowError)
    assert "needs" in message and "device has 10.0 GiB" in message and "train.method: qlora" in message


def test_refusal_names_the_largest_micro_batch_that_fits():
    shape, setup = KNOWN_SHAPES["1B"], Setup(method="lora", micro_batch_size=8, seq_len=2048)
    two, three = (plan(shape, replace(setup, micro_batch_size=m)).total for m in (2, 3))
    budget = (two + three) / 2
    message = refusal(shape, setup, budget)
    assert message.startswith(
        f"Llama-3.2-1B (lora) needs {plan(shape, setup).total / GiB:.1f} GiB per device, "
        f"device has {budget / GiB:.1f} GiB: "
    )
    assert "set train.micro_batch_size <= 2 " in message and "set train.gradient_checkpointing: true" in message


def test_check_fit_refuses_or_adapts():
    setup = Setup(micro_batch_size=8, seq_len=2048)
    budget = plan(SEVEN_B, replace(setup, gradient_checkpointing=True)).total + GiB
    with pytest.raises(DoesNotFit, match="set train.gradient_checkpointing: true"):
        check_fit(SEVEN_B, setup, budget, adapt=False)
    assert check_fit(SEVEN_B, setup, budget, adapt=True).setup.gradient_checkpointing


def test_invalid_settings_are_reported_together():
    with pytest.raises(FineflowError) as info:
        Setup(method="lora", precision="fp8", micro_batch_size=0, lora_targets=())
    message = str(info.value)
    assert "precision must be one of bf16, fp16, fp32" in message
    assert "micro_batch_size must be >= 1 (got 0)" in message and "lora_targets must name at least one" in message


def test_a_lora_target_the_model_lacks_is_refused_with_its_own_linears():
    with pytest.raises(FineflowError, match="no such linear: theirs are q_proj, k_proj, v_proj, o_proj"):
        plan(SEVEN_B, Setup(lora_targets=("qkv",)))


# ---------------------------------------------------------------- the linears come from the model (issue 30, 1)

PHI_3_MINI_CONFIG = {  # microsoft/Phi-3-mini-4k-instruct config.json
    "model_type": "phi3",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32064,
    "tie_word_embeddings": False,
}


def _peft_trainable(config: dict, target_modules) -> int:
    """What peft really adds on this architecture: a 2-layer copy built on the meta device, scaled to every layer."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    layers = {k: v for k, v in config.items() if k != "model_type"}
    built = AutoConfig.for_model(config["model_type"], **{**layers, "num_hidden_layers": 2})
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(built), LoraConfig(r=8, target_modules=target_modules))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable // 2 * config["num_hidden_layers"]


def test_seen_on_main_phi3_lora_was_counted_on_llamas_separate_linears():
    # main planned Phi-3 with Llama's q/k/v and gate/up as separate linears: one adapter per name, 3*r*h too many
    # parameters per layer (counted 14,942,208 at r=8 where peft adds 12,582,912), and "qkv_proj" was refused
    phi3 = shape_from_config(PHI_3_MINI_CONFIG)
    assert phi3.params == 3_821_079_552  # the published 3.8B
    assert dict(phi3.linear_dims())["qkv_proj"] == (3072, 3 * 3072)
    assert lora_params(phi3, 8, LINEARS) == _peft_trainable(PHI_3_MINI_CONFIG, "all-linear") == 12_582_912
    own_names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert lora_params(phi3, 8, ("all-linear",)) == lora_params(phi3, 8, own_names)
    assert lora_params(phi3, 8, ("q_proj", "v_proj")) == _peft_trainable(PHI_3_MINI_CONFIG, ["qkv_proj"])


def test_seen_on_main_the_train_stage_planned_llamas_linears_for_phi3s_own_target_names(tmp_path):
    # main's sizing kept only target names in Llama's list: train.lora.target_modules [qkv_proj] on a Phi-3 base was
    # planned as adapters on all seven Llama linears (14,942,208 parameters at r=8 on the config below)
    from fineflow.core.config import parse_params
    from tests.conftest import TINY_PARAMS, _merge

    (tmp_path / "config.json").write_text(json.dumps(PHI_3_MINI_CONFIG))
    train = {"precision": "bf16", "device_memory_gib": 4096, "lora": {"r": 8, "target_modules": ["qkv_proj"]}}
    params = parse_params(_merge(TINY_PARAMS, {"train": train}))
    memory = _stage_plan(params, tmp_path).memory
    assert memory["trainable_params"] == _peft_trainable(PHI_3_MINI_CONFIG, ["qkv_proj"]) == 32 * 8 * (3072 + 9216)


def test_llama_layouts_are_described_as_the_known_sizes():
    assert shape_from_config(LLAMA_3_8B_CONFIG).linears == () and lora_params(
        shape_from_config(LLAMA_3_8B_CONFIG), 8, ("all-linear",)
    ) == _peft_trainable(LLAMA_3_8B_CONFIG, "all-linear")


def test_a_fused_linear_keeps_one_input_for_its_adapter():
    phi3 = shape_from_config(PHI_3_MINI_CONFIG)
    fp32 = Setup(precision="fp32", micro_batch_size=1, seq_len=1, lora_targets=("q_proj", "k_proj", "v_proj"))
    llama_layout = replace(phi3, linears=())
    # in fp32 q/k/v share the one input they read; fused or not, one copy of it
    assert layer_activation_bytes(phi3, fp32) == layer_activation_bytes(llama_layout, fp32)
    bf16 = replace(fp32, precision="bf16")  # under autocast each adapter keeps its own 16-bit copy: one, not three
    assert layer_activation_bytes(llama_layout, bf16) - layer_activation_bytes(phi3, bf16) == 2 * 2 * 3072


# ---------------------------------------------------------------- loading a shape


def test_config_json_and_model_dir_give_the_known_shape(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B_CONFIG))
    for reference in (tmp_path / "config.json", tmp_path):
        shape = shape_from_file(reference)
        assert replace(shape, name="") == replace(KNOWN_SHAPES["8B"], name="")
        assert shape.params == 8_030_261_248
    assert load_shape(str(tmp_path)).params == 8_030_261_248


def test_config_reads_text_config_head_dim_and_defaults():
    nested = {"model_type": "llava", "text_config": {**LLAMA_3_8B_CONFIG, "head_dim": 256}}
    shape = shape_from_config(nested)
    assert shape.q_dim == 32 * 256 and shape.kv_dim == 8 * 256
    bare = {k: v for k, v in LLAMA_3_8B_CONFIG.items() if k not in ("num_key_value_heads", "tie_word_embeddings")}
    assert shape_from_config(bare).num_kv_heads == 32 and not shape_from_config(bare).tie_word_embeddings


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"n_embd": 768, "n_layer": 12}, "missing hidden_size, intermediate_size"),
        ({**LLAMA_3_8B_CONFIG, "num_local_experts": 8}, "mixture-of-experts"),
    ],
)
def test_unsupported_configs_are_refused_clearly(config, fragment):
    with pytest.raises(FineflowError, match=fragment):
        shape_from_config(config)


def test_unreadable_model_references_are_clear(tmp_path):
    with pytest.raises(FineflowError, match="no config.json there"):
        shape_from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(FineflowError, match="cannot read the model config"):
        shape_from_file(tmp_path)
    with pytest.raises(FineflowError, match="no standard shape near 3.00B"):
        load_shape("3B")


@pytest.mark.parametrize(
    "reference, name",
    [
        ("7b", "Llama-2-7B"),
        ("6.7e9", "Llama-2-7B"),
        ("8B", "Llama-3-8B"),
        ("1500M", "Llama-3.2-1B"),
        ("70B", "Llama-3-70B"),
    ],
)
def test_sizes_and_counts_resolve_to_known_shapes(reference, name):
    assert load_shape(reference).name == name


# ---------------------------------------------------------------- the CLI


def test_table_prints_every_size_and_method(capsys):
    assert main(["plan", "--table", "--device-gib", "80"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("Llama-")]
    assert len(rows) == 15
    for shape in KNOWN_SHAPES.values():
        assert [r.split()[2] for r in rows if r.split()[0] == shape.name] == ["full", "lora", "qlora"]
    seven_full = next(r for r in rows if r.startswith("Llama-2-7B") and " full " in r).split()
    assert float(seven_full[3]) == pytest.approx(2 * SEVEN_B.params / GiB, abs=0.05)  # weights column
    assert seven_full[-1] == "no" and rows[1].split()[-1] == "yes"  # 7B full needs > 80 GiB; 1B lora fits


def test_plan_prints_a_breakdown_and_exit_status_says_whether_it_fits(capsys):
    assert main(["plan", "--model", "7B", "--method", "qlora", "--micro-batch", "1", "--device-gib", "80"]) == 0
    out = capsys.readouterr().out
    for label in ("weights", "gradients", "optimizer states", "activations", "overhead", "total", "fits in 80.0 GiB"):
        assert label in out
    assert main(["plan", "--model", "70B", "--method", "full", "--device-gib", "80"]) == 1
    assert "to fit: " in capsys.readouterr().out


def test_plan_auto_fit_and_json(capsys):
    args = ["plan", "--model", "7B", "--micro-batch", "8", "--seq-len", "2048", "--device-gib", "40"]
    assert main(args + ["--auto-fit", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True and data["setup"]["gradient_checkpointing"] is True
    assert data["changes"] and data["gib"]["total"] <= 40
    assert data["bytes"]["total"] == round(plan(SEVEN_B, Setup(**{**data["setup"], "lora_targets": LINEARS})).total)


def test_plan_reads_a_config_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_3_8B_CONFIG))
    assert main(["plan", "--model", str(path), "--method", "full"]) == 0
    assert "8.03B parameters" in capsys.readouterr().out


def test_plan_bad_input_is_one_line_and_status_2(capsys):
    assert main(["plan", "--model", "gpt-five"]) == 2
    assert "fineflow plan: error: --model 'gpt-five' is neither a known size" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fineflow.cli", "plan", "--model", "1B"])
    monkeypatch.delitem(sys.modules, "fineflow.cli", raising=False)  # run it fresh, as python -m does
    with pytest.raises(SystemExit) as info:
        runpy.run_module("fineflow.cli", run_name="__main__")
    assert info.value.code == 0 and "Llama-3.2-1B" in capsys.readouterr().out


def test_console_script_is_declared():
    from tests.conftest import ROOT

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fineflow"] == "fineflow.cli:main"


def test_planner_and_cli_import_nothing_heavy():
    code = (
        "import sys, fineflow.cli, fineflow.train.planner; "
        "print(sorted({'torch', 'transformers', 'pydantic'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- what the run really does (issue 30, 5 and 2)


def _eight_b_lora(**changes) -> Setup:
    return replace(Setup(method="lora", precision="bf16", micro_batch_size=2, seq_len=4096), **changes)


@pytest.mark.parametrize("attention", ["varlen", "flash_attention_2"])
def test_per_example_attention_is_sized_without_the_mask_and_the_expanded_kv(attention):
    """varlen and flash attend per example: no b*s*s mask and no k/v expanded to every head (repeat_kv) in
    any layer; transformers' sdpa over packed rows keeps both (+5.5 GiB at 8B, micro-batch 2, 4,096 tokens)."""
    eight_b = KNOWN_SHAPES["8B"]
    dense, per_example = plan(eight_b, _eight_b_lora()), plan(eight_b, _eight_b_lora(attention=attention))
    b, s, p = 2, 4096, 2
    mask, expanded_kv = b * s * s * p, b * s * 2 * p * (eight_b.q_dim - eight_b.kv_dim)
    assert dense.activations - per_example.activations == eight_b.num_layers * (mask + expanded_kv)
    assert (dense.activations - per_example.activations) / GiB == pytest.approx(5.0, abs=0.01)
    assert (dense.total - per_example.total) / GiB == pytest.approx(5.5, abs=0.05)  # with 10% fragmentation


def test_the_cli_sizes_the_attention_and_the_base_dtype_it_is_given(capsys):
    common = ["plan", "--model", "8B", "--micro-batch", "2", "--seq-len", "4096", "--json"]
    totals, weights = {}, {}
    for kind in ("sdpa", "varlen", "flash"):
        assert main([*common, "--attention", kind]) == 0
        out = json.loads(capsys.readouterr().out)
        totals[kind], weights[kind] = out["bytes"]["total"], out["bytes"]["weights"]
        assert out["setup"]["attention"] == ("flash_attention_2" if kind == "flash" else kind)
    assert totals["varlen"] == totals["flash"] < totals["sdpa"]
    assert main([*common, "--base-dtype", "fp32"]) == 0
    fp32_base = json.loads(capsys.readouterr().out)
    assert fp32_base["setup"]["weight_storage"] == "fp32"
    assert fp32_base["bytes"]["weights"] > 1.9 * weights["sdpa"]  # 4 bytes per base parameter, not 2


def _stage_params(tmp_path, **train):
    from fineflow.core.config import parse_params
    from tests.conftest import TINY_PARAMS, _merge

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B_CONFIG))
    settings = {"precision": "bf16", "device_memory_gib": 4096, "micro_batch_size": 2, **train}
    return parse_params(_merge(TINY_PARAMS, {"tokenize": {"seq_len": 4096}, "train": settings}))


def _stage_plan(params, tmp_path):
    from fineflow.train.profile import load_profile
    from fineflow.train.run_plan import fit_plan

    return fit_plan(params, load_profile(params.train.accelerate_profile), str(tmp_path), has_gpu=False)


def test_the_train_stage_sizes_its_attention_kind(tmp_path):
    plans = {kind: _stage_plan(_stage_params(tmp_path, attention=kind), tmp_path).memory for kind in ("sdpa", "varlen")}
    assert plans["varlen"]["setup"]["attention"] == "varlen" and plans["varlen"]["setup"]["packed"]
    eight_b = shape_from_config(LLAMA_3_8B_CONFIG)
    b, s, p = 2, 4096, 2
    per_layer = b * s * s * p + b * s * 2 * p * (eight_b.q_dim - eight_b.kv_dim)
    assert plans["sdpa"]["bytes"]["activations"] - plans["varlen"]["bytes"]["activations"] == pytest.approx(
        eight_b.num_layers * per_layer, abs=2
    )


def _keys_named(text: str) -> set[str]:
    import re

    return set(re.findall(r"\b(?:train|tokenize|model)\.[a-z_]+(?:\.[a-z_]+)?", text))


def _is_a_params_key(key: str) -> bool:
    from fineflow.core.config import Params

    model = Params
    for part in key.split("."):
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return False
        model = fields[part].annotation
    return True


def test_every_key_the_advice_names_exists_in_params():
    from fineflow.train.planner import PARAM_KEYS

    texts = list(PARAM_KEYS.values())
    seventy = KNOWN_SHAPES["70B"]
    for method in ("full", "lora"):  # multi-GPU DDP runs too big for a card: the advice suggests sharding
        setup = Setup(method=method, micro_batch_size=4, seq_len=4096, num_gpus=8)
        texts += suggestions(seventy, setup, 80 * GiB)
        texts.append(refusal(seventy, setup, 80 * GiB))
    named = set().union(*map(_keys_named, texts))
    assert [key for key in sorted(named) if not _is_a_params_key(key)] == []
    assert "train.accelerate_profile" in named  # the sharding advice was produced, naming the profile


def test_a_real_base_with_the_embedded_models_learning_rate_is_warned_about(tmp_path):
    """params.yaml's lr (3e-3) suits the 1M-parameter embedded model; on an 8B LoRA it is 15-30x the usual rate."""
    params = _stage_params(tmp_path, lr=3e-3)
    params = params.model_copy(update={"model": params.model.model_copy(update={"base": str(tmp_path)})})
    run = _stage_plan(params, tmp_path)
    assert len(run.warnings) == 1 and run.memory["warnings"] == list(run.warnings)
    assert "train.lr 0.003" in run.warnings[0] and "1e-4" in run.warnings[0]
    usual = params.model_copy(update={"train": params.train.model_copy(update={"lr": 2e-4})})
    assert _stage_plan(usual, tmp_path).warnings == ()
    too_big = params.model_copy(update={"train": params.train.model_copy(update={"device_memory_gib": 40})})
    with pytest.raises(DoesNotFit, match=r"train.gradient_checkpointing: true.*also: params.yaml train.lr 0.003"):
        _stage_plan(too_big, tmp_path)  # a refusal says it too: fixing the memory alone would leave the lr
    embedded = _stage_params(tmp_path, lr=3e-3)  # the embedded model takes the high rate: no warning
    assert embedded.model.base == "embedded" and _stage_plan(embedded, tmp_path).warnings == ()


def test_fused_lora_with_dropout_is_warned_about(tmp_path):
    """Seen running SmolLM2 with a practitioner's lora.dropout 0.05: fused LoRA computes no dropout, so every layer
    silently took peft's forward (the report said fused_lora_layers: 0, nothing else)."""
    params = _stage_params(tmp_path)
    lora = params.train.lora.model_copy(update={"dropout": 0.05})
    dropped = params.model_copy(update={"train": params.train.model_copy(update={"lora": lora})})
    run = _stage_plan(dropped, tmp_path)
    assert [w for w in run.warnings if "train.fused_lora" in w and "lora.dropout 0.05" in w]
    assert _stage_plan(params, tmp_path).warnings == ()  # dropout 0: fused, nothing to say
    unfused = dropped.model_copy(update={"train": dropped.train.model_copy(update={"fused_lora": False})})
    assert _stage_plan(unfused, tmp_path).warnings == ()  # asked for peft's forward: nothing to say


@pytest.mark.parametrize("method", ["lora", "full"])
def test_the_chunked_loss_is_sized_one_chunk_of_logits_at_a_time(method):
    """train.loss_chunk_tokens: the loss's fp32 (rows x vocab) tensors hold one chunk of rows, plus the hidden
    states' gradient it keeps from forward to backward (and, for full fine-tuning, the head's fp32 gradient)."""
    eight_b = KNOWN_SHAPES["8B"]
    whole, chunked = _eight_b_lora(method=method), _eight_b_lora(method=method, loss_chunk_tokens=1024)
    tokens, p = 2 * 4096, 2
    assert logits_bytes(eight_b, whole) == tokens * eight_b.vocab_size * 4 * 3
    head_grad = eight_b.vocab_size * eight_b.hidden_size * 4 if method == "full" else 0
    expected = 1024 * eight_b.vocab_size * 4 * 3 + tokens * eight_b.hidden_size * p + head_grad
    assert logits_bytes(eight_b, chunked) == expected
    assert plan(eight_b, chunked).total < plan(eight_b, whole).total
    # a chunk as large as the micro-batch's tokens is the plain path
    assert logits_bytes(eight_b, _eight_b_lora(loss_chunk_tokens=tokens)) == logits_bytes(eight_b, whole)


def test_the_train_stage_and_the_cli_size_the_chunked_loss(capsys):
    from fineflow.core.config import Params
    from fineflow.train.profile import load_profile
    from fineflow.train.run_plan import planner_setup

    params = Params.model_validate({"train": {"loss_chunk_tokens": 256}})
    setup = planner_setup(params, load_profile("auto"), "no", 1)
    assert setup.loss_chunk_tokens == 256
    common = ["plan", "--model", "8B", "--micro-batch", "2", "--seq-len", "4096", "--json"]
    totals = {}
    for chunk in ("0", "1024"):
        assert main([*common, "--loss-chunk-tokens", chunk]) == 0
        totals[chunk] = json.loads(capsys.readouterr().out)["bytes"]["total"]
    assert totals["1024"] < totals["0"]
    with pytest.raises(FineflowError, match="loss_chunk_tokens must be >= 0"):
        _eight_b_lora(loss_chunk_tokens=-1)


# ---------------------------------------------------------------- the recipes' hub ids, sized without downloading


@pytest.mark.parametrize(
    "hub_id, published",
    [  # parameter counts as the hub's safetensors metadata states them
        ("meta-llama/Llama-3.1-8B-Instruct", 8_030_261_248),
        ("meta-llama/Llama-3.1-70B-Instruct", 70_553_706_496),
        ("Qwen/Qwen2.5-7B-Instruct", 7_615_616_512),  # q/k/v biases not counted: 129,024
        ("Qwen/Qwen3-8B", 8_190_735_360),  # q/k norms not counted: 9,216
        ("mistralai/Mistral-7B-Instruct-v0.3", 7_248_023_552),
        ("google/gemma-2-9b-it", 9_241_705_984),  # Gemma 2's extra per-layer norms not counted: 301,056
        ("microsoft/Phi-3-mini-4k-instruct", 3_821_079_552),
    ],
)
def test_hub_ids_plan_their_real_shape(hub_id, published):
    shape = load_shape(hub_id)
    assert shape.name == hub_id and abs(shape.params - published) / published < 1e-4


def test_gemma2s_soft_capped_logits_are_sized_whole():
    gemma = load_shape("google/gemma-2-9b-it")
    setup = Setup(micro_batch_size=2, seq_len=2048, loss_chunk_tokens=1024)
    assert not gemma.chunked_loss and load_shape("Qwen/Qwen3-8B").chunked_loss
    assert (
        logits_bytes(gemma, setup) == 2 * 2048 * 256_000 * 4 * 3
    )  # the plain path fineflow.objectives.token_loss takes


def test_the_cli_plans_a_recipes_hub_id_offline(capsys):
    assert main(["plan", "--model", "microsoft/Phi-3-mini-4k-instruct", "--lora-r", "8", "--device-gib", "24"]) == 0
    out = capsys.readouterr().out
    assert "3.82B parameters, lora r=8 on all-linear, 12,582,912 trainable" in out
