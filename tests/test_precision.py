"""One precision source (fineflow.train.precision): the rule between train.precision, the accelerate profile and the
device; the dtypes build_model loads for it, checked by dtype accounting against the memory planner's weight term
(fp32, bf16, and the QLoRA layout with peft's real kbit preparation); QLoRA's bitsandbytes and checkpointing
arguments; fused LoRA on a bf16 base. CPU only, a ~30k-parameter model: a few seconds."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from fineflow.errors import FineflowError
from fineflow.train import planner
from fineflow.train.precision import (
    PrecisionChoice,
    base_dtype,
    check_qlora_sharding,
    choose_precision,
    kbit_preparation_kwargs,
    quantization_kwargs,
    resolve_precision,
    weight_storage,
)
from fineflow.train.profile import load_profile, profile_mixed_precision
from tests.conftest import TINY_PARAMS, _merge

PROFILE = Path("configs/accelerate/multi_gpu_ddp.yaml")


def _fit_plan(params, base: str):
    """fit_plan as a rank on this CPU machine calls it: with the params' profile, read once."""
    from fineflow.train.run_plan import fit_plan

    return fit_plan(params, load_profile(params.train.accelerate_profile), base, has_gpu=False)


# ---------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    "param, profile, gpu_bf16, has_gpu, expected, source",
    [
        ("auto", None, False, False, "no", "device (no GPU)"),
        ("auto", None, True, True, "bf16", "device (GPU supports bf16)"),
        ("auto", None, False, True, "no", "device (GPU without bf16)"),  # fp16 is never chosen for the user
        ("auto", "bf16", False, False, "bf16", f"profile {PROFILE}"),
        ("auto", "fp16", True, True, "fp16", f"profile {PROFILE}"),
        ("auto", "no", True, True, "no", f"profile {PROFILE}"),
        ("bf16", None, False, False, "bf16", "train.precision"),
        ("no", None, True, True, "no", "train.precision"),
        ("fp16", "fp16", True, True, "fp16", "train.precision"),
    ],
)
def test_auto_takes_the_profile_then_the_device_and_an_explicit_value_wins(
    param, profile, gpu_bf16, has_gpu, expected, source
):
    chosen = resolve_precision(param, profile, PROFILE if profile else None, gpu_bf16, has_gpu)
    assert chosen == PrecisionChoice(expected, source, None)


@pytest.mark.parametrize("param, profile", [("no", "bf16"), ("bf16", "fp16"), ("fp16", "no")])
def test_params_override_a_differing_profile_and_the_conflict_is_reported(param, profile):
    chosen = resolve_precision(param, profile, PROFILE, gpu_bf16=True, has_gpu=True)
    assert chosen.mixed_precision == param and chosen.source == "train.precision"
    assert chosen.conflict == (
        f"params.yaml train.precision {param!r} overrides mixed_precision {profile!r} of the accelerate profile "
        f"{PROFILE}; set train.precision: auto to use the profile's, or change the profile"
    )
    assert chosen.as_dict()["conflict"] == chosen.conflict


def test_profile_values_are_read_as_accelerate_writes_them():
    assert profile_mixed_precision({"mixed_precision": False}, PROFILE) == "no"  # bare `no` in YAML
    assert profile_mixed_precision({"mixed_precision": "BF16"}, PROFILE) == "bf16"
    assert profile_mixed_precision({}, PROFILE) is None
    with pytest.raises(FineflowError, match=f"accelerate profile {PROFILE}: mixed_precision 'fp8' is not supported"):
        profile_mixed_precision({"mixed_precision": "fp8"}, PROFILE)


@pytest.mark.parametrize(
    "profile, expected",
    [("auto", "no"), ("cpu_ddp_2proc", "no"), ("single_gpu", "bf16"), ("fsdp_lora", "bf16"), ("multi_node", "bf16")],
)
def test_the_shipped_profiles_decide_under_auto(profile, expected):
    assert choose_precision("auto", load_profile(profile), has_gpu=False).mixed_precision == expected


# ---------------------------------------------------------------- dtypes that follow


@pytest.mark.parametrize(
    "method, precision, sharding, dtype, storage",
    [
        ("lora", "bf16", "none", "bfloat16", "compute"),  # the base in the compute dtype, adapters fp32
        ("lora", "fp16", "zero2", "float16", "compute"),
        ("lora", "bf16", "zero3", "bfloat16", "compute"),
        ("lora", "bf16", "fsdp", "bfloat16", "compute"),  # FSDP2 (the shipped fsdp_lora): per-parameter shards
        ("lora", "no", "none", "float32", "compute"),
        ("full", "bf16", "none", "float32", "fp32"),  # autocast over fp32 weights, no master copy
        ("full", "bf16", "zero2", "float32", "compute"),  # DeepSpeed converts to 16 bits, fp32 masters
        ("qlora", "fp16", "none", "float16", "compute"),
    ],
)
def test_the_load_dtype_and_the_planners_layout_agree(method, precision, sharding, dtype, storage):
    assert base_dtype(method, precision, sharding) == dtype
    assert weight_storage(method, precision, sharding) == storage


def test_qlora_computes_in_the_runs_precision():
    assert quantization_kwargs("bf16")["bnb_4bit_compute_dtype"] == "bfloat16"
    assert quantization_kwargs("fp16")["bnb_4bit_compute_dtype"] == "float16"  # GPUs without bf16 (V100, T4)
    assert quantization_kwargs("no")["bnb_4bit_compute_dtype"] == "float32"
    from transformers import BitsAndBytesConfig  # what build_model builds from them (no bitsandbytes needed)

    config = BitsAndBytesConfig(**quantization_kwargs("fp16"))
    assert config.bnb_4bit_compute_dtype == torch.float16 and config.bnb_4bit_quant_type == "nf4"
    assert config.load_in_4bit and config.bnb_4bit_use_double_quant


@pytest.mark.parametrize("sharding", ["fsdp", "zero3"])
def test_qlora_with_sharded_weights_is_refused_with_what_to_do(sharding):
    with pytest.raises(FineflowError, match=f"qlora cannot run with the {sharding} accelerate profile p.yaml"):
        check_qlora_sharding("qlora", sharding, "p.yaml")
    check_qlora_sharding("qlora", "zero2", "p.yaml")
    check_qlora_sharding("lora", sharding, "p.yaml")


# ---------------------------------------------------------------- a real (tiny) base


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A saved tiny Llama with an untied lm_head (so QLoRA's layout has one to leave unquantized)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=400,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("precision-base")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _params(**train):
    from fineflow.core.config import parse_params

    return parse_params(_merge(TINY_PARAMS, {"train": {"device_memory_gib": 8, **train}}))


def _bytes_by_dtype(model) -> Counter:
    """numel x element_size of every parameter and buffer, per dtype (shared tensors once)."""
    seen, totals = set(), Counter()
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            totals[tensor.dtype] += tensor.numel() * tensor.element_size()
    return totals


@pytest.mark.parametrize("precision, base", [("auto", torch.float32), ("bf16", torch.bfloat16)])
def test_built_weights_match_the_planners_weight_term(base_dir, precision, base):
    """build_model through fit_plan as a rank runs them: on CPU, auto stays fp32 (CPU results unchanged) and bf16
    loads a bf16 base beside fp32 adapters; the planner's weight bytes are within 10% of the dtype accounting."""
    from fineflow.train.model import build_model

    run = _fit_plan(_params(precision=precision), str(base_dir))
    cfg, plan = run.train, run.memory
    model = build_model(str(base_dir), run.params, run.profile)
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    adapters = {p.dtype for p in model.parameters() if p.requires_grad}
    assert frozen == {base} and adapters == {torch.float32}
    measured = sum(_bytes_by_dtype(model).values())
    assert plan["bytes"]["weights"] == pytest.approx(measured, rel=0.10)
    assert plan["precision"]["mixed_precision"] == cfg.precision == ("no" if precision == "auto" else "bf16")


def test_the_qlora_layout_after_peft_kbit_preparation_matches_the_planner(base_dir):
    """Without bitsandbytes the 4-bit part is computed from the modules: what transformers would quantize (every
    linear but the ones get_keys_to_not_convert keeps) gets a stand-in parameter of peft's Params4bit class name
    holding the packed bytes. peft's real prepare_model_for_kbit_training then upcasts the rest to fp32 and
    re-enables checkpointing with fineflow's kwargs. Only a GPU confirms bitsandbytes' own storage."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.base import get_keys_to_not_convert

    class Params4bit(torch.nn.Parameter):  # peft tells 4-bit weights apart by this class name
        pass

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=getattr(torch, base_dtype("qlora", "bf16", "none")))
    keep = get_keys_to_not_convert(model)
    quantized = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not any(name == k or name.endswith("." + k) for k in keep):
            numel = module.weight.numel()
            packed = math.ceil(numel * planner.QLORA_BYTES_PER_PARAM)  # 4 bits + double-quantized constants
            module.weight = Params4bit(torch.zeros(packed, dtype=torch.uint8), requires_grad=False)
            quantized += numel
    assert "lm_head" in keep and quantized
    model.is_loaded_in_4bit = True
    model = prepare_model_for_kbit_training(model, **kbit_preparation_kwargs(True))

    totals = _bytes_by_dtype(model)
    assert set(totals) == {torch.uint8, torch.float32}  # nothing left in bf16: norms, embeddings, lm_head upcast
    shape = planner.shape_from_file(base_dir)
    setup = planner.Setup(method="qlora", precision="bf16")
    dequantize_buffer = shape.max_linear_params * 2
    adapters = planner.trainable_params(shape, setup) * planner.ADAPTER_BYTES
    predicted = planner.weight_bytes(shape, setup) - dequantize_buffer - adapters
    assert predicted == pytest.approx(sum(totals.values()), rel=0.10)
    assert quantized == shape.num_layers * shape.linear_params_per_layer
    # peft re-enabled gradient checkpointing with the non-reentrant variant, not torch's reentrant default
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert layers and all(m._gradient_checkpointing_func.keywords == {"use_reentrant": False} for m in layers)


def test_fused_lora_on_a_bf16_base_under_fp32_adapters_fuses_and_trains_alike(base_dir):
    """On a bf16 base peft keeps the adapters fp32; fused_lora still fuses every layer (computing in the autocast
    dtype, as autocast runs peft's linears), and the model trains like the unfused one under bf16 autocast."""
    from fineflow.train.model import build_model

    run = _fit_plan(_params(precision="bf16"), str(base_dir))
    fused, plain = (build_model(str(base_dir), run.params, run.profile, fuse_lora=f) for f in (True, False))
    assert fused.fineflow_fused_layers == 14  # 2 layers x 7 projections: every LoRA linear
    ids = torch.randint(1, 400, (2, 24), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (fused, plain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 400).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert grads and all(g is not None and g.dtype == torch.float32 and g.isfinite().all() for g in grads)
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1])


def test_fit_plan_reports_a_conflict_and_refuses_qlora_on_fsdp(base_dir):
    run = _fit_plan(_params(precision="no", accelerate_profile="multi_gpu_ddp", num_processes=None), str(base_dir))
    cfg, plan = run.train, run.memory
    assert cfg.precision == "no" and "overrides mixed_precision 'bf16'" in plan["precision"]["conflict"]
    run = _fit_plan(_params(accelerate_profile="multi_gpu_ddp", num_processes=None), str(base_dir))
    cfg, plan = run.train, run.memory
    assert cfg.precision == "bf16" and plan["precision"]["conflict"] is None
    assert plan["setup"]["precision"] == "bf16" and plan["setup"]["weight_storage"] == "compute"
    with pytest.raises(FineflowError, match="qlora cannot run with the fsdp accelerate profile"):
        _fit_plan(_params(method="qlora", accelerate_profile="fsdp_lora", num_processes=None), str(base_dir))


# ---------------------------------------------------------------- FSDP2 (issue 30, 5)


def test_fsdp2_keeps_the_lora_base_in_the_compute_dtype(tmp_path):
    """The shipped fsdp_lora profile is FSDP2: fully_shard needs one dtype among a group's *trainable* parameters
    only, so a bf16 base beside fp32 adapters is fine; FSDP1's flat parameters still need one dtype per unit."""
    from fineflow.train.precision import fsdp_version

    shipped = load_profile("fsdp_lora")
    assert fsdp_version(shipped) == 2
    assert base_dtype("lora", "bf16", "fsdp") == "bfloat16"
    assert weight_storage("lora", "bf16", "fsdp") == "compute"
    fsdp1 = tmp_path / "fsdp1.yaml"
    shipped_text = Path("configs/accelerate/fsdp_lora.yaml").read_text()
    fsdp1.write_text(shipped_text.replace("fsdp_version: 2", "fsdp_version: 1"))
    assert fsdp_version(load_profile(str(fsdp1))) == 1
    assert base_dtype("lora", "bf16", "fsdp", fsdp_version=1) == "float32"
    assert weight_storage("lora", "bf16", "fsdp", fsdp_version=1) == "fp32"


def test_fit_plan_under_the_fsdp_lora_profile_plans_a_16bit_base(base_dir):
    run = _fit_plan(_params(accelerate_profile="fsdp_lora", num_processes=None), str(base_dir))
    assert run.train.precision == "bf16" and run.memory["setup"]["weight_storage"] == "compute"
