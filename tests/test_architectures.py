"""fineflow.train.architecture on tiny random-initialised models of the real families (the same transformers
classes as Llama 3, Qwen2.5, Qwen3, Mistral, Gemma 2 / 3 and Phi-3): the decoder-layer class and the linears come
from the loaded model, the train stage's LoRA adapts every projection in each family's own names (Phi-3's fused
qkv_proj and gate_up_proj included), ``all-linear`` works everywhere, fused LoRA runs on fused linears, and the
FSDP wrap unit is each family's decoder layer without a class in the profile."""

from __future__ import annotations

import pytest
import torch

from fineflow.errors import FineflowError
from tests.families import FAMILIES, LLAMA_NAMES, TINY, tiny_model


def _train_params(target_modules):
    from fineflow.core.config import Params

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    train = {"precision": "no", "lora": {"r": 4, "target_modules": targets}}
    return Params.model_validate({"train": train})


def _build(tmp_path, family, target_modules=LLAMA_NAMES, fuse_lora: bool = False):
    """The train stage's build_model on a saved tiny base of the family."""
    from fineflow.train.model import build_model
    from fineflow.train.profile import Profile

    tiny_model(family).save_pretrained(tmp_path / family)
    return build_model(str(tmp_path / family), _train_params(target_modules), Profile(None), fuse_lora=fuse_lora)


def adapted(model) -> set[str]:
    """Leaf names of the linears that carry a LoRA adapter."""
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}


def _forward_backward(model) -> None:
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for n, p in model.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_layer_class_and_linears_come_from_the_model(family):
    from fineflow.train.architecture import describe

    _, _, layer_class, linears = FAMILIES[family]
    arch = describe(tiny_model(family))
    assert arch.layer_classes == (layer_class,)
    assert sorted(arch.linears) == sorted(linears)
    assert arch.fused_qkv == arch.fused_gate_up == (family == "phi3")


def test_a_config_alone_gives_the_same_without_weights():
    """What a planner can call before anything loads: the meta-device model's layer, linears and shapes."""
    from fineflow.train.architecture import describe, describe_config

    model = tiny_model("phi3")
    arch = describe_config(model.config)
    assert arch == describe(model)
    q_dim, kv_dim = (
        TINY["hidden_size"],
        TINY["hidden_size"] // TINY["num_attention_heads"] * TINY["num_key_value_heads"],
    )
    assert arch.shapes["qkv_proj"] == (TINY["hidden_size"], q_dim + 2 * kv_dim)
    assert arch.shapes["gate_up_proj"] == (TINY["hidden_size"], 2 * TINY["intermediate_size"])


def test_without_usable_no_split_modules_the_repeated_block_is_the_layer(monkeypatch):
    from fineflow.train.architecture import decoder_layer_classes

    model = tiny_model("qwen2.5")
    monkeypatch.setattr(model, "_no_split_modules", None)
    assert decoder_layer_classes(model) == ("Qwen2DecoderLayer",)
    monkeypatch.setattr(model, "_no_split_modules", {"Qwen2DecoderLayer", "Qwen2VisionBlock"})  # a class it lacks
    assert decoder_layer_classes(model) == ("Qwen2DecoderLayer",)


def test_seen_on_main_phi3_got_lora_on_half_its_projections(tmp_path):
    """On main, the default targets (Llama's names) on Phi-3 adapted o_proj and down_proj alone: peft dropped
    q/k/v_proj and gate/up_proj without a word, since two names matched. They stand for qkv_proj and gate_up_proj."""
    assert adapted(_build(tmp_path, "phi3")) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_train_stages_lora_adapts_every_projection_and_trains(tmp_path, family):
    model = _build(tmp_path, family, fuse_lora=True)
    assert adapted(model) == set(FAMILIES[family][3])
    assert model.fineflow_fused_layers == 2 * len(FAMILIES[family][3])  # fused LoRA on every one, fused or not
    _forward_backward(model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_all_linear_adapts_every_linear_but_the_head(tmp_path, family):
    """The params schema takes `target_modules: all-linear` (not only a list), and peft gets its keyword, not
    ["all-linear"], a module name."""
    model = _build(tmp_path, family, target_modules="all-linear")
    assert adapted(model) == set(FAMILIES[family][3])
    _forward_backward(model)


def test_a_target_the_model_lacks_is_refused_with_its_linears():
    from fineflow.train.architecture import lora_targets

    with pytest.raises(FineflowError, match=r"names 'c_attn'.*theirs are o_proj, qkv_proj, gate_up_proj, down_proj"):
        lora_targets(tiny_model("phi3"), ["o_proj", "c_attn"])
    assert lora_targets(tiny_model("phi3"), ["q_proj", "v_proj", "up_proj"]) == ["qkv_proj", "gate_up_proj"]


def test_fused_lora_on_phi3s_fused_qkv_computes_peft(tmp_path):
    """fused_lora treats each LoRA linear on its own, so Phi-3's qkv_proj is one fused target: same loss and
    gradients as peft's forward."""
    from fineflow.train.fused_lora import fuse_lora_layers
    from tests.test_fused_lora import _loss_and_grads

    reference, fused = (_build(tmp_path / str(i), "phi3") for i in (0, 1))
    for model in (reference, fused):
        for name, param in model.named_parameters():
            if "lora_B" in name:  # B starts at zero, which would hide an error in A's gradient
                torch.nn.init.normal_(param, std=0.1, generator=torch.Generator().manual_seed(hash(name) % 1000))
    assert fuse_lora_layers(fused) == 8
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    (ref_loss, ref_grads), (loss, grads) = _loss_and_grads(reference, ids), _loss_and_grads(fused, ids)
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and any("qkv_proj" in n for n in grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


# --- FSDP's wrap unit ----------------------------------------------------------------------------------------


def _wrap_policy_of_shipped_profile(model):
    """What accelerate 1.15 builds for FSDP2 from configs/accelerate/fsdp_lora.yaml's environment, after
    fineflow.train.fsdp set the classes: the policy fully_shard is applied with."""
    from types import SimpleNamespace

    import yaml
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from fineflow.train.fsdp import set_wrap_classes
    from tests.test_launch import PROFILE_DIR

    fsdp_config = yaml.safe_load((PROFILE_DIR / "fsdp_lora.yaml").read_text())["fsdp_config"]
    assert fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    named = fsdp_config.get("fsdp_transformer_layer_cls_to_wrap")
    plugin = SimpleNamespace(auto_wrap_policy=transformer_auto_wrap_policy, transformer_cls_names_to_wrap=named)
    set_wrap_classes(plugin, model)
    return fsdp2_prepare_auto_wrap_policy(plugin, model)


@pytest.mark.parametrize("family", ["qwen2.5", "mistral", "phi3", "gemma2"])
def test_the_shipped_fsdp_profile_wraps_each_familys_decoder_layer(tmp_path, family):
    model = _build(tmp_path, family)
    policy = _wrap_policy_of_shipped_profile(model)
    wrapped = {type(m).__name__ for m in model.modules() if policy(m)}
    assert wrapped == {FAMILIES[family][2]}
    assert sum(map(policy, model.modules())) == TINY["num_hidden_layers"]


def test_a_profile_naming_another_familys_layer_is_refused():
    from types import SimpleNamespace

    from fineflow.train.fsdp import set_wrap_classes

    plugin = SimpleNamespace(transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    with pytest.raises(FineflowError, match="names LlamaDecoderLayer.*decoder layer is Qwen2DecoderLayer"):
        set_wrap_classes(plugin, tiny_model("qwen2.5"))


# --- the train stage on a fused-qkv family ---------------------------------------------------------------------


@pytest.mark.slow
def test_the_train_stage_trains_phi3_with_lora_on_its_fused_linears(built, tmp_path):
    """The real train stage (one rank, the built shards) on a tiny Phi-3 base in place of the bundled Llama: the
    adapter covers qkv_proj, o_proj, gate_up_proj and down_proj, every one of them fused, and the loss falls."""
    import json

    from tests.conftest import finish_train, ranks_overrides, train_project

    project = train_project(built, tmp_path, ranks_overrides(1))
    vocab = json.loads((project / "models/base/config.json").read_text())["vocab_size"]
    for weights in (project / "models/base").glob("*.safetensors"):
        weights.unlink()
    (project / "models/base/config.json").unlink()
    phi3 = tiny_model("phi3")
    phi3.resize_token_embeddings(vocab)
    phi3.save_pretrained(project / "models/base")  # the bundled tokenizer stays
    finish_train(project, 1)
    adapter = json.loads((project / "models/candidate/adapter_config.json").read_text())
    assert adapter["target_modules"] == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    report = json.loads((project / "reports/train.json").read_text())
    assert report["fused_lora_layers"] == 2 * 4
    steps = [json.loads(line) for line in (project / "reports/train_steps.jsonl").read_text().splitlines()]
    losses = [s["loss"] for s in steps if "loss" in s]
    assert losses[-1] < losses[0]
