"""peft LoRA linears as one autograd op: y = x W^T + s (x A^T) B^T with the low-rank update accumulated in
place into the base GEMM's output (``addmm_``), and the backward written out by hand.

peft computes ``result + lora_B(lora_A(x)) * scaling``: besides the three GEMMs that is a scale pass and
an add pass over the (tokens x out_features) output, and autograd keeps them for backward too. Those
passes are memory-bound; for a narrow model on a CPU they cost as much as a GEMM (on the bundled
pipeline fused layers train 8-12% faster, bench/trl_compare.py). The maths is the same: loss equal and
gradients within float rounding of peft's (tests/test_fused_lora.py); adapters save and load with peft
as before, since the parameters are peft's own.

Each LoRA linear is fused on its own, whatever its name: a family whose q/k/v (or gate/up) are already one linear
(Phi-3's qkv_proj, gate_up_proj) has that linear fused as one target, with nothing to group.

Only the plain case is fused: a torch.nn.Linear base of the adapter's dtype (or a bf16/fp16 base under fp32
adapters, fused under autocast), one active adapter, no dropout, no DoRA/variant, not merged. Under autocast
(train.precision bf16/fp16) the op runs in the autocast dtype, as autocast would run the linear. Anything
else (adapters disabled or merged, parameters a sharding engine has not gathered) falls back to peft's
forward at call time.

    fuse_lora_layers(peft_model)  # -> how many layers were fused
"""

from __future__ import annotations

import types

import torch


class FusedLoraLinear(torch.autograd.Function):
    """y = linear(x, W, bias) + scaling * (x A^T) B^T; W and bias frozen."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        down = flat @ lora_a.t()  # (tokens, r): the only activation LoRA adds
        out = torch.nn.functional.linear(flat, weight, bias)
        out.addmm_(down, lora_b.t(), alpha=scaling)  # beta=1: the GEMM accumulates into out, no extra pass
        ctx.save_for_backward(flat, down, weight, lora_a, lora_b)
        ctx.scaling, ctx.shape = scaling, shape
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        flat, down, weight, lora_a, lora_b = ctx.saved_tensors
        scaling = ctx.scaling
        grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_down = grad @ lora_b  # (tokens, r), shared by dx and dA
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ weight).addmm_(grad_down, lora_a, alpha=scaling).view(ctx.shape)
        if ctx.needs_input_grad[3]:
            grad_a = (grad_down.t() @ flat).mul_(scaling)
        if ctx.needs_input_grad[4]:
            grad_b = (grad.t() @ down).mul_(scaling)
        return grad_x, None, None, grad_a, grad_b, None


def fusable(layer) -> bool:
    """Whether a peft LoRA layer is the plain case FusedLoraLinear computes exactly."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    if type(layer) is not LoraLinear or type(layer.base_layer) is not torch.nn.Linear:
        return False
    names = list(layer.lora_A.keys())
    if len(names) != 1 or layer.fan_in_fan_out or names[0] in getattr(layer, "lora_variant", {}):
        return False
    name = names[0]
    base, a, b = layer.base_layer.weight, layer.lora_A[name].weight, layer.lora_B[name].weight
    no_dropout = isinstance(layer.lora_dropout[name], torch.nn.Identity)
    # a base of the adapters' dtype, or a 16-bit base under fp32 adapters (LoRA on a GPU: peft keeps adapters fp32
    # on a bf16/fp16 base); the mixed case is fused under autocast only (_fused_forward)
    same_or_half = base.dtype == a.dtype or base.dtype in (torch.bfloat16, torch.float16)
    return no_dropout and layer.lora_B[name].bias is None and a.dtype == b.dtype and same_or_half


def _fused_forward(self, x, *args, **kwargs):
    name = next(iter(self.lora_A.keys()))
    base, bias = self.base_layer.weight, self.base_layer.bias
    a, b = self.lora_A[name].weight, self.lora_B[name].weight
    device_type = x.device.type
    autocast = torch.is_autocast_enabled(device_type)
    plain = (
        not args
        and not kwargs
        and not self.merged
        and not self.disable_adapters
        and list(self.active_adapters) == [name]
        and (autocast or x.dtype == base.dtype == a.dtype)  # mixed dtypes need autocast's casts
        and not base.requires_grad
        and (bias is None or not bias.requires_grad)
        and base.numel()
        and a.numel()
        and b.numel()
    )  # a sharding engine may hold them ungathered
    if not plain:
        return type(self).forward(self, x, *args, **kwargs)
    if autocast:
        # what autocast does for a linear: compute in its dtype; the casts are differentiable, so A and B
        # keep fp32 gradients
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return FusedLoraLinear.apply(
                x.to(dtype),
                base.to(dtype),
                None if bias is None else bias.to(dtype),
                a.to(dtype),
                b.to(dtype),
                self.scaling[name],
            )
    return FusedLoraLinear.apply(x, base, bias, a, b, self.scaling[name])


def fuse_lora_layers(model) -> int:
    """Route every fusable LoRA layer of a peft model through FusedLoraLinear; returns how many."""
    count = 0
    for module in model.modules():
        if fusable(module):
            module.forward = types.MethodType(_fused_forward, module)
            count += 1
    return count
