"""fineflow.train.fused_lora: the fused LoRA op computes peft's maths (values and gradients), falls back to peft
wherever it is not the plain case, and leaves saved adapters loadable by stock peft."""

import torch

from fineflow.train.fused_lora import FusedLoraLinear, fusable, fuse_lora_layers

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_fused_op_gradients_match_finite_differences():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    weight, bias = torch.randn(7, 6, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    lora_a = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    lora_b = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, a, b: FusedLoraLinear.apply(x, weight, bias, a, b, 1.7), (x, lora_a, lora_b)
    )
    expected = torch.nn.functional.linear(x, weight, bias) + 1.7 * (x @ lora_a.t()) @ lora_b.t()
    torch.testing.assert_close(FusedLoraLinear.apply(x, weight, bias, lora_a, lora_b, 1.7), expected)


def _lora_model(dropout: float = 0.0, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )
    from peft import LoraConfig, get_peft_model  # here, not at the top: peft's import costs ~10 s of collection

    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS, task_type="CAUSAL_LM")
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which would hide any error in A's gradient
            torch.nn.init.normal_(param, std=0.1)
    return model


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_fused_model_trains_like_peft():
    ids = torch.randint(1, 64, (3, 20), generator=torch.Generator().manual_seed(1))
    reference, fused = _lora_model(), _lora_model()
    assert fuse_lora_layers(fused) == 2 * len(TARGETS)  # every targeted linear of both layers
    ref_loss, ref_grads = _loss_and_grads(reference, ids)
    loss, grads = _loss_and_grads(fused, ids)
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and len(grads) == 4 * len(TARGETS)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_under_bf16_autocast_the_fused_op_matches_peft_at_bf16_precision(monkeypatch):
    import fineflow.train.fused_lora as fused_lora

    ids = torch.randint(1, 64, (3, 20), generator=torch.Generator().manual_seed(4))
    reference, fused = _lora_model(), _lora_model()
    fuse_lora_layers(fused)
    ran_in = []  # the dtype each fused call computed in: proves the fused path ran, not a fallback
    apply = fused_lora.FusedLoraLinear.apply
    monkeypatch.setattr(fused_lora.FusedLoraLinear, "apply", lambda x, *rest: ran_in.append(x.dtype) or apply(x, *rest))
    results = []
    for model in (reference, fused):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_loss_and_grads(model, ids))
    (ref_loss, ref_grads), (loss, grads) = results
    assert ran_in and set(ran_in) == {torch.bfloat16}
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    for name, grad in ref_grads.items():
        assert grads[name].dtype == torch.float32  # the adapters' master weights keep fp32 gradients
        # bf16 has 8 bits of mantissa: compare the gradients as directions, not elementwise
        cosine = torch.nn.functional.cosine_similarity(grads[name].flatten(), grad.flatten(), dim=0)
        assert cosine > 0.99, (name, float(cosine))


def test_layers_with_dropout_are_left_to_peft():
    model = _lora_model(dropout=0.1)
    assert not any(fusable(m) for m in model.modules())
    assert fuse_lora_layers(model) == 0


def test_disabled_and_merged_adapters_fall_back_to_peft():
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    reference, fused = _lora_model(), _lora_model()
    fuse_lora_layers(fused)
    with torch.no_grad():
        with reference.disable_adapter(), fused.disable_adapter():  # the base model alone
            torch.testing.assert_close(fused(input_ids=ids).logits, reference(input_ids=ids).logits)
        expected = reference(input_ids=ids).logits
        fused.merge_adapter()
        torch.testing.assert_close(fused(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)


def test_a_fused_adapter_saves_and_loads_with_stock_peft(tmp_path):
    from peft import PeftModel

    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    model = _lora_model()
    fuse_lora_layers(model)
    _, grads = _loss_and_grads(model, ids)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param -= 0.1 * grads[name]
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(_fresh_base(), tmp_path / "adapter")  # stock peft, nothing fused
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected)


def _fresh_base():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )
